"""Partitioning an FX graph into regions acefuse compiles and the rest, left to torch.

A region is a *convex* set of nodes with lowerings (no path leaves it and comes back),
grown greedily in topological order: a node joins (and may merge) the regions of its
producers unless one of its other inputs depends on them. A region is offered to
acefuse only if it contains a reduction; elementwise-only regions stay with torch.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from acefuse.frontend.lower import kind_of, name_of, is_pure_view

CALLS = ("call_function", "call_method")


def split_composites(gm: torch.fx.GraphModule) -> None:
    """Rewrite ops whose last step is a full reduction into a per-row part acefuse can
    fuse and a torch tail: ``cross_entropy(reduction='mean'|'sum')`` becomes
    ``cross_entropy(reduction='none')`` followed by a torch sum (and a count of the
    targets that are not ``ignore_index``)."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or name_of(n) != "cross_entropy":
            continue
        red = n.kwargs.get("reduction", n.args[6] if len(n.args) > 6 else "mean")
        if red == "none" or len(n.args) > 3 and any(a is not None for a in n.args[3:6] if not isinstance(a, int)):
            continue
        ii = n.kwargs.get("ignore_index", n.args[4] if len(n.args) > 4 else -100)
        target = n.args[1] if len(n.args) > 1 else n.kwargs["target"]
        args = tuple(n.args[:6])
        kw = dict(n.kwargs)
        kw["reduction"] = "none"
        with g.inserting_before(n):
            rows = g.call_function(F.cross_entropy, args, kw)
            rows.meta = dict(n.meta)
            total = g.call_function(torch.sum, (rows,))
            total.meta["af_torch"] = True
            if red == "mean":
                valid = g.call_function(operator.ne, (target, ii))
                cnt = g.call_function(torch.sum, (valid,))
                out = g.call_function(operator.truediv, (total, cnt))
                for x in (valid, cnt, out):
                    x.meta["af_torch"] = True
            else:
                out = total
        for k in ("stack_trace",):
            for x in (total, out):
                x.meta[k] = n.meta.get(k)
        n.replace_all_uses_with(out)
        g.erase_node(n)
    g.lint()
    gm.recompile()


def unshare_contraction_operands(gm: torch.fx.GraphModule) -> None:
    """Give each offloaded contraction (attention) its own copy of every view or cast chain
    between it and an operand when that chain is shared with other users. A mask built once and
    ``expand``ed once for every layer (transformers 5.17's ``sdpa_mask`` under tracing) would
    otherwise be an *output* of the first attention's region, over (query, key), which the
    attention kernel cannot write; views cost nothing in torch, and each region reads its
    copy as a view of the operand (the operand itself, when computed, is left to torch by the
    retry in runtime.specialize)."""
    g = gm.graph
    changed = False
    for c in list(g.nodes):
        if c.op != "call_function" or kind_of(c) != "contraction" or name_of(c) not in OFFLOAD_CONTRACTIONS:
            continue
        slots = [("a", i) for i in range(min(len(c.args), 4))] + \
                [("k", k) for k in ("query", "key", "value", "attn_mask") if k in c.kwargs]
        for where, i in slots:
            a = c.args[i] if where == "a" else c.kwargs[i]
            chain, x = [], a
            while isinstance(x, torch.fx.Node) and x.op in CALLS and kind_of(x) in ("layout", "cast") and x.args:
                chain.append(x)
                x = x.args[0]
            if not chain or all(len(n.users) == 1 for n in chain):
                continue
            env: dict = {}
            with g.inserting_before(c):
                for n in reversed(chain):      # from the operand's base up to the contraction's argument
                    cp = g.node_copy(n, lambda y: env.get(y, y))
                    cp.meta = dict(n.meta)
                    env[n] = cp
            if where == "a":
                args = list(c.args)
                args[i] = env[a]
                c.args = tuple(args)
            else:
                kw = dict(c.kwargs)
                kw[i] = env[a]
                c.kwargs = kw
            for n in chain:                    # (the original chain's links only the contraction used)
                if not n.users:
                    g.erase_node(n)
            changed = True
    if changed:
        g.lint()
        gm.recompile()


# Contractions acefuse is offered: attention (the contraction kernel family). Plain
# matmul / linear / einsum / bmm stay with torch (a GEMM library), so attention written
# with matmuls gets its softmax (and masking, scaling) fused by acefuse between them.
OFFLOAD_CONTRACTIONS = {"scaled_dot_product_attention"}


def _allowed(n, region_of, find, exclude):
    """Can node ``n`` be lowered as part of a region (given its producers' regions)?"""
    if n.op not in CALLS or n.meta.get("af_torch") or n in exclude:
        return False
    k = kind_of(n)
    if k is None:
        return False
    if k == "contraction" and name_of(n) not in OFFLOAD_CONTRACTIONS:
        return False
    if k == "static":
        # only a getitem of a tuple produced inside a region (split pieces)
        # a getitem of a tuple produced inside a region (split pieces), or basic indexing of
        # a tensor (on an input: a view the runtime replays; else the import refuses it)
        return name_of(n) == "getitem" and isinstance(n.meta.get("af_val"), torch.Tensor) and \
            (n.args[0] in region_of or isinstance(n.args[0].meta.get("af_val"), torch.Tensor))
    v = n.meta.get("af_val")
    if not isinstance(v, torch.Tensor) and not (isinstance(v, (tuple, list)) and v and isinstance(v[0], torch.Tensor)):
        return False
    if k == "layout":
        src = n.args[0]
        inside = src in region_of
        nm = name_of(n)
        if nm in ("split", "chunk", "unbind") and inside:
            return False
        if nm in ("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as") and inside:
            sv = src.meta.get("af_val")
            return is_pure_view(tuple(sv.shape), tuple(v.shape)) or _leaf_view(src, region_of)
    return True


