"""Progress bars for long runs (tqdm): on stderr, and off when stderr is not a terminal or
the user asked for ``--quiet``, so that pipes, logs and tests stay clean."""
from __future__ import annotations

import sys


def enabled(quiet: bool = False) -> bool:
    try:
        return not quiet and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def bar(iterable=None, *, quiet: bool = False, **kw):
    """``tqdm(iterable, ...)`` on stderr, disabled unless :func:`enabled`."""
    from tqdm import tqdm
    kw.setdefault("file", sys.stderr)
    kw.setdefault("leave", False)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(iterable, disable=not enabled(quiet), **kw)
