"""Attention written plainly; acefuse derives FlashAttention (rolling) and
FlashDecoding (split-KV merge) from it. Variants are ordinary programs: a score
modification or a mask is just more math on the score.

Grouped heads (GQA/MQA): split the query-head axis into the key/value head g and
the member r of its group. A torch query of shape [B, H, N, D] with G key/value
heads is ``q.view(B, G, H // G, N, D)``, declared here as "b g r i d"; keys and
values are "b g j d" / "b g j e". Nothing else changes.
"""
import math

import acefuse as af

D = 128
SCALE = 1.0 / math.sqrt(D)
WINDOW = 256
CAP = 30.0

q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
slope = af.tensor("slope", "h")          # per-head ALiBi slope
i, j = af.index("i"), af.index("j")


def attend(name, s, v=v):
    m = af.max(s, "j")
    p = af.exp(s - m)
    l = af.sum(p, "j")
    return af.program(name, o=af.sum(p * v, "j") / l)


score = af.sum(q * k, "d") * SCALE
attention = attend("attention", score)
causal = attend("causal", af.where(j <= i, score, af.NEG_INF))
alibi = attend("alibi", af.where(j <= i, score + slope * (j - i), af.NEG_INF))
softcap = attend("softcap", CAP * af.tanh(score / CAP))
sliding_window = attend("sliding_window", af.where((j <= i) & (i - j < WINDOW), score, af.NEG_INF))

# grouped-query attention: 32 query heads over 8 key/value heads -> g = 8, r = 4
qg = af.tensor("q", "b g r i d")
kg = af.tensor("k", "b g j d")
vg = af.tensor("v", "b g j e")
gqa = attend("gqa", af.sum(qg * kg, "d") * SCALE, v=vg)
# decode: the same program with one query row per head (i has length 1); the
# cost model picks the split-KV schedule and the derived merge as the combine
decode = attend("decode", af.sum(qg * kg, "d") * SCALE, v=vg)

# deferred normalization is derived, not written: dividing inside the sum
pv = af.exp(score - af.max(score, "j"))
inside = af.program("normalize_inside", o=af.sum(pv * v / af.sum(pv, "j"), "j"))
