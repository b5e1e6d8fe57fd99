"""GPU benchmark of the generated row kernels against torch eager, torch.compile and
Liger-Kernel (where it imports), in one run, on the same inputs.

    python benchmarks/bench_rows.py [--quick] [--out results.json] [--source auto|compile|export]
        [--no-sweep] [--only softmax,...] [--shapes 4096x65536,...]

``--source`` (benchmarks/_common.py): ``compile`` derives and generates the kernels in this
run with ``af.compile`` (egglog needed; "auto" is then the call a user makes, which on an sm_90
GPU may keep the shared-memory staged Gluon kernel: the row says which); ``export`` imports
benchmarks/kernels/ (benchmarks/export.py; Triton only). ``--no-sweep`` times the automatic
call alone (no schedule variants).

Reports GB/s counting the bytes each kernel must move (each input read once, each
output written once), next to the measured copy bandwidth of the device, and the
ratio of our time to each peer's (>1 means acefuse is faster).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import _common
from _common import load


def liger(name, cols):
    """Liger-Kernel's forward for this workload (None where it has none or does not import)."""
    try:
        import liger_kernel.transformers.functional as L
    except Exception:  # noqa: BLE001 - not installed, or not importable with this torch/triton
        return None
    if name == "softmax":
        return lambda x: L.liger_softmax(x)
    if name == "layernorm":
        return lambda x, w, b: L.liger_layer_norm(x, w, b, 1e-5)
    if name == "rmsnorm":
        return lambda x, w: L.liger_rms_norm(x, w, 1e-6, offset=0.0, casting_mode="llama", in_place=False)
    if name == "cross_entropy":
        return lambda x, t: L.liger_cross_entropy(x, t, reduction="none")
    return None


bench = functools.partial(_common.bench, rep=200, warmup=25)   # ms


def workloads(rows, cols, dev):
    g = torch.Generator(device=dev).manual_seed(rows * 7 + cols)
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16, generator=g) * 3
    w = torch.rand(cols, device=dev, dtype=torch.bfloat16, generator=g) + 0.5
    b = torch.randn(cols, device=dev, dtype=torch.bfloat16, generator=g)
    t = torch.randint(0, cols, (rows,), device=dev, generator=g)
    el = rows * cols * 2
    return {
        "softmax": (dict(x=x), lambda: torch.softmax(x, -1), 2 * el),
        "log_softmax": (dict(x=x), lambda: torch.log_softmax(x, -1), 2 * el),
        "layernorm": (dict(x=x, w=w, b=b), lambda: F.layer_norm(x, (cols,), w, b, eps=1e-5), 2 * el),
        "rmsnorm": (dict(x=x, w=w), lambda: F.rms_norm(x, (cols,), w, eps=1e-6), 2 * el),
        "cross_entropy": (dict(x=x, t=t), lambda: F.cross_entropy(x, t, reduction="none"), el + rows * 10),
    }


