"""Adversarial float32 simulation of a fused pass: the check extraction runs before it
accepts a form.

Range facts in the e-graph (``Le``, ``UB``) decide which exponentials are bounded, but
they are incomplete: a form can pass the cost model and still overflow float32 where
the program as written cannot (``sum_B(exp(x - s_AB)) * exp(s_AB - m_AB)`` for a
shift ``s`` much larger than the max). So every extracted pass is *run*, as the kernel
runs it, on adversarial rows:

- leaves are sampled per row from adversarial regimes (unit normal,
  spread 30 and 1e4, offset 1e4, logits near -100, exact zeros, leading fully masked
  (-inf) tiles and middle ones), one regime shared by all leaves on half of the rows
  and one per leaf on the other half; per-row parameters from ``{U(0.5, 2), N(0, 1), 1e4}``;
- the states are folded tile by tile with the ``init`` and ``rolling`` forms, and
  tile partials are folded with the ``merge`` forms, in float32, with the kernels'
  numerics conventions (codegen/emit.py: an empty max bounds a shift as 0; ``0/0``
  from a reduction is 0);
- the reference is each state's definition over the whole row in float64.

A form *fails* when its state comes out NaN or infinite on a row where the float64
definition is finite and below ``FINITE_LIMIT`` in magnitude (a value float32 can
hold with margin): the fuse step then forbids exponentials whose argument is not
proved bounded and extracts again. It also fails when it is off by more than
``ACCURACY_REL`` (relative, at least absolute) and more than ``ACCURACY_FACTOR`` times
the error of float32 evaluating the state's definition directly (cancellation the
program as written does not have). A state with no form that passes takes another
pass (correct, and slower), and ``explain()`` says so.
"""
from __future__ import annotations

import numpy as np

from acefuse.rewrite.terms import Term, reblock, A, B, U
from acefuse.codegen.emit import _child_pols, _row_only
from acefuse.rewrite.terms import INT_OPS as _INT_OPS
# functions, rounding and integer operators: the kernels compute them accurately (float64
# inside, or exact int64), so they are evaluated as the float64 reference does and rounded
from acefuse.reference import _FUNCS as _SPECIAL, _cast, _int_op

FINITE_LIMIT = 1e30
ACCURACY_REL = 1e-2      # a form is inaccurate when it is off by more than this (relative, at least 1)
ACCURACY_FACTOR = 100.0  # ... and more than this many times the error of the plain float32 evaluation
ROWS = 48
TILES = (4, 4, 4, 3)   # a row of 15 elements in 4 tiles (the last one partial)


