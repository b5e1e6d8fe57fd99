"""The contraction kernel family (attention-shaped programs), one Triton template.

Axes of the program are classified, not named (``classify``):
- ``j``: the fused axis (keys); tiles of ``BLOCK_J`` are looped over.
- contraction axes ``C``: reduced inside a leaf (``sum(q * k, "d")``) -> ``tl.dot``; a
  score may add several (MLA: ``sum(q * k, "d") + sum(qr * kr, "c")``).
- row axes ``R``: parallel axes that no key-side operand (``k``, ``v``: tensors over
  ``j`` and a contraction or value axis) has (queries ``i``; grouped query heads ``r``
  under GQA): flattened into the rows of a tile of ``BLOCK_I``. Tensors over rows and
  keys (a bias or boolean mask ``b h i j``) are read as ``[BLOCK_I, BLOCK_J]`` tiles.
- vector axis ``E``: an output axis that only tensors over ``j`` carry (``v``'s ``e``): a
  state over ``E`` is a ``[BLOCK_I, BLOCK_E]`` accumulator, and a tile reduction of
  ``p * v`` over the keys is ``tl.dot(p, v)`` (with or without a softmax around it; a
  plain key sum ``sum_j(v)`` is the same dot with weights 1).
- grid axes ``G``: every other parallel axis (batch, heads): one program per value.
- lookup axes ``L``: axes read only through ``af.take`` / ``x.at(...)`` (document ids
  along positions, a page table's pages, the page pool): only their lengths are passed.

Hooks, as in the row family: PROLOGUE (offsets; hoisted row-side operands), INIT
(state definitions on the first key tile; where the derived rolling update started from an
empty block's states is that definition, ``empty_start``, the states start empty and no tile
is peeled), ROLLING (the derived update, with a
``full`` variant for tiles the mask analysis proves fully visible and a skip for
tiles it proves fully masked), MERGE (split-KV combine), FINALIZE (outputs).

Mask analysis (codegen/masks.py): interval arithmetic over each tile's index box on
the conditions of ``where(cond, s, -inf)`` leaves; tiles where ``cond`` is always false
are skipped, tiles where it is always true run without mask arithmetic. Values and the
term lowering live in codegen/contraction_ctx.py, the host launcher in
codegen/contraction_launch.py.

Two variants of the loop kernel, from the same derived expressions (the emitter writes the
math of both; only memory movement differs): ``{name}_attn``, portable (pointer loads; the
interpreter, GPUs before Hopper, the split-KV schedule), and ``{name}_attn_hopper``, whose
query, key and value tiles are copied by TMA tensor descriptors made in the prologue
(``tl.make_tensor_descriptor``: zeros past the ends, so no load is masked) and whose fully
visible loop is a ``tl.range`` pipelined over ``num_stages`` (warp-specialized on request).
The launcher picks the Hopper kernel on devices of capability 9.0+ for 16-bit inputs laid
out for TMA (``hopper_ok``), and times its own tile candidates. In both, a positive scale
of the score leaves the key max (``CContext.canon``): the score tile is multiplied once.

Split-KV (programs that cannot fill the device: decode), from the derived merge, in two
forms: ``{name}_part`` (partial states of one chunk of keys per program, to a workspace) then
``{name}_combine`` (the merge over the chunks, the outputs), two launches; or
``{name}_split1`` (and its TMA variant ``{name}_split1_hopper``), one launch: each program
stores its chunk's partial states and takes a ticket on its row tile's counter, and the last
to arrive folds the chunks with the same merge code in the same order (no program waits).

Sum kernels (``SumGen``, codegen/sums.py): a program whose states are all plain sums over the loop axis
and that the template above cannot classify (an output over a contraction axis) -- the
stages of a derived backward such as attention's dQ (``sum_j(dS * k)``, loop over keys)
and dK/dV (loop over queries) -- gets a second, smaller template: contractions inside the
body as ``tl.dot`` (or ``tl.sum`` when both sides are on the same side), accumulation into a
vector state as ``tl.dot(tile, w, acc)``, and the same interval mask analysis to visit only
tiles a mask does not exclude.
"""
from __future__ import annotations

from acefuse.rewrite.terms import Term, pretty, A, B, is_integer
from acefuse.codegen.emit import Emitter, CodegenError
from acefuse.codegen.row import HEADER, emit_output
from acefuse.codegen.masks import MaskAnalysis
from acefuse.codegen.contraction_ctx import CContext, _cjoin, _flat_mul
from acefuse.codegen import contraction_launch

# the tanh of the family's kernels (CContext.tanh): the hardware's where the scores feed 16-bit
# matmuls on a GPU, the accurate _tanh elsewhere (README, numerics)
TANH_MM = '''@triton.jit
def _tanh_mm(a, K: tl.constexpr, C: tl.constexpr, R: tl.constexpr, T: tl.constexpr):
    # tanh((a * K) / C). On the GPU (NATIVE) with 16-bit matmul operands T: tanh.approx.f32 of
    # a * R (R = K / C rounded; one MUFU op, relative error about 2^-11 by the PTX ISA), for scores
    # that make a 16-bit P tile; otherwise the product, a correctly rounded division and _tanh
    if NATIVE and ((T == tl.bfloat16) or (T == tl.float16)):
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [a * R], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        x = a
        if K != 1.0:
            x = x * K
        if C != 1.0:
            x = tl.div_rn(x, C)
        return _tanh(x)'''

