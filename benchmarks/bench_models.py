"""A Llama-shaped model through the frontend on the GPU: training and inference tokens/s of
``torch.compile(model, backend=af.Backend(inner=...))`` against eager torch and ``torch.compile``
(Inductor), in one run, on the same inputs (Hugging Face ``LlamaForCausalLM``, random init,
bf16 weights, SDPA attention). Implementations (``--impls``, default all):

- ``eager``: torch, op by op (the reference every other one is checked against);
- ``inductor``: ``torch.compile(backend="inductor")``;
- ``acefuse``: ``af.Backend(inner="inductor")``: acefuse's regions as opaque ops inside the graph
  Inductor compiles (the default on CUDA);
- ``acefuse-eager``: ``af.Backend(inner="eager")``: acefuse's regions, the rest op by op in torch.

    python3 benchmarks/bench_models.py [--quick] [--mode inference|training|both]
        [--impls eager,inductor,acefuse,acefuse-eager] [--take attention,loss,softmax,norm]
        [--out f.json]                                                 # needs egglog (carry the wheel)

``--take`` restricts the region kinds acefuse takes (``af.Backend(take=...)``); the rest is
Inductor's (or eager torch's): which of acefuse's kernels beat Inductor's fusion in the model.

A training step is forward + loss + backward + AdamW step, with a fixed batch. Before timing,
each implementation's loss (and, for training, the gradient norm of every parameter) is
compared with eager's on the same weights; a mismatch is reported, never timed. The
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


def config(quick):
    import transformers as tf
    if quick:
        return tf.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096), 4, 1024
    return tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096), 4, 2048


def build(cfg):
    import transformers as tf
    torch.manual_seed(0)
    cfg._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = tf.LlamaForCausalLM(cfg)
    return m.to("cuda", torch.bfloat16)


IMPLS = ("eager", "inductor", "acefuse", "acefuse-eager")
INNER = {"acefuse": "inductor", "acefuse-eager": "eager"}


def timed(fn, steps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--mode", choices=("inference", "training", "both"), default="both")
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
    modes = ("inference", "training") if args.mode == "both" else (args.mode,)
    if not torch.cuda.is_available():
        print("bench_models: needs a CUDA GPU")
        return 2
    import acefuse as af
    cfg, B, T = config(args.quick)
    import transformers
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; transformers {transformers.__version__}"
          + (f"; acefuse takes {args.take}" if args.take else ""))
    print(f"Llama: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, heads {cfg.num_attention_heads}/"
          f"{cfg.num_key_value_heads}, vocab {cfg.vocab_size}; batch {B} x {T} tokens, bf16")
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda", generator=g)
    base = build(cfg)
    rows = []
    for mode in modes:
        ref = None
        for impl in impls:
            res = {"mode": mode, "impl": impl}
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
                torch.cuda.synchronize()
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
                    sec = timed(step, args.steps)
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
            print(f"{mode:9s} {impl:13s} " + (f"{res['tokens_per_s']:9.0f} tokens/s ({res['ms']:.1f} ms/step)"
                                             if "tokens_per_s" in res else
                                             ("WRONG " + str(res) if res.get("wrong") else res.get("error", ""))),
                  f" first call {res.get('first_call_s')} s", flush=True)
            if be is not None:
                print(f"  acefuse took {res['taken']} regions; left to torch: {len(res['left'])}")
                for err in res["inductor_errors"]:
                    print("   - Inductor could not compile a graph (ran eagerly):", err)
                for line in sorted(set(res["left"])):
                    print("   -", line)
            del model
            torch.cuda.empty_cache()
    for mode in modes:
        t = {r["impl"]: r.get("tokens_per_s") for r in rows if r["mode"] == mode}
        for impl in ("acefuse", "acefuse-eager"):
            if t.get(impl) and t.get("eager"):
                print(f"{mode}: {impl} / eager {t[impl] / t['eager']:.2f}x"
                      + (f", {impl} / inductor {t[impl] / t['inductor']:.2f}x" if t.get("inductor") else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), B=B, T=T,
                                                  hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, rows=rows),
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
