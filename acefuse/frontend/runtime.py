"""Drop-in callables backed by acefuse kernels: ``compile_fn`` and the torch.compile ``Backend``.

A compiled function specialises on the call's *shape signature* (shapes, dtypes,
devices, non-tensor arguments): ``compile_fn`` captures the function through Dynamo for
each new signature (``graph.capture``), the graph is partitioned and re-imported (an op
acefuse cannot import splits its region: ``split_unsupported``), and each region's
program is looked up by ``Program.key()`` in the kernel cache (acefuse.frontend.kernels),
in memory and on disk, so a new shape with the same program reuses the
kernel. The generated module itself chooses its schedule from the sizes (one tile,
rolling loop, split), so whether the fused axis fits one tile needs no new kernel.

A region whose reductions run over different axes (a norm over features, then a softmax over
rows) is split at the first reduction over another axis, one region per axis (``_axis_split``).
Regions that acefuse cannot compile (a contraction, one op reducing over several dims that
another reduction depends on, float64) run in torch, with one warning line naming the region,
its source line and why.

Dtypes (inference): a region's kernel reads float16/bfloat16 inputs in their own type (widened
on load, exactly) and writes each output in the type eager gives it; a computed value that
eager rounds to float16/bfloat16 (``.to(input_dtype)``, a bf16 residual read back in float32,
a bf16 output) is rounded by the program at that point (``af.cast``, bit-exact), so no
widened copy or float32 intermediate is made around the call (``Imported.direct_plan``).
What a call does is worked out on its first call and reused (shapes and dtypes are part of
the specialisation).

``Backend(inner="inductor")`` (the default on CUDA) hands each specialised graph to Inductor
with every region one opaque ``acefuse::region`` op (acefuse.frontend.inductor); the text below
describes ``inner="eager"``, where torch runs the rest of the graph op by op.

Training: a region whose inputs require grad (grad mode on) runs as a differentiable
kernel (acefuse.autograd): a ``torch.autograd.Function`` whose forward is the augmented
forward kernel and whose backward runs the kernels of ``af.backward(program)``, so its
outputs have a ``grad_fn`` and every input upstream or inside (a LayerNorm's weight and
bias) gets its gradient. torch.compile hands a plain backend the forward graph only
(no AOTAutograd), and autograd records each region as one node. A region acefuse
cannot differentiate or whose backward does not compile runs in torch, with one
warning naming the region and why: gradients are never dropped. When that region
holds contractions (matmuls: no derived backward kernel yet), they stay in torch and
the reductions around them are retried, as for inference. Grad mode and
``requires_grad`` are part of the shape signature, so the same function under
``torch.no_grad()`` (inference) runs the plain kernels. A region without contractions that
widens a float16/bfloat16 input (HF's RMSNorm: ``x.to(float32)`` inside; a cross-entropy over
``logits.float()``) runs its differentiable kernel on the inputs as they are (``grad_plan``: no
float32 copy of an input, none saved for the backward; each output written in eager's type, the
gradients in their inputs', saved values wide; a gradient as large as its input is rounded and
written in that type by the backward kernel itself: ``kernels.narrowed``); other regions are
widened to the compute dtype as before.

Region inputs are named by position (``importer.import_nodes``), so regions that differ only in
the torch values they read (every layer's norm or attention) are one program: derived, certified
and compiled once per process (and found in the on-disk index by other processes).
"""
from __future__ import annotations

import inspect
import os
import warnings

import torch
import torch.fx

from acefuse.frontend.errors import FrontendError, UnsupportedOpError
from acefuse.frontend.graph import capture, op_name, propagate, source_line, trace
from acefuse.frontend.importer import import_nodes, reduced_dims
from acefuse.frontend.lower import kind_of, name_of
from acefuse.frontend.partition import (find_regions, rebuild, region_outputs, split_at_axis_change,
                                        split_composites, unshare_contraction_operands)
from acefuse.frontend.report import Report, graph_entries, is_reduction_like
from acefuse.frontend.kernels import (GradKernelError, clear_cache, get_grad_kernel, get_kernel,  # noqa: F401
                                      stats)


class AcefuseFallbackWarning(UserWarning):
    """A recognised region runs in torch instead of an acefuse kernel (the message says why)."""


