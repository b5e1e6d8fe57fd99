"""The launch plans reused per call signature (issue 12: the host cost of a region call).

The row family's generated ``run()`` works out a call's checks, sizes, output shapes, tiles and
grid once per signature (each input's shape, strides, dtype and device, and the launch
options) and reuses them; the frontend's regions work out their input and output adapters once
per specialisation. These tests change one part of the signature at a time after a plan is
cached (strides, a non-contiguous view, dtype, device) and compare every result with an
independent float64 reference; bad input after a cached good call must still raise the errors
a fresh launcher raises, and is never cached.
"""
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af

TOL = {torch.float32: (2e-6, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@pytest.fixture(scope="module")
def softmax_kernel():
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    p = af.exp(x - m)
    s = af.sum(p, "j")
    return af.compile(af.program("lc_softmax", y=p / s, lse=m + af.log(s)))


def _ref(x):
    x = x.double()
    return torch.softmax(x, -1), torch.logsumexp(x, -1)


def _check(out, x):
    y, lse = _ref(x)
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out["y"].double(), y, atol=atol, rtol=rtol)
    torch.testing.assert_close(out["lse"].double(), lse, atol=atol, rtol=rtol)


def _variants(g):
    base = torch.randn(6, 45, generator=g) * 4
    wide = torch.randn(6, 90, generator=g) * 4
    return [
        ("contiguous", base),
        ("transposed strides", torch.randn(45, 6, generator=g).t()),   # same shape, strides (1, 6)
        ("a strided slice", wide[:, ::2]),                                # non-contiguous, strides (90, 2)
        ("a narrowed row view", wide[:, 3:48]),                           # same shape and strides as none above
        ("bfloat16", base.bfloat16()),
        ("float16", base.half()),
        ("contiguous again", torch.randn(6, 45, generator=g)),
    ]


def test_a_cached_plan_is_reused_only_for_its_signature(softmax_kernel):
    mod = softmax_kernel.module
    mod._PLANS.clear()
    g = torch.Generator().manual_seed(11)
    seen = set()
    for what, x in _variants(g):
        out = mod.run(x=x)
        _check(out, x)
        seen.add((tuple(x.shape), x.stride(), x.dtype))
        assert len(mod._PLANS) == len(seen), what
        # the same signature again, fresh values: the cached plan, the right result
        x2 = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        x2.copy_(torch.randn(x.shape, generator=g) * 4)
        assert x2.stride() == x.stride()
        _check(mod.run(x=x2), x2)
        assert len(mod._PLANS) == len(seen), what
        # a positional call takes the full path every time, and agrees
        _check(mod.run(x2), x2)


def test_each_launch_option_is_part_of_the_signature(softmax_kernel):
    mod = softmax_kernel.module
    mod._PLANS.clear()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 70, generator=g) * 3
    for kw in ({}, {"schedule": "loop", "block_j": 16}, {"schedule": "split", "block_j": 16},
               {"schedule": "split", "block_j": 16, "nsplit": 2}, {"schedule": "single"},
               {"out_dtypes": {"y": torch.bfloat16}}):
        out = mod.run(x=x, **kw)
        if "out_dtypes" in kw:
            assert out["y"].dtype == torch.bfloat16 and out["lse"].dtype == torch.float32
            y, lse = _ref(x)
            torch.testing.assert_close(out["y"].double(), y, atol=4e-3, rtol=8e-3)   # one bf16 rounding
            torch.testing.assert_close(out["lse"].double(), lse, atol=2e-6, rtol=2e-5)
        else:
            _check(out, x)
    assert len(mod._PLANS) == 6


def test_a_signature_without_strides_would_give_wrong_results(softmax_kernel, monkeypatch):
    """The check above can fail: a cache keyed on shapes and dtypes only reuses the strides of the
    first call for a transposed input, and the result is wrong."""
    mod = softmax_kernel.module
    mod._PLANS.clear()

    def no_strides(inputs, options):
        return (options,) + tuple((a.shape, a.dtype, a.device) for a in inputs.values())
    monkeypatch.setattr(mod, "_signature", no_strides)
    g = torch.Generator().manual_seed(13)
    mod.run(x=torch.randn(6, 45, generator=g))
    xt = torch.randn(45, 6, generator=g).t()
    with pytest.raises(AssertionError):
        _check(mod.run(x=xt), xt)
    mod._PLANS.clear()


