"""af.backward: the vector-Jacobian product of a program, derived symbolically.

    bwd = af.backward(prog)           # a BackwardProgram (a Program)
    bwd.augmented                     # the forward program plus the saved values
    bwd.saved                         # {"saved_m": ("r",), "saved_s": ("r",)}: inputs that
                                      #   the augmented forward writes and the backward reads
    bwd.cotangents                    # {"grad_y": ("r", "j")}: one per forward output
    bwd.grads                         # {"x": "grad_x", ...}: float input -> gradient output
    bwd.zero_grads                    # float inputs no output depends on (gradient 0)
    bwd.stages                        # one Program per fused axis (what af.fuse/af.compile run)
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
the indicator ``body == m``; ties share it equally (``adj / count``, torch.amax's
convention). ``maximum``/``minimum`` give half to each side on a tie. ``where(c, a, b)``
sends the adjoint to a under c and to b elsewhere; comparisons, logic, ``index`` and
``size`` have none; ``abs`` uses sign(0) = 0. A gather ``take(x, t, j)`` becomes the
scatter ``where(index(j) == t, adjoint, 0)``, so it stays in the language.

Saved values: every forward reduction the backward needs whose result does not range
over the forward's fused axis (the per-row max and sum of a softmax, a layernorm's
mean and variance) is written by the augmented forward and read by the backward as
``saved_<m|s|mn><k>``; reductions that do range over it (attention's scores) are
recomputed. Saved max/min values must be finite: a fully masked row's ``-inf`` is
passed as 0 (the forward's own convention; ``BackwardKernel`` does it).

Numerics conventions (matching the forward's): where a divisor or a log argument
computed from a reduction is 0 (a fully masked row), the adjoint through it is 0, so a
fully masked row gets gradient 0, never NaN. Index inputs (used by ``take``) are
compared with ``index(j)`` in the backward, which reads them as float32 (exact below
2**24; ``BackwardKernel`` converts them).
"""
from __future__ import annotations

from acefuse.lang import Program, Expr, LanguageError
from acefuse.rewrite.terms import Term, pretty
from acefuse.rewrite.encode import _Axes

RED = ("Sum", "RMax", "RMin")
NO_ADJOINT = ("Num", "Size", "Idx", "CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe",
              "LAnd", "LOr", "LNot")
_PREFIX = {"RMax": "m", "Sum": "s", "RMin": "mn"}   # saved names; "v" for other values


class BackwardError(LanguageError):
    """The program cannot be differentiated as asked; the message names the term and the fix."""


# ---- smart constructors: fold x*1, x+0, 0*x (a structurally zero adjoint), --x ------------------
ZERO, ONE = Term("Num", (0.0,)), Term("Num", (1.0,))


def _val(t):
    return t.args[0] if t.op == "Num" and not isinstance(t.args[0], Term) else None


def num(v):
    return Term("Num", (float(v),))


def neg(a):
    v = _val(a)
    if v is not None:
        return num(-v)
    if a.op == "Neg":
        return a.args[0]
    return Term("Neg", (a,))


def add(a, b):
    va, vb = _val(a), _val(b)
    if va == 0:
        return b
    if vb == 0:
        return a
    if va is not None and vb is not None:
        return num(va + vb)
    if b.op == "Neg":
        return sub(a, b.args[0])
    if a.op == "Neg":
        return sub(b, a.args[0])
    if a == b:
        return mul(num(2.0), a)
    return Term("Add", (a, b))


def sub(a, b):
    if _val(b) == 0:
        return a
    if _val(a) == 0:
        return neg(b)
    if b.op == "Neg":
        return add(a, b.args[0])
    return Term("Sub", (a, b))


def mul(a, b):
    va, vb = _val(a), _val(b)
    if va == 0 or vb == 0:
        return ZERO
    if va == 1:
        return b
    if vb == 1:
        return a
    if va is not None and vb is not None:
        return num(va * vb)
    if va == -1:
        return neg(b)
    if vb == -1:
        return neg(a)
    if a.op == "Neg":
        return neg(mul(a.args[0], b))
    if b.op == "Neg":
        return neg(mul(a, b.args[0]))
    return Term("Mul", (a, b))


def div(a, b):
    if _val(a) == 0:
        return ZERO
    if _val(b) == 1:
        return a
    if a.op == "Neg":
        return neg(div(a.args[0], b))
    return Term("Div", (a, b))


def where(c, a, b):
    if a == b:
        return a
    return Term("Where", (c, a, b))


def rsum(axis, t):
    if _val(t) == 0:
        return ZERO
    if t.op == "Neg":
        return neg(rsum(axis, t.args[0]))
    return Term("Sum", (Term("Ax", (axis,)), t))


def _has_red(t: Term, axis: str) -> bool:
    return any(s.op in RED and s.args[0].op == "Ax" and s.args[0].args[0] == axis for s in t.walk())


def _cmp(op, a, b):
    return Term(op, (a, b))


