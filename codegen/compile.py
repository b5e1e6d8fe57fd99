"""af.compile: fuse a program, generate its Triton module, load it, return a callable.

Generated modules are cached on disk by a hash of the program, the axis and the
acefuse version (``$ACEFUSE_CACHE_DIR/kernels``, default ``~/.cache/acefuse/kernels``).
With no CUDA device, kernels run through Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

GEN_VERSION = "row-1"


def cache_dir() -> Path:
    base = os.environ.get("ACEFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "acefuse")
    p = Path(base) / "kernels"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _ensure_backend():
    """Use Triton's interpreter when there is no GPU (must be set before kernels are defined)."""
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"


class KernelError(RuntimeError):
    """The generated Triton kernel failed to compile or run."""

    def __init__(self, kernel, exc):
        msg = str(exc).strip().splitlines()
        super().__init__(
            f"program {kernel.program.name!r}: the generated kernel failed "
            f"({type(exc).__name__}: {msg[-1] if msg else ''}). The source is {kernel.path}; "
            "try another schedule (schedule='loop' or 'split') or smaller tiles (block_j=..., "
            "num_warps=...), and report the program if it persists.")


class Kernel:
    """A compiled program: call it with the inputs by name (or position)."""

    def __init__(self, fusion, source: str, path: Path, module):
        self.fusion = fusion
        self.program = fusion.program
        self.source = source
        self.path = path
        self.module = module

    def __call__(self, *args, **inputs):
        try:
            if os.environ.get("TRITON_INTERPRET") == "1":
                import numpy as np
                with np.errstate(all="ignore"):  # the interpreter evaluates masked lanes too
                    return self.module.run(*args, **inputs)
            return self.module.run(*args, **inputs)
        except (TypeError, ValueError) as exc:
            if type(exc).__module__.startswith("triton"):
                raise KernelError(self, exc) from exc
            raise  # the launcher's own checks already name the program, input and axis
        except Exception as exc:
            if type(exc).__module__.split(".")[0] in ("triton", "torch"):
                raise KernelError(self, exc) from exc
            raise

    @property
    def fusible(self):
        return self.fusion.fusible

    def __repr__(self):
        return f"<acefuse kernel {self.program.name!r} over {self.fusion.axis!r} ({self.path})>"


def load_module(path: Path, name: str):
    _ensure_backend()
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_program(prog, axis=None, rules=(), allow_unproved=False, fusion=None):
    from acefuse.fuse import fuse, _pick_axis
    if fusion is None:
        staged = stage(prog, _pick_axis(prog, axis))
        if staged is not None:
            s1, s2, hidden = staged
            k1 = compile_program(s1, axis=axis, rules=rules, allow_unproved=allow_unproved)
            k2 = compile_program(s2, rules=rules, allow_unproved=allow_unproved)
            return StagedKernel(k1, k2, hidden, list(prog.outputs))
    from acefuse.codegen import row, contraction
    f = fusion or fuse(prog, axis=axis, rules=rules, allow_unproved=allow_unproved)
    src = (contraction if contraction.is_contraction(f) else row).generate(f)
    h = hashlib.sha256((GEN_VERSION + src).encode()).hexdigest()[:16]
    path = cache_dir() / f"{prog.name}_{h}.py"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(src)
        os.replace(tmp, path)
    mod = load_module(path, f"acefuse_gen_{prog.name}_{h}")
    return Kernel(f, src, path, mod)


# ---- staging: reductions over a parallel axis of the fused computation ------------------------
class StagedKernel:
    """A program whose outputs reduce over another axis the results of the fused
    axis (``mean_r(cross_entropy_r)``): stage 1 is the fused kernel, which writes the
    per-row values; stage 2 is a second acefuse program over those values."""

    def __init__(self, stage1, stage2, hidden, outputs):
        self.stage1, self.stage2, self.hidden, self.output_names = stage1, stage2, hidden, outputs
        self.fusion = stage1.fusion
        self.program = stage1.program
        self.source = stage1.source + "\n\n# ---- stage 2 ----\n" + stage2.source

    @property
    def fusible(self):
        return self.stage1.fusible

    def __call__(self, *args, **inputs):
        for name, a in zip(self.stage1.program.tensors, args):
            inputs[name] = a
        first = self.stage1(**{k: v for k, v in inputs.items() if k in self.stage1.program.tensors})
        first = first if isinstance(first, dict) else {next(iter(self.stage1.program.outputs)): first}
        second_in = {k: v for k, v in inputs.items() if k in self.stage2.program.tensors}
        second_in.update({h: first[h] for h in self.hidden})
        second = self.stage2(**second_in)
        second = second if isinstance(second, dict) else {next(iter(self.stage2.program.outputs)): second}
        out = {k: first[k] for k in first if k not in self.hidden}
        out.update(second)
        out = {k: out[k] for k in self.output_names}
        return out[self.output_names[0]] if len(out) == 1 else out


def stage(prog, axis):
    """(stage-1 program, stage-2 program, hidden names) or None when no output reduces
    over another axis a value computed from reductions over ``axis``."""
    from acefuse.lang import Program, Expr
    from acefuse.rewrite.encode import _Axes, RED_OPS
    from acefuse.rewrite.terms import Term
    axes_of = _Axes(prog.tensors)

    def fused_red(t):
        return any(s.op in RED_OPS and s.args[0].op == "Ax" and s.args[0].args[0] == axis for s in t.walk())

    hidden: dict = {}

    def outer(t):
        if t.op in RED_OPS and t.args[0].op == "Ax" and t.args[0].args[0] != axis and fused_red(t.args[1]):
            body = t.args[1]
            if body not in hidden:
                hidden[body] = f"stage_{len(hidden) + 1}"
            return Term(t.op, (t.args[0], Term("In", (hidden[body],))))
        if not t.children:
            return t
        return Term(t.op, tuple(outer(a) if isinstance(a, Term) else a for a in t.args))

    new = {k: outer(e.term) for k, e in prog.outputs.items()}
    if not hidden:
        return None
    s1_out = {k: e for k, e in prog.outputs.items() if new[k] == e.term}
    order = {a: i for i, a in enumerate(prog.axes)}
    for body, name in hidden.items():
        s1_out[name] = Expr(body, tuple(sorted(axes_of(body), key=order.get)), dict(prog.tensors))
    stage1 = Program(prog.name + "_stage1", s1_out)
    tensors2 = {name: tuple(sorted(axes_of(body), key=order.get)) for body, name in hidden.items()}
    s2_out = {}
    for k, t in new.items():
        if t == prog.outputs[k].term:
            continue
        used = {s.args[0] for s in t.walk() if s.op == "In"}
        tens = {n: (tensors2[n] if n in tensors2 else prog.tensors[n]) for n in used}
        s2_out[k] = Expr(t, prog.outputs[k].axes, tens)
    stage2 = Program(prog.name + "_stage2", s2_out)
    return stage1, stage2, list(hidden.values())
