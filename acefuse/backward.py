"""af.backward: the vector-Jacobian product of a program, derived symbolically.

    bwd = af.backward(prog)           # a BackwardProgram (a Program)
    bwd.augmented                     # the forward program plus the saved values
    bwd.saved                         # {"saved_lse": ("r",)}: inputs that the augmented
                                      #   forward writes and the backward reads
    bwd.derivation                    # (rule, before, after, note): the normal forms' steps,
                                      #   which af.fuse(bwd).explain() lists with their rules
    bwd.cotangents                    # {"grad_y": ("r", "j")}: one per forward output
    bwd.grads                         # {"x": "grad_x", ...}: float input -> gradient output
    bwd.zero_grads                    # float inputs no output depends on (gradient 0)
    af.backward(prog, wrt=["x"])      # only these inputs' gradients (others: no output, no work)
    bwd.stages                        # one Stage (a Program, .axis its fused axis) per fused
                                      #   axis (what af.fuse/af.compile run)
    bwd.finish                        # {grad: (stage output, axes)}: a gradient that is a stage's
                                      #   tile output summed over broadcast axes (a bias over fewer heads)
    stage.row_scatters                # {grad: (n, g, axes)}: a gradient the stage's kernel adds row by
                                      #   row into the table entry g names (paged KV; backward_scatter.py)
    bwd.intermediates                 # {"pre1": ("b", "h", "i")}: reductions a stage's rows do not
                                      #   depend on (attention's D_i), computed once by a pre-stage
                                      #   (``stage.hoisted`` says why) and read by later stages
    af.fuse(bwd).explain()            # every stage fused by the same engine
    k = af.compile(bwd)               # BackwardKernel: k(x=..., saved_m=..., grad_y=...) -> grads

Inputs of the backward program: the forward inputs, the saved values (``saved_*``),
and one cotangent ``grad_<output>`` per forward output (same axes as the output).
Outputs: ``grad_<input>`` for every float input that reaches an output. An output
may range over fewer axes than its input (the gradient is constant along the
missing ones); ``af.compile(bwd)`` expands it to the input's shape.

How it is derived: reverse mode over the term DAG with named axes. The adjoint of a
node ranges over the node's axes; the adjoint flowing to an operand with fewer axes
is summed over the missing axes (that is where dW/db become reductions over rows).
``sum_j(body)`` broadcasts its adjoint along j. ``max_j``/``min_j`` route it through
the indicator ``body == m`` (m the saved extremum); ties share it equally (``adj / count``,
torch.amax's convention; see "Max and min" below). ``maximum``/``minimum`` give half to each
side on a tie. ``where(c, a, b)``
sends the adjoint to a under c and to b elsewhere; comparisons, logic, ``index`` and
``size`` have none, and neither have the piecewise-constant operators (floor, ceil, round,
integer casts, integer arithmetic: gradient 0, torch's convention); ``abs`` uses
sign(0) = 0. ``erf``, ``sigmoid``, ``softplus``, ``log1p`` and ``expm1`` have their
derivatives (``2/sqrt(pi) exp(-a^2)``, ``s (1 - s)``, ``sigmoid(a)``, ``1 / (1 + a)``,
``exp(a)``). An output that only indexes an axis of its input (``x * (index(j) % 2 == 0)``)
gets that axis's length from the input. A gather ``take(x, t, j)`` becomes the
scatter ``where(index(j) == t, adjoint, 0)``, so it stays in the language.

Saved values: every forward reduction the backward needs whose result does not range
over the forward's fused axis (the per-row max and sum of a softmax, a layernorm's
mean and variance) is written by the augmented forward and read by the backward as
``saved_<m|s|mn><k>``; reductions that do range over it (attention's scores) are
recomputed. A forward *output* the backward reads back keeps its own name
(``saved_kind[name] == "output"``: attention's ``o``), since the forward writes it anyway.
Where the gradients read a saved max ``m`` and sum ``l = sum_j(exp(b - m))`` only as
``exp(b - m) * r(l)``, they read one value ``saved_lse = where(l == 0, 0, m + log(l))`` instead
(``P = exp(b - L)``; ``backward_shift.fold_outputs``, proved rules of rules/shifted.py).

The normal form against the saved values (``acefuse.backward_normal``; the FlashAttention-2
backward comes out of it, from plain attention, with nothing that names attention) drops the
adjoint of a max the program is invariant to, and reads ``sum_e(grad_o * o)`` for FlashAttention-2's
``D_i``. A fully masked row's saved max (``-inf``; a min's ``+inf``) reads as 0 only where the
gradients subtract it (a min: add it inside a difference), the forward's own convention
(``backward_shift.guard_masked_shifts``); everywhere else, and always for the other infinity (a row
holding ``+inf`` has max ``+inf``: its adjoint goes to that element), it is read as it is, so a body
made ``-inf`` by a masked max still equals its own max.

Max and min: the adjoint ``g`` of ``m = max_j(body)`` is ``g * r(n) * [body == m]`` with
``n = sum_j([body == m])`` and ``r(n)`` = 1/n, 0 where n is 0.
The product form matters: a sum of it over j (the adjoint reaching ``mean_j x`` in
``max_j(x - mean_j x)``) factors into ``g * r(n) * n``, so no reduction of the backward depends
on another one over j and the backward fuses in one pass wherever the forward does. The
comparison is exact: a runner-up distinct in float32 gets nothing, however close (torch's
float32 and float64 answers). Over the data itself (``max_j(x)``) the saved max is one of the
values. Over a computed body the backward recomputes the body from the forward's inputs and
saved values. The forward evaluates that expression itself (a max it cannot fuse takes its own
pass over the body), or the max of a simpler body shifted by per-row values (``max_j(x) - mean``),
which rounds as the body does at the element attaining it; either way that element compares
equal bit for bit. On a row where none does (a forward that computed the extremum in another
fused form, rounded differently), the elements within ``EXT_REL`` (2^-17, relative) of
the saved extremum share the adjoint instead (``sum_j`` of that window is a second count of the
same pass). Saving the argmax and the tie count from the forward instead was considered: for a
body that reads another reduction of the row (``x - mean_j x``) the forward fuses the max by
shifting (``max_j(x) - mean``) and never has the body's rounded values, so its tie structure
would be that of ``x``, not of ``fl(x - mean)``, and counting ties needs a merge rule no
proved rule derives (``sum_S(where(f == max, 1, 0))``).

Numerics conventions (matching the forward's): where a divisor or a log argument
computed from a reduction is 0 (a fully masked row), the adjoint through it is 0, never NaN
(torch's float64 autograd gives NaN there; elsewhere a masked row's gradient is torch's). Index inputs (used by ``take``) are
compared with ``index(j)`` in the backward, which reads them as float32 (exact below
2**24; ``BackwardKernel`` converts them).
"""
from __future__ import annotations

import math

from acefuse.lang import Program, Expr, LanguageError
from acefuse.rewrite.terms import Term, pretty, INT_OPS, CAST_LIMITS
from acefuse.rewrite.encode import _Axes
from acefuse.backward_normal import (RED, ZERO, ONE, _val, num, neg, add, sub, mul, div, where, rsum, _has_red,
                                     _cmp, _Normal, _TooBig, _inner_work, saved_equations, read_saved)
from acefuse.backward_shift import fold_outputs, dropped_adjoint, guard_masked_shifts

# no adjoint flows through these: constants, comparisons and logic, and the piecewise-constant
# integer-valued operators (rounding, integer casts, integer arithmetic), whose derivative is 0
# wherever it exists (torch's convention for floor/ceil/round)
NO_ADJOINT = ("Num", "Size", "Idx", "CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe",
              "LAnd", "LOr", "LNot", "Floor", "Ceil", "Round") + INT_OPS
