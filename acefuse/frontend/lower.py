"""Lowering torch ops (FX nodes at the torch level) to acefuse expressions.

Each handler reads its arguments as abstract values and returns one:

- ``TV``: a tensor, an expression ``N`` with a dim list (``Axis`` per torch dim, ``None``
  for a dim of size 1). A tensor from outside the imported region is a *leaf*: its
  ``chain`` records the view ops (permute, reshape, narrow, ...) applied to it since, so
  a head split ``x.view(B, N, H, D).transpose(1, 2)`` becomes a program input that the
  runtime builds with the same (free) views.
- ``S``: a Python number known at import time, optionally with an expression
  (``x.size(-1)`` -> ``size(d)``), so scales like ``1/sqrt(D)`` stay symbolic.
- tuples and plain Python values.

Handlers write the plain definitions (softmax is ``exp(x - max) / sum(exp(x - max))``);
acefuse derives the fusion. ``KIND`` tells the partitioner what each op is made of.
"""
from __future__ import annotations

import math
import operator
import re

import torch
import torch.nn.functional as F

import acefuse.lang as L
from acefuse.frontend import ir
from acefuse.frontend.errors import FrontendError, UnsupportedOpError
from acefuse.frontend.graph import op_name, source_line
from acefuse.frontend.ir import Axis, N, num, un, bin_, red, unify


class Unsupported(Exception):
    """Raised inside a handler: this use of a supported op is not (detail in the message)."""


class TV:
    """A tensor value: expression + dims (Axis or None per torch dim) + fake/meta tensor."""

    __slots__ = ("n", "dims", "meta", "leaf")

    def __init__(self, n, dims, meta, leaf=None):
        self.n, self.dims, self.meta, self.leaf = n, list(dims), meta, leaf
        if meta is not None and len(self.dims) != meta.dim():
            raise FrontendError(f"internal: dims {self.dims} vs shape {tuple(meta.shape)}")

    @property
    def shape(self):
        return tuple(int(s) for s in self.meta.shape)


class Leaf:
    """A region input: the source node and the view chain applied to it at run time."""

    __slots__ = ("src", "chain")

    def __init__(self, src, chain=()):
        self.src, self.chain = src, tuple(chain)


class S:
    """An import-time scalar: its value, and an expression for it when it has one."""

    __slots__ = ("v", "n")

    def __init__(self, v, n=None):
        self.v, self.n = v, n

    def __index__(self):
        return int(self.v)

    def __int__(self):
        return int(self.v)

    def __float__(self):
        return float(self.v)


def conc(v):
    """The concrete Python value of an abstract non-tensor value."""
    if isinstance(v, S):
        return v.v
    if isinstance(v, (tuple, list)):
        return type(v)(conc(x) for x in v)
    return v


class Ctx:
    """State of one import: node values, leaves, and the program inputs they become."""

    def __init__(self, region: set, full: bool):
        self.region = region          # nodes being lowered (others are inputs)
        self.full = full              # whole-function import (from_torch) vs a region
        self.vals: dict = {}
        self.leaves: dict = {}        # key -> (Leaf, role, extra, [Axis])
        self.node = None

    # -- reading arguments ------------------------------------------------------------
    def val(self, a):
        if isinstance(a, torch.fx.Node):
            if a in self.vals:
                return self.vals[a]
            v = self._external(a)
            self.vals[a] = v
            return v
        if isinstance(a, (tuple, list)):
            return type(a)(self.val(x) for x in a)
        if isinstance(a, dict):
            return {k: self.val(x) for k, x in a.items()}
        return a

    def _external(self, node):
        v = node.meta.get("af_val")
        if isinstance(v, torch.Tensor):
            return TV(None, [Axis(s) if s != 1 else None for s in v.shape], v, Leaf(node))
        if isinstance(v, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in v):
            raise Unsupported("a tuple of tensors from outside the imported part")
        if v is None and "af_val" not in node.meta:
            raise FrontendError(f"internal: no value recorded for node {node.name}")
        return v

    # -- making expressions -------------------------------------------------------------
    def leaf_node(self, tv: TV, role="float", extra=()) -> N:
        """The input-tensor expression of a leaf (registers a program input)."""
        key = (tv.leaf.src, tv.leaf.chain, role, tuple(extra))
        if key not in self.leaves:
            self.leaves[key] = (tv.leaf, role, tuple(extra), [d for d in tv.dims if d is not None])
        else:  # the same input read again: its axes are the same axes
            for a, b in zip(self.leaves[key][3], [d for d in tv.dims if d is not None]):
                unify(a, b)
        return N("in", key)

    def n(self, v) -> N:
        """Expression of an operand: a tensor, an import-time scalar or a number."""
        if isinstance(v, TV):
            if v.n is None:
                v.n = self.leaf_node(v)
            return v.n
        if isinstance(v, S):
            return v.n if v.n is not None else num(v.v)
        if isinstance(v, bool):
            return num(1.0 if v else 0.0)
        if isinstance(v, (int, float)):
            return num(v)
        raise Unsupported(f"operand {v!r} of type {type(v).__name__}")


# ---- helpers ----------------------------------------------------------------------------
def _meta(cx):
    return cx.node.meta.get("af_val")


