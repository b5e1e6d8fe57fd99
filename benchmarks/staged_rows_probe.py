"""GPU probe (issue 15; a measurement, not product code and not a benchmark of record): can a
softmax over long bf16 rows read HBM once by staging each row in shared memory, and how close
does that get to copy bandwidth? Written by hand to answer that question before the row family
gets such a schedule (which would come from its derived expressions, like every kernel). A persistent Gluon kernel: TMA copies of
[64, 64] chunks of a row into a ring of NBUF shared-memory slots; pass 1 folds (max, sum) over
the chunks as they land; pass 2 reads the same slots again, writes exp(x - M) / S, and refills
each slot with a chunk of a later row (``staged``). ``ws``: the same with a warp of its own
for the copies (warp specialisation), which refills a slot as soon as pass 2 releases it. Measures GB/s against copy at 4096x65536 and 8192x32768.

    OUT=/tmp/probe python benchmarks/staged_rows_probe.py     # Hopper GPU (TMA, Gluon); ~10 s
"""
import json
import os
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_sync = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _issue(x_desc, bars, slots, t, pid, P, R, NC: gl.constexpr, NBUF: gl.constexpr, CR: gl.constexpr):
    k = t // NC
    c = t - k * NC
    r = pid + k * P
    if r < R:
        s = t % NBUF
        mbarrier.expect(bars.index(s), x_desc.block_type.nbytes)
        _tma_load(x_desc, [(r * NC + c) * CR, 0], bars.index(s), slots.index(s))


