"""The basis of a one-launch-per-step context-parallel ring (issue 16, not used by the ring yet):
global positions given as lookups (``pos_i.at(n=index(i))``, ``pos_j.at(m=index(j))``) let one
kernel of the contraction family serve a rank's whole zig-zag shard (two query chunks) against a
visiting shard (two key chunks), where the ring now launches one kernel per (query chunk, key
chunk) pair with a 0-d offset each. Checked here: the result against float64 on zig-zag shard
pairs with fresh random inputs, and the mask analysis' tile classes (codegen/masks.py
tile_stats) for the 8192 x 8192 blocks of a 32K sequence on 4 ranks: exactly the tiles the
causal mask excludes are skipped, and only diagonal tiles are masked."""
from __future__ import annotations

import math

import pytest
import torch

import acefuse as af

W = 4
D = 16


def _zz(rank, c):
    return torch.cat([torch.arange(rank * c, rank * c + c), torch.arange((2 * W - 1 - rank) * c, (2 * W - rank) * c)])


@pytest.fixture(scope="module")
def kern():
    pi, pj = af.tensor("pi", "n"), af.tensor("pj", "m")
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    s = af.where(pj.at(m=af.index("j")) <= pi.at(n=af.index("i")), af.sum(q * k, "d") * (1 / math.sqrt(D)),
                 af.NEG_INF)
    mx = af.max(s, "j")
    p = af.exp(s - mx)
    return af.compile(af.program("cp_lookup_positions", o=af.sum(p * v, "j") / af.sum(p, "j")))


@pytest.mark.parametrize("rq,rk", [(1, 1), (1, 2), (2, 0), (3, 3)])
def test_one_kernel_per_zigzag_shard_pair_matches_float64(kern, rq, rk):
    c = 24
    N = 2 * W * c
    g = torch.Generator().manual_seed(1000 + 10 * rq + rk)
    Q, K, V = (torch.randn(1, 2, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    qi, kj = _zz(rq, c), _zz(rk, c)
    got = kern(q=Q[:, :, qi].float(), k=K[:, :, kj].float(), v=V[:, :, kj].float(), pi=qi.float(), pj=kj.float())
    sc = (Q[:, :, qi] @ K[:, :, kj].transpose(-1, -2)) / math.sqrt(D)
    seen = kj[None, :] <= qi[:, None]
    sc = sc.masked_fill(~seen, float("-inf"))
    rows = seen.any(1)
    want = torch.softmax(sc[:, :, rows], -1) @ V[:, :, kj]
    assert rows.any()
    torch.testing.assert_close(got.double()[:, :, rows], want, rtol=2e-5, atol=2e-5)
    assert torch.all(got[:, :, ~rows] == 0)   # a row that sees no key of the block: empty states (0/0 -> 0)


@pytest.mark.parametrize("rq,rk,skipped,masked", [(1, 1, 0.4922, 0.0156), (1, 2, 0.5, 0.0), (1, 0, 0.5, 0.0),
                                                  (0, 3, 0.5, 0.0)])
def test_tile_classes_of_a_32k_zigzag_step(kern, rq, rk, skipped, masked):
    import numpy as np
    from acefuse.codegen.masks import tile_stats
    C = 4096
    st = tile_stats(kern.kernel.fusion, {"b": 1, "h": 1, "i": 2 * C, "j": 2 * C, "d": 128, "e": 128, "n": 2 * C,
                                         "m": 2 * C}, 128, 128,
                    data={"pi": _zz(rq, C).float().numpy(), "pj": _zz(rk, C).float().numpy()})
    # the exact count of 128 x 128 tiles the causal mask excludes / cuts, from the positions
    pi, pj = _zz(rq, C).view(-1, 128), _zz(rk, C).view(-1, 128)
    lo_i, hi_i, lo_j, hi_j = pi.min(1).values, pi.max(1).values, pj.min(1).values, pj.max(1).values
    excl = (lo_j[None, :] > hi_i[:, None]).float().mean().item()
    cut = ((hi_j[None, :] > lo_i[:, None]) & (lo_j[None, :] <= hi_i[:, None])).float().mean().item()
    assert st["skipped"] == pytest.approx(excl, abs=1e-9) and excl == pytest.approx(skipped, abs=1e-4)
    assert 1 - st["skipped"] - st["full"] == pytest.approx(cut, abs=1e-9) and cut == pytest.approx(masked, abs=1e-4)
    assert np.isfinite(st["tiles"])
