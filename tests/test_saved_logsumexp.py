"""The backward recomputes P = exp(s - L) from one saved value per row, L = m + log(l)
(issue 11: "P recomputed from the saved logsumexp"), derived by backward_shift.fold_outputs
for any saved shifted sum l = sum_j(exp(b - max_j b)) and its max, nothing named.

Checked: the derived programs read one per-row saved value (attention, causal, softmax, log-softmax,
cross-entropy, logsumexp); each compiled kernel (Triton's interpreter) against float64 torch autograd
of plain math written here, fresh random inputs, odd sizes, float32 and bfloat16, with fully masked
rows (gradient 0, never NaN: L is saved as 0 there, exp(-inf - 0) = 0); the structure test fails with
the fold disabled, and the masked-row test fails with L saved unguarded (m + log l = -inf).
"""
import math
import runpy
from pathlib import Path

import pytest
import torch

import acefuse as af
import acefuse.backward_normal as bnorm
import acefuse.backward_shift as bn

EX = Path(__file__).resolve().parents[1] / "examples"
_NS: dict = {}
_K: dict = {}


def ns(f):
    if f not in _NS:
        _NS[f] = runpy.run_path(str(EX / f"{f}.py"), run_name="examples_lse_" + f)
    return _NS[f]


# ---- programs: attention with a query row that sees no key, softmax-like rows with a mask tensor ----
q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
I, J = af.index("i"), af.index("j")
SCALE = 0.3


def _attend(name, s):
    m = af.max(s, "j")
    p = af.exp(s - m)
    return af.program(name, o=af.sum(p * v, "j") / af.sum(p, "j"))


_score = af.sum(q * k, "d") * SCALE
ATTN = {"global": _attend("lse_global", _score),
        "causal": _attend("lse_causal", af.where(J <= I, _score, af.NEG_INF)),
        "strict": _attend("lse_strict", af.where(J < I, _score, af.NEG_INF))}   # query 0 sees no key

x, c, t = af.tensor("x", "r j"), af.tensor("c", "r j"), af.tensor("t", "r")
_xm = af.where(c > 0, x, af.NEG_INF)
_m = af.max(_xm, "j")
_l = af.sum(af.exp(_xm - _m), "j")
ROWS = {"softmax": af.program("lse_softmax", y=af.exp(_xm - _m) / _l),
        "log_softmax": af.program("lse_log_softmax", y=_xm - _m - af.log(_l)),
        "logsumexp": af.program("lse_lse", y=_m + af.log(_l)),
        "cross_entropy": af.program("lse_ce", loss=_m + af.log(_l) - af.take(x, t, "j"))}


def _attn_ref(name, q, k, v):
    s = q @ k.transpose(-1, -2) * SCALE
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    if name != "global":
        s = torch.where(j <= i if name == "causal" else j < i, s, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))   # the fully masked row: o = 0 (0/0 -> 0)
    l = p.sum(-1, keepdim=True)
    return {"o": (p @ v) / torch.where(l == 0, 1.0, l)}