_PREFIX = {"RMax": "m", "Sum": "s", "RMin": "mn"}   # saved names; "v" for other values
# the relative distance to a saved max/min within which a recomputed element counts as a hit on a
# row where no element equals it bit for bit (64 float32 ulps: a recomputation in another fused
# form lands within a few of the forward's; module docstring, "Max and min")
EXT_REL = 2.0 ** -17


class BackwardError(LanguageError):
    """The program cannot be differentiated as asked; the message names the term and the fix."""


# ---- the backward program -------------------------------------------------------------------------
class BackwardProgram(Program):
    """The vector-Jacobian product of ``forward`` (see the module docstring for the API)."""

    def __init__(self, name, outputs, forward, augmented, saved, saved_kind, cotangents, grads,
                 zero_grads, index_inputs, stages, input_axes):
        # the forward's axis order, not one re-derived from the tensors' latest declarations
        # (lang.axis_order: another program declaring k "b h j d" again would reorder d and j)
        super().__init__(name, outputs, order=forward.axes)
        self.forward = forward
        self.augmented = augmented
        self.saved = saved                # saved input name -> axes
        self.saved_kind = saved_kind      # saved input name -> "sum" | "max" | "min"
        self.cotangents = cotangents      # grad_<output> -> axes
        self.grads = grads                # float input -> its gradient output
        self.zero_grads = zero_grads      # float inputs no output depends on
        self.index_inputs = index_inputs  # inputs used as indices (no gradient)
        self.stages = stages              # Programs, one per fused axis
        self.input_axes = input_axes      # every forward input -> axes

    def __repr__(self):
        return (f"BackwardProgram({self.name}: {', '.join(self.outputs)}; saved "
                f"{', '.join(self.saved) or 'nothing'}; stages {', '.join(s.name for s in self.stages)})")


def index_inputs(prog) -> list:
    """Inputs used inside the index of a gather (integer tensors: no gradient)."""
    out = []
    for e in prog.outputs.values():
        for t in e.term.walk():
            if t.op == "Take":
                for s in t.args[1].walk():
                    if s.op == "In" and s.args[0] not in out:
                        out.append(s.args[0])
    return out


