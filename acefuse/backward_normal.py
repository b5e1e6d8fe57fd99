"""The backward's term constructors, and its normal forms against the saved forward values.

``af.backward`` (acefuse/backward.py) uses them in two places:

1. **Contractions, by the rewrite system** (``read_saved``). Each innermost reduction of a
   gradient (a sum whose body holds no reduction) goes into an e-graph with the proved
   library rules of the NORMALIZE schedule and this program's own equations
   (``saved_equations``: each forward output ``o = a / b`` equals ``P(a) * r(P(b))``; each
   savable forward sum equals its recomputation); the extractor's program cost picks the form
   with the least work per element. With ``p = exp(s - m)``, ``l = sum_j p``,
   ``S = sum_j(p * v)`` and ``o = S / l``, the adjoint of ``l`` is
   ``-sum_e(g * S * r(l) * r(l))`` (``r`` the safe reciprocal); the e-graph knows
   ``o = S * r(l)``, commutes and re-associates the product (mul-comm, mul-assoc) and factors
   the invariant ``r(l)`` out of the sum (sum-factor-right): ``sum_e(g * o) * r(l)``. That is
   FlashAttention-2's ``D_i = sum_j P_ij dP_ij = sum_e dO_ie O_ie``, a sum over the head dim
   instead of over the keys, so ``dS = P * (dP - D)``, dQ (a sum over keys) and dK, dV (sums
   over queries) have no cascade, and the backward saves only ``o`` and, per row,
   ``L = m + log(l)``: ``exp(s - m) * r(l)`` is read as ``exp(s - L)`` (3.).
   Nothing names attention: the same step reads a saved softmax sum for
   ``sum_j(exp(x - m))`` and factors invariants out of every contraction. The form is
   adopted only where it does less work per element than the derivation's.
2. **The adjoint of a max (or min)** is put in a polynomial normal form (``_Normal``); when
   it is identically 0 the max's tie-routing branch is dropped (softmax-shaped programs do not
   depend on the shift by their max). With the names above, the adjoint of ``m`` is
   ``-sum_j(p * (sum_e(g * v) * r(l) - sum_e(g * S * r(l)^2)))``. Linearity splits it; in
   the first sum, ``sum_j`` is swapped with ``sum_e`` (Fubini) and the invariant
   ``g * r(l)`` factored out, which leaves ``sum_j(p * v)``, recognised as the saved ``S``; in
   the second, the invariant ``sum_e(...)`` is factored out and ``sum_j(p)`` is the saved
   ``l``; then ``r(l)^2 * l = r(l)`` and the two monomials cancel. This step stays in Python
   for now: Fubini over two *named* axes (``sum_j sum_e f = sum_e sum_j f`` for a family ``f``
   over both) is outside the class the rule checker decides (proofs/induction.py models a
   pattern variable as a family over the innermost reduced element only, and ``Inv`` does
   not say *which* axis a term is invariant along), so it cannot be a proved library rule yet.
3. **One saved value per shifted sum** (acefuse/backward_shift.py, ``fold_outputs``):
   ``exp(b - m) * r(l)`` with ``l = sum_j(exp(b - m))``, ``m = max_j b`` both saved, is ``exp(b - L)`` with
   ``L = where(l == 0, 0, m + log(l))`` saved instead (library rules ``shifted-sum-ge-one``,
   ``pos-of-ge-one``, ``exp-div-log``; ``factor-sub-right`` and ``sum-factor-right`` bring the
   factors together). Taken only where afterwards no gradient reads ``exp(b - m)`` or ``r(l)``.

Every step of 1.-3. is recorded in ``bwd.derivation`` with the library rules it is an instance
of; ``af.fuse(bwd).explain()`` lists them (backward_shift.derivation_text). The Python laws are
applied only while the rules they cite are proved (backward_shift.laws_proved).

The laws of both (linearity, factoring an invariant, Fubini for two sums over different
axes, ``r(x)^a * x^b = r(x)^(a-b)`` for ``a > b >= 1``) are exact over the reals; reading
``o`` for ``S * r(l)`` is exact wherever the forward's ``o`` is finite. Polynomials past
``_Normal.LIMIT`` monomials are left as derived.
"""
from __future__ import annotations

