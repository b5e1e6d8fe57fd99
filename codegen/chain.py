"""A multi-pass contraction Fusion as a chain of one-pass kernels.

The contraction family (codegen/contraction.py) emits one-pass kernels: one loop over
the key tiles carrying the states of a single pass. A Fusion with several passes (the
unfused kernel that ``af.compile`` falls back to when a fusion is not certified, one pass
per reduction depth, or a fusion some of whose states need another pass) runs here as one
kernel per pass, a *link*:

- link k evaluates pass k exactly as the Fusion states it: the init, rolling and merge
  forms of its states (so the loop and split schedules both exist), reading every state
  finished by an earlier pass as a final value ``St(q, J)``;
- those final values come in as float32 tensors over the states' parallel axes (a
  per-row max is an input "b h i"), loaded once per row tile into the variable the
  template names the final state by, so every convention the emitter applies to a final
  state applies unchanged (an empty max read as 0 where it bounds a shift, 0/0 from a
  reduction is 0: a fully masked row gives the same result as in one kernel);
- link k writes, as float32, the states and reference values of its pass that a later
  link reads; the last link writes the program's outputs.

No link evaluates an expression that is not the Fusion's own: the forms are the pass's,
the outputs the encoding's, a reference value its definition. So the chain is certified
exactly when the Fusion is (``Fusion.certificate``; af.compile compiles a chain only for
a fusion that passed it, or under ``allow_uncertified=True``), and ``ChainKernel.fusion``
is that Fusion.
"""
from __future__ import annotations

import hashlib
import inspect
from dataclasses import replace

from acefuse.rewrite.terms import Term, reblock
from acefuse.rewrite.encode import _Axes
from acefuse.codegen.emit import CodegenError
from acefuse.codegen.contraction import ContractionGen

J = Term("BJ")
# launch options of the contraction launcher, passed to every link
RUN_OPTIONS = ("schedule", "block_i", "block_j", "nsplit", "num_warps", "num_stages")


class _LinkProgram:
    """What the template reads of a link's program: its name (the user's program, so that
    every message names it), its axes (only those the link uses: an axis no operand of the
    link has must not become a grid axis) and a key."""

    def __init__(self, program, axes, index, outputs):
        self.name = program.name
        self.axes = tuple(axes)
        self.tensors = program.tensors
        self._key = hashlib.sha256(repr((program.key(), index, sorted(outputs))).encode()).hexdigest()[:16]

    def key(self) -> str:
        return self._key


class LinkGen(ContractionGen):
    """The contraction template for one link: the states finished by earlier links are
    extra input tensors (``given``: state -> (tensor, axes)), loaded in the prologue into
    the names the template gives final states."""

    def __init__(self, fusion, given: dict):
        super().__init__(fusion)
        self.given = dict(given)
        self.tensors = dict(self.tensors)
        for q, (t, axes) in self.given.items():
            odd = [a for a in axes if a not in self.G + self.R + self.E]
            if odd:
                raise CodegenError(f"program {self.name!r}: the state {q} finished by an earlier pass ranges "
                                   f"over {odd}, which are not parallel axes of pass {fusion.passes[0].index}")
            self.tensors[t] = tuple(axes)

    def prologue(self, L):
        super().prologue(L)
        for q, (t, axes) in self.given.items():
            ptr = f"{t}_ptr + off_{t}_g"
            r = any(a in self.R for a in axes)
            L.append(f"    # {q}: final value from an earlier pass (link input {t})")
            if self.E and self.E[0] in axes:
                ptr += (f" + off_{t}_r[:, None]" if r else "") + f" + ecols[None, :] * s_{t}_{self.E[0]}"
                L.append(f"    {q} = tl.load({ptr} + 0 * rows[:, None], mask=rmask[:, None] & emask[None, :], "
                         "other=0.0).to(tl.float32)")
            else:
                ptr += f" + off_{t}_r" if r else ""
                L.append(f"    {q} = tl.load({ptr} + 0 * rows, mask=rmask, other=0.0).to(tl.float32)")


def _states_read(terms) -> set:
    return {u.args[0] for t in terms for u in t.walk() if u.op == "St"}


def _expand_refs(t: Term, enc, keep) -> Term:
    """``St(r, J)`` of a reference value not in ``keep`` -> its definition over J (the template
    names only carried and loaded states)."""
    if t.op == "St" and t.args[0] not in keep and enc.state(t.args[0]).op == "ref":
        return _expand_refs(reblock(enc.state(t.args[0]).definition, J), enc, keep)
    if not t.children:
        return t
    return Term(t.op, tuple(_expand_refs(a, enc, keep) if isinstance(a, Term) else a for a in t.args))


def _leaves_of(terms, leaves) -> dict:
    names = {u.args[0] for t in terms for u in t.walk() if u.op in ("Elm", "Par")}
    return {n: lf for n, lf in leaves.items() if n in names}


