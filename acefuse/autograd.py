"""Differentiable kernels: ``af.compile(prog)`` outputs carry a ``grad_fn``.

- ``BackwardKernel`` (``af.compile(af.backward(prog))``): the compiled stages of a
  backward program. Call it with the forward inputs, the saved values and the
  cotangents by name; it returns ``{grad_<input>: tensor}``, each in its input's shape
  (an output constant along an axis is expanded). Saved max/min values are passed as
  they are (the backward's terms read a fully masked row's -inf as 0 where they subtract
  it, as the forward does: acefuse.backward_shift.guard_masked_shifts), and index inputs
  as float32. Stages run in dependency order: a pre-stage's outputs
  (``bwd.intermediates``, attention's D_i) are kept in float32 (float64 for float64
  inputs) and passed to the stages that read them, never returned.
- ``DifferentiableKernel`` (``af.compile(prog)``): the plain forward kernel when no
  input requires grad; otherwise a ``torch.autograd.Function`` whose forward runs the
  augmented forward kernel (outputs + saved values), saves the inputs and the saved
  values, and whose backward runs the ``BackwardKernel``. Missing cotangents are
  zeros; gradients come back in each input's dtype (None for index inputs). The
  augmented forward and the backward are compiled on the first call that needs them.
  Only the inputs that require grad are differentiated (``af.backward(prog, wrt=...)``):
  a call whose set differs from the kernel's runs a kernel for that set (cached), so a
  mask or a constant input costs no gradient work and a later call never loses one.
  A backward stage reducing over several axes (a parameter's gradient over a batch of
  rows) is compiled over the first axis of ``stage_axes`` that compiles. A backward with
  ``create_graph=True`` (double backward) raises ``NotDifferentiableError``: the backward
  kernels are not differentiable themselves.
- Saved values (a row's max, sum, mean, rsqrt of its variance) are written in float32
  whatever the inputs' type (float64 for float64 inputs), so a float16/bfloat16 backward
  recomputes ``exp(x - m) / l`` from unrounded ``m`` and ``l`` (the launchers' ``out_dtypes``
  option; a kernel without it, a staged kernel, gives them in the input's type, widened).
  A saved forward *output* that does not range over a reduced axis (attention's ``o``, read
  back for ``sum_e(grad_o * o)``) is kept in float32 too, and handed to the caller rounded.
- No gradient is ever dropped: when ``af.backward`` cannot differentiate the program or its
  kernels do not compile (on the first call that needs them), the forward still runs the
  acefuse kernel and the backward is torch autograd of the program's torch evaluation
  (acefuse.autograd_ref: float32, float64 for float64 inputs); when a backward kernel fails
  at ``.backward()`` time, that call and every later one take the same path. Either way one
  ``GradientFallbackWarning`` per kernel names the program and why.

The torch frontend (``af.backend``, ``af.compile(fn, *inputs)``) runs each region whose
inputs require grad through a ``DifferentiableKernel`` (acefuse/frontend/runtime.py).
"""
from __future__ import annotations

import inspect
import math
import warnings

import torch

from acefuse.codegen.compile import bind_inputs
from acefuse.frontend.runtime import AcefuseFallbackWarning

RUN_KW = ("schedule", "block_i", "block_j", "block_r", "nsplit", "num_warps", "num_stages")
_CALL_KW = frozenset(RUN_KW + ("out_dtypes",))   # launch options a differentiable kernel's call takes


class GradientFallbackWarning(AcefuseFallbackWarning):
    """A program's gradient is computed by torch autograd of the program (acefuse.autograd_ref)
    because its derived backward could not be built or failed; the message says why."""


