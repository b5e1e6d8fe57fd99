"""Proofs of *selection* rules for blocks of every size: order types and induction.

The class this module decides (anything else is left to the other methods):

* rewrite rules whose terms are built from pattern variables, numeric constants,
  ``Max2``/``Min2``, ``Where``, the comparisons (``CmpLt`` ... ``CmpNe``) and the
  logical operators, and reductions ``RMax``/``RMin`` over one block variable ``s``
  whose bodies hold no reduction;
* comparisons and logical operators only in condition position (the first operand of
  ``Where``, operands of ``LAnd``/``LOr``/``LNot``): every value is then one of the
  leaves (a variable, an aggregate, a constant), never a boolean used as a number;
* side conditions ``Inv(v)`` (v a variable), ``Le(a, b)`` and ``UB(m, e, s)`` with
  ``m`` invariant.

**Why order types decide it.** In this class the value of a term is a function that
only *selects* among its leaves by comparing leaves: min, max and where commute with
every strictly increasing map of the reals. So an identity holds for all real values
exactly when it holds for one representative of every *weak order* of the leaves
(which leaves are equal, which smaller), with the constants kept at their values.
The module enumerates those weak orders (ordered set partitions) and evaluates both
sides on each: complete for the class, and exact (no floating point is involved
beyond assigning distinct representatives).

**Induction over the block** (the rule must hold for every non-empty block ``s``):
the base ``s = {e}`` reads each reduction as its body at ``e``. The step ``s u {e}``
unfolds ``R_{s u {e}} body = R(agg_s(body), body[e])``, where each ``agg_s(body)`` is
a fresh leaf (an arbitrary value: real blocks give it a particular one, so the
step is proved for a superset of the real cases); the induction hypothesis
``lhs(s) = rhs(s)`` and the side conditions at ``s`` (implied by those at ``s u {e}``:
``UB`` over a larger block implies ``UB`` over ``s``, and where the rule reads the max
aggregate of the bounded body, ``agg_s <= m``) filter the weak orders. A step that fails only on
unrealisable aggregates is a failure of the method, not a counterexample, so only a
failing *base* is reported as a counterexample (a block of one element).
"""
from __future__ import annotations

import math

from acefuse.rewrite.terms import Term

SELECT = ("Max2", "Min2", "Where")
CONDS = ("CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe", "LAnd", "LOr", "LNot")
METHOD = "order types of the leaves, induction over the block"
MAX_LEAVES = 8   # ordered set partitions of 8 leaves: 545,835 (about 20 s here); beyond that: not tried


class OutsideClass(ValueError):
    """The rule is not a selection rule of the decided class (module docstring)."""


def applies(rule) -> bool:
    """A rewrite rule that uses where or a comparison: a candidate for this method."""
    if rule.rhs is None:
        return False
    return any(t.op in ("Where",) + CONDS for side in (rule.lhs, rule.rhs) for t in side.walk())


def _block_var(rule):
    blocks = set()
    for side in [rule.lhs, rule.rhs] + list(rule.when):
        for t in side.walk():
            if t.op in ("RMax", "RMin", "Sum", "Cnt", "St"):
                b = t.args[0] if t.op != "St" else t.args[1]
                if b.op != "?":
                    raise OutsideClass(f"a reduction over {b!r}: only a block variable is decided here")
                blocks.add(b.args[0])
    if len(blocks) > 1:
        raise OutsideClass(f"several block variables {sorted(blocks)}")
    return next(iter(blocks), None)


def _check_class(t: Term, cond=False, in_body=False):
    op = t.op
    if op == "?":
        return
    if op == "Num":
        if isinstance(t.args[0], Term):
            raise OutsideClass("a constant pattern")
        return
    if op in ("RMax", "RMin"):
        if in_body:
            raise OutsideClass("a reduction inside a reduction's body")
        _check_class(t.args[1], in_body=True)
        return
    if op in CONDS:
        if not cond:
            raise OutsideClass(f"{op} used as a number (only as a condition)")
        for a in t.args:
            _check_class(a, cond=op in ("LAnd", "LOr", "LNot"), in_body=in_body)
        return
    if op == "Where":
        _check_class(t.args[0], cond=True, in_body=in_body)
        _check_class(t.args[1], in_body=in_body)
        _check_class(t.args[2], in_body=in_body)
        return
    if op in ("Max2", "Min2"):
        if cond:
            raise OutsideClass(f"{op} in condition position")
        for a in t.args:
            _check_class(a, in_body=in_body)
        return
    raise OutsideClass(f"operator {op}")


