"""A lookup whose index reads the fused axis's length inside a reduction over that axis
(``w[n = size(j) - 1 - j]`` inside attention's sums over keys j; the gallery's
``rel[r = j - i + size(i) - 1]`` inside the dK/dV stage's sums over queries i): inside a
reduction body ``size(j)`` is the whole axis's, a constant, so the lookup is one leaf of the
encoding (rewrite/encode.py) and the certificate models the leaf (acefuse/certificate.py).
Before, the encoding split the lookup at ``size(j)`` and af.fuse raised "no state of pass 2
could be formed" (reported as a bug in acefuse). Checked against float64 torch autograd on
fresh random inputs; tolerances ``|got - ref| <= 1e-4 |ref| + 2e-5 max|ref|`` (float32)."""
import math
import warnings

import torch

import acefuse as af
from acefuse.autograd import GradientFallbackWarning

D = 8


def _program():
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    w = af.tensor("w", "h n")      # a learned bias per head and key position counted from the end
    s = af.sum(q * k, "d") * (1.0 / math.sqrt(D)) + w.at(n=af.size("j") - 1 - af.index("j"))
    m = af.max(s, "j")
    p = af.exp(s - m)
    return af.program("bias_from_end", o=af.sum(p * v, "j") / af.sum(p, "j"))


def _reference(q, k, v, w):
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D) + w[:, : k.shape[2]].flip(1)[None, :, None, :]
    return torch.softmax(s, -1) @ v


def test_lookup_at_the_axis_length_fuses_in_one_certified_pass():
    f = af.fuse(_program(), axis="j")
    assert f.fusible and len(f.passes) == 1, f.reason
    assert f.certificate.ok, f.certificate.summary()


def test_lookup_at_the_axis_length_forward_and_gradients_match_float64():
    kern = af.compile(_program())
    g = torch.Generator().manual_seed(11)
    B, H, L, S = 2, 2, 7, 19
    ins = {"q": torch.randn(B, H, L, D, generator=g), "k": torch.randn(B, H, S, D, generator=g),
           "v": torch.randn(B, H, S, D, generator=g), "w": torch.randn(H, S + 3, generator=g)}  # (3 entries unread)
    leaves = {n: x.clone().requires_grad_() for n, x in ins.items()}
    cot = torch.randn(B, H, L, D, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientFallbackWarning)
        o = kern(**leaves)
        got = dict(zip(leaves, torch.autograd.grad(o, list(leaves.values()), cot)))
    assert kern.grad_fallback is None, kern.grad_fallback
    lv = {n: x.double().requires_grad_() for n, x in ins.items()}
    r = _reference(**lv)
    want = dict(zip(lv, torch.autograd.grad(r, list(lv.values()), cot.double())))
    assert want["w"][:, S:].abs().max() == 0 and want["w"].abs().max() > 1e-2
    for name, got_, want_ in [("o", o, r)] + [(f"grad {n}", got[n], want[n]) for n in want]:
        err = (got_.detach().double() - want_).abs()
        assert (err <= 1e-4 * want_.abs() + 2e-5 * want_.abs().max()).all(), f"{name} off by {err.max().item():.3g}"
