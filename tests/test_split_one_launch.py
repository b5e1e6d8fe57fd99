"""Split-KV in one launch (``schedule='split1'``, codegen/contraction.py ``kernel_split_last``):
each program folds one chunk of keys and stores its partial states, takes a ticket on its row
tile's counter, and the last one folds every chunk with the derived merge and writes the
outputs. Checked on the CPU (Triton's interpreter) against float64 torch with fresh random
inputs: odd key lengths and an uneven last chunk, GQA decode, masked programs (causal, sliding
window, ALiBi, rows that see no key), softcap, two outputs; the cached workspace reused over
several calls and two shapes alternating (its counters back at 0 after every launch), and
the result equal, bit for bit, to the two-launch split's (the same merge in the same order)."""
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af

ROOT = Path(__file__).resolve().parents[1]
EX = runpy.run_path(str(ROOT / "examples" / "attention.py"))
MASKS = runpy.run_path(str(ROOT / "examples" / "masks.py"))
SCALE, WINDOW, CAP = EX["SCALE"], EX["WINDOW"], EX["CAP"]


def reference(q, k, v, bias=None, mask=None, cap=None):
    """float64 attention (fully masked rows give 0, the documented convention)."""
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("...id,...jd->...ij", q, k) * SCALE
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if bias is not None:
        s = s + bias
    return MASKS["softmax_reference"](s, v, mask)


def _close(got, ref, tol=2e-5):
    assert not torch.isnan(got).any()
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"max abs error {err:.3e}"


@pytest.fixture(scope="module")
def kernels():
    return {}


def _kernel(kernels, name, prog=None):
    if name not in kernels:
        kernels[name] = af.compile(prog if prog is not None else EX[name])
    return kernels[name]


def _decode(g, n_kv, B=2, G=2, R=4, D=16):
    q = torch.randn(B, G, R, 1, D, generator=g)
    k, v = (torch.randn(B, G, n_kv, D, generator=g) for _ in range(2))
    return dict(q=q, k=k, v=v)


def _decode_ref(ins):
    q, k, v = ins["q"], ins["k"], ins["v"]
    B, G, R, _, D = q.shape
    ref = reference(q.reshape(B, G * R, 1, D), k.repeat_interleave(R, 1), v.repeat_interleave(R, 1))
    return ref.reshape(q.shape[:-1] + (v.shape[-1],))


def _counters(mod):
    return [c for p in mod._PLANS.values() if p.kernel == "split1" for _, c in p.wcache.values()]


@pytest.mark.parametrize("n_kv,nsplit", [(97, 3), (130, 4), (33, 5), (17, 2), (200, None)])
def test_decode_one_launch_against_float64(kernels, n_kv, nsplit):
    """GQA decode, odd key lengths, a last chunk shorter than the others (or a single partial
    tile), bit-equal to the two-launch split."""
    mod = _kernel(kernels, "decode").module
    g = torch.Generator().manual_seed(1000 + n_kv)
    ins = _decode(g, n_kv)
    o = mod.run(**ins, schedule="split1", nsplit=nsplit, block_j=16)
    _close(o, _decode_ref(ins))
    two = mod.run(**ins, schedule="split", nsplit=nsplit, block_j=16)
    assert torch.equal(o, two), "the one-launch split folds the same partial states in the same order"
    assert all(int(c.abs().sum()) == 0 for c in _counters(mod)), "every launch leaves its counters at 0"


