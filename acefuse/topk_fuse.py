"""Top-k as a reduction kind: one running state of k candidates, merged by the proved merge.

``af.topk(x, k, axis)`` is a language construct (acefuse/topk.py). Its candidates are written
as a cascade of plain reductions (what the reference evaluator and the unfused kernel run),
and each candidate term is registered with its selection (``TopKSpec``: the order by ``y``
decreasing, then the rank ``g`` increasing). This module fuses a program that uses the
construct without the e-graph and without the cascade:

* every selection over the fused axis becomes one *k-candidate state*: 2k scalar states per
  row, ``tv_r`` (the r-th value, NaN read as +inf) and ``ti_r`` (its rank, negative for a
  NaN), plus ``tp_r`` for each ``af.gather(f, idx, axis)`` at the selection's indices (the
  value of f at the candidate's position, a *payload* carried with it);
* its definition over a block S is ``top_k(S)``, padded with ``BOT = (-inf, +inf)``; on a
  tile the kernel computes it by k rounds of (max of y, the lowest rank among the maxima,
  mask that one out), each a vector reduction over the tile;
* its rolling update and its merge are the same network of compare-exchanges
  (``proofs/topk.merge_network``: A's r-th against B's (k-1-r)-th, then an odd-even
  transposition sort), B being the tile's k candidates (rolling) or the other partial
  state (split, and the cross-device merge). ``proofs/topk.prove_merge`` proves that network
  for all block sizes; the certificate (``certify``) checks that the kernel's forms are that
  network's terms and that the proof says "proved", so a wrong merge (one that keeps k - 1
  candidates, or puts the higher index first among equal values) is refused and the
  program falls back to its unfused kernel;
* the other reductions over the axis must be plain (their bodies read no reduction over
  it): their updates are the split law (``sum-split``, ``max-split``, ``min-split``);
* a selection whose operand reads reductions over the axis and is a strictly increasing
  chain over a reduction-free score (top-k of softmax probabilities ``exp(x - m) / l``;
  proofs/monotone.py decides and proves it) is made on the score: one k-candidate state on
  x, the chain's row constants carried beside it (every reduction of such a program is
  derived by the general engine, one sub-fusion: the online-softmax max and sum with their
  certified corrections), and candidate r's value is the chain at the r-th score from the
  finished states (rank r - n where the normaliser is NaN: every value NaN, index order).
  Order by exact value: a float32 rounding tie goes to the larger score (README);
* any other selection whose operand reads plain reductions takes a second pass, after them,
  with their final values (one HBM read in the ``single`` schedule);
* outputs are functions of the candidates, payloads, plain reductions and per-row values.

Why a reduction kind, not rules over the cascade: the cascade's terms grow with k (deriving
k = 8 took 153 s and 17 GB); the k-candidate state is the construct's own definition, its merge
is proved once per k by a decision procedure (comparator by weak orders, network by the 0-1
principle, the union lemma for every block size), and fusing costs milliseconds. A program
this module does not cover (an output elementwise over the fused axis, a reduction reading a
candidate, a selection reading a non-plain reduction) goes to the general engine, which
fuses the cascade as before.
"""
from __future__ import annotations

import functools
import time

from acefuse.rewrite.terms import Term, A, B, U, pretty, substitute, reblock
from acefuse.rewrite.encode import Encoding, StateDef, RED_OPS
from acefuse.rewrite.dag import nodes

J = Term("BJ")
AB = U(A, B)
_COMBINE = {"sum": "Add", "max": "Max2", "min": "Min2"}
_SPLIT_RULE = {"sum": "sum-split", "max": "max-split", "min": "min-split"}
MERGE_RULE = "topk-merge"


class Group:
    """One k-candidate state: a selection, its payloads and its state names."""

    def __init__(self, gid, spec, suffix):
        self.gid, self.spec, self.k = gid, spec, spec.k
        self.suffix = suffix
        self.payloads: list = []          # gathered program terms, in order
        self.y = self.g = None            # bodies with known reductions as St(q, J)
        self.f: list = []
        self.net = None

    def name(self, slot, r):
        return f"t{slot}{self.suffix}{r}"

    def slots(self):
        return ["v", "i"] + [f"p{j}_" for j in range(len(self.payloads))]

    def names(self, r):
        return [self.name(s, r) for s in self.slots()]


