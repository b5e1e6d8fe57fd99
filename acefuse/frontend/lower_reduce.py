"""Lowerings of reductions (sum, max, var, softmax, norms, cross-entropy) and
contractions (matmul, einsum, scaled_dot_product_attention): plain definitions, from
which acefuse derives the fusion."""
from __future__ import annotations

import math

import torch

from acefuse.frontend.ir import Axis, N, num, un, bin_, red, unify
from acefuse.frontend.lower import (TV, Unsupported, conc, arg, op, _meta, _dim, _dims_arg, _bcast, _tv,
                                    _elem, _reduce, _leaf_chain)


# -- reductions ------------------------------------------------------------------------------
def _red_handler(kind, mean=False):
    def h(cx):
        x = arg(cx, 0, "input")
        d = arg(cx, 1, "dim")
        keep = bool(conc(arg(cx, 2, "keepdim", False)))
        dims = _dims_arg(d, len(x.dims))
        n, out, count = _reduce(cx, kind, x, dims, keep)
        if mean and count is not None:
            n = bin_("div", n, count)
        return _tv(cx, n, out)
    return h


op("reduce", "sum")(_red_handler("sum"))
op("reduce", "mean")(_red_handler("sum", mean=True))
op("reduce", "amax")(_red_handler("max"))
op("reduce", "amin")(_red_handler("min"))


def _maxmin(kind):
    def h(cx):
        x = arg(cx, 0, "input")
        d = arg(cx, 1, "dim")
        other = d if isinstance(d, TV) else arg(cx, None, "other")
        if isinstance(other, TV):
            return _elem(cx, lambda a, b: bin_("max2" if kind == "max" else "min2", a, b), x, other)
        if d is None:
            n, out, _ = _reduce(cx, kind, x, list(range(len(x.dims))), False)
            return _tv(cx, n, out)
        keep = bool(conc(arg(cx, 2, "keepdim", False)))
        n, out, _ = _reduce(cx, kind, x, _dims_arg(d, len(x.dims)), keep)
        m = _meta(cx)
        return (TV(n, out, m[0]), _NoIndices(cx.node, kind))
    return h


class _NoIndices:
    def __init__(self, node, kind):
        self.node, self.kind = node, kind


op("reduce", "max")(_maxmin("max"))
op("reduce", "min")(_maxmin("min"))


def _var_n(cx, x, dims, correction, keep):
    mu, _, count = _reduce(cx, "sum", x, dims, True)
    if count is None:
        return num(0.0), [d for i, d in enumerate(x.dims) if keep or i not in dims], None
    mu = bin_("div", mu, count)
    xc = bin_("sub", cx.n(x), mu)
    s, out, _ = _reduce(cx, "sum", TV(bin_("mul", xc, xc), x.dims, x.meta), dims, keep)
    den = bin_("sub", count, num(correction)) if correction else count
    return bin_("div", s, den), out, count


def _correction(cx):
    c = arg(cx, None, "correction")
    if c is not None:
        return float(conc(c))
    u = arg(cx, None, "unbiased")
    if u is None and len(cx.node.args) > 2 and isinstance(cx.node.args[1], (int, tuple, list)):
        u = cx.val(cx.node.args[2])
    return 1.0 if (u is None or conc(u)) else 0.0


@op("reduce", "var")
def _var(cx):
    x = arg(cx, 0, "input")
    dims = _dims_arg(arg(cx, 1, "dim"), len(x.dims))
    n, out, _ = _var_n(cx, x, dims, _correction(cx), bool(conc(arg(cx, None, "keepdim", False))))
    return _tv(cx, n, out)


@op("reduce", "std")
def _std(cx):
    x = arg(cx, 0, "input")
    dims = _dims_arg(arg(cx, 1, "dim"), len(x.dims))
    n, out, _ = _var_n(cx, x, dims, _correction(cx), bool(conc(arg(cx, None, "keepdim", False))))
    return _tv(cx, un("sqrt", n), out)


def _fused_axis(x: TV, d):
    ax = x.dims[d]
    if ax is not None:
        ax.set_hint("j")
    return ax


