"""The ring of a sharded call (``exchange="ring"``, context parallelism): the sharded inputs
(K/V) travel around the ranks; each rank folds every visiting block's partial states into
its running ones with the derived merge, in the block's own kernel where the contraction
template allows (kernels.fold_kernel), else in torch (merge._merge2). A mixin of
ShardedKernel (sharded.py), which holds the plan, the kernels and the other exchanges."""
from __future__ import annotations

import warnings

from acefuse.rewrite.terms import reblock
from acefuse.distributed.base import (J, DistributedFallbackWarning, _uses, _device, ring_peers,
                                      ring_shift, gpos_inputs, count_input)
from acefuse.distributed.merge import StateEval, OUTPUT_OPS, _merge2
from acefuse.distributed.kernels import state_axes


class Ring:
    """The ring's methods of ShardedKernel (``self``: the sharded kernel)."""

    # -- the ring (context parallelism) -----------------------------------------------------
    def _chunks(self, src, sizes, zigzag):
        """[(local start, length, global offset)] of rank ``src``'s shard of the sharded axis:
        one contiguous piece, or (zig-zag) chunks ``src`` and ``2W - 1 - src`` of 2W equal chunks."""
        if not zigzag:
            return [(0, sizes[src], sum(sizes[:src]))]
        c = sizes[src] // 2
        return [(0, c, src * c), (c, c, (2 * len(sizes) - 1 - src) * c)]

    def _pieces(self, inputs, zigzag, offsets, sizes, rank):
        """The local inputs split where the zig-zag axes jump: [(inputs, offsets, {axis: (start, length)})]."""
        if not zigzag:
            return [(inputs, offsets, {})]
        out = []
        for start, n, off in self._chunks(rank, sizes, True):
            ins = {t: x.narrow(self.program.tensors[t].index(a), start, n)   # a view: the kernels take strides
                   for t, x in inputs.items() for a in [next((a for a in zigzag if a in self.program.tensors[t]), None)]
                   if a is not None}
            ins = {t: ins.get(t, x) for t, x in inputs.items()}
            offs = dict(offsets)
            offs.update({a: off for a in zigzag})
            out.append((ins, offs, {a: (start, n) for a in zigzag}))
        return out

    def _ring_plan(self, pieces, sizes, rank, zigzag, gsizes, kv_shapes):
        """The blocks the ring runs, per step: [[(chunk start, length, global offset, piece)]]:
        each (visiting key chunk, query piece) pair, less those whose mask the analysis proves
        excludes entirely (``_all_masked``) once the piece has states (its first block always
        runs: it starts the running states). Shapes only: no data is read."""
        import torch
        # (made once per layout: on a CPU of the H200 host a plan took ~0.2 ms, a tenth of a step)
        pkey = ("plan", tuple(sizes), rank, tuple(zigzag), tuple(sorted(gsizes.items())),
                tuple(sorted((t, tuple(s)) for t, s in kv_shapes.items())),
                tuple((tuple(sorted((t, tuple(x.shape)) for t, x in ins.items())), tuple(sorted(offs.items())))
                      for ins, offs, _ in pieces))
        if pkey in self._kernels:
            return self._kernels[pkey]
        world = len(sizes)
        started = [False] * len(pieces)
        steps = []
        for step in range(world):
            src = (rank - step) % world
            blocks = []
            for start, n_src, off in self._chunks(src, sizes, bool(zigzag)):
                kv = {}
                for t, shp in kv_shapes.items():
                    shp = list(shp)
                    shp[self.program.tensors[t].index(self.axis)] = n_src
                    kv[t] = torch.empty(shp, device="meta")
                for h, (ins, offs, _) in enumerate(pieces):
                    offs = dict(offs)
                    offs[self.axis] = off
                    if started[h] and self._all_masked({**ins, **kv}, offs, gsizes):
                        continue   # the mask excludes the whole block: its states would change nothing
                    started[h] = True
                    blocks.append((start, n_src, off, h))
            steps.append(blocks)
        self._kernels[pkey] = steps
        return steps

    def _ring(self, inputs, opts, offsets, gsizes, sizes, rank, shard_names, zigzag=()):
        """Every rank keeps its other inputs (its queries) and passes its shards of the
        sharded inputs (K/V) around the ring; each visiting shard's partial states are
        folded into the running ones with the derived merge (the rolling update across
        devices), while the next shard is in flight. ``zigzag``: axes (besides the sharded
        one) laid out as chunks r and 2W-1-r, which balances causal work.

        The fold: in the block's own kernel (``fold_kernel``: it takes the running states as
        its initial states and runs the derived rolling update over its tiles; a query piece's
        last block writes the outputs), where the template allows (``kernels.foldable``); else the partial kernel
        writes the block's states and the merge is evaluated in torch (``_merge2``), with a
        ``DistributedFallbackWarning`` once. ``ring_fold = False`` on the ShardedKernel (or
        ACEFUSE_RING_FOLD=0) forces the torch merge."""
        import torch
        if zigzag and self._positions_mode(offsets, zigzag) == "lookup":
            return self._ring_lookup(inputs, opts, offsets, gsizes, sizes, rank, shard_names, zigzag)
        f = self.fusion
        p = f.passes[0]
        world = len(sizes)
        mx = max(sizes)
        cur = {}
        for t in shard_names:
            x = inputs[t]
            d = self.program.tensors[t].index(self.axis)
            pad = list(x.shape)
            pad[d] = mx - x.shape[d]
            cur[t] = torch.cat([x, x.new_zeros(pad)], dim=d).contiguous() if pad[d] else x.contiguous()
        pieces = self._pieces({t: v for t, v in inputs.items() if t not in shard_names}, zigzag, offsets, sizes, rank)
        plan = self._ring_plan(pieces, sizes, rank, zigzag, gsizes, {t: cur[t].shape for t in shard_names})
        fold = self._fold_mode()
        opts = self._block_opts(opts, pieces, cur, shard_names, plan, offsets, gsizes, sizes, fold)
        self.block_launch = dict(opts)   # (what the last call's block kernels were launched with)
        last = {}
        for step, blocks in enumerate(plan):
            for b, blk in enumerate(blocks):
                last[blk[3]] = (step, b)
        runs = [None] * len(pieces)
        outs = [None] * len(pieces)
        nxt_rank, prv_rank = ring_peers(self.group, rank, world)
        for step, blocks in enumerate(plan):
            mark = torch.profiler.record_function(f"ring step {step}")   # (benchmarks/ring_profile.py's timeline)
            mark.__enter__()
            reqs, nxt = [], {}
            if step < world - 1:
                nxt, reqs = ring_shift({t: cur[t] for t in shard_names}, nxt_rank, prv_rank, self.group)
            for b, (start, n_src, off, h) in enumerate(blocks):
                kv = {t: cur[t].narrow(self.program.tensors[t].index(self.axis), start, n_src) for t in shard_names}
                ins, offs, _ = pieces[h]
                offs = dict(offs)
                offs[self.axis] = off
                if fold:
                    final = fold == "final" and last[h] == (step, b)
                    res = self._run_fold({**ins, **kv}, opts, offs, gsizes, runs[h], final)
                    if final:
                        outs[h] = res
                    else:
                        runs[h] = (res, n_src + (runs[h][1] if runs[h] is not None else 0))
                    continue
                st, c = self._partial_states({**ins, **kv}, opts, offs, gsizes, n_src)
                runs[h] = (st, c) if runs[h] is None else (
                    _merge2(f.encoding, p, self._P(), runs[h][0], st, runs[h][1], c, dict(gsizes)), runs[h][1] + c)
            for r in reqs:
                r.wait()
            mark.__exit__(None, None, None)
            if step < world - 1:
                cur = nxt
        for h, (ins, offs, _) in enumerate(pieces):
            if outs[h] is None:
                st = runs[h][0]
                if fold:   # the kernel's states, laid out over [1, *P] for the evaluation in torch
                    st = self._layout_states(st, {**ins, **{t: cur[t] for t in shard_names}})
                outs[h] = self._finish_states(st, ins, offs, gsizes)
        return self._concat(outs, zigzag)

    # -- the zig-zag ring with global positions as lookups: one block kernel per step ----------
    def _positions_mode(self, offsets, zigzag):
        """'lookup' when the zig-zag ring runs one block kernel per step, its global positions
        read from 1-D tensors (``instantiate(runtime="lookup")``): asked for by
        ``ring_positions = "lookup"`` on the ShardedKernel or ACEFUSE_RING_POSITIONS=lookup, for
        a program whose blocks fold in their kernels and whose last block writes the outputs,
        with offsets on the sharded and zig-zag axes only. Else None (one kernel per pair of
        chunks, 0-d offsets)."""
        import os
        want = self.ring_positions or os.environ.get("ACEFUSE_RING_POSITIONS") or None
        if want != "lookup" or set(offsets) - {self.axis} - set(zigzag) or self._fold_mode() != "final":
            return None
        return "lookup"

    def _ring_lookup(self, inputs, opts, offsets, gsizes, sizes, rank, shard_names, zigzag):
        """The zig-zag ring with one block kernel per step: every local query against the
        whole visiting shard, the global position of each element a lookup (this rank's along
        the zig-zag axes, the visiting rank's along the sharded axis), so the mask analysis
        skips and unmasks tiles per tile as with 0-d offsets, and a row tile runs the key
        tiles of both visiting chunks in one loop."""
        import torch
        from acefuse.distributed.kernels import fold_kernel
        from acefuse.distributed.base import gpos
        world = len(sizes)
        dev = _device(inputs)
        names = [self.axis] + list(zigzag)
        pkey = ("lpos", tuple(sizes), str(dev))
        if pkey not in self._kernels:
            self._kernels[pkey] = [torch.cat([torch.arange(off, off + n) for _, n, off in self._chunks(r, sizes, True)])
                                   .to(device=dev, dtype=torch.float32) for r in range(world)]
        pos = self._kernels[pkey]
        gs = {a: v for a, v in gsizes.items()
              if _uses([s.definition for s in self.fusion.encoding.states] + list(self.fusion.encoding.leaves.values())
                       + list(self.fusion.encoding.outputs.values()), lambda u, a=a: u.op == "Size" and u.args[0] == a)}

        def kern(carry, final):
            key = ("lfold", carry, final, tuple(sorted(gs.items())), gsizes[self.axis])
            if key not in self._kernels:
                self._kernels[key] = fold_kernel(self.fusion, {a: 0 for a in names}, gs, self._state_names(), carry,
                                                 final, gsizes[self.axis], runtime="lookup")
            return self._kernels[key]
        cur = {t: inputs[t].contiguous() for t in shard_names}
        rest = {t: v for t, v in inputs.items() if t not in shard_names}
        mine = {gpos(a): pos[rank] for a in zigzag}
        fixed = self._fixed_opts(opts)
        if fixed is not None:
            opts = fixed
        elif dev is not None and dev.type == "cuda":   # one timed choice for every role (see _block_opts)
            key = ("lblock_opts", tuple((t, tuple(x.shape), str(x.dtype)) for t, x in sorted(inputs.items())))
            if key not in self._kernels:
                self._kernels[key] = self._timed_block_opts(
                    kern(False, False), {**rest, **cur, **mine, gpos(self.axis): pos[rank]}, True)
            opts = {**opts, **self._kernels[key]}
        self.block_launch = dict(opts)
        steps = []
        for step in range(world):
            src = (rank - step) % world
            if step == 0 or not self._all_masked_lookup(rest, cur, zigzag, rank, src, sizes, kern):
                steps.append(step)
        nxt_rank, prv_rank = ring_peers(self.group, rank, world)
        run, n_run, out = None, 0, None
        for step in range(world):
            src = (rank - step) % world
            reqs, nxt = [], {}
            if step < world - 1:
                nxt, reqs = ring_shift(cur, nxt_rank, prv_rank, self.group)
            if step in steps:
                final = step == steps[-1]
                k = kern(run is not None, final)
                own = {**rest, **cur, **mine, gpos(self.axis): pos[src]}
                own = {t: v for t, v in own.items() if t in k.module.TENSORS}
                if run is not None:
                    own.update({t: run[q] for q, t in k.carry.items()})
                    if k.carry_n is not None:
                        own[k.carry_n] = count_input(n_run, dev)
                n_blk = sizes[src]
                if final:
                    dts = {o: torch.float32 for o in self.keep_wide if o in self.fusion.encoding.outputs}
                    out = k(**own, **opts, **({"out_dtypes": dts} if dts else {}))
                else:
                    st_names = self._state_names()
                    p = self.fusion.passes[0]
                    res = k(**own, **opts, out_dtypes={st_names[s.name]: torch.float32 for s in p.states})
                    res = res if isinstance(res, dict) else {st_names[p.states[0].name]: res}
                    run = {s.name: res[st_names[s.name]] for s in p.states}
                    n_run += n_blk
            for r in reqs:
                r.wait()
            if step < world - 1:
                cur = nxt
        return self._finish_staged(out, inputs)

    def _all_masked_lookup(self, rest, cur, zigzag, rank, src, sizes, kern):
        """True when the mask analysis proves the whole block (every local query, the whole
        visiting shard, with their positions) excluded and a fully masked block changes no
        state; False when it cannot tell. Decided on the host (positions from the layout, no
        read of a device tensor), once per (layout, rank, visiting rank)."""
        from acefuse.distributed.base import gpos
        key = ("lmasked", tuple(sorted((t, tuple(x.shape)) for t, x in {**rest, **cur}.items())), tuple(sizes),
               rank, src, tuple(zigzag))
        if key not in self._kernels:
            masked = False
            try:
                import numpy as np
                from acefuse.codegen.masks import tile_stats
                k = kern(False, False)

                def pos(r):
                    return np.concatenate([np.arange(off, off + n, dtype=np.float64)
                                           for _, n, off in self._chunks(r, sizes, True)])
                data = {gpos(a): pos(rank) for a in zigzag}
                data[gpos(self.axis)] = pos(src)
                shp = {}
                for t, x in {**rest, **cur}.items():
                    for a, n in zip(self.program.tensors[t], x.shape):
                        shp.setdefault(a, n)
                for n, v in data.items():
                    shp[k.module.TENSORS[n][0]] = len(v)
                rows = list(k.module.ROW_AXES)
                if len(rows) == 1:
                    st = tile_stats(k.fusion, shp, block_i=shp[rows[0]], block_j=shp[self.axis], data=data)
                    masked = st["skipped"] == 1.0
            except Exception:  # noqa: BLE001 - no proof: run the block
                masked = False
            self._kernels[key] = masked
        return self._kernels[key]

    # launch options every block kernel of the ring takes (the tiles, warps, stages and path)
    TILE_KW = ("block_i", "block_j", "num_warps", "num_stages", "path")

    def _block_opts(self, opts, pieces, cur, shard_names, plan, offsets, gsizes, sizes, fold):
        """The launch options of the ring's block kernels: one choice for every role (first
        block, folding block, last block), so that each role compiles one kernel and none
        times candidates of its own (each role timing its own tiles compiled every candidate
        for each: 4 x 8 compiles per shape on the first call of a 4-GPU causal ring). In order:
        the caller's (any tile or schedule option given: those), ``ACEFUSE_RING_TILES`` (e.g.
        ``block_i=128,block_j=128,num_warps=8,num_stages=2,path=hopper``: fixed, nothing
        timed), else, on a GPU, the launcher's own timed choice (``_tuned``: its Hopper and
        portable candidates) made once per block shape on the first block's kernel; when the
        shards are equal, each rank first compiles its share of the candidates and the ranks
        meet at a barrier, so the timing finds the others' compiles in Triton's cache (shared
        by the processes of one host, TRITON_CACHE_DIR). Elsewhere: ``opts``."""
        fixed = self._fixed_opts(opts)
        if fixed is not None:
            return fixed
        if not plan or not plan[0]:
            return opts
        dev = _device(cur)
        if dev is None or dev.type != "cuda":
            return opts

        def block(blk):
            start, n_src, off, h = blk
            kv = {t: cur[t].narrow(self.program.tensors[t].index(self.axis), start, n_src) for t in shard_names}
            ins, offs, _ = pieces[h]
            return {**ins, **kv}, dict(offs, **{self.axis: off})
        first, _ = block(plan[0][0])
        key = ("block_opts", tuple((t, tuple(x.shape), str(x.dtype)) for t, x in sorted(first.items())), bool(fold))
        if key not in self._kernels:
            # timed on the block of step 0 (local data) with the most tiles the mask lets through
            # (a causal ring's diagonal blocks skip half of theirs; most blocks skip none)
            inputs, offs = max((block(b) for b in plan[0]), key=lambda io: self._visible(*io, gsizes))
            k = self._partial(offs, gsizes)
            own = {**inputs, **gpos_inputs(offs, _device(inputs))}
            self._kernels[key] = self._timed_block_opts(k, own, len(set(sizes)) == 1)
        return {**opts, **self._kernels[key]}

    def _fixed_opts(self, opts):
        """The block kernels' launch options when the caller gave tiles or a schedule (``opts``)
        or ACEFUSE_RING_TILES sets them; None when they are to be chosen."""
        import os
        if any(o in self.TILE_KW + ("schedule", "nsplit") for o in opts):
            return opts
        env = os.environ.get("ACEFUSE_RING_TILES", "").strip()
        if env:
            return {**opts, **_parse_tiles(env, self.program.name)}
        return None

    def _visible(self, inputs, offsets, gsizes):
        """The (row tile x key tile) pairs of 128 x 128 that the mask analysis does not skip in
        this block (codegen/masks.py tile_stats); every pair when it cannot tell."""
        sizes = {}
        for t, x in inputs.items():
            for a, n in zip(self.program.tensors[t], x.shape):
                sizes.setdefault(a, n)
        tiles = -(-sizes[self.axis] // 128)
        rows = [a for a in self._P() if a in sizes and all(a not in self.program.tensors[t] for t in inputs
                                                             if self.axis in self.program.tensors[t])]
        for a in rows:
            tiles *= -(-sizes[a] // 128) if a == rows[0] else sizes[a]
        try:
            import numpy as np
            from acefuse.codegen.masks import tile_stats
            k = self._partial(offsets, gsizes)
            st = tile_stats(k.fusion, sizes, block_i=128, block_j=128,
                            data={n: np.array([v.item()]) for n, v in gpos_inputs(offsets).items()})
            return tiles * (1.0 - st["skipped"])
        except Exception:  # noqa: BLE001 - no analysis: count every tile
            return float(tiles)

    def _timed_block_opts(self, k, own, same_shapes):
        """The launcher's timed tile choice for block kernel ``k`` on inputs ``own`` (see
        _block_opts); {} when the launcher would not time (a small problem, float32) or cannot."""
        import torch.distributed as dist
        mod = k.module
        own = {t: v for t, v in own.items() if t in mod.TENSORS}
        need = ("_tuned", "HOPPER_CANDIDATES", "CANDIDATES", "ROW_AXES", "GRID_AXES", "AXIS", "TENSORS")
        if any(not hasattr(mod, n) for n in need):
            return {}
        ref = next((v for v in own.values() if v.dtype.is_floating_point), None)
        if ref is None or ref.dtype not in (_torch().bfloat16, _torch().float16):
            return {}
        sizes = {}
        for t, x in own.items():
            for a, n in zip(mod.TENSORS[t], x.shape):
                sizes.setdefault(a, n)
        work = 1 << max(0, (int(sizes[mod.AXIS]) - 1).bit_length())
        for a in set(mod.ROW_AXES + mod.GRID_AXES) - {mod.AXIS}:
            work *= sizes[a]
        if work < 1 << 26:   # (the launcher's own threshold: launch overhead dominates below)
            return {}
        path = "hopper" if mod.hopper_ok(own, ref.device, ref.dtype) else "portable"
        cands = ([dict(c, path="hopper") for c in mod.HOPPER_CANDIDATES] if path == "hopper" else []) + \
            [dict(c, path="portable") for c in mod.CANDIDATES]
        if same_shapes and dist.is_initialized():
            # each rank compiles its share of the candidates (one launch each), then the timing
            # below loads the others' from Triton's cache instead of compiling all of them
            world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            for c in cands[rank::world]:
                try:
                    k(**own, **c)
                except Exception:  # noqa: BLE001 - a candidate that does not fit: the timing skips it
                    pass
            dist.barrier(group=self.group)
        try:
            cfg = mod._tuned(own, None, path, both=path == "hopper")
        except Exception:  # noqa: BLE001 - the launcher's own choice per kernel then
            return {}
        return {o: v for o, v in cfg.items() if o in self.TILE_KW and v is not None}

    def _fold_mode(self):
        """'final' (blocks fold in their kernel, the last one writes the outputs), 'states'
        (blocks fold in their kernel, the outputs are evaluated in torch), or None (the
        torch merge: forced by ``ring_fold = False`` / ACEFUSE_RING_FOLD=0, or the template
        cannot fold: warned once)."""
        import os
        from acefuse.distributed.kernels import foldable
        if not self.ring_fold or os.environ.get("ACEFUSE_RING_FOLD") == "0":
            return None
        if "fold_why" not in self.__dict__:
            why = foldable(self.fusion)
            if why is not None:
                warnings.warn(f"acefuse: program {self.program.name!r} sharded along {self.axis!r} with "
                              f"exchange='ring' merges each block's states in torch (a pass over them in memory "
                              f"per block), because {why}", DistributedFallbackWarning, stacklevel=4)
            self.fold_why = why
        if self.fold_why is not None:
            return None
        enc = self.fusion.encoding
        bad = [u for t in enc.outputs.values() for u in t.walk() if u.op not in OUTPUT_OPS or u.op == "Take"]
        if self.fusion.passes[0].refs or bad or enc.elementwise_outputs or self.staged is not None:
            return "states"   # outputs the kernel's epilogue cannot write from the states: torch
        return "final"

    def _layout_states(self, st, inputs):
        """Kernel state tensors (over their own axes) laid out over [1, *P]."""
        P, sax = self._P(), state_axes(self.fusion)
        local = {}
        for t, x in inputs.items():
            for a, k in zip(self.program.tensors[t], x.shape):
                local.setdefault(a, k)
        return {q: v.reshape([1] + [local[a] if a in sax[q] else 1 for a in P]) for q, v in st.items()}

    def _run_fold(self, inputs, opts, offsets, gsizes, run, final):
        """One ring block by its folding kernel: the running states ``run`` ((states, count) or
        None for a piece's first block) in, the folded states (or, ``final``, the outputs) out."""
        import torch
        k = self._fold_kernel(offsets, gsizes, run is not None, final)
        own = {**inputs, **gpos_inputs(offsets, _device(inputs))}
        tens = k.module.TENSORS
        own = {t: v for t, v in own.items() if t in tens}
        if run is not None:
            st, n = run
            own.update({t: st[q] for q, t in k.carry.items()})
            if k.carry_n is not None:
                own[k.carry_n] = count_input(n, _device(inputs))
        names = self._state_names()
        p = self.fusion.passes[0]
        if final:
            dts = {o: torch.float32 for o in self.keep_wide if o in self.fusion.encoding.outputs}
            return k(**own, **opts, **({"out_dtypes": dts} if dts else {}))
        out = k(**own, **opts, out_dtypes={names[s.name]: torch.float32 for s in p.states})
        outs = out if isinstance(out, dict) else {names[p.states[0].name]: out}
        return {s.name: outs[names[s.name]] for s in p.states}

    def _fold_kernel(self, offsets, gsizes, carry, final):
        """The block kernel of one role (``carry``: takes running states; ``final``: writes the
        outputs), keyed like ``_partial`` by the shifted axes (offsets are runtime inputs)."""
        from acefuse.distributed.kernels import fold_kernel
        quick = ("foldq", carry, final, tuple(sorted(offsets)), tuple(sorted(gsizes.items())))
        if quick in self._kernels:   # (the walk over the terms below: ~0.1 ms a block)
            return self._kernels[quick]
        f = self.fusion
        enc = f.encoding
        terms = list(enc.leaves.values()) + [s.definition for s in enc.states] + \
            [t for d in (f.passes[0].init, f.passes[0].rolling) for t in d.values()]
        if final:
            terms += list(enc.outputs.values())
        offs = {a: v for a, v in offsets.items() if _uses(terms, lambda u, a=a: u.op == "Idx" and u.args[0] == a)}
        gs = {a: v for a, v in gsizes.items() if _uses(terms, lambda u, a=a: u.op == "Size" and u.args[0] == a)}
        n_global = gsizes[self.axis] if final else None
        key = ("fold", carry, final, tuple(sorted(offs)), tuple(sorted(gs.items())), n_global)
        if key not in self._kernels:
            if not carry and not final:
                self._kernels[key] = self._partial(offsets, gsizes)
                self._kernels[key].carry, self._kernels[key].carry_n = {}, None
            else:
                self._kernels[key] = fold_kernel(f, offs, gs, self._state_names(), carry, final, n_global)
        self._kernels[quick] = self._kernels[key]
        return self._kernels[key]

    def _all_masked(self, inputs, offsets, gsizes) -> bool:
        """True when the mask analysis (codegen/masks.py) proves that the block's mask excludes
        every (query, key) pair (one tile spanning the whole block) and that a fully masked
        block leaves every state unchanged: the ring then skips its kernel and its merge (the
        causal blocks above the diagonal). False whenever the analysis cannot tell."""
        from acefuse.codegen import contraction
        if not contraction.is_contraction(self.fusion):
            return False
        sizes = {}
        for t, x in inputs.items():
            for a, n in zip(self.program.tensors[t], x.shape):
                sizes.setdefault(a, n)
        key = ("masked", tuple(sorted(offsets.items())), tuple(sorted(sizes.items())))
        if key not in self._kernels:
            masked = False
            try:
                from acefuse.codegen.masks import tile_stats
                k = self._partial(offsets, gsizes)
                rows = [a for a in k.fusion.program.axes if a != self.axis and a in sizes
                        and any(a in self.program.tensors[t] for t in inputs if self.axis not in self.program.tensors[t])]
                if len(rows) >= 1:
                    import numpy as np
                    st = tile_stats(k.fusion, sizes, block_i=max(sizes[a] for a in rows), block_j=sizes[self.axis],
                                    data={n: np.array([v.item()]) for n, v in gpos_inputs(offsets).items()})
                    masked = st["skipped"] == 1.0
            except Exception:  # noqa: BLE001 - no proof: run the block
                masked = False
            self._kernels[key] = masked
        return self._kernels[key]

    def _P(self):
        return [a for a in self.fusion.program.axes if a != self.axis]

    def _partial_states(self, inputs, opts, offsets, gsizes, n):
        """The partial states of this block laid out over [1, *P], and its count."""
        import torch
        P, sax = self._P(), state_axes(self.fusion)
        local = {}
        for t, x in inputs.items():
            for a, k in zip(self.program.tensors[t], x.shape):
                local.setdefault(a, k)
        part = self._run_partial(inputs, opts, offsets, gsizes)
        st = {q: part[q].reshape([1] + [local[a] if a in sax[q] else 1 for a in P]) for q in part}
        ref = next(iter(st.values()))
        return st, torch.full([1] + [1] * len(P), float(n), dtype=ref.dtype, device=ref.device)

    def _finish_states(self, final, inputs, offsets, gsizes):
        """Outputs (contraction family: evaluated from the states) of merged final states."""
        enc, p, P = self.fusion.encoding, self.fusion.passes[0], self._P()
        local = {}
        for t, x in inputs.items():
            for a, k in zip(self.program.tensors[t], x.shape):
                local.setdefault(a, k)
        for i, a in enumerate(P):   # axes only the sharded inputs have (v's e): from the states
            if a not in local:
                local[a] = max(v.shape[i + 1] for v in final.values())
        sizes_loc = {a: local[a] for a in P}
        env = {(q, "J"): v for q, v in final.items()}
        evf = StateEval(enc, P, env, {"J": float(gsizes[self.axis])}, dict(gsizes), inputs=inputs, offsets=offsets,
                        takes={}, local=sizes_loc)
        for r in p.refs:
            env[(r.name, "J")] = evf.ev(reblock(r.definition, J))
        return self._finish_eval(evf, P, sizes_loc, inputs)

    def _concat(self, outs, zigzag):
        """The pieces' outputs joined along the zig-zag axes they range over."""
        import torch
        if len(outs) == 1:
            return outs[0]
        names = list(self.program.outputs)
        ds = [o if isinstance(o, dict) else {names[0]: o} for o in outs]
        res = {}
        for o in ds[0]:
            axes = self.program.outputs[o].axes
            za = [a for a in zigzag if a in axes]
            res[o] = torch.cat([d[o] for d in ds], dim=axes.index(za[0])) if za else ds[0][o]
        return res[names[0]] if len(res) == 1 else res


def _torch():
    import torch
    return torch


def _parse_tiles(text, name):
    """``ACEFUSE_RING_TILES``: ``key=value`` pairs, comma-separated, keys among Ring.TILE_KW
    (integers; ``path`` is 'hopper' or 'portable')."""
    from acefuse.distributed.base import DistributedError
    out = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        k, _, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if k not in Ring.TILE_KW or not v:
            raise DistributedError(f"program {name!r}: ACEFUSE_RING_TILES={text!r}: {part!r} is not key=value with a key "
                                   f"among {', '.join(Ring.TILE_KW)} (e.g. block_i=128,block_j=128,num_warps=8,"
                                   "num_stages=2,path=hopper)")
        if k == "path":
            if v not in ("hopper", "portable"):
                raise DistributedError(f"program {name!r}: ACEFUSE_RING_TILES: path={v!r}; use hopper or portable")
            out[k] = v
            continue
        try:
            out[k] = int(v)
        except ValueError:
            raise DistributedError(f"program {name!r}: ACEFUSE_RING_TILES: {k}={v!r} is not an integer") from None
    return out
