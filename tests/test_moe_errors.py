"""MoE routing: DeepSeek-V3 grouped routing against a float64 reference in bfloat16 and float32,
and the error paths of af.topk / af.gather / the launcher's input-type check.

The grouped reference is DeepSeek-V3's gate (``MoEGate``, topk_method "noaux_tc", in
modeling_deepseek.py: float32 logits, ``sigmoid``, the bias added for choosing, groups scored by
the sum of their top-2, the best ``topk_group`` groups kept, the others' experts at -inf as in the
V3 inference code, top-k, the unbiased scores renormalised and scaled) written here in float64.
The kernels compute in float32: a row's indices must be the reference's wherever its decisions
(the kept groups, the order of the k + 1 best kept experts) are separated by more than float32
rounding (``SEP``); the few rows that are not must still keep groups within SEP of the
threshold."""
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.lang import LanguageError

ROOT = Path(__file__).resolve().parents[1]
MOE = runpy.run_path(str(ROOT / "examples" / "moe.py"))
SEP = 1e-5     # float32 rounding of sums of a few scores below 3: a few 2^-23 relative
# a bfloat16 output: float32 arithmetic, then one store (the interpreter truncates: a whole ulp)
RTOL = {torch.float32: 3e-6, torch.bfloat16: 2.0 ** -7 + 3e-6}


