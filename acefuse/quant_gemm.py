"""GEMMs whose operands are programs: a quantization's reduction feeding a GEMM operand.

Written plainly (examples/quant.py)::

    x, wq, ws = af.tensor("x", "t k"), af.tensor("wq", "n k"), af.tensor("ws", "n")
    scale = af.cast(af.max(af.abs(x), "k") / 448.0, "float32")
    prog = af.program("fp8_linear", out=af.sum(af.cast(x / scale, "float8_e4m3fn") * wq, "k") * scale * ws)
    g = af.gemm(prog); print(g.explain(x=x_t, wq=wq_t, ws=ws_t)); out = g(x=x_t, wq=wq_t, ws=ws_t)["out"]

``split`` finds the one contraction ``sum_k(A * B)`` whose factors range over the output's two
axes (A over [m, k], B over [n, k]); each operand is the product of its side's factors, an
arbitrary program of that side's inputs (reductions over k included: the per-token scale);
the epilogue is the output with the contraction replaced by the accumulator. Two forms:

- ``"scaled_mm"``: each computed operand is materialized by the row-family kernel of a program
  ``q = operand, scale = the epilogue's factor of that side`` (one read of the input: the
  quantization kernel acefuse already generates), then ``torch._scaled_mm(qa, qb.t(),
  scale_a, scale_b)``. Needs float8 operands and an epilogue ``acc * row factor * column
  factor``. Where ``_scaled_mm`` cannot run (the CPU, a GPU below compute capability 8.9, k or
  n not a multiple of 16) the same product is a float32 matmul of the float8 values, then
  ``* scale_a * scale_b``: the exact products of float8 values, accumulated in float32 (the
  order differs from _scaled_mm's), reported by ``last_path``.
- ``"prologue"``: one generated Triton GEMM (codegen/gemm.py) whose operand loaders compute the
  row tile's reductions in a pre-loop over k and the operand tile from its inputs at each k
  step: the quantized operand is never written to memory.

The choice. On a GPU the first call for a key (the program, the device, M, N, K rounded up to
powers of two, the dtypes) times scaled_mm and each of the prologue's PROLOGUE_CONFIGS on the
call's inputs (codegen/contraction_launch.py's TIMING_SRC helpers: one untimed call, then 5
timed behind a sleep) and keeps the fastest; ``explain`` shows the byte model and the measured
times. On an H100 (t=16384, k=8192, bf16 x) scaled_mm measured faster at n=128 (0.226 ms
against the prologue's best 0.290 ms) and n=4096 (1.005 against 6.94 ms), where the byte model
had chosen the prologue at n=128. On the CPU (Triton's interpreter) the byte model chooses.

The byte model (``cost``), in bytes requested from HBM, then FLOPs; blocks BLOCK_M x BLOCK_N:

    c_n = ceil(N / BLOCK_N) (column tiles: how often a row tile of A is needed),
    c_m = ceil(M / BLOCK_M); in_a = bytes of A's inputs over [m, k] (M*K*element size),
    q_a = M*K*(1 byte for float8) + 4*M (the scale); likewise for B; out = M*N*(output bytes)
    scaled_mm: in_a + q_a (materialize; write)  + c_n*q_a (the GEMM reads q_a and its scale
               per column tile) + the same for B with c_m + out
    prologue:  c_n*in_a (each column tile's pre-loop reads its row tile of A's inputs) + c_n*in_a
               again (the main loop's second read: counted as L2 bytes where the row tiles
               held by the resident programs, one per SM in grouped order, fit in the device's
               L2 between the two reads; otherwise, or with no device to say, as HBM bytes)
               + c_m*in_b (likewise) + out
    FLOPs: 2*M*N*K for the dot in both; the operand's elementwise ops (and its reductions)
    once per element for scaled_mm, c_n times for prologue.

A bare operand (a float8 input, like ``wq``) costs its reads only, in both forms. The form
with fewer HBM bytes is chosen; on equal bytes the one with fewer FLOPs. For a bfloat16 x
quantized to float8 with no L2 reuse, prologue moves 4*c_n*M*K bytes for A against
scaled_mm's (4 + c_n)*M*K: the prologue wins only at c_n = 1, and then by the scale's bytes
(a near tie the model cannot resolve: on an H100 scaled_mm measured faster there). It counts
requested bytes only; it is a stated contract, not a measurement.

On a GPU of compute capability 9.0 the prologue's dot runs in float8: Hopper's float8 MMA sums
products in reduced precision, so each k step's dot (BLOCK_K = 64 products) starts from zero and
is added to a float32 accumulator (codegen/gemm.py). With Triton's default (no such promotion)
the GPU tests failed at k = 1024 and 1040; with it the worst error over the test's float32
bound measured 0.17 at t=1000, k=1024, n=384 (torch._scaled_mm: 0.44; BLOCK_K = 128: 0.44).
"""
from __future__ import annotations

