"""Refutation: a 50-digit random search for counterexamples on concrete blocks.

When the symbolic prover (induction.py) cannot prove a rule, ``Refuter`` evaluates
it on concrete symbolic blocks of sizes 1 to 5 (so that a law that only holds on
small blocks, like ``(n - 1)(n - 2)(n - 3) = 0`` for ``n = Cnt(s)``, is refuted at
``|s| = 4``), at random points sampled at 50 digits (mpmath) plus targeted points
on the zero sets of the domain conditions. Distinct block variables are disjoint
blocks here; ``BJ`` contains every other block. A point where a goal fails is a
counterexample (status "refuted"); finding none proves nothing ("unproved").
"""
from __future__ import annotations

import random

import mpmath
import sympy as sp

from acefuse.rewrite.terms import Term
from acefuse.rules.base import Rule
from acefuse.proofs import decide
from acefuse.proofs.semantics import SympyBackend, MpBackend, Undefined, evaluate, mp_context

RANDOM_POINTS = 200          # random 50-digit points per block configuration
OMEGA = -1                   # a second ambient element, for Inv facts


class _Env:
    """Symbols and blocks of one block configuration of one rule."""

    def __init__(self, blocks: dict, inv: set, nonzero: set):
        self.blocks = blocks
        self.inv = inv
        self.nonzero = nonzero
        self.symbols: dict[str, sp.Symbol] = {}

    # -- blocks ------------------------------------------------------------------
    def block(self, b: Term) -> tuple:
        if b.op == "?":
            return self.blocks[b.args[0]]
        if b.op in ("BA", "BB", "BJ"):
            return self.blocks[b.op[1]]
        if b.op == "BU":
            x, y = self.block(b.args[0]), self.block(b.args[1])
            if set(x) & set(y):
                raise ValueError(f"BU of overlapping blocks {b!r}")
            return x + y
        raise ValueError(f"not a block: {b!r}")

    def block_key(self, b: Term) -> str:
        if b.op == "?":
            return b.args[0]
        if b.op in ("BA", "BB", "BJ"):
            return b.op[1]
        if b.op == "BU":
            return "(" + self.block_key(b.args[0]) + "+" + self.block_key(b.args[1]) + ")"
        return repr(b)

    # -- leaves ------------------------------------------------------------------
    def sym(self, name: str, var: str | None = None) -> sp.Symbol:
        s = self.symbols.get(name)
        if s is None:
            nz = var is not None and var in self.nonzero
            s = sp.Symbol(name, real=True, nonzero=True) if nz else sp.Symbol(name, real=True)
            self.symbols[name] = s
        return s

    def leaf(self, t: Term, elem: int):
        op = t.op
        if op == "?":
            name = t.args[0]
            if name in self.inv:
                return self.sym(name, name)
            return self.sym(_at(name, elem), name)
        if op == "Num":  # Num with a variable payload: an invariant constant
            return self.sym(t.args[0].args[0])
        name = t.args[0]
        if op == "Elm":
            base = f"Elm({name.lstrip('?')})"
            return self.sym(_at(base, elem))
        if op == "Par":
            return self.sym(f"Par({name.lstrip('?')})")
        if op == "St":
            return self.sym(f"St({name.lstrip('?')},{self.block_key(t.args[1])})")
        raise ValueError(f"unexpected leaf {t!r}")

    def ev(self, t: Term, elem: int = 0, be=None):
        return evaluate(t, elem, be or SympyBackend(), self.leaf, self.block)


def _at(name: str, elem: int) -> str:
    if elem == 0:
        return name
    if elem == OMEGA:
        return name + "[*]"
    return f"{name}[{elem}]"


def block_configs(names: list[str]) -> list[tuple]:
    """Block sizes tried for the block variables (sizes up to 5: beyond the small cases)."""
    n = len(names)
    if n == 0:
        return [()]
    if n == 1:
        return [(1,), (2,), (3,), (4,), (5,)]
    if n == 2:
        return [(1, 1), (2, 1), (1, 3), (2, 3), (4, 1), (1, 4), (3, 3)]
    return [(1,) * n, tuple(2 if i % 2 == 0 else 1 for i in range(n)), (4,) * n]


