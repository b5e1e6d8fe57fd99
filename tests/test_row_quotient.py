"""Division by a per-row value in the row family's elementwise outputs (issue 15).

Written to a float16/bfloat16 output, ``a / s`` (s one value per row, from a reduction) is
``(a * f) * p`` with the row's reciprocal factors of ``_rcp_row`` (codegen/row.py): one
division per row instead of one correctly rounded division per element, within 1.5 ulp of
float32 before the output's own rounding. Written to a float32 output (float32 inputs, or
``out_dtypes``), the division stays correctly rounded (``tl.div_rn``), bit for bit torch's.
Under a rounding (cast, round) or a comparison the quotient is never the cheap one.

Every test draws fresh random inputs (the seed is in the message) and compares against an
independent float64 reference, through every row schedule, at odd sizes, with a fully masked
row (0/0 -> 0)."""
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import acefuse as af

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "norms.py"))
SCHEDULES = [("single", {}), ("loop", {"block_j": 64}), ("split", {"block_j": 64, "nsplit": 3})]
_K = {}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _gen():
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    return torch.Generator().manual_seed(seed), seed


def _softmax():
    if "softmax" not in _K:
        x = af.tensor("x", "r j")
        m = af.max(x, "j")
        e = af.exp(x - m)
        _K["softmax"] = af.compile(af.program("quot_softmax", y=e / af.sum(e, "j")))
    return _K["softmax"]


def _quot():
    if "quot" not in _K:
        x, w = af.tensor("x", "r j"), af.tensor("w", "r j")
        _K["quot"] = af.compile(af.program("quot_div", y=x / af.sum(w, "j")))
    return _K["quot"]


def _units(got, want):
    """|got - want| in units of the 16-bit format (ordered bit patterns); equal infinities and
    NaN against NaN count 0, anything else against NaN or an infinity counts 2**20."""
    def ordered(t):
        b = t.view(torch.int16).to(torch.int64)
        return torch.where(b < 0, -(b & 0x7FFF), b)
    d = (ordered(got) - ordered(want)).abs()
    gn, wn = torch.isnan(got), torch.isnan(want)
    d = torch.where(gn & wn, 0, d)
    d = torch.where(gn ^ wn, 1 << 20, d)
    gi, wi = torch.isinf(got), torch.isinf(want)
    return torch.where(gi | wi, torch.where(got == want, 0, 1 << 20), d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_softmax_every_schedule_against_float64(dtype):
    """Softmax with a fully masked row: 16-bit outputs at most one unit from the float64 value
    rounded once (nearly all equal to it); float32 within a few ulp; the masked row 0."""
    k = _softmax()
    g, seed = _gen()
    for (rows, cols), (sched, kw) in zip([(5, 1823), (3, 301), (4, 781)], SCHEDULES):
        x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 4).to(dtype)
        x[1] = float("-inf")
        ref = torch.softmax(x.double(), -1)
        ref[1] = 0.0
        y = k(x=x, schedule=sched, **kw)
        what = f"{sched} {rows}x{cols} {dtype} seed {seed}"
        assert y.dtype == dtype, what
        assert (y[1] == 0).all(), f"{what}: the fully masked row is not 0"
        if dtype == torch.float32:
            err = ((y.double() - ref).abs() / ref.abs().clamp_min(1e-38)).max().item()
            assert err < 2e-6, f"{what}: relative error {err:.2e}"
        else:
            u = _units(y, ref.to(dtype))
            assert u.max() <= 1, f"{what}: {int((u > 1).sum())} elements off by more than one unit"
            assert (u == 0).double().mean() > 0.99, f"{what}: {int((u > 0).sum())} elements not rounded once"


