"""A sum shifted by its own max, and reading it back as one logarithm.

``l = sum_s(exp(f - max_s f))`` is at least 1: the element that attains the max contributes
``exp(0) = 1`` and every other one ``exp(.) > 0`` (shifted-sum-ge-one; proved by induction over
the block, proofs/induction.py). So ``l > 0`` (pos-of-ge-one), the safe reciprocal ``r(l)`` is ``1 / l`` and
``r(l) * l = 1`` (div-mul-cancel): the *shift invariance* of softmax-shaped programs, whose
max's adjoint ``g * (1 - l * r(l))`` is 0; and ``exp(b - m) / l = exp(b - (m + log l))``
(exp-div-log), so a backward reads one saved value ``m + log(l)`` instead of ``m`` and ``l``.

The backward's normal forms (acefuse/backward_normal.py, acefuse/backward_shift.py) apply these laws over named axes and
cite them by name; they apply them only while ``acefuse prove`` proves them. In the e-graph they
run in the ``backward-normal`` schedule (rewrite/schedules.py), not in the forward's: there
``exp-div-log`` would trade softmax's one division per row for a log.
"""
from acefuse.rules.base import Theory, rw, infer, tvars, bvars, le, nonzero, pos, SELF
from acefuse.rewrite.terms import rsum, rmax, exp, log, num

f, a, b, c = tvars("f a b c")
s, = bvars("s")

THEORY = Theory("shifted", __doc__, [
    infer("shifted-sum-ge-one", rsum(s, exp(f - rmax(s, f))), le(num(1.0), SELF)),
    infer("pos-of-ge-one", a, [le(num(0.0), SELF), nonzero(SELF)], when=[le(num(1.0), a)]),
    rw("exp-div-log", exp(a - b) / c, exp(a - (b + log(c))), when=[pos(c)],
       float_unsafe="exp(a - b) alone can overflow float32 (a - b > 88.7) where exp(a - (b + log c)) does not"),
])
