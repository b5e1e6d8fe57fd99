"""GPU benchmark of the generated attention kernels against SDPA (flash and cuDNN
backends), FlexAttention (compiled, with block masks) and torch.compile of the
plain program, in one run, on the same inputs.

    python benchmarks/bench_attention.py --part prefill|variants|decode [--out f.json]
        [--source auto|compile|export] [--path auto|portable|hopper|both] [--ws] [--no-sweep]
        [--peers sdpa-flash,sdpa-cudnn,flex]

``--source``: where the kernels come from (benchmarks/_common.py): ``compile`` derives and
generates them in this run with ``af.compile`` (needs egglog: carry its wheel to the GPU
machine), and "auto" is then the call a user makes, which on an sm_90 GPU chooses between the
Triton module and the warp-specialised Gluon kernels by timing them (the row says which it
kept); ``export`` imports benchmarks/kernels/ (written by benchmarks/export.py; Triton only).

``--path``: which of the generated kernels to time besides the automatic choice: the
portable one, the Hopper one (TMA descriptors, pipelined key loop; capability 9.0+), or
both side by side (``both``); ``--ws`` adds the Hopper kernel with its main loop
warp-specialized. ``--peers`` limits the peers timed (all by default).

Prefill reports TFLOP/s counting 4*B*H*D per visible (query, key) pair (so
causal is halved); decode reports GB/s of K+V read.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import _common
from _common import load, bench, ceilings

D = 128
SCALE = 1.0 / math.sqrt(D)
WINDOW = 256
CAP = 30.0


def visible_pairs(kind, n, window=WINDOW):
    if kind in ("causal", "alibi"):
        return n * (n + 1) / 2
    if kind == "sliding_window":
        return sum(min(i + 1, window) for i in range(n))
    return n * n


def plain(kind, slope=None, window=WINDOW):
    """The same function written plainly in torch (for torch.compile and checks)."""
    def f(q, k, v):
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, 1)
            v = v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)).float() * SCALE
        n_i, n_j = s.shape[-2:]
        i = torch.arange(n_i, device=q.device)[:, None] + (n_j - n_i) * 0
        j = torch.arange(n_j, device=q.device)[None, :]
        if kind == "softcap":
            s = CAP * torch.tanh(s / CAP)
        if kind == "alibi":
            s = s + slope[:, None, None] * (j - i)
        if kind in ("causal", "alibi"):
            s = s.masked_fill(j > i, -math.inf)
        if kind == "sliding_window":
            s = s.masked_fill((j > i) | (i - j >= window), -math.inf)
        return (torch.softmax(s, -1).to(v.dtype) @ v)
    return f


def flex(kind, B, H, N, slope=None, gqa=False, window=WINDOW):
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    fa = torch.compile(flex_attention, dynamic=False)
    mask_mod = None
    if kind in ("causal", "alibi"):
        mask_mod = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    elif kind == "sliding_window":
        mask_mod = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    bm = create_block_mask(mask_mod, None, None, N, N, device="cuda") if mask_mod else None
    score_mod = None
    if kind == "softcap":
        score_mod = lambda s, b, h, q_idx, kv_idx: CAP * torch.tanh(s / CAP)
    elif kind == "alibi":
        score_mod = lambda s, b, h, q_idx, kv_idx: s + slope[h] * (kv_idx - q_idx)
    return lambda q, k, v: fa(q, k, v, score_mod=score_mod, block_mask=bm, scale=SCALE, enable_gqa=gqa)


def sdpa(backend, causal, gqa=False):
    def f(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, enable_gqa=gqa)
    return f


SWEEP = [dict(block_i=128, block_j=64, num_warps=8, num_stages=3),
         dict(block_i=128, block_j=128, num_warps=8, num_stages=2),
         dict(block_i=64, block_j=64, num_warps=4, num_stages=3),
         dict(block_i=128, block_j=64, num_warps=4, num_stages=3)]
# the windows' sweep (--sweep-windows): smaller key tiles and other depths besides SWEEP, to find
# tiles the tuner's candidates lack (session 21: the window of 256 at 1.13x FlexAttention)
SWEEP_WINDOWS = SWEEP + [dict(block_i=128, block_j=32, num_warps=8, num_stages=3),
                         dict(block_i=64, block_j=32, num_warps=4, num_stages=3),
                         dict(block_i=64, block_j=64, num_warps=4, num_stages=2),
                         dict(block_i=64, block_j=128, num_warps=4, num_stages=2),
                         dict(block_i=128, block_j=64, num_warps=8, num_stages=4)]


def time_peers(res, peers, args, compile_s=False):
    """Times each peer on ``args`` into ``res[f"{name}_ms"]``; a peer that fails gets None
    and its error in ``res[f"{name}_err"]``. With ``compile_s``: also the seconds of its first
    call (compilation) in ``res[f"{name}_compile_s"]``, and the allocator's cache is emptied
    after each peer."""
    for pn, fn in peers.items():
        try:
            t0 = time.time()
            fn(*args)
            if compile_s:
                torch.cuda.synchronize()
                res[f"{pn}_compile_s"] = round(time.time() - t0, 1)
            res[f"{pn}_ms"] = bench(lambda: fn(*args))
        except Exception as exc:
            res[f"{pn}_ms"] = None
            res[f"{pn}_err"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        if compile_s:
            torch.cuda.empty_cache()


def report(label, res, peers, rate, unit):
    """One line: acefuse's automatic and best choice, then each peer, as ``rate(ms)`` in
    ``unit`` (nan where not timed)."""
    r = lambda ms: rate(ms) if ms else float("nan")  # noqa: E731
    line = (f"{label:28s} acefuse auto {r(res.get('auto_ms')):6.1f}" + (f" ({res['kept']})" if "kept" in res else "")
            + f" best {r(res.get('best_ms')):6.1f} {unit} [{res.get('best')}]")
    for pn in peers:
        line += f" | {pn} {r(res.get(pn + '_ms')):6.1f}"
    print(line, flush=True)
    for key in sorted(k for k in res if k.startswith(("err_", "wrong_")) or k.endswith("_err")):
        print(f"{'':28s}   {key}: {res[key]}", flush=True)


OPTS = dict(paths=(), ws=False, peers=None, sweep=True)   # set from the command line in main()


def path_cands():
    """(label, run() keywords) of the paths asked for with --path/--ws, each tuned on its first call."""
    out = [(p, dict(path=p)) for p in OPTS["paths"]]
    if OPTS["ws"]:
        out.append(("hopper-ws", dict(path="hopper", ws=True)))
    return out


def window_program(window):
    """The example's sliding-window program with another window (``--source compile`` only)."""
    import acefuse as af
    _, ns = _common.example_program("attention")
    i, j = ns["i"], ns["j"]
    return ns["attend"](f"sliding_window{window}", af.where((j <= i) & (i - j < window), ns["score"], af.NEG_INF))


