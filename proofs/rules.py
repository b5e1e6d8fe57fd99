"""Soundness proofs of rewrite and analysis rules, for blocks of every size.

``prove_rule(rule)`` decides, for one ``Rule`` of ``acefuse.rules``:

* a **rewrite** ``lhs => rhs`` (applied in an e-graph, so read as the equation
  ``lhs = rhs``): under the side conditions, ``lhs - rhs`` is 0, and both sides
  are defined in the same places (``log``, ``sqrt``, ``rsqrt`` and ``/`` are
  partial: a domain condition of one side must follow from the side conditions
  and the other side's domain -- decided semantically, not by comparing text);
* an **analysis** rule ``lhs |- facts``: every concluded fact follows from the
  premises (``Inv``: the value does not depend on the reduced element;
  ``NonZero``: != 0; ``Le(a, b)``: ``b - a >= 0``; ``UB(m, e, s)``: ``m >= e_i``
  for every element ``i`` of ``s``, i.e. ``m >= max_s e``).

**What "proved" means.** The proof holds for blocks of *every* size: block
variables are arbitrary blocks, reductions over them are block aggregates
(free symbols), and laws that relate aggregates are proved by induction over
the block (base ``{e}``, step ``s u {e}``). The class of rules this decides,
and the disjointness premise, are stated in induction.py. A rule outside the
class, or one sympy cannot decide, is "unproved" (refused by default) -- unless
the 50-digit random search on concrete blocks of sizes 1 to 5 (search.py) finds
a counterexample: "refuted".

Side conditions become sympy facts: ``NonZero(v)`` makes ``v`` a non-zero
symbol; ``Le(a, b)`` substitutes ``b := a + g`` (``g >= 0``); ``UB(m, e, s)``
substitutes ``max_s e := m - g``. ``pos(t)`` of the DSL is ``Le(0, t)`` and
``NonZero(t)``. Max and min are decided by case splits (decide.py).

**Float safety** is derived, not declared: floatcheck.py evaluates each rule in
float32 on adversarial values against float64 and sets
``ProofResult.float_unsafe`` (the reason, "" when no bad point was found) and
``float_kind`` ("range": inf/NaN/underflow where the other side is finite;
"rounding": one side loses many more bits). ``float_note`` says when the
rule's declared tag disagrees with the derived one.

Results are cached in-process and on disk (cache.py), keyed by a hash of the
checker's own source and the rule, and authenticated with an HMAC.
"""
from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, asdict, fields

import sympy as sp

from acefuse.rewrite.terms import substitute
from acefuse.rules.base import Rule, SELF
from acefuse.proofs import decide, order, cache as _cache
from acefuse.proofs.cache import cache_path, checker_hash
from acefuse.proofs.semantics import SympyBackend
from acefuse.proofs.induction import (SymbolicProver, SymEnv, Unsupported, OMEGA, ALL_SIZES,
                                      disjointness_problem, block_rewrite)
from acefuse.proofs.search import Refuter
from acefuse.proofs.floatcheck import derive as derive_float

CHECKER_VERSION = "acefuse-proofs-2"


@dataclass
class ProofResult:
    """The outcome of proving one rule.

    status: "proved" (for every block size, see ``scope``), "refuted" (a
    counterexample exists), "unproved" (outside what the checker decides, or
    undecided, and no counterexample found).
    method: how (``sympy identity``, ``sympy with block aggregates``, ``induction on |s| ...``).
    scope: what the proof covers (``for all block sizes``; ``no blocks``).
    float_unsafe / float_kind: the *derived* float-safety tag (floatcheck.py).
    float_note: non-empty when the rule's declared ``float_unsafe`` disagrees.
    """

    name: str
    theory: str
    status: str
    method: str
    counterexample: dict | None = None
    seconds: float = 0.0
    detail: str = ""
    cached: bool = False
    scope: str = ""
    float_unsafe: str = ""
    float_kind: str = ""
    float_note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "proved"

    @property
    def float_safe(self) -> bool:
        return not self.float_unsafe

    def summary(self) -> str:
        s = f"{self.name} [{self.theory}]: {self.status}"
        if self.status == "proved" and self.scope:
            s += f" ({self.method}; {self.scope})"
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
        lines.append("Fix the rule (or state the side condition it needs: inv(k), nonzero(b), pos(a), le(a, b), "
                     "ub(m, e, s)); check it with `acefuse prove my_rules.py`. For an experiment you may load it "
                     "anyway with allow_unproved=True.")
        super().__init__("\n".join(lines))


