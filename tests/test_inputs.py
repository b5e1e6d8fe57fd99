"""Bad input, the CLI, the kernel cache, and gradients never silently dropped.

Every value check compares against an independent float64 computation (acefuse's
numpy reference, or eager torch in float64) on fresh random inputs."""
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import acefuse as af
from acefuse import cli
from acefuse.codegen import compile as cc
from acefuse.frontend.runtime import AcefuseFallbackWarning
from acefuse.reference import evaluate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _softmax_lse(name):
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    e = af.exp(x - m)
    l = af.sum(e, "j")
    return af.program(name, y=e / l, lse=m + af.log(l))


def _logsumexp(name):
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    return af.program(name, out=m + af.log(af.sum(af.exp(x - m), "j")))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


@pytest.fixture(scope="module")
def k_sm():
    """The plain kernel (af.compile wraps it in acefuse.autograd's differentiable kernel)."""
    return cc.compile_program(_softmax_lse("inputs_softmax_lse"))


def _check_ref(prog, out, inputs, tol=2e-5):
    out = out if isinstance(out, dict) else {next(iter(prog.outputs)): out}
    ref = evaluate(prog, {n: t.detach().double() for n, t in inputs.items()})
    for o, r in ref.items():
        got = out[o].detach().double().numpy()
        err = np.max(np.abs(got - r) / np.maximum(np.abs(r), 1.0))
        assert err < tol, f"{o}: max rel err {err:.3e}"


# ---- bad input: extra or doubled inputs, empty axes --------------------------------------------
def test_extra_positional_input_is_an_error(k_sm):
    x = torch.randn(5, 19)
    _check_ref(k_sm.program, k_sm(x), {"x": x})          # one positional input is right
    with pytest.raises(TypeError, match=r"inputs_softmax_lse.*takes 1 input.*\['x'\].*2 positional"):
        k_sm(x, torch.randn(5, 19))
    with pytest.raises(TypeError, match=r"'x' given both by position and by name"):
        k_sm(x, x=x)
    with pytest.raises(TypeError, match=r"has no input\(s\) \['z'\]"):
        k_sm(x=x, z=x)


def test_compiled_function_refuses_extra_arguments():
    def two_rows(x, scale=2.0):
        return torch.softmax(x * scale, -1)

    cf = af.compile(two_rows)          # no example inputs: nothing compiled yet
    with pytest.raises(TypeError, match=r"two_rows\(x, scale=2.0\): too many positional"):
        cf(torch.randn(3, 4), 2.0, torch.randn(3, 4))
    with pytest.raises(TypeError, match=r"two_rows.*unexpected keyword.*bias"):
        cf(torch.randn(3, 4), bias=1.0)


def test_zero_rows_give_empty_outputs_like_torch(k_sm):
    x = torch.randn(0, 23)
    out = k_sm(x)
    for name, want in (("y", torch.softmax(x, -1)), ("lse", torch.logsumexp(x, -1))):
        assert out[name].shape == want.shape and out[name].dtype == want.dtype
    xh = torch.randn(0, 23, dtype=torch.float16)
    assert k_sm(x=xh)["y"].dtype == torch.float16
    # the same kernel on rows is still right (an independent float64 reference)
    x = torch.randn(7, 23) * 3
    _check_ref(k_sm.program, k_sm(x), {"x": x})


def test_empty_reduced_axis_is_refused_naming_axis_and_output(k_sm):
    with pytest.raises(ValueError, match=r"axis \['j'\] is empty.*output 'lse'"):
        k_sm(torch.randn(4, 0))


def test_zero_rows_through_the_torch_frontend():
    def fn(x):
        return torch.softmax(x * 1.5, dim=-1)

    cf = af.compile(fn, torch.randn(4, 30))
    y = cf(torch.randn(0, 30))
    assert y.shape == (0, 30) and y.dtype == torch.float32
    assert all(g.af_regions for g in cf.graphs.values())
    x = torch.randn(6, 30) * 3
    assert torch.allclose(cf(x).double(), fn(x.double()), atol=1e-6, rtol=1e-5)


