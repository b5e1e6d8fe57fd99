"""Host (CPU) time per call of acefuse's generated launchers, called from Python.

``--program softmax`` (the default): one training step through ``af.compile``, softmax
forward + backward (the augmented forward kernel, then the derived backward kernel).
``--program decode``: one decode step of grouped-query attention (examples/attention.py
``decode``: B=8, 8 key/value heads of 4 query heads, one query row, D=128, bfloat16, KV
length ``--kv``), through the compiled kernel under no_grad and through the generated
``run()`` alone, with the automatic schedule and with ``schedule='split'`` (what a GPU picks
where the programs cannot fill it: two launches, the partial states and their merge).

    python benchmarks/host_overhead.py              # GPU: issue time per step (no sync inside the loop)
    TRITON_INTERPRET=1 python benchmarks/host_overhead.py --stub   # CPU: launches stubbed
    python benchmarks/host_overhead.py --program decode --stub     # the decode launcher, CPU
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
    ap.add_argument("--program", choices=("softmax", "decode"), default="softmax")
    ap.add_argument("--kv", type=int, default=4096, help="decode: key/value length")
    ap.add_argument("--module", help="decode: time run() of this generated module file instead (another "
                    "version's launcher, to compare)")
    a = ap.parse_args()
    if a.stub:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.program == "decode":
        return decode(a)
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
        _stub_launches()

    def step():
        x.grad = None
        k(x=x).backward(g)

    for _ in range(20):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    times = _repeat(step, a.steps, dev)
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



def _stub_launches():
    from triton.runtime import interpreter
    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *args, **kw: None)


def _repeat(step, steps, dev):
    """Seconds per call of ``step``: 15 repetitions of ``steps`` calls, sorted."""
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) / steps)
        if dev == "cuda":
            torch.cuda.synchronize()
    return sorted(times)


def decode(a):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import acefuse as af
    import attention as ex
    k = af.compile(ex.decode)
    mod = getattr(k, "kernel", k).module
    if a.module:
        from acefuse.codegen.compile import load_module
        mod = load_module(Path(a.module), "decode_compared")
    dev = "cuda" if torch.cuda.is_available() and not a.stub else "cpu"
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def inputs(kv):
        return dict(q=torch.randn(8, 8, 4, 1, 128, generator=gen).to(dev, dt),
                    k=torch.randn(8, 8, kv, 128, generator=gen).to(dev, dt),
                    v=torch.randn(8, 8, kv, 128, generator=gen).to(dev, dt))

    # correctness first (a short KV on the CPU: the interpreter runs it), against float64
    small = inputs(a.kv if dev == "cuda" else 64)
    q, kk, vv = (small[n].double() for n in "qkv")
    s = torch.einsum("bgrid,bgjd->bgrij", q, kk) * ex.SCALE
    ref = torch.einsum("bgrij,bgje->bgrie", torch.softmax(s, -1), vv)
    for sched in (None, "split"):
        for fn in (k, mod.run):
            with torch.no_grad():
                got = fn(**small, schedule=sched)
            err = (got.double() - ref).abs().max().item()
            assert err < 2e-2, f"decode (schedule={sched}) is off by {err}"
    ins = inputs(a.kv)
    if a.stub:
        _stub_launches()
    cases = [("af.compile kernel, automatic schedule", lambda: k(**ins)),
             ("generated run(), automatic schedule", lambda: mod.run(**ins)),
             ("generated run(), schedule='split'", lambda: mod.run(**ins, schedule="split"))]
    with torch.no_grad():
        for what, fn in cases:
            for _ in range(20):
                fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            times = _repeat(fn, a.steps, dev)
            print(f"decode B=8 G=8 R=4 D=128 KV={a.kv} bf16 on {dev}{' (launches stubbed)' if a.stub else ''}, "
                  f"{what}: host time per call median {times[7] * 1e6:.1f} us, min {times[0] * 1e6:.1f} us")
        if a.profile:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.steps):
                cases[2][1]()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
