"""Host (CPU) time of one training step through ``af.compile``: softmax forward + backward
(the augmented forward kernel, then the derived backward kernel) called from Python.

    python benchmarks/host_overhead.py              # GPU: issue time per step (no sync inside the loop)
    TRITON_INTERPRET=1 python benchmarks/host_overhead.py --stub   # CPU: launches stubbed
    ... --profile                                   # cProfile of the Python path, by own time

``--stub`` replaces every Triton launch by a no-op (Triton's interpreter on the CPU would
otherwise dominate), so what is timed is acefuse's Python path (acefuse/autograd.py, the
generated launchers) and torch's autograd engine. On a GPU the loop issues the kernels
asynchronously and the time per step is the host's, as long as it exceeds the kernels' own
(compare with the kernel times in BENCHMARKS.md). Median and minimum of 15 repetitions.
"""
import argparse
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stub", action="store_true", help="no-op Triton launches (CPU)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    if a.stub:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import acefuse as af
    x_ = af.tensor("x", "r j")
    m = af.max(x_, "j")
    p = af.exp(x_ - m)
    k = af.compile(af.program("softmax_host", y=p / af.sum(p, "j")))
    dev = "cuda" if torch.cuda.is_available() and not a.stub else "cpu"
    x = torch.randn(a.rows, a.cols, device=dev, requires_grad=True)
    g = torch.randn(a.rows, a.cols, device=dev)
    y = k(x=x)
    y.backward(g)                    # compile and run once for real
    ref = torch.softmax(x.detach().double(), -1)
    err = (y.detach().double() - ref).abs().max().item()
    assert err < 1e-5, f"softmax forward is off by {err}"
    if a.stub:
        from triton.runtime import interpreter
        interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *args, **kw: None)

    def step():
        x.grad = None
        k(x=x).backward(g)

    for _ in range(20):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        times.append((time.perf_counter() - t0) / a.steps)
        if dev == "cuda":
            torch.cuda.synchronize()
    times.sort()
    print(f"softmax {a.rows}x{a.cols} forward+backward via af.compile on {dev}"
          f"{' (launches stubbed)' if a.stub else ''}: host time per step median {times[7] * 1e3:.3f} ms, "
          f"min {times[0] * 1e3:.3f} ms")
    if a.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
