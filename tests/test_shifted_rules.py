"""The shift-invariance law as proved library rules (rules/shifted.py), and the checker rejecting
wrong variants of it.

``shifted-sum-ge-one``: ``sum_s(exp(f - max_s f)) >= 1`` for every block size (induction over the
block with sums linear in their bodies, proofs/induction.py); ``pos-of-ge-one``: ``a >= 1 |- a > 0``;
``exp-div-log``: ``exp(a - b) / c = exp(a - (b + log c))`` for ``c > 0``. The backward's Python
normal forms (acefuse/backward_normal.py, acefuse/backward_shift.py) cite them and apply them only while they are proved; the
``backward-normal`` schedule runs them in an e-graph.
"""
import sys

import pytest

import acefuse as af
import acefuse.backward_shift as bn
from acefuse.rules import REGISTRY, THEORIES
from acefuse.rules.base import Theory, infer, rw, tvars, bvars, le, nonzero, pos, SELF
from acefuse.rewrite.terms import Term, rsum, rmax, exp, log, num, J, elm
from acefuse.proofs import prove_rule
from acefuse.proofs.rules import _Prover
from acefuse.proofs.induction import SymbolicProver

f, a, b, c = tvars("f a b c")
s, = bvars("s")
SHIFTED = rsum(s, exp(f - rmax(s, f)))


def _rule(r):
    return Theory("test", "", [r]).rules[0]


def _symbolic_proves(rule) -> bool:
    """The symbolic prover alone (no random search): does it claim a proof?"""
    p = _Prover(rule)
    return SymbolicProver(rule, p.facts, p._premises, p._goal).run()[0]


def test_the_rules_are_registered_and_proved_for_every_block_size():
    assert {r.name for r in THEORIES["shifted"].rules} == {"shifted-sum-ge-one", "pos-of-ge-one", "exp-div-log"}
    res = prove_rule(REGISTRY["shifted-sum-ge-one"], use_cache=False)
    assert res.ok and res.scope == "for all block sizes" and res.method.startswith("sympy, induction on"), res.summary()
    for n in ("pos-of-ge-one", "exp-div-log"):
        assert prove_rule(REGISTRY[n], use_cache=False).ok
    assert bn.laws_proved(bn.SHIFT_LAW) and bn.laws_proved(bn.FOLD_LAW)


@pytest.mark.parametrize("wrong", [
    # the shift by an arbitrary value, not the block's max: sum_s(exp(f - c)) can be < 1
    infer("wrong-shift-by-any", rsum(s, exp(f - c)), le(num(1.0), SELF)),
    # a bound the max does not give: one element gives exactly 1
    infer("wrong-ge-two", SHIFTED, le(num(2.0), SELF)),
    infer("wrong-le-one", SHIFTED, le(SELF, num(1.0))),
    # without the side condition: a = 0 is not positive
    infer("wrong-pos-without-premise", a, [le(num(0.0), SELF), nonzero(SELF)]),
    # without c > 0, log(c) is undefined where the lhs is defined
    rw("wrong-exp-div-log-any-c", exp(a - b) / c, exp(a - (b + log(c)))),
], ids=lambda r: r.name)
def test_wrong_variants_are_rejected(wrong):
    r = _rule(wrong)
    res = prove_rule(r, use_cache=False)
    assert res.status == "refuted", res.summary()
    assert not _symbolic_proves(r), f"the symbolic prover claims {r.name}"


def test_induction_with_linear_sums_is_what_proves_it(monkeypatch):
    """Without the new induction mode (linear sums, a positive non-numeric coefficient in the
    hypothesis) the law is left unproved, not refuted: the extension is what proves it."""
    from acefuse.proofs import induction
    orig = induction.SymbolicProver._induct
    assert _symbolic_proves(REGISTRY["shifted-sum-ge-one"])
    monkeypatch.setattr(induction.SymbolicProver, "_induct",
                        lambda self, s_, binding, depth: (False, "") if self._linear else
                        orig(self, s_, binding, depth))
    assert not _symbolic_proves(REGISTRY["shifted-sum-ge-one"])


def test_backward_normal_schedule_derives_the_logsumexp_read():
    """In an e-graph with the backward-normal schedule: exp(x - m) / l = exp(x - (m + log l)) for
    l = sum_J(exp(x - max_J x)); not without shifted-sum-ge-one, not for a sum shifted by another
    value."""
    from acefuse.rewrite.egraph import EGraph
    from acefuse.rewrite.schedules import BACKWARD_NORMAL, SCHEDULES
    assert SCHEDULES["backward-normal"] is BACKWARD_NORMAL
    rules = [r for r in REGISTRY.values() if r.theory in BACKWARD_NORMAL.theories()]
    x, y = elm("x"), elm("y")

    def derives(rules, m):
        l = rsum(J, exp(x - m))
        eg = EGraph(rules)
        eg.add(exp(x - m) / l)
        eg.saturate(BACKWARD_NORMAL)
        return eg.check(exp(x - m) / l, exp(x - (m + log(l))))
    assert derives(rules, rmax(J, x))
    assert not derives([r for r in rules if r.name != "shifted-sum-ge-one"], rmax(J, x))
    assert not derives(rules, rmax(J, y))   # shifted by the max of another family


def test_python_normal_form_applies_the_law_only_while_it_is_proved(monkeypatch):
    """A wrong rule under the law's name (the shift by any value) fails its proof: the backward
    then keeps the max's adjoint (a tie count) and saves the max and the sum, never using it."""
    import acefuse.rules as R
    monkeypatch.setitem(R.REGISTRY, "shifted-sum-ge-one",
                        _rule(infer("shifted-sum-ge-one", rsum(s, exp(f - c)), le(num(1.0), SELF))))
    monkeypatch.setattr(bn, "_PROVED", {})
    assert not bn.laws_proved(bn.SHIFT_LAW)
    lse = af.program("lse_gate", y=af.max(af.tensor("x", "r j"), "j") + af.log(af.sum(af.exp(
        af.tensor("x", "r j") - af.max(af.tensor("x", "r j"), "j")), "j")))
    bwd = af.backward(lse)
    assert sorted(bwd.saved) == ["saved_m", "saved_s"]
    assert any(t.op == "CmpEq" for e in bwd.outputs.values() for t in e.term.walk())   # the tie routing
    monkeypatch.undo()
    bn._PROVED.clear()
    bwd = af.backward(lse)
    assert sorted(bwd.saved) == ["saved_lse"]
    assert not any(t.op == "CmpEq" for e in bwd.outputs.values() for t in e.term.walk())
