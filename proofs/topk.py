"""The merge of two k-candidate states (af.topk), proved for every block size.

A *k-candidate state* of a block S (a non-empty set of positions of the selected axis) is
``top_k(S)``: its min(k, |S|) first elements in the order of acefuse/topk.py, padded to k with
the empty candidate ``BOT = (-inf, +inf)``. Elements are pairs (value y, rank g): ``y`` is the
value with NaN read as +inf and ``g`` the index (negative for a NaN, so NaNs come first), and

    p before q   <=>   y_p > y_q,  or  y_p == y_q and g_p < g_q          (SPEC_BEFORE)

Positions are distinct, so on the elements of a union of disjoint blocks this is a strict
total order. A merge is a *comparator network*: a list of compare-exchanges ``(r, s)`` on
2k slots (A's candidates in slots 0..k-1, B's in k..2k-1), each putting the earlier of the two
in slot r and the other in slot s, with one comparator term ``before(p, q)``; the merged state
is slots 0..k-1. ``network_terms`` writes a network as acefuse terms (where, comparisons) over
the states ``St(v_r, A)``, ``St(i_r, A)``, ``St(v_r, B)``, ``St(i_r, B)`` (what a kernel's merge
hook evaluates).

**Theorem.** For disjoint blocks A, B of any sizes, ``merge(top_k(A), top_k(B)) =
top_k(A u B)`` when ``prove_merge`` says "proved". The proof has three parts:

1. *The comparator is a compare-exchange of SPEC_BEFORE* (``check_comparator``): its term
   selects among its four leaves (y_p, g_p, y_q, g_q) with comparisons only, so, as in
   proofs/order.py, it agrees with SPEC_BEFORE for all reals exactly when it agrees on one
   representative of every weak order of the leaves with g_p != g_q, which are enumerated
   (and on BOT against BOT, where either choice leaves the same pair).
2. *The network keeps the top k of two sorted lists, sorted* (``check_network``): by the 0-1
   principle (Knuth, TAOCP 5.3.4, Theorem Z; it holds for inputs restricted to two sorted
   lists, which a monotone map keeps sorted) a network of compare-exchanges does so for every
   input iff it does for every pair of sorted 0-1 lists, (k+1)^2 cases, all enumerated. BOT
   candidates are equal to each other and below every element; equal inputs leave a
   compare-exchange's output unchanged, so padding does not affect the argument.
3. *Lemma (every block size)*: ``top_k(A u B) = top_k(top_k(A) u top_k(B))``. An element x of
   A among the first k of A u B has fewer than k elements of A u B before it, so fewer than k
   of A: x is in top_k(A) (the same for B). So the first k of A u B all lie in
   ``top_k(A) u top_k(B)``, a subset of A u B, and are its first k.

Parts 1 and 2 are decided mechanically here; part 3 is the argument above, which needs no
block size. A rolling update is the same merge with B the tile (its state from the
definition). Wrong merges are refused: a network that keeps k - 1 candidates, pairs the wrong
slots, or a comparator that orders equal values by the higher index (tests/test_topk.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from acefuse.rewrite.terms import Term

INF = math.inf
BOT = (-INF, INF)
METHOD = "compare-exchange by order types of its leaves; network by the 0-1 principle; union lemma"


def SPEC_BEFORE(p, q) -> bool:
    """The documented order: the larger value first, the lower index among equal values."""
    return p[0] > q[0] or (p[0] == q[0] and p[1] < q[1])


# ---- comparator terms ----------------------------------------------------------------------------
def _v(name):
    return Term("?", (name,))


def before_term(yp, gp, yq, gq, ties="lowest"):
    """``p before q`` as a term: ``(y_p > y_q) | ((y_p == y_q) & (g_p < g_q))``. ``ties=
    "highest"`` builds the wrong variant (equal values, higher index first) for mutation tests."""
    tie = Term("CmpLt" if ties == "lowest" else "CmpGt", (gp, gq))
    return Term("LOr", (Term("CmpGt", (yp, yq)), Term("LAnd", (Term("CmpEq", (yp, yq)), tie))))


@dataclass
class Network:
    """A merge of two k-candidate states: compare-exchanges on 2k slots, then slots 0..k-1
    (``keep`` of them; the rest read BOT)."""
    k: int
    comparators: list
    ties: str = "lowest"
    keep: int = None
    notes: list = field(default_factory=list)

    def __post_init__(self):
        if self.keep is None:
            self.keep = self.k


def merge_network(k: int) -> Network:
    """The merge acefuse uses: slot r takes the earlier of A's r-th and B's (k-1-r)-th
    candidate (the first k of the union, as a bitonic sequence), then an odd-even
    transposition sort of slots 0..k-1 (k rounds): k + k(k-1)/2 comparators."""
    comps = [(r, 2 * k - 1 - r) for r in range(k)]
    for rnd in range(k):
        comps += [(r, r + 1) for r in range(rnd % 2, k - 1, 2)]
    return Network(k, comps)


def run_network(net: Network, slots: list, before=None) -> list:
    """Apply the network to concrete candidates (pairs) with ``before`` (default: the
    network's comparator evaluated on numbers)."""
    if before is None:
        def before(p, q):
            return _eval_before(net.ties, p, q)
    s = list(slots)
    for r, t in net.comparators:
        if not before(s[r], s[t]):
            s[r], s[t] = s[t], s[r]
    return s[:net.keep] + [BOT] * (net.k - net.keep)


def _eval_before(ties, p, q):
    from acefuse.proofs.order import _ev, _Leaves
    t = before_term(_v("yp"), _v("gp"), _v("yq"), _v("gq"), ties)
    env = {"yp": p[0], "gp": p[1], "yq": q[0], "gq": q[1]}
    return bool(_ev(t, env, "0", _Leaves(set(env)), None))


# ---- part 1: the comparator ----------------------------------------------------------------------
def check_comparator(ties="lowest"):
    """None when the comparator term equals SPEC_BEFORE on every weak order of its four leaves
    with distinct ranks (and BOT vs BOT), else a counterexample (p, q)."""
    from acefuse.proofs.order import _assignments, _ev, _Leaves
    names = ["yp", "gp", "yq", "gq"]
    t = before_term(*map(_v, names), ties)
    for env in _assignments(names, []):
        if env["gp"] == env["gq"]:
            continue   # two elements of disjoint blocks never share a position
        p, q = (env["yp"], env["gp"]), (env["yq"], env["gq"])
        if bool(_ev(t, env, "0", _Leaves(set(names)), None)) != SPEC_BEFORE(p, q):
            return p, q
    return None


# ---- part 2: the network -------------------------------------------------------------------------
def check_network(net: Network):
    """None when the network outputs the first k of every pair of sorted 0-1 lists, sorted
    (the 0-1 principle), else the failing input (a, b)."""
    k = net.k

    def before(p, q):   # 0-1 keys: 1 before 0; equal keys are interchangeable
        return p >= q
    for ones_a in range(k + 1):
        for ones_b in range(k + 1):
            a = [1] * ones_a + [0] * (k - ones_a)
            b = [1] * ones_b + [0] * (k - ones_b)
            s = list(a + b)
            for r, t in net.comparators:
                if not before(s[r], s[t]):
                    s[r], s[t] = s[t], s[r]
            got = s[:net.keep] + [0] * (k - net.keep)
            want = sorted(a + b, reverse=True)[:k]
            if got != want:
                return a, b
    return None


@dataclass
class MergeProof:
    k: int
    status: str          # "proved" | "refuted"
    detail: str
    counterexample: object = None
    method: str = METHOD
    scope: str = "for all block sizes"

    @property
    def ok(self):
        return self.status == "proved"


def prove_merge(net: Network) -> MergeProof:
    """Prove the merge of two k-candidate states given by ``net`` (module docstring)."""
    bad = check_comparator(net.ties)
    if bad is not None:
        p, q = bad
        return MergeProof(net.k, "refuted", f"the comparator disagrees with the documented order at p = {p}, "
                          f"q = {q} (SPEC_BEFORE(p, q) = {SPEC_BEFORE(p, q)})", bad, scope="")
    bad = check_network(net)
    if bad is not None:
        a, b = bad
        # a concrete counterexample with real candidates: the 0-1 lists lifted to pairs
        lift_a = [(1.0, 2 * r) if x else (0.0, 2 * r) for r, x in enumerate(a)]
        lift_b = [(1.0, 2 * r + 1) if x else (0.0, 2 * r + 1) for r, x in enumerate(b)]
        got = run_network(net, lift_a + lift_b)
        want = sorted(lift_a + lift_b, key=lambda p: (-p[0], p[1]))[:net.k]
        return MergeProof(net.k, "refuted", f"states A = {lift_a}, B = {lift_b}: merge gives {got}, the first "
                          f"{net.k} of A u B are {want}", (lift_a, lift_b), scope="")
    return MergeProof(net.k, "proved", f"merge of two {net.k}-candidate states proved ({METHOD}; for all "
                      f"block sizes; {len(net.comparators)} compare-exchanges)")


# ---- the network as acefuse terms ----------------------------------------------------------------
def network_terms(net: Network, v="v", i="i", payloads=(), a_side=None, b_side=None):
    """[(value term, index term, *payload terms)] of the merged state, over ``St(f"{v}{r}", A)``,
    ``St(f"{i}{r}", A)`` and the same for B (r = 0..k-1): one where per compare-exchange.

    ``payloads`` names values that travel with each candidate (``St(f"{p}{r}", blk)``: a
    function of the candidate's position, e.g. af.gather of another expression at the chosen
    index). A compare-exchange moves whole slots and its comparator reads only (y, g), so the
    merged slots are the same elements as without payloads, each with its own payload: the
    theorem carries over unchanged. ``a_side`` / ``b_side`` replace A's / B's slots by other
    terms (a rolling update reads B's candidates from the tile)."""
    from acefuse.rewrite.terms import A, B, st
    names = (v, i) + tuple(payloads)

    def side(blk, given):
        if given is not None:
            return [tuple(x) for x in given]
        return [tuple(st(f"{n}{r}", blk) for n in names) for r in range(net.k)]
    slots = side(A, a_side) + side(B, b_side)
    for r, t in net.comparators:
        p, q = slots[r], slots[t]
        c = before_term(p[0], p[1], q[0], q[1], net.ties)
        slots[r] = tuple(Term("Where", (c, x, y)) for x, y in zip(p, q))
        slots[t] = tuple(Term("Where", (c, y, x)) for x, y in zip(p, q))
    bot = (Term("Num", (-INF,)), Term("Num", (INF,))) + tuple(Term("Num", (-INF,)) for _ in payloads)
    return slots[:net.keep] + [bot] * (net.k - net.keep)


def top_k_state(block, k):
    """The k-candidate state of a block given as [(y, g)]: its first k, padded with BOT."""
    s = sorted(block, key=lambda p: (-p[0], p[1]))[:k]
    return s + [BOT] * (k - len(s))


if __name__ == "__main__":   # python -m acefuse.proofs.topk
    for k in range(1, 9):
        print(k, prove_merge(merge_network(k)).detail)
