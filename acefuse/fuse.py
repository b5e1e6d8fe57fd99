"""af.fuse: equality saturation + extraction of the fused forms of a program.

A fused *pass* reads the fused axis once and carries a set of states. For each
state it holds three derived expressions:

- ``init``: the state over the first tile (its definition over block B),
- ``rolling``: ``St(q, A u B)`` from the running states of the prefix A and the
  raw tile B (FlashAttention-style),
- ``merge``: ``St(q, A u B)`` from the finished partial states of A and B only
  (FlashDecoding-style, also the cross-device combine).

A state whose rolling form has no finite cost is not fusible: it (and what
depends on it) moves to a later pass, where the states it needs are final.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import time

from acefuse.rewrite.terms import Term, A, B, U, pretty, substitute, reblock
from acefuse.rewrite.encode import encode, Encoding, StateDef, RED_OPS
from acefuse.rewrite.egraph import EGraph, RunStats
from acefuse.rewrite import schedules, auxiliary
from acefuse.extract.extractor import Extractor, Reach
from acefuse.extract import cost as C
from acefuse.extract import simulate

AB = U(A, B)
J = Term("BJ")


class FuseError(ValueError):
    """The program cannot be fused as asked; the message says what to change."""


@dataclass
class FusionPass:
    """One read of the fused axis and the states it carries."""

    index: int
    states: list                       # carried StateDefs (no refs), in update order
    refs: list                         # reference states used by them
    init: dict = field(default_factory=dict)
    rolling: dict = field(default_factory=dict)
    merge: dict = field(default_factory=dict)   # empty when the split schedule is not available
    rolling_cost: dict = field(default_factory=dict)
    merge_cost: dict = field(default_factory=dict)
    stats: RunStats | None = None
    egraph: object = None
    known: tuple = ()                  # states finished in earlier passes
    schedule: object = None            # the schedule it was derived with (None: the fusion's)

    @property
    def split_ok(self) -> bool:
        return bool(self.states) and all(s.name in self.merge for s in self.states)


@dataclass
class Fusion:
    program: object
    axis: str
    encoding: Encoding
    passes: list
    fusible: bool
    reason: str
    blocked: list                       # (state, reason) for every state that needed another pass
    rules: list
    seconds: float = 0.0
    schedule: object = None
    normal_form: list = field(default_factory=list)   # what normal-form extraction changed
    _chains: dict = field(default_factory=dict)
    _certs: dict = field(default_factory=dict)

    # -- summary ------------------------------------------------------------------------
    @property
    def states(self) -> list:
        return [s for p in self.passes for s in p.states]

    @property
    def hbm_passes(self) -> dict:
        """Reads of the input over the fused axis: plain evaluation vs the fused kernel
        (a row longer than one tile; a row that fits one tile is read once)."""
        ep = 1 if self.encoding.elementwise_outputs else 0
        return {"unfused": self.encoding.unfused_passes, "fused": len(self.passes) + ep}

    def state(self, name) -> StateDef:
        return self.encoding.state(name)

    # -- explanation ----------------------------------------------------------------------
    def rule_chain(self, name: str, form: str = "rolling") -> list:
        """The named rules needed to derive a correction, in the order they first fired
        (reconstructed by ablation: a rule is in the chain when removing it loses the form)."""
        key = (name, form)
        if key not in self._chains:
            p = next((p for p in self.passes if any(s.name == name for s in p.states)), None)
            if p is None:
                raise KeyError(f"program {self.program.name!r} has no carried state {name!r}; "
                               f"states: {[s.name for s in self.states]}")
            self._chains.update(_ablate_pass(self, p))
        return self._chains.get(key, [])

    @property
    def certificate(self):
        """The certificate of every step, from the program as written to every expression
        the kernel evaluates (normal form, init, rolling, merge, finalize, epilogue), proved
        for all block sizes (acefuse/certificate.py, proofs/certify.py). A
        ``FusionCertificate``: ``{(state, "rolling" | "merge"): Certificate}`` plus
        ``.steps`` (every step) and ``.ok``. Memoised on the fusion's content."""
        from acefuse.certificate import certify_fusion
        return certify_fusion(self)

    def explain(self, chains: bool = True, timings: bool = False) -> str:
        """The derivation, readably. ``timings=True`` adds saturation times (wall clock; left
        out by default so the text, which heads every generated kernel, is deterministic)."""
        enc = self.encoding
        L = [f"program {self.program.name!r}, fused axis {self.axis!r}: "
             + ("fusible" if self.fusible else "NOT fully fusible")]
        if not self.fusible:
            L.append(f"  not fusible because {self.reason}")
        for note in self.normal_form:
            L.append("  " + note)
        L.append("states (block-local definitions over a block S):")
        for s in enc.states:
            L.append(f"  {s.name:>4} = {_show(s.definition, 'S')}    [{s.op}; from {pretty(s.source)}]")
            if s.aux:   # discovered, not written (rewrite/auxiliary.py)
                L.append(f"         auxiliary state, discovered: {s.aux}")
        hp = self.hbm_passes
        L.append(f"HBM passes over the input (rows longer than a tile): unfused {hp['unfused']}, "
                 f"fused {hp['fused']}")
        for p in self.passes:
            L.append(f"pass {p.index}: carries {', '.join(s.name for s in p.states)}"
                     + (f" (with {', '.join(p.known)} final from earlier passes)" if p.known else ""))
            if p.stats:
                L.append(f"  saturation {p.stats.describe(timing=timings)}")
            for s in p.states:
                L.append(f"  {s.name}:")
                L.append(f"    init     {s.name}_B  = {pretty(p.init[s.name])}")
                L.append(f"    rolling  {s.name}_AB = {pretty(p.rolling[s.name])}")
                if chains:
                    L.append(f"             rules: {' -> '.join(self.rule_chain(s.name, 'rolling')) or '(definition)'}")
                if s.name in p.merge:
                    L.append(f"    merge    {s.name}_AB = {pretty(p.merge[s.name])}")
                    if chains:
                        L.append(f"             rules: {' -> '.join(self.rule_chain(s.name, 'merge')) or '(definition)'}")
            if not p.split_ok:
                L.append("  split schedule: not available for this pass")
        L.append("outputs:")
        for k, t in enc.outputs.items():
            kind = "epilogue, elementwise over " + self.axis if k in enc.elementwise_outputs else "finalize, per row"
            L.append(f"  {k} = {_final_str(t)}    [{kind}]")
        from acefuse.extract.numerics import cancellation_text
        L.extend(cancellation_text(enc))
        return "\n".join(L)

    def to_json(self) -> dict:
        enc = self.encoding
        return {
            "program": self.program.name,
            "axis": self.axis,
            "fusible": self.fusible,
            "reason": self.reason or None,
            "hbm_passes": self.hbm_passes,
            "normal_form": list(self.normal_form),
            "passes": [{
                "index": p.index,
                "known": list(p.known),
                "split": p.split_ok,
                "saturation": {"stop_reason": p.stats.stop_reason, "iterations": p.stats.iterations,
                               "nodes": p.stats.nodes} if p.stats else None,
                "states": [{
                    "name": s.name, "op": s.op,
                    "definition": _show(s.definition, "S"),
                    "auxiliary": s.aux or None,   # why a discovered state was needed
                    "init": pretty(p.init[s.name]),
                    "rolling": pretty(p.rolling[s.name]),
                    "merge": pretty(p.merge[s.name]) if s.name in p.merge else None,
                    "rules": {"rolling": self.rule_chain(s.name, "rolling"),
                              "merge": self.rule_chain(s.name, "merge") if s.name in p.merge else []},
                } for s in p.states],
            } for p in self.passes],
            "references": [{"name": s.name, "definition": _show(s.definition, "S")}
                           for s in enc.states if s.op == "ref"],
            "outputs": [{"name": k, "expr": _final_str(t),
                         "kind": "epilogue" if k in enc.elementwise_outputs else "finalize"}
                        for k, t in enc.outputs.items()],
            "rules_used": sorted({r for p in self.passes for s in p.states
                                  for f in ("rolling", "merge") if f == "rolling" or s.name in p.merge
                                  for r in self.rule_chain(s.name, f)}),
        }


