"""Host (CPU) time per call of acefuse's generated launchers, called from Python.

``--program softmax`` (the default): one training step through ``af.compile``, softmax
forward + backward (the augmented forward kernel, then the derived backward kernel).
``--program decode``: one decode step of grouped-query attention (examples/attention.py
``decode``: B=8, 8 key/value heads of 4 query heads, one query row, D=128, bfloat16, KV
length ``--kv``), through the compiled kernel under no_grad and through the generated
``run()`` alone, with the automatic schedule and with ``schedule='split'`` (what a GPU picks
where the programs cannot fill it: two launches, the partial states and their merge), with
``schedule='split1'`` (the same in one launch, the last program of a row merging), and
with a KV cache growing by one position per call (each call a new signature: the launcher's
plan is worked out again). ``--module`` times another generated decode module beside this
checkout's, the two taking turns.

    python benchmarks/host_overhead.py              # GPU: issue time per step (no sync inside the loop)
    TRITON_INTERPRET=1 python benchmarks/host_overhead.py --stub   # CPU: launches stubbed
    python benchmarks/host_overhead.py --program decode --stub     # the decode launcher, CPU
    ... --program decode --stub --cpu-time --module OLD.py         # against another version's module
    ... --profile                                   # cProfile of the Python path, by own time

``--compare-fast`` times every case twice, taking turns: with the direct launch of compiled
kernels (codegen/fastlaunch.py: Triton 3.6 on a GPU) and without it (``ACEFUSE_FAST_LAUNCH=0``,
every launch through Triton's JIT), labelled ``[fast launch]`` and ``[JIT launch]``.

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
    ap.add_argument("--cpu-time", action="store_true", help="with --stub: this thread's CPU time, not "
                    "wall time (steadier on a shared host)")
    ap.add_argument("--compare-fast", action="store_true", help="time each case with the direct launch "
                    "of compiled kernels and without it (codegen/fastlaunch.py), taking turns")
    ap.add_argument("--module", help="decode: time run() of this generated module file instead (another "
                    "version's launcher, to compare)")
    a = ap.parse_args()
    global _clock
    if a.cpu_time:
        _clock = time.thread_time
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
    for label, times in _timed({"": step}, a, dev).items():
        print(f"softmax {a.rows}x{a.cols} forward+backward via af.compile on {dev}"
              f"{' (launches stubbed)' if a.stub else ''}{label}: host time per step median {times[7] * 1e6:.1f} us, "
              f"min {times[0] * 1e6:.1f} us")
    if a.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)



def _timed(fns, a, dev, reps=15):
    """{label: sorted seconds per call}: each of ``fns`` (label -> fn) timed by _repeat, one
    repetition each in turn (a busy host drifts); with --compare-fast each twice, with the
    direct launch of compiled kernels on (" [fast launch]") and off (" [JIT launch]")."""
    from acefuse.codegen import fastlaunch
    modes = ((" [fast launch]", True), (" [JIT launch]", False)) if a.compare_fast else (("", fastlaunch.ENABLED),)
    was = fastlaunch.ENABLED
    times = {f"{n}{m}": [] for n in fns for m, _ in modes}
    try:
        for _ in range(reps):
            for n, fn in fns.items():
                for m, on in modes:
                    fastlaunch.set_enabled(on)
                    for _ in range(3):   # (a switch: the first calls of the other path)
                        fn()
                    times[f"{n}{m}"] += _repeat(fn, a.steps, dev, reps=1)
    finally:
        fastlaunch.set_enabled(was)
    return {n: sorted(t) for n, t in times.items()}


def _stub_launches():
    from triton.runtime import interpreter
    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *args, **kw: None)


_clock = time.perf_counter


def _repeat(step, steps, dev, reps=15):
    """Seconds per call of ``step``: ``reps`` repetitions of ``steps`` calls, sorted."""
    times = []
    for _ in range(reps):
        t0 = _clock()
        for _ in range(steps):
            step()
        times.append((_clock() - t0) / steps)
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
    mods = {"this checkout": getattr(k, "kernel", k).module}
    if a.module:
        from acefuse.codegen.compile import load_module
        mods[a.module] = load_module(Path(a.module), "decode_compared")
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
    for sched in (None, "split", "split1"):
        for fn in [k] + [m.run for m in mods.values()]:
            with torch.no_grad():
                got = fn(**small, schedule=sched)
            err = (got.double() - ref).abs().max().item()
            assert err < 2e-2, f"decode (schedule={sched}) is off by {err}"
    ins = inputs(a.kv)
    # a growing KV cache: a view of the first n positions of a longer buffer, n one longer each
    # call (1024 lengths in turn: more than a launcher keeps plans for, so each call is a new one)
    buf = torch.empty(8, 8, a.kv + 1024, 128, device=dev, dtype=dt).normal_()
    grown = [dict(ins, k=buf[:, :, :n], v=buf[:, :, :n]) for n in range(a.kv, a.kv + 1024)]

    def growing(run):
        turn = [0]

        def call():
            turn[0] = (turn[0] + 1) % len(grown)
            return run(**grown[turn[0]])
        return call
    if a.stub:
        _stub_launches()
    cases = [("af.compile kernel, automatic schedule", {"this checkout": lambda: k(**ins)})]
    for what, make in (("automatic schedule", lambda run: lambda: run(**ins)),
                       ("schedule='split'", lambda run: lambda: run(**ins, schedule="split")),
                       ("schedule='split1'", lambda run: lambda: run(**ins, schedule="split1")),
                       ("automatic schedule, KV growing by one per call", growing)):
        cases.append((f"generated run(), {what}", {n: make(m.run) for n, m in mods.items()}))
    with torch.no_grad():
        for what, fns in cases:
            for fn in fns.values():
                for _ in range(20):
                    fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            # the launchers compared take turns, repetition by repetition (a busy host drifts)
            for n, t in _timed({f" [{n}]": fn for n, fn in fns.items()}, a, dev).items():
                print(f"decode B=8 G=8 R=4 D=128 KV={a.kv} bf16 on {dev}{' (launches stubbed)' if a.stub else ''}, "
                      f"{what}{n}: host time per call median {t[7] * 1e6:.1f} us, min {t[0] * 1e6:.1f} us")
        if a.profile:
            import cProfile
            import pstats
            fn = cases[3][1]["this checkout"]   # the generated run(), schedule='split1'
            print("cProfile: generated run(), schedule='split1'")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.steps):
                fn()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
