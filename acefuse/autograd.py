"""Differentiable kernels: ``af.compile(prog)`` outputs carry a ``grad_fn``.

- ``BackwardKernel`` (``af.compile(af.backward(prog))``): the compiled stages of a
  backward program. Call it with the forward inputs, the saved values and the
  cotangents by name; it returns ``{grad_<input>: tensor}``, each in its input's shape
  (an output constant along an axis is expanded). Saved max/min values that are
  +-inf (fully masked rows) are read as 0, and index inputs as float32 (see
  acefuse.backward).
- ``DifferentiableKernel`` (``af.compile(prog)``): the plain forward kernel when no
  input requires grad; otherwise a ``torch.autograd.Function`` whose forward runs the
  augmented forward kernel (outputs + saved values), saves the inputs and the saved
  values, and whose backward runs the ``BackwardKernel``. Missing cotangents are
  zeros; gradients come back in each input's dtype (None for index inputs). The
  augmented forward and the backward are compiled on the first call that needs them.
  A backward stage reducing over several axes (a parameter's gradient over a batch of
  rows) is compiled over the first axis of ``stage_axes`` that compiles. A backward with
  ``create_graph=True`` (double backward) raises ``NotDifferentiableError``: the backward
  kernels are not differentiable themselves.

The torch frontend (``af.backend``, ``af.compile(fn, *inputs)``) runs each region whose
inputs require grad through a ``DifferentiableKernel`` (acefuse/frontend/runtime.py).
"""
from __future__ import annotations

import torch

RUN_KW = ("schedule", "block_j", "block_r", "nsplit", "num_warps")


def _as_dict(out, names):
    return out if isinstance(out, dict) else {names[0]: out}


def _to_axes(t: torch.Tensor, axes, target_axes, shape):
    """A tensor over ``axes`` broadcast to ``target_axes`` (a superset) of ``shape``."""
    if tuple(axes) == tuple(target_axes):
        return t
    order = [a for a in target_axes if a in axes]
    t = t.permute([list(axes).index(a) for a in order]) if t.dim() else t
    view = [t.shape[order.index(a)] if a in axes else 1 for a in target_axes]
    return t.reshape(view).expand(shape)


class BackwardKernel:
    """The compiled stages of an ``af.backward`` program."""

    def __init__(self, bwd, kernels):
        self.program = bwd
        self.kernels = kernels   # one per stage

    @property
    def fusible(self) -> bool:
        return all(k.fusible for k in self.kernels)

    @property
    def source(self) -> str:
        return "\n\n".join(f"# ---- stage {s.name} ----\n{k.source}"
                           for s, k in zip(self.program.stages, self.kernels))

    def __call__(self, *args, **inputs):
        bwd = self.program
        run_kw = {k: inputs.pop(k) for k in RUN_KW if k in inputs}
        names = list(bwd.tensors)
        if len(args) > len(names):
            raise TypeError(f"program {bwd.name!r} takes {len(names)} inputs {names}, got {len(args)} positional")
        for n, a in zip(names, args):
            if n in inputs:
                raise TypeError(f"program {bwd.name!r}: input {n!r} given both by position and by name")
            inputs[n] = a
        missing = [n for n in names if n not in inputs]
        if missing:
            raise TypeError(f"program {bwd.name!r} needs inputs {missing} (saved values come from the outputs "
                            f"of {bwd.augmented.name!r}; cotangents are named grad_<output>)")
        inputs = dict(inputs)
        for n, kind in bwd.saved_kind.items():
            if kind in ("max", "min"):   # the forward's convention: a fully masked row's max reads as 0
                v = inputs[n]
                inputs[n] = torch.where(torch.isinf(v), torch.zeros_like(v), v)
        for n in bwd.index_inputs:
            if n in inputs:
                inputs[n] = inputs[n].to(torch.float32)
        for n in bwd.cotangents:
            inputs[n] = inputs[n].contiguous()
        sizes = {}
        for n, axes in bwd.tensors.items():
            for a, s in zip(axes, inputs[n].shape):
                sizes[a] = s
        out = {}
        for stage, k in zip(bwd.stages, self.kernels):
            kin = {n: inputs[n] for n in stage.tensors}
            res = _as_dict(k(**kin, **run_kw), list(stage.outputs))
            out.update({n: v for n, v in res.items() if n in bwd.outputs})
        grads = {}
        for name, gname in bwd.grads.items():
            axes = bwd.input_axes[name]
            grads[gname] = _to_axes(out[gname], bwd.outputs[gname].axes, axes, [sizes[a] for a in axes])
        for name in bwd.zero_grads:
            axes = bwd.input_axes[name]
            ref = inputs[name] if name in inputs else None
            grads[f"grad_{name}"] = torch.zeros([sizes[a] for a in axes], dtype=ref.dtype if ref is not None
                                                else torch.float32, device=ref.device if ref is not None else None)
        return grads

    def __repr__(self):
        return f"<acefuse backward kernel {self.program.name!r}: {len(self.kernels)} stage(s)>"


