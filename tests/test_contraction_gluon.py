"""The EXPERIMENTAL Gluon Hopper kernel of the contraction family (codegen/contraction_gluon.py).

CPU: the generated source is deterministic, names no workload, compiles for sm_90 offline
(when this Triton ships Gluon), and programs outside phase 1 get a clear error.
GPU (sm_90, marked gpu): the kernel against float64 torch on fresh random bfloat16 inputs,
plain and masked scores at odd and power-of-two lengths, and derived score variants.

    python -m pytest -q tests/test_contraction_gluon.py -p no:cacheprovider
"""
import importlib.util
import math
import os
import re

import pytest
import torch

import acefuse as af
from acefuse.codegen.emit import CodegenError
from acefuse.codegen.contraction_gluon import gluon_source

D = 128
SCALE = 1.0 / math.sqrt(D)
CAP = 20.0
BAND = 300
LAG = 700
q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
slope = af.tensor("slope", "h")
seg = af.tensor("seg", "b n")   # integer segment ids
i, j = af.index("i"), af.index("j")


def _prog(name, s):
    m = af.max(s, "j")
    p = af.exp(s - m)
    return af.program(name, o=af.sum(p * v, "j") / af.sum(p, "j"))


score = af.sum(q * k, "d") * SCALE
PROGS = {   # neutral names: the source must not get a workload's name from the program
    "p_plain": lambda: _prog("p_plain", score),
    "p_lower": lambda: _prog("p_lower", af.where(j <= i, score, af.NEG_INF)),
    "p_cap": lambda: _prog("p_cap", CAP * af.tanh(score / CAP)),
    "p_slope": lambda: _prog("p_slope", af.where(j <= i, score + slope * (j - i), af.NEG_INF)),
    # a band: tiles skipped before and after it (the loop starts past key 0)
    "p_band": lambda: _prog("p_band", af.where((j <= i) & (i - j < BAND), score, af.NEG_INF)),
    # rows below LAG see no key: their output is 0 (the template's empty-row convention)
    "p_lag": lambda: _prog("p_lag", af.where(j <= i - LAG, score, af.NEG_INF)),
    # a mask from data: a segment id per position read by lookups (the scan loads key tiles' ids)
    "p_seg": lambda: _prog("p_seg", af.where(seg.at(n=i).eq(seg.at(n=j)) & (j <= i), score, af.NEG_INF)),
}
WORKLOADS = ("softmax", "attention", "attn", "flash", "causal", "alibi", "softcap", "window", "welford",
             "decode", "prefill")


@pytest.fixture(scope="module")
def sources():
    src = {n: gluon_source(mk()) for n, mk in PROGS.items()}
    src.update({n + "_ov": gluon_source(PROGS[n](), overlap=True) for n in ("p_plain", "p_lower", "p_band")})
    src.update({n + "_ws": gluon_source(PROGS[n](), ws=True) for n in ("p_plain", "p_lower", "p_band", "p_cap")})
    src.update({n + "_wspp": gluon_source(PROGS[n](), ws=True, pingpong=True) for n in ("p_plain", "p_lower")})
    src.update({n + "_wsov": gluon_source(PROGS[n](), ws=True, overlap=True) for n in ("p_plain", "p_lower")})
    return src


def test_source_is_deterministic(sources):
    for n in ("p_plain", "p_lower"):
        assert gluon_source(PROGS[n]()) == sources[n], n


def test_source_names_no_workload(sources):
    for n, src in sources.items():
        low = src.lower()
        hits = [w for w in WORKLOADS if w in low]
        assert not hits, f"{n}: the Gluon source names {hits}"


def test_source_structure(sources):
    src = sources["p_lower"]
    # both contractions are warpgroup MMAs, operands come by TMA, nothing Triton-only is left
    assert src.count("warpgroup_mma(q_smem") == 3 and "warpgroup_mma(gl.convert_layout(" in src
    assert "_tma_load(" in src and "tl.dot(" not in src and "tl.trans(" not in src
    assert not re.search(r"\btl\.(?!constexpr)", src.split("def p_lower_gluon")[1])
    # the masked score: the mask analysis' loops and the mask where() kept, the full loop has none
    full = src.split("# fully visible tiles")[1].split("# masked tiles")[0]
    assert "tmask" not in full and "where(" not in full.split("_fin_max")[0]


def test_overlap_structure(sources):
    """The overlapped pipeline: the tile's score is read from s_cur, the next score is issued
    asynchronously before the math and completed with P @ V; no synchronous score MMA in a loop."""
    src = sources["p_lower_ov"]
    loops = src.split("for start in range(")[1:]
    assert len(loops) == 3
    for body in loops:
        assert "s_next = warpgroup_mma(q_smem" in body and "is_async=True" in body
        assert body.index("s_next = warpgroup_mma(") < body.index("gl.exp2(") < body.index("warpgroup_mma_wait(")
        assert "k_cur" not in body


def _partition(src, fn):
    """The text of one generated Gluon function."""
    return src.split(f"def {fn}(")[1].split("@gluon.jit")[0]


