"""Factoring: the inverse of distributivity, and pulling a common divisor out of a sum.
Run only in the normal-form schedule (with distributivity it would cycle)."""
from acefuse.rules.base import Theory, rw, tvars

a, b, c = tvars("a b c")
_CANCEL = ("the factored and the expanded form round differently: a * c + b * c can overflow or cancel "
           "where (a + b) * c does not")
_DIV = "a / c + b / c can overflow (or cancel) in float32 where (a + b) / c does not"

THEORY = Theory("factoring", __doc__, [
    rw("factor-sub-right", a * c - b * c, (a - b) * c, float_unsafe=_CANCEL),
    rw("factor-add-right", a * c + b * c, (a + b) * c, float_unsafe=_CANCEL),
    rw("div-add", (a + b) / c, a / c + b / c, float_unsafe=_DIV),
])
