"""Kernels generated for the sharded flow from a certified fusion's own forms: partial states
over a shard, outputs from given (merged) states, a whole pass with global offsets.

Global offsets are runtime arguments: ``offsets`` names the axes whose local positions are
shifted (``index(a)`` -> ``index(a) + gpos_a``, a 0-d float32 input, ``base.gpos_inputs``), so
one kernel per program and set of shifted axes serves every rank and every visiting block of
a ring; its values are not part of the kernel. Global lengths (``sizes``, the same on every
rank) stay constants."""
from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from acefuse.rewrite.terms import Term, pretty
from acefuse.distributed.base import J, instantiate, gpos, gpos_axis


# ---- kernels generated for the sharded flow ---------------------------------------------
class _ShardProgram:
    """What a template reads of a generated program: name, axes, tensors, key."""

    def __init__(self, program, axes, tensors, role, extra, outputs=None):
        self.name = program.name
        self.outputs = dict(outputs or {})   # the program's outputs this kernel writes (their storage types)
        self.axes = tuple(axes)
        self.tensors = dict(tensors)
        self._key = hashlib.sha256(repr((program.key(), role, extra)).encode()).hexdigest()[:16]

    def key(self) -> str:
        return self._key


def _axes_fn(enc):
    from acefuse.rewrite.encode import _Axes
    return _Axes(dict(enc.tensors))


def state_axes(fusion) -> dict:
    """{state or reference value: its parallel axes, program order}."""
    enc, prog = fusion.encoding, fusion.program
    order = {a: i for i, a in enumerate(prog.axes)}
    ax = _axes_fn(enc)
    return {s.name: tuple(sorted(ax(s.source), key=order.__getitem__)) for s in enc.states}


def _inst_pass(p, f, offsets, sizes, states=True, runtime=True):
    from acefuse.fuse import FusionPass
    sub = (lambda t: instantiate(t, offsets, sizes, runtime=runtime))
    if not states:
        return []
    st = [replace(s, definition=sub(s.definition)) for s in p.states]
    refs = [replace(s, definition=sub(s.definition)) for s in p.refs]
    return [FusionPass(p.index, st, refs, init={k: sub(v) for k, v in p.init.items()},
                       rolling={k: sub(v) for k, v in p.rolling.items()},
                       merge={k: sub(v) for k, v in p.merge.items()},
                       rolling_cost=dict(p.rolling_cost), merge_cost=dict(p.merge_cost), stats=p.stats,
                       known=tuple(p.known))]


def _link_fusion(f, outputs, out_axes, tensors, passes, role, extra, enc_states=None, leaves=None, given=None):
    from acefuse.fuse import Fusion
    enc = f.encoding
    leaves = leaves if leaves is not None else enc.leaves
    enc_states = enc_states if enc_states is not None else enc.states
    # only the tensors this kernel reads (an index tensor no longer looked up must not be
    # checked as a float input), and only the axes they and the outputs range over
    terms = list(outputs.values()) + list(leaves.values()) + [s.definition for s in enc_states]
    for p in passes:
        terms += [t for d in (p.init, p.rolling, p.merge) for t in d.values()]
    used = {u.args[0] for t in terms for u in t.walk() if u.op == "In"}
    used |= {u.args[0] for t in terms for u in t.walk() if u.op == "Take"}
    used |= set(given or ())
    tensors = {t: ax for t, ax in tensors.items() if t in used}
    axes_used = {a for ax in tensors.values() for a in ax} | {a for ax in out_axes.values() for a in ax}
    axes_used |= {u.args[0] for t in terms for u in t.walk() if u.op == "Idx"}
    lenc = replace(enc, outputs=outputs, output_axes=out_axes, elementwise_outputs=tuple(
        o for o in outputs if enc.axis in out_axes[o]), tensors=dict(tensors), states=enc_states, leaves=leaves)
    extra_axes = sorted(a for a in axes_used if a not in f.program.axes)   # (gpos_axis: positions as lookups)
    prog = _ShardProgram(f.program, [a for a in f.program.axes if a in axes_used] + extra_axes, tensors, role, extra,
                         outputs={o: e for o, e in getattr(f.program, "outputs", {}).items() if o in outputs})
    note = f"sharded across ranks along {f.axis!r}: {role} ({extra})"
    lf = Fusion(prog, f.axis, lenc, passes, f.fusible, f.reason, list(f.blocked), list(f.rules),
                schedule=f.schedule, normal_form=list(f.normal_form) + [note])
    for p in f.passes:
        for s in p.states:
            lf._chains[(s.name, "rolling")] = f.rule_chain(s.name, "rolling")
            if s.name in p.merge:
                lf._chains[(s.name, "merge")] = f.rule_chain(s.name, "merge")
    return lf