def stage_axes(stage) -> list:
    """The axes a backward stage may fuse, best first: ``[None]`` (the program's own
    choice) when it reduces over one axis; else the axis ``af.backward`` grouped the stage
    by, then the others innermost first (a parameter's gradient over a batch of rows,
    ``sum_d0(sum_d1(...))``, fuses d1 and sums the per-d0 values in a second stage)."""
    from acefuse.rewrite.encode import RED_OPS
    try:
        from acefuse.backward import _inner_axis   # how af.backward grouped the stage
    except ImportError:  # pragma: no cover - the nesting order alone
        def _inner_axis(t):
            return None
    depth: dict = {}   # reduced axis -> deepest nesting of a reduction over it

    def walk(t, d):
        if t.op in RED_OPS and t.args[0].op == "Ax":
            a = t.args[0].args[0]
            depth[a] = max(depth.get(a, 0), d)
            d += 1
        for c in t.children:
            walk(c, d)

    for e in stage.outputs.values():
        walk(e.term, 0)
    if len(depth) <= 1:
        return [None]
    out = []
    for e in stage.outputs.values():
        a = _inner_axis(e.term)
        if a is not None and a not in out:
            out.append(a)
    out += [a for a in sorted(depth, key=lambda a: -depth[a]) if a not in out]
    return out


def compile_stage(stage, compile_one=None, **kw):
    """Compile one backward stage over the first of ``stage_axes`` that compiles (the
    error of the first choice is raised when none does)."""
    if compile_one is None:
        from acefuse.codegen.compile import compile_program as compile_one
    first = None
    for a in stage_axes(stage):
        try:
            return compile_one(stage, axis=a, **kw)
        except Exception as e:  # noqa: BLE001 - another axis may compile; the first error is raised
            first = first or e
    raise first


def compile_backward(bwd, **kw) -> BackwardKernel:
    kw.pop("axis", None)
    return BackwardKernel(bwd, [compile_stage(s, **kw) for s in bwd.stages])


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dk, run_kw, names, *tensors):
        inputs = dict(zip(names, tensors))
        aug, bwd = dk._grad_kernels()
        out = _as_dict(aug(**inputs, **run_kw), list(bwd.augmented.outputs))
        saved = [out[n] for n in bwd.saved]
        ctx.dk, ctx.run_kw, ctx.names = dk, run_kw, names
        ctx.out_meta = [(out[k].shape, out[k].dtype, out[k].device) for k in dk.prog.outputs]
        ctx.save_for_backward(*tensors, *saved)
        return tuple(out[k] for k in dk.prog.outputs)

    @staticmethod
    def backward(ctx, *cots):
        dk = ctx.dk
        if torch.is_grad_enabled():   # create_graph=True: the backward kernels are not differentiable
            from acefuse.codegen.compile import NotDifferentiableError
            raise NotDifferentiableError(
                f"program {dk.prog.name!r}: higher-order gradients (backward with create_graph=True) "
                "through acefuse kernels are not supported: the backward kernels' results would have no "
                "grad_fn. Run this part in torch (outside af.compile / the acefuse backend) for "
                "double backward.")
        _, bwd = dk._grad_kernels()
        vals = ctx.saved_tensors
        n = len(ctx.names)
        inputs = dict(zip(ctx.names, vals[:n]))
        inputs.update(zip(bwd.saved, vals[n:]))
        for k, g, (shape, dtype, dev) in zip(dk.prog.outputs, cots, ctx.out_meta):
            inputs[f"grad_{k}"] = torch.zeros(shape, dtype=dtype, device=dev) if g is None else g.to(dtype)
        if not any(ctx.needs_input_grad[3 + i] for i in range(n)):
            return (None, None, None) + (None,) * n
        grads = dk._bwd_kernel(**{k: inputs[k] for k in bwd.tensors}, **ctx.run_kw)
        res = []
        for i, name in enumerate(ctx.names):
            x = vals[i]
            if not ctx.needs_input_grad[3 + i] or not x.dtype.is_floating_point or f"grad_{name}" not in grads:
                res.append(None)
            else:
                res.append(grads[f"grad_{name}"].to(x.dtype))
        return (None, None, None) + tuple(res)


