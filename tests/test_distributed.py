"""Programs sharded along their fused axis across gloo ranks (acefuse/distributed.py).

The ranks are forked processes (each initialises a gloo process group through a temporary
file), so they inherit the kernels compiled once here and TRITON_INTERPRET=1 (each rank
checks it). Shards are uneven. Every sharded result is compared with the single-process
kernel on the whole input (tight tolerance: only the order of float32 merges differs) and
with the independent float64 reference (acefuse.reference), on fresh random inputs.
"""
from __future__ import annotations

import os
import tempfile
import traceback
import warnings

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.reference import evaluate

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():   # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

SEED = int(np.random.SeedSequence().entropy % (2 ** 31))
TOL_KERNEL = dict(rtol=2e-5, atol=2e-5)    # sharded vs one-process kernel (merge order only)
TOL_F64 = dict(rtol=2e-4, atol=2e-4)       # vs the float64 reference


# ---- ranks ------------------------------------------------------------------------------
def _plain(o):
    """Tensors as numpy arrays (a tensor sent through a queue is a shared-memory handle that
    dies with the rank), back to tensors with ``_torch``."""
    if isinstance(o, torch.Tensor):
        return ("__tensor__", o.detach().cpu().numpy())
    if isinstance(o, dict):
        return {k: _plain(v) for k, v in o.items()}
    return o


def _torch(o):
    if isinstance(o, tuple) and len(o) == 2 and o[0] == "__tensor__":
        return torch.from_numpy(o[1])
    if isinstance(o, dict):
        return {k: _torch(v) for k, v in o.items()}
    return o


def _rank_main(fn, rank, world, init, queue, args):
    try:
        torch.set_num_threads(1)
        assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), \
            "a forked rank did not inherit TRITON_INTERPRET=1"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                out = fn(rank, world, *args)
            queue.put((rank, "ok", _plain(out), [f"{x.category.__name__}: {x.message}" for x in w]))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", traceback.format_exc(), []))


def run_ranks(fn, world, *args, timeout=240):
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; [(result, warnings)] by rank."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    fd, path = tempfile.mkstemp(prefix="acefuse_dist_")
    os.close(fd)
    os.unlink(path)
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, "file://" + path, q, args)) for r in range(world)]
    import gc
    gc.collect()
    gc.freeze()     # the ranks' collections skip the parent's objects (no copy-on-write of the whole heap)
    for p in procs:
        p.start()
    gc.unfreeze()
    got = {}
    try:
        for _ in range(world):
            rank, status, out, warns = q.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed (seed {SEED}):\n{out}")
            got[rank] = (_torch(out), warns)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(path):
            os.unlink(path)
    return [got[r] for r in range(world)]


def shard(x, axes, axis, sizes, rank):
    if axis not in axes:
        return x
    j0 = sum(sizes[:rank])
    return x.narrow(axes.index(axis), j0, sizes[rank]).contiguous()


def _dict(out, prog):
    return out if isinstance(out, dict) else {next(iter(prog.outputs)): out}


def check(prog, outs, full, inputs, sizes, axis="j", **extra_shard):
    """Each rank's outputs vs the one-process kernel ``full`` and the float64 reference."""
    ref = evaluate(prog, inputs)
    for rank, (out, _) in enumerate(outs):
        out = _dict(out, prog)
        for o, e in prog.outputs.items():
            want_k = _dict(full, prog)[o]
            want_r = torch.as_tensor(np.array(ref[o], dtype=np.float64))
            for ax, (starts, lens) in extra_shard.items():
                if ax in e.axes:
                    want_k = want_k.narrow(e.axes.index(ax), starts[rank], lens[rank])
                    want_r = want_r.narrow(e.axes.index(ax), starts[rank], lens[rank])
            if axis in e.axes:
                want_k = shard(want_k, e.axes, axis, sizes, rank)
                want_r = shard(want_r, e.axes, axis, sizes, rank)
            got = out[o]
            assert got.shape == want_k.shape, (prog.name, o, rank, got.shape, want_k.shape)
            assert torch.isfinite(got).all(), (prog.name, o, rank, SEED)
            torch.testing.assert_close(got.float(), want_k.float(), **TOL_KERNEL,
                                       msg=lambda m: f"{prog.name}.{o} rank {rank} vs one process (seed {SEED}): {m}")
            torch.testing.assert_close(got.double(), want_r.double(), **TOL_F64,
                                       msg=lambda m: f"{prog.name}.{o} rank {rank} vs float64 (seed {SEED}): {m}")


