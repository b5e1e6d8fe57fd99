"""Lowerings of layout ops (views, transposes, splits) and import-time values (sizes,
attributes, getitem): an input's views are recorded for the runtime; a computed
value's are renamings of its axes."""
from __future__ import annotations

import math

from acefuse.frontend.errors import UnsupportedOpError
from acefuse.frontend.graph import source_line
from acefuse.frontend.ir import Axis, N, un
from acefuse.frontend.lower_reduce import _NoIndices
from acefuse.frontend.lower import TV, Leaf, S, Unsupported, conc, arg, op, _meta, _dim, _dims_arg


# -- layout -------------------------------------------------------------------------------------
def _relayout(cx, x: TV, dims, step):
    """A view op: re-indexes dims; on an input it is recorded for the runtime."""
    m = _meta(cx)
    if x.n is None and x.leaf is not None:
        return TV(None, dims, m, Leaf(x.leaf.src, x.leaf.chain + (step,)))
    return TV(x.n, dims, m)


@op("layout", "transpose", "swapaxes", "swapdims")
def _transpose(cx):
    x = arg(cx, 0, "input")
    nd = len(x.dims)
    a, b = _dim(arg(cx, 1, "dim0"), nd), _dim(arg(cx, 2, "dim1"), nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _relayout(cx, x, [x.dims[i] for i in perm], ("permute", tuple(perm)))


@op("layout", "t")
def _t(cx):
    x = arg(cx, 0, "input")
    perm = list(range(len(x.dims)))[::-1]
    return _relayout(cx, x, [x.dims[i] for i in perm], ("permute", tuple(perm)))


@op("layout", "permute")
def _permute(cx):
    x = arg(cx, 0, "input")
    perm = [conc(cx.val(a)) for a in cx.node.args[1:]] or conc(arg(cx, None, "dims"))
    if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
        perm = list(perm[0])
    perm = [_dim(p, len(x.dims)) for p in perm]
    return _relayout(cx, x, [x.dims[i] for i in perm], ("permute", tuple(perm)))


@op("layout", "unsqueeze")
def _unsqueeze(cx):
    x = arg(cx, 0, "input")
    d = _dim(arg(cx, 1, "dim"), len(x.dims) + 1)
    dims = list(x.dims)
    dims.insert(d, None)
    return _relayout(cx, x, dims, ("reshape", tuple(_meta(cx).shape)))


@op("layout", "squeeze")
def _squeeze(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    d = arg(cx, 1, "dim")
    drop = [i for i in _dims_arg(d, len(x.dims)) if x.shape[i] == 1] if d is not None else \
        [i for i, s in enumerate(x.shape) if s == 1]
    return _relayout(cx, x, [a for i, a in enumerate(x.dims) if i not in drop], ("reshape", tuple(m.shape)))


def view_groups(src, dst):
    """Align two shapes of equal numel into groups ([src dims], [dst dims]) of equal size."""
    i = j = 0
    out = []
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            out.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            out.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            raise Unsupported(f"cannot align shapes {tuple(src)} and {tuple(dst)}")
        gi, gj, ps, pd = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        out.append((gi, gj))
    return out


def is_pure_view(src, dst) -> bool:
    """A view that only adds or drops dims of size 1 (no split, no merge)."""
    if 0 in src or 0 in dst:
        return False
    return all(len(gi) <= 1 and len(gj) <= 1 for gi, gj in view_groups(list(src), list(dst)))


@op("layout", "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "expand_dims")
def _view(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    src, dst = list(x.shape), [int(s) for s in m.shape]
    if 0 in src or 0 in dst:
        raise Unsupported("an empty dim")
    dims = [None] * len(dst)
    split = False
    for gi, gj in view_groups(src, dst):
        if len(gi) == 1 and len(gj) == 1:
            dims[gj[0]] = x.dims[gi[0]]
        elif gi and gj:
            split = True
            for j in gj:
                dims[j] = Axis(dst[j]) if dst[j] != 1 else None
    if split and not (x.n is None and x.leaf is not None):
        raise Unsupported(f"a view from {tuple(src)} to {tuple(dst)} splits or merges dims of a value "
                          "computed inside the function; acefuse splits only inputs (the head split "
                          "x.view(B, N, H, D).transpose(1, 2)); do the merge in torch after the call")
    return _relayout(cx, x, dims, ("reshape", tuple(dst)))


@op("layout", "expand", "expand_as", "broadcast_to")
def _expand(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    dst = [int(s) for s in m.shape]
    pad = [None] * (len(dst) - len(x.dims)) + list(x.dims)
    dims = [a if a is not None else (Axis(s) if s != 1 else None) for a, s in zip(pad, dst)]
    if x.n is None and x.leaf is not None:
        # an expanded input is read as if it did not range over the new dims
        return TV(cx.n(x), dims, m)
    return TV(x.n, dims, m)


@op("layout", "split", "chunk", "unbind")
def _split(cx):
    x = arg(cx, 0, "input")
    m = _meta(cx)
    name = cx.node.target if cx.node.op == "call_method" else cx.node.target.__name__
    d = _dim(arg(cx, 2 if name != "unbind" else 1, "dim", 0), len(x.dims))
    if x.n is not None or x.leaf is None:
        raise Unsupported(f"{name} of a value computed inside the function")
    out, start = [], 0
    for piece in m:
        ln = int(piece.shape[d]) if name != "unbind" else 1
        dims = list(x.dims)
        if name == "unbind":
            dims.pop(d)
        else:
            dims[d] = Axis(ln) if ln != 1 else None
        out.append(TV(None, dims, piece, Leaf(x.leaf.src, x.leaf.chain + (("narrow", d, start, ln, name == "unbind"),))))
        start += ln
    return tuple(out)


# -- import-time values (shapes) --------------------------------------------------------------
@op("static", "size")
def _size(cx):
    x = arg(cx, 0, "input")
    d = arg(cx, 1, "dim")
    if d is None:
        return tuple(S(s, N("size", a) if a is not None else None) for s, a in zip(x.shape, x.dims))
    d = _dim(d, len(x.dims))
    a = x.dims[d]
    return S(x.shape[d], N("size", a) if a is not None else None)


@op("static", "dim", "ndimension")
def _ndim(cx):
    return S(len(arg(cx, 0, "input").dims))


@op("static", "getattr")
def _getattr(cx):
    x, name = arg(cx, 0, "input"), cx.node.args[1]
    if isinstance(x, TV):
        if name == "shape":
            return tuple(S(s, N("size", a) if a is not None else None) for s, a in zip(x.shape, x.dims))
        if name in ("dtype", "device", "ndim"):
            return getattr(x.meta, name)
        if name in ("T", "mT"):
            raise Unsupported(f"Tensor.{name}; use transpose")
    raise Unsupported(f"attribute {name!r}")


@op("static", "getitem")
def _getitem(cx):
    x, i = cx.val(cx.node.args[0]), cx.node.args[1]
    if isinstance(x, TV):
        return _index(cx, x, i)
    v = x[conc(cx.val(i))]
    if isinstance(v, _NoIndices):
        raise UnsupportedOpError(f"torch.{v.kind}(...).indices", source_line(v.node),
                                 "the indices of a max/min are not expressible; use amax/amin")
    return v


@op("static", "sqrt_scalar")
def _msqrt(cx):
    x = arg(cx, 0, "x")
    return S(math.sqrt(conc(x)), un("sqrt", x.n) if isinstance(x, S) and x.n is not None else None)




def _index_spec(cx, i):
    """A hashable form of a basic index (ints, slices, None, Ellipsis), or Unsupported."""
    items = i if isinstance(i, tuple) else (i,)
    spec = []
    for it in items:
        if isinstance(it, slice):
            start, stop, step = (conc(cx.val(v)) for v in (it.start, it.stop, it.step))
            if not all(v is None or isinstance(v, int) for v in (start, stop, step)):
                raise Unsupported("a slice whose bounds are not integers")
            spec.append(("s", start, stop, step))
        elif it is None:
            spec.append(("n",))
        elif it is Ellipsis:
            spec.append(("e",))
        else:
            v = conc(cx.val(it))
            if isinstance(v, bool) or not isinstance(v, int):
                raise Unsupported("indexing with a tensor or a list (advanced indexing); index in torch")
            spec.append(("i", v))
    return tuple(spec)


def index_of(spec):
    """The Python index a spec stands for (applied to the input at run time)."""
    out = []
    for it in spec:
        out.append({"s": lambda: slice(*it[1:]), "n": lambda: None, "e": lambda: Ellipsis,
                    "i": lambda: it[1]}[it[0]]())
    return tuple(out)


def _index(cx, x: TV, i):
    """``x[:, :, :T, :T]`` on an input: a view recorded for the runtime (a sliced dim is a
    new axis, a whole one keeps its axis). A computed value cannot be sliced in a program."""
    spec = _index_spec(cx, i)
    if x.n is not None or x.leaf is None:
        raise Unsupported("slicing or indexing a value computed inside the region (acefuse slices only "
                          "its inputs); torch does it, and the region ends before it")
    m = _meta(cx)
    used = sum(1 for it in spec if it[0] in ("s", "i"))
    dims, d = [], 0
    for it in spec:
        if it[0] == "e":
            for _ in range(len(x.dims) - used):
                dims.append(x.dims[d])
                d += 1
        elif it[0] == "n":
            dims.append(None)
        elif it[0] == "i":
            d += 1
        else:
            n = len(range(*slice(*it[1:]).indices(x.shape[d])))
            dims.append(x.dims[d] if n == x.shape[d] else (Axis(n) if n != 1 else None))
            d += 1
    dims += x.dims[d:]
    if len(dims) != m.dim():
        raise Unsupported(f"an index {index_of(spec)} this importer cannot follow")
    dims = [a if int(s) != 1 else None for a, s in zip(dims, m.shape)]
    return TV(None, dims, m, Leaf(x.leaf.src, x.leaf.chain + (("index", spec),)))


@op("layout", "narrow")
def _narrow(cx):
    x = arg(cx, 0, "input")
    d = _dim(arg(cx, 1, "dim"), len(x.dims))
    start, length = int(conc(arg(cx, 2, "start"))), int(conc(arg(cx, 3, "length")))
    if x.n is not None or x.leaf is None:
        raise Unsupported("narrowing a value computed inside the region (acefuse narrows only its inputs)")
    dims = list(x.dims)
    dims[d] = x.dims[d] if length == x.shape[d] else (Axis(length) if length != 1 else None)
    return TV(None, dims, _meta(cx), Leaf(x.leaf.src, x.leaf.chain + (("narrow", d, start % max(x.shape[d], 1),
                                                                          length, False),)))