@pytest.mark.parametrize("name", ["log_softmax", "layernorm", "rmsnorm", "cross_entropy", "softmax_lse"])
def test_norms_in_bfloat16_every_schedule(name):
    """The norms examples (whose outputs divide by, or scale by, a per-row value) in bfloat16,
    odd sizes, against float64 torch."""
    k = _K.setdefault(name, af.compile(EX[name]))
    g, seed = _gen()
    for sched, kw in SCHEDULES:
        if sched == "split" and not k.fusion.passes[0].split_ok:
            continue
        rows, cols = 3, 517
        x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3).to(torch.bfloat16)
        w = (torch.rand(cols, generator=g, dtype=torch.float64) + 0.5).to(torch.bfloat16)
        b = torch.randn(cols, generator=g, dtype=torch.float64).to(torch.bfloat16)
        t = torch.randint(0, cols, (rows,), generator=g)
        inp = {"x": x, "w": w, "b": b, "t": t}
        xd, wd, bd = x.double(), w.double(), b.double()
        refs = {"log_softmax": lambda: {"y": torch.log_softmax(xd, -1)},
                "layernorm": lambda: {"y": F.layer_norm(xd, (cols,), wd, bd, eps=EX["EPS"])},
                "rmsnorm": lambda: {"y": F.rms_norm(xd, (cols,), wd, eps=1e-6)},
                "cross_entropy": lambda: {"loss": F.cross_entropy(xd, t, reduction="none")},
                "softmax_lse": lambda: {"y": torch.softmax(xd, -1), "lse": torch.logsumexp(xd, -1)}}
        ref = refs[name]()
        names = {"log_softmax": ("x",), "layernorm": ("x", "w", "b"), "rmsnorm": ("x", "w"),
                 "cross_entropy": ("x", "t"), "softmax_lse": ("x",)}[name]
        out = k(**{n: inp[n] for n in names}, schedule=sched, **kw)
        out = out if isinstance(out, dict) else {next(iter(ref)): out}
        for o, r in ref.items():
            err = (out[o].double() - r).abs() - (2e-2 * r.abs() + 1e-2)
            assert (err <= 0).all(), f"{name}.{o} {sched} seed {seed}: max excess {err.max().item():.3e}"


def _extreme_rows(g, cols=37):
    """Rows of x over rows of w (normal bfloat16 values: Triton's interpreter misreads subnormal
    ones) whose float32 sum is exact and spans the exponent range: subnormal (by cancellation),
    tiny, ordinary, huge, negative, 0 (x zero: 0/0 -> 0; x nonzero: +-inf), +inf and NaN."""
    scales = [None, None, 2.0 ** -120, 1.0, 3.0, -5.0, 2.0 ** 90, 2.0 ** 120, 0.0, 0.0, 1.0, 1.0]
    w = torch.zeros(len(scales), cols, dtype=torch.float64)
    x = torch.zeros(len(scales), cols, dtype=torch.float64)
    mag = torch.tensor([2.0 ** -126, 2.0 ** -60, 1e-3, 1.0, 7.0, 2.0 ** 60, 2.0 ** 126]).double()
    for i, s in enumerate(scales):
        if s is None:   # 2^-126 (1 + k 2^-7) - 2^-126 = k 2^-133 (row 0) or k 2^-130 (row 1)
            k = int(torch.randint(1, 100, (1,), generator=g))
            w[i, 0], w[i, 1] = 2.0 ** -126 * (1 + k * 2.0 ** (-7 + 3 * i)), -(2.0 ** -126)
        else:
            w[i] = torch.randint(1, 4, (cols,), generator=g).double() * s   # exact sums (< 2^7 units)
        pick = torch.randint(0, len(mag), (cols,), generator=g)
        x[i] = torch.randn(cols, generator=g, dtype=torch.float64).sign() * mag[pick] * (
            1 + torch.randint(0, 128, (cols,), generator=g).double() / 128)
    x[8] = 0.0        # 0 / 0 -> 0
    x[8, ::3] = -0.0
    w[10, 5] = float("inf")          # s = +inf: x / inf = 0
    w[11, 3], w[11, 4] = float("inf"), float("-inf")   # s = NaN
    x[11, 0] = float("inf")
    return x, w


