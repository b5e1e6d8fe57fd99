"""Regression tests for the classes of silent wrong results the numerics issue found:
masked tiles in the rolling update and the merge, exponentials split into unbounded ones,
infinite min/max, programs that crashed, output layout, tanh accuracy. Every check is
against torch float64 on fresh random inputs (seeded per test), at odd sizes, with small
tiles so that several tiles (and a fully masked one) occur."""
import math

import pytest
import torch

import acefuse as af

SCHEDULES = ("single", "loop", "split")


def run_all(k, inputs, schedules=SCHEDULES, **kw):
    """{schedule: output} for every schedule the kernel has (split needs one pass with merges)."""
    out = {}
    for s in schedules:
        if s == "split" and not (len(k.fusion.passes) == 1 and k.fusion.passes[0].split_ok):
            continue
        out[s] = k(**inputs, schedule=s, block_j=16, nsplit=3, **kw)
    return out


def close(got, ref, rtol=1e-4, atol=1e-5):
    got = got.double()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    same_nan = torch.isnan(got) == torch.isnan(ref)
    assert bool(same_nan.all()), f"NaN pattern differs: got {got}, expected {ref}"
    fin = torch.isfinite(ref)
    assert bool((got[~fin & ~torch.isnan(ref)] == ref[~fin & ~torch.isnan(ref)]).all()), "infinities differ"
    assert torch.allclose(got[fin], ref[fin], rtol=rtol, atol=atol), (got[fin] - ref[fin]).abs().max()


def softmax_programs():
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    e = af.exp(x - m)
    l = af.sum(e, "j")
    return af.program("nm_softmax", y=e / l), af.program("nm_lse", out=m + af.log(l))


# ---- 1. a fully masked tile or chunk leaves every state unchanged ----------------------------
@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_fully_masked_tile_does_not_poison_rolling_or_merge(where):
    g = torch.Generator().manual_seed({"start": 1, "middle": 2, "end": 3}[where])
    sm, lse = softmax_programs()
    X = torch.randn(3, 101, generator=g) - 100.0          # logits near -100: exp(0 - m) overflows
    sl = {"start": slice(0, 40), "middle": slice(30, 70), "end": slice(60, 101)}[where]
    X[:, sl] = -math.inf
    X[2] = -math.inf                                       # and one fully masked row
    ref_y = torch.softmax(X.double(), -1).nan_to_num(0.0)  # convention: a fully masked row gives 0
    ref_l = torch.logsumexp(X.double(), -1)                # -inf on the masked row
    for y in run_all(af.compile(sm), {"x": X}).values():
        close(y, ref_y)
    for o in run_all(af.compile(lse), {"x": X}).values():
        close(o, ref_l)


def test_masked_softmax_expectation_with_masked_chunks():
    g = torch.Generator().manual_seed(4)
    x, w = af.tensor("x", "r j"), af.tensor("w", "r j")
    s = af.where(af.index("j") >= 37, x, af.NEG_INF)      # left padding: the first tiles are masked
    m = af.max(s, "j")
    p = af.exp(s - m)
    prog = af.program("nm_expect", o=af.sum(p * w, "j") / af.sum(p, "j"))
    X, W = torch.randn(4, 90, generator=g) * 3, torch.randn(4, 90, generator=g)
    Xm = X.double().clone()
    Xm[:, :37] = -math.inf
    ref = (torch.softmax(Xm, -1) * W.double()).sum(-1)
    for o in run_all(af.compile(prog), {"x": X, "w": W}).values():
        close(o, ref)


# ---- 2. an exponential that is bounded as written is never split into unbounded ones -----------
def test_logsumexp_shifted_by_a_large_sum_stays_finite():
    g = torch.Generator().manual_seed(5)
    x = af.tensor("x", "r j")
    t = x - af.sum(af.abs(x), "j")
    m = af.max(t, "j")
    prog = af.program("nm_lse_shift", out=m + af.log(af.sum(af.exp(t - m), "j")))
    X = torch.randn(2, 5000, generator=g)
    ref = torch.logsumexp(X.double() - X.double().abs().sum(-1, keepdim=True), -1)
    k = af.compile(prog)
    for o in run_all(k, {"x": X}).values():
        close(o, ref, rtol=1e-5, atol=1e-3)
    if not k.fusion.fusible:   # the exact fallback must say why
        assert "float32" in k.fusion.reason or "another pass" in k.fusion.reason


