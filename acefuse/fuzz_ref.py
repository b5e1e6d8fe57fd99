"""The fuzzer's program pairs (an acefuse expression and a node tree) and its independent
float64 reference over the node tree, with the kernels' numerics conventions in one place.
Split out of acefuse/fuzz.py (whose docstring states the conventions and the oracle)."""
from __future__ import annotations

import math

import torch

import acefuse as af
from acefuse.backward import EXT_REL

BOUND = 3e4          # finite inputs are within [-BOUND, BOUND] (offsets 1e4 plus a spread 1e4)
MAX_J = 130
EXP_HI = 60.0        # exp only of arguments bounded above by this
OVERFLOW = 1e30      # no intermediate may be bounded by more than this
U32 = 2.0 ** -24
TINY32 = torch.finfo(torch.float32).tiny
C_A = 16.0         # the oracle accepts C_A * u32 * (running error bound)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCHEDULES = ("single", "loop", "split")
BLOCK_J = 16
NSPLIT = 3
COMPILE_TIMEOUT = 120   # seconds; a longer af.compile is reported as crash:CompileTimeout


# ---- the numerics conventions of the kernels (the one documented place) ----------------------
# README "Numerics conventions": IEEE/torch everywhere, except
#  * polarity: inside a difference every operand has a sign, followed through ``+``, ``-``,
#    unary minus and products/quotients with a constant (anything else resets it);
#  * a max over j that is -inf, and any per-row value built only from reductions that is
#    -inf (the logsumexp or mean of a fully masked row), reads as 0 where it is subtracted
#    (sign "-"); a min over j that is +inf reads as 0 where it is added inside a
#    difference (sign "+")                                             -> _shift_conv
#  * a division whose denominator is computed from a reduction gives 0 for 0/0 -> _div_red
#  * where the program as written reaches NaN only through an infinite input, the fused
#    form may give any value (identities proved over the reals)       -> check_output
_FLIP = {"+": "-", "-": "+"}


def _kid_pols(n, pol):
    """Signs of the operands of ``n`` inside an enclosing difference (None outside one)."""
    op = n.op
    if op == "add":
        return [pol, pol]
    if op == "sub":
        p = pol or "+"
        return [p, _FLIP[p]]
    if op == "neg":
        return [_FLIP[pol or "+"]]
    if op in ("mul", "div") and pol is not None:
        a, b = n.kids
        if b.op == "const":
            return [pol if b.arg >= 0 else _FLIP[pol], None]
        if op == "mul" and a.op == "const":
            return [None, pol if a.arg >= 0 else _FLIP[pol]]
    return [None] * len(n.kids)


def _row_only(n) -> bool:
    """Built only from reductions over j and constants (a per-row value), with a max, a min
    or a log among them (the shift of a masked row; a mean or a sum that is -inf is read as
    it is)."""
    def walk(u):
        if u.op in ("sum", "max", "min"):
            return True, u.op != "sum"
        if u.op in ("const", "size"):
            return True, False
        if u.op in ("in", "index"):
            return False, False
        ok, found = True, u.op == "log"
        for k in u.kids:
            o, f = walk(k)
            ok, found = ok and o, found or f
        return ok, found
    ok, found = walk(n)
    return ok and found


def _has_extremum(n) -> bool:
    return n.op in ("max", "min") or (n.op not in ("sum",) and any(_has_extremum(k) for k in n.kids))


def _shift_conv(n, pol, v):
    """The empty-extremum convention applied to the value ``v`` of ``n`` read with sign ``pol``."""
    if pol == "-" and _row_only(n):
        return torch.where(v == -math.inf, torch.zeros_like(v), v)
    if pol == "+" and n.op == "min":
        return torch.where(v == math.inf, torch.zeros_like(v), v)
    return v


def _div_red(n, d):
    """A division by a value computed from a reduction: 0 / 0 -> 0."""
    return torch.where((n == 0) & (d == 0), torch.zeros_like(n / d), n / d)