def test_quotient_by_extreme_row_values_in_bfloat16():
    """y = x / sum_j w, bfloat16: every element within one unit of the float64 quotient rounded
    once (nearly all equal), infinities and NaN where IEEE puts them, 0/0 -> 0."""
    k = _quot()
    g, seed = _gen()
    x, w = _extreme_rows(g)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    s = wb.double().sum(-1, keepdim=True)
    assert torch.equal(s.float().double(), s) or torch.isnan(s).any()
    ref = xb.double() / s
    ref = torch.where((xb.double() == 0) & (s == 0), torch.zeros_like(ref), ref)
    for sched, kw in SCHEDULES:
        y = k(x=xb, w=wb, schedule=sched, **kw)
        u = _units(y, ref.to(torch.bfloat16))
        assert u.max() <= 1, (f"{sched} seed {seed}: {int((u > 1).sum())} elements off, rows "
                              f"{sorted(set((u > 1).nonzero()[:, 0].tolist()))}")
        assert (u == 0).double().mean() > 0.98, f"{sched} seed {seed}"
        assert (y[8] == 0).all() and torch.isinf(y[9][x[9] != 0]).all() and torch.isnan(y[11]).all()


def test_float32_outputs_keep_correctly_rounded_division():
    """Float32 inputs, and bfloat16 inputs with a float32 output (out_dtypes): bit for bit
    torch's x / s (the exact float32 sum), every schedule."""
    k = _quot()
    g, seed = _gen()
    x, w = _extreme_rows(g)
    x, w = x[:8].float(), w[:8].float()
    s = w.double().sum(-1, keepdim=True).float()
    want = x / s
    assert not torch.equal(x * (1 / s), want), "vacuous: the reciprocal product equals the quotient"
    for sched, kw in SCHEDULES:
        y = k(x=x, w=w, schedule=sched, **kw)
        assert torch.equal(y, want), f"{sched} seed {seed}: {int((y != want).sum())} elements differ"
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        sb = wb.double().sum(-1, keepdim=True).float()
        y = k(x=xb, w=wb, schedule=sched, out_dtypes={"y": torch.float32}, **kw)
        assert y.dtype == torch.float32
        assert torch.equal(y, xb.float() / sb), f"{sched} out_dtypes float32 seed {seed}"


def test_cheap_quotient_only_on_the_way_to_a_plain_output():
    """The generated source: a softmax output takes the row's reciprocal; a quotient under a
    rounding, a cast or a comparison does not."""
    x, w = af.tensor("x", "r j"), af.tensor("w", "r j")
    s = af.sum(w, "j")
    src = open(_quot().kernel.module.__file__).read()
    assert "_rcp_row(" in src and "_qdiv(" in src
    for name, y in (("quot_round", af.round(x / s)), ("quot_cast", af.cast(x / s, "bfloat16")),
                    ("quot_where", af.where(x / s > 0.5, x, w))):
        k = af.compile(af.program(name, y=y))
        src = open(k.kernel.module.__file__).read()
        body = src[src.index(f"def {name}_single"):]
        assert "_qdiv(" not in body and "_div0(" in body, name


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layernorm", "rmsnorm"])
def test_single_tile_narrow_and_held_agree_with_float64(name):
    """The single-tile kernel with the row held as loaded (narrow=True: the outputs recomputed
    from the bfloat16 tile, widened again through its bits) and with its float32 values held
    (narrow=False): the same values, each within bfloat16's rounding of float64 torch, a fully
    masked softmax row 0."""
    k = _softmax() if name == "softmax" else _K.setdefault(name, af.compile(EX[name]))
    src = open(k.kernel.module.__file__).read()
    assert "_rewiden(" in src[src.index("_single("):src.index("_loop(")]
    g, seed = _gen()
    rows, cols = 4, 1531
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3 + (50 if "norm" in name else 0)).to(torch.bfloat16)
    w = (torch.rand(cols, generator=g, dtype=torch.float64) + 0.5).to(torch.bfloat16)
    b = torch.randn(cols, generator=g, dtype=torch.float64).to(torch.bfloat16)
    xd, wd, bd = x.double(), w.double(), b.double()
    if name == "softmax":
        x[2] = float("-inf")
        ref = torch.softmax(x.double(), -1)
        ref[2] = 0.0
        inp = dict(x=x)
    elif name == "log_softmax":
        ref, inp = torch.log_softmax(xd, -1), dict(x=x)
    elif name == "layernorm":
        ref, inp = F.layer_norm(xd, (cols,), wd, bd, eps=EX["EPS"]), dict(x=x, w=w, b=b)
    else:
        ref, inp = F.rms_norm(xd, (cols,), wd, eps=1e-6), dict(x=x, w=w)
    outs = [k(**inp, schedule="single", narrow=nar) for nar in (True, False)]
    assert torch.equal(outs[0], outs[1]), f"{name} seed {seed}: narrow and held differ"
    err = (outs[0].double() - ref).abs() - (2 ** -8 * ref.abs() + 1e-6)
    assert (err <= 0).all(), f"{name} seed {seed}: max excess {err.max().item():.3e}"


