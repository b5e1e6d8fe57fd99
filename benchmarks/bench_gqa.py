"""Grouped-query attention, forward + backward: acefuse's derived kernels (examples/attention.py
``gqa``: q "b g r i d", k/v "b g j d") against SDPA with ``enable_gqa=True``, in one run.

    python3 benchmarks/bench_gqa.py [--size B,G,R,N]          # GPU, bf16, D = 128
    python benchmarks/bench_gqa.py --cpu-smoke                 # tiny float32, Triton's interpreter

Prints the first call's time (derivation, compilation, timed launch choices), each backward
stage's kernel kind, the gradients' norm-relative error against SDPA's, the ride-or-apart timing
of the backward (``BackwardKernel.ride_times``) and ms / TFLOP/s (3.5x the forward's FLOPs)."""
from __future__ import annotations

import argparse
import math
import runpy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="2,8,4,4096", help="B,G,R,N (KV heads G, query heads per group R)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args(argv)
    import acefuse as af
    ns = runpy.run_path(str(ROOT / "examples" / "attention.py"))
    D = ns["D"]
    if args.cpu_smoke:
        (B, G, R, N), dev, dt = (1, 2, 2, 24), "cpu", torch.float32
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gqa: no CUDA device; use --cpu-smoke")
        (B, G, R, N), dev, dt = tuple(int(x) for x in args.size.split(",")), "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    q, go = (torch.randn(B, G, R, N, D, generator=g).to(dev, dt) for _ in range(2))
    k, v = (torch.randn(B, G, N, D, generator=g).to(dev, dt) for _ in range(2))
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    t0 = time.time()
    kern = af.compile(ns["gqa"])

    def ours():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kern(q=leaves[0], k=leaves[1], v=leaves[2]).backward(go)
        return [t.grad for t in leaves]

    def sdpa():
        leaves = [t.clone().requires_grad_() for t in (q.reshape(B, G * R, N, D), k, v)]
        F.scaled_dot_product_attention(*leaves, scale=1.0 / math.sqrt(D), enable_gqa=True).backward(
            go.reshape(B, G * R, N, D))
        return [leaves[0].grad.reshape(B, G, R, N, D), leaves[1].grad, leaves[2].grad]

    got = ours()
    sync()
    print(f"gqa B={B} G={G} R={R} N={N} D={D} {dt}: first call {time.time() - t0:.1f} s; "
          f"gradient fallback: {kern.grad_fallback}")
    bk = kern._bwd_kernel
    for s, kk in zip(bk.program.stages, bk.kernels):
        print(f"  stage {s.name}: {type(kk).__name__}, loops over {getattr(getattr(kk, 'module', None), 'LOOP2_AXES', None)}")
    bad = False
    for n, a, b in zip("qkv", got, sdpa()):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        bad |= not err < (2e-2 if dt == torch.bfloat16 else 1e-4)
        print(f"  grad_{n}: norm-relative error vs SDPA {err:.2e}")
    if bad:
        print("WRONG gradient: not timed")
        return 1
    if dev != "cuda":
        print("cpu smoke: OK")
        return 0
    from triton.testing import do_bench
    flops = 4.0 * B * G * R * N * N * D * 3.5
    res = {}
    for name, fn in (("acefuse", ours), ("sdpa enable_gqa", sdpa)):
        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
        res[name] = ms
        print(f"  {name}: fwd+bwd {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
    print(f"  acefuse vs SDPA: {res['sdpa enable_gqa'] / res['acefuse']:.2f}x")
    print(f"  ride times (ms with riders, ms apart): {list(getattr(bk, 'ride_times', {}).values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
