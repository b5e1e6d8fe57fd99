"""Gradients of programs sharded across gloo ranks (acefuse/distributed/grad.py): the derived
backward on the shards, against float64 torch autograd of the plain math, unsharded.

Ranks are forked (tests/test_distributed.py's run_ranks); shards are uneven where the layout
allows it; inputs and cotangents are fresh random values (the seed is printed on failure).
"""
from __future__ import annotations

import pytest
import torch

import acefuse as af
from tests.test_distributed import run_ranks, SEED, dist

TOL = dict(rtol=1e-4, atol=1e-4)      # float32 kernels vs float64 autograd


# ---- programs and their plain torch math -------------------------------------------------
q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
SCALE = 0.25
s = af.sum(q * k, "d") * SCALE
sc = af.where(af.index("j") <= af.index("i"), s, af.NEG_INF)
mc = af.max(sc, "j")
pc = af.exp(sc - mc)
lc = af.sum(pc, "j")
CAUSAL = af.program("causal_attention_g", o=af.sum(pc * v, "j") / lc)
mg = af.max(s, "j")
pg_ = af.exp(s - mg)
GLOBAL = af.program("global_attention_g", o=af.sum(pg_ * v, "j") / af.sum(pg_, "j"))

x = af.tensor("x", "r j")
t = af.tensor("t", "r")
m = af.max(x, "j")
l_ = af.sum(af.exp(x - m), "j")
CE = af.program("vocab_ce_g", loss=m + af.log(l_) - af.take(x, t, "j"))
# of our own: a layer norm whose features are sharded (tensor parallel), with a weight over them
g = af.tensor("g", "j")
mu = af.mean(x, "j")
var = af.mean((x - mu) * (x - mu), "j")
LN = af.program("sharded_layernorm_g", y=(x - mu) * af.rsqrt(var + 1e-5) * g)


def attention_ref(ins, causal, lse):
    Q, K, V = (ins[n].double().requires_grad_(True) for n in "qkv")
    sc_ = torch.einsum("bhid,bhjd->bhij", Q, K) * SCALE
    if causal:
        N = sc_.shape[-1]
        sc_ = sc_.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    out = {"o": torch.softmax(sc_, -1) @ V}
    if lse:
        out["lse"] = torch.logsumexp(sc_, -1)
    return (Q, K, V), out


def ce_ref(ins):
    X = ins["x"].double().requires_grad_(True)
    return (X,), {"loss": torch.logsumexp(X, -1) - X.gather(1, ins["t"][:, None]).squeeze(1)}


def ln_ref(ins):
    X, G = ins["x"].double().requires_grad_(True), ins["g"].double().requires_grad_(True)
    mu_ = X.mean(-1, keepdim=True)
    var_ = ((X - mu_) ** 2).mean(-1, keepdim=True)
    return (X, G), {"y": (X - mu_) * torch.rsqrt(var_ + 1e-5) * G}


def ref_grads(leaves, outs, cots):
    names = list(outs)
    return torch.autograd.grad([outs[n] for n in names], list(leaves), [cots[n].double() for n in names])


_KERNELS: dict = {}


def kernel(prog):
    if prog.name not in _KERNELS:
        _KERNELS[prog.name] = af.compile(prog)
    return _KERNELS[prog.name]


def _sl(x, axis_dim, idx):
    return x.index_select(axis_dim, idx).contiguous()


# ---- on the ranks ------------------------------------------------------------------------
def _attention_rank(rank, world, prog_name, ins, cots, sizes, exchange, zigzag, offsets_i, broken=False):
    prog = {"causal": CAUSAL, "global": GLOBAL}[prog_name]
    if broken:
        from acefuse.distributed.grad import ShardedBackward
        ShardedBackward.send_home = False
    idx = _layout(rank, world, sizes, zigzag)
    loc = {n: _sl(ins[n], 2, idx).requires_grad_(True) for n in "qkv"}
    kw = dict(process_group=dist.group.WORLD, sharded_axis="j", exchange=exchange, shard_sizes=sizes)
    if zigzag:
        kw["zigzag"] = ("i",)
    elif offsets_i:
        kw["axis_offsets"] = {"i": sum(sizes[:rank])}
    out = kernel(prog)(**loc, **kw)
    out = out if isinstance(out, dict) else {"o": out}
    torch.autograd.backward([out[o] for o in out], [_sl(cots[o], 2, idx) for o in out])
    return {n: loc[n].grad for n in "qkv"}


def _layout(rank, world, sizes, zigzag):
    if zigzag:
        c = sizes[0] // 2
        return torch.cat([torch.arange(rank * c, rank * c + c), torch.arange((2 * world - 1 - rank) * c,
                                                                               (2 * world - rank) * c)])
    j0 = sum(sizes[:rank])
    return torch.arange(j0, j0 + sizes[rank])


