"""Timed regions (acefuse.frontend.timed): through ``af.Backend()`` a region whose torch code is one
``F.scaled_dot_product_attention`` call is kept only where acefuse's kernel is measured faster.
Nothing is timed on the CPU, so these tests treat the CPU as a GPU (``timing_device``) and replace
the measurement (``time_pair``) by fixed times; outputs and gradients are checked against float64
eager torch either way."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import acefuse as af
from acefuse.frontend import timed

ATOL, RTOL = 2e-5, 2e-4   # float32 kernel vs float64 eager
SDPA = "torch.nn.functional.scaled_dot_product_attention"


class TinyAttention(nn.Module):
    """q, k, v projections, a causal SDPA over heads, an output projection."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, N, D))


class FakeTimer:
    """``time_pair`` answering fixed times (acefuse's, torch's) and counting its calls."""

    def __init__(self, acefuse_ms, torch_ms):
        self.ms, self.calls = (acefuse_ms, torch_ms), 0

    def __call__(self, run_acefuse, run_torch, **kw):
        self.calls += 1
        return self.ms


@pytest.fixture
def gpu_like(monkeypatch, tmp_path):
    """The CPU treated as a GPU by the timing; a fresh tuning store; no choice in memory."""
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ACEFUSE_TUNING_CACHE", raising=False)
    monkeypatch.delenv("ACEFUSE_TIMED_REGIONS", raising=False)
    monkeypatch.setattr(timed, "timing_device",
                        lambda vals: next((v.device for v in vals if isinstance(v, torch.Tensor)), None))
    timed.forget()
    torch._dynamo.reset()
    yield
    timed.forget()
    torch._dynamo.reset()


def _timer(monkeypatch, acefuse_ms, torch_ms):
    t = FakeTimer(acefuse_ms, torch_ms)
    monkeypatch.setattr(timed, "time_pair", t)
    return t


def _run(be, seed=0, train=True):
    """One call of TinyAttention through torch.compile(backend=be) on fresh random inputs;
    outputs (and, with ``train``, the gradients of x and every parameter) against float64 eager."""
    torch.manual_seed(seed)
    m = TinyAttention()
    m64 = TinyAttention().double()
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    x = torch.randn(2, 6, 16)
    cot = torch.randn(2, 6, 16)
    cm = torch.compile(m, backend=be)
    if not train:
        with torch.no_grad():
            y = cm(x)
        torch.testing.assert_close(y.double(), m64(x.double()), atol=ATOL, rtol=RTOL)
        return
    xg, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    y = cm(xg)
    y.backward(cot)
    y64 = m64(x64)
    y64.backward(cot.double())
    torch.testing.assert_close(y.double(), y64, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(xg.grad.double(), x64.grad, atol=ATOL, rtol=RTOL)
    for (name, p), p64 in zip(m.named_parameters(), m64.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.double(), p64.grad, atol=ATOL, rtol=RTOL, msg=name)


def _sdpa_entries(be):
    r = be.report()
    return [e for e in r.entries if e.op == SDPA], r


def test_torch_measured_faster_leaves_the_attention_to_torch(gpu_like, monkeypatch):
    t = _timer(monkeypatch, acefuse_ms=1.61, torch_ms=1.23)
    be = af.Backend()
    _run(be)
    (e,), r = _sdpa_entries(be)
    assert e.status == "left", str(r)
    assert "torch's scaled_dot_product_attention measured faster on this GPU (1.23 ms vs acefuse's 1.61 ms, " \
           "forward+backward)" in e.reason, e.reason
    assert t.calls == 1
    assert not [g for cf in be.functions for g in cf.graphs.values() for m in g.af_regions
                if SDPA in {x.op for x in g.af_report if x.region is m}], "the attention still has a region"


def test_forward_only_is_timed_as_forward(gpu_like, monkeypatch):
    _timer(monkeypatch, acefuse_ms=2.0, torch_ms=1.0)
    be = af.Backend()
    _run(be, train=False)
    (e,), r = _sdpa_entries(be)
    assert e.status == "left" and "(1 ms vs acefuse's 2 ms, forward)" in e.reason, str(r)


def test_acefuse_measured_faster_takes_the_attention(gpu_like, monkeypatch):
    t = _timer(monkeypatch, acefuse_ms=0.5, torch_ms=0.9)
    be = af.Backend()
    _run(be, seed=1)
    (e,), r = _sdpa_entries(be)
    assert e.status == "taken", str(r)
    assert e.region.timing["winner"] == "acefuse" and e.region.timing["mode"] == "forward+backward"
    assert e.region.calls["grad"] >= 1 and not e.region.calls["torch"]
    assert t.calls == 1


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_untimed_takes_the_attention_without_timing(gpu_like, monkeypatch, how):
    t = _timer(monkeypatch, acefuse_ms=9.0, torch_ms=1.0)
    if how == "argument":
        be = af.Backend(timed=False)
    else:
        monkeypatch.setenv("ACEFUSE_TIMED_REGIONS", "0")
        be = af.Backend()
    _run(be, seed=2)
    (e,), r = _sdpa_entries(be)
    assert e.status == "taken" and e.region.timing is None, str(r)
    assert t.calls == 0


def test_the_choice_is_persisted(gpu_like, monkeypatch):
    t = _timer(monkeypatch, acefuse_ms=1.61, torch_ms=1.23)
    _run(af.Backend(), seed=3)
    assert t.calls == 1
    timed.forget()                      # a new process: only the disk store remembers
    torch._dynamo.reset()
    be = af.Backend()
    _run(be, seed=4)
    (e,), r = _sdpa_entries(be)
    assert t.calls == 1, "timed again although the tuning store holds the choice"
    assert e.status == "left" and "(1.23 ms vs acefuse's 1.61 ms" in e.reason, str(r)
    # ACEFUSE_TUNING_CACHE=0: nothing read from disk, so a new process times again
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    timed.forget()
    torch._dynamo.reset()
    _run(af.Backend(), seed=5)
    assert t.calls == 2


def test_nothing_is_timed_on_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    t = _timer(monkeypatch, acefuse_ms=9.0, torch_ms=1.0)
    timed.forget()
    torch._dynamo.reset()
    be = af.Backend()
    _run(be, seed=6, train=False)
    (e,), r = _sdpa_entries(be)
    assert e.status == "taken" and t.calls == 0, str(r)


def test_a_region_with_more_than_the_library_call_is_not_timed(gpu_like, monkeypatch):
    """Timing is for a region that *is* one library call: a softmax region is acefuse's."""
    t = _timer(monkeypatch, acefuse_ms=9.0, torch_ms=1.0)
    be = af.Backend()
    x = torch.randn(4, 33)
    y = torch.compile(lambda a: torch.softmax(a * 2.0, -1), backend=be)(x)
    torch.testing.assert_close(y.double(), torch.softmax(x.double() * 2.0, -1), atol=ATOL, rtol=RTOL)
    assert [e.status for e in be.report().entries] == ["taken"] and t.calls == 0
