"""Importing an FX graph (or a region of one) as an acefuse program, with the adapters
that turn torch arguments into program inputs and kernel outputs back into torch layout."""
from __future__ import annotations

import inspect
import re

import torch
import torch.fx

import acefuse.lang as L
from acefuse.frontend import ir
from acefuse.frontend.errors import FrontendError, UnsupportedOpError
from acefuse.frontend.graph import op_name, propagate, source_line, trace
from acefuse.frontend.lower import TV, Ctx, lower_node, _ROUNDING, _rounds_in_kernel
from acefuse.frontend.ir import un

_IDENT = re.compile(r"[^A-Za-z0-9_]")


def _ident(s: str) -> str:
    s = _IDENT.sub("_", s).strip("_") or "t"
    return s if not s[0].isdigit() else "t" + s


def apply_chain(t: torch.Tensor, chain) -> torch.Tensor:
    """Re-apply the view ops recorded on an input (all views except repeat_interleave/to)."""
    for step in chain:
        k = step[0]
        if k == "permute":
            t = t.permute(step[1])
        elif k == "reshape":
            t = t.reshape(step[1])
        elif k == "narrow":
            t = t.narrow(step[1], step[2], step[3])
            if step[4]:
                t = t.squeeze(step[1])
        elif k == "repeat_interleave":
            t = t.repeat_interleave(step[1], dim=step[2])
        elif k == "to":
            t = t.to(step[1])
        elif k == "index":
            from acefuse.frontend.lower_layout import index_of
            t = t[index_of(step[1])]
        else:
            raise FrontendError(f"internal: unknown view step {step}")
    return t


class InputSpec:
    """A program input: ``name`` reads ``src`` (an FX node) through ``chain``, drops its
    dims of size 1, and is converted for its ``role`` (float data or gather index)."""

    def __init__(self, name, src, chain, role, extra):
        self.name, self.src, self.chain, self.role, self.extra = name, src, chain, role, extra

    def step_dtype(self, dtype):
        """The dtype of the input after its view chain (a recorded cast changes it)."""
        for step in self.chain:
            if step[0] == "to":
                dtype = step[1]
        return dtype

    def direct_chain(self, dtype) -> tuple:
        """The view chain without its float-widening casts (``x.to(torch.float32)`` of a bfloat16
        ``x``): a kernel reads the narrower type and widens each element on load, exactly, so
        the widened copy is never made. ``dtype``: the source tensor's."""
        out = []
        for step in self.chain:
            if step[0] == "to":
                new = step[1]
                if dtype.is_floating_point and new.is_floating_point and \
                        torch.finfo(new).bits > torch.finfo(dtype).bits:
                    continue
                dtype = new
            out.append(step)
        return tuple(out)

    def make(self, t: torch.Tensor, fdtype, chain=None) -> torch.Tensor:
        """The program input from the source tensor ``t``: the chain replayed, dims of size 1
        dropped, converted for its role. ``fdtype``: the kernel's float type, or None to keep a
        float input in its own type (the kernel widens it on load); ``chain``: the chain to
        replay (``direct_chain``'s) instead of the recorded one."""
        t = apply_chain(t, self.chain if chain is None else chain)
        t = t[tuple(0 if s == 1 else slice(None) for s in t.shape)] if 1 in t.shape else t
        if self.role == "index":
            if self.extra and self.extra[0] == "clamp":
                t = t.clamp(0, self.extra[1] - 1)
            return t if t.dtype in (torch.int32, torch.int64) else t.long()
        if self.extra and self.extra[0] == "ne":
            return (t != self.extra[1]).to(fdtype or torch.float32)
        if fdtype is None:     # read as it is (an integer or bool value becomes a float32 one)
            return t if t.dtype.is_floating_point else t.to(torch.float32)
        if t.dtype != fdtype:   # (a narrower float input is widened exactly, as torch promotes it)
            t = t.to(fdtype)
        return t


    def adapter(self, t: torch.Tensor, fdtype, chain=None):
        """``make`` for source tensors of ``t``'s shape and dtype, worked out once: a function
        that runs only the steps such a tensor needs (the chain, the size-1 dims dropped, the
        conversion), or None where ``make`` returns its argument unchanged. A caller keeps it
        for as long as the shapes and dtypes are those of ``t`` (one call signature)."""
        chain = tuple(self.chain if chain is None else chain)
        y = apply_chain(t, chain)
        drop = tuple(0 if n == 1 else slice(None) for n in y.shape) if 1 in y.shape else None
        y = y[drop] if drop is not None else y
        conv = None       # (what make() does after the view chain, for y's dtype)
        if self.role == "index":
            lo_hi = (0, self.extra[1] - 1) if self.extra and self.extra[0] == "clamp" else None
            to_long = y.dtype not in (torch.int32, torch.int64)
            if lo_hi is not None or to_long:
                def conv(x):
                    x = x.clamp(*lo_hi) if lo_hi is not None else x
                    return x.long() if to_long else x
        elif self.extra and self.extra[0] == "ne":
            value, dt = self.extra[1], fdtype or torch.float32

            def conv(x):
                return (x != value).to(dt)
        else:
            dt = (None if y.dtype.is_floating_point else torch.float32) if fdtype is None else \
                (fdtype if y.dtype != fdtype else None)
            if dt is not None:
                def conv(x):
                    return x.to(dt)
        if not chain and drop is None and conv is None:
            return None

        def adapt(x):
            if chain:
                x = apply_chain(x, chain)
            if drop is not None:
                x = x[drop]
            return conv(x) if conv is not None else x
        return adapt