def arg(cx, i, name, default=None):
    node = cx.node
    if i is not None and i < len(node.args):
        return cx.val(node.args[i])
    if name in node.kwargs:
        return cx.val(node.kwargs[name])
    return default


def _dim(d, nd):
    d = int(conc(d))
    if not -nd <= d < max(nd, 1):
        raise Unsupported(f"dim {d} out of range for a {nd}-d tensor")
    return d % nd if nd else 0


def _dims_arg(d, nd):
    d = conc(d)
    if d is None or (isinstance(d, (tuple, list)) and len(d) == 0):
        return list(range(nd))
    if isinstance(d, (tuple, list)):
        return sorted(_dim(x, nd) for x in d)
    return [_dim(d, nd)]


def _bcast(*dimss):
    n = max((len(d) for d in dimss), default=0)
    out = [None] * n
    for dims in dimss:
        pad = [None] * (n - len(dims)) + list(dims)
        for i, d in enumerate(pad):
            if d is None:
                continue
            out[i] = d if out[i] is None else unify(out[i], d)
    return out


def _tv(cx, n, dims):
    m = _meta(cx)
    dims = list(dims)
    if isinstance(m, torch.Tensor) and m.dim() != len(dims):
        raise FrontendError(f"internal: {op_name(cx.node)} gave {len(dims)} dims, torch {m.dim()}")
    return TV(n, dims, m)


def _elem(cx, fn, *vals):
    dims = _bcast(*[v.dims for v in vals if isinstance(v, TV)])
    return _tv(cx, fn(*[cx.n(v) for v in vals]), dims)


def _scalar_or(cx, op, a, b, pyop):
    """Binary op on tensors (elementwise, broadcasting) or on import-time scalars."""
    if not isinstance(a, TV) and not isinstance(b, TV):
        va, vb = conc(a), conc(b)
        v = pyop(va, vb)
        ne = None
        if isinstance(a, S) and a.n is not None or isinstance(b, S) and b.n is not None:
            ne = bin_(op, cx.n(a), cx.n(b)) if op in ("add", "sub", "mul", "div") else None
        return S(v, ne)
    return _elem(cx, lambda x, y: bin_(op, x, y), a, b)


def _reduce(cx, kind, x: TV, dims, keepdim):
    n = cx.n(x)
    out = list(x.dims)
    count = None
    for d in dims:
        ax = x.dims[d]
        if ax is None:
            continue
        n = red(kind, ax, n)
        sz = N("size", ax)
        count = sz if count is None else bin_("mul", count, sz)
        out[d] = None
    if not keepdim:
        out = [a for i, a in enumerate(out) if i not in dims]
    return n, out, count


# ---- handlers -----------------------------------------------------------------------------
H: dict = {}        # op name -> handler(cx)
KIND: dict = {}     # op name -> elementwise | layout | reduce | contraction | static | cast


def op(kind, *names):
    def deco(fn):
        for nm in names:
            H[nm] = fn
            KIND[nm] = kind
        return fn
    return deco


_BINOPS = {"add": ("add", operator.add), "sub": ("sub", operator.sub), "mul": ("mul", operator.mul),
           "div": ("div", operator.truediv), "truediv": ("div", operator.truediv),
           "maximum": ("max2", max), "minimum": ("min2", min),
           "lt": ("lt", operator.lt), "le": ("le", operator.le), "gt": ("gt", operator.gt),
           "ge": ("ge", operator.ge), "eq": ("eq", operator.eq), "ne": ("ne", operator.ne),
           "logical_and": ("land", lambda a, b: a and b), "and_": ("land", operator.and_),
           "logical_or": ("lor", lambda a, b: a or b), "or_": ("lor", operator.or_),
           "floordiv": (None, operator.floordiv), "mod": (None, operator.mod)}


def _binary(name):
    opn, pyop = _BINOPS[name]

    def h(cx):
        a, b = arg(cx, 0, "input"), arg(cx, 1, "other")
        if name in ("add", "sub"):
            alpha = conc(arg(cx, 2, "alpha", 1))
            if alpha != 1:
                b = _elem(cx, lambda x: bin_("mul", x, num(alpha)), b) if isinstance(b, TV) else conc(b) * alpha
        if name == "div" and arg(cx, 2, "rounding_mode") is not None:
            raise Unsupported("rounding_mode (integer division)")
        if opn is None:
            if isinstance(a, TV) or isinstance(b, TV):
                raise Unsupported(f"{name} on tensors")
            return S(pyop(conc(a), conc(b)))
        return _scalar_or(cx, opn, a, b, pyop)
    return h


for _n in _BINOPS:
    KIND[_n] = "elementwise"
    H[_n] = _binary(_n)
for _n, _m in (("iadd", "add"), ("isub", "sub"), ("imul", "mul"), ("itruediv", "div")):
    KIND[_n] = "elementwise"
    H[_n] = H[_m]


@op("elementwise", "rsub")
def _rsub(cx):
    a, b = arg(cx, 0, "input"), arg(cx, 1, "other")
    return _scalar_or(cx, "sub", b, a, operator.sub)


@op("elementwise", "neg", "negative")
def _neg(cx):
    x = arg(cx, 0, "input")
    if not isinstance(x, TV):
        return S(-conc(x), un("neg", x.n) if isinstance(x, S) and x.n is not None else None)
    return _elem(cx, lambda a: un("neg", a), x)


