"""The torch frontend: plain PyTorch imported (af.from_torch), compiled (compile_fn) and
hooked into torch.compile (backend), each compared with eager torch in float64 on the CPU
(Triton interpreter). Kernels run in float32; the reference is torch on float64 copies."""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import acefuse as af
import acefuse.frontend as aff
from acefuse.frontend.importer import graph_values
from acefuse.frontend.runtime import AcefuseFallbackWarning

ATOL, RTOL = 2e-5, 2e-4   # float32 kernel vs float64 eager


def _g(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g) * scale


def _close(got, ref):
    got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert a.shape == b.shape, (a.shape, b.shape)
        torch.testing.assert_close(a.double(), b.double(), atol=ATOL, rtol=RTOL)


def _f64(args):
    return [a.double() if a.dtype.is_floating_point else a for a in args]


def _check_import(fn, *args):
    """from_torch gives an af.Program whose float64 reference evaluation matches eager torch."""
    prog = af_from_torch(fn, *args)
    assert isinstance(prog, af.Program)
    imp = prog.frontend
    ref = fn(*_f64(args))
    got = imp.reference(graph_values(imp, _f64(args)))
    _close(tuple(got) if isinstance(ref, tuple) else got[0], ref)
    return prog


def af_from_torch(fn, *args):
    return getattr(af, "from_torch", aff.from_torch)(fn, *args)