class CompiledRegion(torch.nn.Module):
    """One region of the graph, run by an acefuse kernel; differentiable (``grad``, an
    acefuse.autograd kernel) when its inputs require grad. ``calls`` counts how each call
    ran: ``kernel`` (plain), ``grad`` (differentiable kernel), ``torch`` (fallback)."""

    def __init__(self, imp, kernel, fallback, grad=None):
        super().__init__()
        self.imp, self.kernel, self.grad = imp, kernel, grad
        self.program = imp.program
        self.fallback = fallback      # the region's own torch ops, same inputs and outputs
        self.grad_error = None
        self.kernel_error = None
        self.calls = {"kernel": 0, "grad": 0, "torch": 0}
        self._fd = None               # the compute dtype: fixed per specialisation (dtypes are in the signature)
        self._plan = False            # the plain kernel's call without widened copies (Imported.direct_plan)
        self._grad_feeds = None       # the differentiable kernel's input adapters (_run_grad)
        self._grad_kw = {}            # and its out_dtypes (eager's output types: grad_plan)
        self._outs = {}               # "kernel"/"grad" -> the output adapters (_torch_outputs)
        self._sources = imp.sources
        self.timing = None            # acefuse.frontend.timed's choice, when the region was timed

    def _inputs(self, values):
        if self._fd is None:
            self._fd = self.imp.compute_dtype(values)
        return self.imp.program_inputs(values, self._fd)

    def _run_plain(self, srcs):
        """The plain kernel on these source values: float inputs read in their own types and each
        output written in eager's (``Imported.direct_plan``), else through the widening adapters.
        What a call does is worked out on the first one (shapes, dtypes and devices are fixed per
        specialisation): which source feeds each input through which adapter (None: the source
        itself), and the launcher called directly (no per-call grad or empty-input checks: inputs
        are not empty and grad mode is off here; the launcher reuses its own plan per signature)."""
        if self._plan is False:
            self._plan = self._plain_plan(srcs)
        feeds, run, kw = self._plan
        return run(**{name: srcs[i] if f is None else f(srcs[i]) for name, i, f in feeds}, **kw)

    def _plain_plan(self, srcs):
        values = dict(zip(self._sources, srcs))
        if self._fd is None:
            self._fd = self.imp.compute_dtype(values)
        plan = self.imp.direct_plan(values, self.kernel, self._fd)
        chains, fd, kw = (None, self._fd, {}) if plan is None else (plan[0], None, {"out_dtypes": plan[1]})
        at = {s: i for i, s in enumerate(self._sources)}
        feeds = [(s.name, at[s.src], s.adapter(srcs[at[s.src]], fd, None if chains is None else chains[s.name]))
                 for s in self.imp.inputs]
        run = self.kernel
        # a one-module kernel's launcher, called directly: what Kernel.__call__ adds (the grad
        # refusal, the empty-input result) cannot apply here
        if isinstance(run, _ONE_MODULE) and all(t.numel() for t in srcs if isinstance(t, torch.Tensor)):
            run = run.module.run
            if os.environ.get("TRITON_INTERPRET") == "1":
                run = _interpreted(run)
        return feeds, run, kw

    def _run_grad(self, srcs):
        """The differentiable kernel on these source values: read in their own types where that
        changes nothing (``grad_plan``: a bfloat16 norm region reads bfloat16 and writes it),
        else widened to the compute dtype; the input adapters are worked out on the first call."""
        if self._grad_feeds is None:
            values = dict(zip(self._sources, srcs))
            if self._fd is None:
                self._fd = self.imp.compute_dtype(values)
            plan = grad_plan(self.imp, self.grad, values)
            chains, fd = (None, self._fd) if plan is None else (plan[0], None)
            self._grad_kw = {} if plan is None or not plan[1] else {"out_dtypes": plan[1]}
            at = {s: i for i, s in enumerate(self._sources)}
            self._grad_feeds = [(s.name, at[s.src], s.adapter(srcs[at[s.src]], fd,
                                                              None if chains is None else chains[s.name]))
                                for s in self.imp.inputs]
        return self.grad(**{name: srcs[i] if f is None else f(srcs[i]) for name, i, f in self._grad_feeds},
                         **self._grad_kw)

    def _torch_outputs(self, outs, how):
        """The region's torch results from the kernel's outputs (``how``: "kernel" or "grad"), through
        output adapters worked out on the first call (each checks its output's layout)."""
        if not isinstance(outs, dict):
            outs = {self.imp.outputs[0].name: outs}
        ad = self._outs.get(how)
        if ad is None:
            if not all(isinstance(outs.get(o.name), torch.Tensor) for o in self.imp.outputs):
                return tuple(self.imp.torch_outputs(outs))
            ad = self._outs[how] = [(o.name, o.adapter(outs[o.name])) for o in self.imp.outputs]
        return tuple(f(outs[name]) for name, f in ad)

    def _torch(self, srcs):
        self.calls["torch"] += 1
        return tuple(self.fallback(*srcs))

    def forward(self, *srcs):
        if self.kernel is None:
            return self._torch(srcs)
        if _needs_grad(srcs):
            values = dict(zip(self._sources, srcs))
            # (a parameter read inside the graph may require grad although no argument did
            # when the region was specialised: the differentiable kernel is built now)
            if self.grad is None and self.grad_error is None:
                try:
                    self.grad = grad_kernel(self.imp, self.kernel, values)
                except GradKernelError as e:
                    self.grad_error = e
                    _warn(self.imp.nodes, e)
            if self.grad is None:
                return self._torch(srcs)
            try:
                outs = self._run_grad(srcs)
            except Exception as e:  # noqa: BLE001 - a kernel that fails must not break the model
                _warn(self.imp.nodes, f"its differentiable kernel failed at run time and is disabled "
                                      f"({type(e).__name__}: {e})")
                self.grad, self.grad_error = None, e
                return self._torch(srcs)
            self.calls["grad"] += 1
            return self._torch_outputs(outs, "grad")
        try:
            outs = self._run_plain(srcs)
        except Exception as e:  # noqa: BLE001 - a kernel that fails must not break the model
            _warn(self.imp.nodes, f"its kernel failed at run time and is disabled ({type(e).__name__}: {e})")
            self.kernel, self.kernel_error = None, f"{type(e).__name__}: {_first(e)}"
            return self._torch(srcs)
        self.calls["kernel"] += 1
        return self._torch_outputs(outs, "kernel")

    def extra_repr(self):
        return repr(self.program)


