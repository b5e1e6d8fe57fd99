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

import torch
import torch.fx
import torch.nn.functional as F

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
        self._has_contraction = None  # (whether the region holds a contraction: _rounds_in_kernel)

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
                   "abs": abs, "tanh": math.tanh, "erf": math.erf, "log1p": math.log1p, "expm1": math.expm1,
                   "floor": math.floor, "ceil": math.ceil, "round": round,
                   "sigmoid": lambda t: 1 / (1 + math.exp(-t))}[fn]
            return S(pyf(v), un(fn, x.n) if isinstance(x, S) and x.n is not None else None)
        return _elem(cx, lambda a: un(fn, a), x)
    return h


for _n in ("exp", "log", "sqrt", "rsqrt", "abs", "tanh", "erf", "log1p", "expm1", "floor", "ceil", "sigmoid"):
    KIND[_n] = "elementwise"
    H[_n] = _unary(_n)


@op("elementwise", "logical_not", "invert", "bitwise_not")
def _lnot(cx):
    return _elem(cx, lambda a: un("lnot", a), arg(cx, 0, "input"))


@op("elementwise", "round")
def _round(cx):
    if conc(arg(cx, None, "decimals", 0)):
        raise Unsupported("round(decimals=...) (only rounding to integers)")
    return _unary("round")(cx)


@op("elementwise", "softplus")
def _softplus(cx):
    x, beta, th = arg(cx, 0, "input"), float(conc(arg(cx, 1, "beta", 1.0))), float(conc(arg(cx, 2, "threshold", 20.0)))

    def f(a):   # torch: x where beta * x > threshold, else log(1 + exp(beta * x)) / beta
        bx = a if beta == 1 else bin_("mul", a, num(beta))
        sp = un("softplus", bx) if beta == 1 else bin_("div", un("softplus", bx), num(beta))
        return N("where", bin_("gt", bx, num(th)), a, sp)
    return _elem(cx, f, x)


@op("elementwise", "silu")
def _silu(cx):
    return _elem(cx, lambda a: bin_("div", a, bin_("add", num(1), un("exp", un("neg", a)))),
                 arg(cx, 0, "input"))


@op("elementwise", "relu")
def _relu(cx):
    return _elem(cx, lambda a: bin_("max2", a, num(0)), arg(cx, 0, "input"))


@op("elementwise", "gelu")
def _gelu(cx):
    if arg(cx, 1, "approximate", "none") != "tanh":   # exact: x * (1 + erf(x / sqrt(2))) / 2
        return _elem(cx, lambda a: bin_("mul", bin_("mul", num(0.5), a),
                                        bin_("add", num(1), un("erf", bin_("mul", a, num(math.sqrt(0.5)))))),
                     arg(cx, 0, "input"))
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
    src = x.meta.dtype
    if m.dtype == src:
        return TV(x.n, x.dims, m)
    rounds = _ROUNDING.get(src)
    if rounds and m.dtype.is_floating_point and torch.finfo(m.dtype).bits > torch.finfo(src).bits \
            and _rounds_in_kernel(cx, x):
        # a computed float16/bfloat16 value widened: eager holds it rounded to its type, and so
        # does the kernel, exactly (a residual add in bf16 read back in float32 by an RMSNorm)
        return TV(un(rounds, x.n), x.dims, m)
    if m.dtype == torch.bool:
        return TV(bin_("ne", x.n, num(0)), x.dims, m)
    if m.dtype in (torch.int32, torch.int64):
        return TV(un("int32" if m.dtype == torch.int32 else "int64", x.n) if src.is_floating_point else x.n,
                  x.dims, m)
    if m.dtype.is_floating_point and src.is_floating_point and torch.finfo(m.dtype).bits < torch.finfo(src).bits:
        if m.dtype in _ROUNDING and _rounds_in_kernel(cx, x):
            # rounded here, as eager rounds (HF's RMSNorm: `(x * rsqrt(var)).to(input_dtype)`),
            # bit-exact (af.cast); an output that ends with it is written in that dtype
            return TV(un(_ROUNDING[m.dtype], x.n), x.dims, m)
        raise Unsupported(f"a cast from {src} to {m.dtype} of a computed value rounds it there (eager "
                          "rounds at this point); acefuse kernels round only their outputs, so the "
                          "region ends before this cast")
    if not m.dtype.is_floating_point:
        raise Unsupported(f"a cast to {m.dtype} of a computed value")
    return TV(x.n, x.dims, m)


_ROUNDING = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _rounds_in_kernel(cx, x) -> bool:
    """Whether a float16/bfloat16 rounding of computed value ``x`` is a program operator (af.cast):
    in a region without contractions (the attention kernels take no cast between their matmuls,
    so such a region ends before the cast instead), of a value that is not already so rounded."""
    if getattr(cx, "_has_contraction", None) is None:
        cx._has_contraction = any(kind_of(n) == "contraction" for n in cx.region)
    exact = x.n.op in ("in", "num", "take") or x.n.op == "un" and x.n.args[0] in _ROUNDING.values()
    return not cx._has_contraction and not exact


@op("cast", "dropout")
def _dropout(cx):
    x, p, training = arg(cx, 0, "input"), conc(arg(cx, 1, "p", 0.5)), conc(arg(cx, 2, "training", True))
    if training and p > 0:
        raise Unsupported("dropout in training mode (random); call model.eval() or use p=0")
    return TV(x.n, x.dims, _meta(cx), x.leaf)




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


# the handlers of reductions, contractions and layout ops (they register themselves in H)
from acefuse.frontend import lower_reduce as _lower_reduce  # noqa: E402,F401
from acefuse.frontend import lower_layout as _lower_layout  # noqa: E402,F401
from acefuse.frontend.lower_layout import view_groups, is_pure_view  # noqa: E402,F401
from acefuse.frontend.lower_reduce import _NoIndices  # noqa: E402,F401

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
    if nm in ("max", "min") and _binary_maxmin(node):
        return "elementwise"      # torch.max(a, b): elementwise, nothing is reduced
    return KIND.get(nm) if nm else None


def _binary_maxmin(node) -> bool:
    """``torch.max(a, b)`` / ``a.min(b)``: the second operand is a tensor (``torch.max(x, 1)``
    reduces over dim 1 instead). A graph value without a recorded value is taken as a tensor:
    Dynamo records dims as constants, not as graph values."""
    o = node.kwargs.get("other", node.args[1] if len(node.args) > 1 else None)
    if not isinstance(o, torch.fx.Node):
        return False
    v = o.meta.get("af_val", o.meta.get("example_value"))
    return v is None or isinstance(v, torch.Tensor)


def lower_node(cx: Ctx, node):
    nm = name_of(node)
    if nm is None:
        err = UnsupportedOpError(op_name(node), source_line(node))
        err.node = node
        raise err
    cx.node = node
    try:
        return H[nm](cx)
    except Unsupported as e:
        err = UnsupportedOpError(op_name(node), source_line(node), str(e))
        err.node = node
        raise err from None
    except UnsupportedOpError as e:
        if getattr(e, "node", None) is None:
            e.node = node
        raise
    except FrontendError:
        raise
    except Exception as e:  # a malformed use: report it against the user's line
        err = UnsupportedOpError(op_name(node), source_line(node), f"{type(e).__name__}: {e}")
        err.node = node
        raise err from e