class OutputSpec:
    """A program output and how to put it back in torch layout."""

    def __init__(self, name, node, dim_names, shape, dtype, expr_axes, stride=None):
        self.name, self.node = name, node
        self.dim_names, self.shape, self.dtype, self.expr_axes = dim_names, shape, dtype, expr_axes
        self.stride = stride      # torch's strides for this value (None: any layout)
        self._steps = None        # (permutation or None, view shape, expand?): fixed once expr_axes is

    def _layout(self):
        present = [n for n in self.dim_names if n is not None and n in self.expr_axes]
        perm = [self.expr_axes.index(n) for n in present] if list(self.expr_axes) != present else None
        view = tuple(s if (n is not None and n in self.expr_axes) else 1
                     for n, s in zip(self.dim_names, self.shape))
        self._steps = (perm, view, view != tuple(self.shape))
        return self._steps

    def adapter(self, t: torch.Tensor):
        """``to_torch`` for kernel outputs of ``t``'s shape, dtype and strides, worked out once:
        a function that runs only the steps such an output needs. It checks the kernel output's
        shape, dtype and strides first and takes ``to_torch`` for any other."""
        perm, view, expand = self._steps or self._layout()
        y = t.permute(perm) if perm is not None else t
        reshape = y.shape != view
        y = y.reshape(view) if reshape else y
        y = y.expand(self.shape).contiguous() if expand else y
        cast = self.dtype if y.dtype != self.dtype else None
        y = y.to(cast) if cast is not None else y
        restride = self.stride is not None and y.stride() != self.stride and y.numel() > 1
        sig = (t.shape, t.dtype, t.stride())
        shape, stride = self.shape, self.stride

        def adapt(x):
            if (x.shape, x.dtype, x.stride()) != sig:
                return self.to_torch(x)
            x = x.permute(perm) if perm is not None else x
            x = x.reshape(view) if reshape else x
            x = x.expand(shape).contiguous() if expand else x
            x = x.to(cast) if cast is not None else x
            if restride:
                x = torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device).copy_(x)
            return x
        return adapt

    def to_torch(self, t: torch.Tensor) -> torch.Tensor:
        perm, view, expand = self._steps or self._layout()   # (worked out once: the program fixes them)
        if perm is not None:
            t = t.permute(perm)
        if t.shape != view:
            t = t.reshape(view)
        if expand:
            t = t.expand(self.shape).contiguous()
        t = t.to(self.dtype) if t.dtype != self.dtype else t
        if self.stride is not None and t.stride() != self.stride and t.numel() > 1:
            # the layout torch gives (x.transpose(1, 2).contiguous() is contiguous: a later
            # .view() relies on it), not the kernel's axis order
            out = torch.empty_strided(self.shape, self.stride, dtype=t.dtype, device=t.device)
            t = out.copy_(t)
        return t


