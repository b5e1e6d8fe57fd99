"""Certificates of derived merges: online softmax and parallel variance."""
import pytest

from acefuse.rewrite.terms import A, B, U, st, cnt, elm, rsum, rmax, max2, exp
from acefuse.proofs import certify, StateDef

x = elm("x")
AB = U(A, B)

# online softmax: m = max x, l = sum exp(x - m)
M = StateDef("m", "max", rmax(A, x))
L = StateDef("l", "sum", rsum(A, exp(x - st("m", A))))
SOFTMAX = [M, L]
m_A, m_B, m_AB = st("m", A), st("m", B), st("m", AB)
l_A, l_B = st("l", A), st("l", B)

# parallel variance: s1 = sum x, mu = s1 / n, s2 = sum (x - mu)^2
S1 = StateDef("s1", "sum", rsum(A, x))
MU = StateDef("mu", "ref", st("s1", A) / cnt(A))
S2 = StateDef("s2", "sum", rsum(A, (x - st("mu", A)) * (x - st("mu", A))))
VARIANCE = [S1, MU, S2]
mu_A, mu_B, mu_AB = st("mu", A), st("mu", B), st("mu", AB)


def sq(t):
    return t * t


CORRECT = {
    "max-merge": (SOFTMAX, "m", max2(m_A, m_B)),
    "softmax-split-merge": (SOFTMAX, "l", l_A * exp(m_A - m_AB) + l_B * exp(m_B - m_AB)),
    "softmax-rolling": (SOFTMAX, "l", l_A * exp(m_A - m_AB) + rsum(B, exp(x - m_AB))),
    "mean-merge": (VARIANCE, "mu", (st("s1", A) + st("s1", B)) / (cnt(A) + cnt(B))),
    "variance-split-merge": (VARIANCE, "s2", st("s2", A) + cnt(A) * sq(mu_AB - mu_A)
                             + st("s2", B) + cnt(B) * sq(mu_AB - mu_B)),
    "variance-rolling": (VARIANCE, "s2", st("s2", A) + cnt(A) * sq(mu_AB - mu_A)
                         + rsum(B, sq(x - mu_AB))),
}

WRONG = {
    "softmax-dropped-factor": (SOFTMAX, "l", l_A + l_B * exp(m_B - m_AB)),
    "softmax-sign-flip": (SOFTMAX, "l", l_A * exp(m_AB - m_A) + l_B * exp(m_B - m_AB)),
    "softmax-rolling-stale-max": (SOFTMAX, "l", l_A * exp(m_A - m_AB) + rsum(B, exp(x - m_B))),
    "variance-dropped-count": (VARIANCE, "s2", st("s2", A) + sq(mu_AB - mu_A)
                               + st("s2", B) + cnt(B) * sq(mu_AB - mu_B)),
    "variance-sign-flip": (VARIANCE, "s2", st("s2", A) - cnt(A) * sq(mu_AB - mu_A)
                           + st("s2", B) + cnt(B) * sq(mu_AB - mu_B)),
    "max-as-sum": (SOFTMAX, "m", m_A + m_B),
}


@pytest.mark.parametrize("case", sorted(CORRECT))
def test_correct_merge_is_certified(case):
    states, name, rhs = CORRECT[case]
    cert = certify(states, name, rhs)
    assert cert.status == "certified", cert.detail
    assert cert.sympy_ok is True and cert.float_ok
    assert cert.counterexample is None


@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_merge_fails_with_counterexample(case):
    states, name, rhs = WRONG[case]
    cert = certify(states, name, rhs)
    assert cert.status == "failed", cert.detail
    assert cert.float_ok is False and cert.sympy_ok is False
    cex = cert.counterexample
    assert cex and cex["|A|"] >= 1 and cex["|B|"] >= 1 and "x[1]" in cex
    assert cex["lhs"] != pytest.approx(cex["rhs"])


def test_unknown_state_is_a_clear_error():
    with pytest.raises(ValueError, match="only .* are defined"):
        certify([M], "m", max2(m_A, l_B))


# ---- symbolic in the block sizes ---------------------------------------------------------------
from acefuse.rewrite.terms import Term, cnt as _cnt, rmax as _rmax, num
from acefuse.proofs.certify import symbolic_check, certify_claim

S = StateDef("s", "sum", rsum(A, x))
J_ = Term("BJ")


def test_symbolic_check_proves_updates_for_all_block_sizes():
    for case in ("softmax-rolling", "softmax-split-merge", "variance-rolling", "variance-split-merge"):
        states, name, rhs = CORRECT[case]
        ok, why = symbolic_check({s.name: s for s in states}, st(name, AB), rhs)
        assert ok is True, (case, why)


def test_a_claim_true_only_on_small_blocks_is_not_proved():
    # zero whenever |A| <= 3: a fixed-size check on blocks (1,1), (2,3), (3,2) would accept it
    bump = (_cnt(A) - 1) * (_cnt(A) - 2) * (_cnt(A) - 3)
    rhs = st("s", A) + st("s", B) + bump
    ok, why = symbolic_check({"s": S}, st("s", AB), rhs)
    assert ok is None and "does not simplify" in why
    cert = certify([S], "s", rhs)
    assert cert.status == "failed" and cert.counterexample["|A|"] > 3


def test_outside_the_class_is_unproved_never_certified():
    # max_{AB}(2x) == 2 max(max_A x, max_B x) is true, but pulling a scale out of a max is
    # outside the generic-block class: the answer is "unproved"
    m2 = StateDef("m2", "max", _rmax(A, 2 * x))
    cert = certify([m2], "m2", 2 * max2(_rmax(A, x), _rmax(B, x)))
    assert cert.status == "unproved" and cert.float_ok and cert.sympy_ok is None


def test_program_level_claim_over_the_whole_axis():
    # mean as written vs a "normal form" that dropped the / size(j)
    mean = rsum(J_, x) / _cnt(J_)
    good = certify_claim([], x - mean, x - rsum(J_, x) * (num(1) / _cnt(J_)), "y", "normal form")
    bad = certify_claim([], x - mean, x - rsum(J_, x), "y", "normal form")
    assert good.status == "certified", good.detail
    assert bad.status == "failed" and bad.step == "normal form" and "|J|" in bad.detail


def test_a_union_of_a_block_with_itself_is_refused():
    with pytest.raises(ValueError, match="not a disjoint union"):
        certify([S], "s", st("s", U(A, A)))


def test_every_step_of_the_examples_is_certified_quickly():
    import runpy, time
    from pathlib import Path
    import acefuse as af
    root = Path(__file__).resolve().parents[1] / "examples"
    t0, n = time.perf_counter(), 0
    for path in sorted(root.glob("*.py")):
        if path.name.startswith("torch_"):
            continue
        ns = runpy.run_path(str(path))
        for name, prog in ns.items():
            if isinstance(prog, af.Program):
                cert = af.fuse(prog, rules=ns.get("RULES", ())).certificate
                assert cert.ok, (name, cert.summary())
                steps = {c.step for c in cert.steps}
                assert {"normal form", "init", "rolling", "merge"} <= steps, (name, steps)
                assert steps & {"finalize", "epilogue"}, (name, steps)
                n += 1
    assert n >= 15
    assert time.perf_counter() - t0 < 45
