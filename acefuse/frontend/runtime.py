"""Drop-in callables backed by acefuse kernels: ``compile_fn`` and the torch.compile ``backend``.

A compiled function specialises on the call's *shape signature* (shapes, dtypes,
devices, non-tensor arguments): the graph is re-imported for each new signature (cheap:
milliseconds), and each region's program is looked up by ``Program.key()`` in the
kernel cache, in memory and on disk, so a new shape with the same program reuses the
kernel. The generated module itself chooses its schedule from the sizes (one tile,
rolling loop, split), so whether the fused axis fits one tile needs no new kernel.

Regions that acefuse cannot compile (a contraction, several reduced axes, float64)
run in torch, with one warning line naming the region, its source line and why.

Training: a region whose inputs require grad (grad mode on) runs as a differentiable
kernel (acefuse.autograd): a ``torch.autograd.Function`` whose forward is the augmented
forward kernel and whose backward runs the kernels of ``af.backward(program)``, so its
outputs have a ``grad_fn`` and every input upstream or inside (a LayerNorm's weight and
bias) gets its gradient. torch.compile hands a plain backend the forward graph only
(no AOTAutograd), and autograd records each region as one node. A region acefuse
cannot differentiate or whose backward does not compile runs in torch, with one
warning naming the region and why: gradients are never dropped. When that region
holds contractions (matmuls: no derived backward kernel yet), they stay in torch and
the reductions around them are retried, as for inference. Grad mode and
``requires_grad`` are part of the shape signature, so the same function under
``torch.no_grad()`` (inference) runs the plain kernels.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import warnings
from pathlib import Path

import torch
import torch.fx

from acefuse.frontend.errors import FrontendError, UnsupportedOpError
from acefuse.frontend.graph import propagate, source_line, trace
from acefuse.frontend.importer import import_nodes
from acefuse.frontend.lower import kind_of, name_of
from acefuse.frontend.partition import find_regions, rebuild, region_outputs, split_composites


class AcefuseFallbackWarning(UserWarning):
    """A recognised region runs in torch instead of an acefuse kernel (the message says why)."""


class GradKernelError(FrontendError):
    """A region needs gradients and acefuse has no backward kernel for it (says why)."""

    def __init__(self, why: str):
        self.why = why
        super().__init__(f"its inputs require grad and acefuse has no backward kernel for it ({why}); "
                         "torch computes this region and its gradients (under torch.no_grad() the "
                         "kernel runs)")


stats = {"specializations": 0, "kernel_memory_hits": 0, "kernel_disk_hits": 0, "kernel_compiles": 0,
         "fallbacks": 0, "grad_kernel_compiles": 0}
_KERNELS: dict = {}
_FAILED: dict = {}
_GRAD: dict = {}


def clear_cache(memory_only: bool = True):
    """Forget compiled kernels in memory (the on-disk cache stays unless memory_only=False)."""
    _KERNELS.clear()
    _FAILED.clear()
    _GRAD.clear()
    if not memory_only:
        d = _index_dir()
        for p in d.glob("*.json"):
            p.unlink()


def _code_version() -> str:
    """A hash of the code that decides what a program compiles to (rules, extraction, codegen)."""
    from acefuse.codegen.compile import code_version
    return code_version()


def _index_dir() -> Path:
    from acefuse.codegen.compile import cache_dir
    d = cache_dir().parent / "frontend"
    d.mkdir(parents=True, exist_ok=True)
    return d


class _Loaded:
    """A generated module loaded from the disk cache (no fusion run)."""

    def __init__(self, module, path, program=None):
        self.module, self.path, self.program = module, path, program

    def __call__(self, **inputs):
        from acefuse.codegen import compile as cc
        names = cc.requires_grad_inputs((), inputs)
        if names:     # like a compiled Kernel: never a result without grad_fn
            return cc.grad_hook(self, names, (), inputs)
        return cc.run_module(self.module, (), inputs)


def _cache_warn(msg):
    from acefuse.codegen.compile import CacheWarning
    warnings.warn(f"acefuse: {msg}", CacheWarning, stacklevel=3)


def _load_indexed(idx: Path, program=None):
    """The kernel an index entry points to, or None (absent). A corrupt entry, or one whose
    kernel file is missing or changed, is removed with a warning (the caller regenerates)."""
    if not idx.exists():
        return None
    try:
        meta = json.loads(idx.read_bytes())
        path = Path(meta["path"])
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise ValueError(f"kernel file {path} does not match its recorded hash (truncated or overwritten)")
        from acefuse.codegen.compile import load_module
        return _Loaded(load_module(path, meta["module"]), path, program)
    except Exception as e:  # noqa: BLE001 - any bad entry is regenerated, never fatal
        _cache_warn(f"kernel cache index {idx.name} is unusable ({type(e).__name__}: {e}); "
                    "removed, the kernel is regenerated")
        try:
            idx.unlink()
        except OSError:
            pass
        return None


def get_kernel(prog, axis=None):
    """The kernel of a program: memory, then the on-disk index, then af.compile."""
    key = f"{prog.name}_{prog.key()}{'_' + axis if axis else ''}_{_code_version()}"
    if key in _KERNELS:
        stats["kernel_memory_hits"] += 1
        return _KERNELS[key]
    if key in _FAILED:
        raise _FAILED[key]
    idx = _index_dir() / f"{key}.json"
    k = _load_indexed(idx, prog)
    if k is not None:
        stats["kernel_disk_hits"] += 1
        _KERNELS[key] = k
        return k
    from acefuse.codegen.compile import compile_program
    try:
        k = compile_program(prog, axis=axis)
    except Exception as e:
        _FAILED[key] = e
        raise
    stats["kernel_compiles"] += 1
    from acefuse.codegen.compile import write_atomic
    mod = getattr(getattr(k, "module", None), "__name__", f"acefuse_gen_{prog.name}")
    if getattr(k, "path", None) is not None:   # (a staged kernel is two files: not indexed)
        sha = hashlib.sha256(Path(k.path).read_bytes()).hexdigest()
        write_atomic(idx, json.dumps({"path": str(k.path), "module": mod, "sha256": sha,
                                      "program": repr(prog)}).encode())
    _KERNELS[key] = k
    return k


def get_grad_kernel(prog, kernel):
    """The differentiable kernel of a region's program (acefuse.autograd), its augmented
    forward and backward kernels compiled; GradKernelError (naming the program and why)
    when ``af.backward`` or a backward kernel fails. Cached in memory by program."""
    key = f"{prog.name}_{prog.key()}_{_code_version()}"
    hit = _GRAD.get(key)
    if isinstance(hit, Exception):
        raise hit
    if hit is not None and hit.kernel is kernel:
        return hit
    from acefuse.autograd import DifferentiableKernel, BackwardKernel, compile_stage
    from acefuse.backward import backward
    dk = DifferentiableKernel(prog, kernel, {})
    if hit is not None:            # same program, kernel reloaded: reuse the compiled backward
        dk._aug = kernel if hit._aug is hit.kernel else hit._aug
        dk._bwd, dk._bwd_kernel = hit._bwd, hit._bwd_kernel
    else:
        try:
            # each stage through get_kernel: cached in memory and on disk like forward kernels
            bwd = backward(prog)
            bk = BackwardKernel(bwd, [compile_stage(s, get_kernel) for s in bwd.stages])
            dk._aug = kernel if bwd.augmented is prog else get_kernel(bwd.augmented)
            dk._bwd, dk._bwd_kernel = bwd, bk
        except Exception as e:  # noqa: BLE001 - reported as the region's reason to run in torch
            first = (str(e).strip().splitlines() or [""])[0]
            err = GradKernelError(f"{type(e).__name__}: {first}")
            _GRAD[key] = err
            raise err from e
        stats["grad_kernel_compiles"] += 1
    _GRAD[key] = dk
    return dk


class CompiledRegion(torch.nn.Module):
    """One region of the graph, run by an acefuse kernel; differentiable (``grad``, an
    acefuse.autograd kernel) when its inputs require grad. ``calls`` counts how each call
    ran: ``kernel`` (plain), ``grad`` (differentiable kernel), ``torch`` (fallback)."""

    def __init__(self, imp, kernel, fallback, grad=None):
        super().__init__()
        self.imp, self.kernel, self.grad = imp, kernel, grad
        self.program = imp.program
        self.fallback = fallback      # the region's own torch ops, same inputs and outputs
        self.grad_error = None
        self.calls = {"kernel": 0, "grad": 0, "torch": 0}

    def _torch(self, srcs):
        self.calls["torch"] += 1
        return tuple(self.fallback(*srcs))

    def forward(self, *srcs):
        if self.kernel is None:
            return self._torch(srcs)
        values = dict(zip(self.imp.sources, srcs))
        if _needs_grad(srcs):
            # (a parameter read inside the graph may require grad although no argument did
            # when the region was specialised: the differentiable kernel is built now)
            if self.grad is None and self.grad_error is None:
                try:
                    self.grad = get_grad_kernel(self.program, self.kernel)
                except GradKernelError as e:
                    self.grad_error = e
                    _warn(self.imp.nodes, e)
            if self.grad is None:
                return self._torch(srcs)
            try:
                outs = self.grad(**self.imp.program_inputs(values))
            except Exception as e:  # noqa: BLE001 - a kernel that fails must not break the model
                _warn(self.imp.nodes, f"its differentiable kernel failed at run time and is disabled "
                                      f"({type(e).__name__}: {e})")
                self.grad, self.grad_error = None, e
                return self._torch(srcs)
            self.calls["grad"] += 1
            return tuple(self.imp.torch_outputs(outs))
        try:
            outs = self.kernel(**self.imp.program_inputs(values))
        except Exception as e:  # noqa: BLE001 - a kernel that fails must not break the model
            _warn(self.imp.nodes, f"its kernel failed at run time and is disabled ({type(e).__name__}: {e})")
            self.kernel = None
            return self._torch(srcs)
        self.calls["kernel"] += 1
        return tuple(self.imp.torch_outputs(outs))

    def extra_repr(self):
        return repr(self.program)


def _needs_grad(values) -> bool:
    return torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _region_name(nodes) -> str:
    for n in nodes:
        if kind_of(n) in ("reduce", "contraction"):
            return name_of(n)
    return "region"


def _reject_dtype(imp) -> str | None:
    for s in imp.inputs:
        v = s.src.meta.get("af_val")
        if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
            return "float64 input (acefuse kernels take float32/float16/bfloat16)"
    for o in imp.outputs:
        if o.dtype == torch.float64:
            return "float64 output (acefuse kernels take float32/float16/bfloat16)"
    return None


def _warn(nodes, why, seen=None):
    """One warning line: the region, its source line, and why it runs in torch (once per
    region and reason within ``seen``: a specialisation retries regions)."""
    anchor = next((n for n in nodes if kind_of(n) in ("reduce", "contraction")), nodes[0])
    where = source_line(anchor)
    first = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
    msg = f"acefuse: region `{_region_name(nodes)}`{' at ' + where if where else ''} runs in torch: {first}"
    if seen is not None:
        if msg in seen:
            return
        seen.add(msg)
    stats["fallbacks"] += 1
    warnings.warn(msg, AcefuseFallbackWarning, stacklevel=3)


def specialize(gm: torch.fx.GraphModule, args, name="fn"):
    """Partition ``gm`` for these concrete arguments and compile each region."""
    stats["specializations"] += 1
    gm = torch.fx.GraphModule(gm, gm.graph.__deepcopy__() if hasattr(gm.graph, "__deepcopy__") else gm.graph)
    gm._af_name = name
    propagate(gm, args)
    split_composites(gm)
    propagate(gm, args)
    exclude: set = set()
    warned: set = set()
    for attempt in range(3):
        compiled, failed_contraction = [], False
        for i, nodes in enumerate(find_regions(gm, frozenset(exclude))):
            outs = region_outputs(gm, nodes)
            while len(outs) > 1:
                # one output per kernel: an intermediate that torch also needs goes to torch,
                # with its in-region ancestors (an ancestor-closed cut keeps the region convex)
                cut, stack = set(), [outs[0]]
                while stack:
                    c = stack.pop()
                    if c not in cut:
                        cut.add(c)
                        stack += [p for p in c.all_input_nodes if p in nodes]
                nodes = [n for n in nodes if n not in cut]
                outs = region_outputs(gm, nodes) if any(kind_of(n) == "reduce" or kind_of(n) == "contraction"
                                                        for n in nodes) else []
            if not outs:
                continue
            rname = f"{name}_{_region_name(nodes)}"
            try:
                imp = import_nodes(nodes, outs, rname)
                bad = _reject_dtype(imp)
                if bad:
                    raise FrontendError(bad)
                k = get_kernel(imp.program)
                dk = None
                if _needs_grad(s.meta.get("af_val") for s in imp.sources):
                    dk = get_grad_kernel(imp.program, k)
            except Exception as e:  # noqa: BLE001 - any failure means: this region runs in torch
                contr = [n for n in nodes if kind_of(n) == "contraction"]
                grad = isinstance(e, GradKernelError)
                if contr and (grad or not isinstance(e, FrontendError)) and attempt < 2:
                    # no kernel (or, in training, no backward kernel) for the contractions:
                    # keep them in torch and fuse what remains around them (softmax between matmuls)
                    exclude |= set(contr)
                    failed_contraction = True
                    if attempt == 0:
                        _warn(contr, (f"no backward kernel for its contractions ({e.why}); in training the "
                                      if grad else f"no kernel family for contractions yet ({e}); ")
                              + "matmuls stay in torch, the reductions around them go to acefuse", warned)
                    continue
                if attempt == 2 or not failed_contraction:
                    _warn(nodes, e, warned)
                continue
            compiled.append((f"af_region{i}", CompiledRegion(imp, k, _torch_region(gm, imp), dk), imp))
        if not failed_contraction:
            break
    new = rebuild(gm, compiled)
    new.af_regions = [m for _, m, _ in compiled]
    return new


def _torch_region(gm, imp) -> torch.fx.GraphModule:
    """The region's nodes as a GraphModule (sources in, outputs out): its torch fallback."""
    g = torch.fx.Graph()
    env = {s: g.placeholder(f"src{i}") for i, s in enumerate(imp.sources)}
    root = {}
    for n in imp.nodes:
        for a in n.all_input_nodes:
            if a not in env and a.op == "get_attr":
                t = gm
                for p in a.target.split("."):
                    t = getattr(t, p)
                root[a.target] = t
                env[a] = g.get_attr(a.target)
        # shape values computed outside the region were read as constants by the import
        env[n] = g.node_copy(n, lambda x: env[x] if x in env else x.meta.get("af_val"))
    g.output(tuple(env[o.node] for o in imp.outputs))
    return torch.fx.GraphModule(root, g, "region_fallback")


