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
    # sdpa (causal, with a mask over (query, key), GQA) is one acefuse attention kernel;
    # attention written with matmuls keeps the matmuls in torch and fuses the masked, scaled
    # softmax between them
    args = mk()
    if name == "sdpa_bool_mask":
        args[3][:, 0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AcefuseFallbackWarning)
        cf = aff.compile_fn(fn, *args)
        got = cf(*args)
    _close(got, fn(*_f64(args)))
    r = cf.report()
    assert len(r.taken) == 1 and not r.left, str(r)
    assert name.startswith("sdpa") == (r.taken[0].op == "torch.nn.functional.scaled_dot_product_attention"), str(r)


# ---- SDPA with a mask over (query, key) positions: one kernel, the mask an input over its axes ----
def sdpa_masked(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def sdpa_masked_causal(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)


def eager_masked_fill(q, k, v, m):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return s.masked_fill(~m, float("-inf")).softmax(-1) @ v


def eager_bias(q, k, v, b):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.5 + b, dim=-1) @ v


MB, MH, ML, MS = 2, 3, 5, 7     # L != S: a query/key mix-up changes a shape or the result
MASK_SHAPES = {"TT": (ML, MS), "11TT": (1, 1, ML, MS), "B1TT": (MB, 1, ML, MS), "BHTT": (MB, MH, ML, MS),
               "1H1T": (1, MH, 1, MS)}


def _mask(shape, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":                                    # True = attend
        return torch.rand(*shape, generator=g) > 0.3
    return torch.randn(*shape, generator=g) * 2           # added to the scores


def _mask_axes(prog, shape):
    """The mask's axes in the program: its torch dims right-aligned against (b, h, i, j), the
    broadcast (size-1) dims dropped."""
    qa = next(a for a in prog.tensors.values() if "e" in a and "j" not in a)
    return tuple(ax for ax, n in zip((*qa[:3], "j")[4 - len(shape):], shape) if n > 1)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES), ids=list(MASK_SHAPES))
def test_sdpa_with_query_key_mask_is_one_kernel(shape, kind, causal):
    fn = sdpa_masked_causal if causal else sdpa_masked
    q, k, v = _qkv(B=MB, H=MH, L=ML, S=MS)
    m = _mask(MASK_SHAPES[shape], kind, seed=len(shape) + 10 * causal)
    cf = _check_compiled(fn, q, k, v, m)           # float64 torch reference, no fallback warning
    r = cf.report()
    assert [e.op for e in r.taken] == ["torch.nn.functional.scaled_dot_product_attention"] and not r.left, str(r)
    prog = cf.regions[0].program                    # q, k, v and the mask over its own axes
    assert len(prog.tensors) == 4 and _mask_axes(prog, MASK_SHAPES[shape]) in prog.tensors.values(), prog.tensors


def test_sdpa_expanded_mask_and_fully_masked_rows_give_what_torch_gives():
    # a row that sees no key: torch's SDPA gives 0 (not NaN), and so does the kernel
    q, k, v = _qkv(B=MB, H=MH, L=ML, S=MS)
    keep = _mask((MB, 1, ML, MS), "bool", seed=3)
    keep[0, 0, 1], keep[1, 0, 4], keep[:, 0, 0, 0] = False, False, False   # rows (0, 1), (1, 4); causal: row 0
    bias = torch.where(keep, _mask(keep.shape, "float", seed=4), -math.inf)
    for fn, m in ((sdpa_masked, keep), (sdpa_masked, bias), (sdpa_masked_causal, keep),
                  (sdpa_masked, keep.expand(MB, MH, ML, MS))):
        cf = _check_compiled(fn, q, k, v, m)
        ref, got = fn(*_f64((q, k, v, m))), cf(q, k, v, m)
        for row in (ref, got):
            assert row[0, :, 1].eq(0).all() and row[1, :, 4].eq(0).all(), row
        if fn is sdpa_masked_causal:
            assert ref[:, :, 0].eq(0).all() and got[:, :, 0].eq(0).all()


def test_sdpa_with_query_key_mask_in_training_never_loses_a_gradient():
    # the backward's sum kernels read no tensor over (query, key) yet: in training such an
    # attention is torch's, with one warning and the reason in the report (or, once they do,
    # a differentiable kernel); either way every gradient matches float64 eager
    q, k, v = (t.requires_grad_() for t in _qkv(B=MB, H=MH, L=ML, S=MS))
    m = _mask((ML, MS), "bool", 8)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", AcefuseFallbackWarning)
        cf = aff.compile_fn(sdpa_masked_causal, q, k, v, m)
        (cf(q, k, v, m) * _g(MB, MH, ML, 4, seed=9)).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (sdpa_masked_causal(*ref, m) * _g(MB, MH, ML, 4, seed=9).double()).sum().backward()
    for a, b in zip((q, k, v), ref):
        _close(a.grad, b.grad)
    r = cf.report()
    if r.left:
        assert [e.reason.split(" (")[0] for e in r.left] == ["no backward kernel for its contractions"], str(r)
        assert len([w for w in rec if issubclass(w.category, AcefuseFallbackWarning)]) == 1
    else:
        assert len(r.taken) == 1 and not rec, str(r)


@pytest.mark.parametrize("shape", ["TT", "B1TT"])
def test_eager_masked_softmax_spelling_fuses_the_softmax(shape):
    q, k, v = _qkv(B=MB, H=MH, L=ML, S=MS)
    for fn, m in ((eager_masked_fill, _mask(MASK_SHAPES[shape], "bool", 5)),
                  (eager_bias, _mask(MASK_SHAPES[shape], "float", 6))):
        cf = _check_compiled(fn, q, k, v, m)
        r = cf.report()
        assert [e.op for e in r.taken] == ["torch.softmax" if fn is eager_bias else "Tensor.softmax"] \
            and not r.left, str(r)