# ---- programs ---------------------------------------------------------------------------
from tests.programs import x, t, m, e, l, mu, var   # noqa: E402 (the row-wise pieces)
g = af.tensor("g", "j")
jx = af.index("j")
ROWS = {
    "vocab_ce": af.program("vocab_ce", loss=m + af.log(l) - af.take(x, t, "j")),
    "softmax": af.program("softmax", y=e / l, lse=m + af.log(l)),
    "layernorm": af.program("layernorm", y=(x - mu) * af.rsqrt(var + 1e-5) * g, var=var),
    # index arithmetic and the length of the sharded axis: need each rank's global offset
    "index_mask": af.program("index_mask", y=af.sum(af.where(jx % 3 == 0, x, 0.0) * (jx + 1.0), "j")
                             / af.size("j")),
}

q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
s = af.sum(q * k, "d") * 0.25
sc = af.where(af.index("j") <= af.index("i"), s, af.NEG_INF)
mc = af.max(sc, "j")
pc = af.exp(sc - mc)
lc = af.sum(pc, "j")
CAUSAL = af.program("causal_attention", o=af.sum(pc * v, "j") / lc, lse=mc + af.log(lc))
md = af.max(s, "j")
pd = af.exp(s - md)
DECODE = af.program("decode_attention", o=af.sum(pd * v, "j") / af.sum(pd, "j"))

_KERNELS: dict = {}


def kernel(prog):
    if prog.name not in _KERNELS:
        _KERNELS[prog.name] = af.compile(prog)
    return _KERNELS[prog.name]


def row_inputs(gen, R, N):
    X = torch.randn(R, N, generator=gen) * 3
    X[0] += 40.0                     # a row far from zero (the max shift matters)
    return {"x": X, "t": torch.randint(0, N, (R,), generator=gen), "g": torch.rand(N, generator=gen) + 0.5}


# ---- workloads on the ranks ---------------------------------------------------------------
def _rows_on_rank(rank, world, sizes, inputs, names, pass_sizes):
    pg = dist.group.WORLD
    res = {}
    for name in names:
        prog = ROWS[name]
        kern = kernel(prog)
        loc = {n: shard(inputs[n], prog.tensors[n], "j", sizes, rank) for n in prog.tensors}
        kw = {"shard_sizes": sizes} if pass_sizes else {}
        res[name] = kern(**loc, process_group=pg, sharded_axis="j", **kw)
    return res


@pytest.mark.parametrize("sizes,pass_sizes", [([9, 4, 14], False), ([5, 12], True)])
def test_row_workloads_match_one_process(sizes, pass_sizes):
    gen = torch.Generator().manual_seed(SEED)
    inputs = row_inputs(gen, 6, sum(sizes))
    names = list(ROWS)
    fulls = {n: kernel(ROWS[n])(**{t_: inputs[t_] for t_ in ROWS[n].tensors}) for n in names}
    outs = run_ranks(_rows_on_rank, len(sizes), sizes, inputs, names, pass_sizes)
    for rank_out, warns in outs:
        assert not [w for w in warns if "DistributedFallbackWarning" in w], warns   # states, not data
    for n in names:
        prog = ROWS[n]
        check(prog, [(o[n], w) for o, w in outs], fulls[n], {t_: inputs[t_] for t_ in prog.tensors}, sizes)


