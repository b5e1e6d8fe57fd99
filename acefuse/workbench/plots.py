"""Tables (Markdown, JSON) and PNG plots of benchmark results, as the scripts in
``benchmarks/`` write them (``benchmarks/results/*.json`` are recorded ones). Runs on the
CPU: it only reads numbers.

Each results file is recognised by its shape:

* ``rows`` (bench_rows.py): ``{"results": [{"workload", "shape", "auto_gbs", "eager_gbs", ...}]}``
  -> throughput (GB/s) against the row length, per workload: acefuse, eager, torch.compile;
* ``attention`` (bench_attention.py prefill/variants/smoke): ``{"rows": [{"case", "kind", "N",
  "flops", "auto_ms", "<peer>_ms"}]}`` -> TFLOP/s against N per kind (a bar chart per case
  when every case has the same N);
* ``decode`` (bench_attention.py decode): ``{"rows": [{"case", "L", "bytes", "auto_ms", ...}]}``
  -> GB/s of K and V read against the cache length L;
* ``masks`` (bench_masks.py): ``{"rows": [{"variant", "acefuse_tflops", "flex_tflops", ...}]}``, one
  size -> TFLOP/s per variant, acefuse and FlexAttention side by side;
* ``quant`` (bench_quant.py): ``{"rows": [{"quant", "dtype", "auto_gbs", "eager_gbs", "compile_gbs"}]}``
  -> GB/s per input dtype, acefuse, eager and torch.compile, a panel per quantization;
* ``models`` (bench_models.py): ``{"rows": [{"mode", "impl", "tokens_per_s"}]}`` -> tokens/s per
  implementation, a panel per mode (inference, training);
* ``training`` (bench_training.py): ``{"attention": [...], "rows": [...]}`` with ``impls`` per
  case -> forward+backward throughput per implementation.

``series(kind, data)`` returns exactly what a plot draws (a test compares it to the file).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

PEERS_ATTN = ("sdpa-flash", "sdpa-cudnn", "flex", "compile-plain")
LABEL = {"auto": "acefuse", "eager": "eager", "compile": "torch.compile", "sdpa-flash": "SDPA flash",
         "sdpa-cudnn": "SDPA cuDNN", "flex": "FlexAttention", "compile-plain": "torch.compile (plain)",
         "best": "acefuse best variant"}


class PlotError(ValueError):
    """A results file cannot be read as benchmark results; the message names it."""


def kind_of(data: dict, name: str = "results") -> str:
    if isinstance(data.get("results"), list) and all("workload" in r for r in data["results"]):
        return "rows"
    if isinstance(data.get("attention"), list) or (isinstance(data.get("rows"), list)
                                                    and any("impls" in r for r in data["rows"])):
        return "training"
    if isinstance(data.get("rows"), list) and data["rows"]:
        if all("variant" in r and "acefuse_tflops" in r for r in data["rows"]):
            return "masks"
        if all("quant" in r and "auto_gbs" in r for r in data["rows"]):
            return "quant"
        if all("mode" in r and "impl" in r for r in data["rows"]):
            return "models"
        if all("L" in r for r in data["rows"]):
            return "decode"
        if all("N" in r and "flops" in r for r in data["rows"]):
            return "attention"
    raise PlotError(f"{name}: not a results file of benchmarks/bench_rows.py, bench_attention.py, "
                    "bench_masks.py, bench_quant.py, bench_models.py or bench_training.py (expected a 'results' list of workloads, or a 'rows' list of cases)")


def load(path) -> tuple:
    """(kind, data) of a results file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlotError(f"{path}: no such results file") from None
    except json.JSONDecodeError as exc:
        raise PlotError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlotError(f"{path}: expected a JSON object at the top level")
    return kind_of(data, str(path)), data


def _rate(amount, ms, scale):
    return amount / (ms * 1e-3) / scale if ms else math.nan


