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

``DERIVE_BINOMIAL`` and ``DERIVE_AUXILIARY`` (``discovery``) derive a pass again
only when one of its states has no reachable rolling form, to discover auxiliary
states (rewrite/auxiliary.py).
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


def discovery(schedule: Schedule) -> tuple:
    """The schedules a pass is derived again with, in order, when one of its states has no
    reachable rolling form (auxiliary-state discovery, rewrite/auxiliary.py); each is tried
    only when the one before proposes nothing:

    1. ``+binomial``: the schedule without general distributivity (``distrib``), with the
       ``monomial`` theory in its ``factor`` phase. The binomial rules alone
       (rules/polynomial.py) expand a shifted power into monomials times invariants, and
       the e-graph stays small (``sum (x - m)**3``: 1,400 e-nodes, where distributivity
       passes the 8,000 node limit before factoring runs);
    2. ``+auxiliary``: the schedule itself with ``monomial`` in ``factor`` (a weight times a
       square, ``sum w (x - m)**2``, or ``exp(x - m) * (x - m)``, needs distributivity).

    Empty for a schedule without ``expand`` and ``factor`` phases. Kept out of DERIVE, so
    programs that fuse without auxiliary states pay nothing."""
    names = [p.name for p in schedule.phases]
    if "factor" not in names or "expand" not in names or "+" in schedule.name:
        return ()

    def variant(suffix, drop):
        phases = tuple(Phase(p.name, tuple(t for t in p.theories if t not in drop)
                             + (("monomial",) if p.name == "factor" and "monomial" not in p.theories else ()),
                             p.analysis, p.max_iterations) for p in schedule.phases)
        return Schedule(f"{schedule.name}+{suffix}", phases, schedule.limits)
    return variant("binomial", ("distrib",)), variant("auxiliary", ())


# Derive corrections with auxiliary-state discovery (a pass where a state has no reachable form).
DERIVE_BINOMIAL, DERIVE_AUXILIARY = discovery(DERIVE)

# The laws of a sum shifted by its own max (rules/shifted.py): what the backward's normal forms
# (acefuse/backward_normal.py) apply over named axes, by name; kept out of the forward's schedules.
BACKWARD_NORMAL = Schedule("backward-normal", (
    Phase("shifted", ("shifted", "arith")),
))

SCHEDULES = {s.name: s for s in (DERIVE, DERIVE_BINOMIAL, DERIVE_AUXILIARY, NORMALIZE, BACKWARD_NORMAL)}


def validate(schedule: Schedule) -> Schedule:
    """Refuse a schedule that names a theory nobody registered (a misspelled group
    name would otherwise switch its rules off silently)."""
    from acefuse.rules import THEORIES
    unknown = sorted(schedule.theories() - set(THEORIES) - {"user"})
    if unknown:
        raise ValueError(f"schedule {schedule.name!r} names unregistered theories {unknown}; "
                         f"registered: {sorted(THEORIES)} (and 'user' for rules passed to af.fuse)")
    return schedule