import math

from acefuse.rewrite.terms import Term


RED = ("Sum", "RMax", "RMin")

# ---- smart constructors: fold x*1, x+0, 0*x (a structurally zero adjoint), --x ------------------
ZERO, ONE = Term("Num", (0.0,)), Term("Num", (1.0,))


def _val(t):
    return t.args[0] if t.op == "Num" and not isinstance(t.args[0], Term) else None


def num(v):
    return Term("Num", (float(v),))


def neg(a):
    v = _val(a)
    if v is not None:
        return num(-v)
    if a.op == "Neg":
        return a.args[0]
    return Term("Neg", (a,))


def add(a, b):
    va, vb = _val(a), _val(b)
    if va == 0:
        return b
    if vb == 0:
        return a
    if va is not None and vb is not None:
        return num(va + vb)
    if b.op == "Neg":
        return sub(a, b.args[0])
    if a.op == "Neg":
        return sub(b, a.args[0])
    if a == b:
        return mul(num(2.0), a)
    return Term("Add", (a, b))


def sub(a, b):
    if _val(b) == 0:
        return a
    if _val(a) == 0:
        return neg(b)
    if b.op == "Neg":
        return add(a, b.args[0])
    return Term("Sub", (a, b))


def mul(a, b):
    va, vb = _val(a), _val(b)
    if va == 0 or vb == 0:
        return ZERO
    if va == 1:
        return b
    if vb == 1:
        return a
    if va is not None and vb is not None:
        return num(va * vb)
    if va == -1:
        return neg(b)
    if vb == -1:
        return neg(a)
    if a.op == "Neg":
        return neg(mul(a.args[0], b))
    if b.op == "Neg":
        return neg(mul(a, b.args[0]))
    return Term("Mul", (a, b))


def div(a, b):
    if _val(a) == 0:
        return ZERO
    if _val(b) == 1:
        return a
    if a.op == "Neg":
        return neg(div(a.args[0], b))
    return Term("Div", (a, b))


def where(c, a, b):
    if a == b:
        return a
    return Term("Where", (c, a, b))


def rsum(axis, t):
    if _val(t) == 0:
        return ZERO
    if t.op == "Neg":
        return neg(rsum(axis, t.args[0]))
    return Term("Sum", (Term("Ax", (axis,)), t))


def _has_red(t: Term, axis: str) -> bool:
    return any(s.op in RED and s.args[0].op == "Ax" and s.args[0].args[0] == axis for s in t.walk())


def _cmp(op, a, b):
    return Term(op, (a, b))


