"""The project's fuzzer (acefuse/fuzz.py): its oracle must be able to fail, its reference
must follow the documented numerics conventions, and a short fixed-seed run must be clean."""
import math
import os
import random

import pytest
import torch

import acefuse as af
from acefuse import fuzz as fz


# ---- hand-built program pairs ----------------------------------------------------------------
def _softmax_pair():
    x = fz.inp("x", "rj")
    s = fz.sub(x, fz.reduce("max", x))
    s.hi = 0.0
    p = fz.exp(s)
    l = fz.reduce("sum", p)
    l.lo = 1.0
    return {"y": fz.div(p, l)}


def _lse_var_pair():
    x = fz.inp("x", "rj")
    m = fz.reduce("max", x)
    s = fz.sub(x, m)
    s.hi = 0.0
    l = fz.reduce("sum", fz.exp(s))
    l.lo = 1.0
    c = fz.sub(x, fz.mean(x))
    return {"lse": fz.add(m, fz.log(l)), "var": fz.mean(fz.pow_(c, 2))}


_KERNELS: dict = {}


def _compiled(prog):
    """af.compile, once per program for this module (the wrong-kernel tests reuse kernels)."""
    if prog.key() not in _KERNELS:
        _KERNELS[prog.key()] = af.compile(prog)
    return _KERNELS[prog.key()]


def _res(outputs, cases, compile_fn=None):
    res = fz.Result()
    fz.run_program(outputs, None, cases, res, log=lambda *a: None, name="fzt", compile_fn=compile_fn)
    return res


def _case(kind="normal", R=5, J=5, dtype="float32", seed=3):
    return dict(kind=kind, R=R, J=J, dtype=dtype, seed=seed, w_axes=None)


# ---- the reference follows the conventions ---------------------------------------------------
def test_reference_conventions_on_masked_rows():
    x = torch.randn(3, 20, dtype=torch.float64)
    x[0] = -math.inf                   # fully masked row
    x[1, 3] = math.inf                 # a row holding +inf
    out = fz.reference(_softmax_pair(), {"x": x}, track=True)["y"][0]
    assert torch.equal(out[0], torch.zeros(20, dtype=torch.float64))   # softmax of -inf row: 0
    assert torch.isnan(out[1]).all()                                   # +inf row: NaN like torch
    ref = torch.softmax(x[2], 0)
    assert torch.allclose(out[2], ref, rtol=1e-12, atol=0)
    r = fz.reference(_lse_var_pair(), {"x": x}, track=True)
    assert r["lse"][0][0] == -math.inf                                  # logsumexp of -inf row
    assert torch.allclose(r["lse"][0][2], torch.logsumexp(x[2], 0), rtol=1e-12)
    assert torch.allclose(r["var"][0][2], x[2].var(unbiased=False), rtol=1e-12)


def test_reference_text_rebuilds_the_same_program():
    for seed in range(60):
        rng = random.Random(seed)
        w = rng.choice([None, "j", "rj"])
        outs = fz.Gen(rng, w).program(depth=rng.choice([1, 2, 3]))
        if not outs:
            continue
        ns: dict = {}
        exec(fz.program_text(outs, w, "fz"), ns)   # noqa: S102 - our own generated source
        assert ns["prog"].key() == af.program("fz", **{k: v.af for k, v in outs.items()}).key()


