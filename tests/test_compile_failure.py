"""A Triton compile failure never reaches the user raw (codegen/launch_retry.py).

On an H200 (Triton 3.6) the bfloat16 augmented forward of the paged-KV attention program failed
to compile at N=11 and 13 (``RuntimeError: PassManager::run failed``, an assertion on pipelined
gathered loads) and reached the user as it was. Every launcher now retries a kernel Triton
cannot compile with safer options (no pipelining, then other warp counts), keeps the options
that compile, and raises KernelCompileError naming the program, the kernel, the options tried
and Triton's first line when none does; a run-time error is raised as it is.

On the CPU the kernels run in Triton's interpreter, which compiles nothing: each test puts a
stand-in (``Failing``) in place of a generated module's kernel, raising a compile error for the
launch options it is told to refuse and launching the real kernel otherwise. Families: row
(softmax), contraction (the mask gallery's paged_kv forward, and its bfloat16 augmented forward
trained through af.compile, the reported case), sum kernel (an attention dQ stage), gemm
(af.gemm's prologue form, acefuse/quant_gemm.py: a per-token float8 quantization feeding the
dot; its GPU options, num_warps and num_stages, are passed by calling the launch with a
forced config on the CPU, where the interpreter ignores them; the timed choice of a config
on a GPU is not run here).
"""
import math
import runpy
import warnings
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.codegen.compile import CompileRetryWarning, KernelCompileError, KernelError

EX = Path(__file__).resolve().parents[1] / "examples"
PASS_MANAGER = "PassManager::run failed"


class Failing:
    """Stands in for a generated kernel ``real``: a launch whose options ``refuse(kw)`` raises
    ``error()``; others launch ``real``. ``calls``: each launch's options."""

    def __init__(self, real, refuse, error=lambda: RuntimeError(PASS_MANAGER)):
        self.real, self.refuse, self.error, self.calls = real, refuse, error, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(dict(kw))
            if self.refuse(kw):
                raise self.error()
            return self.real[grid](*args, **kw)
        return launch


def pipelined(kw):   # Triton 3.6's failure: any software-pipelined launch
    return kw.get("num_stages") != 1


def _fresh(mod):
    for d in ("_SAFER", "_PLANS"):
        if hasattr(mod, d):
            getattr(mod, d).clear()


def _patch(monkeypatch, mod, name, refuse, **kw):
    fake = Failing(getattr(mod, name), refuse, **kw)
    monkeypatch.setattr(mod, name, fake)
    _fresh(mod)
    return fake


def _close(got, want, tol):
    want = want.double()
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"off by {err:.3g}"


# ---- row family --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def softmax():
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    p = af.exp(x - m)
    return af.compile(af.program("cf_softmax", y=p / af.sum(p, "j")))


def test_row_kernel_retried_without_pipelining_and_kept(softmax, monkeypatch):
    mod = softmax.module
    fake = _patch(monkeypatch, mod, "cf_softmax_single", pipelined)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 37, generator=g) * 3
    with pytest.warns(CompileRetryWarning, match=r"cf_softmax.*cf_softmax_single.*PassManager::run failed.*num_stages=1"):
        y = softmax(x=x)
    _close(y, torch.softmax(x.double(), -1), 1e-5)
    assert [c.get("num_stages") for c in fake.calls] == [None, 1]
    # kept: the plan (same signature) and a new plan of the same options (a positional call)
    x2 = torch.randn(5, 37, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileRetryWarning)
        _close(softmax(x=x2), torch.softmax(x2.double(), -1), 1e-5)
        _close(softmax(x2), torch.softmax(x2.double(), -1), 1e-5)   # positional: a new plan
    assert [c.get("num_stages") for c in fake.calls] == [None, 1, 1, 1]


def test_row_kernel_no_option_compiles(softmax, monkeypatch):
    mod = softmax.module
    fake = _patch(monkeypatch, mod, "cf_softmax_single", lambda kw: True)
    x = torch.randn(3, 20)
    with pytest.raises(KernelCompileError) as e:
        softmax(x=x)
    msg = str(e.value)
    assert type(e.value) is KernelCompileError and isinstance(e.value, KernelError)
    for part in ("'cf_softmax'", "cf_softmax_single", "RuntimeError: PassManager::run failed",
                 "num_stages=1", "num_warps=8", "num_warps=2", "report", mod.__file__):
        assert part in msg, part
    assert len(fake.calls) == 4   # as given, then no pipelining with 4, 8, 2 warps
    assert not mod._SAFER


