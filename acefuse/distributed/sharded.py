"""ShardedKernel: a compiled program called on each rank's shard of its fused axis."""
from __future__ import annotations

import warnings

from acefuse.rewrite.terms import Term, reblock, pretty
from acefuse.codegen.compile import bind_inputs
from acefuse.distributed.base import (J, A_, B_, EXCHANGES, RUN_KW, DistributedError, DistributedFallbackWarning,
                                      _uses, _device, instantiate, gpos_inputs)
from acefuse.distributed.merge import (StateEval, MERGE_OPS, OUTPUT_OPS, _ARITH, merge_tree)
from acefuse.distributed.kernels import (state_axes, _axes_fn, partial_kernel, full_kernel, final_kernel)
from acefuse.distributed.ring import Ring


# ---- the sharded kernel -----------------------------------------------------------------
def _base_kernels(kernel):
    """(outer callable, kernel whose fusion is sharded, staged part or None)."""
    from acefuse.codegen.compile import StagedKernel
    base = getattr(kernel, "kernel", kernel)        # a DifferentiableKernel wraps the forward kernel
    if isinstance(base, StagedKernel):
        return kernel, base.stage1, base
    return kernel, base, None


def _plain_merge(p):
    """'sum' / 'max' when every state's derived merge is a plain sum / max of its partials."""
    kinds = set()
    for s in p.states:
        m = p.merge[s.name]
        a, b = Term("St", (s.name, A_)), Term("St", (s.name, B_))
        if m.op == "Add" and set(m.args) == {a, b}:
            kinds.add("sum")
        elif m.op == "Max2" and set(m.args) == {a, b}:
            kinds.add("max")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


