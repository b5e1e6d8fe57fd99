"""Riders (codegen/riders.py): a backward stage of sums over rows (a norm's weight and bias
gradients) computed in the pass of the stage fused over the feature axis, its partial sums
folded over the programs. Gradients against float64 torch autograd of the plain math
(written here, not by acefuse), fresh random inputs, odd shapes, two row axes; the rider
stage still runs alone when the persistent kernel does not (rows longer than one tile, a
schedule option); and a fold that loses a program's partial is caught by these checks."""
import pytest
import torch

import acefuse as af
import acefuse.autograd as aga
from acefuse.codegen import riders as rd

TOL = (2e-5, 2e-6)   # |got - ref| <= RTOL * |ref| + STOL * max|ref| (float32 kernels)


def _close(got, ref):
    got = got.double()
    bound = TOL[0] * ref.abs() + TOL[1] * ref.abs().max()
    return bool(((got - ref).abs() <= bound).all()), (got - ref).abs().max().item()


def _layernorm(axes="r j"):
    x = af.tensor("x", axes)
    j = axes.split()[-1]
    w, b = af.tensor("w", j), af.tensor("b", j)
    mu = af.mean(x, j)
    var = af.mean((x - mu) ** 2, j)
    return af.program("ln_r", y=(x - mu) * af.rsqrt(var + 1e-5) * w + b)


def _rmsnorm():
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    return af.program("rms_r", y=x * af.rsqrt(af.mean(x * x, "j") + 1e-6) * w)


def _ref_layernorm(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + 1e-5) * w + b


def _ref_rmsnorm(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def _grads(kernel, ref_fn, shapes, seed, **run):
    g = torch.Generator().manual_seed(seed)
    leaves = {n: (torch.randn(s, generator=g) * (1.5 if n == "x" else 1.0) + (0.3 if n == "x" else 0.0))
              for n, s in shapes.items()}
    got = {n: t.clone().requires_grad_() for n, t in leaves.items()}
    y = kernel(**got, **run)
    cot = torch.randn(y.shape, generator=g)
    y.backward(cot)
    ref = {n: t.double().requires_grad_() for n, t in leaves.items()}
    ref_fn(**ref).backward(cot.double())
    return {n: (got[n].grad, ref[n].grad) for n in leaves}


@pytest.fixture(scope="module")
def ln():
    return af.compile(_layernorm())


def _bk(kernel):
    kernel._grad_kernels()
    return kernel._bwd_kernel


def test_layernorm_weight_and_bias_ride_the_input_gradient_pass(ln):
    bk = _bk(ln)
    assert bk._riders, "the weight/bias stage should ride the grad_x stage"
    host = bk.kernels[next(iter(bk._riders.values()))]
    assert sorted(host.module.RIDERS) == ["grad_b", "grad_w"]
    for seed, (R, N) in enumerate([(37, 100), (5, 16), (64, 33)]):
        for n, (got, ref) in _grads(ln, _ref_layernorm, {"x": (R, N), "w": (N,), "b": (N,)}, seed).items():
            ok, err = _close(got, ref)
            assert ok, f"grad of {n} at {R}x{N}: max error {err}"


def test_rmsnorm_weight_rides_and_matches():
    k = af.compile(_rmsnorm())
    assert _bk(k)._riders
    for n, (got, ref) in _grads(k, _ref_rmsnorm, {"x": (23, 70), "w": (70,)}, 7).items():
        ok, err = _close(got, ref)
        assert ok, f"grad of {n}: max error {err}"


@pytest.mark.slow   # a second layernorm derivation (70 s on 2 busy cores)
def test_two_row_axes():
    k = af.compile(_layernorm("b t c"))
    bk = _bk(k)
    got = _grads(k, _ref_layernorm, {"x": (3, 11, 40), "w": (40,), "b": (40,)}, 3)
    for n, (g, r) in got.items():
        ok, err = _close(g, r)
        assert ok, f"grad of {n}: max error {err}"
    # whether or not its stage rode (the staging over two row axes may nest the sums),
    # the gradients are right; when it rode, the host's module says so
    for b, a in bk._riders.items():
        assert bk.kernels[a].module.RIDERS


def test_rider_stage_runs_alone_under_another_schedule(ln, monkeypatch):
    bk = _bk(ln)
    folds = []
    real = aga.BackwardKernel._fold_riders
    monkeypatch.setattr(aga.BackwardKernel, "_fold_riders",
                        lambda self, *a: (folds.append(1), real(self, *a))[1])
    for n, (got, ref) in _grads(ln, _ref_layernorm, {"x": (9, 50), "w": (50,), "b": (50,)}, 11,
                                schedule="loop").items():
        ok, err = _close(got, ref)
        assert ok, f"grad of {n} (loop schedule): max error {err}"
    assert not folds, "a schedule option must run the rider stage itself"
    _grads(ln, _ref_layernorm, {"x": (9, 50), "w": (50,), "b": (50,)}, 12)
    assert folds, "the default schedule should fold the riders"
    assert bk._riders


def test_a_fold_that_loses_a_partial_is_caught(ln, monkeypatch):
    monkeypatch.setattr(rd, "fold", lambda partials, dtype: partials[1:].sum(0).to(dtype))
    got = _grads(ln, _ref_layernorm, {"x": (40, 24), "w": (24,), "b": (24,)}, 5)
    assert not _close(*got["w"])[0] and not _close(*got["b"])[0]
    assert _close(*got["x"])[0]


def test_rider_bodies_only_take_sums_over_exactly_the_row_axes():
    x, w, t = af.tensor("x", "r j"), af.tensor("w", "j"), af.tensor("t", "r j")
    first = af.program("f", y=x * w / af.sum(x, "j"))
    fusion = af.fuse(first)
    ok = af.program("s", gw=af.sum(x * x, "r"))
    assert rd.rider_bodies(first, fusion, ok) is not None
    assert rd.rider_bodies(first, fusion, af.program("m", gw=af.max(x, "r"))) is None
    assert rd.rider_bodies(first, fusion, af.program("o", gw=af.sum(x * t, "r"))) is None
    assert rd.rider_bodies(first, fusion, af.program("n", gw=af.sum(x, "j"))) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_riders_on_the_gpu(dtype):
    """The persistent rider kernel on CUDA (many programs, each folding several row blocks):
    layernorm gradients against float64 autograd from the same (rounded) inputs."""
    k = af.compile(_layernorm())
    g = torch.Generator(device="cuda").manual_seed(0)
    R, N = 3001, 1000
    leaves = {"x": torch.randn(R, N, device="cuda", generator=g).to(dtype) * 2 + 0.5,
              "w": torch.randn(N, device="cuda", generator=g).to(dtype),
              "b": torch.randn(N, device="cuda", generator=g).to(dtype)}
    got = {n: t.clone().requires_grad_() for n, t in leaves.items()}
    y = k(**got)
    cot = torch.randn(y.shape, device="cuda", generator=g).to(dtype)
    y.backward(cot)
    assert _bk(k)._riders
    ref = {n: t.double().requires_grad_() for n, t in leaves.items()}
    _ref_layernorm(**ref).backward(cot.double())
    rtol, stol = (TOL if dtype == torch.float32 else (1.6e-2, 4e-3))
    for n in leaves:
        a, r = got[n].grad.double(), ref[n].grad
        assert ((a - r).abs() <= rtol * r.abs() + stol * r.abs().max()).all(), \
            f"grad of {n} ({dtype}): max error {(a - r).abs().max().item()}"