# ============================================================================
# public API
# ============================================================================

def prove_rule(rule: Rule, use_cache: bool = True) -> ProofResult:
    """Prove one rule (cached by the checker's source and the rule); see the module docstring."""
    key = rule_key(rule)
    if use_cache:
        hit = _cache.get(key)
        if hit is not None:
            try:
                res = ProofResult(**{f.name: hit[f.name] for f in fields(ProofResult) if f.name in hit})
                return _with_identity(res, rule, cached=True)
            except (TypeError, KeyError):
                pass
    t0 = time.perf_counter()
    try:
        res = _Prover(rule).run()
    except Exception as exc:  # a malformed rule: say so instead of crashing the loader
        res = ProofResult(rule.name, rule.theory, "unproved", "error", None, 0.0,
                          f"the checker could not evaluate this rule: {type(exc).__name__}: {exc}")
    _float_tag(rule, res)
    res.seconds = time.perf_counter() - t0
    if use_cache:
        d = asdict(res)
        d["cached"] = False
        _cache.put(key, d)
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
    """Cache key: the checker's source hash, the rule's egglog text and its declared float tag."""
    text = "\n".join((CHECKER_VERSION, checker_hash(), rule.egglog("r"), "float_unsafe=" + rule.float_unsafe))
    return hashlib.sha256(text.encode()).hexdigest()


def clear_memory_cache():
    """Forget in-process results (the disk cache is re-read on next use)."""
    _cache.clear()


def save_cache():
    """Merge the in-process results into the disk cache (atomic replace; errors ignored)."""
    _cache.save()


def _with_identity(res: ProofResult, rule: Rule, cached: bool) -> ProofResult:
    res.name, res.theory, res.cached = rule.name, rule.theory, cached
    return res


def _float_tag(rule: Rule, res: ProofResult):
    """Derive the float-safety tag and compare it with the declared one."""
    try:
        v = derive_float(rule)
    except Exception as exc:  # pragma: no cover - the float check must never crash the loader
        res.float_unsafe, res.float_kind = f"the float check failed ({type(exc).__name__}: {exc})", "range"
    else:
        res.float_unsafe, res.float_kind = v.unsafe, v.kind
    declared = bool(rule.float_unsafe)
    if declared and not res.float_unsafe:
        res.float_note = ("declared float_unsafe, but no float32 counterexample was found among the "
                          "adversarial points (kept as declared)")
        res.float_unsafe, res.float_kind = rule.float_unsafe, "declared"
    elif res.float_unsafe and not declared:
        res.float_note = f"declared float-safe, but derived unsafe ({res.float_kind}): {res.float_unsafe}"


# ============================================================================
# the prover
# ============================================================================

