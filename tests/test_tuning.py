"""The tuning cache (codegen/tuning.py): a launch configuration timed on the GPU is kept on
disk, so that another launcher of the same module, in this process or a fresh one, does not
time it again; a changed module source, device, or a corrupt or stale entry times again.

On the CPU nothing is timed, so these tests call the contraction launcher's timed choices
(``_timed_schedule``: loop vs split-KV; ``_tuned``: tile shapes) directly, with its
``_fastest`` (the GPU timing) replaced by a counter that picks a fixed candidate.
"""
import json
import os
import runpy
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.codegen import compile as cc
from acefuse.codegen import tuning

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))
KEY = (1, 64, 16, 16, 4096, "torch.bfloat16", (128, 128))   # a _timed_schedule key (shape class)


@pytest.fixture(scope="module")
def decode_path():
    kern = af.compile(EX["decode"])
    return Path(kern.module.__file__)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ACEFUSE_TUNING_CACHE", raising=False)
    return tmp_path / "tuning"


_LOADED = [0]


def _launcher(path):
    """A fresh module object of the generated source at ``path`` (a second launcher)."""
    _LOADED[0] += 1
    return cc.load_module(path, f"acefuse_test_tuning_{_LOADED[0]}")


def _counting(mod, pick):
    """Replace ``mod._fastest`` (the GPU timing) by one that counts its calls and returns
    candidate number ``pick``."""
    calls = []

    def fastest(cands, call, required=()):
        calls.append(list(cands))
        return cands[pick]
    mod._fastest = fastest
    return calls


def _inputs(dtype=torch.bfloat16):
    return dict(q=torch.randn(2, 2, 4, 1, 16, dtype=dtype), k=torch.randn(2, 2, 40, 16, dtype=dtype),
                v=torch.randn(2, 2, 40, 16, dtype=dtype))


def test_a_second_launcher_does_not_time_again(decode_path, store):
    a = _launcher(decode_path)
    timed = _counting(a, 1)
    assert a._timed_schedule(KEY, _inputs(), None, 16) == ("split", None)
    assert len(timed) == 1 and len(list(store.glob("*.json"))) == 1
    b = _launcher(decode_path)                       # another launcher: nothing in memory
    again = _counting(b, 0)
    got = b._timed_schedule(KEY, _inputs(), None, 16)
    assert got == ("split", None) and isinstance(got, tuple) and not again
    # another shape key is timed
    assert b._timed_schedule(KEY[:4] + (8192,) + KEY[5:], _inputs(), None, 16) == ("loop", None)
    assert len(again) == 1


def test_tile_shapes_are_remembered_as_the_candidates_themselves(decode_path, store):
    a = _launcher(decode_path)
    timed = _counting(a, 2)
    best = a._tuned(_inputs(), None, "portable")
    assert best == dict(a.CANDIDATES[2], path="portable") and len(timed) == 1
    b = _launcher(decode_path)
    again = _counting(b, 0)
    assert b._tuned(_inputs(), None, "portable") == best and not again
    # the key holds the dtype: float16 inputs are timed
    b._tuned(_inputs(torch.float16), None, "portable")
    assert len(again) == 1


def test_another_source_or_device_times_again(decode_path, store, tmp_path, monkeypatch):
    a = _launcher(decode_path)
    _counting(a, 1)
    a._timed_schedule(KEY, _inputs(), None, 16)
    # the same module with one changed line of source
    edited = tmp_path / "edited.py"
    edited.write_text(decode_path.read_text().replace("MAX_PLANS = 512", "MAX_PLANS = 511"))
    b = _launcher(edited)
    timed = _counting(b, 0)
    assert b._timed_schedule(KEY, _inputs(), None, 16) == ("loop", None) and len(timed) == 1
    # the same source on another device
    monkeypatch.setattr(tuning, "device_name", lambda dev: "Another GPU (7 SMs)")
    c = _launcher(decode_path)
    timed = _counting(c, 0)
    assert c._timed_schedule(KEY, _inputs(), None, 16) == ("loop", None) and len(timed) == 1


def test_another_torch_or_triton_version_times_again(decode_path, store, monkeypatch):
    import triton
    a = _launcher(decode_path)
    _counting(a, 1)
    a._timed_schedule(KEY, _inputs(), None, 16)
    for mod, attr in ((torch, "__version__"), (triton, "__version__")):
        with monkeypatch.context() as m:
            m.setattr(mod, attr, "0.0-other")
            b = _launcher(decode_path)
            timed = _counting(b, 0)
            assert b._timed_schedule(KEY, _inputs(), None, 16) == ("loop", None) and len(timed) == 1