def _sel(gid, r, slot):
    """The tile's r-th candidate (slot v, i or p<j>_) of selection gid, as a tile reduction
    (codegen/topk.py lowers every candidate of a selection in one go)."""
    return Term("TopSel", (gid, float(r), slot))


@functools.lru_cache(maxsize=None)
def _fusion_class():
    from acefuse.fuse import Fusion

    class TopKFusion(Fusion):
        """A Fusion with k-candidate states; ``explain`` shows their merge network once."""

        def explain(self, chains: bool = True, timings: bool = False) -> str:
            return explain(self, chains)

        def rule_chain(self, name: str, form: str = "rolling") -> list:
            eng = getattr(self, "engine", None)
            if (name, form) not in self._chains and eng is not None and any(s.name == name for s in eng.states):
                return eng.rule_chain(name, form)
            return super().rule_chain(name, form)

        def to_json(self) -> dict:
            d = super().to_json()
            d["topk"] = [{"k": g.k, "axis": g.spec.axis, "states": [g.names(r) for r in range(g.k)],
                          "network": [list(c) for c in g.net.comparators], "ties": g.net.ties,
                          "payloads": [pretty(f) for f in g.payloads]} for g in self.topk_groups]
            return d
    return TopKFusion


def explain(f, chains=True) -> str:
    enc = f.encoding
    L = [f"program {f.program.name!r}, fused axis {f.axis!r}: "
         + ("fusible, one pass" if f.fusible else f"{len(f.passes)} passes ({f.reason})")]
    L += ["  " + n for n in f.normal_form]
    hp = f.hbm_passes
    L.append(f"HBM passes over the input (rows longer than a tile): unfused {hp['unfused']}, fused {hp['fused']}")
    groups = {n: g for g in f.topk_groups for r in range(g.k) for n in g.names(r)}
    for p in f.passes:
        L.append(f"pass {p.index}: carries {', '.join(s.name for s in p.states)}"
                 + (f" (with {', '.join(p.known)} final from earlier passes)" if p.known else ""))
        shown = set()
        for s in p.states:
            if s.op != "topk":
                L.append(f"  {s.name} = {pretty(s.definition).replace('_A', '_S')}")
                L.append(f"    init     {s.name}_B  = {pretty(p.init[s.name])}")
                L.append(f"    rolling  {s.name}_AB = {pretty(p.rolling[s.name])}")
                if s.name in p.merge:
                    L.append(f"    merge    {s.name}_AB = {pretty(p.merge[s.name])}")
                if chains:
                    L.append(f"             rules: {' -> '.join(f.rule_chain(s.name, 'rolling'))}")
                    if s.name in p.merge and f.rule_chain(s.name, "merge") != f.rule_chain(s.name, "rolling"):
                        L.append(f"             merge rules: {' -> '.join(f.rule_chain(s.name, 'merge'))}")
                continue
            g = groups[s.name]
            if g.gid in shown:
                continue
            shown.add(g.gid)
            names = ", ".join("(" + ", ".join(g.names(r)) + ")" for r in range(g.k))
            L.append(f"  k-candidate state {g.gid}: {names}")
            L.append(f"    definition over S: the first {g.k} of S by `{pretty(g.y)}` decreasing, then "
                     f"`{pretty(g.g)}` increasing, padded with (-inf, +inf)"
                     + (f"; payloads {', '.join(pretty(x) for x in g.f)} at each candidate" if g.f else ""))
            L.append(f"    init     the tile's {g.k} candidates: {g.k} rounds of (max, lowest rank among the "
                     "maxima, mask it out)")
            L.append(f"    rolling  merge(A's candidates, the tile's candidates)")
            if s.name in p.merge:
                L.append(f"    merge    merge(A's candidates, B's candidates)")
            L.append(f"    merge network: {len(g.net.comparators)} compare-exchanges {g.net.comparators} on "
                     f"slots A_0..A_{g.k - 1}, B_0..B_{g.k - 1} (ties: {g.net.ties} index first), keep "
                     f"{g.net.keep}")
            if chains:
                L.append(f"             rules: {MERGE_RULE} (proofs/topk.py, for all block sizes)")
            for ms in getattr(f, "monotone", ()):
                if ms.uspec == g.spec:
                    L.append(f"    monotone selection: af.topk of `{pretty(ms.analysis.selected)}` is made on its "
                             f"score `{pretty(ms.analysis.score)}`, because the chain "
                             f"{' -> '.join(x.name for x in ms.analysis.facts())} is strictly increasing with "
                             "these row constants (proofs/monotone.py: " + ms.proof.summary
                             + "); each candidate's value is that expression at its score, from the finished states")
        if not p.split_ok:
            L.append("  split schedule: not available for this pass")
    L.append("outputs:")
    for k, t in enc.outputs.items():
        L.append(f"  {k} = {pretty(t).replace('_J', '')}    [finalize, per row]")
    return "\n".join(L)


