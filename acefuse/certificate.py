"""The certificate of a fusion: every step from the program as written to every
expression the kernel evaluates, proved for all block sizes (proofs/certify.py).

Steps (one claim each, ``Certificate.step``):

* ``normal form`` (per output): the normalised program's output equals the
  program's as written, over the whole axis ``J`` (reductions over generic
  blocks, so for every length of the axis);
* ``finalize`` / ``epilogue`` (per output; per row / elementwise over the fused
  axis): the encoded output, a term over final states ``St(q, J)``, equals the
  normalised program's output when each final state is its definition over ``J``;
* ``init`` (per carried state): the kernel's first-tile expression equals the
  state's definition over the tile ``B``;
* ``rolling`` and ``merge`` (per carried state): ``St(q, A u B)`` equals the
  derived update (from the running states of ``A`` and the raw tile ``B``) and the
  derived merge (from the states of ``A`` and ``B``).

States of a later pass read the states finished by earlier passes as opaque
values (``Par(k_final)``): the claims hold whatever those values are. With the
finalize step (``St(q, J)`` is the definition over the whole axis, of which a
later pass's view is the same term) this chains, by induction over the tiles,
from the program to the kernel's outputs.

    >>> import acefuse as af
    >>> x = af.tensor("x", "r j"); m = af.max(x, "j")
    >>> cert = af.fuse(af.program("lse", out=m + af.log(af.sum(af.exp(x - m), "j")))).certificate
    >>> cert.ok, sorted({c.step for c in cert.steps})
    (True, ['finalize', 'init', 'merge', 'normal form', 'rolling'])
"""
from __future__ import annotations

import time
import warnings

from acefuse.rewrite.terms import Term, A, B, U, pretty, substitute, reblock
from acefuse.rewrite.encode import _Axes, RED_OPS
from acefuse.proofs.certify import Certificate, StateDef, certify_claim, Unsupported

J = Term("BJ")
AB = U(A, B)
_STRUCTURAL = {"Erf", "Sigmoid", "Softplus", "Log1p", "Expm1", "Floor", "Ceil", "Round", "FloorDiv", "Mod",
               "BitAnd", "BitOr", "BitXor", "BitNot", "Shl", "Shr", "Add", "Sub", "Mul", "Div", "Neg", "Exp", "Log", "Sqrt", "Rsqrt", "Abs", "Tanh",
               "Max2", "Min2", "Pow", "Where", "CmpLt", "CmpLe", "CmpGt", "CmpGe", "CmpEq", "CmpNe",
               "LAnd", "LOr", "LNot", "Cast"}
_MEMO: dict = {}
_MEMO_SIZE = 512
_WARNED: set = set()


class UncertifiedFusionWarning(UserWarning):
    """af.compile met a fusion whose certificate is not complete (see the message)."""


class FusionCertificate(dict):
    """``{(state, "rolling" | "merge"): Certificate}`` for the derived updates and merges,
    and ``steps``: the certificates of every step (normal form, init, rolling, merge,
    finalize, epilogue). ``ok`` is true when every step is certified."""

    def __init__(self, steps: list):
        super().__init__({(c.state, c.step): c for c in steps if c.step in ("rolling", "merge")})
        self.steps = list(steps)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.steps)

    @property
    def failures(self) -> list:
        return [c for c in self.steps if not c.ok]

    def summary(self) -> str:
        lines = []
        for c in self.steps:
            lines.append(f"{c.step:>11} {c.state:<8} {c.status}: {c.detail}")
        return "\n".join(lines)


