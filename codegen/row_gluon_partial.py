"""Partial staging, the staged row kernel's form for rows longer than the ring (issue 15, "long
rows in one read"; codegen/row_gluon.py ``StagedGen`` with ``partial=True``): the launcher
(codegen/row_gluon_launch.py) takes it where a row of the staged inputs needs more slots than
sm_90's shared memory holds.

The ring's NBUF slots are cut in two: KEEP *kept* slots (slot c holds chunk c of the row, c <
KEEP, read by both passes, filled once per row) and RING *rotating* slots (KEEP + u % RING for the
program's u-th rotating fill) through which the row's other S = NC - KEEP chunks stream twice:
once for pass 1's fold (each released as soon as it is folded), once more, copied again in the
same order, for pass 2's outputs. A row is then (2 - KEEP / NC) reads and one write instead of
two reads and one write.

Order, so that HBM stays busy: pass 2 writes the kept chunks' outputs first and releases their
slots; the copy warp puts the next row's kept chunks into them once it has issued this row's
first RING pass-2 fills (those need no release from pass 2: pass 1 freed their slots; RING < S,
since KEEP + RING < NC),
then the rest of the pass-2 fills, each once pass 2 released the rotating slot it needs.
Per row k, the copy warp's fills are: (row 0 only) its kept chunks; the S pass-1 fills; the
first RING pass-2 fills; row k + 1's kept chunks (each after pass 2 of row k released
its slot); the remaining pass-2 fills. The rotating fills u of row k are k * 2S .. k * 2S + 2S - 1
(the first S pass 1's), fill u waits for the release of fill u - RING of its slot.

No deadlock: a kept slot's release (pass 2 of row k, its first KEEP chunks) needs only pass 1
of row k, whose fills the copy warp issued before it waits on a kept slot; a rotating fill
waits for the release of the fill RING before it, which the compute warps reach without waiting
for any later fill. One row in flight (one compute group): the kept slots belong to one row, so
``rows_in_flight=2`` runs this form with its warps in one group. tests/test_row_gluon_protocol.py
runs the protocol under random interleavings; tests/test_row_gluon.py emulates the slots on the
CPU (``emulate``: each chunk copied into a slot of a global scratch ring at the compute warps'
wait and read back from it) against float64.

Text in, text out: Triton-flavoured lines the caller passes through ``_gluonize``.
"""
from __future__ import annotations

from acefuse.codegen.row_gluon_parts import one_group, ring_inputs

# rotating slots: this many bytes of the staged inputs in flight (12 slots of 8 KB). On an H200
# (session 18, softmax 256x262144): 8 slots 47.5% of copy, 4 slots 47.7%, 12 slots 56.1%
PARTIAL_RING_BYTES = 98304


