"""The one term IR of acefuse.

Every stage speaks it: rule patterns (rules/), e-graph terms (rewrite/), extracted
updates and merges (extract/), generated code (codegen/) and proofs (proofs/).
A ``Term`` is an immutable operator application; leaves carry their payload in
``args`` as plain Python values (str or float).

Each operator is declared once in ``OPS`` with its egglog signature and a one-line
docstring. Sorts: ``T`` (a real-valued term), ``Blk`` (a block of the reduced
axis), ``String``/``f64`` (payloads).
"""
from __future__ import annotations

from dataclasses import dataclass
import math


@dataclass(frozen=True)
class Op:
    name: str
    sig: tuple  # argument sorts
    sort: str  # result sort
    doc: str


def _op(name, sig, sort, doc):
    return name, Op(name, tuple(sig), sort, doc)


OPS: dict[str, Op] = dict([
    # --- blocks of the reduced axis -------------------------------------------
    _op("BA", (), "Blk", "block A: the first part (the running prefix, or the left partial)"),
    _op("BB", (), "Blk", "block B: the second part (the tile in registers, or the right partial)"),
    _op("BU", ("Blk", "Blk"), "Blk", "the disjoint union of two blocks"),
    _op("BJ", (), "Blk", "the whole fused axis: St(k, BJ) is the final value of state k"),
    _op("Ax", ("String",), "Blk", "a whole named axis of the program (reductions as the user wrote them)"),
    # --- leaves ---------------------------------------------------------------
    _op("Num", ("f64",), "T", "a float constant"),
    _op("Elm", ("String",), "T", "an opaque value that depends on the reduced element (a load, or a subprogram free of reductions)"),
    _op("Par", ("String",), "T", "an opaque value that does not depend on the reduced element (per-row input, or a state finished in an earlier pass)"),
    _op("St", ("String", "Blk"), "T", "state named k over a block: the block-local value of a reduction (or of a reference value built from reductions)"),
    _op("Cnt", ("Blk",), "T", "the number of elements of a block (the block-local counterpart of size(axis))"),
    _op("In", ("String",), "T", "an input tensor read at the current index (program level)"),
    _op("Size", ("String",), "T", "the length of a named axis (program level)"),
    _op("Idx", ("String",), "T", "the current index along a named axis (program level)"),
    _op("Take", ("String", "T", "String"), "T", "gather: input tensor read with its axis replaced by an index term"),
    _op("Out", ("String",), "T", "names a program output in normal-form extraction (no analysis or rule applies)"),
    # --- arithmetic -----------------------------------------------------------
    _op("Add", ("T", "T"), "T", "a + b"),
    _op("Sub", ("T", "T"), "T", "a - b"),
    _op("Mul", ("T", "T"), "T", "a * b"),
    _op("Div", ("T", "T"), "T", "a / b"),
    _op("Neg", ("T",), "T", "-a"),
    _op("Exp", ("T",), "T", "exp(a)"),
    _op("Log", ("T",), "T", "natural log(a)"),
    _op("Sqrt", ("T",), "T", "sqrt(a)"),
    _op("Rsqrt", ("T",), "T", "1 / sqrt(a)"),
    _op("Abs", ("T",), "T", "|a|"),
    _op("Tanh", ("T",), "T", "tanh(a)"),
    _op("Max2", ("T", "T"), "T", "elementwise maximum(a, b)"),
    _op("Min2", ("T", "T"), "T", "elementwise minimum(a, b)"),
    _op("Pow", ("T", "f64"), "T", "a ** c for a constant exponent c"),
    _op("Where", ("T", "T", "T"), "T", "where(c, a, b): a where c is true, else b"),
    _op("CmpLt", ("T", "T"), "T", "a < b (a boolean)"),
    _op("CmpLe", ("T", "T"), "T", "a <= b (a boolean)"),
    _op("CmpGt", ("T", "T"), "T", "a > b (a boolean)"),
    _op("CmpGe", ("T", "T"), "T", "a >= b (a boolean)"),
    _op("CmpEq", ("T", "T"), "T", "a == b (a boolean)"),
    _op("CmpNe", ("T", "T"), "T", "a != b (a boolean)"),
    _op("LAnd", ("T", "T"), "T", "a & b for booleans"),
    _op("LOr", ("T", "T"), "T", "a | b for booleans"),
    _op("LNot", ("T",), "T", "~a for a boolean"),
    # --- special functions (accurate float formulations: codegen/emit.py) ------
    _op("Erf", ("T",), "T", "the error function erf(a)"),
    _op("Sigmoid", ("T",), "T", "1 / (1 + exp(-a)), without overflow for large |a|"),
    _op("Softplus", ("T",), "T", "log(1 + exp(a)), without overflow or cancellation for large |a|"),
    _op("Log1p", ("T",), "T", "log(1 + a), accurate for tiny a"),
    _op("Expm1", ("T",), "T", "exp(a) - 1, accurate for tiny a"),
    # --- rounding to integers (results are integer-valued; NaN/inf propagate) -
    _op("Floor", ("T",), "T", "the largest integer <= a"),
    _op("Ceil", ("T",), "T", "the smallest integer >= a"),
    _op("Round", ("T",), "T", "a rounded to the nearest integer, ties to even (torch.round)"),
    _op("Cast", ("T", "String"), "T", "a converted to a type: 'int32'/'int64' truncate toward zero (NaN when a is NaN, infinite or out of range); 'int8' truncates toward zero and saturates to -128..127 (NaN stays NaN); 'float8_e4m3fn'/'float8_e5m2'/'float16'/'bfloat16'/'float32' round to nearest even into the format, exactly as torch's .to() (FLOAT_CASTS)"),
    # --- exact integer arithmetic (int64 in kernels; NaN where undefined) ------
    _op("FloorDiv", ("T", "T"), "T", "a // b: floor division as Python and torch (rounds toward -inf); NaN when b == 0"),
    _op("Mod", ("T", "T"), "T", "a % b = a - (a // b) * b: the sign of b, as Python and torch.remainder; NaN when b == 0"),
    _op("BitAnd", ("T", "T"), "T", "a & b on integers (two's complement, int64)"),
    _op("BitOr", ("T", "T"), "T", "a | b on integers (two's complement, int64)"),
    _op("BitXor", ("T", "T"), "T", "a ^ b on integers (two's complement, int64)"),
    _op("BitNot", ("T",), "T", "~a = -a - 1 on integers"),
    _op("Shl", ("T", "T"), "T", "a << b on int64 (wraps like torch int64); NaN unless 0 <= b < 64"),
    _op("Shr", ("T", "T"), "T", "a >> b: arithmetic shift, floor(a / 2**b); NaN unless 0 <= b < 64"),
    # --- reductions over a block ---------------------------------------------
    _op("Sum", ("Blk", "T"), "T", "sum over the elements of a block of the body"),
    _op("RMax", ("Blk", "T"), "T", "max over the elements of a block of the body (-inf when empty)"),
    _op("RMin", ("Blk", "T"), "T", "min over the elements of a block of the body (+inf when empty)"),
])

