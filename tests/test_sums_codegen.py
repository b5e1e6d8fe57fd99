"""The sum kernel's generated source (codegen/sums.py) and its launch-configuration chooser.

Snapshot-style checks on programs of the form a derived backward stage takes (written here
directly, so that they do not depend on how af.backward splits its stages): a sum over keys
of a contraction-built tile times a key vector (dQ), and two sums over queries (dK, dV).
What they check: loads that only feed dots stay in their storage type (no float32 round
trip); nothing loop-invariant is computed inside the loop; exp becomes exp2 with log2(e)
folded into the constants; full loop tiles run unmasked and the partial last tile masked;
the configuration chooser prunes by its estimate and times once per shape class. Each kernel
also runs (Triton's interpreter) against float64 torch at odd sizes.
"""
import math
import re

import pytest
import torch

import acefuse as af

SCALE = 0.125
GAP = 20


def _programs(mask="causal"):
    q = af.tensor("q", "b h i d")
    k = af.tensor("k", "b h j d")
    v = af.tensor("v", "b h j e")
    go = af.tensor("go", "b h i e")
    m = af.tensor("m", "b h i")
    dd = af.tensor("dd", "b h i")
    lse = af.tensor("l", "b h i")
    i, j = af.index("i"), af.index("j")
    keep = (j <= i) if mask == "causal" else (j <= i) | (j >= i + GAP)   # "gap": two all-true runs per row
    s = af.where(keep, af.sum(q * k, "d") * SCALE, af.NEG_INF)
    p = af.exp(s - m) * af.where(lse.eq(0.0), 0.0, 1.0 / lse)   # per query row: above dQ's loop
    ds = p * (af.sum(go * v, "e") - dd) * SCALE
    dq = af.program(f"sums_dq_{mask}", grad_q=af.sum(ds * k, "j"))
    dkv = af.program(f"sums_dkv_{mask}", grad_k=af.sum(ds * q, "i"), grad_v=af.sum(p * go, "i"))
    return dq, dkv


_KERNELS = {}


def _kernel(which, mask="causal"):
    if (which, mask) not in _KERNELS:
        dq, dkv = _programs(mask)
        _KERNELS["dq", mask] = af.compile(dq, axis="j")
        _KERNELS["dkv", mask] = af.compile(dkv, axis="i")
    return _KERNELS[which, mask]


def _kernel_fn(src):
    """The @triton.jit kernel of a sum module (the function whose name ends in _sum)."""
    a = src.index("_sum(")
    a = src.rindex("\n@triton.jit", 0, a)
    return src[a:src.index("\n\n\n", a)]


def _loop(src):
    """(lines of the full-tile loop body, lines of the tail), stripped."""
    fn = _kernel_fn(src)
    head = "    for start in range(first, end, BLOCK_J):\n"
    assert head in fn
    body = fn.split(head, 1)[1]
    full, _, tail = body.partition("    if end < last:\n")
    full, tail = full.split("\n    tl.store(", 1)[0], tail.split("\n    tl.store(", 1)[0]
    full = full.split("    for start in range(tlo, thi, BLOCK_J):\n")[0]   # the mixed tiles' body
    return ([ln.strip() for ln in full.splitlines() if ln.strip()],
            [ln.strip() for ln in tail.splitlines() if ln.strip()])


def _hoisted(src):
    fn = _kernel_fn(src)
    return [ln.strip() for ln in fn.split("    for start in range(first, end, BLOCK_J):")[0].splitlines()]