# ---- the backward program -------------------------------------------------------------------------
class BackwardProgram(Program):
    """The vector-Jacobian product of ``forward`` (see the module docstring for the API)."""

    def __init__(self, name, outputs, forward, augmented, saved, saved_kind, cotangents, grads,
                 zero_grads, index_inputs, stages, input_axes):
        super().__init__(name, outputs)
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
    def __init__(self, prog):
        from acefuse.fuse import _pick_axis, FuseError
        self.prog = prog
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
            for child, c in self.local(t, adj):
                if not self.live(child):
                    continue
                c = c()
                c = self.reduce_to(c, child)
                if _val(c) != 0:
                    contribs.setdefault(child, []).append(c)
        return grads

    def live(self, t: Term) -> bool:
        """``t`` depends on a float input (so it has an adjoint worth computing)."""
        if t not in self.lmemo:
            if t.op == "In":
                r = t.args[0] not in self.idx_inputs
            elif t.op == "Take":
                r = t.args[0] not in self.idx_inputs
            elif t.op in NO_ADJOINT:
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
        if t.op in NO_ADJOINT:
            return []
        return list(t.children)

    def reduce_to(self, c: Term, child: Term) -> Term:
        target = self.axes_of(child)
        for a in self.ordered(self.axes_of(c) - target):
            c = self.rsum(a, c)
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
        return [(1, [t])]

    def local(self, t: Term, g: Term) -> list:
        """(operand, thunk) pairs: the adjoint ``g`` of ``t`` pulled back to each operand
        (a thunk, so that forward values are only asked for where an adjoint flows)."""
        op, P = t.op, self.P
        args = t.args
        if op in NO_ADJOINT:
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
                hit = _cmp("CmpEq", P(args[1]), P(t))
                return where(hit, div(g, rsum(axis, where(hit, ONE, ZERO))), ZERO)
            return [(args[1], dext)]
        raise BackwardError(f"program {self.prog.name!r}: no derivative for operator {op!r} in "
                            f"`{pretty(t)}`; rewrite the program with the operators af documents")


def backward(prog) -> BackwardProgram:
    """The vector-Jacobian-product program of ``prog`` (see the module docstring)."""
    if isinstance(prog, BackwardProgram):
        raise BackwardError(f"af.backward({prog.name!r}): higher derivatives are not supported; "
                            "differentiate the forward program")
    if not isinstance(prog, Program):
        raise BackwardError(f"af.backward expects a program made with af.program(...), got {type(prog).__name__}")
    d = _Deriv(prog)
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
        if name in idx_inputs:
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
        outputs[gname] = _expr(d, g)
        grads[name] = gname
    if not outputs:
        raise BackwardError(f"program {prog.name!r}: no float input reaches an output, so every gradient "
                            "is zero; there is nothing to differentiate")
    aug_out = dict(prog.outputs)
    for t, name in d.saved.items():
        aug_out[name] = Expr(t, d.tensors[name], dict(prog.tensors))
    augmented = Program(prog.name + "_fwd", aug_out) if d.saved else prog
    saved = {name: d.tensors[name] for name in d.saved.values()}
    tensor_order = _tensor_order(prog, idx_inputs, saved, cot_axes)
    stages = _stages(prog.name + "_bwd", outputs, tensor_order)
    bwd = BackwardProgram(prog.name + "_bwd", outputs, prog, augmented, saved, d.saved_kind, cot_axes,
                          grads, zero, idx_inputs, stages, dict(prog.tensors))
    bwd.tensors = {n: bwd.tensors[n] for n in tensor_order if n in bwd.tensors}
    return bwd


def _expr(d: _Deriv, t: Term) -> Expr:
    used = {s.args[0] for s in t.walk() if s.op == "In"} | {s.args[0] for s in t.walk() if s.op == "Take"}
    return Expr(t, d.ordered(d.axes_of(t)), {n: d.tensors[n] for n in d.tensors if n in used})


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
    inner = []
    for s in t.walk():
        if s.op in RED and s.args[0].op == "Ax":
            for a in _red_axes(s.args[1]):
                if a != s.args[0].args[0] and a not in inner:
                    inner.append(a)
    return inner[0] if len(inner) == 1 else red[0]


def _stages(name, outputs: dict, tensor_order) -> list:
    groups: dict = {}
    elementwise = []
    for k, e in outputs.items():
        a = _inner_axis(e.term)
        if a is None:
            elementwise.append(k)
        else:
            groups.setdefault(a, []).append(k)
    for k in elementwise:   # into a stage whose fused axis the output ranges over, else any
        axes = outputs[k].axes
        target = next((a for a in groups if a in axes), next(iter(groups), None))
        if target is None:
            groups.setdefault(None, []).append(k)
        else:
            groups[target].append(k)
    stages = []
    for a, ks in groups.items():
        outs = {k: outputs[k] for k in ks}
        if a is None:   # no reduction at all: a carrier reduction makes it a kernel the row family runs
            k0 = ks[0]
            ax = outputs[k0].axes[-1]
            carrier = Term("Sum", (Term("Ax", (ax,)), Term("Mul", (outputs[k0].term, ZERO))))
            outs["carrier_"] = Expr(carrier, tuple(x for x in outputs[k0].axes if x != ax), outputs[k0].tensors)
        p = Program(f"{name}_{a}" if a else name, outs)
        p.tensors = {n: p.tensors[n] for n in tensor_order if n in p.tensors}
        stages.append(p)
    return stages
