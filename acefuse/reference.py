"""An independent float64 reference: evaluates a program as written, unfused, with numpy.

Values carry their named axes; binary operators align by axis name. It shares no
code with the fused path (no states, no rules, no codegen), so comparing a kernel
against it checks the whole pipeline.

Conventions for fully masked data (the same ones the kernels document, README
"Numerics"): IEEE semantics, except that a value built only from reductions, with a
max, min or log among them (an empty max, the logsumexp of a fully masked row), that is -inf
reads as 0 where it is subtracted (its sign inside an enclosing difference is negative, through
``+ - neg`` and products with a constant), an empty min (+inf) reads as 0 where it
is added inside a difference, and a division by a value computed from a reduction
gives 0 when both sides are 0.
"""
from __future__ import annotations

import numpy as np

from acefuse.rewrite.terms import Term


class _V:
    __slots__ = ("a", "axes", "red", "ext")

    def __init__(self, a, axes, red=False, ext=False):
        self.a = np.asarray(a, dtype=np.float64) if not isinstance(a, np.ndarray) else a
        self.axes = tuple(axes)
        self.red = red   # computed from a reduction
        self.ext = ext   # the direct result of a max/min reduction


def _align(vals):
    axes: list = []
    for v in vals:
        for a in v.axes:
            if a not in axes:
                axes.append(a)
    out = []
    for v in vals:
        arr = v.a
        # transpose v's axes into the order of `axes`, then insert singleton dims
        order = [v.axes.index(a) for a in axes if a in v.axes]
        arr = np.transpose(arr, order) if arr.ndim else arr
        shape = [arr.shape[[a for a in axes if a in v.axes].index(a)] if a in v.axes else 1 for a in axes]
        out.append(arr.reshape(shape) if arr.ndim or shape else arr)
    return out, tuple(axes)


def _fin(v: _V, pol):
    """An empty extremum that bounds a shift reads as 0 (see the module docstring)."""
    if v.ext == "max" and pol == "-":
        return np.where(v.a == -np.inf, 0.0, v.a)
    if v.ext == "min" and pol == "+":
        return np.where(v.a == np.inf, 0.0, v.a)
    return v.a


def _row_only(t: Term) -> bool:
    """A value built only from reductions and constants, with a max, a min or a log among
    them (the shift of a masked row: ``max_j x``, ``max_j x + log(...)``; not a mean or a sum)."""
    found = [False]

    def walk(u):
        if u.op in ("Sum", "RMax", "RMin"):
            found[0] = found[0] or u.op != "Sum"   # built from a max or min: the shift of a masked row
            return True
        if u.op in ("Num", "Size"):
            return True
        if u.op in ("In", "Idx", "Take"):
            return False
        if u.op == "Log":
            found[0] = True   # the log of a sum that is 0 (a masked row's sum of exponentials)
        return all(walk(c) for c in u.children)
    return walk(t) and found[0]


def _pols(t: Term, pol):
    """Signs of the operands of ``t`` inside an enclosing difference (None outside one)."""
    op = t.op
    flip = {"+": "-", "-": "+"}
    if op == "Add":
        return [pol, pol]
    if op == "Sub":
        p = pol or "+"
        return [p, flip[p]]
    if op == "Neg":
        return [flip[pol or "+"]]
    if op in ("Mul", "Div") and pol is not None:
        a, b = t.args
        if b.op == "Num":
            return [pol if b.args[0] >= 0 else flip[pol], None]
        if op == "Mul" and a.op == "Num":
            return [None, pol if a.args[0] >= 0 else flip[pol]]
    return [None] * len(t.children)


ROUNDING_OPS = ("Cast", "Round", "Floor", "Ceil")   # discontinuous: an ulp of their argument can move them a unit


def has_rounding(prog) -> bool:
    """Whether an output of ``prog`` reads a rounding operator (``ROUNDING_OPS``)."""
    seen: set = set()
    todo = [getattr(e, "term", e) for e in prog.outputs.values()]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.op in ROUNDING_OPS:
            return True
        todo.extend(t.children)
    return False