# ---- program-level terms as terms over the whole axis J ---------------------------------------
class ProgramTerms:
    """Program-level terms (reductions written over the axis) as claim terms over ``J``:
    a reduction over the fused axis becomes a reduction over ``J``, ``size(axis)`` the
    count of ``J``, inputs and other opaque subterms free of fused reductions become
    ``Elm``/``Par`` leaves (by whether they depend on the fused axis), arithmetic stays."""

    def __init__(self, axis: str, tensors: dict):
        self.axis = axis
        self.tensors = tensors
        self.axes_of = _Axes(tensors)
        self.names: dict = {}
        self.used: set = set()

    def _fused(self, t: Term) -> bool:
        # size(axis) alone does not count: over J it is one value, the count of J, and an
        # opaque leaf holding it (a lookup at j - i + size(i) - 1) is named by its term, so
        # that a claim proved for every value of the leaf holds for that one
        return any((s.op in RED_OPS and s.args[0].op == "Ax" and s.args[0].args[0] == self.axis)
                   or s.op in ("St", "Cnt") for s in t.walk())

    def _opaque(self, t: Term) -> Term:
        name = self.names.get(t)
        if name is None:
            base = t.args[0] if t.op == "In" else "{" + pretty(t) + "}"
            name, k = base, 1
            while name in self.used:
                k += 1
                name = f"{base}#{k}"
            self.names[t] = name
            self.used.add(name)
        return Term("Elm" if self.axis in self.axes_of(t) else "Par", (name,))

    def __call__(self, t: Term) -> Term:
        op = t.op
        if op in RED_OPS and t.args[0].op == "Ax":
            if t.args[0].args[0] == self.axis:
                return Term(op, (J, self(t.args[1])))
        elif op == "Size" and t.args[0] == self.axis:
            return Term("Cnt", (J,))
        elif op in ("St", "Cnt"):
            return t
        elif op == "Num":
            if isinstance(t.args[0], float) and abs(t.args[0]) != float("inf"):
                return t
        elif op in _STRUCTURAL:
            return Term(op, tuple(self(a) if isinstance(a, Term) else a for a in t.args))
        if self._fused(t):
            raise Unsupported(f"`{pretty(t)}` holds a reduction over {self.axis!r} inside an operator "
                              "the certificate does not model")
        return self._opaque(t)


def _output_program(enc, k) -> Term:
    """The normalised program's output ``k``: the encoded output with every final state
    replaced by the program-level reduction it stands for."""
    return substitute(enc.outputs[k], {Term("St", (s.name, J)): s.source for s in enc.states})


def _unsupported(subject, step, exc, t0) -> Certificate:
    return Certificate(subject, "unproved", None, True, 0.0, None,
                       f"the claim is outside the certified class: {exc}", time.perf_counter() - t0, step)


def _claim(states, lhs, rhs, subject, step, **kw) -> Certificate:
    """certify_claim, with a malformed claim (an unknown state, a block that is not a
    disjoint union) reported as a failed step rather than raised."""
    t0 = time.perf_counter()
    try:
        return certify_claim(states, lhs, rhs, subject, step, **kw)
    except Unsupported as exc:
        return _unsupported(subject, step, exc, t0)
    except ValueError as exc:
        if not str(exc).startswith("certify:"):
            raise
        return Certificate(subject, "failed", False, False, float("inf"), None, str(exc),
                           time.perf_counter() - t0, step)


def _trivial(subject, step, what) -> Certificate:
    return Certificate(subject, "certified", True, True, 0.0, None,
                       f"both sides are the same term ({what})", 0.0, step)


def _key(f) -> tuple:
    enc = f.encoding
    return (f.axis, tuple((k, e.term) for k, e in f.program.outputs.items()),
            tuple(sorted((k, tuple(v)) for k, v in {**enc.tensors, **f.program.tensors}.items())),
            tuple((s.name, s.op, s.definition, s.source) for s in enc.states),
            tuple(sorted(enc.leaves.items())), tuple(enc.outputs.items()), enc.elementwise_outputs,
            tuple((p.known, tuple(s.name for s in p.states), tuple(sorted(p.init.items())),
                   tuple(sorted(p.rolling.items())), tuple(sorted(p.merge.items()))) for p in f.passes))


def certify_fusion(f) -> FusionCertificate:
    """Certify every step of a Fusion (memoised on its content within the process)."""
    try:
        key = _key(f)
        hash(key)
    except TypeError:  # pragma: no cover - unhashable payloads: no memo
        key = None
    if key is not None and key in _MEMO:
        return _MEMO[key]
    if getattr(f, "topk_groups", None):   # k-candidate states: acefuse/topk_fuse.py certifies them
        from acefuse.topk_fuse import certify as certify_topk
        steps = certify_topk(f)
    else:
        steps = _program_steps(f) + _pass_steps(f)
    cert = FusionCertificate(steps)
    if key is not None:
        if len(_MEMO) >= _MEMO_SIZE:   # a fuzzer compiles thousands of programs: stay bounded
            _MEMO.clear()
        _MEMO[key] = cert
    return cert