class _Prover:
    def __init__(self, rule: Rule):
        self.rule = rule
        self.facts = [substitute(f, {SELF: rule.lhs}) for f in rule.then]
        self.inv = {w.args[0].args[0] for w in rule.when if w.op == "Inv" and w.args[0].op == "?"}
        self.nonzero = {w.args[0].args[0] for w in rule.when if w.op == "NonZero" and w.args[0].op == "?"}
        self.has_blocks = any(sub.op in ("Sum", "RMax", "RMin", "Cnt", "St", "UB") or
                              (sub.op == "?" and sub.args[1] == "Blk")
                              for t in [rule.lhs] + ([rule.rhs] if rule.rhs is not None else [])
                              + list(rule.when) + self.facts for sub in t.walk())

    def _goals(self):
        r = self.rule
        if r.kind == "rewrite":
            return [("eq", r.lhs, r.rhs)]
        return [(f.op, *f.args) for f in self.facts]

    def run(self) -> ProofResult:
        r = self.rule
        scope = ALL_SIZES if self.has_blocks else "no blocks (an elementwise identity)"
        if block_rewrite(r):
            return self._unproved("outside the decided class", "a rewrite between blocks (sort Blk): the checker "
                                  "decides equations between real-valued terms only")
        problem = disjointness_problem(r, self.facts)
        notes = []
        if not problem and order.applies(r):
            # a selection rule (where, comparisons, min/max): decided by order types (proofs/order.py)
            try:
                status, detail, point = order.decide(r)
            except order.OutsideClass:
                status = None
            if status == "proved":
                return ProofResult(r.name, r.theory, "proved", order.METHOD, None, 0.0, detail, scope=scope)
            if status == "refuted":
                return ProofResult(r.name, r.theory, "refuted", order.METHOD, point, 0.0,
                                   f"the sides differ on a block of one element: {detail}" + _hint(r))
        if not problem:
            try:
                sp_ = SymbolicProver(r, self.facts, self._premises, self._goal)
                ok, how, why, notes = sp_.run()
            except Unsupported as exc:
                ok, how, why = False, "", f"outside the decided class: {exc}"
            if ok:
                method = "sympy identity" if not self.has_blocks else \
                    ("sympy, block aggregates as free symbols" if how == "aggregates" else "sympy, " + how)
                detail = f"{r.kind} proved" + (f" (side conditions not used: {', '.join(notes)})" if notes else "")
                return ProofResult(r.name, r.theory, "proved", method, None, 0.0, detail, scope=scope)
        # not proved: search for a counterexample at 50 digits on concrete blocks
        # the seed depends on the rule only (not on the checker's source): reproducible points
        seed = int(hashlib.sha256(r.egglog("r").encode()).hexdigest()[:12], 16)
        cex = Refuter(r, self.facts, seed).run(self._goals())
        if cex is not None:
            point, why2 = cex
            return ProofResult(r.name, r.theory, "refuted", "mpmath random search (50 digits), blocks of sizes 1-5",
                               point, 0.0, why2 + _hint(r))
        if problem:
            return self._unproved("disjointness not established", problem)
        how = ("Neither block aggregates nor induction over the block decide it, and a 50-digit random search "
               "on blocks of sizes 1 to 5 found no counterexample.") if self.has_blocks else \
            "sympy does not decide it, and a 50-digit random search found no counterexample."
        detail = (f"not proved{' for all block sizes' if self.has_blocks else ''}: {why}. {how} Simplify the rule, split it into smaller steps, "
                  f"or state the side condition it relies on.")
        if notes:
            detail += " (side conditions not used by the checker: " + ", ".join(notes) + ")"
        return self._unproved("sympy (aggregates, induction) + mpmath random search", detail)

    def _unproved(self, method, detail):
        r = self.rule
        return ProofResult(r.name, r.theory, "unproved", method, None, 0.0, detail)

    # -- premises -> substitution ----------------------------------------------------
    def _premises(self, env: SymEnv):
        """Turn Le/UB side conditions into substitutions by fresh >= 0 gaps (decide.premises)."""
        return decide.premises(self.rule.when, env, self.nonzero, self._ub_premise, self._solve_premise)

    def _solve_premise(self, sub, d) -> bool:
        """``d >= 0``: solve for a symbol it is linear in (an aggregate or a plain symbol)."""
        d = sp.expand(d.xreplace(sub))
        for z in sorted(d.free_symbols, key=str):
            if not (z.is_real and z.is_positive is None and z.is_nonnegative is None):
                continue
            c = sp.diff(d, z)
            if c.is_number and c != 0:
                rest = sp.expand(d - c * z)
                if z not in rest.free_symbols:
                    return decide.compose(sub, z, (decide.gap() - rest) / c)
        return False

    def _ub_premise(self, env: SymEnv, sub, m, e, s) -> bool:
        vm = env.ev(m)
        blk = env.block(s)
        items = []
        if blk.atoms:
            items.append(env.aggregate("RMax", blk.atoms, e, SympyBackend()))
        for i in blk.elems:
            if e.op == "?" and e.args[0] not in self.inv:
                items.append(env.leaf(e, i))
            else:
                items = None
                break
        if items is not None and not any(x in vm.xreplace(sub).free_symbols for x in items) \
                and all(x not in sub for x in items):
            trial = dict(sub)
            if all(decide.compose(trial, x, vm - decide.gap()) for x in items):
                sub.clear()
                sub.update(trial)
                return True
        if m.op == "?":
            vals = ([env.aggregate("RMax", blk.atoms, e, SympyBackend())] if blk.atoms else []) + \
                [env.ev(e, i) for i in blk.elems]
            trial = dict(sub)
            if decide.compose(trial, env.leaf(m, 0), sp.Max(*vals) + decide.gap()):
                sub.clear()
                sub.update(trial)
                return True
        return False

    # -- goals -----------------------------------------------------------------------------
    def _goal(self, env: SymEnv, goal, sub, _unused=None):
        kind = goal[0]
        if kind == "eq":
            bl, br = SympyBackend(), SympyBackend()
            lhs, rhs = env.ev(goal[1], 0, bl), env.ev(goal[2], 0, br)
            diff = (lhs - rhs).xreplace(sub)
            if decide.is_zero(diff) is None:
                return False, f"lhs - rhs = {_short(sp.simplify(diff) if sp.count_ops(diff) < 60 else diff)} is not shown to be 0"
            only_l, only_r = self._domain_diff(env, bl.conditions, br.conditions, sub)
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
            blk = env.block(s)
            items = ([env.aggregate("RMax", blk.atoms, e, SympyBackend())] if blk.atoms else []) + \
                [env.ev(e, i) for i in blk.elems]
            for v in items:
                d = (vm - v).xreplace(sub)
                if not decide.is_nonneg(d):
                    return False, f"{m!r} >= {e!r} on every element of {s!r} is not shown ({_short(d)} >= 0)"
            return True, ""
        raise Unsupported(f"unknown fact {kind!r}")

    def _domain_diff(self, env, lc, rc, sub):
        """Domain conditions of one side not implied by the premises and the other side's domain."""
        given = []
        for w in self.rule.when:
            if w.op == "NonZero":
                given.append(("nonzero", env.ev(w.args[0])))
            elif w.op == "Le":
                given.append(("nonneg", env.ev(w.args[1]) - env.ev(w.args[0])))

        def norm(conds):
            out = []
            for c in conds:
                for k, x in _split_cond((c[0], c[1].xreplace(sub))):
                    if (k, x) not in out and not _holds(k, x):
                        out.append((k, x))
            return out

        L, R = norm(lc), norm(rc)
        G = [(k, x.xreplace(sub)) for k, x in given]
        only_l = [c for c in L if c not in R and not _implied(c, R + G)]
        only_r = [c for c in R if c not in L and not _implied(c, L + G)]
        return sorted(only_l, key=str), sorted(only_r, key=str)


