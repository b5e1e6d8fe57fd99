"""Forward+backward (training) benchmark: acefuse's differentiable kernels against their
peers, in one run, on the same inputs (bf16 on a GPU).

    python benchmarks/bench_training.py [--part attention|rows|all] [--quick] [--out f.json]
    TRITON_INTERPRET=1 python benchmarks/bench_training.py --cpu-smoke

- attention, B=4 H=16 N=4096 D=128, global and causal: ``af.compile`` of the programs in
  examples/attention.py (differentiable through acefuse/autograd.py) against SDPA's flash
  and cuDNN backends and FlexAttention (``torch.compile(flex_attention)``, causal block
  mask). TFLOP/s count 3.5x the forward's FLOPs (forward = 4*B*H*N*N*D, halved for causal).
- rows: softmax, layernorm (weight and bias), RMSNorm (weight) at 16384x8192 and
  32768x4096, cross-entropy (mean over rows of logsumexp - x[target]) at 8192x128256,
  from examples/softmax.py and examples/norms.py, against eager torch, torch.compile
  (inductor) and Liger-Kernel. GB/s count 5 passes over the tensor (forward: read x, write
  y; backward: read x, read dy, write dx), 3 for cross-entropy (read x; read x, write dx).

One timed step is the forward and ``torch.autograd.grad`` of its output with a fixed random
cotangent (no gradient accumulation). Each implementation's output and gradients are
checked before it is timed: on the GPU against SDPA (attention, bf16) or against eager torch
in float32 from the same bf16 inputs (rows); a wrong result is reported, never timed, and
so is an acefuse kernel whose gradient fell back to torch autograd (``grad_fallback`` /
``GradientFallbackWarning``). A failing implementation is reported in its row; the others
still run. Ratios are ``peer ms / acefuse ms`` (> 1: acefuse is faster). Liger's RMSNorm
runs with ``in_place=False`` (the cotangent is reused across timed steps); its
cross-entropy writes dx into x, so every implementation gets its own copy of the inputs.

``--cpu-smoke``: tiny sizes, float32, no timing, through Triton's interpreter: every acefuse
path (each program, the automatic and the rolling-loop schedule; the two-stage
cross-entropy kernel ignores the schedule option) runs forward and backward and must match
float64 torch, and so must eager torch; peers that need CUDA are skipped. Exits 1 on any
failure.

acefuse must be importable (``pip install --no-deps -e .`` in the repository root) and
compiles its kernels on first use into ``$ACEFUSE_CACHE_DIR`` (default ~/.cache/acefuse).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import bench, ceilings

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

# tolerances: (norm-relative, max-relative) error of every output and gradient
TOL_GPU = (3e-2, 6e-2)     # bf16 against SDPA bf16 / eager float32
TOL_CPU = (1e-4, 1e-4)     # float32 against float64
ATTN_SIZE = (4, 16, 4096, 128)
ROW_SIZES = [(16384, 8192), (32768, 4096)]
CE_SIZE = (8192, 128256)
DEVICE = "cuda"            # the timed run's device (the smoke runs on the CPU)


def _acefuse():
    try:
        import acefuse as af
        import attention as A
        import norms as N
        import softmax as S
    except ImportError as exc:  # pragma: no cover - a setup error, say how to fix it
        sys.exit(f"bench_training: cannot import acefuse or the example programs ({exc}); run "
                 "`pip install --no-deps -e .` in the repository root (egglog must be installed)")
    return af, A, N, S


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- one training step, checked then timed ----------------------------------------------------------
def fresh(args, wrt, dtype=None):
    """New leaves for one implementation (Liger's cross-entropy writes its gradient into x)."""
    out = {}
    for n, v in args.items():
        v = v.detach().clone()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[n] = v.requires_grad_(n in wrt)
    return out


def step(fn, leaves, wrt, cot):
    out = fn(**leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in wrt], cot)
    return [out, *grads]