class _StateView:
    """A state definition with earlier-pass states read as final values."""

    def __init__(self, s: StateDef, known: dict):
        self.name, self.op = s.name, s.op
        self.definition = _known_to_final(s.definition, known)


def _known_to_final(t: Term, known: dict) -> Term:
    if t.op == "St" and t.args[0] in known:
        return known[t.args[0]]
    if not t.children:
        return t
    return Term(t.op, tuple(_known_to_final(a, known) if isinstance(a, Term) else a for a in t.args))


def _show(t: Term, blk: str) -> str:
    return pretty(t).replace("_A", "_" + blk).replace("sum_A(", f"sum_{blk}(").replace(
        "max_A(", f"max_{blk}(").replace("min_A(", f"min_{blk}(")


def _final_str(t: Term) -> str:
    return pretty(t).replace("_J", "")


def default_rules(extra=()) -> list:
    from acefuse.rules import REGISTRY
    return list(REGISTRY.values()) + list(extra)


def _build(enc: Encoding, pass_states: list, known: set, rules, allow_unproved=False, check_proofs=True):
    eg = EGraph(rules, check_proofs=check_proofs, allow_unproved=allow_unproved)
    finals = {k: Term("St", (k, J)) for k in known}
    for s in pass_states:
        d = _known_to_final(s.definition, finals)
        for blk in (A, B, AB):
            eg.union(Term("St", (s.name, blk)), reblock(d, blk))
    return eg




