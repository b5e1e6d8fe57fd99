"""Top-k of a strictly increasing function of a score selects what top-k of the score selects.

acefuse/topk_fuse.py uses this to fuse ``af.topk(f(u), k, axis)`` (softmax probabilities
``exp(x - m) / l``, ``sigmoid(x)``, ``x * 2 + 1``, ...) as one k-candidate state on the
score ``u``, the other operands of ``f`` (``m``, ``l``: *row constants*, the same for every
element of the row) carried beside it and ``f`` applied to the k chosen scores at the end.

**Theorem (select-by-score).** Let ``f`` be a chain of the operations of ``FACTS`` from ``u``
to the selected expression, every other operand a row constant, and let the row's constants
satisfy the chain's side conditions (finite; a factor or divisor positive). Then the exact
(real) value ``f(u)`` is strictly increasing in ``u`` on the extended reals [-inf, +inf], is
NaN exactly where ``u`` is NaN, so the order of acefuse/topk.py (value decreasing, NaN
first, then the lowest index) over the elements ``f(u_j)`` *by exact value* is the order over
the ``u_j``. Proof: each fact below is proved (sympy: the derivative is positive on the
stated domain, so the operation is strictly increasing by the mean value theorem; checked on
IEEE float32 at -inf, +inf and NaN: the ends map to the ends, NaN to NaN and nothing else to
NaN); a composition of strictly increasing maps is strictly increasing (decreasing twice is
increasing); and ``before(f(p), f(q)) <=> before(p, q)`` because a strictly increasing ``f``
keeps ``>`` and ``==`` and NaN-ness (``check_order_lemma``, by the weak orders of two values).

Float32 rounding can make two distinct exact values equal (two logits whose probabilities
round to the same float): the selection is by the score, so the larger exact value (the larger
score) comes first; that is the documented convention, not torch.topk of the rounded values.

**Rows where the side conditions fail.** The chain's constants come with a decision procedure
(``const_range``): an interval for every constant, valid unless an *event* happens in the row;
the only event is "the max ``M(w)`` of a reduced expression w is not finite", and it is
*covered* when w is the score u and the chain also reads the softmax normaliser
``l = sum(exp(u - M(u)))``. ``check_normaliser_lemma``: l is NaN; or l is in [1, n] and
``M(u)`` is finite; or l = 0 and every score is -inf (acefuse's convention: an empty max
shifts by 0). ``check_nan_absorption``: every operation of the chain gives NaN for every
operand when a constant operand is NaN. So a row has every constant in range (the theorem
applies); or a NaN normaliser, and then every selected value is NaN: the order is the index
order, candidates 0..k-1 with value NaN, which the kernel writes from the finished states; or
every score is -inf, and then every value is the same expression of the same operands: all
tie, index order, which the selection on the scores (all equal) gives as well.
A constant whose range is unknown (an input tensor: it may hold +inf) or an event not covered
makes ``analyse`` refuse: the program keeps its two-pass fusion, exactly as written.

Decreasing chains (``-x``, ``c - x``, ``x * -2``) are refused (a bottom-k is not a construct);
a chain of two decreasing steps is increasing and is accepted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from acefuse.rewrite.terms import Term

FMAX = float(np.finfo(np.float32).max)
NMAX = 2.0 ** 31                     # the longest axis a kernel reads
_OVER = 2.0 ** 128 - 2.0 ** 103      # exact values below this round to a finite float32
_TINY = 2.0 ** -126                  # exact values at or above this round to a positive float32
_SLACK = 2.0 ** -20                  # relative error of the transcendental functions (a few ulp)


# ---- the facts --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fact:
    """One step of a chain: ``op`` with the score in operand ``pos`` (the other operand, if any,
    a row constant that must satisfy ``needs``); ``sign`` +1 increasing, -1 decreasing."""
    name: str
    op: str
    pos: int
    sign: int
    needs: str          # "" | "finite" | "positive" | "negative" | "nonneg-arg"
    expr: str           # sympy text of the function of x (c: the constant)


FACTS = [
    Fact("exp-increasing", "Exp", 0, 1, "", "exp(x)"),
    Fact("log-increasing-on-nonneg", "Log", 0, 1, "nonneg-arg", "log(x)"),
    Fact("sigmoid-increasing", "Sigmoid", 0, 1, "", "1/(1 + exp(-x))"),
    Fact("tanh-increasing", "Tanh", 0, 1, "", "tanh(x)"),
    Fact("add-const-increasing", "Add", 0, 1, "finite", "x + c"),
    Fact("const-add-increasing", "Add", 1, 1, "finite", "c + x"),
    Fact("sub-const-increasing", "Sub", 0, 1, "finite", "x - c"),
    Fact("const-sub-decreasing", "Sub", 1, -1, "finite", "c - x"),
    Fact("neg-decreasing", "Neg", 0, -1, "", "-x"),
    Fact("mul-positive-increasing", "Mul", 0, 1, "positive", "x * c"),
    Fact("positive-mul-increasing", "Mul", 1, 1, "positive", "c * x"),
    Fact("mul-negative-decreasing", "Mul", 0, -1, "negative", "x * c"),
    Fact("negative-mul-decreasing", "Mul", 1, -1, "negative", "c * x"),
    Fact("div-positive-increasing", "Div", 0, 1, "positive", "x / c"),
    Fact("div-negative-decreasing", "Div", 0, -1, "negative", "x / c"),
]
BY_KEY = {(f.op, f.pos, f.needs == "negative"): f for f in FACTS}

_NP = {"Exp": np.exp, "Log": np.log, "Sigmoid": lambda x: 1 / (1 + np.exp(-x)), "Tanh": np.tanh,
       "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Neg": np.negative}
_PROVED: dict = {}


def prove_fact(f: Fact):
    """(ok, detail): the sign of the derivative on the domain (sympy), and the float32 ends."""
    if f.name in _PROVED:
        return _PROVED[f.name]
    import sympy as sp
    x = sp.Symbol("x", positive=True) if f.needs == "nonneg-arg" else sp.Symbol("x", real=True)
    c = sp.Symbol("c", positive=True) if f.needs == "positive" else (
        sp.Symbol("c", negative=True) if f.needs == "negative" else sp.Symbol("c", real=True))
    d = sp.simplify(sp.diff(sp.sympify(f.expr, locals={"x": x, "c": c}), x))
    sign_ok = bool((d if f.sign > 0 else -d).rewrite(sp.exp).is_positive)
    # IEEE float32 at the ends and NaN, with a constant of every allowed kind
    consts = {"": [None], "finite": [-3.0, 0.0, 2.5, 1e30], "positive": [0.5, 3.0, 1e-30, 1e30],
              "negative": [-0.5, -3.0], "nonneg-arg": [None]}[f.needs]
    xs = [-math.inf, -1e30, -2.0, 0.0, 1e-30, 3.0, 1e30, math.inf] if f.needs != "nonneg-arg" else \
        [0.0, 1e-30, 1.0, 1e30, math.inf]
    ends_ok = True
    with np.errstate(all="ignore"):
        for cv in consts:
            def ev(v):
                a = np.float32(v)
                if f.op in ("Exp", "Log", "Sigmoid", "Tanh", "Neg"):
                    return _NP[f.op](a)
                cc = np.float32(cv)
                return _NP[f.op](a, cc) if f.pos == 0 else _NP[f.op](cc, a)
            ys = [ev(v) for v in xs]
            nan_ok = math.isnan(ev(math.nan)) and not any(math.isnan(y) for y in ys)
            mono = all((b >= a) if f.sign > 0 else (b <= a) for a, b in zip(ys, ys[1:]))
            ends_ok = ends_ok and nan_ok and mono
    ok = sign_ok and ends_ok
    detail = (f"{f.name}: d/dx({f.expr}) = {d}, {'positive' if f.sign > 0 else 'negative'} on the domain "
              f"(sympy){'; float32: ends kept, NaN only from NaN' if ends_ok else '; FLOAT32 ENDS FAIL'}")
    _PROVED[f.name] = (ok, detail)
    return ok, detail


def check_order_lemma() -> bool:
    """before(f(p), f(q)) == before(p, q) for a strictly increasing f keeping NaN: on every weak
    order of two values (less, equal, greater; either NaN), with distinct ranks."""
    from acefuse.proofs.topk import SPEC_BEFORE
    f = [lambda v: v, lambda v: 2.0 * v + 1.0, lambda v: math.exp(v / 8.0)]   # increasing representatives
    vals = [-1.0, 0.0, 1.0, math.nan]
    for fn in f:
        for a in vals:
            for b in vals:
                for ga, gb in ((0, 1), (1, 0)):
                    ya, yb = (math.inf if math.isnan(a) else a), (math.inf if math.isnan(b) else b)
                    fa, fb = fn(a), fn(b)
                    fya, fyb = (math.inf if math.isnan(fa) else fa), (math.inf if math.isnan(fb) else fb)
                    ra, rb = (ga - 9 if math.isnan(a) else ga), (gb - 9 if math.isnan(b) else gb)
                    if SPEC_BEFORE((ya, ra), (yb, rb)) != SPEC_BEFORE((fya, ra), (fyb, rb)):
                        return False
    return True


def check_nan_absorption() -> bool:
    """Every chain operation with a NaN constant operand is NaN for every score value."""
    with np.errstate(all="ignore"):
        for f in FACTS:
            if f.op in ("Exp", "Log", "Sigmoid", "Tanh", "Neg"):
                continue
            for v in (-math.inf, -1.0, 0.0, 2.0, math.inf, math.nan):
                a, c = np.float32(v), np.float32(math.nan)
                r = _NP[f.op](a, c) if f.pos == 0 else _NP[f.op](c, a)
                if not math.isnan(r):
                    return False
        for op in ("Exp", "Log", "Sigmoid", "Tanh", "Neg", "Add", "Sub", "Mul", "Div"):   # constants' own ops
            args = (np.float32(math.nan),) if op in ("Exp", "Log", "Sigmoid", "Tanh", "Neg") else \
                (np.float32(math.nan), np.float32(1.0))
            if not math.isnan(_NP[op](*args)):
                return False
    return True


def check_normaliser_lemma() -> bool:
    """``l = sum_S exp(w - M)``, ``M = max_S w``, with acefuse's convention that an empty max
    (M = -inf: every w is -inf) shifts by 0: l is NaN; or l is in [1, |S|] and M is finite;
    or l = 0 and every w is -inf. For every |S| by cases on M: M NaN or some w NaN: a NaN
    term; M = +inf: the term at M is exp(inf - inf) = NaN; M = -inf: every term exp(-inf - 0)
    = 0; M finite and no NaN: each term exp(w - M) in [0, 1] (w <= M), the term at M is
    exp(0) = 1, so the (monotonically rounded) sum is in [1, |S|]. Checked here on every row
    of up to 3 elements drawn from the IEEE classes, with NaN-ignoring and NaN-propagating max."""
    import itertools
    classes = [math.nan, -math.inf, math.inf, -5.0, 0.0, 3.0, 1e30, -1e30]
    with np.errstate(all="ignore"):
        for n in (1, 2, 3):
            for row in itertools.product(classes, repeat=n):
                w = np.array(row, np.float32)
                for M in (np.max(w), np.nanmax(w) if not np.all(np.isnan(w)) else np.float32(math.nan)):
                    terms = np.exp(w - (np.float32(0.0) if M == -math.inf else M))
                    s = np.float32(0.0)
                    for t in terms:
                        s = np.float32(s + t)
                    if math.isnan(s) or (s == 0.0 and np.all(w == -math.inf)):
                        continue
                    if not (1.0 <= s <= n) or not math.isfinite(M):
                        return False
    return True


# ---- the decision procedure over a selected term ------------------------------------------------
@dataclass
class Analysis:
    """``p = f(u)``: the score ``u``, the chain (outermost first: (node, operand position, Fact)),
    each constant's range, the events it depends on, and the normalisers that cover them."""
    selected: Term
    score: Term
    chain: list
    constants: list = field(default_factory=list)   # (term, (lo, hi), needs)
    normalisers: list = field(default_factory=list) # normaliser terms read by the chain
    refused: str = ""

    @property
    def ok(self):
        return not self.refused

    def facts(self):
        return [f for _, _, f in self.chain]