@pytest.mark.parametrize("which", ["dq", "dkv"])
def test_dot_only_loads_keep_their_storage_type(which):
    """No load is widened to float32 on the spot; a value read by dots only is never widened
    (it goes to DOT_T straight from its storage type), and no dot operand makes a float32
    round trip."""
    src = _kernel_fn(_kernel(which).source)
    assert ".to(tl.float32).to(DOT_T)" not in src
    loads = re.findall(r"^\s*(\w+) = (?:tl\.load|_ld)\((.*)$", src, re.M)
    assert loads
    for name, rest in loads:
        assert not rest.endswith(".to(tl.float32)"), f"{name} is widened where it is loaded"
    # the key/query blocks held over the loop (dot operands only) stay in their storage type
    held = [n for n, rest in loads if n.startswith("h") and rest.startswith(("k_ptr", "q_ptr", "v_ptr"))]
    assert held, "expected a held dot operand"
    for n in held:
        assert f"{n}.to(tl.float32)" not in src, f"{n} (a dot operand) is widened to float32"
        assert f"{n}.to(DOT_T)" in src


@pytest.mark.parametrize("which", ["dq", "dkv"])
def test_no_loop_invariant_work_inside_the_loop(which):
    """Every value computed in the loop depends on the loop tile (its columns, a load of it or
    an accumulator): per-row work (1/x, where, per-row products) is above the loop."""
    full, tail = _loop(_kernel(which).source)
    for body, base in ((full, {"cols"}), (tail, {"cols", "fmask", "tmask"})):
        variant = set(base) | {"s", "s2"}
        for ln in body:
            if ln.startswith("#") or "=" not in ln or ln.startswith("cols"):
                continue
            name, rhs = (x.strip() for x in ln.split("=", 1))
            ids = set(re.findall(r"\b[A-Za-z_]\w*\b", rhs))
            assert ids & variant, f"loop-invariant value computed in the loop: {ln}"
            variant.add(name)


@pytest.mark.parametrize("which", ["dq", "dkv"])
def test_exp_is_exp2_with_folded_constants(which):
    src = _kernel(which).source
    full, _ = _loop(src)
    text = "\n".join(full)
    assert "tl.exp(" not in text and "tl.exp2(" in text
    assert repr(SCALE * 1.4426950408889634) in text          # the score's scale times log2(e)
    if which == "dq":   # the per-row shift m * log2(e): once, above the loop
        assert any(ln.endswith("* 1.4426950408889634") for ln in _hoisted(src))


@pytest.mark.parametrize("which", ["dq", "dkv"])
def test_full_tiles_unmasked_last_tile_masked(which):
    full, tail = _loop(_kernel(which).source)
    f, t = "\n".join(full), "\n".join(tail)
    assert "fmask" not in f and "tmask" not in f and "tl.where(tmask" not in f
    assert "_ld(" in f                        # a vector axis masked only when it is not a whole block
    assert "tl.where(tmask" in t and "mask=fmask" in t


def _reference(ins, mask="causal"):
    d = {n: x.double() for n, x in ins.items()}
    ni, nj = d["q"].shape[2], d["k"].shape[2]
    s = torch.einsum("bhid,bhjd->bhij", d["q"], d["k"]) * SCALE
    i, j = torch.arange(ni)[:, None], torch.arange(nj)[None, :]
    causal = (j <= i) if mask == "causal" else (j <= i) | (j >= i + GAP)
    p = torch.where(causal, torch.exp(s - d["m"][..., None]), 0.0) / d["l"][..., None]
    ds = p * (torch.einsum("bhie,bhje->bhij", d["go"], d["v"]) - d["dd"][..., None]) * SCALE
    return {"grad_q": torch.einsum("bhij,bhjd->bhid", ds, d["k"]),
            "grad_k": torch.einsum("bhij,bhid->bhjd", ds, d["q"]),
            "grad_v": torch.einsum("bhij,bhie->bhje", p, d["go"])}