class _Deriv:
    def __init__(self, prog, wrt=None):
        from acefuse.fuse import _pick_axis, FuseError
        self.prog = prog
        self.wrt = None if wrt is None else frozenset(wrt)   # the inputs differentiated (None: every one)
        self.order = {a: i for i, a in enumerate(prog.axes)}
        self.tensors = dict(prog.tensors)       # grows with saved values and cotangents
        self.axes_of = _Axes(self.tensors)
        try:
            self.fused = _pick_axis(prog, None)
        except FuseError:
            self.fused = None
        self.saved: dict = {}      # forward reduction term -> saved input name
        self.saved_kind: dict = {}
        self.pmemo: dict = {}
        self.counts: dict = {}
        self.lmemo: dict = {}
        self.idx_inputs = index_inputs(prog)
        self.saved_outputs: dict = {}   # forward outputs the backward reads (name -> axes)
        self.normal = _Normal(self)
        self._egraph = None        # the e-graph contractions are normalised in (simplify_output)
        self._contractions: dict = {}   # contraction -> its form (shared by the gradients)
        self.derivation: list = []      # (rule, before, after, note): the normal forms' steps (explain())

    def output_input(self, k: str, axes) -> Term:
        """The forward output ``k`` read as a saved value (same name, written by the forward)."""
        self.saved_outputs[k] = tuple(axes)
        self.tensors[k] = tuple(axes)
        return Term("In", (k,))

    def vanishes(self, t: Term) -> bool:
        """``t`` is identically 0 in the normal form (e.g. the adjoint of a max the program is
        invariant to: softmax-like programs do not depend on the shift by their max)."""
        try:
            return not self.normal.poly(t)
        except (_TooBig, RecursionError):   # too large to decide: keep the full adjoint
            return False

    def simplify_output(self, t: Term) -> Term:
        """Each innermost reduction (a sum whose body holds no reduction: a contraction such as
        ``sum_e(grad_o * saved_s2 * r(l) * r(l))``) in the normal form the rewrite system finds
        against the saved values and forward outputs (-> ``sum_e(grad_o * o) * r(l)``;
        ``read_saved``), when that does less work per element."""
        from acefuse.rules import REGISTRY
        from acefuse.rewrite.schedules import NORMALIZE
        from acefuse.rewrite.egraph import EGraph
        eqs = saved_equations(self)
        if self._egraph is None:   # one e-graph with the rules loaded; each contraction in its own scope
            self._egraph = EGraph([r for r in REGISTRY.values() if r.theory in NORMALIZE.theories()])
        memo = self._contractions

        def go(u: Term) -> Term:
            if u in memo:
                return memo[u]
            if u.op == "Sum" and u.args[0].op == "Ax" and not any(s.op in RED for s in u.args[1].walk()):
                nf = read_saved(self, u, eqs, None, self._egraph)
                r = nf if nf is not None and _inner_work(nf) < _inner_work(u) else u
            elif u.children:
                r = Term(u.op, tuple(go(a) if isinstance(a, Term) else a for a in u.args))
            else:
                r = u
            memo[u] = r
            return r
        return go(t)

    def ordered(self, axes) -> tuple:
        return tuple(sorted(axes, key=self.order.__getitem__))

    def from_red(self, t) -> bool:
        return any(s.op in RED and s.args[0].op == "Ax" for s in t.walk())

    # the forward value of a node, as the backward computes it
    def P(self, t: Term) -> Term:
        if t in self.pmemo:
            return self.pmemo[t]
        op = t.op
        if self.savable(t):
            name = self.saved.get(t)
            if name is None:
                k = _PREFIX.get(op, "v") if t.args and isinstance(t.args[0], Term) and t.args[0].op == "Ax" else "v"
                self.counts[k] = self.counts.get(k, 0) + 1
                name = f"saved_{k}" if self.counts[k] == 1 else f"saved_{k}{self.counts[k]}"
                if name in self.prog.tensors or name in self.prog.outputs:
                    raise BackwardError(f"program {self.prog.name!r}: an input or output is named {name!r}, "
                                        "which the backward uses for a saved value; rename it")
                self.saved[t] = name
                self.saved_kind[name] = {"s": "sum", "m": "max", "mn": "min"}.get(k, "value")
                self.tensors[name] = self.ordered(self.axes_of(t))
            r = Term("In", (name,))
        elif not t.children:
            r = t
        elif op == "Take":
            r = Term("Take", (t.args[0], self.P(t.args[1]), t.args[2]))
        elif op == "Div" and self.from_red(t.args[1]):
            a, b = self.P(t.args[0]), self.P(t.args[1])
            # the forward's convention: 0 / 0 -> 0 when the divisor comes from a reduction
            r = where(Term("LAnd", (_cmp("CmpEq", a, ZERO), _cmp("CmpEq", b, ZERO))), ZERO, Term("Div", (a, b)))
        else:
            r = Term(op, tuple(self.P(a) if isinstance(a, Term) else a for a in t.args))
        self.pmemo[t] = r
        return r

    def savable(self, t: Term) -> bool:
        """Saved by the forward: with a fused axis, every value computed from reductions that
        does not range over it (taken whole: the mean, rsqrt(var + eps), the max, the sum);
        otherwise the reductions themselves."""
        if t.op in ("In", "Num", "Size", "Idx", "Take"):
            return False
        if self.fused is None:
            return t.op in RED and t.args[0].op == "Ax"
        return self.from_red(t) and self.fused not in self.axes_of(t)

    def safe_recip(self, t: Term) -> Term:
        """1 / P(t), or 0 where P(t) is 0 and t comes from a reduction (a fully masked row)."""
        p = self.P(t)
        if self.from_red(t):
            return where(_cmp("CmpEq", p, ZERO), ZERO, div(ONE, p))
        return div(ONE, p)

    # ---- reverse mode -----------------------------------------------------------------------
    def run(self, cotangents: dict) -> dict:
        """cotangents: output term -> adjoint term. Returns In-name -> adjoint term."""
        post: list = []
        seen: set = set()
        for root in cotangents:
            stack = [(root, False)]
            while stack:
                t, done = stack.pop()
                if done:
                    post.append(t)
                    continue
                if t in seen:
                    continue
                seen.add(t)
                stack.append((t, True))
                for c in reversed(self._operands(t)):
                    if c not in seen:
                        stack.append((c, False))
        contribs: dict = {}
        for t, a in cotangents.items():
            contribs.setdefault(t, []).append(a)
        grads: dict = {}
        for t in reversed(post):
            parts = contribs.pop(t, None)
            if not parts:
                continue
            adj = parts[0]
            for p in parts[1:]:
                adj = add(adj, p)
            if _val(adj) == 0:
                continue
            if t.op == "In":
                grads[t.args[0]] = adj
                continue
            if t.op in ("RMax", "RMin") and self.vanishes(adj):
                dropped_adjoint(self, t, adj)
                continue
            for child, c in self.local(t, adj):
                if not self.live(child):
                    continue
                c = c()
                c = self.reduce_to(c, child, t)
                if _val(c) != 0:
                    contribs.setdefault(child, []).append(c)
        return grads

    def live(self, t: Term) -> bool:
        """``t`` depends on a float input (so it has an adjoint worth computing)."""
        if t not in self.lmemo:
            if t.op in ("In", "Take"):
                r = t.args[0] not in self.idx_inputs and (self.wrt is None or t.args[0] in self.wrt)
            elif _no_adjoint(t):
                r = False
            else:
                r = any(self.live(c) for c in self._operands(t))
            self.lmemo[t] = r
        return self.lmemo[t]

    def _operands(self, t):
        if t.op == "Take":
            return [Term("In", (t.args[0],))]
        if t.op in RED:
            return [t.args[1]]
        if _no_adjoint(t):
            return []
        return list(t.children)

    def reduce_to(self, c: Term, child: Term, node: Term | None = None) -> Term:
        """The contribution ``c`` to ``child``'s adjoint from ``node``, summed over the axes of
        ``node`` (and of ``c``) that ``child`` does not range over. An axis of ``node`` that ``c``
        does not range over holds ``c`` at each of its positions: the sum is ``c * size(a)``
        (``sum_j(x - mean_j x)``: ``x - mean_j x`` gets the adjoint ``grad_o``, constant along
        j, and ``mean_j x`` gets ``-size(j) grad_o``, not ``-grad_o``)."""
        target = self.axes_of(child)
        have = self.axes_of(c)
        for a in self.ordered((have | (self.axes_of(node) if node is not None else set())) - target):
            c = self.rsum(a, c) if a in have else mul(c, Term("Size", (a,)))
        return c

    def rsum(self, axis: str, t: Term) -> Term:
        """``sum_axis(t)``; when ``t`` itself holds a reduction over ``axis`` (the backward
        of a cascade), sum linearity splits it into products of a factor invariant in ``axis``
        and a plain sum: ``sum_j((g - s) * e) = sum_j(g * e) - s * sum_j(e)``, so the
        backward has no cascade the forward did not have."""
        if not _has_red(t, axis):
            return rsum(axis, t)
        out = ZERO
        for sign, factors in self._expand(t, axis):
            inv = [f for f in factors if axis not in self.axes_of(f)]
            var = [f for f in factors if axis in self.axes_of(f)]
            k = ONE
            for f in inv:
                k = mul(k, f)
            if var:
                body = var[0]
                for f in var[1:]:
                    body = mul(body, f)
                term = mul(k, rsum(axis, body))
            else:
                term = mul(k, Term("Size", (axis,)))
            out = add(out, term) if sign > 0 else sub(out, term)
        return out

    def _expand(self, t: Term, axis: str) -> list:
        """``t`` as a signed sum of products, expanding only around subterms that hold a
        reduction over ``axis`` (everything else stays one factor)."""
        if not _has_red(t, axis) or axis not in self.axes_of(t) and t.op not in ("Add", "Sub", "Neg", "Mul", "Div"):
            return [(1, [t])]
        op = t.op
        if op == "Add":
            return self._expand(t.args[0], axis) + self._expand(t.args[1], axis)
        if op == "Sub":
            return self._expand(t.args[0], axis) + [(-s, f) for s, f in self._expand(t.args[1], axis)]
        if op == "Neg":
            return [(-s, f) for s, f in self._expand(t.args[0], axis)]
        if op == "Mul":
            return [(s1 * s2, f1 + f2) for s1, f1 in self._expand(t.args[0], axis)
                    for s2, f2 in self._expand(t.args[1], axis)]
        if op == "Div" and axis not in self.axes_of(t.args[1]):
            return [(s, f + [div(ONE, t.args[1])]) for s, f in self._expand(t.args[0], axis)]
        if op == "Where" and t.args[2] == ZERO:   # where(c, a, 0) = a * [c] under a sum (a finite)
            return [(s, f + [where(t.args[0], ONE, ZERO)]) for s, f in self._expand(t.args[1], axis)]
        return [(1, [t])]

    def local(self, t: Term, g: Term) -> list:
        """(operand, thunk) pairs: the adjoint ``g`` of ``t`` pulled back to each operand
        (a thunk, so that forward values are only asked for where an adjoint flows)."""
        op, P = t.op, self.P
        args = t.args
        if _no_adjoint(t):
            return []
        if op == "Add":
            return [(args[0], lambda: g), (args[1], lambda: g)]
        if op == "Sub":
            return [(args[0], lambda: g), (args[1], lambda: neg(g))]
        if op == "Neg":
            return [(args[0], lambda: neg(g))]
        if op == "Mul":
            return [(args[0], lambda: mul(g, P(args[1]))), (args[1], lambda: mul(g, P(args[0])))]
        if op == "Div":
            a, b = args
            if self.from_red(b):
                return [(a, lambda: mul(g, self.safe_recip(b))),
                        (b, lambda: neg(mul(mul(g, P(a)), mul(self.safe_recip(b), self.safe_recip(b)))))]
            return [(a, lambda: div(g, P(b))), (b, lambda: neg(div(mul(g, P(t)), P(b))))]
        if op == "Exp":
            return [(args[0], lambda: mul(g, P(t)))]
        if op == "Log":
            return [(args[0], lambda: mul(g, self.safe_recip(args[0])))]
        if op == "Sqrt":
            return [(args[0], lambda: div(mul(num(0.5), g), P(t)))]
        if op == "Rsqrt":
            return [(args[0], lambda: mul(num(-0.5), mul(g, mul(P(t), mul(P(t), P(t))))))]
        if op == "Abs":
            def dabs():
                a = P(args[0])
                return where(_cmp("CmpGt", a, ZERO), g, where(_cmp("CmpLt", a, ZERO), neg(g), ZERO))
            return [(args[0], dabs)]
        if op == "Tanh":
            return [(args[0], lambda: mul(g, sub(ONE, mul(P(t), P(t)))))]
        if op == "Erf":   # 2 / sqrt(pi) * exp(-a^2)
            return [(args[0], lambda: mul(mul(num(2.0 / math.sqrt(math.pi)), g),
                                          Term("Exp", (neg(mul(P(args[0]), P(args[0]))),))))]
        if op == "Sigmoid":   # s * (1 - s)
            return [(args[0], lambda: mul(g, mul(P(t), sub(ONE, P(t)))))]
        if op == "Softplus":   # sigmoid(a)
            return [(args[0], lambda: mul(g, Term("Sigmoid", (P(args[0]),))))]
        if op == "Log1p":   # 1 / (1 + a)
            return [(args[0], lambda: div(g, add(ONE, P(args[0]))))]
        if op == "Expm1":   # exp(a)
            return [(args[0], lambda: mul(g, Term("Exp", (P(args[0]),))))]
        if op == "Cast":   # a float cast (an integer cast has no adjoint: _no_adjoint)
            return [(args[0], lambda: g)]
        if op in ("Max2", "Min2"):
            wins = "CmpGt" if op == "Max2" else "CmpLt"

            def dside(k):
                a, b = P(args[k]), P(args[1 - k])
                return where(_cmp(wins, a, b), g, where(_cmp("CmpEq", a, b), mul(num(0.5), g), ZERO))
            return [(args[0], lambda: dside(0)), (args[1], lambda: dside(1))]
        if op == "Pow":
            c = float(args[1])
            d = c - 1.0

            def dpow():
                a = P(args[0])
                pw = ONE if d == 0 else a if d == 1 else mul(a, a) if d == 2 else Term("Pow", (a, d))
                return mul(mul(num(c), g), pw)
            return [(args[0], dpow)]
        if op == "Where":
            return [(args[1], lambda: where(P(args[0]), g, ZERO)), (args[2], lambda: where(P(args[0]), ZERO, g))]
        if op == "Take":
            name, idx, axis = args
            return [(Term("In", (name,)),
                     lambda: where(_cmp("CmpEq", Term("Idx", (axis,)), P(idx)), g, ZERO))]
        if op == "Sum":
            return [(args[1], lambda: g)]
        if op in ("RMax", "RMin"):
            def dext():
                axis = args[0].args[0]
                body, ext = P(args[1]), P(t)
                exact = _cmp("CmpEq", body, ext)
                n_exact = rsum(axis, where(exact, ONE, ZERO))
                if args[1].op in ("In", "Take"):   # the data itself: the extremum is one of its values
                    return _share(g, n_exact, exact)
                # a computed body, recomputed by the backward: the elements equal to the saved
                # extremum bit for bit share the adjoint (a near tie goes to the larger, as in torch);
                # on a row where none is (the forward computed the extremum in another fused form),
                # the elements within EXT_REL of it share it (module docstring: max and min)
                slack = mul(Term("Abs", (ext,)), num(EXT_REL))
                near = (_cmp("CmpGe", body, sub(ext, slack)) if op == "RMax"
                        else _cmp("CmpLe", body, add(ext, slack)))
                missed = where(_cmp("CmpEq", n_exact, ZERO), g, ZERO)
                return add(_share(g, n_exact, exact), _share(missed, rsum(axis, where(near, ONE, ZERO)), near))
            return [(args[1], dext)]
        raise BackwardError(f"program {self.prog.name!r}: no derivative for operator {op!r} in "
                            f"`{pretty(t)}`; rewrite the program with the operators af documents")