def test_the_device_is_part_of_the_signature(softmax_kernel):
    mod = softmax_kernel.module
    a = torch.empty(4, 8)
    b = torch.empty(4, 8, device="meta")
    assert mod._signature({"x": a}, ()) != mod._signature({"x": b}, ())
    assert mod._signature({"x": a}, ()) == mod._signature({"x": torch.empty(4, 8)}, ())
    assert mod._signature({"x": a, "z": a}, ()) is None          # not exactly the inputs: full checks
    assert mod._signature({"x": a.numpy()}, ()) is None


@pytest.mark.gpu
def test_another_device_index_gets_its_own_plan(softmax_kernel):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    mod = softmax_kernel.module
    g = torch.Generator().manual_seed(14)
    x = torch.randn(6, 45, generator=g)
    for d in ("cuda:0", "cuda:1", "cuda:0"):
        out = mod.run(x=x.to(d))
        assert out["y"].device == torch.device(d)
        _check({k: v.cpu() for k, v in out.items()}, x)


def _errors(mod, good, bad=None):
    """(type, message) of each bad call (``bad``: keyword sets; default, the row kernel's)."""
    if bad is None:
        bad = [dict(x=good.double()), dict(x=good[0]), dict(), dict(x=good, z=good), dict(x=good.numpy()),
               dict(x=good[:, :0]), dict(x=good.int()), dict(x=good, schedule="tiles")]
    out = []
    for kw in bad:
        with pytest.raises((TypeError, ValueError)) as e:
            mod.run(**kw)
        out.append((type(e.value), str(e.value)))
    return out


def test_bad_input_raises_the_same_errors_after_a_cached_call(softmax_kernel):
    mod = softmax_kernel.module
    good = torch.randn(3, 20)
    mod._PLANS.clear()
    fresh = _errors(mod, good)                   # no plan cached
    assert not mod._PLANS
    assert "is torch.float64, which its kernel does not read; it accepts float32" in fresh[0][1]
    assert "has 1 dimensions but is declared with axes 'r j'" in fresh[1][1]
    assert "needs inputs ['x']" in fresh[2][1] and "has no input(s) ['z']" in fresh[3][1]
    assert "must be a torch.Tensor" in fresh[4][1] and "an empty axis" in fresh[5][1]
    assert "unknown schedule 'tiles'" in fresh[7][1]
    _check(mod.run(x=good), good)                # a plan cached for the good signature
    assert _errors(mod, good) == fresh
    assert len(mod._PLANS) == 1                  # no bad call was cached


def test_the_plan_cache_is_bounded(softmax_kernel):
    mod = softmax_kernel.module
    mod._PLANS.clear()
    x = torch.randn(2, 9)
    mod.run(x=x)
    for n in range(mod.MAX_PLANS - 1):       # (stand-ins for as many other signatures)
        mod._PLANS[("another signature", n)] = None
    y = torch.randn(3, 9)
    _check(mod.run(x=y), y)                  # a new signature in a full cache: the cache starts over
    assert len(mod._PLANS) == 1
    _check(mod.run(x=x), x)
    assert len(mod._PLANS) == 2
    mod._PLANS.clear()


# -- the frontend: a region's adapters, worked out on its first call ---------------------------
def _rms(x, w):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * w


def _rms_ref(x, w):
    x, w = x.double(), w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_a_region_called_with_other_strides_and_dtypes_matches_float64():
    g = torch.Generator().manual_seed(21)
    w = torch.randn(24, generator=g)
    f = af.compile(_rms)
    cases = [torch.randn(3, 5, 24, generator=g),
             torch.randn(24, 5, 3, generator=g).permute(2, 1, 0),          # same shape, other strides
             torch.randn(3, 5, 48, generator=g)[..., ::2],                 # non-contiguous
             torch.randn(3, 5, 24, generator=g).bfloat16(),                # another dtype: a new specialisation
             torch.randn(3, 5, 24, generator=g)]
    with torch.no_grad():
        for x in cases:
            ww = w.to(x.dtype)
            got = f(x, ww)
            atol, rtol = TOL[x.dtype]
            torch.testing.assert_close(got.double(), _rms_ref(x, ww), atol=atol * 4, rtol=rtol * 4)
    assert sum(r.calls["kernel"] for r in f.regions) == len(cases)
    assert len(f.graphs) == 2


