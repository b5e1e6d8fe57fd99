"""The cost model: its contract, in units a reader can check.

A form of a state update is scored in two steps.

1. **Reachability** (schedule-level, decides rolling vs split forms). A term that
   needs data the schedule cannot see has infinite cost:
   - rolling (FlashAttention-style): the running state of the prefix A is known,
     the tile B is in registers, earlier states of this pass are already updated.
     Raw elements of A are gone: a reduction over A is unreachable (only its state is).
   - split (FlashDecoding-style): the finished partial states of A and B are known,
     earlier states of this pass are already merged. No raw element is reachable.
   HBM traffic is the same for every reachable form inside one pass (each element
   is read once), so bytes are accounted for at the schedule level
   (``FusionPass.hbm_passes``): a fused pass reads the input once, an unfusible
   reduction costs an extra pass.
2. **Work** (weighted operations). Each operator costs ``WEIGHTS[op]``; a
   reduction over the tile costs ``REDUCE`` plus ``TILE`` times the cost of its
   body (the body runs once per element). An ``exp`` whose argument is not known
   to be bounded above (``Bounded`` below) costs ``UNBOUNDED_EXP`` extra: it can
   overflow float32 where a bounded alternative cannot, so extraction takes the
   bounded form whenever one exists.

The cost is monotone in the children: every node adds a non-negative amount to
the sum of its children's costs.
"""
INF = float("inf")

WEIGHTS = {
    "Add": 1.0, "Sub": 1.0, "Neg": 1.0, "Mul": 1.0, "Max2": 1.0, "Min2": 1.0, "Abs": 1.0,
    "Div": 4.0, "Exp": 4.0, "Log": 4.0, "Sqrt": 4.0, "Rsqrt": 4.0, "Tanh": 8.0,
}
LEAF = 1.0            # reading a register / a scalar argument
REDUCE = 2.0          # the cross-lane reduction itself
TILE = 64.0           # elements per row of a tile, in the weighting of per-element work
UNBOUNDED_EXP = 1e4   # an exp that may overflow where a bounded form exists