def _share(g: Term, n: Term, hit: Term) -> Term:
    """``g / n`` at the ``n`` elements where ``hit`` holds, 0 elsewhere (and 0 when ``n`` is 0: a
    fully masked row): ``where(hit, g * r(n), 0)``, exactly 0 off the hits even where ``g`` is not
    finite (a product with ``[hit]`` would put ``inf * 0 = NaN`` there). A sum of it over the axis
    still factors into ``g * r(n) * n`` (``_Deriv._expand`` reads ``where(c, a, 0)`` as ``a * [c]``):
    no reduction depends on the count."""
    return where(hit, mul(g, where(_cmp("CmpEq", n, ZERO), ZERO, div(ONE, n))), ZERO)


def _no_adjoint(t: Term) -> bool:
    return t.op in NO_ADJOINT or (t.op == "Cast" and t.args[1] in CAST_LIMITS)


def backward(prog, wrt=None) -> BackwardProgram:
    """The vector-Jacobian-product program of ``prog`` (see the module docstring).

    ``wrt``: the names of the inputs to differentiate (default: every float input). The
    others get no gradient output and no adjoint flows towards them, so an input that does
    not require grad (an attention mask, a constant) costs nothing in the backward and a
    gradient acefuse has no kernel for is not built when nobody asks for it."""
    if isinstance(prog, BackwardProgram):
        raise BackwardError(f"af.backward({prog.name!r}): higher derivatives are not supported; "
                            "differentiate the forward program")
    if not isinstance(prog, Program):
        raise BackwardError(f"af.backward expects a program made with af.program(...), got {type(prog).__name__}")
    if wrt is not None:
        wrt = [wrt] if isinstance(wrt, str) else list(wrt)
        unknown = [n for n in wrt if n not in prog.tensors]
        if unknown:
            raise BackwardError(f"af.backward({prog.name!r}, wrt=...): {unknown} are not inputs of the program "
                                f"(its inputs: {list(prog.tensors)})")
    d = _Deriv(prog, wrt)
    idx_inputs = index_inputs(prog)
    cot: dict = {}
    cot_axes: dict = {}
    for k, e in prog.outputs.items():
        name = f"grad_{k}"
        if name in prog.tensors:
            raise BackwardError(f"program {prog.name!r}: input {name!r} clashes with the cotangent of output "
                                f"{k!r}; rename the input")
        cot_axes[name] = e.axes
        d.tensors[name] = e.axes
        t = Term("In", (name,))
        cot[e.term] = add(cot[e.term], t) if e.term in cot else t
    adj = d.run(cot)
    outputs: dict = {}
    grads: dict = {}
    zero: list = []
    for name, axes in prog.tensors.items():
        if name in idx_inputs or (wrt is not None and name not in wrt):
            continue
        gname = f"grad_{name}"
        if gname in cot_axes:
            raise BackwardError(f"program {prog.name!r}: output {name!r} and input {name!r}... the "
                                f"gradient name {gname!r} is taken by a cotangent; rename the output")
        g = adj.get(name)
        if g is None or _val(g) == 0:
            zero.append(name)
            continue
        if _val(g) is not None:   # a constant gradient: give it the input's axes
            g = mul(g, where(_cmp("CmpGe", Term("Idx", (axes[0],)), ZERO), ONE, ZERO))
        outputs[gname] = _expr(d, d.simplify_output(g), name)
        grads[name] = gname
    # P = exp(b - L) from one saved L = m + log(l) where that reads neither the max nor the sum
    folded = fold_outputs(d, {n: outputs[g].term for n, g in grads.items()})
    for name, gname in grads.items():
        if folded[name] is not outputs[gname].term:
            outputs[gname] = _expr(d, folded[name], name)
    # a fully masked row's saved max reads as 0 only where it is subtracted, as in the forward
    guarded = guard_masked_shifts({g: outputs[g].term for g in grads.values()}, d.saved_kind)
    for name, gname in grads.items():
        if guarded[gname] is not outputs[gname].term:
            outputs[gname] = _expr(d, guarded[gname], name)
    if not outputs:
        raise BackwardError(f"program {prog.name!r}: no float input{' of ' + str(sorted(wrt)) if wrt is not None else ''} "
                            "reaches an output, so every gradient is zero; there is nothing to differentiate")
    used = {s.args[0] for e in outputs.values() for s in e.term.walk() if s.op == "In"}
    aug_out = dict(prog.outputs)
    saved_kind = {}
    for t, name in d.saved.items():
        if name in used:
            aug_out[name] = Expr(t, d.tensors[name], dict(prog.tensors))
            saved_kind[name] = d.saved_kind[name]
    augmented = Program(prog.name + "_fwd", aug_out, order=prog.axes) if saved_kind else prog
    saved = {name: d.tensors[name] for name in saved_kind}
    for k, axes in d.saved_outputs.items():   # forward outputs read back (written anyway)
        if k in used:
            saved[k] = axes
            saved_kind[k] = "output"
    tensor_order = _tensor_order(prog, idx_inputs, saved, cot_axes)
    finish: dict = {}
    hoisted: dict = {}
    stages = _stages(prog.name + "_bwd", outputs, tensor_order, prog.axes, finish, prog, hoisted)
    seq = {s.axis for s in stages if s.axis} | {t.args[0].args[0] for e in list(prog.outputs.values())
                                               + list(outputs.values()) for t in e.term.walk()
                                               if t.op in RED and t.args[0].op == "Ax" and not _is_contraction(t)}
    for st in stages:   # axes a kernel tiles (rows, loop), never a vector axis: codegen/sums.py reads it
        st.seq_axes = tuple(a for a in prog.axes if a in seq)
    bwd = BackwardProgram(prog.name + "_bwd", outputs, prog, augmented, saved, saved_kind, cot_axes,
                          grads, zero, idx_inputs, stages, dict(prog.tensors))
    bwd.tensors = {n: bwd.tensors[n] for n in tensor_order if n in bwd.tensors}
    bwd.wrt = None if wrt is None else tuple(wrt)
    # gradient -> (stage output, axes): the gradient is that tile output summed over those axes
    bwd.finish = finish
    # intermediate -> axes: a reduction a pre-stage computes once and later stages read (_hoist)
    bwd.intermediates = {n: h[0] for n, h in hoisted.items()}
    bwd.derivation = list(d.derivation)   # (rule, before, after, note) steps of the normal forms
    return bwd


