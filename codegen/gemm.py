"""The GEMM kernel family: out[m, n] = E(sum_k A[m, k] * B[n, k], per-row and per-column values),
where each operand is a *program* over its own inputs (acefuse/quant_gemm.py splits a program
into operand A, operand B and the epilogue E). One Triton template; the operands' programs are
spliced in at its hook points by the same Emitter as the row family (codegen/emit.py), so a
per-token quantization, a per-channel dequantization or any other elementwise-after-reduction
operand lowers the way the row kernel lowers it (same casts, same correctly rounded division).

Grid: one program per (BLOCK_M, BLOCK_N) output tile, in grouped order (GROUP_M row tiles share
their column tiles while they are in L2). Per tile:

- PRELOOP (one loop over k per level of the operand's reductions over k, for each operand that
  has them): the row tile's reductions (e.g. absmax over k); it reads the operand's row tile,
  which the main loop then reads once more (from L2 when the tile fits there);
- HOIST: the operand's per-row values (e.g. scale = absmax / 448), computed once per tile;
- PROLOGUE (each k step of the main loop): the operand tile from its inputs (e.g.
  cast(x / scale, float8_e4m3fn)), so the operand is never written to memory; then
  the dot: float8 operands in float8 on a GPU of compute capability >= 9.0 (both operands
  float8 and a float8 value of each is exactly representable: the dot's inputs are the
  operands' exact values) as ``acc = acc + tl.dot(a, b^T, zero_acc)``: Hopper's float8 MMA
  sums in reduced precision, so it sums one k step (BLOCK_K products) and the float32 add
  accumulates (Triton's own ``max_num_imprecise_acc=32`` failed to compile in its pipeliner
  here; its default never promotes); else ``acc = tl.dot(a, b^T, acc)`` in float32
  (``input_precision="ieee"``, Triton's interpreter included);
- EPILOGUE: E of the accumulator and the per-row (m) and per-column (n) values, stored.

Shapes seen by the Emitter (the row family's names): in an operand's frame ``row`` is
[BLOCK] (one value per row of the operand's tile), ``col`` [1, BLOCK_K], ``tile``
[BLOCK, BLOCK_K]; in the epilogue ``row`` is [BLOCK_M], ``col`` [1, BLOCK_N] and ``tile``
[BLOCK_M, BLOCK_N].
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term, pretty
from acefuse.codegen.emit import Emitter, CodegenError
from acefuse.codegen.row import HEADER

J = Term("BJ")
_RED = ("Sum", "RMax", "RMin")
_INIT = {"Sum": "0.0", "RMax": "float('-inf')", "RMin": "float('inf')"}
_BLK = {"a": "BLOCK_M", "b": "BLOCK_N"}


def is_kred(t: Term, k: str) -> bool:
    """``t`` is a reduction over the contraction axis ``k``."""
    return t.op in _RED and t.args[0].op == "Ax" and t.args[0].args[0] == k


def free_of(t: Term, axis: str, tensors: dict) -> bool:
    """``t``'s value does not vary along ``axis`` (a reduction over ``axis`` is free of it)."""
    if t.op in _RED and t.args[0].op == "Ax" and t.args[0].args[0] == axis:
        return True
    if t.op == "In":
        return axis not in tensors[t.args[0]]
    if t.op == "Idx":
        return t.args[0] != axis
    return all(free_of(c, axis, tensors) for c in t.children)


def replace(t: Term, table: dict) -> Term:
    if t in table:
        return table[t]
    if not t.children:
        return t
    return Term(t.op, tuple(replace(a, table) if isinstance(a, Term) else a for a in t.args))


def kreductions(t: Term, k: str) -> list:
    """The reductions over ``k`` inside ``t``, innermost first, each once."""
    out = []

    def walk(u):
        for c in u.children:
            walk(c)
        if is_kred(u, k) and u not in out:
            out.append(u)
    walk(t)
    return out


class _Graph:
    """What the Emitter reads from ``ctx.g``: no derived states here (ops, defs empty)."""

    def __init__(self):
        self.ops, self.defs, self.counter, self.cast_src = {}, {}, [0], {}