def _dense_stride(m):
    """torch's strides for an output when they describe a dense layout (else None)."""
    if not isinstance(m, torch.Tensor) or m.dim() == 0:
        return None
    try:
        st = tuple(int(x) for x in m.stride())
    except Exception:  # noqa: BLE001 - a value without strides
        return None
    expect = 1
    for i in sorted((i for i in range(m.dim()) if m.shape[i] != 1), key=lambda i: st[i]):
        if st[i] != expect:
            return None
        expect *= int(m.shape[i])
    return st


class Imported:
    """An acefuse program made from torch code, with its input and output adapters."""

    def __init__(self, program, inputs, outputs, nodes):
        self.program: L.Program = program
        self.inputs: list = inputs        # InputSpec
        self.outputs: list = outputs      # OutputSpec, in the order torch returns them
        self.nodes = nodes                # the FX nodes it replaces
        self.labels: dict = {}            # program input name -> the torch value it reads (FX node name)

    @property
    def sources(self) -> list:
        out = []
        for s in self.inputs:
            if s.src not in out:
                out.append(s.src)
        return out

    def compute_dtype(self, values: dict):
        """The dtype the kernel reads and writes: the widest float type among the outputs and
        the float inputs (float32 when float16 meets bfloat16). Kernels compute in float32 and
        round each output once; torch's type promotion would widen every narrower input to
        this type, so widening them first is exact (``F.softmax(x16, -1, dtype=torch.float32)``
        reads x in float32 and writes float32, as eager does)."""
        fl = [o.dtype for o in self.outputs if o.dtype.is_floating_point]
        for s in self.inputs:
            t = values[s.src]
            if s.role == "float" and not (s.extra and s.extra[0] == "ne") and isinstance(t, torch.Tensor) \
                    and t.dtype.is_floating_point:
                fl.append(s.step_dtype(t.dtype))
        fl = set(fl)
        if not fl:
            return torch.float32
        if {torch.float16, torch.bfloat16} <= fl:   # neither holds the other
            fl.add(torch.float32)
        return max(fl, key=lambda d: torch.finfo(d).bits)

    def program_inputs(self, values: dict, fd=None, chains=None) -> dict:
        """Program inputs by name, from the torch values of the source nodes (``fd``: the
        compute dtype when the caller knows it: fixed per call signature). ``chains``
        (``direct_plan``'s): float inputs are read in their own types through these chains."""
        if chains is not None:
            return {s.name: s.make(values[s.src], None, chains[s.name]) for s in self.inputs}
        if fd is None:
            fd = self.compute_dtype(values)
        return {s.name: s.make(values[s.src], fd) for s in self.inputs}

    def direct_plan(self, values: dict, kernel, fd):
        """How a call of ``kernel`` reads its inputs in their own types and writes each output in
        eager's type: ``(chains, out_dtypes)`` (``chains``: each input's view chain without its
        widening casts; ``out_dtypes``: the launcher's option), or None where the call takes the
        widening path (``compute_dtype``): a region with a contraction (the attention kernels
        pick their dot operands' type from their inputs'), a launcher without ``out_dtypes``.

        Exactness: widening a float16/bfloat16 value to float32 is exact wherever it happens,
        and the kernels compute in float32 and round each output once, so reading the narrower
        input changes no result. An output is written in its own type when the kernel rounds
        to it as torch's ``.to()`` does: on the GPU (Triton's stores round to nearest even), or
        when the program rounds it itself (an output that ends with a cast); otherwise (Triton's
        CPU interpreter truncates) an output narrower than ``fd`` is written in ``fd`` and torch
        rounds it, as before. Integer and bool outputs are written in float32 (exact)."""
        from acefuse.frontend.lower import kind_of
        if any(kind_of(n) == "contraction" for n in self.nodes):
            return None
        mod = getattr(kernel, "module", None)
        run = getattr(mod, "run", None)
        try:
            if run is None or "out_dtypes" not in inspect.signature(run).parameters:
                return None
        except (TypeError, ValueError):
            return None
        chains, cuda = {}, False
        for s in self.inputs:
            t = values[s.src]
            if not isinstance(t, torch.Tensor):
                return None
            cuda = cuda or t.device.type == "cuda"
            chains[s.name] = s.direct_chain(t.dtype)
        store = getattr(mod, "STORE_DTYPES", None) or {}
        odt = {}
        for o in self.outputs:
            d = o.dtype
            if o.name in store:          # written in its cast's type by the kernel
                continue
            if not d.is_floating_point:
                odt[o.name] = torch.float32
            elif cuda or torch.finfo(d).bits >= torch.finfo(fd).bits:
                odt[o.name] = d
            else:
                odt[o.name] = fd
        return chains, odt

    def grad_plan(self, values: dict, store=()):
        """How a differentiable call (training) reads its inputs in their own types and writes each
        output in eager's: ``(chains, out_dtypes)`` (``chains``: each input's view chain without its
        widening casts, ``InputSpec.direct_chain``; ``out_dtypes``: the differentiable kernel's
        option, acefuse.autograd), or None where the call takes the widening path
        (``compute_dtype``). Direct only when it changes no value and no type: a region without
        contractions that widens some float input (``x.to(float32)`` of a bfloat16 value: HF's
        RMSNorm, or the logits of a cross-entropy) and whose outputs are each one of

        - an integer or bool output, or one as wide as the compute dtype: written in float32, the
          type the widening path wrote it in (the output adapter converts an integer one, exactly);
        - a float16/bfloat16 output, when every float input is read in that type: there every such
          output the region computes ends with the program's own rounding (``af.cast``), so the
          kernel writes it exactly on the GPU and in Triton's interpreter alike.

        ``store``: outputs the kernel writes in their cast's type anyway (its ``STORE_DTYPES``).
        Index inputs, masks made from integers (``y != ignore_index``) and integer values read as
        floats are made as before (float32, exact). The float32 copy of every widened input (saved
        for the backward too) and the float32 outputs narrowed by torch are not made; gradients
        come back in each input's type, saved values wide."""
        from acefuse.frontend.lower import kind_of
        if any(kind_of(n) == "contraction" for n in self.nodes):
            return None
        fd = self.compute_dtype(values)
        chains, types, narrow = {}, set(), False
        for s in self.inputs:
            t = values.get(s.src)
            if not isinstance(t, torch.Tensor):
                return None
            chain = s.direct_chain(t.dtype)
            chains[s.name] = chain
            if s.role == "index" or (s.extra and s.extra[0] == "ne"):
                continue
            d = t.dtype
            for step in chain:
                if step[0] == "to":
                    d = step[1]
            if not d.is_floating_point:
                continue          # (an integer value read as a float: float32, as the widening path does)
            types.add(d)
            narrow = narrow or torch.finfo(d).bits < torch.finfo(fd).bits
        if not narrow:
            return None           # nothing is widened anyway
        odt = {}
        for o in self.outputs:
            d = o.dtype
            if o.name in store:
                continue
            if not d.is_floating_point or torch.finfo(d).bits >= torch.finfo(fd).bits:
                odt[o.name] = torch.float32 if not d.is_floating_point else d
            elif types == {d}:
                odt[o.name] = d
            else:
                return None
        return chains, odt

    def torch_outputs(self, outs) -> list:
        if not isinstance(outs, dict):
            outs = {self.outputs[0].name: outs}
        return [o.to_torch(torch.as_tensor(outs[o.name])) for o in self.outputs]

    def reference(self, values: dict) -> list:
        """Evaluate the program with acefuse's float64 reference (acefuse/reference.py)."""
        from acefuse.reference import evaluate
        ins = {k: (v.double() if v.dtype.is_floating_point else v)
               for k, v in self.program_inputs(values).items()}
        res = evaluate(self.program, ins)
        return [o.to_torch(torch.from_numpy(res[o.name])).double() for o in self.outputs]

    def __repr__(self):
        ins = [s.name if self.labels.get(s.name, s.name) == s.name else f"{s.name}={self.labels[s.name]}"
               for s in self.inputs]
        return f"Imported({self.program!r}; inputs {ins})"