# ---- the oracle fails deliberately wrong kernels ---------------------------------------------
def test_check_output_rules():
    ref = torch.tensor([1.0, -2.0, math.nan, math.inf], dtype=torch.float64)
    b = ref.abs().nan_to_num(0, 0, 0)
    ok = fz.check_output(ref.float(), ref, ref.float(), b, torch.float32)
    assert ok.ok
    for got, cls in [([math.nan, -2.0, math.nan, math.inf], "nonfinite-where-finite"),
                     ([1.0, -2.0, 0.0, math.inf], "not-nan-where-nan"),
                     ([1.0, -2.0, math.nan, -math.inf], "wrong-inf"),
                     ([1.0, -2.0, math.nan, 3.0], "wrong-inf"),
                     ([1.0, -2.001, math.nan, math.inf], "wrong-value")]:
        v = fz.check_output(torch.tensor(got), ref, ref.float(), b, torch.float32)
        assert not v.ok and v.cls == cls, (got, v)
    # within float16's rounding of the output: accepted; 3 half-ulps off: flagged
    h = torch.tensor([1.0 + 2 ** -11], dtype=torch.float16)
    assert fz.check_output(h, torch.tensor([1.0 + 2 ** -12], dtype=torch.float64),
                           torch.tensor([1.0 + 2 ** -12]), torch.ones(1, dtype=torch.float64), torch.float16).ok
    assert not fz.check_output(torch.tensor([1.0 + 2 ** -8], dtype=torch.float16),
                               torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0]),
                               torch.ones(1, dtype=torch.float64), torch.float16).ok


class _Wrong:
    """A real kernel whose outputs are corrupted after the fact."""

    def __init__(self, k, how):
        self.k, self.how, self.fusible = k, how, k.fusible

    def __call__(self, **kw):
        out = self.k(**kw)
        if isinstance(out, dict):
            return {n: self.how(t) for n, t in out.items()}
        return self.how(out)


def _nan_at_one(t):
    t = t.clone()
    t.view(-1)[t.numel() // 2] = math.nan
    return t


@pytest.mark.parametrize("how,cls", [
    (_nan_at_one, "nonfinite-where-finite"),
    (lambda t: t.transpose(0, 1).contiguous() if t.dim() == 2 else t.flip(0), "wrong-value"),
    (lambda t: t * 1.001, "wrong-value"),
    (lambda t: t * 2, "wrong-value"),
])
def test_oracle_flags_wrong_kernels(how, cls):
    for pair in (_softmax_pair(), {"lse": _lse_var_pair()["lse"]}):
        res = _res(pair, [_case(), _case("offset_1e4", seed=4)],
                   compile_fn=lambda p: _Wrong(_compiled(p), how))
        assert res.failures and res.wrong == len(res.failures)
        assert {f.cls for f in res.failures} == {cls}
        # every schedule that ran is flagged, and each failure is a reproducer
        assert {f.schedule for f in res.failures} >= {"single", "loop"}
        assert "make_inputs(" in res.failures[0].reproducer()


def test_oracle_flags_a_crashing_kernel():
    def boom(p):
        k = _compiled(p)

        def call(**kw):
            raise IndexError("tile index out of range")
        call.fusible = k.fusible
        return call
    res = _res(_softmax_pair(), [_case()], compile_fn=boom)
    assert res.crashes and {f.cls for f in res.failures} == {"crash:IndexError"}


def test_correct_kernels_pass_on_adversarial_inputs():
    cases = [_case(k, R=3, J=J, dtype=d, seed=i) for i, (k, J, d) in enumerate(
        [("masked_tiles", 130, "float32"), ("near_m1e4", 33, "float16"), ("infs", 50, "bfloat16"),
         ("offset_1e4", 17, "float32")])]
    res = _res(_softmax_pair(), cases)
    assert res.ok, [f.reproducer() for f in res.failures]
    assert res.kernel_runs >= 8


# ---- fuzzing runs --------------------------------------------------------------------------------
# (10 programs: 77 s of the 2-core suite at 14, session 22; the long profile runs 80 with -m slow)
SHORT_PROGRAMS, SHORT_SEED = 10, 7


def test_fuzz_short_profile():
    res = fz.run(n_programs=SHORT_PROGRAMS, seed=SHORT_SEED, profile="short")
    assert res.programs == SHORT_PROGRAMS and res.kernel_runs >= 2 * SHORT_PROGRAMS
    assert res.ok, res.summary() + "\n\n" + "\n\n".join(f.reproducer() for f in res.failures[:5])


@pytest.mark.slow
def test_fuzz_long_profile(request):
    """About 8 minutes on 2 cores: runs only with ``-m slow`` (or ACEFUSE_FUZZ_LONG=1)."""
    if "slow" not in (request.config.getoption("markexpr") or "") and not os.environ.get("ACEFUSE_FUZZ_LONG"):
        pytest.skip("long fuzzing run: use -m slow or ACEFUSE_FUZZ_LONG=1")
    res = fz.run(n_programs=80, seed=11, profile="long")
    assert res.ok, res.summary() + "\n\n" + "\n\n".join(f.reproducer() for f in res.failures[:5])


# ---- the running error bound covers what float32 evaluation actually loses ---------------------
from hypothesis import given, settings, HealthCheck, strategies as st   # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(pair=fz.programs(depth=3), kind=st.sampled_from(fz.KINDS), J=st.sampled_from([1, 7, 33, 130]),
       seed=st.integers(0, 2 ** 20))