class ShardedKernel(Ring):
    """A compiled program whose fused axis is sharded across the ranks of ``process_group``.
    Call it like the kernel, with each rank's local tensors (inputs without the sharded axis
    are the same on every rank). Outputs over the sharded axis are the rank's own shard;
    the others are the whole result, on every rank.

    Call options: ``shard_sizes=[n_0, ..., n_{W-1}]`` (each rank's length along the sharded
    axis; saves the exchange of shapes, and then the inputs' other axes are not checked
    across ranks), ``axis_offsets={"i": i0}`` (local tensors along another axis start at
    global position i0), ``axis_sizes={"i": N}`` (that axis's global length, for
    ``size(i)``), and the kernel's launch options."""

    def __init__(self, kernel, process_group, sharded_axis, exchange="auto"):
        import torch.distributed as dist
        self.kernel, self.base, self.staged = _base_kernels(kernel)
        self.fusion = self.base.fusion
        self.program = getattr(kernel, "prog", None) or self.base.program
        name = self.program.name
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError(f"program {name!r}: process_group= needs torch.distributed initialised "
                                   "(dist.init_process_group(...)) on every rank before the call")
        if exchange not in EXCHANGES:
            raise DistributedError(f"program {name!r}: unknown exchange {exchange!r}; use one of {EXCHANGES}")
        axes = self.fusion.program.axes
        if sharded_axis is None:
            raise DistributedError(f"program {name!r}: process_group= needs sharded_axis=, the fused axis "
                                   f"split across ranks ({self.fusion.axis!r})")
        if sharded_axis != self.fusion.axis:
            where = "an axis of the program" if sharded_axis in axes else f"not an axis of the program ({' '.join(axes)})"
            raise DistributedError(
                f"program {name!r}: sharded_axis {sharded_axis!r} is {where}, and only the fused axis "
                f"{self.fusion.axis!r} can be split across ranks (its partial states merge with the derived "
                f"merge). Shard {self.fusion.axis!r}, or compile with axis={sharded_axis!r} if that axis is "
                "reduced (af.compile(prog, axis=...)); a parallel axis needs no collective: run the kernel on "
                "each rank's slice and pass axis_offsets= for index arithmetic")
        self.group = process_group
        self.axis = sharded_axis
        self.exchange = exchange
        self.mode, self.why = self._plan()
        self._kernels = {}
        self._warned = False
        self.keep_wide = frozenset()    # outputs written in float32 whatever the inputs' type (saved values)
        self.ring_fold = True           # the ring folds states in its kernels where it can (_ring)
        self.block_launch = None        # the launch options of the last ring call's block kernels
        self.ring_positions = None      # "lookup": the zig-zag ring runs one block kernel per step (_ring_lookup)

    # -- planning --------------------------------------------------------------------------
    def _plan(self):
        """('states', None) or ('gather', why)."""
        from acefuse.codegen import contraction
        f, enc = self.fusion, self.fusion.encoding
        if self.exchange == "gather":
            return "gather", None
        if self.exchange == "ring":
            if len(f.passes) != 1 or not f.passes[0].split_ok:
                raise DistributedError(f"program {self.program.name!r}: exchange='ring' needs one pass whose "
                                       "states all have a derived merge; use exchange='gather'")
            return "ring", None
        if len(f.passes) != 1:
            why = f"its fusion needs {len(f.passes)} passes over {f.axis!r} (each would need its own exchange)"
        elif not f.passes[0].split_ok:
            miss = [s.name for s in f.passes[0].states if s.name not in f.passes[0].merge]
            why = f"state(s) {miss} have no derived merge"
        elif _uses(enc.leaves.values(), lambda u: u.op == "Take" and u.args[2] == self.axis):
            why = f"a reduction's body looks up an input along the sharded axis {self.axis!r} (data of other ranks)"
        else:
            p = f.passes[0]
            forms = list(p.merge.values()) + [r.definition for r in p.refs]
            bad = [u.op for t in forms for u in t.walk() if u.op not in MERGE_OPS]
            why = f"its merge uses {sorted(set(bad))}, which the state exchange cannot evaluate" if bad else None
            if why is None and contraction.is_contraction(f):
                bad = [u for t in enc.outputs.values() for u in t.walk() if u.op not in OUTPUT_OPS]
                if bad or enc.elementwise_outputs:
                    why = "an output reads values other than the merged states and per-row inputs"
            if why is None:
                bad = [u for t in enc.outputs.values() for u in t.walk() if u.op == "Take" and u.args[2] == self.axis
                       and not _uses([u.args[1]], lambda v: v.op in ("In", "Idx", "Num") or v.op in _ARITH)]
                if bad:
                    why = f"an output looks up {pretty(bad[0])} with an index the state exchange cannot compute"
        if why is None:
            return "states", None
        if self.exchange == "states":
            raise DistributedError(f"program {self.program.name!r}: exchange='states' is not possible: {why}; "
                                   "use exchange='gather' (or 'auto')")
        return "gather", why

    # -- the call --------------------------------------------------------------------------
    def __call__(self, *args, shard_sizes=None, axis_offsets=None, axis_sizes=None, zigzag=None, **inputs):
        import torch
        import torch.distributed as dist
        name = self.program.name
        opts = {k: inputs.pop(k) for k in list(inputs) if k in RUN_KW}
        names = list(self.program.tensors)
        bind_inputs(name, names, args, inputs)
        req = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        req = req if torch.is_grad_enabled() else []
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        offsets = dict(axis_offsets or {})
        gsizes = dict(axis_sizes or {})
        if self.axis in offsets:
            raise DistributedError(f"program {name!r}: the offset of the sharded axis {self.axis!r} comes from "
                                   "shard_sizes (or the exchange of shapes); give axis_offsets only for other axes")
        tensors = self.program.tensors
        shard_names = [t for t in names if self.axis in tensors[t]]
        if not shard_names:
            raise DistributedError(f"program {name!r}: no input has the sharded axis {self.axis!r}")
        local = {}
        for t in names:
            x = inputs[t]
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {t!r} of program {name!r} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != len(tensors[t]):
                raise ValueError(f"input {t!r} of program {name!r} has {x.dim()} dimensions but is declared "
                                 f"with axes {' '.join(tensors[t])!r}")
            for a, n in zip(tensors[t], x.shape):
                if local.setdefault(a, n) != n:
                    raise ValueError(f"axis {a!r} of program {name!r} has length {local[a]} in one input and {n} "
                                     f"in {t!r}; inputs must agree on every axis")
        n_loc = local[self.axis]
        if world == 1:
            if req and (any(offsets.values()) or gsizes):
                raise DistributedError(f"program {name!r}: a differentiable call on a group of one rank with "
                                       "axis_offsets/axis_sizes is not supported; call the kernel without process_group")
            return self._local(inputs, opts, offsets, gsizes)
        dev = inputs[shard_names[0]].device
        if shard_sizes is not None:
            sizes = [int(s) for s in shard_sizes]
            if len(sizes) != world:
                raise DistributedError(f"program {name!r}: shard_sizes has {len(sizes)} entries for a process "
                                       f"group of {world} ranks; give one length along {self.axis!r} per rank")
            if sizes[rank] != n_loc:
                raise DistributedError(f"program {name!r}: rank {rank}'s shard along {self.axis!r} has length "
                                       f"{n_loc}, but shard_sizes says {sizes[rank]}")
        else:
            sizes = self._exchange_shapes(local, dev, world)
        if any(s <= 0 for s in sizes):
            raise DistributedError(f"program {name!r}: the shards along {self.axis!r} have lengths {sizes}; every "
                                   "rank needs at least one element (re-split the axis, or use a smaller group)")
        if req:
            return self._grad_call(inputs, req, names, opts, sizes, rank, world, offsets, gsizes, zigzag)
        j0 = sum(sizes[:rank])
        n_glob = sum(sizes)
        offsets[self.axis] = j0
        gsizes[self.axis] = n_glob
        if zigzag is not None:
            zigzag = tuple([zigzag] if isinstance(zigzag, str) else zigzag)
            bad = [a for a in zigzag if a == self.axis or a not in self.fusion.program.axes]
            if bad or self.mode not in ("ring", "gather") or len(set(sizes)) != 1 or sizes[0] % 2:
                raise DistributedError(
                    f"program {name!r}: zigzag={zigzag} needs exchange='ring' or 'gather', axes of the program "
                    f"other than the sharded axis {self.axis!r} (got {bad or zigzag}), and equal shards of even "
                    f"length (got {sizes}): rank r holds chunks r and 2W-1-r of 2W equal chunks")
            if self.mode == "gather":
                return self._gather_zigzag(inputs, opts, offsets, gsizes, sizes, rank, shard_names, zigzag)
        if self.mode == "gather":
            if not self._warned and self.why:
                self._warned = True
                warnings.warn(f"acefuse: program {name!r} sharded along {self.axis!r} runs by all-gathering its "
                              f"sharded inputs {shard_names} (more bytes than an exchange of states), because "
                              f"{self.why}", DistributedFallbackWarning, stacklevel=2)
            return self._gather(inputs, opts, offsets, gsizes, sizes, rank, shard_names)
        if self.mode == "ring":
            return self._ring(inputs, opts, offsets, gsizes, sizes, rank, shard_names, zigzag or ())
        return self._states(inputs, opts, offsets, gsizes, sizes, rank, local)

    def _grad_call(self, inputs, req, names, opts, sizes, rank, world, offsets, gsizes, zigzag):
        """A call on inputs that require grad: the augmented forward sharded like this call
        (its saved values merged across ranks), and a grad_fn running the derived backward on
        the shards (acefuse/distributed/grad.py)."""
        from acefuse.distributed.grad import ShardedGrad, sharded_function
        floats = frozenset(n for n in names if inputs[n].dtype.is_floating_point)
        key = ("grad", frozenset(req))
        if key not in self._kernels:
            self._kernels[key] = ShardedGrad(self, req, floats)
        sg = self._kernels[key]
        zz = () if zigzag is None else tuple([zigzag] if isinstance(zigzag, str) else zigzag)
        D = set(offsets) | set(zz)
        mode = sg.aug.mode
        gs = dict(gsizes)
        gs[self.axis] = sum(sizes)
        info = {"mode": mode, "world": world, "rank": rank, "sizes": list(sizes), "offsets": dict(offsets),
                "gsizes": gs, "zigzag": zz, "D": frozenset(D), "opts": dict(opts)}
        call = dict(opts, shard_sizes=list(sizes), axis_offsets=dict(offsets) or None,
                    axis_sizes=dict(gsizes) or None, zigzag=zigzag)
        outs = sharded_function().apply(sg, call, info, names, *[inputs[n] for n in names])
        keys = list(self.program.outputs)
        return outs[0] if len(keys) == 1 else dict(zip(keys, outs))

    def _local(self, inputs, opts, offsets, gsizes):
        """One rank: the kernel itself (with other axes' offsets instantiated, if any)."""
        if not any(offsets.values()) and not gsizes:
            return self.kernel(**inputs, **opts)
        from acefuse.codegen.compile import Kernel
        kern = self._specialised(offsets, gsizes)
        if isinstance(kern, Kernel):   # generated here: it takes only the tensors it reads
            inputs = {**inputs, **gpos_inputs(offsets, _device(inputs))}
            inputs = {t: v for t, v in inputs.items() if t in kern.fusion.encoding.tensors}
        return kern(**inputs, **opts)

    def _specialised(self, offsets, gsizes):
        """The kernel with ``index(a)`` / ``size(a)`` of the given axes instantiated (cached per
        instantiation): the fusion's own forms with those leaves fixed when it has one pass (the
        offsets runtime inputs: one kernel for all of them), else the instantiated program
        compiled anew (offsets as constants)."""
        import acefuse as af
        from acefuse.lang import Program, Expr
        one = len(self.fusion.passes) == 1 and self.staged is None
        key = ("prog", tuple(sorted(offsets)) if one else tuple(sorted(offsets.items())),
               tuple(sorted(gsizes.items())))
        if key not in self._kernels and one:
            self._kernels[key] = full_kernel(self.fusion, offsets, gsizes)
        if key not in self._kernels:
            prog = self.program
            outs = {o: Expr(instantiate(e.term, offsets, gsizes), e.axes, e.tensors) for o, e in prog.outputs.items()}
            self._kernels[key] = af.compile(Program(prog.name, outs), axis=self.axis)
        return self._kernels[key]

    def _exchange_shapes(self, local, dev, world):
        import torch
        import torch.distributed as dist
        axes = sorted(local)
        mine = torch.tensor([local[a] for a in axes], dtype=torch.int64, device=dev)
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=self.group)
        got = [g.tolist() for g in got]
        for i, a in enumerate(axes):
            if a == self.axis:
                continue
            vals = [g[i] for g in got]
            if len(set(vals)) != 1:
                raise DistributedError(f"program {self.program.name!r}: axis {a!r} has lengths {vals} on the ranks "
                                       f"of the process group; only the sharded axis {self.axis!r} may differ (pass "
                                       "the same tensors, or axis_offsets= for a sharded parallel axis, split equally)")
        return [g[axes.index(self.axis)] for g in got]

    # -- gathering the data ----------------------------------------------------------------
    def _all_gather_axis(self, x, dim, sizes):
        import torch
        import torch.distributed as dist
        world = len(sizes)
        mx = max(sizes)
        pad = list(x.shape)
        pad[dim] = mx - x.shape[dim]
        xp = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous() if pad[dim] else x.contiguous()
        got = [torch.empty_like(xp) for _ in range(world)]
        dist.all_gather(got, xp, group=self.group)
        return torch.cat([g.narrow(dim, 0, n) for g, n in zip(got, sizes)], dim=dim)

    def _gather(self, inputs, opts, offsets, gsizes, sizes, rank, shard_names):
        full = dict(inputs)
        for t in shard_names:
            full[t] = self._all_gather_axis(inputs[t], self.program.tensors[t].index(self.axis), sizes)
        offs = {a: v for a, v in offsets.items() if a != self.axis}
        gs = {a: v for a, v in gsizes.items() if a != self.axis}
        out = self._local(full, opts, offs, gs)
        return self._own_shard(out, sizes, rank)

    def _own_shard(self, out, sizes, rank):
        outs = out if isinstance(out, dict) else {next(iter(self.program.outputs)): out}
        j0 = sum(sizes[:rank])
        res = {}
        for o, v in outs.items():
            axes = self.program.outputs[o].axes if o in self.program.outputs else ()
            res[o] = v.narrow(axes.index(self.axis), j0, sizes[rank]) if self.axis in axes else v
        return res[next(iter(res))] if len(res) == 1 else res

    # -- exchanging states -----------------------------------------------------------------
    def _state_names(self):
        f = self.fusion
        taken = set(self.fusion.encoding.tensors) | set(f.encoding.outputs)
        names = {}
        for s in f.encoding.states:
            t = f"state_{s.name}"
            while t in taken:
                t += "_"
            names[s.name] = t
        return names

    def _partial(self, offsets, gsizes):
        quick = ("partialq", tuple(sorted(offsets)), tuple(sorted(gsizes.items())))
        if quick in self._kernels:   # (the walk over the terms below: ~0.1 ms a call)
            return self._kernels[quick]
        f = self.fusion
        enc = f.encoding
        terms = list(enc.leaves.values()) + [s.definition for s in enc.states] + \
            [t for d in (f.passes[0].init, f.passes[0].rolling) for t in d.values()]
        offs = {a: v for a, v in offsets.items() if _uses(terms, lambda u, a=a: u.op == "Idx" and u.args[0] == a)}
        gs = {a: v for a, v in gsizes.items() if _uses(terms, lambda u, a=a: u.op == "Size" and u.args[0] == a)}
        key = ("partial", tuple(sorted(offs)), tuple(sorted(gs.items())))   # offsets: runtime inputs
        if key not in self._kernels:
            self._kernels[key] = partial_kernel(f, offs, gs, {s.name: n for s, n in
                                                              zip(enc.states, self._state_names().values())})
        self._kernels[quick] = self._kernels[key]
        return self._kernels[key]

    def _run_partial(self, inputs, opts, offsets, gsizes):
        """{state: float32 tensor over its parallel axes} over the local shard."""
        import torch
        f = self.fusion
        k = self._partial(offsets, gsizes)
        names = self._state_names()
        p = f.passes[0]
        own = {**inputs, **gpos_inputs(offsets, _device(inputs))}
        own = {t: v for t, v in own.items() if t in k.fusion.encoding.tensors}
        out = k(**own, **opts, out_dtypes={names[s.name]: torch.float32 for s in p.states})
        outs = out if isinstance(out, dict) else {names[p.states[0].name]: out}
        return {s.name: outs[names[s.name]] for s in p.states}

    def _takes(self):
        enc = self.fusion.encoding
        seen = []
        for t in enc.outputs.values():
            for u in t.walk():
                if u.op == "Take" and u.args[2] == self.axis and u not in seen:
                    seen.append(u)
        return seen

    def _take_values(self, tk, inputs, P, sizes_loc, offsets, env_ref):
        """(value, owned): the lookup's value where this rank owns the index, else 0; 1/0."""
        import torch
        name, idx, ax = tk.args
        tensors = self.program.tensors
        ev = StateEval(self.fusion.encoding, P, {("_", "J"): env_ref}, {}, {}, inputs=inputs,
                       offsets=offsets, local=sizes_loc)
        ix = ev.ev(idx)[0]                                   # over P, length-1 where it does not range
        x = inputs[name]            # gathered in its own dtype (no pass over the shard), converted after
        xa = tensors[name]
        others = [a for a in P if a in xa and a != ax]
        # x over (its other axes in P order, ax)
        x = x.permute([xa.index(a) for a in others] + [xa.index(ax)])
        j0, n = offsets.get(ax, 0), x.shape[-1]
        shape = [sizes_loc[a] if (a in others or ix.shape[i] != 1) else 1 for i, a in enumerate(P)]
        ixf = ix.expand(shape)
        owned = (ixf >= j0) & (ixf < j0 + n) & (ixf == ixf)
        loc = torch.where(owned, ixf - j0, torch.zeros_like(ixf)).to(torch.int64)
        # x laid out over P (length 1 on axes it does not have) with the fused axis last
        xl = x.reshape([sizes_loc[a] if a in others else 1 for a in P] + [n])
        xl = xl.expand(shape + [n])
        val = torch.gather(xl, -1, loc.unsqueeze(-1)).squeeze(-1).to(env_ref.dtype)
        val = torch.where(owned, val, torch.zeros_like(val))
        return val.unsqueeze(0), owned.to(val.dtype).unsqueeze(0)

    def _collect(self, payload, how):
        import torch
        import torch.distributed as dist
        world = dist.get_world_size(self.group)
        if how in ("sum", "max"):
            dist.all_reduce(payload, op=dist.ReduceOp.SUM if how == "sum" else dist.ReduceOp.MAX, group=self.group)
            return payload.unsqueeze(0)
        out = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
        if dist.get_backend(self.group) == "nccl":
            dist.all_gather_into_tensor(out, payload, group=self.group)
        else:
            dist.all_gather(list(out.chunk(world)), payload, group=self.group)
        return out.view(world, -1)

    def _states(self, inputs, opts, offsets, gsizes, sizes, rank, local):
        import torch
        from acefuse.codegen import contraction
        f = self.fusion
        enc = f.encoding
        p = f.passes[0]
        P = [a for a in f.program.axes if a != self.axis]
        sax = state_axes(f)
        part = self._run_partial(inputs, opts, offsets, gsizes)
        ref = next(iter(part.values()))
        sizes_loc = {a: local[a] for a in P if a in local}
        takes = self._takes()
        tvals = [self._take_values(tk, inputs, P, sizes_loc, offsets, ref) for tk in takes]
        how = _plain_merge(p)
        if how == "max" and takes:
            how = None
        pieces = [part[s.name].reshape(-1) for s in p.states]
        for v, o in tvals:
            pieces += [v.reshape(-1), o.reshape(-1)]
        if how is None:
            pieces.append(torch.tensor([float(sizes[rank])], dtype=torch.float32, device=ref.device))
        payload = torch.cat(pieces)
        got = self._collect(payload, how)                  # [W or 1, L]
        K = got.shape[0]
        # unpack: states laid out over [K, *P]
        ev0 = StateEval(enc, P, {("_", "J"): ref}, {}, {})
        stacked, pos = {}, 0
        for s in p.states:
            n = part[s.name].numel()
            shp = [K] + [sizes_loc[a] if a in sax[s.name] else 1 for a in P]
            stacked[s.name] = got[:, pos:pos + n].reshape(shp)
            pos += n
        take_env = {}
        for tk, (v, o) in zip(takes, tvals):
            n = v.numel()
            val = got[:, pos:pos + n].sum(0).reshape(v.shape)
            own = got[:, pos + n:pos + 2 * n].sum(0).reshape(v.shape)
            pos += 2 * n
            take_env[tk] = torch.where(own > 0, val, torch.full_like(val, float("nan")))
        gs = dict(gsizes)
        if how is None:
            counts = got[:, pos].reshape([K] + [1] * len(P))
            final = merge_tree(enc, p, P, stacked, counts, gs)
        else:
            final = stacked
        del ev0
        names = self._state_names()
        env = {(q, "J"): v for q, v in final.items()}
        evf = StateEval(enc, P, env, {"J": float(gs[self.axis])}, gs, inputs=inputs, offsets=offsets,
                        takes=take_env, local=sizes_loc)
        for r in p.refs:
            env[(r.name, "J")] = evf.ev(reblock(r.definition, J))
        if contraction.is_contraction(f):
            return self._finish_eval(evf, P, sizes_loc, inputs)
        # row family: a row kernel writes the outputs (the epilogue on the local shard)
        given = {q: names[q] for q in [s.name for s in p.states] + [r.name for r in p.refs]}
        tnames = {tk: f"take_{i}" for i, tk in enumerate(takes)}
        key = ("final", tuple(sorted(offsets)), tuple(sorted(gs.items())), len(takes))   # offsets: runtime
        if key not in self._kernels:
            self._kernels[key] = final_kernel(f, {a: v for a, v in offsets.items()},
                                              {a: v for a, v in gs.items()}, given, tnames, gs[self.axis])
        k = self._kernels[key]
        extra = {}
        for q, t in given.items():
            v = env[(q, "J")][0]
            extra[t] = v.expand([sizes_loc[a] if a in sax[q] else 1 for a in P]).reshape(
                [sizes_loc[a] for a in sax[q]]).contiguous()
        order = {a: i for i, a in enumerate(f.program.axes)}
        ax = _axes_fn(enc)
        for tk, t in tnames.items():
            tax = tuple(sorted(ax(tk), key=order.__getitem__))
            v = take_env[tk][0]
            extra[t] = v.expand([sizes_loc[a] if a in tax else 1 for a in P]).reshape(
                [sizes_loc[a] for a in tax]).contiguous()
        own = {**inputs, **gpos_inputs(offsets, _device(inputs))}
        own = {t: v for t, v in own.items() if t in k.fusion.encoding.tensors}
        # no pass of its own: the loop kernel is the outputs (and the epilogue over the shard)
        fopts = {o: v for o, v in opts.items() if o in ("block_j", "block_r", "num_warps")}
        if self.keep_wide:
            from acefuse.autograd import takes_out_dtypes
            if takes_out_dtypes(k):
                fopts["out_dtypes"] = {o: torch.float32 for o in self.keep_wide if o in enc.outputs}
        out = k(**own, **extra, schedule="loop", **fopts)
        return self._finish_staged(out, inputs)

    def _finish_eval(self, evf, P, sizes_loc, inputs):
        enc = self.fusion.encoding
        dt = next((v.dtype for v in inputs.values() if v.dtype.is_floating_point), None)
        outs = {}
        for o, t in enc.outputs.items():
            v = evf.ev(t)[0]
            oa = enc.output_axes[o]
            v = v.expand([sizes_loc[a] if a in oa else 1 for a in P]).reshape([sizes_loc[a] for a in oa])
            outs[o] = v.to(dt).contiguous() if dt is not None and o not in self.keep_wide else v.contiguous()
        return self._finish_staged(outs if len(outs) > 1 else outs[next(iter(outs))], inputs)

    def _finish_staged(self, out, inputs):
        """Stage 2 of a staged program (a reduction over rows of the per-row values): run
        locally on the replicated stage-1 results."""
        if self.staged is None:
            return out
        return self.staged.finish(out, inputs)

    def _gather_zigzag(self, inputs, opts, offsets, gsizes, sizes, rank, shard_names, zigzag):
        """All-gather the zig-zag shards of K/V, put them in sequence order, and run the kernel
        on each local query chunk with its global offset."""
        import torch
        world = len(sizes)
        c = sizes[0] // 2
        full = {}
        for t in shard_names:
            d = self.program.tensors[t].index(self.axis)
            got = self._all_gather_axis(inputs[t], d, sizes)
            pieces = [None] * (2 * world)
            for r in range(world):
                blk = got.narrow(d, 2 * c * r, 2 * c)
                pieces[r], pieces[2 * world - 1 - r] = blk.narrow(d, 0, c), blk.narrow(d, c, c)
            full[t] = torch.cat(pieces, dim=d)
        rest = {t: v for t, v in inputs.items() if t not in shard_names}
        gs = {a: v for a, v in gsizes.items() if a != self.axis}
        outs = [self._local({**ins, **full}, opts, {a: v for a, v in offs.items() if a != self.axis}, gs)
                for ins, offs, _ in self._pieces(rest, zigzag, offsets, sizes, rank)]
        return self._concat(outs, zigzag)
