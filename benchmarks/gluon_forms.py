"""The warp-specialised Gluon attention kernels form by form, against SDPA's cuDNN backend, in one
run (an sm_90 GPU; acefuse and egglog on the machine: the kernels are derived in the run). What the
automatic choice picks between (codegen/contraction_gluon.py AUTO_VARIANTS) and the options it does
not time yet, each checked against SDPA first:

    python benchmarks/gluon_forms.py [--sizes 1024,4096,16384] [--kinds global,causal,window]
        [--forms wsPD,wsPD-mma,wsPD-stage,wsov] [--out forms.json]

Forms: ws (one-shot), wsP (persistent), wsPD (persistent, dynamic work items), wsPDown (wsPD
with each consumer folding only the key tiles its own rows see: own_range=True), wsov (one-shot,
the next score MMA during this tile's math), wspp (ping-pong); suffixes: -mma (output tiles
stored from the MMA layout, 3 stages of 128 keys), -tile (from STORE_L through the conversion's
scratch, 2 stages), -stage (stage_store: from STORE_L through the last key tile's value buffer,
3 stages); no suffix: the form's default. B*N = 16384, H = 16, D = 128, bf16; TFLOP/s count
4*B*H*N^2*D, halved for causal; window (the example's sliding window of 256 keys): 4*B*H*D per
visible pair, against SDPA with the boolean mask (its efficient-attention backend).
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
H, D = 16, 128
BASE = {"ws": dict(ws=True), "wsP": dict(ws=True, persistent=True),
        "wsPD": dict(ws=True, persistent=True, dynamic=True), "wsov": dict(ws=True, overlap=True),
        "wspp": dict(ws=True, pingpong=True),
        "wsPDown": dict(ws=True, persistent=True, dynamic=True, own_range=True)}
STORES = {"": {}, "mma": dict(tile_store=False), "tile": dict(tile_store=True), "stage": dict(stage_store=True)}


def form_options(form):
    base, _, store = form.partition("-")
    if base not in BASE or store not in STORES:
        raise SystemExit(f"gluon_forms: unknown form {form!r} (forms {list(BASE)}, suffixes -mma, -tile, -stage)")
    return {**BASE[base], **STORES[store]}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096,16384")
    ap.add_argument("--kinds", default="global,causal")
    ap.add_argument("--forms", default="wsPD,wsPD-mma,wsPD-stage,wsov")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("gluon_forms: needs an sm_90 GPU")
        return 2
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from acefuse.codegen.contraction_gluon import compile_gluon
    ex = runpy.run_path(str(ROOT / "examples" / "attention.py"))
    forms = {f: form_options(f) for f in args.forms.split(",")}
    kerns, rows = {}, []
    print(f"device: {torch.cuda.get_device_name()}; forms {list(forms)}", flush=True)
    for n in (int(x) for x in args.sizes.split(",")):
        b = 16384 // n
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        for kind in args.kinds.split(","):
            causal = kind == "causal"
            if kind == "window":   # the example's sliding window: SDPA with the boolean mask as the peer
                w = ex["WINDOW"]
                ii = torch.arange(n, device="cuda")
                keep = (ii[None, :] <= ii[:, None]) & (ii[:, None] - ii[None, :] < w)
                flops = 4 * b * H * D * sum(min(x + 1, w) for x in range(n))
                peer = dict(attn_mask=keep)
            else:
                flops = 4 * b * H * n * n * D * (0.5 if causal else 1.0)
                peer = dict(is_causal=causal)
            rate = lambda ms: flops / (ms * 1e-3) / 1e12   # noqa: E731
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if kind != "window" else
                             [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                sd = lambda: F.scaled_dot_product_attention(q, k, v, scale=ex["SCALE"], **peer)  # noqa: E731
                ref = sd().float()
                row = dict(kind=kind, N=n, B=b, cudnn=rate(do_bench(sd, warmup=25, rep=150, return_mode="median")))
            prog = ex[{"causal": "causal", "window": "sliding_window"}.get(kind, "attention")]
            for f, opts in forms.items():
                key = (kind, f)
                try:
                    if key not in kerns:
                        kerns[key] = compile_gluon(prog, **opts)
                    kern = kerns[key]
                    o = kern(q=q, k=k, v=v)["o"].float()
                    err = ((o - ref).norm() / ref.norm()).item()
                    if not (err < 2e-2 and torch.isfinite(o).all()):
                        row[f] = f"WRONG (relative error {err:.2e})"
                        continue
                    row[f] = rate(do_bench(lambda: kern(q=q, k=k, v=v), warmup=25, rep=150, return_mode="median"))
                except Exception as exc:   # a form that does not compile or launch is reported, not fatal
                    row[f] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            cells = " | ".join(f"{f} {row[f]:.1f}" if isinstance(row[f], float) else f"{f} {row[f]}" for f in forms)
            peer_name = "SDPA (boolean mask)" if kind == "window" else "cuDNN"
            print(f"{kind} N={n}: {peer_name} {row['cudnn']:.1f} | {cells} TFLOP/s", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
