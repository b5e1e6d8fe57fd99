"""GPU probe for af.gemm (diagnostics, not a benchmark of record): the prologue form's error
against the float64 reference as a fraction of tests/test_quant_gemm.py's bound, for several
FP8_PROMOTE values (-1: Triton's default), the scaled_mm form's; then times of both forms and
of prologue launch configurations at t=16384, k=8192 (bf16 x)."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_quant_gemm import fp8_linear, inputs, ref_quant   # noqa: E402
from acefuse.quant_gemm import gemm   # noqa: E402
from acefuse.codegen.contraction_launch import TIMING_SRC   # noqa: E402

T0 = time.time()
ns = {"torch": torch}
exec("\n".join(TIMING_SRC), ns)
res = {"acc": [], "time": []}


def ratio(got, inp):
    q, s = ref_quant(inp["x"])
    qd, wd = q.double(), inp["wq"].double()
    sc = s.double()[:, None] * inp["ws"].double()[None, :]
    ref = (qd @ wd.t()) * sc
    mag = (qd.abs() @ wd.abs().t()) * sc
    eps_out = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}[got.dtype]
    tol = 2 * inp["x"].shape[1] * 2.0 ** -24 * mag + (4 * 2.0 ** -24 + eps_out) * ref.abs() + 1e-30
    err = (got.double() - ref).abs()
    rel = err / mag.clamp_min(1e-300)
    return float((err / tol).max()), float(rel.max())


g = gemm(fp8_linear())
for t, k, n in [(1000, 1024, 384), (333, 1040, 200), (64, 4096, 4096), (2048, 8192, 512)]:
    cpu = inputs(1234 + t, torch.bfloat16, t=t, k=k, n=n)
    inp = {a: v.cuda() for a, v in cpu.items()}
    for form, promote in [("scaled_mm", None), ("prologue", -1), ("prologue", 0), ("prologue", 32),
                          ("prologue", 64)]:
        for od in (torch.float32, torch.bfloat16):
            if form == "prologue":
                M, N, K, dt, cuda = g._shapes(inp)
                out = g._run_prologue(inp, od, M, N, K, dt, cuda, promote=promote)
            else:
                out = g(form=form, out_dtype=od, **inp)["out"]
            r, rel = ratio(out.cpu(), cpu)
            res["acc"].append(dict(t=t, k=k, n=n, form=form, promote=promote, od=str(od), ratio=r, maxrel=rel,
                                   path=g.last_path))
            print("acc", t, k, n, form, promote, od, f"err/tol {r:.3g} max err/mag {rel:.3g}", flush=True)

M, K = 16384, 8192
x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
for n in (128, 4096):
    w = torch.randn(n, K, device="cuda")
    ws = w.abs().amax(1) / 448.0
    inp = dict(x=x, wq=(w / ws[:, None]).to(torch.float8_e4m3fn), ws=ws)
    M_, N_, K_, dt, cuda = g._shapes(inp)
    cands = [("scaled_mm", None, None)]
    for cfg in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 64, 64, 4, 4),
                (64, 128, 64, 4, 4), (128, 256, 128, 8, 2), (64, 64, 128, 4, 4)]:
        cands.append(("prologue", cfg, 32))
    cands += [("prologue", (128, 128, 64, 8, 3), -1), ("prologue", (128, 256, 64, 8, 3), -1),
              ("prologue", (128, 128, 64, 8, 3), 64)]
    for c in cands:
        if time.time() - T0 > 100:
            print("time limit", flush=True)
            break
        def call(c=c):
            if c[0] == "scaled_mm":
                return g(form="scaled_mm", **inp)
            return g._run_prologue(inp, torch.bfloat16, M_, N_, K_, dt, cuda, config=c[1], promote=c[2])
        try:
            call()
            torch.cuda.synchronize()
            ms = ns["_time_calls"](call) / 5
        except Exception as exc:
            ms = None
            print("fail", c, str(exc).splitlines()[0][:200])
        res["time"].append(dict(n=n, cand=c, ms=ms))
        print("time", n, c, ms, flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
