"""af.compile compiles only certified fusions.

A wrong derivation injected into the pipeline (a dropped correction factor in an
extracted rolling update, a doubled count in a merge, a dropped ``/ size(j)`` in the
normal form, a wrong encoded output) is refused: af.compile warns once, naming the
program, the state and the step, and compiles the unfused kernel, which matches an
independent float64 reference. ``allow_uncertified=True`` compiles the wrong fusion,
loudly (and the kernel is then demonstrably wrong: the certificate is what stops it).
Attention-shaped (contraction) programs fall back the same way: their unfused kernel is a
chain of one-pass kernels (codegen/chain.py), each pass's states handed on as tensors.
"""
import math
import sys
import warnings

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.fuse import unfused
from acefuse.certificate import UncertifiedFusionWarning
from acefuse.extract.extractor import Extractor
from acefuse.reference import evaluate, random_inputs
from acefuse.rewrite.terms import Term, A, B, U, pretty

x = af.tensor("x", "r j")
w = af.tensor("w", "j")
SIZES = {"r": 5, "j": 45}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    import acefuse.certificate as cm
    monkeypatch.setattr(cm, "_WARNED", set())


def layernorm(name):
    mu = af.mean(x, "j")
    var = af.mean((x - mu) ** 2, "j")
    return af.program(name, y=(x - mu) * af.rsqrt(var + 1e-5) * w)


def softmax(name):
    m = af.max(x, "j")
    e = af.exp(x - m)
    return af.program(name, y=e / af.sum(e, "j"))


def max_rel_err(k, prog, seed, **run):
    inputs = random_inputs(prog, SIZES, seed=seed)
    out = k(**inputs, **run)
    out = out if isinstance(out, dict) else {next(iter(prog.outputs)): out}
    ref = evaluate(prog, {n: t.double() for n, t in inputs.items()})
    return max(float(np.max(np.abs(out[o].double().numpy() - r) / np.maximum(np.abs(r), 1.0)))
               for o, r in ref.items())


# ---- injections ---------------------------------------------------------------------------------
def _rewrite(t: Term, f):
    """Apply ``f`` bottom-up to every subterm."""
    if t.children:
        t = Term(t.op, tuple(_rewrite(a, f) if isinstance(a, Term) else a for a in t.args))
    return f(t)


def inject_extraction(monkeypatch, mode, mutate):
    """Wrap the extractor so that every extracted form of schedule ``mode`` goes through
    ``mutate`` (before fuse's own adversarial float32 check sees it)."""
    real = Extractor.extract
    hits = []

    def extract(self, cid, reach, target=None):
        cost, term = real(self, cid, reach, target)
        if term is not None and reach.mode == mode:
            new = mutate(term)
            if new != term:
                hits.append((target, pretty(term), pretty(new)))
            term = new
        return cost, term

    monkeypatch.setattr(Extractor, "extract", extract)
    return hits


def inject_forms(monkeypatch, form, mutate):
    """Wrap af.fuse so that every derived ``form`` ("rolling" or "merge") it returns goes
    through ``mutate``: a wrong derivation that reached the Fusion (fuse's own float32
    check aside), which only the certificate stands between and codegen."""
    fm = sys.modules["acefuse.fuse"]
    real = fm.fuse
    hits = []

    def fuse(*a, **kw):
        f = real(*a, **kw)
        for p in f.passes:
            forms = getattr(p, form)
            for name, t in list(forms.items()):
                new = mutate(t)
                if new != t:
                    hits.append((name, pretty(t), pretty(new)))
                    forms[name] = new
        return f

    monkeypatch.setattr(fm, "fuse", fuse)
    return hits


def drop_count_factor(t):
    """``... * n_A`` -> ``...``: the correction factor of the parallel-variance update."""
    return _rewrite(t, lambda s: s.args[0] if (s.op == "Mul" and s.args[1] == Term("Cnt", (A,))) else s)


def drop_exp_correction(t):
    """``s_A * exp(m_A - m_AB)`` -> ``s_A``: the online-softmax rescale."""
    return _rewrite(t, lambda s: s.args[0] if (s.op == "Mul" and s.args[1].op == "Exp"
                                                 and s.args[0].op == "St" and s.args[0].args[1] == A) else s)


