"""The program language: tensors with named axes, elementwise math, reductions.

    x = tensor("x", "r j")           # named axes
    m = max(x, "j")                  # reduce over j; the result has axes ("r",)
    y = exp(x - m) / sum(exp(x - m), "j")
    softmax = program("softmax", y=y)

Broadcasting is by axis name: a tensor with axes "j" combines with one with axes
"r j". Every expression wraps one program-level ``Term`` (rewrite/terms.py); a
reduction is ``Sum/RMax/RMin(Ax(axis), body)``.

Functions: ``erf``, ``sigmoid``, ``softplus``, ``log1p``, ``expm1`` are computed without
overflow or cancellation (sigmoid as ``e / (1 + e)``, ``e = exp(-|x|)``, for x < 0;
softplus as ``max(x, 0) + log1p(exp(-|x|))``; log1p, expm1 and softplus in float64 in
the kernel, then rounded: within 1 ulp of float32; erf and sigmoid in float32, a few ulp,
about ``|x| * 6e-8`` relative for sigmoid on a GPU, whose exp is approximate).
``floor``, ``ceil``, ``round`` (ties to even, as torch) keep NaN and infinities.

Integer arithmetic: ``//``, ``%``, ``&``, ``|``, ``^``, ``~``, ``<<``, ``>>`` take integer
expressions (``rewrite.terms.is_integer``: indices, sizes, integer constants, comparisons,
floor/ceil/round/cast results, and ``+ - *``, abs, max/min, where of those) and are exact:
kernels compute them in int64 (``af.index("j") * 16777217 % 2`` is right, where float32
would not be). ``//`` and ``%`` round toward -inf as Python and torch do (``-7 // 2 == -4``,
``-7 % 3 == 2``); bitwise operators are two's complement; ``<<`` wraps in int64 like
torch. Where the result is undefined (``a // 0``, ``a % 0``, a shift count outside 0..63,
an operand that is NaN, infinite or beyond int64) it is NaN. An integer result that leaves
integer arithmetic becomes a float (exact below 2**24 in float32 outputs). On real values
use ``floor(a / b)`` or round first: ``x // 2`` on a float tensor is refused. ``&``, ``|``
and ``~`` stay logical on booleans (comparisons) and on real values.

Lookups: ``x.at(a=idx)`` (``take``) reads input ``x`` at a computed position along its axis
``a``: ``doc.at(n=index("i")).eq(doc.at(n=index("j")))`` is a document mask. Tensors an
index is read from (page tables) are int32/int64 inputs; integer or bool inputs outside
the dot products (document ids, masks) are read as float32.

Casts: ``cast(x, "int32" | "int64")`` truncates toward zero (as ``x.to(torch.int32)``)
and gives NaN where ``x`` is NaN, infinite or outside the type; the result is an integer
expression. Input tensors are read as floats, so an integer-valued input is exact up to
2**24. ``cast(x, "int8")`` truncates toward zero and *saturates* to -128..127 (NaN stays
NaN; an int8 output stores it as 0). ``cast(x, "float8_e4m3fn" | "float8_e5m2" | "float16" |
"bfloat16")`` rounds to the nearest value of the format, ties to even, bit-exact with torch's
``.to()``: past the largest finite value float8_e5m2/float16/bfloat16 give +-inf and
float8_e4m3fn (no infinity) saturates to +-448; NaN stays NaN. An output whose outermost
operator is a cast to one of these five types is stored in that dtype (``q`` of a per-token
float8 quantization is a ``torch.float8_e4m3fn`` tensor). ``clamp(x, lo, hi)`` is
``minimum(maximum(x, lo), hi)`` (NaN propagates, as torch.clamp). Gradients (af.backward):
a float cast passes the gradient straight through; round, floor, ceil and integer casts have
zero gradient; clamp's is that of maximum/minimum (1 inside, 0 outside, 1/2 at a tie).
Float8 inputs (``torch.float8_e4m3fn``/``float8_e5m2``) are accepted by row-family kernels
and decoded exactly (NaN included).

Selection: ``argmax(x, axis)`` / ``argmin(x, axis)`` give the index of the first largest
(smallest) element as an int64 output (``cast(..., "index")``: an int64 value, written as an
int64 tensor); they are plain programs (a min over the indices where x equals its max) whose
one-pass merge the rules derive. ``topk(x, k, axis)`` (acefuse/topk.py) gives the k largest
and their indices over a new axis of size k, as ``Stacked`` candidates: the functions of one
operand, ``where``, casts and lookups here apply to each candidate.
"""
from __future__ import annotations

