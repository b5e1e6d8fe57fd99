"""Linearity of reductions and factoring of invariants: a sum of a sum (or
difference) is the sum (difference) of the sums, and a term that does not depend
on the reduced element (``Inv``, rules/analysis.py) moves out of a reduction."""
from acefuse.rules.base import Theory, rw, tvars, bvars, inv
from acefuse.rewrite.terms import cnt, rsum, rmax, rmin

f, g, k = tvars("f g k")
s, = bvars("s")
_REGROUP = "sum f + sum g rounds each sum first: with f close to -g it can lose every bit that sum (f + g) keeps"
_SCALE = "f * k per element can overflow (or underflow) float32 where (sum f) * k does not, or the reverse"

THEORY = Theory("linearity", __doc__, [
    # -- linearity ----------------------------------------------------------------------
    rw("sum-add", rsum(s, f + g), rsum(s, f) + rsum(s, g), float_unsafe=_REGROUP),
    rw("sum-sub", rsum(s, f - g), rsum(s, f) - rsum(s, g),
       float_unsafe="the difference of two rounded sums can cancel catastrophically"),
    rw("sum-neg", rsum(s, -f), -rsum(s, f)),
    # -- factor an invariant ----------------------------------------------------------
    rw("sum-factor-right", rsum(s, f * k), rsum(s, f) * k, when=[inv(k)], float_unsafe=_SCALE),
    rw("sum-factor-left", rsum(s, k * f), k * rsum(s, f), when=[inv(k)], float_unsafe=_SCALE),
    rw("sum-factor-div", rsum(s, f / k), rsum(s, f) / k, when=[inv(k)], float_unsafe=_SCALE),
    rw("sum-invariant", rsum(s, k), k * cnt(s), when=[inv(k)]),
    rw("max-shift-add", rmax(s, f + k), rmax(s, f) + k, when=[inv(k)]),
    rw("max-shift-sub", rmax(s, f - k), rmax(s, f) - k, when=[inv(k)]),
    rw("min-shift-add", rmin(s, f + k), rmin(s, f) + k, when=[inv(k)]),
    rw("min-shift-sub", rmin(s, f - k), rmin(s, f) - k, when=[inv(k)]),
])
