"""Soundness proofs of rewrite and analysis rules.

``prove_rule(rule)`` decides, for one ``Rule`` of ``acefuse.rules``:

* a **rewrite** ``lhs => rhs`` (applied in an e-graph, so read as the equation
  ``lhs = rhs``): under the side conditions, ``lhs - rhs`` simplifies to 0 with
  sympy, and both sides are defined in the same places (``log``, ``sqrt``,
  ``rsqrt`` and ``/`` are partial: an identity that needs ``x > 0`` or
  ``b != 0`` must state it as a side condition);
* an **analysis** rule ``lhs |- facts``: every concluded fact follows from the
  premises (``Inv``: the value does not depend on the reduced element;
  ``NonZero``: provably != 0; ``Le(a, b)``: ``b - a >= 0``; ``UB(m, e, s)``:
  ``m - e_i >= 0`` for every element ``i`` of ``s``).

Semantics (see semantics.py): each block variable is a symbolic block of
several sizes (distinct block variables are disjoint blocks, ``BU`` is their
disjoint union, ``BJ`` contains every other block); a pattern variable is one
real symbol when the rule states ``Inv(var)``, otherwise a *family* with one
symbol per element (``f[1]``, ``f[2]``, ...; ``f`` outside every reduction is
its value at the ambient element, kept independent of the block's elements);
``St(q, s)`` is an opaque symbol per state and block; ``Cnt(s)`` is the size.

Side conditions become sympy facts: ``NonZero(v)`` makes ``v`` a non-zero
symbol; ``Le(a, b)`` substitutes ``b := a + g`` (``g >= 0``); ``UB(m, e, s)``
substitutes ``e_i := m - g_i``. Max and min are decided by case splits
(decide.py).

When sympy cannot decide, a random search at 50 digits (mpmath) looks for a
counterexample: found -> ``"refuted"`` with the point, else ``"unproved"``.

Results are cached in-process and on disk (``$ACEFUSE_CACHE_DIR/proofs.json``,
default ``~/.cache/acefuse/proofs.json``), keyed by a hash of the rule's egglog
text and ``CHECKER_VERSION``.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, asdict
from pathlib import Path

import mpmath
import sympy as sp

from acefuse.rewrite.terms import Term, substitute
from acefuse.rules.base import Rule, SELF
from acefuse.proofs import decide
from acefuse.proofs.semantics import (SympyBackend, MpBackend, Undefined, evaluate, mp_context)

CHECKER_VERSION = "acefuse-proofs-1"
RANDOM_POINTS = 200          # random 50-digit points per block configuration
OMEGA = -1                   # a second ambient element, for proving Inv facts



@dataclass
class ProofResult:
    """The outcome of proving one rule.

    status: "proved" (sympy shows it), "refuted" (a counterexample exists),
    "unproved" (sympy could not decide and random search found no counterexample).
    """

    name: str
    theory: str
    status: str
    method: str
    counterexample: dict | None = None
    seconds: float = 0.0
    detail: str = ""
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "proved"

    def summary(self) -> str:
        s = f"{self.name} [{self.theory}]: {self.status}"
        if self.status != "proved":
            s += f" -- {self.detail}"
            if self.counterexample:
                s += f"; counterexample {_fmt_point(self.counterexample)}"
        return s


class UnprovedRuleError(ValueError):
    """Raised by ``require_proved`` when some rule is refuted or unproved."""

    def __init__(self, results):
        self.results = list(results)
        lines = [f"{len(self.results)} rule(s) failed their soundness proof and were not loaded:"]
        lines += ["  - " + r.summary() for r in self.results]
        lines.append("Fix the rule (or state the side condition it needs: inv(k), nonzero(b), le(a, b)); "
                     "check it with `acefuse prove my_rules.py`. For an experiment you may load it anyway "
                     "with allow_unproved=True.")
        super().__init__("\n".join(lines))


# ============================================================================
# public API
# ============================================================================

def prove_rule(rule: Rule, use_cache: bool = True) -> ProofResult:
    """Prove one rule (cached by its egglog text); see the module docstring."""
    key = rule_key(rule)
    if use_cache:
        hit = _cache_get(key)
        if hit is not None:
            return _with_identity(hit, rule, cached=True)
    t0 = time.perf_counter()
    try:
        res = _Prover(rule).run()
    except Exception as exc:  # a malformed rule: say so instead of crashing the loader
        res = ProofResult(rule.name, rule.theory, "unproved", "error", None, 0.0,
                          f"the checker could not evaluate this rule: {type(exc).__name__}: {exc}")
    res.seconds = time.perf_counter() - t0
    if use_cache:
        _cache_put(key, res)
    return res


def prove_rules(rules, use_cache: bool = True) -> list[ProofResult]:
    """Prove several rules (a list, or a dict of name -> Rule); saves the disk cache once."""
    rules = list(rules.values()) if isinstance(rules, dict) else list(rules)
    out = [prove_rule(r, use_cache=use_cache) for r in rules]
    if use_cache:
        save_cache()
    return out


def require_proved(rules, allow_unproved: bool = False) -> list[ProofResult]:
    """Prove ``rules``; raise ``UnprovedRuleError`` unless every one is proved.

    With ``allow_unproved=True`` (the experiments opt-out) a loud warning goes to
    stderr instead, and the results are returned.
    """
    results = prove_rules(rules)
    bad = [r for r in results if not r.ok]
    if bad:
        if not allow_unproved:
            raise UnprovedRuleError(bad)
        bar = "!" * 78
        msg = [bar, f"WARNING: acefuse is loading {len(bad)} rule(s) WITHOUT a soundness proof "
                    "(allow_unproved=True). Results may be wrong:"]
        msg += ["  - " + r.summary() for r in bad]
        msg.append(bar)
        print("\n".join(msg), file=sys.stderr)
    return results


def rule_key(rule: Rule) -> str:
    text = CHECKER_VERSION + "\n" + rule.egglog("r")
    return hashlib.sha256(text.encode()).hexdigest()


# ============================================================================
# cache
# ============================================================================

_MEM: dict[str, dict] = {}
_DISK_LOADED = False
_DIRTY = False


def cache_path() -> Path:
    base = os.environ.get("ACEFUSE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "acefuse"
    return root / "proofs.json"


def clear_memory_cache():
    """Forget in-process results (the disk cache is re-read on next use)."""
    global _DISK_LOADED
    _MEM.clear()
    _DISK_LOADED = False


def _load_disk():
    global _DISK_LOADED
    if _DISK_LOADED:
        return
    _DISK_LOADED = True
    try:
        data = json.loads(cache_path().read_text())
        if isinstance(data, dict):
            for k, v in data.items():
                _MEM.setdefault(k, v)
    except (OSError, ValueError):
        pass


def _cache_get(key):
    _load_disk()
    d = _MEM.get(key)
    if d is None:
        return None
    try:
        return ProofResult(**d)
    except TypeError:
        return None


def _cache_put(key, res: ProofResult):
    global _DIRTY
    d = asdict(res)
    d["cached"] = False
    _MEM[key] = d
    _DIRTY = True


def save_cache():
    """Merge the in-process results into the disk cache (atomic replace; errors ignored)."""
    global _DIRTY
    if not _DIRTY:
        return
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data.update(_MEM)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".proofs-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
        _DIRTY = False
    except OSError:
        pass


def _with_identity(res: ProofResult, rule: Rule, cached: bool) -> ProofResult:
    res.name, res.theory, res.cached = rule.name, rule.theory, cached
    return res


# ============================================================================
# the prover
# ============================================================================

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


def _block_configs(names: list[str]) -> list[tuple]:
    n = len(names)
    if n == 0:
        return [()]
    if n == 1:
        return [(1,), (2,), (3,)]
    if n == 2:
        return [(1, 1), (2, 1), (1, 3), (2, 3)]
    return [(1,) * n, tuple(2 if i % 2 == 0 else 1 for i in range(n))]


class _Prover:
    def __init__(self, rule: Rule):
        self.rule = rule
        self.rng = random.Random(int(rule_key(rule)[:12], 16))
        facts = [substitute(f, {SELF: rule.lhs}) for f in rule.then]
        self.facts = facts
        # block names: pattern block variables, then the concrete blocks used
        names, concrete = [], []
        terms = [rule.lhs] + ([rule.rhs] if rule.rhs is not None else []) + list(rule.when) + facts
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
        self.inv = {w.args[0].args[0] for w in rule.when
                    if w.op == "Inv" and w.args[0].op == "?"}
        self.nonzero = {w.args[0].args[0] for w in rule.when
                        if w.op == "NonZero" and w.args[0].op == "?"}

    # ---------------------------------------------------------------------------
    def run(self) -> ProofResult:
        r = self.rule
        configs = _block_configs(self.block_names)
        kind = "rewrite" if r.kind == "rewrite" else "analysis"
        method = "sympy" if not self.block_names and not self.has_j else \
            "sympy on symbolic blocks " + ", ".join(
                "(" + ",".join(f"|{n}|={k}" for n, k in zip(self.block_names, c)) + ")" for c in configs)
        notes = []
        undecided = []
        for sizes in configs:
            env = self._env(sizes)
            sub, unresolved = self._premises(env)
            notes += [u for u in unresolved if u not in notes]
            open_goals = []
            for goal in self._goals():
                ok, why = self._prove_goal(env, goal, sub)
                if not ok:
                    open_goals.append((goal, why))
            if not open_goals:
                continue
            # sympy could not decide: search for a counterexample at 50 digits
            cex = self._search(env, sub, [g for g, _ in open_goals], sizes)
            if cex is not None:
                point, why = cex
                return ProofResult(r.name, r.theory, "refuted",
                                   method + " + mpmath random search (50 digits)", point, 0.0,
                                   why + _hint(r))
            undecided.append((sizes, open_goals))
        if undecided:
            sizes, goals = undecided[0]
            whys = "; ".join(why for _, why in goals)
            where = f" on blocks {dict(zip(self.block_names, sizes))}" if sizes else ""
            detail = (f"sympy could not decide{where}: {whys}. {RANDOM_POINTS} random 50-digit points per "
                      f"block configuration found no counterexample. Simplify the rule, split it into "
                      f"smaller steps, or state the side condition it relies on.")
            if notes:
                detail += " (side conditions not used by the checker: " + ", ".join(notes) + ")"
            return ProofResult(r.name, r.theory, "unproved", method + " + mpmath random search", None,
                               0.0, detail)
        return ProofResult(r.name, r.theory, "proved", method, None, 0.0,
                           f"{kind} proved" + (f" (side conditions not used: {', '.join(notes)})" if notes else ""))

    def _env(self, sizes) -> _Env:
        blocks, nxt = {}, 1
        for name, k in zip(self.block_names, sizes):
            blocks[name] = tuple(range(nxt, nxt + k))
            nxt += k
        if self.has_j:
            blocks["J"] = tuple(range(1, nxt + 1))
        return _Env(blocks, self.inv, self.nonzero)

    # -- premises -> substitution ----------------------------------------------------
    def _premises(self, env: _Env):
        """Turn Le/UB side conditions into substitutions by fresh >= 0 gaps."""
        sub: dict = {}
        unresolved = []
        for w in self.rule.when:
            a = w.args
            if w.op == "Inv":
                if a[0].op != "?":
                    unresolved.append(f"Inv({a[0]!r})")
            elif w.op == "NonZero":
                if a[0].op != "?":
                    unresolved.append(f"NonZero({a[0]!r})")
            elif w.op == "Le":
                va, vb = env.ev(a[0]), env.ev(a[1])
                done = False
                if a[1].op == "?":
                    pos = a[1].args[0] in self.nonzero and va == 0
                    done = decide.compose(sub, env.leaf(a[1], 0), va + decide.gap(pos))
                if not done and a[0].op == "?":
                    pos = a[0].args[0] in self.nonzero and vb == 0
                    done = decide.compose(sub, env.leaf(a[0], 0), vb - decide.gap(pos))
                if not done:
                    unresolved.append(f"Le({a[0]!r}, {a[1]!r})")
            elif w.op == "UB":
                m, e, s = a
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
                if not done:
                    unresolved.append(f"UB({m!r}, {e!r}, {s!r})")
        return sub, unresolved

    # -- goals ---------------------------------------------------------------------------
    def _goals(self):
        r = self.rule
        if r.kind == "rewrite":
            return [("eq", r.lhs, r.rhs)]
        return [(f.op, *f.args) for f in self.facts]

    def _prove_goal(self, env: _Env, goal, sub):
        kind = goal[0]
        if kind == "eq":
            bl, br = SympyBackend(), SympyBackend()
            lhs, rhs = env.ev(goal[1], 0, bl), env.ev(goal[2], 0, br)
            diff = (lhs - rhs).xreplace(sub)
            if decide.is_zero(diff) is None:
                return False, f"lhs - rhs = {_short(sp.simplify(diff) if sp.count_ops(diff) < 60 else diff)} is not shown to be 0"
            only_l, only_r = self._domain_diff(bl.conditions, br.conditions, sub, env)
            if only_l or only_r:
                parts = []
                if only_l:
                    parts.append("lhs needs " + " and ".join(_cond_str(c) for c in only_l))
                if only_r:
                    parts.append("rhs needs " + " and ".join(_cond_str(c) for c in only_r))
                return False, ("the sides are equal where both are defined, but their domains differ: "
                               + "; ".join(parts) + ", which the rule's side conditions do not give")
            return True, ""
        if kind == "Inv":
            v0, v1 = env.ev(goal[1], 0), env.ev(goal[1], OMEGA)
            if decide.is_zero((v0 - v1).xreplace(sub)):
                return True, ""
            return False, f"{goal[1]!r} may depend on the reduced element"
        if kind == "NonZero":
            v = env.ev(goal[1]).xreplace(sub)
            if decide.is_nonzero(v):
                return True, ""
            return False, f"{goal[1]!r} = {_short(v)} is not shown to be non-zero"
        if kind == "Le":
            d = (env.ev(goal[2]) - env.ev(goal[1])).xreplace(sub)
            if decide.is_nonneg(d):
                return True, ""
            return False, f"{goal[2]!r} - {goal[1]!r} = {_short(d)} is not shown to be >= 0"
        if kind == "UB":
            m, e, s = goal[1:]
            vm = env.ev(m)
            for i in env.block(s):
                d = (vm - env.ev(e, i)).xreplace(sub)
                if not decide.is_nonneg(d):
                    return False, f"{m!r} >= {e!r} at element {i} of {s!r} is not shown ({_short(d)} >= 0)"
            return True, ""
        raise ValueError(f"unknown fact {kind!r}")

    def _domain_diff(self, lc, rc, sub, env):
        """Domain conditions needed by one side only (after dropping those that always hold)."""
        given = set()
        for w in self.rule.when:
            if w.op == "NonZero":
                given |= _split_cond(("nonzero", env.ev(w.args[0]).xreplace(sub)))

        def norm(conds):
            out = set()
            for c in conds:
                for k, x in _split_cond((c[0], c[1].xreplace(sub))):
                    if (k, x) in given or _holds(k, x):
                        continue
                    out.add((k, x))
            return out

        L, R = norm(lc), norm(rc)
        return sorted(L - R, key=str), sorted(R - L, key=str)

    # -- random search -----------------------------------------------------------------------
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
        """Points on the zero set of domain conditions x != 0 (random search never hits them)."""
        pts = []
        for g in goals:
            if g[0] != "eq":
                continue
            bl, br = SympyBackend(), SympyBackend()
            env.ev(g[1], 0, bl), env.ev(g[2], 0, br)
            for k, x in {c for c in bl.conditions + br.conditions}:
                if k != "nonzero":
                    continue
                x = x.xreplace(sub)
                if sp.count_ops(x) > 40:
                    continue
                for z in sorted((s for s in x.free_symbols if decide.is_plain(s)), key=lambda s: s.name)[:2]:
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


# ============================================================================
# helpers
# ============================================================================

def _split_cond(c):
    """Normalise a domain condition: x*y != 0 -> x != 0, y != 0; numeric factors dropped."""
    k, x = c
    if k == "nonzero":
        x = sp.factor(x) if sp.count_ops(x) < 30 else x
        parts = x.args if x.is_Mul else (x,)
        out = set()
        for p in parts:
            if p.is_Pow and p.exp.is_positive:
                p = p.base
            if not p.is_number:
                out.add(("nonzero", p))
            elif p == 0:
                out.add(("nonzero", p))
        return out
    return {(k, x)}


def _holds(k, x) -> bool:
    if k == "pos":
        return bool(x.is_positive)
    if k == "nonneg":
        return bool(x.is_nonnegative)
    return bool(x.is_nonzero)


def _cond_str(c) -> str:
    k, x = c
    return f"{x} {dict(pos='>', nonneg='>=', nonzero='!=')[k]} 0"


def _tol(a, b):
    return mpmath.mpf(10) ** -25 * max(mpmath.mpf(1), abs(a), abs(b))


def _num(v) -> str:
    return mpmath.nstr(v, 8) if not isinstance(v, Exception) else str(v)


def _short(e, n=160) -> str:
    s = str(e)
    return s if len(s) <= n else s[:n] + "..."


def _fmt_point(p: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in p.items()) + "}"


def _hint(rule: Rule) -> str:
    what = "the right-hand side" if rule.kind == "rewrite" else "the concluded fact"
    return (f". The rule is unsound as stated: fix {what}, or add the side condition it needs "
            "(inv(k) for a term that must not depend on the reduced element, nonzero(b), le(a, b), ub(m, e, s))")
