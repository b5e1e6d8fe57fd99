"""Gradient mode of the fuzzer: the fuzzer's random programs through ``af.backward``.

    python -m acefuse.fuzz --backward --programs 20 --seed 1
    acefuse fuzz --backward --minutes 5
    res = acefuse.fuzz_backward.run(n_programs=10, seed=1); res.failures

For each generated program (acefuse/fuzz_gen.py, the forward fuzzer's generator, same
seeds), ``af.backward(prog)`` is derived and ``af.compile(prog)`` (a differentiable kernel:
augmented forward + the backward program's kernels) is run forward and backward under
every schedule (``single``, ``loop``, ``split``; ``block_j=16``, ``nsplit=3``) with random
cotangents ``grad_<output>`` ~ N(0, 1). Each ``grad_<input>`` is compared with float64
torch autograd of the fuzzer's own reference (``fuzz_ref.reference(..., grad=True)``: plain
torch on the program's node tree, nothing of acefuse). The forward outputs of the
augmented kernel are checked with the forward oracle (``fuzz.check_output``) on the way.

**Inputs** (``make_grad_inputs``): finite, moderate values (N(0, 1), N(0, 9) or 4 + N(0, 1))
in float32 (and, in the long profile, float16/bfloat16 drawn in that type), no infinite
entries. A program's index masks (``where(index(j) < k, e, -inf)``) stay: a masked entry
has gradient 0 in both; a *fully* masked row is reported by the reference with a
non-finite gradient or by the conventions (the backward's gradient there is 0, see
acefuse/backward.py), and such entries are skipped as not comparable when torch's
gradient is not finite.

**Not comparable** (counted, not checked): entries whose float64 reference gradient is
NaN or +-inf; and rows where the program is not differentiable at the sample or within
float32's rounding of such a point: a comparison (``where``), ``maximum``, ``abs`` or a
max/min over ``j`` whose two sides (its runner-up) are within the forward oracle's error
bound of each other but not equal (``info["amb"]`` of the reference; for a max/min, the sum
of the two candidates' bounds, C_A u32 times their running error bounds). A runner-up
further away is compared however near: the backward gives the adjoint to the element whose
recomputed body equals the saved extremum bit for bit, as torch does (``near_tie_compared``
counts the entries of rows with one within the backward's fallback window EXT_REL).
Inputs are drawn from continuous distributions, so exact ties of a max have probability 0 in float32
(in float16/bfloat16 they do happen: both torch and acefuse then share the adjoint
equally, ``adj / count``, and the comparison stands). A row's gradient of ``w`` over
``"j"`` (summed over rows) is not comparable when any row is.

**Oracle** (``check_grad``), per gradient entry with float64 reference ``g64``, float32
torch autograd of the same reference ``g32``, ``gmc`` the largest deviation of four Monte
Carlo float32 emulations of it (``fuzz_ref._Jiggle``), ``gabs`` the absolute sensitivity
(``abs_sensitivity``) and ``s`` the largest ``|g64|`` of the row (of the whole tensor for
``w`` over ``"j"``):

    |got - g64| <= RTOL |g64| + STOL s + 16 max_row |g32 - g64| + 16 max_row gmc
                   + 16 u32 gabs + (the spacing of the input type's subnormals)

(RTOL, STOL) = (1e-4, 1e-5) for float32, (2e-3, 1e-3) float16, (1.6e-2, 4e-3) bfloat16,
as tests/test_grad_props.py. The float32 term is what float32 evaluation of the program as
written loses (cancellation, a variance of offset rows), the ``gabs`` term what a backward
of another form loses (each of its terms rounded once). NaN or inf where the reference is
finite is ``nonfinite-where-finite``; otherwise ``wrong-grad``.

**Refused**: ``af.backward`` raising a ``BackwardError`` (a ``LanguageError``) or the
backward kernels not compiling with an acefuse refusal (``FuseError``, ``CodegenError``)
whose message does not say "this is a bug"; the reason is kept (``Result.refusals``).
Anything else, including a silent fallback to torch autograd that hides a crash of the
backward kernels, is a ``crash:<Type>``.
"""
from __future__ import annotations

import random
import time
import warnings
from dataclasses import dataclass, field

import torch

import acefuse as af
from acefuse.fuzz import (Failure, Result, _choose, _is_refusal, _crash_class, _short_tb, _time_limit,
                          check_output, _inf_rows, COMPILE_TIMEOUT)
