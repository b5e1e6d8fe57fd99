"""Where the first (cold) training step of a Llama-shaped model through ``torch.compile(backend=
af.Backend(...))`` spends its time: per region program and per pipeline phase (capture and
partition, import, fusion (e-graph saturation and extraction), the rule-chain ablation behind the
generated comments, certification, rule proofs, the backward's derivation, code emission, kernel
runs), with how many programs were derived and compiled and how many regions reused them.

    python3 benchmarks/compile_phases.py [--size tiny] [--layers N] [--dtype float32|bfloat16]
        [--device cpu|cuda] [--inner eager|inductor] [--cache-dir D] [--cprofile out.prof]

Times are exclusive (a phase's time excludes the phases it calls), in wall-clock and process
CPU seconds (the CPU column is steadier on a shared machine). ``--cache-dir`` (default: a fresh
temporary folder, i.e. a cold kernel cache) is ``ACEFUSE_CACHE_DIR``; ``--proofs-from D`` copies
the rule-proof cache (``proofs.json``, ``proofs.key``) from ``D`` into it, so that proving the
rules (once per checker version, not per program) is not counted. Without a GPU the kernels run
in Triton's interpreter (``run-kernel`` then measures the interpreter, not a GPU).

Run it twice with the same ``--cache-dir`` for a warm process: the second finds every region's
kernels, backward programs, backward stages' kernels and riders in the frontend's disk index
(acefuse/frontend/kernels.py); its ``kernel cache`` line then shows ``kernel_compiles`` and
``backward_derivations`` 0 and no fusion, derivation or emit phase is timed. (The index is keyed
by a hash of the code: a checkout edited between the two runs compiles again.)
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

# (module, attribute, phase): wrapped with exclusive timers; the region is _compile_region's name
PHASES = [
    ("acefuse.frontend.runtime", "specialize", "capture+partition"),
    ("acefuse.frontend.importer", "import_nodes", "import"),
    ("acefuse.frontend.runtime", "_compile_region", "region/other"),
    ("acefuse.backward", "backward", "backward-derive"),
    ("acefuse.fuse", "fuse", "fuse (e-graph, extract)"),
    ("acefuse.fuse", "_ablate_pass", "ablate (rule-chain comments)"),
    ("acefuse.certificate", "certify_fusion", "certify"),
    ("acefuse.rewrite.normalize", "normalize", "normalize"),
    ("acefuse.proofs.rules", "prove_rules", "prove-rules"),
    ("acefuse.codegen.row", "generate", "emit (row)"),
    ("acefuse.codegen.contraction", "generate", "emit (contraction)"),
    ("acefuse.codegen.compile", "compile_program", "compile/other"),
    ("acefuse.autograd", "compile_stage", "backward-stage/other"),
    ("acefuse.codegen.compile", "run_module", "run-kernel"),
]


class Timers:
    def __init__(self):
        self.stack = []                       # [phase, wall0, cpu0, child wall, child cpu]
        self.wall = collections.defaultdict(float)
        self.cpu = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.region = "-"

    def wrap(self, modname, attr, phase):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            return
        f = getattr(mod, attr, None)
        if f is None:
            return

        @functools.wraps(f)
        def timed(*a, **k):
            prev = self.region
            if attr == "_compile_region":
                self.region = a[2]
            self.stack.append([phase, time.perf_counter(), time.process_time(), 0.0, 0.0])
            try:
                return f(*a, **k)
            finally:
                ph, w0, c0, cw, cc = self.stack.pop()
                dw, dc = time.perf_counter() - w0, time.process_time() - c0
                key = (self.region, ph)
                self.wall[key] += dw - cw
                self.cpu[key] += dc - cc
                self.calls[key] += 1
                if self.stack:
                    self.stack[-1][3] += dw
                    self.stack[-1][4] += dc
                self.region = prev
        # rebind every `from module import f` copy in acefuse's modules
        for m in list(sys.modules.values()):
            if getattr(m, "__name__", "").startswith("acefuse") and getattr(m, attr, None) is f:
                setattr(m, attr, timed)

    def table(self):
        out = ["per phase (exclusive): wall s, cpu s, calls"]
        ph = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for (r, p), w in self.wall.items():
            ph[p][0] += w
            ph[p][1] += self.cpu[(r, p)]
            ph[p][2] += self.calls[(r, p)]
        for p, (w, c, n) in sorted(ph.items(), key=lambda x: -x[1][1]):
            out.append(f"  {p:30s} {w:8.2f} {c:8.2f} {n:6d}")
        out.append("per region program (exclusive, every phase under its _compile_region): wall s, cpu s")
        rg = collections.defaultdict(lambda: [0.0, 0.0])
        for (r, p), w in self.wall.items():
            rg[r][0] += w
            rg[r][1] += self.cpu[(r, p)]
        for r, (w, c) in sorted(rg.items(), key=lambda x: -x[1][1]):
            top = sorted(((self.cpu[(rr, p)], p) for (rr, p) in self.cpu if rr == r), reverse=True)[:4]
            out.append(f"  {r:40s} {w:8.2f} {c:8.2f}   " + ", ".join(f"{p} {t:.1f}" for t, p in top))
        return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", help="bench_models.py's --size (default tiny)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on CUDA, else float32)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    ap.add_argument("--cache-dir", default=None, help="ACEFUSE_CACHE_DIR (default: a fresh temporary folder)")
    ap.add_argument("--proofs-from", default=None, help="copy the rule-proof cache from this ACEFUSE_CACHE_DIR")
    ap.add_argument("--cprofile", default=None, help="also write a cProfile of the first step here")
    args = ap.parse_args(argv)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="acefuse-phases-"))
    cache.mkdir(parents=True, exist_ok=True)
    if args.proofs_from:
        for f in ("proofs.json", "proofs.key"):
            if (Path(args.proofs_from) / f).exists():
                shutil.copy(Path(args.proofs_from) / f, cache / f)
    os.environ["ACEFUSE_CACHE_DIR"] = str(cache)
    import torch
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_models as bm
    import acefuse as af
    from acefuse.frontend import kernels as K
    timers = Timers()
    for mod, attr, phase in PHASES:
        timers.wrap(mod, attr, phase)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    cfg, B, T = bm.config(args.size, args.layers)
    model = bm.build(cfg, dev, dtype)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=torch.Generator(dev).manual_seed(1))
    be = af.Backend(inner=args.inner)
    fn = torch.compile(lambda i: model(input_ids=i, labels=i).loss, backend=be, dynamic=False)
    prof = None
    if args.cprofile:
        import cProfile
        prof = cProfile.Profile()
    before = dict(K.stats)
    w0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = fn(ids)
        w1 = time.perf_counter()
        loss.backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    if prof:
        prof.disable()
        prof.dump_stats(args.cprofile)
    w2, c2 = time.perf_counter(), time.process_time()
    r = be.report()
    n_regions = sum(len(g.af_regions) for cf in be.functions for g in cf.graphs.values())
    programs = {reg.program.key() for cf in be.functions for g in cf.graphs.values() for reg in g.af_regions}
    print(f"Llama ({args.size}, {cfg.num_hidden_layers} layers, {str(dtype)[6:]}, {dev}, inner={args.inner}); "
          f"cache {cache}")
    print(f"first step: forward {w1 - w0:.1f} s, backward {w2 - w1:.1f} s (wall); {c2 - c0:.1f} s CPU")
    print(f"regions {n_regions}, distinct region programs {len(programs)}; taken {len(r.taken)}, "
          f"left {len(r.left)}")
    print("kernel cache:", {k: K.stats[k] - before.get(k, 0) for k in K.stats})
    print(timers.table())
    for e in r.left:
        print("  left:", e.op, e.reason[:120])
    return 0


if __name__ == "__main__":
    sys.exit(main())