def double_count(t):
    """``n_A`` -> ``n_A + n_A``."""
    return _rewrite(t, lambda s: Term("Add", (s, s)) if s == Term("Cnt", (A,)) else s)


def compile_refused(prog, expect_state, expect_step, **kw):
    with pytest.warns(UncertifiedFusionWarning) as rec:
        k = af.compile(prog, **kw)
    msgs = [str(r.message) for r in rec if issubclass(r.category, UncertifiedFusionWarning)]
    assert len(msgs) == 1, msgs
    msg = msgs[0]
    assert repr(prog.name) in msg and repr(expect_state) in msg and expect_step in msg, msg
    assert "allow_uncertified=True" in msg and "unfused kernel" in msg
    assert not k.fusion.certificate.failures
    assert k.fusion.normal_form and "unfused" in k.fusion.normal_form[0]
    return k


# ---- refused: rolling, merge, normal form, finalize ----------------------------------------------
def test_dropped_correction_factor_in_rolling_is_refused(monkeypatch):
    prog = layernorm("ln_gate_rolling")
    hits = inject_forms(monkeypatch, "rolling", drop_count_factor)
    k = compile_refused(prog, "s2", "rolling")
    assert hits and hits[0][0] == "s2"
    assert len(k.fusion.passes) == 2 and not k.fusion.fusible      # one pass per reduction depth
    assert pretty(k.fusion.passes[1].rolling["s2"]) == "s2_A + sum_B((x - r_J) * (x - r_J))"
    for sched in ({"schedule": "loop", "block_j": 8}, {"schedule": "single"}):
        assert max_rel_err(k, prog, seed=11, **sched) < 1e-4


def test_subtly_wrong_extraction_passing_the_float32_check_is_refused(monkeypatch):
    # n_A -> n_A * (1 + 1e-6) in the extracted variance update: within float32 rounding of
    # the program (fuse's own adversarial float32 check passes it), but not an identity
    prog = layernorm("ln_gate_subtle")
    scale = lambda t: _rewrite(t, lambda s: Term("Mul", (s, Term("Num", (1.000001,))))
                               if s == Term("Cnt", (A,)) else s)
    hits = inject_extraction(monkeypatch, "rolling", scale)
    k = compile_refused(prog, "s2", "rolling")
    assert any(h[0] == "s2" for h in hits)
    assert max_rel_err(k, prog, seed=19, schedule="loop", block_j=8) < 1e-4


def test_dropped_rescale_in_merge_is_refused(monkeypatch):
    prog = softmax("softmax_gate_merge")
    inject_forms(monkeypatch, "merge", drop_exp_correction)
    k = compile_refused(prog, "s", "merge")
    assert len(k.fusion.passes) == 2
    assert max_rel_err(k, prog, seed=12, schedule="loop", block_j=8) < 1e-4


def test_doubled_count_is_refused(monkeypatch):
    prog = layernorm("ln_gate_count")
    inject_forms(monkeypatch, "merge", double_count)
    k = compile_refused(prog, "s2", "merge")
    assert max_rel_err(k, prog, seed=13, schedule="loop", block_j=8) < 1e-4


def test_dropped_size_in_normal_form_is_refused(monkeypatch):
    import acefuse.rewrite.normalize as nm
    prog = af.program("center_gate", y=x - af.mean(x, "j"))
    real = nm.normalize

    def normalize(p, axis, *a, **kw):
        drop = lambda s: s.args[0] if (s.op == "Div" and s.args[1] == Term("Size", (axis,))) else s
        outs = {k: af.Expr(_rewrite(e.term, drop), e.axes, e.tensors) for k, e in p.outputs.items()}
        return af.Program(p.name, outs), [f"normal form of {k}: (injected) dropped / size({axis})" for k in outs]

    monkeypatch.setattr(nm, "normalize", normalize)
    k = compile_refused(prog, "y", "normal form")
    cert = k.fusion.certificate
    assert [c.step for c in cert.steps if c.state == "y"] == ["normal form", "epilogue"]
    assert max_rel_err(k, prog, seed=14, schedule="loop", block_j=8) < 1e-4
    monkeypatch.setattr(nm, "normalize", real)