AB = Term("BU", (A, B))
J = Term("BJ")


def _takes(terms):
    return [u for t in terms for u in t.walk() if u.op == "Take"]


def classify(prog, tensors, terms, out_axes, j, C):
    """(R, E, G, L): the row, value, grid and lookup axes of an attention-shaped program
    whose key axis is ``j`` and contraction axes ``C`` (module docstring). Lookup axes are
    the gathered axes of ``af.take`` that no tensor is read along directly; the others are
    seen through *views*: each directly read tensor's axes, and each gathered tensor's axes
    without the gathered one. Key views are the views over ``j`` that carry a contraction
    or value axis (``k``, ``v``); rows are the parallel axes no key view has (queries),
    so a tensor over queries and keys (a bias ``b h i j``) is neither a key nor a reason
    to lose the rows. A value axis is an output axis that only views over ``j`` have; when
    several are, the last is the value axis and the others are rows."""
    direct = {u.args[0] for t in terms for u in t.walk() if u.op == "In"}
    takes = _takes(terms)
    views = [tuple(tensors[n]) for n in tensors if n in direct]

    def axes(u):   # the axes a term ranges over (program level)
        if u.op == "In":
            return set(tensors[u.args[0]])
        if u.op == "Idx":
            return {u.args[0]}
        if u.op == "Take":
            return (set(tensors[u.args[0]]) - {u.args[2]}) | axes(u.args[1])
        if u.op in ("Sum", "RMax", "RMin") and u.args[0].op == "Ax":
            return axes(u.args[1]) - {u.args[0].args[0]}
        return set().union(*[axes(c) for c in u.children]) if u.children else set()
    views += [tuple(a for a in tensors[t.args[0]] if a != t.args[2]) + tuple(sorted(axes(t.args[1])))
              for t in takes]
    seen = {a for v in views for a in v} | {a for ax in out_axes.values() for a in ax}
    Lk = [a for a in prog.axes if a not in seen]
    par = [a for a in prog.axes if a != j and a not in C and a not in Lk]
    out_ax = {a for ax in out_axes.values() for a in ax}
    jv = [v for v in views if j in v]
    cand = [a for a in par if a in out_ax and not any(a in v for v in views if j not in v)]
    E = cand[-1:]
    keys = [v for v in jv if any(a in v for a in C + E)] or jv
    R = [a for a in par if a not in E and not any(a in v for v in keys)]
    G = [a for a in par if a not in R and a not in E]
    return R, E, G, Lk


def row_indices(R, G, rows="pid_r * BLOCK_I + tl.arange(0, BLOCK_I)", pre="") -> list:
    """A row tile's indices from ``pid_r`` and ``pid_g``: its rows and their mask, each row
    axis' index (the rows are the row axes flattened, the last innermost) and each grid axis'
    (``pid_g`` over the grid axes, the last innermost), in int64. ``rows``: another row range
    (its names prefixed ``pre``); ``G`` None: no grid axes' indices."""
    L = [f"    {pre}rows = {rows}",
         f"    {pre}rmask = {pre}rows < n_rows",
         f"    {pre}rem = {pre}rows.to(tl.int64)"]
    for a in reversed(R):
        L += [f"    {pre}idx_{a} = {pre}rem % len_{a}", f"    {pre}rem = {pre}rem // len_{a}"]
    if G is None:
        return L
    L.append("    gem = pid_g.to(tl.int64)")
    for a in reversed(G):
        L += [f"    idx_{a} = gem % len_{a}", f"    gem = gem // len_{a}"]
    return L


