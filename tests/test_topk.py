"""af.topk and MoE routing (issue 14): the merge of two k-candidate states proved and wrong
merges refused; top-k against torch (values exactly, indices where values are distinct, the
tie convention against torch.sort(stable=True) separately) on every schedule the fusion
has; softmax and DeepSeek-V3 routing against float64 torch references."""
import inspect
import math
import random
import runpy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.lang import LanguageError
from acefuse.proofs import topk as ptk
from acefuse.reference import evaluate
from acefuse.topk import stack_outputs

MOE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "moe.py"))
SCHEDULES = [("single", {}), ("loop", {"block_j": 8}), ("loop", {"block_j": 16})]


# ---- the k-candidate merge -----------------------------------------------------------------------
@pytest.mark.parametrize("k", range(1, 9))
def test_k_candidate_merge_is_proved_for_every_block_size(k):
    res = ptk.prove_merge(ptk.merge_network(k))
    assert res.ok and res.scope == "for all block sizes", res.detail


def _eval(t, env, memo=None):
    """The value of a merge term (a DAG: each compare-exchange reads the previous slots twice,
    so it is evaluated once per node, by identity)."""
    memo = {} if memo is None else memo
    if id(t) in memo:
        return memo[id(t)][1]
    op = t.op
    if op == "St":
        return env[(t.args[0], t.args[1].op)]
    if op == "Num":
        return t.args[0]
    a = [_eval(x, env, memo) for x in t.args]
    memo[id(t)] = (t, _apply(op, a))
    return memo[id(t)][1]


def _apply(op, a):
    if op == "Where":
        return a[1] if a[0] else a[2]
    return {"CmpGt": lambda: a[0] > a[1], "CmpLt": lambda: a[0] < a[1], "CmpEq": lambda: a[0] == a[1],
            "LAnd": lambda: a[0] and a[1], "LOr": lambda: a[0] or a[1]}[op]()


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_merge_terms_give_the_state_of_the_union(k):
    """The network as acefuse terms over St(v_r, A), St(i_r, B), ... (what a merge hook would
    evaluate) on random disjoint blocks with many equal values, against the first k of A u B."""
    net = ptk.merge_network(k)
    terms = ptk.network_terms(net)
    rng = random.Random(k)
    for _ in range(150):
        n, m = rng.randint(1, 2 * k + 2), rng.randint(1, 2 * k + 2)
        pos = rng.sample(range(-5, 60), n + m)
        blk_a = [(float(rng.randint(0, 3)), p) for p in pos[:n]]
        blk_b = [(float(rng.choice([0, 1, 2, 3, math.inf])), p) for p in pos[n:]]
        env = {}
        for blk, st in (("BA", ptk.top_k_state(blk_a, k)), ("BB", ptk.top_k_state(blk_b, k))):
            for r, (v, i) in enumerate(st):
                env[(f"v{r}", blk)], env[(f"i{r}", blk)] = v, i
        memo = {}
        got = [(_eval(v, env, memo), _eval(i, env, memo)) for v, i in terms]
        assert got == ptk.top_k_state(blk_a + blk_b, k), (blk_a, blk_b)


def test_wrong_merges_are_refused():
    for k in (2, 3, 8):
        net = ptk.merge_network(k)
        keeps_fewer = ptk.Network(k, net.comparators, keep=k - 1)           # drops the k-th candidate
        res = ptk.prove_merge(keeps_fewer)
        assert res.status == "refuted" and res.counterexample, res
        a, b = res.counterexample   # a real counterexample: the merge differs from the union's first k
        assert ptk.run_network(keeps_fewer, a + b) != ptk.top_k_state(a + b, k)
        wrong_ties = ptk.Network(k, net.comparators, ties="highest")         # equal values: higher index first
        res = ptk.prove_merge(wrong_ties)
        assert res.status == "refuted" and "comparator" in res.detail, res
        (yp, gp), (yq, gq) = res.counterexample
        assert yp == yq and gp != gq
        wrong_pairs = ptk.Network(k, [(r, k + r) for r in range(k)] + net.comparators[k:])   # A_r with B_r
        assert ptk.prove_merge(wrong_pairs).status == "refuted"
        no_sort = ptk.Network(k, net.comparators[:k])                        # the top k, unsorted
        assert ptk.prove_merge(no_sort).status == "refuted"


