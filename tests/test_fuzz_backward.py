"""The fuzzer's gradient mode (acefuse/fuzz_backward.py): random cascaded programs through
``af.backward`` and ``af.compile``'s differentiable kernels, against float64 torch autograd
of the fuzzer's reference. Its oracle must be able to fail (a gradient off by 1% or
transposed is flagged), a short fixed-seed run must be clean, and each bug it found has a
regression test against float64 autograd of the plain math written here."""
import math
import os
import warnings

import pytest
import torch

import acefuse as af
from acefuse import fuzz as fz
from acefuse import fuzz_backward as fb
from acefuse.autograd import GradientFallbackWarning

# the default run: a few programs per seed (the whole file under 40 s on an idle 2-core CPU)
FAST = {1: 3}


def _grads(prog, inputs: dict, cots: dict, **run_kw):
    """{input: gradient} of af.compile(prog)'s differentiable kernel; no fallback to torch."""
    dk = af.compile(prog)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        out = dk(**leaves, **run_kw)
        out = out if isinstance(out, dict) else {next(iter(prog.outputs)): out}
        got = torch.autograd.grad([out[k] for k in cots], list(leaves.values()), list(cots.values()))
    return dict(zip(leaves, got))


def _autograd64(fn, inputs: dict, cots: dict):
    leaves = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    out = fn(**leaves)
    got = torch.autograd.grad([out[k] for k in cots], list(leaves.values()), [c.double() for c in cots.values()])
    return dict(zip(leaves, got))


def _close(got: dict, ref: dict):
    for k, r in ref.items():
        g = got[k].double()
        assert g.shape == r.shape, (k, g.shape, r.shape)
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-6), (k, (g - r).abs().max().item())


# ---- regressions: each bug class the gradient fuzzer found, on its smallest program --------------------
@pytest.mark.parametrize("sched", ["single", "loop"])
def test_mean_gradient_needs_the_reduced_axis_length(sched):
    # grad_x = grad_o / size(j) ranges over r only: the backward stage read no tensor over j,
    # so its kernel had no j length (NameError: len_j_f) and the gradient fell back to torch
    x = af.tensor("x", "r j")
    prog = af.program("fzb_mean", o=af.sum(x, "j") / af.size("j"))
    xs, cot = torch.randn(3, 40), torch.randn(3)
    got = _grads(prog, {"x": xs}, {"o": cot}, schedule=sched, block_j=16)
    _close(got, _autograd64(lambda x: {"o": x.mean(-1)}, {"x": xs}, {"o": cot}))


@pytest.mark.parametrize("sched", ["single", "loop"])
def test_constant_gradient_along_the_axis_is_expanded(sched):
    # sum_j(x + x) differentiates to 2 grad_o over r: the backward kernel was not given x, so
    # it could not expand the gradient to x's shape (KeyError: 'j' in BackwardKernel)
    x = af.tensor("x", "r j")
    prog = af.program("fzb_sum2", o=af.sum(x + x, "j"))
    xs, cot = torch.randn(2, 7), torch.randn(2)
    got = _grads(prog, {"x": xs}, {"o": cot}, schedule=sched, block_j=16)
    _close(got, _autograd64(lambda x: {"o": (x + x).sum(-1)}, {"x": xs}, {"o": cot}))


@pytest.mark.parametrize("case", ["centred", "lse", "weight"])
def test_adjoint_constant_along_an_axis_is_summed_over_it(case):
    # x - mean_j x inside sum_j gets the adjoint grad_o, constant along j; its per-row operand
    # mean_j x must get -size(j) grad_o (one grad_o per position of j). The backward passed
    # -grad_o: every gradient through such a broadcast was off (sum_j(x - mean_j x) gave
    # grad_o (1 - 1/n) instead of 0)
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    xs, ws, cot = torch.randn(3, 20), torch.randn(20), torch.randn(3)
    if case == "centred":
        prog = af.program("fzb_c", o=af.sum(x - af.sum(x, "j") / af.size("j"), "j"))
        ins, fn = {"x": xs}, lambda x: {"o": (x - x.mean(-1, keepdim=True)).sum(-1)}
    elif case == "lse":
        m = af.max(x, "j")
        prog = af.program("fzb_l", o=af.sum(x + (m + af.log(af.sum(af.exp(x - m), "j"))), "j"))
        ins, fn = {"x": xs}, lambda x: {"o": (x + torch.logsumexp(x, -1, keepdim=True)).sum(-1)}
    else:
        prog = af.program("fzb_w", o=af.sum(x + af.sum(x + w, "j") / af.size("j"), "j") / af.size("j"))
        ins, fn = {"x": xs, "w": ws}, lambda x, w: {"o": (x + (x + w).mean(-1, keepdim=True)).mean(-1)}
    _close(_grads(prog, ins, {"o": cot}, schedule="loop", block_j=16), _autograd64(fn, ins, {"o": cot}))


