"""Issue 15, attention variants: the contraction family's tanh (``_tanh_mm``: the hardware
tanh.approx.f32 on a GPU for 16-bit matmul operands, the accurate _tanh elsewhere) and masked
key tiles inside the keys (no bounds mask, no masked load; only the last loop's tile mask has the
keys' bound). Structure of the generated source, then the kernels against float64 on fresh random
inputs at sizes where tiles are partly masked and the keys end inside a tile."""
import math
import re
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))

q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
i, j = af.index("i"), af.index("j")


def _attend(name, s):
    m = af.max(s, "j")
    p = af.exp(s - m)
    return af.program(name, o=af.sum(p * v, "j") / af.sum(p, "j"))


def _kernel_src(src, name):
    start = src.index(f"def {name}(")
    end = src.find("@triton.jit", start)
    return src[start:end if end > 0 else len(src)]


def _loops(kern):
    """{loop header: body lines (comments dropped)} of the top-level key loops."""
    out, cur = {}, None
    for ln in kern.split("\n"):
        if ln.startswith("    for start in "):
            cur = out.setdefault(ln.strip(), [])
        elif cur is not None and (ln.startswith("        ") or not ln.strip()):
            if ln.strip() and not ln.strip().startswith("#"):
                cur.append(ln)
        else:
            cur = None
    return {h: "\n".join(b) for h, b in out.items()}


def _seed():
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _ref(qq, kk, vv, scale, score_fn=None, mask=None):
    s = torch.einsum("bhid,bhjd->bhij", qq.double(), kk.double()) * scale
    if score_fn is not None:
        s = score_fn(s)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vv.double()


# ---- tanh --------------------------------------------------------------------------------------
def test_softcap_tanh_is_the_hardware_one_for_16_bit_operands_on_the_gpu_only():
    src = af.compile(EX["softcap"]).source
    assert src.count("def _tanh_mm(") == 1
    helper = src[src.index("def _tanh_mm("):src.index("@triton.jit", src.index("def _tanh_mm("))]
    # the hardware form only where NATIVE (a GPU, not the interpreter) and the operands are 16-bit
    assert re.search(r"if NATIVE and \(\(T == tl\.bfloat16\) or \(T == tl\.float16\)\):", helper)
    assert 'tanh.approx.f32 $0, $1;' in helper and "[a * R]" in helper
    # elsewhere: the score's product, torch's division, the accurate tanh
    assert "x = x * K" in helper and "x = tl.div_rn(x, C)" in helper and "return _tanh(x)" in helper
    for name in ("softcap_attn", "softcap_attn_hopper", "softcap_part"):
        kern = _kernel_src(src, name)
        calls = re.findall(r"_tanh_mm\((\w+), ([^,]+), ([^,]+), ([^,]+), DOT_T\)", kern)
        assert calls, name
        for a, k, c, r in calls:   # the soft cap's quotient: the raw dot product, its scale, c, scale / c
            assert a.startswith("_dot_"), kern
            assert float(k) == EX["SCALE"] and float(c) == EX["CAP"] and float(r) == EX["SCALE"] / EX["CAP"]
        assert "tl.div_rn(" not in kern and "_tanh(" not in kern


def test_tanh_without_a_quotient_and_a_row_family_tanh():
    prog = _attend("tanh_score", 8.0 * af.tanh(af.sum(q * k, "d") * 0.25))
    src = af.compile(prog).source
    # (tanh of a product with no quotient: the product as it is, the helper's constants 1)
    assert re.search(r"_tanh_mm\(_t\d+, 1\.0, 1\.0, 1\.0, DOT_T\)", _kernel_src(src, "tanh_score_attn"))
    # the row family keeps its own accurate _tanh (no _tanh_mm defined or called)
    x = af.tensor("x", "r c")
    row = af.compile(af.program("row_tanh", y=af.sum(af.tanh(x), "c"))).source
    assert "_tanh_mm" not in row and "_tanh(" in row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [45, 130])
