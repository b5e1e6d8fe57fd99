"""Backward stages: reductions a stage's rows do not depend on are hoisted into pre-stages.

A stage fused over one axis runs a grid over its row axes; a reduction inside it whose value
does not range over a row axis (``max_j(w)``'s adjoint ``sum_j(sum_r(...))`` in a stage whose
rows are ``r``; attention's ``D = sum_e(grad_o * o)`` in the dK/dV stage, whose rows are key
tiles) is computed once by a pre-stage and read by the stages that use it
(acefuse/backward.py ``_hoist``). The programs here were refused by codegen before ("there are
no query rows") and fell back to torch autograd; their gradients are checked against float64
torch autograd of the plain math, fresh random inputs, odd sizes, float32 and bfloat16.
"""
import math
import warnings

import pytest
import torch

import acefuse as af
from acefuse.autograd import GradientFallbackWarning

TOL = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (3e-2, 5e-2)}


def _close(got, ref, what, atol, rtol):
    got, ref = got.double(), ref.double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite gradient"
    scale = max(1.0, ref.abs().max().item())
    err = (got - ref).abs() - (atol * scale + rtol * ref.abs())
    assert (err <= 0).all(), f"{what}: max excess error {err.max().item():.3e}"


def _programs():
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    xb, wb = af.tensor("x", "b r j"), af.tensor("w", "b j")

    def sm(t):
        return af.exp(t - af.max(t, "j"))

    def tsm(t):
        return torch.exp(t - t.amax(-1, keepdim=True))

    return {
        # the reproducer: max_j(w) scales a per-row softmax numerator
        "max_w": (af.program("hs_max_w", y=af.sum(sm(x) * af.max(w, "j"), "j")),
                  lambda X, W: (tsm(X) * W.amax()).sum(-1)),
        # a mean of the lower-rank input inside the per-row terms
        "mean_w": (af.program("hs_mean_w", y=af.sum(sm(x) * (x - af.mean(w, "j")), "j")),
                   lambda X, W: (tsm(X) * (X - W.mean())).sum(-1)),
        # an output elementwise over (r, j) scaled by a 0-d sum of squares
        "sumsq_w": (af.program("hs_sumsq_w", y=sm(x) * af.sum(w * w, "j")),
                    lambda X, W: tsm(X) * (W * W).sum()),
        # a max of w scaled by its own max: the adjoint of the outer max, routed through the
        # inner one, is a pre-stage value that reads two others (a 0-d value of 0-d values)
        "max_max_w": (af.program("hs_max_max_w", y=af.sum(sm(x) * af.max(w * af.max(w, "j"), "j"), "j")),
                      lambda X, W: (tsm(X) * (W * W.amax()).amax()).sum(-1)),
        # the hoisted value is not 0-d: one max per batch entry b, invariant along the rows r
        "batched": (af.program("hs_batched", y=af.sum(sm(xb) * af.max(wb, "j"), "j")),
                    lambda X, W: (tsm(X) * W.amax(-1)[:, None, None]).sum(-1)),
    }


PROGS = _programs()
SHAPES = {"max_w": ((5, 37), (37,)), "max_max_w": ((6, 31), (31,)), "mean_w": ((7, 29), (29,)), "sumsq_w": ((3, 41), (41,)),
          "batched": ((3, 5, 23), (3, 23))}
_KERNELS: dict = {}


def _kernel(name):
    if name not in _KERNELS:
        _KERNELS[name] = af.compile(PROGS[name][0])
    return _KERNELS[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(PROGS))
