"""The workbench (acefuse/workbench/, docs/workbench.md): ``acefuse explore``, ``acefuse show``
and ``acefuse bench`` (its tables and plots from recorded results, on the CPU)."""
from __future__ import annotations

from html.parser import HTMLParser
import importlib
import json
import math
from pathlib import Path
import runpy
import sys

import pytest

import acefuse as af
from acefuse import cli
from acefuse.workbench import corpus as C
from acefuse.workbench import explore as X
from acefuse.workbench import plots as PL

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "benchmarks" / "results"
FUSE = importlib.import_module("acefuse.fuse")   # the module (``acefuse.fuse`` the attribute is af.fuse)
USER = runpy.run_path(str(EXAMPLES / "user_rule.py"))
SUBSET = ["renyi2", "logsumexp", "rmsnorm", "mean_abs_dev"]


def _entry(name):
    return next(e for e in C.builtin() if e.name == name)


# ---- the corpus -----------------------------------------------------------------------------------
def test_builtin_corpus_has_forty_cascaded_programs_of_every_kind():
    entries = C.builtin()
    names = [e.name for e in entries]
    assert len(names) == len(set(names))
    assert {e.category for e in entries} == {"norms", "losses", "statistics", "attention", "routing"}
    cascaded = [e for e in entries if any(FUSE._cascades(e.program, a) for a in e.program.reduced_axes())]
    assert len(cascaded) >= 40, [e.name for e in entries if e not in cascaded]


def test_corpus_from_the_examples_folder_reads_dicts_and_skips_scripts(capsys):
    entries = C.load([str(EXAMPLES)])
    names = {e.name for e in entries}
    assert {"softmax:softmax", "user_rule:renyi2", "masks:document_mask", "norms:layernorm"} <= names
    assert not any(n.startswith("torch_block:") for n in names)   # a script: never run
    assert "max |acefuse" not in capsys.readouterr().out          # (it would have printed this)


def test_corpus_errors_name_the_path(tmp_path):
    with pytest.raises(C.CorpusError, match="no such file or folder"):
        C.load([str(tmp_path / "nope")])
    bad = tmp_path / "bad.py"
    bad.write_text("import acefuse as af\nx = af.tensor('x', 'r j')\np = af.program('p', y=x)\n1 / 0\n")
    with pytest.raises(C.CorpusError, match=r"bad\.py.*ZeroDivisionError"):
        C.load([str(bad)])
    warned = []
    assert C.load([str(tmp_path)], warn=warned.append) == [] and "bad.py" in warned[0]