def series(kind: str, data: dict) -> dict:
    """``{panel: {"x": [...], "xlabel", "ylabel", "lines": {label: [y per x]}, "ceiling": y|None}}``."""
    out: dict = {}
    if kind == "rows":
        by: dict = {}
        for r in data["results"]:
            by.setdefault(r["workload"], []).append(r)
        for w, rs in by.items():
            rs = sorted(rs, key=lambda r: r["shape"][1])
            out[w] = {"x": [r["shape"][1] for r in rs], "xlabel": "row length (elements)",
                      "ylabel": "GB/s", "ceiling": data.get("copy_gbs"),
                      "labels": [f"{r['shape'][0]}x{r['shape'][1]}" for r in rs],
                      "lines": {LABEL[k]: [r.get(f"{k}_gbs", math.nan) for r in rs]
                                for k in ("auto", "eager", "compile")}}
    elif kind == "attention":
        by = {}
        for r in data["rows"]:   # grouped query heads get their own panel
            k = r.get("kind", r["case"])
            by.setdefault("gqa" if r.get("HKV", r.get("H")) != r.get("H") else k, []).append(r)
        for k, rs in by.items():
            rs = sorted(rs, key=lambda r: r["N"])
            lines = {"acefuse": [_rate(r["flops"], r.get("auto_ms"), 1e12) for r in rs]}
            for p in PEERS_ATTN:
                if any(f"{p}_ms" in r for r in rs):
                    lines[LABEL[p]] = [_rate(r["flops"], r.get(f"{p}_ms"), 1e12) for r in rs]
            out[k] = {"x": [r["N"] for r in rs], "xlabel": "sequence length N", "ylabel": "TFLOP/s",
                      "ceiling": data.get("matmul_tflops"), "labels": [r["case"] for r in rs], "lines": lines}
    elif kind == "decode":
        rs = sorted(data["rows"], key=lambda r: r["L"])
        lines = {"acefuse": [_rate(r["bytes"], r.get("auto_ms"), 1e9) for r in rs]}
        for p in PEERS_ATTN:
            if any(f"{p}_ms" in r for r in rs):
                lines[LABEL[p]] = [_rate(r["bytes"], r.get(f"{p}_ms"), 1e9) for r in rs]
        out["decode"] = {"x": [r["L"] for r in rs], "xlabel": "KV length L", "ylabel": "GB/s (K and V read)",
                         "ceiling": data.get("copy_gbs"), "labels": [r["case"] for r in rs], "lines": lines}
    elif kind == "masks":
        rs = data["rows"]
        out["masks and score modifications"] = {
            "x": [r["variant"] for r in rs], "categorical": True, "xlabel": "variant (one size)",
            "ylabel": "TFLOP/s (visible pairs)", "ceiling": data.get("matmul_tflops"),
            "labels": [r["variant"] for r in rs],
            "lines": {"acefuse": [r.get("acefuse_tflops", math.nan) for r in rs],
                      LABEL["flex"]: [r.get("flex_tflops", math.nan) for r in rs]}}
    elif kind == "quant":
        by = {}
        for r in data["rows"]:
            by.setdefault(r["quant"], []).append(r)
        for q, rs in by.items():
            out[q] = {"x": [r["dtype"] for r in rs], "categorical": True,
                      "xlabel": f"input dtype ({rs[0].get('rows')}x{rs[0].get('cols')})", "ylabel": "GB/s",
                      "ceiling": data.get("copy_gbs"), "labels": [r["dtype"] for r in rs],
                      "lines": {LABEL[k]: [r.get(f"{k}_gbs") if r.get(f"{k}_gbs") is not None else math.nan
                                           for r in rs] for k in ("auto", "eager", "compile")}}
    elif kind == "models":
        by = {}
        for r in data["rows"]:
            by.setdefault(r["mode"], []).append(r)
        for mode, rs in by.items():
            out[mode] = {"x": [r["impl"] for r in rs], "categorical": True, "xlabel": "implementation",
                         "ylabel": "tokens/s", "ceiling": None, "labels": [r["impl"] for r in rs],
                         "lines": {"tokens/s": [r.get("tokens_per_s", math.nan) for r in rs]}}
    elif kind == "training":
        for group, amount, scale, unit in (("attention", "flops", 1e12, "TFLOP/s"), ("rows", "bytes", 1e9, "GB/s")):
            by = {}
            for r in data.get(group) or []:
                by.setdefault(r.get("kind") or r.get("workload") or r["case"], []).append(r)
            for k, rs in by.items():
                xs = [r.get("N") or r.get("shape", [0, 0])[1] for r in rs]
                order = sorted(range(len(rs)), key=lambda i: xs[i])
                rs, xs = [rs[i] for i in order], [xs[i] for i in order]
                impls = list(dict.fromkeys(n for r in rs for n in r["impls"]))
                lines = {n: [_rate(r[amount], r["impls"].get(n, {}).get("ms"), scale) for r in rs] for n in impls}
                out[f"{group}: {k}"] = {"x": xs, "xlabel": "N" if group == "attention" else "row length",
                                        "ylabel": f"{unit} (forward+backward)", "ceiling": None,
                                        "labels": [r.get("case") or f"{r['shape'][0]}x{r['shape'][1]}" for r in rs],
                                        "lines": lines}
    return out


