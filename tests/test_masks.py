"""The mask and score gallery (examples/masks.py) against float64 torch references on the
CPU (Triton's interpreter), the mask analysis' soundness checked exhaustively at small
sizes, and the language pieces it rests on (lookups, integer inputs, (i, j) tensors,
contractions without a softmax, several contraction axes)."""
import itertools
import math
import random
import runpy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import acefuse as af
from tests.programs import index_op
from acefuse.codegen.masks import MaskAnalysis, tile_truth, tile_stats
from acefuse.rewrite.terms import Term

GAL = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "masks.py"))
GALLERY, make_inputs, reference = GAL["GALLERY"], GAL["make_inputs"], GAL["reference"]
N = 40   # not a multiple of the CPU tiles (32 rows, 16 keys): partial tiles on both axes


def _err(got, ref):
    assert not torch.isnan(got).any()
    return ((got.double() - ref).abs().max() / max(1.0, ref.abs().max().item())).item()


@pytest.fixture(scope="module")
def kernels():
    return {}


def _kernel(kernels, name):
    if name not in kernels:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kernels[name] = af.compile(GALLERY[name].program, axis="j")
    return kernels[name]


@pytest.mark.parametrize("name", list(GALLERY))
def test_gallery_matches_float64_reference(kernels, name):
    kern = _kernel(kernels, name)
    prog = GALLERY[name].program
    inputs = make_inputs(name, B=2, H=1, N=N, seed=random.randrange(2 ** 31))
    out = kern(**{n: t for n, t in inputs.items() if n in prog.tensors})
    ref = reference(name, inputs)
    assert out.shape == ref.shape
    assert _err(out, ref) < 2e-5, name
    data = {n: inputs[n][0] for n in ("doc",) if n in inputs}   # document ids of batch 0
    st = tile_stats(kern.fusion, {"b": 2, "h": 1, "i": N, "j": N, "n": N, "d": 16, "e": 16}, 32, 16, data)
    print(f"{name}: mask analysis skips {st['skipped']:.0%} of {st['tiles']} tiles, "
          f"{st['full']:.0%} run unmasked")


@pytest.mark.parametrize("name", ["document_mask", "paged_kv", "additive_mask", "mla_split_scores", "t5_buckets"])
def test_gallery_split_kv_schedule(kernels, name):
    """The split-KV schedule (partial states per key chunk, then the derived merge)."""
    kern = _kernel(kernels, name)
    prog = GALLERY[name].program
    inputs = make_inputs(name, B=1, H=2, N=70, seed=random.randrange(2 ** 31))
    out = kern(**{n: t for n, t in inputs.items() if n in prog.tensors}, schedule="split", nsplit=3)
    assert _err(out, reference(name, inputs)) < 2e-5


def test_paged_decode_one_query_row(kernels):
    kern = _kernel(kernels, "paged_kv")
    inputs = make_inputs("paged_kv", B=3, H=2, N=45, seed=random.randrange(2 ** 31))
    inputs["q"] = inputs["q"][:, :, -1:].contiguous()
    out = kern(**{n: t for n, t in inputs.items() if n not in ("k", "v")}, schedule="split")
    assert out.shape == (3, 2, 1, 16)
    assert _err(out, reference("paged_kv", inputs)) < 2e-5


def test_gallery_has_the_listed_variants():
    want = {"document_mask", "prefix_lm", "dilated_sliding_window", "natten_2d", "block_diagonal",
            "relative_bias", "t5_buckets", "alibi", "softcap", "sigmoid_attention", "mla_split_scores",
            "boolean_mask", "additive_mask", "paged_kv", "relu_attention"}
    assert want <= set(GALLERY) and len(GALLERY) >= 15


@pytest.mark.parametrize("name,least", [("causal", 0.3), ("sliding_window", 0.6), ("block_diagonal", 0.7),
                                        ("natten_2d", 0.5), ("dilated_sliding_window", 0.6),
                                        ("document_mask", 0.6), ("relu_attention", 0.3)])
def test_mask_analysis_skips_tiles(kernels, name, least):
    """At 256 x 256 with 16 x 16 tiles (analysis only); document ids: 8 sorted documents."""
    data = {"doc": np.repeat(np.arange(8.0), 32)}
    st = tile_stats(_kernel(kernels, name).fusion, {"i": 256, "j": 256, "n": 256}, 16, 16, data)
    assert st["skipped"] >= least, st


