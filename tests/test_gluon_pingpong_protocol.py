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
from tests import barrier_model

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


KEEP_Q = re.compile(KEEP.pattern[:-1] + r"|if (start|end\w*) .*:|_dot_\d+ = warpgroup_mma\(q_smem, |_pv\d+ = warpgroup_mma\()")
KEEP_D = re.compile(KEEP_Q.pattern[:-1] + r"|item = |while |item_buf\.)")


def _protocol(src, fn, persistent, q_slots=False, dynamic=False):
    """The generator function of partition ``fn`` (a function of the generated source): its
    loops, ``if WG`` branches, the integer bookkeeping and its barrier operations as yields
    (tests/barrier_model.py). ``q_slots``: the query buffers as slots (the query copy lands item
    ``item`` in slot ('q', w); each score MMA reads its warpgroup's slot, which must hold this
    item's tile). ``dynamic``: work items from the shared counter ``CNT`` (the load partition's
    atomic add), passed to the consumers through ``BUF`` (the program's ``item_buf``); each
    consumer records the items it folds in ``SEEN``."""
    def translate(body, ind):
        body = (body.replace("gl.static_range", "range").replace("gl.program_id(0)", "PID")
                .replace("gl.num_programs(0)", "NPROG"))
        if dynamic and body.startswith("item = gl.atomic_add(cnt_ptr, 1)"):
            return ["item = CNT[0]", "CNT[0] += 1"]
        m = re.match(r"item_buf\.index\(0\)\.store\(gl\.full\(\[1\], (\w+), .*\)\)$", body)
        if dynamic and m:
            return [f"BUF[0] = {m.group(1)}"]
        if dynamic and body.startswith("item = gl.max(item_buf.index(0).load("):
            return ["item = BUF[0]"]
        if q_slots and re.match(r"_dot_\d+ = warpgroup_mma\(q_smem, ", body):
            return ["yield ('read', ('q', WG), item)"]
        if q_slots and re.match(r"_tma_load\(q_desc, \[.*?\], q_bar\.index\(w\), .*\)$", body):
            return ["yield ('tma', 'q_bar', w, ('q', w), item)"]
        if q_slots and re.match(r"_tma_load\(v_desc, \[.*?\], v_bar\.index\(stage\), .*\)$", body):
            return ["yield ('tma', 'v_bar', stage, ('v', stage), t_i)"]   # the value tile of tile t_i
        if q_slots and re.match(r"_pv\d+ = warpgroup_mma\(", body):
            return ["yield ('read', ('v', stage), t_i)"]   # P @ V: the stage must still hold tile t_i
        if re.match(r"_pv\d+ = ", body):
            return None
        m = re.match(r"_tma_load\(\w+, \[.*?\], (\w+)\.index\((.*?)\), .*\)$", body)
        if m:
            body = f"yield ('tma', '{m.group(1)}', {m.group(2)})"
        m = re.match(r"mbarrier\.arrive\((\w+)\.index\((.*?)\), count=1, pred=(.*)\)$", body)
        if m:   # a predicated arrival
            return [f"if {m.group(3)}:", f"    yield ('arrive', '{m.group(1)}', {m.group(2)})"]
        own = ["    first_w, a_w, b_w, end_w = OWN(item, WG) if OWN and WG is not None else (first, a, b, end)"]
        if persistent and body.startswith("for item in range("):
            return [body, "    first, a, b, end = ITEM(item)"] + own
        if dynamic and body.startswith("while item < n_items:"):
            return [body, "    first, a, b, end = ITEM(item)", "    if WG is not None:", "        SEEN.append((WG, item))"] + own
        return [body]
    if dynamic:
        header = ["def part(WG, ITEM, NS, n_items, CNT, BUF, SEEN, OWN=None):", "    BLOCK_J = 1"]
    else:
        header = ["def part(WG, ITEM, NS, n_items, first=0, a=0, b=0, end=0, OWN=None):", "    BLOCK_J = 1",
                  "    PID, NPROG = 0, 1"]
    return barrier_model.partition(src, fn, KEEP_D if dynamic else KEEP_Q if q_slots else KEEP, header, translate)