def _own_hash() -> str:
    """A hash of this package (it holds a template: part of the cache key of what it generates)."""
    global _OWN_HASH
    if _OWN_HASH is None:
        h = hashlib.sha256()
        for p in sorted(Path(__file__).parent.glob("*.py")):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        _OWN_HASH = h.hexdigest()[:12]
    return _OWN_HASH


_OWN_HASH = None


def _load(lf, src, role, extra):
    from acefuse.codegen.compile import cache_key, cached_source, load_module, Kernel
    h = cache_key(lf, "sharded", role=role, extra=repr(extra), template=_own_hash())
    path = cached_source(f"{lf.program.name}_{role}", h, src)
    mod = load_module(path, f"acefuse_gen_{lf.program.name}_{role}_{h}")
    return Kernel(lf, src, path, mod)


def _with_gpos(tensors: dict, offsets, runtime=True) -> dict:
    return {**tensors, **{gpos(a): (gpos_axis(a),) if runtime == "lookup" else () for a in sorted(offsets)}}


def partial_kernel(f, offsets: dict, sizes: dict, names: dict):
    """The kernel writing the carried states of ``f``'s pass over the local shard (float32),
    with global positions instantiated: ``index(a)`` -> ``index(a) + gpos_a`` for the axes of
    ``offsets`` (runtime inputs; the values are not used here), ``size(a)`` -> ``sizes[a]``."""
    from acefuse.codegen import contraction, row
    enc = f.encoding
    p = f.passes[0]
    sax = state_axes(f)
    sub = (lambda t: instantiate(t, offsets, sizes, runtime=True))
    outputs = {names[s.name]: Term("St", (s.name, J)) for s in p.states}
    out_axes = {names[s.name]: sax[s.name] for s in p.states}
    states = [replace(s, definition=sub(s.definition)) for s in enc.states]
    leaves = {k: sub(v) for k, v in enc.leaves.items()}
    extra = (sorted(offsets), sorted(sizes.items()))
    lf = _link_fusion(f, outputs, out_axes, _with_gpos(enc.tensors, offsets), _inst_pass(p, f, offsets, sizes),
                      "partial", extra,
                      enc_states=states, leaves=leaves)
    lf.encoding = replace(lf.encoding, elementwise_outputs=())
    if contraction.is_contraction(f):
        from acefuse.codegen.chain import LinkGen
        src = LinkGen(lf, {}).module()
    else:
        src = row.RowGen(lf).module()
    return _load(lf, src, "partial", extra)


def full_kernel(f, offsets: dict, sizes: dict, template=False):
    """The one-pass kernel of ``f`` with global positions instantiated (``offsets``: runtime
    ``gpos_a`` inputs, ``sizes``: constants): a rank's slice of a parallel axis (its queries)
    against whole data.
    ``template=True``: generated by the family's own template as ``compile_program`` does
    (a backward stage whose outputs range over the contracted axis), else by the chain's
    link template."""
    from acefuse.codegen import contraction, row
    enc = f.encoding
    sub = (lambda t: instantiate(t, offsets, sizes, runtime=True))
    states = [replace(s, definition=sub(s.definition)) for s in enc.states]
    leaves = {k: sub(v) for k, v in enc.leaves.items()}
    extra = (sorted(offsets), sorted(sizes.items()))
    lf = _link_fusion(f, {o: sub(t) for o, t in enc.outputs.items()}, dict(enc.output_axes),
                      _with_gpos(enc.tensors, offsets),
                      _inst_pass(f.passes[0], f, offsets, sizes) if f.passes else [], "full", extra, enc_states=states,
                      leaves=leaves)
    lf.encoding = replace(lf.encoding, elementwise_outputs=tuple(enc.elementwise_outputs))
    if template:
        src = (contraction if contraction.is_contraction(f) else row).generate(lf)
        return _load(lf, src, "fullt", extra)
    if contraction.is_contraction(f):
        from acefuse.codegen.chain import LinkGen
        src = LinkGen(lf, {}).module()
    else:
        src = row.RowGen(lf).module()
    return _load(lf, src, "full", extra)


