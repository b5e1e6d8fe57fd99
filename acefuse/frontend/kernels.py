"""The kernels of region programs: looked up in memory, then in the on-disk index
(``$ACEFUSE_CACHE_DIR/frontend/*.json`` describing the compiled kernel: one generated module, or
a staged kernel's two, each with its SHA-256), then compiled; and the differentiable kernels
(forward plus the kernels of ``af.backward``) of regions whose inputs require grad. A process
that finds a region in the index derives and generates nothing: the index also holds the
backward program (``*_backward.json``: pickled, keyed by the code that derives it), the axis
each backward stage compiled over (``*_stage.json``), the rider modules (``*_riders.json``: a
norm's weight gradient computed in the pass of the stage over the features), and the programs
that have no kernel of a form (``*_failed.json``: the error, raised again)."""
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
         "fallbacks": 0, "grad_kernel_compiles": 0, "backward_derivations": 0, "backward_disk_hits": 0,
         "stage_disk_hits": 0, "failure_disk_hits": 0}
_KERNELS: dict = {}
_FAILED: dict = {}
_GRAD: dict = {}
_BWD: dict = {}


def clear_cache(memory_only: bool = True):
    """Forget compiled kernels in memory (the on-disk cache stays unless memory_only=False)."""
    _KERNELS.clear()
    _FAILED.clear()
    _GRAD.clear()
    _BWD.clear()
    if not memory_only:
        d = _index_dir()
        for p in d.glob("*.json"):      # (the kernel, stage, rider, backward and failure indexes)
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
    """A generated module loaded from the disk cache (no fusion run). ``fusible``: the compiled
    kernel's, as recorded in the index (None for an entry that did not record it)."""

    from_disk = True

    def __init__(self, module, path, program=None, fusible=None):
        self.module, self.path, self.program, self.fusible = module, path, program, fusible

    @property
    def source(self) -> str:
        return Path(self.path).read_text()

    def __call__(self, **inputs):
        from acefuse.codegen import compile as cc
        names = cc.requires_grad_inputs((), inputs)
        if names:     # like a compiled Kernel: never a result without grad_fn
            return cc.grad_hook(self, names, (), inputs)
        return cc.run_module(self.module, (), inputs)


_STAGED = []


def _staged_class():
    if _STAGED:
        return _STAGED[0]
    from acefuse.codegen.compile import StagedKernel

    class _LoadedStaged(StagedKernel):
        """A staged kernel (codegen.compile.StagedKernel) whose two stages came from the disk
        cache: the stage programs are split off again (``compile.stage``, no fusion run)."""

        from_disk = True

        def __init__(self, stage1, stage2, hidden, outputs):
            self.stage1, self.stage2, self.hidden, self.output_names = stage1, stage2, hidden, outputs
            self.fusion = None
            self.program = stage1.program

        @property
        def source(self) -> str:
            return self.stage1.source + "\n\n# ---- stage 2 ----\n" + self.stage2.source
    _STAGED.append(_LoadedStaged)
    return _LoadedStaged


def _from_disk(k) -> bool:
    """``k`` was loaded from the disk index (a module, or a staged kernel)."""
    return getattr(type(k), "from_disk", False)


def _recipe(k, axis):
    """What the index records of a compiled kernel ``k`` (compiled over ``axis``), JSON-able: one
    module (its path, name, SHA-256), or a staged kernel (both stages' recipes, the names handed
    from stage 1 to stage 2, the outputs); None for a kernel of several files it cannot describe
    (a multi-pass contraction's chain: compiled again in each process)."""
    from acefuse.codegen.compile import StagedKernel
    path, mod = getattr(k, "path", None), getattr(getattr(k, "module", None), "__name__", None)
    if path is not None and mod is not None:
        return {"kind": "module", "path": str(path), "module": mod,
                "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
                "fusible": getattr(k, "fusible", None)}
    if isinstance(k, StagedKernel):
        r1, r2 = _recipe(k.stage1, axis), _recipe(k.stage2, None)
        if r1 is None or r2 is None:
            return None
        return {"kind": "staged", "axis": axis, "stage1": r1, "stage2": r2, "hidden": list(k.hidden),
                "outputs": list(k.output_names)}
    return None


