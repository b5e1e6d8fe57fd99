"""Re-association and commutation of + and * (orientations that move an invariant
operand outwards, so that a reduction can factor it)."""
from acefuse.rules.base import Theory, rw, tvars

a, b, c = tvars("a b c")
_REASSOC = "re-associates rounded operations; the result can differ in the last bits"

THEORY = Theory("assoc", __doc__, [
    rw("sub-add-assoc", a - (b + c), (a - b) - c, float_unsafe=_REASSOC),
    rw("mul-div-assoc", a * (b / c), (a * b) / c, float_unsafe=_REASSOC),
    rw("div-mul-swap", (a / c) * b, (a * b) / c, float_unsafe=_REASSOC),
])