@pytest.mark.parametrize("name", ["softmax", "layernorm", "cross_entropy"])
def test_single_tile_full_tiles_against_float64(name):
    """Rows of a power-of-two length, a multiple of the rows per tile: the single-tile kernel's
    unmasked variant (EVEN), bfloat16, against float64 torch, a fully masked softmax row 0; and
    the same values as the masked kernel (the first row's length one shorter is not EVEN)."""
    k = _softmax() if name == "softmax" else _K.setdefault(name, af.compile(EX[name]))
    g, seed = _gen()
    rows, cols = 4, 2048
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3).to(torch.bfloat16)
    w = (torch.rand(cols, generator=g, dtype=torch.float64) + 0.5).to(torch.bfloat16)
    b = torch.randn(cols, generator=g, dtype=torch.float64).to(torch.bfloat16)
    t = torch.randint(0, cols, (rows,), generator=g)
    if name == "softmax":
        x[1] = float("-inf")
        ref = torch.softmax(x.double(), -1)
        ref[1] = 0.0
        inp = dict(x=x)
    elif name == "layernorm":
        ref, inp = F.layer_norm(x.double(), (cols,), w.double(), b.double(), eps=EX["EPS"]), dict(x=x, w=w, b=b)
    else:
        ref, inp = F.cross_entropy(x.double(), t, reduction="none"), dict(x=x, t=t)
    got = k(**inp, schedule="single", block_r=2)
    plan = next(p for p in k.kernel.module._PLANS.values() if p.schedule == "single" and p.n_j == cols)
    assert plan.kw["EVEN"], plan.kw
    err = (got.double() - ref).abs() - (2 ** -8 * ref.abs() + 1e-6)
    assert (err <= 0).all(), f"{name} seed {seed}: max excess {err.max().item():.3e}"
    masked = k(**inp, schedule="single", block_j=4096, block_r=2)   # n_j < BLOCK_J: masked
    assert torch.equal(got, masked), f"{name} seed {seed}: EVEN and masked kernels differ"


@pytest.mark.parametrize("sched,kw", [("loop", {"block_j": 256}), ("split", {"block_j": 256, "nsplit": 3})])
def test_loop_and_split_full_tiles_against_float64(sched, kw):
    """A row length that is a multiple of the tile (loop and split kernels' EVEN): softmax in
    bfloat16 with a fully masked row, against float64, and bit-equal to a tile that does not
    divide it (masked tiles)."""
    k = _softmax()
    g, seed = _gen()
    x = (torch.randn(4, 1536, generator=g, dtype=torch.float64) * 3).to(torch.bfloat16)
    x[2] = float("-inf")
    ref = torch.softmax(x.double(), -1)
    ref[2] = 0.0
    got = k(x=x, schedule=sched, block_r=2, **kw)
    plan = next(p for p in k.kernel.module._PLANS.values() if p.schedule == sched and p.n_j == 1536
                and p.kw["BLOCK_J"] == 256)
    assert plan.kw["EVEN"], plan.kw
    u = _units(got, ref.to(torch.bfloat16))
    assert u.max() <= 1 and (u == 0).double().mean() > 0.99, f"{sched} seed {seed}"
    masked = k(x=x, schedule=sched, block_r=2, **dict(kw, block_j=1024))   # 1536 = 1.5 tiles
    assert not next(p for p in k.kernel.module._PLANS.values() if p.schedule == sched and p.n_j == 1536
                    and p.kw["BLOCK_J"] != 256).kw["EVEN"]
    assert (_units(got, masked) <= 1).all(), f"{sched} seed {seed}: EVEN and masked tiles disagree"
