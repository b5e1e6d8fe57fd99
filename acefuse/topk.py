"""Top-k selection, written plainly: ``values, indices = af.topk(x, k, axis)``.

The result ranges over the operand's other axes plus a new axis of size k (named ``"k"``
unless ``kaxis=`` says otherwise), the largest first. It is an ordinary program: the t-th
candidate is the largest element strictly after the (t-1)-th in the order

    (a, i) before (b, j)  <=>  a > b, or a == b and i < j      (NaN counts as the largest)

written, for the reference evaluator and the unfused kernel, as a cascade of plain reductions
over ``axis``: the distinct values in decreasing order (``u_0 = max(y)``, ``u_s = max(where(y <
u_{s-1}, y, -inf))``, y being x with NaN read as +inf), the count of each, and the positions of
each value's first occurrences (g the index, negative for a NaN so NaNs come first); candidate
t's index is picked from them by the counts, and its value is x at that index, as torch.topk's
values are ``x.gather(idx)``: ``sum(where(index == idx_t, x, 0))`` (a one-hot sum: exact, but
-0.0 reads +0.0 where the cascade is evaluated; the fused kernels carry the element itself),
NaN where the candidate is a NaN. So ``af.backward`` differentiates a one-hot sum: the adjoint
goes to the chosen position (torch.topk's gradient; equal values do not share it; no
recomputed value has to match a saved one), and the augmented forward saves candidates and the
reductions the one pass carries (top-k of softmax probabilities trains with its one-pass
forward fusion), not the cascade's levels and counts, which need more passes.

The fusion does not derive anything from that cascade. Each candidate term is registered
(``CANDIDATES``, and ``af.gather`` at a candidate's index in ``PAYLOADS``) with its selection
(``TopKSpec``), and acefuse/topk_fuse.py makes the selection one reduction kind: a state of k
(value, rank) pairs per row (plus the gathered values, carried with their candidate), whose
tile definition is k rounds of (max, lowest rank among the maxima, mask it out), and whose
rolling update and split merge are the merge of two k-candidate states proved for every block
size by proofs/topk.py (the certificate refuses any other network, so a wrong merge does not
run). One pass in the single, loop and split schedules; deriving k = 8 takes about a second
and a few hundred MB (it took 153 s and 17 GB through the cascade). Design choice: a reduction
kind recognised from the construct, not rules over the cascade, because the cascade's terms
grow with k while the k-candidate merge is proved once per k by a decision procedure. A
program outside what topk_fuse covers (an output elementwise over the axis, a reduction that
reads a candidate) goes to the general engine, which fuses the cascade into about k + 2
passes (the values read the indices). Top-k of a strictly increasing function of a score (softmax probabilities
``exp(x - m) / l``) is selected on the score, one pass (proofs/monotone.py proves it).

Conventions (torch.topk leaves the order of equal values unspecified; these are fixed):

- equal values: the lowest index first (``torch.sort(x, descending=True, stable=True)``);
- NaN is larger than every number, +inf included (as torch.sort and torch.topk): NaNs come
  first, lowest index first, with value NaN;
- top-k of a strictly increasing chain ``f(u)`` of a score u (proofs/monotone.py; e.g. softmax
  probabilities of logits): candidates are ordered by the exact (real) value of ``f(u)`` on the
  float inputs and the finished row constants; where float32 rounding makes two distinct exact
  values equal, the larger exact value (the larger score) comes first; equal exact values: the
  lowest index first. The values are the program's expression at the chosen candidates (bit
  for bit). A row whose normaliser is NaN (a NaN or +inf logit: every value NaN) gives
  candidates 0..k-1 with value NaN, as the program written plainly does;
- ``k`` must be at most the axis length: a row with fewer than k elements is refused at
  run time by the compiled kernel (``torch.topk`` raises too).

Indices are int64 outputs (``cast(..., "index")``), exact for axes of up to 2**24 elements.
``Stacked`` is the container of the k candidates: elementwise arithmetic, ``af.exp`` and the
other functions of one operand, ``.sum()`` / ``.max()`` / ``.min()`` over the new axis (a
renormalisation is ``w = vals / vals.sum()``) and lookups ``t.at(a=indices)`` apply to every
candidate; ``af.program`` writes a Stacked output as one tensor with the new axis last.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from acefuse import lang
from acefuse.lang import Expr, LanguageError
from acefuse.rewrite.terms import Term


@dataclass(frozen=True)
class TopKSpec:
    """One ``af.topk`` selection: the k first elements along ``axis`` in the order of (``y``
    decreasing, then ``g`` increasing). ``y`` is the operand with NaN read as +inf, ``g`` the
    index (negative for a NaN). Program-level terms."""
    axis: str
    y: Term
    g: Term
    k: int


# The language construct, recognised by the fusion (acefuse/topk_fuse.py): each candidate term
# af.topk writes is registered with its selection; af.gather at a candidate's index, too.
# Keyed by the term's identity (hashing a cascade's term walks all of it), the term kept alive.
CANDIDATES: dict = {}   # id(candidate value / rank term) -> (term, TopKSpec, r, "v" | "i")
POSITIONS: dict = {}    # id(the index output's term, cast to "index") -> (term, TopKSpec, r)
PAYLOADS: dict = {}     # id(af.gather's term) -> (term, TopKSpec, r, gathered program term)


class Stacked:
    """k expressions over the same axes, read as one tensor with a new last axis of size k
    (``af.topk``'s values and indices)."""

    __array_priority__ = 1001
    _acefuse_elementwise_over_parts = True   # Expr's operators defer to ours (``s - vals``)

    def __init__(self, parts, axis: str, source_axis: str | None = None, origin: str | None = None):
        parts = [lang._lift(p) for p in parts]
        self.source_axis = source_axis   # the axis topk selected along (a row must hold k elements)
        self.origin = origin             # the af.topk call it comes from, short (for error messages)
        if not parts:
            raise LanguageError("a stacked expression needs at least one part")
        if axis in parts[0].axes:
            raise LanguageError(f"stacked axis {axis!r} is already an axis of `{parts[0]}`; pick another kaxis=")
        self.parts, self.axis = parts, axis

    def __len__(self):
        return len(self.parts)

    def __getitem__(self, r) -> Expr:
        """The r-th candidate (an expression over the other axes)."""
        return self.parts[r]

    def __iter__(self):
        return iter(self.parts)

    @property
    def axes(self) -> tuple:
        ax: list = []
        for p in self.parts:
            ax += [a for a in p.axes if a not in ax]
        return tuple(ax) + (self.axis,)

    def map(self, fn) -> "Stacked":
        """``fn`` applied to every candidate."""
        return Stacked([fn(p) for p in self.parts], self.axis, self.source_axis, self.origin)

    def _zip(self, other, fn, swap=False):
        if isinstance(other, Stacked):
            if other.axis != self.axis or len(other) != len(self):
                raise LanguageError(f"cannot combine stacked expressions over {self.axis!r} (size {len(self)}) "
                                    f"and {other.axis!r} (size {len(other)}); they must share the axis and k")
            pairs = zip(self.parts, other.parts)
        else:
            pairs = ((p, other) for p in self.parts)
        src = self.source_axis or getattr(other, "source_axis", None)
        origin = self.origin or getattr(other, "origin", None)
        return Stacked([fn(b, a) if swap else fn(a, b) for a, b in pairs], self.axis, src, origin)

    def __add__(self, o): return self._zip(o, lambda a, b: a + b)
    def __radd__(self, o): return self._zip(o, lambda a, b: a + b, True)
    def __sub__(self, o): return self._zip(o, lambda a, b: a - b)
    def __rsub__(self, o): return self._zip(o, lambda a, b: a - b, True)
    def __mul__(self, o): return self._zip(o, lambda a, b: a * b)
    def __rmul__(self, o): return self._zip(o, lambda a, b: a * b, True)
    def __truediv__(self, o): return self._zip(o, lambda a, b: a / b)
    def __rtruediv__(self, o): return self._zip(o, lambda a, b: a / b, True)
    def __neg__(self): return self.map(lambda p: -p)

    def sum(self) -> Expr:
        """The sum over the stacked axis (first candidate first)."""
        out = self.parts[0]
        for p in self.parts[1:]:
            out = out + p
        return out

    def max(self) -> Expr:
        out = self.parts[0]
        for p in self.parts[1:]:
            out = lang.maximum(out, p)
        return out

    def min(self) -> Expr:
        out = self.parts[0]
        for p in self.parts[1:]:
            out = lang.minimum(out, p)
        return out

    def __bool__(self):
        raise LanguageError("a stacked expression has no truth value; use af.where")

    def describe(self) -> str:
        """A short name for error messages (the parts of a top-k cascade print as pages)."""
        return (f"a stacked expression ({len(self)} candidates over {self.axis!r}"
                + (f", from {self.origin}" if self.origin else "") + ")")

    def __repr__(self):
        return f"Stacked({len(self)} over {self.axis!r}: {', '.join(str(p) for p in self.parts)})"


def topk(x, k: int, axis: str, kaxis: str = "k"):
    """``(values, indices)``: the k largest elements of ``x`` along ``axis`` and their int64
    indices, the largest first, as ``Stacked`` expressions over ``x``'s other axes plus the new
    axis ``kaxis`` of size k (written last). Equal values: the lowest index first; NaN counts as
    larger than every number (module docstring). ``k`` is 1 to 64 (one k-candidate state,
    acefuse/topk_fuse.py; the cascade kept for reference has about k(k + 5) / 2 reductions).

        >>> vals, idx = topk(lang.tensor("x", "t e"), 2, "e")
        >>> vals.axes, idx.axes
        (('t', 'k'), ('t', 'k'))
    """
    if isinstance(x, Stacked):
        raise LanguageError(f"topk of {x.describe()}, k = {k}, axis {axis!r}: top-k of top-k candidates "
                            "is not supported. Select once from the original operand (its candidates "
                            "come largest first), or use one candidate `vals[r]` or `vals.max()`, "
                            "`.min()`, `.sum()` over the candidates")
    x = lang._lift(x)
    lang._reduce("RMax", x, axis, "topk")   # checks the axis
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
        raise LanguageError(f"topk(`{x}`, {k!r}, {axis!r}): k must be an integer from 1 to 64")
    lang._axes(kaxis, "topk kaxis")
    if kaxis in x.axes or kaxis == axis:
        raise LanguageError(f"topk(`{x}`, {k}, {axis!r}): the new axis {kaxis!r} must not be an axis of the "
                            "operand; pass another name, e.g. kaxis='kk'")
    inf = math.inf
    nan = x.ne(x)
    y = lang.where(nan, inf, x)                                   # NaN ranks as +inf ...
    j = lang.index(axis)
    g = lang.where(nan, j - lang.size(axis), j)                   # ... before every +inf (a negative rank)
    spec = TopKSpec(axis, y.term, g.term, k)
    # level s: the s-th largest distinct value u_s (the largest below u_{s-1}), its count c_s, and the
    # positions of its first k - s occurrences, each the first after the previous one
    levels, counts, occ = [], [], []
    for lv in range(k):
        u = lang.max(y if not levels else lang.where(y < levels[-1], y, -inf), axis)
        here = y.eq(u)
        row: list = []
        for _ in range(k - lv):
            row.append(lang.min(lang.where(here if not row else here & (g > row[-1]), g, inf), axis))
        levels.append(u)
        counts.append(lang.sum(lang.where(here, 1.0, 0.0), axis))
        occ.append(row)
    before = [lang.const(0.0)]                                    # C_s: candidates before level s
    for c in counts[:-1]:
        before.append(c if len(before) == 1 else before[-1] + c)
    vals, idxs = [], []
    for t in range(k):   # candidate t: level s with C_s <= t < C_{s+1}, occurrence t - C_s (<= t - s)
        i = None
        for lv in reversed(range(t + 1)):
            pick = occ[lv][t - lv] if lv else occ[0][t]
            for r in reversed(range(t - lv if lv else 0)):
                pick = lang.where((t - before[lv]).eq(r), occ[lv][r], pick)
            i = pick if i is None else lang.where(before[lv + 1] > t, pick, i)
        idxs.append(lang.cast(lang.where(i < 0, i + lang.size(axis), i), "index"))
        # the value: the operand at the candidate's position (torch.topk's values: x.gather(idx)),
        # its level wherever i >= 0, as a one-hot sum. Written so, the derivative is the adjoint
        # scattered to that position (torch.topk's; ties do not share it) and a backward saves
        # the candidates, which the fused pass carries, not the cascade's levels and counts
        at = lang.sum(lang.where(j.eq(idxs[-1]), x, 0.0), axis)
        vals.append(lang.where(i < 0, math.nan, at))
        CANDIDATES[id(at.term)] = (at.term, spec, t, "v")   # by identity (the term is kept alive)
        CANDIDATES[id(i.term)] = (i.term, spec, t, "i")
        POSITIONS[id(idxs[-1].term)] = (idxs[-1].term, spec, t)
    origin = f"topk(`{_short(x)}`, {k}, {axis!r})"
    return Stacked(vals, kaxis, axis, origin), Stacked(idxs, kaxis, axis, origin)


def _short(e, n: int = 60) -> str:
    """An expression's text, cut to about n characters (for error messages)."""
    text = str(e)
    return text if len(text) <= n else text[:n - 3] + "..."


def gather(x, idx, axis: str):
    """The element of ``x`` at position ``idx`` along ``axis`` (``torch.gather`` of one index per
    row), written as a reduction: ``max(where(index(axis) == idx, x, -inf), axis)``, exact (NaN
    and -0.0 included). ``x`` may be any expression (``af.sigmoid(x)``), ``idx`` af.topk's
    indices (then one value per candidate). Unlike ``t.at(axis=idx)``, which reads an input
    tensor, it is a plain reduction, so the certificate covers it. At af.topk's indices (same
    axis) the fusion carries ``x`` at each candidate's position with the candidate (a payload
    moved whole by the proved merge): no extra pass."""
    if isinstance(idx, Stacked):
        return idx.map(lambda i: gather(x, i, axis))
    if isinstance(x, Stacked):
        raise LanguageError(f"gather from {x.describe()} along {axis!r} is not supported; gather from "
                            "the expression the candidates were selected from")
    x = lang._lift(x)
    lang._reduce("RMax", x, axis, "gather")
    idx = lang._lift(idx)
    if axis in idx.axes:
        raise LanguageError(
            f"gather(`{_short(x)}`, `{_short(idx)}`, {axis!r}): the index ranges over {axis!r}, the axis it "
            f"selects along, so there would be one position per element, not one per row. Give the index "
            f"one position per row (an expression over the other axes, e.g. af.topk's or af.argmax's "
            f"indices along {axis!r}); for one position per element (torch.gather with an index of x's "
            f"shape), name the index's axis differently (af.tensor('idx', '... s')): the result ranges "
            f"over that axis")
    out = lang.max(lang.where(lang.index(axis).eq(idx), x, -math.inf), axis)
    sel = POSITIONS.get(id(getattr(idx, "term", None)))
    if sel is not None and sel[1].axis == axis:
        PAYLOADS[id(out.term)] = (out.term, sel[1], sel[2], x.term)
    return out


# ---- programs with stacked outputs ------------------------------------------------------------
def part_name(name: str, r: int) -> str:
    """The name of the r-th candidate of stacked output ``name`` inside the program."""
    return f"{name}__{r}"


def expand(name: str, value: Stacked) -> dict:
    """{part name: expression} for a stacked output (Program's hook)."""
    return {part_name(name, r): p for r, p in enumerate(value.parts)}


def stack_outputs(prog, out):
    """A kernel's (or acefuse.reference.evaluate's) outputs with every stacked output of
    ``prog`` gathered into one tensor, the stacked axis last: always a dict (StackedOutputs),
    even for one output. Outputs a row-family kernel already wrote stacked (codegen/stacked.py)
    are taken as they are."""
    stacked = getattr(prog, "stacked", None) or {}
    if not stacked:
        return out
    if not isinstance(out, dict):
        raise TypeError(f"program {prog.name!r}: expected a dict of outputs")
    res = StackedOutputs(prog)
    for name in prog.user_outputs:
        if name in stacked and name not in out:
            parts = [out[p] for p in stacked[name][1]]
            if hasattr(parts[0], "dim"):
                import torch
                res[name] = torch.stack(parts, -1)
            else:
                import numpy as np
                res[name] = np.stack(parts, -1)
        else:
            res[name] = out[name]
    return res


class StackedOutputs(dict):
    """{output: tensor} with stacked outputs stacked; a candidate's own name inside the
    program (``weights__0``) still reads its slice, so generic checks over
    ``program.outputs`` (acefuse run --check, the example tests) work unchanged."""

    def __init__(self, prog):
        super().__init__()
        self._prog = prog

    def __missing__(self, key):
        for n, (_, parts, _) in self._prog.stacked.items():
            if key in parts:
                return self[n][..., parts.index(key)]
        raise KeyError(key)


class StackedKernel:
    """A compiled program with stacked outputs. A row-family kernel writes each stacked output
    as one tensor itself (codegen/stacked.py) and returns them as they are: no per-call work
    here beyond the row-length check; other kernels' candidates are stacked after the call."""

    def __init__(self, prog, kernel):
        self.program, self.kernel = prog, kernel
        names = list(prog.tensors)
        # (input, its position, the dimension of the selected axis, k, axis): a row must hold k elements
        rows = {}
        for n, (_, parts, axis) in prog.stacked.items():
            holder = next((t for t in names if axis is not None and axis in prog.tensors[t]), None)
            if holder is not None:
                rows[(holder, names.index(holder), list(prog.tensors[holder]).index(axis), len(parts), axis)] = None
        self._rows = list(rows)
        mod = getattr(getattr(kernel, "kernel", None), "module", None)
        stacked = getattr(mod, "STACKED", None) or {}
        # the class of the launcher's result when it writes every stacked output itself
        self._direct = getattr(mod, "StackedOutputs", None) if set(stacked) == set(prog.stacked) else None

    def __getattr__(self, name):   # fusion, source, path, ... of the kernel
        return getattr(self.kernel, name)

    def __call__(self, *args, **inputs):
        for t, pos, dim, k, axis in self._rows:
            v = inputs.get(t) if pos >= len(args) else args[pos]
            n = v.shape[dim] if hasattr(v, "shape") and len(v.shape) > dim else k
            if n < k:
                raise ValueError(f"program {self.program.name!r}: top-{k} over axis {axis!r}, but input {t!r} "
                                 f"has only {n} elements along it; use k <= {n}")
        out = self.kernel(*args, **inputs)
        if out.__class__ is self._direct:   # written stacked by the kernel
            return out
        if not isinstance(out, dict):   # one output: a program of one part
            (name,) = [p for n in self.program.user_outputs for p in self.program.stacked.get(n, (None, [n]))[1]]
            out = {name: out}
        return stack_outputs(self.program, out)

    def __repr__(self):
        return f"<acefuse stacked-output kernel {self.program.name!r}: {self.kernel!r}>"
