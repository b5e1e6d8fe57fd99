"""The contraction template's loop structure (issue 15): the key loop starts from the states
of an empty block instead of a peeled first tile (on sm_90 a peeled tile's key and value
copies kept 64 KB of shared memory of their own, leaving no room for a third pipeline stage
at 128 x 128 tiles), and the Hopper kernel's fully visible loop reads like the tutorial's:
no mask, one multiply of the score tile, one exp2 of it. Snapshots of the generated source,
then the kernels against float64 on fresh random inputs where rows start fully masked."""
import math
import re
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af
from acefuse.codegen.contraction import _fold_empty, _ab_to_b, AB
from acefuse.rewrite.terms import Term, A, B

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))
MASKS = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "masks.py"))


def _kernel_src(src, name):
    start = src.index(f"def {name}(")
    end = src.find("@triton.jit", start)
    return src[start:end if end > 0 else len(src)]


def _loops(kern):
    """{header line: body lines} of the kernel's top-level key loops."""
    out, cur = {}, None
    for ln in kern.split("\n"):
        if ln.startswith("    for start in "):
            cur = ln.strip()
            out[cur] = []
        elif cur is not None:
            if ln.startswith("        ") or not ln.strip():
                out[cur].append(ln)
            else:
                cur = None
    return out


@pytest.fixture(scope="module")
def sources():
    return {n: af.compile(EX[n]).source for n in ("attention", "causal")}


@pytest.mark.parametrize("name", ["attention", "causal"])
@pytest.mark.parametrize("hopper", [False, True])
def test_no_peeled_tile(sources, name, hopper):
    kern = _kernel_src(sources[name], f"{name}_attn_hopper" if hopper else f"{name}_attn")
    # the states start as an empty block's (max -inf, sums 0), every tile is in a loop
    assert "m = tl.full([BLOCK_I], float('-inf'), tl.float32)" in kern
    assert "s = tl.full([BLOCK_I, BLOCK_E], 0.0, tl.float32)" in kern
    assert "its definition on the first tile" not in kern
    assert "range(first, a, BLOCK_J)" in kern
    # one copy of the score dot per loop (the peel added a fourth)
    assert kern.count("tl.dot(h1") == 3 if hopper else kern.count("tl.trans(") == 3


@pytest.mark.parametrize("name", ["attention", "causal"])
def test_hopper_fully_visible_loop_reads_like_the_tutorial(sources, name):
    kern = _kernel_src(sources[name], f"{name}_attn_hopper")
    loops = _loops(kern)
    full = [b for h, b in loops.items() if "tl.range(a, b, BLOCK_J" in h]
    assert len(full) == 1, list(loops)
    body = "\n".join(ln for ln in full[0] if not ln.strip().startswith("#"))
    assert "tl.where" not in body and "mask" not in body and "cols" not in body
    assert "desc_k.load([start, 0])" in body and "desc_v.load([start, 0])" in body
    dot = re.search(r"(_dot_\d+) = tl\.dot\(", body).group(1)
    # the score tile is multiplied once (scale * log2(e), folded), its max once per row
    assert len(re.findall(rf"{dot} \* ", body)) == 1
    assert len(re.findall(rf"tl\.max\({dot}, axis=1\)", body)) == 1
    assert body.count("tl.exp2(") == 2          # p (a tile) and the correction (a row)
    assert body.count("tl.dot(") == 2           # q k^T, then p v accumulated in place
    assert re.search(r"tl\.dot\(_t\d+\.to\(DOT_T\), _kt_\d+\.to\(DOT_T\), acc=", body)


def test_fold_keeps_the_peel_where_the_rolling_form_is_not_the_definition():
    m_A, m_AB, s_A = Term("St", ("m", A)), Term("St", ("m", AB)), Term("St", ("s", A))
    body = Term("Exp", (Term("Sub", (Term("Elm", ("e1",)), m_AB)),))
    init = Term("Sum", (B, Term("Exp", (Term("Sub", (Term("Elm", ("e1",)), Term("St", ("m", B)))),))))
    empty = {"m": -math.inf, "s": 0.0}
    good = Term("Add", (Term("Mul", (s_A, Term("Exp", (Term("Sub", (m_A, m_AB)),)))), Term("Sum", (B, body))))
    assert _ab_to_b(_fold_empty(good, empty, {"m"}, set())) == init
    # exp(m_AB - m_A) is +inf with m_A empty: 0 * inf is not 0, the form does not fold to the definition
    bad = Term("Add", (Term("Mul", (s_A, Term("Exp", (Term("Sub", (m_AB, m_A)),)))), Term("Sum", (B, body))))
    assert _ab_to_b(_fold_empty(bad, empty, {"m"}, set())) != init
    # a state of A that the fold cannot remove: no empty start
    left = Term("Add", (Term("Mul", (s_A, m_AB)), Term("Sum", (B, body))))
    assert _fold_empty(left, empty, {"m"}, set()) is None or _ab_to_b(_fold_empty(left, empty, {"m"}, set())) != init


def _ref(q, k, v, scale, mask):
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scale
    return MASKS["softmax_reference"](s, v.double(), mask)


@pytest.mark.parametrize("path", ["portable", "hopper"])
def test_rows_whose_first_tiles_are_masked(path, monkeypatch):
    """Sliding window over more keys than queries, shifted: early key tiles are fully masked for
    some rows and the first visible one partly; rows that see no key give 0. Fresh inputs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q_, k_, v_ = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    i, j = af.index("i"), af.index("j")
    s = af.sum(q_ * k_, "d") * 0.25
    lo, w = 9, 7
    cond = (j >= i + lo) & (j < i + lo + w)
    sm = af.where(cond, s, af.NEG_INF)
    m = af.max(sm, "j")
    p = af.exp(sm - m)
    prog = af.program("shifted_window", o=af.sum(p * v_, "j") / af.sum(p, "j"))
    kern = af.compile(prog)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    B_, H, NI, NJ, D = 1, 2, 23, 30, 16
    q, k, v = (torch.randn(B_, H, n, D, generator=g) for n in (NI, NJ, NJ))
    ii, jj = torch.arange(NI)[:, None], torch.arange(NJ)[None, :]
    mask = (jj >= ii + lo) & (jj < ii + lo + w)
    assert (~mask).all(-1).any()          # some rows see no key
    o = kern(q=q, k=k, v=v, path=path)
    ref = _ref(q, k, v, 0.25, mask)
    assert not torch.isnan(o).any()
    assert (o.double() - ref).abs().max().item() <= 2e-5 * max(1.0, ref.abs().max().item())
