"""Extraction from a saturated e-graph with a reachability- and numerics-aware cost.

egglog's own extractor uses static per-constructor costs; ours depends on the
schedule (rolling or split), on which state is being solved (only states earlier
in the pass are known at the union), and on facts the analyses proved (an exp
argument bounded above). So the e-graph is serialized and extracted here: a
fixpoint over (e-class, context) pairs, context = whether we are inside a
reduction over the tile B (where element values exist).
"""
from __future__ import annotations

from dataclasses import dataclass

from acefuse.rewrite.terms import Term, OPS, RELATIONS
from acefuse.extract import cost as C


@dataclass(frozen=True)
class Reach:
    """What a form may read: the schedule and the states known at this point."""

    mode: str                      # "rolling" | "split" | "final"
    carried: frozenset             # states carried per block (their St over A (and B, split) is known)
    earlier: frozenset             # states already updated at the union A u B
    # "final": a finished pass; St(q, J) is the only state form and is known


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
                if ctx == "B" and (b, a, self.b_class) in self.ub:
                    return True
        return False

    # -- costs ------------------------------------------------------------------------------
    def node_cost(self, nid, ctx, reach: Reach, costs, target):
        n = self.nodes[nid]
        op = n["op"]
        ch = n["children"]
        if op == "St":
            q = self.payload(ch[0])
            blk = self.blk.get(self.cls(ch[1]))
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
            blk = self.blk.get(self.cls(ch[0]))
            if not (reach.mode == "rolling" and blk == "B"):
                return C.INF
            body = costs.get((self.cls(ch[1]), "B"), C.INF)
            return C.REDUCE + C.TILE * body
        if op not in C.WEIGHTS:
            return C.INF
        total = C.WEIGHTS[op]
        for c in ch:
            total += costs.get((self.cls(c), ctx), C.INF)
        if op == "Exp" and not self.bounded(self.cls(ch[0]), ctx):
            total += C.UNBOUNDED_EXP
        return total

    def solve(self, reach: Reach, target=None):
        """Fixpoint of the cheapest cost per (class, ctx)."""
        costs: dict = {}
        best: dict = {}
        t_classes = [c for c in self.cls_nodes if c not in self.blk]
        changed = True
        rounds = 0
        while changed and rounds < 200:
            changed = False
            rounds += 1
            for ctx in (None, "B"):
                for cid in t_classes:
                    for nid in self.cls_nodes[cid]:
                        if not self._is_term(nid):
                            continue
                        c = self.node_cost(nid, ctx, reach, costs, target)
                        if c < costs.get((cid, ctx), C.INF) - 1e-9:
                            costs[(cid, ctx)] = c
                            best[(cid, ctx)] = nid
                            changed = True
        return costs, best

    def build(self, cid, ctx, best) -> Term:
        nid = best[(cid, ctx)]
        n = self.nodes[nid]
        op = n["op"]
        args = []
        for i, c in enumerate(n["children"]):
            if not self._is_term(c):
                args.append(self.payload(c))
            elif OPS[self.nodes[c]["op"]].sort == "Blk":
                args.append(self.build_blk(self.cls(c)))
            else:
                sub_ctx = "B" if (op in ("Sum", "RMax", "RMin") and i == 1) else ctx
                args.append(self.build(self.cls(c), sub_ctx, best))
        return Term(op, tuple(args))

    def build_blk(self, cid) -> Term:
        name = self.blk.get(cid)
        return {"A": Term("BA"), "B": Term("BB"), "J": Term("BJ"),
                "AB": Term("BU", (Term("BA"), Term("BB")))}.get(name, Term("BJ"))

    def extract(self, cid, reach: Reach, target=None):
        """(cost, term) of the cheapest reachable form of a class, or (inf, None)."""
        costs, best = self.solve(reach, target)
        c = costs.get((cid, None), C.INF)
        if c == C.INF:
            return C.INF, None
        return c, self.build(cid, None, best)
