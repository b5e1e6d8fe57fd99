"""Swapping operands of a product so that a factor which does not depend on the
reduced element moves to the outer level, where a reduction can factor it out
(``sum_S((p * c) * v) = sum_S(p * v) * c``). Runs both before and after the
exponential laws, since those create new invariant factors."""
from acefuse.rules.base import Theory, rw, tvars

a, b, c = tvars("a b c")
_REASSOC = "re-associates rounded operations; the result can differ in the last bits"

THEORY = Theory("swap", __doc__, [
    rw("mul-swap-right", (a * b) * c, (a * c) * b, float_unsafe=_REASSOC),
])