def test_bfloat16_document_mask(kernels):
    kern = _kernel(kernels, "document_mask")
    inputs = make_inputs("document_mask", N=N, dtype=torch.bfloat16, seed=5)
    out = kern(**inputs)
    assert out.dtype == torch.bfloat16
    assert _err(out, reference("document_mask", inputs)) < 3e-2


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_lookup_out_of_range_is_nan_not_a_wrong_value(kernels):
    kern = _kernel(kernels, "relative_bias")
    inputs = make_inputs("relative_bias", N=N, seed=2)
    inputs["rel"] = inputs["rel"][:, : N]   # too short: distances j - i > 0 have no entry
    out = kern(**inputs)
    assert torch.isnan(out).any()


def test_page_table_must_be_integer(kernels):
    kern = _kernel(kernels, "paged_kv")
    inputs = make_inputs("paged_kv", N=N, seed=3)
    del inputs["k"], inputs["v"]
    inputs["pages"] = inputs["pages"].float()
    with pytest.raises(TypeError, match="pages.*int32/int64"):
        kern(**inputs)


# ---- the mask analysis is sound: exhaustive over tile boxes at small sizes --------------------
class _Gen(MaskAnalysis):
    """What the analysis needs of a kernel generator: the key axis, the row axes, tensors."""
    axis, R, G, E, C, L = "j", ["i"], [], [], [], ["n"]
    tensors = {"doc": ("n",)}


DOC = af.tensor("doc", "n")


def _ev(t: Term, I, J, doc=None):
    """Independent evaluation of an index condition on integer grids (Python semantics); a
    lookup ``doc.at(n=...)`` outside the ids is NaN (as in the kernel)."""
    op, a = t.op, t.args
    if op == "Take":
        p = np.asarray(_ev(a[1], I, J, doc))
        ok = (p >= 0) & (p < len(doc))
        return np.where(ok, doc[np.where(ok, p, 0).astype(np.int64)], np.nan)
    if op == "Num":
        return np.int64(a[0])
    if op == "Idx":
        return I if a[0] == "i" else J
    if op == "Size":
        return np.int64(J.shape[1] if a[0] == "j" else I.shape[0])
    x = [_ev(c, I, J, doc) for c in t.children]
    return index_op(op, x)


def _rand_index(rng, depth):
    i, j = af.index("i"), af.index("j")
    if depth == 0:
        return rng.choice([i, j, i, j, rng.randint(-6, 9), DOC.at(n=i), DOC.at(n=j)])
    a, b = _rand_index(rng, depth - 1), _rand_index(rng, depth - 1)
    c = rng.randint(1, 5)
    kind = rng.randrange(8)
    if isinstance(a, int) and isinstance(b, int):
        a = i
    return [lambda: a + b, lambda: a - b, lambda: af.lang._lift(a) * c, lambda: af.abs(af.lang._lift(a) - b),
            lambda: af.lang._lift(a) // c, lambda: af.lang._lift(a) % c, lambda: af.maximum(a, b),
            lambda: af.minimum(a, b)][kind]()


def _rand_cond(rng, depth=2):
    try:
        return _rand_cond1(rng, depth)
    except af.LanguageError:   # an integer operator drew a lookup (a float): draw again
        return _rand_cond(rng, depth)


def _rand_cond1(rng, depth):
    if depth == 0 or rng.random() < 0.4:
        a, b = af.lang._lift(_rand_index(rng, rng.randint(0, 2))), _rand_index(rng, rng.randint(0, 2))
        return rng.choice([a < b, a <= b, a > b, a >= b, a.eq(b), a.ne(b)])
    x, y = _rand_cond(rng, depth - 1), _rand_cond(rng, depth - 1)
    return rng.choice([x & y, x | y, ~x])


def _check_sound(cond: Term, n_i, n_j, bi, bj, doc=None):
    """Every (row tile, key tile) box: always-false boxes hold no true pair, always-true
    boxes no false one. Returns the number of boxes decided."""
    I, J = np.arange(n_i)[:, None], np.arange(n_j)[None, :]
    doc = np.zeros(1) if doc is None else doc
    with np.errstate(invalid="ignore"):
        truth = np.broadcast_to(_ev(cond, I, J, doc), (n_i, n_j))
    starts = np.arange(0, n_j, bj)
    decided = 0
    for i0 in range(0, n_i, bi):
        i1 = min(i0 + bi, n_i)
        rows = np.arange(i0, i0 + bi)
        env = {"i_lo": float(i0), "i_hi": float(i1 - 1), "len_i": n_i, "len_n": len(doc), "idx_i": rows,
               "rmask": rows < n_i}
        with np.errstate(invalid="ignore"):
            t_, f_ = tile_truth(_Gen(), cond, env, starts, bj, n_j, {"doc": doc})
        for s, at, af_ in zip(starts, t_, f_):
            box = truth[i0:i1, s:min(s + bj, n_j)]
            assert not (af_ and box.any()), f"skipped a visible pair: {cond} box i {i0}.. j {s}.."
            assert not (at and not box.all()), f"called a masked pair visible: {cond} box i {i0}.. j {s}.."
            decided += bool(at) + bool(af_)
    return decided