# ---- the program pair: acefuse expression + node tree ----------------------------------------
class N:
    """One node of a generated program: its acefuse expression, the operation the
    reference evaluates, and what the generator knows about it (interval bounds over
    finite inputs, whether it may hold mask -inf, whether it reads a reduction)."""

    __slots__ = ("af", "op", "kids", "arg", "shape", "lo", "hi", "minf", "red", "text", "uid")
    _n = [0]

    def __init__(self, expr, op, kids=(), arg=None, shape="rj", lo=-math.inf, hi=math.inf,
                 minf=False, text=""):
        self.af, self.op, self.kids, self.arg, self.shape = expr, op, tuple(kids), arg, shape
        self.lo, self.hi, self.minf = float(lo), float(hi), minf
        self.red = op in ("sum", "max", "min") or any(k.red for k in self.kids)
        self.text = text
        N._n[0] += 1
        self.uid = N._n[0]

    @property
    def leaf(self):
        return self.op in ("in", "const", "index", "size")


class _NoNode(Exception):
    """A sub-generator found no admissible node; the caller tries another option."""


def _need(*kids):
    if any(k is None for k in kids):
        raise _NoNode()


def _shape(*kids):
    return "rj" if any(k.shape == "rj" for k in kids) else ("r" if any(k.shape == "r" for k in kids) else "c")


def _iv_mul(a, b):
    ps = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi) if not (math.isinf(x) and y == 0 or math.isinf(y) and x == 0)]
    return min(ps), max(ps)


def const(c):
    return N(af.const(c), "const", arg=float(c), shape="c", lo=c, hi=c, text=repr(float(c)))


def inp(name, shape):
    return N(af.tensor(name, "r j" if shape == "rj" else "j"), "in", arg=name, shape="rj",
             lo=-BOUND, hi=BOUND, text=name)


def index_j():
    return N(af.index("j"), "index", shape="rj", lo=0, hi=MAX_J - 1, text='af.index("j")')


def size_j():
    return N(af.size("j"), "size", shape="c", lo=1, hi=MAX_J, text='af.size("j")')


def add(a, b):
    _need(a, b)
    return N(a.af + b.af, "add", (a, b), shape=_shape(a, b), lo=a.lo + b.lo, hi=a.hi + b.hi)


def sub(a, b):
    _need(a, b)
    return N(a.af - b.af, "sub", (a, b), shape=_shape(a, b), lo=a.lo - b.hi, hi=a.hi - b.lo)


def mul(a, b):
    _need(a, b)
    lo, hi = _iv_mul(a, b)
    return N(a.af * b.af, "mul", (a, b), shape=_shape(a, b), lo=lo, hi=hi)


