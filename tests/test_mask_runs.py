"""The contraction template's mask analysis finds the whole run of fully visible key tiles, however
many SCAN-tile steps it spans (issue 15: with SCAN = 16 the Gluon kernel ran every causal tile past
the first 2048 keys through the masked loop). The analysis block of the generated source is run
here with numpy standing in for ``tl`` (codegen/masks.py ``_NumpyTL``), at small SCAN, against a
brute-force tile classification."""
import runpy
from pathlib import Path

import numpy as np
import pytest

import acefuse as af
from acefuse.codegen.masks import _NumpyTL   # the analysis' tl on host arrays (codegen/masks.py)

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))
i, j = af.index("i"), af.index("j")


def _analysis(src):
    """The generated lines from the analysis' first assignment to ``b = ``, dedented."""
    lines = src.split("\n")
    s = next(n for n, ln in enumerate(lines) if ln.startswith("    BIG = "))
    e = next(n for n in range(s, len(lines)) if lines[n].startswith("    b = "))
    return "\n".join(ln[4:] for ln in lines[s:e + 1])


def _run(code, i_lo, i_hi, n_j, block_j, scan):
    env = dict(tl=_NumpyTL, i_lo=float(i_lo), i_hi=float(i_hi), n_j=n_j, BLOCK_J=block_j, SCAN=scan)
    exec(code, env)
    return int(env["first"]), int(env["a"]), int(env["b"]), int(env["end"])


def _band(window):
    q = af.tensor("q", "b h i d")
    k = af.tensor("k", "b h j d")
    v = af.tensor("v", "b h j e")
    s = af.where((j <= i) & (i - j < window), af.sum(q * k, "d") * 0.3, af.NEG_INF)
    p = af.exp(s - af.max(s, "j"))
    return af.program(f"band{window}", o=af.sum(p * v, "j") / af.sum(p, "j"))


@pytest.mark.parametrize("name,visible", [
    ("causal", lambda ii, jj: jj <= ii),
    ("band", lambda ii, jj: (jj <= ii) & (ii - jj < 200)),
])
def test_full_run_spans_every_step(name, visible):
    prog = EX["causal"] if name == "causal" else _band(200)
    code = _analysis(af.compile(prog).source)
    assert "goes_on = " in code
    rng = np.random.default_rng()
    n_j, bj = 1000, 16
    for scan in (2, 4, 16):
        for _ in range(40):
            i_lo = int(rng.integers(0, n_j))
            i_hi = min(n_j - 1, i_lo + int(rng.integers(0, 3 * bj)))
            first, a, b, end = _run(code, i_lo, i_hi, n_j, bj, scan)
            ii = np.arange(i_lo, i_hi + 1)[:, None]
            full = [t for t in range(0, n_j, bj) if t + bj <= n_j
                    and visible(ii, np.arange(t, t + bj)[None, :]).all()]
            seen = [t for t in range(0, n_j, bj) if visible(ii, np.arange(t, min(t + bj, n_j))[None, :]).any()]
            # the run [a, b) holds fully visible tiles only, all of them (they are one run here),
            # and [first, end) every tile that shows a key
            assert set(range(a, b, bj)) == set(full), (scan, i_lo, i_hi, a, b, full[:3], full[-3:])
            assert first <= min(seen) and end >= min(max(seen) + bj, n_j)


def test_the_run_check_fails_without_the_continuation():
    """The check above, on the analysis with its continuation line removed, finds the cut run."""
    code = _analysis(af.compile(EX["causal"]).source).replace("take | goes_on", "take")
    first, a, b, end = _run(code, 900, 915, 1000, 16, 4)
    assert (a, b) == (0, 64)   # one step of 4 tiles; tiles 64 .. 895 went to the masked loop


@pytest.mark.parametrize("name,window", [("causal", None), ("band", 90)])
def test_kernel_with_the_run_over_several_steps_float64(name, window, monkeypatch):
    """The Triton kernel itself where the analysis takes several steps (SCAN_MAX 16, 16 keys a
    tile, 300 keys: two steps, the full run crossing between them), against float64 on fresh
    random inputs: the loops' bounds from the continued run keep every value."""
    import torch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prog = EX["causal"] if name == "causal" else _band(window)
    kern = af.compile(prog)
    monkeypatch.setattr(kern.module, "SCAN_MAX", 16)
    n = 300
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    qq, kk, vv = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    scale = EX["SCALE"] if name == "causal" else 0.3
    s = torch.einsum("bhid,bhjd->bhij", qq.double(), kk.double()) * scale
    ii, jj = torch.arange(n)[:, None], torch.arange(n)[None, :]
    vis = (jj <= ii) if window is None else (jj <= ii) & (ii - jj < window)
    ref = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ vv.double()
    o = kern(q=qq, k=kk, v=vv, path="portable", block_j=16)
    assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())
