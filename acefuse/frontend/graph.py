"""Capturing a torch function as an FX graph, and propagating shapes through it.

``af.compile(fn, *examples)`` captures through Dynamo (``capture``: ``torch._dynamo.export``
with static shapes, torch-level ops, once per call signature), so it accepts what
``torch.compile`` accepts: sizes used as Python ints, buffers sliced by a size, branches on
dtypes. Dynamo and ``torch.fx.symbolic_trace`` hand over the same *torch-level* vocabulary
(``torch.softmax``, ``F.layer_norm``, ``Tensor.view``), so one op table serves
``af.from_torch`` (fx: a whole function as one program, traced through ``nn.LayerNorm``),
``af.compile`` and ``af.backend``. ``torch.export`` proper lowers to ATen (a second op
vocabulary) and is not used.
"""
from __future__ import annotations

import os
import traceback

import torch
import torch.fx

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))


class _Tracer(torch.fx.Tracer):
    """Symbolic tracer that records the user's source line on every node."""

    def __init__(self):
        super().__init__()
        self.record_stack_traces = True

    # torch.nn modules acefuse lowers: traced through (their F.* call and parameters
    # become graph nodes), where fx would keep them as opaque leaf calls
    TRACE_THROUGH = ("LayerNorm", "RMSNorm")

    def is_leaf_module(self, m, qualname) -> bool:
        if type(m).__module__.startswith("torch.nn") and type(m).__name__ in self.TRACE_THROUGH:
            return False
        return super().is_leaf_module(m, qualname)

    def _filter_traceback_frames(self, summary):
        frames = [f for f in summary if not f.filename.startswith(_TORCH_DIR)
                  and not f.filename.startswith(_HERE)]
        return traceback.StackSummary.from_list(frames[-1:])


def trace(fn) -> torch.fx.GraphModule:
    """An FX GraphModule for a function or an nn.Module (torch-level ops, stack traces kept)."""
    tracer = _Tracer()
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        graph = tracer.trace(fn)
    except Exception as e:
        from acefuse.frontend.errors import FrontendError
        if isinstance(e, FrontendError):
            raise
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_HERE)]
        where = (f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}: {frames[-1].line}"
                 if frames else "")
        first = (str(e).strip().splitlines() or [""])[0]
        raise FrontendError(
            f"{name}: torch.fx could not trace it{where} ({type(e).__name__}: {first}). Symbolic tracing "
            "runs the function on proxies: sizes are not Python ints and tensor values cannot steer "
            "Python control flow. Compute such values outside the traced code (a buffer, a constant), "
            "or use torch.compile(fn, backend=af.backend), which handles them") from e
    root = fn if isinstance(fn, torch.nn.Module) else torch.nn.Module()
    gm = torch.fx.GraphModule(root, graph, name)
    gm._af_name = name
    return gm


def capture(fn, args) -> torch.fx.GraphModule:
    """A torch-level FX graph of ``fn`` on these arguments, captured by Dynamo (the machinery
    behind torch.compile) with static shapes: sizes are Python ints, a branch on a dtype or a
    size is taken, ``self.bias[:, :, :T, :T]`` and ``torch.ones(T, T)`` are plain ops. Its
    ``forward`` takes ``fn``'s arguments. Raises ``FrontendError`` saying what to do when
    Dynamo needs a graph break (Python control flow on tensor values, unsupported calls)."""
    import warnings
    import torch._dynamo as dynamo
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = dynamo.export(fn, aten_graph=False, assume_static_by_default=True,
                                _log_export_usage=False)(*args)
    except Exception as e:  # noqa: BLE001 - every capture failure gets the same advice
        from acefuse.frontend.errors import FrontendError
        first = (str(e).strip().splitlines() or [""])[0]
        raise FrontendError(
            f"{name}: Dynamo could not capture it as one graph ({type(e).__name__}: {first}). af.compile "
            "needs the whole function in one graph; torch.compile(fn, backend=af.backend) splits it at "
            "graph breaks (Python control flow on tensor values, calls Dynamo cannot trace) and "
            "acefuse takes what it recognises in each piece") from e
    gm = res.graph_module
    gm._af_name = name
    return gm


def flat_args(gm, args) -> list:
    """The graph's placeholder values for a call with ``args`` (a Dynamo graph flattens them)."""
    return list(gm.graph._codegen.process_inputs(*args))


def source_line(node) -> str:
    """``file.py:12: code`` for the node's last user frame, or '' when unknown."""
    st = node.meta.get("stack_trace") or getattr(node, "stack_trace", None) or ""
    lines = [s for s in st.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        s = lines[i].strip()
        if s.startswith('File "'):
            try:
                fname = s.split('"')[1]
                lno = s.split("line ")[1].split(",")[0]
            except IndexError:
                return s
            if (fname.startswith(_TORCH_DIR) or fname.startswith(_HERE)) and \
                    any(t.strip().startswith('File "') for t in lines[:i]):
                continue   # a frame inside torch (F.rms_norm calls torch.rms_norm): the caller's line
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{os.path.basename(fname)}:{lno}: {code}"
    return ""


def op_name(node) -> str:
    """How torch spells the op of a node: ``torch.cumsum``, ``Tensor.view``, ``F.gelu``."""
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        return f"module {t}"
    if node.op == "call_function":
        mod = getattr(t, "__module__", None) or ""
        name = getattr(t, "__name__", None) or str(t)
        if mod.startswith("torch.nn.functional") or mod == "torch._C._nn":
            return f"torch.nn.functional.{name}"
        if mod in ("_operator", "operator"):
            return f"operator.{name}"
        if isinstance(t, torch._ops.OpOverload) or isinstance(t, torch._ops.OpOverloadPacket):
            return str(t)
        if mod.startswith("torch") or mod == "":
            return f"torch.{name}"
        return f"{mod}.{name}"
    return f"{node.op} {t}"


class _Prop(torch.fx.Interpreter):
    def run_node(self, n):
        self.af_node = n
        out = super().run_node(n)
        n.meta["af_val"] = out
        return out


def propagate(gm: torch.fx.GraphModule, args) -> None:
    """Store every node's value on fake tensors (shapes, dtypes; ints stay concrete) in
    ``node.meta['af_val']``; runs on the real inputs when fake execution fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            _Prop(gm).run(*flat_args(gm, fargs))
        return
    except Exception:  # data-dependent ops: fall back to one real execution
        pass
    prop = _Prop(gm)
    try:
        with torch.no_grad():
            prop.run(*flat_args(gm, args))
    except Exception as e:  # noqa: BLE001 - the function itself fails on these inputs
        from acefuse.frontend.errors import FrontendError
        n = getattr(prop, "af_node", None)
        where = ""
        if n is not None:
            line = source_line(n)
            where = f" in `{op_name(n)}`" + (f" at {line}" if line else "")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        name = getattr(gm, "_af_name", "the function")
        raise FrontendError(
            f"{name}: the captured function fails on these inputs{where} ({type(e).__name__}: {first}). "
            "Check the inputs' shapes, dtypes and order: they must be arguments a plain call of the "
            "function accepts") from e
