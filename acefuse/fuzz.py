"""The project's own fuzzer: random cascaded programs, adversarial inputs, an
independent float64 reference, every schedule.

    python -m acefuse.fuzz --minutes 5 --seed 1 --profile short
    res = acefuse.fuzz.run(n_programs=10, seed=1); res.failures

**Generator.** A seeded generator builds each random program as a *pair*: the acefuse
expression (``import acefuse as af``) and a node tree that this module evaluates
directly with torch (``_evaluate``). The reference never calls ``acefuse.reference``
nor anything of acefuse's fusion (no terms, rules, states, codegen): it is plain torch
on the node tree, built by the same generator call that built the acefuse expression.
Programs are cascaded over the fused axis ``j`` (rows ``r``): shifts by a max
(``exp(e - max_j e)``), normalisation by sums, centred moments (``(e - mean_j e)**2``,
``**3``, ``**4``), ``abs``, ``tanh``, ``sqrt``, ``log``, comparisons against reductions
(``where(e > mean_j e, e, 0)``), index masks (``where(index(j) < k, e, -inf)``), a
second input over ``"j"`` or ``"r j"``, one to three outputs (per row and elementwise).

What the generator avoids, so that every program's true value is well defined and
float32 can compute it *as written* (tracked with interval bounds over finite inputs of
magnitude <= ``BOUND``):
  * ``exp`` of an argument not bounded above by 60 (only shifted ``e - max_j e``,
    ``min_j e - e``, ``-abs``, ``tanh``, small multiples of the index ...);
  * ``log`` of an argument not bounded below by a positive number, ``sqrt`` of an
    argument that may be negative (variances are used as ``sqrt(var + 1e-5)``);
  * division by something that may be 0, except a sum of shifted exponentials, which is
    0 only on a fully masked row (then the numerator vanishes too: convention 0/0 -> 0);
  * any intermediate whose bound exceeds 1e30 (float32 overflow as written);
  * masked values (-inf from an index mask) anywhere but in a max reduction or a shift
    ``e - max_j e`` (so ``-inf - -inf`` is only reached through the convention).
Adversarial *inputs* (+-inf entries, fully masked rows) may still make an output NaN or
inf; the reference then follows IEEE (torch) and the conventions below.

**Numerics conventions** (README "Numerics conventions"; kept in one place, the block
after the constants: ``_kid_pols``, ``_row_only``, ``_shift_conv``, ``_div_red``):
IEEE/torch semantics everywhere, except
  * inside a difference every operand has a sign, followed through ``+``, ``-``, unary
    minus and products with a constant; a max over ``j`` that is -inf, and any per-row
    value built only from reductions that is -inf (logsumexp or mean of a fully masked
    row), reads as 0 where it is subtracted; a min over ``j`` that is +inf reads as 0
    where it is added inside a difference;
  * a division whose denominator is computed from a reduction gives 0 when numerator
    and denominator are both exactly 0;
  * where the program as written reaches NaN only through an infinite input (a row
    whose inputs hold an infinity), the fused form may give any value: rewrites are
    proved over the reals (``sum_j(x - mean_j x) = 0``, ``max_j(x + c) = max_j(x) + c``),
    so the oracle accepts NaN, +-inf or a number there; and on such a row, once the
    program as written reads a sum over ``j`` that is +-inf or NaN (an infinity summed
    in, then used further: ``max_j(x + s) = max_j(x) + s`` leaves ``s - s``), every
    output of the row may take any value. A finite true value on a row without
    infinities is never excused.
So softmax of a fully -inf row is 0, its logsumexp -inf; a row holding +inf gives NaN.

**Oracle** (``check_output``). The reference runs in float64 on the input *as rounded*
to the kernel's dtype, and again in float32 (same formula, unfused). Where the float64
value is NaN, only NaN is accepted; where it is +-inf, the same inf; where it is
finite, NaN/inf is always wrong (unless float32 itself cannot compute the program as
written there, i.e. the float32 reference overflows: those elements are skipped and
counted, or the value overflows the output dtype: then the same inf is accepted).
Otherwise ``|kernel - ref64| <= tol`` with

    tol = 4 |ref32 - ref64| + 16 u32 a + 2 u_out |ref64| + tiny_out

``u32`` is float32's unit roundoff (kernels accumulate in float32), ``u_out`` the
output dtype's (outputs are stored in the input dtype), ``tiny_out`` its smallest
normal number. ``a`` is a running error bound propagated through the program as
written (float64, alongside the value): the magnitude of every rounding that float32
evaluation of the program incurs, times the sensitivity of the output to it
(``a(x+y) = a(x) + a(y) + |x+y|``, ``a(xy) = a(x)|y| + a(y)|x| + 16 u32 a(x)a(y) + |xy|``,
a sum adds its terms' bounds and magnitudes; for exp, log, sqrt, powers and division the
whole perturbation, not only its first order). It covers the cancellation that the program as
written suffers anyway (a variance of rows offset by 1e4) and nothing more: a kernel
that rewrites into a form that cancels worse (``E[x^2] - E[x]^2``) is flagged. At a
comparison whose sides are within their error bounds of each other, either branch is
accepted (``a`` grows by the difference of the branches).

**Crashes** are failures: any exception from ``af.fuse``/``af.compile``/the kernel,
except an acefuse error that clearly refuses an unsupported program (counted as
``refused``); an error whose message says "this is a bug" is always a failure. The
launcher's ``has no split schedule`` is expected when the fusion has no merge.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

import acefuse as af

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


def _clean(a, v):
    a = torch.nan_to_num(a, nan=0.0, posinf=1e300, neginf=0.0)
    return torch.where(torch.isfinite(v), a, torch.zeros_like(a))


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
    mags = [a for _, a in kv]
    for k, x in zip(n.kids, vals):
        if k.op == "sum":   # an infinite (or NaN) sum read further: the row is loose
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
    elif op == "tanh":
        v = torch.tanh(vals[0])
        a = ((1 - v * v) * mags[0] + v.abs()) if tr else None
    elif op == "max2":
        v = torch.maximum(vals[0], vals[1])
        a = torch.maximum(mags[0], mags[1]) if tr else None
    elif op == "where":
        l, r, p, q = vals
        c = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge}[n.arg](l, r)
        v = torch.where(c, p, q)
        a = None
        if tr:
            a = torch.where(c, mags[2], mags[3])
            # a comparison within its error bound may go either way in float32
            # (sides below float32's smallest normal may have underflowed to 0: also a tie)
            amb = ((l - r).abs() <= C_A * U32 * (mags[0] + mags[1]) + 2 * TINY32) & torch.isfinite(l) & torch.isfinite(r)
            a = torch.where(amb, torch.maximum(mags[2], mags[3]) + (p - q).abs() / U32, a)
    elif op in ("sum", "max", "min"):
        x = vals[0]
        if op == "sum":
            v = x.sum(dim=1, keepdim=True)
            a = (mags[0].sum(dim=1, keepdim=True) + x.abs().sum(dim=1, keepdim=True)) if tr else None
        else:
            v = (x.amax if op == "max" else x.amin)(dim=1, keepdim=True)
            a = mags[0].amax(dim=1, keepdim=True) if tr else None
    else:  # pragma: no cover
        raise AssertionError(f"fuzz reference: unknown node {op}")
    if tr:
        a = _clean(a.expand_as(v) if a.shape != v.shape else a, v)
    return v, a


def reference(outputs: dict, inputs: dict, dtype=torch.float64, track=False, info=None):
    """{output: (value, error bound)} of the program pair's outputs on ``inputs``.
    ``info`` (a dict), if given, receives ``loose``: [R] bool, the rows where a sum over
    ``j`` that is +-inf or NaN is read by a further expression (see ``check_output``)."""
    with torch.no_grad():
        ctx = _Ctx(inputs, dtype, track)
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
        return res


# ---- the generator -------------------------------------------------------------------------------
class Gen:
    """Random cascaded programs over x ("r j") and optionally w ("j" or "r j")."""

    def __init__(self, rng: random.Random, w_axes=None):
        self.rng = rng
        self.x = inp("x", "rj")
        self.w = inp("w", w_axes) if w_axes else None
        self.w_axes = w_axes

    def pick(self, options):
        """options: [(weight, thunk)]; call thunks until one returns a node."""
        opts = [o for o in options if o[0] > 0]
        while opts:
            tot = sum(w for w, _ in opts)
            r = self.rng.random() * tot
            for i, (w, f) in enumerate(opts):
                r -= w
                if r <= 0:
                    break
            try:
                out = f()
            except _NoNode:
                out = None
            if out is not None and abs(out.lo) < OVERFLOW and abs(out.hi) < OVERFLOW:
                return out
            opts.pop(i)
        return None

    def leaf(self, minf=False):
        rng = self.rng
        x = self.x
        opts = [(4, lambda: x),
                (1, lambda: add(x, mul(const(rng.choice([0.01, -0.05, 0.5])), index_j()))),
                (1, lambda: mul(x, const(rng.choice([0.5, -2.0, 3.0]))))]
        if self.w is not None:
            opts += [(2, lambda: self.w), (1, lambda: mul(x, self.w)), (1, lambda: add(x, self.w))]
        if minf:
            opts += [(3, lambda: self.mask(self.leaf(False)))]
        return self.pick(opts)

    def mask(self, e):
        """where(index(j) < k, e, -inf) style masks (several tiles at start/middle/end)."""
        rng = self.rng
        k = rng.choice([0, 1, 5, 16, 17, 33, 40, 64, 100])
        i = index_j()
        ninf = const(-math.inf)
        ninf.lo = ninf.hi = -math.inf
        kind = rng.random()
        if kind < 0.4:
            m = where("<", i, const(float(k)), e, ninf)
        elif kind < 0.7:
            m = where(">=", i, const(float(k)), e, ninf)
        else:  # a masked band in the middle
            k2 = k + rng.choice([16, 20, 40])
            m = where("<", i, const(float(k)), e, where(">=", i, const(float(k2)), e, ninf))
        m.minf = True
        m.lo = e.lo
        return m

    def shifted(self, depth, minf=True):
        """e - max_j e (<= 0) or min_j e - e (<= 0)."""
        e = self.elem(depth - 1, minf=minf)
        if e is None:
            return None
        if self.rng.random() < 0.8 or e.minf:
            s = sub(e, reduce("max", e))
        else:
            s = sub(reduce("min", e), e)
        s.hi = 0.0
        s.lo = max(s.lo, -2 * BOUND * 10)
        s.minf = e.minf
        return s

    def expshift(self, depth, minf=True):
        s = self.shifted(depth, minf)
        if s is None:
            return None
        p = exp(s)
        p.lo, p.hi = 0.0, 1.0
        return p

    def sumexp(self, p):
        l = reduce("sum", p)
        l.arg = "expshift"
        l.lo = 1.0   # >= 1 unless the row is fully masked (then the numerators vanish too)
        return l

    def elem(self, depth, minf=False):
        """An expression elementwise over (r, j)."""
        rng = self.rng
        if depth <= 0:
            return self.leaf(minf)
        d = depth - 1
        opts = [
            (3, lambda: self.leaf(minf)),
            (1, lambda: abs_(self.elem(d))),
            (1, lambda: tanh(self.elem(d))),
            (0.5, lambda: neg(self.elem(d))),
            (1, lambda: mul(const(rng.choice([0.5, 2.0, -1.5])), self.elem(d))),
            (1, lambda: pow_(self.elem(d), rng.choice([2, 3]))),
            (1, lambda: add(self.elem(d), self.elem(d))),
            (1, lambda: mul(self.elem(d), tanh(self.elem(d)))),
            (0.5, lambda: maximum(self.elem(d), const(0.0))),
            (3, lambda: self.expshift(depth)),                                   # exp(e - max_j e)
            (3, lambda: self.normalized(depth)),                                 # softmax-like
            (2, lambda: self.centred(depth)),                                    # e - mean_j e
            (1, lambda: self.standardized(depth)),                               # layernorm-like
            (2, lambda: self.thresholded(depth)),                                # where(e > red_j e, e, 0)
            (1, lambda: mul(self.elem(d), self.row(d))),                         # broadcast per-row
            (1, lambda: add(self.elem(d), self.row(d))),
            (1, lambda: exp(neg(abs_(self.elem(d))))),
        ]
        if minf:
            opts.append((2, lambda: self.mask(self.elem(d))))
        return self.pick(opts)

    def normalized(self, depth):
        p = self.expshift(depth, minf=True)
        if p is None:
            return None
        l = self.sumexp(p)
        y = div(p, l)
        y.lo, y.hi = 0.0, 1.0
        return y

    def centred(self, depth):
        e = self.elem(depth - 1)
        return None if e is None else sub(e, mean(e))

    def variance(self, depth, c=None):
        c = c or self.centred(depth)
        return None if c is None else mean(pow_(c, 2))

    def standardized(self, depth):
        e = self.elem(depth - 1)
        if e is None:
            return None
        c = sub(e, mean(e))
        return div(c, sqrt(add(mean(pow_(c, 2)), const(1e-5))))

    def thresholded(self, depth):
        rng = self.rng
        e = self.elem(depth - 1)
        if e is None:
            return None
        r = rng.choice([lambda: mean(e), lambda: reduce("max", e), lambda: reduce("min", e),
                        lambda: mul(const(0.5), reduce("max", e))])()
        other = rng.choice([lambda: const(0.0), lambda: self.elem(depth - 2), lambda: e])()
        if other is None:
            return None
        cmp = rng.choice(list(CMPS))
        return where(cmp, e, r, e, other) if rng.random() < 0.7 else where(cmp, e, r, other, e)

    def row(self, depth):
        """An expression with one value per row (reductions over j, cascaded)."""
        rng = self.rng
        d = max(depth - 1, 0)
        deeper = 1 if depth > 0 else 0
        opts = [
            (2, lambda: reduce("sum", self.elem(d))),
            (2, lambda: mean(self.elem(d))),
            (1, lambda: reduce("max", self.elem(d, minf=True))),
            (1, lambda: reduce("min", self.elem(d))),
            (3, lambda: self.logsumexp(depth)),
            (2, lambda: self.variance(depth)),
            (1, lambda: sqrt(add(self.variance(depth), const(1e-5)))),
            (1, lambda: self.moment(depth, rng.choice([3, 4]))),
            (2, lambda: self.weighted(depth)),
            (2, lambda: reduce(rng.choice(["sum", "max", "min"]), self.elem(depth))),   # cascaded body
            (deeper, lambda: log(add(abs_(self.row(d)), const(1.0)))),
            (deeper, lambda: add(self.row(d), self.row(d))),
            (1, lambda: reduce("sum", self.thresholded(depth))),
        ]
        return self.pick([(w, f) for w, f in opts])

    def logsumexp(self, depth):
        e = self.elem(depth - 1, minf=True)
        if e is None:
            return None
        m = reduce("max", e)
        s = sub(e, m)
        s.hi, s.minf = 0.0, e.minf
        p = exp(s)
        p.lo, p.hi = 0.0, 1.0
        return add(m, log(self.sumexp(p)))

    def moment(self, depth, k):
        c = self.centred(depth)
        if c is None:
            return None
        mk = mean(pow_(c, k))
        if k == 4 and self.rng.random() < 0.5:   # kurtosis-like: m4 / (var + eps)^2
            v = add(mean(pow_(c, 2)), const(1e-5))
            return div(mk, mul(v, v))
        return mk

    def weighted(self, depth):
        """sum_j exp(s) v / sum_j exp(s): a normalised weighted sum (attention-like)."""
        p = self.expshift(depth, minf=True)
        v = self.elem(depth - 1)
        if p is None or v is None:
            return None
        num = reduce("sum", mul(p, v))
        return div(num, self.sumexp(p))

    def program(self, depth=3, n_out=None):
        rng = self.rng
        n_out = n_out or rng.choice([1, 1, 2, 2, 3])
        outs = {}
        tries = 0
        while len(outs) < n_out and tries < 20:
            tries += 1
            nd = self.row(depth) if rng.random() < 0.5 else self.elem(depth)
            if nd is None or not nd.red or not _uses(nd, "x"):
                continue
            if nd.minf and nd.shape == "rj":
                continue   # a masked elementwise output is -inf by design; not interesting
            outs[f"o{len(outs)}"] = nd
        return outs


# ---- program text (reproducers) ---------------------------------------------------------------
_FMT = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
        "neg": "-{0}", "exp": "af.exp({0})", "log": "af.log({0})", "sqrt": "af.sqrt({0})",
        "abs": "af.abs({0})", "tanh": "af.tanh({0})", "max2": "af.maximum({0}, {1})",
        "sum": 'af.sum({0}, "j")', "max": 'af.max({0}, "j")', "min": 'af.min({0}, "j")'}


def program_text(outputs: dict, w_axes=None, name="fz") -> str:
    """Python source that rebuilds the program (shared subexpressions named t1, t2, ...)."""
    uses: dict = {}
    order: list = []

    def visit(n):
        uses[n.uid] = uses.get(n.uid, 0) + 1
        if uses[n.uid] > 1:
            return
        for k in n.kids:
            visit(k)
        order.append(n)

    for n in outputs.values():
        visit(n)
    names: dict = {}
    lines = ["import acefuse as af", "import math", 'x = af.tensor("x", "r j")']
    if w_axes:
        lines.append(f'w = af.tensor("w", "{"r j" if w_axes == "rj" else "j"}")')

    def expr(n, top=False):
        if n.uid in names and not top:
            return names[n.uid]
        if n.op == "in":
            return n.arg
        if n.op == "const":
            return "af.NEG_INF" if n.arg == -math.inf else ("math.inf" if n.arg == math.inf else repr(n.arg))
        if n.op in ("index", "size"):
            return n.text
        ks = [expr(k) for k in n.kids]
        if n.op == "pow":
            return f"({ks[0]}) ** {n.arg}" if _needs_parens(n.kids[0], names) or n.kids[0].op == "const" else f"{ks[0]} ** {n.arg}"
        if n.op == "where":
            return f"af.where({ks[0]} {n.arg} {ks[1]}, {ks[2]}, {ks[3]})"
        if n.op in ("add", "sub", "mul", "div", "neg"):
            ks = [f"({s})" if _needs_parens(k, names) else s for k, s in zip(n.kids, ks)]
        return _FMT[n.op].format(*ks)

    for n in order:
        if uses[n.uid] > 1 and not n.leaf:
            names[n.uid] = f"t{len(names) + 1}"
            lines.append(f"{names[n.uid]} = {expr(n, top=True)}")
    outs = ", ".join(f"{k}={expr(v)}" for k, v in outputs.items())
    lines.append(f'prog = af.program("{name}", {outs})')
    return "\n".join(lines)


def _needs_parens(k: N, names: dict) -> bool:
    if k.uid in names:
        return False
    return k.op in ("add", "sub", "mul", "div", "neg", "pow") or (k.op == "const" and k.arg < 0)


# ---- adversarial inputs ----------------------------------------------------------------------
KINDS = ("normal", "near_m100", "near_m1e4", "offset_1e4", "spread_1e4", "masked_tiles",
         "infs", "subnormal", "zeros")


def make_inputs(kind: str, R: int, J: int, dtype: str, seed: int, w_axes=None) -> dict:
    """The inputs of one case, reproducible from (kind, R, J, dtype, seed, w_axes)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def base(shape):
        z = torch.randn(shape, generator=g, dtype=torch.float64)
        if kind == "near_m100":
            return -100.0 + z
        if kind == "near_m1e4":
            return -1e4 + 3 * z
        if kind == "offset_1e4":
            return 1e4 + z
        if kind == "spread_1e4":
            return 1e4 / 3 * z
        if kind == "subnormal":
            tiny = 1e-6 if dtype == "float16" else 1e-40
            return torch.where(torch.rand(shape, generator=g) < 0.5, z * tiny, z)
        if kind == "zeros":
            return torch.where(torch.rand(shape, generator=g) < 0.5, torch.zeros_like(z), z)
        return z * rng.choice([1.0, 3.0])

    x = base((R, J))
    if kind == "masked_tiles":
        for r in range(R):
            what = rng.choice(["start", "middle", "end", "all", "start_end", "none"])
            runs = []
            if what in ("start", "start_end"):
                runs.append((0, rng.randint(16, max(16, J))))
            if what in ("end", "start_end"):
                runs.append((max(0, J - rng.randint(16, 48)), J))
            if what == "middle":
                a = rng.randint(0, max(0, J - 16))
                runs.append((a, a + rng.randint(16, 40)))
            if what == "all":
                runs.append((0, J))
            for a, b in runs:
                x[r, a:b] = -math.inf
    if kind == "infs":
        n = max(1, (R * J) // 40)
        for _ in range(n):
            x[rng.randrange(R), rng.randrange(J)] = rng.choice([math.inf, -math.inf, -math.inf])
    if kind == "zeros" and R > 1:
        x[rng.randrange(R)] = 0.0
    out = {"x": x.to(DTYPES[dtype])}
    if w_axes:
        wk = torch.randn((R, J) if w_axes == "rj" else (J,), generator=g, dtype=torch.float64)
        if kind == "zeros":
            wk = torch.where(torch.rand(wk.shape, generator=g) < 0.5, torch.zeros_like(wk), wk)
        out["w"] = wk.to(DTYPES[dtype])
    return out


# ---- oracle --------------------------------------------------------------------------------------
@dataclass
class Verdict:
    ok: bool
    cls: str = ""
    detail: str = ""
    skipped: int = 0
    worst: float = 0.0


def check_output(got, ref64, ref32, bound, dtype, inf_input=None, loose=None) -> Verdict:
    """Compare a kernel output with the reference (see the module docstring for the rules).
    ``inf_input``: where (broadcast to the output) the inputs hold an infinity; there a
    NaN of the reference may come out as any value (documented convention). ``loose``
    (broadcast likewise): where the inputs hold an infinity and the program as written
    reads a sum that is +-inf or NaN; there any value is accepted (documented convention:
    real-algebra rewrites move such a sum across shifts and maxima)."""
    got = got.detach().to(torch.float64).cpu()
    if got.shape != ref64.shape:
        return Verdict(False, "wrong-shape", f"shape {tuple(got.shape)}, expected {tuple(ref64.shape)}")
    fi = torch.finfo(dtype)
    u_out = fi.eps / 2
    nan_ref, inf_ref, fin_ref = torch.isnan(ref64), torch.isinf(ref64), torch.isfinite(ref64)
    bad = torch.zeros_like(ref64, dtype=torch.bool)
    cls = ""

    def first(mask, name):
        nonlocal cls
        if mask.any() and not cls:
            cls = name
        return mask

    nan_ok = torch.isnan(got)
    if inf_input is not None:
        nan_ok = nan_ok | torch.as_tensor(inf_input).expand_as(ref64)
    free = torch.zeros_like(ref64, dtype=torch.bool)
    if loose is not None:
        free = torch.as_tensor(loose).expand_as(ref64)
        if inf_input is not None:
            free = free & torch.as_tensor(inf_input).expand_as(ref64)
    nan_ok = nan_ok | free
    bad |= first(nan_ref & ~nan_ok, "not-nan-where-nan")
    bad |= first(inf_ref & (got != ref64) & ~free, "wrong-inf")
    r32_ok = torch.isfinite(ref32)
    overflow_out = fin_ref & (ref64.abs() > fi.max)
    skip = fin_ref & ~r32_ok
    live = fin_ref & r32_ok & ~free
    ovf_ok = overflow_out & torch.isinf(got) & (torch.sign(got) == torch.sign(ref64))
    bad |= first(live & ~torch.isfinite(got) & ~ovf_ok, "nonfinite-where-finite")
    d32 = torch.where(r32_ok, (ref32.to(torch.float64) - ref64).abs(), torch.zeros_like(ref64))
    tol = 4 * d32 + C_A * U32 * bound + 2 * u_out * ref64.abs() + fi.tiny
    err = torch.where(live & torch.isfinite(got), (got - ref64).abs(), torch.zeros_like(ref64))
    bad |= first(live & torch.isfinite(got) & ~ovf_ok & (err > tol), "wrong-value")
    ratio = float((err / tol).max()) if err.numel() else 0.0
    if not bad.any():
        return Verdict(True, skipped=int(skip.sum()), worst=ratio)
    idx = tuple(int(i) for i in bad.nonzero()[0])
    detail = (f"at {idx}: kernel {float(got[idx])!r}, float64 reference {float(ref64[idx])!r}, "
              f"float32 reference {float(ref32[idx])!r}, tolerance {float(tol[idx]):.3g}; "
              f"{int(bad.sum())} of {bad.numel()} elements wrong")
    return Verdict(False, cls, detail, int(skip.sum()), ratio)


# ---- running ------------------------------------------------------------------------------------
@dataclass
class Failure:
    cls: str                 # crash:<Type> | wrong-value | nonfinite-where-finite | not-nan-where-nan | wrong-inf
    stage: str               # fuse | compile | run
    program: str             # Python source that rebuilds the program
    inputs: str              # make_inputs(...) call
    schedule: str = ""
    output: str = ""
    detail: str = ""
    fusible: object = None

    def reproducer(self) -> str:
        call = (f"k = af.compile(prog)\nout = k(**inputs, schedule={self.schedule!r}, block_j={BLOCK_J}, "
                f"nsplit={NSPLIT})" if self.schedule else "k = af.compile(prog)")
        return (f"# {self.cls} ({self.stage}){' output ' + self.output if self.output else ''}: {self.detail}\n"
                f"{self.program}\nfrom acefuse.fuzz import make_inputs\ninputs = {self.inputs}\n{call}")


@dataclass
class Result:
    programs: int = 0
    kernel_runs: int = 0
    wrong: int = 0
    crashes: int = 0
    refused: int = 0
    skipped_elements: int = 0
    unfusible: int = 0
    by_class: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        L = [f"programs {self.programs} (not fusible: {self.unfusible}), kernel runs {self.kernel_runs}, "
             f"wrong results {self.wrong}, crashes {self.crashes}, refused {self.refused}, "
             f"elements skipped (float32 overflows as written) {self.skipped_elements}"]
        for k, v in sorted(self.by_class.items()):
            L.append(f"  {k}: {v}")
        return "\n".join(L)


PROFILES = {"short": dict(depth=2, n_inputs=3, dtypes=(("float32", 0.7), ("float16", 0.15), ("bfloat16", 0.15))),
            "long": dict(depth=3, n_inputs=6, dtypes=(("float32", 0.6), ("float16", 0.2), ("bfloat16", 0.2)))}

_BUG = ("this is a bug", "an acefuse bug", "report it")


def _is_refusal(exc) -> bool:
    from acefuse.codegen.emit import CodegenError
    msg = str(exc)
    if any(b in msg for b in _BUG):
        return False
    return isinstance(exc, (af.LanguageError, af.FuseError, CodegenError)) or type(exc).__name__ == "UnsupportedOpError"


def _crash_class(exc) -> str:
    return f"crash:{type(exc).__name__}"


def _choose(rng, weighted):
    r = rng.random()
    for v, w in weighted:
        r -= w
        if r <= 0:
            return v
    return weighted[-1][0]


def _as_dict(out, names):
    return out if isinstance(out, dict) else {names[0]: out}


def run_program(outputs: dict, w_axes, cases: list, res: Result, log=print, name="fz", minimize=True,
                compile_fn=None, compile_timeout=COMPILE_TIMEOUT):
    """Compile one program pair and check it on every (inputs, schedule). ``cases`` is a
    list of make_inputs keyword dicts. ``compile_fn`` replaces ``af.compile`` (the tests pass
    deliberately wrong kernels through it to show the oracle fails them)."""
    text = program_text(outputs, w_axes, name)
    prog = af.program(name, **{k: v.af for k, v in outputs.items()})
    res.programs += 1

    def fail(f: Failure):
        res.failures.append(f)
        res.by_class[f.cls] = res.by_class.get(f.cls, 0) + 1
        if f.cls.startswith("crash"):
            res.crashes += 1
        else:
            res.wrong += 1
        log(f"  FAIL {f.cls} [{f.stage}{' ' + f.schedule if f.schedule else ''}"
            f"{' ' + f.output if f.output else ''}] {f.detail[:300]}")

    try:
        with warnings.catch_warnings(), _time_limit(compile_timeout):
            warnings.simplefilter("ignore")
            k = (compile_fn or af.compile)(prog)
    except Exception as exc:  # noqa: BLE001 - every exception is classified
        if _is_refusal(exc):
            res.refused += 1
            res.by_class["refused"] = res.by_class.get("refused", 0) + 1
            log(f"  refused: {str(exc)[:200]}")
            return
        fail(Failure(_crash_class(exc), "compile", text, f"make_inputs(**{cases[0]!r})" if cases else "",
                     detail=_short_tb(exc)))
        return
    if not getattr(k, "fusible", True):
        res.unfusible += 1
    names = list(outputs)
    for case in cases:
        inputs = make_inputs(**case)
        dt = DTYPES[case["dtype"]]
        exact = {n: t.to(torch.float64) for n, t in inputs.items()}
        info = {}
        r64 = reference(outputs, exact, torch.float64, track=True, info=info)
        r32 = reference(outputs, exact, torch.float32)
        inf_rows, loose = _inf_rows(exact), info["loose"]
        for sched in SCHEDULES:
            try:
                out = k(**_on_device(inputs), schedule=sched, block_j=BLOCK_J, nsplit=NSPLIT)
            except ValueError as exc:
                if sched == "split" and "has no split schedule" in str(exc):
                    continue
                fail(Failure(_crash_class(exc), "run", text, f"make_inputs(**{case!r})", sched,
                             detail=_short_tb(exc)))
                continue
            except Exception as exc:  # noqa: BLE001
                fail(Failure(_crash_class(exc), "run", text, f"make_inputs(**{case!r})", sched,
                             detail=_short_tb(exc)))
                continue
            res.kernel_runs += 1
            out = _as_dict(out, names)
            for o in names:
                v64, bound = r64[o]
                rows = (lambda m: m if outputs[o].shape != "rj" else m[:, None])
                v = check_output(out[o], v64, r32[o][0], bound, dt, rows(inf_rows), rows(loose))
                res.skipped_elements += v.skipped
                if not v.ok:
                    f = Failure(v.cls, "run", text, f"make_inputs(**{case!r})", sched, o, v.detail,
                                getattr(k, "fusible", None))
                    if minimize and compile_fn is None:
                        f = _minimize(f, outputs, w_axes, case, sched, o, name)
                    fail(f)


class CompileTimeout(Exception):
    """af.compile of one generated program ran longer than the fuzzer's limit."""


@contextlib.contextmanager
def _time_limit(seconds):
    """Raise CompileTimeout after ``seconds`` (SIGALRM; only in the main thread, else no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise CompileTimeout(f"af.compile took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _inf_rows(inputs: dict):
    """[R] bool: the row's inputs (an input over "j" counts for every row) hold an infinity."""
    R = max(t.shape[0] for t in inputs.values() if t.dim() == 2)
    m = torch.zeros(R, dtype=torch.bool)
    for t in inputs.values():
        m = m | (torch.isinf(t).any(dim=1) if t.dim() == 2 else torch.isinf(t).any().expand(R))
    return m


def _short_tb(exc) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}{where}"