def test_hoisted_gradients_match_torch_autograd(name, dtype):
    prog, ref_fn = PROGS[name]
    bwd = af.backward(prog)
    pre = [s for s in bwd.stages if s.hoisted]
    assert pre, f"{name}: no pre-stage ({[s.name for s in bwd.stages]})"
    gen = torch.Generator().manual_seed(list(PROGS).index(name) * 2 + (dtype == torch.bfloat16))
    xs, ws = SHAPES[name]
    X = torch.randn(xs, generator=gen, dtype=torch.float64).to(dtype)
    W = torch.randn(ws, generator=gen, dtype=torch.float64).to(dtype)
    k = _kernel(name)
    x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)   # torch's gradient would hide a refusal
        y = k(x=x, w=w)
        cot = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
        y.backward(cot)
    assert k.grad_fallback is None
    assert isinstance(k._bwd_kernel, af.autograd.BackwardKernel)
    xr, wr = X.double().requires_grad_(), W.double().requires_grad_()
    ref_fn(xr, wr).backward(cot.double())
    atol, rtol = TOL[dtype]
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    _close(x.grad, xr.grad, f"{name} {dtype}: grad_x", atol, rtol)
    _close(w.grad, wr.grad, f"{name} {dtype}: grad_w", atol, rtol)


def test_reproducer_stages_and_explain():
    """The issue's program: the stage over j no longer contains the 0-d sums (a pre-stage
    computes them and it reads them), and explain() says why each was hoisted."""
    bwd = af.backward(PROGS["max_w"][0])
    pre, last = [s for s in bwd.stages if s.hoisted], bwd.stages[-1]
    names = {n for s in pre for n in s.outputs}
    assert names == set(bwd.intermediates) and len(names) == 2
    assert all(bwd.intermediates[n] == () for n in names)
    assert names <= set(last.tensors) and not names & set(bwd.tensors)   # inputs of the stage, not of the call
    assert not any(u.op == "Sum" and u.args[0].args[0] == "r" for e in last.outputs.values() for u in e.term.walk())
    text = af.fuse(bwd).explain(chains=False)
    assert "pre-stage" in text and text.count("hoisted, invariant along r in stage hs_max_w_bwd_j") == 2


def test_backward_kernel_returns_only_gradients():
    """Intermediates are passed between stages, never returned; the kernel called directly."""
    prog = PROGS["sumsq_w"][0]
    bwd = af.backward(prog)
    bk, aug = af.compile(bwd), af.compile(bwd.augmented)
    gen = torch.Generator().manual_seed(3)
    X, W = torch.randn(4, 19, generator=gen), torch.randn(19, generator=gen)
    saved = aug(x=X, w=W)
    cot = torch.randn(4, 19, generator=gen)
    g = bk(x=X, w=W, **{n: saved[n] for n in bwd.saved}, grad_y=cot)
    assert set(g) == {"grad_x", "grad_w"}
    xr, wr = X.double().requires_grad_(), W.double().requires_grad_()
    PROGS["sumsq_w"][1](xr, wr).backward(cot.double())
    _close(g["grad_x"], xr.grad, "grad_x", *TOL[torch.float32])
    _close(g["grad_w"], wr.grad, "grad_w", *TOL[torch.float32])


def test_row_dependent_reductions_are_not_hoisted():
    """A layernorm's per-row sums range over the stage's rows: no pre-stage, same stages."""
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    mu = af.mean(x, "j")
    xc = x - mu
    prog = af.program("hs_ln", y=xc / af.sqrt(af.mean(xc * xc, "j") + 1e-5) * w)
    bwd = af.backward(prog)
    assert not bwd.intermediates and not any(s.hoisted for s in bwd.stages)


def test_elementwise_stage_carrier_reads_only_the_tensors():
    """A stage without reductions runs with a carrier sum whose body is the product of the
    tensors it reads, not a copy of the gradient: the copy was normalised again, and
    ``grad_y / size(j) * (1 - tanh(x) * tanh(x))`` took minutes to fuse (the fuzzer's slowest
    stages). Its gradient still matches float64 torch autograd."""
    x = af.tensor("x", "r j")
    prog = af.program("hs_mean_tanh", y=af.mean(af.tanh(x), "j"))
    bwd = af.backward(prog)
    (st,) = bwd.stages
    carrier = st.outputs["carrier_"].term
    assert not any(u.op == "Tanh" for u in carrier.walk()), str(st.outputs["carrier_"])
    k = af.compile(prog)
    gen = torch.Generator().manual_seed(11)
    X = torch.randn(6, 23, generator=gen)
    xl = X.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        y = k(x=xl)
        cot = torch.randn(y.shape, generator=gen)
        y.backward(cot)
    xr = X.double().requires_grad_()
    torch.tanh(xr).mean(-1).backward(cot.double())
    _close(xl.grad, xr.grad, "grad_x", *TOL[torch.float32])


