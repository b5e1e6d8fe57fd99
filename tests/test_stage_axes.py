"""Programs that reduce over several axes (issue 11 close-out gaps): each kernel reduces over one.

- The fused axis picked without ``axis=`` (acefuse/fuse.py ``_pick_axis``): when fusing over the
  outermost reduced axis leaves no row axis (a 0-d output, ``sum_r(sum_j(x * x))``; an output
  every tensor over that axis carries), the innermost reduced axis is fused and the reductions
  around it are second stages (codegen/compile.py ``stage``, staged again for three axes).
- A staged program's stage 2 reads the reductions over the fused axis left outside the staged
  bodies as outputs of stage 1 (fp8_linear's gradient: ``sum_n(grad_out * wq * ws)`` beside
  ``sum_h(stage_1)``), so stage 2 reduces over the other axes only and compiles; af.fuse fuses
  stage 2 too, so its report and the kernels agree.

Every result against float64 torch autograd of plain math written here, fresh random inputs,
odd sizes; a float cast passes the gradient straight through (README, Gradients).
"""
import runpy
import warnings
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.autograd import GradientFallbackWarning
from acefuse.fuse import FuseError

EX = Path(__file__).resolve().parents[1] / "examples"
TOL = {torch.float32: (1e-4, 2e-5), torch.bfloat16: (1.6e-2, 8e-3)}
_K: dict = {}


def _ste(v, dtype):   # a float cast that passes the gradient straight through
    return v + (v.to(dtype).to(v.dtype) - v).detach()


def _kernel(name, prog):
    if name not in _K:
        _K[name] = af.compile(prog)
    return _K[name]


def grads_vs_float64(k, ref, inputs64: dict, dtype, seed, wrt):
    """The kernel's outputs and the gradients of ``wrt`` (inputs rounded to ``dtype``, a random
    cotangent) against float64 autograd of ``ref``; no gradient may fall back to torch. Per
    element: |got - ref| <= rtol |ref| + stol max|ref| + 16 (torch float32's own error)."""
    ins = {n: (t.to(dtype) if t.dtype == torch.float64 else t) for n, t in inputs64.items()}
    leaves = {n: (t.clone().requires_grad_() if n in wrt else t) for n, t in ins.items()}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = k(**leaves)
        out = out if isinstance(out, dict) else {next(iter(k.prog.outputs)): out}
        g = torch.Generator().manual_seed(seed)
        cots = {n: torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for n, o in out.items()}
        got = torch.autograd.grad(list(out.values()), [leaves[n] for n in wrt], list(cots.values()))
    fell = [str(r.message) for r in rec if issubclass(r.category, GradientFallbackWarning)]
    assert not fell and not k.grad_fallback, f"gradient fell back to torch: {fell or k.grad_fallback}"

    def reference(rdt):
        lv = {n: (t.detach().to(rdt).requires_grad_() if n in wrt else
                  (t.to(rdt) if t.dtype.is_floating_point and t.dtype.itemsize > 1 else t))
              for n, t in ins.items()}
        o = ref(**lv)
        return o, dict(zip(wrt, torch.autograd.grad([o[n] for n in cots], [lv[n] for n in wrt],
                                                    [c.to(rdt) for c in cots.values()])))
    rout, want = reference(torch.float64)
    _, w32 = reference(torch.float32)
    rtol, stol = TOL[dtype]
    for n, o in out.items():
        r = rout[n].detach()
        assert torch.allclose(o.double(), r, rtol=2 * rtol, atol=2 * stol * r.abs().max().item() + 1e-6), \
            f"output {n} off by {(o.double() - r).abs().max().item():.3g}"
    for n, r in want.items():
        gg = got[wrt.index(n)].double()
        assert gg.shape == r.shape and torch.isfinite(gg).all()
        bound = rtol * r.abs() + stol * r.abs().max() + 16 * (w32[n].double() - r).abs().max() + 1e-12
        bad = (gg - r).abs() > bound
        assert not bad.any(), (f"grad {n}: {int(bad.sum())} of {bad.numel()} off, max error "
                               f"{(gg - r).abs().max().item():.3g} (scale {r.abs().max().item():.3g})")
        assert r.abs().max() > 1e-3