def test_ws_structure(sources):
    """The warp-specialised kernel: a load partition and two consumer warpgroups forked by
    gl.warp_specialize; the consumers run the same derived updates as the one-partition kernel
    (the same rule chains, the same exponentials), wait for each stage's key tile at the top of
    a tile and its value tile just before P @ V, and release the stage after it; only the load
    partition copies key and value tiles."""
    src, one = sources["p_lower_ws"], sources["p_lower"]
    assert src.count("gl.warp_specialize(") == 1 and "], [4, 1], [REGS, 24])" in src
    con = _partition(src, "_p_lower_consume")
    load = _partition(src, "_p_lower_load")
    chains = lambda t: sorted(re.findall(r"#\s+derived by: .*", t))   # noqa: E731
    assert chains(con) == chains(one) and len(chains(con)) == 9   # 3 states x 3 tile loops
    assert con.count("gl.exp2(") == one.count("gl.exp2(") and "_tma_load(" not in con
    loops = con.split("for start in range(")[1:]
    assert len(loops) == 3
    for body in loops:
        assert body.index("mbarrier.wait(k_bar.index(stage), ph)") < body.index("warpgroup_mma(q_smem, k_cur")
        assert body.index("mbarrier.wait(v_bar.index(stage), ph)") < body.index("warpgroup_mma(gl.convert_layout(")
        assert body.index("warpgroup_mma(gl.convert_layout(") < body.index("mbarrier.arrive(kv_free.index(stage)")
    assert load.count("_tma_load(") == 3 and "mbarrier.wait(kv_free.index(stage), ((t_i // NS) & 1) ^ 1)" in load
    # each consumer's own rows; the parent's mask analysis over both
    assert "rows = (pid_r * 2 + WG) * BLOCK_I" in con
    assert "i_lo = (pid_r * (2 * BLOCK_I)) * 1.0" in _partition(src, "p_lower_gluon")
    assert "turn.index" not in con
    # ping-pong: a warpgroup's turn spans P @ V of tile t and the score of tile t+1 (the second
    # warpgroup's first turn starts after the first one's first score)
    pp = _partition(sources["p_lower_wspp"], "_p_lower_consume")
    assert "if WG == 1:\n        mbarrier.wait(turn.index(1), 0)" in pp.split("for start in range(")[0]
    for body in pp.split("for start in range(")[1:]:
        seq = [body.index(x) for x in ("warpgroup_mma(q_smem, k_cur", "mbarrier.arrive(turn.index(1 - WG), count=1)",
                                       "gl.exp2(", "mbarrier.wait(turn.index(WG), (t_i + WG) & 1)",
                                       "warpgroup_mma(gl.convert_layout(")]
        assert seq == sorted(seq) and body.split("    if WG == 0:")[0].count("turn.index") == 2
    # after the last tile the first warpgroup hands the turn over once more: the second one's
    # last wait is for it (a missing arrival hangs the kernel)
    after = pp.split("for start in range(")[-1]
    assert "    if WG == 0:   # ping-pong: the turn after the last score MMA\n        mbarrier.arrive(turn.index(1), count=1)" in after
    assert gluon_source(PROGS["p_lower"](), ws=True) == src
    # with the overlap: the next tile's score is issued (after its key tile's wait) before this
    # tile's math and completed with its P @ V; the stage is released after that
    ov = _partition(sources["p_lower_wsov"], "_p_lower_consume")
    assert chains(ov) == chains(one) and "k_cur" not in ov
    for body in ov.split("for start in range(")[1:]:
        seq = [body.index(x) for x in ("mbarrier.wait(k_bar.index((t_i + 1) % NS)", "s_next = warpgroup_mma(q_smem",
                                       "gl.exp2(", "mbarrier.wait(v_bar.index(stage), ph)",
                                       "warpgroup_mma_wait(0, deps=(_pv", "mbarrier.arrive(kv_free.index(stage)",
                                       "s_cur = warpgroup_mma_wait(0, deps=(s_next,))")]
        assert seq == sorted(seq)
    with pytest.raises(CodegenError, match="not both"):
        gluon_source(PROGS["p_lower"](), ws=True, overlap=True, pingpong=True)
    # defer (FlashAttention-3's order): P @ V of tile t runs on through tile t+1's exponentials and
    # is waited on where the accumulator is first read (its derived rescale); the stage then released
    df = _partition(gluon_source(PROGS["p_lower"](), ws=True, overlap=True, defer=True), "_p_lower_consume")
    assert chains(df) == chains(one) and "s = warpgroup_mma_init(s)" in df
    for body in df.split("for start in range(")[1:]:
        seq = [body.index(x) for x in ("s_next = warpgroup_mma(q_smem", "gl.exp2(", "s = warpgroup_mma_wait(0, deps=(s,))",
                                       "pred=start > first)", "= s * ", "mbarrier.wait(v_bar.index(stage), ph)",
                                       "v_cur, _t", "s_cur = warpgroup_mma_wait(1, deps=(s_next,))")]
        assert seq == sorted(seq) and "mbarrier.arrive(kv_free.index(stage)" not in body
    tail = df.split("for start in range(")[-1]
    assert "s = warpgroup_mma_wait(0, deps=(s,))   # the last tile's P @ V" in tail
    with pytest.raises(CodegenError, match="defer"):
        gluon_source(PROGS["p_lower"](), ws=True, defer=True)


def test_tanh_and_row_quotient_as_in_the_triton_kernel(sources):
    """The Gluon kernels evaluate the derived expressions with the Triton kernel's numerics: a
    tanh of the score as _tanh_mm with the same constants (the hardware's tanh.approx.f32 on
    16-bit MMA operands), and the output's quotient by a per-row value as the row's reciprocal
    factors (_rcp_row once per row, _qdiv per element), not _tanh and _div0."""
    tri = af.compile(PROGS["p_cap"]()).source
    calls = lambda t: sorted(set(re.findall(r"= _tanh_mm\(\w+, ([^)]*)\)", t)))   # noqa: E731
    want = calls(tri)
    assert want and all(c.endswith("DOT_T") for c in want)
    for name in ("p_cap", "p_cap_ws"):
        src = sources[name]
        assert calls(src) == want, name
        assert "def _tanh_mm(" in src and "tanh.approx.f32" in src and not re.search(r"= _tanh\(", src), name
    cap_pers = gluon_source(PROGS["p_cap"](), ws=True, persistent=True)
    assert calls(cap_pers) == want
    for name, src in list(sources.items()) + [("p_cap_pers", cap_pers)]:
        # the program's own functions (kernels, partitions), not the helpers
        code = "".join(f for f in src.split("@gluon.jit\n") if re.match(r"def _?p_", f))
        kernels = len(re.findall(r"def \w+_consume\(", src)) or len(re.findall(r"def \w+_gluon\(", src))
        assert code.count("= _rcp_row(s2)") == kernels, name   # the row's reciprocal, once per row
        assert "_qdiv(s, s2[:, None]" in code and "_div0(" not in code, name
        assert ("_tanh_mm(" in code) == name.startswith("p_cap"), name


def test_ws_persistent_structure_and_choice():
    """The persistent kernel (in the module beside the one-shot WS kernel): every partition
    walks the work items with the running tile count; the launcher takes it only when the
    operands are (grid axes x rows, inner axis) matrices and every key tile is whole."""
    from acefuse.codegen.contraction_gluon import compile_gluon
    src = gluon_source(PROGS["p_lower"](), ws=True, persistent=True)
    assert "def p_lower_gluon(" in src and "def p_lower_gluon_persistent(" in src
    for fn in ("_p_lower_p_consume", "_p_lower_p_load"):
        body = _partition(src, fn)
        assert "for item in range(gl.program_id(0), n_items, gl.num_programs(0)):" in body
        assert "t_i = tc + (start - first) // BLOCK_J" in body and "tc = tc + (end - first + BLOCK_J - 1) // BLOCK_J" in body
    assert "mbarrier.arrive(q_free.index(WG), count=1)" in _partition(src, "_p_lower_p_consume")
    assert "mbarrier.wait(q_free.index(w), (it & 1) ^ 1)" in _partition(src, "_p_lower_p_load")
    low = src.lower()
    assert not [w for w in WORKLOADS if w in low]
    kern = compile_gluon(PROGS["p_lower"](), ws=True, persistent=True)
    g = torch.Generator().manual_seed(6)
    x = lambda n: torch.randn(2, 3, n, D, dtype=torch.bfloat16, generator=g)   # noqa: E731
    grid = kern.launch_args(dict(q=x(333), k=x(512), v=x(512)))[0]
    assert grid == (min(3 * 6, 132),)                      # whole key tiles, nested strides: persistent
    assert len(kern.launch_args(dict(q=x(333), k=x(500), v=x(500)))[0]) == 2   # a partial key tile
    kt = torch.randn(2, 512, 3, D, dtype=torch.bfloat16, generator=g).transpose(1, 2)
    assert len(kern.launch_args(dict(q=x(333), k=kt, v=kt))[0]) == 2             # strides that do not nest
    # ping-pong: each item starts and ends its turns itself (the turn phases count tiles and
    # items; tests/test_gluon_pingpong_protocol.py runs the protocol)
    pp = _partition(gluon_source(PROGS["p_lower"](), ws=True, persistent=True, pingpong=True), "_p_lower_p_consume")
    head, loop = pp.split("for item in range(")
    assert "turn.index" not in head and "tc + it) & 1)" in loop
    assert loop.count("mbarrier.wait(turn.index(WG), (t_i + it + WG) & 1)") == 3
    assert loop.index("mbarrier.wait(turn.index(1), (tc + it) & 1)") < loop.index("for start in range(")
    end = loop.split("for start in range(")[-1]
    assert end.index("mbarrier.arrive(turn.index(1), count=1)") < end.index("mbarrier.arrive(turn.index(0), count=1)") \
        < end.index("mbarrier.wait(turn.index(0), ") < end.index("mbarrier.arrive(q_free.index(WG)")



