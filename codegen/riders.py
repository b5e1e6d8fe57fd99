"""Riders: sums over rows computed in the pass of another stage.

A backward program often has two stages that read the same tensors: one fused over the
feature axis ``j`` (a layernorm's ``grad_x``: per-row sums over ``j``, then an elementwise
epilogue), and one whose outputs are sums over every row of a body elementwise over
``(rows, j)`` (``grad_w = sum_r(grad_y * xhat)``, ``grad_b = sum_r(grad_y)``). Run apart,
the second stage reads ``x`` and ``grad_y`` again. When a row fits one tile, the first
stage's kernel holds the body's operands in registers anyway: its persistent variant
(``RowGen.kernel_riders``) adds each body over the rows it visits into a per-program
partial row, and the caller folds the partials with the sum's merge (``s_AB = s_A + s_B``,
the rule ``sum-split``; the same fold the split schedule and the cross-GPU merge use).

Nothing here names a workload: a stage qualifies by its form alone (every output a sum
over exactly the other stage's row axes of a reduction-free body over that stage's
tensors, laid out over its fused axis). The second stage stays compiled: it runs when the
first stage's kernel takes another schedule (rows longer than one tile) or a launch option
excludes the persistent kernel.

The sum family (codegen/sums.py) has the same situation with the roles of the axes swapped:
stage A sums over ``i`` with programs over tiles of ``j`` (a derived attention backward's
dK = sum_i(dS * q), dV = sum_i(P * dO)), stage B sums over ``j`` with rows ``i``
(dQ = sum_j(dS * k)), and each recomputes the same (i, j) tiles (S, P, dP, dS). When B's
loop axis is A's only row axis, B's outputs range over A's loop axis and grid axes, and
B's body is, per tile, a value A's pass already has times at most one row vector A holds,
A's kernel computes B's contribution per tile (``tl.dot(tl.trans(tile), vector)``, or
``tl.sum(tile, axis=0)`` for a plain sum) and adds it into a float32 buffer with
``tl.atomic_add`` (masked on partial tiles and rows); B's constant factor and dtype cast
apply once after (``finish``). The values are B's certified sums, reassociated over tiles
and programs (``sum-split``: s_AB = s_A + s_B), so B's certificate covers them; the float32
adds land in an order the hardware picks (results may differ in the last bits run to run).
B stays compiled and runs itself whenever the host runs without riders (a schedule option).
"""
from __future__ import annotations


def rider_bodies(first, fusion, second) -> dict | None:
    """{output of ``second``: body} when every output of program ``second`` is a sum over
    exactly the row axes of ``fusion`` (the first stage's, fused over ``fusion.axis``) of a
    body without reductions that reads only tensors of ``first`` with the same axes; else
    None."""
    from acefuse.rewrite.encode import RED_OPS
    j = fusion.axis
    rows = sorted(a for a in first.axes if a != j)
    if not rows or not second.outputs:
        return None
    out = {}
    for name, e in second.outputs.items():
        t, reduced = e.term, []
        while t.op == "Sum" and t.args[0].op == "Ax":
            reduced.append(t.args[0].args[0])
            t = t.args[1]
        if sorted(reduced) != rows or tuple(e.axes) != (j,):
            return None
        if any(u.op in RED_OPS or u.op in ("Take", "St") for u in t.walk()):
            return None
        used = {u.args[0] for u in t.walk() if u.op == "In"}
        if not used or any(first.tensors.get(n) != second.tensors.get(n) for n in used):
            return None
        out[name] = t
    return out


def sum_kernel(k) -> bool:
    """``k`` is a compiled sum-family kernel (codegen/sums.py) of a certified fusion."""
    from acefuse.codegen import compile as cc
    mod = getattr(k, "module", None)
    return (type(k) is cc.Kernel and k.fusion.fusible and hasattr(mod, f"{k.program.name}_sum")
            and all(hasattr(mod, n) for n in ("ROW_AXES", "GRID_AXES", "VEC_AXES", "AXIS")))


