"""Derive and generate the benchmark kernels here (needs egglog), and write the
self-contained modules (torch + triton only) to benchmarks/kernels/, which the
GPU benchmarks import. Run: python benchmarks/export.py
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "kernels"

# (example file, program variable) pairs that the benchmarks time
PROGRAMS = [
    ("examples/softmax.py", "softmax"),
    ("examples/softmax.py", "lse"),
    ("examples/norms.py", "layernorm"),
    ("examples/norms.py", "rmsnorm"),
    ("examples/norms.py", "log_softmax"),
    ("examples/norms.py", "cross_entropy"),
    ("examples/attention.py", "attention"),
    ("examples/attention.py", "causal"),
    ("examples/attention.py", "alibi"),
    ("examples/attention.py", "softcap"),
    ("examples/attention.py", "sliding_window"),
    ("examples/attention.py", "gqa"),
    ("examples/attention.py", "decode"),
]


def main(argv=None) -> int:
    from acefuse.codegen.compile import compile_program
    OUT.mkdir(exist_ok=True)
    for f, var in PROGRAMS:
        path = ROOT / f
        if not path.exists():
            print(f"skip {f} (missing)")
            continue
        ns = runpy.run_path(str(path))
        if var not in ns:
            print(f"skip {f}:{var} (not defined)")
            continue
        prog = ns[var]
        try:
            k = compile_program(prog)
        except Exception as exc:  # report and go on: the table says what is missing
            print(f"FAILED {f}:{var}: {exc}")
            continue
        dst = OUT / f"{var}.py"
        # written whole, then renamed: a reader in another process (pytest-xdist workers of
        # tests/test_gpu.py export on first use, each of them) never sees a half-written module
        tmp = dst.with_name(f".{var}.{os.getpid()}.tmp")
        tmp.write_text(k.source)
        os.replace(tmp, dst)
        print(f"wrote {dst.relative_to(ROOT)} ({'fused' if k.fusible else 'not fusible'}, "
              f"HBM passes {k.fusion.hbm_passes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