def _load_recipe(meta: dict, prog):
    """The kernel of program ``prog`` that ``_recipe`` described (raises when a file is missing
    or changed, or the recipe is not this program's)."""
    from acefuse.codegen.compile import load_module
    kind = meta.get("kind", "module")
    if kind == "module":
        path = Path(meta["path"])
        if hashlib.sha256(path.read_bytes()).hexdigest() != meta["sha256"]:
            raise ValueError(f"kernel file {path} does not match its recorded hash (truncated or overwritten)")
        return _Loaded(load_module(path, meta["module"]), path, prog, meta.get("fusible"))
    if kind == "staged":
        from acefuse.codegen.compile import stage
        from acefuse.fuse import _pick_axis
        split = stage(prog, _pick_axis(prog, meta["axis"]))
        if split is None or list(split[2]) != meta["hidden"]:
            raise ValueError(f"program {prog.name!r} no longer splits into the recorded stages")
        s1, s2, hidden = split
        return _staged_class()(_load_recipe(meta["stage1"], s1), _load_recipe(meta["stage2"], s2), hidden,
                               meta["outputs"])
    raise ValueError(f"unknown kernel kind {kind!r}")


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
    """The kernel an index entry describes, or None (absent). A corrupt entry, or one whose
    kernel file is missing or changed, is removed with a warning (the caller regenerates)."""
    if not idx.exists():
        return None
    try:
        return _load_recipe(json.loads(idx.read_bytes()), program)
    except Exception as e:  # noqa: BLE001 - any bad entry is regenerated, never fatal
        _drop_index(idx, f"kernel cache index {idx.name} is unusable ({type(e).__name__}: {e}); "
                    "removed, the kernel is regenerated")
        return None


def _failure_types() -> tuple:
    """The errors saying a program has no kernel of a form (the codegen family cannot lower a
    term, the fusion cannot be made as asked): recorded on disk, so another process does not
    derive the program again to learn it (the frontend then splits the region, as here)."""
    from acefuse.codegen.emit import CodegenError
    from acefuse.fuse import FuseError
    return CodegenError, FuseError


def _record_failure(idx: Path, prog, e: Exception) -> None:
    if type(e) in _failure_types():
        from acefuse.codegen.compile import write_atomic
        write_atomic(idx, json.dumps({"error": type(e).__name__, "message": str(e), "program": repr(prog)}).encode())


def _indexed_failure(idx: Path):
    """The error recorded by ``_record_failure`` (to raise), or None (absent; a bad entry is
    removed with a warning)."""
    if not idx.exists():
        return None
    try:
        meta = json.loads(idx.read_bytes())
        cls = {c.__name__: c for c in _failure_types()}[meta["error"]]
        return cls(meta["message"])
    except Exception as e:  # noqa: BLE001 - any bad entry is derived again, never fatal
        _drop_index(idx, f"failure index {idx.name} is unusable ({type(e).__name__}: {e}); removed, the "
                    "program is compiled again")
        return None


def get_kernel(prog, axis=None):
    """The kernel of a program: memory, then the on-disk index, then af.compile. A program with
    no kernel of the form asked (``_failure_types``) raises its error again, from memory or disk."""
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
    failed = _index_dir() / f"{key}_failed.json"
    err = _indexed_failure(failed)
    if err is not None:
        stats["failure_disk_hits"] += 1
        _FAILED[key] = err
        raise err
    from acefuse.codegen.compile import compile_program
    try:
        k = compile_program(prog, axis=axis)
    except Exception as e:
        _FAILED[key] = e
        _record_failure(failed, prog, e)
        raise
    stats["kernel_compiles"] += 1
    from acefuse.codegen.compile import write_atomic
    meta = _recipe(k, axis)
    if meta is not None:
        write_atomic(idx, json.dumps({**meta, "program": repr(prog)}).encode())
    _KERNELS[key] = k
    return k


