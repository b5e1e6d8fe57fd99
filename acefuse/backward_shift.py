"""One saved value per shifted sum, and the record of the backward's normal-form steps.

``fold_outputs``: where the gradients read a saved max ``m`` and a saved shifted sum
``l = sum_a(exp(b - m))`` only as ``exp(b - m) * r(l)`` (``r`` the safe reciprocal), they read
``exp(b - L)`` from one saved ``L = where(l == 0, 0, m + log(l))`` (FlashAttention-2's saved
logsumexp, derived for any such pair). ``laws_proved``: the Python normal forms apply a law only
while the library rules it cites are proved. ``derivation_text``: explain()'s lines for
``bwd.derivation`` (each step, before and after, with its rules).
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term
from acefuse.backward_normal import ZERO, ONE, add, sub, mul, neg, _cmp


# ---- one saved value per shifted sum: exp(b - m) * r(l) -> exp(b - L) --------------------------
# the library rules (rules/shifted.py, rules/arith.py) the Python normal forms apply; explain() cites them
SHIFT_LAW = ("shifted-sum-ge-one", "pos-of-ge-one", "div-mul-cancel")      # r(l) * l = 1
FOLD_LAW = ("shifted-sum-ge-one", "pos-of-ge-one", "exp-div-log")         # exp(b - m) * r(l) = exp(b - L)
_PROVED: dict = {}


def laws_proved(names) -> bool:
    """Every library rule ``names`` cites is registered and proved (proofs/rules.py, cached): a law
    of the Python normal forms is applied only as an instance of proved rules, like a rule the
    e-graph loads."""
    key = tuple(names)
    if key not in _PROVED:
        from acefuse.rules import REGISTRY
        from acefuse.proofs import prove_rule
        _PROVED[key] = all(n in REGISTRY and prove_rule(REGISTRY[n]).ok for n in names)
    return _PROVED[key]


def dropped_adjoint(d, t: Term, adj: Term) -> None:
    """Record that the adjoint ``adj`` of the max/min ``t`` is identically 0 in the normal form."""
    _note(d.derivation, ("shift-invariance", t, adj, ""))


def derivation_text(bwd, chains: bool = True) -> list:
    """explain()'s lines for the normal forms' steps (``bwd.derivation``); ``chains=False`` leaves
    out the rewrite system's rule chains (one e-graph run per rule that fired, done when first
    asked for)."""
    from acefuse.rewrite.terms import pretty
    steps = getattr(bwd, "derivation", ())
    if not steps:
        return []

    def show(t, n=320):
        x = pretty(t)
        return x if len(x) <= n else x[:n] + " ..."
    L = ["normal forms against the saved values (acefuse/backward_normal.py; each step an instance of proved "
         "library rules):"]
    for rule, before, after, note in steps:
        if rule == "read-saved":
            L.append(f"  {show(before)}")
            L.append(f"    = {show(after)}")
            names = ' -> '.join(note.names()) or '(the equations alone)' if chains else '(chains=False)'
            L.append(f"    rules: {names}  "
                     "[rewrite system, NORMALIZE, with this program's saved values as equations]")
        elif rule == "shift-invariance":
            L.append(f"  adjoint of {show(before, 160)} = {show(after, 240)} = 0: dropped")
            L.append("    rules: linearity (sum-add, sum-sub), factor an invariant (sum-factor-left/right), "
                     "Fubini and saved values (Python normal form), r(l)^a * l^a = 1: " + ", ".join(SHIFT_LAW))
        elif rule == "exp-div-log":
            L.append(f"  {show(before)}")
            L.append(f"    = {show(after)}")
            L.append(f"    rules: {', '.join(FOLD_LAW)} (L = where(l == 0, 0, m + log(l)): a fully masked row reads 0)")
        else:
            L.append(f"  {show(before)}")
            L.append(f"    = {show(after)}")
            L.append(f"    rules: {rule}" + (f" ({note})" if note else ""))
    return L


def shifted_pairs(d) -> list:
    """``(E, R, Lt)`` for each saved forward sum ``l = sum_a(exp(b - max_a b))`` (a *shifted sum*,
    ``shifted-sum-ge-one``: ``l >= 1`` wherever the max is finite) whose max is saved too:
    ``E = exp(P(b) - saved max)``, ``R = r(saved l)`` as the backward reads them, and ``Lt`` the
    forward value ``where(l == 0, 0, max_a b + log(l))`` the backward reads instead of both."""
    out = []
    for t in list(d.saved):
        if t.op != "Sum" or t.args[0].op != "Ax" or t.args[1].op != "Exp" or t.args[1].args[0].op != "Sub":
            continue
        b, mx = t.args[1].args[0].args
        if mx.op != "RMax" or mx.args[0] != t.args[0] or mx.args[1] != b or mx not in d.saved:
            continue
        lt = Term("Where", (_cmp("CmpEq", t, ZERO), ZERO, Term("Add", (mx, Term("Log", (t,))))))
        if not d.savable(lt):
            continue
        if lt not in d.saved:   # named for what it is (P would call it saved_v<n>)
            k = sum(1 for n in d.saved.values() if n.startswith("saved_lse")) + 1
            name = "saved_lse" if k == 1 else f"saved_lse{k}"
            if name in d.prog.tensors or name in d.prog.outputs:
                continue
            d.saved[lt] = name
            d.saved_kind[name] = "value"
            d.tensors[name] = d.ordered(d.axes_of(lt))
        out.append((d.P(t.args[1]), d.safe_recip(t), lt))
    return out


def fold_outputs(d, terms: dict) -> dict:
    """``fold_shifted`` over every gradient of the program at once (``{name: term}``), for the pairs
    it removes entirely: a pair whose ``exp(b - m)`` or ``r(l)`` is still read after the fold (the
    max's adjoint kept: ``m + 2 log(l)``) is left as derived in every gradient, so no stage
    computes ``P`` two ways (the contraction family reads one score exponential per stage) and
    the saved max and sum are dropped whenever ``L`` is saved."""
    if not laws_proved(FOLD_LAW):
        return terms
    pairs = [p for p in shifted_pairs(d) if any(p[0] in set(t.walk()) for t in terms.values())]
    while pairs:
        record: list = []
        out = {k: fold_shifted(d, t, record, pairs) for k, t in terms.items()}
        left = [p for p in pairs if any(s == p[0] or s == p[1] for t in out.values() for s in t.walk())]
        if not left:
            for step in record:
                _note(d.derivation, step)
            return out
        pairs = [p for p in pairs if p not in left]
    return terms


def fold_shifted(d, t: Term, record: list | None = None, pairs=None) -> Term:
    """``t`` with each product ``exp(P(b) - m) * r(l)`` (``l = sum_a(exp(b - m))``, ``m = max_a b``,
    both saved) read as ``exp(P(b) - L)`` from one saved value ``L = m + log(l)``: one float32
    per row saved instead of two, and one multiply less per element (FlashAttention-2 recomputes
    ``P = exp(S - L)`` from the saved logsumexp). Each step is an instance of a proved library
    rule, written to ``record`` as ``(rule, before, after)``:

    - ``exp-div-log``: ``exp(a - b) / c = exp(a - (b + log(c)))`` for ``c > 0``; ``l >= 1`` by
      ``shifted-sum-ge-one`` wherever the max is finite, so ``r(l) = 1 / l`` there. Where
      ``l = 0`` (a fully masked row: ``m = -inf``, every ``b = -inf``) the left side is 0 (the
      safe reciprocal) and so is the right one: ``L`` is saved as ``where(l == 0, 0, m + log l)``
      and ``exp(-inf - 0) = 0``, never ``exp(-inf + inf)``;
    - ``factor-sub-right`` / ``factor-add-right``: ``a * r - b * r = (a - b) * r`` brings ``r(l)``
      next to the ``exp`` it multiplies;
    - ``sum-factor-right`` read right to left: ``sum_a(f) * r = sum_a(f * r)`` when ``r`` does not
      range over ``a``, to meet an ``exp`` inside the sum (softmax's ``sum_j(exp(x - m) g) r(l)``).

    Nothing names a workload: any saved shifted sum and its max are read this way."""
    if not laws_proved(FOLD_LAW):
        return t
    pairs = [(e, r, lt) for e, r, lt in (shifted_pairs(d) if pairs is None else pairs)
             if any(s == e for s in t.walk()) and any(s == r for s in t.walk())]
    if not pairs:
        return t
    record = [] if record is None else record
    memo: dict = {}

    def go(u: Term) -> Term:
        if u in memo:
            return memo[u]
        if u.op in ("Mul", "Neg"):
            sign, fs = _signed_factors(u)
            r = _rebuild(sign, combine([go(f) for f in fs]))
        elif u.children:
            r = Term(u.op, tuple(go(a) if isinstance(a, Term) else a for a in u.args))
        else:
            r = u
        memo[u] = r
        return r

    def combine(fs: list) -> list:
        changed = True
        while changed:
            changed = False
            for e, r, lt in pairs:
                if e in fs and r in fs:
                    new = Term("Exp", (sub(e.args[0].args[0], d.P(lt)),))
                    before = _rebuild(1, [e, r])
                    i = fs.index(e)   # (in the exp's place: the factor order of the product is kept)
                    fs = _drop(fs[:i] + [new] + fs[i + 1:], r)
                    _note(record, ("exp-div-log", before, new, ""))
                    changed = True
                    break
                if e in fs:   # r(l) in every addend of a factor: factor it out
                    for i, f in enumerate(fs):
                        if f.op not in ("Add", "Sub"):
                            continue
                        terms = _addends(f)
                        if all(r in fs2 for _, (_, fs2) in terms):
                            g = _resum([(s0 * s1, _drop(fs2, r)) for s0, (s1, fs2) in terms])
                            _note(record, ("factor-sub-right" if any(s0 * s1 < 0 for s0, (s1, _) in terms)
                                           else "factor-add-right", f, _rebuild(1, [g, r]), ""))
                            fs = fs[:i] + [g, r] + fs[i + 1:]
                            changed = True
                            break
                    if changed:
                        break
                if r in fs:   # an exp inside a sum the invariant r(l) multiplies: move r(l) in
                    for i, f in enumerate(fs):
                        if f.op != "Sum" or f.args[0].op != "Ax" or f.args[0].args[0] in d.axes_of(r):
                            continue
                        s1, bfs = _signed_factors(f.args[1])
                        if e not in bfs:
                            continue
                        body = _rebuild(s1, combine(bfs + [r]))
                        new = Term("Sum", (f.args[0], body))
                        _note(record, ("sum-factor-right", _rebuild(1, [f, r]), new, "right to left"))
                        fs = _drop(fs[:i] + [new] + fs[i + 1:], r)
                        changed = True
                        break
                    if changed:
                        break
        return fs

    return go(t)


def _note(record: list, step: tuple) -> None:
    if step not in record:   # (the same contraction in several gradients: one step)
        record.append(step)


def _drop(fs: list, x: Term) -> list:
    """``fs`` without one occurrence of ``x``."""
    out, done = [], False
    for f in fs:
        if not done and f == x:
            done = True
            continue
        out.append(f)
    return out


def _signed_factors(t: Term):
    """``(sign, factors)`` of a product (``Neg`` taken out as the sign)."""
    if t.op == "Neg":
        s, fs = _signed_factors(t.args[0])
        return -s, fs
    if t.op == "Mul":
        s1, f1 = _signed_factors(t.args[0])
        s2, f2 = _signed_factors(t.args[1])
        return s1 * s2, f1 + f2
    return 1, [t]


def _rebuild(sign: int, fs: list) -> Term:
    out = ONE
    for f in fs:
        out = mul(out, f)
    return neg(out) if sign < 0 else out


def _addends(t: Term) -> list:
    """``[(sign, (sign, factors))]`` of a sum of products (``Add``/``Sub``/``Neg`` flattened)."""
    if t.op == "Add":
        return _addends(t.args[0]) + _addends(t.args[1])
    if t.op == "Sub":
        return _addends(t.args[0]) + [(-s, x) for s, x in _addends(t.args[1])]
    if t.op == "Neg":
        return [(-s, x) for s, x in _addends(t.args[0])]
    return [(1, _signed_factors(t))]


def _resum(terms: list) -> Term:
    out = ZERO
    for s, fs in terms:
        x = _rebuild(1, fs)
        out = add(out, x) if s > 0 else sub(out, x)
    return out


# ---- a fully masked row's saved extremum, read as the forward reads it -------------------------
def guard_masked_shifts(terms: dict, saved_kind: dict) -> dict:
    """The gradients ``terms`` with the forward's empty-extremum convention (README "Numerics
    conventions") applied to the saved extrema they read: a saved max that is ``-inf`` reads as 0
    where it is *subtracted* (``exp(b - m)`` of a fully masked row is ``exp(-inf) = 0``), a saved min
    that is ``+inf`` where it is *added inside a difference*; the sign is followed through ``+``,
    ``-``, unary minus and products with a constant, as in the forward. Anywhere else (``x + m``,
    ``body == m``) the saved value is read as it is, as the forward reads it: a body made ``-inf``
    by a masked max compares equal to its own max, never as ``x + 0``."""
    from acefuse.reference import _pols
    guards = {}
    for n, kind in saved_kind.items():
        if kind in ("max", "min"):
            inf = Term("Num", (float("-inf") if kind == "max" else float("inf"),))
            leaf = Term("In", (n,))
            guards[(n, "-" if kind == "max" else "+")] = Term("Where", (Term("CmpEq", (leaf, inf)), ZERO, leaf))
    if not guards:
        return terms
    memo: dict = {}

    def walk(t: Term, pol):
        key = (t, pol)
        if key not in memo:
            if t.op == "In":
                memo[key] = guards.get((t.args[0], pol), t)
            elif not t.children:
                memo[key] = t
            else:
                kids = iter(_pols(t, pol))
                memo[key] = Term(t.op, tuple(walk(a, next(kids)) if isinstance(a, Term) else a for a in t.args))
        return memo[key]
    return {k: walk(t, None) for k, t in terms.items()}
