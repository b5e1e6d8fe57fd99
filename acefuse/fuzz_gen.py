"""The fuzzer's generator of cascaded programs, their Python text (reproducers) and the
adversarial inputs. Split out of acefuse/fuzz.py."""
from __future__ import annotations

import math
import random

import torch

import acefuse as af
from acefuse.fuzz_ref import *  # noqa: F401,F403 - the node constructors and constants
from acefuse.fuzz_ref import _NoNode, _uses

# ---- the generator -------------------------------------------------------------------------------
class Gen:
    """Random cascaded programs over x ("r j") and optionally w ("j" or "r j")."""

    def __init__(self, rng: random.Random, w_axes=None):
        self.rng = rng
        self.x = inp("x", "rj")
        self.w = inp("w", w_axes) if w_axes else None
        self.w_axes = w_axes

    def pick(self, options):
        """options: [(weight, thunk)]; call thunks until one returns a node."""
        opts = [o for o in options if o[0] > 0]
        while opts:
            tot = sum(w for w, _ in opts)
            r = self.rng.random() * tot
            for i, (w, f) in enumerate(opts):
                r -= w
                if r <= 0:
                    break
            try:
                out = f()
            except _NoNode:
                out = None
            if out is not None and abs(out.lo) < OVERFLOW and abs(out.hi) < OVERFLOW:
                return out
            opts.pop(i)
        return None

    def leaf(self, minf=False):
        rng = self.rng
        x = self.x
        opts = [(4, lambda: x),
                (1, lambda: add(x, mul(const(rng.choice([0.01, -0.05, 0.5])), index_j()))),
                (1, lambda: mul(x, const(rng.choice([0.5, -2.0, 3.0]))))]
        if self.w is not None:
            opts += [(2, lambda: self.w), (1, lambda: mul(x, self.w)), (1, lambda: add(x, self.w))]
        if minf:
            opts += [(3, lambda: self.mask(self.leaf(False)))]
        return self.pick(opts)

    def mask(self, e):
        """where(index(j) < k, e, -inf) style masks (several tiles at start/middle/end)."""
        rng = self.rng
        k = rng.choice([0, 1, 5, 16, 17, 33, 40, 64, 100])
        i = index_j()
        ninf = const(-math.inf)
        ninf.lo = ninf.hi = -math.inf
        kind = rng.random()
        if kind < 0.4:
            m = where("<", i, const(float(k)), e, ninf)
        elif kind < 0.7:
            m = where(">=", i, const(float(k)), e, ninf)
        else:  # a masked band in the middle
            k2 = k + rng.choice([16, 20, 40])
            m = where("<", i, const(float(k)), e, where(">=", i, const(float(k2)), e, ninf))
        m.minf = True
        m.lo = e.lo
        return m

    def shifted(self, depth, minf=True):
        """e - max_j e (<= 0) or min_j e - e (<= 0)."""
        e = self.elem(depth - 1, minf=minf)
        if e is None:
            return None
        if self.rng.random() < 0.8 or e.minf:
            s = sub(e, reduce("max", e))
        else:
            s = sub(reduce("min", e), e)
        s.hi = 0.0
        s.lo = max(s.lo, -2 * BOUND * 10)
        s.minf = e.minf
        return s

    def expshift(self, depth, minf=True):
        s = self.shifted(depth, minf)
        if s is None:
            return None
        p = exp(s)
        p.lo, p.hi = 0.0, 1.0
        return p

    def sumexp(self, p):
        l = reduce("sum", p)
        l.arg = "expshift"
        l.lo = 1.0   # >= 1 unless the row is fully masked (then the numerators vanish too)
        return l

    def elem(self, depth, minf=False):
        """An expression elementwise over (r, j)."""
        rng = self.rng
        if depth <= 0:
            return self.leaf(minf)
        d = depth - 1
        opts = [
            (3, lambda: self.leaf(minf)),
            (1, lambda: abs_(self.elem(d))),
            (1, lambda: tanh(self.elem(d))),
            (0.5, lambda: neg(self.elem(d))),
            (1, lambda: mul(const(rng.choice([0.5, 2.0, -1.5])), self.elem(d))),
            (1, lambda: pow_(self.elem(d), rng.choice([2, 3]))),
            (1, lambda: add(self.elem(d), self.elem(d))),
            (1, lambda: mul(self.elem(d), tanh(self.elem(d)))),
            (0.5, lambda: maximum(self.elem(d), const(0.0))),
            (3, lambda: self.expshift(depth)),                                   # exp(e - max_j e)
            (3, lambda: self.normalized(depth)),                                 # softmax-like
            (2, lambda: self.centred(depth)),                                    # e - mean_j e
            (1, lambda: self.standardized(depth)),                               # layernorm-like
            (2, lambda: self.thresholded(depth)),                                # where(e > red_j e, e, 0)
            (1, lambda: mul(self.elem(d), self.row(d))),                         # broadcast per-row
            (1, lambda: add(self.elem(d), self.row(d))),
            (1, lambda: exp(neg(abs_(self.elem(d))))),
        ]
        if minf:
            opts.append((2, lambda: self.mask(self.elem(d))))
        return self.pick(opts)

    def normalized(self, depth):
        p = self.expshift(depth, minf=True)
        if p is None:
            return None
        l = self.sumexp(p)
        y = div(p, l)
        y.lo, y.hi = 0.0, 1.0
        return y

    def centred(self, depth):
        e = self.elem(depth - 1)
        return None if e is None else sub(e, mean(e))

    def variance(self, depth, c=None):
        c = c or self.centred(depth)
        return None if c is None else mean(pow_(c, 2))

    def standardized(self, depth):
        e = self.elem(depth - 1)
        if e is None:
            return None
        c = sub(e, mean(e))
        return div(c, sqrt(add(mean(pow_(c, 2)), const(1e-5))))

    def thresholded(self, depth):
        rng = self.rng
        e = self.elem(depth - 1)
        if e is None:
            return None
        r = rng.choice([lambda: mean(e), lambda: reduce("max", e), lambda: reduce("min", e),
                        lambda: mul(const(0.5), reduce("max", e))])()
        other = rng.choice([lambda: const(0.0), lambda: self.elem(depth - 2), lambda: e])()
        if other is None:
            return None
        cmp = rng.choice(list(CMPS))
        return where(cmp, e, r, e, other) if rng.random() < 0.7 else where(cmp, e, r, other, e)

    def row(self, depth):
        """An expression with one value per row (reductions over j, cascaded)."""
        rng = self.rng
        d = max(depth - 1, 0)
        deeper = 1 if depth > 0 else 0
        opts = [
            (2, lambda: reduce("sum", self.elem(d))),
            (2, lambda: mean(self.elem(d))),
            (1, lambda: reduce("max", self.elem(d, minf=True))),
            (1, lambda: reduce("min", self.elem(d))),
            (3, lambda: self.logsumexp(depth)),
            (2, lambda: self.variance(depth)),
            (1, lambda: sqrt(add(self.variance(depth), const(1e-5)))),
            (1, lambda: self.moment(depth, rng.choice([3, 4]))),
            (2, lambda: self.weighted(depth)),
            (2, lambda: reduce(rng.choice(["sum", "max", "min"]), self.elem(depth))),   # cascaded body
            (deeper, lambda: log(add(abs_(self.row(d)), const(1.0)))),
            (deeper, lambda: add(self.row(d), self.row(d))),
            (1, lambda: reduce("sum", self.thresholded(depth))),
        ]
        return self.pick([(w, f) for w, f in opts])

    def logsumexp(self, depth):
        e = self.elem(depth - 1, minf=True)
        if e is None:
            return None
        m = reduce("max", e)
        s = sub(e, m)
        s.hi, s.minf = 0.0, e.minf
        p = exp(s)
        p.lo, p.hi = 0.0, 1.0
        return add(m, log(self.sumexp(p)))

    def moment(self, depth, k):
        c = self.centred(depth)
        if c is None:
            return None
        mk = mean(pow_(c, k))
        if k == 4 and self.rng.random() < 0.5:   # kurtosis-like: m4 / (var + eps)^2
            v = add(mean(pow_(c, 2)), const(1e-5))
            return div(mk, mul(v, v))
        return mk

    def weighted(self, depth):
        """sum_j exp(s) v / sum_j exp(s): a normalised weighted sum (attention-like)."""
        p = self.expshift(depth, minf=True)
        v = self.elem(depth - 1)
        if p is None or v is None:
            return None
        num = reduce("sum", mul(p, v))
        return div(num, self.sumexp(p))

    def program(self, depth=3, n_out=None):
        rng = self.rng
        n_out = n_out or rng.choice([1, 1, 2, 2, 3])
        outs = {}
        tries = 0
        while len(outs) < n_out and tries < 20:
            tries += 1
            nd = self.row(depth) if rng.random() < 0.5 else self.elem(depth)
            if nd is None or not nd.red or not _uses(nd, "x"):
                continue
            if nd.minf and nd.shape == "rj":
                continue   # a masked elementwise output is -inf by design; not interesting
            outs[f"o{len(outs)}"] = nd
        return outs


