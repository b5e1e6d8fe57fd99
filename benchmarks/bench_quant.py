"""Per-token absmax quantization (examples/quant.py) on the GPU against torch eager and
torch.compile, in one run, on the same inputs, beside the measured copy bandwidth.

    python benchmarks/bench_quant.py [--rows 16384 --cols 8192] [--out results.json]
    python benchmarks/bench_quant.py --cpu-smoke      # tiny size through Triton's interpreter
    python benchmarks/bench_quant.py --part gemm [--gemm-n 128,4096,8192] [--dtypes bfloat16]
                                                      # quantization feeding a GEMM (af.gemm):
                                                      # both forms (and launch candidates of the
                                                      # prologue form), the automatic (measured)
                                                      # choice, eager quantize + _scaled_mm,
                                                      # torch.compile of it; TFLOP/s = 2 t n k /
                                                      # time, the cost model's bytes per form
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


# ---- --part gemm: per-token quantization feeding a GEMM (examples/quant.py fp8_linear, af.gemm) ----
def eager_fp8_linear(x, wq, ws, out_dtype):
    """torch as one writes it: quantize x per token, then torch._scaled_mm (where it cannot run,
    the float32 matmul of the float8 values, as af.gemm's scaled_mm form does)."""
    s = x.abs().amax(-1).float() / 448.0
    q = (x.float() / s[:, None]).to(torch.float8_e4m3fn)
    if x.is_cuda:
        return torch._scaled_mm(q, wq.t(), scale_a=s[:, None], scale_b=ws[None, :], out_dtype=out_dtype)
    return ((q.float() @ wq.float().t()) * s[:, None] * ws[None, :]).to(out_dtype)


def check_gemm(what, out, x, wq, ws, rows, fatal=True):
    """``out[:rows]`` against a float64 matmul of the dequantized float8 values (the IEEE scale,
    torch's cast of x / scale): |err| <= 2 K 2^-24 sum|q w| s ws + (4 2^-24 + the output's
    rounding) |ref| (float32 accumulation, the epilogue's products, the output's rounding)."""
    xs = x[:rows]
    s = (xs.double().abs().amax(1) / 448.0).float()
    q = (xs.float() / s[:, None]).to(torch.float8_e4m3fn).double()
    w = wq.double()
    sc = s.double()[:, None] * ws.double()[None, :]
    ref = (q @ w.t()) * sc
    tol = 2 * x.shape[1] * 2.0 ** -24 * ((q.abs() @ w.abs().t()) * sc) \
        + (4 * 2.0 ** -24 + {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}[out.dtype]) * ref.abs()
    bad = int(((out[:rows].double() - ref).abs() > tol).sum())
    if bad:
        msg = (f"{what}: {bad} of {ref.numel()} checked outputs differ from the float64 matmul of the "
               f"dequantized values beyond the float32 accumulation bound")
        if fatal:
            sys.exit(msg)
        # eager torch on CUDA divides by a Python scalar through its reciprocal (module docstring):
        # a scale an ulp off moves some q by one float8 step; reported, not fatal
        print(f"  note: {msg}")


def gemm_part(args, dev, bench, name):
    import acefuse as af
    import runpy
    prog = runpy.run_path(str(ROOT / "examples" / "quant.py"))["fp8_linear"]
    g = af.gemm(prog)
    t, k = args.rows, args.cols
    ns = [int(v) for v in args.gemm_n.split(",")]
    rows_out = []
    comp = None if args.no_compile else torch.compile(eager_fp8_linear)
    from acefuse.quant_gemm import PROLOGUE_CONFIGS
    # the prologue form at its default (the first candidate) and each launch candidate the
    # automatic choice times, plus one more tile shape
    blocks = [None] + (list(PROLOGUE_CONFIGS) + [(128, 256, 64, 8, 3)] if dev == "cuda" else [])
    for dname in args.dtypes.split(","):
        dt = getattr(torch, dname)
        for n in ns:
            gen = torch.Generator(device=dev).manual_seed(t + k + n)
            x = (torch.randn(t, k, device=dev, generator=gen) * 3).to(dt)
            w = torch.randn(n, k, device=dev, generator=gen)
            ws = (w.abs().amax(1).double() / 448.0).float()
            wq = (w / ws[:, None]).to(torch.float8_e4m3fn)
            w = None
            inputs = dict(x=x, wq=wq, ws=ws)
            flops = 2 * t * n * k
            form, costs, why = g.choose(t, n, k, {"x": dt, "wq": wq.dtype, "ws": ws.dtype}, 2 if dt != torch.float32 else 4,
                                        cuda=dev == "cuda", device=x.device if dev == "cuda" else None)
            auto = None
            if dev == "cuda":   # the automatic choice: times the forms once for this key, keeps the fastest
                ga = af.gemm(prog)
                check_gemm(f"{dname} n={n} auto", ga(**inputs)["out"], x, wq, ws, min(t, 256))
                best, times = ga.measured(**inputs)
                auto = dict(best=list(best[:1]) + [list(best[1]) if best[1] else None],
                            times={str(c): ms for c, ms in times.items()})
            res = {}
            for f in ("scaled_mm", "prologue"):
                for blk in (blocks if f == "prologue" else [None]):
                    gg = g if blk is None else af.gemm(prog, block=blk)
                    label = f if blk is None else f"{f}/{'x'.join(map(str, blk))}"
                    call = (lambda gg=gg, f=f: gg(form=f, **inputs)["out"])
                    out = call()
                    check_gemm(f"{dname} n={n} {label}", out, x, wq, ws, min(t, 256))
                    res[label] = (bench(call), gg.last_path)
            t_eager = t_comp = None
            try:
                e_out = eager_fp8_linear(x, wq, ws, dt)
            except RuntimeError as exc:   # e.g. row-wise _scaled_mm with float32 output on some torch versions
                print(f"  note: eager quantize + _scaled_mm with {dname} output: {str(exc).splitlines()[0]}; "
                      "eager and torch.compile not timed")
            else:
                check_gemm(f"{dname} n={n} eager", e_out, x, wq, ws, min(t, 256), fatal=False)
                t_eager = bench(lambda: eager_fp8_linear(x, wq, ws, dt))
            if comp is not None and t_eager is not None:
                check_gemm(f"{dname} n={n} torch.compile", comp(x, wq, ws, dt), x, wq, ws, min(t, 256), fatal=False)
                t_comp = bench(lambda: comp(x, wq, ws, dt))
            tf = lambda ms: flops / (ms * 1e-3) / 1e12   # noqa: E731
            best_pro = min((l for l in res if l.startswith("prologue")), key=lambda l: res[l][0])
            row = dict(part="gemm", dtype=dname, t=t, k=k, n=n, flops=flops, chosen=form, why=why, auto=auto,
                       model_bytes={c.form: c.hbm_bytes for c in costs.values()},
                       model_l2_bytes={c.form: c.l2_bytes for c in costs.values()},
                       forms={l: dict(ms=v[0], tflops=tf(v[0]), path=v[1]) for l, v in res.items()},
                       eager_ms=t_eager, eager_tflops=tf(t_eager) if t_eager else None, compile_ms=t_comp,
                       compile_tflops=tf(t_comp) if t_comp else None)
            rows_out.append(row)
            print(f"gemm {dname} t={t} k={k} n={n}: model chose {form} ({why})"
                  + (f"; measured choice {auto['best']}" if auto else ""))
            for c in costs.values():
                print(f"    model {c.form:9s}: {c.hbm_bytes / 1e6:10.2f} MB HBM"
                      + (f" + {c.l2_bytes / 1e6:.2f} MB L2" if c.l2_bytes else "") + f", {c.flops / 1e9:.1f} GFLOP")
            for l, v in res.items():
                print(f"    acefuse {l:22s} {v[0]:9.3f} ms {tf(v[0]):8.1f} TFLOP/s  ({v[1]})")
            print((f"    eager (quantize + _scaled_mm) {t_eager:9.3f} ms {tf(t_eager):8.1f} TFLOP/s; " if t_eager
                   else "    eager (not timed); ")
                  + (f"torch.compile {t_comp:9.3f} ms {tf(t_comp):8.1f} TFLOP/s" if t_comp else "torch.compile (skipped)")
                  + f"; best prologue blocks {best_pro}; the model's form measured "
                  f"{'faster' if res[form][0] <= min(res['scaled_mm'][0], res['prologue'][0]) else 'slower'} "
                  "than the other at default blocks")
    return rows_out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("quant", "gemm", "all"), default="quant",
                    help="quant: the quantization kernels; gemm: quantization feeding a GEMM (af.gemm)")
    ap.add_argument("--gemm-n", default="128,4096,8192", help="--part gemm: the GEMM's n values")
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
        args.rows, args.cols, args.no_compile = (8, 96, True) if args.part == "quant" else (37, 80, True)
        if args.part != "quant":
            args.gemm_n = "48,16"
    sys.path.insert(0, str(ROOT))
    import acefuse as af
    bench = timer(dev)
    copy = copy_gbs(bench, dev, 1 << 29 if dev == "cuda" else 1 << 16)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    print(f"device {name}; measured copy {copy:.0f} GB/s (read + write, bfloat16, "
          f"{'1 GiB' if dev == 'cuda' else '128 KiB'})")
    rows_out = []
    if args.part in ("gemm", "all"):
        rows_out += gemm_part(args, dev, bench, name)
    for qname, (prog, eager) in (programs().items() if args.part != "gemm" else ()):
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
