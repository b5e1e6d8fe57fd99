"""A gallery of attention masks and score modifications, written as plain programs
(FlexAttention's attention-gym and Neptune's operators): index arithmetic, lookups of
integer tensors along any axis (``doc.at(n=i)``), tensors over queries and keys, and
contraction bodies without a softmax. acefuse derives the fused kernel of each, and
its mask analysis skips the key tiles a mask excludes entirely.

Each entry of ``GALLERY`` is a ``Variant``: the program, a maker of random inputs at
given sizes, and an independent float64 torch reference (tests/test_masks.py runs
them all on the CPU; tests/test_gpu.py on the GPU). Sizes: ``B, H, N, D`` with one
query and one key sequence of length ``N``; NATTEN takes ``N = GRID[0] * GRID[1]``.
"""
import math
from dataclasses import dataclass
from typing import Callable

import torch

import acefuse as af

D = 16
SCALE = 1.0 / math.sqrt(D)
WINDOW, DILATION, BLOCK, PREFIX, CAP, PAGE = 8, 2, 16, 12, 20.0, 8
GRID = (6, 8)            # NATTEN: queries and keys on a 6 x 8 image, row-major
RADIUS = 1               # NATTEN: a 3 x 3 neighbourhood, shifted inward at the borders

q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
i, j = af.index("i"), af.index("j")
score = af.sum(q * k, "d") * SCALE


@dataclass
class Variant:
    program: af.Program
    inputs: Callable      # (generator, B, H, N, D) -> extra inputs (besides q, k, v)
    reference: Callable   # (q, k, v, **extra) in float64 -> output


def softmax_attention(name, s, v=v):
    m = af.max(s, "j")
    p = af.exp(s - m)
    return af.program(name, o=af.sum(p * v, "j") / af.sum(p, "j"))


# ---- float64 references (torch only; fully masked rows give 0, README "Numerics") -------------
def _scores(q, k):
    return torch.einsum("bhid,bhjd->bhij", q, k) * SCALE


def softmax_reference(s, v, mask=None):
    """Softmax attention from float64 scores ``s`` (masked out where ``mask`` is False):
    ``softmax(s) @ v``, with 0 for a fully masked row (tests/test_attention.py uses it too)."""
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = p @ v
    return torch.where(l == 0, torch.zeros_like(o), o / l)


def _ij(q, k):
    return torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]


def _masked(cond):
    """A variant whose mask is a function of the query and key indices."""
    return lambda q, k, v: softmax_reference(_scores(q, k), v, cond(*_ij(q, k)))


def _none(g, B, H, N, D):
    return {}


GALLERY = {}

# -- masks from index arithmetic ----------------------------------------------------------------
GALLERY["causal"] = Variant(softmax_attention("causal", af.where(j <= i, score, af.NEG_INF)), _none,
                            _masked(lambda i, j: j <= i))
GALLERY["prefix_lm"] = Variant(
    softmax_attention("prefix_lm", af.where((j <= i) | (j < PREFIX), score, af.NEG_INF)), _none,
    _masked(lambda i, j: (j <= i) | (j < PREFIX)))
GALLERY["sliding_window"] = Variant(
    softmax_attention("sliding_window", af.where((j <= i) & (i - j < WINDOW), score, af.NEG_INF)), _none,
    _masked(lambda i, j: (j <= i) & (i - j < WINDOW)))
GALLERY["dilated_sliding_window"] = Variant(
    softmax_attention("dilated_window", af.where((af.abs(i - j) < WINDOW * DILATION) & ((i - j) % DILATION).eq(0),
                                                 score, af.NEG_INF)), _none,
    _masked(lambda i, j: ((i - j).abs() < WINDOW * DILATION) & ((i - j) % DILATION == 0)))
