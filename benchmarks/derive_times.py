"""Time af.fuse (normal form + saturation + extraction) per example program, warm
process, on this machine (CPU). Prints e-graph size and stop reason.

    python benchmarks/derive_times.py
"""
import runpy
import time
from pathlib import Path

import acefuse as af

ROOT = Path(__file__).resolve().parents[1]
af.fuse(runpy.run_path(str(ROOT / "examples" / "softmax.py"))["softmax"])  # warm: proofs cache, imports
for f in ("softmax.py", "norms.py", "attention.py", "not_fusible.py"):
    ns = runpy.run_path(str(ROOT / "examples" / f))
    for name, p in ns.items():
        if isinstance(p, af.Program):
            t = time.perf_counter()
            fu = af.fuse(p)
            ms = (time.perf_counter() - t) * 1e3
            sizes = ", ".join(f"{q.stats.nodes} e-nodes ({q.stats.stop_reason})" for q in fu.passes)
            print(f"{f}:{name:20s} {ms:7.1f} ms  fusible={fu.fusible!s:5s} passes {fu.hbm_passes}  {sizes}")