def plan(fusion):
    """The links of a multi-pass Fusion: [(link Fusion, given {state: (tensor, axes)},
    state outputs {tensor: state})], one per pass."""
    from acefuse.fuse import Fusion, FusionPass
    enc, prog = fusion.encoding, fusion.program
    axes_of = _Axes(dict(enc.tensors))
    order = {a: i for i, a in enumerate(prog.axes)}
    taken = set(prog.tensors) | set(enc.outputs)

    def tensor_name(q):
        t = f"state_{q}"
        while t in taken:
            t += "_"
        return t
    names = {s.name: tensor_name(s.name) for s in enc.states}
    st_axes = {s.name: tuple(sorted(axes_of(s.source), key=order.__getitem__)) for s in enc.states}

    def forms(p):
        return [t for d in (p.init, p.rolling, p.merge) for t in d.values()]
    passes = fusion.passes
    produced = {}   # state or reference value -> the link (pass) that finishes it
    for k, p in enumerate(passes):
        for s in list(p.states) + list(p.refs):
            produced[s.name] = k
    # from the last link back: what a link writes is what later links read of its pass; what
    # it reads is every final state its forms and outputs name (a reference value finished by
    # an earlier link is read as a tensor, one of its own pass is computed from its definition)
    plans, need = {}, {}
    for k in range(len(passes) - 1, -1, -1):
        p = passes[k]
        own = {s.name for s in p.states}
        keep = own | {q for q, kk in produced.items() if kk < k}
        if k == len(passes) - 1:
            outputs = {o: _expand_refs(t, enc, keep) for o, t in enc.outputs.items()}
            out_axes, state_out = dict(enc.output_axes), {}
        else:
            outs = sorted(need.get(k, ()), key=[s.name for s in enc.states].index)
            outputs = {names[q]: _expand_refs(Term("St", (q, J)), enc, keep) for q in outs}
            out_axes = {names[q]: st_axes[q] for q in outs}
            state_out = {names[q]: q for q in outs}
        read = _states_read(forms(p) + list(outputs.values())) - own
        for q in sorted(read):
            if produced.get(q, k) >= k:
                raise CodegenError(f"program {prog.name!r}: pass {p.index} reads state {q}, which no earlier "
                                   "pass finishes (an acefuse bug, please report it)")
            need.setdefault(produced[q], set()).add(q)
        plans[k] = ({q: (names[q], st_axes[q]) for q in sorted(read)}, outputs, out_axes, state_out)
    links = []
    for k, p in enumerate(passes):
        given, outputs, out_axes, state_out = plans[k]
        leaves = _leaves_of(forms(p) + list(outputs.values()), enc.leaves)
        used = {a for lf in leaves.values() for a in axes_of(lf)} | {a for ax in out_axes.values() for a in ax}
        used |= {a for _, ax in given.values() for a in ax}
        used |= {a for t in forms(p) + list(outputs.values()) for u in t.walk() if u.op == "In"
                 for a in enc.tensors[u.args[0]]}
        used |= {u.args[0] for t in list(leaves.values()) + forms(p) + list(outputs.values())
                 for u in t.walk() if u.op == "Idx"}
        lenc = replace(enc, leaves=leaves, outputs=outputs, output_axes=out_axes, elementwise_outputs=())
        lp = FusionPass(p.index, list(p.states), list(p.refs), init=dict(p.init), rolling=dict(p.rolling),
                        merge=dict(p.merge), rolling_cost=dict(p.rolling_cost), merge_cost=dict(p.merge_cost),
                        stats=p.stats, known=tuple(p.known))
        note = (f"link {k + 1} of {len(passes)}: pass {p.index} as its own kernel"
                + (f", reading {', '.join(sorted(given))} finished by earlier links" if given else "")
                + (f", writing {', '.join(state_out.values())} for later links" if state_out else ""))
        lf = Fusion(_LinkProgram(prog, [a for a in prog.axes if a in used], k, outputs), fusion.axis, lenc,
                    [lp], fusion.fusible, fusion.reason, list(fusion.blocked), list(fusion.rules),
                    schedule=fusion.schedule, normal_form=list(fusion.normal_form) + [note])
        lf._chains.update({(s.name, form): fusion.rule_chain(s.name, form) for s in p.states
                           for form in ("rolling", "merge") if form == "rolling" or s.name in p.merge})
        links.append((lf, given, state_out))
    return links


class _ChainModule:
    """What callers read of a kernel's generated module: ``run`` (the whole chain's launcher,
    with ``out_dtypes`` like the others), ``TENSORS`` and a name."""

    def __init__(self, chain):
        self.run = chain.run
        self.TENSORS = dict(chain.program.tensors)
        self.__name__ = f"acefuse_chain_{chain.program.name}"