class Refuter:
    """Searches for a counterexample to ``goals`` of ``rule`` (see the module docstring)."""

    def __init__(self, rule: Rule, facts, seed: int):
        self.rule = rule
        self.rng = random.Random(seed)
        names, concrete = [], []
        terms = [rule.lhs] + ([rule.rhs] if rule.rhs is not None else []) + list(rule.when) + list(facts)
        for t in terms:
            for sub in t.walk():
                if sub.op == "?" and sub.args[1] == "Blk" and sub.args[0] not in names:
                    names.append(sub.args[0])
                if sub.op in ("BA", "BB") and sub.op[1] not in concrete:
                    concrete.append(sub.op[1])
                if sub.op == "BJ" and "J" not in concrete:
                    concrete.append("J")
        self.block_names = names + [c for c in concrete if c != "J"]
        self.has_j = "J" in concrete
        self.inv = {w.args[0].args[0] for w in rule.when if w.op == "Inv" and w.args[0].op == "?"}
        self.nonzero = {w.args[0].args[0] for w in rule.when if w.op == "NonZero" and w.args[0].op == "?"}

    def run(self, goals):
        """``(counterexample dict, explanation)`` or None."""
        for sizes in block_configs(self.block_names):
            env = self._env(sizes)
            sub, _ = self._premises(env)
            cex = self._search(env, sub, goals, sizes)
            if cex is not None:
                return cex
        return None

    def _env(self, sizes) -> _Env:
        blocks, nxt = {}, 1
        for name, k in zip(self.block_names, sizes):
            blocks[name] = tuple(range(nxt, nxt + k))
            nxt += k
        if self.has_j:
            blocks["J"] = tuple(range(1, nxt + 1))
        return _Env(blocks, self.inv, self.nonzero)

    def _premises(self, env: _Env):
        """Turn Le/UB side conditions into substitutions by fresh >= 0 gaps (decide.premises)."""
        return decide.premises(self.rule.when, env, self.nonzero, self._ub_premise)

    def _ub_premise(self, env: _Env, sub, m, e, s) -> bool:
        """``UB(m, e, s)``: every ``e`` over block ``s`` is at most ``m``, by a gap below ``m``
        for each element of a pattern variable ``e``, or above their max for a variable ``m``."""
        vm = env.ev(m)
        elems = env.block(s)
        done = False
        if e.op == "?":
            targets = {env.leaf(e, i) for i in elems}
            if not (targets & vm.free_symbols):
                done = all(decide.compose(sub, env.leaf(e, i), vm - decide.gap()) for i in elems)
        if not done and m.op == "?":
            top = sp.Max(*[env.ev(e, i) for i in elems])
            done = decide.compose(sub, env.leaf(m, 0), top + decide.gap())
        return done

    def _search(self, env: _Env, sub, goals, sizes):
        """A point (dict) where some goal fails at 50 digits, with an explanation; or None."""
        lam = {}
        with mp_context():
            seeds = self._targeted_points(env, sub, goals)
            for n in range(RANDOM_POINTS + len(seeds)):
                vals = dict(seeds[n]) if n < len(seeds) else {}
                point = _Point(env, sub, vals, self.rng, lam)
                try:
                    if not self._premises_hold(env, point):
                        continue
                except Undefined:
                    continue
                for g in goals:
                    why = self._check_goal_numeric(env, point, g)
                    if why:
                        cex = point.report()
                        for name, k in zip(self.block_names, sizes):
                            cex[f"|{name}|"] = k
                        return cex, why
        return None

    def _targeted_points(self, env, sub, goals):
        """Points on the zero set of domain conditions x != 0 and of NonZero facts
        (random search rarely hits them)."""
        pts = []
        for g in goals:
            if g[0] == "eq":
                bl, br = SympyBackend(), SympyBackend()
                env.ev(g[1], 0, bl), env.ev(g[2], 0, br)
                zero_sets = [x for k, x in {c for c in bl.conditions + br.conditions} if k == "nonzero"]
            elif g[0] == "NonZero":   # a NonZero fact: its own zero set
                zero_sets = [env.ev(g[1])]
            else:
                continue
            for x in zero_sets:
                x = x.xreplace(sub)
                if sp.count_ops(x) > 40:
                    continue
                solvable = [s for s in x.free_symbols
                            if s.is_real and s.is_positive is None and s.is_nonnegative is None]
                for z in sorted(solvable, key=lambda s: s.name)[:2]:  # a non-zero symbol too: premises are checked
                    try:
                        sols = sp.solve(x, z)
                    except Exception:
                        continue
                    for sol in sols[:2]:
                        if sol.is_real is False:
                            continue
                        vals = {}
                        for s in sol.free_symbols:
                            vals[s] = mpmath.mpf(self.rng.choice([1, 2, -1, 3])) if not s.name.startswith("_g") \
                                else mpmath.mpf(self.rng.choice([0, 1, 2]))
                        try:
                            v = sp.N(sol.xreplace({s: sp.Float(str(vals[s]), 50) for s in vals}), 50)
                            if not v.is_real:
                                continue
                            vals[z] = mpmath.mpf(str(v))
                        except Exception:
                            continue
                        pts.append(vals)
        return pts

    def _premises_hold(self, env, point) -> bool:
        be = MpBackend()
        for w in self.rule.when:
            a = w.args
            if w.op == "NonZero":
                if evaluate(a[0], 0, be, point.leaf, env.block) == 0:
                    return False
            elif w.op == "Le":
                x, y = (evaluate(t, 0, be, point.leaf, env.block) for t in a)
                if not x <= y + _tol(x, y):
                    return False
            elif w.op == "UB":
                m = evaluate(a[0], 0, be, point.leaf, env.block)
                for i in env.block(a[2]):
                    e = evaluate(a[1], i, be, point.leaf, env.block)
                    if not e <= m + _tol(m, e):
                        return False
        return True

    def _check_goal_numeric(self, env, point, g) -> str:
        """Explanation if goal ``g`` fails at ``point``, else ''."""
        be = MpBackend()
        kind = g[0]

        def ev(t, elem=0):
            return evaluate(t, elem, be, point.leaf, env.block)

        if kind == "eq":
            try:
                lv = ev(g[1])
            except Undefined as exc:
                lv = exc
            try:
                rv = ev(g[2])
            except Undefined as exc:
                rv = exc
            l_bad, r_bad = isinstance(lv, Undefined), isinstance(rv, Undefined)
            if l_bad and r_bad:
                return ""
            if l_bad or r_bad:
                bad, good = ("lhs", "rhs") if l_bad else ("rhs", "lhs")
                return (f"{bad} is undefined ({lv if l_bad else rv}) where {good} = "
                        f"{_num(rv if l_bad else lv)}: the domains differ")
            if abs(lv - rv) > _tol(lv, rv):
                return f"lhs = {_num(lv)} but rhs = {_num(rv)}"
            return ""
        try:
            if kind == "Inv":
                v0, v1 = ev(g[1], 0), ev(g[1], OMEGA)
                if abs(v0 - v1) > _tol(v0, v1):
                    return f"{g[1]!r} takes different values at two elements ({_num(v0)} vs {_num(v1)})"
            elif kind == "NonZero":
                v = ev(g[1])
                if abs(v) <= mpmath.mpf(10) ** -40:
                    return f"{g[1]!r} = 0"
            elif kind == "Le":
                a, b = ev(g[1]), ev(g[2])
                if a > b + _tol(a, b):
                    return f"{g[1]!r} = {_num(a)} > {g[2]!r} = {_num(b)}"
            elif kind == "UB":
                m = ev(g[1])
                for i in env.block(g[3]):
                    e = ev(g[2], i)
                    if e > m + _tol(m, e):
                        return f"{g[1]!r} = {_num(m)} < {g[2]!r} = {_num(e)} at element {i}"
        except Undefined as exc:
            return f"{g[1]!r} is undefined ({exc})"
        return ""