def get_grad_kernel(prog, kernel, wrt=None, grad_dtypes=None):
    """The differentiable kernel of a region's program (acefuse.autograd), its augmented
    forward and backward kernels compiled; GradKernelError (naming the program and why)
    when ``af.backward`` or a backward kernel fails. ``wrt``: the program inputs that require
    grad (None: every float input); only their gradients are derived and compiled (a mask or
    a constant built in the graph gets none). ``grad_dtypes``: {input: "bfloat16" or "float16"},
    the inputs read in that type, whose gradients the backward writes in it (``narrowed``).
    Cached in memory by program, ``wrt`` and ``grad_dtypes``."""
    wrt = None if wrt is None else frozenset(wrt)
    base = _grad_key(prog, wrt)
    key = base + "".join(f"_{n}-{d}" for n, d in sorted((grad_dtypes or {}).items()))
    hit = _GRAD.get(key)
    if isinstance(hit, Exception):
        raise hit
    if hit is not None and hit.kernel is kernel:
        return hit
    from acefuse.autograd import DifferentiableKernel, BackwardKernel
    # each stage through get_kernel: cached in memory and on disk like forward kernels
    dk = DifferentiableKernel(prog, kernel, {}, wrt=wrt, compile_one=_compile_one)
    if hit is not None:            # same program, kernel reloaded: reuse the compiled backward
        dk._aug = kernel if hit._aug is hit.kernel else hit._aug
        dk._bwd, dk._bwd_kernel = hit._bwd, hit._bwd_kernel
    else:
        try:
            bwd = narrowed(_backward_program(prog, wrt, base), grad_dtypes or {})
            kernels = [_stage_kernel(s) for s in bwd.stages]
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


def _grad_key(prog, wrt) -> str:
    return f"{prog.name}_{prog.key()}_{_code_version()}" + ("" if wrt is None else "_" + ",".join(sorted(wrt)))


def grad_parts(prog, kernel, wrt=None):
    """``(augmented forward kernel, backward program)`` of ``get_grad_kernel(prog, kernel, wrt)``,
    without compiling the backward's stages (what ``runtime.grad_plan`` needs to decide how the
    differentiable kernel is called, before it is built). Raises when there is no backward."""
    wrt = None if wrt is None else frozenset(wrt)
    bwd = _backward_program(prog, wrt, _grad_key(prog, wrt))
    return (kernel if bwd.augmented is prog else get_kernel(bwd.augmented)), bwd


def narrowed(bwd, grad_dtypes: dict):
    """``bwd`` with the gradient of each input in ``grad_dtypes`` ({input: "bfloat16" or
    "float16"}) written in that type by the stage that computes it: the stage's output ends
    with ``af.cast`` (rounded to nearest even inside the kernel, bit-exact with torch's
    ``.to()``; the kernel stores the narrow type), so no float32 gradient as large as the input
    is made and rounded afterwards (a bfloat16 cross-entropy's logit gradient). Only gradients
    a stage computes whole and elementwise over its fused axis (every axis of the input, not
    summed in a second step); a gradient summed over the stage's axis (a norm's weight gradient,
    over rows: as small as the weight, and it rides another stage's pass as a plain sum,
    codegen/riders.py) stays float32. The stages changed are renamed ``<stage>_<dtype>``; ``bwd``
    itself when nothing changes."""
    import copy
    from acefuse.lang import cast
    want = {}
    for name, dt in grad_dtypes.items():
        g = bwd.grads.get(name)
        if g is None or g in getattr(bwd, "finish", {}) or g not in bwd.outputs:
            continue
        if set(bwd.outputs[g].axes) == set(bwd.input_axes[name]):
            want[g] = dt
    if not want:
        return bwd
    stages = []
    for st in bwd.stages:
        # the stage computes the gradient whole: fused over one of its axes, or a stage with no
        # reduction at all (axis None: a loss whose backward reads only saved per-row values)
        hit = {g: dt for g, dt in want.items()
               if g in st.outputs and getattr(st, "axis", None) in (None, *st.outputs[g].axes)}
        if hit:
            st = copy.copy(st)
            st.name = "_".join([st.name, *sorted(set(hit.values()))])
            st.outputs = {k: cast(e, hit[k]) if k in hit else e for k, e in st.outputs.items()}
        stages.append(st)
    new = copy.copy(bwd)
    new.stages = stages
    return new


def _compile_one(prog, axis=None, **kw):
    """get_kernel with compile_program's signature (launch options are not compile options)."""
    return get_kernel(prog, axis=axis)