def _interval(op, a, b=None):
    with np.errstate(all="ignore"):
        if op == "Neg":
            return (-a[1], -a[0])
        if op in ("Exp", "Sigmoid", "Tanh", "Log"):
            if op == "Log" and a[0] <= 0:
                return None
            fn = {"Exp": math.exp, "Log": math.log, "Sigmoid": lambda v: 1 / (1 + math.exp(-v)),
                  "Tanh": math.tanh}[op]
            def safe(v):
                try:
                    return fn(v)
                except OverflowError:
                    return math.inf
            lo, hi = safe(a[0]), safe(a[1])
            return (lo - abs(lo) * _SLACK, hi + abs(hi) * _SLACK)
        if op == "Add":
            return (a[0] + b[0], a[1] + b[1])
        if op == "Sub":
            return (a[0] - b[1], a[1] - b[0])
        if op == "Mul":
            ps = [x * y for x in a for y in b if not (math.isinf(x) and y == 0 or math.isinf(y) and x == 0)]
            return (min(ps), max(ps)) if ps else None
        if op == "Div":
            if b[0] <= 0 <= b[1]:
                return None
            ps = [x / y for x in a for y in b if not (math.isinf(x) and math.isinf(y))]
            return (min(ps), max(ps)) if ps else None
    return None