def test_a_fresh_process_does_not_time_again(decode_path, store):
    a = _launcher(decode_path)
    _counting(a, 1)
    a._timed_schedule(KEY, _inputs(), None, 16)
    code = (
        "import sys, torch\n"
        "from acefuse.codegen.compile import load_module\n"
        f"mod = load_module({str(decode_path)!r}, 'fresh')\n"
        "def fastest(*a, **k):\n"
        "    raise SystemExit('timed again')\n"
        "mod._fastest = fastest\n"
        "ins = dict(q=torch.randn(2, 2, 4, 1, 16), k=torch.randn(2, 2, 40, 16), v=torch.randn(2, 2, 40, 16))\n"
        f"print(mod._timed_schedule({KEY!r}, ins, None, 16))\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "('split', None)"


def test_a_corrupt_or_stale_entry_is_timed_again(decode_path, store):
    a = _launcher(decode_path)
    _counting(a, 1)
    a._timed_schedule(KEY, _inputs(), None, 16)
    (entry,) = store.glob("*.json")
    for bad, why in ((entry.read_text()[:20], "not JSON"), ("[1, 2]", "not an entry for this key")):
        entry.write_text(bad)
        b = _launcher(decode_path)
        timed = _counting(b, 0)
        with pytest.warns(cc.CacheWarning, match=why):
            assert b._timed_schedule(KEY, _inputs(), None, 16) == ("loop", None)
        assert len(timed) == 1
        assert json.loads(entry.read_text())["value"] == ["loop", None]   # rewritten
    # a value that is none of the candidates (edited by hand): timed again
    data = json.loads(entry.read_text())
    data["value"] = ["split", 4096]
    entry.write_text(json.dumps(data))
    c = _launcher(decode_path)
    timed = _counting(c, 1)
    with pytest.warns(cc.CacheWarning, match="none of the candidates"):
        assert c._timed_schedule(KEY, _inputs(), None, 16) == ("split", None)
    assert len(timed) == 1


def test_the_store_can_be_turned_off(decode_path, store, monkeypatch):
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    for n in range(2):
        mod = _launcher(decode_path)
        timed = _counting(mod, 1)
        mod._timed_schedule(KEY, _inputs(), None, 16)
        assert len(timed) == 1
    assert not store.exists() or not list(store.glob("*"))


def test_an_unwritable_store_still_chooses(decode_path, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(blocker))   # tuning/ cannot be made under a file
    mod = _launcher(decode_path)
    timed = _counting(mod, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mod._timed_schedule(KEY, _inputs(), None, 16) == ("split", None)
    assert len(timed) == 1


def test_concurrent_writers_leave_whole_entries(store):
    src = "0" * 64

    def writer(n):
        for i in range(25):
            tuning.record(src, "tiles", ("shape", i % 5), "cpu", {"writer": n, "i": i})

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(5):
            v = tuning.lookup(src, "tiles", ("shape", i), "cpu")
            assert set(v) == {"writer", "i"} and v["i"] % 5 == i
    assert sorted(p.name.startswith(".") for p in store.iterdir()) == [False] * 5   # no temporary left


@pytest.mark.gpu
def test_a_second_launcher_on_the_gpu_does_not_time(decode_path, store):
    """Decode at a shape whose programs cannot fill the GPU: the first launcher times loop vs
    split-KV, a second (same cache directory) launches what the first chose, untimed."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, G, R, D, L = 8, 8, 4, 128, 4096
    ins = dict(q=torch.randn(B, G, R, 1, D, device="cuda", dtype=torch.bfloat16, generator=g),
               k=torch.randn(B, G, L, D, device="cuda", dtype=torch.bfloat16, generator=g),
               v=torch.randn(B, G, L, D, device="cuda", dtype=torch.bfloat16, generator=g))
    q, k, v = (ins[n].double() for n in "qkv")
    ref = torch.einsum("bgrij,bgje->bgrie", torch.softmax(torch.einsum("bgrid,bgjd->bgrij", q, k)
                                                          * EX["SCALE"], -1), v)
    counts = []
    for n in range(2):
        mod = _launcher(decode_path)
        real, calls = mod._time_calls, []
        mod._time_calls = lambda fn, reps=5: calls.append(1) or real(fn, reps)
        out = mod.run(**ins)
        torch.cuda.synchronize()
        assert (out.double() - ref).abs().max().item() < 2e-2
        counts.append(len(calls))
    assert counts[0] >= 2 and counts[1] == 0, counts


def test_the_sum_kernels_configuration_is_remembered(store):
    """codegen/sums_launch.py's timed configuration (a backward stage's first call: 13-24 s
    on an H100) goes through the same store: a second launcher does not time it again."""
    q, k = af.tensor("q", "b h i d"), af.tensor("k", "b h j d")
    g = af.tensor("g", "b h i j")
    prog = af.program("tuning_sums", out=af.sum(af.exp(af.sum(q * k, "d")) * g * q, "i"))
    path = Path(af.compile(prog, axis="i").module.__file__)
    ins = dict(q=torch.randn(1, 2, 40, 16), k=torch.randn(1, 2, 24, 16), g=torch.randn(1, 2, 40, 24))
    sizes = dict(b=1, h=2, i=40, j=24, d=16)
    a = _launcher(path)
    assert a._tuned is not None
    timed = _counting(a, 1)
    best = a._tuned(ins, sizes, ins["q"], torch.device("cpu"))
    assert len(timed) >= 1 and len(list(store.glob("*.json"))) == 1
    b = _launcher(path)
    again = _counting(b, 0)
    assert b._tuned(ins, sizes, ins["q"], torch.device("cpu")) == best and not again
