"""Mixture-of-experts routing, written plainly.

- Switch Transformer (one expert per token): the softmax over the experts and the choice of
  the expert fuse into one pass over the router logits (the running max and sum of the
  softmax, and argmax's running max and index).
- Top-k softmax routing (Mixtral, k = 2; k = 8 with ``softmax_topk(8)``): softmax over the
  experts, ``af.topk``, the selected weights renormalised.
- DeepSeek-V3 routing (``deepseek(k)``): sigmoid scores plus a per-expert bias used only for
  choosing; the weights are the unbiased scores of the chosen experts, renormalised and scaled.
  Grouped top-k (``deepseek_grouped``: experts in G groups, each scored by the sum of its top-2
  biased scores, the best groups kept, then top-k among their experts) runs as three acefuse
  kernels (group scores; the threshold group; the masked top-k), not one pass.

af.topk is one reduction kind (acefuse/topk_fuse.py): a running state of k candidates whose
update and split merge are the merge proved by proofs/topk.py. ``softmax_topk(k,
select="logits")`` and ``deepseek(k)`` (the gathered scores ride with the candidates) are one
pass over the experts in every schedule (single, loop, split). So is top-k of the softmax
*probabilities* (``softmax_topk(k)``, written plainly): ``exp(x - m) / l`` is a strictly
increasing function of x with row constants m and l (proofs/monotone.py), so the selection is
made on x, the online-softmax max and sum carried beside it, and the chosen probabilities are
computed from the finished states. Where float32 rounding makes two probabilities equal, the
larger logit comes first (the documented convention; torch.topk would take the lower index).

    acefuse derive examples/moe.py
    acefuse run examples/moe.py --check
"""
import acefuse as af

x = af.tensor("x", "t e")              # router logits: tokens t, experts e (the reduced axis)
m = af.max(x, "e")
l = af.sum(af.exp(x - m), "e")
# With k = 1 the renormalised weight is 1; Switch Transformer scales the expert's output by its
# softmax probability, ``exp(m - m) / l = 1 / l``.
switch_top1 = af.program("switch_top1", expert=af.argmax(x, "e"), gate=1.0 / l)

# the router's z-loss term beside the choice (ST-MoE): logsumexp squared, same pass
router_z = af.program("router_top1_zloss", expert=af.argmax(x, "e"), gate=1.0 / l,
                      z=(m + af.log(l)) * (m + af.log(l)))


def softmax_topk(k, name=None, select="probs"):
    """softmax over the experts, top-k, the selected weights renormalised (Mixtral's router).

    Written plainly, one pass: acefuse selects on the logits because the probabilities are a
    proved strictly increasing function of them (README, "Top-k of a monotone function").
    ``select="logits"`` writes that choice explicitly and weighs the experts
    ``exp(v - m) / sum_r exp(v_r - m)``: one pass (the max and one k-candidate state)."""
    x = af.tensor("x", "t e")
    m = af.max(x, "e")
    if select == "logits":
        vals, idx = af.topk(x, k, "e")
        w = af.exp(vals - m)
        return af.program(name or f"softmax_top{k}_logits", weights=w / w.sum(), experts=idx)
    p = af.exp(x - m) / af.sum(af.exp(x - m), "e")
    vals, idx = af.topk(p, k, "e")
    return af.program(name or f"softmax_top{k}", weights=vals / vals.sum(), experts=idx)


def deepseek(k, scale=1.0, name=None):
    """DeepSeek-V3 routing without groups: choose by sigmoid(x) + bias, weigh by sigmoid(x)."""
    x = af.tensor("x", "t e")
    bias = af.tensor("bias", "e")
    s = af.sigmoid(x)
    _, idx = af.topk(s + bias, k, "e")
    w = af.gather(s, idx, "e")                     # the unbiased scores of the chosen experts
    return af.program(name or f"deepseek_top{k}", weights=w / w.sum() * scale, experts=idx)


softmax_top2 = softmax_topk(2)
deepseek_top2 = deepseek(2, scale=2.5)


