"""From a program to block-local states over the fused axis.

For a block S of the fused axis, every reduction over that axis gets a
*block-local state*: the same reduction over S only, with every reference to an
earlier reduction replaced by its block-local counterpart (and ``size(axis)`` by
the block's count). An invariant value built from reductions and used inside a
later reduction's body (``mean = sum(x) / size(j)`` inside ``sum((x - mean)^2)``)
becomes a *reference state* (op ``ref``) so that the shift rule can use it as a
candidate.

Subterms free of reductions over the fused axis are abstracted to opaque leaves:
``Elm`` when they depend on the reduced element, ``Par`` when they do not. The
e-graph therefore only sees the dependence structure between reductions, which
keeps saturation small whatever the elementwise math around it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math

from acefuse.rewrite.terms import Term, pretty, A, substitute, reblock

RED_OPS = {"Sum": "sum", "RMax": "max", "RMin": "min"}
PREFIX = {"sum": "s", "max": "m", "min": "mn", "ref": "r"}


class EncodeError(ValueError):
    """The program cannot be encoded for the requested axis."""


@dataclass
class StateDef:
    """A state: the block-local value of a reduction (or a reference value)."""

    name: str
    op: str                 # "sum" | "max" | "min" | "ref"
    definition: Term        # over the placeholder block A (Term("BA"))
    source: Term            # the program-level term it stands for
    deps: tuple = ()        # states the definition refers to
    aux: str = ""           # an auxiliary state (rewrite/auxiliary.py): why a merge needed it

    def over(self, blk: Term) -> Term:
        """The definition over another block."""
        return reblock(self.definition, blk)

    @property
    def body(self):
        return self.definition.args[1] if self.op != "ref" else None


@dataclass
class Encoding:
    program_name: str
    axis: str
    states: list                       # StateDef, dependencies first
    leaves: dict                       # Elm/Par name -> program-level term
    outputs: dict                      # output -> program term with reductions as St(q, BJ)
    output_axes: dict                  # output -> axes
    tensors: dict                      # tensor -> axes
    unfused_passes: int = 0
    elementwise_outputs: tuple = ()    # outputs that range over the fused axis
    leaf_of: dict = field(default_factory=dict)

    def state(self, name) -> StateDef:
        return next(s for s in self.states if s.name == name)




class _Axes:
    """Axes of program-level terms (memoised)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.memo = {}

    def __call__(self, t: Term) -> frozenset:
        if t in self.memo:
            return self.memo[t]
        op = t.op
        if op == "In":
            r = frozenset(self.tensors[t.args[0]])
        elif op == "Idx":
            r = frozenset([t.args[0]])
        elif op in ("Num", "Size", "Par", "Cnt", "St"):
            r = frozenset()
        elif op == "Elm":
            r = frozenset(["?elm"])
        elif op in RED_OPS and t.args[0].op == "Ax":
            r = self(t.args[1]) - {t.args[0].args[0]}
        elif op == "Take":
            r = (frozenset(self.tensors[t.args[0]]) - {t.args[2]}) | self(t.args[1])
        else:
            r = frozenset().union(*(self(c) for c in t.children)) if t.children else frozenset()
        self.memo[t] = r
        return r