def fuse_topk(prog, axis: str, network=None, monotone=True):
    """The k-candidate fusion of ``prog`` over ``axis`` (a Fusion), or None when the program
    uses no af.topk over ``axis`` or falls outside what this module covers (module docstring).
    ``network``: {k: proofs.topk.Network} to use instead of the proved one (mutation tests).
    ``monotone=False``: never select on the score of a monotone chain (the two-pass form)."""
    from acefuse.topk import CANDIDATES, PAYLOADS
    from acefuse.proofs.topk import merge_network
    from acefuse.fuse import FusionPass
    TopKFusion = _fusion_class()
    t0 = time.perf_counter()

    def is_red(t):
        return t.op in RED_OPS and t.args[0].op == "Ax" and t.args[0].args[0] == axis

    mono = _monotone_specs(prog, axis, is_red) if monotone and axis is not None else {}
    engine_reds: list = []     # reductions of a monotone program: derived by the general engine

    groups: dict = {}          # spec -> Group
    plain: dict = {}           # reduction term -> state name
    plain_defs: list = []
    counters: dict = {}

    def group_of(spec):
        if spec not in groups:
            groups[spec] = Group(f"g{len(groups) + 1}", spec, "" if not groups else f"{len(groups) + 1}_")
        return groups[spec]

    class Outside(Exception):
        pass

    def plain_state(t):
        if t in plain:
            return plain[t]
        if any(is_red(u) or id(u) in CANDIDATES or id(u) in PAYLOADS for u in _walk_once(t.args[1])):
            raise Outside
        kind = RED_OPS[t.op]
        counters[kind] = counters.get(kind, 0) + 1
        name = {"sum": "s", "max": "m", "min": "mn"}[kind] + ("" if counters[kind] == 1 else str(counters[kind]))
        plain[t] = name
        plain_defs.append(StateDef(name, kind, Term(t.op, (A, t.args[1])), t, ()))
        return name

    memo: dict = {}

    def lower(t, inside=False):
        """A program term with selections, payloads and plain reductions as final states
        (memoised by identity: a cascade's terms share subterms, and hashing one walks it)."""
        key = (id(t), inside)
        if key not in memo:
            memo[key] = (t, _lower(t, inside))
        return memo[key][1]

    def _lower(t, inside):
        hit = CANDIDATES.get(id(t))
        if hit is not None and hit[1].axis == axis:
            if inside:
                raise Outside
            _, spec, r, slot = hit
            if spec in mono:   # selected on the score (proofs/monotone.py): f at the r-th candidate
                return _mono_candidate(mono[spec], group_of(mono[spec].uspec), r, slot, lower)
            return Term("St", (group_of(spec).name(slot, r), J))
        hit = PAYLOADS.get(id(t))
        if hit is not None and hit[1].axis == axis:
            if inside or hit[1] in mono:   # a payload of a monotone selection: the two-pass form
                raise Outside
            _, spec, r, f = hit
            grp = group_of(spec)
            if f not in grp.payloads:
                grp.payloads.append(f)
            return Term("St", (grp.name(f"p{grp.payloads.index(f)}_", r), J))
        if is_red(t):
            if mono:   # every reduction goes to the general engine (one sub-fusion, below)
                if any(id(u) in CANDIDATES or id(u) in PAYLOADS for u in _walk_once(t.args[1])):
                    raise Outside
                if t not in engine_reds:
                    engine_reds.append(t)
                return Term("St", (f"__r{engine_reds.index(t)}", J))
            return Term("St", (plain_state(t), J))
        if not t.children:
            return t
        return Term(t.op, tuple(lower(a, inside) if isinstance(a, Term) else a for a in t.args))

    if axis is None:
        return None
    try:
        outputs = {k: lower(e.term) for k, e in prog.outputs.items()}
        if not groups or any(axis in e.axes for e in prog.outputs.values()):
            return None
        for grp in list(groups.values()):
            grp.y, grp.g = lower(grp.spec.y, True), lower(grp.spec.g, True)
            grp.f = [lower(f, True) for f in grp.payloads]
    except Outside:
        return fuse_topk(prog, axis, network, monotone=False) if mono else None
    if len(groups) > 8 or any(grp.k > 64 for grp in groups.values()):
        return None
    engine = None
    if mono:
        engine = _engine_fusion(prog, axis, engine_reds)
        if engine is None:
            return fuse_topk(prog, axis, network, monotone=False)
        ph = {Term("St", (f"__r{i}", J)): engine.encoding.outputs[f"r{i}"] for i in range(len(engine_reds))}
        outputs = {k: substitute(t, ph) for k, t in outputs.items()}
        for grp in groups.values():
            grp.y, grp.g = substitute(grp.y, ph), substitute(grp.g, ph)
            grp.f = [substitute(f, ph) for f in grp.f]
        plain_defs[:] = [s for p in engine.passes for s in p.refs + p.states]

    def reads(t):
        return {u.args[0] for u in t.walk() if u.op == "St"}

    states = list(plain_defs)
    first, second = [], []
    for grp in groups.values():
        grp.net = (network or {}).get(grp.k) or merge_network(grp.k)
        deps = set().union(reads(grp.y), reads(grp.g), *map(reads, grp.f))
        (second if deps else first).append(grp)
        for r in range(grp.k):
            for slot, nm in zip(grp.slots(), grp.names(r)):
                states.append(StateDef(nm, "topk", Term("RMax", (A, _sel(grp.gid, r, slot))),
                                       grp.spec.y, tuple(sorted(deps))))
    by_name = {s.name: s for s in states}
    passes = []
    known: set = set()
    chunks = [(plain_defs, first), ([], second)]
    for pl, grps in chunks:
        if not pl and not grps:
            continue
        p = FusionPass(len(passes) + 1, [], [], known=tuple(sorted(known)))
        if engine is not None and pl:   # the general engine's derived forms (certified with it)
            ep = engine.passes[0]
            p.refs = list(ep.refs)
            p.init.update(ep.init)
            p.rolling.update(ep.rolling)
            p.merge.update(ep.merge)
            p.states += list(ep.states)
            pl = []
        for s in pl:
            comb = _COMBINE[s.op]
            red = s.definition.op
            p.init[s.name] = reblock(s.definition, B)
            p.rolling[s.name] = Term(comb, (Term("St", (s.name, A)), Term(red, (B, s.definition.args[1]))))
            p.merge[s.name] = Term(comb, (Term("St", (s.name, A)), Term("St", (s.name, B))))
            p.states.append(s)
        for grp in grps:
            init, rolling, merge = group_forms(grp)
            p.init.update(init)
            p.rolling.update(rolling)
            p.merge.update(merge)
            p.states += [by_name[n] for r in range(grp.k) for n in grp.names(r)]
        passes.append(p)
        known |= {s.name for s in p.states}
    if len(passes) > 1:
        passes[-1].merge.clear()   # the split schedule runs one pass
    enc = Encoding(prog.name, axis, states, {}, outputs, {k: e.axes for k, e in prog.outputs.items()},
                   dict(prog.tensors), unfused_passes=_cascade_depth(prog, axis), elementwise_outputs=())
    if engine is not None:   # the engine's forms read its leaves (Elm / Par terms)
        enc.leaves, enc.leaf_of = dict(engine.encoding.leaves), dict(engine.encoding.leaf_of)
    notes = [f"top-k: `{pretty(g.spec.y)}` over {axis!r}, k = {g.k}, as one state of {g.k} candidates "
             f"({', '.join(g.slots())} each; order: value decreasing, then rank `{pretty(g.spec.g)}` "
             f"increasing); update and merge: the proved merge of two {g.k}-candidate states "
             f"({len(g.net.comparators)} compare-exchanges, proofs/topk.py)"
             + (f"; payloads (af.gather at its indices): {', '.join(pretty(f) for f in g.payloads)}" if g.payloads else "")
             for g in groups.values()]
    for ms in mono.values():
        notes.append(f"monotone selection: top-k of `{pretty(ms.analysis.selected)}` selects what top-k of its "
                     f"score `{pretty(ms.analysis.score)}` selects ({ms.proof.summary}; "
                     "proofs/monotone.py); the values are the program's expression at the chosen scores")
    if engine is not None:
        notes += [n for n in engine.normal_form if n not in notes]
    if second:
        notes.append(f"the selection over `{pretty(second[0].spec.y)}` reads "
                     f"{', '.join(sorted(reads(second[0].y) | reads(second[0].g)))}: a second pass after "
                     "them (top-k of a monotone map of x selects what top-k of x does over the reals, not in "
                     "float32, so no rule rewrites it); one HBM read in the single schedule")
    f = TopKFusion(prog, axis, enc, passes, len(passes) <= 1,
               "" if len(passes) <= 1 else "the selection reads reductions of the same axis: a second pass",
               [], [], seconds=time.perf_counter() - t0, normal_form=notes)
    f.topk_groups = list(groups.values())
    f.monotone = list(mono.values())
    f.engine = engine
    for p in passes:
        for s in p.states:
            if engine is not None and s.op != "topk":
                continue   # derived by the engine: TopKFusion.rule_chain asks it
            for step in ("rolling", "merge"):
                f._chains[(s.name, step)] = [MERGE_RULE] if s.op == "topk" else [_SPLIT_RULE[s.op]]
    return f