def _check_compiled(fn, *args, regions=1):
    cf = aff.compile_fn(fn, *args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        got = cf(*args)
    _close(got, fn(*_f64(args)))
    assert len(cf.regions) == regions, cf.graph_for(*args).code
    return cf


# ---- the row family: imported, compiled to kernels, compared with eager ----------------------
def softmax_fn(x):
    return torch.softmax(x, dim=-1)


def log_softmax_fn(x):
    return F.log_softmax(x, dim=1)


def logsumexp_fn(x):
    return torch.logsumexp(x, dim=-1)


def layer_norm_fn(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def rms_norm_fn(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


def cross_entropy_fn(x, t):
    return F.cross_entropy(x, t)


def manual_softmax_fn(x, bias):
    # amax / exp / sum, broadcasting a per-column bias, a dtype cast on the way
    s = (x + bias).float() * 0.5
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def var_mean_fn(x):
    mu = x.mean(-1, keepdim=True)
    return torch.tanh((x - mu) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5))


def softmax_dim0_fn(x):  # the reduced dim is not the last one; output keeps torch's layout
    return torch.softmax(x.transpose(0, 1), dim=-1)


ROW_CASES = [
    ("softmax", softmax_fn, lambda: (_g(5, 37, scale=3),)),
    ("softmax_3d", softmax_fn, lambda: (_g(2, 3, 19, scale=3),)),
    ("log_softmax", log_softmax_fn, lambda: (_g(6, 23, scale=3),)),
    ("logsumexp", logsumexp_fn, lambda: (_g(7, 41, scale=10),)),
    ("layer_norm", layer_norm_fn, lambda: (_g(3, 5, 33), _g(33, seed=1), _g(33, seed=2))),
    ("rms_norm", rms_norm_fn, lambda: (_g(9, 31), _g(31, seed=1))),
    ("cross_entropy", cross_entropy_fn,
     lambda: (_g(8, 17, scale=2), torch.tensor([0, 3, 16, -100, 5, 5, 2, 9]))),
    ("manual_softmax", manual_softmax_fn, lambda: (_g(4, 29, scale=2), _g(29, seed=3))),
    ("var_mean_tanh", var_mean_fn, lambda: (_g(6, 21),)),
    ("softmax_transposed", softmax_dim0_fn, lambda: (_g(13, 4),)),
]


@pytest.mark.parametrize("name,fn,mk", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_row_family_import_and_compile(name, fn, mk):
    args = mk()
    _check_import(fn, *args)
    _check_compiled(fn, *args)


def test_cross_entropy_mean_is_per_row_kernel_plus_torch_mean():
    x, t = _g(8, 17), torch.tensor([0, 3, 16, -100, 5, 5, 2, 9])
    cf = _check_compiled(cross_entropy_fn, x, t)
    code = cf.graph_for(x, t).code
    assert "af_region0" in code and "torch.sum" in code


# ---- attention patterns: imported exactly (reference), compiled with a torch fallback ----------
def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_bool_mask_scale(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)


def sdpa_bias(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def matmul_attention(x, wq, mask):
    # head split of an input, q @ k^T, masked_fill, softmax, @ v
    B, N, C = x.shape
    H = 2
    q = x.view(B, N, H, C // H).transpose(1, 2)
    k = wq.view(B, N, H, C // H).transpose(1, 2)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    s = s.masked_fill(mask == 0, float("-inf"))
    return s.softmax(-1) @ k


def einsum_attention(q, k, v):
    s = torch.einsum("bhid,bhjd->bhij", q, k) * 0.25
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhij,bhjd->bhid", p, v)


def _qkv(B=2, H=2, L=5, S=7, E=4, Hk=None):
    return _g(B, H, L, E), _g(B, Hk or H, S, E, seed=1), _g(B, Hk or H, S, E, seed=2)


ATTN_CASES = [
    ("sdpa_causal", sdpa_causal, lambda: _qkv(S=5)),
    ("sdpa_bool_mask", sdpa_bool_mask_scale, lambda: (*_qkv(), torch.rand(5, 7, generator=torch.Generator().manual_seed(0)) > 0.3)),
    ("sdpa_bias", sdpa_bias, lambda: (*_qkv(), _g(2, 1, 5, 7, seed=5))),
    ("sdpa_gqa", sdpa_gqa, lambda: _qkv(H=4, Hk=2)),
    ("matmul_attention", matmul_attention, lambda: (_g(2, 5, 8), _g(2, 5, 8, seed=1), torch.ones(5, 5).tril())),
    ("einsum_attention", einsum_attention, lambda: _qkv(S=5)),
]


@pytest.mark.parametrize("name,fn,mk", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_attention_import(name, fn, mk):
    args = mk()
    if name == "sdpa_bool_mask":  # every query row keeps at least one key
        args[3][:, 0] = True
    _check_import(fn, *args)


@pytest.mark.parametrize("name,fn,mk", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_attention_compile_matches_eager(name, fn, mk):
    # sdpa goes to acefuse's attention kernels when they compile it, else to torch with a
    # warning; attention written with matmuls keeps the matmuls in torch and fuses the
    # masked, scaled softmax between them
    args = mk()
    if name == "sdpa_bool_mask":
        args[3][:, 0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AcefuseFallbackWarning)
        cf = aff.compile_fn(fn, *args)
        got = cf(*args)
    _close(got, fn(*_f64(args)))
    assert cf.regions or aff.stats["fallbacks"]


def test_matmul_attention_keeps_softmax_in_acefuse():
    x, w, m = _g(2, 5, 8), _g(2, 5, 8, seed=1), torch.ones(5, 5).tril()
    cf = _check_compiled(matmul_attention, x, w, m)
    assert [r.program.reduced_axes() for r in cf.regions] == [["j"]]
    assert "matmul" in cf.graph_for(x, w, m).code


def test_region_that_cannot_compile_falls_back_with_one_line_warning():
    x = _g(5, 37).double()                    # float64: no acefuse kernel takes it
    with pytest.warns(AcefuseFallbackWarning, match=r"region `softmax` at .*test_frontend.py:\d+: .*runs in torch: float64"):
        cf = aff.compile_fn(softmax_fn, x)
    _close(cf(x), softmax_fn(x))
    assert not cf.regions


# ---- errors ---------------------------------------------------------------------------------------
def cumsum_fn(x):
    y = torch.softmax(x, -1)
    return torch.cumsum(y, dim=-1)


def test_unsupported_op_names_op_and_line():
    with pytest.raises(aff.UnsupportedOpError) as ei:
        af_from_torch(cumsum_fn, _g(3, 4))
    msg = str(ei.value)
    assert "torch.cumsum" in msg and "test_frontend.py" in msg and "torch.cumsum(y, dim=-1)" in msg
    assert ei.value.op == "torch.cumsum"


def test_untraceable_function_says_how_to_fix():
    def sized(x):
        n = x.size(1)
        return torch.softmax(x + torch.ones(n, n)[0], -1)
    with pytest.raises(aff.FrontendError, match=r"sized: torch.fx could not trace it at test_frontend.py:\d+: "
                                                r".*torch.ones\(n, n\).*TypeError.*backend=af.backend"):
        aff.compile_fn(sized, _g(3, 4))


def test_norm_modules_are_traced_through():
    """nn.LayerNorm / nn.RMSNorm are lowered (their parameters become program inputs),
    not kept as opaque fx leaf calls."""
    for mod in (nn.LayerNorm(10), nn.RMSNorm(10)):
        with torch.no_grad():
            mod.weight.uniform_(0.5, 1.5)
        x = _g(3, 10, scale=2.0) + 1.0
        prog = af_from_torch(mod, x)
        assert any("weight" in t for t in prog.tensors), prog.tensors
        imp = prog.frontend
        got = imp.reference(graph_values(imp, [x.double()]))[0]
        _close(got, mod.double()(x.double()))


def test_unsupported_use_of_supported_op():
    def f(x):
        return F.gelu(x) + torch.softmax(x, -1)
    with pytest.raises(aff.UnsupportedOpError, match="approximate='tanh'"):
        af_from_torch(f, _g(3, 4))


def test_compile_keeps_unsupported_ops_in_torch():
    x = _g(3, 11)
    cf = aff.compile_fn(cumsum_fn, x)
    _close(cf(x), cumsum_fn(x.double()))
    assert len(cf.regions) == 1


# ---- shapes: reuse and respecialisation -------------------------------------------------------------
def test_new_shape_reuses_kernel_and_respecialises():
    aff.clear_cache()
    x, w, b = _g(3, 5, 33), _g(33, seed=1), _g(33, seed=2)
    cf = aff.compile_fn(layer_norm_fn, x, w, b)
    before = dict(aff.stats)
    x2, w2, b2 = _g(4, 7, 50), _g(50, seed=1), _g(50, seed=2)     # new sizes, same program
    _close(cf(x2, w2, b2), layer_norm_fn(*_f64([x2, w2, b2])))
    assert aff.stats["kernel_compiles"] == before["kernel_compiles"]
    assert aff.stats["kernel_memory_hits"] == before["kernel_memory_hits"] + 1
    x3 = _g(1, 6, 20)                                                # a dim of 1: new shape class
    _close(cf(x3, w2[:20], b2[:20]), layer_norm_fn(*_f64([x3, w2[:20], b2[:20]])))
    x4 = _g(2, 20000)                                                # longer than one tile: same module
    _close(cf(x4, _g(20000, seed=1), _g(20000, seed=2)),
           layer_norm_fn(*_f64([x4, _g(20000, seed=1), _g(20000, seed=2)])))
    assert len(cf.graphs) == 4


def test_disk_cache_reloads_without_fusing():
    x = _g(5, 37)
    aff.compile_fn(softmax_fn, x)
    aff.clear_cache()                                   # memory only
    before = aff.stats["kernel_disk_hits"]
    cf = aff.compile_fn(softmax_fn, x)
    assert aff.stats["kernel_disk_hits"] == before + 1
    _close(cf(x), softmax_fn(x.double()))


# ---- torch.compile backend on a small transformer block --------------------------------------------
class Block(nn.Module):
    def __init__(self, C=16, H=2):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, N, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def test_transformer_block_through_torch_compile():
    torch.manual_seed(0)
    torch._dynamo.reset()
    m = Block().eval()
    x = _g(2, 5, 16)
    ref = Block().eval().double()
    ref.load_state_dict(m.state_dict())
    backend = getattr(af, "backend", aff.backend)
    cm = torch.compile(m, backend=backend, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AcefuseFallbackWarning)
        with torch.no_grad():
            out = cm(x)
            out2 = cm(_g(2, 6, 16))
    _close(out, ref(x.double()))
    _close(out2, ref(_g(2, 6, 16).double()))