def _closure(states, names):
    """Names plus every state that (transitively) depends on one of them."""
    out = set(names)
    changed = True
    while changed:
        changed = False
        for s in states:
            if s.name not in out and any(d in out for d in s.deps):
                out.add(s.name)
                changed = True
    return out


def fuse(prog, axis: str | None = None, rules=(), schedule=None, allow_unproved: bool = False,
         check_proofs: bool = True) -> Fusion:
    """Derive the fused forms of ``prog`` over ``axis`` (default: its only reduced axis).

    ``rules`` adds user rules (each must pass its proof, see ``acefuse prove``);
    ``allow_unproved=True`` is the loud opt-out for experiments.
    """
    from acefuse.lang import Program
    if not isinstance(prog, Program):
        raise FuseError(f"af.fuse expects a program made with af.program(...), got {type(prog).__name__}")
    axis = _pick_axis(prog, axis)
    from acefuse.topk_fuse import fuse_topk   # af.topk: one k-candidate state (acefuse/topk_fuse.py)
    tk = fuse_topk(prog, axis) if not rules else None
    if tk is not None:
        return tk
    t0 = time.perf_counter()
    schedule = schedules.validate(schedule or schedules.DERIVE)
    all_rules = default_rules(rules)
    from acefuse.rewrite.normalize import normalize
    from acefuse.codegen.compile import stage
    staged = stage(prog, axis)
    stage_notes, stage_why = [], []
    while staged is not None:   # outputs that reduce, over another axis, what this axis computes
        s1, s2, hidden = staged
        notes2, why = _second_stage(s2, hidden, rules, allow_unproved, check_proofs)
        stage_notes[:0] = notes2   # (in the order they run)
        stage_why += [why] if why else []
        prog = s1
        staged = stage(prog, axis)   # stage 1 staged again: mean_b(mean_r(mean_j(x))) over j
    normal, notes = normalize(prog, axis, all_rules, check_proofs=check_proofs, allow_unproved=allow_unproved)
    notes = stage_notes + notes
    enc = encode(normal, axis)
    remaining = list(enc.states)
    known: set = set()
    passes, blocked = [], []
    # auxiliary-state discovery (rewrite/auxiliary.py): a pass whose states lack a reachable
    # form is derived again with the discovery schedules, in order, and the proposed states
    aux_defs: dict = {}               # definition -> name of the auxiliary states proposed
    aux_rounds = 0
    ladder = (schedule,) + schedules.discovery(schedule)
    level, base_ok, discover, limited, plain_pass = 0, None, True, False, None
    while remaining:
        eg = _build(enc, remaining, known, all_rules, allow_unproved, check_proofs)
        stats = eg.saturate(ladder[level])
        ex = Extractor(eg.serialized())
        carried = [s for s in remaining if s.op != "ref"]
        carried_names = frozenset(s.name for s in carried)
        p = FusionPass(len(passes) + 1, [], [], stats=stats, egraph=eg, known=tuple(sorted(known)))
        finals_known = {k: Term("St", (k, J)) for k in known}
        for s in remaining:
            if s.op != "ref":
                p.init[s.name] = reblock(_known_to_final(s.definition, finals_known), B)
        unsafe: dict = {}   # state -> why every form of it overflows float32 (extract/simulate.py)
        while True:
            ok, why = _extract_rolling(enc, ex, p, remaining, carried_names, known, unsafe)
            p.states = ok
            # a pass whose states read only final values runs the split law as written: exact,
            # and the fallback of every other form, so it is never refused
            plain = {x.name for x in ok if set(x.deps) <= known}
            bad = simulate.failures(enc, p, p.rolling, "rolling") if set(p.rolling) - plain else {}
            bad = {q: v for q, v in bad.items() if q not in plain}
            if not bad:
                break
            fresh = {q for q, (cause, _) in bad.items() if cause == "overflow"} - ex.strict_exp
            if fresh:   # only exponentials proved bounded above for these, then check again
                ex.strict_exp |= fresh
                continue
            # no safe form: these states take another pass
            unsafe.update({q: msg for q, (cause, msg) in bad.items()})
        if discover and aux_rounds < auxiliary.MAX_ROUNDS:
            ok_now = {x.name for x in ok if not x.aux}
            if base_ok is None:   # the plain derivation of this pass, kept to fall back on
                base_ok, plain_pass = ok_now, (enc, remaining, eg, stats, ex, p, ok, unsafe, why)
            new_enc = None
            if base_ok - ok_now:
                # this discovery schedule lost a state the plain one derives: drop what it
                # proposed and try the next one, or stop discovering
                aux_defs.clear()
                if level + 1 < len(ladder):
                    new_enc = auxiliary.prune(enc, {x.name for x in enc.states if x.aux and x.name in known})
                    level += 1
                else:
                    discover = False
            else:
                new_enc, why, structural = _auxiliary(enc, ex, p, remaining, known, unsafe, why, aux_defs)
                if level == 0:
                    plain_pass = plain_pass[:-1] + (why,)
                    limited = not stats.stop_reason.startswith(("saturated", "phase iteration cap"))
                nxt = level + 1
                while limited and nxt < len(ladder) and ladder[nxt].theories() >= ladder[0].theories():
                    nxt += 1   # the plain derivation stopped at a limit: a superset of it would too
                if new_enc is None and structural and nxt < len(ladder):
                    level, new_enc = nxt, enc   # nothing proposed: the next discovery schedule
            if new_enc is not None and aux_rounds + 1 < auxiliary.MAX_ROUNDS:
                aux_rounds += 1
                enc = new_enc if level == 0 else auxiliary.expand_powers(new_enc, [x.name for x in remaining])
                remaining = [x for x in enc.states if x.name not in known]
                continue
        if level and not any(x.aux for x in remaining):
            # discovery found nothing for this pass: its plain derivation stands
            enc, remaining, eg, stats, ex, p, ok, unsafe, why = plain_pass
            why = [(n, r if r.endswith(_NO_AUX) or n in unsafe else r + _NO_AUX) for n, r in why]
            level = 0
        p.schedule = ladder[level]
        p.states = ok
        level, base_ok, discover, limited, plain_pass = 0, None, True, False, None
        blocked.extend(why)
        # split merges for the states that fuse
        okn = frozenset(x.name for x in ok)
        for strict in (set(ex.strict_exp), {x.name for x in ok}):
            ex.strict_exp = strict
            p.merge.clear()
            for i, s in enumerate(ok):
                cid = ex.class_of(lambda op, args, n=s.name: op == "St" and args and args[0] == n
                                  and ex.blk.get(args[1]) == "AB")
                reach = Reach("split", okn, frozenset(x.name for x in ok[:i]))
                cost, term = ex.extract(cid, reach, target=s.name)
                if term is not None:
                    p.merge[s.name], p.merge_cost[s.name] = term, cost
            if not p.split_ok or not simulate.failures(enc, p, p.merge, "merge"):
                break
        if p.split_ok and simulate.failures(enc, p, p.merge, "merge"):
            p.merge.clear()        # no merge survives the float32 check: no split schedule
        if not ok:  # cannot happen: the first remaining reduction only reads final states
            raise FuseError(f"program {prog.name!r}: no state of pass {len(passes) + 1} could be "
                            f"formed over {axis!r} (states {[s.name for s in remaining]}); "
                            "this is a bug in acefuse, please report it with the program")
        p.init = {k: v for k, v in p.init.items() if k in {x.name for x in ok}}
        p.states = ok
        done = {s.name for s in ok}
        p.refs = [s for s in remaining if s.op == "ref" and set(s.deps) <= done | known]
        passes.append(p)
        known |= done | {r.name for r in p.refs}
        remaining = [s for s in remaining if s.name not in known]
    fusible = len(passes) <= 1 and not stage_why
    reason = "; ".join([r for _, r in blocked] + stage_why)
    f = Fusion(prog, axis, enc, passes, fusible, reason, blocked, all_rules,
               seconds=time.perf_counter() - t0, schedule=schedule, normal_form=notes)
    f.normal_program = normal   # the certificate checks the normal form against ``prog``
    return f


