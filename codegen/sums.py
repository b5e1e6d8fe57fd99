"""The sum kernel of the contraction family: one pass whose states are all plain sums over
the loop axis, with contractions inside (the stages of a derived backward: dQ over keys,
dK/dV over queries). Split out of contraction.py, whose interval arithmetic, mask
analysis and context it shares."""
from __future__ import annotations

import math
import re

from acefuse.rewrite.terms import Term, pretty, is_integer, INT_OPS, BOOLEAN
from acefuse.codegen.emit import CodegenError, _scale_log2e, pow_expr
from acefuse.codegen.row import HEADER
from acefuse.codegen.contraction import ContractionGen, _flat_mul, row_indices
from acefuse.codegen.masks import _interval_leaf, _pos_const
from acefuse.rewrite.dag import nodes
from acefuse.codegen.sums_loops import two_loop_axes, compile_two_loops, double_sum_axis  # noqa: F401 (re-exported)

LOAD_HELPER = """@triton.jit
def _ld(ptr, mask, MASKED: tl.constexpr):
    # a load masked only where the block may pass the tensor's end (MASKED, a constexpr the
    # launcher sets: a vector axis shorter than its block); unmasked loads vectorize
    if MASKED:
        return tl.load(ptr, mask=mask, other=0.0)
    else:
        return tl.load(ptr)"""

# special functions and roundings (SumGen._function; emit.py's _FUNCS)
_FUNCS = ("Erf", "Sigmoid", "Softplus", "Log1p", "Expm1", "Floor", "Ceil", "Round", "Cast")
BOOL_OPS = ("CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe", "LAnd", "LOr", "LNot")


