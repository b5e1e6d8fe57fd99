"""The kernels of region programs: looked up in memory, then in the on-disk index
(``$ACEFUSE_CACHE_DIR/frontend/*.json`` pointing at a generated module and recording its
SHA-256), then compiled; and the differentiable kernels (forward plus the kernels of
``af.backward``) of regions whose inputs require grad, whose rider modules (a norm's weight
gradient computed in the pass of the stage over the features) are indexed as well
(``*_riders.json``), so a process that loads the stages from disk runs the same passes."""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from acefuse.frontend.errors import FrontendError


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
        for p in d.glob("*.json"):      # (the kernel and rider indexes)
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


def _drop_index(idx: Path, msg):
    """Remove an unusable index entry, with a warning saying why (``msg``)."""
    _cache_warn(msg)
    try:
        idx.unlink()
    except OSError:
        pass


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
        _drop_index(idx, f"kernel cache index {idx.name} is unusable ({type(e).__name__}: {e}); "
                    "removed, the kernel is regenerated")
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


def get_grad_kernel(prog, kernel, wrt=None):
    """The differentiable kernel of a region's program (acefuse.autograd), its augmented
    forward and backward kernels compiled; GradKernelError (naming the program and why)
    when ``af.backward`` or a backward kernel fails. ``wrt``: the program inputs that require
    grad (None: every float input); only their gradients are derived and compiled (a mask or
    a constant built in the graph gets none). Cached in memory by program and ``wrt``."""
    wrt = None if wrt is None else frozenset(wrt)
    key = f"{prog.name}_{prog.key()}_{_code_version()}" + ("" if wrt is None else "_" + ",".join(sorted(wrt)))
    hit = _GRAD.get(key)
    if isinstance(hit, Exception):
        raise hit
    if hit is not None and hit.kernel is kernel:
        return hit
    from acefuse.autograd import DifferentiableKernel, BackwardKernel, compile_stage
    from acefuse.backward import backward
    # each stage through get_kernel: cached in memory and on disk like forward kernels
    dk = DifferentiableKernel(prog, kernel, {}, wrt=wrt, compile_one=_compile_one)
    if hit is not None:            # same program, kernel reloaded: reuse the compiled backward
        dk._aug = kernel if hit._aug is hit.kernel else hit._aug
        dk._bwd, dk._bwd_kernel = hit._bwd, hit._bwd_kernel
    else:
        try:
            bwd = backward(prog, wrt=None if wrt is None else sorted(wrt))
            kernels = [compile_stage(s, get_kernel) for s in bwd.stages]
            # a stage of sums over rows (a norm's weight gradient) rides the pass of the stage
            # fused over the feature axis (codegen/riders.py); the hosts' rider modules are indexed
            # on disk too, so a process that loads the stages from disk runs the same passes
            bk = BackwardKernel(bwd, kernels, _riders(bwd, kernels, key))
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


def _compile_one(prog, axis=None, **kw):
    """get_kernel with compile_program's signature (launch options are not compile options)."""
    return get_kernel(prog, axis=axis)


def _riders(bwd, kernels, key) -> dict:
    """``codegen.riders.attach`` for the stage kernels of ``bwd`` ({rider stage: host stage};
    ``kernels[host]`` replaced by its module with the rider kernel). attach needs the hosts'
    fusions, which kernels loaded from the disk index lack, so what it made when every stage
    was compiled here is indexed (``<key>_riders.json``: the mapping and each host module's
    path and SHA-256) and, when a stage came from disk, loaded instead."""
    from acefuse.codegen.riders import attach
    idx = _index_dir() / f"{key}_riders.json"
    if any(isinstance(k, _Loaded) for k in kernels):
        got = _load_riders(idx, bwd, kernels)
        if got is not None:
            stats["rider_disk_hits"] = stats.get("rider_disk_hits", 0) + 1
            return got
        return attach(bwd.stages, kernels)
    riders = attach(bwd.stages, kernels)
    hosts = {}
    for a in sorted(set(riders.values())):
        path = getattr(kernels[a], "path", None)
        mod = getattr(getattr(kernels[a], "module", None), "__name__", None)
        if path is None or mod is None:
            return riders            # (a host that is not one module file: not indexed)
        hosts[str(a)] = {"path": str(path), "module": mod,
                         "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
    from acefuse.codegen.compile import write_atomic
    write_atomic(idx, json.dumps({"riders": {str(b): a for b, a in riders.items()}, "hosts": hosts,
                                  "stages": [st.name for st in bwd.stages]}).encode())
    return riders


def _load_riders(idx: Path, bwd, kernels):
    """The rider mapping and host modules indexed by ``_riders`` (``kernels`` updated), or None
    (absent; a corrupt entry or a changed module file is removed with a warning)."""
    if not idx.exists():
        return None
    try:
        meta = json.loads(idx.read_bytes())
        if meta["stages"] != [st.name for st in bwd.stages]:
            raise ValueError("its stages are not this backward's")
        from acefuse.codegen.compile import load_module
        loaded = {}
        for a, h in meta["hosts"].items():
            path = Path(h["path"])
            if hashlib.sha256(path.read_bytes()).hexdigest() != h["sha256"]:
                raise ValueError(f"kernel file {path} does not match its recorded hash")
            loaded[int(a)] = _Loaded(load_module(path, h["module"]), path, bwd.stages[int(a)])
    except Exception as e:  # noqa: BLE001 - any bad entry is regenerated, never fatal
        _drop_index(idx, f"rider index {idx.name} is unusable ({type(e).__name__}: {e}); removed, the stages "
                    "run apart in this process")
        return None
    for a, k in loaded.items():
        kernels[a] = k
    return {int(b): a for b, a in meta["riders"].items()}
