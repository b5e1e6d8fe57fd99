"""The acefuse command line.

    acefuse derive FILE.py [--json]      derivation of every program in FILE.py
    acefuse run FILE.py --check          compile, run on fresh random inputs, compare to float64
    acefuse prove [FILE.py] [--json]     prove every library rule (or the rules in FILE.py)
    acefuse fuzz [--backward] [--minutes N] [--seed S] [--profile short|long]
                                         the fuzzer (docs/fuzzing.md); --backward checks gradients
    acefuse explore [RULES.py] [--corpus DIR|builtin|examples] [--ablate NAME] [--json]
                                         effect of rules on a corpus of programs (docs/workbench.md)
    acefuse show FILE.py --program NAME --html OUT.html
                                         one derivation as a self-contained HTML page
    acefuse bench [--quick] [--out DIR]  the GPU benchmark suite, tables and plots
    acefuse bench --plot-only RESULTS.json [--out DIR]   tables and plots of recorded results

A module-level ``RULES = [...]`` in FILE.py adds those (proved) rules to ``derive`` and ``run``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys

# Default sizes of ``acefuse run``: the fused axis 1000, every other axis 37, shrunk
# (largest first, fused axis last) until the iteration space (product of all axis
# lengths, which the float64 reference materialises) fits the budget of the device.
# Triton's CPU interpreter runs one program instance at a time in numpy: ~seconds.
DEFAULT_FUSED, DEFAULT_OTHER = 1000, 37
MIN_FUSED, MIN_OTHER = 100, 3
SIZE_BUDGET = {"cpu": 300_000, "cuda": 16_000_000}


def _load(path: str) -> tuple:
    """(programs, rules) defined by the user's file."""
    from acefuse.lang import Program
    from acefuse.rules.base import Rule
    if not os.path.isfile(path):
        raise SystemExit(f"acefuse: no such file: {path}")
    ns = runpy.run_path(path, run_name="acefuse_user_file")
    progs = [v for v in ns.values() if isinstance(v, Program)]
    if not progs:
        raise SystemExit(f"acefuse: {path} defines no program; make one with af.program(name, out=...)")
    seen, out = set(), []
    for p in progs:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    rules = ns.get("RULES", ())
    rules = list(rules.values()) if isinstance(rules, dict) else list(rules)
    bad = [r for r in rules if not isinstance(r, Rule)]
    if bad:
        raise SystemExit(f"acefuse: {path}: RULES must list Rule objects (made with af.rule(...) or rw(...)); "
                         f"got {bad[0]!r}")
    return out, rules


def _programs(path: str) -> list:
    return _load(path)[0]


def _sizes(spec: str | None) -> dict:
    out = {}
    if spec:
        for part in spec.split(","):
            k, _, v = part.partition("=")
            if not k.strip() or not v.strip().isdigit() or int(v) < 1:
                raise SystemExit(f"acefuse: --sizes expects axis=length pairs with lengths >= 1, like "
                                 f"r=37,j=1000; got {part!r}")
            out[k.strip()] = int(v)
    return out


def check_sizes(user: dict, progs, path: str) -> None:
    """Every axis named in --sizes must be an axis of some program of the file."""
    axes = {a: [p.name for p in progs if a in p.axes] for p in progs for a in p.axes}
    unknown = [a for a in user if a not in axes]
    if unknown:
        listing = "; ".join(f"{p.name}: {' '.join(p.axes)}" for p in progs)
        raise SystemExit(f"acefuse: --sizes names axis {', '.join(map(repr, unknown))}, which no program in "
                         f"{path} has (axes: {listing})")


