"""Numeric stress evaluation of an e-graph: the numerics term of the cost model.

All nodes of an e-class denote the same real value, so a class has one value on
a given input. We evaluate every class once, in float64, on a sampled *stress
input* (``cost.STRESS``): ``ROWS`` independent rows; the reduced axis holds the
elements of block A followed by those of block B (a few elements each, so that
block-local means differ visibly); every element-dependent leaf (``Elm``) is
``OFFSET + N(0, 1)`` (a large common offset, the regime where raw moments
cancel), every per-row leaf (``Par``) is ``U(0.5, 2)``, a count is its block's
size. An element-dependent class has a value per element (an array over the
elements of A u B); an invariant class has one value per row.

Then, for every ``Add`` / ``Sub`` node whose two operands both *carry rounding
error*, the bits lost to cancellation are

    log2(max(|a|, |b|) / |a +- b|)       (0 when nothing cancels, at most BITS_CAP)

averaged over rows and elements. An operand is *error-free* when its class can
be formed without rounding: a constant, a leaf (an input element, a per-row
value, a count), or a max / min / negation / absolute value of error-free
operands, or a ``where`` choosing between error-free operands (max, min and a select
return one of their operands exactly, so ``m_A - m_AB``
in softmax amplifies no earlier error). Every other class (an accumulated sum,
a mean, a product) carries the rounding error of its computation, and
cancellation turns that small relative error into a large one.
"""
from __future__ import annotations

import zlib

import numpy as np

from acefuse.extract import cost as C

_EXACT_OPS = ("Max2", "Min2", "Neg", "Abs", "RMax", "RMin")


def _rng(name: str, salt: int = 0):
    return np.random.default_rng(zlib.crc32(name.encode()) + 7919 * salt + C.STRESS["seed"])