def _mpl():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plots need matplotlib: pip install 'acefuse[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(kind: str, data: dict, dst, title: str = "") -> str:
    """One PNG with a panel per workload (or kind): throughput against size, acefuse and
    each peer; a bar chart in a panel whose cases all have one size."""
    plt = _mpl()
    panels = series(kind, data)
    if not panels:
        raise PlotError(f"{title or kind}: no results to plot")
    n = len(panels)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (name, s) in zip(axes.flat, panels.items()):
        if s.get("categorical"):   # grouped bars: one group per case, one bar per implementation
            k = len(s["lines"])
            width = 0.8 / k
            for i, (label, ys) in enumerate(s["lines"].items()):
                ax.bar([j + (i - (k - 1) / 2) * width for j in range(len(s["x"]))],
                       [0 if math.isnan(y) else y for y in ys], width, label=label)
            ax.set_xticks(range(len(s["x"])))
            ax.set_xticklabels(s["x"], rotation=30, ha="right", fontsize=8)
            ax.set_xlabel(s["xlabel"])
        elif len(set(s["x"])) > 1:
            for label, ys in s["lines"].items():
                ax.plot(s["x"], ys, marker="o", label=label, linewidth=2.2 if label == "acefuse" else 1.3)
            ax.set_xscale("log", base=2)
            ax.set_xticks(s["x"])
            ax.set_xticklabels([str(x) for x in s["x"]], fontsize=8)
            ax.set_xlabel(s["xlabel"])
        else:   # one size: bars, one per implementation
            labels = list(s["lines"])
            vals = [s["lines"][k][0] if s["lines"][k] else math.nan for k in labels]
            ax.bar(range(len(labels)), [0 if math.isnan(v) else v for v in vals],
                   color=["#2563eb" if k == "acefuse" else "#9ca3af" for k in labels])
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
            ax.set_xlabel(s["labels"][0] if s["labels"] else "")
        if s.get("ceiling"):
            ax.axhline(s["ceiling"], linestyle=":", color="#6b7280",
                       label=("copy" if "GB/s" in s["ylabel"] else "matmul") + " ceiling (same run)")
        ax.set_title(name)
        ax.set_ylabel(s["ylabel"])
        ax.grid(alpha=0.3)
        if len(set(s["x"])) > 1 or s.get("categorical"):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    dst = Path(dst)
    fig.savefig(dst, dpi=90)
    plt.close(fig)
    return str(dst)


