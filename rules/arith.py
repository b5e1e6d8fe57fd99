"""Field arithmetic: identities and cancellation (terminating, size-reducing rules)."""
from acefuse.rules.base import Theory, rw, tvars, nonzero
from acefuse.rewrite.terms import num

a, b, c = tvars("a b c")
ZERO, ONE = num(0.0), num(1.0)
_OVER = "a / b overflows (or underflows to 0) in float32 for tiny (huge) b, so (a / b) * b is inf or NaN where a is finite"

THEORY = Theory("arith", __doc__, [
    rw("add-zero", a + ZERO, a),
    rw("zero-add", ZERO + a, a),
    rw("sub-zero", a - ZERO, a),
    rw("zero-sub", ZERO - a, -a),
    rw("mul-one", a * ONE, a),
    rw("one-mul", ONE * a, a),
    rw("mul-zero", a * ZERO, ZERO,
       float_unsafe="inf * 0 is NaN in floating point, not 0"),
    rw("zero-mul", ZERO * a, ZERO,
       float_unsafe="0 * inf is NaN in floating point, not 0"),
    rw("div-one", a / ONE, a),
    rw("sub-self", a - a, ZERO,
       float_unsafe="inf - inf is NaN in floating point (a fully masked row: -inf - -inf)"),
    rw("sub-add-cancel", (a + b) - (c + b), a - c,
       float_unsafe="inf - inf is NaN in floating point: with b = -inf the left side is NaN"),
    rw("neg-neg", -(-a), a),
    rw("neg-sub", -(a - b), b - a),
    rw("sub-neg", a - (-b), a + b),
    rw("add-neg", a + (-b), a - b),
    rw("div-mul-cancel", (a / b) * b, a, when=[nonzero(b)], float_unsafe=_OVER),
    rw("mul-div-cancel", b * (a / b), a, when=[nonzero(b)], float_unsafe=_OVER),
])