def test_mask_analysis_is_sound_on_random_conditions():
    rng = random.Random(1234)
    decided = 0
    for trial in range(150):
        cond = _rand_cond(rng).term
        # document ids: sorted runs, some positions past the ids' end (lookups read NaN there)
        doc = np.sort(np.array([rng.randrange(4) for _ in range(15)], dtype=np.float64))
        for n_i, n_j, bi, bj in ((7, 9, 1, 1), (13, 11, 4, 3), (20, 17, 5, 8)):
            decided += _check_sound(cond, n_i, n_j, bi, bj, doc)
    assert decided > 1000   # the analysis decides many boxes: the check is not vacuous


@pytest.mark.parametrize("name", ["causal", "prefix_lm", "sliding_window", "dilated_sliding_window",
                                  "block_diagonal", "block_causal", "natten_2d"])
def test_mask_analysis_is_sound_on_the_gallery(name):
    prog = GALLERY[name].program
    conds = {t.args[0] for e in prog.outputs.values() for t in e.term.walk()
             if t.op == "Where" and t.args[2].op == "Num" and t.args[2].args[0] == -math.inf}
    assert conds
    for cond, (n, bi, bj) in itertools.product(conds, ((48, 1, 1), (48, 16, 16), (61, 7, 5))):
        _check_sound(cond, n, n, bi, bj)


def test_document_ids_are_bounded_by_the_values_read():
    """doc[i] == doc[j] over sorted ids: tiles of different documents are skipped, tiles
    inside one document run unmasked; an atom on a lookup of an expression stays unknown."""
    i, j = af.index("i"), af.index("j")
    doc = np.repeat([0.0, 1.0, 2.0, 3.0], 16)      # four documents of 16 positions
    env = {"i_lo": 0.0, "i_hi": 15.0, "idx_i": np.arange(16), "rmask": np.ones(16, bool), "len_n": 64}
    cond = DOC.at(n=i).eq(DOC.at(n=j)).term
    t_, f_ = tile_truth(_Gen(), cond, env, np.arange(0, 64, 16), 16, 64, {"doc": doc})
    assert list(t_) == [True, False, False, False] and list(f_) == [False, True, True, True]
    cond = (DOC.at(n=j + 1).eq(DOC.at(n=i)) & (j <= i)).term   # j + 1: not analysed; j <= i is
    t_, f_ = tile_truth(_Gen(), cond, env, np.arange(0, 64, 16), 16, 64, {"doc": doc})
    assert not t_.any() and list(f_) == [False, True, True, True]


# ---- the constructs behind the gallery -----------------------------------------------------------
def test_query_only_or_key_only_condition_runs_in_the_interpreter():
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    i, j = af.index("i"), af.index("j")
    s = af.where((i < 3) | (j < 5), af.sum(q * k, "d"), af.NEG_INF)
    p = af.exp(s - af.max(s, "j"))
    prog = af.program("or_mask", o=af.sum(p * v, "j") / af.sum(p, "j"))
    g = torch.Generator().manual_seed(random.randrange(2 ** 31))
    Q, K, V = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = af.compile(prog)(q=Q, k=K, v=V)
    sc = torch.einsum("bhid,bhjd->bhij", Q.double(), K.double())
    I, J = torch.arange(20)[:, None], torch.arange(20)[None, :]
    sc = sc.masked_fill(~((I < 3) | (J < 5)), -math.inf)
    assert _err(out, torch.softmax(sc, -1) @ V.double()) < 2e-5