def test_wrong_encoded_output_is_refused():
    prog = softmax("softmax_gate_output")
    f = af.fuse(prog)
    assert f.certificate.ok
    enc = f.encoding
    # y = exp(x - m_J) / s_J  ->  exp(x - m_J) * s_J (the epilogue the kernel would evaluate)
    enc.outputs["y"] = Term("Mul", enc.outputs["y"].args)
    cert = f.certificate
    assert not cert.ok
    assert [(c.state, c.step, c.status) for c in cert.failures] == [("y", "epilogue", "failed")]
    with pytest.warns(UncertifiedFusionWarning, match="epilogue step for 'y'"):
        k = af.compile(prog, fusion=f)
    assert max_rel_err(k, prog, seed=15, schedule="loop", block_j=8) < 1e-4


# ---- the opt-out, warn once, certified programs stay quiet ---------------------------------------
def test_allow_uncertified_compiles_the_wrong_fusion_loudly(monkeypatch):
    prog = softmax("softmax_gate_optout")
    inject_forms(monkeypatch, "rolling", drop_exp_correction)
    with pytest.warns(UncertifiedFusionWarning, match="USING AN UNCERTIFIED FUSION") as rec:
        k = af.compile(prog, allow_uncertified=True)
    assert "'s'" in str(rec[0].message) and "rolling" in str(rec[0].message)
    assert len(k.fusion.passes) == 1 and not k.fusion.certificate.ok
    # the certificate was right: over several tiles the injected update is wrong
    assert max_rel_err(k, prog, seed=16, schedule="loop", block_j=8) > 1e-2


def test_warns_once_per_program(monkeypatch):
    prog = softmax("softmax_gate_once")
    inject_forms(monkeypatch, "rolling", drop_exp_correction)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        af.compile(prog)
        af.compile(prog)
    assert sum(issubclass(r.category, UncertifiedFusionWarning) for r in rec) == 1


def test_certified_program_compiles_fused_without_warning():
    prog = layernorm("ln_gate_ok")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncertifiedFusionWarning)
        k = af.compile(prog)
    assert k.fusion.fusible and len(k.fusion.passes) == 1 and k.fusion.certificate.ok
    assert max_rel_err(k, prog, seed=17, schedule="loop", block_j=8) < 1e-4


# ---- contraction programs: the unfused kernel is a chain of one-pass kernels ----------------------
qa, ka, va = af.tensor("q", "b h i e"), af.tensor("k", "b h j e"), af.tensor("v", "b h j d")
ia, ja = af.index("i"), af.index("j")
SCALE = 0.25
MASKS = {"global": None, "causal": lambda i, j: j <= i, "masked_rows": lambda i, j: j < i - 5}
TILES = dict(block_i=16, block_j=16)   # N = 40: 3 query tiles x 3 key tiles; split: 2 key chunks


def attention(name, mask):
    s = af.sum(qa * ka, "e") * SCALE
    if MASKS[mask] is not None:
        s = af.where(MASKS[mask](ia, ja), s, af.NEG_INF)
    m = af.max(s, "j")
    p = af.exp(s - m)
    l = af.sum(p, "j")
    return af.program(name, o=af.sum(p * va, "j") / l, lse=m + af.log(l))


def attention_inputs(seed, dtype=torch.float32, n=40):
    g = torch.Generator().manual_seed(seed)
    return {t: (torch.randn(1, 2, n, 16, generator=g) * 2).to(dtype) for t in "qkv"}


def attention_reference(mask, q, k, v):
    """softmax(q k^T * scale + mask) v and its logsumexp in float64; a fully masked row gives
    o = 0 and lse = -inf (README, numerics)."""
    s = torch.einsum("bhie,bhje->bhij", q.double(), k.double()) * SCALE
    if MASKS[mask] is not None:
        i, j = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
        s = s.masked_fill(~MASKS[mask](i, j), -math.inf)
    lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(lse)[..., None]
    p = torch.where(seen, torch.exp(s - torch.where(seen, lse[..., None], 0.0)), 0.0)
    return {"o": p @ v.double(), "lse": lse}