def errors(got, ref, names):
    """Per tensor: max abs error, norm-relative and max-relative error (against ``ref``)."""
    res = {}
    if not len(got) == len(ref) == len(names):
        return {"count": dict(shape=len(got), want=len(ref))}
    for n, a, b in zip(names, got, ref):
        if a is None or tuple(a.shape) != tuple(b.shape):
            res[n] = dict(shape=None if a is None else list(a.shape), want=list(b.shape))
            continue
        wide = torch.float64 if a.device.type == "cpu" else torch.float32   # GPU: 8192x128256 fits
        a, b = a.detach().to(wide), b.detach().to(wide)
        d = a - b
        bad = not bool(torch.isfinite(a).all())
        res[n] = dict(max_abs=float(d.abs().max()) if not bad else math.inf,
                      norm_rel=float(d.norm() / b.norm().clamp_min(1e-30)) if not bad else math.inf,
                      max_rel=float(d.abs().max() / b.abs().max().clamp_min(1e-30)) if not bad else math.inf)
    return res


def within(errs, tol):
    return all("max_abs" in e and e["norm_rel"] <= tol[0] and e["max_rel"] <= tol[1] for e in errs.values())


def run_impls(impls, args, wrt, cot, ref, tol, rep, dtype=None):
    """Check each implementation against ``ref`` (output, then one gradient per ``wrt``),
    then time it when ``rep`` is given. Failures are recorded, never raised."""
    names = ["out"] + [f"grad_{n}" for n in wrt]
    res = {}
    for name, fn in impls.items():
        r = res[name] = {}
        if isinstance(fn, str):            # a peer that cannot run here: the reason
            r.update(status="skipped", reason=fn)
            continue
        leaves = None
        try:
            leaves = fresh(args, wrt, dtype)
            t0 = time.time()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = step(fn, leaves, wrt, cot)
                sync()
            r["first_call_s"] = round(time.time() - t0, 2)
            if caught:
                r["warnings"] = list(dict.fromkeys(f"{w.category.__name__}: {str(w.message)[:500]}"
                                                   for w in caught))[:8]
            r["errors"] = errors(got, ref, names)
            del got
            if not within(r["errors"], tol):
                r["status"] = "WRONG"
                continue
            probe = getattr(fn, "fallback", None)   # acefuse: did any part run in torch instead?
            reason = probe and (probe() or next((w for w in r.get("warnings", ())
                                                 if w.split(":")[0].endswith("FallbackWarning")), None))
            if reason:   # timing it would not time acefuse
                r.update(status="fallback", error=reason)
                continue
            r["status"] = "ok"
            if rep:
                r["ms"] = bench(lambda: step(fn, leaves, wrt, cot), rep)
        except Exception as exc:  # noqa: BLE001 - one failing implementation must not stop the run
            r.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
        finally:
            leaves = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return res


def max_err(r, key="max_abs"):
    """The largest error over the output and the gradients (``max_rel``: each relative to
    its tensor's largest magnitude)."""
    e = r.get("errors") or {}
    return max((v.get(key, math.inf) for v in e.values()), default=math.nan)


def err_text(r):
    return f"max err {max_err(r):.2e} (rel {max_err(r, 'max_rel'):.1e})"


def why(r):
    return r.get("error") or r.get("reason") or json.dumps(r.get("errors"))


def acefuse_impl(af, prog, kernels, run_kw=None):
    """acefuse's implementation: ``prog`` compiled on first use (kept in ``kernels``), called
    with the inputs by name (and ``run_kw``); ``.fallback()`` says whether its gradient fell
    back to torch autograd (``grad_fallback``)."""
    run_kw = run_kw or {}

    def acefuse_fn(**inputs):
        if prog.name not in kernels:
            kernels[prog.name] = af.compile(prog)
        return kernels[prog.name](**inputs, **run_kw)

    acefuse_fn.fallback = lambda: getattr(kernels.get(prog.name), "grad_fallback", None)
    return acefuse_fn


