"""The row family's timed launch choice (codegen/row_tuning.py): on a GPU, a large problem's
first call times a few launch configurations (warps, rows per tile, loop tiles, programs per
SM of the riders schedule) and keeps the fastest. Here the timing is allowed on the CPU
(TIMED_DEVICES, TUNE_MIN patched) and _fastest replaced by one that runs EVERY candidate,
checks its outputs against the heuristics' launch, and picks the last: so each candidate
launch is checked for correctness, and the forward and backward with the picked launches
against float64 torch autograd of the plain math (written here), fresh random inputs."""
import pytest
import torch

import acefuse as af


def _layernorm():
    x = af.tensor("x", "r j")
    w, b = af.tensor("w", "j"), af.tensor("b", "j")
    mu = af.mean(x, "j")
    var = af.mean((x - mu) ** 2, "j")
    return af.program("ln_tuned", y=(x - mu) * af.rsqrt(var + 1e-5) * w + b)


def _ref_layernorm(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + 1e-5) * w + b


def _normalized_exp():
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    return af.program("nexp_tuned", y=af.exp(x - m) / af.sum(af.exp(x - m), "j"))


class _Timing:
    """Patches a generated row module so that its launches are 'timed' on the CPU: every
    candidate runs, its outputs equal (to float32 rounding) the first's, the last is kept."""

    def __init__(self, monkeypatch, mod, pick=-1):
        self.mod, self.cands, self.pick = mod, [], pick
        monkeypatch.setattr(mod, "TIMED_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(mod, "TUNE_MIN", 1)
        monkeypatch.setattr(mod, "_CHOSEN", {})
        monkeypatch.setattr(mod, "_PLANS", {})
        monkeypatch.setattr(mod, "_fastest", self.fastest)

    def fastest(self, cands, call, required=()):
        assert cands[0] == {} and 0 in required   # the heuristics' launch first, and required
        first = call(cands[0])
        for c in cands[1:]:
            got = call(c)
            for n in (first if isinstance(first, dict) else {"out": first}):
                a = first[n] if isinstance(first, dict) else first
                b = got[n] if isinstance(got, dict) else got
                if n in getattr(self.mod, "RIDERS", ()):   # per-program partials: compare their sum
                    a, b = a.sum(0), b.sum(0)
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (c, n, (a - b).abs().max())
        self.cands.append(cands)
        return cands[self.pick]


def _close(got, ref, rtol=2e-5, stol=2e-6):
    got = got.double()
    bound = rtol * ref.abs() + stol * ref.abs().max()
    return bool(((got - ref).abs() <= bound).all()), (got - ref).abs().max().item()


def test_timed_launches_of_forward_and_backward_with_riders(monkeypatch):
    """Layernorm-shaped program: its augmented forward, and the backward's riders schedule
    (weight and bias gradients summed per persistent program, 1/2/4 programs per SM) timed;
    the picked launch (the last candidate: 32 warps, 2 programs per SM) is the one planned,
    and the gradients match float64 autograd."""
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    k = af.compile(_layernorm())
    aug, _ = k._grad_kernels()
    bk = k._bwd_kernel
    host = next(iter(bk._riders.values()))
    mods = {"aug": aug.module, "host": bk.kernels[host].module}
    timing = {n: _Timing(monkeypatch, m) for n, m in mods.items()}
    g = torch.Generator().manual_seed(11)
    R, N = 37, 300
    leaves = {"x": torch.randn(R, N, generator=g) * 1.5 + 0.3, "w": torch.randn(N, generator=g),
              "b": torch.randn(N, generator=g)}
    got = {n: t.clone().requires_grad_() for n, t in leaves.items()}
    y = k(**got)
    cot = torch.randn(y.shape, generator=g)
    y.backward(cot)
    ref = {n: t.double().requires_grad_() for n, t in leaves.items()}
    yr = _ref_layernorm(**ref)
    yr.backward(cot.double())
    ok, err = _close(y.detach(), yr.detach())
    assert ok, f"y: {err}"
    for n in leaves:
        ok, err = _close(got[n].grad, ref[n].grad)
        assert ok, f"grad_{n}: {err}"
    ride = timing["host"].cands
    assert ride, "the riders launch was not timed"
    assert {c.get("per_sm") for c in ride[0][1:]} == {1, 2, 4}
    plans = [p for p in mods["host"]._PLANS.values() if p.schedule == "riders"]
    last = ride[0][-1]
    assert last["num_warps"] == 32 and last["per_sm"] == 2
    br = plans[0].kw["BLOCK_R"]   # 2 "SMs" on the CPU, 2 programs each (5 row tiles)
    assert plans[0].kw["num_warps"] == 32 and plans[0].grid == (4,) and -(-R // br) == 5
    assert timing["aug"].cands, "the forward's launch was not timed"
    # the same shape class again: no new timing
    n_timed = len(ride)
    y = k(**{n: t.clone().requires_grad_() for n, t in leaves.items()})
    y.backward(cot)
    assert len(timing["host"].cands) == n_timed


@pytest.mark.slow   # ~20 s: eleven launches of a 32768-element tile on the interpreter
def test_long_rows_time_loop_tiles_and_explicit_options_skip_the_timing(monkeypatch):
    """Rows of 16K-64K elements: one tile or a loop of 4096-16384-element tiles; the picked
    loop launch (the last candidate) gives the float64 result; an explicit option is obeyed
    untimed."""
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    k = af.compile(_normalized_exp())
    mod = k.kernel.module
    timing = _Timing(monkeypatch, mod)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 16500, generator=g) * 3
    y = k(x=x)
    ref = torch.softmax(x.double(), -1)
    ok, err = _close(y, ref)
    assert ok, err
    (cands,) = timing.cands
    assert {c.get("schedule") for c in cands[1:]} == {"single", "loop"}
    assert cands[-1] == dict(schedule="loop", block_j=16384, num_warps=16)   # (32768: not below the row)
    (plan,) = mod._PLANS.values()
    assert plan.schedule == "loop" and plan.kw["BLOCK_J"] == 16384 and plan.kw["num_warps"] == 16
    y2 = k(x=x, schedule="single", num_warps=4)
    assert len(timing.cands) == 1
    ok, err = _close(y2, ref)
    assert ok, err


def test_small_problems_and_the_cpu_are_not_timed(monkeypatch):
    k = af.compile(_normalized_exp())
    mod = k.kernel.module
    monkeypatch.setattr(mod, "_CHOSEN", {})
    monkeypatch.setattr(mod, "_PLANS", {})
    called = []
    monkeypatch.setattr(mod, "_fastest", lambda *a, **kw: called.append(1))
    x = torch.randn(4, 64)
    k(x=x)                                               # the CPU: never timed
    monkeypatch.setattr(mod, "TIMED_DEVICES", ("cuda", "cpu"))
    k(x=torch.randn(5, 64))                              # below TUNE_MIN: untimed
    assert not called and not mod._CHOSEN


def test_training_forward_converts_no_saved_value():
    """The differentiable forward's only torch work besides its kernel is for the outputs:
    the saved values (float32 row statistics, no outputs) are not converted to the input's
    type and dropped (three wasted launches per call for this program before)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    import triton.runtime.interpreter as interp

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.inside = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.inside and func.__name__ not in ("empty.memory_format", "detach.default"):
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    k = af.compile(_layernorm())
    x, w, b = (torch.randn(6, 40).to(torch.bfloat16), torch.randn(40).to(torch.bfloat16),
               torch.randn(40).to(torch.bfloat16))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    k(x=leaves[0], w=leaves[1], b=leaves[2])   # compiled, first call
    mode = Ops()
    run = interp.InterpretedFunction.run

    def counted(self, *a, **kw):   # the kernel's own (interpreter) work is not counted
        mode.inside += 1
        try:
            return run(self, *a, **kw)
        finally:
            mode.inside -= 1
    interp.InterpretedFunction.run = counted
    try:
        with mode:
            y = k(x=leaves[0], w=leaves[1], b=leaves[2])
    finally:
        interp.InterpretedFunction.run = run
    assert "_to_copy.default" not in mode.ops, mode.ops
    ref = _ref_layernorm(x.double(), w.double(), b.double())
    assert y.dtype == torch.bfloat16 and torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2)


class _FakeEvent:
    """torch.cuda.Event on the CPU: the time it was recorded."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        import time
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_real_timing_path_and_the_tuning_store(monkeypatch, tmp_path):
    """The timing the GPU runs (_fastest, _time_calls, _remembered and codegen/tuning.py's
    store), here with CPU stand-ins for CUDA events: a choice among the candidates is made,
    recorded on disk, and read back by a fresh module state without timing again."""
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "1")
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda n: None)
    k = af.compile(_normalized_exp())
    mod = k.kernel.module
    monkeypatch.setattr(mod, "TIMED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mod, "TUNE_MIN", 1)
    monkeypatch.setattr(mod, "_CHOSEN", {})
    monkeypatch.setattr(mod, "_PLANS", {})
    timed = []
    real = mod._fastest
    monkeypatch.setattr(mod, "_fastest", lambda *a, **kw: timed.append(1) or real(*a, **kw))
    x = torch.randn(2, 200)   # small: three candidates, each run 16 times on the interpreter
    y = k(x=x)
    assert timed == [1] and len(mod._CHOSEN) == 1
    ok, err = _close(y, torch.softmax(x.double(), -1))
    assert ok, err
    assert list((tmp_path / "tuning").glob("*.json")), "the choice was not stored"
    monkeypatch.setattr(mod, "_CHOSEN", {})
    monkeypatch.setattr(mod, "_PLANS", {})
    y = k(x=torch.randn(2, 170))   # the same shape class, a fresh process's state: read back
    assert timed == [1] and len(mod._CHOSEN) == 1
