"""Programs nobody wrote a rule for: multi-output compositions, shared reductions,
several parallel axes, gathers; each compiled and compared with the independent
float64 reference evaluator (acefuse/reference.py), every schedule."""
import math

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.reference import evaluate, random_inputs
from tests.programs import run_schedules

SCHEDULES = [("single", {}), ("loop", {"block_j": 8}), ("split", {"block_j": 8, "nsplit": 3})]


def _run_all(prog, sizes, tol=2e-5, scale=3.0, offset=0.0, schedules=SCHEDULES):
    k = af.compile(prog)
    inputs = random_inputs(prog, sizes, scale=scale, seed=sum(sizes.values()))
    if offset:
        inputs = {n: (t + offset if t.dtype.is_floating_point else t) for n, t in inputs.items()}
    ref = evaluate(prog, {n: t.double() if t.dtype.is_floating_point else t for n, t in inputs.items()})
    for sched, out in run_schedules(k, prog, inputs, schedules):
        for name, r in ref.items():
            got = out[name].double().numpy()
            assert got.shape == r.shape
            err = np.max(np.abs(got - r) / np.maximum(np.abs(r), 1.0))
            assert err <= tol, f"{prog.name}.{name} [{sched}]: max rel err {err:.3e}"
    return k


def test_elementwise_output_beside_a_norm_is_not_treated_as_invariant():
    # regression: an elementwise output must not make its value look invariant to the
    # analyses (normal-form extraction once derived var = 0 here)
    x = af.tensor("x", "a b j"); y = af.tensor("y", "a b j"); w = af.tensor("w", "j")
    h = x + y
    mu = af.mean(h, "j")
    var = af.mean((h - mu) ** 2, "j")
    p = af.program("residual_norm", out0=h, out1=(h - mu) * af.rsqrt(var + 1e-5) * w)
    k = _run_all(p, {"a": 2, "b": 5, "j": 37})
    assert k.fusible


def test_layernorm_with_large_offset_keeps_precision():
    x = af.tensor("x", "r j")
    mu = af.mean(x, "j")
    var = af.mean((x - mu) ** 2, "j")
    p = af.program("ln_offset", y=(x - mu) * af.rsqrt(var + 1e-5))
    # |mean| = 1e4 >> std = 1: the derived merge is centred, so float32 keeps ~1e-3 accuracy
    _run_all(p, {"r": 5, "j": 203}, tol=5e-3, scale=1.0, offset=1e4)


def test_shared_reductions_in_one_kernel():
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    l = af.sum(af.exp(x - m), "j")
    p = af.program("softmax_and_lse", y=af.exp(x - m) / l, lse=m + af.log(l), mx=m)
    k = _run_all(p, {"r": 7, "j": 45})
    assert [s.name for s in k.fusion.states] == ["m", "s"]


def test_min_and_max_and_mean_together():
    x = af.tensor("x", "r j")
    lo, hi = af.min(x, "j"), af.max(x, "j")
    p = af.program("minmax_scale", y=(x - lo) / (hi - lo), mid=af.mean(x, "j"))
    _run_all(p, {"r": 4, "j": 29})


def test_cross_entropy_gather():
    x = af.tensor("x", "r j")
    t = af.tensor("t", "r")
    m = af.max(x, "j")
    p = af.program("ce", loss=m + af.log(af.sum(af.exp(x - m), "j")) - af.take(x, t, "j"))
    k = _run_all(p, {"r": 9, "j": 53})
    assert k.fusion.hbm_passes["fused"] == 1


def test_temperature_and_bias_broadcast_over_axes():
    x = af.tensor("x", "b r j")
    bias = af.tensor("bias", "j")
    temp = af.tensor("temp", "b")
    s = (x + bias) / temp
    m = af.max(s, "j")
    p = af.program("tempered_softmax", y=af.exp(s - m) / af.sum(af.exp(s - m), "j"))
    k = _run_all(p, {"b": 3, "r": 4, "j": 33})
    assert k.fusible


def test_second_moment_around_max_fuses_with_an_auxiliary_state():
    # sum_j (x - max_j x)^2: its correction needs sum_A(x - m_A), which is not a state of
    # the program; discovery adds it as an auxiliary state (rewrite/auxiliary.py,
    # tests/test_auxiliary.py), so one pass is enough, and the kernel is correct
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    p = af.program("sq_from_max", out=af.sum((x - m) * (x - m), "j"))
    k = _run_all(p, {"r": 6, "j": 41})
    assert k.fusible and [s.name for s in k.fusion.encoding.states if s.aux] == ["aux"]
    assert k.fusion.hbm_passes == {"unfused": 2, "fused": 1}


def test_bad_inputs_give_clear_errors():
    x = af.tensor("x", "r j")
    k = af.compile(af.program("plain_sum", out=af.sum(af.exp(x - af.max(x, "j")), "j")))
    with pytest.raises(TypeError, match="needs inputs \\['x'\\]"):
        k()
    with pytest.raises(ValueError, match="declared with axes 'r j'"):
        k(x=torch.randn(3))
    with pytest.raises(TypeError, match="accepts float32, float16, bfloat16, float8_e4m3fn or float8_e5m2"):
        k(x=torch.randn(3, 4).double())
    with pytest.raises(TypeError, match="no input"):
        k(x=torch.randn(3, 4), z=torch.randn(3))


def test_a_failing_kernel_launch_names_the_program(monkeypatch):
    x = af.tensor("x", "r j")
    k = af.compile(af.program("plain_max", out=af.max(x, "j")))
    from acefuse.codegen.compile import KernelError
    with pytest.raises(KernelError, match="plain_max"):
        k(x=torch.randn(3, 40), schedule="loop", block_j=3)   # not a power of two: Triton refuses


def test_layout_follows_the_latest_declarations_not_process_history():
    """An output's layout comes from the declarations of the code that builds the program: a
    tensor ("wb", "n k") declared earlier in the process must not put n before t when a later
    program declares x "t k" first (the first-declaration rule laid af.gemm's [t, n] output out
    as [n, t] after another test file had run)."""
    af.tensor("wb_hist", "n k")   # an earlier program's declaration
    x, w = af.tensor("x_hist", "t k"), af.tensor("wb_hist", "n k")
    prog = af.program("layout_hist", out=af.sum(x * w, "k"))
    assert prog.outputs["out"].axes == ("t", "n")
    w2, x2 = af.tensor("wb_hist", "n k"), af.tensor("x_hist", "t k")
    assert af.program("layout_hist2", out=af.sum(x2 * w2, "k")).outputs["out"].axes == ("n", "t")