# ---- top-k of a monotone function of a score (proofs/monotone.py) --------------------------------
class MonoSpec:
    """A selection ``af.topk(f(u))`` made on the score u: the analysis, its proof, u's spec."""

    def __init__(self, spec, analysis, proof, uspec):
        self.spec, self.analysis, self.proof, self.uspec = spec, analysis, proof, uspec


def _monotone_specs(prog, axis, is_red):
    """{spec: MonoSpec} for every selection over ``axis`` whose operand reads reductions over
    it and is a proved strictly increasing chain over a reduction-free score."""
    from acefuse.topk import CANDIDATES, TopKSpec
    from acefuse.rewrite.encode import _Axes
    from acefuse.proofs import monotone
    from acefuse import lang
    axes_of = _Axes(dict(prog.tensors))
    specs = []
    for e in prog.outputs.values():
        for u in _walk_once(e.term):
            hit = CANDIDATES.get(id(u))
            if hit is not None and hit[1].axis == axis and hit[1] not in specs:
                specs.append(hit[1])
    out = {}
    for spec in specs:
        y = spec.y
        if not (y.op == "Where" and y.args[0].op == "CmpNe" and y.args[2] == y.args[0].args[0]):
            continue
        p = y.args[2]
        if not any(is_red(u) for u in _walk_once(p)):
            continue   # selected in one pass as it is
        a = monotone.analyse(p, axis, lambda t: axis in axes_of(t), is_red)
        proof = monotone.prove(a)
        if not proof.ok:
            continue
        order = [ax for t in prog.tensors.values() for ax in t]
        ue = lang.Expr(a.score, tuple(dict.fromkeys(ax for ax in order if ax in axes_of(a.score))),
                       {n: ax for n, ax in prog.tensors.items()
                        if any(v.op == "In" and v.args[0] == n for v in _walk_once(a.score))})
        nan = ue.ne(ue)
        j = lang.index(axis)
        uy = lang.where(nan, float("inf"), ue)
        ug = lang.where(nan, j - lang.size(axis), j)
        out[spec] = MonoSpec(spec, a, proof, TopKSpec(axis, uy.term, ug.term, spec.k))
    return out