def _leaf_view(n, region_of) -> bool:
    """``n`` (inside a region) is an input re-viewed or cast only (``logits.float()`` before a
    cross-entropy's ``view(-1, V)``): the import replays its chain on the input, so any view of it
    is one more step of that chain, not a reshape of a computed value."""
    while n in region_of:
        if n.op not in CALLS or kind_of(n) not in ("layout", "cast") or not n.args \
                or not isinstance(n.args[0], torch.fx.Node):
            return False
        n = n.args[0]
    return True


def find_regions(gm: torch.fx.GraphModule, exclude=frozenset()) -> list:
    """Regions as lists of nodes (topological order), each containing a reduction."""
    parent: dict = {}

    def find(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    region_of: dict = {}
    anc: dict = {}
    ext_anc: dict = {}
    members: dict = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        a = set()
        for p in ins:
            a |= {find(r) for r in anc[p]}
        if _allowed(n, region_of, find, exclude):
            cands = []
            for p in ins:
                if p in region_of and find(region_of[p]) not in cands:
                    cands.append(find(region_of[p]))
            chosen: list = []
            for r in cands:
                trial = chosen + [r]
                forb = set()
                for p in ins:
                    if p in region_of and find(region_of[p]) in trial:
                        continue
                    forb |= {find(x) for x in anc[p]}
                for t in trial:
                    forb |= {find(x) for x in ext_anc[t]}
                if not forb & set(trial):
                    chosen = trial
            if chosen:
                rid = chosen[0]
                for r in chosen[1:]:
                    parent[r] = rid
                    members[rid] += members.pop(r)
                    ext_anc[rid] |= ext_anc.pop(r)
            else:
                rid = len(parent)
                parent[rid] = rid
                members[rid] = []
                ext_anc[rid] = set()
            region_of[n] = rid
            members[rid].append(n)
            for p in ins:
                if not (p in region_of and find(region_of[p]) == rid):
                    ext_anc[rid] |= {find(x) for x in anc[p]}
            a.add(rid)
        anc[n] = a
    out = []
    for rid, ms in members.items():
        if any(kind_of(m) in ("reduce", "contraction") for m in ms):
            out.append(sorted(ms, key=order.__getitem__))
    return sorted(out, key=lambda ms: order[ms[0]])


def split_at_axis_change(nodes, reduced: dict):
    """Two convex pieces of a region whose reductions run over different axes, or None.

    ``reduced``: node -> (axis key, dims) of the axes each reduction reduces over itself
    (``importer.reduced_dims``). The cut is at the first reduction (topological order) over other
    axes than the region's first reduction: that reduction and everything inside the region that
    depends on it form the second piece, the rest the first. No path leaves the second piece and
    comes back (it holds its descendants), nor the first (a node of the second cannot reach it), so
    both are convex; each holds a reduction. A piece still over several axes is split again."""
    reds = [n for n in nodes if n in reduced]
    if not reds:
        return None
    first = reduced[reds[0]][0]
    cut = next((n for n in reds if reduced[n][0] != first), None)
    if cut is None:
        return None
    inside, later = set(nodes), {cut}
    for n in nodes:                     # topological order: descendants follow their producers
        if n not in later and any(p in later for p in n.all_input_nodes if p in inside):
            later.add(n)
    return [[n for n in nodes if n not in later], [n for n in nodes if n in later]]


def region_outputs(gm, nodes) -> list:
    s = set(nodes)
    return [n for n in nodes if any(u not in s for u in n.users)]


def rebuild(gm: torch.fx.GraphModule, regions: list) -> torch.fx.GraphModule:
    """A GraphModule in which each (imported, compiled) region is one call_module.

    ``regions``: list of (module_name, nn.Module, Imported)."""
    in_region = {}
    for i, (_, _, imp) in enumerate(regions):
        for n in imp.nodes:
            in_region[n] = i
    units = []
    seen = set()
    for n in gm.graph.nodes:
        if n in in_region:
            i = in_region[n]
            if i not in seen:
                seen.add(i)
                units.append(("region", i))
        else:
            units.append(("node", n))

    def deps(u):
        if u[0] == "node":
            return [p for p in u[1].all_input_nodes]
        return regions[u[1]][2].sources

    g = torch.fx.Graph()
    g._codegen = gm.graph._codegen   # (a Dynamo export's graph flattens its arguments)
    env: dict = {}
    root: dict = {}
    pending = list(units)
    done_nodes = set()
    while pending:
        for k, u in enumerate(pending):
            if all(p in done_nodes for p in deps(u)):
                break
        else:
            raise RuntimeError("acefuse partition: regions are not convex (a bug; please report)")
        pending.pop(k)
        if u[0] == "node":
            n = u[1]
            if n.op == "get_attr":
                t = gm
                for p in n.target.split("."):
                    t = getattr(t, p)
                root[n.target] = t
            elif n.op == "call_module":
                root[n.target] = gm.get_submodule(n.target)
            env[n] = g.node_copy(n, lambda x: env[x])
            done_nodes.add(n)
        else:
            name, mod, imp = regions[u[1]]
            root[name] = mod
            call = g.call_module(name, tuple(env[s] for s in imp.sources))
            for j, o in enumerate(imp.outputs):
                env[o.node] = g.call_function(operator.getitem, (call, j))
            done_nodes |= set(imp.nodes)
    new = torch.fx.GraphModule(root, g, getattr(gm, "_af_name", "af_graph"))
    return new
