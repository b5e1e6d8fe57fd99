"""Issue 11: the backward of the mask gallery's variants (examples/masks.py) is derived into
kernels, with no torch fallback: masks from integer index arithmetic (``%``, ``//``: dilated
windows, blocks, NATTEN), lookups (``doc[n=i]``), and contractions without a softmax
(sigmoid/ReLU attention), lookups whose index reads the reduced axis (a relative-position
bias, paged keys and values). Each variant's gradients, in float32 and bfloat16, against float64
torch autograd of the gallery's own reference on fresh random inputs (odd sizes, a grid of
6 x 8 for NATTEN).

Tolerances: ``|got - ref| <= RTOL |ref| + STOL max|ref|`` per gradient; in bfloat16 plus twice
torch's own error (autograd of the same reference in bfloat16), the yardstick for a contraction
computed in a 16-bit type."""
import runpy
import warnings
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.autograd import GradientFallbackWarning

EX = Path(__file__).resolve().parents[1] / "examples"
TOL = {torch.float32: (1e-4, 2e-5), torch.bfloat16: (1.6e-2, 8e-3)}
_GAL: dict = {}
_K: dict = {}


def gallery():
    if not _GAL:
        _GAL.update(runpy.run_path(str(EX / "masks.py"), run_name="examples_masks"))
    return _GAL


def grads(name, dtype, seed, n=11):
    """(kernel gradients, float64 reference gradients, torch's gradients in ``dtype``)."""
    gal = gallery()
    var = gal["GALLERY"][name]
    N = gal["GRID"][0] * gal["GRID"][1] if name == "natten_2d" else n
    made = gal["make_inputs"](name, B=1, H=2, N=N, seed=seed)
    ins = {t: (x.to(dtype) if x.dtype.is_floating_point else x) for t, x in made.items() if t in var.program.tensors}
    extra = {t: x for t, x in made.items() if t not in var.program.tensors}
    if name not in _K:
        _K[name] = af.compile(var.program)
    k = _K[name]
    leaves = {t: (x.clone().requires_grad_() if x.dtype.is_floating_point else x) for t, x in ins.items()}
    wrt = [t for t, x in leaves.items() if x.dtype.is_floating_point]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        o = k(**leaves)
        o = o if isinstance(o, torch.Tensor) else o["o"]
        cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        got = dict(zip(wrt, torch.autograd.grad(o, [leaves[t] for t in wrt], cot, allow_unused=True)))
    assert k.grad_fallback is None, k.grad_fallback

    def ref(tp):
        lv = {t: (x.detach().to(tp).requires_grad_() if x.dtype.is_floating_point else x) for t, x in ins.items()}
        ex = {t: (x.to(tp) if x.dtype.is_floating_point else x) for t, x in extra.items()}
        r = var.reference(**lv, **ex)
        g = torch.autograd.grad(r, [lv[t] for t in wrt], cot.to(tp), allow_unused=True)
        return r, {t: torch.zeros_like(lv[t]) if x is None else x for t, x in zip(wrt, g)}
    r64, want = ref(torch.float64)
    assert torch.allclose(o.double(), r64, rtol=2 * TOL[dtype][0], atol=2 * TOL[dtype][1] * r64.abs().max().item()), \
        f"{name}: the forward is off by {(o.double() - r64).abs().max().item():.3g}"
    theirs = ref(dtype)[1] if dtype != torch.float32 else None
    return got, want, theirs


def check(name, dtype, seed=3, n=11):
    got, want, theirs = grads(name, dtype, seed, n)
    rtol, stol = TOL[dtype]
    assert any(w.abs().max() > 1e-3 for w in want.values()), f"{name}: every reference gradient ~ 0"
    for t, w in want.items():
        g = torch.zeros_like(w) if got[t] is None else got[t].double()
        bound = rtol * w.abs() + stol * w.abs().max()
        if theirs is not None:
            bound = bound + 2 * (theirs[t].double() - w).abs().max()
        err = (g - w).abs()
        assert torch.isfinite(g).all() and (err <= bound).all(), \
            f"{name} {dtype}: grad {t} off by {err.max().item():.3g} (scale {w.abs().max().item():.3g})"


