"""tests/conftest.py's ACEFUSE_FAILURE_LOG: a failing test's traceback reaches the file while the
run goes on (a GPU call cut by its time limit used to lose every failure's message)."""
import os
import subprocess
import sys
from pathlib import Path


import pytest


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_failure_log_gets_each_failure_at_once(tmp_path, workers):
    (tmp_path / "test_probe.py").write_text(
        "def test_ok():\n    assert 1 + 1 == 2\n\n\n"
        "def test_bad():\n    assert [1, 2] == [1, 3], 'the message to find'\n")
    conf = Path(__file__).with_name("conftest.py")
    (tmp_path / "conftest.py").write_text(conf.read_text())
    log = tmp_path / "failures.txt"
    # (not the outer run's PYTEST_XDIST_WORKER & co: under xdist the inner controller would take
    # itself for a worker and leave the writing to nobody)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["ACEFUSE_FAILURE_LOG"] = str(log)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1, r.stdout[-2000:]
    text = log.read_text()
    assert text.count("test_probe.py::test_bad (call)") == 1 and "the message to find" in text
    assert "test_ok" not in text
