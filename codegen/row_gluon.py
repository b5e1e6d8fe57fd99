"""The row family's staged schedule on Hopper: each row read from HBM once into a shared-memory
ring (issue 15, "rows in one read"), as a Gluon kernel GENERATED from the same derived
expressions as the Triton loop schedule (codegen/row.py ``RowGen.kernel_loop``).

What changes against the loop schedule is only where the tiles come from and how a row is cut:

- a row of the staged inputs (those over every row axis and the fused axis, 16-bit,
  contiguous) is NC chunks of ``[CR, CW]`` elements (a chunk is CR consecutive *sub-rows* of CW
  elements of the row, ``CR * CW`` contiguous elements); a copy warp (``gl.warp_specialize``)
  issues TMA copies of the chunks of the program's rows into a ring of NBUF shared-memory
  slots, each slot completing on its ``full`` mbarrier and refilled once the compute warps
  release it (``empty``);
- pass 1 folds the chunks, as they land, into per-sub-row states (the states are vectors of CR
  values: sub-row ``u`` of every chunk belongs to partial state ``u``): the first chunk gives
  the states' definitions (``init``), each later one the derived rolling update (``rolling``);
  a sub-row with no element left (the row's tail) keeps its state. Then the CR partial states
  are folded into the row's states with the derived merge (``merge``, the split schedule's:
  ``gl.reduce`` with the merge as its combine function), and the row's references and per-row
  outputs follow (``final``), as in the loop schedule;
- pass 2 reads the same slots again (no second HBM read) and writes the outputs elementwise
  over the fused axis, then releases each slot to the copy warp.

Per element, the compute warps do what the hand-written probe (benchmarks/staged_rows_probe.py)
does plus what the program needs: exp as one ex2 (``exp2``), pass 2's per-row values computed
before its chunk loop (``hoist``), and a quotient by a per-row value as one multiply on rows whose
denominators are normal floats (``qfast``; other rows the exact ``_qdiv``). Offline sm_90 SASS of
softmax (tests/test_row_gluon.py): 160 and 121 instructions per chunk in pass 1 and pass 2, the
probe's 153 and 120, the first generated kernel's (all three off) 214 and 233.

``rows_in_flight=2`` (the automatic choice's form, codegen/row_gluon_auto.py): two compute groups
of ``num_warps // 2`` warps take the program's rows in turn (row k to group k % 2), sharing the
copy warp and the ring, so that one group's pass 2 runs while the other's pass 1 folds the next
row; each group waits on its own ``full`` barriers (``StagedGen.kernel`` has the protocol,
tests/test_row_gluon_protocol.py runs it under random interleavings).

Masking: the TMA copy of the row's last chunk reads past the row (the next row's elements, or
zeros past the tensor); the column mask ``tmask`` (global column < n_j) selects them out of
every reduction with the reduction's identity, exactly where the Triton loop masks its tail
tile (codegen/emit.py ``_reduce``), and out of every store.

Scope (``compile_staged`` refuses the rest with a ValueError that says why): one pass over the
fused axis with a derived merge (``split_ok``), no stacked outputs (af.topk) or riders; at
launch, at least one staged input, 16-bit, contiguous, 16-byte aligned, the fused axis a
multiple of 8 elements and at least one chunk long. Inputs over the fused axis that are not
staged (a per-column weight) are read with plain loads.

Rows longer than the ring (more chunks than ``SMEM_SM90``, 227 KB per program, holds: 262144
bf16 elements are 64 chunks, 28 slots fit) run the *partial* form (``partial=True``,
codegen/row_gluon_partial.py has its protocol): the row's first KEEP chunks stay in their slots
for pass 2, the other chunks stream through RING rotating slots twice (pass 1, then pass 2
copied again), so a row is (2 - KEEP / NC) reads and one write instead of the Triton loop's two
reads. One row in flight (the kept slots are one row's): ``rows_in_flight=2`` runs it with its
warps in one group. The launcher (codegen/row_gluon_launch.py) takes it only where the row does
not fit, with as many slots kept as fit beside the rotating ones (``ring_split``); the same
generator, per-element forms and masks (``tmask``) as the fully staged form, whose source is
unchanged by it.

``auto_staged`` (codegen/row_gluon_auto.py) is the automatic choice for af.compile's row
kernels on sm_90 (hooked into codegen/compile.py ``Kernel.__call__``): the staged kernel is
timed against the Triton module's own launch, both outputs compared, the faster kept (with a
margin), remembered per shapes on the kernel and on disk (codegen/tuning.py, ``what='staged'``). No kernel text names a workload.
Gluon has no interpreter: on the CPU this module generates and compiles (offline, for sm_90)
the source only.

The modules: this one generates the kernel's source (``StagedGen``, ``staged_source``,
``emulation_source``); codegen/row_gluon_pass2.py emits pass 2's chunk loop in its per-element
forms and holds the kernel's own helpers; codegen/row_gluon_parts.py writes the copy partition
and the kernel, codegen/row_gluon_partial.py the partial form's pieces (its waits and releases,
its copy partition and kernel); codegen/row_gluon_launch.py is the compiled kernel
(``compile_staged``, ``RowStagedKernel`` and its launch arguments, ``run_emulated``), re-exported here.
"""
from __future__ import annotations

