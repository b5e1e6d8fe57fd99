"""The row family's onepass schedule (codegen/row.py, kernel_onepass) as the timed launch may
now choose it for long rows: teams of NSPLIT programs, one chunk each, the partial states
folded in groups of FOLD_GROUP chunks (each group's workspace loads first, places past NSPLIT
masked and their merges discarded), one team per block of rows or persistent teams looping
over blocks (per_sm), EVEN (every chunk a full tile) unmasked. Triton's interpreter runs the
kernel in two phases (states and counts, then merge and outputs). Every output is checked
against float64 torch on fresh random inputs at odd sizes: an uneven last chunk, a last group
with places past NSPLIT, n_rows not a multiple of BLOCK_R, fully masked rows, -inf chunks,
large values; and the timed launch's candidates for long rows include the onepass schedule
and the persistent loop."""
import pytest
import torch

import acefuse as af


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _programs():
    x = af.tensor("x", "r j")
    w, b = af.tensor("w", "j"), af.tensor("b", "j")
    t = af.tensor("t", "r")
    m = af.max(x, "j")
    l = af.sum(af.exp(x - m), "j")
    mu = af.mean(x, "j")
    var = af.mean((x - mu) ** 2, "j")
    return {
        "softmax": (af.program("op_softmax", y=af.exp(x - m) / l),
                    lambda x: torch.softmax(x, -1)),
        "log_softmax": (af.program("op_log_softmax", y=x - m - af.log(l)),
                        lambda x: torch.log_softmax(x, -1)),
        "layernorm": (af.program("op_layernorm", y=(x - mu) * af.rsqrt(var + 1e-5) * w + b),
                      lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)),
        "rmsnorm": (af.program("op_rmsnorm", y=x * af.rsqrt(af.mean(x * x, "j") + 1e-6) * w),
                    lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w),
        "cross_entropy": (af.program("op_cross_entropy", loss=m + af.log(l) - af.take(x, t, "j")),
                          lambda x, t: torch.logsumexp(x, -1) - x.gather(-1, t[:, None])[:, 0]),
        # a per-row output (written by a team's first program) next to an elementwise one
        "stats": (af.program("op_stats", mu=mu, y=x - mu),
                  lambda x: {"mu": x.mean(-1), "y": x - x.mean(-1, keepdim=True)}),
    }


PROGRAMS = _programs()
_KERNELS = {}


def _module(name):
    if name not in _KERNELS:
        _KERNELS[name] = af.compile(PROGRAMS[name][0]).kernel.module
    return _KERNELS[name]