class ContractionGen(MaskAnalysis):
    # masked tiles inside the keys without a bounds mask (key_loop; False: the previous template,
    # every masked tile with the bounds mask, kept for measuring one against the other)
    INB_TILES = True
    # a run of fewer fully visible key tiles than this joins the masked loop before it (with
    # INB_TILES; 1: never). A band a few tiles wide otherwise runs three loops of one or two tiles
    # each, every one filling and draining its own pipeline (measured against each other by
    # .gen/v_gpu.py, not yet on a GPU)
    MIN_FULL = 1

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
        R, E, G, Lk = classify(prog, self.tensors, list(self.leaves.values()) + list(self.outputs.values()),
                               self.out_axes, j, C)
        if not R:
            raise CodegenError(f"program {self.name!r}: every parallel axis is shared with the key-side "
                               "tensors; there are no query rows (use the row family)")
        if len(E) > 1:
            raise CodegenError(f"program {self.name!r}: at most one value axis is supported, got {E}")
        over_c = sorted({a for ax in self.out_axes.values() for a in ax if a in C})
        if over_c:
            raise CodegenError(f"program {self.name!r}: an output ranges over {over_c}, which the scores "
                               "contract; the attention template writes per-query outputs over the value axis")
        if enc.elementwise_outputs:
            raise CodegenError(f"program {self.name!r}: outputs {list(enc.elementwise_outputs)} range over "
                               f"the key axis {j!r}; the contraction family writes per-query outputs only")
        self.C, self.R, self.E, self.G, self.L = C, R, E, G, Lk
        self.hoisting = []
        self._hoisted = {}
        self._axes_memo = {}
        # the Hopper variant of the loop kernel (``kernel_loop(hopper=True)``) reads operands
        # through TMA tensor descriptors: {tensor: (outer axis, inner axis)} of those it made
        self.hopper = False
        self.tma = {}
        self.tile_start = "start"
        # key_loop: masked tiles inside the keys (the first masked loop's) apply the program's mask
        # alone, with no bounds mask and no masked load; the last loop's tile mask is the keys' bound
        # alone (set by module(); Gluon's kernel keeps its own)
        self.inb_tiles = False
        self.tile_inb = False   # the tiles being emitted lie inside the keys (CContext.inb)
        self.whole_tiles = False   # every key tile lies inside the keys (key_loop)
        takes = _takes(list(self.leaves.values()) + list(self.outputs.values()))
        # tensors an index is read from (page tables) must be int32/int64; tensors outside the
        # dot products (document ids, masks, biases) may be integers or floats
        self.index_tensors = sorted({u.args[0] for t in takes for u in t.args[1].walk() if u.op == "In"}
                                    | {u.args[0] for t in takes for u in t.args[1].walk() if u.op == "Take"})
        self.int_ok = sorted(n for n, ax in self.tensors.items()
                             if n not in self.index_tensors and not any(a in C + E for a in ax))

    # -- helpers ------------------------------------------------------------------
    def axes_of(self, t: Term) -> set:
        if t in self._axes_memo:
            return self._axes_memo[t]
        if t.op == "In":
            r = set(self.tensors[t.args[0]])
        elif t.op == "Idx":
            r = {t.args[0]}
        elif t.op == "Take":
            r = (set(self.tensors[t.args[0]]) - {t.args[2]}) | self.axes_of(t.args[1])
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

    def int_index(self, t: Term, em):
        """(int64 expression, shape, ok) of a lookup index: index expressions (exact int64,
        emit.py's ``emit_int``), integer tensors (INDEX_TENSORS: checked int32/int64 at the
        call) and lookups of them, combined by + - * max min and // % by a positive constant.
        ``ok`` (or None) is false where an inner lookup's index was out of range."""
        uses = any(u.op in ("In", "Take") for u in t.walk())
        if not uses:
            if not is_integer(t):
                raise CodegenError(f"program {self.name!r}: the lookup index `{pretty(t)}` is not an integer "
                                   "expression; round it first (af.floor, af.round, af.cast)")
            r, sh, bad = em.emit_int(t)
            return r, sh, (em.bind(f"~({bad})", sh, "c")[0] if bad else None)
        op = t.op
        if op == "In":
            x, sh = em.ctx.load(t.args[0], em, raw=True)
            return em.bind(f"({x}).to(tl.int64)", sh, "ix")[0], sh, None
        if op == "Take":
            return em.ctx.take(t, em, as_int=True)
        if op in ("Add", "Sub", "Mul", "Max2", "Min2", "FloorDiv", "Mod"):
            if op in ("FloorDiv", "Mod"):
                c = t.args[1]
                if not (c.op == "Num" and float(c.args[0]).is_integer() and c.args[0] > 0):
                    raise CodegenError(f"program {self.name!r}: in the lookup index `{pretty(t)}`, // and % "
                                       "of a tensor value need a positive integer constant divisor")
                a, sa, ok = self.int_index(t.args[0], em)
                q = em.bind(f"{a} // {int(c.args[0])}", sa, "n")[0]
                r = em.bind(f"{a} - {q} * {int(c.args[0])}", sa, "n")[0]   # C division: fix toward -inf
                e = (f"tl.where({r} < 0, {q} - 1, {q})" if op == "FloorDiv"
                     else f"tl.where({r} < 0, {r} + {int(c.args[0])}, {r})")
                return em.bind(e, sa, "n")[0], sa, ok
            (a, sa, oa), (b, sb, ob) = self.int_index(t.args[0], em), self.int_index(t.args[1], em)
            sh = _cjoin(sa, sb)
            a, b = em._bcast(a, sa, sh), em._bcast(b, sb, sh)
            e = {"Add": f"{a} + {b}", "Sub": f"{a} - {b}", "Mul": f"{a} * {b}",
                 "Max2": f"tl.maximum({a}, {b})", "Min2": f"tl.minimum({a}, {b})"}[op]
            ok = (f"{em._bcast(oa, sa, sh)} & {em._bcast(ob, sb, sh)}" if oa and ob
                  else em._bcast(oa, sa, sh) if oa else em._bcast(ob, sb, sh) if ob else None)
            return em.bind(e, sh, "n")[0], sh, ok
        raise CodegenError(f"program {self.name!r}: the lookup index `{pretty(t)}` uses {op}; an index "
                           "of tensor values is built from + - * max min, and // % by a constant")

    def hoist(self, expr, shape):
        if expr in self._hoisted:
            return self._hoisted[expr]
        name = f"h{len(self._hoisted) + 1}"
        self.hoisting.append(f"    {name} = {expr}")
        self._hoisted[expr] = (name, shape)
        return name, shape

    def descriptor(self, name, outer, inner, block_outer, block_inner):
        """The device-side TMA descriptor of ``name`` viewed as an (outer, inner) matrix of this
        program (its grid axes fixed by the base offset), made once in the prologue; the
        launcher checks its constraints (inner stride 1, 16-byte aligned base and strides)."""
        d = f"desc_{name}"
        if name not in self.tma:
            self.tma[name] = (outer, inner)
            n_outer = "n_j" if outer == self.axis else f"len_{outer}"
            self.hoisting.append(f"    {d} = tl.make_tensor_descriptor({name}_ptr + off_{name}_g, "
                                 f"shape=[{n_outer}, len_{inner}], strides=[s_{name}_{outer}, 1], "
                                 f"block_shape=[{block_outer}, {block_inner}])")
        return d

    def row_axes_of(self, name):
        return [a for a in self.tensors[name] if a in self.R]

    # -- kernel text ----------------------------------------------------------------
    def sig(self):
        args = []
        for t, axes in self.tensors.items():
            args.append(f"{t}_ptr")
            args += [f"s_{t}_{a}" for a in axes]
        for o, axes in self.out_axes.items():
            args.append(f"{o}_ptr")
            args += [f"s_{o}_{a}" for a in axes]
        args += [f"len_{a}" for a in self.G + self.R + self.E + self.C + self.L]
        args += ["n_rows", "n_j"]
        return args

    def prologue(self, L):
        # row tiles in reverse: with lower-triangular masks the last rows see the most keys,
        # and starting the longest programs first shortens the tail
        L.append("    pid_r = tl.num_programs(0) - 1 - tl.program_id(0)")
        L.append("    pid_g = tl.program_id(1)")
        L += row_indices(self.R, self.G)
        if len(self.R) == 1:
            # one query axis: its index is the row, so the tile's range is known without reducing
            # over the rows (a block-wide min and max, each a round trip through shared memory)
            a = self.R[0]
            L.append(f"    {a}_lo = (pid_r * BLOCK_I) * 1.0")
            L.append(f"    {a}_hi = (tl.minimum(pid_r * BLOCK_I + BLOCK_I, n_rows) - 1) * 1.0")
        else:
            for a in self.R:
                L.append(f"    {a}_lo = tl.min(tl.where(rmask, idx_{a}, 2**31), axis=0) * 1.0")
                L.append(f"    {a}_hi = tl.max(tl.where(rmask, idx_{a}, -1), axis=0) * 1.0")
        L.append("    nj_f = n_j * 1.0")
        for a in self.G + self.R + self.E + self.C + self.L:
            L.append(f"    len_{a}_f = len_{a} * 1.0")
        for t in list(self.tensors) + list(self.outputs):
            axes = self.tensors[t] if t in self.tensors else self.out_axes[t]
            g = [a for a in axes if a in self.G]
            r = [a for a in axes if a in self.R]
            L.append(f"    off_{t}_g = " + (" + ".join(f"idx_{a} * s_{t}_{a}" for a in g) if g else "0"))
            if r:
                L.append(f"    off_{t}_r = " + " + ".join(f"idx_{a} * s_{t}_{a}" for a in r))
        L.append("    cols0 = tl.arange(0, BLOCK_J)")
        L.append("    ecols = tl.arange(0, BLOCK_E)")
        L.append(f"    emask = ecols < {'len_' + self.E[0] if self.E else 1}")
        L.append("    dcols = tl.arange(0, BLOCK_D)   # BLOCK_D covers the longest contraction axis")
        for a in self.C:
            L.append(f"    dmask_{a} = dcols < len_{a}")

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

    def tile_setup(self, L, start, ind, limit="n_j", full=False):
        self.tile_start = start
        L.append(f"{ind}cols = {start} + cols0")
        if self.inb_tiles and not full and not self.tile_inb:
            # the keys' bound alone: rows past the end are never stored, each row's states its own
            L.append(f"{ind}tmask = cols[None, :] < {limit}")
        elif not full and not self.tile_inb:   # (a tile inside the keys: the program's mask alone)
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
            skip_ok = self.skip_is_sound(p, self.site_values(sites))
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
            L.append(f"{ind}    # the run reached this step's first tile and that tile is full: it goes on here")
            L.append(f"{ind}    goes_on = (f_lo < BIG) & (f_hi == t0) & (c_lo == t0)")
            L.append(f"{ind}    f_hi = tl.where(take | goes_on, c_hi, f_hi)")
            L.append(f"{ind}    f_lo = tl.where(take, c_lo, f_lo)")
            L.append(f"{ind}# a row tile that sees no key still runs one (masked) tile: its states are empty")
            L.append(f"{ind}first = tl.where(first == BIG, {lo}, first)")
            L.append(f"{ind}end = tl.maximum(end, tl.minimum(first + BLOCK_J, {hi}))")
            L.append(f"{ind}f_lo = tl.minimum(f_lo, end)")
        empty = self.empty_start()
        lo1 = "first" if empty else "first + BLOCK_J"
        if self.inb_tiles:
            # the tiles before e_in lie inside the keys (the keys may end inside the one at e_in):
            # the first two loops stop there, and the last loop, whose tile mask has the bound,
            # takes the tile the keys end in (tiles stay in ascending order)
            L.append(f"{ind}e_in = tl.minimum(tl.maximum(first + (end - first) // BLOCK_J * BLOCK_J, {lo1}), end)")
            L.append(f"{ind}a = tl.minimum(tl.maximum(f_lo, {lo1}), e_in)")
            L.append(f"{ind}b = tl.minimum(tl.maximum(f_hi, a), e_in)")
            if sites and self.MIN_FULL > 1:
                L.append(f"{ind}# fewer than {self.MIN_FULL} fully visible tiles: they join the first masked loop "
                         "(one pipelined loop; the mask is evaluated on them too)")
                L.append(f"{ind}few = b - a < {self.MIN_FULL} * BLOCK_J")
                L.append(f"{ind}a = tl.where(few, e_in, a)")
                L.append(f"{ind}b = tl.where(few, e_in, b)")
        else:
            L.append(f"{ind}a = tl.minimum(tl.maximum(f_lo, {lo1}), end)")
            L.append(f"{ind}b = tl.minimum(tl.maximum(f_hi, a), end)")
        if empty:
            # no peeled tile: the states start as those of an empty block, and every key tile is
            # folded in by the rolling update (one copy of the loop body per kind of tile; a
            # peeled tile's copies of the key and value tiles kept 64 KB of shared memory of
            # their own on sm_90, which left no room for a third pipeline stage at 128 x 128)
            for s_ in p.states:
                e = {0.0: "0.0", float("-inf"): "float('-inf')", float("inf"): "float('inf')"}[empty[s_.name]]
                shape = "[BLOCK_I, BLOCK_E]" if self._is_vec(s_) else "[BLOCK_I]"
                L.append(f"{ind}# {s_.name}: on an empty block, {pretty(p.init[s_.name])} = {e}; the rolling update "
                         f"from it is the definition on the first tile")
                L.append(f"{ind}{s_.name} = tl.full({shape}, {e}, tl.float32)")
        else:
            # peel: the first tile computes the states from their definitions
            self.tile_setup(L, "first", ind, "end")
            ctx, em = self.region("init", ind)
            self.emit_states(p.init, em, L, ind, "",
                             lambda s: f"{s.name}: its definition on the first tile:  {pretty(p.init[s.name])}")
            if self.uses_counts():
                L.append(f"{ind}n_a = n_b")
        subst = self.unmasked(sites)
        # (inb_tiles: the first loop's masked tiles lie inside the keys: the program's mask alone)
        loops = ((lo1, "a", "inb" if self.inb_tiles else False, "masked"), ("a", "b", True, "fully visible"),
                 ("b", "end", False, "masked"))
        for lo_, hi_, full, what in loops:
            # (whole_tiles: a kernel whose launcher takes only whole key tiles and stores no row
            # past the end, so that every tile lies inside the keys: GluonGen's persistent kernel)
            self.tile_inb = full == "inb" or getattr(self, "whole_tiles", False)
            full = full is True
            if full and self.hopper:
                # the main loop: TMA loads pipelined over num_stages (warp specialization on request)
                L.append(f"{ind}for start in tl.range({lo_}, {hi_}, BLOCK_J, warp_specialize=WS):  # {what} tiles")
            else:
                L.append(f"{ind}for start in range({lo_}, {hi_}, BLOCK_J):  # {what} tiles")
            setup, body = [], []
            self.tile_setup(setup, "start", ind + "    ", "end", full=full)
            ctx, em = self.region("roll", ind + "    ", full=full, subst=subst if full else None)
            self.emit_states(p.rolling, em, body, ind + "    ", "_new", comment)
            for s_ in p.states:
                body.append(f"{ind}    {s_.name} = {s_.name}_new")
            if self.uses_counts():
                body.append(f"{ind}    n_a = n_a + n_b")
            L.extend(_used_setup(setup, body) + body)
        self.tile_inb = False

    def empty_start(self):
        """{state: its value on an empty block} when the key loop may start from those values
        instead of peeling the first tile, else None. It may when every state is a plain block
        reduction (``sum_B`` -> 0, ``max_B`` -> -inf, ``min_B`` -> +inf: their definitions on an
        empty block) and each derived rolling update, with the A states at those values, folds
        to the state's definition on B (_fold_empty): then folding the first tile into the empty
        states computes what the peel computed. A subclass that hooks the first tile's
        definitions (emit_states: the ring's carried states) keeps the peel, as do forms that
        read counts."""
        if type(self).emit_states is not ContractionGen.emit_states or self.uses_counts():
            return None
        p = self.p
        empty = {}
        for s in p.states:
            t = p.init[s.name]
            if t.op not in ("Sum", "RMax", "RMin") or t.args[0] != B:
                return None
            empty[s.name] = {"Sum": 0.0, "RMax": float("-inf"), "RMin": float("inf")}[t.op]
        maxes = {q for q, v in empty.items() if v == float("-inf")}
        mins = {q for q, v in empty.items() if v == float("inf")}
        for s in p.states:
            r = _fold_empty(p.rolling[s.name], empty, maxes, mins)
            if r is None or _ab_to_b(r) != p.init[s.name]:
                return None
        return empty

    def store_outputs(self, L, ind="    "):
        ctx, em = self.region("final", ind)
        for o, t in self.outputs.items():
            em.comment(f"output {o} = {pretty(t)}")
            # a quotient by a per-row value on this output's way: the row's reciprocal factors
            # where the output is float16/bfloat16 (CContext.row_quotient)
            e, sh = emit_output(em, t, f"{o}_ptr")
            axes = self.out_axes[o]
            r = any(a in self.R for a in axes)
            if self.E and self.E[0] in axes:
                if sh != "rvec":
                    e = f"({em._bcast(e, sh, 'rvec')}) + tl.zeros([BLOCK_I, BLOCK_E], tl.float32)"
                # an output over no query axis (a plain key sum) is written by row 0 only
                rm = "rmask" if r else "(rows == 0)"
                ptr = f"{o}_ptr + off_{o}_g + {f'off_{o}_r' if r else '(rows * 0)'}[:, None] + ecols[None, :] * s_{o}_{self.E[0]}"
                em.line(f"tl.store({ptr}, _out({e}, {o}_ptr), mask={rm}[:, None] & emask[None, :])")
            else:
                if sh != "row":
                    e = f"({e}) + tl.zeros([BLOCK_I], tl.float32)"
                ptr = f"{o}_ptr + off_{o}_g + " + (f"off_{o}_r" if r else "rows * 0")
                em.line(f"tl.store({ptr}, _out({e}, {o}_ptr), mask={'rmask' if r else '(rows == 0)'})")
        L.extend(em.lines)

    def kernel_loop(self, hopper=False):
        """The loop kernel; ``hopper``: its Hopper variant (``{name}_attn_hopper``), the same
        derived expressions with query, key and value tiles copied by TMA descriptors and
        the fully visible loop software-pipelined (``tl.range``); None where no operand
        can be read that way (lookups: paged KV)."""
        self.p = self.f.passes[0]
        self.hopper, self.tma = hopper, {}
        self.hoisting, self._hoisted = [], {}
        kname = f"{self.name}_attn_hopper" if hopper else f"{self.name}_attn"
        L = ["@triton.jit",
             f"def {kname}({', '.join(self.sig())}, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, "
             "BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, DOT_T: tl.constexpr, SCAN: tl.constexpr"
             + (", WS: tl.constexpr):" if hopper else "):"),
             "    # grid: (query row tiles, grid axes); loop over key tiles carrying the derived state"
             + ("\n    # Hopper: tiles copied by TMA descriptors (zeros past the ends), the main loop pipelined"
                if hopper else "")]
        self.prologue(L)
        body = []
        self.key_loop(body, "0", "n_j")
        self.store_outputs(body)
        self.hopper = False
        if hopper and not any(ax[0] == self.axis for ax in self.tma.values()):
            return None
        return _drop_dead("\n".join(L + self.hoisting + body))

    def _split_states_out(self, body, sid="sid"):
        """Store the chunk's partial states (split-KV) to the workspace: chunk ``sid``'s slot."""
        body.append(f"    base = ({sid} * n_grid + pid_g) * n_rows")
        for s in self.p.states:
            if self._is_vec(s):
                body.append(f"    tl.store(ws_{s.name} + (base + rows)[:, None] * BLOCK_E + ecols[None, :], "
                            f"{s.name}, mask=rmask[:, None])")
            else:
                body.append(f"    tl.store(ws_{s.name} + base + rows, {s.name}, mask=rmask)")

    def _split_fold(self, body, ind, volatile="", sid="sid"):
        """Fold the NSPLIT partial states in the workspace, chunk 0 first, with the derived merge
        and store the outputs (the combine's body; ``volatile``: the loads bypass the L1 cache,
        for a program reading partial states other programs of the same launch wrote; ``sid``:
        the loop's chunk index, a name the kernel does not use otherwise)."""
        p = self.p
        inner = ind + "    "

        def ld(s, sid, suffix, at):
            base = f"(({sid}) * n_grid + pid_g) * n_rows"
            if self._is_vec(s):
                return (f"{at}{s.name}{suffix} = tl.load(ws_{s.name} + ({base} + rows)[:, None] * BLOCK_E + "
                        f"ecols[None, :], mask=rmask[:, None], other=0.0{volatile})")
            return f"{at}{s.name}{suffix} = tl.load(ws_{s.name} + {base} + rows, mask=rmask, other=0.0{volatile})"
        for s in p.states:
            body.append(ld(s, "0", "", ind))
        body.append(f"{ind}n_a = tl.minimum(CHUNK, n_j) * 1.0")
        body.append(f"{ind}for {sid} in range(1, NSPLIT):")
        for s in p.states:
            body.append(ld(s, sid, "_b", inner))
        body.append(f"{inner}n_b = (tl.minimum({sid} * CHUNK + CHUNK, n_j) - {sid} * CHUNK) * 1.0")
        chain = self.f.rule_chain
        ctx, em = self.region("merge", inner)
        self.emit_states(p.merge, em, body, inner, "_new",
                         lambda s: f"{s.name}_AB = {pretty(p.merge[s.name])}\n  derived by: "
                                   f"{' -> '.join(chain(s.name, 'merge')) or 'definition'}")
        for s in p.states:
            body.append(f"{inner}{s.name} = {s.name}_new")
        body.append(f"{inner}n_a = n_a + n_b")
        self.store_outputs(body, ind)

    def kernel_split(self):
        """Split-KV in two launches: ``{name}_part`` (grid axis 2: one chunk of keys per program;
        its partial states to the workspace) and ``{name}_combine`` (one program per row tile:
        folds the chunks' states with the derived merge, writes the outputs)."""
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
        self._split_states_out(body)
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
        self._split_fold(body, "    ")
        comb = "\n".join(L + self.hoisting + body)
        return _drop_dead(part), _drop_dead(comb)

    def kernel_split_last(self, hopper=False):
        """Split-KV in one launch, ``{name}_split1``: each program folds one chunk of keys
        (grid axis 2) as ``{name}_part`` does and stores its partial states, then takes a
        ticket on its row tile's counter (acq_rel); the program that takes the last ticket
        folds every chunk's states with the derived merge in chunk order (as
        ``{name}_combine``: the same result whichever program arrives last) and writes the
        outputs, then sets the counter back to 0 for the next launch. No program waits for
        another, so none can deadlock, whatever the number resident (Triton's interpreter,
        which runs programs one after another, included). ``hopper``: its variant
        ``{name}_split1_hopper``, key and value tiles copied by TMA descriptors as in
        ``{name}_attn_hopper`` (None where no key-side operand can be read that way)."""
        self.p = p = self.f.passes[0]
        ws = [f"ws_{s.name}" for s in p.states]
        self.hoisting = []
        self._hoisted = {}
        self.hopper, self.tma = hopper, {}
        kname = f"{self.name}_split1_hopper" if hopper else f"{self.name}_split1"
        L = ["@triton.jit",
             f"def {kname}({', '.join(self.sig())}, {', '.join(ws)}, cnt_ptr, CHUNK, NSPLIT, n_grid, "
             "BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, "
             "PREC: tl.constexpr, DOT_T: tl.constexpr, SCAN: tl.constexpr" + (", WS: tl.constexpr):" if hopper else "):"),
             "    # split-KV in one launch: one chunk of keys per program along grid axis 2, partial states",
             "    # to a workspace; the last program of each row tile to finish folds them"
             + ("\n    # Hopper: key and value tiles copied by TMA descriptors (zeros past the keys' end)" if hopper else "")]
        try:
            self.prologue(L)
            body = ["    sid = tl.program_id(2)", "    chunk_lo = sid * CHUNK",
                    "    chunk_hi = tl.minimum(chunk_lo + CHUNK, n_j)"]
            self.key_loop(body, "chunk_lo", "chunk_hi")
        finally:
            self.hopper = False
        if hopper and not any(ax[0] == self.axis for ax in self.tma.values()):
            return None
        self._split_states_out(body)
        body += ["    tl.debug_barrier()   # every thread's partial states written before the ticket",
                 "    cnt = cnt_ptr + pid_g * tl.num_programs(0) + pid_r",
                 "    ticket = tl.atomic_add(cnt, 1, sem='acq_rel')",
                 "    if ticket == NSPLIT - 1:   # the row tile's last chunk to finish: every partial state is written",
                 "        tl.debug_barrier()"]
        self._split_fold(body, "        ", volatile=", volatile=True", sid="fold_sid")
        body.append("        tl.atomic_xchg(cnt, 0)   # ready for the next launch (a cached workspace)")
        return _drop_dead("\n".join(L + self.hoisting + body))

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
        self.tanh_mm = True   # this module defines _tanh_mm (CContext.tanh)
        self.inb_tiles = self.INB_TILES
        try:
            parts.append(self.kernel_loop())
            hop = self.kernel_loop(hopper=True)
            self.hopper_tma = dict(self.tma) if hop else {}
            if hop:
                parts.append(hop)
            split = f.passes[0].split_ok
            if split:
                parts.extend(self.kernel_split())
                parts.append(self.kernel_split_last())
                # (the Hopper variant only where the loop kernel has one: the same TMA operands)
                hsplit = self.kernel_split_last(hopper=True) if hop else None
                if hsplit:
                    parts.append(hsplit)
                self.split_hopper = bool(hsplit)
        finally:
            self.tanh_mm = self.inb_tiles = False
        if any("_tanh_mm(" in x for x in parts[1:]):
            parts.insert(1, TANH_MM)
        parts.append(self.launcher(split))
        return "\n\n\n".join(parts) + "\n"

    def launcher(self, split):
        return contraction_launch.launcher(self, split)


