"""The memory-bound family, written plainly (two-pass where that is the natural
definition); acefuse derives the one-pass forms.
"""
import acefuse as af

EPS = 1e-5

x = af.tensor("x", "r j")
w = af.tensor("w", "j")
b = af.tensor("b", "j")
t = af.tensor("t", "r")           # integer class targets

# layernorm, two-pass definition: mean, then the variance around it
mu = af.mean(x, "j")
var = af.mean((x - mu) ** 2, "j")
layernorm = af.program("layernorm", y=(x - mu) * af.rsqrt(var + EPS) * w + b)

# the one-pass E[x^2] - E[x]^2 variance: the same function, numerically worse
var1 = af.mean(x * x, "j") - af.mean(x, "j") ** 2
layernorm_onepass = af.program("layernorm_onepass", y=(x - mu) * af.rsqrt(var1 + EPS) * w + b)

rmsnorm = af.program("rmsnorm", y=x * af.rsqrt(af.mean(x * x, "j") + 1e-6) * w)

m = af.max(x, "j")
l = af.sum(af.exp(x - m), "j")
log_softmax = af.program("log_softmax", y=x - m - af.log(l))

# cross-entropy with integer targets: logsumexp minus the target's logit
cross_entropy = af.program("cross_entropy", loss=m + af.log(l) - af.take(x, t, "j"))

# softmax and its logsumexp together: one kernel, shared states
softmax_lse = af.program("softmax_lse", y=af.exp(x - m) / l, lse=m + af.log(l))

# mean-reduced over rows: the per-row loss is fused over j, then a second stage
# (itself an acefuse program over r) takes the mean
cross_entropy_mean = af.program("cross_entropy_mean", loss=af.mean(m + af.log(l) - af.take(x, t, "j"), "r"))
