"""acefuse regions inside Inductor: ``Backend(inner="inductor")``.

Each compiled region of a specialised graph (runtime.specialize) becomes a call of
``region_call(key, *sources)``: the region's input adapters (views, size-1 squeezes; widening
casts only in training, and there only where the region is not read in its own type:
runtime.grad_plan), one opaque custom op ``acefuse::region(key, inputs)`` that runs the
acefuse kernel on the program's inputs, and the output adapters (permutes, reshapes, the output
dtype and torch's strides). For inference the op takes float16/bfloat16 sources as they are (the
kernel widens on load) and its launcher writes each output in eager's type
(``Imported.direct_plan``): no widened copy of an input, no float32 output narrowed by torch. The rewritten graph goes to Inductor (``compile_fx``), which traces the
adapters into ATen ops and compiles and fuses everything acefuse did not take (matmuls'
neighbours, RoPE, SiLU-mul, residual adds); the region stays one opaque call.

Training: AOTAutograd builds the joint graph. ``acefuse::region`` has an autograd formula
(``torch.library.register_autograd``): in a region whose inputs require grad the op runs the
*augmented* forward kernel (the outputs plus the saved values acefuse's backward reads: a
softmax's max and sum, a norm's inverse deviation) and its backward is a second opaque op,
``acefuse::region_bwd``, running the kernels of ``af.backward(program)``
(acefuse.autograd.BackwardKernel). The adapters are torch ops, so AOTAutograd differentiates
them (a head-split view's gradient, a widening cast's). No gradient is dropped: an input that
needs a gradient the derived backward does not compute, a backward kernel that fails, or a
region acefuse cannot differentiate gets torch autograd of the program
(acefuse.autograd_ref), with one warning.

Output metadata: Inductor plans buffers and fuses consumers from the op's *fake* outputs, so
their shapes, dtypes and strides must be exactly the real ones. The fake implementation runs
the region's kernel once on zeros of the inputs' shapes (per input signature; generated
launchers decide their output dtypes) and records what it gives; the real implementation
copies any output whose strides differ into the recorded layout.

Region keys are content hashes (program, mode, the inputs differentiated, adapters), so a
graph Inductor caches on disk and loads in another process names the same region there.
"""
from __future__ import annotations

import hashlib
import warnings

import torch
import torch.fx

_ENTRIES: dict = {}          # key -> RegionOp
stats = {"region_calls": 0, "region_bwd_calls": 0, "inductor_compiles": 0}
_REGISTERED = False


def _as_dict(out, keys):
    return out if isinstance(out, dict) else {keys[0]: out}