import itertools

import builtins
import math
import re

from acefuse.rewrite.terms import Term, pretty, is_integer, BOOLEAN, CAST_LIMITS, SATURATING, FLOAT_CASTS

_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = _AXIS


class LanguageError(ValueError):
    """A program is malformed; the message names the program, term or axis and the fix."""


class Expr:
    """A program expression: a term plus the ordered axes it ranges over."""

    __slots__ = ("term", "axes", "tensors")
    __array_priority__ = 1000  # make numpy scalars defer to us

    def __init__(self, term: Term, axes: tuple, tensors: dict):
        self.term = term
        self.axes = tuple(axes)
        self.tensors = tensors  # name -> axes, for every input under this expression

    # -- arithmetic ------------------------------------------------------------------
    def _bin(self, other, op, swap=False):
        if getattr(other, "_acefuse_elementwise_over_parts", False):
            return NotImplemented    # af.Stacked: applied to each candidate by its reflected operator
        o = _lift(other)
        a, b = (o, self) if swap else (self, o)
        return _combine(op, a, b)

    def __add__(self, o): return self._bin(o, "Add")
    def __radd__(self, o): return self._bin(o, "Add", True)
    def __sub__(self, o): return self._bin(o, "Sub")
    def __rsub__(self, o): return self._bin(o, "Sub", True)
    def __mul__(self, o): return self._bin(o, "Mul")
    def __rmul__(self, o): return self._bin(o, "Mul", True)
    def __truediv__(self, o): return self._bin(o, "Div")
    def __rtruediv__(self, o): return self._bin(o, "Div", True)
    def __neg__(self): return _unary("Neg", self)
    def __lt__(self, o): return self._bin(o, "CmpLt")
    def __le__(self, o): return self._bin(o, "CmpLe")
    def __gt__(self, o): return self._bin(o, "CmpGt")
    def __ge__(self, o): return self._bin(o, "CmpGe")
    # ``&``, ``|``, ``~`` are logical on booleans (and on float values: nonzero is true) and
    # bitwise on integer expressions (indices, integer constants, af.floor/cast results, ...)
    def __and__(self, o): return self._logic(o, "LAnd", "BitAnd")
    def __rand__(self, o): return self._logic(o, "LAnd", "BitAnd", True)
    def __or__(self, o): return self._logic(o, "LOr", "BitOr")
    def __ror__(self, o): return self._logic(o, "LOr", "BitOr", True)
    def __xor__(self, o): return _intop("BitXor", self, o)
    def __rxor__(self, o): return _intop("BitXor", o, self)
    def __floordiv__(self, o): return _intop("FloorDiv", self, o)
    def __rfloordiv__(self, o): return _intop("FloorDiv", o, self)
    def __mod__(self, o): return _intop("Mod", self, o)
    def __rmod__(self, o): return _intop("Mod", o, self)
    def __lshift__(self, o): return _intop("Shl", self, o)
    def __rlshift__(self, o): return _intop("Shl", o, self)
    def __rshift__(self, o): return _intop("Shr", self, o)
    def __rrshift__(self, o): return _intop("Shr", o, self)

    def __abs__(self): return abs(self)
    def __floor__(self): return floor(self)
    def __ceil__(self): return ceil(self)

    def __round__(self, ndigits=None):
        if ndigits is not None:
            raise LanguageError(f"round(`{self}`, {ndigits!r}): only rounding to an integer is supported; "
                                "scale first, e.g. af.round(x * 100) / 100")
        return round(self)

    def __invert__(self):
        if is_integer(self.term) and self.term.op not in BOOLEAN:
            return _intop("BitNot", self)
        return _unary("LNot", self)

    def _logic(self, o, logical, bitwise, swap=False):
        if getattr(o, "_acefuse_elementwise_over_parts", False):
            return NotImplemented
        o = _lift(o)
        a, b = (o, self) if swap else (self, o)
        if all(is_integer(e.term) and e.term.op not in BOOLEAN for e in (a, b)):
            return _intop(bitwise, a, b)
        return _combine(logical, a, b)

    def at(self, **where):
        """A lookup: this input tensor read at computed positions along one of its axes,
        ``doc.at(n=af.index("i"))`` (``af.take(doc, af.index("i"), "n")``): document ids at the
        query and at the key, ``doc.at(n=i).eq(doc.at(n=j))``; a page table's entry for a key,
        ``pages.at(p=j // PAGE)``. The index is an integer expression or built from integer
        tensors (int32/int64 inputs) and lookups of them."""
        if len(where) != 1:
            raise LanguageError(f"`{self}`.at(...): give exactly one axis=index, e.g. .at(n=af.index('i')); "
                                f"got {sorted(where) or 'none'}")
        (axis, idx), = where.items()
        return take(self, idx, axis)

    def eq(self, o):
        """Elementwise ``==`` (Python's ``==`` keeps its usual meaning on expressions)."""
        return self._bin(o, "CmpEq")

    def ne(self, o):
        return self._bin(o, "CmpNe")

    def __pow__(self, p):
        if not isinstance(p, (int, float)) or isinstance(p, bool):
            raise LanguageError(f"`{self}` ** {p!r}: the exponent must be a Python number")
        if p == 2:
            return self * self
        if p == 1:
            return self
        if p == 0.5:
            return sqrt(self)
        return Expr(Term("Pow", (self.term, float(p))), self.axes, self.tensors)

    def __bool__(self):
        raise LanguageError(f"`{self}` is a symbolic expression and has no truth value; "
                            "use af.where(cond, a, b) instead of `if`, and `&`/`|` instead of and/or")

    def __repr__(self):
        return f"Expr({pretty(self.term)} | axes {' '.join(self.axes) or '()'})"

    def __str__(self):
        return pretty(self.term)