def _minimize(f: Failure, outputs, w_axes, case, sched, o, name) -> Failure:
    """Shrink a wrong result: keep only the failing output, then only the failing row(s)."""
    try:
        one = {o: outputs[o]}
        cur = dict(case)
        prog = af.program(name + "_min", **{o: outputs[o].af})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            k = af.compile(prog)

        def still(c):
            inputs = make_inputs(**c)
            exact = {n: t.to(torch.float64) for n, t in inputs.items()}
            info = {}
            v64, bound = reference(one, exact, torch.float64, track=True, info=info)[o]
            v32 = reference(one, exact, torch.float32)[o][0]
            got = k(**_on_device(inputs), schedule=sched, block_j=BLOCK_J, nsplit=NSPLIT)
            rows = (lambda m: m if one[o].shape != "rj" else m[:, None])
            return check_output(got, v64, v32, bound, DTYPES[c["dtype"]], rows(_inf_rows(exact)),
                                rows(info["loose"]))

        v = still(cur)
        if v.ok:
            return f   # only fails together with the other outputs: keep the full program
        f = Failure(v.cls, f.stage, program_text(one, w_axes, name + "_min"), f"make_inputs(**{cur!r})",
                    sched, o, v.detail, getattr(k, "fusible", None))
        if cur["R"] > 1:
            c1 = dict(cur, R=1)
            v1 = still(c1)
            if not v1.ok:
                f.inputs, f.detail, f.cls = f"make_inputs(**{c1!r})", v1.detail, v1.cls
        return f
    except Exception:  # noqa: BLE001 - minimisation is best effort
        return f


