"""Auxiliary states (rewrite/auxiliary.py): reductions a merge needs that the program does not
compute, proposed by the rewrite system, chosen by extraction, named by explain(), certified,
and run against an independent float64 reference in every schedule, at a large offset too."""
import numpy as np
import pytest
import torch

import acefuse as af
from acefuse.reference import evaluate, random_inputs
from acefuse.rewrite import schedules
from acefuse.rewrite.terms import Term, pretty
from tests.programs import run_schedules

SCHEDULES = [("single", {}), ("loop", {"block_j": 16}), ("split", {"block_j": 16, "nsplit": 3})]


def _x():
    return af.tensor("x", "r j")


def _programs():
    x, w = _x(), af.tensor("w", "r j")
    m, mn = af.max(x, "j"), af.min(x, "j")
    pw = af.exp(w)   # positive weights: the weighted mean's denominator stays away from 0
    return {
        # name: (program, the auxiliary sums expected, as program-level reductions)
        "sq_dev_from_max": (af.program("sq_dev_from_max", out=af.sum((x - m) ** 2, "j")), ["sum_j(x - max_j(x))"]),
        "weighted_dev_from_min": (af.program("weighted_dev_from_min", out=af.sum((x - mn) * w, "j")),
                                  ["sum_j(w)"]),
        "entropy_like": (af.program("entropy_like", out=af.sum(af.exp(x - m) * (x - m), "j")),
                         ["sum_j(exp(x - max_j(x)))"]),
        "weighted_var_max_shift": (af.program("weighted_var_max_shift",
                                              out=af.sum(pw * (x - m) ** 2, "j") / af.sum(pw, "j")),
                                   ["sum_j((x - max_j(x)) * exp(w))"]),
        # a third power needs the second and the first: auxiliaries of auxiliaries
        "cube_from_max": (af.program("cube_from_max", out=af.sum((x - m) ** 3, "j")),
                          ["sum_j((x - max_j(x)) * (x - max_j(x)))", "sum_j(x - max_j(x))"]),
        "dev_times_abs": (af.program("dev_times_abs", out=af.sum((x - m) * af.abs(x), "j")), ["sum_j(abs(x))"]),
        # two shifts in one body: one auxiliary per shifted quantity
        "max_and_min_shift": (af.program("max_and_min_shift", out=af.sum((x - m) * (x - mn), "j")),
                              ["sum_j(x - max_j(x))", "sum_j(x - min_j(x))"]),
    }


def _aux(f):
    return [s for s in f.encoding.states if s.aux]


def _check(prog, sizes, offset=0.0, scale=3.0, tol=2e-5, seed=0):
    k = af.compile(prog)
    inputs = random_inputs(prog, sizes, scale=scale, seed=seed)
    if offset:
        inputs["x"] = inputs["x"] + offset
    ref = evaluate(prog, {n: t.double() for n, t in inputs.items()})
    ran = []
    for sched, out in run_schedules(k, prog, inputs, SCHEDULES):
        for name, r in ref.items():
            got = out[name].double().numpy()
            assert np.all(np.isfinite(got)), f"{prog.name}.{name} [{sched}]: non-finite output"
            err = np.max(np.abs(got - r) / np.maximum(np.abs(r), 1.0))
            assert err <= tol, f"{prog.name}.{name} [{sched}, offset {offset}]: max rel err {err:.3e}"
        ran.append(sched)
    return k, ran


# ---- discovery ------------------------------------------------------------------------------------
def test_square_from_max_discovers_the_shifted_block_sum_and_fuses_in_one_pass():
    prog, _ = _programs()["sq_dev_from_max"]
    f = af.fuse(prog)
    assert f.fusible and len(f.passes) == 1 and f.passes[0].split_ok
    aux = _aux(f)
    assert len(aux) == 1
    # the cost model's cancellation term picks the shifted sum, not the raw moment sum_S(x)
    assert pretty(aux[0].definition) == "sum_A(x - m_A)"
    name = aux[0].name
    assert name in pretty(f.passes[0].rolling["s"]) and name in pretty(f.passes[0].merge["s"])
    text = f.explain()
    assert f"auxiliary state, discovered: the update of s" in text
    assert "sum_A(x - m_A)" in text and "no state of the program carries" in text
    assert f.certificate.ok
    assert f.to_json()["fusible"]


@pytest.mark.parametrize("name", ["weighted_dev_from_min", "entropy_like",
                                  pytest.param("weighted_var_max_shift", marks=pytest.mark.slow),
                                  "cube_from_max", "dev_times_abs",
                                  pytest.param("max_and_min_shift", marks=pytest.mark.slow)])
