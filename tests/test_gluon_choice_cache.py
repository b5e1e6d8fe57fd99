"""The automatic Gluon-or-Triton choice of af.compile's kernels (codegen/contraction_gluon.py
auto_gluon) is remembered on disk (codegen/tuning.py, what='gluon'): a fresh kernel object (a
fresh process alike) runs the remembered kernel without timing, another shape or ACEFUSE_TUNING_CACHE=0
times again, and a choice made because the outputs disagreed is not written to disk.

No GPU here: the sm_90 checks, the timing (``_time_pair``) and the Gluon launch
(``GluonKernel.__call__``) are replaced by counting stand-ins; the Gluon stand-in returns an
independent float64 result rounded to bfloat16 (or a wrong one, for the disagreement), the
Triton kernel runs in Triton's interpreter, and every result is compared with float64.

    python -m pytest -q tests/test_gluon_choice_cache.py -p no:cacheprovider
"""
import math

import pytest
import torch

import acefuse as af
from acefuse.codegen import contraction_gluon as cg

D = 128
q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")


def _prog():
    s = af.sum(q * k, "d") * (1.0 / math.sqrt(D))
    p = af.exp(s - af.max(s, "j"))
    return af.program("p_remembered", o=af.sum(p * v, "j") / af.sum(p, "j"))


def _ref(qx, kx, vx):
    s = qx.double() @ kx.double().transpose(-1, -2) / math.sqrt(D)
    return torch.softmax(s, -1) @ vx.double()


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {x: torch.randn(1, 2, n, D, generator=g).to(torch.bfloat16) for x in "qkv"}


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """An sm_90 GPU as auto_gluon sees it: counting stand-ins for the timing and the Gluon
    launch. ``gpu.times``: the (Triton, Gluon) seconds the timing reports; ``gpu.wrong``: the
    Gluon stand-in returns a wrong result."""
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ACEFUSE_TUNING_CACHE", raising=False)
    monkeypatch.delenv("ACEFUSE_GLUON", raising=False)
    monkeypatch.setattr(cg, "_cuda_eager", lambda ts: all(type(t) is torch.Tensor for t in ts))
    monkeypatch.setattr(cg, "_sm90", lambda dev: True)
    monkeypatch.setattr(cg, "AUTO_MIN_WORK", 0)
    monkeypatch.setattr(cg, "AUTO_VARIANTS", ({"ws": True, "persistent": True},))   # one Gluon kernel (but below)

    class State:
        times = (2e-3, 1e-3)   # Gluon faster
        wrong = False
        timed = []
        launched = []
    st = State()

    def time_pair(fns, rounds=3, reps=5):
        st.timed.append(len(fns))
        assert len(fns) == len(st.times)
        return list(st.times)

    def launch(self, **inputs):
        st.launched.append(cg._variant_tag(self))
        o = _ref(inputs["q"], inputs["k"], inputs["v"])
        if st.wrong:
            o = -o
        return {"o": o.to(inputs["q"].dtype)}
    monkeypatch.setattr(cg, "_time_pair", time_pair)
    monkeypatch.setattr(cg.GluonKernel, "__call__", launch)
    st.store = tmp_path / "tuning"
    return st


def _call(kern, ins):
    out = kern(**ins)
    assert _rel(out, _ref(ins["q"], ins["k"], ins["v"])) < 2e-2
    return kern.kernel


def test_a_fresh_kernel_runs_the_remembered_choice_without_timing(gpu):
    ins = _inputs(40, 1)
    a = _call(af.compile(_prog()), ins)
    assert gpu.timed == [2] and len(gpu.launched) == 1
    assert isinstance(next(iter(a._gluon_choice.values())), cg.GluonKernel)
    assert len(list(gpu.store.glob("*.json"))) == 1
    b = _call(af.compile(_prog()), _inputs(40, 2))   # a fresh kernel object: nothing in memory
    assert gpu.timed == [2] and len(gpu.launched) == 2   # not timed; the remembered Gluon kernel ran
    assert isinstance(next(iter(b._gluon_choice.values())), cg.GluonKernel)
    assert list(b._gluon_times.values()) == [gpu.times]   # the times it was chosen by, read back
    _call(af.compile(_prog()), _inputs(48, 3))   # another shape: timed
    assert gpu.timed == [2, 2]