def import_nodes(nodes, outputs, name: str, full: bool = False) -> Imported:
    """Lower ``nodes`` (topological order) to one program whose outputs are ``outputs``. A
    region's inputs (``full=False``) are named ``x0, x1, ...`` in the order its ops read them
    (``Imported.labels`` maps each to the torch value it reads), so regions that differ only in
    the values they read (every layer's) are one program; a whole function's (``full=True``) are
    named after its values."""
    region = set(nodes)
    cx = Ctx(region, full)
    for n in nodes:
        cx.vals[n] = lower_node(cx, n)
    outs = []
    for o in outputs:
        v = cx.vals[o] if o in cx.vals else cx.val(o)
        if not isinstance(v, TV):
            raise UnsupportedOpError(op_name(o), source_line(o),
                                     f"it returns a {type(v).__name__}, not a tensor")
        n = cx.n(v)
        if v.meta.dtype in _ROUNDING and _rounds_in_kernel(cx, TV(n, v.dims, v.meta)):
            # a float16/bfloat16 output computed in float32 is rounded by the program itself
            # (af.cast: round to nearest even, bit-exact with torch's `.to()`), so the kernel
            # writes it in its type on the GPU and in Triton's CPU interpreter (which truncates) alike
            n = un(_ROUNDING[v.meta.dtype], n)
        outs.append((o, v, n))
    # name axes and tensors
    axes = set()
    for _, v, n in outs:
        axes |= ir.axes_of(n)
        axes |= {d.find() for d in v.dims if d is not None}
    for key, (_, _, _, lax) in cx.leaves.items():
        axes |= {a.find() for a in lax}
    names = ir.name_axes(axes)
    onames = ["out"] if len(outs) == 1 else [f"out{i}" for i in range(len(outs))]
    leaves, specs, used, labels = {}, [], set(onames), {}
    for i, (key, (leaf, role, extra, lax)) in enumerate(cx.leaves.items()):
        if not full:
            # a region's inputs are named by position (x0, x1, ... in the order the region's ops
            # read them), not after torch's values: every layer's norm, attention or loss is then
            # the same program (one Program.key()), derived, certified and compiled once
            tname = f"x{i}"
        else:
            base = _ident(leaf.src.name)
            tname = base if not (leaf.chain or extra) else f"{base}_v"
            k = 2
            while tname in used:
                tname = f"{base}_v{k}"
                k += 1
        used.add(tname)
        labels[tname] = leaf.src.name
        leaves[key] = (tname, lax)
        specs.append(InputSpec(tname, leaf.src, leaf.chain, role, extra))
    em = ir.Emitter(names, leaves)
    exprs, ospecs = {}, []
    for oname, (node, v, n) in zip(onames, outs):
        e = em(n)
        exprs[oname] = e
        ospecs.append(OutputSpec(oname, node, [names[d.find()] if d is not None else None for d in v.dims],
                                 tuple(v.shape), v.meta.dtype, list(e.axes), _dense_stride(v.meta)))
    try:
        prog = L.program(_ident(name), **exprs)
    except L.LanguageError as e:
        raise FrontendError(f"the imported program {name!r} is malformed: {e}") from e
    for o in ospecs:  # the program fixes each output's axis order (kernels write it so)
        o.expr_axes = list(prog.outputs[o.name].axes)
    imp = Imported(prog, specs, ospecs, list(nodes))
    imp.labels = labels
    return imp


