"""Scatter outputs of the sum kernel (codegen/sums.py): the gradient of a lookup table.

A program that reads a table through a lookup, ``rel[r = g(i, j)]`` (a relative-position bias,
T5's buckets), has as the table's gradient a sum over every (query, key) element of the ones
that read each entry: ``grad_rel[h, r] = sum_j(sum_i(where(index(r) == g(i, j), sum_b(dS), 0)))``
(af.backward's adjoint of a lookup). Summed per table entry, that is one pass over (i, j) per
entry; read instead as a *scatter*, it is one pass over (i, j) in all: every element of a
(rows x loop tile) adds its value ``dS`` into the entry its index ``g`` names (``tl.atomic_add``
into a zeroed float32 buffer). The identity used: for a finite set S and a function g on it,
``sum_{s in S} where(r == g(s), x_s, 0) = sum_{s in S, g(s) = r} x_s`` for every r, i.e. the
sum over S splits by the value of g (exact over the reals; the buffer adds in float32, in an
order the GPU chooses, like the riders' sums, codegen/riders.py).

The scatter rides the pass of the stage whose loop and rows cover the summed axes: the
summed axes must be exactly the kernel's loop axis, its row axes and the grid axes the output
does not have (each program adds its part; the atomics sum across programs).
"""
from __future__ import annotations

from dataclasses import dataclass

from acefuse.rewrite.terms import Term, pretty
from acefuse.codegen.emit import CodegenError


@dataclass
class Scatter:
    state: str     # the state (a sum over the loop axis) this output is
    axis: str      # the table axis, ``r``
    index: Term    # the entry each element adds into, ``g(i, j)``
    body: Term     # the value each element adds, ``dS``
    summed: set    # the axes summed besides the loop axis (rows, grid axes the output lacks)


def find_scatters(name, F, states: dict, enc) -> dict:
    """{output: Scatter} for the outputs that are a state of the form
    ``sum_F(sum_A(where(index(r) == g, sum_B(x), 0)))`` (sums over other axes, in any nesting,
    around and inside the where), ``r`` an axis of the output that ``g`` and ``x`` do not
    range over and that no other output has."""
    out = {}
    for o, t in enc.outputs.items():
        if t.op != "St" or t.args[0] not in states:
            continue
        src = states[t.args[0]]
        if src.op != "Sum" or src.args[0].op != "Ax" or src.args[0].args[0] != F:
            continue
        body, summed = src.args[1], set()
        while body.op == "Sum" and body.args[0].op == "Ax":
            summed.add(body.args[0].args[0])
            body = body.args[1]
        if body.op != "Where" or not (body.args[2].op == "Num" and body.args[2].args[0] == 0):
            continue
        c = body.args[0]
        if c.op != "CmpEq":
            continue
        axes = set(enc.output_axes[o])
        for idx, g in ((c.args[0], c.args[1]), (c.args[1], c.args[0])):
            if idx.op == "Idx" and idx.args[0] in axes and not _mentions(g, idx.args[0]):
                break
        else:
            continue
        tax = idx.args[0]
        x = body.args[1]
        while x.op == "Sum" and x.args[0].op == "Ax":
            summed.add(x.args[0].args[0])
            x = x.args[1]
        if _mentions(x, tax) or tax in summed:
            continue
        if any(tax in ax for o2, ax in enc.output_axes.items() if o2 != o):
            continue
        if not any(tax in ax for ax in enc.tensors.values()):
            raise CodegenError(f"program {name!r}: output {o!r} scatters into axis {tax!r}, which no input has "
                               "(its length is unknown); pass the table whose gradient it is as an input")
        out[o] = Scatter(t.args[0], tax, g, x, summed)
    return out


def _mentions(t: Term, axis: str) -> bool:
    return any(u.op == "Idx" and u.args[0] == axis for u in t.walk())


def check_scatters(gen) -> None:
    """Each scatter's summed axes are what one pass adds: the loop axis, the row axes and the
    grid axes its output lacks; its output is over grid axes and its table axis only."""
    for o, sc in gen.scatters.items():
        ax = gen.out_axes[o]
        if gen.F2:
            raise CodegenError(f"program {gen.name!r}: output {o!r} scatters into {sc.axis!r}, and the states loop "
                               f"over a second axis {gen.F2!r} (not supported together)")
        bad = [a for a in ax if a != sc.axis and a not in gen.G]
        if bad:
            raise CodegenError(f"program {gen.name!r}: output {o!r} scatters into {sc.axis!r} but also ranges over "
                               f"{bad}, which are not grid axes of this pass ({gen.G})")
        want = set(gen.R) | {a for a in gen.G if a not in ax}
        if sc.summed != want:
            raise CodegenError(f"program {gen.name!r}: output {o!r} = a scatter into {sc.axis!r} summing over "
                               f"{sorted(sc.summed)} besides {gen.F!r}; this pass adds over {sorted(want)} "
                               "(its rows and the grid axes the output lacks); it needs a stage of its own")


