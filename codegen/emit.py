"""Terms to Triton expressions, with shapes tracked and common subterms named once.

Shapes: ``scalar``; ``row`` ([BLOCK_R], one value per row); ``col`` ([1, BLOCK_J],
one value per element of the tile, shared by all rows); ``tile`` ([BLOCK_R, BLOCK_J]).
A row value meeting a col/tile value is broadcast with ``[:, None]``.

Numerics conventions (documented in README.md). IEEE semantics everywhere, except:
- an *empty* extremum state (a max that is -inf because every element of its block
  is -inf, a min that is +inf) reads as 0 where it is the bound of a shift: a max in
  subtracted position (``x - m``, ``-m``), a min in added position of a difference
  (``m - x``). Polarity is tracked through ``+``, ``-``, unary minus and products with
  a constant. So a fully masked block never computes ``-inf - -inf``, while the old
  state of a rolling update (``exp(m_A - m_AB)``, ``m_A = -inf``) still gives
  ``exp(-inf) = 0``; a max that is +inf (or a min that is -inf) is a real infinity and
  follows IEEE (a row holding +inf gives NaN for softmax, as torch does);
- a division whose denominator comes from a reduction gives 0 when numerator and
  denominator are both 0 (a fully masked row's normalized output is 0, not NaN).
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term, pretty

_BIN = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/"}
_CMP = {"CmpLt": "<", "CmpLe": "<=", "CmpGt": ">", "CmpGe": ">=", "CmpEq": "==", "CmpNe": "!="}
_FN = {"Exp": "tl.exp", "Log": "tl.log", "Sqrt": "tl.sqrt", "Rsqrt": "tl.rsqrt", "Abs": "tl.abs"}


class CodegenError(ValueError):
    """A term has no Triton lowering in this kernel family."""


def join_shapes(a, b):
    """Shape of an elementwise result (row family; the contraction family extends it)."""
    order = {"scalar": 0, "row": 1, "col": 2, "tile": 3, "rvec": 3}
    if a == b:
        return a
    if {a, b} == {"row", "col"}:
        return "tile"
    if "jvec" in (a, b) or {a, b} in ({"tile", "rvec"}, {"col", "rvec"}):
        raise CodegenError(f"cannot combine a {a} value with a {b} value elementwise")
    return a if order[a] >= order[b] else b


def bcast(e, shape, target):
    if shape == "row" and target in ("tile", "col", "rvec"):
        return f"{e}[:, None]"
    return e


class Emitter:
    """Appends assignment lines; ``emit(term)`` returns (expression, shape)."""

    def __init__(self, ctx, indent="    ", counter=None):
        self.ctx = ctx            # codegen.row.Context: names of states, tiles, leaves, tensors
        self.lines: list = []
        self.cache: dict = {}
        self.indent = indent
        # one counter per kernel: a temporary never changes shape under the same name
        # (Triton rejects a loop-carried name whose type changes)
        self.counter = counter if counter is not None else getattr(getattr(ctx, "g", None), "counter", [0])

    def fresh(self, hint="t"):
        self.counter[0] += 1
        return f"_{hint}{self.counter[0]}"

    def line(self, s):
        self.lines.append(self.indent + s)

    def comment(self, s):
        for part in s.splitlines():
            self.lines.append(self.indent + "# " + part)

    def assign(self, name, expr):
        self.line(f"{name} = {expr}")
        return name

    def bind(self, expr, shape, hint="t"):
        if _is_atom(expr):
            return expr, shape
        name = self.fresh(hint)
        self.assign(name, expr)
        return name, shape

    # -- the lowering ----------------------------------------------------------------
    def emit(self, t: Term, raw_state=False, pol=None):
        """Lower ``t``; ``pol`` is its sign inside an enclosing difference ("+", "-") or
        None outside one (``raw_state`` is accepted for compatibility: states are raw
        unless they bound a shift, see the module docstring)."""
        canon = getattr(self.ctx, "canon", None)
        if canon is not None:
            t = canon(t)
        if t.op != "St" and not _carries_pol(t) and not (pol == "-" and _row_only(t)):
            pol = None   # polarity only matters where it can reach a per-row value
        key = (t, pol)
        if key in self.cache:
            return self.cache[key]
        if pol == "-" and t.op != "St" and _row_only(t):
            # a subtracted per-row value built only from reductions that is -inf (a fully
            # masked row reaching it) reads as 0, like an empty max (module docstring)
            e, sh = self.emit(t)
            out = self.bind(f"_fin_max({e})", sh, "f")
        else:
            out = self._emit(t, pol)
        self.cache[key] = out
        return out

    def _bcast(self, e, shape, target):
        return bcast(e, shape, target)

    def join(self, a, b):
        j = getattr(self.ctx, "join", None)
        return j(a, b) if j else join_shapes(a, b)

    def _emit(self, t: Term, pol):
        op, ctx = t.op, self.ctx
        if op == "Num":
            v = float(t.args[0])
            if v == float("inf"):
                return "float('inf')", "scalar"
            if v == float("-inf"):
                return "float('-inf')", "scalar"
            return repr(v), "scalar"
        if op == "St":
            name, shape = ctx.state_var(t.args[0], t.args[1], pol)
            kind = ctx.g.ops.get(t.args[0])
            if pol == "-":
                kind = "max"    # any subtracted per-row value from reductions: -inf reads as 0
            if (kind == "max" and pol == "-") or (kind == "min" and pol == "+"):
                # an empty max (min) bounds the shift as 0: never -inf - -inf
                return self.bind(f"_fin_{kind}({name})", shape, "f")
            return name, shape
        if op == "Cnt":
            return ctx.count(t.args[0]), "scalar"
        if op == "Size":
            return ctx.size(t.args[0]), "scalar"
        if op == "Idx":
            return ctx.index(t.args[0])
        if op == "In":
            return ctx.load(t.args[0], self)
        if op == "Take":
            return ctx.take(t, self)
        if op in ("Elm", "Par"):
            return self.emit(ctx.leaf(t.args[0]))
        if op in ("Sum", "RMax", "RMin"):
            if t.args[0].op == "Ax":
                return ctx.contract(t, self)
            return self._reduce(t)
        if op == "Add" and hasattr(ctx, "accumulate"):
            out = ctx.accumulate(t, self)
            if out is not None:
                return out
        if op in _BIN:
            (a, sa), (b, sb) = (self.emit(x, pol=p) for x, p in zip(t.args, _child_pols(t, pol)))
            s = self.join(sa, sb)
            a2, b2 = self._bcast(a, sa, s), self._bcast(b, sb, s)
            if op == "Div" and ctx.from_reduction(t.args[1]):
                return self.bind(f"_div0({a2}, {b2})", s)
            return self.bind(f"{a2} {_BIN[op]} {b2}", s)
        if op in _CMP or op in ("LAnd", "LOr"):
            (a, sa), (b, sb) = self.emit(t.args[0]), self.emit(t.args[1])
            s = self.join(sa, sb)
            sym = _CMP.get(op) or {"LAnd": "&", "LOr": "|"}[op]
            return self.bind(f"({self._bcast(a, sa, s)} {sym} {self._bcast(b, sb, s)})", s, "c")
        if op == "LNot":
            a, sa = self.emit(t.args[0])
            return self.bind(f"(~{a})", sa, "c")
        if op == "Neg":
            a, sa = self.emit(t.args[0], pol=_flip(pol or "+"))
            return self.bind(f"-{a}", sa)
        if op == "Exp" and getattr(ctx, "fold_exp2", False):
            # exp(x) = exp2(x * log2(e)), with the constant folded into the operands so that
            # (s * c - m) * log2(e) becomes one fused multiply-add per element
            a, sa = self.emit(_scale_log2e(t.args[0], ctx))
            return self.bind(f"tl.exp2({a})", sa)
        if op in _FN:
            a, sa = self.emit(t.args[0])
            return self.bind(f"{_FN[op]}({a})", sa)
        if op == "Tanh":
            a, sa = self.emit(t.args[0])
            return self.bind(f"_tanh({a})", sa)
        if op == "Pow":
            a, sa = self.emit(t.args[0])
            p = float(t.args[1])
            if p.is_integer() and 0 < p <= 4:
                return self.bind(" * ".join([a] * int(p)), sa)
            return self.bind(f"tl.exp({p!r} * tl.log({a}))", sa)
        if op in ("Max2", "Min2"):
            (a, sa), (b, sb) = self.emit(t.args[0]), self.emit(t.args[1])
            s = self.join(sa, sb)
            fn = "tl.maximum" if op == "Max2" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if getattr(ctx, "nan_extrema", False) else ""
            return self.bind(f"{fn}({self._bcast(a, sa, s)}, {self._bcast(b, sb, s)}{nan})", s)
        if op == "Where":
            (c, sc), (a, sa), (b, sb) = (self.emit(x) for x in t.args)
            s = self.join(self.join(sc, sa), sb)
            args = ", ".join(self._bcast(e, se, s) for e, se in ((c, sc), (a, sa), (b, sb)))
            return self.bind(f"tl.where({args})", s)
        raise CodegenError(f"no Triton lowering for `{pretty(t)}` (operator {op}) in the row kernel "
                           "family; rewrite the program without it or report the operator")

    def _reduce(self, t: Term):
        special = getattr(self.ctx, "reduce_tile", None)
        if special is not None:
            out = special(t, self)
            if out is not None:
                return out
        blk = t.args[0]
        if blk.op != "BB":
            raise CodegenError(f"`{pretty(t)}`: only reductions over the tile in registers can be "
                               "lowered; this form reads data the kernel no longer has (an acefuse bug)")
        body, sb = self.emit(t.args[1])
        body = self._bcast(body, sb, "tile")
        mask = self.ctx.tile_mask
        if mask is None:  # a tile proven fully visible and in bounds
            if sb != "tile":
                body = f"({body}) + tl.zeros([BLOCK_I, BLOCK_J], tl.float32)"
            return self.bind(self._red_call(t.op, body), "row", "r")
        if t.op == "Sum":
            return self.bind(f"tl.sum(tl.where({mask}, {body}, 0.0), axis=1)", "row", "r")
        if t.op == "RMax":
            return self.bind(self._red_call(t.op, f"tl.where({mask}, {body}, float('-inf'))"), "row", "r")
        return self.bind(self._red_call(t.op, f"tl.where({mask}, {body}, float('inf'))"), "row", "r")

    def _red_call(self, op, body):
        """A row reduction of a tile. Max/min propagate NaN like torch (``_max_nan``) where the
        family asks for it (the row family); otherwise Triton's max/min, which drop NaN."""
        if op == "Sum":
            return f"tl.sum({body}, axis=1)"
        if getattr(self.ctx, "nan_extrema", False):
            return f"tl.reduce({body}, 1, {'_max_nan' if op == 'RMax' else '_min_nan'})"
        return f"{'tl.max' if op == 'RMax' else 'tl.min'}({body}, axis=1)"


