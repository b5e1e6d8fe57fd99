"""Float safety as a checked property: derive a rule's ``float_unsafe`` tag.

``derive(rule) -> FloatVerdict`` evaluates the rule in IEEE float32 (numpy,
vectorised over a few hundred points) on adversarial values -- huge and tiny
magnitudes (1e20, 1e30, 1e-30), arguments near exp's overflow (88.7) and
underflow (-103.9), +-inf (fully masked rows), 0, and pairs of values that
nearly cancel -- and compares with a float64 evaluation of the same inputs:

* a **rewrite** ``lhs => rhs`` is unsafe of kind ``"range"`` when, at some point
  where its side conditions hold, one side is finite and the other is inf or
  NaN (or they are infinities of different signs, or one is NaN): e.g.
  ``exp(a + b) => exp(a) * exp(b)`` at ``a = 100, b = -50`` (which non-finite
  value a side gives, inf or NaN, is not compared); it is unsafe of
  kind ``"rounding"`` when both are finite but one side is accurate (within
  ``GOOD_BITS`` bits of the float64 value) and the other has lost more than
  ``BAD_BITS`` bits (cancellation, re-association);
* an **analysis** rule is unsafe (kind ``"range"``) when a concluded fact is false
  in float32 while its premises hold: ``NonZero(exp(a))`` at ``a = -104``
  (``exp(-104) == 0`` in float32), ``NonZero(a * b)`` at ``a = b = 1e-30``.
  ``Inv`` facts are structural and always safe.

The points are pseudo-random with a seed taken from the rule's name, so a
verdict is reproducible. Finding no bad point is evidence, not proof: the
verdict ``safe`` means "no float32 counterexample among the adversarial points".
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from acefuse.rewrite.terms import Term, REDUCTIONS, substitute
from acefuse.rules.base import Rule, SELF
from acefuse.proofs.semantics import is_leaf, _OPS, NumpyOps

N_POINTS = 4096
GOOD_BITS = 4.0      # a side within 4 bits (16 ulps) of float64 is accurate
BAD_BITS = 16.0      # a side more than 16 bits off has lost half its precision
BLOCK_SIZE = 3       # elements per block variable

_POOL = np.array([0.5, -1.5, 2.0, 3.0, -0.75, 1.0, 0.0, 1e-30, -1e-30, 1e30, -1e30, 1e20, -1e20,
                  88.0, 89.0, -104.0, 100.0, -100.0, 50.0, -50.0, 1e8, -1e8, 1e-8,
                  np.inf, -np.inf], dtype=np.float32)


@dataclass
class FloatVerdict:
    unsafe: str = ""        # why (with the point), "" when no bad point was found
    kind: str = ""          # "range" or "rounding" ("" when safe)


class _Vec(NumpyOps):
    """numpy backend of one dtype (float32 or float64), vectorised over points."""

    def __init__(self, dtype):
        self.dt = dtype

    def const(self, v): return self.dt(v)
    def rsqrt(self, a): return self.dt(1) / np.sqrt(a)

    def max(self, vals):
        out = vals[0]
        for v in vals[1:]:
            out = np.maximum(out, v)
        return out

    def min(self, vals):
        out = vals[0]
        for v in vals[1:]:
            out = np.minimum(out, v)
        return out

    def sum(self, vals):
        out = vals[0]
        for v in vals[1:]:
            out = out + v
        return out

    def where(self, c, a, b): return np.where(c != 0, a, b).astype(self.dt)

    def cmp(self, op, a, b):
        if op == "LNot":
            return (a == 0).astype(self.dt)
        f = {"CmpLt": np.less, "CmpLe": np.less_equal, "CmpGt": np.greater, "CmpGe": np.greater_equal,
             "CmpEq": np.equal, "CmpNe": np.not_equal}.get(op)
        if f is not None:
            return f(a, b).astype(self.dt)
        return (((a != 0) & (b != 0)) if op == "LAnd" else ((a != 0) | (b != 0))).astype(self.dt)


class _Sampler:
    """Values of the leaves (one array per leaf symbol), sampled on first use."""

    def __init__(self, seed: int, inv: set):
        self.rng = np.random.default_rng(seed)
        self.inv = inv
        self.vals: dict[str, np.ndarray] = {}

    def get(self, name: str) -> np.ndarray:
        v = self.vals.get(name)
        if v is None:
            v = self._sample()
            self.vals[name] = v
        return v

    def _sample(self):
        r = self.rng
        pick = r.integers(0, 4, N_POINTS)
        pool = r.choice(_POOL, N_POINTS)
        normal = (r.standard_normal(N_POINTS) * 10.0 ** r.uniform(-3, 3, N_POINTS)).astype(np.float32)
        small = r.integers(-3, 4, N_POINTS).astype(np.float32)
        out = np.where(pick == 0, normal, np.where(pick == 3, small, pool))
        if self.vals:  # near cancellation with an earlier leaf (a different one per point): -v (1 + tiny)
            earlier = np.stack([self.vals[k] for k in sorted(self.vals)])
            partner = earlier[r.integers(0, len(earlier), N_POINTS), np.arange(N_POINTS)]
            rel = (2.0 ** -r.integers(8, 24, N_POINTS)).astype(np.float32)
            sign = np.where(r.random(N_POINTS) < 0.5, np.float32(-1), np.float32(1))
            with np.errstate(all="ignore"):
                near = (sign * partner * (np.float32(1) + rel)).astype(np.float32)
            which = r.random(N_POINTS) < 0.35
            out = np.where(which & np.isfinite(near), near, out)
        return out.astype(np.float32)


class _Env:
    def __init__(self, blocks, sampler, inv, dtype):
        self.blocks, self.sampler, self.inv, self.dt = blocks, sampler, inv, dtype

    def block(self, b: Term):
        if b.op == "?":
            return self.blocks[b.args[0]]
        if b.op in ("BA", "BB", "BJ"):
            return self.blocks[b.op[1]]
        if b.op == "BU":
            return self.block(b.args[0]) + self.block(b.args[1])
        raise ValueError(f"not a block: {b!r}")

    def leaf(self, t: Term, elem: int):
        op = t.op
        if op == "?":
            name = t.args[0] if t.args[0] in self.inv else f"{t.args[0]}[{elem}]"
        elif op == "Num":
            name = t.args[0].args[0]
        elif op == "Elm":
            name = f"Elm({t.args[0]})[{elem}]"
        elif op == "Par":
            name = f"Par({t.args[0]})"
        elif op == "St":
            name = f"St({t.args[0]},{self.block(t.args[1])})"
        else:
            raise ValueError(f"unexpected leaf {t!r}")
        return self.sampler.get(name).astype(self.dt)

    def ev(self, t: Term, elem: int = 0, be=None):
        be = be or _Vec(self.dt)
        op = t.op
        if is_leaf(t):
            return self.leaf(t, elem)
        if op == "Num":
            return be.const(t.args[0])
        if op == "Cnt":
            return self.dt(len(self.block(t.args[0])))
        if op in REDUCTIONS:
            vals = [self.ev(t.args[1], i, be) for i in self.block(t.args[0])]
            return {"Sum": be.sum, "RMax": be.max, "RMin": be.min}[op](vals)
        fn = _OPS.get(op)
        if fn is None:
            raise ValueError(f"no float semantics for {op!r}")
        return fn(be, *[self.ev(a, elem, be) for a in t.args])


def _bits(v32, x64):
    """Bits of error of float32 values against float64 references (ordinal distance)."""
    ref = x64.astype(np.float32)

    def ordinal(a):
        i = a.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    d = np.abs(ordinal(np.ascontiguousarray(v32, dtype=np.float32)) - ordinal(ref))
    return np.log2(1.0 + d.astype(np.float64))


def _cat(v):
    """0 for a finite value, 1 for inf or NaN (which non-finite value a side produces is not compared)."""
    return np.where(np.isfinite(v), 0, 1)


def derive(rule: Rule) -> FloatVerdict:
    """The derived float-safety verdict of ``rule`` (see the module docstring)."""
    seed = int(hashlib.sha256(rule.egglog("r").encode()).hexdigest()[:8], 16)
    inv = {w.args[0].args[0] for w in rule.when if w.op == "Inv" and w.args[0].op == "?"}
    facts = [substitute(f, {SELF: rule.lhs}) for f in rule.then]
    names, concrete = [], set()
    for t in [rule.lhs] + ([rule.rhs] if rule.rhs is not None else []) + list(rule.when) + facts:
        for sub in t.walk():
            if sub.op == "?" and sub.args[1] == "Blk" and sub.args[0] not in names:
                names.append(sub.args[0])
            if sub.op in ("BA", "BB"):
                concrete.add(sub.op[1])
    blocks, nxt = {}, 1
    for n in names + sorted(concrete):
        blocks[n] = tuple(range(nxt, nxt + BLOCK_SIZE))
        nxt += BLOCK_SIZE
    blocks["J"] = tuple(range(1, nxt + BLOCK_SIZE))
    sampler = _Sampler(seed, inv)
    e32, e64 = _Env(blocks, sampler, inv, np.float32), _Env(blocks, sampler, inv, np.float64)
    try:
        with np.errstate(all="ignore"):
            ok = _premises(rule, e64)
            if rule.kind == "rewrite":
                return _rewrite(rule, e32, e64, ok, sampler)
            return _analysis(facts, e32, e64, ok, sampler)
    except (ValueError, TypeError, KeyError) as exc:
        return FloatVerdict(f"the float check could not evaluate this rule ({exc})", "range")


def _premises(rule, e64):
    ok = np.ones(N_POINTS, dtype=bool)
    for w in rule.when:
        a = w.args
        if w.op == "NonZero":
            ok &= e64.ev(a[0]) != 0
        elif w.op == "Le":
            ok &= e64.ev(a[0]) <= e64.ev(a[1])
        elif w.op == "UB":
            m = e64.ev(a[0])
            for i in e64.block(a[2]):
                ok &= e64.ev(a[1], i) <= m
    return ok


def _point(sampler, i) -> str:
    items = []
    for k, v in sorted(sampler.vals.items()):
        items.append(f"{k} = {float(v[i]):.6g}")
    return ", ".join(items[:8]) + (", ..." if len(items) > 8 else "")


def _rewrite(rule, e32, e64, ok, sampler) -> FloatVerdict:
    l32, r32 = np.broadcast_to(e32.ev(rule.lhs), (N_POINTS,)), np.broadcast_to(e32.ev(rule.rhs), (N_POINTS,))
    l64, r64 = np.broadcast_to(e64.ev(rule.lhs), (N_POINTS,)), np.broadcast_to(e64.ev(rule.rhs), (N_POINTS,))
    # a point where both sides are undefined over the reals (log(-1), 0/0 from finite inputs) says nothing
    cl, cr = _cat(l32), _cat(r32)
    bad = ok & (cl != cr)
    if bad.any():
        i = int(np.argmax(bad))
        return FloatVerdict(f"in float32 the lhs is {float(l32[i]):.6g} but the rhs is {float(r32[i]):.6g} "
                            f"at {_point(sampler, i)}", "range")
    fin = ok & (cl == 0) & np.isfinite(l64) & np.isfinite(r64)
    close = np.abs(l64 - r64) <= 1e-9 * np.maximum(np.abs(l64), np.abs(r64)) + 1e-300
    fin &= close
    fin &= np.abs(l64) < 3e38
    if fin.any():
        bl, br = _bits(l32, l64), _bits(r32, l64)
        lo, hi = np.minimum(bl, br), np.maximum(bl, br)
        bad = fin & (lo <= GOOD_BITS) & (hi >= BAD_BITS)
        if bad.any():
            i = int(np.argmax(bad))
            return FloatVerdict(f"in float32 the lhs is {float(l32[i]):.8g} and the rhs {float(r32[i]):.8g} "
                                f"where the value is {float(l64[i]):.8g} (one side loses {hi[i]:.0f} bits) "
                                f"at {_point(sampler, i)}", "rounding")
    return FloatVerdict()


def _analysis(facts, e32, e64, ok, sampler) -> FloatVerdict:
    for f in facts:
        a = f.args
        if f.op == "NonZero":
            v32, v64 = e32.ev(a[0]), e64.ev(a[0])
            bad = ok & (v32 == 0) & (v64 != 0)
            what = lambda i: f"{a[0]!r} is 0 in float32 (float64: {float(np.broadcast_to(v64, (N_POINTS,))[i]):.6g})"
        elif f.op == "Le":
            x32, y32 = e32.ev(a[0]), e32.ev(a[1])
            bad = ok & ~(x32 <= y32) & (e64.ev(a[0]) <= e64.ev(a[1]))
            what = lambda i: f"{a[0]!r} <= {a[1]!r} fails in float32"
        elif f.op == "UB":
            m32, m64 = e32.ev(a[0]), e64.ev(a[0])
            bad = np.zeros(N_POINTS, dtype=bool)
            for j in e32.block(a[2]):
                bad |= ok & ~(e32.ev(a[1], j) <= m32) & (e64.ev(a[1], j) <= m64)
            what = lambda i: f"{a[0]!r} >= {a[1]!r} fails in float32"
        else:
            continue
        bad = np.broadcast_to(bad, (N_POINTS,))
        if bad.any():
            i = int(np.argmax(bad))
            return FloatVerdict(f"{what(i)} at {_point(sampler, i)}", "range")
    return FloatVerdict()