def test_eager_fully_masked_row_is_zero_where_torch_gives_nan():
    # softmax of an all -inf row is NaN in torch; acefuse follows the README numerics (a fully
    # masked row reads 0, as torch's own SDPA gives): documented in docs/frontend.md
    q, k, v = _qkv(B=MB, H=MH, L=ML, S=MS)
    keep = _mask((ML, MS), "bool", 7)
    keep[2] = False
    cf = aff.compile_fn(eager_masked_fill, q, k, v, keep)
    got, ref = cf(q, k, v, keep), eager_masked_fill(*_f64((q, k, v, keep)))
    assert ref[:, :, 2].isnan().all() and got[:, :, 2].eq(0).all()
    ok = torch.arange(ML) != 2
    _close(got[:, :, ok], ref[:, :, ok])
    _close(got[:, :, 2], sdpa_masked(*_f64((q, k, v, keep)))[:, :, 2])


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
    def branchy(x):
        if x.sum() > 0:              # Python control flow on a tensor value: no single graph
            return torch.softmax(x, -1)
        return torch.log_softmax(x, -1)
    with pytest.raises(aff.FrontendError, match=r"branchy: Dynamo could not capture it as one graph.*"
                                                r"torch.compile\(fn, backend=af.backend\)"):
        aff.compile_fn(branchy, _g(3, 4))
    with pytest.raises(aff.FrontendError, match=r"torch.fx could not trace it at test_frontend.py:\d+: .*backend=af.backend"):
        af_from_torch(branchy, _g(3, 4))


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
        return torch.round(x, decimals=2) + torch.softmax(x, -1)
    with pytest.raises(aff.UnsupportedOpError, match="decimals"):
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


# ---- issue 12: capture, regions that survive unsupported ops, dtypes, layouts, the report ------------
class _NanoAttention(nn.Module):
    """nanoGPT's attention core: a causal buffer sliced by a size, torch.ones(T, T) from
    .size(), a branch on a dtype, and the transpose/contiguous/view tail."""

    def __init__(self, n=16):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, q, k, v):
        B, H, T, D = q.size()
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        if q.dtype == torch.float16:
            att = att.float()
        att = att + torch.ones(T, T) * 0.25
        y = F.softmax(att, dim=-1) @ v
        return y.transpose(1, 2).contiguous().view(B, T, H * D)


def test_dynamo_capture_takes_nanogpt_attention_and_its_tail():
    m = _NanoAttention()
    q, k, v = _g(2, 3, 7, 4), _g(2, 3, 7, 4, seed=1), _g(2, 3, 7, 4, seed=2)
    cf = _check_compiled(m, q, k, v)
    r = cf.report()
    assert [e.op for e in r.taken] == ["torch.nn.functional.softmax"] and not r.left, str(r)
    assert "test_frontend.py" in r.taken[0].line and r.taken[0].program is cf.regions[0].program


def cumsum_after_norm(x, w):
    y = F.layer_norm(x, (x.shape[-1],), w)
    return torch.cumsum(y, -1), torch.softmax(y[:, 1:], -1)   # slicing a computed value: torch


def test_report_lists_taken_and_left_with_reasons():
    x, w = _g(4, 9), _g(9, seed=1)
    cf = aff.compile_fn(cumsum_after_norm, x, w)
    _close(cf(x, w), cumsum_after_norm(x.double(), w.double()))
    r = cf.report()
    assert [e.op for e in r.taken] == ["torch.nn.functional.layer_norm", "torch.softmax"], str(r)
    assert [(e.op, e.reason) for e in r.left] == [("torch.cumsum", "acefuse has no lowering for this op")]
    assert all(e.program is not None for e in r.taken) and all(e.line.startswith("test_frontend.py:") for e in r.entries)
    text = str(r)
    assert "2 taken, 1 left" in text and "torch.cumsum" in text and "acefuse has no lowering" in text


def test_backend_object_reports_over_its_graphs():
    be = af.Backend()
    x, w = _g(4, 9), _g(9, seed=1)
    cm = torch.compile(cumsum_after_norm, backend=be, dynamic=False)
    _close(cm(x, w), cumsum_after_norm(x.double(), w.double()))
    r = be.report()
    assert len(r.taken) == 2 and len(r.left) == 1 and isinstance(af.backend, af.Backend)
    be.reset()
    assert len(be.report()) == 0


def sandwich_norms(x, h, w1, w2):      # Gemma-2's sandwich norms: the residual and the norm leave
    h = F.rms_norm(h, (h.shape[-1],), w1, eps=1e-6)
    x = x + h
    return x, F.rms_norm(x, (x.shape[-1],), w2, eps=1e-6)


def test_multi_output_region_keeps_every_reduction():
    args = (_g(2, 5, 12), _g(2, 5, 12, seed=1), _g(12, seed=2), _g(12, seed=3))
    cf = _check_compiled(sandwich_norms, *args)
    assert len(cf.regions[0].program.outputs) == 2
    assert len(cf.report().taken) == 2 and not cf.report().left
    assert cf.report().programs == [cf.regions[0].program]         # one program takes both norms


def exact_gelu_and_functions(x, w, s):
    h = F.gelu(x) + torch.sigmoid(x) * s + F.softplus(x) - torch.log1p(x.abs()) + torch.expm1(x * 0.1)
    h = h + torch.erf(x) + torch.floor(x) - torch.ceil(x * 0.5) + torch.round(x)
    return F.layer_norm(h, (h.shape[-1],), w)