def test_programs_of_other_shapes_discover_their_auxiliary_states(name):
    prog, expected = _programs()[name]
    f = af.fuse(prog)
    assert f.fusible and len(f.passes) == 1, f.reason
    assert sorted(pretty(s.source) for s in _aux(f)) == sorted(expected)
    assert f.certificate.ok
    assert "auxiliary state, discovered" in f.explain()


def test_a_program_that_fuses_without_help_gets_no_auxiliary_state_and_the_plain_schedule():
    x = _x()
    prog = af.program("indep", out=af.sum(af.abs(x) ** 2, "j") - af.max(x, "j") * af.sum(x, "j"))
    f = af.fuse(prog)
    assert f.fusible and not _aux(f)
    assert all(p.schedule == schedules.DERIVE for p in f.passes)
    assert "auxiliary" not in f.explain()


def test_a_sum_the_program_already_computes_is_used_not_duplicated():
    # sum_j(x - max_j x) is a state of this program: the correction of the square reads it
    x = _x()
    m = af.max(x, "j")
    prog = af.program("ratio", out=af.sum((x - m) ** 2, "j") / af.sum(x - m, "j"))
    f = af.fuse(prog)
    assert f.fusible and len(f.passes) == 1 and not _aux(f)


@pytest.mark.parametrize("body", ["abs", "tanh", pytest.param("gauss", marks=pytest.mark.slow)])
def test_programs_no_auxiliary_state_can_fuse_stay_two_pass_and_say_why(body):
    # no finite set of block sums corrects these: abs and tanh do not expand, and
    # exp(-(d - e)^2) = exp(-d^2) exp(2 d e) exp(-e^2) keeps a factor mixing d and e
    x = _x()
    m = af.max(x, "j")
    d = {"abs": af.abs(x - m), "tanh": af.tanh(x - m), "gauss": af.exp(-((x - m) ** 2))}[body]
    prog = af.program(f"two_pass_{body}", out=af.sum(d, "j"))
    f = af.fuse(prog)
    assert not f.fusible and len(f.passes) == 2 and not _aux(f)
    assert "no auxiliary state" in f.reason and "another pass over 'j'" in f.reason
    _check(prog, {"r": 5, "j": 67})   # still right: two passes


# ---- numbers: every schedule, small blocks, float64 reference, at an offset --------------------------
@pytest.mark.parametrize("name", ["sq_dev_from_max", "weighted_dev_from_min",
                                  pytest.param("entropy_like", marks=pytest.mark.slow),
                                  pytest.param("weighted_var_max_shift", marks=pytest.mark.slow),
                                  "cube_from_max", pytest.param("dev_times_abs", marks=pytest.mark.slow)])
def test_kernels_with_auxiliary_states_match_float64(name):
    prog, _ = _programs()[name]
    k, ran = _check(prog, {"r": 6, "j": 203}, scale=2.0, tol=2e-5, seed=3)
    assert k.fusion.fusible and _aux(k.fusion) and ran == ["single", "loop", "split"]


@pytest.mark.parametrize("name", ["sq_dev_from_max", "cube_from_max",
                                  pytest.param("weighted_dev_from_min", marks=pytest.mark.slow),
                                  pytest.param("weighted_var_max_shift", marks=pytest.mark.slow)])
def test_auxiliary_forms_keep_precision_at_an_offset_of_1e4(name):
    # values 1e4 + N(0, 1): the raw-moment form sum x^2 - 2 m sum x + n m^2 would lose every bit;
    # the shifted auxiliary sum (x - m_S) keeps all terms of one sign, so float32 stays accurate
    prog, _ = _programs()[name]
    k, ran = _check(prog, {"r": 5, "j": 203}, offset=1e4, scale=1.0, tol=1e-4, seed=4)
    assert k.fusion.fusible and ran == ["single", "loop", "split"]


# ---- the checkers see a wrong auxiliary form ---------------------------------------------------------
def test_certificate_refuses_a_wrong_update_of_an_auxiliary_state():
    prog, _ = _programs()["sq_dev_from_max"]
    f = af.fuse(prog)
    aux = _aux(f)[0].name
    p = f.passes[0]
    right = p.rolling[aux]
    assert f.certificate.ok
    # drop the correction term: aux_AB = aux_A + sum_B(x - m_AB) (wrong when the max moves)
    p.rolling[aux] = Term("Add", (Term("St", (aux, Term("BA"))), right.args[1]))
    assert not f.certificate.ok
    p.rolling[aux] = right


def test_a_wrong_factoring_rule_is_refuted():
    # the monomial rules move only invariant factors; moving any factor out of a sum is false
    from acefuse.proofs.rules import prove_rule
    from acefuse.rules import rw, tvars, bvars
    from acefuse.rewrite.terms import rsum
    f, g = tvars("f g")
    s, = bvars("s")
    res = prove_rule(rw("sum-factor-anything", rsum(s, f * g), rsum(s, f) * g), use_cache=False)
    assert not res.ok