DEVICE = "cpu"   # where kernels run (inputs are made, and references computed, on the CPU)


def _on_device(inputs: dict) -> dict:
    return inputs if DEVICE == "cpu" else {n: t.to(DEVICE) for n, t in inputs.items()}


def run(n_programs: int | None = None, seed: int = 0, profile: str = "short", minutes: float | None = None,
        log=None, depth=None, device: str = "cpu") -> Result:
    """Fuzz ``n_programs`` random programs (or for ``minutes``); returns a Result. ``device="cuda"``
    runs the kernels compiled on a GPU (references stay on the CPU)."""
    global DEVICE
    DEVICE = device
    log = log or (lambda *a: None)
    prof = PROFILES[profile]
    depth = depth or prof["depth"]
    rng = random.Random(seed)
    res = Result()
    t0 = time.time()
    i = 0
    while True:
        if n_programs is not None and i >= n_programs:
            break
        if minutes is not None and time.time() - t0 > minutes * 60:
            break
        if n_programs is None and minutes is None:
            break
        pseed = rng.randrange(2 ** 31)
        prng = random.Random(pseed)
        w_axes = prng.choice([None, None, "j", "rj"])
        gen = Gen(prng, w_axes)
        outputs = gen.program(depth=prng.choice(range(1, depth + 1)))
        if not outputs:
            continue
        used_w = w_axes if any(_uses(n, "w") for n in outputs.values()) else None
        cases = []
        for c in range(prof["n_inputs"]):
            kind = KINDS[(i + c) % len(KINDS)] if c < 2 else prng.choice(KINDS)
            cases.append(dict(kind=kind, R=prng.randint(1, 5), J=prng.choice([1, 7, 16, 17, 33, 50, 64, 100, 130]),
                              dtype=_choose(prng, prof["dtypes"]), seed=prng.randrange(2 ** 31), w_axes=used_w))
        log(f"[{i}] seed {pseed} ({time.time() - t0:.0f}s): {', '.join(f'{k}: {v.shape}' for k, v in outputs.items())}")
        run_program(outputs, used_w, cases, res, log=log, name=f"fz{i}")
        i += 1
    return res