class RegionOp:
    """One region as the custom op sees it: the kernel over the program's inputs (in
    ``names`` order), its outputs (``keys``) and, in training (``dk``: the differentiable
    kernel), the saved values the backward reads after them."""

    def __init__(self, key, region, dk=None, plan=None):
        self.key, self.region = key, region
        self.imp = region.imp
        self.prog = region.program
        self.kernel = region.kernel
        self.dk = dk
        # (chains, out_dtypes): the op reads float inputs in their own types and writes eager's
        # output types (Imported.direct_plan); None: inputs widened by the adapters
        self.plan = plan
        self._out_kw = {"out_dtypes": plan[1]} if plan is not None and plan[1] is not None else {}
        # on the GPU the launcher itself (Kernel.__call__'s grad and empty-input checks are moot:
        # the op's implementation runs below autograd; an empty input takes the kernel's path)
        cuda = any(isinstance(v, torch.Tensor) and v.device.type == "cuda"
                   for v in (s.meta.get("af_val") for s in self.imp.sources))
        self._run = self.kernel.module.run if plan is not None and plan[1] is not None and cuda else self.kernel
        self.names = list(self.prog.tensors)
        self.keys = list(self.prog.outputs)
        self.n_out = len(self.keys)
        self.meta: dict = {}          # input signature -> [(shape, dtype, stride)] of every result
        self.disabled = None          # why the kernel no longer runs (torch evaluates the program)
        self.warned = set()
        self.calls = {"kernel": 0, "grad": 0, "torch": 0, "backward": 0, "backward_torch": 0}

    # -- what the forward op computes -------------------------------------------------------
    def saved_names(self) -> list:
        if self.dk is None:
            return []
        aug, bwd = self.dk._grad_kernels()
        return list(bwd.saved) if bwd is not None else []

    def forward(self, xs) -> list:
        # (the op's implementation runs below autograd: its inputs need no detach)
        inputs = dict(zip(self.names, xs))
        if self.disabled is None:
            try:
                return self._fix(xs, self._kernel_forward(inputs))
            except Exception as e:  # noqa: BLE001 - a kernel that fails must not break the model
                self._disable(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
        self.calls["torch"] += 1
        return self._fix(xs, self._torch_forward(inputs), fresh=False)

    def _kernel_forward(self, inputs) -> list:
        if self.dk is None:
            run = self._run if all(t.numel() for t in inputs.values()) else self.kernel
            out = _as_dict(run(**inputs, **self._out_kw), self.keys)
            self.calls["kernel"] += 1
            return [out[k] for k in self.keys]
        from acefuse.autograd import _to, wide_dtype
        dk = self.dk
        aug, bwd = dk._grad_kernels()
        odts = self._out_kw.get("out_dtypes") or {}    # eager's output types (runtime.grad_plan)
        if bwd is None:            # no derived backward: gradients are torch's (warned by dk)
            from acefuse.autograd import takes_out_dtypes
            out = _as_dict(self.kernel(**inputs, **(self._out_kw if takes_out_dtypes(self.kernel) else {})),
                           self.keys)
            self.calls["grad"] += 1
            return [_to(out[k], odts[k]) if k in odts else out[k] for k in self.keys]
        floats = [t for t in inputs.values() if t.dtype.is_floating_point]
        odt = floats[0].dtype if floats else torch.float32
        wide = wide_dtype(odt)
        values, direct = dk.wide_values(aug, bwd)
        kw = {"out_dtypes": {**odts, **{n: wide for n in values}}} if direct and (values or odts) else {}
        out = _as_dict(aug(**inputs, **kw), list(bwd.augmented.outputs))
        saved = [_to(out[n], wide) if n in values else out[n] for n in bwd.saved]
        outs = [_to(out[k], odts.get(k, odt)) if k in values else _to(out[k], odts[k]) if k in odts else out[k]
                for k in self.keys]
        # (an op's results may not alias each other: a saved output kept as is is copied)
        saved = [s.clone() if any(s is o for o in outs) else s for s in saved]
        self.calls["grad"] += 1
        return outs + saved

    def _torch_forward(self, inputs) -> list:
        """The program evaluated by torch (acefuse.autograd_ref) in float32 (float64 for
        float64): the outputs; the saved values are not computed (zeros: the backward of a
        disabled region is torch's too)."""
        from acefuse.autograd_ref import evaluate
        from acefuse.autograd import wide_dtype
        floats = [t for t in inputs.values() if t.dtype.is_floating_point]
        cd = wide_dtype(floats[0].dtype if floats else torch.float32)
        with torch.no_grad():
            outs = evaluate(self.prog, {k: (t.to(cd) if t.dtype.is_floating_point else t)
                                        for k, t in inputs.items()}, cd)
        return [outs[k] for k in self.keys] + [None] * len(self.saved_names())

    def _disable(self, err):
        """The kernel failed: from now on torch evaluates the program (one warning; the report
        lists the region as left, with the error)."""
        self.disabled = f"its kernel failed at run time and is disabled ({err})"
        self.region.kernel, self.region.kernel_error = None, err
        from acefuse.frontend.runtime import _warn
        _warn(self.imp.nodes, self.disabled, self.warned)

    # -- metadata: what the fake op gives ---------------------------------------------------
    @staticmethod
    def signature(xs):
        return tuple((tuple(x.shape), x.dtype, x.device.type) for x in xs)

    def fake(self, xs) -> list:
        sig = self.signature(xs)
        m = self.meta.get(sig)
        if m is None:
            calls = dict(self.calls)
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            with unset_fake_temporarily(), torch.no_grad():
                zs = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in xs]
                inputs = dict(zip(self.names, zs))
                res = None
                if self.disabled is None:
                    try:
                        res = self._kernel_forward(inputs)
                    except Exception as e:  # noqa: BLE001 - disabled now, so that every call agrees with this layout
                        self._disable(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
                if res is None:
                    res = [r.contiguous() if r is not None else torch.zeros((), device=xs[0].device)
                           for r in self._torch_forward(inputs)]
            m = self.meta[sig] = [(tuple(r.shape), r.dtype, tuple(r.stride())) for r in res]
            self.calls.update(calls)      # (that run is not a call of the model)
        return [torch.empty_strided(s, st, dtype=d, device=xs[0].device) for s, d, st in m]

    def _fix(self, xs, res, fresh=True) -> list:
        """The results in the recorded layout (what Inductor compiled its consumers for). ``fresh``:
        the results are new tensors (a kernel's), else one may alias an input and is copied."""
        # (one input signature recorded, the usual case: its layout; each result's shape is checked)
        m = next(iter(self.meta.values())) if len(self.meta) == 1 else self.meta.get(self.signature(xs))
        if m is None:   # (a graph Inductor loaded from its cache: the kernel's own, contiguous layout)
            return [r.contiguous() if r is not None else torch.zeros((), device=xs[0].device) for r in res]
        ptrs = () if fresh else {x.data_ptr() for x in xs if x.numel()}
        out = []
        for r, (shape, dtype, stride) in zip(res, m):
            if r is None:
                r = torch.zeros(shape, dtype=dtype, device=xs[0].device)
            if r.shape != shape:
                raise RuntimeError(f"acefuse: region {self.prog.name!r} gave a result of shape {tuple(r.shape)}, "
                                   f"recorded {shape} for these inputs (a bug; run with "
                                   "af.Backend(inner='eager') meanwhile, and please report)")
            if r.dtype != dtype:
                r = r.to(dtype)
            if r.stride() != stride and r.numel() > 1 or ptrs and r.numel() and r.data_ptr() in ptrs:
                # (the recorded layout; and an op's result may not alias its inputs)
                r = torch.empty_strided(shape, stride, dtype=dtype, device=r.device).copy_(r)
            out.append(r)
        return out

    # -- backward -------------------------------------------------------------------------
    def backward(self, want, xs, saved, cots) -> list:
        inputs = dict(zip(self.names, (x.detach() for x in xs)))
        names = [self.names[i] for i in want]
        cot = {}
        for k, g, x in zip(self.keys, cots, range(len(self.keys))):
            cot[k] = g
        grads = None
        dk = self.dk
        why = None
        if self.disabled is not None:
            why = self.disabled
        elif dk is None:
            why = "the region was specialised for inference (no input required grad)"
        else:
            aug, bwd = dk._grad_kernels()
            if bwd is None:
                why = dk._torch_reason or "no backward kernels"
            elif not set(names) <= set(bwd.grads):
                why = f"inputs {sorted(set(names) - set(bwd.grads))} need gradients its backward was not derived for"
            else:
                kin = dict(inputs)
                kin.update(zip(bwd.saved, saved))
                for k, g in cot.items():
                    kin[f"grad_{k}"] = g
                try:
                    got = dk._bwd_kernel(**{k: kin[k] for k in bwd.tensors})
                    grads = {n: got[f"grad_{n}"] for n in names}
                    self.calls["backward"] += 1
                except Exception as e:  # noqa: BLE001 - a failing backward kernel must not lose the gradient
                    dk._fall_back(f"its backward kernel failed at .backward() "
                                  f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})")
        if grads is None:
            if why is not None and why not in self.warned:
                self.warned.add(why)
                from acefuse.autograd import GradientFallbackWarning
                warnings.warn(f"acefuse: region {self.prog.name!r}: gradients computed by torch autograd of the "
                              f"program: {why}", GradientFallbackWarning, stacklevel=2)
            from acefuse.autograd import DifferentiableKernel
            ref = dk or DifferentiableKernel(self.prog, self.kernel, {})
            with _autograd_on():     # (a custom op's implementation runs with autograd dispatch off)
                got = ref._torch_grads(inputs, cot, names)
            grads = {n: got[f"grad_{n}"] for n in names}
            self.calls["backward_torch"] += 1
        out = []
        for n, i in zip(names, want):
            g = grads[n]
            x = xs[i]
            if tuple(g.shape) != tuple(x.shape):
                g = g.expand(x.shape)
            out.append(g.to(x.dtype).contiguous())
        return out