GALLERY["block_diagonal"] = Variant(
    softmax_attention("block_diagonal", af.where((i // BLOCK).eq(j // BLOCK), score, af.NEG_INF)), _none,
    _masked(lambda i, j: i // BLOCK == j // BLOCK))
GALLERY["block_causal"] = Variant(   # block diffusion / semi-autoregressive: whole blocks see each other
    softmax_attention("block_causal", af.where(j // BLOCK <= i // BLOCK, score, af.NEG_INF)), _none,
    _masked(lambda i, j: j // BLOCK <= i // BLOCK))


def _natten_centre(x, n):
    return af.minimum(af.maximum(x, RADIUS), n - 1 - RADIUS)


_qy, _qx, _ky, _kx = i // GRID[1], i % GRID[1], j // GRID[1], j % GRID[1]
GALLERY["natten_2d"] = Variant(
    softmax_attention("natten_2d", af.where(
        (af.abs(_natten_centre(_qy, GRID[0]) - _ky) <= RADIUS) & (af.abs(_natten_centre(_qx, GRID[1]) - _kx) <= RADIUS),
        score, af.NEG_INF)), _none,
    _masked(lambda i, j: ((i // GRID[1]).clamp(RADIUS, GRID[0] - 1 - RADIUS) - j // GRID[1]).abs().le(RADIUS)
            & ((i % GRID[1]).clamp(RADIUS, GRID[1] - 1 - RADIUS) - j % GRID[1]).abs().le(RADIUS)))

# -- lookups of integer tensors along any axis --------------------------------------------------
doc = af.tensor("doc", "b n")            # document id of each position (int32)


def _docs(g, B, H, N, D):
    return {"doc": torch.sort(torch.randint(0, 4, (B, N), generator=g), dim=1).values.to(torch.int32)}


GALLERY["document_mask"] = Variant(
    softmax_attention("document_mask", af.where(doc.at(n=i).eq(doc.at(n=j)) & (j <= i), score, af.NEG_INF)), _docs,
    lambda q, k, v, doc: softmax_reference(_scores(q, k), v, (doc[:, None, :, None] == doc[:, None, None, :])
                                      & _ij(q, k)[1].le(_ij(q, k)[0])))

rel = af.tensor("rel", "h r")            # learned bias per head and relative distance (2N - 1 entries)
GALLERY["relative_bias"] = Variant(
    softmax_attention("relative_bias", score + rel.at(r=j - i + af.size("i") - 1)),
    lambda g, B, H, N, D: {"rel": torch.randn(H, 2 * N - 1, generator=g)},
    lambda q, k, v, rel: softmax_reference(_scores(q, k) + rel[:, (_ij(q, k)[1] - _ij(q, k)[0] + q.shape[2] - 1)][None], v))

bucket = af.tensor("bucket", "i j")      # precomputed T5 relative-position buckets (int32)
t5 = af.tensor("t5", "h u")              # one learned bias per head and bucket


def _t5_buckets(N, n_buckets=8, max_distance=32):
    rp = torch.arange(N)[None, :] - torch.arange(N)[:, None]
    half = n_buckets // 2
    ret = (rp > 0).long() * half
    n = rp.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (half - exact)).long()
    return (ret + torch.where(n < exact, n, large.clamp(max=half - 1))).to(torch.int32)


GALLERY["t5_buckets"] = Variant(
    softmax_attention("t5_buckets", score + t5.at(u=bucket)),
    lambda g, B, H, N, D: {"bucket": _t5_buckets(N), "t5": torch.randn(H, 8, generator=g)},
    lambda q, k, v, bucket, t5: softmax_reference(_scores(q, k) + t5[:, bucket.long()][None], v))

# -- tensors over queries and keys --------------------------------------------------------------
bias = af.tensor("bias", "b h i j")      # SDPA's float attn_mask, Graphormer's spatial bias
keep = af.tensor("keep", "b i j")        # SDPA's boolean attn_mask (bool, int or float; nonzero keeps)
GALLERY["additive_mask"] = Variant(
    softmax_attention("additive_mask", score + bias),
    lambda g, B, H, N, D: {"bias": torch.randn(B, H, N, N, generator=g)},
    lambda q, k, v, bias: softmax_reference(_scores(q, k) + bias, v))
GALLERY["boolean_mask"] = Variant(
    softmax_attention("boolean_mask", af.where(keep.ne(0), score, af.NEG_INF)),
    lambda g, B, H, N, D: {"keep": torch.rand(B, N, N, generator=g) > 0.4},
    lambda q, k, v, keep: softmax_reference(_scores(q, k), v, keep[:, None]))

# -- score modifications ------------------------------------------------------------------------
slope = af.tensor("slope", "h")
GALLERY["alibi"] = Variant(
    softmax_attention("alibi", af.where(j <= i, score + slope * (j - i), af.NEG_INF)),
    lambda g, B, H, N, D: {"slope": 2.0 ** (-8.0 * (torch.arange(H) + 1) / H)},
    lambda q, k, v, slope: softmax_reference(_scores(q, k) + slope[:, None, None] * (_ij(q, k)[1] - _ij(q, k)[0]), v,
                                        _ij(q, k)[1] <= _ij(q, k)[0]))
GALLERY["softcap"] = Variant(
    softmax_attention("softcap", CAP * af.tanh(score / CAP)), _none,
    lambda q, k, v: softmax_reference(CAP * torch.tanh(_scores(q, k) / CAP), v))

# -- contractions without a softmax, several contraction axes -------------------------------------
GALLERY["sigmoid_attention"] = Variant(   # Apple's SigmoidAttn: sigmoid(s - log n), no normalisation
    af.program("sigmoid_attention", o=af.sum(af.sigmoid(score - af.log(af.size("j"))) * v, "j")), _none,
    lambda q, k, v: torch.sigmoid(_scores(q, k) - math.log(k.shape[2])) @ v)
GALLERY["relu_attention"] = Variant(
    af.program("relu_attention", o=af.sum(af.where(j <= i, af.maximum(score, 0.0), 0.0) * v, "j") / af.size("j")),
    _none, lambda q, k, v: torch.where(_ij(q, k)[1] <= _ij(q, k)[0], _scores(q, k).clamp(min=0), 0.0) @ v / k.shape[2])

qr = af.tensor("qr", "b h i c")          # MLA: decoupled rotary parts of queries and keys
kr = af.tensor("kr", "b h j c")
GALLERY["mla_split_scores"] = Variant(
    softmax_attention("mla_split_scores", (af.sum(q * k, "d") + af.sum(qr * kr, "c")) * SCALE),
    lambda g, B, H, N, D: {"qr": torch.randn(B, H, N, 8, generator=g), "kr": torch.randn(B, H, N, 8, generator=g)},
    lambda q, k, v, qr, kr: softmax_reference(_scores(q, k) + torch.einsum("bhic,bhjc->bhij", qr, kr) * SCALE, v))

# -- paged KV: keys and values gathered from a shared page pool through a page table ---------------
kc = af.tensor("kc", "h n d")            # the page pool, pages of PAGE rows laid end to end
vc = af.tensor("vc", "h n e")
pages = af.tensor("pages", "b p")        # page table: the pool page holding each sequence's page p
kvalid = af.tensor("kvalid", "b j")      # key padding (sequences of different lengths)
slot = pages.at(p=j // PAGE) * PAGE + j % PAGE
paged_score = af.where(kvalid.ne(0), af.sum(q * kc.at(n=slot), "d") * SCALE, af.NEG_INF)
_pm = af.max(paged_score, "j")
_pp = af.exp(paged_score - _pm)


def _paged_inputs(g, B, H, N, D):
    n_pages = -(-N // PAGE)
    pool = B * n_pages + 3
    perm = torch.randperm(pool, generator=g)[:B * n_pages].view(B, n_pages).to(torch.int32)
    lengths = torch.randint(N // 2, N + 1, (B,), generator=g)
    return {"kc": torch.randn(H, pool * PAGE, D, generator=g), "vc": torch.randn(H, pool * PAGE, D, generator=g),
            "pages": perm, "kvalid": (torch.arange(N)[None, :] < lengths[:, None]).to(torch.int32)}


def _paged_ref(q, k, v, kc, vc, pages, kvalid):
    N = k.shape[2]
    jj = torch.arange(N)
    slots = pages.long()[:, jj // PAGE] * PAGE + jj % PAGE                 # [B, N]
    kk = kc[:, slots].permute(1, 0, 2, 3)                                # [B, H, N, D]
    vv = vc[:, slots].permute(1, 0, 2, 3)
    return softmax_reference(_scores(q, kk), vv, (kvalid != 0)[:, None, None, :])


GALLERY["paged_kv"] = Variant(af.program("paged_kv", o=af.sum(_pp * vc.at(n=slot), "j") / af.sum(_pp, "j")),
                              _paged_inputs, _paged_ref)


def make_inputs(name, B=2, H=2, N=48, dtype=torch.float32, seed=0):
    """Fresh random inputs of a variant (q, k, v and its own)."""
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(B, H, N, D, generator=g).to(dtype) for n in ("q", "k", "v")}
    extra = GALLERY[name].inputs(g, B, H, N, D)
    extra = {n: (t.to(dtype) if t.dtype.is_floating_point else t) for n, t in extra.items()}
    return {**base, **extra}


def reference(name, inputs):
    """The variant's float64 torch reference on ``inputs``."""
    f64 = {n: (t.double() if t.dtype.is_floating_point else t) for n, t in inputs.items()}
    return GALLERY[name].reference(**f64)


def export(out_dir):
    """Write each variant's generated module (torch + triton only) to ``out_dir`` as
    ``mask_<name>.py``, for machines without egglog (tests/test_gpu.py loads them)."""
    from pathlib import Path
    from acefuse.codegen.compile import compile_program
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, var in GALLERY.items():
        (out / f"mask_{name}.py").write_text(compile_program(var.program, axis="j").source)


def stats(N=4096, block_i=128, block_j=64, seed=0):
    """{variant: fraction of (query tile, key tile) pairs the mask analysis skips} at the
    GPU's tile shapes (analysis only; document ids and inputs from ``make_inputs``)."""
    from acefuse.codegen.masks import tile_stats
    out = {}
    for name, var in GALLERY.items():
        inputs = make_inputs(name, B=1, H=1, N=N, seed=seed)
        data = {n: inputs[n][0].numpy() for n in ("doc",) if n in inputs}
        fusion = af.fuse(var.program, axis="j")
        sizes = {"i": N, "j": N, "n": N, "b": 1, "h": 1, "d": D, "e": D}
        out[name] = tile_stats(fusion, sizes, block_i, block_j, data)["skipped"]
    return out


if __name__ == "__main__":
    import sys
    if "--export" in sys.argv:   # python examples/masks.py --export  ->  benchmarks/kernels/mask_*.py
        from pathlib import Path
        export(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels")
    if "--stats" in sys.argv:    # python examples/masks.py --stats: tiles skipped at N = 4096
        for name, frac in stats().items():
            print(f"{name:24s} skips {frac:6.1%} of the 128 x 64 tiles")
    else:
        for name, var in GALLERY.items():
            print(f"{name:24s} {var.program}")
