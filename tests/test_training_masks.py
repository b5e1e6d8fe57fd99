"""Training with tensors over query *and* key positions (issue 11/12): an additive bias or a
boolean mask declared over ``i j`` (SDPA's ``attn_mask``), through ``af.compile(prog)`` and the
torch frontend, then ``.backward()``.

The backward's sum kernels (codegen/sums.py) read such a tensor as a [query tile, key tile]
block (grid axes from the tensors that carry a contracted axis, rows = the output axes left),
and a bias's gradient dS, elementwise over (i, j), is a tile output of dQ's loop over keys
(it shares every contraction with dQ). Inputs that do not require grad (a mask, a constant
built in the graph) get no gradient and cost nothing (``af.backward(prog, wrt=...)``).

Every gradient is compared with float64 torch autograd of the plain math, fresh random inputs,
odd sizes (L != S), explicit tolerances; the comparison is shown to fail on a wrong gradient.
Float32 kernels on the CPU (Triton's interpreter), tiny sizes.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import acefuse as af
from acefuse.backward import backward, BackwardError
from acefuse.frontend.runtime import AcefuseFallbackWarning

D = 8
SCALE = 1.0 / math.sqrt(D)
RTOL, ATOL = 2e-5, 2e-5      # float32 kernels vs float64 torch (gradients are O(1))

q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
bias = af.tensor("bias", "b h i j")      # learned bias / float attn_mask over (query, key)
keep = af.tensor("keep", "b i j")        # boolean attn_mask, broadcast over heads
i, j = af.index("i"), af.index("j")
score = af.sum(q * k, "d") * SCALE


def _attend(name, s, vv=v):
    m = af.max(s, "j")
    p = af.exp(s - m)
    return af.program(name, o=af.sum(p * vv, "j") / af.sum(p, "j"))


PROGRAMS = {
    "bias": lambda: _attend("t_bias", score + bias),
    "causal_bias": lambda: _attend("t_causal_bias", af.where(j <= i, score + bias, af.NEG_INF)),
    "keep": lambda: _attend("t_keep", af.where(keep, score, af.NEG_INF)),
    "causal_keep_bias": lambda: _attend("t_causal_keep_bias", af.where(
        j <= i, af.where(keep, score + bias, af.NEG_INF), af.NEG_INF)),
}
_KERNELS: dict = {}


def _kernel(name):
    if name not in _KERNELS:
        _KERNELS[name] = af.compile(PROGRAMS[name]())
    return _KERNELS[name]


def _inputs(seed, B=1, H=2, L=11, S=13, masked_row=False):
    g = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, H, L, D, generator=g, dtype=torch.float64) * 1.5,
         "k": torch.randn(B, H, S, D, generator=g, dtype=torch.float64) * 1.5,
         "v": torch.randn(B, H, S, D, generator=g, dtype=torch.float64),
         "bias": torch.randn(B, H, L, S, generator=g, dtype=torch.float64)}
    kp = torch.rand(B, L, S, generator=g) < 0.6
    kp[..., 0] = True                    # every query sees key 0 ...
    if masked_row:
        kp[:, 3] = False                 # ... but query 3, which sees no key (o = 0, gradient 0)
    x["keep"] = kp
    return x, torch.randn(B, H, L, D, generator=g, dtype=torch.float64)


def _reference(name, x, cot, wrt):
    """float64 torch autograd of the plain math. A query that sees no key gives 0 (the README's
    convention, and SDPA's): the max is taken as 0 there and 0/0 reads 0."""
    leaves = {n: (t.clone().requires_grad_(n in wrt) if t.dtype == torch.float64 else t) for n, t in x.items()}
    s = leaves["q"] @ leaves["k"].transpose(-1, -2) * SCALE
    if "bias" in name:
        s = s + leaves["bias"]
    L, S = s.shape[-2:]
    vis = torch.ones(L, S, dtype=torch.bool)
    if "causal" in name:
        vis = torch.arange(S)[None, :] <= torch.arange(L)[:, None]
    if "keep" in name:
        vis = vis & x["keep"][:, None]
    s = torch.where(vis, s, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    l = p.sum(-1, keepdim=True)
    o = (p @ leaves["v"]) / torch.where(l == 0, 1.0, l)
    o.backward(cot)
    return {n: leaves[n].grad for n in wrt}


def _close(got, ref, what, rtol=RTOL, atol=ATOL):
    assert got is not None, f"{what}: no gradient"
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite gradient"
    err = ((got.double() - ref).abs() - (atol * max(1.0, ref.abs().max().item()) + rtol * ref.abs())).max().item()
    assert err <= 0, f"{what}: max excess error {err:.3e}"


def _run(name, x, cot, wrt):
    prog = PROGRAMS[name]()
    leaves = {n: (x[n].float().requires_grad_(n in wrt) if x[n].dtype == torch.float64 else x[n])
              for n in prog.tensors}
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)   # no fallback: derived kernels only
        o = _kernel(name)(**leaves)
        assert o.grad_fn is not None
        o.backward(cot.float())
    return {n: leaves[n].grad for n in wrt}


@pytest.mark.parametrize("name,wrt", [
    ("bias", ("q", "k", "v", "bias")),
    ("causal_bias", ("q", "k", "v", "bias")),
    ("causal_bias", ("q", "k", "v")),          # the bias is a mask: it gets no gradient
    ("keep", ("q", "k", "v")),
    ("causal_keep_bias", ("q", "v", "bias")),
])
def test_gradients_with_tensors_over_queries_and_keys_match_float64(name, wrt):
    x, cot = _inputs(hash((name, wrt)) % 1000)
    got = _run(name, x, cot, wrt)
    ref = _reference(name, x, cot, wrt)
    for n in wrt:
        assert ref[n].abs().max() > 1e-2, "the reference gradient must not be trivially small"
        _close(got[n], ref[n], f"{name}: grad_{n}")


def test_query_that_sees_no_key_gets_zero_gradient_never_nan():
    x, cot = _inputs(17, masked_row=True)
    wrt = ("q", "k", "v", "bias")
    got = _run("causal_keep_bias", x, cot, wrt)
    ref = _reference("causal_keep_bias", x, cot, wrt)
    assert (got["q"][:, :, 3] == 0).all() and (got["bias"][:, :, 3] == 0).all()
    for n in wrt:
        _close(got[n], ref[n], f"masked row: grad_{n}")


def test_checker_fails_on_a_wrong_gradient():
    """The comparison above is not vacuous: a slightly wrong dS, or the gradient of another
    mask, fails it."""
    x, cot = _inputs(5)
    wrt = ("q", "k", "v", "bias")
    got = _run("causal_bias", x, cot, wrt)
    ref = _reference("causal_bias", x, cot, wrt)
    with pytest.raises(AssertionError):
        _close(got["bias"] * (1 + 1e-3), ref["bias"], "perturbed")
    with pytest.raises(AssertionError):
        _close(got["k"], _reference("bias", x, cot, wrt)["k"], "causal vs global")


def test_bias_gradient_is_a_tile_output_of_the_key_loop():
    """Derived, not templated: dS (the bias's gradient) shares every contraction with dQ, so it
    is stored from dQ's loop over key tiles; the causal mask's skipped tiles are zeroed by the
    launcher, and the bias is read as [query tile, key tile] blocks in both stages."""
    bwd = backward(PROGRAMS["causal_bias"]())
    # D_i = sum_e(grad_o * o) comes from a pre-stage (backward._hoist); no N x N value is hoisted
    assert {s.axis: sorted(s.outputs) for s in bwd.stages} == {"e": ["pre1"], "j": ["grad_bias", "grad_q"],
                                                              "i": ["grad_k", "grad_v"]}
    assert bwd.intermediates == {"pre1": ("b", "h", "i")}
    dk = _kernel("causal_bias")
    x, cot = _inputs(3)
    _run("causal_bias", x, cot, ("q", "k", "v", "bias"))
    bk = dk._for(frozenset("qkv") | {"bias"}, frozenset("qkv") | {"bias"})._bwd_kernel
    src_j, src_i = (kk.source for st, kk in zip(bk.program.stages, bk.kernels) if st.axis in ("j", "i"))
    assert "tl.store(grad_bias_ptr" in src_j.split("for start in range(first, end, BLOCK_J):")[1]
    assert "ZERO_TILE_OUTPUTS = True" in src_j and "are skipped" in src_j
    for src in (src_j, src_i):
        assert "bias_ptr + off_bias_g + off_bias_r" in src


def test_backward_for_the_inputs_that_require_grad_only():
    """af.backward(prog, wrt=...): a mask or a constant gets no gradient output and no work."""
    prog = PROGRAMS["causal_bias"]()
    full, part = backward(prog), backward(prog, wrt=["q", "v"])
    assert set(full.grads) == {"q", "k", "v", "bias"}
    assert set(part.grads) == {"q", "v"} and set(part.outputs) == {"grad_q", "grad_v"}
    assert not part.zero_grads
    with pytest.raises(BackwardError, match="not inputs of the program"):
        backward(prog, wrt=["nope"])


def test_gqa_with_a_bias_and_a_boolean_mask():
    """Grouped heads (q "b g r i d" over k/v "b g j d"): dK/dV also sum over the group members."""
    qg, kg, vg = af.tensor("q", "b g r i d"), af.tensor("k", "b g j d"), af.tensor("v", "b g j e")
    bg = af.tensor("bias", "b g r i j")
    s = af.where(keep, af.sum(qg * kg, "d") * SCALE + bg, af.NEG_INF)
    m = af.max(s, "j")
    p = af.exp(s - m)
    prog = af.program("t_gqa_bias", o=af.sum(p * vg, "j") / af.sum(p, "j"))
    g = torch.Generator().manual_seed(23)
    B, G, R, L, S = 1, 2, 2, 7, 9
    x = {"q": torch.randn(B, G, R, L, D, generator=g, dtype=torch.float64),
         "k": torch.randn(B, G, S, D, generator=g, dtype=torch.float64),
         "v": torch.randn(B, G, S, D, generator=g, dtype=torch.float64),
         "bias": torch.randn(B, G, R, L, S, generator=g, dtype=torch.float64)}
    kp = torch.rand(B, L, S, generator=g) < 0.6
    kp[..., 0] = True
    cot = torch.randn(B, G, R, L, D, generator=g, dtype=torch.float64)
    leaves = {n: t.float().requires_grad_() for n, t in x.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        af.compile(prog)(**leaves, keep=kp).backward(cot.float())
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    sc = torch.einsum("bgrid,bgjd->bgrij", ref["q"], ref["k"]) * SCALE + ref["bias"]
    sc = sc.masked_fill(~kp[:, None, None], -math.inf)
    torch.einsum("bgrij,bgje->bgrie", torch.softmax(sc, -1), ref["v"]).backward(cot)
    for n in x:
        _close(leaves[n].grad, ref[n].grad, f"gqa: grad_{n}")


# ---- through the torch frontend: SDPA's attn_mask ------------------------------------------------
B, H, L, S = 2, 2, 5, 7


def _sdpa(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _sdpa_causal(q, k, v, m):     # a mask and is_causal together (L <= S: torch's top-left causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)


MASKS = {
    "bool[L,S]": lambda g: torch.rand(L, S, generator=g) < 0.6,
    "additive[B,1,L,S]": lambda g: torch.randn(B, 1, L, S, generator=g, dtype=torch.float64),
    "additive[B,H,L,S]": lambda g: torch.randn(B, H, L, S, generator=g, dtype=torch.float64),
}


FAST_SDPA = {("bool[L,S]", "mask+causal"), ("additive[B,1,L,S]", "mask")}   # the rest: -m slow
SDPA_CASES = [pytest.param(fn, mask, id=f"{mask}-{fid}",
                           marks=() if (mask, fid) in FAST_SDPA else pytest.mark.slow)
              for mask in MASKS for fn, fid in ((_sdpa, "mask"), (_sdpa_causal, "mask+causal"))]


@pytest.mark.parametrize("fn,mask", SDPA_CASES)
def test_sdpa_with_attn_mask_trains_with_derived_kernels(fn, mask):
    """Training through af.compile(fn): the attention with its mask is one acefuse kernel
    forward *and* backward (no fallback); the mask requires no grad and gets none."""
    g = torch.Generator().manual_seed(len(mask) + (fn is _sdpa_causal))
    qkv = [torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (L, S, S)]
    m = MASKS[mask](g)
    if m.dtype == torch.bool:
        m[:, 0] = True
    cot = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    x = [t.float().requires_grad_() for t in qkv]
    mf = m if m.dtype == torch.bool else m.float()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        cf = af.compile(fn, *x, mf)
        cf(*x, mf).backward(cot.float())
    r = cf.report()
    assert len(r.taken) == 1 and not r.left, str(r)
    regions = [reg for gm in cf.graphs.values() for reg in gm.af_regions]
    assert [reg.calls["grad"] for reg in regions] == [1]
    ref = [t.clone().requires_grad_() for t in qkv]
    fn(*ref, m).backward(cot)
    for n, a, b in zip("qkv", x, ref):
        _close(a.grad, b.grad, f"{mask}: grad_{n}")


@pytest.mark.parametrize("shape", [(B, 1, L, S), (L, S)], ids=["[B,1,L,S]", "[L,S]"])
def test_sdpa_bias_that_requires_grad_over_fewer_axes(shape):
    """A learned bias broadcast over heads (and batch) that requires grad: its gradient is dS
    summed over them. dQ's key loop stores dS tile by tile (a tile output) and the sum over the
    broadcast axes is a second step; derived kernels, no fallback, against float64 autograd."""
    g = torch.Generator().manual_seed(31 + len(shape))
    qkv = [torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (L, S, S)]
    m = torch.randn(*shape, generator=g, dtype=torch.float64)
    cot = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    x = [t.float().requires_grad_() for t in qkv] + [m.float().requires_grad_()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        cf = af.compile(_sdpa, *x)
        cf(*x).backward(cot.float())
    assert len(cf.report().taken) == 1 and not cf.report().left, str(cf.report())
    ref = [t.clone().requires_grad_() for t in qkv] + [m.clone().requires_grad_()]
    _sdpa(*ref).backward(cot)
    for n, a, b in zip(["q", "k", "v", "mask"], x, ref):
        _close(a.grad, b.grad, f"grad_{n}")


def test_bias_summed_over_heads_is_a_tile_output_plus_a_sum():
    hb = af.tensor("hb", "b i j")      # one bias per batch element, shared by the heads
    bwd = backward(_attend("t_head_bias", score + hb))
    assert bwd.finish == {"grad_hb": ("part_grad_hb", ("h",))}
    (stage,) = [s for s in bwd.stages if "part_grad_hb" in s.outputs]
    assert stage.axis == "j" and "grad_q" in stage.outputs
    assert not any(u.op in ("Sum", "RMax", "RMin") and u.args[0].args[0] == "j"
                   for u in stage.outputs["part_grad_hb"].term.walk())


def test_a_later_call_asking_for_more_gradients_gets_them():
    """The differentiable kernel is specialised to the inputs that require grad; a call where
    another one does (a bias unfrozen later) runs a kernel for that set: no gradient dropped."""
    dk = _kernel("causal_bias")
    x, cot = _inputs(41)
    for wrt in (("q", "k", "v"), ("q", "k", "v", "bias"), ("v",)):
        got = _run("causal_bias", x, cot, wrt)
        ref = _reference("causal_bias", x, cot, wrt)
        for n in wrt:
            _close(got[n], ref[n], f"{wrt}: grad_{n}")
    assert set(dk._by_wrt) >= {frozenset("qkv"), frozenset("v")}
    assert all(c.grad_fallback is None for c in dk._by_wrt.values())


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("wrt", [("q", "v", "bias"), ("q", "k", "v"), ("v",), ("bias",)])
def test_no_hoisted_value_is_larger_than_what_it_reads(name, wrt):
    """A pre-stage value (backward._hoist) is written and read back: the scores sum_d(q * k)
    or dP = sum_e(grad_o * v) over (i, j) must stay inside the fused stages (with wrt without
    k they were hoisted as N x N tensors, and the stage over keys then refused the bool mask)."""
    wrt = tuple(n for n in wrt if n in PROGRAMS[name]().tensors)
    if not wrt:
        pytest.skip(f"{name} has none of these inputs")
    bwd = backward(PROGRAMS[name](), wrt=list(wrt))
    for n, axes in bwd.intermediates.items():
        assert not {"i", "j"} <= set(axes), (name, wrt, n, axes)
