"""Commutativity and full associativity: complete but explosive, so they run only
in the program normal-form schedule, on small terms."""
from acefuse.rules.base import Theory, rw, tvars

a, b, c = tvars("a b c")
_REASSOC = "re-associates rounded operations; the result can differ in the last bits"

THEORY = Theory("commute", __doc__, [
    rw("add-comm", a + b, b + a),
    rw("mul-comm", a * b, b * a),
    rw("add-assoc", a + (b + c), (a + b) + c, float_unsafe=_REASSOC),
    rw("mul-assoc", a * (b * c), (a * b) * c, float_unsafe=_REASSOC),
])