def _given_row_gen():
    from acefuse.codegen.row import RowGen

    class GivenRowGen(RowGen):
        """The row template with final states loaded from tensors (``given``: state ->
        tensor name) in the prologue, and no pass of its own: the outputs and the epilogue
        of the fusion, on the local shard, from states merged across ranks."""

        def __init__(self, fusion, given):
            super().__init__(fusion)
            self.given = dict(given)

        def prologue(self, L, grid_rows="tl.program_id(0)"):
            super().prologue(L, grid_rows)
            for q, t in self.given.items():
                off = f" + off_{t}" if self.row_axes_of(t) else ""
                L.append(f"    # {q}: its final value, merged across ranks (input {t})")
                L.append(f"    {q} = tl.load({t}_ptr{off} + 0 * rows, mask=rmask, other=0.0).to(tl.float32)")
    return GivenRowGen


def final_kernel(f, offsets: dict, sizes: dict, names: dict, takes: dict, n_global: int):
    """The row kernel writing ``f``'s outputs on the local shard from given final states
    (``names``: state -> input tensor) and looked-up values (``takes``: Take term -> input);
    ``offsets``' axes are shifted by runtime ``gpos_a`` inputs."""
    enc = f.encoding
    sax = state_axes(f)
    ax = _axes_fn(enc)
    order = {a: i for i, a in enumerate(f.program.axes)}
    tensors = _with_gpos(enc.tensors, offsets)
    for q, t in names.items():
        tensors[t] = sax[q]
    for tk, t in takes.items():
        tensors[t] = tuple(sorted(ax(tk), key=order.__getitem__))

    def swap(t):
        if t in takes:
            return Term("In", (takes[t],))
        if not t.children:
            return t
        return Term(t.op, tuple(swap(a) if isinstance(a, Term) else a for a in t.args))

    def sub(t):
        return instantiate(swap(t), offsets, sizes, n_global, runtime=True)
    outputs = {o: sub(t) for o, t in enc.outputs.items()}
    states = [replace(s, definition=sub(s.definition)) for s in enc.states]
    leaves = {k: sub(v) for k, v in enc.leaves.items()}
    extra = (sorted(offsets), sorted(sizes.items()), n_global, sorted(names.items()),
             sorted((pretty(k), v) for k, v in takes.items()))
    lf = _link_fusion(f, outputs, dict(enc.output_axes), tensors, [], "final", extra,
                      enc_states=states, leaves=leaves, given=list(names.values()) + list(takes.values()))
    src = _given_row_gen()(lf, names).module()
    return _load(lf, src, "final", extra)


