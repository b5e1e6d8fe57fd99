"""Programs shared by the tests (written plainly, as a user would), the row-wise pieces
they are built from (``x`` over rows ``r`` and the fused axis ``j``, its max ``m``, the
shifted exponentials ``e`` and their sum ``l``, mean ``mu`` and variance ``var``, targets
``t``), and the runner of a compiled program in each schedule."""
import numpy as np

import acefuse as af


def index_op(op, x):
    """An index-arithmetic operator (integer grids, Python/numpy semantics: // and % round toward
    -inf) applied to its evaluated operands ``x``: the brute-force masks of the mask tests."""
    return {"Neg": lambda: -x[0], "Abs": lambda: np.abs(x[0]), "Add": lambda: x[0] + x[1],
            "Sub": lambda: x[0] - x[1], "Mul": lambda: x[0] * x[1], "FloorDiv": lambda: x[0] // x[1],
            "Mod": lambda: x[0] % x[1], "Max2": lambda: np.maximum(x[0], x[1]),
            "Min2": lambda: np.minimum(x[0], x[1]), "CmpLt": lambda: x[0] < x[1], "CmpLe": lambda: x[0] <= x[1],
            "CmpGt": lambda: x[0] > x[1], "CmpGe": lambda: x[0] >= x[1], "CmpEq": lambda: x[0] == x[1],
            "CmpNe": lambda: x[0] != x[1], "LAnd": lambda: x[0] & x[1], "LOr": lambda: x[0] | x[1],
            "LNot": lambda: ~x[0]}[op]()

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
