"""The barrier protocol of the warp-specialised Gluon kernels (codegen/contraction_gluon.py), run
on the CPU: the generated partitions, cut down to their control flow, their integer
bookkeeping (tile and item counts, stages, phases) and their mbarrier operations, run as
Python generators under a random interleaving; TMA copies complete at random later steps.
mbarrier semantics as on sm_90: a phase completes after ``count`` arrivals, and a wait for
parity p passes while the number of completed phases has the other parity (so a barrier two
phases ahead of a waiter looks not-yet-complete to it).

The persistent ping-pong kernel hung on an H200 (session 14; more work items than programs):
here a program walks several items of random lengths (empty ones included), and every run
must finish. Nothing here needs a GPU; the math of the kernels is not run (the GPU tests do).

    python -m pytest -q tests/test_gluon_pingpong_protocol.py -p no:cacheprovider
"""
import random
import re

import pytest

import acefuse as af
from acefuse.codegen.contraction_gluon import GluonGen

q = af.tensor("q", "b h i d")
k = af.tensor("k", "b h j d")
v = af.tensor("v", "b h j e")
i, j = af.index("i"), af.index("j")


def _fusion(masked):
    s = af.sum(q * k, "d") * 0.125
    if masked:
        s = af.where(j <= i, s, af.NEG_INF)
    p = af.exp(s - af.max(s, "j"))
    return af.fuse(af.program("p_turns", o=af.sum(p * v, "j") / af.sum(p, "j")))


KEEP = re.compile(r"(for (item|start|w|st) in |if WG|else:|mbarrier\.(wait|arrive)\(|_tma_load\(|(t_i|stage|ph|tc|it) = )")


def _protocol(src, fn, persistent):
    """The generator function of partition ``fn`` (a function of the generated source): its
    loops, ``if WG`` branches, the integer bookkeeping and its barrier operations as yields."""
    text = src.split(f"def {fn}(")[1].split("\n@gluon.jit")[0]
    lines = text.split("\n")[1:]
    out = ["def part(WG, ITEM, NS, n_items, first=0, a=0, b=0, end=0):", "    BLOCK_J = 1", "    PID, NPROG = 0, 1"]
    for ln in lines:
        body = ln.strip()
        if not body or body.startswith("#") or not KEEP.match(body):
            continue
        ind = ln[:len(ln) - len(ln.lstrip())]
        body = body.split("  #")[0].rstrip()
        body = (body.replace("gl.static_range", "range").replace("gl.program_id(0)", "PID")
                .replace("gl.num_programs(0)", "NPROG"))
        m = re.match(r"mbarrier\.wait\((\w+)\.index\((.*?)\), (.*)\)$", body)
        if m:
            body = f"yield ('wait', '{m.group(1)}', {m.group(2)}, {m.group(3)})"
        m = re.match(r"mbarrier\.arrive\((\w+)\.index\((.*?)\), count=1\)$", body)
        if m:
            body = f"yield ('arrive', '{m.group(1)}', {m.group(2)})"
        m = re.match(r"_tma_load\(\w+, \[.*?\], (\w+)\.index\((.*?)\), .*\)$", body)
        if m:
            body = f"yield ('tma', '{m.group(1)}', {m.group(2)})"
        assert "gl." not in body and "mbarrier." not in body and "_tma" not in body, body
        out.append(ind + body)
        if persistent and body.startswith("for item in range("):
            out.append(ind + "    first, a, b, end = ITEM(item)")
    fixed = []   # a block left empty by the cut gets a pass
    for n, ln in enumerate(out):
        fixed.append(ln)
        if ln.rstrip().endswith(":"):
            ind = len(ln) - len(ln.lstrip())
            nxt = out[n + 1] if n + 1 < len(out) else ""
            if len(nxt) - len(nxt.lstrip()) <= ind:
                fixed.append(" " * (ind + 4) + "pass")
    ns = {}
    exec("\n".join(fixed), ns)
    return ns["part"], "\n".join(fixed)


COUNTS = {"q_bar": 1, "q_free": 1, "turn": 1, "k_bar": 1, "v_bar": 1, "kv_free": 2}


def _run(parts, ns, seed, limit=200000):
    """Interleave the partitions (generators) at random; TMA copies arrive at random later
    steps. Returns None when every partition finished, else a description of the deadlock."""
    rng = random.Random(seed)
    bars = {(b, s): [0, 0] for b, c in COUNTS.items() for s in range(max(ns, 2))}   # arrivals, phases

    def arrive(b, s):
        st = bars[b, s]
        st[0] += 1
        if st[0] == COUNTS[b]:
            st[0], st[1] = 0, st[1] + 1
    cur = {n: next(g, None) for n, g in parts.items()}
    tma = []
    for _ in range(limit):
        ready = [n for n, op in cur.items() if op is not None
                 and not (op[0] == "wait" and bars[op[1], op[2]][1] % 2 == op[3] % 2)]
        if not ready and not tma:
            live = {n: op for n, op in cur.items() if op is not None}
            return None if not live else f"deadlock: {live}, barriers {[(k_, v_) for k_, v_ in bars.items() if v_ != [0, 0]]}"
        if tma and (not ready or rng.random() < 0.3):
            arrive(*tma.pop(rng.randrange(len(tma))))
            continue
        n = rng.choice(ready)
        op = cur[n]
        if op[0] == "arrive":
            arrive(op[1], op[2])
        elif op[0] == "tma":
            tma.append((op[1], op[2]))
        cur[n] = next(parts[n], None)
    return "no end within the step limit"