REDUCTIONS = ("Sum", "RMax", "RMin")
FUNCTIONS = ("Erf", "Sigmoid", "Softplus", "Log1p", "Expm1")
ROUNDING = ("Floor", "Ceil", "Round", "Cast")
INT_OPS = ("FloorDiv", "Mod", "BitAnd", "BitOr", "BitXor", "BitNot", "Shl", "Shr")
BOOLEAN = ("CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe", "LAnd", "LOr", "LNot")
CAST_LIMITS = {"int32": 2.0 ** 31, "int64": 2.0 ** 63,   # a cast needs -limit <= trunc(a) < limit
               "int8": 2.0 ** 7,                          # ... except SATURATING types, which clamp
               "index": 2.0 ** 63}   # as int64; an output cast to it is an int64 tensor (argmax, argmin)
SATURATING = {"int8": (-128.0, 127.0)}   # integer casts that saturate after truncation (quantization)
# float casts: (mantissa bits, exponent of the smallest normal, largest finite, on overflow). The
# value is rounded to nearest, ties to even, with the format's subnormals; beyond the largest
# finite value (after rounding) "inf" types give +-inf and "sat" types (float8_e4m3fn, which has
# no infinity) give +-448, as torch's .to() does; NaN stays NaN. acefuse.reference.round_format.
FLOAT_CASTS = {"float8_e4m3fn": (3, -6, 448.0, "sat"), "float8_e5m2": (2, -14, 57344.0, "inf"),
               "float16": (10, -14, 65504.0, "inf"), "bfloat16": (7, -126, (2 - 2 ** -7) * 2.0 ** 127, "inf"),
               "float32": (23, -126, (2 - 2 ** -23) * 2.0 ** 127, "inf")}
INT_LIMIT = 2.0 ** 63   # integer constants are exact int64 values below this magnitude
BINARY = tuple(n for n, o in OPS.items() if o.sort == "T" and o.sig == ("T", "T"))
UNARY = tuple(n for n, o in OPS.items() if o.sort == "T" and o.sig == ("T",))