def _expr(d: _Deriv, t: Term, own: str) -> Expr:
    """The gradient ``t`` of input ``own`` as an output. The tensors it reads give its axes'
    lengths; an axis it only indexes (``x * (index(j) % 2 == 0)`` differentiates to
    ``grad_y * (index(j) % 2 == 0)``) takes its length from ``own``, whose shape the
    gradient has."""
    used = {s.args[0] for s in t.walk() if s.op == "In"} | {s.args[0] for s in t.walk() if s.op == "Take"}
    axes = d.ordered(d.axes_of(t))
    # the axes whose lengths it needs: its own, those it takes a size or an index of (a mean's
    # gradient ``grad_o / size(j)`` ranges over r only, yet needs j's length), and those of
    # ``own``, along which the gradient is expanded to ``own``'s shape (``sum_j(x + x)``
    # differentiates to ``2 grad_o`` over r: the kernel needs j's length to expand it)
    need = set(axes) | {s.args[0] for s in t.walk() if s.op in ("Size", "Idx")} | set(d.tensors[own])
    if not need <= {a for n in used for a in d.tensors[n]}:
        used.add(own)
    return Expr(t, axes, {n: d.tensors[n] for n in d.tensors if n in used})


def _tensor_order(prog, idx_inputs, saved, cot) -> list:
    """Float forward inputs first (the kernels take their output dtype from the first float input)."""
    return ([n for n in prog.tensors if n not in idx_inputs] + list(saved) + list(cot)
            + [n for n in prog.tensors if n in idx_inputs])


def _red_axes(t: Term) -> list:
    out = []
    for s in t.walk():
        if s.op in RED and s.args[0].op == "Ax" and s.args[0].args[0] not in out:
            out.append(s.args[0].args[0])
    return out


def _inner_axis(t: Term):
    """The axis a fused kernel should run over: the only reduced axis, or the one whose
    reductions sit inside reductions over the others (they become a second stage)."""
    red = _red_axes(t)
    if len(red) <= 1:
        return red[0] if red else None
    inner, nested = [], set()
    for s in t.walk():
        if s.op in RED and s.args[0].op == "Ax":
            nested.update(u for u in s.args[1].walk() if u.op in RED and u.args[0].op == "Ax")
            for a in _red_axes(s.args[1]):
                if a != s.args[0].args[0] and a not in inner:
                    inner.append(a)
    # a contraction (a sum whose body holds no reduction, e.g. sum_d(q * k) inside
    # sum_j(...)) is computed inside the fused loop's body; it does not pick the axis
    fused = [a for a in inner if not all(_is_contraction(u) for u in nested if u.args[0].args[0] == a)]
    if len(fused) == 1:
        return fused[0]
    if not fused:
        top = []
        for s in t.walk():
            if s.op in RED and s.args[0].op == "Ax" and s not in nested and s.args[0].args[0] not in top:
                top.append(s.args[0].args[0])
        if len(top) == 1:
            return top[0]
    return inner[0] if len(inner) == 1 else red[0]


def _is_contraction(t: Term) -> bool:
    return t.op == "Sum" and not any(s.op in RED for s in t.args[1].walk())


def _contractions_in(t: Term) -> set:
    return {s for s in t.walk() if s.op in RED}


def _shares_contractions(e, a, groups, outputs) -> bool:
    """``e`` (grouped by axis ``a``) reduces only by contractions, and every one of them is
    computed by the outputs of another group whose fused axis ``e`` ranges over: ``e`` is then
    elementwise over that group's loop (a tile output of its kernel), sharing the work."""
    own = _contractions_in(e.term)
    if not own or not all(_is_contraction(s) for s in own):
        return False
    return any(b != a and b in e.axes and own <= set().union(*(_contractions_in(outputs[x].term) for x in ks))
               for b, ks in groups.items())


class Stage(Program):
    """One stage of a backward program: the outputs one kernel computes, fused over ``axis``.

    Its reductions over other axes (``sum_d(q * k)``, ``sum_e(grad_o * v)``) are contractions
    inside the fused loop's body, so ``reduced_axes`` names only the fused axis: that is the
    axis ``af.fuse``/``af.compile`` pick for it when none is given."""

    def __init__(self, name, outputs, axis):
        super().__init__(name, outputs)
        self.axis = axis
        # the axes the backward loops or tiles over (stage axes, the forward's non-contraction
        # reductions: attention's i and j), never held whole as a vector axis (set by backward())
        self.seq_axes: tuple = ()
        # a pre-stage's outputs (intermediates later stages read, never gradients) -> why each
        # was hoisted out of the stage that uses it (``_hoist``); empty for other stages
        self.hoisted: dict = {}
        # gradient -> (table axis n, index g, the gradient's axes): the output is stored row by
        # row into the entry g names, summed (``_split_row_scatters``; codegen/sums.py)
        self.row_scatters: dict = {}

    def reduced_axes(self) -> list:
        red = super().reduced_axes()
        return [self.axis] if self.axis in red else red

    def key(self) -> str:
        """The program's key, plus ``seq_axes`` (they decide the sum kernel's axes, so two
        stages equal as programs but with other ``seq_axes`` must not share a cached kernel)."""
        base = super().key()
        rs = getattr(self, "row_scatters", {})
        if not self.seq_axes and not rs:
            return base
        import hashlib
        extra = " ".join(f"{k}:{n}:{g.sexpr() if hasattr(g, 'sexpr') else g!r}:{' '.join(ax)}"
                         for k, (n, g, ax) in sorted(rs.items()))
        return hashlib.sha256(f"{base} {' '.join(self.seq_axes)}{' | ' + extra if rs else ''}".encode()).hexdigest()[:16]