def _num(t):
    return float(t.args[0]) if t.op == "Num" and not isinstance(t.args[0], Term) else None


def _fold_empty(t: Term, empty: dict, maxes: set, mins: set):
    """``t`` with the A states at their empty values ``empty`` (ContractionGen.empty_start), folded
    by exact facts only: max(-inf, x) = x, min(+inf, x) = x, x + 0 = x, 0 * 0 = 0, and exp(u) = 0
    when u is -inf whatever the other states are: an empty max (-inf) minus a max of AB or B
    (the template reads an empty one as 0 there; a finite or +inf one leaves -inf), or a
    positive multiple of such a difference. None when a
    state of A is left over (the fold did not remove it)."""
    def st(u, kinds):   # a state of AB or B of one of ``kinds``
        return u.op == "St" and u.args[1] != A and u.args[0] in kinds

    def neg_inf(u):   # u is -inf for every value of the other states
        if _num(u) == float("-inf"):
            return True
        if u.op == "Sub":
            x, y = u.args
            return neg_inf(x) and st(y, maxes)
        if u.op == "Mul":
            x, y = u.args
            return (neg_inf(x) and (_num(y) or 0) > 0) or (neg_inf(y) and (_num(x) or 0) > 0)
        return False

    def go(u):
        if u.op == "St" and u.args[1] == A:
            return Term("Num", (empty[u.args[0]],)) if u.args[0] in empty else u
        if not u.children:
            return u
        ch = [go(c) for c in u.children]
        args, n = [], 0
        for a in u.args:
            if isinstance(a, Term):
                args.append(ch[n])
                n += 1
            else:
                args.append(a)
        v = Term(u.op, tuple(args))
        if u.op == "Max2":
            for x, y in (ch, ch[::-1]):
                if _num(x) == float("-inf"):
                    return y
        if u.op == "Min2":
            for x, y in (ch, ch[::-1]):
                if _num(x) == float("inf"):
                    return y
        if u.op == "Exp" and neg_inf(ch[0]):
            return Term("Num", (0.0,))
        if u.op == "Add":
            for x, y in (ch, ch[::-1]):
                if _num(x) == 0.0:
                    return y
        if u.op == "Mul" and _num(ch[0]) == 0.0 and _num(ch[1]) == 0.0:
            return Term("Num", (0.0,))
        return v
    r = go(t)
    return None if any(u.op == "St" and u.args[1] == A for u in r.walk()) else r