def attention_error(out, ref) -> float:
    """Largest error relative to max(|ref|, 1) over every output; inf when a NaN appears or an
    infinity (a masked row's lse) is not exactly where the reference has one."""
    err = 0.0
    for name, r in ref.items():
        g = out[name].double()
        if torch.isnan(g).any() or not torch.equal(torch.isinf(g), torch.isinf(r)) or \
                not torch.equal(g[torch.isinf(g)], r[torch.isinf(r)]):
            return math.inf
        fin = torch.isfinite(r)
        err = max(err, float(((g - r).abs()[fin] / r.abs()[fin].clamp(min=1.0)).max()))
    return err


@pytest.mark.parametrize("mask", list(MASKS))
def test_uncertified_attention_falls_back_to_a_chain_of_one_pass_kernels(monkeypatch, mask):
    prog = attention(f"attn_gate_{mask}", mask)
    hits = inject_forms(monkeypatch, "rolling", drop_exp_correction)
    k = compile_refused(prog, "s", "rolling")
    assert {h[0] for h in hits} >= {"s", "s2"}
    assert [[s.name for s in p.states] for p in k.fusion.passes] == [["m"], ["s", "s2"]]
    assert len(k.links) == 2 and k.fusible is False    # one kernel per pass, m handed on as a tensor
    inputs = attention_inputs(seed=21 + len(mask))
    ref = attention_reference(mask, **inputs)
    for sched in ("loop", "split"):
        out = k(**inputs, schedule=sched, **TILES)
        assert out["o"].dtype == torch.float32 and out["lse"].shape == (1, 2, 40)
        assert attention_error(out, ref) < 1e-4, sched
    if mask == "masked_rows":   # rows i <= 5 see no key
        assert torch.all(out["o"][:, :, :6] == 0) and torch.all(out["lse"][:, :, :6] == -math.inf)
    if mask == "causal":        # the state handed on stays float32: a bf16 chain is as accurate as one kernel
        bf = {t: x.bfloat16() for t, x in inputs.items()}
        out = k(**bf, schedule="loop", **TILES)
        assert out["o"].dtype == torch.bfloat16
        assert attention_error(out, attention_reference(mask, **bf)) < 3e-2


def test_allow_uncertified_attention_compiles_the_wrong_fusion(monkeypatch):
    prog = attention("attn_gate_optout", "causal")
    inject_forms(monkeypatch, "rolling", drop_exp_correction)
    with pytest.warns(UncertifiedFusionWarning, match="USING AN UNCERTIFIED FUSION"):
        k = af.compile(prog, allow_uncertified=True)
    assert len(k.fusion.passes) == 1 and not k.fusion.certificate.ok and not hasattr(k.kernel, "links")
    # the certificate was right: over several key tiles the injected update is wrong
    inputs = attention_inputs(seed=31)
    assert attention_error(k(**inputs, schedule="loop", **TILES), attention_reference("causal", **inputs)) > 1e-2


def test_a_chain_that_cannot_be_generated_is_a_clear_error(monkeypatch):
    import acefuse.codegen.chain as chain
    from acefuse.codegen.emit import CodegenError

    def refuse(f, **kw):
        raise CodegenError("(injected) no link kernel")
    monkeypatch.setattr(chain, "compile_chain", refuse)
    prog = attention("attn_gate_nochain", "global")
    inject_forms(monkeypatch, "rolling", drop_exp_correction)
    with pytest.warns(UncertifiedFusionWarning):
        with pytest.raises(af.FuseError, match="attn_gate_nochain.*not certified.*injected.*allow_uncertified=True"):
            af.compile(prog)


