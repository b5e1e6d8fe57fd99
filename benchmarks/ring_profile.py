"""Where the context-parallel ring's time goes (issue 16): acefuse's zig-zag ring
(``exchange="ring"``) on causal attention, per call and per ring step.

    torchrun --standalone --nproc_per_node=4 benchmarks/ring_profile.py --seq-len 32768 --out-dir /tmp/ringprof
    python benchmarks/ring_profile.py --cpu-count       # 4 gloo ranks, Triton's interpreter: ops and bytes

On GPUs (bf16, B=1, H=32, D=128) it reports, for the folding ring (each block's kernel takes
the running states and folds its block into them; the last block writes the outputs), the
lookup ring (``ring_positions = "lookup"``: one block kernel per step, global positions as
lookups; its blocks are not timed alone) and for the torch-merge ring (``ring_fold = False``: the partial kernel writes the block's states and
the derived merge runs in torch):

1. the call's time (CUDA events, median of ``--reps``, slowest rank) and the host's time to
   issue it (no synchronisation inside: when the host takes longer than the GPU, the GPU waits);
2. each block's kernel alone (CUDA events, the same inputs), the sum of them (the ring's
   compute with nothing else), and the model: FLOPs at 450 and 600 TFLOP/s, bytes of the
   float32 states at 4.2 TB/s;
3. a torch.profiler trace of two calls on rank 0: the top GPU kernels by total time, and the
   timeline of one call (each GPU kernel's start relative to the call, duration, stream, and
   the ring step it belongs to by its ``ring step s`` annotation): whether the ring's sends
   and receives (NCCL kernels, their own stream) overlap the block kernels, and whether the
   diagonal blocks (step 0) take about half a full block (causal tile skipping with runtime
   offsets). The chrome trace is written to ``--out-dir``.

``--cpu-count`` counts, on the CPU (4 gloo ranks, tiny sizes), per ring call of rank 0: the
block kernels launched by kind, and every torch op outside them with the bytes it reads and
writes, in units of one query piece's float32 accumulator (the model's unit: on 4 H200s at
N=32K one such accumulator is B*H*(N/8)*D*4 = 64 MiB).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time
from pathlib import Path

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def causal_kernel(D, name="causal_attention"):
    import acefuse as af
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    s = af.where(af.index("j") <= af.index("i"), af.sum(q * k, "d") * (1 / math.sqrt(D)), af.NEG_INF)
    mx = af.max(s, "j")
    p = af.exp(s - mx)
    return af.compile(af.program(name, o=af.sum(p * v, "j") / af.sum(p, "j")))


def zigzag_inputs(N, B, H, D, world, rank, device, dtype):
    C = N // (2 * world)
    idx = torch.cat([torch.arange(rank * C, rank * C + C), torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)])
    gen = torch.Generator().manual_seed(N)
    return {t: torch.randn(B, H, N, D, generator=gen)[:, :, idx].contiguous().to(device=device, dtype=dtype)
            for t in "qkv"}


def sharded(kern, n, world):
    """The ShardedKernel the calls below use (kept on the kernel by call_sharded)."""
    return next(sk for key, sk in kern.__dict__["_acefuse_sharded"].items() if key[2] == "ring")


# ---- the CPU count ----------------------------------------------------------------------------
class _Count:
    """Counts aten ops and the bytes of their tensor arguments and results (views count their
    size too: they are listed, and left out of the total of moved bytes)."""
    VIEWS = {"view", "slice", "select", "expand", "as_strided", "_unsafe_view", "reshape", "narrow",
             "empty", "empty_like", "new_empty", "send", "recv_", "full", "detach", "alias", "t", "unsqueeze",
             "squeeze", "permute"}

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if self.on:
                    name = str(func.overloadpacket.__name__)
                    ts = [a for a in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor)]
                    self.ops[name] += 1
                    self.bytes[name] += sum(a.numel() * a.element_size() for a in ts if a.numel() > 1)
                return out
        self.mode = Mode()
        self.ops, self.bytes, self.on = collections.Counter(), collections.Counter(), True


def _cpu_count_rank(rank, world, init, n):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from acefuse.distributed import sharded as sh
    B, H, D = 1, 2, 16
    kern = causal_kernel(D, "ring_count")
    loc = zigzag_inputs(n * world, B, H, D, world, rank, torch.device("cpu"), torch.float32)

    def call():
        return kern(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring", zigzag=("i",),
                    shard_sizes=[n] * world)
    call()
    sk = sharded(kern, n, world)
    acc = B * H * (n // 2) * D * 4
    for fold in (True, False):
        sk.ring_fold = fold
        call()
        cnt, launches = _Count(), collections.Counter()
        o_fold, o_part = sh.ShardedKernel._run_fold, sh.ShardedKernel._run_partial

        def run_fold(self, inputs, opts, offsets, gsizes, run, final):
            cnt.on = False
            try:
                return o_fold(self, inputs, opts, offsets, gsizes, run, final)
            finally:
                cnt.on = True
                launches[("carry" if run is not None else "first") + (" final" if final else "")] += 1

        def run_partial(self, *a, **kw):
            cnt.on = False
            try:
                return o_part(self, *a, **kw)
            finally:
                cnt.on = True
                launches["partial (states out)"] += 1
        sh.ShardedKernel._run_fold, sh.ShardedKernel._run_partial = run_fold, run_partial
        try:
            with cnt.mode:
                call()
        finally:
            sh.ShardedKernel._run_fold, sh.ShardedKernel._run_partial = o_fold, o_part
        if rank == 0:
            moved = sum(b for o, b in cnt.bytes.items() if o not in _Count.VIEWS)
            print(f"\n== ring {'folding in the kernels' if fold else 'merging in torch'} (rank 0 of {world}, "
                  f"zig-zag, {n} keys per rank) ==")
            print(f"block kernels: {dict(launches)}")
            print(f"torch ops outside them: {sum(cnt.ops.values())}; bytes moved (views, allocations and the "
                  f"ring's send/recv left out) {moved / acc:.1f} accumulator units")
            for o, c in cnt.ops.most_common():
                print(f"  {o:16s} {c:4d} calls  {cnt.bytes[o] / acc:7.2f} units" + ("  (view/alloc/comm)"
                                                                                     if o in _Count.VIEWS else ""))
    dist.destroy_process_group()


# ---- the GPU profile --------------------------------------------------------------------------
def _events_ms(fn, reps):
    """Median ms of ``fn`` (CUDA events; wall time on the CPU for --cpu-dry), after 3 warm-up calls."""
    from bench_distributed import timed_local
    return timed_local(fn, reps, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _host_ms(fn, reps):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / reps
    sync()
    return host


def _slowest(x, device):
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _blocks_alone(sk, loc, world, rank, reps):
    """Each block of this rank's ring, its kernel timed alone on the same data (the K/V chunks
    of every rank are made here from the same generator): [(step, piece, key offset, kind, ms)]."""
    n = loc["k"].shape[2]
    sizes = [n] * world
    ins = {"q": loc["q"]}
    pieces = sk._pieces(ins, ("i",), {}, sizes, rank)
    kv_shapes = {t: loc[t].shape for t in ("k", "v")}
    plan = sk._ring_plan(pieces, sizes, rank, ("i",), {"j": n * world}, kv_shapes)
    fold = sk._fold_mode()
    opts = dict(sk.block_launch or {})   # the ring's own launch options for its block kernels
    out, runs = [], [None] * len(pieces)
    last = {}
    for step, blocks in enumerate(plan):
        for b, blk in enumerate(blocks):
            last[blk[3]] = (step, b)
    for step, blocks in enumerate(plan):
        for b, (start, n_src, off, h) in enumerate(blocks):
            kv = {t: loc[t].narrow(2, start, n_src) for t in ("k", "v")}   # (this rank's data: the cost is the same)
            pin, offs, _ = pieces[h]
            offs = dict(offs, j=off)
            final = bool(fold == "final" and last[h] == (step, b))
            if fold:
                def fn(run=runs[h], final=final):
                    return sk._run_fold({**pin, **kv}, opts, offs, {"j": n * world}, run, final)
            else:
                def fn():
                    return sk._partial_states({**pin, **kv}, opts, offs, {"j": n * world}, n_src)
            ms = _events_ms(fn, reps)
            carried = fold and runs[h] is not None
            res = fn()
            if fold and not final:
                runs[h] = (res, n_src + (runs[h][1] if runs[h] else 0))
            kind = ("diagonal" if off == pieces[h][1].get("i") else "full") + (" +fold" if carried else "")
            out.append((step, h, off, kind + (" final" if final else ""), ms))
    return out


def _timeline(trace_path, call_marker="ring call 1"):
    """GPU kernels of one call from a chrome trace: [(start us from the call's first kernel,
    duration us, stream, name, ring step)]. Steps come from the gpu_user_annotation ranges."""
    data = json.loads(Path(trace_path).read_text())
    ev = data["traceEvents"] if isinstance(data, dict) else data
    anns = [e for e in ev if e.get("cat") == "gpu_user_annotation"]
    call = next((e for e in anns if e.get("name") == call_marker), None)
    kernels = [e for e in ev if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if call is not None:
        lo, hi = call["ts"], call["ts"] + call["dur"]
        kernels = [e for e in kernels if lo <= e["ts"] <= hi]
    steps = [e for e in anns if str(e.get("name", "")).startswith("ring step")]
    kernels.sort(key=lambda e: e["ts"])
    if not kernels:
        return []
    t0 = kernels[0]["ts"]
    rows = []
    for e in kernels:
        st = next((s["name"] for s in steps if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]), "")
        rows.append((e["ts"] - t0, e["dur"], e.get("args", {}).get("stream", "?"), e["name"], st))
    return rows


def gpu_main(args, cpu_dry=False):
    """The GPU profile (``cpu_dry``: the same flow on gloo ranks with tiny sizes, a check of
    this script on the CPU; its times mean nothing)."""
    from torch.profiler import profile, ProfilerActivity, record_function
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cpu_dry:
        device, (B, H, D, N), dtype = torch.device("cpu"), (1, 2, 16, 8 * world), torch.float32
    else:
        device, (B, H, D, N), dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), \
            (1, 32, 128, args.n), torch.bfloat16
        torch.cuda.set_device(device)
    kern = causal_kernel(D, "causal_attention" if not cpu_dry else "ring_dry")
    loc = zigzag_inputs(N, B, H, D, world, rank, device, dtype)
    n = loc["q"].shape[2]

    def call():
        return kern(**loc, process_group=dist.group.WORLD, sharded_axis="j", exchange="ring", zigzag=("i",),
                    shard_sizes=[n] * world)
    call()
    sk = sharded(kern, n, world)
    c = n // 2
    flops_step = 2 * 4.0 * B * H * c * c * D   # per step: two full (c x c) blocks' worth (step 0: 1 full + 2 halves)
    acc_bytes = B * H * c * D * 4
    report = {"N": N, "world": world, "rank": rank, "modes": {}, "block_launch": dict(sk.block_launch or {})}
    # the one-process causal kernel (constant offsets, bf16 output, its own timed launch) on the
    # work of one diagonal block: this rank's first chunk against itself
    diag = {t: loc[t][:, :, :c].contiguous() for t in "qkv"}
    dist.barrier()
    report["diagonal_block_by_the_one_gpu_kernel_ms"] = _events_ms(lambda: kern(**diag), args.reps)
    if rank == 0:
        print(f"ring block kernels launched with {report['block_launch'] or 'the launcher defaults'}; the one-GPU "
              f"causal kernel on one diagonal block ({c} x {c}): {report['diagonal_block_by_the_one_gpu_kernel_ms']:.3f} ms",
              flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for mode, fold, positions in (("fold", True, None), ("torch-merge", False, None), ("lookup", True, "lookup")):
        sk.ring_fold, sk.ring_positions = fold, positions
        dist.barrier()
        call()   # (the lookup ring's first call compiles its kernels)
        ms = _slowest(_events_ms(call, args.reps), device)
        dist.barrier()
        host = _slowest(_host_ms(call, args.reps), device)
        dist.barrier()
        # (the lookup ring: one kernel per step; its blocks are not timed alone here)
        blocks = _blocks_alone(sk, loc, world, rank, max(5, args.reps // 2)) if positions is None else []
        comp = sum(b[-1] for b in blocks)
        comp_max = _slowest(comp, device)
        report["modes"][mode] = {"ms": ms, "host_ms": host, "blocks_alone_ms_this_rank": comp,
                                 "blocks_alone_ms_slowest_rank": comp_max, "blocks": blocks}
        if rank == 0:
            print(f"\n== {mode}: N={N}, {world} ranks, zig-zag ==")
            print(f"call {ms:.3f} ms (slowest rank; CUDA events, median of {args.reps}); host issue time {host:.3f} ms")
            print(f"block kernels alone: {comp:.3f} ms on rank 0, {comp_max:.3f} ms on the slowest rank")
            print("model: compute %.3f-%.3f ms (%d steps x %.0f GFLOP at 600/450 TFLOP/s); one float32 accumulator "
                  "%.1f MiB = %.3f ms at 4.2 TB/s per read or write" % (
                      world * flops_step / 600e9, world * flops_step / 450e9, world, flops_step / 1e9,
                      acc_bytes / 2 ** 20, acc_bytes / 4.2e9))
            for step, h, off, kind, bms in blocks:
                print(f"  step {step} piece {h} key offset {off:7d} {kind:22s} {bms:.3f} ms")
        # the trace: two calls, each step annotated (sharded.py's ring has record_function ranges)
        dist.barrier()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not cpu_dry else [])
        with profile(activities=acts) as prof:
            for i in range(2):
                with record_function(f"ring call {i}"):
                    call()
            if not cpu_dry:
                torch.cuda.synchronize()
        if rank == 0:
            path = out_dir / f"ring_{mode}_N{N}_rank0.json"
            prof.export_chrome_trace(str(path))
            print(prof.key_averages().table(sort_by="cpu_time_total" if cpu_dry else "cuda_time_total",
                                            row_limit=args.top))
            rows = _timeline(path)
            print(f"timeline of one call (rank 0, {mode}): start_us dur_us stream step kernel")
            for t, d, s, name, st in rows:
                print(f"  {t:9.1f} {d:8.1f} {str(s):>4s} {st:12s} {name[:90]}")
            busy = sum(d for _, d, _, name, _ in rows if "nccl" not in name.lower())
            span = (rows[-1][0] + rows[-1][1]) if rows else 0.0
            print(f"  compute-stream busy {busy / 1e3:.3f} ms of a {span / 1e3:.3f} ms span")
    sk.ring_fold, sk.ring_positions = True, None
    if rank == 0:
        report["modes"] = {m: {k: v for k, v in r.items()} for m, r in report["modes"].items()}
        (out_dir / f"ring_profile_N{N}.json").write_text(json.dumps(report, indent=1))
        print("results:", out_dir / f"ring_profile_N{N}.json")
    dist.barrier()
    dist.destroy_process_group()


def _dry_rank(rank, world, init, args):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    args.reps = 2
    gpu_main(args, cpu_dry=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", dest="n", type=int, default=32768, help="global sequence length (GPU)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=15, help="rows of the top-kernels table")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/ring_profile"))
    ap.add_argument("--cpu-count", action="store_true", help="count ops and bytes per ring call on the CPU")
    ap.add_argument("--world", type=int, default=4, help="--cpu-count: gloo ranks")
    ap.add_argument("--local", type=int, default=16, help="--cpu-count: keys per rank")
    ap.add_argument("--cpu-dry", action="store_true", help="the GPU flow on 2 gloo ranks, tiny sizes (a check)")
    args = ap.parse_args()
    if args.cpu_dry:
        import tempfile
        import torch.multiprocessing as mp
        os.environ["TRITON_INTERPRET"] = "1"
        fd, path = tempfile.mkstemp(prefix="acefuse_ringdry_")
        os.close(fd)
        os.unlink(path)
        mp.spawn(_dry_rank, args=(2, "file://" + path, args), nprocs=2)
        return 0
    if args.cpu_count:
        import tempfile
        import torch.multiprocessing as mp
        os.environ["TRITON_INTERPRET"] = "1"
        fd, path = tempfile.mkstemp(prefix="acefuse_ringcount_")
        os.close(fd)
        os.unlink(path)
        mp.spawn(_cpu_count_rank, args=(args.world, "file://" + path, args.local), nprocs=args.world)
        return 0
    gpu_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
