"""Certificates: a claimed identity between two terms over blocks, proved for blocks of
*every* size, and cross-checked in float64.

A claim is ``lhs == rhs`` where both sides are terms over the blocks ``A``, ``B``,
their disjoint union ``A u B`` and the whole axis ``J``, with leaves ``Elm`` (a
value of the reduced element), ``Par`` (a value that does not depend on it),
``Cnt`` (a block's size) and ``St(q, X)`` (state ``q`` over block ``X``, i.e. its
definition over ``X``; a definition may refer to other states on the same block).
The derived updates are claims ``St(q, A u B) == rhs``; acefuse/certificate.py
builds the other steps of a fusion (normal form, init, finalize, epilogue) as
claims of the same shape.

**Symbolic check, for all block sizes: the generic-block method.** Each *atomic*
block (``A``, ``B`` or ``J``) is an arbitrary non-empty block: its size is a
positive integer symbol ``n_A``, and every reduction over it is an opaque real
symbol, one per (block, operator, element function):

* a sum body is expanded (sympy ``expand``; ``exp(a + b) = exp(a) exp(b)``) into
  ``sum_k c_k * phi_k`` where ``phi_k`` is a product of the factors that depend on
  the element and ``c_k`` of those that do not; then
  ``sum_X(body) = sum_k c_k * S_X[phi_k]`` (linearity; ``S_X[1] = n_X``);
* a max/min body is split additively into ``phi + c`` (``c`` the element-free
  terms), and ``max_X(body) = M_X[phi] + c`` (translation; ``c`` alone when
  ``phi = 0``: the block is not empty);
* over a disjoint union ``A u B``: ``S_AB[phi] = S_A[phi] + S_B[phi]``,
  ``M_AB[phi] = max(M_A[phi], M_B[phi])``, ``n_AB = n_A + n_B`` (the split laws;
  disjointness is checked on the block terms: ``A u A`` is refused).

Each of these steps is an identity of real numbers for blocks of any size, and
every symbol stands for a value that exists for any concrete blocks; a
``phi_k`` that still contains element-free values (``abs(x - r)``) simply names
the reduction of that function, parameters included. So if the difference of the
two sides is identically 0 as a function of independent symbols (``decide.is_zero``,
with max/min decided by case splits), the claim holds for **all** non-empty
disjoint blocks of all sizes. The class where the method is complete: claims that
follow from linearity of sums, translation of max/min and the split laws (all
rolling updates and merges acefuse's rules derive, normal forms such as deferred
normalisation, and the outputs over final states). Outside it (a positive scale
pulled out of a max, relations between different aggregates, ``where`` around a
reduction) the answer is ``"unproved"``, never ``"certified"``. Identities are of
real functions where both sides are defined (a division is assumed non-zero, as
in the rule proofs).

**Float64 check:** both sides on random concrete blocks (sizes 1 and odd sizes
included, values up to ~50 in magnitude), relative tolerance 1e-9. A float64
mismatch is re-evaluated at 50 digits: a real counterexample makes the claim
``"failed"``.

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
from acefuse.proofs.semantics import (MpBackend, FloatBackend, evaluate, mp_context, Undefined)

FLOAT_RTOL = 1e-9
FLOAT_TRIALS = 40
_AB = U(BLK_A, BLK_B)
_FLOAT_SIZES = (1, 1, 2, 3, 5, 7, 8, 13)
METHOD = "generic blocks (sizes and reductions as symbols; split laws over disjoint unions)"


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
    """The outcome of certifying one claim ``lhs == rhs`` (one step of a fusion).

    status: "certified" (proved for all block sizes, and float64 agrees), "failed"
    (float64 found a counterexample), "unproved" (float64 passed but the symbolic
    check could not decide). ``state`` names the state or output the claim is about,
    ``step`` the step ("rolling", "merge", "init", "normal form", "finalize", "epilogue").
    """

    state: str
    status: str
    sympy_ok: bool | None
    float_ok: bool
    max_abs_err: float
    counterexample: dict | None = None
    detail: str = ""
    seconds: float = 0.0
    step: str = "claim"

    @property
    def ok(self) -> bool:
        return self.status == "certified"


class Unsupported(ValueError):
    """The claim uses an operator the checker cannot model (the claim stays unproved)."""


# ---- Pow: lowered to the operators both models know ------------------------------------------
def lower_pow(t: Term) -> Term:
    """``a ** k`` for an integer ``k`` as products (and a reciprocal), ``a ** 0.5`` as sqrt."""
    if not t.children:
        return t
    args = tuple(lower_pow(a) if isinstance(a, Term) else a for a in t.args)
    if t.op == "Pow":
        base, k = args[0], float(args[1])
        if k == 0.5:
            return Term("Sqrt", (base,))
        if k == -0.5:
            return Term("Rsqrt", (base,))
        if k.is_integer() and 1 <= abs(k) <= 16:
            r = base
            for _ in range(int(abs(k)) - 1):
                r = Term("Mul", (r, base))
            return r if k > 0 else Term("Div", (Term("Num", (1.0,)), r))
    return Term(t.op, args)


# ---- blocks ---------------------------------------------------------------------------------
def block_atoms(b: Term) -> tuple:
    """The atomic blocks of a block term: A, B, J, or a disjoint union of A and B."""
    if b.op in ("BA", "BB", "BJ"):
        return (b.op[1],)
    if b.op == "BU":
        a1, a2 = block_atoms(b.args[0]), block_atoms(b.args[1])
        if set(a1) & set(a2) or "J" in a1 + a2:
            raise ValueError(f"certify: block {b!r} is not a disjoint union of A and B "
                             "(a union of a block with itself, or with the whole axis)")
        return a1 + a2
    raise ValueError(f"certify: block {b!r} is not A, B, J or a disjoint union of them")


# ---- state values, shared by both models -------------------------------------------------
class _StateValues:
    """A state's value over a block, from its definition with the block substituted for A,
    computed once per (state, block atoms); a definition that refers to itself is refused.
    Subclasses set ``states`` (name -> StateDef), ``_memo`` and ``_active``, and define
    ``ev``."""

    def state(self, q: str, blk: Term):
        k = (q, block_atoms(blk))
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


# ---- the symbolic model: generic blocks --------------------------------------------------
class _Generic(_StateValues):
    """sympy values of terms over arbitrary non-empty blocks (see the module docstring)."""

    def __init__(self, states: dict):
        self.states = states
        self.elem: set = set()
        self._leaves: dict = {}
        self._agg: dict = {}
        self._memo: dict = {}
        self._active: set = set()

    def _leaf(self, kind: str, name: str):
        key = (kind, name)
        s = self._leaves.get(key)
        if s is None:
            s = sp.Dummy(name if kind == "Elm" else name + "'", real=True)
            self._leaves[key] = s
            if kind == "Elm":
                self.elem.add(s)
        return s

    def count(self, atom: str):
        key = ("n", atom)
        s = self._agg.get(key)
        if s is None:
            s = self._agg[key] = sp.Dummy(f"n_{atom}", positive=True, integer=True)
        return s

    def agg(self, atom: str, op: str, phi):
        key = (atom, op, phi)
        s = self._agg.get(key)
        if s is None:
            s = self._agg[key] = sp.Dummy(f"{op}_{atom}[{phi}]", real=True)
        return s

    def ev(self, t: Term):
        op = t.op
        if op == "Num":
            v = t.args[0]
            if isinstance(v, Term):
                raise ValueError(f"certify: unexpected leaf {t!r} (no pattern variables in a claim)")
            v = float(v)
            if math.isinf(v):
                return sp.oo if v > 0 else -sp.oo
            return sp.Integer(int(v)) if v.is_integer() else sp.Rational(v)
        if op in ("Elm", "Par"):
            return self._leaf(op, t.args[0])
        if op == "St":
            return self.state(t.args[0], t.args[1])
        if op == "Cnt":
            return sp.Add(*(self.count(a) for a in block_atoms(t.args[0])))
        if op in ("Sum", "RMax", "RMin"):
            return self.reduce(op, block_atoms(t.args[0]), self.ev(t.args[1]))
        if op == "Cast":   # an uninterpreted function per target type (sound: equal arguments, equal results)
            return sp.Function("cast_" + t.args[1], real=True)(self.ev(t.args[0]))
        fn = _SYM_OPS.get(op)
        if fn is None:
            if op == "?":
                raise ValueError(f"certify: unexpected leaf {t!r}; a claim may contain Elm, Par, St, Cnt and "
                                 "Num leaves (no pattern variables)")
            raise Unsupported(f"operator {op} in `{t!r}` is outside the certified class")
        return fn(*(self.ev(a) for a in t.args))

    # -- reductions over generic blocks --
    def _split_exp(self, f):
        """exp(a + b) with a element-dependent, b not: (exp(b), exp(a))."""
        inv, el = [], []
        for a in sp.Add.make_args(sp.expand(f.args[0])):
            (el if a.free_symbols & self.elem else inv).append(a)
        return sp.exp(sp.Add(*inv)), sp.exp(sp.Add(*el))

    def separate_sum(self, body) -> dict:
        """{phi: c} with body == sum c * phi, phi depending on the element, c not."""
        out: dict = {}
        for term in sp.Add.make_args(sp.expand(body)):
            coef, phi = [], []
            todo = list(sp.Mul.make_args(term))
            while todo:
                f = todo.pop()
                if not (f.free_symbols & self.elem):
                    coef.append(f)
                elif isinstance(f, sp.exp):
                    c, e = self._split_exp(f)
                    coef.append(c)
                    phi.append(e)
                elif f.is_Pow and f.exp.is_integer and isinstance(f.base, sp.Add) \
                        and isinstance(sp.factor_terms(f.base), sp.Mul):
                    # (e(x) * c)^k = e(x)^k * c^k for an integer k: pull the common factors out
                    todo.extend(sp.expand_power_base(b ** f.exp, force=False)
                                for b in sp.Mul.make_args(sp.factor_terms(f.base)))
                else:
                    phi.append(f)
            key = sp.Mul(*phi)
            out[key] = out.get(key, 0) + sp.Mul(*coef)
        return out

    def reduce(self, op: str, atoms: tuple, body):
        if op == "Sum":
            total = sp.Integer(0)
            for phi, c in self.separate_sum(body).items():
                agg = sp.Add(*(self.count(a) if phi == 1 else self.agg(a, "sum", phi) for a in atoms))
                total += c * agg
            return total
        terms = sp.Add.make_args(sp.expand(body))
        phi = sp.Add(*(a for a in terms if a.free_symbols & self.elem))
        inv = sp.Add(*(a for a in terms if not (a.free_symbols & self.elem)))
        if phi == 0:
            return inv
        name = "max" if op == "RMax" else "min"
        if op == "RMin" and inv == 0:
            sel = [self._select_by_bound(a, phi) for a in atoms]
            if all(v is not None for v in sel):
                return sp.Min(*sel)
        vals = [self.agg(a, name, phi) for a in atoms]
        return inv + (sp.Max(*vals) if op == "RMax" else sp.Min(*vals))

    def _select_by_bound(self, atom, phi):
        """``min_S where(f == c, g, k)`` where ``c = max(..., max_S f, ...)`` is an upper bound of
        ``f`` on S: ``where(max_S f == c, min_S where(f == max_S f, g, k), k)``, the proved rule
        min-where-eq-bound (rules/order.py) with d = max_S f (UB by definition, d <= c as an
        argument of the max). None when phi is not of that form."""
        if getattr(phi, "func", None) != _SYM_OPS["Where"] or len(phi.args) != 3:
            return None
        cond, g, k = phi.args
        if getattr(cond, "func", None) != _SYM_OPS["CmpEq"] or k.free_symbols & self.elem:
            return None
        f, c = cond.args
        if not (f.free_symbols & self.elem) or c.free_symbols & self.elem:
            return None
        d = self.agg(atom, "max", f)
        if c == d:
            return None   # already the block's own max: the aggregate as it is
        if not (isinstance(c, sp.Max) and d in c.args):
            return None
        return _SYM_OPS["Where"](_SYM_OPS["CmpEq"](d, c), self.agg(atom, "min", _SYM_OPS["Where"](
            _SYM_OPS["CmpEq"](f, d), g, k)), k)


_SYM_OPS = {
    "Add": lambda a, b: a + b,
    "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b,
    "Div": lambda a, b: a / b,
    "Neg": lambda a: -a,
    "Exp": sp.exp,
    "Log": sp.log,
    "Sqrt": sp.sqrt,
    "Rsqrt": lambda a: 1 / sp.sqrt(a),
    "Abs": sp.Abs,
    "Tanh": sp.tanh,
    "Max2": lambda a, b: sp.Max(a, b),
    "Min2": lambda a, b: sp.Min(a, b),
}
# operators without algebra here: uninterpreted functions of their values (equal arguments,
# equal results: sound, and enough when both sides use them the same way)
for _op in ("Where", "CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe", "LAnd", "LOr", "LNot",
            "Round", "FloorDiv", "Mod", "BitAnd", "BitOr", "BitXor", "BitNot", "Shl", "Shr"):
    _SYM_OPS[_op] = sp.Function(_op.lower(), real=True)
_SYM_OPS.update({
    "Erf": sp.erf,
    "Sigmoid": lambda a: 1 / (1 + sp.exp(-a)),
    "Softplus": lambda a: sp.log(1 + sp.exp(a)),
    "Log1p": lambda a: sp.log(1 + a),
    "Expm1": lambda a: sp.exp(a) - 1,
    "Floor": sp.floor,
    "Ceil": sp.ceiling,
})


def symbolic_check(sdict: dict, lhs: Term, rhs: Term):
    """(True, "") when the generic-block model proves lhs == rhs, else (None, why)."""
    model = _Generic(sdict)
    try:
        diff = model.ev(lhs) - model.ev(rhs)
    except Unsupported as exc:
        return None, str(exc)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith("certify:"):
            raise
        return None, f"sympy could not build the claim: {exc}"
    try:
        ok = decide.is_zero(diff)
    except (TypeError, ValueError, RecursionError) as exc:
        return None, f"sympy failed: {exc}"
    if not ok:
        return None, f"the difference over generic blocks does not simplify to 0: {str(diff)[:200]}"
    return True, ""


# ---- the concrete model: random blocks ---------------------------------------------------------
class _Model(_StateValues):
    """Values of leaves on concrete blocks laid out one after another (A = 1..nA,
    B = nA+1..nA+nB, J = the next nJ elements), for one backend."""

    def __init__(self, states: dict, sizes: dict, backend_factory, leaf_value):
        self.states = states
        self.blocks, start = {}, 1
        for atom in ("A", "B", "J"):
            n = sizes.get(atom, 0)
            self.blocks[atom] = tuple(range(start, start + n))
            start += n
        self.be = backend_factory
        self.leaf_value = leaf_value  # (kind, name, elem) -> value for Elm/Par leaves
        self._memo: dict = {}
        self._active: set = set()

    def block(self, b: Term):
        out = ()
        for a in block_atoms(b):
            out += self.blocks[a]
        return out

    def leaf(self, t: Term, elem: int):
        if t.op == "Elm":
            return self.leaf_value("Elm", t.args[0], elem)
        if t.op == "Par":
            return self.leaf_value("Par", t.args[0], 0)
        if t.op == "St":
            return self.state(t.args[0], t.args[1])
        raise ValueError(f"certify: unexpected leaf {t!r}; a claim may contain Elm, Par, St, Cnt and Num leaves "
                         "(no pattern variables)")

    def ev(self, t: Term, elem: int = 0):
        """semantics.evaluate, with the value of each reduction computed once (it does not
        depend on the ambient element): nested reductions stay linear in the block size."""
        if not hasattr(self, "_red"):
            self._red, self._backend = {}, self.be()
        return self._ev(t, elem)

    def _ev(self, t: Term, elem: int):
        op = t.op
        if op in _REDUCE:
            key = id(t)
            hit = self._red.get(key)
            if hit is not None and hit[0] is t:
                return hit[1]
            elems = self.block(t.args[0])
            if not elems:
                raise ValueError(f"reduction {t!r} over an empty block")
            be = self._backend
            v = getattr(be, _REDUCE[op])([self._ev(t.args[1], i) for i in elems])
            self._red[key] = (t, v)
            return v
        if op in _CONCRETE_OPS:
            be = self._backend
            return getattr(be, _CONCRETE_OPS[op])(*(self._ev(a, elem) for a in t.args))
        return evaluate(t, elem, self._backend, self.leaf, self.block)


_REDUCE = {"Sum": "sum", "RMax": "max", "RMin": "min"}
_CONCRETE_OPS = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Neg": "neg", "Exp": "exp",
                 "Log": "log", "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Abs": "abs", "Tanh": "tanh"}


def _atoms_of(*terms) -> set:
    out = set()
    for t in terms:
        for s in t.walk():
            if s.op in ("BA", "BB", "BJ"):
                out.add(s.op[1])
    return out


def _sizes_for(n: int, atoms: set, rng) -> dict:
    if n < 9:
        small = {"A": 1 + n // 3, "B": 1 + n % 3, "J": 1 + n}
    else:
        small = {a: rng.choice(_FLOAT_SIZES) for a in ("A", "B", "J")}
    return {a: small[a] for a in atoms}


def _float_check(sdict, lhs, rhs, trials, seed):
    rng = random.Random(seed)
    max_err = 0.0
    atoms = _atoms_of(lhs, rhs) or {"A"}   # definitions are evaluated on the blocks the claim names
    for n in range(trials):
        sizes = _sizes_for(n, atoms, rng)   # small blocks first, so that a counterexample is small
        vals: dict = {}

        def leaf_value(kind, nm, elem, vals=vals):
            key = f"{nm}[{elem}]" if kind == "Elm" else nm
            if key not in vals:
                vals[key] = np.float64(rng.choice([rng.uniform(-50, 50), rng.uniform(-3, 3),
                                                   float(rng.randint(-3, 3))]))
            return vals[key]

        model = _Model(sdict, sizes, FloatBackend, leaf_value)
        with np.errstate(all="ignore"):
            lv = float(model.ev(lhs))
            rv = float(model.ev(rhs))
        if not math.isfinite(lv) and not math.isfinite(rv) and (lv == rv):
            continue
        if math.isnan(lv) and math.isnan(rv):
            continue   # both sides undefined at this point (log of a negative leaf, 0/0)
        err = abs(lv - rv) if (math.isfinite(lv) and math.isfinite(rv)) else math.inf
        if not math.isnan(err):
            max_err = max(max_err, err)
        if not (err <= FLOAT_RTOL * max(abs(lv), abs(rv), 1.0)):
            cex = {f"|{a}|": sizes[a] for a in sorted(sizes)}
            cex.update({k: float(v) for k, v in sorted(vals.items())})
            cex["lhs"], cex["rhs"] = lv, rv
            where = ", ".join(f"|{a}|={sizes[a]}" for a in sorted(sizes))
            return False, max_err, cex, f"float64 counterexample on {where}: lhs = {lv:.10g} but rhs = {rv:.10g}"
    return True, max_err, None, ""


def _exact_mismatch(sdict, lhs, rhs, cex) -> bool:
    sizes = {k[1:-1]: v for k, v in cex.items() if k.startswith("|")}

    def leaf_value(kind, nm, elem):
        key = f"{nm}[{elem}]" if kind == "Elm" else nm
        return mpmath.mpf(cex.get(key, 0.0))

    with mp_context():
        model = _Model(sdict, sizes, MpBackend, leaf_value)
        try:
            lv, rv = model.ev(lhs), model.ev(rhs)
        except Undefined:
            return True
        return abs(lv - rv) > mpmath.mpf(10) ** -30 * max(1, abs(lv), abs(rv))


# ---- claims -------------------------------------------------------------------------------------
def certify_claim(states, lhs: Term, rhs: Term, subject: str = "", step: str = "claim",
                  trials: int = FLOAT_TRIALS, seed: int = 0) -> Certificate:
    """Certify ``lhs == rhs`` (terms over A, B, A u B or J) against the states' definitions."""
    t0 = time.perf_counter()
    sdict = {s.name: s for s in states}
    sdict = {k: StateDef(s.name, s.op, lower_pow(s.definition)) for k, s in sdict.items()}
    lhs, rhs = lower_pow(lhs), lower_pow(rhs)
    for side in (lhs, rhs):
        for s in side.walk():
            if s.op in ("BU",):
                block_atoms(s)   # a union that is not disjoint is a clear error, not a claim
    try:
        float_ok, max_err, cex, fdetail = _float_check(sdict, lhs, rhs, trials, seed)
    except ValueError as exc:
        if str(exc).startswith("certify:"):
            raise
        float_ok, max_err, cex, fdetail = True, 0.0, None, f"(no float64 check: {exc})"
        trials = 0
    if float_ok:
        sympy_ok, sdetail = symbolic_check(sdict, lhs, rhs)
    else:
        sdetail = ""
        # is the counterexample a real one, or float64 rounding? decide at 50 digits
        sympy_ok = False if _exact_mismatch(sdict, lhs, rhs, cex) else None
        if sympy_ok is None:
            fdetail += " (at 50 digits the two sides agree: the form is exact but numerically unstable in float64)"
    if not float_ok:
        status, detail = "failed", fdetail
    elif sympy_ok:
        status = "certified"
        detail = (f"proved for all block sizes ({METHOD}); float64: "
                  + (f"{trials} random blocks agree" if trials else fdetail))
    else:
        status = "unproved"
        detail = (f"float64 agrees on {trials} random blocks, but the symbolic check could not prove it "
                  f"for all block sizes: {sdetail}")
    return Certificate(subject, status, sympy_ok, float_ok, max_err, cex, detail,
                       time.perf_counter() - t0, step)


def certify(states: list, name: str, rhs: Term, trials: int = FLOAT_TRIALS, seed: int = 0,
            step: str = "claim") -> Certificate:
    """Certify ``St(name, BU(BA, BB)) == rhs`` against the states' definitions, for all block sizes."""
    sdict = {s.name: s for s in states}
    if name not in sdict:
        raise ValueError(f"certify: no state named {name!r} among {sorted(sdict)}")
    return certify_claim(states, Term("St", (name, _AB)), rhs, name, step, trials, seed)
