"""The sum-kernel launcher's launch plans (codegen/sums_launch.py): a call by name whose inputs
have the shapes, strides, dtypes, devices and 16-byte alignment of an earlier call's, with the
same options, reuses that call's plan; any of those changed makes a new one; the results stay
right against float64 with fresh random inputs either way. The plan's kernel launches through
a Site (codegen/fastlaunch.py): never directly under Triton's interpreter; on a GPU (marked)
the direct launch is bit for bit the JIT launch's (ACEFUSE_FAST_LAUNCH=0's)."""
import random

import pytest
import torch

import acefuse as af
from acefuse.codegen import fastlaunch as fl

SCALE = 0.125


def _programs():
    """dQ and dK/dV of causal attention, as a derived backward stage takes them (sums over keys
    of a contraction-built tile times a key vector; two sums over queries)."""
    q = af.tensor("q", "b h i d")
    k = af.tensor("k", "b h j d")
    v = af.tensor("v", "b h j e")
    go = af.tensor("go", "b h i e")
    m = af.tensor("m", "b h i")
    dd = af.tensor("dd", "b h i")
    lse = af.tensor("l", "b h i")
    i, j = af.index("i"), af.index("j")
    s = af.where(j <= i, af.sum(q * k, "d") * SCALE, af.NEG_INF)
    p = af.exp(s - m) / lse
    ds = p * (af.sum(go * v, "e") - dd) * SCALE
    dq = af.program("plans_dq", grad_q=af.sum(ds * k, "j"))
    dkv = af.program("plans_dkv", grad_k=af.sum(ds * q, "i"), grad_v=af.sum(p * go, "i"))
    return dq, dkv


_KERNELS = {}


def _kernel(which):
    if not _KERNELS:
        dq, dkv = _programs()
        _KERNELS["dq"] = af.compile(dq, axis="j")
        _KERNELS["dkv"] = af.compile(dkv, axis="i")
    return _KERNELS[which]


def _inputs(g, ni, nj, dk, de, dtype=torch.float32, device="cpu"):
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = r(1, 2, ni, dk), r(1, 2, nj, dk)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * SCALE
    m = s.amax(-1) + r(1, 2, ni).abs()   # a shift at least the row's max: exp stays <= 1
    ins = {"q": q, "k": k, "v": r(1, 2, nj, de), "go": r(1, 2, ni, de), "m": m, "dd": r(1, 2, ni),
           "l": 0.5 + torch.rand(1, 2, ni, generator=g, dtype=torch.float64)}
    return {n: x.to(device=device, dtype=dtype) for n, x in ins.items()}


def _reference(ins):
    d = {n: x.double().cpu() for n, x in ins.items()}
    ni, nj = d["q"].shape[2], d["k"].shape[2]
    s = torch.einsum("bhid,bhjd->bhij", d["q"], d["k"]) * SCALE
    i, j = torch.arange(ni)[:, None], torch.arange(nj)[None, :]
    p = torch.where(j <= i, torch.exp(s - d["m"][..., None]), 0.0) / d["l"][..., None]
    ds = p * (torch.einsum("bhie,bhje->bhij", d["go"], d["v"]) - d["dd"][..., None]) * SCALE
    return {"grad_q": torch.einsum("bhij,bhjd->bhid", ds, d["k"]),
            "grad_k": torch.einsum("bhij,bhid->bhjd", ds, d["q"]),
            "grad_v": torch.einsum("bhij,bhie->bhje", p, d["go"])}


def _check(got, ins, names, tol=2e-5):
    ref = _reference(ins)
    if not isinstance(got, dict):
        got = {names[0]: got}
    for n in names:
        r = ref[n]
        err = (got[n].double().cpu() - r).abs().max().item()
        assert err <= tol * (1 + r.abs().max().item()), f"{n}: max error {err:.3e}"


def _count_plans(mod, monkeypatch):
    made = []
    real = mod._plan

    def plan(*a, **kw):
        made.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(mod, "_plan", plan)
    return made


def _gen():
    return torch.Generator().manual_seed(random.randrange(2 ** 31))


