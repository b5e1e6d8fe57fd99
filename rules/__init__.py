"""The rule library: one module per algebraic theory, and the registry of them all.

``THEORIES`` maps a theory name to its ``Theory``; ``REGISTRY`` maps every rule
name to its ``Rule``. Schedules (rewrite/schedules.py) refer to theories by name.
"""
from acefuse.rules.base import Rule, Theory, rw, infer, V, tvars, bvars, inv, nonzero, le, ub, pos, SELF
from acefuse.rules import (analysis, arith, assoc, commute, distrib, exponential, factoring, functions, linearity,
                           monomial, order, polynomial, reduction, shifted, swap)

THEORIES: dict[str, Theory] = {t.name: t for t in (
    analysis.THEORY, reduction.THEORY, linearity.THEORY, arith.THEORY, assoc.THEORY, distrib.THEORY, exponential.THEORY,
    order.THEORY, commute.THEORY, factoring.THEORY, polynomial.THEORY, swap.THEORY, functions.THEORY,
    monomial.THEORY, shifted.THEORY)}


def _registry():
    reg: dict[str, Rule] = {}
    for th in THEORIES.values():
        for r in th.rules:
            if r.name in reg:
                raise ValueError(f"rule name {r.name!r} is defined twice (theories "
                                 f"{reg[r.name].theory!r} and {th.name!r}); rename one")
            reg[r.name] = r
    return reg


REGISTRY: dict[str, Rule] = _registry()

__all__ = ["Rule", "Theory", "rw", "infer", "V", "tvars", "bvars", "inv", "nonzero", "le", "ub", "pos",
           "SELF", "THEORIES", "REGISTRY"]