def test_a_region_in_training_with_other_strides_matches_float64_gradients():
    g = torch.Generator().manual_seed(22)
    w = torch.randn(16, generator=g)
    f = af.compile(_rms)
    for x0 in (torch.randn(4, 16, generator=g), torch.randn(16, 4, generator=g).t(),
               torch.randn(4, 32, generator=g)[:, 1::2]):
        x = x0.clone().requires_grad_(True) if x0.is_contiguous() else x0.detach().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        cot = torch.randn(4, 16, generator=g)
        y = f(x, ww)
        gx, gw = torch.autograd.grad(y, (x, ww), cot)
        xr, wr = x0.detach().double().requires_grad_(True), w.double().requires_grad_(True)
        yr = _rms_ref(xr, wr)
        rx, rw = torch.autograd.grad(yr, (xr, wr), cot.double())
        torch.testing.assert_close(y.double(), yr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx.double(), rx, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gw.double(), rw, atol=1e-5, rtol=1e-4)
    assert sum(r.calls["grad"] for r in f.regions) == 3


# -- the contraction family: decode's launch plan (issue 12: the host work of a short kernel) -----
EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))


@pytest.fixture(scope="module")
def decode_kernel():
    return af.compile(EX["decode"])


def _decode_inputs(g, n_kv=40, dtype=torch.float32):
    return dict(q=torch.randn(2, 2, 4, 1, 16, generator=g).to(dtype),
                k=torch.randn(2, 2, n_kv, 16, generator=g).to(dtype),
                v=torch.randn(2, 2, n_kv, 16, generator=g).to(dtype))