import re

from acefuse.rewrite.terms import Term, pretty
from acefuse.codegen.emit import CodegenError, Emitter
from acefuse.codegen.row import Context, RowGen, emit_output
from acefuse.codegen.contraction_gluon import SMEM_SM90, _helpers   # noqa: F401 (SMEM_SM90: re-exported)
# pass 2's chunk loop and the per-element forms' helpers (module() and emulation_source read
# OWN_HELPERS here, as a name of this module)
from acefuse.codegen.row_gluon_pass2 import CHUNK_NAMES, OWN_HELPERS, pass2_loop   # noqa: F401
from acefuse.codegen.row_gluon_parts import copy_partition, staged_kernel
from acefuse.codegen import row_gluon_partial as partial_form
# the compiled kernel, its launch and its emulated run: re-exported (tests, codegen/compile.py,
# codegen/row_gluon_auto.py and the GPU scripts import them from here)
from acefuse.codegen.row_gluon_launch import (BARRIER_BYTES, CHUNK, DEFAULT_NBUF, DEFAULT_WARPS,  # noqa: F401
                                              RowStagedKernel, _chunk_shape, auto_staged, compile_staged,
                                              run_emulated)

STAGED_HEADER = '''"""Generated by acefuse from program {name!r} (fused axis {axis!r}): the row family's staged
Gluon kernel for Hopper (codegen/row_gluon.py): each row read once into a shared-memory ring.
Do not edit.

{explain}
"""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared

# the TMA copy into shared memory (Triton 3.6 names it async_copy_global_to_shared, later ones async_load)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# the TMA copy out of shared memory (tma_store=True; Triton 3.6: async_copy_shared_to_global)
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
# every compute warp has read a slot before it is released (Triton 3.6: gl.barrier)
_sync = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
NATIVE = gl.constexpr(True)        # Gluon runs compiled for sm_90+ only: the helpers' native branches
INTERPRETED = gl.constexpr(False)
'''


def _gluonize(src: str) -> str:
    """Triton text of the row template's expressions -> Gluon text: the tensors it makes get
    the kernel's layouts (``[BLOCK_R]``: one value per sub-row, ROW_L; ``[BLOCK_R, BLOCK_J]``:
    the chunk, BL), ``tl.`` -> ``gl.`` elsewhere (NaN-propagating extrema keep Triton's enum)."""
    src = src.replace("tl.PropagateNan.ALL", "PROPAGATE_ALL")
    src = re.sub(r"tl\.zeros\(\[BLOCK_R\], (tl\.\w+)\)", r"gl.zeros([CR], \1, layout=ROW_L)", src)
    src = re.sub(r"tl\.zeros\(\[BLOCK_R, BLOCK_J\], (tl\.\w+)\)", r"gl.zeros([CR, CW], \1, layout=BL)", src)
    src = re.sub(r"tl\.full\(\[BLOCK_R, BLOCK_J\], ([^,()]+), (tl\.\w+)\)", r"gl.full([CR, CW], \1, \2, layout=BL)", src)
    src = re.sub(r"tl\.full\(\[BLOCK_R\], ([^,()]+), (tl\.\w+)\)", r"gl.full([CR], \1, \2, layout=ROW_L)", src)
    if re.search(r"tl\.(arange|zeros|full)\(|BLOCK_[RJ]\b|tl\.debug_barrier", src):
        raise CodegenError("the staged Gluon kernel has no layout for a tensor the row template makes "
                           f"({re.search(r'tl[.](arange|zeros|full)[(]|BLOCK_[RJ]|tl[.]debug_barrier', src).group(0)})")
    return re.sub(r"\btl\.", "gl.", src)


