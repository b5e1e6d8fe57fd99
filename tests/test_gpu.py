"""On a CUDA GPU: the generated kernels (benchmarks/kernels/, exported by
benchmarks/export.py; they need only torch and triton) against float64 torch,
at odd sizes, head dims 16..256 and every dtype. Skipped without a GPU.

    python3 -m pytest -q tests/test_gpu.py      # or: python3 tests/test_gpu.py
"""
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
KDIR = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"
SCALE = 1.0 / math.sqrt(128)   # the constant baked into examples/attention.py
TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}   # relative (norm-wise)


def load(name):
    """A generated module: exported now when acefuse (egglog) is importable, else the one
    exported beforehand (``python benchmarks/export.py``; generated code is never committed)."""
    path = KDIR / f"{name}.py"
    if not path.exists():
        try:
            import runpy
            runpy.run_path(str(KDIR.parent / "export.py"), run_name="__main__")
        except (ImportError, SystemExit) as exc:
            if not path.exists():
                pytest.skip(f"benchmarks/kernels/{name}.py is missing and cannot be generated here "
                            f"({exc}); run `python benchmarks/export.py` first")
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attn_ref(q, k, v, causal=False):
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * SCALE
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i, -math.inf)
    return torch.softmax(s, -1) @ v


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,causal", [("attention", False), ("causal", True)])
def test_attention_head_dims_and_dtypes(name, causal, D, dtype):
    g = torch.Generator(device="cuda").manual_seed(D)
    q = torch.randn(2, 3, 257, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(2, 3, 333, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(2, 3, 333, D, device="cuda", generator=g).to(dtype)
    mod = load(name)
    for sched in ("loop", "split"):
        o = mod.run(q=q, k=k, v=v, schedule=sched)
        torch.cuda.synchronize()
        assert rel(o, attn_ref(q, k, v, causal)) < TOL[dtype], (name, D, dtype, sched)


def _hopper_module(name):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the Hopper path needs capability 9.0 (TMA)")
    mod = load(name)
    if not getattr(mod, "HOPPER", None):
        pytest.skip(f"benchmarks/kernels/{name}.py has no Hopper kernel (exported before issue 15?)")
    return mod


@pytest.mark.parametrize("D", [16, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,causal", [("attention", False), ("causal", True)])
def test_attention_hopper_path(name, causal, D, dtype):
    """Issue 15: the Hopper kernel (TMA descriptors, pipelined key loop) at odd sizes, with its
    default tiles and a smaller pipelined shape; 16-bit inputs take it automatically, a layout
    TMA cannot read (keys transposed in memory) falls back to the portable kernel."""
    mod = _hopper_module(name)
    g = torch.Generator(device="cuda").manual_seed(D + 1)
    q = torch.randn(2, 3, 257, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(2, 3, 333, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(2, 3, 333, D, device="cuda", generator=g).to(dtype)
    ref = attn_ref(q, k, v, causal)
    small = [dict(path="hopper", block_i=128, block_j=64, num_warps=4, num_stages=3)]
    for kw in [dict(path="hopper")] + (small if dtype != torch.float32 and D <= 128 else []):
        o = mod.run(q=q, k=k, v=v, **kw)
        torch.cuda.synchronize()
        assert rel(o, ref) < TOL[dtype], (name, D, dtype, kw)
    assert mod.hopper_ok(dict(q=q, k=k, v=v), q.device, dtype) == (dtype != torch.float32)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not mod.hopper_ok(dict(q=q, k=kt, v=v), q.device, dtype)
    assert rel(mod.run(q=q, k=kt, v=v), ref) < TOL[dtype]


@pytest.mark.parametrize("name,causal", [("attention", False), ("causal", True)])
def test_attention_hopper_tuned(name, causal):
    """A problem big enough to be tuned: the Hopper candidates are timed (those that do not fit
    shared memory skipped) and the fastest runs; the portable path still computes the same."""
    mod = _hopper_module(name)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 16, 2048, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    ref = attn_ref(q, k, v, causal)
    for path in (None, "hopper", "portable"):
        o = mod.run(q=q, k=k, v=v, path=path)
        torch.cuda.synchronize()
        assert rel(o, ref) < TOL[torch.bfloat16], (name, path)


def test_attention_hopper_warp_specialized():
    """The Hopper kernel with its main loop warp-specialized (tl.range(warp_specialize=True));
    run apart from the others (a compiler crash there should not take the suite down)."""
    mod = _hopper_module("causal")
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    o = mod.run(q=q, k=k, v=v, path="hopper", ws=True)
    torch.cuda.synchronize()
    assert rel(o, attn_ref(q, k, v, True)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("L", [1, 100, 4097])
def test_decode_and_gqa(L):
    g = torch.Generator(device="cuda").manual_seed(L)
    B, G, R, D = 3, 4, 8, 128
    q = torch.randn(B, G * R, 1, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(B, G, L, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(B, G, L, D, device="cuda", generator=g, dtype=torch.bfloat16)
    o = load("decode").run(q=q.view(B, G, R, 1, D), k=k, v=v)
    assert rel(o.reshape(B, G * R, 1, D), attn_ref(q, k, v)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("cols", [1, 777, 8192, 70001, 262144])
def test_rows_on_gpu(cols):
    g = torch.Generator(device="cuda").manual_seed(cols)
    rows = 5 if cols > 70000 else 37
    x = torch.randn(rows, cols, device="cuda", generator=g).to(torch.bfloat16) * 4
    w = torch.rand(cols, device="cuda", generator=g).to(torch.bfloat16) + 0.5
    b = torch.randn(cols, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.randint(0, cols, (rows,), device="cuda", generator=g)
    xd = x.double()
    cases = [("softmax", dict(x=x), torch.softmax(xd, -1)),
             ("layernorm", dict(x=x, w=w, b=b), F.layer_norm(xd, (cols,), w.double(), b.double(), eps=1e-5)),
             ("cross_entropy", dict(x=x, t=t), F.cross_entropy(xd, t, reduction="none"))]
    for name, inputs, ref in cases:
        mod = load(name)
        scheds = [None, "loop"] + (["split"] if mod.SPLIT else [])
        for sched in scheds:
            out = mod.run(**inputs, schedule=sched)
            torch.cuda.synchronize()
            err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()
            assert err < 3e-2, (name, cols, sched, err)


if __name__ == "__main__":  # no pytest on the machine: run every case directly
    import itertools
    import sys
    failed = 0
    cases = ([(test_attention_head_dims_and_dtypes, a) for a in itertools.product(
        [("attention", False), ("causal", True)], [16, 32, 64, 128, 256],
        [torch.float32, torch.float16, torch.bfloat16])]
        + [(test_decode_and_gqa, (L,)) for L in (1, 100, 4097)]
        + [(test_rows_on_gpu, (c,)) for c in (1, 777, 8192, 70001, 262144)])
    for fn, args in cases:
        if fn is test_attention_head_dims_and_dtypes:
            (name, causal), D, dt = args
            args = (name, causal, D, dt)
        try:
            fn(*args)
        except Exception as exc:  # report every failure
            failed += 1
            print("FAIL", fn.__name__, args, repr(exc)[:300])
    print(f"{len(cases) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


# ---- issue 13: the mask and score gallery (examples/masks.py) on the GPU ----------------------------
# kernels exported beforehand where egglog is installed: python examples/masks.py --export
MASK_GALLERY = ["causal", "prefix_lm", "sliding_window", "dilated_sliding_window", "block_diagonal",
                "block_causal", "natten_2d", "document_mask", "relative_bias", "t5_buckets", "additive_mask",
                "boolean_mask", "alibi", "softcap", "sigmoid_attention", "relu_attention", "mla_split_scores",
                "paged_kv"]


def _mask_kernel(name):
    path = KDIR / f"mask_{name}.py"
    if not path.exists():
        if importlib.util.find_spec("egglog") is None:
            pytest.skip(f"benchmarks/kernels/mask_{name}.py is missing; run `python examples/masks.py --export`")
        import runpy
        runpy.run_path(str(KDIR.parent.parent / "examples" / "masks.py"))["export"](KDIR)
    spec = importlib.util.spec_from_file_location(f"gpu_mask_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MASK_GALLERY)
def test_mask_gallery_on_gpu(name, dtype):
    import runpy
    gal = runpy.run_path(str(KDIR.parent.parent / "examples" / "masks.py"))
    mod = _mask_kernel(name)
    inputs = gal["make_inputs"](name, B=2, H=4, N=1000, dtype=dtype, seed=13)
    ref = gal["reference"](name, inputs).cuda()
    dev = {n: t.cuda() for n, t in inputs.items() if n in mod.TENSORS}
    for sched in (None, "loop", "split"):
        out = mod.run(**dev, schedule=sched)
        torch.cuda.synchronize()
        assert out.dtype == dtype and not torch.isnan(out).any(), (name, sched)
        err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()
        assert err < TOL[dtype], (name, dtype, sched, err)


# ---- issue 14: quantization at copy bandwidth: hardware casts and the per-row division ------------
# (compiled here through af.compile: the GPU script installs egglog; compare with the interpreter's
# emulated path, checked bit for bit on the CPU by tests/test_quant.py)
def _native_ok():
    return torch.cuda.get_device_capability() >= (9, 0)


def _corner_floats(n, seed):
    """float32 values of every kind (random bit patterns, normal values at all scales) with the
    corners of each format at the front: NaN, +-inf, -0.0, past the largest finite value (448,
    464, 480, 500, 1e30; 57344, 61439.996, 61440, 65504, 65520), subnormals of each format and
    exact ties between two neighbours."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_quant import _random_floats
    x = _random_floats((n,), torch.Generator().manual_seed(seed))
    fixed = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 448.0, -448.0, 449.0, 463.99997, 464.0, 464.00003,
             479.99997, 480.0, 500.0, -500.0, 1e30, -1e30, 3.4e38, 57344.0, 61439.996, 61440.0, -61440.0, 65504.0,
             65519.996, 65520.0, 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 5 * 2.0 ** -11,
             2.0 ** -14, 2.0 ** -16, 2.0 ** -17, 3 * 2.0 ** -18, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-40, -1e-45,
             1.0625, 1.1875, -1.0625, 1.125, 1.25 + 2.0 ** -4, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11,
             1.0 + 3 * 2.0 ** -11, 2.5, -3.5, 127.5, -128.5]
    x[:len(fixed)] = torch.tensor(fixed)
    return x


def test_quant_module_takes_the_native_path():
    import acefuse as af
    if not _native_ok():
        pytest.skip("hardware float8 conversions need compute capability >= 9.0 (the emulated path runs)")
    k = af.compile(af.program("native_probe", y=af.cast(af.tensor("x", "r j") * 1.0, "float8_e4m3fn")))
    assert bool(k.kernel.module.NATIVE), "NATIVE is False on a CUDA GPU of compute capability >= 9.0"


@pytest.mark.parametrize("schedule", ["single", "loop", "split"])
def test_cast_native_path_is_bit_exact_with_torch(schedule):
    """Every float cast on the native path (hardware conversions with fix-ups), stored in its
    format (``c_``, one conversion of the operand) and as a float32 value (``v_``), bit for bit:
    torch's .to() for float16/bfloat16/e5m2, and for e4m3fn the documented saturation (torch
    2.13's .to(); torch 2.11's CUDA cast gives NaN from 480 on, so its target is clamped)."""
    import acefuse as af
    x = af.tensor("x", "r j")
    fmts = ("float8_e4m3fn", "float8_e5m2", "float16", "bfloat16")
    outs = {f"c_{f}": af.cast(x * 1.0, f) for f in fmts}
    outs.update({f"v_{f}": af.cast(x * 1.0, f) * 1.0 for f in fmts})
    outs["n"] = af.sum(x * 0.0 + 1.0, "j")
    k = af.compile(af.program("casts_native", **outs))
    xv = _corner_floats(64 * 999, 14).reshape(64, 999).cuda()
    kw = {} if schedule == "single" else {"block_j": 128, **({"nsplit": 3} if schedule == "split" else {})}
    out = k(x=xv, schedule=schedule, **kw)
    for f in fmts:
        src = torch.where(xv.isnan(), xv, xv.clamp(-448.0, 448.0)) if f == "float8_e4m3fn" else xv
        want = src.to(getattr(torch, f))
        got = out[f"c_{f}"]
        assert got.dtype == want.dtype
        nan = want.float().isnan()
        bad = (got.float().isnan() != nan) | (~nan & (got.view(torch.uint8 if got.element_size() == 1 else torch.int16)
                                                     != want.view(torch.uint8 if want.element_size() == 1 else torch.int16)))
        assert not bad.any(), (f, schedule, int(bad.sum()), xv[bad][:6].tolist(), got[bad][:6].float().tolist())
        v, wf = out[f"v_{f}"], want.float()
        bad = (v.isnan() != wf.isnan()) | (~wf.isnan() & (v.view(torch.int32) != wf.view(torch.int32)))
        assert not bad.any(), (f, "value", schedule, int(bad.sum()), xv[bad][:6].tolist(), v[bad][:6].tolist())


QUANT_ROWS = 300


def test_quant_native_path_matches_torch():
    """examples/quant.py (fp8 e4m3, e5m2, int8) on the GPU: q bit-exact with torch's cast of
    x / scale (tensor division: IEEE on CUDA) on random data at several scales, rows with
    zeros, NaN, infinities and subnormals, bfloat16 and float32 inputs; float8 inputs (every
    byte) are read exactly."""
    import runpy
    import acefuse as af
    ex = runpy.run_path(str(KDIR.parent.parent / "examples" / "quant.py"))
    g = torch.Generator().manual_seed(14)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(QUANT_ROWS, 8192, generator=g) * torch.exp(torch.randn(QUANT_ROWS, 1, generator=g) * 4)).to(dtype)
        x[0] = 0.0
        x[1, :3] = torch.tensor([math.nan, 1.0, 2.0])
        x[2, 5], x[3, 6], x[4, 7:9] = math.inf, -math.inf, torch.tensor([1e-40, -1e-39])
        x[5] = _corner_floats(8192, 3).to(dtype)
        x = x.cuda()
        for name, fmt in (("quant_fp8", torch.float8_e4m3fn), ("quant_e5m2", torch.float8_e5m2), ("quant_int8", None)):
            for sched, kw in ((None, {}), ("loop", {"block_j": 1024})):
                out = af.compile(ex[name])(x=x, schedule=sched, **kw)
                s = out["scale"]
                ref = (x.float().abs().amax(1).double() / {"quant_fp8": 448.0, "quant_e5m2": 57344.0,
                                                           "quant_int8": 127.0}[name]).float()
                assert torch.equal(s.isnan(), ref.isnan()) and torch.equal(s[~ref.isnan()], ref[~ref.isnan()])
                v = x.float() / s[:, None]
                if fmt is None:
                    want = torch.where(v.isnan(), 0.0, v.round().clamp(-127, 127)).to(torch.int8)
                else:
                    want = (torch.where(v.isnan(), v, v.clamp(-448.0, 448.0)) if fmt == torch.float8_e4m3fn else v).to(fmt)
                zero = (s == 0)[:, None]
                wb = torch.where(zero, 0, want.view(torch.uint8).int())
                gb = out["q"].view(torch.uint8).int()
                nan = want.float().isnan() & ~zero
                bad = (gb != wb) & ~(nan & out["q"].float().isnan())
                assert not bad.any(), (name, dtype, sched, int(bad.sum()), x[bad][:5].tolist(), v[bad][:5].tolist())
    xb = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64).cuda()
    k = af.compile(af.program("widen_native", y=af.tensor("x", "r j") * 1.0))
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        got, want = k(x=xb.view(dt)), xb.view(dt).float()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
            torch.where(want.isnan(), 0, got.view(torch.int32)), torch.where(want.isnan(), 0, want.view(torch.int32))), dt


def test_div_by_a_row_value_is_bit_exact_with_torch():
    """x / s (one s per row) against torch's float32 division on CUDA (IEEE): the hardest
    quotients (within ~2^-48 of a midpoint), every kind of dividend, and extreme divisors."""
    import sys
    import numpy as np
    import acefuse as af
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_quant import _near_midpoints, _hard_mantissas
    rng = np.random.default_rng(14)
    rows, cols = 256, 4096
    a, b = _near_midpoints(rng, rows, cols)
    a = torch.from_numpy(a)
    a[rows // 2:] = torch.from_numpy((_hard_mantissas(rng, rows // 2 * cols) * np.exp2(rng.integers(-60, 60, rows // 2 * cols))
                                      ).astype(np.float32)).reshape(rows // 2, cols)
    a[rows - 16:] = _corner_floats(16 * cols, 7).reshape(16, cols)
    special = [0.0, -0.0, -3.0, 2.0 ** -64, 2.0 ** 64, 1e-40, 3e38, math.inf, math.nan, -1e-30, 2.0 ** -70, 2.0 ** 70]
    b[rows - len(special):] = special
    s = torch.from_numpy(b)
    x, s = a.cuda(), s.cuda()
    k = af.compile(af.program("divrow_native", y=af.tensor("x", "r j") / af.tensor("s", "r")))
    for sched, kw in ((None, {}), ("single", {"block_r": 1}), ("loop", {"block_j": 512})):
        got, want = k(x=x, s=s, schedule=sched, **kw), x / s[:, None]
        bad = (got.isnan() != want.isnan()) | (~want.isnan() & (got.view(torch.int32) != want.view(torch.int32)))
        assert not bad.any(), (sched, int(bad.sum()), x[bad][:4].tolist(), got[bad][:4].tolist(), want[bad][:4].tolist())