class SumGen:
    """A one-pass kernel whose states are all plain sums over the loop axis ``F``
    (``s_AB = s_A + sum_B(e)``: the stages of a derived backward, e.g. dQ = sum_j(dS * k)
    with F = j, or dK = sum_i(dS * q), dV = sum_i(P * dO) with F = i).

    Axes, classified, not named: ``F`` the loop axis (tiles of BLOCK_J); grid axes ``G``
    (every tensor over F that carries a contracted axis has them: batch, heads; a lookup over F,
    ``kc[n = slot(b, j)]``, counts as a tensor over its own and its index's axes): one program each; row axes ``R`` (output
    axes no F-tensor has): flattened into tiles of BLOCK_I; vector axes: any other axis a
    tensor or output carries (head dims), one per value, a [BLOCK, BLOCK_<axis>] tile.
    Values are scalars, rows [I], loop columns [J], tiles [I, J], row vectors [I, a] or
    loop vectors [J, a]. Inside the body a sum over a vector axis is a contraction:
    ``tl.dot`` of a row vector and a loop vector (-> tile), else ``tl.sum`` over the axis.
    A state ``sum_F(t * w)`` with ``w`` a loop vector is ``acc = tl.dot(t, w, acc)``; a
    state ``sum_F(t)`` is ``acc += tl.sum(t, axis=1)``.

    Two loop axes: when every state is a sum over ``F`` and one other axis ``A`` that no output
    has, nested either way (``sum_i(sum_r(x))``: grouped-query attention's dK/dV, the group
    members ``r`` sharing one key/value head), and every tensor over ``F`` carries ``A`` (else
    ``A`` is a vector axis, contracted per tile), each program loops over every value of ``A``
    and, inside, over the tiles of ``F``, adding into the same accumulators (two_loop_axes;
    ``F`` is the tiled one unless the mask analysis's conditions read ``A`` only). Tensors over
    ``A`` are offset by ``idx_A * stride`` (``off_<t>_ga``), ``index(A)`` is the loop variable,
    values that change with ``A`` only are computed once per value of it, above the tiles
    (``hoisted_a``); the loop range and the mask analysis are set once for every ``A``.

    Mask analysis: ``where(cond, a, b)`` conditions built from indices are evaluated with
    interval arithmetic over each loop tile's index box; when every state's body is 0 where
    all of them are false (checked symbolically: ``where(c, a, 0)``, ``exp(-inf) = 0``,
    ``0 * finite``), the loop runs only over the tiles between the first and the last tile
    the mask does not exclude entirely.

    Rules of the generated code (each applies to any sum kernel; tests/test_sums_codegen.py):
    - a load stays in its storage type; a dot reads it converted straight to DOT_T, elementwise
      math widens it to float32 once (``widen``); accumulators are float32;
    - a value that does not range over the loop axis is computed once, above the loop (``bind``);
    - ``exp(x)`` is ``exp2(x * log2 e)`` with log2(e) folded into x's constants;
    - a state's constant factor is applied once, at the store (``_const_factor``);
    - full loop tiles run without the loop-axis mask (a vector axis is masked only when it is
      shorter than its block: ``VMASK_<axis>``); the run of full tiles where every mask condition
      holds everywhere runs without those where()s; the partial last tile runs masked;
    - the launch configuration is timed on a GPU among the candidates an estimate keeps
      (codegen/sums_launch.py).
    """

    def __init__(self, fusion, riders=None):
        self.f = fusion
        enc = fusion.encoding
        self.enc = enc
        self.F = enc.axis
        self.name = fusion.program.name
        self.tensors = dict(enc.tensors)
        if len(fusion.passes) != 1:
            raise CodegenError(f"program {self.name!r}: {len(fusion.passes)} passes; sum kernels are one pass")
        p = fusion.passes[0]
        self.p = p
        self.states = {}
        for s in p.states:
            src = s.source
            if s.op != "sum" or src.op != "Sum":
                raise CodegenError(f"program {self.name!r}: state {s.name} is not a plain sum over {self.F!r}")
            self.states[s.name] = src
        # scatter outputs (codegen/sums_scatter.py): a lookup table's gradient, added per tile
        from acefuse.codegen.sums_scatter import find_scatters
        self.scatters = find_scatters(self.name, self.F, self.states, enc)
        # row scatters (sums_scatter.py): state outputs added row by row into a table's entries
        self.row_scatters = {o: v for o, v in getattr(fusion.program, "row_scatters", {}).items()
                             if o in enc.outputs}
        for sc in self.scatters.values():
            del self.states[sc.state]
        # two loop axes (class docstring): every state a double sum over F and one other axis
        two = two_loop_axes(self.states, self.F, enc.tensors.values(), enc.output_axes.values())
        self.F2 = None
        if two:
            self.F, self.F2, self.states = two
        for q, src in self.states.items():
            if not two and src.args[0].args[0] != self.F:
                raise CodegenError(f"program {self.name!r}: state {q} is not a plain sum over {self.F!r} (nor, "
                                   f"with every other state, a sum over {self.F!r} and one more axis that no "
                                   "output has)")
        if not two:
            self.states = {q: src.args[1] for q, src in self.states.items()}
        self.outs = {}
        self.tiles = {}    # outputs elementwise over (rows, loop axis): stored from each loop tile
        self.out_axes = dict(enc.output_axes)
        self.finals = {}   # outputs computed after the loop from several states and per-row values
        self._final = None   # while emitting them: the lines they are computed in
        self._oscale = {}   # output -> the constant factor it multiplies its state by (``s_J * 0.25``)
        for o, t in enc.outputs.items():
            if o in self.scatters:
                continue
            so = _state_output(t)
            if so and so[0] in self.states:
                self.outs[o] = so[0]
                if so[1] != 1.0:
                    self._oscale[o] = so[1]
            elif _final_output(t, self.F, self.tensors) and all(u.args[0] in self.states for u in t.walk()
                                                                if u.op == "St"):
                self.finals[o] = t
            elif _tile_output(t, self.F, self.out_axes[o]):
                self.tiles[o] = t
            else:
                raise CodegenError(f"program {self.name!r}: output {o!r} = {pretty(t)} is neither a state nor "
                                   f"elementwise over the loop axis {self.F!r}")
        F = self.F
        # lookups (af.take: ``doc[n=index(i)]``, ``rel[r=index(j) - index(i) + ...]``): the gathered
        # axis of a tensor read only through lookups is no axis of the kernel (its length is passed
        # for the range check); the lookups' index tensors are integers (INDEX_TENSORS)
        bodies = (list(self.states.values()) + [t for o, t in enc.outputs.items() if o not in self.outs
                                                 and o not in self.scatters]
                  + [u for sc in self.scatters.values() for u in (sc.index, sc.body)]
                  + [g for _, g, _ in self.row_scatters.values()])
        cls_axes = {o: ax for o, ax in self.out_axes.items() if o not in self.scatters}   # (a scatter's
        # output is over grid axes and its table axis: it takes no part in choosing the rows)
        takes = [u for b in bodies for u in b.walk() if u.op == "Take"]
        order0 = list(fusion.program.axes)
        direct = {u.args[0] for b in bodies for u in b.walk() if u.op == "In"}
        self.Lk = [a for a in fusion.program.axes if a in {u.args[2] for u in takes}
                   and not any(a in self.tensors[n] for n in direct) and not any(a in ax for ax in cls_axes.values())]
        self.Lk += [sc.axis for sc in self.scatters.values() if sc.axis not in self.Lk]
        self.index_tensors = sorted({u.args[0] for t in takes for u in t.args[1].walk() if u.op in ("In", "Take")}
                                    | {u.args[0] for sc in self.scatters.values() for u in sc.index.walk()
                                       if u.op == "In"}
                                    | {u.args[0] for _, g, _ in self.row_scatters.values() for u in g.walk()
                                       if u.op in ("In", "Take")})
        # a lookup over the loop axis reads like a tensor over its own axes and its index's
        # (paged keys ``kc[n = slot(b, j)]`` over (h, d, b, j): h is a grid axis, d a vector axis)
        ft = [ax for ax in self.tensors.values() if F in ax] + [
            tuple(a for a in order0 if a in self._axes(u)) for u in takes if F in self._axes(u)]
        if not ft:
            raise CodegenError(f"program {self.name!r}: no tensor ranges over the loop axis {F!r}")
        # grid axes: those the loop-axis tensors carrying a contracted axis all have, when there are
        # any (a key padding mask over (b, j) broadcasts over the heads: h stays a grid axis)
        vec = set() if two else {u.args[0].args[0] for b in self.states.values() for u in b.walk()
                                 if u.op == "Sum" and u.args[0].op == "Ax" and u.args[0].args[0] != F}
        vft = [ax for ax in ft if set(ax) & vec] or ft
        common = set(vft[0]).intersection(*[set(a) for a in vft[1:]]) - {F}
        order = fusion.program.axes
        out_ax = [a for ax in cls_axes.values() for a in ax if a != F]
        allax = {a for ax in list(self.tensors.values()) + list(cls_axes.values()) for a in ax} - set(self.Lk)
        self.R = [a for a in order if a in out_ax and not any(a in ax for ax in ft)]
        self.G = [a for a in order if a in common and a not in self.R]
        self.V = [a for a in order if a in allax and a != F and a not in self.R and a not in self.G]
        if not self.R:
            self._rows_from_vectors(order, ft, out_ax, allax)
        if self.F2:   # looped over inside each program, not a grid or vector axis
            self.G = [a for a in self.G if a != self.F2]
            self.V = [a for a in self.V if a != self.F2]
        if not self.R:
            raise CodegenError(f"program {self.name!r}: no row axis (every output axis is carried by a "
                               f"tensor over {F!r})")
        if self.scatters:
            from acefuse.codegen.sums_scatter import check_scatters
            check_scatters(self)
        for o, ax in cls_axes.items():
            if any(a not in ax for a in self.G):   # programs of the grid would write the same elements
                raise CodegenError(f"program {self.name!r}: output {o!r} (axes {' '.join(ax)}) does not range "
                                   f"over the grid axes {self.G} (a sum over them needs a second stage)")
            if [a for a in ax if a in self.R] != self.R:
                raise CodegenError(f"program {self.name!r}: output {o!r} does not range over every row axis {self.R}")
            if len([a for a in ax if a in self.V]) > 1:
                raise CodegenError(f"program {self.name!r}: output {o!r} has more than one vector axis")
            if o in self.tiles and self.F2:
                raise CodegenError(f"program {self.name!r}: output {o!r} is elementwise over the loop axis {F!r}, "
                                   f"and the states also loop over {self.F2!r} (not supported together)")
            if o in self.tiles and any(a in self.V for a in ax):
                raise CodegenError(f"program {self.name!r}: output {o!r} ranges over the loop axis {F!r} and a "
                                   "vector axis (a tile output is over rows and the loop axis only)")
        if self.row_scatters:   # (after the checks above, which read the state's own axes)
            from acefuse.codegen.sums_scatter import setup_row_scatters
            setup_row_scatters(self)
        # riders (codegen/riders.py): {output of another stage: (the body of its sum over this
        # kernel's row axis, the output's axes)}, added per tile into float32 buffers (RIDE)
        self.riders = dict(riders or {})
        if self.riders:
            from acefuse.codegen.riders import check_sum_riders
            check_sum_riders(self)
        self.rdots: list = []     # per tile: the vector axis of each rider's tl.dot ('' for a row sum)
        self.rtma = getattr(self, "rtma", [])   # riders added by a TMA reduce where the launcher says (RTMA)
        self.hoisted: list = []
        self.hoisted_a: list = []   # ... over the second loop axis: inside its loop, above the tiles'
        self._hoist: dict = {}
        # names whose value changes with the second loop axis (its index, the offsets of the
        # tensors over it, and the values computed from them)
        self._adep = ({f"idx_{self.F2}"} | {self.goff(t, ax) for t, ax in list(self.tensors.items())
                                            + [(o, ax) for o, (_, ax) in self.riders.items()] if self.F2 in ax}
                      if self.F2 else set())
        self.lines: list = []
        self.n = 0
        self.full = False      # emitting the body of a full loop tile (no loop-axis mask)
        self.alltrue = False   # ... of a tile where every mask condition is true
        self._conds: list = []
        self._scale: dict = {}   # state -> the constant factor of its body, applied at the store
        self._memo: dict = {}
        self._raw: dict = {}   # tensor -> its load, in the tensor's storage type
        self._wide: dict = {}  # raw load -> the same value as float32
        # what the launcher's resource estimate counts (filled while emitting the full-tile body)
        self.held: dict = {}      # loop-invariant dot operand -> its vector axis (a [rows, axis] block)
        self.loopvec: dict = {}   # tensor loaded per loop tile over a vector axis -> that axis
        self.dots: list = []      # per tile: the inner or outer vector axis of each tl.dot

    def _rows_from_vectors(self, order, ft, out_ax, allax):
        """Axes when a tensor over the loop axis also ranges over the rows (an attention bias
        or mask over query and key positions, read as a [rows, loop] tile): the vector axes are
        the axes contracted inside the body (``sum_d(q * k)``); the grid axes are those every
        loop-axis tensor carrying a vector axis has (batch, heads: a mask may broadcast over
        some of them); the row axes are the output axes left, those a backward stage tiles when
        it says (``Stage.seq_axes``: dV = sum_i(P * grad_o) alone keeps e as its vector axis).
        Leaves ``R`` empty when there is no contraction or no tensor carries one."""
        F = self.F
        vec = []
        for body in self.states.values():
            for t in body.walk():
                if t.op == "Sum" and t.args[0].op == "Ax" and t.args[0].args[0] != F:
                    vec.append(t.args[0].args[0])
        vft = [ax for ax in ft if any(a in vec for a in ax)]
        if not vft:
            return
        common = set(vft[0]).intersection(*[set(a) for a in vft[1:]]) - {F} - set(vec)
        G = [a for a in order if a in common]
        R = [a for a in order if a in out_ax and a not in G and a not in vec and a != F]
        seq = getattr(self.f.program, "seq_axes", ())   # (a backward stage's loop/tile axes, if known)
        if seq:   # an axis that a loop-axis tensor carries alone besides the grid axes (grad_o's e in
            R = [a for a in R if a in seq or    # dV = sum_i(P * grad_o)) is its vector axis, unless tiled
                 not any(set(ax) - set(G) - {F} == {a} for ax in ft)]
        if R:
            self.G, self.R = G, R
            self.V = [a for a in order if a in allax and a != F and a not in R and a not in G]

    # -- values: (expression, shape); shape is "s", "r", "f", "rf", ("r", a) or ("f", a) --------------
    def bind(self, expr, shape, hint="t"):
        """Name a value. A value that does not range over the loop axis (its shape has no
        ``f``) is loop-invariant: it is computed once, above the loop (the ``h`` names), and
        one expression gets one name there."""
        if self._final is not None:   # after the loop (an output from several states)
            self.n += 1
            name = f"{hint}{self.n}"
            self._final.append(f"    {name} = {expr}")
            return name, shape
        if not _over_f(shape):
            if expr not in self._hoist:
                name = f"h{len(self._hoist) + 1}"
                if self.F2 and set(re.findall(r"\b\w+\b", expr)) & self._adep:
                    # it changes with the second loop axis: computed once per value of it, above
                    # the loop over tiles
                    self.hoisted_a.append(f"        {name} = {expr}")
                    self._adep.add(name)
                else:
                    self.hoisted.append(f"    {name} = {expr}")
                self._hoist[expr] = name
            return self._hoist[expr], shape
        self.n += 1
        name = f"{hint}{self.n}"
        self.lines.append(f"{name} = {expr}")
        return name, shape

    @staticmethod
    def join(a, b):
        if a == b or b == "s":
            return a
        if a == "s":
            return b
        s = {a, b} if isinstance(a, str) and isinstance(b, str) else None
        if s and s <= {"r", "f", "rf"}:
            return "rf"
        for x, y in ((a, b), (b, a)):
            if isinstance(y, tuple) and x == y[0]:
                return y
        raise CodegenError(f"cannot combine a {a} value with a {b} value in one expression (a value over "
                           "rows, the loop axis and a vector axis at once is not supported)")

    @staticmethod
    def bcast(e, sh, to):
        if sh == to or sh == "s":
            return e
        if to == "rf":
            return f"{e}[:, None]" if sh == "r" else f"{e}[None, :]"
        if isinstance(to, tuple) and sh == to[0]:
            return f"{e}[:, None]"
        raise CodegenError(f"cannot broadcast a {sh} value to {to}")

    @property
    def loop2(self) -> list:
        """The second loop axis, as a list (empty when the states sum over the loop axis only)."""
        return [self.F2] if self.F2 else []

    def goff(self, name, axes) -> str:
        """The name of tensor/output/rider ``name``'s offset over the grid axes, and over the
        second loop axis when ``axes`` has it (``off_<name>_ga``, set in that loop)."""
        return f"off_{name}_g" + ("a" if self.F2 and self.F2 in axes else "")

    def vec(self, a):
        return f"vc_{a}", f"vm_{a}"

    def load(self, name):
        ax = self.tensors[name]
        has_r = any(a in self.R for a in ax)
        has_f = self.F in ax
        vs = [a for a in ax if a in self.V]
        if len(vs) > 1 or (vs and has_r and has_f):
            raise CodegenError(f"tensor {name!r} (axes {' '.join(ax)}): at most two of rows, the loop axis "
                               "and one vector axis")
        ptr = f"{name}_ptr + {self.goff(name, ax)}"
        masks = []
        lead = "[:, None]" if vs or (has_r and has_f) else ""
        if has_r:
            ptr += f" + off_{name}_r{lead}"
            masks.append(f"rmask{lead}")
        if has_f:
            fl = "[:, None]" if vs else ("[None, :]" if has_r else "")
            ptr += f" + cols{fl} * s_{name}_{self.F}"
            masks.append(f"fmask{fl}")
        if vs:
            c, m = self.vec(vs[0])
            ptr += f" + {c}[None, :] * s_{name}_{vs[0]}"
            masks.append(f"{m}[None, :]")
        shape = ((("r" if has_r else "f"), vs[0]) if vs else
                 "rf" if has_r and has_f else "r" if has_r else "f" if has_f else "s")
        if self._count and has_f and vs:
            self.loopvec[name] = vs[0]
        if self.full and has_f:   # a full loop tile: no loop-axis mask
            masks = [m for m in masks if not m.startswith("fmask")]
            if vs and not has_r:   # a vector axis's mask only where it is not a whole block
                c, m = self.vec(vs[0])
                return self.bind(f"_ld({ptr}, {m}[None, :], VMASK_{vs[0]})", shape, "ld_")
        m = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
        # the storage type: widened to float32 where elementwise math reads it (``widen``),
        # converted straight to the dot type where a dot reads it
        return self.bind(f"tl.load({ptr}{m})", shape, "ld_")

    @property
    def _count(self):   # the body whose dots and loads the launcher's estimate counts
        return self.full and not self.alltrue

    def raw(self, t: Term):
        """A loaded tensor in its storage type (loaded once per body)."""
        name = t.args[0]
        if name not in self._raw:
            self._raw[name] = self.load(name)
        return self._raw[name]

    def widen(self, v):
        """A raw load as float32, converted once (above the loop when the load is there)."""
        e, sh = v
        if e not in self._wide:
            self._wide[e] = self.bind(f"{e}.to(tl.float32)", sh, "w")
        return self._wide[e]

    def dot_operand(self, t: Term) -> str:
        """``t`` as an operand of ``tl.dot``: a load goes from its storage type to DOT_T with
        no float32 round trip (exact: bf16/fp16 -> float32 -> DOT_T is the identity when
        DOT_T is the storage type, and float32 -> DOT_T rounds once either way)."""
        e, sh = self.raw(t) if t.op == "In" else self.emit(t)
        if not _over_f(sh):
            if isinstance(sh, tuple) and self._count:
                self.held[e] = sh[1]
            return self.bind(f"{e}.to(DOT_T)", sh, "d")[0]
        return f"{e}.to(DOT_T)"

    def emit(self, t: Term):
        memo = self._memo
        if t in memo:
            return memo[t]
        r = self._emit(t)
        memo[t] = r
        return r

    def _emit(self, t: Term):
        op = t.op
        if op == "Num":
            v = float(t.args[0])
            return ("float('-inf')" if v == -math.inf else "float('inf')" if v == math.inf else repr(v)), "s"
        if op == "In":
            return self.widen(self.raw(t))
        if op == "Idx":
            a = t.args[0]
            if a == self.F:
                return "cols.to(tl.float32)", "f"
            if a in self.R:
                return f"idx_{a}.to(tl.float32)", "r"
            if a in self.G or a == self.F2:
                return f"(idx_{a} * 1.0)", "s"
            raise CodegenError(f"index({a!r}) over a vector axis is not supported in this kernel")
        if op == "Size":
            return (f"(len_{t.args[0]} * 1.0)" if t.args[0] != self.F else "nf_f"), "s"
        if op == "Sum":
            return self.contract(t)
        if op == "Take":
            return self.take(t)
        if op == "St" and self._final is not None:   # a state's value after the loop
            q = t.args[0]
            sh = self._accs[q][1]
            return (f"({q} * {self._scale[q]!r})" if q in self._scale else q), sh
        if op in INT_OPS:   # exact in int64 (emit.py's semantics: // and % round toward -inf)
            r, sh, bad = self.emit_int(t)
            f = f"({r}).to(tl.float32)"
            return self.bind(f if bad is None else f"tl.where({bad}, float('nan'), {f})", sh, "i")
        if op in ("RMax", "RMin"):
            raise CodegenError(f"`{pretty(t)}`: a max/min over another axis inside the body is not supported")
        if op == "Exp":
            # exp(x) = exp2(x * log2(e)), log2(e) folded into x's constants (emit._scale_log2e:
            # exp(s * c - m) -> exp2(s * (c * log2 e) - m * log2 e), the per-row part above the loop)
            a, sa = self.emit(_scale_log2e(t.args[0], None))
            return self.bind(f"tl.exp2({a})", sa)
        if op in _FUNCS:
            return self._function(t)
        if op == "Pow":   # as every family lowers it (emit.pow_expr)
            a, sa = self.emit(t.args[0])
            return self.bind(pow_expr(a, t.args[1]), sa)
        if op == "Where" and self.alltrue and t.args[0] in self._conds:
            return self.emit(t.args[1])
        args = [self.emit(c) for c in t.children]
        if op in ("LAnd", "LOr", "LNot", "Where"):   # a value read as float (a bool mask) is a condition if != 0
            conds = t.children if op != "Where" else t.children[:1]
            args = [(f"({e} != 0)" if c in conds and c.op not in BOOL_OPS else e, s2)
                    for c, (e, s2) in zip(t.children, args)]
        sh = "s"
        for _, s in args:
            sh = self.join(sh, s)
        xs = [self.bcast(e, s, sh) for e, s in args]
        if op == "Div":   # correctly rounded, as torch divides (Triton's `/` is not: emit.py)
            return self.bind(f"tl.div_rn({xs[0]}, {xs[1]})", sh)
        binop = {"Add": "+", "Sub": "-", "Mul": "*", "CmpLt": "<", "CmpLe": "<=", "CmpGt": ">",
                 "CmpGe": ">=", "CmpEq": "==", "CmpNe": "!=", "LAnd": "&", "LOr": "|"}
        if op in binop:
            return self.bind(f"{xs[0]} {binop[op]} {xs[1]}", sh)
        unary = {"Neg": "-{}", "Exp": "tl.exp({})", "Log": "tl.log({})", "Sqrt": "tl.sqrt({})",
                 "Rsqrt": "tl.rsqrt({})", "Abs": "tl.abs({})", "Tanh": "_tanh({})", "LNot": "~({})"}
        if op in unary:
            return self.bind(unary[op].format(xs[0]), sh)
        if op in ("Max2", "Min2"):
            return self.bind(f"tl.{'maximum' if op == 'Max2' else 'minimum'}({xs[0]}, {xs[1]})", sh)
        if op == "Where":
            return self.bind(f"tl.where({xs[0]}, {xs[1]}, {xs[2]})", sh)
        raise CodegenError(f"operator {op!r} in `{pretty(t)}` is not supported by the sum kernel")

    def _function(self, t: Term):
        """Special functions and roundings, lowered as emit.py's ``_function`` lowers them (the
        forward families'): a stable sigmoid, log1p/expm1/softplus in float64, round half to
        even, casts that truncate (integer types) or round into the float format."""
        from acefuse.rewrite.terms import FLOAT_CASTS, SATURATING, CAST_LIMITS
        op, arg = t.op, t.args[0]
        a, sa = self.emit(arg)
        if op == "Erf":
            return self.bind(f"tl.erf({a})", sa)
        if op == "Sigmoid":   # exp of -|a| never overflows: 1 / (1 + e) where a >= 0, else e / (1 + e)
            e = self.bind(f"tl.exp(-tl.abs({a}))", sa, "e")[0]
            return self.bind(f"tl.where({a} >= 0, 1.0 / (1.0 + {e}), {e} / (1.0 + {e}))", sa)
        if op in ("Log1p", "Expm1", "Softplus"):   # in float64: a series for tiny arguments, no cancellation
            w = self.bind(f"({a}).to(tl.float64)", sa, "w")[0]
            if op == "Log1p":
                return self.bind(f"tl.where(tl.abs({w}) < 1e-5, {w} * (1.0 - {w} * (0.5 - {w} * "
                                 f"0.3333333333333333)), tl.log(1.0 + {w})).to(tl.float32)", sa)
            if op == "Expm1":
                return self.bind(f"tl.where(tl.abs({w}) < 1e-5, {w} * (1.0 + {w} * (0.5 + {w} * "
                                 f"0.16666666666666666)), tl.exp({w}) - 1.0).to(tl.float32)", sa)
            e = self.bind(f"tl.exp(-tl.abs({w}))", sa, "w")[0]
            lp = self.bind(f"tl.where({e} < 1e-5, {e} * (1.0 - 0.5 * {e}), tl.log(1.0 + {e}))", sa, "w")[0]
            return self.bind(f"(tl.where({w} > 0.0, {w}, 0.0) + {lp}).to(tl.float32)", sa)
        if op in ("Floor", "Ceil"):
            return self.bind(f"tl.{op.lower()}({a})", sa)
        if op == "Round":
            return self.bind(f"_rint({a})", sa)
        dtype = t.args[1]
        if dtype == "float32":
            return a, sa
        if dtype in FLOAT_CASTS:
            helper = {"float8_e4m3fn": "_rnd_e4m3", "float8_e5m2": "_rnd_e5m2", "float16": "_rnd_f16",
                      "bfloat16": "_rnd_bf16"}[dtype]
            return self.bind(f"{helper}({a})", sa)
        tr = self.bind(f"_trunc({a})", sa)[0]
        if dtype in SATURATING:
            lo, hi = SATURATING[dtype]
            return self.bind(f"tl.where({tr} != {tr}, {tr}, tl.minimum(tl.maximum({tr}, {lo!r}), {hi!r}))", sa)
        lim = CAST_LIMITS[dtype]
        return self.bind(f"tl.where(({tr} >= {-lim!r}) & ({tr} < {lim!r}), {tr}, float('nan'))", sa)

    # -- integers and lookups -------------------------------------------------------------------
    def emit_int(self, t: Term):
        """An integer expression (indices, sizes, integer constants and operators, index tensors
        and lookups of them) as exact int64: (expression, shape, bad), ``bad`` naming a boolean
        that is true where the value is undefined (a division by zero, a shift count outside
        0..63, a float value outside int64), or None. The semantics of emit.py's ``emit_int``
        (the row and contraction families'): ``//`` and ``%`` round toward -inf, as torch on
        integers."""
        key = ("int", t)
        if key not in self._memo:
            self._memo[key] = self._emit_int(t)
        return self._memo[key]

    def _ibind(self, expr, sh, hint="n"):
        return self.bind(expr, sh, hint)[0]

    def _emit_int(self, t: Term):
        op = t.op
        if op == "Num" and not isinstance(t.args[0], Term) and float(t.args[0]).is_integer():
            return repr(int(t.args[0])), "s", None
        if op == "Idx":
            a = t.args[0]
            if a == self.F:
                return self._ibind("cols.to(tl.int64)", "f"), "f", None
            if a in self.R or a in self.G or a == self.F2:
                return f"idx_{a}", ("r" if a in self.R else "s"), None
            raise CodegenError(f"program {self.name!r}: index({a!r}) over a vector axis is not supported in "
                               "this kernel")
        if op == "Size":
            return ("n_f" if t.args[0] == self.F else f"len_{t.args[0]}"), "s", None
        if op == "In" and t.args[0] in self.index_tensors:
            e, sh = self.raw(t)
            return self._ibind(f"({e}).to(tl.int64)", sh, "ix"), sh, None
        if op == "Take":
            return self.take(t, as_int=True)
        if op in ("Add", "Sub", "Mul", "Max2", "Min2", "BitAnd", "BitOr", "BitXor", "FloorDiv", "Mod", "Shl", "Shr"):
            (a, sa, ba), (b, sb, bb) = self.emit_int(t.args[0]), self.emit_int(t.args[1])
            sh = self.join(sa, sb)
            a, b = self.bcast(a, sa, sh), self.bcast(b, sb, sh)
            bad = _or(ba, bb)
            sym = {"Add": "+", "Sub": "-", "Mul": "*", "BitAnd": "&", "BitOr": "|", "BitXor": "^"}
            if op in sym:
                return self._ibind(f"{a} {sym[op]} {b}", sh), sh, bad
            if op in ("Max2", "Min2"):
                return self._ibind(f"tl.{'maximum' if op == 'Max2' else 'minimum'}({a}, {b})", sh), sh, bad
            lit = _int_literal(t.args[1])
            if op in ("FloorDiv", "Mod") and lit is not None and lit > 0 and lit & (lit - 1) == 0:
                # a power of two: an arithmetic shift and a mask round toward -inf exactly
                e = f"{a} >> {lit.bit_length() - 1}" if op == "FloorDiv" else f"{a} & {lit - 1}"
                return self._ibind(e, sh), sh, bad
            if op in ("FloorDiv", "Mod"):
                if lit is None or lit == 0:
                    zero = self._ibind(f"{b} == 0", sh, "z")
                    bad = _or(bad, zero)
                    b = self._ibind(f"tl.where({zero}, 1, {b})", sh)
                # Triton's // truncates toward zero (C); floor semantics by a correction
                q = self._ibind(f"{a} // {b}", sh)
                r = self._ibind(f"{a} - {q} * {b}", sh)
                fix = self._ibind(f"{r} < 0" if lit is not None and lit > 0
                                  else f"({r} != 0) & (({r} < 0) != ({b} < 0))", sh, "z")
                e = f"tl.where({fix}, {q} - 1, {q})" if op == "FloorDiv" else f"tl.where({fix}, {r} + {b}, {r})"
                return self._ibind(e, sh), sh, bad
            if lit is None:   # shifts: the count must be in 0..63 (else undefined in int64: NaN)
                okc = self._ibind(f"({b} >= 0) & ({b} < 64)", sh, "z")
                bad = _or(bad, f"~{okc}")
                b = self._ibind(f"tl.where({okc}, {b}, 0)", sh)
            if _int_literal(t.args[0]) is not None:   # a literal shifted by a tensor: make it int64
                a = f"tl.full([], {a}, tl.int64)"
            return self._ibind(f"{a} {'<<' if op == 'Shl' else '>>'} {b}", sh), sh, bad
        if op in ("Neg", "Abs", "BitNot"):
            a, sa, ba = self.emit_int(t.args[0])
            return self._ibind({"Neg": f"-{a}", "Abs": f"tl.abs({a})", "BitNot": f"~{a}"}[op], sa), sa, ba
        if op == "Where":
            c, sc = self.emit(t.args[0])
            if t.args[0].op not in BOOL_OPS:
                c = f"({c} != 0)"
            (a, sa, ba), (b, sb, bb) = self.emit_int(t.args[1]), self.emit_int(t.args[2])
            sh = self.join(self.join(sc, sa), sb)
            c, a, b = self.bcast(c, sc, sh), self.bcast(a, sa, sh), self.bcast(b, sb, sh)
            bad = _or(f"tl.where({c}, {self.bcast(ba, sa, sh)}, False)" if ba else None,
                      f"tl.where({c}, False, {self.bcast(bb, sb, sh)})" if bb else None)
            return self._ibind(f"tl.where({c}, {a}, {b})", sh), sh, bad
        if not is_integer(t) and op not in ("In", "Take"):
            raise CodegenError(f"program {self.name!r}: `{pretty(t)}` is not an integer expression; an index or "
                               "an integer operator's operand must be one (round it first: af.floor, af.round, "
                               "af.cast)")
        # a float value that is integer by construction (a boolean, a rounded value)
        f, sf = self.emit(t)
        if op in BOOLEAN:
            return self._ibind(f"({f}).to(tl.int64)", sf), sf, None
        ok = self._ibind(f"({f} >= -9.223372036854776e18) & ({f} < 9.223372036854776e18)", sf, "z")
        return self._ibind(f"tl.where({ok}, {f}, 0.0).to(tl.int64)", sf), sf, f"~{ok}"

    def take(self, t: Term, as_int=False):
        """A lookup ``af.take(x, idx, a)``: ``x`` read with its axis ``a`` replaced by the integer
        value of ``idx`` (emit_int), a load at the computed offset. An index outside
        ``0 .. len(a) - 1`` reads NaN (a comparison with it is false), as in the forward families
        (codegen/contraction_ctx.py ``take``). ``as_int``: (int64 value, shape, bad)."""
        name, idx, ax = t.args
        rest = [a for a in self.tensors[name] if a != ax]
        vs = [a for a in rest if a in self.V]
        bad_ax = [a for a in rest if a not in self.G + self.R + [self.F] + self.loop2 + vs[:1]]
        if bad_ax:
            raise CodegenError(f"program {self.name!r}: af.take({name}, `{pretty(idx)}`, {ax!r}): {name!r} also "
                               f"ranges over {bad_ax}; a lookup in a sum kernel reads one value, or one vector "
                               "along one vector axis, per row and loop element (its other axes must be grid, "
                               "row or loop axes)")
        ie, si, bad = self.emit_int(idx)
        has_r, has_f = any(a in self.R for a in rest), self.F in rest
        if vs:   # a gathered vector (paged keys ``kc[n = slot(j)]`` over d): a [rows or loop, axis] tile
            if (has_r and has_f) or si == "rf" or isinstance(si, tuple) or (si == "r" and has_f) or (si == "f" and has_r):
                raise CodegenError(f"program {self.name!r}: af.take({name}, `{pretty(idx)}`, {ax!r}): a gathered "
                                   f"vector over {vs[0]!r} is read per row or per loop element, not both")
            base = "r" if has_r or si == "r" else "f" if has_f or si == "f" else None
            if base is None:
                raise CodegenError(f"program {self.name!r}: af.take({name}, `{pretty(idx)}`, {ax!r}): a gathered "
                                   f"vector over {vs[0]!r} must vary along the rows or the loop axis")
            sh = (base, vs[0])
        else:
            sh = self.join(si, "rf" if has_r and has_f else "r" if has_r else "f" if has_f else "s")
        ptr = f"{name}_ptr + {self.goff(name, self.tensors[name])}"
        if has_r:
            ptr += f" + {self.bcast(f'off_{name}_r', 'r', sh)}"
        if has_f:
            ptr += f" + {self.bcast('cols', 'f', sh)} * s_{name}_{self.F}"
        inr = f"({ie} >= 0) & ({ie} < len_{ax})"
        ok = self._ibind(f"{inr} & ~({bad})" if bad else inr, si, "c")
        ptr += f" + {self.bcast(f'tl.where({ok}, {ie}, 0)', si, sh)} * s_{name}_{ax}"
        masks = [] if not has_f or self.full else [self.bcast('fmask', 'f', sh)]
        if vs:
            c, vm = self.vec(vs[0])
            ptr += f" + {c}[None, :] * s_{name}_{vs[0]}"
            masks.append(f"{vm}[None, :]")
        m = f", mask={' & '.join(masks)}, other=0" if masks else ""
        v = self._ibind(f"tl.load({ptr}{m})", sh, "tk_")
        okb = self.bcast(ok, si, sh)
        if as_int:
            return self._ibind(f"({v}).to(tl.int64)", sh, "tk_"), sh, f"~{okb}"
        val = f"tl.where({okb}, ({v}).to(tl.float32), float('nan'))"
        if vs and (sh[0] == "r" or not self.full):
            # a gathered vector is a dot operand: past the rows or the loop axis's end it is 0, not
            # NaN (an index computed there may fall outside the table, and 0 * NaN is NaN)
            val = f"tl.where({'rmask' if sh[0] == 'r' else 'fmask'}[:, None], {val}, 0.0)"
        return self.bind(val, sh, "tk_")

    def contract(self, t: Term):
        ax = t.args[0].args[0]
        if ax not in self.V:
            raise CodegenError(f"`{pretty(t)}`: a sum over {ax!r} inside the body must run over a vector axis")
        fs = _flat_mul(t.args[1])
        on_t = [f for f in fs if ax in self._axes(f)]
        off = [self.emit(f) for f in fs if ax not in self._axes(f)]
        shapes = [self._shape_of(f) for f in on_t]
        if len(on_t) == 2 and sorted(shapes, key=str) == [("f", ax), ("r", ax)]:
            rt, lt = on_t if shapes[0] == ("r", ax) else on_t[::-1]
            if self._count:
                self.dots.append(ax)
            out = self.bind(f"tl.dot({self.dot_operand(rt)}, tl.trans({self.dot_operand(lt)}), "
                            "input_precision=PREC)", "rf", "dot_")
        else:
            on = [self.emit(f) for f in on_t]
            sh = "s"
            for _, s in on:
                sh = self.join(sh, s)
            if not isinstance(sh, tuple):
                raise CodegenError(f"`{pretty(t)}`: the body of a sum over {ax!r} does not range over it")
            prod = " * ".join(self.bcast(e, s, sh) for e, s in on)
            out = self.bind(f"tl.sum({prod}, axis=1)", sh[0])
        for e, s in off:
            sh = self.join(out[1], s)
            out = self.bind(f"{self.bcast(out[0], out[1], sh)} * {self.bcast(e, s, sh)}", sh)
        return out

    def _axes(self, t: Term) -> set:
        if t.op == "In":
            return set(self.tensors[t.args[0]])
        if t.op == "Idx":
            return {t.args[0]}
        if t.op == "Take":
            return (set(self.tensors[t.args[0]]) - {t.args[2]}) | self._axes(t.args[1])
        if t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax":
            return self._axes(t.args[1]) - {t.args[0].args[0]}
        return set().union(*[self._axes(c) for c in t.children]) if t.children else set()

    # -- mask analysis ---------------------------------------------------------------------------
    def mask_conds(self) -> list:
        conds = []
        for body in self.states.values():
            for t in body.walk():
                if t.op == "Where" and self._index_only(t.args[0]) and t.args[0] not in conds:
                    conds.append(t.args[0])
        return conds

    def _index_only(self, c: Term) -> bool:
        ok = ("Idx", "Num", "Size", "Add", "Sub", "Neg", "Mul", "Abs", "Max2", "Min2", "FloorDiv", "Mod", "CmpLt",
              "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe", "LAnd", "LOr", "LNot")
        # a 0-d input (a shard's global offset, acefuse/distributed) is one value per launch: a point
        # interval (masks.py). // and % by a positive integer: masks.py's bounds are exact integer
        # floor divisions (2b40fa4), no longer Triton's float `/`
        walk = list(nodes(c))
        return (any(s.op == "Idx" for s in walk)
                and all(s.op in ok or (s.op == "In" and self.tensors.get(s.args[0]) == ()) for s in walk)
                and all(s.args[0] in [self.F] + self.R + self.G for s in walk if s.op == "Idx")
                and not any(s.op == "Mul" and not any(x.op == "Num" for x in s.args) for s in walk)
                and all(_pos_const(s.args[1]) for s in walk if s.op in ("FloorDiv", "Mod")))

    def _zero_if_false(self, t: Term, conds) -> bool:
        """``t`` is 0 wherever every condition in ``conds`` is false. Inputs are taken to be
        finite (an infinite input would give NaN in the unskipped tile, not 0)."""
        def cls(u):   # "0", "-inf" or "?" (finite, unknown)
            op = u.op
            if op == "Num":
                v = u.args[0]
                return "0" if v == 0 else "-inf" if v == -math.inf else "?"
            if op == "Where" and u.args[0] in conds:
                return cls(u.args[2])
            if op == "Exp":
                return "0" if cls(u.args[0]) == "-inf" else "?"
            if op in ("Add", "Sub"):
                a, b = cls(u.args[0]), cls(u.args[1])
                return "-inf" if a == "-inf" and b == "?" else "?"
            if op == "Mul":
                a, b = cls(u.args[0]), cls(u.args[1])
                if "0" in (a, b) and "-inf" not in (a, b):
                    return "0"
                for x, y in ((u.args[0], u.args[1]), (u.args[1], u.args[0])):
                    if cls(x) == "-inf" and y.op == "Num" and 0 < y.args[0] < math.inf:
                        return "-inf"
                return "?"
            if op == "Neg":
                return "0" if cls(u.args[0]) == "0" else "?"
            if op == "Sum":
                return "0" if cls(u.args[1]) == "0" else "?"
            return "?"
        return cls(t) == "0"

    def interval(self, t: Term, L: list):
        op = t.op
        if op in ("Num", "Idx", "Size"):
            return _interval_leaf(self, t, self.F, "f", "nf_f")
        if op in ("Neg", "Add", "Sub", "Mul", "Abs", "Max2", "Min2", "FloorDiv", "Mod", "In"):
            return ContractionGen.interval(self, t, L)
        raise CodegenError(f"program {self.name!r}: no interval arithmetic for {op!r} in a mask condition")

    def truth(self, c: Term, L: list):
        """(always_true, always_false) of a mask condition over each tile box (ContractionGen's);
        ``==`` and ``!=`` here, with every bound made a block over the tiles (a row bound is a
        0-d value in this kernel, and Triton's interpreter cannot ``&`` it with a block)."""
        from acefuse.codegen.masks import _atom_ok
        if c.op in ("CmpEq", "CmpNe") and _atom_ok(self, c):
            z = "start * 0.0"
            (al, ah), (bl, bh) = (self.interval(x, L) for x in c.args)
            eq = f"(({al} + {z} == {ah} + {z}) & ({bl} + {z} == {bh} + {z}) & ({al} + {z} == {bl} + {z}))"
            ne = f"(({ah} + {z} < {bl}) | ({al} + {z} > {bh}))"
            return (eq, ne) if c.op == "CmpEq" else (ne, eq)
        return ContractionGen.truth(self, c, L)

    # -- kernel text -----------------------------------------------------------------------------
    def sig(self):
        args = []
        for t, axes in list(self.tensors.items()) + list(self.out_axes.items()):
            args.append(f"{t}_ptr")
            args += [f"s_{t}_{a}" for a in axes]
        for o, (_, axes) in self.riders.items():
            args.append(f"{o}_ptr")
            args += [f"s_{o}_{a}" for a in axes]
            if o in self.rtma:
                args.append(f"{o}_desc")   # its TMA descriptor ([grid, loop, vector]; None: pointer atomics)
        args += [f"len_{a}" for a in self.G + self.R + self.V + self.loop2 + self.Lk]
        return args + ["n_rows", "n_f"]

    def kernel(self) -> str:
        self._memo = {}
        F = self.F
        blocks = ", ".join(f"BLOCK_V_{a}: tl.constexpr, VMASK_{a}: tl.constexpr" for a in self.V)
        L = ["@triton.jit",
             f"def {self.name}_sum({', '.join(self.sig())}, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, "
             f"{blocks + ', ' if blocks else ''}PREC: tl.constexpr, DOT_T: tl.constexpr, SCAN: tl.constexpr, "
             f"REV: tl.constexpr{', RIDE: tl.constexpr, RTMA: tl.constexpr' if self.riders else ''}):",
             f"    # grid: (row tiles over {' '.join(self.R)}, {' '.join(self.G) or 'one'}); "
             f"loop over tiles of {F!r} carrying the sums"
             + (f" (inside a loop over every {self.F2!r})" if self.F2 else "")]
        L.append("    pid_r = tl.program_id(0)")
        L.append("    if REV:   # the row tiles in reverse order (the launcher times both on a GPU)")
        L.append("        pid_r = tl.num_programs(0) - 1 - pid_r")
        L.append("    pid_g = tl.program_id(1)")
        L += row_indices(self.R, self.G)
        for a in self.R:
            L.append(f"    {a}_lo = tl.min(tl.where(rmask, idx_{a}, 2**31), axis=0) * 1.0")
            L.append(f"    {a}_hi = tl.max(tl.where(rmask, idx_{a}, -1), axis=0) * 1.0")
        L.append("    nf_f = n_f * 1.0")
        for a in self.V:
            c, m = self.vec(a)
            L.append(f"    {c} = tl.arange(0, BLOCK_V_{a})")
            L.append(f"    {m} = {c} < len_{a}")
        for t in list(self.tensors) + list(self.out_axes) + list(self.riders):
            axes = (self.tensors[t] if t in self.tensors else self.out_axes[t] if t in self.out_axes
                    else self.riders[t][1])
            g = [a for a in axes if a in self.G]
            r = [a for a in axes if a in self.R]
            L.append(f"    off_{t}_g = " + (" + ".join(f"idx_{a} * s_{t}_{a}" for a in g) if g else "0"))
            if r:
                L.append(f"    off_{t}_r = " + " + ".join(f"idx_{a} * s_{t}_{a}" for a in r))
        # the loop's range: mask analysis
        conds = self.mask_conds()
        skip = bool(conds) and all(self._zero_if_false(b, conds)
                                   for b in list(self.states.values()) + list(self.tiles.values())
                                   + [sc.body for sc in self.scatters.values()])
        for o, (b, _) in self.riders.items():   # a skipped tile must add 0 to the riders' sums too
            if skip and not self._zero_if_false(b, conds):
                raise CodegenError(f"program {self.name!r}: rider {o!r} = sum(`{pretty(b)}`) is not 0 on the "
                                   f"{F!r} tiles the mask analysis skips; its stage runs apart")
        self.skips = skip
        self._conds = conds
        if conds:
            L.append(f"    # mask analysis: interval arithmetic over each {F!r} tile's index box (this program's rows)")
            if skip:
                L.append("    # tiles where every mask condition is false add 0 to every sum (checked symbolically) "
                         "and are skipped;")
            L.append("    # full tiles where every condition is true everywhere (one run of them) need no where()")
            L.append("    BIG = 2147483647")
            L.append("    first = 0 * n_f + BIG")
            L.append("    end = 0 * n_f")
            L.append("    tfirst = 0 * n_f + BIG")
            L.append("    tend = 0 * n_f")
            L.append("    ntrue = 0 * n_f")
            L.append("    for t0 in range(0, n_f, SCAN * BLOCK_J):")
            L.append("        start = t0 + tl.arange(0, SCAN) * BLOCK_J")
            L.append("        valid = start < n_f")
            L.append("        f_lo = start * 1.0")
            L.append("        f_hi = (tl.minimum(start + BLOCK_J, n_f) - 1) * 1.0")
            ivl: list = []
            trues, falses = [], []
            for c in conds:
                t_, f_ = self.truth(c, ivl)
                trues.append(t_)
                falses.append(f_)
            L.extend(f"        {x}" for x in ivl)
            if skip:
                L.append(f"        seen = (~({' & '.join(falses)})) & valid")
                L.append("        first = tl.minimum(first, tl.min(tl.where(seen, start, BIG), axis=0))")
                L.append("        end = tl.maximum(end, tl.max(tl.where(seen, tl.minimum(start + BLOCK_J, n_f), 0), axis=0))")
            L.append(f"        alltrue = ({' & '.join(trues)}) & valid & (start + BLOCK_J <= n_f)")
            L.append("        tfirst = tl.minimum(tfirst, tl.min(tl.where(alltrue, start, BIG), axis=0))")
            L.append("        tend = tl.maximum(tend, tl.max(tl.where(alltrue, start + BLOCK_J, 0), axis=0))")
            L.append("        ntrue = ntrue + tl.sum(alltrue.to(tl.int32), axis=0)")
            if skip:
                L.append("    first = tl.where(first == BIG, 0, first)")
                L.append("    end = tl.maximum(end, first)")
            else:
                L.append("    first = 0")
                L.append("    end = n_f")
            L.append("    # the all-true tiles as one run [tfirst, tend), else none")
            L.append("    one_run = ntrue * BLOCK_J == tend - tfirst")
            L.append("    tfirst = tl.where(one_run, tfirst, 0)")
            L.append("    tend = tl.where(one_run, tend, 0)")
        else:
            L.append("    first = 0")
            L.append("    end = n_f")
        accs = self._accs = {}
        full = self._body(True, accs)
        true = self._body(True, accs, alltrue=True) if conds else []
        tail = self._body(False, accs)
        for q, (init, _) in accs.items():
            L.append(f"    {q} = {init}")
        if self.F2:
            L2 = self._two_loops(full, true, tail, conds)
        elif conds:
            L2 = ["    # full tiles first, unmasked along the loop axis: the all-true run [tlo, thi) cut out of",
                  "    # [first, end) runs after the others without the where()s; then the partial last tile",
                  "    last = end",
                  "    end = first + (last - first) // BLOCK_J * BLOCK_J",
                  "    tlo = tl.minimum(tl.maximum(tfirst, first), end)",
                  "    thi = tl.minimum(tl.maximum(tend, tlo), end)",
                  "    cut = thi - tlo",
                  "    end = end - cut",
                  "    for start in range(first, end, BLOCK_J):",
                  "        cols = start + tl.where(start < tlo, 0, cut) + tl.arange(0, BLOCK_J)"]
            L2 += full
            L2 += ["    for start in range(tlo, thi, BLOCK_J):",
                   "        cols = start + tl.arange(0, BLOCK_J)"]
            L2 += true
            L2 += ["    end = end + cut"]
        else:
            L2 = ["    # full tiles first, unmasked along the loop axis; then the last, partial tile (if any)",
                  "    last = end",
                  "    end = first + (last - first) // BLOCK_J * BLOCK_J",
                  "    for start in range(first, end, BLOCK_J):",
                  "        cols = start + tl.arange(0, BLOCK_J)"]
            L2 += full
        if not self.F2:
            L2 += ["    if end < last:",
                   "        cols = end + tl.arange(0, BLOCK_J)",
                   "        fmask = cols < last",
                   "        tmask = rmask[:, None] & fmask[None, :]"]
            L2 += tail
        store = []
        for o, q in self.outs.items():
            sh = accs[q][1]
            ptr = f"{o}_ptr + off_{o}_g + off_{o}_r"
            if isinstance(sh, tuple):
                c, m = self.vec(sh[1])
                ptr = f"{ptr}[:, None] + {c}[None, :] * s_{o}_{sh[1]}"
                mask = f"rmask[:, None] & {m}[None, :]"
            else:
                mask = "rmask"
            if isinstance(sh, tuple) != any(a in self.V for a in self.out_axes[o]):
                raise CodegenError(f"output {o!r}: the state {q} does not carry the output's vector axis")
            c = self._scale.get(q, 1.0) * self._oscale.get(o, 1.0)
            val = f"({q} * {c!r})" if c != 1.0 else q
            if o in self.row_scatters:
                from acefuse.codegen.sums_scatter import row_scatter_store
                store += row_scatter_store(self, o, val, sh)
                continue
            store.append(f"    tl.store({ptr}, _out({val}, {o}_ptr), mask={mask})")
        for o, t in self.finals.items():   # sum kernels' finalize: after the loop, per row tile
            self._final, self._memo, self._raw = [], {}, {}
            self._wide = {k: v for k, v in self._wide.items() if not _over_f(v[1])}
            try:
                e, sh = self.emit(t)
                lines = self._final
            finally:
                self._final = None
            vs = [a for a in self.out_axes[o] if a in self.V]
            to = ("r", vs[0]) if vs else "r"
            if sh not in ("s", "r", to):
                raise CodegenError(f"program {self.name!r}: output {o!r} = {pretty(t)}: its value has shape {sh}, "
                                   f"not the output's {to}")
            e = self.bcast(e, sh, to) if sh != "s" else e
            if sh != to:
                e = f"({e}) + tl.zeros([BLOCK_I{', BLOCK_V_' + vs[0] if vs else ''}], tl.float32)"
            ptr = f"{o}_ptr + off_{o}_g + off_{o}_r"
            mask = "rmask"
            if vs:
                c, m = self.vec(vs[0])
                ptr = f"{ptr}[:, None] + {c}[None, :] * s_{o}_{vs[0]}"
                mask = f"rmask[:, None] & {m}[None, :]"
            store.append(f"    # {o} = {pretty(t)}")
            store += lines
            store.append(f"    tl.store({ptr}, _out({e}, {o}_ptr), mask={mask})")
        return "\n".join(L + self.hoisted + L2 + store)

    def _two_loops(self, full, true, tail, conds):
        """The loops of a kernel whose states sum over two loop axes (``sum_F(sum_A(x))``, either
        nesting): the loop axis's range and its all-true run are the same for every value of
        ``A`` (no mask condition reads ``A``), so they are set once; then for each value of ``A``
        the tiles of ``F`` add into the same accumulators."""
        A = self.F2
        F = self.F
        L = [f"    # the states are sums over {F!r} and {A!r}: for each {A!r} (tensors over it offset by idx_{A} * stride),",
             f"    # the tiles of {F!r} add into the same accumulators. The certified update is sum-split over tiles",
             f"    # of {F!r} (s_AB = s_A + sum_B(...)); adding per {A!r} regroups the same terms: sum-split over the",
             f"    # ({F!r}, {A!r}) pairs in blocks {{{A}}} x tile, reading the double sum as one sum over the pairs",
             "    # (Fubini: exact over the reals, not a proved library rule; acefuse/backward_normal.py)",
             "    last = end",
             "    end = first + (last - first) // BLOCK_J * BLOCK_J"]
        if conds:
            L += ["    # full tiles first, unmasked along the loop axis: the all-true run [tlo, thi) cut out of",
                  "    # [first, end) runs after the others without the where()s; then the partial last tile",
                  "    tlo = tl.minimum(tl.maximum(tfirst, first), end)",
                  "    thi = tl.minimum(tl.maximum(tend, tlo), end)",
                  "    cut = thi - tlo",
                  "    tail = end",
                  "    end = end - cut"]
        else:
            L += ["    # full tiles first, unmasked along the loop axis; then the last, partial tile (if any)",
                  "    tail = end"]
        L.append(f"    for a_{A} in range(0, len_{A}):")
        L.append(f"        idx_{A} = gem * 0 + a_{A}")
        offs = [(t, ax) for t, ax in list(self.tensors.items()) + list(self.out_axes.items())
                + [(o, ax) for o, (_, ax) in self.riders.items()] if A in ax]
        L += [f"        {self.goff(t, ax)} = off_{t}_g + idx_{A} * s_{t}_{A}" for t, ax in offs]
        L += self.hoisted_a
        ind = ["    " + x for x in full]
        if conds:
            L += ["        for start in range(first, end, BLOCK_J):",
                  "            cols = start + tl.where(start < tlo, 0, cut) + tl.arange(0, BLOCK_J)"]
            L += ind
            L += ["        for start in range(tlo, thi, BLOCK_J):",
                  "            cols = start + tl.arange(0, BLOCK_J)"]
            L += ["    " + x for x in true]
        else:
            L += ["        for start in range(first, end, BLOCK_J):",
                  "            cols = start + tl.arange(0, BLOCK_J)"]
            L += ind
        L += ["        if tail < last:",
              "            cols = tail + tl.arange(0, BLOCK_J)",
              "            fmask = cols < last",
              "            tmask = rmask[:, None] & fmask[None, :]"]
        L += ["    " + x for x in tail]
        return L

    def _body(self, full, accs, alltrue=False):
        """The loop body over one tile, as lines: ``full``, a tile wholly inside the loop's
        range (no mask along the loop axis: each output row depends on its own row of every
        tile, so rows past the end only reach rows that are not stored); else the masked last
        tile. Loop-invariant values are shared (named once above the loop)."""
        F = self.F
        self.full = full
        self.alltrue = alltrue   # tiles where every mask condition holds: where(c, a, b) is a
        self._memo, self._raw = {}, {}
        self._wide = {k: v for k, v in self._wide.items() if not _over_f(v[1])}
        body = []

        def masked(e):
            return e if full else f"tl.where(tmask, {e}, 0.0)"
        for q, b in self.states.items():
            self.lines = []
            c, fs = _const_factor(_flat_mul(b))
            if c != 1.0:   # sum_F(t * c) = c * sum_F(t): the constant applied once, at the store
                self._scale[q] = c
            vecs = [f for f in fs if isinstance(self._shape_of(f), tuple) and self._shape_of(f)[0] == "f"]
            if len(vecs) == 1:
                tt = _product([f for f in fs if f is not vecs[0]])
                wsh = self._shape_of(vecs[0])
                w = self.dot_operand(vecs[0])
                e, sh = self.emit(tt)
                if sh not in ("rf", "r", "f", "s"):
                    raise CodegenError(f"state {q}: `{pretty(b)}` is not a (rows x {F!r}) tile times a vector")
                e = self.bcast(e, sh, "rf") if sh != "rf" else e
                if sh in ("r", "s"):
                    e = f"({e}) + tl.zeros([BLOCK_I, BLOCK_J], tl.float32)"
                a = wsh[1]
                if self._count:
                    self.dots.append(a)
                accs[q] = (f"tl.zeros([BLOCK_I, BLOCK_V_{a}], tl.float32)", ("r", a))
                self.lines.append(f"{q} = tl.dot({masked(e)}.to(DOT_T), {w}, acc={q}, input_precision=PREC)")
            else:
                bb = fs[0]
                for f in fs[1:]:
                    bb = Term("Mul", (bb, f))
                e, sh = self.emit(bb)
                if sh not in ("rf", "f"):
                    raise CodegenError(f"state {q}: `{pretty(b)}` has shape {sh}; expected a (rows x {F!r}) tile")
                e = self.bcast(e, sh, "rf") if sh != "rf" else e
                if sh == "f":
                    e = f"({e}) + tl.zeros([BLOCK_I, BLOCK_J], tl.float32)"
                accs[q] = ("tl.zeros([BLOCK_I], tl.float32)", "r")
                self.lines.append(f"{q} = {q} + tl.sum({masked(e)}, axis=1)")
            body.append(f"        # {q}_AB = {q}_A + sum_B({pretty(b)})")
            body.extend("        " + x for x in self.lines)
        for o, t in self.tiles.items():   # stored from each tile (a skipped tile: 0, zeroed by the launcher)
            self.lines = []
            e, sh = self.emit(t)
            if sh not in ("rf", "r", "f", "s"):
                raise CodegenError(f"output {o!r}: `{pretty(t)}` is not a (rows x {F!r}) tile")
            e = self.bcast(e, sh, "rf") if sh != "rf" else e
            if sh != "rf":
                e = f"({e}) + tl.zeros([BLOCK_I, BLOCK_J], tl.float32)"
            body.append(f"        # {o} = {pretty(t)}, over this (rows x {F!r}) tile")
            body.extend("        " + x for x in self.lines)
            body.append(f"        tl.store({o}_ptr + off_{o}_g + off_{o}_r[:, None] + cols[None, :] * s_{o}_{F}, "
                        f"_out({e}, {o}_ptr), mask={'rmask[:, None]' if full else 'tmask'})")
        if self.scatters:
            from acefuse.codegen.sums_scatter import scatter_lines
            body.extend(scatter_lines(self, full))
        if self.riders:
            from acefuse.codegen.riders import sum_rider_lines
            body.extend(sum_rider_lines(self, full))
        self.full = self.alltrue = False
        return body

    def _shape_of(self, t: Term):
        ax = self._axes(t)
        vs = [a for a in ax if a in self.V]
        has_r, has_f = any(a in self.R for a in ax), self.F in ax
        if vs:
            return ("r" if has_r else "f", vs[0]) if len(vs) == 1 and not (has_r and has_f) else "?"
        return "rf" if has_r and has_f else "r" if has_r else "f" if has_f else "s"

    def module(self) -> str:
        f = self.f
        parts = [HEADER.format(name=self.name, axis=self.F, explain=f.explain().replace('"""', "'''")),
                 LOAD_HELPER, self.kernel(), self.launcher()]
        return "\n\n\n".join(parts) + "\n"

    def launcher(self):
        from acefuse.codegen.sums_launch import launcher
        return launcher(self)


