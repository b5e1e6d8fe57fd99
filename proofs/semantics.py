"""The meaning of a term on concrete symbolic blocks, for three number systems.

A *block* is a tuple of element indices (``(1, 2, 3)``). Element index ``0`` is
the *ambient* element: the element at which a term outside every reduction is
evaluated (``y = exp(x - m) / l`` is elementwise over the reduced axis).
Reductions evaluate their body once per element of their block and combine
the values with ``+``, ``max`` or ``min``.

``evaluate(term, elem, backend, leaf, blocks)`` is the one recursive evaluator;
what changes between the symbolic proof, the 50-digit random search and the
float64 certificate check is only the backend (how ``+``, ``exp``, ... are
computed) and ``leaf`` (what a leaf is worth at an element):

* ``SympyBackend``  builds sympy expressions, and records the domain conditions
  each partial operator needs (``log(x)`` needs ``x > 0``, ``a / b`` needs
  ``b != 0``), so that a proof can compare the domains of both sides;
* ``MpBackend``     computes with mpmath at 50 digits and raises ``Undefined``
  outside the real domain (``log(-1)``, ``1 / 0``);
* ``FloatBackend``  computes in IEEE float64 (numpy scalars), as a kernel would.
"""
from __future__ import annotations

import math

import mpmath
import numpy as np
import sympy as sp

from acefuse.rewrite.terms import Term, REDUCTIONS

PRECISION_DIGITS = 50


class Undefined(ArithmeticError):
    """A partial operator was applied outside its real domain (log of <= 0, x / 0, ...)."""


def is_leaf(t: Term) -> bool:
    """Leaves whose value the caller decides: pattern variables, Elm, Par, St, Num with a variable payload."""
    if t.op in ("?", "Elm", "Par", "St"):
        return True
    return t.op == "Num" and isinstance(t.args[0], Term)


def evaluate(t: Term, elem: int, be, leaf, blocks, memo=None):
    """Value of ``t`` at ambient element ``elem``.

    be:     a backend (SympyBackend, MpBackend, FloatBackend)
    leaf:   leaf(term, elem) -> value for the leaves listed in ``is_leaf``
    blocks: blocks(block_term) -> tuple of element indices

    A reduction's value does not depend on the ambient element: it is computed once per call
    (without that, a cascade of d reductions nested in bodies, af.topk's, costs n**d).
    """
    if memo is None:
        memo = {}
    op = t.op
    if is_leaf(t):
        return leaf(t, elem)
    if op == "Num":
        return be.const(t.args[0])
    if op == "Cnt":
        return be.const(len(blocks(t.args[0])))
    if op in REDUCTIONS:
        if t in memo:
            return memo[t]
        elems = blocks(t.args[0])
        if not elems:
            raise ValueError(f"reduction {t!r} over an empty block")
        vals = [evaluate(t.args[1], i, be, leaf, blocks, memo) for i in elems]
        memo[t] = r = {"Sum": be.sum, "RMax": be.max, "RMin": be.min}[op](vals)
        return r
    if op == "Cast":
        return be.cast(evaluate(t.args[0], elem, be, leaf, blocks, memo), t.args[1])
    fn = _OPS.get(op)
    if fn is None:
        raise ValueError(f"cannot evaluate operator {op!r} in {t!r}")
    vals = [evaluate(a, elem, be, leaf, blocks, memo) for a in t.args]
    return fn(be, *vals)


def _call(method: str):
    """The operator as the backend method ``method`` on its operand values."""
    def fn(be, *vals):
        return getattr(be, method)(*vals)
    fn.__name__ = method
    return fn


def _tagged(method: str, op: str):
    """The operator as the backend method ``method`` told the operator's name (one method
    for every comparison, one for every integer operator); the second operand of a unary
    one is None."""
    def fn(be, a, b=None):
        return getattr(be, method)(op, a, b)
    fn.__name__ = f"{method}_{op}"
    return fn


# operator -> fn(backend, *operand values)
_OPS = {op: _call(op.lower()) for op in (
    "Add", "Sub", "Mul", "Div", "Neg", "Exp", "Log", "Sqrt", "Rsqrt", "Abs", "Tanh",
    "Erf", "Sigmoid", "Softplus", "Log1p", "Expm1", "Floor", "Ceil", "Round")}
