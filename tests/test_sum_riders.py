"""Riders of the sum family (codegen/riders.py): in the derived attention backward, the stage
of sums over keys (dQ, and ALiBi's per-query slope part) is computed in the pass of the stage
summing over queries (dK, dV), each tile's part added into a float32 buffer with an atomic
add. Nothing names attention: the stages qualify by form. Gradients against float64 torch
autograd of the plain math (test_attention_backward.py's; GQA's here), fresh random inputs, sizes that are not multiples
of the interpreter's 16-wide tiles, short head dims; each test asserts the rider path ran and
the riding stage's own kernel did not (so it fails without the rider); a schedule option runs
the stage itself; a finish that drops the constant factor is caught."""
import sys
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.codegen import riders as rd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import attention as A  # noqa: E402
from tests.test_attention_backward import _torch_attention  # noqa: E402

i_, j_ = af.index("i"), af.index("j")
STRICT = A.attend("strict_riders", af.where(j_ < i_, A.score, af.NEG_INF))   # query 0 sees no key
PROGRAMS = {"attention": A.attention, "causal": A.causal, "alibi": A.alibi, "strict": STRICT}
_COMPILED: dict = {}


def _compiled(name):
    if name not in _COMPILED:
        _COMPILED[name] = af.compile(PROGRAMS[name] if name != "gqa" else A.gqa)
    return _COMPILED[name]


def _torch(name, q, k, v, slope=None):
    """Plain float64 math (no acefuse code); q is [b, h, i, d] or, for gqa, [b, g, r, i, d]."""
    if name == "gqa":
        s = torch.einsum("bgrid,bgjd->bgrij", q, k) * A.SCALE
        return torch.einsum("bgrij,bgje->bgrie", torch.softmax(s, -1), v)
    return _torch_attention(name, q, k, v, slope)


def _leaves(name, seed, n, d):
    g = torch.Generator().manual_seed(seed)
    qs = (1, 2, 3, n, d) if name == "gqa" else (1, 2, n, d)
    ks = (1, 2, n, d)
    ins = {"q": torch.randn(qs, generator=g) * 1.5, "k": torch.randn(ks, generator=g) * 1.5,
           "v": torch.randn(ks, generator=g)}
    if name == "alibi":
        ins["slope"] = torch.rand(2, generator=g)
    return ins, torch.randn(qs, generator=g)


def _grads(name, ins, cot, **run):
    got = {n: x.clone().requires_grad_() for n, x in ins.items()}
    _compiled(name)(**got, **run).backward(cot)
    ref = {n: x.double().requires_grad_() for n, x in ins.items()}
    _torch(name, **ref).backward(cot.double())
    return {n: (got[n].grad, ref[n].grad) for n in ins}


def _close(got, ref, rtol=2e-5, stol=2e-5):
    got = got.double()
    ok = bool(torch.isfinite(got).all()) and bool(((got - ref).abs() <= rtol * ref.abs() + stol * ref.abs().max()).all())
    return ok, (got - ref).abs().max().item()


def _watch(name, monkeypatch):
    """(finish calls, calls of the riding stages' own kernels), recorded."""
    k = _compiled(name)
    k._grad_kernels()
    bk = k._bwd_kernel
    finished, alone = [], []
    real = rd.finish
    monkeypatch.setattr(rd, "finish", lambda *a: (finished.append(1), real(*a))[1])
    stages = list(bk._stages)
    for b in bk._riders:
        kb, *rest = stages[b]
        stages[b] = (lambda kb=kb, b=b, **kw: (alone.append(b), kb(**kw))[1], *rest)
    monkeypatch.setattr(bk, "_stages", stages)
    return bk, finished, alone


@pytest.mark.parametrize("name,n,d", [("causal", 37, 24),
                                      pytest.param("attention", 45, 16, marks=pytest.mark.slow),
                                      pytest.param("alibi", 29, 16, marks=pytest.mark.slow),
                                      pytest.param("strict", 33, 16, marks=pytest.mark.slow)])
