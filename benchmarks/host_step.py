"""Host (Python + launch) time of one training step through ``af.compile``, by phase (issue 11:
the host took longer than the GPU per forward+backward step of softmax, layernorm, RMSNorm).

    TRITON_INTERPRET=1 python benchmarks/host_step.py            # CPU: Triton launches stubbed
    python benchmarks/host_step.py --device cuda                 # GPU: the host's issue time
    ... --only softmax,layernorm --rows 64 --cols 1000 --steps 200 --profile 25

The step is ``y = k(x=..., w=..., b=...); torch.autograd.grad(y, [x, w, b], g)`` (cross-entropy:
the mean loss, ``g`` a 0-d tensor of 1). Phases, microseconds per step, median of 15 repetitions
of ``--steps`` steps (min in brackets):

- ``forward``: the call ``k(...)`` (argument binding, the augmented forward's launcher);
- ``backward``: ``torch.autograd.grad``; of it, ``bwd fn`` is the time inside the autograd
  Function's backward (the backward kernel's launchers, gradient shaping) and ``engine`` the rest
  (torch's autograd engine);
- ``step``: the two together;
- ``per step``: what one step issues: Triton launches (by kernel) and the ATen ops besides
  (allocations, conversions, small reductions; views not counted), each a launch on a GPU.

On the CPU every Triton launch is replaced by a no-op (the interpreter would otherwise dominate),
so what is timed is acefuse's Python path and torch's (tensor allocations included); the kernels
are run for real once first and the results checked against float64 torch. On a GPU nothing is
stubbed and the loop does not synchronise, so the time is the host's as long as it exceeds the
kernels' (the GPU's kernel times are in BENCHMARKS.md): keep the shapes small there (the default
64x1000) to time the host alone; at 16384x8192 the queue fills and the time is the GPU's. ``--cpu-time`` times this thread's CPU
time instead of wall time (steadier on a shared host).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

_clock = time.perf_counter


def workloads(N, S):
    import torch.nn.functional as F
    return {
        "softmax": (S.softmax, lambda a: torch.softmax(a["x"], -1)),
        "layernorm": (N.layernorm, lambda a: F.layer_norm(a["x"], (a["x"].shape[-1],), a["w"], a["b"], eps=N.EPS)),
        "rmsnorm": (N.rmsnorm, lambda a: a["x"] * torch.rsqrt((a["x"] * a["x"]).mean(-1, keepdim=True) + 1e-6)
                    * a["w"]),
        "cross_entropy": (N.cross_entropy_mean, lambda a: F.cross_entropy(a["x"], a["t"])),
    }


def inputs(prog, rows, cols, dev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    args = {}
    for n in prog.tensors:
        if n == "x":
            args[n] = (torch.randn(rows, cols, generator=g) * 2).to(dev, dtype)
        elif n == "w":
            args[n] = (torch.rand(cols, generator=g) + 0.5).to(dev, dtype)
        elif n == "b":
            args[n] = torch.randn(cols, generator=g).to(dev, dtype)
        elif n == "t":
            args[n] = torch.randint(0, cols, (rows,), generator=g).to(dev)
    return args


def _stub_launches(on=True):
    """Triton's interpreted launches as no-ops (``on``), or real again."""
    from triton.runtime import interpreter
    cls = interpreter.InterpretedFunction
    if not hasattr(cls, "_real_getitem"):
        cls._real_getitem = cls.__getitem__
    cls.__getitem__ = (lambda self, grid: (lambda *args, **kw: None)) if on else cls._real_getitem


def _inventory(step, stub):
    """(Triton launches by kernel name, ATen ops by name) of one call of ``step``."""
    from collections import Counter
    from torch.utils._python_dispatch import TorchDispatchMode
    if stub:
        from triton.runtime.interpreter import InterpretedFunction as cls
    else:
        from triton.runtime.jit import JITFunction as cls
    launches, ops = Counter(), Counter()
    real = cls.__getitem__

    def counted(self, grid):
        launches[getattr(getattr(self, "fn", None), "__name__", repr(self))] += 1
        return real(self, grid)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))
    cls.__getitem__ = counted
    try:
        with Ops():
            step()
    finally:
        cls.__getitem__ = real
    return launches, ops


