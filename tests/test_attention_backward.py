"""The FlashAttention-2 backward, derived from plain attention (no rule or template names it).

Layer (1): ``af.backward`` of the example attention programs, evaluated unfused by the
independent float64 reference (acefuse.reference), against float64 torch autograd of the
plain math (odd sizes, global / causal / ALiBi / softcap, a fully masked row). Layer (2): the
shape of the derived program: the max's adjoint vanishes (softmax is shift invariant), ``D_i``
reads ``sum_e(grad_o * o)`` with ``o`` the saved forward output, dQ is one reduction over
the keys and dK/dV are reductions over the queries (two stages).
"""
import math
import sys
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.backward import backward
from acefuse.reference import evaluate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import attention as A  # noqa: E402

B, H, NI, NJ, D = 1, 2, 19, 23, 16


def _inputs(seed, ni=NI, nj=NJ):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 2.0  # noqa: E731
    return {"q": t(B, H, ni, D), "k": t(B, H, nj, D), "v": t(B, H, nj, D),
            "slope": torch.rand(H, generator=g, dtype=torch.float64)}


def _torch_attention(name, q, k, v, slope):
    """The plain math, float64 (no acefuse code)."""
    s = q @ k.transpose(-1, -2) * A.SCALE
    i = torch.arange(q.shape[-2], dtype=torch.float64, device=q.device)[:, None]
    j = torch.arange(k.shape[-2], dtype=torch.float64, device=q.device)[None, :]
    if name in ("alibi", "alibi_global"):
        s = s + slope[None, :, None, None] * (j - i)
    if name == "softcap":
        s = A.CAP * torch.tanh(s / A.CAP)
    if name in ("causal", "alibi"):
        s = torch.where(j <= i, s, -math.inf)
    if name == "strict":   # query 0 sees no key: the forward's 0/0 -> 0 convention
        s = torch.where(j < i, s, -math.inf)
        m = s.amax(-1, keepdim=True).detach()
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
        l = p.sum(-1, keepdim=True)
        return (p @ v) / torch.where(l == 0, 1.0, l)
    return torch.softmax(s, -1) @ v


def _torch_grads(name, ins, cot):
    leaves = {n: x.clone().requires_grad_(True) for n, x in ins.items()}
    o = _torch_attention(name, **leaves)
    o.backward(cot)
    return {n: leaves[n].grad for n in ("q", "k", "v", "slope") if leaves[n].grad is not None}


def _derived_grads(prog, ins, cot):
    """Gradients from the derived backward program, evaluated unfused in float64."""
    bwd = backward(prog)
    ins = {n: x.numpy() for n, x in ins.items() if n in prog.tensors}
    fwd = evaluate(bwd.augmented, ins)
    vals = dict(ins, grad_o=cot.numpy())
    vals.update({n: fwd[n] for n in bwd.saved_kind})   # as saved (a masked row's -inf: guarded in the terms)
    out = evaluate(bwd, {n: vals[n] for n in bwd.tensors})
    res = {}
    for name, gname in bwd.grads.items():
        # the program's axis order may lay a gradient out as (b h d j) for k (b h j d): the
        # declarations of other programs move it (lang.axis_order); read it in k's own order
        have, want = bwd.outputs[gname].axes, bwd.input_axes[name]
        assert sorted(have) == sorted(want), (have, want)
        res[name] = torch.as_tensor(out[gname]).permute([have.index(a) for a in want])
    return res


def _close(got, ref, what, rtol=1e-9, atol=1e-9):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite gradient"
    err = ((got - ref).abs() - (atol * max(1.0, ref.abs().max().item()) + rtol * ref.abs())).max().item()
    assert err <= 0, f"{what}: max excess error {err:.3e}"


ATTN = {"attention": A.attention, "causal": A.causal, "alibi": A.alibi, "softcap": A.softcap}