def test_keys_stage_rides_the_queries_pass(name, n, d, monkeypatch):
    bk, finished, alone = _watch(name, monkeypatch)
    assert bk._riders, f"{name}: the stage of sums over keys should ride the pass over queries"
    host = bk.kernels[next(iter(bk._riders.values()))]
    assert "grad_q" in host.module.RIDERS
    ins, cot = _leaves(name, n * d, n, d)
    for g, (got, ref) in _grads(name, ins, cot).items():
        assert ref.abs().max() > 1e-3, f"{name}: the reference gradient of {g} must not be trivially small"
        ok, err = _close(got, ref)
        assert ok, f"{name} at n={n} d={d}: grad of {g}: max error {err}"
        if name == "strict" and g == "q":
            assert (got[:, :, 0] == 0).all(), "the query that sees no key gets gradient 0"
    assert finished and not alone, f"{name}: the rider path should have run (finish {finished}, alone {alone})"
    assert _compiled(name).grad_fallback is None


@pytest.mark.slow   # a third derivation (GQA's backward, ~40 s on 2 busy cores)
def test_grouped_query_attention_gradients(monkeypatch):
    """GQA (q "b g r i d"): the gradients are right whether or not a stage rides (its stage of
    sums over queries also sums over the group members r, which today runs as a staged kernel,
    not a sum kernel, so nothing rides it)."""
    bk, finished, alone = _watch("gqa", monkeypatch)
    ins, cot = _leaves("gqa", 4, 23, 16)
    for g, (got, ref) in _grads("gqa", ins, cot).items():
        ok, err = _close(got, ref)
        assert ok, f"gqa: grad of {g}: max error {err}"
    assert bool(finished) == bool(bk._riders) and not alone


def test_a_schedule_option_runs_the_stage_itself(monkeypatch):
    bk, finished, alone = _watch("causal", monkeypatch)
    ins, cot = _leaves("causal", 11, 21, 16)
    for g, (got, ref) in _grads("causal", ins, cot, schedule="loop").items():
        ok, err = _close(got, ref)
        assert ok, f"grad of {g} (schedule='loop'): max error {err}"
    assert not finished and alone, "a schedule option must run the riding stage itself"


def test_a_finish_without_the_constant_factor_is_caught(monkeypatch):
    monkeypatch.setattr(rd, "finish", lambda acc, dtype, scale=1.0: acc.to(dtype))
    ins, cot = _leaves("causal", 12, 37, 16)
    got = _grads("causal", ins, cot)
    assert not _close(*got["q"])[0]
    assert _close(*got["k"])[0] and _close(*got["v"])[0]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attention", "causal"])
def test_rider_on_the_gpu(name, monkeypatch):
    """bf16 on CUDA (many programs adding into the same dQ rows, N not a multiple of any
    tile): gradients against float64 autograd of the same rounded inputs, and the rider's dQ
    against the stage run alone (schedule='loop') in the same precision."""
    bk, finished, alone = _watch(name, monkeypatch)
    monkeypatch.setattr(bk, "ride_policy", True)   # the rider path, not the timed choice
    g = torch.Generator(device="cuda").manual_seed(1)
    B, H, N, D = 2, 4, 1000, 128
    ins = {n: torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16) for n in "qkv"}
    cot = torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
    got = {}
    for sched in ({}, {"schedule": "loop"}):
        x = {n: t.clone().requires_grad_() for n, t in ins.items()}
        _compiled(name)(**x, **sched).backward(cot)
        got[bool(sched)] = {n: x[n].grad for n in x}
    assert finished and alone, "the rider path and the stage alone should each have run once"
    ref = {n: t.double().requires_grad_() for n, t in ins.items()}
    _torch(name, **ref).backward(cot.double())
    for n in "qkv":
        a, r, b = got[False][n].double(), ref[n].grad, got[True][n].double()
        rel = ((a - r).norm() / r.norm()).item()
        assert rel <= 2e-2, f"{name}: grad of {n} (bf16, rider pass): norm-relative error {rel}"
        assert (a - b).abs().max().item() <= 1e-2 * b.abs().max().item(), \
            f"{name}: grad of {n}: rider pass and stage alone differ by {(a - b).abs().max().item()}"
