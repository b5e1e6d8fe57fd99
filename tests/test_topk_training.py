"""Training through top-k routing (issue 11): top-k of the softmax probabilities keeps its
one-pass fusion when its input requires grad.

af.topk's values are written as the operand at each candidate's position (acefuse/topk.py),
so af.backward differentiates a gather (the adjoint scattered to the chosen position) and the
augmented forward saves what the one pass already carries: the candidates, the max and sum of
the softmax, the renormaliser. Checked here: the augmented forward of examples/moe.py's
``softmax_topk(k)`` is one pass; the differentiable kernel runs every schedule the plain kernel
runs (single, loop, split); its outputs and gradients match float64 torch autograd of the
plain math (softmax, a stable descending sort, gather, renormalise) on fresh random logits with
exact ties, near-ties, odd expert counts, in float32, float16 and bfloat16, and never fall back
to torch.

Tolerance per gradient element: ``u |ref| + 64 * 2^-24 * T``, u the unit roundoff of the
gradient's type (the kernel rounds its float32 result once; 0 for float32) and T the largest
term the gradient is a sum of, ``2 k max|cot|``: ``grad x_j = sum_r a_r p_r (delta_j,i_r - p_j)``
with ``a_r p_r = (cot_r - sum_s cot_s w_s) p_r / sum_s v_s`` and ``p_r <= sum_s v_s``. A
gradient scaled by ``1 + 8u`` (1.001 in float32) fails it (test_the_checker_fails_on_a_scaled_gradient).
"""
import runpy
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import acefuse as af
from acefuse.autograd import GradientFallbackWarning

MOE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "moe.py"))
SCHED = [dict(schedule="single"), dict(schedule="loop", block_j=8), dict(schedule="split", block_j=8, nsplit=3)]
UNIT = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
_K: dict = {}


def kernel(k, select="probs"):
    if (k, select) not in _K:
        _K[(k, select)] = af.compile(MOE["softmax_topk"](k, select=select))
    return _K[(k, select)]