def _carrier_body(t: Term) -> Term:
    """A term over the axes of the elementwise term ``t``: the product of the tensors and
    indices it reads (``t`` itself when it gathers). The carrier's value is never used; its
    body is only there to give the kernel ``t``'s axes, and a copy of ``t`` would be
    normalised again (``grad_o / size(j) * (1 - tanh(x) * tanh(x))`` inside the carrier
    grew the normal form's e-graph to ~360k nodes: af.fuse of that stage took 216 s on a
    2-core CPU, 0.3 s with the product)."""
    if any(u.op == "Take" for u in t.walk()):
        return t
    reads = list(dict.fromkeys(u for u in t.walk() if u.op in ("In", "Idx")))
    if not reads:
        return t
    body = reads[0]
    for u in reads[1:]:
        body = Term("Mul", (body, u))
    return body


def _summed_part(e):
    """``(X, axes)`` when ``e`` is ``sum_{a1}(sum_{a2}(... X))`` and X reduces only by
    contractions (a bias broadcast over heads: its gradient is dS summed over them); else None."""
    t, axes = e.term, []
    while t.op == "Sum" and t.args[0].op == "Ax" and not _is_contraction(t):
        axes.append(t.args[0].args[0])
        t = t.args[1]
    own = _contractions_in(t)
    if not axes or not own or not all(_is_contraction(u) for u in own):
        return None
    return t, axes


def _stages(name, outputs: dict, tensor_order, order=(), finish=None, forward=None, hoisted=None,
            pre=False) -> list:
    """The stages of a backward program's ``outputs``, pre-stages first (see ``_hoist``).
    ``finish`` (filled in): gradient -> (tile output, axes it is summed over); ``hoisted``
    (filled in): intermediate name -> (axes, reduction term, why); ``tensor_order`` gets
    the intermediates appended."""
    outputs = dict(outputs)
    scatters: dict = {}
    if finish is not None:
        from acefuse.backward_scatter import split_row_scatters
        split_row_scatters(outputs, order, scatters)
        _split_finish(outputs, order, finish, forward)
    for n, e in list(outputs.items()):   # a cascade's axis innermost in a chain of sums (Fubini)
        t = _cascade_inner(e.term)
        if t is not e.term:
            outputs[n] = _retensor(t, e.axes, e.tensors)
    if hoisted is None:
        hoisted = {}
    taken = set(tensor_order) | set(outputs) | set(forward.outputs if forward is not None else ())
    pres: dict = {}        # intermediate name -> its Expr (the outputs of the pre-stages)
    for _ in range(0 if pre else _HOIST_ROUNDS):   # (a pre-stage's own reductions stay in it)
        found = _hoist(_group(outputs), outputs)
        nested = _hoist_nested(pres, found)   # and reductions nested in a pre-stage's value
        if not found and not nested:
            break
        subst = {}
        for t, (a, missing) in list(found.items()) + list(nested.items()):
            n = next(f"pre{i}" for i in range(1, len(taken) + 2) if f"pre{i}" not in taken)
            taken.add(n)
            inner = _red_axes(t.args[1])
            nest = f"a reduction over {t.args[0].args[0]} of a reduction over {', '.join(inner)}, nested in"
            if t in found:
                e0 = next(o for o in outputs.values() if any(u is t or u == t for u in o.term.walk()))
                why = (f"invariant along {', '.join(sorted(missing))} in stage {name}_{a} (fused over {a}); its grid "
                       f"would recompute it for every block along {' and '.join(sorted(missing))}" if missing else
                       f"{nest} stage {name}_{a} (fused over {a}), which has no row axes: inline it would be a "
                       "pass with no rows to run the inner reduction on; its own stage computes it first")
            else:
                e0 = pres[a]
                why = (f"{nest} the pre-stage value {a} (a reduction over {e0.term.args[0].args[0]}): inline it "
                       "would be a pass of that value's kernel with the inner reduction nested in it; its own "
                       "stage computes it first")
            axes = tuple(x for x in order if x in _Axes(e0.tensors)(t)) if order else tuple(sorted(_Axes(e0.tensors)(t)))
            pres[n] = _retensor(t, axes, e0.tensors)
            hoisted[n] = (axes, t, why)
            subst[t] = Term("In", (n,))
            tensor_order.append(n)
        for table in (outputs, pres):
            for k, e in list(table.items()):
                # (a value is not replaced by its own name: only its subterms are)
                nt = _substitute(e.term, {t: v for t, v in subst.items() if not (table is pres and v.args[0] == k)})
                if nt is not e.term:
                    tens = dict(e.tensors)
                    tens.update({n: pres[n].axes for n in {u.args[0] for u in nt.walk() if u.op == "In"} if n in pres})
                    table[k] = _retensor(nt, e.axes, tens)
    pre_stages = _stages(name + "_pre", pres, tensor_order, order, None, forward, hoisted, True) if pres else []
    if not pre:
        built = _build(name, outputs, _group(outputs), tensor_order)
        for st in built:
            st.row_scatters = {k: v for k, v in scatters.items() if k in st.outputs}
        return pre_stages + built
    # pre-stages: the values that reduce over one axis share a kernel per axis (FlashAttention-2's
    # D = sum_e(grad_o * o)); a value nested over several axes gets its own stage, compiled over
    # whichever of its axes compiles (``sum_j(sum_r(X))``: over r, rows j, then a sum over j)
    # A value that reads another one (``_hoist_nested``) runs in a later kernel than it: level
    # 0 reads none, level L reads one of level L - 1 (stages are listed in level order).
    level: dict = {}

    def lev(n):
        if n not in level:
            level[n] = 1 + max([lev(m) for m in {u.args[0] for u in outputs[n].term.walk() if u.op == "In"}
                                if m in outputs and m != n], default=-1)
        return level[n]
    stages = []
    for L in sorted({lev(n) for n in outputs}):
        base = name if L == 0 else f"{name}_l{L}"
        single, nest = {}, []
        for n, e in outputs.items():
            if lev(n) != L:
                continue
            red = _red_axes(e.term)
            if len(red) == 1:
                single.setdefault(red[0], []).append(n)
            else:
                nest += _build(f"{base}_{n}", {n: e}, {_inner_axis(e.term): [n]}, tensor_order)
        stages += _build(base, outputs, single, tensor_order) + nest
    for st in stages:
        st.hoisted = {n: hoisted[n][2] for n in st.outputs if n in hoisted}
    return pre_stages + stages


def _cascade_inner(t: Term) -> Term:
    """``t`` with a chain of one reduction over several axes (``sum_j(sum_r(X))``) reordered so
    that the axes ``X`` itself reduces over come innermost (``sum_r(sum_j(X))`` when ``X``
    reads ``sum_j(...)`` per row r), ``t`` itself when nothing moves. Swapping two sums over
    different axes is Fubini (two maxes, two mins: both are the one over the pairs of the two
    axes), exact over the reals; only float rounding order changes. Why: ``X`` is a
    cascade over j for each r. Fused over j with rows r (the inner order), that cascade is one
    pass per row and the outer sum over r of its per-row values is a second stage
    (codegen/compile.py ``stage``). In the other order neither axis compiles: fused over j,
    the body over (r, j) is written whole and the sum over both after it has no row axis
    (codegen/sums.py); fused over r, the cascade over j is a pass inside the pass. (A pre-stage
    value ``sum_j(sum_r(...))`` of the adjoints of a reduction over a weight over j.)"""
    axes, body = [], t
    while body.op == t.op and body.op in RED and body.args[0].op == "Ax" and body.args[0].args[0] not in axes:
        axes.append(body.args[0].args[0])
        body = body.args[1]
    inner = set(_red_axes(body))
    order = [a for a in axes if a not in inner] + [a for a in axes if a in inner]
    if order == axes:
        return t
    for a in reversed(order):
        body = Term(t.op, (Term("Ax", (a,)), body))
    return body