def div(a, b):
    _need(a, b)
    assert b.lo > 0, "generator bug: division by something that may be <= 0"
    q = [x / y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return N(a.af / b.af, "div", (a, b), shape=_shape(a, b), lo=min(q), hi=max(q))


def neg(a):
    _need(a)
    return N(-a.af, "neg", (a,), shape=a.shape, lo=-a.hi, hi=-a.lo)


def exp(a):
    _need(a)
    assert a.hi <= EXP_HI, "generator bug: exp of an unbounded argument"
    return N(af.exp(a.af), "exp", (a,), shape=a.shape, lo=math.exp(max(a.lo, -700)) if a.lo > -700 else 0.0,
             hi=math.exp(a.hi))


def log(a):
    _need(a)
    assert a.lo > 0 or a.op == "sum" and a.arg == "expshift", "generator bug: log of something <= 0"
    lo = math.log(a.lo) if a.lo > 0 else -math.inf
    return N(af.log(a.af), "log", (a,), shape=a.shape, lo=lo, hi=math.log(a.hi) if a.hi < math.inf else math.inf)


def sqrt(a):
    _need(a)
    assert a.lo >= 0, "generator bug: sqrt of something that may be negative"
    return N(af.sqrt(a.af), "sqrt", (a,), shape=a.shape, lo=math.sqrt(a.lo), hi=math.sqrt(a.hi))


def pow_(a, p):
    _need(a)
    vals = [a.lo ** p, a.hi ** p] + ([0.0] if a.lo < 0 < a.hi else [])
    return N(a.af ** p, "pow", (a,), arg=p, shape=a.shape, lo=min(vals), hi=max(vals))


def abs_(a):
    _need(a)
    lo = 0.0 if a.lo < 0 < a.hi else min(abs(a.lo), abs(a.hi))
    return N(af.abs(a.af), "abs", (a,), shape=a.shape, lo=lo, hi=max(abs(a.lo), abs(a.hi)))


def tanh(a):
    _need(a)
    return N(af.tanh(a.af), "tanh", (a,), shape=a.shape, lo=math.tanh(a.lo), hi=math.tanh(a.hi))


def maximum(a, b):
    _need(a, b)
    return N(af.maximum(a.af, b.af), "max2", (a, b), shape=_shape(a, b), lo=max(a.lo, b.lo), hi=max(a.hi, b.hi))


CMPS = {"<": "__lt__", "<=": "__le__", ">": "__gt__", ">=": "__ge__"}


def where(cmp, l, r, a, b):
    _need(l, r, a, b)
    cond = getattr(l.af, CMPS[cmp])(r.af)
    n = N(af.where(cond, a.af, b.af), "where", (l, r, a, b), arg=cmp, shape=_shape(l, r, a, b),
          lo=min(a.lo, b.lo), hi=max(a.hi, b.hi), minf=a.minf or b.minf)
    return n


def reduce(kind, a):
    _need(a)
    assert a.shape == "rj"
    f = {"sum": af.sum, "max": af.max, "min": af.min}[kind]
    if kind == "sum":
        lo = a.lo * (MAX_J if a.lo < 0 else 1)
        hi = a.hi * (MAX_J if a.hi > 0 else 1)
    else:
        lo, hi = a.lo, a.hi
    return N(f(a.af, "j"), kind, (a,), shape="r", lo=lo, hi=hi, minf=a.minf and kind != "sum")


def mean(a):
    _need(a)
    return div(reduce("sum", a), size_j())


# ---- the reference: torch on the node tree ---------------------------------------------------
class _Ctx:
    def __init__(self, inputs: dict, dtype, track: bool):
        self.dtype, self.track = dtype, track
        self.inputs = {k: v.to(dtype) for k, v in inputs.items()}
        x = next(iter(inputs.values()))
        self.J = x.shape[-1]
        self.memo: dict = {}
        # [R or 1, 1]: rows where a sum that is not finite is read by another expression
        self.loose = torch.zeros((1, 1), dtype=torch.bool)
        # [R or 1, 1]: rows where a where() selects an infinite constant (a -inf mask): the
        # program brings in an infinity itself, which counts like an infinite input
        self.inf_sel = torch.zeros((1, 1), dtype=torch.bool)
        # [R or 1, 1] (tracked runs only): rows where the program is at, or within float32's
        # error bound of, a point where it is not differentiable (a comparison, a maximum, an
        # abs or a max/min over j whose sides or candidates nearly tie): a kernel may take the
        # other branch there, so the gradient of such a row is not comparable (gradient mode)
        self.amb = torch.zeros((1, 1), dtype=torch.bool)
        # [R or 1, 1] (tracked runs, statistics): rows marked amb by a max/min near tie, and
        # rows whose max/min over a computed body has a runner-up float32 separates but within
        # the backward's fallback window (EXT_REL): compared (the exact path)
        self.tie = torch.zeros((1, 1), dtype=torch.bool)
        self.tie_kept = torch.zeros((1, 1), dtype=torch.bool)
        self.jiggle = None   # a torch.Generator: Monte Carlo arithmetic (see _Jiggle)

    def near(self, d, a):
        """[R or 1, 1]: rows where some entry of ``d`` (a difference whose exact value 0 is a
        kink) is nonzero but within ``a`` (its running error bound's share) of 0."""
        m = (d != 0) & (d.abs() <= C_A * U32 * a + 2 * TINY32)
        m = m.any(dim=1, keepdim=True) if m.dim() == 2 else m.reshape(1, 1)
        self.amb = self.amb | m


def _clean(a, v):
    a = torch.nan_to_num(a, nan=0.0, posinf=1e300, neginf=0.0)
    return torch.where(torch.isfinite(v), a, torch.zeros_like(a))


# operations that round in float32 (max, min, abs, negation and where are exact)
_ROUNDING = ("add", "sub", "mul", "div", "exp", "log", "sqrt", "pow", "tanh", "sum")


class _Jiggle(torch.autograd.Function):
    """Monte Carlo arithmetic (Parker 1997) for the gradient oracle's float32 yardstick: the
    identity, whose backward multiplies the adjoint by a random ``1 + d``, ``|d| <= u32`` (the
    forward value is perturbed likewise by ``_evaluate``): a float64 evaluation with every
    rounding of a float32 one emulated, forward and backward (per use of a value: the
    contributions to an operand's adjoint, ``x - max_j x`` at the argmax, round apart)."""

    @staticmethod
    def forward(ctx, v, gen):
        ctx.gen = gen
        return v.view_as(v)

    @staticmethod
    def backward(ctx, g):
        return g * (1 + U32 * (2 * torch.rand(g.shape, generator=ctx.gen, dtype=g.dtype) - 1)), None


def _evaluate(node: N, ctx: _Ctx, pol=None):
    """(value, running error bound or None) of ``node`` read with sign ``pol`` inside a
    difference (None outside one): 2-d tensors [R or 1, J or 1]."""
    key = (node.uid, pol)
    if key in ctx.memo:
        return ctx.memo[key]
    if pol is not None and (pol == "-" and _row_only(node) or pol == "+" and node.op == "min"):
        v, a = _evaluate(node, ctx, None)
        c = _shift_conv(node, pol, v)
        r = (c, (torch.where(c == v, a, torch.zeros_like(a)) if a is not None else None))
    else:
        r = _eval1(node, ctx, pol)
        if ctx.jiggle is not None and node.op in _ROUNDING:
            v = r[0]
            v = v * (1 + U32 * (2 * torch.rand(v.shape, generator=ctx.jiggle, dtype=v.dtype) - 1))
            r = (_Jiggle.apply(v, ctx.jiggle), r[1])
    ctx.memo[key] = r
    return r


def _eval1(n: N, ctx: _Ctx, pol=None):
    dt, tr = ctx.dtype, ctx.track
    op = n.op
    if op == "in":
        v = ctx.inputs[n.arg]
        v = v if v.dim() == 2 else v[None, :]
        return v, (v.abs() if tr else None)
    if op == "const":
        v = torch.full((1, 1), n.arg, dtype=dt)
        return v, (v.abs() if tr else None)
    if op == "index":
        v = torch.arange(ctx.J, dtype=dt)[None, :]
        return v, (torch.zeros_like(v) if tr else None)
    if op == "size":
        v = torch.full((1, 1), float(ctx.J), dtype=dt)
        return v, (torch.zeros_like(v) if tr else None)
    kv = [_evaluate(k, ctx, p) for k, p in zip(n.kids, _kid_pols(n, pol))]
    vals = [x for x, _ in kv]
    if ctx.jiggle is not None:   # each use's contribution to an operand's adjoint rounds on its own
        vals = [_Jiggle.apply(x, ctx.jiggle) for x in vals]
    mags = [a for _, a in kv]
    for k, x in zip(n.kids, vals):
        if k.op == "sum":   # an infinite (or NaN) sum read further: the row is loose
            ctx.loose = ctx.loose | ~torch.isfinite(x)
    if op in ("add", "sub") and n.shape == "rj":
        # an infinite per-row extremum added to (or subtracted from, not as a shift) values
        # over j: real-algebra rewrites move it across maxima and cancel it (max_j(a + s) =
        # max_j(a) + s, (a + s) - (c + s) = a - c), which the empty-extremum convention
        # does not survive for s = -inf: the row is loose
        for k, x in zip(n.kids, vals):
            if k.shape == "r" and _has_extremum(k):
                ctx.loose = ctx.loose | ~torch.isfinite(x)
    if op == "add":
        v = vals[0] + vals[1]
        a = (mags[0] + mags[1] + v.abs()) if tr else None
    elif op == "sub":
        v = vals[0] - vals[1]
        a = (mags[0] + mags[1] + v.abs()) if tr else None
    elif op == "mul":
        v = vals[0] * vals[1]
        a = (mags[0] * vals[1].abs() + mags[1] * vals[0].abs() + C_A * U32 * mags[0] * mags[1] + v.abs()) if tr else None
    elif op == "div":
        num, den = vals
        v = _div_red(num, den) if n.kids[1].red else num / den
        a = None
        if tr:   # (|n| + dn) / (|d| - dd) - |n| / |d|, the whole perturbation
            dn, dd = C_A * U32 * mags[0], C_A * U32 * mags[1]
            shrunk = den.abs() - dd
            a = torch.where(shrunk > 0, ((num.abs() + dn) / shrunk - num.abs() / den.abs()) / (C_A * U32),
                            torch.full_like(den, math.inf)) + v.abs()
    elif op == "neg":
        v = -vals[0]
        a = mags[0] if tr else None
    elif op == "exp":
        v = torch.exp(vals[0])
        # exp(u + d) - exp(u) for the whole error d = C_A u32 a(u) of the argument, not only
        # its first-order part (a comparison that may flip can move the argument far)
        a = (v * torch.expm1(torch.clamp(C_A * U32 * mags[0], max=700.0)) / (C_A * U32) + v) if tr else None
    elif op == "log":
        v = torch.log(vals[0])
        a = None
        if tr:
            du = C_A * U32 * mags[0]
            lo = vals[0].abs() - du
            a = torch.where(lo > 0, (torch.log(vals[0].abs()) - torch.log(lo.clamp_min(1e-300))) / (C_A * U32),
                            torch.full_like(v, math.inf)) + v.abs()
    elif op == "sqrt":
        v = torch.sqrt(vals[0])
        a = (torch.minimum(mags[0] / (2 * v), torch.sqrt(mags[0] / U32)) + v) if tr else None
    elif op == "pow":
        v = vals[0] ** n.arg
        u = vals[0].abs()
        a = (((u + C_A * U32 * mags[0]) ** n.arg - u ** n.arg) / (C_A * U32) + v.abs()) if tr else None
    elif op == "abs":
        v = vals[0].abs()
        a = mags[0] if tr else None
        if tr:
            ctx.near(torch.where(torch.isfinite(vals[0]), vals[0], torch.zeros_like(v)), mags[0])
    elif op == "tanh":
        v = torch.tanh(vals[0])
        a = ((1 - v * v) * mags[0] + v.abs()) if tr else None
    elif op == "max2":
        v = torch.maximum(vals[0], vals[1])
        a = torch.maximum(mags[0], mags[1]) if tr else None
        if tr:
            d = vals[0] - vals[1]
            ctx.near(torch.where(torch.isfinite(d), d, torch.zeros_like(d)), mags[0] + mags[1])
    elif op == "where":
        l, r, p, q = vals
        c = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge}[n.arg](l, r)
        v = torch.where(c, p, q)
        for kid, sel in ((n.kids[2], c), (n.kids[3], ~c)):
            if kid.op == "const" and math.isinf(kid.arg):
                ctx.inf_sel = ctx.inf_sel | (sel & torch.ones_like(v, dtype=torch.bool)).any(dim=1, keepdim=True)
        a = None
        if tr:
            a = torch.where(c, mags[2], mags[3])
            # a comparison within its error bound may go either way in float32
            # (sides below float32's smallest normal may have underflowed to 0: also a tie)
            # (not where both sides are exact in float32: an index mask's boundary, index(j) >= 17.0)
            amb = ((l - r).abs() <= C_A * U32 * (mags[0] + mags[1]) + 2 * TINY32) & torch.isfinite(l) & torch.isfinite(r)
            if _exact32(n.kids[0]) and _exact32(n.kids[1]):
                amb = torch.zeros_like(amb)
            a = torch.where(amb, torch.maximum(mags[2], mags[3]) + (p - q).abs() / U32, a)
            if _reads_input(n.kids[0]) or _reads_input(n.kids[1]):
                fin = torch.isfinite(l) & torch.isfinite(r)
                ctx.near(torch.where(fin, l - r, torch.zeros_like(l - r)), mags[0] + mags[1])
    elif op in ("sum", "max", "min"):
        x = vals[0]
        if op == "sum":
            v = x.sum(dim=1, keepdim=True)
            a = (mags[0].sum(dim=1, keepdim=True) + x.abs().sum(dim=1, keepdim=True)) if tr else None
        else:
            v = (x.amax if op == "max" else x.amin)(dim=1, keepdim=True)
            a = mags[0].amax(dim=1, keepdim=True) if tr else None
            if tr:
                # a runner-up float32 cannot separate from the extremum: its value and the
                # extremum's are each within C_A u32 times their own running error bounds
                # (``at``: the extremum element's, not the row's largest) of float64's
                # (a bound that grows by the magnitude of every rounding of the body: depth x
                # magnitude), so float32 may order them either way and the adjoint may go to
                # either: the row is not comparable. A runner-up further away is compared, near
                # or not: the backward sends the adjoint to the element whose recomputed body
                # equals the saved extremum bit for bit (acefuse.backward, "Max and min"), the
                # one float64 picks
                fin = torch.isfinite(v) & torch.isfinite(x)
                at = torch.where(x == v, mags[0], torch.zeros_like(mags[0])).amax(dim=1, keepdim=True)
                tol = C_A * U32 * (mags[0] + at) + 2 * TINY32
                close = ((x - v).abs() <= tol) & fin & (x != v)
                tie = close.any(dim=1, keepdim=True)
                ctx.amb = ctx.amb | tie
                ctx.tie = ctx.tie | tie
                if n.kids[0].op != "in":   # within the backward's fallback window, compared
                    kept = ((x - v).abs() <= EXT_REL * v.abs()) & fin & (x != v) & ~close
                    ctx.tie_kept = ctx.tie_kept | kept.any(dim=1, keepdim=True)
    else:  # pragma: no cover
        raise AssertionError(f"fuzz reference: unknown node {op}")
    if tr:
        a = _clean(a.expand_as(v) if a.shape != v.shape else a, v)
    return v, a


