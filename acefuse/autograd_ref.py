"""A program evaluated with torch operations, differentiable by torch autograd.

``evaluate(prog, inputs, dtype)`` computes every output of ``prog`` unfused, with the
same conventions as acefuse/reference.py (its float64 numpy twin) and the kernels
(README "Numerics"): an empty max (``-inf``, a fully masked row) reads as 0 where it is
subtracted, and a division by a value computed from a reduction gives 0 when both sides
are 0. Through such a fully masked row the gradient is 0, never NaN (the convention of
af.backward): a division, log, sqrt or rsqrt of a reduction's value that is 0 passes no
gradient.

It is the torch fallback of acefuse.autograd: when a derived backward kernel cannot be
built or fails, the gradient is torch autograd of this evaluation (float32 for
float16/bfloat16/float32 inputs), so no gradient is ever dropped.
"""
from __future__ import annotations

import torch

from acefuse.reference import _INTS, _int_op, _pols, _row_only
from acefuse.rewrite.terms import Term

RED = ("Sum", "RMax", "RMin")
_CMP = {"CmpLt": torch.lt, "CmpLe": torch.le, "CmpGt": torch.gt, "CmpGe": torch.ge,
        "CmpEq": torch.eq, "CmpNe": torch.ne}
_UNARY = {"Exp": torch.exp, "Neg": torch.neg, "Abs": torch.abs, "Tanh": torch.tanh, "Erf": torch.erf,
          "Sigmoid": torch.sigmoid, "Log1p": torch.log1p, "Expm1": torch.expm1,
          "Softplus": lambda a: torch.logaddexp(torch.zeros_like(a), a),
          "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round}   # round: ties to even
# singular at 0: where their argument is a reduction's value that is 0, no gradient passes
_SINGULAR = {"Log": (torch.log, float("-inf")), "Sqrt": (torch.sqrt, 0.0), "Rsqrt": (torch.rsqrt, float("inf"))}


class _V:
    __slots__ = ("a", "axes", "red", "ext")

    def __init__(self, a, axes, red=False, ext=False):
        self.a, self.axes, self.red, self.ext = a, tuple(axes), red, ext


def _align(vals):
    """The tensors of ``vals`` permuted and reshaped onto the union of their axes."""
    axes: list = []
    for v in vals:
        axes += [a for a in v.axes if a not in axes]
    out = []
    for v in vals:
        mine = [a for a in axes if a in v.axes]
        arr = v.a.permute([v.axes.index(a) for a in mine]) if v.a.dim() else v.a
        shape = [arr.shape[mine.index(a)] if a in v.axes else 1 for a in axes]
        out.append(arr.reshape(shape) if shape else arr)
    return out, tuple(axes)


def evaluate(prog, inputs: dict, dtype=torch.float32) -> dict:
    """Every output of ``prog`` ({name: tensor in the output's axis order}), computed in
    ``dtype`` from ``inputs`` (tensors by name; float inputs may require grad)."""
    sizes: dict = {}
    for name, axes in prog.tensors.items():
        for a, n in zip(axes, inputs[name].shape):
            sizes[a] = n
    dev = next(iter(inputs.values())).device
    memo: dict = {}

    def const(v):
        return torch.tensor(v, dtype=dtype, device=dev)

    def ev(t: Term, pol=None) -> _V:
        key = (t, pol)
        if key not in memo:
            if pol == "-" and _row_only(t):   # the shift of a fully masked row reads as 0
                v = ev(t, None)
                memo[key] = _V(torch.where(v.a == float("-inf"), const(0.0), v.a), v.axes, red=True, ext=v.ext)
            else:
                memo[key] = _ev(t, pol)
        return memo[key]

    def fin(v: _V, pol):
        if v.ext == "max" and pol == "-":
            return torch.where(v.a == float("-inf"), const(0.0), v.a)
        if v.ext == "min" and pol == "+":
            return torch.where(v.a == float("inf"), const(0.0), v.a)
        return v.a

    def _ev(t: Term, pol) -> _V:
        op = t.op
        if op == "Num":
            return _V(const(float(t.args[0])), ())
        if op == "In":
            x = inputs[t.args[0]]
            return _V(x.to(dtype) if x.dtype.is_floating_point else x.to(dtype).detach(), prog.tensors[t.args[0]])
        if op == "Size":
            return _V(const(float(sizes[t.args[0]])), ())
        if op == "Idx":
            return _V(torch.arange(sizes[t.args[0]], device=dev).to(dtype), (t.args[0],))
        if op == "Take":
            return take(*t.args)
        if op in RED:
            ax = t.args[0].args[0]
            v = ev(t.args[1])
            if ax not in v.axes:   # a body constant along the axis
                a, axes = _align([v, _V(torch.zeros(sizes[ax], dtype=dtype, device=dev), (ax,))])
                v = _V(a[0] + a[1], axes)
            k = v.axes.index(ax)
            r = v.a.sum(k) if op == "Sum" else v.a.amax(k) if op == "RMax" else v.a.amin(k)
            return _V(r, tuple(a for a in v.axes if a != ax), red=True,
                      ext={"RMax": "max", "RMin": "min"}.get(op, False))
        kids = [ev(c, p) for c, p in zip(t.children, _pols(t, pol))]
        red = any(k.red for k in kids)
        if op in ("Max2", "Min2"):
            (a, b), axes = _align(kids)
            return _V(torch.maximum(a, b) if op == "Max2" else torch.minimum(a, b), axes, red=red)
        arrs, axes = _align([_V(fin(k, p), k.axes) for k, p in zip(kids, _pols(t, pol))])
        return _V(apply(t, op, arrs, kids), axes, red=red)

    def apply(t, op, arrs, kids):
        if op == "Add":
            return arrs[0] + arrs[1]
        if op == "Sub":
            return arrs[0] - arrs[1]
        if op == "Mul":
            return arrs[0] * arrs[1]
        if op == "Div":
            a, b = arrs
            if not kids[1].red:
                return a / b
            zero = b == 0        # a reduction's value that is 0: 0/0 -> 0, and no gradient
            held = torch.where(a == 0, const(0.0), (a / b).detach())
            return torch.where(zero, held, a / torch.where(zero, const(1.0), b))
        if op in _SINGULAR:
            f, at0 = _SINGULAR[op]
            a = arrs[0]
            if not kids[0].red:
                return f(a)
            return torch.where(a == 0, const(at0), f(torch.where(a == 0, const(1.0), a)))
        if op == "Pow":
            return torch.pow(arrs[0], float(t.args[1]))
        if op in _UNARY:
            return _UNARY[op](arrs[0])
        if op == "Where":
            return torch.where(arrs[0] != 0, arrs[1], arrs[2])
        if op in _CMP:
            return _CMP[op](arrs[0], arrs[1]).to(dtype)
        if op == "LAnd":
            return ((arrs[0] != 0) & (arrs[1] != 0)).to(dtype)
        if op == "LOr":
            return ((arrs[0] != 0) | (arrs[1] != 0)).to(dtype)
        if op == "LNot":
            return (arrs[0] == 0).to(dtype)
        if op == "Cast":   # the reference's semantics (float formats, int8 saturation, NaN outside int32/64)
            from acefuse.reference import cast_torch
            return cast_torch(arrs[0], t.args[1])
        if op in _INTS:   # exact int64 arithmetic: the reference's own helper (no gradient)
            import numpy as np
            shape = torch.broadcast_shapes(*(a.shape for a in arrs))
            res = _int_op(op, [np.asarray(a.detach().double().cpu().expand(shape)) for a in arrs])
            return torch.from_numpy(np.ascontiguousarray(res)).to(device=dev, dtype=dtype)
        raise NotImplementedError(f"program {prog.name!r}: the torch evaluation has no operator {op!r}")

    def take(name, idx, ax):
        """The gather ``x[..., idx, ...]`` along ``ax`` (differentiable in x)."""
        x, axes = inputs[name].to(dtype), prog.tensors[name]
        rest = [a for a in axes if a != ax]
        xm = x.movedim(axes.index(ax), -1)
        iv = ev(idx)
        (_, ib), axes2 = _align([_V(torch.zeros([sizes[a] for a in rest], dtype=dtype, device=dev), rest), iv])
        extra = [a for a in axes2 if a not in rest]
        shape = torch.broadcast_shapes(tuple(sizes[a] for a in axes2), ib.shape)
        xe = xm.reshape(xm.shape[:-1] + (1,) * len(extra) + xm.shape[-1:]).expand(shape + xm.shape[-1:])
        index = ib.detach().expand(shape).long()[..., None]
        return _V(torch.gather(xe, -1, index)[..., 0], axes2)

    out = {}
    for k, e in prog.outputs.items():
        v = ev(e.term)
        arr = v.a.permute([v.axes.index(a) for a in e.axes if a in v.axes]) if v.a.dim() else v.a
        arr = arr.reshape([sizes[a] if a in v.axes else 1 for a in e.axes]) if e.axes else arr
        out[k] = arr.expand([sizes[a] for a in e.axes])
    return out
