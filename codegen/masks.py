"""Mask analysis for the contraction family: which key tiles a mask excludes entirely
(skipped) and which it includes entirely (run without mask arithmetic).

A leaf ``where(cond, s, -inf)`` is a *mask site*. ``truth(cond)`` gives two scalar
booleans per key tile (vectorised over ``SCAN`` tiles at once): *always true* and
*always false* over the tile's index box (the row tile's query indices times the key
tile's indices), by interval arithmetic on index expressions. A comparison whose sides
interval arithmetic cannot bound (a lookup ``doc[i] == doc[j]``, a tensor over axes) is *unknown*:
neither always true nor always false, so ``A & unknown`` is still always false where
``A`` is, and ``A | unknown`` always true where ``A`` is; the condition itself is always
evaluated per element on tiles that are not proven fully visible. Sound by
construction: each interval encloses every value of its expression over the box
(integer indices; a 0-d input tensor, such as a shard's global offset, is one value per
launch: a point interval, loaded as the kernel loads it; ``//`` and ``%`` by a positive
constant are monotone / periodic), and tests/test_masks.py checks it exhaustively at small
sizes.

Exact on every device: every bound of an arithmetic node is computed *exactly* or widened
to (-inf, inf). The bounds are float32 values; an arithmetic node keeps its bounds only
where they and its operands' bounds are integers of magnitude below 2**24 (then each
float32 operation that produced them was exact), and a product only by an integer
constant. ``//`` and ``%`` divide in int64 (floor division, as emit.py's per-element
``emit_int``), never with Triton's float ``/`` (approximate on a GPU: ``6 / 3`` may come
out just below 2, and its floor, 1, bounds a box it does not enclose). Exact bounds
enclose the per-element values however the kernel rounds them (fused multiply-adds
included): each is a rounding of a real value the exact bounds enclose, and rounding is
monotone and keeps representable values. A leaf compared directly (``j <= i``) is the
float32 value of an index in the kernel too (its rounding is monotone).
tests/test_mask_bounds.py checks this against brute force at exact multiples, with the
float division of the interpreter made adversarial (two ulps either way).

A skip is used only when the derived updates are checked (numerically, here) to leave
every state unchanged on a tile whose masked leaves are all -inf.
"""
from __future__ import annotations

import math

import numpy as np

from acefuse.rewrite.terms import Term
from acefuse.codegen.emit import CodegenError

# operators interval() bounds; Mul needs a constant factor, // and % a positive constant divisor
_ARITH = frozenset(("Num", "Idx", "Size", "Neg", "Add", "Sub", "Mul", "Abs", "FloorDiv", "Mod",
                    "Max2", "Min2"))
_CMPS = ("CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe")
# an unknown truth value as a block (a 0-d boolean next to a block fails in Triton's interpreter)
UNKNOWN = "(start < 0)"
# a lookup's key positions over a scan step's tiles, [SCAN, BLOCK_J] (_lookup_interval; the Gluon
# text gives them their own 2-d layout: gluon_text._gluonize)
SCAN_KEYS = "start[:, None] + tl.arange(0, BLOCK_J)[None, :]"
# float32 holds every integer of magnitude up to 2**24 exactly (bounds are kept below it)
_EXACT = "16777216.0"
_WIDE = ("float('-inf')", "float('inf')")


def _int_const(t: Term) -> bool:
    return t.op == "Num" and not isinstance(t.args[0], Term) and math.isfinite(float(t.args[0])) \
        and float(t.args[0]).is_integer() and abs(float(t.args[0])) < 2 ** 24