def launch_choices(dk):
    """{generated program: its timed launch options by shape class} of an af.compile kernel's
    forward, augmented forward, unit-gradient and backward kernels (codegen/row_tuning.py;
    an empty dict: the size heuristics' launch). For the JSON: which launch was timed fastest."""
    kernels = [getattr(dk, "kernel", None), getattr(dk, "_aug", None), getattr(dk, "_unit", None)]
    kernels += list(getattr(getattr(dk, "_bwd_kernel", None), "kernels", None) or [])
    out = {}
    for k in kernels:
        for part in (k, getattr(k, "stage1", None)):
            mod = getattr(part, "module", None)
            chosen = getattr(mod, "_CHOSEN", None)
            if chosen:
                out[mod.PROGRAM] = {repr(key): val for key, val in chosen.items()}
    return out


def report_case(head, label, impls, rate, unit):
    """One line per case: ``head``, acefuse's status and errors, each timed implementation as
    ms and ``rate(ms)`` in ``unit``; then what went wrong (``report_errors`` under ``label``)."""
    ace = impls["acefuse"]
    line = f"{head} acefuse {ace['status']:7s} {err_text(ace)}"
    for name, r in impls.items():
        if r.get("ms"):
            line += f" | {name} {r['ms']:.3f} ms {rate(r['ms']):.0f} {unit}"
    print(line, flush=True)
    report_errors(label, impls)


def report_errors(label, res):
    skipped = [f"{name} ({r['reason']})" for name, r in res.items() if r["status"] == "skipped"]
    if skipped:
        print(f"    skipped: {', '.join(skipped)}", flush=True)
    for name, r in res.items():
        if r["status"] not in ("ok", "skipped"):
            print(f"    {label}: {name} {r['status']}: {why(r)}", flush=True)
        if name == "acefuse" and r.get("warnings"):
            print(f"    {label}: acefuse warned: {'; '.join(r['warnings'])[:600]}", flush=True)


# ---- attention ----------------------------------------------------------------------------------------
def attention_math(q, k, v, scale, causal):
    """The plain math (the CPU smoke's float64 reference)."""
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        n_i, n_j = s.shape[-2:]
        keep = torch.arange(n_j, device=q.device)[None, :] <= torch.arange(n_i, device=q.device)[:, None]
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ v


def sdpa(backend, causal, scale):
    from torch.nn.attention import sdpa_kernel

    def f(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return f


def flex(causal, n, scale):
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    fa = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, n, n,
                           device=DEVICE) if causal else None
    return lambda q, k, v: fa(q, k, v, block_mask=bm, scale=scale)