# ---- tables ----------------------------------------------------------------------------------------
def _f(v, fmt="{:.0f}"):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def table(kind: str, data: dict) -> str:
    """A Markdown table of one results file (ratios: peer time / acefuse time, > 1: acefuse faster)."""
    L = []
    if kind == "rows":
        copy = data.get("copy_gbs")
        L += ["| workload | rows x cols | acefuse GB/s (% copy) | best variant GB/s | eager GB/s | torch.compile GB/s | "
              "vs eager | vs torch.compile |", "|---|---|---|---|---|---|---|---|"]
        for r in data["results"]:
            pct = f" ({r['auto_gbs'] / copy:.0%})" if copy else ""
            L.append(f"| {r['workload']} | {r['shape'][0]}x{r['shape'][1]} | {_f(r.get('auto_gbs'))}{pct} | "
                     f"{_f(r.get('best_gbs'))} ({r.get('best', '?')}) | {_f(r.get('eager_gbs'))} | "
                     f"{_f(r.get('compile_gbs'))} | {_f(r['eager_us'] / r['auto_us'], '{:.2f}x')} | "
                     f"{_f(r['compile_us'] / r['auto_us'], '{:.2f}x')} |")
    elif kind in ("attention", "decode"):
        unit = "TFLOP/s" if kind == "attention" else "GB/s"
        amount, scale = ("flops", 1e12) if kind == "attention" else ("bytes", 1e9)
        peers = [p for p in PEERS_ATTN if any(f"{p}_ms" in r for r in data["rows"])]
        L += [f"| case | acefuse {unit} | " + " | ".join(LABEL[p] for p in peers) + " | "
              + " | ".join(f"vs {LABEL[p]}" for p in peers) + " |",
              "|---|---|" + "---|" * (2 * len(peers))]
        for r in data["rows"]:
            a = r.get("auto_ms")
            cells = [_f(_rate(r[amount], r.get(f"{p}_ms"), scale)) for p in peers]
            ratios = [_f(r[f"{p}_ms"] / a, "{:.2f}x") if (a and r.get(f"{p}_ms")) else "n/a" for p in peers]
            L.append(f"| {r['case']} | {_f(_rate(r[amount], a, scale))} | " + " | ".join(cells) + " | "
                     + " | ".join(ratios) + " |")
    elif kind == "masks":
        L += ["| variant | visible fraction | acefuse TFLOP/s | FlexAttention TFLOP/s | vs FlexAttention | rel err |",
              "|---|---|---|---|---|---|"]
        for r in data["rows"]:
            note = " (WRONG)" if r.get("acefuse_wrong") else (" (error)" if r.get("acefuse_err") else "")
            L.append(f"| {r['variant']} | {_f(r.get('visible_fraction'), '{:.3f}')} | {_f(r.get('acefuse_tflops'))}{note} | "
                     f"{_f(r.get('flex_tflops'))} | {_f(r.get('vs_flex'), '{:.2f}x')} | {_f(r.get('rel_err'), '{:.1e}')} |")
    elif kind == "quant":
        L += ["| quantization | dtype | rows x cols | acefuse GB/s | best variant GB/s | eager GB/s | torch.compile GB/s | "
              "vs eager | vs torch.compile |", "|---|---|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            L.append(f"| {r['quant']} | {r['dtype']} | {r.get('rows')}x{r.get('cols')} | {_f(r['auto_gbs'])} | "
                     f"{_f(r.get('best_gbs'))} ({r.get('best', '?')}) | {_f(r.get('eager_gbs'))} | "
                     f"{_f(r.get('compile_gbs'))} | {_f(r['eager_ms'] / r['auto_ms'], '{:.2f}x')} | "
                     + (_f(r['compile_ms'] / r['auto_ms'], '{:.2f}x') if r.get("compile_ms") else "n/a") + " |")
    elif kind == "models":
        L += ["| mode | implementation | tokens/s | ms/step | note |", "|---|---|---|---|---|"]
        for r in data["rows"]:
            note = "WRONG" if r.get("wrong") else (r.get("error") or "")
            L.append(f"| {r['mode']} | {r['impl']} | {_f(r.get('tokens_per_s'))} | {_f(r.get('ms'), '{:.1f}')} | "
                     f"{note.replace('|', '/')} |")
    elif kind == "training":
        for group, amount, scale, unit in (("attention", "flops", 1e12, "TFLOP/s"), ("rows", "bytes", 1e9, "GB/s")):
            rs = data.get(group) or []
            if not rs:
                continue
            impls = list(dict.fromkeys(n for r in rs for n in r["impls"]))
            L += ["", f"{group} (forward+backward; ms, {unit})", "",
                  "| case | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
            for r in rs:
                label = r.get("case") or f"{r['workload']} {r['shape'][0]}x{r['shape'][1]}"
                cells = []
                for n in impls:
                    x = r["impls"].get(n, {})
                    ms = x.get("ms")
                    cells.append(f"{ms:.3f} ({_f(_rate(r[amount], ms, scale))})" if ms else x.get("status", "n/a"))
                L.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(L).strip("\n")


def render(paths, out_dir, need_plots: bool = True) -> dict:
    """Tables and plots of recorded results files: ``tables.md``, ``results.json`` (every
    file, keyed by its stem) and one PNG per file in ``out_dir``. Returns what it wrote, and
    under ``"no_plots"`` why there are no plots when matplotlib is missing and
    ``need_plots`` is false (a GPU machine without it still gets its tables)."""
    out = Path(out_dir)
    loaded = []   # every file read before anything is written
    for p in paths:
        data = json.loads(Path(p).read_text()) if Path(p).is_file() and Path(p).name == "results.json" else None
        if isinstance(data, dict) and data and all(isinstance(v, dict) and "kind" in v for v in data.values()):
            for stem, v in data.items():   # a results.json this function wrote: its parts again
                v = {k: x for k, x in v.items() if k not in ("kind", "source")}
                loaded.append((stem, f"{p}:{stem}", kind_of(v, f"{p}:{stem}"), v))
            continue
        loaded.append((Path(p).stem, str(p), *load(p)))
    out.mkdir(parents=True, exist_ok=True)
    no_plots = ""
    try:
        _mpl()
    except PlotError as exc:
        if need_plots:
            raise
        no_plots = str(exc)
    md, combined, pngs = [], {}, []
    for stem, src, kind, data in loaded:
        combined[stem] = {"kind": kind, "source": src, **data}
        md += [f"## {stem} ({kind}; {data.get('device', 'device not recorded')})", "", table(kind, data), ""]
        if not no_plots:
            md += [f"![{stem}]({stem}.png)", ""]
            pngs.append(plot(kind, data, out / f"{stem}.png", title=f"{stem} ({data.get('device', '')})"))
    (out / "tables.md").write_text("\n".join(md))
    (out / "results.json").write_text(json.dumps(combined, indent=1))
    return {"tables": str(out / "tables.md"), "json": str(out / "results.json"), "plots": pngs,
            "no_plots": no_plots}