def test_plain_key_sum_next_to_attention():
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    s = af.sum(q * k, "d")
    p = af.exp(s - af.max(s, "j"))
    prog = af.program("attn_and_key_sum", o=af.sum(p * v, "j") / af.sum(p, "j"), vsum=af.sum(v, "j"))
    g = torch.Generator().manual_seed(random.randrange(2 ** 31))
    Q, K, V = torch.randn(2, 1, 21, 16, generator=g), torch.randn(2, 1, 37, 16, generator=g), \
        torch.randn(2, 1, 37, 8, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = af.compile(prog, axis="j")(q=Q, k=K, v=V)
    sc = torch.einsum("bhid,bhjd->bhij", Q.double(), K.double())
    assert _err(out["o"], torch.softmax(sc, -1) @ V.double()) < 2e-5
    assert _err(out["vsum"], V.double().sum(2)) < 2e-5


def test_linear_attention_without_softmax():
    q, k, v = af.tensor("q", "b i d"), af.tensor("k", "b j d"), af.tensor("v", "b j e")
    prog = af.program("linear_attention", o=af.sum(af.sum(q * k, "d") * v, "j"))
    g = torch.Generator().manual_seed(random.randrange(2 ** 31))
    Q, K, V = torch.randn(3, 19, 8, generator=g), torch.randn(3, 33, 8, generator=g), torch.randn(3, 33, 24, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = af.compile(prog, axis="j")(q=Q, k=K, v=V)
    assert _err(out, Q.double() @ K.double().transpose(1, 2) @ V.double()) < 2e-5


def test_lookup_spelling_and_errors():
    doc = af.tensor("doc", "b n")
    e = doc.at(n=af.index("i"))
    assert e.term.op == "Take" and set(e.axes) == {"b", "i"}
    with pytest.raises(af.LanguageError, match="exactly one axis"):
        doc.at(n=af.index("i"), b=0)
    with pytest.raises(af.LanguageError, match="not an axis"):
        doc.at(m=af.index("i"))


def test_scalar_input_gqa_and_document_mask():
    """A 0-d runtime scalar (a temperature), grouped query heads and a document mask."""
    i, j = af.index("i"), af.index("j")
    c = af.tensor("c", "")
    q, k, v = af.tensor("q", "b g r i d"), af.tensor("k", "b g j d"), af.tensor("v", "b g j e")
    doc = af.tensor("doc", "b n")
    s = af.where(doc.at(n=i).eq(doc.at(n=j)), af.sum(q * k, "d") * c, af.NEG_INF)
    p = af.exp(s - af.max(s, "j"))
    prog = af.program("gqa_doc_temperature", o=af.sum(p * v, "j") / af.sum(p, "j"))
    g = torch.Generator().manual_seed(random.randrange(2 ** 31))
    Q, K, V = torch.randn(2, 2, 3, 33, 16, generator=g), torch.randn(2, 2, 33, 16, generator=g), \
        torch.randn(2, 2, 33, 16, generator=g)
    ids = torch.sort(torch.randint(0, 3, (2, 33), generator=g), 1).values   # int64 ids
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = af.compile(prog)(q=Q, k=K, v=V, doc=ids, c=torch.tensor(0.3))
    sc = torch.einsum("bgrid,bgjd->bgrij", Q.double(), K.double()) * 0.3
    keep = ids[:, None, None, :, None] == ids[:, None, None, None, :]
    assert _err(out, torch.softmax(sc.masked_fill(~keep, -math.inf), -1) @ V.double()[:, :, None]) < 2e-5


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float32])
def test_mask_tensor_combined_with_index_condition(dtype):
    """A mask tensor (bool, int or float: nonzero keeps) inside `&` with an index condition:
    the tensor is read as float32 and must become a condition, not a float operand of `&`."""
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    keep = af.tensor("keep", "b i j")
    i, j = af.index("i"), af.index("j")
    s = af.sum(q * k, "d") * 0.25
    sc = af.where(keep & (j <= i), s, af.NEG_INF)
    m = af.max(sc, "j")
    p = af.exp(sc - m)
    prog = af.program("mask_and_causal", o=af.sum(p * v, "j") / af.sum(p, "j"))
    g = torch.Generator().manual_seed(11)
    Q, K, V = (torch.randn(2, 2, 21, 8, generator=g) for _ in range(3))
    keep_b = torch.rand(2, 21, 21, generator=g) > 0.3
    mask = keep_b[:, None] & (torch.arange(21)[None, :] <= torch.arange(21)[:, None])
    S = (torch.einsum("bhid,bhjd->bhij", Q.double(), K.double()) * 0.25).masked_fill(~mask, -math.inf)
    ref = torch.softmax(S, -1).nan_to_num(0.0) @ V.double()
    keep_t = keep_b.to(dtype) * (3 if dtype == torch.float32 else 1)    # nonzero, not only 1
    with torch.no_grad():
        o = af.compile(prog)(q=Q, k=K, v=V, keep=keep_t)
    torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)