_OPS["Max2"] = lambda be, a, b: be.max([a, b])
_OPS["Min2"] = lambda be, a, b: be.min([a, b])
# selection: where and comparisons (a comparison is 1 or 0; where picks by a nonzero condition)
_OPS["Where"] = _call("where")
_OPS.update({op: _tagged("cmp", op) for op in (
    "CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe", "LAnd", "LOr", "LNot")})
# exact integer arithmetic (floor division and modulo as Python; int64 two's complement)
_OPS.update({op: _tagged("intop", op) for op in (
    "FloorDiv", "Mod", "BitAnd", "BitOr", "BitXor", "BitNot", "Shl", "Shr")})


def int_value(op: str, a: int, b: int = 0):
    """An integer operator on Python ints, or None where it is undefined (x // 0, x % 0, a
    shift count outside 0..63). ``<<`` wraps to int64 like the kernels and torch."""
    if op == "BitNot":
        return ~a
    if op in ("FloorDiv", "Mod") and b == 0:
        return None
    if op in ("Shl", "Shr") and not 0 <= b < 64:
        return None
    if op == "Shl":
        r = (a << b) & (2 ** 64 - 1)
        return r - 2 ** 64 if r >= 2 ** 63 else r
    return {"FloorDiv": lambda: a // b, "Mod": lambda: a % b, "BitAnd": lambda: a & b,
            "BitOr": lambda: a | b, "BitXor": lambda: a ^ b, "Shr": lambda: a >> b}[op]()


def cast_float(a, dtype, floor, ldexp, frexp, inf):
    """``a`` rounded to the float format ``dtype`` (rewrite/terms.py FLOAT_CASTS): to nearest,
    ties to even, with subnormals; saturating or infinite past the largest finite value.
    Generic in the number system (mpmath here; acefuse.reference.round_format on arrays)."""
    from acefuse.rewrite.terms import FLOAT_CASTS
    p, emin, top, over = FLOAT_CASTS[dtype]
    if a != a:
        return a
    mag = -a if a < 0 else a
    if mag == inf:
        r = inf
    elif mag == 0:
        return a
    else:
        _, e = frexp(mag)
        q = ldexp(1, max(int(e) - 1, emin) - p)
        n = mag / q
        f = floor(n)
        d = n - f
        r = (f + 1 if d > 0.5 or (d == 0.5 and int(f) % 2) else f) * q
    if r > top:
        r = top if over == "sat" else inf
    return -r if a < 0 else r


def truth(op, a, b):
    """A comparison or logical operator on concrete numbers (True/False)."""
    return {"CmpLt": lambda: a < b, "CmpLe": lambda: a <= b, "CmpGt": lambda: a > b, "CmpGe": lambda: a >= b,
            "CmpEq": lambda: a == b, "CmpNe": lambda: a != b, "LAnd": lambda: a != 0 and b != 0,
            "LOr": lambda: a != 0 or b != 0, "LNot": lambda: a == 0}[op]()


_UNINTERPRETED = {}


def _uf(name):
    """An uninterpreted real function (equal arguments, equal results): sound, and enough
    for claims that use an operator the same way on both sides."""
    if name not in _UNINTERPRETED:
        _UNINTERPRETED[name] = sp.Function(name, real=True)
    return _UNINTERPRETED[name]


class _Operators:
    """+, - and * and negation as Python's operators, which every number system here has."""

    def add(self, a, b): return a + b
    def sub(self, a, b): return a - b
    def mul(self, a, b): return a * b
    def neg(self, a): return -a


class NumpyOps(_Operators):
    """IEEE arithmetic on numpy values (scalars or arrays): division and the elementary
    functions as numpy computes them. Shared by ``FloatBackend`` and the vectorised float
    check (proofs/floatcheck.py)."""

    def div(self, a, b): return a / b
    def exp(self, a): return np.exp(a)
    def log(self, a): return np.log(a)
    def sqrt(self, a): return np.sqrt(a)
    def abs(self, a): return np.abs(a)
    def tanh(self, a): return np.tanh(a)


