"""GPU probe for af.gemm (diagnostics, not a benchmark of record): the prologue form's error
against the float64 reference as a fraction of tests/test_quant_gemm.py's bound, per launch
configuration (BLOCK_K = the products one float8 MMA sum holds), the float32-dot variant's and
the scaled_mm form's; then times of both forms and of prologue configurations at t=16384,
k=8192 (bf16 x). Compact output (one line per measurement)."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_quant_gemm import fp8_linear, inputs, ref_quant   # noqa: E402
from acefuse.quant_gemm import gemm, _fastest_timed   # noqa: E402

T0 = time.time()
LIMIT = float(os.environ.get("PROBE_S", "60"))
res = {"acc": [], "time": []}
out_dir = os.environ.get("OUT", "/tmp")


def dump():
    json.dump(res, open(os.path.join(out_dir, "probe.json"), "w"), indent=1)


def ratio(got, inp):
    q, s = ref_quant(inp["x"])
    qd, wd = q.double(), inp["wq"].double()
    sc = s.double()[:, None] * inp["ws"].double()[None, :]
    ref = (qd @ wd.t()) * sc
    mag = (qd.abs() @ wd.abs().t()) * sc
    eps_out = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}[got.dtype]
    tol = 2 * inp["x"].shape[1] * 2.0 ** -24 * mag + (4 * 2.0 ** -24 + eps_out) * ref.abs() + 1e-30
    err = (got.double() - ref).abs()
    return float((err / tol).max()), float((err / mag.clamp_min(1e-300)).max())


g = gemm(fp8_linear())
for t, k, n in [(1000, 1024, 384), (333, 1040, 200), (2048, 8192, 512)]:
    cpu = inputs(1234 + t, torch.bfloat16, t=t, k=k, n=n)
    inp = {a: v.cuda() for a, v in cpu.items()}
    M, N, K, dt, cuda = g._shapes(inp)
    for cand in [("scaled_mm", None, True), ("prologue", (128, 128, 64, 8, 3), True),
                 ("prologue", (128, 128, 32, 8, 3), True), ("prologue", (128, 128, 128, 8, 3), True),
                 ("prologue", (128, 128, 64, 8, 3), False)]:
        try:
            g.fp8_dot = cand[2]
            if cand[0] == "scaled_mm":
                out = g(form="scaled_mm", out_dtype=torch.float32, **inp)["out"]
            else:
                out = g._run_prologue(inp, torch.float32, M, N, K, dt, True, config=cand[1])
            r, rel = ratio(out.cpu(), cpu)
            print(f"acc {t}x{k}x{n} {cand} {g.last_path}: err/tol {r:.3g}, max err/mag {rel:.3g}", flush=True)
            res["acc"].append(dict(shape=(t, k, n), cand=cand, ratio=r, rel=rel))
        except Exception as exc:
            print(f"acc {t}x{k}x{n} {cand}: FAILED {type(exc).__name__}: {str(exc).splitlines()[-1][:150]}")
g.fp8_dot = True
dump()
M, K = 16384, 8192
x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
for n in (128, 4096):
    if time.time() - T0 > LIMIT:
        break
    w = torch.randn(n, K, device="cuda")
    ws = w.abs().amax(1) / 448.0
    inp = dict(x=x, wq=(w / ws[:, None]).to(torch.float8_e4m3fn), ws=ws)
    M_, N_, K_, dt, cuda = g._shapes(inp)
    cands = [("scaled_mm", None)] + [("prologue", c) for c in [
        (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
        (128, 128, 64, 4, 4), (128, 256, 64, 8, 4)]]

    def call(c):
        if c[0] == "scaled_mm":
            return g._run_scaled(inp, torch.bfloat16, M_, N_, K_)
        return g._run_prologue(inp, torch.bfloat16, M_, N_, K_, dt, True, config=c[1])
    best, times = _fastest_timed(cands, call)
    flop = 2 * M * n * K
    for c in cands:
        ms = times.get(c)
        print(f"time n={n} {c}: " + (f"{ms:.3f} ms, {flop / ms / 1e9:.0f} TFLOP/s" if ms else "failed"), flush=True)
        res["time"].append(dict(n=n, cand=c, ms=ms))
    print(f"best n={n}: {best}")
    model = g.choose(M, n, K, dt, 2, True, x.device)
    print(f"model n={n}: {model[0]} ({model[2]})", flush=True)
    if n == 128 and time.time() - T0 < LIMIT:
        g(**inp)
        print("\n".join(g.explain(**inp).splitlines()[-4:]), flush=True)
dump()