@pytest.mark.parametrize("name", list(ATTN))
def test_derived_backward_matches_torch_autograd(name):
    ins = _inputs(hash(name) % 1000)
    cot = torch.randn(B, H, NI, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref = _torch_grads(name, ins, cot)
    got = _derived_grads(ATTN[name], ins, cot)
    assert set(got) == ({"q", "k", "v", "slope"} if name == "alibi" else {"q", "k", "v"})
    for n in got:
        assert ref[n].abs().max() > 1e-3, "the reference gradient must not be trivially small"
        _close(got[n], ref[n], f"{name}: grad_{n}")


def test_grouped_query_attention_backward_matches_torch_autograd():
    """GQA (q "b g r i d" over k/v "b g j d"): dK and dV also sum over the group members r."""
    g = torch.Generator().manual_seed(12)
    ins = {"q": torch.randn(B, 2, 3, NI, D, generator=g, dtype=torch.float64),
           "k": torch.randn(B, 2, NJ, D, generator=g, dtype=torch.float64),
           "v": torch.randn(B, 2, NJ, D, generator=g, dtype=torch.float64)}
    cot = torch.randn(B, 2, 3, NI, D, generator=g, dtype=torch.float64)
    leaves = {n: x.clone().requires_grad_(True) for n, x in ins.items()}
    sc = torch.einsum("bgrid,bgjd->bgrij", leaves["q"], leaves["k"]) * A.SCALE
    torch.einsum("bgrij,bgje->bgrie", torch.softmax(sc, -1), leaves["v"]).backward(cot)
    got = _derived_grads(A.gqa, ins, cot)
    for n in ("q", "k", "v"):
        _close(got[n], leaves[n].grad, f"gqa: grad_{n}")


def test_reference_comparison_catches_a_wrong_gradient():
    """The checker above fails on a gradient that is slightly off (a wrong D_i)."""
    ins = _inputs(3)
    cot = torch.randn(B, H, NI, D, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    ref = _torch_grads("causal", ins, cot)
    got = _derived_grads(A.causal, ins, cot)
    with pytest.raises(AssertionError):
        _close(got["q"] * (1 + 1e-6), ref["q"], "perturbed")
    with pytest.raises(AssertionError):   # softmax gradient without the D_i term
        _close(got["k"], _torch_grads("attention", ins, cot)["k"], "global vs causal")


def test_fully_masked_row_gets_zero_gradient():
    """``j < i`` masks every key of query 0: the forward gives o = 0 there (0/0 -> 0) and
    the gradient is 0, never NaN; the other rows match torch."""
    i, j = af.index("i"), af.index("j")
    strict = A.attend("strict", af.where(j < i, A.score, af.NEG_INF))
    ins = _inputs(5)
    cot = torch.randn(B, H, NI, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = _derived_grads(strict, ins, cot)
    assert (got["q"][:, :, 0] == 0).all()
    ref = _torch_grads("strict", ins, cot)
    for n in ("q", "k", "v"):
        _close(got[n], ref[n], f"grad_{n}")

def test_max_adjoint_is_dropped_only_when_it_vanishes():
    """Adding the max itself to the output makes the program depend on it: its adjoint no
    longer cancels, the tie routing stays, and the gradient still matches torch."""
    m = af.max(A.score, "j")
    p = af.exp(A.score - m)
    shifted = af.program("shifted", o=af.sum(p * A.v, "j") / af.sum(p, "j") + m)
    bwd = backward(shifted)
    assert any(s.op in ("CmpEq", "CmpGe") and _reads(s, "saved_m") for s in bwd.outputs["grad_q"].term.walk())
    ins = _inputs(21)
    cot = torch.randn(B, H, NI, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    leaves = {n: x.clone().requires_grad_(True) for n, x in ins.items()}
    sc = leaves["q"] @ leaves["k"].transpose(-1, -2) * A.SCALE
    (torch.softmax(sc, -1) @ leaves["v"] + sc.amax(-1, keepdim=True)).backward(cot)
    got = _derived_grads(shifted, ins, cot)
    for n in ("q", "k", "v"):
        _close(got[n], leaves[n].grad, f"shifted: grad_{n}")


def _reads(t, name):
    return any(s.op == "In" and s.args[0] == name for s in t.walk())


def _sums(t, axis):
    return [s for s in t.walk() if s.op == "Sum" and s.args[0].op == "Ax" and s.args[0].args[0] == axis]


@pytest.mark.parametrize("name", ["attention", "causal"])
def test_flash_attention_2_structure_is_derived(name):
    bwd = backward(ATTN[name])
    # P is recomputed from one saved value per row, L = m + log(l) (exp(s - L): the forward's max and
    # sum are not saved); the forward output o is read back
    assert set(bwd.saved) == {"saved_lse", "o"}
    assert bwd.saved_kind == {"saved_lse": "value", "o": "output"}
    assert "o" in bwd.augmented.outputs and bwd.augmented.outputs["o"].term == ATTN[name].outputs["o"].term
    gq, gk, gv = (bwd.outputs[f"grad_{n}"].term for n in "qkv")
    for g in (gq, gk, gv):   # the max's adjoint vanished: no tie indicator, no count of ties
        assert not any(s.op == "CmpEq" and _reads(s, "saved_m") for s in g.walk())
    # D_i = sum_e(grad_o * o): a reduction over the head dim, not over the keys
    for g in (gq, gk):
        (d_term,) = [s for s in _sums(g, "e") if _reads(s, "o")]
        assert _reads(d_term, "grad_o") and not _reads(d_term, "v")
    # dQ is one reduction over the keys; dK and dV are reductions over the queries
    (outer,) = _sums(gq, "j")
    assert outer == gq or outer in list(gq.walk())
    assert not any(_sums(s.args[1], "j") for s in _sums(gq, "j"))
    for g in (gk, gv):
        assert len(_sums(g, "i")) == 1 and not _sums(g, "j")
    stages = {s.name.rsplit("_", 1)[1]: sorted(s.outputs) for s in bwd.stages}
    # D_i once, in a pre-stage over the head dim (test_d_i_is_computed_once); dQ; dK and dV
    assert stages == {"e": ["pre1"], "j": ["grad_q"], "i": ["grad_k", "grad_v"]}
    assert [s.axis for s in bwd.stages] == ["e", "j", "i"]
    f = af.fuse(bwd)   # each stage: plain sums over its axis, one pass, certified like any fusion
    assert f.fusible and f.hbm_passes and "sum_e(grad_o * o)" in f.explain()


def test_d_i_is_found_by_the_rewrite_system():
    """``D_i``: the derivation gives the contraction ``sum_e(grad_o * S * r(l) * r(l))``
    (``S = sum_j(p * v)`` saved, ``r`` the safe reciprocal); the e-graph, with the proved
    library rules and this program's equation ``o = S * r(l)``, extracts
    ``sum_e(grad_o * o) * r(l)``. Without the equation, or without the rules, it does not."""
    from acefuse.backward import _Deriv
    from acefuse.backward_normal import saved_equations, read_saved
    from acefuse.rewrite.terms import Term
    from acefuse.rules import REGISTRY
    d = _Deriv(A.attention)
    eqs = saved_equations(d)
    (o_def,) = [t for key, _, t, _ in eqs if key == ("output", "o")]
    s_, r = o_def.args   # P(S) (the saved S) and r(l)
    assert s_.op == "In" and r.op == "Where"
    d.tensors["grad_o"] = ("b", "h", "i", "e")
    g = Term("In", ("grad_o",))
    u = Term("Sum", (Term("Ax", ("e",)), Term("Mul", (Term("Mul", (Term("Mul", (g, s_)), r)), r))))
    got = read_saved(d, u, eqs, list(REGISTRY.values()))
    o = Term("In", ("o",))
    assert got == Term("Mul", (Term("Sum", (Term("Ax", ("e",)), Term("Mul", (g, o)))), r)), got
    assert d.saved_outputs == {"o": ("b", "h", "i", "e")}   # o is read back from the forward
    no_eq = read_saved(d, u, [e for e in eqs if e[0] != ("output", "o")], list(REGISTRY.values()))
    assert no_eq is not None and not _reads(no_eq, "o") and _reads(no_eq, s_.args[0])
    assert not _reads(read_saved(d, u, eqs, []), "o")   # no rules: the equation alone is not enough


# ---- (3) the stages compiled (Triton's interpreter on the CPU) and (4) autograd through af.compile ----
TOL = {torch.float32: (2e-5, 2e-4), torch.float16: (4e-3, 2e-2)}
_KERNELS: dict = {}


def _strict():
    i, j = af.index("i"), af.index("j")
    return A.attend("strict", af.where(j < i, A.score, af.NEG_INF))


def _kernel(name):
    if name not in _KERNELS:
        _KERNELS[name] = af.compile(_strict() if name == "strict" else ATTN[name])
    return _KERNELS[name]


@pytest.mark.parametrize("name,ni,nj", [("attention", 33, 21), ("causal", 37, 40), ("strict", 17, 29)])
def test_compiled_gradients_match_torch_autograd(name, ni, nj):
    """af.compile(attention) is differentiable: its backward runs the derived stages (dQ over
    key tiles, dK/dV over query tiles), float32, odd sizes, against float64 torch autograd."""
    ins = _inputs(11 + ni, ni, nj)
    k = _kernel(name)
    x = {n: v.float().requires_grad_() for n, v in ins.items() if n in ("q", "k", "v")}
    o = k(**x)
    assert o.grad_fn is not None
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(ni), dtype=torch.float64)
    o.backward(cot.float())
    ref = _torch_grads(name, ins, cot)
    atol, rtol = TOL[torch.float32]
    for n in ("q", "k", "v"):
        _close(x[n].grad.double(), ref[n], f"{name}: grad_{n}", rtol=rtol, atol=atol)
    if name == "strict":
        assert (x["q"].grad[:, :, 0] == 0).all()


def test_backward_stages_use_dots_and_mask_analysis():
    dk = _kernel("causal")
    dk._grad_kernels()
    bk = dk._bwd_kernel
    assert [s.name for s in bk.program.stages] == ["causal_bwd_pre_e", "causal_bwd_j", "causal_bwd_i"]
    for kern in bk.kernels[1:]:
        src = kern.source
        assert src.count("tl.dot(") >= 3   # QK^T, dO V^T, and the accumulation into dQ or dK/dV
        assert "are skipped" in src         # tiles the causal mask excludes are not visited
    assert "sum_e(grad_o * o)" in bk.kernels[0].source


@pytest.mark.parametrize("name", ["attention", "causal", "softcap"])
def test_d_i_is_computed_once(name):
    """FlashAttention-2's D_i = sum_e(grad_o * o) does not range over the key tiles the dK/dV
    stage's grid runs over: a pre-stage computes it once and both stages read it, so neither
    reads the forward output o (before, dK/dV recomputed D for every query tile in every
    program of its grid)."""
    bwd = backward(ATTN[name])
    pre, dq, dkv = bwd.stages
    assert pre.hoisted and list(pre.outputs) == list(bwd.intermediates) == ["pre1"]
    assert str(pre.outputs["pre1"]) == "sum_e(grad_o * o)" and bwd.intermediates["pre1"] == ("b", "h", "i")
    assert "invariant along j in stage " + dkv.name in pre.hoisted["pre1"]
    for st in (dq, dkv):
        assert "o" not in st.tensors and "pre1" in st.tensors
        assert not any(str(u) == "sum_e(grad_o * o)" for e in st.outputs.values() for u in e.term.walk())
    assert "o" in bwd.tensors and "pre1" not in bwd.tensors   # the call passes o; pre1 stays inside


def test_backward_kernel_float16():
    """The BackwardKernel called directly, float16 inputs (float32 accumulation)."""
    bwd = backward(A.causal)
    bk = af.compile(bwd)
    fwd = af.compile(bwd.augmented)
    ins = _inputs(4, 21, 19)
    h = {n: ins[n].half() for n in ("q", "k", "v")}
    aug = fwd(**h)
    cot = torch.randn(B, H, 21, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    g = bk(**h, **{n: aug[n] for n in bwd.saved}, grad_o=cot.half())
    ref = _torch_grads("causal", {n: v.half().double() for n, v in ins.items()}, cot.half().double())
    atol, rtol = TOL[torch.float16]
    for n in ("q", "k", "v"):
        assert g[f"grad_{n}"].dtype == torch.float16
        _close(g[f"grad_{n}"].double(), ref[n], f"float16 grad_{n}", rtol=rtol, atol=atol)


# ---- (5) a per-head ALiBi slope's gradient: derived kernels, never the N x N dS ----
def _alibi_global():
    i, j = af.index("i"), af.index("j")
    return A.attend("alibi_global", A.score + A.slope * (j - i))


@pytest.mark.parametrize("name,ni,nj,wrt", [("alibi", 17, 23, "qkvs"), ("alibi_global", 21, 13, "qkvs"),
                                            ("alibi", 19, 11, "s")])
def test_alibi_slope_gradient_is_derived(name, ni, nj, wrt):
    """grad_slope[h] = sum_{b,i,j} dS * (j - i). It is not one reduction over a fused axis:
    dQ's stage (or a stage of its own when only the slope requires grad) reduces the body over
    the keys, ``part_grad_slope`` over (b, h, i), and the sum over b and i is a second step
    (``bwd.finish``). No stage writes anything over both i and j. Compiled (float32, odd sizes,
    causal and global), no fallback to torch, against float64 torch autograd of the plain math."""
    from acefuse.autograd import GradientFallbackWarning
    import warnings
    prog = A.alibi if name == "alibi" else _alibi_global()
    names = [{"s": "slope"}.get(c, c) for c in wrt]
    bwd = backward(prog, wrt=names)
    assert bwd.finish == {"grad_slope": ("part_grad_slope", ("b", "i"))}
    (st,) = [s for s in bwd.stages if "part_grad_slope" in s.outputs]
    assert st.axis == "j" and ("grad_q" in st.outputs) == ("q" in names)
    for s in bwd.stages:
        for n, e in s.outputs.items():
            assert not {"i", "j"} <= set(e.axes), f"stage {s.name} writes {n} over {e.axes}"
    ins = _inputs(ni * nj, ni, nj)
    x = {n: v.float().requires_grad_(n in names) for n, v in ins.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        o = af.compile(prog)(**x)
        cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(ni), dtype=torch.float64)
        o.backward(cot.float())
    leaves = {n: v.clone().requires_grad_(n in names) for n, v in ins.items()}
    _torch_attention(name, **leaves).backward(cot)
    atol, rtol = TOL[torch.float32]
    for n in names:
        assert leaves[n].grad.abs().max() > 1e-3, "the reference gradient must not be trivially small"
        _close(x[n].grad.double(), leaves[n].grad, f"{name}: grad_{n}", rtol=rtol, atol=atol)