def test_error_bound_covers_float32_evaluation(pair, kind, J, seed):
    """The oracle's tolerance term C_A u32 a must cover the float32 reference's own error
    (otherwise an unfused float32 kernel would be flagged): no false alarms by construction."""
    outs, w = pair
    ex = {k: v.double() for k, v in fz.make_inputs(kind, 3, J, "float32", seed, w).items()}
    r64 = fz.reference(outs, ex, torch.float64, track=True)
    r32 = fz.reference(outs, ex, torch.float32)
    for o in outs:
        v, a = r64[o]
        v32 = r32[o][0].double()
        live = torch.isfinite(v) & torch.isfinite(v32)
        assert torch.equal(torch.isnan(v), torch.isnan(v32)) or not live.all()
        err = (v32 - v).abs()[live]
        assert (err <= fz.C_A * fz.U32 * a[live] + fz.TINY32).all(), (o, fz.program_text(outs, w))


def test_reference_polarity_conventions():
    """A per-row value built only from reductions that is -inf reads as 0 where it is
    subtracted (README "Numerics conventions"): shifting x + mean_j x by its max on a
    fully -inf row gives exp(-inf) = 0, not NaN; outside a difference it stays -inf."""
    x = fz.inp("x", "rj")
    t = fz.add(x, fz.mean(x))
    s = fz.sub(t, fz.reduce("max", t))
    s.hi = 0.0
    lse_in = fz.add(fz.mul(x, fz.const(0.5)), fz.reduce("max", x))
    X = torch.randn(2, 9, dtype=torch.float64)
    X[1] = -math.inf
    r = fz.reference({"y": fz.exp(s), "m": fz.reduce("max", x), "z": lse_in}, {"x": X}, track=True)
    assert torch.equal(r["y"][0][1], torch.zeros(9, dtype=torch.float64))
    assert torch.allclose(r["y"][0][0], torch.exp(X[0] - X[0].max()), rtol=1e-12)
    assert r["m"][0][1] == -math.inf and (r["z"][0][1] == -math.inf).all()
    # NaN of the reference may come out as any value only where the inputs hold an infinity
    # (identities proved over the reals, README "Infinite inputs after algebra")
    ref = torch.tensor([math.nan, math.nan], dtype=torch.float64)
    got = torch.tensor([math.inf, -math.inf])
    assert fz.check_output(got, ref, ref.float(), torch.zeros(2, dtype=torch.float64), torch.float32,
                           torch.tensor([True, True])).ok
    assert not fz.check_output(got, ref, ref.float(), torch.zeros(2, dtype=torch.float64), torch.float32,
                               torch.tensor([True, False])).ok
    assert fz.check_output(torch.tensor([0.0, 0.0]), ref, ref.float(), torch.zeros(2, dtype=torch.float64),
                           torch.float32, torch.tensor([True, True])).ok
    assert not fz.check_output(torch.tensor([0.0, 0.0]), ref, ref.float(), torch.zeros(2, dtype=torch.float64),
                               torch.float32, torch.tensor([False, False])).ok