def sum_rider_bodies(first, ka, second, kb) -> dict | None:
    """{output of ``second``: (body, axes)} when stage ``second`` (sum kernel ``kb`` over
    ``j``) can ride the pass of stage ``first`` (sum kernel ``ka`` over ``i``): ``j`` is
    ``ka``'s only row axis, every output of ``kb`` is one of its sums over ``j`` (no tile
    output), ranging over ``i``, ``ka``'s grid axes, its second loop axis if it has one (GQA's
    group members ``r``: added at that value's offset) and at most one of its vector axes, and
    reading only tensors ``first`` has with the same axes; else None. Whether the body
    needs no new per-tile work in ``ka``'s pass is decided while generating (SumGen)."""
    from acefuse.codegen.sums import sum_pass
    ma, mb = ka.module, kb.module
    if not (sum_kernel(ka) and sum_kernel(kb) and sum_pass(kb.fusion) and list(ma.ROW_AXES) == [mb.AXIS]):
        return None
    if not (ka.fusion.certificate.ok and kb.fusion.certificate.ok):
        return None
    F, G, V = ma.AXIS, set(ma.GRID_AXES) | set(getattr(ma, "LOOP2_AXES", ())), set(ma.VEC_AXES)
    states = {s.name: s.source for s in kb.fusion.passes[0].states}
    out = {}
    for o, t in kb.fusion.encoding.outputs.items():
        axes = tuple(kb.fusion.encoding.output_axes[o])
        if t.op != "St" or t.args[0] not in states or o in first.tensors or o in first.outputs:
            return None
        if tuple(second.outputs[o].axes) != axes:   # the layout the rider stage's caller expects
            return None
        if F not in axes or {a for a in axes if a not in V} != G | {F} or len(set(axes) & V) > 1:
            return None
        body = states[t.args[0]].args[1]
        used = {u.args[0] for u in body.walk() if u.op == "In"}
        if any(first.tensors.get(n) != second.tensors.get(n) for n in used):
            return None
        out[o] = (body, axes)
    return out or None


def _attach_sums(stages, kernels, compile_kw, done) -> None:
    """attach() for the sum family: a stage of sums over ``j`` rides a stage summing over ``i``
    with rows ``j`` (module docstring). Two such stages qualify both ways round; the host is
    the one that leaves the least to ride (each rider output costs an atomic add of every
    tile's result: fewest outputs over a vector axis, then fewest per-row outputs; attention's
    dQ riding the dK/dV pass adds one [tile, d] block per tile, dK and dV riding the dQ pass
    two). ``kernels[host]`` is replaced by the same
    fusion's module with the rider code (the RIDE variant of its kernel)."""
    from acefuse.codegen import compile as cc
    from acefuse.codegen.emit import CodegenError
    from acefuse.codegen.sums import SumGen
    pairs = []
    for a, (sa, ka) in enumerate(zip(stages, kernels)):
        for b, (sb, kb) in enumerate(zip(stages, kernels)):
            if b != a and sum_kernel(ka) and sum_kernel(kb):
                bodies = sum_rider_bodies(sa, ka, sb, kb)
                if bodies:   # the atomic traffic: riders over a vector axis, then per-row riders
                    vec = sum(1 for _, ax in bodies.values() if set(ax) & set(ka.module.VEC_AXES))
                    pairs.append(((vec, len(bodies) - vec), a, b, bodies))
    for _, a, b, bodies in sorted(pairs, key=lambda p: p[:3]):
        if {a, b} & (set(done) | set(done.values())):
            continue
        sa, ka = stages[a], kernels[a]
        try:
            src = SumGen(ka.fusion, riders=bodies).module()
        except CodegenError:
            continue
        h = cc.cache_key(ka.fusion, "sums", riders=sorted((o, cc._sx(t), ax) for o, (t, ax) in bodies.items()),
                         **{k: v for k, v in compile_kw.items() if v})
        path = cc.cached_source(sa.name, h, src)
        kernels[a] = cc.Kernel(ka.fusion, src, path, cc.load_module(path, f"acefuse_gen_{sa.name}_{h}"))
        done[b] = a


