"""The project's own fuzzer: random cascaded programs, adversarial inputs, an
independent float64 reference, every schedule.

    python -m acefuse.fuzz --minutes 5 --seed 1 --profile short
    res = acefuse.fuzz.run(n_programs=10, seed=1); res.failures
    python -m acefuse.fuzz --backward --programs 20    # gradients: acefuse/fuzz_backward.py

**Generator.** A seeded generator builds each random program as a *pair*: the acefuse
expression (``import acefuse as af``) and a node tree that this module evaluates
directly with torch (``_evaluate``). The reference never calls ``acefuse.reference``
nor anything of acefuse's fusion (no terms, rules, states, codegen): it is plain torch
on the node tree, built by the same generator call that built the acefuse expression.
Programs are cascaded over the fused axis ``j`` (rows ``r``): shifts by a max
(``exp(e - max_j e)``), normalisation by sums, centred moments (``(e - mean_j e)**2``,
``**3``, ``**4``), ``abs``, ``tanh``, ``sqrt``, ``log``, comparisons against reductions
(``where(e > mean_j e, e, 0)``), index masks (``where(index(j) < k, e, -inf)``), a
second input over ``"j"`` or ``"r j"``, one to three outputs (per row and elementwise).

What the generator avoids, so that every program's true value is well defined and
float32 can compute it *as written* (tracked with interval bounds over finite inputs of
magnitude <= ``BOUND``):
  * ``exp`` of an argument not bounded above by 60 (only shifted ``e - max_j e``,
    ``min_j e - e``, ``-abs``, ``tanh``, small multiples of the index ...);
  * ``log`` of an argument not bounded below by a positive number, ``sqrt`` of an
    argument that may be negative (variances are used as ``sqrt(var + 1e-5)``);
  * division by something that may be 0, except a sum of shifted exponentials, which is
    0 only on a fully masked row (then the numerator vanishes too: convention 0/0 -> 0);
  * any intermediate whose bound exceeds 1e30 (float32 overflow as written);
  * masked values (-inf from an index mask) anywhere but in a max reduction or a shift
    ``e - max_j e`` (so ``-inf - -inf`` is only reached through the convention).
Adversarial *inputs* (+-inf entries, fully masked rows) may still make an output NaN or
inf; the reference then follows IEEE (torch) and the conventions below.

**Numerics conventions** (README "Numerics conventions"; kept in one place, the block
after the constants in acefuse/fuzz_ref.py: ``_kid_pols``, ``_row_only``, ``_shift_conv``, ``_div_red``):
IEEE/torch semantics everywhere, except
  * inside a difference every operand has a sign, followed through ``+``, ``-``, unary
    minus and products with a constant; a max over ``j`` that is -inf, and any per-row
    value built only from reductions that is -inf (logsumexp or mean of a fully masked
    row), reads as 0 where it is subtracted; a min over ``j`` that is +inf reads as 0
    where it is added inside a difference;
  * a division whose denominator is computed from a reduction gives 0 when numerator
    and denominator are both exactly 0;
  * where the program as written reaches NaN only through an infinite input (a row
    whose inputs hold an infinity), the fused form may give any value: rewrites are
    proved over the reals (``sum_j(x - mean_j x) = 0``, ``max_j(x + c) = max_j(x) + c``),
    so the oracle accepts NaN, +-inf or a number there; and on such a row, once the
    program as written reads a sum over ``j`` that is +-inf or NaN (an infinity summed
    in, then used further: ``max_j(x + s) = max_j(x) + s`` leaves ``s - s``), every
    output of the row may take any value. A row where a ``where`` selects an infinite
    constant (a -inf mask) counts as a row whose inputs hold an infinity. A finite true
    value on a row without infinities is never excused.
So softmax of a fully -inf row is 0, its logsumexp -inf; a row holding +inf gives NaN.

**Oracle** (``check_output``). The reference runs in float64 on the input *as rounded*
to the kernel's dtype, and again in float32 (same formula, unfused). Where the float64
value is NaN, only NaN is accepted; where it is +-inf, the same inf; where it is
finite, NaN/inf is always wrong (unless float32 itself cannot compute the program as
written there, i.e. the float32 reference overflows: those elements are skipped and
counted, or the value overflows the output dtype, or comes within the tolerance below of
overflowing it: then the same inf is accepted).
Otherwise ``|kernel - ref64| <= tol`` with

    tol = 4 |ref32 - ref64| + 16 u32 a + 2 u_out |ref64| + tiny_out

``u32`` is float32's unit roundoff (kernels accumulate in float32), ``u_out`` the
output dtype's (outputs are stored in the input dtype), ``tiny_out`` its smallest
normal number. ``a`` is a running error bound propagated through the program as
written (float64, alongside the value): the magnitude of every rounding that float32
evaluation of the program incurs, times the sensitivity of the output to it
(``a(x+y) = a(x) + a(y) + |x+y|``, ``a(xy) = a(x)|y| + a(y)|x| + 16 u32 a(x)a(y) + |xy|``,
a sum adds its terms' bounds and magnitudes; for exp, log, sqrt, powers and division the
whole perturbation, not only its first order). It covers the cancellation that the program as
written suffers anyway (a variance of rows offset by 1e4) and nothing more: a kernel
that rewrites into a form that cancels worse (``E[x^2] - E[x]^2``) is flagged. At a
comparison whose sides are within their error bounds of each other, either branch is
accepted (``a`` grows by the difference of the branches).

**Crashes** are failures: any exception from ``af.fuse``/``af.compile``/the kernel,
except an acefuse error that clearly refuses an unsupported program (counted as
``refused``); an error whose message says "this is a bug" is always a failure. The
launcher's ``has no split schedule`` is expected when the fusion has no merge.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

import acefuse as af

from acefuse.fuzz_ref import *  # noqa: F401,F403 - re-exported: the node constructors, reference, constants
from acefuse.fuzz_gen import *  # noqa: F401,F403 - re-exported: Gen, program_text, make_inputs, KINDS
from acefuse.fuzz_ref import _uses

# ---- oracle --------------------------------------------------------------------------------------
@dataclass
class Verdict:
    ok: bool
    cls: str = ""
    detail: str = ""
    skipped: int = 0
    worst: float = 0.0


def check_output(got, ref64, ref32, bound, dtype, inf_input=None, loose=None) -> Verdict:
    """Compare a kernel output with the reference (see the module docstring for the rules).
    ``inf_input``: where (broadcast to the output) the inputs hold an infinity; there a
    NaN of the reference may come out as any value (documented convention). ``loose``
    (broadcast likewise): where the inputs hold an infinity and the program as written
    reads a sum that is +-inf or NaN, or adds a max or min that is +-inf to values over j;
    there any value is accepted (documented convention: real-algebra rewrites move such a
    value across shifts and maxima and cancel it). Likewise where the
    inputs hold an infinity and the float64 reference is an infinity the float32 one does
    not reproduce (an infinite input times rounding noise: ``(x + w) * sum_j(w - mean_j w)``)."""
    got = got.detach().to(torch.float64).cpu()
    if got.shape != ref64.shape:
        return Verdict(False, "wrong-shape", f"shape {tuple(got.shape)}, expected {tuple(ref64.shape)}")
    fi = torch.finfo(dtype)
    u_out = fi.eps / 2
    nan_ref, inf_ref, fin_ref = torch.isnan(ref64), torch.isinf(ref64), torch.isfinite(ref64)
    bad = torch.zeros_like(ref64, dtype=torch.bool)
    cls = ""

    def first(mask, name):
        nonlocal cls
        if mask.any() and not cls:
            cls = name
        return mask

    nan_ok = torch.isnan(got)
    if inf_input is not None:
        nan_ok = nan_ok | torch.as_tensor(inf_input).expand_as(ref64)
    free = torch.zeros_like(ref64, dtype=torch.bool)
    if loose is not None:
        free = torch.as_tensor(loose).expand_as(ref64)
        if inf_input is not None:
            free = free & torch.as_tensor(inf_input).expand_as(ref64)
    if inf_input is not None:
        # an infinity whose sign (or whose being infinite) float64 and float32 evaluation of
        # the program as written do not agree on is rounding noise times an infinite input
        # (inf * (s - s)): on such a row any value is accepted
        free = free | (torch.as_tensor(inf_input).expand_as(ref64) & torch.isinf(ref64)
                       & (ref32.to(torch.float64) != ref64))
    nan_ok = nan_ok | free
    bad |= first(nan_ref & ~nan_ok, "not-nan-where-nan")
    bad |= first(inf_ref & (got != ref64) & ~free, "wrong-inf")
    r32_ok = torch.isfinite(ref32)
    d32 = torch.where(r32_ok, (ref32.to(torch.float64) - ref64).abs(), torch.zeros_like(ref64))
    tol = 4 * d32 + C_A * U32 * bound + 2 * u_out * ref64.abs() + fi.tiny
    # the value, or a value within the tolerance of it, overflows the output dtype (float16
    # near 65504: float32 error of the program as written decides whether it rounds to inf)
    overflow_out = fin_ref & (ref64.abs() + tol > fi.max)
    skip = fin_ref & ~r32_ok
    live = fin_ref & r32_ok & ~free
    ovf_ok = overflow_out & torch.isinf(got) & (torch.sign(got) == torch.sign(ref64))
    bad |= first(live & ~torch.isfinite(got) & ~ovf_ok, "nonfinite-where-finite")
    err = torch.where(live & torch.isfinite(got), (got - ref64).abs(), torch.zeros_like(ref64))
    bad |= first(live & torch.isfinite(got) & ~ovf_ok & (err > tol), "wrong-value")
    ratio = float((err / tol).max()) if err.numel() else 0.0
    if not bad.any():
        return Verdict(True, skipped=int(skip.sum()), worst=ratio)
    idx = tuple(int(i) for i in bad.nonzero()[0])
    detail = (f"at {idx}: kernel {float(got[idx])!r}, float64 reference {float(ref64[idx])!r}, "
              f"float32 reference {float(ref32[idx])!r}, tolerance {float(tol[idx]):.3g}; "
              f"{int(bad.sum())} of {bad.numel()} elements wrong")
    return Verdict(False, cls, detail, int(skip.sum()), ratio)


# ---- running ------------------------------------------------------------------------------------
@dataclass
class Failure:
    cls: str                 # crash:<Type> | wrong-value | nonfinite-where-finite | not-nan-where-nan | wrong-inf
    stage: str               # fuse | compile | run
    program: str             # Python source that rebuilds the program
    inputs: str              # make_inputs(...) call
    schedule: str = ""
    output: str = ""
    detail: str = ""
    fusible: object = None

    def reproducer(self) -> str:
        call = (f"k = af.compile(prog)\nout = k(**inputs, schedule={self.schedule!r}, block_j={BLOCK_J}, "
                f"nsplit={NSPLIT})" if self.schedule else "k = af.compile(prog)")
        imp = "from acefuse.fuzz import make_inputs"
        if self.inputs.startswith("make_grad_inputs"):   # the gradient mode (acefuse/fuzz_backward.py)
            imp = "from acefuse.fuzz_backward import make_grad_inputs"
            if self.schedule:
                call = ("k = af.compile(prog)\nleaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}\n"
                        f"out = k(**leaves, schedule={self.schedule!r}, block_j={BLOCK_J}, nsplit={NSPLIT})\n"
                        "# then torch.autograd.grad(outputs, leaves, cotangents) against float64 autograd of the "
                        "math (the fuzzer's cotangents: torch.randn(..., generator=torch.Generator()"
                        ".manual_seed(seed + 1), dtype=torch.float64) per output in order)")
        return (f"# {self.cls} ({self.stage}){' output ' + self.output if self.output else ''}: {self.detail}\n"
                f"{self.program}\n{imp}\ninputs = {self.inputs}\n{call}")


@dataclass
class Result:
    programs: int = 0
    kernel_runs: int = 0
    wrong: int = 0
    crashes: int = 0
    refused: int = 0
    skipped_elements: int = 0
    unfusible: int = 0
    by_class: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def record(self, f, log=print):
        """Count and log one failure (a crash class or a wrong result)."""
        self.failures.append(f)
        self.by_class[f.cls] = self.by_class.get(f.cls, 0) + 1
        if f.cls.startswith("crash"):
            self.crashes += 1
        else:
            self.wrong += 1
        log(f"  FAIL {f.cls} [{f.stage}{' ' + f.schedule if f.schedule else ''}"
            f"{' ' + f.output if f.output else ''}] {f.detail[:300]}")

    def summary(self) -> str:
        L = [f"programs {self.programs} (not fusible: {self.unfusible}), kernel runs {self.kernel_runs}, "
             f"wrong results {self.wrong}, crashes {self.crashes}, refused {self.refused}, "
             f"elements skipped (float32 overflows as written) {self.skipped_elements}"]
        for k, v in sorted(self.by_class.items()):
            L.append(f"  {k}: {v}")
        return "\n".join(L)


PROFILES = {"short": dict(depth=2, n_inputs=3, dtypes=(("float32", 0.7), ("float16", 0.15), ("bfloat16", 0.15))),
            "long": dict(depth=3, n_inputs=6, dtypes=(("float32", 0.6), ("float16", 0.2), ("bfloat16", 0.2)))}

_BUG = ("this is a bug", "an acefuse bug", "report it")


def _is_refusal(exc) -> bool:
    from acefuse.codegen.emit import CodegenError
    msg = str(exc)
    if any(b in msg for b in _BUG):
        return False
    return isinstance(exc, (af.LanguageError, af.FuseError, CodegenError)) or type(exc).__name__ == "UnsupportedOpError"


def _crash_class(exc) -> str:
    return f"crash:{type(exc).__name__}"


def _choose(rng, weighted):
    r = rng.random()
    for v, w in weighted:
        r -= w
        if r <= 0:
            return v
    return weighted[-1][0]


def _as_dict(out, names):
    return out if isinstance(out, dict) else {names[0]: out}


def run_program(outputs: dict, w_axes, cases: list, res: Result, log=print, name="fz", minimize=True,
                compile_fn=None, compile_timeout=COMPILE_TIMEOUT):
    """Compile one program pair and check it on every (inputs, schedule). ``cases`` is a
    list of make_inputs keyword dicts. ``compile_fn`` replaces ``af.compile`` (the tests pass
    deliberately wrong kernels through it to show the oracle fails them)."""
    text = program_text(outputs, w_axes, name)
    prog = af.program(name, **{k: v.af for k, v in outputs.items()})
    res.programs += 1

    def fail(f: Failure):
        res.record(f, log)

    try:
        with warnings.catch_warnings(), _time_limit(compile_timeout):
            warnings.simplefilter("ignore")
            k = (compile_fn or af.compile)(prog)
    except Exception as exc:  # noqa: BLE001 - every exception is classified
        if _is_refusal(exc):
            res.refused += 1
            res.by_class["refused"] = res.by_class.get("refused", 0) + 1
            log(f"  refused: {str(exc)[:200]}")
            return
        fail(Failure(_crash_class(exc), "compile", text, f"make_inputs(**{cases[0]!r})" if cases else "",
                     detail=_short_tb(exc)))
        return
    if not getattr(k, "fusible", True):
        res.unfusible += 1
    names = list(outputs)
    for case in cases:
        inputs = make_inputs(**case)
        dt = DTYPES[case["dtype"]]
        exact = {n: t.to(torch.float64) for n, t in inputs.items()}
        info = {}
        r64 = reference(outputs, exact, torch.float64, track=True, info=info)
        r32 = reference(outputs, exact, torch.float32)
        inf_rows, loose = _inf_rows(exact) | info["inf_sel"], info["loose"]
        # onepass (the row family's in-kernel merge across the programs sharing a row, a timed
        # candidate of long rows): NSPLIT chunks, each one tile of its own size
        for sched in SCHEDULES + ("onepass",):
            try:
                kw = dict(block_j=BLOCK_J) if sched != "onepass" else {}
                out = k(**_on_device(inputs), schedule=sched, nsplit=NSPLIT, **kw)
            except ValueError as exc:
                msg = str(exc)
                if sched in ("split", "onepass") and f"has no {sched} schedule" in msg:
                    continue
                if sched == "onepass" and ("stacked outputs" in msg or "unknown schedule 'onepass'" in msg):
                    continue   # (outputs the onepass kernel does not write; a family without it)
                fail(Failure(_crash_class(exc), "run", text, f"make_inputs(**{case!r})", sched,
                             detail=_short_tb(exc)))
                continue
            except Exception as exc:  # noqa: BLE001
                fail(Failure(_crash_class(exc), "run", text, f"make_inputs(**{case!r})", sched,
                             detail=_short_tb(exc)))
                continue
            res.kernel_runs += 1
            out = _as_dict(out, names)
            for o in names:
                v64, bound = r64[o]
                rows = (lambda m: m if outputs[o].shape != "rj" else m[:, None])
                v = check_output(out[o], v64, r32[o][0], bound, dt, rows(inf_rows), rows(loose))
                res.skipped_elements += v.skipped
                if not v.ok:
                    f = Failure(v.cls, "run", text, f"make_inputs(**{case!r})", sched, o, v.detail,
                                getattr(k, "fusible", None))
                    if minimize and compile_fn is None:
                        f = _minimize(f, outputs, w_axes, case, sched, o, name)
                    fail(f)


class CompileTimeout(Exception):
    """af.compile of one generated program ran longer than the fuzzer's limit."""