class Frame:
    """Names for one region of the kernel: an operand's frame (rows of the operand tile by
    k) or the epilogue's (rows by columns of the output tile). Duck-types codegen.row.Context
    for the Emitter."""

    nan_extrema = True
    tile_mask = None

    def __init__(self, gen, side, kind):
        self.g = gen.graph
        self.gen = gen
        self.side = side      # "a" | "b" | None (the epilogue)
        self.kind = kind      # "operand" | "epilogue"
        self.em = None

    # states: the placeholders of finished reductions and hoisted per-row values
    def state_var(self, q, blk, pol=None):
        return self.gen.state_shape(q, self)

    def from_reduction(self, t: Term) -> bool:
        return any(s.op in _RED or (s.op == "St" and self.gen.placeholder_from_reduction(s.args[0]))
                   for s in t.walk())

    def contract(self, t: Term, em):
        name = self.gen.reduction_var.get(t)
        if name is None:
            raise CodegenError(f"`{pretty(t)}`: a reduction over {t.args[0].args[0]!r} that no pre-loop computes "
                               "(an acefuse bug: quant_gemm.split should have listed it)")
        return self.gen.state_shape(name, self)

    def leaf(self, name):
        raise CodegenError(f"leaf {name!r} in a GEMM operand (an acefuse bug)")

    def count(self, blk):
        raise CodegenError("a count of elements of a block inside a GEMM operand (write size(axis) instead)")

    def size(self, axis):
        return f"len_{axis}_f"

    def index(self, axis):
        g = self.gen
        if self.kind == "operand":
            if axis == g.k:
                return "ks[None, :].to(tl.float32)", "col"
            if axis == g.axis[self.side]:
                return f"rows_{self.side}.to(tl.float32)", "row"
        else:
            if axis == g.axis["a"]:
                return "rows_a.to(tl.float32)", "row"
            if axis == g.axis["b"]:
                return "rows_b[None, :].to(tl.float32)", "col"
        raise CodegenError(f"index({axis!r}) in the GEMM's {self.kind} of operand {self.side}: not an axis there")

    def take(self, t: Term, em):
        raise CodegenError(f"`{pretty(t)}`: gathers are not supported in a GEMM operand; compute the "
                           "gathered tensor first")

    def load(self, name, em):
        ptr, mask, shape = self.pointer(name)
        m = f", mask={mask}, other=0.0" if mask else ""
        return em.bind(f"_widen(tl.load({ptr}{m}))", shape, "ld_")

    def pointer(self, name):
        """(pointer expression, mask or None, shape) of input ``name`` in this frame."""
        g = self.gen
        axes = g.tensors[name]
        k = g.k
        if self.kind == "operand":
            p, s = g.axis[self.side], self.side
            parts, mask = [], []
            if p in axes:
                parts.append(f"rows_{s}[:, None] * s_{name}_{p}" if k in axes else f"rows_{s} * s_{name}_{p}")
                mask.append(f"{s}mask[:, None]" if k in axes else f"{s}mask")
            if k in axes:
                parts.append(f"ks[None, :] * s_{name}_{k}")
                mask.append("kmask[None, :]")
            if len(mask) == 2:
                mask = [f"tmask_{s}"]
            shape = "tile" if len(parts) == 2 else ("col" if k in axes else ("row" if parts else "scalar"))
        else:
            parts, mask = [], []
            if g.axis["a"] in axes:
                parts.append(f"rows_a * s_{name}_{g.axis['a']}")
                mask.append("amask")
            if g.axis["b"] in axes:
                parts.append(f"rows_b[None, :] * s_{name}_{g.axis['b']}")
                mask.append("bmask[None, :]")
            if len(parts) == 2:
                raise CodegenError(f"input {name!r} spans both output axes; the epilogue takes per-row and "
                                   "per-column values only")
            shape = "row" if g.axis["a"] in axes else ("col" if parts else "scalar")
        return " + ".join([f"{name}_ptr"] + parts), (" & ".join(mask) or None), shape