def _exprs(v):
    """The expression nodes of a lowered value (a tensor, or a tuple of them: ``max(x, dim)``)."""
    if isinstance(v, TV):
        return [v.n] if v.n is not None else []
    if isinstance(v, (tuple, list)):
        return [n for x in v for n in _exprs(x)]
    return []


def reduced_dims(nodes) -> dict:
    """For each node of ``nodes`` (a region, topological order) that reduces: the axes it reduces
    over itself (not those of the values it reads), as ``(frozenset of axis keys, dims)`` where
    ``dims`` are the torch dims of its first tensor operand that those axes are. Two nodes reduce
    over the same axis when their keys are equal (broadcasting and masks unify axes)."""
    cx = Ctx(set(nodes), False)
    for n in nodes:
        cx.vals[n] = lower_node(cx, n)
    own = {}
    for n in nodes:
        seen: set = set()
        stack = [e for p in n.all_input_nodes for e in _exprs(cx.vals.get(p))]
        while stack:                      # every expression node its operands already hold
            e = stack.pop()
            if id(e) not in seen:
                seen.add(id(e))
                stack += [a for a in e.args if isinstance(a, ir.N)]
        axes, stack, mine = set(), _exprs(cx.vals[n]), set()
        while stack:
            e = stack.pop()
            if id(e) in seen or id(e) in mine:
                continue
            mine.add(id(e))
            if e.op == "red":
                axes.add(e.args[1])
            stack += [a for a in e.args if isinstance(a, ir.N)]
        if axes:
            own[n] = axes
    out = {}
    for n, axes in own.items():           # (keys only now: every unification has happened)
        roots = {a.find() for a in axes}
        x = next((cx.vals[p] for p in n.all_input_nodes if isinstance(cx.vals.get(p), TV)), None)
        dims = tuple(i for i, d in enumerate(x.dims) if d is not None and d.find() in roots) if x else ()
        out[n] = (frozenset(r.order for r in roots), dims)
    return out


