"""The importer's intermediate form: axis variables unified through broadcasting, and
expression nodes over them, emitted as acefuse expressions once every axis has a name.

torch indexes dims by position; acefuse names axes. While a graph is imported, each
torch dim is an ``Axis`` variable; broadcasting, contractions and masks *unify*
variables (union-find), so names can only be chosen at the end. A dim of size 1 has no
axis (``None``): in acefuse such a value simply does not range over it.
"""
from __future__ import annotations

import itertools
import math

import acefuse.lang as L
from acefuse.frontend.errors import FrontendError

_order = itertools.count()


class Axis:
    """An axis variable (union-find): a torch dim of size ``size`` (> 1)."""

    __slots__ = ("parent", "size", "hint", "order")

    def __init__(self, size: int, hint: str | None = None):
        self.parent = self
        self.size = int(size)
        self.hint = hint
        self.order = next(_order)

    def find(self) -> "Axis":
        a = self
        while a.parent is not a:
            a.parent = a.parent.parent
            a = a.parent
        return a

    def set_hint(self, hint: str):
        r = self.find()
        if r.hint is None:
            r.hint = hint

    def __repr__(self):
        return f"Axis#{self.find().order}({self.size})"


def unify(a: Axis, b: Axis) -> Axis:
    """Make ``a`` and ``b`` the same axis (same index space); returns the representative."""
    ra, rb = a.find(), b.find()
    if ra is rb:
        return ra
    if ra.size != rb.size:
        raise FrontendError(f"internal: unifying axes of sizes {ra.size} and {rb.size}")
    old, new = (ra, rb) if ra.order < rb.order else (rb, ra)
    new.parent = old
    old.hint = old.hint or new.hint
    return old


class N:
    """An expression node. ops (args):
    in (leaf key)            an input tensor
    num (value)              a float constant
    size (Axis)              the length of an axis
    idx (Axis)               the index along an axis
    un (fn, x)               exp log sqrt rsqrt abs tanh neg lnot erf sigmoid softplus log1p
                             expm1 floor ceil round int32 int64 (a cast to that type)
                             bfloat16 float16 (rounded to that format, as torch's ``.to()``)
    bin (op, a, b)           add sub mul div max2 min2 lt le gt ge eq ne land lor
    where (c, a, b)          a where c holds, else b
    pow (x, p)               x ** p, p a Python number
    red (kind, Axis, x)      sum | max | min over one axis
    take (leaf key, idx, Axis)  gather along an axis of an input tensor
    """

    __slots__ = ("op", "args")

    def __init__(self, op, *args):
        self.op, self.args = op, args

    def __repr__(self):
        return f"N({self.op}, {self.args})"


def num(v) -> N:
    return N("num", float(v))


def un(fn, x) -> N:
    return N("un", fn, x)


def bin_(op, a, b) -> N:
    return N("bin", op, a, b)


def red(kind, ax, x) -> N:
    return N("red", kind, ax, x)


_UN = {"exp": L.exp, "log": L.log, "sqrt": L.sqrt, "rsqrt": L.rsqrt, "abs": L.abs, "tanh": L.tanh,
       "neg": lambda x: -x, "lnot": lambda x: x.eq(0.0),   # not: == 0 (also on a float mask)
       "erf": L.erf, "sigmoid": L.sigmoid, "softplus": L.softplus, "log1p": L.log1p, "expm1": L.expm1,
       "floor": L.floor, "ceil": L.ceil, "round": L.round,
       "int32": lambda x: L.cast(x, "int32"), "int64": lambda x: L.cast(x, "int64"),
       "bfloat16": lambda x: L.cast(x, "bfloat16"), "float16": lambda x: L.cast(x, "float16")}
_BIN = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
        "div": lambda a, b: a / b, "max2": L.maximum, "min2": L.minimum,
        "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
        "ge": lambda a, b: a >= b, "eq": lambda a, b: a.eq(b), "ne": lambda a, b: a.ne(b),
        "land": lambda a, b: a & b, "lor": lambda a, b: a | b}