def _exact(L: list, lo: str, hi: str, operands=()):
    """(lo, hi) where they and every operand bound are integers of magnitude below 2**24 (so
    every float32 operation that computed them was exact), else (-inf, inf); per tile. Each
    value is made a block over the tiles (``+ start * 0.0``, exact): Triton's interpreter
    cannot ``&`` a 0-d boolean with a block."""
    n = len(L)
    L.append(f"iv{n}l = {lo} + start * 0.0")
    L.append(f"iv{n}h = {hi} + start * 0.0")
    vals = [f"iv{n}l", f"iv{n}h"]
    for k, v in enumerate(x for pair in operands for x in pair):
        L.append(f"iv{n}o{k} = {v} + start * 0.0")
        vals.append(f"iv{n}o{k}")
    L.append(f"iv{n}ok = " + " & ".join(f"(tl.abs({v}) < {_EXACT}) & ({v} == tl.floor({v}))" for v in vals))
    return f"tl.where(iv{n}ok, iv{n}l, {_WIDE[0]})", f"tl.where(iv{n}ok, iv{n}h, {_WIDE[1]})"


def _floor_div(L: list, name: str, a: str, c: int) -> str:
    """int64 floor division by a positive constant (Triton's ``//`` truncates toward zero on a
    GPU; the interpreter floors, where the correction is a no-op)."""
    L.append(f"{name}t = {a} // {c}")
    L.append(f"{name} = tl.where({a} - {name}t * {c} < 0, {name}t - 1, {name}t)")
    return name


def _pos_const(t: Term) -> bool:
    return t.op == "Num" and not isinstance(t.args[0], Term) and float(t.args[0]) > 0 \
        and float(t.args[0]).is_integer()


def masked_leaf(t: Term):
    """(condition, value where it is false, value where it holds) of a leaf
    ``where(cond, x, -inf)`` (a score mask), ``where(cond, x, 0)``, or a product with
    such a factor (``where(j <= i, relu(s), 0) * v``: 0 where masked); else None."""
    if t.op == "Where" and t.args[2].op == "Num" and t.args[2].args[0] in (-math.inf, 0.0):
        return t.args[0], float(t.args[2].args[0]), t.args[1]
    if t.op == "Mul":
        for k in (0, 1):
            site = masked_leaf(t.args[k])
            if site is not None and site[1] == 0.0:
                args = list(t.args)
                args[k] = site[2]
                return site[0], 0.0, Term("Mul", tuple(args))
    return None


def _loop(g):
    return getattr(g, "axis", None) or g.F   # ContractionGen's key axis, SumGen's loop axis


def _len_axes(g):
    """Axes whose length the kernel has (rows, grid, value, contraction, vector axes)."""
    return tuple(a for n in ("R", "G", "E", "C", "V", "L") for a in getattr(g, n, ()))


def _interval_ok(g, t: Term) -> bool:
    """``t`` is an index expression interval() can bound over the tile box (methods are
    module functions so that SumGen, which borrows interval()/truth(), needs no more)."""
    if t.op == "Take":
        return _lookup_ok(g, t)
    for u in t.walk():
        if u.op == "Take" and _lookup_ok(g, u):
            continue
        if u.op == "In" and g.tensors.get(u.args[0]) == ():
            continue   # a scalar input (a shard's global offset): one value per launch, a point interval
        if u.op not in _ARITH:
            return False
        if u.op == "Mul" and not any(x.op == "Num" for x in u.args):
            return False
        if u.op in ("FloorDiv", "Mod") and not _pos_const(u.args[1]):
            return False
        if u.op == "Idx" and u.args[0] not in (_loop(g),) + tuple(g.R) + tuple(g.G):
            return False
        if u.op == "Size" and u.args[0] not in (_loop(g),) + _len_axes(g):
            return False
    return True


def _lookup_ok(g, t: Term) -> bool:
    """A lookup ``x.at(a=index(i))`` of a tensor over batch/head axes and ``a`` at a query or
    key index: its interval over a tile is the min and max of the values read (loaded)."""
    if getattr(g, "F", None) is not None and not hasattr(g, "axis"):
        return False   # SumGen: no lookups
    name, idx, ax = t.args
    return (idx.op == "Idx" and idx.args[0] in (_loop(g),) + tuple(g.R)
            and all(a in g.G for a in g.tensors[name] if a != ax))