class _Leaves:
    """Names of the leaves of one case (base or step): invariants, families at e, aggregates."""

    def __init__(self, inv):
        self.inv = inv
        self.names: list = []

    def leaf(self, name):
        if name not in self.names:
            self.names.append(name)
        return name


def _ev(t: Term, env: dict, at, leaves: _Leaves, agg):
    """The value of ``t`` at element ``at`` ("e", or "0" for the ambient element): a leaf
    name is looked up in env; agg(op, body) gives a reduction's value."""
    op = t.op
    if op == "?":
        name = t.args[0]
        key = name if name in leaves.inv else f"{name}@{at}"
        return env[leaves.leaf(key)]
    if op == "Num":
        return float(t.args[0])
    if op in ("RMax", "RMin"):
        return agg(op, t.args[1])
    a = [_ev(x, env, at, leaves, agg) for x in t.args]
    if op == "Max2":
        return max(a)
    if op == "Min2":
        return min(a)
    if op == "Where":
        return a[1] if a[0] else a[2]
    if op == "LNot":
        return not a[0]
    if op == "LAnd":
        return bool(a[0]) and bool(a[1])
    if op == "LOr":
        return bool(a[0]) or bool(a[1])
    return {"CmpLt": a[0] < a[1], "CmpLe": a[0] <= a[1], "CmpGt": a[0] > a[1], "CmpGe": a[0] >= a[1],
            "CmpEq": a[0] == a[1], "CmpNe": a[0] != a[1]}[op]


def _weak_orders(items):
    """Every ordered set partition of ``items`` (a weak order: a list of levels)."""
    items = list(items)
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for order in _weak_orders(rest):
        for i in range(len(order) + 1):   # first on a level of its own, at every position
            yield order[:i] + [[first]] + order[i:]
        for i in range(len(order)):        # or tied with a level
            yield order[:i] + [order[i] + [first]] + order[i + 1:]


def _assignments(names, consts):
    """One representative real assignment per weak order of ``names`` together with the
    constants ``consts`` (kept at their values and their order)."""
    cs = sorted(set(consts))
    tag = {f"#const{i}": v for i, v in enumerate(cs)}
    for order in _weak_orders(list(names) + list(tag)):
        levels = []   # value of each level
        ok, last_c = True, None
        for lvl in order:
            vs = [tag[x] for x in lvl if x in tag]
            if len(vs) > 1:
                ok = False
                break
            levels.append(vs[0] if vs else None)
        if not ok:
            continue
        known = [(i, v) for i, v in enumerate(levels) if v is not None]
        if any(b <= a for (_, a), (_, b) in zip(known, known[1:])):
            continue   # constants out of their order
        vals = []
        for i, v in enumerate(levels):
            if v is not None:
                vals.append(v)
                continue
            lo = next(((j, w) for j, w in reversed(known) if j < i), None)
            hi = next(((j, w) for j, w in known if j > i), None)
            if (lo and lo[1] == math.inf) or (hi and hi[1] == -math.inf):
                ok = False
                break
            if lo is None and hi is None:
                vals.append(float(i))
            elif hi is None or hi[1] == math.inf:
                base = lo[1] if lo is not None and lo[1] != -math.inf else -1e6
                vals.append(base + (i - (lo[0] if lo is not None else -1)))
            elif lo is None or lo[1] == -math.inf:
                vals.append(hi[1] - (hi[0] - i))
            else:
                vals.append(lo[1] + (hi[1] - lo[1]) * (i - lo[0]) / (hi[0] - lo[0]))
        if not ok:
            continue
        env = {}
        for lvl, v in zip(order, vals):
            for x in lvl:
                if x not in tag:
                    env[x] = v
        yield env


def _constants(rule):
    out = set()
    for side in [rule.lhs, rule.rhs] + list(rule.when):
        for t in side.walk():
            if t.op == "Num" and not isinstance(t.args[0], Term):
                out.add(float(t.args[0]))
    return out