def _implied(c, assumptions) -> bool:
    """Whether condition ``c`` follows from ``assumptions`` (each solved for one symbol)."""
    sub: dict = {}
    for k, x in sorted(assumptions, key=lambda a: (sp.count_ops(a[1]), str(a[1]))):
        x = sp.expand(x.xreplace(sub))
        for z in sorted(x.free_symbols, key=str):
            if not decide.is_plain(z):
                continue
            co = sp.diff(x, z)
            if z in co.free_symbols or not (co.is_nonzero or (not co.is_number and decide.is_nonzero(co))):
                continue
            rest = sp.expand(x - co * z)
            if z in rest.free_symbols:
                continue
            w = decide.gap(positive=True) if k == "pos" else decide.gap() if k == "nonneg" else \
                sp.Symbol(f"_w{next(decide._gap_counter)}", real=True, nonzero=True)
            if decide.compose(sub, z, (w - rest) / co):
                break
    k, x = c
    x = x.xreplace(sub)
    if k == "nonzero":
        return bool(decide.is_nonzero(x))
    if k == "nonneg":
        return bool(decide.is_nonneg(x))
    return bool(decide.is_nonneg(x)) and bool(decide.is_nonzero(x))


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


def _short(e, n=160) -> str:
    s = str(e)
    return s if len(s) <= n else s[:n] + "..."


def _fmt_point(p: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in p.items()) + "}"


def _hint(rule: Rule) -> str:
    what = "the right-hand side" if rule.kind == "rewrite" else "the concluded fact"
    return (f". The rule is unsound as stated: fix {what}, or add the side condition it needs "
            "(inv(k) for a term that must not depend on the reduced element, nonzero(b), le(a, b), ub(m, e, s))")