@contextlib.contextmanager
def _time_limit(seconds):
    """Raise CompileTimeout after ``seconds`` (SIGALRM; only in the main thread, else no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise CompileTimeout(f"af.compile took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _inf_rows(inputs: dict):
    """[R] bool: the row's inputs (an input over "j" counts for every row) hold an infinity."""
    R = max(t.shape[0] for t in inputs.values() if t.dim() == 2)
    m = torch.zeros(R, dtype=torch.bool)
    for t in inputs.values():
        m = m | (torch.isinf(t).any(dim=1) if t.dim() == 2 else torch.isinf(t).any().expand(R))
    return m


def _short_tb(exc) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}{where}"


def _minimize(f: Failure, outputs, w_axes, case, sched, o, name) -> Failure:
    """Shrink a wrong result: keep only the failing output, then only the failing row(s)."""
    try:
        one = {o: outputs[o]}
        cur = dict(case)
        prog = af.program(name + "_min", **{o: outputs[o].af})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            k = af.compile(prog)

        def still(c):
            inputs = make_inputs(**c)
            exact = {n: t.to(torch.float64) for n, t in inputs.items()}
            info = {}
            v64, bound = reference(one, exact, torch.float64, track=True, info=info)[o]
            v32 = reference(one, exact, torch.float32)[o][0]
            got = k(**_on_device(inputs), schedule=sched, block_j=BLOCK_J, nsplit=NSPLIT)
            rows = (lambda m: m if one[o].shape != "rj" else m[:, None])
            return check_output(got, v64, v32, bound, DTYPES[c["dtype"]], rows(_inf_rows(exact) | info["inf_sel"]),
                                rows(info["loose"]))

        v = still(cur)
        if v.ok:
            return f   # only fails together with the other outputs: keep the full program
        f = Failure(v.cls, f.stage, program_text(one, w_axes, name + "_min"), f"make_inputs(**{cur!r})",
                    sched, o, v.detail, getattr(k, "fusible", None))
        if cur["R"] > 1:
            c1 = dict(cur, R=1)
            v1 = still(c1)
            if not v1.ok:
                f.inputs, f.detail, f.cls = f"make_inputs(**{c1!r})", v1.detail, v1.cls
        return f
    except Exception:  # noqa: BLE001 - minimisation is best effort
        return f