COUNTS = {"q_bar": 1, "q_free": 1, "turn": 1, "k_bar": 1, "v_bar": 1, "kv_free": 2}


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
        why = barrier_model.run(parts, trial, counts=COUNTS)
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
        why = barrier_model.run(parts, trial, counts=COUNTS)
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
    assert barrier_model.run(parts, 0, counts=COUNTS).startswith("deadlock")


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
        hung += barrier_model.run(parts, trial, counts=COUNTS) is not None
    assert 0 < hung < 300



def _own(rng, items):
    """own_range: each consumer's tiles of each item, a random run inside the pair's (the kernel's
    own analysis finds a box inside the pair's; a consumer always folds at least one tile)."""
    own = {}
    for x, (first, _, _, end) in enumerate(items):
        for w in (0, 1):
            if end <= first:
                own[x, w] = (first, first, first, first)
                continue
            fw = rng.randint(first, end - 1)
            ew = rng.randint(fw + 1, end)
            aw = rng.randint(fw, ew)
            own[x, w] = (fw, aw, rng.randint(aw, ew), ew)
    return lambda x, w: own[x, w]


def _run_persistent(src, name, rng, trials, items_min=1):
    nm = f"{name}_p"
    con, con_text = _protocol(src, f"_{nm}_consume", True, q_slots=True)
    load, _ = _protocol(src, f"_{nm}_load", True, q_slots=True)
    bad = []
    for trial in range(trials):
        NS = rng.choice((2, 3, 4))
        items = [(0, a, b, max(T, items_min)) for (_, a, b, T) in _items(rng, rng.randint(1, 6), 5)]
        it = lambda x, items=items: items[x]   # noqa: E731
        own = _own(rng, items)
        parts = {"consume0": con(0, it, NS, len(items), OWN=own), "consume1": con(1, it, NS, len(items), OWN=own),
                 "load": load(None, it, NS, len(items))}
        why = barrier_model.run(parts, trial, counts=COUNTS)
        if why is not None:
            bad.append(f"items {items}, {NS} stages: {why}")
    return con_text, bad


@pytest.mark.parametrize("masked", [False, True])
def test_persistent_kernel_frees_the_query_tile_after_its_last_score(masked):
    """The persistent kernel without ping-pong releases a warpgroup's query buffer right after
    the item's last score MMA (so that the next item's query copy overlaps this item's last
    tile): every run finishes, and no score MMA reads a query buffer the next item's copy
    already took."""
    gen = GluonGen(_fusion(masked), ws=True, persistent=True, own_range=masked)
    con_text, bad = _run_persistent(gen.module(), gen.name, random.Random(11 + masked), 200, items_min=masked)
    assert "if start + BLOCK_J >= end" in con_text and "('read', ('q', WG), item)" in con_text
    assert "('read', ('v', stage), t_i)" in con_text
    assert ("range(end_w, end, BLOCK_J)" in con_text) == masked   # (own_range: where a mask is)
    assert not bad, bad[:3]


def test_the_model_finds_a_query_tile_freed_too_early():
    """The check can fail: the release moved before the score MMA (the next item's query copy
    may land while this item's last score still reads the buffer)."""
    gen = GluonGen(_fusion(True), ws=True, persistent=True)
    src = gen.module()
    early = re.compile(r"(\n(\s*)(_dot_\d+ = warpgroup_mma\(q_smem, [^\n]*)\n\s*if start \+ BLOCK_J >= (end\w*):[^\n]*\n"
                       r"\s*mbarrier\.arrive\(q_free\.index\(WG\), count=1\))")
    assert early.search(src)
    wrong = early.sub(lambda m: f"\n{m.group(2)}if start + BLOCK_J >= {m.group(4)}:\n{m.group(2)}    "
                                f"mbarrier.arrive(q_free.index(WG), count=1)\n{m.group(2)}{m.group(3)}", src)
    _, bad = _run_persistent(wrong, gen.name, random.Random(5), 200)
    assert any("read slot ('q'" in b for b in bad), bad[:3]



