"""Stacked outputs of the row family: af.topk's k candidates written as one tensor.

A program output that is a ``Stacked`` (``vals / vals.sum()``, ``idx`` of ``af.topk``) is k
outputs inside the program (``weights__0`` ... ``weights__{k-1}``, acefuse/topk.py). The
row family writes them as **one** tensor ``weights`` with the stacked axis last (``[t, k]``,
what af.topk documents), in the kernel: a row output's k values are put in a
``[BLOCK_R, K]`` register block (k - 1 selects on a ``tl.arange(0, K)`` column index) and
stored by one masked store per row block; an output elementwise over the fused axis stores
each candidate's tile at its offset along the stacked axis. So the launcher allocates one
tensor per stacked output and passes one pointer (not k), and nothing is stacked afterwards.

The generated launcher returns a ``StackedOutputs`` dict: ``out["weights"]`` is the
``[t, k]`` tensor, and a candidate's own name (``out["weights__0"]``) still reads its slice
(a view), so code written against the per-candidate names keeps working. A row with fewer
elements along the selected axis than k is refused once per call signature (the launcher's
plan), with the program, the axis, the input and what to do.

An output is stacked when all its candidates are outputs of this kernel with the same axes and
storage type, and the stacked axis is no axis of an input; otherwise (never for af.topk's own
outputs) its candidates stay separate outputs, stacked by acefuse.topk.stack_outputs.
"""
from __future__ import annotations


def stacks(gen) -> dict:
    """{stacked output: (stacked axis, [its candidates' names], axis selected along)} of the
    program that ``gen`` (a RowGen) writes as one tensor each (module docstring)."""
    declared = getattr(gen.f.program, "stacked", None) or {}
    if not declared:
        return {}
    sdt = gen.store_dtypes()
    input_axes = {a for ax in gen.tensors.values() for a in ax}
    out = {}
    for name, (kax, parts, src) in declared.items():
        if not all(p in gen.outputs for p in parts):
            continue
        ax = tuple(gen.out_axes[parts[0]])
        if (kax in input_axes or kax == gen.axis or any(tuple(gen.out_axes[p]) != ax for p in parts)
                or len({sdt.get(p) for p in parts}) > 1):
            continue
        out[name] = (kax, list(parts), src)
    return out


def emit_row_store(gen, em, name, values):
    """Store the k row values ``values`` (one per candidate, first candidate first, each one
    value per row) of stacked output ``name`` as one [BLOCK_R, K] block."""
    kax, parts, _ = gen.stacks[name]
    k = len(parts)
    row_axes = [a for a in gen.out_axes[parts[0]] if a != gen.axis]
    if k == 1:
        off = f"off_{name}" if row_axes else "rows * 0"
        em.line(f"tl.store({name}_ptr + {off}, {gen.stored(parts[0], values[0], dst=name)}, mask=rmask)")
        return
    off = f"off_{name}[:, None]" if row_axes else "rows[:, None] * 0"
    kp = 1 << (k - 1).bit_length()
    em.comment(f"output {name}: its {k} candidates as one [BLOCK_R, {kp}] block along {kax!r}, one store")
    kk = em.fresh("kk")
    em.assign(kk, f"tl.arange(0, {kp})[None, :]")
    blk = em.fresh("stk")
    em.assign(blk, f"{values[-1]}[:, None] + tl.zeros([BLOCK_R, {kp}], tl.float32)")
    for r in range(k - 2, -1, -1):
        em.assign(blk, f"tl.where({kk} == {r}, {values[r]}[:, None], {blk})")
    mask = f"rmask[:, None] & ({kk} < {k})" if kp != k else "rmask[:, None]"
    em.line(f"tl.store({name}_ptr + {off} + {kk} * s_{name}_{kax}, {gen.stored(parts[0], blk, dst=name)}, "
            f"mask={mask})")


def launcher_lines(gen) -> list:
    """The launcher's constants and helpers for stacked outputs (empty without any)."""
    st = {n: (kax, len(parts), src, parts) for n, (kax, parts, src) in gen.stacks.items()}
    parts = {p: (n, r) for n, (_, _, _, ps) in st.items() for r, p in enumerate(ps)}
    # which input (and dimension) holds each selected axis: the row-length check of the plan
    holders = {}
    for n, (_, k, src, _) in st.items():
        for t, ax in gen.tensors.items():
            if src in ax:
                holders[(t, src, k)] = None
                break
    return [
        f"STACKED = {st!r}   # af.topk outputs written as one tensor, the stacked axis last: (axis, k, selected along, candidates)",
        f"PARTS = {parts!r}   # a candidate's own name -> (its stacked output, its position)",
        f"_ROW_LENGTH = {list(holders)!r}   # (input, selected axis, k): a row must hold k elements",
        "",
        "",
        "class StackedOutputs(dict):",
        "    \"\"\"{output: tensor}; each stacked output is one tensor with its stacked axis last, and a",
        "    candidate's own name inside the program (``weights__0``) reads its slice (a view).\"\"\"",
        "",
        "    def __missing__(self, key):",
        "        if key in PARTS:",
        "            n, r = PARTS[key]",
        "            return self[n][..., r]",
        "        raise KeyError(key)",
        "",
        "",
        "def _check_stacked(sizes):",
        "    \"\"\"Refuse rows shorter than k along a selected axis (torch.topk raises too).\"\"\"",
        "    for t, axis, k in _ROW_LENGTH:",
        "        if sizes[axis] < k:",
        f"            raise ValueError(f\"program {gen.name!r}: top-{{k}} over axis {{axis!r}}, but input {{t!r}} has only \"",
        "                             f\"{sizes[axis]} elements along it; use k <= {sizes[axis]}\")",
    ]
