"""Per-token absmax quantization (examples/quant.py) on the GPU against torch eager and
torch.compile, in one run, on the same inputs, beside the measured copy bandwidth.

    python benchmarks/bench_quant.py [--rows 16384 --cols 8192] [--out results.json]
    python benchmarks/bench_quant.py --cpu-smoke      # tiny size through Triton's interpreter
    ACEFUSE_NATIVE=0 python benchmarks/bench_quant.py # the emulated casts on the GPU too (the
                                                      # interpreter's path), to compare

Timed through the generated module's own launcher (``run``), as the other benchmarks do.
Bytes counted per call (each input read once, each output written once): x (rows * cols *
its element size) + q (rows * cols, one byte for float8/int8) + scale (rows * 4). GB/s is
those bytes over the median time (triton.testing.do_bench). Before timing, the scale must
equal the IEEE float32 quotient (absmax / 448, or / 127) and q must be bit-exact with torch's
cast of x / scale. (Eager torch on CUDA divides by a Python scalar through its reciprocal,
which can be an ulp off the quotient; the script notes where.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from _common import timer

ROOT = Path(__file__).resolve().parents[1]


def eager_fp8(x):
    s = x.abs().amax(-1).float() / 448.0
    return (x.float() / s[:, None]).to(torch.float8_e4m3fn), s


def eager_int8(x):
    s = x.abs().amax(-1).float() / 127.0
    return (x.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8), s


def _quantize(qname, x, scale):
    """torch's cast of x / scale (tensor by tensor: IEEE division on CPU and CUDA)."""
    v = x.float() / scale[:, None]
    if qname == "int8":
        return torch.where(v.isnan(), 0.0, v.round().clamp(-127, 127)).to(torch.int8)
    return v.to(torch.float8_e4m3fn)


def programs():
    import runpy
    ns = runpy.run_path(str(ROOT / "examples" / "quant.py"))
    return {"fp8_e4m3": (ns["quant_fp8"], eager_fp8), "int8": (ns["quant_int8"], eager_int8)}




def copy_gbs(bench, dev, n):
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / (t * 1e-3) / 1e9


def variants(cols, dev):
    out = [("auto", {})]
    if dev == "cuda":
        bj = 1 << (cols - 1).bit_length()
        for br in (1, 2, 4):
            for nw in (4, 8, 16):
                if bj * br <= 65536:
                    out.append((f"single/r{br}/w{nw}", dict(schedule="single", block_r=br, num_warps=nw)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny size on the CPU (Triton's interpreter)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    if dev == "cpu":
        if not args.cpu_smoke:
            sys.exit("no CUDA GPU: run with --cpu-smoke for a functional check")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.rows, args.cols, args.no_compile = 8, 96, True
    sys.path.insert(0, str(ROOT))
    import acefuse as af
    bench = timer(dev)
    copy = copy_gbs(bench, dev, 1 << 29 if dev == "cuda" else 1 << 16)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    print(f"device {name}; measured copy {copy:.0f} GB/s (read + write, bfloat16, "
          f"{'1 GiB' if dev == 'cuda' else '128 KiB'})")
    rows_out = []
    for qname, (prog, eager) in programs().items():
        k = af.compile(prog)
        comp = None if args.no_compile else torch.compile(eager)
        for dname in args.dtypes.split(","):
            dt = getattr(torch, dname)
            g = torch.Generator(device=dev).manual_seed(args.rows + args.cols)
            x = (torch.randn(args.rows, args.cols, device=dev, generator=g) * 3).to(dt)
            nbytes = x.numel() * x.element_size() + x.numel() + args.rows * 4
            q_eager, s_eager = eager(x)
            # the reference: IEEE float32 (the float64 quotient rounded once), and q as torch
            # casts x / scale with that scale. torch's CUDA kernel divides by a Python scalar
            # through its reciprocal (amax * (1/448)), which is up to an ulp off; that is
            # reported, not used as the target
            div = 448.0 if qname == "fp8_e4m3" else 127.0
            s_ref = (x.abs().amax(-1).double() / div).float()
            q_ref = _quantize(qname, x, s_ref)
            n_off = int((s_eager != s_ref).sum())
            if n_off:
                print(f"  note: eager torch's scale is not the IEEE quotient in {n_off} of {s_ref.numel()} rows "
                      f"(max |diff| {(s_eager - s_ref).abs().max().item():.2e})")
            res = {}
            raw = getattr(getattr(k, "kernel", None), "module", None)   # the generated launcher, no wrappers
            for vname, kw in variants(args.cols, dev):
                call = (lambda kw=kw: raw.run(x=x, **kw)) if raw is not None else (lambda kw=kw: k(x=x, **kw))
                out = call()
                if not torch.equal(out["scale"], s_ref):
                    sys.exit(f"{qname}/{dname}/{vname}: scale differs from the IEEE quotient "
                             f"(max |diff| {(out['scale'] - s_ref).abs().max().item():.3e})")
                if not torch.equal(out["q"].view(torch.uint8), q_ref.view(torch.uint8)):
                    bad = int((out["q"].view(torch.uint8) != q_ref.view(torch.uint8)).sum())
                    sys.exit(f"{qname}/{dname}/{vname}: q differs from torch's cast of x / scale in {bad} elements")
                res[vname] = bench(call)
            t_eager = bench(lambda: eager(x))
            t_comp = None
            if comp is not None:
                qc, sc = comp(x)
                if not torch.equal(qc.view(torch.uint8), q_eager.view(torch.uint8)):
                    print(f"  note: torch.compile's q differs from eager in "
                          f"{int((qc.view(torch.uint8) != q_eager.view(torch.uint8)).sum())} elements")
                t_comp = bench(lambda: comp(x))
            best = min(res, key=res.get)
            gbs = lambda t: nbytes / (t * 1e-3) / 1e9   # noqa: E731
            row = dict(quant=qname, dtype=dname, rows=args.rows, cols=args.cols, bytes=nbytes,
                       auto_ms=res["auto"], auto_gbs=gbs(res["auto"]), best=best, best_ms=res[best],
                       best_gbs=gbs(res[best]), eager_ms=t_eager, eager_gbs=gbs(t_eager),
                       compile_ms=t_comp, compile_gbs=gbs(t_comp) if t_comp else None, copy_gbs=copy)
            rows_out.append(row)
            comp_txt = f"compile {row['compile_gbs']:7.0f} GB/s" if t_comp else "compile (skipped)"
            print(f"{qname:9s} {dname:9s} {args.rows}x{args.cols} ({nbytes / 1e6:.0f} MB): acefuse auto "
                  f"{row['auto_gbs']:7.1f} GB/s ({row['auto_gbs'] / copy:5.1%} of copy), best {best} "
                  f"{row['best_gbs']:7.1f} GB/s ({row['best_gbs'] / copy:5.1%}); eager {row['eager_gbs']:7.1f} GB/s; "
                  f"{comp_txt}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, copy_gbs=copy, rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
