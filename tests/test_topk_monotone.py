"""Top-k of a strictly increasing function of a score, selected on the score (issue 14):
proofs/monotone.py's facts and lemmas, the decision procedure (what it accepts and refuses),
and MoE routing written plainly (softmax, top-k, renormalise) as one pass on every schedule,
against a float64 reference of the exact order (adversarial rows: exact ties, near-ties that
round to equal probabilities, NaN, +-inf, all -inf) and torch.topk where no rounding tie exists."""
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.proofs import monotone as pm

MOE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "moe.py"))
SCHED = [("single", {}), ("loop", {"block_j": 8}), ("split", {"block_j": 8, "nsplit": 3})]


# ---- the proofs ----------------------------------------------------------------------------------
def test_every_fact_and_lemma_is_proved_and_a_wrong_fact_is_refuted():
    for f in pm.FACTS:
        ok, detail = pm.prove_fact(f)
        assert ok, detail
    assert pm.check_order_lemma() and pm.check_nan_absorption() and pm.check_normaliser_lemma()
    wrong = pm.Fact("neg-increasing", "Neg", 0, 1, "", "-x")          # claims -x increasing
    assert not pm.prove_fact(wrong)[0]
    wrong = pm.Fact("mul-any-increasing", "Mul", 0, 1, "finite", "x * c")   # c may be <= 0
    assert not pm.prove_fact(wrong)[0]


def _analyse(e):
    from acefuse.rewrite.encode import _Axes, RED_OPS
    ax = _Axes(dict(e.tensors))

    def is_red(t):
        return t.op in RED_OPS and t.args[0].op == "Ax" and t.args[0].args[0] == "e"
    return pm.analyse(e.term, "e", lambda t: "e" in ax(t), is_red)


def test_the_decision_procedure_accepts_increasing_chains_and_refuses_the_rest():
    x = af.tensor("x", "t e")
    b = af.tensor("b", "t")
    m = af.max(x, "e")
    l = af.sum(af.exp(x - m), "e")
    ok = {"softmax": af.exp(x - m) / l, "log-softmax": x - m - af.log(l), "double negation": -(-(x - m)) / l,
          "scaled": (af.exp(x - m) / l) * 3.0 + 1.0, "sigmoid of softmax": af.sigmoid(af.exp(x - m) / l)}
    for what, e in ok.items():
        a = _analyse(e)
        assert a.ok and pm.prove(a).ok, (what, a.refused)
        assert a.score == x.term, what
    refused = {"decreasing": -(af.exp(x - m) / l), "max not covered by a normaliser": af.exp(x - m),
               "a tensor factor of unknown sign": x * b - m / l, "a sum of exps may underflow": af.exp(x) / af.sum(af.exp(x), "e"),
               "a tensor shift may be infinite": (x + b) / l}
    for what, e in refused.items():
        a = _analyse(e)
        assert not (a.ok and pm.prove(a).ok), what


