import os

import pytest

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # long property runs (marked slow) run only when asked for: pytest -m slow
    if "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="long run: use pytest -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    # ACEFUSE_FAILURE_LOG=path: each failure's traceback is appended to that file as soon as it is
    # reported (with pytest-xdist, in the controller as the workers send their reports), so a run
    # cut by a time limit (the GPU machine's calls) still says what failed and why; pytest's own
    # summary comes only at the end
    path = os.environ.get("ACEFUSE_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):   # (the controller writes)
        return
    with open(path, "a") as f:
        f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
