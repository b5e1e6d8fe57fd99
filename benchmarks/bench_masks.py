"""GPU benchmark of masks and score modifications from data and index arithmetic
(FlexAttention's attention-gym) against FlexAttention (compiled, with its block mask),
with SDPA's cuDNN backend on plain causal attention as the ceiling, in one run, on the
same inputs. bf16, B=4, H=16, N=4096, D=128.

    python benchmarks/bench_masks.py --export          # here (needs egglog): derive the kernels
    python benchmarks/bench_masks.py [--out f.json]    # on the GPU (torch + triton only)
    python benchmarks/bench_masks.py --source compile  # on the GPU, egglog carried: derive in the run

``--source compile`` (the default where acefuse and egglog import) times ``af.compile``'s kernels
as a user calls them: on an sm_90 GPU, the automatic choice between the Triton kernel and the
warp-specialised Gluon kernels (each row says which it kept); ``export`` times the exported Triton
modules of ``--export``.

The programs are written plainly below (as a user writes them), at realistic sizes
(windows of hundreds of keys, a 64 x 64 NATTEN image), not the small constants of the
test gallery (examples/masks.py). TFLOP/s count 4*B*H*D per visible (query, key) pair,
counted from the mask itself. Every output is checked against a float32 torch reference
on the first batch before it is timed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

import _common   # (a sibling module: the benchmarks run as scripts from this folder)

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "kernels"
B, H, N, D = 4, 16, 4096, 128
SCALE = 1.0 / math.sqrt(D)
PREFIX, WINDOW, DILATION, CAP = 1024, 256, 2, 20.0
GRID, RADIUS = (64, 64), 3          # NATTEN-2D: a 64 x 64 image, 7 x 7 neighbourhoods
DOCS = 8                            # documents per sequence (random lengths)
NAMES = ["causal", "document", "prefix_lm", "dilated_window", "natten_2d", "alibi", "softcap"]


# ---- the programs, written plainly -------------------------------------------------------------
def programs():
    import acefuse as af
    q = af.tensor("q", "b h i d")
    k = af.tensor("k", "b h j d")
    v = af.tensor("v", "b h j e")
    doc = af.tensor("doc", "b n")
    slope = af.tensor("slope", "h")
    i, j = af.index("i"), af.index("j")
    s = af.sum(q * k, "d") * SCALE

    def attn(name, sc):
        m = af.max(sc, "j")
        p = af.exp(sc - m)
        return af.program(name, o=af.sum(p * v, "j") / af.sum(p, "j"))

    def centre(x, n):
        return af.minimum(af.maximum(x, RADIUS), n - 1 - RADIUS)

    qy, qx, ky, kx = i // GRID[1], i % GRID[1], j // GRID[1], j % GRID[1]
    return {
        "causal": attn("bm_causal", af.where(j <= i, s, af.NEG_INF)),
        "document": attn("bm_document", af.where(doc.at(n=i).eq(doc.at(n=j)) & (j <= i), s, af.NEG_INF)),
        "prefix_lm": attn("bm_prefix_lm", af.where((j <= i) | (j < PREFIX), s, af.NEG_INF)),
        "dilated_window": attn("bm_dilated_window", af.where(
            (af.abs(i - j) < WINDOW * DILATION) & ((i - j) % DILATION).eq(0), s, af.NEG_INF)),
        "natten_2d": attn("bm_natten_2d", af.where(
            (af.abs(centre(qy, GRID[0]) - ky) <= RADIUS) & (af.abs(centre(qx, GRID[1]) - kx) <= RADIUS),
            s, af.NEG_INF)),
        "alibi": attn("bm_alibi", af.where(j <= i, s + slope * (j - i), af.NEG_INF)),
        "softcap": attn("bm_softcap", CAP * af.tanh(s / CAP)),
    }


def export():
    from acefuse.codegen.compile import compile_program
    KERNELS.mkdir(exist_ok=True)
    for name, prog in programs().items():
        (KERNELS / f"bm_{name}.py").write_text(compile_program(prog, axis="j").source)
        print(f"exported {name}")


# ---- masks and score modifications in torch (FlexAttention and the reference) ------------------
def mask_fn(name, doc):
    def centre(x, n):
        return x.clamp(RADIUS, n - 1 - RADIUS)
    if name in ("causal", "alibi"):
        return lambda b, h, qi, kj: kj <= qi
    if name == "document":
        return lambda b, h, qi, kj: (doc[b, qi] == doc[b, kj]) & (kj <= qi)
    if name == "prefix_lm":
        return lambda b, h, qi, kj: (kj <= qi) | (kj < PREFIX)
    if name == "dilated_window":
        return lambda b, h, qi, kj: ((qi - kj).abs() < WINDOW * DILATION) & ((qi - kj) % DILATION == 0)
    if name == "natten_2d":
        return lambda b, h, qi, kj: (((centre(qi // GRID[1], GRID[0]) - kj // GRID[1]).abs() <= RADIUS)
                                     & ((centre(qi % GRID[1], GRID[1]) - kj % GRID[1]).abs() <= RADIUS))
    return None


def score_fn(name, slope):
    if name == "alibi":
        return lambda sc, b, h, qi, kj: sc + slope[h] * (kj - qi)
    if name == "softcap":
        return lambda sc, b, h, qi, kj: CAP * torch.tanh(sc / CAP)
    return None


def make_inputs(dev="cuda"):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(dev, torch.bfloat16) for _ in range(3))
    cuts = torch.stack([torch.sort(torch.randperm(N - 1, generator=g)[:DOCS - 1] + 1).values for _ in range(B)])
    doc = (torch.arange(N)[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32).to(dev)
    slope = (2.0 ** (-8.0 * (torch.arange(H) + 1) / H)).to(dev)
    return q, k, v, doc, slope


def visible(name, doc):
    """Visible (query, key) pairs over all batches and heads, counted from the mask."""
    mf = mask_fn(name, doc)
    if mf is None:
        return B * H * N * N
    dev = doc.device
    kj = torch.arange(N, device=dev)[None, :]
    total = 0
    for b in range(B):
        bb = torch.tensor(b, device=dev)
        for i0 in range(0, N, 512):
            qi = torch.arange(i0, min(i0 + 512, N), device=dev)[:, None]
            total += int(mf(bb, 0, qi, kj).sum())
    return total * H


def reference(name, q, k, v, doc, slope):
    """Float32 torch on the first batch."""
    qf, kf, vf = (t[:1].float() for t in (q, k, v))
    sc = qf @ kf.transpose(-1, -2) * SCALE
    qi = torch.arange(N, device=q.device)[:, None]
    kj = torch.arange(N, device=q.device)[None, :]
    if name == "softcap":
        sc = CAP * torch.tanh(sc / CAP)
    if name == "alibi":
        sc = sc + slope[:, None, None] * (kj - qi)
    mf = mask_fn(name, doc)
    if mf is not None:
        sc = sc.masked_fill(~mf(torch.tensor(0, device=q.device), 0, qi, kj), -math.inf)
    return torch.softmax(sc, -1) @ vf


def load(name, source="export"):
    if source == "compile":   # derived and compiled in this run (benchmarks/_common.py)
        return _common.Compiled(name, programs()[name])
    spec = importlib.util.spec_from_file_location(f"bm_{name}", KERNELS / f"bm_{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", action="store_true", help="derive and write the kernels (needs egglog)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated variants")
    ap.add_argument("--source", default="auto", choices=["auto", "compile", "export"])
    ap.add_argument("--sweep", action="store_true",
                    help="also time the Triton module over bench_attention's SWEEP_WINDOWS tiles (sweep_*_ms)")
    args = ap.parse_args(argv)
    args.source = _common.set_source(args.source)
    if args.export:
        export()
        return 0
    if not torch.cuda.is_available():
        print("bench_masks: needs a CUDA GPU (run with --export here first)")
        return 2
    import triton
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    import torch.nn.functional as F

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=10, rep=100, return_mode="median")

    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 2 / (bench(lambda: y.copy_(x)) * 1e-3) / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / (bench(lambda: a @ a) * 1e-3) / 1e12
    del x, y, a
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}; torch {torch.__version__}; triton {triton.__version__}; kernels: {args.source}")
    print(f"measured ceilings: copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s")
    print(f"B={B} H={H} N={N} D={D} bf16")
    q, k, v, doc, slope = make_inputs()
    fa = torch.compile(flex_attention, dynamic=False)
    rows = []
    names = args.only.split(",") if args.only else NAMES
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE))
    print(f"sdpa-cudnn causal: {4 * B * H * D * N * (N + 1) / 2 / (cudnn_ms * 1e-3) / 1e12:.0f} TFLOP/s")
    for name in names:
        res = {"variant": name}
        pairs = visible(name, doc)
        flops = 4 * D * pairs
        res["visible_fraction"] = pairs / (B * H * N * N)
        extra = {"doc": doc} if name == "document" else {"slope": slope} if name == "alibi" else {}
        ref = reference(name, q, k, v, doc, slope)
        try:
            mod = load(name, args.source)
            o = mod.run(q=q, k=k, v=v, **extra)
            o = o["o"] if isinstance(o, dict) else o
            err = ((o[:1].float() - ref).norm() / ref.norm()).item()
            res["rel_err"] = err
            if err < 2e-2:
                res["acefuse_ms"] = bench(lambda: mod.run(q=q, k=k, v=v, **extra))
                if hasattr(mod, "kept"):
                    res["kept"] = mod.kept()
                    # the Triton module's timed tile choice (the launcher's _TUNED: tiles and path per shapes)
                    tuned = getattr(getattr(mod, "module", None), "_TUNED", None)
                    if tuned:
                        res["triton_tiles"] = [str(v) for v in tuned.values()]
                    # what the automatic choice timed (seconds per kernel) or why it timed nothing
                    kern = getattr(mod, "kernel", None)
                    for a in ("_gluon_all_times", "_gluon_times", "_gluon_reason"):
                        val = getattr(kern, a, None)   # (af.compile's kernel hands these on from its own)
                        if val is not None:
                            res["choice" + a[len("_gluon"):]] = ({str(k): v for k, v in val.items()}
                                                                if isinstance(val, dict) else str(val))
            else:
                res["acefuse_wrong"] = True
            if args.sweep and err < 2e-2:
                from bench_attention import SWEEP_WINDOWS
                for c in SWEEP_WINDOWS:
                    lab = f"bi{c['block_i']}/bj{c['block_j']}/w{c['num_warps']}/s{c['num_stages']}"
                    try:
                        o = mod.run(q=q, k=k, v=v, **extra, **c)
                        o = o["o"] if isinstance(o, dict) else o
                        e = ((o[:1].float() - ref).norm() / ref.norm()).item()
                        res[f"sweep_{lab}_ms"] = bench(lambda: mod.run(q=q, k=k, v=v, **extra, **c)) if e < 2e-2 else None
                    except Exception as exc:
                        res[f"sweep_{lab}_err"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                    t = res.get(f"sweep_{lab}_ms")
                    print(f"  {name} sweep {lab}: {t if t is None else round(t * 1e3, 1)} us", flush=True)
        except Exception as exc:
            res["acefuse_err"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        try:
            mf, sf = mask_fn(name, doc), score_fn(name, slope)
            bm = create_block_mask(mf, B if name == "document" else None, None, N, N, device="cuda") if mf else None
            run_flex = lambda: fa(q, k, v, score_mod=sf, block_mask=bm, scale=SCALE)
            of = run_flex()
            res["flex_rel_err"] = ((of[:1].float() - ref).norm() / ref.norm()).item()
            res["flex_ms"] = bench(run_flex)
        except Exception as exc:
            res["flex_err"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        tf = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else float("nan")
        res["acefuse_tflops"], res["flex_tflops"] = tf(res.get("acefuse_ms")), tf(res.get("flex_ms"))
        ratio = res["acefuse_tflops"] / res["flex_tflops"] if res.get("flex_ms") and res.get("acefuse_ms") else float("nan")
        res["vs_flex"] = ratio
        rows.append(res)
        print(f"{name:16s} visible {res['visible_fraction']:.4f}  acefuse {res['acefuse_tflops']:6.0f}  "
              f"flex {res['flex_tflops']:6.0f} TFLOP/s  x{ratio:.2f}  err {res.get('rel_err', float('nan')):.1e}"
              f"{'  kept ' + res['kept'] if 'kept' in res else ''}"
              f"{'  ' + res['acefuse_err'] if 'acefuse_err' in res else ''}"
              f"{'  WRONG' if res.get('acefuse_wrong') else ''}{'  ' + res['flex_err'] if 'flex_err' in res else ''}",
              flush=True)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=props.name, copy_gbs=copy, matmul_tflops=mm, source=args.source,
                                                  cudnn_causal_ms=cudnn_ms, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
