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
    # a rule with more matches than this in one iteration is skipped in that iteration
    # (egglog's back-off scheduler, a fresh one per iteration: every iteration counts all of
    # a rule's matches). Without it one iteration is unbounded: when an e-class holds
    # thousands of products (every product with a zero factor joins the zero class), a rule
    # over a product of products matches quadratically often (a gradient's normal form:
    # 3.8 million matches of mul-assoc on 5,211 e-nodes, 3.2 million e-nodes after 23 s,
    # before any limit was checked). Skipping only loses equalities, never adds a wrong one;
    # RunStats.skipped names the rules skipped, and a phase held up only by skipped rules
    # stops with "match limit" rather than "saturated". None: egglog's plain run.
    match_limit: int | None = 20_000
    # ... applied from this many e-nodes on: a scheduler costs a few ms per iteration (its
    # rules are compiled again), and below it egglog's plain run gives the same e-graph
    # (nothing is skipped) sooner. Small e-graphs grow moderately in one iteration (in the
    # stall above, 677 e-nodes became 5,211), and the next iteration runs under the limit
    match_limit_from: int = 400


@dataclass
class RunStats:
    """Why and where a saturation run stopped."""

    stop_reason: str = ""
    iterations: int = 0
    nodes: int = 0
    seconds: float = 0.0
    # rule name -> total matches (an iteration under the match limit's scheduler counts every
    # match again, those applied before too: egglog's plain run counts only new ones)
    matches: dict = field(default_factory=dict)
    first_iteration: dict = field(default_factory=dict)  # rule name -> first iteration it matched
    phases: list = field(default_factory=list)           # (phase, why it stopped, iterations, e-nodes)
    skipped: dict = field(default_factory=dict)          # rule name -> iterations it was skipped (match limit)
    largest: int = 0                                     # the most e-nodes after any iteration (rolled back or not)

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
            capped = [(p, why) for p, why, _, _ in stats.phases if why != "saturated"]
            stats.stop_reason = ("saturated" if not capped else "; ".join(
                ("phase iteration cap" if why.startswith("phase iteration cap") else why) + f" in {p!r}"
                for p, why in capped))
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
        plain = f"(run {combined})"
        # scoped to its run-schedule command: a fresh scheduler per iteration
        guarded = (None if limits.match_limit is None else
                   f"(let-scheduler _bo (back-off :match-limit {int(limits.match_limit)})) (run-with _bo {combined})")
        rules = {r.name for t in phase.theories if _rs(t) in self.rulesets for r in self.rulesets[_rs(t)]}
        reason = ""
        for _ in range(phase.max_iterations):
            if limits.rollback:
                self.push()
            sched = guarded is not None and self.size() >= limits.match_limit_from
            out = self._run(f"(run-schedule {pre} {guarded if sched else plain})")
            stats.iterations += 1
            changed, held, applied = False, False, set()
            for rep in out:
                if not hasattr(rep, "report"):
                    continue
                # the matches applied (with a scheduler, its query's own report counts every
                # match found, those of skipped rules too)
                for name, n in rep.report.num_matches_per_rule.items():
                    if n:
                        applied.add(name)
                        stats.matches[name] = stats.matches.get(name, 0) + n
                        stats.first_iteration.setdefault(name, stats.iterations)
                changed = changed or any(it.rule_set_report.changed for it in rep.report.iterations)
                # the scheduler reports the run as updated while it holds a rule back
                held = held or (sched and rep.report.updated)
            # a fresh scheduler finds every match again, and a rule's matches only grow with the
            # e-graph: one that matched before and applied nothing now was skipped (one skipped
            # at its first match is covered by ``held``)
            for name in (rules & set(stats.matches) - applied) if sched else ():
                stats.skipped[name] = stats.skipped.get(name, 0) + 1
            if not changed:
                reason = "saturated" if not held else (
                    f"match limit ({limits.match_limit} matches of one rule in one iteration; skipped: "
                    + (", ".join(sorted(rules & set(stats.skipped))) or "rules not yet matched") + ")")
                break
            n = self.size()
            stats.largest = max(stats.largest, n)
            if n > limits.nodes:   # before the time limit: an iteration past it is rolled back
                reason = f"node limit ({n} > {limits.nodes} e-nodes)"
                if limits.rollback:
                    self.pop()
                    reason += ", its last iteration rolled back"
                break
            if stats.iterations >= limits.iterations:
                reason = f"iteration limit ({limits.iterations})"
                break
            if time.perf_counter() - t0 > limits.seconds:
                reason = f"time limit ({limits.seconds} s)"
                break
        else:
            reason = f"phase iteration cap ({phase.max_iterations})"
        # one last analysis pass so that extraction sees complete facts
        if pre:
            self._run(f"(run-schedule {pre})")
        stats.phases.append((phase.name, reason, stats.iterations - start, self.size()))
        # a phase that stops at its own cap hands a partial e-graph to the next phase;
        # that is reported, but only a schedule-wide limit ends the run
        return "" if reason in ("saturated",) or reason.startswith(("phase iteration cap", "match limit")) else reason

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
