"""Special functions (erf, sigmoid, softplus, log1p, expm1), rounding (floor, ceil, round,
cast) and exact integer arithmetic (// % & | ^ ~ << >>) in compiled kernels, against
independent float64 torch (functions) and Python integers (integer operators), on fresh
random inputs with extreme magnitudes, through every schedule."""
import math
import warnings

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse import lang as L
from acefuse.lang import LanguageError
from acefuse.reference import evaluate

SCHEDULES = [("single", {}), ("loop", {"block_j": 16}), ("split", {"block_j": 16, "nsplit": 3})]
FUNCS = ("erf", "sigmoid", "softplus", "log1p", "expm1", "floor", "ceil", "round")
OP_NAMES = {"erf": "Erf", "sigmoid": "Sigmoid", "softplus": "Softplus", "log1p": "Log1p", "expm1": "Expm1",
            "floor": "Floor", "ceil": "Ceil", "round": "Round"}
# float32 kernels against float64 truth rounded to float32: a few ulp, and denormals absolutely
RTOL, ATOL = 4e-6, 1e-37


def _truth(name, x):
    """float64 torch, independent of acefuse (its reference evaluator is tested separately)."""
    x = x.double()
    return {"erf": torch.special.erf, "sigmoid": torch.sigmoid, "log1p": torch.log1p, "expm1": torch.expm1,
            "softplus": lambda v: torch.logaddexp(torch.zeros_like(v), v), "floor": torch.floor,
            "ceil": torch.ceil, "round": torch.round,
            "cast": lambda v: torch.where(torch.trunc(v).abs() < 2.0 ** 31, torch.trunc(v), math.nan)}[name](x)


def _close(got, ref, what, rtol=RTOL, atol=ATOL):
    """|got - ref| <= atol + rtol |ref| where ref is finite in float32; the same infinities and
    NaNs elsewhere (ref is rounded to float32 first: an overflow there must be an inf)."""
    got, ref = got.double().cpu(), ref.float().double().cpu()
    assert got.shape == ref.shape, what
    nan_g, nan_r = torch.isnan(got), torch.isnan(ref)
    assert torch.equal(nan_g, nan_r), f"{what}: NaN where ref is {ref[nan_g != nan_r][:4]}"
    inf = torch.isinf(ref)
    assert torch.equal(got[inf], ref[inf]), f"{what}: infinities differ"
    fin = torch.isfinite(ref)
    excess = (got[fin] - ref[fin]).abs() - (atol + rtol * ref[fin].abs())
    if (excess > 0).any():
        k = int(torch.argmax(excess))
        raise AssertionError(f"{what}: got {got[fin][k].item()!r} for {ref[fin][k].item()!r} "
                             f"(excess {excess[k].item():.3e})")


def _extreme_row(n, g):
    """Values every function must get right: huge, tiny (1e-30), ties, and random spreads."""
    fixed = torch.tensor([-1e4, -1e3, -103.5, -88.5, -30.0, -20.0, -1.0, -0.5, -1e-3, -1e-6, -1e-30, 0.0,
                          1e-30, 1e-7, 1e-5, 1e-3, 0.5, 1.5, 2.5, -2.5, 3.5, 20.0, 30.0, 88.0, 100.0, 1e4,
                          3e9, -7e9], dtype=torch.float64)
    rnd = torch.cat([torch.randn(n, generator=g, dtype=torch.float64) * s for s in (1e-4, 3.0, 60.0, 1e4)])
    return torch.cat([fixed, rnd])


@pytest.fixture(scope="module")
def k_funcs():
    x = L.tensor("x", "r j")
    outs = {n: getattr(L, n)(x) for n in FUNCS}
    outs["cast"] = L.cast(x, "int32")
    # a fused cascade with a function in the body (an opaque per-element leaf for the rewrites)
    outs["s"] = L.sum(L.exp(x - L.max(x, "j")) * L.sigmoid(x), "j")
    return af.compile(L.program("functions", **outs))


