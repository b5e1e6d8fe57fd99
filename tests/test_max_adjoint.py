"""The adjoint of a max/min over a computed body (acefuse/backward.py, ``dext``; README: Gradients).

Each program's gradient from af.compile (derived backward kernels under Triton's interpreter) against
float64 torch autograd of the same math written in plain torch here, on the inputs rounded to the
dtype, with planted rows:

- a near tie (float32): the runner-up 2^-19 (relative) from the extremum, inside the old 2^-17
  window, distinct in float32; float32 and float64 torch give the whole adjoint to the extremum;
- an exact tie (every dtype, bf16-like duplicates): torch.amax shares the adjoint equally;
- a fully masked row (masked programs): torch's float64 gradient (0 where the mask is applied last;
  -g/n through the mean of ``max_j(masked(x) - mean_j x)``), never NaN.

Also: the backward of a max over a body that reads another reduction of the row fuses in one pass
(its forward does); where the backward's recomputation misses the saved extremum bit for bit (a
forward that computed it in another fused form), the elements within EXT_REL share the adjoint.
"""
import math

import pytest
import torch

import acefuse as af
from acefuse.backward import EXT_REL

x, w, c = af.tensor("x", "r j"), af.tensor("w", "j"), af.tensor("c", "r j")
R, N = 7, 37
ROWS_TIE, ROWS_NEAR, ROW_MASKED = (0, 1), (2, 3), 4


def _mean(v):
    return af.sum(v, "j") / af.size("j")


def _softmax(v):
    e = af.exp(v - af.max(v, "j"))
    return e / af.sum(e, "j")


def _centered(v):
    return v - v.mean(-1, keepdim=True)


def _masked(b, cm, fill):   # (a fully masked row: the torch reference's amax of all -inf is -inf)
    return torch.where(cm > 0, b, torch.full_like(b, fill))


# name -> (program, "max" | "min", body in torch (the reference's max/min is taken over it), masked)
PROGS = {
    "max_centered": (af.program("ma_max_centered", y=af.max(x - _mean(x), "j")), "max",
                     lambda x, w, c: _centered(x), False),
    "min_centered": (af.program("ma_min_centered", y=af.min(x - _mean(x), "j")), "min",
                     lambda x, w, c: _centered(x), False),
    "max_xw": (af.program("ma_max_xw", y=af.max(x * w, "j")), "max", lambda x, w, c: x * w, False),
    "softmax_max": (af.program("ma_softmax_max", y=af.max(_softmax(x) * w, "j")), "max",
                    lambda x, w, c: torch.softmax(x, -1) * w, False),
    "masked_max_centered": (af.program("ma_masked_max_centered",
                                       y=af.max(af.where(c > 0, x - _mean(x), af.NEG_INF), "j")), "max",
                            lambda x, w, c: _masked(_centered(x), c, -math.inf), True),
    "masked_then_centered": (af.program("ma_masked_then_centered",
                                        y=af.max(af.where(c > 0, x, af.NEG_INF) - _mean(x), "j")), "max",
                             lambda x, w, c: _masked(x, c, -math.inf) - x.mean(-1, keepdim=True), True),
    "masked_min_xw": (af.program("ma_masked_min_xw", y=af.min(af.where(c > 0, x * w, math.inf), "j")), "min",
                      lambda x, w, c: _masked(x * w, c, math.inf), True),
    "rowmax": (af.program("ma_rowmax", y=af.max(x, "j")), "max", lambda x, w, c: x, False),   # data (control)
}
SCHEDULES = {"single": dict(schedule="single"), "loop": dict(schedule="loop", block_j=16),
             "split": dict(schedule="split", block_j=16, nsplit=3)}
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}   # x max|ref|
_K: dict = {}


def kernel(name):
    if name not in _K:
        _K[name] = af.compile(PROGS[name][0])
    return _K[name]


def _used(name):
    return [n for n in ("x", "w", "c") if n in PROGS[name][0].tensors]