def _product(fs) -> Term:
    """The product of the factors ``fs``, left to right (1 when there are none)."""
    if not fs:
        return Term("Num", (1.0,))
    t = fs[0]
    for f in fs[1:]:
        t = Term("Mul", (t, f))
    return t


def _const_factor(fs):
    """(c, factors): the product c of the constant factors of a product (finite, magnitudes in
    [1e-30, 1e30], so that moving them out of a sum neither overflows nor underflows where the
    sum as written would not), and the other factors ([1.0] when none is left)."""
    c, rest = 1.0, []
    for f in fs:
        v = f.args[0] if f.op == "Num" and not isinstance(f.args[0], Term) else None
        if v is not None and 1e-30 <= abs(float(v)) <= 1e30 and 1e-30 <= abs(c * float(v)) <= 1e30:
            c *= float(v)
        else:
            rest.append(f)
    return c, rest or [Term("Num", (1.0,))]


def _over_f(shape) -> bool:
    """A value of this shape ranges over the loop axis (else it is the same in every tile)."""
    return shape in ("f", "rf") or (isinstance(shape, tuple) and shape[0] == "f")


def _tile_output(t: Term, F: str, axes) -> bool:
    """An output elementwise over the loop axis (it ranges over it and reads no state: a bias's
    gradient dS over queries and keys), computed from each tile of the loop."""
    return F in axes and not any(s.op == "St" for s in t.walk())


