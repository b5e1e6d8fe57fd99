"""af.backward and differentiable kernels.

Two layers: (1) the derived backward programs evaluated by the independent float64
reference (acefuse.reference, no kernels) against float64 torch autograd or central
finite differences, for every operator; (2) af.compile(prog) outputs with grad_fn,
run through Triton's interpreter, against float64 torch autograd of the plain math
(torch.softmax, F.layer_norm, F.cross_entropy ...) for every example program, every
schedule, odd shapes, masked rows and float32/float16/bfloat16.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st, HealthCheck

import acefuse as af
from acefuse.backward import backward, BackwardError
from acefuse.reference import evaluate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import softmax as S  # noqa: E402
import norms as N  # noqa: E402

TOL = {torch.float32: (2e-5, 2e-4), torch.float16: (4e-3, 2e-2), torch.bfloat16: (3e-2, 5e-2)}
SCHEDULES = [("single", {}), ("loop", {"block_j": 16}), ("split", {"block_j": 16, "nsplit": 3})]


def _close(got, ref, atol, rtol, what=""):
    got = torch.as_tensor(np.array(got) if isinstance(got, np.ndarray) else got).double()
    ref = torch.as_tensor(np.array(ref) if isinstance(ref, np.ndarray) else ref).double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in the gradient"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (got - ref).abs() - (atol * max(1.0, scale) + rtol * ref.abs())
    assert (err <= 0).all(), f"{what}: max excess error {err.max().item():.3e}"


# ---- (1) derivation, checked with the float64 reference evaluator ----------------------------------
def _ref_grads(prog, inputs, cots):
    """Gradients from the derived backward program, evaluated unfused in float64."""
    bwd = backward(prog)
    fwd = evaluate(bwd.augmented, inputs)
    vals = dict(inputs)
    vals.update({n: fwd[n] for n in bwd.saved_kind})   # as saved (a masked row's -inf: guarded in the terms)
    vals.update({f"grad_{k}": c for k, c in cots.items()})
    out = evaluate(bwd, {n: vals[n] for n in bwd.tensors})
    res = {}
    for name, g in bwd.grads.items():
        axes = bwd.input_axes[name]
        res[name] = np.broadcast_to(_expand(out[g], bwd.outputs[g].axes, axes), np.shape(inputs[name]))
    return res


def _expand(a, axes, target):
    order = [t for t in target if t in axes]
    a = np.transpose(a, [list(axes).index(t) for t in order]) if np.ndim(a) else a
    return np.reshape(a, [a.shape[order.index(t)] if t in axes else 1 for t in target])


def _fd_check(prog, inputs, h=1e-6, tol=1e-5):
    """Central finite differences of <cot, prog(inputs)> against the derived gradients."""
    rng = np.random.default_rng(1)
    outs = evaluate(prog, inputs)
    cots = {k: rng.standard_normal(np.shape(v)) for k, v in outs.items()}
    grads = _ref_grads(prog, inputs, cots)

    def f(ins):
        o = evaluate(prog, ins)
        return sum(float((o[k] * cots[k]).sum()) for k in o)
    for name, g in grads.items():
        x = np.asarray(inputs[name], dtype=np.float64)
        fd = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[i] += h
            xm[i] -= h
            fd[i] = (f({**inputs, name: xp}) - f({**inputs, name: xm})) / (2 * h)
        _close(g, fd, tol, tol, f"{prog.name}: grad {name}")


x_ = af.tensor("x", "r j")
w_ = af.tensor("w", "j")
u_ = af.tensor("u", "r")
OP_PROGRAMS = [
    af.program("ops_a", y=af.tanh(x_ * w_) + af.abs(x_ - u_) + af.maximum(x_, w_) * af.minimum(x_, 0.5)),
    af.program("ops_b", y=af.sqrt(x_ * x_ + 1.0) / (af.exp(x_) + w_ * w_) + (x_ + 2.0) ** 3),
    af.program("ops_c", out=af.sum(af.where(x_ > u_, af.log(x_ * x_ + 1.0), af.rsqrt(w_ * w_ + 0.5)), "j")),
    af.program("ops_d", out=af.max(x_ * w_, "j") - af.min(x_ + u_, "j"), s=af.mean(x_ * u_, "j")),
    af.program("softmax_affine", y=af.exp(x_ * w_ - af.max(x_ * w_, "j")) / af.sum(af.exp(x_ * w_ - af.max(x_ * w_, "j")), "j")),
]


@pytest.mark.parametrize("prog", OP_PROGRAMS, ids=lambda p: p.name)
def test_every_operator_matches_finite_differences(prog):
    rng = np.random.default_rng(0)
    inputs = {n: rng.standard_normal([{"r": 3, "j": 5}[a] for a in ax]) for n, ax in prog.tensors.items()}
    _fd_check(prog, inputs)


def test_finite_difference_check_catches_a_wrong_derivative(monkeypatch):
    B = sys.modules["acefuse.backward"]   # (af.backward, the function, shadows the module name)
    orig = B._Deriv.local

    def wrong(self, t, g):
        pairs = orig(self, t, g)
        if t.op == "Tanh":   # drop the (1 - tanh^2) factor
            return [(c, (lambda: g)) for c, _ in pairs]
        return pairs
    monkeypatch.setattr(B._Deriv, "local", wrong)
    rng = np.random.default_rng(0)
    inputs = {n: rng.standard_normal([{"r": 3, "j": 5}[a] for a in ax]) for n, ax in OP_PROGRAMS[0].tensors.items()}
    with pytest.raises(AssertionError):
        _fd_check(OP_PROGRAMS[0], inputs)


@pytest.mark.parametrize("prog", [S.softmax, S.lse, N.layernorm, N.layernorm_onepass, N.rmsnorm, N.log_softmax,
                                  N.cross_entropy, N.softmax_lse, N.cross_entropy_mean], ids=lambda p: p.name)
def test_derived_backward_fuses(prog):
    bwd = af.backward(prog)
    f = af.fuse(bwd)
    assert f.fusible, f.reason
    text = f.explain(chains=False)
    assert "stage" in text and "rolling" in text
    for t in (o.term for o in bwd.outputs.values()):
        for s in t.walk():   # trivial simplifications done
            assert not (s.op == "Mul" and any(c.op == "Num" and c.args[0] == 1.0 for c in s.children)), s
            assert not (s.op == "Add" and any(c.op == "Num" and c.args[0] == 0.0 for c in s.children)), s


def test_backward_api():
    bwd = af.backward(N.layernorm)
    assert set(bwd.cotangents) == {"grad_y"} and bwd.grads == {"x": "grad_x", "w": "grad_w", "b": "grad_b"}
    assert all(a == ("r",) for a in bwd.saved.values()) and set(bwd.saved) <= set(bwd.augmented.outputs)
    assert [s.name for s in bwd.stages] == ["layernorm_bwd_j", "layernorm_bwd_r"]   # dW, db: sums over rows
    ce = af.backward(N.cross_entropy)
    assert ce.index_inputs == ["t"] and "t" not in ce.grads
    assert any(s.op == "Idx" for s in ce.outputs["grad_x"].term.walk())   # the gather's scatter
    sm = af.backward(S.softmax)
    # one value per row, L = m + log(l): P = exp(x - L) (backward_shift.fold_outputs)
    assert sm.saved_kind == {"saved_lse": "value"}
    # no recomputed sum_j(exp(x - m)): the gradient reads the saved L
    lse = af.backward(S.lse).outputs["grad_x"].term
    assert not any(s.op == "Sum" and s.args[1].op == "Exp" for s in lse.walk())
    assert any(s.op == "In" and s.args[0] == "saved_lse" for s in lse.walk())


def test_backward_errors():
    with pytest.raises(BackwardError, match="af.program"):
        af.backward(lambda x: x)
    y = af.tensor("grad_y", "r j")
    with pytest.raises(BackwardError, match="grad_y"):
        af.backward(af.program("clash", y=af.sum(y, "j") + af.sum(x_, "j")))
    with pytest.raises(BackwardError, match="higher derivatives"):
        af.backward(af.backward(S.softmax))
    with pytest.raises(BackwardError, match="no float input"):
        t = af.tensor("t", "r")
        af.backward(af.program("idx_only", y=af.sum(af.where(af.index("j").eq(t), 1.0, 0.0) * 0.0 + 1.0, "j")))


def test_masked_softmax_backward_is_zero_not_nan():
    x = np.random.default_rng(3).standard_normal((3, 6))
    x[0, :] = -math.inf
    x[1, 2:4] = -math.inf
    g = _ref_grads(S.softmax, {"x": x}, {"y": np.random.default_rng(4).standard_normal((3, 6))})["x"]
    assert np.isfinite(g).all() and (g[0] == 0).all() and (g[1, 2:4] == 0).all()


# ---- (2) compiled kernels: outputs with grad_fn ------------------------------------------------------
def _torch_refs():
    def ln(x, w, b):
        return {"y": F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)}

    def rms(x, w):
        return {"y": x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w}
    return {
        "softmax": lambda x: {"y": torch.softmax(x, -1)},
        "logsumexp": lambda x: {"out": torch.logsumexp(x, -1)},
        "log_softmax": lambda x: {"y": torch.log_softmax(x, -1)},
        "layernorm": ln, "layernorm_onepass": ln, "rmsnorm": rms,
        "cross_entropy": lambda x, t: {"loss": F.cross_entropy(x, t, reduction="none")},
        "softmax_lse": lambda x: {"y": torch.softmax(x, -1), "lse": torch.logsumexp(x, -1)},
        "cross_entropy_mean": lambda x, t: {"loss": F.cross_entropy(x, t)},
    }


REFS = _torch_refs()
_KERNELS: dict = {}


def _kernel(prog):
    if prog.name not in _KERNELS:
        _KERNELS[prog.name] = af.compile(prog)
    return _KERNELS[prog.name]


def _inputs(prog, rows, cols, g, masked=False, scale=1.0):
    out = {}
    for n, ax in prog.tensors.items():
        shape = [{"r": rows, "j": cols}[a] for a in ax]
        if n == "t":
            out[n] = torch.randint(0, cols, shape, generator=g)
        elif n == "w":
            out[n] = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
        else:
            out[n] = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if masked:
        x = out["x"]
        x[torch.rand(x.shape, generator=g) < 0.3] = -math.inf
        x[:, 0] = torch.where(torch.isinf(x[:, 0]), torch.zeros_like(x[:, 0]), x[:, 0])  # no fully masked row
    return out


def _grad_check(prog, inputs, dtype, g, full_masked_rows=(), **run):
    k = _kernel(prog)
    ins = {n: (v.to(dtype).requires_grad_() if v.dtype.is_floating_point else v) for n, v in inputs.items()}
    out = k(**ins, **run)
    outs = out if isinstance(out, dict) else {next(iter(prog.outputs)): out}
    for o in outs.values():
        assert o.grad_fn is not None and o.dtype == dtype
    cots = {n: torch.randn(o.shape, generator=g, dtype=torch.float64) for n, o in outs.items()}
    used = list(outs)[:1] if len(outs) > 1 and g.initial_seed() % 2 else list(outs)   # a None cotangent
    sum((outs[n].double() * cots[n]).sum() for n in used).backward()
    rin = {n: (v.to(dtype).double().requires_grad_() if v.dtype.is_floating_point else v) for n, v in inputs.items()}
    rout = REFS[prog.name](**rin)
    sum((rout[n] * cots[n]).sum() for n in used).backward()
    atol, rtol = TOL[dtype]
    for n, v in ins.items():
        if not v.dtype.is_floating_point:
            continue
        assert v.grad is not None and v.grad.dtype == dtype, n
        got, ref = v.grad.double(), rin[n].grad.clone()
        for r in full_masked_rows:   # documented convention: a fully masked row gets gradient 0
            assert (got[r] == 0).all()
            got[r], ref[r] = 0.0, 0.0
        _close(got, ref, atol, rtol, f"{prog.name} {dtype} {run}: grad {n}")


@pytest.mark.parametrize("prog", [S.softmax, S.lse, N.log_softmax, N.layernorm, N.layernorm_onepass, N.rmsnorm,
                                  N.cross_entropy, N.softmax_lse], ids=lambda p: p.name)
@pytest.mark.parametrize("sched", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_example_gradients_float32(prog, sched):
    g = torch.Generator().manual_seed(hash((prog.name, sched[0])) % 2**31)
    name, kw = sched
    masked = prog.name in ("softmax", "logsumexp", "log_softmax", "softmax_lse", "cross_entropy")
    _grad_check(prog, _inputs(prog, 5, 37, g, masked=masked), torch.float32, g, schedule=name, **kw)


def test_cross_entropy_mean_gradient():
    g = torch.Generator().manual_seed(7)
    _grad_check(N.cross_entropy_mean, _inputs(N.cross_entropy_mean, 5, 37, g), torch.float32, g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prog", [S.softmax, N.layernorm, N.cross_entropy], ids=lambda p: p.name)
def test_example_gradients_low_precision(prog, dtype):
    g = torch.Generator().manual_seed(11)
    _grad_check(prog, _inputs(prog, 3, 29, g), dtype, g, schedule="loop", block_j=16)


def test_fully_masked_row_gets_zero_gradient():
    g = torch.Generator().manual_seed(5)
    inputs = _inputs(S.softmax, 4, 19, g, masked=True)
    inputs["x"][2] = -math.inf
    _grad_check(S.softmax, inputs, torch.float32, g, full_masked_rows=(2,), schedule="loop", block_j=16)


def test_grad_check_rejects_wrong_gradients():
    ref = torch.randn(4, 5, dtype=torch.float64)
    with pytest.raises(AssertionError):
        _close(ref * 1.01, ref, *TOL[torch.float32])
    with pytest.raises(AssertionError):
        _close(torch.full_like(ref, math.nan), ref, *TOL[torch.float32])


def test_fast_path_without_requires_grad():
    k = _kernel(S.softmax)
    x = torch.randn(3, 10)
    y = k(x=x)
    assert y.grad_fn is None
    with torch.no_grad():
        assert k(x=x.requires_grad_()).grad_fn is None
    assert k.fusible and "def " in k.source   # the forward kernel's attributes


def test_backward_kernel_direct():
    bwd = af.backward(S.softmax)
    kb = af.compile(bwd)
    assert kb.fusible
    x = torch.randn(4, 23)
    fwd = af.compile(bwd.augmented)(x=x)
    gy = torch.randn(4, 23)
    grads = kb(x=x, grad_y=gy, **{n: fwd[n] for n in bwd.saved})
    xr = x.double().requires_grad_()
    torch.softmax(xr, -1).backward(gy.double())
    _close(grads["grad_x"], xr.grad, *TOL[torch.float32])


@st.composite
def _case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    sched = draw(st.sampled_from(SCHEDULES))
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 45))
    scale = draw(st.sampled_from([1.0, 10.0]))
    masked = draw(st.booleans())
    return dtype, sched, rows, cols, scale, masked, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_softmax_gradient_hypothesis(c):
    dtype, (name, kw), rows, cols, scale, masked, seed = c
    g = torch.Generator().manual_seed(seed)
    _grad_check(S.softmax, _inputs(S.softmax, rows, cols, g, masked=masked, scale=scale), dtype, g,
                schedule=name, **kw)


# ---- special functions, rounding, casts and index arithmetic --------------------------------------
_T = {"erf": torch.erf, "sigmoid": torch.sigmoid, "softplus": F.softplus, "log1p": torch.log1p,
      "expm1": torch.expm1, "floor": torch.floor, "ceil": torch.ceil, "round": torch.round}


@pytest.mark.parametrize("fn", list(_T))
def test_function_derivatives_match_torch_autograd(fn):
    """y = sum_j(f(x * w) * w) + f(x) (the function inside a reduction and elementwise): the
    derived gradients, evaluated in float64, against torch autograd of the same math with
    fresh random inputs; rounding has gradient 0 (torch's convention) and leaves only the
    other paths. log1p gets arguments above -1."""
    f = getattr(af, "round" if fn == "round" else fn)
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    prog = af.program(f"fn_{fn}", s=af.sum(f(x * w) * w, "j"), y=f(x) * x)
    rng = np.random.default_rng(sorted(_T).index(fn) + 101)
    xs, ws = rng.standard_normal((4, 7)) * 1.5, rng.uniform(0.2, 0.6, 7)
    if fn == "log1p":
        xs = rng.uniform(-0.6, 3.0, (4, 7))
    cots = {"s": rng.standard_normal(4), "y": rng.standard_normal((4, 7))}
    got = _ref_grads(prog, {"x": xs, "w": ws}, cots)
    xt, wt = torch.tensor(xs, requires_grad=True), torch.tensor(ws, requires_grad=True)
    s = (_T[fn](xt * wt) * wt).sum(-1)
    y = _T[fn](xt) * xt
    ((s * torch.tensor(cots["s"])).sum() + (y * torch.tensor(cots["y"])).sum()).backward()
    assert xt.grad.abs().max() > 1e-2
    _close(got["x"], xt.grad, 1e-12, 1e-10, f"{fn}: grad x")
    _close(got["w"], wt.grad, 1e-12, 1e-10, f"{fn}: grad w")


def test_casts_and_index_arithmetic_have_zero_gradient():
    """An integer cast and integer arithmetic are piecewise constant: no adjoint flows through
    them, the other paths still do."""
    x = af.tensor("x", "r j")
    prog = af.program("casts", y=af.sum(af.cast(x * 3.0, "int32") * x + (af.cast(x, "int64") % 3) * 2.0, "j"))
    rng = np.random.default_rng(4)
    xs, gy = rng.standard_normal((3, 5)) * 4.0, rng.standard_normal(3)
    got = _ref_grads(prog, {"x": xs}, {"y": gy})["x"]
    ref = np.trunc(xs * 3.0) * gy[:, None]
    assert np.abs(ref).max() > 1
    _close(got, ref, 1e-12, 1e-12, "casts: grad x")
    with pytest.raises(BackwardError, match="no float input"):
        af.backward(af.program("only_int", y=af.sum(af.floor(x) + af.cast(x, "int32"), "j")))


def test_gradient_that_only_indexes_an_axis():
    """``x * (index(j) % 2 == 0)`` differentiates to ``grad_y * (index(j) % 2 == 0)``: the
    gradient ranges over j, which only x has (it used to fail with 'grad_x ranges over j')."""
    x = af.tensor("x", "r j")
    prog = af.program("parity", y=af.sum(x * ((af.index("j") % 2).eq(0)), "j"))
    bwd = af.backward(prog)
    assert bwd.outputs["grad_x"].axes == ("r", "j")
    rng = np.random.default_rng(6)
    xs, gy = rng.standard_normal((3, 7)), rng.standard_normal(3)
    got = _ref_grads(prog, {"x": xs}, {"y": gy})["x"]
    ref = gy[:, None] * (np.arange(7) % 2 == 0)[None, :]
    _close(got, ref, 0.0, 0.0, "parity: grad x")
    kb = af.compile(bwd)   # the compiled stage takes j's length from x
    g = kb(x=torch.tensor(xs, dtype=torch.float32), grad_y=torch.tensor(gy, dtype=torch.float32))["grad_x"]
    _close(torch.broadcast_to(g, xs.shape), ref, *TOL[torch.float32], "parity: compiled grad x")


def test_function_gradients_compiled():
    """The derivatives above in compiled backward kernels (Triton's interpreter): af.compile's
    output has a grad_fn that runs the derived stages, no fallback to torch autograd."""
    import warnings
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    z = x * w
    prog = af.program("fns", y=af.sum(af.erf(z) * af.sigmoid(x) + af.softplus(z) + af.log1p(af.abs(x))
                                      + af.expm1(z * 0.5) + af.floor(x) * x, "j"))
    g = torch.Generator().manual_seed(17)
    xv = torch.randn(5, 37, generator=g, dtype=torch.float64)
    wv = torch.rand(37, generator=g, dtype=torch.float64) + 0.2
    cot = torch.randn(5, generator=g, dtype=torch.float64)
    xs, ws = xv.float().requires_grad_(), wv.float().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a fallback to torch autograd warns: fail on it
        (af.compile(prog)(x=xs, w=ws).double() * cot).sum().backward()
    xr, wr = xv.clone().requires_grad_(), wv.clone().requires_grad_()
    zr = xr * wr
    yr = (torch.erf(zr) * torch.sigmoid(xr) + F.softplus(zr) + torch.log1p(xr.abs()) + torch.expm1(zr * 0.5)
          + torch.floor(xr) * xr).sum(-1)
    (yr * cot).sum().backward()
    _close(xs.grad, xr.grad, *TOL[torch.float32], "fns: grad x")
    _close(ws.grad, wr.grad, *TOL[torch.float32], "fns: grad w")