def reference(outputs: dict, inputs: dict, dtype=torch.float64, track=False, info=None, grad=False,
              jiggle=None):
    """{output: (value, error bound)} of the program pair's outputs on ``inputs``.
    ``info`` (a dict), if given, receives ``loose``: [R] bool, the rows where a sum over
    ``j`` that is +-inf or NaN is read by a further expression, or a max or min that is
    +-inf is added to values over ``j`` (see ``check_output``), and
    ``inf_sel``: the rows where a ``where`` selects an infinite constant (a -inf mask),
    which count like rows whose inputs hold an infinity, and (tracked runs) ``amb``: [R] bool,
    the rows near a point where the program is not differentiable (``_Ctx.amb``), ``tie``
    those of them with a max/min near tie and ``tie_kept`` the comparable rows with a
    separable runner-up within the backward's fallback window (``_Ctx.tie``, statistics).
    ``grad=True``: recorded by torch autograd (inputs that require grad give outputs with a
    ``grad_fn``: the gradient mode's reference, acefuse/fuzz_backward.py); ``jiggle`` (a
    torch.Generator): every rounding of float32 emulated at random (``_Jiggle``)."""
    with (torch.enable_grad() if grad else torch.no_grad()):
        ctx = _Ctx(inputs, dtype, track)
        ctx.jiggle = jiggle
        res = {}
        for k, nd in outputs.items():
            v, a = _evaluate(nd, ctx)
            R = max(t.shape[0] if t.dim() == 2 else 1 for t in ctx.inputs.values())
            shape = (R, ctx.J) if nd.shape == "rj" else (R, 1)
            v = v.expand(shape)
            a = a.expand(shape) if a is not None else None
            if nd.shape != "rj":
                v = v[:, 0]
                a = a[:, 0] if a is not None else None
            res[k] = (v, a)
        if info is not None:
            R = max(t.shape[0] if t.dim() == 2 else 1 for t in ctx.inputs.values())
            info["loose"] = ctx.loose[:, 0].expand(R).clone()
            info["inf_sel"] = ctx.inf_sel[:, 0].expand(R).clone()
            info["amb"] = ctx.amb[:, 0].expand(R).clone()
            info["tie"] = ctx.tie[:, 0].expand(R).clone()
            info["tie_kept"] = (ctx.tie_kept & ~ctx.amb)[:, 0].expand(R).clone()
        return res


def _exact32(n: N) -> bool:
    """The same value in float32 as in float64: an index or size (integers below 2^24), a
    constant float32 represents."""
    return n.op in ("index", "size") or (n.op == "const" and float(torch.tensor(n.arg, dtype=torch.float32)) == n.arg)


def _reads_input(n: N) -> bool:
    return n.op == "in" or any(_reads_input(k) for k in n.kids)


def _uses(n: N, name) -> bool:
    return (n.op == "in" and n.arg == name) or any(_uses(k, name) for k in n.kids)
