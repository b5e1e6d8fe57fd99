"""What acefuse took from captured torch graphs, and what it left to torch and why.

Every *reduction-like* computation of a captured graph (a softmax, a normalization, a
loss, an attention, a plain sum or max: each op of kind ``reduce`` or an offloaded
contraction, plus reductions acefuse has no lowering for, such as ``torch.cumsum`` or
``F.group_norm``) appears once per graph: ``taken`` (it runs inside an acefuse kernel,
the entry carries that kernel's program) or ``left`` (torch runs it; the entry says why
and where).

    cf = af.compile(fn, x); cf(x)
    r = cf.report(); print(r)          # a table: status, op, source line, program or reason
    [e.program for e in r.taken]       # the acefuse programs
"""
from __future__ import annotations

from acefuse.frontend.graph import op_name, source_line
from acefuse.frontend.lower import kind_of, name_of
from acefuse.frontend.partition import OFFLOAD_CONTRACTIONS

# reductions that acefuse has no lowering for: listed as left, so a report names them
UNLOWERED_REDUCTIONS = {
    "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "group_norm", "batch_norm", "instance_norm",
    "local_response_norm", "normalize", "norm", "prod", "median", "topk", "sort", "argmax", "argmin",
    "nll_loss", "kl_div", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "softmin", "embedding_bag", "std_mean", "var_mean", "nansum",
    "nanmean", "all", "any", "count_nonzero", "multi_head_attention_forward",
}


def _raw_name(node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def is_reduction_like(node) -> bool:
    """A node the report lists: a reduction (lowered or not) or an attention."""
    if node.op not in ("call_function", "call_method") or node.meta.get("af_torch"):
        return False
    k = kind_of(node)
    if k == "reduce":
        return True
    if k == "contraction":
        return name_of(node) in OFFLOAD_CONTRACTIONS
    return k is None and _raw_name(node) in UNLOWERED_REDUCTIONS


class Entry:
    """One reduction-like computation: ``status`` ('taken' or 'left'), ``op`` (torch's name),
    ``line`` (``file.py:12: code``), ``program`` (the acefuse program that computes it, when
    taken), ``reason`` (why torch computes it, when left), ``graph`` (the captured graph)."""

    __slots__ = ("status", "op", "line", "program", "reason", "graph", "region", "node")

    def __init__(self, status, op, line, program=None, reason="", graph="", region=None, node=""):
        self.status, self.op, self.line, self.program = status, op, line, program
        self.reason, self.graph, self.region, self.node = reason, graph, region, node

    def key(self):
        return (self.graph, self.node, self.op, self.line, self.status, self.reason,
                getattr(self.program, "name", None))

    def __repr__(self):
        what = self.program.name if self.program is not None else self.reason
        return f"<{self.status} {self.op} at {self.line or '?'}: {what}>"


def graph_entries(gm, in_region: dict, reasons: dict, graph: str) -> list:
    """Entries for one specialised graph. ``in_region``: node -> CompiledRegion holding it;
    ``reasons``: node -> why it was left to torch (recorded by the partitioner)."""
    out = []
    for n in gm.graph.nodes:
        if not is_reduction_like(n):
            continue
        opn, line = op_name(n), source_line(n)
        r = in_region.get(n)
        if r is not None:
            out.append(Entry("taken", opn, line, r.program, graph=graph, region=r, node=n.name))
            continue
        why = reasons.get(n)
        if why is None:
            k = kind_of(n)
            why = ("acefuse has no lowering for this op" if k is None else
                   "no region was formed around it (internal: no reason recorded)")
        out.append(Entry("left", opn, line, reason=why, graph=graph, node=n.name))
    return out


class Report:
    """The reduction-like computations of every captured graph; ``taken`` and ``left`` are
    lists of ``Entry`` (``entry.program`` is the acefuse program of a taken one)."""

    def __init__(self, entries):
        seen, self.entries = set(), []
        for e in entries:
            e = _live(e)
            if e.key() not in seen:
                seen.add(e.key())
                self.entries.append(e)

    @property
    def taken(self) -> list:
        return [e for e in self.entries if e.status == "taken"]

    @property
    def left(self) -> list:
        return [e for e in self.entries if e.status == "left"]

    @property
    def programs(self) -> list:
        """The distinct acefuse programs that compute the taken entries (one per region)."""
        out = []
        for e in self.taken:
            if all(e.program is not p for p in out):
                out.append(e.program)
        return out

    def __len__(self):
        return len(self.entries)

    def __str__(self):
        if not self.entries:
            return "acefuse report: no reduction-like computation in the captured graphs"
        rows = [("", "op", "source", "program / reason")]
        for e in self.entries:
            rows.append((e.status, e.op.replace("torch.nn.functional.", "F."), e.line or "?",
                         e.program.name if e.program is not None else e.reason))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        w[2] = min(w[2], 60)
        lines = [f"acefuse report: {len(self.taken)} taken, {len(self.left)} left to torch"]
        for r in rows:
            src = r[2] if len(r[2]) <= w[2] else r[2][:w[2] - 3] + "..."
            lines.append(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {src:<{w[2]}}  {r[3]}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<acefuse Report: {len(self.taken)} taken, {len(self.left)} left>"


def _live(e: Entry) -> Entry:
    """A taken entry whose region was disabled at run time (its kernel failed, or it has no
    backward kernel in training) is reported as left, with that reason."""
    r = e.region
    if e.status != "taken" or r is None:
        return e
    if r.kernel is None:
        why = f"its kernel failed at run time and was disabled ({r.kernel_error})"
    elif r.grad_error is not None and r.calls["torch"]:
        why = f"in training: {r.grad_error}"
    else:
        return e
    return Entry("left", e.op, e.line, reason=why, graph=e.graph, node=e.node)