# ---- backward stages that reduce over two axes -----------------------------------------------------
def _quant():
    return runpy.run_path(str(EX / "quant.py"), run_name="examples_stage_axes_quant")


def _fp8_linear_ref(x, wq, ws):
    s = x.abs().amax(-1) / 448.0
    q = _ste(x / s[:, None], torch.float8_e4m3fn)
    return {"out": (q @ wq.to(x.dtype).t()) * s[:, None] * ws.to(x.dtype)[None, :]}


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_fp8_linear_backward_is_derived(dtype):
    """examples/quant.py fp8_linear: the stage over n reads sum_h(...sum_n(...)) and sum_n(...)
    independently; stage 1 (over n) computes both sums over n, stage 2 (over h) the rest. Fails
    before: stage 2 reduced over n and h ('pick the one to fuse with axis=...'), gradients by torch."""
    prog = _quant()["fp8_linear"]
    bwd = af.backward(prog)
    f = af.fuse(bwd)
    assert f.fusible, f.reason
    assert "fused over 'h': fusible" in f.explain(chains=False)
    k = _kernel("fp8_linear", prog)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        wv = torch.randn(6, 37, generator=g)
        ws = wv.abs().amax(1) / 448.0
        ins = {"x": torch.randn(5, 37, generator=g, dtype=torch.float64),
               "wq": (wv / ws[:, None]).to(torch.float8_e4m3fn), "ws": ws.to(dtype)}
        grads_vs_float64(k, _fp8_linear_ref, ins, dtype, seed, ["x"])


x_th = af.tensor("x", "t h")
w_nh = af.tensor("w", "n h")
_mu = af.mean(x_th, "h")
_var = af.mean((x_th - _mu) * (x_th - _mu), "h")
NORM_LINEAR = {
    # grad_x = sum_n(g * w) - sum_h(sum_n(g * w)) / H: failed before (the stage over h wrote an
    # output over the key axis; over n its second stage reduced over n and h)
    "centered_linear": (af.program("centered_linear", out=af.sum((x_th - _mu) * w_nh, "h")),
                        lambda x, w: {"out": (x - x.mean(-1, keepdim=True)) @ w.t()}),
    # layernorm (no affine) feeding a linear layer in one program
    "ln_linear": (af.program("ln_linear", out=af.sum((x_th - _mu) * af.rsqrt(_var + 1e-5) * w_nh, "h")),
                  lambda x, w: {"out": torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5) @ w.t()}),
}


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", list(NORM_LINEAR))
def test_norm_into_linear_backward_is_derived(name, dtype):
    prog, ref = NORM_LINEAR[name]
    f = af.fuse(af.backward(prog))
    assert f.fusible, f.reason
    k = _kernel(name, prog)
    g = torch.Generator().manual_seed(11)
    ins = {"x": 1 + torch.randn(7, 45, generator=g, dtype=torch.float64),
           "w": torch.randn(5, 45, generator=g, dtype=torch.float64)}
    grads_vs_float64(k, ref, ins, dtype, 3, ["x", "w"])


# ---- outputs reduced over every axis, no axis= -------------------------------------------------------
x_brj = af.tensor("x", "b r j")
ALL_AXES = {
    "zero_d_sum3": (af.program("zero_d_sum3", y=af.sum(af.sum(af.sum(x_brj * x_brj, "j"), "r"), "b")),
                    lambda x: {"y": (x * x).sum()}),
    "zero_d_mean3": (af.program("zero_d_mean3", y=af.mean(af.mean(af.mean(x_brj, "j"), "r"), "b")),
                     lambda x: {"y": x.mean()}),
    "zero_d_max3": (af.program("zero_d_max3", y=af.max(af.max(af.max(x_brj, "j"), "r"), "b")),
                    lambda x: {"y": x.amax()}),
    # an output over b that x (over r) carries: fused over r no kernel has rows either
    "per_b_sum2": (af.program("per_b_sum2", y=af.sum(af.sum(af.exp(x_brj), "j"), "r")),
                   lambda x: {"y": x.exp().sum((1, 2))}),
}