# ---- explore --------------------------------------------------------------------------------------
def test_explore_user_rule_makes_renyi2_fusible_and_nothing_else_changes(capsys):
    """README's associativity rule on part of the built-in corpus: the Renyi-2 program becomes
    fusible, the rule is needed by its winning derivation, and no other program changes."""
    rc = cli.main(["explore", str(EXAMPLES / "user_rule.py"), "--corpus", "builtin", "--only",
                   ",".join(SUBSET), "--json", "--quiet"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["rules"] == ["mul-assoc-right-to-left"] and rep["ablated"] == []
    rows = {r["program"]: r for r in rep["programs"]}
    assert sorted(rows) == sorted(SUBSET)
    # premise (README, tests/test_user_rules.py): the library alone does not fuse Renyi-2
    renyi2 = _entry("renyi2").program
    assert not af.fuse(renyi2).fusible, "the library alone now fuses renyi2: README's rule example needs a new program"
    r = rows["renyi2"]
    assert (r["before"]["fusible"], r["after"]["fusible"], r["change"]) == (False, True, "gained")
    assert r["after"]["passes"] < r["before"]["passes"]
    assert r["rules_needed"] == ["mul-assoc-right-to-left"]
    assert rep["summary"]["gained"] == ["renyi2"]
    assert rep["summary"]["needs"] == {"mul-assoc-right-to-left": ["renyi2"]}
    for name in SUBSET[1:]:
        assert rows[name]["change"] == "same", rows[name]
        assert rows[name]["rules_needed"] == []
    # the numbers are af.fuse's own
    f = af.fuse(renyi2, rules=USER["RULES"])
    assert r["after"]["passes"] == f.hbm_passes["fused"]
    assert r["after"]["enodes"] == sum(p.stats.nodes for p in f.passes)
    assert r["after"]["cost"] == pytest.approx(sum(c for p in f.passes for c in p.rolling_cost.values()))
    assert r["after"]["matched"]["mul-assoc-right-to-left"] > 0
    assert r["before"]["saturation_ms"] > 0 and r["after"]["derive_ms"] >= r["after"]["saturation_ms"]
    text = X.table(rep)                        # the terminal form of the same report
    assert "no -> yes" in text and "1 gained (renyi2); 3 unchanged" in text
    assert "needed by 1 winning derivation(s) (renyi2)" in text


def test_needed_is_empty_for_a_rule_the_derivation_does_not_use():
    """A proved rule that matches but that no chosen form needs is reported as matched only."""
    from acefuse.rules import rw, tvars
    a, b = tvars("a b")
    comm = rw("add-comm-user", a + b, b + a)
    rep = X.explore([_entry("logsumexp")], [comm], quiet=True)
    row = rep["programs"][0]
    assert row["change"] == "same" and row["rules_matched"] == ["add-comm-user"] and row["rules_needed"] == []


def test_ablating_a_library_rule_reports_the_programs_it_breaks(capsys):
    # which programs need exp-sub, from the library's own ablation (Fusion.rule_chain)
    progs = {n: _entry(n).program for n in ("logsumexp", "rmsnorm", "variance")}
    uses = {n: any("exp-sub" in f.rule_chain(s.name, "rolling") for s in f.states)
            for n, f in ((n, af.fuse(p)) for n, p in progs.items())}
    assert uses == {"logsumexp": True, "rmsnorm": False, "variance": False}
    rc = cli.main(["explore", "--ablate", "exp-sub", "--corpus", "builtin", "--only", ",".join(progs), "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "without exp-sub: 1 program(s) break (logsumexp)" in out
    assert cli.main(["explore", "--ablate", "exp-sub", "--corpus", "builtin", "--only", "logsumexp,rmsnorm,variance",
                     "--quiet", "--json"]) == 0
    rows = {r["program"]: r for r in json.loads(capsys.readouterr().out)["programs"]}
    assert rows["logsumexp"]["change"] == "lost" and rows["logsumexp"]["after"]["passes"] == 2
    assert rows["rmsnorm"]["change"] == rows["variance"]["change"] == "same"
    # the ablated rule really is gone from the run, and only during it
    m = X.measure(progs["logsumexp"], drop=["exp-sub"])
    assert "exp-sub" not in {r.name for r in m.fusion.rules}
    assert "exp-sub" in {r.name for r in FUSE.default_rules()}


def test_explore_bad_input_says_what_to_do(tmp_path, capsys):
    assert cli.main(["explore", "--ablate", "exp-subb", "--corpus", "builtin"]) == 2
    assert "no library rule has that name; did you mean exp-sub" in capsys.readouterr().err
    assert cli.main(["explore", "--corpus", "builtin"]) == 2
    assert "give a rules file" in capsys.readouterr().err
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    assert cli.main(["explore", str(empty), "--corpus", "builtin"]) == 2
    assert "defines no rule" in capsys.readouterr().err
    wrong = tmp_path / "wrong.py"
    wrong.write_text("from acefuse.rules import rw, tvars\na, b = tvars('a b')\n"
                     "RULES = [rw('sub-flip-wrong', a - b, b - a)]\n")
    assert cli.main(["explore", str(wrong), "--corpus", "builtin", "--only", "rmsnorm"]) == 2
    assert "sub-flip-wrong" in capsys.readouterr().err
    assert cli.main(["explore", str(EXAMPLES / "user_rule.py"), "--corpus", "builtin", "--only", "nope"]) == 2
    assert "no program of the corpus" in capsys.readouterr().err


def test_explore_default_corpus_outside_a_checkout(monkeypatch, capsys):
    monkeypatch.setattr(C, "examples_dir", lambda: None)
    assert cli.main(["explore", "--ablate", "exp-sub", "--only", "rmsnorm", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert "the built-in corpus only" in cap.err and "rmsnorm" in cap.out and "no program breaks" in cap.out
    with pytest.raises(C.CorpusError, match="no examples/ folder"):
        C.load(["examples"])


def test_progress_bars_only_on_a_terminal(monkeypatch):
    from acefuse.workbench import progress

    class Tty:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

        def write(self, s):
            return len(s)

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stderr", Tty(True))
    assert progress.enabled() and not progress.enabled(quiet=True)
    assert not progress.bar(range(3), desc="x").disable
    monkeypatch.setattr(sys, "stderr", Tty(False))
    assert not progress.enabled() and progress.bar(range(3)).disable


@pytest.mark.slow
def test_explore_full_builtin_corpus_with_the_user_rule():
    rep = X.explore(C.builtin(), USER["RULES"], quiet=True)
    rows = {r["program"]: r for r in rep["programs"]}
    assert len(rows) >= 40 and not any(r["before"]["error"] or r["after"]["error"] for r in rows.values())
    assert rows["renyi2"]["change"] == "gained"
    for r in rows.values():   # every reported change agrees with the two measurements
        b, a = r["before"], r["after"]
        assert (r["change"] == "gained") == (not b["fusible"] and a["fusible"])
        assert (r["change"] == "lost") == (b["fusible"] and not a["fusible"])


# ---- show -----------------------------------------------------------------------------------------
class _Page(HTMLParser):
    """Collects text, tags (checking that every non-void element is closed), the rule chains
    drawn (per svg: its state, form and the data-rule of its nodes in order) and resources."""

    VOID = {"meta", "br", "hr", "img", "link", "input", "path", "rect", "line", "marker"}

    def __init__(self):
        super().__init__()
        self.text, self.stack, self.errors, self.chains, self.external, self.tags = [], [], [], {}, [], []
        self._svg = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        for k in ("src", "href"):
            if a.get(k) and not a[k].startswith("#") and not a[k].startswith("url(#"):
                self.external.append(a[k])
        if tag == "svg":
            self._svg = (a.get("data-state"), a.get("data-form"))
            self.chains[self._svg] = []
        if tag == "g" and self._svg and "data-rule" in a:
            self.chains[self._svg].append(a["data-rule"])
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag == "svg":
            self._svg = None

    def handle_data(self, data):
        self.text.append(data)


def test_show_writes_a_page_with_every_state_and_rule_chain(tmp_path, capsys):
    from acefuse.rewrite.terms import pretty
    out = tmp_path / "lse.html"
    assert cli.main(["show", str(EXAMPLES / "norms.py"), "--program", "softmax_lse", "--html", str(out), "--quiet"]) == 0
    assert str(out) in capsys.readouterr().out
    page = _Page()
    page.feed(out.read_text())
    page.close()
    assert page.errors == [] and page.stack == []
    assert page.external == [] and "script" not in page.tags and "link" not in page.tags
    text = " ".join(page.text)
    ns = runpy.run_path(str(EXAMPLES / "norms.py"))
    f = af.fuse(ns["softmax_lse"])           # the same derivation, independently
    for s in f.encoding.states:
        assert FUSE._show(s.definition, "S") in text
    chains = 0
    for p in f.passes:
        for s in p.states:
            assert f"{s.name}_B = {pretty(p.init[s.name])}" in text
            for form, forms in (("rolling", p.rolling), ("merge", p.merge)):
                if s.name not in forms:
                    continue
                assert f"{s.name}_AB = {pretty(forms[s.name])}" in text
                assert page.chains[(s.name, form)] == f.rule_chain(s.name, form)
                chains += 1
    assert chains == len(page.chains) >= 4
    assert any(len(c) >= 3 for c in page.chains.values())   # a real chain, not only definitions
    for c in f.certificate.steps:
        assert f"{c.step}" in text and c.status in text
    assert "chosen" in text                                  # the alternatives mark extraction's pick
    assert f"fused {f.hbm_passes['fused']}" in text


def test_show_alternatives_hold_the_chosen_form_at_its_cost():
    from acefuse.workbench.show import alternatives
    from acefuse.rewrite.terms import pretty
    f = af.fuse(_entry("logsumexp").program)
    p = f.passes[0]
    for s in p.states:
        alt = alternatives(f, p, s.name, "rolling", limit=50)
        chosen = [x for x in alt["forms"] if x[2]]
        assert len(chosen) == 1 and chosen[0][1] == pretty(p.rolling[s.name])
        assert chosen[0][0] == pytest.approx(p.rolling_cost[s.name])
        assert all(c >= chosen[0][0] - 1e-9 for c, _, _ in alt["forms"])   # nothing cheaper was passed over
        assert alt["nodes"] >= len(alt["forms"])


def test_show_bad_input(tmp_path, capsys):
    assert cli.main(["show", str(EXAMPLES / "norms.py"), "--program", "nope", "--html", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert "no program named 'nope'" in err and "layernorm" in err
    assert cli.main(["show", str(EXAMPLES / "norms.py"), "--html", str(tmp_path / "x.html")]) == 2
    assert "--program NAME" in capsys.readouterr().err
    assert cli.main(["show", str(tmp_path / "missing.py"), "--html", str(tmp_path / "x.html")]) == 2


# ---- bench: plots and tables from recorded results (CPU) ---------------------------------------------
def test_plots_from_recorded_results(tmp_path):
    pytest.importorskip("matplotlib")   # in the test extra; a bare install says how to get it
    import matplotlib.image as mpimg
    files = sorted(RESULTS.glob("*.json"))
    assert len(files) >= 4
    assert cli.main(["bench", "--plot-only", *map(str, files), "--out", str(tmp_path)]) == 0
    for f in files:
        png = tmp_path / f"{f.stem}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        h, w = mpimg.imread(png).shape[:2]
        assert h > 200 and w > 200
    rows = json.loads((RESULTS / "rows.json").read_text())
    s = PL.series("rows", rows)["softmax"]      # what the plot draws is what the run measured
    want = sorted((r["shape"][1], r["auto_gbs"], r["eager_gbs"]) for r in rows["results"] if r["workload"] == "softmax")
    assert s["x"] == [w[0] for w in want] and len(want) == 3
    assert s["lines"]["acefuse"] == [w[1] for w in want] and s["lines"]["eager"] == [w[2] for w in want]
    pre = json.loads((RESULTS / "prefill.json").read_text())
    causal = PL.series("attention", pre)["causal"]
    r0 = min((r for r in pre["rows"] if r["kind"] == "causal"), key=lambda r: r["N"])
    assert causal["lines"]["SDPA cuDNN"][0] == pytest.approx(r0["flops"] / (r0["sdpa-cudnn_ms"] * 1e-3) / 1e12)
    md = (tmp_path / "tables.md").read_text()
    soft = next(r for r in rows["results"] if r["workload"] == "softmax")
    assert f"| softmax | 16384x8192 | {soft['auto_gbs']:.0f} (" in md and "![rows](rows.png)" in md
    combined = json.loads((tmp_path / "results.json").read_text())
    assert combined["rows"]["kind"] == "rows" and combined["decode"]["kind"] == "decode"


def test_tables_without_matplotlib(tmp_path, monkeypatch):
    """On a GPU machine without matplotlib, bench still writes its tables and says how to plot;
    --plot-only (need_plots) refuses instead."""
    def missing():
        raise PL.PlotError("plots need matplotlib: pip install 'acefuse[bench]'")
    monkeypatch.setattr(PL, "_mpl", missing)
    got = PL.render([RESULTS / "decode.json", RESULTS / "rows.json"], tmp_path, need_plots=False)
    assert got["plots"] == [] and "matplotlib" in got["no_plots"]
    md = (tmp_path / "tables.md").read_text()
    assert "| decode B=8 32q/8kv L=32768 |" in md and "| rmsnorm | 256x262144 |" in md and ".png" not in md
    # the combined results.json reads back as its parts (the hint bench prints points at it)
    PL.render([tmp_path / "results.json"], tmp_path / "again", need_plots=False)
    assert (tmp_path / "again" / "tables.md").read_text() == md
    with pytest.raises(PL.PlotError, match="matplotlib"):
        PL.render([RESULTS / "decode.json"], tmp_path / "x")


def test_plots_of_training_results(tmp_path):
    pytest.importorskip("matplotlib")
    data = {"device": "test", "attention": [
        {"case": "global", "kind": "global", "N": 512, "flops": 7e12, "impls": {"acefuse": {"status": "ok", "ms": 2.0},
                                                                            "flex": {"status": "ok", "ms": 1.0}}}],
        "rows": [{"workload": "softmax", "shape": [8, 1024], "bytes": 4e9,
                  "impls": {"acefuse": {"status": "ok", "ms": 4.0}, "eager": {"status": "WRONG"}}},
                 {"workload": "softmax", "shape": [8, 256], "bytes": 1e9,
                  "impls": {"acefuse": {"status": "ok", "ms": 2.0}, "eager": {"status": "ok", "ms": 1.0}}}]}
    assert PL.kind_of(data) == "training"
    s = PL.series("training", data)
    assert s["rows: softmax"]["x"] == [256, 1024]
    # GB/s = bytes / s / 1e9: 1e9 B in 2 ms = 500 GB/s; TFLOP/s: 7e12 FLOP in 1 ms = 7000
    assert s["rows: softmax"]["lines"]["acefuse"] == [pytest.approx(500.0), pytest.approx(1000.0)]
    eager = s["rows: softmax"]["lines"]["eager"]
    assert eager[0] == pytest.approx(1000.0) and math.isnan(eager[1])   # WRONG: not timed, not drawn
    assert s["attention: global"]["lines"]["flex"] == [pytest.approx(7000.0)]
    p = tmp_path / "training.json"
    p.write_text(json.dumps(data))
    got = PL.render([p], tmp_path)
    assert Path(got["plots"][0]).read_bytes()[:4] == b"\x89PNG"
    assert "| softmax 8x1024 | 4.000 (1000) | WRONG |" in (tmp_path / "tables.md").read_text()


def test_plots_of_quant_and_model_results(tmp_path):
    pytest.importorskip("matplotlib")
    quant = {"device": "test", "copy_gbs": 3000.0, "rows": [
        {"quant": "int8", "dtype": "bfloat16", "rows": 4, "cols": 8, "auto_ms": 1.0, "auto_gbs": 2000.0, "best": "auto",
         "best_gbs": 2000.0, "eager_ms": 3.0, "eager_gbs": 666.7, "compile_ms": None, "compile_gbs": None}]}
    models = {"device": "test", "rows": [{"mode": "training", "impl": "eager", "tokens_per_s": 100.0, "ms": 10.0},
                                         {"mode": "training", "impl": "acefuse", "wrong": True}]}
    assert PL.kind_of(quant) == "quant" and PL.kind_of(models) == "models"
    q = PL.series("quant", quant)["int8"]
    assert q["x"] == ["bfloat16"] and q["lines"]["acefuse"] == [2000.0] and math.isnan(q["lines"]["torch.compile"][0])
    m = PL.series("models", models)["training"]
    assert m["x"] == ["eager", "acefuse"] and m["lines"]["tokens/s"][0] == 100.0 and math.isnan(m["lines"]["tokens/s"][1])
    assert "| int8 | bfloat16 | 4x8 | 2000 | 2000 (auto) | 667 | n/a | 3.00x | n/a |" in PL.table("quant", quant)
    assert "| training | acefuse | n/a | n/a | WRONG |" in PL.table("models", models)
    for name, data in (("quant", quant), ("models", models)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    got = PL.render([tmp_path / "quant.json", tmp_path / "models.json"], tmp_path / "out")
    assert len(got["plots"]) == 2 and all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in got["plots"])


def test_plots_refuse_what_is_not_a_results_file(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": [{"case": "a"}]}))
    assert cli.main(["bench", "--plot-only", str(bad), "--out", str(tmp_path)]) == 2
    assert "not a results file" in capsys.readouterr().err
    bad.write_text("{")
    with pytest.raises(PL.PlotError, match="not JSON"):
        PL.load(bad)


def test_bench_without_a_gpu_says_so_and_fails(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: acefuse bench would run")
    assert cli.main(["bench", "--quick", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--plot-only" in err
    assert not (tmp_path / "b").exists()


def test_bench_runs_parts_counts_cases_and_renders(tmp_path, monkeypatch, capsys):
    """The runner on the CPU with a stand-in benchmark script (the GPU is the one thing faked):
    each part runs in a subprocess, its log is kept, every reported case advances the count,
    and the results are tabulated and plotted."""
    pytest.importorskip("matplotlib")
    from acefuse.workbench import bench as B
    bdir = tmp_path / "benchmarks"
    bdir.mkdir()
    (bdir / "bench_rows.py").write_text(
        "import json, shutil, sys\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "print('device: fake')\n"
        "for w in ('softmax', 'log_softmax'):\n"
        "    print(f'{w:14s} 16384x8192: acefuse auto 4000 GB/s', flush=True)\n"
        f"shutil.copy({str(RESULTS / 'rows.json')!r}, out)\n")
    monkeypatch.setattr(B, "require_gpu", lambda: "fake GPU")
    out = tmp_path / "res"
    seen = []

    class Count:
        def update(self, n):
            seen.append(n)
    rc, res = B.run_part(B.PARTS["rows"], B.QUICK["rows"][0], bdir, out.parent, Count(), write=lambda s: None) \
        if out.parent.exists() else (None, None)
    assert rc == 0 and res is not None and sum(seen) == B.QUICK["rows"][1] == 2
    assert "acefuse auto" in (out.parent / "rows.log").read_text()
    assert cli.main(["bench", "--quick", "--parts", "rows", "--benchmarks", str(bdir), "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "[rows] softmax" in text and (out / "rows.png").is_file() and (out / "tables.md").is_file()
    assert cli.main(["bench", "--parts", "nope", "--benchmarks", str(bdir), "--out", str(out)]) == 2
    assert "unknown part 'nope'" in capsys.readouterr().err
