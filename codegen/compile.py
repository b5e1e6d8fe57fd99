"""af.compile: fuse a program, generate its Triton module, load it, return a callable.

Generated modules are cached on disk by a hash of the program, the axis and the
acefuse version (``$ACEFUSE_CACHE_DIR/kernels``, default ``~/.cache/acefuse/kernels``).
With no CUDA device, kernels run through Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

GEN_VERSION = "row-1"


def cache_dir() -> Path:
    base = os.environ.get("ACEFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "acefuse")
    p = Path(base) / "kernels"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _ensure_backend():
    """Use Triton's interpreter when there is no GPU (must be set before kernels are defined)."""
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"


class Kernel:
    """A compiled program: call it with the inputs by name (or position)."""

    def __init__(self, fusion, source: str, path: Path, module):
        self.fusion = fusion
        self.program = fusion.program
        self.source = source
        self.path = path
        self.module = module

    def __call__(self, *args, **inputs):
        if os.environ.get("TRITON_INTERPRET") == "1":
            import numpy as np
            with np.errstate(all="ignore"):  # the interpreter evaluates masked lanes too
                return self.module.run(*args, **inputs)
        return self.module.run(*args, **inputs)

    @property
    def fusible(self):
        return self.fusion.fusible

    def __repr__(self):
        return f"<acefuse kernel {self.program.name!r} over {self.fusion.axis!r} ({self.path})>"


def load_module(path: Path, name: str):
    _ensure_backend()
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_program(prog, axis=None, rules=(), allow_unproved=False, fusion=None):
    from acefuse.fuse import fuse
    from acefuse.codegen import row, contraction
    f = fusion or fuse(prog, axis=axis, rules=rules, allow_unproved=allow_unproved)
    src = (contraction if contraction.is_contraction(f) else row).generate(f)
    h = hashlib.sha256((GEN_VERSION + src).encode()).hexdigest()[:16]
    path = cache_dir() / f"{prog.name}_{h}.py"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(src)
        os.replace(tmp, path)
    mod = load_module(path, f"acefuse_gen_{prog.name}_{h}")
    return Kernel(f, src, path, mod)