class SContext(Context):
    """The row template's names in the staged kernel: a tile is the chunk ``[CR, CW]`` (layout
    BL), a "row" value one per sub-row ``[CR]`` (ROW_L; after the merge every sub-row holds the
    row's value), a per-row input a scalar of the row being computed."""

    # count(): the row template's (the staged kernel's regions are never its "single" mode)

    def index(self, axis):
        if axis == self.g.axis:
            return "cols.to(tl.float32)", "tile"
        return f"idx_{axis}.to(tl.float32)", "scalar"

    def load(self, name, em):
        g = self.g
        key = ("_ld", name)
        if key in em.cache:
            return em.cache[key]
        base = f"{name}_ptr + off_{name}" if g.row_axes_of(name) else f"{name}_ptr"
        if name in g.staged and g.emulate and g.partial:   # the CPU emulation of the slots: from its scratch slot
            out = em.bind(partial_form.slot_load(name), "tile", "ld_")
        elif name in g.staged and g.emulate:   # the CPU emulation: the chunk from global memory
            out = em.bind(f"tl.load({base} + cols * s_{name}_{g.axis}, mask=tmask, other=0.0).to(tl.float32)",
                          "tile", "ld_")
        elif name in g.staged:   # the chunk from its ring slot (pass 1 waited for it)
            out = em.bind(f"slots_{name}.index(z_slot).load(BL).to(tl.float32)", "tile", "ld_")
        elif g.axis in g.tensors[name]:   # a per-column input: plain loads (L2 serves the rows after the first)
            out = em.bind(f"tl.load({base} + cols * s_{name}_{g.axis}, mask=tmask, other=0.0).to(tl.float32)",
                          "tile", "ld_")
        else:
            out = em.bind(f"tl.load({base}).to(tl.float32)", "scalar", "ld_")
        em.cache[key] = out
        return out

    def take(self, t: Term, em):
        g = self.g
        name, idx, ax = t.args
        if ax != g.axis or any(a != g.axis and a not in g.row_axes for a in g.tensors[name]):
            raise CodegenError(f"take({name}, ..., {ax!r}): the row family gathers along the fused axis only")
        if idx.op == "In":
            i = idx.args[0]
            base = f"{i}_ptr + off_{i}" if g.row_axes_of(i) else f"{i}_ptr"
            ie, si = em.bind(f"tl.load({base}).to(tl.int64)", "scalar", "ix_")
        else:
            e, si = em.emit(idx)
            if si not in ("scalar", "row"):
                raise CodegenError(f"take({name}, ...): an index that varies along the fused axis")
            ie, si = em.bind(f"({e}).to(tl.int64)", si, "ix_")
        off = f"off_{name} + " if g.row_axes_of(name) else ""
        return em.bind(f"tl.load({name}_ptr + {off}{ie} * s_{name}_{ax}).to(tl.float32)", si, "tk_")


class SEmitter(Emitter):
    """The row template's emitter, with the counts of the blocks one value per sub-row (a chunk's
    tail sub-rows hold fewer elements than the others)."""

    def _emit(self, t: Term, pol):
        if t.op == "Cnt":
            c = self.ctx.count(t.args[0])
            return c, ("scalar" if c == "nj_f" or self.ctx.mode == "merge" else "row")
        return super()._emit(t, pol)