# ---- kernels -------------------------------------------------------------------------------------
def _rows(t, e, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(t, e, generator=g) * 4
    X[0] = torch.randint(0, 3, (e,), generator=g).float()      # exact ties: lowest index first
    X[1, ::5] = math.nan                                         # NaN: every probability NaN
    X[2, ::3] = math.inf                                         # +inf: every probability NaN
    X[3] = -math.inf                                             # all -inf: every probability NaN
    X[4, :] = 1.0
    X[5, e // 2:] = -math.inf                                    # half masked
    # near-ties: 0.01 and the next float32 up round to the same probability; the larger first
    X[6] = -3.0
    X[6, 0] = 0.5
    X[6, 1] = 0.01
    X[6, e - 1] = float(np.nextafter(np.float32(0.01), np.float32(1)))
    return X


def _exact(X, k):
    """The documented order in float64: by the exact probability, i.e. by the logit, then the
    lowest index; a row whose normaliser is NaN (a NaN or +inf logit): every probability is
    NaN, candidates 0..k-1; a row of -inf: every probability 0 (acefuse's convention, as the
    reference evaluator), candidates 0..k-1. Values: the float64 probabilities there."""
    idx = torch.sort(X, dim=1, descending=True, stable=True)[1][:, :k]
    nanrow = torch.isnan(X).any(1) | torch.isposinf(X).any(1) | torch.isneginf(X).all(1)
    idx[nanrow] = torch.arange(k)
    p = torch.softmax(X.double(), -1)
    p[torch.isneginf(X).all(1)] = 0.0
    return idx, p.gather(1, idx)


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("k,sizes", [(2, (29,)), pytest.param(8, (8,), marks=_SLOW),
                                     pytest.param(1, (8, 29, 256), marks=_SLOW), pytest.param(2, (8, 256), marks=_SLOW),
                                     pytest.param(4, (8, 256), marks=_SLOW), pytest.param(8, (256,), marks=_SLOW)])
def test_softmax_topk_is_one_pass_on_every_schedule(k, sizes):
    """k = 1, 2, 4, 8 over 8 to 256 experts (the default run: k = 2 over 29 experts; the
    rest with -m slow: the interpreter runs the unrolled 8-candidate network for minutes), single / loop / split with small tiles."""
    prog = MOE["softmax_topk"](k)
    kern = af.compile(prog)
    f = kern.fusion
    assert f.certificate.ok and len(f.passes) == 1 and f.passes[0].split_ok
    x = af.tensor("x", "t e")
    m = af.max(x, "e")
    p = af.exp(x - m) / af.sum(af.exp(x - m), "e")
    vals, idx = af.topk(p, k, "e")
    raw = af.compile(af.program(f"softmax_top{k}_raw", values=vals, indices=idx))
    assert len(raw.fusion.passes) == 1
    probs = af.compile(af.program("probs", p=p))            # the program's expression, elementwise
    for e in sizes:
        X = _rows(8, e, 10 * k + e)
        i_ref, v_ref = _exact(X, k)
        for sched, kw in SCHED:
            out = kern(x=X, schedule=sched, **kw)
            assert torch.equal(out["experts"], i_ref), (sched, e, out["experts"], i_ref)
            w_ref = (v_ref / v_ref.sum(1, keepdim=True)).nan_to_num(0.0)
            w_ref[torch.isnan(X).any(1) | torch.isposinf(X).any(1)] = math.nan
            np.testing.assert_allclose(out["weights"].double().numpy(), w_ref.numpy(), rtol=3e-6, atol=1e-7)
            r = raw(x=X, schedule=sched, **kw)
            assert torch.equal(r["indices"], i_ref)
            # values: what the program's expression gives at the chosen experts, bit for bit
            pv = probs(x=X, schedule=sched, **kw)
            assert torch.equal(r["values"].nan_to_num(7.0), pv.gather(1, i_ref).nan_to_num(7.0)), sched
        if e >= 29:   # the near-tie row: the larger logit first, although the probabilities are equal
            assert r["indices"][6, 1].item() == e - 1 and r["values"][6, 1] == r["values"][6, 2] if k > 2 else True
    # torch.topk of the float32 probabilities agrees where no rounding tie exists
    g = torch.Generator().manual_seed(k)
    X = torch.randn(16, 64, generator=g) * 3
    out = kern(x=X)
    assert torch.equal(out["experts"], torch.topk(torch.softmax(X, -1), k, -1)[1])


def test_explain_names_the_monotone_step_and_one_pass():
    import time
    t0 = time.perf_counter()
    f = af.fuse(MOE["softmax_topk"](8))
    assert time.perf_counter() - t0 < 30
    text = f.explain()
    assert "fusible, one pass" in text and "monotone selection" in text
    assert "div-positive-increasing -> exp-increasing -> sub-const-increasing" in text
    assert "HBM passes over the input (rows longer than a tile): unfused" in text and "fused 1" in text
    assert any(c.step == "selection" and c.ok for c in f.certificate.steps)


def test_log_softmax_topk_and_refused_chains_still_run():
    """Top-k of log-probabilities: one pass; top-k of exp(x - max) (no normaliser covers an
    infinite max) keeps its two-pass form, correct as written."""
    x = af.tensor("x", "t e")
    m = af.max(x, "e")
    l = af.sum(af.exp(x - m), "e")
    vals, idx = af.topk(x - m - af.log(l), 2, "e")
    kern = af.compile(af.program("logsm_top2", values=vals, indices=idx))
    assert kern.fusion.certificate.ok and len(kern.fusion.passes) == 1
    X = _rows(8, 29, 5)
    i_ref, _ = _exact(X, 2)
    out = kern(x=X, schedule="loop", block_j=8)
    assert torch.equal(out["indices"], i_ref)
    vals, idx = af.topk(af.exp(x - m), 2, "e")
    kern = af.compile(af.program("shifted_top2", values=vals, indices=idx))
    assert kern.fusion.certificate.ok and not getattr(kern.fusion, "monotone", None)
    Y = torch.randn(5, 29)
    out = kern(x=Y)
    assert torch.equal(out["indices"], torch.topk(torch.exp(Y - Y.amax(1, keepdim=True)), 2, -1)[1])