def _decode_check(out, ins):
    q, k, v = (ins[n].double() for n in "qkv")
    s = torch.einsum("bgrid,bgjd->bgrij", q, k) * EX["SCALE"]
    ref = torch.einsum("bgrij,bgje->bgrie", torch.softmax(s, -1), v)
    atol, rtol = TOL[ins["q"].dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


class _Counted:
    """A kernel whose launches are counted, then run."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def test_a_warm_decode_call_is_the_launches_only(decode_kernel, monkeypatch):
    """The second call of a signature checks nothing again and plans nothing: it launches
    (one kernel for the loop, the partial states and their merge for split-KV)."""
    mod = decode_kernel.module
    mod._PLANS.clear()
    work, launches = [], []
    for f in ("_prepare", "_plan"):
        real = getattr(mod, f)
        monkeypatch.setattr(mod, f, lambda *a, _f=f, _real=real, **k: work.append(_f) or _real(*a, **k))
    for f in ("decode_attn", "decode_part", "decode_combine"):
        monkeypatch.setattr(mod, f, _Counted(getattr(mod, f), launches))
    g = torch.Generator().manual_seed(31)
    for schedule, n_launch in ((None, 1), ("split", 2)):
        ins = _decode_inputs(g)
        work.clear()
        _decode_check(mod.run(**ins, schedule=schedule), ins)
        assert work == ["_prepare", "_plan"]
        for _ in range(3):
            ins = _decode_inputs(g)
            work.clear(), launches.clear()
            with torch.no_grad():
                _decode_check(decode_kernel(**ins, schedule=schedule), ins)
            assert work == [] and len(launches) == n_launch, (schedule, work, launches)
    assert len(mod._PLANS) == 2


def test_decode_plans_follow_the_signature(decode_kernel):
    """Strides (a transposed key cache, a slice of a longer cache), dtype and the alignment of
    a base pointer each give a plan of their own, and every result matches float64."""
    mod = decode_kernel.module
    mod._PLANS.clear()
    g = torch.Generator().manual_seed(32)
    base = _decode_inputs(g)
    flat = torch.randn(2 * 2 * 40 * 16 + 1, generator=g)
    variants = [
        ("contiguous", base),
        ("keys stored transposed", dict(base, k=torch.randn(2, 2, 16, 40, generator=g).transpose(-1, -2))),
        ("a slice of a longer cache", dict(base, k=torch.randn(2, 2, 64, 16, generator=g)[:, :, :40],
                                           v=torch.randn(2, 2, 64, 16, generator=g)[:, :, :40])),
        ("keys at an unaligned base", dict(base, k=flat[1:].view(2, 2, 40, 16))),
        ("bfloat16", {n: t.bfloat16() for n, t in base.items()}),
        ("contiguous again", _decode_inputs(g)),
    ]
    plans = set()
    for what, ins in variants:
        _decode_check(mod.run(**ins), ins)
        plans.add(mod._signature(ins, ())[0][1:])
        assert len(mod._PLANS) == len(plans), what
        again = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(torch.randn(t.shape, generator=g))
                 for n, t in ins.items()}
        _decode_check(mod.run(**again), again)
        assert len(mod._PLANS) == len(plans), what
        _decode_check(mod.run(again["q"], again["k"], again["v"]), again)   # positional: the full path
    assert len(plans) == 5
    mod._PLANS.clear()


def test_a_growing_kv_cache_reuses_a_plan_per_power_of_two(decode_kernel):
    """Views of the first n positions of one cache, n growing: one plan per power-of-two class
    of n (the schedule, tiles and scan bound are the same across it), each call launched with
    its own length (split-KV: its own chunks), every result against float64."""
    mod = decode_kernel.module
    mod._PLANS.clear()
    g = torch.Generator().manual_seed(35)
    q = torch.randn(2, 2, 4, 1, 16, generator=g)
    kc, vc = (torch.randn(2, 2, 80, 16, generator=g) for _ in range(2))
    for schedule in (None, "split"):
        for n in (17, 20, 31, 32, 33, 47, 64, 65, 80):
            ins = dict(q=q, k=kc[:, :, :n], v=vc[:, :, :n])
            _decode_check(mod.run(**ins, schedule=schedule, block_j=16), ins)
    assert len(mod._PLANS) == 2 * 3          # classes 32, 64, 128 per schedule
    with pytest.raises(ValueError, match="axis 'j' of program 'decode' has length 33 in one input and 34 in 'v'"):
        mod.run(q=q, k=kc[:, :, :33], v=vc[:, :, :34], schedule="split", block_j=16)
    mod._PLANS.clear()


def test_the_hopper_switch_and_alignment_are_part_of_the_signature(decode_kernel, monkeypatch):
    """ACEFUSE_HOPPER, read on every call, and a base address the TMA copies cannot take each
    change the kernel a plan launches."""
    mod = decode_kernel.module
    mod._PLANS.clear()
    monkeypatch.delenv("ACEFUSE_HOPPER", raising=False)
    g = torch.Generator().manual_seed(33)
    ins = _decode_inputs(g)

    def kernel_of(ins):
        n = len(mod._PLANS)
        _decode_check(mod.run(**ins), ins)
        assert len(mod._PLANS) == n + 1          # a signature of its own
        return list(mod._PLANS.values())[-1].kernel
    assert kernel_of(ins) == "loop"
    monkeypatch.setenv("ACEFUSE_HOPPER", "1")        # the Hopper kernel, forced (interpreter)
    assert kernel_of(ins) == "hopper"
    flat = torch.randn(ins["k"].numel() + 1, generator=g)
    assert kernel_of(dict(ins, k=flat[1:].view(ins["k"].shape))) == "loop"
    monkeypatch.setenv("ACEFUSE_HOPPER", "0")
    assert kernel_of(ins) == "loop"
    assert len(mod._PLANS) == 4
    mod._PLANS.clear()


def test_decode_bad_input_raises_the_same_errors_after_a_cached_call(decode_kernel):
    mod = decode_kernel.module
    g = torch.Generator().manual_seed(34)
    good = _decode_inputs(g)
    bad = [dict(good, q=good["q"].double()), dict(good, k=good["k"][0]), {n: good[n] for n in "qk"},
           dict(good, z=good["q"]), dict(good, v=good["v"].numpy()), dict(good, v=good["v"][:, :, :0]),
           dict(good, k=good["k"][:, :, :7]), dict(good, schedule="tiles"), dict(good, path="tma")]
    mod._PLANS.clear()
    fresh = _errors(mod, good, bad)
    assert not mod._PLANS
    assert "unknown schedule 'tiles'" in fresh[7][1] and "unknown path 'tma'" in fresh[8][1]
    assert "axis 'j' of program 'decode' has length 7 in one input and 40 in 'v'" in fresh[6][1]
    _decode_check(mod.run(**good), good)
    assert _errors(mod, good, bad) == fresh and len(mod._PLANS) == 1
    mod._PLANS.clear()


@pytest.mark.gpu
def test_decode_launches_the_kernel_its_timing_chose():
    """A decode whose programs cannot fill the GPU times loop against split-KV (two launches, or
    one: split1 and its TMA variant); the loop it times is run(schedule='loop')'s (the Hopper
    kernel where it applies). The automatic call must launch that same kernel: before, it launched the portable loop (at KV 4K on an H100,
    881 GB/s where schedule='loop' gave 1742). Output against float64 torch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    mod = af.compile(EX["decode"]).module
    B, G, R, L, D = 8, 8, 4, 4096, 128
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, G, R, 1, D, generator=g)
    k, v = torch.randn(B, G, L, D, generator=g), torch.randn(B, G, L, D, generator=g)
    ins = {n: t.to("cuda", torch.bfloat16) for n, t in dict(q=q, k=k, v=v).items()}
    out = mod.run(**ins)
    # a choice is (schedule, block_j[, nsplit, num_warps, path, num_stages]): the one-launch
    # split (session 14) is timed too, with and without its TMA variant
    chosen = list(mod._SCHEDULES.values())
    plans = [p for key, p in mod._PLANS.items() if key[0][0] is None]   # schedule=None: the automatic call
    assert chosen and plans, "the automatic call should have timed its schedule and kept a plan"
    sched, path = chosen[-1][0], (chosen[-1][4] if len(chosen[-1]) > 4 else None)
    if sched == "loop":
        want = "hopper" if mod.hopper_ok(ins, torch.device("cuda"), torch.bfloat16) else "loop"
    elif sched == "split1":
        want = "split1_hopper" if path == "hopper" else "split1"
    else:
        want = "split"
    assert plans[-1].kernel == want, f"timed {chosen[-1]}, launched {plans[-1].kernel}"
    s = torch.einsum("bgrid,bgjd->bgrij", ins["q"].double(), ins["k"].double()) / D ** 0.5
    ref = torch.einsum("bgrij,bgjd->bgrid", torch.softmax(s, -1), ins["v"].double())
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err


