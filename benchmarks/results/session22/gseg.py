"""Offline sm_90 compile of the Gluon p_seg kernels (test program): registers, spills, local memory."""
import sys, inspect, re, glob, os, subprocess, tempfile, collections
sys.path.insert(0, "/work/main/tests")
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from test_contraction_gluon import PROGS, _segments
from acefuse.codegen.contraction_gluon import compile_gluon
from acefuse.codegen import contraction_gluon as _cg
if os.environ.get("PATCH"):   # the load partition's scan over PATCH tiles a step
    _orig = _cg.GluonGen.module
    def _mod(self):
        src = _orig(self)
        if "_p_load(" not in src:
            return src
        i0 = src.index("_p_load("); i0 = src.rindex("def ", 0, i0); i1 = src.index("@gluon.jit", i0)
        ld = os.environ["PATCH"]
        body = src[i0:i1].replace("SCAN * BLOCK_J", f"{ld} * BLOCK_J").replace("gl.arange(0, SCAN, layout=SCANV_L)", f"gl.arange(0, {ld}, layout=SCANV_L)")
        return src[:i0] + body + src[i1:]
    _cg.GluonGen.module = _mod
if os.environ.get("MASKLOAD"):   # key lookups as masked loads (contiguous addresses)
    _orig2 = _cg.GluonGen.module
    def _mod2(self):
        src = _orig2(self)
        return re.sub(r"gl\.load\(seg_ptr \+ off_seg_g \+ gl\.where\((_c\d+), (_ix\d+), 0\) \* s_seg_n\)",
                      lambda m: f"gl.load(seg_ptr + off_seg_g + {m.group(2)} * s_seg_n, mask={m.group(1)}, other=0)", src)
    _cg.GluonGen.module = _mod2
FORMS = {"wsov": dict(ws=True, overlap=True), "wsPD": dict(ws=True, persistent=True, dynamic=True)}
name = sys.argv[1] if len(sys.argv) > 1 else "p_seg"
for form in sys.argv[2:] or list(FORMS):
    kern = compile_gluon(PROGS[name](), **FORMS[form])
    x = lambda *s: torch.empty(*s, dtype=torch.bfloat16)
    N = 4096
    ins = dict(q=x(4, 16, N, 128), k=x(4, 16, N, 128), v=x(4, 16, N, 128))
    if "seg" in kern.tensors:
        ins["seg"] = _segments(4, N, torch.Generator().manual_seed(0))
    grid, args, kw, _ = kern.launch_args(ins)[:4]
    fn = kern.fn_persistent if len(grid) == 1 else kern.fn
    sig, consts, attrs = {}, {}, {}
    kw = dict(kw); maxnreg = kw.pop("maxnreg", None)
    if os.environ.get("SCAN"): kw["SCAN"] = int(os.environ["SCAN"])
    print("SCAN", kw.get("SCAN"))
    for i, p in enumerate(inspect.signature(fn.fn).parameters):
        a = args[i] if p not in kw else None
        if p in kw or (not isinstance(a, torch.Tensor) and a == 1):
            sig[p], consts[(i,)] = "constexpr", kw.get(p, 1)
        elif isinstance(a, torch.Tensor):
            sig[p] = "*" + {torch.bfloat16: "bf16", torch.int32: "i32", torch.float32: "fp32"}[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p] = "i32"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = dict(num_warps=kw.get("num_warps", 4))
    if maxnreg:
        opts["maxnreg"] = maxnreg
    ck = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 128), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    s = subprocess.run([glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))[0], "-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", s))
    print(name, form, "grid", grid, "regs", getattr(ck, "n_regs", None), "spills", getattr(ck, "n_spills", None), "shared", ck.metadata.shared, "maxnreg", maxnreg,
          {o: ops[o] for o in ("LDL", "STL", "LDG", "HGMMA", "SETMAXNREG", "BAR")}, "total", sum(ops.values()), flush=True)
    open(f"/tmp/{name}_{form}.sass", "w").write(s)
