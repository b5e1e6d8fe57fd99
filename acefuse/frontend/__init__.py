"""acefuse's torch frontend: import plain PyTorch, compile it, or hook torch.compile.

    import acefuse.frontend as aff
    prog = aff.from_torch(lambda x: torch.softmax(x, -1), torch.randn(4, 10))   # an af.Program
    f = aff.compile_fn(fn, *example_inputs)     # drop-in callable backed by acefuse kernels
    torch.compile(model, backend=aff.backend)   # acefuse takes the subgraphs it recognises

See docs/frontend.md.
"""
import os as _os

try:  # no GPU: kernels run in Triton's interpreter (must be set before kernels are defined)
    import torch as _torch
    if not _torch.cuda.is_available():
        _os.environ.setdefault("TRITON_INTERPRET", "1")
except Exception:  # pragma: no cover
    pass

from acefuse.frontend.errors import FrontendError, UnsupportedOpError
from acefuse.frontend.importer import from_torch, from_torch_imported, Imported
from acefuse.frontend.runtime import compile_fn, backend, Backend, CompiledFunction, stats, clear_cache
from acefuse.frontend.report import Report

__all__ = ["from_torch", "from_torch_imported", "Imported", "compile_fn", "backend", "Backend", "Report", "CompiledFunction",
           "UnsupportedOpError", "FrontendError", "stats", "clear_cache"]