def analyse(p: Term, axis: str, varies, is_red) -> Analysis:
    """Decide whether ``p`` (the selected expression) is a strictly increasing chain over a
    score free of reductions over ``axis``. ``varies(t)``: t reads the axis outside
    reductions; ``is_red(t)``: t is a reduction over the axis."""
    def reads_red(t):
        return any(is_red(u) for u in t.walk())

    path, cur, sign = [], p, 1
    best = None   # the deepest (score, chain) with an increasing chain and a reduction-free score
    if not reads_red(p):
        best = (p, [])
    while True:
        nxt = None
        if cur.op in ("Exp", "Sigmoid", "Tanh", "Neg", "Log"):
            f = BY_KEY.get((cur.op, 0, False))
            if f is not None and (f.needs != "nonneg-arg" or _nonneg(cur.args[0], varies)):
                nxt = (cur.args[0], 0, f)
        elif cur.op in ("Add", "Sub", "Mul", "Div") and len(cur.args) == 2:
            va, vb = varies(cur.args[0]), varies(cur.args[1])
            if va != vb:
                pos = 0 if va else 1
                c = cur.args[1 - pos]
                rng = const_range(c, axis, is_red)
                neg = rng is not None and rng[0][1] < 0 and cur.op in ("Mul", "Div")
                f = BY_KEY.get((cur.op, pos, neg))
                if f is not None:
                    nxt = (cur.args[pos], pos, f)
        if nxt is None:
            break
        path.append((cur, nxt[1], nxt[2]))
        sign *= nxt[2].sign
        cur = nxt[0]
        if sign > 0 and not reads_red(cur):
            best = (cur, list(path))
    if best is None:
        return Analysis(p, p, [], refused="no increasing chain reaches a score free of reductions over "
                        f"{axis!r} (a decreasing chain would be a bottom-k, which is not a construct)")
    u, chain = best
    a = Analysis(p, u, chain)
    if not chain:
        a.refused = "the selected expression is its own score"
        return a
    events, norms = set(), []
    for node, pos, f in chain:
        if f.needs in ("", "nonneg-arg"):
            continue
        c = node.args[1 - pos]
        r = const_range(c, axis, is_red)
        if r is None:
            a.refused = (f"the row constant `{_pretty(c)}` of `{_pretty(node)}` has no known range (an input "
                         "tensor may hold inf), so the chain may not be increasing in a row")
            return a
        (lo, hi), ev, nm = r
        good = {"finite": -_OVER < lo and hi < _OVER,
                "positive": _TINY <= lo and hi < _OVER,
                "negative": -_OVER < lo and hi <= -_TINY}[f.needs]
        if not good:
            a.refused = f"the row constant `{_pretty(c)}` is in [{lo:g}, {hi:g}], not {f.needs}"
            return a
        a.constants.append((c, (lo, hi), f.needs))
        events |= ev
        norms += [n for n in nm if n not in norms]
    # a normaliser of the score itself covers its max: NaN (every value NaN), or 0 with every
    # score -inf (every value the same: all tie, index order, as the scores tie)
    covered = {n.args[1].args[0].args[0] for n in norms} & {u}
    if events - covered:
        a.refused = ("a row's max of `" + _pretty(next(iter(events - covered))) + "` may be infinite and the "
                     "chain reads no normaliser sum(exp(w - max(w))) that would then be NaN")
        return a
    a.normalisers = norms
    return a


