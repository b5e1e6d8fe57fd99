"""Proofs of rules for blocks of *every* size: block aggregates and induction.

The class of rules this module decides (anything else is left "unproved"):

* the terms are built from the operators of ``semantics._OPS`` (field operations,
  exp, log, sqrt, rsqrt, abs, tanh, max2, min2), leaves (pattern variables, Elm,
  Par, St, Num), ``Cnt(b)`` and reductions ``Sum/RMax/RMin(b, body)``;
* a block ``b`` is a block variable, ``BA``, ``BB``, ``BJ`` or ``BU(x, y)`` of
  blocks whose *disjointness* is established (see ``disjointness_problem``);
  every block is non-empty (the encoding only builds non-empty blocks);
* side conditions are ``Inv``, ``NonZero``, ``Le``, ``UB`` facts (``pos(t)`` of
  the DSL is ``Le(0, t)`` and ``NonZero(t)``).

**The model.** A block variable ``s`` is an *arbitrary* non-empty block. A
reduction over an arbitrary block is a *block aggregate*: a fresh real symbol
``sum[s](body)``, ``max[s](body)``, keyed by the operator, the set of atomic blocks
and the (expanded) body evaluated at a generic element ``@s`` of the block;
``Cnt(s)`` is a positive integer symbol ``cnt[s]``; ``St(q, s)`` an opaque symbol.
Equal keys are equal values; distinct keys are treated as independent symbols.
Since real blocks give the aggregates *particular* values, an identity that
sympy shows with the aggregates as free symbols holds for all block sizes
(method ``aggregates``). Block variables that are not known disjoint get
independent aggregates, so such a proof also covers blocks that are equal or
overlap.

**Induction** (method ``induction``), when the aggregates alone do not suffice
(``sum_s (f + g) = sum_s f + sum_s g``): on one block variable ``s``, proving
``P({e})`` (base; recursively by induction on another block variable if
needed) and ``P(s) => P(s u {e})`` for a fresh element ``e`` (step). The only
semantic law used is the unfolding of a reduction over ``b u {e}`` (``e`` not in
``b``): ``R_{b u {e}} body = R_b body (+|max|min) body[e]`` and
``Cnt(b u {e}) = Cnt(b) + 1``. In the step, the induction hypothesis
``lhs(s) = rhs(s)`` is solved for one symbol over ``s`` it contains linearly
(with a non-zero numeric coefficient) and substituted. Induction on ``s`` is
only used when every side condition either does not mention ``s`` or is
``UB(m, e, s)`` with ``m`` free of ``s`` (so the premises at ``s u {e}`` imply
those at ``s`` and the hypothesis applies). A reduction whose body contains a
reduction over the inducted block stays an opaque aggregate (sound, but such
rules are usually left unproved).

The hypothesis is used the same way for a ``Le(a, b)`` goal (``b(s) - a(s) >= 0``
solved with a fresh gap ``g >= 0``); other facts get base and step without it. The
symbol solved for may have a coefficient that is not a number when sympy shows it
positive (``Le``: dividing keeps the direction) or non-zero (an equation): ``exp(-max_s f)``.

**Linearity of sums** (method ``block aggregates, with sums linear in their
bodies``), tried last, for goals with sums: the expanded body of a sum is split
into terms ``c_j d_j`` with ``c_j`` free of the element, and
``sum_b body = sum_j c_j sum_b d_j`` (``sum_b c = c Cnt(b)``). This is the
content of the library rules sum-add, sum-factor-left and sum-invariant, each
proved by induction above; it decides identities whose body contains a
reduction over the same block (``sum_s (f - sum_s f / n)^2 = ...``). Induction is
tried with linear sums too: ``sum_s(exp(f - max_s f)) >= 1`` (``exp(f - m)`` expands
to ``exp(f) * exp(-m)``, the invariant factor leaves the sum, and hypothesis and step
then speak of the same aggregate ``sum_s(exp(f))``).

Pattern variables without ``Inv`` are arbitrary *families* of values (one symbol
per element: ``f[e1]``, ``f[@s]``); the statement proved is "for all families,
all invariant values and all blocks", so the actual matches are instances.

**Disjointness.** ``BU(x, y)`` in the e-graph is only ever built from disjoint
blocks: the encoding builds ``BU(BA, BB)``, and a rule may only introduce
``U(x, y)`` (in its rhs or its concluded facts) when every atomic block of ``x``
is known disjoint from every atomic block of ``y``: both occur on different
sides of a ``U`` in the rule's lhs or side conditions (which only match blocks
present in the e-graph), or they are ``BA`` and ``BB``. Rules that rewrite
blocks themselves (sort ``Blk``) are outside the class.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import sympy as sp

from acefuse.rewrite.terms import Term, REDUCTIONS
from acefuse.rules.base import Rule
from acefuse.proofs import decide
from acefuse.proofs.semantics import SympyBackend, is_leaf, _OPS

OMEGA = -1          # a second ambient element, for proving Inv facts
MAX_DEPTH = 3       # nested inductions (one per block variable)

ALL_SIZES = "for all block sizes"
LINEAR = "block aggregates, with sums linear in their bodies"


@dataclass(frozen=True)
class SymBlock:
    """A block: a union of atomic arbitrary blocks plus explicit fresh elements."""

    atoms: frozenset
    elems: tuple = ()

    def key(self) -> str:
        parts = sorted(self.atoms) + ["{" + e + "}" for e in self.elems]
        return "+".join(parts)


class Unsupported(ValueError):
    """The rule is outside the class this module decides."""


# ============================================================================
# structure: block variables and disjointness
# ============================================================================

def _atoms(b: Term) -> set:
    if b.op == "?":
        return {b.args[0]}
    if b.op in ("BA", "BB", "BJ"):
        return {b.op[1]}
    if b.op == "BU":
        return _atoms(b.args[0]) | _atoms(b.args[1])
    if b.op == "Ax":
        return {"Ax:" + str(b.args[0])}
    raise Unsupported(f"not a block: {b!r}")


def _bstr(b: Term) -> str:
    if b.op == "?":
        return b.args[0]
    if b.op == "BU":
        return f"U({_bstr(b.args[0])}, {_bstr(b.args[1])})"
    return b.op


def _unions(t: Term):
    for sub in t.walk():
        if sub.op == "BU":
            yield sub


def disjointness_problem(rule: Rule, facts) -> str:
    """Why the rule may build a union of blocks that are not known disjoint ('' if none)."""
    known = {frozenset(("A", "B"))}
    for t in [rule.lhs] + list(rule.when):
        for u in _unions(t):
            x, y = _atoms(u.args[0]), _atoms(u.args[1])
            if x & y:
                return f"the pattern {_bstr(u)} names block {sorted(x & y)[0]} on both sides of a union"
            known |= {frozenset((p, q)) for p in x for q in y}
    produced = ([rule.rhs] if rule.rhs is not None else []) + list(facts)
    for t in produced:
        for u in _unions(t):
            x, y = _atoms(u.args[0]), _atoms(u.args[1])
            bad = sorted((p, q) for p in x for q in y if frozenset((p, q)) not in known)
            if bad:
                p, q = bad[0]
                return (f"disjointness: the rule builds the union {_bstr(u)}, but nothing in its lhs shows that "
                        f"blocks {p} and {q} are disjoint (the e-graph can bind both to the same block). "
                        f"Match the union in the lhs instead (e.g. `U(s1, s2)`), so the rule only applies to "
                        f"disjoint blocks")
    return ""


def block_rewrite(rule: Rule) -> bool:
    """True for a rewrite between blocks (sort Blk)."""
    if rule.rhs is None:
        return False
    t = rule.lhs
    return t.op in ("BA", "BB", "BJ", "BU", "Ax") or (t.op == "?" and t.args[1] == "Blk")


# ============================================================================
# the symbolic environment
# ============================================================================

class SymEnv:
    """Evaluates terms to sympy with block aggregates. ``binding`` maps block
    variables to SymBlocks (default: the atomic arbitrary block)."""

    def __init__(self, symbols: dict, inv: set, nonzero: set, binding: dict | None = None,
                 linear: bool = False):
        self.symbols = symbols          # shared between the cases of one rule
        self.inv, self.nonzero = inv, nonzero
        self.binding = binding or {}
        self.linear = linear            # sums are linear in their bodies (see SymbolicProver.run)
        self.over: dict = {}            # aggregate / count / state symbol -> its atoms
        self.elem_syms: dict = {}       # bound element -> symbols of values at that element

    # -- blocks -------------------------------------------------------------------
    def block(self, b: Term) -> SymBlock:
        if b.op == "?":
            return self.binding.get(b.args[0], SymBlock(frozenset((b.args[0],))))
        if b.op in ("BA", "BB", "BJ"):
            return SymBlock(frozenset((b.op[1],)))
        if b.op == "BU":
            x, y = self.block(b.args[0]), self.block(b.args[1])
            if (x.atoms & y.atoms) or (set(x.elems) & set(y.elems)):
                raise Unsupported(f"union of overlapping blocks {b!r}")
            return SymBlock(x.atoms | y.atoms, x.elems + y.elems)
        raise Unsupported(f"not a block: {b!r}")

    # -- symbols ------------------------------------------------------------------
    def sym(self, name: str, **assumptions) -> sp.Symbol:
        s = self.symbols.get(name)
        if s is None:
            s = sp.Symbol(name, real=True, **assumptions)
            self.symbols[name] = s
        return s

    def leaf(self, t: Term, elem):
        v = self._leaf(t, elem)
        if isinstance(elem, str) and elem.startswith("@"):
            self.elem_syms.setdefault(elem, set()).add(v)
        return v

    def _leaf(self, t: Term, elem):
        op = t.op
        if op == "?":
            name = t.args[0]
            nz = {"nonzero": True} if name in self.nonzero else {}
            if name in self.inv:
                return self.sym(name, **nz)
            return self.sym(name + _at(elem), **nz)
        if op == "Num":
            return self.sym(t.args[0].args[0])
        name = t.args[0]
        if op == "Elm":
            return self.sym(f"Elm({name.lstrip('?')})" + _at(elem))
        if op == "Par":
            return self.sym(f"Par({name.lstrip('?')})")
        if op == "St":
            blk = self.block(t.args[1])
            s = self.sym(f"St({name.lstrip('?')},{blk.key()})")
            self.over[s] = blk.atoms
            return s
        raise Unsupported(f"unexpected leaf {t!r}")

    def count(self, atoms) -> sp.Symbol:
        s = self.sym("cnt[" + "+".join(sorted(atoms)) + "]", integer=True, positive=True)
        self.over[s] = frozenset(atoms)
        return s

    def aggregate(self, op: str, atoms, body: Term, be) -> sp.Symbol:
        bound = "@" + "+".join(sorted(atoms))
        inner = SympyBackend()
        val = self.ev(body, bound, inner)
        be.conditions.extend(inner.conditions)   # "for every element of the block"
        try:
            val = sp.expand(val)
        except Exception:
            pass
        opname = {"Sum": "sum", "RMax": "max", "RMin": "min"}[op]
        if op == "Sum" and self.linear:
            return self._linear_sum(atoms, val, bound)
        return self._agg_symbol(opname, atoms, val)

    def _linear_sum(self, atoms, val, bound):
        """sum_b (sum_j c_j d_j) = sum_j c_j sum_b d_j, with c_j free of the element."""
        dep = self.elem_syms.get(bound, set())
        groups: dict = {}
        for term in sp.Add.make_args(val):
            cs, ds = [], []
            for fct in sp.Mul.make_args(term):
                (ds if fct.free_symbols & dep else cs).append(fct)
            d = sp.Mul(*ds)
            groups[d] = groups.get(d, 0) + sp.Mul(*cs)
        out = sp.Integer(0)
        for d, c in groups.items():
            out += c * (self.count(atoms) if d == 1 else self._agg_symbol("sum", atoms, d))
        return out

    def _agg_symbol(self, opname, atoms, val):
        name = f"{opname}[{'+'.join(sorted(atoms))}]({val})"
        s = self.symbols.get(name)
        if s is None:
            s = sp.Symbol(name, real=True)
            self.symbols[name] = s
        self.over[s] = frozenset(atoms)
        return s

    # -- evaluation ------------------------------------------------------------------
    def ev(self, t: Term, elem=0, be=None):
        be = be if be is not None else SympyBackend()
        op = t.op
        if is_leaf(t):
            return self.leaf(t, elem)
        if op == "Num":
            return be.const(t.args[0])
        if op == "Cnt":
            blk = self.block(t.args[0])
            n = sp.Integer(len(blk.elems))
            return (self.count(blk.atoms) + n) if blk.atoms else n
        if op in REDUCTIONS:
            blk = self.block(t.args[0])
            parts = []
            if blk.atoms:
                parts.append(self.aggregate(op, blk.atoms, t.args[1], be))
            parts += [self.ev(t.args[1], e, be) for e in blk.elems]
            if not parts:
                raise Unsupported(f"reduction {t!r} over an empty block")
            return {"Sum": be.sum, "RMax": be.max, "RMin": be.min}[op](parts)
        fn = _OPS.get(op)
        if fn is None:
            raise Unsupported(f"the checker has no semantics for operator {op!r} (in {t!r})")
        return fn(be, *[self.ev(a, elem, be) for a in t.args])


def _at(elem) -> str:
    if elem == 0:
        return ""
    if elem == OMEGA:
        return "[*]"
    return f"[{elem}]"


# ============================================================================
# the prover
# ============================================================================

class SymbolicProver:
    """Proves one rule for all block sizes; ``run() -> (ok, method, why, notes)``.

    ``goal_check(env, goal, sub, be_pair) -> (ok, why)`` is supplied by the caller
    (rules.py), so that goal semantics (domains, facts) live in one place.
    """

    def __init__(self, rule: Rule, facts, premises, goal_check):
        self.rule, self.facts = rule, facts
        self.premises, self.goal_check = premises, goal_check
        self.symbols: dict = {}
        self.inv = {w.args[0].args[0] for w in rule.when if w.op == "Inv" and w.args[0].op == "?"}
        self.nonzero = {w.args[0].args[0] for w in rule.when if w.op == "NonZero" and w.args[0].op == "?"}
        names = []
        for t in [rule.lhs] + ([rule.rhs] if rule.rhs is not None else []) + list(rule.when) + list(facts):
            for sub in t.walk():
                if sub.op == "?" and sub.args[1] == "Blk" and sub.args[0] not in names:
                    names.append(sub.args[0])
        self.block_vars = names
        self._fresh = itertools.count(1)
        self._linear = False

    def env(self, binding=None) -> SymEnv:
        return SymEnv(self.symbols, self.inv, self.nonzero, binding, linear=self._linear)

    def goals(self):
        if self.rule.kind == "rewrite":
            return [("eq", self.rule.lhs, self.rule.rhs)]
        return [(f.op, *f.args) for f in self.facts]

    # ---------------------------------------------------------------------------------
    def run(self):
        ok, why, notes = self._case({}, None)
        if ok:
            return True, "aggregates", "", notes
        for s in self.block_vars:
            res = self._induct(s, {}, 1)
            if res[0]:
                return True, res[1], "", notes
        # last: a sum is linear in its body -- sum_s (c f + d g) = c sum_s f + d sum_s g for c, d
        # free of the element, and sum_s c = c Cnt(s) (what sum-add, sum-factor-left and
        # sum-invariant prove by induction); this decides e.g. the variance identity, whose body
        # contains sum_s f itself
        if any(t.op == "Sum" for g in self.goals() for x in g[1:] if isinstance(x, Term) for t in x.walk()):
            self._linear = True
            try:
                ok2, _, notes2 = self._case({}, None)
                if ok2:
                    return True, LINEAR, "", notes2
                # and induction with linear sums: sum_s(exp(f - max_s f)) >= 1 needs both (the body's
                # invariant factor exp(-max) moves out of the sum, so the hypothesis, a bound on
                # sum_s(exp(f)) * exp(-max_s f), speaks of the same aggregate as the step)
                for s in self.block_vars:
                    res = self._induct(s, {}, 1)
                    if res[0]:
                        return True, f"{res[1]}, {LINEAR}", "", notes2
            finally:
                self._linear = False
        return False, "", why, notes

    def _case(self, binding, ih):
        """Prove every goal with ``binding``; ``ih``: (IH env, IH goal diff) for eq goals."""
        env = self.env(binding)
        sub, notes = self.premises(env)
        for goal in self.goals():
            ok, why = self.goal_check(env, goal, sub, None)
            if not ok and ih is not None and goal[0] in ("eq", "Le"):
                ok = self._with_ih(env, goal, sub, ih, binding)
            if not ok:
                return False, why, notes
        return True, "", notes

    def _ih_allowed(self, s) -> bool:
        for w in self.rule.when:
            mentions = any(x.op == "?" and x.args[0] == s for x in w.walk())
            if not mentions:
                continue
            if w.op == "UB" and w.args[2] == Term("?", (s, "Blk")) and \
                    not any(x.op == "?" and x.args[0] == s for a in w.args[:2] for x in a.walk()):
                continue
            return False
        return True

    def _induct(self, s, binding, depth):
        """Induction on block variable ``s`` (the others as in ``binding``)."""
        if depth > MAX_DEPTH or not self._ih_allowed(s):
            return (False, "")
        e = f"e{next(self._fresh)}"
        base = dict(binding)
        base[s] = SymBlock(frozenset(), (e,))
        ok, _, _ = self._case(base, None)
        how_base = ""
        if not ok:
            for t in self.block_vars:
                if t != s and t not in binding:
                    r = self._induct(t, base, depth + 1)
                    if r[0]:
                        ok, how_base = True, r[1]
                        break
            if not ok:
                return (False, "")
        step = dict(binding)
        step[s] = SymBlock(frozenset((s,)), (e,))
        ok, _, _ = self._case(step, binding)
        if not ok:
            return (False, "")
        method = f"induction on |{s}| (base {s} = {{e}}" + (f", by {how_base}" if how_base else "") + \
                 f"; step {s} -> {s} u {{e}})"
        return (True, method)

    def _with_ih(self, env, goal, sub, ih_binding, binding):
        """Use the hypothesis lhs(s) = rhs(s) (``ih_binding``: s left arbitrary) in the step."""
        ih_env = self.env(ih_binding)
        try:
            if goal[0] == "eq":      # lhs(s) - rhs(s) = 0
                d_ih = (ih_env.ev(goal[1]) - ih_env.ev(goal[2])).xreplace(sub)
            else:                    # Le(a, b): b(s) - a(s) >= 0
                d_ih = (ih_env.ev(goal[2]) - ih_env.ev(goal[1])).xreplace(sub)
        except Unsupported:
            return False
        over = ih_env.over
        stepped = {v for v, blk in binding.items() if v not in ih_binding}
        cands = sorted((z for z in d_ih.free_symbols if z in over and over[z] & stepped),
                       key=lambda z: (-len(str(z)), str(z)))
        for z in cands:
            c = sp.diff(d_ih, z)
            # a numeric coefficient, or one sympy shows positive (Le: dividing by it keeps the
            # direction) or non-zero (eq), e.g. exp(-max_s f)
            if not ((c.is_number and c != 0) or (goal[0] == "eq" and decide.is_nonzero(c))
                    or (goal[0] == "Le" and c.is_positive)):
                continue
            rest = sp.expand(d_ih - c * z)
            if z in rest.free_symbols:
                continue
            sub2 = dict(sub)
            slack = 0 if goal[0] == "eq" else decide.gap()
            if not decide.compose(sub2, z, (slack - rest) / c):
                continue
            if self.goal_check(env, goal, sub2, None)[0]:
                return True
        return False
