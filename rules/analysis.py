"""Analyses: facts about e-classes that side conditions and the cost model read.

Inv(t)      t does not depend on the reduced element
NonZero(t)  t is never zero
Le(a, b)    a <= b
UB(m, e, s) m >= e for every element of block s
"""
from acefuse.rules.base import Theory, infer, tvars, bvars, inv, nonzero, le, ub, SELF
from acefuse.rewrite.terms import Term, st, cnt, rsum, rmax, rmin, max2, min2, exp, log, sqrt, rsqrt, absf, tanh

a, b, e, f = tvars("a b e f")
s, s1, s2 = bvars("s s1 s2")
k = "?k"

THEORY = Theory("analysis", __doc__, [
    # -- invariance: leaves and closed forms ---------------------------------------
    infer("inv-state", st(k, s), inv(SELF)),
    infer("inv-count", cnt(s), inv(SELF)),
    infer("inv-param", Term("Par", ("?k",)), inv(SELF)),
    infer("inv-num", Term("Num", (Term("?", ("c", "f64")),)), inv(SELF)),
    infer("inv-sum", rsum(s, f), inv(SELF)),
    infer("inv-max", rmax(s, f), inv(SELF)),
    infer("inv-min", rmin(s, f), inv(SELF)),
    # -- invariance is closed under the elementwise operators -----------------------
    infer("inv-add", a + b, inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-sub", a - b, inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-mul", a * b, inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-div", a / b, inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-neg", -a, inv(SELF), when=[inv(a)]),
    infer("inv-exp", exp(a), inv(SELF), when=[inv(a)]),
    infer("inv-log", log(a), inv(SELF), when=[inv(a)]),
    infer("inv-sqrt", sqrt(a), inv(SELF), when=[inv(a)]),
    infer("inv-rsqrt", rsqrt(a), inv(SELF), when=[inv(a)]),
    infer("inv-abs", absf(a), inv(SELF), when=[inv(a)]),
    infer("inv-tanh", tanh(a), inv(SELF), when=[inv(a)]),
    infer("inv-max2", max2(a, b), inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-min2", min2(a, b), inv(SELF), when=[inv(a), inv(b)]),
    # -- non-zero --------------------------------------------------------------------
    infer("nonzero-count", cnt(s), nonzero(SELF)),
    infer("nonzero-exp", exp(a), nonzero(SELF),
          float_unsafe="exp(a) underflows to 0 in float32 for a < -103.9 (exp(-104) == 0)"),
    infer("nonzero-mul", a * b, nonzero(SELF), when=[nonzero(a), nonzero(b)],
          float_unsafe="a * b underflows to 0 in float32 when |a * b| < 1e-45 (a = b = 1e-30)"),
    # -- order between invariant values ------------------------------------------------
    infer("le-max2-left", max2(a, b), le(a, SELF)),
    infer("le-max2-right", max2(a, b), le(b, SELF)),
    infer("le-min2-left", min2(a, b), le(SELF, a)),
    infer("le-min2-right", min2(a, b), le(SELF, b)),
    # -- upper bounds of elements: m >= e on block s ---------------------------------
    infer("ub-max", rmax(s, e), ub(SELF, e, s)),
    infer("ub-max2-left", max2(a, b), ub(SELF, e, s), when=[ub(a, e, s)]),
    infer("ub-max2-right", max2(a, b), ub(SELF, e, s), when=[ub(b, e, s)]),
])
