"""The benchmarks' kernels derived in the run (benchmarks/_common.py ``--source compile``): the
wrapper runs ``af.compile``'s automatic call without options and the generated Triton module's
launcher with them, both against float64 here (Triton's interpreter), and says what it kept."""
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402


def test_auto_source_is_compile_where_egglog_imports():
    assert _common.set_source("auto") == "compile"
    with pytest.raises(KeyError, match="no benchmark program"):
        _common.example_program("not_a_program")


def test_compiled_softmax_with_and_without_options_against_float64():
    _common.set_source("compile")
    m = _common.load("softmax")
    g = torch.Generator().manual_seed(19)
    x = torch.randn(5, 777, generator=g) * 4
    ref = torch.softmax(x.double(), -1)
    for opts in ({}, dict(schedule="loop", block_j=128)):
        y = m.run(x=x, **opts)
        assert (y.double() - ref).abs().max().item() < 1e-6, opts
    assert m.kept() == "triton"          # (no sm_90 GPU here: the Triton module ran)
    assert m.SPLIT == m.module.SPLIT      # the generated module's attributes read through


def test_masks_benchmark_builds_its_programs_in_the_run():
    import bench_masks
    m = bench_masks.load("causal", "compile")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 48, 128, generator=g) for _ in range(3))
    o = m.run(q=q, k=k, v=v)
    s = (q.double() @ k.double().transpose(-1, -2)) * bench_masks.SCALE
    s = s.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ v.double()
    assert (o.double() - ref).abs().max().item() < 1e-4
