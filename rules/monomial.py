"""Monomials: moving an invariant coefficient (``Inv``: it does not depend on the reduced
element) of a nested product to the outside, so that a reduction can factor it out.

The binomial expansion (rules/polynomial.py) leaves coefficients inside products:
``((x - m_A) - e)^2 * w`` expands to ``... - (2 * ((x - m_A) * e)) * w``, where linearity
can factor neither the 2 nor ``e``. ``(k * a) * b = k * (a * b)`` moves the coefficient
out (``2 * (((x - m_A) * e) * w)``), after which linearity and ``mul-swap-right`` leave
``2 * (sum_A((x - m_A) * w) * e)``: a monomial over the elements whose block sum is a
candidate auxiliary state (rewrite/auxiliary.py).

Only this orientation: the others (``a * (k * b)``, ``a * (b * k)``) also pull invariant
factors out of the second operand, and with ``mul-swap-right`` they multiply the forms of
every product of exponentials (measured: the Renyi-2 entropy of a softmax went from 334
to 48,852 e-nodes, 0.6 s to 13 s to derive). The theory runs in the ``factor`` phase of
the auxiliary-discovery schedule only (rewrite/schedules.py, ``DERIVE_AUXILIARY``):
programs that fuse without auxiliary states never see it."""
from acefuse.rules.base import Theory, rw, tvars, inv

a, b, k = tvars("a b k")
_REASSOC = "re-associates rounded products; the result can differ in the last bits"

THEORY = Theory("monomial", __doc__, [
    rw("mul-inv-out-left", (k * a) * b, k * (a * b), when=[inv(k)], float_unsafe=_REASSOC),
])