def _ext(kind, b):
    return b.amax(-1) if kind == "max" else b.amin(-1)


def _plant_near(name, ins, rows):
    """Move the runner-up of each row in ``rows`` to 2^-19 (relative) from the extremum of the body
    (Newton on x at the runner-up, float64), on the kept elements."""
    _, kind, body, _ = PROGS[name]
    sgn = 1.0 if kind == "max" else -1.0
    xv = ins["x"]
    for r in rows:
        b = sgn * body(xv, ins["w"], ins["c"])[r]
        a, k = b.topk(2).indices.tolist()

        def gap(v):   # the runner-up's distance to 2^-19 below the extremum
            b = sgn * body(v, ins["w"], ins["c"])[r]
            return b[k] - b[a] + abs(b[a]) * 2.0 ** -19
        for _ in range(30):
            f0, h = gap(xv), 1e-6
            xv[r, k] += h
            d = (gap(xv) - f0) / h
            xv[r, k] -= h + f0 / d
    return ins


def inputs(name, seed, dtype):
    """Inputs over ``dtype`` (returned in float64: exactly the values the kernel gets)."""
    _, kind, body, masked = PROGS[name]
    g = torch.Generator().manual_seed(seed)
    xv = torch.randn(R, N, generator=g, dtype=torch.float64)
    wv = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    wv[1] = wv[0]
    cv = torch.where(torch.rand(R, N, generator=g, dtype=torch.float64) < 0.3, -1.0, 1.0)
    cv[:, :2] = 1.0
    if masked:
        cv[ROW_MASKED] = -1.0
    big = xv.abs().max() + 1.0
    for r in ROWS_TIE:   # an exact tie at the extremum (w[0] == w[1] > 0: the body ties too)
        xv[r, 0] = xv[r, 1] = big if kind == "max" else -big
    ins = {"x": xv, "w": wv, "c": cv}
    if dtype == torch.float32:
        ins = _plant_near(name, {k: v.to(dtype).double() for k, v in ins.items()}, ROWS_NEAR)
    return {k: v.to(dtype).double() for k, v in ins.items()}


def reference(name, ins, cot, dtype=torch.float64):
    _, kind, body, _ = PROGS[name]
    leaves = {n: ins[n].to(dtype).requires_grad_(n != "c") for n in ("x", "w", "c")}
    y = _ext(kind, body(**leaves))
    want = [n for n in _used(name) if n != "c"]
    return y, dict(zip(want, torch.autograd.grad(y, [leaves[n] for n in want], cot.to(dtype))))