def _per_program(gen, pid):
    """A partition's ops with its barriers and slots named apart from another program's."""
    for op in gen:
        if op[0] in ("wait", "arrive"):
            op = (op[0], f"{op[1]}@{pid}") + tuple(op[2:])
        elif op[0] == "tma":   # ('tma', bar, i[, slot, chunk])
            op = ("tma", f"{op[1]}@{pid}", op[2]) + (((op[3], pid), op[4]) if len(op) > 3 else ())
        elif op[0] == "read":
            op = ("read", (op[1], pid), op[2])
        yield op


def _run_dynamic(src, name, rng, trials, programs=2):
    nm = f"{name}_p"
    con, con_text = _protocol(src, f"_{nm}_consume", False, q_slots=True, dynamic=True)
    load, load_text = _protocol(src, f"_{nm}_load", False, q_slots=True, dynamic=True)
    bad = []
    for trial in range(trials):
        NS = rng.choice((2, 3, 4))
        items = _items(rng, rng.randint(1, 7), 5)
        it = lambda x, items=items: items[x]   # noqa: E731
        cnt, seen, parts, own = [0], [], {}, _own(rng, items)
        for p in range(programs):
            buf = [None]
            parts[f"c0@{p}"] = _per_program(con(0, it, NS, len(items), cnt, buf, seen, own), p)
            parts[f"c1@{p}"] = _per_program(con(1, it, NS, len(items), cnt, buf, seen, own), p)
            parts[f"ld@{p}"] = _per_program(load(None, it, NS, len(items), cnt, buf, seen), p)
        why = barrier_model.run(parts, trial, counts={k + f"@{p}": c for k, c in COUNTS.items()
                                                      for p in range(programs)})
        if why is None and sorted(seen) != sorted((w, x) for w in (0, 1) for x in range(len(items))):
            why = f"items folded {sorted(seen)}"
        if why is not None:
            bad.append(f"items {items}, {NS} stages: {why}")
    return con_text + load_text, bad


@pytest.mark.parametrize("masked", [False, True])
def test_dynamic_persistent_kernel_takes_each_item_once(masked):
    """dynamic=True: two programs take work items from one counter; every run finishes, each
    item is folded by both consumers of exactly one program, and no score MMA reads a query
    buffer the next item's copy took."""
    gen = GluonGen(_fusion(masked), ws=True, persistent=True, dynamic=True)
    text, bad = _run_dynamic(gen.module(), gen.name, random.Random(21 + masked), 150)
    assert "CNT[0] += 1" in text and "BUF[0] = item" in text and "item = BUF[0]" in text
    assert not bad, bad[:3]


def test_own_range_releases_the_tiles_it_does_not_read():
    """own_range (the persistent kernel, where a mask is): each consumer folds a run of the pair's
    key tiles (random here) and releases the others unread; every run finishes, each item is
    folded once, and no P @ V finds its value stage holding another tile."""
    gen = GluonGen(_fusion(True), ws=True, persistent=True, dynamic=True, own_range=True)
    src = gen.module()
    assert gen.own_range and "range(first_w, a_w, BLOCK_J)" in src and "released unread" in src
    text, bad = _run_dynamic(src, gen.name, random.Random(33), 200)
    assert "range(first, first_w, BLOCK_J)" in text and "range(end_w, end, BLOCK_J)" in text
    assert not bad, bad[:3]
    plain = GluonGen(_fusion(True), ws=True, persistent=True, dynamic=True)
    assert "first_w" not in plain.module() and not plain.own_range
    unmasked = GluonGen(_fusion(False), ws=True, persistent=True, dynamic=True, own_range=True)
    assert unmasked.module() == GluonGen(_fusion(False), ws=True, persistent=True, dynamic=True).module()
    assert not unmasked.own_range   # (no mask: every tile is the pair's; the source is the plain one)


def test_the_model_finds_a_tile_released_unread_too_early():
    """The check can fail: a consumer that releases the tiles it does not read without waiting
    for them to land reads a later tile of the same stage before it lands (the stage's barrier,
    two phases ahead of its last wait there, looks complete to it)."""
    gen = GluonGen(_fusion(True), ws=True, persistent=True, dynamic=True, own_range=True)
    src = gen.module()
    waits = ["            mbarrier.wait(k_bar.index(t_i % NS), (t_i // NS) & 1)\n",
             "            mbarrier.wait(v_bar.index(t_i % NS), (t_i // NS) & 1)\n"]
    assert all(src.count(w) == 2 for w in waits)
    for w in waits:
        src = src.replace(w, "")
    _, bad = _run_dynamic(src, gen.name, random.Random(34), 200)
    assert any("read slot ('v'" in b or "read slot (('v'" in b for b in bad), bad[:3]