class _OnDevice1(torch.Tensor):
    """A CPU tensor that reports itself on cuda:1 (the device guard's view of an input)."""
    is_cuda = property(lambda self: True)
    device = property(lambda self: torch.device("cuda", 1))

    def get_device(self):
        return 1


@pytest.mark.parametrize("family", ["row", "contraction"])
def test_launcher_enters_the_inputs_device(softmax_kernel, decode_kernel, monkeypatch, family):
    """The generated run() is wrapped by _on_input_device (45c612f): inputs on a CUDA device other
    than the current one launch inside torch.cuda.device(theirs) (Triton launches on the current
    device: 'Pointer argument cannot be accessed'); inputs on the current device or the CPU enter
    nothing. The GPU test above checks it on two devices; this one checks the guard on the CPU."""
    mod = (softmax_kernel if family == "row" else decode_kernel).module
    assert getattr(mod.run, "__wrapped__", None) is not None, "run() has no device guard"
    entered = []

    class Rec:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            entered.append(torch.device(self.d))

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)   # (what the guard reads)
    monkeypatch.setattr(torch.cuda, "device", Rec)
    seen = []
    guarded = mod._on_input_device(lambda *a, **k: seen.append((a, k)) or "ran")
    x = torch.randn(3, 5)
    assert guarded(x=x) == "ran" and entered == []
    fake = x.as_subclass(_OnDevice1)
    assert guarded(x=fake) == "ran" and entered == [torch.device("cuda", 1)]
    assert guarded(fake, schedule="loop") == "ran" and len(entered) == 2 and len(seen) == 3
