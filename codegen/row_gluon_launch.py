"""The row family's staged Gluon kernel as a compiled object (codegen/row_gluon.py generates its
source): ``compile_staged`` writes the generated module to acefuse's cache folder and loads it;
``RowStagedKernel`` checks the inputs, sizes the chunk and the ring against sm_90's shared
memory, allocates the outputs and launches (``launch_args``: every check, on any device), with
the partial form (codegen/row_gluon_partial.py) where a row does not fit in the ring;
``run_emulated`` runs the compute partition's arithmetic in Triton's interpreter on the CPU.
Triton is imported inside the functions only (``import acefuse`` does not import it).
"""
from __future__ import annotations

import hashlib

from acefuse.codegen.emit import CodegenError
from acefuse.codegen.contraction_gluon import SMEM_SM90, _allocator
from acefuse.codegen.row_gluon_partial import ring_split

CHUNK = 4096          # elements of a row per ring slot (the probe's [64, 64]: benchmarks/staged_rows_probe.py)
DEFAULT_NBUF = 24     # ring slots (at most: fewer where the row's inputs need more room per slot)
DEFAULT_WARPS = 8     # compute warps (the probe's best: ws nbuf=24 w8, 80.1% of copy at 4096x65536)
BARRIER_BYTES = 2048  # shared memory kept for the mbarriers and the reductions' scratch