def encode(prog, axis: str) -> Encoding:
    """Block-local states of every reduction over ``axis`` in ``prog``."""
    if axis not in prog.axes:
        raise EncodeError(f"program {prog.name!r}: axis {axis!r} is not an axis of any input "
                          f"(axes: {' '.join(prog.axes)}); pass one of them as axis=")
    axes_of = _Axes(prog.tensors)
    red_names: dict[Term, str] = {}
    states: list[StateDef] = []
    leaves: dict[str, Term] = {}
    leaf_of: dict[Term, str] = {}
    counters: dict[str, int] = {}

    def is_red(t):
        return t.op in RED_OPS and t.args[0].op == "Ax" and t.args[0].args[0] == axis

    def has_red(t):
        return any(is_red(s) or (s.op == "Size" and s.args[0] == axis) for s in t.walk())

    def has_true_red(t):
        return any(is_red(s) for s in t.walk())

    def fresh(kind):
        counters[kind] = counters.get(kind, 0) + 1
        n = counters[kind]
        return PREFIX[kind] if n == 1 else f"{PREFIX[kind]}{n}"

    def leaf(t, kind):
        if t in leaf_of:
            return Term(kind, (leaf_of[t],))
        if t.op == "In":
            name = t.args[0]
        else:
            name = f"{'e' if kind == 'Elm' else 'p'}{len(leaf_of) + 1}"
        if name in leaves:
            name = f"{name}_{len(leaf_of) + 1}"
        leaf_of[t] = name
        leaves[name] = t
        return Term(kind, (name,))

    def enc(t: Term, allow_ref: bool) -> Term:
        if t.op == "Ax":  # a block argument (another axis) is never a leaf
            return t
        if is_red(t):
            return Term("St", (state_of(t), A))
        if t.op == "Size" and t.args[0] == axis:
            # inside a reduction body the axis length is the whole axis's (a per-program
            # constant); in a value built from reductions (a mean) it is the block's count
            return leaf(t, "Par") if allow_ref else Term("Cnt", (A,))
        if not (has_true_red(t) if allow_ref else has_red(t)):
            # free of reductions over the axis (inside a reduction body size(axis) is the
            # whole axis's, a constant): one leaf, whatever reads it (a lookup at an index
            # built from the axis and its size, rel[r=j - i + size(i) - 1])
            if axis in axes_of(t):
                return leaf(t, "Elm")
            if t.op == "Num" and math.isfinite(t.args[0]):
                return t
            return leaf(t, "Par")
        if allow_ref and axis not in axes_of(t) and has_true_red(t):
            return Term("St", (ref_of(t), A))
        args = tuple(enc(a, allow_ref) if isinstance(a, Term) else a for a in t.args)
        if t.op == "Mul" and _reads_state(args[1]) and not _reads_state(args[0]):
            # a product is written with the factor that reads states first (multiplication
            # commutes, in floating point too), so that `w * exp(x - m)` and `exp(x - m) * w`
            # meet the same factoring rules
            args = (args[1], args[0])
        return Term(t.op, args)

    def deps_of(d: Term):
        return tuple(dict.fromkeys(s.args[0] for s in d.walk() if s.op == "St"))

    def ref_of(t: Term) -> str:
        if t in red_names:
            return red_names[t]
        d = enc(t, allow_ref=False)
        name = fresh("ref")
        red_names[t] = name
        states.append(StateDef(name, "ref", d, t, deps_of(d)))
        return name

    def state_of(t: Term) -> str:
        if t in red_names:
            return red_names[t]
        body = enc(t.args[1], allow_ref=True)
        kind = RED_OPS[t.op]
        name = fresh(kind)
        red_names[t] = name
        d = Term(t.op, (A, body))
        states.append(StateDef(name, kind, d, t, deps_of(d)))
        return name

    outputs, output_axes = {}, {}
    for k, e in prog.outputs.items():
        for sub in e.term.walk():
            if is_red(sub):
                state_of(sub)
        outputs[k] = _finals(e.term, red_names, is_red)
        output_axes[k] = e.axes

    # depth of each reduction: the passes a plain (unfused) evaluation needs
    depth: dict[str, int] = {}
    for s in states:
        d = max((depth[x] for x in s.deps), default=0)
        depth[s.name] = d + (0 if s.op == "ref" else 1)
    elementwise = tuple(k for k, ax in output_axes.items() if axis in ax)
    unfused = max(depth.values(), default=0) + (1 if elementwise else 0)
    enc_ = Encoding(prog.name, axis, states, leaves, outputs, output_axes, dict(prog.tensors),
                    unfused_passes=unfused, elementwise_outputs=elementwise, leaf_of=leaf_of)
    return enc_


def _reads_state(t: Term) -> bool:
    return any(u.op in ("St", "Cnt") for u in t.walk())


def _finals(t: Term, names, is_red) -> Term:
    """Replace each reduction over the fused axis by its final state St(q, BJ)."""
    if is_red(t):
        return Term("St", (names[t], Term("BJ")))
    if not t.children:
        return t
    return Term(t.op, tuple(_finals(a, names, is_red) if isinstance(a, Term) else a for a in t.args))


def describe(s: StateDef) -> str:
    return f"{s.name} = {pretty(s.source)}"


__all__ = ["StateDef", "Encoding", "encode", "EncodeError", "describe", "substitute"]