# ---- the ring's folding kernels -----------------------------------------------------------
def _fold_gen():
    from acefuse.codegen.chain import LinkGen
    from acefuse.codegen.emit import CodegenError

    class FoldGen(LinkGen):
        """The contraction template of the partial kernel with one hook: the running states of
        the blocks before this one (``carry``: state -> input tensor; ``carry_n``: a 0-d input
        holding their count, when a form reads counts) are the kernel's initial states, and
        every key tile of the block, the first included, is folded into them by the pass's own
        derived rolling update (``St(q, A)``: the running states, the tile in registers): the
        rolling schedule continued across blocks, with no merge of two finished states at the
        end and no second set of accumulators live beside the loop's. The outputs are then the
        folded states (``St(q, J)``) or the program's outputs read from them (the ring's last
        block). Everything else is the partial kernel's source."""

        def __init__(self, fusion, carry, carry_n):
            super().__init__(fusion, {})
            self.carry = dict(carry)
            self.carry_n = carry_n
            self.split_mode = False

        def load_carry(self, L, ind):
            L.append(f"{ind}# the running states of the blocks before (inputs {', '.join(self.carry.values())}): "
                     "this block's tiles are folded into them")
            for s in self.p.states:
                t = self.carry[s.name]
                axes = self.tensors[t]
                r = any(a in self.R for a in axes)
                ptr = f"{t}_ptr + off_{t}_g"
                if self.E and self.E[0] in axes:
                    ptr += (f" + off_{t}_r[:, None]" if r else "") + f" + ecols[None, :] * s_{t}_{self.E[0]}"
                    ptr += "" if r else " + 0 * rows[:, None]"   # (a state over no row axis: one per row tile)
                    L.append(f"{ind}{s.name} = tl.load({ptr}, mask=rmask[:, None] & emask[None, :], other=0.0)")
                else:
                    ptr += f" + off_{t}_r" if r else " + 0 * rows"
                    L.append(f"{ind}{s.name} = tl.load({ptr}, mask=rmask, other=0.0)")
            if self.carry_n is not None:
                L.append(f"{ind}n_a = tl.load({self.carry_n}_ptr).to(tl.float32)")

        def emit_states(self, forms, em, L, ind, suffix, comment):
            if not self.carry or self.split_mode or forms is not self.p.init:
                return super().emit_states(forms, em, L, ind, suffix, comment)
            # the block's first tile: the rolling update of the running states (not the states'
            # definitions on it, as in a kernel that starts from nothing)
            self.load_carry(L, ind)
            self._update_from_carry("rolling", "roll", L, ind)
            if self.uses_counts():   # (the template then sets n_a = n_b: the count so far)
                L.append(f"{ind}n_b = n_a + n_b")

        def empty_start(self):
            # a folding block's loop starts from the running states: no peeled first tile (the
            # template's empty-start branch, whose initial values key_loop replaces by the carry)
            if self.carry and not self.split_mode:
                return {s.name: 0.0 for s in self.p.states}
            return super().empty_start()

        def key_loop(self, L, lo, hi):
            """The template's key loop; for a folding block whose loop starts without a peeled
            tile, its initial states (an empty block's values) are replaced by the carry's."""
            if not self.carry or self.split_mode:
                return super().key_loop(L, lo, hi)
            import re
            sub = []
            super().key_loop(sub, lo, hi)
            names = {s.name for s in self.p.states}
            out, seen, ind = [], set(), "    "
            for ln in sub:
                m = re.match(r"(\s*)(\w+) = tl\.full\(", ln)
                c = re.match(r"\s*# (\w+): on an empty block", ln)
                if c and c.group(1) in names:
                    continue
                if m and m.group(2) in names and m.group(2) not in seen:
                    if not seen:
                        self.load_carry(out, m.group(1))
                    seen.add(m.group(2))
                    continue
                out.append(ln)
            if seen and seen != names:
                raise CodegenError(f"program {self.name!r}: the ring's folding kernel found the initial values of "
                                   f"{sorted(seen)} but not of {sorted(names - seen)} in the contraction template's "
                                   "key loop (the template changed: update kernels.FoldGen.key_loop)")
            L.extend(out)

        def kernel_split(self):
            # split-KV (a launch whose programs cannot fill the device): the chunks start from
            # nothing and the combine kernel folds the running states into their merge at the end
            self.split_mode = True
            try:
                return super().kernel_split()
            finally:
                self.split_mode = False

        def fold_end(self, L, ind):
            """The combine's fold: the running states (A) and the merged chunks' (B), by the
            derived merge."""
            for s in self.p.states:
                L.append(f"{ind}{s.name}_b = {s.name}")
            self.load_carry(L, ind)
            if self.carry_n is not None:
                L.append(f"{ind}n_b = nj_f")
            self._update_from_carry("merge", "merge", L, ind)

        def _update_from_carry(self, form, region, L, ind):
            """The states updated by the derived ``form`` ('rolling' or 'merge') from the running
            (carried) states, each with its rule chain in a comment."""
            p, chain = self.p, self.f.rule_chain
            forms = getattr(p, form)
            ctx, em = self.region(region, ind)
            super().emit_states(forms, em, L, ind, "_new",
                                lambda s: f"{s.name}_AB = {pretty(forms[s.name])}\n  derived by: "
                                          f"{' -> '.join(chain(s.name, form)) or 'definition'}")
            for s in p.states:
                L.append(f"{ind}{s.name} = {s.name}_new")

        def store_outputs(self, L, ind="    "):
            if self.carry and self.split_mode:
                self.fold_end(L, ind)
            super().store_outputs(L, ind)
    return FoldGen


