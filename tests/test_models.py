"""Real models through the frontend: Hugging Face transformers (tiny configs, random init,
CPU, Triton interpreter) through ``torch.compile(backend=af.Backend())`` and ``af.compile``.

Each model's logits must match eager torch (float64 eager as the reference, float32 kernels),
and the report must list every reduction-like computation, each taken by acefuse or left to
torch with a reason that names what is missing. The expected reports are written out per
model: a reduction that silently goes to torch, or a reason that changes, fails the test.
"""
import warnings

import pytest
import torch

import acefuse as af
from acefuse.frontend.runtime import AcefuseFallbackWarning

tf = pytest.importorskip("transformers")

V, T = 64, 7
ATOL, RTOL = 2e-5, 2e-4        # float32 kernels vs float64 eager (logits are O(1))

_COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": lambda: (tf.LlamaConfig(**_COMMON), tf.LlamaForCausalLM),
    "mistral": lambda: (tf.MistralConfig(**_COMMON, sliding_window=4), tf.MistralForCausalLM),
    "qwen2": lambda: (tf.Qwen2Config(**_COMMON), tf.Qwen2ForCausalLM),
    "gemma2": lambda: (tf.Gemma2Config(**_COMMON, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
                                       final_logit_softcapping=30.0), tf.Gemma2ForCausalLM),
    "gpt2": lambda: (tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                   bos_token_id=0, eos_token_id=0), tf.GPT2LMHeadModel),
    "bert": lambda: (tf.BertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=64), tf.BertForMaskedLM),
}

# (model, attention implementation) -> the report: (op, status or reason prefix) in graph order
NORM = {"llama": "Tensor.mean", "mistral": "Tensor.mean", "qwen2": "Tensor.mean", "gemma2": "Tensor.mean",
        "gpt2": "F.layer_norm", "bert": "F.layer_norm"}
N_NORMS = {"llama": 3, "mistral": 3, "qwen2": 3, "gemma2": 5, "gpt2": 3, "bert": 4}

FAST = [("llama", "eager"), ("gemma2", "eager"), ("gpt2", "eager"), ("qwen2", "sdpa")]
SLOW = [("bert", "sdpa"), ("mistral", "eager"), ("qwen2", "eager"), ("bert", "eager"),
        ("llama", "sdpa"), ("mistral", "sdpa"),
        ("gpt2", "sdpa")]
CASES = [pytest.param(m, i, id=f"{m}-{i}") for m, i in FAST] + \
        [pytest.param(m, i, id=f"{m}-{i}", marks=pytest.mark.slow) for m, i in SLOW]


def _model(name, impl):
    torch.manual_seed(0)
    cfg, cls = MODELS[name]()
    cfg._attn_implementation = impl
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(cfg).eval()


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :2] = 0                 # a padded row: the mask reaches the attention softmax
    return ids, mask


def _check_logits(model, got, ids, mask):
    eager = model(input_ids=ids, attention_mask=mask).logits
    ref = model.double()(input_ids=ids, attention_mask=mask).logits
    model.float()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # float64 eager is the reference where it is defined: a causal query before the padding
    # ends sees no key, and HF's float64 mask (finfo.min added to a score) overflows to -inf
    # there (NaN rows); those rows are compared with float32 eager, which defines them
    ok = ~ref.isnan().any(-1)
    assert ok.sum() >= ok.numel() - 2, "NaN in float64 eager beyond the fully padded rows"
    torch.testing.assert_close(got.double()[ok], ref[ok], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[~ok], eager[~ok], atol=ATOL, rtol=RTOL)


def _short(op):
    return op.replace("torch.nn.functional.", "F.")


