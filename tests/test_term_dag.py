"""Programs whose terms share subterms are walked as DAGs (rewrite/dag.py, Term's cached hash).

af.topk's k-th candidate is built from the ones before it: examples/moe.py's grouped top-8
routing has 801 term objects reading as a tree of 4,974,236 nodes, and compiling it took
86-148 s in Program.reduced_axes, codegen/compile.py's stage and the certificate's hashes.
Here a term of 2^k tree nodes built from k + 2 objects (x, then y = y + y, k times) must be
handled in well under a second by every walk a compile makes: each test fails (the alarm, a
count of calls) with the tree walks, which would take longer than the age of the universe
at k = 64. The DAG walks must also give what the tree walks gave on terms they can still
walk."""
import pickle
import random
import signal
from contextlib import contextmanager

import pytest

import acefuse as af
from acefuse.lang import Expr, Program
from acefuse.rewrite import dag
from acefuse.rewrite.terms import Term, num

DEPTH = 64


@contextmanager
def _deadline(seconds):
    def fail(*_):
        raise TimeoutError(f"not done within {seconds} s: a walk over the tree, not the DAG")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _doubled(depth, leaf):
    t = leaf
    for _ in range(depth):
        t = Term("Add", (t, t))
    return t


def _shared_program(depth=DEPTH, outer=True):
    """s = sum_j (x doubled ``depth`` times), out = s / (s doubled), or s: 2^depth tree nodes
    or more, 2 * depth + 4 objects."""
    x = af.tensor("x", "r j")
    s = af.sum(Expr(_doubled(depth, x.term), x.axes, x.tensors), "j")
    return af.program(f"doubled_{depth}", out=s / Expr(_doubled(depth, s.term), s.axes, s.tensors) if outer else s)


def test_reduced_axes_and_hash_of_a_shared_term_are_fast():
    prog = _shared_program()
    with _deadline(20):
        assert prog.reduced_axes() == ["j"]
        t = prog.outputs["out"].term
        assert hash(t) == hash((t.op, t.args)) and {t: 1}[t] == 1


def test_stage_of_a_shared_term_is_fast():
    from acefuse.codegen.compile import stage
    prog = _shared_program()
    with _deadline(20):
        assert stage(prog, "j") is None   # no reduction over another axis of a reduction over j


def test_key_text_is_computed_once_per_subterm(monkeypatch):
    """The key's text is Term.sexpr's (cache keys unchanged: recomputed here the old way at a
    small depth), and Program.key builds it once per distinct subterm: at depth 20 (2^21 tree
    nodes, 23 objects) Term.sexpr runs only for the leaves. Its length is the tree's, so the
    key of a deep enough DAG stays out of reach (a limit of the key's format)."""
    import hashlib
    small = _shared_program(6)
    text = repr((small.name, sorted(small.tensors.items()),
                 sorted((k, v.term.sexpr(), v.axes) for k, v in small.outputs.items())))
    assert small.key() == hashlib.sha256(text.encode()).hexdigest()[:16]
    prog = _shared_program(20, outer=False)
    calls = []
    plain = Term.sexpr
    monkeypatch.setattr(Term, "sexpr", lambda self: calls.append(self.op) or plain(self))
    memo = {}
    assert len(dag.sexpr(prog.outputs["out"].term, memo)) == 15_728_648 and len(memo) == 23
    calls.clear()
    prog.key()
    assert len(calls) <= 2, calls   # the leaf x (tree walk: 2^20 leaves, 2^21 calls)


def _random_term(rng, pool, n):
    """A random term over a pool of shared subterms (leaves: inputs, indices, numbers, reductions)."""
    ops2 = ["Add", "Sub", "Mul", "Div", "Max2", "CmpLt"]
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            ax = rng.choice(["j", "k"])
            pool.append(Term(rng.choice(["Sum", "RMax", "RMin"]), (Term("Ax", (ax,)), rng.choice(pool))))
        elif r < 0.25:
            pool.append(Term(rng.choice(["Exp", "Neg", "Abs"]), (rng.choice(pool),)))
        elif r < 0.3:
            pool.append(Term("Cast", (rng.choice(pool), "float32")))
        else:
            pool.append(Term(rng.choice(ops2), (rng.choice(pool), rng.choice(pool))))
    return pool[-1]


@pytest.mark.parametrize("seed", range(6))
def test_dag_walks_give_what_the_tree_walks_gave(seed):
    rng = random.Random(seed)
    x, y = af.tensor("x", "r j k"), af.tensor("y", "r k")
    pool = [x.term, y.term, Term("Idx", ("j",)), num(rng.uniform(-3, 3)), num(-0.0), num(1e-300), num(2.0)]
    outs = [_random_term(rng, pool, 40) for _ in range(3)]
    # first appearance in pre-order, as the tree walk reaches them
    first = []
    for o in outs:
        for t in o.walk():
            if not any(t is u for u in first):
                first.append(t)
    assert [id(t) for t in dag.nodes(*outs)] == [id(t) for t in first]
    memo = {}
    assert [dag.sexpr(o, memo) for o in outs] == [o.sexpr() for o in outs]
    # Program.reduced_axes: the order of first appearance over the outputs
    want = []
    for o in outs:
        for t in o.walk():
            if t.op in ("Sum", "RMax", "RMin") and t.args[0].args[0] not in want:
                want.append(t.args[0].args[0])
    prog = Program(f"random_{seed}", {f"o{i}": Expr(o, ("r",), {**x.tensors, **y.tensors})
                                      for i, o in enumerate(outs)})
    assert prog.reduced_axes() == want


def test_term_hash_is_cached_and_not_pickled():
    """A Term's hash is the dataclass's, hash((op, args)), computed once; a pickled Term
    carries no hash (str hashes differ between processes), and is equal with the same hash."""
    t = _doubled(5, Term("In", ("x",)))
    h = hash(t)
    assert h == hash(("Add", t.args)) and t.__dict__.get("_hash") == h
    u = pickle.loads(pickle.dumps(t))
    assert "_hash" not in u.__dict__ and u == t and hash(u) == h
    assert Term("Add", (num(1.0), num(2.0))) == Term("Add", (num(1.0), num(2.0)))
    assert len({Term("Add", (num(1.0), num(2.0))), Term("Add", (num(1.0), num(2.0)))}) == 1