# ---- gradients are never silently dropped ------------------------------------------------------
def test_plain_kernel_refuses_inputs_that_require_grad(k_sm):
    """The backstop under every differentiable wrapper: a plain kernel never returns a
    result without grad_fn for inputs that require grad."""
    x = (torch.randn(3, 17) * 2).requires_grad_()
    with pytest.raises(cc.NotDifferentiableError, match=r"inputs_softmax_lse.*\['x'\] require grad.*no_grad"):
        k_sm(x)
    with torch.no_grad():           # inference on a parameter-like tensor is fine
        out = k_sm(x)
    _check_ref(k_sm.program, out, {"x": x})


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(24, 24), nn.Linear(24, 24)
        self.ln = nn.LayerNorm(24)

    def forward(self, x):
        h = self.lin2(self.ln(self.lin(x)))
        return torch.softmax(h, -1) * torch.logsumexp(h, -1, keepdim=True)


def _grads(model, x, w, prefix=""):
    model.zero_grad()
    (model(x) * w).sum().backward()
    return {n.replace(prefix, ""): p.grad for n, p in model.named_parameters()}


def _grad_setup():
    torch.manual_seed(1)
    net = _Net()
    with torch.no_grad():
        net.ln.weight.uniform_(0.5, 1.5)
        net.ln.bias.normal_()
    x, w = torch.randn(5, 24) * 2, torch.randn(5, 24)
    ref_net = _Net().double()
    ref_net.load_state_dict({k: v.double() for k, v in net.state_dict().items()})
    ref = _grads(ref_net, x.double(), w.double())
    return net, x, w, ref


def _assert_grads(got, ref):
    assert set(got) == set(ref)
    for n, r in ref.items():
        assert got[n] is not None, f"{n} got no gradient"
        assert torch.allclose(got[n].double(), r, rtol=1e-4, atol=1e-5), n


def _fallbacks(rec):
    return [str(r.message) for r in rec if issubclass(r.category, AcefuseFallbackWarning)]


def _grad_calls(regions):
    return sorted((r.program.name.split("_", 1)[1], r.calls["grad"]) for r in regions)


def test_torch_compile_backend_trains_with_differentiable_kernels():
    """Training through the backend: the regions run acefuse's differentiable kernels
    (no fallback), and every parameter gets float64 eager's gradient."""
    torch._dynamo.reset()
    net, x, w, ref = _grad_setup()
    graphs = []

    def backend(gm, ex):
        graphs.append(af.backend(gm, ex))
        return graphs[-1]

    cm = torch.compile(net, backend=backend)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            _assert_grads(_grads(cm, x, w, prefix="_orig_mod."), ref)
    assert _fallbacks(rec) == []
    assert _grad_calls(r for g in graphs for r in g.regions) == [("layer_norm", 2), ("softmax", 2)]


def test_compiled_function_trains_and_infers_with_kernels():
    net, x, w, ref = _grad_setup()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cf = af.compile(net, x)
        for _ in range(2):
            net.zero_grad()
            y = cf(x)
            assert y.grad_fn is not None
            (y * w).sum().backward()
            _assert_grads({n: p.grad for n, p in net.named_parameters()}, ref)
    assert _fallbacks(rec) == []
    assert _grad_calls(cf.graph_for(x).af_regions) == [("layer_norm", 2), ("softmax", 2)]
    with torch.no_grad():       # inference: the plain kernels run
        y = cf(x)
        g = cf.graph_for(x)
    assert y.grad_fn is None
    assert g.af_regions and all(r.calls == {"kernel": 1, "grad": 0, "torch": 0} for r in g.af_regions)
    ref_y = _Net().double()
    ref_y.load_state_dict({k: v.double() for k, v in net.state_dict().items()})
    assert torch.allclose(y.double(), ref_y(x.double()), rtol=1e-4, atol=1e-5)


# ---- the kernel cache --------------------------------------------------------------------------
_PROBE = textwrap.dedent("""
    import hashlib, sys
    import acefuse as af
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    k = af.compile(af.program("cache_probe", out=m + af.log(af.sum(af.exp(x - m), "j"))))
    print(k.path, hashlib.sha256(k.source.encode()).hexdigest())
""")