def _one_module_kernels() -> tuple:
    from acefuse.codegen.compile import Kernel
    from acefuse.frontend.kernels import _Loaded
    return Kernel, _Loaded


_ONE_MODULE = _one_module_kernels()


def _interpreted(run):
    """A launcher called under Triton's CPU interpreter, which evaluates masked lanes too
    (codegen.compile.run_module's floating-point error state)."""
    import numpy as np

    def call(**kw):
        with np.errstate(all="ignore"):
            return run(**kw)
    return call


def grad_plan(imp, dk, values: dict, parts=None):
    """``Imported.grad_plan`` ``(chains, out_dtypes)`` for a call of the differentiable kernel
    ``dk``, or None (the widening path) unless ``dk`` keeps its saved values wide and writes its
    outputs in the types asked for: its augmented forward kernel takes ``out_dtypes`` (a row's
    max, sum or inverse deviation saved in bfloat16 would lose precision in the backward; a
    cross-entropy's loss written in its logits' bfloat16 would lose it in the forward).
    ``parts``: ``(augmented kernel, backward program)`` instead of ``dk``'s."""
    try:
        from acefuse.autograd import takes_out_dtypes
        aug, bwd = parts if parts is not None else dk._grad_kernels()
    except Exception:  # noqa: BLE001 - the widening path reports its own errors
        return None
    if bwd is None or not takes_out_dtypes(aug):
        return None
    return imp.grad_plan(values, getattr(aug.module, "STORE_DTYPES", None) or {})


def grad_kernel(imp, kernel, values: dict):
    """The differentiable kernel of region ``imp`` for these source values (``values``: source
    node -> tensor): its backward derives the gradients of the inputs that require grad, and
    where ``grad_plan`` reads a float16/bfloat16 input in its own type, writes that input's
    gradient in that type too (``kernels.narrowed``: a bfloat16 cross-entropy's logit gradient
    is rounded in the kernel, no float32 copy as large as the logits). The plan is worked out
    from the backward program and the augmented forward kernel (``kernels.grad_parts``), so only
    the backward that runs has its stages compiled. When the narrowed backward does not compile,
    the one writing float32 gradients (torch rounds them) runs: same values."""
    from acefuse.frontend.kernels import grad_parts
    wrt = requires_grad_inputs(imp, values)
    try:
        narrow = _narrow_grads(imp, grad_plan(imp, None, values, grad_parts(imp.program, kernel, wrt)), values, wrt)
    except Exception:  # noqa: BLE001 - get_grad_kernel reports why there is no backward
        narrow = {}
    if narrow:
        try:
            return get_grad_kernel(imp.program, kernel, wrt, narrow)
        except GradKernelError:
            pass
    return get_grad_kernel(imp.program, kernel, wrt)


def _narrow_grads(imp, plan, values: dict, wrt) -> dict:
    """{input: "bfloat16" or "float16"}: the inputs requiring grad that ``plan`` (``grad_plan``'s)
    reads in that type (empty on the widening path)."""
    if plan is None:
        return {}
    out = {}
    for s in imp.inputs:
        t = values.get(s.src)
        if s.name not in wrt or not isinstance(t, torch.Tensor):
            continue
        d = t.dtype
        for step in plan[0][s.name]:
            if step[0] == "to":
                d = step[1]
        if d in (torch.bfloat16, torch.float16):
            out[s.name] = str(d).removeprefix("torch.")
    return out


