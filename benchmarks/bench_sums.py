"""The derived attention backward, stage by stage: the sum kernels (codegen/sums.py) with their
automatic launch configuration and a sweep of explicit ones, against SDPA's flash and cuDNN
backward in the same run.

    python benchmarks/bench_sums.py [--programs attention,causal] [--size 4,16,4096,128]
                                    [--sweep pruned|all|none] [--out f.json]
    TRITON_INTERPRET=1 python benchmarks/bench_sums.py --cpu-smoke [--out f.json]

What runs: ``af.compile(af.backward(prog))`` for the programs of examples/attention.py (global
and causal), bf16, B=4 H=16 N=4096 D=128 by default. Its forward (``bwd.augmented``, also
compiled by acefuse) gives the saved values; the cotangent is random. The stages run in order,
each stage's outputs feeding the later ones (a pre-stage, if af.backward makes one), exactly the
inputs the BackwardKernel gives them.

Per stage: the automatic choice (the first call times the candidates ``configs()`` keeps, then
the timed call reuses the choice; the chosen configuration is reported), then each explicit
configuration of the sweep: ``pruned`` the candidates the estimate keeps (compiled already by
the automatic choice), ``all`` every combination of BLOCK_I_CHOICES x BLOCK_J_CHOICES x
WARPS_CHOICES x STAGES_CHOICES, the ones the estimate prunes marked (a failure is recorded,
not raised: that is what the estimate predicts), ``none``. Plus ``default``: the untimed
configuration a GPU run gets below TUNE_MIN (block_i 128, block_j 64, 4 warps for 16-bit
inputs). Each explicit configuration's output is checked against the automatic choice's.

FLOPs (written down, counted from the generated module): each ``tl.dot`` of a loop tile is a
[rows x tile] by [tile x axis] (or [rows x axis] by [axis x tile]) product, 2 * rows * tile *
axis FLOPs; over the whole loop 2 * n_rows * n_loop * n_grid * len(axis) per dot
(``DOTS`` lists each dot's axis: dQ has 3 dots, S = Q K^T, dP = dO V^T and dQ += dS K; dK/dV
has 4, S^T, dP^T, dK += dS^T Q and dV += P^T dO). Causal: half of that (the triangle the mask
analysis visits; the diagonal tiles it also visits are not counted). The whole backward is
also rated by the FlashAttention convention, 2.5x the forward's 4*B*H*N*N*D (halved for
causal): the 5 matmuls of a fused backward, the same count SDPA's rows use, so the rates
compare. Run apart, acefuse's two stages execute 7 matmuls for those 5; when the stage of sums
over keys rides the pass over queries (codegen/riders.py: dQ's tiles added with atomic adds in
the dK/dV pass), the backward executes 5. A host stage is timed both ways: alone (its own
outputs) and ``with_riders`` (the riding stage's outputs too; its FLOPs include the riders'
dots), and the riding stage alone; ``backward`` is the BackwardKernel's call (riders on).

Correctness: the whole backward's gradients against SDPA's (flash, else math) in bf16, norm-
relative error <= 3e-2 (bench_training's tolerance); a wrong result is reported and not timed.

``--cpu-smoke``: B=1 H=2 N=40 D=16, float32, Triton's interpreter, no timing: every stage runs
(automatic and a few explicit configurations) and the gradients must match float64 torch
autograd (max error <= 1e-4 of the largest entry). Exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

TOL_GPU = 3e-2       # norm-relative, bf16 against SDPA bf16
TOL_CPU = 1e-4       # max error / max |reference|, float32 against float64
TOL_CFG = 1e-2       # an explicit configuration against the automatic one (same dtype)


def _acefuse():
    try:
        import acefuse as af
        import attention as A
    except ImportError as exc:  # pragma: no cover - a setup error, say how to fix it
        sys.exit(f"bench_sums: cannot import acefuse or examples/attention.py ({exc}); run "
                 "`pip install --no-deps -e .` in the repository root")
    return af, A


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _as_dict(out, names):
    return out if isinstance(out, dict) else {names[0]: out}


def _stage_sizes(mod, kin):
    sizes = {}
    for t, axes in mod.TENSORS.items():
        if t in kin:
            for a, n in zip(axes, kin[t].shape):
                sizes[a] = n
    return sizes


def stage_flops(mod, kin, causal, riders=False):
    """FLOPs of one run of a sum-kernel stage (module docstring), or None for another kernel;
    ``riders``: with the per-tile dots of the stages riding its pass (RIDER_ACC)."""
    dots = getattr(mod, "DOTS", None)
    if dots is None:
        return None
    if riders:
        dots = list(dots) + [a for a in getattr(mod, "RIDER_ACC", []) if a]
    s = _stage_sizes(mod, kin)
    n = s[mod.AXIS]
    for a in list(mod.ROW_AXES) + list(mod.GRID_AXES):
        n *= s[a]
    f = sum(2 * n * s[a] for a in dots)
    return f * (0.5 if causal else 1.0)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _maxrel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _sdpa_grads(q, k, v, go, causal, backend=None):
    from torch.nn.attention import sdpa_kernel
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if backend is None:
        o = F.scaled_dot_product_attention(*x, is_causal=causal)
    else:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(*x, is_causal=causal)
    return o, x


def _sdpa_row(q, k, v, go, causal, backend, timer):
    """SDPA's backward alone (the forward outside the timing), ms."""
    from torch.nn.attention import sdpa_kernel
    try:
        with sdpa_kernel(backend):
            o, x = _sdpa_grads(q, k, v, go, causal)
            g = torch.autograd.grad(o, x, go, retain_graph=True)
            ms = timer(lambda: torch.autograd.grad(o, x, go, retain_graph=True))
        return {"ms": ms}, g
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}, None