@op("reduce", "softmax", "log_softmax")
def _softmax(cx):
    name = cx.node.target if cx.node.op == "call_method" else cx.node.target.__name__
    x = arg(cx, 0, "input")
    d = arg(cx, 1, "dim")
    if d is None:
        raise Unsupported("softmax without dim (implicit dim is deprecated); pass dim=-1")
    d = _dim(d, len(x.dims))
    ax = _fused_axis(x, d)
    xn = cx.n(x)
    if ax is None:  # softmax over a dim of size 1
        n = num(0.0) if "log" in name else num(1.0)
        return _tv(cx, bin_("add", bin_("mul", xn, num(0)), n), x.dims)
    m = red("max", ax, xn)
    e = un("exp", bin_("sub", xn, m))
    s = red("sum", ax, e)
    if "log" in name:
        return _tv(cx, bin_("sub", bin_("sub", xn, m), un("log", s)), x.dims)
    return _tv(cx, bin_("div", e, s), x.dims)


def _lse(xn, ax):
    m = red("max", ax, xn)
    return bin_("add", m, un("log", red("sum", ax, un("exp", bin_("sub", xn, m)))))


@op("reduce", "logsumexp")
def _logsumexp(cx):
    x = arg(cx, 0, "input")
    dims = _dims_arg(arg(cx, 1, "dim"), len(x.dims))
    keep = bool(conc(arg(cx, 2, "keepdim", False)))
    n = cx.n(x)
    out = list(x.dims)
    for d in dims:
        ax = _fused_axis(x, d)
        if ax is not None:
            n = _lse(n, ax)
        out[d] = None
    if not keep:
        out = [a for i, a in enumerate(out) if i not in dims]
    return _tv(cx, n, out)


def _affine(cx, n, dims, w, b):
    if w is not None:
        dims = _bcast(dims, w.dims)
        n = bin_("mul", n, cx.n(w))
    if b is not None:
        dims = _bcast(dims, b.dims)
        n = bin_("add", n, cx.n(b))
    return n, dims


@op("reduce", "layer_norm")
def _layer_norm(cx):
    x, ns = arg(cx, 0, "input"), conc(arg(cx, 1, "normalized_shape"))
    w, b, eps = arg(cx, 2, "weight"), arg(cx, 3, "bias"), conc(arg(cx, 4, "eps", 1e-5))
    k = len(ns) if isinstance(ns, (tuple, list)) else 1
    dims = list(range(len(x.dims) - k, len(x.dims)))
    for d in dims:
        _fused_axis(x, d)
    var, _, count = _var_n(cx, x, dims, 0.0, True)
    mu, _, _ = _reduce(cx, "sum", x, dims, True)
    xc = bin_("sub", cx.n(x), bin_("div", mu, count) if count is not None else mu)
    n = bin_("mul", xc, un("rsqrt", bin_("add", var, num(eps))))
    n, out = _affine(cx, n, x.dims, w, b)
    return _tv(cx, n, out)


@op("reduce", "rms_norm")
def _rms_norm(cx):
    x, ns = arg(cx, 0, "input"), conc(arg(cx, 1, "normalized_shape"))
    w, eps = arg(cx, 2, "weight"), conc(arg(cx, 3, "eps"))
    if eps is None:
        eps = torch.finfo(x.meta.dtype).eps
    k = len(ns) if isinstance(ns, (tuple, list)) else 1
    dims = list(range(len(x.dims) - k, len(x.dims)))
    for d in dims:
        _fused_axis(x, d)
    xn = cx.n(x)
    ms, _, count = _reduce(cx, "sum", TV(bin_("mul", xn, xn), x.dims, x.meta), dims, True)
    ms = bin_("div", ms, count) if count is not None else ms
    n = bin_("mul", xn, un("rsqrt", bin_("add", ms, num(eps))))
    n, out = _affine(cx, n, x.dims, w, None)
    return _tv(cx, n, out)