def _items(rng, n_items, maxlen):
    lens = [rng.randint(0, maxlen) for _ in range(n_items)]
    bounds = []
    for T in lens:
        a = rng.randint(0, T)
        bounds.append((0, a, rng.randint(a, T), T))
    return bounds


@pytest.mark.parametrize("masked", [False, True])
def test_persistent_ping_pong_runs_to_the_end(masked):
    gen = GluonGen(_fusion(masked), ws=True, pingpong=True, persistent=True)
    src = gen.module()
    nm = f"{gen.name}_p"
    con, con_text = _protocol(src, f"_{nm}_consume", True)
    load, _ = _protocol(src, f"_{nm}_load", True)
    assert "turn" in con_text and "kv_free" in con_text
    rng = random.Random(7 + masked)
    for trial in range(150):
        NS = rng.choice((2, 3, 4))
        items = _items(rng, rng.randint(1, 6), 5)
        it = lambda x, items=items: items[x]   # noqa: E731
        parts = {"consume0": con(0, it, NS, len(items)), "consume1": con(1, it, NS, len(items)),
                 "load": load(None, it, NS, len(items))}
        why = _run(parts, NS, seed=trial)
        assert why is None, f"items {items} (tiles each; first, a, b, end), {NS} stages: {why}"


@pytest.mark.parametrize("pp", [False, True])
def test_one_shot_kernel_runs_to_the_end(pp):
    """The one-shot warp-specialised kernel (one item per program), with and without ping-pong:
    the same model, as a check of the model itself against kernels that ran on the GPU."""
    gen = GluonGen(_fusion(True), ws=True, pingpong=pp)
    src = gen.module()
    con, _ = _protocol(src, f"_{gen.name}_consume", False)
    load, _ = _protocol(src, f"_{gen.name}_load", False)
    rng = random.Random(3)
    for trial in range(100):
        NS = rng.choice((2, 3, 4))
        (first, a, b, end), = _items(rng, 1, 6)
        parts = {"consume0": con(0, None, NS, 1, first, a, b, end), "consume1": con(1, None, NS, 1, first, a, b, end),
                 "load": load(0, None, NS, 1, first, a, b, end)}
        why = _run(parts, NS, seed=trial)
        assert why is None, f"tiles {(first, a, b, end)}, {NS} stages: {why}"


def test_the_model_finds_a_deadlock():
    """The model can fail: the consumers of a persistent kernel whose second warpgroup waits
    for one score too many (a turn wait with the wrong parity) deadlock in it."""
    gen = GluonGen(_fusion(False), ws=True, pingpong=True, persistent=True)
    src = gen.module().replace("(t_i + it + WG) & 1", "(t_i + it + WG + 1) & 1")
    nm = f"{gen.name}_p"
    con, _ = _protocol(src, f"_{nm}_consume", True)
    load, _ = _protocol(src, f"_{nm}_load", True)
    items = [(0, 1, 2, 3), (0, 0, 2, 2)]
    it = lambda x: items[x]   # noqa: E731
    parts = {"consume0": con(0, it, 3, 2), "consume1": con(1, it, 3, 2), "load": load(None, it, 3, 2)}
    assert _run(parts, 3, seed=0).startswith("deadlock")


def test_without_the_acknowledgement_parity_waits_alias():
    """Why the second warpgroup acknowledges the end of an item: without it (its turn phases
    counted accordingly) the first warpgroup's end-of-item arrival and its next item's first
    score arrival can both land before the second warpgroup's wait, which then sees the
    barrier's parity unchanged and waits forever, in some interleavings only."""
    gen = GluonGen(_fusion(False), ws=True, pingpong=True, persistent=True)
    src = gen.module()
    ack = ("        else:   # taken (its last wait is behind it): the first warpgroup may start the next item\n"
           "            mbarrier.arrive(turn.index(0), count=1)\n"
           "        if WG == 0:\n"
           "            mbarrier.wait(turn.index(0), (tc + (end - first + BLOCK_J - 1) // BLOCK_J + it) & 1)\n")
    assert ack in src
    noack = src.replace(ack, "").replace("(t_i + it + WG) & 1", "(t_i + it * WG + WG) & 1")
    nm = f"{gen.name}_p"
    con, _ = _protocol(noack, f"_{nm}_consume", True)
    load, _ = _protocol(noack, f"_{nm}_load", True)
    rng, hung = random.Random(1), 0
    for trial in range(300):
        NS = rng.choice((2, 3, 4))
        items = _items(rng, rng.randint(1, 6), 5)
        it = lambda x, items=items: items[x]   # noqa: E731
        parts = {"consume0": con(0, it, NS, len(items)), "consume1": con(1, it, NS, len(items)),
                 "load": load(None, it, NS, len(items))}
        hung += _run(parts, NS, seed=trial) is not None
    assert 0 < hung < 300