def _atom_ok(g, c: Term) -> bool:
    return c.op in _CMPS and all(_interval_ok(g, x) for x in c.args)


def _cmp_truth(op, al, ah, bl, bh):
    """(always_true, always_false) of a comparison of two intervals."""
    # every comparison is made a block over the tiles (`+ z`): Triton's interpreter
    # cannot combine a 0-d boolean (a query-only condition) with a block one
    z = "start * 0.0"
    if op in ("CmpLt", "CmpGt"):
        return f"({ah} + {z} < {bl})", f"({al} + {z} >= {bh})"
    if op in ("CmpLe", "CmpGe"):
        return f"({ah} + {z} <= {bl})", f"({al} + {z} > {bh})"
    eq = f"(({al} + {z} == {ah}) & ({bl} == {bh}) & ({al} == {bl}))"
    ne = f"(({ah} + {z} < {bl}) | ({al} + {z} > {bh}))"
    return (eq, ne) if op == "CmpEq" else (ne, eq)


def _interval_leaf(g, t: Term, axis: str, box: str, n_f: str):
    """(lo, hi) of a constant, an index or an axis length (``g``: the generator, ContractionGen
    or SumGen): ``axis``'s index over the tile's box (``{box}_lo``, ``{box}_hi``), a row axis'
    over the row tile's, any other a point; ``axis``'s length ``n_f``."""
    op = t.op
    if op == "Num":
        v = repr(float(t.args[0]))
        return v, v
    if op == "Idx":
        a = t.args[0]
        if a == axis:
            return f"{box}_lo", f"{box}_hi"
        if a in g.R:
            return f"{a}_lo", f"{a}_hi"
        return f"(idx_{a} * 1.0)", f"(idx_{a} * 1.0)"
    if op == "Size":
        v = n_f if t.args[0] == axis else f"(len_{t.args[0]} * 1.0)"
        return v, v
    raise CodegenError(f"no interval leaf for {op!r}")


