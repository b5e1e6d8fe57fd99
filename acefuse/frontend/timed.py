"""Timed regions: acefuse keeps a region that replaces one torch library kernel only where its
own kernel is faster, measured on the GPU.

A region whose torch code is one call of a fused library op (``LIBRARY_OPS``: torch's
``scaled_dot_product_attention``, which runs flash or cuDNN attention; the region may hold views
and casts of its operands besides) replaces a kernel that may be faster than acefuse's on this
GPU. On a CUDA device, ``runtime.specialize`` times the region on first use per shape class
(``decide``): acefuse's kernel (``CompiledRegion.forward``) against the region's torch code, on
random inputs of the region's shapes, dtypes and strides; forward only, or forward and backward
(each side running its own backward, ``torch.autograd.grad``) when an input requires grad. Each
side is called untimed first (compilation, the launcher's own tile tuning), then timed in a few
interleaved rounds keeping each side's best (``codegen.contraction_launch.TIMING_SRC``'s
``_time_calls``: the GPU's time or the host's, whichever is longer). The faster side is kept:
when torch wins the region stays a torch op (Inductor compiles it as usual) and the report lists
it as left, with both times.

The choice is kept per (program and kernel source, shapes rounded up to powers of two, strides'
order, dtypes, which inputs require grad, device) in this process and on disk through
``acefuse.codegen.tuning`` (``ACEFUSE_CACHE_DIR/tuning``; ``ACEFUSE_TUNING_CACHE=0``: not on disk),
so a later process does not time again. ``af.Backend(timed=False)`` or ``ACEFUSE_TIMED_REGIONS=0``
keeps acefuse's kernel without timing; on the CPU (Triton's interpreter) nothing is timed.
"""
from __future__ import annotations

import hashlib
import os

import torch

from acefuse.frontend.lower import kind_of, name_of

# ops torch runs as one fused library kernel: a region that is one call of such an op is timed
LIBRARY_OPS = {"scaled_dot_product_attention": "torch's scaled_dot_product_attention"}

_CHOICES: dict = {}          # (source, shape key, device name) -> choice (this process)
stats = {"timed": 0, "remembered": 0}


def enabled(timed) -> bool:
    """Regions are timed unless ``timed`` is False or ACEFUSE_TIMED_REGIONS=0."""
    return timed is not False and os.environ.get("ACEFUSE_TIMED_REGIONS", "1") != "0"


def library_call(nodes):
    """The one call of a ``LIBRARY_OPS`` op that is the region's whole torch code (its other nodes
    views, casts or shape values), or None."""
    calls = [n for n in nodes if kind_of(n) not in ("layout", "cast", "static")]
    if len(calls) == 1 and name_of(calls[0]) in LIBRARY_OPS:
        return calls[0]
    return None


def timing_device(values):
    """The CUDA device the region's values live on, or None (nothing is timed elsewhere: on the
    CPU acefuse's kernels run in Triton's interpreter)."""
    for v in values:
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            return v.device
    return None


def _np2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def shape_class(values) -> tuple:
    """What a timing holds for: each input's shape rounded up to powers of two, the order of its
    strides (which dim is innermost, broadcast dims), dtype and whether it requires grad."""
    out = []
    for v in values:
        if not isinstance(v, torch.Tensor):
            out.append(("v", repr(v)))
            continue
        order = tuple(sorted(range(v.dim()), key=lambda d: (-v.stride(d), d)))
        zero = tuple(d for d in range(v.dim()) if v.stride(d) == 0 and v.shape[d] > 1)
        out.append((tuple(_np2(s) for s in v.shape), order, zero, str(v.dtype).removeprefix("torch."),
                    bool(v.requires_grad)))
    return tuple(out)


def random_like(v, gen):
    """A real tensor with ``v``'s shape, strides, dtype, device and requires_grad (``v`` may be a
    fake tensor): floats standard normal, booleans True, integers 0. A broadcast operand (stride 0)
    stays one."""
    if not isinstance(v, torch.Tensor):
        return v
    size = 1 + sum((s - 1) * st for s, st in zip(v.shape, v.stride()) if s > 0) if v.numel() else 0
    if v.dtype.is_floating_point:
        base = torch.randn(size, generator=gen, device=v.device, dtype=torch.float32).to(v.dtype)
    elif v.dtype == torch.bool:
        base = torch.ones(size, dtype=torch.bool, device=v.device)
    else:
        base = torch.zeros(size, dtype=v.dtype, device=v.device)
    t = base.as_strided(tuple(v.shape), tuple(v.stride()))
    return t.requires_grad_() if v.requires_grad and v.dtype.is_floating_point else t


def _time_calls():
    from acefuse.codegen.contraction_launch import TIMING_SRC
    ns = {"torch": torch}
    exec(compile("\n".join(TIMING_SRC), "<acefuse TIMING_SRC>", "exec"), ns)   # noqa: S102 - our own source
    return ns["_time_calls"]


