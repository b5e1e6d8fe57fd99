"""Golden derivations: what af.fuse derives for the cascaded-reduction workloads.

start => goal equivalences (the e-graph proves St(q, A u B) equal to the derived
form), snapshots of the extracted rolling updates and split merges, a float64
certificate of every derived form against the unfused definitions, and a float32
check that the derived variance merge does not cancel where raw moments do.
"""
import time

import numpy as np
import pytest

import acefuse as af
from acefuse.rewrite.terms import Term, A, B, U, st, cnt, pretty
from acefuse.rewrite.schedules import SCHEDULES
from acefuse.rules import THEORIES
from acefuse.extract.numerics import output_cancellation
from acefuse.proofs.certify import certify, StateDef
from tests.programs import x, t, m, e, l, mu, var

AB = U(A, B)
J = Term("BJ")

w = af.tensor("w", "j")
b = af.tensor("b", "j")

PROGRAMS = {
    "softmax": lambda: af.program("softmax", y=e / l),
    "logsumexp": lambda: af.program("logsumexp", y=m + af.log(l)),
    "layernorm": lambda: af.program("layernorm", y=(x - mu) * af.rsqrt(var + 1e-5) * w + b),
    "rmsnorm": lambda: af.program("rmsnorm", y=x * af.rsqrt(af.mean(x * x, "j") + 1e-6) * w),
    "log_softmax": lambda: af.program("log_softmax", y=x - m - af.log(l)),
    "cross_entropy": lambda: af.program("cross_entropy", loss=m + af.log(l) - af.take(x, t, "j")),
    "softmax_lse": lambda: af.program("softmax_lse", y=e / l, lse=m + af.log(l)),
    "raw_variance": lambda: af.program("raw_variance", y=af.mean(x * x, "j") - af.mean(x, "j") ** 2),
}
FUSIBLE = sorted(PROGRAMS)

_CACHE: dict = {}


def fused(name):
    if name not in _CACHE:
        _CACHE[name] = af.fuse(PROGRAMS[name]())
    return _CACHE[name]


def forms(f):
    p = f.passes[0]
    return {s.name: (pretty(p.rolling[s.name]), pretty(p.merge[s.name])) for s in p.states}


# ---- softmax family: snapshots -------------------------------------------------------------
SOFTMAX_FORMS = {
    "m": ("max(m_A, max_B(x))", "max(m_A, m_B)"),
    "s": ("s_A * exp(m_A - m_AB) + sum_B(exp(x - m_AB))",
          "s_A * exp(m_A - m_AB) + s_B * exp(m_B - m_AB)"),
}


@pytest.mark.parametrize("name", ["softmax", "logsumexp", "log_softmax", "cross_entropy", "softmax_lse"])
def test_softmax_family_snapshot(name):
    f = fused(name)
    assert f.fusible and len(f.passes) == 1
    assert [s.name for s in f.states] == ["m", "s"]   # one max, one sum: states are shared
    assert forms(f) == SOFTMAX_FORMS


def test_softmax_and_logsumexp_share_states():
    f = fused("softmax_lse")
    outs = {k: pretty(v) for k, v in f.encoding.outputs.items()}
    assert outs == {"y": "exp(x - m_J) / s_J", "lse": "m_J + log(s_J)"}
    assert f.hbm_passes == {"unfused": 3, "fused": 2}


def test_cross_entropy_gathers_target_as_a_row_value():
    f = fused("cross_entropy")
    assert pretty(f.encoding.outputs["loss"]) == "m_J + log(s_J) - x[j=t]"
    assert f.hbm_passes["fused"] == 1


# ---- layernorm: the count-weighted (parallel-variance) correction ----------------------------
def _mean(blk):
    """The forms a block mean can take in an extracted term."""
    return {st("r", blk), Term("Div", (st("s", blk), cnt(blk)))}


def _is_dev(d, blk):
    """d is mean_AB - mean_blk (either sign)."""
    return d.op == "Sub" and ((d.args[0] in _mean(AB) and d.args[1] in _mean(blk))
                              or (d.args[0] in _mean(blk) and d.args[1] in _mean(AB)))


def _weighted_square(term, blk):
    """term contains n_blk * (mean_AB - mean_blk)^2 (in either factor order)."""
    for sub in term.walk():
        if sub.op != "Mul":
            continue
        for n_, sq in (sub.args, sub.args[::-1]):
            if n_ == cnt(blk) and sq.op == "Mul" and sq.args[0] == sq.args[1] and _is_dev(sq.args[0], blk):
                return True
    return False


def _reductions(term):
    return [s for s in term.walk() if s.op in ("Sum", "RMax", "RMin")]