@pytest.mark.parametrize("sched,kw", SCHEDULES)
def test_functions_against_float64(k_funcs, sched, kw):
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    x = torch.stack([_extreme_row(12, g)[torch.randperm(76, generator=g)] for _ in range(5)]).float()
    got = k_funcs(x=x, schedule=sched, **kw)
    for name in FUNCS + ("cast",):
        _close(got[name], _truth(name, x), f"{name} ({sched})")
    xd = x.double()
    s = (torch.sigmoid(xd) * torch.exp(xd - xd.amax(1, keepdim=True))).sum(1)
    _close(got["s"], s, f"sum(sigmoid(x) exp(x - max x)) ({sched})", rtol=2e-5)
    assert k_funcs.fusible


def test_accuracy_check_rejects_naive_formulas():
    """The tolerance above is tight enough to fail the textbook formulas in float32, and a
    value off by a few parts in 1e5."""
    x = torch.tensor([1e-7, -30.0, 1e-6, 0.3])
    with pytest.raises(AssertionError):
        _close(torch.log(1 + x[:1]), _truth("log1p", x[:1]), "naive log1p")
    with pytest.raises(AssertionError):
        _close(torch.exp(x[2:3]) - 1, _truth("expm1", x[2:3]), "naive expm1")
    with pytest.raises(AssertionError):
        _close(torch.log(1 + torch.exp(x[1:2])), _truth("softplus", x[1:2]), "naive softplus")
    with pytest.raises(AssertionError):
        _close(torch.sigmoid(x[3:]) * (1 + 3e-5), _truth("sigmoid", x[3:]), "a perturbed sigmoid")


def test_reference_evaluator_matches_torch():
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    x = L.tensor("x", "r j")
    prog = L.program("ref_functions", **{n: getattr(L, n)(x) for n in FUNCS}, cast=L.cast(x, "int32"))
    xs = _extreme_row(20, g).reshape(4, -1)
    ref = evaluate(prog, {"x": xs})
    for name in FUNCS + ("cast",):
        # atol: torch's float64 sigmoid flushes below exp(-709) to 0 where the reference keeps
        # the subnormal value
        torch.testing.assert_close(torch.from_numpy(ref[name]), _truth(name, xs), rtol=1e-14, atol=1e-300,
                                   equal_nan=True, msg=name)