def _second_stage(s2, hidden, rules, allow_unproved, check_proofs):
    """(notes for explain(), why the program is not fusible or None) for the second stage of a
    staged program: fused here, with the axis its kernel is compiled over (codegen/compile.py
    compiles it as ``af.compile(s2)`` would), so that fuse's report and the kernels agree; the
    notes of its own stages follow its note."""
    head = (f"stage 2 (program {s2.name!r}, a separate program over {', '.join(hidden)}): "
            + "; ".join(f"{k} = {v}" for k, v in s2.outputs.items()))
    try:
        f2 = fuse(s2, rules=rules, allow_unproved=allow_unproved, check_proofs=check_proofs)
    except FuseError as exc:
        return [head + "; it does not compile"], f"stage 2 (program {s2.name!r}) does not compile: {exc}"
    own = [n for n in f2.normal_form if n.startswith("stage 2 (program")]
    if not f2.fusible:
        return ([head + f"; fused over {f2.axis!r}: NOT fully fusible"] + own,
                f"stage 2 (program {s2.name!r}, fused over {f2.axis!r}): {f2.reason}")
    return [head + f"; fused over {f2.axis!r}: fusible"] + own, None


def _extract_rolling(enc, ex, p, remaining, carried_names, known, unsafe):
    """The cheapest rolling form of every state of this pass that has one, in update order;
    (states that fuse, [(state, why not)] for the others). ``unsafe`` states failed the
    float32 check with every form (extract/simulate.py) and take another pass."""
    p.rolling.clear()
    p.rolling_cost.clear()
    failed: set = set()
    ok: list = []
    why: list = []
    for s in remaining:
        if s.op == "ref" or s.name in failed:
            continue
        if _depends_on(enc, s.name, failed):
            failed.add(s.name)
            continue
        if s.name in unsafe:
            failed.add(s.name)
            why.append((s.name, f"reduction `{pretty(s.source)}` (state {s.name}): every derived update "
                                f"fails the adversarial float32 check (extract/simulate.py): {unsafe[s.name]}; "
                                f"it takes another pass over {enc.axis!r}, which is exact"))
            continue
        cid = ex.class_of(lambda op, args, n=s.name: op == "St" and args and args[0] == n
                          and ex.blk.get(args[1]) == "AB")
        reach = Reach("rolling", carried_names - failed, frozenset(x.name for x in ok))
        cost, term = ex.extract(cid, reach, target=s.name)
        if term is None:
            failed.add(s.name)
            if s.name in ex.strict_exp:
                why.append((s.name, f"reduction `{pretty(s.source)}` (state {s.name}): its derived updates "
                                    "use exponentials that can overflow float32 where the program as written "
                                    "cannot (found by the adversarial float32 check, extract/simulate.py), and "
                                    "no form with every exponential bounded exists; it takes another pass over "
                                    f"{enc.axis!r}, which is exact"))
            else:
                why.append((s.name, _why(enc, s, known)))
            continue
        p.rolling[s.name], p.rolling_cost[s.name] = _canonical_extremum(p, s, term), cost
        ok.append(s)
    return ok, why