def test_softcap_float64(n, dtype, monkeypatch):
    """The interpreter runs the accurate tanh (NATIVE is false): errors of the input type."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern = af.compile(EX["softcap"])
    g = _seed()
    qq, kk, vv = (torch.randn(1, 2, n, 32, generator=g) * 3 for _ in range(3))
    qq, kk, vv = qq.to(dtype), kk.to(dtype), vv.to(dtype)
    o = kern(q=qq, k=kk, v=vv)
    cap = EX["CAP"]
    ref = _ref(qq, kk, vv, EX["SCALE"], lambda s: cap * torch.tanh(s / cap))
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2   # bf16: P and the output rounded to 8 bits
    assert (o.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_tanh_score_float64(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern = af.compile(_attend("tanh_score", 8.0 * af.tanh(af.sum(q * k, "d") * 0.25)))
    g = _seed()
    qq, kk, vv = (torch.randn(2, 1, 37, 16, generator=g) for _ in range(3))
    o = kern(q=qq, k=kk, v=vv)
    ref = _ref(qq, kk, vv, 0.25, lambda s: 8.0 * torch.tanh(s))
    assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_softcap_hardware_tanh_bf16_within_its_bound(monkeypatch):
    """On the GPU, bf16: tanh.approx.f32 (relative error < 2^-10, PTX ISA: about 2^-11) moves each
    capped score by at most cap * 2^-10, so each weight p by a factor within exp(+-cap * 2^-10);
    with P rounded to bf16 (2^-8) the output moves by at most (e^(2 d) - 1) * max|v - o|, d the
    sum of both, plus the output's own rounding. Fresh inputs scaled so scores reach the cap."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kern = af.compile(EX["softcap"])
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    n = 1000
    qq, kk, vv = (torch.randn(2, 4, n, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    qq = (qq.float() * 8).to(torch.bfloat16)   # scores of spread 8: the tails reach the cap
    o = kern(q=qq, k=kk, v=vv)
    cap = EX["CAP"]
    ref = _ref(qq, kk, vv, EX["SCALE"], lambda s: cap * torch.tanh(s / cap))
    d = cap * 2.0 ** -10 + 2.0 ** -8
    tol = math.expm1(2 * d) * 2 * vv.double().abs().max().item() + 2.0 ** -7 * ref.abs().max().item()
    err = (o.double() - ref).abs().max().item()
    assert err <= tol, (err, tol)


# ---- masked tiles inside the keys -----------------------------------------------------------------
@pytest.mark.parametrize("kname", ["sliding_window_attn", "sliding_window_attn_hopper", "sliding_window_part"])
def test_band_masked_tiles_inside_the_keys_have_no_bounds_mask(kname):
    src = af.compile(EX["sliding_window"]).source
    kern = _kernel_src(src, kname)
    assert "e_in = tl.minimum(tl.maximum(first + (end - first) // BLOCK_J * BLOCK_J, first), end)" in kern
    assert "a = tl.minimum(tl.maximum(f_lo, first), e_in)" in kern
    assert "b = tl.minimum(tl.maximum(f_hi, a), e_in)" in kern
    loops = _loops(kern)
    heads = list(loops)
    assert len(heads) == 3, heads
    first, full, last = (loops[h] for h in heads)
    assert "range(first, a, BLOCK_J)" in heads[0] and "range(b, end, BLOCK_J)" in heads[2]
    # tiles below the window and inside the keys: the band's condition alone, loads unmasked by keys
    for body in (first, full):
        assert "tmask" not in body and "< n_j" not in body and "< end" not in body
    # (the band's two conditions: one select each, the second reading the first)
    assert first.count("tl.where(") == 2 and "tl.where(" not in full
    assert re.search(r"(_t\d+) = tl\.where\(_c\d+, _dot_\d+, float\('-inf'\)\)\n(?:.*\n)*?\s*_t\d+ = "
                     r"tl\.where\(_c\d+, \1, float\('-inf'\)\)", first)
    # the last loop's tiles (the diagonal, the tile the keys end in): the keys' bound as the tile
    # mask, the last select of the chain
    assert re.search(r"tmask = cols\[None, :\] < end\n", last)
    assert re.search(r"_t\d+ = tl\.where\(tmask, _t\d+, float\('-inf'\)\)", last)


@pytest.mark.parametrize("path,schedule", [("portable", "loop"), ("hopper", "loop"), ("portable", "split")])
@pytest.mark.parametrize("n,window", [(100, 20), (64, 17), (150, 64)])
def test_band_float64(n, window, path, schedule, monkeypatch):
    """A band (both bounds: tiles wholly below it skipped, tiles inside it unmasked) at sizes where
    the keys end inside a tile and the last row tile is not full; tiles of 16 keys."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prog = _attend(f"band{window}", af.where((j <= i) & (i - j < window), af.sum(q * k, "d") * 0.3, af.NEG_INF))
    kern = af.compile(prog)
    g = _seed()
    qq, kk, vv = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    kw = dict(path=path, schedule=schedule, block_j=16)
    if schedule == "split":
        kw["nsplit"] = 3
    o = kern(q=qq, k=kk, v=vv, **kw)
    ii, jj = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = _ref(qq, kk, vv, 0.3, mask=(jj <= ii) & (ii - jj < window))
    assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("n", [33, 96])
def test_rows_that_see_no_key_and_a_reversed_band_float64(n, monkeypatch):
    """A band above the diagonal (keys i+3 .. i+9: the last rows see none, their output 0) and
    queries shorter than keys: the first masked loop then holds tiles before the full ones."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prog = _attend("ahead", af.where((j >= i + 3) & (j <= i + 9), af.sum(q * k, "d") * 0.5, af.NEG_INF))
    kern = af.compile(prog)
    g = _seed()
    qq = torch.randn(1, 1, n, 16, generator=g)
    kk, vv = (torch.randn(1, 1, n + 5, 16, generator=g) for _ in range(2))
    o = kern(q=qq, k=kk, v=vv, block_j=16)
    ii, jj = torch.arange(n)[:, None], torch.arange(n + 5)[None, :]
    ref = _ref(qq, kk, vv, 0.5, mask=(jj >= ii + 3) & (jj <= ii + 9))
    assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


# ---- a score plus a bias: the exp reads the max's score -------------------------------------------
def test_biased_score_is_scaled_once_for_the_exp():
    """ALiBi's score ``s * scale + slope * (j - i)``: on a fully visible tile the exp2 reads the
    score the max read, times log2(e) once (the sum is not formed again from scaled terms)."""
    kern = _kernel_src(af.compile(EX["alibi"]).source, "alibi_attn_hopper")
    full = next(b for h, b in _loops(kern).items() if "tl.range(a, b" in h)
    score = re.search(r"_r\d+ = tl\.max\((_t\d+), axis=1\)", full).group(1)
    assert re.search(rf"_t\d+ = {score} \* 1\.4426950408889634\n", full), full
    assert len(re.findall(r"_dot_\d+ \* ", full)) == 1   # the dot product scaled once (in the score)
    assert full.count("tl.exp2(") == 2


@pytest.mark.parametrize("n", [50, 133])
def test_alibi_float64_large_slopes(n, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern = af.compile(EX["alibi"])
    g = _seed()
    qq, kk, vv = (torch.randn(1, 3, n, 16, generator=g) for _ in range(3))
    slope = torch.rand(3, generator=g) * 4
    o = kern(q=qq, k=kk, v=vv, slope=slope, block_j=16)
    ii, jj = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = _ref(qq, kk, vv, EX["SCALE"], lambda s: s + slope.double()[:, None, None] * (jj - ii),
               mask=jj <= ii)
    assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("min_full", [2, 3])
@pytest.mark.parametrize("n,window", [(100, 40), (150, 64)])
def test_short_full_runs_join_the_masked_loop_float64(n, window, min_full, monkeypatch):
    """ContractionGen.MIN_FULL: a run of fewer fully visible tiles goes through the masked loop
    (the mask evaluated on it too); the same values against float64, fresh inputs."""
    from acefuse.codegen.contraction import ContractionGen
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ContractionGen, "MIN_FULL", min_full)
    prog = _attend(f"band{window}", af.where((j <= i) & (i - j < window), af.sum(q * k, "d") * 0.3, af.NEG_INF))
    kern = af.compile(prog)
    assert f"few = b - a < {min_full} * BLOCK_J" in kern.source
    g = _seed()
    qq, kk, vv = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    ii, jj = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = _ref(qq, kk, vv, 0.3, mask=(jj <= ii) & (ii - jj < window))
    for path in ("portable", "hopper"):
        o = kern(q=qq, k=kk, v=vv, path=path, block_j=16)
        assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


# ---- the finalize's quotient by the row's sum ------------------------------------------------------
def test_finalize_divides_by_the_rows_reciprocal():
    """o = s / l: the row's reciprocal factors once per row (_rcp_row), a product per element
    (_qdiv: float16/bfloat16 outputs; _div0, correctly rounded, for others: by the output's type)."""
    src = af.compile(EX["causal"]).source
    for name in ("causal_attn", "causal_attn_hopper", "causal_combine"):
        kern = _kernel_src(src, name)
        assert re.search(r"(_fq\d+), (_pq\d+) = _rcp_row\(s2\)", kern), name
        assert re.search(r"_qdiv\(s, s2\[:, None\], _fq\d+\[:, None\], _pq\d+\[:, None\], o_ptr\)", kern), name
        assert "_div0(" not in kern


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_finalize_quotient_float64(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern = af.compile(EX["causal"])
    g = _seed()
    n = 61
    qq, kk, vv = (torch.randn(1, 2, n, 32, generator=g).to(dtype) for _ in range(3))
    vv = (vv.float() * torch.logspace(-30, 30, 32)).to(dtype) if dtype == torch.float32 else vv
    o = kern(q=qq, k=kk, v=vv)
    assert o.dtype == dtype
    ii, jj = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = _ref(qq, kk, vv, EX["SCALE"], mask=jj <= ii)
    rel = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = ref.abs().amax(dim=(0, 1, 2), keepdim=True).clamp_min(1e-300)   # per value column
    assert ((o.double() - ref).abs() / scale).max().item() <= rel
