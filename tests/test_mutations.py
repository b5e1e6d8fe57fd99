"""Deliberately wrong rules are refuted with a counterexample; the loader refuses them."""
import pytest

from acefuse.rules import rw, infer, tvars, bvars, inv, nonzero, le, ub, SELF
from acefuse.rewrite.terms import U, elm, num, rsum, rmax, max2, exp, log, sqrt, absf
from acefuse.proofs import prove_rule, require_proved, UnprovedRuleError

a, b, c, e, f, k = tvars("a b c e f k")
s, s1, s2 = bvars("s s1 s2")

WRONG = [
    # a sign flipped
    rw("wrong-sub-add-assoc", a - (b + c), (a - b) + c),
    rw("wrong-neg-sub", -(a - b), a - b),
    # a missing correction / a lost part
    rw("wrong-max-split-as-sum", rmax(U(s1, s2), f), rmax(s1, f) + rmax(s2, f)),
    rw("wrong-sum-split-drops-part", rsum(U(s1, s2), f), rsum(s1, f)),
    rw("wrong-sum-invariant-no-count", rsum(s, k), k, when=[inv(k)]),
    # a side condition dropped: f and k are then both per-element
    rw("wrong-sum-factor-no-inv", rsum(s, f * k), rsum(s, f) * k),
    rw("wrong-max-shift-no-inv", rmax(s, f + k), rmax(s, f) + k),
    # a wrong exponential law
    rw("wrong-exp-mul", exp(a * b), exp(a) * exp(b)),
    # factoring a term that depends on the element
    rw("wrong-factor-element", rsum(s, k * f), rsum(s, k) * f, when=[inv(k)]),
    rw("wrong-factor-elm-leaf", rsum(s, f * elm("x")), rsum(s, f) * elm("x")),
    # max is not linear: needs k >= 0
    rw("wrong-max-scale", rmax(s, f * k), rmax(s, f) * k, when=[inv(k)]),
    # domain assumptions the rule does not state
    rw("wrong-log-mul", log(a * b), log(a) + log(b)),
    rw("wrong-sqrt-square", sqrt(a * a), a),
    rw("wrong-div-cancel-no-nonzero", (a / b) * b, a),
    # wrong analysis facts
    infer("wrong-nonzero-add", a + b, nonzero(SELF), when=[nonzero(a), nonzero(b)]),
    infer("wrong-inv-add", a + b, inv(SELF), when=[inv(a)]),
    infer("wrong-ub-sum", rsum(s, e), ub(SELF, e, s)),
    infer("wrong-le-min", max2(a, b), le(SELF, a)),
]

RIGHT = [  # controls: the same shapes with the side condition they need
    rw("ok-log-mul", log(a * b), log(a) + log(b),
       when=[le(num(0), a), nonzero(a), le(num(0), b), nonzero(b)]),
    rw("ok-sqrt-square", sqrt(a * a), absf(a)),
    rw("ok-div-cancel", (a / b) * b, a, when=[nonzero(b)]),
    rw("ok-max-scale", rmax(s, f * k), rmax(s, f) * k, when=[inv(k), le(num(0), k)]),
    rw("ok-max-shift", rmax(s, f + k), rmax(s, f) + k, when=[inv(k)]),
    infer("ok-ub-max2", max2(a, b), ub(SELF, e, s), when=[ub(b, e, s)]),
]


@pytest.mark.parametrize("rule", WRONG, ids=lambda r: r.name)
def test_wrong_rule_is_refuted(rule):
    res = prove_rule(rule, use_cache=False)
    assert res.status == "refuted", res.summary()
    assert res.counterexample, f"{rule.name}: refuted without a counterexample"
    assert res.detail


@pytest.mark.parametrize("rule", RIGHT, ids=lambda r: r.name)
def test_control_rule_is_proved(rule):
    res = prove_rule(rule, use_cache=False)
    assert res.status == "proved", res.summary()


def test_require_proved_names_the_rule():
    bad = WRONG[0]
    with pytest.raises(UnprovedRuleError) as exc:
        require_proved([RIGHT[0], bad])
    msg = str(exc.value)
    assert bad.name in msg and "counterexample" in msg and "allow_unproved=True" in msg
    assert isinstance(exc.value, ValueError)
    assert [r.name for r in exc.value.results] == [bad.name]


def test_require_proved_passes_sound_rules():
    results = require_proved(RIGHT)
    assert all(r.status == "proved" for r in results)


def test_opt_out_warns_loudly(capsys):
    results = require_proved([WRONG[2]], allow_unproved=True)
    assert results[0].status == "refuted"
    err = capsys.readouterr().err
    assert "WARNING" in err and WRONG[2].name in err
