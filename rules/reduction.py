"""Reduction laws over blocks of the reduced axis.

Splitting a reduction over a union of disjoint blocks, linearity of sums,
factoring a term that does not depend on the reduced element out of a reduction,
and the *shift by a candidate*: a value over a union of blocks equals its
block-local counterpart plus a difference (``c = d + (c - d)``); candidates are
the state terms only, which keeps the rule bounded.
"""
from acefuse.rules.base import Theory, rw, tvars, bvars, inv
from acefuse.rewrite.terms import U, st, cnt, rsum, rmax, rmin, max2, min2

f, g, k = tvars("f g k")
s, s1, s2 = bvars("s s1 s2")
q = "?q"

THEORY = Theory("reduction", __doc__, [
    # -- split over a union of disjoint blocks ----------------------------------------
    rw("sum-split", rsum(U(s1, s2), f), rsum(s1, f) + rsum(s2, f)),
    rw("max-split", rmax(U(s1, s2), f), max2(rmax(s1, f), rmax(s2, f))),
    rw("min-split", rmin(U(s1, s2), f), min2(rmin(s1, f), rmin(s2, f))),
    rw("count-split", cnt(U(s1, s2)), cnt(s1) + cnt(s2)),
    # -- linearity ----------------------------------------------------------------------
    rw("sum-add", rsum(s, f + g), rsum(s, f) + rsum(s, g)),
    rw("sum-sub", rsum(s, f - g), rsum(s, f) - rsum(s, g),
       float_unsafe="the difference of two rounded sums can cancel catastrophically"),
    rw("sum-neg", rsum(s, -f), -rsum(s, f)),
    # -- factor an invariant ----------------------------------------------------------
    rw("sum-factor-right", rsum(s, f * k), rsum(s, f) * k, when=[inv(k)]),
    rw("sum-factor-left", rsum(s, k * f), k * rsum(s, f), when=[inv(k)]),
    rw("sum-factor-div", rsum(s, f / k), rsum(s, f) / k, when=[inv(k)]),
    rw("sum-invariant", rsum(s, k), k * cnt(s), when=[inv(k)]),
    rw("max-shift-add", rmax(s, f + k), rmax(s, f) + k, when=[inv(k)]),
    rw("max-shift-sub", rmax(s, f - k), rmax(s, f) - k, when=[inv(k)]),
    rw("min-shift-add", rmin(s, f + k), rmin(s, f) + k, when=[inv(k)]),
    rw("min-shift-sub", rmin(s, f - k), rmin(s, f) - k, when=[inv(k)]),
    # -- shift by a candidate ----------------------------------------------------------
    rw("shift-by-left-part", st(q, U(s1, s2)), st(q, s1) + (st(q, U(s1, s2)) - st(q, s1))),
    rw("shift-by-right-part", st(q, U(s1, s2)), st(q, s2) + (st(q, U(s1, s2)) - st(q, s2))),
])