def fold_names(f, taken) -> tuple:
    """({state: carry tensor name}, count tensor name or None): the running states' inputs of
    a folding kernel (names free in ``taken``); the count only when a form reads counts."""
    p = f.passes[0]
    carry = {}
    for s in p.states:
        t = f"carry_{s.name}"
        while t in taken:
            t += "_"
        carry[s.name] = t
    # (the folding kernel's rolling update of its first tile, and its split-KV combine's merge)
    forms = [p.merge[s.name] for s in p.states] + list(p.rolling.values()) + list(p.init.values())
    counts = any(u.op == "Cnt" for t in forms for u in t.walk())
    n = None
    if counts:
        n = "carry_n"
        while n in taken or n in carry.values():
            n += "_"
    return carry, n


def foldable(f) -> str | None:
    """None when the ring's blocks can fold their states in the kernel (the contraction family,
    one pass, every state with a derived merge); else why not (the ring then merges in torch)."""
    from acefuse.codegen import contraction
    if not contraction.is_contraction(f):
        return "the program is not in the contraction family (the fold hook is in its template)"
    if len(f.passes) != 1 or not f.passes[0].split_ok:
        return "its fusion is not one pass whose states all have a derived merge"
    return None


def fold_kernel(f, offsets: dict, sizes: dict, names: dict, carry: bool, final: bool, n_global=None, runtime=True):
    """A ring block's kernel: the partial kernel (``partial_kernel``) that, with ``carry``, takes
    the running states as inputs and starts its key loop from them (the derived rolling update
    from the block's first tile on; split-KV: its combine folds them in by the derived merge):
    one load and one store of each state per block, no merge pass over them in memory; with
    ``final``, writes the program's outputs from the folded states (the last block of a query
    piece: no float32 state is written, no finishing pass). ``names``: state -> output tensor
    name. ``final`` needs outputs that read only the states and per-row inputs (``size(a)`` and
    the whole axis's count instantiated to the global values; no reference values)."""
    enc = f.encoding
    p = f.passes[0]
    sax = state_axes(f)
    sub = (lambda t: instantiate(t, offsets, sizes, runtime=runtime))
    if final:
        outputs = {o: instantiate(t, offsets, sizes, n_global, runtime=runtime) for o, t in enc.outputs.items()}
        out_axes = dict(enc.output_axes)
    else:
        outputs = {names[s.name]: Term("St", (s.name, J)) for s in p.states}
        out_axes = {names[s.name]: sax[s.name] for s in p.states}
    states = [replace(s, definition=sub(s.definition)) for s in enc.states]
    leaves = {k: sub(v) for k, v in enc.leaves.items()}
    tensors = _with_gpos(enc.tensors, offsets, runtime)
    cn, nn = fold_names(f, set(tensors) | set(outputs)) if carry else ({}, None)
    for q, t in cn.items():
        tensors[t] = sax[q]
    if nn is not None:
        tensors[nn] = ()
    role = "fold" + ("final" if final else "") if carry else "final1"
    extra = (sorted(offsets), sorted(sizes.items()), n_global if final else None) + (("lookup",) if runtime == "lookup" else ())
    lf = _link_fusion(f, outputs, out_axes, tensors, _inst_pass(p, f, offsets, sizes, runtime=runtime), role, extra,
                      enc_states=states, leaves=leaves, given=list(cn.values()) + ([nn] if nn else []))
    lf.encoding = replace(lf.encoding, elementwise_outputs=())
    src = _fold_gen()(lf, cn, nn).module()
    k = _load(lf, src, role, extra)
    k.carry, k.carry_n = cn, nn
    return k