def ring_split(nbuf: int, per_slot: int, ring=None):
    """(KEEP, RING) of a ring of ``nbuf`` slots of ``per_slot`` bytes: RING rotating slots
    (``ring``, or PARTIAL_RING_BYTES of slots, at least 2 and at most half the ring), the rest
    kept; None where no slot would be kept or none rotate."""
    r = ring if ring is not None else max(2, min(nbuf // 2, PARTIAL_RING_BYTES // per_slot))
    if r < 1 or nbuf - r < 1:
        return None
    return nbuf - r, r


def emulated_fill(gen, ind):
    """The emulation's stand-in for a TMA copy landing: chunk z_c of the row (masked past it)
    into slot z_slot of this program's scratch ring (``ring_<input>``, as many slots as the
    kernel's)."""
    L = [f"{ind}z_ecols = (z_c * (CR * CW) + z_sub * CW)[:, None] + z_lane[None, :]"]
    for t in gen.staged:
        L.append(f"{ind}tl.store(ring_{t}_ptr + z_rb + z_slot * (CR * CW) + z_sub[:, None] * CW + z_lane[None, :], "
                 f"tl.load({t}_ptr + off_{t} + z_ecols * s_{t}_{gen.axis}, mask=z_ecols < n_j, other=0.0))")
    return L


def slot_load(name):
    """The emulation's read of a staged input's chunk from its scratch slot."""
    return f"tl.load(ring_{name}_ptr + z_rb + z_slot * (CR * CW) + z_sub[:, None] * CW + z_lane[None, :]).to(tl.float32)"


def pass1_wait(gen, L, ind, first):
    """Pass 1's wait for chunk z_c of row z_k: a kept chunk (z_c < KEEP) in slot z_c, its fill
    once per row (parity z_k & 1); a streamed one in rotating slot KEEP + z_u % RING."""
    if first:   # chunk 0: always kept (KEEP >= 1)
        L.append(f"{ind}z_slot = 0")
        L.extend(emulated_fill(gen, ind) if gen.emulate else [f"{ind}mbarrier.wait(full.index(z_slot), z_k & 1)"])
        return
    L.append(f"{ind}z_u = z_u0 + z_c - KEEP   # (a streamed chunk's fill of the rotating slots)")
    L.append(f"{ind}if z_c < KEEP:   # a kept chunk: its own slot, filled once per row")
    L.append(f"{ind}    z_slot = z_c")
    L.append(f"{ind}    z_par = z_k & 1")
    L.append(f"{ind}else:   # a streamed chunk: a rotating slot")
    L.append(f"{ind}    z_slot = KEEP + z_u % RING")
    L.append(f"{ind}    z_par = (z_u // RING) & 1")
    L.extend(emulated_fill(gen, ind) if gen.emulate else [f"{ind}mbarrier.wait(full.index(z_slot), z_par)"])


def pass1_release(gen, L, ind):
    """A streamed chunk, folded: its rotating slot back to the copy warp (pass 2 reads it again
    from a later fill)."""
    if gen.emulate:
        return
    L.append(f"{ind}if z_c >= KEEP:   # a streamed chunk, folded: its slot back to the copy warp")
    L.append(f"{ind}    _sync()   # every compute warp has read the slot")
    L.append(f"{ind}    mbarrier.arrive(empty.index(z_slot), count=1)")


def pass2_slot(gen, B, ind):
    """Pass 2's slot of chunk z_c: a kept chunk still in its slot from pass 1; a streamed one
    copied again, the row's S pass-1 fills after the first of its rotating fills."""
    B.append(f"{ind}z_u = z_u0 + (NC - KEEP) + z_c - KEEP   # (a streamed chunk's second fill)")
    B.append(f"{ind}if z_c < KEEP:   # a kept chunk: still in its slot since pass 1")
    B.append(f"{ind}    z_slot = z_c")
    B.append(f"{ind}else:   # a streamed chunk: copied again into a rotating slot")
    B.append(f"{ind}    z_slot = KEEP + z_u % RING")
    if gen.emulate:
        B.extend(emulated_fill(gen, ind + "    "))
    else:
        B.append(f"{ind}    mbarrier.wait(full.index(z_slot), (z_u // RING) & 1)")


def copy_partition(gen, descs: str, slots: str) -> str:
    """The copy warp of the partial form (the module docstring has its order)."""
    nbytes = " + ".join(f"{t}_desc.block_type.nbytes" for t in gen.staged)

    def fill(ind, bar, row0):
        out = [f"{ind}mbarrier.expect(full.index({bar}), {nbytes})"]
        out += [f"{ind}_tma_load({t}_desc, [{row0} + c * CR, 0], full.index({bar}), slots_{t}.index({bar}))"
                for t in gen.staged]
        return out
    C = ["@gluon.jit",
         f"def _{gen.name}_copy({descs}, full, empty, {slots}, n_rows, NC: gl.constexpr, KEEP: gl.constexpr, "
         "RING: gl.constexpr, NSUB, CR: gl.constexpr):",
         "    # the copy warp: per row its first KEEP chunks into the kept slots 0..KEEP-1, its other",
         "    # S = NC - KEEP chunks twice through the RING rotating slots (pass 1's fold, pass 2's outputs)",
         "    z_pid = gl.program_id(0)",
         "    P = gl.num_programs(0)",
         "    mine = (n_rows - z_pid + P - 1) // P",
         "    S = NC - KEEP",
         "    lead = S + RING - 1   # the last pass-2 fill before the next row's kept chunks (RING < S)",
         "    for k in range(0, mine):",
         "        z_row0 = (z_pid + k * P) * NSUB   # (n_rows * NSUB < 2**31: the launcher checks)",
         "        if k == 0:   # the first row's kept chunks (a later row's: during pass 2 of the row before)",
         "            for c in range(0, KEEP):"]
    C += fill("                ", "c", "z_row0")
    C += ["        for j in range(0, 2 * S):   # the S streamed chunks, for pass 1 then for pass 2",
          "            c = KEEP + j % S",
          "            u = k * (2 * S) + j",
          "            s = KEEP + u % RING",
          "            if u >= RING:   # the rotating slot's fill RING before, released",
          "                mbarrier.wait(empty.index(s), ((u // RING) - 1) & 1)"]
    C += fill("            ", "s", "z_row0")
    C += ["            if j == lead and k + 1 < mine:   # the next row's kept chunks, as pass 2 releases them",
          "                for c in range(0, KEEP):",
          "                    mbarrier.wait(empty.index(c), k & 1)"]
    C += fill("                    ", "c", "z_row0 + P * NSUB")
    return "\n".join(C)


def partial_kernel(gen, sig: str, slots: str, descs: str, dts: str):
    """The kernel of the partial form: as the fully staged one with one compute group
    (codegen/row_gluon_parts.py ``staged_kernel``), its ring KEEP + RING slots."""
    K = ["@gluon.jit",
         f"def {gen.name}_staged({sig}, NSUB, NC: gl.constexpr, NBUF: gl.constexpr, KEEP: gl.constexpr, "
         f"RING: gl.constexpr, CR: gl.constexpr, CW: gl.constexpr, EVEN: gl.constexpr, {dts}, num_warps: gl.constexpr):",
         "    # a persistent program per SM; each row's first KEEP chunks read once, the others twice",
         "    # (NBUF = KEEP + RING slots)"]
    K += ring_inputs(gen)
    K += one_group(f"_{gen.name}_compute, ({sig}, full, empty, {slots}, NC, NBUF, KEEP, RING, CR, CW, EVEN, num_warps)",
                   f"_{gen.name}_copy, ({descs}, full, empty, {slots}, n_rows, NC, KEEP, RING, NSUB, CR)")
    return K


__all__ = ["PARTIAL_RING_BYTES", "copy_partition", "partial_kernel", "ring_split"]