def _mono_candidate(ms, grp, r, slot, lower):
    """Candidate r of ``topk(f(u))`` from the r-th candidate of the score's state: the rank
    as it is, or r - n in a row whose normaliser is NaN (every f(u_j) NaN: index order); the
    value f at the chosen score (+inf for a NaN, as y reads it), evaluated as the program
    writes f (the same operations, the finished row constants)."""
    a = ms.analysis
    rank = Term("St", (grp.name("i", r), J))
    if a.normalisers:
        ks = [lower(n) for n in a.normalisers]
        k = ks[0]
        for x in ks[1:]:
            k = Term("Add", (k, x))
        rank = Term("Where", (Term("CmpNe", (k, k)), Term("Sub", (Term("Num", (float(r),)),
                                                                 Term("Size", (grp.spec.axis,)))), rank))
    if slot == "i":
        return rank
    val = Term("St", (grp.name("v", r), J))
    for node, pos, _ in reversed(a.chain):
        args = list(node.args)
        args[pos] = val
        val = Term(node.op, tuple(args))
    val = lower(val)
    return Term("Where", (Term("CmpLt", (rank, Term("Num", (0.0,)))), Term("Num", (float("inf"),)), val))


_ENGINE: dict = {}


def _engine_fusion(prog, axis, reds):
    """The general engine's fusion of the reductions ``reds`` (outputs ``r0``, ``r1``, ...), or
    None unless it is one pass (the online-softmax max and sum: derived, proved, certified)."""
    from acefuse import lang
    from acefuse.rewrite.encode import _Axes
    if not reds:
        return None
    key = (axis, tuple(reds), tuple(sorted((k, tuple(v)) for k, v in prog.tensors.items())))
    if key not in _ENGINE:
        axes_of = _Axes(dict(prog.tensors))
        order = [ax for t in prog.tensors.values() for ax in t]
        outs = {}
        for i, t in enumerate(reds):
            names = {v.args[0] for v in _walk_once(t) if v.op == "In"}
            outs[f"r{i}"] = lang.Expr(t, tuple(dict.fromkeys(ax for ax in order if ax in axes_of(t))),
                                      {n: ax for n, ax in prog.tensors.items() if n in names})
        from acefuse.fuse import fuse
        try:
            sub = fuse(lang.program(f"{prog.name}_rows", **outs), axis)
        except Exception:   # noqa: BLE001 - the two-pass form is used instead
            sub = None
        ok = (sub is not None and len(sub.passes) == 1 and sub.fusible and not sub.encoding.elementwise_outputs
              and all(f"r{i}" in sub.encoding.outputs for i in range(len(reds))))
        _ENGINE[key] = sub if ok else None
    return _ENGINE[key]