INDEX_ARITHMETIC = ["dilated_sliding_window", "block_diagonal", "block_causal", "natten_2d", "document_mask"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", INDEX_ARITHMETIC)
def test_index_arithmetic_masks_backward_is_kernels(name, dtype):
    """``%``, ``//`` of indices and lookups of integer tensors inside the backward's stages: exact
    int64 with torch's rounding toward -inf (the forward families' semantics), no fallback."""
    check(name, dtype)


@pytest.mark.parametrize("name", ["block_causal", "dilated_sliding_window"])
def test_block_masks_backward_skips_tiles(name):
    """Conditions with // and % by a power of two, == and != take part in the sum kernel's mask
    analysis: the dK/dV and dQ passes skip the tiles the mask excludes (N = 40: several tiles of
    16 under the interpreter, some skipped, some all-true), with the gradients still right."""
    from acefuse.autograd import compile_backward
    bk = compile_backward(af.backward(gallery()["GALLERY"][name].program))
    for st, k in zip(bk.program.stages, bk.kernels):
        if st.axis in ("i", "j"):
            assert "seen = " in k.source and "alltrue = " in k.source, f"{st.name}: no tile skipping"
    got, want, _ = grads(name, torch.float32, 7, n=40)
    for t, w in want.items():
        err = (got[t].double() - w).abs()
        assert (err <= 1e-4 * w.abs() + 2e-5 * w.abs().max()).all(), f"{name}: grad {t} off by {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["sigmoid_attention", "relu_attention"])
def test_contractions_without_softmax_backward_is_kernels(name, dtype):
    """No softmax: dQ = sum_j(dS * k) * c is a constant times a sum over keys, an output over the
    contraction axis d (the sum kernel's, not the attention template's)."""
    check(name, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_lookup_table_gradient_is_a_scatter(dtype):
    """T5's buckets: the table's gradient sum_j(sum_i(where(index(u) == bucket, sum_b(dS), 0))) is
    added per (query, key) element into the entry it read (a scatter in dQ's pass), not summed
    once per entry; the table's gradient is checked with the others."""
    check("t5_buckets", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["relative_bias", "paged_kv"])
def test_lookups_at_the_reduced_axis_backward_is_kernels(name, dtype):
    """Lookups whose index reads the stage's loop axis: ``rel[r = j - i + size(i) - 1]`` (size(i)
    inside the dK/dV stage's sums over i is the whole axis's, one leaf of the encoding; the
    table's gradient a scatter in dQ's pass) and paged keys ``kc[n = pages[j // 8] * 8 + j % 8]``
    (gathered vectors over d per key; the pool's gradient dK added row by row into the slots the
    page table names). Both fell back to torch before."""
    check(name, dtype)


def test_paged_kv_stages_apart_past_the_last_page(monkeypatch):
    """Each stage run by its own kernel (on the CPU dQ's stage otherwise rides the dK/dV pass),
    N = 17: the last loop tile's columns past N index a page past the page table's end, and the
    gathered keys there (a dot operand) are 0, not NaN (0 * NaN poisoned every dQ row before)."""
    from acefuse.autograd import BackwardKernel
    monkeypatch.setattr(BackwardKernel, "_ride", lambda self, *a, **kw: False)
    check("paged_kv", torch.float32, seed=5, n=17)


def test_paged_kv_pool_gradient_is_a_row_scatter_with_shared_pages():
    """The pool's gradient is dK/dV (rows: keys) added into the slots the page table names,
    atomically: two sequences sharing a page (a common prefix) add into the same rows of the
    pool, and pool rows no page names get 0. Checked on such a page table against float64
    autograd of the gallery's reference; the dK/dV stage stores nothing over (b, h, j)."""
    from acefuse.autograd import compile_backward
    gal = gallery()
    var = gal["GALLERY"]["paged_kv"]
    bk = compile_backward(af.backward(var.program))
    st = [(s, k) for s, k in zip(bk.program.stages, bk.kernels) if s.row_scatters]
    assert [sorted(s.row_scatters) for s, _ in st] == [["grad_kc", "grad_vc"]]
    assert st[0][1].source.count("tl.atomic_add(grad_") == 2
    made = gal["make_inputs"]("paged_kv", B=2, H=2, N=13, seed=4)
    made["pages"] = torch.tensor([[3, 0], [3, 5]], dtype=torch.int32)   # page 3 shared by both sequences
    made["kvalid"] = torch.ones_like(made["kvalid"])
    ins = {t: x for t, x in made.items() if t in var.program.tensors}
    extra = {t: x for t, x in made.items() if t not in var.program.tensors}
    if "paged_kv" not in _K:
        _K["paged_kv"] = af.compile(var.program)
    leaves = {t: (x.clone().requires_grad_() if x.dtype.is_floating_point else x) for t, x in ins.items()}
    wrt = [t for t, x in leaves.items() if x.dtype.is_floating_point]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        o = _K["paged_kv"](**leaves)
        o = o if isinstance(o, torch.Tensor) else o["o"]
        cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(9))
        got = dict(zip(wrt, torch.autograd.grad(o, [leaves[t] for t in wrt], cot)))
    lv = {t: (x.double().requires_grad_() if x.dtype.is_floating_point else x) for t, x in ins.items()}
    r = var.reference(**lv, **{t: (x.double() if x.dtype.is_floating_point else x) for t, x in extra.items()})
    want = dict(zip(wrt, torch.autograd.grad(r, [lv[t] for t in wrt], cot.double())))
    shared = slice(3 * 8, 4 * 8)
    assert want["kc"][:, shared].abs().max() > 1e-2     # the shared page gets both sequences' parts
    for t, w in want.items():
        err = (got[t].double() - w).abs()
        assert (err <= 1e-4 * w.abs() + 2e-5 * w.abs().max()).all(), f"grad {t} off by {err.max().item():.3g}"


def _inside_grads(dtype, seed=2):
    A = runpy.run_path(str(EX / "attention.py"), run_name="examples_attention")
    if "inside" not in _K:
        _K["inside"] = af.compile(A["inside"])
    g = torch.Generator().manual_seed(seed)
    ins = {"q": torch.randn(1, 2, 7, 5, generator=g) * 2, "k": torch.randn(1, 2, 23, 5, generator=g) * 2,
           "v": torch.randn(1, 2, 23, 3, generator=g)}
    ins = {n: x.to(dtype) for n, x in ins.items()}
    cot = torch.randn(1, 2, 7, 3, generator=g).to(dtype)
    leaves = {n: x.clone().requires_grad_() for n, x in ins.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        o = _K["inside"](**leaves)
        o = o if isinstance(o, torch.Tensor) else o["o"]
        got = dict(zip(leaves, torch.autograd.grad(o, list(leaves.values()), cot)))

    def ref(tp):
        lv = {n: x.detach().to(tp).requires_grad_() for n, x in ins.items()}
        r = torch.softmax(lv["q"] @ lv["k"].transpose(-1, -2) * A["SCALE"], -1) @ lv["v"]
        return dict(zip(lv, torch.autograd.grad(r, list(lv.values()), cot.to(tp))))
    return got, ref(torch.float64), (ref(dtype) if dtype != torch.float32 else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_normalize_inside_backward_is_kernels(dtype):
    """attention.py's ``inside`` (sum_j(p * v / sum_j(p))): dQ is a combination of three sums over
    keys and per-row values, computed after the loop (the sum kernel's finalize)."""
    got, want, theirs = _inside_grads(dtype)
    rtol, stol = TOL[dtype]
    for t, w in want.items():
        bound = rtol * w.abs() + stol * w.abs().max() + (0 if theirs is None else 2 * (theirs[t].double() - w).abs().max())
        err = (got[t].double() - w).abs()
        assert (err <= bound).all(), f"inside {dtype}: grad {t} off by {err.max().item():.3g}"


def test_checker_fails_on_a_wrong_gradient(monkeypatch):
    """The check fails when the kernels' gradients are scaled by 1.001 (float32)."""
    from acefuse.autograd import BackwardKernel
    good = BackwardKernel.__call__
    monkeypatch.setattr(BackwardKernel, "__call__",
                        lambda self, *a, **kw: {n: t * 1.001 for n, t in good(self, *a, **kw).items()})
    with pytest.raises(AssertionError, match="off by"):
        check("block_causal", torch.float32)


def test_block_mask_by_a_non_power_of_two_skips_tiles_in_the_backward():
    """Blocks of 6 keys (j // 6 <= i // 6): the sum kernel's mask analysis takes // and % by any
    positive integer since masks.py's bounds are exact integer floor divisions (they were limited to
    powers of two while the bounds divided with Triton's float /); the dK/dV and dQ passes skip
    tiles, and the gradients match float64 autograd (N = 40: several 16-key tiles)."""
    from acefuse.autograd import compile_backward
    gal = gallery()
    i, j = af.index("i"), af.index("j")
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    score = af.sum(q * k, "d") * gal["SCALE"]
    prog = gal["softmax_attention"]("block6_causal", af.where(j // 6 <= i // 6, score, af.NEG_INF))
    bk = compile_backward(af.backward(prog))
    skipping = [st.name for st, kk in zip(bk.program.stages, bk.kernels)
                if st.axis in ("i", "j") and "seen = " in kk.source]
    assert skipping, "no backward stage skips tiles"
    g = torch.Generator().manual_seed(11)
    ins = {n: torch.randn(1, 2, 40, 8, generator=g) for n in ("q", "k", "v")}
    kern = af.compile(prog)
    leaves = {n: x.clone().requires_grad_() for n, x in ins.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        o = kern(**leaves)
        cot = torch.randn(o.shape, generator=g)
        got = torch.autograd.grad(o, list(leaves.values()), cot)
    lv = {n: x.double().requires_grad_() for n, x in ins.items()}
    ii, jj = gal["_ij"](lv["q"], lv["k"])
    ref = gal["softmax_reference"](gal["_scores"](lv["q"], lv["k"]), lv["v"], (jj // 6) <= (ii // 6))
    want = torch.autograd.grad(ref, list(lv.values()), cot.double())
    for n, gg, w in zip(leaves, got, want):
        err = (gg.double() - w).abs()
        assert (err <= 1e-4 * w.abs() + 2e-5 * w.abs().max()).all(), f"grad {n} off by {err.max().item():.3g}"
