"""The barrier protocol of the row family's staged Gluon kernel (codegen/row_gluon.py), with one
compute group and with two (``rows_in_flight=2``: rows of the program to groups k % 2, one copy
warp and one ring), run on the CPU: the generated partitions cut down to their control flow,
their integer bookkeeping (rows, chunks, slots, phase bits) and their barrier operations and
slot reads, run as Python generators under a random interleaving; TMA copies land at random
later steps. mbarrier semantics as on sm_90 (tests/test_gluon_pingpong_protocol.py's model): a
wait for parity p passes while the number of completed phases has the other parity. Besides
finishing, every read of a slot must find the chunk it expects there (landed, not overwritten),
and every chunk of the program's rows must be read (odd row counts, one row, tails).

    python -m pytest -q tests/test_row_gluon_protocol.py -p no:cacheprovider
"""
import random
import re

import pytest

import acefuse as af
from acefuse.codegen import row_gluon as rg

from tests import barrier_model

x = af.tensor("x", "r j")
_F = af.fuse(af.program("rp_softmax", y=af.exp(x - af.max(x, "j")) / af.sum(af.exp(x - af.max(x, "j")), "j")))

KEEP = re.compile(r"(for (z_k|z_c|t) in |if (z_qok|t >= NBUF):|else:|mbarrier\.(wait|arrive)\(|_tma_load\(|"
                  r"(z_pid|z_P|P|z_mine|z_ph|z_one|z_base|z_c|z_slot|z_t|total|s|k|c|f) = |_ld_\w+ = slots_)")


def _protocol(src, fn):
    """The generator function of partition ``fn`` of the generated source (tests/barrier_model.py)."""
    ifs = set()

    def translate(body, ind):
        if "compute" in fn and re.match(r"(s|k|c|f) = ", body):
            return None   # (the copy warp's names; in the compute partition, a program's states)
        if body == "else:" and len(ind) not in ifs:
            return None   # (an if EVEN's else: its if is not kept)
        if body.startswith("if "):
            ifs.add(len(ind))
        body = (re.sub(r"\.to\(g?l?t?l?\.int(32|64)\)", "", body).replace("gl.program_id(0)", "PID")
                .replace("gl.num_programs(0)", "NPROG").replace("if z_qok:", "if QOK:"))
        m = re.match(r"_tma_load\(\w+, \[.*?\], (\w+)\.index\((\w+)\), \w+\.index\((\w+)\)\)$", body)
        if m:
            body = f"yield ('tma', '{m.group(1)}', {m.group(2)}, {m.group(3)}, t)"
        m = re.match(r"_ld_\w+ = slots_\w+\.index\((\w+)\)\.load", body)
        if m:
            body = f"yield ('read', {m.group(1)}, z_base + z_c)"
        return [body]
    return barrier_model.partition(src, fn, KEEP, ["def part(G, PID, NPROG, n_rows, NC, NBUF, QOK):"], translate)


def _parts(src, rif):
    nm = _F.program.name
    con, con_text = _protocol(src, f"_{nm}_compute")
    copy, copy_text = _protocol(src, f"_{nm}_copy")
    return con, copy, con_text + "\n" + copy_text


def _trial(con, copy, rif, rng, seed):
    NPROG = rng.randint(1, 3)
    PID = rng.randrange(NPROG)
    n_rows = rng.randint(1, 9)
    NC = rng.randint(1, 5)
    NBUF = rng.randint(NC, NC + 5)
    QOK = rng.random() < 0.5
    mine = (n_rows - PID + NPROG - 1) // NPROG
    parts = {f"group{g}": con(g, PID, NPROG, n_rows, NC, NBUF, QOK) for g in range(rif)}
    parts["copy"] = copy(None, PID, NPROG, n_rows, NC, NBUF, QOK)
    return barrier_model.run(parts, seed, total=mine * NC), (n_rows, NPROG, PID, NC, NBUF, QOK)


