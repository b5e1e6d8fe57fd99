"""Saturation limits that keep one iteration bounded (rewrite/egraph.py) and the normal form
that stalled a gradient fuzz run (seed 1770245031: ``rewrite/normalize`` ran > 200 s).

The stall: a gradient's normal-form e-graph held a zero written as a product
(``sum_j(g) - sum_j(g) * (1 / size(j)) * size(j)``), every product with it joined the zero
class, and ``mul-assoc`` / ``factor-add-right`` then matched quadratically often: one
iteration went from 5,211 to 3.2 million e-nodes in 23 s, the time limit (checked before the
node limit) kept it, and extraction never finished. Now a rule with more matches than
``Limits.match_limit`` in one iteration is skipped in that iteration (and reported), and the
node limit is checked, with its rollback, before the time limit."""
import dataclasses
import time

import numpy as np
import pytest

import acefuse as af
from acefuse.fuse import default_rules
from acefuse.reference import evaluate
from acefuse.rewrite import schedules
from acefuse.rewrite.egraph import EGraph, Limits
from acefuse.rewrite.normalize import normalize
from acefuse.rewrite.terms import Term


def _stalled_gradient():
    """grad_w of the fuzz program of seed 1770245031 (af.backward's output, written plainly):
    w's gradient through ``max_j w`` and ``mean_j`` of ``w``'s logsumexp, exactly 0."""
    g, w = af.tensor("g", "r j"), af.tensor("w", "r j")
    s, m = af.tensor("s", "r"), af.tensor("m", "r")
    G, n = af.sum(g, "j"), af.size("j")
    inv = af.where(s.eq(0), 0, 1 / s)
    zero = G - G * (1 / n) * n
    return af.program("stall", gw=zero * inv * af.exp(w - m) + af.where(
        w.eq(m), (zero + (G * (1 / n) * n * inv * s - G * inv * s)) / af.sum(af.where(w.eq(m), 1, 0), "j"), 0))


def test_gradient_normal_form_stays_bounded_and_correct():
    prog = _stalled_gradient()
    report: list = []
    t0 = time.perf_counter()
    new, notes = normalize(prog, "j", default_rules(()), report=report)
    elapsed = time.perf_counter() - t0
    (stats,) = report
    # before: 3,229,074 e-nodes after the sixth iteration, and > 20 s (> 200 s in the fuzz run)
    assert stats.largest <= 50_000, (stats.largest, stats.describe())
    assert elapsed < 60, elapsed
    assert "mul-assoc" in stats.skipped, stats.skipped
    assert any("stopped early" in n and "mul-assoc" in n for n in notes), notes
    # the normal form found is still the program: float64, fresh inputs, m the row max of w
    rng = np.random.default_rng()
    R, J = 3, int(rng.integers(5, 40))
    w = rng.normal(size=(R, J)) * 3
    inputs = {"g": rng.normal(size=(R, J)), "w": w, "m": w.max(axis=1), "s": rng.uniform(0.5, 2.0, size=R)}
    ref, got = evaluate(prog, inputs)["gw"], evaluate(new, inputs)["gw"]
    scale = np.abs(inputs["g"]).sum(axis=1, keepdims=True) / inputs["s"][:, None]
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - ref) <= 1e-12 * scale), np.max(np.abs(got - ref))


def _chain(k):
    """x1 * x2 * ... * xk (per-row leaves): associativity and commutativity give every order."""
    t = Term("Par", ("n1",))
    for i in range(2, k + 1):
        t = Term("Mul", (t, Term("Par", (f"n{i}",))))
    return t


def test_a_rule_matching_too_often_is_skipped_and_reported():
    eg = EGraph(default_rules(()))
    eg.add(_chain(7))
    lim = Limits(iterations=8, nodes=100_000, seconds=60.0, match_limit=30, match_limit_from=0)
    stats = eg.saturate(schedules.NORMALIZE, lim)
    assert stats.skipped and set(stats.skipped) <= {r.name for r in eg.rules}
    assert "match limit" in stats.stop_reason or "match limit" in stats.phase_summary() \
        or stats.iterations == schedules.NORMALIZE.phases[0].max_iterations, stats.describe()
    assert stats.stop_reason != "saturated"
    # the same e-graph without the limit is larger: the limit did hold rules back
    eg2 = EGraph(default_rules(()))
    eg2.add(_chain(7))
    stats2 = eg2.saturate(schedules.NORMALIZE, dataclasses.replace(lim, match_limit=None))
    assert not stats2.skipped and stats2.nodes > stats.nodes


def test_without_the_limit_nothing_is_skipped_and_the_e_graph_is_the_same():
    """Below the match limit the scheduler changes nothing: same size as egglog's plain run."""
    sizes = []
    for ml in (None, 10_000_000):
        eg = EGraph(default_rules(()))
        eg.add(_chain(5))
        st = eg.saturate(schedules.NORMALIZE, Limits(iterations=6, nodes=100_000, seconds=60.0, match_limit=ml,
                                                     match_limit_from=0))
        assert not st.skipped
        sizes.append((st.nodes, st.stop_reason))
    assert sizes[0] == sizes[1]


def test_node_limit_is_checked_before_the_time_limit():
    """An iteration past both the time and the node limit is rolled back (the time limit was
    checked first and kept it: the 3.2-million e-node graph of the stall)."""
    eg = EGraph(default_rules(()))
    eg.add(_chain(7))
    stats = eg.saturate(schedules.NORMALIZE, Limits(iterations=8, nodes=30, seconds=0.0, rollback=True))
    assert stats.stop_reason.startswith("node limit") and "rolled back" in stats.stop_reason, stats.stop_reason
    assert stats.nodes <= 30 < stats.largest


@pytest.mark.slow
def test_fuzz_seed_1770245031_gradients():
    """The fuzz program itself, through af.backward and the gradient oracle (acefuse/fuzz_backward.py)."""
    import random
    from acefuse.fuzz_gen import Gen
    from acefuse.fuzz_ref import _uses
    from acefuse.fuzz_backward import PROFILES, make_grad_cases, run_grad_program, GradResult
    prng = random.Random(1770245031)
    w_axes = prng.choice([None, None, "j", "rj"])
    outputs = Gen(prng, w_axes).program(depth=prng.choice(range(1, PROFILES["short"]["depth"] + 1)))
    used = w_axes if any(_uses(nd, "w") for nd in outputs.values()) else None
    res = GradResult()
    t0 = time.perf_counter()
    run_grad_program(outputs, used, make_grad_cases(prng, PROFILES["short"], used), res, log=lambda *a: None)
    assert res.wrong == 0 and res.crashes == 0 and res.refused == 0 and res.grad_checks > 0, res.summary()
    assert time.perf_counter() - t0 < 120