class MaskAnalysis:
    """Mixin of ContractionGen (needs ``axis``, ``R``, ``G``, ``leaves``)."""

    def mask_sites(self):
        """Elm leaves masked by a condition with an atom interval arithmetic can bound
        (otherwise nothing could be skipped or proven visible): (name, condition)."""
        sites = []
        for name, t in self.leaves.items():
            site = masked_leaf(t)
            if site is not None and any(_atom_ok(self, u) for u in site[0].walk() if u.op in _CMPS):
                sites.append((name, site[0]))
        return sites

    def site_values(self, sites) -> dict:
        """What each masked leaf is where its condition is false (-inf or 0)."""
        return {n: masked_leaf(self.leaves[n])[1] for n, _ in sites}

    def unmasked(self, sites) -> dict:
        """Each masked leaf as it is where its condition holds (tiles proven fully visible)."""
        return {n: masked_leaf(self.leaves[n])[2] for n, _ in sites}

    def scan_max(self) -> int:
        """Key tiles analysed per step: 256, or 32 where a lookup's interval loads the values
        of every key tile of the step (``[SCAN, BLOCK_J]`` in registers)."""
        looks = any(u.op == "Take" and _lookup_ok(self, u) for _, c in self.mask_sites() for u in c.walk())
        return 32 if looks else 256

    # the prefix of the row indices and mask a lookup's interval over the row tile reads
    # (``idx_{a}``, ``rmask``): the warp-specialised Gluon kernels' analysis covers both consumers'
    # rows under ``pr_`` names (contraction_gluon_ws)
    ROWS_OF_ANALYSIS = ""

    def row_lookups(self) -> bool:
        """A lookup's interval reads the values of the row tile's rows (a row axis' index)."""
        return any(u.op == "Take" and _lookup_ok(self, u) and u.args[1].args[0] in self.R
                   for _, c in self.mask_sites() for u in c.walk())

    def scan_lookups(self) -> bool:
        """A lookup's interval loads key tiles' values in the scan (scan_max; Gluon's layouts)."""
        return self.scan_max() != 256

    def _interval_ok(self, t: Term) -> bool:
        return _interval_ok(self, t)

    def _atom_ok(self, c: Term) -> bool:
        return _atom_ok(self, c)

    def skip_is_sound(self, p, masked: dict) -> bool:
        """Numerically check that a tile whose masked leaves all hold their masked value
        (``masked``: leaf -> -inf or 0) leaves every state unchanged."""
        rng = np.random.default_rng(0)
        for trial in range(3):
            env_a = {s.name: float(rng.normal() * 3) for s in p.states}
            for s in p.states:
                if s.op == "sum":
                    env_a[s.name] = abs(env_a[s.name]) + 0.5
            new = {}
            nb = 5
            leaves = {n: (np.full(nb, masked[n]) if n in masked else rng.normal(size=nb)) for n in self.leaves}

            def ev(t):
                op = t.op
                if op == "St":
                    q, blk = t.args
                    if blk.op == "BA":
                        return env_a[q]
                    if blk.op == "BU":
                        return new[q]
                    if blk.op == "BJ":
                        return 1.0
                    raise KeyError
                if op == "Num":
                    return t.args[0]
                if op == "Cnt":
                    return {"BA": 7.0, "BB": float(nb), "BU": 7.0 + nb}.get(t.args[0].op, 1.0)
                if op == "Elm":
                    return leaves[t.args[0]]
                if op == "Par":
                    return 1.3
                if op in ("Sum", "RMax", "RMin"):
                    v = np.broadcast_to(ev(t.args[1]), (nb,))
                    return {"Sum": np.sum, "RMax": np.max, "RMin": np.min}[op](v)
                a = [ev(c) for c in t.children]
                with np.errstate(all="ignore"):
                    fin = [np.where(np.isinf(x), 0.0, x) if c.op == "St" else x for x, c in zip(a, t.children)]
                    f = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
                         "Div": lambda x, y: x / y, "Neg": lambda x: -x, "Exp": np.exp, "Log": np.log,
                         "Max2": np.maximum, "Min2": np.minimum, "Abs": np.abs, "Tanh": np.tanh,
                         "Sqrt": np.sqrt, "Rsqrt": lambda x: 1 / np.sqrt(x)}.get(op)
                    if f is None:
                        raise KeyError(op)
                    if op in ("Max2", "Min2"):
                        return f(*a)
                    return f(*fin)
            try:
                for s in p.states:
                    new[s.name] = float(ev(p.rolling[s.name]))
            except (KeyError, TypeError, ValueError):
                return False
            for s in p.states:
                if not np.isclose(new[s.name], env_a[s.name], rtol=1e-12, atol=0):
                    return False
        return True

    def interval(self, t: Term, L: list):
        """(lo, hi) float32 expressions of an index expression over the tile's index box:
        exact, or (-inf, inf) where exactness is not proved (the module docstring)."""
        op = t.op
        if op in ("Num", "Idx", "Size"):
            return _interval_leaf(self, t, self.axis, "j", "nj_f")
        if op in ("Neg", "Add", "Sub", "Max2", "Min2", "Mul", "Abs") and any(
                a.op == "Num" and not _int_const(a) for a in t.args):
            return _WIDE   # a non-integer (or huge) constant: float32 bounds may be rounded
        if op == "Neg":
            lo, hi = self.interval(t.args[0], L)
            return _exact(L, f"(-{hi})", f"(-{lo})", [(lo, hi)])
        if op in ("Add", "Sub"):
            (al, ah), (bl, bh) = ops = self.interval(t.args[0], L), self.interval(t.args[1], L)
            if op == "Add":
                return _exact(L, f"({al} + {bl})", f"({ah} + {bh})", ops)
            return _exact(L, f"({al} - {bh})", f"({ah} - {bl})", ops)
        if op in ("Max2", "Min2"):   # monotone in both arguments
            (al, ah), (bl, bh) = ops = self.interval(t.args[0], L), self.interval(t.args[1], L)
            fn = "tl.maximum" if op == "Max2" else "tl.minimum"
            return _exact(L, f"{fn}({al}, {bl})", f"{fn}({ah}, {bh})", ops)
        if op == "Mul":
            (al, ah), (bl, bh) = ops = self.interval(t.args[0], L), self.interval(t.args[1], L)
            n = len(L)
            L.append(f"iv{n}a = {al} * {bl}")
            L.append(f"iv{n}b = {al} * {bh}")
            L.append(f"iv{n}c = {ah} * {bl}")
            L.append(f"iv{n}d = {ah} * {bh}")
            return _exact(L, f"tl.minimum(tl.minimum(iv{n}a, iv{n}b), tl.minimum(iv{n}c, iv{n}d))",
                          f"tl.maximum(tl.maximum(iv{n}a, iv{n}b), tl.maximum(iv{n}c, iv{n}d))", ops)
        if op == "Abs":
            lo, hi = self.interval(t.args[0], L)
            return _exact(L, f"tl.where({lo} >= 0, {lo}, tl.where({hi} <= 0, -{hi}, 0.0))",
                          f"tl.maximum(tl.abs({lo}), tl.abs({hi}))", [(lo, hi)])
        if op in ("FloorDiv", "Mod"):
            # by a positive constant c, in int64 from exact operand bounds: // is monotone;
            # % is [lo % c, hi % c] within one period (lo // c == hi // c), else [0, c - 1]
            lo, hi = self.interval(t.args[0], L)
            c = int(float(t.args[1].args[0]))
            lo, hi = _exact(L, lo, hi)   # exact integers, or infinite (then the result is too)
            n = len(L)
            L.append(f"iv{n}ok = {lo} > {_WIDE[0]}")
            L.append(f"iv{n}a = tl.where(iv{n}ok, {lo}, 0.0).to(tl.int64)")
            L.append(f"iv{n}b = tl.where(iv{n}ok, {hi}, 0.0).to(tl.int64)")
            qa, qb = _floor_div(L, f"iv{n}qa", f"iv{n}a", c), _floor_div(L, f"iv{n}qb", f"iv{n}b", c)
            if op == "FloorDiv":
                rl, rh = f"{qa}.to(tl.float32)", f"{qb}.to(tl.float32)"
            else:
                L.append(f"iv{n}s = {qa} == {qb}")
                rl = f"tl.where(iv{n}s, iv{n}a - {qa} * {c}, 0).to(tl.float32)"
                rh = f"tl.where(iv{n}s, iv{n}b - {qa} * {c}, {c - 1}).to(tl.float32)"
            return _exact(L, f"tl.where(iv{n}ok, {rl}, {_WIDE[0]})", f"tl.where(iv{n}ok, {rh}, {_WIDE[1]})")
        if op == "Take":
            return self._lookup_interval(t, L)
        if op == "In":   # a scalar input (_interval_ok): loaded as the kernel loads it
            v = f"tl.load({t.args[0]}_ptr).to(tl.float32)"
            return v, v
        raise CodegenError(f"interval of {op}")

    def _lookup_interval(self, t: Term, L: list):
        """[min, max] of the values a lookup reads over the tile (every key tile of the scan
        step, or the row tile), as float32 like the kernel's reads; (-inf, inf) where a
        position is out of the tensor (the kernel reads NaN there)."""
        name, idx, ax = t.args
        a = idx.args[0]
        n = len(L)
        base = f"{name}_ptr + off_{name}_g"
        if a == _loop(self):
            L.append(f"iv{n}p = {SCAN_KEYS}")
            L.append(f"iv{n}in = (iv{n}p * 1.0 <= j_hi[:, None]) & valid[:, None]")
            red = 1
        else:   # the row tile's values (``ROWS_OF_ANALYSIS``: another row range's names)
            pre = self.ROWS_OF_ANALYSIS
            L.append(f"iv{n}p = {pre}idx_{a}")   # (a row axis: _lookup_ok)
            L.append(f"iv{n}in = {pre}rmask")
            red = 0
        L.append(f"iv{n}ok = iv{n}in & (iv{n}p < len_{ax})")
        L.append(f"iv{n}x = tl.load({base} + tl.where(iv{n}ok, iv{n}p, 0) * s_{name}_{ax}, mask=iv{n}ok, "
                 "other=0).to(tl.float32)")
        L.append(f"iv{n}bad = tl.max((iv{n}in & (iv{n}p >= len_{ax})).to(tl.int32), axis={red}) > 0")
        return (f"tl.where(iv{n}bad, float('-inf'), tl.min(tl.where(iv{n}ok, iv{n}x, float('inf')), axis={red}))",
                f"tl.where(iv{n}bad, float('inf'), tl.max(tl.where(iv{n}ok, iv{n}x, float('-inf')), axis={red}))")

    def truth(self, c: Term, L: list):
        """(always_true, always_false) booleans of a condition over each tile box; an atom
        interval arithmetic cannot bound is neither."""
        op = c.op
        if op in ("LAnd", "LOr"):
            (at, af), (bt, bf) = self.truth(c.args[0], L), self.truth(c.args[1], L)
            if op == "LAnd":
                return f"({at} & {bt})", f"({af} | {bf})"
            return f"({at} | {bt})", f"({af} & {bf})"
        if op == "LNot":
            t_, f_ = self.truth(c.args[0], L)
            return f_, t_
        if op in _CMPS and _atom_ok(self, c):
            a, b = c.args
            if op in ("CmpGt", "CmpGe"):
                a, b = b, a
            mark = len(L)
            (al, ah), (bl, bh) = self.interval(a, L), self.interval(b, L)
            # a lookup out of range reads NaN: a comparison with it is false (!= true), whatever
            # the interval says; such boxes are never called always-true (always-false for !=)
            nan = [x.split(" = ")[0] for x in L[mark:] if x.split(" = ")[0].endswith("bad")]
            at, af = _cmp_truth(op, al, ah, bl, bh)
            if nan:
                nv = " | ".join(nan)
                if op == "CmpNe":
                    af = f"tl.where({nv}, False, {af})"
                else:
                    at = f"tl.where({nv}, False, {at})"
            return at, af
        return UNKNOWN, UNKNOWN



