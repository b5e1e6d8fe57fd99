"""The test suite itself: no test module changes the process environment when it is imported.

On a GPU machine pytest-xdist imports every test module in every worker, so a module-level
``os.environ.setdefault("TRITON_INTERPRET", "1")`` (tests/test_row_persistent.py had one)
sends every later test of that worker through Triton's interpreter: the GPU tests then
fail for a reason that has nothing to do with them. Only conftest.py may set the
interpreter, and only where no GPU is present; a test sets it with monkeypatch."""
import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).parent


def _environment_writes_at_import(source):
    """Line numbers of statements outside functions and classes that write os.environ."""
    found = []

    def writes(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                owner = n.func.value
                if (n.func.attr in {"setdefault", "update", "pop", "__setitem__", "clear"}
                        and isinstance(owner, ast.Attribute) and owner.attr == "environ"):
                    return True
                if n.func.attr in {"putenv", "unsetenv"}:
                    return True
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
                for t in targets:
                    if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
                            and t.value.attr == "environ"):
                        return True
        return False

    for stmt in ast.parse(source).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if writes(stmt):
            found.append(stmt.lineno)
    return found


def test_the_checker_finds_an_import_time_write():
    bad = ("import os\nos.environ.setdefault('TRITON_INTERPRET', '1')\n"
           "os.environ['X'] = '1'\nif True:\n    os.environ.update(Y='2')\n"
           "def f():\n    os.environ['Z'] = '3'\n")
    assert _environment_writes_at_import(bad) == [2, 3, 4]


@pytest.mark.parametrize("path", sorted(p.name for p in TESTS.glob("*.py")
                                        if p.name != "conftest.py"))
def test_no_test_module_writes_the_environment_when_imported(path):
    lines = _environment_writes_at_import((TESTS / path).read_text())
    assert not lines, (f"tests/{path} writes os.environ at import (lines {lines}): on a GPU "
                       "machine every xdist worker imports it; use monkeypatch.setenv in the test")
