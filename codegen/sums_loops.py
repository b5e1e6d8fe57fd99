"""Sum kernels over two loop axes: which stages take them, and compiling a stage that way.

A backward stage whose every state is a double sum ``sum_i(sum_r(x))`` over two axes that every
loop tensor carries (grouped-query attention's ``grad_k``, ``grad_v``) is one sum kernel
(codegen/sums.py, ``SumGen.loop2``): each program loops over every value of one axis and, inside,
over the tiles of the other, adding into the same accumulators (the same sums regrouped over
blocks, ``sum-split``; swapping the two sums is Fubini, exact over the reals). Split out of
sums.py: this module decides the form and the axis, sums.py generates the kernel.
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term


def _double_sum(t: Term):
    """(outer axis, inner axis, body) of ``sum_a(sum_b(body))`` with a != b, else None."""
    if t.op == "Sum" and t.args[0].op == "Ax" and t.args[1].op == "Sum" and t.args[1].args[0].op == "Ax":
        a, b = t.args[0].args[0], t.args[1].args[0].args[0]
        if a != b:
            return a, b, t.args[1].args[1]
    return None


def _index_conds(t: Term) -> list:
    """The conditions of the where()s in ``t`` built from indices and constants only."""
    ok = ("Idx", "Num", "Size", "Add", "Sub", "Neg", "Mul", "Abs", "CmpLt", "CmpLe", "CmpGt", "CmpGe",
          "LAnd", "LOr", "LNot")
    return [u.args[0] for u in t.walk() if u.op == "Where" and any(x.op == "Idx" for x in u.args[0].walk())
            and all(x.op in ok for x in u.args[0].walk())]


def two_loop_axes(sums: dict, F: str, tensors, out_axes) -> tuple | None:
    """(tiled axis, second loop axis, {name: body}) when every term of ``sums`` is a sum over
    ``F`` and one other axis ``A`` (the same for all), nested either way, no output ranges
    over either, and every tensor (axes in ``tensors``) over the tiled axis also ranges over
    the looped one (else the looped axis is a vector axis of the body, contracted per tile:
    ``sum_i(sum_d(q * k * w))`` with ``w`` over i only); else None. The tiled axis is ``F`` unless the index-only where()
    conditions (the mask analysis's) read ``A`` and not ``F``: then ``A`` is tiled, so that the
    mask analysis bounds its tiles, and ``F`` is looped over."""
    ds = {n: _double_sum(t) for n, t in sums.items()}
    if not ds or any(d is None or F not in d[:2] for d in ds.values()):
        return None
    others = {d[1] if d[0] == F else d[0] for d in ds.values()}
    if len(others) != 1:
        return None
    A = others.pop()
    if any(F in ax or A in ax for ax in out_axes):
        return None
    bodies = {n: d[2] for n, d in ds.items()}
    read = {x.args[0] for b in bodies.values() for c in _index_conds(b) for x in c.walk() if x.op == "Idx"}
    if A in read and F not in read:
        F, A = A, F
    over = [ax for ax in tensors if F in ax]
    if not over or not all(A in ax for ax in over):
        return None
    return F, A, bodies


def double_sum_axis(prog) -> str | None:
    """The axis to fuse program ``prog`` over (``compile_program(prog, axis=...)``) so that its
    states are double sums a sum kernel takes with two loop axes (``sum_i(sum_r(x))``: ``i``;
    fused over the inner axis, the outer sum would be staged as a second program over an
    intermediate): every output is ``sum_a(sum_b(x))`` with the same ``a`` and ``b``, neither an
    axis of the output, and ``x`` (itself no sum) contracts another axis inside (a dot: the sum
    kernel's family; a body without one, a norm's weight gradient, is the row family's); else
    None."""
    ds = [_double_sum(e.term) for e in prog.outputs.values()]
    if not ds or any(d is None for d in ds) or len({d[:2] for d in ds}) != 1:
        return None
    if not all(d[2].op != "Sum" and any(u.op == "Sum" for u in d[2].walk()) for d in ds):
        return None
    a, b = ds[0][:2]
    if any(a in e.axes or b in e.axes for e in prog.outputs.values()):
        return None
    return a


def compile_two_loops(prog, compile_one=None, **kw):
    """``prog`` compiled as one sum kernel with two loop axes (over ``double_sum_axis``), or
    None when it is not of that form or does not compile to one (the caller then tries its
    other axes: a backward stage's ``compile_stage``). ``compile_one``: the compiler to call
    (default codegen.compile.compile_program)."""
    a = double_sum_axis(prog)
    if a is None:
        return None
    if compile_one is None:
        from acefuse.codegen.compile import compile_program as compile_one
    try:
        k = compile_one(prog, axis=a, **kw)
    except Exception:  # noqa: BLE001 - not this form after all: the caller's axes, as before
        return None
    from acefuse.codegen.riders import sum_kernel
    return k if sum_kernel(k) and getattr(k.module, "LOOP2_AXES", None) else None