def decide(rule):
    """(status, detail, point): status "proved", "failed" (the step did not close: not a
    counterexample) or "refuted" (a block of one element where the sides differ: point)."""
    s = _block_var(rule)
    _check_class(rule.lhs)
    _check_class(rule.rhs)
    inv = set()
    prem = []
    for w in rule.when:
        if w.op == "Inv":
            if w.args[0].op != "?":
                raise OutsideClass(f"Inv of a term {w.args[0]!r}")
            inv.add(w.args[0].args[0])
        elif w.op in ("Le", "UB"):
            prem.append(w)
        elif w.op == "NonZero":
            raise OutsideClass("a NonZero side condition")
        else:
            raise OutsideClass(f"side condition {w.op}")
    for w in prem:
        for a in (w.args[:2] if w.op == "Le" else w.args[:1]):
            _check_class(a)
            if any(t.op == "?" and t.args[0] not in inv for t in a.walk()):
                raise OutsideClass(f"{w.op} of a value that is not declared invariant")
        if w.op == "UB":
            _check_class(w.args[1], in_body=True)
    consts = _constants(rule)
    if s is None:
        cases = [("identity", None)]
    else:
        cases = [("base", None), ("step", None)]
    for case, _ in cases:
        st = _case(rule, case, inv, prem, consts)
        if st is not None:
            status, point = st
            return status, f"{case} case fails at {point}", point
    scope = "for all block sizes" if s is not None else "all values"
    return "proved", f"rewrite proved ({METHOD}; {scope})", None


class _Probe(dict):
    """An environment that names every leaf it is asked for (value 0)."""

    def __missing__(self, k):
        return 0.0


def _case(rule, case, inv, prem, consts):
    """None when the case holds for every weak order, else (status, point)."""
    leaves = _Leaves(inv)
    aggs: dict = {}

    def agg_leaf(op, body):
        if (op, body) not in aggs:
            aggs[(op, body)] = leaves.leaf(f"{op.lower()}_s{len(aggs)}")
        return aggs[(op, body)]

    def reducer(env, mode):
        """mode "base": s = {e}; "grown": s u {e}; "old": s (the hypothesis)."""
        def agg(op, body):
            if mode == "base":
                return _ev(body, env, "e", leaves, agg)
            old = env[agg_leaf(op, body)]
            if mode == "old":
                return old
            here = _ev(body, env, "e", leaves, agg)
            return max(old, here) if op == "RMax" else min(old, here)
        return agg

    def premises_hold(env, mode):
        red = reducer(env, mode)
        for w in prem:
            if w.op == "Le":
                if not _ev(w.args[0], env, "0", leaves, red) <= _ev(w.args[1], env, "0", leaves, red):
                    return False
                continue
            m = _ev(w.args[0], env, "0", leaves, red)
            if m < _ev(w.args[1], env, "e", leaves, red):
                return False
            if mode != "base" and ("RMax", w.args[1]) in aggs and env[aggs[("RMax", w.args[1])]] > m:
                return False   # UB over s u {e} implies UB over s (for an aggregate the rule reads)
        return True

    probe = _Probe()
    for mode in ("base",) if case in ("base", "identity") else ("grown", "old"):
        red = reducer(probe, mode)
        _ev(rule.lhs, probe, "0", leaves, red)
        _ev(rule.rhs, probe, "0", leaves, red)
        premises_hold(probe, mode)
    for w in prem:   # premises_hold stops early: name every leaf of the premises too
        if w.op == "UB":
            _ev(w.args[1], probe, "e", leaves, reducer(probe, "base"))
        for t in (w.args[:2] if w.op == "Le" else w.args[:1]):
            _ev(t, probe, "0", leaves, reducer(probe, "base"))
    names = list(leaves.names)
    if len(names) + len(consts) > MAX_LEAVES:
        raise OutsideClass(f"{len(names)} leaves and {len(consts)} constants: too many to enumerate")
    grown_mode = "base" if case in ("base", "identity") else "grown"
    for env in _assignments(names, consts):
        if not premises_hold(env, grown_mode):
            continue
        if case == "step":   # the induction hypothesis, at s
            old = reducer(env, "old")
            if _ev(rule.lhs, env, "0", leaves, old) != _ev(rule.rhs, env, "0", leaves, old):
                continue
        red = reducer(env, grown_mode)
        a, b = _ev(rule.lhs, env, "0", leaves, red), _ev(rule.rhs, env, "0", leaves, red)
        if a != b:
            return ("refuted" if case in ("base", "identity") else "failed"), dict(env, lhs=a, rhs=b)
    return None
