"""The context-parallel ring's folding kernels (issue 16; acefuse/distributed/sharded.py
``_ring``, kernels.py ``fold_kernel``): each block's kernel takes the running states of the
blocks before it and folds its block into them with the derived merge in registers; a query
piece's last block writes the outputs. Checked on gloo ranks (forked, Triton's interpreter)
against the one-process kernel on the whole input and against the same ring merging in torch
(``ring_fold = False``: the partial kernel's states merged by ``_merge2``), for causal
attention, global attention, a strictly causal mask (row 0 sees no key: empty states fold
with the kernels' conventions), contractions that are not attention (the log-sum-exp of the
scores: no value axis; the variance of the scores: a merge reading the blocks' counts) and a row-family program (no fold hook: the torch merge, warned),
in float32 and bfloat16, on uneven contiguous shards and on the zig-zag layout.
"""
from __future__ import annotations

import pytest
import torch

import acefuse as af
from tests.test_distributed import run_ranks, SEED, dist   # noqa: F401 (dist: skips without gloo)

q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
s = af.sum(q * k, "d") * 0.25


def _attention(name, mask, lse=True):
    sc = af.where(mask, s, af.NEG_INF) if mask is not None else s
    m = af.max(sc, "j")
    p = af.exp(sc - m)
    l_ = af.sum(p, "j")
    outs = {"o": af.sum(p * v, "j") / l_}
    if lse:
        outs["lse"] = m + af.log(l_)
    return af.program(name, **outs)


ji, ii = af.index("j"), af.index("i")
ms_ = af.max(s, "j")
mu_s = af.sum(s, "j") / af.size("j")
PROGS = {
    "causal": _attention("ring_causal", ji <= ii),
    "global": _attention("ring_global", None, lse=False),
    "strict": _attention("ring_strict", ji < ii),      # row 0 sees no key: o = 0 (0/0), lse = -inf
    "score_lse": af.program("ring_score_lse", lse=ms_ + af.log(af.sum(af.exp(s - ms_), "j"))),
    # a merge that reads the blocks' counts (the folding kernel's carry_n input)
    "score_var": af.program("ring_score_var", var=af.sum((s - mu_s) * (s - mu_s), "j") / af.size("j")),
}
x = af.tensor("x", "r j")
mx_ = af.max(x, "j")
ROW = af.program("ring_row_lse", lse=mx_ + af.log(af.sum(af.exp(x - mx_), "j")))
_K: dict = {}


def kern(prog):
    if prog.name not in _K:
        _K[prog.name] = af.compile(prog)
    return _K[prog.name]


def _inputs(N, dtype, gen):
    B, H, D = 1, 2, 16
    return {"q": torch.randn(B, H, N, D, generator=gen).to(dtype), "k": (torch.randn(B, H, N, D, generator=gen) * 2).to(dtype),
            "v": torch.randn(B, H, N, D, generator=gen).to(dtype)}


def _ring_sk(kc):
    return next(sk for key, sk in kc.__dict__["_acefuse_sharded"].items() if key[2] == "ring")


