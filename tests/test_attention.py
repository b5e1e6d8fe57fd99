"""Attention variants, derived from the plain program and compiled into the
contraction family, against a float64 torch reference on the CPU (interpreter)."""
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af

EX = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "attention.py"))
MASKS = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "masks.py"))
SCALE, WINDOW, CAP = EX["SCALE"], EX["WINDOW"], EX["CAP"]


def reference(q, k, v, bias=None, mask=None, cap=None):
    """Plain float64 attention; fully masked rows give 0 (documented convention)."""
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("...id,...jd->...ij", q, k) * SCALE
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias
    return MASKS["softmax_reference"](s, v, mask)


def _idx(n_i, n_j):
    i = torch.arange(n_i)[:, None]
    j = torch.arange(n_j)[None, :]
    return i, j


def _check(got, ref, dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    assert not torch.isnan(got).any()
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"max abs error {err:.3e}"


@pytest.fixture(scope="module")
def kernels():
    return {}


def _kernel(kernels, name):
    if name not in kernels:
        kernels[name] = af.compile(EX[name])
    return kernels[name]


@pytest.mark.parametrize("schedule", ["loop", "split"])
@pytest.mark.parametrize("shape", [(1, 2, 37, 29, 16), (2, 1, 5, 70, 32)])
def test_global(kernels, shape, schedule):
    B, H, NI, NJ, D = shape
    g = torch.Generator().manual_seed(NI * NJ)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (NI, NJ, NJ))
    o = _kernel(kernels, "attention")(q=q, k=k, v=v, schedule=schedule)
    assert o.shape == (B, H, NI, D)
    _check(o, reference(q, k, v), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal(kernels, dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 45, 16, generator=g).to(dtype) for _ in range(3))
    i, j = _idx(45, 45)
    o = _kernel(kernels, "causal")(q=q, k=k, v=v)
    assert o.dtype == dtype
    _check(o, reference(q, k, v, mask=j <= i), dtype)


def test_causal_queries_and_keys_of_different_lengths(kernels):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 3, 19, 16, generator=g)
    k, v = (torch.randn(1, 3, 53, 16, generator=g) for _ in range(2))
    i, j = _idx(19, 53)
    _check(_kernel(kernels, "causal")(q=q, k=k, v=v), reference(q, k, v, mask=j <= i), torch.float32)


def test_alibi(kernels):
    g = torch.Generator().manual_seed(5)
    H = 3
    q, k, v = (torch.randn(2, H, 33, 16, generator=g) for _ in range(3))
    slope = torch.rand(H, generator=g) * 0.5
    i, j = _idx(33, 33)
    bias = slope[:, None, None] * (j - i)
    o = _kernel(kernels, "alibi")(q=q, k=k, v=v, slope=slope)
    _check(o, reference(q, k, v, bias=bias, mask=j <= i), torch.float32)


def test_softcap(kernels):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 27, 16, generator=g) * 4 for _ in range(3))
    _check(_kernel(kernels, "softcap")(q=q, k=k, v=v, schedule="split"), reference(q, k, v, cap=CAP), torch.float32)


