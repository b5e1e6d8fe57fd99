"""Soundness of acefuse: proofs of rules and certificates of derived updates.

* ``prove_rule(rule) -> ProofResult``: a rewrite or analysis rule, proved with
  sympy (on symbolic blocks for reduction laws), or refuted with a 50-digit
  counterexample (rules.py).
* ``require_proved(rules, allow_unproved=False)``: the loader's gate; raises
  ``UnprovedRuleError`` naming every rule that is not proved.
* ``certify(states, name, rhs) -> Certificate``: a derived update or merge
  ``St(name, A u B) = rhs``, checked with sympy and float64 (certify.py).
* ``cli.main(argv)``: ``acefuse prove [FILE.py] [--json]``.
"""
from acefuse.proofs.rules import (ProofResult, UnprovedRuleError, prove_rule, prove_rules,
                                  require_proved, cache_path, clear_memory_cache, CHECKER_VERSION)
from acefuse.proofs.certify import Certificate, StateDef, certify

__all__ = ["ProofResult", "UnprovedRuleError", "prove_rule", "prove_rules", "require_proved",
           "cache_path", "clear_memory_cache", "CHECKER_VERSION", "Certificate", "StateDef", "certify"]