def _inputs(seed, ni, nj, dk, de, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = r(1, 2, ni, dk), r(1, 2, nj, dk)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * SCALE
    m = s.amax(-1) + r(1, 2, ni).abs()   # a shift at least the row's max: exp stays <= 1
    ins = {"q": q, "k": k, "v": r(1, 2, nj, de), "go": r(1, 2, ni, de), "m": m, "dd": r(1, 2, ni),
           "l": 0.5 + torch.rand(1, 2, ni, generator=g, dtype=torch.float64)}
    return {n: x.to(dtype) for n, x in ins.items()}


@pytest.mark.parametrize("ni,nj,dk,de,mask", [(37, 29, 16, 16, "causal"),   # partial last tiles, whole vector blocks
                                              (32, 48, 20, 12, "causal"),   # whole loop tiles, short vector axes
                                              (19, 53, 16, 24, "causal"),
                                              (70, 115, 16, 16, "gap")])     # all-true tiles in two runs: no cut
def test_sum_kernels_match_float64(ni, nj, dk, de, mask):
    ins = _inputs(ni * nj + dk, ni, nj, dk, de)
    ref = _reference(ins, mask)
    gq = _kernel("dq", mask)(**ins)
    gkv = _kernel("dkv", mask)(**ins)
    for name, got in (("grad_q", gq), ("grad_k", gkv["grad_k"]), ("grad_v", gkv["grad_v"])):
        r = ref[name]
        err = (got.double() - r).abs().max().item()
        assert err <= 2e-5 * (1 + r.abs().max().item()), f"{name} ({mask} {ni}x{nj}, d={dk}, e={de}): max error {err}"


def test_float64_check_catches_a_wrong_kernel():
    """The comparison above fails on a wrong result (the scale missing once)."""
    ins = _inputs(5, 37, 29, 16, 16)
    ref = _reference(ins)
    got = _kernel("dq")(**ins) / SCALE
    assert (got.double() - ref["grad_q"]).abs().max().item() > 2e-5 * (1 + ref["grad_q"].abs().max().item())


def test_bfloat16_inputs():
    ins = _inputs(7, 45, 45, 16, 16, torch.bfloat16)
    ref = _reference(ins)
    got = _kernel("dkv")(**ins)
    for name in ("grad_k", "grad_v"):
        r = ref[name]
        assert got[name].dtype == torch.bfloat16
        err = (got[name].double() - r).abs().max().item()
        assert err <= 2e-2 * (1 + r.abs().max().item()), f"{name}: max error {err}"


# -- the launch-configuration chooser -------------------------------------------------------------
def test_config_candidates_are_pruned_by_the_estimate():
    mod = _kernel("dkv").module
    every = [dict(block_i=a, block_j=b, num_warps=w, num_stages=s) for a in mod.BLOCK_I_CHOICES
             for b in mod.BLOCK_J_CHOICES for w in mod.WARPS_CHOICES for s in mod.STAGES_CHOICES]
    vs = {"d": 128, "e": 128}
    kept = mod.configs(vs, 2, 227 * 1024)
    assert 0 < len(kept) < len(every)
    def fits(cfg):
        regs, smem = mod.estimate(cfg, vs, 2)
        return regs <= mod.REG_LIMIT and smem <= 227 * 1024 and cfg["block_i"] >= 16 * cfg["num_warps"]
    for cfg in every:
        deeper = [dict(cfg, num_stages=n) for n in mod.STAGES_CHOICES if n > 1]
        one_only = cfg["num_stages"] == 1 and any(fits(c) for c in deeper)
        assert (cfg in kept) == (fits(cfg) and not one_only), cfg
    # two 128x128 float32 accumulators with 128x128 tiles on 4 warps: 512 registers a thread
    assert dict(block_i=128, block_j=128, num_warps=4, num_stages=1) not in kept
    assert mod.ACC == ["d", "e"] and sorted(mod.HELD) == ["d", "e"] and len(mod.DOTS) == 4


def test_config_choice_is_timed_once_per_shape_class(monkeypatch):
    mod = _kernel("dq").module
    calls = []

    def fake_fastest(cands, call, required=()):
        calls.append(len(cands))
        return cands[0]
    monkeypatch.setattr(mod, "_fastest", fake_fastest)
    monkeypatch.setattr(mod, "_TUNED", {})
    monkeypatch.setenv("ACEFUSE_TUNING_CACHE", "0")   # this process's timing (the disk store: test_tuning.py)
    cpu = torch.device("cpu")
    for n in (33, 40, 64, 70):   # 33..64 round up to 64 (one class); 70 to 128
        ins = _inputs(n, n, n, 16, 16)
        sizes = {"b": 1, "h": 2, "i": n, "j": n, "d": 16, "e": 16}
        cfg = mod._tuned(ins, sizes, ins["q"], cpu)
        assert cfg in mod.configs({"d": 16, "e": 16}, 4, 227 * 1024)
    assert len(calls) == 4 and len(mod._TUNED) == 2   # per class: the candidates, then the row order


def test_explicit_options_and_the_cpu_skip_the_timing(monkeypatch):
    mod = _kernel("dq").module
    called = []
    monkeypatch.setattr(mod, "_tuned", lambda *a: called.append(a) or dict(block_i=64, block_j=32, num_warps=4,
                                                                           num_stages=2))
    monkeypatch.setattr(mod, "TUNE_MIN", 1)
    ins = _inputs(3, 17, 17, 16, 16)
    sizes = {"b": 1, "h": 2, "i": 17, "j": 17, "d": 16, "e": 16}
    gpu = torch.device("cuda")
    assert mod._auto_config(ins, sizes, ins["q"], gpu, True) is None        # an explicit option wins
    assert mod._auto_config(ins, sizes, ins["q"], torch.device("cpu"), False) is None
    assert not called
    assert mod._auto_config(ins, sizes, ins["q"], gpu, False)["block_j"] == 32
    assert len(called) == 1
    _kernel("dq")(**ins)   # on the CPU run() never times
    assert len(called) == 1


def _true_body(src):
    fn = _kernel_fn(src)
    head = "    for start in range(tlo, thi, BLOCK_J):\n"
    assert head in fn
    return fn.split(head, 1)[1].split("\n    end = end + cut", 1)[0]


@pytest.mark.parametrize("which", ["dq", "dkv"])
def test_all_true_tiles_run_without_the_mask(which):
    """The mask analysis finds the run of full tiles where the causal condition holds
    everywhere (for this program's rows); their body has no index comparison and no where()
    of it, while the other full tiles keep it."""
    src = _kernel(which).source
    body = "\n".join(ln for ln in _true_body(src).splitlines() if not ln.strip().startswith("#"))
    assert "<=" not in body and "float('-inf')" not in body
    full, _ = _loop(src)
    assert any("<=" in ln for ln in full)
    assert "one_run = ntrue * BLOCK_J == tend - tfirst" in _kernel_fn(src)


def test_constant_factor_applied_once_at_the_store():
    """sum_F(t * c) = c * sum_F(t): the body's constant factor leaves the loop."""
    src = _kernel_fn(_kernel("dq").source)
    full, tail = _loop(_kernel("dq").source)
    assert not any(ln.endswith(f"* {SCALE!r}") for ln in full + tail)
    assert f"(s * {SCALE!r})" in src.split("    if end < last:")[1]


# -- riders: dQ's sums computed in the dK/dV pass (codegen/riders.py) ----------------------------
def _plain(k):
    return getattr(k, "kernel", k)   # af.compile's differentiable wrapper -> the compiled kernel


def _riding(mask="causal"):
    """The dK/dV kernel with the dQ program riding its pass, as riders.attach builds it."""
    from acefuse.codegen import riders as rd
    if ("ride", mask) not in _KERNELS:
        dq, dkv = _programs(mask)
        kernels = [_plain(_kernel("dq", mask)), _plain(_kernel("dkv", mask))]
        done = rd.attach([dq, dkv], kernels)
        assert done == {0: 1}, "dQ (one output) should ride the dK/dV pass, not the other way round"
        _KERNELS["ride", mask] = kernels[1]
    return _KERNELS["ride", mask]


def test_dq_rides_the_dkv_pass_with_five_dots_per_tile():
    """The riding kernel's full tile does FlashAttention-2's 5 tile matmuls (S, dP, dK, dV and
    dS^T k for dQ), loads nothing more than dK/dV alone, and adds dQ's part with an atomic add
    (masked along the loop axis only in the last tile); dQ's constant factor is left to the end."""
    host = _riding()
    mod, src = host.module, host.source
    assert mod.RIDERS == {"grad_q": ("b", "h", "i", "d")} and mod.RIDER_SCALE == {"grad_q": SCALE}
    full, tail = _loop(src)
    alone, _ = _loop(_kernel("dkv").source)
    f = "\n".join(full)
    assert f.count("tl.dot(") == 5 and f.count("tl.atomic_add(") == 1, f
    assert sum("tl.load(" in ln or "_ld(" in ln for ln in full) == sum("tl.load(" in ln or "_ld(" in ln for ln in alone)
    assert "if RIDE:" in f and "fmask" not in f
    t = "\n".join(tail)
    assert "tl.atomic_add(" in t and "mask=fmask[:, None]" in t
    assert not any(ln.endswith(f"* {SCALE!r}") for ln in full + tail)


@pytest.mark.parametrize("ni,nj,dk,de,mask", [(37, 29, 16, 16, "causal"),
                                              (19, 53, 20, 24, "causal"),   # short vector blocks (VMASK)
                                              (70, 115, 16, 16, "gap")])
def test_riding_kernel_matches_float64(ni, nj, dk, de, mask):
    """dQ from the rider buffer (riders.finish), dK and dV from the same pass, against float64
    torch at odd sizes; without riders the same module gives dK and dV alone."""
    from acefuse.codegen.riders import finish
    host = _riding(mask)
    ins = _inputs(ni + 3 * nj + dk, ni, nj, dk, de)
    ref = _reference(ins, mask)
    out = host(**ins, riders=True)
    assert out["grad_q"].dtype == torch.float32
    got = dict(out, grad_q=finish(out["grad_q"], torch.float32, host.module.RIDER_SCALE["grad_q"]))
    alone = host(**ins)
    assert set(alone) == {"grad_k", "grad_v"}
    for name, r in ref.items():
        bound = 2e-5 * (1 + r.abs().max().item())
        err = (got[name].double() - r).abs().max().item()
        assert err <= bound, f"{name} ({mask} {ni}x{nj}, d={dk}, e={de}), rider pass: max error {err}"
        if name != "grad_q":
            assert (alone[name].double() - r).abs().max().item() <= bound
    # the check is not vacuous: dQ without its constant factor is off
    assert (out["grad_q"].double() - ref["grad_q"]).abs().max().item() > 2e-5 * (1 + ref["grad_q"].abs().max().item())


def test_a_rider_that_needs_a_new_dot_runs_apart():
    """A body whose tile needs a contraction the host pass does not do (sum_d(q2 * k), with q2
    loaded by the host but never contracted with k) is refused: the stage runs itself."""
    from acefuse.codegen import riders as rd
    from acefuse.codegen.compile import compile_program
    q, q2, k = af.tensor("q", "b h i d"), af.tensor("q2", "b h i d"), af.tensor("k", "b h j d")
    v, go, m = af.tensor("v", "b h j e"), af.tensor("go", "b h i e"), af.tensor("m", "b h i")
    dp = af.sum(go * v, "e")
    p = af.exp(af.sum(q * k, "d") * SCALE - m)
    host = af.program("rider_host", grad_k=af.sum(p * dp * q, "i"), grad_k2=af.sum(p * q2, "i"))
    other = af.program("rider_new_dot", grad_q=af.sum(af.exp(af.sum(q2 * k, "d") * SCALE - m) * dp * k, "j"))
    kernels = [compile_program(host, axis="i"), compile_program(other, axis="j")]
    assert rd.sum_rider_bodies(host, kernels[0], other, kernels[1])   # by form it could ride ...
    first = kernels[0]
    assert rd.attach([host, other], kernels) == {}                   # ... but would add a dot per tile
    assert kernels[0] is first
