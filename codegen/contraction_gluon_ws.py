"""The warp-specialised Gluon kernels of the contraction family (issue 15, phase 2), as the
methods ``GluonGen`` (codegen/contraction_gluon.py) takes from ``WarpSpecialised``:
FlashAttention-3's structure, a TMA load partition feeding a ring of key/value stages and two
consumer warpgroups with a query tile each (``kernel_ws``; options ``pingpong``, ``overlap``,
``defer``), and the persistent kernel walking work items (``kernel_ws_persistent``; option
``dynamic``). The template's text (prologue, mask analysis, key loops, stores) is cut and
placed into the partitions here; codegen/contraction_gluon.py holds the phase-1 kernel, the
module and the automatic choice, codegen/contraction_gluon_launch.py the launch."""
from __future__ import annotations

import re

from acefuse.codegen.emit import CodegenError
from acefuse.codegen.contraction import _drop_dead
from acefuse.codegen.gluon_text import STORE_LAYOUTS, _gluonize, scan_layouts


class WarpSpecialised:
    """The warp-specialised kernels' text (a mixin of GluonGen: it reads the generator's
    fusion, names and options)."""

    def _layouts(self, nw):
        """The register and shared-memory layouts of a function run by ``nw`` warps."""
        return [f"    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[{nw}, 1], "
                "instr_shape=[16, INSTR_N, 16])",
                "    ROW_L: gl.constexpr = gl.SliceLayout(1, MMA)   # one value per query row",
                "    COL_L: gl.constexpr = gl.SliceLayout(0, MMA)   # one value per key / value column",
                "    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)",
                f"    SCAN_L: gl.constexpr = gl.BlockedLayout([1], [32], [{nw}], [0])",
                *scan_layouts(nw, self.scan_lookups()),
                STORE_LAYOUTS.format(nw=nw)]

    def _ws_parts(self, what, pids=None):
        """The template's prologue, key loop and stores cut for the warp-specialised kernels:
        (prologue, the parent's prologue whose row bounds cover both consumers' rows, a
        consumer's prologue over its own warpgroup's rows, the mask analysis before the key
        loops, the key loops, the stores). ``pids``: prologue lines (by their start) replaced
        in all three prologues (the persistent kernel's work item)."""
        self._begin()
        pro, body, store = [], [], []
        self.prologue(pro)
        # the mask analysis' lookups at the query rows read both consumers' rows (_pair_bounds)
        self.ROWS_OF_ANALYSIS = "pr_" if self.row_lookups() else ""
        try:
            self.key_loop(body, "0", "n_j")
        finally:
            del self.ROWS_OF_ANALYSIS
        self.store_outputs(store)
        cut = [i for i, ln in enumerate(body) if ln.startswith("    b = ")]
        pid = [i for i, ln in enumerate(pro) if ln.startswith(tuple(pids or ()))]
        rows_ln = [i for i, ln in enumerate(pro) if ln.startswith("    rows = pid_r * BLOCK_I + ")]
        lohi = [i for i, ln in enumerate(pro) if ln.startswith(tuple(f"    {a}_{b} = " for a in self.R
                                                                     for b in ("lo", "hi")))]
        if (len(cut) != 1 or len(rows_ln) != 1 or len(lohi) != 2 * len(self.R)
                or lohi != list(range(lohi[0], lohi[0] + len(lohi))) or len(pid) != len(pids or ())):
            raise CodegenError("the contraction template's prologue or key loop changed shape; "
                               f"codegen/contraction_gluon_ws.py ({what}) needs updating")
        for i in pid:
            pro[i] = next(v for k, v in pids.items() if pro[i].startswith(k))
        assert rows_ln[0] < lohi[0]   # (the rows line keeps its index in par_pro)
        par_pro = pro[:lohi[0]] + ["\n".join(self._pair_bounds())] + pro[lohi[-1] + 1:]
        con_pro = list(par_pro if pids else pro)   # (the one-shot kernel's consumers keep the template's bounds)
        con_pro[rows_ln[0]] = "    rows = (pid_r * 2 + WG) * BLOCK_I + tl.arange(0, BLOCK_I)   # this warpgroup's rows"
        return pro, par_pro, con_pro, body[:cut[0] + 1], body[cut[0] + 1:], store

    def _ring_init(self, per_wg):
        """The barriers' initialisation: one of each ``per_wg`` name per consumer warpgroup, and
        per ring stage its key and value arrivals and its release by both consumers. With
        ``stage_store`` the ``turn`` barriers (ping-pong's, unused then) count both consumers:
        ``turn[0]`` says that both finished their last P @ V (``_stage_store``)."""
        both = getattr(self, "stage_store", False)
        return (["    for w in gl.static_range(2):"]
                + [f"        mbarrier.init({b}.index(w), count={2 if both and b == 'turn' else 1})"
                   + ("   # both consumers' last P @ V (stage_store)" if both and b == "turn" else "")
                   for b in per_wg]
                + ["    for st in gl.static_range(NS):",
                   "        mbarrier.init(k_bar.index(st), count=1)",
                   "        mbarrier.init(v_bar.index(st), count=1)",
                   "        mbarrier.init(kv_free.index(st), count=2)   # released by both consumers",
                   "    fence_async_shared()"])

    def kernel_ws(self) -> str:
        """The warp-specialised kernel (FlashAttention-3's structure, issue 15 phase 2): one
        program owns ``2 * BLOCK_I`` query rows. The parent region runs the template's
        prologue and mask analysis over all of them (so every partition walks the same key
        tiles), makes the TMA descriptors and the shared-memory ring, and forks:
        - a load partition (one warp) copies the two query tiles, then each visible key tile's
          key and value tiles into stage ``t % NS`` of the ring (``k_bar`` / ``v_bar`` signal
          them complete), after both consumers released that stage's previous tile
          (``kv_free``, two arrivals);
        - two consumer partitions (one warpgroup each; the first is the default partition)
          each own ``BLOCK_I`` rows and run the template's key loop on them: the derived
          rolling update of every state, unchanged, with the score MMA on the key tile of the
          current stage and the P @ V MMA on its value tile; each releases the stage after
          its P @ V. With ``pingpong`` (FlashAttention-3's inter-warpgroup schedule) their MMAs
          alternate in blocks, P @ V of tile t and the score of tile t+1, so one warpgroup's
          exponentials run during the other's MMAs (``turn`` barriers: warpgroup w waits on
          ``turn[w]`` before its block, and arrives on ``turn[1 - w]`` after it). With
          ``overlap`` each consumer issues the next tile's score MMA before this tile's math.
        """
        qn, kn, vn = self.q_name, self.k_name, self.v_name
        # the program's rows: its query axes flattened (n_rows); the mask analysis of the parent
        # covers both consumers' rows
        pro, par_pro, con_pro, analysis, loops, store = self._ws_parts("kernel_ws")
        sig = ", ".join(self.sig())
        consts = ("BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, BLOCK_E: gl.constexpr, BLOCK_D: gl.constexpr, "
                  "DOT_T: gl.constexpr, SCAN: gl.constexpr, INSTR_N: gl.constexpr, NS: gl.constexpr")
        # the consumers' constexprs (the element type: their query buffers' own)
        ccons = ("BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, BLOCK_E: gl.constexpr, BLOCK_D: gl.constexpr, "
                 "SCAN: gl.constexpr, INSTR_N: gl.constexpr, NS: gl.constexpr")
        cargs = "BLOCK_I, BLOCK_J, BLOCK_E, BLOCK_D, SCAN, INSTR_N, NS"
        ring = "q_bufs, k_smem, v_smem, q_bar, k_bar, v_bar, kv_free, turn"

        # -- parent ------------------------------------------------------------------
        P = ["@gluon.jit",
             f"def {self.name}_gluon({sig}, {consts}, REGS: gl.constexpr, num_warps: gl.constexpr):",
             "    # grid: (pairs of query row tiles, grid axes). Warp-specialised: a load partition feeds",
             "    # a ring of NS key/value stages; two consumer warpgroups fold the key tiles into the",
             "    # derived states of their own BLOCK_I rows (kernel_ws in codegen/contraction_gluon_ws.py).",
             ] + self._layouts("num_warps") + [
             "    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_I, BLOCK_D], DOT_T)",
             "    K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_J, BLOCK_D], DOT_T)",
             "    V_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_J, BLOCK_E], DOT_T)"]
        P += par_pro + analysis
        P += ["    # TMA descriptors of this program's (rows, inner axis) matrices: zeros past the ends"]
        P += self._tma_descs()
        P += ["    # the two consumers' query tiles; the key/value ring of NS stages",
              f"    q_bufs = gl.allocate_shared_memory(DOT_T, [2, BLOCK_I, BLOCK_D], {qn}_desc.layout)",
              f"    k_smem = gl.allocate_shared_memory(DOT_T, [NS, BLOCK_J, BLOCK_D], {kn}_desc.layout)",
              f"    v_smem = gl.allocate_shared_memory(DOT_T, [NS, BLOCK_J, BLOCK_E], {vn}_desc.layout)",
              "    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
              "    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
              "    k_bar = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())",
              "    v_bar = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())",
              "    kv_free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())",
              *self._ring_init(("q_bar", "turn")),
              "    gl.warp_specialize([",
              f"        (_{self.name}_consume0, ({sig}, first, a, b, end, {ring}, {cargs})),",
              f"        (_{self.name}_consume1, ({sig}, first, a, b, end, {ring}, {cargs})),",
              f"        (_{self.name}_load, (pid_r, first, end, {qn}_desc, {kn}_desc, {vn}_desc, {ring}, BLOCK_I, "
              "BLOCK_J, NS)),",
              "    ], [4, 1], [REGS, 24])",
              "    for w in gl.static_range(2):",
              "        mbarrier.invalidate(q_bar.index(w))",
              "        mbarrier.invalidate(turn.index(w))",
              "    for st in gl.static_range(NS):",
              "        mbarrier.invalidate(k_bar.index(st))",
              "        mbarrier.invalidate(v_bar.index(st))",
              "        mbarrier.invalidate(kv_free.index(st))"]

        # -- load partition ------------------------------------------------------------
        Ld = ["@gluon.jit",
              f"def _{self.name}_load(pid_r, first, end, {qn}_desc, {kn}_desc, {vn}_desc, {ring}, "
              "BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, NS: gl.constexpr):",
              "    # the load partition: the two query tiles, then the visible key tiles in order,",
              "    # stage t % NS once both consumers released its previous tile (a fresh barrier",
              "    # counts as released: its wait for the phase before the first passes)",
              "    for w in gl.static_range(2):",
              f"        mbarrier.expect(q_bar.index(w), {qn}_desc.block_type.nbytes)",
              f"        _tma_load({qn}_desc, [(pid_r * 2 + w) * BLOCK_I, 0], q_bar.index(w), q_bufs.index(w))",
              "    for start in range(first, end, BLOCK_J):",
              "        t_i = (start - first) // BLOCK_J",
              "        stage = t_i % NS",
              "        mbarrier.wait(kv_free.index(stage), ((t_i // NS) & 1) ^ 1)",
              f"        mbarrier.expect(k_bar.index(stage), {kn}_desc.block_type.nbytes)",
              f"        _tma_load({kn}_desc, [start, 0], k_bar.index(stage), k_smem.index(stage))",
              f"        mbarrier.expect(v_bar.index(stage), {vn}_desc.block_type.nbytes)",
              f"        _tma_load({vn}_desc, [start, 0], v_bar.index(stage), v_smem.index(stage))"]

        # -- consumer partitions ---------------------------------------------------------
        C = ["@gluon.jit",
             f"def _{self.name}_consume(WG: gl.constexpr, {sig}, first, a, b, end, {ring}, {ccons}):",
             "    # a consumer warpgroup: the template's key loop over the ring, on rows WG of the pair",
             "    DOT_T: gl.constexpr = q_bufs.dtype"
             ] + self._layouts(4) + con_pro
        C += ["    q_smem = q_bufs.index(WG)",
              "    mbarrier.wait(q_bar.index(WG), 0)"]
        C += self.hoisting + self._ws_pipeline(loops) + self._stage_store(store, "", "0")
        wrappers = []
        for w in (0, 1):
            wrappers += ["@gluon.jit",
                         f"def _{self.name}_consume{w}({sig}, first, a, b, end, {ring}, {ccons}):",
                         f"    _{self.name}_consume({w}, {sig}, first, a, b, end, {ring}, {cargs})", ""]
        funcs = [_drop_dead("\n".join(C)), "\n".join(wrappers).rstrip(), "\n".join(Ld), _drop_dead("\n".join(P))]
        return _gluonize("\n\n\n".join(funcs))

    @staticmethod
    def _pingpong_start():
        return ["    # ping-pong: the second warpgroup's first score MMA waits for the first one's",
                "    if WG == 1:",
                "        mbarrier.wait(turn.index(1), 0)"]

    @staticmethod
    def _pingpong_end():
        # the second warpgroup's wait before its last P @ V is for the first one's score MMA of
        # the tile after the last: that arrival is made here (mbarrier waits are by phase
        # parity, so a missing arrival would hang it and an early one would not pass it twice:
        # neither warpgroup gets two arrivals ahead of the other's waits)
        return ["    if WG == 0:   # ping-pong: the turn after the last score MMA",
                "        mbarrier.arrive(turn.index(1), count=1)"]

    @staticmethod
    def _pingpong_item_start():
        # the persistent kernel, per work item: turn[1] has had tc + it arrivals before this
        # item (one per score MMA of the first warpgroup, and one at the end of each item)
        return ["    if WG == 1:   # ping-pong: this item's first score MMA waits for the first warpgroup's",
                "        mbarrier.wait(turn.index(1), (tc + it) & 1)"]

    @staticmethod
    def _pingpong_item_end():
        # the persistent kernel, per work item. Without these lines (session 14, an H200) the
        # second warpgroup's last P @ V of an item waited for the first one's next score MMA, of
        # the next item, whose key tile the load partition copies only after the second
        # warpgroup released its query buffer at the end of this item: a deadlock wherever a
        # program has two or more items. Here each item ends its turns itself: the first
        # warpgroup's arrival after its last score (the one-shot kernel's _pingpong_end), which
        # the second one's last wait takes; and, since mbarrier waits are by phase parity, the
        # first warpgroup does not start the next item (its next arrival on turn[1]) before the
        # second one took that arrival: the second warpgroup acknowledges on turn[0] (tc + it
        # arrivals before this item there too: one per score MMA, one acknowledgement per item)
        n = "(end - first + BLOCK_J - 1) // BLOCK_J"
        return ["    if WG == 0:   # ping-pong: the turn after this item's last score MMA",
                "        mbarrier.arrive(turn.index(1), count=1)",
                "    else:   # taken (its last wait is behind it): the first warpgroup may start the next item",
                "        mbarrier.arrive(turn.index(0), count=1)",
                "    if WG == 0:",
                f"        mbarrier.wait(turn.index(0), (tc + {n} + it) & 1)"]

    def kernel_ws_persistent(self) -> str:
        """The persistent warp-specialised kernel: ``grid = (number of SMs,)``; each program walks
        work items (a pair of query row tiles of one grid-axes slice; the longest first) with
        its partitions in step: the load partition copies the items' query tiles (once both
        consumers released the previous ones: ``q_free``, right after the item's last score MMA
        without ping-pong or overlap, else at the item's end) and key/value tiles into the ring,
        whose stages and phases run on over the items (``tc``: tiles so far); each consumer
        folds its rows' tiles into the derived states and stores its outputs while the load
        partition already copies the next item's tiles. The TMA descriptors are made once, over
        each operand flattened to ``(grid axes x rows, inner axis)``: the launcher takes this
        kernel only when the strides nest that way and every key tile is whole (a partial last
        tile would read the next slice's keys; query rows past the end only feed rows that are
        not stored)."""
        qn, kn, vn = self.q_name, self.k_name, self.v_name
        (c,), (e,) = self.C, self.E
        qrows, qstride = self._q_rows()
        # the items in groups of n_hg grid-axes slices whose keys and values fill half of L2 (L2_KB,
        # the device's): within a group the longest row tiles first, slice by slice, so that the
        # programs running at one time read the keys of few slices (each from L2 after the first
        # read) and the static round robin over the items stays longest-first
        pids = {"    pid_r = ": "\n".join([
                    f"    n_hg = gl.minimum(gl.maximum(L2_KB * 256 // (n_j * (len_{c} + len_{e})), 1), n_g)",
                    "    g0 = (item // (n_rp * n_hg)) * n_hg   # the item's group: slices g0 ..",
                    "    hg = gl.minimum(n_hg, n_g - g0)",
                    "    w_i = item - g0 * n_rp",
                    "    pid_r = n_rp - 1 - w_i // hg   # the longest row tiles first"]),
                "    pid_g = ": "    pid_g = g0 + w_i % hg"}
        self._pp_items = True   # the turn phases count work items too (GContext.reduce_tile)
        # every key tile is whole here (the launcher's condition) and rows past the end are not
        # stored: the masked tiles apply the program's mask alone, without the bounds mask of
        # rows and keys (session 20, offline sm_90 SASS of the sliding window's kernel: 9584 ->
        # 8256 instructions, of the 3256 the masks add)
        self.whole_tiles = True
        try:
            tpro, pro, con_pro, analysis, loops, store = self._ws_parts("kernel_ws_persistent", pids)
        finally:
            self._pp_items = self.whole_tiles = False
        n_g = " * ".join(f"len_{a}" for a in self.G) or "1"
        sig = ", ".join(self.sig())
        ccons = ("BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, BLOCK_E: gl.constexpr, BLOCK_D: gl.constexpr, "
                 "SCAN: gl.constexpr, INSTR_N: gl.constexpr, NS: gl.constexpr, L2_KB: gl.constexpr")
        cargs = "BLOCK_I, BLOCK_J, BLOCK_E, BLOCK_D, SCAN, INSTR_N, NS, L2_KB"
        dyn = self.dynamic
        ring = "q_bufs, k_smem, v_smem, q_bar, q_free, k_bar, v_bar, kv_free, turn" + (", item_buf" if dyn else "")
        cnt = ", cnt_ptr" if dyn else ""
        nm = f"{self.name}_p"

        def loop_over_items(lines, role=None):
            """Top-level lines (4 spaces) -> the body of the loop over work items. Dynamic: the
            load partition takes each item from the counter and publishes it (``item_buf``,
            written once both consumers released their query buffers, read by them after their
            query tile landed); past the last item it publishes ``n_items`` and arrives on the
            query barriers without a copy, which ends the consumers' loops."""
            body = ["    " + ln if ln.strip() else ln for ln in _drop_dead("\n".join(lines)).split("\n")]
            head = ["    tc = 0   # key tiles so far (the ring's stage and phase)",
                    "    it = 0   # items so far (the query buffers' phase)"]
            if not dyn:
                return head + ["    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):"] + body
            take = "    item = gl.max(item_buf.index(0).load(SCAN_L), axis=0)   # the item the load partition took"
            if role == "load":
                return (head + ["    item = gl.atomic_add(cnt_ptr, 1)   # the next free work item",
                                "    while item < n_items:"] + body
                        + ["        item = gl.atomic_add(cnt_ptr, 1)",
                           "    for w in gl.static_range(2):   # the end: the consumers read n_items",
                           "        mbarrier.wait(q_free.index(w), (it & 1) ^ 1)",
                           "    item_buf.index(0).store(gl.full([1], n_items, gl.int32, layout=SCAN_L))",
                           "    for w in gl.static_range(2):",
                           "        mbarrier.arrive(q_bar.index(w), count=1)"])
            return (head + ["    mbarrier.wait(q_bar.index(WG), 0)", take, "    while item < n_items:"] + body
                    + ["        mbarrier.wait(q_bar.index(WG), it & 1)", "    " + take])

        P = ["@gluon.jit",
             f"def {self.name}_gluon_persistent({sig}{cnt}, {ccons}, DOT_T: gl.constexpr, REGS: gl.constexpr, "
             "num_warps: gl.constexpr):",
             "    # grid: (programs,), each walking work items: pairs of query row tiles x grid-axes slices",
             "    # (kernel_ws_persistent in codegen/contraction_gluon_ws.py)",
             "    Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_I, BLOCK_D], DOT_T)",
             "    K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_J, BLOCK_D], DOT_T)",
             "    V_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_J, BLOCK_E], DOT_T)",
             f"    n_g = {n_g}",
             "    n_rp = (n_rows + 2 * BLOCK_I - 1) // (2 * BLOCK_I)",
             "    n_items = n_rp * n_g",
             "    # TMA descriptors over the operands flattened to (grid axes x rows, inner axis)"] + \
            self._tma_descs(spans_grid=True) + [
             f"    q_bufs = gl.allocate_shared_memory(DOT_T, [2, BLOCK_I, BLOCK_D], {qn}_desc.layout)",
             f"    k_smem = gl.allocate_shared_memory(DOT_T, [NS, BLOCK_J, BLOCK_D], {kn}_desc.layout)",
             f"    v_smem = gl.allocate_shared_memory(DOT_T, [NS, BLOCK_J, BLOCK_E], {vn}_desc.layout)",
             "    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
             "    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
             "    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())",
             "    k_bar = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())",
             "    v_bar = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())",
             "    kv_free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())"] + (
            ["    item_buf = gl.allocate_shared_memory(gl.int32, [1, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))"]
            if dyn else []) + [
             *self._ring_init(("q_bar", "q_free", "turn")),
             "    gl.warp_specialize([",
             f"        (_{nm}_consume0, ({sig}, n_rp, n_g, n_items, {ring}, {cargs})),",
             f"        (_{nm}_consume1, ({sig}, n_rp, n_g, n_items, {ring}, {cargs})),",
             f"        (_{nm}_load, ({sig}{cnt}, n_rp, n_g, n_items, {qn}_desc, {kn}_desc, {vn}_desc, {ring}, {cargs})),",
             "    ], [4, 1], [REGS, 24])",
             "    for w in gl.static_range(2):",
             "        mbarrier.invalidate(q_bar.index(w))",
             "        mbarrier.invalidate(q_free.index(w))",
             "        mbarrier.invalidate(turn.index(w))",
             "    for st in gl.static_range(NS):",
             "        mbarrier.invalidate(k_bar.index(st))",
             "        mbarrier.invalidate(v_bar.index(st))",
             "        mbarrier.invalidate(kv_free.index(st))"]

        qload = (["    for w in gl.static_range(2):   # the query tiles, once both consumers released the last ones",
                  "        mbarrier.wait(q_free.index(w), (it & 1) ^ 1)"]
                 + (["    item_buf.index(0).store(gl.full([1], item, gl.int32, layout=SCAN_L))   # this item, for the consumers",
                     "    for w in gl.static_range(2):"] if dyn else []))
        # the load partition's scan: with lookups over the key tiles, one tile a step (SCAN_LD),
        # since its one warp of 24 registers would hold [SCAN, BLOCK_J] values per thread array and
        # spill (offline sm_90, the document mask: 1402 local loads in it at SCAN = 16, 36 at 1);
        # first and end, all it reads, come out the same at any step width
        lk = self.scan_lookups()
        ld_analysis = [re.sub(r"\bSCAN\b", "SCAN_LD", ln) for ln in analysis] if lk else analysis
        ld_body = pro + ld_analysis + qload + [
            f"        mbarrier.expect(q_bar.index(w), {qn}_desc.block_type.nbytes)",
            f"        _tma_load({qn}_desc, [pid_g * {qrows} + (pid_r * 2 + w) * BLOCK_I, 0], q_bar.index(w), "
            "q_bufs.index(w))",
            "    for start in range(first, end, BLOCK_J):",
            "        t_i = tc + (start - first) // BLOCK_J",
            "        stage = t_i % NS",
            "        mbarrier.wait(kv_free.index(stage), ((t_i // NS) & 1) ^ 1)",
            f"        mbarrier.expect(k_bar.index(stage), {kn}_desc.block_type.nbytes)",
            f"        _tma_load({kn}_desc, [pid_g * n_j + start, 0], k_bar.index(stage), k_smem.index(stage))",
            f"        mbarrier.expect(v_bar.index(stage), {vn}_desc.block_type.nbytes)",
            f"        _tma_load({vn}_desc, [pid_g * n_j + start, 0], v_bar.index(stage), v_smem.index(stage))",
            "    tc = tc + (end - first + BLOCK_J - 1) // BLOCK_J",
            "    it = it + 1"]
        Ld = ["@gluon.jit",
              f"def _{nm}_load({sig}{cnt}, n_rp, n_g, n_items, {qn}_desc, {kn}_desc, {vn}_desc, {ring}, {ccons}):",
              "    # the load partition (one warp): per item, the query tiles, then the visible key tiles",
              "    MMA: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])   # one warp: index math only",
              "    ROW_L: gl.constexpr = gl.SliceLayout(1, MMA)",
              "    COL_L: gl.constexpr = gl.SliceLayout(0, MMA)",
              "    SCAN_L: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])",
              *scan_layouts(1, lk)] + (["    SCAN_LD: gl.constexpr = 1   # key tiles a scan step (above)"] if lk else []) \
            + loop_over_items(ld_body, "load")

        con_body = con_pro + analysis + ["    q_smem = q_bufs.index(WG)"]
        if not dyn:   # (dynamic: waited on before the item is read)
            con_body += ["    mbarrier.wait(q_bar.index(WG), it & 1)"]
        if self.pingpong:
            con_body += self._pingpong_item_start()
        pipe = self._ws_pipeline(loops, base="tc + ")
        if self.pingpong or self.overlap:
            con_body += self.hoisting + pipe
            if self.pingpong:
                con_body += self._pingpong_item_end()
            con_body += ["    mbarrier.arrive(q_free.index(WG), count=1)   # its last score MMA is complete"]
        else:
            own = self._own_range(tpro, con_pro, analysis, pipe) if self.own_range_opt and self.mask_sites() else None
            if own is None:
                con_body += self.hoisting + self._early_q_free(pipe)
            else:
                head, pipe = own
                self.own_range = True
                con_body = head + con_body[len(con_pro) + len(analysis):]
                con_body += self.hoisting + self._early_q_free(pipe, "first_w", "end_w")
                con_body += self._released_unread("end_w", "end", "after")
        con_body += self._stage_store(store, "tc + ", "it & 1") + ["    tc = tc + (end - first + BLOCK_J - 1) // BLOCK_J",
                                                                   "    it = it + 1"]
        C = ["@gluon.jit",
             f"def _{nm}_consume(WG: gl.constexpr, {sig}, n_rp, n_g, n_items, {ring}, {ccons}):",
             "    # a consumer warpgroup: per item, the template's key loop over the ring on rows WG of the pair",
             "    DOT_T: gl.constexpr = q_bufs.dtype"] + self._layouts(4)
        C += loop_over_items(con_body)
        wrappers = []
        for w in (0, 1):
            wrappers += ["@gluon.jit",
                         f"def _{nm}_consume{w}({sig}, n_rp, n_g, n_items, {ring}, {ccons}):",
                         f"    _{nm}_consume({w}, {sig}, n_rp, n_g, n_items, {ring}, {cargs})", ""]
        funcs = ["\n".join(C), "\n".join(wrappers).rstrip(), "\n".join(Ld), "\n".join(P)]
        return _gluonize("\n\n\n".join(funcs))

    def _stage_store(self, store, base, phase):
        """``stage_store``: the output tiles go through shared memory that is free by then instead
        of a layout conversion's scratch (which costs the ring a stage): the last key tile's
        value buffer, BLOCK_I of its rows per consumer, once both consumers' last P @ V are
        complete (``turn[0]``, two arrivals an item). Each warp writes its tile rows from the MMA
        layout and reads the same rows back in STORE_L (16 bytes a thread), then the stage is
        released to the load partition. ``base``: the running tile count before this item's
        tiles; ``phase``: ``turn[0]``'s phase this item. Without stage_store: ``store`` as is."""
        if not self.stage_store:
            return store
        last = f"(({base}(end - first + BLOCK_J - 1) // BLOCK_J - 1) % NS)"
        out, n = [], 0
        for ln in store:
            m = re.match(r"^(\s*)_sc = gl\.arange\(0, BLOCK_E, layout=SCOL_L\).*\n(\s*)tl\.store\((.*), "
                         r"gl\.convert_layout\((_out\(.*\)), STORE_L\), (mask=.*)\)$", ln, re.S)
            if m is None:
                out.append(ln)
                continue
            sp, _, ptr, val, mask = m.groups()
            if n == 0:
                out += [f"{sp}mbarrier.arrive(turn.index(0), count=1)   # this consumer's last P @ V is complete",
                        f"{sp}mbarrier.wait(turn.index(0), {phase})   # and the other's: the value buffer is free",
                        f"{sp}o_buf = v_smem.index({last}).slice(WG * BLOCK_I, BLOCK_I)"]
            n += 1
            out += [f"{sp}o_buf.store({val})   # the tile from the MMA layout, read back 16 bytes a thread",
                    f"{sp}_sc = gl.arange(0, BLOCK_E, layout=SCOL_L)",
                    f"{sp}tl.store({ptr}, o_buf.load(STORE_L), {mask})"]
        if n:
            out += ["    fence_async_shared()   # (the load partition's copies into the stage come after these reads)",
                    f"    mbarrier.arrive(kv_free.index({last}), count=1)   # the last tile's stage"]
        else:   # (no tile output: the last stage is released as every other)
            out.append(f"    mbarrier.arrive(kv_free.index({last}), count=1)")
        return out

    def _own_range(self, pro, con_pro, analysis, pipe):
        """``own_range``: the consumer's prologue and key loops over the key tiles its own rows
        see, or None where the template's loops are not the three the text expects. The load
        partition copies the tiles the pair's rows see (the mask analysis over both consumers'
        rows, as before); each consumer runs the same analysis over its own rows first (a box
        inside the pair's, so its tiles lie among the pair's: interval arithmetic only loses
        tiles as the box shrinks), folds those, evaluates the mask only on those its rows see
        partly, and releases the pair's others unread (``_released_unread``). Where the own
        analysis leaves the pair's tiles (rows past the end) or finds none, the consumer runs
        the pair's first tile masked, as the template runs a row tile that sees no key. Returns
        (the consumer's prologue and analyses, in place of ``con_pro + analysis``; the loops)."""
        loops = {"range(first, a, BLOCK_J)": "range(first_w, a_w, BLOCK_J)",
                 "range(a, b, BLOCK_J)": "range(a_w, b_w, BLOCK_J)",
                 "range(b, end, BLOCK_J)": "range(b_w, end_w, BLOCK_J)"}
        heads = tuple(f"    {a}_{b} = " for a in self.R for b in ("lo", "hi"))
        own_b = [ln.replace("pid_r * BLOCK_I", "(pid_r * 2 + WG) * BLOCK_I") for ln in pro if ln.startswith(heads)]
        pair = "\n".join(self._pair_bounds())
        found = [ln for ln in pipe if ln.lstrip().startswith("for start in ")]
        if (pair not in con_pro or len(own_b) != 2 * len(self.R) or len(found) != 3
                or any(k not in ln for k, ln in zip(loops, found))):
            return None
        k = con_pro.index(pair)
        body = (con_pro[:k] + ["    # this warpgroup's rows (own_range): the key tiles it folds"] + own_b
                + con_pro[k + 1:] + analysis
                + ["    first_w = first", "    a_w = a", "    b_w = b", "    end_w = end",
                   "    # both consumers' rows: the tiles the load partition copies (the ring's count)", pair]
                + analysis
                + ["    # this warpgroup's tiles among the pair's; rows that see none (or lie past the end) run",
                   "    # the pair's first tile, masked",
                   "    ok_w = (first_w >= first) & (end_w <= end) & (first_w < end_w)",
                   "    first_w = tl.where(ok_w, first_w, first)",
                   "    end_w = tl.where(ok_w, end_w, tl.minimum(first + BLOCK_J, end))",
                   "    a_w = tl.where(ok_w, tl.minimum(tl.maximum(a_w, first_w), end_w), end_w)",
                   "    b_w = tl.where(ok_w, tl.minimum(tl.maximum(b_w, a_w), end_w), end_w)"])
        out, first = [], True
        for ln in pipe:
            if ln.lstrip().startswith("for start in "):
                if first:
                    out += self._released_unread("first", "first_w", "before")
                    first = False
                for a, b in loops.items():
                    ln = ln.replace(a, b)
            out.append(ln)
        return body, out

    @staticmethod
    def _released_unread(lo, hi, where):
        """The pair's key tiles ``lo .. hi`` that this consumer's rows do not see (own_range):
        each stage released unread once its key and value tiles landed. The waits keep this
        consumer's view of the stage's barriers in step (mbarrier waits are by phase parity: a
        consumer that skipped a landing would see the barrier of the stage's next tile as two
        phases behind, i.e. complete, and read the stage before it lands), and they also order
        the arrival after both consumers' release of the stage's tile before (an earlier arrival
        would count towards that release)."""
        return [f"    for start in range({lo}, {hi}, BLOCK_J):   # the pair's tiles {where} this warpgroup's: "
                "released unread",
                "        t_i = tc + (start - first) // BLOCK_J",
                "        mbarrier.wait(k_bar.index(t_i % NS), (t_i // NS) & 1)",
                "        mbarrier.wait(v_bar.index(t_i % NS), (t_i // NS) & 1)",
                "        mbarrier.arrive(kv_free.index(t_i % NS), count=1)"]

    @staticmethod
    def _early_q_free(pipe, first="first", end="end"):
        """The persistent kernel's consumers (score MMAs waited on where issued): the query
        buffer released right after the item's last score MMA, so that the load partition copies
        the next item's query tile (and, behind it, its first key tiles) while this warpgroup
        still runs the last tile's exponentials, P @ V and the stores; an item without tiles
        (which the mask analysis never makes: a row tile that sees no key runs one masked tile)
        releases it at its end."""
        out, n = [], 0
        for ln in pipe:
            out.append(ln)
            m = re.match(r"(\s*)_dot_\d+ = warpgroup_mma\(q_smem, ", ln)
            if m:
                n += 1
                out += [f"{m.group(1)}if start + BLOCK_J >= {end}:   # the item's last score MMA: its query tile is free",
                        f"{m.group(1)}    mbarrier.arrive(q_free.index(WG), count=1)"]
        if n == 0:
            raise CodegenError("the persistent kernel's key loops have no score MMA on the query tile; "
                               "codegen/contraction_gluon_ws.py (_early_q_free) needs updating")
        return out + [f"    if {end} <= {first}:   # no tiles: the query tile is free at the item's end",
                      "        mbarrier.arrive(q_free.index(WG), count=1)"]

    def _defer(self, tile, ind):
        """One tile's body with its P @ V left running (defer): the state it updates is waited
        on where the body first reads it (the derived rescale of the accumulator, after the
        tile's exponentials), and the previous tile's stage released there."""
        pv = [re.match(r"\s*(\w+)_new = (_pv\d+)$", ln) for ln in tile]
        pv = [m.group(1) for m in pv if m]
        if len(pv) != 1:
            raise CodegenError(f"defer=True needs exactly one state updated by a P @ V MMA (found {pv})")
        acc = self._deferred = pv[0]
        for k, ln in enumerate(tile):
            lhs, eq, rhs = ln.partition(" = ")
            if eq and re.search(rf"\b{acc}\b", rhs):
                return (tile[:k] + [f"{ind}{acc} = warpgroup_mma_wait(0, deps=({acc},))   # the tile before's P @ V",
                                    f"{ind}mbarrier.arrive(kv_free.index((t_i + NS - 1) % NS), count=1, "
                                    "pred=start > first)   # the tile before's stage"] + tile[k:])
        raise CodegenError(f"defer=True: no read of the state {acc!r} in a tile's body")

    def _ws_pipeline(self, loops, base=""):
        """The consumers' key loops: at the top of each tile, wait for its key tile in stage
        ``t % NS`` (the value tile is waited on just before the P @ V MMA: GContext), and at
        the bottom release the stage to the load partition."""
        out, n = [], 0
        i = 0
        zeros = "gl.zeros([BLOCK_I, BLOCK_J], gl.float32, layout=MMA)"
        if self.pingpong and not base:   # (persistent: once, before the loop over items)
            out += self._pingpong_start()
        if self.overlap and not base:   # the first tile's score, before the loops
            out += ["    # the first tile's score (stage 0); each tile issues the next one's",
                    "    mbarrier.wait(k_bar.index(0), 0)",
                    f"    s_cur = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), {zeros}, use_acc=False)"]
        elif self.overlap:   # the first tile's score: tile `tc` of the running count
            out += ["    # the first tile's score; each tile issues the next one's",
                    "    mbarrier.wait(k_bar.index(tc % NS), (tc // NS) & 1)",
                    f"    s_cur = warpgroup_mma(q_smem, k_smem.index(tc % NS).permute((1, 0)), {zeros}, use_acc=False)"]
        acc = None
        if self.defer:   # the state a P @ V MMA updates: carried through the loops as an MMA accumulator
            accs = sorted({m.group(1) for m in (re.match(r"\s*(\w+)_new = _pv\d+$", ln) for ln in loops) if m})
            if len(accs) != 1:
                raise CodegenError(f"defer=True needs exactly one state updated by a P @ V MMA (found {accs})")
            acc = accs[0]
        while i < len(loops):
            ln = loops[i]
            out.append(ln)
            i += 1
            if acc and re.match(rf"    {acc} = tl\.full\(", ln):
                out.append(f"    {acc} = warpgroup_mma_init({acc})   # a P @ V MMA's accumulator, waited on in the loop")
            m = re.match(r"(\s*)for start in range\(", ln)
            if not m:
                continue
            n += 1
            ind = m.group(1) + "    "
            out += [f"{ind}t_i = {base}(start - first) // BLOCK_J",
                    f"{ind}stage = t_i % NS",
                    f"{ind}ph = (t_i // NS) & 1",
                    f"{ind}v_cur = v_smem.index(stage)"]
            if self.overlap:
                # the next tile's score MMA runs during this tile's math (past the last tile
                # it reads a stage no copy is writing, and is discarded)
                out += [f"{ind}more = start + BLOCK_J < end",
                        f"{ind}mbarrier.wait(k_bar.index((t_i + 1) % NS), ((t_i + 1) // NS) & 1, pred=more)",
                        f"{ind}s_next = warpgroup_mma(q_smem, k_smem.index((t_i + 1) % NS).permute((1, 0)), "
                        f"{zeros}, use_acc=False, is_async=True)"]
            else:
                out += [f"{ind}mbarrier.wait(k_bar.index(stage), ph)",
                        f"{ind}k_cur = k_smem.index(stage)"]
            tile = []
            while i < len(loops) and (not loops[i].strip() or len(loops[i]) - len(loops[i].lstrip()) >= len(ind)):
                tile.append(loops[i])
                i += 1
            if self.defer:
                out += self._defer(tile, ind)
                out.append(f"{ind}s_cur = warpgroup_mma_wait(1, deps=(s_next,))   # P @ V of this tile still runs")
                continue
            out += tile
            if self.stage_store:   # the last tile's value buffer stages the output tiles: released after them
                out.append(f"{ind}mbarrier.arrive(kv_free.index(stage), count=1, pred=start + BLOCK_J < end)")
            else:
                out.append(f"{ind}mbarrier.arrive(kv_free.index(stage), count=1)   # this tile's MMAs are complete")
            if self.overlap:
                out.append(f"{ind}s_cur = warpgroup_mma_wait(0, deps=(s_next,))")
        if n != 3:
            raise CodegenError(f"the contraction template's key loop changed shape ({n} tile loops, "
                               "expected 3); codegen/contraction_gluon_ws.py needs updating")
        if self.pingpong and not base:   # (persistent: once, after the loop over items)
            out += self._pingpong_end()
        if self.defer:   # the last tile's P @ V, and its stage
            acc = self._deferred
            out += [f"    {acc} = warpgroup_mma_wait(0, deps=({acc},))   # the last tile's P @ V",
                    f"    mbarrier.arrive(kv_free.index(({base}(end - first + BLOCK_J - 1) // BLOCK_J - 1) % NS), "
                    "count=1)"]
        if self.overlap and any("k_cur" in ln for ln in out):
            raise CodegenError("the overlapped Gluon pipeline left a read of k_cur; "
                               "codegen/contraction_gluon_ws.py needs updating")
        return out
