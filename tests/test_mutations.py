"""Deliberately wrong rules are refuted with a counterexample; the loader refuses them."""
import pytest

from acefuse.rules import rw, infer, tvars, bvars, inv, nonzero, le, ub, pos, SELF
from acefuse.rewrite.terms import U, elm, num, cnt, rsum, rmax, rmin, max2, exp, log, sqrt, absf
from acefuse.proofs import prove_rule, require_proved, UnprovedRuleError

a, b, c, e, f, g, k = tvars("a b c e f g k")
s, s1, s2 = bvars("s s1 s2")
n = cnt(s)
p1, p2, p3 = rsum(s, f), rsum(s, f * f), rsum(s, f * (f * f))

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

# true on blocks of 1-3 (or 1-2) elements only: must be refuted on a larger block, never proved
SMALL_BLOCKS = [
    rw("small-count-cubic", (n - 1) * ((n - 2) * (n - 3)), num(0)),
    # Newton's identity with e4 = 0: the 4th power sum from the first three, for |s| <= 3
    rw("small-power-sum-4", rsum(s, (f * f) * (f * f)),
       (p1 * p1 * p1 * p1 - num(6) * (p1 * p1 * p2) + num(3) * (p2 * p2) + num(8) * (p1 * p3)) / num(6)),
    rw("small-variance-times-n", rsum(s, (f - p1 / n) * (f - p1 / n)) * ((n - 1) * (n - 2)), num(0)),
    rw("small-max-is-sum-minus-min", rmax(s, f), rsum(s, f) - rmin(s, f) - (rsum(s, f) - rmax(s, f) - rmin(s, f))
       + (n - 1) * ((n - 2) * (n - 3))),
]

# unions that double count, or unions of blocks not known disjoint
UNIONS_REFUTED = [
    rw("union-count-twice", cnt(U(s1, s2)), cnt(s1) + cnt(s1)),
    rw("union-sum-keeps-union", rsum(U(s1, s2), f), rsum(s1, f) + rsum(U(s1, s2), f)),
    rw("union-max-as-sum", rmax(U(s1, s2), f), rmax(s1, f) + rmax(s2, f)),
]
UNIONS_NOT_DISJOINT = [  # true only for disjoint blocks, and the lhs does not establish it
    rw("union-count-intro", cnt(s1) + cnt(s2), cnt(U(s1, s2))),
    rw("union-sum-intro", rsum(s1, f) + rsum(s2, f), rsum(U(s1, s2), f)),
    infer("union-ub-intro", max2(rmax(s1, e), rmax(s2, e)), ub(SELF, e, U(s1, s2))),
]

# dropped domain conditions, and conditions on the wrong variable
DOMAIN = [
    rw("domain-sqrt-mul", sqrt(a) * sqrt(b), sqrt(a * b)),
    rw("domain-div-self", (a * b) / b, a),
    rw("domain-sum-sqrt-square", rsum(s, sqrt(f) * sqrt(f)), rsum(s, f)),
    rw("wrong-var-log-mul", log(a * b), log(a) + log(b), when=[pos(c), nonzero(a)]),
    rw("wrong-var-div-cancel", (a / b) * b, a, when=[nonzero(a)]),
    rw("wrong-var-sum-factor", rsum(s, f * k), rsum(s, f) * k, when=[inv(f)]),
    rw("wrong-var-max-scale", rmax(s, f * k), rmax(s, f) * k, when=[inv(k), pos(a)]),
]

