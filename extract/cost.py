"""The cost model: its contract, in units a reader can check.

A form of a state update is scored in three steps.

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
   body (the body runs once per element). Inside a tile, a subterm that does not
   depend on the element (an ``Inv`` class, e.g. ``m_AB`` in ``exp(x - m_AB)``)
   is computed once per tile, not per element: it costs its cost outside the
   tile divided by ``TILE``. An operation whose two operands are the same class
   (``d * d``) computes that operand once and counts it once. An ``exp`` whose
   argument is not known to be bounded above costs ``UNBOUNDED_EXP`` extra: it
   can overflow float32 where a bounded alternative cannot, so extraction takes
   the bounded form whenever one exists.
3. **Numerics: cancellation** (Herbie-style, extract/numerics.py). Every e-class
   is evaluated once in float64 on a stress input (``STRESS``: a few rows, blocks
   of a few elements, element values ``1e4 + N(0, 1)``, per-row values
   ``U(0.5, 2)``); all nodes of a class share that value. An ``Add``/``Sub``
   whose two operands both carry rounding error (accumulated sums, means,
   products -- not leaves, counts, constants, or max/min, which are exact) costs
   ``BIT`` per bit lost to cancellation, ``log2(max(|a|, |b|) / |a +- b|)``
   (capped at ``BITS_CAP``, a float32 significand). Raw-moment forms are
   numerically worse, and this term is how the model knows it: for two-pass
   variance, ``sum_B(x*x) - 2 r sum_B(x) + n_B r^2`` subtracts quantities of size
   ``n 1e8`` to leave one of size ``n`` (all 24 bits lost, cost ``24 BIT``), while
   ``sum_B((x - r)^2)`` subtracts only a leaf from a mean (no charge) and the
   correction ``n_A (r_AB - r_A)^2`` loses about ``log2(1e4 / |r_AB - r_A|)``
   bits once -- a cancellation every correct merge has. One lost bit costs
   more than any few operations, so a form that computes the same value with
   less cancellation wins.

4. **Auxiliary states** (rewrite/auxiliary.py). When a state has no reachable
   rolling form, extraction runs once more with ``Reach.discover``: a sum over
   the folded block A whose body is A-local (elements, constants, per-row values,
   ``n_A``, states over A updated before the target) becomes reachable as a
   *proposed* state, at ``AUX_STATE`` (one more state carried: its register, its
   init, update and merge, its slot in a split workspace) plus ``REDUCE`` plus
   ``TILE`` times its body (the body is summed once per element of every tile).
   The cheapest form names the set of states to add; with the cancellation term
   above, a shifted auxiliary sum (``sum_A(x - m_A)``) beats a raw moment
   (``sum_A(x)``, which cancels against ``n_A m_A`` at a large offset) although its
   body costs one subtraction more per element.

The cost is monotone in the children: every node adds a non-negative amount to
the (sum of the) costs of its children.
"""
INF = float("inf")

WEIGHTS = {
    "Add": 1.0, "Sub": 1.0, "Neg": 1.0, "Mul": 1.0, "Max2": 1.0, "Min2": 1.0, "Abs": 1.0,
    "Div": 4.0, "Exp": 4.0, "Log": 4.0, "Sqrt": 4.0, "Rsqrt": 4.0, "Tanh": 8.0,
    "Pow": 8.0,           # a constant power: a few multiplies, or exp(p * log(a))
    "Where": 1.0, "CmpLt": 1.0, "CmpLe": 1.0, "CmpGt": 1.0, "CmpGe": 1.0, "CmpEq": 1.0,
    "CmpNe": 1.0, "LAnd": 1.0, "LOr": 1.0, "LNot": 1.0,
    # special functions: an exp/log (or two) and a few flops; log1p/expm1/softplus work in float64
    "Erf": 8.0, "Sigmoid": 6.0, "Softplus": 12.0, "Log1p": 8.0, "Expm1": 8.0,
    "Floor": 1.0, "Ceil": 1.0, "Round": 4.0, "Cast": 2.0,
    # exact int64 arithmetic: a division is a long sequence, the rest a few integer ops
    "FloorDiv": 8.0, "Mod": 8.0, "BitAnd": 2.0, "BitOr": 2.0, "BitXor": 2.0, "BitNot": 2.0,
    "Shl": 2.0, "Shr": 2.0,
}
LEAF = 1.0            # reading a register / a scalar argument
REDUCE = 2.0          # the cross-lane reduction itself
TILE = 64.0           # elements per row of a tile, in the weighting of per-element work
UNBOUNDED_EXP = 1e4   # an exp that may overflow where a bounded form exists
BIT = 16.0            # one bit lost to cancellation (weighted operations)
BITS_CAP = 24.0       # at most a float32 significand is lost
AUX_STATE = 128.0     # one more carried state proposed by discovery (two elements' worth of a tile)

# The stress input of the numerics term (extract/numerics.py).
STRESS = {
    "rows": 4,            # independent samples
    "block_a": 3,         # elements of block A
    "block_b": 4,         # elements of block B
    "offset": 1e4,        # common offset of element values: |mean| >> std
    "par": (0.5, 2.0),    # per-row values are uniform on this interval
    "seed": 20240607,
}