@pytest.mark.parametrize("sched,kw", SCHEDULES)
def test_function_of_a_reduction_in_a_cascade(sched, kw):
    """Functions applied to values built from reductions (they reach the rewrites and the
    certificate, not only opaque leaves): softplus of a shifted element, log1p of a sum."""
    x = L.tensor("x", "r j")
    m = L.max(x, "j")
    prog = L.program("fn_cascade", a=L.log1p(L.sum(L.exp(x - m), "j")) + m,
                     b=L.sum(L.softplus(x - m) * L.erf(x), "j"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # an uncertified step compiles the unfused kernel: still exact
        k = af.compile(prog)
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    xs = (torch.randn(6, 37, generator=g, dtype=torch.float64) * torch.tensor([1.0, 30.0, 1e3, 1.0, 1e-3, 5.0])[:, None]).float()
    got = k(x=xs, schedule=sched, **kw) if k.fusible else k(x=xs)
    xd = xs.double()
    md = xd.amax(1, keepdim=True)
    a = torch.log1p(torch.exp(xd - md).sum(1)) + md[:, 0]
    b = (torch.logaddexp(torch.zeros_like(xd), xd - md) * torch.special.erf(xd)).sum(1)
    _close(got["a"], a, "log1p(sum exp(x - m)) + m", rtol=2e-5)
    _close(got["b"], b, "sum softplus(x - m) erf(x)", rtol=2e-5, atol=1e-4 * b.abs().max().item())


# ---- integer arithmetic: exhaustive at small sizes, against Python ----------------------------------
def _py(op, a, b=0):
    if op in ("//", "%") and b == 0 or op in ("<<", ">>") and not 0 <= b < 64:
        return math.nan
    if op == "<<":
        r = (a << b) & (2 ** 64 - 1)
        return float(r - 2 ** 64 if r >= 2 ** 63 else r)
    return float({"//": lambda: a // b, "%": lambda: a % b, "&": lambda: a & b, "|": lambda: a | b,
                  "^": lambda: a ^ b, ">>": lambda: a >> b, "~": lambda: ~a}[op]())


def _exact(got, want, what):
    """Exact, up to the rounding of the result to the float32 output (values above 2**24)."""
    got = got.double().cpu().numpy()
    want = np.asarray(want, dtype=np.float64).astype(np.float32).astype(np.float64)
    assert want.shape == got.shape, (what, want.shape, got.shape)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{what}: at {np.argwhere(~same)[:3].tolist()} got {got[~same][:3]} want {want[~same][:3]}"


def test_integer_operators_exhaustive():
    x = L.tensor("x", "i j")
    a, b = L.index("i") - 8, L.index("j") - 8          # every pair in -8..8
    ops = {"fd": ("//", a // b), "md": ("%", a % b), "an": ("&", a & b), "orr": ("|", a | b),
           "xo": ("^", a ^ b), "nt": ("~", ~a)}
    # where / max / abs / sizes / booleans inside integer arithmetic stay exact int64
    misc = L.where(b > 3, a // b, L.maximum(a, b) % 5) + (L.abs(a) // 3) * 1000 \
        + ((L.size("i") // 2 + (b > 0)) << 12)
    # constant divisors: powers of two (a shift and a mask) and others, on negative dividends
    p2 = (a // 4) * 10000 + (a % 8) * 100 + (a // -4) + (a % 3) * 1000000 + (a % -2) * 100000000
    prog = L.program("int_ops", **{k: e for k, (_, e) in ops.items()}, misc=misc, p2=p2,
                     s=L.sum(x * (L.index("j") % 3).eq(0), "j"))
    k = af.compile(prog)
    xs = torch.randn(17, 17)
    got = k(x=xs)
    for name, (sym, _) in ops.items():
        want = [[_py(sym, i - 8, j - 8) for j in range(17)] for i in range(17)]
        want = [w[0] for w in want] if sym == "~" else want   # ~a ranges over i only
        _exact(got[name], want, f"a {sym} b")
    want = [[(_py("//", ia, ib) if ib > 3 else float(max(ia, ib) % 5)) + (abs(ia) // 3) * 1000
             + ((17 // 2 + (ib > 0)) << 12) for ib in range(-8, 9)] for ia in range(-8, 9)]
    _exact(got["misc"], want, "where/max/abs/size/bool in integer arithmetic")
    _exact(got["p2"], [(ia // 4) * 10000 + (ia % 8) * 100 + (ia // -4) + (ia % 3) * 1000000 + (ia % -2) * 100000000
                       for ia in range(-8, 9)], "constant divisors")
    torch.testing.assert_close(got["s"].double(), xs.double()[:, ::3].sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sched,kw", SCHEDULES)
def test_shifts_and_index_arithmetic_in_every_schedule(sched, kw):
    x = L.tensor("x", "i j")
    i, j = L.index("i"), L.index("j")
    a, c = i - 8, j - 2                                   # counts -2..67: out of range is NaN
    # i * 16777217 is not a float32 value: only int64 arithmetic gets the parity right
    prog = L.program("int_shifts", shl=a << c, shr=a >> c, par=(i * 16777217) % 2,
                     bits=(j >> 1) & 1, q=j // 4 + (i % 3) * 100,
                     y=L.sum(L.exp(x - L.max(x, "j")) * ((j >> 1) & 1), "j"))
    k = af.compile(prog)
    xs = torch.randn(17, 70) * 3
    got = k(x=xs, schedule=sched, **kw)
    _exact(got["shl"], [[_py("<<", ii - 8, jj - 2) for jj in range(70)] for ii in range(17)], "a << c")
    _exact(got["shr"], [[_py(">>", ii - 8, jj - 2) for jj in range(70)] for ii in range(17)], "a >> c")
    _exact(got["par"], [float(ii % 2) for ii in range(17)], "(i * 16777217) % 2")
    _exact(got["bits"], [float((jj >> 1) & 1) for jj in range(70)], "(j >> 1) & 1")
    _exact(got["q"], [[float(jj // 4 + (ii % 3) * 100) for jj in range(70)] for ii in range(17)], "j // 4 + 100 (i % 3)")
    xd = xs.double()
    want = (torch.exp(xd - xd.amax(1, keepdim=True)) * ((torch.arange(70) >> 1) & 1)).sum(1)
    _close(got["y"], want, "masked sum", rtol=2e-5)


def test_integer_operators_on_rounded_values():
    """Integer operators on rounded tensors agree with torch int64; NaN/inf and out-of-range
    casts give NaN (never a wrapped value)."""
    x = L.tensor("x", "r j")
    prog = L.program("int_rounded", fd=L.floor(x) // -3, md=L.cast(x * 10, "int32") % 7,
                     rd=L.round(x) ^ 5, c64=L.cast(x * 1e9, "int64") % 1000, s=L.sum(x, "j"))
    k = af.compile(prog)
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    xs = torch.randn(5, 23, generator=g) * 30
    xs[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, 3e8])   # cast(3e9, int32) overflows
    xs[1, :4] = torch.tensor([2.5, -2.5, 0.5, -0.5])
    got = k(x=xs)
    xd = xs.double()
    fin = torch.isfinite(xd)
    z = lambda v: torch.where(fin, v, 0.0).long()   # noqa: E731
    fl = torch.where(fin, torch.div(z(torch.floor(xd)), -3, rounding_mode="floor").double(), math.nan)
    _exact(got["fd"], fl.numpy(), "floor(x) // -3")
    t = torch.trunc((xs * 10).double())   # the kernel multiplies in float32, then truncates
    ok = fin & (t.abs() < 2.0 ** 31)
    _exact(got["md"], torch.where(ok, torch.remainder(torch.where(ok, t, 0.0).long(), 7).double(), math.nan).numpy(),
           "cast(10 x, int32) % 7")
    _exact(got["rd"], torch.where(fin, (z(torch.round(xd)) ^ 5).double(), math.nan).numpy(), "round(x) ^ 5")
    t = torch.trunc((xs * 1e9).double())
    ok = torch.isfinite(t)
    _exact(got["c64"], torch.where(ok, torch.remainder(torch.where(ok, t, 0.0).long(), 1000).double(), math.nan).numpy(),
           "cast(1e9 x, int64) % 1000")


# ---- the language ------------------------------------------------------------------------------------
def test_integer_operators_refuse_real_operands_with_a_clear_error():
    x = L.tensor("x", "r j")
    with pytest.raises(LanguageError, match=r"not an integer expression.*af.floor"):
        x // 2
    with pytest.raises(LanguageError, match="not an integer expression"):
        L.index("j") % (x * 0.5)
    with pytest.raises(LanguageError, match="not an integer expression"):
        x ^ 1
    with pytest.raises(LanguageError, match="division by the constant zero"):
        L.index("j") // 0
    with pytest.raises(LanguageError, match="shift count"):
        L.index("j") << 64
    with pytest.raises(LanguageError, match="integer type must be one of"):
        L.cast(x, "uint8")


def test_and_or_not_are_logical_on_booleans_and_bitwise_on_integers():
    x, j = L.tensor("x", "r j"), L.index("j")
    assert ((x > 0) & (x < 1)).term.op == "LAnd"
    assert (~(x > 0)).term.op == "LNot"
    assert (j & 1).term.op == "BitAnd" and (j | 6).term.op == "BitOr" and (~j).term.op == "BitNot"
    assert (L.const(7) // 2).term.args[0] == 3.0 and (L.const(-7) % 3).term.args[0] == 2.0   # folded
    assert L.sigmoid(0.0).term.args[0] == 0.5 and math.isnan(L.cast(3e9, "int32").term.args[0])
    assert [round(x).term.op, math.floor(x).term.op, math.ceil(x).term.op] == ["Round", "Floor", "Ceil"]
    with pytest.raises(LanguageError, match="only rounding to an integer"):
        round(x, 2)


def test_input_and_output_with_one_name_are_refused():
    x = L.tensor("x", "r j")
    with pytest.raises(LanguageError, match=r"'x' names both an input tensor and an output.*rename"):
        L.program("clash", x=L.exp(x - L.max(x, "j")))


def test_zero_dimensional_runtime_scalar():
    x, c = L.tensor("x", "r j"), L.tensor("c", "")
    prog = L.program("scalar_in", y=L.sum(L.exp(x * c - L.max(x * c, "j")), "j") + c)
    k = af.compile(prog)
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    xs, cs = torch.randn(3, 29, generator=g), torch.tensor(1.7)
    xd = xs.double() * 1.7
    want = torch.exp(xd - xd.amax(1, keepdim=True)).sum(1) + 1.7
    for sched, kw in SCHEDULES:
        _close(k(x=xs, c=cs, schedule=sched, **kw), want, f"scalar input ({sched})", rtol=1e-5)


def test_proof_semantics_of_integer_operators():
    from acefuse.proofs.semantics import evaluate as sem, MpBackend, FloatBackend, Undefined, mp_context
    from acefuse.rewrite.terms import Term, num
    for sym, op in (("//", "FloorDiv"), ("%", "Mod"), ("&", "BitAnd"), ("|", "BitOr"), ("^", "BitXor"),
                    ("<<", "Shl"), (">>", "Shr")):
        for a in (-9, -1, 0, 5, 2 ** 40):
            for b in (-3, 0, 1, 7, 63, 64):
                want = _py(sym, a, b)
                t = Term(op, (num(a), num(b)))
                got = float(sem(t, 0, FloatBackend(), None, None))
                assert got == want or (math.isnan(got) and math.isnan(want)), (sym, a, b)
                with mp_context():
                    if math.isnan(want):
                        with pytest.raises(Undefined):
                            sem(t, 0, MpBackend(), None, None)
                    else:
                        assert float(sem(t, 0, MpBackend(), None, None)) == want


def test_function_theory_is_proved_and_a_wrong_rule_is_refuted():
    from acefuse.proofs import prove_rule
    from acefuse.rules.base import infer, tvars, inv, SELF
    from acefuse.rules.functions import THEORY
    from acefuse.rewrite.terms import Term
    assert all(prove_rule(r).status == "proved" for r in THEORY.rules)
    (a,) = tvars("a")
    wrong = infer("inv-sigmoid-unconditional", Term("Sigmoid", (a,)), inv(SELF))   # a may vary
    assert prove_rule(wrong).status == "refuted"


def test_simulated_fused_pass_evaluates_the_new_operators():
    """extract/simulate.py runs extracted forms in float32 before accepting them: it must
    evaluate the new operators (accurately, as the kernels do) and integer ones exactly."""
    from acefuse.extract.simulate import _Eval
    from acefuse.rewrite.encode import encode
    from acefuse.rewrite.terms import Term, A
    x = L.tensor("x", "r j")
    enc = encode(L.program("sim_fns", s=L.sum(L.softplus(x - L.max(x, "j")), "j")), "j")
    rng = np.random.default_rng()
    vals = rng.standard_normal((48, 15)) * np.array([1e-6, 1.0, 30.0])[rng.integers(0, 3, (48, 1))]
    ev = _Eval(enc, {"x": vals}, {}, np.float32)
    ev.blocks = {"A": np.arange(15)}
    xt, ix = torch.from_numpy(vals), np.arange(15)
    for op in FUNCS:
        with np.errstate(all="ignore"):   # log1p(x < -1) is NaN, as in torch
            got = ev.ev(Term(OP_NAMES[op], (Term("Elm", ("x",)),)), ix, None)
        assert got.dtype == np.float32
        _close(torch.from_numpy(got.astype(np.float64)), _truth(op, xt.float()), f"simulated {op}", rtol=2e-7)
    n = Term("Num", (5.0,))
    k = Term("Mod", (Term("Floor", (Term("Mul", (Term("Elm", ("x",)), Term("Num", (100.0,)))),)), n))
    want = np.mod(np.floor(vals.astype(np.float32) * np.float32(100)), 5)
    assert np.array_equal(ev.ev(k, ix, None), want.astype(np.float32))
    s = ev.state("s", A)   # the state's definition over the whole row, with the new operator inside
    xd = torch.from_numpy(vals)
    ref = torch.logaddexp(torch.zeros_like(xd), xd - xd.amax(1, keepdim=True)).sum(1)
    _close(torch.from_numpy(s.astype(np.float64)), ref, "simulated state", rtol=1e-5)