def _attention_on_rank(rank, world, sizes, ins_dec, ins_cp):
    pg = dist.group.WORLD
    j0, n = sum(sizes[:rank]), sizes[rank]
    kd = kernel(DECODE)
    dec = kd(q=ins_dec["q"], k=ins_dec["k"][:, :, j0:j0 + n], v=ins_dec["v"][:, :, j0:j0 + n],
             process_group=pg, sharded_axis="j")
    kc = kernel(CAUSAL)
    loc = {t_: ins_cp[t_][:, :, j0:j0 + n].contiguous() for t_ in ("q", "k", "v")}
    cp = {ex: kc(**loc, process_group=pg, sharded_axis="j", exchange=ex, axis_offsets={"i": j0},
                 shard_sizes=sizes) for ex in ("gather", "ring")}
    ring = next(sk for key, sk in kc.__dict__["_acefuse_sharded"].items() if key[2] == "ring")
    skipped = sum(1 for key, v in ring._kernels.items() if key[0] == "masked" and v is True)
    return {"decode": dec, "cp": cp, "skipped": skipped}


def test_sharded_kv_decode_and_context_parallel_prefill():
    sizes = [23, 9, 16]
    N = sum(sizes)
    gen = torch.Generator().manual_seed(SEED + 1)
    B, H, D, E = 1, 2, 16, 16
    ins_dec = {"q": torch.randn(B, H, 1, D, generator=gen), "k": torch.randn(B, H, N, D, generator=gen) * 2,
               "v": torch.randn(B, H, N, E, generator=gen)}
    ins_cp = {"q": torch.randn(B, H, N, D, generator=gen), "k": torch.randn(B, H, N, D, generator=gen),
              "v": torch.randn(B, H, N, E, generator=gen)}
    full_dec = kernel(DECODE)(**ins_dec)
    full_cp = kernel(CAUSAL)(**ins_cp)
    outs = run_ranks(_attention_on_rank, len(sizes), sizes, ins_dec, ins_cp)
    for _, warns in outs:
        assert not [w for w in warns if "DistributedFallbackWarning" in w], warns
    check(DECODE, [(o["decode"], w) for o, w in outs], full_dec, ins_dec, sizes)
    # the ring skips key shards the causal mask excludes entirely (rank 0: the two later
    # shards; the last rank: none), and the results above still match
    assert [o["skipped"] for o, _ in outs] == [2, 1, 0], [o["skipped"] for o, _ in outs]
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    for ex in ("gather", "ring"):
        check(CAUSAL, [(o["cp"][ex], w) for o, w in outs], full_cp, ins_cp, sizes, i=(starts, sizes))