@op("reduce", "cross_entropy")
def _cross_entropy(cx):
    x, t = arg(cx, 0, "input"), arg(cx, 1, "target")
    w = arg(cx, 2, "weight")
    ii = int(conc(arg(cx, 4, "ignore_index", -100)))
    reduction = conc(arg(cx, 6, "reduction", "mean"))
    ls = float(conc(arg(cx, 7, "label_smoothing", 0.0)))
    if conc(arg(cx, 3, "size_average")) is not None or conc(arg(cx, 5, "reduce")) is not None:
        raise Unsupported("the deprecated size_average/reduce arguments; use reduction=")
    if w is not None:
        raise Unsupported("per-class weight")
    if not isinstance(t, TV) or t.meta.dtype.is_floating_point:
        raise Unsupported("class-probability targets (only integer class indices are supported)")
    cd = 1 if len(x.dims) > 1 else 0
    cax = x.dims[cd]
    if cax is None:
        raise Unsupported("a single class")
    cax.set_hint("j")
    rest = [d for i, d in enumerate(x.dims) if i != cd]
    if len(rest) != len(t.dims):
        raise Unsupported("target shape does not match the input without its class dim")
    for a, b in zip(rest, t.dims):
        if a is not None and b is not None:
            unify(a, b)
    xn = cx.n(x)
    lse = _lse(xn, cax)
    if t.leaf is not None and xn.op == "in":  # an input: a gather along the class axis
        idx = cx.leaf_node(t, role="index", extra=("clamp", cax.size))
        xt = N("take", xn.args[0], idx, cax)
    else:  # a computed input: gather by a one-hot sum over the classes
        tf = cx.leaf_node(t) if t.leaf is not None else cx.n(t)
        xt = red("sum", cax, N("where", bin_("eq", N("idx", cax), tf), xn, num(0)))
    loss = bin_("sub", lse, xt)
    if ls:
        smooth = bin_("sub", lse, bin_("div", red("sum", cax, xn), N("size", cax)))
        loss = bin_("add", bin_("mul", num(1 - ls), loss), bin_("mul", num(ls), smooth))
    valid = cx.leaf_node(t, role="float", extra=("ne", ii)) if t.leaf is not None else bin_("ne", cx.n(t), num(ii))
    loss = N("where", valid, loss, num(0))
    dims = [a if a is not None else b for a, b in zip(rest, t.dims)]
    if reduction == "none":
        return _tv(cx, loss, dims)
    n, cnt = loss, valid
    for a in dims:
        if a is not None:
            n, cnt = red("sum", a, n), red("sum", a, cnt)
    if reduction == "sum":
        return _tv(cx, n, [])
    if reduction == "mean":
        return _tv(cx, bin_("div", n, cnt), [])
    raise Unsupported(f"reduction={reduction!r}")


# -- contractions -------------------------------------------------------------------------------
def _contract(a_n, a_dims, b_n, b_dims, k_a, k_b):
    """sum over the unified axis of a * b."""
    if k_a is None or k_b is None:
        return bin_("mul", a_n, b_n)
    k = unify(k_a, k_b)
    k.set_hint("e")
    return red("sum", k, bin_("mul", a_n, b_n))


@op("contraction", "matmul", "bmm", "mm")
def _matmul(cx):
    a, b = arg(cx, 0, "input"), arg(cx, 1, "other")
    ad, bd = list(a.dims), list(b.dims)
    a1, b1 = len(ad) == 1, len(bd) == 1
    if a1:
        ad = [None] + ad
    if b1:
        bd = bd + [None]
    ka, kb = ad[-1], bd[-2]
    batch = _bcast(ad[:-2], bd[:-2])
    n = _contract(cx.n(a), ad, cx.n(b), bd, ka, kb)
    out = batch + ([] if a1 else [ad[-2]]) + ([] if b1 else [bd[-1]])
    return _tv(cx, n, out)


@op("contraction", "linear")
def _linear(cx):
    x, w, b = arg(cx, 0, "input"), arg(cx, 1, "weight"), arg(cx, 2, "bias")
    wd = list(w.dims)
    n = _contract(cx.n(x), x.dims, cx.n(w), wd, x.dims[-1], wd[-1])
    out = list(x.dims[:-1]) + ([wd[0]] if len(wd) == 2 else [])
    if b is not None:
        out = _bcast(out, b.dims)
        n = bin_("add", n, cx.n(b))
    return _tv(cx, n, out)