def programs(depth: int = 2):
    """A Hypothesis strategy of program pairs ``(outputs, w_axes)`` (drawn through a seed,
    so shrinking moves between programs rather than inside one)."""
    from hypothesis import strategies as st

    def build(seed, w_axes):
        outs = Gen(random.Random(seed), w_axes).program(depth=depth)
        used = w_axes if any(_uses(n, "w") for n in outs.values()) else None
        return outs, used
    return st.builds(build, st.integers(0, 2 ** 31 - 1), st.sampled_from([None, "j", "rj"])).filter(
        lambda p: bool(p[0]))


def _uses(n: N, name) -> bool:
    return (n.op == "in" and n.arg == name) or any(_uses(k, name) for k in n.kids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m acefuse.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="short")
    ap.add_argument("--programs", type=int, default=None, help="stop after this many programs")
    ap.add_argument("--findings", default=None, help="append each distinct failure's reproducer to this file")
    ap.add_argument("--device", default="cpu", help="run the kernels here (cpu: Triton's interpreter; cuda)")
    args = ap.parse_args(argv)
    t0 = time.time()
    res = run(n_programs=args.programs, seed=args.seed, profile=args.profile, minutes=args.minutes,
              log=lambda s: print(s, flush=True), device=args.device)
    print(f"\n== acefuse fuzz: seed {args.seed}, profile {args.profile}, {time.time() - t0:.0f}s ==")
    print(res.summary())
    seen = set()
    for f in res.failures:
        key = (f.cls, f.schedule, f.program)
        if key in seen:
            continue
        seen.add(key)
        print("\n" + f.reproducer())
        if args.findings:
            with open(args.findings, "a") as fh:
                fh.write(f"\n```python\n# fuzz seed {args.seed}, profile {args.profile}\n{f.reproducer()}\n```\n")
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
