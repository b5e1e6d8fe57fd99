"""Deciding ``e == 0`` and ``e >= 0`` with sympy, with max/min handled by case splits.

sympy simplifies ``Max(x, x + g)`` to ``x + g`` when it knows ``g >= 0``, but it
cannot decide ``Max(a + k, b + k) - Max(a, b) - k == 0`` directly. We therefore
split on which argument of a max/min is the extreme one: in the case "argument
``u`` is the max", every other argument ``v`` satisfies ``u - v >= 0``; when that
difference is linear in a free real symbol ``z`` we *solve* for it,
``z := (g - rest) / coeff`` with a fresh symbol ``g >= 0``, so the case's
constraint is carried by sympy's assumptions and the other max/min nodes
collapse by themselves. A constraint we cannot solve is dropped, which only
makes the obligation of that case stronger (still sound, possibly undecided).

Every function here returns ``True`` (proved) or ``None`` (undecided); none of
them ever claims a falsehood is false: refutation is the random search's job.
"""
from __future__ import annotations

import itertools

import sympy as sp

MAX_CASES = 4096

_gap_counter = itertools.count()


def gap(positive: bool = False) -> sp.Symbol:
    """A fresh non-negative (or positive) symbol."""
    n = next(_gap_counter)
    if positive:
        return sp.Symbol(f"_gp{n}", positive=True)
    return sp.Symbol(f"_g{n}", nonnegative=True)


def is_plain(z: sp.Symbol) -> bool:
    """A real symbol without further assumptions: safe to solve for."""
    return (z.is_real and z.is_positive is None and z.is_nonnegative is None
            and z.is_nonzero is None and z.is_zero is None)


def compose(sub: dict, z: sp.Symbol, val) -> bool:
    """Add ``z := val`` to an idempotent substitution ``sub``; False if circular."""
    val = val.xreplace(sub)
    if z in val.free_symbols:
        return False
    for k in list(sub):
        sub[k] = sub[k].xreplace({z: val})
    sub[z] = val
    return True


def compose_le(sub: dict, env, lo, hi, va, vb, nonzero) -> bool:
    """Side condition ``Le(lo, hi)`` (values ``va``, ``vb`` in ``env``) as a substitution: a
    pattern variable ``hi`` becomes ``va`` plus a fresh gap, else a pattern variable ``lo``
    becomes ``vb`` minus one (the gap is positive where the variable is ``NonZero`` and the
    other side is 0). False when neither side can be substituted (no variable, or circular)."""
    if hi.op == "?":
        pos = hi.args[0] in nonzero and va == 0
        if compose(sub, env.leaf(hi, 0), va + gap(pos)):
            return True
    if lo.op == "?":
        pos = lo.args[0] in nonzero and vb == 0
        return compose(sub, env.leaf(lo, 0), vb - gap(pos))
    return False


def premises(when, env, nonzero, solve_ub, solve_le=None):
    """The side conditions ``when`` of a rule as a substitution by fresh >= 0 gaps, with the
    values of ``env``: ``(sub, unresolved)``, ``unresolved`` naming each condition not
    encoded. Inv and NonZero of a pattern variable hold by its symbol's assumptions; Le by
    ``compose_le``, else ``solve_le(sub, hi - lo)`` when given; ``UB(m, e, s)`` by
    ``solve_ub(env, sub, m, e, s)``. Shared by the prover (proofs/rules.py) and the refuter
    (proofs/search.py)."""
    sub: dict = {}
    unresolved = []
    for w in when:
        a = w.args
        if w.op in ("Inv", "NonZero"):
            if a[0].op != "?":
                unresolved.append(f"{w.op}({a[0]!r})")
        elif w.op == "Le":
            va, vb = env.ev(a[0]), env.ev(a[1])
            done = compose_le(sub, env, a[0], a[1], va, vb, nonzero)
            if not done and solve_le is not None:
                done = solve_le(sub, vb - va)
            if not done:
                unresolved.append(f"Le({a[0]!r}, {a[1]!r})")
        elif w.op == "UB":
            if not solve_ub(env, sub, *a):
                unresolved.append(f"UB({a[0]!r}, {a[1]!r}, {a[2]!r})")
    return sub, unresolved