def _on_rank(rank, world, layout, sizes, inputs, names, broken=False, states=False, run_opts=None):
    """Each program by the folding ring and by the torch-merge ring on this rank's shards,
    counting the folding kernels' launches and the torch merges each ran. ``broken``: the
    folding blocks drop the running states (the check must catch it); ``states``: the blocks
    fold, and the outputs are evaluated from the folded states in torch (the path of programs
    whose outputs the kernel's epilogue cannot write); ``run_opts``: launch options of every
    block kernel (split-KV: the folding kernel's combine folds the running states)."""
    from acefuse.distributed import sharded as sh, ring as rg
    if states:
        sh.ShardedKernel._fold_mode = lambda self: "states" if self.ring_fold else None
    calls = {"fold": 0, "merge": 0}
    run_fold, merge2 = sh.ShardedKernel._run_fold, rg._merge2

    def counted_fold(self, i, o, off, g, run, final):
        calls["fold"] += 1
        return run_fold(self, i, o, off, g, None if broken else run, final)

    def counted_merge(*a, **kw):
        calls["merge"] += 1
        return merge2(*a, **kw)
    sh.ShardedKernel._run_fold, rg._merge2 = counted_fold, counted_merge
    res = {}
    for dt, ins in inputs.items():
        for name in names:
            prog = PROGS[name]
            kc = kern(prog)
            if layout == "zigzag":
                n = sizes[rank]
                C = n // 2
                idx = torch.cat([torch.arange(rank * C, rank * C + C),
                                 torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
                loc = {t: ins[t][:, :, idx].contiguous() for t in prog.tensors}
                kw = dict(zigzag=("i",), shard_sizes=sizes)
            else:
                j0, n = sum(sizes[:rank]), sizes[rank]
                loc = {t: ins[t][:, :, j0:j0 + n].contiguous() for t in prog.tensors}
                kw = dict(axis_offsets={"i": j0}, axis_sizes={"i": sum(sizes)}, shard_sizes=sizes)
            out = {}
            for fold in (True, False):
                if not fold:
                    _ring_sk(kc).ring_fold = False
                before = dict(calls)
                r = kc(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring", **kw,
                       **(run_opts or {}))
                r = r if isinstance(r, dict) else {next(iter(prog.outputs)): r}
                out["fold" if fold else "torch"] = {o: x_.float() for o, x_ in r.items()}   # (bf16 -> float32: exact)
                out[f"calls_{fold}"] = {c: calls[c] - before[c] for c in calls}
            _ring_sk(kc).ring_fold = True
            res[f"{name}/{dt}"] = out
    return res


def _want(layout, sizes, world, rank, full):
    if layout == "zigzag":
        n = sizes[rank]
        C = n // 2
        idx = torch.cat([torch.arange(rank * C, rank * C + C),
                         torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
        return full[:, :, idx]
    j0 = sum(sizes[:rank])
    return full[:, :, j0:j0 + sizes[rank]]


# vs the one-process kernel; vs the torch-merge ring (measured: float32 within 1e-6, bfloat16
# mostly bitwise equal, at most one bfloat16 rounding step apart)
TOL = {"float32": dict(rtol=2e-5, atol=2e-5), "bfloat16": dict(rtol=8e-3, atol=8e-3)}
TOL_SAME = {"float32": dict(rtol=2e-6, atol=2e-6), "bfloat16": dict(rtol=8e-3, atol=8e-3)}


def _check(layout, sizes, names, dtypes, broken=False, states=False, run_opts=None):
    world = len(sizes)
    N = sum(sizes)
    gen = torch.Generator().manual_seed(SEED + 11)
    base = _inputs(N, torch.float32, gen)
    inputs = {str(dt).split(".")[-1]: {t: x_.to(dt) for t, x_ in base.items()} for dt in dtypes}
    fulls = {f"{n}/{dt}": kern(PROGS[n])(**{t: inputs[dt][t] for t in PROGS[n].tensors}) for n in names for dt in inputs}
    outs = run_ranks(_on_rank, world, layout, sizes, inputs, names, broken, states, run_opts)
    bad, merges = [], {}
    for rank, (res, warns) in enumerate(outs):
        assert not [w for w in warns if "DistributedFallbackWarning" in w], warns
        for key, out in res.items():
            dt = key.split("/")[1]
            full = fulls[key] if isinstance(fulls[key], dict) else {next(iter(PROGS[key.split('/')[0]].outputs)): fulls[key]}
            # the folding ring launched only folding kernels, the other merged in torch only
            assert out["calls_True"]["merge"] == 0 and out["calls_True"]["fold"] >= 1, (key, rank, out["calls_True"])
            assert out["calls_False"]["fold"] == 0, (key, rank, out["calls_False"])
            merges[key] = merges.get(key, 0) + out["calls_False"]["merge"]
            for o, got in out["fold"].items():
                want = _want(layout, sizes, world, rank, full[o])
                for what, a, b, tol in (("fold vs one process", got, want, TOL[dt]),
                                        ("fold vs torch merge", got, out["torch"][o], TOL_SAME[dt])):
                    try:
                        torch.testing.assert_close(a.float(), b.float(), **tol, equal_nan=False)
                    except AssertionError as exc:
                        bad.append(f"{key}.{o} rank {rank} {what} (seed {SEED}): {str(exc).splitlines()[:4]}")
    assert all(m > 0 for m in merges.values()), merges   # the torch merge ran on some rank
    return bad


def test_folding_ring_uneven_contiguous_shards():
    """3 ranks, shards of 7, 12 and 9 keys (queries sharded the same way, axis_offsets): every
    program and dtype by the folding ring equals the one-process kernel and the torch-merge ring."""
    bad = _check("contiguous", [7, 12, 9], list(PROGS), (torch.float32, torch.bfloat16))
    assert not bad, "\n".join(bad)


@pytest.mark.slow   # (19 s on 2 cores; the zigzag layout stays in the default run through the lookup-positions ring)
def test_folding_ring_zigzag():
    """2 ranks, the zig-zag layout (chunks r and 2W-1-r): causal and the strict mask."""
    bad = _check("zigzag", [12, 12], ["causal", "strict"], (torch.float32, torch.bfloat16))
    assert not bad, "\n".join(bad)


def test_folding_ring_with_outputs_evaluated_in_torch():
    """The blocks fold, the last one writes states, and the outputs come from them in torch."""
    bad = _check("contiguous", [7, 12, 9], ["causal", "strict"], (torch.float32,), states=True)
    assert not bad, "\n".join(bad)


def test_folding_ring_split_kv_blocks():
    """Block kernels launched split-KV (``schedule="split"``): their chunks start from nothing and
    the combine kernel folds the running states in with the derived merge (the loop kernel folds
    them in as its initial states instead). Causal attention and the variance of the scores (a
    merge reading counts), against the one-process kernel and the torch-merge ring."""
    bad = _check("contiguous", [7, 12, 9], ["causal", "score_var"], (torch.float32,),
                 run_opts=dict(schedule="split", nsplit=2, block_j=16))
    assert not bad, "\n".join(bad)


def test_a_fold_that_drops_the_running_states_is_caught():
    """The checks above fail when the folding blocks ignore the running states."""
    bad = _check("contiguous", [7, 12, 9], ["causal"], (torch.float32,), broken=True)
    assert any("fold vs one process" in b for b in bad), bad


def _row_on_rank(rank, world, sizes, X):
    j0, n = sum(sizes[:rank]), sizes[rank]
    kc = kern(ROW)
    out = kc(x=X[:, j0:j0 + n].contiguous(), process_group=dist.group.WORLD, sharded_axis="j", exchange="ring",
             shard_sizes=sizes)
    return {"out": out, "fold": [key for key in _ring_sk(kc)._kernels if key[0] == "fold"]}


def test_row_family_ring_merges_in_torch_with_a_warning():
    """A row-family program has no fold hook: the ring merges in torch (as before), says so
    once with a DistributedFallbackWarning, and is exact."""
    sizes = [5, 9, 6]
    gen = torch.Generator().manual_seed(SEED + 12)
    X = torch.randn(4, sum(sizes), generator=gen) * 3
    full = kern(ROW)(x=X)
    outs = run_ranks(_row_on_rank, len(sizes), sizes, X)
    for rank, (res, warns) in enumerate(outs):
        assert res["fold"] == [], res["fold"]
        assert [w for w in warns if "DistributedFallbackWarning" in w and "merges each block's states in torch" in w
                and "ring_row_lse" in w], warns
        torch.testing.assert_close(res["out"], full, rtol=2e-5, atol=2e-5)


# ---- the backward ring skips the blocks the forward's mask analysis excludes -------------------
def _grad_rank(rank, world, sizes, ins, cot, zigzag):
    from acefuse.distributed.grad import ShardedBackward
    from tests.test_distributed_grad import CAUSAL as CAUSAL_G, kernel as kernel_g
    skipped = {"n": 0}
    orig = ShardedBackward._skip

    def counted(self, *a, **kw):
        r = orig(self, *a, **kw)
        skipped["n"] += bool(r)
        return r
    ShardedBackward._skip = counted
    if zigzag:
        C = sizes[rank] // 2
        idx = torch.cat([torch.arange(rank * C, rank * C + C), torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
        kw = dict(zigzag=("i",))
    else:
        j0 = sum(sizes[:rank])
        idx = torch.arange(j0, j0 + sizes[rank])
        kw = dict(axis_offsets={"i": j0})
    res = {}
    for skip in (True, False):
        ShardedBackward.skip_masked = skip
        before = skipped["n"]
        loc = {t: ins[t][:, :, idx].contiguous().requires_grad_(True) for t in "qkv"}
        out = kernel_g(CAUSAL_G)(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring",
                                 shard_sizes=sizes, **kw)
        torch.autograd.backward([out], [cot[:, :, idx]])
        res[skip] = {t: loc[t].grad for t in "qkv"}
        res[f"skipped_{skip}"] = skipped["n"] - before
    ShardedBackward.skip_masked = True
    return {"idx": idx, **{str(k): v for k, v in res.items()}}


@pytest.mark.parametrize("sizes,zigzag", [([13, 6, 10], False),
                                          pytest.param([10, 10], True, marks=pytest.mark.slow)])   # (13 s)
def test_backward_ring_skips_fully_masked_blocks(sizes, zigzag):
    """Causal attention's backward ring skips the blocks above the diagonal (the forward's mask
    analysis proves them fully masked) and its gradients equal those with every block run and
    the one-process kernel's."""
    N = sum(sizes)
    gen = torch.Generator().manual_seed(SEED + 13)
    ins = _inputs(N, torch.float32, gen)
    cot = torch.randn(1, 2, N, 16, generator=gen)
    from tests.test_distributed_grad import CAUSAL as CAUSAL_G, kernel as kernel_g, _chunk_starts
    from acefuse.distributed.grad import prepare
    world = len(sizes)
    # derived here, not on the ranks (a fork inside egglog's or torch's threads can hang)
    starts = sorted({int(i[0]) for r in range(world) for i in _chunk_starts(r, world, sizes, zigzag)})
    prepare(kernel_g(CAUSAL_G), "j", distributed_axes=("i",), offsets=[{"i": a, "j": b} for a in starts for b in starts],
            sizes={"j": N})
    outs = run_ranks(_grad_rank, world, sizes, ins, cot, zigzag)
    full = {t: x_.clone().requires_grad_(True) for t, x_ in ins.items()}
    torch.autograd.backward([kernel_g(CAUSAL_G)(**full)], [cot])
    assert sum(r["skipped_True"] for r, _ in outs) > 0, [r["skipped_True"] for r, _ in outs]
    assert all(r["skipped_False"] == 0 for r, _ in outs)
    for rank, (r, _) in enumerate(outs):
        for t in "qkv":
            torch.testing.assert_close(r["True"][t], r["False"][t], rtol=0, atol=0,
                                       msg=lambda m: f"grad {t} rank {rank}: skipping changed it (seed {SEED}): {m}")
            torch.testing.assert_close(r["True"][t], full[t].grad[:, :, r["idx"]], rtol=2e-5, atol=2e-5,
                                       msg=lambda m: f"grad {t} rank {rank} vs one process (seed {SEED}): {m}")


def _tiles_on_rank(rank, world, sizes, ins):
    from acefuse.distributed import sharded as sh
    seen = []
    run_fold = sh.ShardedKernel._run_fold

    def spy(self, i, o, off, g, run, final):
        seen.append(dict(o))
        return run_fold(self, i, o, off, g, run, final)
    sh.ShardedKernel._run_fold = spy
    j0, n = sum(sizes[:rank]), sizes[rank]
    kc = kern(PROGS["causal"])
    loc = {t: ins[t][:, :, j0:j0 + n].contiguous() for t in PROGS["causal"].tensors}
    r = kc(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring",
           axis_offsets={"i": j0}, axis_sizes={"i": sum(sizes)}, shard_sizes=sizes)
    return {"out": {o: x_.float() for o, x_ in r.items()}, "seen": seen}


def test_ring_tiles_from_the_environment(monkeypatch):
    """ACEFUSE_RING_TILES fixes the launch options of every block kernel of the ring (one choice
    for all roles, nothing timed): each block saw them, and the result equals the one-process
    kernel's."""
    monkeypatch.setenv("ACEFUSE_RING_TILES", "block_i=16, block_j=16,num_warps=4,path=portable")
    sizes = [7, 12, 9]
    gen = torch.Generator().manual_seed(SEED + 12)
    ins = _inputs(sum(sizes), torch.float32, gen)
    full = kern(PROGS["causal"])(**{t: ins[t] for t in PROGS["causal"].tensors})
    want_opts = dict(block_i=16, block_j=16, num_warps=4, path="portable")
    for rank, (res, warns) in enumerate(run_ranks(_tiles_on_rank, len(sizes), sizes, ins)):
        assert res["seen"] and all(o == want_opts for o in res["seen"]), res["seen"]
        for o, got in res["out"].items():
            torch.testing.assert_close(got, _want("contiguous", sizes, len(sizes), rank, full[o]), **TOL["float32"])


@pytest.mark.parametrize("text,says", [("block_q=3", "block_i"), ("block_i=x", "not an integer"),
                                       ("path=tma", "hopper or portable"), ("block_i", "key=value")])
def test_ring_tiles_bad_setting_is_a_clear_error(text, says):
    from acefuse.distributed.ring import _parse_tiles
    from acefuse.distributed import DistributedError
    with pytest.raises(DistributedError, match=says):
        _parse_tiles(text, "p")


def _lookup_on_rank(rank, world, sizes, inputs, names):
    res = {}
    for dt, ins in inputs.items():
        for name in names:
            prog = PROGS[name]
            kc = kern(prog)
            C = sizes[rank] // 2
            idx = torch.cat([torch.arange(rank * C, rank * C + C),
                             torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
            loc = {t: ins[t][:, :, idx].contiguous() for t in prog.tensors}
            kc(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring", zigzag=("i",),
               shard_sizes=sizes)   # (creates the sharded kernel)
            sk = _ring_sk(kc)
            sk.ring_positions = "lookup"
            try:
                r = kc(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring", zigzag=("i",),
                       shard_sizes=sizes)
            finally:
                sk.ring_positions = None
            r = r if isinstance(r, dict) else {next(iter(prog.outputs)): r}
            res[f"{name}/{dt}"] = {"out": {o: x_.float() for o, x_ in r.items()},
                                   "lookup": sorted(str(key[1:3]) for key in sk._kernels if key[0] == "lfold"),
                                   "skipped": sum(1 for key, v in sk._kernels.items() if key[0] == "lmasked" and v)}
    return res


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])   # (3: 29 s on 2 cores)
def test_zigzag_ring_one_kernel_per_step_with_lookup_positions(world):
    """``ring_positions = "lookup"``: one block kernel per ring step (every local query against
    the whole visiting shard, global positions read from 1-D tensors) gives the one-process
    result on every rank (fails with the visiting shard's positions replaced by this rank's:
    checked by editing _ring_lookup)."""
    sizes = [8] * world
    N = sum(sizes)
    gen = torch.Generator().manual_seed(SEED + 13)
    base = _inputs(N, torch.float32, gen)
    names = ["causal", "strict", "global"]
    inputs = {str(dt).split(".")[-1]: {t: x_.to(dt) for t, x_ in base.items()} for dt in (torch.float32, torch.bfloat16)}
    fulls = {f"{n}/{dt}": kern(PROGS[n])(**{t: inputs[dt][t] for t in PROGS[n].tensors}) for n in names for dt in inputs}
    outs = run_ranks(_lookup_on_rank, world, sizes, inputs, names)
    for rank, (res, warns) in enumerate(outs):
        for key, r in res.items():
            assert r["lookup"], key   # the lookup path ran
            full = fulls[key] if isinstance(fulls[key], dict) else {next(iter(PROGS[key.split('/')[0]].outputs)): fulls[key]}
            for o, got in r["out"].items():
                want = _want("zigzag", sizes, world, rank, full[o])
                torch.testing.assert_close(got, want.float(), **TOL[key.split("/")[1]])
