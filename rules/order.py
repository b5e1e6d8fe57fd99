"""Max and min as a lattice: commutativity, and shifting by an invariant."""
from acefuse.rules.base import Theory, rw, tvars
from acefuse.rewrite.terms import max2, min2

a, b, c = tvars("a b c")

THEORY = Theory("order", __doc__, [
    rw("max2-comm", max2(a, b), max2(b, a)),
    rw("min2-comm", min2(a, b), min2(b, a)),
    rw("max2-self", max2(a, a), a),
    rw("min2-self", min2(a, a), a),
])