@pytest.mark.parametrize("name,impl", CASES)
def test_model_logits_match_eager_and_report_names_every_reduction(name, impl):
    model = _model(name, impl)
    ids, mask = _inputs()
    be = af.Backend()
    with torch.no_grad():
        cm = torch.compile(lambda i, m: model(input_ids=i, attention_mask=m).logits, backend=be, dynamic=False)
        got = cm(ids, mask)
        _check_logits(model, got, ids, mask)
    r = be.report()
    print(r)
    norms = [e for e in r.entries if _short(e.op) == NORM[name]]
    assert len(norms) == N_NORMS[name] and all(e.status == "taken" for e in norms), str(r)
    attn = [e for e in r.entries if _short(e.op) in ("F.softmax", "F.scaled_dot_product_attention")]
    assert len(attn) == 1, str(r)
    # eager: matmul attention, the masked (softcapped, sliding-window) softmax is fused; sdpa: the
    # whole attention with its padding/causal/sliding-window mask over (query, key) is one kernel
    assert attn[0].status == "taken" and attn[0].program is not None, str(r)
    if impl == "sdpa":
        assert _short(attn[0].op) == "F.scaled_dot_product_attention", str(r)
    assert len(r.entries) == len(norms) + len(attn), str(r)
    for e in r.entries:
        assert e.line and ".py:" in e.line, e
    assert all(e.program.name.startswith("dynamo_") for e in r.taken)


def test_af_compile_takes_a_model_forward_with_padding():
    """af.compile captures through Dynamo, like torch.compile: HF's mask construction
    (sizes from .shape, torch.arange, dtype branches) is one graph."""
    model = _model("llama", "eager")
    ids, mask = _inputs(seed=3)

    def logits(ids, mask):
        return model(input_ids=ids, attention_mask=mask).logits

    with torch.no_grad():
        cf = af.compile(logits, ids, mask)
        got = cf(ids, mask)
        _check_logits(model, got, ids, mask)
    r = cf.report()
    assert len(r.taken) == 4 and not r.left, str(r)
    assert "4 taken, 0 left to torch" in str(r)



@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_low_precision_model_is_as_accurate_as_eager(dtype):
    """Llama in bfloat16/float16: LlamaRMSNorm's float32 math and `.to(input_dtype)`, softmax's
    dtype=float32 then `.to(query.dtype)`: the kernels round where eager rounds, so the
    logits are as close to float64 as eager's are."""
    model = _model("llama", "eager").to(dtype)
    ids, mask = _inputs(seed=5)
    be = af.Backend()
    with torch.no_grad():
        got = torch.compile(lambda i, m: model(input_ids=i, attention_mask=m).logits, backend=be, dynamic=False)(ids, mask)
        eager = model(input_ids=ids, attention_mask=mask).logits
        ref = model.double()(input_ids=ids, attention_mask=mask).logits
    ok = ~ref.isnan().any(-1)
    assert got.dtype == dtype
    err, eager_err = [(t.double()[ok] - ref[ok]).abs().max().item() for t in (got, eager)]
    assert err <= 2 * eager_err + torch.finfo(dtype).eps * ref[ok].abs().max().item(), (err, eager_err)
    assert len(be.report().taken) == 4 and not be.report().left, str(be.report())