# ---- program text (reproducers) ---------------------------------------------------------------
_FMT = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
        "neg": "-{0}", "exp": "af.exp({0})", "log": "af.log({0})", "sqrt": "af.sqrt({0})",
        "abs": "af.abs({0})", "tanh": "af.tanh({0})", "max2": "af.maximum({0}, {1})",
        "sum": 'af.sum({0}, "j")', "max": 'af.max({0}, "j")', "min": 'af.min({0}, "j")'}


def program_text(outputs: dict, w_axes=None, name="fz") -> str:
    """Python source that rebuilds the program (shared subexpressions named t1, t2, ...)."""
    uses: dict = {}
    order: list = []

    def visit(n):
        uses[n.uid] = uses.get(n.uid, 0) + 1
        if uses[n.uid] > 1:
            return
        for k in n.kids:
            visit(k)
        order.append(n)

    for n in outputs.values():
        visit(n)
    names: dict = {}
    lines = ["import acefuse as af", "import math", 'x = af.tensor("x", "r j")']
    if w_axes:
        lines.append(f'w = af.tensor("w", "{"r j" if w_axes == "rj" else "j"}")')

    def expr(n, top=False):
        if n.uid in names and not top:
            return names[n.uid]
        if n.op == "in":
            return n.arg
        if n.op == "const":
            return "af.NEG_INF" if n.arg == -math.inf else ("math.inf" if n.arg == math.inf else repr(n.arg))
        if n.op in ("index", "size"):
            return n.text
        ks = [expr(k) for k in n.kids]
        if n.op == "pow":
            return f"({ks[0]}) ** {n.arg}" if _needs_parens(n.kids[0], names) or n.kids[0].op == "const" else f"{ks[0]} ** {n.arg}"
        if n.op == "where":
            return f"af.where({ks[0]} {n.arg} {ks[1]}, {ks[2]}, {ks[3]})"
        if n.op in ("add", "sub", "mul", "div", "neg"):
            ks = [f"({s})" if _needs_parens(k, names) else s for k, s in zip(n.kids, ks)]
        return _FMT[n.op].format(*ks)

    for n in order:
        if uses[n.uid] > 1 and not n.leaf:
            names[n.uid] = f"t{len(names) + 1}"
            lines.append(f"{names[n.uid]} = {expr(n, top=True)}")
    outs = ", ".join(f"{k}={expr(v)}" for k, v in outputs.items())
    lines.append(f'prog = af.program("{name}", {outs})')
    return "\n".join(lines)