def test_constant_body_sum_is_not_hoisted_and_compiles():
    """GPU fuzz seed 3102 (97ddf86): this program's backward holds ``sum_j(saved_v3)`` with
    saved_v3 over r (a body constant along j). Hoisted, its pre-stage fused over j had no input
    over j (EncodeError at compile, a crash). It stays inline (``_not_larger``), and the
    gradients match float64 torch autograd."""
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    t1 = x * w
    t2 = t1 - af.sum(t1, "j") / af.size("j")
    prog = af.program("hs_const_body", o0=(x + w) * (af.sum(x * 0.5, "j") / af.size("j")),
                      o1=af.sqrt(af.sum((t2 - af.sum(t2, "j") / af.size("j")) ** 2, "j") / af.size("j") + 1e-05))
    bwd = af.backward(prog)
    for s in bwd.stages:   # every stage has an input over its fused axis
        assert s.axis in {a for ax in s.tensors.values() for a in ax}, (s.name, dict(s.tensors))
    gen = torch.Generator().manual_seed(3102)
    X, W = torch.randn(3, 17, generator=gen, dtype=torch.float64), torch.randn(17, generator=gen, dtype=torch.float64)
    k = af.compile(prog)
    xx, ww = X.float().requires_grad_(), W.float().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = k(x=xx, w=ww)
        c0 = torch.randn(3, 17, generator=gen, dtype=torch.float64)
        c1 = torch.randn(3, generator=gen, dtype=torch.float64)
        torch.autograd.backward([out["o0"], out["o1"]], [c0.float(), c1.float()])
    assert k.grad_fallback is None
    xr, wr = X.clone().requires_grad_(), W.clone().requires_grad_()
    a = xr * wr
    c = a - a.mean(-1, keepdim=True)
    o0 = (xr + wr) * (xr * 0.5).mean(-1, keepdim=True)
    o1 = torch.sqrt(((c - c.mean(-1, keepdim=True)) ** 2).mean(-1) + 1e-5)
    torch.autograd.backward([o0, o1], [c0, c1])
    _close(xx.grad, xr.grad, "grad_x", *TOL[torch.float32])
    _close(ww.grad, wr.grad, "grad_w", *TOL[torch.float32])


def _max_u_max_w():
    x, w, u = af.tensor("x", "r j"), af.tensor("w", "j"), af.tensor("u", "j")
    return af.program("hs_max_u_max_w", y=af.sum(af.exp(x - af.max(x, "j")) * af.max(u * af.max(w, "j"), "j"), "j"))


def _torch_max_u_max_w(X, W, U):
    return (torch.exp(X - X.amax(-1, keepdim=True)) * (U * W.amax()).amax()).sum(-1)


def _staged(bwd, ins: dict, cot):
    """The backward program's stages evaluated one after another, in the order they are
    listed, by the float64 reference evaluator (no codegen): each stage reads the inputs, the
    saved values and the intermediates earlier stages wrote (a stage that reads a value no
    earlier stage wrote fails with a KeyError)."""
    from acefuse.reference import evaluate
    ins = {n: v.numpy() for n, v in ins.items()}
    fwd = evaluate(bwd.augmented, ins)
    vals = dict(ins, grad_y=cot.numpy())
    vals.update({n: fwd[n] for n in bwd.saved_kind})   # as saved (a masked row's -inf: guarded in the terms)
    for st in bwd.stages:
        vals.update(evaluate(st, {n: vals[n] for n in st.tensors}))
    return {n: torch.as_tensor(vals[g]) for n, g in bwd.grads.items()}