def logits(t, e, seed, dtype):
    """Fresh random router logits with adversarial rows: exact ties (integers), a tied top
    value, a near-tie whose float32 probabilities are equal, a large offset, one finite expert
    (the others masked with -inf: chosen with probability 0, gradient 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e, generator=g, dtype=torch.float64) * 2
    x[0] = torch.randint(0, 3, (e,), generator=g).double()        # many exact ties
    if t > 1:
        x[1, : e // 2] = x[1].max()                                  # the top value e // 2 times
    if t > 2:
        x[2] += 40.0                                                 # softmax's shift
    if t > 3 and e > 2:
        x[3] = -3.0
        x[3, 0], x[3, e - 1] = 0.5, 0.5 + 2.0 ** -22                  # equal float32 probabilities
    if t > 4:
        x[4, 1:] = -float("inf")                                     # masked experts: chosen with p = 0
    return x.to(dtype)


def reference(x, k, cot, select="probs"):
    """float64 outputs and gradient of the plain math: softmax, the first k of a stable
    descending sort (equal values: the lower index; a float32 tie of probabilities is no tie
    in float64: the larger logit), the chosen values renormalised."""
    x = x.detach().double().requires_grad_()
    p = torch.softmax(x, -1)
    idx = torch.sort(x if select == "logits" else p, dim=-1, descending=True, stable=True).indices[:, :k]
    if select == "logits":
        w = torch.exp(x.gather(-1, idx) - x.amax(-1, keepdim=True))
    else:
        w = p.gather(-1, idx)
    w = w / w.sum(-1, keepdim=True)
    (g,) = torch.autograd.grad(w, x, cot.double())
    return w.detach(), idx, g


def close(got, ref, cot, dtype, what):
    u = UNIT[dtype]
    terms = 2 * cot.shape[-1] * cot.double().abs().max()
    bound = u * ref.abs() + 64 * 2.0 ** -24 * terms
    err = (got.double() - ref).abs()
    assert torch.isfinite(got).all(), f"{what}: non-finite gradient"
    assert (err <= bound).all(), (f"{what}: {int((err > bound).sum())} of {err.numel()} off, max error "
                                  f"{err.max().item():.3g} (scale {ref.abs().max().item():.3g})")


def run(k, x, sched, seed, select="probs"):
    """(weights, experts, grad_x, cotangent) of the differentiable kernel; no torch fallback."""
    kern = kernel(k, select)
    xl = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        out = kern(x=xl, **sched)
        cot = torch.randn(out["weights"].shape, generator=torch.Generator().manual_seed(seed + 1)).to(x.dtype)
        (g,) = torch.autograd.grad(out["weights"], xl, cot)
    assert kern.grad_fallback is None, kern.grad_fallback
    return out["weights"], out["experts"], g, cot


def check(k, t, e, dtype, sched, seed, select="probs"):
    x = logits(t, e, seed, dtype)
    w, i, g, cot = run(k, x, sched, seed, select)
    rw, ri, rg = reference(x, k, cot, select)
    what = f"top-{k} {select} {dtype} {sched} ({t}, {e}) seed {seed}"
    assert torch.equal(i, ri), f"{what}: experts {i.tolist()} != {ri.tolist()}"
    assert torch.allclose(w.double(), rw, rtol=2 * UNIT[dtype] + 1e-6, atol=1e-6), f"{what}: weights"
    close(g, rg, cot, dtype, what)
    assert rg.abs().max() > 1e-3, f"{what}: reference gradient ~ 0"


def test_the_augmented_forward_of_top_k_of_softmax_is_one_pass():
    """The saved values are candidates and softmax states, not the selection cascade's levels
    and counts (fails with af.topk's values written as the cascade's levels: 'not fusible')."""
    prog = MOE["softmax_top2"]
    bwd = af.backward(prog)
    f = af.fuse(bwd.augmented)
    assert f.fusible and len(f.passes) == 1, f.reason
    assert f.certificate.ok, f.certificate.summary()
    assert af.fuse(prog).fusible
    assert set(bwd.saved_kind.values()) <= {"max", "sum", "value"}
    # the backward: the softmax's sum_e(scattered adjoint * p), then the elementwise gradient
    # (with the values as a max over a one-hot, its hit counts took one more pass: not fusible)
    fb = af.fuse(bwd)
    assert fb.fusible, fb.reason


@pytest.mark.parametrize("sched", SCHED, ids=lambda s: s["schedule"])
def test_top2_of_softmax_trains_on_every_schedule(sched):
    """float32 and bfloat16, odd expert count, every schedule of the plain kernel."""
    for dtype in (torch.float32, torch.bfloat16):
        check(2, 6, 37, dtype, sched, 11)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_top_k_of_softmax_gradients_odd_sizes(dtype):
    """k = 3 over 7 and 65 experts (split: three chunks), k = 2 over 3."""
    check(3, 5, 7, dtype, SCHED[2], 3)
    check(3, 4, 65, dtype, SCHED[1], 4)
    check(2, 4, 3, dtype, SCHED[0], 5)


@pytest.mark.slow
def test_top_k_of_logits_gradients():
    """``select='logits'`` (the weights exp(v - m) renormalised) trains on the split schedule too."""
    for dtype in (torch.float32, torch.bfloat16):
        check(3, 5, 19, dtype, SCHED[2], 6, select="logits")


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 8])
def test_top_k_of_softmax_gradients_sweep(k):
    for seed, e in enumerate([k, k + 1, 67]):
        for dtype in UNIT:
            for sched in SCHED:
                check(k, 7, e, dtype, sched, 100 * k + seed)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_top_k_of_softmax_gradients_hypothesis(data):
    """k, expert count, rows, type, schedule, logits (with their adversarial rows) drawn."""
    draw = data.draw
    k = draw(st.integers(2, 4))
    check(k, draw(st.integers(1, 7)), draw(st.integers(k, 70)), draw(st.sampled_from(list(UNIT))),
          draw(st.sampled_from(SCHED)), draw(st.integers(0, 2**31 - 1)),
          select=draw(st.sampled_from(["probs", "logits"])))


def test_the_checker_fails_on_a_scaled_gradient():
    """The tolerance is tight enough: a gradient 1 + 8u times the true one fails (1.001 in float32)."""
    for dtype, s in ((torch.float32, 1.001), (torch.bfloat16, 1 + 8 * 2.0 ** -8)):
        x = logits(5, 19, 7, dtype)
        w, i, g, cot = run(2, x, SCHED[1], 7)
        rg = reference(x, 2, cot)[2]
        close(g, rg, cot, dtype, "unbroken")
        with pytest.raises(AssertionError, match="off, max error"):
            close((g.double() * s).to(dtype), rg, cot, dtype, "scaled")