import hashlib
import math
import types
import warnings
from dataclasses import dataclass, field

import torch

from acefuse.lang import LanguageError, Expr, Program
from acefuse.rewrite.terms import Term, pretty
from acefuse.codegen.gemm import free_of, replace, kreductions, generate, J
from acefuse.codegen.contraction_launch import TIMING_SRC
from acefuse.codegen.input_types import FLOAT_OK, FLOAT8_TYPES, INT_TYPES, _type_error

# the input types the GEMM's kernels read (codegen/row.py _widen: float8 decoded exactly,
# integers converted to float32, exact below 2**24); float64 would be narrowed: refused
_INPUT_OK = FLOAT_OK + FLOAT8_TYPES + INT_TYPES

FP8 = {"float8_e4m3fn": 1, "float8_e5m2": 2}
_TORCH_FP8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
ACC = Term("St", ("acc", J))
FORMS = ("scaled_mm", "prologue")
# the prologue form's launch candidates on a GPU: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
# (the two fastest of six on an H100 at t=16384, k=8192, n=128 and 4096; the first, the default
# of a forced prologue form, is the one the GPU tests checked; BLOCK_K = 64 bounds the products
# one float8 MMA sums before the float32 accumulator: codegen/gemm.py)
PROLOGUE_CONFIGS = ((128, 128, 64, 8, 3), (64, 128, 64, 4, 4))


_TIMING = {}     # TIMING_SRC's helpers (_time_calls, _fastest), executed once
_MEASURED = {}   # (program, device, shapes rounded up to powers of two, dtypes) -> (best, {candidate: ms})


def _cand_name(c):
    if c[0] == "scaled_mm":
        return "scaled_mm"
    bm, bn, bk, w, st = c[1]
    return f"prologue {bm}x{bn}x{bk} ({w} warps, {st} stages)"


def _np2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def _fastest_timed(cands, call):
    """(the fastest candidate or None, {candidate: ms per call}): TIMING_SRC's ``_fastest``
    (each candidate called once untimed, then timed; failing ones skipped) with its
    ``_time_calls`` recording what it measured."""
    if not _TIMING:
        _TIMING["torch"] = torch
        exec("\n".join(TIMING_SRC), _TIMING)
    times, cur = {}, [None]

    def record(fn, reps=5):
        ms = _TIMING["_time_calls"](fn, reps)
        times[cur[0]] = min(times.get(cur[0], float("inf")), ms / reps)   # (the best of _fastest's rounds)
        return ms

    def tagged(cand):
        cur[0] = cand
        return call(cand)
    f = _TIMING["_fastest"]
    fastest = types.FunctionType(f.__code__, dict(_TIMING, _time_calls=record), f.__name__, f.__defaults__)
    return fastest(cands, tagged), times


class GemmError(LanguageError):
    """A program is not a GEMM with program operands; the message names the term and the fix."""


def _mul_factors(t: Term) -> list:
    if t.op == "Mul":
        return _mul_factors(t.args[0]) + _mul_factors(t.args[1])
    return [t]


def _product(factors):
    if not factors:
        return None
    out = factors[0]
    for f in factors[1:]:
        out = Term("Mul", (out, f))
    return out


def _axes_of(t: Term, tensors: dict) -> set:
    """Axes ``t`` ranges over (reductions remove their axis)."""
    if t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax":
        return _axes_of(t.args[1], tensors) - {t.args[0].args[0]}
    if t.op == "In":
        return set(tensors[t.args[0]])
    if t.op == "Idx":
        return {t.args[0]}
    out = set()
    for c in t.children:
        out |= _axes_of(c, tensors)
    return out


def _inputs_of(t: Term) -> set:
    return {u.args[0] for u in t.walk() if u.op == "In"}


@dataclass
class Split:
    """A program read as out[m, n] = epilogue(sum_k operand_a[m, k] * operand_b[n, k])."""
    name: str
    output: str
    k: str
    axis_a: str
    axis_b: str
    tensors: dict
    operand: dict                     # "a" | "b" -> Term
    epilogue: Term                    # with ACC for the contraction
    contraction: Term
    scale: dict = field(default_factory=dict)   # "a" | "b" -> factor Term (or None): scaled_mm's form
    scaled_why_not: str = ""

    def side_of(self, t: Term):
        """"a" when ``t`` reads only A's side (axes within {m, k}), "b" for B's, None for both."""
        ax = _axes_of(t, self.tensors) | {a for u in t.walk() if u.op in ("Sum", "RMax", "RMin")
                                          and u.args[0].op == "Ax" for a in _axes_of(u.args[1], self.tensors)}
        if self.axis_a in ax and self.axis_b in ax:
            return None
        return "b" if self.axis_b in ax else "a"