def _program_steps(f) -> list:
    enc = f.encoding
    pt = ProgramTerms(f.axis, {**enc.tensors, **f.program.tensors})
    out = []
    # leaves of the encoding, as claim terms (so that both sides name the same values)
    leaf_terms: dict = {}
    try:
        for name, t in enc.leaves.items():
            kind = "Elm" if f.axis in pt.axes_of(t) else "Par"
            leaf_terms[Term(kind, (name,))] = pt(t)
    except Unsupported as exc:
        leaf_terms = exc
    defs = []
    if not isinstance(leaf_terms, Exception):
        defs = [StateDef(s.name, s.op, substitute(s.definition, leaf_terms)) for s in enc.states]
    normal_prog = getattr(f, "normal_program", None)
    changed = {n.split(":", 1)[0][len("normal form of "):] for n in f.normal_form if n.startswith("normal form of ")}
    for k, e in f.program.outputs.items():
        t0 = time.perf_counter()
        if k not in enc.outputs:
            normal = None
        elif normal_prog is not None and k in normal_prog.outputs:
            normal = normal_prog.outputs[k].term
        elif k in changed:   # the normalised output, recovered from the encoding
            normal = _output_program(enc, k)
        else:                # normalisation kept the output as written
            normal = e.term
        if normal is None:
            out.append(Certificate(k, "failed", False, False, float("inf"), None,
                                   f"output {k!r} of the program has no encoded output", 0.0, "normal form"))
            continue
        if normal == e.term:
            out.append(_trivial(k, "normal form", "the program as written is its normal form"))
        else:
            try:
                out.append(_claim([], pt(e.term), pt(normal), k, "normal form", trials=30))
            except Unsupported as exc:
                out.append(_unsupported(k, "normal form", exc, t0))
        step = "epilogue" if k in enc.elementwise_outputs else "finalize"
        t0 = time.perf_counter()
        if isinstance(leaf_terms, Exception):
            out.append(_unsupported(k, step, leaf_terms, t0))
            continue
        try:
            out.append(_claim(defs, pt(normal), pt(enc.outputs[k]), k, step, trials=30))
        except Unsupported as exc:
            out.append(_unsupported(k, step, exc, t0))
    return out


class _View:
    """A state definition with the states finished by earlier passes read as final values."""

    def __init__(self, s, known: dict):
        self.name, self.op = s.name, s.op
        self.definition = _known_to_par(s.definition, known)


def _known_to_par(t: Term, known: dict) -> Term:
    if t.op == "St" and t.args[0] in known:
        return known[t.args[0]]
    if not t.children:
        return t
    return Term(t.op, tuple(_known_to_par(a, known) if isinstance(a, Term) else a for a in t.args))


def _pass_steps(f) -> list:
    out = []
    defs = list(f.encoding.states)
    for p in f.passes:
        known = {k: Term("Par", (f"{k}_final",)) for k in p.known}
        fin = {Term("St", (k, J)): v for k, v in known.items()}
        views = [_View(s, known) for s in defs if s.name not in p.known]
        vd = {v.name: v for v in views}
        for s in p.states:
            init = substitute(p.init[s.name], fin)
            if init == reblock(vd[s.name].definition, B):
                out.append(_trivial(s.name, "init", "the state's definition over the tile B"))
            else:
                out.append(_claim(views, Term("St", (s.name, B)), init, s.name, "init"))
            for step, forms in (("rolling", p.rolling), ("merge", p.merge)):
                if s.name in forms:
                    out.append(_claim(views, Term("St", (s.name, AB)), substitute(forms[s.name], fin),
                                      s.name, step))
    return out


# ---- af.compile's gate -------------------------------------------------------------------------
def describe_failure(f, cert: FusionCertificate) -> str:
    c = cert.failures[0]
    more = f" (and {len(cert.failures) - 1} more)" if len(cert.failures) > 1 else ""
    return (f"the {c.step} step for {c.state!r} is {c.status}{more}: {c.detail}")


def warn_uncertified(f, cert: FusionCertificate, used: bool) -> None:
    """Warn once per program (and axis, and choice) that its fusion is not certified."""
    prog = f.program
    key = (prog.name, prog.key() if hasattr(prog, "key") else None, f.axis, used)
    if key in _WARNED:
        return
    _WARNED.add(key)
    why = describe_failure(f, cert)
    if used:
        msg = (f"acefuse: program {f.program.name!r}: USING AN UNCERTIFIED FUSION over {f.axis!r} because "
               f"allow_uncertified=True: {why}. Its results are not guaranteed to match the program.")
    else:
        msg = (f"acefuse: program {f.program.name!r}: the fusion over {f.axis!r} is not certified ({why}); "
               "compiling the unfused kernel instead (one pass per reduction depth, each update the plain "
               "split law). Pass allow_uncertified=True to af.compile to use the uncertified fused kernel "
               "anyway (not recommended).")
    warnings.warn(msg, UncertifiedFusionWarning, stacklevel=4)