def test_workspace_is_reused_and_shapes_alternate(kernels):
    """Several calls of one signature reuse one cached workspace (no new allocation, counters
    at 0 after each): views of one KV cache whose lengths alternate between two power-of-two
    classes (a plan each), the cache refilled with fresh values at every step, each result
    against float64; a length inside a class (fewer chunks) reuses its class's buffers."""
    mod = _kernel(kernels, "decode").module
    mod._PLANS.clear()
    g = torch.Generator().manual_seed(7)
    q = torch.empty(2, 2, 4, 1, 16)
    kc, vc = torch.empty(2, 2, 128, 16), torch.empty(2, 2, 128, 16)
    ptrs = {}
    for n_kv in (45, 120, 41, 127, 64, 100, 33):
        for t in (q, kc, vc):
            t.copy_(torch.randn(t.shape, generator=g))
        ins = dict(q=q, k=kc[:, :, :n_kv], v=vc[:, :, :n_kv])
        _close(mod.run(**ins, schedule="split1", block_j=16, nsplit=4), _decode_ref(ins))
        for p in (p for p in mod._PLANS.values() if p.kernel == "split1"):
            ((views, cnt),) = p.wcache.values()
            ptrs.setdefault(id(p), (views[0].data_ptr(), cnt.data_ptr()))
            assert ptrs[id(p)] == (views[0].data_ptr(), cnt.data_ptr()), "the workspace is allocated once"
            assert int(cnt.abs().sum()) == 0
    assert len(ptrs) == len(mod._PLANS) == 2   # key-length classes 64 and 128


def test_the_automatic_call_and_positional_calls(kernels):
    """Positional inputs take the full path (a plan per call, its workspace allocated per call)."""
    mod = _kernel(kernels, "decode").module
    g = torch.Generator().manual_seed(8)
    ins = _decode(g, 77, B=1, G=3, R=2, D=24)
    _close(mod.run(ins["q"], ins["k"], ins["v"], schedule="split1", block_j=16), _decode_ref(ins))


def test_bad_split_options_are_refused(kernels):
    mod = _kernel(kernels, "decode").module
    ins = _decode(torch.Generator().manual_seed(9), 40)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="nsplit must be a positive integer"):
            mod.run(**ins, schedule="split1", nsplit=bad)
    with pytest.raises(ValueError, match="'split1' \\(split-KV, one launch\\)"):
        mod.run(**ins, schedule="split2")


def _idx(n_i, n_j):
    return torch.arange(n_i)[:, None], torch.arange(n_j)[None, :]


@pytest.mark.parametrize("name", ["causal", "sliding_window", "alibi", "softcap"])
def test_masks_and_score_modifications(kernels, name):
    """Chunks a mask excludes entirely leave the states empty; the merge of empty and
    non-empty chunks is right. Keys longer than the window so some chunks are excluded."""
    kern = _kernel(kernels, name)
    g = torch.Generator().manual_seed(len(name))
    B, H, N, D = 1, 2, 300 if name == "sliding_window" else 70, 16
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    ii, jj = _idx(N, N)
    extra, kw = {}, {}
    if name == "causal":
        kw = dict(mask=jj <= ii)
    elif name == "sliding_window":
        kw = dict(mask=(jj <= ii) & (ii - jj < WINDOW))
    elif name == "alibi":
        slope = torch.rand(H, generator=g)
        extra = dict(slope=slope)
        kw = dict(mask=jj <= ii, bias=slope[:, None, None] * (jj - ii))
    else:
        kw = dict(cap=CAP)
    ref = reference(q, k, v, **kw)
    for nsplit in (3, 7):
        o = kern(q=q, k=k, v=v, **extra, schedule="split1", block_j=16, nsplit=nsplit)
        _close(o, ref)
        assert torch.equal(o, kern(q=q, k=k, v=v, **extra, schedule="split", block_j=16, nsplit=nsplit))


