"""The derived merge as a collective, on several GPUs (NCCL): acefuse's sharded kernels
(acefuse/distributed.py) against their peers, in one run, on the same inputs (bf16).

    torchrun --standalone --nproc_per_node=4 benchmarks/bench_distributed.py --out benchmarks/results/dist_4gpu.json
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_distributed.py --part cp --cp-lens 131072
    python benchmarks/bench_distributed.py --cpu-smoke        # 2 gloo ranks, tiny sizes, Triton's interpreter

First calls compile: the sharded kernels take the global offsets as runtime inputs, so
each is compiled (and its launch timed) once, whatever rank or visiting shard. The ring's block
kernels share one launch choice (timed once per block shape on the first block's kernel, the
ranks compiling a share of the candidates each; ``ACEFUSE_RING_TILES`` fixes it, see
acefuse/distributed/ring.py ``_block_opts``), and before the one-GPU baseline every rank compiles
a share of its launch candidates (``share_compiles``), so rank 0's timing finds them in Triton's
cache (one per host: keep TRITON_CACHE_DIR and ACEFUSE_CACHE_DIR the same for every rank).
``--one-gpu-reps`` / ``--one-gpu-max-len`` shorten or skip the one-GPU baseline (a skipped one is
reported as skipped). Split long runs by ``--part`` and ``--cp-lens`` (the kernel caches persist
between runs on one machine). Rank 0 prints its progress with the time since the start and
rewrites ``--out`` after every row, so a run stopped by a time limit keeps what it measured.

Parts (``--part ce|cp|decode|all``):

- **ce**, vocab-parallel cross-entropy (a tensor-parallel LM head: logits [T, V] sharded
  over the vocabulary, T=8192, V=128256): ``af.compile(cross_entropy)`` called with
  ``process_group=`` / ``sharded_axis="j"`` (one all-gather of per-row states (max, sum of
  exponentials), the target logit and its owner flag, merged with the derived merge) against
  Megatron's scheme written in torch (all-reduce MAX of the row max, all-reduce SUM of the
  target logit, all-reduce SUM of the sum of exponentials: three collectives). GB/s count one
  read of the local logits per rank.
- **cp**, context-parallel causal prefill (B=1, H=32, D=128, N = 32K, 64K, 128K; queries,
  keys and values sharded along the sequence): acefuse's ``exchange="gather"`` (all-gather
  of K/V, then the causal kernel on the local queries with their global offset) and
  ``exchange="ring"`` (K/V shards passed around the ring, each visiting shard's partial
  states folded in with the derived merge inside the block's kernel; benchmarks/ring_profile.py
  breaks its time down per step), each with contiguous shards (the last rank has
  the most causal work) and with the zig-zag layout (``zigzag=("i",)``: rank r holds chunks
  r and 2W-1-r, balanced; ``ring-zigzag-lookup``: the zig-zag ring with one block kernel per step,
  global positions read from 1-D tensors, ACEFUSE_RING_POSITIONS=lookup), against PyTorch's
  ``torch.distributed.tensor.experimental.context_parallel`` (ring attention over SDPA,
  its default load balancing and rotate method). TFLOP/s count the causal forward's FLOPs,
  2*B*H*N*N*D (4*B*H*N*N*D / 2), over all ranks.
- **decode**, sharded-KV decode (B=8, H=32, D=128, KV length 128K split across ranks, one
  query per sequence): the sharded kernel (states exchange) against the same kernel on one
  GPU holding the whole cache.

Scaling: every part also times the same global problem on one GPU (acefuse's kernel, rank
0 alone, others waiting) and reports the speed-up and the scaling efficiency
``t_1 / (W * t_W)``.

Every implementation's result is checked before it is timed (against float32 torch on the
whole input: F.cross_entropy, SDPA on the whole sequence); a wrong result is reported, never
timed. Timing: CUDA events around ``--reps`` calls after warm-up, all ranks in step
(barrier before each measurement); a rank's time is its own, the reported time the slowest
rank's (the collective waits for it). Results: JSON (``--out``) written by rank 0 and a
table on stdout.
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

# NVLink multicast stays off (shared hosts: docs of the lent machines), also for the ranks
# torchrun starts with this environment
for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CE = (8192, 128256)
CP_LENS = (32768, 65536, 131072)
CP_SHAPE = (1, 32, 128)                 # B, H, D
DEC = (8, 32, 128, 131072)              # B, H, D, KV length
TOL_GPU = (3e-2, 6e-2)                  # (norm-relative, max-relative) for bf16 results
TOL_CPU = (1e-4, 1e-4)


# ---- the programs ---------------------------------------------------------------------------
def programs():
    import acefuse as af
    x = af.tensor("x", "r j")
    t = af.tensor("t", "r")
    m = af.max(x, "j")
    l = af.sum(af.exp(x - m), "j")
    ce = af.program("cross_entropy", loss=m + af.log(l) - af.take(x, t, "j"))
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")

    def attention(name, scale, causal):
        s = af.sum(q * k, "d") * scale
        if causal:
            s = af.where(af.index("j") <= af.index("i"), s, af.NEG_INF)
        mx = af.max(s, "j")
        p = af.exp(s - mx)
        return af.program(name, o=af.sum(p * v, "j") / af.sum(p, "j"))
    D = CP_SHAPE[2]
    return {"ce": ce, "causal": attention("causal_attention", 1 / math.sqrt(D), True),
            "decode": attention("decode_attention", 1 / math.sqrt(D), False)}


# ---- helpers --------------------------------------------------------------------------------
def rel_err(got, want):
    got, want = got.double(), want.double()
    d = (got - want).norm() / max(want.norm().item(), 1e-30)
    mx = (got - want).abs().max() / max(want.abs().max().item(), 1e-30)
    return d.item(), mx.item()


def ok(got, want, tol):
    if not torch.isfinite(got.float()).all():
        return False, "non-finite values"
    n, m = rel_err(got, want)
    return n <= tol[0] and m <= tol[1], f"norm-rel {n:.2e}, max-rel {m:.2e}"


def checked_timed(fn, want, tol, reps, device, got=None):
    """Checks ``got`` (default: ``fn()``) against ``want`` on every rank, and only when every
    rank's is right times ``fn`` (``timed``; the slowest rank's ms). Returns (ms or None,
    this rank's errors as text, whether every rank was right)."""
    good, why = ok(fn() if got is None else got, want, tol)
    flags = torch.tensor([1 if good else 0], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    good = bool(flags.item())
    ms = slowest(timed(fn, reps, device), device) if good else None
    return ms, why, good


def error_text(e):
    """An exception for a result row: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def timed(fn, reps, device, group=None):
    """Median ms of ``fn`` over ``reps`` calls on this rank (after 3 warm-up calls); ranks
    enter in step."""
    return timed_local(fn, reps, device, barrier=lambda: dist.barrier(group=group))


def slowest(ms, device):
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def split(n, world):
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def one_gpu(fn, reps, device):
    """Rank 0 times ``fn`` alone (the one-GPU baseline); the others wait. None elsewhere."""
    ms = None
    if dist.get_rank() == 0:
        ms = timed_local(fn, reps, device)
    dist.barrier()
    t = torch.tensor([ms or 0.0], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return t.item()


def timed_local(fn, reps, device, barrier=None):
    """Median ms of ``fn`` over ``reps`` calls timed with CUDA events (the mean of a wall-clock
    loop on the CPU), after 3 warm-up calls; ``barrier()``, when given, runs right before the
    timing starts (after the warm-up has finished on the GPU)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


_T0 = time.perf_counter()
_RES: dict = {}        # the results so far (rank 0 rewrites --out after every row: _save)


def log(msg):
    """Rank 0's progress line, with the seconds since the start."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", flush=True)


def _save(args):
    if args.out and _RES and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(_RES, indent=1))


def share_compiles(kern, inputs, device):
    """Every rank compiles (and runs once) its share of the launch candidates the kernel's
    launcher times on its first GPU call (``HOPPER_CANDIDATES``, ``CANDIDATES`` of the generated
    module), then the ranks meet: the one-GPU baseline timed on rank 0 loads them from Triton's
    cache instead of compiling each. Nothing on the CPU or for a launcher without candidates."""
    base = getattr(kern, "kernel", kern)
    mod = getattr(base, "module", None)
    if device.type != "cuda" or mod is None or not hasattr(mod, "CANDIDATES"):
        return
    cands = [dict(c, path="hopper") for c in getattr(mod, "HOPPER_CANDIDATES", [])] + \
        [dict(c, path="portable") for c in mod.CANDIDATES]
    world, rank = dist.get_world_size(), dist.get_rank()
    for c in cands[rank::world]:
        try:
            kern(**inputs, **c)
        except Exception:  # noqa: BLE001 - one that does not fit: the timing skips it too
            pass
    torch.cuda.synchronize()
    dist.barrier()


def with_env(var, value, fn):
    """``fn`` called with the environment variable ``var`` set to ``value`` (restored after)."""
    def call():
        old = os.environ.get(var)
        os.environ[var] = value
        try:
            return fn()
        finally:
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
    return call


def ring_launch(kern):
    """The launch options the ring's block kernels last ran with (None: no ring call yet)."""
    for key, sk in kern.__dict__.get("_acefuse_sharded", {}).items():
        if key[2] == "ring" and sk.block_launch is not None:
            return dict(sk.block_launch)
    return None


def baseline(args, N, fn, device, inputs=None, kern=None):
    """The one-GPU baseline's ms (``one_gpu``), or None when skipped (--one-gpu-max-len)."""
    if args.one_gpu_max_len and N > args.one_gpu_max_len:
        return None
    if kern is not None and inputs is not None:
        share_compiles(kern, inputs, device)
    return one_gpu(fn, args.one_gpu_reps or args.reps, device)


# ---- vocab-parallel cross-entropy -----------------------------------------------------------
def megatron_ce(x_loc, target, v0, group=None):
    """Megatron's vocab-parallel cross-entropy in torch (three all-reduces)."""
    xf = x_loc.float()
    mx = xf.max(dim=-1).values
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    xf = xf - mx[:, None]
    n = x_loc.shape[-1]
    mask = (target < v0) | (target >= v0 + n)
    loc = (target - v0).clamp(0, n - 1)
    pred = xf.gather(1, loc[:, None]).squeeze(1)
    pred = torch.where(mask, torch.zeros_like(pred), pred)
    dist.all_reduce(pred, op=dist.ReduceOp.SUM, group=group)
    se = xf.exp().sum(dim=-1)
    dist.all_reduce(se, op=dist.ReduceOp.SUM, group=group)
    return se.log() - pred


def part_ce(args, device, dtype, kernels, T, V):
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = split(V, world)
    v0 = sum(sizes[:rank])
    gen = torch.Generator(device="cpu").manual_seed(1234)
    X = (torch.randn(T, V, generator=gen) * 2).to(device=device, dtype=dtype)   # same on every rank
    tgt = torch.randint(0, V, (T,), generator=gen).to(device)
    x_loc = X[:, v0:v0 + sizes[rank]].contiguous()
    want = F.cross_entropy(X.float(), tgt, reduction="none")
    k = kernels["ce"]
    tol = TOL_GPU if device.type == "cuda" else TOL_CPU
    rows = []
    impls = {
        "acefuse (1 all-gather of states)": lambda: k(x=x_loc, t=tgt, process_group=dist.group.WORLD,
                                                     sharded_axis="j", shard_sizes=sizes),
        "Megatron (3 all-reduces, torch)": lambda: megatron_ce(x_loc, tgt, v0),
    }
    for name, fn in impls.items():
        row = {"impl": name, "T": T, "V": V, "world": world}
        try:
            ms, why, good = checked_timed(fn, want, tol, args.reps, device)
            if not good:
                row["error"] = f"wrong result on some rank ({why} here)"
            else:
                row.update(ms=ms, local_GBps=T * sizes[rank] * X.element_size() / ms / 1e6, check=why)
        except Exception as e:  # noqa: BLE001 - reported in the row
            row["error"] = error_text(e)
            if args.verbose:
                traceback.print_exc()
        rows.append(row)
    try:
        base = one_gpu(lambda: k(x=X, t=tgt), args.reps, device)
        for row in rows:
            if "ms" in row and row["impl"].startswith("acefuse"):
                row.update(one_gpu_ms=base, speedup=base / row["ms"], scaling_eff=base / (world * row["ms"]))
    except Exception as e:  # noqa: BLE001
        rows.append({"impl": "acefuse on one GPU", "error": f"{type(e).__name__}: {e}"})
    return rows


# ---- context-parallel prefill ---------------------------------------------------------------
def zigzag_index(N, world, rank, device):
    """The sequence positions rank ``rank`` holds in the zig-zag layout: chunks ``rank`` and
    ``2W-1-rank`` of 2W equal chunks (balanced causal work)."""
    C = N // (2 * world)
    return torch.cat([torch.arange(rank * C, rank * C + C),
                      torch.arange((2 * world - 1 - rank) * C, (2 * world - rank) * C)]).to(device)


def part_cp(args, device, dtype, kernels, lens, shape):
    world, rank = dist.get_world_size(), dist.get_rank()
    B, H, D = shape
    k = kernels["causal"]
    rows = _RES.setdefault("parts", {}).setdefault("cp", [])   # (saved as they come: _save)
    for N in lens:
        sizes = split(N, world)
        j0 = sum(sizes[:rank])
        gen = torch.Generator(device="cpu").manual_seed(N)
        Q, K, V = (torch.randn(B, H, N, D, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
        q, kk, v = (t[:, :, j0:j0 + sizes[rank]].contiguous() for t in (Q, K, V))
        whole = F.scaled_dot_product_attention(Q.float(), K.float(), V.float(), is_causal=True)
        want = whole[:, :, j0:j0 + sizes[rank]]
        zidx = zigzag_index(N, world, rank, device)
        qz, kz, vz = (t[:, :, zidx].contiguous() for t in (Q, K, V))
        want_z = whole[:, :, zidx]
        flops = 2.0 * B * H * N * N * D
        tol = TOL_GPU if device.type == "cuda" else TOL_CPU
        impls = {}
        for ex in [e for e in ("gather", "ring") if e in args.cp_impls]:
            impls[f"acefuse {ex}"] = (lambda ex=ex: k(q=q, k=kk, v=v, process_group=dist.group.WORLD,
                                                      sharded_axis="j", exchange=ex, axis_offsets={"i": j0},
                                                      shard_sizes=sizes), None)
        if N % (2 * world) == 0:
            for ex in [e for e in ("gather", "ring") if f"{e}-zigzag" in args.cp_impls]:
                impls[f"acefuse {ex} zig-zag"] = (lambda ex=ex: k(q=qz, k=kz, v=vz, process_group=dist.group.WORLD,
                                                                  sharded_axis="j", exchange=ex, zigzag=("i",),
                                                                  shard_sizes=[len(zidx)] * world), "zigzag")
            if "ring-zigzag-lookup" in args.cp_impls:   # one block kernel per step (positions as lookups)
                impls["acefuse ring zig-zag, one kernel per step"] = (with_env(
                    "ACEFUSE_RING_POSITIONS", "lookup", lambda: k(q=qz, k=kz, v=vz, process_group=dist.group.WORLD,
                                                                  sharded_axis="j", exchange="ring", zigzag=("i",),
                                                                  shard_sizes=[len(zidx)] * world)), "zigzag")
        if "torch" in args.cp_impls:
            impls["torch context_parallel (SDPA ring)"] = (None, "torch")
        for name, (fn, kind) in impls.items():
            row = {"impl": name, "N": N, "B": B, "H": H, "D": D, "world": world}
            log(f"cp N={N}: {name} ...")
            try:
                if kind == "torch":
                    ms, why, good = torch_cp(Q, K, V, device, args.reps, tol)
                else:
                    ms, why, good = checked_timed(fn, want_z if kind == "zigzag" else want, tol, args.reps, device)
                if not good:
                    row["error"] = f"wrong result on some rank ({why} here)"
                else:
                    row.update(ms=ms, TFLOPs=flops / ms / 1e9, check=why)
                if kind != "torch" and "ring" in name:
                    row["block_launch"] = ring_launch(k)
            except Exception as e:  # noqa: BLE001
                row["error"] = error_text(e)
                if args.verbose:
                    traceback.print_exc()
            rows.append(row)
            log(f"cp N={N}: {name}: {row.get('ms', row.get('error'))}")
            _save(args)
        try:
            log(f"cp N={N}: acefuse on one GPU ...")
            base = baseline(args, N, lambda: k(q=Q, k=K, v=V), device, dict(q=Q, k=K, v=V), k)
            for row in rows:
                if "ms" in row and base is not None:
                    row.update(one_gpu_acefuse_ms=base, speedup_vs_one_gpu=base / row["ms"],
                               scaling_eff=base / (world * row["ms"]))
                elif "ms" in row:
                    row["one_gpu_acefuse_ms"] = f"skipped (--one-gpu-max-len {args.one_gpu_max_len})"
            log(f"cp N={N}: acefuse on one GPU: {base}")
        except Exception as e:  # noqa: BLE001
            rows.append({"impl": "acefuse on one GPU", "N": N, "error": f"{type(e).__name__}: {e}"})
        _save(args)
    return rows


def torch_cp(Q, K, V, device, reps, tol):
    """PyTorch's context parallelism (ring attention over SDPA): buffers sharded in place
    inside the context (its load balancing); the output checked against the whole-sequence
    SDPA after unsharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    try:
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    except ImportError:   # moved between torch versions
        from torch.distributed.tensor.experimental._context_parallel._attention import context_parallel_unshard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    want = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    q, k, v = Q.clone(), K.clone(), V.clone()
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (full,) = context_parallel_unshard(mesh, [out], [2])
        return checked_timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), want, tol, reps,
                             device, got=full)


# ---- training: forward + backward -----------------------------------------------------------
class MegatronCE(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy with its backward (softmax minus one-hot on the
    local shard, no collective), in torch."""

    @staticmethod
    def forward(ctx, x_loc, target, v0):
        xf = x_loc.float()
        mx = xf.max(dim=-1).values
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        xf = xf - mx[:, None]
        n = x_loc.shape[-1]
        mask = (target < v0) | (target >= v0 + n)
        loc = (target - v0).clamp(0, n - 1)
        pred = xf.gather(1, loc[:, None]).squeeze(1)
        pred = torch.where(mask, torch.zeros_like(pred), pred)
        dist.all_reduce(pred, op=dist.ReduceOp.SUM)
        e = xf.exp()
        se = e.sum(dim=-1)
        dist.all_reduce(se, op=dist.ReduceOp.SUM)
        ctx.save_for_backward(e, se, loc, mask)
        ctx.dtype = x_loc.dtype
        return se.log() - pred

    @staticmethod
    def backward(ctx, g):
        e, se, loc, mask = ctx.saved_tensors
        grad = e / se[:, None]
        grad.scatter_add_(1, loc[:, None], torch.where(mask, 0.0, -1.0)[:, None].to(grad.dtype))
        return (grad * g[:, None]).to(ctx.dtype), None, None


def fwd_bwd(fn, leaves, cot):
    """One training step's attention/loss part: the forward and the backward, grads reset."""
    def step():
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(cot)
    return step


def check_grads(step, leaves, wants, tol):
    step()
    worst, good = "", True
    for t, w in zip(leaves, wants):
        g_ok, why = ok(t.grad, w, tol)
        worst = f"{worst}; {why}" if worst else why
        good = good and g_ok
    flag = torch.tensor([1.0 if good else 0.0], device=leaves[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return worst, bool(flag.item())


def part_ce_bwd(args, device, dtype, kernels, T, V):
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = split(V, world)
    v0 = sum(sizes[:rank])
    gen = torch.Generator(device="cpu").manual_seed(4321)
    X = (torch.randn(T, V, generator=gen) * 2).to(device=device, dtype=dtype)
    tgt = torch.randint(0, V, (T,), generator=gen).to(device)
    gl = torch.randn(T, generator=gen).to(device)
    Xr = X.float().clone().requires_grad_(True)
    F.cross_entropy(Xr, tgt, reduction="none").backward(gl)
    want = Xr.grad[:, v0:v0 + sizes[rank]]
    x_loc = X[:, v0:v0 + sizes[rank]].contiguous().requires_grad_(True)
    k = kernels["ce"]
    tol = TOL_GPU if device.type == "cuda" else TOL_CPU
    impls = {"acefuse (states exchanged, derived backward)": lambda: k(
                 x=x_loc, t=tgt, process_group=dist.group.WORLD, sharded_axis="j", shard_sizes=sizes),
             "Megatron (3 all-reduces, torch)": lambda: MegatronCE.apply(x_loc, tgt, v0)}
    rows = []
    for name, fn in impls.items():
        row = {"impl": name, "T": T, "V": V, "world": world}
        try:
            step = fwd_bwd(fn, [x_loc], gl)
            why, good = check_grads(step, [x_loc], [want], tol)
            if not good:
                row["error"] = f"wrong gradient on some rank ({why} here)"
            else:
                ms = slowest(timed(step, args.reps, device), device)
                # read x, write grad x (bytes of the logits shard, twice) + the forward's read
                row.update(ms=ms, local_GBps=3 * T * sizes[rank] * X.element_size() / ms / 1e6, check=why)
        except Exception as e:  # noqa: BLE001
            row["error"] = error_text(e)
            if args.verbose:
                traceback.print_exc()
        rows.append(row)
    try:
        Xg = X.clone().requires_grad_(True)
        base = one_gpu(fwd_bwd(lambda: k(x=Xg, t=tgt), [Xg], gl), args.reps, device)
        for row in rows:
            if "ms" in row and row["impl"].startswith("acefuse"):
                row.update(one_gpu_ms=base, speedup=base / row["ms"], scaling_eff=base / (world * row["ms"]))
    except Exception as e:  # noqa: BLE001
        rows.append({"impl": "acefuse on one GPU", "error": error_text(e)})
    return rows


def part_cp_bwd(args, device, dtype, kernels, lens, shape):
    """Context-parallel causal attention, forward + backward (the ring in reverse for dK/dV).
    TFLOP/s count the backward as 2.5x the forward's FLOPs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    B, H, D = shape
    k = kernels["causal"]
    rows = _RES.setdefault("parts", {}).setdefault("cp-bwd", [])   # (saved as they come: _save)
    for N in lens:
        sizes = split(N, world)
        j0 = sum(sizes[:rank])
        gen = torch.Generator(device="cpu").manual_seed(N + 1)
        Q, K, V, GO = (torch.randn(B, H, N, D, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
        zidx = zigzag_index(N, world, rank, device)
        cidx = torch.arange(j0, j0 + sizes[rank], device=device)
        wants = None
        if args.check_bwd:
            leaves = [t.float().clone().requires_grad_(True) for t in (Q, K, V)]
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(GO.float())
            wants = [t.grad for t in leaves]
            del leaves
        flops = 2.0 * B * H * N * N * D * 3.5
        tol = TOL_GPU if device.type == "cuda" else TOL_CPU
        impls = {}
        for ex in ("ring", "gather"):
            if ex in args.cp_impls:
                impls[f"acefuse {ex}"] = (ex, cidx, dict(axis_offsets={"i": j0}, shard_sizes=sizes))
            if f"{ex}-zigzag" in args.cp_impls and N % (2 * world) == 0:
                impls[f"acefuse {ex} zig-zag"] = (ex, zidx, dict(zigzag=("i",), shard_sizes=[len(zidx)] * world))
        for name, (ex, idx, kw) in impls.items():
            row = {"impl": name, "N": N, "B": B, "H": H, "D": D, "world": world}
            log(f"cp-bwd N={N}: {name} ...")
            try:
                loc = [t[:, :, idx].contiguous().requires_grad_(True) for t in (Q, K, V)]
                go = GO[:, :, idx].contiguous()
                step = fwd_bwd(lambda loc=loc, ex=ex, kw=kw: k(q=loc[0], k=loc[1], v=loc[2],
                                                               process_group=dist.group.WORLD, sharded_axis="j",
                                                               exchange=ex, **kw), loc, go)
                if wants is not None:
                    why, good = check_grads(step, loc, [w[:, :, idx] for w in wants], tol)
                else:
                    why, good = "not checked (--no-check-bwd)", True
                if not good:
                    row["error"] = f"wrong gradient on some rank ({why} here)"
                else:
                    ms = slowest(timed(step, args.reps, device), device)
                    row.update(ms=ms, TFLOPs=flops / ms / 1e9, check=why)
                del loc
            except Exception as e:  # noqa: BLE001
                row["error"] = error_text(e)
                if args.verbose:
                    traceback.print_exc()
            rows.append(row)
            log(f"cp-bwd N={N}: {name}: {row.get('ms', row.get('error'))}")
            _save(args)
        if "torch" in args.cp_impls:
            row = {"impl": "torch context_parallel (SDPA ring)", "N": N, "B": B, "H": H, "D": D, "world": world}
            log(f"cp-bwd N={N}: torch context_parallel ...")
            try:
                ms = torch_cp_bwd(Q, K, V, GO, device, args.reps)
                row.update(ms=ms, TFLOPs=flops / ms / 1e9, check="not checked (torch's own)")
            except Exception as e:  # noqa: BLE001
                row["error"] = error_text(e)
            rows.append(row)
            _save(args)
        try:
            log(f"cp-bwd N={N}: acefuse on one GPU ...")
            full = [t.clone().requires_grad_(True) for t in (Q, K, V)]
            base = baseline(args, N, fwd_bwd(lambda: k(q=full[0], k=full[1], v=full[2]), full, GO), device)
            for row in rows:
                if "ms" in row and base is not None:
                    row.update(one_gpu_acefuse_ms=base, speedup_vs_one_gpu=base / row["ms"],
                               scaling_eff=base / (world * row["ms"]))
                elif "ms" in row:
                    row["one_gpu_acefuse_ms"] = f"skipped (--one-gpu-max-len {args.one_gpu_max_len})"
            log(f"cp-bwd N={N}: acefuse on one GPU: {base}")
        except Exception as e:  # noqa: BLE001
            rows.append({"impl": "acefuse on one GPU", "N": N, "error": error_text(e)})
        _save(args)
    return rows


def torch_cp_bwd(Q, K, V, GO, device, reps):
    """PyTorch's context parallelism, forward + backward, ms per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    q, k, v, go = Q.clone(), K.clone(), V.clone(), GO.clone()
    with context_parallel(mesh, buffers=[q, k, v, go], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, go}):
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        step = fwd_bwd(lambda: F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, go)
        return slowest(timed(step, reps, device), device)


# ---- sharded-KV decode ----------------------------------------------------------------------
def part_decode(args, device, dtype, kernels, shape):
    world, rank = dist.get_world_size(), dist.get_rank()
    B, H, D, N = shape
    sizes = split(N, world)
    j0 = sum(sizes[:rank])
    gen = torch.Generator(device="cpu").manual_seed(99)
    Q = torch.randn(B, H, 1, D, generator=gen).to(device=device, dtype=dtype)
    K, V = (torch.randn(B, H, N, D, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    k, v = K[:, :, j0:j0 + sizes[rank]].contiguous(), V[:, :, j0:j0 + sizes[rank]].contiguous()
    kern = kernels["decode"]
    want = F.scaled_dot_product_attention(Q.float(), K.float(), V.float())
    tol = TOL_GPU if device.type == "cuda" else TOL_CPU
    row = {"impl": "acefuse sharded-KV decode (states all-gather)", "B": B, "H": H, "D": D, "N": N,
           "world": world}
    rows = [row]
    try:
        fn = (lambda: kern(q=Q, k=k, v=v, process_group=dist.group.WORLD, sharded_axis="j", shard_sizes=sizes))
        ms, why, good = checked_timed(fn, want, tol, args.reps, device)
        if not good:
            row["error"] = f"wrong result on some rank ({why} here)"
        else:
            kv_bytes = 2 * B * H * N * D * K.element_size()
            row.update(ms=ms, GBps_aggregate=kv_bytes / ms / 1e6, check=why)
            base = one_gpu(lambda: kern(q=Q, k=K, v=V), args.reps, device)
            row.update(one_gpu_ms=base, speedup=base / ms, scaling_eff=base / (world * ms))
    except Exception as e:  # noqa: BLE001
        row["error"] = error_text(e)
        if args.verbose:
            traceback.print_exc()
    return rows


# ---- driver ---------------------------------------------------------------------------------
def table(rows):
    keys = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    out = [" | ".join(keys)]
    for r in rows:
        out.append(" | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    return "\n".join(out)


def main_rank(args):
    """One rank's run (torchrun, or a --cpu-smoke child)."""
    import warnings
    import acefuse as af
    smoke = args.cpu_smoke
    device = torch.device("cpu") if smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # a rank that fails before a collective must not leave the others waiting for the
        # whole run: collectives time out (long enough for first-call kernel compiles)
        from datetime import timedelta
        dist.init_process_group("gloo" if smoke else "nccl", timeout=timedelta(seconds=args.pg_timeout))
    dtype = torch.float32 if smoke else torch.bfloat16
    progs = programs()
    kernels = {n: af.compile(p) for n, p in progs.items()}
    parts = ["ce", "cp", "decode", "ce-bwd", "cp-bwd"] if args.part == "all" else [args.part]
    res = {"world": dist.get_world_size(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu (Triton interpreter)", "dtype": str(dtype), "torch": torch.__version__, "parts": {},
           "env": {v: os.environ.get(v) for v in ("ACEFUSE_RING_TILES", "TRITON_CACHE_DIR", "ACEFUSE_CACHE_DIR")}}
    _RES.clear()
    _RES.update(res)
    res = _RES
    with warnings.catch_warnings(record=True) as wlist:
        warnings.simplefilter("always")
        if "ce" in parts:
            T, V = (6, 50) if smoke else CE
            res["parts"]["ce"] = part_ce(args, device, dtype, kernels, T, V)
        if "cp" in parts:
            lens, shape = ((24,), (1, 2, 16)) if smoke else (tuple(args.cp_lens), CP_SHAPE)
            if smoke:
                import acefuse as af2
                q, k, v = af2.tensor("q", "b h i d"), af2.tensor("k", "b h j d"), af2.tensor("v", "b h j e")
                s = af2.where(af2.index("j") <= af2.index("i"), af2.sum(q * k, "d") * 0.25, af2.NEG_INF)
                mx = af2.max(s, "j")
                p = af2.exp(s - mx)
                kernels["causal"] = af2.compile(af2.program("causal_attention_smoke",
                                                            o=af2.sum(p * v, "j") / af2.sum(p, "j")))
            res["parts"]["cp"] = part_cp(args, device, dtype, kernels, lens, shape)
        if "ce-bwd" in parts:
            T, V = (6, 50) if smoke else CE
            res["parts"]["ce-bwd"] = part_ce_bwd(args, device, dtype, kernels, T, V)
        if "cp-bwd" in parts:
            lens, shape = ((24,), (1, 2, 16)) if smoke else (tuple(args.cp_lens), CP_SHAPE)
            if smoke and kernels["causal"].prog.name != "causal_attention_smoke":
                import acefuse as af2
                q, k, v = af2.tensor("q", "b h i d"), af2.tensor("k", "b h j d"), af2.tensor("v", "b h j e")
                s = af2.where(af2.index("j") <= af2.index("i"), af2.sum(q * k, "d") * 0.25, af2.NEG_INF)
                mx = af2.max(s, "j")
                p = af2.exp(s - mx)
                kernels["causal"] = af2.compile(af2.program("causal_attention_smoke",
                                                            o=af2.sum(p * v, "j") / af2.sum(p, "j")))
            res["parts"]["cp-bwd"] = part_cp_bwd(args, device, dtype, kernels, lens, shape)
        if "decode" in parts:
            if smoke:
                import acefuse as af2
                q, k, v = af2.tensor("q", "b h i d"), af2.tensor("k", "b h j d"), af2.tensor("v", "b h j e")
                s = af2.sum(q * k, "d") * 0.25
                mx = af2.max(s, "j")
                p = af2.exp(s - mx)
                kernels["decode"] = af2.compile(af2.program("decode_attention_smoke",
                                                            o=af2.sum(p * v, "j") / af2.sum(p, "j")))
            res["parts"]["decode"] = part_decode(args, device, dtype, kernels,
                                                 (1, 2, 16, 40) if smoke else DEC)
    res["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in wlist
                              if "acefuse" in str(w.message) or "Distributed" in w.category.__name__})
    failed = [r for rows in res["parts"].values() for r in rows if "error" in r]
    if dist.get_rank() == 0:
        for name, rows in res["parts"].items():
            print(f"\n== {name} ({res['world']} ranks, {res['device']}, {res['dtype']}) ==")
            print(table(rows))
        for w in res["warnings"]:
            print("warning:", w)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
            print("results:", args.out)
    dist.barrier()
    dist.destroy_process_group()
    return failed


def _smoke_child(rank, world, init, args):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    failed = main_rank(args)
    # in the smoke, only failures of acefuse or of the torch-only peers count (the PyTorch CP
    # peer may not run on the CPU)
    bad = [r for r in failed if not r["impl"].startswith("torch context_parallel")]
    if bad:
        raise SystemExit(f"rank {rank}: {len(bad)} failure(s): {bad}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="all", choices=["ce", "cp", "decode", "ce-bwd", "cp-bwd", "all"])
    ap.add_argument("--no-check-bwd", dest="check_bwd", action="store_false",
                    help="cp-bwd: skip the float32 SDPA autograd reference of the whole sequence (its memory)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cp-lens", type=int, nargs="+", default=list(CP_LENS))
    ap.add_argument("--cp-impls", default="gather,ring,gather-zigzag,ring-zigzag,torch",
                    help="context-parallel implementations to run (comma-separated; each acefuse one compiles "
                         "its kernels on its first call)")
    ap.add_argument("--one-gpu-reps", type=int, default=None,
                    help="timed calls of the one-GPU baseline (default: --reps)")
    ap.add_argument("--one-gpu-max-len", type=int, default=None,
                    help="cp, cp-bwd: skip the one-GPU baseline above this sequence length (reported as skipped)")
    ap.add_argument("--pg-timeout", type=int, default=300, help="seconds before a stuck collective aborts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="2 gloo ranks on the CPU, tiny sizes, Triton's interpreter, no meaningful timing")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    args.cp_impls = set(args.cp_impls.split(","))
    if args.cpu_smoke and "RANK" not in os.environ:
        import tempfile
        import torch.multiprocessing as mp
        os.environ["TRITON_INTERPRET"] = "1"    # inherited by the spawned ranks
        args.reps = min(args.reps, 2)
        fd, path = tempfile.mkstemp(prefix="acefuse_bench_")
        os.close(fd)
        os.unlink(path)
        mp.spawn(_smoke_child, args=(2, "file://" + path, args), nprocs=2)
        print("cpu smoke: OK")
        return 0
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # under torchrun: before acefuse imports Triton
        args.reps = min(args.reps, 2)
    failed = main_rank(args)
    if args.cpu_smoke:   # as in the spawned smoke: PyTorch's CP peer has no CPU sharding strategy
        failed = [r for r in failed if not r["impl"].startswith("torch context_parallel")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
