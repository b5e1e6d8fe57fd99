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

from acefuse.rewrite.terms import Term, pretty, is_integer, INT_OPS, BOOLEAN, CAST_LIMITS, SATURATING, FLOAT_CASTS

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


_RN_OPS = frozenset(("Div", "Sqrt", "Rsqrt"))
# the module header's helper that rounds a float32 value into each float format (codegen/row.py)
_ROUND_HELPER = {"float8_e4m3fn": "_rnd_e4m3", "float8_e5m2": "_rnd_e5m2", "float16": "_rnd_f16",
                 "bfloat16": "_rnd_bf16"}


def _rounds_differently(t: Term) -> bool:
    """``t`` lowers differently inside a rounding's operand (it holds a square root)."""
    return any(u.op in _RN_OPS for u in t.walk())


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
        # > 0 while lowering the operand of a rounding (cast, round, floor, ceil): square roots
        # there are correctly rounded too, so the rounding sees the value torch computes
        self._rn = 0
        # masked tiles of a family that asks for it (ctx.fold_tile_mask): names of tile values
        # proven -inf (``_ninf``) or 0 (``_zero``) wherever the tile mask is false, so that a
        # reduction or a p @ v of them needs no select of its own; ``_finrow``: per-row shifts
        # bound by _fin_max (never -inf)
        self._ninf: set = set()
        self._zero: set = set()
        self._finrow: set = set()
        self._fold_conds: dict = {}

    def _is_ext(self, q) -> bool:
        """State q is a max/min, or a reference value built from one (``m + log(l)``)."""
        g = getattr(self.ctx, "g", None)
        ops = getattr(g, "ops", {})
        if ops.get(q) in ("max", "min"):
            return True
        if ops.get(q) == "ref":   # built from a max, a min or a log (m + log(l), log(l))
            return any((u.op == "St" and u.args[0] != q and self._is_ext(u.args[0])) or u.op == "Log"
                       for u in g.defs[q].walk())
        return False

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
        if expr.startswith("_fin_max(") and shape in ("row", "scalar"):
            self._finrow.add(name)
        return name, shape

    def _fold_mask(self):
        """The tile mask that a masked tile's -inf selects absorb (module docstring of
        contraction_ctx: ``fold_tile_mask``), True for a masked tile with no tile mask (inside
        the keys: the program's condition alone), or None."""
        if not getattr(self.ctx, "fold_tile_mask", False):
            return None
        return self.ctx.tile_mask or True

    def masked_off(self, name, value):
        """Whether the tile value ``name`` is ``value`` (-inf or 0) wherever the tile mask is false."""
        return name in (self._ninf if value == "-inf" else self._zero)

    # -- the lowering ----------------------------------------------------------------
    def emit(self, t: Term, raw_state=False, pol=None):
        """Lower ``t``; ``pol`` is its sign inside an enclosing difference ("+", "-") or
        None outside one (``raw_state`` is accepted for compatibility: states are raw
        unless they bound a shift, see the module docstring)."""
        canon = getattr(self.ctx, "canon", None)
        if canon is not None:
            t = canon(t)
        shift = pol == "-" and t.op != "St" and _row_only(t, self._is_ext)
        if t.op != "St" and not _carries_pol(t) and not shift:
            pol = None   # polarity only matters where it can reach a per-row value
        key = (t, pol, self._rn > 0 and _rounds_differently(t))
        if key in self.cache:
            return self.cache[key]
        if shift:
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
            if v != v:   # NaN (af.topk's value of a NaN element)
                return "float('nan')", "scalar"
            return repr(v), "scalar"
        if op == "St":
            name, shape = ctx.state_var(t.args[0], t.args[1], pol)
            kind = ctx.g.ops.get(t.args[0])
            if pol == "-" and self._is_ext(t.args[0]):
                kind = "max"    # a subtracted per-row value built from a max: -inf reads as 0
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
            if op == "Div":
                # correctly rounded, as torch divides (Triton's `/` is div.full.f32 on the GPU,
                # off by up to 2 ulp: a cast of x / scale then differs from torch's)
                # (one divisor per row takes tl.div_rn too: a reciprocal per row with Markstein's
                # correction per element needed a tile-wide branch for the values outside its guarded
                # range, and that branch made a bf16 softmax forward at 16384x8192 3.3x slower on an
                # H200: 438 us against 144 with tl.div_rn per element and 130 for a copy)
                z = ctx.from_reduction(t.args[1])
                if z and not self._rn and hasattr(ctx, "row_quotient"):
                    # a family's cheaper quotient by a per-row value (the row family: a tile
                    # divided by a per-row sum on its way to a float16/bfloat16 output, a
                    # product with the row's reciprocal, no per-element correction and no
                    # branch: Context.row_quotient in codegen/row.py; README, numerics)
                    out = ctx.row_quotient(t, a2, b, sb, s, self)
                    if out is not None:
                        return out
                if z:
                    return self.bind(f"_div0({a2}, {b2})", s)
                return self.bind(f"tl.div_rn({a2}, {b2})", s)
            out = self.bind(f"{a2} {_BIN[op]} {b2}", s)
            if self._fold_mask() and s == "tile" and a in self._ninf:
                # -inf * c = -inf for a constant 0 < c < inf; -inf - f = -inf for a shift f bound
                # by _fin_max (never -inf; a NaN or +inf f makes the row's every exp NaN or 0 alike)
                cb = _literal_pos(t.args[1])
                if (op == "Mul" and cb) or (op == "Sub" and b in self._finrow and sb in ("row", "scalar")):
                    self._ninf.add(out[0])
            return out
        if op in _CMP:
            (a, sa), (b, sb) = self.emit(t.args[0]), self.emit(t.args[1])
            s = self.join(sa, sb)
            return self.bind(f"({self._bcast(a, sa, s)} {_CMP[op]} {self._bcast(b, sb, s)})", s, "c")
        if op in ("LAnd", "LOr"):
            (a, sa), (b, sb) = self.cond(t.args[0]), self.cond(t.args[1])
            s = self.join(sa, sb)
            sym = {"LAnd": "&", "LOr": "|"}[op]
            if sa != sb and "scalar" in (sa, sb):
                # a 0-d condition (a comparison of a loaded scalar) with a vector one: Triton's
                # interpreter has no bitwise and/or of those two kinds of bool (a TypeError), so
                # the operands go through int32 there and on the GPU alike
                return self.bind(f"(({self._bcast(a, sa, s)}).to(tl.int32) {sym} ({self._bcast(b, sb, s)})"
                                 f".to(tl.int32) != 0)", s, "c")
            return self.bind(f"({self._bcast(a, sa, s)} {sym} {self._bcast(b, sb, s)})", s, "c")
        if op == "LNot":
            a, sa = self.cond(t.args[0])
            return self.bind(f"(~{a})", sa, "c")
        if op == "Neg":
            a, sa = self.emit(t.args[0], pol=_flip(pol or "+"))
            return self.bind(f"-{a}", sa)
        if op == "Exp" and getattr(ctx, "fold_exp2", False):
            # exp(x) = exp2(x * log2(e)), with the constant folded into the operands so that
            # (s * c - m) * log2(e) becomes one fused multiply-add per element
            a, sa = self.emit(_scale_log2e(t.args[0], ctx))
            out = self.bind(f"tl.exp2({a})", sa)
            if a in self._ninf:
                self._zero.add(out[0])
            return out
        if op in _FN:
            a, sa = self.emit(t.args[0])
            if self._rn and op in ("Sqrt", "Rsqrt"):
                return self.bind(f"tl.sqrt_rn({a})" if op == "Sqrt" else f"tl.div_rn(1.0, tl.sqrt_rn({a}))", sa)
            return self.bind(f"{_FN[op]}({a})", sa)
        if op == "Tanh":
            if hasattr(ctx, "tanh"):   # a family's own lowering (contraction_ctx: the scores' tanh)
                return ctx.tanh(t, self)
            a, sa = self.emit(t.args[0])
            return self.bind(f"_tanh({a})", sa)
        if op in _FUNCS:
            return self._function(t)
        if op in INT_OPS:
            r, s, bad = self.emit_int(t)
            f = f"({r}).to(tl.float32)"
            if bad is not None:
                f = f"tl.where({bad}, float('nan'), {f})"
            return self.bind(f, s, "i")
        if op == "Pow":
            a, sa = self.emit(t.args[0])
            return self.bind(pow_expr(a, t.args[1]), sa)
        if op in ("Max2", "Min2"):
            (a, sa), (b, sb) = self.emit(t.args[0]), self.emit(t.args[1])
            s = self.join(sa, sb)
            fn = "tl.maximum" if op == "Max2" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if getattr(ctx, "nan_extrema", False) else ""
            return self.bind(f"{fn}({self._bcast(a, sa, s)}, {self._bcast(b, sb, s)}{nan})", s)
        if op == "Where":
            if self._fold_mask() and _literal_value(t.args[2]) == float("-inf"):
                x = t.args[1]
                while x.op == "Elm":
                    x = ctx.leaf(x.args[0])
                if x.op == "Mul" and _literal_pos(x.args[1]):
                    # where(c, x * k, -inf) = where(c, x, -inf) * k for 0 < k < inf, exactly: the
                    # select of a max's operand is reused by the exp's (the score scaled once)
                    return self._emit(Term("Mul", (Term("Where", (t.args[0], x.args[0], t.args[2])), x.args[1])), pol)
                leaves = _conjuncts(t.args[0])
                if len(leaves) > 1:
                    return self._masked_selects(leaves, t.args[1])
            (c, sc), (a, sa), (b, sb) = self.cond(t.args[0]), self.emit(t.args[1]), self.emit(t.args[2])
            s = self.join(self.join(sc, sa), sb)
            mask = self._fold_mask()
            if mask and s == "tile" and b == "float('-inf')":
                # a masked tile: the tile mask joins the condition once, so that the value is
                # -inf wherever the tile mask is false and the reductions of it select nothing
                cb = self._bcast(c, sc, s)
                if cb not in self._fold_conds:
                    self._fold_conds[cb] = cb if mask is True else self.bind(f"{cb} & {mask}", "tile", "c")[0]
                args = ", ".join((self._fold_conds[cb], self._bcast(a, sa, s), b))
                out = self.bind(f"tl.where({args})", s)
                self._ninf.add(out[0])
                return out
            args = ", ".join(self._bcast(e, se, s) for e, se in ((c, sc), (a, sa), (b, sb)))
            return self.bind(f"tl.where({args})", s)
        raise CodegenError(f"no Triton lowering for `{pretty(t)}` (operator {op}) in the row kernel "
                           "family; rewrite the program without it or report the operator")

    def _masked_selects(self, leaves, value):
        """``where(c1 & c2 & ..., value, -inf)`` on a masked tile as one select per condition,
        ``where(c2, where(c1, value, -inf), -inf)`` (the tile mask, if any, the outermost): the
        same values exactly, without the conjunction as a tensor of booleans (its bytes and their
        bitwise ands: session 20, the sliding window's sm_90 code, 280 of 8256 instructions)."""
        a, sa = self.emit(value)
        conds = [self.cond(x) for x in leaves]
        s = sa
        for _, sc in conds:
            s = self.join(s, sc)
        mask = self._fold_mask()
        if s != "tile":
            c = self.bind(" & ".join(self._bcast(c, sc, s) for c, sc in conds), s, "c")[0]
            return self.bind(f"tl.where({c}, {self._bcast(a, sa, s)}, float('-inf'))", s)
        v = self._bcast(a, sa, s)
        for c, sc in conds + ([(mask, "tile")] if mask is not True else []):
            v = self.bind(f"tl.where({self._bcast(c, sc, s)}, {v}, float('-inf'))", s)[0]
        self._ninf.add(v)
        return v, s

    def cond(self, t: Term):
        """``t`` as a boolean block: a comparison or a logical operator is one already; any other
        value (a bool or int mask tensor, read as float32) holds where it is nonzero."""
        c, sc = self.emit(t)
        if t.op in _CMP or t.op in ("LAnd", "LOr", "LNot"):
            return c, sc
        return self.bind(f"({c} != 0)", sc, "c")

    # -- special functions and rounding (float32 values; see _FUNCS) ---------------------------
    def _function(self, t: Term):
        op, arg = t.op, t.args[0]
        if arg.op == "Num" and not isinstance(arg.args[0], Term):
            from acefuse import lang   # a function of a literal: its value
            v = lang._lift(arg.args[0])
            v = lang.cast(v, t.args[1]) if op == "Cast" else getattr(lang, _FUNCS[op])(v)
            return self.emit(v.term)
        rounding = op in ("Cast", "Round", "Floor", "Ceil")
        self._rn += rounding
        try:
            a, sa = self.emit(arg)
        finally:
            self._rn -= rounding
        b = lambda e, h="u": self._once(e, sa, h)   # noqa: E731 - one temporary of a's shape
        if op == "Erf":
            return self.bind(f"tl.erf({a})", sa)
        if op == "Sigmoid":
            # exp of -|a| never overflows; a < 0 uses e / (1 + e), exact to a few ulp for large -a
            self.comment(f"sigmoid({pretty(arg)}): 1 / (1 + e) where the argument is >= 0, else e / (1 + e), "
                         "with e = exp(-|argument|) <= 1")
            e = b(f"tl.exp(-tl.abs({a}))")
            return self.bind(f"tl.where({a} >= 0, 1.0 / (1.0 + {e}), {e} / (1.0 + {e}))", sa)
        if op in ("Log1p", "Expm1", "Softplus"):
            # computed in float64, then rounded to float32: error <= 1 ulp of float32 (a 3-term
            # series where |w| < 1e-5, else log(1 + w) / exp(w) - 1 with >= 36 good bits)
            self.comment(f"{_FUNCS[op]}({pretty(arg)}) in float64: a series for tiny arguments, no cancellation")
            w = b(f"({a}).to(tl.float64)", "w")
            if op == "Log1p":
                return self.bind(f"tl.where(tl.abs({w}) < 1e-5, {w} * (1.0 - {w} * (0.5 - {w} * "
                                 f"0.3333333333333333)), tl.log(1.0 + {w})).to(tl.float32)", sa)
            if op == "Expm1":
                return self.bind(f"tl.where(tl.abs({w}) < 1e-5, {w} * (1.0 + {w} * (0.5 + {w} * "
                                 f"0.16666666666666666)), tl.exp({w}) - 1.0).to(tl.float32)", sa)
            # softplus(w) = max(w, 0) + log1p(exp(-|w|)): no overflow, no cancellation
            e = b(f"tl.exp(-tl.abs({w}))", "w")
            lp = b(f"tl.where({e} < 1e-5, {e} * (1.0 - 0.5 * {e}), tl.log(1.0 + {e}))", "w")
            return self.bind(f"(tl.where({w} > 0.0, {w}, 0.0) + {lp}).to(tl.float32)", sa)
        if op == "Floor":
            return self.bind(f"tl.floor({a})", sa)
        if op == "Ceil":
            return self.bind(f"tl.ceil({a})", sa)
        if op == "Round":
            # ties to even: f = floor(a), d = a - f (exact); up when d > 1/2, or d == 1/2 and f is odd
            self.comment(f"round({pretty(arg)}): to nearest, ties to even (-0.3 rounds to -0.0, as torch)")
            return self.bind(f"_rint({a})", sa)
        if op == "Cast" and t.args[1] in FLOAT_CASTS:
            return self._float_cast(a, sa, arg, t.args[1])
        if op == "Cast" and t.args[1] in SATURATING:
            lo, hi = SATURATING[t.args[1]]
            self.comment(f"cast({pretty(arg)}, {t.args[1]!r}): truncate toward zero, saturate to "
                         f"{lo:g}..{hi:g}; NaN stays NaN")
            tr = b(f"_trunc({a})")
            return self.bind(f"tl.where({tr} != {tr}, {tr}, tl.minimum(tl.maximum({tr}, {lo!r}), {hi!r}))", sa)
        if op == "Cast":
            lim = CAST_LIMITS[t.args[1]]
            self.comment(f"cast({pretty(arg)}, {t.args[1]!r}): truncate toward zero; NaN outside the type")
            tr = b(f"_trunc({a})")
            return self.bind(f"tl.where(({tr} >= {-lim!r}) & ({tr} < {lim!r}), {tr}, float('nan'))", sa)
        raise CodegenError(f"no Triton lowering for `{pretty(t)}`")

    def _float_cast(self, a, sa, arg, dtype):
        """``a`` rounded to a float format, exactly as torch's ``.to()`` (rewrite/terms.py
        FLOAT_CASTS), as a float32 value: ``_rnd_<format>`` (codegen/row.py's module header) uses
        the hardware conversion when the module is compiled for an NVIDIA GPU (``NATIVE``), with
        the fix-ups that make it torch's, and otherwise emulates the rounding in float32/int32
        arithmetic (Triton's interpreter truncates bfloat16 and wraps float8). The operand is
        remembered, so that a float8 output is converted from it once (``RowGen.stored``)."""
        if dtype == "float32":
            return a, sa   # kernels compute in float32: the value is already rounded
        _, _, top, over = FLOAT_CASTS[dtype]
        self.comment(f"cast({pretty(arg)}, {dtype!r}): round to nearest even into the format; past "
                     f"{top:g}: {'saturate' if over == 'sat' else 'inf'}; NaN stays NaN")
        out = self.bind(f"{_ROUND_HELPER[dtype]}({a})", sa)
        src = getattr(getattr(self.ctx, "g", None), "cast_src", None)
        if src is not None:
            src[out[0]] = (a, dtype)
        return out

    def _once(self, expr, shape, hint):
        """A temporary for ``expr``, shared by every use in this region (a guard or a
        conversion that several operators need is computed once)."""
        key = ("once", expr, shape)
        if key not in self.cache:
            self.cache[key] = self.bind(expr, shape, hint)[0]
        return self.cache[key]

    # -- exact integer arithmetic ---------------------------------------------------------------
    def emit_int(self, t: Term):
        """Lower an integer expression (``is_integer``) to int64: (expression, shape, bad),
        where ``bad`` names a boolean that is true where the value is undefined (a division
        by zero, a shift count outside 0..63, rounding a NaN/infinite/huge value), or None.
        Indices, constants and + - * stay exact in int64 here, whatever their size."""
        canon = getattr(self.ctx, "canon", None)
        if canon is not None:
            t = canon(t)
        key = ("int", t)
        if key in self.cache:
            return self.cache[key]
        out = self._emit_int(t)
        self.cache[key] = out
        return out

    def _emit_int(self, t: Term):
        op, ctx = t.op, self.ctx
        if not is_integer(t):
            raise CodegenError(f"`{pretty(t)}` is not an integer expression (an acefuse bug: the "
                               "language checks the operands of integer operators)")
        if op == "Num":
            return repr(int(t.args[0])), "scalar", None
        if op == "Idx":
            e, s = _index_int(ctx, t.args[0])
            return self.bind(e, s, "ix")[0], s, None
        if op in ("Add", "Sub", "Mul", "Max2", "Min2", "BitAnd", "BitOr", "BitXor", "FloorDiv", "Mod",
                  "Shl", "Shr"):
            (a, sa, ba), (b, sb, bb) = self.emit_int(t.args[0]), self.emit_int(t.args[1])
            s = self.join(sa, sb)
            a, b = self._bcast(a, sa, s), self._bcast(b, sb, s)
            bad = _or(ba, bb)
            if op in ("Add", "Sub", "Mul", "BitAnd", "BitOr", "BitXor"):
                sym = {"Add": "+", "Sub": "-", "Mul": "*", "BitAnd": "&", "BitOr": "|", "BitXor": "^"}[op]
                return self.bind(f"{a} {sym} {b}", s, "n")[0], s, bad
            if op in ("Max2", "Min2"):
                fn = "tl.maximum" if op == "Max2" else "tl.minimum"
                return self.bind(f"{fn}({a}, {b})", s, "n")[0], s, bad
            lit = _literal(t.args[1])
            if op in ("FloorDiv", "Mod") and lit is not None and lit > 0 and lit & (lit - 1) == 0:
                # a power of two: an arithmetic shift and a mask round toward -inf exactly
                e = f"{a} >> {lit.bit_length() - 1}" if op == "FloorDiv" else f"{a} & {lit - 1}"
                return self.bind(e, s, "n")[0], s, bad
            if op in ("FloorDiv", "Mod"):
                if lit is None or lit == 0:
                    zero = self._once(f"{b} == 0", s, "z")
                    bad = _or(bad, zero)
                    b = self._once(f"tl.where({zero}, 1, {b})", s, "n")
                # Triton's // truncates toward zero (C); floor semantics by a correction
                self.comment(f"{pretty(t)}: exact int64, rounding toward -inf (Python/torch semantics)")
                q = self.bind(f"{a} // {b}", s, "n")[0]
                r = self.bind(f"{a} - {q} * {b}", s, "n")[0]
                fix = f"{r} < 0" if lit is not None and lit > 0 else f"({r} != 0) & (({r} < 0) != ({b} < 0))"
                fix = self.bind(fix, s, "z")[0]
                if op == "FloorDiv":
                    return self.bind(f"tl.where({fix}, {q} - 1, {q})", s, "n")[0], s, bad
                return self.bind(f"tl.where({fix}, {r} + {b}, {r})", s, "n")[0], s, bad
            # shifts: the count must be in 0..63 (else undefined in int64: NaN)
            if lit is None:
                okc = self._once(f"({b} >= 0) & ({b} < 64)", s, "z")
                bad = _or(bad, f"~{okc}")
                b = self._once(f"tl.where({okc}, {b}, 0)", s, "n")
            if _literal(t.args[0]) is not None:   # a literal shifted by a tensor: make it int64
                a = f"tl.full([], {a}, tl.int64)"
            sym = "<<" if op == "Shl" else ">>"
            return self.bind(f"{a} {sym} {b}", s, "n")[0], s, bad
        if op in ("Neg", "Abs", "BitNot"):
            a, sa, ba = self.emit_int(t.args[0])
            e = {"Neg": f"-{a}", "Abs": f"tl.abs({a})", "BitNot": f"~{a}"}[op]
            return self.bind(e, sa, "n")[0], sa, ba
        if op == "Where":
            c, sc = self.emit(t.args[0])
            (a, sa, ba), (b, sb, bb) = self.emit_int(t.args[1]), self.emit_int(t.args[2])
            s = self.join(self.join(sc, sa), sb)
            args = ", ".join(self._bcast(e, se, s) for e, se in ((c, sc), (a, sa), (b, sb)))
            cb = self._bcast(c, sc, s)
            bad = _or(f"tl.where({cb}, {ba}, False)" if ba else None, f"tl.where({cb}, False, {bb})" if bb else None)
            return self.bind(f"tl.where({args})", s, "n")[0], s, bad
        # a float value that is integer by construction (a size, a boolean, a rounded value)
        f, sf = self.emit(t)
        if op in ("Size", "Cnt") or op in BOOLEAN:
            return self.bind(f"({f}).to(tl.int64)", sf, "n")[0], sf, None
        ok = self.bind(f"({f} >= -9.223372036854776e18) & ({f} < 9.223372036854776e18)", sf, "z")[0]
        return self.bind(f"tl.where({ok}, {f}, 0.0).to(tl.int64)", sf, "n")[0], sf, f"~{ok}"

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
        if (t.op == "Sum" and body in self._zero) or (t.op == "RMax" and body in self._ninf):
            return self.bind(self._red_call(t.op, body), "row", "r")   # masked off already
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