def test_max_of_a_recomputed_body_keeps_its_adjoint():
    # o = max_j(softmax_j(softmax_j(x) + lse_j(w))): the backward recomputes the body and
    # compared it with the forward's saved max bit for bit; the forward's fused form rounds
    # otherwise, so no element matched on some rows and their gradient came out 0
    x, w = af.tensor("x", "r j"), af.tensor("w", "r j")
    t1 = af.exp(x - af.max(x, "j"))
    t2 = af.max(w, "j")
    t3 = (t1 / af.sum(t1, "j")) + (t2 + af.log(af.sum(af.exp(w - t2), "j")))
    t4 = af.exp(t3 - af.max(t3, "j"))
    prog = af.program("fzb_mx", o=af.max(t4 / af.sum(t4, "j"), "j"))
    ins = fb.make_grad_inputs(kind="normal", R=3, J=7, dtype="float32", seed=1332717762, w_axes="rj")
    cot = torch.randn(3, generator=torch.Generator().manual_seed(0))

    def ref(x, w):
        t3 = torch.softmax(x, -1) + torch.logsumexp(w, -1, keepdim=True)
        return {"o": torch.softmax(t3, -1).amax(-1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (the stage runs unfused: its fusion is not certified)
        got = _grads(prog, ins, {"o": cot}, schedule="single")
    r = _autograd64(ref, ins, {"o": cot})
    assert torch.allclose(got["x"].double(), r["x"], rtol=1e-4, atol=1e-6), (got["x"], r["x"])
    assert got["w"].abs().max() < 1e-6   # the output does not depend on w (up to rounding)


# ---- the oracle can fail -------------------------------------------------------------------------------
def _softmax_lse_pair():
    x = fz.inp("x", "rj")
    s = fz.sub(x, fz.reduce("max", x))
    s.hi = 0.0
    p = fz.exp(s)
    l = fz.reduce("sum", p)
    l.lo = 1.0
    return {"y": fz.div(p, l), "lse": fz.add(fz.reduce("max", x), fz.log(l))}


def _case(R=3, J=20, seed=5, kind="normal", dtype="float32"):
    return dict(kind=kind, R=R, J=J, dtype=dtype, seed=seed, w_axes=None)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * 1.01


class _Flip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.flip(-1)    # the gradient's entries along j in reverse order ("transposed")


def _checked(wrap=None, cases=None):
    res = fb.GradResult()
    fb.run_grad_program(_softmax_lse_pair(), None, cases or [_case()], res, log=lambda *a: None,
                        name="fzbt", wrap=wrap, schedules=("loop",))
    return res


def test_oracle_passes_the_true_gradient():
    res = _checked()
    assert res.ok and res.grad_checks == 1 and res.compared == 60 and res.not_comparable == 0, res.summary()


@pytest.mark.parametrize("wrong", [_Scale, _Flip], ids=["scaled-1.01", "transposed"])
def test_oracle_flags_a_wrong_gradient(wrong):
    res = _checked(wrap=wrong.apply)
    assert res.wrong == 1 and res.by_class == {"wrong-grad": 1}, res.summary()
    assert "float64 autograd" in res.failures[0].detail


def test_check_grad_flags_nan_and_skips_what_is_not_comparable():
    g64 = torch.tensor([[1.0, -2.0, 0.5], [0.1, math.nan, 3.0]], dtype=torch.float64)
    ok = fb.check_grad(g64.float(), g64, g64.float(), "float32")
    assert ok.ok and ok.skipped == 1                                  # the NaN reference entry
    bad = g64.clone()
    bad[0, 1] = math.nan
    v = fb.check_grad(bad, g64, g64.float(), "float32")
    assert not v.ok and v.cls == "nonfinite-where-finite"
    off = g64.clone()
    off[0, 0] *= 1.01
    assert fb.check_grad(off, g64, g64.float(), "float32").cls == "wrong-grad"
    # a row near a kink is not compared (the whole gradient of a weight over j: any such row)
    amb = torch.tensor([True, False])
    v = fb.check_grad(off, g64, g64.float(), "float32", amb)
    assert v.ok and v.skipped == 4
    assert fb.check_grad(off[0], g64[0], g64[0].float(), "float32", amb).skipped == 3


def test_reference_marks_rows_near_a_kink():
    x = fz.inp("x", "rj")
    out = {"o": fz.reduce("sum", fz.abs_(fz.sub(x, fz.const(1.0))))}   # x - 1 rounds: its sign may flip
    xs = torch.tensor([[1.5, -2.0, 3.0], [1.0 + 1e-12, 2.0, 3.0]], dtype=torch.float64)
    info = {}
    fz.reference(out, {"x": xs}, track=True, info=info)
    assert info["amb"].tolist() == [False, True]
    out = {"o": fz.reduce("max", x)}
    xs = torch.tensor([[1.0, 1.0 + 1e-9, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    fz.reference(out, {"x": xs}, track=True, info=info)
    assert info["amb"].tolist() == [True, False]   # a near tie moves the argmax; an exact one is shared


def test_reference_compares_a_near_tie_float32_separates():
    """A max/min over a computed body with a runner-up float32 can separate is compared, however
    near: the backward sends the adjoint to the element whose recomputed body equals the saved
    extremum bit for bit (acefuse.backward, "Max and min"), as float64 torch does. The CPU fuzz
    at b1e7e14 (seed 1702, min_j(tanh(3 x)), -0.99998105 and -0.99997717 in one row, 3.9e-6
    apart: 2^-18 relative, inside the fallback window EXT_REL) found them wrong under the old
    backward that always shared within EXT_REL; they were then skipped (810cb1e). Only a
    runner-up within float32's error bound of the body (here 2e-7 apart) is not comparable,
    and the kernel's gradient on the compared row is float64's."""
    x = fz.inp("x", "rj")
    out = {"o": fz.reduce("min", fz.tanh(fz.mul(x, fz.const(3.0))))}
    t = lambda y: math.atanh(y) / 3
    a = t(-0.99998105)
    xs = torch.tensor([[a, t(-0.99997717), 0.5], [a, t(-0.998), 0.5], [a, t(-0.99998085), 0.5]],
                      dtype=torch.float32).double()
    info = {}
    fz.reference(out, {"x": xs}, track=True, info=info)
    assert info["amb"].tolist() == [False, False, True]
    assert info["tie"].tolist() == [False, False, True]
    assert info["tie_kept"].tolist() == [True, False, False]
    prog = af.program("mt", o=af.min(af.tanh(af.tensor("x", "r j") * 3.0), "j"))
    cot = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    g64 = _autograd64(lambda x: {"o": torch.tanh(3 * x).amin(dim=1)}, {"x": xs}, {"o": cot})["x"]
    x32 = xs.float().requires_grad_()   # float32 autograd: 1 - tanh^2 cancels (the oracle's yardstick)
    g32, = torch.autograd.grad(torch.tanh(3 * x32).amin(dim=1), x32, cot.float())
    for sched in ("single", "loop"):
        got = _grads(prog, {"x": xs.float()}, {"o": cot.float()}, schedule=sched, block_j=16)["x"]
        v = fb.check_grad(got, g64, g32, "float32", info["amb"])
        assert v.ok and v.compared == 6 and v.skipped == 3, (sched, v.detail)
        assert got[0, 1] == 0 and got[0, 0] != 0, (sched, got[0])
    out = {"o": fz.reduce("min", x)}
    xs = torch.tensor([[-1.0, -1.0 + 4e-6, 0.5], [-1.0, -0.9, 0.5]], dtype=torch.float64)
    fz.reference(out, {"x": xs}, track=True, info=info)
    assert info["amb"].tolist() == [False, False]


def test_index_mask_boundary_is_exact():
    """A where comparing index(j) with a constant float32 represents is exact in a kernel as in
    float64: at the mask's boundary (index == 1.0) it is no near tie. It was (the error bound
    of the masked body became ~1e300 there), so every max/min over such a body was marked a
    near tie: 21 of the 28 near-tie marks of seed 1702's first 154 short-profile programs."""
    x = fz.inp("x", "rj")
    t = fz.where(">=", fz.index_j(), fz.const(1.0), fz.mul(x, fz.const(-2.0)), fz.const(-math.inf))
    sh = fz.sub(t, fz.reduce("max", t))
    sh.hi = 0.0                       # (the generator's bound: a value minus its row max)
    out = {"o": fz.reduce("max", fz.exp(sh))}
    xs = torch.tensor([[0.3, -1.0, 0.5, 2.0], [0.1, 0.7, -0.2, 0.4]], dtype=torch.float64)
    info = {}
    r = fz.reference(out, {"x": xs}, track=True, info=info)
    assert info["amb"].tolist() == [False, False] and info["tie"].tolist() == [False, False]
    assert bool((r["o"][1] < 1e3).all()), r["o"][1]
    from acefuse.fuzz_ref import _exact32
    assert _exact32(fz.const(1.0)) and _exact32(fz.index_j()) and not _exact32(fz.const(0.1))


def test_refusal_needs_a_reason():
    from acefuse.backward import BackwardError
    assert fb._backward_refusal(BackwardError("program 'p': no float input reaches an output")) is not None
    assert fb._backward_refusal(BackwardError("")) is None
    assert fb._backward_refusal(KeyError("j")) is None


# ---- runs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", sorted(FAST))
def test_gradient_fuzz_short(seed):
    res = fb.run(n_programs=FAST[seed], seed=seed, profile="short")
    assert res.programs == FAST[seed] and res.grad_checks > 0
    assert res.ok, res.summary() + "\n\n" + "\n\n".join(f.reproducer() for f in res.failures[:3])


@pytest.mark.slow
def test_gradient_fuzz_long():
    minutes = float(os.environ.get("ACEFUSE_FUZZ_BWD_MINUTES", "8"))
    res = fb.run(minutes=minutes, seed=11, profile="long")
    assert res.ok, res.summary() + "\n\n" + "\n\n".join(f.reproducer() for f in res.failures[:5])


def test_references_see_the_cotangents_the_kernel_sees():
    """The kernel gets the cotangents rounded to its output type: the float64 references must
    start from those same values. With the unrounded ones, an H100 run of the long profile
    (seed 3004) reported this program's bfloat16 gradient 10% off (0.0422 against 0.0470)
    where the cotangent terms cancel; from the rounded cotangents the reference is 0.0422."""
    x, w = fz.inp("x", "rj"), fz.inp("w", "j")
    t1 = fz.add(x, w)
    sh = fz.sub(t1, fz.reduce("max", t1))
    sh.hi = 0.0                       # (the generator's bound: a value minus its row max)
    xw = fz.reduce("sum", fz.mul(x, w))
    var = fz.div(fz.reduce("sum", fz.pow_(fz.sub(x, fz.div(fz.reduce("sum", x), fz.size_j())), 2)), fz.size_j())
    var.lo = 0.0
    outs = {"o0": fz.exp(sh), "o1": xw,
            "o2": fz.add(fz.reduce("sum", fz.mul(x, w)), fz.sqrt(fz.add(var, fz.const(1e-5))))}
    res = fb.GradResult()
    case = dict(kind="offset", R=2, J=7, dtype="bfloat16", seed=953621263, w_axes="j")
    fb.run_grad_program(outs, "j", [case], res, log=lambda *a: None, name="fzbc", schedules=("single",))
    assert res.ok and res.wrong == 0 and res.compared > 0, res.summary()


def test_a_gradient_past_its_types_range_is_not_compared():
    """A float16 gradient whose float64 value is -68041 (past float16's 65504) overflows as written,
    in torch as in acefuse: not comparable (fuzz seed 11303 reported it as nonfinite-where-finite).
    An entry inside the range that comes out infinite is still wrong."""
    g64 = torch.tensor([[-68041.74, 1.5, -2.0]], dtype=torch.float64)
    got = torch.tensor([[-math.inf, 1.5, -2.0]], dtype=torch.float16)
    v = fb.check_grad(got, g64, g64.float(), "float16")
    assert v.ok and v.skipped == 1 and v.compared == 2, v
    bad = fb.check_grad(torch.tensor([[-math.inf, math.inf, -2.0]], dtype=torch.float16), g64, g64.float(), "float16")
    assert not bad.ok and bad.cls == "nonfinite-where-finite", bad
