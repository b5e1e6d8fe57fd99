"""The staged row kernel's copy partition and kernel (codegen/row_gluon.py ``StagedGen.kernel``
writes the compute partition, from the derived expressions, and calls these for the rest): the
copy warp's TMA loop over the ring, and the persistent kernel that makes the descriptors, the
ring and its barriers and forks the partitions, with one compute group or two
(``rows_in_flight=2``). The text is Triton-flavoured (``tl.`` where it has any); the caller passes
it through ``_gluonize``."""
from __future__ import annotations


def copy_partition(gen, two: bool, descs: str, slots: str) -> str:
    """The copy warp: chunk t of the program's rows into slot t % NBUF once the compute warps
    released the chunk that slot held; with two groups, signalled on the full barrier of row
    k's group (k % 2)."""
    nbytes = " + ".join(f"{t}_desc.block_type.nbytes" for t in gen.staged)
    C = ["@gluon.jit",
         f"def _{gen.name}_copy({descs}, full, empty, {slots}, n_rows, NC: gl.constexpr, NBUF: gl.constexpr, "
         "NSUB, CR: gl.constexpr):",
         "    # the copy warp: chunk t of this program's rows into z_slot t % NBUF, once the compute",
         "    # warps released the chunk that z_slot held (its pass 2 is done)",
         "    z_pid = gl.program_id(0)",
         "    P = gl.num_programs(0)",
         "    total = ((n_rows - z_pid + P - 1) // P) * NC",
         "    for t in range(0, total):",
         "        s = t % NBUF",
         "        if t >= NBUF:",
         "            mbarrier.wait(empty.index(s), ((t // NBUF) - 1) & 1)",
         "        k = t // NC",
         "        c = t - k * NC",
         "        z_row0 = (z_pid + k * P) * NSUB + c * CR   # (n_rows * NSUB < 2**31: the launcher checks)",
         f"        mbarrier.expect(full.index(s), {nbytes})"]
    if two:   # the full barrier of the group of row k (k % 2)
        C[-1] = "        f = (k % 2) * NBUF + s   # the full barrier of slot s of row k's group (k % 2)"
        C.append(f"        mbarrier.expect(full.index(f), {nbytes})")
    for t in gen.staged:
        C.append(f"        _tma_load({t}_desc, [z_row0, 0], full.index({'f' if two else 's'}), slots_{t}.index(s))")
    return "\n".join(C)


def ring_inputs(gen) -> list:
    """Each staged input's shared layout, its descriptor over the rows as sub-rows of CW, and
    its NBUF ring slots (the kernel's text)."""
    K = []
    for t in gen.staged:
        K.append(f"    SL_{t}: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CR, CW], DT_{t})")
        K.append(f"    {t}_desc = tma.make_tensor_descriptor({t}_ptr, shape=[n_rows * NSUB, CW], strides=[CW, 1], "
                 f"block_shape=[CR, CW], layout=SL_{t})")
        K.append(f"    slots_{t} = gl.allocate_shared_memory(DT_{t}, [NBUF, CR, CW], SL_{t})")
    return K


def one_group(compute: str, copy: str) -> list:
    """One compute group's kernel end: a full and an empty barrier per slot, the fork into the
    compute partition and the copy warp (``compute``, ``copy``: each function and its
    arguments), and the barriers' invalidation."""
    return ["    full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())",
            "    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())",
            "    for i in gl.static_range(NBUF):",
            "        mbarrier.init(full.index(i), count=1)",
            "        mbarrier.init(empty.index(i), count=1)",
            "    fence_async_shared()",
            "    gl.warp_specialize([",
            f"        ({compute}),",
            f"        ({copy}),",
            "    ], [1], [24])",
            "    for i in gl.static_range(NBUF):",
            "        mbarrier.invalidate(full.index(i))",
            "        mbarrier.invalidate(empty.index(i))"]


def staged_kernel(gen, two: bool, sig: str, slots: str, descs: str, dts: str, outs: str):
    """(the kernel's text, the two groups' compute wrappers or none): a persistent program per
    SM; descriptors over each staged input's rows as sub-rows of CW, the ring of NBUF slots, a
    full and an empty barrier per slot (two groups: a full barrier per slot and group), the fork
    into the compute partition(s) and the copy warp."""
    K = ["@gluon.jit",
         f"def {gen.name}_staged({sig}, NSUB, NC: gl.constexpr, NBUF: gl.constexpr, CR: gl.constexpr, "
         f"CW: gl.constexpr, EVEN: gl.constexpr, {dts}, {'REGS: gl.constexpr, ' if two else ''}"
         "num_warps: gl.constexpr):",
         "    # a persistent program per SM; each row of the staged inputs is read once, through the ring"]
    if two:
        K[-1] += " (two compute groups of num_warps warps each)"
    K += ring_inputs(gen)
    for o in gen.elem_out if gen.tma_store else ():
        K.append(f"    SLO_{o}: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CR, CW], DT_O_{o})")
        K.append(f"    {o}_odesc = tma.make_tensor_descriptor({o}_ptr, shape=[n_rows * NSUB, CW], strides=[CW, 1], "
                 f"block_shape=[CR, CW], layout=SLO_{o})")
        K.append(f"    obuf_{o} = gl.allocate_shared_memory(DT_O_{o}, [2, CR, CW], SLO_{o})")
    if not two:
        K += one_group(f"_{gen.name}_compute, ({sig}, full, empty, {slots}, {outs}NC, NBUF, CR, CW, EVEN, num_warps)",
                       f"_{gen.name}_copy, ({descs}, full, empty, {slots}, n_rows, NC, NBUF, NSUB, CR)")
        return K, []
    K += ["    # a full barrier per slot and group (G * NBUF + slot), an empty barrier per slot",
          "    full = gl.allocate_shared_memory(gl.int64, [2 * NBUF, 1], mbarrier.MBarrierLayout())",
          "    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())",
          "    for i in gl.static_range(NBUF):",
          "        mbarrier.init(full.index(i), count=1)",
          "        mbarrier.init(full.index(NBUF + i), count=1)",
          "        mbarrier.init(empty.index(i), count=1)",
          "    fence_async_shared()",
          "    gl.warp_specialize([",
          f"        (_{gen.name}_compute0, ({sig}, full, empty, {slots}, NC, NBUF, CR, CW, EVEN, num_warps)),",
          f"        (_{gen.name}_compute1, ({sig}, full, empty, {slots}, NC, NBUF, CR, CW, EVEN, num_warps)),",
          f"        (_{gen.name}_copy, ({descs}, full, empty, {slots}, n_rows, NC, NBUF, NSUB, CR)),",
          "    ], [num_warps, 1], [REGS, 24])",
          "    for i in gl.static_range(NBUF):",
          "        mbarrier.invalidate(full.index(i))",
          "        mbarrier.invalidate(full.index(NBUF + i))",
          "        mbarrier.invalidate(empty.index(i))"]
    wrappers = []
    for w in (0, 1):   # the two groups: the compute partition with its group as a constexpr
        wrappers.append("\n".join([
            "@gluon.jit",
            f"def _{gen.name}_compute{w}({sig}, full, empty, {slots}, NC: gl.constexpr, NBUF: gl.constexpr, "
            "CR: gl.constexpr, CW: gl.constexpr, EVEN: gl.constexpr, NW: gl.constexpr):",
            f"    _{gen.name}_compute({w}, {sig}, full, empty, {slots}, NC, NBUF, CR, CW, EVEN, NW)"]))
    return K, wrappers
