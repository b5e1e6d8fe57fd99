"""Shared pieces of acefuse.distributed: errors, constants, and the instantiation of global
positions (``index(a)``, ``size(a)``) in terms."""
from __future__ import annotations

from acefuse.rewrite.terms import Term, num

J = Term("BJ")
A_, B_ = Term("BA"), Term("BB")
AB_ = Term("BU", (A_, B_))
EXCHANGES = ("auto", "states", "gather", "ring")
# launch options every kernel family takes (passed through to the local kernels)
RUN_KW = ("schedule", "block_i", "block_j", "block_r", "nsplit", "num_warps", "num_stages")


class DistributedError(ValueError):
    """A sharded call that cannot run as asked; the message names the program, the axis or
    the input, and what to do."""


class DistributedFallbackWarning(UserWarning):
    """A sharded program runs by gathering its sharded inputs (not by exchanging states)."""


# ---- the term-level instantiation of global positions -----------------------------------
def gpos(axis: str) -> str:
    """The name of the 0-d input tensor that holds the global position of a shard's first
    element along ``axis`` (a runtime argument of the per-shard kernels, see ``instantiate``)."""
    return f"gpos_{axis}"


def gpos_axis(axis: str) -> str:
    """The axis of ``gpos(axis)`` when it holds one global position per local element
    (``instantiate(..., runtime="lookup")``)."""
    return f"gpos_{axis}_n"


def gpos_inputs(offsets: dict, device=None) -> dict:
    """{gpos(a): 0-d float32 tensor holding offsets[a]}: the values a kernel instantiated with
    ``runtime=True`` reads. Exact: the mask analysis keeps integer bounds below 2**24 only."""
    import torch
    out = {}
    for a, v in offsets.items():
        key = (int(v), str(device))
        if key not in _GPOS:   # made once per value and device (on a GPU each is a copy from the host)
            _GPOS[key] = torch.tensor(float(int(v)), dtype=torch.float32, device=device)
        out[gpos(a)] = _GPOS[key]
    return out


_GPOS: dict = {}   # (offset, device) -> its 0-d float32 tensor (read-only: kernels only load it)


def instantiate(t: Term, offsets: dict, sizes: dict, count_j=None, runtime=False) -> Term:
    """``t`` with ``index(a)`` -> ``index(a) + offsets[a]``, ``size(a)`` -> ``sizes[a]`` and,
    when ``count_j`` is given, the whole axis's count ``Cnt(J)`` -> that number. The result is
    the same expression with its free leaves (positions, lengths) fixed: every derivation step
    proved over generic leaves still holds.

    ``runtime=True``: ``index(a)`` -> ``index(a) + gpos_a`` for every axis in ``offsets`` (its
    value unused), ``gpos_a`` a 0-d input tensor (``gpos``, ``gpos_inputs``): one kernel serves
    every offset (a ring visits W of them per rank, a zig-zag layout 2W), and the offset, one
    value per launch, is a point interval to the mask analysis (codegen/masks.py), so tiles a
    causal mask excludes are still skipped.

    ``runtime="lookup"``: ``index(a)`` -> ``gpos_a.at(index(a))``, ``gpos_a`` a 1-D input holding
    the global position of every local element (a zig-zag shard's two chunks in one kernel); the
    mask analysis bounds a lookup over each tile from the values it loads."""
    if t.op == "Idx" and t.args[0] in offsets and (runtime or offsets[t.args[0]]):
        if runtime == "lookup":   # the global position of each local element: a lookup (gpos_axis)
            return Term("Take", (gpos(t.args[0]), t, gpos_axis(t.args[0])))
        if runtime:
            return Term("Add", (t, Term("In", (gpos(t.args[0]),))))
        return Term("Add", (t, num(int(offsets[t.args[0]]))))
    if t.op == "Size" and t.args[0] in sizes:
        return num(int(sizes[t.args[0]]))
    if count_j is not None and t.op == "Cnt" and t.args[0].op == "BJ":
        return num(int(count_j))
    if not t.children:
        return t
    return Term(t.op, tuple(instantiate(a, offsets, sizes, count_j, runtime) if isinstance(a, Term) else a
                            for a in t.args))


def _device(inputs):
    """The device of the first tensor among ``inputs``' values (None if none)."""
    return next((v.device for v in inputs.values() if hasattr(v, "device")), None)


def _uses(terms, pred) -> bool:
    return any(pred(u) for t in terms for u in t.walk())


def ring_peers(group, rank: int, world: int) -> tuple:
    """(next, previous) rank of ``rank`` around the ring, as global ranks (what point-to-point
    calls take; a subgroup's rank r is ``dist.get_global_rank(group, r)``)."""
    import torch.distributed as dist

    def glob(r):
        if group is None or group is dist.group.WORLD:
            return r
        return dist.get_global_rank(group, r)
    return glob((rank + 1) % world), glob((rank - 1) % world)


def ring_shift(tensors: dict, nxt_rank: int, prv_rank: int, group) -> tuple:
    """Post one ring step: send each tensor to the next rank and receive the previous rank's
    into a new tensor of the same shape. Returns ({name: receiving tensor}, requests to wait on)."""
    import torch
    import torch.distributed as dist
    got, ops = {}, []
    for n, t in tensors.items():
        got[n] = torch.empty_like(t)
        ops.append(dist.P2POp(dist.isend, t, nxt_rank, group=group))
        ops.append(dist.P2POp(dist.irecv, got[n], prv_rank, group=group))
    return got, (dist.batch_isend_irecv(ops) if ops else [])


def count_input(n, device=None):
    """A 0-d float32 tensor holding the count ``n`` (the ring's running count of keys, a
    folding kernel's ``carry_n``), made once per value and device like ``gpos_inputs``'."""
    import torch
    key = ("n", int(n), str(device))
    if key not in _GPOS:
        _GPOS[key] = torch.tensor(float(int(n)), dtype=torch.float32, device=device)
    return _GPOS[key]