def test_logsumexp_of_centred_values_near_1e4():
    g = torch.Generator().manual_seed(6)
    x = af.tensor("x", "r j")
    c = x - af.mean(x, "j")
    m = af.max(c, "j")
    prog = af.program("nm_lse_centred", out=m + af.log(af.sum(af.exp(c - m), "j")))
    X = torch.randn(3, 300, generator=g) * 30 + 1e4
    ref = torch.logsumexp(X.double() - X.double().mean(-1, keepdim=True), -1)
    for o in run_all(af.compile(prog), {"x": X}).values():
        close(o, ref, rtol=1e-4, atol=2e-2)   # float32 holds 1e4 to about 1e-3


def test_logsumexp_shifted_by_a_row_constant_keeps_the_exact_zero_at_its_max():
    """max_j(a + b) = max_j(a) + b turned `t - max_j t` (t = a + b) into `a + b - max_j a - b`:
    with a ~ 1e11 the float32 sum a + b loses b, the argmax no longer gives exp(0) = 1 and
    logsumexp came out -inf (fuzz seed 510). `(a + b) - (c + b) = a - c` cancels the shift."""
    g = torch.Generator().manual_seed(7)
    x = af.tensor("x", "r j")
    t = x ** 3 + af.min(x + 0.01 * af.index("j"), "j")
    m = af.max(t, "j")
    prog = af.program("nm_lse_cubed", out=m + af.log(af.sum(af.exp(t - m), "j")))
    X = torch.randn(3, 33, generator=g) * 3000
    Xd = X.double()
    T = Xd ** 3 + (Xd + 0.01 * torch.arange(33, dtype=torch.float64)).amin(-1, keepdim=True)
    ref = torch.logsumexp(T, -1)
    for o in run_all(af.compile(prog), {"x": X}).values():
        assert torch.isfinite(o).all()
        close(o, ref, rtol=1e-5, atol=0)


def test_simulation_rejects_an_overflowing_form():
    """The adversarial float32 check itself: a rolling update that overflows is flagged."""
    from acefuse.extract import simulate
    from acefuse.rewrite.terms import Term, A, B, U, st, rsum, elm, exp
    x = af.tensor("x", "r j")
    m = af.max(x, "j")
    f = af.fuse(af.program("nm_sim", out=af.sum(af.exp(x - m), "j")))
    p = f.passes[0]
    s = next(q.name for q in p.states if q.op == "sum")
    mq = next(q.name for q in p.states if q.op == "max")
    AB = U(A, B)
    # exp(m_A) * exp(-m_AB) instead of exp(m_A - m_AB): the same real number, overflows in float32
    bad = dict(p.rolling)
    bad[s] = st(s, A) * exp(st(mq, A)) * exp(-st(mq, AB)) + rsum(B, exp(elm("x") - st(mq, AB)))
    assert s in simulate.failures(f.encoding, p, bad, "rolling")
    assert not simulate.failures(f.encoding, p, p.rolling, "rolling")


def test_simulation_rejects_a_raw_moment_variance_over_a_select_of_two_leaves():
    """The float32 check must refuse a raw-moment rolling variance of a `where` over two
    leaves at an offset of 1e4 (it sampled each leaf's regime independently and missed it)."""
    from acefuse.extract import simulate
    from acefuse.rewrite.terms import Term, A, B, U, st, rsum, cnt, num
    x = af.tensor("x", "r j")
    h = 0.5 * x
    t = af.where(h <= 0.5 * af.max(h, "j"), h, x)
    f = af.fuse(af.program("nm_sim_var", v=af.sum((t - af.sum(t, "j") / af.size("j")) ** 2, "j")))
    centred = lambda s: s.op == "sum" and any(u.op == "Sub" for u in f.encoding.state(s.name).definition.walk())
    p = next(q for q in f.passes if any(centred(s) for s in q.states))
    var = next(s.name for s in p.states if centred(s))
    tot = next(s.name for s in p.states if s.op == "sum" and s.name != var)
    w = p.init[tot].args[1]                                     # the body of sum_B(t)
    AB = U(A, B)
    mean = lambda blk: st(tot, blk) / cnt(blk)
    d = mean(AB) - mean(A)
    raw = rsum(B, w * w) - num(2.0) * (rsum(B, w) * mean(AB)) + mean(AB) * mean(AB) * cnt(B)
    bad = dict(p.rolling)
    bad[var] = st(var, A) + d * d * cnt(A) + raw               # the same real number, cancels
    for seed in range(8):      # not by luck of the draw: every seed has offset rows for both leaves
        assert var in simulate.failures(f.encoding, p, bad, "rolling", seed=seed)
        assert var not in simulate.failures(f.encoding, p, p.rolling, "rolling", seed=seed)