class _Point:
    """A random point: values of the free symbols, sampled lazily; substituted symbols computed."""

    def __init__(self, env, sub, vals, rng, lam):
        self.env, self.sub, self.rng, self.lam = env, sub, rng, lam
        self.vals = vals  # Symbol -> mpf

    def value(self, s: sp.Symbol):
        v = self.vals.get(s)
        if v is not None:
            return v
        if s in self.sub:
            expr = self.sub[s]
            fn = self.lam.get(s)
            if fn is None:
                args = sorted(expr.free_symbols, key=lambda x: x.name)
                fn = (args, sp.lambdify(args, expr, modules=[{"Max": max, "Min": min}, "mpmath"]))
                self.lam[s] = fn
            args, f = fn
            v = mpmath.mpf(f(*[self.value(a) for a in args]))
        else:
            v = self._sample(s)
        self.vals[s] = v
        return v

    def _sample(self, s):
        r = self.rng
        if s.is_positive:
            return mpmath.mpf(r.choice([r.uniform(0.05, 4), r.randint(1, 3), r.uniform(0.001, 0.1)]))
        if s.is_nonnegative:
            return mpmath.mpf(0 if r.random() < 0.2 else r.uniform(0, 4))
        x = r.choice([r.uniform(-3, 3), r.uniform(-3, 3), float(r.randint(-3, 3)), r.uniform(-40, 40)])
        if s.is_nonzero and x == 0:
            x = 1.5
        return mpmath.mpf(x)

    def leaf(self, t, elem):
        return self.value(self.env.leaf(t, elem))

    def report(self) -> dict:
        out = {}
        for name, s in sorted(self.env.symbols.items()):
            if s in self.vals or s in self.sub:
                try:
                    out[name] = float(self.value(s))
                except Exception:
                    pass
        return out


def _tol(a, b):
    return mpmath.mpf(10) ** -25 * max(mpmath.mpf(1), abs(a), abs(b))


def _num(v) -> str:
    return mpmath.nstr(v, 8) if not isinstance(v, Exception) else str(v)