def is_integer(t: "Term") -> bool:
    """True when ``t`` is integer-valued wherever it is finite, by construction: indices,
    sizes (and block counts), integer constants, rounding, casts, comparisons and the integer operators, closed
    under ``+ - *``, negation, abs, max/min and where. The integer operators (``//``, ``%``,
    bitwise, shifts) accept only such operands, and kernels compute them exactly in int64.

        >>> is_integer(Term("Mod", (Term("Idx", ("j",)), num(3)))), is_integer(num(0.5))
        (True, False)
    """
    op = t.op
    if op == "Cast" and t.args[1] in FLOAT_CASTS:
        return False   # a float cast rounds to a float format, not to an integer
    if op in ("Idx", "Size", "Cnt") or op in ROUNDING or op in INT_OPS or op in BOOLEAN:
        return True
    if op == "Num":
        v = t.args[0]
        return isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < INT_LIMIT
    if op in ("Add", "Sub", "Mul", "Max2", "Min2", "Neg", "Abs"):
        return all(is_integer(c) for c in t.children)
    if op == "Where":
        return is_integer(t.args[1]) and is_integer(t.args[2])
    return False


# Relations the analyses compute (rules/analysis.py); extraction reads them.
RELATIONS = {
    "Inv": ("T",),            # the term does not depend on the reduced element
    "NonZero": ("T",),        # the term is never zero
    "Le": ("T", "T"),         # a <= b (both invariant)
    "UB": ("T", "T", "Blk"),  # m >= e for every element of the block
}


@dataclass(frozen=True)
class Term:
    """An operator application. ``args`` are Terms, or str/float payloads for leaves."""

    op: str
    args: tuple = ()

    # -- construction sugar (used by rule patterns and tests) ---------------
    def __add__(self, o):
        return Term("Add", (self, lift(o)))

    def __radd__(self, o):
        return Term("Add", (lift(o), self))

    def __sub__(self, o):
        return Term("Sub", (self, lift(o)))

    def __rsub__(self, o):
        return Term("Sub", (lift(o), self))

    def __mul__(self, o):
        return Term("Mul", (self, lift(o)))

    def __rmul__(self, o):
        return Term("Mul", (lift(o), self))

    def __truediv__(self, o):
        return Term("Div", (self, lift(o)))

    def __rtruediv__(self, o):
        return Term("Div", (lift(o), self))

    def __neg__(self):
        return Term("Neg", (self,))

    # -- hashing: computed once per object ----------------------------------------
    # (the dataclass hash recurses over the tree on every call: programs share subterms,
    # and examples/moe.py's grouped top-8 routing is 801 objects, a tree of 4,974,236 nodes)
    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.op, self.args))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):   # pickled without the cached hash (str hashes differ per process)
        return {"op": self.op, "args": self.args}

    # -- inspection -----------------------------------------------------------
    @property
    def children(self):
        return tuple(a for a in self.args if isinstance(a, Term))

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()

    def __repr__(self):
        return pretty(self)

    def sexpr(self) -> str:
        """egglog text for this term (pattern variables print as themselves)."""
        if self.op == "?":
            return "v_" + self.args[0]
        if self.op == "Num" and not isinstance(self.args[0], Term):
            return f"(Num {fmt_f64(self.args[0])})"
        parts = [self.op]
        for a in self.args:
            if isinstance(a, Term):
                parts.append(a.sexpr())
            elif isinstance(a, str):
                parts.append("v_" + a[1:] if a.startswith("?") else '"' + a + '"')
            else:
                parts.append(fmt_f64(a))
        return "(" + " ".join(parts) + ")"


def fmt_f64(v: float) -> str:
    v = float(v)
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"  # not expected in rules; guarded by encoders
    s = repr(v)
    return s if ("." in s or "e" in s) else s + ".0"


def lift(x) -> Term:
    if isinstance(x, Term):
        return x
    if isinstance(x, (int, float)):
        return Term("Num", (float(x),))
    raise TypeError(f"cannot use {x!r} in a term")


# ---- constructors --------------------------------------------------------------
A = Term("BA")
B = Term("BB")
J = Term("BJ")


def U(a, b):
    return Term("BU", (a, b))


def num(v):
    return Term("Num", (float(v),))


def elm(name):
    return Term("Elm", (name,))


def par(name):
    return Term("Par", (name,))


def st(name, blk):
    return Term("St", (name, blk))


def cnt(blk):
    return Term("Cnt", (blk,))


def _u(op):
    return lambda a: Term(op, (lift(a),))


def _b(op):
    return lambda a, b: Term(op, (lift(a), lift(b)))


exp, log, sqrt, rsqrt, absf, tanh = (_u(o) for o in ("Exp", "Log", "Sqrt", "Rsqrt", "Abs", "Tanh"))
erf, sigmoid, softplus, log1p, expm1 = (_u(o) for o in FUNCTIONS)
floor, ceil, round_ = (_u(o) for o in ("Floor", "Ceil", "Round"))
max2, min2 = _b("Max2"), _b("Min2")


