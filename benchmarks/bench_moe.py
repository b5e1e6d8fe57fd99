"""MoE top-k softmax routing (examples/moe.py, ``softmax_topk(k)``) against torch eager and
torch.compile (softmax + torch.topk + renormalise), in one run, on the same inputs.

    python benchmarks/bench_moe.py                       # GPU: 16384/32768/65536 tokens x 64/128/256 experts, k = 2, 8
    python benchmarks/bench_moe.py --quick               # GPU: 16384 tokens x 64/256 experts, k = 2, 8
    python benchmarks/bench_moe.py --device cpu --quick  # tiny sizes through Triton's interpreter (functional check)
    python benchmarks/bench_moe.py --out moe.json
    python benchmarks/bench_moe.py --host-only           # CPU: host time per call, launches stubbed

``--host-only`` times the Python path of one routing call (tokens x experts from ``--tokens``
and ``--experts``, default 64 x 64, float32, on the CPU) with every Triton launch replaced by a
no-op (Triton's interpreter would otherwise dominate; as benchmarks/host_overhead.py --stub):
the af.compile kernel (what a caller gets: the weights and experts as [tokens, k] tensors) and
the generated launcher's ``run()`` alone. It is what the GPU pays per call on the host besides
Triton's own launch (not stubbed there: its cost grows with the kernel's argument count, which
``--host-only`` prints). Median and minimum of 15 repetitions of ``--steps`` calls.

The acefuse kernels are regenerated from the programs (af.compile: derivation, certificate,
codegen; cached by program) and timed as a caller calls them: ``kern(x=x)``, which returns the
weights and experts as [tokens, k] tensors written by the kernel (``--launcher``: the generated
module's ``run()`` alone, which returns the same tensors). The
program is the routing written plainly, top-k of the probabilities (``softmax_topk(k)``): one
pass over the experts (the selection runs on the logits, proofs/monotone.py; the k-candidate
state's merge is proofs/topk.py's); ``--select logits`` times the program that chooses on the
logits as written instead. Bytes counted per call, each once: the
logits read (tokens * experts * element size), the weights written (tokens * k * element size)
and the expert indices written (tokens * k * 8, int64 as torch.topk). GB/s is those bytes over
the median time (triton.testing.do_bench on CUDA). Before timing, the experts must equal
torch.topk's on every row whose k + 1 largest probabilities are distinct, and the weights
must match the float64 reference within 2e-6 (relative) + 1e-7 (16-bit weights: one unit in
their last place more).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from _common import timer

ROOT = Path(__file__).resolve().parents[1]
TOKENS, EXPERTS = "16384,32768,65536", "64,128,256"   # the GPU sizes (issue 14)


def eager_route(x, k):
    p = torch.softmax(x, dim=-1)
    w, i = torch.topk(p, k, dim=-1)
    return w / w.sum(-1, keepdim=True), i




def check(x, k, w, i):
    """None when (w, i) are the routing of x (module docstring), else what differs."""
    w_ref, i_ref = eager_route(x.double(), k)
    p = torch.softmax(x.double(), -1).sort(-1, descending=True)[0][:, :k + 1]
    distinct = (p[:, :-1] > p[:, 1:]).all(-1)
    bad = (i[distinct] != i_ref[distinct]).any(-1).sum().item()
    if bad:
        return f"experts differ from torch.topk on {bad} rows with distinct probabilities"
    # float32 weights: 2e-6 relative; 16-bit weights are rounded once more at the output
    # (half a unit in the last place, plus the float32 error before it)
    rel = 2e-6 if w.dtype == torch.float32 else torch.finfo(w.dtype).eps + 2e-6
    err = ((w.double() - w_ref).abs() - rel * w_ref.abs()).max().item()
    if err > 1e-7:
        return f"weights differ from the float64 reference by {err:.2e} beyond the tolerance"
    return None


def host_only(args):
    """Host time per call of the compiled routing on the CPU, Triton launches stubbed."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(ROOT))
    import runpy
    import inspect
    import acefuse as af
    from triton.runtime import interpreter
    moe = runpy.run_path(str(ROOT / "examples" / "moe.py"))
    # the GPU sizes' defaults are the interpreter's minutes: 64 x 64 unless sizes are given
    t = 64 if args.tokens == TOKENS else int(args.tokens.split(",")[0])
    e = 64 if args.experts == EXPERTS else int(args.experts.split(",")[0])
    real = interpreter.InterpretedFunction.__getitem__
    for k in [int(v) for v in args.k.split(",")]:
        kern = af.compile(moe["softmax_topk"](k, select=args.select))
        mod = kern.kernel.kernel.module                 # the generated module (its launcher run())
        x = torch.randn(t, e) * 2
        interpreter.InterpretedFunction.__getitem__ = real
        out = kern(x=x)                                 # one real call: checked, and the plan cached
        why = check(x, k, out["weights"], out["experts"])
        if why:
            sys.exit(f"k={k} {t}x{e}: {why}")
        launch = getattr(mod, f"{kern.program.name}_single")
        nargs = len(inspect.signature(launch.fn).parameters) - 2   # less BLOCK_R, BLOCK_J
        interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **kw: None)
        try:
            for what, fn in (("af.compile kernel (stacked outputs)", lambda: kern(x=x)),
                             ("generated run() alone", lambda: mod.run(x=x))):
                for _ in range(20):
                    fn()
                times = []
                for _ in range(15):
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        fn()
                    times.append((time.perf_counter() - t0) / args.steps)
                times.sort()
                print(f"k={k} {t}x{e} float32, {what}: host time per call median {times[7] * 1e6:.1f} us, "
                      f"min {times[0] * 1e6:.1f} us (single-tile kernel: {nargs} arguments)")
        finally:
            interpreter.InterpretedFunction.__getitem__ = real


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--experts", default=EXPERTS)
    ap.add_argument("--k", default="2,8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (GPU), or tiny sizes on the CPU")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--select", choices=["probs", "logits"], default="probs",
                    help="top-k of the probabilities as written (default) or of the logits")
    ap.add_argument("--out")
    ap.add_argument("--host-only", action="store_true", help="host time per call, launches stubbed (CPU)")
    ap.add_argument("--launcher", action="store_true", help="time the generated run() alone, not af.compile's kernel")
    ap.add_argument("--steps", type=int, default=200, help="--host-only: calls per repetition")
    args = ap.parse_args()
    if args.host_only:
        return host_only(args)
    dev = args.device
    if dev == "cpu":
        if not args.quick:
            sys.exit("the CPU runs Triton's interpreter: use --device cpu --quick for a functional check")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.tokens, args.experts, args.k, args.dtypes, args.no_compile = "8", "16", "2", "float32", True
    elif not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run with --device cpu --quick for a functional check")
    elif args.quick:
        args.tokens, args.experts = "16384", "64,256"
    sys.path.insert(0, str(ROOT))
    import runpy
    import acefuse as af
    moe = runpy.run_path(str(ROOT / "examples" / "moe.py"))
    bench = timer(dev)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    print(f"device {name}")
    rows = []
    for k in [int(v) for v in args.k.split(",")]:
        t0 = time.perf_counter()
        select = args.select
        kern = af.compile(moe["softmax_topk"](k, select=select))
        print(f"k = {k} (top-k of the {select}): derived, certified and generated in {time.perf_counter() - t0:.0f} s "
              f"({len(kern.fusion.passes)} passes over the experts; certificate "
              f"{'ok' if kern.fusion.certificate.ok else 'NOT ok: the unfused kernel runs'})")
        raw = getattr(getattr(kern.kernel, "kernel", None), "module", None)   # the generated launcher
        comp = None if args.no_compile else torch.compile(lambda x, k=k: eager_route(x, k))
        for dname in args.dtypes.split(","):
            dt = getattr(torch, dname)
            for t in [int(v) for v in args.tokens.split(",")]:
                for e in [int(v) for v in args.experts.split(",")]:
                    g = torch.Generator(device=dev).manual_seed(t + e + k)
                    x = (torch.randn(t, e, device=dev, generator=g) * 2).to(dt)
                    # the kernel writes the weights and experts as [tokens, k] tensors (codegen/stacked.py)
                    call = (lambda x=x: raw.run(x=x)) if args.launcher and raw is not None else (lambda x=x: kern(x=x))
                    out = call()
                    why = check(x.float().cpu(), k, out["weights"].cpu(), out["experts"].cpu())
                    if why:
                        sys.exit(f"k={k} {dname} {t}x{e}: {why}")
                    t_af = bench(call)
                    t_eager = bench(lambda x=x: eager_route(x, k))
                    t_comp = bench(lambda x=x: comp(x)) if comp is not None else None
                    nbytes = x.numel() * x.element_size() + t * k * (x.element_size() + 8)
                    gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9   # noqa: E731
                    row = dict(k=k, dtype=dname, tokens=t, experts=e, bytes=nbytes, acefuse_ms=t_af,
                               acefuse_gbs=gbs(t_af), eager_ms=t_eager, eager_gbs=gbs(t_eager),
                               compile_ms=t_comp, compile_gbs=gbs(t_comp) if t_comp else None,
                               vs_eager=t_eager / t_af, vs_compile=(t_comp / t_af) if t_comp else None,
                               passes=len(kern.fusion.passes))
                    rows.append(row)
                    comp_txt = (f"compile {t_comp:8.3f} ms {row['compile_gbs']:7.1f} GB/s "
                                f"({row['vs_compile']:.2f}x)") if t_comp else "compile (skipped)"
                    print(f"k={k} {dname:8s} {t:6d} x {e:3d}: acefuse {t_af:8.3f} ms {row['acefuse_gbs']:7.1f} GB/s; "
                          f"eager {t_eager:8.3f} ms {row['eager_gbs']:7.1f} GB/s ({row['vs_eager']:.2f}x); {comp_txt}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, rows=rows), indent=1))


if __name__ == "__main__":
    main()
