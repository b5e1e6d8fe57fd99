"""What the GPU benchmarks share: loading a kernel (derived and generated in the run, or an
exported module), timing a call, and the device's measured ceilings (copy bandwidth, bf16
matmul throughput) that rates are read against. The benchmarks import it as a sibling module
(``import _common``): they run as scripts from this folder (``python benchmarks/bench_rows.py``).

Where a kernel comes from (``--source`` of the benchmarks, ``set_source``):
- ``compile``: ``af.compile`` of the example program, in this run (needs acefuse and egglog;
  on the GPU machine carry the egglog wheel). The automatic call (no options) is what a user
  gets, Gluon kernels included on an sm_90 GPU; calls with schedule options run the generated
  Triton module's launcher with them.
- ``export``: the module ``benchmarks/kernels/<name>.py`` written by benchmarks/export.py
  (torch and triton only; the Triton module alone, no Gluon kernels).
- ``auto`` (default): ``compile`` where acefuse and egglog import, else ``export``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

KERNELS = Path(__file__).resolve().parent / "kernels"


SOURCE = {"where": "auto"}   # set_source(); what load() reads


def set_source(where):
    """Where ``load`` takes kernels from: 'compile', 'export' or 'auto' (the module docstring);
    returns the one in effect."""
    if where == "auto":
        try:
            import acefuse  # noqa: F401
            import egglog  # noqa: F401
            where = "compile"
        except ImportError:
            where = "export"
    SOURCE["where"] = where
    return where


def load(name):
    """The kernel of benchmark program ``name`` (benchmarks/export.py's PROGRAMS): an object
    whose ``run(**inputs, **options)`` runs it (see the module docstring)."""
    if set_source(SOURCE["where"]) == "compile":
        return Compiled(name)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", KERNELS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_program(name, var=None):
    """The program ``var`` (default ``name``) of the example file that benchmarks/export.py
    lists for ``name``, with that file's namespace."""
    import runpy
    from export import PROGRAMS, ROOT
    files = [f for f, v in PROGRAMS if v == name]
    if not files:
        raise KeyError(f"no benchmark program {name!r} (benchmarks/export.py PROGRAMS)")
    ns = runpy.run_path(str(ROOT / files[0]))
    return ns[var or name], ns


class Compiled:
    """``af.compile`` of a program in this run, with an exported module's interface: ``run()``
    with no options is the automatic call (what a user gets); with options (``schedule``,
    ``block_j``, ...) the generated Triton module's launcher; ``kept()`` names what the automatic
    call kept for the last input shapes it chose for."""

    def __init__(self, name, prog=None):
        import acefuse as af
        self.name = name
        self.kernel = af.compile(prog if prog is not None else example_program(name)[0])
        self.module = self.kernel.module

    def run(self, **inputs):
        opts = {k: inputs.pop(k) for k in list(inputs) if k not in self.kernel.program.tensors}
        if not opts:
            return self.kernel(**inputs)
        return self.module.run(**inputs, **opts)

    def kept(self):
        for attr in ("_gluon", "_staged"):
            choice = getattr(self.kernel, f"{attr}_choice", None) or {}
            for v in choice.values():
                return "triton" if v == "triton" else describe_gluon(v)
        return "triton"

    def __getattr__(self, a):   # SPLIT, STACKED, ... of the generated module
        return getattr(self.__dict__["module"], a)


def describe_gluon(g):
    """A Gluon kernel's form in a few letters: ws (warp-specialised), ov (overlap), P
    (persistent), D (dynamic work items), pp (ping-pong), df (deferred P @ V), "+tile store"
    (output tiles stored from STORE_L); a staged row kernel's class name otherwise."""
    if not hasattr(g, "ws"):
        return type(g).__name__
    return "gluon " + "".join(t for t, on in (("ws", g.ws), ("ov", g.overlap), ("pp", g.pingpong),
                                               ("df", g.defer), ("P", g.persistent), ("D", g.dynamic),
                                               ("+tile store", getattr(g, "tile_store", False))) if on)


def bench(fn, rep=100, warmup=10):
    """Median milliseconds of ``fn`` (``triton.testing.do_bench``, ``warmup`` and ``rep`` in
    ms), after one untimed call (compilation, autotuning and caches stay outside)."""
    from triton.testing import do_bench
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def ceilings(copy_rep=100, mm_rep=300, warmup=10):
    """(copy GB/s, bf16 matmul TFLOP/s) measured on this GPU: a copy of 1 GiB of bf16 counted
    as read + write, and an 8192^3 matmul counted as 2*8192^3 FLOPs."""
    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)   # 1 GiB
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 2 / (bench(lambda: y.copy_(x), copy_rep, warmup) * 1e-3) / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / (bench(lambda: a @ b, mm_rep, warmup) * 1e-3) / 1e12
    x = y = a = b = None   # dropped, so that empty_cache() returns their memory
    torch.cuda.empty_cache()
    return copy, mm


def timer(dev):
    """A timing function for ``dev`` (ms per call): the median of triton's do_bench after
    an untimed call on CUDA; on the CPU (Triton's interpreter, a smoke run) the wall time of
    two calls after one untimed."""
    if dev == "cuda":
        from triton.testing import do_bench

        def bench_cuda(fn):
            fn()
            torch.cuda.synchronize()
            return do_bench(fn, warmup=25, rep=200, return_mode="median")
        return bench_cuda

    def bench_cpu(fn):
        import time
        fn()
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - t0) / 2 * 1e3
    return bench_cpu