from acefuse.fuzz_gen import Gen, program_text
from acefuse.fuzz_ref import DTYPES, SCHEDULES, BLOCK_J, NSPLIT, U32, reference, _uses

GRAD_TOL = {"float32": (1e-4, 1e-5), "float16": (2e-3, 1e-3), "bfloat16": (1.6e-2, 4e-3)}
K32 = 16.0      # times float32 autograd's own error
KMC = 16.0      # times the largest deviation of N_MC Monte Carlo float32 emulations (fuzz_ref._Jiggle)
N_MC = 4
KABS = 16.0     # times u32 times the absolute sensitivity (abs_sensitivity)
# af.backward + the forward, augmented forward and backward stages' kernels: several compiles
# (about 25 s for a layernorm-like program on an idle CPU)
GRAD_COMPILE_TIMEOUT = 3 * COMPILE_TIMEOUT
GRAD_KINDS = ("normal", "wide", "offset")
PROFILES = {"short": dict(depth=2, n_inputs=1, dtypes=(("float32", 1.0),)),
            "long": dict(depth=3, n_inputs=2, dtypes=(("float32", 0.8), ("float16", 0.1), ("bfloat16", 0.1)))}


@dataclass
class GradResult(Result):
    grad_checks: int = 0          # gradient tensors compared (per case, schedule and input)
    not_comparable: int = 0       # gradient entries skipped (see the module docstring)
    compared: int = 0             # gradient entries compared
    refusals: dict = field(default_factory=dict)   # reason (first line) -> count
    worst: float = 0.0            # the largest error / tolerance of a passing comparison
    near_tie_skipped: int = 0     # entries not comparable for a max/min near tie float32 cannot separate
    near_tie_compared: int = 0    # entries compared on rows with a separable runner-up within the
                                  # backward's fallback window (EXT_REL) of a computed extremum

    def summary(self) -> str:
        L = [f"programs {self.programs} (not fusible: {self.unfusible}), kernel runs {self.kernel_runs}, "
             f"gradient checks {self.grad_checks}, wrong results {self.wrong}, crashes {self.crashes}, "
             f"refused {self.refused}, entries compared {self.compared}, not comparable {self.not_comparable}, "
             f"worst error/tolerance {self.worst:.3g}, near ties: {self.near_tie_skipped} entries not "
             f"comparable, {self.near_tie_compared} compared within EXT_REL"]
        for k, v in sorted(self.by_class.items()):
            L.append(f"  {k}: {v}")
        for k, v in sorted(self.refusals.items(), key=lambda kv: -kv[1]):
            L.append(f"  refused ({v}): {k}")
        return "\n".join(L)


def make_grad_inputs(kind: str, R: int, J: int, dtype: str, seed: int, w_axes=None) -> dict:
    """Finite moderate inputs, reproducible from the arguments (continuous: no ties in float32)."""
    g = torch.Generator().manual_seed(seed)

    def draw(shape):
        z = torch.randn(shape, generator=g, dtype=torch.float64)
        return {"normal": z, "wide": 3 * z, "offset": 4 + z}[kind]

    out = {"x": draw((R, J)).to(DTYPES[dtype])}
    if w_axes:
        out["w"] = draw((R, J) if w_axes == "rj" else (J,)).to(DTYPES[dtype])
    return out