# function -> its name in the language (acefuse.lang), which also folds it on literals
_FUNCS = {"Erf": "erf", "Sigmoid": "sigmoid", "Softplus": "softplus", "Log1p": "log1p", "Expm1": "expm1",
          "Floor": "floor", "Ceil": "ceil", "Round": "round", "Cast": "cast"}


def _or(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return f"({a}) | ({b})"


def pow_expr(a: str, p) -> str:
    """Triton expression of ``a ** p`` for a constant exponent ``p`` (every kernel family's
    Pow), with torch's values: a product of ``a`` with itself for a positive integer power up
    to 4; 1 for ``p = 0``; for any other integer ``p``, ``exp(p * log|a|)`` with the sign of
    ``a`` for an odd one (a negative base has a finite power); else ``exp(p * log(a))`` (NaN
    for a negative base, as torch)."""
    p = float(p)
    if p.is_integer() and 0 < p <= 4:
        return " * ".join([a] * int(p))
    if p == 0:
        return f"tl.where({a} != 0.0, 1.0, 1.0)"   # 1 of a's shape, for NaN and inf too
    if p.is_integer():
        m = f"tl.exp({p!r} * tl.log(tl.abs({a})))"
        return f"tl.where({a} < 0, -{m}, {m})" if int(p) % 2 else m
    return f"tl.exp({p!r} * tl.log({a}))"


def _conjuncts(t: Term) -> list:
    """The conditions of a conjunction ``c1 & c2 & ...`` (one element for any other condition)."""
    if t.op == "LAnd":
        return _conjuncts(t.args[0]) + _conjuncts(t.args[1])
    return [t]


def _literal_value(t: Term):
    """The value of a float literal, else None."""
    return float(t.args[0]) if t.op == "Num" and not isinstance(t.args[0], Term) else None


def _literal_pos(t: Term) -> bool:
    """``t`` is a literal constant with 0 < t < inf."""
    v = _literal_value(t)
    return v is not None and 0 < v < float("inf")


def _literal(t: Term):
    return int(t.args[0]) if t.op == "Num" and not isinstance(t.args[0], Term) else None


def _index_int(ctx, axis):
    """The index along ``axis`` as int64 (the family's ``index_int`` when it has one, else its
    float index expression with the conversion to float32 replaced)."""
    f = getattr(ctx, "index_int", None)
    if f is not None:
        return f(axis)
    e, s = ctx.index(axis)
    if e.endswith(".to(tl.float32)"):
        return e[:-len(".to(tl.float32)")] + ".to(tl.int64)", s
    if e.startswith("(") and e.endswith(" * 1.0)"):
        return f"({e[1:-len(' * 1.0)')]}).to(tl.int64)", s
    return f"({e}).to(tl.int64)", s


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


def _row_only(t: Term, is_ext=None) -> bool:
    """A per-row value built only from reductions (states, tile reductions) and constants,
    with at least one max or min (``is_ext(q)``: state q is one, or is built from one) or
    log among them: the shift of a masked row (``m``, ``m + log(l)``, ``log(l)``), not a
    mean or a sum."""
    found = [False]

    def walk(u):
        if u.op in _ROW_LEAVES:
            if u.op in ("RMax", "RMin") or (u.op == "St" and (is_ext is None or is_ext(u.args[0]))):
                found[0] = True
            return True
        if u.op in ("Num", "Cnt", "Size"):
            return True
        if u.op in ("Elm", "Par", "In", "Idx", "Take"):
            return False
        if u.op == "Log":
            found[0] = True   # the log of a sum that is 0 (a masked row's sum of exponentials)
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
        if getattr(ctx, "fold_tile_mask", False) and _literal_value(t.args[2]) == float("-inf"):
            x = t.args[1]
            while x.op == "Elm":
                x = ctx.leaf(x.args[0])
            if not (x.op == "Mul" and _literal_pos(x.args[1])):
                # a masked tile: the select the max read is reused, scaled after it (where(c, y,
                # -inf) * log2(e) is where(c, y * log2(e), -inf) exactly), not selected again
                return Term("Mul", (t, Term("Num", (LOG2E,))))
        return Term(op, (t.args[0], _scale_log2e(t.args[1], ctx), _scale_log2e(t.args[2], ctx)))
    if op == "Elm":
        leaf = ctx.leaf(t.args[0])
        if getattr(ctx, "fold_exp2", False) and not _folds_log2e(leaf):
            # a leaf that is a sum with a term no constant absorbs (a score plus a bias, ALiBi's
            # slope * (j - i)): the leaf as the max read it (bound once), times log2(e) once, not
            # each term scaled and the sum formed again
            return Term("Mul", (t, Term("Num", (LOG2E,))))
        return _scale_log2e(leaf, ctx)
    return Term("Mul", (t, Term("Num", (LOG2E,))))


def _folds_log2e(t: Term) -> bool:
    """``t * log2(e)`` pushed through it costs no operation: not a sum or difference, or one of
    constants and constant multiples only (each absorbs log2(e) into its constant)."""
    if t.op in ("Add", "Sub"):
        return all(_folds_log2e(a) for a in t.args) and all(
            a.op == "Num" or (a.op == "Mul" and (a.args[0].op == "Num" or a.args[1].op == "Num"))
            or a.op in ("Add", "Sub", "Neg") for a in t.args)
    if t.op == "Neg":
        return _folds_log2e(t.args[0])
    return True


def _is_atom(e: str) -> bool:
    return e.replace("_", "").isalnum() or e.replace(".", "").replace("-", "").replace("e", "").isdigit()
