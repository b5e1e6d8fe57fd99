"""``a ** p`` for a constant exponent, as every kernel family lowers it (codegen/emit.py's
pow_expr, used by the row/contraction emitter and the sum kernel): torch's values, negative
bases included. ``exp(p * log(a))`` alone gave NaN for a negative base where the true value is
finite (``x ** 5``, ``x ** -1``, ``x ** 0``; a gradient ``7 s ** 6``)."""
import math
import warnings

import pytest
import torch

import acefuse as af

x = af.tensor("x", "r j")


def _gen():
    return torch.Generator().manual_seed(torch.seed() % 2 ** 31)


@pytest.mark.parametrize("p", [5, 6, -1, -2, -3, 0, 3, 2.5])
def test_row_family_power_of_negative_and_positive_bases(p):
    """Forward and gradient of sum_j(x ** p) against float64 torch, x of both signs (|x| in
    [0.5, 1.5]; positive only for a non-integer power, where torch is NaN too)."""
    g = _gen()
    X = (torch.rand(3, 13, generator=g, dtype=torch.float64) + 0.5)
    if float(p).is_integer():
        X = X * torch.where(torch.rand(3, 13, generator=g) < 0.5, -1.0, 1.0).double()
    k = af.compile(af.program(f"pw_{str(p).replace('-', 'm').replace('.', '_')}", y=af.sum(x ** p, "j")))
    xx = X.float().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = k(x=xx)
        cot = torch.randn(3, generator=g)
        y.backward(cot)
    assert k.grad_fallback is None or p == 0   # x ** 0: no gradient to derive (torch's zeros)
    xr = X.clone().requires_grad_()
    yr = (xr ** p).sum(-1)
    yr.backward(cot.double())
    scale = (X.abs() ** p).sum(-1)
    assert torch.all(torch.isfinite(y)) and torch.all(torch.isfinite(xx.grad))
    assert torch.all((y.double() - yr).abs() <= 1e-5 * scale), (y, yr)
    gs = (abs(p) * X.abs() ** (p - 1) * cot.double().abs()[:, None]) if p else torch.zeros_like(X)
    assert torch.all((xx.grad.double() - xr.grad).abs() <= 1e-5 * gs + 1e-6), (xx.grad, xr.grad)


def test_sum_kernel_power_of_negative_scores():
    """An attention-shaped program with an odd power of a signed score: the backward's sum
    kernels (dK, dV over queries) evaluate s ** 7 and 7 s ** 6 for negative s."""
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    s = af.sum(q * k, "d") * 0.25
    prog = af.program("pow7_attention", o=af.sum(s ** 7 * v, "j") / af.size("j"))
    g = _gen()
    B, H, N, D = 1, 2, 19, 8
    Q, K, V = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    kern = af.compile(prog)
    leaves = [t.float().requires_grad_() for t in (Q, K, V)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = kern(q=leaves[0], k=leaves[1], v=leaves[2])
        cot = torch.randn(o.shape, generator=g)
        o.backward(cot)
    assert kern.grad_fallback is None
    assert any("_sum(" in st.source for st in kern._bwd_kernel.kernels), "no sum kernel in the backward"
    ref = [t.clone().requires_grad_() for t in (Q, K, V)]
    sr = torch.einsum("bhid,bhjd->bhij", ref[0], ref[1]) * 0.25
    orf = torch.einsum("bhij,bhje->bhie", sr ** 7, ref[2]) / N
    orf.backward(cot.double())
    assert torch.allclose(o.double(), orf, rtol=1e-4, atol=1e-4 * orf.abs().max().item())
    for got, want, name in zip(leaves, ref, "qkv"):
        assert torch.all(torch.isfinite(got.grad)), name
        tol = 1e-4 * want.grad.abs().max().item()
        assert torch.allclose(got.grad.double(), want.grad, rtol=1e-3, atol=tol), (name, (got.grad - want.grad).abs().max())