def _needs_parens(k: N, names: dict) -> bool:
    if k.uid in names:
        return False
    return k.op in ("add", "sub", "mul", "div", "neg", "pow") or (k.op == "const" and k.arg < 0)


# ---- adversarial inputs ----------------------------------------------------------------------
KINDS = ("normal", "near_m100", "near_m1e4", "offset_1e4", "spread_1e4", "masked_tiles",
         "infs", "subnormal", "zeros")


def make_inputs(kind: str, R: int, J: int, dtype: str, seed: int, w_axes=None) -> dict:
    """The inputs of one case, reproducible from (kind, R, J, dtype, seed, w_axes)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def base(shape):
        z = torch.randn(shape, generator=g, dtype=torch.float64)
        if kind == "near_m100":
            return -100.0 + z
        if kind == "near_m1e4":
            return -1e4 + 3 * z
        if kind == "offset_1e4":
            return 1e4 + z
        if kind == "spread_1e4":
            return 1e4 / 3 * z
        if kind == "subnormal":
            tiny = 1e-6 if dtype == "float16" else 1e-40
            return torch.where(torch.rand(shape, generator=g) < 0.5, z * tiny, z)
        if kind == "zeros":
            return torch.where(torch.rand(shape, generator=g) < 0.5, torch.zeros_like(z), z)
        return z * rng.choice([1.0, 3.0])

    x = base((R, J))
    if kind == "masked_tiles":
        for r in range(R):
            what = rng.choice(["start", "middle", "end", "all", "start_end", "none"])
            runs = []
            if what in ("start", "start_end"):
                runs.append((0, rng.randint(16, max(16, J))))
            if what in ("end", "start_end"):
                runs.append((max(0, J - rng.randint(16, 48)), J))
            if what == "middle":
                a = rng.randint(0, max(0, J - 16))
                runs.append((a, a + rng.randint(16, 40)))
            if what == "all":
                runs.append((0, J))
            for a, b in runs:
                x[r, a:b] = -math.inf
    if kind == "infs":
        n = max(1, (R * J) // 40)
        for _ in range(n):
            x[rng.randrange(R), rng.randrange(J)] = rng.choice([math.inf, -math.inf, -math.inf])
    if kind == "zeros" and R > 1:
        x[rng.randrange(R)] = 0.0
    out = {"x": x.to(DTYPES[dtype])}
    if w_axes:
        wk = torch.randn((R, J) if w_axes == "rj" else (J,), generator=g, dtype=torch.float64)
        if kind == "zeros":
            wk = torch.where(torch.rand(wk.shape, generator=g) < 0.5, torch.zeros_like(wk), wk)
        out["w"] = wk.to(DTYPES[dtype])
    return out
