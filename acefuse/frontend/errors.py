"""Errors of the torch frontend; each names the torch op, its source line and the next step."""
from __future__ import annotations


class FrontendError(ValueError):
    """A torch function could not be imported as asked; the message says what to change."""


class UnsupportedOpError(FrontendError):
    """A torch op (or an argument of it) that the importer has no lowering for.

    ``op`` is the op's name as torch spells it (``torch.cumsum``, ``Tensor.scatter_``),
    ``line`` the user's source line it came from (``file.py:12: y = x.cumsum(-1)``)."""

    def __init__(self, op: str, line: str, detail: str = ""):
        self.op, self.line, self.detail = op, line, detail
        self.node = None   # the FX node, when the error comes from lowering one
        where = f" at {line}" if line else ""
        why = f": {detail}" if detail else ""
        super().__init__(
            f"acefuse cannot import `{op}`{where}{why}. Supported ops are listed in docs/frontend.md; "
            "compute this part in torch before or after the acefuse function, or use "
            "af.compile(fn, ...) / torch.compile(backend=af.backend), which keep unsupported ops in torch.")
