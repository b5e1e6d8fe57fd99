"""acefuse: equality-saturation fusion of cascaded reductions.

    import acefuse as af
    x = af.tensor("x", "r j")
    m = af.max(x, "j"); e = af.exp(x - m); l = af.sum(e, "j")
    softmax = af.program("softmax", y=e / l)
    f = af.fuse(softmax, axis="j"); print(f.explain())
    k = af.compile(softmax); y = k(x=torch.randn(37, 1000))
"""
from acefuse.lang import (tensor, const, size, index, exp, log, sqrt, rsqrt, abs, tanh, maximum,
                          minimum, where, sum, max, min, mean, take, program, Program, Expr,
                          LanguageError, NEG_INF, erf, sigmoid, softplus, log1p, expm1, floor, ceil,
                          round, cast, clamp, argmax, argmin)
from acefuse.topk import topk, gather, Stacked
from acefuse.quant_gemm import gemm, GemmKernel, GemmError
from acefuse.fuse import Fusion, FuseError, unfused
from acefuse.certificate import UncertifiedFusionWarning
from acefuse.backward import backward, BackwardProgram, BackwardError
from acefuse.rules.base import rw, infer, tvars, bvars, inv, nonzero, pos, le, ub, Rule
from acefuse.frontend import from_torch, backend, Backend, Report, UnsupportedOpError

from acefuse.rewrite import terms as rewrite_terms  # the term constructors, for writing rules

__version__ = "0.1.0"


def compile(prog, *example_inputs, axis=None, **kw):  # noqa: A001 - mirrors torch.compile
    """Compile a program into a Triton kernel (see acefuse.codegen).

    The kernel's outputs are differentiable: when an input requires grad, it runs the
    augmented forward and, on ``.backward()``, the kernels of ``af.backward(prog)``
    (see acefuse.autograd); otherwise it is the plain forward kernel. A backward program
    (``af.backward(prog)``) compiles to a ``BackwardKernel`` returning the gradients.

    ``prog`` may also be a plain PyTorch function with example inputs: the result is a
    drop-in callable with the function's signature (see acefuse.frontend)."""
    if isinstance(prog, BackwardProgram):
        from acefuse.autograd import compile_backward
        return compile_backward(prog, **kw)
    if not isinstance(prog, Program):
        from acefuse.frontend import compile_fn
        return compile_fn(prog, *example_inputs)
    if kw.get("process_group") is not None or kw.get("sharded_axis") is not None:   # acefuse/distributed.py
        from acefuse.distributed import compile_sharded
        return compile_sharded(prog, axis=axis, **kw)
    from acefuse.codegen.compile import compile_program
    from acefuse.autograd import DifferentiableKernel
    k = DifferentiableKernel(prog, compile_program(prog, axis=axis, **kw), dict(kw, axis=axis))
    if getattr(prog, "stacked", None):   # af.topk outputs: the k candidates stacked on their new axis
        from acefuse.topk import StackedKernel
        return StackedKernel(prog, k)
    return k


def fuse(prog, axis=None, **kw):
    """Derive the fused forms of ``prog`` (see acefuse.fuse.fuse). A backward program
    (``af.backward(prog)``) is fused stage by stage: the result is fusible when every
    stage is, and ``explain()`` shows each stage's derivation."""
    from acefuse.fuse import fuse as _fuse
    if isinstance(prog, BackwardProgram):
        if axis is not None:
            raise FuseError(f"program {prog.name!r} is a backward program: each stage has its own fused "
                            f"axis ({', '.join(s.name for s in prog.stages)}); call af.fuse without axis=")
        from acefuse.autograd import StagedFusion
        return StagedFusion(prog, [_fuse(s, **kw) for s in prog.stages])
    return _fuse(prog, axis=axis, **kw)


def rule(name, lhs, rhs, when=(), float_unsafe=""):
    """A user rewrite rule (alias of ``rw``); prove it with ``acefuse prove FILE.py``."""
    return rw(name, lhs, rhs, when=when, float_unsafe=float_unsafe)