def run_case(label, kind, B, H, HKV, N, flops, rows, mods, sweep=True, window=WINDOW):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(B * N + H)
    q = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16, generator=g)
    slope = (torch.rand(H, device=dev, generator=g) * 0.1).float()
    name = {"global": "attention"}.get(kind, kind)
    if HKV != H:
        name = "gqa"
    if kind == "sliding_window" and window != WINDOW:
        mod = mods.setdefault(f"{name}{window}", _common.Compiled(name, window_program(window)))
    else:
        mod = mods.setdefault(name, load(name))
    if name == "gqa":
        G = HKV
        inputs = dict(q=q.view(B, G, H // G, N, D), k=k, v=v)
        unview = lambda o: o.reshape(B, H, N, D)
    elif name == "alibi":
        inputs = dict(q=q, k=k, v=v, slope=slope)
        unview = lambda o: o
    else:
        inputs = dict(q=q, k=k, v=v)
        unview = lambda o: o
    ref = None
    if N <= 4096:
        ref = plain(kind, slope, window)(q.float(), k.float(), v.float())
    peers = {}
    causal = kind in ("causal",)
    if kind in ("global", "causal") and HKV == H:
        peers["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION, causal)
        peers["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION, causal)
    elif kind == "global":  # GQA
        peers["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION, False, gqa=True)
        peers["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION, False, gqa=True)
    peers["flex"] = flex(kind, B, H, N, slope, gqa=HKV != H, window=window)
    peers["compile-plain"] = torch.compile(plain(kind, slope, window), dynamic=False)
    if OPTS["peers"] is not None:
        peers = {pn: fn for pn, fn in peers.items() if pn in OPTS["peers"]}
    res = dict(case=label, kind=kind, B=B, H=H, HKV=HKV, N=N, flops=flops)
    sweep = OPTS["sweep"] and sweep
    tiles = sweep if isinstance(sweep, list) else SWEEP
    cands = [("auto", {})] + path_cands() + ([(f"bi{c['block_i']}/bj{c['block_j']}/w{c['num_warps']}/s{c['num_stages']}", c)
                                              for c in tiles] if sweep else [])
    best = None
    for lab, kw in cands:
        try:
            o = unview(mod.run(**inputs, **kw))
            torch.cuda.synchronize()
        except Exception as exc:
            res[f"err_{lab}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
            continue
        if ref is not None:
            err = ((o.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                res[f"wrong_{lab}"] = err
                continue
            res.setdefault("rel_err", err)
        t = bench(lambda: mod.run(**inputs, **kw))
        if lab == "auto":
            res["auto_ms"] = t
            if hasattr(mod, "kept"):
                res["kept"] = mod.kept()
        if lab in [c[0] for c in path_cands()]:
            res[f"{lab}_ms"] = t
        elif lab != "auto":
            res[f"sweep_{lab}_ms"] = t
        if best is None or t < best[0]:
            best = (t, lab)
    if best:
        res["best_ms"], res["best"] = best
    time_peers(res, peers, (q, k, v), compile_s=True)
    rows.append(res)
    report(label, res, [c[0] for c in path_cands()] + list(peers), lambda ms: flops / (ms * 1e-3) / 1e12, "TFLOP/s")
    if OPTS.get("save"):   # each case: a run cut off by a time limit keeps its rows
        OPTS["save"]()
    return res


def run_decode(label, B, HQ, HKV, L, rows, mods):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(L)
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16, generator=g)
    mod = mods.setdefault("decode", load("decode"))
    G, R = HKV, HQ // HKV
    inputs = dict(q=q.view(B, G, R, 1, D), k=k, v=v)
    ref = plain("global")(q.float(), k.float(), v.float())
    nbytes = 2 * B * HKV * L * D * 2
    res = dict(case=label, B=B, HQ=HQ, HKV=HKV, L=L, bytes=nbytes)
    best = None
    # split: partial states, then their merge (two launches); split1: the last program of each
    # row tile merges (one launch; chunks as the launcher's default, about 2 programs per SM)
    for lab, kw in [("auto", {}), ("split/bj64", dict(schedule="split", block_j=64)),
                    ("split/bj128", dict(schedule="split", block_j=128)),
                    ("split1/bj64", dict(schedule="split1", block_j=64)),
                    ("split1/bj128", dict(schedule="split1", block_j=128)), ("loop", dict(schedule="loop"))]:
        try:
            o = mod.run(**inputs, **kw).reshape(B, HQ, 1, D)
        except Exception as exc:
            res[f"err_{lab}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
            continue
        err = ((o.float() - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            res[f"wrong_{lab}"] = err
            continue
        t = bench(lambda: mod.run(**inputs, **kw))
        if lab == "auto":
            res["auto_ms"], res["rel_err"] = t, err
            if hasattr(mod, "kept"):
                res["kept"] = mod.kept()
        if best is None or t < best[0]:
            best = (t, lab)
    if best:
        res["best_ms"], res["best"] = best
    peers = {"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION, False, gqa=True),
             "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, False, gqa=True),
             "flex": flex("global", B, HQ, L, gqa=True),
             "compile-plain": torch.compile(plain("global"), dynamic=False)}
    if OPTS["peers"] is not None:
        peers = {pn: fn for pn, fn in peers.items() if pn in OPTS["peers"]}
    time_peers(res, peers, (q, k, v))
    rows.append(res)
    report(label, res, peers, lambda ms: nbytes / (ms * 1e-3) / 1e9, "GB/s")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="prefill", choices=["prefill", "variants", "decode", "smoke"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--path", default="auto", choices=["auto", "portable", "hopper", "both"],
                    help="generated kernels timed besides the automatic choice (both: portable and hopper)")
    ap.add_argument("--ws", action="store_true", help="also time the Hopper kernel with a warp-specialized loop")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweep at N=4096")
    ap.add_argument("--peers", default=None, help="comma-separated peers to time (default: all)")
    ap.add_argument("--sizes", default="1024,4096,16384", help="prefill sequence lengths")
    ap.add_argument("--source", default="auto", choices=["auto", "compile", "export"],
                    help="kernels derived in this run (compile) or exported modules (export)")
    ap.add_argument("--sweep-windows", action="store_true",
                    help="variants: time the windows' portable kernel over SWEEP_WINDOWS's tiles too")
    ap.add_argument("--windows", default=str(WINDOW),
                    help="sliding windows of the variants part (other than 256: --source compile)")
    args = ap.parse_args(argv)
    source = _common.set_source(args.source)
    OPTS.update(paths={"auto": (), "both": ("portable", "hopper")}.get(args.path, (args.path,)), ws=args.ws,
                peers=None if args.peers is None else args.peers.split(","), sweep=not args.no_sweep)
    props = torch.cuda.get_device_properties(0)
    copy, mm = ceilings()
    print(f"device: {props.name}; torch {torch.__version__}; triton {triton.__version__}; kernels: {source}")
    print(f"measured ceilings: copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOP/s")
    rows, mods = [], {}
    OPTS["save"] = lambda: save(args.out, props, copy, mm, rows, source)
    H = 16
    if args.part == "smoke":
        run_case("smoke global N=1024", "global", 2, H, H, 1024, 4 * 2 * H * D * 1024 ** 2, rows, mods, sweep=False)
    if args.part == "prefill":
        for N in (int(n) for n in args.sizes.split(",")):
            B = 16384 // N
            for kind in ("global", "causal"):
                fl = 4 * B * H * D * visible_pairs(kind, N)
                run_case(f"{kind} B={B} N={N}", kind, B, H, H, N, fl, rows, mods, sweep=(N == 4096))
    if args.part == "variants":
        B, N = 4, 4096
        for kind in ("alibi", "softcap"):
            run_case(f"{kind} B={B} N={N}", kind, B, H, H, N, 4 * B * H * D * visible_pairs(kind, N), rows, mods,
                     sweep=False)
        for w in (int(x) for x in args.windows.split(",")):
            if w != WINDOW and source != "compile":
                print(f"sliding_window{w}: skipped (only the window of {WINDOW} is exported; use --source compile)")
                continue
            run_case(f"sliding_window{w} B={B} N={N}", "sliding_window", B, H, H, N,
                     4 * B * H * D * visible_pairs("sliding_window", N, w), rows, mods,
                     sweep=SWEEP_WINDOWS if args.sweep_windows else False, window=w)
        run_case(f"gqa 32q/8kv B={B} N={N}", "global", B, 32, 8, N, 4 * B * 32 * D * N * N, rows, mods, sweep=False)
    if args.part == "decode":
        for L in (4096, 32768):
            run_decode(f"decode B=8 32q/8kv L={L}", 8, 32, 8, L, rows, mods)
    save(args.out, props, copy, mm, rows, source)
    return 0


def save(out, props, copy, mm, rows, source=None):
    if out:
        Path(out).write_text(json.dumps(dict(device=props.name, copy_gbs=copy, matmul_tflops=mm, source=source,
                                             torch=torch.__version__, triton=triton.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    sys.exit(main())
