"""A direct launch of a generated kernel that Triton has compiled already.

Triton's ``kernel[grid](*args, **kw)`` binds every argument, specialises each one (a
tensor by its dtype and 16-byte alignment, an integer by being 1, being divisible by 16
and its int32/int64 range), looks the compiled kernel up by that key and the launch
options, checks the global values the kernel read, then calls the compiled kernel's
launcher. For a 37-argument decode kernel on an H200 host that Python path took about as
long as the rest of acefuse's launcher (benchmarks/results/session15/
h200_25f6e46_triton_launch.txt: 15.6 us per launch of a 12-argument kernel, 8.8 us calling
the ``CompiledKernel`` directly).

A ``Site`` is one kernel launched by one launch plan of a generated launcher (the plan
fixes the shapes, strides, dtypes, alignment of the inputs and the launch options). It is
made from the plan's argument *template*: the kernel's positional arguments with ``None``
in each slot the launcher fills per call (tensors, the key length); every other entry is
an integer fixed for the plan, and arguments past the template are per call too. The
first launch of each *specialisation key* (what Triton specialises on, computed over the
per-call slots only) goes through Triton's JIT, and the ``CompiledKernel`` it returns is
kept; a later launch with the same key, the same constexprs and options (the same ``kw``
object: a retry with safer options makes a new one) is made by calling that kernel's
launcher directly. The JIT path is taken instead whenever:

- the Triton version is not one this was checked against (3.6.x: ``jit.py``'s ``run``), or
  Triton's interpreter runs the kernel, or ``ACEFUSE_FAST_LAUNCH=0`` (read at import;
  ``set_enabled`` switches it at run time);
- a per-call argument is of a type not handled here (the key is None);
- a launch hook is set (``knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``: the
  JIT path calls them), the kernel has pre-run hooks, ``knobs.runtime.debug`` or the
  instrumentation mode differ from the kept kernel's, a global value the kernel read is
  no longer the same object, or the current device is not the kept kernel's.

A ``Site`` whose fast path is off costs one attribute test per launch.
"""
from __future__ import annotations

import os

import torch

# (no module-level ``import triton``: acefuse imports this module, and Triton must not be imported
# before codegen/compile.py's _ensure_backend has chosen its interpreter on a machine without a
# GPU: kernels and Triton's own library functions are made interpreted or compiled at import)
VERSIONS = ("3.6.",)   # Triton versions whose JITFunction.run this mirrors (checked against 3.6.0's source)
ENABLED = os.environ.get("ACEFUSE_FAST_LAUNCH", "1") != "0"


def set_enabled(on: bool) -> None:
    """Switch the direct launch on or off for every launch from now on (a benchmark's
    comparison; the environment's ACEFUSE_FAST_LAUNCH=0 sets the default)."""
    global ENABLED
    ENABLED = bool(on)


def _version_ok() -> bool:
    import triton
    return triton.__version__.startswith(VERSIONS)


def _interpreted() -> bool:
    import triton
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET") == "1"


def fast_ok(fn) -> bool:
    """Whether kernel ``fn`` may be launched directly: a compiled (not interpreted)
    JITFunction of a checked Triton version."""
    if not _version_ok() or _interpreted():
        return False
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        return False
    return _device is not None and isinstance(fn, JITFunction) and all(hasattr(fn, a) for a in ("params", "used_global_vals", "pre_run_hooks"))


