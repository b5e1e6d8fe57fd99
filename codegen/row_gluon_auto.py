"""The automatic choice between the row family's staged Gluon kernel (codegen/row_gluon.py) and
the Triton module's own launch, for af.compile's kernels on an sm_90 GPU (called from
codegen/compile.py ``Kernel.__call__``): timed on the first call per input shapes, outputs
compared, the faster kept, remembered on the kernel and on disk (codegen/tuning.py,
``what='staged'``). The same design as the contraction family's ``auto_gluon``
(codegen/contraction_gluon.py), whose helpers it uses.
"""
from __future__ import annotations

import hashlib

from acefuse.codegen import row_gluon
from acefuse.codegen.contraction_gluon import _agree, _cuda_eager, _result, _sm90, _time_pair   # noqa: F401

# the configurations the automatic choice times against the Triton module (the fastest of those
# whose outputs agree is kept where it beats the Triton launch by AUTO_MARGIN): the probe's best
# (benchmarks/results/session15: ws nbuf=24 w8, 80.1% of copy at 4096x65536, 78.6% at 8192x32768)
AUTO_CONFIGS = ({"num_warps": 8},)
AUTO_MIN_NJ = 16384        # rows up to this length: the single-tile Triton schedule reads them once already
AUTO_MIN_WORK = 1 << 24    # rows x columns below which the Triton kernel is kept untimed
AUTO_MARGIN = 0.97         # the staged kernel is kept only at most this fraction of the Triton time


def _auto_enabled():
    """On unless ``ACEFUSE_STAGED=0`` or ``ACEFUSE_GLUON=0``. One H200, bf16, % of copy (session 16,
    benchmarks/results/session16/h200_56e8590_staged_rows_ab.txt): softmax 4096x65536 staged
    76.4% against the Triton module's 65.0% (h200_5398671_rows.txt); 8192x32768 75.3% against
    75.1% (a tie: the margin keeps Triton); RMSNorm 54.8% and layernorm 37.2% at 4096x65536,
    where the Triton module runs at 85.6% and (session 14) 73%: kept. Before that run's per-element forms
    (exp2, hoist, qfast) the staged kernel lost everywhere (51-58%) and this was opt-in."""
    import os
    return os.environ.get("ACEFUSE_GLUON", "") != "0" and os.environ.get("ACEFUSE_STAGED", "") != "0"


def _choice_source(kernel, gs) -> str | None:
    tri = getattr(kernel, "source", None)
    if tri is None:
        return None
    return hashlib.sha256("\0".join([tri] + [g.source + g.tag for g in gs]).encode()).hexdigest()


def _remembered(stored, gs):
    if not (isinstance(stored, dict) and stored.get("kernel") in ("staged", "triton")
            and all(isinstance(stored.get(k), (int, float)) for k in ("triton_s", "staged_s"))):
        return None
    times = (float(stored["triton_s"]), float(stored["staged_s"]))
    if stored["kernel"] == "triton":
        return "triton", times
    hit = [g for g in gs if g.tag == stored.get("config")]
    return (hit[0], times) if hit else None