def test_loose_rows_only_where_an_infinite_sum_is_read_further():
    """README "Infinite inputs after algebra": once the program reads a sum over j that is
    +-inf or NaN on a row whose inputs hold an infinity, the rewrites may move the sum
    across a shift (``max_j(x + s) = max_j(x) + s``), so that row's outputs are free.
    Rows without such a sum, and rows without an infinity, are still checked."""
    x = fz.inp("x", "rj")
    t = fz.add(x, fz.reduce("sum", x))
    s = fz.sub(t, fz.reduce("max", t))
    s.hi = 0.0
    y = fz.exp(s)
    X = torch.randn(3, 7, dtype=torch.float64)
    X[1, 2] = -math.inf        # the sum is -inf and it is read: row 1 is loose
    info = {}
    ref = fz.reference({"y": y, "s": fz.reduce("sum", x)}, {"x": X}, track=True, info=info)
    assert info["loose"].tolist() == [False, True, False]
    # the sum alone is an output, not read further: not loose
    info2 = {}
    fz.reference({"s": fz.reduce("sum", x)}, {"x": X}, track=True, info=info2)
    assert not info2["loose"].any()
    v64, b = ref["y"]
    wrong = v64.clone().float()
    wrong[1] = math.nan
    inf_rows = torch.tensor([False, True, False])[:, None]
    assert fz.check_output(wrong, v64, v64.float(), b, torch.float32, inf_rows, info["loose"][:, None]).ok
    # the same NaN on a row that is not loose is wrong (the checker can fail)
    wrong2 = v64.clone().float()
    wrong2[0] = math.nan
    assert not fz.check_output(wrong2, v64, v64.float(), b, torch.float32, inf_rows, info["loose"][:, None]).ok
    # a loose row without an infinite input (a sum that overflowed) is still checked
    assert not fz.check_output(wrong, v64, v64.float(), b, torch.float32, torch.zeros(3, 1, dtype=torch.bool),
                               info["loose"][:, None]).ok


def _shifted_by_a_masked_max_pair():
    """GPU fuzz seed 1104, program 11: t = softmax_j(w) + max_j x, then exp(t - max_j t)."""
    w, x = fz.inp("w", "rj"), fz.inp("x", "rj")
    d = fz.sub(w, fz.reduce("max", w))
    d.hi = 0.0
    e = fz.exp(d)
    l = fz.reduce("sum", e)
    l.lo = 1.0
    t = fz.add(fz.div(e, l), fz.reduce("max", x))
    s = fz.sub(t, fz.reduce("max", t))
    s.hi = 0.0
    return {"o0": fz.exp(s)}


def _masked_max_beside_a_scaled_lse_pair():
    """GPU fuzz seed 1103, program 56: a max over a mask that selects nothing (J = 16 < 40),
    added to w * logsumexp_j(x), then a softmax shifted by the min."""
    w, x = fz.inp("w", "rj"), fz.inp("x", "rj")
    m = fz.reduce("max", x)
    d = fz.sub(x, m)
    d.hi = 0.0
    l = fz.reduce("sum", fz.exp(d))
    l.lo = 1.0
    ninf = fz.const(-math.inf)
    ninf.lo = ninf.hi = -math.inf
    masked = fz.where(">=", fz.index_j(), fz.const(40.0), fz.mul(x, w), ninf)
    t = fz.add(fz.mul(w, fz.add(m, fz.log(l))), fz.reduce("max", masked))
    e = fz.sub(fz.reduce("min", t), t)
    e.hi = 0.0
    p = fz.exp(e)
    s = fz.reduce("sum", p)
    s.lo = 1.0
    return {"o0": fz.div(p, s)}


def test_loose_rows_where_an_infinite_extremum_is_added_to_elements():
    """README "Infinite inputs after algebra": a max that is -inf (a fully masked row) added
    to values over j is cancelled by max_j(a + s) = max_j(a) + s and (a + s) - (c + s) =
    a - c, so the row is loose; the same max used as a shift (softmax, logsumexp of the
    masked row) keeps the strict convention."""
    W, X = torch.randn(3, 9, dtype=torch.float64), torch.randn(3, 9, dtype=torch.float64)
    X[1] = -math.inf
    info = {}
    fz.reference(_shifted_by_a_masked_max_pair(), {"w": W, "x": X}, track=True, info=info)
    assert info["loose"].tolist() == [False, True, False]
    for pair in (_softmax_pair(), {"lse": _lse_var_pair()["lse"]}):
        info = {}
        fz.reference(pair, {"x": X}, track=True, info=info)
        assert not info["loose"].any()


