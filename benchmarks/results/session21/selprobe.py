"""Triton window kernels with the masked tiles' selects in three forms (timing A/B, session 21):
chain+sep (the tree), and+sep, and+nosep (session 20's form). One mode per process."""
import json, math, sys
import torch
mode, out = sys.argv[1], sys.argv[2]
import acefuse.codegen.emit as E
if "nosep" in mode:
    E._separated = lambda t, key: None
if mode.startswith("and"):
    def and_sel(self, leaves, value):
        a, sa = self.emit(value)
        conds = [self.cond(x) for x in leaves]
        mask = self._fold_mask()
        c = " & ".join(self._bcast(c, sc, "tile") for c, sc in conds)
        if mask is not True:
            c += f" & {mask}"
        cb = self.bind(c, "tile", "c")[0]
        v = self.bind(f"tl.where({cb}, {self._bcast(a, sa, 'tile')}, float('-inf'))", "tile")[0]
        self._ninf.add(v)
        return v, "tile"
    E.Emitter._masked_selects = and_sel
sys.path.insert(0, "benchmarks")
import bench_attention as BA
import _common
from triton.testing import do_bench
B, H, N, D = 4, 16, 4096, 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
rows = []
for w in (256, 1024):
    c = _common.Compiled(f"sw{w}", BA.window_program(w))
    flops = 4 * B * H * D * sum(min(x + 1, w) for x in range(N))
    ref = BA.plain("sliding_window", None, w)(q.float(), k.float(), v.float())
    for path in ("hopper", "portable"):
        o = c.run(q=q, k=k, v=v, path=path)
        err = ((o.float() - ref).norm() / ref.norm()).item()
        ms = do_bench(lambda: c.run(q=q, k=k, v=v, path=path), warmup=25, rep=200, return_mode="median")
        r = dict(mode=mode, window=w, path=path, us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12, err=err)
        print(r, flush=True)
        rows.append(r)
json.dump(rows, open(out, "w"), indent=1)
