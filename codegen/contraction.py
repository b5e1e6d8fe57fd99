"""The contraction kernel family (attention-shaped programs), one Triton template.

Axes of the program are classified, not named:
- ``j``: the fused axis (keys); tiles of ``BLOCK_J`` are looped over.
- contraction axes ``C``: reduced inside a leaf (``sum(q * k, "d")``) -> ``tl.dot``.
- row axes ``R``: parallel axes that no j-tensor has (queries ``i``; grouped query
  heads ``r`` under GQA): flattened into the rows of a tile of ``BLOCK_I``.
- vector axis ``E``: an output axis that only j-tensors carry (``v``'s ``e``): a
  state over ``E`` is a ``[BLOCK_I, BLOCK_E]`` accumulator, and a tile reduction of
  ``p * v`` over the keys is ``tl.dot(p, v)``.
- grid axes ``G``: every other parallel axis (batch, heads): one program per value.

Hooks, as in the row family: PROLOGUE (offsets; hoisted row-side operands), INIT
(state definitions on the first key tile), ROLLING (the derived update, with a
``full`` variant for tiles the mask analysis proves fully visible and a skip for
tiles it proves fully masked), MERGE (split-KV combine), FINALIZE (outputs).

Mask analysis: a leaf ``where(cond, s, -inf)`` whose condition is built from
indices and constants is evaluated with interval arithmetic over the tile's index
box; a tile where ``cond`` is always false is skipped (when the derived updates are
checked, numerically, to leave every state unchanged on an all -inf tile), and a
tile where it is always true runs without mask arithmetic.

Sum kernels (``SumGen``, codegen/sums.py): a program whose states are all plain sums over the loop axis
and that the template above cannot classify (several contraction axes, an output over
a contraction axis) -- the stages of a derived backward such as attention's dQ
(``sum_j(dS * k)``, loop over keys) and dK/dV (loop over queries) -- gets a second,
smaller template: contractions inside the body as ``tl.dot`` (or ``tl.sum`` when both
sides are on the same side), accumulation into a vector state as ``tl.dot(tile, w,
acc)``, and the same interval mask analysis to visit only tiles a mask does not exclude.
"""
from __future__ import annotations

import math

import numpy as np

from acefuse.rewrite.terms import Term, pretty, A, B
from acefuse.codegen.emit import Emitter, CodegenError
from acefuse.codegen.row import HEADER, PREPARE, Context

AB = Term("BU", (A, B))
J = Term("BJ")


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
        self.tile_mask = None if full else "tmask"

    def join(self, a, b):
        return _cjoin(a, b)

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
                masks.append("(cols[:, None] < n_j) & emask[None, :]")
                shape = "jvec"
            else:
                ptr += f" + cols[None, :] * s_{name}_{g.axis}"
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
        if len(with_ax) != 2 or not all(f.op == "In" for f in with_ax):
            raise CodegenError(f"`{pretty(t)}`: a contraction over {ax!r} must be a product of two "
                               "input tensors (e.g. sum(q * k, 'd'))")
        a, b = with_ax
        if g.axis in g.tensors[a.args[0]]:
            a, b = b, a
        qa, ka = g.tensors[a.args[0]], g.tensors[b.args[0]]
        if g.axis in qa or g.axis not in ka or not any(x in g.R for x in qa):
            raise CodegenError(f"`{pretty(t)}`: expected one query-side tensor (over rows and {ax!r}) "
                               f"and one key-side tensor (over {g.axis!r} and {ax!r})")
        qn, kn = a.args[0], b.args[0]
        q = g.hoist(f"tl.load({qn}_ptr + off_{qn}_g + off_{qn}_r[:, None] + dcols[None, :] * s_{qn}_{ax}, "
                    f"mask=rmask[:, None] & dmask[None, :], other=0.0)", "qtile")[0]
        k, _ = em.bind(f"tl.load({kn}_ptr + off_{kn}_g + cols[:, None] * s_{kn}_{g.axis} + dcols[None, :] * "
                       f"s_{kn}_{ax}, mask=(cols[:, None] < n_j) & dmask[None, :], other=0.0)", "ktile", "kt_")
        out, sh = em.bind(f"tl.dot({q}.to(DOT_T), tl.trans({k}.to(DOT_T)), input_precision=PREC)", "tile", "dot_")
        for f in rest:
            e, s = em.emit(f)
            out, sh = em.bind(f"{out} * {em._bcast(e, s, 'tile')}", "tile")
        return out, sh

    def accumulate(self, t: Term, em):
        """``x + sum_B(p * v)`` as one ``tl.dot(p, v, acc=x)`` (the matrix unit accumulates)."""
        for i in (1, 0):
            red, other = t.args[i], t.args[1 - i]
            if red.op == "Sum" and red.args[0].op == "BB":
                pv = self.reduce_tile(red, em, acc=other)
                if pv is not None:
                    return pv
        return None

    def reduce_tile(self, t: Term, em, acc=None):
        if t.op != "Sum":
            return None
        fs = _flat_mul(t.args[1])
        vec = [f for f in fs if self.g.elm_shape(f) == "jvec"]
        if not vec:
            return None
        if len(vec) != 1:
            raise CodegenError(f"`{pretty(t)}`: a product of two key-side vectors is not a contraction")
        others = [f for f in fs if f is not vec[0]]
        p = others[0]
        for f in others[1:]:
            p = Term("Mul", (p, f))
        pe, ps = em.emit(p)
        pe = em._bcast(pe, ps, "tile")
        if self.tile_mask:
            pe, _ = em.bind(f"tl.where({self.tile_mask}, {pe}, 0.0)", "tile", "p")
        accs = ""
        if acc is not None:
            a, sa = em.emit(acc)
            if sa != "rvec":
                return None
            accs = f", acc={a}"
        leaf = self.g.leaves[vec[0].args[0]] if vec[0].op == "Elm" else None
        if leaf is not None and leaf.op == "In":
            v, _ = self.load(leaf.args[0], em, raw=True)
        else:
            v, _ = em.emit(vec[0])
        return em.bind(f"tl.dot({pe}.to(DOT_T), {v}.to(DOT_T){accs}, input_precision=PREC)", "rvec", "pv")


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