def _canonical_extremum(p, s, term):
    """A state whose definition reads only elements and final values rolls by its split law
    as written, ``s_A + sum_B(body)`` / ``max(m_A, max_B(body))``, with the definition's own
    body, never a rewritten one. A shift must be computed exactly as the maximum it
    subtracts: a max of ``(x + r) * c`` rolled as ``max_B(x * c) + r * c`` (fuzz seed 1012,
    program 57), or a later ``sum_B(exp(mn * r * e - m))`` reassociated from the max's
    ``mn * e * r`` (seed 1104, program 0), is rounded differently, and at magnitudes of 1e12
    and more ``exp(body - m)`` overflows where the value is finite."""
    init = p.init.get(s.name)
    comb = {"sum": ("Add", "Sum"), "max": ("Max2", "RMax"), "min": ("Min2", "RMin")}.get(s.op)
    if comb is None or init is None or init.op != comb[1] \
            or any(u.op == "St" and u.args[1].op != "BJ" for u in init.walk()):
        return term
    return Term(comb[0], (Term("St", (s.name, A)), init))


_NO_AUX = ("; no auxiliary state (a sum over the folded block of a subterm the rules produce, "
           "rewrite/auxiliary.py) makes it reachable either")


def _auxiliary(enc, ex, p, remaining, known, unsafe, why, aux_defs):
    """(an encoding to derive this pass again with, or None; the blocked reasons; whether a
    state is blocked for want of a reachable form, not by the float32 check). Proposes
    auxiliary states for the states of this pass that have no reachable rolling form
    (rewrite/auxiliary.py), or, when nothing new is proposed, drops the auxiliary states that
    no chosen form reads."""
    ok = {s.name for s in p.states}
    order = [s.name for s in remaining if s.op != "ref"]
    new_enc, added, out = enc, [], []
    for name, reason in why:
        if name in unsafe or name in ex.strict_exp:
            out.append((name, reason))
            continue
        cid = ex.class_of(lambda op, args, n=name: op == "St" and args and args[0] == n
                          and ex.blk.get(args[1]) == "AB")
        i = order.index(name)
        # the state's own running value over A is carried, like every state of the pass that fuses
        reach = Reach("rolling", frozenset(ok | {name}), frozenset(q for q in order[:i] if q in ok), discover=True)
        _, term = ex.extract(cid, reach, target=name)
        bodies = auxiliary.proposals(term) if term is not None else []
        names = []
        if bodies:
            new_enc, names = auxiliary.add(new_enc, name, bodies, term, aux_defs)
            added += names
        out.append((name, reason if names else reason + _NO_AUX))
    structural = len(out) > sum(1 for n, _ in why if n in unsafe or n in ex.strict_exp)
    if added:
        return new_enc, out, structural
    unused = {s.name for s in remaining if s.aux} - auxiliary.used(p, enc)
    if unused:
        return auxiliary.prune(enc, {s.name for s in enc.states if s.aux} - unused), out, structural
    return None, out, structural


def _depends_on(enc, name, failed) -> bool:
    s = enc.state(name)
    for d in s.deps:
        if d in failed or _depends_on(enc, d, failed):
            return True
    return False


