"""Certificates for derived updates and merges.

The rewrite system derives, for a state ``q`` of a cascaded reduction, an
expression for ``St(q, A u B)`` from the parts (``St(p, A)``, ``St(p, B)``, the
raw tile ``B``, counts and per-row parameters). ``certify`` checks one such
claim against the *definitions* of the states, independently of the rules that
derived it:

* symbolically: on blocks of several sizes (``|A|, |B|`` in ``sizes``), both
  sides are built from the definitions (``St(q, X)`` is ``q``'s definition with
  the placeholder block ``BA`` replaced by ``X``, evaluated on the elements of
  ``X``; definitions may refer to earlier states on the same block), and the
  difference must simplify to 0 (max/min by case splits over which element is
  the extreme one, see decide.py);
* numerically: float64 on random blocks (sizes 1 and odd sizes included,
  values up to ~50 in magnitude), relative tolerance 1e-9.

    >>> from acefuse.rewrite.terms import A, B, U, st, elm, rmax, max2
    >>> m = StateDef("m", "max", rmax(A, elm("x")))
    >>> certify([m], "m", max2(st("m", A), st("m", B))).status
    'certified'
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import mpmath
import numpy as np
import sympy as sp

from acefuse.rewrite.terms import Term, A as BLK_A, B as BLK_B, U, substitute
from acefuse.proofs import decide
from acefuse.proofs.semantics import (SympyBackend, MpBackend, FloatBackend, evaluate, mp_context,
                                      Undefined)

FLOAT_RTOL = 1e-9
FLOAT_TRIALS = 200
_AB = U(BLK_A, BLK_B)
_FLOAT_SIZES = (1, 1, 2, 3, 5, 7, 8, 13)


@dataclass(frozen=True)
class StateDef:
    """A state of a fused reduction: ``definition`` is a term over the placeholder block ``BA``.

    op: "sum" | "max" | "min" (a reduction) or "ref" (a value built from other states).
    """

    name: str
    op: str
    definition: Term


@dataclass
class Certificate:
    """The outcome of certifying ``St(state, A u B) == rhs``.

    status: "certified" (sympy and float64 agree), "failed" (float64 found a
    counterexample), "unproved" (float64 passed but sympy could not decide).
    """

    state: str
    status: str
    sympy_ok: bool | None
    float_ok: bool
    max_abs_err: float
    counterexample: dict | None = None
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "certified"


class _Model:
    """Values of leaves on blocks A = 1..nA and B = nA+1..nA+nB, for one backend."""

    def __init__(self, states: dict, na: int, nb: int, backend_factory, leaf_value):
        self.states = states
        self.blocks = {"A": tuple(range(1, na + 1)), "B": tuple(range(na + 1, na + nb + 1))}
        self.be = backend_factory
        self.leaf_value = leaf_value  # (kind, name, elem) -> value for Elm/Par leaves
        self._memo: dict = {}
        self._active: set = set()

    def block(self, b: Term):
        if b.op in ("BA", "BB"):
            return self.blocks[b.op[1]]
        if b.op == "BU":
            return self.block(b.args[0]) + self.block(b.args[1])
        raise ValueError(f"certify: block {b!r} is not A, B or a union of them")

    def key(self, b: Term) -> str:
        if b.op in ("BA", "BB"):
            return b.op[1]
        return "".join(self.key(a) for a in b.args)

    def leaf(self, t: Term, elem: int):
        if t.op == "Elm":
            return self.leaf_value("Elm", t.args[0], elem)
        if t.op == "Par":
            return self.leaf_value("Par", t.args[0], 0)
        if t.op == "St":
            return self.state(t.args[0], t.args[1])
        raise ValueError(f"certify: unexpected leaf {t!r}; a claim may contain Elm, Par, St, Cnt and Num leaves "
                         "(no pattern variables)")

    def state(self, q: str, blk: Term):
        k = (q, self.key(blk))
        if k in self._memo:
            return self._memo[k]
        if q not in self.states:
            raise ValueError(f"certify: the claim refers to state {q!r}, but only "
                             f"{sorted(self.states)} are defined; pass its StateDef in `states`")
        if k in self._active:
            raise ValueError(f"certify: the definition of state {q!r} refers to itself")
        self._active.add(k)
        try:
            v = self.ev(substitute(self.states[q].definition, {BLK_A: blk}))
        finally:
            self._active.discard(k)
        self._memo[k] = v
        return v

    def ev(self, t: Term, elem: int = 0):
        return evaluate(t, elem, self.be(), self.leaf, self.block)


def certify(states: list, name: str, rhs: Term, sizes=((1, 1), (2, 3), (3, 2)),
            trials: int = FLOAT_TRIALS, seed: int = 0) -> Certificate:
    """Certify ``St(name, BU(BA, BB)) == rhs`` against the states' definitions."""
    t0 = time.perf_counter()
    sdict = {s.name: s for s in states}
    if name not in sdict:
        raise ValueError(f"certify: no state named {name!r} among {sorted(sdict)}")
    lhs = Term("St", (name, _AB))

    float_ok, max_err, cex, fdetail = _float_check(sdict, lhs, rhs, trials, seed)
    sympy_ok, sdetail = (None, "")
    if float_ok:
        sympy_ok, sdetail = _sympy_check(sdict, lhs, rhs, sizes)
    else:
        # is the counterexample a real one, or float64 rounding? decide at 50 digits
        sympy_ok = False if _exact_mismatch(sdict, lhs, rhs, cex) else None
        if sympy_ok is None:
            fdetail += " (at 50 digits the two sides agree: the form is exact but numerically unstable in float64)"

    if not float_ok:
        status = "failed"
        detail = fdetail
    elif sympy_ok:
        status, detail = "certified", f"sympy: difference is 0 on blocks {list(sizes)}; float64: {trials} random blocks agree"
    else:
        status = "unproved"
        detail = (f"float64 agrees on {trials} random blocks, but sympy could not show the difference is 0: "
                  f"{sdetail}")
    return Certificate(name, status, sympy_ok, float_ok, max_err, cex, detail, time.perf_counter() - t0)