def test_three_pass_chain_hands_on_a_reference_value():
    # o = sum_j(exp(s - lse) v) reads lse = m + log(l) (a reference value) in a third pass;
    # fully masked rows read the handed-on lse = -inf as the shift 0 there, as in one kernel
    s = af.where(MASKS["masked_rows"](ia, ja), af.sum(qa * ka, "e") * SCALE, af.NEG_INF)
    m = af.max(s, "j")
    lse = m + af.log(af.sum(af.exp(s - m), "j"))
    prog = af.program("attn_chain3", o=af.sum(af.exp(s - lse) * va, "j"), lse=lse)
    u = unfused(prog, reason="test")
    assert u.certificate.ok and len(u.passes) == 3
    k = af.compile(prog, fusion=u)
    assert [sorted(so.values()) for _, _, so in k.links] == [["m"], ["r", "s"], []]
    assert sorted(k.links[2][1]) == ["m", "r", "s"]
    inputs = attention_inputs(seed=41, n=37)
    ref = attention_reference("masked_rows", **inputs)
    for sched in ("loop", "split"):
        assert attention_error(k(*inputs.values(), schedule=sched, **TILES), ref) < 1e-4, sched
    with pytest.raises(TypeError, match="attn_chain3.*no input.*'w'"):
        k(**inputs, w=inputs["q"])


def test_a_fused_multi_pass_contraction_runs_as_a_chain():
    # the mean absolute deviation of the scores needs a second pass after their mean; the
    # fused first pass (online softmax, corrections and all) and the second run as two kernels,
    # the value accumulator (a state over d) handed on to the last link
    s = af.sum(qa * ka, "e") * SCALE
    m = af.max(s, "j")
    p = af.exp(s - m)
    mad = af.sum(af.abs(s - af.sum(s, "j") / af.size("j")), "j")
    prog = af.program("attn_gate_mad", o=af.sum(p * va, "j") / af.sum(p, "j"), mad=mad)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncertifiedFusionWarning)
        k = af.compile(prog)
    assert k.fusion.certificate.ok and len(k.fusion.passes) == 2 and len(k.links) == 2
    assert "exp(m_A - m_AB)" in pretty(k.fusion.passes[0].rolling["s"])
    inputs = attention_inputs(seed=51)
    sc = torch.einsum("bhie,bhje->bhij", inputs["q"].double(), inputs["k"].double()) * SCALE
    ref = {"o": torch.softmax(sc, -1) @ inputs["v"].double(), "mad": (sc - sc.mean(-1, keepdim=True)).abs().sum(-1)}
    for sched in ("loop", "split"):
        assert attention_error(k(**inputs, schedule=sched, **TILES), ref) < 1e-4, sched


# ---- the unfused kernel -------------------------------------------------------------------------
def test_unfused_kernel_is_certified_and_correct():
    prog = af.program("mad_unfused", y=af.sum(af.abs(x - af.mean(x / af.size("j") * 2.0, "j")), "j"))
    u = unfused(prog, reason="test")
    assert u.certificate.ok, u.certificate.summary()
    assert [s.name for p in u.passes for s in p.states] == ["s", "s2"]
    assert "sum-split" in u.rule_chain("s2", "rolling")
    k = af.compile(prog, fusion=u)
    assert max_rel_err(k, prog, seed=18, schedule="loop", block_j=8) < 1e-4


# ---- disjointness: extraction never names a block it cannot name -----------------------------------
def test_extractor_refuses_a_block_it_cannot_name():
    ex = Extractor.__new__(Extractor)
    ex.blk = {"c1": "A", "c2": "AB", "c3": "BA", "c4": "AA", "c5": "?B", "c6": "J"}
    assert ex.build_blk("c1") == A and ex.build_blk("c6") == Term("BJ")
    assert ex.build_blk("c2") == U(A, B) and ex.build_blk("c3") == U(B, A)
    for cid in ("c4", "c5", "c7"):
        with pytest.raises(af.FuseError, match="cannot name"):
            ex.build_blk(cid)


def test_a_form_over_a_non_disjoint_block_fails_its_step():
    from acefuse.rewrite.terms import substitute
    f = af.fuse(softmax("softmax_gate_blocks"))
    p = f.passes[0]
    p.rolling["s"] = substitute(p.rolling["s"], {U(A, B): U(A, A)})
    bad = [(c.state, c.step, c.status) for c in f.certificate.failures]
    assert bad == [("s", "rolling", "failed")]
    assert "not a disjoint union" in f.certificate.failures[0].detail