def _nonneg(t, varies):
    """t >= 0 (or NaN) for every score value: exp, sigmoid, or such a term times / over a
    positive literal."""
    if t.op in ("Exp", "Sigmoid"):
        return True
    if t.op in ("Mul", "Div") and t.args[1].op == "Num" and t.args[1].args[0] > 0:
        return _nonneg(t.args[0], varies)
    if t.op == "Mul" and t.args[0].op == "Num" and t.args[0].args[0] > 0:
        return _nonneg(t.args[1], varies)
    return False


def _is_normaliser(t, is_red):
    """``sum_e(exp(w - max_e(w)))`` over the axis."""
    if not (is_red(t) and t.op == "Sum"):
        return False
    b = t.args[1]
    if b.op != "Exp" or b.args[0].op != "Sub":
        return False
    w, m = b.args[0].args
    return m.op == "RMax" and is_red(m) and m.args[1] == w and not any(is_red(u) for u in w.walk())


def const_range(c: Term, axis: str, is_red):
    """((lo, hi), events, normalisers) of a row constant, valid when no event happens in the
    row (events: terms w whose max over the axis is not finite), or None (unknown)."""
    if c.op == "Num":
        v = float(c.args[0])
        return ((v, v), frozenset(), ()) if not math.isnan(v) else None
    if is_red(c):
        if c.op == "RMax" and not any(is_red(u) for u in c.args[1].walk()):
            return (-FMAX, FMAX), frozenset([c.args[1]]), ()
        if _is_normaliser(c, is_red):
            return (1.0, NMAX), frozenset([c.args[1].args[0].args[0]]), (c,)
        return None
    if c.op in ("Exp", "Log", "Sigmoid", "Tanh", "Neg"):
        r = const_range(c.args[0], axis, is_red)
        if r is None:
            return None
        iv = _interval(c.op, r[0])
        return None if iv is None else (iv, r[1], r[2])
    if c.op in ("Add", "Sub", "Mul", "Div") and len(c.args) == 2:
        ra, rb = const_range(c.args[0], axis, is_red), const_range(c.args[1], axis, is_red)
        if ra is None or rb is None:
            return None
        iv = _interval(c.op, ra[0], rb[0])
        if iv is None or any(math.isnan(v) for v in iv):
            return None
        # a rounded result: one more ulp either way (finite results stay within _OVER)
        iv = (iv[0] - abs(iv[0]) * 2.0 ** -23, iv[1] + abs(iv[1]) * 2.0 ** -23)
        return iv, ra[1] | rb[1], ra[2] + tuple(n for n in rb[2] if n not in ra[2])
    return None


