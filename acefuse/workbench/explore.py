"""``acefuse explore``: the effect of a set of rules on a corpus of programs.

For every program of the corpus, ``af.fuse`` runs twice: *before* with the library's rules,
*after* with the library's rules plus the new ones (and without the ablated library rules).
Each run is measured (fusible, HBM passes, cost, e-graph size, saturation time), the two are
compared, and for the after run the new rules are sorted into those that *matched* during
saturation and those the winning derivation *needs*: re-saturating without the rule loses a
derived update or merge the extraction chose (the same ablation as ``Fusion.rule_chain``,
restricted to the new rules), or changes the program's normal form.

    acefuse explore examples/user_rule.py --corpus builtin
    acefuse explore --ablate sum-factor-right --corpus builtin --json
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
import difflib
import time

from acefuse.workbench.progress import bar

CHANGES = ("gained", "lost", "fewer-passes", "more-passes", "cheaper", "costlier", "same",
           "error-before", "error-after", "error")


class ExploreError(ValueError):
    """The rules or the ablation asked for cannot be used; the message says what to do."""


# ---- rules ---------------------------------------------------------------------------------------
def load_rules(path) -> list:
    """The rules of a file: its ``RULES`` list (or dict) when it has one, else every
    module-level ``Rule`` (and every rule of a module-level ``Theory``), as ``acefuse prove``
    reads them. Programs in the file are not part of the corpus."""
    import contextlib
    import runpy
    import sys
    from pathlib import Path
    from acefuse.rules.base import Rule, Theory
    p = Path(path)
    if not p.is_file():
        raise ExploreError(f"acefuse explore: no such rules file: {path}")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            ns = runpy.run_path(str(p), run_name="acefuse_rules_file")
    except Exception as exc:  # the user's file: name it, keep the cause
        raise ExploreError(f"acefuse explore: {path} could not be loaded ({type(exc).__name__}: {exc})") from None
    if "RULES" in ns:
        rules = ns["RULES"]
        rules = list(rules.values()) if isinstance(rules, dict) else list(rules)
        bad = [r for r in rules if not isinstance(r, Rule)]
        if bad:
            raise ExploreError(f"acefuse explore: {path}: RULES must list Rule objects (made with rw(...) or "
                               f"af.rule(...)); got {bad[0]!r}")
    else:
        rules, seen = [], set()
        for v in ns.values():
            for r in (v.rules if isinstance(v, Theory) else [v] if isinstance(v, Rule) else []):
                if r.name not in seen:
                    seen.add(r.name)
                    rules.append(r)
    if not rules:
        raise ExploreError(f"acefuse explore: {path} defines no rule; write one with rw(name, lhs, rhs) and "
                           "list it in RULES = [...] (docs/writing-rules.md)")
    from acefuse.rules import REGISTRY
    clash = [r.name for r in rules if r.name in REGISTRY]
    if clash:
        raise ExploreError(f"acefuse explore: {path}: rule {clash[0]!r} has the name of a library rule; rename "
                           f"it (to ablate the library's rule, use --ablate {clash[0]})")
    return rules


def check_ablate(names) -> list:
    """The library rules named by ``--ablate`` (each must exist; a near miss is suggested)."""
    from acefuse.rules import REGISTRY
    out = []
    for n in names:
        if n not in REGISTRY:
            near = difflib.get_close_matches(n, list(REGISTRY), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else "; `acefuse prove` lists them"
            raise ExploreError(f"acefuse explore: --ablate {n}: no library rule has that name{hint}")
        out.append(n)
    return out


@contextmanager
def without(names):
    """Run ``af.fuse`` with the library rules ``names`` removed (``fuse.default_rules`` is the
    one place the library's rules enter a fusion; the ablation of ``rule_chain`` then works
    on the same reduced set, since it reads ``Fusion.rules``)."""
    import importlib
    F = importlib.import_module("acefuse.fuse")   # the module (``acefuse.fuse`` the attribute is af.fuse)
    names = set(names)
    if not names:
        yield
        return
    orig = F.default_rules

    def reduced(extra=()):
        return [r for r in orig(extra) if r.name not in names]
    F.default_rules = reduced
    try:
        yield
    finally:
        F.default_rules = orig


# ---- one measurement ---------------------------------------------------------------------------
@dataclass
class Measure:
    """One ``af.fuse`` run of one program, as ``explore`` reports it."""

    fusible: bool | None = None
    reason: str = ""
    passes: int | None = None          # HBM reads of the input, fused kernel (rows longer than a tile)
    unfused_passes: int | None = None  # HBM reads written plainly
    cost: float | None = None          # cost model, rolling updates of every carried state (extract/cost.py)
    merge_cost: float | None = None    # the same for the split merges (None: no split schedule)
    enodes: int = 0                    # e-nodes after saturation, summed over the passes
    iterations: int = 0
    stop: list = field(default_factory=list)   # why each pass's saturation stopped
    saturation_ms: float = 0.0
    derive_ms: float = 0.0             # all of af.fuse (normal form, saturation, extraction, checks)
    matched: dict = field(default_factory=dict)   # new rule -> matches during saturation
    normal_form: tuple = ()
    error: str = ""
    fusion: object = None              # the Fusion (not serialised)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("fusible", "reason", "passes", "unfused_passes", "cost", "merge_cost",
                                            "enodes", "iterations", "stop", "saturation_ms", "derive_ms",
                                            "matched", "error")}
        d["saturation_ms"] = round(d["saturation_ms"], 2)
        d["derive_ms"] = round(d["derive_ms"], 2)
        d["reason"] = d["reason"] or None
        d["error"] = d["error"] or None
        return d


def measure(prog, rules=(), drop=(), watch=()) -> Measure:
    """Fuse ``prog`` with the library's rules plus ``rules`` minus ``drop``, and measure it.
    ``watch`` names the rules whose matches are counted."""
    from acefuse.fuse import fuse
    m = Measure()
    t0 = time.perf_counter()
    try:
        with without(drop):
            f = fuse(prog, rules=list(rules))
    except Exception as exc:  # reported per program: one bad program must not end the run
        m.error = f"{type(exc).__name__}: {exc}"
        m.derive_ms = (time.perf_counter() - t0) * 1e3
        return m
    m.derive_ms = (time.perf_counter() - t0) * 1e3
    m.fusion = f
    m.fusible, m.reason = f.fusible, f.reason
    hp = f.hbm_passes
    m.passes, m.unfused_passes = hp["fused"], hp["unfused"]
    m.cost = float(sum(c for p in f.passes for c in p.rolling_cost.values()))
    m.merge_cost = (float(sum(c for p in f.passes for c in p.merge_cost.values()))
                    if all(p.split_ok for p in f.passes) else None)
    for p in f.passes:
        if p.stats:
            m.enodes += p.stats.nodes
            m.iterations += p.stats.iterations
            m.stop.append(p.stats.stop_reason)
            m.saturation_ms += p.stats.seconds * 1e3
            for r in watch:
                if p.stats.matches.get(r):
                    m.matched[r] = m.matched.get(r, 0) + p.stats.matches[r]
    normal = getattr(f, "normal_program", None)
    if normal is not None:
        m.normal_form = tuple(sorted((k, v.term.sexpr()) for k, v in normal.outputs.items()))
    return m


def needed(f, new_rules, before: Measure | None = None) -> list:
    """The new rules the winning derivation of ``f`` needs: without the rule, some derived
    update or merge the extraction chose is no longer in the re-saturated e-graph, or the
    program's normal form is not the one extraction chose (checked only when it differs from
    ``before``'s). One re-saturation per pass for each new rule that matched in it."""
    from acefuse.fuse import _build, _is_definition, AB
    from acefuse.rewrite.terms import Term
    out = []
    for r in new_rules:
        rest = [x for x in f.rules if x.name != r.name]
        need = False
        for p in f.passes:
            if need or not (p.stats and p.stats.matches.get(r.name)):
                continue
            targets = [(s.name, t) for s in p.states for forms in (p.rolling, p.merge)
                       for t in [forms.get(s.name)] if t is not None and not _is_definition(f, s.name, t)]
            if not targets:
                continue
            remaining = [s for s in f.encoding.states if s.name not in p.known]
            eg = _build(f.encoding, remaining, set(p.known), rest, check_proofs=False)
            eg.saturate(getattr(p, "schedule", None) or f.schedule)   # a pass may have its own
            need = any(not eg.check(Term("St", (name, AB)), t) for name, t in targets)
        if not need and before is not None and before.normal_form and getattr(f, "normal_program", None):
            mine = tuple(sorted((k, v.term.sexpr()) for k, v in f.normal_program.outputs.items()))
            if mine != before.normal_form:
                from acefuse.rewrite.normalize import normalize
                alt, _ = normalize(f.program, f.axis, rest, check_proofs=False)
                need = tuple(sorted((k, v.term.sexpr()) for k, v in alt.outputs.items())) != mine
        if need:
            out.append(r.name)
    return out