def test_rows_that_see_no_key_and_two_outputs():
    """A mask that leaves the first rows without any key (their outputs 0, never NaN) and a
    program with two outputs (the attention output and the log-sum-exp of the scores)."""
    q = af.tensor("q", "b h i d"); k = af.tensor("k", "b h j d"); v = af.tensor("v", "b h j e")
    i, j = af.index("i"), af.index("j")
    s = af.where(j < i - 3, af.sum(q * k, "d") * SCALE, af.NEG_INF)   # rows i <= 3 see nothing
    m = af.max(s, "j")
    p = af.exp(s - m)
    l = af.sum(p, "j")
    kern = af.compile(af.program("split1_masked_rows", o=af.sum(p * v, "j") / l))
    g = torch.Generator().manual_seed(10)
    q_, k_, v_ = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    ii, jj = _idx(40, 40)
    o = kern(q=q_, k=k_, v=v_, schedule="split1", block_j=16, nsplit=3)
    _close(o, reference(q_, k_, v_, mask=jj < ii - 3))
    assert torch.all(o[:, :, :4] == 0)

    s2 = af.sum(q * k, "d") * SCALE
    m2 = af.max(s2, "j")
    p2 = af.exp(s2 - m2)
    l2 = af.sum(p2, "j")
    two = af.compile(af.program("split1_two_outputs", o=af.sum(p2 * v, "j") / l2, lse=m2 + af.log(l2)))
    q_, k_, v_ = (torch.randn(2, 2, n, 16, generator=g) for n in (5, 83, 83))
    out = two(q=q_, k=k_, v=v_, schedule="split1", block_j=16, nsplit=4)
    _close(out["o"], reference(q_, k_, v_))
    lse = torch.logsumexp(torch.einsum("bhid,bhjd->bhij", q_.double(), k_.double()) * SCALE, -1)
    _close(out["lse"], lse)


@pytest.mark.parametrize("name", ["decode", "causal"])
def test_hopper_variant_in_the_interpreter(kernels, name, monkeypatch):
    """The TMA variant ({name}_split1_hopper, forced with path='hopper' in the interpreter):
    against float64 and bit-equal to the portable one-launch split."""
    kern = _kernel(kernels, name)
    mod = kern.module
    assert mod.SPLIT_HOPPER
    g = torch.Generator().manual_seed(11 + len(name))
    if name == "decode":
        ins = _decode(g, 83)
        ref = _decode_ref(ins)
    else:
        q, k, v = (torch.randn(1, 2, 45, 16, generator=g) for _ in range(3))
        ins = dict(q=q, k=k, v=v)
        ii, jj = _idx(45, 45)
        ref = reference(q, k, v, mask=jj <= ii)
    mod._PLANS.clear()
    o = mod.run(**ins, schedule="split1", block_j=16, nsplit=3, path="hopper")
    assert [p.kernel for p in mod._PLANS.values()] == ["split1_hopper"]
    _close(o, ref)
    assert torch.equal(o, mod.run(**ins, schedule="split1", block_j=16, nsplit=3))