def test_sliding_window_skips_and_is_exact(kernels):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(3))
    i, j = _idx(300, 300)
    kern = _kernel(kernels, "sliding_window")
    o = kern(q=q, k=k, v=v, block_i=32, block_j=32)
    _check(o, reference(q, k, v, mask=(j <= i) & (i - j < WINDOW)), torch.float32)
    # the mask analysis produced tile skipping and mask-free full tiles
    assert "seen = (~(" in kern.source and "# fully visible tiles" in kern.source
    src = kern.source
    assert "tl.where(" in src.split("# fully visible tiles")[0]  # masked loops evaluate the mask


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa(kernels, group):
    g = torch.Generator().manual_seed(group)
    B, G, N, D = 1, 2, 21, 16
    q = torch.randn(B, G * group, N, D, generator=g)
    k, v = (torch.randn(B, G, N, D, generator=g) for _ in range(2))
    o = _kernel(kernels, "gqa")(q=q.view(B, G, group, N, D), k=k, v=v)
    ref = reference(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    _check(o.reshape(B, G * group, N, D), ref, torch.float32)


@pytest.mark.parametrize("n_kv,nsplit", [(97, 3), (130, 4), (64, 5)])
def test_decode_split_kv(kernels, n_kv, nsplit):
    g = torch.Generator().manual_seed(n_kv)
    B, G, R, D = 2, 2, 4, 16
    q = torch.randn(B, G, R, 1, D, generator=g)
    k, v = (torch.randn(B, G, n_kv, D, generator=g) for _ in range(2))
    kern = _kernel(kernels, "decode")
    o = kern(q=q, k=k, v=v, schedule="split", nsplit=nsplit, block_j=16)
    ref = reference(q.reshape(B, G * R, 1, D), k.repeat_interleave(R, 1), v.repeat_interleave(R, 1))
    _check(o.reshape(B, G * R, 1, D), ref, torch.float32)


def test_fully_masked_rows_give_zero():
    q = af.tensor("q", "b h i d"); k = af.tensor("k", "b h j d"); v = af.tensor("v", "b h j e")
    i, j = af.index("i"), af.index("j")
    s = af.where(j < i - 3, af.sum(q * k, "d") * SCALE, af.NEG_INF)   # rows i <= 3 see nothing
    m = af.max(s, "j"); p = af.exp(s - m)
    prog = af.program("masked_rows", o=af.sum(p * v, "j") / af.sum(p, "j"))
    kern = af.compile(prog)
    g = torch.Generator().manual_seed(8)
    q_, k_, v_ = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    ii, jj = _idx(24, 24)
    for sched in ("loop", "split"):
        o = kern(q=q_, k=k_, v=v_, schedule=sched, block_j=16)
        _check(o, reference(q_, k_, v_, mask=jj < ii - 3), torch.float32)
        assert torch.all(o[:, :, :4] == 0)


def test_deferred_normalization_is_derived(kernels):
    f = af.fuse(EX["inside"])
    assert f.fusible and f.normal_form, "normal-form extraction should move the division out of the sum"
    out = f.encoding.outputs["o"]
    assert out.op == "Div" and all(a.op == "St" for a in out.args)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 17, 64, generator=g) for _ in range(3))
    _check(af.compile(EX["inside"])(q=q, k=k, v=v), reference(q, k, v), torch.float32)


def test_attention_is_derived_not_templated():
    f = af.fuse(EX["attention"])
    p = f.passes[0]
    assert [s.op for s in p.states] == ["max", "sum", "sum"]
    assert str(p.rolling["s"]) == "s_A * exp(m_A - m_AB) + sum_B(exp(e1 - m_AB) * v)"
    assert str(p.merge["s"]) == "s_A * exp(m_A - m_AB) + s_B * exp(m_B - m_AB)"
    assert "mul-swap-right" in f.rule_chain("s", "rolling")


# ---- issue 15: the Hopper path (TMA descriptors, pipelined key loop), forced in the interpreter ----

def _loop_body(src, kernel, what="# fully visible tiles"):
    """The fully visible key loop of ``kernel`` in a generated module's source."""
    body = src.split(f"def {kernel}(")[1].split("\n\n\n")[0]
    return body.split(what)[1].split("    for start in")[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,shape", [("attention", (1, 2, 37, 29, 16)), ("causal", (2, 1, 70, 70, 32)),
                                        ("causal", (1, 1, 40, 100, 24)), ("gqa", (1, 2, 21, 21, 16))])
def test_hopper_path_computes_what_the_portable_path_does(kernels, name, shape, dtype):
    """The Hopper kernel is generated from the same derived expressions; only the memory
    movement differs (tiles past the ends read zeros from the descriptors): within tolerance
    of float64 at odd sizes, and the portable kernel's values up to summation order."""
    B, H, NI, NJ, D = shape
    g = torch.Generator().manual_seed(NI * NJ + D)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (NI, NJ, NJ))
    kern = _kernel(kernels, name)
    i, j = _idx(NI, NJ)
    if name == "gqa":   # 2 query heads per key/value head
        k, v = k[:, :1], v[:, :1]
        args = dict(q=q.view(B, 1, 2, NI, D), k=k, v=v)
        ref = reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)).view(B, 1, 2, NI, D)
    else:
        args = dict(q=q, k=k, v=v)
        ref = reference(q, k, v, mask=(j <= i) if name == "causal" else None)
    assert set(kern.module.HOPPER) >= {"k", "v"}
    portable = kern(**args, path="portable")
    hopper = kern(**args, path="hopper")
    _check(hopper, ref, dtype)
    # the same arithmetic on the same tiles: equal up to float32 summation order in the
    # interpreter's dot (and one rounding of the 16-bit output)
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}[dtype]
    assert (hopper.double() - portable.double()).abs().max().item() <= ulp * max(1.0, ref.abs().max().item())