LOG2E = 1.4426950408889634


def _flip(p):
    return "-" if p == "+" else "+"


def _child_pols(t: Term, pol):
    """Polarity of the operands of a binary arithmetic node (see the module docstring)."""
    op = t.op
    if op == "Add":
        return (pol, pol)
    if op == "Sub":
        p = pol or "+"
        return (p, _flip(p))
    if op in ("Mul", "Div") and pol is not None:
        a, b = t.args
        if b.op == "Num" and not isinstance(b.args[0], Term):
            return (pol if float(b.args[0]) >= 0 else _flip(pol), None)
        if op == "Mul" and a.op == "Num" and not isinstance(a.args[0], Term):
            return (None, pol if float(a.args[0]) >= 0 else _flip(pol))
    return (None, None)


_POL_OPS = frozenset(("Add", "Sub", "Neg", "Mul", "Div"))


def _carries_pol(t: Term) -> bool:
    return t.op in _POL_OPS


_ROW_LEAVES = frozenset(("St", "Sum", "RMax", "RMin"))


def _row_only(t: Term) -> bool:
    """A per-row value built only from reductions (states, tile reductions) and constants."""
    found = [False]

    def walk(u):
        if u.op in _ROW_LEAVES:
            found[0] = True
            return True
        if u.op in ("Num", "Cnt", "Size"):
            return True
        if u.op in ("Elm", "Par", "In", "Idx", "Take"):
            return False
        return all(walk(c) for c in u.children)
    return walk(t) and found[0]