def attach(stages, kernels, compile_kw=None) -> dict:
    """Give stage kernels riders where a later (or earlier) stage qualifies: returns
    {second stage index: first stage index}, and replaces ``kernels[first]`` (in place)
    with the same fusion's module that also has the persistent rider kernel. A module
    that cannot be generated with riders (a body the row family cannot lower) keeps the
    stages apart."""
    from acefuse.codegen import compile as cc
    from acefuse.codegen.emit import CodegenError
    from acefuse.codegen.contraction import is_contraction
    compile_kw = {k: v for k, v in (compile_kw or {}).items()
                  if k in ("allow_unproved", "allow_uncertified")}
    done: dict = {}
    for a, (sa, ka) in enumerate(zip(stages, kernels)):
        if type(ka) is not cc.Kernel or not ka.fusion.fusible or is_contraction(ka.fusion):
            continue
        if len(ka.fusion.passes) != 1:
            continue
        riders = {}
        owners = []
        for b, sb in enumerate(stages):
            if b == a or b in done or b in done.values():
                continue
            bodies = rider_bodies(sa, ka.fusion, sb)
            if bodies and not (bodies.keys() & riders.keys()) and not (bodies.keys() & set(sa.outputs)):
                riders.update(bodies)
                owners.append(b)
        if not riders:
            continue
        try:
            k = cc.compile_program(sa, fusion=ka.fusion, riders=riders, **compile_kw)
        except CodegenError:
            continue
        if getattr(k, "fusion", None) is not ka.fusion:   # the certificate gate chose another kernel
            continue
        kernels[a] = k
        for b in owners:
            done[b] = a
    _attach_sums(stages, kernels, compile_kw, done)
    return done


def fold(partials, dtype):
    """A rider's result: its per-program partial sums (float32, programs x j) folded with
    the sum's merge, in the stage's output type."""
    return partials.sum(0).to(dtype)


def finish(acc, dtype, scale=1.0):
    """A sum-family rider's result: its float32 buffer (every program's tiles already added
    in, ``tl.atomic_add``) times the body's constant factor, in the stage's output type."""
    return (acc * scale if scale != 1.0 else acc).to(dtype)


# -- the sum kernel's rider code (called by codegen/sums.py's SumGen) ------------------------------
def check_sum_riders(gen) -> None:
    """Each rider of SumGen ``gen`` is laid out over its loop axis, its grid axes (and its second
    loop axis, if any) and at most one vector axis, reads only its tensors, and names no tensor
    or output; its constant factor goes to ``gen.rscale`` (applied once, by ``finish``)."""
    from acefuse.codegen.emit import CodegenError
    from acefuse.codegen.sums import _const_factor
    from acefuse.codegen.contraction import _flat_mul
    gen.rscale, gen.rtma = {}, []
    for o, (body, axes) in gen.riders.items():
        where = f"program {gen.name!r}: rider {o!r} (axes {' '.join(axes)})"
        if o in gen.tensors or o in gen.out_axes:
            raise CodegenError(f"{where}: the name is taken by a tensor or output of the host kernel")
        if gen.F not in axes or {a for a in axes if a not in gen.V} != set(gen.G) | {gen.F} | set(gen.loop2) \
                or len([a for a in axes if a in gen.V]) > 1:
            raise CodegenError(f"{where}: a rider ranges over the loop axis {gen.F!r}, the grid axes "
                               f"{gen.G}{' and the second loop axis ' + repr(gen.F2) if gen.F2 else ''} and at "
                               f"most one vector axis of {gen.V}")
        missing = sorted({u.args[0] for u in body.walk() if u.op == "In"} - set(gen.tensors))
        if missing:
            raise CodegenError(f"{where}: reads {missing}, which the host kernel does not load")
        gen.rscale[o] = _const_factor(_flat_mul(body))[0]
        vs = [a for a in axes if a in gen.V]
        if vs and list(axes) == list(gen.G) + [gen.F] + vs:   # a [grid, loop, vector] block: TMA-addressable
            gen.rtma.append(o)