# at most this many rounds of hoisting per stage set (each round removes at least one reduction
# from the stages; a round can expose another by moving an output to another stage)
_HOIST_ROUNDS = 8


def _substitute(t: Term, subst: dict, memo=None) -> Term:
    """``t`` with every subterm in ``subst`` replaced (the same object back when nothing is)."""
    if memo is None:
        memo = {}
    if t in subst:
        return subst[t]
    if t in memo:
        return memo[t]
    if not t.children:
        r = t
    else:
        args = tuple(_substitute(a, subst, memo) if isinstance(a, Term) else a for a in t.args)
        r = t if all(x is y for x, y in zip(args, t.args)) else Term(t.op, args)
    memo[t] = r
    return r


def _retensor(t: Term, axes, tensors: dict) -> Expr:
    """``Expr(t, axes)`` over the tensors ``t`` reads, plus (from ``tensors``) those that give
    the length of an axis it ranges over, indexes or takes the size of and no read tensor has."""
    used = {s.args[0] for s in t.walk() if s.op in ("In", "Take")}
    need = set(axes) | {s.args[0] for s in t.walk() if s.op in ("Size", "Idx")}
    have = {a for n in used for a in tensors[n]}
    for n, ax in tensors.items():
        if not need <= have and n not in used and (need - have) & set(ax):
            used.add(n)
            have |= set(ax)
    return Expr(t, tuple(axes), {n: ax for n, ax in tensors.items() if n in used})


def _hoist(groups: dict, outputs: dict) -> dict:
    """The reductions to compute in a pre-stage: {term: (stage axis, row axes it misses)}.

    Cost rule. A stage fused over ``a`` runs a grid over its row axes (``_row_axes``). A
    reduction inside the stage whose value does not range over a row axis ``g``
    (``D = sum_e(grad_o * o)`` over (b, h, i) in dK/dV's stage, whose rows are key tiles
    ``j``; ``sum_j(sum_r(...))`` inside a weight's gradient over ``j`` in a stage whose rows
    are ``r``) is the same for every block of rows along ``g``: inline, each of them
    recomputes it (reading its operands again), and a contraction over the only row axis
    leaves codegen no rows to run at all. A pre-stage computes it once (one pass over its
    operands, one write of a value with fewer axes than they have) and each program reads the
    value instead. Lengths are not known when the backward is derived; a row axis is taken to
    span more than one block (the case a backward is derived for), where the pre-pass costs
    less than the recomputations. An output's own root reduction is what its stage computes
    and is never hoisted; a hoisted reduction is read by every stage that uses it.

    A stage with no row axes (a gradient over the fused axis alone: ``w`` over j) is one
    program; a reduction over ``a`` nested in it whose body reduces over another axis
    (``sum_j(sum_r(X))``, 0-d) would be a pass of that program with no rows to run the inner
    reduction on, which no kernel family has: it is hoisted too (its own stage compiles it
    over r, rows j, then sums over j)."""
    found: dict = {}
    for a, ks in groups.items():
        if a is None:
            continue
        tensors: dict = {}
        for k in ks:
            tensors.update(outputs[k].tensors)
        axes_of = _Axes(tensors)
        roots = [outputs[k].term for k in ks]
        rows = _row_axes(a, roots, tensors, set().union(*(set(outputs[k].axes) for k in ks)) - {a})

        def visit(u, root, seen):
            if u in seen or u in found:
                return
            seen.add(u)
            if u.op in RED and u.args[0].op == "Ax" and not root:
                missing = rows - axes_of(u)
                if missing and _not_larger(u, axes_of(u), tensors):
                    found[u] = (a, missing)
                    return
                if not rows and _nested_over(u, a) and _not_larger(u, axes_of(u), tensors):
                    found[u] = (a, set())   # (see the docstring's last paragraph)
                    return
            for c in u.children:
                visit(c, False, seen)

        seen: set = set()
        for r in roots:
            visit(r, True, seen)
    return found


def _nested_over(u: Term, a: str) -> bool:
    """``u`` is a reduction over ``a`` of a body that reduces over other axes only
    (``sum_j(sum_r(X))``)."""
    return (u.op in RED and u.args[0].op == "Ax" and u.args[0].args[0] == a
            and bool(_red_axes(u.args[1])) and a not in _red_axes(u.args[1]))


def _hoist_nested(pres: dict, found: dict) -> dict:
    """The rule of ``_hoist``'s last paragraph inside a pre-stage's value ``n`` (a reduction
    over ``a``, 0-d or over rows of its own): ``sum_j(where(hit, sum_j(sum_r(X)) / count, 0))``
    (a max's adjoint routed through another max) reads ``sum_j(sum_r(X))`` inside a sum over
    j; inline that is a cascade over j whose inner value is a reduction over r, which no
    one-pass kernel computes. Hoisted, its own stage computes it first and ``n`` reads it.
    {term: (n, set())}; terms in ``found`` (hoisted anyway this round) are left to it."""
    out: dict = {}
    for n, e in pres.items():
        a = e.term.args[0].args[0]
        axes_of = _Axes(e.tensors)

        def visit(u, root, seen):
            if u in seen or u in out or u in found:
                return
            seen.add(u)
            if not root and _nested_over(u, a) and _not_larger(u, axes_of(u), e.tensors):
                out[u] = (n, set())
                return
            for c in u.children:
                visit(c, False, seen)
        visit(e.term, True, set())
    return out


def _not_larger(u: Term, axes: set, tensors: dict) -> bool:
    """A hoisted value is written once and read back: it must not range over more than one of
    the tensors it reads does (``D = sum_e(grad_o * o)`` over (b, h, i) is smaller than
    ``grad_o``). ``sum_d(q * k)`` over (b, h, i, j) is larger than q and k: hoisting it would
    write the N x N scores that a fused kernel exists to avoid, so it stays in its stage."""
    read = {s.args[0] for s in u.walk() if s.op in ("In", "Take")}
    # a reduction over an axis none of its tensors has (``sum_j(saved_v)`` with saved_v over r:
    # its body is constant along j) is not hoisted either: a pre-stage fused over j would have
    # no input over j to run on, and inline it is one product with size(j)
    if u.args[0].args[0] not in {a for n in read if n in tensors for a in tensors[n]}:
        return False
    return any(axes <= set(tensors[n]) for n in read if n in tensors)


def _row_axes(a, terms, tensors: dict, out_axes: set) -> set:
    """The axes along which the grid of a stage fused over ``a`` runs programs: the sum
    kernel's row and grid axes (codegen/sums.py: the output axes no tensor over ``a`` carries,
    and those every such tensor carries; else, with a tensor over ``a`` and the rows (a bias),
    every output axis but the ones contracted inside the body, which it holds whole as
    vectors); when it has none, the row family's (every output axis but ``a``)."""
    ft = [set(ax) for ax in tensors.values() if a in ax]
    if ft:
        rows = {x for x in out_axes if not any(x in ax for ax in ft)}
        if rows:
            return rows | (set.intersection(*ft) & out_axes)
        vec = {u.args[0].args[0] for t in terms for u in t.walk()
               if u.op == "Sum" and u.args[0].op == "Ax" and u.args[0].args[0] != a}
        vft = [ax for ax in ft if ax & vec]
        if vft:
            grid = set.intersection(*vft) - {a} - vec
            rows = out_axes - grid - vec
            if rows:
                return rows | (grid & out_axes)
    return set(out_axes)