def _chunk_starts(rank, world, sizes, zigzag):
    if zigzag:
        c = sizes[0] // 2
        return [(rank * c,), ((2 * world - 1 - rank) * c,)]
    return [(sum(sizes[:rank]),)]


def _check(got, want, name, what):
    assert got is not None, f"{what}: no gradient for {name}"
    assert torch.isfinite(got).all(), f"{what}: non-finite gradient of {name} (seed {SEED})"
    torch.testing.assert_close(got.double(), want, **TOL, msg=lambda m_: f"{what}: grad {name} (seed {SEED}): {m_}")


def attention_case(prog_name, sizes, exchange, zigzag=False, heads=2, D=16, broken=False):
    world = len(sizes)
    N = sum(sizes)
    gen = torch.Generator().manual_seed(SEED + hash((prog_name, exchange, zigzag)) % 1000)
    ins = {"q": torch.randn(1, heads, N, D, generator=gen), "k": torch.randn(1, heads, N, D, generator=gen),
           "v": torch.randn(1, heads, N, D, generator=gen)}
    causal = prog_name == "causal"
    cots = {"o": torch.randn(1, heads, N, D, generator=gen)}
    from acefuse.distributed.grad import prepare
    # derived here, not on the ranks (every block's global offsets)
    starts = sorted({int(i[0]) for r in range(world) for i in _chunk_starts(r, world, sizes, zigzag)})
    prepare(kernel(CAUSAL if causal else GLOBAL), "j", distributed_axes=("i",),
            offsets=[{"i": a, "j": b} for a in starts for b in starts], sizes={"j": N})
    res = run_ranks(_attention_rank, world, prog_name, ins, cots, sizes, exchange, zigzag, True, broken)
    # the references after the ranks: a fork after torch's threaded kernels can hang the child
    leaves, outs = attention_ref(ins, causal, False)
    want = dict(zip("qkv", ref_grads(leaves, outs, cots)))
    for rank, (got, warns) in enumerate(res):
        idx = _layout(rank, world, sizes, zigzag)
        for n in "qkv":
            _check(got[n], want[n].index_select(2, idx), n, f"{prog_name} {exchange} zigzag={zigzag} rank {rank}")
    return res


@pytest.mark.parametrize("exchange", ["ring", "gather"])
def test_causal_attention_context_parallel_gradients(exchange):
    attention_case("causal", [13, 6, 10], exchange)


def test_causal_attention_zigzag_gradients():
    attention_case("causal", [10, 10], "ring", zigzag=True)


def test_global_attention_gradients_all_gather():
    attention_case("global", [9, 12], "gather")


# ---- vocab-parallel cross-entropy and a sharded layer norm (states exchanged) -----------------
def _rows_rank(rank, world, name, ins, cots, sizes):
    prog = {"ce": CE, "ln": LN}[name]
    j0, n = sum(sizes[:rank]), sizes[rank]
    loc = {"x": ins["x"][:, j0:j0 + n].contiguous().requires_grad_(True)}
    if name == "ce":
        loc["t"] = ins["t"]
    else:
        loc["g"] = ins["g"][j0:j0 + n].contiguous().requires_grad_(True)
    out = kernel(prog)(**loc, process_group=dist.group.WORLD, sharded_axis="j", shard_sizes=sizes)
    (oname,) = prog.outputs
    cot = cots[oname] if name == "ce" else cots[oname][:, j0:j0 + n]
    out.backward(cot)
    return {k_: v_.grad for k_, v_ in loc.items() if v_.dtype.is_floating_point}


def rows_case(name, sizes, R=5):
    from acefuse.distributed.grad import prepare
    world, N = len(sizes), sum(sizes)
    gen = torch.Generator().manual_seed(SEED + (7 if name == "ce" else 8))
    X = torch.randn(R, N, generator=gen) * 3
    X[0] += 30.0
    ins = {"x": X, "t": torch.randint(0, N, (R,), generator=gen), "g": torch.rand(N, generator=gen) + 0.5}
    cots = {"loss": torch.randn(R, generator=gen), "y": torch.randn(R, N, generator=gen)}
    prog = CE if name == "ce" else LN
    starts = [sum(sizes[:r]) for r in range(world)]
    prepare(kernel(prog), "j", offsets=[{"j": s_} for s_ in starts], sizes={"j": N})
    res = run_ranks(_rows_rank, world, name, ins, cots, sizes)
    leaves, outs = ce_ref(ins) if name == "ce" else ln_ref(ins)
    want = ref_grads(leaves, outs, cots if name == "ce" else {"y": cots["y"]})
    for rank, (got, _) in enumerate(res):
        j0, n = starts[rank], sizes[rank]
        _check(got["x"], want[0][:, j0:j0 + n], "x", f"{name} rank {rank}")
        if name == "ln":
            _check(got["g"], want[1][j0:j0 + n], "g", f"{name} rank {rank}")
    return res