# ---- normal form of backward terms against the saved values ---------------------------------------
class _Normal:
    """Sums of products over named axes, in a normal form that reads saved values.

    A polynomial is ``{monomial: coefficient}``; a monomial is a sorted tuple of
    ``(atom, exponent)``; an atom is any term that is not ``+ - * neg`` or a constant. A
    reduction ``sum_a(body)`` is normalised monomial by monomial with these laws, each
    general algebra over the reals (nothing here knows a workload):

    - linearity: ``sum_a(f + g) = sum_a(f) + sum_a(g)``, ``sum_a(c * f) = c * sum_a(f)``;
    - factor an invariant: ``sum_a(k * f) = k * sum_a(f)`` when ``k`` does not range over
      ``a``; ``sum_a(k) = k * size(a)``;
    - swap sums (Fubini): ``sum_a(f * sum_e(g)) = sum_e(sum_a(f * g))`` when ``f`` does not
      range over ``e``, taken only when the new inner ``sum_a`` becomes a saved value (the
      extraction criterion: read what the forward already wrote instead of reducing again);
    - recognise a saved value: a reduction equal (in this normal form) to the backward's
      recomputation of a saved forward reduction is that saved input;
    - the safe reciprocal ``r(x) = where(x == 0, 0, 1 / x)``: ``r(x)^a * x^b = r(x)^(a-b)``
      for ``a > b >= 1`` (both sides are 0 where ``x`` is 0);
    - shift invariance: ``r(l)^a * l^a = 1`` when ``l = sum_a(exp(b - max_a b))`` (the library
      rules ``shifted-sum-ge-one``, ``pos-of-ge-one`` and ``div-mul-cancel``, rules/shifted.py; see
      ``shifted_sum``): the adjoint of the max in ``m + log(l)`` (logsumexp, log-softmax,
      cross-entropy) is ``g * (1 - l * r(l)) = 0``;

    Forward outputs are recognised in contractions by the rewrite system (``read_saved``).
    """

    def __init__(self, d):   # d: the backward.py _Deriv it serves
        self.d = d
        self.memo: dict = {}
        self._cands = None
        self._outs = None

    # -- polynomials ----------------------------------------------------------------------------
    @staticmethod
    def key(t: Term) -> str:
        return t.sexpr()

    def mono(self, factors: dict) -> tuple:
        return tuple(sorted(((a, e) for a, e in factors.items() if e), key=lambda x: self.key(x[0])))

    LIMIT = 256   # monomials per polynomial; beyond it the normal form is not attempted

    @staticmethod
    def padd(p: dict, q: dict, c: float = 1.0) -> dict:
        out = dict(p)
        for m, v in q.items():
            out[m] = out.get(m, 0.0) + c * v
            if out[m] == 0:
                del out[m]
        if len(out) > _Normal.LIMIT:
            raise _TooBig()
        return out

    def pmul(self, p: dict, q: dict) -> dict:
        out: dict = {}
        for m1, c1 in p.items():
            for m2, c2 in q.items():
                f = dict(m1)
                for a, e in m2:
                    f[a] = f.get(a, 0) + e
                m = self.canon(f)
                out = self.padd(out, {m: c1 * c2})
        return out

    def canon(self, f: dict) -> tuple:
        """The safe-reciprocal law on a monomial's factors."""
        f = dict(f)
        for a in list(f):
            x = _recip_of(a)
            if x is not None and x in f and a in f and f[a] > f[x] >= 1:
                f[a] -= f[x]
                del f[x]
            elif x is not None and x in f and a in f and f[a] == f[x] >= 1 and self.shifted_sum(x):
                del f[a], f[x]
        return self.mono(f)

    def forward_of(self, t: Term) -> Term:
        """The forward term a saved input of the backward stands for (else ``t``)."""
        if t.op == "In":
            for ft, name in self.d.saved.items():
                if name == t.args[0]:
                    return ft
        return t

    def shifted_sum(self, x: Term) -> bool:
        """``x`` is ``sum_a(exp(b - max_a(b)))``: at least 1 wherever the max is finite (the
        library rule ``shifted-sum-ge-one``, proved for every block size: the element that attains
        the max contributes ``exp(0) = 1``), so ``x > 0`` (``pos-of-ge-one``), ``r(x) = 1 / x`` and
        ``r(x) * x = 1`` (``div-mul-cancel``). It is 0 only in a fully masked row (``max = -inf``),
        where the backward's convention is gradient 0: the law's ``1`` drops an adjoint that
        reaches the inputs only through such rows. Used only while those rules are proved."""
        from acefuse.backward_shift import laws_proved, SHIFT_LAW
        if not laws_proved(SHIFT_LAW):
            return False
        t = self.forward_of(x)
        if t.op != "Sum" or t.args[0].op != "Ax" or t.args[1].op != "Exp":
            return False
        e = t.args[1].args[0]
        if e.op != "Sub":
            return False
        mx = self.forward_of(e.args[1])
        return mx.op == "RMax" and mx.args[0] == t.args[0] and self.forward_of(mx.args[1]) == self.forward_of(e.args[0])

    def atom(self, t: Term) -> dict:
        return {self.mono({t: 1}): 1.0}

    # -- terms -> polynomials -----------------------------------------------------------------
    def poly(self, t: Term) -> dict:
        if t in self.memo:
            return self.memo[t]
        op = t.op
        v = _val(t)
        if v is not None:
            r = {(): v} if v != 0 else {}
        elif op == "Add":
            r = self.padd(self.poly(t.args[0]), self.poly(t.args[1]))
        elif op == "Sub":
            r = self.padd(self.poly(t.args[0]), self.poly(t.args[1]), -1.0)
        elif op == "Neg":
            r = self.padd({}, self.poly(t.args[0]), -1.0)
        elif op == "Mul":
            r = self.pmul(self.poly(t.args[0]), self.poly(t.args[1]))
        elif op == "Sum" and t.args[0].op == "Ax":
            r = self.psum(t.args[0].args[0], self.poly(t.args[1]))
        else:
            r = self.atom(t)
        self.memo[t] = r
        return r

    def psum(self, ax: str, body: dict) -> dict:
        axes_of = self.d.axes_of
        out: dict = {}
        for m, c in body.items():
            inv = {a: e for a, e in m if ax not in axes_of(a)}
            var = {a: e for a, e in m if ax in axes_of(a)}
            if not var:
                inv[Term("Size", (ax,))] = inv.get(Term("Size", (ax,)), 0) + 1
                out = self.padd(out, {self.canon(inv): c})
                continue
            res = self.swap(ax, var)
            if res is None:
                st = Term("Sum", (Term("Ax", (ax,)), self.term({self.mono(var): 1.0})))
                res = self.recognise(st)
            out = self.padd(out, self.pmul({self.canon(inv): c}, res))
        return out

    def swap(self, ax: str, var: dict):
        """``sum_ax(f * sum_e(g))`` as ``sum_e(sum_ax(f * g))`` when the inner sum is saved."""
        axes_of = self.d.axes_of
        for a, e in var.items():
            if e != 1 or a.op != "Sum" or a.args[0].op != "Ax" or a.args[0].args[0] == ax:
                continue
            ea = a.args[0].args[0]
            rest = {b: k for b, k in var.items() if b != a}
            if any(ea in axes_of(b) for b in rest):
                continue
            inner = self.psum(ax, self.pmul({self.mono(rest): 1.0}, self.poly(a.args[1])))
            if any(_has_red(self.term({m: 1.0}), ax) for m in inner):
                continue
            return self.psum(ea, inner)
        return None

    def candidates(self) -> dict:
        """Normal form of the backward's recomputation of each savable forward sum -> the sum."""
        if self._cands is None:
            self._cands = {}
            d = self.d
            for t in savable_sums(d):
                raw = Term("Sum", (t.args[0], d.P(t.args[1])))
                p = self.poly(raw)
                if len(p) == 1 and list(p.values())[0] == 1.0:
                    (m,) = p
                    if len(m) == 1 and m[0][1] == 1:
                        self._cands.setdefault(m[0][0], t)
            self.memo.clear()   # normal forms computed while the table was incomplete
        return self._cands

    def recognise(self, st: Term) -> dict:
        t = self.candidates().get(st)
        if t is None:
            return self.atom(st)
        return self.atom(self.d.P(t))

    # -- polynomials -> terms -------------------------------------------------------------------
    def term(self, p: dict) -> Term:
        out = ZERO
        for m, c in sorted(p.items(), key=lambda x: [self.key(a) + str(e) for a, e in x[0]]):
            t = None
            for a, e in m:
                for _ in range(e):
                    t = a if t is None else mul(t, a)
            t = num(abs(c)) if t is None else mul(num(abs(c)), t)
            out = add(out, t) if c > 0 else sub(out, t)
        return out


