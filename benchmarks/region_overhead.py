"""What each acefuse region of a Llama costs around its kernel: host time per call, bytes the
call allocates, and the copies and casts it runs or leaves in the graph around it (issue 12:
the backend slower than Inductor on a Llama).

    python3 benchmarks/region_overhead.py [--size tiny|quick|full] [--inner eager|inductor]
        [--mode inference|training] [--take attention,loss,...] [--calls 50] [--profile N]

For every region of the compiled model (one forward through
``torch.compile(model, backend=af.Backend(inner=...))``), on the region's recorded inputs:

- ``host us``: time of one region call from Python. On the CPU the Triton launches are stubbed
  (no-ops: the interpreter would dominate), so what is timed is acefuse's Python path (input
  adapters, argument binding, the launcher, output adapters). On a GPU the calls are issued
  without synchronising, so the time is the host's as long as it exceeds the kernels'
  (``gpu us`` is the synchronised time per call, kernels included; ``torch us``, with
  ``--inner eager`` on a GPU, the same region run by its own torch ops, for comparison);
- ``bwd us`` (``--mode training``, ``--inner eager``): host time of the region's backward, the
  time of its call followed by ``torch.autograd.grad`` of its outputs (ones) with respect to its
  inputs that require grad, minus ``host us``; the backward kernels are compiled and run before
  anything is timed;
- ``alloc MB``: bytes of the tensors the call allocates (every ATen op's outputs, views
  excluded: kernel outputs, widened copies, layout copies), and ``copies``: the ATen copies
  and casts it runs (``_to_copy``, ``copy_``, ``clone``, ``repeat_interleave`` ...), by name;
- ``graph casts``: the cast/copy nodes in the graph next to the region (producers of its inputs
  and consumers of its outputs), which torch or Inductor runs around it.

With ``--inner inductor`` the recorded call is the ``acefuse::region`` op (its inputs already
through the adapters Inductor compiled); with ``--inner eager`` it is the whole region module.
``--size tiny`` runs anywhere (the CPU smoke configuration); ``quick`` and ``full`` are
bench_models.py's. ``--profile N``: a cProfile of each region kind's calls (own time, top N).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

COPY_OPS = ("_to_copy", "copy_", "clone", "contiguous", "repeat_interleave", "expand_copy", "_unsafe_view",
            "index", "cat")


class _Allocs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what ATen ops run under it: bytes of non-view outputs, and copies/casts by name."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.copies: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view:
            return out
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and name not in ("detach", "alias"):
                self.bytes += t.numel() * t.element_size()
        if name in COPY_OPS:
            self.copies[name] = self.copies.get(name, 0) + 1
        return out


@contextlib.contextmanager
def _stubbed_launches(on):
    """Triton launches as no-ops (the CPU interpreter would otherwise dominate the time)."""
    if not on:
        yield
        return
    from triton.runtime import interpreter
    old = interpreter.InterpretedFunction.__getitem__
    interpreter.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)
    try:
        yield
    finally:
        interpreter.InterpretedFunction.__getitem__ = old


def _graph_casts(gm, node) -> list:
    """Cast/copy nodes next to a region's call in the specialised graph: producers of its inputs,
    consumers of its outputs (through getitem)."""
    from acefuse.frontend.lower import kind_of
    out = []
    for a in node.all_input_nodes:
        if a.op in ("call_function", "call_method") and kind_of(a) == "cast":
            out.append(f"in:{a.target if isinstance(a.target, str) else a.target.__name__}")
    users = list(node.users)
    for u in list(users):
        if u.op == "call_function" and getattr(u.target, "__name__", "") == "getitem":
            users += list(u.users)
    for u in users:
        if u.op in ("call_function", "call_method") and kind_of(u) == "cast":
            out.append(f"out:{u.target if isinstance(u.target, str) else u.target.__name__}"
                       f"({u.meta.get('af_val').dtype if isinstance(u.meta.get('af_val'), torch.Tensor) else ''})")
    return out


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _best(call, calls, sync, repeats=5):
    """Seconds per call: the best of ``repeats`` loops of ``calls`` calls (a shared machine's noise
    only adds time); ``sync``: wait for the GPU at the end of each loop (kernels included)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        if sync:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _profile(name, call, calls, top):
    """cProfile of ``calls`` calls of one region, by own time (the ``top`` lines)."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        call()
    pr.disable()
    print(f"--- profile of {calls} calls of {name} (by own time)")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def _backward_step(srcs, call_on):
    """A training step of one region (``call_on(args)`` calls it): its call on leaf copies of its
    recorded inputs ``srcs``, then the gradients of its float outputs (ones) with respect to those
    that require grad: the region's backward kernels only. None when no gradient flows."""
    srcs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in srcs]
    ins = [a for a in srcs if isinstance(a, torch.Tensor) and a.requires_grad]

    def call():
        return call_on(srcs)
    outs = [o for o in call() if isinstance(o, torch.Tensor) and o.requires_grad]
    if not ins or not outs:
        return None
    cot = [torch.ones_like(o) for o in outs]

    def step():
        res = [o for o in call() if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.grad(res, ins, grad_outputs=cot, allow_unused=True)
    return step


def measure(size="tiny", inner="eager", mode="inference", take=None, calls=50, dtype=torch.bfloat16, profile=0):
    import acefuse as af
    import bench_models as bm
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, B, T = bm.config(size)
    model = bm.build(cfg, dev, dtype)
    model.train(mode == "training")
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g)
    be = af.Backend(inner=inner, take=take)
    torch._dynamo.reset()
    fn = torch.compile(lambda i: model(input_ids=i, labels=i).loss, backend=be, dynamic=False)
    recorded = {}         # region -> (callable, args)

    from acefuse.frontend import inductor as ind
    from acefuse.frontend.runtime import CompiledRegion
    orig_region, orig_op = CompiledRegion.forward, ind.RegionOp.forward

    def rec_region(self, *srcs):
        recorded.setdefault(id(self), (f"{self.program.name}", lambda s=self, a=srcs: orig_region(s, *a), self,
                                       lambda s=self, a=srcs: s.fallback(*a),
                                       (srcs, lambda a, s=self: orig_region(s, *a))))
        return orig_region(self, *srcs)

    def rec_op(self, xs):
        recorded.setdefault(id(self), (f"{self.prog.name}", lambda s=self, a=list(xs): orig_op(s, a), self.region,
                                       None, None))
        return orig_op(self, xs)

    CompiledRegion.forward, ind.RegionOp.forward = rec_region, rec_op
    try:
        ctx = torch.no_grad() if mode == "inference" else contextlib.nullcontext()
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = fn(ids)
            if mode == "training":
                loss.backward()
            _sync(dev)
    finally:
        CompiledRegion.forward, ind.RegionOp.forward = orig_region, orig_op
    # the specialised graphs: where each region sits, and the casts around it
    around = {}
    for cf in be.functions:
        for gr in cf.graphs.values():
            gm = getattr(gr, "gm", gr)
            for n in gm.graph.nodes:
                if n.op == "call_module" and n.target.startswith("af_region"):
                    around[id(gm.get_submodule(n.target))] = _graph_casts(gm, n)
                elif n.op == "call_function" and getattr(n.target, "__name__", "") == "region_call":
                    reg = ind._entry(n.args[0]).region
                    around[id(reg)] = _graph_casts(gm, n)
    rows = []
    profiled: set = set()
    stub = dev == "cpu"
    for key, (name, call, region, torch_call, srcs) in recorded.items():
        step = _backward_step(*srcs) if mode == "training" and srcs is not None else None
        grad_ctx = torch.no_grad() if mode == "inference" else contextlib.nullcontext()
        with grad_ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _stubbed_launches(stub):
                for _ in range(3):
                    call()
                    if step is not None:    # (the backward kernels compiled and warm before timing)
                        step()
                _sync(dev)
                mode_ = _Allocs()
                with mode_:
                    call()
                host = _best(call, calls, sync=False)
                bwd = _best(step, calls, sync=False) - host if step is not None else None
                if profile and name not in profiled:
                    profiled.add(name)
                    _profile(name, call, calls, profile)
            gpu = _best(call, calls, sync=True) if dev == "cuda" else None
            # the same region as torch's own ops (inner="eager" records their sources)
            ref = _best(torch_call, calls, sync=True) if torch_call is not None and dev == "cuda" else None
        rows.append(dict(region=name, host_us=host * 1e6, bwd_us=None if bwd is None else bwd * 1e6, gpu_us=None if gpu is None else gpu * 1e6,
                         torch_us=None if ref is None else ref * 1e6,
                         alloc_mb=mode_.bytes / 2 ** 20, copies=dict(mode_.copies),
                         graph_casts=around.get(id(region), [])))
    return rows, dict(device=dev, size=size, inner=inner, mode=mode, B=B, T=T, hidden=cfg.hidden_size,
                      stubbed=stub, regions=len(rows))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=("tiny", "quick", "full"), default="tiny")
    ap.add_argument("--inner", choices=("eager", "inductor"), default="eager")
    ap.add_argument("--mode", choices=("inference", "training"), default="inference")
    ap.add_argument("--take", default=None)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile each region kind's calls (the first region of each name), top N by own time")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    take = None if a.take is None else [k for k in a.take.split(",") if k]
    rows, info = measure(a.size, a.inner, a.mode, take, a.calls, profile=a.profile)
    print(f"regions of a Llama ({info['size']}: hidden {info['hidden']}, batch {info['B']} x {info['T']}, bf16) "
          f"on {info['device']}, inner={info['inner']}, {info['mode']}"
          + (" (Triton launches stubbed: host time only)" if info["stubbed"] else ""))
    print(f"{'region':40s} {'host us':>8s} {'bwd us':>8s} {'gpu us':>8s} {'torch us':>8s} {'alloc MB':>9s}  "
          "copies in the call | casts in the graph")
    tot = {"host_us": 0.0, "bwd_us": 0.0, "gpu_us": 0.0, "torch_us": 0.0, "alloc_mb": 0.0}

    def num(v, w=8, p=1):
        return f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}s}"

    for r in rows:
        for k in tot:
            tot[k] += r[k] or 0.0
        cps = ", ".join(f"{k} x{v}" for k, v in sorted(r["copies"].items())) or "none"
        print(f"{r['region'][:40]:40s} {num(r['host_us'])} {num(r['bwd_us'])} {num(r['gpu_us'])} {num(r['torch_us'])} "
              f"{num(r['alloc_mb'], 9, 3)}  {cps} | {', '.join(r['graph_casts']) or 'none'}")
    print(f"total over {len(rows)} regions per forward: host {tot['host_us']:.1f} us"
          + (f", backward {tot['bwd_us']:.1f} us" if info["mode"] == "training" else "")
          + (f", gpu {tot['gpu_us']:.1f} us, torch's ops {tot['torch_us']:.1f} us" if info["device"] == "cuda" else "")
          + f", {tot['alloc_mb']:.3f} MB allocated")
    if a.out:
        import json
        Path(a.out).write_text(json.dumps(dict(info, rows=rows), indent=1, default=str))
    print("(host us: the forward call, min over 5 loops, launches stubbed on the CPU; bwd us: training with "
          "inner=eager, the region's backward (host time of call + autograd.grad to its inputs, minus host us); gpu us: synchronised, kernels included; "
          "torch us: the region's own torch ops, inner=eager only; alloc MB: tensors the call creates)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