def change(before: Measure, after: Measure) -> str:
    """How the program moved: gained/lost fusibility, fewer/more passes, cheaper/costlier, same."""
    if before.error or after.error:
        return "error" if before.error and after.error else ("error-before" if before.error else "error-after")
    if before.fusible != after.fusible:
        return "gained" if after.fusible else "lost"
    if before.passes != after.passes:
        return "fewer-passes" if after.passes < before.passes else "more-passes"
    if abs(after.cost - before.cost) > 1e-9 * max(1.0, abs(before.cost)):
        return "cheaper" if after.cost < before.cost else "costlier"
    return "same"


# ---- the run ---------------------------------------------------------------------------------------
def explore(entries, rules=(), ablate=(), needed_rules: bool = True, quiet: bool = False) -> dict:
    """Measure every entry before and after; the report as a JSON-ready dict."""
    rules, ablate = list(rules), list(ablate)
    if rules:   # every new rule must be proved before the run (af.fuse would refuse it per program)
        from acefuse.proofs import require_proved
        from acefuse.proofs.rules import UnprovedRuleError
        try:
            require_proved(rules)
        except UnprovedRuleError as exc:
            raise ExploreError(f"acefuse explore: {exc}") from None
    names = [r.name for r in rules]
    t0 = time.perf_counter()
    rows = []
    it = bar(entries, quiet=quiet, desc="explore", unit="program")
    for e in it:
        if hasattr(it, "set_postfix_str"):
            it.set_postfix_str(e.name)
        b = measure(e.program, watch=names)
        a = measure(e.program, rules=rules, drop=ablate, watch=names)
        need = needed(a.fusion, rules, b) if (needed_rules and rules and a.fusion is not None and a.matched) else []
        rows.append({
            "program": e.name, "category": e.category, "source": e.source,
            "axis": a.fusion.axis if a.fusion is not None else (b.fusion.axis if b.fusion is not None else None),
            "before": b.to_json(), "after": a.to_json(), "change": change(b, a),
            "rules_matched": sorted(a.matched), "rules_needed": need,
            "normal_form_changed": bool(b.normal_form and a.normal_form and b.normal_form != a.normal_form),
        })
    counts = {c: [r["program"] for r in rows if r["change"] == c] for c in CHANGES}
    return {
        "rules": names,
        "ablated": ablate,
        "programs": rows,
        "summary": {"programs": len(rows), **{c: v for c, v in counts.items() if v},
                    "needs": {n: [r["program"] for r in rows if n in r["rules_needed"]] for n in names}},
        "seconds": round(time.perf_counter() - t0, 2),
    }


