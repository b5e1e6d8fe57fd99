"""Every registered rule is proved sound, and belongs to a registered theory."""
import time

import pytest

from acefuse.rules import REGISTRY, THEORIES
from acefuse.proofs import prove_rule, prove_rules, clear_memory_cache, cache_path


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rule_is_proved(name):
    rule = REGISTRY[name]
    res = prove_rule(rule, use_cache=False)
    assert res.status == "proved", res.summary()
    assert res.counterexample is None


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_rule_has_registered_theory(name):
    rule = REGISTRY[name]
    assert rule.theory in THEORIES, f"rule {name!r} names theory {rule.theory!r}, not in THEORIES"
    assert any(r.name == name for r in THEORIES[rule.theory].rules)


def test_cache_makes_reloading_cheap(tmp_path, monkeypatch):
    monkeypatch.setenv("ACEFUSE_CACHE_DIR", str(tmp_path))
    clear_memory_cache()
    try:
        cold = prove_rules(REGISTRY)
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