def test_row_run_time_error_is_not_retried(softmax, monkeypatch):
    mod = softmax.module
    fake = _patch(monkeypatch, mod, "cf_softmax_single", lambda kw: True,
                  error=lambda: RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access") as e:
        softmax(x=torch.randn(3, 20))
    assert not isinstance(e.value, KernelError) and len(fake.calls) == 1


# ---- contraction family: paged KV attention (the reported program) --------------------------------
@pytest.fixture(scope="module")
def gallery():
    return runpy.run_path(str(EX / "masks.py"), run_name="examples_masks")


@pytest.fixture(scope="module")
def paged(gallery):
    return af.compile(gallery["GALLERY"]["paged_kv"].program, axis="j")


def _paged_inputs(gallery, prog, n, seed, dtype=torch.float32):
    made = gallery["make_inputs"]("paged_kv", B=2, H=2, N=n, seed=seed)
    ins = {t: (x.to(dtype) if x.dtype.is_floating_point else x) for t, x in made.items() if t in prog.tensors}
    return ins, gallery["reference"]("paged_kv", made)


@pytest.mark.parametrize("n", [11, 13])
def test_paged_kv_forward_retried(gallery, paged, monkeypatch, n):
    mod = paged.module
    fake = _patch(monkeypatch, mod, "paged_kv_attn", pipelined)
    ins, want = _paged_inputs(gallery, paged.prog, n, seed=n)
    with pytest.warns(CompileRetryWarning, match=r"paged_kv_attn .*num_stages=1"):
        o = paged(**ins)
    _close(o, want, 2e-5)
    assert [c.get("num_stages") for c in fake.calls] == [None, 1]
    ins2, want2 = _paged_inputs(gallery, paged.prog, n, seed=n + 100)
    _close(paged(**ins2), want2, 2e-5)
    assert len(fake.calls) == 3 and fake.calls[-1].get("num_stages") == 1


def test_paged_kv_other_warps_then_error(gallery, paged, monkeypatch):
    """num_stages=1 also fails: each other warp count is tried; the first that compiles is kept.
    Then nothing compiles: KernelCompileError with the options tried."""
    mod = paged.module
    fake = _patch(monkeypatch, mod, "paged_kv_attn", lambda kw: kw.get("num_warps") != 2)
    ins, want = _paged_inputs(gallery, paged.prog, 13, seed=5)
    with pytest.warns(CompileRetryWarning, match="num_warps=2"):
        _close(paged(**ins), want, 2e-5)
    assert [(c.get("num_stages"), c["num_warps"]) for c in fake.calls] == [(None, 4), (1, 4), (1, 8), (1, 2)]
    _close(paged(**ins), want, 2e-5)
    assert len(fake.calls) == 5
    fake = _patch(monkeypatch, mod, "paged_kv_attn", lambda kw: True,
                  error=lambda: _triton_error("PTXASError", "`ptxas` failed with error code -11"))
    with pytest.raises(KernelCompileError, match=r"'paged_kv'.*paged_kv_attn.*PTXASError.*ptxas.*num_warps=8"):
        paged(**ins)


def _triton_error(name, msg):
    import triton.runtime.errors as te
    return getattr(te, name)(msg)


def test_paged_kv_run_time_error_is_not_retried(gallery, paged, monkeypatch):
    mod = paged.module
    fake = _patch(monkeypatch, mod, "paged_kv_attn", lambda kw: True,
                  error=lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    ins, _ = _paged_inputs(gallery, paged.prog, 11, seed=1)
    with pytest.raises(Exception, match="CUDA out of memory") as e:   # (af.compile's KernelError wraps torch's)
        paged(**ins)
    assert not isinstance(e.value, KernelCompileError) and len(fake.calls) == 1


@pytest.mark.parametrize("n", [11, 13])
def test_paged_kv_bf16_training_retries_the_augmented_forward(gallery, monkeypatch, n):
    """The reported case: af.compile(paged_kv) trained in bfloat16; its augmented forward (the
    forward that also writes the saved values) refuses pipelined launches. The gradients
    match float64 autograd of the gallery's reference; no gradient falls back to torch."""
    from acefuse.autograd import GradientFallbackWarning
    var = gallery["GALLERY"]["paged_kv"]
    dk = af.compile(var.program)
    aug, _ = dk._grad_kernels()
    name = f"{aug.program.name}_attn"
    fake = _patch(monkeypatch, aug.module, name, pipelined)
    made = gallery["make_inputs"]("paged_kv", B=1, H=2, N=n, seed=n)
    ins = {t: (x.to(torch.bfloat16) if x.dtype.is_floating_point else x) for t, x in made.items()
           if t in var.program.tensors}
    extra = {t: x for t, x in made.items() if t not in var.program.tensors}
    leaves = {t: (x.clone().requires_grad_() if x.dtype.is_floating_point else x) for t, x in ins.items()}
    wrt = [t for t, x in leaves.items() if x.dtype.is_floating_point]
    cot = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.simplefilter("error", GradientFallbackWarning)
        o = dk(**leaves)
        got = torch.autograd.grad(o, [leaves[t] for t in wrt], cot)
    assert any(issubclass(w.category, CompileRetryWarning) and name in str(w.message) for w in seen)
    assert dk.grad_fallback is None and [c.get("num_stages") for c in fake.calls][:2] == [None, 1]
    lv = {t: (x.detach().double().requires_grad_() if x.dtype.is_floating_point else x) for t, x in ins.items()}
    r = var.reference(**lv, **{t: (x.double() if x.dtype.is_floating_point else x) for t, x in extra.items()})
    want = torch.autograd.grad(r, [lv[t] for t in wrt], cot.double())
    _close(o, r, 3e-2)
    for t, g, w in zip(wrt, got, want):
        err = (g.double() - w).abs().max().item()
        assert err <= 4e-2 * max(1.0, w.abs().max().item()), f"grad {t} off by {err:.3g}"


# ---- sum-kernel family: an attention dQ stage --------------------------------------------------------
SCALE = 0.125


@pytest.fixture(scope="module")
def dq():
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    go, m, dd, lse = af.tensor("go", "b h i e"), af.tensor("m", "b h i"), af.tensor("dd", "b h i"), af.tensor("l", "b h i")
    i, j = af.index("i"), af.index("j")
    s = af.where(j <= i, af.sum(q * k, "d") * SCALE, af.NEG_INF)
    p = af.exp(s - m) * af.where(lse.eq(0.0), 0.0, 1.0 / lse)
    ds = p * (af.sum(go * v, "e") - dd) * SCALE
    kern = af.compile(af.program("cf_dq", grad_q=af.sum(ds * k, "j")), axis="j")
    assert hasattr(kern.module, "cf_dq_sum"), "expected a sum kernel"
    return kern


def _dq_case(seed, n=19):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    v, go = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * SCALE
    s = s.masked_fill(torch.ones(n, n).tril() == 0, -math.inf)
    m = s.amax(-1)
    l = torch.exp(s - m[..., None]).sum(-1)
    dd = torch.randn(1, 2, n, generator=g).double()
    p = torch.exp(s - m[..., None]) / l[..., None]
    ds = p * (torch.einsum("bhie,bhje->bhij", go.double(), v.double()) - dd[..., None]) * SCALE
    want = torch.einsum("bhij,bhjd->bhid", ds, k.double())
    return dict(q=q, k=k, v=v, go=go, m=m.float(), dd=dd.float(), l=l.float()), want


def test_sum_kernel_retried_and_kept(dq, monkeypatch):
    mod = dq.module
    fake = _patch(monkeypatch, mod, "cf_dq_sum", pipelined)
    ins, want = _dq_case(3)
    with pytest.warns(CompileRetryWarning, match=r"cf_dq_sum .*num_stages=1"):
        _close(dq(**ins), want, 2e-5)
    ins, want = _dq_case(4)
    _close(dq(**ins), want, 2e-5)
    assert [c.get("num_stages") for c in fake.calls] == [None, 1, 1]


def test_sum_kernel_errors(dq, monkeypatch):
    mod = dq.module
    ins, _ = _dq_case(5)
    fake = _patch(monkeypatch, mod, "cf_dq_sum", lambda kw: True)
    with pytest.raises(KernelCompileError, match=r"'cf_dq'.*cf_dq_sum.*PassManager.*num_stages=1.*num_warps=8"):
        dq(**ins)
    assert len(fake.calls) == 4
    fake = _patch(monkeypatch, mod, "cf_dq_sum", lambda kw: True,
                  error=lambda: RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access") as e:
        dq(**ins)
    assert not isinstance(e.value, KernelError) and len(fake.calls) == 1


def test_compile_error_classification(softmax):
    """Compile errors (Triton's types; RuntimeError of an MLIR pass, ptxas, LLVM) are retried;
    CUDA's run-time errors, out of memory and other errors are not."""
    from triton.compiler.errors import CompilationError
    f = softmax.module._compile_error
    assert f(RuntimeError(PASS_MANAGER)) and f(_triton_error("PTXASError", "ptxas fatal"))
    import triton.runtime.errors as te
    assert f(te.OutOfResources(300000, 232448, "shared memory")) and f(CompilationError("src", None, "bad"))
    assert f(RuntimeError("LLVM ERROR: Cannot select"))
    for e in (RuntimeError("CUDA error: an illegal memory access was encountered"),
              torch.cuda.OutOfMemoryError("CUDA out of memory"), RuntimeError("no TMA in this Triton"),
              ValueError("PassManager::run failed"), TypeError("bad argument")):
        assert not f(e), e


def test_timed_launch_skips_a_candidate_that_does_not_compile(softmax, monkeypatch):
    """A large problem's first call times launch candidates (here on the CPU, every candidate
    taking the same time): the size heuristics' own launch (required: a real error in it is
    raised) that Triton cannot compile is skipped like any candidate, not raised raw; the
    first candidate that compiles runs, and keeps running."""
    mod = softmax.module
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    monkeypatch.setattr(mod, "TIMED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mod, "TUNE_MIN", 1)
    monkeypatch.setattr(mod, "_CHOSEN", {})
    monkeypatch.setattr(mod, "_time_calls", lambda fn, reps=5: (fn(), 1.0)[1])
    fake = _patch(monkeypatch, mod, "cf_softmax_single", lambda kw: kw["num_warps"] == 4)
    x = torch.randn(6, 45, generator=torch.Generator().manual_seed(9)) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileRetryWarning)
        _close(softmax(x=x), torch.softmax(x.double(), -1), 1e-5)
    assert fake.calls[0]["num_warps"] == 4 and fake.calls[-1]["num_warps"] == 8
    assert list(mod._CHOSEN.values()) == [dict(schedule="single", block_r=8, num_warps=8)]
    n = len(fake.calls)
    _close(softmax(x=x), torch.softmax(x.double(), -1), 1e-5)
    assert len(fake.calls) == n + 1 and fake.calls[-1]["num_warps"] == 8


# ---- gemm family: af.gemm's prologue form (acefuse/quant_gemm.py) ------------------------------------
@pytest.fixture(scope="module")
def qgemm():
    from acefuse.quant_gemm import gemm
    x, wq, ws = af.tensor("x", "t k"), af.tensor("wq", "n k"), af.tensor("ws", "n")
    scale = af.cast(af.max(af.abs(x), "k") / 448.0, "float32")
    acc = af.sum(af.cast(x / scale, "float8_e4m3fn") * wq, "k")
    return gemm(af.program("cf_gemm", out=acc * scale * ws))


def _gemm_case(seed, t=21, k=40, n=19):
    """Inputs and the float64 product of the dequantized float8 values (torch's casts)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.exp(torch.randn(t, 1, generator=g))
    w = torch.randn(n, k, generator=g)
    ws = (w.abs().amax(1).double() / 448.0).float()
    wq = (w / ws[:, None]).to(torch.float8_e4m3fn)
    s = (x.double().abs().amax(1) / 448.0).float()
    q = (x / s[:, None]).to(torch.float8_e4m3fn)
    want = (q.double() @ wq.double().t()) * s.double()[:, None] * ws.double()[None, :]
    return dict(x=x, wq=wq, ws=ws), want


def _gemm_run(g, ins, config=None, cuda=False):
    """The prologue form's launch (``cuda=True``: with a GPU config's num_warps/num_stages)."""
    M, N, K, dtypes, _ = g._shapes(ins)
    return g._run_prologue(ins, torch.float32, M, N, K, dtypes, cuda, config=config)


def test_gemm_retried_without_pipelining_and_kept(qgemm, monkeypatch):
    mod = qgemm._module()
    fake = _patch(monkeypatch, mod, "cf_gemm_gemm", lambda kw: kw.get("num_stages") != 1)
    ins, want = _gemm_case(1)
    with pytest.warns(CompileRetryWarning, match=r"'cf_gemm'.*cf_gemm_gemm .*PassManager::run failed.*num_stages=1"):
        out = qgemm(form="prologue", **ins)["out"]
    _close(out, want, 1e-5)
    ins, want = _gemm_case(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileRetryWarning)
        _close(qgemm(form="prologue", **ins)["out"], want, 1e-5)
    assert [c.get("num_stages") for c in fake.calls] == [None, 1, 1]


def test_gemm_forced_gpu_config_other_warps_then_error(qgemm, monkeypatch):
    """A forced config (8 warps, 3 stages): no pipelining, then the other warp counts; the one
    that compiles is kept for that config. Then nothing compiles: KernelCompileError naming
    the program, the kernel, Triton's first line and the options tried (blocks included)."""
    mod = qgemm._module()
    cfg = (16, 16, 32, 8, 3)
    fake = _patch(monkeypatch, mod, "cf_gemm_gemm", lambda kw: kw.get("num_warps") != 2)
    ins, want = _gemm_case(3)
    with pytest.warns(CompileRetryWarning, match="num_warps=2"):
        _close(_gemm_run(qgemm, ins, cfg, cuda=True), want, 1e-5)
    assert [(c.get("num_stages"), c["num_warps"]) for c in fake.calls] == [(3, 8), (1, 8), (1, 4), (1, 2)]
    _close(_gemm_run(qgemm, ins, cfg, cuda=True), want, 1e-5)
    last = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=1)
    assert {k: fake.calls[-1][k] for k in last} == last
    assert len(fake.calls) == 5
    fake = _patch(monkeypatch, mod, "cf_gemm_gemm", lambda kw: True,
                  error=lambda: _triton_error("PTXASError", "`ptxas` failed with error code -11"))
    with pytest.raises(KernelCompileError) as e:
        _gemm_run(qgemm, ins, cfg, cuda=True)
    msg = str(e.value)
    for part in ("'cf_gemm'", "cf_gemm_gemm", "PTXASError", "BLOCK_M=16", "num_stages=3", "num_stages=1",
                 "num_warps=4", "num_warps=2", "report", mod.__file__):
        assert part in msg, part
    assert len(fake.calls) == 4 and not mod._SAFER


def test_gemm_run_time_error_and_tuning_not_retried(qgemm, monkeypatch):
    """A run-time error is raised as it is; so is a compile error while the GPU's candidates are
    timed (``_TUNING``: the candidate is skipped there, quant_gemm._measure)."""
    mod = qgemm._module()
    ins, _ = _gemm_case(4)
    fake = _patch(monkeypatch, mod, "cf_gemm_gemm", lambda kw: True,
                  error=lambda: RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access") as e:
        qgemm(form="prologue", **ins)
    assert not isinstance(e.value, KernelError) and len(fake.calls) == 1
    fake = _patch(monkeypatch, mod, "cf_gemm_gemm", lambda kw: True)
    monkeypatch.setattr(mod, "_TUNING", [1])
    with pytest.raises(RuntimeError, match=PASS_MANAGER) as e:
        _gemm_run(qgemm, ins, (16, 16, 32, 8, 3), cuda=True)
    assert not isinstance(e.value, KernelError) and len(fake.calls) == 1
