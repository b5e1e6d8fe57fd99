"""``acefuse bench``: the GPU benchmark suite (``benchmarks/*.py``) in one command, with a
progress bar, then the tables (Markdown and JSON) and the PNG plots (plots.py).

Each part runs its benchmark script in a subprocess (so a crash in one part leaves the
others' results), its output goes to ``OUT/<part>.log``, and the bar advances on every
case the script reports. Without a CUDA GPU it says so and exits non-zero; ``--plot-only
RESULTS.json ...`` renders recorded results on the CPU instead.

    acefuse bench --quick --out bench-results
    acefuse bench --plot-only benchmarks/results/*.json --out plots
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import re
import subprocess
import sys
import time

from acefuse.workbench.progress import bar


class BenchError(RuntimeError):
    """The benchmarks cannot run here; the message says why and what to do instead."""


@dataclass(frozen=True)
class Part:
    name: str
    script: str
    args: tuple          # {out} is replaced by the results file
    cases: int           # cases the script reports (the progress bar's share)
    done: str            # a line matching this regex reports one case
    writes_json: bool = True
    pre: tuple = ()      # arguments of a first run of the same script (masks: --export)


_ATTN_DONE = r"acefuse auto"
PARTS = {
    "export": Part("export", "export.py", (), 13, r"^(wrote|FAILED|skip) ", writes_json=False),
    "rows": Part("rows", "bench_rows.py", ("--out", "{out}"), 13, r"acefuse auto|: FAILED"),
    "prefill": Part("prefill", "bench_attention.py", ("--part", "prefill", "--out", "{out}"), 6, _ATTN_DONE),
    "variants": Part("variants", "bench_attention.py", ("--part", "variants", "--out", "{out}"), 4, _ATTN_DONE),
    "decode": Part("decode", "bench_attention.py", ("--part", "decode", "--out", "{out}"), 2, _ATTN_DONE),
    "masks": Part("masks", "bench_masks.py", ("--out", "{out}"), 7, r"^\S+\s+visible [\d.]+\s+acefuse",
                  pre=("--export",)),
    "quant": Part("quant", "bench_quant.py", ("--out", "{out}"), 4, r"acefuse auto .* GB/s"),
    "models": Part("models", "bench_models.py", ("--out", "{out}"), 6, r"^(inference|training)\s+\S+\s"),
    "training": Part("training", "bench_training.py", ("--out", "{out}"), 9, r"^\S.* acefuse (ok|WRONG|fallback|error|skipped)"),
}
QUICK = {   # the quick variant of each part: (arguments, cases)
    "rows": (("--quick", "--out", "{out}"), 2),
    "prefill": (("--part", "smoke", "--out", "{out}"), 1),
    "training": (("--quick", "--out", "{out}"), 6),
    "masks": (("--only", "causal,document", "--out", "{out}"), 2),
    "quant": (("--dtypes", "bfloat16", "--out", "{out}"), 2),
    "models": (("--quick", "--out", "{out}"), 6),
}
DEFAULT = ("export", "rows", "prefill", "variants", "decode", "masks", "quant", "training", "models")
DEFAULT_QUICK = ("export", "rows", "prefill", "decode")


def benchmarks_dir(given=None) -> Path:
    """The ``benchmarks/`` folder: given, next to the package (a source checkout), or here."""
    import acefuse
    cands = [Path(given)] if given else [Path(acefuse.__file__).resolve().parents[1] / "benchmarks",
                                         Path.cwd() / "benchmarks"]
    for d in cands:
        if (d / "bench_rows.py").is_file():
            return d
    raise BenchError(f"no benchmarks folder with bench_rows.py at {', '.join(map(str, cands))}; the benchmark "
                     "scripts live in the source repository: run from a checkout, or pass --benchmarks DIR")


def require_gpu() -> str:
    import torch
    if not torch.cuda.is_available():
        raise BenchError(f"acefuse bench needs a CUDA GPU, and torch {torch.__version__} sees none here "
                         "(torch.cuda.is_available() is False). The benchmarks time kernels against their peers "
                         "on the GPU; on the CPU, render recorded results instead: acefuse bench --plot-only "
                         "benchmarks/results/*.json --out DIR")
    return torch.cuda.get_device_name(0)


def plan(parts=None, quick=False) -> list:
    """[(Part, arguments, cases)] to run, in order."""
    names = [p.strip() for p in parts.split(",") if p.strip()] if parts else list(DEFAULT_QUICK if quick else DEFAULT)
    bad = [n for n in names if n not in PARTS]
    if bad:
        raise BenchError(f"--parts: unknown part {bad[0]!r}; parts: {', '.join(PARTS)}")
    out = []
    for n in names:
        p = PARTS[n]
        args, cases = QUICK.get(n, (p.args, p.cases)) if quick else (p.args, p.cases)
        out.append((p, args, cases))
    return out


def run_part(part: Part, args, bench_dir: Path, out_dir: Path, progress, write=print) -> tuple:
    """Run one part; (exit status, results file or None). Every line goes to its log; the
    lines that report a case also to the terminal."""
    res = out_dir / f"{part.name}.json"
    argv = [sys.executable, str(bench_dir / part.script)] + [a.replace("{out}", str(res)) for a in args]
    done = re.compile(part.done)
    log = out_dir / f"{part.name}.log"
    with open(log, "w") as fh:
        if part.pre:   # a preparation run of the script (its own kernels), logged, not counted
            pre = [sys.executable, str(bench_dir / part.script), *part.pre]
            fh.write("$ " + " ".join(pre) + "\n")
            fh.flush()
            rc = subprocess.run(pre, cwd=str(bench_dir.parent), stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                return rc, None
        fh.write("$ " + " ".join(argv) + "\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=str(bench_dir.parent), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            if done.search(line):
                progress.update(1)
                write(f"[{part.name}] {line.rstrip()}")
        rc = proc.wait()
    return rc, (res if part.writes_json and res.is_file() else None)


def main(args) -> int:
    from acefuse.workbench import plots
    out = Path(args.out)
    if args.plot_only:
        try:
            got = plots.render(args.plot_only, out)
        except plots.PlotError as exc:
            raise BenchError(str(exc)) from None
        print(f"wrote {got['tables']}, {got['json']} and {len(got['plots'])} plot(s): {', '.join(got['plots'])}")
        return 0
    device = require_gpu()
    bench_dir = benchmarks_dir(args.benchmarks)
    steps = plan(args.parts, args.quick)
    if args.no_export:
        steps = [s for s in steps if s[0].name != "export"]
    out.mkdir(parents=True, exist_ok=True)
    print(f"acefuse bench on {device}: parts {', '.join(p.name for p, _, _ in steps)}; logs and results in {out}/",
          flush=True)
    t0 = time.perf_counter()
    results, failed = [], []
    with bar(total=sum(c for _, _, c in steps), quiet=args.quiet, desc="bench", unit="case", leave=True) as pb:
        write = pb.write if not pb.disable else (lambda s: print(s, flush=True))
        for part, pargs, _ in steps:
            pb.set_postfix_str(part.name)
            rc, res = run_part(part, pargs, bench_dir, out, pb, write)
            if rc != 0:
                failed.append(f"{part.name} (exit {rc}; see {out / (part.name + '.log')})")
            if res is not None:
                results.append(res)
    print(f"ran in {time.perf_counter() - t0:.0f} s", flush=True)
    if results:
        got = plots.render(results, out, need_plots=False)
        print(f"wrote {got['tables']}, {got['json']}" + (f" and plots {', '.join(got['plots'])}" if got["plots"] else ""))
        if got["no_plots"]:
            print(f"no plots: {got['no_plots']}; render them elsewhere with acefuse bench --plot-only "
                  f"{out}/results.json --out DIR", file=sys.stderr)
    if failed:
        print("failed parts: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0