def _grouped_programs(k, groups, topk_group, group_size, scale):
    # 1. group scores: the sum of each group's top-2 biased scores (x viewed as [t, g, f])
    xg = af.tensor("x", "t g f")
    bg = af.tensor("bias", "g f")
    top2, _ = af.topk(af.sigmoid(xg) + bg, 2, "f")
    # written in float32 whatever the logits' type: the group choice compares these sums, and a
    # bfloat16 store would make distinct ones equal (1.99274 and 1.99485 both 1.9921875)
    scores = af.program("ds_group_scores", gs=af.cast(top2.sum(), "float32"))
    # 2. the topk_group-th group in the order (value, then the lower group index)
    gs = af.tensor("gs", "t g")
    gv, gi = af.topk(gs, topk_group, "g")
    threshold = af.program("ds_group_threshold", tv=gv[topk_group - 1], ti=gi[topk_group - 1])
    # 3. top-k over the experts of the kept groups (a group at or before the threshold)
    x = af.tensor("x", "t e")
    bias = af.tensor("bias", "e")
    gval = af.tensor("gs_e", "t e")          # each expert's group score (torch repeats gs per group)
    tv, ti = af.tensor("tv", "t"), af.tensor("ti", "t")
    grp = af.index("e") // group_size
    kept = (gval > tv) | (gval.eq(tv) & (grp <= ti))
    s = af.sigmoid(x)
    _, idx = af.topk(af.where(kept, s + bias, af.NEG_INF), k, "e")
    w = af.gather(s, idx, "e")
    route = af.program(f"ds_grouped_top{k}", weights=w / w.sum() * scale, experts=idx)
    return scores, threshold, route


def deepseek_grouped(k, groups, topk_group, n_experts, scale=1.0):
    """DeepSeek-V3 grouped routing as a callable ``route(x, bias) -> (weights, experts)``:
    three acefuse kernels (group scores, threshold group, masked top-k). Masked experts score
    -inf (DeepSeek's reference code); ties go to the lower index, groups as experts.

    Precision: DeepSeek-V3's reference gate (``MoEGate`` in modeling_deepseek.py) casts the
    router's input and weight to float32, so its scores, biased scores and group scores are
    float32 whatever the model's type. The kernels compute in float32 too, and the group
    scores, which the group choice compares, are written in float32 for any input type (a
    bfloat16 store would make distinct group scores equal and keep the wrong group); the
    threshold and the per-expert group scores stay float32 up to the comparison. Only the
    weights are written in the logits' type (float32 for float8 logits)."""
    if n_experts % groups:
        raise ValueError(f"deepseek_grouped: {n_experts} experts do not split into {groups} groups")
    gsz = n_experts // groups
    if topk_group * gsz < k:
        raise ValueError(f"deepseek_grouped: {topk_group} groups of {gsz} experts hold fewer than k = {k}")
    import torch
    progs = _grouped_programs(k, groups, topk_group, gsz, scale)
    k1, k2, k3 = (af.compile(p) for p in progs)

    def route(x, bias, **kw):
        t = x.shape[0]
        gs = k1(x=x.reshape(t, groups, gsz), bias=bias.reshape(groups, gsz), **kw)   # one output: a tensor
        th = k2(gs=gs, **kw)
        # the row family gathers only along its fused axis: torch repeats each group's score
        # over its experts ([t, e], one elementwise copy), the kernel compares it per expert
        gs_e = gs.repeat_interleave(gsz, dim=1)
        # the weights in the logits' type (kernel 3's first input is the float32 gs_e)
        wdt = x.dtype if x.dtype.itemsize > 1 else torch.float32
        out = k3(x=x, bias=bias, gs_e=gs_e, tv=th["tv"], ti=th["ti"].to(gs.dtype),
                 out_dtypes={"weights": wdt}, **kw)
        return out["weights"], out["experts"]
    route.kernels = (k1, k2, k3)
    return route


if __name__ == "__main__":
    import torch
    f = af.fuse(switch_top1)
    print(f.explain())
    k = af.compile(switch_top1)
    logits = torch.randn(6, 64)
    out = k(x=logits)
    p = torch.softmax(logits, -1)
    print("expert", out["expert"].tolist(), "torch", p.argmax(-1).tolist())
    print("gate  ", [round(v, 6) for v in out["gate"].tolist()], "torch", [round(v, 6) for v in p.amax(-1).tolist()])
    k2 = af.compile(softmax_top2)
    out = k2(x=logits)
    w, i = torch.topk(p, 2, dim=-1)
    print("top-2 experts", out["experts"].tolist(), "torch", i.tolist())
    print("top-2 weights", out["weights"].tolist(), "torch", (w / w.sum(-1, keepdim=True)).tolist())
