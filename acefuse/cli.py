"""The acefuse command line.

    acefuse derive FILE.py [--json]      derivation of every program in FILE.py
    acefuse run FILE.py --check          compile, run on fresh random inputs, compare to float64
    acefuse prove [FILE.py] [--json]     prove every library rule (or the rules in FILE.py)
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys


def _programs(path: str) -> list:
    from acefuse.lang import Program
    try:
        ns = runpy.run_path(path, run_name="acefuse_user_file")
    except FileNotFoundError:
        raise SystemExit(f"acefuse: no such file: {path}")
    progs = [v for v in ns.values() if isinstance(v, Program)]
    if not progs:
        raise SystemExit(f"acefuse: {path} defines no program; make one with af.program(name, out=...)")
    seen, out = set(), []
    for p in progs:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _sizes(spec: str | None) -> dict:
    out = {}
    if spec:
        for part in spec.split(","):
            k, _, v = part.partition("=")
            if not v.isdigit():
                raise SystemExit(f"acefuse: --sizes expects axis=length pairs like r=37,j=1000, got {part!r}")
            out[k.strip()] = int(v)
    return out


def cmd_derive(args) -> int:
    from acefuse.fuse import fuse
    docs = []
    for p in _programs(args.file):
        f = fuse(p, axis=args.axis)
        if args.json:
            docs.append(f.to_json())
        else:
            print(f.explain())
            print()
    if args.json:
        print(json.dumps(docs, indent=2))
    return 0


def cmd_run(args) -> int:
    import numpy as np
    import torch
    from acefuse.codegen.compile import compile_program
    from acefuse.reference import evaluate, random_inputs
    user = _sizes(args.sizes)
    failed = False
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    tol = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 3e-2}[args.dtype]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for p in _programs(args.file):
        k = compile_program(p, axis=args.axis)
        axis = k.fusion.axis
        sizes = {a: user.get(a, 1000 if a == axis else 37) for a in p.axes}
        inputs = random_inputs(p, sizes, dtype=dtype, device=dev)
        out = k(**inputs)
        out = out if isinstance(out, dict) else {next(iter(p.outputs)): out}
        ref = evaluate(p, {n: t.cpu().to(torch.float64) if t.dtype.is_floating_point else t.cpu()
                           for n, t in inputs.items()})
        status = "fusible" if k.fusible else f"not fusible ({k.fusion.reason})"
        print(f"{p.name}: {status}; sizes {sizes}; {args.dtype}; "
              f"HBM passes unfused {k.fusion.hbm_passes['unfused']} -> fused {k.fusion.hbm_passes['fused']}")
        if not args.check:
            continue
        for o, y in out.items():
            r = ref[o]
            got = y.detach().cpu().double().numpy()
            fin = np.isfinite(r)
            same_nonfinite = bool(np.all((~fin) == (~np.isfinite(got))) and np.all(got[~fin] == r[~fin]))
            denom = np.maximum(np.abs(r[fin]), 1.0)
            err = float(np.max(np.abs(got[fin] - r[fin]) / denom)) if fin.any() else 0.0
            ok = err <= tol and same_nonfinite
            failed |= not ok
            print(f"  {o}: max rel err {err:.3e} (tol {tol:g}) {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prove":
        from acefuse.proofs.cli import main as prove_main
        return prove_main(argv[1:])
    ap = argparse.ArgumentParser(prog="acefuse", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("derive", help="print the derivation of every program in FILE.py")
    d.add_argument("file")
    d.add_argument("--json", action="store_true", help="stable machine-readable output")
    d.add_argument("--axis", default=None, help="the axis to fuse (default: the program's reduced axis)")
    r = sub.add_parser("run", help="compile and run every program in FILE.py")
    r.add_argument("file")
    r.add_argument("--check", action="store_true", help="compare against a float64 reference; exit 1 on FAIL")
    r.add_argument("--sizes", default=None, help="axis lengths, e.g. r=37,j=1000")
    r.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    r.add_argument("--axis", default=None)
    sub.add_parser("prove", help="prove every rule (or the rules in FILE.py)")
    args = ap.parse_args(argv)
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