class StagedGen(RowGen):
    """Generates the staged Gluon module for one Fusion of the row family."""

    context = SContext

    def __init__(self, fusion, emulate=False, tma_store=False, exp2=True, hoist=True, qfast=True, rows_in_flight=1,
                 partial=False):
        super().__init__(fusion)
        # partial: the form for rows longer than the ring (codegen/row_gluon_partial.py): the first
        # KEEP chunks of a row kept in their slots, the others streamed twice through RING slots
        self.partial = bool(partial)
        # rows_in_flight=2: two compute groups on alternating rows of the program (row k to group
        # k % 2), sharing the copy warp and the ring, so that one group's pass 2 overlaps the other's
        # pass 1 (``kernel``'s docstring has the protocol); 1: one group (the default kernel)
        if rows_in_flight not in (1, 2):
            raise ValueError(f"rows_in_flight={rows_in_flight!r}: 1 or 2")
        self.rif = rows_in_flight
        # exp2: exp(x) as exp2(x * log2(e)) (``_expf``: ex2.approx.ftz, one MUFU.EX2; results below
        # 2^-126, which float32's exp gives with a few bits only, flush to 0); False: tl.exp
        # (ex2.approx.f32, whose subnormal fix-up costs an FSETP and two FMULs per element on
        # sm_90); "fold": log2(e) folded into the operands as the contraction family does (x *
        # log2(e) - m * log2(e), one FMA, but m * log2(e) overflows for |m| > 2.3e38, a bfloat16
        # input: not the default)
        if exp2 not in (True, False, "fold"):
            raise ValueError(f"exp2={exp2!r}: True, False or 'fold'")
        self.exp2 = exp2
        # hoist: pass 2's per-row values (the shifts, the quotients' reciprocals) computed once per
        # row before its chunk loop, not left to the compiler (which kept _rcp_row's division,
        # a CALL, inside the loop)
        self.hoist = hoist
        # qfast: a row whose every quotient denominator b is a normal float (2^-126 <= |b| <= 2^126)
        # runs pass 2 with a * RN(1/b), one multiply per element and no select; any other row
        # (b 0, subnormal, huge, infinite, NaN) the exact _qdiv (a split reciprocal, 0/0 -> 0)
        self.qfast = qfast and hoist
        # emulate: the compute partition's arithmetic as a Triton kernel reading its chunks from
        # global memory (no ring, no copy warp), which Triton's interpreter runs on the CPU
        self.emulate = emulate
        # tma_store: the elementwise outputs of whole chunks (EVEN) go out through two shared-memory
        # buffers per output and TMA copies (a tail chunk's, with masked stores)
        self.tma_store = tma_store and not emulate
        f = fusion
        name = self.name
        if len(f.passes) != 1:
            raise CodegenError(f"program {name!r} needs {len(f.passes)} passes over the fused axis "
                               f"{self.axis!r}; the staged Gluon kernel holds one (af.compile's Triton loop "
                               "schedule runs it)")
        p = f.passes[0]
        if not p.split_ok or not p.states:
            raise CodegenError(f"program {name!r}: its states over {self.axis!r} have no derived merge (the split "
                               "schedule's), which the staged kernel needs to fold its sub-rows' partial states")
        if self.stacks or self.index_tensors and any(self.axis in self.tensors[i] for i in self.index_tensors):
            raise CodegenError(f"program {name!r}: stacked outputs (af.topk) or index tensors over the fused axis "
                               "have no staged form")
        full = set(self.row_axes) | {self.axis}
        # the staged inputs: over every row axis and the fused axis, fused axis last
        self.staged = [t for t, ax in self.tensors.items() if set(ax) == full and t not in self.index_tensors]
        if not self.staged:
            raise CodegenError(f"program {name!r}: no input spans the rows and the fused axis {self.axis!r}; "
                               "nothing to stage")
        for t in self.staged:
            ax = self.tensors[t]
            if ax[-1] != self.axis or [a for a in ax if a != self.axis] != self.row_axes:
                raise CodegenError(f"program {name!r}: input {t!r} is over {' '.join(ax)!r}; the staged kernel "
                                   f"reads inputs whose axes are the row axes in order, then {self.axis!r}")
        for o, ax in self.stores():
            if self.axis in ax and (ax[-1] != self.axis):
                raise CodegenError(f"program {name!r}: output {o!r} has the fused axis {self.axis!r} not last")
        self.elem_out = list(self.enc.elementwise_outputs)
        if self.partial and (self.rif > 1 or self.tma_store):
            raise CodegenError(f"program {name!r}: partial staging (a row longer than the ring) has one row in flight "
                               "and no tma_store form; use rows_in_flight=1 and tma_store=False")
        if self.rif > 1 and self.tma_store:
            raise CodegenError(f"program {name!r}: rows_in_flight=2 has no tma_store form (the output buffers and "
                               "their store waits are one group's); use one of the two")
        if self.tma_store and (not self.elem_out or any(list(self.out_axes[o]) != self.row_axes + [self.axis]
                                                        for o in self.elem_out)):
            raise CodegenError(f"program {name!r}: tma_store needs outputs elementwise over the rows and "
                               f"{self.axis!r} (in that order)")

    def region(self, mode, ind, em=None):
        ctx = self.context(self, mode)
        ctx.fold_exp2 = self.exp2 == "fold"
        em = em or SEmitter(ctx, indent=ind)
        em.ctx = ctx
        ctx.em = em
        return ctx, em

    # -- pieces --------------------------------------------------------------------------------
    def row_setup(self, L, ind):
        """Indices and offsets of row ``r`` (scalars)."""
        L.append(f"{ind}rem = z_row.to(tl.int64)")
        for a in reversed(self.row_axes[1:]):
            L.append(f"{ind}idx_{a} = rem % len_{a}")
            L.append(f"{ind}rem = rem // len_{a}")
        if self.row_axes:
            L.append(f"{ind}idx_{self.row_axes[0]} = rem")
        for t, axes in list(self.tensors.items()) + self.stores():
            ra = [a for a in axes if a != self.axis and a in self.row_axes]
            if ra:
                L.append(f"{ind}off_{t} = " + " + ".join(f"idx_{a} * s_{t}_{a}" for a in ra))

    def chunk_setup(self, L, ind):
        """Chunk ``c`` of the row: its global columns, their mask, each z_sub-row's element count."""
        L.append(f"{ind}z_col0 = z_c * (CR * CW) + z_sub * CW")
        L.append(f"{ind}cols = z_col0[:, None] + z_lane[None, :]")
        if not self.hoist:   # (the first kernel's form: the counts computed in every chunk)
            L.append(f"{ind}if EVEN:   # every chunk whole: no column masked (the compiler drops the selects)")
            L.append(f"{ind}    tmask = tl.full([BLOCK_R, BLOCK_J], 1, tl.int1)")
            L.append(f"{ind}else:")
            L.append(f"{ind}    tmask = cols < n_j")
            L.append(f"{ind}n_b = tl.minimum(tl.maximum(n_j - z_col0, 0), CW) * 1.0")
            return
        L.append(f"{ind}if EVEN:   # every chunk whole: no column masked, every sub-row CW elements (the compiler")
        L.append(f"{ind}    tmask = tl.full([BLOCK_R, BLOCK_J], 1, tl.int1)   # drops the selects)")
        L.append(f"{ind}    n_b = tl.full([BLOCK_R], CW, tl.float32)")
        L.append(f"{ind}else:")
        L.append(f"{ind}    tmask = cols < n_j")
        L.append(f"{ind}    n_b = tl.minimum(tl.maximum(n_j - z_col0, 0), CW) * 1.0")

    def emit_states(self, p, forms, L, ind, mode, kind):
        ctx, em = self.region(mode, ind)
        chain = self.f.rule_chain
        for s in p.states:
            rules = " -> ".join(chain(s.name, kind)) or "definition"
            em.comment(f"{s.name}_{'B' if mode == 'init' else 'AB'} = {pretty(forms[s.name])}\n  derived by: {rules}")
            e, sh = em.emit(forms[s.name])
            if sh == "scalar":
                e = f"({e}) + tl.zeros([BLOCK_R], tl.float32)"
            elif sh != "row":
                raise CodegenError(f"a state update came out with shape {sh} ({e}); expected one value per sub-row")
            em.assign(s.name if mode == "init" else s.name + "_new", e)
        L.extend(em.lines)
        if mode == "roll":
            L.append(f"{ind}# a z_sub-row with no element left (the row's tail) keeps its state")
            for s in p.states:
                L.append(f"{ind}{s.name} = tl.where(n_b > 0.0, {s.name}_new, {s.name})")

    def merge_fn(self, p):
        """The derived merge as the combine function of ``gl.reduce`` over the z_sub-rows."""
        names = [s.name for s in p.states]
        ctx, em = self.region("merge", "    ")
        chain = self.f.rule_chain
        for s in p.states:
            rules = " -> ".join(chain(s.name, "merge")) or "definition"
            em.comment(f"{s.name}_AB = {pretty(p.merge[s.name])}\n  derived by: {rules}")
            e, sh = em.emit(p.merge[s.name])
            em.assign(s.name + "_new", e)
        args = names + ["n_a"] + [q + "_b" for q in names] + ["n_b"]
        L = ["@gluon.jit", f"def _{self.name}_merge({', '.join(args)}):",
             "    # two blocks' states -> their union's (the derived merge); a block of no element is the other's"]
        L += em.lines
        for q in names:
            L.append(f"    {q}_new = tl.where(n_b > 0.0, tl.where(n_a > 0.0, {q}_new, {q}_b), {q})")
        L.append(f"    return {', '.join(q + '_new' for q in names)}, n_a + n_b")
        return "\n".join(L)

    def emit_row_outputs_staged(self, L, ind):
        ctx, em = self.region("final", ind)
        for o, t in self.outputs.items():
            if o in self.enc.elementwise_outputs:
                continue
            em.comment(f"output {o} = {pretty(t)}")
            e, sh = em.emit(t, raw_state=True)
            v = e if sh == "row" else f"({e}) + tl.zeros([BLOCK_R], tl.float32)"
            off = f" + off_{o}" if [a for a in self.out_axes[o] if a != self.axis] else ""
            em.line(f"tl.store({o}_ptr{off} + z_sub * 0, {self.stored(o, v)}, mask=z_sub == 0)   # once per row")
        L.extend(em.lines)

    def emit_elem_outputs_staged(self, L, ind):
        ctx, em = self.region("final", ind)
        for o in self.enc.elementwise_outputs:
            t = self.outputs[o]
            em.comment(f"output {o} = {pretty(t)}")
            e, sh = emit_output(em, t, f"{o}_ptr")
            v = e if sh == "tile" else f"({e}{'[:, None]' if sh == 'row' else ''}) + tl.zeros([BLOCK_R, BLOCK_J], tl.float32)"
            off = f" + off_{o}" if [a for a in self.out_axes[o] if a != self.axis] else ""
            st = f"tl.store({o}_ptr{off} + cols * s_{o}_{self.axis}, {self.stored(o, v)}, mask=tmask)"
            if not self.tma_store:
                em.line(st)
                continue
            em.line("if EVEN:   # a whole chunk: through its shared-memory buffer and a TMA copy")
            em.line(f"    obuf_{o}.index(z_ob).store({self.stored(o, v)})")
            em.line("else:")
            em.line(f"    {st}")
        if self.tma_store:
            em.line("if EVEN:")
            em.line("    fence_async_shared()")
            em.line("    _sync()   # every compute warp has written the buffers")
            for o in self.elem_out:
                em.line(f"    _tma_store({o}_odesc, [z_orow, 0], obuf_{o}.index(z_ob))")
        L.extend(em.lines)

    def _exp(self, src):
        """exp as ``_expf`` (exp2 of x * log2(e)) where ``exp2`` is True."""
        return re.sub(r"\btl\.exp\(", "_expf(", src) if self.exp2 is True else src

    def pass2(self, L, B, ind):
        """Pass 2's chunk loop of body lines ``B`` in this kernel's forms (``hoist``, ``qfast``):
        codegen/row_gluon_pass2.py ``pass2_loop``."""
        pass2_loop(L, B, ind, self.hoist, self.qfast)

    # -- the kernel ------------------------------------------------------------------------------
    def _wait_chunk(self, L, ind, t, two):
        """Pass 1's wait for the program's chunk ``t`` in its slot (t % NBUF): on the slot's full
        barrier, or with two groups on this group's own (parity kept in bit ``z_slot`` of z_ph)."""
        if self.emulate:
            return
        L.append(f"{ind}z_slot = {t} % NBUF")
        if two:
            L.append(f"{ind}mbarrier.wait(full.index(G * NBUF + z_slot), ((z_ph >> z_slot) & 1).to(tl.int32))")
            L.append(f"{ind}z_ph = z_ph ^ (z_one << z_slot)")
        else:
            L.append(f"{ind}mbarrier.wait(full.index(z_slot), ({t} // NBUF) & 1)")

    def kernel(self) -> str:
        """The module's kernels: the merge, the compute partition, the copy partition and the kernel
        (the last two written by codegen/row_gluon_parts.py).

        With ``rows_in_flight=2`` (``self.rif``) the compute partition runs twice, as two groups of
        warps (group G takes rows G, G + 2, ... of the program); the copy warp fills the ring in the
        same order as with one group (chunk t of the program's rows into slot t % NBUF once the
        slot's previous chunk was released: one ``empty`` barrier per slot, released by whichever
        group read it, in fill order, since a slot is refilled only after its release). Each group
        has its own ``full`` barrier per slot (index G * NBUF + slot): a group waits only for its
        own fills, in its order, and keeps the parity of its next fill of each slot as one bit of
        ``z_ph`` (NBUF <= 64), so a wait never sees the other group's phases. No deadlock: the
        copy of chunk t waits for the release of chunk t - NBUF, whose row ended before t (NBUF >= NC)
        and whose group waits on earlier chunks only. tests/test_row_gluon_protocol.py runs it."""
        p = self.f.passes[0]
        two = self.rif > 1
        names = [s.name for s in p.states]
        sig = ", ".join(self.sig())
        slots = ", ".join(f"slots_{t}" for t in self.staged)
        descs = ", ".join(f"{t}_desc" for t in self.staged)
        dts = ", ".join(f"DT_{t}: gl.constexpr" for t in self.staged)
        # tma_store: each elementwise output's descriptor and its two shared-memory buffers
        outs = "".join(f"{o}_odesc, obuf_{o}, " for o in self.elem_out) + "NSUB, " if self.tma_store else ""
        dts += "".join(f", DT_O_{o}: gl.constexpr" for o in self.elem_out) if self.tma_store else ""
        # -- compute partition
        part = self.partial
        if self.emulate:
            rings = "".join(f"ring_{t}_ptr, " for t in self.staged) + "NC: tl.constexpr, KEEP: tl.constexpr, RING: tl.constexpr"
            L = ["@triton.jit",
                 f"def {self.name}_emulated({sig}, {rings if part else 'NC: tl.constexpr'}, CR: tl.constexpr, "
                 "CW: tl.constexpr, EVEN: tl.constexpr):",
                 "    # the compute partition's arithmetic with its chunks loaded from global memory",
                 "    z_pid = tl.program_id(0)",
                 "    z_P = tl.num_programs(0)",
                 "    z_sub = tl.arange(0, CR)",
                 "    z_lane = tl.arange(0, CW)",
                 "    nj_f = n_j * 1.0"]
            if part:   # this program's scratch ring: the slots' stand-in
                L.append("    z_rb = z_pid * ((KEEP + RING) * CR * CW)")
        else:
            L = ["@gluon.jit",
                 f"def _{self.name}_compute({'G: gl.constexpr, ' if two else ''}{sig}, full, empty, {slots}, {outs}"
                 f"NC: gl.constexpr, NBUF: gl.constexpr, {'KEEP: gl.constexpr, RING: gl.constexpr, ' if part else ''}"
                 "CR: gl.constexpr, CW: gl.constexpr, EVEN: gl.constexpr, NW: gl.constexpr):",
                 "    # the compute warps: pass 1 folds each row's chunks as they land, pass 2 writes the",
                 "    # outputs from the same slots and releases each to the copy warp",
                 "    BL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CW // 8), CW // 8], [NW, 1], [1, 0])",
                 "    ROW_L: gl.constexpr = gl.SliceLayout(1, BL)",
                 "    z_pid = gl.program_id(0)",
                 "    z_P = gl.num_programs(0)",
                 "    z_sub = gl.arange(0, CR, layout=ROW_L)",
                 "    z_lane = gl.arange(0, CW, layout=gl.SliceLayout(0, BL))",
                 "    nj_f = n_j * 1.0"]
        for a in self.row_axes:
            L.append(f"    len_{a}_f = len_{a} * 1.0")
        L.append("    z_mine = (n_rows - z_pid + z_P - 1) // z_P")
        if two and self.emulate:   # the groups' rows in turn: group 0's (even k), then group 1's (odd k)
            L.append("    z_n0 = (z_mine + 1) // 2")
            L.append("    for z_i in range(0, z_mine):")
            L.append("        z_k = tl.where(z_i < z_n0, 2 * z_i, 2 * (z_i - z_n0) + 1)")
        elif two:
            L.append("    # this group's next fill of slot s has parity bit s of z_ph (its own full barriers)")
            L.append("    z_ph = z_pid.to(tl.int64) * 0")
            L.append("    z_one = z_ph + 1")
            L.append("    for z_k in range(G, z_mine, 2):   # rows G, G + 2, ... of the program")
        else:
            L.append("    for z_k in range(0, z_mine):")
        ind = "        "
        L.append(f"{ind}z_row = z_pid + z_k * z_P")
        if part:
            L.append(f"{ind}z_u0 = z_k * (2 * (NC - KEEP))   # the row's first fill of the rotating slots")
        else:
            L.append(f"{ind}z_base = z_k * NC")
        self.row_setup(L, ind)
        L.append(f"{ind}# ---- pass 1: the row's chunks as they land, carrying {', '.join(names)} per sub-row")
        L.append(f"{ind}z_c = 0")
        if part:
            partial_form.pass1_wait(self, L, ind, True)
        else:
            self._wait_chunk(L, ind, "z_base", two)
        self.chunk_setup(L, ind)
        self.emit_states(p, p.init, L, ind, "init", "init")
        L.append(f"{ind}n_a = n_b")
        L.append(f"{ind}for z_c in range(1, NC):")
        i2 = ind + "    "
        if part:
            partial_form.pass1_wait(self, L, i2, False)
        else:
            L.append(f"{i2}z_t = z_base + z_c")
            self._wait_chunk(L, i2, "z_t", two)
        self.chunk_setup(L, i2)
        self.emit_states(p, p.rolling, L, i2, "roll", "rolling")
        L.append(f"{i2}n_a = n_a + n_b")
        if part:
            partial_form.pass1_release(self, L, i2)
        L.append(f"{ind}# the sub-rows' partial states folded into the row's with the derived merge")
        L.append(f"{ind}{', '.join(names)}, n_a = tl.reduce(({', '.join(names)}, n_a), 0, _{self.name}_merge)")
        for q in names:
            L.append(f"{ind}{q} = {q} + tl.zeros([BLOCK_R], tl.float32)")
        ctx, em = self.region("final", ind)
        self.emit_refs(p, em, L)
        if any(o not in self.enc.elementwise_outputs for o in self.outputs):
            self.emit_row_outputs_staged(L, ind)
        L.append(f"{ind}# ---- pass 2: the outputs elementwise over {self.axis!r}, from the staged chunks")
        B = [] if part else [f"{i2}z_t = z_base + z_c"]
        if self.tma_store:
            B.append(f"{i2}z_ob = z_t % 2")
            B.append(f"{i2}z_orow = z_row * NSUB + z_c * CR")
            B.append(f"{i2}if EVEN:   # the copy out of this buffer two chunks ago has read it")
            B.append(f"{i2}    tma.store_wait({len(self.elem_out)})")
            B.append(f"{i2}    _sync()")
        if part:
            partial_form.pass2_slot(self, B, i2)
        elif not self.emulate:
            B.append(f"{i2}z_slot = z_t % NBUF")
        self.chunk_setup(B, i2)
        self.emit_elem_outputs_staged(B, i2)
        if not self.emulate:
            B.append(f"{i2}_sync()   # every compute warp has read the slot")
            B.append(f"{i2}mbarrier.arrive(empty.index(z_slot), count=1)")
        self.pass2(L, B, ind)
        if self.emulate:
            return self._exp("\n\n\n".join([self.merge_fn(p).replace("@gluon.jit", "@triton.jit"), "\n".join(L)]))
        if self.tma_store:
            L.append("    tma.store_wait(0)   # the last copies out have read their buffers")
        compute = _gluonize(self._exp("\n".join(L)))
        if part:
            copy = _gluonize(partial_form.copy_partition(self, descs, slots))
            K, wrappers = partial_form.partial_kernel(self, sig, slots, descs, dts), []
        else:
            copy = _gluonize(copy_partition(self, two, descs, slots))
            K, wrappers = staged_kernel(self, two, sig, slots, descs, dts, outs)
        parts = [_gluonize(self._exp(self.merge_fn(p))), compute] + wrappers
        return "\n\n\n".join(parts + [copy, _gluonize("\n".join(K))])

    def module(self) -> str:
        kern = self.kernel()
        # (a helper passed as a reduction's combine function is named without a call)
        own = [re.sub(r"\btl\.", "gl.", h.replace("@triton.jit", "@gluon.jit"))
               for h in OWN_HELPERS.split("\n\n\n") if re.search(rf"\b{h.split('def ')[1].split('(')[0]}\(", kern)]
        helpers = _helpers(re.sub(r"\b(_max_nan|_min_nan)\b(?!\()", r"\1(", kern + "\n".join(own))) + own
        explain = self.f.explain().replace('"""', "'''")
        head = STAGED_HEADER.format(name=self.name, axis=self.axis, explain=explain)
        if self.partial:   # (codegen/row_gluon_partial.py)
            head = head.replace("each row read once into a shared-memory ring.",
                                "partial staging: a row longer than the ring,\nits first KEEP chunks "
                                "read once, the others twice (through RING rotating slots).")
        if "PROPAGATE_ALL" in kern or any("PROPAGATE_ALL" in h or "PropagateNan" in h for h in helpers):
            head += "PROPAGATE_ALL = gl.constexpr(tl.PropagateNan.ALL)   # max/min propagate NaN, as torch\n"
        helpers = [h.replace("gl.PropagateNan.ALL", "PROPAGATE_ALL") for h in helpers]
        if any("libdevice." in x for x in helpers + [kern]):
            head += "from triton.language.extra import libdevice\n"
        return "\n\n".join([head] + helpers + [kern]) + "\n"