def _why(enc: Encoding, s: StateDef, known: set) -> str:
    deps = [d for d in s.deps if d not in known]
    dep_txt = ", ".join(f"{d} = {pretty(enc.state(d).source)}" for d in deps) or "nothing"
    body = s.body
    return (f"reduction `{pretty(s.source)}` (state {s.name}) reads {dep_txt} inside "
            f"`{pretty(body) if body is not None else pretty(s.definition)}`, and no chain of rules turns "
            f"its value over a block already read into that block's states (the raw elements are gone "
            f"once the block is folded); it needs another pass over {enc.axis!r} after "
            f"{', '.join(deps) or 'its inputs'} {'is' if len(deps) == 1 else 'are'} final")


def _cascades(prog, axis) -> bool:
    """Some reduction over ``axis`` reads another reduction over ``axis``."""
    def red(t):
        return t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax" and t.args[0].args[0] == axis
    for e in prog.outputs.values():
        for t in e.term.walk():
            if red(t) and any(red(u) for u in t.args[1].walk()):
                return True
    return False


def _row_axis_possible(prog, axis) -> bool:
    """Some output axis other than ``axis`` is missing from some input over ``axis``: a kernel
    fused over ``axis`` can have rows (codegen/sums.py takes its row axes among such axes; an
    output axis that every tensor over ``axis`` carries varies along the loop, no row)."""
    over = [ax for ax in prog.tensors.values() if axis in ax]
    if not over:
        return True
    return any(a != axis and any(a not in ax for ax in over) for e in prog.outputs.values() for a in e.axes)


def _leaf_reduced_axes(prog) -> list:
    """The axes of the reductions of the outputs that contain no other reduction."""
    from acefuse.rewrite.dag import nodes
    red = ("Sum", "RMax", "RMin")
    has_red: dict = {}   # id -> the term contains a reduction (shared subterms visited once)

    def contains(t):
        if id(t) not in has_red:
            has_red[id(t)] = t.op in red or any(contains(c) for c in t.children)
        return has_red[id(t)]
    out = []
    for t in nodes(*(e.term for e in prog.outputs.values())):
        if t.op in red and t.args[0].op == "Ax" and not contains(t.args[1]) and t.args[0].args[0] not in out:
            out.append(t.args[0].args[0])
    return out


def _outer_reduced_axes(prog) -> list:
    """The axes of the outermost reductions of the outputs (not those nested inside them)."""
    out = []

    def walk(t):
        if t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax":
            if t.args[0].args[0] not in out:
                out.append(t.args[0].args[0])
            return
        for c in t.children:
            walk(c)
    for e in prog.outputs.values():
        walk(e.term)
    return out


def _pick_axis(prog, axis):
    red = prog.reduced_axes()
    if axis is None:
        if len(red) == 1:
            return red[0]
        if not red:
            raise FuseError(f"program {prog.name!r} has no reduction; there is nothing to fuse "
                            "(af.compile still makes an elementwise kernel)")
        cascaded = [a for a in red if _cascades(prog, a)]
        if len(cascaded) == 1:
            return cascaded[0]
        outer = _outer_reduced_axes(prog)
        if not cascaded:
            if len(outer) == 1 and _row_axis_possible(prog, outer[0]):   # sum_j(f(sum_e(q * k)) * v)
                return outer[0]
            # fused over the outer axis no kernel has rows (a 0-d output, sum_r(sum_j(x * x)), or
            # one whose axes every tensor over it carries), or outputs reduce outermost over
            # several axes (a training forward also saving max_j(x) and max_r(max_j(x))): the
            # innermost reduced axis, the reductions around it second stages over its per-row
            # values (codegen/compile.py ``stage``)
            leaf = _leaf_reduced_axes(prog)
            if len(leaf) == 1:
                return leaf[0]
        raise FuseError(f"program {prog.name!r} reduces over several axes {red}; "
                        f"pick the one to fuse with axis=...")
    if axis not in prog.axes:
        raise FuseError(f"program {prog.name!r}: axis {axis!r} is not an axis of its inputs "
                        f"({' '.join(prog.axes)}); pick one of them")
    return axis


def _ablate_pass(f: Fusion, p: FusionPass) -> dict:
    """For every derived form of a pass, the rules without which it is no longer
    derivable (one re-saturation per rule that fired, checking all forms at once).
    A rule that another rule can stand in for is not listed: these are the rules
    each correction *needs*, ordered by the iteration in which they first fired.

    The result is a function of the pass's e-graph input (its states, the known ones, the
    derived forms, the rules' text, the schedule) and of the code that saturates it, so it is
    kept under that key (``_ablation_key``) in memory and on disk
    (``$ACEFUSE_CACHE_DIR/ablation/<key>.json``, default ``~/.cache/acefuse``;
    ``ACEFUSE_ABLATION_CACHE=0`` turns the disk part off): a program fused again, in this
    process or another, reads its chains instead of re-saturating once per rule. The chains
    only explain (explain(), the generated code's comments); nothing is certified from them."""
    key = _ablation_key(f, p)
    got = _ablation_load(key)
    if got is None:
        got = _ablate_pass_run(f, p)
        _ablation_store(key, got)
    return dict(got)