def _pretty(t):
    from acefuse.rewrite.terms import pretty
    return pretty(t)


@dataclass
class MonotoneProof:
    status: str
    detail: str
    summary: str = ""

    @property
    def ok(self):
        return self.status == "proved"


def prove(a: Analysis) -> MonotoneProof:
    """The select-by-score theorem for one analysed chain: every fact proved, the lemmas
    checked, the constants' side conditions decided (module docstring)."""
    if not a.ok:
        return MonotoneProof("refused", a.refused)
    lines = []
    for f in a.facts():
        ok, d = prove_fact(f)
        if not ok:
            return MonotoneProof("refuted", d)
        lines.append(d)
    if sum(1 for f in a.facts() if f.sign < 0) % 2:
        return MonotoneProof("refuted", "the chain is decreasing")
    for name, check in (("order lemma", check_order_lemma), ("NaN absorption", check_nan_absorption),
                        ("normaliser lemma", check_normaliser_lemma)):
        if name == "normaliser lemma" and not a.normalisers:
            continue
        if not _lemma(name, check):
            return MonotoneProof("refuted", f"the {name} fails")
        lines.append(name + " checked")
    consts = "; ".join(f"`{_pretty(c)}` in [{lo:g}, {hi:g}] ({needs})" for c, (lo, hi), needs in a.constants)
    summary = ("strictly increasing chain " + " -> ".join(f.name for f in a.facts())
               + (f"; row constants {consts}" if consts else "")
               + (f"; a row whose normaliser {', '.join(_pretty(n) for n in a.normalisers)} is NaN "
                  "selects candidates 0..k-1 with value NaN" if a.normalisers else ""))
    return MonotoneProof("proved", summary + " [" + "; ".join(lines) + "]", summary)


_LEMMAS: dict = {}


def _lemma(name, check):
    if name not in _LEMMAS:
        _LEMMAS[name] = check()
    return _LEMMAS[name]


if __name__ == "__main__":   # python -m acefuse.proofs.monotone
    for f in FACTS:
        print(prove_fact(f))
    print("order", check_order_lemma(), "nan", check_nan_absorption(), "normaliser", check_normaliser_lemma())