def attention_case(kind, size, smoke, rep, kernels):
    af, A, _, _ = _acefuse()
    B, H, N, D = size
    causal = kind == "causal"
    dev = "cpu" if smoke else DEVICE
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1000 * N + H + causal)
    q, k, v, cot = (torch.randn(B, H, N, D, device=dev, dtype=dtype, generator=g) for _ in range(4))
    args, wrt = dict(q=q, k=k, v=v), ("q", "k", "v")
    prog = A.causal if causal else A.attention

    impls = {"acefuse": acefuse_impl(af, prog, kernels)}
    if smoke:   # reference: float64 plain math; peers that need CUDA are skipped
        ref = step(lambda q, k, v: attention_math(q, k, v, A.SCALE, causal), fresh(args, wrt, torch.float64),
                   wrt, cot.double())
        impls["sdpa (CPU)"] = sdpa(None, causal, A.SCALE)
        for p in ("sdpa-flash", "sdpa-cudnn", "flex"):
            impls[p] = "needs CUDA"
        tol = TOL_CPU
    else:
        from torch.nn.attention import SDPBackend
        ref = [t.detach() for t in step(sdpa(None, causal, A.SCALE), fresh(args, wrt), wrt, cot)]
        impls["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION, causal, A.SCALE)
        impls["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION, causal, A.SCALE)
        try:
            impls["flex"] = flex(causal, N, A.SCALE)
        except Exception as exc:  # noqa: BLE001
            impls["flex"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        tol = TOL_GPU
    fwd = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    res = dict(case=f"{kind} B={B} H={H} N={N} D={D}", kind=kind, B=B, H=H, N=N, D=D,
               flops=3.5 * fwd, impls=run_impls(impls, args, wrt, cot, ref, tol, rep))
    report_case(f"{res['case']:34s}", res["case"], res["impls"], lambda ms: res["flops"] / (ms * 1e-3) / 1e12,
                "TFLOP/s")
    return res


# ---- rows ---------------------------------------------------------------------------------------------
def row_workloads():
    """name -> (program, eager torch function, liger function name)."""
    _, _, N, S = _acefuse()
    C = lambda x: x.shape[-1]  # noqa: E731
    return {
        "softmax": (S.softmax, lambda x: torch.softmax(x, -1), "liger_softmax"),
        "layernorm": (N.layernorm, lambda x, w, b: F.layer_norm(x, (C(x),), w, b, eps=N.EPS), "liger_layer_norm"),
        "rmsnorm": (N.rmsnorm, lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w,
                    "liger_rms_norm"),
        "cross_entropy": (N.cross_entropy_mean, lambda x, t: F.cross_entropy(x, t), "liger_cross_entropy"),
    }


def eager_peer(name):
    """The eager peer: torch's own fused ops where they exist (F.rms_norm for RMSNorm)."""
    if name == "rmsnorm":
        return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
    return row_workloads()[name][1]


def liger_peer(name, fn_name):
    """Liger-Kernel's function for this workload, or the reason it cannot run."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import liger_kernel.transformers.functional as L
    except Exception as exc:  # noqa: BLE001 - not installed, or does not import with this torch/triton
        return f"liger_kernel does not import: {type(exc).__name__}: {str(exc)[:200]}"
    _, _, N, _ = _acefuse()
    f = getattr(L, fn_name, None)
    if f is None:
        return f"liger_kernel has no {fn_name}"
    if name == "layernorm":
        return lambda x, w, b: f(x, w, b, N.EPS)
    if name == "rmsnorm":   # in_place=False: the cotangent is reused across timed steps
        return lambda x, w: f(x, w, 1e-6, offset=0.0, casting_mode="llama", in_place=False)
    if name == "cross_entropy":   # mean over rows, like F.cross_entropy (Liger writes dx into x)
        return lambda x, t: f(x, t)
    return lambda x: f(x)


def row_inputs(name, prog, rows, cols, dev, dtype):
    g = torch.Generator(device=dev).manual_seed(rows * 7 + cols)
    args = {}
    for n in prog.tensors:
        if n == "x":
            args[n] = torch.randn(rows, cols, device=dev, dtype=dtype, generator=g) * 2
        elif n == "w":
            args[n] = torch.rand(cols, device=dev, dtype=dtype, generator=g) + 0.5
        elif n == "b":
            args[n] = torch.randn(cols, device=dev, dtype=dtype, generator=g)
        elif n == "t":
            args[n] = torch.randint(0, cols, (rows,), device=dev, generator=g)
    wrt = tuple(n for n in prog.tensors if n != "t")
    cot = (torch.ones((), device=dev, dtype=dtype) if name == "cross_entropy"
           else torch.randn(rows, cols, device=dev, dtype=dtype, generator=g))
    return args, wrt, cot


def row_case(name, rows, cols, smoke, rep, kernels, run_kw=None, label=""):
    af, _, _, _ = _acefuse()
    prog, plain, liger_name = row_workloads()[name]
    dev = "cpu" if smoke else DEVICE
    dtype = torch.float32 if smoke else torch.bfloat16
    args, wrt, cot = row_inputs(name, prog, rows, cols, dev, dtype)
    run_kw = dict(run_kw or {})

    # reference: the plain math in float64 (CPU) or float32 (GPU) from the same inputs
    rdt = torch.float64 if smoke else torch.float32
    ref = [t.detach() for t in step(plain, fresh(args, wrt, rdt), wrt, cot.to(rdt))]
    impls = {"acefuse": acefuse_impl(af, prog, kernels, run_kw), "eager": eager_peer(name)}
    if smoke:
        impls["torch.compile"] = "skipped on the CPU smoke (timing peer)"
    else:
        impls["torch.compile"] = torch.compile(eager_peer(name), dynamic=False)
    impls["liger"] = liger_peer(name, liger_name)
    passes = 3 if name == "cross_entropy" else 5
    nbytes = passes * rows * cols * torch.finfo(dtype).bits // 8
    res = dict(workload=name, shape=[rows, cols], label=label, run_kw=run_kw, bytes=nbytes, passes=passes,
               impls=run_impls(impls, args, wrt, cot, ref, TOL_CPU if smoke else TOL_GPU, rep))
    if prog.name in kernels:
        res["launch_choices"] = launch_choices(kernels[prog.name])
    report_case(f"{name:14s} {rows}x{cols} {label:8s}", f"{name} {rows}x{cols} {label}", res["impls"],
                lambda ms: nbytes / (ms * 1e-3) / 1e9, "GB/s")
    return res


# ---- tables -------------------------------------------------------------------------------------------
def cell(r, rate):
    """'ms (rate)' of a timed implementation, or its status."""
    if r.get("ms"):
        return f"{r['ms']:.3f} ({rate(r['ms']):.0f})"
    return {"skipped": "n/a", "error": "error", "WRONG": "WRONG", "fallback": "torch fallback"}.get(
        r["status"], r["status"])


def ratio(ace, peer):
    if ace.get("ms") and peer.get("ms"):
        return f"{peer['ms'] / ace['ms']:.2f}"
    return "-"


def impl_table(results, cols, unit, rate, ace_cell, ace_head, err_head):
    """A markdown table of ``results`` (each with ``impls``: acefuse first, then its peers):
    the case columns ``cols`` ({header: fn(result) -> text}), acefuse's time (``ace_cell``,
    under ``ace_head``), each peer's as ms (``rate(result, ms)`` in ``unit``), each peer's
    ratio to acefuse, and acefuse's max relative error (under ``err_head``)."""
    if not results:
        return []
    peers = [p for p in results[0]["impls"] if p != "acefuse"]
    L = ["| " + " | ".join(cols) + f" | {ace_head} | " + " | ".join(f"{p} ms ({unit})" for p in peers)
         + " | " + " | ".join(f"vs {p}" for p in peers) + f" | {err_head} |",
         "|---" * (len(cols) + 2 + 2 * len(peers)) + "|"]
    for res in results:
        r = lambda ms, res=res: rate(res, ms)  # noqa: E731
        ace = res["impls"]["acefuse"]
        L.append("| " + " | ".join(f(res) for f in cols.values()) + f" | {ace_cell(ace, r)} | "
                 + " | ".join(cell(res["impls"][p], r) for p in peers) + " | "
                 + " | ".join(ratio(ace, res["impls"][p]) for p in peers) + f" | {max_err(ace, 'max_rel'):.1e} |")
    return L


def attention_table(results):
    return impl_table(results, {"case": lambda res: res["case"]}, "TFLOP/s",
                      lambda res, ms: res["flops"] / (ms * 1e-3) / 1e12, cell,
                      "acefuse ms (TFLOP/s)", "acefuse max rel err vs SDPA")


def rows_table(results, copy):
    def ace_cell(ace, rate):
        if ace.get("ms") and copy:
            return f"{ace['ms']:.3f} ({rate(ace['ms']):.0f}, {rate(ace['ms']) / copy:.0%})"
        return cell(ace, rate)
    return impl_table(results, {"workload": lambda res: res["workload"],
                                "rows x cols": lambda res: f"{res['shape'][0]}x{res['shape'][1]}"}, "GB/s",
                      lambda res, ms: res["bytes"] / (ms * 1e-3) / 1e9, ace_cell,
                      "acefuse ms (GB/s, % copy)", "acefuse max rel err")


# ---- drivers ------------------------------------------------------------------------------------------
def self_check():
    """The comparison rejects a slightly wrong result (the smoke cannot pass vacuously)."""
    ref = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert within(errors([ref.float()], [ref], ["y"]), TOL_CPU)
    assert not within(errors([ref * (1 + 1e-3)], [ref], ["y"]), TOL_CPU)
    assert not within(errors([ref[:, :6]], [ref], ["y"]), TOL_CPU)
    bad = ref.clone()
    bad[2, 3] = math.nan
    assert not within(errors([bad], [ref], ["y"]), TOL_CPU)


def cpu_smoke():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    self_check()
    kernels, results, failed = {}, [], []
    for kind in ("global", "causal"):
        results.append(attention_case(kind, (1, 2, 37, 16), True, None, kernels))
    for name in ("softmax", "layernorm", "rmsnorm", "cross_entropy"):
        results.append(row_case(name, 7, 37, True, None, kernels, label="auto"))
        results.append(row_case(name, 5, 100, True, None, kernels, dict(schedule="loop", block_j=16), "loop/16"))
    for res in results:
        label = res.get("case") or f"{res['workload']} {res['shape']} {res['label']}"
        for name, r in res["impls"].items():
            if r["status"] not in ("ok", "skipped"):
                failed.append(f"{label}: {name} {r['status']}")
            if r["status"] == "skipped" and name in ("acefuse", "eager"):
                failed.append(f"{label}: {name} skipped")
    checked = sum(r["impls"]["acefuse"]["status"] == "ok" for r in results)
    print(f"cpu smoke: acefuse forward+backward matched float64 torch in {checked}/{len(results)} cases")
    for f in failed:
        print("FAILED", f)
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="all", choices=["attention", "rows", "all"])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, one size per workload")
    ap.add_argument("--out", default=None, help="write the raw results as JSON")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny float32 run through Triton's interpreter")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        return cpu_smoke()
    if not torch.cuda.is_available():
        sys.exit("bench_training: no CUDA device; use --cpu-smoke for the CPU check")
    import triton
    af, _, _, _ = _acefuse()
    rep = 30 if args.quick else 100
    props = torch.cuda.get_device_properties(0)
    copy, mm = ceilings(copy_rep=rep, mm_rep=rep)
    try:
        import importlib.metadata as md
        liger_v = md.version("liger-kernel")
    except Exception:  # noqa: BLE001
        liger_v = None
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}, liger-kernel {liger_v}; acefuse cache "
          f"{os.environ.get('ACEFUSE_CACHE_DIR') or '~/.cache/acefuse'}")
    print(f"measured ceilings: copy {copy:.0f} GB/s (read+write), bf16 matmul {mm:.0f} TFLOP/s", flush=True)
    kernels, attn, rows = {}, [], []

    def save():   # after every case, so a run cut short still leaves its results
        if args.out:
            Path(args.out).write_text(json.dumps(dict(device=props.name, torch=torch.__version__,
                                                      triton=triton.__version__, liger=liger_v, copy_gbs=copy,
                                                      matmul_tflops=mm, attention=attn, rows=rows), indent=1))
    if args.part in ("attention", "all"):
        for kind in ("global", "causal"):
            attn.append(attention_case(kind, ATTN_SIZE, False, rep, kernels))
            save()
    if args.part in ("rows", "all"):
        sizes = ROW_SIZES[:1] if args.quick else ROW_SIZES
        for r, c in sizes:
            for name in ("softmax", "layernorm", "rmsnorm"):
                rows.append(row_case(name, r, c, False, 2 * rep, kernels))
                save()
        rows.append(row_case("cross_entropy", *CE_SIZE, False, rep, kernels))
        save()
    print(f"\nceilings (same run): copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s; "
          "vs <peer> = peer ms / acefuse ms (> 1: acefuse faster)")
    if attn:
        print("\nAttention forward+backward, bf16 (TFLOP/s = 3.5 x forward FLOPs; error: max |acefuse - SDPA| / "
              "max |SDPA| over o, dq, dk, dv):\n")
        print("\n".join(attention_table(attn)))
    if rows:
        print("\nRows forward+backward, bf16 (GB/s counting 5 passes, 3 for cross-entropy; error: max |acefuse - "
              "ref| / max |ref| over the output and each gradient, ref = eager torch in float32):\n")
        print("\n".join(rows_table(rows, copy)))
    notes = [f"- {res.get('case') or res['workload'] + ' ' + 'x'.join(map(str, res['shape']))}: {p} "
             f"{r['status']}: {why(r)}"
             for res in attn + rows for p, r in res["impls"].items() if r["status"] != "ok"]
    if notes:
        print("\nNot timed:\n" + "\n".join(dict.fromkeys(notes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