@op("contraction", "einsum")
def _einsum(cx):
    eq = conc(cx.val(cx.node.args[0])).replace(" ", "")
    ops = [cx.val(a) for a in cx.node.args[1:]]
    if len(ops) == 1 and isinstance(ops[0], (tuple, list)):
        ops = list(ops[0])
    if "..." in eq:
        raise Unsupported("'...' in an einsum equation")
    lhs, _, rhs = eq.partition("->")
    specs = lhs.split(",")
    if not _:
        cnt = {}
        for c in lhs.replace(",", ""):
            cnt[c] = cnt.get(c, 0) + 1
        rhs = "".join(sorted(c for c, k in cnt.items() if k == 1))
    letters: dict = {}
    n = None
    for spec, t in zip(specs, ops):
        if len(spec) != len(t.dims):
            raise Unsupported(f"einsum operand {spec!r} has {len(t.dims)} dims")
        for c, d in zip(spec, t.dims):
            if d is None:
                continue
            letters[c] = unify(letters[c], d) if c in letters else d
        n = cx.n(t) if n is None else bin_("mul", n, cx.n(t))
    for c, d in letters.items():
        if c not in rhs:
            d.set_hint("e")
            n = red("sum", d, n)
    return _tv(cx, n, [letters.get(c) for c in rhs])


@op("contraction", "scaled_dot_product_attention")
def _sdpa(cx):
    q, k, v = arg(cx, 0, "query"), arg(cx, 1, "key"), arg(cx, 2, "value")
    mask, p = arg(cx, 3, "attn_mask"), float(conc(arg(cx, 4, "dropout_p", 0.0)))
    causal, scale = bool(conc(arg(cx, 5, "is_causal", False))), conc(arg(cx, 6, "scale"))
    gqa = bool(conc(arg(cx, 7, "enable_gqa", False)))
    if p > 0:
        raise Unsupported("dropout_p > 0 (random)")
    if len(q.dims) >= 3 and q.shape[-3] != k.shape[-3]:
        if not gqa:
            raise Unsupported(f"query has {q.shape[-3]} heads and key {k.shape[-3]}; pass enable_gqa=True")
        g = q.shape[-3] // k.shape[-3]
        k, v = (_leaf_chain(t, ("repeat_interleave", g, len(t.dims) - 3),
                            list(t.dims[:-3]) + [Axis(q.shape[-3])] + list(t.dims[-2:]))
                for t in (k, v))
    ld, sd = q.dims[-2], k.dims[-2]
    if sd is not None:
        sd.set_hint("j")
    if sd is not None and v.dims[-2] is not None:
        unify(sd, v.dims[-2])
    batch = _bcast(q.dims[:-2], k.dims[:-2], v.dims[:-2])
    e = q.dims[-1]
    s = _contract(cx.n(q), q.dims, cx.n(k), k.dims, e, k.dims[-1])
    sc = num(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    s = bin_("mul", s, sc)
    sdims = batch + [ld, sd]
    if causal:
        if ld is None or sd is None:
            raise Unsupported("is_causal with a query or key length of 1")
        s = N("where", bin_("le", N("idx", sd), N("idx", ld)), s, num(-math.inf))
    if mask is not None:
        sdims = _bcast(sdims, mask.dims)
        mn = cx.n(mask)
        if mask.meta.dtype == torch.bool:
            s = N("where", mn, s, num(-math.inf))
        else:
            s = bin_("add", s, mn)
    if sd is None:
        raise Unsupported("a key length of 1")
    m = red("max", sd, s)
    pe = un("exp", bin_("sub", s, m))
    l = red("sum", sd, pe)
    o = red("sum", sd, bin_("mul", pe, cx.n(v)))
    out = _bcast(batch, v.dims[:-2]) + [ld, v.dims[-1]]
    return _tv(cx, bin_("div", o, l), out)