def auto_staged(kernel, inputs: dict):
    """The automatic choice of af.compile's row kernels on an sm_90 GPU: the staged Gluon kernel
    (the fastest of AUTO_CONFIGS) or the Triton module's own launch (its timed schedule),
    whichever runs faster here, timed on the first call per input shapes, strides, dtypes and
    device, remembered on ``kernel`` (``_staged_choice``) and on disk (codegen/tuning.py,
    ``what='staged'``, keyed by a hash of both generated sources). On the timed call both run and
    the outputs must agree: a disagreement keeps the Triton kernel with a warning and records
    nothing on disk. Returns the outputs, or None where the caller runs the Triton module as
    before: not a row program with a staged form (``kernel._staged_reason`` says why), not an
    eager sm_90 call of CUDA tensors, rows of AUTO_MIN_NJ or fewer, too little work,
    ``ACEFUSE_STAGED=0`` or ``ACEFUSE_GLUON=0`` (_auto_enabled), or the Triton kernel measured
    faster."""
    import warnings
    state = getattr(kernel, "_staged_auto", None)
    if state is False or not inputs:
        return None
    ts = list(inputs.values())
    if not all(hasattr(t, "is_cuda") for t in ts) or not _cuda_eager(ts):
        return None
    key = tuple((n, tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for n, t in inputs.items())
    choices = kernel.__dict__.setdefault("_staged_choice", {})
    choice = choices.get(key)
    if choice == "triton":
        return None
    if choice is not None:
        return _result(choice(**inputs))
    name = kernel.fusion.program.name
    shapes = [tuple(t.shape) for t in ts]
    if state is None:
        if not _auto_enabled() or not _sm90(ts[0].device):
            kernel._staged_auto, kernel._staged_reason = False, "not an sm_90 GPU, or ACEFUSE_GLUON=0"
            return None
        if getattr(kernel.module, "RIDERS", None) or not hasattr(kernel.module, "STATES"):
            kernel._staged_auto, kernel._staged_reason = False, "not a row-family module (or one with riders)"
            return None
        try:
            kernel._staged_auto = tuple(row_gluon.compile_staged(kernel.fusion, **c) for c in AUTO_CONFIGS)
        except Exception as exc:   # no staged form (or no Gluon here): the Triton module
            kernel._staged_auto, kernel._staged_reason = False, f"{type(exc).__name__}: {exc}"
            return None
    gs = kernel._staged_auto
    g0 = gs[0]
    try:
        grid, args, kw, _ = g0.launch_args(inputs)
    except (ValueError, TypeError) as exc:
        choices[key], kernel._staged_reason = "triton", str(exc)
        return None
    lens = {}
    for n, axes in g0.tensors.items():
        lens.update(zip(axes, inputs[n].shape))
    n_j = lens[g0.axis]
    work = n_j
    for a in g0.row_axes:
        work *= lens[a]
    if n_j <= AUTO_MIN_NJ or work < AUTO_MIN_WORK:
        choices[key] = "triton"
        return None
    from acefuse.codegen import tuning
    from acefuse.codegen.compile import run_module
    src = _choice_source(kernel, gs)
    disk_key = tuple((n, tuple(t.shape), tuple(t.stride()), str(t.dtype)) for n, t in inputs.items())
    stored = _remembered(tuning.lookup(src, "staged", disk_key, ts[0].device), gs)
    if stored is not None:
        which, times = stored
        kernel.__dict__.setdefault("_staged_times", {})[key] = times
        if which == "triton":
            choices[key] = "triton"
            return None
        try:
            out = which(**inputs)
        except Exception as exc:
            warnings.warn(f"program {name!r}: the staged Gluon kernel remembered as the faster ({which.tag}) failed "
                          f"at shapes {shapes} ({type(exc).__name__}: {str(exc)[:200]}); the Triton kernel runs",
                          stacklevel=3)
            choices[key], kernel._staged_reason = "triton", f"{type(exc).__name__}: {exc}"
            return None
        choices[key] = which
        return _result(out)
    want = run_module(kernel.module, (), inputs)   # (its own first call: the Triton launch's timed choice)
    outs = want if isinstance(want, dict) else {g0.stores[0][0]: want}
    ran, first = [], {}
    for g in gs:
        try:
            got = g(**inputs)
        except Exception as exc:
            warnings.warn(f"program {name!r}: the staged Gluon kernel ({g.tag}) failed at shapes {shapes} "
                          f"({type(exc).__name__}: {str(exc)[:200]}); it is left out of the choice", stacklevel=3)
            kernel._staged_reason = f"{g.tag}: {type(exc).__name__}: {exc}"
            continue
        if set(got) != set(outs) or not all(got[n].dtype == outs[n].dtype and _agree(got[n], outs[n]) for n in outs):
            warnings.warn(f"program {name!r}: the staged Gluon kernel's ({g.tag}) outputs differ from the Triton "
                          f"kernel's at shapes {shapes}; the Triton kernel is kept", stacklevel=3)
            choices[key] = "triton"
            return want
        ran.append(g)
        first[g] = got
    if not ran:
        choices[key] = "triton"
        return want
    times = _time_pair([lambda: run_module(kernel.module, (), inputs)] + [lambda g=g: g(**inputs) for g in ran])
    t_tri, t_st = times[0], min(times[1:])
    best = ran[times[1:].index(t_st)]
    choices[key] = best if t_st <= AUTO_MARGIN * t_tri else "triton"
    kernel.__dict__.setdefault("_staged_times", {})[key] = (t_tri, t_st)
    if len(ran) == len(gs):
        tuning.record(src, "staged", disk_key, ts[0].device,
                      {"kernel": "triton" if choices[key] == "triton" else "staged", "config": best.tag,
                       "triton_s": t_tri, "staged_s": t_st})
    if choices[key] == "triton":
        return want
    return _result(first[best])


__all__ = ["auto_staged"]