class KernelEval:
    """Evaluation of encoded terms on arrays with the kernels' numerics conventions
    (codegen/emit.py), shared by this simulation (numpy, on sampled rows) and the
    distributed merge (torch, on state tensors: acefuse/distributed/merge.py):

    - a per-row value built from a max, a min or a log that is -inf reads as 0 where it is
      subtracted (an empty max bounds a shift as 0), and so does such a state;
    - a min state that is +inf reads as 0 where it is added;
    - a division whose denominator comes from a state or a reduction gives 0 for 0/0.

    ``ev(t, elems, pol)`` walks the term, tracking polarity (``_child_pols``) and applying
    the conventions, and evaluates the arithmetic every backend shares. A subclass supplies
    the rest: ``defs`` (state name -> definition), ``xp`` (the array module: ``where``,
    ``maximum``, ``minimum``), ``LEAVES`` (operators ``_leaf`` evaluates), ``state``,
    ``_zero_where``, ``_in_elems``, ``_from_bool`` and ``_func`` (every other operator)."""

    defs: dict
    xp = np
    LEAVES: frozenset = frozenset()

    def is_ext(self, q) -> bool:
        """State q is a max/min or a reference value built from one (codegen/emit.py)."""
        d = self.defs.get(q)
        if d is None:
            return False
        if d.op in ("max", "min"):
            return True
        return d.op == "ref" and any((u.op == "St" and u.args[0] != q and self.is_ext(u.args[0]))
                                     or u.op == "Log" for u in d.definition.walk())

    def row_only(self, t: Term) -> bool:
        """emit's ``_row_only``: a per-row value built from a max, a min or a log."""
        return _row_only(t, self.is_ext)

    def ev(self, t: Term, elems=None, pol=None):
        """Value of ``t`` (``elems``: the elements of the reduction it is inside, or None;
        ``pol``: "-" where it is subtracted, "+" where added, None where neither)."""
        op = t.op
        if pol == "-" and op != "St" and self.row_only(t):   # the kernels' convention (emit.py)
            v = self.ev(t, elems, None)
            return self._zero_where(v == -np.inf, v)
        if op == "St":
            q = t.args[0]
            v = self.state_value(q, t.args[1])
            d = self.defs.get(q)
            if pol == "-" and self.is_ext(q):
                v = self._zero_where(v == -np.inf, v)
            elif d is not None and d.op == "min" and pol == "+":
                v = self._zero_where(v == np.inf, v)
            return self._in_elems(v, elems)
        if op in self.LEAVES:
            return self._leaf(t, elems)
        if op == "Neg":
            return -self.ev(t.args[0], elems, "-" if (pol or "+") == "+" else "+")
        pols = _child_pols(t, pol) if op in ("Add", "Sub", "Mul", "Div") else None
        kids = [self.ev(c, elems, pols[i] if pols else None) for i, c in enumerate(t.children)]
        a = kids[0]
        b = kids[1] if len(kids) > 1 else None
        if op == "Add":
            return a + b
        if op == "Sub":
            return a - b
        if op == "Mul":
            return a * b
        if op == "Div":
            r = a / b
            if any(s.op in ("St", "Sum", "RMax", "RMin") for s in t.args[1].walk()):
                r = self._zero_where((a == 0) & (b == 0), r)
            return r
        if op == "Max2":
            return self.xp.maximum(a, b)
        if op == "Min2":
            return self.xp.minimum(a, b)
        if op == "Where":
            return self.xp.where(a != 0, b, kids[2])
        if op == "LAnd":
            return self._from_bool((a != 0) & (b != 0), a)
        if op == "LOr":
            return self._from_bool((a != 0) | (b != 0), a)
        if op == "LNot":
            return self._from_bool(a == 0, a)
        return self._func(op, t, kids)

    def state_value(self, q: str, blk: Term):
        """State ``q`` over block ``blk``, as the kernel holds it."""
        return self.state(q, blk)

    def _in_elems(self, v, elems):
        """A per-row value ``v`` read inside a reduction over ``elems`` (or outside one)."""
        return v