# ---- the analysis outside a kernel: tile statistics and soundness checks ----------------------------
class _Arr(np.ndarray):
    """A numpy array with Triton's ``.to(dtype)`` (the shim below)."""

    def to(self, dtype):
        return np.asarray(self).astype(dtype).view(_Arr)


class _NumpyTL:
    """The ``tl`` functions interval()/truth() emit, on numpy arrays. Pointers are offsets:
    tensor number ``k`` starts at ``k * _SPAN`` (``tile_truth``'s ``data``)."""
    minimum, maximum, floor, abs = np.minimum, np.maximum, np.floor, np.abs
    float32, int32, int64 = np.float32, np.int32, np.int64
    data: list = []

    @staticmethod
    def where(c, a, b):
        return np.asarray(np.where(c, a, b)).view(_Arr)

    @staticmethod
    def arange(a, b):
        return np.arange(a, b).view(_Arr)

    @staticmethod
    def min(x, axis):
        return np.min(x, axis=axis).view(_Arr)

    @staticmethod
    def max(x, axis):
        return np.max(x, axis=axis).view(_Arr)

    @classmethod
    def load(cls, off, mask=True, other=0.0):
        off = np.asarray(off)
        k = int(off.flat[0]) // _SPAN
        arr = cls.data[k]
        return np.where(mask, arr[np.where(mask, off - k * _SPAN, 0)], other).view(_Arr)


