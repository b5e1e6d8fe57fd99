"""Reduction laws over blocks of the reduced axis: splitting a reduction over a
union of disjoint blocks, and the *shift by a candidate*: a value over a union of
blocks equals its block-local counterpart plus a difference (``c = d + (c - d)``);
candidates are the state terms only, which keeps the rule bounded.

Linearity and factoring of invariants are in linearity.py (a later phase)."""
from acefuse.rules.base import Theory, rw, tvars, bvars
from acefuse.rewrite.terms import U, st, cnt, rsum, rmax, rmin, max2, min2

f, = tvars("f")
s1, s2 = bvars("s1 s2")
q = "?q"
_REGROUP = ("regroups a rounded sum: with cancellation between the parts one grouping can lose every "
            "significant bit the other keeps")
_SHIFT = "st_A + (st_AB - st_A) is NaN in floating point when st_A is infinite (a fully masked block: -inf)"

THEORY = Theory("reduction", __doc__, [
    # -- split over a union of disjoint blocks ----------------------------------------
    rw("sum-split", rsum(U(s1, s2), f), rsum(s1, f) + rsum(s2, f), float_unsafe=_REGROUP),
    rw("max-split", rmax(U(s1, s2), f), max2(rmax(s1, f), rmax(s2, f))),
    rw("min-split", rmin(U(s1, s2), f), min2(rmin(s1, f), rmin(s2, f))),
    rw("count-split", cnt(U(s1, s2)), cnt(s1) + cnt(s2)),
    # -- shift by a candidate ----------------------------------------------------------
    rw("shift-by-left-part", st(q, U(s1, s2)), st(q, s1) + (st(q, U(s1, s2)) - st(q, s1)), float_unsafe=_SHIFT),
    rw("shift-by-right-part", st(q, U(s1, s2)), st(q, s2) + (st(q, U(s1, s2)) - st(q, s2)), float_unsafe=_SHIFT),
])
