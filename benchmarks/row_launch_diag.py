"""Where the row workloads' forward+backward time goes on a GPU, with the row launchers' size
heuristics ("heuristic") and with their timed launch choice ("timed", codegen/row_tuning.py),
measured in one process, alternately, next to Liger-Kernel:

    python benchmarks/row_launch_diag.py [--budget 250] [--out diag.json]

Per case: ms per forward+backward step (CUDA events, the calls queued behind a sleep: a
host slower than the GPU shows), the host's microseconds per step, the GPU kernels of one
step (torch.profiler: name -> calls, ms) and the timed launch options. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
import bench_training as B   # noqa: E402

CASES = [("softmax", 16384, 8192), ("layernorm", 16384, 8192), ("rmsnorm", 16384, 8192),
         ("cross_entropy", 8192, 128256), ("softmax", 32768, 4096), ("layernorm", 32768, 4096),
         ("rmsnorm", 32768, 4096)]


def gpu_ms(fn, n=20, rounds=3):
    """Best of ``rounds``: ms per call of ``n`` calls queued behind a 1 ms sleep."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / n)
    return round(best, 4)


def host_us(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(h, 1)


def kernels_of_step(step, n=3):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    agg = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) or 0
            a = agg.setdefault(e.name[:80], [0, 0.0])
            a[0] += 1
            a[1] += t / 1000
    return {k: [c / n, round(t / n, 4)] for k, (c, t) in agg.items()}


def row_modules(dk):
    """The generated row-family modules behind an af.compile kernel (forward, augmented
    forward, unit-gradient stages, backward stages)."""
    ks = [getattr(dk, "kernel", None), getattr(dk, "_aug", None), getattr(dk, "_unit", None)]
    ks += list(getattr(getattr(dk, "_bwd_kernel", None), "kernels", None) or [])
    mods = []
    for k in ks:
        for part in (k, getattr(k, "stage1", None), getattr(k, "stage2", None)):
            m = getattr(part, "module", None)
            if m is not None and hasattr(m, "TUNE_MIN") and m not in mods:
                mods.append(m)
    return mods


def set_mode(dk, timed, default_min):
    """Heuristic launches (timing off) or timed ones; plans and ride choices forgotten."""
    for m in row_modules(dk):
        m.TUNE_MIN = default_min if timed else float("inf")
        m._PLANS.clear()
    bk = getattr(dk, "_bwd_kernel", None)
    if bk is not None:
        bk._ride_choice.clear()
        bk.ride_times.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=250.0, help="seconds; stops starting cases after")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "row_launch_diag.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    t0 = time.time()
    af = B._acefuse()[0]
    res = {"device": torch.cuda.get_device_name(), "cases": {}}
    x = torch.empty(16384 * 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    res["copy_256MB_ms"] = gpu_ms(lambda: y.copy_(x))
    del x, y
    compiled = {}
    for name, R, C in CASES:
        if time.time() - t0 > args.budget:
            break
        key = f"{name} {R}x{C}"
        r = res["cases"][key] = {}
        prog, _, liger_name = B.row_workloads()[name]
        ins, wrt, cot = B.row_inputs(name, prog, R, C, "cuda", torch.bfloat16)
        dk = compiled.setdefault(name, af.compile(prog))
        leaves = B.fresh(ins, wrt)
        step = lambda: B.step(dk, leaves, wrt, cot)   # noqa: E731
        t = time.time()
        step()
        torch.cuda.synchronize()
        r["first_call_s"] = round(time.time() - t, 1)
        default_min = row_modules(dk)[0].TUNE_MIN
        lig = B.liger_peer(name, liger_name)
        lleaves = B.fresh(ins, wrt)
        for rnd in range(2):
            for mode in ("heuristic", "timed"):
                set_mode(dk, mode == "timed", default_min)
                t = time.time()
                step()
                torch.cuda.synchronize()
                m = r.setdefault(mode, {"first_call_s": round(time.time() - t, 1)})
                m.setdefault("ms", []).append(gpu_ms(step, 10))
                m.setdefault("host_us", []).append(host_us(step))
                if rnd == 0:
                    m["kernels"] = kernels_of_step(step)
                    bk = getattr(dk, "_bwd_kernel", None)
                    m["ride_times"] = {str(k[0]): v for k, v in (bk.ride_times if bk else {}).items()}
                    m["choices"] = {mm.PROGRAM: {repr(k): v for k, v in mm._CHOSEN.items()}
                                    for mm in row_modules(dk) if mm._CHOSEN}
            if not isinstance(lig, str):
                r.setdefault("liger_ms", []).append(gpu_ms(lambda: B.step(lig, lleaves, wrt, cot), 10))
        set_mode(dk, True, default_min)
        print(key, json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items()
                                                                       if kk != "kernels"})
                               for k, v in r.items()}), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    res["elapsed_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print("wrote", args.out, "in", res["elapsed_s"], "s")


if __name__ == "__main__":
    main()