def requires_grad_inputs(imp, values: dict) -> list:
    """The region program's inputs whose torch values (``values``: source node -> tensor)
    require grad: the gradients its backward derives (a later call that asks for others gets
    a kernel for those: acefuse.autograd.DifferentiableKernel._for)."""
    out = []
    for s in imp.inputs:
        v = values.get(s.src)
        if isinstance(v, torch.Tensor) and v.requires_grad and s.name not in out:
            out.append(s.name)
    return out


def _needs_grad(values) -> bool:
    return torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _region_name(nodes) -> str:
    for n in nodes:
        if kind_of(n) in ("reduce", "contraction"):
            return name_of(n)
    return "region"


def _reject_dtype(imp) -> str | None:
    for s in imp.inputs:
        v = s.src.meta.get("af_val")
        if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
            return "float64 input (acefuse kernels take float32/float16/bfloat16)"
    for o in imp.outputs:
        if o.dtype == torch.float64:
            return "float64 output (acefuse kernels take float32/float16/bfloat16)"
    return None


def _warn(nodes, why, seen=None):
    """One warning line: the region, its source line, and why it runs in torch (once per
    region and reason within ``seen``: a specialisation retries regions)."""
    anchor = next((n for n in nodes if kind_of(n) in ("reduce", "contraction")), nodes[0])
    where = source_line(anchor)
    first = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
    msg = f"acefuse: region `{_region_name(nodes)}`{' at ' + where if where else ''} runs in torch: {first}"
    if seen is not None:
        if msg in seen:
            return
        seen.add(msg)
    stats["fallbacks"] += 1
    warnings.warn(msg, AcefuseFallbackWarning, stacklevel=3)


# What a region is, for ``Backend(take=...)``: by the first of its ops that names a kind
KINDS = ("attention", "loss", "softmax", "norm")
_KIND_OPS = {"attention": {"scaled_dot_product_attention"}, "loss": {"cross_entropy"},
             "softmax": {"softmax", "log_softmax", "logsumexp"}}


def reduction_kind(n) -> str | None:
    """What a reduction-like node is, for ``Backend(take=...)``: ``attention`` (an SDPA), ``loss``
    (cross-entropy), ``softmax`` (softmax, log_softmax, logsumexp: matmul attention's masked
    softmax too), ``norm`` (layer_norm, rms_norm, and every other reduction: HF's RMSNorm is
    ``pow().mean()``); None for other nodes (matmuls stay torch's anyway)."""
    k = kind_of(n) if n.op in ("call_function", "call_method") else None
    if k not in ("reduce", "contraction"):
        return None
    nm = name_of(n)
    for kind in ("attention", "loss", "softmax"):
        if nm in _KIND_OPS[kind]:
            return kind
    return "norm" if k == "reduce" else None