def _inputs(name, R, N, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, N, generator=g, dtype=torch.float64) * 4 + torch.randn(R, 1, generator=g,
                                                                              dtype=torch.float64) * 20
    ins = {"x": x.to(dtype)}
    if name in ("layernorm", "rmsnorm"):
        ins["w"] = (torch.rand(N, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    if name == "layernorm":
        ins["b"] = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    if name == "cross_entropy":
        ins["t"] = torch.randint(0, N, (R,), generator=g)
    return ins


def _reference(name, ins):
    return PROGRAMS[name][1](**{k: (v.double() if v.is_floating_point() else v) for k, v in ins.items()})


def _check(got, ref, rtol, stol):
    if isinstance(ref, dict):
        for k in ref:
            _check(got[k], ref[k], rtol, stol)
        return
    got = got.double()
    bound = rtol * ref.abs() + stol * ref.abs().max()
    bad = ~((got - ref).abs() <= bound)
    assert not bool(bad.any()), (int(bad.sum()), (got - ref).abs().max().item())


def _plan(mod, kw, shape):
    opts = ("onepass", kw.get("block_j"), kw.get("block_r"), kw.get("nsplit"))
    got = [p for k, p in mod._PLANS.items() if k[0][:4] == opts and k[0][-1] == kw.get("per_sm")
           and k[1][0] == shape]
    assert got, (kw, list(mod._PLANS))
    return got[-1]


# (R, N, launch options): 11 chunks (a second group with 5 places past NSPLIT), an uneven last
# chunk, 5 rows in blocks of 2; persistent teams (2 "SMs" here: per_sm=2 gives one team of 2
# programs over 5 blocks, per_sm=4 four teams, the first visiting blocks 0 and 4); EVEN (every chunk a full tile, rows a multiple
# of BLOCK_R)
CASES = [
    (5, 9001, dict(nsplit=11, block_r=2)),
    (5, 9001, dict(nsplit=2, block_r=1, per_sm=2)),
    (5, 9001, dict(nsplit=2, block_r=1, per_sm=4)),
    (4, 8192, dict(block_j=1024, block_r=2)),
]


def _rotated(cases, names, per):
    """pytest parameters (*case, name) of every case with every name: ``per(k)`` of the names run
    by default for case ``k``, a different window of them for each case, so that every name and
    every case runs; the rest are marked slow (session 21: the 2-core suite was over 15 minutes;
    ``pytest -m slow`` runs them all)."""
    return [pytest.param(*c, n, marks=() if (i - k * per(k)) % len(names) < per(k) else pytest.mark.slow)
            for k, c in enumerate(cases) for i, n in enumerate(names)]


@pytest.mark.parametrize("case,name", _rotated([(k,) for k in range(len(CASES))], list(PROGRAMS),
                                               lambda k: len(PROGRAMS) if CASES[k][0] * CASES[k][1] < 40000 else 2))
def test_onepass_matches_float64(name, case):
    R, N, kw = CASES[case]
    mod = _module(name)
    ins = _inputs(name, R, N, seed=R * 7919 + N + 31 * case + len(name))
    got = mod.run(**ins, schedule="onepass", **kw)
    _check(got, _reference(name, ins), rtol=2e-5, stol=2e-6)
    p = _plan(mod, kw, ins["x"].shape)
    br = p.kw["BLOCK_R"]
    blocks = -(-R // br)
    assert p.ns == kw.get("nsplit", -(-N // kw.get("block_j", 1 << 30)))
    assert bool(p.kw["PERSISTENT"]) == (p.teams < blocks) == ("per_sm" in kw)
    assert p.grid == (p.teams * p.ns,)
    assert p.kw["EVEN"] == (N % p.chunk == 0 and p.chunk == p.kw["BLOCK_J"] and R % br == 0)


@pytest.mark.parametrize("kw", [dict(nsplit=11, block_r=2),
                                pytest.param(dict(nsplit=3, block_r=1, per_sm=3), marks=pytest.mark.slow),
                                pytest.param(dict(block_j=2048, block_r=1), marks=pytest.mark.slow),
                                dict(nsplit=5, block_r=2, narrow=True)])
def test_onepass_bfloat16_masked_rows_and_large_values(kw):
    """bfloat16 softmax (also with the chunk held as loaded, narrow): a row -inf in its first
    chunks, a fully masked row (0, as the single-tile schedule gives), a row of values near
    bfloat16's largest, one -inf among finite values."""
    mod = _module("softmax")
    g = torch.Generator().manual_seed(29 + len(kw))
    x = torch.randn(7, 4099, generator=g, dtype=torch.float64) * 5   # (4099: session 21's suite time)
    x[1, :3000] = float("-inf")
    x[4] = float("-inf")
    x[5] = 3.0e38 - torch.rand(4099, generator=g, dtype=torch.float64) * 1e37
    x[6, 17] = float("-inf")
    xb = x.to(torch.bfloat16)
    got = mod.run(x=xb, schedule="onepass", **kw).double()
    ref = torch.softmax(xb.double(), -1)
    ref[4] = 0.0
    single = mod.run(x=xb, schedule="single").double()
    assert torch.equal(single[4], ref[4])
    _check(got, ref, rtol=8e-3, stol=1e-6)


def test_onepass_nan_row_stays_nan():
    mod = _module("log_softmax")
    x = torch.randn(3, 5000, dtype=torch.float64)
    x[1, 4321] = float("nan")
    got = mod.run(x=x.float(), schedule="onepass", nsplit=9, block_r=1).double()
    assert bool(torch.isnan(got[1]).all())
    _check(got[[0, 2]], torch.log_softmax(x[[0, 2]], -1), rtol=2e-5, stol=2e-6)


def test_timed_candidates_of_long_rows_include_onepass_and_the_persistent_loop():
    """For rows longer than 16384 (loop, split and single-tile regimes alike) the timed
    launch's candidates include the onepass schedule (one team per block and persistent
    teams) and the loop on a persistent grid; where the chunks would outnumber a quarter of the
    SMs (programs // 16), or for rows of 16384 or less: none."""
    mod = _module("softmax")
    programs = 132 * 4
    for R, N in ((4096, 65536), (256, 262144), (8192, 32768)):
        cands = mod._launch_cands(R, N, False, programs, narrow_ok=True)
        one = [c for c in cands if c.get("schedule") == "onepass" and "stages" not in c]
        assert [(c["block_j"], c["num_warps"], c["per_sm"]) for c in cands if c.get("schedule") == "onepass"
                and c.get("stages") == 2] == [(16384, 16, 1), (8192, 8, 2)]
        assert {(c["block_j"], c["num_warps"], c.get("per_sm"), c.get("maxnreg"), c.get("narrow")) for c in one} == {
            (16384, 16, None, None, None), (8192, 8, None, None, None), (16384, 16, None, 64, None),
            (16384, 16, None, None, True), (16384, 16, 1, None, None), (16384, 16, 2, 64, None),
            (8192, 8, 2, None, None)}, (R, N, cands)
        # float32 rows: no narrow candidate
        assert not [c for c in mod._launch_cands(R, N, False, programs) if c.get("narrow")]
        assert dict(schedule="loop", block_j=16384, num_warps=16, per_sm=1) in cands
        assert cands[0] == {}
    assert not [c for c in mod._launch_cands(64, 1 << 21, False, 8 * 4) if c.get("schedule") == "onepass"]
    # 2^20 elements: 64 chunks of 16384 > 132 / 4
    assert not [c for c in mod._launch_cands(64, 1 << 20, False, programs) if c.get("schedule") == "onepass"]
    assert not [c for c in mod._launch_cands(16384, 16384, False, programs) if c.get("schedule") == "onepass"]


def test_timed_launch_may_pick_onepass(monkeypatch):
    """With the timing allowed on the CPU and a _fastest that checks every candidate against
    the first and picks a onepass one, the launch runs the onepass schedule and the output
    matches float64 (rows of 20011: chunks of 16384, the last uneven)."""
    mod = _module("layernorm")
    monkeypatch.setattr(mod, "TIMED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mod, "TUNE_MIN", 1)
    monkeypatch.setattr(mod, "_CHOSEN", {})
    monkeypatch.setattr(mod, "_PLANS", {})
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    seen = []

    def fastest(cands, call, required=()):
        one = [c for c in cands if c.get("schedule") == "onepass"]
        assert one, cands
        first = call(cands[0])
        got = call(one[0])
        assert torch.allclose(first, got, rtol=1e-5, atol=1e-5)
        seen.append(one[0])
        return one[0]

    monkeypatch.setattr(mod, "_fastest", fastest)
    ins = _inputs("layernorm", 3, 20011, seed=77)
    got = mod.run(**ins)
    _check(got, _reference("layernorm", ins), rtol=2e-5, stol=2e-6)
    assert seen and list(mod._PLANS.values())[-1].schedule == "onepass"


TEAMS = [(5, 9001, 3, 2, 1), (7, 8192, 4, 4, 2), (5, 9001, 11, 1, 1)]


@pytest.mark.parametrize("R,N,ns,per,br,name", _rotated(TEAMS, ["softmax", "layernorm", "cross_entropy", "stats"],
                                                         lambda k: 2))
def test_persistent_teams_with_the_next_block_prefetched(name, R, N, ns, per, br):
    """stages=2 (as the timed launch passes it): persistent teams load their next block's
    chunk before they wait (PERSISTENT 2; the last block's prefetch masked past the rows)."""
    mod = _module(name)
    ins = _inputs(name, R, N, seed=R * 31 + N + ns + len(name))
    checked, sizes, ref_t, dev = mod._prepare((), dict(ins))
    p = mod._plan(checked, sizes, ref_t, dev, "onepass", None, br, ns, None, None, False, per, 2)
    assert p.kw["PERSISTENT"] == 2 and p.teams < -(-R // br)
    _check(mod._launch(p, checked), _reference(name, ins), rtol=2e-5, stol=2e-6)