def test_a_remembered_triton_choice_launches_no_gluon_kernel(gpu):
    gpu.times = (1e-3, 2e-3)   # Triton faster
    ins = _inputs(40, 4)
    _call(af.compile(_prog()), ins)
    assert gpu.timed == [2] and len(gpu.launched) == 1
    b = _call(af.compile(_prog()), ins)
    assert gpu.timed == [2] and len(gpu.launched) == 1 and list(b._gluon_choice.values()) == ["triton"]


def test_strides_are_part_of_the_key(gpu):
    ins = _inputs(40, 5)
    _call(af.compile(_prog()), ins)
    t = {n: x.transpose(1, 2).contiguous().transpose(1, 2) for n, x in ins.items()}   # other strides
    _call(af.compile(_prog()), t)
    assert gpu.timed == [2, 2]


def test_tuning_cache_off_times_every_kernel(gpu, monkeypatch):
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    ins = _inputs(40, 6)
    _call(af.compile(_prog()), ins)
    _call(af.compile(_prog()), ins)
    assert gpu.timed == [2, 2] and not gpu.store.exists()


def test_disagreeing_outputs_keep_triton_and_are_not_remembered(gpu):
    gpu.wrong = True
    ins = _inputs(40, 7)
    kern = af.compile(_prog())
    with pytest.warns(UserWarning, match="differ"):
        a = _call(kern, ins)   # the Triton kernel's (right) result
    assert list(a._gluon_choice.values()) == ["triton"] and not gpu.timed
    _call(kern, ins)           # this kernel: Triton, without launching the Gluon kernel again
    assert len(gpu.launched) == 1 and not gpu.timed
    assert not list(gpu.store.glob("*.json"))   # nothing on disk: another process checks again
    with pytest.warns(UserWarning, match="differ"):
        _call(af.compile(_prog()), ins)
    assert len(gpu.launched) == 2


def test_a_changed_source_times_again(gpu, monkeypatch):
    ins = _inputs(40, 8)
    _call(af.compile(_prog()), ins)
    real = cg.compile_gluon

    def changed(*a, **kw):
        g = real(*a, **kw)
        g.source += "\n# another version\n"
        return g
    monkeypatch.setattr(cg, "compile_gluon", changed)
    _call(af.compile(_prog()), ins)
    assert gpu.timed == [2, 2]


def test_an_unreadable_entry_is_timed_again(gpu):
    ins = _inputs(40, 9)
    _call(af.compile(_prog()), ins)
    (f,) = gpu.store.glob("*.json")
    import json
    data = json.loads(f.read_text())
    data["value"] = {"kernel": "cuda"}   # not a choice: timed again and rewritten
    f.write_text(json.dumps(data))
    _call(af.compile(_prog()), ins)
    assert gpu.timed == [2, 2] and json.loads(f.read_text())["value"]["kernel"] == "gluon"


def test_the_fastest_of_several_gluon_kernels_is_kept_and_remembered(gpu, monkeypatch):
    """With two Gluon variants, both run and are checked on the timed call; the faster (here
    the second, ping-pong) is kept, remembered, and a fresh kernel launches only it."""
    monkeypatch.setattr(cg, "AUTO_VARIANTS", ({"ws": True, "persistent": True},
                                              {"ws": True, "persistent": True, "pingpong": True}))
    gpu.times = (2e-3, 1.5e-3, 1e-3)
    ins = _inputs(40, 10)
    a = _call(af.compile(_prog()), ins)
    assert gpu.timed == [3] and gpu.launched == ["ws,persistent,tile_store", "ws,pingpong,persistent,tile_store"]
    (kept,) = a._gluon_choice.values()
    assert cg._variant_tag(kept) == "ws,pingpong,persistent,tile_store"
    assert list(a._gluon_times.values()) == [(2e-3, 1e-3)]
    b = _call(af.compile(_prog()), ins)
    assert gpu.timed == [3] and gpu.launched[2:] == ["ws,pingpong,persistent,tile_store"]
    assert cg._variant_tag(next(iter(b._gluon_choice.values()))) == "ws,pingpong,persistent,tile_store"
    gpu.wrong = True   # one variant's outputs disagreeing: Triton kept, nothing recorded
    with pytest.warns(UserWarning, match="differ"):
        c = _call(af.compile(_prog()), _inputs(44, 11))
    assert list(c._gluon_choice.values()) == ["triton"] and len(list(gpu.store.glob("*.json"))) == 1
