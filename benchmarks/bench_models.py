"""A Llama-shaped model through the frontend on the GPU: training and inference tokens/s of
``torch.compile(model, backend=af.Backend(inner=...))`` against eager torch and ``torch.compile``
(Inductor), in one run, on the same inputs (Hugging Face ``LlamaForCausalLM``, random init,
bf16 weights, SDPA attention). Implementations (``--impls``, default all):

- ``eager``: torch, op by op (the reference every other one is checked against);
- ``inductor``: ``torch.compile(backend="inductor")``;
- ``acefuse``: ``af.Backend(inner="inductor")``: acefuse's regions as opaque ops inside the graph
  Inductor compiles (the default on CUDA);
- ``acefuse-eager``: ``af.Backend(inner="eager")``: acefuse's regions, the rest op by op in torch.

    python3 benchmarks/bench_models.py [--quick | --size tiny|quick|full] [--mode inference|training|both]
        [--train] [--impls eager,inductor,acefuse,acefuse-eager] [--take attention,loss,softmax,norm]
        [--device cuda|cpu] [--dtype bfloat16|float32] [--out f.json]  # needs egglog (carry the wheel)

``--train`` is ``--mode training``: the training step of eager, Inductor (``torch.compile``'s default
backend) and acefuse's backend, timed in one run on the same weights and batch, e.g. issue 12's
realistic size: ``--size full --train``. The CPU smoke run of the same comparison:
``--size tiny --train --device cpu`` (``--dtype bfloat16`` exercises the bfloat16 path there).

``--size``: ``quick`` (hidden 1024, 4 layers, 16/4 heads, batch 4 x 1024), ``full`` (issue 12's
realistic size: hidden 2048, 4 layers, 16/4 heads, batch 4 x 2048), ``tiny`` (the CPU smoke run:
float32 on the CPU, acefuse's kernels in Triton's interpreter; correctness checks, no meaningful
times); ``--layers`` overrides the layer count. Without a GPU only ``--size tiny`` runs.

``--take`` restricts the region kinds acefuse takes (``af.Backend(take=...)``); the rest is
Inductor's (or eager torch's): which of acefuse's kernels beat Inductor's fusion in the model.

Time (issue 12: training runs used to end at the device's time limit while acefuse's first training
call compiled the backward regions): each implementation's first call (``first_call_s``: Dynamo,
acefuse's and Inductor's compilation, forward and backward, and the correctness check) and three
warm-up steps run before anything is timed; the timed steps then take at most ``--timed-s``
seconds (fewer steps when a step is slow, at least 2). ``--time-limit S`` is the run's own wall-clock
budget: an implementation that would start after ``S - --reserve-s`` seconds is reported skipped
(``"skipped"``), and ``--out`` is rewritten after every implementation, so a run stopped from
outside keeps what it measured. ``--cache-dir D`` puts acefuse's, Triton's and Inductor's compile
caches under ``D`` (ignored ``benchmarks/kernels/cache`` carries between device calls);
``--compile-only`` runs every first call (compiling and checking, no timing) to fill them, so that
a second run spends its time limit on the timed steps:

    python3 benchmarks/bench_models.py --size quick --mode training --cache-dir benchmarks/kernels/cache --compile-only
    python3 benchmarks/bench_models.py --size quick --mode training --cache-dir benchmarks/kernels/cache --time-limit 540

A training step is forward + loss + backward + AdamW step, with a fixed batch. Before timing,
each implementation's loss (and, for training, the gradient norm of every parameter) is
compared with eager's on the same weights; a mismatch is reported, never timed (and the exit
status is 1). The
backend's report (what acefuse took, what it left to torch and why) is printed.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch


# --size: (hidden, intermediate, layers, heads, KV heads, vocab), batch, sequence
SIZES = {"tiny": ((64, 128, 2, 4, 2, 128), 2, 16),            # the CPU smoke run (Triton's interpreter)
         "quick": ((1024, 2816, 4, 16, 4, 32000), 4, 1024),
         "full": ((2048, 5632, 4, 16, 4, 32000), 4, 2048)}    # issue 12's realistic size


def config(size="quick", layers=None):
    """(LlamaConfig, batch, sequence) for a ``--size`` (``size=True``/``False``: quick/full, as before)."""
    import transformers as tf
    if isinstance(size, bool):
        size = "quick" if size else "full"
    (h, inter, nl, nh, nkv, vocab), B, T = SIZES[size]
    return tf.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers or nl,
                          num_attention_heads=nh, num_key_value_heads=nkv,
                          max_position_embeddings=max(4096, T)), B, T


def build(cfg, device="cuda", dtype=torch.bfloat16):
    import transformers as tf
    torch.manual_seed(0)
    cfg._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = tf.LlamaForCausalLM(cfg)
    return m.to(device, dtype)


IMPLS = ("eager", "inductor", "acefuse", "acefuse-eager")
INNER = {"acefuse": "inductor", "acefuse-eager": "eager"}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps, budget_s=None):
    """Seconds per call of ``fn``: three warm-up calls, then ``steps`` timed calls, fewer (at least
    2, or ``steps`` if fewer) when the warm-up says they would take more than ``budget_s``. Returns
    (seconds, steps)."""
    _sync()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    _sync()
    warm = (time.perf_counter() - t0) / 3
    if budget_s is not None and warm > 0:
        steps = max(min(2, steps), min(steps, int(budget_s / warm)))
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync()
    return (time.perf_counter() - t0) / steps, steps


def _write(path, info, rows):
    if path:
        Path(path).write_text(json.dumps(dict(info, rows=rows), indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the same as --size quick")
    ap.add_argument("--size", choices=tuple(SIZES), default=None, help="model and batch size (default full)")
    ap.add_argument("--layers", type=int, default=None, help="override the size's layer count")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 for --size tiny)")
    ap.add_argument("--out", default=None, help="JSON results, rewritten after every implementation")
    ap.add_argument("--timed-s", type=float, default=20.0,
                    help="seconds the timed steps of one implementation may take (fewer steps when slow; default 20)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="the run's wall-clock budget: implementations that would start after S - --reserve-s "
                         "seconds are skipped (reported)")
    ap.add_argument("--reserve-s", type=float, default=120.0,
                    help="with --time-limit: the time kept for one implementation's compile and steps (default 120)")
    ap.add_argument("--cache-dir", default=None,
                    help="acefuse's, Triton's and Inductor's compile caches under this folder (kept between runs)")
    ap.add_argument("--compile-only", action="store_true",
                    help="run each implementation's first call (compile, check) and no timed steps: fills --cache-dir")
    ap.add_argument("--mode", choices=("inference", "training", "both"), default="both")
    ap.add_argument("--train", action="store_true", help="the same as --mode training")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default cuda when there is a GPU; cpu runs only --size tiny (Triton's interpreter)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="weights and activations (default bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--take", default=None,
                    help="comma-separated region kinds acefuse takes (attention, loss, softmax, norm; default all): "
                         "af.Backend(take=...), the others stay with Inductor / torch")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help=f"comma-separated, from {', '.join(IMPLS)} (eager always runs first: the reference)")
    args = ap.parse_args(argv)
    impls = ["eager"] + [i for i in args.impls.split(",") if i and i != "eager"]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
    start = time.perf_counter()
    if args.cache_dir:            # (before acefuse, Triton or Inductor read their cache locations)
        import os
        root = Path(args.cache_dir).resolve()
        for var, sub in (("ACEFUSE_CACHE_DIR", "acefuse"), ("TRITON_CACHE_DIR", "triton"),
                         ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
            os.environ[var] = str(root / sub)
            (root / sub).mkdir(parents=True, exist_ok=True)
    if args.train:
        args.mode = "training"
    modes = ("inference", "training") if args.mode == "both" else (args.mode,)
    size = args.size or ("quick" if args.quick else "full")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        print("bench_models: --device cuda, but torch sees no CUDA GPU")
        return 2
    if not cuda and size != "tiny":
        print("bench_models: needs a CUDA GPU (without one: --size tiny, the CPU smoke run)")
        return 2
    if not cuda:
        import os
        if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
            print("bench_models: --device cpu on a machine with a GPU needs TRITON_INTERPRET=1 set before "
                  "Python starts (Triton reads it at import)")
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    import acefuse as af
    cfg, B, T = config(size, args.layers)
    import transformers
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (smoke run)'}; torch {torch.__version__}; "
          f"transformers {transformers.__version__}" + (f"; acefuse takes {args.take}" if args.take else ""))
    print(f"Llama ({size}): hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, heads {cfg.num_attention_heads}/"
          f"{cfg.num_key_value_heads}, vocab {cfg.vocab_size}; batch {B} x {T} tokens, {str(dtype)[6:]}")
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g)
    base = build(cfg, dev, dtype)
    rows = []
    info = dict(device=torch.cuda.get_device_name() if cuda else "cpu", size=size, take=args.take, B=B, T=T,
                hidden=cfg.hidden_size, layers=cfg.num_hidden_layers)
    for mode in modes:
        ref = None
        for impl in impls:
            res = {"mode": mode, "impl": impl}
            spent = time.perf_counter() - start
            if args.time_limit is not None and spent > args.time_limit - args.reserve_s and \
                    not (impl == "eager" and ref is None):
                res["skipped"] = (f"time limit: {spent:.0f} s spent of --time-limit {args.time_limit:.0f} s, "
                                  f"{args.reserve_s:.0f} s reserved per implementation")
                rows.append(res)
                print(f"{mode:9s} {impl:13s} skipped ({res['skipped']})", flush=True)
                _write(args.out, info, rows)
                continue
            model = copy.deepcopy(base)
            model.train(mode == "training")
            take = None if args.take is None else [k for k in args.take.split(",") if k]
            be = af.Backend(inner=INNER[impl], take=take) if impl in INNER else None
            torch._dynamo.reset()

            def loss_fn(i, model=model):
                return model(input_ids=i, labels=i).loss

            fn = loss_fn if impl == "eager" else torch.compile(loss_fn, backend=be if be else "inductor", dynamic=False)
            try:
                t0 = time.perf_counter()
                if mode == "inference":
                    with torch.no_grad():
                        loss = fn(ids)
                    grads = None
                else:
                    loss = fn(ids)
                    loss.backward()
                    grads = torch.stack([p.grad.float().norm() for p in model.parameters()])
                    model.zero_grad(set_to_none=True)
                _sync()
                res["first_call_s"] = round(time.perf_counter() - t0, 1)
                if ref is None:
                    ref = (loss.float().item(), grads)
                else:
                    res["loss_diff"] = abs(loss.float().item() - ref[0])
                    if grads is not None:
                        res["grad_norm_rel_diff"] = ((grads - ref[1]).abs() / ref[1].clamp_min(1e-6)).max().item()
                ok = res.get("loss_diff", 0) < 2e-2 * max(1.0, abs(ref[0])) and res.get("grad_norm_rel_diff", 0) < 5e-2
                if not ok:
                    res["wrong"] = True
                elif args.compile_only:
                    pass
                else:
                    if mode == "inference":
                        def step():
                            with torch.no_grad():
                                fn(ids)
                    else:
                        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

                        def step():
                            fn(ids).backward()
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                    # (the first call compiled the forward and, in training, the backward regions;
                    # timed() runs three more untimed steps: the optimizer's state, Triton's tuning)
                    sec, res["steps"] = timed(step, args.steps or (2 if size == "tiny" else 10), args.timed_s)
                    res["ms"] = sec * 1e3
                    res["tokens_per_s"] = B * T / sec
            except Exception as exc:
                res["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if be is not None:
                r = be.report()
                res["taken"] = len(r.taken)
                res["left"] = [f"{e.op}: {e.reason[:120]}" for e in r.left]
                # a graph Inductor could not compile runs its regions and eager torch (warned): say so
                res["inductor_errors"] = [g.error for cf in be.functions for g in cf.graphs.values()
                                          if getattr(g, "error", None)]
            rows.append(res)
            _write(args.out, info, rows)
            print(f"{mode:9s} {impl:13s} " + (f"{res['tokens_per_s']:9.0f} tokens/s ({res['ms']:.1f} ms/step, "
                                             f"{res['steps']} steps)" if "tokens_per_s" in res else
                                             ("WRONG " + str(res) if res.get("wrong") else
                                              res.get("error", "compiled and checked (--compile-only)"))),
                  f" first call {res.get('first_call_s')} s", flush=True)
            if be is not None:
                print(f"  acefuse took {res['taken']} regions; left to torch: {len(res['left'])}")
                for err in res["inductor_errors"]:
                    print("   - Inductor could not compile a graph (ran eagerly):", err)
                for line in sorted(set(res["left"])):
                    print("   -", line)
            del model
            if cuda:
                torch.cuda.empty_cache()
    for mode in modes:
        t = {r["impl"]: r.get("tokens_per_s") for r in rows if r["mode"] == mode}
        for impl in ("acefuse", "acefuse-eager"):
            if t.get(impl) and t.get("eager"):
                print(f"{mode}: {impl} / eager {t[impl] / t['eager']:.2f}x"
                      + (f", {impl} / inductor {t[impl] / t['inductor']:.2f}x" if t.get("inductor") else ""))
    _write(args.out, info, rows)
    skipped = [f"{r['mode']} {r['impl']}" for r in rows if r.get("skipped")]
    if skipped:
        print("bench_models: skipped at the time limit (run them apart, or raise --time-limit):", ", ".join(skipped))
    bad = [f"{r['mode']} {r['impl']}" for r in rows if r.get("wrong") or r.get("error")]
    if bad:
        print("bench_models: wrong or failed:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