def test_same_program_in_fresh_processes_gives_identical_source_and_one_file(cache):
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONHASHSEED=seed, ACEFUSE_CACHE_DIR=str(cache.parent)))
             for seed in ("1", "2")]      # at once: both write the same entry (atomically)
    runs = []
    for pr in procs:
        out, err = pr.communicate(timeout=600)
        assert pr.returncode == 0, err[-2000:]
        runs.append(out.split())
    assert runs[0] == runs[1]
    assert [p.name for p in cache.glob("cache_probe_*")] == [Path(runs[0][0]).name]
    text = Path(runs[0][0]).read_text()
    # no timing in the source (a duration like "12.3 ms" would differ between runs)
    assert not re.search(r"\d ms\b", text) and "saturation stopped" in text


def test_explain_keeps_timings_on_request():
    f = af.fuse(_logsumexp("timing_probe"))
    assert "saturation stopped" in f.explain(chains=False) and " ms" not in f.explain(chains=False)
    assert " ms" in f.explain(chains=False, timings=True)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_cache_entry_is_detected_warned_and_regenerated(cache, damage):
    prog = _logsumexp("corrupt_probe")
    k = af.compile(prog)
    good = k.path.read_bytes()
    k.path.write_bytes(good[: len(good) // 3] if damage == "truncate" else b"\x00\xff garbage \x9c" * 40)
    with pytest.warns(cc.CacheWarning, match="corrupt.*regenerated"):
        k2 = af.compile(prog)
    assert k2.path == k.path and k2.path.read_bytes() == good
    assert len(list(cache.glob("corrupt_probe_*"))) == 1
    x = torch.randn(9, 41) * 4
    _check_ref(prog, k2(x), {"x": x})


def test_corrupt_frontend_index_is_detected_and_regenerated(cache):
    from acefuse.frontend import runtime

    def lse(x):
        return torch.logsumexp(x * 2.0, -1)

    x = torch.randn(6, 33)
    af.compile(lse, x)
    index = list((cache.parent / "frontend").glob("*.json"))
    assert len(index) == 1
    meta = json.loads(index[0].read_text())
    assert meta["sha256"] == hashlib.sha256(Path(meta["path"]).read_bytes()).hexdigest()
    Path(meta["path"]).write_bytes(Path(meta["path"]).read_bytes()[:100])      # truncated kernel
    runtime.clear_cache()
    with pytest.warns(Warning, match="corrupt|unusable"):
        cf = af.compile(lse, x)
    assert cf.regions and cf.regions[0].kernel is not None
    assert torch.allclose(cf(x).double(), torch.logsumexp(x.double() * 2.0, -1), atol=1e-5, rtol=1e-5)
    index[0].write_text('{"path": ')                                           # truncated index
    runtime.clear_cache()
    with pytest.warns(cc.CacheWarning, match="unusable"):
        cf = af.compile(lse, x)
    assert torch.allclose(cf(x).double(), torch.logsumexp(x.double() * 2.0, -1), atol=1e-5, rtol=1e-5)


# ---- the CLI -----------------------------------------------------------------------------------
def test_sizes_naming_an_unknown_axis_is_an_error():
    with pytest.raises(SystemExit, match=r"axis 'z'.*softmax: r j"):
        cli.main(["run", str(EXAMPLES / "softmax.py"), "--sizes", "z=5"])
    with pytest.raises(SystemExit, match=r"lengths >= 1"):
        cli.main(["run", str(EXAMPLES / "softmax.py"), "--sizes", "j=0"])


def test_default_sizes_fit_the_budget_and_keep_user_sizes():
    import runpy
    ns = runpy.run_path(str(EXAMPLES / "attention.py"))
    for name in ("attention", "gqa"):
        p = ns[name]
        s = cli.default_sizes(p, "j", {}, "cpu")
        assert int(np.prod(list(s.values()))) <= cli.SIZE_BUDGET["cpu"], s
        assert s["j"] >= cli.MIN_FUSED and min(s.values()) >= cli.MIN_OTHER
        assert cli.default_sizes(p, "j", {"d": 64}, "cpu")["d"] == 64
    sm = _softmax_lse("sizes_probe")
    assert cli.default_sizes(sm, "j", {}, "cpu") == {"r": 37, "j": 1000}


def test_broken_pipe_ends_quietly():
    r, w = os.pipe()
    os.close(r)                     # the reader is gone before the first write (``| head``)
    try:
        p = subprocess.run([sys.executable, "-m", "acefuse", "prove", str(EXAMPLES / "user_rule.py")],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=600, cwd=ROOT)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_broken_pipe_in_process(monkeypatch):
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert cli.main(["run", str(EXAMPLES / "softmax.py"), "--sizes", "r=3,j=40"]) == 1


def test_run_and_derive_use_the_files_rules(tmp_path, capsys):
    """examples/user_rule.py: renyi2 needs its RULES to fuse; ``run`` must use them and
    match the float64 reference."""
    assert cli.main(["run", str(EXAMPLES / "user_rule.py"), "--check", "--sizes", "r=5,j=37"]) == 0
    out = capsys.readouterr().out
    assert "renyi2: fusible" in out and "PASS" in out and "FAIL" not in out
    fuse_mod = sys.modules["acefuse.fuse"]    # (``acefuse.fuse`` the attribute is af.fuse)
    seen = []

    class _F:
        def explain(self, timings=False):
            return "stub"

    def fake_fuse(prog, axis=None, rules=()):
        seen.append([r.name for r in rules])
        return _F()

    orig = fuse_mod.fuse
    fuse_mod.fuse = fake_fuse
    try:
        assert cli.main(["derive", str(EXAMPLES / "user_rule.py")]) == 0
    finally:
        fuse_mod.fuse = orig
    assert seen == [["mul-assoc-right-to-left"]]
    bad = tmp_path / "bad_rules.py"
    bad.write_text((EXAMPLES / "user_rule.py").read_text() + "\nRULES = ['not a rule']\n")
    with pytest.raises(SystemExit, match="RULES must list Rule objects"):
        cli.main(["derive", str(bad)])


def test_a_0d_condition_joined_with_a_vector_one():
    """``(x > 0.5) & (s > 0)`` with ``s`` 0-d: Triton's interpreter has no bitwise and/or of a
    vector bool and a 0-d one (a TypeError; the gradient fuzz's pre-stage over saved 0-d values
    crashed on it), so such conditions go through int32. Both branches of the 0-d condition,
    against float64 torch."""
    import torch
    x, s = af.tensor("x", "r j"), af.tensor("s0d", "")
    prog = af.program("and_or_0d", y=af.sum(af.where((x > 0.5) & (s > 0.0), x, 0.0 * x), "j"),
                      z=af.sum(af.where((x > 0.5) | (s > 0.0), x, 0.0 * x), "j"))
    k = af.compile(prog)
    X = torch.randn(5, 33, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    for sv in (1.0, -1.0):
        S = torch.tensor(sv, dtype=torch.float64)
        out = k(x=X.float(), s0d=S.float())
        ry = torch.where((X > 0.5) & (S > 0), X, 0.0).sum(-1)
        rz = torch.where((X > 0.5) | (S > 0), X, 0.0).sum(-1)
        assert torch.allclose(out["y"].double(), ry, atol=1e-5, rtol=1e-5)
        assert torch.allclose(out["z"].double(), rz, atol=1e-5, rtol=1e-5)


def test_run_checks_a_top_k_program(tmp_path, capsys):
    """``run --check`` on a program with a top-k: the kernel writes each stacked output as one
    [t, k] tensor, and the float64 reference is stacked the same way before comparing (it
    raised KeyError: 'weights' when only the kernel's outputs were stacked)."""
    f = tmp_path / "route.py"
    f.write_text("import acefuse as af\n"
                 "x = af.tensor('x', 't e')\n"
                 "p = af.exp(x - af.max(x, 'e'))\n"
                 "vals, idx = af.topk(p / af.sum(p, 'e'), 2, 'e')\n"
                 "route = af.program('route', weights=vals / vals.sum(), experts=idx)\n")
    assert cli.main(["run", str(f), "--check", "--sizes", "t=7,e=13"]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "experts" in out and "FAIL" not in out