def variants(mod, n_cols):
    """Schedules to try: the launcher's own choice first, then alternatives."""
    out = [("auto", {})]
    if n_cols <= 65536:
        for nw in (4, 8, 16, 32):
            out.append((f"single/w{nw}", dict(schedule="single", block_j=triton.next_power_of_2(n_cols), num_warps=nw)))
    if 8192 <= n_cols <= 65536:
        # registers per thread capped so that two programs fit an SM (the timed launch tries these too)
        for nw in (8, 16, 32):
            if 64 * nw <= triton.next_power_of_2(n_cols) <= 2048 * nw:
                out.append((f"single/w{nw}/maxnreg{65536 // (64 * nw)}",
                            dict(schedule="single", block_j=triton.next_power_of_2(n_cols), num_warps=nw,
                                 maxnreg=65536 // (64 * nw))))
    if n_cols <= 16384:
        for br, nw in ((2, 8), (2, 16), (4, 16)):
            out.append((f"single/r{br}/w{nw}", dict(schedule="single", block_j=triton.next_power_of_2(n_cols),
                                                    block_r=br, num_warps=nw)))
    for bj in (1024, 4096):
        out.append((f"loop/bj{bj}", dict(schedule="loop", block_j=bj)))
    if mod.SPLIT:
        out.append(("split/bj2048", dict(schedule="split", block_j=2048)))
    if n_cols > 16384:
        # the loop on a persistent grid (a row's second read from L2), and one read: the onepass
        # schedule (a team of programs per block of rows, one chunk each; persistent teams with per_sm)
        out.append(("loop/p1/bj16384/w16", dict(schedule="loop", block_j=16384, num_warps=16, per_sm=1)))
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        if mod.SPLIT and not getattr(mod, "STACKED", None):
            for bj, nw, extra in ((16384, 16, {}), (8192, 8, {}), (16384, 16, dict(per_sm=2, maxnreg=64)),
                                  (8192, 8, dict(per_sm=2))):
                if -(-n_cols // bj) <= sms:
                    lab = f"onepass/bj{bj}/w{nw}" + "".join(f"/{k}{v}" for k, v in extra.items())
                    out.append((lab, dict(schedule="onepass", block_j=bj, num_warps=nw, **extra)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated workloads")
    ap.add_argument("--shapes", default=None, help="comma-separated RxC shapes (default: all five)")
    ap.add_argument("--source", default="auto", choices=["auto", "compile", "export"])
    ap.add_argument("--no-sweep", action="store_true", help="time the automatic call alone")
    args = ap.parse_args(argv)
    source = _common.set_source(args.source)
    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    copy, mm = _common.ceilings(copy_rep=200, mm_rep=300, warmup=25)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; kernels: {source}")
    print(f"measured ceilings: copy {copy:.0f} GB/s (read+write), bf16 matmul {mm:.0f} TFLOP/s")
    shapes = [(16384, 8192), (16384, 16384), (8192, 32768), (4096, 65536), (256, 262144)]
    if args.shapes:
        shapes = [tuple(int(n) for n in sh.split("x")) for sh in args.shapes.split(",")]
    plan = [(w, s) for s in shapes for w in ("softmax", "log_softmax", "layernorm", "rmsnorm")]
    if not args.shapes:
        plan.append(("cross_entropy", (8192, 128256)))
    if args.only:
        keep = set(args.only.split(","))
        plan = [p for p in plan if p[0] in keep]
    if args.quick:
        plan = plan[:2]
    mods = {}
    results = []
    for name, (r, c) in plan:
        mod = mods.setdefault(name, load(name))
        inputs, eager, nbytes = workloads(r, c, dev)[name]
        ref = eager().float()
        compiled = torch.compile(eager, dynamic=False)
        t0 = time.time()
        compiled()
        ctime = time.time() - t0
        best = None
        auto = None
        tried = []
        for label, kw in (variants(mod, c) if not args.no_sweep else [("auto", {})]):
            try:
                out = mod.run(**inputs, **kw)
                torch.cuda.synchronize()
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                tried.append((label, f"error: {type(exc).__name__}: {str(exc)[:80]}"))
                continue
            out = out.float()
            err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            if not (err < 5e-2):
                tried.append((label, f"WRONG (rel err {err:.2e})"))
                continue
            t = bench(lambda: mod.run(**inputs, **kw))
            tried.append((label, round(t * 1e3, 1)))
            if label == "auto":
                auto = (t, err)
                kept = mod.kept() if hasattr(mod, "kept") else None
            if best is None or t < best[0]:
                best = (t, label, err)
        te = bench(eager)
        tc = bench(compiled)
        tl = lg_err = None
        lg = liger(name, c)
        if lg is not None:
            # Liger's cross-entropy may write into its input: it gets a copy of x of its own
            lin = {k: (v.clone() if k == "x" else v) for k, v in inputs.items()}
            try:
                lout = lg(*lin.values()).float()
                lg_err = ((lout - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                tl = bench(lambda: lg(*lin.values()))
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                lg_err = f"{type(exc).__name__}: {str(exc)[:80]}"
        if auto is None or best is None:
            print(f"{name} {r}x{c}: FAILED {tried}", flush=True)
            continue
        row = dict(workload=name, shape=[r, c], bytes=nbytes,
                   auto_us=auto[0] * 1e3, best_us=best[0] * 1e3, best=best[1], rel_err=auto[1],
                   eager_us=te * 1e3, compile_us=tc * 1e3, compile_s=ctime, kept=kept,
                   liger_us=tl * 1e3 if tl else None, liger_err=lg_err,
                   liger_gbs=nbytes / (tl * 1e-3) / 1e9 if tl else None,
                   auto_gbs=nbytes / (auto[0] * 1e-3) / 1e9, best_gbs=nbytes / (best[0] * 1e-3) / 1e9,
                   eager_gbs=nbytes / (te * 1e-3) / 1e9, compile_gbs=nbytes / (tc * 1e-3) / 1e9,
                   copy_gbs=copy, tried=tried)
        results.append(row)
        print(f"{name:14s} {r}x{c}: acefuse auto {row['auto_gbs']:7.0f} GB/s ({row['auto_gbs'] / copy:5.1%} of copy)"
              f" best {row['best_gbs']:7.0f} [{best[1]}] | eager {row['eager_gbs']:7.0f} | compile {row['compile_gbs']:7.0f}"
              f" | liger {row['liger_gbs'] or float('nan'):7.0f} | auto vs eager x{te / auto[0]:.2f}, vs compile "
              f"x{tc / auto[0]:.2f}" + (f", vs liger x{tl / auto[0]:.2f}" if tl else "")
              + f" | err {auto[1]:.1e} | kept {kept}", flush=True)
        print(f"    tried: {tried}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=props.name, copy_gbs=copy, matmul_tflops=mm, source=source,
                                                   torch=torch.__version__, triton=triton.__version__,
                                                   results=results), indent=1))
    print("\n| workload | rows x cols | acefuse GB/s (% copy) | kept | best variant GB/s | eager GB/s | "
          "torch.compile GB/s | Liger GB/s | vs eager | vs compile | vs Liger |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lg = f"{r['liger_gbs']:.0f}" if r["liger_gbs"] else "n/a"
        vl = f"{r['liger_us'] / r['auto_us']:.2f}" if r["liger_us"] else "n/a"
        print(f"| {r['workload']} | {r['shape'][0]}x{r['shape'][1]} | {r['auto_gbs']:.0f} ({r['auto_gbs'] / copy:.1%}) | "
              f"{r['kept']} | {r['best_gbs']:.0f} ({r['best']}) | {r['eager_gbs']:.0f} | {r['compile_gbs']:.0f} | {lg} | "
              f"{r['eager_us'] / r['auto_us']:.2f} | {r['compile_us'] / r['auto_us']:.2f} | {vl} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