def wide_dtype(dtype) -> torch.dtype:
    """The type saved values are kept in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def takes_out_dtypes(kernel) -> bool:
    """The kernel's launcher can write chosen outputs in another type (``out_dtypes=``). A staged
    kernel passes the option to its first stage, which writes the per-row values (a saved
    logsumexp must not be rounded to bfloat16 on its way to float32)."""
    if hasattr(kernel, "stage1") and hasattr(kernel, "finish"):
        return takes_out_dtypes(kernel.stage1)
    run = getattr(getattr(kernel, "module", None), "run", None)
    try:
        return run is not None and "out_dtypes" in inspect.signature(run).parameters
    except (TypeError, ValueError):
        return False


def wide_saved(prog, bwd) -> list:
    """The saved values kept in float32: every one that does not range over an axis the
    program reduces (a row's max, sum, mean; attention's output ``o``, read back for
    ``sum_e(grad_o * o)``), i.e. all but saved outputs as large as the input."""
    reduced = set(prog.reduced_axes())
    return [n for n, axes in bwd.saved.items()
            if bwd.saved_kind.get(n) != "output" or not reduced & set(axes)]


def unit_cotangent_program(bwd):
    """(program, "") computing the forward's output and, per float input, its gradient for a
    unit cotangent (``unit_grad_<input>``) in one forward kernel; (None, why not) when that
    does not give the gradient. Reverse mode makes every gradient linear in the cotangent; when
    the program has one output ranging over no reduced axis (a loss per row) and no reduction
    over one of the output's axes encloses the cotangent, it factors out:
    ``grad_x = grad_out * unit_grad_x`` (broadcast along x's other axes). The unit gradient
    reads the forward's reductions where the backward reads saved values, so the forward's
    fusion computes it as an epilogue (cross-entropy's softmax minus one-hot, derived)."""
    from acefuse.lang import Expr, Program
    from acefuse.rewrite.terms import Term
    prog = bwd.forward
    if len(prog.outputs) != 1:
        return None, "several outputs (one unit gradient per output and input)"
    (oname, oexpr), = prog.outputs.items()
    oaxes, cot = set(oexpr.axes), f"grad_{oname}"
    if oaxes & set(prog.reduced_axes()):
        return None, f"output {oname!r} ranges over a reduced axis (its gradient is as large as the input)"
    subst = {n: (prog.outputs[n] if bwd.saved_kind.get(n) == "output" else bwd.augmented.outputs[n]).term
             for n in bwd.saved}
    # (a fully masked row's max: the backward's terms read it as 0 where they subtract it)
    subst[cot] = Term("Num", (1.0,))
    memo: dict = {}

    def sub(t):
        if t not in memo:
            if t.op == "In" and t.args[0] in subst:
                memo[t] = subst[t.args[0]]
            elif t.op in ("Sum", "RMax", "RMin") and t.args[0].op == "Ax" and t.args[0].args[0] in oaxes \
                    and any(u.op == "In" and u.args[0] == cot for u in t.args[1].walk()):
                raise ValueError(f"the cotangent {cot} is reduced over {t.args[0].args[0]!r}")
            else:
                memo[t] = Term(t.op, tuple(sub(a) if isinstance(a, Term) else a for a in t.args)) \
                    if t.children else t
        return memo[t]

    outs = {oname: oexpr}
    for name, g in bwd.grads.items():
        e = bwd.outputs[g]
        if not oaxes <= set(e.axes):
            return None, f"{g} does not range over the output's axes (a sum of cotangents over them)"
        try:
            outs[f"unit_{g}"] = Expr(sub(e.term), e.axes, dict(prog.tensors))
        except ValueError as exc:
            return None, str(exc)
    return Program(f"{prog.name}_unit", outs), ""


def _requires_grad(args, inputs) -> bool:
    """Some tensor argument requires grad (a plain loop: this runs on every call)."""
    for v in args:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return True
    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return True
    return False


def _to(t: torch.Tensor, dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


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

    def __init__(self, bwd, kernels, riders=None):
        self.program = bwd
        self.kernels = kernels   # one per stage
        # {stage: stage whose kernel computes its sums over rows in the same pass} (codegen/riders.py)
        # intermediates: values a pre-stage computes once and later stages read (acefuse.backward's
        # _hoist); kept in the wide type, passed along as inputs, never returned
        self._inter = set(getattr(bwd, "intermediates", {}))
        made = {n: i for i, st in enumerate(bwd.stages) for n in st.outputs if n in self._inter}
        needs = [{made[n] for n in st.tensors if n in made} for st in bwd.stages]
        # a rider whose host reads its values (directly or through other stages) runs apart
        riders = {b: a for b, a in dict(riders or {}).items() if b not in _upstream(a, needs)}
        self._riders = riders
        self._rider_hosts = set(self._riders.values())
        # riders on a GPU: "timed" (the first call per shape class times the host with its riders
        # against the stages apart and keeps the faster: ``ride_times``), True (always), False (never)
        self.ride_policy = "timed"
        self._ride_choice: dict = {}
        self._ride_seen: dict = {}   # (host, each input's shape, dtype, device) -> its _ride_choice key
        self._rider_plans: dict = {}   # host -> what _fold_riders needs of its riders (made once)
        self.ride_times: dict = {}   # key -> (ms with riders, ms apart)
        # hosts before their riders, every stage after the pre-stages whose values it reads
        self._order = _dependency_order(sorted(range(len(kernels)), key=lambda i: i in self._riders), needs)
        # per-call work done once: which inputs are read how, what each stage takes and gives
        self._names = list(bwd.tensors)
        self._name_set = frozenset(self._names)
        self._finish = getattr(bwd, "finish", {})   # gradient -> (tile output, axes it is summed over)
        parts = {p for p, _ in self._finish.values()}
        self._stages = [(k, tuple(st.tensors), [n for n in st.outputs if n in bwd.outputs or n in parts],
                         list(st.outputs), {n: getattr(st, "row_scatters", {}).get(n, (0, 0, st.outputs[n].axes))[2]
                                            for n in st.outputs})   # (a row scatter: its table's axes)
                        for st, k in zip(bwd.stages, kernels)]
        # per stage: its intermediate outputs, and whether its launcher writes them wide directly
        self._pre = [([n for n in st.outputs if n in self._inter], takes_out_dtypes(k))
                     for st, k in zip(bwd.stages, kernels)]

    @property
    def fusible(self) -> bool:
        return all(k.fusible for k in self.kernels)

    @property
    def source(self) -> str:
        return "\n\n".join(f"# ---- stage {s.name} ----\n{k.source}"
                           for s, k in zip(self.program.stages, self.kernels))

    def __call__(self, *args, **inputs):
        bwd = self.program
        run_kw = {k: inputs.pop(k) for k in RUN_KW if k in inputs} if inputs.keys() & RUN_KW else {}
        names = self._names
        if args or inputs.keys() != self._name_set:   # (by name, exactly the inputs: nothing to bind)
            bind_inputs(bwd.name, names, args, inputs, exact=False)
            missing = [n for n in names if n not in inputs]
            if missing:
                raise TypeError(f"program {bwd.name!r} needs inputs {missing} (saved values come from the outputs "
                                f"of {bwd.augmented.name!r}; cotangents are named grad_<output>)")
        # (``inputs`` is this call's own dict: updated in place below)
        for n in bwd.index_inputs:
            if n in inputs:
                inputs[n] = inputs[n].to(torch.float32)
        for n in bwd.cotangents:
            if n in inputs:   # (a cotangent no requested gradient reads is not an input)
                inputs[n] = inputs[n].contiguous()
        out, out_axes = {}, {}
        wide = None
        for i in self._order:
            k, tnames, keep, onames, oaxes = self._stages[i]
            if i in self._riders and all(n in out for n in keep):
                continue   # its sums over rows came with another stage's pass
            kin = {n: inputs[n] for n in tnames}
            inter, direct = self._pre[i]
            if inter:
                if wide is None:
                    wide = wide_dtype(next((inputs[n].dtype for n in names if inputs[n].dtype.is_floating_point
                                            and n not in bwd.index_inputs), torch.float32))
                if direct:
                    kin["out_dtypes"] = {n: wide for n in inter}
            if i in self._rider_hosts and "schedule" not in run_kw and self._ride(i, k, kin, inputs, run_kw):
                res = _as_dict(_run_stage(k, {**kin, "riders": True}, run_kw), onames)
                self._fold_riders(i, res, inputs, out, out_axes)
            else:
                res = _as_dict(_run_stage(k, kin, run_kw), onames)
            for n in inter:   # read by later stages as inputs (not gradients: not returned)
                inputs[n] = _to(res[n], wide)
            for n in keep:   # a stage lays its outputs out in its own axis order (its inputs' declarations)
                out[n], out_axes[n] = res[n], oaxes[n]
        for gname, (part, red) in self._finish.items():   # the second step: a sum over grid axes
            t, axes = out.pop(part), out_axes.pop(part)
            out[gname] = t.sum([axes.index(a) for a in red], dtype=torch.float32).to(t.dtype)
            out_axes[gname] = tuple(a for a in axes if a not in red)
        grads = {}
        sizes = None
        for name, gname in bwd.grads.items():
            axes = bwd.input_axes[name]
            if tuple(out_axes[gname]) == tuple(axes):
                grads[gname] = out[gname]
                continue
            if sizes is None:
                sizes = self._sizes(inputs)
            grads[gname] = _to_axes(out[gname], out_axes[gname], axes, [sizes[a] for a in axes])
        if bwd.zero_grads and sizes is None:
            sizes = self._sizes(inputs)
        for name in bwd.zero_grads:
            axes = bwd.input_axes[name]
            ref = inputs[name] if name in inputs else None
            grads[f"grad_{name}"] = torch.zeros([sizes[a] for a in axes], dtype=ref.dtype if ref is not None
                                                else torch.float32, device=ref.device if ref is not None else None)
        return grads

    def _ride(self, host, k, kin, inputs, run_kw) -> bool:
        """Whether the host stage computes its riders in this call: always off a GPU or with
        explicit launch options; on a GPU per ``ride_policy``. "timed": the first call per (host,
        device, sizes rounded up to powers of two, dtypes) runs the host with its riders and the
        host and riding stages apart (each once untimed, so that each kernel's launch
        configuration is chosen first), times both and keeps the faster."""
        dev = next((t.device for t in kin.values() if isinstance(t, torch.Tensor)), None)
        if self.ride_policy is not True and self.ride_policy != "timed":
            return False
        if dev is None or dev.type != "cuda" or run_kw or self.ride_policy is True:
            return True
        # the exact shapes seen before map to their shape class without working it out again
        sig = (host, dev, *[(t.shape, t.dtype) for t in kin.values() if isinstance(t, torch.Tensor)])
        key = self._ride_seen.get(sig)
        if key is None:
            if len(self._ride_seen) >= 512:
                self._ride_seen.clear()
            key = self._ride_seen[sig] = (host, str(dev), tuple(
                (n, tuple(1 << max(0, (int(x) - 1).bit_length()) for x in t.shape), str(t.dtype))
                for n, t in kin.items() if isinstance(t, torch.Tensor)))
        if key not in self._ride_choice:
            riding = [b for b, h in self._riders.items() if h == host]

            def together():
                _run_stage(k, {**kin, "riders": True}, run_kw)

            def apart():
                _run_stage(k, kin, run_kw)
                for b in riding:
                    kb, tn = self._stages[b][:2]
                    _run_stage(kb, {n: inputs[n] for n in tn}, run_kw)
            def time_them():
                # the best of three interleaved rounds each (one round varies by 10-40%)
                rounds = [(_time_ms(together), _time_ms(apart)) for _ in range(3)]
                t = (min(r[0] for r in rounds), min(r[1] for r in rounds))
                self.ride_times[key] = t
                return t[0] <= t[1]
            # kept across processes (codegen/tuning.py), keyed by every kernel involved's source
            from acefuse.codegen import tuning
            hashes = [tuning.source_hash(getattr(getattr(self._stages[i][0], "module", None), "__file__", None))
                      for i in [host, *riding]]
            src = None if None in hashes else "+".join(hashes)
            self._ride_choice[key] = tuning.choose(src, "ride", key[2:], dev, [True, False], time_them)
        return self._ride_choice[key]

    def _fold_riders(self, host, res, inputs, out, out_axes):
        """The partial sums the host stage's kernel wrote for its riders' outputs, folded
        over the programs (absent when the kernel ran another schedule: the rider stage
        then runs itself)."""
        from acefuse.codegen.riders import fold, finish
        plan = self._rider_plans.get(host)
        if plan is None:   # what does not depend on the call, worked out once per host stage
            # a sum-family host adds its riders' tiles into one float32 buffer each (RIDER_SCALE: the
            # constant factor left to apply); a row-family host writes per-program partials
            scale = getattr(getattr(self.kernels[host], "module", None), "RIDER_SCALE", None)
            plan = self._rider_plans[host] = []
            for i, h in self._riders.items():
                if h == host:
                    k, tnames, keep, _, oaxes = self._stages[i]
                    # the type the rider stage's own kernel writes: its first float input's
                    order = [n for n in getattr(getattr(k, "module", None), "TENSORS", tnames)
                             if n not in self.program.index_inputs]
                    plan.append((keep, oaxes, order, scale))
        for keep, oaxes, order, scale in plan:
            if not all(n in res for n in keep):
                continue
            ref = next((inputs[n] for n in order if inputs[n].dtype.is_floating_point), None)
            dt = ref.dtype if ref is not None and ref.dtype.itemsize > 1 else torch.float32
            for n in keep:
                out[n] = fold(res[n], dt) if scale is None else finish(res[n], dt, scale.get(n, 1.0))
                out_axes[n] = oaxes[n]

    def _sizes(self, inputs) -> dict:
        sizes = {}
        for n, axes in self.program.tensors.items():
            for a, s in zip(axes, inputs[n].shape):
                sizes[a] = s
        return sizes

    def __repr__(self):
        return f"<acefuse backward kernel {self.program.name!r}: {len(self.kernels)} stage(s)>"


def _upstream(i, needs) -> set:
    """The stages whose values stage ``i`` reads, directly or through others."""
    seen, stack = set(), list(needs[i])
    while stack:
        j = stack.pop()
        if j not in seen:
            seen.add(j)
            stack.extend(needs[j])
    return seen


def _dependency_order(base, needs) -> list:
    """``base`` reordered (stably) so that every stage comes after those whose values it reads."""
    order, done, pending = [], set(), list(base)
    while pending:
        i = next((i for i in pending if needs[i] <= done), None)
        if i is None:   # pragma: no cover - af.backward builds no cycle
            raise RuntimeError(f"backward stages {pending} read each other's values (a cycle)")
        pending.remove(i)
        order.append(i)
        done.add(i)
    return order


def _time_ms(fn, reps=5) -> float:
    """Milliseconds per call of ``fn`` on the GPU, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _run_stage(k, kin, run_kw):
    """One stage (or unit-gradient kernel) with the caller's launch options; a kernel that has
    no such schedule (a sum kernel runs 'loop' only; a multi-pass kernel has no 'split') runs
    with its own schedule instead."""
    try:
        return k(**kin, **run_kw)
    except ValueError as e:
        if "schedule" not in run_kw or "schedule" not in str(e):
            raise
    return k(**kin, **{o: v for o, v in run_kw.items() if o not in ("schedule", "nsplit")})


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
    # a stage of double sums with a contraction inside (grouped-query attention's dK/dV:
    # sum_i(sum_r(...))) as one sum kernel looping over both axes (codegen/sums.py), before
    # the per-axis tries (over r it would be staged through an (i, j, d) intermediate)
    from acefuse.codegen.sums import compile_two_loops
    k = compile_two_loops(stage, compile_one, **kw)
    if k is not None:
        return k
    first = None
    for a in stage_axes(stage):
        try:
            return compile_one(stage, axis=a, **kw)
        except Exception as e:  # noqa: BLE001 - another axis may compile; the first error is raised
            first = first or e
    from acefuse.codegen.emit import CodegenError
    if type(first) is CodegenError:   # say which gradients the stage computes
        raise CodegenError(f"backward stage {stage.name!r} (computing {', '.join(stage.outputs)}): {first}") from first
    raise first


def compile_backward(bwd, **kw) -> BackwardKernel:
    kw.pop("axis", None)
    kernels = [compile_stage(s, **kw) for s in bwd.stages]
    from acefuse.codegen.compile import compile_program
    from acefuse.codegen.riders import attach
    # sums over rows that ride another stage's pass (kernels compiled here: a caller's own
    # compile_one, the frontend's disk cache, keeps its stages apart)
    riders = attach(bwd.stages, kernels, kw) if kw.get("compile_one") in (None, compile_program) else {}
    return BackwardKernel(bwd, kernels, riders)


def _augmented(dk, aug, bwd, inputs, run_kw, odts):
    """(outputs, saved values) of the augmented forward kernel: the saved values that
    ``wide_values`` keeps in float32 written so (or converted), the outputs in the caller's
    types ``odts``."""
    kw = run_kw
    # the launchers' output type: the first float input's
    odt = next((t.dtype for t in inputs.values() if t.dtype.is_floating_point), torch.float32)
    wide = wide_dtype(odt)
    values, direct = dk.wide_values(aug, bwd)
    if direct and (values or odts):
        kw = dict(run_kw, out_dtypes={**odts, **dk._wide_out_dtypes(wide)} if odts else dk._wide_out_dtypes(wide))
    out = aug(**inputs, **kw)
    if not isinstance(out, dict):
        out = _as_dict(out, list(bwd.augmented.outputs))
    saved = [_to(out[n], wide) if n in values else out[n] for n in bwd.saved]
    if values:                       # the caller's type (the program's outputs only: a saved value
        # that is no output is dropped, its conversion would be a wasted launch per call)
        out = {k: (_to(v, odts.get(k, odt)) if k in values else v) for k, v in out.items()
               if k in dk.prog.outputs or k not in values}
    return out, saved


def _exact_scale(g: torch.Tensor):
    """For a 0-d cotangent: None when multiplying a gradient by it may round (it is not a
    power of two in [2^-60, 2^60]), else whether it is 1 (one sync).

    The host reads the value because the three answers run different work: nothing (1: the
    forward's unit gradient is the gradient, no pass over it), one multiplication (a power of
    two), or the derived backward kernels (another value: rounded once). A device-side choice
    would need kernels that skip on a device flag (the unit gradient scaled in place, or the
    derived backward writing into its buffer); until then this is one sync per step."""
    v = float(g)
    m, e = math.frexp(v)
    if not (m in (0.5, -0.5) and -60 <= e <= 61):
        return None
    return v == 1.0


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dk, run_kw, names, *tensors):
        inputs = dict(zip(names, tensors))
        # the caller's output types ({output: dtype}, DifferentiableKernel.__call__'s out_dtypes):
        # the kernels write those outputs in them; merged with the saved values' (kept wide)
        odts = run_kw.get("out_dtypes") or {}
        if "out_dtypes" in run_kw:
            run_kw = {k: v for k, v in run_kw.items() if k != "out_dtypes"}
        aug, bwd = dk._grad_kernels()
        keys = dk._keys
        unit = dk._unit_kernel() if bwd is not None and dk._grad_in_forward() else None
        if unit is not None:                 # the gradient for a unit cotangent, computed now
            try:
                out = _as_dict(_run_stage(unit, inputs, run_kw), list(unit.program.outputs))
                saved = [out[f"unit_{g}"] for g in bwd.grads.values()]
            except Exception as e:  # noqa: BLE001 - the derived backward kernels still run
                dk._unit, dk.unit_reason, unit = False, f"its kernel failed ({_first_line(e)})", None
        ctx.unit = unit is not None
        ctx.derived = bwd is not None and unit is None     # the derived backward kernels' saved values
        if bwd is None:                      # the backward is torch's: the plain forward kernel
            kw = dict(run_kw, out_dtypes=odts) if odts and takes_out_dtypes(dk.kernel) else run_kw
            out, saved = _as_dict(dk.kernel(**inputs, **kw), keys), []
        elif unit is None:
            out, saved = _augmented(dk, aug, bwd, inputs, run_kw, odts)
        if odts:                             # (a launcher without out_dtypes: converted here)
            out = {k: (_to(v, odts[k]) if k in odts and k in keys else v) for k, v in out.items()}
        ctx.dk, ctx.run_kw, ctx.names = dk, run_kw, names
        ctx.set_materialize_grads(False)     # an unused output's cotangent is None, not zeros
        ctx.out_meta = [(out[k].shape, out[k].dtype, out[k].device) for k in keys]
        ctx.save_for_backward(*tensors, *saved)
        return tuple(out[k] for k in keys)

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
        n = len(ctx.names)
        needs = ctx.needs_input_grad[3:]
        if not any(needs):
            return (None, None, None) + (None,) * n
        vals = ctx.saved_tensors
        inputs = dict(zip(ctx.names, vals[:n]))
        want = [name for name, need, v in zip(ctx.names, needs, vals) if need and v.dtype.is_floating_point]
        grads = None
        if ctx.unit:                         # grad_x = grad_out * unit_grad_x
            (oname, oexpr), = dk.prog.outputs.items()
            g = cots[0]
            grads = {}
            scalar = g is not None and g.dim() == 0
            exact = _exact_scale(g) if scalar else None
            if scalar and exact is not None:
                # a loss's cotangent, 1 from .backward() (the unit gradient is the gradient: no
                # pass over it) or a power of two (a product that does not round); reading it
                # costs one sync
                for x, (name, gname) in zip(vals[n:], dk._bwd.grads.items()):
                    axes, full = dk._bwd.outputs[gname].axes, dk._bwd.input_axes[name]
                    unit = _to_axes(x, axes, full, list(inputs[name].shape))
                    grads[gname] = unit if exact else unit * g.to(unit.dtype)
            elif scalar:
                # another scale: the unit gradient, already rounded to the input's type, would be
                # rounded twice; the derived backward kernels run instead, on saved values
                # recomputed by the augmented forward (one more read of the input)
                aug, bwd = dk._grad_kernels()
                _, saved = _augmented(dk, aug, bwd, inputs, ctx.run_kw, {})
                kin = dict(inputs, **dict(zip(bwd.saved, saved)))
                kin[f"grad_{oname}"] = g.to(ctx.out_meta[0][1])
                try:
                    grads = dk._bwd_kernel(**{k: kin[k] for k in bwd.tensors}, **ctx.run_kw)
                except Exception as e:  # noqa: BLE001 - a failing backward kernel must not lose the gradient
                    dk._fall_back(f"its backward kernel failed at .backward() ({_first_line(e)})")
                    grads = None
            for x, (name, gname) in zip(() if scalar else vals[n:], dk._bwd.grads.items()):
                axes = dk._bwd.outputs[gname].axes
                full = dk._bwd.input_axes[name]
                unit = _to_axes(x.to(wide_dtype(x.dtype)), axes, full, list(inputs[name].shape))
                grads[gname] = (torch.zeros_like(unit) if g is None else
                                unit * _to_axes(g.to(unit.dtype), oexpr.axes, full, list(unit.shape)))
        elif ctx.derived and dk._torch_reason is None:
            bwd = dk._bwd
            kin = dict(inputs)
            kin.update(zip(bwd.saved, vals[n:]))
            for k, g, (shape, dtype, dev) in zip(dk.prog.outputs, cots, ctx.out_meta):
                kin[f"grad_{k}"] = torch.zeros(shape, dtype=dtype, device=dev) if g is None else g.to(dtype)
            try:
                grads = dk._bwd_kernel(**{k: kin[k] for k in bwd.tensors}, **ctx.run_kw)
            except Exception as e:  # noqa: BLE001 - a failing backward kernel must not lose the gradient
                dk._fall_back(f"its backward kernel failed at .backward() ({_first_line(e)})")
        if grads is None:
            grads = dk._torch_grads(inputs, dict(zip(dk.prog.outputs, cots)), want)
        res = []
        for name, x in zip(ctx.names, vals[:n]):
            g = grads.get(f"grad_{name}") if name in want else None
            res.append(None if g is None else _to(g, x.dtype))
        return (None, None, None) + tuple(res)


class DifferentiableKernel:
    """``af.compile(prog)``: the forward kernel; differentiable when an input requires grad."""

    _OWN = ("kernel", "prog", "_kw", "_aug", "_bwd", "_bwd_kernel", "_torch_reason", "_warned", "_unit",
            "unit_reason", "grad_in_forward", "_wide", "wrt", "_compile_one", "_by_wrt", "_names", "_name_set",
            "_keys")

    def __init__(self, prog, kernel, compile_kw, wrt=None, compile_one=None):
        self.prog = prog
        self.kernel = kernel
        self._kw = compile_kw
        # per-call work done once: the inputs' names (a set: a call by name is checked in O(1)
        # against it, positional or unknown inputs go through bind_inputs) and the outputs'
        self._names = list(prog.tensors)
        self._name_set = frozenset(self._names)
        self._keys = list(prog.outputs)
        # the inputs differentiated: None = every float input; else only these (af.backward(prog, wrt)).
        # A call whose set of inputs requiring grad differs runs a kernel for that set (_for)
        self.wrt = None if wrt is None else frozenset(wrt)
        self._compile_one = compile_one   # (program, axis=..., **kw) -> kernel; default compile_program
        self._by_wrt: dict = {}
        self._aug = self._bwd = self._bwd_kernel = None
        self._torch_reason = None   # why the gradient is torch's (None: acefuse's backward kernels)
        self._warned = False
        # the forward also writes the gradient for a unit cotangent (unit_cotangent_program), in
        # the input's type; the backward returns it as is when the cotangent is 1 (a loss's
        # .backward()), else multiplies it by the cotangent. "auto" (the default): where the
        # program's only output is 0-d (a loss), so that the loss's forward and backward read the
        # input once (two passes instead of three). True: for any program that allows it (a
        # per-row loss too: the backward then reads the gradient back to multiply it); False: never
        self.grad_in_forward = "auto"
        self._unit = None           # its kernel; False when the program does not allow it
        self.unit_reason = None     # why not
        self._wide = None           # (saved values kept wide, the launcher takes out_dtypes): per kernel

    def wide_values(self, aug, bwd):
        """The saved values kept in float32 and whether ``aug`` writes them so directly;
        computed once (a walk of the program and a signature lookup: not per call)."""
        if self._wide is None or self._wide[0] is not aug:
            self._wide = (aug, wide_saved(self.prog, bwd), takes_out_dtypes(aug), {})
        return self._wide[1], self._wide[2]

    def _wide_out_dtypes(self, wide) -> dict:
        """``{saved value: wide}`` for the values ``wide_values`` keeps wide (one dict per type,
        made once; the launchers only read it)."""
        made = self._wide[3]
        if wide not in made:
            made[wide] = {n: wide for n in self._wide[1]}
        return made[wide]

    def __getattr__(self, name):   # source, fusion, path, module, fusible ... of the forward kernel
        if name in self._OWN:
            raise AttributeError(name)
        return getattr(self.kernel, name)

    @property
    def backward_program(self):
        if self._bwd is None:
            from acefuse.backward import backward
            self._bwd = backward(self.prog, wrt=None if self.wrt is None else sorted(self.wrt))
        return self._bwd

    def _for(self, requested: frozenset, floats: frozenset):
        """The differentiable kernel for a call whose inputs ``requested`` require grad: this one
        when it differentiates exactly those (or every float input, when all require grad);
        else one restricted to them (cached), so no gradient nobody asked for is built or run."""
        if requested == self.wrt or (self.wrt is None and requested >= floats):
            return self
        dk = self._by_wrt.get(requested)
        if dk is None:
            dk = self._by_wrt[requested] = DifferentiableKernel(self.prog, self.kernel, self._kw, wrt=requested,
                                                                compile_one=self._compile_one)
        dk.grad_in_forward = self.grad_in_forward
        return dk

    @property
    def grad_fallback(self):
        """Why gradients come from torch autograd of the program (None when acefuse's
        backward kernels compute them)."""
        return self._torch_reason

    def _fall_back(self, why: str) -> None:
        """From now on the backward is torch's; warn once, naming the program and why."""
        self._torch_reason = why
        if not self._warned:
            self._warned = True
            warnings.warn(f"acefuse: program {self.prog.name!r}: gradients are computed by torch autograd of "
                          f"the program (its forward still runs the acefuse kernel): {why}",
                          GradientFallbackWarning, stacklevel=4)

    def _grad_kernels(self):
        """(augmented forward kernel, backward program), compiled on first use; (the plain
        kernel, None) when the backward is torch's."""
        if self._aug is None and self._torch_reason is None:
            try:
                from acefuse.codegen.compile import compile_program
                one = self._compile_one or compile_program
                bwd = self.backward_program
                kw = {k: v for k, v in self._kw.items() if k != "axis"}
                bk = compile_backward(bwd, compile_one=one, **kw)
                self._aug = self.kernel if bwd.augmented is self.prog else one(
                    bwd.augmented, axis=self._kw.get("axis"), **kw)
                self._bwd_kernel = bk
            except Exception as e:  # noqa: BLE001 - the forward runs; the gradient is torch's
                self._fall_back(f"no backward kernels ({_first_line(e)})")
        if self._torch_reason is not None:
            return self.kernel, None
        return self._aug, self._bwd

    def _grad_in_forward(self) -> bool:
        """Whether the forward computes the gradient (``grad_in_forward``; "auto": the program's
        only output is 0-d)."""
        if self.grad_in_forward == "auto":
            outs = list(self.prog.outputs.values())
            return len(outs) == 1 and not outs[0].axes
        return bool(self.grad_in_forward)

    def _unit_kernel(self):
        """The kernel of ``unit_cotangent_program`` (compiled on first use), or None."""
        if self._unit is None:
            self._unit = False
            prog, why = unit_cotangent_program(self._bwd)
            if prog is not None:
                try:
                    from acefuse.codegen.compile import compile_program
                    self._unit = compile_program(prog, axis=self._kw.get("axis"),
                                                 **{k: v for k, v in self._kw.items() if k != "axis"})
                except Exception as e:  # noqa: BLE001 - the derived backward kernels still run
                    why = f"its kernel does not compile ({_first_line(e)})"
            self.unit_reason = why or None
        return self._unit or None

    def _torch_grads(self, inputs: dict, cots: dict, want: list) -> dict:
        """{grad_<name>: gradient} for the inputs ``want``: torch autograd of the program's
        torch evaluation (float32; float64 for float64 inputs), cotangents ``cots`` by output
        (None: zero)."""
        from acefuse.autograd_ref import evaluate
        floats = [t for t in inputs.values() if t.dtype.is_floating_point]
        cd = wide_dtype(floats[0].dtype if floats else torch.float32)
        with torch.enable_grad():
            leaves = {k: (t.detach().to(cd).requires_grad_(k in want) if t.dtype.is_floating_point else t)
                      for k, t in inputs.items()}
            wrt = [leaves[k] for k in want]
            if wrt and not (wrt[0] * 1).requires_grad:
                # autograd does not record here (inside a custom op's dispatch, below the
                # Autograd key): every gradient would come out as zeros, silently
                raise RuntimeError(f"program {self.prog.name!r}: torch's gradient of the program was asked for "
                                   "where autograd does not record (inside a custom op or under "
                                   "torch.inference_mode); call it where gradients are recorded")
            outs = evaluate(self.prog, leaves, cd)
            pairs = [(outs[k], g) for k, g in cots.items() if g is not None and outs[k].requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g.to(cd) for _, g in pairs],
                                      allow_unused=True) if pairs and wrt else [None] * len(wrt)
        return {f"grad_{k}": torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(want, got)}

    def __call__(self, *args, **inputs):
        if "process_group" in inputs or "sharded_axis" in inputs:   # sharded across ranks: acefuse/distributed.py
            from acefuse.distributed import call_sharded
            return call_sharded(self, args, inputs)
        if not (torch.is_grad_enabled() and _requires_grad(args, inputs)):
            return self.kernel(*args, **inputs)
        run_kw = {} if inputs.keys().isdisjoint(_CALL_KW) else {k: inputs.pop(k) for k in _CALL_KW if k in inputs}
        names = self._names
        if args or inputs.keys() != self._name_set:   # (by name, exactly the inputs: nothing to bind)
            bind_inputs(self.prog.name, names, args, inputs)
        tensors = [inputs[n] for n in names]
        requested = frozenset([n for n, v in zip(names, tensors) if isinstance(v, torch.Tensor) and v.requires_grad])
        if requested == self.wrt or (self.wrt is None and requested == self._name_set):
            dk = self   # (what _for gives for these: no set of float inputs to build)
        else:
            floats = frozenset(n for n, v in zip(names, tensors)
                               if isinstance(v, torch.Tensor) and v.dtype.is_floating_point)
            dk = self._for(requested, floats)
        dk._grad_kernels()
        outs = _Function.apply(dk, run_kw, names, *tensors)
        return outs[0] if len(outs) == 1 else dict(zip(self._keys, outs))

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
        from acefuse.backward_shift import derivation_text
        L.extend(derivation_text(bwd, chains=chains))
        for st, f in zip(bwd.stages, self.stages):
            L.append("")
            hoisted = getattr(st, "hoisted", None)
            L.append(f"== stage {f.program.name}" + (" (pre-stage: its outputs are read by later stages, "
                                                      "not returned)" if hoisted else "") + " ==")
            for n, why in (hoisted or {}).items():
                L.append(f"  {n} = {st.outputs[n]}: hoisted, {why}")
            L.append(f.explain(chains=chains, timings=timings))
        return "\n".join(L)

    def to_json(self) -> dict:
        return {"program": self.program.name, "fusible": self.fusible,
                "saved": {n: " ".join(a) for n, a in self.program.saved.items()},
                "stages": [f.to_json() for f in self.stages],
                "hoisted": {n: why for st in self.program.stages for n, why in getattr(st, "hoisted", {}).items()}}