def reference_grads(outputs: dict, inputs: dict, cots: dict, dtype, jiggle=None) -> dict:
    """{input: torch autograd gradient of the fuzzer's reference computed in ``dtype``}
    (``jiggle``: a torch.Generator, float32's roundings emulated at random, fuzz_ref._Jiggle)."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
    outs = reference(outputs, leaves, dtype, grad=True, jiggle=jiggle)
    pairs = [(outs[o][0], cots[o].to(dtype)) for o in outputs if outs[o][0].requires_grad]
    names = list(leaves)
    if not pairs:
        return {k: torch.zeros_like(v) for k, v in leaves.items()}
    got = torch.autograd.grad([p for p, _ in pairs], [leaves[k] for k in names], [c for _, c in pairs],
                              allow_unused=True)
    return {k: torch.zeros_like(leaves[k]) if gk is None else gk.detach() for k, gk in zip(names, got)}


def _coef(c):
    return torch.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0)


def abs_sensitivity(outputs: dict, inputs: dict, cots: dict) -> dict:
    """{input: |cot| propagated back through the *absolute values* of every local derivative}
    (float64): the magnitude of the terms a gradient is a sum of, whatever order the backward
    adds them in. A kernel's backward rounds each term (a softmax's ``p (g - sum_j p g)``
    cancels ``g`` against ``sum_j p g``): its error is a few ``u32`` times this, where the
    gradient itself may be 0. Computed by autograd of a surrogate that is linear in the
    inputs with those absolute derivatives as coefficients (fixed at the sample)."""
    from acefuse.fuzz_ref import _Ctx, _evaluate, _kid_pols, _row_only
    leaves = {k: v.detach().to(torch.float64).requires_grad_() for k, v in inputs.items()}
    with torch.no_grad():
        ctx = _Ctx({k: v.detach() for k, v in leaves.items()}, torch.float64, False)
    memo: dict = {}

    def val(n, pol):
        with torch.no_grad():
            return _evaluate(n, ctx, pol)[0]

    def sur(n, pol=None):
        key = (n.uid, pol)
        if key in memo:
            return memo[key]
        r = _sur(n, pol)
        if r is not None and pol is not None and (pol == "-" and _row_only(n) or pol == "+" and n.op == "min"):
            v = val(n, None)
            r = torch.where(torch.isinf(v), torch.zeros_like(r), r)   # the empty-extremum convention
        memo[key] = r
        return r

    def _sur(n, pol):
        op = n.op
        if op == "in":
            t = leaves[n.arg]
            return t if t.dim() == 2 else t[None, :]
        if op in ("const", "index", "size"):
            return None
        pols = _kid_pols(n, pol)
        ks = [sur(k, p) for k, p in zip(n.kids, pols)]
        vs = [val(k, p) for k, p in zip(n.kids, pols)]
        v = val(n, pol)

        def lin(*pairs):
            out = None
            for c, t in pairs:
                if t is None:
                    continue
                term = _coef(c) * t
                out = term if out is None else out + term
            return out
        if op in ("add", "sub"):
            return lin((torch.ones(()), ks[0]), (torch.ones(()), ks[1]))
        if op == "mul":
            return lin((vs[1].abs(), ks[0]), (vs[0].abs(), ks[1]))
        if op == "div":
            return lin(((1 / vs[1]).abs(), ks[0]), ((vs[0] / vs[1] ** 2).abs(), ks[1]))
        if op in ("neg", "abs"):
            return ks[0]
        if op == "exp":
            return lin((v, ks[0]))
        if op == "log":
            return lin(((1 / vs[0]).abs(), ks[0]))
        if op == "sqrt":
            return lin((1 / (2 * v), ks[0]))
        if op == "pow":
            return lin(((n.arg * vs[0] ** (n.arg - 1)).abs(), ks[0]))
        if op == "tanh":
            return lin((1 - v * v, ks[0]))
        if op == "max2":
            a, b = vs
            w = torch.where(a > b, 1.0, torch.where(a < b, 0.0, 0.5)).to(torch.float64)
            return lin((w, ks[0]), (1 - w, ks[1]))
        if op == "where":
            c = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge}[n.arg](vs[0], vs[1]).to(torch.float64)
            return lin((c, ks[2]), (1 - c, ks[3]))
        if op in ("sum", "max", "min"):
            if ks[0] is None:
                return None
            x = vs[0]
            if op == "sum":
                w = torch.ones_like(x)
            else:
                hit = (x == v).to(torch.float64)
                w = hit / hit.sum(dim=1, keepdim=True).clamp_min(1)
            return (_coef(w) * ks[0]).sum(dim=1, keepdim=True)
        raise AssertionError(f"abs_sensitivity: unknown node {op}")

    with torch.enable_grad():
        total = None
        for o, nd in outputs.items():
            s_o = sur(nd)
            if s_o is None:
                continue
            c = cots[o].to(torch.float64).abs()
            c = c if nd.shape == "rj" else c[:, None]
            term = (c * s_o.expand(c.shape[0], s_o.shape[1]) if nd.shape == "rj" else c * s_o).sum()
            total = term if total is None else total + term
        if total is None or not total.requires_grad:
            return {k: torch.zeros_like(v) for k, v in leaves.items()}
        got = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    return {k: torch.zeros_like(leaves[k]) if g is None else g.detach() for k, g in zip(leaves, got)}


@dataclass
class GradVerdict:
    ok: bool
    cls: str = ""
    detail: str = ""
    skipped: int = 0
    worst: float = 0.0
    compared: int = 0


def check_grad(got, g64, g32, dtype: str, amb_rows=None, dmc=None, gabs=None) -> GradVerdict:
    """Compare a kernel gradient with float64 autograd (see the module docstring). ``dmc``: the
    largest deviation from ``g64`` of the Monte Carlo float32 emulations. ``amb_rows``:
    [R] bool, rows not comparable (near a non-differentiable point); for a 1-d gradient (``w``
    over ``"j"``, summed over rows) any such row makes the whole tensor not comparable."""
    got = got.detach().to(torch.float64).cpu()
    if got.shape != g64.shape:
        return GradVerdict(False, "wrong-shape", f"shape {tuple(got.shape)}, expected {tuple(g64.shape)}")
    rtol, stol = GRAD_TOL[dtype]
    rows = g64 if g64.dim() == 2 else g64[None, :]
    gr, r32 = (got, g32.to(torch.float64)) if g64.dim() == 2 else (got[None, :], g32.to(torch.float64)[None, :])
    fin = torch.isfinite(rows)
    comparable = fin.clone()
    if amb_rows is not None:
        amb = amb_rows.to(torch.bool)
        comparable &= ~(amb[:, None] if g64.dim() == 2 else amb.any().reshape(1, 1))
    z = torch.zeros_like(rows)
    scale = torch.where(fin, rows.abs(), z).amax(dim=1, keepdim=True)
    d32 = torch.where(fin & torch.isfinite(r32), (r32 - rows).abs(), z).amax(dim=1, keepdim=True)
    fi = torch.finfo(DTYPES[dtype])   # the gradient is stored in the input's type: its subnormal
    tol = rtol * rows.abs() + stol * scale + K32 * d32 + fi.tiny * fi.eps + 1e-30   # spacing
    if gabs is not None:
        ga = gabs.to(torch.float64) if g64.dim() == 2 else gabs.to(torch.float64)[None, :]
        tol = tol + KABS * U32 * torch.where(torch.isfinite(ga), ga, z)
    if dmc is not None:
        dm = dmc.to(torch.float64) if g64.dim() == 2 else dmc.to(torch.float64)[None, :]
        tol = tol + KMC * torch.where(fin & torch.isfinite(dm), dm, z).amax(dim=1, keepdim=True)
    # the gradient is stored in the input's type: an entry past its largest finite value (a float16
    # gradient of -68041) overflows as written, in torch as here; not comparable
    comparable &= ~(fin & (rows.abs() - tol > fi.max))
    nonfin = comparable & ~torch.isfinite(gr)
    err = torch.where(comparable & torch.isfinite(gr), (gr - rows).abs(), z)
    wrong = comparable & torch.isfinite(gr) & (err > tol)
    skipped = int((~comparable).sum())
    bad = nonfin | wrong
    worst = float((err / tol).max()) if err.numel() else 0.0
    if not bad.any():
        return GradVerdict(True, skipped=skipped, worst=worst, compared=int(comparable.sum()))
    cls = "nonfinite-where-finite" if nonfin.any() else "wrong-grad"
    idx = tuple(int(i) for i in bad.nonzero()[0])
    at = idx if g64.dim() == 2 else idx[1:]
    detail = (f"at {at}: kernel {float(gr[idx])!r}, float64 autograd {float(rows[idx])!r}, float32 autograd "
              f"{float(r32[idx])!r}, tolerance {float(tol[idx]):.3g}; {int(bad.sum())} of {int(comparable.sum())} "
              f"comparable entries wrong")
    return GradVerdict(False, cls, detail, skipped, worst, int(comparable.sum()))


def _row_entries(g, rows) -> int:
    """Gradient entries of ``g`` in ``rows`` ([R] bool; a 1-d gradient summed over rows: all
    of its entries as soon as one row is)."""
    if g.dim() == 2:
        return int(rows.sum()) * g.shape[1]
    return g.numel() if bool(rows.any()) else 0


def _backward_refusal(exc) -> str | None:
    """The reason, when ``exc`` (from af.backward or the backward kernels' compile) is an
    acefuse refusal that says why; None when it is a crash."""
    from acefuse.backward import BackwardError
    msg = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, BackwardError) and not any(b in str(exc) for b in ("this is a bug", "an acefuse bug")):
        return f"{type(exc).__name__}: {msg}" if msg else None
    if _is_refusal(exc) and msg:
        return f"{type(exc).__name__}: {msg}"
    return None


def _refuse(res: GradResult, why: str, log):
    res.refused += 1
    res.by_class["refused"] = res.by_class.get("refused", 0) + 1
    key = why[:160]
    res.refusals[key] = res.refusals.get(key, 0) + 1
    log(f"  refused: {why[:200]}")


def _grad_kernel(prog, compile_fn=None, compile_timeout=GRAD_COMPILE_TIMEOUT):
    """af.compile(prog) with its gradient kernels built now; an exception if they cannot be
    (GradientFallbackWarning turned into the error that caused it)."""
    from acefuse.autograd import GradientFallbackWarning
    with warnings.catch_warnings(), _time_limit(compile_timeout):
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", GradientFallbackWarning)
        dk = (compile_fn or af.compile)(prog)
        try:
            dk._grad_kernels()
        except GradientFallbackWarning as w:
            raise (w.__context__ or w)
    return dk


def run_grad_program(outputs: dict, w_axes, cases: list, res: GradResult, log=print, name="fzb",
                     compile_fn=None, wrap=None, compile_timeout=GRAD_COMPILE_TIMEOUT, schedules=SCHEDULES):
    """Derive, compile and check the gradients of one program pair on every case (a list of
    ``make_grad_inputs`` keyword dicts) and schedule. ``compile_fn`` replaces ``af.compile``;
    ``wrap(tensor) -> tensor`` is applied to each input leaf before the kernel (the tests
    pass a deliberately wrong gradient through it to show the oracle fails it)."""
    from acefuse.autograd import GradientFallbackWarning
    text = program_text(outputs, w_axes, name)
    prog = af.program(name, **{k: v.af for k, v in outputs.items()})
    res.programs += 1

    def fail(f: Failure):
        res.record(f, log)

    case0 = f"make_grad_inputs(**{cases[0]!r})" if cases else ""
    try:
        with _time_limit(compile_timeout):
            af.backward(prog)
    except Exception as exc:  # noqa: BLE001 - every exception is classified
        why = _backward_refusal(exc)
        if why:
            return _refuse(res, why, log)
        return fail(Failure(_crash_class(exc), "backward", text, case0, detail=_short_tb(exc)))
    try:
        dk = _grad_kernel(prog, compile_fn, compile_timeout)
    except Exception as exc:  # noqa: BLE001
        why = _backward_refusal(exc)
        if why:
            return _refuse(res, why, log)
        return fail(Failure(_crash_class(exc), "compile", text, case0, detail=_short_tb(exc)))
    if not getattr(dk, "fusible", True):
        res.unfusible += 1
    names = list(outputs)
    for case in cases:
        inputs = make_grad_inputs(**case)
        dt = case["dtype"]
        exact = {n: t.to(torch.float64) for n, t in inputs.items()}
        info = {}
        r64 = reference(outputs, exact, torch.float64, track=True, info=info)
        r32 = reference(outputs, exact, torch.float32)
        cg = torch.Generator().manual_seed(case["seed"] + 1)
        # the cotangents the kernel is given are rounded to its output type (the input type):
        # the references start from those same rounded values (an H100 run of the long profile
        # reported bfloat16 gradients "wrong" by 10% where the unrounded cotangents cancelled)
        ct = DTYPES[dt] if isinstance(dt, str) else dt
        cots = {o: torch.randn(tuple(r64[o][0].shape), generator=cg, dtype=torch.float64).to(ct).to(torch.float64)
                for o in names}
        g64 = reference_grads(outputs, exact, cots, torch.float64)
        g32 = reference_grads(outputs, exact, cots, torch.float32)
        gabs = abs_sensitivity(outputs, exact, cots)
        jg = torch.Generator().manual_seed(case["seed"] + 2)
        dmc = {n: torch.zeros_like(g) for n, g in g64.items()}
        for _ in range(N_MC):
            gm = reference_grads(outputs, exact, cots, torch.float64, jiggle=jg)
            for n in dmc:
                dmc[n] = torch.maximum(dmc[n], torch.nan_to_num((gm[n] - g64[n]).abs(), nan=0.0, posinf=0.0))
        amb = info["amb"]
        inf_rows, loose = _inf_rows(exact) | info["inf_sel"], info["loose"]
        for sched in schedules:
            leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    warnings.simplefilter("error", GradientFallbackWarning)
                    args = {n: (wrap(t) if wrap else t) for n, t in leaves.items()}
                    out = dk(**args, schedule=sched, block_j=BLOCK_J, nsplit=NSPLIT)
                    out = out if isinstance(out, dict) else {names[0]: out}
                    pairs = [(out[o], cots[o].to(device=out[o].device, dtype=out[o].dtype)) for o in names]
                    got = torch.autograd.grad([p for p, _ in pairs], [leaves[n] for n in leaves],
                                              [c for _, c in pairs], allow_unused=True)
            except Exception as exc:  # noqa: BLE001
                if sched == "split" and isinstance(exc, ValueError) and "has no split schedule" in str(exc):
                    continue   # the forward fuzzer's rule: a fusion without a merge has no split
                cause = exc.__context__ if isinstance(exc, GradientFallbackWarning) and exc.__context__ else exc
                fail(Failure(_crash_class(cause), "run", text, f"make_grad_inputs(**{case!r})", sched,
                             detail=_short_tb(cause)))
                continue
            res.kernel_runs += 1
            for o in names:   # the augmented forward's outputs, with the forward oracle
                rows = (lambda m: m if outputs[o].shape != "rj" else m[:, None])
                v = check_output(out[o].detach(), r64[o][0], r32[o][0], r64[o][1], DTYPES[dt],
                                 rows(inf_rows), rows(loose))
                if not v.ok:
                    fail(Failure(v.cls, "forward", text, f"make_grad_inputs(**{case!r})", sched, o, v.detail))
            for n, gk in zip(leaves, got):
                res.grad_checks += 1
                gk = torch.zeros_like(leaves[n]) if gk is None else gk
                v = check_grad(gk, g64[n], g32[n], dt, amb, dmc[n], gabs[n])
                res.not_comparable += v.skipped
                res.near_tie_skipped += _row_entries(g64[n], info["tie"])
                res.near_tie_compared += _row_entries(g64[n], info["tie_kept"])
                res.compared += v.compared
                if v.ok:
                    res.worst = max(res.worst, v.worst)
                if not v.ok:
                    fail(Failure(v.cls, "backward", text, f"make_grad_inputs(**{case!r})", sched,
                                 f"grad_{n}", v.detail, getattr(dk, "fusible", None)))


def make_grad_cases(prng, prof, used_w) -> list:
    return [dict(kind=prng.choice(GRAD_KINDS), R=prng.randint(1, 4),
                 J=prng.choice([1, 7, 16, 17, 33, 50, 64]), dtype=_choose(prng, prof["dtypes"]),
                 seed=prng.randrange(2 ** 31), w_axes=used_w) for _ in range(prof["n_inputs"])]


def run(n_programs: int | None = None, seed: int = 0, profile: str = "short", minutes: float | None = None,
        log=None, depth=None, device: str = "cpu") -> GradResult:
    """Check the gradients of ``n_programs`` random programs (or for ``minutes``); the same
    program sequence as ``acefuse.fuzz.run`` with the same seed and depth."""
    import acefuse.fuzz as fz
    fz.DEVICE = device
    log = log or (lambda *a: None)
    prof = PROFILES[profile]
    depth = depth or prof["depth"]
    rng = random.Random(seed)
    res = GradResult()
    t0 = time.time()
    i = 0
    while (n_programs is None or i < n_programs) and (minutes is None or time.time() - t0 <= minutes * 60) \
            and not (n_programs is None and minutes is None):
        pseed = rng.randrange(2 ** 31)
        prng = random.Random(pseed)
        w_axes = prng.choice([None, None, "j", "rj"])
        outputs = Gen(prng, w_axes).program(depth=prng.choice(range(1, depth + 1)))
        if not outputs:
            continue
        used_w = w_axes if any(_uses(nd, "w") for nd in outputs.values()) else None
        cases = make_grad_cases(prng, prof, used_w)
        log(f"[{i}] seed {pseed} ({time.time() - t0:.0f}s): {', '.join(f'{k}: {v.shape}' for k, v in outputs.items())}")
        run_grad_program(outputs, used_w, cases, res, log=log, name=f"fzb{i}",
                         wrap=(lambda t: t.to(device)) if device != "cpu" else None)
        i += 1
    return res