def specialize(gm: torch.fx.GraphModule, args, name="fn", take=None, timed=False):
    """Partition ``gm`` for these concrete arguments and compile each region. The result
    carries ``af_regions`` (the compiled regions) and ``af_report`` (report entries).
    ``take``: the region kinds acefuse takes (``KINDS``; None: all); the others stay torch ops
    (with Inductor: Inductor's), reported as left for that reason. ``timed``: a region that is one
    call of a torch library op (SDPA) is kept only where acefuse's kernel is measured faster on
    this GPU (acefuse.frontend.timed; nothing is timed on the CPU)."""
    stats["specializations"] += 1
    gm = _copy_gm(gm)
    gm._af_name = name
    propagate(gm, args)
    split_composites(gm)
    unshare_contraction_operands(gm)
    propagate(gm, args)
    reasons: dict = {}        # node -> why torch computes it (for the report)
    warned: set = set()
    exclude: set = set()
    if take is not None:    # reductions of the kinds not taken stay torch ops; regions form around them
        for n in gm.graph.nodes:
            rk = reduction_kind(n)
            if rk is not None and rk not in take:
                exclude.add(n)
                reasons.setdefault(n, f"not taken: a {rk}, and the backend takes {', '.join(sorted(take)) or 'none'} "
                                      "(Backend(take=...))")
    exclude = split_unsupported(gm, exclude, reasons, warned)
    operands_cut: set = set()
    warned_contr: set = set()
    for attempt in range(4):
        compiled, failed_contraction = [], False
        work = find_regions(gm, frozenset(exclude))
        i = -1
        while work:
            nodes, i = work.pop(0), i + 1
            outs = region_outputs(gm, nodes)
            if not outs:
                _left(reasons, nodes, "its result is not used")
                continue
            rname = f"{name}_{_region_name(nodes)}"
            try:
                try:
                    res = _compile_region(nodes, outs, rname)
                except GradKernelError:
                    raise
                except Exception as e:  # noqa: BLE001 - several outputs: retry with the last one
                    pieces, why = _axis_split(nodes, outs)
                    if pieces:         # reductions over different axes: one region per axis
                        work[:0] = pieces
                        continue
                    if why:
                        raise FrontendError(why) from e
                    if len(outs) < 2 or [n for n in nodes if kind_of(n) == "contraction"]:
                        raise
                    nodes, cut = _cut_to_last_output(gm, nodes)
                    res = _compile_region(nodes, region_outputs(gm, nodes), rname)
                    _left(reasons, cut, "the kernel of its region with all outputs failed "
                                        f"({_first(e)}); the region was cut to its last output")
            except Exception as e:  # noqa: BLE001 - any failure means: this region runs in torch
                contr = [n for n in nodes if kind_of(n) == "contraction"]
                grad = isinstance(e, GradKernelError)
                computed = _computed_operands(contr, nodes) if not grad else []
                if computed and not set(contr) <= operands_cut and attempt < 3:
                    # operands computed inside the region (RoPE before attention): torch computes
                    # them first and the contraction reads them as inputs
                    operands_cut |= set(contr)
                    exclude |= set(computed)
                    failed_contraction = True
                    continue
                if contr and (grad or not isinstance(e, FrontendError)) and attempt < 3:
                    # no kernel (or, in training, no backward kernel) for the contractions:
                    # keep them in torch and fuse what remains around them (softmax between matmuls)
                    exclude |= set(contr)
                    failed_contraction = True
                    why = (f"no backward kernel for its contractions ({e.why}); in training the "
                           if grad else f"{_contraction_why(contr)} ({_first(e)}); ")
                    _left(reasons, contr, why.rstrip("; ").replace("; in training the", ""))
                    if not set(contr) <= warned_contr:    # once per contraction
                        warned_contr |= set(contr)
                        _warn(contr, why + "matmuls stay in torch, the reductions around them go to acefuse",
                              warned)
                    continue
                _left(reasons, nodes, _first(e))
                if attempt == 3 or not failed_contraction:
                    _warn(nodes, e, warned)
                continue
            imp, k, dk = res
            region = CompiledRegion(imp, k, _torch_region(gm, imp), dk)
            why = _timed_out(region, imp, timed)
            if why:
                for n in imp.nodes:
                    reasons[n] = why
                continue
            compiled.append((f"af_region{i}", region, imp))
        if not failed_contraction:
            break
    new = rebuild(gm, compiled)
    new.af_regions = [m for _, m, _ in compiled]
    in_region = {n: m for _, m, imp in compiled for n in imp.nodes}
    new.af_report = graph_entries(gm, in_region, reasons, name)
    return new


def _timed_out(region, imp, timed) -> str | None:
    """Why ``region`` is left to torch by timing (torch's library op measured faster), or None:
    it is kept (not timed: ``timed`` off, not one library call, not on a CUDA device; or acefuse's
    kernel measured faster, recorded as ``region.timing``)."""
    from acefuse.frontend import timed as timing
    if not timing.enabled(timed):
        return None
    values = {s: s.meta.get("af_val") for s in imp.sources}
    choice = timing.decide(region, imp.nodes, values, _needs_grad(values.values()))
    if choice is None:
        return None
    region.timing = choice
    return timing.reason(choice) if choice["winner"] == "torch" else None


def _axis_split(nodes, outs):
    """``(pieces, None)`` when the region's reductions run over different axes, which no one kernel
    fuses (acefuse.fuse picks one axis per program): the region cut at the first reduction over
    another axis (``partition.split_at_axis_change``), each piece compiled on its own. ``(None,
    why)`` when no such cut exists (one op reduces over several dims at once): ``why`` says so in
    torch's terms. ``(None, None)`` when the region's program has one axis to fuse."""
    from acefuse.fuse import FuseError, _pick_axis
    try:
        _pick_axis(import_nodes(nodes, outs, "probe").program, None)
        return None, None
    except FuseError:
        pass
    except Exception:  # noqa: BLE001 - the region's own compile error is reported
        return None, None
    try:
        reduced = reduced_dims(nodes)
    except Exception:  # noqa: BLE001
        return None, None
    pieces = split_at_axis_change(nodes, reduced)
    if pieces:
        return pieces, None
    n, dims = next(((n, d) for n, (_, d) in reduced.items() if len(d) > 1), (None, ()))
    what = f"`{op_name(n)}` reduces over dims {list(dims)} at once" if n is not None else \
        "its reductions run over several dims"
    return None, (f"{what} and a reduction depends on another: acefuse fuses dependent reductions along "
                  "one dim per kernel (reducing a flattened tensor, x.flatten().mean(), is one dim)")