def _per_step(fn, steps, reps=15):
    """Sorted seconds per call of ``fn`` over ``reps`` repetitions of ``steps`` calls."""
    out = []
    for _ in range(reps):
        t0 = _clock()
        for _ in range(steps):
            fn()
        out.append((_clock() - t0) / steps)
    return sorted(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--only", default="softmax,layernorm,rmsnorm,cross_entropy")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=1000)
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="cProfile of the step, top N by own time")
    a = ap.parse_args()
    global _clock
    if a.cpu_time and a.device == "cuda":
        # (the autograd engine runs a CUDA backward on its own thread: this thread's CPU time misses it)
        ap.error("--cpu-time is for the CPU (stubbed launches); on a GPU the wall time is the host's")
    if a.cpu_time:
        _clock = time.thread_time
    stub = a.device == "cpu"
    if stub:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import acefuse as af
    import acefuse.autograd as aga
    import norms as N
    import softmax as S
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.float32 if stub else torch.bfloat16)
    dev = a.device
    # time spent inside the autograd Function's backward (acefuse's side of the backward)
    inside = [0.0]
    real_bwd = aga._Function.backward
    # on a GPU the autograd engine runs the backward on its own thread, which a profiler started
    # on this one does not see: --profile there profiles the backward apart, from inside it
    bwd_prof = []

    def timed_bwd(ctx, *cots):
        if bwd_prof:
            bwd_prof[0].enable()
        t0 = _clock()
        try:
            return real_bwd(ctx, *cots)
        finally:
            inside[0] += _clock() - t0
            if bwd_prof:
                bwd_prof[0].disable()
    aga._Function.backward = staticmethod(timed_bwd)
    for name in a.only.split(","):
        if stub:
            _stub_launches(False)
        prog, ref_fn = workloads(N, S)[name]
        k = af.compile(prog)
        args = inputs(prog, a.rows, a.cols, dev, dtype)
        wrt = [n for n in prog.tensors if n != "t"]
        for n in wrt:
            args[n].requires_grad_(True)
        y = k(**args)
        gen = torch.Generator().manual_seed(1)
        g = (torch.ones((), dtype=dtype) if y.dim() == 0 else torch.randn(y.shape, generator=gen)).to(dev, dtype)
        got = torch.autograd.grad(y, [args[n] for n in wrt], g)
        # checked once, for real, against float64 torch (a stubbed timing of a wrong path is worthless)
        a64 = {n: (t.detach().double().requires_grad_(n in wrt) if t.dtype.is_floating_point else t)
               for n, t in args.items()}
        y64 = ref_fn(a64)
        want = torch.autograd.grad(y64, [a64[n] for n in wrt], g.double())
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        rel = lambda x, w: float((x.double() - w).abs().max() / w.abs().max().clamp_min(1e-30))  # noqa: E731
        err = max(rel(y.detach(), y64.detach()), *(rel(x, w) for x, w in zip(got, want)))
        assert err < tol, f"{name}: off by {err} against float64 torch"
        if stub:
            _stub_launches()
        leaves = [args[n] for n in wrt]
        state = {}

        def fwd():
            state["y"] = k(**args)

        def bwd():
            torch.autograd.grad(state["y"], leaves, g)

        def step():
            torch.autograd.grad(k(**args), leaves, g)

        for _ in range(20):
            step()
        launches, ops = _inventory(step, stub)
        if dev == "cuda":
            torch.cuda.synchronize()
        t_step = _per_step(step, a.steps)
        t_fwd = _per_step(fwd, a.steps)
        # the backward alone: each timed call needs a fresh graph, made (untimed) before it
        bw, fn_in = [], []
        for _ in range(15):
            tot, inside[0] = 0.0, 0.0
            for _ in range(a.steps):
                fwd()
                t0 = _clock()
                bwd()
                tot += _clock() - t0
            bw.append(tot / a.steps)
            fn_in.append(inside[0] / a.steps)
        bw.sort()
        fn_in.sort()
        if dev == "cuda":
            torch.cuda.synchronize()
        us = lambda t: f"{t[7] * 1e6:7.1f} [{t[0] * 1e6:6.1f}]"  # noqa: E731
        print(f"{name:14s} {a.rows}x{a.cols} {str(dtype)[6:]:8s} {dev}{' (launches stubbed)' if stub else ''}: "
              f"step {us(t_step)} us | forward {us(t_fwd)} | backward {us(bw)} (bwd fn {us(fn_in)}, "
              f"engine {(bw[7] - fn_in[7]) * 1e6:.1f})", flush=True)
        print(f"{'':14s} per step: {sum(launches.values())} Triton launches ({', '.join(launches)}); "
              f"{sum(ops.values())} ATen ops ({', '.join(f'{k} x{v}' for k, v in sorted(ops.items()))})", flush=True)
        if a.profile:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.steps):
                step()
            pr.disable()
            print(f"--- {name}: profile of the step (this thread)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(a.profile)
            if dev == "cuda":
                bwd_prof.append(cProfile.Profile())
                for _ in range(a.steps):
                    step()
                print(f"--- {name}: profile of the autograd Function's backward (the engine's thread)")
                pstats.Stats(bwd_prof.pop()).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()
