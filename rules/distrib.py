"""Distributivity, expanding direction (products of sums become sums of products)."""
from acefuse.rules.base import Theory, rw, tvars

a, b, c = tvars("a b c")
_CANCEL = ("expanded products can cancel (or overflow: a * b + a * c with b close to -c) "
           "where the factored form does not")

THEORY = Theory("distrib", __doc__, [
    rw("distribute-mul-sub", a * (b - c), a * b - a * c, float_unsafe=_CANCEL),
    rw("distribute-sub-mul", (a - b) * c, a * c - b * c, float_unsafe=_CANCEL),
    rw("distribute-mul-add", a * (b + c), a * b + a * c, float_unsafe=_CANCEL),
    rw("distribute-add-mul", (a + b) * c, a * c + b * c, float_unsafe=_CANCEL),
])
