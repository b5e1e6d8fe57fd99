"""A CPU model of the Gluon kernels' barrier protocols, shared by tests/test_gluon_pingpong_protocol.py
(the contraction family's warp-specialised kernels) and tests/test_row_gluon_protocol.py (the row
family's staged kernel): a partition of the generated source, cut down to its control flow, its
integer bookkeeping and its barrier operations (as yields), runs as a Python generator; ``run``
interleaves the partitions at random, with TMA copies landing at random later steps.

mbarrier semantics as on sm_90: a phase completes after ``count`` arrivals, and a wait for
parity p passes while the number of completed phases has the other parity (so a barrier two
phases ahead of a waiter looks not-yet-complete to it).
"""
import random
import re

_WAIT = re.compile(r"mbarrier\.wait\((\w+)\.index\((.*?)\), (.*)\)$")
_ARRIVE = re.compile(r"mbarrier\.arrive\((\w+)\.index\((.*?)\), count=1\)$")


def partition(src, fn, keep, header, translate):
    """The generator function of partition ``fn`` of the generated source ``src`` and its text:
    ``header`` (the function's first lines), then each line matching ``keep`` with its trailing
    comment dropped, passed through ``translate(body, indent)`` (the family's own forms: its TMA
    copy and reads as yields, names bound by the test; a list of lines, or None to leave the line
    out), then the barrier waits and arrivals as ``('wait', bar, index, parity)`` and
    ``('arrive', bar, index)`` yields. A block the cut leaves empty gets a ``pass``."""
    text = src.split(f"def {fn}(")[1].split("\n@gluon.jit")[0]
    out = list(header)
    for ln in text.split("\n")[1:]:
        body = ln.strip()
        if not body or body.startswith("#") or not keep.match(body):
            continue
        ind = ln[:len(ln) - len(ln.lstrip())]
        for b in translate(body.split("  #")[0].rstrip(), ind) or ():
            m = _WAIT.match(b)
            if m:
                b = f"yield ('wait', '{m.group(1)}', {m.group(2)}, {m.group(3)})"
            m = _ARRIVE.match(b)
            if m:
                b = f"yield ('arrive', '{m.group(1)}', {m.group(2)})"
            assert "gl." not in b and "tl." not in b and "mbarrier." not in b and "_tma" not in b, b
            out.append(ind + b)
    fixed = []
    for n, ln in enumerate(out):
        fixed.append(ln)
        if ln.rstrip().endswith(":"):
            ind = len(ln) - len(ln.lstrip())
            nxt = out[n + 1] if n + 1 < len(out) else ""
            if len(nxt) - len(nxt.lstrip()) <= ind:
                fixed.append(" " * (ind + 4) + "pass")
    ns = {}
    exec("\n".join(fixed), ns)   # noqa: S102 - the project's own generated source, cut down
    return ns["part"], "\n".join(fixed)


def run(parts, seed, counts=None, total=None, limit=400000):
    """Interleave the partitions (generators) at random; TMA copies land at random later steps.
    Ops: ('wait', bar, i, parity), ('arrive', bar, i), ('tma', bar, i[, slot, chunk]) (with a
    slot: the chunk is in flight there until it lands), ('read', slot, chunk) (must find that
    chunk landed there). ``counts``: arrivals per phase by barrier name (default 1). ``total``:
    chunks 0..total-1 must all be read. None when all of that holds and every partition
    finished; else why not."""
    rng = random.Random(seed)
    counts = counts or {}
    bars, content, tma, seen = {}, {}, [], set()

    def arrive(b, i):
        st = bars.setdefault((b, i), [0, 0])   # arrivals, completed phases
        st[0] += 1
        if st[0] == counts.get(b, 1):
            st[0], st[1] = 0, st[1] + 1
    cur = {n: next(g, None) for n, g in parts.items()}
    for _ in range(limit):
        ready = [n for n, op in cur.items() if op is not None
                 and not (op[0] == "wait" and bars.get((op[1], op[2]), [0, 0])[1] % 2 == op[3] % 2)]
        if not ready and not tma:
            live = {n: op for n, op in cur.items() if op is not None}
            if live:
                return f"deadlock: {live}, barriers {[(k, v) for k, v in bars.items() if v != [0, 0]]}"
            missing = set(range(total)) - seen if total is not None else ()
            return f"chunks never read: {sorted(missing)}" if missing else None
        if tma and (not ready or rng.random() < 0.3):
            b, i, *landed = tma.pop(rng.randrange(len(tma)))
            if landed:
                content[landed[0]] = landed[1]
            arrive(b, i)
            continue
        n = rng.choice(ready)
        op = cur[n]
        if op[0] == "arrive":
            arrive(op[1], op[2])
        elif op[0] == "tma":
            if len(op) > 3:
                content[op[3]] = ("in flight", op[4])
            tma.append(op[1:])
        elif op[0] == "read":
            if content.get(op[1]) != op[2]:
                return f"{n} read slot {op[1]} for chunk {op[2]} and found {content.get(op[1])}"
            seen.add(op[2])
        cur[n] = next(parts[n], None)
    return "no end within the step limit"