def test_exact_gelu_new_functions_and_0d_input_fuse():
    args = (_g(6, 19, scale=2), _g(19, seed=1), torch.tensor(0.7))
    cf = _check_compiled(exact_gelu_and_functions, *args)
    assert not cf.report().left


def test_softmax_dtype_float32_on_half_has_float32_accuracy():
    def f(x):
        return F.softmax(x, dim=-1, dtype=torch.float32)
    x = (_g(5, 300) * 4).half()
    cf = _check_compiled(f, x)
    got = cf(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.softmax(x.double(), -1), atol=1e-7, rtol=1e-5)


def llama_rms_norm(x, w):               # LlamaRMSNorm: float32 inside, rounded back before the weight
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(dt)


def test_narrowing_cast_inside_a_region_rounds_where_eager_does():
    x, w = _g(7, 40, scale=3).half(), (_g(40, seed=1) + 1).half()
    cf = aff.compile_fn(llama_rms_norm, x, w)
    got = cf(x, w)
    assert got.dtype == torch.float16 and len(cf.report().taken) == 1
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (w.double() * h.half().double()).half()          # float64 math, rounded where eager rounds
    assert (got.double() - ref.double()).abs().max() <= 2 * torch.finfo(torch.float16).eps * ref.abs().max()


class _Allocated(torch.utils._python_dispatch.TorchDispatchMode):
    """The (op, dtype, shape) of every tensor an ATen op creates under it (views excluded)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.made.append((func.overloadpacket.__name__, t.dtype, tuple(t.shape)))
        return out


def _float32_made(made, shape):
    return [m for m in made if m[1] == torch.float32 and m[2] == tuple(shape)]


def _bf16_ulp(t):
    """One unit in the last place of bfloat16 values (8 significant bits)."""
    return torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(t.double().abs().clamp_min(1e-30))))


def test_bf16_rms_norm_reads_bf16_and_rounds_where_eager_does():
    """Issue 12: HF's RMSNorm in bfloat16 is one region (the float32 widening, the norm, the
    rounding back and the weight), whose kernel reads x in bfloat16 (no float32 copy of x is
    made) and writes the bfloat16 output itself, rounded where eager rounds."""
    x, w = _g(37, 300, scale=3).bfloat16(), (_g(300, seed=1).abs() + 0.5).bfloat16()
    cf = aff.compile_fn(llama_rms_norm, x, w)
    rec = _Allocated()
    with rec, warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        got = cf(x, w)
    r, = cf.regions
    assert "cast(" in repr(r.program) and r.calls["kernel"] == 1, r.program
    assert not _float32_made(rec.made, x.shape), rec.made        # neither a widened input nor a wide output
    assert not [m for m in rec.made if m[0] in ("_to_copy", "copy_", "clone") and m[1] != torch.uint8], rec.made
    assert got.dtype == torch.bfloat16
    eager = llama_rms_norm(x, w)
    x64 = x.double()
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (w.double() * h.bfloat16().double()).bfloat16().double()   # float64, rounded where eager rounds
    assert ((got.double() - ref).abs() <= _bf16_ulp(ref)).all()
    assert (got == eager).double().mean() > 0.99                     # bit-exact but for rare 1-ulp ties


def residual_rms_norm(a, b, w):          # Llama's residual add, then the next norm
    r = a + b
    return r, llama_rms_norm(r, w)


def test_bf16_residual_add_then_rms_norm_rounds_the_sum_as_eager():
    """The bfloat16 sum is an output and, read back in float32 by the norm, the rounded value
    eager reads (``cast``), not the float32 sum."""
    a, b = _g(9, 64, seed=2).bfloat16(), _g(9, 64, seed=3).bfloat16()
    w = (_g(64, seed=4).abs() + 0.5).bfloat16()
    cf = aff.compile_fn(residual_rms_norm, a, b, w)
    rec = _Allocated()
    with rec, warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        r, y = cf(a, b, w)
    assert len(cf.regions) == 1 and not _float32_made(rec.made, a.shape), rec.made
    assert r.dtype == y.dtype == torch.bfloat16
    assert torch.equal(r, a + b)                                       # rounded to nearest even, as eager
    r64 = (a + b).double()
    h = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (w.double() * h.bfloat16().double()).bfloat16().double()
    assert ((y.double() - ref).abs() <= _bf16_ulp(ref)).all()
    assert (y == residual_rms_norm(a, b, w)[1]).double().mean() > 0.99


def test_bf16_rms_norm_trains_without_float32_copies():
    """Issue 12's training path: HF's RMSNorm reads ``x.to(float32)``, so its region's compute
    dtype is float32; its differentiable kernel reads x and w in bfloat16 (``grad_chains``: no
    float32 copy of x, none saved for the backward) and writes the bfloat16 output and gradients.
    Output and gradients against a float64 reference (rounded where eager rounds) within bfloat16
    tolerances, and against eager."""
    x = _g(6, 48, seed=21, scale=2).bfloat16()
    w = (_g(48, seed=23).abs() + 0.5).bfloat16()
    cot = _g(6, 48, seed=25).bfloat16()
    args = [t.clone().requires_grad_() for t in (x, w)]
    cf = aff.compile_fn(llama_rms_norm, *args)
    rec = _Allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        with rec:
            y = cf(*args)
            y.backward(cot)                                        # (the cotangent as it is)
    reg, = cf.regions
    assert reg.calls["grad"] == 1 and y.dtype == torch.bfloat16
    assert not _float32_made(rec.made, x.shape), rec.made          # no widened x, no wide output
    assert all(t.grad.dtype == torch.bfloat16 for t in args)

    def rnd(t):        # the value rounded to bfloat16 (where eager rounds), the identity's gradient
        return t + (t.detach().bfloat16().double() - t.detach())
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    y64 = w64 * rnd(h)
    (y64 * cot.double()).sum().backward()
    ref_y = y64.detach().bfloat16().double()
    assert ((y.detach().double() - ref_y).abs() <= _bf16_ulp(ref_y)).all()
    for t, ref in zip(args, (x64, w64)):
        # bfloat16 gradients: 2^-8 relative per rounding; w's sums 6 rows
        torch.testing.assert_close(t.grad.double(), ref.grad, atol=0.02, rtol=0.02)
    e_args = [t.detach().clone().requires_grad_() for t in (x, w)]
    llama_rms_norm(*e_args).backward(cot)
    for t, e in zip(args, e_args):
        torch.testing.assert_close(t.grad.double(), e.grad.double(), atol=0.02, rtol=0.02)


def bf16_logits_loss(h, W, y):           # HF's loss: logits.float(), then cross_entropy over a view
    logits = (h @ W).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def test_cross_entropy_reads_bf16_logits_without_a_float32_copy():
    h, W = _g(2, 5, 16).bfloat16(), _g(16, 40, seed=1).bfloat16()
    y = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    cf = aff.compile_fn(bf16_logits_loss, h, W, y)
    rec = _Allocated()
    with rec, warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        got = cf(h, W, y)
    r, = cf.regions
    # the logits' .float() and view are the chain of a region input, replayed without the cast
    assert [s.chain for s in r.imp.inputs if s.chain and s.chain[0][0] == "to"] == \
        [(("to", torch.float32), ("reshape", (10, 40)))]
    assert not _float32_made(rec.made, (10, 40)) and not _float32_made(rec.made, (2, 5, 40)), rec.made
    logits = (h @ W).double()
    ref = F.cross_entropy(logits.view(-1, 40), y.view(-1))
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    # training: the gradient flows through the widening, as eager's
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    cf(hh, WW, y).backward()
    h2, W2 = h.clone().requires_grad_(), W.clone().requires_grad_()
    bf16_logits_loss(h2, W2, y).backward()
    torch.testing.assert_close(hh.grad.double(), h2.grad.double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(WW.grad.double(), W2.grad.double(), atol=1e-2, rtol=1e-2)


def plain_bf16_loss(logits, y):         # a causal LM's loss written plainly (HF's: .float(), a view)
    logits = logits.float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def test_bf16_cross_entropy_trains_without_a_float32_copy_of_the_logits():
    """Issue 12's training path for the loss: the cross-entropy region widens bfloat16 logits and
    has an integer output (the targets' mask), so its differentiable kernel used to read float32
    copies of the logits (saved for the backward too). Now it reads the bfloat16 logits
    (``grad_plan``: the kernel is asked for eager's output types, ``out_dtypes``), no float32
    tensor as large as the logits is made in the forward or the backward (the backward kernel
    rounds the logits' gradient to bfloat16 itself and writes it so: ``kernels.narrowed``), the
    loss is float32 and the logits' gradient bfloat16, both against a float64 reference within
    bfloat16 tolerances."""
    logits = _g(3, 7, 50, seed=31, scale=3).bfloat16()
    y = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(3))
    y[0, 2] = y[2, 5] = -100                                     # ignored positions
    x = logits.clone().requires_grad_()
    cf = aff.compile_fn(plain_bf16_loss, x, y)
    rec, rec_bwd = _Allocated(), _Allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        with rec:
            loss = cf(x, y)
        with rec_bwd:
            loss.backward(torch.tensor(1.5))
    reg, = cf.regions
    assert reg.calls["grad"] == 1 and reg.calls["torch"] == 0
    assert reg._grad_kw.get("out_dtypes"), "the differentiable kernel took the widening path"
    assert not _float32_made(rec.made, (21, 50)) and not _float32_made(rec.made, (3, 7, 50)), rec.made
    # the backward reads the saved bfloat16 logits as they are and its kernel writes their gradient
    # in bfloat16, rounded inside the kernel (kernels.narrowed): no float32 [tokens, vocab] buffer
    assert not [m for m in rec_bwd.made if m[0] == "_to_copy" and m[1] == torch.float32 and len(m[2]) > 1], \
        rec_bwd.made
    assert not _float32_made(rec_bwd.made, (21, 50)) and not _float32_made(rec_bwd.made, (3, 7, 50)), rec_bwd.made
    assert any(m[1] == torch.bfloat16 and m[2] in ((21, 50), (3, 7, 50)) for m in rec_bwd.made), rec_bwd.made
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    x64 = logits.double().requires_grad_()
    ref = F.cross_entropy(x64.view(-1, 50), y.view(-1))
    (ref * 1.5).backward()
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)   # float32 math on exact inputs
    # the gradient (softmax - one-hot) * 1.5 / 19 rounded once to bfloat16: 2^-8 relative, plus
    # float32 rounding near zero
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-4, rtol=2 ** -7)
    e = logits.clone().requires_grad_()
    (plain_bf16_loss(e, y) * 1.5).backward()
    torch.testing.assert_close(x.grad.double(), e.grad.double(), atol=1e-4, rtol=2 ** -7)


def test_region_calls_work_out_their_plan_once():
    """Per-call work is cached (issue 12): the adapters' layout steps and the call's plan (which
    source feeds which input through which chain, the output types) are made on the first call."""
    x, w = _g(5, 32).bfloat16(), (_g(32, seed=1) + 1).bfloat16()
    cf = aff.compile_fn(llama_rms_norm, x, w)
    cf(x, w)
    r, = cf.regions
    feeds, run, kw = r._plan
    # x's widening cast is not replayed: both sources are fed as they are (no adapter)
    assert [(name, adapter) for name, _, adapter in feeds] == [(s.name, None) for s in r.imp.inputs]
    assert all(o._steps is not None for o in r.imp.outputs)
    plan = r._plan
    torch.testing.assert_close(cf(x, w), llama_rms_norm(x, w), atol=0, rtol=0)
    assert r._plan is plan and r.calls["kernel"] == 2


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_then_causal_sdpa(q, k, v, cos, sin):
    # cos/sin are read with the query and with the key positions: computed in the region they
    # would tie both position axes into one, so torch computes q and k first
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_rope_then_causal_sdpa_takes_the_attention():
    args = [_g(2, 2, 6, 8, seed=s) for s in range(3)] + [_g(6, 8, seed=4), _g(6, 8, seed=5)]
    cf = _check_compiled(rope_then_causal_sdpa, *args)
    r = cf.report()
    assert [e.op for e in r.taken] == ["torch.nn.functional.scaled_dot_product_attention"] and not r.left, str(r)


def sdpa_with_mask_built_from_positions(q, k, v, pos):
    mask = pos[None, :] <= pos[:, None]         # one position tensor read at i and at j
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_sdpa_with_a_mask_built_in_the_graph_takes_the_attention():
    """Hugging Face builds its causal mask in the graph under tracing (from cache_position):
    reading one tensor at the query and at the key positions ties both axes, so torch
    computes the mask first and the attention reads it as an input (the H100 Llama run
    left this attention to torch)."""
    args = [_g(2, 2, 9, 8, seed=s) for s in range(3)] + [torch.arange(9)]
    cf = _check_compiled(sdpa_with_mask_built_from_positions, *args)
    r = cf.report()
    assert [e.op for e in r.taken] == ["torch.nn.functional.scaled_dot_product_attention"] and not r.left, str(r)


def two_layers_share_one_mask(q, k, v, w):
    B, H, N, D = q.shape
    q_idx, kv_idx = torch.arange(N)[None, None, :, None], torch.arange(N)[None, None, None, :]
    mask = (kv_idx <= q_idx).expand(B, -1, N, N)        # (transformers 5.17's sdpa_mask, traced)
    h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    h = torch.tanh(h @ w)                               # (torch: the next layer's q, k, v)
    return F.scaled_dot_product_attention(h, h * 0.5, h + 1, attn_mask=mask)


def test_a_mask_view_shared_by_several_attentions_is_not_a_region_output():
    """transformers 5.17 builds one causal mask, ``expand``s it once and hands that view to every
    layer's SDPA: the first attention's region had the view as an output over (query, key), which
    the attention kernel cannot write ("outputs ['out0'] range over the key axis"), and the
    attention went to torch (the H100 Llama run with 5.17). Each attention now reads its own copy
    of the view, so both are attention kernels."""
    args = [_g(2, 2, 9, 8, seed=s) for s in range(3)] + [_g(8, 8, seed=3) / 3]
    cf = _check_compiled(two_layers_share_one_mask, *args, regions=2)
    r = cf.report()
    assert [e.op for e in r.taken] == ["torch.nn.functional.scaled_dot_product_attention"] * 2 and not r.left, str(r)


def norm_then_weighted_loss(x, w, t, cw):
    return F.cross_entropy(F.layer_norm(x, (x.shape[-1],), w), t, weight=cw, reduction="none")


def test_unsupported_use_splits_the_region_and_warns_once():
    x, w, cw = _g(6, 11, scale=2), _g(11, seed=1), _g(11, seed=2).abs() + 0.5
    t = torch.tensor([0, 3, 10, 5, 5, 2])
    with pytest.warns(AcefuseFallbackWarning, match=r"region `cross_entropy` at test_frontend.py:\d+: .*per-class weight") as rec:
        cf = aff.compile_fn(norm_then_weighted_loss, x, w, t, cw)
    assert len([r for r in rec if issubclass(r.category, AcefuseFallbackWarning)]) == 1
    _close(cf(x, w, t, cw), norm_then_weighted_loss(x.double(), w.double(), t, cw.double()))
    r = cf.report()
    assert [e.op for e in r.taken] == ["torch.nn.functional.layer_norm"], str(r)
    assert [(e.op, e.reason) for e in r.left] == [
        ("torch.nn.functional.cross_entropy", "acefuse cannot import it (per-class weight)")], str(r)


# ---- Backend(inner="inductor"): acefuse regions as opaque ops inside Inductor's graph --------------
class _InductorLM(nn.Module):
    """Embedding, RMSNorm, RoPE-like elementwise, causal softmax between matmuls, SiLU-mul MLP,
    LayerNorm, cross-entropy: acefuse takes the norms, the softmax and the loss, Inductor the rest."""

    def __init__(self, V=13, C=8, H=2):
        super().__init__()
        self.V, self.C, self.H = V, C, H
        self.emb = nn.Embedding(V, C)
        self.rms = nn.Parameter(1 + 0.3 * torch.randn(C))
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.up, self.gate, self.down = nn.Linear(C, 2 * C), nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        self.lnf = nn.LayerNorm(C)
        self.head = nn.Linear(C, V)

    def forward(self, idx, tgt):
        B, N = idx.shape
        C, H = self.C, self.H
        x = self.emb(idx)
        q, k, v = self.qkv(F.rms_norm(x, (C,), self.rms, eps=1e-6)).split(C, dim=-1)
        q, k, v = (t.view(B, N, H, C // H).transpose(1, 2) for t in (q, k, v))
        pos = torch.arange(N, dtype=x.dtype)[:, None]
        q = q * torch.cos(pos) + q.flip(-1) * torch.sin(pos)          # (RoPE-like: elementwise, Inductor's)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, N, C))
        x = x + self.down(F.silu(self.gate(x)) * self.up(x))
        logits = self.head(self.lnf(x))
        return F.cross_entropy(logits.view(-1, self.V), tgt.view(-1))


def _inductor_lm(seed=0):
    torch.manual_seed(seed)
    m = _InductorLM()
    with torch.no_grad():
        m.lnf.weight.add_(0.3 * torch.randn(m.C))
        m.lnf.bias.add_(0.3 * torch.randn(m.C))
    ref = _InductorLM().double()
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    return m, ref


def _lm_data(seed, B=2, N=5, V=13):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, N), generator=g), torch.randint(0, V, (B, N), generator=g)


def test_backend_inner_is_checked_and_auto_picks_by_device():
    with pytest.raises(ValueError, match=r"inner is one of 'auto', 'inductor', 'eager'"):
        af.Backend(inner="aot")
    be = af.Backend()
    assert be.inner == "auto" and be.inner_for([torch.ones(2)]) == "eager"
    assert af.Backend(inner="inductor").inner_for([torch.ones(2)]) == "inductor"
    assert be.inner_for([torch.empty(2, device="meta")]) == "eager"


@pytest.mark.slow
def test_inductor_inner_trains_with_eager_gradients_and_calls_the_regions():
    """The graph goes to Inductor with each region one ``acefuse::region`` op (its backward
    ``acefuse::region_bwd``): the loss and every parameter's gradient match float64 eager,
    the report lists the regions, and the ops run inside Inductor's compiled graph."""
    from acefuse.frontend import inductor
    torch._dynamo.reset()
    m, ref = _inductor_lm()
    be = af.Backend(inner="inductor")
    cm = torch.compile(m, backend=be, dynamic=False)
    for step, seed in enumerate((1, 2)):        # the second step runs the compiled graph only
        idx, tgt = _lm_data(seed)
        m.zero_grad()
        ref.zero_grad()
        before = dict(inductor.stats)
        loss = cm(idx, tgt)
        loss.backward()
        lref = ref(idx, tgt)
        lref.backward()
        torch.testing.assert_close(loss.double(), lref, atol=1e-5, rtol=1e-5)
        for n, p in ref.named_parameters():
            got = dict(m.named_parameters())[n].grad
            assert got is not None, f"{n}: no gradient"
            torch.testing.assert_close(got.double(), p.grad, atol=1e-5, rtol=1e-4, msg=n)
        r = be.report()
        # (the norms' and the loss's backward kernels are tested in test_training.py; here the
        # report must name every reduction, the RMSNorm and the softmax taken, as differentiable ops)
        assert sorted(_short_op(e.op) for e in r.entries) == sorted(
            ["torch.rms_norm", "Tensor.softmax", "F.layer_norm", "F.cross_entropy"]), str(r)
        assert {"torch.rms_norm", "Tensor.softmax"} <= {_short_op(e.op) for e in r.taken}, str(r)
        assert all(e.reason for e in r.left), str(r)
        regions = {e.region for e in r.taken}
        graphs = [g for cf in be.functions for g in cf.graphs.values()]
        assert len(graphs) == 1 and graphs[0].error is None and callable(graphs[0].fn)
        assert "region_call" in graphs[0].code
        # one acefuse::region call per region and one acefuse::region_bwd per region, this step
        assert inductor.stats["region_calls"] - before["region_calls"] == len(regions)
        assert inductor.stats["region_bwd_calls"] - before["region_bwd_calls"] == len(regions)
    assert inductor.stats["inductor_compiles"] >= 1


@pytest.mark.slow
def test_inductor_inner_inference_matches_eager():
    from acefuse.frontend import inductor
    torch._dynamo.reset()
    m, ref = _inductor_lm(seed=3)
    be = af.Backend(inner="inductor")
    cm = torch.compile(m, backend=be, dynamic=False)
    idx, tgt = _lm_data(4)
    with torch.no_grad():
        before = inductor.stats["region_calls"]
        loss = cm(idx, tgt)
        torch.testing.assert_close(loss.double(), ref(idx, tgt), atol=1e-5, rtol=1e-5)
        assert inductor.stats["region_calls"] - before == len({e.region for e in be.report().taken}) >= 3
        idx, tgt = _lm_data(5)
        torch.testing.assert_close(cm(idx, tgt).double(), ref(idx, tgt), atol=1e-5, rtol=1e-5)


def _short_op(op):
    return op.replace("torch.nn.functional.", "F.")


def _small_block(x, w, w1, w2):
    h = F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
    h = F.silu(h @ w1) * (h @ w2)                      # Inductor's: matmuls, SiLU-mul
    return torch.softmax(h * 0.5, -1) * 2 + x


def test_inductor_inner_small_block_inference_and_training():
    """The default suite's Inductor case: one graph compiled for inference and for training;
    outputs and every input's gradient match float64 eager, the regions are listed and run as
    ``acefuse::region`` (``acefuse::region_bwd``) calls inside Inductor's compiled graphs."""
    from acefuse.frontend import inductor
    torch._dynamo.reset()
    args = [_g(3, 6, 8), 1 + 0.3 * _g(8, seed=1), _g(8, 8, seed=2) / 3, _g(8, 8, seed=3) / 3]
    be = af.Backend(inner="inductor")
    cm = torch.compile(_small_block, backend=be, dynamic=False)
    with torch.no_grad():
        before = inductor.stats["region_calls"]
        _close(cm(*args), _small_block(*_f64(args)))
        assert inductor.stats["region_calls"] - before == 2        # rms_norm, softmax
    r = be.report()
    assert sorted(_short_op(e.op) for e in r.taken) == ["torch.rms_norm", "torch.softmax"], str(r)
    assert not r.left, str(r)
    g, = [g for cf in be.functions for g in cf.graphs.values()]
    assert g.error is None and "region_call" in g.code and g.code.count("region_call(") == 2
    # training: fresh inputs, every input requires grad
    args = [a.clone().requires_grad_() for a in (_g(3, 6, 8, seed=7), args[1], args[2], args[3])]
    ref = [a.detach().double().requires_grad_() for a in args]
    cot = _g(3, 6, 8, seed=9)
    before = dict(inductor.stats)
    out = cm(*args)
    (out * cot).sum().backward()
    (_small_block(*ref) * cot.double()).sum().backward()
    _close(out.detach(), _small_block(*ref).detach())
    for a, b in zip(args, ref):
        assert a.grad is not None
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-4)
    assert inductor.stats["region_calls"] - before["region_calls"] == 2
    assert inductor.stats["region_bwd_calls"] - before["region_bwd_calls"] == 2
    assert not be.report().left, str(be.report())


def test_inductor_inner_bf16_norm_op_reads_bf16_and_trains():
    """``acefuse::region`` of a bfloat16 residual add + RMSNorm: the op takes the bfloat16 sources
    as they are (no widening adapter in the graph Inductor compiles) and writes bfloat16, equal
    to eager; in training (widened inputs, derived backward) every gradient is eager's."""
    from acefuse.frontend import inductor
    torch._dynamo.reset()
    a, b = _g(3, 4, 32, seed=2).bfloat16(), _g(3, 4, 32, seed=3).bfloat16()
    w = (_g(32, seed=4).abs() + 0.5).bfloat16()
    be = af.Backend(inner="inductor")
    cm = torch.compile(residual_rms_norm, backend=be, dynamic=False)
    with torch.no_grad():
        r, y = cm(a, b, w)
    er, ey = residual_rms_norm(a, b, w)
    assert torch.equal(r, er) and y.dtype == torch.bfloat16
    assert (y == ey).double().mean() > 0.99 and ((y.double() - ey.double()).abs() <= _bf16_ulp(ey)).all()
    g, = [g for cf in be.functions for g in cf.graphs.values()]
    reg, = g.af_regions
    entry = inductor._ENTRIES[reg.op_key]
    assert entry.plan is not None and all(c == () for c in entry.plan[0].values()), entry.plan
    # training: the same function, inputs requiring grad
    args = [t.clone().requires_grad_() for t in (a, b, w)]
    ref = [t.detach().clone().requires_grad_() for t in (a, b, w)]
    cot = _g(3, 4, 32, seed=5).bfloat16()
    r, y = cm(*args)
    ((r + y).float() * cot.float()).sum().backward()
    r2, y2 = residual_rms_norm(*ref)
    ((r2 + y2).float() * cot.float()).sum().backward()
    for x, xr in zip(args, ref):
        torch.testing.assert_close(x.grad.double(), xr.grad.double(), atol=0.05, rtol=0.02)


def _scaled_softmax(x, w):
    return torch.softmax(x * w, -1)


def test_region_op_gradients_are_never_dropped(monkeypatch):
    """The ops Inductor sees, run eagerly (no Inductor compile): ``acefuse::region``'s autograd
    formula runs the derived backward kernels; when they fail, or an input needs a gradient the
    region's backward was not derived for, the gradient is torch autograd of the program, with
    a warning: every gradient matches float64 eager."""
    from acefuse.autograd import GradientFallbackWarning
    from acefuse.frontend import inductor
    from acefuse.frontend.graph import capture
    from acefuse.frontend.runtime import specialize
    x, w = _g(4, 9, seed=11), 1 + 0.3 * _g(9, seed=12)
    cot = _g(4, 9, seed=13)

    def grads(fn, wants_w, dtype=torch.float32):
        xs = [x.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_(wants_w)]
        (fn(*xs) * cot.to(dtype)).sum().backward()
        return [a.grad for a in xs]

    ref = grads(_scaled_softmax, True, torch.float64)
    with torch.enable_grad():
        xs = [x.clone().requires_grad_(), w.clone()]           # specialised: only x requires grad
        og = inductor.op_graph(specialize(capture(_scaled_softmax, xs), xs, "t"))
    assert "region_call" in og.code
    entry = inductor._ENTRIES[og.af_regions[0].op_key]
    gx, gw = grads(og, False)
    assert gw is None and entry.calls["backward"] == 1 and entry.calls["backward_torch"] == 0
    torch.testing.assert_close(gx.double(), ref[0], atol=ATOL, rtol=RTOL)
    with pytest.warns(GradientFallbackWarning, match=r"need gradients its backward was not derived for"):
        gx, gw = grads(og, True)                              # w requires grad now: torch's gradient
    assert entry.calls["backward_torch"] == 1
    torch.testing.assert_close(gx.double(), ref[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(gw.double(), ref[1], atol=ATOL, rtol=RTOL)

    def broken(**kw):
        raise RuntimeError("deliberately broken backward kernel")
    monkeypatch.setattr(entry.dk, "_bwd_kernel", broken)
    with pytest.warns(GradientFallbackWarning, match=r"backward kernel failed at .backward\(\).*deliberately broken"):
        gx, _ = grads(og, False)
    assert entry.calls["backward_torch"] == 2
    torch.testing.assert_close(gx.double(), ref[0], atol=ATOL, rtol=RTOL)


def test_backend_takes_only_the_region_kinds_asked_for():
    """``Backend(take=...)``: the other regions stay torch ops (Inductor's, with inner='inductor'),
    listed as left with that reason; the result is eager's."""
    with pytest.raises(ValueError, match=r"unknown region kinds \['norms'\]; the kinds are attention, loss"):
        af.Backend(take={"norms"})
    x, w, t = _g(6, 11), 1 + 0.3 * _g(11, seed=1), torch.tensor([0, 3, 10, 5, 5, 2])

    def fn(x, w, t):
        return F.cross_entropy(F.rms_norm(x, (11,), w) * 3, t, reduction="none")

    torch._dynamo.reset()
    be = af.Backend(inner="eager", take="loss")
    _close(torch.compile(fn, backend=be, dynamic=False)(x, w, t), fn(x.double(), w.double(), t))
    r = be.report()
    assert [_short_op(e.op) for e in r.taken] == ["F.cross_entropy"], str(r)
    assert [(_short_op(e.op), e.reason) for e in r.left] == [
        ("torch.rms_norm", "not taken: a norm, and the backend takes loss (Backend(take=...))")], str(r)


# ---- elementwise torch.max(a, b) / torch.min(a, b) inside a region ------------------------------
def clamp_between_then_softmax(x, lo, hi):   # elementwise min/max feeding a reduction, and a reduction
    return torch.softmax(torch.min(torch.max(x, lo), hi) * 3, -1), x.max(-1).values


def test_elementwise_max_min_are_part_of_a_region_not_reductions():
    """Binary ``torch.max(a, b)`` is elementwise: it joins the softmax's region and is not listed
    in the report (before: two extra 'taken' reductions), while ``x.max(-1)`` still reduces."""
    x, lo, hi = _g(5, 13, seed=60), _g(5, 13, seed=61) - 0.5, _g(13, seed=62) + 0.5
    cf = af.compile(clamp_between_then_softmax, x, lo, hi)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        got = cf(x, lo, hi)
    _close(got, clamp_between_then_softmax(*_f64([x, lo, hi])))
    ops = [(e.op.replace("torch.nn.functional.", "F."), e.status) for e in cf.report().entries]
    assert sorted(ops) == [("Tensor.max", "taken"), ("torch.softmax", "taken")], str(cf.report())


# ---- capture errors name the function and what to pass ------------------------------------------
def scaled_softmax(x, w):
    return torch.softmax(x * w, -1)


def test_capture_errors_say_what_to_pass():
    x = _g(3, 5, seed=63)
    with pytest.raises(TypeError, match=r"af.compile\(scaled_softmax.*missing an example for 'w'"):
        af.compile(scaled_softmax, x)
    with pytest.raises(TypeError, match=r"scaled_softmax.*3 example input"):
        af.compile(scaled_softmax, x, x, x)
    with pytest.raises(aff.FrontendError, match=r"scaled_softmax: the captured function fails on these "
                       r"inputs in `operator.mul` at test_frontend.py:\d+.*size of tensor"):
        af.compile(scaled_softmax, x, _g(4, seed=64))
    cf = af.compile(scaled_softmax, x, _g(5, seed=64))       # (the right inputs compile)
    _close(cf(x, _g(5, seed=64)), scaled_softmax(x.double(), _g(5, seed=64).double()))


# ---- a region whose reductions run over two axes splits into one region per axis ---------------
def norm_rows_softmax_cols_norm_rows(x, w):   # layer_norm over dim 1, softmax over dim 0, again dim 1
    h = torch.softmax(F.layer_norm(x, (x.shape[-1],), w) * 2, dim=0)
    return F.layer_norm(h, (x.shape[-1],))


def test_region_over_three_axis_changes_splits_at_each():
    """Partitioning only (no kernel): the region [layer_norm, mul, softmax, layer_norm] is cut at
    each change of reduced axis, into convex pieces each over one axis."""
    from acefuse.frontend.graph import capture, propagate
    from acefuse.frontend.importer import reduced_dims
    from acefuse.frontend.partition import find_regions, split_at_axis_change
    x, w = _g(6, 9, seed=65), _g(9, seed=66) + 1
    gm = capture(norm_rows_softmax_cols_norm_rows, (x, w))
    propagate(gm, (x, w))
    (region,) = find_regions(gm)
    red = reduced_dims(region)
    assert sorted(dims for _, dims in red.values()) == [(0,), (1,), (1,)]
    pieces, work = [], [region]
    while work:
        p = work.pop(0)
        s = split_at_axis_change(p, reduced_dims(p))
        if s is None:
            pieces.append(p)
        else:
            work[:0] = s
    names = [[n.target.__name__ if callable(n.target) else n.target for n in p] for p in pieces]
    assert names == [["layer_norm", "mul"], ["softmax"], ["layer_norm"]], names


def mean_over_rows_and_cols(x):      # two reductions over different dims, neither depending on the other
    return x - x.mean(0) - x.mean(1, keepdim=True)


def global_variance(x):              # one op reducing over both dims, and a reduction depending on it
    return (x - x.mean()).pow(2).mean()


def test_reductions_over_two_dims_split_or_say_why_in_torch_terms():
    x = _g(6, 9, seed=67)
    cf = af.compile(mean_over_rows_and_cols, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        got = cf(x)
    _close(got, mean_over_rows_and_cols(x.double()))
    r = cf.report()
    assert len(r.taken) == 2 and not r.left and len(cf.regions) == 2, str(r)
    with pytest.warns(AcefuseFallbackWarning, match=r"`Tensor.mean` reduces over dims \[0, 1\] at once"):
        cf = af.compile(global_variance, x)
    got = cf(x)
    _close(got, global_variance(x.double()))
    r = cf.report()
    assert len(r.left) == 2 and "axis=" not in str(r) and "x.flatten().mean()" in r.left[0].reason, str(r)
