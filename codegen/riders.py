"""Riders: sums over rows computed in the pass of another stage.

A backward program often has two stages that read the same tensors: one fused over the
feature axis ``j`` (a layernorm's ``grad_x``: per-row sums over ``j``, then an elementwise
epilogue), and one whose outputs are sums over every row of a body elementwise over
``(rows, j)`` (``grad_w = sum_r(grad_y * xhat)``, ``grad_b = sum_r(grad_y)``). Run apart,
the second stage reads ``x`` and ``grad_y`` again. When a row fits one tile, the first
stage's kernel holds the body's operands in registers anyway: its persistent variant
(``RowGen.kernel_riders``) adds each body over the rows it visits into a per-program
partial row, and the caller folds the partials with the sum's merge (``s_AB = s_A + s_B``,
the rule ``sum-split``; the same fold the split schedule and the cross-GPU merge use).

Nothing here names a workload: a stage qualifies by its form alone (every output a sum
over exactly the other stage's row axes of a reduction-free body over that stage's
tensors, laid out over its fused axis). The second stage stays compiled: it runs when the
first stage's kernel takes another schedule (rows longer than one tile) or a launch option
excludes the persistent kernel.
"""
from __future__ import annotations


def rider_bodies(first, fusion, second) -> dict | None:
    """{output of ``second``: body} when every output of program ``second`` is a sum over
    exactly the row axes of ``fusion`` (the first stage's, fused over ``fusion.axis``) of a
    body without reductions that reads only tensors of ``first`` with the same axes; else
    None."""
    from acefuse.rewrite.encode import RED_OPS
    j = fusion.axis
    rows = sorted(a for a in first.axes if a != j)
    if not rows or not second.outputs:
        return None
    out = {}
    for name, e in second.outputs.items():
        t, reduced = e.term, []
        while t.op == "Sum" and t.args[0].op == "Ax":
            reduced.append(t.args[0].args[0])
            t = t.args[1]
        if sorted(reduced) != rows or tuple(e.axes) != (j,):
            return None
        if any(u.op in RED_OPS or u.op in ("Take", "St") for u in t.walk()):
            return None
        used = {u.args[0] for u in t.walk() if u.op == "In"}
        if not used or any(first.tensors.get(n) != second.tensors.get(n) for n in used):
            return None
        out[name] = t
    return out


def attach(stages, kernels, compile_kw=None) -> dict:
    """Give stage kernels riders where a later (or earlier) stage qualifies: returns
    {second stage index: first stage index}, and replaces ``kernels[first]`` (in place)
    with the same fusion's module that also has the persistent rider kernel. A module
    that cannot be generated with riders (a body the row family cannot lower) keeps the
    stages apart."""
    from acefuse.codegen import compile as cc
    from acefuse.codegen.emit import CodegenError
    from acefuse.codegen.contraction import is_contraction
    compile_kw = {k: v for k, v in (compile_kw or {}).items()
                  if k in ("allow_unproved", "allow_uncertified")}
    done: dict = {}
    for a, (sa, ka) in enumerate(zip(stages, kernels)):
        if type(ka) is not cc.Kernel or not ka.fusion.fusible or is_contraction(ka.fusion):
            continue
        if len(ka.fusion.passes) != 1:
            continue
        riders = {}
        owners = []
        for b, sb in enumerate(stages):
            if b == a or b in done or b in done.values():
                continue
            bodies = rider_bodies(sa, ka.fusion, sb)
            if bodies and not (bodies.keys() & riders.keys()) and not (bodies.keys() & set(sa.outputs)):
                riders.update(bodies)
                owners.append(b)
        if not riders:
            continue
        try:
            k = cc.compile_program(sa, fusion=ka.fusion, riders=riders, **compile_kw)
        except CodegenError:
            continue
        if getattr(k, "fusion", None) is not ka.fusion:   # the certificate gate chose another kernel
            continue
        kernels[a] = k
        for b in owners:
            done[b] = a
    return done


def fold(partials, dtype):
    """A rider's result: its per-program partial sums (float32, programs x j) folded with
    the sum's merge, in the stage's output type."""
    return partials.sum(0).to(dtype)