class _autograd_on:
    """Autograd recording inside a custom op's implementation, where the dispatcher excludes the
    autograd keys (torch autograd of the program would otherwise give no graph and silent zero
    gradients). Checked: raises when recording stays off."""

    def __enter__(self):
        K = torch._C.DispatchKey
        self._guards = []
        if hasattr(K, "AutogradFunctionality") and hasattr(torch._C, "_ForceDispatchKeyGuard"):
            exc = torch._C._dispatch_tls_local_exclude_set().remove(K.AutogradFunctionality)
            self._guards.append(torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exc))
        self._guards.append(torch.enable_grad())
        for g in self._guards:
            g.__enter__()
        if not (torch.ones(1, requires_grad=True) * 2).requires_grad:
            self.__exit__(None, None, None)
            raise RuntimeError("acefuse: autograd cannot record inside acefuse::region_bwd in this torch version, "
                               "so torch's gradient of the region cannot be computed there; use "
                               "af.Backend(inner='eager') for training")
        return self

    def __exit__(self, *exc):
        for g in reversed(self._guards):
            g.__exit__(*exc)
        return False


def _register():
    """Define ``acefuse::region`` and ``acefuse::region_bwd`` (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    @torch.library.custom_op("acefuse::region", mutates_args=(), schema="(str key, Tensor[] xs) -> Tensor[]")
    def region(key, xs):
        stats["region_calls"] += 1
        return _entry(key).forward(xs)

    @region.register_fake
    def _(key, xs):
        return _entry(key).fake(xs)

    @torch.library.custom_op("acefuse::region_bwd", mutates_args=(),
                             schema="(str key, int[] want, Tensor[] xs, Tensor[] saved, Tensor[] cots) -> Tensor[]")
    def region_bwd(key, want, xs, saved, cots):
        stats["region_bwd_calls"] += 1
        return _entry(key).backward(want, xs, saved, cots)

    @region_bwd.register_fake
    def _(key, want, xs, saved, cots):
        return [torch.empty(xs[i].shape, dtype=xs[i].dtype, device=xs[i].device) for i in want]

    def setup_context(ctx, inputs, output):
        key, xs = inputs
        e = _entry(key)
        ctx.key, ctx.n = key, len(xs)
        ctx.out_meta = [(o.shape, o.dtype) for o in output[:e.n_out]]
        ctx.save_for_backward(*xs, *output[e.n_out:])

    def backward(ctx, grads):
        vals = ctx.saved_tensors
        xs, saved = list(vals[:ctx.n]), list(vals[ctx.n:])
        need = ctx.needs_input_grad[1]
        want = [i for i, x in enumerate(xs) if need[i] and x.dtype.is_floating_point]
        res = [None] * ctx.n
        if not want:
            return None, res
        cots = [torch.zeros(s, dtype=d, device=xs[0].device) if g is None else g.to(d)
                for g, (s, d) in zip(grads, ctx.out_meta)]
        got = torch.ops.acefuse.region_bwd(ctx.key, want, xs, saved, cots)
        for i, g in zip(want, got):
            res[i] = g
        return None, res

    torch.library.register_autograd("acefuse::region", backward, setup_context=setup_context)
    _REGISTERED = True


def _entry(key) -> RegionOp:
    e = _ENTRIES.get(key)
    if e is None:
        raise RuntimeError(f"acefuse: no region {key!r} in this process: a graph compiled by acefuse's Inductor "
                           "backend was loaded without its regions (clear Inductor's cache, "
                           "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, or use af.Backend(inner='eager'))")
    return e


def region_call(key, *srcs):
    """A region in the graph handed to Inductor: input adapters, the opaque acefuse op, output
    adapters (traced by AOTAutograd into ATen ops around one ``acefuse::region`` call)."""
    e = _entry(key)
    imp = e.imp
    chains = e.plan[0] if e.plan is not None else None
    pins = imp.program_inputs(dict(zip(imp.sources, srcs)), chains=chains)
    res = torch.ops.acefuse.region(key, [pins[n] for n in e.names])
    return tuple(imp.torch_outputs(dict(zip(e.keys, res[:e.n_out]))))


def _plan(region, dk):
    """The region op's direct plan: for inference Imported.direct_plan's ``(chains, out_dtypes)``;
    in training runtime.grad_plan's ``(chains, out_dtypes)`` where the differentiable kernel reads
    its inputs in their own types (it writes its outputs in eager's types, its saved values wide);
    None where the region has none (the widening adapters)."""
    if region.kernel is None:
        return None
    imp = region.imp
    vals = {s: s.meta.get("af_val") for s in imp.sources}
    try:
        if dk is not None:
            from acefuse.frontend.runtime import grad_plan
            return grad_plan(imp, dk, vals)
        return imp.direct_plan(vals, region.kernel, imp.compute_dtype(vals))
    except Exception:  # noqa: BLE001 - the widening adapters always work
        return None


def _key(region, dk, plan=None) -> str:
    imp = region.imp
    h = hashlib.sha256()
    h.update(repr(plan).encode())
    h.update(repr(region.program).encode())
    h.update(repr(region.program.key()).encode())
    h.update(repr(sorted(dk.wrt) if dk is not None and dk.wrt is not None else (dk is not None)).encode())
    for s in imp.inputs:
        h.update(repr((s.name, s.chain, s.role, s.extra)).encode())
    for o in imp.outputs:
        h.update(repr((o.name, o.dim_names, o.shape, o.dtype, o.expr_axes, o.stride)).encode())
    return f"{region.program.name}_{h.hexdigest()[:20]}"


def op_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (runtime.specialize's result: each region a ``call_module``) with each region a
    ``region_call`` of a registered ``acefuse::region`` op instead."""
    _register()
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_module" or not n.target.startswith("af_region"):
            continue
        region = gm.get_submodule(n.target)
        if not all(isinstance(s.meta.get("af_val"), torch.Tensor) for s in region.imp.sources):
            # (an input that is not a tensor: the op takes tensors only) torch's ops, traced by Inductor
            from acefuse.frontend.runtime import _warn
            region.kernel, region.kernel_error = None, "an input of the region is not a tensor (acefuse::region takes tensors)"
            _warn(region.imp.nodes, region.kernel_error)
            n.target = n.target + "_torch"
            gm.add_submodule(n.target, region.fallback)
            continue
        dk = region.grad if region.grad is not None else None
        plan = _plan(region, dk)
        key = _key(region, dk, plan)
        if key not in _ENTRIES:
            _ENTRIES[key] = RegionOp(key, region, dk, plan)
        region.op_key = key
        with g.inserting_before(n):
            call = g.call_function(region_call, (key,) + tuple(n.args))
        n.replace_all_uses_with(call)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    gm.delete_all_unused_submodules()
    return gm


def compile_inductor(gm: torch.fx.GraphModule, args):
    """Inductor's compiled callable for ``gm`` (regions already ``region_call`` nodes) on
    these concrete arguments (static shapes)."""
    from torch._inductor.compile_fx import compile_fx
    stats["inductor_compiles"] += 1
    ins = [a for a in args]
    return compile_fx(gm, ins)


__all__ = ["op_graph", "compile_inductor", "region_call", "RegionOp", "stats"]
