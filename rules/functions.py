"""Special functions, rounding and integer operators: invariance is closed under them.

A function of values that do not depend on the reduced element does not depend on it
either (``sigmoid(m_A)`` in ``sum_A(exp(x - m_A) * sigmoid(m_A))`` is a per-block
constant the factoring rules can move out of the sum). Nothing else is claimed about
these operators: the rewrites treat them as opaque functions of their arguments.
Runs in every phase's analysis, beside the analysis theory (rewrite/schedules.py).
"""
from acefuse.rules.base import Theory, infer, tvars, inv, SELF
from acefuse.rewrite.terms import Term

a, b = tvars("a b")


def _f(op, *args):
    return Term(op, tuple(args))


THEORY = Theory("functions", __doc__, [
    # -- special functions -----------------------------------------------------------------
    infer("inv-erf", _f("Erf", a), inv(SELF), when=[inv(a)]),
    infer("inv-sigmoid", _f("Sigmoid", a), inv(SELF), when=[inv(a)]),
    infer("inv-softplus", _f("Softplus", a), inv(SELF), when=[inv(a)]),
    infer("inv-log1p", _f("Log1p", a), inv(SELF), when=[inv(a)]),
    infer("inv-expm1", _f("Expm1", a), inv(SELF), when=[inv(a)]),
    # -- rounding ------------------------------------------------------------------------------
    infer("inv-floor", _f("Floor", a), inv(SELF), when=[inv(a)]),
    infer("inv-ceil", _f("Ceil", a), inv(SELF), when=[inv(a)]),
    infer("inv-round", _f("Round", a), inv(SELF), when=[inv(a)]),
    # -- integer operators -----------------------------------------------------------------------
    infer("inv-floor-div", _f("FloorDiv", a, b), inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-mod", _f("Mod", a, b), inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-bit-and", _f("BitAnd", a, b), inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-bit-or", _f("BitOr", a, b), inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-bit-xor", _f("BitXor", a, b), inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-bit-not", _f("BitNot", a), inv(SELF), when=[inv(a)]),
    infer("inv-shl", _f("Shl", a, b), inv(SELF), when=[inv(a), inv(b)]),
    infer("inv-shr", _f("Shr", a, b), inv(SELF), when=[inv(a), inv(b)]),
])