def default_sizes(prog, axis: str, user: dict, device: str = "cpu") -> dict:
    """Axis lengths for ``acefuse run``: the user's, then defaults shrunk to the budget."""
    sizes = {a: user.get(a, DEFAULT_FUSED if a == axis else DEFAULT_OTHER) for a in prog.axes}
    budget = SIZE_BUDGET.get(device, SIZE_BUDGET["cpu"])
    floor = {a: (MIN_FUSED if a == axis else MIN_OTHER) for a in prog.axes}
    while math.prod(sizes.values()) > budget:
        free = [a for a in prog.axes if a not in user and sizes[a] > floor[a]]
        if not free:
            break
        a = max(free, key=lambda a: (sizes[a] / floor[a], a != axis))
        sizes[a] = max(floor[a], -(-sizes[a] // 2))
    return sizes


def cmd_derive(args) -> int:
    from acefuse.fuse import fuse
    docs = []
    progs, rules = _load(args.file)
    for p in progs:
        f = fuse(p, axis=args.axis, rules=rules)
        if args.json:
            docs.append(f.to_json())
        else:
            print(f.explain(timings=args.timings))
            print()
    if args.json:
        print(json.dumps(docs, indent=2))
    return 0


def cmd_run(args) -> int:
    import numpy as np
    import torch
    from acefuse.codegen.compile import compile_program
    from acefuse.reference import evaluate, has_rounding, random_inputs
    user = _sizes(args.sizes)
    progs, rules = _load(args.file)
    check_sizes(user, progs, args.file)
    failed = False
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    tol = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 3e-2}[args.dtype]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for p in progs:
        k = compile_program(p, axis=args.axis, rules=rules)
        sizes = default_sizes(p, k.fusion.axis, user, dev)
        inputs = random_inputs(p, sizes, dtype=dtype, device=dev)
        out = k(**inputs)
        out = out if isinstance(out, dict) else {next(iter(p.outputs)): out}
        status = "fusible" if k.fusible else f"not fusible ({k.fusion.reason})"
        print(f"{p.name}: {status}; sizes {sizes}; {args.dtype}; "
              f"HBM passes unfused {k.fusion.hbm_passes['unfused']} -> fused {k.fusion.hbm_passes['fused']}")
        if not args.check:
            continue
        from acefuse.topk import stack_outputs    # the kernel writes a top-k's candidates as one tensor
        ins64 = {n: t.cpu().to(torch.float64) if t.dtype.is_floating_point else t.cpu() for n, t in inputs.items()}
        ref = stack_outputs(p, evaluate(p, ins64))
        if has_rounding(p):
            # a cast/round/floor/ceil is discontinuous: the float32 value the kernel rounds may sit on
            # the other side of a rounding boundary than the exact one (reference.evaluate's docstring)
            ref32 = stack_outputs(p, evaluate(p, ins64, round_args_to="float32"))
            print("  (reference: float64, the argument of each cast/round/floor/ceil rounded to float32 "
                  "first, as the kernel computes it; 'exact' is the error against plain float64)")
        for o, y in out.items():
            r = ref[o] if not has_rounding(p) else ref32[o]
            got = y.detach().cpu().double().numpy()
            fin = np.isfinite(r)
            same_nonfinite = bool(np.all((~fin) == (~np.isfinite(got))) and np.all(got[~fin] == r[~fin]))
            denom = np.maximum(np.abs(r[fin]), 1.0)
            err = float(np.max(np.abs(got[fin] - r[fin]) / denom)) if fin.any() else 0.0
            ok = err <= tol and same_nonfinite
            failed |= not ok
            exact = ""
            if has_rounding(p):
                r0, g0 = ref[o][fin], got[fin]
                exact = f"; exact {float(np.max(np.abs(g0 - r0) / np.maximum(np.abs(r0), 1.0))) if fin.any() else 0.0:.3e}"
            print(f"  {o}: max rel err {err:.3e} (tol {tol:g}{exact}) {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


def main(argv=None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()   # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        # the reader went away (``acefuse prove | head``): stop quietly, like cat
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prove":
        from acefuse.proofs.cli import main as prove_main
        return prove_main(argv[1:])
    if argv and argv[0] == "fuzz":   # the fuzzer's own options (--backward: gradients), docs/fuzzing.md
        from acefuse.fuzz import main as fuzz_main
        return fuzz_main(argv[1:])
    ap = argparse.ArgumentParser(prog="acefuse", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("derive", help="print the derivation of every program in FILE.py")
    d.add_argument("file")
    d.add_argument("--json", action="store_true", help="stable machine-readable output")
    d.add_argument("--axis", default=None, help="the axis to fuse (default: the program's reduced axis)")
    d.add_argument("--timings", action="store_true", help="show how long each saturation run took")
    r = sub.add_parser("run", help="compile and run every program in FILE.py")
    r.add_argument("file")
    r.add_argument("--check", action="store_true", help="compare against a float64 reference; exit 1 on FAIL")
    r.add_argument("--sizes", default=None,
                   help="axis lengths, e.g. r=37,j=1000 (default: fused axis 1000, others 37, shrunk to a "
                        "size budget of the device; the sizes used are printed)")
    r.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    r.add_argument("--axis", default=None)
    sub.add_parser("prove", help="prove every rule (or the rules in FILE.py)")
    sub.add_parser("fuzz", help="random cascaded programs against a float64 reference (--backward: their "
                                "gradients); acefuse fuzz --help")
    from acefuse.workbench import cli as wb
    wb.add_parsers(sub)
    args = ap.parse_args(argv)
    if args.cmd in wb.COMMANDS:
        return wb.COMMANDS[args.cmd](args)
    try:
        return {"derive": cmd_derive, "run": cmd_run}[args.cmd](args)
    except (ValueError, TypeError) as exc:
        from acefuse.lang import LanguageError
        from acefuse.fuse import FuseError
        if isinstance(exc, (LanguageError, FuseError)) or type(exc).__module__.startswith("acefuse"):
            print(f"acefuse: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