def _ablate_pass_run(f: Fusion, p: FusionPass) -> dict:
    """``_ablate_pass`` computed: one re-saturation per rule that fired."""
    out: dict = {}
    targets: dict = {}
    for s in p.states:
        for form, forms in (("rolling", p.rolling), ("merge", p.merge)):
            t = forms.get(s.name)
            if t is None:
                continue
            if _is_definition(f, s.name, t):
                out[(s.name, form)] = []
            else:
                targets[(s.name, form)] = t
    needed: dict = {k: [] for k in targets}
    fired = p.stats.matches if p.stats else {}
    candidates = [r for r in f.rules if r.kind == "rewrite" and fired.get(r.name)]
    remaining = [s for s in f.encoding.states if s.name not in p.known]
    for r in candidates if targets else ():
        rules = [x for x in f.rules if x.name != r.name]
        eg = _build(f.encoding, remaining, set(p.known), rules, check_proofs=False)
        eg.saturate(p.schedule or f.schedule)
        for key, t in targets.items():
            if not eg.check(Term("St", (key[0], AB)), t):
                needed[key].append(r.name)
    order = p.stats.first_iteration if p.stats else {}
    for key, names in needed.items():
        out[key] = sorted(names, key=lambda n: (order.get(n, 99), n))
    return out


_ABLATIONS: dict = {}        # key -> {(state, form): [rule, ...]}
_CODE_HASH = None


def _code_hash() -> str:
    """sha256 of the code an ablation runs: this module, acefuse.rewrite and the egglog version."""
    global _CODE_HASH
    if _CODE_HASH is None:
        import hashlib
        from pathlib import Path
        import acefuse.rewrite as rw
        h = hashlib.sha256(Path(__file__).read_bytes())
        for d in rw.__path__:
            for q in sorted(Path(d).glob("*.py")):
                h.update(q.name.encode() + b"\0" + q.read_bytes())
        try:
            from importlib.metadata import version
            h.update(version("egglog").encode())
        except Exception:  # noqa: BLE001 - no version metadata: the sources still key it
            pass
        _CODE_HASH = h.hexdigest()
    return _CODE_HASH


def _ablation_key(f: Fusion, p: FusionPass) -> str:
    """What an ablation of ``p`` depends on, hashed: the code, the rules (each one's egglog text,
    theory and kind), the schedule, the pass's states and known states, its derived forms, and
    which rules fired in it and when (the order of each chain)."""
    import hashlib
    h = hashlib.sha256(_code_hash().encode())
    sched = p.schedule or f.schedule
    parts = [
        [(r.name, r.theory, r.kind, r.egglog("r")) for r in f.rules],
        repr(sched),
        [(s.name, s.op, s.definition.sexpr()) for s in f.encoding.states if s.name not in p.known],
        sorted(p.known),
        [(s.name, form, t.sexpr()) for s in p.states for form, forms in (("rolling", p.rolling), ("merge", p.merge))
         for t in [forms.get(s.name)] if t is not None],
        sorted((p.stats.matches or {}).items()) if p.stats else None,
        sorted((p.stats.first_iteration or {}).items()) if p.stats else None,
    ]
    h.update(repr(parts).encode())
    return h.hexdigest()[:40]


