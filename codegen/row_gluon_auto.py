"""The automatic choice between the row family's staged Gluon kernel (codegen/row_gluon.py) and
the Triton module's own launch, for af.compile's kernels on an sm_90 GPU (called from
codegen/compile.py ``Kernel.__call__``): timed on the first call per input shapes, outputs
compared, the faster kept, remembered on the kernel and on disk (codegen/tuning.py,
``what='staged'``): codegen/auto_choice.py, shared with the contraction family's ``auto_gluon``;
this module says what is particular to rows.
"""
from __future__ import annotations

import hashlib
import sys

from acefuse.codegen import row_gluon
from acefuse.codegen.auto_choice import Family, choose
from acefuse.codegen.contraction_gluon import _cuda_eager, _sm90, _time_pair   # noqa: F401 (read by auto_choice)

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


def _not_here(kernel, dev):
    """Why this program has no automatic staged kernel on ``dev``, or None (auto_choice)."""
    if not _auto_enabled() or not _sm90(dev):
        return "not an sm_90 GPU, or ACEFUSE_GLUON=0 / ACEFUSE_STAGED=0"
    if getattr(kernel.module, "RIDERS", None) or not hasattr(kernel.module, "STATES"):
        return "not a row-family module (or one with riders)"
    return None


def _compile_all(kernel):
    return tuple(row_gluon.compile_staged(kernel.fusion, **c) for c in AUTO_CONFIGS)


def _too_little(g0, inputs) -> bool:
    """Rows of AUTO_MIN_NJ elements or fewer (read once already by the single-tile schedule), or
    under AUTO_MIN_WORK elements in all: the Triton module, untimed."""
    lens = {}
    for n, axes in g0.tensors.items():
        lens.update(zip(axes, inputs[n].shape))
    n_j = lens[g0.axis]
    work = n_j
    for a in g0.row_axes:
        work *= lens[a]
    return n_j <= AUTO_MIN_NJ or work < AUTO_MIN_WORK


def _tag(g) -> str:
    return g.tag


def _single_out(g0) -> str:
    return g0.stores[0][0]


FAMILY = Family(attr="_staged", what="staged", noun="the staged Gluon kernel", tag_key="config")
_THIS = sys.modules[__name__]


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
    return choose(FAMILY, _THIS, kernel, inputs)


__all__ = ["auto_staged"]
