"""Programs shared by the tests (written plainly, as a user would)."""
import acefuse as af

x = af.tensor("x", "r j")
m = af.max(x, "j")
e = af.exp(x - m)
l = af.sum(e, "j")
softmax = af.program("softmax", y=e / l)
logsumexp = af.program("logsumexp", out=m + af.log(l))
mu = af.mean(x, "j")
mad = af.program("mad", out=af.sum(af.abs(x - mu), "j"))
