"""Mixture-of-experts routing with one expert per token (Switch Transformer), written plainly:
the softmax over the experts and the choice of the expert fuse into one pass over the router
logits (states: the running max and sum of the softmax, and argmax's running max and index).

    acefuse derive examples/moe.py
    acefuse run examples/moe.py --check

Top-k for k > 1 (a running state of k candidates) is not supported yet: see README, "Argmax
and argmin". With k = 1 the renormalised weight is 1; Switch Transformer scales the expert's
output by its softmax probability, ``exp(m - m) / l = 1 / l``.
"""
import acefuse as af

x = af.tensor("x", "t e")              # router logits: tokens t, experts e (the reduced axis)
m = af.max(x, "e")
l = af.sum(af.exp(x - m), "e")
switch_top1 = af.program("switch_top1", expert=af.argmax(x, "e"), gate=1.0 / l)

# the router's z-loss term beside the choice (ST-MoE): logsumexp squared, same pass
router_z = af.program("router_top1_zloss", expert=af.argmax(x, "e"), gate=1.0 / l,
                      z=(m + af.log(l)) * (m + af.log(l)))


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