def _zigzag_on_rank(rank, world, n, ins):
    C = n // 2
    idx = torch.cat([torch.arange(rank * C, rank * C + C), torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
    loc = {t_: ins[t_][:, :, idx].contiguous() for t_ in ("q", "k", "v")}
    kc = kernel(CAUSAL)
    return {ex: kc(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange=ex, zigzag=("i",),
                   shard_sizes=[n] * world) for ex in ("gather", "ring")}


def test_context_parallel_zigzag_layout():
    """Rank r holds chunks r and 2W-1-r of the sequence (queries, keys and values): causal
    work is balanced; each query chunk sees its global offset."""
    world, n = 2, 12
    N = world * n
    gen = torch.Generator().manual_seed(SEED + 5)
    ins = {"q": torch.randn(1, 2, N, 16, generator=gen), "k": torch.randn(1, 2, N, 16, generator=gen),
           "v": torch.randn(1, 2, N, 16, generator=gen)}
    full = kernel(CAUSAL)(**ins)
    ref = evaluate(CAUSAL, ins)
    outs = run_ranks(_zigzag_on_rank, world, n, ins)
    C = n // 2
    for rank, (res, _) in enumerate(outs):
        idx = torch.cat([torch.arange(rank * C, rank * C + C),
                         torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
        for ex, out in res.items():
            for o in CAUSAL.outputs:
                torch.testing.assert_close(out[o], full[o][:, :, idx], **TOL_KERNEL,
                                           msg=lambda m: f"zig-zag {ex} {o} rank {rank} (seed {SEED}): {m}")
                want = torch.as_tensor(np.array(ref[o], dtype=np.float64))[:, :, idx]
                torch.testing.assert_close(out[o].double(), want, **TOL_F64)


def _zigzag_ring_counting(rank, world, n, ins):
    """The zig-zag ring on this rank, counting the kernels the sharded flow generates by role."""
    from acefuse.distributed import kernels as dk
    counts: dict = {}
    load = dk._load

    def counting(lf, src, role, extra):
        counts[role] = counts.get(role, 0) + 1
        return load(lf, src, role, extra)
    dk._load = counting
    try:
        C = n // 2
        idx = torch.cat([torch.arange(rank * C, rank * C + C),
                         torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
        loc = {t_: ins[t_][:, :, idx].contiguous() for t_ in ("q", "k", "v")}
        out = kernel(CAUSAL)(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring",
                             zigzag=("i",), shard_sizes=[n] * world)
        again = kernel(CAUSAL)(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring",
                               zigzag=("i",), shard_sizes=[n] * world)
    finally:
        dk._load = load
    sk = next(v for key, v in kernel(CAUSAL).__dict__["_acefuse_sharded"].items() if key[2] == "ring")
    src = open(next(k for key, k in sk._kernels.items() if key[0] == "partial").path).read()
    return {"out": out, "again": again, "counts": counts, "src": src}


def test_zigzag_ring_compiles_each_kernel_once():
    """A zig-zag ring over 3 ranks visits 2 x 6 (query chunk, key chunk) blocks per rank at 5
    distinct pairs of global offsets; the offsets are runtime inputs of one kernel per role
    (a piece's first block, a folding block, a folding last block; compiled once per rank,
    not once per pair), whose source still skips the key tiles the
    causal mask excludes (the offsets are point intervals to the mask analysis). Outputs match
    the one-process kernel and float64."""
    world, n = 3, 10
    N = world * n
    gen = torch.Generator().manual_seed(SEED + 7)
    ins = {"q": torch.randn(1, 2, N, 16, generator=gen), "k": torch.randn(1, 2, N, 16, generator=gen),
           "v": torch.randn(1, 2, N, 16, generator=gen)}
    full = kernel(CAUSAL)(**ins)
    ref = evaluate(CAUSAL, ins)
    outs = run_ranks(_zigzag_ring_counting, world, n, ins)
    C = n // 2
    for rank, (res, _) in enumerate(outs):
        # one kernel per role (the block kernels fold the running states in, rank 0's first
        # piece has one block only: 'final1'), each compiled once over both calls
        assert set(res["counts"]) <= {"partial", "fold", "foldfinal", "final1"}, (rank, res["counts"])
        assert set(res["counts"].values()) == {1}, (rank, res["counts"])
        src = res["src"]
        assert "gpos_j_ptr" in src and "gpos_i_ptr" in src
        assert "tiles the mask excludes entirely (skipped)" in src
        assert "(j_lo + tl.load(gpos_j_ptr).to(tl.float32))" in src, "the offset is not a point interval"
        idx = torch.cat([torch.arange(rank * C, rank * C + C),
                         torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
        for got in (res["out"], res["again"]):
            for o in CAUSAL.outputs:
                torch.testing.assert_close(got[o], full[o][:, :, idx], **TOL_KERNEL,
                                           msg=lambda m: f"zig-zag ring {o} rank {rank} (seed {SEED}): {m}")
                want = torch.as_tensor(np.array(ref[o], dtype=np.float64))[:, :, idx]
                torch.testing.assert_close(got[o].double(), want, **TOL_F64)


@pytest.mark.parametrize("n_i,n_j,bi,bj", [(13, 17, 4, 5), (8, 24, 8, 3)])
def test_runtime_offsets_are_exact_point_intervals(n_i, n_j, bi, bj):
    """The mask analysis of the partial kernel with runtime offsets (gpos_i, gpos_j: 0-d inputs)
    classifies every (query tile, key tile) exactly as brute force over the causal mask
    j + gpos_j <= i + gpos_i does, at offsets on both sides of the diagonal: skipped where no
    pair is visible, run without the mask where every pair is."""
    from acefuse.codegen.masks import tile_stats
    from acefuse.distributed import partial_kernel
    f = kernel(CAUSAL).fusion
    names = {s_.name: f"state_{s_.name}" for s_ in f.encoding.states}
    pk = partial_kernel(f, {"i": 0, "j": 0}, {}, names)
    rng = np.random.default_rng(SEED)
    for oi, oj in [(0, 0), (30, 0), (0, 30), (7, 3)] + [tuple(int(v) for v in rng.integers(0, 40, 2)) for _ in range(4)]:
        st = tile_stats(pk.fusion, {"i": n_i, "j": n_j, "b": 1, "h": 1, "d": 16, "e": 16}, block_i=bi, block_j=bj,
                        data={"gpos_i": np.array([float(oi)]), "gpos_j": np.array([float(oj)])})
        skipped = full = total = 0
        for i0 in range(0, n_i, bi):
            ii = np.arange(i0, min(i0 + bi, n_i))[:, None] + oi
            for j0 in range(0, n_j, bj):
                jj = np.arange(j0, min(j0 + bj, n_j))[None, :] + oj
                vis = jj <= ii
                total += 1
                skipped += int(not vis.any())
                full += int(vis.all())
        assert st["tiles"] == total
        assert st["skipped"] == skipped / total, (oi, oj, st, skipped / total)
        assert st["full"] == full / total, (oi, oj, st, full / total)


# ---- the merge: associativity on random partial states ------------------------------------
def _partials(prog, inputs, axis, bounds, axes_p):
    """Partial states of every block [b0, b1) of the fused axis, computed by the sharded
    flow's own partial kernel, as float64 tensors laid out over the parallel axes."""
    from acefuse.distributed import partial_kernel, state_axes
    kern = kernel(prog)
    f = kern.fusion
    p = f.passes[0]
    names = {s_.name: f"state_{s_.name}" for s_ in f.encoding.states}
    sax = state_axes(f)
    parts = []
    for b0, b1 in bounds:
        loc = {n: (inputs[n].narrow(prog.tensors[n].index(axis), b0, b1 - b0).contiguous()
                   if axis in prog.tensors[n] else inputs[n]) for n in prog.tensors}
        pk = partial_kernel(f, {}, {}, names)
        loc = {n: t_ for n, t_ in loc.items() if n in pk.fusion.encoding.tensors}
        out = pk(**loc, out_dtypes={names[s_.name]: torch.float32 for s_ in p.states})
        out = out if isinstance(out, dict) else {names[p.states[0].name]: out}
        st = {}
        for s_ in p.states:
            val = out[names[s_.name]].double()
            shape = [val.shape[sax[s_.name].index(a)] if a in sax[s_.name] else 1 for a in axes_p]
            st[s_.name] = val.reshape([1] + shape)
        parts.append(st)
    return f, parts


def _random_bracketing(idx, rng):
    if len(idx) == 1:
        return idx[0]
    cut = int(rng.integers(1, len(idx)))
    return (_random_bracketing(idx[:cut], rng), _random_bracketing(idx[cut:], rng))


@pytest.mark.parametrize("name", ["softmax", "layernorm", "decode"])
def test_derived_merge_is_associative_on_random_partials(name):
    from acefuse.distributed import merge_tree, merge_bracketed
    rng = np.random.default_rng(SEED + 2)
    gen = torch.Generator().manual_seed(SEED + 2)
    if name == "decode":
        prog, N = DECODE, 61
        inputs = {"q": torch.randn(1, 2, 3, 16, generator=gen), "k": torch.randn(1, 2, N, 16, generator=gen) * 2,
                  "v": torch.randn(1, 2, N, 16, generator=gen)}
    else:
        prog, N = ROWS[name], 61
        inputs = {n: v_ for n, v_ in row_inputs(gen, 5, N).items() if n in ROWS[name].tensors}
    cuts = sorted(rng.choice(np.arange(1, N), size=5, replace=False).tolist())
    bounds = list(zip([0] + cuts, cuts + [N]))
    axes_p = [a for a in kernel(prog).fusion.program.axes if a != "j"]
    f, parts = _partials(prog, inputs, "j", bounds, axes_p)
    p, enc = f.passes[0], f.encoding
    stacked = {q_: torch.cat([pp[q_] for pp in parts]) for q_ in parts[0]}
    counts = torch.tensor([b1 - b0 for b0, b1 in bounds], dtype=torch.float64).reshape([-1] + [1] * len(axes_p))
    sizes = {"j": N}
    tree = merge_tree(enc, p, axes_p, stacked, counts, sizes)
    idx = list(range(len(bounds)))
    left = idx[0]
    for i in idx[1:]:
        left = (left, i)
    right = idx[-1]
    for i in reversed(idx[:-1]):
        right = (i, right)
    orders = [left, right] + [_random_bracketing(idx, rng) for _ in range(3)]
    # the states of the whole axis, one block, from the same kernel (float32)
    _, whole = _partials(prog, inputs, "j", [(0, N)], axes_p)
    for q_ in tree:
        for br in orders:
            other = merge_bracketed(enc, p, axes_p, stacked, counts, sizes, br)
            torch.testing.assert_close(other[q_], tree[q_], rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name}: state {q_}, bracketing {br} vs tree (seed {SEED}): {m}")
        torch.testing.assert_close(tree[q_], whole[0][q_], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: merged {q_} vs one block (seed {SEED}): {m}")


def test_a_wrong_merge_breaks_the_check():
    """The associativity/whole-block check fails when the merge is wrong (a missing
    correction factor), so the test above can fail."""
    from acefuse.distributed import merge_tree
    from acefuse.rewrite.terms import Term
    gen = torch.Generator().manual_seed(SEED + 3)
    prog, N = ROWS["softmax"], 40
    inputs = {"x": row_inputs(gen, 4, N)["x"]}
    bounds = [(0, 13), (13, 30), (30, 40)]
    f, parts = _partials(prog, inputs, "j", bounds, ["r"])
    p = f.passes[0]
    s_name = next(s_.name for s_ in p.states if s_.op == "sum")
    wrong = Term("Add", (Term("St", (s_name, Term("BA"))), Term("St", (s_name, Term("BB")))))   # no rescale
    bad = type(p)(p.index, p.states, p.refs, init=p.init, rolling=p.rolling, merge=dict(p.merge, **{s_name: wrong}))
    stacked = {q_: torch.cat([pp[q_] for pp in parts]) for q_ in parts[0]}
    counts = torch.tensor([13.0, 17.0, 10.0], dtype=torch.float64).reshape(-1, 1)
    _, whole = _partials(prog, inputs, "j", [(0, N)], ["r"])
    good = merge_tree(f.encoding, p, ["r"], stacked, counts, {"j": N})
    torch.testing.assert_close(good[s_name], whole[0][s_name], rtol=1e-5, atol=1e-5)
    got = merge_tree(f.encoding, bad, ["r"], stacked, counts, {"j": N})
    assert not torch.allclose(got[s_name], whole[0][s_name], rtol=1e-3, atol=1e-3)


# ---- bad input, fallbacks, gradients -----------------------------------------------------
NOT_FUSIBLE = af.program("mad", out=af.sum(af.abs(x - mu), "j"))
CE_MEAN = af.program("ce_mean", loss=af.mean(m + af.log(l) - af.take(x, t, "j"), "r"))


def _errors_on_rank(rank, world, sizes, inputs):
    from acefuse.distributed import DistributedError
    pg = dist.group.WORLD
    res = {}
    ks = kernel(ROWS["softmax"])
    loc = shard(inputs["x"], ("r", "j"), "j", sizes, rank)

    def err(fn):
        try:
            fn()
        except DistributedError as ex:
            return str(ex)
        return None
    res["wrong_axis"] = err(lambda: ks(x=loc, process_group=pg, sharded_axis="r"))
    res["no_axis"] = err(lambda: ks(x=loc, process_group=pg))
    res["bad_sizes_len"] = err(lambda: ks(x=loc, process_group=pg, sharded_axis="j", shard_sizes=[sizes[0]]))
    res["bad_sizes_val"] = err(lambda: ks(x=loc, process_group=pg, sharded_axis="j",
                                          shard_sizes=[n + 1 for n in sizes]))
    # the other axis differs across ranks: found by the exchange of shapes, on every rank
    rows = loc if rank == 0 else loc[:-1]
    res["mismatch"] = err(lambda: ks(x=rows.contiguous(), process_group=pg, sharded_axis="j"))
    xg = loc.clone().requires_grad_(True)
    res["grad"] = err(lambda: ks(x=xg, process_group=pg, sharded_axis="j"))
    with torch.no_grad():
        res["no_grad"] = ks(x=xg, process_group=pg, sharded_axis="j")
    # a group of one rank: the kernel on the local data
    groups = [dist.new_group([r]) for r in range(world)]   # every rank creates every group
    solo = groups[rank]
    res["solo"] = ks(x=loc, process_group=solo, sharded_axis="j")
    res["solo_ref"] = ks(x=loc)
    # not fusible in one pass: the sharded inputs are gathered (with a warning), still correct
    res["mad"] = kernel(NOT_FUSIBLE)(x=loc, process_group=pg, sharded_axis="j")
    res["states_only"] = err(lambda: kernel(NOT_FUSIBLE)(x=loc, process_group=pg, sharded_axis="j",
                                                         exchange="states"))
    res["zigzag_rows"] = err(lambda: ks(x=loc, process_group=pg, sharded_axis="j", zigzag=("r",),
                                        shard_sizes=sizes))
    # a reduction over rows of the per-row losses (two stages): stage 1 sharded, stage 2 local
    res["ce_mean"] = kernel(CE_MEAN)(x=loc, t=inputs["t"], process_group=pg, sharded_axis="j")
    return res


def test_bad_input_fallbacks_and_gradients():
    sizes = [11, 6]
    gen = torch.Generator().manual_seed(SEED + 4)
    inputs = row_inputs(gen, 5, sum(sizes))
    full_soft = kernel(ROWS["softmax"])(x=inputs["x"])
    full_mad = kernel(NOT_FUSIBLE)(x=inputs["x"])          # compiled here, before the ranks fork
    full_ce = kernel(CE_MEAN)(x=inputs["x"], t=inputs["t"])
    from acefuse.distributed import prepare_backward
    prepare_backward(kernel(ROWS["softmax"]), "j")      # derived here: the ranks are forked
    outs = run_ranks(_errors_on_rank, len(sizes), sizes, inputs)
    for rank, (res, warns) in enumerate(outs):
        assert "sharded_axis 'r'" in res["wrong_axis"] and "fused axis 'j'" in res["wrong_axis"]
        assert "needs sharded_axis=" in res["no_axis"]
        assert "shard_sizes has 1 entries" in res["bad_sizes_len"]
        assert "shard_sizes says" in res["bad_sizes_val"]
        assert "axis 'r' has lengths [5, 4]" in res["mismatch"], res["mismatch"]
        assert res["grad"] is None, res["grad"]   # differentiable now (tests/test_distributed_grad.py)
        torch.testing.assert_close(res["no_grad"]["y"], shard(full_soft["y"], ("r", "j"), "j", sizes, rank),
                                   **TOL_KERNEL)
        torch.testing.assert_close(res["solo"]["y"], res["solo_ref"]["y"], rtol=0, atol=0)
        assert any("DistributedFallbackWarning" in w and "'mad'" in w for w in warns), warns
        assert "exchange='states' is not possible" in res["states_only"] and "passes" in res["states_only"]
        assert "zigzag=('r',) needs exchange='ring' or 'gather'" in res["zigzag_rows"], res["zigzag_rows"]
    check(NOT_FUSIBLE, [(o["mad"], w) for o, w in outs], full_mad, {"x": inputs["x"]}, sizes)
    check(CE_MEAN, [(o["ce_mean"], w) for o, w in outs], full_ce, {"x": inputs["x"], "t": inputs["t"]}, sizes)


def test_compile_with_process_group_needs_torch_distributed():
    """``af.compile(prog, process_group=..., sharded_axis=...)`` builds the sharded kernel,
    which says what is missing when torch.distributed is not initialised (this process)."""
    from acefuse.distributed import DistributedError
    assert not dist.is_initialized()
    with pytest.raises(DistributedError, match="torch.distributed initialised"):
        af.compile(ROWS["softmax"], process_group=None, sharded_axis="j")
    with pytest.raises(DistributedError, match="torch.distributed initialised"):
        kernel(ROWS["softmax"])(x=torch.randn(2, 5), process_group=None, sharded_axis="j")