DEVICE = "cpu"   # where kernels run (inputs are made, and references computed, on the CPU)


def _on_device(inputs: dict) -> dict:
    return inputs if DEVICE == "cpu" else {n: t.to(DEVICE) for n, t in inputs.items()}


def make_cases(prng, prof, i, used_w, device="cpu") -> list:
    """The make_inputs keyword dicts program ``i`` is run on (drawn from its own rng)."""
    cases = []
    for c in range(prof["n_inputs"]):
        kind = KINDS[(i + c) % len(KINDS)] if c < 2 else prng.choice(KINDS)
        case = dict(kind=kind, R=prng.randint(1, 5), J=prng.choice([1, 7, 16, 17, 33, 50, 64, 100, 130]),
                    dtype=_choose(prng, prof["dtypes"]), seed=prng.randrange(2 ** 31), w_axes=used_w)
        if device == "cpu" and kind == "subnormal" and case["dtype"] == "bfloat16":
            # Triton's interpreter (3.9) widens a bfloat16 subnormal wrongly (-2.76e-40 loads
            # as -5.88e-39): on the CPU that case would test the interpreter, not acefuse
            case["dtype"] = "float32"
        cases.append(case)
    return cases


def run(n_programs: int | None = None, seed: int = 0, profile: str = "short", minutes: float | None = None,
        log=None, depth=None, device: str = "cpu") -> Result:
    """Fuzz ``n_programs`` random programs (or for ``minutes``); returns a Result. ``device="cuda"``
    runs the kernels compiled on a GPU (references stay on the CPU)."""
    global DEVICE
    DEVICE = device
    log = log or (lambda *a: None)
    prof = PROFILES[profile]
    depth = depth or prof["depth"]
    rng = random.Random(seed)
    res = Result()
    t0 = time.time()
    i = 0
    while True:
        if n_programs is not None and i >= n_programs:
            break
        if minutes is not None and time.time() - t0 > minutes * 60:
            break
        if n_programs is None and minutes is None:
            break
        pseed = rng.randrange(2 ** 31)
        prng = random.Random(pseed)
        w_axes = prng.choice([None, None, "j", "rj"])
        gen = Gen(prng, w_axes)
        outputs = gen.program(depth=prng.choice(range(1, depth + 1)))
        if not outputs:
            continue
        used_w = w_axes if any(_uses(n, "w") for n in outputs.values()) else None
        cases = make_cases(prng, prof, i, used_w, device)
        log(f"[{i}] seed {pseed} ({time.time() - t0:.0f}s): {', '.join(f'{k}: {v.shape}' for k, v in outputs.items())}")
        run_program(outputs, used_w, cases, res, log=log, name=f"fz{i}")
        i += 1
    return res