def import_graph(gm: torch.fx.GraphModule, args, name=None) -> Imported:
    """Import a whole traced function (every op must have a lowering)."""
    propagate(gm, args)
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    for n in nodes:
        if n.op == "call_module":
            raise UnsupportedOpError(f"module {n.target} ({type(gm.get_submodule(n.target)).__name__})",
                                     source_line(n), "trace through it (it is not a leaf module)")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    ret = out_node.args[0]
    flat = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    for r in flat:
        if not isinstance(r, torch.fx.Node):
            raise FrontendError(f"the function returns {r!r}, which is not a tensor computed from its inputs")
    imp = import_nodes(nodes, flat, name or getattr(gm, "_af_name", "torch_fn"), full=True)
    imp.gm = gm
    imp.returns_tuple = isinstance(ret, (tuple, list))
    return imp


def from_torch_imported(fn, *example_inputs) -> Imported:
    """Trace ``fn`` with torch.fx and import it; the ``Imported`` carries the adapters."""
    for a in example_inputs:
        if not isinstance(a, torch.Tensor):
            raise FrontendError(f"af.from_torch: example inputs must be tensors, got {type(a).__name__}; "
                                "bind other arguments with functools.partial or a closure")
    gm = trace(fn)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(ph) != len(example_inputs):
        raise FrontendError(f"af.from_torch: {getattr(fn, '__name__', fn)} takes {len(ph)} tensors "
                            f"({', '.join(n.name for n in ph)}), got {len(example_inputs)} example inputs")
    return import_graph(gm, example_inputs)


def from_torch(fn, *example_inputs) -> L.Program:
    """Import a plain PyTorch function as an acefuse program.

    Inputs are named after the function's parameters (a parameter that is re-viewed,
    e.g. head-split, becomes ``<name>_v``); outputs are ``out`` (or ``out0, out1, ...``).
    ``program.frontend`` holds the adapters (``program_inputs``, ``torch_outputs``,
    ``reference``). Raises ``UnsupportedOpError`` naming the op and source line.
    """
    imp = from_torch_imported(fn, *example_inputs)
    prog = imp.program
    prog.frontend = imp
    return prog


def graph_values(imp: Imported, args) -> dict:
    """Values of the source nodes of a whole-function import, from the call's arguments."""
    gm = imp.gm
    vals = {}
    it = iter(args)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            vals[n] = next(it)
        elif n.op == "get_attr":
            t = gm
            for p in n.target.split("."):
                t = getattr(t, p)
            vals[n] = t
    return vals
