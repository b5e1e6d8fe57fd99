"""Gradients of a lookup table added row by row (a stage of af.backward, acefuse/backward.py).

The adjoint of a lookup ``kc[n = g]`` (paged keys: ``g = pages[j // 8] * 8 + j % 8``) is the
scatter ``where(index(n) == g, adjoint, 0)``; summed over the lookup's axes it is the table's
gradient ``grad_kc = sum_{b, j}(where(index(n) == g(b, j), sum_i(X), 0))``, where ``sum_i(X)``
is the gradient of the gathered value (dK over (b, h, j, d), as for plain attention). A stage
that computes ``sum_i(X)`` per key (rows j, loop i) adds each row into the entry ``g`` names
(codegen/sums_scatter.py ``row_scatter_store``) instead of storing it, and the gradient is
never an (n x j) intermediate. Lookups whose index reads the loop axis per element (T5's
buckets over (i, j)) are the other scatter, per element (codegen/sums_scatter.py).
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term
from acefuse.rewrite.encode import _Axes
from acefuse.backward_normal import _val
from acefuse.backward import _is_contraction, _retensor


def row_scatter(t: Term, tensors: dict):
    """``(a, summed, n, g, sum_a(X))`` when ``t`` scatters a reduction over ``a`` into a table,
    ``sum_S(where(index(n) == g, sum_a(X), 0))`` (sums over the axes ``S`` around the where: the
    adjoint of a lookup ``kc[n = g]`` whose value's gradient reduces over ``a``, paged keys'
    ``sum_i(dS * q)``), with ``g`` not reading ``a`` and ``a`` no batch axis (T5's ``sum_b(dS)``
    is summed by the grid: a scatter per element, codegen/sums_scatter.py); else None."""
    summed, body = [], t
    while body.op == "Sum" and body.args[0].op == "Ax" and not _is_contraction(body):
        summed.append(body.args[0].args[0])
        body = body.args[1]
    if not summed or body.op != "Where" or _val(body.args[2]) != 0 or body.args[0].op != "CmpEq":
        return None
    c, x = body.args[0], body.args[1]
    n, g = next(((i_.args[0], b) for i_, b in ((c.args[0], c.args[1]), (c.args[1], c.args[0])) if i_.op == "Idx"
                 and not any(u.op == "Idx" and u.args[0] == i_.args[0] for u in b.walk())), (None, None))
    chain, body = [], x   # the sums inside the where (sum_i(sum_b(dS)): a bias over key positions)
    while body.op == "Sum" and body.args[0].op == "Ax" and not _is_contraction(body):
        chain.append(body.args[0].args[0])
        body = body.args[1]
    if g is None or not chain or n in summed or set(chain) & set(summed) or len(set(chain)) < len(chain):
        return None
    # ``a`` is the one axis of the chain that is no batch axis: not every tensor (or lookup)
    # carrying an axis contracted inside ``X`` ranges over it (attention's q, k, v all carry b;
    # paged keys kc[n = slot(b, j)] lack i); the batch axes' sums move out of the where (``g``
    # is constant along them, and sums over different axes commute), summed by the grid
    axes_of = _Axes(tensors)
    con = {u.args[0].args[0] for u in body.walk() if _is_contraction(u) and u.args[0].op == "Ax"}
    carry = [axes_of(u) for u in body.walk() if u.op == "Take" or (u.op == "In" and u.args[0] in tensors)]
    carry = [ax for ax in carry if ax & con]
    loop = [c for c in chain if carry and not all(c in ax for ax in carry)]
    if len(loop) != 1 or any(u.op == "Idx" and u.args[0] in chain for u in g.walk()):
        return None
    a = loop[0]
    return a, summed + [c for c in chain if c != a], n, g, Term("Sum", (Term("Ax", (a,)), body))


def split_row_scatters(outputs: dict, order, scatters: dict) -> None:
    """A gradient ``sum_S(where(index(n) == g, sum_a(X), 0))`` (``row_scatter``: the adjoint of a
    lookup ``kc[n = g]`` whose value's gradient reduces over ``a``) becomes the stage output
    ``sum_a(X)`` over its own axes (paged keys: dK over (b, h, j, d), the plain dK), which the sum
    kernel adds row by row into the table entry ``g`` names instead of storing it
    (``scatters[k] = (n, g, the gradient's axes)``; codegen/sums.py). Exact over the reals: for
    each table entry, the sum over S of the rows whose ``g`` is that entry (``g`` does not read
    ``a``, so the where commutes with the sum over ``a``). Only where the summed axes ``S`` are
    exactly the axes of ``sum_a(X)`` that the gradient lacks, and ``g`` reads no other axis."""
    for k, e in list(outputs.items()):
        r = row_scatter(e.term, e.tensors)
        if r is None:
            continue
        a, summed, n, g, x = r
        axes_of = _Axes(e.tensors)
        xa = axes_of(x)
        if n in xa or set(summed) != xa - set(e.axes) or not axes_of(g) <= xa:
            continue
        paxes = tuple(y for y in order if y in xa) if order else tuple(sorted(xa))
        outputs[k] = _retensor(x, paxes, e.tensors)
        scatters[k] = (n, g, tuple(e.axes))