def evaluate(prog, inputs: dict, masked_conventions: bool = True, round_args_to=None) -> dict:
    """Evaluate every output of ``prog`` in float64; returns {output: ndarray in output axis order}.

    ``round_args_to="float32"``: the argument of every rounding operator (``ROUNDING_OPS``: a cast,
    round, floor, ceil) is first rounded to float32, the precision a kernel computes it in. These
    operators are discontinuous: ``cast(x / s, "float8_e4m3fn")`` with x/s = 168.0000036 exactly is
    176, but the float32 quotient is 168.0, a tie that rounds to 160 (as torch's ``.to()`` of the
    float32 quotient does), and one unit of float8 moves a sum that reads it far. The exact float64
    evaluation (the default) is the program's real-number semantics; this one is the documented
    semantics of a kernel (a cast converts the float32 value it computed) up to float32 rounding
    of the argument's other operations."""
    sizes: dict = {}
    arrays = {}
    for name, axes in prog.tensors.items():
        x = inputs[name]
        if hasattr(x, "detach"):
            x = x.detach().cpu()
            if x.dtype.is_floating_point and x.dtype.itemsize == 1:
                x = x.double()   # float8: numpy has no such type (the values are exact in float64)
            x = x.numpy()
        else:
            x = np.asarray(x)
        arrays[name] = x
        for a, n in zip(axes, x.shape):
            sizes[a] = n
    memo: dict = {}

    def ev(t: Term, pol=None) -> _V:
        key = (t, pol)
        if key in memo:
            return memo[key]
        if masked_conventions and pol == "-" and _row_only(t):
            # a subtracted value built only from reductions that is -inf reads as 0
            v = ev(t, None)
            r = _V(np.where(v.a == -np.inf, 0.0, v.a), v.axes, red=True, ext=v.ext)
        else:
            r = _ev(t, pol)
        memo[key] = r
        return r

    def _ev(t: Term, pol) -> _V:
        op = t.op
        if op == "Num":
            return _V(np.float64(t.args[0]), ())
        if op == "In":
            x = arrays[t.args[0]]
            return _V(x.astype(np.float64), prog.tensors[t.args[0]])
        if op == "Size":
            return _V(np.float64(sizes[t.args[0]]), ())
        if op == "Idx":
            return _V(np.arange(sizes[t.args[0]], dtype=np.float64), (t.args[0],))
        if op == "Take":
            name, idx, ax = t.args
            x = arrays[name].astype(np.float64)
            axes = prog.tensors[name]
            iv = ev(idx)
            k = axes.index(ax)
            rest = [a for a in axes if a != ax]
            xm = np.moveaxis(x, k, -1)  # rest..., ax
            vals = [_V(np.zeros([sizes[a] for a in rest]), rest), iv]
            (z, ib), axes2 = _align(vals)
            ib = np.broadcast_to(ib, np.broadcast_shapes(z.shape, ib.shape)).astype(np.int64)
            # gather: for each position of rest axes (and extra index axes), pick xm[..., idx]
            extra = [a for a in axes2 if a not in rest]
            xe = xm.reshape(xm.shape[:-1] + (1,) * len(extra) + xm.shape[-1:])
            xe = np.broadcast_to(xe, ib.shape + xm.shape[-1:])
            out = np.take_along_axis(xe, ib[..., None], axis=-1)[..., 0]
            return _V(out, axes2)
        if op in ("Sum", "RMax", "RMin"):
            ax = t.args[0].args[0]
            v = ev(t.args[1])
            k = v.axes.index(ax)
            fn = {"Sum": np.sum, "RMax": np.max, "RMin": np.min}[op]
            ext = {"RMax": "max", "RMin": "min"}.get(op, False)
            return _V(fn(v.a, axis=k), tuple(a for a in v.axes if a != ax), red=True, ext=ext)
        pols = _pols(t, pol)
        kids = [ev(c, p) for c, p in zip(t.children, pols)]
        if op in ("Max2", "Min2"):
            (a, b), axes = _align(kids)
            return _V((np.maximum if op == "Max2" else np.minimum)(a, b), axes,
                      red=any(k.red for k in kids))
        vals = [(_fin(k, p) if masked_conventions else k.a) for k, p in zip(kids, pols)]
        (arrs), axes = _align([_V(v, k.axes) for v, k in zip(vals, kids)])
        red = any(k.red for k in kids)
        with np.errstate(all="ignore"):
            if op == "Add":
                r = arrs[0] + arrs[1]
            elif op == "Sub":
                r = arrs[0] - arrs[1]
            elif op == "Mul":
                r = arrs[0] * arrs[1]
            elif op == "Div":
                r = arrs[0] / arrs[1]
                if masked_conventions and kids[1].red:
                    r = np.where((arrs[0] == 0) & (arrs[1] == 0), 0.0, r)
            elif op == "Neg":
                r = -arrs[0]
            elif op == "Exp":
                r = np.exp(arrs[0])
            elif op == "Log":
                r = np.log(arrs[0])
            elif op == "Sqrt":
                r = np.sqrt(arrs[0])
            elif op == "Rsqrt":
                r = 1.0 / np.sqrt(arrs[0])
            elif op == "Abs":
                r = np.abs(arrs[0])
            elif op == "Tanh":
                r = np.tanh(arrs[0])
            elif op == "Pow":
                r = np.power(arrs[0], float(t.args[1]))
            elif op in ROUNDING_OPS and round_args_to == "float32":
                a32 = arrs[0].astype(np.float32).astype(np.float64)
                r = _cast(a32, t.args[1]) if op == "Cast" else _FUNCS[op](a32)
            elif op in _FUNCS:
                r = _FUNCS[op](arrs[0])
            elif op == "Cast":
                r = _cast(arrs[0], t.args[1])
            elif op in _INTS:
                r = _int_op(op, arrs)
            elif op == "Where":
                r = np.where(arrs[0] != 0, arrs[1], arrs[2])
            elif op in ("CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe"):
                f = {"CmpLt": np.less, "CmpLe": np.less_equal, "CmpGt": np.greater,
                     "CmpGe": np.greater_equal, "CmpEq": np.equal, "CmpNe": np.not_equal}[op]
                r = f(arrs[0], arrs[1]).astype(np.float64)
            elif op == "LAnd":
                r = ((arrs[0] != 0) & (arrs[1] != 0)).astype(np.float64)
            elif op == "LOr":
                r = ((arrs[0] != 0) | (arrs[1] != 0)).astype(np.float64)
            elif op == "LNot":
                r = (arrs[0] == 0).astype(np.float64)
            else:
                raise NotImplementedError(f"reference: operator {op}")
        return _V(r, axes, red=red)

    out = {}
    for k, e in prog.outputs.items():
        v = ev(e.term)
        (arr,), axes = _align([v])
        order = [axes.index(a) for a in e.axes]
        arr = np.transpose(arr, order) if arr.ndim else arr
        shape = [sizes[a] for a in e.axes]
        out[k] = np.broadcast_to(arr, shape).copy() if shape else np.asarray(arr)
    return out


