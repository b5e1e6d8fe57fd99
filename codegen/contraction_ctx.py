"""Terms to Triton expressions in the contraction family (codegen/contraction.py): the
shapes of values in a query-tile x key-tile kernel and the lowering of loads, lookups
(``af.take``), contractions (``tl.dot``) and key reductions of ``p * v`` (``tl.dot(p, v)``).

Shapes: ``scalar``; ``row`` ([BLOCK_I], per query row); ``col`` ([1, BLOCK_J], per key);
``tile`` ([BLOCK_I, BLOCK_J]); ``rvec`` ([BLOCK_I, BLOCK_E], per row and value index);
``jvec`` ([BLOCK_J, BLOCK_E], per key and value index: ``v``).
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term, pretty
from acefuse.codegen.emit import CodegenError
from acefuse.codegen.row import Context


def _flat_mul(t: Term):
    if t.op == "Mul":
        return _flat_mul(t.args[0]) + _flat_mul(t.args[1])
    return [t]


class CContext(Context):
    """Context for the contraction family: adds E vectors, key-side vectors, dots."""

    fold_exp2 = True
    # Triton's max drops NaN: a NaN score still reaches every output through the sums of
    # exp(s - m); the max-free NaN check would cost a reduction per key tile
    nan_extrema = False

    def __init__(self, gen, mode, full=False):
        super().__init__(gen, mode)
        self.full = full
        # a tile inside the keys (a fully visible one, or a masked one before the last partial tile
        # where the generator says so: ContractionGen.tile_inb) reads without a bounds mask and
        # applies the program's mask alone (no ``tmask``: rows past the end are never stored, and
        # each row's states are its own)
        self.inb = full or bool(getattr(gen, "tile_inb", False))
        self.tile_mask = None if self.inb else "tmask"
        # a masked tile joins the tile mask into a where(c, x, -inf)'s condition once, so that
        # the max and the exp2 (whose 0 the sums need) of it select nothing more (emit.py)
        self.fold_tile_mask = not full

    def join(self, a, b):
        return _cjoin(a, b)

    def canon(self, t: Term) -> Term:
        """A positive constant factor of a key max moves out of it: ``max_B(s * c)`` is
        ``max_B(s) * c`` for c > 0, exactly in float too (rounding ``x * c`` is monotone in x),
        and through ``where(cond, s * c, -inf)``. The score tile is then multiplied once, by
        ``c * log2(e)`` inside the exp2 (emit.py folds log2(e) into the constant), and the max
        runs on the raw dot product (the tutorial's ``m_ij = max(m_i, max(qk) * qk_scale)``)."""
        t = super().canon(t)
        if t.op == "RMax" and t.args[0].op == "BB":
            body, c = self._pos_scaled(t.args[1])
            if c is not None:
                return Term("Mul", (Term("RMax", (t.args[0], body)), Term("Num", (c,))))
        return t

    def _pos_scaled(self, u: Term):
        """(x, c) with ``u = x * c`` for a constant c > 0 (through leaves and a where whose
        other branch is -inf), else (None, None)."""
        if u.op == "Elm":
            return self._pos_scaled(self.leaf(u.args[0]))
        pos = lambda x: _const(x) is not None and 0 < _const(x) < float("inf")  # noqa: E731
        if u.op == "Mul":
            a, b = u.args
            if pos(b) and not pos(a):
                return a, _const(b)
            if pos(a) and not pos(b):
                return b, _const(a)
        if u.op == "Where":
            cond, x, y = u.args
            if _const(y) == float("-inf"):
                body, c = self._pos_scaled(x)
                return (Term("Where", (cond, body, y)), c) if c is not None else (None, None)
            if _const(x) == float("-inf"):
                body, c = self._pos_scaled(y)
                return (Term("Where", (cond, x, body)), c) if c is not None else (None, None)
        return None, None

    def tanh(self, t: Term, em):
        """``tanh(x)`` as ``_tanh_mm`` (contraction.TANH_MM, in the generated module): on a GPU, in
        a kernel whose matmuls take 16-bit operands (``DOT_T``), the hardware's ``tanh.approx.f32``;
        in the interpreter and for float32 operands the accurate ``_tanh``. A quotient by a
        nonzero constant (a soft cap's ``tanh(s / c)``), and a constant factor of its dividend (the
        score's scale), are passed as constants: the hardware form multiplies once by ``k / c``,
        the accurate one computes ``(s * k) / c`` as written (``tl.div_rn``, as torch)."""
        if not getattr(self.g, "tanh_mm", False):   # (a generator whose module has no _tanh_mm)
            a, sa = em.emit(t.args[0])
            return em.bind(f"_tanh({a})", sa)
        x = t.args[0]
        while x.op == "Elm":
            x = self.leaf(x.args[0])
        c = _const(x.args[1]) if x.op == "Div" else None
        fin = lambda u: u is not None and 0.0 < abs(u) < float("inf")  # noqa: E731
        if not (fin(c) and fin(1.0 / c)):
            a, sa = em.emit(t.args[0])
            return em.bind(f"_tanh_mm({a}, 1.0, 1.0, 1.0, DOT_T)", sa)
        y, k = x.args[0], 1.0
        while y.op == "Elm":
            y = self.leaf(y.args[0])
        if y.op == "Mul" and fin(_const(y.args[1])) and fin(_const(y.args[1]) / c):
            y, k = y.args[0], _const(y.args[1])
        elif y.op == "Mul" and fin(_const(y.args[0])) and fin(_const(y.args[0]) / c):
            y, k = y.args[1], _const(y.args[0])
        else:
            y = x.args[0]
        a, sa = em.emit(y)
        return em.bind(f"_tanh_mm({a}, {k!r}, {c!r}, {k / c!r}, DOT_T)", sa)

    def row_quotient(self, t: Term, a, b, sb, s, em):
        """The finalize's quotient by a per-row value (``o = s / l``, an ``rvec`` over the value
        axis) on its way to a float16/bfloat16 output: R's ``_qdiv`` of the row family (the row's
        reciprocal factors, once per row; within 1.5 ulp of float32, far below the output's
        rounding), else None (``_div0``, correctly rounded). Only in a module that defines the
        family's helpers (``tanh_mm`` set: ContractionGen's and, since session 15, GluonGen's)."""
        if not getattr(self.g, "tanh_mm", False):
            return super().row_quotient(t, a, b, sb, s, em) if s == "tile" else None
        return super().row_quotient(t, a, b, sb, s, em, shape="rvec")

    def state_var(self, q, blk, pol=None):
        e, sh = super().state_var(q, blk, pol)
        if sh == "row" and self.g.ops.get(q) != "ref" and self.g.vec_state(q):
            return e, "rvec"
        return e, sh

    def index(self, axis):
        g = self.g
        if axis == g.axis:
            return "cols[None, :].to(tl.float32)", "col"
        if axis in g.R:
            return f"idx_{axis}.to(tl.float32)", "row"
        if axis in g.G:
            return f"(idx_{axis} * 1.0)", "scalar"
        raise CodegenError(f"index({axis!r}) is not available in the contraction kernel family")

    def load(self, name, em, raw=False):
        g = self.g
        axes = g.tensors[name]
        has_r = any(a in g.R for a in axes)
        has_j = g.axis in axes
        has_e = any(a in g.E for a in axes)
        if any(a in g.C for a in axes):
            raise CodegenError(f"tensor {name!r} has a contraction axis; it can only be used inside "
                               f"the contraction sum(..., {g.C[0]!r})")
        ptr = f"{name}_ptr + off_{name}_g"
        masks = []
        if has_r and has_j and has_e:
            raise CodegenError(f"tensor {name!r}: a tensor over rows, keys and {g.E} is not supported")
        if has_r:
            ptr += f" + off_{name}_r" + ("[:, None]" if (has_j or has_e) else "")
            masks.append("rmask" + ("[:, None]" if (has_j or has_e) else ""))
        if has_j:
            if has_e:
                ptr += f" + cols[:, None] * s_{name}_{g.axis} + ecols[None, :] * s_{name}_{g.E[0]}"
                masks.append("emask[None, :]" if self.inb else "(cols[:, None] < n_j) & emask[None, :]")
                shape = "jvec"
            else:
                ptr += f" + cols[None, :] * s_{name}_{g.axis}"
                if not self.inb:
                    masks.append("(cols[None, :] < n_j)")
                shape = "tile" if has_r else "col"
        elif has_e:
            ptr += (f" + ecols[None, :] * s_{name}_{g.E[0]}")
            masks.append("emask[None, :]")
            shape = "rvec"
        else:
            shape = "row" if has_r else "scalar"
        m = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
        cast = "" if raw else ".to(tl.float32)"
        hint = "kv_" if has_j else "ld_"
        if not has_j and self.g.hoisting is not None:
            return self.g.hoist(f"tl.load({ptr}{m}){cast}", shape)
        return em.bind(f"tl.load({ptr}{m}){cast}", shape, hint)

    def take(self, t: Term, em, as_int=False):
        """A lookup ``af.take(x, idx, a)``: ``x`` read with its axis ``a`` replaced by the value of
        ``idx`` (an index expression, or integer tensors and lookups of them: a page table). An
        index outside ``0 .. len(a) - 1`` reads NaN (a comparison with it is false)."""
        g = self.g
        name, idx, ax = t.args
        rest = [a for a in g.tensors[name] if a != ax]
        bad_ax = [a for a in rest if a not in g.G + g.R and a != g.axis]
        if bad_ax:
            raise CodegenError(f"af.take({name}, `{pretty(idx)}`, {ax!r}): {name!r} also ranges over {bad_ax}; "
                               "a lookup here reads one value per query and key (its other axes must be "
                               "batch/head, query or key axes); a contraction or value operand may be gathered "
                               "only as a whole key row (af.take(k, pos_j, ...) inside sum(q * ..., 'd'))")
        ie, si, ok = g.int_index(idx, em)
        has_r, has_j = any(a in g.R for a in rest), g.axis in rest
        sh = _cjoin(si, "tile" if has_r and has_j else "row" if has_r else "col" if has_j else "scalar")
        ptr = f"{name}_ptr + off_{name}_g"
        if has_r:
            ptr += f" + {em._bcast(f'off_{name}_r', 'row', sh)}"
        if has_j:
            ptr += f" + cols[None, :] * s_{name}_{g.axis}"
        inr = f"({ie} >= 0) & ({ie} < len_{ax})"
        ok = em.bind(f"{inr} & {ok}" if ok else inr, si, "c")[0]
        ptr += f" + {em._bcast(f'tl.where({ok}, {ie}, 0)', si, sh)} * s_{name}_{ax}"
        m = ", mask=cols[None, :] < n_j, other=0" if has_j and not self.inb else ""
        if as_int:
            return em.bind(f"tl.load({ptr}{m}).to(tl.int64)", sh, "tk_")[0], sh, ok
        v = em.bind(f"tl.load({ptr}{m}).to(tl.float32)", sh, "tk_")[0]
        return em.bind(f"tl.where({em._bcast(ok, si, sh)}, {v}, float('nan'))", sh, "tk_")

    def contract(self, t: Term, em):
        g = self.g
        ax = t.args[0].args[0]
        if ax not in g.C:
            raise CodegenError(f"`{pretty(t)}`: a reduction over {ax!r} inside the body is not a "
                               "contraction this family lowers")
        if t.op != "Sum":
            raise CodegenError(f"`{pretty(t)}`: only sums are lowered as contractions (tl.dot)")
        fs = _flat_mul(t.args[1])
        with_ax = [f for f in fs if ax in g.axes_of(f)]
        rest = [f for f in fs if ax not in g.axes_of(f)]
        key = lambda f: f.op == "Take" or g.axis in g.tensors[f.args[0]]   # noqa: E731
        if len(with_ax) != 2 or not all(f.op in ("In", "Take") for f in with_ax) or sum(map(key, with_ax)) != 1:
            raise CodegenError(f"`{pretty(t)}`: a contraction over {ax!r} must be a product of a query-side "
                               f"input tensor (over rows and {ax!r}) and a key-side one (over {g.axis!r} and "
                               f"{ax!r}, or gathered along keys with af.take), e.g. sum(q * k, {ax!r})")
        a, b = with_ax if key(with_ax[1]) else with_ax[::-1]
        qa = g.tensors[a.args[0]]
        if a.op != "In" or not any(x in g.R for x in qa):
            raise CodegenError(f"`{pretty(t)}`: the query-side operand of a contraction over {ax!r} must be an "
                               "input tensor over the query rows")
        qn = a.args[0]
        if g.hopper and len(g.R) == 1 and set(qa) - {g.R[0], ax} <= set(g.G):
            # one query axis: the query tile is a box of the (rows, ax) matrix of this program
            desc = g.descriptor(qn, g.R[0], ax, "BLOCK_I", "BLOCK_D")
            q = g.hoist(f"{desc}.load([pid_r * BLOCK_I, 0])", "qtile")[0]
        else:
            q = g.hoist(f"tl.load({qn}_ptr + off_{qn}_g + off_{qn}_r[:, None] + dcols[None, :] * s_{qn}_{ax}, "
                        f"mask=rmask[:, None] & dmask_{ax}[None, :], other=0.0)", "qtile")[0]
        k = self.key_rows(b, ax, em)
        out, sh = em.bind(f"tl.dot({q}.to(DOT_T), tl.trans({k}.to(DOT_T)), input_precision=PREC)", "tile", "dot_")
        for f in rest:
            e, s = em.emit(f)
            out, sh = em.bind(f"{out} * {em._bcast(e, s, 'tile')}", "tile")
        return out, sh

    def key_rows(self, t: Term, inner: str, em):
        """A [BLOCK_J, BLOCK_D|E] tile of a key-side operand over the keys and ``inner`` (a
        contraction or the value axis): an input tensor, or a lookup ``af.take(x, pos, a)``
        whose position depends on the key only (paged KV: ``pos = page[j // P] * P + j % P``);
        a position out of range reads NaN."""
        g = self.g
        cs, ms = ("dcols", f"dmask_{inner}") if inner in g.C else ("ecols", "emask")
        if t.op == "In":
            n = t.args[0]
            if g.hopper and set(g.tensors[n]) - {g.axis, inner} <= set(g.G):
                # Hopper: a TMA copy of the tile; keys past n_j (and columns past the axis'
                # length) read zeros, so no tile is loaded through a mask
                desc = g.descriptor(n, g.axis, inner, "BLOCK_J", "BLOCK_D" if inner in g.C else "BLOCK_E")
                return em.bind(f"{desc}.load([{g.tile_start}, 0])", "ktile", "kt_")[0]
            return em.bind(f"tl.load({n}_ptr + off_{n}_g + cols[:, None] * s_{n}_{g.axis} + {cs}[None, :] * "
                           f"s_{n}_{inner}, mask={self._kmask(ms)}, other=0.0)", "ktile", "kt_")[0]
        n, idx, a = t.args
        rest = [x for x in g.tensors[n] if x != a]
        if any(x not in g.G and x != inner for x in rest) or not g.axes_of(idx) - set(g.G) <= {g.axis}:
            raise CodegenError(f"af.take({n}, `{pretty(idx)}`, {a!r}) as a key-side operand: the gathered tensor "
                               f"may range over {inner!r} and batch/head axes only, and the position over the "
                               f"keys {g.axis!r} only")
        ie, si, ok = g.int_index(idx, em)
        if si != "col":
            ie, si = em.bind(f"{ie} + tl.zeros([1, BLOCK_J], tl.int64)", "col", "n")
        inr = f"({ie} >= 0) & ({ie} < len_{a})" + (f" & {ok}" if ok else "")
        # keys past the end read 0 (their weight is 0; NaN there would leak through the dot)
        okt = em.bind(f"tl.trans({inr}) | (cols[:, None] >= n_j)", "kcol", "c")[0]
        pos = em.bind(f"tl.trans(tl.where({inr}, {ie}, 0))", "kcol", "n")[0]
        x = em.bind(f"tl.load({n}_ptr + off_{n}_g + {pos} * s_{n}_{a} + {cs}[None, :] * s_{n}_{inner}, "
                    f"mask={self._kmask(ms)}, other=0.0)", "ktile", "kt_")[0]
        return em.bind(f"tl.where({okt}, {x}, float('nan'))", "ktile", "kt_")[0]

    def _kmask(self, ms):
        """The mask of a [BLOCK_J, inner] key-side load: the inner axis' columns, and the keys'
        bound unless the tile is inside the keys (``inb``)."""
        return f"{ms}[None, :]" if self.inb else f"(cols[:, None] < n_j) & {ms}[None, :]"

    def accumulate(self, t: Term, em):
        """``x + sum_B(p * v)`` as one ``tl.dot(p, v, acc=x)`` (the matrix unit accumulates)."""
        for i in (1, 0):
            red, other = t.args[i], t.args[1 - i]
            if red.op == "Sum" and red.args[0].op == "BB":
                pv = self.reduce_tile(red, em, acc=other)
                if pv is not None:
                    return pv
        return None

    def _factors(self, u: Term):
        """The factors of a product, looking through leaves that are products (a leaf free of
        states, ``sum_d(q * k) * v``, holds the whole body of a sum without a softmax)."""
        if u.op == "Elm" and self.leaf(u.args[0]).op == "Mul":
            return [f for x in _flat_mul(self.leaf(u.args[0])) for f in self._factors(x)]
        return [u]

    def reduce_tile(self, t: Term, em, acc=None):
        if t.op != "Sum":
            return None
        g = self.g
        fs = [f for u in _flat_mul(t.args[1]) for f in self._factors(u)]
        vec = [f for f in fs if g.elm_shape(f) == "jvec"]
        if not vec:
            return None
        if len(vec) != 1:
            raise CodegenError(f"`{pretty(t)}`: a product of two key-side vectors is not a contraction")
        others = [f for f in fs if f is not vec[0]]
        if any(g.E[0] in g.axes_of(f) for f in others):
            raise CodegenError(f"`{pretty(t)}`: only one factor of a sum over {g.axis!r} may range over the "
                               f"value axis {g.E[0]!r}")
        if others:
            p = others[0]
            for f in others[1:]:
                p = Term("Mul", (p, f))
            pe, ps = em.emit(p)
            if ps != "tile":   # weights the same for every row (a plain key sum): one row of a tile
                pe = f"{em._bcast(pe, ps, 'tile')} + tl.zeros([BLOCK_I, BLOCK_J], tl.float32)"
        else:
            pe = "tl.full([BLOCK_I, BLOCK_J], 1.0, tl.float32)"
        if self.tile_mask and not em.masked_off(pe, "0"):
            pe, _ = em.bind(f"tl.where({self.tile_mask}, {pe}, 0.0)", "tile", "p")
        accs = ""
        if acc is not None:
            a, sa = em.emit(acc)
            if sa != "rvec":
                return None
            accs = f", acc={a}"
        f = vec[0]
        if f.op == "Elm" and self.leaf(f.args[0]).op in ("In", "Take"):
            f = self.leaf(f.args[0])
        v = self.key_rows(f, g.E[0], em) if f.op in ("In", "Take") else em.emit(f)[0]
        return em.bind(f"tl.dot({pe}.to(DOT_T), {v}.to(DOT_T){accs}, input_precision=PREC)", "rvec", "pv")


def _const(t: Term):
    """The value of a literal constant, else None."""
    return float(t.args[0]) if t.op == "Num" and not isinstance(t.args[0], Term) else None


def _cjoin(a, b):
    if a == b:
        return a
    s = {a, b}
    if "scalar" in s:
        return (s - {"scalar"}).pop()
    if s == {"row", "col"} or s == {"row", "tile"} or s == {"col", "tile"}:
        return "tile"
    if s == {"row", "rvec"}:
        return "rvec"
    raise CodegenError(f"cannot combine a {a} value with a {b} value elementwise in the contraction family")
