"""Programs shared by the tests (written plainly, as a user would), the row-wise pieces
they are built from (``x`` over rows ``r`` and the fused axis ``j``, its max ``m``, the
shifted exponentials ``e`` and their sum ``l``, mean ``mu`` and variance ``var``, targets
``t``), and the runner of a compiled program in each schedule."""
import acefuse as af

x = af.tensor("x", "r j")
t = af.tensor("t", "r")
m = af.max(x, "j")
e = af.exp(x - m)
l = af.sum(e, "j")
softmax = af.program("softmax", y=e / l)
logsumexp = af.program("logsumexp", out=m + af.log(l))
mu = af.mean(x, "j")
var = af.mean((x - mu) ** 2, "j")
mad = af.program("mad", out=af.sum(af.abs(x - mu), "j"))


def run_schedules(k, prog, inputs, schedules):
    """Runs ``k``, program ``prog`` compiled, on ``inputs`` in each of ``schedules`` ((name, launch
    options) pairs; "split" only where the fusion is one pass that can split); yields
    (schedule name, {output name: tensor})."""
    for sched, kw in schedules:
        if sched == "split" and not (len(k.fusion.passes) == 1 and k.fusion.passes[0].split_ok):
            continue
        out = k(**inputs, schedule=sched, **kw)
        yield sched, (out if isinstance(out, dict) else {next(iter(prog.outputs)): out})