# ---- the terminal table ------------------------------------------------------------------------------
def _fus(m: dict) -> str:
    return "error" if m["error"] else ("yes" if m["fusible"] else "no")


def _arrow(a, b, fmt=str) -> str:
    a = "-" if a is None else fmt(a)
    b = "-" if b is None else fmt(b)
    return a if a == b else f"{a} -> {b}"


def table(report: dict) -> str:
    """The report as a table for a terminal, then the summary and the errors."""
    head = ("program", "fusible", "passes", "cost", "e-nodes", "sat ms", "new rules needed", "change")
    body = []
    for r in report["programs"]:
        b, a = r["before"], r["after"]
        needed_txt = ", ".join(r["rules_needed"]) or ("(matched: " + ", ".join(r["rules_matched"]) + ")"
                                                      if r["rules_matched"] else "-")
        body.append((r["program"], _arrow(_fus(b), _fus(a)), _arrow(b["passes"], a["passes"]),
                     _arrow(b["cost"], a["cost"], lambda c: f"{c:.0f}"),
                     _arrow(None if b["error"] else b["enodes"], None if a["error"] else a["enodes"]),
                     _arrow(None if b["error"] else b["saturation_ms"], None if a["error"] else a["saturation_ms"],
                            lambda s: f"{s:.0f}"),
                     needed_txt, r["change"]))
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = []
    what = []
    if report["rules"]:
        what.append("adding " + ", ".join(report["rules"]))
    if report["ablated"]:
        what.append("without " + ", ".join(report["ablated"]))
    out.append(f"before: the library's rules; after: {' and '.join(what) or 'the same rules'}")
    out.append(line(head))
    out.append(line(tuple("-" * w for w in widths)))
    out.extend(line(row) for row in body)
    s = report["summary"]
    out.append("")
    parts = [f"{len(s[c])} {c} ({', '.join(s[c])})" for c in CHANGES if c != "same" and s.get(c)]
    out.append(f"{s['programs']} programs in {report['seconds']:.1f} s: "
               + ("; ".join(parts) + f"; {len(s.get('same', []))} unchanged" if parts else "no change"))
    for n, progs in s["needs"].items():
        out.append(f"rule {n}: needed by {len(progs)} winning derivation(s)" + (f" ({', '.join(progs)})" if progs
                                                                               else ""))
    if report["ablated"]:
        broken = s.get("lost", []) + s.get("more-passes", [])
        out.append(f"without {', '.join(report['ablated'])}: "
                   + (f"{len(broken)} program(s) break ({', '.join(broken)})" if broken else "no program breaks"))
    for r in report["programs"]:
        for when in ("before", "after"):
            if r[when]["error"]:
                out.append(f"error {when}: {r['program']}: {r[when]['error']}")
    return "\n".join(out)
