"""Training through ``torch.compile(backend=af.backend)``: a small transformer language
model (embedding, LayerNorm, causal attention written with ``masked_fill``, MLP,
cross-entropy). Its norm, softmax and loss regions run as differentiable acefuse kernels
(acefuse.autograd: augmented forward + the kernels of ``af.backward``); every
parameter's gradient is compared with float64 eager autograd of the same model, on
fresh random inputs, with explicit tolerances. Float32 kernels on the CPU (Triton's
interpreter), tiny sizes. The comparison itself is tested: a deliberately broken
backward kernel must fail it. When acefuse's backward cannot be built or fails at
``.backward()``, the gradient is torch autograd of the program (acefuse.autograd_ref),
with one warning: never lost (the last tests)."""
import math
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import acefuse as af
import acefuse.frontend as aff
from acefuse.autograd import BackwardKernel
from acefuse.frontend.runtime import AcefuseFallbackWarning

RTOL, ATOL = 1e-4, 1e-6      # float32 kernels + float32 torch ops vs float64 eager
V, C, H, N, B = 11, 8, 2, 5, 2


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.pos = nn.Parameter(torch.randn(N, C) * 0.1)
        self.ln1, self.lnf = nn.LayerNorm(C), nn.LayerNorm(C)   # (an ln2 would be ln1's program again)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc2 = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        self.head = nn.Linear(C, V)
        self.register_buffer("mask", torch.tril(torch.ones(N, N, dtype=torch.bool)))

    def forward(self, idx, tgt):
        x = self.emb(idx) + self.pos
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, N, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(~self.mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc(x), approximate="tanh"))
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.view(-1, V), tgt.view(-1))


def _models(seed=0):
    torch.manual_seed(seed)
    m = TinyLM()
    with torch.no_grad():            # LayerNorm weight/bias away from 1/0, so their gradients matter
        for n, p in m.named_parameters():
            if n.startswith("ln"):
                p.add_(torch.randn_like(p) * 0.3)
    ref = TinyLM().double()
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    return m, ref


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, N), generator=g), torch.randint(0, V, (B, N), generator=g)


def _step(model, idx, tgt):
    model.zero_grad()
    loss = model(idx, tgt)
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}