def _rows_ref(name, x, c, t=None):
    s = x.masked_fill(c <= 0, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    safe_l = torch.where(l == 0, 1.0, l)
    lse = torch.where(l[:, 0] == 0, -math.inf, (m + torch.log(safe_l))[:, 0])   # -inf: a fully masked row
    if name == "softmax":
        return {"y": p / safe_l}
    if name == "log_softmax":   # -inf where masked (a constant: no gradient flows through it)
        return {"y": torch.where(c <= 0, -math.inf, x - m - torch.log(safe_l))}
    if name == "logsumexp":
        return {"y": lse}
    return {"loss": lse - x.gather(-1, t[:, None])[:, 0]}


TOL = {torch.float32: (1e-4, 2e-5), torch.bfloat16: (1.6e-2, 8e-3)}


def _check(kern, prog, ref, ins64: dict, nodiff: set, dtype, seed, masked_rows=()):
    """Outputs and gradients of ``kern`` (inputs rounded to ``dtype``) against float64 autograd of
    ``ref`` from the same rounded inputs; ``masked_rows``: (input, index) whose gradient must be 0."""
    ins = {n: (v.to(dtype) if v.dtype == torch.float64 else v) for n, v in ins64.items()}
    leaves = {n: (v if n in nodiff else v.clone().requires_grad_()) for n, v in ins.items()}
    out = kern(**leaves)
    out = out if isinstance(out, dict) else {next(iter(prog.outputs)): out}
    g = torch.Generator().manual_seed(seed)
    cots = {n: torch.randn(o.shape, generator=g, dtype=torch.float64) for n, o in out.items()}
    wrt = [n for n in leaves if n not in nodiff]
    l64 = {n: (v if n in nodiff else v.detach().double().requires_grad_()) for n, v in ins.items()}
    rout = ref(**l64)
    rtol, stol = TOL[dtype]
    for n in cots:   # (the reference's -inf outputs: the same -inf from the kernel)
        r, o = rout[n].detach(), out[n].double()
        fin = torch.isfinite(r)
        assert (o[~fin] == r[~fin]).all(), n
        assert torch.allclose(o[fin], r[fin], rtol=2 * rtol, atol=2 * stol * r[fin].abs().max().item() + 1e-6), n
    cots = {n: torch.where(torch.isfinite(rout[n].detach()), v, 0.0) for n, v in cots.items()}
    got = torch.autograd.grad([out[n] for n in cots], [leaves[n] for n in wrt], [cots[n].to(dtype) for n in cots])
    want = torch.autograd.grad([rout[n] for n in cots], [l64[n] for n in wrt], list(cots.values()))
    for n, gv, r in zip(wrt, got, want):
        gv = gv.double()
        assert torch.isfinite(gv).all(), f"grad {n} has non-finite values"
        err = (gv - r).abs()
        assert (err <= rtol * r.abs() + stol * r.abs().max() + 1e-9).all(), \
            f"grad {n}: max error {err.max().item():.3g} (scale {r.abs().max().item():.3g})"
        assert r.abs().max() > 1e-3
    for n, idx in masked_rows:
        assert (got[wrt.index(n)][idx] == 0).all(), f"grad {n} of a fully masked row is not 0"


def _kernel(key, prog):
    if key not in _K:
        _K[key] = af.compile(prog)
    return _K[key]


# ---- the derived programs read one saved value per row -------------------------------------------------
@pytest.mark.parametrize("fname,name", [("attention", "attention"), ("attention", "causal"), ("attention", "gqa"),
                                        ("softmax", "softmax"), ("softmax", "lse"), ("norms", "log_softmax"),
                                        ("norms", "cross_entropy"), ("norms", "cross_entropy_mean")])
def test_one_saved_value_per_row(fname, name):
    bwd = af.backward(ns(fname)[name])
    per_row = [n for n in bwd.saved if bwd.saved_kind[n] != "output"]
    assert per_row == ["saved_lse"], bwd.saved
    reads = {s.args[0] for e in bwd.outputs.values() for s in e.term.walk() if s.op == "In"}
    assert "saved_m" not in reads and "saved_s" not in reads
    # no reciprocal of the sum left: P = exp(s - L) is one exp per score
    for e in bwd.outputs.values():
        assert not any(bnorm._recip_of(s) is not None for s in e.term.walk()), str(e)
    assert "saved_lse" in bwd.augmented.outputs


def test_structure_needs_the_fold(monkeypatch):
    """With the fold disabled the backward saves the max and the sum again (the test above can fail)."""
    import sys
    monkeypatch.setattr(sys.modules["acefuse.backward"], "fold_outputs", lambda d, terms: terms)
    bwd = af.backward(ns("attention")["attention"])
    assert sorted(n for n in bwd.saved if bwd.saved_kind[n] != "output") == ["saved_m", "saved_s"]


def test_fold_keeps_a_max_the_output_depends_on():
    """m + 2 log(l) depends on the max (its adjoint is kept, routed through saved_m, and reads
    l * r(l)): the fold would leave r(l) read, so the pair is left as derived in every gradient
    (no stage computes P two ways); the max and the sum stay saved."""
    xx = af.tensor("x", "r j")
    m = af.max(xx, "j")
    bwd = af.backward(af.program("lse2", out=m + af.log(af.sum(af.exp(xx - m), "j")) * 2.0))
    assert sorted(bwd.saved) == ["saved_m", "saved_s"]


def test_no_stage_reads_p_two_ways():
    """normalize_inside (division inside the sum): the max's adjoint is not dropped there, so
    exp(s - m) stays in dQ; the pair is not folded anywhere (one score exponential per stage)."""
    bwd = af.backward(ns("attention")["inside"])
    for st in bwd.stages:
        exps = {s for e in st.outputs.values() for s in e.term.walk() if s.op == "Exp"}
        assert not ({u.args[0] for s in exps for u in s.walk() if u.op == "In"} >= {"saved_m", "saved_lse"}), st.name


# ---- gradients of the compiled kernels ------------------------------------------------------------
def _attn_inputs(seed, ni=7, nj=13, d=8, e=5):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 1.5   # noqa: E731
    return {"q": r(1, 2, ni, d), "k": r(1, 2, nj, d), "v": r(1, 2, nj, e)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["global", "causal", "strict"])
def test_attention_gradients(name, dtype):
    prog = ATTN[name]
    assert [n for n in af.backward(prog).saved if n != "o"] == ["saved_lse"]
    masked = [("q", (0, slice(None), 0))] if name == "strict" else []
    _check(_kernel(name, prog), prog, lambda **kw: _attn_ref(name, **kw), _attn_inputs(11 + len(name)), set(),
           dtype, seed=3, masked_rows=masked)


def _row_inputs(seed, name, r=6, n=37):
    g = torch.Generator().manual_seed(seed)
    ins = {"x": torch.randn(r, n, generator=g, dtype=torch.float64) * 3,
           "c": (torch.rand(r, n, generator=g) > 0.3).double()}
    ins["c"][:, 5] = 1.0
    if name == "cross_entropy":   # (a fully masked row's loss is -inf: not one)
        ins["t"] = torch.full((r,), 5, dtype=torch.long)
    else:
        ins["c"][2] = 0.0          # a fully masked row
    return ins


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp", "cross_entropy"])
def test_row_gradients_with_a_fully_masked_row(name, dtype):
    prog = ROWS[name]
    assert [n for n in af.backward(prog, wrt=["x"]).saved] == ["saved_lse"]
    ins = _row_inputs(5 + len(name), name)
    ref = (lambda x, c, t: _rows_ref(name, x, c, t)) if name == "cross_entropy" else \
        (lambda x, c: _rows_ref(name, x, c))
    masked = [] if name == "cross_entropy" else [("x", 2)]
    _check(_kernel(name, prog), prog, ref, ins, {"c", "t"}, dtype, seed=7, masked_rows=masked)


def test_unguarded_logsumexp_gives_nan_on_a_fully_masked_row(monkeypatch):
    """The guard is needed: L saved as m + log(l) (-inf on a fully masked row) makes exp(-inf - -inf)
    NaN there, which the check above rejects."""
    real = bn.shifted_pairs

    def unguarded(d):
        out = []
        for e, r, lt in real(d):
            bare = lt.args[2]
            if bare not in d.saved:
                d.saved[bare] = "saved_lse_bare"
                d.saved_kind["saved_lse_bare"] = "value"
                d.tensors["saved_lse_bare"] = d.tensors[d.saved[lt]]
            out.append((e, r, bare))
        return out
    monkeypatch.setattr(bn, "shifted_pairs", unguarded)
    prog = ATTN["strict"]
    assert "saved_lse_bare" in af.backward(prog).saved
    with pytest.raises(AssertionError, match="non-finite|masked row"):
        _check(af.compile(prog), prog, lambda **kw: _attn_ref("strict", **kw), _attn_inputs(4), set(), torch.float32,
               seed=3, masked_rows=[("q", (0, slice(None), 0))])