def _deepseek_grouped64(X, B, k, groups, topk_group, scale):
    """DeepSeek-V3's grouped routing in float64: (weights, experts, group scores, kept groups,
    a per-row flag: every decision separated by more than SEP). Ties: the lower index first."""
    s = torch.sigmoid(X.double())
    c = s + B.double()
    t, e = c.shape
    gsc = c.view(t, groups, e // groups).topk(2, -1)[0].sum(-1)
    gv, gi = torch.sort(gsc, dim=1, descending=True, stable=True)
    kept = torch.zeros(t, groups, dtype=torch.bool).scatter_(1, gi[:, :topk_group], True)
    masked = c.masked_fill(~kept.repeat_interleave(e // groups, 1), -math.inf)
    ev, ei = torch.sort(masked, dim=1, descending=True, stable=True)
    idx = ei[:, :k]
    w = s.gather(1, idx)
    w = w / w.sum(1, keepdim=True) * scale
    sep = gv[:, topk_group - 1] - gv[:, topk_group] > SEP
    sep &= (ev[:, :k] - ev[:, 1:k + 1] > SEP).all(1)
    return w, idx, gsc, kept, sep


def _check(route, X, B, k, groups, topk_group, scale, what):
    w_ref, i_ref, gsc, kept, sep = _deepseek_grouped64(X, B, k, groups, topk_group, scale)
    for sched, kw in [("single", {}), ("split", {"block_j": 16, "nsplit": 3})]:
        w, i = route(X, B, schedule=sched, **kw)
        at = f"{what} [{sched}]"
        assert i.dtype == torch.int64 and w.dtype == X.dtype, at
        bad = (i != i_ref).any(1) & sep
        assert not bad.any(), (at, "rows", bad.nonzero().flatten().tolist(), i[bad], i_ref[bad])
        # rows whose decisions are within float32 rounding: k distinct experts of groups that score
        # within SEP of the kept groups' threshold
        thr = gsc.masked_fill(~kept, math.inf).amin(1, keepdim=True)
        g = i // (X.shape[1] // groups)
        assert all(len(set(r)) == k for r in i.tolist()), at
        assert (gsc.gather(1, g) >= thr - SEP).all(), at
        np.testing.assert_allclose(w[sep].double().numpy(), w_ref[sep].numpy(), rtol=RTOL[X.dtype], atol=1e-7,
                                   err_msg=at)
    return sep


def _inputs(n_experts, dtype, g):
    """Logits of 24 tokens: 8 spread (2 randn), 16 crowded (4 + 0.3 randn: sigmoid near 0.98,
    group scores a bfloat16 ulp apart, where a rounded group score keeps the wrong group), and a
    bias of the scores' spread."""
    X = torch.cat([torch.randn(8, n_experts, generator=g) * 2, 4 + torch.randn(16, n_experts, generator=g) * 0.3])
    return X.to(dtype), (torch.randn(n_experts, generator=g) * 0.02).to(dtype)


_ROUTES = {}


def _route(k, n_experts, groups, topk_group, scale):
    key = (k, n_experts, groups, topk_group, scale)
    if key not in _ROUTES:
        _ROUTES[key] = MOE["deepseek_grouped"](k, groups=groups, topk_group=topk_group, n_experts=n_experts,
                                               scale=scale)
    return _ROUTES[key]


CONFIGS = [pytest.param(2, 64, 8, 3, id="k2-of-64"), pytest.param(2, 256, 8, 4, id="k2-of-256"),
           # k = 8 compiles in about a second since its shared terms are walked as DAGs (86 s
           # before: tests/test_term_dag.py); 256 experts take 6-9 s each in the interpreter
           pytest.param(8, 64, 8, 4, id="k8-of-64"),
           pytest.param(8, 256, 8, 4, id="k8-of-256", marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k,n_experts,groups,topk_group", CONFIGS)
def test_grouped_routing_matches_deepseek_reference_in_float64(k, n_experts, groups, topk_group, dtype):
    """bfloat16 logits used to be scored per group in bfloat16 (kernel 1's output), so group
    scores a bfloat16 ulp apart became equal and the wrong group was kept."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    X, B = _inputs(n_experts, dtype, torch.Generator().manual_seed(seed))
    route = _route(k, n_experts, groups, topk_group, 2.5)
    sep = _check(route, X, B, k, groups, topk_group, 2.5, f"k={k} of {n_experts} {dtype} seed {seed}")
    assert sep.float().mean() > 0.8, (seed, sep.float().mean())   # the exact check covers most rows


def test_grouped_check_fails_on_bfloat16_group_scores():
    """The check above is not vacuous: group scores rounded to bfloat16 before the group choice
    (what deepseek_grouped did) keep another group in some rows."""
    route = _route(2, 64, 8, 3, 2.5)
    k1, k2, k3 = route.kernels

    def rounded(x, bias, **kw):
        t = x.shape[0]
        gs = k1(x=x.reshape(t, 8, 8), bias=bias.reshape(8, 8), **kw).to(torch.bfloat16).float()
        th = k2(gs=gs, **kw)
        out = k3(x=x, bias=bias, gs_e=gs.repeat_interleave(8, dim=1), tv=th["tv"], ti=th["ti"].float(),
                 out_dtypes={"weights": x.dtype}, **kw)
        return out["weights"], out["experts"]
    X, B = _inputs(64, torch.bfloat16, torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError):
        _check(rounded, X, B, 2, 8, 3, 2.5, "bfloat16 group scores")


# ---- error paths -----------------------------------------------------------------------------
def test_gather_refuses_an_index_that_varies_along_the_gathered_axis():
    x, i = af.tensor("x", "t e"), af.tensor("i", "t e")
    with pytest.raises(LanguageError) as err:
        af.gather(x, i, "e")
    msg = str(err.value)
    assert "gather(`x`, `i`, 'e')" in msg and "ranges over 'e'" in msg and "af.topk" in msg, msg
    # what the message suggests for one position per element: the index on its own axis
    j = af.tensor("j", "t s")
    k = af.compile(af.program("gather_per_element", out=af.gather(x, j, "e")))
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    X, J = torch.randn(3, 11, generator=g), torch.randint(0, 11, (3, 5), generator=g)
    assert torch.equal(k(x=X, j=J.float()), torch.gather(X, 1, J))


def test_topk_of_topk_candidates_is_a_short_error():
    x = af.tensor("x", "t e")
    vals, idx = af.topk(af.sigmoid(x), 2, "e")
    for call in (lambda: af.topk(vals, 1, "k"), lambda: af.topk(idx, 1, "k")):
        with pytest.raises(LanguageError) as err:
            call()
        msg = str(err.value)
        assert len(msg) < 400, (len(msg), msg)
        assert "topk(`sigmoid(x)`, 2, 'e')" in msg and "not supported" in msg and "vals[r]" in msg, msg
        assert "af.tensor" not in msg, msg
    with pytest.raises(LanguageError) as err:    # a reduction over the candidates' axis
        af.sum(vals / vals.sum(), "k")
    msg = str(err.value)
    assert len(msg) < 300 and "2 candidates over 'k'" in msg and ".sum()" in msg, msg


def _type_message(call):
    with pytest.raises(TypeError) as err:
        call()
    return str(err.value)


def test_input_type_error_lists_the_float8_types_it_accepts():
    x = af.tensor("x", "t e")
    k = af.compile(af.program("float8_sum", s=af.sum(x, "e")))
    X = torch.randn(3, 9)
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):     # accepted, decoded exactly
        got = k(x=X.to(f8))
        np.testing.assert_allclose(got.double().numpy(), X.to(f8).double().sum(1).numpy(), rtol=3e-6)
    for bad in (torch.float64, torch.int32):
        msg = _type_message(lambda: k(x=X.to(bad)))
        assert ("input 'x' of program 'float8_sum' is " + str(bad)) in msg, msg
        assert "accepts float32, float16, bfloat16, float8_e4m3fn or float8_e5m2" in msg, msg
        assert "x.to(torch.float32)" in msg, msg


def test_input_type_error_of_the_contraction_and_sum_kernel_families():
    """Each family's launcher lists what its kernels read: no float8 (they do not decode it)."""
    q, k, v = af.tensor("q", "b i d"), af.tensor("k", "b j d"), af.tensor("v", "b j e")
    s = af.sum(q * k, "d")
    p = af.exp(s - af.max(s, "j"))
    att = af.compile(af.program("attn_types", o=af.sum(p * v, "j") / af.sum(p, "j")))
    go, m = af.tensor("go", "b i e"), af.tensor("m", "b i")
    dq = af.compile(af.program("dq_types", g=af.sum(af.exp(s - m) * af.sum(go * v, "e") * k, "j")), axis="j")
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    Q, K, V = torch.randn(2, 5, 4, generator=g), torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 3, generator=g)
    GO, M = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, generator=g).abs() + 4.0
    S = torch.einsum("bid,bjd->bij", Q.double(), K.double())
    P = torch.softmax(S, -1)
    np.testing.assert_allclose(att(q=Q, k=K, v=V).double().numpy(), (P @ V.double()).numpy(), rtol=1e-5, atol=1e-6)
    want = torch.einsum("bij,bjd->bid", torch.exp(S - M.double()[..., None]) * (GO.double() @ V.double().transpose(1, 2)), K.double())
    np.testing.assert_allclose(dq(q=Q, k=K, v=V, go=GO, m=M).double().numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    for name, call in (("attn_types", lambda d: att(q=Q, k=K.to(d), v=V)),
                       ("dq_types", lambda d: dq(q=Q, k=K.to(d), v=V, go=GO, m=M))):
        for bad in (torch.float64, torch.float8_e4m3fn):
            msg = _type_message(lambda: call(bad))
            assert f"input 'k' of program '{name}' is {bad}" in msg, msg
            assert "accepts float32, float16 or bfloat16:" in msg and "k.to(torch.float32)" in msg, msg


def test_gemm_refuses_an_input_type_its_kernels_do_not_read():
    """af.gemm checked no input type: a float64 activation ran and gave a float64 output."""
    x, wq, ws = af.tensor("x", "t h"), af.tensor("wq", "n h"), af.tensor("ws", "n")
    scale = af.cast(af.max(af.abs(x), "h") / 448.0, "float32")
    gk = af.gemm(af.program("gemm_types", out=af.sum(af.cast(x / scale, "float8_e4m3fn") * wq, "h") * scale * ws))
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    w = torch.randn(5, 16, generator=g)
    inp = dict(x=torch.randn(3, 16, generator=g), wq=w.to(torch.float8_e4m3fn), ws=torch.rand(5, generator=g) + 0.5)
    for bad in ("x", "ws"):
        for form in ("prologue", "scaled_mm"):
            msg = _type_message(lambda: gk(form=form, **dict(inp, **{bad: inp[bad].double()})))
            assert f"input {bad!r} of program 'gemm_types' is torch.float64" in msg, msg
            assert ("accepts float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int32, int64, int8, "
                    "uint8 or bool:") in msg and f"{bad}.to(torch.float32)" in msg, msg
    with pytest.raises(TypeError, match="input 'ws' of program 'gemm_types' must be a torch.Tensor"):
        gk(**dict(inp, ws=[1.0] * 5))
