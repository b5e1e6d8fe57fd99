"""Sum kernels whose states sum over two loop axes (codegen/sums.py, "two loop axes"):
``sum_i(sum_r(x))`` with ``r`` carried by every tensor over ``i`` and by no output (grouped-query
attention's dK/dV: the group members ``r`` share one key/value head). Each program (a tile of
``j``, per grid b g) loops over every ``r`` and, inside, over the tiles of ``i``, adding into the
same accumulators; nothing over (i, j, d) is written. Nothing names attention: the programs
below are written directly, in the form a derived backward stage has, and the stage
``af.backward`` derives for GQA qualifies by its form.

Against float64 torch at odd sizes (neither i nor j a multiple of the interpreter's 16-wide
tiles, r = 3), global and causal masks, both nestings; each test asserts the kernel is one sum
kernel with ``r`` looped over (each fails without the two-loop support: the stage compiled
to a staged kernel over an (i, j, d) intermediate, or did not compile)."""
import math
import sys
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse import autograd
from acefuse.codegen import riders as rd
from acefuse.codegen.riders import sum_kernel
from acefuse.codegen.sums_loops import compile_two_loops, double_sum_axis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import attention as A  # noqa: E402

SCALE = 0.125
B, G, R, NI, NJ, D, E = 1, 2, 3, 37, 29, 16, 24


def _program(mask, nesting):
    q = af.tensor("q", "b g r i d")
    k = af.tensor("k", "b g j d")
    v = af.tensor("v", "b g j e")
    go = af.tensor("go", "b g r i e")
    m = af.tensor("m", "b g r i")
    dd = af.tensor("dd", "b g r i")
    lse = af.tensor("l", "b g r i")
    i, j = af.index("i"), af.index("j")
    s = af.sum(q * k, "d") * SCALE
    if mask == "causal":
        s = af.where(j <= i, s, af.NEG_INF)
    p = af.exp(s - m) * af.where(lse.eq(0.0), 0.0, 1.0 / lse)
    ds = p * (af.sum(go * v, "e") - dd) * SCALE

    def two(x):
        return af.sum(af.sum(x, "r"), "i") if nesting == "ir" else af.sum(af.sum(x, "i"), "r")
    return af.program(f"two_loops_{mask}_{nesting}", grad_k=two(ds * q), grad_v=two(p * go))


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"q": t(B, G, R, NI, D), "k": t(B, G, NJ, D), "v": t(B, G, NJ, E), "go": t(B, G, R, NI, E),
            "m": t(B, G, R, NI) * 0.5 + 1.0, "dd": t(B, G, R, NI), "l": t(B, G, R, NI).abs() + 0.5}


def _reference(d, mask):
    s = torch.einsum("bgrid,bgjd->bgrij", d["q"], d["k"]) * SCALE
    ii, jj = torch.arange(NI)[:, None], torch.arange(NJ)[None, :]
    p = torch.exp(s - d["m"][..., None]) / d["l"][..., None]
    if mask == "causal":
        p = torch.where(jj <= ii, p, 0.0)
    ds = p * (torch.einsum("bgrie,bgje->bgrij", d["go"], d["v"]) - d["dd"][..., None]) * SCALE
    return {"grad_k": torch.einsum("bgrij,bgrid->bgjd", ds, d["q"]),
            "grad_v": torch.einsum("bgrij,bgrie->bgje", p, d["go"])}


@pytest.mark.parametrize("mask,nesting", [("causal", "ir"), ("global", "ir"), ("causal", "ri"),
                                          pytest.param("global", "ri", marks=pytest.mark.slow)])
def test_double_sum_is_one_sum_kernel(mask, nesting):
    prog = _program(mask, nesting)
    axis = double_sum_axis(prog)
    assert axis == nesting[0], "compile over the outer sum's axis (over the inner one the outer is staged)"
    k = af.compile(prog, axis=axis).kernel
    mod = k.module
    assert sum_kernel(k), f"expected one sum kernel, got {type(k).__name__}"
    # the mask reads i: i is tiled (and its tiles bounded by the mask analysis), r looped over
    tiled = "i" if mask == "causal" or nesting == "ir" else "r"
    assert mod.AXIS == tiled and mod.LOOP2_AXES == [{"i": "r", "r": "i"}[tiled]]
    assert mod.GRID_AXES == ["b", "g"] and mod.ROW_AXES == ["j"]
    if mask == "causal":
        assert "tiles where every mask condition is false add 0" in k.source
    ins = _inputs(7 + len(mask))
    ref = _reference(ins, mask)
    out = k(**{n: x.float() for n, x in ins.items()})
    for o in ("grad_k", "grad_v"):
        r, got = ref[o], out[o].double()
        assert r.abs().max() > 1e-2
        err = (got - r).abs().max().item()
        assert torch.isfinite(got).all() and err <= 2e-5 * r.abs().max().item(), f"{o}: max error {err}"


def test_double_sum_axis_only_for_double_sums_with_a_contraction():
    """compile_two_loops (and double_sum_axis) leave other stages to the usual axes: a single
    sum, a double sum without a dot inside (a norm's weight gradient: the row family's), a sum
    that keeps one of the summed axes, a triple sum."""
    x, gy, rs = af.tensor("x", "b t d"), af.tensor("gy", "b t d"), af.tensor("rs", "b t")
    w = af.tensor("w", "d")
    dot = af.sum(x * w, "d")
    assert double_sum_axis(af.program("one", o=af.sum(gy * dot, "t"))) is None
    assert double_sum_axis(af.program("norm_w", o=af.sum(af.sum(gy * x * rs, "t"), "b"))) is None
    assert double_sum_axis(af.program("tri", o=af.sum(af.sum(af.sum(gy * x, "d"), "t"), "b"))) is None
    assert double_sum_axis(af.program("two", o=af.sum(af.sum(gy * dot, "t"), "b"))) == "b"
    assert compile_two_loops(af.program("norm_w2", o=af.sum(af.sum(gy * x * rs, "t"), "b"))) is None