@pytest.mark.parametrize("name", ["p_lower", "p_slope"])
def test_persistent_masked_tiles_apply_the_programs_mask_alone(name):
    """The persistent kernel runs only where every key tile is whole (above) and stores no row
    past the end, so its masked tiles carry the program's mask alone: no bounds mask of rows and
    keys (which took 41% of the mask's instructions in the sliding window's sm_90 code); the
    one-shot kernel, whose last key tile may be partial, keeps it."""
    src = gluon_source(PROGS[name](), ws=True, persistent=True, dynamic=True)
    per = _partition(src, f"_{name}_p_consume")
    one = _partition(src, f"_{name}_consume")
    assert "tmask" not in per and "gl.where(" in per
    assert "tmask = rmask[:, None] & (cols[None, :] < end)" in one and "& tmask" in one

qg, kg, vg = af.tensor("q", "b g r i d"), af.tensor("k", "b g j d"), af.tensor("v", "b g j e")
gscore = af.sum(qg * kg, "d") * SCALE


def _gprog(name, s):
    m = af.max(s, "j")
    p = af.exp(s - m)
    return af.program(name, o=af.sum(p * vg, "j") / af.sum(p, "j"))


GPROGS = {   # several query axes (r: query heads per key head; i: positions), read as one matrix of rows
    "p_rows": lambda: _gprog("p_rows", gscore),
    "p_rows_lower": lambda: _gprog("p_rows_lower", af.where(j <= i, gscore, af.NEG_INF)),
    "p_rows_band": lambda: _gprog("p_rows_band", af.where((j <= i) & (i - j < BAND), gscore, af.NEG_INF)),
}


def test_several_query_axes_read_as_one_matrix_of_rows():
    for mode in ({}, dict(ws=True), dict(ws=True, persistent=True)):
        src = gluon_source(GPROGS["p_rows_lower"](), **mode)
        assert "shape=[n_rows, len_d], strides=[s_q_i, 1]" in src or "shape=[n_g * n_rows, len_d]" in src
        assert "len_r" in src and "idx_i" in src
    src = gluon_source(GPROGS["p_rows_lower"](), ws=True)
    # the parent's bounds of i over both consumers' rows, per axis (no reduction over the rows)
    assert "i_lo = gl.where(one_i, q0_i % len_i, 0) * 1.0" in src
    q2, k2 = af.tensor("q", "b h i c d"), af.tensor("k", "b h j c d")   # two contraction axes
    with pytest.raises(CodegenError, match="one contraction axis"):
        gluon_source(_prog("p_two", af.sum(af.sum(q2 * k2, "d"), "c") * SCALE))


def _bounds(lines, lens, BLOCK_I, pid_r, n_rows):
    """Run the parent's bound lines (Python for the few gl calls) -> {axis: (lo, hi)}."""
    ns = dict(pid_r=pid_r, BLOCK_I=BLOCK_I, n_rows=n_rows, **{f"len_{a}": n for a, n in lens.items()})
    tl = type("tl", (), dict(where=staticmethod(lambda c, a, b: a if c else b), minimum=staticmethod(min)))
    ns["tl"] = tl
    exec("\n".join(ln.strip() for ln in "\n".join(lines).split("\n")), {}, ns)
    return {a: (ns[f"{a}_lo"], ns[f"{a}_hi"]) for a in lens}