class DifferentiableKernel:
    """``af.compile(prog)``: the forward kernel; differentiable when an input requires grad."""

    def __init__(self, prog, kernel, compile_kw):
        self.prog = prog
        self.kernel = kernel
        self._kw = compile_kw
        self._aug = self._bwd = self._bwd_kernel = None

    def __getattr__(self, name):   # source, fusion, path, module, fusible ... of the forward kernel
        if name in ("kernel", "prog", "_kw", "_aug", "_bwd", "_bwd_kernel"):
            raise AttributeError(name)
        return getattr(self.kernel, name)

    @property
    def backward_program(self):
        if self._bwd is None:
            from acefuse.backward import backward
            self._bwd = backward(self.prog)
        return self._bwd

    def _grad_kernels(self):
        if self._aug is None:
            from acefuse.codegen.compile import compile_program
            bwd = self.backward_program
            kw = {k: v for k, v in self._kw.items() if k != "axis"}
            self._bwd_kernel = compile_backward(bwd, **kw)
            self._aug = self.kernel if bwd.augmented is self.prog else compile_program(
                bwd.augmented, axis=self._kw.get("axis"), **kw)
        return self._aug, self._bwd

    def __call__(self, *args, **inputs):
        names = list(self.prog.tensors)
        needs = torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in list(args) + list(inputs.values()))
        if not needs:
            return self.kernel(*args, **inputs)
        run_kw = {k: inputs.pop(k) for k in RUN_KW if k in inputs}
        if len(args) > len(names):
            raise TypeError(f"program {self.prog.name!r} takes {len(names)} inputs {names}, got {len(args)} positional")
        for n, a in zip(names, args):
            if n in inputs:
                raise TypeError(f"program {self.prog.name!r}: input {n!r} given both by position and by name")
            inputs[n] = a
        missing = [n for n in names if n not in inputs]
        extra = [n for n in inputs if n not in names]
        if missing or extra:
            raise TypeError(f"program {self.prog.name!r} needs inputs {names}"
                            + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else ""))
        self._grad_kernels()
        outs = _Function.apply(self, run_kw, names, *[inputs[n] for n in names])
        keys = list(self.prog.outputs)
        return outs[0] if len(keys) == 1 else dict(zip(keys, outs))

    def __repr__(self):
        return f"<acefuse differentiable kernel {self.prog.name!r} ({self.kernel!r})>"


class StagedFusion:
    """``af.fuse(af.backward(prog))``: one Fusion per stage of the backward program."""

    def __init__(self, bwd, fusions):
        self.program = bwd
        self.stages = fusions

    @property
    def fusible(self) -> bool:
        return all(f.fusible for f in self.stages)

    @property
    def reason(self) -> str:
        return "; ".join(f"stage {f.program.name}: {f.reason}" for f in self.stages if not f.fusible)

    @property
    def hbm_passes(self) -> dict:
        return {f.program.name: f.hbm_passes for f in self.stages}

    def explain(self, chains: bool = True, timings: bool = False) -> str:
        bwd = self.program
        L = [f"backward program {bwd.name!r} of {bwd.forward.name!r}: "
             + ("fusible" if self.fusible else "NOT fully fusible") + f" ({len(self.stages)} stage(s))",
             "  saved by the forward ({}): {}".format(bwd.augmented.name, "; ".join(
                 f"{n} = {bwd.augmented.outputs[n]}" for n in bwd.saved) or "nothing"),
             "  cotangents: " + ", ".join(bwd.cotangents),
             "derived gradients:"]
        for k, e in bwd.outputs.items():
            L.append(f"  {k} = {e}")
        if bwd.zero_grads:
            L.append("  zero (no output depends on them): " + ", ".join(bwd.zero_grads))
        for f in self.stages:
            L.append("")
            L.append(f"== stage {f.program.name} ==")
            L.append(f.explain(chains=chains, timings=timings))
        return "\n".join(L)

    def to_json(self) -> dict:
        return {"program": self.program.name, "fusible": self.fusible,
                "saved": {n: " ".join(a) for n, a in self.program.saved.items()},
                "stages": [f.to_json() for f in self.stages]}