def _scale_log2e(t: Term, ctx) -> Term:
    """``t * log2(e)``, pushed through +, -, negation, where and constant factors."""
    op = t.op
    if op in ("Add", "Sub"):
        return Term(op, (_scale_log2e(t.args[0], ctx), _scale_log2e(t.args[1], ctx)))
    if op == "Neg":
        return Term(op, (_scale_log2e(t.args[0], ctx),))
    if op == "Num":
        return Term("Num", (float(t.args[0]) * LOG2E,))
    if op == "Mul" and t.args[1].op == "Num":
        return Term("Mul", (t.args[0], Term("Num", (float(t.args[1].args[0]) * LOG2E,))))
    if op == "Mul" and t.args[0].op == "Num":
        return Term("Mul", (Term("Num", (float(t.args[0].args[0]) * LOG2E,)), t.args[1]))
    if op == "Where":
        return Term(op, (t.args[0], _scale_log2e(t.args[1], ctx), _scale_log2e(t.args[2], ctx)))
    if op == "Elm":
        return _scale_log2e(ctx.leaf(t.args[0]), ctx)
    return Term("Mul", (t, Term("Num", (LOG2E,))))


def _is_atom(e: str) -> bool:
    return e.replace("_", "").isalnum() or e.replace(".", "").replace("-", "").replace("e", "").isdigit()