def emulation_source(fusion, **opts) -> str:
    """A Triton module (codegen/row.py's header and helpers) whose kernel ``<name>_emulated`` is
    the staged kernel's compute partition, the same generated arithmetic (chunks of CR sub-rows
    of CW, per-sub-row states, the merge over sub-rows, the masks), with each chunk loaded from
    global memory instead of its ring slot: what Triton's interpreter can check on the CPU. Its
    arguments: the staged kernel's, without NSUB, NBUF and the dtypes. ``opts``: StagedGen's
    (exp2, hoist, qfast, rows_in_flight: with 2, the two groups' rows in turn; partial: the slots
    emulated too, a scratch ring per program after the inputs and outputs, KEEP and RING)."""
    from acefuse.codegen.row import HEADER
    g = StagedGen(fusion, emulate=True, **opts)
    kern = g.kernel()
    kern = re.sub(r"tl\.(zeros|full)\(\[BLOCK_R\], ", r"tl.\1([CR], ", kern)
    kern = re.sub(r"\[BLOCK_R, BLOCK_J\]", "[CR, CW]", kern)
    head = HEADER.format(name=g.name, axis=g.axis, explain="the staged kernel's arithmetic, emulated")
    own = OWN_HELPERS + "\n\n\n" if re.search(r"\b(_qfast|_expf)\(", kern) else ""
    return head + "\n\n" + own + kern + "\n"


def staged_source(fusion, **opts) -> str:
    """The staged Gluon module source of a row-family Fusion (CodegenError, a ValueError, where
    the program has no staged form); ``opts``: StagedGen's (tma_store, exp2, hoist, qfast,
    rows_in_flight, partial)."""
    return StagedGen(fusion, **opts).module()


__all__ = ["StagedGen", "RowStagedKernel", "auto_staged", "compile_staged", "staged_source"]
