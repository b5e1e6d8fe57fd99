"""Extraction from a saturated e-graph with a reachability- and numerics-aware cost.

egglog's own extractor uses static per-constructor costs; ours depends on the
schedule (rolling or split), on which state is being solved (only states earlier
in the pass are known at the union), and on facts the analyses proved (an exp
argument bounded above). So the e-graph is serialized and extracted here: a
worklist over (e-class, context) pairs, context = whether we are inside a
reduction over the tile B (where element values exist). The numerics term of
the cost (cancellation bits on a stress input) is computed once per e-graph
(extract/numerics.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from acefuse.rewrite.terms import Term, OPS, RELATIONS
from acefuse.extract import cost as C


@dataclass(frozen=True)
class Reach:
    """What a form may read: the schedule and the states known at this point."""

    mode: str                      # "rolling" | "split" | "final" | "program"
    carried: frozenset             # states carried per block (their St over A (and B, split) is known)
    earlier: frozenset             # states already updated at the union A u B
    # "final": a finished pass; St(q, J) is the only state form and is known
    discover: bool = False         # rolling only: a sum over the folded block A whose body is
    #                                A-local (elements, earlier states over A) may be *proposed* as
    #                                an auxiliary state (rewrite/auxiliary.py), at cost AUX_STATE


class Extractor:
    def __init__(self, serialized: dict):
        nodes = serialized["nodes"]
        self.nodes = nodes
        self.cls_nodes: dict[str, list] = {}
        self.facts = {r: set() for r in RELATIONS}
        for nid in sorted(nodes):
            n = nodes[nid]
            op = n["op"]
            if op in RELATIONS:
                self.facts[op].add(tuple(nodes[c]["eclass"] for c in n["children"]))
                continue
            self.cls_nodes.setdefault(n["eclass"], []).append(nid)
        # decode block classes
        self.blk: dict[str, str] = {}
        for cid, nids in self.cls_nodes.items():
            for nid in nids:
                op = nodes[nid]["op"]
                if op in ("BA", "BB", "BJ"):
                    self.blk[cid] = op[1]
        for cid, nids in self.cls_nodes.items():
            for nid in nids:
                n = nodes[nid]
                if n["op"] == "BU":
                    a, b = (self.blk.get(nodes[c]["eclass"], "?") for c in n["children"])
                    self.blk[cid] = a + b
        self.inv = {f[0] for f in self.facts["Inv"]}
        self.le = self.facts["Le"]
        self.ub = self.facts["UB"]
        self.b_class = next((c for c, v in self.blk.items() if v == "B"), None)
        self.j_class = next((c for c, v in self.blk.items() if v == "J"), None)
        self.a_class = next((c for c, v in self.blk.items() if v == "A"), None)
        self.t_classes = [c for c, nids in self.cls_nodes.items()
                          if c not in self.blk and any(self._is_term(n) for n in nids)]
        self._dep_map = None
        self._leaf_list = None
        self._prog_table = None   # _program_cost_fn's per-node dispatch
        self._stress = None
        self._info: dict = {}
        self._bounded: dict = {}
        # states whose form failed the adversarial float32 check (extract/simulate.py): their
        # forms may only use exponentials whose argument is proved bounded above
        self.strict_exp: set = set()
        # solve()'s result per (reach, target, target in strict_exp): the program normal form
        # extracts every output with the same Reach, and each solve visits the whole e-graph
        self._solved: dict = {}

    # -- helpers -------------------------------------------------------------------------
    def cls(self, nid):
        return self.nodes[nid]["eclass"]

    def payload(self, nid):
        op = self.nodes[nid]["op"]
        if op.startswith('"'):
            return op[1:-1]
        try:
            return float(op)
        except ValueError:
            return op

    def class_of(self, term_pred):
        """First e-class that holds a node satisfying ``term_pred(op, payload-args)``."""
        for cid, nids in self.cls_nodes.items():
            for nid in nids:
                n = self.nodes[nid]
                if term_pred(n["op"], [self.payload(c) if not self._is_term(c) else self.cls(c)
                                       for c in n["children"]]):
                    return cid
        return None

    def _is_term(self, nid):
        op = self.nodes[nid]["op"]
        return op in OPS

    def bounded(self, cid, ctx) -> bool:
        """exp of this class cannot overflow: the argument is provably <= 0."""
        for nid in self.cls_nodes.get(cid, ()):
            n = self.nodes[nid]
            if n["op"] == "Num" and isinstance(self.payload(n["children"][0]), float):
                if self.payload(n["children"][0]) <= 0:
                    return True
            if n["op"] == "Sub":
                a, b = (self.cls(c) for c in n["children"])
                if (a, b) in self.le:
                    return True
                if ctx == "B" and ((b, a, self.b_class) in self.ub or (b, a, self.j_class) in self.ub):
                    return True
                if ctx == "A" and ((b, a, self.a_class) in self.ub or (b, a, self.j_class) in self.ub):
                    return True
        return False

    # -- costs ------------------------------------------------------------------------------
    @property
    def stress(self):
        """Class values on the stress input and cancellation bits per node (numerics.py)."""
        if self._stress is None:
            from acefuse.extract.numerics import Stress
            self._stress = Stress(self)
        return self._stress

    def _static(self, nid):
        """Per-node data that does not depend on the schedule: (op, term children's classes,
        distinct ones, fixed cost of the operator including its cancellation bits)."""
        info = self._info.get(nid)
        if info is None:
            n = self.nodes[nid]
            op = n["op"]
            kids = tuple(self.cls(c) for c in n["children"])
            fixed = C.WEIGHTS.get(op, C.INF)
            if op in ("Add", "Sub"):
                fixed += C.BIT * self.stress.bits.get(nid, 0.0)
            terms = tuple(k for k, c in zip(kids, n["children"]) if self._is_term(c))  # not payloads
            info = (op, kids, tuple(dict.fromkeys(terms)), fixed, n["children"])
            self._info[nid] = info
        return info

    def node_cost(self, nid, ctx, reach: Reach, costs, target):
        op, kids, ukids, fixed, ch = self._static(nid)
        if reach.mode == "program":
            return self._program_cost(op, kids, ukids, fixed, ctx, costs)
        if ctx == "A":
            return self._a_local_cost(op, kids, ukids, fixed, ch, reach, costs, target)
        if op == "St":
            q = self.payload(ch[0])
            blk = self.blk.get(kids[1])
            if blk == "J":
                return C.LEAF
            if reach.mode == "final":
                return C.INF
            if blk == "A":
                return C.LEAF if q in reach.carried else C.INF
            if blk == "B":
                return C.LEAF if (reach.mode == "split" and q in reach.carried) else C.INF
            if blk == "AB":
                return C.LEAF if (q in reach.earlier and q != target) else C.INF
            return C.INF
        if op in ("Num", "Par"):
            return C.LEAF
        if op == "Cnt":
            return C.LEAF if reach.mode != "final" else C.INF
        if op == "Elm":
            return C.LEAF if ctx == "B" else C.INF
        if op in ("Sum", "RMax", "RMin"):
            blk = self.blk.get(kids[0])
            if reach.discover and reach.mode == "rolling" and blk == "A" and op == "Sum":
                # a proposed auxiliary state: one more state carried, its body summed per tile
                return C.AUX_STATE + C.REDUCE + C.TILE * costs.get((kids[1], "A"), C.INF)
            if not (reach.mode == "rolling" and blk == "B"):
                return C.INF
            body = costs.get((kids[1], "B"), C.INF)
            return C.REDUCE + C.TILE * body
        if fixed == C.INF:
            return C.INF
        total = fixed
        for c in ukids:  # a repeated operand (d * d) is computed once
            total += costs.get((c, ctx), C.INF)
        return total + self._exp_penalty(op, kids, ctx, target)

    def _a_local_cost(self, op, kids, ukids, fixed, ch, reach, costs, target):
        """Context "A": the body of a proposed auxiliary state ``sum_A(body)``. The body must be
        a block-local definition over A: elements, constants, per-row values, A's count, and
        states over A that are updated before the target (never the target, never a value at
        the union), so that the auxiliary state can be defined and updated ahead of it."""
        if not reach.discover:
            return C.INF
        if op == "St":
            q = self.payload(ch[0])
            blk = self.blk.get(kids[1])
            if blk == "J":
                return C.LEAF
            return C.LEAF if (blk == "A" and q in reach.earlier and q != target) else C.INF
        if op == "Cnt":
            return C.LEAF if self.blk.get(kids[0]) == "A" else C.INF
        if op in ("Num", "Par", "Elm"):
            return C.LEAF
        if op in ("Sum", "RMax", "RMin") or fixed == C.INF:
            return C.INF
        total = fixed + sum(costs.get((c, "A"), C.INF) for c in ukids)
        return total + self._exp_penalty(op, kids, "A", target)

    def _exp_penalty(self, op, kids, ctx, target=None):
        """UNBOUNDED_EXP for an exp whose argument is not proven bounded above (cost.py)."""
        if op != "Exp":
            return 0.0
        key = (kids[0], ctx)
        if key not in self._bounded:
            self._bounded[key] = self.bounded(kids[0], ctx)
        if self._bounded[key]:
            return 0.0
        return C.INF if target in self.strict_exp else C.UNBOUNDED_EXP

    def _program_cost(self, op, kids, ukids, fixed, ctx, costs):
        """Normal-form extraction of a whole program: reductions run over the whole axis J
        (their bodies weighted per element); no states exist yet."""
        if op in ("St", "Out"):
            return C.INF  # no states yet; Out only names an output
        if op in ("Num", "Par", "Cnt", "Elm"):
            return C.LEAF
        if op in ("Sum", "RMax", "RMin"):
            if self.blk.get(kids[0]) != "J":
                return C.INF
            return C.REDUCE + C.TILE * costs.get((kids[1], "B"), C.INF)
        if fixed == C.INF:
            return C.INF
        total = fixed + sum(costs.get((c, ctx), C.INF) for c in ukids)
        return total + self._exp_penalty(op, kids, ctx)

    def _deps(self):
        """(child class, ctx) -> the (node, ctx) costs that read it."""
        if self._dep_map is None:
            dep: dict = {}
            for cid in self.t_classes:
                for nid in self.cls_nodes[cid]:
                    n = self.nodes[nid]
                    is_red = n["op"] in ("Sum", "RMax", "RMin")
                    body_ctx = "A" if (is_red and self.blk.get(self.cls(n["children"][0])) == "A") else "B"
                    for i, c in enumerate(n["children"]):
                        if not self._is_term(c):
                            continue
                        for ctx in (None, "B", "A"):
                            sub = body_ctx if (is_red and i == 1) else ctx
                            dep.setdefault((self.cls(c), sub), []).append((nid, ctx))
            self._dep_map = dep
        return self._dep_map

    def _leaves(self):
        if self._leaf_list is None:   # a function of the e-graph alone: computed once
            self._leaf_list = [nid for cid in self.t_classes for nid in self.cls_nodes[cid]
                               if self._is_term(nid) and not any(
                                   self._is_term(c) and OPS[self.nodes[c]["op"]].sort == "T"
                                   for c in self.nodes[nid]["children"])]
        return self._leaf_list

    def _program_cost_fn(self, costs):
        """``node_cost`` for ``Reach("program", ...)`` without a target, with the per-node
        dispatch of ``_program_cost`` decided once per node: the same cases, the same float
        operations in the same order (so the same costs and choices), fewer calls per
        evaluation (the normal form's extraction evaluates millions of nodes)."""
        table = self._prog_table
        if table is None:
            table = self._prog_table = {}
            INF, LEAF = C.INF, C.LEAF
            for cid in self.t_classes:
                for nid in self.cls_nodes[cid]:
                    if not self._is_term(nid):
                        continue
                    op, kids, ukids, fixed, _ = self._static(nid)
                    if op in ("St", "Out"):
                        table[nid] = (0, INF)
                    elif op in ("Num", "Par", "Cnt", "Elm"):
                        table[nid] = (0, LEAF)
                    elif op in ("Sum", "RMax", "RMin"):
                        table[nid] = (0, INF) if self.blk.get(kids[0]) != "J" else (1, kids[1])
                    elif fixed == INF:
                        table[nid] = (0, INF)
                    else:
                        table[nid] = (2, fixed, ukids, kids[0] if op == "Exp" else None)
        get = costs.get
        INF, REDUCE, TILE = C.INF, C.REDUCE, C.TILE
        penalty = self._exp_penalty

        def cost(nid, ctx):
            t = table.get(nid)
            if t is None:   # (not a term node: node_cost's own answer)
                return self.node_cost(nid, ctx, Reach("program", frozenset(), frozenset()), costs, None)
            kind = t[0]
            if kind == 0:
                return t[1]
            if kind == 1:
                return REDUCE + TILE * get((t[1], "B"), INF)
            total = t[1] + sum(get((c, ctx), INF) for c in t[2])
            return total + (penalty("Exp", (t[3],), ctx) if t[3] is not None else 0.0)
        return cost

    def solve(self, reach: Reach, target=None):
        """Cheapest cost per (class, ctx): a worklist over the nodes whose children improved
        (Bellman-Ford on the e-graph hypergraph; costs are monotone, so it converges)."""
        costs: dict = {}
        best: dict = {}
        dep = self._deps()
        # start from the nodes without term children; a node is queued again whenever
        # one of its children's cost improves (FIFO: few re-evaluations)
        ctxs = (None, "B", "A") if reach.discover else (None, "B")
        work = deque((nid, ctx) for nid in self._leaves() for ctx in ctxs)
        queued = set(work)
        if reach.mode == "program" and target is None:
            node_cost = self._program_cost_fn(costs)
        else:
            def node_cost(nid, ctx):
                return self.node_cost(nid, ctx, reach, costs, target)
        nodes = self.nodes

        def improve(key, c, choice):
            if c < costs.get(key, C.INF) - 1e-9:
                costs[key] = c
                best[key] = choice
                for item in dep.get(key, ()):
                    if item not in queued:
                        queued.add(item)
                        work.append(item)
                if key[1] is None and key[0] in self.inv:   # hoisted into a tile
                    improve((key[0], "B"), c / C.TILE, "hoist")

        INF = C.INF
        popleft, discard = work.popleft, queued.discard
        while work:
            item = popleft()
            discard(item)
            c = node_cost(*item)
            if c < INF:
                improve((nodes[item[0]]["eclass"], item[1]), c, item[0])
        # deterministic ties: the first node of a class (in e-graph order) that reaches the optimum
        for (cid, ctx), opt in costs.items():
            for nid in self.cls_nodes[cid]:
                if self._is_term(nid) and node_cost(nid, ctx) <= opt + 1e-9:
                    best[(cid, ctx)] = nid
                    break
        return costs, best

    def build(self, cid, ctx, best) -> Term:
        nid = best[(cid, ctx)]
        if nid == "hoist":
            return self.build(cid, None, best)
        n = self.nodes[nid]
        op = n["op"]
        args = []
        for i, c in enumerate(n["children"]):
            if not self._is_term(c):
                args.append(self.payload(c))
            elif OPS[self.nodes[c]["op"]].sort == "Blk":
                args.append(self.build_blk(self.cls(c)))
            else:
                sub_ctx = ctx
                if op in ("Sum", "RMax", "RMin") and i == 1:
                    sub_ctx = "A" if self.blk.get(self.cls(n["children"][0])) == "A" else "B"
                args.append(self.build(self.cls(c), sub_ctx, best))
        return Term(op, tuple(args))

    def build_blk(self, cid) -> Term:
        """The block term of a block class: A, B, J, or a disjoint union of A and B (in the
        order decoded). Any other block (a class never decoded, a union of a block with
        itself or with J) is refused: a form over a block we cannot name must never reach
        codegen, where it would silently read the wrong elements."""
        name = self.blk.get(cid)
        one = {"A": Term("BA"), "B": Term("BB"), "J": Term("BJ")}
        if name in one:
            return one[name]
        if name and len(name) == 2 and set(name) == {"A", "B"}:
            return Term("BU", (one[name[0]], one[name[1]]))
        from acefuse.fuse import FuseError
        raise FuseError(f"extraction: block class {cid} (decoded as {name or 'nothing'!r}) is not A, B, J or a "
                        "disjoint union of A and B, so acefuse cannot name it; a rule made a block that the "
                        "encoding does not define. Remove the user rule that builds blocks, or report the "
                        "program and rules")

    def extract(self, cid, reach: Reach, target=None):
        """(cost, term) of the cheapest reachable form of a class, or (inf, None)."""
        key = (reach, target, target in self.strict_exp)
        if key not in self._solved:   # (costs depend on nothing else: every other cache is a function of the e-graph)
            self._solved[key] = self.solve(reach, target)
        costs, best = self._solved[key]
        c = costs.get((cid, None), C.INF)
        if c == C.INF:
            return C.INF, None
        return c, self.build(cid, None, best)