RIGHT = [  # controls: the same shapes with the side condition they need
    rw("ok-log-mul", log(a * b), log(a) + log(b),
       when=[le(num(0), a), nonzero(a), le(num(0), b), nonzero(b)]),
    rw("ok-sqrt-square", sqrt(a * a), absf(a)),
    rw("ok-div-cancel", (a / b) * b, a, when=[nonzero(b)]),
    rw("ok-max-scale", rmax(s, f * k), rmax(s, f) * k, when=[inv(k), le(num(0), k)]),
    rw("ok-max-shift", rmax(s, f + k), rmax(s, f) + k, when=[inv(k)]),
    infer("ok-ub-max2", max2(a, b), ub(SELF, e, s), when=[ub(b, e, s)]),
    # side conditions decided semantically: pos(t) is le(0, t) and nonzero(t)
    rw("ok-log-mul-pos", log(a * b), log(a) + log(b), when=[pos(a), pos(b)]),
    rw("ok-log-mul-one-pos", log(a * b), log(a) + log(b), when=[pos(a)]),  # then b > 0 on both sides
    rw("ok-log-div-pos", log(a / b), log(a) - log(b), when=[pos(a), pos(b)]),
    # laws for all block sizes that need induction, and unions matched in the lhs
    rw("ok-sum-double", rsum(s, f + f), num(2.0) * rsum(s, f)),
    rw("ok-sum-add-sub", rsum(s, (f + g) - g), rsum(s, f)),
    rw("ok-count-split-swapped", cnt(U(s1, s2)), cnt(U(s2, s1))),
    rw("ok-union-split-rebuild", rsum(U(s1, s2), f) - rsum(s1, f), rsum(s2, f)),
    rw("ok-max-of-min-shift", rmin(s, f - k), rmin(s, f) - k, when=[inv(k)]),
    # the variance identity: the body holds a sum over the same block (sums are linear)
    rw("ok-variance-identity", rsum(s, (f - p1 / n) * (f - p1 / n)), p2 - p1 * p1 / n),
    # a fact for all sizes by induction, with the bound as hypothesis
    infer("ok-sum-below-count-times-bound", rsum(s, f), le(SELF, n * k), when=[ub(k, f, s), inv(k)]),
    # blocks not known disjoint are fine when no union is built
    rw("ok-two-blocks-commute", rsum(s1, f) + rsum(s2, f), rsum(s2, f) + rsum(s1, f)),
]


@pytest.mark.parametrize("rule", WRONG, ids=lambda r: r.name)
def test_wrong_rule_is_refuted(rule):
    res = prove_rule(rule, use_cache=False)
    assert res.status == "refuted", res.summary()
    assert res.counterexample, f"{rule.name}: refuted without a counterexample"
    assert res.detail


@pytest.mark.parametrize("rule", SMALL_BLOCKS, ids=lambda r: r.name)
def test_law_of_small_blocks_is_refuted_beyond_them(rule):
    res = prove_rule(rule, use_cache=False)
    assert res.status == "refuted", res.summary()
    true_up_to = 2 if "variance" in rule.name else 3
    assert res.counterexample["|s|"] > true_up_to, res.counterexample


@pytest.mark.parametrize("rule", UNIONS_REFUTED + DOMAIN, ids=lambda r: r.name)
def test_union_and_domain_mutations_are_refuted(rule):
    res = prove_rule(rule, use_cache=False)
    assert res.status == "refuted", res.summary()
    assert res.counterexample


@pytest.mark.parametrize("rule", UNIONS_NOT_DISJOINT, ids=lambda r: r.name)
def test_union_of_blocks_not_known_disjoint_is_refused(rule):
    res = prove_rule(rule, use_cache=False)
    assert res.status == "unproved", res.summary()
    assert "disjoint" in res.detail
    with pytest.raises(UnprovedRuleError, match="disjoint"):
        require_proved([rule])


def test_rewrite_between_blocks_is_outside_the_class():
    res = prove_rule(rw("union-comm-blocks", U(s1, s2), U(s2, s1)), use_cache=False)
    assert res.status == "unproved" and "sort Blk" in res.detail


def test_float_tag_is_derived_and_mismatch_reported():
    from acefuse.rewrite.terms import Term
    undeclared = rw("my-exp-add", exp(a + b), exp(a) * exp(b))
    res = prove_rule(undeclared, use_cache=False)
    assert res.ok and res.float_kind == "range" and "declared float-safe" in res.float_note
    fact = infer("my-nonzero-exp", exp(a), nonzero(SELF))
    res = prove_rule(fact, use_cache=False)
    assert res.ok and res.float_kind == "range" and "0 in float32" in res.float_unsafe
    over_declared = rw("my-add-comm", a + b, b + a, float_unsafe="not really")
    res = prove_rule(over_declared, use_cache=False)
    assert res.ok and res.float_unsafe == "not really" and "no float32 counterexample" in res.float_note
    reassoc = rw("my-add-assoc", a + (b + c), (a + b) + c)
    res = prove_rule(reassoc, use_cache=False)
    assert res.float_kind in ("rounding", "range") and res.float_note
    fine = rw("my-neg-neg", -(-a), a)
    res = prove_rule(fine, use_cache=False)
    assert res.float_unsafe == "" and res.float_note == ""


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