# ---- functions, rounding and integer arithmetic (float64 / exact int64) -----------------------
def _erf(a):
    import math
    a = np.asarray(a)
    return np.frompyfunc(math.erf, 1, 1)(a).astype(a.dtype if a.dtype.kind == "f" else np.float64)


def _sigmoid(a):
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _round(a):
    return np.round(a)   # ties to even, as torch.round


_FUNCS = {"Erf": _erf, "Sigmoid": _sigmoid, "Softplus": lambda a: np.logaddexp(0.0, a),
          "Log1p": np.log1p, "Expm1": np.expm1, "Floor": np.floor, "Ceil": np.ceil, "Round": _round}
_INTS = ("FloorDiv", "Mod", "BitAnd", "BitOr", "BitXor", "BitNot", "Shl", "Shr")


def _cast(a, dtype):
    """``cast(a, dtype)`` on float64 arrays (rewrite/terms.py, the Cast operator): a float
    format rounds (``round_format``); int8 truncates toward zero and saturates; int32/int64
    truncate toward zero and give NaN outside the type."""
    from acefuse.rewrite.terms import CAST_LIMITS, SATURATING, FLOAT_CASTS
    if dtype in FLOAT_CASTS:
        return round_format(a, dtype)
    t = np.trunc(a)
    if dtype in SATURATING:
        lo, hi = SATURATING[dtype]
        return np.clip(t, lo, hi)   # NaN stays NaN
    lim = CAST_LIMITS[dtype]
    return np.where((t >= -lim) & (t < lim), t, np.nan)


