"""Every registered rule is proved sound for all block sizes, its float tag agrees
with the one derived in float32, and it belongs to a registered theory."""
import json
import time

import pytest

from acefuse.rules import REGISTRY, THEORIES
from acefuse.proofs import prove_rule, prove_rules, clear_memory_cache, cache_path

BLOCK_OPS = ("Sum", "RMax", "RMin", "Cnt", "St", "UB")


def _has_blocks(rule):
    terms = [rule.lhs] + ([rule.rhs] if rule.rhs is not None else []) + list(rule.when) + list(rule.then)
    return any(t.op in BLOCK_OPS or (t.op == "?" and t.args[1] == "Blk") for x in terms for t in x.walk())


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rule_is_proved(name):
    rule = REGISTRY[name]
    res = prove_rule(rule, use_cache=False)
    assert res.status == "proved", res.summary()
    assert res.counterexample is None
    # proved by a method that covers every block size (never by trying a few sizes)
    if _has_blocks(rule):
        assert res.scope == "for all block sizes", res.summary()
        assert res.method.startswith(("sympy, block aggregates", "sympy, induction on", "order types")), res.method
    else:
        assert res.scope.startswith("no blocks") and res.method == "sympy identity", res.summary()
    # the declared float-safety tag is the derived one
    assert res.float_note == "", f"{name}: {res.float_note}"
    assert bool(res.float_unsafe) == bool(rule.float_unsafe)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rule_has_registered_theory(name):
    rule = REGISTRY[name]
    assert rule.theory in THEORIES, f"rule {name!r} names theory {rule.theory!r}, not in THEORIES"
    assert any(r.name == name for r in THEORIES[rule.theory].rules)


def test_cache_makes_reloading_cheap(tmp_path, monkeypatch):
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    clear_memory_cache()
    try:
        t0 = time.process_time()
        cold = prove_rules(REGISTRY)
        cpu = time.process_time() - t0
        assert all(r.ok for r in cold)
        assert cpu < 10.0, f"proving {len(cold)} rules cold took {cpu:.1f} s of CPU (the budget is 10 s)"
        assert cache_path() == tmp_path / "proofs.json" and cache_path().exists()
        clear_memory_cache()  # a fresh process: only the disk cache is left
        t0 = time.perf_counter()
        warm = prove_rules(REGISTRY)
        elapsed = time.perf_counter() - t0
        assert [r.status for r in warm] == [r.status for r in cold]
        assert all(r.cached for r in warm)
        assert elapsed < 0.5, f"loading {len(warm)} cached proofs took {elapsed:.3f} s"
    finally:
        clear_memory_cache()


def test_cli_proves_registry_and_user_file(tmp_path, monkeypatch, capsys):
    from acefuse.proofs.cli import main
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    clear_memory_cache()
    try:
        assert main([]) == 0
        out = capsys.readouterr().out
        assert f"{len(REGISTRY)}/{len(REGISTRY)} proved" in out
        (line,) = [x for x in out.splitlines() if x.startswith("sum-split ")]
        assert "induction" in line and "for all block sizes" in line
        assert "every declared float_unsafe tag agrees" in out
        f = tmp_path / "my_rules.py"
        f.write_text(
            "from acefuse.rules import rw, tvars, bvars, inv\n"
            "from acefuse.rewrite.terms import rsum\n"
            "f, k = tvars('f k')\n"
            "s, = bvars('s')\n"
            "good = rw('my-sum-factor', rsum(s, f * k), rsum(s, f) * k, when=[inv(k)])\n"
            "bad = rw('my-sum-factor-no-inv', rsum(s, f * k), rsum(s, f) * k)\n")
        assert main([str(f)]) == 1
        out = capsys.readouterr().out
        assert "my-sum-factor " in out and "my-sum-factor-no-inv" in out and "counterexample" in out
        assert main([str(f), "--json"]) == 1
        import json
        data = json.loads(capsys.readouterr().out)
        assert {d["name"]: d["status"] for d in data} == {"my-sum-factor": "proved",
                                                          "my-sum-factor-no-inv": "refuted"}
    finally:
        clear_memory_cache()


def test_library_float_tags_are_checked():
    """The tags the issue named: nonzero-exp is false in float32, distribute-mul-add is
    tagged like distribute-mul-sub, and the derived tag says why (with a point)."""
    res = {n: prove_rule(REGISTRY[n], use_cache=False) for n in
           ("nonzero-exp", "distribute-mul-add", "distribute-mul-sub", "add-comm", "exp-add")}
    assert res["nonzero-exp"].float_kind == "range" and "float32" in res["nonzero-exp"].float_unsafe
    assert res["distribute-mul-add"].float_unsafe and res["distribute-mul-sub"].float_unsafe
    assert res["exp-add"].float_kind == "range"
    assert res["add-comm"].float_unsafe == "" and res["add-comm"].float_safe


def test_edited_cache_is_detected_and_reproved(tmp_path, monkeypatch, capsys):
    """Editing the cache into a lie (refuted -> proved) is detected by its HMAC."""
    from acefuse.rules import rw, tvars
    a, b = tvars("a b")
    wrong = rw("cache-wrong-sub-comm", a - b, b - a)
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    clear_memory_cache()
    try:
        assert prove_rules([wrong])[0].status == "refuted"
        assert (tmp_path / "proofs.key").exists()
        data = json.loads(cache_path().read_text())
        (entry,) = [v for v in data.values() if v["result"]["name"] == wrong.name]
        entry["result"]["status"] = "proved"
        entry["result"]["counterexample"] = None
        cache_path().write_text(json.dumps(data))
        clear_memory_cache()
        capsys.readouterr()
        res = prove_rules([wrong])[0]
        assert res.status == "refuted" and not res.cached
        err = capsys.readouterr().err
        assert "failed authentication" in err and wrong.name in err
        clear_memory_cache()  # the re-proved entry replaced the forged one
        res = prove_rules([wrong])[0]
        assert res.status == "refuted" and res.cached
        assert "failed authentication" not in capsys.readouterr().err
    finally:
        clear_memory_cache()


def test_cache_is_keyed_by_the_checker_source(monkeypatch):
    from acefuse.proofs import cache, rules
    r = REGISTRY["sum-split"]
    k1 = rules.rule_key(r)
    monkeypatch.setattr(cache, "_CHECKER_HASH", "0" * 64)
    assert rules.rule_key(r) != k1