class _TooBig(Exception):
    """A normal form past ``_Normal.LIMIT`` monomials: the caller keeps the term as it is."""


def _recip_of(t: Term):
    """``x`` when ``t`` is the safe reciprocal ``where(x == 0, 0, 1 / x)``."""
    if (t.op == "Where" and t.args[0].op == "CmpEq" and _val(t.args[0].args[1]) == 0
            and _val(t.args[1]) == 0 and t.args[2].op == "Div" and _val(t.args[2].args[0]) == 1
            and t.args[2].args[1] == t.args[0].args[0]):
        return t.args[0].args[0]
    return None


def _size(t: Term) -> int:
    return 1 + sum(_size(c) for c in t.children)


def _inner_work(t: Term) -> int:
    """Nodes evaluated per element of some reduction (work inside reduction bodies)."""
    n = 0
    for s in t.walk():
        if s.op in RED:
            n += _size(s.args[1])
    return n


# ---- a contraction in normal form against the saved values, by the rewrite system --------------
def saved_equations(d) -> list:
    """``(key, leaf axes, definition, value)``: what this program's e-graph may use besides the rule
    library. Each equation holds for this program only (it is added to its e-graph, not to the
    library):

    - a forward output ``o = a / b`` (``b`` computed from a reduction) that does not range over
      the forward's fused axis equals ``P(a) * r(P(b))`` (``r`` the safe reciprocal): the
      backward may read ``o``, which the forward writes anyway (equal wherever ``o`` is finite:
      where ``P(b)`` is 0 the forward's ``0 / 0 -> 0`` gives 0);
    - a forward sum the forward may save (``d.savable``) equals the backward's recomputation of
      it, ``sum_a(P(body))``: the backward may read the saved value instead of reducing again.

    ``value`` is a thunk: the saved value is only allocated when the extracted form reads it."""
    out = []
    for k, e in d.prog.outputs.items():
        t = e.term
        if t.op != "Div" or not d.from_red(t.args[1]) or d.fused is None or d.fused in e.axes \
                or k in d.prog.tensors:
            continue
        out.append((("output", k), tuple(e.axes), mul(d.P(t.args[0]), d.safe_recip(t.args[1])),
                    lambda k=k, axes=tuple(e.axes): d.output_input(k, axes)))
    for t in savable_sums(d):
        out.append((("saved", t), tuple(d.axes_of(t)), Term("Sum", (t.args[0], d.P(t.args[1]))),
                    lambda t=t: d.P(t)))
    return out


