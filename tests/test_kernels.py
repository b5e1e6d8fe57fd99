"""Compiled kernels against an independent float64 reference (torch), on the CPU
through Triton's interpreter: odd shapes, large magnitudes, -inf entries, fully
masked rows, low precision, and every schedule (one tile, rolling loop, split)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

import acefuse as af
from tests.programs import softmax, logsumexp, mad

# tolerances per input dtype: |got - ref| <= atol + rtol * |ref| (outputs are stored in the input dtype)
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1e-2, 2e-2)}

SCHEDULES = [("single", {}), ("loop", {"block_j": 16}), ("split", {"block_j": 16, "nsplit": 3})]


@pytest.fixture(scope="module")
def k_softmax():
    return af.compile(softmax)


@pytest.fixture(scope="module")
def k_lse():
    return af.compile(logsumexp)


def _ref_softmax(x):
    x = x.double()
    y = torch.softmax(x, dim=1)
    full = torch.isneginf(x).all(dim=1)
    y[full] = 0.0  # documented convention: a fully masked row gives 0
    return y


def _ref_lse(x):
    return torch.logsumexp(x.double(), dim=1)  # -inf for a fully masked row


def _close(got, ref, dtype):
    atol, rtol = TOL[dtype]
    got = got.double()
    assert got.shape == ref.shape
    same_inf = torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(got[torch.isinf(got)], ref[torch.isinf(ref)])
    assert same_inf, f"infinities differ: got {got[torch.isinf(got) | torch.isinf(ref)]}, ref {ref[torch.isinf(got) | torch.isinf(ref)]}"
    assert not torch.isnan(got).any(), "NaN in the kernel output"
    fin = torch.isfinite(ref)
    err = (got[fin] - ref[fin]).abs() - (atol + rtol * ref[fin].abs())
    assert (err <= 0).all(), f"max excess error {err.max().item():.3e}"


def _inputs(draw, dtype):
    rows = draw(st.integers(1, 7))
    cols = draw(st.integers(1, 67))
    scale = draw(st.sampled_from([1.0, 30.0, 1e4]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale
    if draw(st.booleans()):
        x[torch.rand(rows, cols, generator=g) < 0.3] = -math.inf
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = -math.inf      # a fully masked row
    return x.to(dtype)


@st.composite
def case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    sched = draw(st.sampled_from(SCHEDULES))
    return _inputs(draw, dtype), dtype, sched


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_softmax_matches_float64(k_softmax, c):
    x, dtype, (sched, kw) = c
    y = k_softmax(x=x, schedule=sched, **kw)
    assert y.dtype == dtype
    _close(y, _ref_softmax(x), dtype)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_logsumexp_matches_float64(k_lse, c):
    x, dtype, (sched, kw) = c
    out = k_lse(x, schedule=sched, **kw)
    _close(out, _ref_lse(x), dtype)


def test_softmax_example_from_readme(k_softmax):
    x = torch.randn(37, 1000)
    y = k_softmax(x=x)
    _close(y, _ref_softmax(x), torch.float32)
    # and the default schedule for a long row is the rolling loop
    x = torch.randn(3, 20000) * 50
    _close(k_softmax(x=x), _ref_softmax(x), torch.float32)


def test_rows_across_several_parallel_axes():
    x = af.tensor("x", "b r j")
    w = af.tensor("w", "j")
    m = af.max(x * w, "j")
    p = af.program("scaled_lse", out=m + af.log(af.sum(af.exp(x * w - m), "j")))
    k = af.compile(p)
    X, W = torch.randn(3, 5, 41), torch.rand(41) + 0.5
    ref = torch.logsumexp(X.double() * W.double(), dim=-1)
    for sched, kw in SCHEDULES:
        _close(k(x=X, w=W, schedule=sched, **kw), ref, torch.float32)


def test_non_contiguous_input(k_softmax):
    x = torch.randn(50, 12).t()  # strides (1, 12)
    _close(k_softmax(x=x, schedule="loop", block_j=16), _ref_softmax(x), torch.float32)


def test_unfusible_program_still_correct():
    f = af.fuse(mad)
    assert not f.fusible
    assert "s2" in f.reason and "abs" in f.reason and "r = sum_j(x) / size(j)" in f.reason
    assert f.hbm_passes == {"unfused": 2, "fused": 2}
    k = af.compile(mad)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 53, generator=g) * 10 + 3
    ref = (x.double() - x.double().mean(1, keepdim=True)).abs().sum(1)
    for sched, kw in SCHEDULES[:2]:
        _close(k(x=x, schedule=sched, **kw), ref, torch.float32)
    with pytest.raises(ValueError, match="no split schedule"):
        k(x=x, schedule="split")