def test_layernorm_merge_is_count_weighted_and_symmetric():
    f = fused("layernorm")
    p = f.passes[0]
    merge = p.merge["s2"]
    assert not _reductions(merge), "a merge reads no raw data"
    assert _weighted_square(merge, A) and _weighted_square(merge, B), pretty(merge)
    leaves = {s for s in merge.walk() if s.op == "St"}
    assert st("s2", A) in leaves and st("s2", B) in leaves
    # start => goal, in the e-graph
    assert p.egraph.check(st("s2", AB), merge)
    d_a = st("r", AB) - st("r", A)
    d_b = st("r", AB) - st("r", B)
    assert p.egraph.check(st("r", AB), st("s", AB) / cnt(AB))
    assert p.egraph.check(Term("Sum", (A, (Term("Elm", ("x",)) - st("r", A)))), Term("Num", (0.0,)))
    assert p.egraph.check(d_a, st("s", AB) / cnt(AB) - st("s", A) / cnt(A))
    assert p.egraph.check(d_b, st("s", AB) / cnt(AB) - st("s", B) / cnt(B))


def test_layernorm_rolling_is_centered():
    f = fused("layernorm")
    roll = f.passes[0].rolling["s2"]
    assert _weighted_square(roll, A), pretty(roll)
    reds = _reductions(roll)
    assert reds and all(r.args[0] == B for r in reds)
    # the tile is centered on the new mean: no raw second moment sum_B(x * x)
    (body,) = [r.args[1] for r in reds]
    assert body.op == "Mul" and body.args[0] == body.args[1], pretty(roll)
    x_ = Term("Elm", ("x",))
    assert body.args[0].op == "Sub" and body.args[0].args[0] == x_ and body.args[0].args[1] in _mean(AB)


def _ev32(term, vals):
    """float32 value of an extracted merge from float32 partial states."""
    if term.op == "Num":
        return np.float32(term.args[0])
    if term.op in ("St", "Cnt"):
        return vals[term]
    a = [_ev32(c, vals) for c in term.children]
    return {"Add": lambda: a[0] + a[1], "Sub": lambda: a[0] - a[1], "Mul": lambda: a[0] * a[1],
            "Div": lambda: a[0] / a[1], "Neg": lambda: -a[0]}[term.op]()


def test_layernorm_merge_is_accurate_in_float32():
    merge = fused("layernorm").passes[0].merge["s2"]
    rng = np.random.default_rng(0)
    worst_derived, worst_raw = 0.0, 0.0
    for _ in range(50):
        xa = (1e4 + rng.standard_normal(rng.integers(2, 300))).astype(np.float32)
        xb = (1e4 + rng.standard_normal(rng.integers(2, 300))).astype(np.float32)
        vals = {}
        for blk, xs in ((A, xa), (B, xb)):
            n, s = np.float32(len(xs)), xs.sum(dtype=np.float32)
            vals[cnt(blk)], vals[st("s", blk)], vals[st("r", blk)] = n, s, s / n
            vals[st("s2", blk)] = ((xs - s / n) ** 2).sum(dtype=np.float32)
        vals[cnt(AB)] = vals[cnt(A)] + vals[cnt(B)]
        vals[st("s", AB)] = vals[st("s", A)] + vals[st("s", B)]
        vals[st("r", AB)] = vals[st("s", AB)] / vals[cnt(AB)]
        exact = ((np.concatenate([xa, xb]).astype(np.float64)
                  - np.concatenate([xa, xb]).astype(np.float64).mean()) ** 2).sum()
        got = float(_ev32(merge, vals))
        allx = np.concatenate([xa, xb])
        raw = float((allx * allx).sum(dtype=np.float32) - allx.sum(dtype=np.float32) ** 2 / np.float32(len(allx)))
        worst_derived = max(worst_derived, abs(got - exact) / exact)
        worst_raw = max(worst_raw, abs(raw - exact) / exact)
    assert worst_derived < 1e-3, worst_derived
    assert worst_raw > 100 * worst_derived   # what the cost model steers away from


# ---- every derived form is certified on random blocks --------------------------------------
@pytest.mark.parametrize("name", FUSIBLE)
def test_every_derived_form_is_certified(name):
    f = fused(name)
    assert f.fusible and len(f.passes) == 1
    certs = f.certificate
    assert len(certs) == 2 * len(f.states)
    assert all(c.status == "certified" for c in certs.values()), {k: c.detail for k, c in certs.items()}