def test_the_model_finds_an_item_published_too_early():
    """The check can fail: the item published before the consumers released the previous one's
    query buffers (a consumer may read the next item's number while still on this one)."""
    gen = GluonGen(_fusion(True), ws=True, persistent=True, dynamic=True)
    src = gen.module()
    pub = "        item_buf.index(0).store(gl.full([1], item, gl.int32, layout=SCAN_L))   # this item, for the consumers\n"
    assert pub in src
    head, ld = src.split(f"def _{gen.name}_p_load(")
    ld = ld.replace(pub, "").replace("    while item < n_items:\n", "    while item < n_items:\n" + pub, 1)
    wrong = head + f"def _{gen.name}_p_load(" + ld
    _, bad = _run_dynamic(wrong, gen.name, random.Random(4), 150)
    assert bad


STAGE_COUNTS = dict(COUNTS, turn=2)   # stage_store: turn[0] counts both consumers' last P @ V


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_stage_store_runs_to_the_end(masked, persistent):
    """stage_store (the output tiles through the last key tile's value buffer): each consumer
    keeps the item's last stage until both finished their last P @ V (turn[0], two arrivals an
    item) and it has stored its tile, then releases it; every run finishes, one-shot and
    persistent, items of random lengths."""
    gen = GluonGen(_fusion(masked), ws=True, persistent=persistent, dynamic=False, stage_store=True)
    src = gen.module()
    nm = f"{gen.name}_p" if persistent else gen.name
    con, con_text = _protocol(src, f"_{nm}_consume", persistent, q_slots=persistent)
    load, _ = _protocol(src, f"_{nm}_load", persistent, q_slots=persistent)
    assert "if start + BLOCK_J < end:" in con_text and "'turn', 0" in con_text
    rng = random.Random(5 + masked + 2 * persistent)
    for trial in range(150):
        NS = rng.choice((2, 3, 4))
        if persistent:
            items = [(0, a, b, max(T, 1)) for (_, a, b, T) in _items(rng, rng.randint(1, 6), 5)]
            it = lambda x, items=items: items[x]   # noqa: E731
            parts = {"consume0": con(0, it, NS, len(items)), "consume1": con(1, it, NS, len(items)),
                     "load": load(None, it, NS, len(items))}
        else:
            (first, a, b, end), = _items(rng, 1, 6)
            end = max(end, 1)
            items = [(first, a, b, end)]
            parts = {"consume0": con(0, None, NS, 1, first, a, b, end), "consume1": con(1, None, NS, 1, first, a, b, end),
                     "load": load(0, None, NS, 1, first, a, b, end)}
        why = barrier_model.run(parts, trial, counts=STAGE_COUNTS)
        assert why is None, f"items {items}, {NS} stages: {why}"


def test_the_model_finds_a_stage_store_that_never_releases_its_last_stage():
    """The model can fail here: without the release of the last tile's stage after the stores,
    the load partition of a program with more tiles than stages waits forever."""
    gen = GluonGen(_fusion(False), ws=True, persistent=True, stage_store=True)
    src = gen.module()
    rel = [ln for ln in src.split("\n") if "# the last tile's stage" in ln]
    assert len(rel) == 2   # (the one-shot kernel's and the persistent kernel's)
    for ln in rel:
        src = src.replace(ln + "\n", "")
    nm = f"{gen.name}_p"
    con, _ = _protocol(src, f"_{nm}_consume", True, q_slots=True)
    load, _ = _protocol(src, f"_{nm}_load", True, q_slots=True)
    items = [(0, 0, 3, 3), (0, 0, 3, 3)]
    it = lambda x: items[x]   # noqa: E731
    parts = {"consume0": con(0, it, 2, 2), "consume1": con(1, it, 2, 2), "load": load(None, it, 2, 2)}
    assert barrier_model.run(parts, 0, counts=STAGE_COUNTS).startswith("deadlock")