def test_vocab_parallel_cross_entropy_gradients():
    rows_case("ce", [11, 4, 16])


def test_sharded_layernorm_gradients():
    """Features sharded: the backward's sums over features are partial on each rank (hoisted
    and all-reduced); the weight's gradient, a sum over the rows, is local to its shard."""
    rows_case("ln", [7, 13])


def test_a_broken_reverse_ring_fails_the_check():
    """Without the last hops of the reverse ring the key/value gradients stay on the wrong
    rank: the comparison above must catch it."""
    with pytest.raises(AssertionError, match="grad k"):
        attention_case("global", [6, 5], "ring", broken=True)


def test_block_offsets_share_one_kernel():
    """The backward's programs at every block offset are one kernel each: the offset is a
    runtime input (``gpos_j``), so a ring compiles (and a GPU times: 13-24 s per sum kernel)
    each program once, not once per offset it visits."""
    from acefuse.distributed.grad import prepare, _RUNNERS
    plan = prepare(kernel(CE), "j", offsets=[{"j": 0}, {"j": 11}, {"j": 20}], sizes={"j": 31})
    runner = next(r for r in _RUNNERS.values() if r.plan is plan)
    shifted = 0
    for p in plan.progs:
        keys = [key for key in runner._kernels if key[0] == id(p)]
        # the plain program (no offset) and at most one with the offset an input
        assert len(keys) <= 2, (p.program.name, keys)
        for key in keys:
            if key[1]:
                shifted += 1
                assert "gpos_j" in runner._kernels[key].fusion.encoding.tensors, key
    assert shifted >= 1, "no backward program reads index(j)"


def test_offset_kernels_keep_the_mask_analysis():
    """A backward program whose kernel would skip fewer masked tiles with the offsets as
    runtime inputs (the sum kernel's mask analysis takes no 0-d input yet) keeps constant
    offsets: every block's kernel holds as many mask analyses as the unshifted program's.
    The others take the offsets as inputs: one kernel for every block."""
    from acefuse.distributed.grad import prepare, _RUNNERS, _mask_marks
    offsets = [{"i": 10, "j": 0}, {"i": 0, "j": 10}, {"i": 5, "j": 5}]
    plan = prepare(kernel(CAUSAL), "j", distributed_axes=("i",), offsets=offsets, sizes={"i": 20, "j": 20})
    runner = next(r for r in _RUNNERS.values() if r.plan is plan)
    shared = 0
    for p in plan.progs:
        base = runner._kernels[(id(p), (), ())]
        ks = [runner._kernel(p, o, {"i": 20, "j": 20}) for o in offsets]
        for o, k in zip(offsets, ks):
            assert _mask_marks(k) >= _mask_marks(base), (p.program.name, o)
        shared += len({id(k) for k in ks}) == 1
    assert any(_mask_marks(runner._kernels[(id(p), (), ())]) for p in plan.progs), "no mask analysis to keep"
    assert shared >= 1, "no backward program takes the offsets as inputs"


def test_constant_offset_kernels_share_one_timing(monkeypatch):
    """Where a backward program keeps constant offsets (a runtime-offset kernel that would lose mask
    analysis; no stage of causal attention does since the sum kernel bounds 0-d inputs, so the
    count of skip marks is patched here to force the fallback), its per-offset kernels read and
    write the plain kernel's table of timed launch choices (a GPU times a sum kernel's
    configurations for 13-24 s), while the kernels themselves differ."""
    import acefuse.distributed.grad as grad_mod
    from acefuse.distributed.grad import prepare, _RUNNERS
    real = grad_mod._mask_marks
    monkeypatch.setattr(grad_mod, "_mask_marks", lambda k: real(k) - ("gpos_" in k.source))
    _RUNNERS.clear()
    offsets = [{"i": 10, "j": 0}, {"i": 0, "j": 10}]
    plan = prepare(kernel(CAUSAL), "j", distributed_axes=("i",), offsets=offsets, sizes={"i": 20, "j": 20})
    runner = next(r for r in _RUNNERS.values() if r.plan is plan)
    shared = 0
    for p in plan.progs:
        ks = [k for key, k in runner._kernels.items() if key[0] == id(p) and key[1] == "constants"]
        if not ks:
            continue
        mods = [runner._kernels[(id(p), (), ())].module] + [k.module for k in ks]
        assert len({id(m) for m in mods}) == len(mods)
        assert len({id(m._TUNED) for m in mods}) == 1, p.program.name
        shared += 1
    assert shared >= 1, "no program keeps constant offsets (then this test is moot: remove it)"