def _ablation_path(key: str):
    import os
    from pathlib import Path
    if os.environ.get("ACEFUSE_ABLATION_CACHE", "1") == "0":
        return None
    base = os.environ.get("ACEFUSE_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "acefuse") / "ablation" / f"{key}.json"


def _ablation_load(key: str):
    got = _ABLATIONS.get(key)
    if got is not None:
        return got
    path = _ablation_path(key)
    if path is None:
        return None
    import json
    try:
        data = json.loads(path.read_text())
        got = {(st, form): [str(r) for r in rules] for st, form, rules in data["chains"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None           # absent or unreadable: computed again (and rewritten)
    _ABLATIONS[key] = got
    return got


def _ablation_store(key: str, chains: dict) -> None:
    _ABLATIONS[key] = chains
    path = _ablation_path(key)
    if path is None:
        return
    import json
    import os
    import tempfile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ablation-")
        with os.fdopen(fd, "w") as fh:
            json.dump({"chains": [[st, form, rules] for (st, form), rules in sorted(chains.items())]}, fh)
        os.replace(tmp, path)
    except OSError:
        pass                  # an unwritable cache directory: nothing is persisted


def _is_definition(f, name, target) -> bool:
    s = f.encoding.state(name)
    return target == reblock(s.definition, AB)


# ---- the unfused kernel: af.compile's fallback when a fusion is not certified -------------------
_COMBINE = {"sum": "Add", "max": "Max2", "min": "Min2"}
_SPLIT_RULE = {"sum": "sum-split", "max": "max-split", "min": "min-split"}


def _counts_final(t: Term) -> Term:
    """Inside a reduction body, the block's count is the whole axis's (``size(axis)`` as written)."""
    if t.op == "Cnt":
        return Term("Cnt", (J,))
    if not t.children:
        return t
    return Term(t.op, tuple(_counts_final(a) if isinstance(a, Term) else a for a in t.args))


def unfused(prog, axis: str | None = None, reason: str = "") -> Fusion:
    """The plain evaluation of ``prog`` as a Fusion that codegen lowers like any other: one
    pass per reduction depth, from the program as written (no normal form, no rules). A
    state's per-tile update is only the split law ``St(q, A u B) = St(q, A) (+|max|min)
    red_B(body)`` and its merge ``St(q, A) (+|max|min) St(q, B)``, where every state the body
    reads is final from an earlier pass (and ``size(axis)`` is the axis's length): certified
    by construction, and certified again by ``certificate``. ``reason`` says why it is used."""
    from acefuse.lang import Program
    if not isinstance(prog, Program):
        raise FuseError(f"af.fuse expects a program made with af.program(...), got {type(prog).__name__}")
    axis = _pick_axis(prog, axis)
    t0 = time.perf_counter()
    enc = encode(prog, axis)
    states = []
    for s in enc.states:   # a count inside a reduction body is the final one (same value over J)
        if s.op in RED_OPS.values():
            d = Term(s.definition.op, (s.definition.args[0], _counts_final(s.definition.args[1])))
            s = StateDef(s.name, s.op, d, s.source, s.deps)
        states.append(s)
    from dataclasses import replace
    enc = replace(enc, states=states)
    remaining, known, passes = list(states), set(), []
    while remaining:
        ready = [s for s in remaining if s.op != "ref" and set(s.deps) <= known]
        if not ready:
            raise FuseError(f"program {prog.name!r}: the states {[s.name for s in remaining]} over {axis!r} "
                            "depend on each other in a cycle; this is a bug in acefuse, please report it")
        p = FusionPass(len(passes) + 1, ready, [], known=tuple(sorted(known)))
        finals = {k: Term("St", (k, J)) for k in known}
        for s in ready:
            d = _known_to_final(s.definition, finals)
            comb = _COMBINE[s.op]
            p.init[s.name] = reblock(d, B)
            p.rolling[s.name] = Term(comb, (Term("St", (s.name, A)), Term(d.op, (B, d.args[1]))))
            p.merge[s.name] = Term(comb, (Term("St", (s.name, A)), Term("St", (s.name, B))))
        done = {s.name for s in ready}
        p.refs = [s for s in remaining if s.op == "ref" and set(s.deps) <= done | known]
        passes.append(p)
        known |= done | {r.name for r in p.refs}
        remaining = [s for s in remaining if s.name not in known]
    why = reason or "the unfused evaluation was asked for"
    f = Fusion(prog, axis, enc, passes, len(passes) <= 1, f"unfused kernel: {why}", [], [],
               seconds=time.perf_counter() - t0, normal_form=[f"unfused kernel ({why})"])
    f._chains.update({(s.name, form): [_SPLIT_RULE[s.op]] for p in passes for s in p.states
                      for form in ("rolling", "merge")})
    return f


def certified_or_unfused(f: Fusion, allow_uncertified: bool = False) -> Fusion:
    """af.compile's gate: ``f`` when every step of its certificate is certified; otherwise
    the unfused kernel of the same program, with an UncertifiedFusionWarning naming the
    program, the state and the step (once per program). ``allow_uncertified=True`` is the
    loud opt-out: ``f`` itself, with a louder warning."""
    from acefuse.certificate import warn_uncertified, describe_failure
    cert = f.certificate
    if cert.ok:
        return f
    if allow_uncertified:
        warn_uncertified(f, cert, used=True)
        return f
    warn_uncertified(f, cert, used=False)
    c = cert.failures[0]
    u = unfused(f.program, f.axis, reason=f"the fused {c.step} of {c.state!r} is {c.status}")
    ucert = u.certificate   # certified by construction; a counterexample here is a bug
    if any(c.status == "failed" for c in ucert.steps):
        raise FuseError(f"program {f.program.name!r}: neither the fusion over {f.axis!r} nor the unfused "
                        f"kernel could be certified (fused: {describe_failure(f, cert)}; unfused: "
                        f"{describe_failure(u, ucert)}); pass allow_uncertified=True to compile the "
                        "uncertified fusion anyway, and please report the program")
    return u
