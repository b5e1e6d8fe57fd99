"""Max and min as a lattice: commutativity, and shifting by an invariant; selecting the
elements equal to an upper bound (argmax: proofs/order.py decides it)."""
from acefuse.rules.base import Theory, rw, tvars, bvars, inv, le, ub
from acefuse.rewrite.terms import Term, max2, min2, rmin

a, b, c = tvars("a b c")
f, g, k, d = tvars("f g k d")
s, = bvars("s")


def _where_eq(x, y, then, other):
    return Term("Where", (Term("CmpEq", (x, y)), then, other))

THEORY = Theory("order", __doc__, [
    rw("max2-comm", max2(a, b), max2(b, a)),
    rw("min2-comm", min2(a, b), min2(b, a)),
    rw("max2-self", max2(a, a), a),
    rw("min2-self", min2(a, a), a),
    # the elements of s equal to c, an upper bound of f that is >= d >= every f on s: none unless
    # d == c, and then those equal to d (the first index of a maximum, from a block's own max)
    rw("min-where-eq-bound", rmin(s, _where_eq(f, c, g, k)), _where_eq(d, c, rmin(s, _where_eq(f, d, g, k)), k),
       when=[ub(d, f, s), le(d, c), inv(c), inv(d), inv(k)]),
])