class SympyBackend(_Operators):
    """Exact arithmetic with sympy; records the domain conditions of partial operators.

    ``conditions`` is a list of ``(kind, expr)`` with kind ``"pos"`` (expr > 0),
    ``"nonneg"`` (expr >= 0) or ``"nonzero"`` (expr != 0).
    """

    def __init__(self):
        self.conditions: list = []

    def const(self, v):
        if isinstance(v, int):
            return sp.Integer(v)
        v = float(v)
        if math.isinf(v):
            return sp.oo if v > 0 else -sp.oo
        return sp.Integer(int(v)) if v.is_integer() else sp.Rational(v)

    def exp(self, a): return sp.exp(a)
    def abs(self, a): return sp.Abs(a)
    def tanh(self, a): return sp.tanh(a)
    def sum(self, vals): return sp.Add(*vals)
    def max(self, vals): return sp.Max(*vals)
    def min(self, vals): return sp.Min(*vals)

    def div(self, a, b):
        self.conditions.append(("nonzero", b))
        return a / b

    def log(self, a):
        self.conditions.append(("pos", a))
        return sp.log(a)

    def sqrt(self, a):
        self.conditions.append(("nonneg", a))
        return sp.sqrt(a)

    def rsqrt(self, a):
        self.conditions.append(("pos", a))
        return 1 / sp.sqrt(a)

    def erf(self, a): return sp.erf(a)
    def sigmoid(self, a): return 1 / (1 + sp.exp(-a))
    def softplus(self, a): return sp.log(1 + sp.exp(a))
    def expm1(self, a): return sp.exp(a) - 1
    def floor(self, a): return sp.floor(a)
    def ceil(self, a): return sp.ceiling(a)
    def round(self, a): return _uf("round_even")(a)
    def cast(self, a, dtype): return _uf("cast_" + dtype)(a)

    # where and comparisons have no symbolic algebra here: selection rules are decided by
    # proofs/order.py (order types), everything else with them stays outside the sympy class
    def where(self, c, a, b):
        raise ValueError("cannot evaluate operator 'Where' symbolically (selection rules: proofs/order.py)")

    def cmp(self, op, a, b):
        raise ValueError(f"cannot evaluate operator {op!r} symbolically (selection rules: proofs/order.py)")

    def log1p(self, a):
        self.conditions.append(("pos", 1 + a))
        return sp.log(1 + a)

    def intop(self, op, a, b=None):
        if op in ("FloorDiv", "Mod"):
            self.conditions.append(("nonzero", b))
            return sp.floor(a / b) if op == "FloorDiv" else a - b * sp.floor(a / b)
        return _uf(op.lower())(a) if b is None else _uf(op.lower())(a, b)


EXP_LIMIT = 1e6


