"""What the per-element mask costs the persistent Gluon attention kernel (session 20): each program
timed as generated and with its masked tiles' ``where(cond, score, -inf)`` dropped (the mask's
arithmetic then dead code; the values are wrong, so only the time is reported), on an sm_90 GPU
with acefuse and egglog on the machine (the kernels derived in the run):

    python benchmarks/mask_cost.py [--out mask_cost.json]
    python benchmarks/mask_cost.py --sass [--out sass.json]     # no GPU: static sm_90 SASS counts

``--sass`` compiles the same kernels for sm_90 offline (Triton's Gluon compiler and cuobjdump, no
GPU needed) and counts their instructions by opcode, with and without the mask. Forms: ``tile``
(the default persistent kernel, output tiles stored from STORE_L, 2 stages) and ``mma`` (stores
from the MMA layout, 3 stages). B*N = 16384, H = 16, D = 128, bf16; TFLOP/s count the visible pairs.
"""
from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import inspect
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
H, D = 16, 128
CASES = (("sliding_window", 4096), ("causal", 1024), ("sliding_window", 16384))
FORMS = (("tile", {}), ("mma", {"tile_store": False}))


def source(prog, nomask, **opts):
    """The persistent kernel's module source, optionally with the masked tiles' first select
    dropped (the score read as it is; every select chained on it then reads the raw score)."""
    import acefuse as af
    from acefuse.codegen.contraction_gluon import GluonGen
    f = af.fuse(prog)
    gen = GluonGen(f, ws=True, persistent=True, dynamic=True, **opts)
    src = gen.module()
    if nomask:
        dropped = re.sub(r"(\w+) = gl\.where\(\w+, (\w+), float\('-inf'\)\)\n", lambda m: f"{m.group(1)} = {m.group(2)}\n", src)
        if dropped == src:
            raise SystemExit(f"mask_cost: no masked select found in {gen.name}'s kernel")
        src = dropped
    return f, gen, src


def kernel(prog, nomask, offline=False, **opts):
    """The kernel object (``offline``: its module loaded for an sm_90 compile on a machine without
    a GPU, outside Triton's interpreter, which acefuse's loader would otherwise pick there)."""
    import importlib.util
    from acefuse.codegen.contraction_gluon import GluonKernel
    from acefuse.codegen.compile import cached_source, load_module
    f, gen, src = source(prog, nomask, **opts)
    h = hashlib.sha256(src.encode()).hexdigest()[:16]
    path, name = cached_source(f"{gen.name}_gluon", h, src), f"mask_cost_{gen.name}_{h}"
    if offline:
        os.environ.pop("TRITON_INTERPRET", None)
        spec = importlib.util.spec_from_file_location(name, str(path))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = load_module(path, name)
    return GluonKernel(f, src, mod, gen)


def sass_counts(prog, nomask, n, **opts):
    """Static instruction counts of the persistent kernel compiled for sm_90 offline."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    k = kernel(prog, nomask, offline=True, **opts)
    b = 16384 // n
    x = lambda *s: torch.empty(*s, dtype=torch.bfloat16)   # noqa: E731
    grid, args, kw, _ = k.launch_args(dict(q=x(b, H, n, D), k=x(b, H, n, D), v=x(b, H, n, D)))
    fn = k.fn_persistent if len(grid) == 1 else k.fn
    sig, consts, attrs = {}, {}, {}
    kw = {a: v for a, v in kw.items() if a != "maxnreg"}
    for i, p in enumerate(inspect.signature(fn.fn).parameters):
        if p in kw:
            sig[p], consts[(i,)] = "constexpr", kw[p]
            continue
        a = args[i]
        if isinstance(a, torch.Tensor):
            sig[p] = "*" + {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a == 1:
            sig[p], consts[(i,)] = "constexpr", 1
        else:
            sig[p] = "i32"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 128),
                        options=dict(num_warps=kw.get("num_warps", 4)))
    tool = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))
    if not tool:
        raise SystemExit("mask_cost --sass: this Triton has no cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(ck.asm["cubin"])
    sass = subprocess.run([tool[0], "-sass", fh.name], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    return dict(total=sum(ops.values()), **{o: ops[o] for o in ("FSETP", "ISETP", "FSEL", "SEL", "LOP3", "FADD")})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sass", action="store_true", help="offline sm_90 instruction counts (no GPU)")
    args = ap.parse_args(argv)
    if args.sass:
        # Triton's Gluon library imported before anything picks the interpreter (acefuse does on a
        # machine without a GPU): its own jitted helpers must be compiled, not interpreted
        os.environ.pop("TRITON_INTERPRET", None)
        import triton.experimental.gluon._runtime  # noqa: F401
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    ex = runpy.run_path(str(ROOT / "examples" / "attention.py"))
    out = []

    def record(r):
        out.append(r)
        print(r, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    if args.sass:
        for name, n in CASES[:2]:
            for nomask in (False, True):
                record(dict(name=name, N=n, form="tile", mask=not nomask, **sass_counts(ex[name], nomask, n)))
        return 0
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("mask_cost: needs an sm_90 GPU (or --sass)")
        return 2
    from triton.testing import do_bench
    import torch.nn.functional as F
    for name, n in CASES:
        b = 16384 // n
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        ii = torch.arange(n, device="cuda")
        keep = ii[None, :] <= ii[:, None]
        if name == "sliding_window":
            keep = keep & (ii[:, None] - ii[None, :] < ex["WINDOW"])
        flops = 4 * b * H * D * keep.sum().item()
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=ex["SCALE"]).float()
        del keep
        for label, opts in FORMS:
            for nomask in (False, True):
                try:
                    kern = kernel(ex[name], nomask, **opts)
                    o = kern(q=q, k=k, v=v)["o"].float()
                    err = ((o - ref).norm() / ref.norm()).item()
                    if not nomask and not (err < 2e-2 and torch.isfinite(o).all()):
                        record(dict(name=name, N=n, form=label, mask=True, error=f"WRONG (relative error {err:.2e})"))
                        continue
                    ms = do_bench(lambda: kern(q=q, k=k, v=v), warmup=25, rep=100, return_mode="median")
                    record(dict(name=name, N=n, form=label, mask=not nomask, us=ms * 1e3,
                                tflops=flops / (ms * 1e-3) / 1e12, err=None if nomask else err))
                except Exception as exc:   # reported, not fatal
                    record(dict(name=name, N=n, form=label, mask=not nomask, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