# ---- 3. infinities follow IEEE/torch --------------------------------------------------------
def test_min_of_a_row_holding_minus_inf_is_minus_inf():
    g = torch.Generator().manual_seed(7)
    x = af.tensor("x", "r j")
    mn = af.min(x, "j")
    prog = af.program("nm_min_inf", y=x / (1 + mn * mn), mn=mn)
    X = torch.randn(3, 50, generator=g)
    X[1, 7] = -math.inf
    Xd = X.double()
    mref = Xd.amin(-1, keepdim=True)
    for out in run_all(af.compile(prog), {"x": X}).values():
        close(out["mn"], mref[:, 0])
        close(out["y"], Xd / (1 + mref * mref))


def test_softmax_of_a_row_holding_plus_inf_is_nan_like_torch():
    g = torch.Generator().manual_seed(8)
    sm, _ = softmax_programs()
    X = torch.randn(3, 50, generator=g)
    X[1, 7] = math.inf
    ref = torch.softmax(X.double(), -1)
    assert torch.isnan(ref[1]).all()
    for y in run_all(af.compile(sm), {"x": X}).values():
        close(y, ref)


def test_max_reduction_propagates_nan():
    x = af.tensor("x", "r j")
    prog = af.program("nm_max_nan", m=af.max(x * 2.0, "j"))
    X = torch.randn(2, 40, generator=torch.Generator().manual_seed(9))
    X[0, 5] = math.nan
    for m in run_all(af.compile(prog), {"x": X}).values():
        assert torch.isnan(m[0]) and torch.isfinite(m[1])


# ---- 4. programs that crashed: they fuse, or take passes with a reason -------------------------
def _moment(p):
    x = af.tensor("x", "r j")
    mu = af.mean(x, "j")
    return af.program(f"nm_moment{p}", y=af.sum((x - mu) ** p, "j")), \
        (lambda X: ((X - X.mean(-1, keepdim=True)) ** p).sum(-1))


def _above_mean(count):
    x = af.tensor("x", "r j")
    mu = af.mean(x, "j")
    body = af.where(x > mu, 1.0, 0.0) if count else af.where(x > mu, x, 0.0)
    ref = (lambda X: (X > X.mean(-1, keepdim=True)).double().sum(-1)) if count else \
        (lambda X: torch.where(X > X.mean(-1, keepdim=True), X, 0.0).sum(-1))
    return af.program(f"nm_above{int(count)}", y=af.sum(body, "j")), ref


@pytest.mark.parametrize("make", [lambda: _moment(3), lambda: _moment(4), lambda: _above_mean(False),
                                  lambda: _above_mean(True)], ids=["moment3", "moment4", "where", "count"])
def test_reductions_reading_earlier_reductions_compile_and_are_right(make):
    prog, ref = make()
    f = af.fuse(prog)
    assert f.fusible or f.reason   # never a crash, and a reason when it takes passes
    X = torch.randn(3, 70, generator=torch.Generator().manual_seed(10)) + 2.0
    for y in run_all(af.compile(prog), {"x": X}).values():
        close(y, ref(X.double()), rtol=1e-4, atol=1e-3)


def test_output_that_folds_to_a_constant():
    x = af.tensor("x", "r j")
    prog = af.program("nm_const", y=af.sum(x, "j") * 0.0 + 1.0, z=af.sum(x, "j"))
    X = torch.randn(3, 40, generator=torch.Generator().manual_seed(11))
    for out in run_all(af.compile(prog), {"x": X}).values():
        close(out["y"], torch.ones(3, dtype=torch.float64))
        close(out["z"], X.double().sum(-1), atol=1e-4)