def _net(gid, r, slot, side, net):
    """Candidate r (slot v, i or p<j>_) of the merge of A's running candidates with B's:
    the tile's (``side == "tile"``, the rolling update) or B's finished state (``"state"``,
    the merge). codegen/topk.py lowers it from the group's Network, compare-exchange by
    compare-exchange, the network the certificate proves (the terms stay small: the
    network's expression tree grows exponentially with its depth)."""
    sig = f"{net.comparators}; ties {net.ties}; keep {net.keep}"   # the network is part of the form
    return Term("TopNet", (gid, float(r), slot, side, sig))


def group_forms(grp):
    """(init, rolling, merge) of a k-candidate state: the tile's selection, and the network
    ``grp.net`` over A's running candidates and the tile's (rolling) or B's (merge)."""
    init, rolling, merge = {}, {}, {}
    for r in range(grp.k):
        for slot, n in zip(grp.slots(), grp.names(r)):
            init[n] = Term("RMax", (B, _sel(grp.gid, r, slot)))
            rolling[n] = Term("RMax", (B, _net(grp.gid, r, slot, "tile", grp.net)))
            merge[n] = Term("RMax", (B, _net(grp.gid, r, slot, "state", grp.net)))
    return init, rolling, merge


_walk_once = nodes   # every distinct node of a term (by identity), once (rewrite/dag.py)


def _cascade_depth(prog, axis):
    """Passes of the plain evaluation: the longest chain of reductions over ``axis``."""
    memo: dict = {}

    def depth(t):
        if id(t) not in memo:
            d = max((depth(c) for c in t.children), default=0)
            memo[id(t)] = (t, d + (1 if t.op in RED_OPS and t.args[0].op == "Ax" and t.args[0].args[0] == axis else 0))
        return memo[id(t)][1]
    return max((depth(e.term) for e in prog.outputs.values()), default=0)