@pytest.mark.parametrize("impl,pad", [("eager", False), ("sdpa", True)], ids=["eager", "sdpa-padding"])
def test_model_trains_through_the_backend(impl, pad):
    """Llama's loss and every parameter's gradient through torch.compile(backend=af.Backend()):
    the norms, the attention softmax (eager: the masked softmax between torch's matmuls; sdpa:
    the whole attention with its padding + causal mask over (query, key), a [B, 1, L, S] input
    that requires no grad) and the loss are differentiable acefuse kernels, nothing is left to
    torch, and no gradient is dropped. (With padding, float64 eager is the reference only for
    sdpa: eager attention's float64 mask overflows to NaN rows, see _check_logits.)"""
    model = _model("llama", impl).train()
    ids, mask = _inputs(seed=7)
    labels = ids.masked_fill(mask == 0, -100) if pad else ids
    kw = dict(attention_mask=mask) if pad else {}
    be = af.Backend()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)   # nothing falls back to torch
        loss = torch.compile(lambda i, l: model(input_ids=i, labels=l, **kw).loss, backend=be,
                             dynamic=False)(ids, labels)
        loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    m64 = model.double()
    ref = m64(input_ids=ids, labels=labels, **kw).loss
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.double(), atol=ATOL, rtol=RTOL)   # (HF's loss upcasts to float32)
    for n, p in m64.named_parameters():
        assert got[n] is not None and p.grad.abs().max() > 0, n
        torch.testing.assert_close(got[n].double(), p.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {n}: {m}")
    model.float()
    r = be.report()
    ops = [(_short(e.op), e.status) for e in r.entries]
    attn = "F.scaled_dot_product_attention" if impl == "sdpa" else "F.softmax"
    assert ops.count(("Tensor.mean", "taken")) == 3 and ("F.cross_entropy", "taken") in ops, str(r)
    assert (attn, "taken") in ops and not r.left, str(r)
    regions = [g for cf in be.functions for g in cf.graphs.values()]
    assert sum(reg.calls["grad"] for g in regions for reg in g.af_regions) == len(r.entries)
    assert sum(reg.calls["torch"] for g in regions for reg in g.af_regions) == 0


@pytest.mark.slow
def test_llama_through_inductor_with_acefuse_regions():
    """Llama (SDPA, a padded row) through ``af.Backend(inner="inductor")``: Inductor compiles the
    graph with each acefuse region one ``acefuse::region`` op. Inference logits match float64
    eager with every reduction taken; a training step's loss and every parameter's gradient
    match float64 eager, and the region ops (forward and backward) run inside the compiled graphs."""
    from acefuse.frontend import inductor
    model = _model("llama", "sdpa")
    ids, mask = _inputs(seed=11)
    torch._dynamo.reset()
    be = af.Backend(inner="inductor")
    with torch.no_grad():
        before = inductor.stats["region_calls"]
        got = torch.compile(lambda i, m: model(input_ids=i, attention_mask=m).logits, backend=be, dynamic=False)(ids, mask)
        _check_logits(model, got, ids, mask)
    r = be.report()
    assert len(r.taken) == 4 and not r.left, str(r)         # 3 norms and the attention
    assert inductor.stats["region_calls"] - before == 4
    assert all(g.error is None for cf in be.functions for g in cf.graphs.values())

    model.train()
    labels = ids.masked_fill(mask == 0, -100)
    torch._dynamo.reset()
    be = af.Backend(inner="inductor")
    before = dict(inductor.stats)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AcefuseFallbackWarning)   # (a region acefuse cannot differentiate: torch's)
        loss = torch.compile(lambda i, l: model(input_ids=i, attention_mask=mask, labels=l).loss, backend=be,
                             dynamic=False)(ids, labels)
        loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    m64 = model.double()
    ref = m64(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.double(), atol=ATOL, rtol=RTOL)
    for n, p in m64.named_parameters():
        assert got[n] is not None and p.grad.abs().max() > 0, n
        torch.testing.assert_close(got[n].double(), p.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"grad {n}: {m}")
    model.float()
    r = be.report()
    assert len(r.entries) == 5 and all(e.reason for e in r.left), str(r)   # + the loss
    assert [_short(e.op) for e in r.taken].count("Tensor.mean") == 3, str(r)
    n = len({e.region for e in r.taken})
    assert inductor.stats["region_calls"] - before["region_calls"] == n
    assert inductor.stats["region_bwd_calls"] - before["region_bwd_calls"] == n


@pytest.mark.slow
def test_bf16_llama_regions_make_no_copies_and_the_benchmarks_smoke_run():
    """Issue 12 at the model level (a tiny bfloat16 Llama, inner='eager'): no region call makes a
    float32 copy or runs a cast for its norms (each norm, its rounding and its weight are one
    kernel), and no cast is left around a norm region in the graph; ``benchmarks/bench_models.py
    --size tiny`` (the CPU smoke run) and ``region_overhead.py`` run end to end."""
    import sys
    from pathlib import Path
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        import bench_models
        import region_overhead
        rows, info = region_overhead.measure("tiny", "eager", "inference", None, calls=2)
        norms = [r for r in rows if r["region"].endswith("_mean")]
        assert len(norms) == 5 and info["regions"] == 8, rows          # 2 layers x 2 + the final norm; 2 SDPA, loss
        for r in norms:
            assert not r["copies"] and not r["graph_casts"], r
        assert bench_models.main(["--size", "tiny", "--mode", "both", "--impls", "eager,acefuse-eager",
                                  "--steps", "1"]) == 0
    finally:
        sys.path.remove(bench)