def test_split_candidates_follow_the_device():
    """The one-launch candidates come from the SM count: chunk counts for at most 1, 2, 4 and 8
    programs per SM and the two-launch default's, never more chunks than key tiles."""
    mod = af.compile(EX["decode"]).module
    for sms, rows, n_j in ((132, 64, 4096), (114, 64, 4096), (132, 64, 256), (16, 8, 1 << 17)):
        cands = mod._split_candidates(1, rows, n_j, 64, sms)
        assert cands and all(c[0] == "split1" and c[1] in (64, 128) and c[3] in (4, 8) and c[4:] == (None, None)
                             for c in cands)
        tma = mod._split_candidates(1, rows, n_j, 64, sms, tma=True)
        assert {c for c in tma if c[4] is None} == set(cands)
        assert {c[:4] for c in tma if c[4] == "hopper"} == {c[:4] for c in cands if c[3] == 4}
        for c in cands:
            assert 2 <= c[2] <= -(-n_j // c[1])
        want = {max(2, k * sms // rows) for k in (1, 2, 4, 8)} | {-(-2 * sms // rows)}
        assert {c[2] for c in cands if c[1] == 64} == {n for n in want if n <= n_j // 64}


@pytest.mark.gpu
def test_one_launch_split_on_the_gpu():
    """On a GPU (programs run concurrently, the last arriver is any of them): decode at KV 4K in
    bf16 over every one-launch candidate the timed choice sees, portable and TMA, against
    float64 (fresh inputs, two calls each: the cached workspace's counters reset); two streams;
    a CUDA graph replayed with new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    mod = af.compile(EX["decode"]).module
    B, G, R, L, D = 8, 8, 4, 4096 - 37, 128
    g = torch.Generator(device="cuda").manual_seed(12)

    def fresh():
        return {n: torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
                for n, shape in (("q", (B, G, R, 1, D)), ("k", (B, G, L, D)), ("v", (B, G, L, D)))}, None

    def check(out, ins):
        q, k, v = (ins[n].double() for n in "qkv")
        s = torch.einsum("bgrid,bgjd->bgrij", q, k) * SCALE
        ref = torch.einsum("bgrij,bgje->bgrie", torch.softmax(s, -1), v)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, err

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tma = mod.SPLIT_HOPPER and mod.hopper_ok(fresh()[0], torch.device("cuda"), torch.bfloat16)
    for c in mod._split_candidates(1, B * G, 4096, 64, sms, tma=tma):
        kw = dict(schedule="split1", block_j=c[1], nsplit=c[2], num_warps=c[3], path=c[4], num_stages=c[5])
        for _ in range(2):
            ins, _ = fresh()
            try:
                check(mod.run(**ins, **kw), ins)
            except Exception as exc:   # a configuration this GPU cannot compile (shared memory) is skipped
                if not mod._compile_error(exc) and "out of resource" not in str(exc):
                    raise
    kw = dict(schedule="split1", block_j=64, nsplit=4)
    side = torch.cuda.Stream()
    a, _ = fresh()
    b, _ = fresh()
    side.wait_stream(torch.cuda.current_stream())
    oa = mod.run(**a, **kw)
    with torch.cuda.stream(side):
        ob = mod.run(**b, **kw)
    torch.cuda.synchronize()
    check(oa, a), check(ob, b)
    static, _ = fresh()
    mod.run(**static, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.run(**static, **kw)
    for _ in range(3):
        new, _ = fresh()
        for n in static:
            static[n].copy_(new[n])
        graph.replay()
        torch.cuda.synchronize()
        check(out, static)


GAL = runpy.run_path(str(ROOT / "examples" / "masks.py"))


@pytest.mark.parametrize("name", ["document_mask", "paged_kv", "additive_mask", "mla_split_scores", "t5_buckets",
                                  "natten_2d", "sigmoid_attention"])
def test_mask_gallery_in_one_launch(name):
    """Data-dependent masks (document ids), a paged KV cache read through a page table (no TMA
    variant), an additive mask, two contractions in the score (MLA), bucketed biases, a 2-D
    neighbourhood mask, sigmoid attention: the one-launch split against float64 and bit-equal to
    the two-launch split."""
    import warnings
    if name not in GAL["GALLERY"]:
        pytest.skip(f"{name} is not in examples/masks.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kern = af.compile(GAL["GALLERY"][name].program, axis="j")
    prog = GAL["GALLERY"][name].program
    if not kern.module.SPLIT:
        pytest.skip(f"{name} has no split schedule")
    inputs = GAL["make_inputs"](name, B=1, H=2, N=70, seed=int(torch.randint(0, 2 ** 31, ())))
    ins = {n: t for n, t in inputs.items() if n in prog.tensors}
    out = kern(**ins, schedule="split1", nsplit=3, block_j=16)
    _close(out, GAL["reference"](name, inputs))
    assert torch.equal(out, kern(**ins, schedule="split", nsplit=3, block_j=16))


def test_a_fastest_schedule_with_a_different_result_is_not_kept(kernels, monkeypatch):
    """The timed choice compares the winner's result with the loop's on the same inputs: a
    schedule whose result differs (here split-KV made wrong on purpose) is refused with a
    warning and the loop runs; an agreeing winner is kept without one."""
    import warnings
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")
    mod = _kernel(kernels, "decode").module
    ins = _decode(torch.Generator().manual_seed(13), 300)
    key = (1, 4, 16, 16, 512, "torch.float32", (16, 16))

    def fastest(cands, call, required=()):   # runs every candidate, then says split-KV was fastest
        for c in cands:
            call(c)
        return cands[1]
    monkeypatch.setattr(mod, "_fastest", fastest)
    mod._SCHEDULES.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert mod._timed_schedule(key, ins, None, 16) == ("split", None)
    real = mod.run

    def wrong(*a, schedule=None, **kw):
        out = real(*a, schedule=schedule, **kw)
        if schedule == "split":   # one chunk's keys lost, say
            out = out * 0.7
        return out
    monkeypatch.setattr(mod, "run", wrong)
    mod._SCHEDULES.clear()
    with pytest.warns(UserWarning, match="differ from the loop schedule"):
        assert mod._timed_schedule(key, ins, None, 16) == ("loop", None)
    mod._SCHEDULES.clear()
    assert mod._same_result({"o": torch.ones(3)}, {"o": torch.ones(3) * (1 + 1e-3)})
    assert not mod._same_result(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0]))


def test_an_unmasked_program_compiles_once_across_key_lengths(kernels):
    """SCAN (key tiles the mask analysis bounds per step) is a compile-time constant: a program
    with no mask keeps it fixed, so a KV cache growing across power-of-two classes reuses one
    compiled kernel; a masked one follows the key length."""
    mod = _kernel(kernels, "decode").module
    assert not mod.MASKED
    mod._PLANS.clear()
    g = torch.Generator().manual_seed(14)
    for n_kv in (40, 300, 1000):
        ins = _decode(g, n_kv)
        _close(mod.run(**ins, schedule="split1", block_j=16), _decode_ref(ins))
    assert {p.kw["SCAN"] for p in mod._PLANS.values()} == {16} and len(mod._PLANS) == 3
    causal = _kernel(kernels, "causal").module
    assert causal.MASKED


def test_host_bound_candidates_are_told_apart_by_gpu_time(kernels, monkeypatch):
    """_fastest with ``call.tie``: among candidates within the fraction of the fastest caller
    time (host-bound ones tie), the shortest GPU time wins; one far slower for the caller does
    not, however short its GPU time; without ``tie`` the fastest caller time wins as before."""
    mod = _kernel(kernels, "decode").module
    scripted = {"a": (1.00, 0.90), "b": (1.05, 0.50), "c": (2.00, 0.10)}
    current = []

    def time_calls(fn, reps=5):
        fn()
        t = mod._Time(scripted[current[-1]][0])
        t.gpu = scripted[current[-1]][1]
        return t
    monkeypatch.setattr(mod, "_time_calls", time_calls)

    def call(c):
        current.append(c)
    assert mod._fastest(["a", "b", "c"], call) == "a"
    call.tie = 0.15
    assert mod._fastest(["a", "b", "c"], call) == "b"
    call.tie = 0.01
    assert mod._fastest(["a", "b", "c"], call) == "a"


def test_each_stream_gets_its_own_workspace(kernels, monkeypatch):
    """Launches on one stream run in order and may share a workspace; another stream must not
    (its launches may overlap): the cache is keyed by stream (here _stream made to report two)."""
    mod = _kernel(kernels, "decode").module
    mod._PLANS.clear()
    g = torch.Generator().manual_seed(15)
    q = torch.empty(2, 2, 4, 1, 16)
    kc, vc = torch.empty(2, 2, 90, 16), torch.empty(2, 2, 90, 16)
    bufs = {}
    for step, st in enumerate((7, 8, 7, 8)):
        monkeypatch.setattr(mod, "_stream", lambda dev, st=st: st)
        for t in (q, kc, vc):
            t.copy_(torch.randn(t.shape, generator=g))
        ins = dict(q=q, k=kc, v=vc)
        _close(mod.run(**ins, schedule="split1", block_j=16, nsplit=3), _decode_ref(ins))
        (p,) = mod._PLANS.values()
        views, cnt = p.wcache[st]
        bufs.setdefault(st, views[0].data_ptr())
        assert bufs[st] == views[0].data_ptr() and int(cnt.abs().sum()) == 0
    assert set(p.wcache) == {7, 8} and bufs[7] != bufs[8]