def rsum(blk, body):
    return Term("Sum", (blk, lift(body)))


def rmax(blk, body):
    return Term("RMax", (blk, lift(body)))


def rmin(blk, body):
    return Term("RMin", (blk, lift(body)))


# ---- printing --------------------------------------------------------------------
_INFIX = {"Add": ("+", 1), "Sub": ("-", 1), "Mul": ("*", 2), "Div": ("/", 2)}
_FN = {"Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Abs": "abs", "Tanh": "tanh",
       "Max2": "max", "Min2": "min", "Erf": "erf", "Sigmoid": "sigmoid", "Softplus": "softplus",
       "Log1p": "log1p", "Expm1": "expm1", "Floor": "floor", "Ceil": "ceil", "Round": "round"}
_INT = {"FloorDiv": "//", "Mod": "%", "BitAnd": "&", "BitOr": "|", "BitXor": "^", "Shl": "<<", "Shr": ">>"}
_RED = {"Sum": "sum", "RMax": "max", "RMin": "min"}
_CMP = {"CmpLt": "<", "CmpLe": "<=", "CmpGt": ">", "CmpGe": ">=", "CmpEq": "==", "CmpNe": "!=",
        "LAnd": "&", "LOr": "|"}


def blk_name(b: Term) -> str:
    if b.op == "Ax":
        return b.args[0]
    if b.op == "BA":
        return "A"
    if b.op == "BB":
        return "B"
    if b.op == "BJ":
        return "J"
    if b.op == "BU":
        return blk_name(b.args[0]) + blk_name(b.args[1])
    if b.op == "?":
        return b.args[0]
    return b.op


def pretty(t: Term, prec: int = 0) -> str:
    """Human-readable infix form: ``l_A * exp(m_A - m_AB) + sum_B(exp(x - m_AB))``."""
    op = t.op
    if op == "?":
        return t.args[0]
    if op == "Num":
        v = t.args[0]
        if isinstance(v, Term):
            return pretty(v)
        return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)
    if op in ("Elm", "Par", "In"):
        return t.args[0]
    if op == "Size":
        return f"size({t.args[0]})"
    if op == "Idx":
        return f"index({t.args[0]})"
    if op == "Take":
        return f"{t.args[0]}[{t.args[2]}={pretty(t.args[1])}]"
    if op == "Pow":
        return f"{pretty(t.args[0], 4)}**{pretty(Term('Num', (t.args[1],)))}"
    if op == "Where":
        return f"where({', '.join(pretty(a) for a in t.args)})"
    if op in _CMP:
        s = f"{pretty(t.args[0], 1)} {_CMP[op]} {pretty(t.args[1], 1)}"
        return f"({s})" if prec > 0 else s
    if op == "LNot" or op == "BitNot":
        return f"~{pretty(t.args[0], 4)}"
    if op in _INT:
        s = f"{pretty(t.args[0], 4)} {_INT[op]} {pretty(t.args[1], 4)}"
        return f"({s})" if prec > 0 else s
    if op == "Cast":
        return f"cast({pretty(t.args[0])}, {t.args[1]!r})"
    if op == "St":
        name = t.args[0]
        name = str(name).lstrip("?")
        return f"{name}_{blk_name(t.args[1])}"
    if op == "Cnt":
        return f"n_{blk_name(t.args[0])}"
    if op in _INFIX:
        sym, p = _INFIX[op]
        lhs = pretty(t.args[0], p)
        rhs = pretty(t.args[1], p + 1)
        s = f"{lhs} {sym} {rhs}"
        return f"({s})" if p < prec else s
    if op == "Neg":
        s = "-" + pretty(t.args[0], 3)
        return f"({s})" if prec > 2 else s
    if op in _FN:
        return f"{_FN[op]}({', '.join(pretty(a) for a in t.args)})"
    if op in _RED:
        return f"{_RED[op]}_{blk_name(t.args[0])}({pretty(t.args[1])})"
    if op in ("BA", "BB", "BU", "BJ"):
        return blk_name(t)
    return f"{op}({', '.join(pretty(a) if isinstance(a, Term) else repr(a) for a in t.args)})"


def substitute(t: Term, mapping: dict) -> Term:
    """Replace subterms (by structural equality) using ``mapping``."""
    if t in mapping:
        return mapping[t]
    if not t.children:
        return t
    return Term(t.op, tuple(substitute(a, mapping) if isinstance(a, Term) else a for a in t.args))


def reblock(t: Term, blk: Term) -> Term:
    """A block-local definition (written over the placeholder block A) over another block."""
    if t.op == "BA":
        return blk
    if not t.children:
        return t
    return Term(t.op, tuple(reblock(a, blk) if isinstance(a, Term) else a for a in t.args))