def test_the_looped_axis_is_not_read_as_a_grid_axis():
    """A wrong offset over r (every r reading r = 0's rows) is caught by the comparison."""
    k = af.compile(_program("global", "ir"), axis="i").kernel
    ins = _inputs(3)
    same = dict(ins)
    for n in ("q", "go", "m", "dd", "l"):
        same[n] = ins[n][:, :, :1].expand_as(ins[n]).contiguous()
    out = k(**{n: x.float() for n, x in ins.items()})
    assert not torch.allclose(out["grad_k"].double(), _reference(same, "global")["grad_k"], rtol=1e-3)
    assert torch.allclose(out["grad_k"].double(), _reference(ins, "global")["grad_k"], rtol=1e-4, atol=1e-4)


# -- the derived GQA backward --------------------------------------------------------------------
i_, j_ = af.index("i"), af.index("j")
GQA = {"gqa": A.gqa,
       "gqa_causal": A.attend("gqa_causal", af.where(j_ <= i_, af.sum(A.qg * A.kg, "d") * A.SCALE, af.NEG_INF),
                              v=A.vg)}


def _torch_gqa(name, q, k, v):
    s = torch.einsum("bgrid,bgjd->bgrij", q, k) * A.SCALE
    if name == "gqa_causal":
        ii = torch.arange(q.shape[-2])[:, None]
        jj = torch.arange(k.shape[-2])[None, :]
        s = torch.where(jj <= ii, s, -math.inf)
    return torch.einsum("bgrij,bgje->bgrie", torch.softmax(s, -1), v)


@pytest.mark.parametrize("name", ["gqa", pytest.param("gqa_causal", marks=pytest.mark.slow)])
def test_gqa_gradients_with_the_key_stage_as_one_sum_kernel(name, monkeypatch):
    """The derived GQA backward (a derivation: ~10 s here): dK/dV's stage is one sum kernel
    looping over r (autograd.compile_stage tries compile_two_loops first); dQ's stage rides its pass (codegen/riders.py: the rider's dQ rows are
    offset by r like the host's tensors); every gradient against float64 torch autograd."""
    finished = []
    real = rd.finish
    monkeypatch.setattr(rd, "finish", lambda *a: (finished.append(1), real(*a))[1])
    kern = af.compile(GQA[name])
    g = torch.Generator().manual_seed(5)
    n, d = 37, 16
    ins = {"q": torch.randn(1, 2, 3, n, d, generator=g) * 1.5, "k": torch.randn(1, 2, n, d, generator=g) * 1.5,
           "v": torch.randn(1, 2, n, d, generator=g)}
    cot = torch.randn(1, 2, 3, n, d, generator=g)
    got = {x: t.clone().requires_grad_() for x, t in ins.items()}
    kern(**got).backward(cot)
    assert kern.grad_fallback is None
    bk = kern._bwd_kernel
    [(st, ks)] = [(s, k) for s, k in zip(bk.program.stages, bk.kernels) if "grad_k" in s.outputs]
    assert sum_kernel(ks) and ks.module.LOOP2_AXES == ["r"], \
        f"{st.name}: expected one sum kernel looping over r, got {type(ks).__name__}"
    assert "grad_q" in ks.module.RIDERS and bk._riders and finished, "dQ should ride the dK/dV pass"
    ref = {x: t.double().requires_grad_() for x, t in ins.items()}
    _torch_gqa(name, **ref).backward(cot.double())
    for x in ins:
        r, a = ref[x].grad, got[x].grad.double()
        assert r.abs().max() > 1e-3
        err = (a - r).abs().max().item()
        assert torch.isfinite(a).all() and err <= 4e-5 * r.abs().max().item(), \
            f"{name}: grad of {x}: max error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GQA))
@pytest.mark.parametrize("n", [200, 1100])
def test_gqa_training_on_the_gpu(name, n):
    """On a GPU, bf16, a small shape (the sum kernels' untimed default configuration) and one
    above the timing threshold (timed candidates, the ride-or-apart choice): every gradient
    against float64 torch autograd, no fallback to torch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kern = af.compile(GQA[name])
    g = torch.Generator().manual_seed(n)
    d = A.D
    ins = {"q": torch.randn(2, 2, 4, n, d, generator=g), "k": torch.randn(2, 2, n, d, generator=g),
           "v": torch.randn(2, 2, n, d, generator=g)}
    cot = torch.randn(2, 2, 4, n, d, generator=g)
    got = {x: t.to("cuda", torch.bfloat16).requires_grad_() for x, t in ins.items()}
    kern(**got).backward(cot.to("cuda", torch.bfloat16))
    assert kern.grad_fallback is None
    ref = {x: t.to(torch.bfloat16).double().requires_grad_() for x, t in ins.items()}
    _torch_gqa(name, **ref).backward(cot.to(torch.bfloat16).double())
    for x in ins:
        r, a = ref[x].grad, got[x].grad.double().cpu()
        assert torch.isfinite(a).all(), f"{name}: non-finite grad of {x}"
        rel = ((a - r).norm() / r.norm()).item()
        assert rel < 2e-2, f"{name} n={n}: grad of {x}: norm-relative error {rel:.2e}"