def time_pair(run_acefuse, run_torch, rounds=3, reps=2) -> tuple:
    """Milliseconds per call of ``run_acefuse`` and ``run_torch``: each called twice untimed, then
    ``rounds`` interleaved rounds of ``reps`` calls each, keeping each side's best."""
    tc = _time_calls()
    for f in (run_acefuse, run_torch, run_acefuse, run_torch):
        f()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, f in enumerate((run_acefuse, run_torch)):
            best[i] = min(best[i], tc(f, reps) / reps)
    return best[0], best[1]


def _source(region) -> str:
    """What the acefuse side of a timing is: its program, and its kernel's generated source."""
    from acefuse.codegen import tuning
    mod = getattr(region.kernel, "module", None)
    text = repr((region.program.key(), tuning.source_hash(getattr(mod, "__file__", None)),
                 tuning.source_hash(__file__)))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _runs(region, srcs, grad: bool):
    """The two sides' calls: acefuse's kernel (the region as it will run) and the region's torch
    code, forward and, with ``grad``, their own backward on fixed random cotangents."""
    def fwd(f):
        def call():
            with torch.no_grad():
                f(*srcs)
        return call
    if not grad:
        return fwd(region.forward), fwd(region.fallback)
    wrt = [t for t in srcs if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.enable_grad():
        outs = [o for o in region.fallback(*srcs) if isinstance(o, torch.Tensor) and o.requires_grad]
    gen = torch.Generator(device=outs[0].device).manual_seed(1) if outs else None
    cots = [random_like(o.detach(), gen) for o in outs]

    def fb(f):
        def call():
            with torch.enable_grad():
                ys = [o for o in f(*srcs) if isinstance(o, torch.Tensor) and o.requires_grad]
                torch.autograd.grad(ys, wrt, cots[:len(ys)], allow_unused=True)
        return call
    return fb(region.forward), fb(region.fallback)


def decide(region, nodes, values: dict, grad: bool):
    """The timed choice for ``region`` (a runtime.CompiledRegion) or None when it is not timed
    (not one library call, not on a CUDA device). ``values``: source node -> its (fake) value;
    ``grad``: the region runs in training (forward+backward timed). A choice is a dict:
    ``winner`` ("acefuse" or "torch"), ``acefuse_ms``, ``torch_ms``, ``mode``, ``op``."""
    node = library_call(nodes)
    if node is None:
        return None
    vals = [values.get(s) for s in region._sources]
    dev = timing_device(vals)
    if dev is None:
        return None
    from acefuse.codegen import tuning
    source, mode = _source(region), "forward+backward" if grad else "forward"
    skey = (shape_class(vals), mode)
    mkey = (source, skey, tuning.device_name(dev))
    got = _CHOICES.get(mkey)
    if got is None:
        got = tuning.lookup(source, "timed-region", skey, dev)
        if not _valid(got):
            got = _measure(region, vals, grad, dev, mode)
            if got is None:
                return None
            got["op"] = name_of(node)
            tuning.record(source, "timed-region", skey, dev, got)
        else:
            stats["remembered"] += 1
        _CHOICES[mkey] = got
    return got


def _valid(v) -> bool:
    return (isinstance(v, dict) and v.get("winner") in ("acefuse", "torch")
            and all(isinstance(v.get(k), (int, float)) for k in ("acefuse_ms", "torch_ms")))


def _measure(region, vals, grad, dev, mode):
    from acefuse.frontend.runtime import CompiledRegion
    gen = torch.Generator(device=dev).manual_seed(0)
    srcs = [random_like(v, gen) for v in vals]
    probe = CompiledRegion(region.imp, region.kernel, region.fallback, region.grad)
    run_a, run_t = _runs(probe, srcs, grad)
    try:
        a, t = time_pair(run_a, run_t)
    except Exception:  # noqa: BLE001 - a side that fails is not chosen by timing; the run reports it
        return None
    if probe.calls["torch"]:      # acefuse's side fell back to torch: nothing was compared
        return None
    stats["timed"] += 1
    return {"winner": "torch" if t < a else "acefuse", "acefuse_ms": float(a), "torch_ms": float(t), "mode": mode}


def reason(choice) -> str:
    """The report's reason for a region left to torch by timing."""
    what = LIBRARY_OPS.get(choice.get("op"), f"torch's {choice.get('op')}")
    return (f"{what} measured faster on this GPU ({choice['torch_ms']:.3g} ms vs acefuse's "
            f"{choice['acefuse_ms']:.3g} ms, {choice['mode']}); af.Backend(timed=False) keeps acefuse's kernel")


def forget() -> None:
    """Forget this process's choices (the disk store stays: acefuse.codegen.tuning.clear)."""
    _CHOICES.clear()