@pytest.mark.parametrize("rif", [1, 2])
def test_staged_protocol_runs_to_the_end_and_reads_every_chunk(rif):
    """Random row counts (odd, one, fewer than the programs), chunks per row, ring sizes from
    one row up, both of pass 2's loops (qfast's): every run finishes, every read finds its chunk.
    rif=1 is the kernel that ran on the H200 (the model's own check)."""
    src = rg.staged_source(_F, rows_in_flight=rif)
    con, copy, text = _parts(src, rif)
    assert ("G * NBUF + z_slot" in text) == (rif == 2) and "('read'" in text and "('tma'" in text
    rng = random.Random(11 + rif)
    for trial in range(300):
        why, case = _trial(con, copy, rif, rng, trial)
        assert why is None, f"(n_rows, programs, pid, NC, NBUF, qok) {case}: {why}"


def test_the_model_finds_a_deadlock():
    """The model can fail: a copy warp that signals row k's chunks to the other group
    ((k + 1) % 2, a disagreement on which group owns a row) hangs both groups."""
    src = rg.staged_source(_F, rows_in_flight=2)
    bad = src.replace("f = (k % 2) * NBUF + s", "f = ((k + 1) % 2) * NBUF + s")
    assert bad != src
    con, copy, _ = _parts(bad, 2)
    rng, found = random.Random(5), []
    for trial in range(40):
        why, case = _trial(con, copy, 2, rng, trial)
        found.append(why or "")
    assert any(w.startswith("deadlock") for w in found)


def test_shared_full_barriers_alias_between_the_groups():
    """Why each group has its own full barriers: with one full barrier per slot, waited with
    the single-group parity of the chunk ((t // NBUF) & 1), a group waiting for a chunk of its
    row can pass on the other group's earlier fill of the slot (two phases behind looks done),
    in some interleavings: a read of the wrong chunk or a hang."""
    src = rg.staged_source(_F, rows_in_flight=2)
    bad = (src.replace("full.index(G * NBUF + z_slot), ((z_ph >> z_slot) & 1).to(gl.int32))",
                       "full.index(z_slot), ((z_base + z_c) // NBUF) & 1)")
           .replace("f = (k % 2) * NBUF + s", "f = s"))
    assert bad.count("full.index(z_slot), ((z_base + z_c) // NBUF) & 1)") == 2
    con, copy, _ = _parts(bad, 2)
    rng, bad_runs = random.Random(2), 0
    for trial in range(300):
        why, case = _trial(con, copy, 2, rng, trial)
        bad_runs += why is not None
    assert 0 < bad_runs < 300


# ---- partial staging (codegen/row_gluon_partial.py): rows longer than the ring ---------------
_PKEEP = {"compute": re.compile(r"(for (z_k|z_c) in |if (z_qok|z_c < KEEP|z_c >=? KEEP|EVEN):|else:|"
                                r"mbarrier\.(wait|arrive)\(|(z_pid|z_P|z_mine|z_u0|z_u|z_c|z_slot|z_par) = |"
                                r"_ld_\w+ = slots_)"),
          "copy": re.compile(r"(for (k|c|j) in |if (k == 0|u >= RING|j == lead and k \+ 1 < mine):|"
                             r"mbarrier\.(wait|arrive)\(|_tma_load\(|(z_pid|P|mine|S|lead|z_row0|c|u|s) = )")}


def _partial_protocol(src, fn):
    """The generator function of partition ``fn`` of the partial form's source: a TMA copy names
    its chunk by its coordinate (sub-rows of one chunk, CR = 1, NSUB = NC), turned into the
    program's chunk number; a read names row z_k's chunk z_c."""
    kind = "compute" if "compute" in fn else "copy"
    last_if = {}

    def translate(body, ind):
        if body.startswith("if "):
            last_if[len(ind)] = body != "if EVEN:"   # (an if EVEN and its else: not kept)
            if body == "if EVEN:":
                return None
        elif body == "else:":
            return [body] if last_if.get(len(ind)) else None
        body = (re.sub(r"\.to\(g?l?t?l?\.int(32|64)\)", "", body).replace("gl.program_id(0)", "PID")
                .replace("gl.num_programs(0)", "NPROG").replace("if z_qok:", "if QOK:"))
        m = re.match(r"_tma_load\(\w+, \[(.*?), 0\], (\w+)\.index\((\w+)\), \w+\.index\((\w+)\)\)$", body)
        if m:
            body = f"yield ('tma', '{m.group(2)}', {m.group(3)}, {m.group(4)}, _local({m.group(1)}))"
        m = re.match(r"_ld_\w+ = slots_\w+\.index\((\w+)\)\.load", body)
        if m:
            body = f"yield ('read', {m.group(1)}, z_k * NC + z_c)"
        return [body]
    head = ["def part(G, PID, NPROG, n_rows, NC, KEEP, RING, QOK):", "    CR, NSUB = 1, NC",
            "    def _local(g):   # a global sub-row (CR = 1) -> this program's chunk number",
            "        return ((g // NC) - PID) // NPROG * NC + g % NC"]
    return barrier_model.partition(src, fn, _PKEEP[kind], head, translate)