def split(prog: Program, output: str = None) -> Split:
    """Read ``prog`` (one output over two axes) as a GEMM with program operands."""
    if not isinstance(prog, Program):
        raise GemmError(f"af.gemm takes a program (af.program(...)), not {type(prog).__name__}")
    outs = list(prog.outputs)
    if output is None:
        if len(outs) != 1:
            raise GemmError(f"program {prog.name!r} has outputs {outs}; af.gemm compiles one: pass output=")
        output = outs[0]
    e = prog.outputs[output]
    if len(e.axes) != 2:
        raise GemmError(f"program {prog.name!r}: output {output!r} ranges over {list(e.axes)}; a GEMM's output "
                        "has two axes (rows m, columns n)")
    am, an = e.axes
    tensors = dict(prog.tensors)
    cands = []
    for u in e.term.walk():
        if u.op == "Sum" and u.args[0].op == "Ax":
            ax = _axes_of(u.args[1], tensors)
            if am in ax and an in ax and u not in cands:
                cands.append(u)
    if len(cands) != 1:
        raise GemmError(f"program {prog.name!r}, output {output!r}: "
                        + ("no sum over an axis of a product of a factor over "
                           f"{am!r} and one over {an!r} (write the contraction as af.sum(a * b, 'k'))"
                           if not cands else f"{len(cands)} contractions ({'; '.join(pretty(c) for c in cands)}); "
                           "a GEMM has one"))
    con = cands[0]
    k = con.args[0].args[0]
    fac = {"a": [], "b": []}
    for f in _mul_factors(con.args[1]):
        ax = _axes_of(f, tensors)
        if am in ax and an in ax:
            raise GemmError(f"program {prog.name!r}: factor `{pretty(f)}` of the contraction over {k!r} ranges over "
                            f"both {am!r} and {an!r}; each factor of a GEMM operand must read one side "
                            f"(write it as a product of an [{am}, {k}] and an [{an}, {k}] factor)")
        fac["b" if an in ax else "a"].append(f)
    operand = {s: _product(fac[s]) for s in "ab"}
    for s in "ab":
        if operand[s] is None or k not in _axes_of(operand[s], tensors):
            raise GemmError(f"program {prog.name!r}: the contraction `{pretty(con)}` has no factor over "
                            f"[{am if s == 'a' else an}, {k}]; that is not a GEMM")
    epi = replace(e.term, {con: ACC})
    sp = Split(prog.name, output, k, am, an, tensors, operand, epi, con)
    for t in (operand["a"], operand["b"], epi):
        for u in t.walk():
            if u.op in ("Sum", "RMax", "RMin") and u.args[0].op == "Ax" and u.args[0].args[0] != k:
                raise GemmError(f"program {prog.name!r}: reduction `{pretty(u)}` over {u.args[0].args[0]!r}; "
                                f"a GEMM operand or epilogue may reduce over the contraction axis {k!r} only")
            if u.op == "Take":
                raise GemmError(f"program {prog.name!r}: gather `{pretty(u)}` in a GEMM; gather first")
    if not free_of(epi, k, tensors):
        raise GemmError(f"program {prog.name!r}: the output `{pretty(e.term)}` reads {k!r} outside its reductions")
    for r in kreductions(epi, k):
        if sp.side_of(r.args[1]) is None:
            raise GemmError(f"program {prog.name!r}: reduction `{pretty(r)}` reads both sides of the GEMM")
    for s in "ab":
        for r in kreductions(operand[s], k):
            if sp.side_of(r.args[1]) not in (s,) and _axes_of(r.args[1], tensors) - {k}:
                raise GemmError(f"program {prog.name!r}: operand {s}'s reduction `{pretty(r)}` reads the other side")
    # scaled_mm's form: epilogue = acc * (factor of side a) * (factor of side b)
    parts = _mul_factors(epi)
    if parts.count(ACC) != 1 or any(ACC in p.walk() for p in parts if p != ACC):
        sp.scaled_why_not = (f"the epilogue `{pretty(epi)}` is not the accumulator times a per-row and a per-column "
                             "factor")
    else:
        side = {"a": [], "b": []}
        for p in parts:
            if p != ACC:
                side[sp.side_of(p)].append(p)
        sp.scale = {s: _product(side[s]) for s in "ab"}
    return sp