def _lift(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool):
        return Expr(Term("Num", (1.0 if x else 0.0,)), (), {})
    if isinstance(x, (int, float)):
        return Expr(Term("Num", (float(x),)), (), {})
    if _stacked(x):   # af.topk's candidates: their parts print as pages
        raise LanguageError(f"cannot use {x.describe()} where one expression is expected; use one "
                            "candidate `vals[r]`, or `vals.sum()`, `.max()`, `.min()` over the candidates")
    raise LanguageError(f"cannot use {x!r} (a {type(x).__name__}) in an acefuse expression; "
                        "use af.tensor(...) for inputs and Python numbers for constants")


def _merge_tensors(*exprs) -> dict:
    out: dict = {}
    for e in exprs:
        for n, ax in e.tensors.items():
            if n in out and out[n] != ax:
                raise LanguageError(f"tensor {n!r} is used with axes {' '.join(out[n])!r} and "
                                    f"{' '.join(ax)!r}; declare each tensor once with one set of axes")
            out[n] = ax
    return out


def _union_axes(*exprs) -> tuple:
    axes: list = []
    for e in exprs:
        for a in e.axes:
            if a not in axes:
                axes.append(a)
    return tuple(axes)


def _combine(op, *exprs) -> Expr:
    return Expr(Term(op, tuple(e.term for e in exprs)), _union_axes(*exprs), _merge_tensors(*exprs))


def _stacked(x):
    """True for af.topk's Stacked candidates (acefuse/topk.py): functions apply to each one."""
    return type(x).__name__ == "Stacked" and hasattr(x, "parts")


def _unary(op, x) -> Expr:
    if _stacked(x):
        return x.map(lambda p: _unary(op, p))
    x = _lift(x)
    return Expr(Term(op, (x.term,)), x.axes, x.tensors)


def _axes(spec, what) -> tuple:
    if isinstance(spec, str):
        axes = tuple(spec.split())
    else:
        axes = tuple(spec)
    for a in axes:
        if not isinstance(a, str) or not _AXIS.match(a):
            raise LanguageError(f"{what}: axis name {a!r} must be an identifier (letters, digits, _)")
    if len(set(axes)) != len(axes):
        raise LanguageError(f"{what}: axes {' '.join(axes)!r} repeat a name; each axis appears once")
    return axes