def _check_bounds(lines, lens, rng):
    """Each axis' bounds contain every index of the rows row0 .. row1 and are exact where the axis
    does not wrap there (the mask analysis skips or trusts tiles by them)."""
    import itertools
    axes = list(lens)
    n_rows = math.prod(lens.values())
    for _ in range(300):
        BLOCK_I = int(rng.choice([16, 64, 128]))
        pid_r = int(rng.integers(0, -(-n_rows // (2 * BLOCK_I))))
        got = _bounds(lines, lens, BLOCK_I, pid_r, n_rows)
        rows = range(pid_r * 2 * BLOCK_I, min(pid_r * 2 * BLOCK_I + 2 * BLOCK_I, n_rows))
        for k, a in enumerate(axes):
            inner = math.prod(lens[b] for b in axes[k + 1:])
            idx = [(r // inner) % lens[a] for r in rows]
            lo, hi = got[a]
            assert lo <= min(idx) and hi >= max(idx), (a, lens, BLOCK_I, pid_r, got[a], min(idx), max(idx))
            if rows[0] // (inner * lens[a]) == rows[-1] // (inner * lens[a]):
                assert (lo, hi) == (min(idx), max(idx)), (a, lens, BLOCK_I, pid_r)


def test_pair_bounds_of_several_query_axes():
    import numpy as np
    from acefuse.codegen.contraction_gluon import GluonGen
    import acefuse as af_
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    gen = GluonGen(af_.fuse(GPROGS["p_rows_lower"]()), ws=True)
    lines = gen._pair_bounds()
    for lens in ({"r": 4, "i": 333}, {"r": 3, "i": 64}, {"r": 7, "i": 1000}, {"r": 1, "i": 50}, {"r": 5, "i": 7}):
        _check_bounds(lines, lens, rng)
    # the check can fail: bounds without the wrap test (row0's and row1's indices as they are)
    wrong = [ln for ln in lines if "one_" not in ln and "_lo" not in ln and "_hi" not in ln]
    wrong += [f"{a}_lo = (q0_{a} % len_{a}) * 1.0\n{a}_hi = (q1_{a} % len_{a}) * 1.0" for a in ("r", "i")]
    with pytest.raises(AssertionError):
        _check_bounds(wrong, {"r": 4, "i": 333}, rng)


def test_dynamic_work_items():
    """dynamic=True (persistent only): the load partition takes items from a counter the launcher
    zeroes for each launch (the kernel's last argument)."""
    from acefuse.codegen.contraction_gluon import GluonGen, GluonKernel
    with pytest.raises(CodegenError, match="persistent"):
        GluonGen(af.fuse(PROGS["p_lower"]()), ws=True, dynamic=True)
    gen = GluonGen(af.fuse(PROGS["p_lower"]()), ws=True, persistent=True, dynamic=True)
    src = gen.module()
    assert src.count("gl.atomic_add(cnt_ptr, 1)") == 2 and "cnt_ptr" not in src.split("def _p_lower_p_consume(")[1].split("\n")[0]
    kern = GluonKernel(gen.f, src, type("M", (), {"p_lower_gluon": None, "p_lower_gluon_persistent": None}), gen)
    x = lambda *sh: torch.randn(*sh, dtype=torch.bfloat16)   # noqa: E731
    grid, args, kw, _ = kern.launch_args(dict(q=x(2, 3, 256, D), k=x(2, 3, 256, D), v=x(2, 3, 256, D)))
    assert len(grid) == 1 and args[-1].dtype == torch.int32 and args[-1].tolist() == [0]


def test_several_query_axes_need_nested_strides():
    from acefuse.codegen.contraction_gluon import GluonGen, GluonKernel
    gen = GluonGen(af.fuse(GPROGS["p_rows"]()), ws=True, persistent=True)
    kern = GluonKernel(gen.f, "", type("M", (), {"p_rows_gluon": None, "p_rows_gluon_persistent": None}), gen)
    x = lambda *s: torch.randn(*s, dtype=torch.bfloat16)   # noqa: E731
    ins = dict(q=x(2, 3, 4, 256, D), k=x(2, 3, 256, D), v=x(2, 3, 256, D))
    grid = kern.launch_args(ins)[0]
    assert len(grid) == 1                                  # the persistent kernel: rows of r x i = 1024
    ins["q"] = x(2, 3, 256, 4, D).transpose(2, 3)          # r and i do not nest: refused, clearly
    with pytest.raises(ValueError, match="nest"):
        kern.launch_args(ins)


def test_launch_arguments_match_the_kernel():
    """The launcher's arguments against the generated signature (CPU tensors: no launch), and
    its refusals: wrong inputs, dtypes, strides TMA cannot read, empty axes, and no GPU."""
    from acefuse.codegen.contraction_gluon import compile_gluon
    kern = compile_gluon(PROGS["p_slope"]())
    g = torch.Generator().manual_seed(5)
    qx = torch.randn(2, 3, 100, D, dtype=torch.bfloat16, generator=g)
    ins = dict(q=qx, k=qx, v=qx, slope=torch.rand(3, generator=g))
    grid, args, kw, out = kern.launch_args(ins, BLOCK_J=64)
    params = [p.strip() for p in re.search(r"def p_slope_gluon\((.*?)\):", kern.source).group(1).split(",")]
    assert len(args) == len([p for p in params if "constexpr" not in p])
    assert sorted(kw) == sorted(p.split(":")[0] for p in params if "constexpr" in p)
    assert grid == (1, 6) and out["o"].shape == (2, 3, 100, D) and kw["BLOCK_J"] == 64
    with pytest.raises(TypeError, match="missing"):
        kern.launch_args(dict(q=qx, k=qx, v=qx))
    with pytest.raises(ValueError, match="16-bit"):
        kern.launch_args(dict(ins, v=qx.float()))
    with pytest.raises(ValueError, match="TMA"):
        kern.launch_args(dict(ins, q=torch.zeros(2, 3, 100, D + 4, dtype=torch.bfloat16)[..., :D]))   # 264-byte rows
    with pytest.raises(ValueError, match="empty"):
        kern.launch_args(dict(ins, q=qx[:, :, :0], k=qx[:, :, :0], v=qx[:, :, :0]))
    with pytest.raises(ValueError, match="sm_90"):
        kern(**ins)
    # the warp-specialised kernel: programs of 2 x BLOCK_I rows, its ring's stages, its registers
    ws = compile_gluon(PROGS["p_slope"](), ws=True)
    grid, args, kw, out = ws.launch_args(dict(ins, q=torch.randn(2, 3, 300, D, dtype=torch.bfloat16)))
    params = [p.strip() for p in re.search(r"def p_slope_gluon\((.*?)\):", ws.source).group(1).split(",")]
    assert len(args) == len([p for p in params if "constexpr" not in p])
    assert sorted(k_ for k_ in kw if k_ != "maxnreg") == sorted(p.split(":")[0] for p in params if "constexpr" in p)
    # output tiles stored from STORE_L: room for the conversion's scratch leaves 2 stages of 128 keys
    assert ws.tile_store and grid == (3, 6) and kw["BLOCK_I"] == 64 and kw["num_warps"] == 4 and kw["NS"] == 2
    assert ws.launch_args(ins, BLOCK_J=64)[2]["NS"] == 4
    with pytest.raises(ValueError, match="shared memory"):
        ws.launch_args(ins, stages=3)
    mma = compile_gluon(PROGS["p_slope"](), ws=True, tile_store=False)   # stores from the MMA layout: 3
    assert not mma.tile_store and mma.launch_args(ins)[2]["NS"] == 3
    with pytest.raises(ValueError, match="shared memory"):
        mma.launch_args(ins, stages=4)
    ov = compile_gluon(PROGS["p_slope"](), ws=True, overlap=True)   # the overlap form keeps 3 by default
    assert not ov.tile_store and ov.launch_args(ins)[2]["NS"] == 3
    with pytest.raises(ValueError, match="warpgroup"):
        ws.launch_args(ins, num_warps=8)
    df = compile_gluon(PROGS["p_slope"](), ws=True, overlap=True, defer=True)
    assert df.launch_args(ins)[2]["NS"] == 3 and df.launch_args(ins)[2]["BLOCK_J"] == 128
    assert df.launch_args(ins, BLOCK_J=64)[2]["NS"] == 4
    wide = dict(ins, v=torch.randn(2, 3, 100, 2 * D, dtype=torch.bfloat16))   # values over 128 columns: 64 keys
    assert compile_gluon(PROGS["p_slope"](), ws=True, overlap=True).launch_args(wide)[2]["BLOCK_J"] == 64
    with pytest.raises(ValueError, match="3 or more"):   # with two stages its ring would deadlock
        df.launch_args(ins, stages=2)


_COMPILE = r"""
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
path, name = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("gluon_offline", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = getattr(mod, name + "_gluon")
ws = "NS" in fn.arg_names
const = dict(BLOCK_I=64 if ws else 128, BLOCK_J=128, BLOCK_E=128, BLOCK_D=128, DOT_T=gl.bfloat16, SCAN=16,
             INSTR_N=128, num_warps=4 if ws else 8)
opts = {"num_warps": const["num_warps"]}
if ws:
    const.update(NS=3, REGS=240)
    opts["maxnreg"] = 168
sig = {a: ("constexpr" if a in const else "*bf16" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
kern = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 128), options=opts)
ptx = kern.asm["ptx"]
print("WGMMA", ptx.count("wgmma.mma_async"), "TMA", ptx.count("cp.async.bulk.tensor"), "TANH",
      ptx.count("tanh.approx.f32"))
"""


@pytest.mark.parametrize("name", ["p_plain", "p_lower", "p_lower_ov", "p_band_ov", "p_lower_ws", "p_plain_wspp",
                                  "p_lower_wsov", "p_cap_ws"])
def test_compiles_for_sm90_offline(sources, tmp_path, name):
    """Compile for sm_90 without a GPU (triton.compile for a GPUTarget; in a subprocess, as
    Triton's interpreter, which conftest turns on without a GPU, has no Gluon), then look for
    the warpgroup MMAs and the TMA copies in the PTX."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton.experimental.gluon")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests run the kernels themselves")
    src, script = tmp_path / f"{name}.py", tmp_path / "compile.py"
    src.write_text(sources[name])
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    r = subprocess.run([sys.executable, str(script), str(src), name.split("_")[0] + "_" + name.split("_")[1]],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"WGMMA (\d+) TMA (\d+) TANH (\d+)", r.stdout)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, r.stdout
    # the soft cap's tanh is the hardware's (_tanh_mm's native branch), as in the Triton kernel
    assert (int(m.group(3)) > 0) == name.startswith("p_cap"), r.stdout


# ---- GPU --------------------------------------------------------------------------------
def _ref(qx, kx, vx, lower=False, cap=None, slopes=None, band=None, lag=None):
    qd, kd, vd = qx.double(), kx.double(), vx.double()
    s = qd @ kd.transpose(-1, -2) * SCALE
    n, nk = qx.shape[2], kx.shape[2]
    ii = torch.arange(n, device=qx.device, dtype=torch.float64)[:, None]
    jj = torch.arange(nk, device=qx.device, dtype=torch.float64)[None, :]
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if slopes is not None:
        s = s + slopes.double()[None, :, None, None] * (jj - ii)
    if lower:
        s = s.masked_fill(jj > ii, -math.inf)
    if band is not None:
        s = s.masked_fill((jj > ii) | (ii - jj >= band), -math.inf)
    if lag is not None:
        s = s.masked_fill(jj > ii - lag, -math.inf)
    o = torch.softmax(s, -1) @ vd
    return torch.where(torch.isinf(s).all(-1, keepdim=True), 0.0, o)   # a row that sees no key: 0


def _rel(a, b):
    """Norm-wise relative error; the largest absolute error where the reference is all zeros."""
    n = b.norm()
    return ((a.double() - b).norm() / n).item() if n > 0 else (a.double() - b).abs().max().item()


def _on_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


_KERNS = {}
# the kernel variants: one partition (plain; overlap: the next score MMA during this tile's math);
# warp-specialised (ws1: a load partition and two consumer warpgroups; wspp: their score MMAs
# take turns; wsov: each consumer overlaps the next score MMA with this tile's math; wsdf: and
# P @ V with the next tile's math)
MODES = {"plain": {}, "ov": dict(overlap=True), "ws1": dict(ws=True), "wspp": dict(ws=True, pingpong=True),
         "wsov": dict(ws=True, overlap=True), "wsdf": dict(ws=True, overlap=True, defer=True)}
# the persistent WS kernel (taken for nested strides and whole key tiles; else the launcher
# runs the one-shot WS kernel of the same module)
PERSISTENT = {"pers1": dict(ws=True, persistent=True), "persdyn": dict(ws=True, persistent=True, dynamic=True),
              "perspp": dict(ws=True, pingpong=True, persistent=True),
              "persov": dict(ws=True, overlap=True, persistent=True),
              "persdf": dict(ws=True, overlap=True, defer=True, persistent=True)}


def _kernel(name, mode):
    from acefuse.codegen.contraction_gluon import compile_gluon
    if (name, mode) not in _KERNS:
        _KERNS[name, mode] = compile_gluon(PROGS[name](), **{**MODES, **PERSISTENT}[mode])
    return _KERNS[name, mode]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(PERSISTENT))
@pytest.mark.parametrize("NQ,NK,BJ", [(333, 1024, 128), (1024, 1024, 64)])
@pytest.mark.parametrize("name", ["p_plain", "p_lower", "p_band", "p_lag", "p_slope"])
def test_gpu_persistent(name, NQ, NK, BJ, mode):
    """The persistent kernel against float64: fewer programs than work items (B*H = 24 slices
    here; items = row-tile pairs x slices), query tiles past a slice's rows (333), and a
    non-finite key and value at the start of one slice, which must stay in it."""
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    kern = _kernel(name, mode)
    g = torch.Generator(device="cuda").manual_seed(NQ + NK + BJ + len(name) + len(mode))
    B, H = 2, 12
    x = lambda n: torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g)   # noqa: E731
    qx, kx, vx = x(NQ), x(NK), x(NK)
    kx[1, 5, 0, 0] = float("inf")
    vx[1, 5, 0, 3] = float("nan")
    ins = dict(q=qx, k=kx, v=vx)
    kw = {}
    if name == "p_slope":
        ins["slope"] = torch.rand(H, device="cuda", generator=g) * 0.1
        kw["slopes"] = ins["slope"]
    assert len(kern.launch_args(ins, BLOCK_J=BJ)[0]) == 1   # the persistent kernel is the one run
    out = kern(BLOCK_J=BJ, **ins)["o"]
    ref = _ref(qx, kx, vx, lower=name in ("p_lower", "p_slope"), band=BAND if name == "p_band" else None,
               lag=LAG if name == "p_lag" else None, **kw)
    ok = torch.ones(B, H, dtype=torch.bool)
    ok[1, 5] = False
    assert torch.isfinite(out[ok]).all()
    err = _rel(out[ok], ref[ok])
    assert err < 2e-2, f"{name} NQ={NQ} NK={NK} BLOCK_J={BJ} mode={mode}: relative error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ws1", "pers1", "persdyn"])
@pytest.mark.parametrize("R,N", [(4, 333), (4, 1024), (2, 200)])
@pytest.mark.parametrize("name", list(GPROGS))
def test_gpu_several_query_axes(name, R, N, mode):
    """Query axes r x i read as one matrix of rows against float64: row tiles that span two
    values of r (N = 333, 200: the mask analysis' bounds of i over such a tile), whole tiles."""
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    from acefuse.codegen.contraction_gluon import compile_gluon
    key = (name, mode)
    if key not in _KERNS:
        _KERNS[key] = compile_gluon(GPROGS[name](), **{**MODES, **PERSISTENT}[mode])
    kern = _KERNS[key]
    g = torch.Generator(device="cuda").manual_seed(R * N + len(name) + len(mode))
    B, G = 2, 3
    x = lambda *sh: torch.randn(*sh, device="cuda", dtype=torch.bfloat16, generator=g)   # noqa: E731
    qx, kx, vx = x(B, G, R, N, D), x(B, G, N, D), x(B, G, N, D)
    out = kern(q=qx, k=kx, v=vx)["o"]
    rep = lambda t: t[:, :, None].expand(B, G, R, N, D).reshape(B, G * R, N, D)   # noqa: E731
    ref = _ref(qx.reshape(B, G * R, N, D), rep(kx), rep(vx), lower=name != "p_rows",
               band=BAND if name == "p_rows_band" else None).reshape(B, G, R, N, D)
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < 2e-2, f"{name} R={R} N={N} mode={mode}: relative error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("N,BJ", [(1000, 128), (4096, 64), (200, 64)])
@pytest.mark.parametrize("name", ["p_plain", "p_lower", "p_cap", "p_slope", "p_band", "p_lag"])
def test_gpu_against_float64(name, N, BJ, mode):
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    kern = _kernel(name, mode)
    g = torch.Generator(device="cuda").manual_seed(N * 7 + BJ + len(name) + len(mode))
    B, H = 2, 3
    x = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)   # noqa: E731
    qx, kx, vx = x(B, H, N, D), x(B, H, N, D), x(B, H, N, D)
    ins = dict(q=qx, k=kx, v=vx)
    kw = {}
    if name == "p_slope":
        ins["slope"] = torch.rand(H, device="cuda", generator=g) * 0.1
        kw["slopes"] = ins["slope"]
    out = kern(BLOCK_J=BJ, **ins)["o"]
    ref = _ref(qx, kx, vx, lower=name in ("p_lower", "p_slope"), cap=CAP if name == "p_cap" else None,
               band=BAND if name == "p_band" else None, lag=LAG if name == "p_lag" else None, **kw)
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < 2e-2, f"{name} N={N} BLOCK_J={BJ} mode={mode}: relative error {err:.3e}"


def _segments(B, N, g, device="cpu"):
    """Sorted random segment ids per batch row (runs of 1 to about N/3 positions), int32."""
    return torch.sort(torch.randint(0, 5, (B, N), generator=g, device=device), dim=1).values.to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES) + list(PERSISTENT))
@pytest.mark.parametrize("N,BJ", [(1000, 128), (4096, 64), (333, 128)])
def test_gpu_lookup_mask_against_float64(N, BJ, mode):
    """A mask read from data (segment ids by lookups, and causal): the mask analysis loads each
    scan step's key tiles' ids ([SCAN, BLOCK_J] in the scan's 2-d layout), the tiles the ids
    per element; against float64 on fresh inputs, the last segment ending inside a tile."""
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    kern = _kernel("p_seg", mode)
    g = torch.Generator(device="cuda").manual_seed(N * 3 + BJ + len(mode))
    B, H = 2, 3
    x = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)   # noqa: E731
    qx, kx, vx = x(B, H, N, D), x(B, H, N, D), x(B, H, N, D)
    sg = _segments(B, N, g, "cuda")
    out = kern(BLOCK_J=BJ, q=qx, k=kx, v=vx, seg=sg)["o"]
    s = (qx.double() @ kx.double().transpose(-1, -2)) * SCALE
    ii, jj = torch.arange(N, device="cuda")[:, None], torch.arange(N, device="cuda")[None, :]
    keep = (sg[:, None, :, None] == sg[:, None, None, :]) & (jj <= ii)
    ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vx.double()
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < 2e-2, f"N={N} BLOCK_J={BJ} mode={mode}: relative error {err:.3e}"


_COMPILE_LOOKUP = """
import inspect, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
sys.path.insert(0, sys.argv[1])
from test_contraction_gluon import PROGS, _segments
from acefuse.codegen.contraction_gluon import compile_gluon
for opts in (dict(ws=True, persistent=True, dynamic=True),):
    kern = compile_gluon(PROGS["p_seg"](), **opts)
    x = lambda *s: torch.empty(*s, dtype=torch.bfloat16)
    ins = dict(q=x(2, 3, 1024, 128), k=x(2, 3, 1024, 128), v=x(2, 3, 1024, 128),
               seg=_segments(2, 1024, torch.Generator().manual_seed(0)))
    grid, args, kw, _ = kern.launch_args(ins)[:4]
    fn = kern.fn_persistent if len(grid) == 1 else kern.fn
    sig, consts = {}, {}
    kw = {a: v for a, v in kw.items() if a != "maxnreg"}
    for i, p in enumerate(inspect.signature(fn.fn).parameters):
        a = args[i] if p not in kw else None
        if p in kw or (not isinstance(a, torch.Tensor) and a == 1):
            sig[p], consts[(i,)] = "constexpr", kw.get(p, 1)
        elif isinstance(a, torch.Tensor):
            sig[p] = "*" + {torch.bfloat16: "bf16", torch.int32: "i32"}[a.dtype]
        else:
            sig[p] = "i32"
    ck = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 128),
                        options=dict(num_warps=kw.get("num_warps", 4)))
    ptx = ck.asm["ptx"]
    print(sorted(opts), "WGMMA", ptx.count("wgmma.mma_async"), "LD_S32", ptx.count("ld.global.b32") + ptx.count("ld.global.u32") + ptx.count("ld.global.s32"))
"""


@pytest.mark.parametrize("opts", [dict(ws=True), dict(ws=True, pingpong=True), dict(ws=True, persistent=True)],
                         ids=["ws", "wspp", "persistent"])
def test_ws_lookup_analysis_reads_both_consumers_rows(opts):
    """The warp-specialised kernels' mask analysis decides which key tiles a program of
    2 * BLOCK_I rows visits, for both consumers: a lookup at the query rows (seg[i]) must read
    the values of all those rows, not the first BLOCK_I (session 21's kernels did: on the GPU
    the second consumer's rows were wrong wherever a segment began inside the pair). Every
    function that runs the analysis reads the row lookup through names defined over
    ``2 * BLOCK_I`` rows; the programs without a row lookup keep their text (no ``pr_`` names)."""
    src = gluon_source(PROGS["p_seg"](), **opts)
    funcs = re.split(r"\n@gluon\.jit\n", src)
    analysed = [f for f in funcs if "iv0p = " in f]
    assert analysed, "no mask analysis in the kernel"
    for f in analysed:
        name = re.search(r"def (\w+)\(", f).group(1)
        row_reads = re.findall(r"iv\d+p = (\w+)\n\s*iv\d+in = (\w+)", f)
        assert row_reads, name
        for idx, msk in row_reads:
            assert (idx, msk) == ("pr_idx_i", "pr_rmask"), f"{name}: the analysis reads {idx}, {msk}"
        # (spread over the partition's threads: SCAN_L; the load partition's ROW_L repeats every row in each thread)
        assert re.search(r"pr_rows = pid_r \* \(2 \* BLOCK_I\) \+ gl\.arange\(0, 2 \* BLOCK_I, layout=SCAN_L\)", f), name
        assert "pr_idx_i = pr_rem % len_i" in f and "pr_rmask = pr_rows < n_rows" in f, name
    assert "pr_" not in gluon_source(PROGS["p_slope"](), **opts)


def test_persistent_load_partition_scans_one_tile_a_step_with_lookups():
    """The persistent kernel's load partition (one warp, 24 registers) runs the consumers' mask
    analysis with one key tile a scan step (SCAN_LD) where lookups load [SCAN, BLOCK_J] values:
    at SCAN = 16 the document mask's load partition spilled (1402 local loads offline for sm_90).
    Its analysis is the consumers' text with SCAN renamed, no other change, so the first and last
    visible tiles it walks (a min and a max over the tiles) are theirs at any step width; programs
    without lookups keep SCAN there (their kernels unchanged)."""
    def funcs(src):
        return {re.search(r"def (\w+)\(", f).group(1): f for f in re.split(r"\n@gluon\.jit\n", src) if "def " in f}

    def analysis(f):
        lines = f.splitlines()
        a = next(i for i, ln in enumerate(lines) if "BIG = 2147483647" in ln)
        b = next(i for i, ln in enumerate(lines) if "first = gl.where(first == BIG, 0, first)" in ln)
        return [ln.strip() for ln in lines[a:b + 1]]

    fs = funcs(gluon_source(PROGS["p_seg"](), ws=True, persistent=True, dynamic=True))
    load = next(f for n, f in fs.items() if n.endswith("_p_load"))   # (the persistent kernel's)
    cons = next(f for n, f in fs.items() if n.endswith("_p_consume"))
    assert "SCAN_LD: gl.constexpr = 1" in load and "SCAN_LD" not in cons
    la, ca = analysis(load), analysis(cons)
    assert la == [re.sub(r"\bSCAN\b", "SCAN_LD", ln) for ln in ca] and la != ca
    plain = funcs(gluon_source(PROGS["p_lower"](), ws=True, persistent=True, dynamic=True))
    assert not any("SCAN_LD" in f for f in plain.values())


def test_lookup_mask_compiles_for_sm90_offline(tmp_path):
    """The mask from data (p_seg) in the persistent Gluon kernel (its load partition and consumers
    run the mask analysis; the plain and one-shot kernels share the layouts; all three compiled in
    session 21): the scan's [SCAN, BLOCK_J] key positions in their own 2-d layout
    (gluon_text.scan_layouts), the ids read as int32, compiled for sm_90 without a GPU (in a
    subprocess, outside the interpreter)."""
    import subprocess
    import sys
    pytest.importorskip("triton.experimental.gluon")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests run the kernels themselves")
    src = gluon_source(PROGS["p_seg"](), ws=True, persistent=True)
    assert "SCANJ_L" in src and "SCAN2_L" in src and "seg_ptr" in src
    script = tmp_path / "compile_lookup.py"
    script.write_text(_COMPILE_LOOKUP)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    r = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip("no ptxas here")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if "WGMMA" in ln]
    assert len(lines) == 1 and all(int(ln.split()[-3]) > 0 and int(ln.split()[-1]) > 0 for ln in lines), r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["p_lower", "p_band"])