@gluon.jit
def staged_softmax(x_ptr, y_ptr, R, NC: gl.constexpr, NBUF: gl.constexpr, CR: gl.constexpr, CW: gl.constexpr,
                   num_warps: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CR, CW], gl.bfloat16)
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    x_desc = tma.make_tensor_descriptor(x_ptr, shape=[R * NC * CR, CW], strides=[CW, 1],
                                        block_shape=[CR, CW], layout=SL)
    slots = gl.allocate_shared_memory(gl.bfloat16, [NBUF, CR, CW], SL)
    bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for t in range(0, NBUF):
        _issue(x_desc, bars, slots, t, pid, P, R, NC, NBUF, CR)
    a = gl.arange(0, CR, layout=gl.SliceLayout(1, BL))
    b = gl.arange(0, CW, layout=gl.SliceLayout(0, BL))
    offs = a[:, None] * CW + b[None, :]
    n_rows = (R - pid + P - 1) // P
    for k in range(0, n_rows):
        r = pid + k * P
        base = k * NC
        m_v = gl.full([CR], float("-inf"), gl.float32, layout=gl.SliceLayout(1, BL))
        s_v = gl.zeros([CR], gl.float32, layout=gl.SliceLayout(1, BL))
        for c in range(0, NC):   # pass 1: (max, sum) folded over the chunks as they land
            t = base + c
            s = t % NBUF
            mbarrier.wait(bars.index(s), (t // NBUF) & 1)
            x = slots.index(s).load(BL).to(gl.float32)
            m_new = gl.maximum(m_v, gl.max(x, axis=1))
            s_v = s_v * gl.exp2((m_v - m_new) * LOG2E) + gl.sum(gl.exp2((x - m_new[:, None]) * LOG2E), axis=1)
            m_v = m_new
        M = gl.max(m_v, axis=0)
        S = gl.sum(s_v * gl.exp2((m_v - M) * LOG2E), axis=0)
        inv = 1.0 / S
        row_y = y_ptr + r.to(gl.int64) * (NC * CR * CW)
        for c in range(0, NC):   # pass 2: the outputs from the staged chunks; each slot refilled
            t = base + c
            s = t % NBUF
            x = slots.index(s).load(BL).to(gl.float32)
            y = gl.exp2((x - M) * LOG2E) * inv
            gl.store(row_y + c * (CR * CW) + offs, y.to(gl.bfloat16))
            _sync()                 # every warp has read slot s
            fence_async_shared()
            _issue(x_desc, bars, slots, t + NBUF, pid, P, R, NC, NBUF, CR)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _ws_copy(x_desc, bars, empty, slots, R, NC: gl.constexpr, NBUF: gl.constexpr, CR: gl.constexpr):
    # the copy warp: chunk t of this program's rows into slot t % NBUF, as soon as the consumers
    # released the chunk that slot held (its pass 2 is done)
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    total = ((R - pid + P - 1) // P) * NC
    for t in range(0, total):
        s = t % NBUF
        if t >= NBUF:
            mbarrier.wait(empty.index(s), ((t // NBUF) - 1) & 1)
        k = t // NC
        c = t - k * NC
        mbarrier.expect(bars.index(s), x_desc.block_type.nbytes)
        _tma_load(x_desc, [((pid + k * P) * NC + c) * CR, 0], bars.index(s), slots.index(s))


@gluon.jit
def _ws_fold(y_ptr, bars, empty, slots, R, NC: gl.constexpr, NBUF: gl.constexpr, CR: gl.constexpr,
             CW: gl.constexpr, NW: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    a = gl.arange(0, CR, layout=gl.SliceLayout(1, BL))
    b = gl.arange(0, CW, layout=gl.SliceLayout(0, BL))
    offs = a[:, None] * CW + b[None, :]
    n_rows = (R - pid + P - 1) // P
    for k in range(0, n_rows):
        r = pid + k * P
        base = k * NC
        m_v = gl.full([CR], float("-inf"), gl.float32, layout=gl.SliceLayout(1, BL))
        s_v = gl.zeros([CR], gl.float32, layout=gl.SliceLayout(1, BL))
        for c in range(0, NC):
            t = base + c
            s = t % NBUF
            mbarrier.wait(bars.index(s), (t // NBUF) & 1)
            x = slots.index(s).load(BL).to(gl.float32)
            m_new = gl.maximum(m_v, gl.max(x, axis=1))
            s_v = s_v * gl.exp2((m_v - m_new) * LOG2E) + gl.sum(gl.exp2((x - m_new[:, None]) * LOG2E), axis=1)
            m_v = m_new
        M = gl.max(m_v, axis=0)
        S = gl.sum(s_v * gl.exp2((m_v - M) * LOG2E), axis=0)
        inv = 1.0 / S
        row_y = y_ptr + r.to(gl.int64) * (NC * CR * CW)
        for c in range(0, NC):
            t = base + c
            s = t % NBUF
            x = slots.index(s).load(BL).to(gl.float32)
            gl.store(row_y + c * (CR * CW) + offs, (gl.exp2((x - M) * LOG2E) * inv).to(gl.bfloat16))
            _sync()
            mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def staged_softmax_ws(x_ptr, y_ptr, R, NC: gl.constexpr, NBUF: gl.constexpr, CR: gl.constexpr, CW: gl.constexpr,
                      num_warps: gl.constexpr):
    """The same two passes with a warp of its own for the copies (warp specialisation): a slot
    is refilled as soon as pass 2 releases it, without the folding warps issuing anything."""
    SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CR, CW], gl.bfloat16)
    x_desc = tma.make_tensor_descriptor(x_ptr, shape=[R * NC * CR, CW], strides=[CW, 1],
                                        block_shape=[CR, CW], layout=SL)
    slots = gl.allocate_shared_memory(gl.bfloat16, [NBUF, CR, CW], SL)
    bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(bars.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_ws_fold, (y_ptr, bars, empty, slots, R, NC, NBUF, CR, CW, num_warps)),
        (_ws_copy, (x_desc, bars, empty, slots, R, NC, NBUF, CR)),
    ], [1], [24])
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(bars.index(i))
        mbarrier.invalidate(empty.index(i))


def run_ws(x, nbuf=24, num_warps=16, programs=None):
    R, C = x.shape
    CR, CW = 64, 64
    assert C % (CR * CW) == 0 and x.is_contiguous()
    NC = C // (CR * CW)
    assert NC <= nbuf and num_warps <= 16
    y = torch.empty_like(x)
    P = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    staged_softmax_ws[(min(P, R),)](x, y, R, NC=NC, NBUF=nbuf, CR=CR, CW=CW, num_warps=num_warps)
    return y


def run(x, nbuf=24, num_warps=16, programs=None):
    R, C = x.shape
    CR, CW = 64, 64
    assert C % (CR * CW) == 0 and x.is_contiguous()
    NC = C // (CR * CW)
    assert NC <= nbuf and num_warps <= 16   # the [64, 64] chunk layout covers 64 rows with 16 warps
    y = torch.empty_like(x)
    P = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    staged_softmax[(min(P, R),)](x, y, R, NC=NC, NBUF=nbuf, CR=CR, CW=CW, num_warps=num_warps)
    return y


def main():
    out = os.environ.get("OUT", "/tmp/rp")
    os.makedirs(out, exist_ok=True)
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    from triton.testing import do_bench
    res = {}
    for R, C, cfgs in ((4096, 65536, [(24, 16, 0), (20, 16, 0), (24, 8, 0), (24, 16, 1), (20, 16, 1), (26, 16, 1), (24, 8, 1)]),
                       (8192, 32768, [(24, 16, 0), (16, 16, 0), (24, 16, 1), (16, 16, 1), (24, 8, 1)])):
        g = torch.Generator(device="cuda").manual_seed(R + C + int(time.time()) % 1000)
        x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        ref = torch.softmax(x.float(), -1)
        nbytes = 2 * x.numel() * 2
        copy = nbytes / (do_bench(lambda: x.clone(), warmup=5, rep=40, return_mode="median") * 1e-3) / 1e9
        tor = nbytes / (do_bench(lambda: torch.softmax(x, -1), warmup=5, rep=40, return_mode="median") * 1e-3) / 1e9
        print(f"{R}x{C}: copy {copy:.0f} GB/s, torch.softmax {tor:.0f} GB/s ({tor / copy:.1%})", flush=True)
        res[f"{R}x{C}"] = dict(copy=copy, torch=tor)
        for nbuf, nw, ws in cfgs:
            fn, tag = (run_ws, 'ws') if ws else (run, 'staged')
            if (C // 4096) > nbuf:
                continue
            t0 = time.time()
            try:
                y = fn(x, nbuf, nw)
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"  {tag} nbuf={nbuf} w{nw}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
                res[f"{R}x{C}"][f"{tag}_n{nbuf}w{nw}"] = f"error {type(exc).__name__}"
                continue
            err = (y.float() - ref).abs().max().item()
            bad = int(((y.float() - ref).abs() > 1.6e-2 * ref.abs() + 1e-6 * ref.abs().max()).sum().item())
            ms = do_bench(lambda: fn(x, nbuf, nw), warmup=5, rep=40, return_mode="median")
            gbs = nbytes / (ms * 1e-3) / 1e9
            print(f"  {tag} nbuf={nbuf} w{nw}: {gbs:.0f} GB/s = {gbs / copy:.1%} of copy ({ms * 1e3:.1f} us; "
                  f"max err {err:.2e}, {bad} outside tolerance; first call {time.time() - t0:.1f} s)", flush=True)
            res[f"{R}x{C}"][f"{tag}_n{nbuf}w{nw}"] = dict(gbs=gbs, pct=gbs / copy, us=ms * 1e3, err=err, bad=bad)
        del x, ref
        torch.cuda.empty_cache()
    with open(os.path.join(out, "rowproto.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
