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