def _sympy_check(sdict, lhs, rhs, sizes):
    syms: dict = {}

    def leaf_value(kind, nm, elem):
        key = f"{nm}[{elem}]" if kind == "Elm" else nm
        if key not in syms:
            syms[key] = sp.Symbol(key, real=True)
        return syms[key]

    for na, nb in sizes:
        model = _Model(sdict, na, nb, SympyBackend, leaf_value)
        try:
            diff = model.ev(lhs) - model.ev(rhs)
            ok = decide.is_zero(diff)
        except (ValueError, TypeError) as exc:
            if str(exc).startswith("certify:"):
                raise
            return None, f"sympy failed on |A|={na}, |B|={nb}: {exc}"
        if not ok:
            return None, f"on |A|={na}, |B|={nb} the difference is {str(diff)[:200]}"
    return True, ""


def _float_check(sdict, lhs, rhs, trials, seed):
    rng = random.Random(seed)
    max_err = 0.0
    for n in range(trials):
        # small blocks first, so that a counterexample is small
        if n < 9:
            na, nb = 1 + n // 3, 1 + n % 3
        else:
            na, nb = rng.choice(_FLOAT_SIZES), rng.choice(_FLOAT_SIZES)
        vals: dict = {}

        def leaf_value(kind, nm, elem, vals=vals):
            key = f"{nm}[{elem}]" if kind == "Elm" else nm
            if key not in vals:
                vals[key] = np.float64(rng.choice([rng.uniform(-50, 50), rng.uniform(-3, 3),
                                                   float(rng.randint(-3, 3))]))
            return vals[key]

        model = _Model(sdict, na, nb, FloatBackend, leaf_value)
        with np.errstate(all="ignore"):
            lv = float(model.ev(lhs))
            rv = float(model.ev(rhs))
        if not math.isfinite(lv) and not math.isfinite(rv) and (lv == rv):
            continue
        err = abs(lv - rv) if (math.isfinite(lv) and math.isfinite(rv)) else math.inf
        if not math.isnan(err):
            max_err = max(max_err, err)
        if not (err <= FLOAT_RTOL * max(abs(lv), abs(rv), 1.0)):
            cex = {"|A|": na, "|B|": nb}
            cex.update({k: float(v) for k, v in sorted(vals.items())})
            cex["lhs"], cex["rhs"] = lv, rv
            return False, max_err, cex, (f"float64 counterexample on |A|={na}, |B|={nb}: "
                                         f"St({lhs.args[0]}, AB) = {lv:.10g} but rhs = {rv:.10g}")
    return True, max_err, None, ""


def _exact_mismatch(sdict, lhs, rhs, cex) -> bool:
    na, nb = cex["|A|"], cex["|B|"]

    def leaf_value(kind, nm, elem):
        key = f"{nm}[{elem}]" if kind == "Elm" else nm
        return mpmath.mpf(cex.get(key, 0.0))

    with mp_context():
        model = _Model(sdict, na, nb, MpBackend, leaf_value)
        try:
            lv, rv = model.ev(lhs), model.ev(rhs)
        except Undefined:
            return True
        return abs(lv - rv) > mpmath.mpf(10) ** -30 * max(1, abs(lv), abs(rv))