def _computed_operands(contr, nodes) -> list:
    """The nodes inside the region that compute an operand of a contraction (through views),
    an attention mask included: a mask built in the graph from one position tensor read at
    the query and at the key positions (``pos[None, :] <= pos[:, None]``, Hugging Face's
    causal mask under tracing) ties both position axes into one, as RoPE's ``cos`` does."""
    region, out = set(nodes), []
    for c in contr:
        ops = list(c.args[:4]) + [c.kwargs[k] for k in ("query", "key", "value", "attn_mask", "input", "other")
                                  if k in c.kwargs]
        for a in ops:
            while isinstance(a, torch.fx.Node) and a in region and kind_of(a) in ("layout", "cast") and a.args:
                a = a.args[0]
            if isinstance(a, torch.fx.Node) and a in region and kind_of(a) not in ("layout", "cast", "static"):
                out.append(a)
    return out


def _contraction_why(contr) -> str:
    """Why a region's contractions have no kernel, naming them (the error that stopped the
    region follows in parentheses)."""
    ops = sorted({(n.target.__name__ if callable(n.target) else str(n.target)) for n in contr})
    return f"no kernel for {', '.join(ops)}"


def _first(e) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _left(reasons: dict, nodes, why: str):
    for n in nodes:
        reasons.setdefault(n, why)


def _copy_gm(gm):
    with warnings.catch_warnings():   # (copying a Dynamo graph's pytree spec warns in torch 2.13)
        warnings.simplefilter("ignore", FutureWarning)
        g = gm.graph.__deepcopy__() if hasattr(gm.graph, "__deepcopy__") else gm.graph
    return torch.fx.GraphModule(gm, g)


def split_unsupported(gm, exclude: set, reasons: dict, warned=None) -> set:
    """Leave to torch each op inside a region that acefuse cannot import (an unsupported use
    of a supported op: exact slicing of a computed value, a narrowing cast...), so that the
    region splits around it instead of running in torch as a whole. Returns ``exclude``."""
    for _ in range(256):
        changed = False
        for nodes in find_regions(gm, frozenset(exclude)):
            outs = region_outputs(gm, nodes)
            if not outs:
                continue
            try:
                import_nodes(nodes, outs, "probe")
            except UnsupportedOpError as e:
                bad = getattr(e, "node", None)
                if bad is not None and bad in nodes and bad not in exclude:
                    exclude.add(bad)
                    reasons.setdefault(bad, f"acefuse cannot import it ({e.detail or 'no lowering'})")
                    if is_reduction_like(bad):   # a reduction lost to torch: say so once
                        _warn([bad], f"acefuse cannot import it ({e.detail or 'no lowering'})", warned)
                    changed = True
            except Exception:  # noqa: BLE001 - reported when the region is compiled
                pass
        if not changed:
            return exclude
    return exclude


def _compile_region(nodes, outs, rname):
    imp = import_nodes(nodes, outs, rname)
    bad = _reject_dtype(imp)
    if bad:
        raise FrontendError(bad)
    k = get_kernel(imp.program)
    dk = None
    if _needs_grad(s.meta.get("af_val") for s in imp.sources):
        dk = grad_kernel(imp, k, {s: s.meta.get("af_val") for s in imp.sources})
    return imp, k, dk


def _cut_to_last_output(gm, nodes):
    """The region without the ancestors (inside it) of every output but the last one: an
    ancestor-closed cut keeps the region convex. Returns (kept nodes, cut nodes)."""
    outs = region_outputs(gm, nodes)
    cut: set = set()
    while len(outs) > 1:
        stack = [outs[0]]
        while stack:
            c = stack.pop()
            if c not in cut:
                cut.add(c)
                stack += [p for p in c.all_input_nodes if p in nodes]
        nodes = [n for n in nodes if n not in cut]
        outs = region_outputs(gm, nodes)
    return nodes, [n for n in cut]


def _torch_region(gm, imp) -> torch.fx.GraphModule:
    """The region's nodes as a GraphModule (sources in, outputs out): its torch fallback."""
    g = torch.fx.Graph()
    env = {s: g.placeholder(f"src{i}") for i, s in enumerate(imp.sources)}
    root = {}
    for n in imp.nodes:
        for a in n.all_input_nodes:
            if a not in env and a.op == "get_attr":
                t = gm
                for p in a.target.split("."):
                    t = getattr(t, p)
                root[a.target] = t
                env[a] = g.get_attr(a.target)
        # shape values computed outside the region were read as constants by the import
        env[n] = g.node_copy(n, lambda x: env[x] if x in env else x.meta.get("af_val"))
    g.output(tuple(env[o.node] for o in imp.outputs))
    return torch.fx.GraphModule(root, g, "region_fallback")


