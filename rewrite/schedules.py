"""Schedules: named compositions of theories, run with limits.

A schedule is a sequence of phases; each phase first saturates its analysis
theories, then runs one iteration of its theories together, and repeats until
nothing changes or a limit is hit (``RunStats.stop_reason`` says which).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from acefuse.rewrite.egraph import Limits


@dataclass(frozen=True)
class Phase:
    name: str
    theories: tuple
    analysis: tuple = ("analysis",)
    max_iterations: int = 12


@dataclass(frozen=True)
class Schedule:
    name: str
    phases: tuple
    limits: Limits = field(default_factory=Limits)

    def theories(self) -> set:
        return {t for p in self.phases for t in p.theories + p.analysis}


# Derive corrections: split reductions over the union of two blocks, shift global
# values by their block-local counterparts, then let algebra and factoring of
# invariants turn every raw reduction over a finished block back into its state.
DERIVE = Schedule("derive", (
    Phase("algebra", ("reduction", "arith", "assoc", "distrib", "exponential", "order", "user"),
          max_iterations=14),
))

# Normal form of a program before states are defined (e.g. pull an invariant
# divisor out of a sum so the division happens once per row).
NORMALIZE = Schedule("normalize", (
    Phase("normalize", ("reduction", "arith", "assoc", "commute", "factoring", "order", "user"),
          max_iterations=6),
))

SCHEDULES = {s.name: s for s in (DERIVE, NORMALIZE)}