def _partial_parts(src):
    nm = _F.program.name
    con, con_text = _partial_protocol(src, f"_{nm}_compute")
    copy, copy_text = _partial_protocol(src, f"_{nm}_copy")
    return con, copy, con_text + "\n" + copy_text


def _partial_trial(con, copy, rng, seed):
    NPROG = rng.randint(1, 3)
    PID = rng.randrange(NPROG)
    n_rows = rng.randint(1, 8)
    NC = rng.randint(3, 8)
    KEEP = rng.randint(1, NC - 2)
    RING = rng.randint(1, NC - 1 - KEEP)   # (the launcher's: KEEP + RING slots, fewer than NC)
    QOK = rng.random() < 0.5
    mine = (n_rows - PID + NPROG - 1) // NPROG
    parts = {"compute": con(None, PID, NPROG, n_rows, NC, KEEP, RING, QOK),
             "copy": copy(None, PID, NPROG, n_rows, NC, KEEP, RING, QOK)}
    return barrier_model.run(parts, seed, total=mine * NC), (n_rows, NPROG, PID, NC, KEEP, RING, QOK)


def test_partial_protocol_runs_to_the_end_and_reads_every_chunk():
    """Partial staging: rows of more chunks than slots (KEEP kept, RING rotating, KEEP + RING <
    NC), several rows per program, one, none; every run finishes and every read (pass 1's
    and pass 2's, kept and streamed) finds its chunk in its slot."""
    src = rg.staged_source(_F, partial=True)
    con, copy, text = _partial_parts(src)
    assert "('read'" in text and "_local(z_row0 + P * NSUB + c * CR)" in text and "if z_c < KEEP:" in text
    rng = random.Random(17)
    for trial in range(400):
        why, case = _partial_trial(con, copy, rng, trial)
        assert why is None, f"(n_rows, programs, pid, NC, KEEP, RING, qok) {case}: {why}"


@pytest.mark.parametrize("broken,old,new", [
    # the next row's kept chunks copied without waiting for pass 2 to release their slots
    ("kept slot not released", "                    mbarrier.wait(empty.index(c), k & 1)\n", ""),
    # a rotating fill waits for the release one fill too late (a slot released one chunk early
    # looks like the release it needs)
    ("rotating slot one release early", "mbarrier.wait(empty.index(s), ((u // RING) - 1) & 1)",
     "mbarrier.wait(empty.index(s), (u // RING) & 1)"),
    # pass 2 reads a streamed chunk without waiting for its second copy
    ("pass 2 without its wait", "\n                    mbarrier.wait(full.index(z_slot), (z_u // RING) & 1)", ""),
    # pass 1 keeps its first streamed chunk's slot (no release): the copy warp waits forever
    ("pass 1 without a release", "if z_c >= KEEP:   # a streamed chunk", "if z_c > KEEP:   # a streamed chunk"),
])
def test_partial_protocol_check_finds_broken_variants(broken, old, new):
    """The model can fail on the partial form: each deliberately wrong variant (a missing wait,
    a wait on the wrong phase, a missing release) is caught in some runs."""
    src = rg.staged_source(_F, partial=True)
    bad = src.replace(old, new)
    assert bad != src, broken
    con, copy, _ = _partial_parts(bad)
    rng, found = random.Random(3), []
    for trial in range(200):
        found.append(_partial_trial(con, copy, rng, trial)[0])
    assert any(found), broken