def solve_linear_for(d, prefer=()):
    """A plain symbol ``z`` in which ``d`` is linear with a numeric coefficient, or None."""
    syms = sorted((s for s in d.free_symbols if is_plain(s)), key=lambda s: (s not in prefer, s.name))
    for z in syms:
        c = sp.diff(d, z)
        if c.is_number and c != 0:
            return z, c, sp.expand(d - c * z)
    return None


def _innermost_minmax(e):
    best = None
    for node in sp.preorder_traversal(e):
        if isinstance(node, (sp.Max, sp.Min)):
            nested = any(isinstance(sub, (sp.Max, sp.Min))
                         for arg in node.args for sub in sp.preorder_traversal(arg))
            if not nested:
                if best is None or sp.default_sort_key(node) < sp.default_sort_key(best):
                    best = node
    return best


def _abs_to_max(e):
    return e.replace(lambda x: isinstance(x, sp.Abs) and x.args[0].is_real,
                     lambda x: sp.Max(x.args[0], -x.args[0]))


def cases(expr):
    """Yield max/min-free versions of ``expr``, one per feasible ordering case.

    Returns via StopIteration normally; raises ``TooManyCases`` beyond MAX_CASES.
    """
    stack = [_abs_to_max(expr)]
    produced = 0
    while stack:
        e = stack.pop()
        mm = _innermost_minmax(e)
        if mm is None:
            produced += 1
            if produced > MAX_CASES:
                raise TooManyCases()
            yield e
            continue
        is_max = isinstance(mm, sp.Max)
        for j, u in enumerate(mm.args):
            sub: dict = {}
            feasible = True
            for i, v in enumerate(mm.args):
                if i == j:
                    continue
                d = sp.expand(((u - v) if is_max else (v - u)).xreplace(sub))
                if d.is_nonnegative:
                    continue
                if d.is_negative:
                    feasible = False
                    break
                lin = solve_linear_for(d)
                if lin is None:
                    continue  # constraint dropped: stronger obligation, still sound
                z, c, rest = lin
                compose(sub, z, (gap() - rest) / c)
            if feasible:
                stack.append(e.xreplace({mm: u}).xreplace(sub))


class TooManyCases(Exception):
    pass


def _every_case(e, holds) -> bool | None:
    """True if ``holds(c)`` for every max/min case ``c`` of ``e`` (``cases``), else None
    (also when there are too many cases to try)."""
    try:
        for c in cases(e):
            if not holds(c):
                return None
    except TooManyCases:
        return None
    return True


def is_zero(e) -> bool | None:
    """True if sympy shows ``e == 0`` (in every max/min case), else None."""
    return _every_case(e, _zero_no_minmax)


def _zero_no_minmax(e) -> bool:
    if e == 0:
        return True
    e1 = sp.expand(e, power_exp=True)
    if e1 == 0:
        return True
    try:
        if sp.cancel(sp.together(e1)) == 0:
            return True
    except sp.PolynomialError:
        pass
    if sp.count_ops(e) > 400:
        return False
    return sp.simplify(e) == 0


def is_nonneg(e) -> bool | None:
    """True if sympy shows ``e >= 0`` (in every max/min case), else None."""
    return _every_case(e, _nonneg_no_minmax)


def _nonneg_no_minmax(e) -> bool:
    if e.is_nonnegative:
        return True
    e1 = sp.expand(e)
    if e1.is_nonnegative:
        return True
    return bool(sp.factor(e1).is_nonnegative) or bool(sp.simplify(e).is_nonnegative)


def is_nonzero(e) -> bool | None:
    """True if sympy shows ``e != 0`` (in every max/min case), else None."""
    return _every_case(e, lambda c: c.is_nonzero or sp.expand(c).is_nonzero or sp.simplify(c).is_nonzero)