_RED = {"sum": L.sum, "max": L.max, "min": L.min}


def name_axes(axes) -> dict:
    """Readable names for the axis classes: hints (``j`` for a softmax/norm axis, ``e``
    for a contraction) where free, else ``d0, d1, ...`` in order of first appearance."""
    roots = sorted({a.find() for a in axes}, key=lambda r: r.order)
    names, used = {}, set()
    k = 0
    for r in roots:
        if r.hint:
            n, i = r.hint, 2
            while n in used:
                n, i = f"{r.hint}{i}", i + 1
        else:
            while f"d{k}" in used:
                k += 1
            n = f"d{k}"
            k += 1
        names[r] = n
        used.add(n)
    return names


class Emitter:
    """Turns ``N`` trees into acefuse expressions once axis names are known."""

    def __init__(self, names: dict, leaves: dict):
        self.names = names            # root Axis -> name
        self.leaves = leaves          # leaf key -> (tensor name, [Axis, ...])
        self.memo: dict = {}
        self.tensors: dict = {}
        self.program_axes: set = set()
        for key, (tname, axes) in leaves.items():
            ax = [self.nm(a) for a in axes]
            if len(set(ax)) != len(ax):
                raise FrontendError(
                    f"input {tname!r} would range over axis {ax} twice (a tensor combined with its own "
                    "transpose, or a diagonal); acefuse axes are named, so this needs a copy in torch "
                    "first (e.g. x.transpose(...).contiguous() computed outside the function)")
            self.tensors[key] = L.tensor(tname, ax)
            self.program_axes |= set(ax)

    def nm(self, a: Axis) -> str:
        return self.names[a.find()]

    def __call__(self, n: N):
        k = id(n)
        if k not in self.memo:
            self.memo[k] = (self._emit(n), n)
        return self.memo[k][0]

    def _emit(self, n: N):
        op, a = n.op, n.args
        if op == "in":
            return self.tensors[a[0]]
        if op == "num":
            return L.const(a[0])
        if op == "size":
            name = self.nm(a[0])
            # a size over an axis no input has cannot be read by a kernel: use its value
            return L.size(name) if name in self.program_axes else L.const(a[0].size)
        if op == "idx":
            return L.index(self.nm(a[0]))
        if op == "un":
            return _UN[a[0]](self(a[1]))
        if op == "bin":
            x, y = self(a[1]), self(a[2])
            if a[0] in ("land", "lor"):   # a mask read from memory is a number: make it boolean
                x, y = (v.ne(0.0) if m.op in ("in", "num") else v for v, m in ((x, a[1]), (y, a[2])))
                if not x.axes or not y.axes:
                    # with a value over no axis (a 0-d mask): a select, as the kernels' `&` and `|`
                    # take only blocks (Triton's interpreter refuses a scalar operand)
                    y01 = L.where(y, 1.0, 0.0)
                    return (L.where(x, y01, 0.0) if a[0] == "land" else L.where(x, 1.0, y01)).ne(0.0)
            return _BIN[a[0]](x, y)
        if op == "where":
            c, x, y = (self(v) for v in a)
            if a[0].op == "in":  # a mask read from memory: make the condition boolean
                c = c.ne(0.0)
            return L.where(c, x, y)
        if op == "pow":
            return self(a[0]) ** a[1]
        if op == "red":
            return _RED[a[0]](self(a[2]), self.nm(a[1]))
        if op == "take":
            return L.take(self.tensors[a[0]], self(a[1]), self.nm(a[2]))
        raise FrontendError(f"internal: unknown node {op}")


def axes_of(n: N, acc=None, seen=None) -> set:
    """Every Axis an expression mentions (to name them)."""
    acc = set() if acc is None else acc
    seen = set() if seen is None else seen
    if id(n) in seen:
        return acc
    seen.add(id(n))
    for x in n.args:
        if isinstance(x, Axis):
            acc.add(x.find())
        elif isinstance(x, N):
            axes_of(x, acc, seen)
    return acc


INF = math.inf