def _timer(cpu):
    if cpu:
        def wall(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return wall
    from _common import bench
    return lambda fn: bench(fn, rep=200, warmup=25)


def run_program(af, A, name, size, dtype, dev, sweep, timer, cpu):
    B, H, N, D = size
    causal = name == "causal"
    prog = getattr(A, name)
    row = {"program": name, "size": [B, H, N, D], "dtype": str(dtype).replace("torch.", ""), "stages": []}
    t0 = time.perf_counter()
    bwd = af.backward(prog)
    bk = af.compile(bwd)
    fwd = af.compile(bwd.augmented)
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["stage_names"] = [s.name for s in bwd.stages]
    hosts = {}
    if hasattr(bk, "_riders"):
        row["riders"] = {bwd.stages[b].name: bwd.stages[a].name for b, a in bk._riders.items()}
        hosts = set(bk._riders.values())
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(dev, dtype) for _ in range(3))
    aug = fwd(q=q, k=k, v=v)
    aug = aug if isinstance(aug, dict) else {next(iter(bwd.augmented.outputs)): aug}
    go = torch.randn(B, H, N, D, generator=g).to(dev, dtype)
    inputs = {"q": q, "k": k, "v": v, "grad_o": go, **{n: aug[n] for n in bwd.saved}}
    inputs = {n: inputs[n] for n in bwd.tensors if n in inputs}

    # correctness of the whole backward first (no timing of a wrong result)
    grads = bk(**inputs)
    if cpu:
        x = [t.double().requires_grad_() for t in (q, k, v)]
        s = x[0] @ x[1].transpose(-1, -2) * A.SCALE
        if causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
        o = torch.softmax(s, -1) @ x[2]
        ref = torch.autograd.grad(o, x, go.double())
        errs = {f"grad_{n}": _maxrel(grads[f"grad_{n}"], r) for n, r in zip("qkv", ref)}
        tol = TOL_CPU
    else:
        o, x = _sdpa_grads(q, k, v, go, causal)
        ref = torch.autograd.grad(o, x, go)
        errs = {f"grad_{n}": _rel(grads[f"grad_{n}"], r) for n, r in zip("qkv", ref)}
        tol = TOL_GPU
    row["errors"] = errs
    row["correct"] = all(e <= tol for e in errs.values())
    if not row["correct"]:
        row["failure"] = f"gradient error above {tol}: {errs}"
        return row

    # the stages, in order, each one's outputs available to the later ones
    avail = dict(inputs)
    total = 0.0
    for si, (st, kern) in enumerate(zip(bwd.stages, bk.kernels)):
        mod = kern.module
        kin = {n: avail[n] for n in st.tensors}
        onames = list(st.outputs)
        srow = {"stage": st.name, "outputs": onames, "sum_kernel": hasattr(mod, "BLOCK_I_CHOICES")}
        flops = stage_flops(mod, kin, causal)
        srow["flops"] = flops
        t = time.perf_counter()
        auto = _as_dict(kern(**kin), onames)   # the first call: times the candidates on a GPU
        _sync()
        srow["first_call_s"] = round(time.perf_counter() - t, 2)
        if srow["sum_kernel"] and getattr(mod, "_TUNED", None):
            srow["auto_config"] = next((c for k2, c in reversed(list(mod._TUNED.items())) if not k2[-1]), None)
        ms = timer(lambda: kern(**kin))
        srow["auto"] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12 if flops and ms else None}
        total += ms
        if si in hosts:   # the same pass with the riding stages' outputs too
            rflops = stage_flops(mod, kin, causal, riders=True)
            kern(**kin, riders=True)   # the first call: times the candidates with riders on a GPU
            _sync()
            rms = timer(lambda: kern(**kin, riders=True))
            srow["with_riders"] = {"ms": rms, "tflops": rflops / (rms * 1e-3) / 1e12 if rflops and rms else None,
                                   "riders": list(getattr(mod, "RIDERS", {}))}
            if getattr(mod, "_TUNED", None):
                srow["with_riders"]["config"] = next((c for k2, c in mod._TUNED.items() if k2[-1]), None)
            print(f"  {name} {st.name} with riders {srow['with_riders']['riders']}: {rms:.3f} ms"
                  + (f" ({srow['with_riders']['tflops']:.1f} TFLOP/s)" if srow["with_riders"]["tflops"] else "")
                  + (f" config {srow['with_riders'].get('config')}" if srow["with_riders"].get("config") else ""),
                  flush=True)
        if srow["sum_kernel"]:
            srow["sweep"] = _sweep(mod, kern, kin, onames, auto, flops, sweep, timer, cpu)
        avail.update(auto)
        row["stages"].append(srow)
        print(f"  {name} {st.name}: auto {ms:.3f} ms" + (f" ({srow['auto']['tflops']:.1f} TFLOP/s)"
              if srow["auto"]["tflops"] else "") + (f" config {srow.get('auto_config')}" if "auto_config" in srow else ""),
              flush=True)
    row["stages_ms"] = total
    ms = timer(lambda: bk(**inputs))
    fa = 2.5 * 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    row["backward"] = {"ms": ms, "tflops_fa_convention": fa / (ms * 1e-3) / 1e12 if ms else None}
    if getattr(bk, "_riders", None):   # the timed choice (ms with riders, apart), then each forced
        row["ride_times"] = {str(key[0]): list(t) for key, t in bk.ride_times.items()}
        policy = bk.ride_policy
        for label, p in (("backward_riders", True), ("backward_apart", False)):
            bk.ride_policy = p
            bk(**inputs)
            row[label] = {"ms": timer(lambda: bk(**inputs))}
        bk.ride_policy = policy
        tma = [getattr(bk.kernels[h].module, "TMA_ERRORS", []) for h in set(bk._riders.values())]
        row["tma_errors"] = [e for t in tma for e in t]
        print(f"  {name} backward: timed choice {row['ride_times']} (ms with riders, apart); forced riders "
              f"{row['backward_riders']['ms']:.3f} ms, apart {row['backward_apart']['ms']:.3f} ms"
              + (f"; TMA errors {row['tma_errors']}" if row["tma_errors"] else ""), flush=True)
    if not cpu:
        from torch.nn.attention import SDPBackend
        for label, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            r, gr = _sdpa_row(q, k, v, go, causal, be, timer)
            if "ms" in r:
                r["tflops_fa_convention"] = fa / (r["ms"] * 1e-3) / 1e12
                r["ratio_vs_acefuse"] = r["ms"] / ms   # > 1: acefuse faster
            row[label] = r
    return row


