"""The launch plans reused per call signature (issue 12: the host cost of a region call).

The row family's generated ``run()`` works out a call's checks, sizes, output shapes, tiles and
grid once per signature (each input's shape, strides, dtype and device, and the launch
options) and reuses them; the frontend's regions work out their input and output adapters once
per specialisation. These tests change one part of the signature at a time after a plan is
cached (strides, a non-contiguous view, dtype, device) and compare every result with an
independent float64 reference; bad input after a cached good call must still raise the errors
a fresh launcher raises, and is never cached.
"""
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


def _errors(mod, good):
    """(type, message) of each bad call."""
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
    assert "must be float32, float16 or bfloat16, got torch.float64" in fresh[0][1]
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