def _chunk_shape(n_j, chunk=CHUNK):
    """(CR, CW) of a chunk: CW the widest of 64, 32, 16, 8 elements dividing the row (each sub-row
    inside one row of the flat ``[rows x n_j / CW, CW]`` view the TMA descriptor takes), CR
    sub-rows (at most 256, TMA's box limit) making ``chunk`` elements; None when no width divides."""
    for cw in (64, 32, 16, 8):
        if n_j % cw == 0:
            return min(256, max(1, chunk // cw)), cw
    return None


class RowStagedKernel:
    """The staged Gluon kernel of a row program: ``kernel(**inputs)`` -> dict of outputs (an sm_90
    GPU; codegen/row_gluon.py's docstring says what the inputs must be). ``nbuf``, ``num_warps``,
    ``chunk``: the ring's slots (None: as many as fit, up to DEFAULT_NBUF), the compute warps,
    the elements per slot; ``source``: the generated module. A row longer than the ring (more
    chunks than fit, or than ``nbuf``) runs the partial form (``partial``: its source and
    module, or None where the kernel has none: tma_store), its ring all the slots that fit (or
    ``nbuf``), ``ring`` of them rotating (None: ``ring_split``'s), the others kept."""

    def __init__(self, fusion, source, module, gen, nbuf=None, num_warps=None, chunk=None, tma_store=False,
                 rows_in_flight=1, partial=None, ring=None):
        self.fusion, self.source, self.module = fusion, source, module
        self.partial_source, self.partial_module = partial or (None, None)
        self.partial_fn = getattr(self.partial_module, f"{gen.name}_staged", None)
        self.ring = ring
        self.name, self.axis = gen.name, gen.axis
        self.tensors = dict(gen.tensors)
        self.staged = list(gen.staged)
        self.row_axes = list(gen.row_axes)
        self.index_tensors = list(gen.index_tensors)
        self.stores = list(gen.stores())
        self.store_dtypes = dict(gen.launch_store_dtypes())
        self.nbuf, self.num_warps, self.chunk = nbuf, num_warps or DEFAULT_WARPS, chunk or CHUNK
        self.tma_store, self.elem_out = tma_store, list(gen.elem_out)
        # rows_in_flight=2: two compute groups of num_warps // 2 warps each (StagedGen.kernel)
        self.rows_in_flight = rows_in_flight
        self.fn = getattr(module, f"{gen.name}_staged", None)
        # the per-element forms (StagedGen's exp2, hoist, qfast) where not all on
        self.forms = "".join(f",no_{k}" for k in ("exp2", "hoist", "qfast") if not getattr(gen, k, True))

    @property
    def tag(self) -> str:
        return (f"nbuf={self.nbuf or 'auto'},w={self.num_warps},chunk={self.chunk}"
                + (",tma_store" if self.tma_store else "") + self.forms
                + (f",ring={self.ring}" if self.ring is not None else "")
                + (f",rif={self.rows_in_flight}" if self.rows_in_flight > 1 else ""))

    def __call__(self, **inputs):
        import torch
        x = inputs.get(self.staged[0])
        if not (isinstance(x, torch.Tensor) and x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)):
            raise ValueError(f"program {self.name!r}: the staged Gluon kernel runs on an sm_90+ GPU only (CUDA "
                             "tensors there); use af.compile")
        grid, args, kw, out = self.launch_args(inputs)
        _allocator()
        with torch.cuda.device(x.device):
            (self.partial_fn if "KEEP" in kw else self.fn)[grid](*args, **kw)
        return out

    def launch_args(self, inputs):
        """(grid, positional arguments, constexpr keywords, outputs) of one launch, and every check
        of the inputs (any device: the CPU tests call this without launching)."""
        import torch
        import triton
        from triton.experimental.gluon import language as gl
        name = self.name
        from acefuse.codegen.input_types import axis_lengths
        lens = axis_lengths(name, self.tensors, inputs)
        if any(v == 0 for v in lens.values()):
            raise ValueError(f"program {name!r}: an empty axis ({lens}); the staged kernel needs rows and "
                             "columns (af.compile handles empty inputs)")
        n_j = lens[self.axis]
        n_rows = 1
        for a in self.row_axes:
            n_rows *= lens[a]
        dev = inputs[self.staged[0]].device
        if any(inputs[n].device != dev for n in self.tensors):
            raise ValueError(f"program {name!r}: all inputs must be on one device")
        for n in self.staged:
            t = inputs[n]
            if t.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"program {name!r}: the staged kernel copies {n!r} into shared memory as a "
                                 f"16-bit tensor (bfloat16 or float16), got {t.dtype}; use af.compile's Triton "
                                 "kernel")
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(f"program {name!r}: the staged kernel reads {n!r} through a TMA descriptor over "
                                 f"its rows, which needs it contiguous and 16-byte aligned (strides "
                                 f"{tuple(t.stride())}); pass {n}.contiguous() or use af.compile")
        for n in self.tensors:
            if n not in self.index_tensors and not inputs[n].dtype.is_floating_point:
                raise ValueError(f"program {name!r}: input {n!r} must be a float tensor, got {inputs[n].dtype}")
        cs = _chunk_shape(n_j, self.chunk)
        if cs is None:
            raise ValueError(f"program {name!r}: the fused axis {self.axis!r} has {n_j} elements, not a multiple of "
                             "8; TMA rows need 16-byte multiples (the Triton kernel handles it)")
        CR, CW = cs
        if n_j < CR * CW:
            raise ValueError(f"program {name!r}: the fused axis {self.axis!r} has {n_j} elements, fewer than one "
                             f"chunk ({CR * CW}); the single-tile Triton schedule reads such rows once already")
        NC = triton.cdiv(n_j, CR * CW)
        per_slot = sum(CR * CW * inputs[n].element_size() for n in self.staged)
        out_bytes = 2 * CR * CW * 2 * len(self.elem_out) if self.tma_store else 0   # two 16-bit buffers each
        cap = (SMEM_SM90 - BARRIER_BYTES - out_bytes) // per_slot
        split = None
        if NC > min(cap, self.nbuf or cap):   # the row does not fit: partial staging (one row in flight)
            nbuf = self.nbuf or cap
            split = ring_split(nbuf, per_slot, self.ring) if nbuf <= cap else None
            why = ("tma_store has no partial form: use tma_store=False" if self.tma_store else
                   "this kernel was made without its partial form: use compile_staged" if self.partial_source is None else
                   f"nbuf={nbuf} is more than fit" if nbuf > cap else
                   f"ring={self.ring} leaves no slot kept or none rotating: use 1 <= ring < {nbuf}"
                   if split is None and self.ring is not None else
                   f"only {nbuf} slots fit, it needs 3: use a smaller chunk" if split is None else None)
            if why:
                room = f"sm_90's shared memory holds ({cap})" if NC > cap else f"nbuf={nbuf}"
                raise ValueError(f"program {name!r}: a row of {n_j} elements of {', '.join(self.staged)} needs {NC} "
                                 f"ring slots of {per_slot} bytes, more than {room}, and partial staging cannot take "
                                 f"it ({why}); af.compile's Triton loop schedule runs it")
        else:
            nbuf = self.nbuf or max(NC, min(DEFAULT_NBUF, cap))
            if nbuf > cap:
                raise ValueError(f"program {name!r}: nbuf={nbuf} ring slots; the row needs {NC} and shared memory "
                                 f"holds {cap}")
        if self.rows_in_flight > 1 and nbuf > 64 and split is None:
            # (each group keeps the parities of its next fill of every slot as the bits of one int64)
            raise ValueError(f"program {name!r}: {nbuf} ring slots (nbuf={self.nbuf}, {NC} chunks a row); "
                             "rows_in_flight=2 takes at most 64: use a larger chunk or rows_in_flight=1")
        nsub = n_j // CW
        if n_rows * nsub + CR >= 2 ** 31:
            raise ValueError(f"program {name!r}: {n_rows} rows of {nsub} sub-rows overflow the TMA coordinates "
                             "(int32)")
        nw = self.num_warps
        if nw not in (1, 2, 4, 8, 16):
            raise ValueError(f"program {name!r}: num_warps={nw}; use 4, 8 or 16")
        floats = [inputs[n] for n in self.tensors if n not in self.index_tensors]
        odt = floats[0].dtype if floats[0].dtype.is_floating_point and floats[0].element_size() > 1 else torch.float32
        out = {}
        for o, axes in self.stores:
            dt = self.store_dtypes.get(o)
            dt = odt if dt is None else getattr(torch, "int64" if dt == "index" else dt)
            out[o] = torch.empty([lens[a] for a in axes], device=dev, dtype=dt)
        args = []
        for n, axes in self.tensors.items():
            args.append(inputs[n])
            args += [inputs[n].stride(i) for i in range(len(axes))]
        for o, axes in self.stores:
            args.append(out[o])
            args += [out[o].stride(i) for i in range(len(axes))]
        args += [lens[a] for a in self.row_axes]
        args += [n_rows, n_j, nsub]
        kw = dict(NC=NC, NBUF=nbuf, CR=CR, CW=CW, EVEN=n_j % (CR * CW) == 0, num_warps=nw)
        if split is not None:   # the partial form: KEEP kept slots, RING rotating, one group of nw warps
            kw.update(KEEP=split[0], RING=split[1])
        elif self.rows_in_flight > 1:
            # two groups of nw // 2 warps (the kernel's num_warps: the first group's, the default
            # partition); the copy warp's warpgroup rounds the warps up to whole warpgroups, which
            # share the 64K registers: REGS per thread (setmaxnreg) for the second group, the same
            # as the kernel's limit
            if nw < 2:
                raise ValueError(f"program {name!r}: rows_in_flight=2 splits num_warps={nw} into two groups; use 8")
            g = nw // 2
            regs = min(256, 65536 // (32 * ((2 * g + 1 + 3) // 4 * 4)) // 8 * 8)
            kw.update(num_warps=g, REGS=regs, maxnreg=regs)
        if self.tma_store:
            for o in self.elem_out:
                if out[o].dtype not in (torch.bfloat16, torch.float16):
                    raise ValueError(f"program {name!r}: tma_store copies output {o!r} out of 16-bit buffers; "
                                     f"it is {out[o].dtype} here (use tma_store=False)")
                kw[f"DT_O_{o}"] = gl.bfloat16 if out[o].dtype == torch.bfloat16 else gl.float16
        for n in self.staged:
            kw[f"DT_{n}"] = gl.bfloat16 if inputs[n].dtype == torch.bfloat16 else gl.float16
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
        return (min(sms, n_rows),), args, kw, out


def run_emulated(fusion, programs=2, chunk=None, opts=None, nbuf=None, ring=None, **inputs) -> dict:
    """Run ``emulation_source``'s kernel in Triton's interpreter (the CPU; TRITON_INTERPRET=1) on
    ``inputs`` (checked as the staged kernel checks them), ``programs`` persistent programs:
    the staged kernel's generated arithmetic, masks and merge against a float64 reference
    without a GPU. Returns the outputs by name. ``opts``: StagedGen's (exp2, hoist, qfast,
    rows_in_flight). A row longer than ``nbuf`` slots (or than fit) runs the partial form's
    emulation (one row in flight): its slots as a scratch ring per program in global memory,
    each chunk copied in where the kernel waits for it and read back from there, filled with
    NaN first (a read of a slot that does not hold the chunk shows)."""
    from acefuse.codegen.compile import cached_source, load_module
    from acefuse.codegen.row_gluon import StagedGen, emulation_source
    gen = StagedGen(fusion, emulate=True, **(opts or {}))
    src = emulation_source(fusion, **(opts or {}))
    h = hashlib.sha256(src.encode()).hexdigest()[:16]
    mod = load_module(cached_source(f"{gen.name}_emulated", h, src), f"acefuse_emulated_{gen.name}_{h}")
    k = RowStagedKernel(fusion, src, mod, gen, chunk=chunk, nbuf=nbuf, ring=ring, partial=(src, mod))
    grid, args, kw, out = k.launch_args(inputs)
    grid = (min(programs, grid[0]),)
    if "KEEP" in kw:   # the partial form: its own emulation, with the scratch rings
        import torch
        po = dict(opts or {}, rows_in_flight=1, partial=True)
        src = emulation_source(fusion, **po)
        h = hashlib.sha256(src.encode()).hexdigest()[:16]
        mod = load_module(cached_source(f"{gen.name}_emulated", h, src), f"acefuse_emulated_{gen.name}_{h}")
        rings = [torch.full((grid[0], kw["NBUF"], kw["CR"] * kw["CW"]), float("nan"), dtype=inputs[n].dtype,
                            device=inputs[n].device) for n in gen.staged]
        keys = ("NC", "KEEP", "RING", "CR", "CW", "EVEN")
        getattr(mod, f"{gen.name}_emulated")[grid](*args[:-1], *rings, **{n: kw[n] for n in keys})
        return out
    kw = {n: v for n, v in kw.items() if n in ("NC", "CR", "CW", "EVEN")}
    getattr(mod, f"{gen.name}_emulated")[grid](*args[:-1], **kw)
    return out


def compile_staged(fusion, nbuf=None, num_warps=None, chunk=None, tma_store=False, exp2=True, hoist=True,
                   qfast=True, rows_in_flight=1, ring=None, **fuse_kw) -> RowStagedKernel:
    """The staged Gluon kernel of a row program (a Fusion, or a program: fused here), written to
    acefuse's cache folder and loaded; a ValueError (CodegenError) names why a program has none.
    Needs ``triton.experimental.gluon`` to load and an sm_90 GPU to run. ``exp2``, ``hoist``,
    ``qfast``: the per-element forms of StagedGen (all False: the first generated kernel's);
    ``rows_in_flight=2``: two compute groups of ``num_warps // 2`` warps on alternating rows.
    A row longer than the ring runs the partial form (generated and loaded here too, except with
    tma_store; one group of ``num_warps`` warps), ``ring`` of its slots rotating (None: the
    launcher's choice, ``ring_split``)."""
    import acefuse as af
    from acefuse.fuse import certified_or_unfused
    from acefuse.codegen import contraction
    from acefuse.codegen.compile import cached_source, load_module
    from acefuse.codegen.row_gluon import StagedGen
    f = fusion if hasattr(fusion, "passes") else af.fuse(fusion, **fuse_kw)
    if certified_or_unfused(f) is not f:
        raise CodegenError(f"program {f.program.name!r}: its fusion is not certified; no staged kernel")
    if contraction.is_contraction(f):
        raise CodegenError(f"program {f.program.name!r} is of the contraction family; the staged kernel is the "
                           "row family's (codegen/contraction_gluon.py has the contraction's Gluon kernel)")
    gen = StagedGen(f, tma_store=tma_store, exp2=exp2, hoist=hoist, qfast=qfast, rows_in_flight=rows_in_flight)
    src = gen.module()
    h = hashlib.sha256(src.encode()).hexdigest()[:16]
    path = cached_source(f"{gen.name}_staged", h, src)
    mod = load_module(path, f"acefuse_staged_{gen.name}_{h}")
    partial = None
    if not tma_store:   # the form for rows longer than the ring
        psrc = StagedGen(f, exp2=exp2, hoist=hoist, qfast=qfast, partial=True).module()
        ph = hashlib.sha256(psrc.encode()).hexdigest()[:16]
        partial = (psrc, load_module(cached_source(f"{gen.name}_partial", ph, psrc), f"acefuse_partial_{gen.name}_{ph}"))
    return RowStagedKernel(f, src, mod, gen, nbuf=nbuf, num_warps=num_warps, chunk=chunk, tma_store=tma_store,
                           rows_in_flight=rows_in_flight, partial=partial, ring=ring)


def auto_staged(kernel, inputs: dict):
    """The automatic staged-or-Triton choice (codegen/row_gluon_auto.py ``auto_staged``)."""
    from acefuse.codegen.row_gluon_auto import auto_staged as choose
    return choose(kernel, inputs)


__all__ = ["RowStagedKernel", "auto_staged", "compile_staged", "run_emulated"]
