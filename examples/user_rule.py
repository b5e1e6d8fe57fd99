"""A rule of your own: the Renyi-2 entropy of a softmax, -log(sum_j p_j^2), needs
re-association of a product to derive its correction, which the default DERIVE
schedule does not run. One proved user rule makes it fusible.

    acefuse prove examples/user_rule.py        # proves the rule
    acefuse derive examples/user_rule.py       # uses the file's RULES: fusible
"""
import acefuse as af
from acefuse.rules import rw, tvars

a, b, c = tvars("a b c")
mul_assoc = rw("mul-assoc-right-to-left", a * (b * c), (a * b) * c)
RULES = [mul_assoc]

x = af.tensor("x", "r j")
m = af.max(x, "j")
e = af.exp(x - m)
renyi2 = af.program("renyi2", h=-af.log(af.sum(e * e, "j") / af.sum(e, "j") ** 2))

if __name__ == "__main__":
    print(af.fuse(renyi2).reason)
    print(af.fuse(renyi2, rules=RULES).explain())