def test_a_second_call_with_the_same_signature_reuses_the_plan(monkeypatch):
    mod = _kernel("dkv").module
    mod._PLANS.clear()
    made = _count_plans(mod, monkeypatch)
    g = _gen()
    ni, nj = random.randint(20, 50), random.randint(20, 50)
    for _ in range(3):   # fresh values each call, same shapes: one plan, right every time
        ins = _inputs(g, ni, nj, 16, 12)
        _check(_kernel("dkv")(**ins), ins, ["grad_k", "grad_v"])
    assert len(made) == 1 and len(mod._PLANS) == 1
    (plan,) = mod._PLANS.values()
    site = plan.sites["sum"]
    assert site.fast is False and site.direct == 0   # the interpreter: Triton's JIT launches it


def test_a_changed_stride_dtype_shape_alignment_or_option_makes_a_new_plan(monkeypatch):
    mod = _kernel("dq").module
    mod._PLANS.clear()
    made = _count_plans(mod, monkeypatch)
    g = _gen()
    ni, nj, dk = random.randint(20, 40), random.randint(20, 40), 16
    ins = _inputs(g, ni, nj, dk, 16)
    _check(mod.run(**ins), ins, ["grad_q"])
    assert len(made) == 1
    # strides: q laid out [b h d i] and read through a transposed view (same shape)
    ins = _inputs(g, ni, nj, dk, 16)
    ins["q"] = ins["q"].transpose(2, 3).contiguous().transpose(2, 3)
    _check(mod.run(**ins), ins, ["grad_q"])
    assert len(made) == 2
    # a dtype
    ins = _inputs(g, ni, nj, dk, 16, dtype=torch.float16)
    _check(mod.run(**ins), ins, ["grad_q"], tol=5e-3)
    assert len(made) == 3
    # a shape (another key length)
    ins = _inputs(g, ni, nj + 3, dk, 16)
    _check(mod.run(**ins), ins, ["grad_q"])
    assert len(made) == 4
    # alignment: k starting one element into its buffer (same shape, strides, dtype)
    ins = _inputs(g, ni, nj, dk, 16)
    buf = torch.empty(ins["k"].numel() + 1)
    ins["k"] = buf[1:].view(ins["k"].shape).copy_(ins["k"])
    assert ins["k"].data_ptr() % 16
    _check(mod.run(**ins), ins, ["grad_q"])
    assert len(made) == 5
    # a launch option
    ins = _inputs(g, ni, nj, dk, 16)
    _check(mod.run(**ins, block_j=32), ins, ["grad_q"])
    assert len(made) == 6
    # each of those again: the plans made above, no new one
    ins = _inputs(g, ni, nj, dk, 16)
    _check(mod.run(**ins, block_j=32), ins, ["grad_q"])
    _check(mod.run(**ins), ins, ["grad_q"])
    assert len(made) == 6 and len(mod._PLANS) == 6
    # positional inputs: checked in full each time, no plan kept
    ins = _inputs(g, ni, nj, dk, 16)
    _check(mod.run(*[ins[t] for t in mod.TENSORS]), ins, ["grad_q"])
    assert len(made) == 7 and len(mod._PLANS) == 6


def test_a_reused_plan_still_refuses_bad_input():
    """A call that does not match a plan (a missing input, an extra one, a wrong rank) gets
    the full checks and their errors."""
    mod = _kernel("dq").module
    g = _gen()
    ins = _inputs(g, 24, 24, 16, 16)
    mod.run(**ins)
    bad = dict(ins)
    bad.pop("dd")
    with pytest.raises(TypeError, match="needs inputs"):
        mod.run(**bad)
    with pytest.raises(ValueError, match="dimensions"):
        mod.run(**dict(ins, dd=ins["dd"][..., None]))
    with pytest.raises(ValueError, match="schedule"):
        mod.run(**ins, schedule="split")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_direct_launch_of_a_sum_kernel_is_bit_identical_to_the_jit_launch():
    """bfloat16 dK/dV on the GPU: the first call compiles through Triton's JIT, later calls with
    the plan's signature launch the compiled kernel directly (where this Triton is one the
    direct launch checked); each output is equal, bit for bit, to the JIT launch's
    (set_enabled(False)) on the same inputs, and right against float64."""
    mod = _kernel("dkv").module
    g = torch.Generator().manual_seed(random.randrange(2 ** 31))
    try:
        for ni, nj in ((300, 257), (129, 1000)):
            ins = _inputs(g, ni, nj, 64, 64, dtype=torch.bfloat16, device="cuda")
            opts = dict(block_i=64, block_j=64, num_warps=4, num_stages=2)
            fl.set_enabled(True)
            first = mod.run(**ins, **opts)
            direct = mod.run(**ins, **opts)
            fl.set_enabled(False)
            jit = mod.run(**ins, **opts)
            for n in ("grad_k", "grad_v"):
                assert torch.equal(direct[n], jit[n]) and torch.equal(first[n], jit[n]), n
            _check(direct, ins, ["grad_k", "grad_v"], tol=2e-2)
            sites = [p.sites["sum"] for p in mod._PLANS.values() if "sum" in p.sites]
            if fl.fast_ok(sites[0].fn):
                assert sum(s.direct for s in sites) > 0
    finally:
        fl.set_enabled(True)


