"""Walks over terms as the DAGs they are.

Programs share subterms: af.topk's k-th candidate is built from the k - 1 before it, so
examples/moe.py's grouped top-8 routing (ds_grouped_top8) has 801 distinct term objects
that read as a tree of 4,974,236 nodes (its outputs' s-expressions: 46 MB). ``Term.walk`` and
``Term.sexpr`` recurse over the tree, and a Term's hash is recomputed over the tree on
every call (a frozen dataclass), so a walk that memoizes by ``Term`` is no cheaper. These
helpers visit each distinct object once, keyed by identity (``id``), which is valid while
the terms are alive (they are: the walk holds its roots).
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term, fmt_f64


def nodes(*roots: Term):
    """Each distinct term object under ``roots`` once, in the order of first appearance in
    the tree's pre-order (the order ``Term.walk`` first reaches it), without recursion."""
    seen = set()
    stack = list(reversed(roots))
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield t
        stack.extend(reversed(t.children))


def sexpr(t: Term, memo: dict | None = None) -> str:
    """``t.sexpr()``, the same text, computed once per distinct subterm object (``memo``:
    id -> text, may be shared by calls over terms that share subterms)."""
    memo = {} if memo is None else memo
    hit = memo.get(id(t))
    if hit is not None:
        return hit
    if t.op == "?" or (t.op == "Num" and not isinstance(t.args[0], Term)):
        s = t.sexpr()
    else:   # as Term.sexpr, with the children's text memoized
        parts = [t.op]
        for a in t.args:
            if isinstance(a, Term):
                parts.append(sexpr(a, memo))
            elif isinstance(a, str):
                parts.append("v_" + a[1:] if a.startswith("?") else '"' + a + '"')
            else:
                parts.append(fmt_f64(a))
        s = "(" + " ".join(parts) + ")"
    memo[id(t)] = s
    return s