class Stress:
    """Class values on the stress input, error-free classes, and per-node cancellation bits."""

    def __init__(self, ex):
        self.ex = ex
        st = C.STRESS
        self.rows = st["rows"]
        self.na, self.nb = st["block_a"], st["block_b"]
        n = self.na + self.nb
        self.cols = {"A": slice(0, self.na), "B": slice(self.na, n), "AB": slice(0, n), "J": slice(0, n)}
        self.size = {"A": self.na, "B": self.nb, "AB": n, "J": n}
        self.values: dict = {}
        self.exact: set = set()
        self.bits: dict = {}   # node id -> bits lost (Add/Sub of two error-carrying operands)
        self._evaluate()
        self._exactness()
        self._cancellation()

    # -- leaves -------------------------------------------------------------------------------
    def _leaf(self, op, nid, ch):
        ex, st = self.ex, C.STRESS
        if op == "Num":
            v = ex.payload(ch[0])
            return np.full((self.rows, 1), float(v)) if isinstance(v, float) else None
        if op == "Par":
            return _rng("par:" + str(ex.payload(ch[0]))).uniform(*st["par"], size=(self.rows, 1))
        if op == "Elm":
            na = self.na + self.nb
            return st["offset"] + _rng("elm:" + str(ex.payload(ch[0]))).standard_normal((self.rows, na))
        if op == "Cnt":
            b = ex.blk.get(ex.cls(ch[0]))
            return np.full((self.rows, 1), float(self.size[b])) if b in self.size else None
        if op == "St" and ex.blk.get(ex.cls(ch[1])) == "J":
            # a state finished in an earlier pass: an opaque per-row value
            return _rng("fin:" + str(ex.payload(ch[0]))).uniform(*st["par"], size=(self.rows, 1))
        return None

    def _node(self, nid):
        ex = self.ex
        n = ex.nodes[nid]
        op, ch = n["op"], n["children"]
        if op in ("Num", "Par", "Elm", "Cnt", "St"):
            return self._leaf(op, nid, ch)
        if op in ("Sum", "RMax", "RMin"):
            b = ex.blk.get(ex.cls(ch[0]))
            body = self.values.get(ex.cls(ch[1]))
            if b not in self.cols or body is None:
                return None
            body = np.broadcast_to(body, (self.rows, self.na + self.nb))[:, self.cols[b]]
            f = {"Sum": np.sum, "RMax": np.max, "RMin": np.min}[op]
            return f(body, axis=1, keepdims=True)
        if op == "Pow":
            a = self.values.get(ex.cls(ch[0]))
            p = ex.payload(ch[1])
            return None if a is None or not isinstance(p, float) else np.power(a, p)
        fn = _FN.get(op)
        if fn is None:
            return None
        args = [self.values.get(ex.cls(c)) for c in ch]
        if any(a is None for a in args):
            return None
        return fn(*args)

    def _evaluate(self):
        """Worklist: a class takes the value of the first node that evaluates; a finite
        value replaces a non-finite one (forms that overflow on the way)."""
        ex = self.ex
        parents: dict = {}
        for cid, nids in ex.cls_nodes.items():
            for nid in nids:
                for c in ex.nodes[nid]["children"]:
                    parents.setdefault(ex.cls(c), []).append(nid)
        work = [nid for nids in ex.cls_nodes.values() for nid in nids if ex._is_term(nid)]
        seen_final: set = set()
        with np.errstate(all="ignore"):
            while work:
                nid = work.pop()
                cid = ex.cls(nid)
                if cid in seen_final or not ex._is_term(nid):
                    continue
                v = self._node(nid)
                if v is None:
                    continue
                v = np.asarray(v, dtype=float)
                old = self.values.get(cid)
                fin = bool(np.all(np.isfinite(v)))
                if old is None or (fin and not np.all(np.isfinite(old))):
                    self.values[cid] = v
                    if fin:
                        seen_final.add(cid)
                    work.extend(parents.get(cid, ()))

    def _exactness(self):
        ex = self.ex
        changed = True
        while changed:
            changed = False
            for cid, nids in ex.cls_nodes.items():
                if cid in self.exact:
                    continue
                for nid in nids:
                    n = ex.nodes[nid]
                    op = n["op"]
                    if op in ("Num", "Par", "Elm", "Cnt"):
                        ok = True
                    elif op == "Where":   # a select returns one of its value operands exactly
                        ok = all(ex.cls(c) in self.exact for c in n["children"][1:])
                    elif op in _EXACT_OPS:
                        ok = all(ex.cls(c) in self.exact or not ex._is_term(c)
                                 or ex.nodes[c]["op"] in ("BA", "BB", "BU", "BJ") for c in n["children"])
                    else:
                        ok = False
                    if ok:
                        self.exact.add(cid)
                        changed = True
                        break

    def _cancellation(self):
        ex = self.ex
        with np.errstate(all="ignore"):
            for cid, nids in ex.cls_nodes.items():
                for nid in nids:
                    n = ex.nodes[nid]
                    if n["op"] not in ("Add", "Sub"):
                        continue
                    a, b = (ex.cls(c) for c in n["children"])
                    if a in self.exact or b in self.exact:
                        continue
                    va, vb = self.values.get(a), self.values.get(b)
                    if va is None or vb is None:
                        continue
                    r = va + vb if n["op"] == "Add" else va - vb
                    big = np.maximum(np.abs(va), np.abs(vb))
                    ok = np.isfinite(r) & np.isfinite(big)
                    if not np.any(ok):
                        continue
                    lost = np.where(np.abs(r) > 0, np.log2(big / np.where(r == 0, 1.0, np.abs(r))), C.BITS_CAP)
                    lost = np.clip(np.where(ok, lost, 0.0), 0.0, C.BITS_CAP)
                    bits = float(np.mean(np.broadcast_to(lost, np.broadcast_shapes(lost.shape, (1, 1)))))
                    if bits > 1e-9:
                        self.bits[nid] = bits


def _where(c, a, b):
    return np.where(c != 0, a, b)


_FN = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Neg": np.negative,
    "Exp": np.exp, "Log": np.log, "Sqrt": np.sqrt, "Rsqrt": lambda a: 1.0 / np.sqrt(a),
    "Abs": np.abs, "Tanh": np.tanh, "Max2": np.maximum, "Min2": np.minimum, "Where": _where,
    "CmpLt": lambda a, b: (a < b).astype(float), "CmpLe": lambda a, b: (a <= b).astype(float),
    "CmpGt": lambda a, b: (a > b).astype(float), "CmpGe": lambda a, b: (a >= b).astype(float),
    "CmpEq": lambda a, b: (a == b).astype(float), "CmpNe": lambda a, b: (a != b).astype(float),
    "LAnd": lambda a, b: ((a != 0) & (b != 0)).astype(float),
    "LOr": lambda a, b: ((a != 0) | (b != 0)).astype(float),
    "LNot": lambda a: (a == 0).astype(float),
}

