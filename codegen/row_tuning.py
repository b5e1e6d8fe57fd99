"""The row family's timed launch choice: the generated host code that, on a GPU, times a few
launch configurations of a large problem's kernel (warps per program, rows per tile, the
tile length of the loop schedule, programs per SM of the persistent riders schedule) on the
first call per shape class and keeps the fastest (codegen/row.py's ``_plan`` asks
``_timed_launch``; explicit launch options skip it).

Why timed, not a formula: on an H200 (benchmarks/row_launch_diag.py, BENCHMARKS.md
session 10) softmax's single-tile backward at 16384x8192 bf16 moved its 3 passes at
4.0 TB/s with the size heuristics' 8 warps, while the riders schedule of RMSNorm's and
layernorm's backward (same tile, one or two weight-gradient sums of the row's length kept in
registers besides) moved theirs at 2.1 and 1.6 TB/s: what is fastest depends on what a kernel
keeps in registers, which only the compiled kernel shows. The candidates are few (each warp
count is one compilation) and the heuristics' own launch is always the first: it is the
reference, and it must run (``required``).
"""
from __future__ import annotations


def lines(timing_src, remembered_src) -> list:
    """Source lines of the generated module's ``_launch_cands`` and ``_timed_launch`` (plus
    the shared timing helpers ``timing_src`` and ``remembered_src``, contraction_launch's)."""
    return [
        *timing_src,
        "",
        "",
        *remembered_src,
        "",
        "",
        "TIME_NARROW = False   # also time NARROW one-tile launches of bfloat16 rows (off: never faster, by registers)",
        "TUNE_MIN = 1 << 24   # rows x fused axis below which the size heuristics run untimed (launch-bound)",
        "TIMED_DEVICES = ('cuda',)   # where launches are timed (tests add 'cpu')",
        "_CHOSEN = {}   # shape class -> the timed launch options (None: the heuristics')",
        "",
        "",
        "def _launch_cands(n_rows, n_j, ride, programs, narrow_ok=False):",
        "    \"\"\"Launch options to time, the size heuristics' own (``{}``) first: one tile per row",
        "    with 4-32 warps, 2-64 elements a thread (and twice the rows per tile where a tile",
        "    holds at most 4096 elements); with riders, 8-32 warps and 1, 2 or 4 persistent programs",
        "    per SM (with and without software pipelining of the loop over rows); a loop of",
        "    4096-32768-element",
        "    tiles where the row is longer than 16384 and the loop would run. narrow_ok (a bfloat16",
        "    input) and TIME_NARROW: one-tile launches of rows of 8192 elements or more also with the row",
        "    held as loaded (NARROW). One-tile rows of 8192 elements or more: also 8-32 warps with the",
        "    registers per thread capped for two programs per SM (maxnreg).\"\"\"",
        "    cands = [{}]",
        "    if n_j <= MAX_SINGLE:",
        "        bj = max(16, _np2(n_j))",
        "        br0 = max(1, min(_np2(n_rows), 4096 // bj if bj < 4096 else 1))",
        "        if ride:",
        "            for nw in (8, 16, 32):",
        "                for per in (1, 2, 4):",
        "                    if 32 * nw <= bj * br0:",
        "                        cands.append(dict(schedule='single', num_warps=nw, per_sm=per))",
        "            # the persistent loop over rows without Triton's software pipelining (its default",
        "            # stages keep the next rows' tiles in shared memory: fewer programs fit an SM)",
        "            for nw in (16, 32):",
        "                for per in (1, 2):",
        "                    if 32 * nw <= bj * br0:",
        "                        cands.append(dict(schedule='single', num_warps=nw, per_sm=per, stages=1))",
        "        else:",
        "            # (each warp count is one compilation: 2-64 elements a thread)",
        "            for br, warps in ((br0, (4, 8, 16, 32)), (2 * br0, (8, 16))):",
        "                if br > br0 and (bj * br0 > 4096 or br > _np2(n_rows)):",
        "                    continue",
        "                for nw in warps:",
        "                    if 64 * nw <= bj * br <= 2048 * nw and (br > br0 or nw != 32 or bj * br > 4096):",
        "                        cands.append(dict(schedule='single', block_r=br, num_warps=nw))",
        "            # rows of 8192 elements or more: registers capped so that two programs fit an SM",
        "            # (one program's load then overlaps another's arithmetic; sm_90, ptxas: softmax 16384",
        "            # at 16 warps takes 78 registers, one program per SM; capped at 64, 40 bytes spill)",
        "            if bj * br0 >= 8192:",
        "                for nw in (8, 16, 32):",
        "                    if 64 * nw <= bj * br0 <= 2048 * nw:",
        "                        cands.append(dict(schedule='single', block_r=br0, num_warps=nw, maxnreg=65536 // (64 * nw)))",
        "            if narrow_ok and bj >= 8192 and TIME_NARROW:",
        "                cands += [dict(c, narrow=True) for c in cands[1:] if 'maxnreg' not in c]",
        "    loop = n_j > MAX_SINGLE and choose_schedule(n_rows, n_j, programs) == 'loop'",
        "    if not ride and (loop or 16384 < n_j <= MAX_SINGLE):",
        "        for bj, warps in ((4096, (8,)), (8192, (8, 16)), (16384, (16,)), (32768, (16, 32))):",
        "            if bj < _np2(n_j):",
        "                for nw in warps:",
        "                    cands.append(dict(schedule='loop', block_j=bj, num_warps=nw))",
        "    return cands",
        "",
        "",
        "def _timed_launch(inputs, sizes, ref, dev, n_rows, n_j, out_dtypes, riders, programs):",
        "    \"\"\"The fastest of _launch_cands for this call's shape class (rows and fused axis",
        "    rounded up to powers of two, the inputs' dtypes, riders, output types), timed once",
        "    (_fastest: GPU or host time, whichever is longer) and kept in this process and the",
        "    tuning cache (_remembered); None: the size heuristics' launch.\"\"\"",
        "    ride = bool(riders and RIDERS)",
        "    key = (_np2(n_rows), _np2(n_j), tuple(str(inputs[t].dtype) for t in TENSORS), ride,",
        "           tuple(sorted((o, str(d)) for o, d in (out_dtypes or {}).items())))",
        "    if key not in _CHOSEN:",
        "        cands = _launch_cands(n_rows, n_j, ride, programs,",
        "                              narrow_ok=any(inputs[t].dtype == torch.bfloat16 for t in TENSORS))",
        "",
        "        plans = {}   # each candidate's plan, worked out once: the timed calls are launches only",
        "",
        "        def call(c):",
        "            k = repr(sorted(c.items()))",
        "            if k not in plans:",
        "                plans[k] = _plan(inputs, sizes, ref, dev, c.get('schedule'), c.get('block_j'), c.get('block_r'),",
        "                                 None, c.get('num_warps'), out_dtypes, riders, c.get('per_sm'), c.get('stages'),",
        "                                 narrow=c.get('narrow'), maxnreg=c.get('maxnreg'))",
        "            return _launch(plans[k], inputs)",
        "",
        "        def time_them():",
        "            _TUNING.append(1)",
        "            try:",
        "                return _fastest(cands, call, required=(0,))",
        "            finally:",
        "                _TUNING.pop()",
        "        best = _remembered('launch', key, dev, cands, time_them) if len(cands) > 1 else None",
        "        _CHOSEN[key] = best or None",
        "    return _CHOSEN[key]",
    ]