def round_format(a, dtype):
    """``a`` (float64) rounded to the float format ``dtype`` (``FLOAT_CASTS``): to nearest,
    ties to even, with the format's subnormals; past the largest finite value +-inf, or +-448
    for float8_e4m3fn (saturation, as torch's ``.to(torch.float8_e4m3fn)``); NaN stays NaN
    and the sign of zero is kept. Bit-exact with torch's cast of a float32 tensor
    (tests/test_quant.py checks millions of random float32 bit patterns)."""
    from acefuse.rewrite.terms import FLOAT_CASTS
    p, emin, top, over = FLOAT_CASTS[dtype]
    a = np.asarray(a, dtype=np.float64)
    mag = np.abs(a)
    with np.errstate(all="ignore"):
        _, e = np.frexp(mag)                              # mag = m * 2**e, m in [0.5, 1)
        q = np.ldexp(1.0, np.maximum(e - 1, emin) - p)    # the format's spacing at mag
        r = np.round(mag / q) * q                         # exact scaling; np.round ties to even
        r = np.where(np.isinf(mag), np.inf, r)
        r = np.where(r > top, top if over == "sat" else np.inf, r)
        return np.copysign(r, a)


def cast_torch(a, dtype):
    """``cast(a, dtype)`` on a torch tensor (autograd_ref's evaluation), with the gradient
    conventions of acefuse/backward.py: a float cast passes the gradient straight through,
    an integer cast has none."""
    import torch
    from acefuse.rewrite.terms import FLOAT_CASTS
    v = torch.from_numpy(np.ascontiguousarray(_cast(a.detach().double().cpu().numpy(), dtype)))
    v = v.to(device=a.device, dtype=a.dtype)
    if dtype in FLOAT_CASTS:
        return a + (v - a.detach())   # straight-through
    return v


def _int_op(op, arrs):
    """Exact int64 arithmetic on integer-valued float64 operands (Python's floor semantics
    for // and %); NaN where an operand is not a finite int64 or the operation is undefined."""
    arrs = np.broadcast_arrays(*arrs)
    ok = np.ones(arrs[0].shape, dtype=bool)
    ints = []
    for x in arrs:
        good = np.isfinite(x) & (np.abs(x) < 2.0 ** 63)
        ok &= good
        ints.append(np.where(good, x, 0).astype(np.int64))
    a = ints[0]
    if op == "BitNot":
        r = ~a
    else:
        b = ints[1]
        if op in ("FloorDiv", "Mod"):
            ok &= b != 0
            bs = np.where(b == 0, 1, b)
            r = np.floor_divide(a, bs) if op == "FloorDiv" else np.mod(a, bs)
        elif op in ("Shl", "Shr"):
            ok &= (b >= 0) & (b < 64)
            bs = np.where((b >= 0) & (b < 64), b, 0)
            r = np.left_shift(a, bs) if op == "Shl" else np.right_shift(a, bs)
        else:
            r = {"BitAnd": np.bitwise_and, "BitOr": np.bitwise_or, "BitXor": np.bitwise_xor}[op](a, b)
    return np.where(ok, r.astype(np.float64), np.nan)


def random_inputs(prog, sizes: dict, dtype=None, seed=None, scale=3.0, device="cpu"):
    """Fresh random inputs for a program (torch tensors); index tensors get valid indices."""
    import torch
    g = torch.Generator().manual_seed(seed if seed is not None else int(np.random.SeedSequence().entropy % 2**31))
    dtype = dtype or torch.float32
    idx_of = {}
    for e in prog.outputs.values():
        for t in e.term.walk():
            if t.op == "Take" and t.args[1].op == "In":
                idx_of[t.args[1].args[0]] = t.args[2]
    out = {}
    for name, axes in prog.tensors.items():
        shape = [sizes[a] for a in axes]
        if name in idx_of:
            out[name] = torch.randint(0, sizes[idx_of[name]], shape, generator=g).to(device)
        else:
            out[name] = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
    return out