# ---- 5. layout: an output's axes never depend on the order of outputs or operands ------------
@pytest.mark.parametrize("order", ["w-first", "x-first"])
def test_output_layout_is_deterministic(order):
    if order == "w-first":
        w, x = af.tensor("w", "j"), af.tensor("x", "r j")
    else:
        x, w = af.tensor("x", "r j"), af.tensor("w", "j")
    prog = af.program(f"nm_layout_{order.replace('-', '_')}", a=af.sum(w, "j") + af.max(x, "j"), y=x * 2.0)
    assert prog.outputs["y"].axes == ("r", "j")
    g = torch.Generator().manual_seed(12)
    X, W = torch.randn(5, 5, generator=g), torch.randn(5, generator=g)   # square: a transpose would hide
    out = af.compile(prog)(x=X, w=W)
    close(out["y"], X.double() * 2)
    close(out["a"], W.double().sum() + X.double().amax(-1))


# ---- 6. tanh is accurate for tiny and moderate arguments --------------------------------------
def test_tanh_relative_accuracy():
    x = af.tensor("x", "r j")
    prog = af.program("nm_tanh", y=af.tanh(x))
    X = torch.tensor([[1e-30, 1e-6, -1e-6, 0.01, 0.1, 0.29, 0.31, 1.0, 5.0, 20.0, -20.0, 1e-20]])
    y = af.compile(prog)(x=X).double()
    ref = torch.tanh(X.double())
    assert ((y - ref).abs() / ref.abs()).max() < 1e-6


def test_axis_length_inside_a_reduction_body_is_the_whole_axis():
    """size(j) in a body is the axis's length (a constant), not the tile's count."""
    x = af.tensor("x", "r j")
    half = af.where(af.index("j") < af.size("j") * 0.5, x, 0.0)
    prog = af.program("nm_size_body", y=af.sum(half, "j"), z=af.sum(x * af.size("j"), "j"))
    X = torch.randn(3, 41, generator=torch.Generator().manual_seed(13))
    Xd = X.double()
    for out in run_all(af.compile(prog), {"x": X}).values():
        close(out["y"], Xd[:, :21].sum(-1))
        close(out["z"], Xd.sum(-1) * 41, atol=1e-3)


@pytest.mark.parametrize("left", [True, False], ids=["w-first", "exp-first"])
def test_factor_order_does_not_change_fusibility(left):
    x, w = af.tensor("x", "r j"), af.tensor("w", "r j")
    e = af.exp(x - af.max(x, "j"))
    prog = af.program(f"nm_order_{int(left)}", y=af.sum(w * e if left else e * w, "j"))
    assert af.fuse(prog).fusible
    g = torch.Generator().manual_seed(14)
    X, W = torch.randn(3, 70, generator=g), torch.randn(3, 70, generator=g)
    ref = (W.double() * torch.exp(X.double() - X.double().amax(-1, keepdim=True))).sum(-1)
    for y in run_all(af.compile(prog), {"x": X, "w": W}).values():
        close(y, ref)


def test_variance_next_to_other_outputs_in_the_loop_schedule():
    """Fuzz seed 703, program 194: next to two other outputs, the rolling form of
    sum_j((t - mean_j t)**2) was extracted expanded (sum_B(t**2) - 2 sum_B(t) mean + ...),
    which cancels at an offset of 1e4. The cost model counted `where(c, a, b) - mean` as a
    cancellation of two rounded values (a select is exact), and the float32 check sampled
    the two leaves of the `where` independently, so no row had both at the offset."""
    x = af.tensor("x", "r j")
    t1 = af.exp(-af.abs(x * 3.0))
    t2 = t1 - af.sum(t1, "j") / af.size("j")
    t3 = af.exp(t2 - af.max(t2, "j"))
    t4 = x + 0.5 * af.index("j")
    t5 = af.where(af.index("j") < 40.0, x, af.NEG_INF)
    t6 = af.exp(t5 - af.max(t5, "j"))
    t7 = t6 / af.sum(t6, "j")
    t8 = af.exp(t7 - af.max(t7, "j"))
    t9 = 0.5 * x
    t10 = af.where(t9 <= 0.5 * af.max(t9, "j"), t9, x)
    prog = af.program(
        "nm_var_multi",
        o0=af.sum(t3 * ((t4 - af.sum(t4, "j") / af.size("j")) * af.sum(x + t4, "j")), "j") / af.sum(t3, "j"),
        o1=(t8 / af.sum(t8, "j")) ** 2,
        o2=af.sum((t10 - af.sum(t10, "j") / af.size("j")) ** 2, "j") / af.size("j"))
    g = torch.Generator().manual_seed(3)
    X = 1e4 + torch.randn(4, 50, generator=g)
    ref = X.double().var(-1, unbiased=False)
    o = af.compile(prog)(x=X, schedule="loop", block_j=16)["o2"]
    close(o, ref, rtol=1e-2, atol=1e-2)


