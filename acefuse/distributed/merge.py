"""Evaluating the derived merge (and outputs read from merged states) on state tensors with
torch, with the kernels' numerics conventions; folding partial states in a tree."""
from __future__ import annotations

from acefuse.rewrite.terms import Term, reblock, pretty
from acefuse.distributed.base import DistributedError
from acefuse.extract.simulate import KernelEval


# ---- evaluating merges and finalisations on state tensors -------------------------------
_FUNCS = {"Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Abs": "abs", "Tanh": "tanh", "Erf": "erf",
          "Sigmoid": "sigmoid", "Log1p": "log1p", "Expm1": "expm1", "Floor": "floor", "Ceil": "ceil",
          "Round": "round", "Rsqrt": "rsqrt"}
_CMP = {"CmpLt": "lt", "CmpLe": "le", "CmpGt": "gt", "CmpGe": "ge", "CmpEq": "eq", "CmpNe": "ne"}
_ARITH = {"Add", "Sub", "Mul", "Div", "Neg", "Max2", "Min2", "Pow", "Where", "LAnd", "LOr", "LNot",
          "Softplus", "FloorDiv", "Mod"} | set(_FUNCS) | set(_CMP)
MERGE_OPS = frozenset({"Num", "St", "Cnt", "Size", "BA", "BB", "BU", "BJ"} | _ARITH)
OUTPUT_OPS = frozenset(MERGE_OPS | {"In", "Idx", "Take"})


_CONSTS: dict = {}
_ROW_ONLY: dict = {}


def _blk_key(blk: Term) -> str:
    if blk.op == "BU":
        return _blk_key(blk.args[0]) + _blk_key(blk.args[1])
    return {"BA": "A", "BB": "B", "BJ": "J"}[blk.op]


class StateEval(KernelEval):
    """Evaluates merge forms and outputs on state tensors with torch, following the kernels'
    conventions with extract/simulate.py's evaluator (``KernelEval``: a per-row value built
    from a max, a min or a log that is -inf reads as 0 where it is subtracted; a min that is
    +inf reads as 0 where it is added; a division whose denominator comes from a reduction
    gives 0 for 0/0).

    Values are tensors laid out over ``P`` (the parallel axes, program order) with a leading
    batch dimension (partial states merged side by side); an axis a value does not range over
    has length 1."""

    LEAVES = frozenset({"Num", "Cnt", "Size", "Idx", "In", "Take"})

    def __init__(self, enc, P, env, counts, sizes, inputs=None, offsets=None, takes=None, local=None):
        self.defs = {s.name: s for s in enc.states}
        self.tensors = enc.tensors
        self.P = list(P)
        self.env = env                  # (state, block key) -> tensor
        self.counts = counts            # block key -> tensor (or number)
        self.sizes = sizes              # axis -> global length (size(a))
        self.inputs = inputs or {}      # input name -> local tensor (parallel axes only)
        self.offsets = offsets or {}
        self.takes = takes or {}        # Take term -> tensor
        self.local = local or {}        # axis -> local length (for index(a))
        self._memo = {}
        self._ext = None

    @property
    def xp(self):
        import torch
        return torch

    def row_only(self, t) -> bool:
        """emit's ``_row_only`` (a per-row value built from a max, min or log), memoised per
        term and set of extremum states: the walk is the same at every call."""
        from acefuse.codegen.emit import _row_only
        if self._ext is None:
            self._ext = frozenset(q for q in self.defs if self.is_ext(q))
        key = (t, self._ext)
        r = _ROW_ONLY.get(key)
        if r is None:
            r = _ROW_ONLY[key] = _row_only(t, self._ext.__contains__)
        return r

    def _const(self, v):
        import torch
        ref = next(iter(self.env.values()))
        key = (float(v), ref.dtype, ref.device)
        c = _CONSTS.get(key)
        if c is None:   # made once: a constant on the GPU is a host-to-device copy
            c = _CONSTS[key] = torch.tensor(float(v), dtype=ref.dtype, device=ref.device)
        return c

    def layout(self, x, axes):
        """A tensor over ``axes`` (a subset of P, in P order) laid out over [1, *P]."""
        shape = [1] + [x.shape[list(axes).index(a)] if a in axes else 1 for a in self.P]
        return x.reshape(shape)

    def state(self, q, blk):
        k = (q, _blk_key(blk))
        if k in self.env:
            return self.env[k]
        d = self.defs.get(q)
        if d is not None and d.op == "ref":
            if k not in self._memo:
                self._memo[k] = self.ev(reblock(d.definition, blk))
            return self._memo[k]
        raise DistributedError(f"state {q} over block {_blk_key(blk)} is not available to the merge "
                               "(an acefuse bug, please report the program)")

    def _zero_where(self, cond, v):
        import torch
        return torch.where(cond, torch.zeros_like(v), v)

    def _from_bool(self, mask, like):
        return mask.to(like.dtype)

    def _leaf(self, t: Term, elems):
        import torch
        op = t.op
        if op == "Num":
            return self._const(t.args[0])
        if op == "Cnt":
            c = self.counts[_blk_key(t.args[0])]
            return c if isinstance(c, torch.Tensor) else self._const(c)
        if op == "Size":
            return self._const(self.sizes[t.args[0]])
        if op == "Idx":
            a = t.args[0]
            ref = next(iter(self.env.values()))
            x = torch.arange(self.local[a], device=ref.device, dtype=ref.dtype) + self.offsets.get(a, 0)
            return self.layout(x, (a,))
        if op == "In":
            name = t.args[0]
            x = self.inputs[name]
            ref = next(iter(self.env.values()))
            return self.layout(x.to(ref.dtype), self.tensors[name])
        return self.takes[t]    # Take

    def _func(self, op, t: Term, kids):
        import torch
        a = kids[0]
        b = kids[1] if len(kids) > 1 else None
        if op in _FUNCS:
            return getattr(torch, _FUNCS[op])(a)
        if op == "Softplus":
            return torch.logaddexp(torch.zeros_like(a), a)
        if op == "Pow":
            return torch.pow(a, float(t.args[1]))
        if op in _CMP:
            return getattr(torch, _CMP[op])(a, b).to(a.dtype if a.is_floating_point() else b.dtype)
        if op == "FloorDiv":
            return torch.where(b == 0, torch.full_like(a, float("nan")), torch.floor(a / b))
        if op == "Mod":
            return torch.where(b == 0, torch.full_like(a, float("nan")), a - torch.floor(a / b) * b)
        raise DistributedError(f"no evaluation of operator {op} in `{pretty(t)}` across ranks")