# ---- the certificate ------------------------------------------------------------------------------
def certify(f) -> list:
    """Certificates of every step of a k-candidate fusion (acefuse/certificate.py's steps):

    * ``finalize``: each output is the program's output with every candidate, payload and
      plain reduction read as its final state (recomputed here and compared);
    * ``init``: each state's definition over the tile B (the same term);
    * plain states: ``rolling`` / ``merge`` are the split law, whose rule is proved for every
      block size (proofs/rules.py);
    * k-candidate states: ``rolling`` / ``merge`` are the terms of the network ``grp.net``,
      and ``proofs/topk.prove_merge(grp.net)`` proves that network for every block size."""
    from acefuse.proofs.certify import Certificate
    from acefuse.proofs.topk import prove_merge
    from acefuse.proofs.rules import prove_rule
    from acefuse.rules import REGISTRY
    out = []

    def cert(subject, step, ok, detail):
        return Certificate(subject, "certified" if ok else "failed", ok, ok, 0.0 if ok else float("inf"),
                           None, detail, 0.0, step)
    again = fuse_topk(f.program, f.axis, network={g.k: g.net for g in f.topk_groups})
    for k in f.encoding.outputs:
        same = again is not None and again.encoding.outputs.get(k) == f.encoding.outputs[k]
        out.append(cert(k, "normal form", True, "both sides are the same term (the program as written)"))
        out.append(cert(k, "finalize", same, "the output with each af.topk candidate, payload and reduction read "
                        "as its final state" if same else "the encoded output is not the program's output"))
    groups = {n: g for g in f.topk_groups for r in range(g.k) for n in g.names(r)}
    proofs = {}
    rules = {}
    for p in f.passes:
        for s in p.states:
            ok = p.init.get(s.name) == reblock(s.definition, B)
            out.append(cert(s.name, "init", ok, "the state's definition over the tile B" if ok
                            else "the first tile's expression is not the state's definition"))
            if s.op == "topk":
                g = groups[s.name]
                if g.gid not in proofs:
                    for ms in getattr(f, "monotone", ()):
                        if ms.uspec == g.spec:
                            from acefuse.proofs.monotone import prove as prove_monotone
                            mp = prove_monotone(ms.analysis)
                            out.append(cert(g.gid, "selection", mp.ok, mp.detail))
                    res = prove_merge(g.net)
                    init, rolling, merge = group_forms(g)
                    proofs[g.gid] = (res, rolling, merge)
                res, rolling, merge = proofs[g.gid]
                for step, forms, want in (("rolling", p.rolling, rolling), ("merge", p.merge, merge)):
                    if s.name not in forms:
                        continue
                    same = forms[s.name] == want[s.name] and g.k == g.net.k
                    ok = res.ok and same
                    detail = (res.detail + "; the kernel lowers this network (codegen/topk.py)" if ok else
                              f"merge of {g.k}-candidate states {res.status}: {res.detail}" if not res.ok
                              else "the kernel's form is not the proved network's")
                    out.append(Certificate(s.name, "certified" if ok else "failed", ok, ok,
                                           0.0 if ok else float("inf"), res.counterexample if not res.ok else None,
                                           detail, 0.0, step))
            elif getattr(f, "engine", None) is not None:   # derived by the general engine: its certificate
                ec = f.engine.certificate
                mine = [c for c in ec.steps if c.state == s.name and c.step in ("rolling", "merge")]
                out += mine
                if not mine or any(not (s.name in forms) or forms[s.name] != ef[s.name]
                                   for forms, ef in ((p.rolling, f.engine.passes[0].rolling),
                                                     (p.merge, f.engine.passes[0].merge)) if s.name in ef):
                    out.append(cert(s.name, "rolling", False, "the kernel's form is not the engine's certified form"))
            else:
                name = _SPLIT_RULE[s.op]
                if name not in rules:
                    rules[name] = prove_rule(REGISTRY[name])
                proved = rules[name].status == "proved"
                red = s.definition.op
                comb = _COMBINE[s.op]
                want = {"rolling": Term(comb, (Term("St", (s.name, A)), Term(red, (B, s.definition.args[1])))),
                        "merge": Term(comb, (Term("St", (s.name, A)), Term("St", (s.name, B))))}
                for step, forms in (("rolling", p.rolling), ("merge", p.merge)):
                    if s.name in forms:
                        ok = proved and forms[s.name] == want[step]
                        out.append(cert(s.name, step, ok, f"the split law ({name}, proved for every block size)"
                                        if ok else f"not the split law {name}, or {name} is not proved"))
    return out
