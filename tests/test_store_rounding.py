"""16-bit outputs are rounded to nearest even, bit for bit as torch's ``.to()``, in every kernel
family (issues 12 and 14). Triton's interpreter truncates a float32 -> bfloat16 conversion, so
a plain ``v.to(ptr.dtype.element_ty)`` store came out one unit low in about half the elements;
the generated modules now store through ``_out`` (codegen/row.py's header, shared by every
family): the plain conversion on a GPU, the bits of ``_rnd_bf16`` under the interpreter.

Each test feeds fresh random inputs chosen so that the kernel's float32 arithmetic is exact
(products of 16-bit values; sums of multiples of a power of two far below 2^24), whatever the
summation order: the float32 value is then the float64 reference, and the stored output must
be that value rounded once, ``ref64.to(dtype)``, bit for bit. Each also checks that the
inputs are not vacuous: a good share of the elements round up (a truncating store fails)."""
import numpy as np
import pytest
import torch

import acefuse as af

DTYPES = [torch.bfloat16, torch.float16]
ROW_SCHEDULES = [("single", {}), ("loop", {"block_j": 16}), ("split", {"block_j": 16, "nsplit": 3})]


def _gen():
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    return torch.Generator().manual_seed(seed), seed


def _grid(shape, g, lo, hi, step):
    """Random multiples of ``step`` in [lo, hi] (exact in bfloat16 and float16 for |.| < 256 steps)."""
    return torch.randint(int(lo / step), int(hi / step) + 1, shape, generator=g).double() * step


def _check(got, ref64, dtype, what):
    """``got`` is ``ref64`` (exact float32 values) rounded to nearest even into ``dtype``, bit for
    bit; and rounding up matters for at least a tenth of the elements (truncation would differ)."""
    want = ref64.to(dtype)
    assert got.dtype == dtype, (what, got.dtype)
    assert torch.equal(ref64.float().double(), ref64), f"{what}: the reference is not exact in float32"
    up = want.double().abs() > ref64.abs()   # rounded away from zero: a truncating store differs
    assert up.double().mean() > 0.1, f"{what}: too few elements round up to test anything"
    bad = got.view(torch.int16) != want.view(torch.int16)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ from the float32 value "
                           f"rounded to nearest even (first: got {got[bad][:4].tolist()}, want {want[bad][:4].tolist()})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_family_output_is_rounded_to_nearest(dtype):
    """Row family (codegen/row.py ``stored``), every schedule: y = x * w (exact in float32)."""
    x, w = af.tensor("x", "r j"), af.tensor("w", "r j")
    k = af.compile(af.program("store_round_row", y=x * w, s=af.sum(x * w, "j")))
    g, seed = _gen()
    X, W = (torch.randn(6, 50, generator=g).to(dtype) for _ in range(2))
    ref = X.double() * W.double()
    for sched, kw in ROW_SCHEDULES:
        _check(k(x=X, w=W, schedule=sched, **kw)["y"], ref, dtype, f"row {sched}, {dtype}, seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_contraction_family_output_is_rounded_to_nearest(dtype):
    """Contraction family (codegen/contraction.py ``store_outputs``), loop and split schedules:
    o = sum_j (sum_d q k) v, with values that keep every float32 partial sum exact."""
    q, kk, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    k = af.compile(af.program("store_round_contraction", o=af.sum(af.sum(q * kk, "d") * v, "j")))
    g, seed = _gen()
    Q, K = _grid((1, 2, 13, 16), g, -2, 2, 1), _grid((1, 2, 37, 16), g, -2, 2, 1)
    V = _grid((1, 2, 37, 16), g, -15, 15, 1 / 16)
    ref = torch.einsum("bhid,bhjd,bhje->bhie", Q, K, V)
    for sched in ("loop", "split"):
        got = k(q=Q.to(dtype), k=K.to(dtype), v=V.to(dtype), schedule=sched)
        _check(got, ref, dtype, f"contraction {sched}, {dtype}, seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_kernel_output_is_rounded_to_nearest(dtype):
    """Sum kernel (codegen/sums.py: the form of a derived backward stage, an output over a
    contraction axis): out = sum_j (sum_d q k)(sum_e g v) k."""
    q, kk = af.tensor("q", "b h i d"), af.tensor("k", "b h j d")
    go, v = af.tensor("go", "b h i e"), af.tensor("v", "b h j e")
    prog = af.program("store_round_sums", out=af.sum(af.sum(q * kk, "d") * af.sum(go * v, "e") * kk, "j"))
    k = af.compile(prog, axis="j")
    assert "_sum(" in k.kernel.source, "expected the sum kernel (codegen/sums.py)"
    g, seed = _gen()
    Q, GO = _grid((1, 2, 11, 8), g, -2, 2, 1), _grid((1, 2, 11, 8), g, -2, 2, 1)
    K, V = _grid((1, 2, 29, 8), g, -2, 2, 1 / 16), _grid((1, 2, 29, 8), g, -2, 2, 1)
    s = torch.einsum("bhid,bhjd->bhij", Q, K) * torch.einsum("bhie,bhje->bhij", GO, V)
    ref = torch.einsum("bhij,bhjd->bhid", s, K)
    got = k(q=Q.to(dtype), k=K.to(dtype), go=GO.to(dtype), v=V.to(dtype))
    _check(got, ref, dtype, f"sums, {dtype}, seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_output_is_rounded_to_nearest(dtype):
    """Generated GEMM (codegen/gemm.py, prologue form): out = sum_k x w in a 16-bit out_dtype."""
    from acefuse.quant_gemm import gemm
    x, w = af.tensor("x", "t k"), af.tensor("w", "n k")
    G = gemm(af.program("store_round_gemm", out=af.sum(x * w, "k")))
    g, seed = _gen()
    X, W = _grid((9, 40), g, -4, 4, 1 / 16), _grid((7, 40), g, -4, 4, 1 / 16)
    got = G(form="prologue", out_dtype=dtype, x=X.to(torch.bfloat16), w=W.float())["out"]
    assert G.last_path.startswith("generated Triton GEMM"), G.last_path
    _check(got, X @ W.t(), dtype, f"gemm, {dtype}, seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_stacked_output_is_rounded_to_nearest(dtype):
    """Top-k's stacked values (codegen/stacked.py through ``stored``), every schedule: the k
    largest of x * w (exact in float32)."""
    x, w = af.tensor("x", "t e"), af.tensor("w", "t e")
    vals, idx = af.topk(x * w, 3, "e")
    k = af.compile(af.program("store_round_topk", values=vals, indices=idx))
    g, seed = _gen()
    X, W = (torch.randn(40, 29, generator=g).to(dtype) for _ in range(2))
    ref = torch.topk(X.double() * W.double(), 3, dim=1).values
    for sched, kw in ROW_SCHEDULES:
        got = k(x=X, w=W, schedule=sched, **kw)["values"]
        _check(got, ref, dtype, f"top-k {sched}, {dtype}, seed {seed}")
