"""Masked tiles of the contraction template (issue 15): a where(c, s, -inf) on a masked key tile
takes the tile's bounds mask into its condition once, so the max reads the selected score as it
is, the exp2 of it is the 0 the sums need (no second select for p or for the row sum), and the
scale multiplies the selected score once. Structure of the generated source, then the kernels
against float64 on fresh random inputs at odd sizes where the diagonal tiles are partly masked."""
import re
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))
MASKS = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "masks.py"))


def _kernel_src(src, name):
    start = src.index(f"def {name}(")
    end = src.find("@triton.jit", start)
    return src[start:end if end > 0 else len(src)]


def _masked_loops(kern):
    """Bodies (comment lines dropped) of the key loops marked '# masked tiles'."""
    out, cur = [], None
    for ln in kern.split("\n"):
        if ln.startswith("    for start in ") and "masked tiles" in ln:
            cur = []
            out.append(cur)
        elif cur is not None:
            if ln.startswith("        ") or not ln.strip():
                if not ln.strip().startswith("#"):
                    cur.append(ln)
            else:
                cur = None
    return ["\n".join(b) for b in out]


@pytest.fixture(scope="module")
def causal_src():
    return af.compile(EX["causal"]).source


@pytest.mark.parametrize("hopper", [False, True])
def test_causal_masked_tile_selects_once(causal_src, hopper):
    kern = _kernel_src(causal_src, "causal_attn_hopper" if hopper else "causal_attn")
    bodies = _masked_loops(kern)
    assert bodies, "no masked loop found"
    # masked tiles inside the keys carry no bounds mask and load without one; only the tile the
    # keys end in does (issue 15: no masked loads on full tiles)
    assert sum("tmask = " in b for b in bodies) == 1, bodies
    for body in bodies:
        if "tmask = " not in body:
            assert "< n_j" not in body and "< end" not in body, body
    for body in bodies:
        # one select per element: the score, under the program's condition and the tile mask joined
        assert body.count("tl.where(") == 1, body
        w = re.search(r"(_t\d+) = tl\.where\((_c\d+), (_dot_\d+), float\('-inf'\)\)", body)
        assert w, body
        sel, cond, dot = w.groups()
        if "tmask = " in body:   # the tile the keys end in (tiles inside the keys have no tile mask)
            assert re.search(rf"{cond} = .*tmask", body)        # the tile mask joined once
        assert body.count("tmask") <= 2 + (0 if hopper else 0)   # its definition and the join
        assert re.search(rf"tl\.max\({sel}, axis=1\)", body)    # the max reads the selected score
        assert len(re.findall(rf"{dot} \* ", body)) == 0         # the raw dot is not scaled apart
        assert len(re.findall(rf"{sel} \* ", body)) == 1         # the selected score is scaled once
        assert body.count("tl.exp2(") == 2


def _ref(q, k, v, scale, mask):
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scale
    return MASKS["softmax_reference"](s, v.double(), mask)


@pytest.mark.parametrize("path", ["portable", "hopper"])
@pytest.mark.parametrize("n", [77, 1000])
def test_causal_partly_masked_tiles_float64(n, path, monkeypatch):
    """Causal at sizes that are no multiple of a tile: the last key tile is out of bounds in part,
    the diagonal tiles masked in part, the last row tile not full. Fresh inputs each run."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern = af.compile(EX["causal"])
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    D = 16 if n > 100 else 32
    q, k, v = (torch.randn(1, 1, n, D, generator=g) for _ in range(3))
    # a large shift of the scores in some rows: exp2 of -inf minus a large max still gives 0
    q[..., n // 3, :] *= 40.0
    o = kern(q=q, k=k, v=v, path=path)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = _ref(q, k, v, EX["SCALE"], j <= i)
    assert not torch.isnan(o).any()
    err = (o.double() - ref).abs().max().item()
    assert err <= 2e-5 * max(1.0, ref.abs().max().item()), err


def test_bounds_mask_still_zeroes_sums_without_an_inf_select(monkeypatch):
    """Global attention at odd sizes has no where(.., -inf): the tail tile keeps its bounds
    selects (exp of an out-of-bounds key is not 0 there). Fresh inputs, float64 reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern = af.compile(EX["attention"])
    body = _masked_loops(_kernel_src(kern.source, "attention_attn"))
    # (the first masked loop, never run without a mask, lies inside the keys: no tile mask)
    assert body and all("tl.where(tmask" in b for b in body if "tmask = " in b)
    assert any("tmask = " in b for b in body)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q = torch.randn(1, 2, 37, 16, generator=g)
    k, v = (torch.randn(1, 2, 77, 16, generator=g) for _ in range(2))
    o = kern(q=q, k=k, v=v)
    ref = _ref(q, k, v, EX["SCALE"], torch.ones(37, 77, dtype=torch.bool))
    assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("name", ["alibi", "sliding_window"])
def test_variant_masked_tile_selects_once(name):
    """A score that is no scaled dot (ALiBi's bias added) is selected once too: the exp2 reads the
    max's selected tile times log2(e), not a second select of the scaled sum. A conjunction of
    conditions (the window's j <= i and i - j < W) is one select per condition, each reading the
    one before (the tile mask, where there is one, the last): no tensor of booleans for the
    conjunction."""
    kern = _kernel_src(af.compile(EX[name]).source, f"{name}_attn")
    bodies = _masked_loops(kern)
    assert bodies
    conds = 2 if name == "sliding_window" else 1
    for body in bodies:
        sels = re.findall(r"(_t\d+) = tl\.where\((\w+), (\w+), float\('-inf'\)\)", body)
        tile = conds > 1 and "tmask = " in body
        assert len(sels) == body.count("tl.where(") == conds + tile, body
        for (prev, _, _), (_, _, arg) in zip(sels, sels[1:]):
            assert arg == prev, body
        assert (sels[-1][1] == "tmask") == tile, body
        assert " & " not in "".join(ln for ln in body.split("\n") if re.match(r"\s*_c\d+ = ", ln) and "tmask" not in ln)
        sel = sels[-1][0]
        assert re.search(rf"tl\.max\({sel}, axis=1\)", body)
        assert "tl.sum(tl.where(" not in body


@pytest.mark.parametrize("n", [77, 400])   # (400: rows past the window of 256, tiles cut by both conditions)
def test_conjunction_masked_tiles_float64(n, monkeypatch):
    """The window's selects one condition at a time, at sizes that are no multiple of a tile (the
    last key tile partly out of bounds, tiles cut by both conditions), against float64 on fresh
    inputs, both paths."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kern = af.compile(EX["sliding_window"])
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    q[..., n // 2, :] *= 30.0
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ref = _ref(q, k, v, EX["SCALE"], (j <= i) & (i - j < EX["WINDOW"]))
    for path in ("portable", "hopper"):
        o = kern(q=q, k=k, v=v, path=path)
        assert torch.isfinite(o).all()
        err = (o.double() - ref).abs().max().item()
        assert err <= 2e-5 * max(1.0, ref.abs().max().item()), (path, err)