_SPAN = 1 << 40


def tile_truth(gen, cond: Term, env: dict, starts, block_j: int, n_j: int, data=None):
    """(always_true, always_false) of ``cond`` for the key tiles starting at ``starts``,
    evaluated from the very expressions the kernel runs (interval()/truth()), with numpy.
    ``env`` holds the row tile's ``{a}_lo``/``{a}_hi``, ``idx_{a}`` (and ``rmask``) and
    ``len_{a}`` values; ``data`` maps a looked-up tensor's name to its 1-D values along the
    looked-up axis (for one batch/head)."""
    L: list = []
    t_, f_ = gen.truth(cond, L)
    data = {n: v for n, v in (data or {}).items() if n in gen.tensors}
    start = np.asarray(starts, dtype=np.int64).view(_Arr)
    tl = type("tl", (_NumpyTL,), {"data": [np.asarray(v, dtype=np.float64) for v in data.values()]})
    env = {k: (np.asarray(v).view(_Arr) if isinstance(v, np.ndarray) else v) for k, v in env.items()}
    ns = dict(env, tl=tl, start=start, j_lo=start * 1.0, valid=start < n_j, BLOCK_J=block_j,
              j_hi=(np.minimum(start + block_j, n_j) - 1) * 1.0, nj_f=float(n_j))
    for k, name in enumerate(data):
        ns[f"{name}_ptr"] = k * _SPAN
        ns[f"off_{name}_g"] = 0
        ns.update({f"s_{name}_{a}": 1 for a in gen.tensors[name]})
    for line in L:
        exec(line, {}, ns)   # noqa: S102 - our own generated arithmetic, as in the kernel
    return np.broadcast_to(eval(t_, {}, ns), start.shape), np.broadcast_to(eval(f_, {}, ns), start.shape)  # noqa: S307