_Tensor = torch.Tensor
# the current CUDA device and a device's current stream, as Triton 3.6's driver reads them (C calls)
_device = getattr(torch._C, "_cuda_getDevice", None)
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def spec_key(args, watch):
    """What Triton 3.6 specialises on, for the arguments at positions ``watch`` of ``args``
    (a conservative superset: an equal key means an equal specialisation): a tensor by its
    dtype and whether its data pointer is 16-byte aligned; an integer by being 1, being
    divisible by 16 and its range (int32, uint64, int64); bool, float and None by their
    type; a host-side tensor descriptor by everything but its base's address (_desc_key). None
    where some argument is of another type (then the JIT path decides)."""
    key = []
    for i in watch:
        a = args[i]
        t = type(a)
        if t is int:
            if -2147483648 <= a <= 2147483647:
                key.append(1 if a == 1 else 2 if a % 16 == 0 else 3)
            elif 2 ** 63 <= a <= 2 ** 64 - 1:
                key.append(4 if a % 16 == 0 else 5)
            elif -2 ** 63 <= a < 2 ** 63:
                key.append(6 if a % 16 == 0 else 7)
            else:
                return None   # (no 64-bit type holds it: Triton refuses it)
        elif t is _Tensor or isinstance(a, _Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif a is None:
            key.append(0)
        elif t is bool:
            key.append(8)
        elif t is float:
            key.append(9)
        elif t.__name__ == "TensorDescriptor":
            d = _desc_key(a)
            if d is None:
                return None
            key.append(d)
        else:
            return None
    return tuple(key)


def _desc_key(d):
    """A host-side tensor descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``: Triton
    3.6 specialises on its base's dtype and its block shape) by everything but its base's
    address: the base's dtype and 16-byte alignment, then every other field (shape, strides,
    block shape, padding, ...) as it is, so that an equal key is an equal specialisation
    whatever Triton reads of it. None where the base is not a tensor or a field is of a type
    not handled (a Gluon layout object: then the JIT path decides)."""
    import dataclasses
    base = getattr(d, "base", None)
    if not dataclasses.is_dataclass(d) or not isinstance(base, _Tensor):
        return None
    key = ["desc", base.dtype, base.data_ptr() % 16 == 0]
    for f in dataclasses.fields(d):
        if f.name == "base":
            continue
        v = getattr(d, f.name)
        if type(v) in (list, tuple):
            if not all(type(x) is int for x in v):
                return None
            v = tuple(v)
        elif type(v) not in (int, str, bool, type(None)):
            return None
        key.append((f.name, v))
    return tuple(key)


_KNOBS = []


def _knobs():
    """(triton.knobs.runtime, triton.knobs.compilation), looked up once."""
    if not _KNOBS:
        import triton
        _KNOBS.append((triton.knobs.runtime, triton.knobs.compilation))
    return _KNOBS[0]


def _hooks_set(runtime) -> bool:
    """A launch hook is set (Triton 3.6: a HookChain with calls; a plain callable)."""
    for h in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


_WARNED = set()


def _warn_once(msg):
    if msg not in _WARNED:
        _WARNED.add(msg)
        import warnings
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


class _Kept:
    """A compiled kernel kept for one specialisation key."""
    __slots__ = ("kw", "launcher", "raw", "function", "packed", "tail", "dev", "globs", "debug", "instr")


class Site:
    """One kernel of one launch plan: ``site(grid, args, kw)`` launches ``fn[grid](*args, **kw)``,
    directly where a kernel compiled for the same specialisation is kept (see the module's
    docstring). ``template``: the plan's fixed positional arguments, None in each per-call slot;
    ``keyed``: per-call slots whose specialisation the caller's own plan key holds already (the
    contraction launcher's inputs: their dtype and alignment), not looked at again."""
    __slots__ = ("fn", "fast", "watch", "n_fixed", "template", "kept", "direct", "_n", "_w")

    def __init__(self, fn, template, keyed=()):
        self.fn = fn
        self.template = list(template)
        self.n_fixed = len(self.template)
        self.watch = tuple(i for i, v in enumerate(self.template) if v is None and i not in keyed)
        self.kept = {}
        self.direct = 0   # launches made directly (tests, benchmarks)
        self._n, self._w = self.n_fixed, self.watch   # (the watched positions for calls of _n arguments)
        self.fast = fast_ok(fn)   # (ENABLED is read per launch: a Site made while it is off launches directly later)

    def __call__(self, grid, args, kw):
        if not (self.fast and ENABLED) or len(args) < self.n_fixed:
            return self.fn[grid](*args, **kw)
        if len(args) != self._n:
            self._n, self._w = len(args), self.watch + tuple(range(self.n_fixed, len(args)))
        key = spec_key(args, self._w)
        k = self.kept.get(key) if key is not None else None
        if k is not None and k.kw is kw and self._same_state(k):
            n = len(grid)
            g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
            try:
                if k.raw is not None:   # CudaLauncher.__call__ without scratch buffers: its C launch
                    launch, coop, pdl = k.raw
                    launch(g0, g1, g2, _stream(k.dev), k.function, coop, pdl, None, None, k.packed, None, None, None,
                           *args, *k.tail)
                else:
                    k.launcher(g0, g1, g2, _stream(k.dev), k.function, k.packed, None, None, None, *args, *k.tail)
            except TypeError as exc:
                # the launcher refused the arguments while parsing them (nothing was launched): this
                # Triton's launcher is not the one this mirrors; the JIT path from now on, said once
                self.fast = False
                _warn_once(f"acefuse: the direct launch of {getattr(self.fn, '__name__', self.fn)} failed ({exc}); "
                           "launching through Triton's JIT from now on (ACEFUSE_FAST_LAUNCH=0 silences this)")
                return self.fn[grid](*args, **kw)
            self.direct += 1
            return None
        ck = self.fn[grid](*args, **kw)
        if key is not None:
            self._keep(key, ck, args, kw)
        return ck

    def _same_state(self, k) -> bool:
        """Nothing outside the arguments that the JIT path would look at has changed."""
        runtime, compilation = _knobs()
        if _hooks_set(runtime) or self.fn.pre_run_hooks:
            return False
        if runtime.debug != k.debug or compilation.instrumentation_mode != k.instr:
            return False
        if _device() != k.dev:
            return False
        for d, name, val in k.globs:
            if d.get(name) is not val:
                return False
        return True

    def _keep(self, key, ck, args, kw) -> None:
        """Keep ``ck``, what the JIT launch just returned, for ``key``: only a CompiledKernel
        with its launcher loaded, and only where every fixed argument is the template's."""
        if hasattr(ck, "result"):   # (an asynchronous compile's future)
            return
        launcher, function, packed = getattr(ck, "_run", None), getattr(ck, "function", None), \
            getattr(ck, "packed_metadata", None)
        if launcher is None or function is None or packed is None:
            return
        for i, v in enumerate(self.template):
            if v is not None and (type(args[i]) is not type(v) or args[i] != v):
                return   # (a caller that filled a fixed slot: not kept, the JIT path stays)
        params = self.fn.params
        if len(args) > len(params):
            return
        tail = []
        for p in params[len(args):]:
            if p.name in kw:
                tail.append(kw[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        k = _Kept()
        k.kw, k.launcher, k.function, k.packed, k.tail = kw, launcher, function, packed, tuple(tail)
        # Triton 3.6's CudaLauncher.__call__ allocates scratch buffers where the kernel has them, then
        # calls its C launch with the cooperative-grid and PDL flags: where it has none, that call
        k.raw = None
        if (type(launcher).__name__ == "CudaLauncher" and callable(getattr(launcher, "launch", None))
                and getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0
                and hasattr(launcher, "launch_cooperative_grid") and hasattr(launcher, "launch_pdl")):
            k.raw = (launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl)
        k.dev = _device()
        k.globs = tuple((d, name, d.get(name)) for (name, _), (_, d) in self.fn.used_global_vals.items())
        runtime, compilation = _knobs()
        k.debug = runtime.debug
        k.instr = compilation.instrumentation_mode
        if len(self.kept) >= 64:
            self.kept.clear()
        self.kept[key] = k


# the generated launchers' import of Site (a module run without acefuse, exported for torch and
# triton only, launches through Triton's JIT) and their _site(plan, kernel, fn, template)
SRC = [
    "try:   # the direct launch of kernels Triton has compiled (acefuse/codegen/fastlaunch.py)",
    "    from acefuse.codegen.fastlaunch import Site as _Site",
    "except ImportError:  # pragma: no cover",
    "    class _Site:",
    "        def __init__(self, fn, template, keyed=()):",
    "            self.fn = fn",
    "",
    "        def __call__(self, grid, args, kw):",
    "            return self.fn[grid](*args, **kw)",
    "",
    "",
    "def _site(p, kernel, fn, template, keyed=()):",
    "    \"\"\"The launch site of kernel ``fn`` in plan ``p`` (acefuse/codegen/fastlaunch.py: after the",
    "    first launch through Triton's JIT, the compiled kernel is launched directly while nothing",
    "    Triton specialises on changes), made on the plan's first launch of it. Its template is",
    "    ``template`` with each tensor (or None) a per-call slot; every other entry, a stride or a",
    "    size, is fixed by the plan. ``keyed``: (position, name) of the per-call slots whose dtype",
    "    and alignment the plan's own key holds already.\"\"\"",
    "    s = p.sites.get(kernel)",
    "    if s is None:",
    "        s = p.sites[kernel] = _Site(fn, [None if isinstance(a, torch.Tensor) else a for a in template],",
    "                                    keyed=[n for n, _ in keyed])",
    "    return s",
]
