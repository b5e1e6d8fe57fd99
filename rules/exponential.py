"""Exponential and logarithm laws."""
from acefuse.rules.base import Theory, rw, tvars
from acefuse.rewrite.terms import exp, log

a, b = tvars("a b")

THEORY = Theory("exponential", __doc__, [
    rw("exp-add", exp(a + b), exp(a) * exp(b),
       float_unsafe="exp(a) or exp(b) alone can overflow float32 (argument > 88.7) when exp(a + b) does not"),
    rw("exp-sub", exp(a - b), exp(a) * exp(-b),
       float_unsafe="exp(a) or exp(-b) alone can overflow float32 (argument > 88.7) when exp(a - b) does not"),
    rw("exp-neg-sub", exp(-(a - b)), exp(b - a)),
])