def scatter_lines(gen, full: bool) -> list:
    """A loop tile's scatter: every (row, loop) element of the tile adds its value into the
    table entry its index names (masked to the tile and to indices inside the table)."""
    body = []
    for o, sc in gen.scatters.items():
        gen.lines = []
        e, sh = gen.emit(sc.body)
        if sh not in ("rf", "r", "f", "s"):
            raise CodegenError(f"program {gen.name!r}: output {o!r}: `{pretty(sc.body)}` is not a "
                               f"(rows x {gen.F!r}) tile")
        e = gen.bcast(e, sh, "rf") if sh != "s" else e
        if sh != "rf":
            e = f"({e}) + tl.zeros([BLOCK_I, BLOCK_J], tl.float32)"
        gi, gs, bad = gen.emit_int(sc.index)
        if gs != "rf":   # an index over the rows or the loop axis only: one per element of the tile
            gi = gen.bcast(gi, gs, "rf") if gs != "s" else gi
            gi = gen.bind(f"({gi}) + tl.zeros([BLOCK_I, BLOCK_J], tl.int64)", "rf", "sx")[0]
        ok = f"({gi} >= 0) & ({gi} < len_{sc.axis}) & " + ("rmask[:, None]" if full else "tmask")
        if bad:
            ok += f" & ~({gen.bcast(bad, gs, 'rf') if gs != 's' else bad})"
        ok = gen.bind(ok, "rf", "sk")[0]
        gen.lines.append(f"tl.atomic_add({o}_ptr + off_{o}_g + tl.where({ok}, {gi}, 0) * s_{o}_{sc.axis}, "
                         f"tl.where({ok}, {e}, 0.0), mask={ok})")
        body.append(f"        # {o}[{sc.axis} = {pretty(sc.index)}] += {pretty(sc.body)}  (a scatter: "
                    f"sum over {', '.join(sorted(sc.summed | {gen.F}))} split by the entry read)")
        body.extend("        " + x for x in gen.lines)
    return body


# ---- row scatters: a state's rows added into the table entries an index names ----------------------
# A backward stage's output ``sum_a(X)`` (paged keys' dK over (b, h, j, d)) that the gradient reads
# only through a scatter, ``grad_kc[h, n, d] = sum_{b, j}(where(n == g(b, j), dK[b, h, j, d], 0))``
# (acefuse/backward.py ``_split_row_scatters``, ``stage.row_scatters``): after the loop, each row of
# the state is added into the entry ``g`` names (``tl.atomic_add`` into a zeroed float32 buffer
# shaped like the table, rounded once to the output type by the launcher), instead of being
# stored. The same identity as above, over the rows: the sum over the rows splits by the value
# of ``g``; rows whose index falls outside the table add nothing (a lookup there read NaN,
# whose adjoint ``where(n == g, ...)`` is 0 for every entry).
def setup_row_scatters(gen) -> None:
    """Check the row scatters of ``gen`` (a SumGen) once its axes are classified, and give each
    its buffer's axes (the table's: ``gen.out_axes``, what the launcher allocates)."""
    for o, (n, g, axes) in gen.row_scatters.items():
        if o not in gen.outs:
            raise CodegenError(f"program {gen.name!r}: output {o!r} is scattered row by row into {n!r}, but it is "
                               f"not a state of this pass over {gen.F!r}")
        if gen.F2:
            raise CodegenError(f"program {gen.name!r}: output {o!r} scatters into {n!r}, and the states loop over "
                               f"a second axis {gen.F2!r} (not supported together)")
        if n in gen.G + gen.R + gen.V or n == gen.F:
            raise CodegenError(f"program {gen.name!r}: output {o!r} scatters into {n!r}, an axis this pass also "
                               "runs over")
        if not any(n in ax for ax in gen.tensors.values()):
            raise CodegenError(f"program {gen.name!r}: output {o!r} scatters into axis {n!r}, which no input has "
                               "(its length is unknown); pass the table whose gradient it is as an input")
        vs = [a for a in gen.out_axes[o] if a in gen.V]
        bad = [a for a in axes if a != n and a not in gen.G + gen.R + vs]
        if bad:
            raise CodegenError(f"program {gen.name!r}: output {o!r} scatters into {n!r}, and its table also ranges "
                               f"over {bad}, which this pass does not run over")
        if n not in gen.Lk:
            gen.Lk.append(n)
        gen.out_axes[o] = tuple(axes)


def row_scatter_store(gen, o: str, val: str, sh) -> list:
    """The lines after the loop that add the state ``val`` (shape ``sh``: rows, or rows x a
    vector axis) of output ``o`` into the entries its index names, masked to the rows and to
    indices inside the table."""
    from acefuse.codegen.sums import _over_f
    n, g, _ = gen.row_scatters[o]
    gen._final, gen._memo, gen._raw = [], {}, {}
    gen._wide = {k: v for k, v in gen._wide.items() if not _over_f(v[1])}
    try:
        gi, gs, bad = gen.emit_int(g)
        lines = gen._final
    finally:
        gen._final = None
    if gs not in ("r", "s"):
        raise CodegenError(f"program {gen.name!r}: output {o!r}: the entry `{pretty(g)}` it scatters into is not "
                           f"one per row of this pass")
    if gs == "s":
        gi = f"(({gi}) + tl.zeros([BLOCK_I], tl.int64))"
    ok = f"rmask & ({gi} >= 0) & ({gi} < len_{n})" + (f" & ~({bad})" if bad else "")
    lines.append(f"    sk_{o} = {ok}")
    rows = [a for a in gen.out_axes[o] if a in gen.R]
    ptr = f"{o}_ptr + off_{o}_g" + (f" + off_{o}_r" if rows else "") + f" + tl.where(sk_{o}, {gi}, 0) * s_{o}_{n}"
    mask = f"sk_{o}"
    if isinstance(sh, tuple):
        c, m = gen.vec(sh[1])
        ptr = f"({ptr})[:, None] + {c}[None, :] * s_{o}_{sh[1]}"
        mask = f"sk_{o}[:, None] & {m}[None, :]"
    return ([f"    # {o}[{n} = {pretty(g)}] += this row's sum (a scatter: the sum over the rows split by the "
             "entry each one names)"] + lines + [f"    tl.atomic_add({ptr}, ({val}).to({o}_ptr.dtype.element_ty), mask={mask})"])