class _Eval(KernelEval):
    """Evaluates encoded terms (St/Cnt/Sum over blocks, Elm/Par leaves) on sampled rows:
    (ROWS,) outside a reduction, (ROWS, |elems|) inside one."""

    LEAVES = frozenset({"Num", "Elm", "Par", "Cnt", "Sum", "RMax", "RMin"})

    def __init__(self, enc, leaf_vals, par_vals, dtype):
        self.enc = enc
        self.defs = {s.name: s for s in enc.states}
        self.leaf_vals = leaf_vals        # Elm name -> (ROWS, N) float64
        self.par_vals = par_vals          # Par name -> (ROWS,) float64
        self.dt = dtype
        self.blocks: dict = {}            # block key -> index array
        self.states: dict = {}            # (q, block key) -> (ROWS,) value
        self._defmemo: dict = {}
        self.known: frozenset = frozenset()   # states final from earlier passes: read over J

    def key(self, blk: Term) -> str:
        if blk.op == "BU":
            return self.key(blk.args[0]) + self.key(blk.args[1])
        return {"BA": "A", "BB": "B", "BJ": "J"}.get(blk.op, "?")

    def idx(self, blk: Term):
        return self.blocks[self.key(blk)]

    def state(self, q: str, blk: Term):
        k = (q, self.key(blk))
        if k in self.states:
            return self.states[k]
        # not supplied: its definition over that block (references, or the float64 reference)
        mk = (q, self.key(blk), tuple(self.idx(blk)) if self.key(blk) in self.blocks else None)
        if mk not in self._defmemo:
            d = _finals(self.defs[q].definition, self.known)
            self._defmemo[mk] = self.ev(reblock(d, blk), None, None)
        return self._defmemo[mk]

    def state_value(self, q: str, blk: Term):
        return self.state(q, blk).astype(self.dt)

    def _in_elems(self, v, elems):
        return v[:, None] if elems is not None else v

    def _zero_where(self, cond, v):
        return np.where(cond, self.dt(0), v)

    def _from_bool(self, mask, like):
        return mask.astype(self.dt)

    def _leaf(self, t: Term, elems):
        op, dt = t.op, self.dt
        if op == "Num":
            return dt(t.args[0])
        if op == "Elm":
            v = self.leaf_vals[t.args[0]]
            return v[:, elems].astype(dt)
        if op == "Par":
            return self.par_vals[t.args[0]].astype(dt)[:, None] if elems is not None else \
                self.par_vals[t.args[0]].astype(dt)
        if op == "Cnt":
            return dt(len(self.idx(t.args[0])))
        # Sum, RMax, RMin over a block
        ix = self.idx(t.args[0])
        body = np.broadcast_to(np.asarray(self.ev(t.args[1], ix, None)), (ROWS, len(ix)))
        if len(ix) == 0:
            r = {"Sum": 0.0, "RMax": -np.inf, "RMin": np.inf}[op]
            return np.full(ROWS, r, dtype=dt)
        fn = {"Sum": np.sum, "RMax": np.max, "RMin": np.min}[op]
        r = fn(body, axis=1).astype(dt)
        return r[:, None] if elems is not None else r

    def _func(self, op, t: Term, kids):
        dt = self.dt
        a = kids[0]
        b = kids[1] if len(kids) > 1 else None
        fns = {"Exp": np.exp, "Log": np.log, "Sqrt": np.sqrt, "Abs": np.abs, "Tanh": np.tanh}
        if op in fns:
            return fns[op](a)
        if op == "Rsqrt":
            return dt(1) / np.sqrt(a)
        if op == "Pow":
            return np.power(a, dt(t.args[1]))
        if op in _SPECIAL:
            return _SPECIAL[op](np.asarray(a, dtype=np.float64)).astype(dt)
        if op == "Cast":
            return _cast(np.asarray(a, dtype=np.float64), t.args[1]).astype(dt)
        if op in _INT_OPS:
            return _int_op(op, [np.asarray(k, dtype=np.float64) for k in kids]).astype(dt)
        cmp = {"CmpLt": np.less, "CmpLe": np.less_equal, "CmpGt": np.greater, "CmpGe": np.greater_equal,
               "CmpEq": np.equal, "CmpNe": np.not_equal}
        if op in cmp:
            return cmp[op](a, b).astype(dt)
        raise ValueError(f"simulate: no evaluation for operator {op}")


def _finals(t: Term, known) -> Term:
    """A definition with the states of earlier passes read as final values (over J)."""
    if not known:
        return t
    if t.op == "St" and t.args[0] in known:
        return Term("St", (t.args[0], Term("BJ")))
    if not t.children:
        return t
    return Term(t.op, tuple(_finals(a, known) if isinstance(a, Term) else a for a in t.args))


