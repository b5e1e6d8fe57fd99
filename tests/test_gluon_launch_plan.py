"""The Gluon kernel's launch plan (codegen/contraction_gluon_launch.py ``plan_args``): a later call
with the same input signature reuses the first call's checks, tiles and grid and places its own
operands, fresh outputs and a zeroed work-item counter by position. On the CPU: the arguments a
launch would get, against ``launch_args`` on the same inputs (no launch)."""
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.codegen.contraction_gluon import GluonGen, GluonKernel

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))
D = 64


def _kernel(prog, **kw):
    gen = GluonGen(af.fuse(prog), ws=True, **kw)
    n = gen.name
    return GluonKernel(gen.f, "", type("M", (), {f"{n}_gluon": None, f"{n}_gluon_persistent": None}), gen)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def _same(a, b):
    """Two launches' arguments are the same: equal values, and for tensors the same shape, dtype
    and strides (outputs and counters are fresh per call)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
            assert x.stride() == y.stride()
        else:
            assert x == y


@pytest.mark.parametrize("kw", [dict(), dict(persistent=True, dynamic=True), dict(overlap=True)])
def test_a_kept_plan_places_this_calls_tensors(kw):
    kern = _kernel(EX["causal"], **kw)
    first = dict(q=_x(2, 3, 256, D), k=_x(2, 3, 256, D), v=_x(2, 3, 256, D))
    g1, a1, kw1, o1 = kern.plan_args(first)
    assert len(kern._plans) == 1
    second = dict(q=_x(2, 3, 256, D), k=_x(2, 3, 256, D), v=_x(2, 3, 256, D))
    g2, a2, kw2, o2 = kern.plan_args(second)
    assert len(kern._plans) == 1                      # the same signature: the kept plan
    g3, a3, kw3, o3 = kern.launch_args(second)         # what the checks and choices give afresh
    assert g2 == g3 and kw2 == kw3
    _same(a2, a3)
    for n in ("q", "k", "v"):
        assert any(a is second[n] for a in a2) and not any(a is first[n] for a in a2)
    assert o2["o"] is not o1["o"] and any(a is o2["o"] for a in a2)
    if kw.get("dynamic"):
        assert len(g2) == 1 and a2[-1].tolist() == [0] and a2[-1] is not a1[-1]   # a fresh counter


def test_operands_passed_twice_stay_per_call():
    """A plan made with q, k and v one tensor places three distinct tensors by position later."""
    kern = _kernel(EX["attention"])
    t = _x(1, 2, 128, D)
    kern.plan_args(dict(q=t, k=t, v=t))
    q, k, v = _x(1, 2, 128, D), _x(1, 2, 128, D), _x(1, 2, 128, D)
    _, args, _, _ = kern.plan_args(dict(q=q, k=k, v=v))
    assert len(kern._plans) == 1
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16]
    assert [args[i] is x for i, x in zip(pos, (q, k, v))] == [True, True, True]


def test_another_signature_gets_its_own_plan_and_checks():
    kern = _kernel(EX["attention"])
    kern.plan_args(dict(q=_x(1, 2, 128, D), k=_x(1, 2, 128, D), v=_x(1, 2, 128, D)))
    kern.plan_args(dict(q=_x(1, 2, 200, D), k=_x(1, 2, 128, D), v=_x(1, 2, 128, D)))    # other shapes
    assert len(kern._plans) == 2
    bad = _x(1, 2, 128, D + 4)[..., :D]                                                  # 136-byte rows
    with pytest.raises(ValueError, match="16 bytes"):
        kern.plan_args(dict(q=bad, k=_x(1, 2, 128, D), v=_x(1, 2, 128, D)))
    with pytest.raises(ValueError, match="16-bit"):
        kern.plan_args(dict(q=_x(1, 2, 128, D).float(), k=_x(1, 2, 128, D), v=_x(1, 2, 128, D)))
    assert len(kern._plans) == 2
    # tile options are part of the signature
    kern.plan_args(dict(q=_x(1, 2, 128, D), k=_x(1, 2, 128, D), v=_x(1, 2, 128, D)), BLOCK_J=64)
    assert len(kern._plans) == 3


def _ref64(q, k, v, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) * EX["SCALE"]   # the example's scale (its D is 128)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(), dict(persistent=True, dynamic=True), dict(overlap=True)])
@pytest.mark.parametrize("name", ["attention", "causal"])
def test_gpu_calls_through_a_kept_plan_against_float64(name, kw):
    """On an sm_90 GPU: three calls with one signature (the second and third through the kept
    plan, launched directly: codegen/fastlaunch.py), each on fresh random inputs, each against
    float64; the outputs are distinct tensors, and the dynamic work-item counter starts at zero
    every time (a stale counter would leave rows unwritten)."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("the Gluon kernel needs an sm_90+ GPU")
    from acefuse.codegen.contraction_gluon import compile_gluon
    kern = compile_gluon(EX[name], ws=True, **kw)
    g = torch.Generator(device="cuda").manual_seed(len(name) * 31 + len(kw))
    outs = []
    for _ in range(3):
        x = lambda: torch.randn(2, 3, 512, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v = x(), x(), x()
        o = kern(q=q, k=k, v=v)["o"]
        ref = _ref64(q, k, v, name == "causal")
        assert torch.isfinite(o).all()
        err = ((o.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name} {kw}: relative error {err:.3e} on call {len(outs) + 1}"
        outs.append(o)
    assert len(kern._plans) == 1
    assert len({o.data_ptr() for o in outs}) == 3   # each call's own output
    site = next(iter(kern._plans.values()))[4]
    if site.fast:   # (a checked Triton version) the second and third calls launched directly
        assert site.direct == 2
