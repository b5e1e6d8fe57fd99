"""Schedules: named compositions of theories, run with limits.

A schedule is a sequence of phases; each phase first saturates its analysis
theories, then runs one iteration of its theories together, and repeats until
nothing changes (the phase *saturated*), its own iteration cap is reached, or a
schedule-wide limit is hit. ``RunStats.stop_reason`` says why the whole run
stopped and ``RunStats.phases`` why each phase did.

Why DERIVE is staged: linearity and factoring of invariants create a new
reduction for every way of splitting a product, and every class that later
merges (``s_A - s_A = 0``, ``(s/n) * n = s``) multiplies those choices again.
Running them all at once blows past any node limit (two-pass layernorm: >8000
e-nodes before the parallel-variance form appears). Staged, each phase only
sees the finite output of the previous one:

1. ``split-shift``: split every reduction over A u B into its parts, and shift
   every state over A u B by its block-local counterparts (``c = d + (c - d)``,
   ``x - (d + e) = (x - d) - e``). Bounded: the shift only matches states.
2. ``expand``: exponential laws and polynomial expansion of the shifted bodies
   (``exp((x - m_A) - e) = exp(x - m_A) * exp(-e)``,
   ``((x - r_A) - e)^2 = (x - r_A)^2 - 2 (x - r_A) e + e^2``). Expanding
   rewrites only: terminates on any finite e-graph.
3. ``factor``: linearity of sums and factoring of invariants turn each raw
   reduction over a finished block into that block's state (user rules run here).
4. ``simplify``: size-reducing field identities (``(a / b) * b = a``,
   ``a - a = 0``, ``0 * a = 0``), which is where ``sum_A (x - r_A) = 0`` closes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from acefuse.rewrite.egraph import Limits


@dataclass(frozen=True)
class Phase:
    name: str
    theories: tuple
    analysis: tuple = ("analysis", "functions")
    max_iterations: int = 12


@dataclass(frozen=True)
class Schedule:
    name: str
    phases: tuple
    limits: Limits = field(default_factory=Limits)

    def theories(self) -> set:
        return {t for p in self.phases for t in p.theories + p.analysis}


# Derive corrections (see the module docstring for why the phases are ordered so).
DERIVE = Schedule("derive", (
    Phase("split-shift", ("reduction", "assoc", "swap", "order")),
    Phase("expand", ("polynomial", "distrib", "exponential")),
    Phase("factor", ("linearity", "swap", "user")),
    Phase("simplify", ("arith", "order")),
), Limits(iterations=60, nodes=8_000, seconds=5.0))

# Normal form of a program before states are defined (e.g. pull an invariant
# divisor out of a sum so the division happens once per row).
NORMALIZE = Schedule("normalize", (
    Phase("normalize", ("reduction", "linearity", "arith", "assoc", "swap", "commute", "factoring", "order", "user"),
          max_iterations=6),
))

SCHEDULES = {s.name: s for s in (DERIVE, NORMALIZE)}


def validate(schedule: Schedule) -> Schedule:
    """Refuse a schedule that names a theory nobody registered (a misspelled group
    name would otherwise switch its rules off silently)."""
    from acefuse.rules import THEORIES
    unknown = sorted(schedule.theories() - set(THEORIES) - {"user"})
    if unknown:
        raise ValueError(f"schedule {schedule.name!r} names unregistered theories {unknown}; "
                         f"registered: {sorted(THEORIES)} (and 'user' for rules passed to af.fuse)")
    return schedule
