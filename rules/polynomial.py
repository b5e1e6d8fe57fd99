"""Polynomial algebra: expanding the square of a difference (the binomial formula), the one expansion the derivation of additive corrections needs.

Unlike the general distributivity rules (distrib.py), it only fires on a product
of a class with itself, so it adds a bounded number of terms."""
from acefuse.rules.base import Theory, rw, tvars
from acefuse.rewrite.terms import num

a, b = tvars("a b")
_CANCEL = "the expanded square is a difference of large terms and can cancel where (a - b)^2 does not"

THEORY = Theory("polynomial", __doc__, [
    rw("square-sub", (a - b) * (a - b), (a * a - num(2.0) * (a * b)) + b * b, float_unsafe=_CANCEL),
])