def savable_sums(d):
    """Each distinct sum over an axis in the program's outputs (walk order) whose value the
    forward can save for the backward (``d.savable``)."""
    seen = set()
    for e in d.prog.outputs.values():
        for t in e.term.walk():
            if t in seen or t.op != "Sum" or t.args[0].op != "Ax" or not d.savable(t):
                continue
            seen.add(t)
            yield t


_ARITH = ("Add", "Sub", "Mul", "Div", "Neg")


def read_saved(d, u: Term, equations: list, rules, egraph=None):
    """The cheapest form of the contraction ``u = sum_a(body)`` (``body`` free of reductions)
    that the rewrite system finds when the e-graph also knows the equations of
    ``saved_equations`` that can occur in ``u``. Returns the new term, or ``None`` when there is
    nothing to look for (no equation applies and no factor of the body is invariant along ``a``).

    The e-graph sees ``sum_J(body)``, ``J`` standing for the axis ``a``, with the atoms of the
    body (inputs, saved values, ``where``s, functions: everything but ``+ - * / neg`` and
    constants) as leaves: ``Elm`` when they range over ``a``, ``Par`` (invariant) otherwise. The
    NORMALIZE schedule (association, commutation, factoring an invariant out of a sum: proved
    library rules) runs, and the extractor's program cost picks the form with the least work
    per element: ``sum_e(g * S * r(l) * r(l))`` with ``o = S * r(l)`` comes out as
    ``sum_e(g * o) * r(l)`` (FlashAttention-2's ``D_i``: mul-comm, mul-assoc, sum-factor-right)."""
    from acefuse.rewrite.egraph import EGraph
    from acefuse.rewrite import schedules
    from acefuse.extract.extractor import Extractor, Reach

    ax = u.args[0].args[0]
    body_atoms = set(_atoms(u.args[1]))
    eqs = []
    for key, axes, t, value in equations:
        if t.op == "Sum":   # a saved sum: over the same axis, with the body's atoms
            if t.args[0] == u.args[0] and set(_atoms(t.args[1])) <= body_atoms:
                eqs.append((key, axes, t, value))
        elif set(_atoms(t)) <= body_atoms:
            eqs.append((key, axes, t, value))
    if not eqs and not any(ax not in d.axes_of(a) for a in body_atoms) \
            and not any(s.op == "Num" for s in u.args[1].walk()):
        return None
    leaves: dict = {}
    leaf_of: dict = {}

    def enc(t: Term, ranges: bool | None = None) -> Term:
        if t.op in _ARITH:
            return Term(t.op, tuple(enc(a) for a in t.args))
        if t.op == "Num" and math.isfinite(t.args[0]):
            return t
        if t.op == "Sum" and t.args[0] == u.args[0]:
            return Term("Sum", (Term("BJ"), enc(t.args[1])))
        if t not in leaf_of:
            leaf_of[t] = f"n{len(leaf_of) + 1}"
            leaves[leaf_of[t]] = t
        kind = (ax in d.axes_of(t)) if ranges is None else ranges
        return Term("Elm" if kind else "Par", (leaf_of[t],))

    placeholder = {}
    eg = egraph if egraph is not None else EGraph(rules)
    unions = [(Term("Out", ("u",)), enc(u))]
    for i, (key, axes, t, value) in enumerate(eqs):
        ph = Term("In", (f" saved value {i}",))   # no input has this name
        placeholder[ph] = value
        unions.append((enc(ph, ax in axes), enc(t)))
    if egraph is not None:   # the caller's e-graph with the rules loaded: a scope for this contraction
        eg.push()
    try:
        for a, b in unions:
            eg.union(a, b)
        stats = eg.saturate(schedules.NORMALIZE)
        ex = Extractor(eg.serialized())
    finally:
        if egraph is not None:
            eg.pop()
    cid = ex.class_of(lambda op, args: op == "Out" and args and args[0] == "u")
    _, term = ex.extract(cid, Reach("program", frozenset(), frozenset()))
    if term is None:
        return None
    lib = list(eg.rules) if hasattr(eg, "rules") else rules

    def dec(t: Term) -> Term:
        if t.op in ("Elm", "Par"):
            leaf = leaves[t.args[0]]
            return placeholder[leaf]() if leaf in placeholder else leaf
        if t.op == "Cnt":
            return Term("Size", (ax,))
        if t.op == "Sum":
            return Term("Sum", (u.args[0], dec(t.args[1])))
        if t.op == "Mul":   # factors in one order (by their text): the same program gives the same bytes
            fs = sorted((dec(f) for f in _factors(t)), key=lambda x: (x.op != "Num", x.sexpr()))
            out = fs[0]
            for f in fs[1:]:
                out = Term("Mul", (out, f))
            return out
        return Term(t.op, tuple(dec(a) if isinstance(a, Term) else a for a in t.args))
    out = dec(term)
    if _inner_work(out) < _inner_work(u) and hasattr(d, "derivation"):   # (the form simplify_output adopts)
        from acefuse.backward_shift import _note
        _note(d.derivation, ("read-saved", u, out, _Chain(lib, unions, term, stats)))
    return out


