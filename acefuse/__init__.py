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
                          LanguageError, NEG_INF)
from acefuse.fuse import fuse, Fusion, FuseError
from acefuse.rules.base import rw, infer, tvars, bvars, inv, nonzero, le, ub, Rule
from acefuse.frontend import from_torch, backend, UnsupportedOpError

from acefuse.rewrite import terms as rewrite_terms  # the term constructors, for writing rules

__version__ = "0.1.0"


def compile(prog, *example_inputs, axis=None, **kw):  # noqa: A001 - mirrors torch.compile
    """Compile a program into a Triton kernel (see acefuse.codegen).

    ``prog`` may also be a plain PyTorch function with example inputs: the result is a
    drop-in callable with the function's signature (see acefuse.frontend)."""
    if not isinstance(prog, Program):
        from acefuse.frontend import compile_fn
        return compile_fn(prog, *example_inputs)
    from acefuse.codegen.compile import compile_program
    return compile_program(prog, axis=axis, **kw)


def rule(name, lhs, rhs, when=(), float_unsafe=""):
    """A user rewrite rule (alias of ``rw``); prove it with ``acefuse prove FILE.py``."""
    return rw(name, lhs, rhs, when=when, float_unsafe=float_unsafe)