def _sum_nest(e):
    """``(axes, E)`` when ``e`` is a sum over several axes of a body ``E`` whose only reductions
    are contractions, once each sum is taken out of a product with a factor that does not
    range over its axis (``sum_j(sum_i(sum_b(dS) * (j - i)))`` -> ``([j, i, b], dS * (j - i))``:
    a per-head ALiBi slope's gradient); else None."""
    axes_of = _Axes(e.tensors)

    def flat(t):
        if t.op == "Sum" and t.args[0].op == "Ax" and not _is_contraction(t):
            r = flat(t.args[1])
            return None if r is None else ([t.args[0].args[0]] + r[0], r[1])
        if t.op == "Neg":
            r = flat(t.args[0])
            return None if r is None else (r[0], Term("Neg", (r[1],)))
        if t.op == "Mul":
            x, y = flat(t.args[0]), flat(t.args[1])
            if x is None or y is None or (x[0] and y[0]):
                return None
            inner, other = (x, y[1]) if x[0] else (y, x[1])
            if axes_of(other) & set(inner[0]):   # the factor varies along a summed axis: not invariant
                return None
            return inner[0], Term("Mul", (inner[1], other) if x[0] else (other, inner[1]))
        if any(u.op in RED and not _is_contraction(u) for u in t.walk()):
            return None
        return [], t

    r = flat(e.term)
    if r is None or len(r[0]) < 2 or len(set(r[0])) < len(r[0]) or set(r[0]) & set(e.axes):
        return None
    return r


def _split_loop_sum(k, e, outputs: dict, order, finish: dict) -> bool:
    """A gradient summed over several axes (``sum_{b,i,j}(dS * (j - i))``: a per-head slope)
    whose body reduces only by contractions: a stage fused over one summed axis ``a`` reduces
    the body over ``a`` (``sum_j(dS * (j - i))`` over (b, h, i): one more output of dQ's
    stage, which computes dS anyway) and the sum over the other summed axes is a second step,
    so the body (N x N) is never written whole. ``a`` is preferably the fused axis of a stage
    that computes the body's contractions; else the part is a stage of its own. The part
    must range over no more axes than a tensor the body reads (``_not_larger``). Returns
    whether ``outputs``/``finish`` were changed."""
    nest = _sum_nest(e)
    if nest is None:
        return False
    red, body = nest
    own = _contractions_in(body)
    if not own:
        return False
    def shares(a):
        ks = [n for n, o in outputs.items() if n != k and _inner_axis(o.term) == a]
        return bool(ks) and own <= set().union(*(_contractions_in(outputs[n].term) for n in ks))
    read = {a for n in {u.args[0] for u in body.walk() if u.op in ("In", "Take")} for a in e.tensors.get(n, ())}
    # a stage that computes the body's contractions anyway first; else (no such stage: only this
    # gradient asked for) a stage of its own over a summed axis some tensor it reads ranges over
    for a in [a for a in red if shares(a)] + [a for a in red if a in read and not shares(a)]:
        rest = set(red) - {a}
        paxes = tuple(x for x in order if x in set(e.axes) | rest) if order else tuple(sorted(set(e.axes) | rest))
        if len(paxes) != len(set(e.axes) | rest):
            continue
        part = Term("Sum", (Term("Ax", (a,)), body))
        if not _not_larger(part, set(paxes), e.tensors):
            continue
        del outputs[k]
        outputs[f"part_{k}"] = _retensor(part, paxes, e.tensors)
        finish[k] = (f"part_{k}", tuple(x for x in paxes if x in rest))
        return True
    return False


def _split_finish(outputs: dict, order, finish: dict, forward) -> None:
    for k, e in list(outputs.items()):   # a gradient that sums a tile output of another stage over
        part = _summed_part(e)           # axes of that stage's grid: the
        if part is None:                 # stage stores the tile output, the sum is a second step
            _split_loop_sum(k, e, outputs, order, finish)
            continue
        x, red = part
        looped = {t.args[0].args[0] for o in [o for n, o in outputs.items() if n != k]
                  + list(forward.outputs.values() if forward is not None else []) for t in o.term.walk()
                  if t.op in RED and t.args[0].op == "Ax" and not _is_contraction(t)}
        if looped & set(red):            # (dQ = sum_j(dS * k) is a reduction over keys, not a sum of a tile)
            continue
        xaxes = tuple(a for a in order if a in set(e.axes) | set(red))
        xe = Expr(x, xaxes, e.tensors)
        others = {a: [n for n, o in outputs.items() if n != k and _inner_axis(o.term) == a] for a in
                  {_inner_axis(o.term) for n, o in outputs.items() if n != k} if a is not None}
        if len(xaxes) == len(set(e.axes) | set(red)) and any(   # (a tile: no axis that stage contracts)
                b in xaxes and b not in red and _contractions_in(x) <= set().union(
                    *(_contractions_in(outputs[n].term) for n in ks)) and not set(xaxes) & {
                    u.args[0].args[0] for n in ks for u in _contractions_in(outputs[n].term) if _is_contraction(u)}
                for b, ks in others.items()):
            del outputs[k]
            outputs[f"part_{k}"] = xe
            finish[k] = (f"part_{k}", tuple(red))


def _group(outputs: dict, axis_of=None) -> dict:
    """{fused axis (None: no reduction): [output names]}: each output by the axis it reduces
    innermost (``axis_of``, default ``_inner_axis``), outputs that only share another stage's
    contractions and elementwise outputs moved into a stage that computes them."""
    groups: dict = {}
    elementwise = []
    for k, e in outputs.items():
        a = (axis_of or _inner_axis)(e.term)
        if a is None:
            elementwise.append(k)
        else:
            groups.setdefault(a, []).append(k)
    for a in list(groups):   # outputs whose only reductions are contractions another stage computes
        shared = [k for k in groups[a] if _shares_contractions(outputs[k], a, groups, outputs)]
        for k in shared:        # anyway (a bias's gradient dS over (i, j): in dQ's loop over j)
            target = next(b for b in groups if b != a and b in outputs[k].axes and _contractions_in(
                outputs[k].term) <= set().union(*(_contractions_in(outputs[x].term) for x in groups[b])))
            groups[a].remove(k)
            groups[target].append(k)
        if not groups[a]:
            del groups[a]
    for k in elementwise:   # into a stage whose fused axis the output ranges over, else any
        axes = outputs[k].axes
        target = next((a for a in groups if a in axes), next(iter(groups), None))
        if target is None:
            groups.setdefault(None, []).append(k)
        else:
            groups[target].append(k)
    return groups


def _build(name, outputs: dict, groups: dict, tensor_order) -> list:
    stages = []
    for a, ks in groups.items():
        outs = {k: outputs[k] for k in ks}
        if a is None:   # no reduction at all: a carrier reduction makes it a kernel the row family runs
            k0 = ks[0]
            # (a gradient over no axis, grad_y / size(b r j) of a 0-d mean: the carrier sums over an
            # axis of a tensor it reads, which it is expanded along)
            ax = (outputs[k0].axes or next(v for v in outputs[k0].tensors.values() if v))[-1]
            carrier = Term("Sum", (Term("Ax", (ax,)), Term("Mul", (_carrier_body(outputs[k0].term), ZERO))))
            outs["carrier_"] = Expr(carrier, tuple(x for x in outputs[k0].axes if x != ax), outputs[k0].tensors)
        p = Stage(f"{name}_{a}" if a else name, outs, a)
        p.tensors = {n: p.tensors[n] for n in tensor_order if n in p.tensors}
        stages.append(p)
    return stages
