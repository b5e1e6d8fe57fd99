"""Softmax and logsumexp, written plainly: acefuse derives the one-pass forms.

    acefuse derive examples/softmax.py
    acefuse run examples/softmax.py --check
"""
import acefuse as af

x = af.tensor("x", "r j")            # named axes; r is parallel, j is reduced
m = af.max(x, "j")
e = af.exp(x - m)
l = af.sum(e, "j")
softmax = af.program("softmax", y=e / l)
lse = af.program("logsumexp", out=m + af.log(l))