def test_gpu_small_tiles(name, mode):
    """64 x 64 tiles on one warpgroup (4 warps): the other launch shape the launcher takes
    (warp-specialised: 64 rows per consumer; 777 rows leave the last program's second
    consumer no row at all)."""
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    kern = _kernel(name, mode)
    g = torch.Generator(device="cuda").manual_seed(23 + len(mode) + len(name))
    qx, kx, vx = (torch.randn(1, 2, 777, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out = kern(q=qx, k=kx, v=vx, BLOCK_I=64, BLOCK_J=64, num_warps=4)["o"]
    ref = _ref(qx, kx, vx, lower=name == "p_lower", band=BAND if name == "p_band" else None)
    err = _rel(out, ref)
    assert err < 2e-2, f"{name} mode={mode}: relative error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_strided_and_unequal_lengths(mode):
    """Operands in (batch, position, head, dim) memory order (strided views, as torch models
    keep them), fewer queries than keys, a masked score; and a non-finite value in one head's
    keys and values stays in that head."""
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    kern = _kernel("p_lower", mode)
    g = torch.Generator(device="cuda").manual_seed(11 + len(mode))
    B, H, NQ, NK = 2, 4, 333, 517
    x = lambda n: torch.randn(B, n, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)  # noqa
    qx, kx, vx = x(NQ), x(NK), x(NK)
    # the first key of head 1 (in memory right after the keys of head 0 of that position):
    # head 0's last, partial key tile must read zeros past its end, never head 1's values
    kx[0, 1, 0, 0] = float("inf")
    vx[0, 1, 0, 0] = float("nan")
    out = kern(q=qx, k=kx, v=vx)["o"]
    ref = _ref(qx, kx, vx, lower=True)
    ok = torch.ones(B, H, dtype=torch.bool)
    ok[0, 1] = False
    assert torch.isfinite(out[ok]).all()
    err = _rel(out[ok], ref[ok])
    assert err < 2e-2, f"mode={mode}: relative error {err:.3e}"


@pytest.mark.gpu
def test_gpu_bad_input_is_refused():
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    from acefuse.codegen.contraction_gluon import compile_gluon
    kern = compile_gluon(PROGS["p_plain"]())
    qx = torch.randn(1, 2, 64, D, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit"):
        kern(q=qx.float(), k=qx.float(), v=qx.float())
    with pytest.raises(ValueError, match="TMA"):   # rows 264 bytes apart: not a multiple of 16
        kern(q=torch.zeros(1, 2, 64, D + 4, device="cuda", dtype=torch.bfloat16)[..., :D], k=qx, v=qx)


def test_hook_falls_back_with_a_warning_or_raises():
    """call_gluon (the hook for af.compile's kernels): asked for explicitly, inputs it cannot
    take raise; under ACEFUSE_GLUON=1 they warn and return None (the Triton path runs)."""
    from acefuse.codegen.contraction_gluon import call_gluon
    kern = af.compile(PROGS["p_plain"]())
    qx = torch.randn(1, 2, 64, D)
    with pytest.raises(ValueError, match="sm_90|16-bit"):   # float32 CPU tensors: refused (why: the device)
        call_gluon(kern, dict(q=qx, k=qx, v=qx), explicit=True)
    with pytest.warns(UserWarning, match="runs its Triton kernel"):
        assert call_gluon(kern, dict(q=qx, k=qx, v=qx), explicit=False) is None


def test_pingpong_with_persistent_is_taken():
    """Ping-pong on the persistent grid hung on an H200 in session 14 (a deadlock across work
    items, tests/test_gluon_pingpong_protocol.py); fixed in session 15 and run there on an H200
    at the shape that hung (global and causal, B=16, H=16, N=1024 and 4096: right against float32,
    no hang): the variant flags and compile_gluon take it."""
    from acefuse.codegen.contraction_gluon import compile_gluon, gluon_variant
    assert gluon_variant("ws,pingpong,persistent") == {"ws": True, "pingpong": True, "persistent": True}
    kern = compile_gluon(PROGS["p_plain"](), ws=True, pingpong=True, persistent=True)
    assert kern.pingpong and kern.persistent and kern.fn_persistent is not None


def test_auto_choice_stays_off_the_gpu_and_outside_the_kernel():
    """af.compile's kernels ask auto_gluon on every plain call: CPU tensors, options and
    ACEFUSE_GLUON=0 leave the Triton kernel running (None), and the result is the Triton one."""
    from acefuse.codegen.contraction_gluon import auto_gluon
    kern = af.compile(PROGS["p_plain"]())
    g = torch.Generator().manual_seed(5)
    qx, kx, vx = (torch.randn(1, 2, 37, D, generator=g) for _ in range(3))
    assert auto_gluon(kern, dict(q=qx, k=kx, v=vx)) is None
    assert auto_gluon(kern, {}) is None
    assert auto_gluon(kern, dict(q=qx, k=kx, v=vx, schedule="loop")) is None
    assert getattr(kern, "_gluon_auto", None) is None      # nothing decided from a CPU call
    sub = type("Sub", (torch.Tensor,), {})
    assert auto_gluon(kern, dict(q=qx.as_subclass(sub), k=kx, v=vx)) is None   # a tensor subclass
    out = kern(q=qx, k=kx, v=vx)
    ref = _ref(qx, kx, vx)
    assert _rel(out, ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("name,N", [("p_plain", 4096), ("p_lower", 2048), ("p_cap", 1536)])
def test_gpu_auto_choice_is_right_and_remembered(name, N, monkeypatch):
    """On an sm_90 GPU the first call times the warp-specialised Gluon kernel against the Triton
    kernel (both must agree) and remembers the faster per shapes; every call's result is right
    against float64, whichever was chosen; ACEFUSE_GLUON=0 keeps the Triton kernel untimed."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the automatic Gluon choice is made on sm_90 GPUs")
    from acefuse.codegen.contraction_gluon import GluonKernel
    kern = af.compile(PROGS[name]())
    g = torch.Generator(device="cuda").manual_seed(N + len(name))
    B, H = 2, 8
    qx, kx, vx = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    ref = _ref(qx, kx, vx, lower=name == "p_lower", cap=CAP if name == "p_cap" else None)
    for _ in range(2):
        out = kern(q=qx, k=kx, v=vx)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert _rel(out, ref) < 2e-2
    assert kern._gluon_auto and all(isinstance(g, GluonKernel) for g in kern._gluon_auto), \
        getattr(kern, "_gluon_reason", None)
    (choice,) = kern._gluon_choice.values()
    (t_tri, t_glu), = kern._gluon_times.values()
    assert (choice == "triton") == (t_glu > 0.97 * t_tri)
    print(f"{name} N={N}: Triton {t_tri * 1e6:.1f} us, Gluon {t_glu * 1e6:.1f} us, chose "
          f"{'gluon' if choice != 'triton' else 'triton'}")
    # a fresh kernel object (a fresh process alike) runs the choice remembered on disk, untimed
    import acefuse.codegen.contraction_gluon as cg
    if os.environ.get("ACEFUSE_TUNING_CACHE", "1") != "0":
        def no_timing(*a, **kw):
            raise AssertionError("timed again")
        monkeypatch.setattr(cg, "_time_pair", no_timing)
        again = af.compile(PROGS[name]())
        assert _rel(again(q=qx, k=kx, v=vx), ref) < 2e-2
        (c2,) = again.kernel._gluon_choice.values()
        assert (c2 == "triton") == (choice == "triton")
        monkeypatch.undo()
    if name == "p_plain":   # inside CUDA graph capture: the Triton kernel, nothing timed or decided
        from acefuse.codegen.contraction_gluon import auto_gluon
        inner = getattr(kern, "kernel", kern)
        n_keys = len(inner._gluon_choice)
        qs = qx[:, :, :2048]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert auto_gluon(inner, dict(q=qs, k=kx, v=vx)) is None
        assert len(inner._gluon_choice) == n_keys
    monkeypatch.setenv("ACEFUSE_GLUON", "0")
    off = af.compile(PROGS[name]())
    inner = getattr(off, "kernel", off)   # the forward kernel (af.compile may share it: decide again)
    inner._gluon_auto = None
    inner.__dict__.pop("_gluon_choice", None)
    assert _rel(off(q=qx, k=kx, v=vx), ref) < 2e-2
    assert inner._gluon_auto is False


def test_variant_flags():
    """ACEFUSE_GLUON_VARIANT picks the kernel call_gluon makes; unknown or inconsistent flags
    are refused with the list of flags."""
    from acefuse.codegen.contraction_gluon import gluon_variant
    assert gluon_variant("") == {} and gluon_variant("overlap") == {"overlap": True}
    assert gluon_variant(" ws, persistent ") == {"ws": True, "persistent": True}
    with pytest.raises(ValueError, match="unknown flags"):
        gluon_variant("ws,fast")
    with pytest.raises(ValueError, match="add 'ws'"):
        gluon_variant("persistent")


def test_af_compile_takes_path_gluon_and_refuses_it_clearly_off_the_gpu():
    """``af.compile(prog)(..., path='gluon')`` reaches the Gluon variant (codegen/compile.py); with no
    sm_90 GPU it raises a ValueError naming the program, and the default call is unaffected."""
    import torch
    import acefuse as af
    if torch.cuda.is_available():
        pytest.skip("off-GPU behaviour")
    q, k, v = (af.tensor(n, a) for n, a in (("q", "i d"), ("k", "j d"), ("v", "j e")))
    s = af.sum(q * k, "d")
    p = af.exp(s - af.max(s, "j"))
    prog = af.program("gluon_path_probe", o=af.sum(p * v, "j") / af.sum(p, "j"))
    kern = af.compile(prog)
    g = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(33, 16, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match="gluon_path_probe"):
        kern(q=Q, k=K, v=V, path="gluon")
    sc = (Q.double() @ K.double().T)
    want = torch.softmax(sc, -1) @ V.double()
    torch.testing.assert_close(kern(q=Q, k=K, v=V).double(), want, rtol=1e-4, atol=1e-5)


def test_output_tiles_are_stored_whole_sectors_where_asked():
    """tile_store: the output tile is converted to STORE_L (8 consecutive values a thread) before
    its store, its rows' offsets and mask with it; by default on without the overlap (whose ring
    keeps 3 stages), off with tile_store=False (stores from the MMA layout, as the template
    writes them)."""
    on = gluon_source(PROGS["p_lower"](), ws=True, persistent=True, dynamic=True)
    off = gluon_source(PROGS["p_lower"](), ws=True, persistent=True, dynamic=True, tile_store=False)
    ov = gluon_source(PROGS["p_lower"](), ws=True, overlap=True)
    stores = lambda src: [ln for ln in src.split("\n") if "gl.store(o_ptr" in ln]   # noqa: E731
    assert len(stores(on)) == 2 and all("gl.convert_layout(_out(" in ln and ", STORE_L)" in ln
                                         and "gl.convert_layout(rmask, SROW_L)" in ln for ln in stores(on))
    assert "STORE_L: gl.constexpr = gl.BlockedLayout([2, 8], [8, 4], [4, 1], [1, 0])" in on
    for src in (off, ov):
        assert stores(src) and not any("STORE_L" in ln for ln in stores(src))


def test_stage_store_keeps_three_stages_and_is_refused_where_it_cannot_run():
    """stage_store (EXPERIMENTAL): the output tiles through the last key tile's value buffer, so
    the ring keeps 3 stages of 128 keys (no conversion scratch is reserved); it needs 2 * BLOCK_I
    rows in a value tile, and is an option of the ws kernel without overlap, ping-pong or defer."""
    ins = dict(q=torch.randn(2, 3, 300, D, dtype=torch.bfloat16), k=torch.randn(2, 3, 256, D, dtype=torch.bfloat16),
               v=torch.randn(2, 3, 256, D, dtype=torch.bfloat16))
    from acefuse.codegen.contraction_gluon import compile_gluon
    ss = compile_gluon(PROGS["p_lower"](), ws=True, persistent=True, dynamic=True, stage_store=True)
    assert ss.stage_store and ss.tile_store and ss.launch_args(ins)[2]["NS"] == 3
    with pytest.raises(ValueError, match="BLOCK_J >= 2"):
        ss.launch_args(ins, BLOCK_J=64)
    src = ss.source
    assert src.count("o_buf.load(STORE_L)") == 2 and "gl.convert_layout(_out(" not in src
    assert src.count("pred=start + BLOCK_J < end") == 6   # 3 tile loops x (one-shot, persistent)
    for bad in (dict(overlap=True), dict(pingpong=True), dict(overlap=True, defer=True)):
        with pytest.raises(CodegenError, match="stage_store"):
            gluon_source(PROGS["p_lower"](), ws=True, stage_store=True, **bad)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("N", [333, 1024])
@pytest.mark.parametrize("name", ["p_plain", "p_lower", "p_band", "p_lag", "p_cap"])
def test_gpu_stage_store_against_float64(name, N, persistent):
    """stage_store on the GPU against float64: partial row tiles (333), masks that skip tiles
    before and after a band, rows that see no key (p_lag), several items per program."""
    if not _on_hopper():
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    from acefuse.codegen.contraction_gluon import compile_gluon
    key = (name, "stage_store", persistent)
    if key not in _KERNS:
        _KERNS[key] = compile_gluon(PROGS[name](), ws=True, persistent=persistent, dynamic=persistent, stage_store=True)
    kern = _KERNS[key]
    g = torch.Generator(device="cuda").manual_seed(N + len(name) + persistent)
    B, H = 2, 12
    x = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)   # noqa: E731
    qx, kx, vx = x(B, H, N, D), x(B, H, N, D), x(B, H, N, D)
    out = kern(q=qx, k=kx, v=vx)["o"]
    ref = _ref(qx, kx, vx, lower=name == "p_lower", band=BAND if name == "p_band" else None,
               lag=LAG if name == "p_lag" else None, cap=CAP if name == "p_cap" else None)
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    assert err < 2e-2, f"{name} N={N} persistent={persistent}: relative error {err:.3e}"