def check(name, dtype, sched, seed=1):
    ins = inputs(name, seed, dtype)
    _, kind, body, masked = PROGS[name]
    if dtype == torch.float32 and name != "rowmax":   # the planted near ties are what they claim
        b = body(**ins)
        for r in ROWS_NEAR:
            top = (b[r] if kind == "max" else -b[r]).topk(2).values
            gap = (top[0] - top[1]).item() / abs(top[0].item())
            assert 0 < gap < EXT_REL / 2, (name, r, gap)
    cot = torch.randn(R, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    cot = cot.to(dtype).double()
    leaves = {n: ins[n].to(dtype).requires_grad_(n != "c") for n in _used(name)}
    y = kernel(name)(**leaves, **SCHEDULES[sched])
    want = [n for n in _used(name) if n != "c"]
    got = dict(zip(want, torch.autograd.grad(y, [leaves[n] for n in want], cot.to(dtype))))
    # a fully masked row: torch's float64 gradient too (0 where the mask is the last step before the
    # max; max_j(masked(x) - mean_j x) sends -g/n to each x through the mean: the max's adjoint is
    # shared by its n tied -inf elements, as torch.amax shares it)
    cref = cot
    yref, ref = reference(name, ins, cref)
    assert torch.equal(torch.isinf(yref), torch.isinf(y.double())), name
    fin = torch.isfinite(yref)
    torch.testing.assert_close(y.double()[fin], yref.detach()[fin], rtol=2 * TOL[dtype], atol=1e-6)
    if dtype == torch.float32:   # float32 torch resolves the planted rows as float64 does
        _, ref32 = reference(name, ins, cref, torch.float32)
        assert all((ref32[n].double() - ref[n]).abs().max() < 1e-5 * ref[n].abs().max() for n in ref)
    for n in want:
        gv = got[n].double()
        assert torch.isfinite(gv).all(), f"{name} {dtype} {sched}: grad {n} not finite"
        err = (gv - ref[n]).abs()
        bound = TOL[dtype] * ref[n].abs().max() + TOL[dtype] * ref[n].abs()
        assert (err <= bound).all(), (f"{name} {dtype} {sched}: grad {n} off by {err.max().item():.3g} "
                                      f"(scale {ref[n].abs().max().item():.3g}) in rows "
                                      f"{sorted(set((err > bound).nonzero()[:, 0].tolist()))}")
    if masked:   # the masked row was compared (its reference is finite), not skipped
        assert torch.isfinite(ref["x"][ROW_MASKED]).all()
        if name == "masked_then_centered":
            assert (ref["x"][ROW_MASKED] != 0).all()


@pytest.mark.parametrize("name", list(PROGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gradient_matches_float64_autograd(name, dtype):
    """Near ties (float32), exact ties (bf16-like duplicates), fully masked rows; the loop schedule."""
    check(name, dtype, "loop")


@pytest.mark.parametrize("name", list(PROGS))
@pytest.mark.parametrize("sched", ["single", "split"])
def test_gradient_under_every_schedule(name, sched):
    if sched == "split" and not af.fuse(PROGS[name][0]).fusible:
        pytest.skip("the forward has no split schedule (several passes)")
    check(name, torch.float32, sched, seed=2)


@pytest.mark.parametrize("name", ["max_centered", "min_centered", "max_xw", "masked_then_centered", "masked_min_xw"])
def test_backward_fuses_where_the_forward_does(name):
    """The adjoint g * r(count) * [hit] summed over the axis (to reach the mean's adjoint) factors
    into g * r(count) * count: no reduction of the backward depends on another one over j."""
    p = PROGS[name][0]
    assert af.fuse(p).fusible
    f = af.fuse(af.backward(p))
    assert f.fusible, f.reason[:400]


@pytest.mark.parametrize("nudge", [math.inf, -math.inf])
def test_a_recomputation_that_misses_the_saved_max_shares_within_the_window(nudge):
    """A forward computing the extremum in another fused form may save a value 1 ulp from every
    recomputed element: no element equals it, so the elements within EXT_REL of it get the adjoint
    (without that fallback the gradient would be 0 on those rows)."""
    p = PROGS["max_centered"][0]
    bwd = af.backward(p)
    fwd = af.compile(bwd.augmented)
    bk = af.compile(bwd)
    g = torch.Generator().manual_seed(5)
    xv = torch.randn(R, N, generator=g)
    saved = {n: v for n, v in fwd(x=xv).items() if n in bwd.saved}
    saved["saved_m"] = torch.nextafter(saved["saved_m"], torch.full_like(saved["saved_m"], nudge))
    cot = torch.randn(R, generator=g)
    got = bk(x=xv, grad_y=cot, **saved)["grad_x"]
    _, ref = reference("max_centered", {"x": xv.double(), "w": torch.ones(N), "c": torch.ones(R, N)}, cot.double())
    torch.testing.assert_close(got.double(), ref["x"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["max", "min"])
def test_an_infinite_extremum_in_the_data_gets_the_adjoint(kind):
    """A row holding +inf has max +inf: the adjoint goes to that element (torch: d amax = g at it),
    while a fully masked row (max -inf; a min's +inf) keeps gradient 0. Before, the backward read
    both infinities of a saved extremum as 0, so the +inf row's adjoint went to elements near 0
    (1/3 each to three others in this program: a silent wrong gradient)."""
    x, c = af.tensor("x", "r j"), af.tensor("c", "r j")
    red, big, fill = (af.max, math.inf, af.NEG_INF) if kind == "max" else (af.min, -math.inf, math.inf)
    prog = af.program(f"inf_{kind}", y=red(af.where(c > 0, x * 2.0, fill), "j"))
    k = af.compile(prog)
    g = torch.Generator().manual_seed(11)
    X = torch.randn(4, 9, generator=g, dtype=torch.float64)
    C = torch.ones(4, 9, dtype=torch.float64)
    X[1, 4] = big            # data: the extremum is infinite
    C[2] = 0                 # a fully masked row
    cot = torch.randn(4, generator=g, dtype=torch.float64)
    xl = X.float().requires_grad_()
    got, = torch.autograd.grad(k(x=xl, c=C.float()), xl, cot.float())
    xr = X.clone().requires_grad_()
    body = torch.where(C > 0, xr * 2, torch.full_like(xr, -math.inf if kind == "max" else math.inf))
    want, = torch.autograd.grad(body.amax(1) if kind == "max" else body.amin(1), xr, cot)
    want[2] = 0              # the convention for a fully masked row (torch: amax of all -inf splits g)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert got[1, 4] != 0 and (got[1, :4] == 0).all()


def test_an_overflowing_adjoint_of_the_max_leaves_the_other_elements_zero():
    """float16 ``((x * -2) * max_j(w))**3`` with inputs whose adjoint of the max passes float16's
    range (fuzz seed 11303): the elements that are not the max get exactly 0, as float64 autograd
    says. Before, the adjoint was written ``g * r(n) * [hit]``, so an infinite ``g`` made them
    ``inf * 0 = NaN`` (torch's own float16 autograd gives NaN there too)."""
    from acefuse.fuzz_backward import make_grad_inputs
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    k = af.compile(af.program("max_adjoint_overflow", y=((x * (-2.0)) * af.max(w, "j")) ** 3))
    ins = make_grad_inputs(kind="wide", R=4, J=50, dtype="float16", seed=729384108, w_axes="j")
    lv = {n: t.clone().requires_grad_() for n, t in ins.items()}
    y = k(**lv)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gw, = torch.autograd.grad(y, lv["w"], cot.to(torch.float16))
    ref = {n: t.detach().double().requires_grad_() for n, t in ins.items()}
    want, = torch.autograd.grad(((ref["x"] * -2.0) * ref["w"].amax()) ** 3, ref["w"], cot)
    hit = ins["w"].double() == ins["w"].double().max()
    assert hit.sum() == 1 and (want[~hit] == 0).all() and want[hit].abs().item() > torch.finfo(torch.float16).max
    assert (gw[~hit] == 0).all(), gw[~hit]


def test_a_max_over_a_body_made_infinite_by_a_masked_max_keeps_gradient_zero():
    """Fuzz --backward seed 11304 (long): a saved max that is -inf because its body is -inf as data
    (x + a fully masked max) was read as 0 by the backward everywhere, like a masked row's shift, so
    the recomputed ``x + 0 > 0`` turned true and a gradient of up to 0.8 flowed where float64 gives 0.
    The backward now reads a saved max as 0 only where it is subtracted (guard_masked_shifts), as
    the forward does."""
    x = af.tensor("x", "r j")
    t1 = x + af.max(af.where(af.index("j") >= 33.0, x + (0.01 * af.index("j")), af.NEG_INF), "j")
    k = af.compile(af.program("max_of_masked_shift", o0=af.sum(af.where(t1 > af.max(t1, "j"), t1, 0.0), "j")))
    X = torch.randn(3, 7, generator=torch.Generator().manual_seed(5))
    xl = X.clone().requires_grad_()
    y = k(x=xl)
    assert (y == 0).all()          # forward: every t1 is -inf, nothing is above the max (as float64)
    g, = torch.autograd.grad(y, xl, torch.randn(3, generator=torch.Generator().manual_seed(6)))
    assert (g == 0).all(), g       # float64 autograd: 0 everywhere