class MpBackend(_Operators):
    """mpmath at 50 significant digits; raises ``Undefined`` outside the real domain."""

    def const(self, v): return mpmath.mpf(v)

    def exp(self, a):
        # exp of an exp of random values explodes (mpmath then runs out of memory): beyond
        # EXP_LIMIT the point is outside what a 50-digit check can say anything about
        if a > EXP_LIMIT:
            raise Undefined(f"exp({mpmath.nstr(a, 5)}) is beyond the numeric check's range")
        return mpmath.exp(a)

    def abs(self, a): return abs(a)
    def tanh(self, a): return mpmath.tanh(a)
    def sum(self, vals): return mpmath.fsum(vals)
    def max(self, vals): return max(vals)
    def min(self, vals): return min(vals)

    def div(self, a, b):
        if b == 0:
            raise Undefined("division by zero")
        return a / b

    def log(self, a):
        if a <= 0:
            raise Undefined(f"log of non-positive {mpmath.nstr(a, 6)}")
        return mpmath.log(a)

    def sqrt(self, a):
        if a < 0:
            raise Undefined(f"sqrt of negative {mpmath.nstr(a, 6)}")
        return mpmath.sqrt(a)

    def rsqrt(self, a):
        if a <= 0:
            raise Undefined(f"rsqrt of non-positive {mpmath.nstr(a, 6)}")
        return 1 / mpmath.sqrt(a)

    def erf(self, a): return mpmath.erf(a)
    def floor(self, a): return mpmath.floor(a)
    def ceil(self, a): return mpmath.ceil(a)

    def sigmoid(self, a):
        e = mpmath.exp(-abs(a))
        return 1 / (1 + e) if a >= 0 else e / (1 + e)

    def softplus(self, a):
        return max(a, 0) + mpmath.log1p(mpmath.exp(-abs(a)))

    def log1p(self, a):
        if a <= -1:
            raise Undefined(f"log1p of {mpmath.nstr(a, 6)} <= -1")
        return mpmath.log1p(a)

    def expm1(self, a):
        if a > EXP_LIMIT:
            raise Undefined(f"expm1({mpmath.nstr(a, 5)}) is beyond the numeric check's range")
        return mpmath.expm1(a)

    def round(self, a):
        f = mpmath.floor(a)
        d = a - f
        return f + 1 if d > 0.5 or (d == 0.5 and int(f) % 2) else f

    def cast(self, a, dtype):
        from acefuse.rewrite.terms import CAST_LIMITS, SATURATING, FLOAT_CASTS
        if dtype in FLOAT_CASTS:
            return cast_float(a, dtype, mpmath.floor, mpmath.ldexp, mpmath.frexp, mpmath.inf)
        t = mpmath.floor(a) if a >= 0 else mpmath.ceil(a)
        if dtype in SATURATING:
            lo, hi = SATURATING[dtype]
            return min(max(t, mpmath.mpf(lo)), mpmath.mpf(hi))
        if not -CAST_LIMITS[dtype] <= t < CAST_LIMITS[dtype]:
            raise Undefined(f"cast({mpmath.nstr(a, 6)}, {dtype!r}) is outside the type")
        return t

    def where(self, c, a, b): return a if c != 0 else b
    def cmp(self, op, a, b): return mpmath.mpf(1 if truth(op, a, b) else 0)

    def intop(self, op, a, b=None):
        vals = [a] if b is None else [a, b]
        if any(v != mpmath.floor(v) for v in vals):
            raise Undefined(f"integer operator {op} of a non-integer {[mpmath.nstr(v, 6) for v in vals]}")
        r = int_value(op, *(int(v) for v in vals))
        if r is None:
            raise Undefined(f"integer operator {op} undefined at {[int(v) for v in vals]}")
        return mpmath.mpf(r)


class FloatBackend(NumpyOps):
    """IEEE float64, as a kernel computes (inf/nan propagate; the caller checks finiteness)."""

    def const(self, v): return np.float64(v)
    def rsqrt(self, a): return 1.0 / np.sqrt(a)
    def sum(self, vals): return np.float64(math.fsum(float(v) for v in vals))
    def max(self, vals): return np.float64(max(vals))
    def min(self, vals): return np.float64(min(vals))
    def erf(self, a): return np.float64(math.erf(a)) if not np.isnan(a) else np.float64(np.nan)
    def log1p(self, a): return np.log1p(a)
    def expm1(self, a): return np.expm1(a)
    def floor(self, a): return np.floor(a)
    def ceil(self, a): return np.ceil(a)
    def round(self, a): return np.round(a)   # ties to even

    def sigmoid(self, a):
        e = np.exp(-np.abs(a))
        return 1.0 / (1.0 + e) if a >= 0 else e / (1.0 + e)

    def softplus(self, a): return np.logaddexp(np.float64(0.0), a)

    def cast(self, a, dtype):
        from acefuse.reference import _cast
        return np.float64(_cast(np.float64(a), dtype))

    def where(self, c, a, b): return a if c != 0 else b
    def cmp(self, op, a, b): return np.float64(1.0 if truth(op, a, b) else 0.0)

    def intop(self, op, a, b=None):
        vals = [a] if b is None else [a, b]
        if not all(np.isfinite(v) and float(v).is_integer() and abs(v) < 2.0 ** 63 for v in vals):
            return np.float64(np.nan)
        r = int_value(op, *(int(v) for v in vals))
        return np.float64(np.nan) if r is None else np.float64(r)


def mp_context():
    """A context manager that sets mpmath to the checker's precision."""
    return mpmath.workdps(PRECISION_DIGITS)