def sum_rider_lines(gen, full) -> list:
    """The lines adding each rider's contribution of the current loop tile (``full``: a tile
    inside the loop's range; else the masked last one), under ``if RIDE:``. The tile value is
    taken from the pass's own values (the emitter's memo); a body needing a new load or dot
    per tile raises CodegenError (the rider stage then runs apart: riding would add work
    rather than share it)."""
    from acefuse.codegen.emit import CodegenError
    from acefuse.codegen.sums import _const_factor, _product
    from acefuse.codegen.contraction import _flat_mul
    from acefuse.rewrite.terms import pretty
    F, out = gen.F, []
    for o, (body, axes) in gen.riders.items():
        gen.lines = []
        _, fs = _const_factor(_flat_mul(body))
        vs = [a for a in axes if a in gen.V]
        vecs = [f for f in fs if vs and gen._shape_of(f) == ("r", vs[0])]
        if vs and len(vecs) != 1:
            raise CodegenError(f"program {gen.name!r}: rider {o!r}: `{pretty(body)}` is not a tile times one "
                               f"row vector over {vs[0]!r}")
        tt = _product([f for f in fs if not (vecs and f is vecs[0])])
        e, sh = gen.emit(tt)
        if sh not in ("rf", "r", "f", "s"):
            raise CodegenError(f"program {gen.name!r}: rider {o!r}: `{pretty(tt)}` is not a (rows x {F!r}) tile")
        work = [ln for ln in gen.lines if "tl.dot(" in ln or "tl.load(" in ln or "_ld(" in ln]
        if work:
            raise CodegenError(f"program {gen.name!r}: rider {o!r} needs per-tile work the pass over {F!r} "
                               f"does not do ({work[0].split(' = ')[0]}: a load or a dot); its stage runs apart")
        if sh != "rf":
            e = f"({gen.bcast(e, sh, 'rf')}) + tl.zeros([BLOCK_I, BLOCK_J], tl.float32)"
        # rows past the end (and, in the last tile, columns) add 0: their values may be inf/NaN
        x, _ = gen.bind(f"tl.where({'rmask[:, None]' if full else 'tmask'}, {e}, 0.0)", "rf", "r")
        ptr = f"{o}_ptr + {gen.goff(o, axes)} + cols{'[:, None]' if vs else ''} * s_{o}_{F}"
        if vs:
            a = vs[0]
            c, m = gen.vec(a)
            w = gen.dot_operand(vecs[0])
            val, _ = gen.bind(f"tl.dot(tl.trans({x}.to(DOT_T)), {w}, input_precision=PREC)", ("f", a), "r")
            ptr += f" + {c}[None, :] * s_{o}_{a}"
            mask = f"{m}[None, :]" if full else f"fmask[:, None] & {m}[None, :]"
        else:
            a = ""
            val, _ = gen.bind(f"tl.sum({x}, axis=0)", "f", "r")
            mask = None if full else "fmask"
        if gen._count:
            gen.rdots.append(a)
        add = f"tl.atomic_add({ptr}, {val}{', mask=' + mask if mask else ''}, sem='relaxed')"
        if o in gen.rtma:   # on Hopper: one bulk reduce-add of the [tile, axis] block (TMA clips the edges)
            gen.lines += ["if RTMA:",
                          f"    {o}_desc.atomic_add([pid_g, tl.min(cols, axis=0), 0], "
                          f"tl.reshape({val}, [1, BLOCK_J, BLOCK_V_{a}]))",
                          "else:",
                          "    " + add]
        else:
            gen.lines.append(add)
        sc = gen.rscale.get(o, 1.0)
        out.append(f"        # rider {o} = sum_{''.join(gen.R)}({pretty(body)}): this tile's rows, per {F} column, "
                   f"added into a float32 buffer (sum-split){f'; x {sc!r} after the pass' if sc != 1.0 else ''}")
        out.append("        if RIDE:")
        out.extend("            " + x for x in gen.lines)
    return out