class _Chain:
    """The library rules of one derivation of a contraction's normal form (``read_saved``), found
    when first asked for (explain()): starting from the rewrite rules that fired, each one is
    dropped, in the reverse order of first firing, when the e-graph without it (and without those
    dropped before), given the same equations, still proves the form equal to the contraction.
    What is left derives the form, and every rule in it is needed given the others; listed in the
    order they first fired. (Analysis rules, the invariance facts, are kept throughout.)"""

    def __init__(self, rules, unions, term, stats):
        self.rules, self.unions, self.term = rules, unions, term
        kind = {r.name: r.kind for r in rules}
        self.fired = sorted((n for n, k in stats.matches.items() if k and kind.get(n) == "rewrite"),
                            key=lambda n: (stats.first_iteration.get(n, 99), n))
        self._names = None

    def __eq__(self, other):   # (one record per contraction: _note compares steps)
        return isinstance(other, _Chain)

    def __hash__(self):
        return 0

    def _derives(self, drop: set) -> bool:
        from acefuse.rewrite.egraph import EGraph
        from acefuse.rewrite import schedules
        eg = EGraph([r for r in self.rules if r.name not in drop], check_proofs=False)
        for a, b in self.unions:
            eg.union(a, b)
        eg.saturate(schedules.NORMALIZE)
        return eg.check(Term("Out", ("u",)), self.term)

    def names(self) -> list:
        if self._names is None:
            fired = set(self.fired)
            drop = {r.name for r in self.rules if r.kind == "rewrite" and r.name not in fired}
            for n in reversed(self.fired):
                if self._derives(drop | {n}):
                    drop.add(n)
            self._names = [n for n in self.fired if n not in drop]
        return self._names


def _atoms(t: Term):
    if t.op in _ARITH:
        for a in t.args:
            yield from _atoms(a)
    elif t.op != "Num":
        yield t


def _factors(t: Term) -> list:
    return _factors(t.args[0]) + _factors(t.args[1]) if t.op == "Mul" else [t]
