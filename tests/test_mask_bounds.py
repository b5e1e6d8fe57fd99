"""The mask analysis' interval bounds are exact on every device (codegen/masks.py).

``//`` and ``%`` bounds used to divide with Triton's float ``/``: exact in the interpreter,
up to 2 ulp off on a GPU, so at an exact multiple (``j = k * c``) the bound's floor could be
``k - 1``: a tile with visible elements skipped, a silent wrong result on the GPU only. Here
the interpreter's division is made adversarial (every ``/`` the bound code performs comes out
two float32 ulps low, or high) and each verdict (always true / always false over a tile box)
is checked against a brute-force evaluation of the condition over the box, with Python's
integer semantics, on fresh random sizes, divisors, offsets and tilings that put tile edges
on exact multiples. The bounds now never divide in floating point at all."""
import math
import random

import numpy as np
import pytest

import acefuse as af
from tests.programs import index_op
from acefuse.codegen import masks
from acefuse.codegen.masks import MaskAnalysis, tile_truth
from acefuse.rewrite.terms import Term


class _Gen(MaskAnalysis):
    """What the analysis needs of a kernel generator: the key axis j, the row axis i."""
    axis, R, G, E, C, L = "j", ["i"], [], [], [], []
    tensors: dict = {}


def _ev(t: Term, I, J):
    """The condition on integer grids, exactly (Python/numpy int64: // and % round toward -inf)."""
    op, a = t.op, t.args
    if op == "Num":
        return np.int64(a[0]) if float(a[0]).is_integer() else float(a[0])
    if op == "Idx":
        return I if a[0] == "i" else J
    x = [_ev(c, I, J) for c in t.children]
    return index_op(op, x)


def _adversarial(direction):
    """``a / b`` as a GPU's approximate division may give it: float32, then two ulps off."""
    def div(self, other):
        r = np.asarray(np.asarray(self, dtype=np.float32) / np.float32(other))
        for _ in range(2):
            r = np.nextafter(r, np.float32(direction * np.inf))
        return np.asarray(r, dtype=np.float64).view(masks._Arr)
    return div


def _check(cond: Term, n_i, n_j, bi, bj):
    """Every (row tile, key tile) box: an always-false box holds no true element, an
    always-true box no false one. Returns the boxes decided."""
    I, J = np.arange(n_i, dtype=np.int64)[:, None], np.arange(n_j, dtype=np.int64)[None, :]
    truth = np.broadcast_to(_ev(cond, I, J), (n_i, n_j))
    starts = np.arange(0, n_j, bj)
    decided = 0
    for i0 in range(0, n_i, bi):
        i1 = min(i0 + bi, n_i)
        rows = np.arange(i0, i0 + bi)
        env = {"i_lo": np.array(float(i0)), "i_hi": np.array(float(i1 - 1)), "len_i": n_i, "idx_i": rows,
               "rmask": rows < n_i}
        with np.errstate(invalid="ignore"):
            t_, f_ = tile_truth(_Gen(), cond, env, starts, bj, n_j)
        for s, at, af_ in zip(starts, t_, f_):
            box = truth[i0:i1, s:min(s + bj, n_j)]
            assert not (af_ and box.any()), f"skipped a visible element: {cond}, box i {i0}..{i1 - 1} j {s}.."
            assert not (at and not box.all()), f"called a masked element visible: {cond}, box i {i0}.. j {s}.."
            decided += bool(at) + bool(af_)
    return decided