# ---- top-k kernels -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def top2():
    x = af.tensor("x", "t e")
    vals, idx = af.topk(x, 2, "e")
    prog = af.program("topk2", values=vals, indices=idx)
    k = af.compile(prog)
    assert k.fusion.certificate.ok
    return prog, k


def _check_topk(prog, kern, X, k, schedules=SCHEDULES):
    sv, si = torch.sort(X, dim=1, descending=True, stable=True)   # the documented tie convention
    tv, ti = torch.topk(X, k, dim=1)
    for sched, kw in schedules:
        out = kern(x=X, schedule=sched, **kw)
        v, i = out["values"], out["indices"]
        assert v.shape == (X.shape[0], k) and i.dtype == torch.int64
        # values exactly as torch.topk's (NaN where torch has NaN)
        assert torch.equal(v.nan_to_num(0.5, 7.0, -7.0), tv.nan_to_num(0.5, 7.0, -7.0)), (sched, v, tv)
        # indices: torch.topk's where the k values and the next one are distinct ...
        distinct = torch.tensor([len(set(r.tolist())) == len(r) for r in sv[:, :k + 1].nan_to_num(9.0)])
        assert torch.equal(i[distinct], ti[distinct]), sched
        # ... and the convention (stable sort, NaN largest) everywhere
        assert torch.equal(i, si[:, :k]), (sched, i, si[:, :k])


@pytest.mark.parametrize("seed", range(3))
def test_topk_matches_torch_on_random_rows(top2, seed):
    prog, kern = top2
    g = torch.Generator().manual_seed(100 + seed)
    X = torch.randn(5, 37 + 11 * seed, generator=g) * 10
    _check_topk(prog, kern, X, 2)
    ref = stack_outputs(prog, evaluate(prog, {"x": X.double()}))   # the float64 reference evaluator
    assert np.array_equal(ref["indices"], torch.topk(X.double(), 2, 1)[1].numpy())


def test_topk_tie_convention_nan_and_infinities(top2):
    prog, kern = top2
    g = torch.Generator().manual_seed(7)
    X = torch.randint(0, 3, (6, 29), generator=g).float()
    X[1, 4] = X[1, 20] = math.nan          # NaN largest: the first two NaNs, lowest index first
    X[2, 3] = math.inf                     # +inf after NaN
    X[2, 8] = math.nan
    X[3] = -math.inf                       # a row of -inf: indices 0, 1
    X[4, :] = 1.0                          # all equal: 0, 1
    _check_topk(prog, kern, X, 2)
    out = kern(x=X)
    assert out["indices"][1].tolist() == [4, 20] and out["indices"][2].tolist() == [8, 3]
    assert out["indices"][3].tolist() == [0, 1] and out["indices"][4].tolist() == [0, 1]
    assert math.isnan(out["values"][2, 0]) and out["values"][2, 1] == math.inf


def test_topk_is_one_pass_with_a_split_schedule(top2):
    """af.topk is one k-candidate state (acefuse/topk_fuse.py): one pass, the proved merge in
    the rolling update and in the split schedule; explain() says so."""
    prog, kern = top2
    assert len(kern.fusion.passes) == 1 and kern.fusion.passes[0].split_ok
    text = kern.fusion.explain()
    assert "fusible, one pass" in text and "topk-merge" in text and "k-candidate state" in text
    X = torch.randn(3, 40)
    _check_topk(prog, kern, X, 2, [("split", {"block_j": 8, "nsplit": 2}), ("split", {"block_j": 4, "nsplit": 5})])


SCHED_ALL = SCHEDULES + [("split", {"block_j": 8, "nsplit": 3}), ("split", {"block_j": 16, "nsplit": 2})]