def _backward_version() -> str:
    """A hash of the code that derives backward programs (acefuse/backward*.py) and of the code
    that compiles programs: the key of a pickled backward program."""
    import acefuse
    h = hashlib.sha256(_code_version().encode())
    for p in sorted(Path(acefuse.__file__).parent.glob("backward*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def _backward_program(prog, wrt, key):
    """``af.backward(prog, wrt)``, derived once and kept on disk (``<key>_backward.json``: the
    pickled program, keyed by ``_backward_version``), so that another process derives nothing;
    a bad entry is removed with a warning and the program derived again. (The cache folder
    already holds the generated modules a process imports: the pickle adds no other trust.)"""
    import base64
    import pickle
    from acefuse.codegen.compile import write_atomic
    if key in _BWD:
        return _BWD[key]
    idx = _index_dir() / f"{key}_backward.json"
    version = _backward_version()
    if idx.exists():
        try:
            meta = json.loads(idx.read_bytes())
            if meta["version"] != version:
                raise ValueError("derived by other code")
            bwd = pickle.loads(base64.b64decode(meta["pickle"]))
            if bwd.forward.name != prog.name or bwd.forward.key() != prog.key():
                raise ValueError(f"it is the backward of {bwd.forward.name!r}, another program")
            if bwd.augmented.name == prog.name and bwd.augmented.key() == prog.key():
                bwd.augmented = prog      # (callers test `bwd.augmented is prog`: no augmented kernel)
            bwd.forward = prog
            stats["backward_disk_hits"] += 1
            _BWD[key] = bwd
            return bwd
        except Exception as e:  # noqa: BLE001 - any bad entry is derived again, never fatal
            _drop_index(idx, f"backward index {idx.name} is unusable ({type(e).__name__}: {e}); removed, the "
                        "backward is derived again")
    from acefuse.backward import backward
    bwd = _BWD[key] = backward(prog, wrt=None if wrt is None else sorted(wrt))
    stats["backward_derivations"] += 1
    try:
        data = base64.b64encode(pickle.dumps(bwd)).decode()
    except Exception:  # noqa: BLE001 - (a program that does not pickle: derived in each process)
        return bwd
    write_atomic(idx, json.dumps({"version": version, "program": prog.name, "pickle": data}).encode())
    return bwd


def _stage_kernel(st):
    """``autograd.compile_stage(st)`` through ``get_kernel``; the axis its kernel was compiled
    over is indexed (``<stage key>_stage.json``), so another process loads that kernel and
    neither tries the others (two loops first, then ``stage_axes``) nor derives a failing one."""
    from acefuse.autograd import compile_stage
    from acefuse.codegen.compile import write_atomic
    idx = _index_dir() / f"{st.name}_{st.key()}_{_code_version()}_stage.json"
    if idx.exists():
        try:
            axis = json.loads(idx.read_bytes())["axis"]
            if axis is not None and axis not in st.axes:
                raise ValueError(f"axis {axis!r} is not an axis of the stage")
        except Exception as e:  # noqa: BLE001 - any bad entry is compiled again, never fatal
            _drop_index(idx, f"stage index {idx.name} is unusable ({type(e).__name__}: {e}); removed, the "
                        "stage is compiled again")
        else:
            stats["stage_disk_hits"] += 1
            return get_kernel(st, axis=axis)
    made = {}

    def one(p, axis=None, **kw):
        k = get_kernel(p, axis=axis)
        made[id(k)] = axis
        return k
    k = compile_stage(st, one)
    if id(k) in made:
        write_atomic(idx, json.dumps({"axis": made[id(k)], "stage": st.name}).encode())
    return k


def _riders(bwd, kernels, key) -> dict:
    """``codegen.riders.attach`` for the stage kernels of ``bwd`` ({rider stage: host stage};
    ``kernels[host]`` replaced by its module with the rider kernel). attach needs the hosts'
    fusions, which kernels loaded from the disk index lack, so what it made when every stage
    was compiled here is indexed (``<key>_riders.json``: the mapping and each host module's
    path and SHA-256) and, when a stage came from disk, loaded instead."""
    from acefuse.codegen.riders import attach
    idx = _index_dir() / f"{key}_riders.json"
    if any(_from_disk(k) for k in kernels):
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
