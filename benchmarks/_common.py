"""What the GPU benchmarks share: loading an exported kernel, timing a call, and the
device's measured ceilings (copy bandwidth, bf16 matmul throughput) that rates are
read against. The benchmarks import it as a sibling module (``import _common``): they
run as scripts from this folder (``python benchmarks/bench_rows.py``).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

KERNELS = Path(__file__).resolve().parent / "kernels"


def load(name):
    """The generated module ``benchmarks/kernels/<name>.py`` (written by
    benchmarks/export.py; it needs only torch and triton)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", KERNELS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
