"""``acefuse prove [FILE.py] [--json] [--no-cache]``: prove rules and print a table.

Per rule: the status, the float-safety tag derived in float32 (``!`` when the
declared tag disagrees; listed below the table), and the method and scope of the
proof (``for all block sizes``).

Without FILE, every rule of ``acefuse.rules.REGISTRY`` is proved. With FILE, the
file is imported and the rules it defines are proved: the module-level list
``RULES`` if there is one, otherwise every module-level ``Rule`` (and the rules
of every module-level ``Theory``). Exit status 0 when every rule is proved, 1
when some rule is refuted or unproved, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

from acefuse.rules.base import Rule, Theory
from acefuse.proofs.rules import prove_rules, cache_path


def load_rules_from_file(path: str) -> list[Rule]:
    """Import ``path`` and return the rules it defines (``RULES``, else module-level Rule objects)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such rule file: {path}")
    modname = "acefuse_user_rules_" + hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(modname, p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    if hasattr(mod, "RULES"):
        rules = list(mod.RULES.values()) if isinstance(mod.RULES, dict) else list(mod.RULES)
        bad = [r for r in rules if not isinstance(r, Rule)]
        if bad:
            raise TypeError(f"{path}: RULES must contain Rule objects (made with rw(...) or infer(...)); "
                            f"got {bad[0]!r}")
        return rules
    rules, seen = [], set()
    for v in vars(mod).values():
        items = v.rules if isinstance(v, Theory) else [v] if isinstance(v, Rule) else []
        for r in items:
            if id(r) not in seen:
                seen.add(id(r))
                rules.append(r)
    return rules


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="acefuse prove",
        description="Prove rewrite and analysis rules sound for all block sizes (sympy with block "
                    "aggregates and induction over the block; a 50-digit random search for counterexamples), "
                    "and derive each rule's float-safety tag in float32.")
    ap.add_argument("file", nargs="?", help="a Python file defining Rule objects (or a list RULES); "
                                            "default: every registered rule")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--no-cache", action="store_true", help=f"ignore and do not write the proof cache ({cache_path()})")
    args = ap.parse_args(argv)

    if args.file:
        try:
            rules = load_rules_from_file(args.file)
        except (OSError, TypeError, SyntaxError, ImportError) as exc:
            print(f"acefuse prove: {exc}", file=sys.stderr)
            return 2
        if not rules:
            print(f"acefuse prove: {args.file} defines no rules. Define them at module level, e.g.\n"
                  f"    my_rule = rw(\"my-rule\", lhs, rhs)\n"
                  f"or list them in RULES = [...].", file=sys.stderr)
            return 2
    else:
        from acefuse.rules import REGISTRY
        rules = list(REGISTRY.values())

    results = prove_rules(rules, use_cache=not args.no_cache)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2, default=str))
    else:
        print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


def _float_col(r) -> str:
    if r.float_kind == "declared":
        col = "unsafe(decl)"
    elif r.float_unsafe:
        col = f"unsafe({r.float_kind})"
    else:
        col = "safe"
    return col + ("!" if r.float_note and r.float_kind != "declared" else "")


def format_table(results) -> str:
    """One line per rule: status, time, float tag, and the method and scope of its proof."""
    w = max([4] + [len(r.name) for r in results])
    wt = max([6] + [len(r.theory) for r in results])
    head = f"{'rule':<{w}}  {'theory':<{wt}}  {'status':<8}  {'ms':>8}  {'float':<16}  proof"
    lines = [head, "-" * (len(head) + 40)]
    for r in results:
        ms = f"{r.seconds * 1000:8.1f}" + ("*" if r.cached else " ")
        proof = f"{r.method}; {r.scope}" if r.ok else r.method
        lines.append(f"{r.name:<{w}}  {r.theory:<{wt}}  {r.status:<8}  {ms} {_float_col(r):<16}  {proof}")
    bad = [r for r in results if not r.ok]
    n = len(results)
    lines.append("-" * (len(head) + 40))
    all_sizes = sum(1 for r in results if r.ok and r.scope == "for all block sizes")
    lines.append(f"{n - len(bad)}/{n} proved ({all_sizes} with blocks, each for all block sizes; "
                 f"the others are elementwise identities)"
                 + ("  (* = time of the cached proof)" if any(r.cached for r in results) else ""))
    mism = [r for r in results if r.float_note]
    if mism:
        lines.append(f"float tags: {len(mism)} rule(s) whose declared float_unsafe tag disagrees with the "
                     f"one derived in float32:")
        for r in mism:
            lines.append(f"  {r.name}: {r.float_note}")
    else:
        lines.append("float tags: every declared float_unsafe tag agrees with the one derived in float32")
    for r in bad:
        lines.append("")
        lines.append(f"{r.name}: {r.status.upper()}  ({r.method})")
        lines.append(f"  {r.detail}")
        if r.counterexample:
            lines.append("  counterexample: " + ", ".join(f"{k} = {v:.6g}" if isinstance(v, float) else f"{k} = {v}"
                                                        for k, v in r.counterexample.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
