"""The program language: tensors with named axes, elementwise math, reductions.

    x = tensor("x", "r j")           # named axes
    m = max(x, "j")                  # reduce over j; the result has axes ("r",)
    y = exp(x - m) / sum(exp(x - m), "j")
    softmax = program("softmax", y=y)

Broadcasting is by axis name: a tensor with axes "j" combines with one with axes
"r j". Every expression wraps one program-level ``Term`` (rewrite/terms.py); a
reduction is ``Sum/RMax/RMin(Ax(axis), body)``.
"""
from __future__ import annotations

import builtins
import math
import re

from acefuse.rewrite.terms import Term, pretty

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
    def __and__(self, o): return self._bin(o, "LAnd")
    def __rand__(self, o): return self._bin(o, "LAnd", True)
    def __or__(self, o): return self._bin(o, "LOr")
    def __ror__(self, o): return self._bin(o, "LOr", True)
    def __invert__(self): return _unary("LNot", self)

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


def _unary(op, x) -> Expr:
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
    _DECLARED.setdefault((name, ax), len(_DECLARED))
    return Expr(Term("In", (name,)), ax, {name: ax})


_DECLARED: dict = {}   # (name, axes) -> order of first declaration (the layout rule, axis_order)
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


# ---- elementwise ------------------------------------------------------------------------
def exp(x): return _unary("Exp", x)
def log(x): return _unary("Log", x)
def sqrt(x): return _unary("Sqrt", x)
def rsqrt(x): return _unary("Rsqrt", x)
def abs(x): return _unary("Abs", x)  # noqa: A001 - mirrors numpy/torch naming
def tanh(x): return _unary("Tanh", x)


def maximum(a, b):
    return _combine("Max2", _lift(a), _lift(b))


def minimum(a, b):
    return _combine("Min2", _lift(a), _lift(b))


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b`` (``b`` may be ``-math.inf`` for masks)."""
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


def take(t: Expr, idx, axis: str) -> Expr:
    """Gather: ``t`` with ``axis`` replaced by the index ``idx`` (e.g. ``x[r, target[r]]``)."""
    if not (isinstance(t, Expr) and t.term.op == "In"):
        raise LanguageError("take: the first argument must be an input tensor (af.tensor)")
    idx = _lift(idx)
    if axis not in t.axes:
        raise LanguageError(f"take: {axis!r} is not an axis of tensor {t.term.args[0]!r} "
                            f"(axes {' '.join(t.axes)})")
    if axis in idx.axes:
        raise LanguageError(f"take: the index must not range over the gathered axis {axis!r}")
    axes = _union_axes(Expr(t.term, tuple(a for a in t.axes if a != axis), {}), idx)
    return Expr(Term("Take", (t.term.args[0], idx.term, axis)), axes, _merge_tensors(t, idx))


# ---- programs -------------------------------------------------------------------------------
class Program:
    """A named set of outputs over shared inputs."""

    def __init__(self, name: str, outputs: dict):
        if not isinstance(name, str) or not _NAME.match(name):
            raise LanguageError(f"program name {name!r} must be an identifier")
        if not outputs:
            raise LanguageError(f"program {name!r} has no outputs; pass them as keywords, "
                                f"e.g. program({name!r}, y=expr)")
        self.name = name
        self.outputs = {}
        for k, v in outputs.items():
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
        self.axes = axis_order(self.tensors)
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
        out: list = []
        for e in self.outputs.values():
            for t in e.term.walk():
                if t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax":
                    a = t.args[0].args[0]
                    if a not in out:
                        out.append(a)
        return out

    def key(self) -> str:
        """A stable hash of the program (names, axes, terms)."""
        import hashlib
        text = repr((self.name, sorted(self.tensors.items()),
                     sorted((k, v.term.sexpr(), v.axes) for k, v in self.outputs.items())))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self):
        outs = ", ".join(f"{k}={v}" for k, v in self.outputs.items())
        return f"Program({self.name}: {outs})"


def axis_order(tensors: dict) -> tuple:
    """The program's axis order, which is every output's layout. Inputs are taken in
    the order they were declared with ``af.tensor`` (then by name); each axis not yet
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