@pytest.mark.parametrize("name", FUSIBLE)
def test_derivation_is_bounded_and_fast(name):
    t0 = time.perf_counter()
    f = af.fuse(PROGRAMS[name]())
    elapsed = time.perf_counter() - t0
    for p in f.passes:
        assert p.stats.stop_reason == "saturated", p.stats.phase_summary()
        assert p.stats.nodes < 4000
        assert [ph[0] for ph in p.stats.phases] == ["split-shift", "expand", "factor", "simplify"]
    assert elapsed < 2.0, f"{name}: {elapsed:.2f} s"


# ---- raw moments as the user wrote them ----------------------------------------------------
def test_raw_variance_fuses_as_written_and_is_flagged():
    f = fused("raw_variance")
    assert f.hbm_passes == {"unfused": 1, "fused": 1}
    notes = output_cancellation(f.encoding)
    assert notes and notes[0][0] == "y" and notes[0][2] > 16
    assert output_cancellation(fused("layernorm").encoding) == []
    assert output_cancellation(fused("softmax").encoding) == []


# ---- the non-fusible example ------------------------------------------------------------------
def test_mean_absolute_deviation_is_not_fusible():
    prog = af.program("mad", y=af.sum(af.abs(x - af.mean(x, "j")), "j"))
    f = af.fuse(prog)
    assert not f.fusible and len(f.passes) == 2
    assert [s for s, _ in f.blocked] == ["s2"]
    assert "abs(x - r_A)" in f.reason and "another pass" in f.reason
    p2 = f.passes[1]
    assert p2.known == ("r", "s")
    assert pretty(p2.rolling["s2"]) == "s2_A + sum_B(abs(x - r_J))"
    # certify pass 2 with the earlier passes' states read as final values
    fin = {st(k, J): Term("Par", (k + "_final",)) for k in p2.known}
    from acefuse.rewrite.terms import substitute
    defs = [StateDef("s2", "sum", substitute(f.state("s2").definition, {st("r", A): fin[st("r", J)]}))]
    for form in (p2.rolling["s2"], p2.merge["s2"]):
        assert certify(defs, "s2", substitute(form, fin)).status == "certified"


# ---- registry ---------------------------------------------------------------------------------
def test_every_theory_is_used_by_a_schedule():
    used = set().union(*(s.theories() for s in SCHEDULES.values()))
    assert set(THEORIES) <= used, set(THEORIES) - used


def test_every_schedule_names_only_registered_theories():
    for sched in SCHEDULES.values():
        unknown = sched.theories() - set(THEORIES) - {"user"}
        assert not unknown, f"schedule {sched.name!r} names unregistered theories {unknown}"


def test_every_registered_rule_is_reachable_from_a_schedule():
    from acefuse.rules import REGISTRY
    used = set().union(*(s.theories() for s in SCHEDULES.values()))
    unreachable = [r.name for r in REGISTRY.values() if r.theory not in used]
    assert not unreachable


def test_a_misspelled_theory_in_a_schedule_is_an_error():
    import pytest
    from acefuse.rewrite.schedules import Schedule, Phase, validate
    with pytest.raises(ValueError, match="arithh"):
        validate(Schedule("bad", (Phase("p", ("arithh",)),)))


_ABLATE_TWICE = r'''
import importlib, sys
import acefuse as af
F = importlib.import_module("acefuse.fuse")
runs = []
run = F._ablate_pass_run
F._ablate_pass_run = lambda f, p: runs.append(p.index) or run(f, p)
x = af.tensor("x", "i j")
m = af.max(x, "j")
l = af.sum(af.exp(x - m), "j")
f = af.fuse(af.program("softmax_again", y=af.exp(x - m) / l))
text = f.explain()
print(len(runs))
print(text)
'''


def test_rule_chains_are_read_back_in_a_fresh_process(tmp_path):
    """The rule-chain ablation (one re-saturation per rule that fired: the largest phase of a cold
    compile) is kept on disk under its e-graph input, rules, schedule and code: a second fusion of
    the same program in a fresh process re-saturates nothing and explains (the generated code's
    header) with the same bytes. Fails without the cache (the second process ablates again)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, ACEFUSE_CACHE_DIR=str(tmp_path), ACEFUSE_ABLATION_CACHE="1")
    outs = [subprocess.run([sys.executable, "-c", _ABLATE_TWICE], env=env, capture_output=True, text=True,
                           timeout=120) for _ in range(2)]
    for o in outs:
        assert o.returncode == 0, o.stderr
    first, second = (o.stdout.split("\n", 1) for o in outs)
    assert int(first[0]) == 1 and int(second[0]) == 0, (first[0], second[0])
    assert first[1] == second[1] and "rules: " in first[1]
    assert list((tmp_path / "ablation").glob("*.json"))