class ContractionGen:
    def __init__(self, fusion):
        self.f = fusion
        self.counter = [0]
        enc = fusion.encoding
        self.enc = enc
        self.axis = enc.axis
        self.name = fusion.program.name
        self.tensors = enc.tensors
        self.leaves = enc.leaves
        self.ops = {s.name: s.op for s in enc.states}
        self.defs = {s.name: s.definition for s in enc.states}
        self.outputs = enc.outputs
        self.out_axes = enc.output_axes
        prog = fusion.program
        j = self.axis
        C = []
        for lf in list(self.leaves.values()) + list(self.outputs.values()):
            for t in lf.walk():
                if t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax" and t.args[0].args[0] != j:
                    if t.args[0].args[0] not in C:
                        C.append(t.args[0].args[0])
        jt = [t for t, ax in self.tensors.items() if j in ax]
        par = [a for a in prog.axes if a != j and a not in C]
        R = [a for a in par if not any(a in self.tensors[t] for t in jt)]
        rtensors = [t for t, ax in self.tensors.items() if any(a in R for a in ax)]
        out_ax = {a for ax in self.out_axes.values() for a in ax}
        E = [a for a in par if a not in R and a in out_ax
             and not any(a in self.tensors[t] for t in rtensors)]
        G = [a for a in par if a not in R and a not in E]
        if not R:
            raise CodegenError(f"program {self.name!r}: every parallel axis is shared with the key-side "
                               "tensors; there are no query rows (use the row family)")
        if len(E) > 1:
            raise CodegenError(f"program {self.name!r}: at most one value axis is supported, got {E}")
        if len(C) > 1:
            raise CodegenError(f"program {self.name!r}: at most one contraction axis is supported, got {C}")
        if enc.elementwise_outputs:
            raise CodegenError(f"program {self.name!r}: outputs {list(enc.elementwise_outputs)} range over "
                               f"the key axis {j!r}; the contraction family writes per-query outputs only")
        self.C, self.R, self.E, self.G = C, R, E, G
        self.hoisting = []
        self._hoisted = {}
        self._axes_memo = {}
        self.index_tensors = []

    # -- helpers ------------------------------------------------------------------
    def axes_of(self, t: Term) -> set:
        if t in self._axes_memo:
            return self._axes_memo[t]
        if t.op == "In":
            r = set(self.tensors[t.args[0]])
        elif t.op == "Idx":
            r = {t.args[0]}
        elif t.op == "Elm":
            r = self.axes_of(self.leaves[t.args[0]])
        elif t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax":
            r = self.axes_of(t.args[1]) - {t.args[0].args[0]}
        else:
            r = set().union(*[self.axes_of(c) for c in t.children]) if t.children else set()
        self._axes_memo[t] = r
        return r

    def elm_shape(self, t: Term) -> str:
        ax = self.axes_of(t)
        has_r = any(a in self.R for a in ax)
        has_j = self.axis in ax
        has_e = any(a in self.E for a in ax)
        if has_j and has_e and not has_r:
            return "jvec"
        if has_e:
            return "rvec"
        if has_j:
            return "tile" if has_r else "col"
        return "row" if has_r else "scalar"

    def hoist(self, expr, shape):
        if expr in self._hoisted:
            return self._hoisted[expr]
        name = f"h{len(self._hoisted) + 1}"
        self.hoisting.append(f"    {name} = {expr}")
        self._hoisted[expr] = (name, shape)
        return name, shape

    def row_axes_of(self, name):
        return [a for a in self.tensors[name] if a in self.R]

    # -- mask analysis -------------------------------------------------------------
    def mask_sites(self):
        """Elm leaves of the form where(cond, s, -inf) with an index-only condition."""
        sites = []
        for name, t in self.leaves.items():
            if t.op == "Where" and t.args[2].op == "Num" and t.args[2].args[0] == -math.inf:
                if self._interval_ok(t.args[0]):
                    sites.append((name, t.args[0]))
        return sites

    # what interval() and truth() can bound: anything else keeps the mask per element (no skip)
    _INTERVAL_OPS = frozenset(("Num", "Idx", "Size", "Neg", "Add", "Sub", "Mul", "Abs", "FloorDiv",
                               "LAnd", "LOr", "LNot", "CmpLt", "CmpLe", "CmpGt", "CmpGe"))

    def _interval_ok(self, c: Term) -> bool:
        for t in c.walk():
            if t.op not in self._INTERVAL_OPS:
                return False
            if t.op == "Mul" and not any(x.op == "Num" for x in t.args):
                return False
            if t.op == "FloorDiv" and not (t.args[1].op == "Num" and float(t.args[1].args[0]) > 0):
                return False
            if t.op == "Idx" and t.args[0] not in (self.axis,) + tuple(self.R) + tuple(self.G):
                return False
        return True

    def skip_is_sound(self, p, masked: set) -> bool:
        """Numerically check that a tile whose masked leaves are all -inf leaves every state unchanged."""
        rng = np.random.default_rng(0)
        for trial in range(3):
            env_a = {s.name: float(rng.normal() * 3) for s in p.states}
            for s in p.states:
                if s.op == "sum":
                    env_a[s.name] = abs(env_a[s.name]) + 0.5
            new = {}
            nb = 5
            leaves = {n: (np.full(nb, -np.inf) if n in masked else rng.normal(size=nb)) for n in self.leaves}

            def ev(t):
                op = t.op
                if op == "St":
                    q, blk = t.args
                    if blk.op == "BA":
                        return env_a[q]
                    if blk.op == "BU":
                        return new[q]
                    if blk.op == "BJ":
                        return 1.0
                    raise KeyError
                if op == "Num":
                    return t.args[0]
                if op == "Cnt":
                    return {"BA": 7.0, "BB": float(nb), "BU": 7.0 + nb}.get(t.args[0].op, 1.0)
                if op == "Elm":
                    return leaves[t.args[0]]
                if op == "Par":
                    return 1.3
                if op in ("Sum", "RMax", "RMin"):
                    v = np.broadcast_to(ev(t.args[1]), (nb,))
                    return {"Sum": np.sum, "RMax": np.max, "RMin": np.min}[op](v)
                a = [ev(c) for c in t.children]
                with np.errstate(all="ignore"):
                    fin = [np.where(np.isinf(x), 0.0, x) if c.op == "St" else x for x, c in zip(a, t.children)]
                    f = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
                         "Div": lambda x, y: x / y, "Neg": lambda x: -x, "Exp": np.exp, "Log": np.log,
                         "Max2": np.maximum, "Min2": np.minimum, "Abs": np.abs, "Tanh": np.tanh,
                         "Sqrt": np.sqrt, "Rsqrt": lambda x: 1 / np.sqrt(x)}.get(op)
                    if f is None:
                        raise KeyError(op)
                    if op in ("Max2", "Min2"):
                        return f(*a)
                    return f(*fin)
            try:
                for s in p.states:
                    new[s.name] = float(ev(p.rolling[s.name]))
            except (KeyError, TypeError, ValueError):
                return False
            for s in p.states:
                if not np.isclose(new[s.name], env_a[s.name], rtol=1e-12, atol=0):
                    return False
        return True

    def interval(self, t: Term, L: list):
        """(lo, hi) scalar expressions of an index expression over the tile's index box."""
        op = t.op
        if op == "Num":
            v = repr(float(t.args[0]))
            return v, v
        if op == "Idx":
            a = t.args[0]
            if a == self.axis:
                return "j_lo", "j_hi"
            if a in self.R:
                return f"{a}_lo", f"{a}_hi"
            return f"(idx_{a} * 1.0)", f"(idx_{a} * 1.0)"
        if op == "Size":
            v = "nj_f" if t.args[0] == self.axis else f"(len_{t.args[0]} * 1.0)"
            return v, v
        if op == "Neg":
            lo, hi = self.interval(t.args[0], L)
            return f"(-{hi})", f"(-{lo})"
        if op in ("Add", "Sub"):
            (al, ah), (bl, bh) = self.interval(t.args[0], L), self.interval(t.args[1], L)
            if op == "Add":
                return f"({al} + {bl})", f"({ah} + {bh})"
            return f"({al} - {bh})", f"({ah} - {bl})"
        if op == "Mul":
            (al, ah), (bl, bh) = self.interval(t.args[0], L), self.interval(t.args[1], L)
            n = len(L)
            L.append(f"iv{n}a = {al} * {bl}")
            L.append(f"iv{n}b = {al} * {bh}")
            L.append(f"iv{n}c = {ah} * {bl}")
            L.append(f"iv{n}d = {ah} * {bh}")
            return (f"tl.minimum(tl.minimum(iv{n}a, iv{n}b), tl.minimum(iv{n}c, iv{n}d))",
                    f"tl.maximum(tl.maximum(iv{n}a, iv{n}b), tl.maximum(iv{n}c, iv{n}d))")
        if op == "Abs":
            lo, hi = self.interval(t.args[0], L)
            return (f"tl.where({lo} >= 0, {lo}, tl.where({hi} <= 0, -{hi}, 0.0))",
                    f"tl.maximum(tl.abs({lo}), tl.abs({hi}))")
        if op == "FloorDiv":   # by a positive constant: monotone (exact for indices below 2**24)
            lo, hi = self.interval(t.args[0], L)
            c = repr(float(t.args[1].args[0]))
            return f"tl.floor({lo} / {c})", f"tl.floor({hi} / {c})"
        raise CodegenError(f"interval of {op}")

    def truth(self, c: Term, L: list):
        """(always_true, always_false) scalar booleans of a condition over the tile box."""
        op = c.op
        if op in ("LAnd", "LOr"):
            (at, af), (bt, bf) = self.truth(c.args[0], L), self.truth(c.args[1], L)
            if op == "LAnd":
                return f"({at} & {bt})", f"({af} | {bf})"
            return f"({at} | {bt})", f"({af} & {bf})"
        if op == "LNot":
            t_, f_ = self.truth(c.args[0], L)
            return f_, t_
        if op in ("CmpLt", "CmpLe", "CmpGt", "CmpGe"):
            a, b = c.args
            if op in ("CmpGt", "CmpGe"):
                a, b = b, a
            (al, ah), (bl, bh) = self.interval(a, L), self.interval(b, L)
            if op in ("CmpLt", "CmpGt"):
                return f"({ah} < {bl})", f"({al} >= {bh})"
            return f"({ah} <= {bl})", f"({al} > {bh})"
        raise CodegenError(f"mask condition with {op}")

    # -- kernel text ----------------------------------------------------------------
    def sig(self):
        args = []
        for t, axes in self.tensors.items():
            args.append(f"{t}_ptr")
            args += [f"s_{t}_{a}" for a in axes]
        for o, axes in self.out_axes.items():
            args.append(f"{o}_ptr")
            args += [f"s_{o}_{a}" for a in axes]
        args += [f"len_{a}" for a in self.G + self.R + self.E + self.C]
        args += ["n_rows", "n_j"]
        return args

    def prologue(self, L):
        # row tiles in reverse: with lower-triangular masks the last rows see the most keys,
        # and starting the longest programs first shortens the tail
        L.append("    pid_r = tl.num_programs(0) - 1 - tl.program_id(0)")
        L.append("    pid_g = tl.program_id(1)")
        L.append("    rows = pid_r * BLOCK_I + tl.arange(0, BLOCK_I)")
        L.append("    rmask = rows < n_rows")
        L.append("    rem = rows.to(tl.int64)")
        for a in reversed(self.R):
            L.append(f"    idx_{a} = rem % len_{a}")
            L.append(f"    rem = rem // len_{a}")
        L.append("    gem = pid_g.to(tl.int64)")
        for a in reversed(self.G):
            L.append(f"    idx_{a} = gem % len_{a}")
            L.append(f"    gem = gem // len_{a}")
        for a in self.R:
            L.append(f"    {a}_lo = tl.min(tl.where(rmask, idx_{a}, 2**31), axis=0) * 1.0")
            L.append(f"    {a}_hi = tl.max(tl.where(rmask, idx_{a}, -1), axis=0) * 1.0")
        L.append("    nj_f = n_j * 1.0")
        for a in self.G + self.R + self.E + self.C:
            L.append(f"    len_{a}_f = len_{a} * 1.0")
        for t in list(self.tensors) + list(self.outputs):
            axes = self.tensors.get(t) or self.out_axes[t]
            g = [a for a in axes if a in self.G]
            r = [a for a in axes if a in self.R]
            L.append(f"    off_{t}_g = " + (" + ".join(f"idx_{a} * s_{t}_{a}" for a in g) if g else "0"))
            if r:
                L.append(f"    off_{t}_r = " + " + ".join(f"idx_{a} * s_{t}_{a}" for a in r))
        L.append("    cols0 = tl.arange(0, BLOCK_J)")
        L.append("    ecols = tl.arange(0, BLOCK_E)")
        L.append(f"    emask = ecols < {'len_' + self.E[0] if self.E else 1}")
        L.append("    dcols = tl.arange(0, BLOCK_D)")
        L.append(f"    dmask = dcols < {'len_' + self.C[0] if self.C else 1}")

    def region(self, mode, ind, full=False, subst=None):
        ctx = CContext(self, mode, full=full)
        em = Emitter(ctx, indent=ind)
        ctx.em = em
        if subst:
            ctx.leaf = lambda name, s=subst: s.get(name, self.leaves[name])
        return ctx, em

    def state_shape_fix(self, e, sh):
        if sh in ("row", "rvec"):
            return e
        if sh == "scalar":
            return f"({e}) + tl.zeros([BLOCK_I], tl.float32)"
        raise CodegenError(f"a state came out with shape {sh}")

    def emit_states(self, forms, em, L, ind, suffix, comment):
        for s in self.p.states:
            em.comment(comment(s))
            e, sh = em.emit(forms[s.name])
            em.assign(s.name + suffix, self.state_shape_fix(e, sh))
        L.extend(em.lines)
        em.lines.clear()

    def uses_counts(self) -> bool:
        p = self.p
        forms = list(p.rolling.values()) + list(p.merge.values()) + list(p.init.values())
        return any(t.op == "Cnt" for f in forms for t in f.walk())

    def tile_setup(self, L, start, ind, limit="n_j"):
        L.append(f"{ind}cols = {start} + cols0")
        L.append(f"{ind}tmask = rmask[:, None] & (cols[None, :] < {limit})")
        if self.uses_counts():
            L.append(f"{ind}n_b = tl.sum(((cols < {limit})).to(tl.float32), axis=0)")

    def key_loop(self, L, lo, hi):
        """Peel the first visible key tile (the states' definitions), then three loops:
        masked tiles, tiles proven fully visible (no mask arithmetic), masked tiles.
        Loads sit at the top level of each loop so the pipeliner can prefetch them."""
        p = self.p
        chain = self.f.rule_chain
        comment = lambda s: (f"{s.name}_AB = {pretty(p.rolling[s.name])}\n  derived by: "
                             f"{' -> '.join(chain(s.name, 'rolling')) or 'definition'}")
        sites = self.mask_sites()
        ind = "    "
        if not sites:
            L.append(f"{ind}# no mask: every tile but a partial last one is fully visible")
            L.append(f"{ind}first = {lo}")
            L.append(f"{ind}end = {hi}")
            L.append(f"{ind}f_lo = first")
            L.append(f"{ind}f_hi = first + (({hi}) - first) // BLOCK_J * BLOCK_J")
        else:
            skip_ok = self.skip_is_sound(p, {n for n, _ in sites})
            L.append(f"{ind}# mask analysis: interval arithmetic over each key tile's index box finds the")
            L.append(f"{ind}# tiles the mask excludes entirely (skipped{'' if skip_ok else ': not sound here, none'}) "
                     "and the first run of tiles it includes entirely")
            L.append(f"{ind}BIG = 2147483647")
            L.append(f"{ind}first = 0 * ({hi}) + BIG")
            L.append(f"{ind}end = 0 * ({hi}) + ({lo})")
            L.append(f"{ind}f_lo = 0 * ({hi}) + BIG")
            L.append(f"{ind}f_hi = 0 * ({hi}) + ({hi})")
            L.append(f"{ind}for t0 in range({lo}, {hi}, SCAN * BLOCK_J):  # all tiles at once, SCAN per step")
            L.append(f"{ind}    start = t0 + tl.arange(0, SCAN) * BLOCK_J")
            L.append(f"{ind}    valid = start < {hi}")
            L.append(f"{ind}    j_lo = start * 1.0")
            L.append(f"{ind}    j_hi = (tl.minimum(start + BLOCK_J, {hi}) - 1) * 1.0")
            ivl: list = []
            trues, falses = [], []
            for _, cond in sites:
                t_, f_ = self.truth(cond, ivl)
                trues.append(t_)
                falses.append(f_)
            L.extend(f"{ind}    {x}" for x in ivl)
            L.append(f"{ind}    full = {' & '.join(trues)} & (start + BLOCK_J <= {hi}) & valid")
            L.append(f"{ind}    seen = " + (f"(~({' | '.join(falses)})) & valid" if skip_ok else "valid"))
            L.append(f"{ind}    first = tl.minimum(first, tl.min(tl.where(seen, start, BIG), axis=0))")
            L.append(f"{ind}    end = tl.maximum(end, tl.max(tl.where(seen, tl.minimum(start + BLOCK_J, {hi}), 0), axis=0))")
            L.append(f"{ind}    c_lo = tl.min(tl.where(full, start, BIG), axis=0)")
            L.append(f"{ind}    c_hi = tl.min(tl.where(valid & (~full) & (start > c_lo), start, "
                     f"tl.minimum(t0 + SCAN * BLOCK_J, {hi})), axis=0)")
            L.append(f"{ind}    take = (f_lo == BIG) & (c_lo < BIG)")
            L.append(f"{ind}    f_hi = tl.where(take, c_hi, f_hi)")
            L.append(f"{ind}    f_lo = tl.where(take, c_lo, f_lo)")
            L.append(f"{ind}# a row tile that sees no key still runs one (masked) tile: its states are empty")
            L.append(f"{ind}first = tl.where(first == BIG, {lo}, first)")
            L.append(f"{ind}end = tl.maximum(end, tl.minimum(first + BLOCK_J, {hi}))")
            L.append(f"{ind}f_lo = tl.minimum(f_lo, end)")
        L.append(f"{ind}a = tl.minimum(tl.maximum(f_lo, first + BLOCK_J), end)")
        L.append(f"{ind}b = tl.minimum(tl.maximum(f_hi, a), end)")
        # peel: the first tile computes the states from their definitions
        self.tile_setup(L, "first", ind, "end")
        ctx, em = self.region("init", ind)
        self.emit_states(p.init, em, L, ind, "",
                         lambda s: f"{s.name}: its definition on the first tile:  {pretty(p.init[s.name])}")
        if self.uses_counts():
            L.append(f"{ind}n_a = n_b")
        subst = {n: self.leaves[n].args[1] for n, _ in sites}
        for lo_, hi_, full, what in (("first + BLOCK_J", "a", False, "masked"), ("a", "b", True, "fully visible"),
                                     ("b", "end", False, "masked")):
            L.append(f"{ind}for start in range({lo_}, {hi_}, BLOCK_J):  # {what} tiles")
            self.tile_setup(L, "start", ind + "    ", "end")
            ctx, em = self.region("roll", ind + "    ", full=full, subst=subst if full else None)
            self.emit_states(p.rolling, em, L, ind + "    ", "_new", comment)
            for s_ in p.states:
                L.append(f"{ind}    {s_.name} = {s_.name}_new")
            if self.uses_counts():
                L.append(f"{ind}    n_a = n_a + n_b")

    def store_outputs(self, L, ind="    "):
        ctx, em = self.region("final", ind)
        for o, t in self.outputs.items():
            em.comment(f"output {o} = {pretty(t)}")
            e, sh = em.emit(t, raw_state=True)
            axes = self.out_axes[o]
            r = any(a in self.R for a in axes)
            if self.E and self.E[0] in axes:
                if sh != "rvec":
                    e = f"({em._bcast(e, sh, 'rvec')}) + tl.zeros([BLOCK_I, BLOCK_E], tl.float32)"
                ptr = f"{o}_ptr + off_{o}_g + off_{o}_r[:, None] + ecols[None, :] * s_{o}_{self.E[0]}"
                em.line(f"tl.store({ptr}, ({e}).to({o}_ptr.dtype.element_ty), mask=rmask[:, None] & emask[None, :])")
            else:
                if sh != "row":
                    e = f"({e}) + tl.zeros([BLOCK_I], tl.float32)"
                ptr = f"{o}_ptr + off_{o}_g" + (f" + off_{o}_r" if r else "")
                em.line(f"tl.store({ptr}, ({e}).to({o}_ptr.dtype.element_ty), mask=rmask)")
        L.extend(em.lines)

    def kernel_loop(self):
        self.p = self.f.passes[0]
        L = ["@triton.jit",
             f"def {self.name}_attn({', '.join(self.sig())}, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, "
             "BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, DOT_T: tl.constexpr, SCAN: tl.constexpr):",
             "    # grid: (query row tiles, grid axes); loop over key tiles carrying the derived state"]
        self.prologue(L)
        body = []
        self.key_loop(body, "0", "n_j")
        self.store_outputs(body)
        return "\n".join(L + self.hoisting + body)

    def kernel_split(self):
        self.p = p = self.f.passes[0]
        names = [s.name for s in p.states]
        ws = [f"ws_{q}" for q in names]
        self.hoisting = []
        self._hoisted = {}
        L = ["@triton.jit",
             f"def {self.name}_part({', '.join(self.sig())}, {', '.join(ws)}, CHUNK, n_grid, "
             "BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, "
             "PREC: tl.constexpr, DOT_T: tl.constexpr, SCAN: tl.constexpr):",
             "    # split-KV: one chunk of keys per program along grid axis 2; partial states to a workspace"]
        self.prologue(L)
        body = ["    sid = tl.program_id(2)", "    chunk_lo = sid * CHUNK", "    chunk_hi = tl.minimum(chunk_lo + CHUNK, n_j)"]
        self.key_loop(body, "chunk_lo", "chunk_hi")
        body.append("    base = (sid * n_grid + pid_g) * n_rows")
        for s in p.states:
            if self._is_vec(s):
                body.append(f"    tl.store(ws_{s.name} + (base + rows)[:, None] * BLOCK_E + ecols[None, :], "
                            f"{s.name}, mask=rmask[:, None])")
            else:
                body.append(f"    tl.store(ws_{s.name} + base + rows, {s.name}, mask=rmask)")
        part = "\n".join(L + self.hoisting + body)

        self.hoisting = []
        self._hoisted = {}
        L = ["@triton.jit",
             f"def {self.name}_combine({', '.join(self.sig())}, {', '.join(ws)}, CHUNK, NSPLIT, n_grid, "
             "BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, "
             "PREC: tl.constexpr, DOT_T: tl.constexpr, SCAN: tl.constexpr):",
             "    # fold the partial states of every key chunk with the derived merge"]
        self.prologue(L)
        body = []

        def ld(s, sid, suffix):
            base = f"(({sid}) * n_grid + pid_g) * n_rows"
            if self._is_vec(s):
                return (f"    {s.name}{suffix} = tl.load(ws_{s.name} + ({base} + rows)[:, None] * BLOCK_E + "
                        f"ecols[None, :], mask=rmask[:, None], other=0.0)")
            return f"    {s.name}{suffix} = tl.load(ws_{s.name} + {base} + rows, mask=rmask, other=0.0)"
        for s in p.states:
            body.append(ld(s, "0", ""))
        body.append("    n_a = tl.minimum(CHUNK, n_j) * 1.0")
        body.append("    for sid in range(1, NSPLIT):")
        for s in p.states:
            body.append("    " + ld(s, "sid", "_b"))
        body.append("        n_b = (tl.minimum(sid * CHUNK + CHUNK, n_j) - sid * CHUNK) * 1.0")
        chain = self.f.rule_chain
        ctx, em = self.region("merge", "        ")
        self.emit_states(p.merge, em, body, "        ", "_new",
                         lambda s: f"{s.name}_AB = {pretty(p.merge[s.name])}\n  derived by: "
                                   f"{' -> '.join(chain(s.name, 'merge')) or 'definition'}")
        for s in p.states:
            body.append(f"        {s.name} = {s.name}_new")
        body.append("        n_a = n_a + n_b")
        self.store_outputs(body)
        comb = "\n".join(L + self.hoisting + body)
        return part, comb

    def _is_vec(self, s):
        return bool(self.E) and self.E[0] in self.axes_of(s.source)

    def vec_state(self, name):
        return self._is_vec(self.enc.state(name))

    def module(self) -> str:
        f = self.f
        if len(f.passes) != 1:
            raise CodegenError(f"program {self.name!r} needs {len(f.passes)} passes over {self.axis!r}; the "
                               f"contraction family emits one-pass kernels only ({f.reason})")
        parts = [HEADER.format(name=self.name, axis=self.axis, explain=f.explain().replace('"""', "'''"))]
        parts.append(self.kernel_loop())
        split = f.passes[0].split_ok
        if split:
            parts.extend(self.kernel_split())
        parts.append(self.launcher(split))
        return "\n\n\n".join(parts) + "\n"

    def launcher(self, split):
        p = self.f.passes[0]
        vec = {s.name: self._is_vec(s) for s in p.states}
        L = [
            f"PROGRAM = {self.name!r}",
            f"AXIS = {self.axis!r}",
            f"TENSORS = {dict(self.tensors)!r}",
            "INDEX_TENSORS = []",
            f"OUTPUTS = {dict(self.out_axes)!r}",
            f"GRID_AXES = {self.G!r}",
            f"ROW_AXES = {self.R!r}",
            f"VEC_AXES = {self.E!r}",
            f"CONTRACT_AXES = {self.C!r}",
            f"SPLIT = {split!r}",
            f"STATES = {vec!r}   # state -> carries the value axis",
            "",
            "",
            "def _np2(n):",
            "    return 1 << max(0, (int(n) - 1).bit_length())",
            "",
            "",
            PREPARE.format(name=self.name),
            "",
            "",
            "def choose_schedule(n_row_tiles, n_g, n_j, block_j, sms):",
            "    \"\"\"Split the keys when the (row tile x grid) programs cannot fill the device.\"\"\"",
            "    if SPLIT and n_row_tiles * n_g < sms and n_j > 4 * block_j:",
            "        return 'split'",
            "    return 'loop'",
            "",
            "",
            "_TUNED = {}",
            "_TUNING = []",
            "# tile shapes tried on the first GPU call per shape (bf16/fp16, head dims up to 128)",
            "CANDIDATES = [dict(), dict(block_i=64, block_j=64, num_warps=4, num_stages=3),",
            "              dict(block_i=64, block_j=32, num_warps=4, num_stages=3)]",
            "",
            "",
            "def _tuned(inputs, schedule):",
            "    \"\"\"Time the candidate tile shapes once per input shapes and dtype; keep the fastest.\"\"\"",
            "    key = (tuple((t, tuple(inputs[t].shape)) for t in TENSORS), str(next(iter(inputs.values())).dtype), schedule)",
            "    if key not in _TUNED:",
            "        _TUNING.append(1)",
            "        try:",
            "            times = []",
            "            for cfg in CANDIDATES:",
            "                run(schedule=schedule, **cfg, **inputs)",
            "                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)",
            "                start.record()",
            "                for _ in range(5):",
            "                    run(schedule=schedule, **cfg, **inputs)",
            "                end.record()",
            "                end.synchronize()",
            "                times.append(start.elapsed_time(end))",
            "            _TUNED[key] = CANDIDATES[times.index(min(times))]",
            "        finally:",
            "            _TUNING.pop()",
            "    return _TUNED[key]",
            "",
            "",
            "def run(*args, schedule=None, block_i=None, block_j=None, nsplit=None, num_warps=None, num_stages=None,",
            "        out_dtypes=None, **inputs):",
            "    \"\"\"Launch the kernel(s); returns the output (a dict when there are several). On the GPU,",
            "    with no tile shape given, the first call per shape times a few and keeps the fastest.\"\"\"",
            "    inputs, sizes, ref, dev = _prepare(args, inputs)",
            "    n_work = 1",
            "    for a in set(ROW_AXES + GRID_AXES + [AXIS]):",
            "        n_work *= sizes[a]",
            "    # only problems big enough for a timing to mean something (launch overhead dominates below)",
            "    if (dev.type == 'cuda' and not _TUNING and schedule != 'split' and nsplit is None and n_work >= 1 << 26",
            "            and block_i is None and block_j is None and num_warps is None and num_stages is None",
            "            and ref.dtype != torch.float32",
            "            and max([inputs[t].shape[TENSORS[t].index(a)] for t in TENSORS for a in VEC_AXES + CONTRACT_AXES",
            "                     if a in TENSORS[t]] or [0]) <= 128):",
            "        cfg = _tuned(inputs, schedule)",
            "        if cfg:",
            "            return run(schedule=schedule, out_dtypes=out_dtypes, **cfg, **inputs)",
            "    odt = ref.dtype",
            "    n_rows = 1",
            "    for a in ROW_AXES:",
            "        n_rows *= sizes[a]",
            "    n_g = 1",
            "    for a in GRID_AXES:",
            "        n_g *= sizes[a]",
            "    n_j = sizes[AXIS]",
            "    # out_dtypes: {output: dtype} written in another type (autograd's float32 saved values)",
            "    outs = {o: torch.empty([sizes[a] for a in ax], device=dev, dtype=(out_dtypes or {}).get(o, odt))",
            "            for o, ax in OUTPUTS.items()}",
            "    argv = []",
            "    for t in TENSORS:",
            "        argv.append(inputs[t])",
            "        argv.extend(inputs[t].stride())",
            "    for o in OUTPUTS:",
            "        argv.append(outs[o])",
            "        argv.extend(outs[o].stride())",
            "    argv.extend(sizes[a] for a in GRID_AXES + ROW_AXES + VEC_AXES + CONTRACT_AXES)",
            "    argv.extend([n_rows, n_j])",
            "    on_gpu = dev.type == 'cuda'",
            "    be = max(16, _np2(sizes[VEC_AXES[0]])) if VEC_AXES else 16",
            "    bd = max(16, _np2(sizes[CONTRACT_AXES[0]])) if CONTRACT_AXES else 16",
            "    if on_gpu:",
            "        big = max(bd, be) > 128   # head dims over 128: smaller tiles fit shared memory",
            "        wide = ref.dtype == torch.float32",
            "        bi = block_i or max(16, min(32 if (big and wide) else 64 if (big or wide) else 128, _np2(n_rows)))",
            "        bj = block_j or (32 if (big or wide) else 64 if max(bd, be) > 64 else 128)",
            "        nw = num_warps or (8 if bi >= 128 else 4)",
            "        ns = num_stages or (1 if (big and wide) else 2 if (big or wide) else 3)",
            "        sms = torch.cuda.get_device_properties(dev).multi_processor_count",
            "    else:",
            "        bi = block_i or max(16, min(32, _np2(n_rows)))",
            "        bj = block_j or 16",
            "        nw, ns, sms = 4, 1, 4",
            "    prec = 'ieee' if ref.dtype == torch.float32 else 'tf32'",
            "    rt = triton.cdiv(n_rows, bi)",
            "    schedule = schedule or choose_schedule(rt, n_g, n_j, bj, sms)",
            "    # dot operands in the input's type on the GPU; float32 in the interpreter, whose bf16 dot is wrong",
            "    dot_t = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(ref.dtype, tl.float32) if on_gpu else tl.float32",
            "    scan = max(16, min(256, _np2(triton.cdiv(n_j, bj))))",
            "    kw = dict(BLOCK_I=bi, BLOCK_J=bj, BLOCK_E=be, BLOCK_D=bd, PREC=prec, DOT_T=dot_t, SCAN=scan, num_warps=nw)",
            "    if on_gpu:",
            "        kw['num_stages'] = ns",
            "    if schedule == 'loop':",
            f"        {self.name}_attn[(rt, n_g)](*argv, **kw)",
            "    elif schedule == 'split':",
            "        if not SPLIT:",
            f"            raise ValueError(\"program {self.name!r} has no split schedule (a state without a derived merge)\")",
            "        nsp = nsplit or max(1, min(triton.cdiv(n_j, bj), triton.cdiv(2 * sms, rt * n_g)))",
            "        chunk = triton.cdiv(triton.cdiv(n_j, nsp), bj) * bj",
            "        nsp = triton.cdiv(n_j, chunk)",
            "        ws = [torch.empty(nsp * n_g * n_rows * (be if v else 1), device=dev, dtype=torch.float32) for v in STATES.values()]",
            f"        {self.name}_part[(rt, n_g, nsp)](*argv, *ws, chunk, n_g, **kw)",
            "        kw.pop('num_stages', None)",
            f"        {self.name}_combine[(rt, n_g)](*argv, *ws, chunk, nsp, n_g, **kw)",
            "    else:",
            "        raise ValueError(f\"unknown schedule {schedule!r}; use 'loop' or 'split'\")",
            "    return outs[next(iter(OUTPUTS))] if len(OUTPUTS) == 1 else outs",
        ]
        return "\n".join(L)


def generate(fusion) -> str:
    """The contraction family's kernel; programs whose states are plain sums over the loop
    axis and that the attention-shaped template cannot classify (several contraction axes,
    an output over a contraction axis: derived backward stages) get the sum kernel."""
    try:
        gen = ContractionGen(fusion)
    except CodegenError:
        from acefuse.codegen.sums import SumGen, sum_pass
        if not sum_pass(fusion):
            raise
        return SumGen(fusion).module()
    return gen.module()


def is_contraction(fusion) -> bool:
    """The program reduces over another axis inside the leaves (a dot product)."""
    j = fusion.encoding.axis
    for lf in fusion.encoding.leaves.values():
        for t in lf.walk():
            if t.op == "Sum" and t.args[0].op == "Ax" and t.args[0].args[0] != j:
                return True
    return False
