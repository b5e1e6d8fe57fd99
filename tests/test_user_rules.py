"""A user rule, proved at load, changes what fuses; a wrong one is refused."""
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.proofs import UnprovedRuleError
from acefuse.rules import rw, tvars
from acefuse.reference import evaluate

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "user_rule.py"))


def test_user_rule_makes_a_program_fusible_and_the_kernel_is_right():
    prog = EX["renyi2"]
    assert not af.fuse(prog).fusible
    f = af.fuse(prog, rules=EX["RULES"])
    assert f.fusible
    assert "mul-assoc-right-to-left" in f.rule_chain("s", "rolling")
    assert all(c.status == "certified" for c in f.certificate.values())
    k = af.compile(prog, rules=EX["RULES"])
    x = torch.randn(5, 77) * 4
    ref = evaluate(prog, {"x": x.double()})["h"]
    for sched, kw in (("loop", {"block_j": 16}), ("split", {"block_j": 16, "nsplit": 3})):
        got = k(x=x, schedule=sched, **kw).double().numpy()
        assert np.max(np.abs(got - ref)) < 1e-4


def test_a_wrong_user_rule_is_refused_at_load():
    a, b = tvars("a b")
    wrong = rw("exp-of-product", af.rewrite_terms.exp(a * b), af.rewrite_terms.exp(a) * af.rewrite_terms.exp(b))
    with pytest.raises(UnprovedRuleError, match="exp-of-product"):
        af.fuse(EX["renyi2"], rules=[wrong])


def test_the_opt_out_is_loud(capsys):
    a, b = tvars("a b")
    wrong = rw("sub-comm-wrong", a - b, b - a)
    f = af.fuse(EX["renyi2"], rules=[wrong], allow_unproved=True)
    assert f is not None
    err = capsys.readouterr().err
    assert "sub-comm-wrong" in err and "UNPROVED" in err.upper()


def test_positivity_side_conditions_are_premises_of_the_proof():
    from acefuse.proofs import require_proved
    from acefuse.rules import pos, nonzero
    a, b, c = tvars("a b c")
    T = af.rewrite_terms
    good = rw("my-log-mul", T.log(a * b), T.log(a) + T.log(b), when=[pos(a), pos(b)])
    assert len(good.when) == 4            # pos(t) is le(0, t) and nonzero(t)
    assert require_proved([good])[0].status == "proved"
    wrong_var = rw("my-log-mul-wrong-var", T.log(a * b), T.log(a) + T.log(b), when=[pos(c), nonzero(a)])
    with pytest.raises(UnprovedRuleError, match="my-log-mul-wrong-var"):
        require_proved([wrong_var])
    with pytest.raises(ValueError, match="not a relation fact"):
        rw("my-bad-condition", a, a, when=[a + b])