def programs(depth: int = 2):
    """A Hypothesis strategy of program pairs ``(outputs, w_axes)`` (drawn through a seed,
    so shrinking moves between programs rather than inside one)."""
    from hypothesis import strategies as st

    def build(seed, w_axes):
        outs = Gen(random.Random(seed), w_axes).program(depth=depth)
        used = w_axes if any(_uses(n, "w") for n in outs.values()) else None
        return outs, used
    return st.builds(build, st.integers(0, 2 ** 31 - 1), st.sampled_from([None, "j", "rj"])).filter(
        lambda p: bool(p[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="acefuse fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop after this long (default: 2 minutes, or no limit with --programs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="short")
    ap.add_argument("--programs", type=int, default=None, help="stop after this many programs")
    ap.add_argument("--findings", default=None, help="append each distinct failure's reproducer to this file")
    ap.add_argument("--device", default="cpu", help="run the kernels here (cpu: Triton's interpreter; cuda)")
    ap.add_argument("--backward", action="store_true",
                    help="gradient mode: af.backward of each program, gradients against float64 torch "
                         "autograd of the reference (acefuse/fuzz_backward.py)")
    args = ap.parse_args(argv)
    if args.minutes is None and args.programs is None:
        args.minutes = 2.0
    t0 = time.time()
    if args.backward:
        from acefuse import fuzz_backward
        runner = fuzz_backward.run
    else:
        runner = run
    res = runner(n_programs=args.programs, seed=args.seed, profile=args.profile, minutes=args.minutes,
                 log=lambda s: print(s, flush=True), device=args.device)
    print(f"\n== acefuse fuzz{' --backward' if args.backward else ''}: seed {args.seed}, profile {args.profile}, "
          f"{time.time() - t0:.0f}s ==")
    print(res.summary())
    seen = set()
    for f in res.failures:
        key = (f.cls, f.schedule, f.program)
        if key in seen:
            continue
        seen.add(key)
        print("\n" + f.reproducer())
        if args.findings:
            with open(args.findings, "a") as fh:
                fh.write(f"\n```python\n# fuzz seed {args.seed}, profile {args.profile}\n{f.reproducer()}\n```\n")
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