class ChainKernel:
    """A compiled multi-pass contraction program: one kernel per pass (``links``), called like
    a ``Kernel`` (inputs by name or position, the same launch options, the same outputs)."""

    def __init__(self, fusion, links):
        self.fusion = fusion
        self.program = fusion.program
        self.links = links               # [(Kernel, given {state: (tensor, axes)}, {tensor: state})]
        self.path = None                 # several files (``paths``); nothing indexes one of them alone
        self.paths = [k.path for k, _, _ in links]
        self.source = "\n\n".join(f"# ---- link {i + 1} of {len(links)}: pass {k.fusion.passes[0].index} ----\n"
                                  + k.source for i, (k, _, _) in enumerate(links))
        self.module = _ChainModule(self)

    @property
    def fusible(self):
        return self.fusion.fusible

    def __call__(self, *args, **inputs):
        if "process_group" in inputs or "sharded_axis" in inputs:   # sharded across ranks: acefuse/distributed.py
            from acefuse.distributed import call_sharded
            return call_sharded(self, args, inputs)
        from acefuse.codegen import compile as cc
        req = cc.requires_grad_inputs(args, inputs, list(self.program.tensors))
        if req:
            return cc.grad_hook(self, req, args, inputs)
        return self.run(*args, **inputs)

    def run(self, *args, out_dtypes=None, **inputs):
        """Launch the links in order; ``out_dtypes`` ({output: dtype}) as in every launcher."""
        import torch
        names = list(self.program.tensors)
        if len(args) > len(names):
            raise TypeError(f"program {self.program.name!r} takes {len(names)} input(s) {names}, got "
                            f"{len(args)} positional arguments")
        inputs = dict(inputs)
        for n, a in zip(names, args):
            if n in inputs:
                raise TypeError(f"program {self.program.name!r}: input {n!r} given both by position and by name")
            inputs[n] = a
        unknown = [n for n in inputs if n not in names and n not in RUN_OPTIONS]
        if unknown:
            raise TypeError(f"program {self.program.name!r} has no input(s) {unknown}; its inputs are {names} "
                            f"and its launch options {list(RUN_OPTIONS)}")
        options = {n: v for n, v in inputs.items() if n in RUN_OPTIONS}
        tensors = {n: v for n, v in inputs.items() if n in names}
        if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in tensors.values()):
            return self._empty(tensors)
        finals: dict = {}
        out = None
        for i, (kern, given, state_out) in enumerate(self.links):
            # states handed on are float32 whatever the inputs' type (as in registers)
            last = i == len(self.links) - 1
            dt = {t: torch.float32 for t in state_out} if not last else (out_dtypes or {})
            out = kern(**tensors, **{t: finals[q] for q, (t, _) in given.items()}, **options,
                       **({"out_dtypes": dt} if dt else {}))
            if state_out:
                outs = out if isinstance(out, dict) else {next(iter(state_out)): out}
                finals.update({q: outs[t] for t, q in state_out.items()})
        return out

    def _empty(self, tensors):
        """Inputs with an empty axis: the last link's empty outputs (its launcher's checks name
        the program's outputs), with empty stand-ins for the states it would read."""
        import torch
        sizes: dict = {}
        for t, x in tensors.items():
            for a, n in zip(self.program.tensors[t], getattr(x, "shape", ())):
                sizes.setdefault(a, n)
        dev = next((x.device for x in tensors.values() if isinstance(x, torch.Tensor)), None)
        kern, given, _ = self.links[-1]
        stand = {t: torch.empty([sizes.get(a, 0) for a in ax], dtype=torch.float32, device=dev)
                 for t, ax in given.values()}
        return kern.module.empty_outputs(**tensors, **stand)

    def __repr__(self):
        return (f"<acefuse chain of {len(self.links)} kernels for {self.program.name!r} over "
                f"{self.fusion.axis!r} (one per pass)>")


def compile_chain(fusion, **options):
    """Generate, cache and load one kernel per pass of a multi-pass contraction Fusion."""
    from acefuse.codegen.compile import cache_key, cached_source, load_module, Kernel
    kernels = []
    for i, (lf, given, state_out) in enumerate(plan(fusion)):
        src = LinkGen(lf, given).module()
        h = cache_key(lf, "chain", link=i, given=sorted(given.items()), **options)
        path = cached_source(f"{fusion.program.name}_link{i + 1}", h, src)
        mod = load_module(path, f"acefuse_gen_{fusion.program.name}_link{i + 1}_{h}")
        if state_out and "out_dtypes" not in inspect.signature(mod.run).parameters:
            raise CodegenError(f"program {fusion.program.name!r}: the contraction launcher takes no out_dtypes, "
                               "which a chain needs to hand on float32 states (an acefuse bug, please report it)")
        kernels.append((Kernel(lf, src, path, mod), given, state_out))
    return ChainKernel(fusion, kernels)