def sum_pass(fusion) -> bool:
    """Every state of the (single) pass is a plain sum over the fused axis; every output is a
    state or elementwise over the fused axis (a tile output)."""
    enc = fusion.encoding
    return (len(fusion.passes) == 1 and bool(fusion.passes[0].states)
            and all(s.op == "sum" for s in fusion.passes[0].states)
            and all(_state_output(t) or _tile_output(t, enc.axis, enc.output_axes[o])
                    or _final_output(t, enc.axis, enc.tensors) for o, t in enc.outputs.items()))


def _final_output(t: Term, F: str, tensors) -> bool:
    """An output computed after the loop: an expression of states, constants, sizes and inputs
    that do not range over the loop axis (``c * s_J - pre1 * c * s2_J + c * s3_J``), with
    selections among them (a max's adjoint ``g * where(n == 0, 0, 1 / n) * s3_J``, n a count)."""
    ops = ("St", "BJ", "Num", "Size", "Cnt", "In", "Add", "Sub", "Mul", "Div", "Neg",   # (BJ: a state's block)
           "Where", "CmpEq", "CmpNe", "CmpLt", "CmpLe", "CmpGt", "CmpGe", "LAnd", "LOr", "LNot")
    return (any(u.op == "St" for u in t.walk()) and all(u.op in ops for u in t.walk())
            and not any(u.op == "In" and F in tensors[u.args[0]] for u in t.walk()))


def _state_output(t: Term):
    """(state, c) when the output ``t`` is a state times constants (``s_J * 0.25``: the constant
    factored out of the sum), with c their product; else None."""
    fs = _flat_mul(t)
    st = [f for f in fs if f.op == "St"]
    c = 1.0
    for f in fs:
        if f.op == "St":
            continue
        v = f.args[0] if f.op == "Num" and not isinstance(f.args[0], Term) else None
        if v is None or not math.isfinite(float(v)):
            return None
        c *= float(v)
    return (st[0].args[0], c) if len(st) == 1 else None


def _or(a, b):
    return a if b is None else b if a is None else f"({a}) | ({b})"


def _int_literal(t: Term):
    return int(t.args[0]) if t.op == "Num" and not isinstance(t.args[0], Term) else None


