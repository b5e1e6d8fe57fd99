"""Soundness of acefuse: proofs of rules and certificates of derived updates.

* ``prove_rule(rule) -> ProofResult``: a rewrite or analysis rule, proved with
  sympy for all block sizes (block aggregates, induction over the block:
  induction.py), or refuted with a 50-digit counterexample (search.py); its
  float-safety tag derived in float32 (``.float_unsafe``, floatcheck.py); cached
  with an HMAC, keyed by the checker's source (cache.py). See rules.py.
* ``require_proved(rules, allow_unproved=False)``: the loader's gate; raises
  ``UnprovedRuleError`` naming every rule that is not proved.
* ``certify(states, name, rhs) -> Certificate``: a derived update or merge
  ``St(name, A u B) = rhs``, checked with sympy and float64 (certify.py).
* ``cli.main(argv)``: ``acefuse prove [FILE.py] [--json]``.
"""
from acefuse.proofs.rules import (ProofResult, UnprovedRuleError, prove_rule, prove_rules,
                                  require_proved, cache_path, clear_memory_cache, CHECKER_VERSION,
                                  rule_key)
from acefuse.proofs.certify import Certificate, StateDef, certify

__all__ = ["ProofResult", "UnprovedRuleError", "prove_rule", "prove_rules", "require_proved",
           "cache_path", "clear_memory_cache", "CHECKER_VERSION", "rule_key", "Certificate", "StateDef", "certify"]