@pytest.mark.parametrize("wrt", ["w", "wx", "xwu"])
def test_nested_zero_d_values_are_staged(wrt):
    """``max_j(u * max_j(w))`` scales a per-row softmax numerator: w's gradient routes the
    outer max's adjoint through the inner max, ``sum_j(where(hit, sum_j(sum_r(X)) / count, 0)
    * u)``: a 0-d value that reads the 0-d ``sum_j(sum_r(X))``. That inner value is computed
    by a pre-stage of its own (a reduction over j of one over r: inline, it was a pass with no
    rows, refused: "there are no query rows"), and the value that reads it by a later one. The
    stages, evaluated one after another in float64, give float64 torch autograd's gradients."""
    names = [{"x": "x", "w": "w", "u": "u"}[c] for c in wrt]
    bwd = af.backward(_max_u_max_w(), wrt=names)
    made = {}
    for i, st in enumerate(bwd.stages):
        for n in st.tensors:   # every intermediate a stage reads is written by an earlier stage
            if n in bwd.intermediates:
                assert made.get(n, i) < i, f"stage {st.name} reads {n} before it is written"
        made.update({n: i for n in st.outputs})
        for n, e in st.outputs.items():   # no stage computes a sum over j of a sum over r inside another
            nested = [u for u in e.term.walk() if u.op == "Sum" and u is not e.term and u.args[0].args[0] == "j"
                      and any(v.op == "Sum" and v.args[0].args[0] == "r" for v in u.args[1].walk())]
            assert not nested, f"{st.name}: {n} = {e}"
    why = " ".join(st.hoisted[n] for st in bwd.stages for n in st.hoisted)
    # (with u's gradient asked for, the inner value is also a term of grad_u, hoisted for its rows;
    # with x's, since the max's adjoint is g * r(count) * [hit] (backward.py, "Max and min"), the
    # sum over j of it factors: no reduction nested in a pre-stage value is left to hoist)
    assert {"w": "nested in stage hs_max_u_max_w_bwd_j (fused over j), which has no row axes",
            "wx": "invariant along r", "xwu": "invariant along r"}[wrt] in why, why
    gen = torch.Generator().manual_seed(len(wrt))
    X, W, U = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((5, 29), (29,), (29,)))
    cot = torch.randn(5, generator=gen, dtype=torch.float64)
    got = _staged(bwd, {"x": X, "w": W, "u": U}, cot)
    leaves = {"x": X.clone().requires_grad_("x" in names), "w": W.clone().requires_grad_("w" in names),
              "u": U.clone().requires_grad_("u" in names)}
    _torch_max_u_max_w(leaves["x"], leaves["w"], leaves["u"]).backward(cot)
    for n in names:
        assert leaves[n].grad.abs().max() > 1e-3
        _close(got[n], leaves[n].grad, f"grad_{n}", 1e-12, 1e-10)