class GemmGen:
    """Generates the module for one split program (acefuse.quant_gemm.Split)."""

    def __init__(self, split):
        self.s = split
        self.name = split.name
        self.k = split.k
        self.axis = {"a": split.axis_a, "b": split.axis_b}
        self.tensors = split.tensors
        self.graph = _Graph()
        self.reduction_var = {}     # reduction term -> its variable (per side)
        self.var_side = {}          # variable -> "a" | "b"
        self.placeholders = {}      # placeholder name -> the term it stands for
        self.hoisted = {}           # per-row term -> its placeholder (shared with the epilogue)

    # -- names ------------------------------------------------------------------------
    def state_shape(self, q, frame):
        side = self.var_side[q]
        if side == "acc":
            return q, "tile"
        if frame.kind == "operand":
            if side != frame.side:
                raise CodegenError(f"operand {frame.side} reads {q}, a value of operand {side} (an acefuse bug)")
            return q, "row"
        return (q, "row") if side == "a" else (f"{q}[None, :]", "col")

    def placeholder_from_reduction(self, q):
        t = self.placeholders.get(q)
        return t is not None and any(u.op in _RED for u in t.walk())

    # -- regions ----------------------------------------------------------------------
    def levels(self, reds):
        """Reductions grouped by dependence: level 0 reads no other reduction over k, level i
        reads those of lower levels (one pre-loop over k per level)."""
        lev = {}
        for r in reds:   # innermost first
            lev[r] = 1 + max((lev[u] for u in kreductions(r.args[1], self.k)), default=-1)
        out = []
        for r in reds:
            while len(out) <= lev[r]:
                out.append([])
            out[lev[r]].append(r)
        return out

    def preloop(self, side, L):
        reds = kreductions(self.s.operand[side], self.k)
        for r in kreductions(self.s.epilogue, self.k):
            if r not in reds and self.s.side_of(r) == side:
                reds.append(r)
        for r in reds:
            name = f"{side}_r{len(self.reduction_var) + 1}"
            self.reduction_var[r] = name
            self.var_side[name] = side
        for lvl, group in enumerate(self.levels(reds)):
            L.append(f"    # ---- operand {side}, pre-loop {lvl + 1}: the row tile's reductions over {self.k!r}; it reads "
                     f"the tile once, the main loop once more (from L2)")
            for r in group:
                L.append(f"    {self.reduction_var[r]} = tl.full([{_BLK[side]}], {_INIT[r.op]}, tl.float32)"
                         f"   # {pretty(r)}")
            L.append("    for k0 in range(0, K, BLOCK_K):")
            L.append("        ks = k0 + ks0")
            L.append("        kmask = ks < K")
            L.append(f"        tmask_{side} = {side}mask[:, None] & kmask[None, :]")
            em = self._emitter(side, "operand", "        ")
            for r in group:
                body, sb = em.emit(r.args[1])
                if sb == "row":
                    body = f"{body}[:, None]"
                if sb != "tile":
                    body = f"({body}) + tl.zeros([{_BLK[side]}, BLOCK_K], tl.float32)"
                v = self.reduction_var[r]
                part = f"tl.where(tmask_{side}, {body}, {_INIT[r.op]})"
                if r.op == "Sum":
                    em.line(f"{v} = {v} + tl.sum({part}, axis=1)")
                else:
                    fn = "_max_nan" if r.op == "RMax" else "_min_nan"
                    em.line(f"{v} = {fn}({v}, tl.reduce({part}, 1, {fn}))")
            L.extend(em.lines)

    def hoist(self, side, L):
        """Replace the operand's maximal per-row subterms (free of k, not a constant) by
        placeholders computed once, before the main loop."""
        table = {}
        tensors = self.tensors

        def walk(u):
            if u.op in ("Num", "Size") or u in table:
                return
            if free_of(u, self.k, tensors):
                name = f"{side}_h{len(self.placeholders) + 1}"
                self.placeholders[name] = u
                self.var_side[name] = side
                table[u] = Term("St", (name, J))
                return
            for c in u.children:
                walk(c)
        walk(self.s.operand[side])
        self.hoisted.update(table)
        if not table:
            return self.s.operand[side]
        em = self._emitter(side, "operand", "    ")
        em.comment(f"operand {side}: its per-row values, once per tile")
        for u, ph in table.items():
            e, sh = em.emit(u)
            if sh == "scalar":
                e = f"({e}) + tl.zeros([{_BLK[side]}], tl.float32)"
            em.assign(ph.args[0], e)
        L.extend(em.lines)
        return replace(self.s.operand[side], table)

    def fp8_operand(self, side, op, e, sh):
        """(expression, comment) of operand ``side``'s tile as float8 for the dot (only on a GPU,
        FP8_DOT): one conversion, not the emulation's round trip through float32. A float8
        input is loaded as it is; a cast to float8_e4m3fn converts its operand directly (the
        same rounding, saturation and NaN as the cast: codegen/row.py _rnd_e4m3); otherwise
        the float32 tile of float8 values is converted (exact)."""
        fmt = f"FMT_{side.upper()}"
        if op.op == "In" and sh == "tile":
            ptr, mask, _ = Frame(self, side, "operand").pointer(op.args[0])
            return f"tl.load({ptr}, mask={mask}, other=0.0)", f"# operand {side}: the float8 input as stored"
        src = self.graph.cast_src.get(e)
        if src is not None and src[1] == "float8_e4m3fn":
            return (f"tl.where(tmask_{side}, {src[0]}, 0.0).to(tl.float8e4nv)",
                    f"# operand {side}: its cast's operand converted once (cvt.rn.satfinite: the cast itself)")
        return f"_as_fp8(op_{side}, {fmt})", f"# operand {side}: float8 values held in float32, converted (exact)"

    def _emitter(self, side, kind, indent):
        fr = Frame(self, side, kind)
        em = Emitter(fr, indent=indent, counter=self.graph.counter)
        fr.em = em
        return em

    # -- the kernel ---------------------------------------------------------------------
    def args(self):
        """(name, kind) of the kernel's arguments, in order: tensors with their strides."""
        out = []
        for name in sorted(self.tensors):
            out.append(name + "_ptr")
            out += [f"s_{name}_{ax}" for ax in self.tensors[name]]
        return out

    def kernel(self):
        s = self.s
        L = []
        sig = ", ".join(self.args() + ["out_ptr", "s_out_m", "s_out_n", "M", "N", "K",
                                       "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr",
                                       "GROUP_M: tl.constexpr", "FMT_A: tl.constexpr", "FMT_B: tl.constexpr",
                                       "FP8_DOT: tl.constexpr", "OUT_BF16: tl.constexpr"])
        ax_a, ax_b = self.axis["a"], self.axis["b"]
        L.append("@triton.jit")
        L.append(f"def {self.name}_gemm({sig}):")
        L.append("    # out[m, n] = epilogue(sum_k A[m, k] * B[n, k]); A and B computed from their inputs per k step")
        L.append("    pid = tl.program_id(0)")
        L.append("    n_pid_m = tl.cdiv(M, BLOCK_M)")
        L.append("    n_pid_n = tl.cdiv(N, BLOCK_N)")
        L.append("    per_group = GROUP_M * n_pid_n")
        L.append("    first_m = (pid // per_group) * GROUP_M")
        L.append("    size_m = tl.minimum(n_pid_m - first_m, GROUP_M)")
        L.append("    pid_m = first_m + (pid % per_group) % size_m")
        L.append("    pid_n = (pid % per_group) // size_m")
        L.append("    rows_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        L.append("    rows_b = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        L.append("    amask = rows_a < M")
        L.append("    bmask = rows_b < N")
        L.append("    rows_a = rows_a.to(tl.int64)")
        L.append("    rows_b = rows_b.to(tl.int64)")
        L.append("    ks0 = tl.arange(0, BLOCK_K)")
        for ax, n in ((ax_a, "M"), (ax_b, "N"), (self.k, "K")):
            L.append(f"    len_{ax}_f = {n} * 1.0")
        ops = {}
        for side in ("a", "b"):
            self.preloop(side, L)
        for side in ("a", "b"):
            ops[side] = self.hoist(side, L)
        L.append(f"    # ---- main loop over {self.k!r}: each operand tile computed from its inputs (never stored)")
        L.append("    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)")
        L.append("    if FP8_DOT:")
        L.append("        # 0 at run time (K >= 0), but not a constant: the float8 dot's own starting value")
        L.append("        zero_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) + tl.where(K < 0, 1.0, 0.0)")
        f8 = {}
        L.append("    for k0 in range(0, K, BLOCK_K):")
        L.append("        ks = k0 + ks0")
        L.append("        kmask = ks < K")
        for side in ("a", "b"):
            L.append(f"        tmask_{side} = {side}mask[:, None] & kmask[None, :]")
            em = self._emitter(side, "operand", "        ")
            em.comment(f"operand {side}: {pretty(s.operand[side])}")
            e, sh = em.emit(ops[side])
            if sh == "row":
                e = f"{e}[:, None]"
            if sh != "tile":
                e = f"({e}) + tl.zeros([{_BLK[side]}, BLOCK_K], tl.float32)"
            # padding (rows past the end, k past K) contributes 0 whatever the operand's value of 0 is
            em.assign(f"op_{side}", f"tl.where(tmask_{side}, {e}, 0.0)")
            L.extend(em.lines)
            f8[side] = self.fp8_operand(side, ops[side], e, sh)
        L.append("        if FP8_DOT:")
        L.append("            # both operands are float8 values: the dot in float8, accumulating in float32")
        for side in ("a", "b"):
            L.append(f"            {f8[side][1]}")
            L.append(f"            op_{side}_f8 = {f8[side][0]}")
        L.append("            # Hopper's float8 MMA sums its products in reduced precision, and Triton's default")
        L.append("            # there never adds them to a float32 accumulator (at k = 1024 the result missed the")
        L.append("            # float32 bound on an H100). So each k step's dot starts from zero (a zero Triton")
        L.append("            # cannot fold the add into the dot with) and is added to acc in float32: at most")
        L.append("            # BLOCK_K products are summed by the MMA")
        L.append("            acc = acc + tl.dot(op_a_f8, tl.trans(op_b_f8), zero_acc)")
        L.append("        else:")
        L.append("            acc = tl.dot(op_a, tl.trans(op_b), acc, input_precision=\"ieee\")")
        L.append("    # ---- epilogue: " + pretty(s.epilogue).replace("acc_J", "acc"))
        em = self._emitter(None, "epilogue", "    ")
        self.var_side["acc"] = "acc"
        e, sh = em.emit(replace(s.epilogue, self.hoisted))   # the operands' per-row values, not recomputed
        if sh == "row":
            e = f"{e}[:, None]"
        if sh != "tile":
            e = f"({e}) + tl.zeros([BLOCK_M, BLOCK_N], tl.float32)"
        L.extend(em.lines)
        L.append(f"    res = {e}")
        L.append("    optr = out_ptr + rows_a[:, None] * s_out_m + rows_b[None, :] * s_out_n")
        L.append("    if OUT_BF16:")
        L.append("        # rounded to nearest even, stored as bits (the interpreter's conversion truncates)")
        L.append("        tl.store(optr, (_rnd_bf16(res).to(tl.int32, bitcast=True) >> 16).to(tl.int16), "
                 "mask=amask[:, None] & bmask[None, :])")
        L.append("    else:")
        L.append("        tl.store(optr, _out(res, out_ptr), mask=amask[:, None] & bmask[None, :])")
        return "\n".join(L) + "\n"

    def module(self, explain: str) -> str:
        head = HEADER.format(name=self.name, axis=self.k, explain=explain.replace('"""', "'''"))
        # PROGRAM names the program in a compile error; _TUNING is set while acefuse.quant_gemm
        # times candidates (one that does not compile is skipped there, not retried:
        # codegen/launch_retry.py, whose _safer_launch the launch in quant_gemm goes through)
        return (head + _AS_FP8 + "\n\n" + self.kernel() + f"\n\nARGS = {self.args()!r}\n"
                + f"PROGRAM = {self.name!r}\n_TUNING = []\n")


_AS_FP8 = '''

@triton.jit
def _as_fp8(v, FMT: tl.constexpr):
    # a float32 tile holding float8 values, as float8 (exact: every value is representable)
    if FMT == 1:
        return v.to(tl.float8e4nv)
    else:
        return v.to(tl.float8e5)
'''


def generate(split, explain: str) -> str:
    gen = GemmGen(split)
    return gen.module(explain)