def _samples(enc, seed):
    rng = np.random.default_rng(seed)
    n = sum(TILES)
    elm = {}
    par = {}
    # the first half of the rows share one regime across all leaves, every regime on three
    # rows (leaves are often one input under different elementwise functions: a `where`
    # choosing between two of them must still see an offset row); the second half draws a
    # regime per leaf
    shared = np.concatenate([rng.permutation(np.arange(ROWS // 2) % 8), np.zeros(ROWS - ROWS // 2, int)])
    for name in sorted(enc.leaves):
        regimes = np.where(np.arange(ROWS) < ROWS // 2, shared, rng.integers(0, 8, size=ROWS))
        v = rng.standard_normal((ROWS, n))
        for r in range(ROWS):
            g = regimes[r]
            if g == 1:
                v[r] *= 30.0
            elif g == 2:
                v[r] = 1e4 + v[r]
            elif g == 3:
                v[r] *= 1e4
            elif g == 4:
                v[r] = -100.0 + v[r]
            elif g == 5:
                v[r, :TILES[0]] = -np.inf          # a fully masked first tile
            elif g == 6:
                v[r, TILES[0]:TILES[0] + TILES[1]] = -np.inf   # a fully masked middle tile
                v[r, -2:] = 0.0
            elif g == 7:
                v[r] = np.abs(v[r]) * 1e3
        elm[name] = v
        p = rng.choice([0.0, 1.0, 2.0], size=ROWS)
        par[name] = np.where(p == 0, rng.uniform(0.5, 2.0, ROWS), np.where(p == 1, rng.standard_normal(ROWS), 1e4))
    return elm, par


def failures(enc, p, forms: dict, kind: str, seed: int = 0) -> dict:
    """{state: description} for the states of pass ``p`` whose ``forms`` (the rolling
    updates when ``kind == "rolling"``, the merges when ``"merge"``) come out NaN/inf in
    float32 where the float64 definition is finite. ``enc`` is the program's Encoding."""
    elm, par = _samples(enc, seed)
    n = sum(TILES)
    bounds = np.cumsum((0,) + TILES)
    tiles = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(TILES))]
    whole = np.arange(n)
    with np.errstate(all="ignore"):
        ref = _Eval(enc, elm, par, np.float64)
        ref.blocks = {"A": whole, "J": whole}
        truth = {s.name: ref.state(s.name, A) for s in p.states}
        # states finished in earlier passes, as the kernel has them: computed in float32
        early = _Eval(enc, elm, par, np.float32)
        early.blocks = {"A": whole, "J": whole}
        finals = {k: early.state(k, A) for k in p.known}
        ev = _Eval(enc, elm, par, np.float32)
        ev.known = frozenset(p.known)
        for k, v in finals.items():
            ev.states[(k, "J")] = v
        names = [s.name for s in p.states]
        order = list(p.states)
        if kind == "rolling":
            ev.blocks = {"B": tiles[0], "J": whole}
            cur = {s.name: ev.ev(p.init[s.name], None, None) for s in order}
            seen = tiles[0]
            for t in tiles[1:]:
                ev.blocks = {"A": seen, "B": t, "AB": np.concatenate([seen, t]), "J": whole}
                ev.states = {(k, "J"): v for k, v in finals.items()}
                ev.states.update({(q, "A"): v for q, v in cur.items()})
                ev._defmemo = {}
                new = {}
                for s in order:
                    val = ev.ev(forms[s.name], None, None)
                    new[s.name] = val
                    ev.states[(s.name, "AB")] = val
                cur = new
                seen = np.concatenate([seen, t])
        else:
            parts = []
            for t in tiles:
                ev.blocks = {"B": t, "J": whole}
                ev.states = {(k, "J"): v for k, v in finals.items()}
                ev._defmemo = {}
                parts.append({s.name: ev.ev(p.init[s.name], None, None) for s in order})
            cur, seen = parts[0], tiles[0]
            for t, part in zip(tiles[1:], parts[1:]):
                ev.blocks = {"A": seen, "B": t, "AB": np.concatenate([seen, t]), "J": whole}
                ev.states = {(k, "J"): v for k, v in finals.items()}
                ev.states.update({(q, "A"): v for q, v in cur.items()})
                ev.states.update({(q, "B"): v for q, v in part.items()})
                ev._defmemo = {}
                new = {}
                for s in order:
                    if s.name not in forms:
                        return {}
                    val = ev.ev(forms[s.name], None, None)
                    new[s.name] = val
                    ev.states[(s.name, "AB")] = val
                cur = new
                seen = np.concatenate([seen, t])
        # how well float32 computes each state as written (unfused, from its definition)
        direct = _Eval(enc, elm, par, np.float32)
        direct.blocks = {"A": whole, "J": whole}
        plain = {q: direct.state(q, A) for q in names}
    out = {}
    for q in names:
        tv, got = truth[q], cur[q]
        ok_truth = np.isfinite(tv) & (np.abs(tv) < FINITE_LIMIT)
        bad = ok_truth & ~np.isfinite(got)
        if bad.any():
            r = int(np.argmax(bad))
            out[q] = ("overflow", f"its {kind} form gives {got[r]} in float32 where the value is "
                                  f"{tv[r]:.6g} (adversarial row {r})")
            continue
        # accuracy: far worse than float32 evaluating the definition directly
        with np.errstate(all="ignore"):
            err = np.abs(got.astype(np.float64) - tv)
            ref_err = np.abs(plain[q].astype(np.float64) - tv)
            worse = ok_truth & np.isfinite(plain[q]) & (err > ACCURACY_REL * np.maximum(np.abs(tv), 1.0)) \
                & (err > ACCURACY_FACTOR * ref_err)
        if worse.any():
            r = int(np.argmax(worse))
            out[q] = ("accuracy", f"its {kind} form gives {got[r]:.6g} in float32 where the value is "
                                  f"{tv[r]:.6g} and float32 evaluating the definition gives "
                                  f"{plain[q][r]:.6g} (adversarial row {r}: cancellation)")
    return out
