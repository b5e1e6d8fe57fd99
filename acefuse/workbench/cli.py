"""The workbench's subcommands of ``acefuse``: ``explore``, ``show`` and ``bench``
(docs/workbench.md). ``acefuse/cli.py`` adds them with ``add_parsers``."""
from __future__ import annotations

import json
import sys


def _err(msg: str) -> int:
    print(msg if msg.startswith("acefuse") else f"acefuse: {msg}", file=sys.stderr)
    return 2


def add_parsers(sub) -> None:
    e = sub.add_parser("explore", help="the effect of rules (or of removing library rules) on a corpus of programs")
    e.add_argument("rules", nargs="?", default=None,
                   help="a .py file defining RULES = [...] (optional with --ablate)")
    e.add_argument("--corpus", action="append", default=None, metavar="DIR|builtin|examples|FILE.py",
                   help="programs to try (repeatable; default: examples and builtin)")
    e.add_argument("--ablate", action="append", default=[], metavar="RULE",
                   help="remove this library rule in the 'after' run (repeatable)")
    e.add_argument("--only", default=None,
                   help="comma-separated program names (as in the table, or the program's own name) to keep")
    e.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    e.add_argument("--no-needed", action="store_true",
                   help="skip the ablation that finds which new rules the winning derivation needs")
    e.add_argument("--quiet", action="store_true", help="no progress bar")

    s = sub.add_parser("show", help="one derivation as a self-contained HTML page")
    s.add_argument("file")
    s.add_argument("--program", default=None, help="the program's name (default: the only program of FILE)")
    s.add_argument("--html", required=True, metavar="OUT.html")
    s.add_argument("--axis", default=None)
    s.add_argument("--alternatives", type=int, default=12, help="forms listed per state and schedule (default 12)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    b = sub.add_parser("bench", help="run the GPU benchmark suite; tables (Markdown, JSON) and PNG plots")
    b.add_argument("--quick", action="store_true", help="the quick variant of each benchmark")
    b.add_argument("--out", default="bench-results", help="folder for results, tables and plots")
    b.add_argument("--parts", default=None,
                   help="comma-separated parts to run (rows, prefill, variants, decode, training)")
    b.add_argument("--benchmarks", default=None, help="the benchmarks/ folder (default: found next to acefuse)")
    b.add_argument("--no-export", action="store_true", help="use the kernels already in benchmarks/kernels/")
    b.add_argument("--plot-only", nargs="+", default=None, metavar="RESULTS.json",
                   help="no run: tables and plots from recorded result files (runs on the CPU)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_explore(args) -> int:
    from acefuse.workbench import corpus as C
    from acefuse.workbench import explore as X
    try:
        rules = X.load_rules(args.rules) if args.rules else []
        ablate = X.check_ablate(args.ablate)
        if not rules and not ablate:
            return _err("acefuse explore: give a rules file (RULES.py) to add, or --ablate RULE to remove a "
                        "library rule, or both")
        warn = lambda m: print(f"acefuse explore: {m}", file=sys.stderr)  # noqa: E731
        specs = args.corpus
        if not specs:   # default: examples/ and the built-in corpus; an installed copy has no examples/
            specs = ["examples", "builtin"] if C.examples_dir() else ["builtin"]
            if len(specs) == 1:
                warn("no examples/ folder found (not a source checkout): the built-in corpus only")
        entries = C.load(specs, warn=warn)
        if args.only:
            keep = {n.strip() for n in args.only.split(",") if n.strip()}
            entries = [e for e in entries if e.name in keep or e.program.name in keep]
            if not entries:
                return _err(f"acefuse explore: --only {args.only}: no program of the corpus has that name")
        report = X.explore(entries, rules, ablate, needed_rules=not args.no_needed, quiet=args.quiet)
    except (X.ExploreError, C.CorpusError) as exc:
        return _err(str(exc))
    print(json.dumps(report, indent=1) if args.json else X.table(report))
    return 0


def cmd_show(args) -> int:
    from acefuse.workbench import show as S
    try:
        path = S.write(args.file, args.html, program=args.program, axis=args.axis,
                       alternatives=args.alternatives, quiet=args.quiet)
    except S.ShowError as exc:
        return _err(str(exc))
    print(f"wrote {path}")
    return 0


def cmd_bench(args) -> int:
    from acefuse.workbench import bench as B
    try:
        return B.main(args)
    except B.BenchError as exc:
        return _err(str(exc))


COMMANDS = {"explore": cmd_explore, "show": cmd_show, "bench": cmd_bench}
