"""Factoring: the inverse of distributivity, and pulling a common divisor out of a sum.
Run only in the normal-form schedule (with distributivity it would cycle)."""
from acefuse.rules.base import Theory, rw, tvars

a, b, c = tvars("a b c")

THEORY = Theory("factoring", __doc__, [
    rw("factor-sub-right", a * c - b * c, (a - b) * c),
    rw("factor-add-right", a * c + b * c, (a + b) * c),
    rw("div-add", (a + b) / c, a / c + b / c),
])