def _ab_to_b(t: Term) -> Term:
    """``t`` with the states of AB read as those of B (equal when A is empty)."""
    if t.op == "St" and t.args[1] == AB:
        return Term("St", (t.args[0], B))
    if not t.children:
        return t
    it = iter(_ab_to_b(c) for c in t.children)
    return Term(t.op, tuple(next(it) if isinstance(a, Term) else a for a in t.args))


def _used_setup(setup, body):
    """The lines of a tile's setup (``cols``, ``tmask``, ``n_b``) that the tile's body reads:
    a fully visible tile whose operands come through TMA needs none of them."""
    import re
    keep, text = [], "\n".join(body)
    for ln in reversed(setup):
        name = ln.split("=")[0].strip()
        if re.search(rf"\b{name}\b", text):
            keep.insert(0, ln)
            text += "\n" + ln
    return keep


def _drop_dead(src: str) -> str:
    """Drop the prologue's unused values (sizes as floats, offsets of tensors read another
    way): a top-level assignment ``name = ...`` whose name is assigned once and read nowhere."""
    import re
    lines = src.split("\n")
    while True:
        text = "\n".join(lines)
        dead = set()
        for ln in lines:
            m = re.match(r"    ([A-Za-z_]\w*) = ", ln)
            if m and not ln.lstrip().startswith("for "):
                n = m.group(1)
                if len(re.findall(rf"\b{n}\b", text)) == 1:
                    dead.add(ln)
        if not dead:
            return text
        lines = [ln for ln in lines if ln not in dead]


def generate(fusion) -> str:
    """The contraction family's kernel; programs whose states are plain sums over the loop
    axis and that the attention-shaped template cannot lower (an output over a contraction
    axis; several contraction axes in the body: derived backward stages) get the sum kernel."""
    from acefuse.codegen.sums import SumGen, sum_pass
    try:
        gen = ContractionGen(fusion)
        if len(gen.C) > 1 and sum_pass(fusion):
            return SumGen(fusion).module()
        return gen.module()
    except CodegenError:
        if not sum_pass(fusion):
            raise
        return SumGen(fusion).module()


def is_contraction(fusion) -> bool:
    """The program reduces over another axis inside the leaves (a dot product)."""
    j = fusion.encoding.axis
    for lf in fusion.encoding.leaves.values():
        for t in lf.walk():
            if t.op == "Sum" and t.args[0].op == "Ax" and t.args[0].args[0] != j:
                return True
    return False


__all__ = ["ContractionGen", "CContext", "classify", "generate", "is_contraction",
           "_flat_mul"]   # codegen/sums.py imports _flat_mul from here
