"""A loss's gradient computed by its forward (issue 11: "cross-entropy backward ... fused with the
forward when the loss is the only output"): af.compile of a program whose only output is 0-d
writes the gradient for a unit cotangent in the forward pass, and the backward returns it (a
cotangent of 1, from .backward()) or scales it exactly (a power of two); any other cotangent runs
the derived backward kernels on recomputed saved values, so the gradient is rounded once.
Gradients against float64 torch autograd on fresh random inputs."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import acefuse as af
import acefuse.autograd as aga

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import norms as N  # noqa: E402

TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6}


@pytest.fixture(scope="module")
def kern():
    return af.compile(N.cross_entropy_mean)


def _case(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols = 29, 203
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype).requires_grad_(True)
    t = torch.randint(0, cols, (rows,), generator=g)
    return x, t


def _ref(x, t, scale):
    x64 = x.detach().double().requires_grad_(True)
    g, = torch.autograd.grad(F.cross_entropy(x64, t), [x64], torch.tensor(scale, dtype=torch.float64))
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,kernels_run", [(1.0, False), (0.25, False), (-8.0, False), (0.37, True), (3.0, True)])
def test_loss_gradient_comes_from_the_forward(kern, monkeypatch, dtype, scale, kernels_run):
    ran = []
    real = aga.BackwardKernel.__call__

    def counted(self, *a, **kw):
        ran.append(1)
        return real(self, *a, **kw)
    monkeypatch.setattr(aga.BackwardKernel, "__call__", counted)
    x, t = _case(dtype, seed=int(abs(scale) * 100) + (dtype == torch.bfloat16))
    loss = kern(x=x, t=t)
    assert kern._unit, kern.unit_reason          # the forward computed the unit gradient
    for _ in range(2):                            # retain_graph: the saved gradient is not consumed
        got, = torch.autograd.grad(loss, [x], torch.tensor(scale, dtype=loss.dtype), retain_graph=True)
        want = _ref(x, t, scale)
        assert got.dtype == dtype and got.shape == x.shape
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= TOL[dtype], (scale, err)
    assert bool(ran) == kernels_run


def test_grad_in_forward_off_runs_the_derived_backward(monkeypatch):
    k = af.compile(N.cross_entropy_mean)
    k.grad_in_forward = False
    ran = []
    real = aga.BackwardKernel.__call__
    monkeypatch.setattr(aga.BackwardKernel, "__call__", lambda self, *a, **kw: ran.append(1) or real(self, *a, **kw))
    x, t = _case(torch.float32, seed=7)
    k(x=x, t=t).backward()
    assert ran and not k._unit
    assert ((x.grad.double() - _ref(x, t, 1.0)).abs().max() / _ref(x, t, 1.0).abs().max()).item() <= TOL[torch.float32]


def test_a_program_with_outputs_over_axes_keeps_the_derived_backward():
    """"auto" takes the forward's gradient only for a 0-d output (a per-row loss would write a
    gradient the backward reads back to scale per row)."""
    assert not af.compile(N.cross_entropy)._grad_in_forward()     # the per-row loss
    assert af.compile(N.cross_entropy_mean)._grad_in_forward()