def _conditions(rng):
    """Block-diagonal, block-causal, dilated and strided conditions with a random divisor c
    (a power of two or not), offsets and residues."""
    i, j = af.index("i"), af.index("j")
    c = rng.choice([rng.randint(2, 13), rng.randint(14, 40), 2 ** rng.randint(1, 5)])
    o, o2, r = rng.randint(-50, 50), rng.randint(-50, 50), rng.randint(0, c - 1)
    k = rng.randint(-3, 6)
    conds = [(j + o) // c >= k, (j + o) // c < k, ((j + o) // c).eq(k), ((j + o) % c).eq(r), ((j + o) % c) <= r,
             ((j + o) % c) > r, (i // c).eq(j // c), (j // c) <= (i // c), ((i - j + o) % c).eq(0),
             ((i - j) // c + o2) < k, (af.abs(i - j) // c) <= k, (af.maximum(i, j + o) % c).ne(r),
             ((j * 3 + o) // c) > ((i + o2) // c), ((j + o) % c + (i // c)) >= r, -((j + o) // c) <= -k]
    return [x.term for x in conds]


@pytest.mark.parametrize("direction", [-1, 1])
def test_floor_div_and_mod_bounds_at_exact_multiples(monkeypatch, direction):
    monkeypatch.setattr(masks._Arr, "__truediv__", _adversarial(direction), raising=False)
    rng = random.Random()
    decided = 0
    for trial in range(6):
        n_i, n_j = rng.randint(5, 40), rng.randint(5, 70)
        for cond in _conditions(rng):
            # one-element tiles put a tile on every exact multiple; wider ones end on them
            for bi, bj in ((1, 1), (rng.randint(1, 8), rng.randint(1, 8)), (rng.randint(2, 16), rng.randint(2, 24))):
                decided += _check(cond, n_i, n_j, bi, bj)
    assert decided > 500   # the analysis decides many boxes: the check is not vacuous


def test_bound_code_never_divides_in_floating_point():
    """No ``/`` in the bound code of // and % (a GPU's float division is approximate)."""
    rng = random.Random()
    for _ in range(20):
        for cond in _conditions(rng):
            L: list = []
            t_, f_ = _Gen().truth(cond, L)
            code = "\n".join(L + [t_, f_])
            assert " / " not in code and "//" in code or "%" not in repr(cond), code


def test_rounded_bounds_are_widened_not_trusted():
    """Bounds that float32 cannot hold exactly (past 2**24, a non-integer factor) are widened
    to (-inf, inf): no verdict rests on a rounded bound."""
    i, j = af.index("i"), af.index("j")
    big = 2 ** 24 - 40
    # j + big crosses 2**24 inside the range: float32 rounds there, and those tiles get no verdict
    for cond, n in (((j + big) // 3 >= (big + 30) // 3, 90), (((j + big) % 7).eq(3), 90),
                    ((j * 0.1 + i) > 3, 60), ((j * 3 + i * 5 + 16777000) // 5 > 3355420, 60)):
        for bj in (1, 3, 8):
            _check(cond.term, 5, n, 1, bj)
    L: list = []
    t_, f_ = _Gen().truth(((j + big) // 3 >= 0).term, L)
    starts = np.arange(0, 96, 8)
    env = {"i_lo": np.array(0.0), "i_hi": np.array(0.0), "len_i": 1, "idx_i": np.arange(1), "rmask": np.ones(1, bool)}
    at, _ = tile_truth(_Gen(), ((j + big) // 3 >= 0).term, env, starts, 8, 96)
    hi = starts + 7 + big
    assert list(at) == list(hi < 2 ** 24)   # decided exactly where every bound is below 2**24


@pytest.mark.parametrize("name", ["block_diagonal", "block_causal", "dilated_sliding_window", "natten_2d"])
def test_gallery_masks_with_div_and_mod_adversarial_division(monkeypatch, name):
    from examples.masks import GALLERY
    monkeypatch.setattr(masks._Arr, "__truediv__", _adversarial(-1), raising=False)
    prog = GALLERY[name].program
    conds = {t.args[0] for e in prog.outputs.values() for t in e.term.walk()
             if t.op == "Where" and t.args[2].op == "Num" and t.args[2].args[0] == -math.inf}
    assert conds
    for cond in conds:
        for n, bi, bj in ((48, 1, 1), (64, 16, 16), (61, 7, 5), (96, 32, 16)):
            _check(cond, n, n, bi, bj)
