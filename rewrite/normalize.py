"""Normal form of a program before states are defined, chosen by extraction.

The program's outputs go into an e-graph at program level (reductions over the
whole fused axis ``J``; subterms free of fused reductions abstracted to leaves as
in encode.py), the NORMALIZE schedule runs, and the cheapest form is extracted
with the per-element weighting of the cost model. E.g. ``sum_j(p * v / l)`` comes
out as ``sum_j(p * v) / l``: the division happens once per row instead of once per
element (FlashAttention-2's deferred normalization). A normal form is adopted only
when it does strictly less per-element work than what the user wrote.
"""
from __future__ import annotations

import dataclasses
import math

from acefuse.rewrite.terms import Term, pretty
from acefuse.rewrite.encode import _Axes, RED_OPS
from acefuse.extract import cost as C

JB = Term("BJ")


def work(t: Term, axis: str, inside: bool = False) -> float:
    """Weighted operations of a program term, per-element work inside reductions x TILE."""
    w = C.WEIGHTS.get(t.op, 0.0) * (C.TILE if inside else 1.0)
    is_red = t.op in RED_OPS and t.args[0].op == "Ax" and t.args[0].args[0] == axis
    for c in t.children:
        w += work(c, axis, inside or is_red)
    return w


def normalize(prog, axis: str, rules, check_proofs=True, allow_unproved=False, report: list | None = None):
    """(program in normal form, notes) — the program itself when nothing is cheaper.
    ``report``: a list the saturation's RunStats is appended to. A search stopped by a limit
    (an iteration past the node limit is rolled back; a rule matching more than the match
    limit in one iteration is skipped, rewrite/egraph.py) adds a note saying so: the form
    kept is the cheapest in the e-graph reached, each of its steps proved all the same."""
    from acefuse.rewrite.egraph import EGraph
    from acefuse.rewrite import schedules
    from acefuse.extract.extractor import Extractor, Reach
    from acefuse.lang import Program, Expr

    axes_of = _Axes(prog.tensors)
    leaves: dict = {}
    leaf_of: dict = {}

    def is_red(t):
        return t.op in RED_OPS and t.args[0].op == "Ax" and t.args[0].args[0] == axis

    def has_red(t):
        return any(is_red(s) or (s.op == "Size" and s.args[0] == axis) for s in t.walk())

    def leaf(t, kind):
        if t not in leaf_of:
            leaf_of[t] = f"n{len(leaf_of) + 1}"
            leaves[leaf_of[t]] = t
        return Term(kind, (leaf_of[t],))

    def enc(t: Term) -> Term:
        if t.op == "Ax":  # a block argument (another axis) is never a leaf
            return t
        if is_red(t):
            return Term(t.op, (JB, enc(t.args[1])))
        if t.op == "Size" and t.args[0] == axis:
            return Term("Cnt", (JB,))
        if not has_red(t):
            if t.op == "Num" and math.isfinite(t.args[0]):
                return t
            return leaf(t, "Elm" if axis in axes_of(t) else "Par")
        return Term(t.op, tuple(enc(a) if isinstance(a, Term) else a for a in t.args))

    def dec(t: Term) -> Term:
        if t.op in RED_OPS and t.args[0].op == "Ax":
            return Term(t.op, (t.args[0], dec(t.args[1])))
        if t.op in RED_OPS:
            return Term(t.op, (Term("Ax", (axis,)), dec(t.args[1])))
        if t.op == "Cnt":
            return Term("Size", (axis,))
        if t.op in ("Elm", "Par"):
            return leaves[t.args[0]]
        return Term(t.op, tuple(dec(a) if isinstance(a, Term) else a for a in t.args))

    encoded = {k: enc(e.term) for k, e in prog.outputs.items()}
    if not any(any(s.op in RED_OPS for s in t.walk()) for t in encoded.values()):
        return prog, []
    eg = EGraph(rules, check_proofs=check_proofs, allow_unproved=allow_unproved)
    for k, t in encoded.items():
        eg.union(Term("Out", (k,)), t)
    stats = eg.saturate(schedules.NORMALIZE, dataclasses.replace(schedules.NORMALIZE.limits, rollback=True))
    if report is not None:
        report.append(stats)
    limited = [] if not (stats.skipped or any(w in stats.stop_reason for w in ("node limit", "time limit"))) else [
        f"normal form: the search stopped early ({stats.stop_reason}"
        + (f"; rules skipped where they matched too often: {', '.join(sorted(stats.skipped))}" if stats.skipped
           else "") + "); the form kept is the cheapest in the e-graph reached"]
    ex = Extractor(eg.serialized())
    new_outputs, notes = {}, []
    for k, e in prog.outputs.items():
        cid = ex.class_of(lambda op, args, n=k: op == "Out" and args and args[0] == n)
        cost, term = ex.extract(cid, Reach("program", frozenset(), frozenset()))
        new = dec(term) if term is not None else e.term
        if term is not None and work(new, axis) < work(e.term, axis) - 1e-9:
            new_outputs[k] = Expr(new, e.axes, e.tensors)
            notes.append(f"normal form of {k}: {pretty(new)}  (was {pretty(e.term)}; "
                         f"per-element work {work(e.term, axis):g} -> {work(new, axis):g})")
        else:
            new_outputs[k] = e
    if not notes:
        return prog, limited
    return Program(prog.name, new_outputs, order=prog.axes), notes + limited