def test_hopper_path_is_chosen_by_capability_and_layout(kernels, monkeypatch):
    kern = _kernel(kernels, "attention")
    mod = kern.module
    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    dev = torch.device("cpu")
    ins = dict(q=q, k=k, v=v)
    monkeypatch.delenv("ACEFUSE_HOPPER", raising=False)
    assert not mod.hopper_ok(ins, dev, torch.float32)       # no TMA on the CPU unless forced
    monkeypatch.setenv("ACEFUSE_HOPPER", "1")
    assert mod.hopper_ok(ins, dev, torch.float32)
    # a non-contiguous head axis, or rows whose stride is not a multiple of 16 bytes: portable
    assert not mod.hopper_ok(dict(ins, k=k.transpose(-1, -2).contiguous().transpose(-1, -2)), dev, torch.float32)
    assert not mod.hopper_ok(dict(ins, v=torch.randn(1, 2, 33, 17)[..., :16]), dev, torch.float32)
    monkeypatch.setenv("ACEFUSE_HOPPER", "0")
    assert not mod.hopper_ok(ins, dev, torch.float32)
    with pytest.raises(ValueError, match="path='portable'"):
        kern(**ins, path="hopper")


def test_a_failing_hopper_kernel_falls_back_visibly(kernels, monkeypatch):
    """The automatic choice survives a Triton that cannot build the Hopper kernel: a warning
    names the error, the portable kernel runs (and keeps running); path='hopper' raises."""
    kern = _kernel(kernels, "attention")
    mod = kern.module

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise RuntimeError("no TMA in this Triton")
            return launch
    monkeypatch.setenv("ACEFUSE_HOPPER", "1")
    monkeypatch.setattr(mod, "attention_attn_hopper", Broken())
    monkeypatch.setattr(mod, "_NO_HOPPER", [])
    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    with pytest.warns(UserWarning, match="Hopper kernel failed .*no TMA in this Triton"):
        o = kern(q=q, k=k, v=v)
    _check(o, reference(q, k, v), torch.float32)
    assert mod._NO_HOPPER and torch.equal(kern(q=q, k=k, v=v), o)
    with pytest.raises(Exception, match="no TMA"):
        kern(q=q, k=k, v=v, path="hopper")


def test_generated_loop_reads_like_the_tutorial(kernels):
    """Issue 15: the score tile is multiplied once (by scale * log2(e), inside the exp2; the
    max runs on the raw dot product and scales one value per row), fully visible tiles apply
    no mask, and the Hopper kernel's loads there are TMA copies (no masked loads)."""
    src = _kernel(kernels, "causal").source
    for kernel in ("causal_attn", "causal_attn_hopper"):
        body = _loop_body(src, kernel)
        dot = body.split(" = tl.dot(")[0].split()[-1]
        assert body.count(f"{dot} * ") == 1, body
        assert "tmask" not in body and "tl.where(" not in body
    hop = _loop_body(src, "causal_attn_hopper")
    assert "tl.load(" not in hop and "desc_k.load([start, 0])" in hop and "desc_v.load([start, 0])" in hop
    assert "tl.range(a, b, BLOCK_J, warp_specialize=WS)" in src
    head = src.split("def causal_attn(")[1].split("BIG = ")[0]
    assert "len_b_f" not in head and "nj_f" not in head   # no dead temporaries


def test_paged_kv_has_no_hopper_kernel():
    """Key rows read through a lookup (paged KV) are gathered, not boxes: no TMA kernel."""
    kern = af.compile(MASKS["GALLERY"]["paged_kv"].program, axis="j")
    assert "def paged_kv_attn_hopper(" not in kern.source and kern.module.HOPPER == {}