def test_riders_plan_reused_with_fresh_buffers_each_call():
    """Causal attention's backward through af.compile: the pass over queries (dK, dV) carries dQ
    as a rider (float32 buffers every program adds into). Calls with fresh inputs of the same
    shapes reuse that kernel's plan; each call's buffers start at zero (a reused buffer would
    add the previous call's dQ in), checked against float64 torch autograd."""
    import math
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import attention as A

    kern = af.compile(A.causal)
    g = _gen()
    n, d = random.randint(20, 40), 16
    host_mods = []
    for call in range(3):
        ins = {x: torch.randn(1, 2, n, d, generator=g) for x in "qkv"}
        cot = torch.randn(1, 2, n, d, generator=g)
        leaves = {x: t.clone().requires_grad_() for x, t in ins.items()}
        kern(**leaves).backward(cot)
        ref = {x: t.double().requires_grad_() for x, t in ins.items()}
        s = ref["q"] @ ref["k"].transpose(-1, -2) * A.SCALE
        s = torch.where(torch.arange(n)[None, :] <= torch.arange(n)[:, None], s, -math.inf)
        (torch.softmax(s, -1) @ ref["v"]).backward(cot.double())
        for x in "qkv":
            err = (leaves[x].grad.double() - ref[x].grad).abs().max().item()
            assert err <= 2e-5 * (1 + ref[x].grad.abs().max().item()), f"call {call}: grad {x}: max error {err:.3e}"
        if not host_mods:
            bk = kern._bwd_kernel
            host_mods = [bk.kernels[h].module for h in set(bk._riders.values())]
            assert host_mods, "the stage of sums over keys should ride the pass over queries"
    for m in host_mods:
        ride = [p for p in m._PLANS.values() if p.ride]
        assert len(ride) == 1, f"{m.PROGRAM}: one riders plan, reused ({len(m._PLANS)} plans)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_riders_launch_directly_on_the_gpu():
    """Causal attention's backward (bf16) on the GPU, three steps with fresh inputs: gradients
    against float64 every step; the riding kernel's launches after the first are direct where
    this Triton is one the direct launch checked (on a Hopper GPU with its TMA descriptors:
    keyed by all but their base's address). Atomic adds: not compared bit for bit."""
    import math
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import attention as A

    kern = af.compile(A.causal)
    g = torch.Generator().manual_seed(random.randrange(2 ** 31))
    n, d = 200 + random.randint(0, 99), 64
    for step in range(3):
        ins = {x: torch.randn(1, 4, n, d, generator=g).to("cuda", torch.bfloat16) for x in "qkv"}
        cot = torch.randn(1, 4, n, d, generator=g).to("cuda", torch.bfloat16)
        leaves = {x: t.clone().requires_grad_() for x, t in ins.items()}
        kern(**leaves).backward(cot)
        ref = {x: t.double().requires_grad_() for x, t in ins.items()}
        s = ref["q"] @ ref["k"].transpose(-1, -2) * A.SCALE
        ar = torch.arange(n, device="cuda")
        s = torch.where(ar[None, :] <= ar[:, None], s, -math.inf)
        (torch.softmax(s, -1) @ ref["v"]).backward(cot.double())
        for x in "qkv":
            got, r = leaves[x].grad.double(), ref[x].grad
            rel = ((got - r).norm() / r.norm()).item()
            assert rel < 2e-2, f"step {step}: grad {x}: relative error {rel:.3e}"
    bk = kern._bwd_kernel
    for h in set(bk._riders.values()):
        m = bk.kernels[h].module
        sites = [p.sites["sum"] for p in m._PLANS.values() if p.ride and "sum" in p.sites]
        if sites and fl.fast_ok(sites[0].fn):
            assert sum(s.direct for s in sites) > 0, f"{m.PROGRAM}: no direct launch (tma {[p.tma for p in m._PLANS.values()]})"
