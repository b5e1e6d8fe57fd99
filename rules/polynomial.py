"""Polynomial algebra: expanding the square and the cube of a difference (the binomial
formula), the expansions the derivation of additive corrections needs.

Unlike the general distributivity rules (distrib.py), they only fire on a product
of a class with itself, so they add a bounded number of terms."""
from acefuse.rules.base import Theory, rw, tvars
from acefuse.rewrite.terms import num

a, b = tvars("a b")
_CANCEL = "the expanded square is a difference of large terms and can cancel where (a - b)^2 does not"

THEORY = Theory("polynomial", __doc__, [
    rw("square-sub", (a - b) * (a - b), (a * a - num(2.0) * (a * b)) + b * b, float_unsafe=_CANCEL),
    # every term a monomial in a times a power of b, coefficients outside: the shape that
    # linearity factors when b does not depend on the element (sum (x - m)**3)
    rw("cube-sub", ((a - b) * (a - b)) * (a - b),
       ((a * a) * a - num(3.0) * ((a * a) * b)) + (num(3.0) * (a * (b * b)) - (b * b) * b),
       float_unsafe="the expanded cube is a sum of large terms of both signs and can cancel where (a - b)^3 does not"),
])
