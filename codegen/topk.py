"""The row family with k-candidate states (acefuse/topk_fuse.py): the tile's top k.

Every template, hook and schedule is the row family's (codegen/row.py); this adds one
lowering: a tile's candidates ``TopSel(g, r, slot)`` of selection g. They are computed
together, once per region, by k rounds over the tile in registers (no loop over elements;
the k rounds are unrolled in the generated source):

    v_r = max(y)                              # the largest left (y: NaN read as +inf)
    i_r = min(where(y == v_r, g, +inf))        # its lowest rank
    hit = g == i_r;  p_r = max(where(hit, f, -inf))   # payloads at that position
    y = where(hit, -inf, y);  g = where(hit, +inf, g) # taken: it becomes BOT

Positions outside the tile (masked) are BOT = (-inf, +inf) from the start, so they come
after every element, -inf included. That is the definition of the tile's k-candidate
state: each round takes the first element in the order among those not taken yet.
"""
from __future__ import annotations

from acefuse.codegen.row import RowGen, Context
from acefuse.codegen.emit import bcast


class TopKContext(Context):
    def reduce_tile(self, t, em):
        body = t.args[1]
        if body.op not in ("TopSel", "TopNet") or t.args[0].op != "BB":
            return None
        gid, r, slot = body.args[:3]
        key = (body.op, gid) + tuple(body.args[3:])
        if key not in em.cache:
            em.cache[key] = (self.g.emit_selection(gid, em) if body.op == "TopSel"
                             else self.g.emit_network(gid, em, body.args[3], self.mode))
        return em.cache[key][(int(r), slot)], "row"


class TopKGen(RowGen):
    context = TopKContext

    def __init__(self, fusion):
        super().__init__(fusion)
        self.groups = {g.gid: g for g in fusion.topk_groups}

    def emit_selection(self, gid, em):
        g = self.groups[gid]
        mask = em.ctx.tile_mask
        em.comment(f"the tile's {g.k} candidates of `{g.spec.axis}`: {g.k} rounds of (max, lowest rank "
                   "among the maxima, mask it out)")

        def tile(t):
            e, sh = em.emit(t)
            return bcast(e, sh, "tile")
        y = em.fresh("sy")
        em.assign(y, f"tl.where({mask}, {tile(g.y)}, float('-inf'))")
        rk = em.fresh("sg")
        em.assign(rk, f"tl.where({mask}, {tile(g.g)}, float('inf'))")
        fs = [tile(f) for f in g.f]
        out = {}
        for r in range(g.k):
            v, i = em.fresh("tv"), em.fresh("ti")
            em.assign(v, f"tl.max({y}, axis=1)")
            em.assign(i, f"tl.min(tl.where({y} == {v}[:, None], {rk}, float('inf')), axis=1)")
            out[(r, "v")], out[(r, "i")] = v, i
            hit = em.fresh("hit")
            em.assign(hit, f"{rk} == {i}[:, None]")
            for j, f in enumerate(fs):
                p = em.fresh("tp")
                em.assign(p, f"tl.reduce(tl.where({hit}, {f}, float('-inf')), 1, _max_nan)")
                out[(r, f"p{j}_")] = p
            if r + 1 < g.k:
                em.assign(y, f"tl.where({hit}, float('-inf'), {y})")
                em.assign(rk, f"tl.where({hit}, float('inf'), {rk})")
        return out


    def emit_network(self, gid, em, side, mode):
        """The group's merge network (its Network object, the one proofs/topk.py proves),
        one compare-exchange at a time, over A's running candidates and B's: the tile's
        (``side == "tile"``) or the other partial state's (``"state"``, the ``_b`` values)."""
        g = self.groups[gid]
        net = g.net
        slots = g.slots()
        if side == "tile":
            sel = em.cache.get(("TopSel", gid)) or self.emit_selection(gid, em)
            em.cache[("TopSel", gid)] = sel
            b = [[sel[(r, s)] for s in slots] for r in range(g.k)]
        else:
            b = [[n + "_b" for n in g.names(r)] for r in range(g.k)]
        a = [list(g.names(r)) for r in range(g.k)]
        cur = a + b
        em.comment(f"merge of two {g.k}-candidate states: {len(net.comparators)} compare-exchanges "
                   f"(proofs/topk.py, proved for all block sizes)")
        tie = "<" if net.ties == "lowest" else ">"
        for r, t in net.comparators:
            p, q = cur[r], cur[t]
            c = em.fresh("c")
            em.assign(c, f"({p[0]} > {q[0]}) | (({p[0]} == {q[0]}) & ({p[1]} {tie} {q[1]}))")
            np_, nq = [], []
            for x, y in zip(p, q):
                u, w = em.fresh("m"), em.fresh("m")
                em.assign(u, f"tl.where({c}, {x}, {y})")
                em.assign(w, f"tl.where({c}, {y}, {x})")
                np_.append(u)
                nq.append(w)
            cur[r], cur[t] = np_, nq
        out = {}
        for r in range(g.k):
            for j, s in enumerate(slots):
                if r < net.keep:
                    out[(r, s)] = cur[r][j]
                else:   # a network that keeps fewer candidates pads with BOT (refused by the proof)
                    bot = "float('inf')" if s == "i" else "float('-inf')"
                    out[(r, s)] = em.bind(f"{bot} + tl.zeros([BLOCK_R], tl.float32)", "row", "bot")[0]
        return out


def generate(fusion) -> str:
    return TopKGen(fusion).module()