def _signature(args):
    sig = [("grad", torch.is_grad_enabled())]
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.dtype, a.device.type, a.requires_grad))
        elif isinstance(a, (int, float, bool, str, type(None))):
            sig.append(("v", a))
        else:
            sig.append(("t", type(a).__name__))
    return tuple(sig)


class CompiledFunction:
    """A torch function whose recognised regions run as acefuse kernels.

    Call it like the original; ``.graphs`` maps each shape signature seen to its
    partitioned GraphModule (``print(f.graph_for(*args).code)`` shows the regions)."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, signature=None, fn=None, inner="eager", take=None,
                 timed=False):
        self.gm, self.name, self.signature = gm, name, signature
        self.take = take          # the region kinds taken (None: all)
        self.timed = timed        # keep a library-op region only where acefuse is measured faster (GPU)
        self.fn = fn              # captured by Dynamo per call signature (af.compile)
        self.inner = inner        # "eager": torch runs the rest of the graph; "inductor": Inductor compiles it
        self.graphs: dict = {}

    def graph_for(self, *args):
        sig = _signature(args)
        g = self.graphs.get(sig)
        if g is None:
            gm = self.gm if self.fn is None else _capture(self.fn, args)
            g = specialize(gm, args, self.name, self.take, self.timed)
            if self.inner == "inductor":
                g = _InductorGraph(g, args, self.name)
            self.graphs[sig] = g
        return g

    @property
    def regions(self):
        return [r for g in self.graphs.values() for r in g.af_regions]

    def report(self) -> Report:
        """What acefuse took from this function's graphs and what it left to torch (why, where)."""
        return Report([e for g in self.graphs.values() for e in g.af_report])

    def __call__(self, *args, **kwargs):
        if self.signature is not None:
            try:   # too many, missing or unknown arguments: say so in the function's terms
                b = self.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{self.name}{self.signature}: {e}") from None
            if kwargs:
                b.apply_defaults()
                args, kwargs = tuple(b.args), {}
        return self.graph_for(*args)(*args, **kwargs)

    def __repr__(self):
        return f"<acefuse compiled {self.name!r}: {len(self.graphs)} specialization(s)>"


def _capture(fn, args) -> torch.fx.GraphModule:
    """Dynamo's graph of ``fn`` for these arguments; torch.fx symbolic tracing when Dynamo
    cannot make one graph (it then raises Dynamo's error, which says what to do)."""
    try:
        return capture(fn, args)
    except FrontendError as e:
        try:
            return trace(fn)
        except FrontendError:
            raise e from None