@pytest.mark.parametrize("name", list(ALL_AXES))
def test_output_reduced_over_every_axis_compiles_without_axis(name):
    """Fails before: CodegenError 'no row axis' (the outermost axis was fused)."""
    prog, ref = ALL_AXES[name]
    f = af.fuse(prog)
    assert f.axis == "j" and f.fusible, f.reason
    assert f.explain(chains=False).count("stage 2 (program") == len(prog.reduced_axes()) - 1
    k = _kernel(name, prog)
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads_vs_float64(k, ref, {"x": x}, torch.float32, 5, ["x"])


def test_zero_d_output_of_two_leaf_axes_names_them():
    """sum_r(sum_j(x) * sum_k(z)): two innermost axes, no rule picks one: the error names the
    program and the axes and says to pass axis=."""
    x, z = af.tensor("x", "r j"), af.tensor("z", "r k")
    prog = af.program("two_leaves", y=af.sum(af.sum(x, "j") * af.sum(z, "k"), "r"))
    with pytest.raises(FuseError, match=r"'two_leaves' reduces over several axes \['r', 'j', 'k'\].*axis="):
        af.compile(prog)


def test_stage_two_that_does_not_compile_is_reported():
    """af.fuse fuses a staged program's stage 2 as af.compile would: when it cannot (here it
    reduces over j and k independently), the report says not fusible and names stage 2."""
    x, z = af.tensor("x", "r j e"), af.tensor("z", "r k")
    prog = af.program("stage2_two_axes", y=af.sum(af.sum(af.sum(x, "e"), "j") * af.sum(z, "k"), "r"))
    f = af.fuse(prog, axis="e")
    assert not f.fusible and "stage 2 (program 'stage2_two_axes_stage2') does not compile" in f.reason
    with pytest.raises(FuseError, match="'stage2_two_axes_stage2' reduces over several axes"):
        af.compile(prog, axis="e")


def test_training_layout_kept_when_an_input_is_declared_again():
    """The augmented forward (the program plus its saved values) and the stages lay out outputs in
    the forward's axis order: before, a program built, then ``x`` declared again (another script,
    examples/quant.py, run in the same process), had its output transposed as soon as an input
    required grad (axis_order follows the latest declarations: [n, t] instead of [t, n])."""
    x, w = af.tensor("x", "t h"), af.tensor("w", "n h")
    prog = af.program("rms_linear_redeclared", out=af.sum(x * w, "h") * af.rsqrt(af.mean(x * x, "h") + 1e-6))
    af.tensor("x", "t h")
    k = af.compile(prog)
    g = torch.Generator().manual_seed(4)
    ins = {"x": torch.randn(7, 45, generator=g, dtype=torch.float64),
           "w": torch.randn(5, 45, generator=g, dtype=torch.float64)}
    grads_vs_float64(k, lambda x, w: {"out": (x @ w.t()) * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)},
                     ins, torch.float32, 6, ["x", "w"])


def test_reduction_over_another_axis_outside_the_fused_one_says_what_to_do():
    """sum_j(x) * sum_k(z) fused over j: the row family has no kernel for sum_k(z) (another axis,
    outside any reduction over j). The error names the program, the term and both axes, and says
    what to do; before it named neither the program nor a way out."""
    from acefuse.codegen.emit import CodegenError
    x, z = af.tensor("x", "r j"), af.tensor("z", "r k")
    prog = af.program("two_axes_out", y=af.sum(x, "j") * af.sum(z, "k"))
    with pytest.raises(CodegenError, match=r"'two_axes_out'.*`sum_k\(z\)` reduces over axis 'k', another axis "
                                           r"than the fused 'j'.*program of its own"):
        af.compile(prog, axis="j")
