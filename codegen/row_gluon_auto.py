"""The automatic choice between the row family's staged Gluon kernel (codegen/row_gluon.py) and
the Triton module's own launch, for af.compile's kernels on an sm_90 GPU (called from
codegen/compile.py ``Kernel.__call__``): timed on the first call per input shapes, outputs
compared, the faster kept, remembered on the kernel and on disk (codegen/tuning.py,
``what='staged'``): codegen/auto_choice.py, shared with the contraction family's ``auto_gluon``;
this module says what is particular to rows. A row longer than the ring (262144 bf16 elements:
64 chunks, 28 slots fit) is timed the same way, through the staged kernel's partial form
(codegen/row_gluon_partial.py: its first chunks kept in shared memory, the rest read twice, one
row in flight: AUTO_CONFIGS' two groups run as one).
"""
from __future__ import annotations

import hashlib
import sys

from acefuse.codegen import row_gluon
from acefuse.codegen.auto_choice import Family, choose
from acefuse.codegen.contraction_gluon import _cuda_eager, _sm90, _time_pair   # noqa: F401 (read by auto_choice)

# the configurations the automatic choice times against the Triton module (the fastest of those
# whose outputs agree is kept where it beats the Triton launch by AUTO_MARGIN): two rows in flight,
# two compute groups of 4 warps. One H200, bf16, % of copy (session 17,
# benchmarks/results/session17/h200_4644404_rows_in_flight.txt): softmax 4096x65536 88.3% against
# 76.1% with one row in flight (the probe 79.1%); 8192x32768 89.7% against 74.7%; RMSNorm 71.1%
# against 55.0%; layernorm 55.5% against 37.7%
AUTO_CONFIGS = ({"num_warps": 8, "rows_in_flight": 2},)
AUTO_MIN_NJ = 16384        # rows up to this length: the single-tile Triton schedule reads them once already
AUTO_MIN_WORK = 1 << 24    # rows x columns below which the Triton kernel is kept untimed
AUTO_MARGIN = 0.97         # the staged kernel is kept only at most this fraction of the Triton time


def _auto_enabled():
    """On unless ``ACEFUSE_STAGED=0`` or ``ACEFUSE_GLUON=0``. Where the Triton module is faster
    (RMSNorm and layernorm at 4096x65536 on the H200: 85.6% and 73% of copy, sessions 14 and 16,
    against the staged kernel's 71.1% and 55.5%) the timed choice keeps it."""
    import os
    return os.environ.get("ACEFUSE_GLUON", "") != "0" and os.environ.get("ACEFUSE_STAGED", "") != "0"


def _choice_source(kernel, gs) -> str | None:
    tri = getattr(kernel, "source", None)
    if tri is None:
        return None
    # (the partial form's source too: it runs rows longer than the ring)
    return hashlib.sha256("\0".join([tri] + [g.source + g.tag + (g.partial_source or "") for g in gs]).encode()).hexdigest()


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