def _signature(args):
    sig = [("grad", torch.is_grad_enabled())]
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.dtype, a.device.type, a.requires_grad))
        elif isinstance(a, (int, float, bool, str, type(None))):
            sig.append(("v", a))
        else:
            sig.append(("t", type(a).__name__))
    return tuple(sig)


class CompiledFunction:
    """A torch function whose recognised regions run as acefuse kernels.

    Call it like the original; ``.graphs`` maps each shape signature seen to its
    partitioned GraphModule (``print(f.graph_for(*args).code)`` shows the regions)."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, signature=None):
        self.gm, self.name, self.signature = gm, name, signature
        self.graphs: dict = {}

    def graph_for(self, *args):
        sig = _signature(args)
        g = self.graphs.get(sig)
        if g is None:
            g = specialize(self.gm, args, self.name)
            self.graphs[sig] = g
        return g

    @property
    def regions(self):
        return [r for g in self.graphs.values() for r in g.af_regions]

    def __call__(self, *args, **kwargs):
        if self.signature is not None:
            try:   # too many, missing or unknown arguments: say so in the function's terms
                b = self.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{self.name}{self.signature}: {e}") from None
            if kwargs:
                b.apply_defaults()
                args, kwargs = tuple(b.args), {}
        return self.graph_for(*args)(*args, **kwargs)

    def __repr__(self):
        return f"<acefuse compiled {self.name!r}: {len(self.graphs)} specialization(s)>"


def compile_fn(fn, *example_inputs):
    """``af.compile(fn, *example_inputs)``: a callable with ``fn``'s signature and outputs,
    in which each recognised region runs as an acefuse kernel (specialised and compiled
    now for the example inputs; other shapes are specialised on first use)."""
    gm = trace(fn)
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        sig = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError):
        sig = None
    cf = CompiledFunction(gm, name, sig)
    if example_inputs:
        cf.graph_for(*example_inputs)
    try:
        import functools
        functools.update_wrapper(cf, fn.forward if isinstance(fn, torch.nn.Module) else fn, updated=())
    except (AttributeError, TypeError):
        pass
    return cf


def backend(gm: torch.fx.GraphModule, example_inputs):
    """A ``torch.compile`` backend: ``torch.compile(model, backend=af.backend)``.

    acefuse takes the FX subgraphs it recognises (softmax, log_softmax, logsumexp,
    layer_norm, rms_norm, cross_entropy and the elementwise code around them); the
    rest of the graph runs as eager torch ops. Specialised per shape signature."""
    return CompiledFunction(gm, "dynamo")
