import sys, math, traceback, torch
sys.path.insert(0, "tests")
from test_contraction_gluon import PROGS, _segments, SCALE, D, MODES, PERSISTENT
from acefuse.codegen.contraction_gluon import compile_gluon
from acefuse.codegen.contraction_gluon_launch import _allocator  # noqa
def ref(q, k, v, sg):
    N = q.shape[2]
    s = (q.double() @ k.double().transpose(-1, -2)) * SCALE
    ii, jj = torch.arange(N, device="cuda")[:, None], torch.arange(N, device="cuda")[None, :]
    keep = (sg[:, None, :, None] == sg[:, None, None, :]) & (jj <= ii)
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.double()
for mode in sys.argv[1:]:
    try:
        kern = compile_gluon(PROGS["p_seg"](), **{**MODES, **PERSISTENT}[mode])
    except Exception:
        print(mode, "COMPILE", traceback.format_exc()[-1500:]); continue
    for N, BJ in [(1000, 128), (333, 128), (4096, 64)]:
        g = torch.Generator(device="cuda").manual_seed(N)
        B, H = 2, 3
        x = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v = x(B, H, N, D), x(B, H, N, D), x(B, H, N, D)
        for sname, sg in [("rand", _segments(B, N, g, "cuda")), ("zeros", torch.zeros(B, N, dtype=torch.int32, device="cuda")),
                          ("ones", torch.ones(B, N, dtype=torch.int32, device="cuda")),
                          ("arange", torch.arange(N, dtype=torch.int32, device="cuda").expand(B, N).contiguous())]:
            try:
                out = kern(BLOCK_J=BJ, q=q, k=k, v=v, seg=sg)["o"]
                torch.cuda.synchronize()
            except Exception:
                print(mode, N, BJ, sname, "RUN", traceback.format_exc()[-1500:]); break
            r = ref(q, k, v, sg)
            d = (out.double() - r).abs().amax(-1)  # B H N
            bad = (d > 0.05) | ~torch.isfinite(d)
            rows = bad.nonzero()
            msg = f"{mode} N={N} BJ={BJ} seg={sname}: nonfinite {int((~torch.isfinite(out)).sum())} bad rows {int(bad.sum())}/{bad.numel()}"
            if len(rows):
                rr = sorted(set(int(t) for t in rows[:, 2]))
                msg += f" first rows {rr[:12]} b={sorted(set(int(t) for t in rows[:,0]))} h={sorted(set(int(t) for t in rows[:,1]))}"
                if sname == "rand":
                    b0 = int(rows[0, 0]); sgb = sg[b0].tolist()
                    bounds = [i for i in range(1, N) if sgb[i] != sgb[i-1]]
                    msg += f" seg bounds(b={b0}) {bounds}"
            print(msg, flush=True)