def _merge2(enc, p, P, A: dict, B: dict, n_a, n_b, sizes):
    """One application of the derived merge to batches of partial states: ``A``, ``B``:
    {state: tensor [K, *P]}, counts [K, 1, ...]. Returns the states of the unions."""
    env = {}
    for q, v in A.items():
        env[(q, "A")] = v
    for q, v in B.items():
        env[(q, "B")] = v
    ev = StateEval(enc, P, env, {"A": n_a, "B": n_b, "AB": n_a + n_b}, sizes)
    for s in p.states:          # update order: a later merge may read an earlier state over A u B
        env[(s.name, "AB")] = ev.ev(p.merge[s.name])
    return {s.name: env[(s.name, "AB")] for s in p.states}


def merge_tree(enc, p, P, states: dict, counts, sizes):
    """Fold K partial states ({state: [K, *P]}, counts [K, 1, ...]) with the derived merge in
    a balanced tree (each level merges neighbours side by side). Returns {state: [1, *P]}."""
    import torch
    while counts.shape[0] > 1:
        k = counts.shape[0]
        even = k - k % 2
        merged = _merge2(enc, p, P, {q: v[0:even:2] for q, v in states.items()},
                         {q: v[1:even:2] for q, v in states.items()}, counts[0:even:2], counts[1:even:2], sizes)
        n = counts[0:even:2] + counts[1:even:2]
        if k % 2:
            merged = {q: torch.cat([merged[q], states[q][even:]]) for q in merged}
            n = torch.cat([n, counts[even:]])
        states, counts = merged, n
    return states


def merge_bracketed(enc, p, P, states: dict, counts, sizes, bracketing):
    """Fold partial states in the order a nested tuple of indices says (``((0, 1), 2)``:
    left to right; ``(0, (1, 2))``: right first). For checking associativity."""
    def go(b):
        if isinstance(b, int):
            return {q: v[b:b + 1] for q, v in states.items()}, counts[b:b + 1]
        (sa, na), (sb, nb) = go(b[0]), go(b[1])
        return _merge2(enc, p, P, sa, sb, na, nb, sizes), na + nb
    return go(bracketing)[0]