__all__ = ["Stress", "output_cancellation", "cancellation_text"]


# ---- the program as written: cancellation in the outputs ------------------------------------
NOTE_BITS = 8.0   # report an output subtraction that loses at least this many bits


def output_cancellation(enc) -> list:
    """Subtractions in the program's outputs (as the user wrote them) that cancel on the
    stress input: ``[(output, subterm, bits lost), ...]``, worst first.

    The finalize and epilogue expressions are not searched by the e-graph (they are what
    the user asked for), so a form like ``mean(x*x) - mean(x)**2`` fuses as written; this
    says how many of a float32 significand's bits it loses when ``|mean| >> spread``."""
    from acefuse.rewrite.terms import pretty
    st = C.STRESS
    rows, n = st["rows"], st["block_a"] + st["block_b"]
    defs = {s.name: s for s in enc.states}
    memo: dict = {}

    def leaf_vec(kind, name):
        if kind == "Elm":
            return st["offset"] + _rng("elm:" + name).standard_normal((rows, n))
        return _rng("par:" + name).uniform(*st["par"], size=(rows, 1))

    def state(q):
        if q not in memo:
            memo[q] = ev(defs[q].definition)
        return memo[q]

    def exact(t) -> bool:
        if t.op in ("Num", "Par", "Elm", "Cnt", "In", "Size", "Idx", "Take"):
            return True
        if t.op == "St":
            return defs[t.args[0]].op in ("max", "min") if t.args[0] in defs else False
        if t.op in _EXACT_OPS:
            return all(exact(c) for c in t.children if c.op not in ("BA", "BB", "BU", "BJ", "Ax"))
        return False

    def ev(t):
        op = t.op
        if op == "Num":
            return np.full((rows, 1), float(t.args[0]))
        if op in ("Elm", "Par"):
            src = enc.leaves.get(t.args[0])
            return ev(src) if src is not None and src.op != "In" else leaf_vec(op, t.args[0])
        if op == "St":
            return state(t.args[0])
        if op in ("Cnt", "Size"):
            return np.full((rows, 1), float(n))
        if op == "Idx":
            return np.broadcast_to(np.arange(n, dtype=float), (rows, n))
        if op == "In":
            return leaf_vec("Elm" if enc.axis in enc.tensors.get(t.args[0], ()) else "Par", t.args[0])
        if op == "Take":
            return st["offset"] + _rng("take:" + t.args[0]).standard_normal((rows, 1))
        if op in ("Sum", "RMax", "RMin"):
            body = np.broadcast_to(ev(t.args[1]), (rows, n))
            return {"Sum": np.sum, "RMax": np.max, "RMin": np.min}[op](body, axis=1, keepdims=True)
        if op == "Pow":
            return np.power(ev(t.args[0]), t.args[1])
        fn = _FN.get(op)
        if fn is None:
            raise KeyError(op)
        return fn(*(ev(c) for c in t.children))

    notes = []
    with np.errstate(all="ignore"):
        for out, term in enc.outputs.items():
            for sub in term.walk():
                if sub.op not in ("Add", "Sub") or any(exact(c) for c in sub.children):
                    continue
                try:
                    a, b = (ev(c) for c in sub.children)
                except KeyError:
                    continue
                r = a + b if sub.op == "Add" else a - b
                big = np.maximum(np.abs(a), np.abs(b))
                lost = np.where(np.abs(r) > 0, np.log2(big / np.where(r == 0, 1.0, np.abs(r))), C.BITS_CAP)
                lost = np.clip(np.where(np.isfinite(lost), lost, 0.0), 0.0, C.BITS_CAP)
                bits = float(np.mean(lost))
                if bits >= NOTE_BITS:
                    notes.append((out, pretty(sub).replace("_J", ""), bits))
    return sorted(notes, key=lambda x: -x[2])


def cancellation_text(enc) -> list:
    """``output_cancellation`` as explanation lines (empty when nothing cancels)."""
    return [f"  numerics: {out}: `{sub}` loses about {bits:.0f} of 24 float32 significand bits to "
            f"cancellation when the data has a large common offset (|mean| >> spread); "
            f"subtract the offset inside the reduction instead (e.g. reduce (x - mean) rather than x)"
            for out, sub, bits in output_cancellation(enc)]
