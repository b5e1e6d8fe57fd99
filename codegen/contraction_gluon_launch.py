"""The compiled Gluon kernel of a contraction-family program and its launch (codegen/
contraction_gluon.py generates the source, ``compile_gluon`` loads it into a ``GluonKernel``):
the inputs' checks, tile sizes, the ring's stages against sm_90's shared memory, the grid
(one-shot, or one program per SM for the persistent kernel) and the outputs.
``L2_KB`` (here) overrides the L2 size the persistent kernel orders its work items by."""
from __future__ import annotations

import math


class GluonKernel:
    """The compiled Gluon kernel of a program: ``kernel(**inputs)`` -> dict of outputs
    (16-bit contiguous inputs on an sm_90 GPU; float32 outputs in the inputs' dtype)."""

    def __init__(self, fusion, source, module, gen):
        self.fusion, self.source, self.module = fusion, source, module
        self.name = gen.name
        self.tensors = dict(gen.tensors)
        self.out_axes = dict(gen.out_axes)
        self.G, self.R, self.E, self.C, self.L = gen.G, gen.R, gen.E, gen.C, gen.L
        self.axis = gen.axis
        self.q, self.k, self.v = gen.q_name, gen.k_name, gen.v_name
        self.sig = gen.sig()
        self.ws, self.overlap, self.persistent, self.defer = gen.ws, gen.overlap, gen.persistent, gen.defer
        self.dynamic = gen.dynamic
        self.tile_store = gen.tile_store   # output tiles stored from STORE_L (its conversion's scratch)
        self.stage_store = gen.stage_store   # ... through the last key tile's value buffer instead
        self.own_range = gen.own_range   # each consumer folds its own rows' key tiles (own_range)
        self.pingpong = gen.pingpong
        self.fn = getattr(module, f"{gen.name}_gluon")
        self.fn_persistent = getattr(module, f"{gen.name}_gluon_persistent", None)
        self._plans = {}   # input signature -> a launch plan (plan_args)

    def __call__(self, BLOCK_I=None, BLOCK_J=None, num_warps=None, stages=None, **inputs):
        import torch
        q = inputs.get(self.q)
        if not (isinstance(q, torch.Tensor) and q.is_cuda and torch.cuda.get_device_capability(q.device) >= (9, 0)):
            raise ValueError(f"program {self.name!r}: the Gluon kernel runs on an sm_90+ GPU only (CUDA tensors "
                             "there); use af.compile")
        grid, args, kw, out, site = self._plan(inputs, (BLOCK_I, BLOCK_J, num_warps, stages))
        _allocator()
        with torch.cuda.device(q.device):
            if site is not None:   # a kept plan: Triton's compiled kernel launched directly once it exists
                site(grid, args, kw)
            else:
                self._fn(grid)[grid](*args, **kw)
        return out

    def _fn(self, grid):
        """The kernel a launch runs: a one-axis grid is the persistent kernel (launch_args chose it)."""
        return self.fn_persistent if len(grid) == 1 else self.fn

    def _nests(self, t, name):
        return _nests(t, self.tensors[name])

    def _signature(self, inputs, opts):
        """What a launch plan depends on: each operand's shape, strides, dtype, device and
        16-byte alignment, the tile options and L2_KB; None (no plan kept) where an operand is
        not a plain tensor."""
        import torch
        key = [opts, L2_KB]
        for n in self.tensors:
            t = inputs.get(n)
            if type(t) is not torch.Tensor:
                return None
            key.append((tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0))
        return tuple(key)

    def plan_args(self, inputs, BLOCK_I=None, BLOCK_J=None, num_warps=None, stages=None):
        """``launch_args`` kept per input signature (``_signature``): the first call checks the
        inputs and chooses the tiles and the grid; a later call with the same signature only puts
        its operands, fresh outputs and (dynamic work items) a zeroed counter into the kept
        arguments, by position (operands passed twice, or aliased, stay per call)."""
        return self._plan(inputs, (BLOCK_I, BLOCK_J, num_warps, stages))[:4]

    def _plan(self, inputs, opts):
        """plan_args and the kept plan's launch site (codegen/fastlaunch.py ``Site``: after the
        plan's first launch through Triton's JIT, its compiled kernel is launched directly;
        None where no plan is kept). Every per-call slot is a tensor whose dtype and alignment
        the plan fixes (the inputs' are in the signature; outputs and the counter are fresh
        allocations of fixed dtypes), so the site watches none of them."""
        import torch
        key = self._signature(inputs, opts)
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            grid, args, kw, out = self.launch_args(inputs, *opts)
            site = None
            if key is not None:
                from acefuse.codegen.fastlaunch import Site
                slots, pos = [("val", a) for a in args], 0
                for n, axes in self.tensors.items():
                    slots[pos], pos = ("in", n), pos + 1 + len(axes)
                for o, axes in self.out_axes.items():
                    slots[pos], pos = ("out", o), pos + 1 + len(axes)
                if len(grid) == 1 and self.dynamic:   # the persistent kernel's work-item counter, last
                    slots[-1] = ("cnt", None)
                outs = [(o, tuple(t.shape), t.dtype, t.device) for o, t in out.items()]
                template = [x if k == "val" else None for k, x in slots]
                site = Site(self._fn(grid), template, keyed=[i for i, v in enumerate(template) if v is None])
                self._plans[key] = (grid, slots, kw, outs, site)
            return grid, args, kw, out, site
        grid, slots, kw, outs, site = plan
        out = {o: torch.empty(shape, device=dev, dtype=dt) for o, shape, dt, dev in outs}
        dev = outs[0][3]
        args = [inputs[x] if k == "in" else out[x] if k == "out" else x if k == "val"
                else torch.zeros(1, dtype=torch.int32, device=dev) for k, x in slots]
        return grid, args, kw, out, site

    def launch_args(self, inputs, BLOCK_I=None, BLOCK_J=None, num_warps=None, stages=None):
        """(grid, positional arguments, constexpr keywords, outputs) of one launch; the checks
        of the inputs (any device: the CPU tests call this without launching). The
        warp-specialised kernel: BLOCK_I rows per consumer warpgroup (two per program, 4 warps
        each; ``num_warps`` is theirs: 4), ``stages`` key/value stages in its ring."""
        import torch
        import triton
        from triton.experimental.gluon import language as gl
        from acefuse.codegen.input_types import axis_lengths
        lens = axis_lengths(self.name, self.tensors, inputs)
        empty = sorted(a for a, n in lens.items() if n == 0)
        if empty:
            raise ValueError(f"program {self.name!r}: axes {empty} are empty; the Gluon kernel needs at least "
                             "one row and one key (af.compile handles empty inputs)")
        q, k, v = inputs[self.q], inputs[self.k], inputs[self.v]
        if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"program {self.name!r}: the Gluon kernel takes 16-bit {self.q}, {self.k}, {self.v} "
                             f"of one dtype (got {q.dtype}, {k.dtype}, {v.dtype}); use af.compile")
        for n in (self.q, self.k, self.v):   # what a TMA descriptor over (keys or rows, inner axis) needs
            t = inputs[n]
            if t.stride(-1) != 1 or t.data_ptr() % 16 or any((st * t.element_size()) % 16 for st in t.stride()[:-1]):
                raise ValueError(f"program {self.name!r}: the Gluon kernel reads {n!r} through TMA descriptors, "
                                 f"which need its last axis contiguous, its other strides multiples of 16 bytes "
                                 f"and a 16-byte aligned start (strides {tuple(t.stride())}); pass "
                                 f"{n}.contiguous() or use af.compile")
        (c,), (e,) = self.C, self.E
        D, Ev, n_j, n_rows = lens[c], lens[e], lens[self.axis], math.prod(lens[a] for a in self.R)
        g0 = len(self.G)
        if len(self.R) > 1 and not all(q.shape[k] == 1 or q.stride(k) == q.shape[k + 1] * q.stride(k + 1)
                                       for k in range(g0, g0 + len(self.R) - 1)):
            # several query axes: read as one (rows, inner axis) matrix
            raise ValueError(f"program {self.name!r}: the Gluon kernel reads {self.q!r} over its query axes "
                             f"{' '.join(self.R)} as one matrix of rows, which needs their strides to nest "
                             f"(strides {tuple(q.stride())}); pass {self.q}.contiguous() or use af.compile")
        BLOCK_D = max(16, triton.next_power_of_2(D))
        BLOCK_E = max(16, triton.next_power_of_2(Ev))
        # 128 keys a tile (64 for values of more than 128 columns); with ws + overlap each consumer
        # also holds the next tile's score: 128 keys ran right and fastest there on an H200 (session
        # 17: 646.8 TFLOP/s at global 16K against 575.1 without the overlap), 64 for wider values
        BLOCK_J = BLOCK_J or (min(128, max(64, BLOCK_E)) if not (self.ws and self.overlap)
                              else (128 if BLOCK_E <= 128 else 64))
        BLOCK_I = BLOCK_I or (64 if self.ws else 128)
        num_warps = num_warps or (4 if self.ws else 8)
        if BLOCK_D > 256 or BLOCK_E > 256:
            raise ValueError(f"program {self.name!r}: the Gluon kernel takes {c!r} and {e!r} up to 256")
        if self.ws and num_warps != 4:
            raise ValueError(f"program {self.name!r}: the warp-specialised Gluon kernel's consumers are one "
                             f"warpgroup each (num_warps=4, got {num_warps})")
        if BLOCK_I % (16 * num_warps) or BLOCK_J % 16:
            raise ValueError(f"program {self.name!r}: BLOCK_I must be a multiple of 16 * num_warps and "
                             f"BLOCK_J of 16 (got {BLOCK_I}, {BLOCK_J}, {num_warps} warps)")
        if self.ws:   # shared memory: two query tiles and the ring; 227 KB per program on sm_90
            per_stage = BLOCK_J * (BLOCK_D + BLOCK_E) * 2
            # the output tile's layout conversion (GluonGen.store_outputs) may take shared memory:
            # room for one tile of it (Triton 3.9 took 7936 bytes at 64 x 128)
            fixed = 2 * BLOCK_I * BLOCK_D * 2 + 1024 + (BLOCK_I * BLOCK_E * 2 if self.tile_store and not self.stage_store
                                                        else 0)
            if self.stage_store and BLOCK_J < 2 * BLOCK_I:
                raise ValueError(f"program {self.name!r}: stage_store writes both consumers' output tiles into one "
                                 f"value tile, which needs BLOCK_J >= 2 * BLOCK_I (got {BLOCK_J}, {BLOCK_I})")
            stages = stages or max(2, min(4, (SMEM_SM90 - fixed) // per_stage))
            if self.defer and stages < 3:
                # tile t waits for tile t+1's keys while tile t-1's stage is released only in
                # tile t's body: with two stages tile t+1 could never be copied
                raise ValueError(f"program {self.name!r}: the deferred P @ V (defer=True) needs 3 or more "
                                 f"key/value stages (got {stages})")
            if fixed + stages * per_stage > SMEM_SM90 or stages < 2:
                raise ValueError(f"program {self.name!r}: {stages} key/value stages of {BLOCK_J} keys and two "
                                 f"query tiles of {BLOCK_I} rows do not fit sm_90's shared memory (or fewer "
                                 "than 2 stages); use fewer stages or smaller tiles")
        dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
        out = {o: torch.empty([lens[a] for a in axes], device=q.device, dtype=q.dtype)
               for o, axes in self.out_axes.items()}
        args = []
        for n, axes in self.tensors.items():
            args.append(inputs[n])
            args += [inputs[n].stride(i) for i in range(len(axes))]
        for o, axes in self.out_axes.items():
            args.append(out[o])
            args += [out[o].stride(i) for i in range(len(axes))]
        args += [lens[a] for a in self.G + self.R + self.E + self.C + self.L]
        args += [n_rows, n_j]
        kw = dict(BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J, BLOCK_E=BLOCK_E, BLOCK_D=BLOCK_D, DOT_T=dt, SCAN=16,
                  INSTR_N=math.gcd(BLOCK_J, BLOCK_E, 256), num_warps=num_warps)
        if self.ws:
            # 12 warps (the load partition's warpgroup included) at WS_MAXNREG registers each on
            # average: each consumer warpgroup gets WS_REGS, the load partition 24
            grid = (triton.cdiv(n_rows, 2 * BLOCK_I), math.prod(lens[a] for a in self.G))
            kw.update(NS=stages, REGS=WS_REGS, maxnreg=WS_MAXNREG)
            if self.persistent and n_j % BLOCK_J == 0 and all(self._nests(inputs[n], n) for n in (self.q, self.k, self.v)):
                # the persistent kernel (kernel_ws_persistent): its descriptors span the grid axes
                props = torch.cuda.get_device_properties(q.device) if q.is_cuda else None
                sms = props.multi_processor_count if props else 132
                grid = (min(grid[0] * grid[1], sms),)
                kw.update(L2_KB=L2_KB if L2_KB is not None else (getattr(props, "L2_cache_size", 0) >> 10
                                                                  if props else 51200))
                if self.dynamic:   # the work-item counter, zero before the launch
                    args.append(torch.zeros(1, dtype=torch.int32, device=q.device))
        else:
            grid = (triton.cdiv(n_rows, BLOCK_I), math.prod(lens[a] for a in self.G))
        return grid, args, kw, out


SMEM_SM90 = 232448   # bytes of shared memory one program may use on sm_90 (227 KB)
WS_REGS = 240        # registers per thread of a consumer warpgroup (setmaxnreg)
WS_MAXNREG = 168     # the kernel's register limit: 3 warpgroups x 128 threads x 168 = the 64K file
L2_KB = None         # the persistent kernel's L2 size (KB) for its order of work items; None: the device's


def _nests(t, axes):
    """Whether tensor ``t`` over ``axes`` (grid axes, rows, inner axis) is one matrix
    ``(grid axes x rows, inner axis)``: each outer axis' stride is the next one's extent times
    its stride (an axis of length 1 adds no offset, whatever its stride)."""
    st, sh = t.stride(), t.shape
    return all(sh[i] == 1 or st[i] == sh[i + 1] * st[i + 1] for i in range(len(axes) - 2))


def _allocator():
    """Device-side TMA descriptors need a global scratch allocation: torch's, unless the
    caller set an allocator already."""
    import torch
    import triton
    from triton.runtime import _allocation
    try:
        cur = _allocation._allocator.get()
    except Exception:
        cur = None
    if cur is None or isinstance(cur, getattr(_allocation, "NullAllocator", ())):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