@pytest.mark.parametrize("pair, kind, J", [(_shifted_by_a_masked_max_pair, "masked_tiles", 40),
                                           (_masked_max_beside_a_scaled_lse_pair, "near_m1e4", 16)])
def test_infinite_extremum_added_to_elements_is_not_a_wrong_result(pair, kind, J):
    """Fuzz seeds 1104 (program 11) and 1103 (program 56): before the convention covered
    these rows, every schedule was reported wrong (0.79 where the convention gives 0; inf);
    rows without the infinity are still checked against the float64 reference."""
    cases = [dict(kind=kind, R=4, J=J, dtype=dt, seed=s, w_axes="rj") for dt in ("float32", "bfloat16") for s in (1, 2)]
    res = _res(pair(), cases)
    assert res.kernel_runs >= 8 and res.wrong == 0 and res.crashes == 0, res.by_class


def test_a_minus_inf_mask_counts_as_an_infinite_input():
    """where(index(j) < 0, x, -inf) brings -inf into every element of the row: the row is
    treated like one whose inputs hold an infinity (fuzz seed 701, program 103: the variance
    of x + c + lse(masked row) is NaN as written, +inf fused). Rows the mask does not reach
    stay strict."""
    x = fz.inp("x", "rj")
    j = fz.index_j()
    ninf = fz.const(-math.inf)
    ninf.lo = ninf.hi = -math.inf
    all_masked = fz.where("<", j, fz.const(0.0), x, ninf)
    none_masked = fz.where("<", j, fz.const(1e9), x, ninf)
    X = torch.randn(2, 9, dtype=torch.float64)
    for node, expect in ((all_masked, [True, True]), (none_masked, [False, False])):
        info = {}
        fz.reference({"m": fz.reduce("max", node)}, {"x": X}, track=True, info=info)
        assert info["inf_sel"].tolist() == expect


def test_an_infinity_only_rounding_decides_is_free_on_rows_holding_an_infinity():
    """(x + w) * sum_j(w - mean_j w) with x = -inf: the float64 reference is +inf and the
    float32 one -inf (the sign of rounding noise, fuzz seed 702 program 1024); the fused
    form folds the sum to 0. Any value is accepted there, only on rows holding an infinity."""
    ref64 = torch.tensor([math.inf, math.inf], dtype=torch.float64)
    ref32 = torch.tensor([-math.inf, math.inf])
    got = torch.tensor([0.0, 0.0])
    b = torch.zeros(2, dtype=torch.float64)
    v = fz.check_output(got, ref64, ref32, b, torch.float32, torch.tensor([True, True]))
    assert not v.ok   # row 1: both references agree on +inf, so 0 is wrong
    assert fz.check_output(got[:1], ref64[:1], ref32[:1], b[:1], torch.float32, torch.tensor([True])).ok
    assert not fz.check_output(got[:1], ref64[:1], ref32[:1], b[:1], torch.float32, torch.tensor([False])).ok


def test_check_output_accepts_inf_only_where_float32_error_can_reach_the_output_overflow():
    """GPU fuzz seed 1109: a float16 output whose true value is -65315 (below float16's
    65504) but whose float32 evaluation as written gives -66329 rounds to -inf; that is
    accepted, while -inf for a value far from the overflow is still wrong."""
    ref = torch.tensor([-65315.03], dtype=torch.float64)
    r32 = torch.tensor([-66329.77], dtype=torch.float32)
    got = torch.tensor([-math.inf], dtype=torch.float16)
    b = torch.tensor([65315.0], dtype=torch.float64)
    assert fz.check_output(got, ref, r32, b, torch.float16).ok
    assert not fz.check_output(got, ref, r32, b, torch.float32).ok     # float32 holds it: inf is wrong
    far = torch.tensor([-1000.0], dtype=torch.float64)
    assert not fz.check_output(got, far, far.float(), far.abs(), torch.float16).ok
    assert not fz.check_output(-got, ref, r32, b, torch.float16).ok     # the wrong sign