def _unary(fn):
    def h(cx):
        x = arg(cx, 0, "input")
        if not isinstance(x, TV):
            v = conc(x)
            pyf = {"exp": math.exp, "log": math.log, "sqrt": math.sqrt, "rsqrt": lambda t: 1 / math.sqrt(t),
                   "abs": abs, "tanh": math.tanh}[fn]
            return S(pyf(v), un(fn, x.n) if isinstance(x, S) and x.n is not None else None)
        return _elem(cx, lambda a: un(fn, a), x)
    return h


for _n in ("exp", "log", "sqrt", "rsqrt", "abs", "tanh"):
    KIND[_n] = "elementwise"
    H[_n] = _unary(_n)


@op("elementwise", "logical_not", "invert", "bitwise_not")
def _lnot(cx):
    return _elem(cx, lambda a: un("lnot", a), arg(cx, 0, "input"))


@op("elementwise", "sigmoid")
def _sigmoid(cx):
    return _elem(cx, lambda a: bin_("div", num(1), bin_("add", num(1), un("exp", un("neg", a)))),
                 arg(cx, 0, "input"))


@op("elementwise", "silu")
def _silu(cx):
    return _elem(cx, lambda a: bin_("div", a, bin_("add", num(1), un("exp", un("neg", a)))),
                 arg(cx, 0, "input"))


@op("elementwise", "relu")
def _relu(cx):
    return _elem(cx, lambda a: bin_("max2", a, num(0)), arg(cx, 0, "input"))


@op("elementwise", "gelu")
def _gelu(cx):
    if arg(cx, 1, "approximate", "none") != "tanh":
        raise Unsupported("exact gelu needs erf, which acefuse has no operator for; "
                          "use F.gelu(x, approximate='tanh')")
    c = math.sqrt(2 / math.pi)

    def g(a):
        inner = bin_("mul", num(c), bin_("add", a, bin_("mul", num(0.044715), bin_("mul", a, bin_("mul", a, a)))))
        return bin_("mul", bin_("mul", num(0.5), a), bin_("add", num(1), un("tanh", inner)))
    return _elem(cx, g, arg(cx, 0, "input"))


@op("elementwise", "square")
def _square(cx):
    return _elem(cx, lambda a: bin_("mul", a, a), arg(cx, 0, "input"))


@op("elementwise", "reciprocal")
def _recip(cx):
    return _elem(cx, lambda a: bin_("div", num(1), a), arg(cx, 0, "input"))


@op("elementwise", "pow")
def _pow(cx):
    x, p = arg(cx, 0, "input"), arg(cx, 1, "exponent")
    if isinstance(p, TV):
        raise Unsupported("a tensor exponent")
    p = conc(p)
    if not isinstance(x, TV):
        return S(conc(x) ** p, N("pow", x.n, float(p)) if isinstance(x, S) and x.n is not None else None)
    if p == 2:
        return _elem(cx, lambda a: bin_("mul", a, a), x)
    if p == 1:
        return _elem(cx, lambda a: a, x)
    if p == 0.5:
        return _elem(cx, lambda a: un("sqrt", a), x)
    if p == -0.5:
        return _elem(cx, lambda a: un("rsqrt", a), x)
    return _elem(cx, lambda a: N("pow", a, float(p)), x)


@op("elementwise", "clamp", "clip")
def _clamp(cx):
    x, lo, hi = arg(cx, 0, "input"), arg(cx, 1, "min"), arg(cx, 2, "max")
    vals = [x] + [v for v in (lo, hi) if v is not None]

    def f(a, *bs):
        i = 0
        if lo is not None:
            a = bin_("max2", a, bs[i])
            i += 1
        if hi is not None:
            a = bin_("min2", a, bs[i])
        return a
    return _elem(cx, f, *vals)


@op("elementwise", "where")
def _where(cx):
    c, a, b = arg(cx, 0, "condition"), arg(cx, 1, "input"), arg(cx, 2, "other")
    if a is None:
        raise Unsupported("torch.where(cond) with one argument (indices)")
    return _elem(cx, lambda x, y, z: N("where", x, y, z), c, a, b)


@op("elementwise", "masked_fill")
def _masked_fill(cx):
    x, m, v = arg(cx, 0, "input"), arg(cx, 1, "mask"), arg(cx, 2, "value")
    return _elem(cx, lambda a, c, b: N("where", c, b, a), x, m, v)


@op("cast", "to", "float", "double", "half", "bfloat16", "type_as", "type", "contiguous", "clone",
    "detach", "alias")