def operand_format(t: Term, dtypes: dict) -> int:
    """1 (float8_e4m3fn), 2 (float8_e5m2) or 0: the operand's values as a format."""
    if t.op == "Cast" and t.args[1] in FP8:
        return FP8[t.args[1]]
    if t.op == "In":
        return _TORCH_FP8.get(dtypes.get(t.args[0]), 0)
    return 0


def _count_ops(t: Term) -> int:
    return sum(1 for u in t.walk() if u.op not in ("In", "Num", "St", "Ax", "Idx", "Size"))


@dataclass
class Cost:
    form: str
    hbm_bytes: int
    l2_bytes: int
    flops: int
    detail: str


class GemmKernel:
    """A compiled GEMM with program operands: ``g(form="auto", out_dtype=None, **inputs)``."""

    def __init__(self, prog, output=None, block=None):
        self.program = prog
        self.split = split(prog, output)
        self.block = block
        self._prologue = None
        self._sides = {}
        self.last_form = None
        self.last_path = None
        self.fp8_dot = True   # False: the prologue's dot in float32 on the GPU too (slow; to compare)

    # -- the cost model -----------------------------------------------------------------
    def blocks(self, device_is_cuda: bool):
        if self.block is not None:
            return tuple(self.block[:3])
        # GPU: 128 x 128 output tiles, k steps of 64 (the operand tiles are computed in float32
        # registers before the dot: a k step of 128 doubles them); interpreter: small blocks
        return (128, 128, 64) if device_is_cuda else (16, 16, 16)

    def cost(self, M, N, K, dtypes: dict, out_bytes: int, cuda: bool = True, device=None) -> dict:
        """Bytes (HBM, L2) and FLOPs of each form (module docstring) for sizes M, N, K;
        ``device`` (a CUDA device) gives the L2 size and SM count that decide whether the
        prologue's main loop re-reads its pre-looped row tiles from L2 (none: from HBM)."""
        s = self.split
        bm, bn, _ = self.blocks(cuda)
        rep = {"a": math.ceil(N / bn), "b": math.ceil(M / bm)}
        rows = {"a": M, "b": N}
        es = {n: torch.empty((), dtype=d).element_size() for n, d in dtypes.items()}
        l2 = self._l2_fits(M, N, K, es, bm, bn, device)
        out = {}
        a_bytes, p_bytes, p_l2, a_fl, p_fl = 0, 0, 0, 2 * M * N * K, 2 * M * N * K
        lines = []
        for side in "ab":
            op = s.operand[side]
            r, c = rows[side], rep[side]
            ins = sum(r * K * es[n] for n in _inputs_of(op) if s.k in s.tensors[n])
            ins += sum(r * es[n] for n in _inputs_of(op) if s.k not in s.tensors[n])
            ops = _count_ops(op) + sum(_count_ops(x.args[1]) for x in kreductions(op, s.k))
            if op.op == "In":
                a_bytes += c * ins
                p_bytes += c * ins
                lines.append(f"operand {side} = input {op.args[0]!r}: read {c}x ({c * ins} B) in both forms")
                continue
            q = r * K * (1 if operand_format(op, {}) else 4) + 4 * r
            a_bytes += ins + q + c * q
            a_fl += ops * r * K
            pre = bool(kreductions(op, s.k))
            p_bytes += c * ins
            if pre and l2:
                p_l2 += c * ins
            elif pre:
                p_bytes += c * ins
            p_fl += c * ops * r * K
            again = ""
            if pre:
                again = ("; again after the pre-loop, from L2" if l2 else
                         "; again after the pre-loop, from HBM: the resident row tiles do not fit in L2"
                         + ("" if device is not None else ", or no device says they do"))
            lines.append(f"operand {side} = {pretty(op)}: scaled_mm reads its inputs once ({ins} B), writes "
                         f"q and its scale ({q} B) and reads them {c}x; prologue reads its inputs {c}x "
                         f"({c * ins} B{again}) and computes it {c}x")
        o = M * N * out_bytes
        a_bytes += o
        p_bytes += o
        out["scaled_mm"] = Cost("scaled_mm", a_bytes, 0, a_fl, "; ".join(lines))
        out["prologue"] = Cost("prologue", p_bytes, p_l2, p_fl, "")
        return out

    def _l2_fits(self, M, N, K, es, bm, bn, device) -> bool:
        """The prologue's main loop finds its pre-looped row tiles in L2: between a tile's
        pre-loop read and its main-loop read every resident program (one per SM) reads its whole
        row tiles; in grouped order (GROUP_M = 8 row tiles cycled fastest) R resident programs
        hold min(c_m, 8 * ceil(R / (8 * c_n))) row tiles of A and min(c_n, ceil(R / 8)) of B.
        Those bytes must fit in the L2; unknown without a CUDA device (then: no)."""
        if isinstance(device, torch.device):
            if device.type != "cuda":
                return False
            props = torch.cuda.get_device_properties(device)
        elif device is None:
            return False
        else:
            props = device   # anything with multi_processor_count and L2_cache_size (bytes)
        s = self.split
        cm, cn = math.ceil(M / bm), math.ceil(N / bn)
        R = min(props.multi_processor_count, cm * cn)
        tiles = {"a": min(cm, 8 * math.ceil(R / (8 * cn))), "b": min(cn, math.ceil(R / 8))}
        size = {"a": bm, "b": bn}
        foot = sum(tiles[x] * size[x] * K * es[n] for x in "ab" for n in _inputs_of(s.operand[x])
                   if s.k in s.tensors[n])
        return foot <= props.L2_cache_size

    def choose(self, M, N, K, dtypes, out_bytes, cuda=True, device=None):
        """(form, costs, why): the byte model's choice (the CPU's; on a GPU the explanation,
        measured times decide: __call__)."""
        costs = self.cost(M, N, K, dtypes, out_bytes, cuda, device)
        why_not = self.scaled_mm_why_not(dtypes)
        if why_not:
            return "prologue", costs, f"scaled_mm does not apply: {why_not}"
        a, p = costs["scaled_mm"], costs["prologue"]
        key = lambda c: (c.hbm_bytes, c.flops)   # noqa: E731 - bytes first, then FLOPs (DESIGN.md)
        form = "prologue" if key(p) <= key(a) else "scaled_mm"
        other = a if form == "prologue" else p
        win = costs[form]
        if win.hbm_bytes < other.hbm_bytes:
            why = (f"{form} moves {win.hbm_bytes:,} B from HBM, {other.form} "
                   f"{other.hbm_bytes:,} B ({100 * (other.hbm_bytes / win.hbm_bytes - 1):.2f}% more)")
        else:
            why = f"equal HBM bytes; {form} does {win.flops:.4g} FLOPs, {other.form} {other.flops:.4g}"
        return form, costs, why

    def scaled_mm_why_not(self, dtypes) -> str:
        s = self.split
        if s.scaled_why_not:
            return s.scaled_why_not
        fm = [operand_format(s.operand[x], dtypes) for x in "ab"]
        if not all(fm):
            bad = "a" if not fm[0] else "b"
            return (f"operand {bad} `{pretty(s.operand[bad])}` is not float8 (a cast to float8_e4m3fn/e5m2, or a "
                    "float8 input)")
        return ""

    def explain(self, **inputs) -> str:
        s = self.split
        L = [f"program {s.name!r}, output {s.output!r}: a GEMM over {s.k!r}, out[{s.axis_a}, {s.axis_b}]",
             f"  operand a [{s.axis_a}, {s.k}] = {pretty(s.operand['a'])}",
             f"  operand b [{s.axis_b}, {s.k}] = {pretty(s.operand['b'])}",
             f"  epilogue = {pretty(s.epilogue).replace('acc_J', 'acc')}   (acc = {pretty(s.contraction)})"]
        for side in "ab":
            reds = kreductions(s.operand[side], s.k)
            if reds:
                L.append(f"  prologue form: operand {side}'s pre-loop over {s.k!r} computes "
                         + ", ".join(f"`{pretty(r)}`" for r in reds) + "; each k step computes the operand tile")
        if s.scale:
            L.append(f"  scaled_mm form: scale_a = {pretty(s.scale['a']) if s.scale['a'] else '1'}, "
                     f"scale_b = {pretty(s.scale['b']) if s.scale['b'] else '1'}")
        else:
            L.append(f"  scaled_mm form: not available ({s.scaled_why_not})")
        L.append("  cost model (bytes from HBM first, then FLOPs; acefuse/quant_gemm.py):")
        L.append("    scaled_mm = inputs once + q and its scale written + read ceil(N/BLOCK_N) times + out; "
                 "prologue = inputs 2*ceil(N/BLOCK_N) times (pre-loop, main loop: L2 where the resident row "
                 "tiles fit) + out; on a GPU measured times decide")
        if inputs:
            M, N, K, dtypes, cuda = self._shapes(inputs)
            dev = next(iter(inputs.values())).device
            od = self._out_dtype(dtypes, None)
            form, costs, why = self.choose(M, N, K, dtypes, torch.empty((), dtype=od).element_size(), cuda,
                                           dev if cuda else None)
            bm, bn, bk = self.blocks(cuda)
            L.append(f"  at M={M}, N={N}, K={K} (blocks {bm}x{bn}x{bk}): "
                     + "; ".join(f"{c.form}: {c.hbm_bytes / 1e6:.3f} MB HBM"
                                 + (f" + {c.l2_bytes / 1e6:.3f} MB L2" if c.l2_bytes else "")
                                 + f", {c.flops / 1e9:.4g} GFLOP" for c in costs.values()))
            L.append(f"    {costs['scaled_mm'].detail}")
            meas = self.measured(**inputs)
            if not cuda:
                L.append(f"  chosen: {form} (the byte model: {why})")
            elif meas is None:
                L.append(f"  byte model: {form} ({why}); on this GPU the first call times the forms "
                         "(not yet measured for these shapes)")
            else:
                best, times = meas
                L.append(f"  byte model: {form} ({why})")
                L.append(f"  measured on {torch.cuda.get_device_name(dev)} (shapes rounded up to powers of two, "
                         f"out {od}): " + "; ".join(
                             f"{_cand_name(c)} {ms:.3f} ms" for c, ms in sorted(times.items(), key=lambda x: x[1])))
                L.append(f"  chosen: {_cand_name(best)} (measured fastest"
                         + ("; the byte model agrees)" if best[0] == form else "; the byte model disagrees)"))
        return "\n".join(L)

    # -- running --------------------------------------------------------------------------
    def _shapes(self, inputs):
        s = self.split
        sizes = {}
        for name, axes in s.tensors.items():
            if name not in inputs:
                raise GemmError(f"program {s.name!r}: input {name!r} missing (inputs: {sorted(s.tensors)})")
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input {name!r} of program {s.name!r} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
            if t.dtype not in _INPUT_OK:
                raise _type_error(s.name, name, t.dtype, _INPUT_OK)
            if t.dim() != len(axes):
                raise GemmError(f"program {s.name!r}: input {name!r} has {t.dim()} dims, declared "
                                f"{' '.join(axes)}")
            for ax, n in zip(axes, t.shape):
                if sizes.setdefault(ax, n) != n:
                    raise GemmError(f"program {s.name!r}: axis {ax!r} is {sizes[ax]} elsewhere but {n} in "
                                    f"input {name!r}")
        dtypes = {n: inputs[n].dtype for n in s.tensors}
        dev = next(iter(inputs.values())).device
        return sizes[s.axis_a], sizes[s.axis_b], sizes[s.k], dtypes, dev.type == "cuda"

    def _out_dtype(self, dtypes, out_dtype):
        if out_dtype is not None:
            return out_dtype
        # the operands' floating inputs, float8 aside, promoted as torch promotes them (bfloat16
        # activations give bfloat16; the epilogue's float32 scales do not count)
        names = _inputs_of(self.split.operand["a"]) | _inputs_of(self.split.operand["b"])
        fl = [dtypes[n] for n in sorted(names) if dtypes[n].is_floating_point and dtypes[n] not in _TORCH_FP8]
        out = fl[0] if fl else torch.float32
        for d in fl[1:]:
            out = torch.promote_types(out, d)
        return out

    # -- the measured choice (a GPU) -------------------------------------------------------
    def prologue_configs(self, cuda):
        """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) candidates of the prologue form:
        the given block only where gemm(block=...) fixed it; on the CPU one."""
        if self.block is not None and len(self.block) == 5:
            return [tuple(self.block)]
        if self.block is not None or not cuda:
            return [tuple(self.blocks(cuda)) + ((8, 3) if cuda else (4, 1))]
        return list(PROLOGUE_CONFIGS)

    def _key(self, M, N, K, dtypes, od, dev):
        s = self.split
        return ((s.name, pretty(s.operand["a"]), pretty(s.operand["b"]), pretty(s.epilogue)), str(dev),
                torch.cuda.get_device_name(dev), _np2(M), _np2(N), _np2(K),
                tuple(sorted((n, str(d)) for n, d in dtypes.items())), str(od))

    def measured(self, out_dtype=None, **inputs):
        """(best candidate, {candidate: ms}) timed for these inputs' key, or None (not yet)."""
        M, N, K, dtypes, cuda = self._shapes(inputs)
        if not cuda:
            return None
        dev = next(iter(inputs.values())).device
        return _MEASURED.get(self._key(M, N, K, dtypes, self._out_dtype(dtypes, out_dtype), dev))

    def _measure(self, inputs, od, M, N, K, dtypes):
        """Time every applicable candidate once per key (shapes rounded up to powers of two)
        on these inputs, keep the fastest: ("scaled_mm", None) or ("prologue", config)."""
        dev = next(iter(inputs.values())).device
        key = self._key(M, N, K, dtypes, od, dev)
        if key not in _MEASURED:
            cands = [] if self.scaled_mm_why_not(dtypes) else [("scaled_mm", None)]
            cands += [("prologue", c) for c in self.prologue_configs(True)]

            def call(c):
                if c[0] == "scaled_mm":
                    return self._run_scaled(inputs, od, M, N, K)
                return self._run_prologue(inputs, od, M, N, K, dtypes, True, config=c[1])
            mod = self._module()
            mod._TUNING.append(1)   # a candidate Triton cannot compile is skipped, not retried
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    best, times = _fastest_timed(cands, call)
            finally:
                mod._TUNING.pop()
            if best is None:   # nothing ran: the byte model's choice, whose call raises the error
                form = self.choose(M, N, K, dtypes, torch.empty((), dtype=od).element_size(), True, dev)[0]
                return (form, None)
            _MEASURED[key] = (best, times)
        return _MEASURED[key][0]

    def __call__(self, form="auto", out_dtype=None, **inputs):
        M, N, K, dtypes, cuda = self._shapes(inputs)
        od = self._out_dtype(dtypes, out_dtype)
        config = None
        if form == "auto":
            if cuda:
                form, config = self._measure(inputs, od, M, N, K, dtypes)
            else:
                form = self.choose(M, N, K, dtypes, torch.empty((), dtype=od).element_size(), cuda)[0]
        if form not in FORMS:
            raise GemmError(f"form {form!r}: one of {FORMS} or 'auto'")
        if form == "prologue" and config is None and cuda:   # forced: the fastest timed config, if any
            meas = self.measured(out_dtype=od, **inputs)
            pro = [(ms, c) for c, ms in meas[1].items() if c[0] == "prologue"] if meas else []
            config = min(pro)[1][1] if pro else None
        self.last_form = form
        if form == "scaled_mm":
            why = self.scaled_mm_why_not(dtypes)
            if why:
                raise GemmError(f"program {self.split.name!r}: form 'scaled_mm' does not apply: {why}; use "
                                "form='prologue'")
            out = self._run_scaled(inputs, od, M, N, K)
        else:
            out = self._run_prologue(inputs, od, M, N, K, dtypes, cuda, config=config)
        return {self.split.output: out}

    def side_program(self, side):
        """The row-family program that materializes operand ``side``: q = the operand and
        scale = its epilogue factor (float32); None for a bare input."""
        s = self.split
        op = s.operand[side]
        if op.op == "In":
            return None
        if side not in self._sides:
            from acefuse.lang import program
            ax = s.axis_a if side == "a" else s.axis_b
            sub = lambda t: {n: a for n, a in s.tensors.items() if n in _inputs_of(t)}   # noqa: E731
            outs = {"q": Expr(op, (ax, s.k), sub(op))}
            f = s.scale.get(side)
            if f is not None and f.op not in ("In", "Num"):
                f32 = f if (f.op == "Cast" and f.args[1] == "float32") else Term("Cast", (f, "float32"))
                outs["scale"] = Expr(f32, (ax,), sub(f32))
            self._sides[side] = program(f"{s.name}_{side}_operand", **outs)
        return self._sides[side]

    def _side_kernel(self, side):
        key = ("k", side)
        if key not in self._sides:
            from acefuse.codegen.compile import compile_program
            p = self.side_program(side)
            self._sides[key] = None if p is None else compile_program(p)
        return self._sides[key]

    def materialize(self, side, inputs):
        """(q, scale) of operand ``side`` as the scaled_mm form computes them."""
        s = self.split
        op, f = s.operand[side], s.scale.get(side)
        k = self._side_kernel(side)
        if k is None:
            q, res = inputs[op.args[0]], {}
        else:
            res = k(**{n: inputs[n] for n in k.program.tensors})
            q = res["q"]
        rows = q.shape[0]
        if f is None:
            sc = torch.ones(rows, dtype=torch.float32, device=q.device)
        elif f.op == "In":
            sc = inputs[f.args[0]].float()
        elif f.op == "Num":
            sc = torch.full((rows,), float(f.args[0]), dtype=torch.float32, device=q.device)
        else:
            sc = res["scale"].float()
        return q, sc

    def _run_scaled(self, inputs, od, M, N, K):
        qa, sa = self.materialize("a", inputs)
        qb, sb = self.materialize("b", inputs)
        why = ""
        if not (qa.is_cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(qa.device) >= (8, 9)):
            why = "no CUDA GPU of compute capability >= 8.9"
        elif K % 16 or N % 16:
            why = f"_scaled_mm needs k and n multiples of 16 (k={K}, n={N})"
        elif qa.dtype == qb.dtype == torch.float8_e5m2:
            why = "_scaled_mm does not take two float8_e5m2 operands"
        if not why:
            try:
                out = torch._scaled_mm(qa.contiguous(), qb.contiguous().t(), scale_a=sa[:, None].contiguous(),
                                       scale_b=sb[None, :].contiguous(), out_dtype=od)
                self.last_path = "torch._scaled_mm"
                return out
            except RuntimeError as exc:   # e.g. a torch whose row-wise scaling takes bfloat16 output only
                why = f"torch._scaled_mm refused it: {str(exc).splitlines()[0]}"
                warnings.warn(f"af.gemm({self.split.name!r}), form 'scaled_mm': {why}; computing the same "
                              "product as a float32 matmul of the float8 values", RuntimeWarning, stacklevel=3)
        # the same product: exact float8 values, float32 accumulation (another order than _scaled_mm's)
        self.last_path = f"float32 matmul of the float8 values ({why})"
        return ((qa.float() @ qb.float().t()) * sa[:, None] * sb[None, :]).to(od)

    def _module(self):
        if self._prologue is None:
            from acefuse.codegen.compile import cached_source, load_module, code_version
            src = generate(self.split, self.explain())
            h = hashlib.sha256((code_version() + src).encode()).hexdigest()[:16]
            path = cached_source(f"{self.split.name}_gemm", h, src)
            self._prologue = (src, path, load_module(path, f"acefuse_gen_{self.split.name}_gemm_{h}"))
        return self._prologue[2]

    @property
    def source(self):
        self._module()
        return self._prologue[0]

    def _run_prologue(self, inputs, od, M, N, K, dtypes, cuda, config=None):
        """The generated GEMM; ``config`` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
        (default: blocks() with 8 warps, 3 stages)."""
        mod = self._module()
        s = self.split
        if config is None:
            config = self.prologue_configs(cuda)[0]
        bm, bn, bk, warps, stages = config
        args = []
        for name in sorted(s.tensors):
            t = inputs[name]
            args.append(t)
            args += [t.stride(i) for i in range(t.dim())]
        dev = inputs[next(iter(s.tensors))].device
        out = torch.empty(M, N, dtype=od, device=dev)
        fa, fb = (operand_format(s.operand[x], dtypes) for x in "ab")
        fp8 = self.fp8_dot and bool(mod._native()) and fa > 0 and fb > 0
        bf16 = od == torch.bfloat16
        # the launch options; a config Triton cannot compile is retried with safer ones
        # (num_stages=1, then other warp counts) and those kept, or KernelCompileError
        # (codegen/launch_retry.py, as every generated launcher)
        what = f"{s.name}_gemm"
        p = mod._Options(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **(dict(num_warps=warps, num_stages=stages)
                                                                   if cuda else {})))
        key = tuple(str(dtypes[n]) for n in sorted(s.tensors)) + (str(od), str(fp8))
        if not mod._TUNING:   # (a timed candidate runs as labelled)
            mod._remember(p, what, key)
        grid = (math.ceil(M / bm) * math.ceil(N / bn),)

        def launch():
            getattr(mod, what)[grid](*args, out.view(torch.int16) if bf16 else out, out.stride(0), out.stride(1),
                                     M, N, K, GROUP_M=8, FMT_A=fa, FMT_B=fb, FP8_DOT=fp8, OUT_BF16=bf16, **p.kw)
        try:
            launch()
        except Exception as exc:  # noqa: BLE001 - _safer_launch raises what is not a compile error
            mod._safer_launch(p, what, launch, exc, key)
        self.last_path = "generated Triton GEMM" + (" (float8 dot)" if fp8 else " (float32 dot)")
        return out


def gemm(prog, output=None, block=None) -> GemmKernel:
    """Compile a program whose output is a GEMM with program operands (acefuse.quant_gemm).
    ``block``: the prologue form's (BLOCK_M, BLOCK_N, BLOCK_K) or (..., num_warps, num_stages),
    fixed (default: the byte model's blocks, and on a GPU the timed PROLOGUE_CONFIGS)."""
    return GemmKernel(prog, output, block)