def assert_grads_match(got: dict, ref: dict):
    """Every parameter has a gradient, close to the float64 one."""
    assert set(got) == set(ref)
    for n, r in ref.items():
        assert got[n] is not None, f"parameter {n} got no gradient"
        assert torch.isfinite(got[n]).all(), f"parameter {n}: non-finite gradient"
        torch.testing.assert_close(got[n].double(), r, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")


@pytest.fixture(scope="module")
def trained():
    """One compiled model, trained: the first step's gradients, then 3 SGD steps (the
    eager float64 twin takes the same steps)."""
    torch._dynamo.reset()
    m, ref = _models()
    graphs = []

    def backend(gm, example_inputs):
        cf = af.backend(gm, example_inputs)
        graphs.append(cf)
        return cf

    cm = torch.compile(m, backend=backend, dynamic=False)
    idx, tgt = _data(1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        loss, grads = _step(cm, idx, tgt)
    ref_loss, ref_grads = _step(ref, idx, tgt)
    warned = [str(r.message) for r in rec if issubclass(r.category, AcefuseFallbackWarning)]
    calls_after_step = [(r.program.name, dict(r.calls)) for g in graphs for r in g.regions]

    losses, ref_losses = [], []
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        for model, o, out in ((cm, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad()
            lo = model(idx, tgt)
            lo.backward()
            o.step()
            out.append(lo.item())
    return dict(cm=cm, m=m, ref=ref, idx=idx, tgt=tgt, loss=loss, grads=grads, ref_loss=ref_loss,
                ref_grads=ref_grads, warned=warned, calls=calls_after_step, graphs=graphs,
                losses=losses, ref_losses=ref_losses)


def test_training_step_gradients_match_float64_eager(trained):
    t = trained
    torch.testing.assert_close(t["loss"].double(), t["ref_loss"], rtol=RTOL, atol=ATOL)
    assert_grads_match(t["grads"], t["ref_grads"])
    assert len(t["grads"]) == 16     # every parameter, LayerNorm weights and biases included


def test_norm_softmax_and_loss_regions_ran_differentiable_kernels(trained):
    """acefuse took the norm/softmax/loss regions in training (nothing fell back)."""
    calls = trained["calls"]
    ran = [name for name, c in calls if c["grad"] == 1 and c["torch"] == 0 and c["kernel"] == 0]
    assert sorted(n.split("_", 1)[1] for n in ran) == \
        ["cross_entropy", "layer_norm", "layer_norm", "softmax"], calls
    assert [n for n, c in calls if c["torch"]] == [], calls
    assert trained["warned"] == []


def test_loss_decreases_over_three_sgd_steps_like_eager(trained):
    losses, ref = trained["losses"], trained["ref_losses"]
    assert losses[0] > losses[1] > losses[2], losses
    assert losses[2] < losses[0] - 0.05, losses
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 1e-4 * abs(b) + 1e-5, (losses, ref)
    for (n, p), (_, q) in zip(trained["m"].named_parameters(), trained["ref"].named_parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{n}: {m}")


def test_broken_backward_kernel_is_caught(trained, monkeypatch):
    """The gradient check can fail: backward kernels that return slightly wrong gradients
    (scaled by 1.01) make the comparison with float64 eager fail."""
    t = trained
    m, ref = _models(seed=3)
    t["m"].load_state_dict(m.state_dict())      # same compiled model, fresh parameters
    idx, tgt = _data(4)
    good = BackwardKernel.__call__

    def broken(self, *args, **kw):
        return {k: g * 1.01 for k, g in good(self, *args, **kw).items()}

    _, ref_grads = _step(ref, idx, tgt)
    monkeypatch.setattr(BackwardKernel, "__call__", broken)
    before = sum(c["grad"] for g in t["graphs"] for c in [r.calls for r in g.regions])
    _, grads = _step(t["cm"], idx, tgt)
    assert sum(c["grad"] for g in t["graphs"] for c in [r.calls for r in g.regions]) == before + 4
    with pytest.raises(AssertionError):
        assert_grads_match(grads, ref_grads)
    monkeypatch.setattr(BackwardKernel, "__call__", good)
    _, grads = _step(t["cm"], idx, tgt)
    assert_grads_match(grads, ref_grads)


@pytest.fixture
def fresh_kernels():
    """In-memory kernels forgotten before and after (a refused backward is cached as refused)."""
    aff.clear_cache()
    yield
    aff.clear_cache()


def _norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b) * 1.5


def test_region_without_backward_kernel_runs_in_torch_with_one_warning(monkeypatch, fresh_kernels):
    """What acefuse cannot differentiate runs in torch, with a warning naming the region
    and the reason; gradients are still eager's. Inference still runs the kernel."""

    def refuse(prog, wrt=None):
        raise af.BackwardError(f"program {prog.name!r}: no derivative (test)")

    monkeypatch.setattr(sys.modules["acefuse.backward"], "backward", refuse)   # (af.backward is the function)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 13, generator=g).requires_grad_()
    w = (torch.rand(13, generator=g) + 0.5).requires_grad_()
    b = torch.randn(13, generator=g).requires_grad_()
    cot = torch.randn(4, 13, generator=g)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cf = af.compile(_norm, x, w, b)
        for _ in range(2):
            for t in (x, w, b):
                t.grad = None
            (cf(x, w, b) * cot).sum().backward()
    msgs = [str(r.message) for r in rec if issubclass(r.category, AcefuseFallbackWarning)]
    assert len(msgs) == 1 and "region `" in msgs[0] and "no derivative (test)" in msgs[0], msgs
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    (_norm(xd, wd, bd) * cot.double()).sum().backward()
    for t, r in ((x, xd), (w, wd), (b, bd)):
        torch.testing.assert_close(t.grad.double(), r.grad, rtol=RTOL, atol=ATOL)
    assert not cf.graph_for(x, w, b).af_regions          # training: the region is torch's
    with torch.no_grad():                                 # inference: the kernel runs
        y = cf(x, w, b)
        regions = cf.graph_for(x, w, b).af_regions
    assert regions and all(r.calls["kernel"] == 1 for r in regions)
    torch.testing.assert_close(y.double(), _norm(xd, wd, bd).detach(), rtol=RTOL, atol=ATOL)


def test_drop_in_compile_is_differentiable_and_refuses_double_backward():
    """af.compile(fn, *inputs): a differentiable region (LayerNorm weight and bias read as
    inputs), float64-exact gradients for every input; a backward with create_graph=True is
    refused with NotDifferentiableError instead of returning gradients without grad_fn."""
    from acefuse.codegen.compile import NotDifferentiableError
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(6, 29, generator=g) * 2 + 1).requires_grad_()
    w = (torch.rand(29, generator=g) + 0.5).requires_grad_()
    b = torch.randn(29, generator=g).requires_grad_()
    cot = torch.randn(6, 29, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        cf = af.compile(_norm, x, w, b)
        y = cf(x, w, b)
        assert y.grad_fn is not None
        got = torch.autograd.grad((y * cot).sum(), [x, w, b])
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad((_norm(xd, wd, bd) * cot.double()).sum(), [xd, wd, bd])
    for name, a, r in zip("xwb", got, ref):
        torch.testing.assert_close(a.double(), r, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
    assert [r.calls["grad"] for r in cf.regions] == [1]
    with pytest.raises(NotDifferentiableError, match=r"f?_norm.*create_graph=True"):
        torch.autograd.grad((cf(x, w, b) * cot).sum(), [w], create_graph=True)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 1.0


def _qkv_grad(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 6, 4, generator=g).requires_grad_() for _ in range(3)]


def _attention_grads(cf, qkv, cot):
    got = torch.autograd.grad((cf(*qkv) * cot).sum(), qkv)
    ref64 = [t.detach().double().requires_grad_() for t in qkv]
    ref = torch.autograd.grad((_sdpa(*ref64) * cot.double()).sum(), ref64)
    for name, a, r in zip("qkv", got, ref):
        torch.testing.assert_close(a.double(), r, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")


def test_contraction_without_backward_kernel_stays_in_torch(monkeypatch, fresh_kernels):
    """A region holding a contraction (sdpa) whose backward acefuse cannot build: in
    training its contraction stays in torch with one warning saying so; gradients are eager's."""
    monkeypatch.setattr(sys.modules["acefuse.backward"], "backward",
                        lambda prog, wrt=None: (_ for _ in ()).throw(af.BackwardError("no derivative (test)")))
    qkv, cot = _qkv_grad(5), torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(6))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cf = af.compile(_sdpa, *qkv)
        _attention_grads(cf, qkv, cot)
    msgs = [str(r.message) for r in rec if issubclass(r.category, AcefuseFallbackWarning)]
    assert len(msgs) == 1 and "no backward kernel for its contractions (BackwardError: no derivative (test))" \
        in msgs[0] and "scaled_dot_product_attention" in msgs[0], msgs
    assert not cf.regions


def test_attention_region_trains_with_derived_backward_kernels():
    """sdpa in training: acefuse's attention kernel forward, the kernels of af.backward of
    the attention program backward (FlashAttention-2-style), float64-exact gradients."""
    qkv, cot = _qkv_grad(8), torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(9))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        cf = af.compile(_sdpa, *qkv)
        _attention_grads(cf, qkv, cot)
    assert [r.calls["grad"] for r in cf.regions] == [1]


def test_parameters_unfrozen_after_compiling_get_the_differentiable_kernel():
    """Parameters read inside the graph are not arguments, so unfreezing them does not
    respecialise: the region builds its differentiable kernel on the first call that
    needs it (fine-tuning a frozen norm)."""
    g = torch.Generator().manual_seed(12)
    ln = nn.LayerNorm(21)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5, generator=g)
        ln.bias.normal_(generator=g)
    ln.requires_grad_(False)
    x, cot = torch.randn(5, 21, generator=g) * 3, torch.randn(5, 21, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        cf = af.compile(ln, x)
        assert cf(x).grad_fn is None and [r.calls for r in cf.regions] == [{"kernel": 1, "grad": 0, "torch": 0}]
        ln.requires_grad_(True)
        (cf(x) * cot).sum().backward()
    assert len(cf.graphs) == 1 and [r.calls["grad"] for r in cf.regions] == [1]
    ref = nn.LayerNorm(21).double()
    ref.load_state_dict({k: v.double() for k, v in ln.state_dict().items()})
    (ref(x.double()) * cot.double()).sum().backward()
    for n, p in ln.named_parameters():
        torch.testing.assert_close(p.grad.double(), dict(ref.named_parameters())[n].grad, rtol=RTOL, atol=ATOL)


# ---- no gradient is lost when acefuse's backward fails (acefuse.autograd's torch fallback) ----------
def _masked_norm_program():
    """A layernorm-like program whose rows may be fully masked: the shift by the max of a
    masked row reads as 0, a 0/0 from a reduction as 0 (README "Numerics")."""
    x, w, b = af.tensor("x", "r j"), af.tensor("w", "j"), af.tensor("b", "j")
    m = af.max(x, "j")
    e = af.exp(x - m)
    mu = af.mean(x, "j")
    return af.program("fb_norm", y=e / af.sum(e, "j") * w + b,
                      z=(x - mu) * af.rsqrt(af.mean((x - mu) ** 2, "j") + 1e-5) * w)


@pytest.fixture(scope="module")
def fb_kernels():
    """The program, its forward kernel and its compiled backward (shared; each test builds
    its own DifferentiableKernel from them, as the frontend does)."""
    from acefuse.autograd import compile_backward
    from acefuse.codegen.compile import compile_program
    prog = _masked_norm_program()
    bwd = af.backward(prog)
    return prog, compile_program(prog), compile_program(bwd.augmented), bwd, compile_backward(bwd)


def _fb_data(seed, masked_rows=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 19, generator=g) * 2
    if masked_rows:
        x[1] = -math.inf             # a fully masked row: y = b there (z is NaN, as in torch)
        x[3, ::2] = -math.inf        # a partly masked row
    w = torch.rand(19, generator=g) + 0.5
    b = torch.randn(19, generator=g)
    cots = {"y": torch.randn(5, 19, generator=g), "z": torch.randn(5, 19, generator=g)}
    return {"x": x, "w": w, "b": b}, cots


def _fb_reference(inputs, cots, outs=("y", "z")):
    """float64 torch, written independently: y = softmax(x) * w + b (a fully masked row's
    softmax is 0, its gradient 0), z = layernorm(x) * w."""
    xd, wd, bd = (inputs[k].double().requires_grad_() for k in "xwb")
    full = torch.isneginf(xd).all(-1, keepdim=True)
    p = torch.where(full, 0.0, torch.softmax(torch.where(full, 0.0, xd), -1))
    z = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5) * wd
    res = {"y": p * wd + bd, "z": z}
    loss = sum((res[k] * cots[k].double()).nan_to_num(0.0).sum() if k == "z" else (res[k] * cots[k].double()).sum()
               for k in outs)
    return res, dict(zip("xwb", torch.autograd.grad(loss, [xd, wd, bd], allow_unused=True)))


def _fb_step(dk, inputs, cots, outs=("y", "z")):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    res = dk(**leaves)
    loss = sum((res[k] * cots[k]).nan_to_num(0.0).sum() if k == "z" else (res[k] * cots[k]).sum() for k in outs)
    return res, dict(zip("xwb", torch.autograd.grad(loss, [leaves[k] for k in "xwb"], allow_unused=True)))


def _fb_check(dk, seed, masked_rows=True):
    inputs, cots = _fb_data(seed, masked_rows)
    outs = ("y",) if masked_rows else ("y", "z")     # (z of a fully masked row is NaN, as in torch)
    res, got = _fb_step(dk, inputs, cots, outs)
    ref, want = _fb_reference(inputs, cots, outs)
    torch.testing.assert_close(res["y"].double(), ref["y"].detach(), rtol=RTOL, atol=ATOL)
    for k in "xwb":
        assert got[k] is not None and torch.isfinite(got[k]).all(), (k, got[k])
        torch.testing.assert_close(got[k].double(), want[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {k}: {m}")
    if masked_rows:
        assert (got["x"][1] == 0).all()              # a fully masked row gets gradient 0


def _grad_warnings(rec):
    from acefuse.autograd import GradientFallbackWarning
    return [str(r.message) for r in rec if issubclass(r.category, GradientFallbackWarning)]


@pytest.mark.parametrize("error", ["CodegenError", "FuseError", "KernelError"])
def test_backward_kernel_failing_at_backward_falls_back_to_torch(fb_kernels, monkeypatch, error):
    """A derived backward kernel that fails when ``.backward()`` runs it (a Triton compile
    error on first launch, a CodegenError, a FuseError): one warning naming the program and
    the error; the gradient of this call and later ones is torch autograd of the program,
    float64-exact, 0 in a fully masked row; the forward kept running acefuse's kernel."""
    from acefuse.autograd import DifferentiableKernel
    from acefuse.codegen.compile import KernelError
    from acefuse.codegen.emit import CodegenError
    prog, kernel, aug, bwd, bk = fb_kernels
    dk = DifferentiableKernel(prog, kernel, {})
    dk._aug, dk._bwd, dk._bwd_kernel = aug, bwd, bk
    _fb_check(dk, 20, masked_rows=False)              # the derived kernels work
    assert dk.grad_fallback is None
    make = {"CodegenError": lambda: CodegenError("no template for `x` (test)"),
            "FuseError": lambda: af.FuseError("not fusible (test)"),
            "KernelError": lambda: KernelError(bk.kernels[0], RuntimeError("triton: out of resources (test)"))}

    def fail(self, *args, **kw):
        raise make[error]()
    monkeypatch.setattr(BackwardKernel, "__call__", fail)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for seed in (21, 22):
            _fb_check(dk, seed)
    msgs = _grad_warnings(rec)
    assert len(msgs) == 1 and "'fb_norm'" in msgs[0] and error in msgs[0] and "(test)" in msgs[0], msgs
    assert error in dk.grad_fallback


@pytest.mark.parametrize("where", ["derive", "compile"])
def test_backward_not_derivable_or_not_compilable_runs_forward_kernel_and_torch_backward(
        fb_kernels, monkeypatch, where):
    """``af.backward`` refuses the program, or its backward kernels do not compile: the
    forward still runs the acefuse kernel (counted), the gradient is torch autograd of the
    program (float64-exact), with one warning naming the program and why."""
    import acefuse.autograd as aga
    from acefuse.autograd import DifferentiableKernel
    from acefuse.codegen.emit import CodegenError
    prog, kernel, *_ = fb_kernels
    if where == "derive":
        def refuse(p, wrt=None):
            raise af.BackwardError(f"program {p.name!r}: no derivative (test)")
        monkeypatch.setattr(sys.modules["acefuse.backward"], "backward", refuse)
    else:
        def refuse(bwd, **kw):
            raise CodegenError(f"program {bwd.name!r}: no kernel (test)")
        monkeypatch.setattr(aga, "compile_backward", refuse)
    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return kernel(*args, **kw)
    dk = DifferentiableKernel(prog, counted, {})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for seed in (30, 31):
            _fb_check(dk, seed)
        _fb_check(dk, 32, masked_rows=False)
    msgs = _grad_warnings(rec)
    assert len(msgs) == 1 and "'fb_norm'" in msgs[0] and "(test)" in msgs[0], msgs
    assert ("BackwardError" if where == "derive" else "CodegenError") in msgs[0]
    assert len(calls) == 3


def test_torch_fallback_gradient_is_checked(fb_kernels, monkeypatch):
    """The fallback's check can fail: a torch evaluation that computes a wrong value (exp
    replaced by exp(1.01 * x)) gives gradients the float64 comparison rejects."""
    import acefuse.autograd_ref as ref
    from acefuse.autograd import DifferentiableKernel
    prog, kernel, *_ = fb_kernels
    monkeypatch.setattr(sys.modules["acefuse.backward"], "backward",
                        lambda p, wrt=None: (_ for _ in ()).throw(af.BackwardError("no derivative (test)")))
    monkeypatch.setitem(ref._UNARY, "Exp", lambda a: torch.exp(a * 1.01))
    dk = DifferentiableKernel(prog, kernel, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(AssertionError):
            _fb_check(dk, 33, masked_rows=False)


def test_region_backward_failing_at_run_time_falls_back(monkeypatch, fresh_kernels):
    """Through the frontend (af.compile(fn, ...)): a backward kernel failing at .backward()
    gives eager's gradients and one warning; the forward stays acefuse's."""
    from acefuse.codegen.emit import CodegenError
    g = torch.Generator().manual_seed(40)
    x = torch.randn(4, 13, generator=g).requires_grad_()
    w = (torch.rand(13, generator=g) + 0.5).requires_grad_()
    b = torch.randn(13, generator=g).requires_grad_()
    cot = torch.randn(4, 13, generator=g)

    def fail(self, *args, **kw):
        raise CodegenError("no kernel (test)")
    monkeypatch.setattr(BackwardKernel, "__call__", fail)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cf = af.compile(_norm, x, w, b)
        for _ in range(2):
            got = torch.autograd.grad((cf(x, w, b) * cot).sum(), [x, w, b])
    msgs = [str(r.message) for r in rec if issubclass(r.category, AcefuseFallbackWarning)]
    assert len(msgs) == 1 and "CodegenError: no kernel (test)" in msgs[0], msgs
    assert [r.calls["grad"] for r in cf.regions] == [2]
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad((_norm(xd, wd, bd) * cot.double()).sum(), [xd, wd, bd])
    for name, a, r in zip("xwb", got, ref):
        torch.testing.assert_close(a.double(), r, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")


def _rms(x, w):                      # Llama's RMSNorm, float32
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _two_layers(x, w1, w2, W):
    """Two layers' norms: the same computation on other values (a matmul between them)."""
    h = _rms(x, w1) @ W
    return _rms(h, w2)


def test_layers_with_the_same_program_derive_and_compile_it_once(monkeypatch, fresh_kernels):
    """Issue 12's cold compile: regions that differ only in the torch values they read (every
    layer's norm) import as one program (inputs named by position), so its backward is derived
    and its kernels compiled once per process; the second layer reuses them. Gradients of every
    input against float64 eager."""
    derived = []
    real = sys.modules["acefuse.backward"].backward

    def counting(prog, wrt=None):
        derived.append(prog.name)
        return real(prog, wrt=wrt)
    monkeypatch.setattr(sys.modules["acefuse.backward"], "backward", counting)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(3, 16, generator=g).requires_grad_()
    w1, w2 = ((torch.rand(16, generator=g) + 0.5).requires_grad_() for _ in range(2))
    W = (torch.randn(16, 16, generator=g) / 4).requires_grad_()
    cot = torch.randn(3, 16, generator=g)
    cf = af.compile(_two_layers, x, w1, w2, W)
    got = torch.autograd.grad((cf(x, w1, w2, W) * cot).sum(), [x, w1, w2, W])
    r1, r2 = cf.regions
    assert r1.program.key() == r2.program.key(), (r1.program, r2.program)
    assert r1.grad is r2.grad and r1.kernel is r2.kernel
    assert derived == [r1.program.name], derived            # one derivation for both layers
    assert [r.calls["grad"] for r in cf.regions] == [1, 1]
    assert set(r1.imp.labels.values()) != set(r2.imp.labels.values())   # other values, named in labels
    ins = [t.detach().double().requires_grad_() for t in (x, w1, w2, W)]
    ref = torch.autograd.grad((_two_layers(*ins) * cot.double()).sum(), ins)
    for name, a, r in zip(("x", "w1", "w2", "W"), got, ref):
        torch.testing.assert_close(a.double(), r, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")


def test_backward_riders_survive_the_disk_cache(monkeypatch, tmp_path, fresh_kernels):
    """A norm's weight gradient (a sum over rows) rides the pass of the stage over the features
    (codegen/riders.py). A process that loads the stage kernels from the disk index (simulated:
    the in-memory kernels forgotten) gets the hosts' rider modules from the index too, so it runs
    the same passes as the process that compiled them; gradients against float64 eager."""
    from acefuse.proofs import cache as proof_cache
    src = proof_cache.cache_path().parent
    for f in ("proofs.json", "proofs.key"):          # (the rules' proofs are not this test's work)
        if (src / f).exists():
            (tmp_path / f).write_bytes((src / f).read_bytes())
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(31)
    x = torch.randn(5, 24, generator=g).requires_grad_()
    w = (torch.rand(24, generator=g) + 0.5).requires_grad_()
    cot = torch.randn(5, 24, generator=g)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    ref = torch.autograd.grad((_rms(xd, wd) * cot.double()).sum(), [xd, wd])
    riders = []
    for _ in range(2):                                   # compiled, then loaded from disk
        aff.clear_cache()
        hits = aff.stats["kernel_disk_hits"]
        cf = af.compile(_rms, x, w)
        got = torch.autograd.grad((cf(x, w) * cot).sum(), [x, w])
        r, = cf.regions
        bk = r.grad._bwd_kernel
        riders.append((dict(bk._riders), aff.stats["kernel_disk_hits"] > hits))
        for name, a, e in zip("xw", got, ref):
            torch.testing.assert_close(a.double(), e, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
    (first, hit0), (second, hit1) = riders
    assert first and not hit0 and hit1, riders        # the weight gradient rode; the second run loaded
    assert second == first, riders


def test_backward_programs_and_staged_stages_come_from_the_disk_index(monkeypatch, tmp_path, fresh_kernels):
    """Issue 12's warm start, in one process (tests/test_training_cache.py runs two): with the
    in-memory kernels forgotten, a region found in the disk index derives and generates nothing.
    The backward program is read back (``*_backward.json``), each stage's axis (``*_stage.json``)
    and its kernel, the RMSNorm weight gradient's staged kernel (a sum over batch and sequence:
    two modules) included; a program with no kernel of a form (the staged stage over its own axis)
    raises its error again without being fused (``*_failed.json``). Gradients against float64
    eager, both times."""
    from acefuse.proofs import cache as proof_cache
    src = proof_cache.cache_path().parent
    for f in ("proofs.json", "proofs.key"):          # (the rules' proofs are not this test's work)
        if (src / f).exists():
            (tmp_path / f).write_bytes((src / f).read_bytes())
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    calls = {"fuse": 0, "backward": 0, "generated": 0}

    def counting(mod, attr, what):
        f = getattr(sys.modules[mod], attr)

        def wrapped(*a, **k):
            calls[what] += 1
            return f(*a, **k)
        monkeypatch.setattr(sys.modules[mod], attr, wrapped)
    import acefuse.codegen.compile  # noqa: F401
    counting("acefuse.fuse", "fuse", "fuse")
    counting("acefuse.backward", "backward", "backward")
    counting("acefuse.codegen.compile", "cached_source", "generated")
    g = torch.Generator().manual_seed(41)
    x = torch.randn(2, 3, 16, generator=g).requires_grad_()
    w = (torch.rand(16, generator=g) + 0.5).requires_grad_()
    cot = torch.randn(2, 3, 16, generator=g)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    ref = torch.autograd.grad((_rms(xd, wd) * cot.double()).sum(), [xd, wd])
    seen = []
    for _ in range(2):                                   # compiled, then read back from the index
        aff.clear_cache()
        before = dict(calls)
        cf = af.compile(_rms, x, w)
        got = torch.autograd.grad((cf(x, w) * cot).sum(), [x, w])
        r, = cf.regions
        seen.append(({k: calls[k] - before[k] for k in calls}, [type(k).__name__ for k in r.grad._bwd_kernel.kernels]))
        for name, a, e in zip("xw", got, ref):
            torch.testing.assert_close(a.double(), e, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
    (first, kinds0), (second, kinds1) = seen
    assert first["fuse"] and first["backward"] and first["generated"] and "StagedKernel" in kinds0, seen
    assert second == {"fuse": 0, "backward": 0, "generated": 0}, seen
    assert "_LoadedStaged" in kinds1, seen
    # the staged stage's own axis has no kernel (the first process learnt it by fusing): the error
    # comes back from the index, with no fusion
    from acefuse.codegen.emit import CodegenError
    from acefuse.frontend.kernels import get_kernel
    st = next(s for s, k in zip(r.grad._bwd.stages, r.grad._bwd_kernel.kernels) if type(k).__name__ == "_LoadedStaged")
    aff.clear_cache()
    fused = calls["fuse"]
    with pytest.raises(CodegenError, match=st.name):
        get_kernel(st, axis=st.axis)
    assert calls["fuse"] == fused, calls
