"""Running egglog: declare the IR, load proved rules, add terms, saturate with limits.

Everything goes through egglog's text language (``egglog.bindings``), which is
the stable core of egglog; the rule DSL (rules/base.py) prints itself as text.
Every run reports why it stopped (saturated, iteration limit, node limit or time
limit) and which rules matched in which iteration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
import time

from acefuse.rewrite.terms import OPS, RELATIONS, Term


class RewriteError(RuntimeError):
    """egglog rejected a program acefuse generated (a bug in acefuse or in a user rule)."""


def declarations() -> str:
    """egglog declarations of the IR (sorts, constructors, relations)."""
    blk = " ".join(_ctor(n, o) for n, o in OPS.items() if o.sort == "Blk")
    t = " ".join(_ctor(n, o) for n, o in OPS.items() if o.sort == "T")
    lines = [f"(datatype Blk {blk})", f"(datatype T {t})"]
    for rel, sig in RELATIONS.items():
        lines.append(f"(relation {rel} ({' '.join(sig)}))")
    return "\n".join(lines)


def _ctor(name, op):
    return f"({name}{''.join(' ' + s for s in op.sig)})" if op.sig else f"({name})"


@dataclass
class Limits:
    """Saturation limits. A run stops at the first one reached."""

    iterations: int = 10
    nodes: int = 8_000
    seconds: float = 5.0
    # roll an iteration that passes ``nodes`` back, so that extraction works on the last
    # e-graph within the limit (one iteration can grow an e-graph 30-fold: factoring
    # a zero, 0 = a * 0 for every a, took normal-form extraction from 0.1 s to 30 s).
    # Each iteration then runs in a push scope that is left open: only for an e-graph
    # saturated once and discarded (not one whose caller scopes equations by push/pop)
    rollback: bool = False


@dataclass
class RunStats:
    """Why and where a saturation run stopped."""

    stop_reason: str = ""
    iterations: int = 0
    nodes: int = 0
    seconds: float = 0.0
    matches: dict = field(default_factory=dict)          # rule name -> total matches
    first_iteration: dict = field(default_factory=dict)  # rule name -> first iteration it matched
    phases: list = field(default_factory=list)           # (phase, why it stopped, iterations, e-nodes)

    def __str__(self):
        # no timing here: this line is part of generated kernel source, which must be
        # deterministic (same program, same bytes); ``describe(timing=True)`` adds it
        return self.describe(timing=False)

    def describe(self, timing: bool = True) -> str:
        """``stopped: saturated after 4 iterations, 612 e-nodes`` (``, 12 ms`` with timing)."""
        return (f"stopped: {self.stop_reason} after {self.iterations} iterations, "
                f"{self.nodes} e-nodes" + (f", {self.seconds * 1000:.0f} ms" if timing else ""))

    def phase_summary(self) -> str:
        """One line per phase: ``expand: saturated after 3 iterations, 412 e-nodes``."""
        return "; ".join(f"{name}: {why} after {it} iterations, {n} e-nodes"
                         for name, why, it, n in self.phases)


class EGraph:
    """An egglog e-graph loaded with the IR and a set of rules grouped into rulesets."""

    def __init__(self, rules, check_proofs: bool = True, allow_unproved: bool = False):
        import egglog.bindings as eb

        rules = list(rules)
        if check_proofs:
            from acefuse.proofs import require_proved
            require_proved(rules, allow_unproved=allow_unproved)
        self.rules = rules
        self._eg = eb.EGraph()
        self._run(declarations())
        self.rulesets: dict[str, list] = {}
        for r in rules:
            self.rulesets.setdefault(_rs(r.theory), []).append(r)
        text = []
        for rs, rs_rules in self.rulesets.items():
            text.append(f"(ruleset {rs})")
            text.extend(r.egglog(rs) for r in rs_rules)
        self._run("\n".join(text))

    # -- low level -----------------------------------------------------------------
    def _run(self, text: str):
        try:
            return self._eg.run_program(*self._eg.parse_program(text))
        except Exception as exc:  # egglog raises EggSmolError; keep its text, add ours
            raise RewriteError(f"egglog rejected a generated program: {exc}\n--- program ---\n{text[:2000]}") from None

    def push(self):
        """Save the e-graph's state; ``pop()`` returns to it (a scope for per-term equations)."""
        self._run("(push)")

    def pop(self):
        self._run("(pop)")

    def union(self, a: Term, b: Term):
        self._run(f"(union {a.sexpr()} {b.sexpr()})")

    def add(self, t: Term):
        self._run(t.sexpr())

    def check(self, a: Term, b: Term) -> bool:
        """True when a and b are in the same e-class."""
        try:
            self._eg.run_program(*self._eg.parse_program(f"(check (= {a.sexpr()} {b.sexpr()}))"))
            return True
        except Exception:
            return False

    def size(self) -> int:
        out = self._run("(print-size)")
        return sum(n for _, n in out[0].sizes) if hasattr(out[0], "sizes") else _parse_sizes(out[0])

    # -- saturation -------------------------------------------------------------------
    def saturate(self, schedule, limits: Limits | None = None) -> RunStats:
        """Run a schedule (rewrite/schedules.py) until it saturates or a limit is hit."""
        limits = limits or schedule.limits
        stats = RunStats()
        t0 = time.perf_counter()
        for phase in schedule.phases:
            reason = self._phase(phase, limits, stats, t0)
            if reason:
                stats.stop_reason = f"{reason} in phase {phase.name!r}"
                break
        else:
            capped = [p for p, why, _, _ in stats.phases if why != "saturated"]
            stats.stop_reason = ("saturated" if not capped else
                                 "phase iteration cap in " + ", ".join(repr(p) for p in capped))
        stats.seconds = time.perf_counter() - t0
        stats.nodes = self.size()
        return stats

    def _phase(self, phase, limits: Limits, stats: RunStats, t0: float) -> str:
        present = [_rs(t) for t in phase.theories if _rs(t) in self.rulesets]
        analysis = [_rs(t) for t in phase.analysis if _rs(t) in self.rulesets]
        if not present:
            stats.phases.append((phase.name, "no rules loaded", 0, stats.nodes))
            return ""
        combined = f"phase_{phase.name.replace('-', '_')}"
        self._run(f"(unstable-combined-ruleset {combined} {' '.join(present)})")
        pre = " ".join(f"(saturate (run {a}))" for a in analysis)
        start = stats.iterations
        reason = ""
        for _ in range(phase.max_iterations):
            if limits.rollback:
                self.push()
            out = self._run(f"(run-schedule {pre} (run {combined}))")
            stats.iterations += 1
            changed = False
            for rep in out:
                if not hasattr(rep, "report"):
                    continue
                for it in rep.report.iterations:
                    for name, rr in it.rule_set_report.rule_reports.items():
                        n = sum(x.num_matches for x in rr)
                        if n:
                            stats.matches[name] = stats.matches.get(name, 0) + n
                            stats.first_iteration.setdefault(name, stats.iterations)
                    changed = changed or it.rule_set_report.changed
            if not changed:
                reason = "saturated"
                break
            if stats.iterations >= limits.iterations:
                reason = f"iteration limit ({limits.iterations})"
                break
            if time.perf_counter() - t0 > limits.seconds:
                reason = f"time limit ({limits.seconds} s)"
                break
            n = self.size()
            if n > limits.nodes:
                reason = f"node limit ({n} > {limits.nodes} e-nodes)"
                if limits.rollback:
                    self.pop()
                    reason += ", its last iteration rolled back"
                break
        else:
            reason = f"phase iteration cap ({phase.max_iterations})"
        # one last analysis pass so that extraction sees complete facts
        if pre:
            self._run(f"(run-schedule {pre})")
        stats.phases.append((phase.name, reason, stats.iterations - start, self.size()))
        # a phase that stops at its own cap hands a partial e-graph to the next phase;
        # that is reported, but only a schedule-wide limit ends the run
        return "" if reason in ("saturated",) or reason.startswith("phase iteration cap") else reason

    # -- export ----------------------------------------------------------------------
    def serialized(self) -> dict:
        """The e-graph as {'nodes': {id: {op, children, eclass}}, ...} (egglog's JSON)."""
        return json.loads(self._eg.serialize([]).to_json())


def _rs(theory: str) -> str:
    return "th_" + theory.replace("-", "_")


def _parse_sizes(out) -> int:
    s = repr(out)
    import re
    return sum(int(n) for n in re.findall(r"', (\d+)\)", s))