def tile_stats(fusion, sizes: dict, block_i: int = 32, block_j: int = 16, data=None) -> dict:
    """How the mask analysis treats the (row tile, key tile) pairs of an attention-shaped
    program with one query axis: ``{"skipped": fraction, "full": fraction, "tiles": n}``.
    Skipped tiles are never visited; full ones run without mask arithmetic. ``data``: the
    values of looked-up tensors (``tile_truth``) for the first batch/head."""
    from acefuse.codegen.contraction import ContractionGen
    gen = ContractionGen(fusion)
    gen.p = fusion.passes[0]
    sites = gen.mask_sites()
    n_j = sizes[gen.axis]
    starts = np.arange(0, n_j, block_j)
    if len(gen.R) != 1:
        raise ValueError(f"tile_stats: one query axis expected, got {gen.R}")
    r = gen.R[0]
    n_i = sizes[r]
    skip_ok = bool(sites) and gen.skip_is_sound(gen.p, gen.site_values(sites))
    skipped = full = total = 0
    for i0 in range(0, n_i, block_i):
        rows = np.arange(i0, i0 + block_i)
        env = {f"{r}_lo": float(i0), f"{r}_hi": float(min(i0 + block_i, n_i) - 1),
               f"idx_{r}": rows.view(_Arr), "rmask": rows < n_i}
        env.update({f"len_{a}": sizes.get(a, 1) for a in _len_axes(gen)})
        env.update({f"idx_{a}": 0 for a in gen.G})
        tr = np.ones(len(starts), bool)
        fa = np.zeros(len(starts), bool)
        for _, c in sites:
            t_, f_ = tile_truth(gen, c, env, starts, block_j, n_j, data)
            tr &= t_
            fa |= f_
        total += len(starts)
        skipped += int(fa.sum()) if skip_ok else 0
        full += int((tr & ~fa).sum()) if sites else len(starts)
    return {"skipped": skipped / total, "full": full / total, "tiles": total}