def _sweep(mod, kern, kin, onames, auto, flops, sweep, timer, cpu):
    if sweep == "none":
        return []
    if cpu:   # the interpreter: a few explicit tile shapes (num_warps/stages mean nothing there)
        cands = [dict(block_i=16, block_j=16, num_warps=4, num_stages=1),
                 dict(block_i=32, block_j=16, num_warps=4, num_stages=2),
                 dict(block_i=16, block_j=32, num_warps=4, num_stages=3)]
        kept = cands
    else:
        s = _stage_sizes(mod, kin)
        vs = {a: max(16, mod._np2(s[a])) for a in mod.VEC_AXES}
        item = next(iter(kin.values())).element_size()
        kept = mod.configs(vs, item, mod._smem_limit(next(iter(kin.values())).device))
        every = [dict(block_i=a, block_j=b, num_warps=w, num_stages=n) for a in mod.BLOCK_I_CHOICES
                 for b in mod.BLOCK_J_CHOICES for w in mod.WARPS_CHOICES for n in mod.STAGES_CHOICES]
        cands = every if sweep == "all" else kept
        cands = [dict(block_i=128, block_j=64, num_warps=4, num_stages=None, default=True)] + cands
    out = []
    for cfg in cands:
        c = {k2: v for k2, v in cfg.items() if k2 != "default"}
        r = {"config": cfg, "pruned": cfg not in kept and not cfg.get("default")}
        if not cpu:
            r["estimate"] = dict(zip(("regs", "smem"), mod.estimate(
                dict(c, num_stages=c["num_stages"] or 1), vs, item)))
        try:
            got = _as_dict(kern(**kin, **c), onames)
            _sync()
            err = max(_maxrel(got[o], auto[o]) for o in onames)
            r["err_vs_auto"] = err
            if err > TOL_CFG:
                r["failure"] = f"differs from the automatic configuration's output by {err:.3g}"
            else:
                ms = timer(lambda: kern(**kin, **c))
                r["ms"] = ms
                r["tflops"] = flops / (ms * 1e-3) / 1e12 if flops and ms else None
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        out.append(r)
        if not cpu:
            print(f"    {cfg}: " + (f"{r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s" if "ms" in r
                                    else r.get("failure") or r.get("error")), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="attention,causal")
    ap.add_argument("--size", default="4,16,4096,128", help="B,H,N,D")
    ap.add_argument("--sweep", choices=("pruned", "all", "none"), default="pruned")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("bench_sums --cpu-smoke needs TRITON_INTERPRET=1")
        size, dtype, dev = (1, 2, 40, 16), torch.float32, "cpu"
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_sums: no CUDA GPU (use --cpu-smoke for the interpreter run)")
        size, dtype, dev = tuple(int(x) for x in args.size.split(",")), torch.bfloat16, "cuda"
    af, A = _acefuse()
    timer = _timer(cpu)
    summary = {"device": torch.cuda.get_device_name() if not cpu else "cpu (Triton interpreter)",
               "torch": torch.__version__, "triton": __import__("triton").__version__,
               "sweep": args.sweep, "programs": []}
    failed = False
    for name in args.programs.split(","):
        print(f"{name} {size} {dtype}", flush=True)
        try:
            row = run_program(af, A, name, size, dtype, dev, args.sweep, timer, cpu)
        except Exception as exc:
            traceback.print_exc()
            row = {"program": name, "failure": f"{type(exc).__name__}: {str(exc)[:500]}"}
        failed |= "failure" in row or any("failure" in r for s in row.get("stages", []) for r in s.get("sweep", []))
        summary["programs"].append(row)
        if "backward" in row:
            b = row["backward"]
            line = f"  {name} backward: {b['ms']:.3f} ms ({b['tflops_fa_convention']:.1f} TFLOP/s, FA convention)"
            for label in ("sdpa_flash", "sdpa_cudnn"):
                r = row.get(label, {})
                if "ms" in r:
                    line += f"; {label} {r['ms']:.3f} ms ({r['tflops_fa_convention']:.1f})"
            print(line, flush=True)
        elif "failure" in row:
            print(f"  {name}: FAILED {row['failure']}", flush=True)
    text = json.dumps(summary, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    if failed:
        print("bench_sums: FAILURES (see above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