@pytest.mark.parametrize("wrt", ["xwu", "w"])   # "w": a 0-d value divided by a per-row count (_div0)
def test_nested_zero_d_values_compiled(wrt):
    """The same program compiled (float32, interpreter on the CPU): no fallback to torch."""
    gen = torch.Generator().manual_seed(7)
    X, W, U = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((6, 23), (23,), (23,)))
    cot = torch.randn(6, generator=gen, dtype=torch.float64)
    x, w, u = (t.float().requires_grad_(n in wrt) for n, t in zip("xwu", (X, W, U)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        af.compile(_max_u_max_w())(x=x, w=w, u=u).backward(cot.float())
    ref = [t.clone().requires_grad_(n in wrt) for n, t in zip("xwu", (X, W, U))]
    _torch_max_u_max_w(*ref).backward(cot)
    for n, a, b in zip("xwu", (x, w, u), ref):
        if n in wrt:
            assert b.grad.abs().max() > 1e-3
            _close(a.grad, b.grad, f"grad_{n}", *TOL[torch.float32])


def _cascade_programs():
    """Programs whose weight gradient holds a 0-d (or per-batch) sum over (r, j) of a body that
    itself reads per-row sums over j: the adjoint of a reduction of ``w`` that scales a term
    centred over j (``t - mean_j(t)``), routed through a max or min over j."""
    x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    xb, wb, sb = af.tensor("x", "b r j"), af.tensor("w", "b j"), af.tensor("s", "b")

    def ctr(t):
        return t - af.sum(t, "j") / af.size("j")

    def tctr(t):
        return t - t.mean(-1, keepdim=True)

    def lse(v):
        m = af.max(v, "j")
        return m + af.log(af.sum(af.exp(v - m), "j"))

    def expmin(u):
        return af.exp(af.min(u, "j") - u)

    def texpmin(u):
        return torch.exp(u.amin(-1, keepdim=True) - u)

    def tmasked(W):
        return torch.where(torch.arange(W.shape[-1]) < 5, W, torch.full_like(W, -math.inf))

    masked = af.where(af.index("j") < 5.0, w, af.NEG_INF)
    return {
        # the gradient fuzzer's program 11 (--profile long --seed 1812, its fuzz seed 1347238023)
        "fuzz_1812_11": (af.program("hc_fuzz11", o0=expmin(ctr(x * w * (af.max(masked, "j") + af.log(af.sum(
            af.exp(masked - af.max(masked, "j")), "j")))))),
            lambda X, W: texpmin(tctr(X * W * torch.logsumexp(tmasked(W), -1))), ((4, 17), (17,))),
        # the same shape, smaller: a mean of w scales a centred term, a max over j reads it
        "mean_w_max": (af.program("hc_mean_w_max", y=af.max(ctr(x * af.mean(w, "j")), "j")),
                       lambda X, W: tctr(X * W.mean()).amax(-1), ((5, 23), (23,))),
        # one logsumexp of w per batch entry b: the hoisted value ranges over b
        "batched_lse": (af.program("hc_batched_lse", y=expmin(ctr(xb * wb * lse(wb)))),
                        lambda X, W: texpmin(tctr(X * W[:, None, :] * torch.logsumexp(W, -1)[:, None, None])),
                        ((3, 4, 19), (3, 19))),
        # the gradient itself is the sum over (r, j): grad_s over b, a stage's own output
        "batched_scale": (af.program("hc_batched_scale", y=expmin(ctr(xb * sb))),
                          lambda X, S: texpmin(tctr(X * S[:, None, None])), ((3, 4, 19), (3,))),
    }


CASCADE = _cascade_programs()


@pytest.mark.parametrize("name", list(CASCADE))
def test_sum_over_rows_of_a_cascade_is_fused_over_the_cascade(name):
    """Issue 11 (gradient fuzzer, --profile long --seed 1812, program 11): the weight's
    gradient reads ``sum_j(sum_r(X))`` where X holds per-row sums over j (a cascade over j for
    each row r). Its pre-stage was refused ("no row axis"): fused over j, the (r, j) body was
    written whole and the sum over both after it had no rows; fused over r, the cascade over j
    is a pass inside the pass. The sums are swapped (``sum_r(sum_j(X))``, Fubini): one pass over
    j per row, then the sum of the per-row values. Gradients against float64 torch autograd."""
    prog, ref_fn, shapes = CASCADE[name]
    gen = torch.Generator().manual_seed(1812 + list(CASCADE).index(name))
    X, W = (torch.randn(s, generator=gen, dtype=torch.float64).float().double() for s in shapes)
    x, w = X.float().requires_grad_(), W.float().requires_grad_()
    k = af.compile(prog)
    wname = "s" if name == "batched_scale" else "w"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)   # torch's gradient would hide a refusal
        y = k(**{"x": x, wname: w})
        cot = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        y.backward(cot.float())
    assert k.grad_fallback is None
    xr, wr = X.clone().requires_grad_(), W.clone().requires_grad_()
    ref_fn(xr, wr).backward(cot)
    assert wr.grad.abs().max() > 1e-3, f"{name}: the weight's gradient is ~0 at this sample"
    _close(x.grad, xr.grad, f"{name}: grad_x", *TOL[torch.float32])
    _close(w.grad, wr.grad, f"{name}: grad_{wname}", *TOL[torch.float32])

    bwd = af.backward(prog)
    for st in bwd.stages:   # every chain of sums has the cascade's axis j innermost
        for n, e in st.outputs.items():
            t = e.term
            if t.op == "Sum" and t.args[1].op == "Sum" and t.args[1].args[0].args[0] != "j":
                assert not any(u.op == "Sum" and u.args[0].args[0] == "j" for u in t.args[1].args[1].walk()), \
                    f"{st.name}: {n} = {e}"