def _cast(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    if not isinstance(x, TV):
        raise Unsupported(f"a cast of {x!r}")
    if x.n is None and x.leaf is not None:  # an input: cast it at run time
        step = ("to", m.dtype) if m.dtype != x.meta.dtype else ("id",)
        return TV(None, x.dims, m, Leaf(x.leaf.src, x.leaf.chain + (step,)) if step[0] == "to" else x.leaf)
    if not (m.dtype.is_floating_point or m.dtype == torch.bool) and m.dtype != x.meta.dtype:
        raise Unsupported(f"a cast to {m.dtype} of a computed value (integer results are not expressible)")
    return TV(x.n, x.dims, m)


@op("cast", "dropout")
def _dropout(cx):
    x, p, training = arg(cx, 0, "input"), conc(arg(cx, 1, "p", 0.5)), conc(arg(cx, 2, "training", True))
    if training and p > 0:
        raise Unsupported("dropout in training mode (random); call model.eval() or use p=0")
    return TV(x.n, x.dims, _meta(cx), x.leaf)


# -- reductions ------------------------------------------------------------------------------
def _red_handler(kind, mean=False):
    def h(cx):
        x = arg(cx, 0, "input")
        d = arg(cx, 1, "dim")
        keep = bool(conc(arg(cx, 2, "keepdim", False)))
        dims = _dims_arg(d, len(x.dims))
        n, out, count = _reduce(cx, kind, x, dims, keep)
        if mean and count is not None:
            n = bin_("div", n, count)
        return _tv(cx, n, out)
    return h


op("reduce", "sum")(_red_handler("sum"))
op("reduce", "mean")(_red_handler("sum", mean=True))
op("reduce", "amax")(_red_handler("max"))
op("reduce", "amin")(_red_handler("min"))


def _maxmin(kind):
    def h(cx):
        x = arg(cx, 0, "input")
        d = arg(cx, 1, "dim")
        other = d if isinstance(d, TV) else arg(cx, None, "other")
        if isinstance(other, TV):
            return _elem(cx, lambda a, b: bin_("max2" if kind == "max" else "min2", a, b), x, other)
        if d is None:
            n, out, _ = _reduce(cx, kind, x, list(range(len(x.dims))), False)
            return _tv(cx, n, out)
        keep = bool(conc(arg(cx, 2, "keepdim", False)))
        n, out, _ = _reduce(cx, kind, x, _dims_arg(d, len(x.dims)), keep)
        m = _meta(cx)
        return (TV(n, out, m[0]), _NoIndices(cx.node, kind))
    return h


class _NoIndices:
    def __init__(self, node, kind):
        self.node, self.kind = node, kind


op("reduce", "max")(_maxmin("max"))
op("reduce", "min")(_maxmin("min"))


def _var_n(cx, x, dims, correction, keep):
    mu, _, count = _reduce(cx, "sum", x, dims, True)
    if count is None:
        return num(0.0), [d for i, d in enumerate(x.dims) if keep or i not in dims], None
    mu = bin_("div", mu, count)
    xc = bin_("sub", cx.n(x), mu)
    s, out, _ = _reduce(cx, "sum", TV(bin_("mul", xc, xc), x.dims, x.meta), dims, keep)
    den = bin_("sub", count, num(correction)) if correction else count
    return bin_("div", s, den), out, count


def _correction(cx):
    c = arg(cx, None, "correction")
    if c is not None:
        return float(conc(c))
    u = arg(cx, None, "unbiased")
    if u is None and len(cx.node.args) > 2 and isinstance(cx.node.args[1], (int, tuple, list)):
        u = cx.val(cx.node.args[2])
    return 1.0 if (u is None or conc(u)) else 0.0


@op("reduce", "var")
def _var(cx):
    x = arg(cx, 0, "input")
    dims = _dims_arg(arg(cx, 1, "dim"), len(x.dims))
    n, out, _ = _var_n(cx, x, dims, _correction(cx), bool(conc(arg(cx, None, "keepdim", False))))
    return _tv(cx, n, out)


@op("reduce", "std")
def _std(cx):
    x = arg(cx, 0, "input")
    dims = _dims_arg(arg(cx, 1, "dim"), len(x.dims))
    n, out, _ = _var_n(cx, x, dims, _correction(cx), bool(conc(arg(cx, None, "keepdim", False))))
    return _tv(cx, un("sqrt", n), out)


def _fused_axis(x: TV, d):
    ax = x.dims[d]
    if ax is not None:
        ax.set_hint("j")
    return ax


@op("reduce", "softmax", "log_softmax")
def _softmax(cx):
    name = cx.node.target if cx.node.op == "call_method" else cx.node.target.__name__
    x = arg(cx, 0, "input")
    d = arg(cx, 1, "dim")
    if d is None:
        raise Unsupported("softmax without dim (implicit dim is deprecated); pass dim=-1")
    d = _dim(d, len(x.dims))
    ax = _fused_axis(x, d)
    xn = cx.n(x)
    if ax is None:  # softmax over a dim of size 1
        n = num(0.0) if "log" in name else num(1.0)
        return _tv(cx, bin_("add", bin_("mul", xn, num(0)), n), x.dims)
    m = red("max", ax, xn)
    e = un("exp", bin_("sub", xn, m))
    s = red("sum", ax, e)
    if "log" in name:
        return _tv(cx, bin_("sub", bin_("sub", xn, m), un("log", s)), x.dims)
    return _tv(cx, bin_("div", e, s), x.dims)


def _lse(xn, ax):
    m = red("max", ax, xn)
    return bin_("add", m, un("log", red("sum", ax, un("exp", bin_("sub", xn, m)))))


@op("reduce", "logsumexp")
def _logsumexp(cx):
    x = arg(cx, 0, "input")
    dims = _dims_arg(arg(cx, 1, "dim"), len(x.dims))
    keep = bool(conc(arg(cx, 2, "keepdim", False)))
    n = cx.n(x)
    out = list(x.dims)
    for d in dims:
        ax = _fused_axis(x, d)
        if ax is not None:
            n = _lse(n, ax)
        out[d] = None
    if not keep:
        out = [a for i, a in enumerate(out) if i not in dims]
    return _tv(cx, n, out)


def _affine(cx, n, dims, w, b):
    if w is not None:
        dims = _bcast(dims, w.dims)
        n = bin_("mul", n, cx.n(w))
    if b is not None:
        dims = _bcast(dims, b.dims)
        n = bin_("add", n, cx.n(b))
    return n, dims


@op("reduce", "layer_norm")
def _layer_norm(cx):
    x, ns = arg(cx, 0, "input"), conc(arg(cx, 1, "normalized_shape"))
    w, b, eps = arg(cx, 2, "weight"), arg(cx, 3, "bias"), conc(arg(cx, 4, "eps", 1e-5))
    k = len(ns) if isinstance(ns, (tuple, list)) else 1
    dims = list(range(len(x.dims) - k, len(x.dims)))
    for d in dims:
        _fused_axis(x, d)
    var, _, count = _var_n(cx, x, dims, 0.0, True)
    mu, _, _ = _reduce(cx, "sum", x, dims, True)
    xc = bin_("sub", cx.n(x), bin_("div", mu, count) if count is not None else mu)
    n = bin_("mul", xc, un("rsqrt", bin_("add", var, num(eps))))
    n, out = _affine(cx, n, x.dims, w, b)
    return _tv(cx, n, out)


@op("reduce", "rms_norm")
def _rms_norm(cx):
    x, ns = arg(cx, 0, "input"), conc(arg(cx, 1, "normalized_shape"))
    w, eps = arg(cx, 2, "weight"), conc(arg(cx, 3, "eps"))
    if eps is None:
        eps = torch.finfo(x.meta.dtype).eps
    k = len(ns) if isinstance(ns, (tuple, list)) else 1
    dims = list(range(len(x.dims) - k, len(x.dims)))
    for d in dims:
        _fused_axis(x, d)
    xn = cx.n(x)
    ms, _, count = _reduce(cx, "sum", TV(bin_("mul", xn, xn), x.dims, x.meta), dims, True)
    ms = bin_("div", ms, count) if count is not None else ms
    n = bin_("mul", xn, un("rsqrt", bin_("add", ms, num(eps))))
    n, out = _affine(cx, n, x.dims, w, None)
    return _tv(cx, n, out)


@op("reduce", "cross_entropy")
def _cross_entropy(cx):
    x, t = arg(cx, 0, "input"), arg(cx, 1, "target")
    w = arg(cx, 2, "weight")
    ii = int(conc(arg(cx, 4, "ignore_index", -100)))
    reduction = conc(arg(cx, 6, "reduction", "mean"))
    ls = float(conc(arg(cx, 7, "label_smoothing", 0.0)))
    if conc(arg(cx, 3, "size_average")) is not None or conc(arg(cx, 5, "reduce")) is not None:
        raise Unsupported("the deprecated size_average/reduce arguments; use reduction=")
    if w is not None:
        raise Unsupported("per-class weight")
    if not isinstance(t, TV) or t.meta.dtype.is_floating_point:
        raise Unsupported("class-probability targets (only integer class indices are supported)")
    cd = 1 if len(x.dims) > 1 else 0
    cax = x.dims[cd]
    if cax is None:
        raise Unsupported("a single class")
    cax.set_hint("j")
    rest = [d for i, d in enumerate(x.dims) if i != cd]
    if len(rest) != len(t.dims):
        raise Unsupported("target shape does not match the input without its class dim")
    for a, b in zip(rest, t.dims):
        if a is not None and b is not None:
            unify(a, b)
    xn = cx.n(x)
    lse = _lse(xn, cax)
    if t.leaf is not None and xn.op == "in":  # an input: a gather along the class axis
        idx = cx.leaf_node(t, role="index", extra=("clamp", cax.size))
        xt = N("take", xn.args[0], idx, cax)
    else:  # a computed input: gather by a one-hot sum over the classes
        tf = cx.leaf_node(t) if t.leaf is not None else cx.n(t)
        xt = red("sum", cax, N("where", bin_("eq", N("idx", cax), tf), xn, num(0)))
    loss = bin_("sub", lse, xt)
    if ls:
        smooth = bin_("sub", lse, bin_("div", red("sum", cax, xn), N("size", cax)))
        loss = bin_("add", bin_("mul", num(1 - ls), loss), bin_("mul", num(ls), smooth))
    valid = cx.leaf_node(t, role="float", extra=("ne", ii)) if t.leaf is not None else bin_("ne", cx.n(t), num(ii))
    loss = N("where", valid, loss, num(0))
    dims = [a if a is not None else b for a, b in zip(rest, t.dims)]
    if reduction == "none":
        return _tv(cx, loss, dims)
    n, cnt = loss, valid
    for a in dims:
        if a is not None:
            n, cnt = red("sum", a, n), red("sum", a, cnt)
    if reduction == "sum":
        return _tv(cx, n, [])
    if reduction == "mean":
        return _tv(cx, bin_("div", n, cnt), [])
    raise Unsupported(f"reduction={reduction!r}")


# -- contractions -------------------------------------------------------------------------------
def _contract(a_n, a_dims, b_n, b_dims, k_a, k_b):
    """sum over the unified axis of a * b."""
    if k_a is None or k_b is None:
        return bin_("mul", a_n, b_n)
    k = unify(k_a, k_b)
    k.set_hint("e")
    return red("sum", k, bin_("mul", a_n, b_n))


@op("contraction", "matmul", "bmm", "mm")
def _matmul(cx):
    a, b = arg(cx, 0, "input"), arg(cx, 1, "other")
    ad, bd = list(a.dims), list(b.dims)
    a1, b1 = len(ad) == 1, len(bd) == 1
    if a1:
        ad = [None] + ad
    if b1:
        bd = bd + [None]
    ka, kb = ad[-1], bd[-2]
    batch = _bcast(ad[:-2], bd[:-2])
    n = _contract(cx.n(a), ad, cx.n(b), bd, ka, kb)
    out = batch + ([] if a1 else [ad[-2]]) + ([] if b1 else [bd[-1]])
    return _tv(cx, n, out)


@op("contraction", "linear")
def _linear(cx):
    x, w, b = arg(cx, 0, "input"), arg(cx, 1, "weight"), arg(cx, 2, "bias")
    wd = list(w.dims)
    n = _contract(cx.n(x), x.dims, cx.n(w), wd, x.dims[-1], wd[-1])
    out = list(x.dims[:-1]) + ([wd[0]] if len(wd) == 2 else [])
    if b is not None:
        out = _bcast(out, b.dims)
        n = bin_("add", n, cx.n(b))
    return _tv(cx, n, out)


@op("contraction", "einsum")
def _einsum(cx):
    eq = conc(cx.val(cx.node.args[0])).replace(" ", "")
    ops = [cx.val(a) for a in cx.node.args[1:]]
    if len(ops) == 1 and isinstance(ops[0], (tuple, list)):
        ops = list(ops[0])
    if "..." in eq:
        raise Unsupported("'...' in an einsum equation")
    lhs, _, rhs = eq.partition("->")
    specs = lhs.split(",")
    if not _:
        cnt = {}
        for c in lhs.replace(",", ""):
            cnt[c] = cnt.get(c, 0) + 1
        rhs = "".join(sorted(c for c, k in cnt.items() if k == 1))
    letters: dict = {}
    n = None
    for spec, t in zip(specs, ops):
        if len(spec) != len(t.dims):
            raise Unsupported(f"einsum operand {spec!r} has {len(t.dims)} dims")
        for c, d in zip(spec, t.dims):
            if d is None:
                continue
            letters[c] = unify(letters[c], d) if c in letters else d
        n = cx.n(t) if n is None else bin_("mul", n, cx.n(t))
    for c, d in letters.items():
        if c not in rhs:
            d.set_hint("e")
            n = red("sum", d, n)
    return _tv(cx, n, [letters.get(c) for c in rhs])


@op("contraction", "scaled_dot_product_attention")
def _sdpa(cx):
    q, k, v = arg(cx, 0, "query"), arg(cx, 1, "key"), arg(cx, 2, "value")
    mask, p = arg(cx, 3, "attn_mask"), float(conc(arg(cx, 4, "dropout_p", 0.0)))
    causal, scale = bool(conc(arg(cx, 5, "is_causal", False))), conc(arg(cx, 6, "scale"))
    gqa = bool(conc(arg(cx, 7, "enable_gqa", False)))
    if p > 0:
        raise Unsupported("dropout_p > 0 (random)")
    if len(q.dims) >= 3 and q.shape[-3] != k.shape[-3]:
        if not gqa:
            raise Unsupported(f"query has {q.shape[-3]} heads and key {k.shape[-3]}; pass enable_gqa=True")
        g = q.shape[-3] // k.shape[-3]
        k, v = (_leaf_chain(t, ("repeat_interleave", g, len(t.dims) - 3),
                            list(t.dims[:-3]) + [Axis(q.shape[-3])] + list(t.dims[-2:]))
                for t in (k, v))
    ld, sd = q.dims[-2], k.dims[-2]
    if sd is not None:
        sd.set_hint("j")
    if sd is not None and v.dims[-2] is not None:
        unify(sd, v.dims[-2])
    batch = _bcast(q.dims[:-2], k.dims[:-2], v.dims[:-2])
    e = q.dims[-1]
    s = _contract(cx.n(q), q.dims, cx.n(k), k.dims, e, k.dims[-1])
    sc = num(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    s = bin_("mul", s, sc)
    sdims = batch + [ld, sd]
    if causal:
        if ld is None or sd is None:
            raise Unsupported("is_causal with a query or key length of 1")
        s = N("where", bin_("le", N("idx", sd), N("idx", ld)), s, num(-math.inf))
    if mask is not None:
        sdims = _bcast(sdims, mask.dims)
        mn = cx.n(mask)
        if mask.meta.dtype == torch.bool:
            s = N("where", mn, s, num(-math.inf))
        else:
            s = bin_("add", s, mn)
    if sd is None:
        raise Unsupported("a key length of 1")
    m = red("max", sd, s)
    pe = un("exp", bin_("sub", s, m))
    l = red("sum", sd, pe)
    o = red("sum", sd, bin_("mul", pe, cx.n(v)))
    out = _bcast(batch, v.dims[:-2]) + [ld, v.dims[-1]]
    return _tv(cx, bin_("div", o, l), out)


# -- layout -------------------------------------------------------------------------------------
def _leaf_chain(x: TV, step, dims, meta=None):
    if x.leaf is None or x.n is not None:
        raise Unsupported(f"`{step[0]}` of a value computed inside the function (only inputs can be "
                          "re-viewed: compute it in torch before the call)")
    m = meta if meta is not None else x.meta
    if m is not None and step[0] == "repeat_interleave":
        shape = list(x.meta.shape)
        shape[step[2]] *= step[1]
        m = x.meta.new_empty(shape)
    return TV(None, dims, m, Leaf(x.leaf.src, x.leaf.chain + (step,)))


def _relayout(cx, x: TV, dims, step):
    """A view op: re-indexes dims; on an input it is recorded for the runtime."""
    m = _meta(cx)
    if x.n is None and x.leaf is not None:
        return TV(None, dims, m, Leaf(x.leaf.src, x.leaf.chain + (step,)))
    return TV(x.n, dims, m)


@op("layout", "transpose", "swapaxes", "swapdims")
def _transpose(cx):
    x = arg(cx, 0, "input")
    nd = len(x.dims)
    a, b = _dim(arg(cx, 1, "dim0"), nd), _dim(arg(cx, 2, "dim1"), nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _relayout(cx, x, [x.dims[i] for i in perm], ("permute", tuple(perm)))


@op("layout", "t")
def _t(cx):
    x = arg(cx, 0, "input")
    perm = list(range(len(x.dims)))[::-1]
    return _relayout(cx, x, [x.dims[i] for i in perm], ("permute", tuple(perm)))


@op("layout", "permute")
def _permute(cx):
    x = arg(cx, 0, "input")
    perm = [conc(cx.val(a)) for a in cx.node.args[1:]] or conc(arg(cx, None, "dims"))
    if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
        perm = list(perm[0])
    perm = [_dim(p, len(x.dims)) for p in perm]
    return _relayout(cx, x, [x.dims[i] for i in perm], ("permute", tuple(perm)))


@op("layout", "unsqueeze")
def _unsqueeze(cx):
    x = arg(cx, 0, "input")
    d = _dim(arg(cx, 1, "dim"), len(x.dims) + 1)
    dims = list(x.dims)
    dims.insert(d, None)
    return _relayout(cx, x, dims, ("reshape", tuple(_meta(cx).shape)))


@op("layout", "squeeze")
def _squeeze(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    d = arg(cx, 1, "dim")
    drop = [i for i in _dims_arg(d, len(x.dims)) if x.shape[i] == 1] if d is not None else \
        [i for i, s in enumerate(x.shape) if s == 1]
    return _relayout(cx, x, [a for i, a in enumerate(x.dims) if i not in drop], ("reshape", tuple(m.shape)))


def view_groups(src, dst):
    """Align two shapes of equal numel into groups ([src dims], [dst dims]) of equal size."""
    i = j = 0
    out = []
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            out.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            out.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise Unsupported(f"cannot align shapes {tuple(src)} and {tuple(dst)}")
        gi, gj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        out.append((gi, gj))
    return out


def is_pure_view(src, dst) -> bool:
    """A view that only adds or drops dims of size 1 (no split, no merge)."""
    if 0 in src or 0 in dst:
        return False
    return all(len(gi) <= 1 and len(gj) <= 1 for gi, gj in view_groups(list(src), list(dst)))


@op("layout", "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "expand_dims")
def _view(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    src, dst = list(x.shape), [int(s) for s in m.shape]
    if 0 in src or 0 in dst:
        raise Unsupported("an empty dim")
    dims = [None] * len(dst)
    split = False
    for gi, gj in view_groups(src, dst):
        if len(gi) == 1 and len(gj) == 1:
            dims[gj[0]] = x.dims[gi[0]]
        elif gi and gj:
            split = True
            for j in gj:
                dims[j] = Axis(dst[j]) if dst[j] != 1 else None
    if split and not (x.n is None and x.leaf is not None):
        raise Unsupported(f"a view from {tuple(src)} to {tuple(dst)} splits or merges dims of a value "
                          "computed inside the function; acefuse splits only inputs (the head split "
                          "x.view(B, N, H, D).transpose(1, 2)); do the merge in torch after the call")
    return _relayout(cx, x, dims, ("reshape", tuple(dst)))


@op("layout", "expand", "expand_as", "broadcast_to")
def _expand(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    dst = [int(s) for s in m.shape]
    pad = [None] * (len(dst) - len(x.dims)) + list(x.dims)
    dims = [a if a is not None else (Axis(s) if s != 1 else None) for a, s in zip(pad, dst)]
    if x.n is None and x.leaf is not None:
        # an expanded input is read as if it did not range over the new dims
        return TV(cx.n(x), dims, m)
    return TV(x.n, dims, m)


@op("layout", "split", "chunk", "unbind")
def _split(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    name = cx.node.target if cx.node.op == "call_method" else cx.node.target.__name__
    d = _dim(arg(cx, 2 if name != "unbind" else 1, "dim", 0), len(x.dims))
    if x.n is not None or x.leaf is None:
        raise Unsupported(f"{name} of a value computed inside the function")
    out, start = [], 0
    for piece in m:
        ln = int(piece.shape[d]) if name != "unbind" else 1
        dims = list(x.dims)
        if name == "unbind":
            dims.pop(d)
        else:
            dims[d] = Axis(ln) if ln != 1 else None
        out.append(TV(None, dims, piece, Leaf(x.leaf.src, x.leaf.chain + (("narrow", d, start, ln, name == "unbind"),))))
        start += ln
    return tuple(out)


# -- import-time values (shapes) --------------------------------------------------------------
@op("static", "size")
def _size(cx):
    x = arg(cx, 0, "input")
    d = arg(cx, 1, "dim")
    if d is None:
        return tuple(S(s, N("size", a) if a is not None else None) for s, a in zip(x.shape, x.dims))
    d = _dim(d, len(x.dims))
    a = x.dims[d]
    return S(x.shape[d], N("size", a) if a is not None else None)


@op("static", "dim", "ndimension")
def _ndim(cx):
    return S(len(arg(cx, 0, "input").dims))


@op("static", "getattr")
def _getattr(cx):
    x, name = arg(cx, 0, "input"), cx.node.args[1]
    if isinstance(x, TV):
        if name == "shape":
            return tuple(S(s, N("size", a) if a is not None else None) for s, a in zip(x.shape, x.dims))
        if name in ("dtype", "device", "ndim"):
            return getattr(x.meta, name)
        if name in ("T", "mT"):
            raise Unsupported(f"Tensor.{name}; use transpose")
    raise Unsupported(f"attribute {name!r}")


@op("static", "getitem")
def _getitem(cx):
    x, i = cx.val(cx.node.args[0]), cx.node.args[1]
    if isinstance(x, TV):
        raise Unsupported("indexing or slicing a tensor (use narrow/split on inputs, or index in torch)")
    v = x[conc(cx.val(i))]
    if isinstance(v, _NoIndices):
        raise UnsupportedOpError(f"torch.{v.kind}(...).indices", source_line(v.node),
                                 "the indices of a max/min are not expressible; use amax/amin")
    return v


@op("static", "sqrt_scalar")
def _msqrt(cx):
    x = arg(cx, 0, "x")
    return S(math.sqrt(conc(x)), un("sqrt", x.n) if isinstance(x, S) and x.n is not None else None)


# ---- target -> op name -------------------------------------------------------------------------
_FUNC_NAMES: dict = {}


def _register_funcs():
    names = set(H) - {"getattr", "getitem", "sqrt_scalar"}
    for nm in names:
        for mod in (torch, F, torch.special, torch.linalg):
            f = getattr(mod, nm, None)
            if f is not None and callable(f):
                _FUNC_NAMES.setdefault(f, nm)
    for nm in ("add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pow", "matmul", "lt", "le",
               "gt", "ge", "eq", "ne", "and_", "or_", "invert", "getitem", "iadd", "isub", "imul",
               "itruediv"):
        _FUNC_NAMES[getattr(operator, nm)] = nm
    _FUNC_NAMES[torch.true_divide] = "div"
    _FUNC_NAMES[torch.divide] = "div"
    _FUNC_NAMES[torch.multiply] = "mul"
    _FUNC_NAMES[torch.subtract] = "sub"
    _FUNC_NAMES[F.softmax] = "softmax"
    _FUNC_NAMES[F.log_softmax] = "log_softmax"
    _FUNC_NAMES[getattr] = "getattr"
    _FUNC_NAMES[math.sqrt] = "sqrt_scalar"
    _FUNC_NAMES[torch._C._nn.linear] = "linear"
    _FUNC_NAMES[torch._C._nn.gelu] = "gelu"
    _FUNC_NAMES[torch.nn.functional.dropout] = "dropout"


_register_funcs()
# F.softmax(input, dim, _stacklevel, dtype) differs from torch.softmax(input, dim, dtype) only
# after dim, which the handlers do not read positionally.


def name_of(node) -> str | None:
    """The op table's name for a node (None when there is no handler)."""
    if node.op == "call_method":
        return node.target if node.target in H else None
    if node.op == "call_function":
        try:
            return _FUNC_NAMES.get(node.target)
        except TypeError:
            return None
    return None


def kind_of(node) -> str | None:
    nm = name_of(node)
    return KIND.get(nm) if nm else None


def lower_node(cx: Ctx, node):
    nm = name_of(node)
    if nm is None:
        raise UnsupportedOpError(op_name(node), source_line(node))
    cx.node = node
    try:
        return H[nm](cx)
    except Unsupported as e:
        raise UnsupportedOpError(op_name(node), source_line(node), str(e)) from None
    except UnsupportedOpError:
        raise
    except FrontendError:
        raise
    except Exception as e:  # a malformed use: report it against the user's line
        raise UnsupportedOpError(op_name(node), source_line(node), f"{type(e).__name__}: {e}") from e