def test_max_state_rolls_with_its_own_body_so_a_later_shift_stays_below_it():
    """Fuzz seed 1012, program 57: the max of ``(x + r) * c`` rolled as
    ``max_B(x * c) + r * c`` (rounded differently from the body a later pass shifts by it);
    at magnitudes of 1e16 the later ``exp((x + r) * c - m)`` overflowed and the loop schedule
    returned -inf/inf where the value is finite. A max reading only final values now rolls
    as ``max(m_A, max_B(body))`` with the definition's own body."""
    from acefuse.fuzz import make_inputs
    x = af.tensor("x", "r j")
    t1 = x + (0.01 * af.index("j"))
    t2 = af.max(t1, "j")
    t3 = (x + (t2 + af.log(af.sum(af.exp(t1 - t2), "j")))) * \
        (af.sum((x - (af.sum(x, "j") / af.size("j"))) ** 3, "j") / af.size("j"))
    t4 = af.max(t3, "j")
    prog = af.program("nm_max_body", o0=t4 + af.log(af.sum(af.exp(t3 - t4), "j")))
    f = af.fuse(prog)
    for p in f.passes:
        for s in p.states:
            if s.op == "max" and all(u.args[1].op == "BJ" for u in p.init[s.name].walk() if u.op == "St"):
                assert p.rolling[s.name].args[1] == p.init[s.name], (s.name, p.rolling[s.name])
    inputs = make_inputs(kind="spread_1e4", R=5, J=100, dtype="bfloat16", seed=438004041, w_axes=None)
    xd = inputs["x"].double()
    m3 = ((xd - xd.mean(-1, keepdim=True)) ** 3).mean(-1, keepdim=True)
    ref = torch.logsumexp((xd + torch.logsumexp(xd + 0.01 * torch.arange(xd.shape[-1]), -1, keepdim=True)) * m3, -1)
    k = af.compile(prog)
    for sched in ("single", "loop"):
        o = k(**inputs, schedule=sched, block_j=16)
        assert torch.isfinite(o).all(), (sched, o)
        close(o.double(), ref, rtol=2e-2, atol=0)


def test_sum_shifted_by_a_max_rolls_with_the_body_the_max_saw():
    """GPU fuzz seed 1104, program 0: the later sum's rolling form reassociated its body
    (``mn * r * e`` against the max's ``mn * e * r``); at 1e12 ``exp(body - m)`` overflowed
    and the loop schedule returned -inf. States reading only final values now roll by their
    split law as written."""
    from acefuse.fuzz import make_inputs
    x, w = af.tensor("x", "r j"), af.tensor("w", "r j")
    t1 = af.max(x, "j")
    t2 = ((x * w) * af.min(x, "j")) * (t1 + af.log(af.sum(af.exp(x - t1), "j")))
    t3 = af.max(t2, "j")
    prog = af.program("nm_sum_body", o0=t3 + af.log(af.sum(af.exp(t2 - t3), "j")))
    f = af.fuse(prog)
    for p in f.passes:
        for s in p.states:
            if all(u.args[1].op == "BJ" for u in p.init[s.name].walk() if u.op == "St"):
                assert p.rolling[s.name].args[1] == p.init[s.name], (s.name, p.rolling[s.name])
    inputs = make_inputs(kind="offset_1e4", R=1, J=17, dtype="float32", seed=1924427965, w_axes="rj")
    xd, wd = inputs["x"].double(), inputs["w"].double()
    t2d = xd * wd * xd.amin(-1, keepdim=True) * torch.logsumexp(xd, -1, keepdim=True)
    ref = torch.logsumexp(t2d, -1)
    k = af.compile(prog)
    for sched in ("single", "loop"):
        o = k(**inputs, schedule=sched, block_j=16)
        assert torch.isfinite(o).all(), (sched, o)
        close(o.double(), ref, rtol=1e-3, atol=0)