# ---- inputs and constants -----------------------------------------------------------
def tensor(name: str, axes) -> Expr:
    """An input tensor with named axes, e.g. ``tensor("x", "r j")``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise LanguageError(f"tensor name {name!r} must be an identifier")
    ax = _axes(axes, f"tensor {name!r}")
    # the latest declaration counts: a program is laid out by the declarations of the code that
    # builds it, not by what an earlier program in the same process declared first (with the
    # first one kept, x "t k" declared after an older wq "n k" laid out an [t, n] output as [n, t])
    _DECLARED[(name, ax)] = next(_SERIAL)
    return Expr(Term("In", (name,)), ax, {name: ax})


_DECLARED: dict = {}   # (name, axes) -> order of its latest declaration (the layout rule, axis_order)
_SERIAL = itertools.count()
_LATE = float("inf")


def const(v: float) -> Expr:
    return _lift(float(v))


def size(axis: str) -> Expr:
    """The length of an axis (a per-program constant)."""
    _axes(axis, "size")
    return Expr(Term("Size", (axis,)), (), {})


def index(axis: str) -> Expr:
    """The current index along an axis (0-based), for masks and position biases."""
    _axes(axis, "index")
    return Expr(Term("Idx", (axis,)), (axis,), {})


# ---- integer arithmetic ---------------------------------------------------------------------
_INT_SYM = {"FloorDiv": "//", "Mod": "%", "BitAnd": "&", "BitOr": "|", "BitXor": "^", "Shl": "<<",
            "Shr": ">>", "BitNot": "~"}


def _fold_int(op, vals):
    """The value of an integer operator on integer constants (Python semantics), or None
    where it is undefined (the kernel's NaN)."""
    a = builtins.int(vals[0])
    if op == "BitNot":
        return float(~a)
    b = builtins.int(vals[1])
    if op in ("FloorDiv", "Mod") and b == 0:
        return None
    if op in ("Shl", "Shr") and not 0 <= b < 64:
        return None
    r = {"FloorDiv": lambda: a // b, "Mod": lambda: a % b, "BitAnd": lambda: a & b,
         "BitOr": lambda: a | b, "BitXor": lambda: a ^ b, "Shr": lambda: a >> b,
         "Shl": lambda: (a << b) & (2 ** 64 - 1)}[op]()
    if op == "Shl" and r >= 2 ** 63:
        r -= 2 ** 64   # int64 wraps, as in the kernel and in torch
    return float(r)


def _intop(op, *operands) -> Expr:
    """An integer operator; its operands must be integer expressions (module docstring of
    rewrite/terms.py: ``is_integer``), and it is exact: int64 in the kernel."""
    xs = [_lift(x) for x in operands]
    sym = _INT_SYM[op]
    for x in xs:
        if not is_integer(x.term):
            shown = f"{sym}`{xs[0]}`" if len(xs) == 1 else f"`{xs[0]}` {sym} `{xs[1]}`"
            raise LanguageError(
                f"{shown}: operand `{x}` is not an integer expression; the operators // % & | ^ << >> "
                "are exact integer arithmetic on indices (af.index), sizes, integer constants and "
                "rounded values. Round it first: af.floor(x), af.round(x), af.cast(x, 'int32') "
                "(or use af.floor(a / b) for a floor division of real values)")
    if op in ("FloorDiv", "Mod") and xs[1].term.op == "Num" and xs[1].term.args[0] == 0:
        raise LanguageError(f"`{xs[0]}` {sym} 0: division by the constant zero")
    if op in ("Shl", "Shr") and xs[1].term.op == "Num" and not 0 <= xs[1].term.args[0] < 64:
        raise LanguageError(f"`{xs[0]}` {sym} {xs[1]}: a shift count must be in 0..63")
    if all(x.term.op == "Num" for x in xs):
        v = _fold_int(op, [x.term.args[0] for x in xs])
        if v is not None:
            return _lift(v)
    return _combine(op, *xs)


# ---- elementwise ------------------------------------------------------------------------
def exp(x): return _unary("Exp", x)
def log(x): return _unary("Log", x)
def sqrt(x): return _unary("Sqrt", x)
def rsqrt(x): return _unary("Rsqrt", x)
def abs(x): return _unary("Abs", x)  # noqa: A001 - mirrors numpy/torch naming
def tanh(x): return _unary("Tanh", x)


def _fn(op, x, fold):
    if _stacked(x):
        return x.map(lambda p: _fn(op, p, fold))
    x = _lift(x)
    if x.term.op == "Num":   # a constant: its value (kernels never see a function of a literal)
        v = x.term.args[0]
        try:
            return _lift(fold(v))
        except (OverflowError, ValueError):
            return _lift(math.nan)
    return _unary(op, x)


def _sigmoid(v):
    if v >= 0:
        return 1.0 / (1.0 + math.exp(-v))
    e = math.exp(v)
    return e / (1.0 + e)


def _softplus(v):
    return builtins.max(v, 0.0) + math.log1p(math.exp(-builtins.abs(v))) if math.isfinite(v) else \
        (v if v > 0 else 0.0 if v < 0 else v)


def _round_even(v):
    return float(builtins.round(v)) if math.isfinite(v) else v


def erf(x):
    """The error function (exact GELU: ``x * 0.5 * (1 + af.erf(x / math.sqrt(2)))``)."""
    return _fn("Erf", x, math.erf)


def sigmoid(x):
    """``1 / (1 + exp(-x))``, computed without overflow (``exp(x) / (1 + exp(x))`` for x < 0)."""
    return _fn("Sigmoid", x, _sigmoid)


def softplus(x):
    """``log(1 + exp(x))`` as ``max(x, 0) + log1p(exp(-|x|))``: no overflow, no cancellation."""
    return _fn("Softplus", x, _softplus)


def log1p(x):
    """``log(1 + x)``, accurate for tiny ``x``."""
    return _fn("Log1p", x, lambda v: math.log1p(v) if v > -1 else (-math.inf if v == -1 else math.nan))


def expm1(x):
    """``exp(x) - 1``, accurate for tiny ``x``."""
    return _fn("Expm1", x, lambda v: math.expm1(v) if v < 710 else math.inf)


def floor(x):
    """The largest integer <= x (an integer expression; NaN and infinities pass through)."""
    return _fn("Floor", x, lambda v: float(math.floor(v)) if math.isfinite(v) else v)


def ceil(x):
    """The smallest integer >= x (an integer expression; NaN and infinities pass through)."""
    return _fn("Ceil", x, lambda v: float(math.ceil(v)) if math.isfinite(v) else v)


def round(x):  # noqa: A001 - mirrors torch.round
    """x rounded to the nearest integer, ties to even (as torch.round and Python's round)."""
    return _fn("Round", x, _round_even)


def cast(x, dtype="int32"):
    """``x`` converted to ``dtype``:

    - ``"int32"``, ``"int64"``: truncated toward zero (as ``x.to(torch.int32)``); NaN where
      ``x`` is NaN, infinite or outside the type (never a wrapped value);
    - ``"int8"``: truncated toward zero, then saturated to -128..127 (NaN stays NaN);
    - ``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"float16"``, ``"bfloat16"``: rounded to the
      nearest value of the format, ties to even, with its subnormals, bit-exact with torch's
      ``.to()``; past the largest finite value +-inf, except float8_e4m3fn, which has no
      infinity and saturates to +-448 (as torch); NaN stays NaN.

    Values stay numbers inside a program (``cast(x / s, "float8_e4m3fn") * s`` dequantizes);
    an output whose outermost operator is a cast to int8, a float8 type, float16 or bfloat16
    is stored in that dtype.

        >>> cast(465.0, "float8_e4m3fn"), cast(1e6, "float8_e4m3fn"), cast(-300.7, "int8")
        (Expr(448 | axes ()), Expr(448 | axes ()), Expr(-128 | axes ()))
    """
    if _stacked(x):
        return x.map(lambda p: cast(p, dtype))
    if dtype not in CAST_LIMITS and dtype not in FLOAT_CASTS:
        raise LanguageError(f"cast(`{_lift(x)}`, {dtype!r}): the integer type must be one of "
                            f"{sorted(CAST_LIMITS)}, or the float format one of {sorted(FLOAT_CASTS)}")
    x = _lift(x)
    if x.term.op == "Num":
        from acefuse.reference import _cast
        return _lift(float(_cast(x.term.args[0], dtype)))
    return Expr(Term("Cast", (x.term, dtype)), x.axes, x.tensors)


def clamp(x, lo=None, hi=None):
    """``x`` limited to ``[lo, hi]``: ``minimum(maximum(x, lo), hi)``, as ``torch.clamp``
    (NaN propagates; where ``lo > hi`` the result is ``hi``). Either bound may be omitted,
    and a bound may be an expression (``clamp(x, -m, m)``).

        >>> clamp(7.5, -1, 2)
        Expr(2 | axes ())
    """
    if lo is None and hi is None:
        raise LanguageError(f"clamp(`{_lift(x)}`): give at least one bound, lo or hi")
    out = _lift(x)
    for bound, fn, pick in ((lo, maximum, builtins.max), (hi, minimum, builtins.min)):
        if bound is None:
            continue
        bound = _lift(bound)
        if out.term.op == "Num" and bound.term.op == "Num":   # constants: the value
            u, v = out.term.args[0], bound.term.args[0]
            out = _lift(math.nan if math.isnan(u) or math.isnan(v) else pick(u, v))
        else:
            out = fn(out, bound)
    return out


def maximum(a, b):
    """Elementwise maximum (NaN propagates, as torch.maximum)."""
    return _combine("Max2", _lift(a), _lift(b))


def minimum(a, b):
    """Elementwise minimum (NaN propagates, as torch.minimum)."""
    return _combine("Min2", _lift(a), _lift(b))


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b`` (``b`` may be ``-math.inf`` for masks)."""
    st = [v for v in (cond, a, b) if _stacked(v)]
    if st:   # af.topk candidates: one where per candidate
        if any((v.axis, len(v)) != (st[0].axis, len(st[0])) for v in st):
            raise LanguageError("where: stacked operands must share their stacked axis and its size")
        pick = lambda v, r: v.parts[r] if _stacked(v) else v   # noqa: E731
        return type(st[0])([where(pick(cond, r), pick(a, r), pick(b, r)) for r in range(len(st[0]))],
                           st[0].axis, st[0].source_axis)
    return _combine("Where", _lift(cond), _lift(a), _lift(b))


NEG_INF = -math.inf


# ---- reductions ---------------------------------------------------------------------------
def _reduce(op, x, axis, what):
    x = _lift(x)
    (ax,) = _axes(axis, what) if isinstance(axis, str) and len(axis.split()) == 1 else (None,)
    if ax is None:
        raise LanguageError(f"{what}: give exactly one axis name, got {axis!r}")
    if ax not in x.axes:
        raise LanguageError(f"{what}(`{x}`, {ax!r}): {ax!r} is not an axis of the operand "
                            f"(its axes are {' '.join(x.axes) or 'none'}); reduce over one of those")
    axes = tuple(a for a in x.axes if a != ax)
    return Expr(Term(op, (Term("Ax", (ax,)), x.term)), axes, x.tensors)


def sum(x, axis):  # noqa: A001
    """Sum over one axis."""
    return _reduce("Sum", x, axis, "sum")


def max(x, axis):  # noqa: A001
    """Max over one axis."""
    return _reduce("RMax", x, axis, "max")


def min(x, axis):  # noqa: A001
    """Min over one axis."""
    return _reduce("RMin", x, axis, "min")


def mean(x, axis):
    """Mean over one axis: ``sum(x, axis) / size(axis)``."""
    return sum(x, axis) / size(axis)


def argmax(x, axis):
    """The index of the largest element along ``axis`` (the first one on ties, as
    torch.argmax), an int64 output; NaN counts as larger than every number (a row holding NaN
    gives its first NaN, as torch). Written plainly: with ``v`` = x where NaN reads -inf,
    ``min(where(v == max(v, axis), index(axis), inf), axis)``, unless the first NaN's index
    ``min(where(x != x, index(axis), inf), axis)`` is finite. One pass carries the running max,
    the index of its first occurrence and the first NaN; the merge
    ``min(where(m_A == m_AB, i_A, inf), where(m_B == m_AB, i_B, inf))`` is derived by the rule
    ``min-where-eq-bound`` (rules/order.py, proved by proofs/order.py). Indices are exact for
    axes of up to 2**24 elements (they are float32 values in the kernel).

        >>> argmax(tensor("x", "r j"), "j").axes
        ('r',)
    """
    x = _lift(x)
    _reduce("RMax", x, axis, "argmax")   # checks the axis
    nan = x.ne(x)
    first_nan = min(where(nan, index(axis), math.inf), axis)
    v = where(nan, -math.inf, x)
    first_max = min(where(v.eq(max(v, axis)), index(axis), math.inf), axis)
    return cast(where(first_nan < math.inf, first_nan, first_max), "index")


def argmin(x, axis):
    """The index of the smallest element along ``axis`` (the first on ties, as torch.argmin),
    an int64 output: ``argmax(-x, axis)`` (NaN counts as smaller than every number)."""
    x = _lift(x)
    _reduce("RMin", x, axis, "argmin")
    return argmax(-x, axis)


def take(t: Expr, idx, axis: str) -> Expr:
    """Gather: ``t`` with ``axis`` replaced by the index ``idx`` (e.g. ``x[r, target[r]]``);
    ``t.at(axis=idx)`` is the same. In attention-shaped programs ``idx`` may range over the
    query or key axes, or both (``doc.at(n=index("i"))``, ``t5.at(u=bucket)`` with ``bucket``
    an int tensor over queries and keys, ``kc.at(n=pages.at(p=j // P) * P + j % P)``); a
    position outside the axis reads NaN."""
    if not (isinstance(t, Expr) and t.term.op == "In"):
        raise LanguageError("take: the first argument must be an input tensor (af.tensor)")
    if _stacked(idx):   # af.topk's indices: one lookup per candidate
        return idx.map(lambda i: take(t, i, axis))
    idx = _lift(idx)
    if axis not in t.axes:
        raise LanguageError(f"take: {axis!r} is not an axis of tensor {t.term.args[0]!r} "
                            f"(axes {' '.join(t.axes)})")
    if axis in idx.axes:
        raise LanguageError(f"take: the index `{idx}` ranges over {axis!r}, the axis it reads "
                            f"{t.term.args[0]!r} along; index with an expression over other axes, or name "
                            f"the index's axis differently (the result ranges over it)")
    axes = _union_axes(Expr(t.term, tuple(a for a in t.axes if a != axis), {}), idx)
    return Expr(Term("Take", (t.term.args[0], idx.term, axis)), axes, _merge_tensors(t, idx))


# ---- programs -------------------------------------------------------------------------------
class Program:
    """A named set of outputs over shared inputs."""

    def __init__(self, name: str, outputs: dict, order=None):
        """``order``: the axis order of the program this one is derived from (a backward's
        augmented forward, a stage of a staged program), so that both lay out an output alike
        whatever was declared in between (``axis_order`` follows the latest declarations)."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise LanguageError(f"program name {name!r} must be an identifier")
        if not outputs:
            raise LanguageError(f"program {name!r} has no outputs; pass them as keywords, "
                                f"e.g. program({name!r}, y=expr)")
        self.name = name
        self.outputs = {}
        self.user_outputs = list(outputs)   # as given: a Stacked output (af.topk) is k outputs inside
        self.stacked = {}                   # {output: (stacked axis, [part names], axis selected along)}
        flat = {}
        for k, v in outputs.items():
            if _stacked(v):
                from acefuse.topk import expand
                parts = expand(k, v)
                clash = sorted(set(parts) & set(outputs))
                if clash:
                    raise LanguageError(f"program {name!r}: output {clash[0]!r} clashes with the name of a "
                                        f"candidate of stacked output {k!r}; rename it")
                self.stacked[k] = (v.axis, list(parts), v.source_axis)
                flat.update(parts)
            else:
                flat[k] = v
        for k, v in flat.items():
            if not isinstance(v, Expr):
                if isinstance(v, (int, float)):
                    v = _lift(v)
                else:
                    raise LanguageError(f"program {name!r}: output {k!r} is a {type(v).__name__}, "
                                        "not an acefuse expression")
            self.outputs[k] = v
        self.tensors = _merge_tensors(*self.outputs.values())
        if not self.tensors:
            raise LanguageError(f"program {name!r} reads no input tensor")
        clash = sorted(set(self.tensors) & set(self.outputs))
        if clash:
            raise LanguageError(f"program {name!r}: {', '.join(map(repr, clash))} names both an input tensor "
                                "and an output; kernels take inputs and outputs as arguments of one "
                                f"function, so rename the output (e.g. {clash[0] + '_out'}=...)")
        self.axes = axis_order(self.tensors)
        if order is not None:
            rank = {a: i for i, a in enumerate(order)}
            self.axes = tuple(sorted(self.axes, key=lambda a: (rank.get(a, len(rank)), self.axes.index(a))))
        # outputs list their axes in the program's axis order (b h i e), not in the order
        # operands or outputs happened to be combined
        order = {a: i for i, a in enumerate(self.axes)}
        for k, v in self.outputs.items():
            missing = [a for a in v.axes if a not in order]
            if missing:
                raise LanguageError(f"program {name!r}: output {k!r} ranges over {missing}, which no input "
                                    "tensor has; its length would be unknown")
            self.outputs[k] = Expr(v.term, tuple(sorted(v.axes, key=order.__getitem__)), v.tensors)

    def reduced_axes(self) -> list:
        """Axes some reduction of the program runs over, in order of appearance."""
        from acefuse.rewrite.dag import nodes   # each shared subterm once (rewrite/dag.py)
        out: list = []
        for t in nodes(*(e.term for e in self.outputs.values())):
            if t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax":
                a = t.args[0].args[0]
                if a not in out:
                    out.append(a)
        return out

    def key(self) -> str:
        """A stable hash of the program (names, axes, terms)."""
        import hashlib
        from acefuse.rewrite.dag import sexpr   # Term.sexpr's text, each shared subterm once
        memo: dict = {}
        text = repr((self.name, sorted(self.tensors.items()),
                     sorted((k, sexpr(v.term, memo), v.axes) for k, v in self.outputs.items())))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self):
        outs = ", ".join(f"{k}={v}" for k, v in self.outputs.items())
        return f"Program({self.name}: {outs})"


def axis_order(tensors: dict) -> tuple:
    """The program's axis order, which is every output's layout. Inputs are taken in
    the order of their latest ``af.tensor`` declarations (then by name); each axis not yet
    placed goes right before the next axis of that input's declaration that is placed,
    else right after the previous one, else last. It depends only on the declarations,
    never on the order of outputs or operands: with ``x: "r j"`` and ``w: "j"`` every
    output over r and j is laid out ``[r, j]``; attention's ``o`` over ``b h i e``
    (q ``b h i d``, k ``b h j d``, v ``b h j e``) and its scores over ``b h i j`` come
    out in those orders.

        >>> axis_order({"w": ("j",), "x": ("r", "j")})
        ('r', 'j')
        >>> q, k, v = tensor("q", "b h i d"), tensor("k", "b h j d"), tensor("v", "b h j e")
        >>> axis_order({**v.tensors, **k.tensors, **q.tensors})
        ('b', 'h', 'i', 'j', 'e', 'd')
    """
    out: list = []
    for name in sorted(tensors, key=lambda n: (_DECLARED.get((n, tuple(tensors[n])), _LATE), n)):
        axes = tuple(tensors[name])
        for i, a in enumerate(axes):
            if a in out:
                continue
            nxt = next((b for b in axes[i + 1:] if b in out), None)
            prv = next((b for b in reversed(axes[:i]) if b in out), None)
            k = out.index(nxt) if nxt is not None else (out.index(prv) + 1 if prv is not None else len(out))
            out.insert(k, a)
    return tuple(out)


def program(name: str, **outputs) -> Program:
    """Name a program and its outputs: ``program("softmax", y=e / l)``."""
    return Program(name, outputs)