def _adversarial(t, e, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(t, e, generator=g) * 10
    X[0] = torch.randint(0, 3, (e,), generator=g).float()          # many ties
    X[1, ::5] = math.nan                                             # NaNs, largest, lowest index first
    X[2, ::3] = math.inf
    X[2, 1] = math.nan
    X[3] = -math.inf                                                 # a row of -inf
    X[4, :] = 1.0
    X[5, e // 2:] = -math.inf
    return X


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_topk_every_schedule_every_k_against_torch(k):
    """k = 1, 2, 4, 8 over 8 to 256 experts, single / loop / split with small tiles, ties,
    NaN and infinities; deriving is fast (seconds for k = 8, no e-graph)."""
    x = af.tensor("x", "t e")
    vals, idx = af.topk(x, k, "e")
    prog = af.program(f"topk_{k}", values=vals, indices=idx)
    kern = af.compile(prog)
    assert kern.fusion.certificate.ok and len(kern.fusion.passes) == 1
    for e in ((8, 29, 256) if k <= 2 else (8, 256)):
        if e >= k:
            _check_topk(prog, kern, _adversarial(6, e, k * 1000 + e), k, SCHED_ALL[:2] + SCHED_ALL[3:4])


def test_wrong_merge_in_a_fusion_is_refused_and_does_not_run():
    """A fusion built with a wrong merge network (keeps k - 1 candidates; equal values by the
    higher index) fails its certificate, so af.compile runs the unfused kernel instead."""
    from acefuse.fuse import certified_or_unfused
    from acefuse.topk_fuse import fuse_topk
    x = af.tensor("x", "t e")
    vals, idx = af.topk(x, 2, "e")
    prog = af.program("topk2_wrong", values=vals, indices=idx)
    good = ptk.merge_network(2)
    for bad in (ptk.Network(2, good.comparators, keep=1), ptk.Network(2, good.comparators, ties="highest")):
        f = fuse_topk(prog, "e", network={2: bad})
        cert = f.certificate
        assert not cert.ok and any(c.step in ("rolling", "merge") for c in cert.failures)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            used = certified_or_unfused(f)
        assert used is not f and not getattr(used, "topk_groups", None)
        from acefuse.codegen.compile import compile_program
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kern = compile_program(prog, fusion=f)
        assert kern.fusion is not f
        X = torch.randint(0, 2, (4, 12)).float()
        out = stack_outputs(prog, kern(x=X, schedule="loop", block_j=4))
        assert torch.equal(out["indices"], torch.sort(X, dim=1, descending=True, stable=True)[1][:, :2])


def test_topk_language_errors(top2):
    x = af.tensor("x", "t e")
    with pytest.raises(LanguageError, match="'f' is not an axis"):
        af.topk(x, 2, "f")
    with pytest.raises(LanguageError, match="k must be an integer"):
        af.topk(x, 0, "e")
    with pytest.raises(LanguageError, match="must not be an axis"):
        af.topk(x, 2, "e", kaxis="t")
    prog, kern = top2
    with pytest.raises(ValueError, match="top-2 over axis 'e'.*only 1 elements"):
        kern(x=torch.randn(3, 1))
    with pytest.raises(ValueError, match="top-2 over axis 'e'.*only 1 elements"):
        kern(torch.randn(3, 1))        # by position too


# ---- routing ---------------------------------------------------------------------------------------
def _softmax_ref(X, k):
    p = torch.softmax(X.double(), -1)
    w, i = torch.topk(p, k, -1)
    return w / w.sum(-1, keepdim=True), i


def _deepseek_ref(X, B, k, scale):
    s = torch.sigmoid(X.double())
    _, i = torch.topk(s + B.double(), k, -1)
    w = s.gather(-1, i)
    return w / w.sum(-1, keepdim=True) * scale, i


def _grouped_ref(X, B, k, G, TG, scale):
    s = torch.sigmoid(X.double())
    c = s + B.double()
    T, E = X.shape
    gsc = c.view(T, G, -1).topk(2, -1)[0].sum(-1)
    gi = gsc.topk(TG, -1)[1]
    mask = torch.zeros(T, G, dtype=torch.bool).scatter_(1, gi, True).repeat_interleave(E // G, 1)
    _, i = torch.topk(c.masked_fill(~mask, -math.inf), k, -1)
    w = s.gather(-1, i)
    return w / w.sum(-1, keepdim=True) * scale, i


def _logits(t, e, seed):
    """Router logits whose top k + 1 are separated (float32 softmax/sigmoid keep their order)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randperm(e, generator=g).float() * 0.05
    return (base[None, :] + torch.rand(t, e, generator=g) * 0.01)[:, torch.randperm(e, generator=g)] * 4


@pytest.mark.parametrize("select", ["probs", "logits"])
def test_softmax_top2_routing_matches_torch(select):
    kern = af.compile(MOE["softmax_topk"](2, select=select))
    assert kern.fusion.certificate.ok
    for seed, (t, e) in enumerate([(7, 24), (5, 61)]):
        X = _logits(t, e, seed)
        w_ref, i_ref = _softmax_ref(X, 2)
        for sched, kw in SCHEDULES[:2]:
            out = kern(x=X, schedule=sched, **kw)
            assert torch.equal(out["experts"], i_ref), sched
            np.testing.assert_allclose(out["weights"].double().numpy(), w_ref.numpy(), rtol=2e-6, atol=1e-7)


def test_deepseek_top2_and_grouped_routing_match_torch():
    kern = af.compile(MOE["deepseek_top2"])
    assert kern.fusion.certificate.ok
    assert len(kern.fusion.passes) == 1   # the gathered scores ride with the candidates
    X = _logits(6, 32, 3)
    B = torch.randn(32, generator=torch.Generator().manual_seed(4)) * 0.05
    w_ref, i_ref = _deepseek_ref(X, B, 2, 2.5)
    for sched, kw in SCHED_ALL:
        out = kern(x=X, bias=B, schedule=sched, **kw)
        assert torch.equal(out["experts"], i_ref), sched
        np.testing.assert_allclose(out["weights"].double().numpy(), w_ref.numpy(), rtol=2e-6, atol=1e-7)
    route = MOE["deepseek_grouped"](2, groups=4, topk_group=2, n_experts=32, scale=1.5)
    assert all(k.fusion.certificate.ok for k in route.kernels)
    w_ref, i_ref = _grouped_ref(X, B, 2, 4, 2, 1.5)
    for sched, kw in [("single", {}), ("loop", {"block_j": 4})]:
        w, i = route(X, B, schedule=sched, **kw)
        assert torch.equal(i, i_ref), sched
        np.testing.assert_allclose(w.double().numpy(), w_ref.numpy(), rtol=2e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("k", [4, 8])
def test_topk_k_up_to_8_matches_torch(k):
    """Integer-valued rows (many ties) on every schedule."""
    x = af.tensor("x", "t e")
    vals, idx = af.topk(x, k, "e")
    prog = af.program(f"topk{k}", values=vals, indices=idx)
    kern = af.compile(prog)
    assert kern.fusion.certificate.ok
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        X = torch.randint(0, 5, (6, 40), generator=g).float() if seed else torch.randn(6, 40, generator=g)
        X[1, 3] = math.nan
        X[2, 5] = math.inf
        _check_topk(prog, kern, X, k)


def test_softmax_top8_matches_torch():
    """Top-8 chosen on the logits: one pass (max and the 8-candidate state)."""
    X = _logits(5, 64, 11)
    kern = af.compile(MOE["softmax_topk"](8, select="logits"))   # on the probabilities: > 24 GB to derive
    assert kern.fusion.certificate.ok
    w_ref, i_ref = _softmax_ref(X, 8)
    for sched, kw in SCHED_ALL:
        out = kern(x=X, schedule=sched, **kw)
        assert torch.equal(out["experts"], i_ref)
        np.testing.assert_allclose(out["weights"].double().numpy(), w_ref.numpy(), rtol=2e-6, atol=1e-7)


def test_deepseek_grouped_top4_of_8_groups_matches_torch():
    """DeepSeek-V3's grouping (8 groups, 4 kept) with k = 4 (k = 8 grouped: tests/test_moe_errors.py)."""
    X = _logits(5, 64, 11)
    B = torch.randn(64, generator=torch.Generator().manual_seed(12)) * 0.05
    route = MOE["deepseek_grouped"](4, groups=8, topk_group=4, n_experts=64, scale=2.5)
    w_ref, i_ref = _grouped_ref(X, B, 4, 8, 4, 2.5)
    w, i = route(X, B)
    assert torch.equal(i, i_ref)
    np.testing.assert_allclose(w.double().numpy(), w_ref.numpy(), rtol=2e-6, atol=1e-7)


# ---- the routing's outputs written stacked by the kernel (issue 14: the host path) ---------------
ROUTE_SCHEDULES = [("single", {}), ("loop", {"block_j": 8}), ("split", {"block_j": 8, "nsplit": 3})]


def _route_rows(t, e, seed, dtype=torch.float32):
    """Fresh random logits, and one row of exact ties (equal logits: the lowest index first)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(t, e, generator=g) * 3
    X[1] = torch.randint(0, 3, (e,), generator=g).float()
    return X.to(dtype)


def _check_route(X, k, out, rtol=2e-6, atol=1e-7):
    """out's weights and experts against a float64 reference: softmax, the k largest in the
    documented order (exact value, then the lowest index: a stable sort), renormalised; and
    torch.topk itself on the rows whose k + 1 largest probabilities are distinct."""
    p = torch.softmax(X.double(), -1)
    sp, si = torch.sort(p, dim=1, descending=True, stable=True)
    i_ref = si[:, :k]
    w_ref = sp[:, :k] / sp[:, :k].sum(1, keepdim=True)
    w, i = out["weights"], out["experts"]
    assert w.shape == (X.shape[0], k) and i.shape == (X.shape[0], k), (w.shape, i.shape)
    assert w.dtype == X.dtype and i.dtype == torch.int64
    assert torch.equal(i, i_ref), (i, i_ref)
    distinct = (sp[:, :k] > sp[:, 1:k + 1]).all(1)
    assert distinct.sum() >= X.shape[0] - 1
    assert torch.equal(i[distinct], torch.topk(p, k, -1)[1][distinct])
    np.testing.assert_allclose(w.double().numpy(), w_ref.numpy(), rtol=rtol, atol=atol)


def _route_every_schedule(k, experts, seed):
    kern = af.compile(MOE["softmax_topk"](k))
    assert kern.fusion.certificate.ok and len(kern.fusion.passes) == 1
    for e in experts:
        X = _route_rows(7, e, seed + e)
        for sched, kw in ROUTE_SCHEDULES:
            _check_route(X, k, kern(x=X, schedule=sched, **kw))
    return kern


@pytest.mark.parametrize("k", [1, 2])
def test_softmax_topk_routing_every_schedule_odd_experts(k):
    """MoE routing written plainly (softmax, top-k, renormalise), k = 1 and 2, 13 and 61
    experts, single / loop / split, against float64 torch; bfloat16 logits too."""
    kern = _route_every_schedule(k, (13, 61), 10 * k)
    Xb = _route_rows(5, 29, 3, torch.bfloat16)
    # bfloat16 weights: float32 arithmetic, then one rounding to nearest at the output (half a
    # unit in the last place, 2^-8 relative; a truncating store, up to 2^-7, fails this)
    _check_route(Xb, k, kern(x=Xb), rtol=2.0 ** -8 + 3e-6, atol=1e-7)


# (122 s, slow-marked, before the top-8's shared terms were walked as DAGs: 5 s)
def test_softmax_top8_routing_every_schedule_odd_experts():
    _route_every_schedule(8, (13, 61), 80)


def test_routing_kernel_writes_the_stacked_outputs_itself(monkeypatch):
    """The kernel writes weights and experts as one [tokens, k] tensor each (one pointer per
    stacked output, one k-wide store per row block): no per-candidate tensors, no torch.stack
    after the call. The per-candidate names still read their slices."""
    kern = af.compile(MOE["softmax_topk"](2))
    mod = kern.kernel.kernel.module
    assert mod.OUTPUTS == {"weights": ("t", "k"), "experts": ("t", "k")}
    single = inspect.signature(getattr(mod, "softmax_top2_single").fn).parameters
    assert "weights_ptr" in single and "weights__0_ptr" not in single and "experts__1_ptr" not in single

    def no_stack(*a, **kw):
        raise AssertionError("the candidates were stacked after the kernel")
    monkeypatch.setattr(torch, "stack", no_stack)
    X = _route_rows(9, 37, 5)
    for sched, kw in ROUTE_SCHEDULES:
        out = kern(x=X, schedule=sched, **kw)
        _check_route(X, 2, out)
        assert out["weights"].stride() == (2, 1) and out["experts"].stride() == (2, 1)
        assert torch.equal(out["weights__1"], out["weights"][:, 1])
        assert torch.equal(out["experts__0"], out["experts"][:, 0])
    raw = mod.run(x=X)                  # the generated launcher alone: the same stacked tensors
    _check_route(X, 2, raw)
    mod._PLANS.clear()                  # a call signature's launch is worked out once (the plan cache)
    for _ in range(3):
        _check_route(X, 2, kern(x=X))
    assert len(mod._PLANS) == 1


def test_routing_launcher_refuses_rows_shorter_than_k():
    """The generated launcher itself (not only af.compile's wrapper) refuses a row with fewer
    experts than k: the kernel would otherwise write candidates that do not exist."""
    mod = af.compile(MOE["softmax_topk"](2)).kernel.kernel.module
    with pytest.raises(ValueError, match="top-2 over axis 'e'.*only 1 elements.*k <= 1"):
        mod.run(x=torch.randn(3, 1))
    assert mod.run(x=torch.randn(3, 2))["experts"].shape == (3, 2)


def test_stacked_output_elementwise_over_the_selected_axis():
    """A stacked output elementwise over the selected axis (x minus each selected value; the
    general engine's several passes) is written as one [t, e, k] tensor too."""
    x = af.tensor("x", "t e")
    vals, idx = af.topk(x, 2, "e")
    kern = af.compile(af.program("topk_elem", d=vals.map(lambda v: x - v), indices=idx))
    assert kern.kernel.kernel.module.OUTPUTS == {"d": ("t", "e", "k"), "indices": ("t", "k")}
    X = torch.randn(5, 13, generator=torch.Generator().manual_seed(2)) * 4
    tv, ti = torch.topk(X.double(), 2, -1)
    for sched, kw in [("single", {}), ("loop", {"block_j": 4})]:
        out = kern(x=X, schedule=sched, **kw)
        assert torch.equal(out["indices"], ti)
        np.testing.assert_allclose(out["d"].double().numpy(), (X.double()[:, :, None] - tv[:, None, :]).numpy(),
                                   rtol=1e-7, atol=4e-6)   # one float32 rounding of values below 40


def test_an_expression_minus_candidates_applies_to_each_candidate():
    """``s - vals`` with ``s`` an af expression (not only ``vals - s`` or ``2.0 - vals``): the
    README promises arithmetic applies to each candidate; Expr's operators raised LanguageError."""
    import torch
    from acefuse.reference import evaluate
    from acefuse.topk import Stacked, stack_outputs
    x = af.tensor("x", "t e")
    s = af.sum(x, "e")
    vals, _ = af.topk(x, 2, "e")
    gap = s - vals
    assert isinstance(gap, Stacked) and isinstance(s / vals, Stacked)
    prog = af.program("gap", gap=gap)
    xs = torch.randn(5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = torch.as_tensor(stack_outputs(prog, evaluate(prog, {"x": xs}))["gap"])
    want = xs.sum(-1, keepdim=True) - torch.topk(xs, 2, -1).values
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