def _check_examples(name, sig, example_inputs):
    """The example inputs bind to the function's parameters (before Dynamo captures it: a missing
    one would otherwise surface as Dynamo's error about a graph placeholder)."""
    if sig is None:
        return
    try:
        sig.bind(*example_inputs)
    except TypeError:
        params = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        free = [p for p in params if p.kind != p.VAR_POSITIONAL]
        missing = [p.name for p in free[len(example_inputs):] if p.default is p.empty]
        if missing:
            raise TypeError(
                f"af.compile({name}, ...): {name}{sig} takes {len(free)} positional parameter(s) and "
                f"{len(example_inputs)} example input(s) were given; missing an example for "
                f"{', '.join(map(repr, missing))}. Pass one example value per parameter, in order "
                f"(af.compile({name}, {', '.join(p.name for p in free)}), tensors of the shapes and "
                "dtypes of a real call)") from None
        kwonly = [p.name for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
        if kwonly:
            raise TypeError(
                f"af.compile({name}, ...): {name}{sig} has keyword-only parameter(s) {', '.join(map(repr, kwonly))} "
                "without a default, and af.compile passes its example inputs by position; compile a wrapper "
                f"that takes them by position (af.compile(lambda *a: {name}(...), ...))") from None
        raise TypeError(
            f"af.compile({name}, ...): {len(example_inputs)} example input(s) do not match {name}{sig}; "
            "pass one example value per positional parameter, in order") from None


def compile_fn(fn, *example_inputs):
    """``af.compile(fn, *example_inputs)``: a callable with ``fn``'s signature and outputs,
    in which each recognised region runs as an acefuse kernel (specialised and compiled
    now for the example inputs; other shapes are specialised on first use)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        sig = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
    except (TypeError, ValueError):
        sig = None
    cf = CompiledFunction(None, name, sig, fn=fn)
    if example_inputs:
        _check_examples(name, sig, example_inputs)
        cf.graph_for(*example_inputs)
    try:
        import functools
        functools.update_wrapper(cf, fn.forward if isinstance(fn, torch.nn.Module) else fn, updated=())
    except (AttributeError, TypeError):
        pass
    return cf


class _InductorGraph:
    """A specialised graph whose regions are ``acefuse::region`` ops (acefuse.frontend.inductor),
    compiled by Inductor for one call signature; ``af_regions`` and ``af_report`` as
    specialize's. When Inductor cannot compile it, the same graph runs eagerly (one warning)."""

    def __init__(self, g, args, name):
        from acefuse.frontend import inductor
        self.af_regions, self.af_report = g.af_regions, g.af_report
        self.gm = inductor.op_graph(g)
        self.error = None
        try:
            self.fn = inductor.compile_inductor(self.gm, args)
        except Exception as e:  # noqa: BLE001 - the regions still run; torch runs the rest eagerly
            self.error = f"{type(e).__name__}: {_first(e)}"
            warnings.warn(f"acefuse: Inductor could not compile graph {name!r} ({self.error}); its acefuse "
                          "regions run, and torch runs the rest eagerly. af.Backend(inner='eager') "
                          "skips Inductor", AcefuseFallbackWarning, stacklevel=3)
            stats["fallbacks"] += 1
            self.fn = self.gm
        self.code = self.gm.code

    def __call__(self, *args):
        return self.fn(*args)


INNERS = ("auto", "inductor", "eager")


class Backend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=af.Backend())``.

    acefuse takes the FX subgraphs it recognises (softmax, log_softmax, logsumexp,
    layer_norm, rms_norm, cross_entropy, attention and the elementwise code around them).
    ``inner`` says what runs the rest of the graph: ``"inductor"`` (Inductor compiles and
    fuses it, each acefuse region one opaque ``acefuse::region`` op: acefuse.frontend.inductor),
    ``"eager"`` (torch runs it op by op), ``"auto"`` (the default: Inductor for graphs on a
    CUDA device, eager on the CPU, where acefuse's kernels run in Triton's interpreter and
    Inductor's C++ compilation would only add compile time). ``take``: the region kinds acefuse
    takes, from ``KINDS`` (``"attention"``, ``"loss"``, ``"softmax"``, ``"norm"``; None, the
    default: all); the others stay with torch (Inductor), reported as left. ``timed`` (default True;
    ``ACEFUSE_TIMED_REGIONS=0`` turns it off): on a CUDA device, a region whose torch code is one
    call of a fused library op (``F.scaled_dot_product_attention``) is timed on first use per shape
    class against that call, and left to torch where torch is faster (reported as left with both
    times; the choice is kept on disk by acefuse.codegen.tuning: acefuse.frontend.timed); False
    always takes acefuse's kernel. Nothing is timed on the CPU. Specialised per shape signature.
    ``report()`` lists what it took and what it left to torch, over every graph it was
    handed (``af.backend`` is a default instance shared by all its users)."""

    def __init__(self, inner: str = "auto", take=None, timed: bool = True):
        if inner not in INNERS:
            raise ValueError(f"af.Backend(inner={inner!r}): inner is one of {', '.join(map(repr, INNERS))} "
                             "(what compiles the part of the graph acefuse does not take)")
        if take is not None:
            take = frozenset([take] if isinstance(take, str) else take)
            bad = sorted(take - set(KINDS))
            if bad:
                raise ValueError(f"af.Backend(take={sorted(take)}): unknown region kinds {bad}; the kinds are "
                                 f"{', '.join(KINDS)}")
        self.inner = inner
        self.take = take
        self.timed = bool(timed)
        self.functions: list = []

    def inner_for(self, example_inputs) -> str:
        """The inner compiler for a graph with these example inputs."""
        if self.inner != "auto":
            return self.inner
        cuda = any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in example_inputs)
        return "inductor" if cuda else "eager"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        cf = CompiledFunction(gm, "dynamo", inner=self.inner_for(example_inputs), take=self.take, timed=self.timed)
        self.functions.append(cf)
        return cf

    def report(self) -> Report:
        return Report([e for cf in self.functions for g in cf.graphs.values() for e in g.af_report])

    def reset(self):
        """Forget the graphs handed so far (the report starts empty)."""
        self.functions.clear()

    def __repr__(self):
        return f"<acefuse Backend (inner={self.inner!r}, timed={self.timed}): {len(self.functions)} graph(s)>"


backend = Backend()
