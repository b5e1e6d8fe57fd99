"""What a generated launcher does when Triton cannot compile one of its kernels.

A kernel is compiled on its first launch for a configuration (launch options, argument
types and Triton's specialisation of them). Triton 3.6 on an H200 failed there on the
pipelined gathered loads of paged attention's bfloat16 augmented forward (an assertion in
``applyLinearLayout``, raised as ``RuntimeError: PassManager::run failed``), and ptxas once
exited with -11 on the GQA forward's Hopper kernel. So every launcher (row, contraction and
sum-kernel families: codegen/row.py, contraction_launch.py, sums_launch.py; the gemm family's
launch in acefuse/quant_gemm.py ``_run_prologue``, with a ``_TUNING`` of its own) launches
through ``_safer_launch`` when a launch raises: a compile error (``_compile_error``) is
retried with safer options, in order no software pipelining (``num_stages=1``), then each
other warp count; the contraction family's automatic choice then falls back to its portable
kernel (contraction_launch.py); the riders' TMA reduce falls back to pointer atomics
(sums_launch.py). The options that compile stay in the launch plan and in ``_SAFER`` (later
plans of the same options start from them: ``_remember``), with one ``CompileRetryWarning``.
When none compiles: ``KernelCompileError`` (codegen/compile.py) naming the program, the
kernel, the options tried and Triton's first line, and what to do. A run-time error (CUDA's
illegal address, out of memory), an input error (raised before any launch) and any error
while a launcher times candidates (``_TUNING``: a candidate that fails is skipped) are
raised as they are.

``SRC`` is part of every generated module's header (row.HEADER). Nothing here is on the
per-call path: a launch that raises is where it starts.
"""
from __future__ import annotations

SRC = '''
try:   # the project's error and warning types (a module run without acefuse: its own)
    from acefuse.codegen.compile import CompileRetryWarning, KernelCompileError
except ImportError:  # pragma: no cover
    class KernelCompileError(RuntimeError):
        """Triton could not compile a kernel of this module with any launch options tried."""
    CompileRetryWarning = UserWarning

_SAFER = {}   # (kernel, launch options, input dtypes) -> options that compiled where those did not
_COMPILE_TYPES = ('CompilationError', 'CompileTimeAssertionFailure', 'UnsupportedLanguageConstruct', 'PTXASError',
                  'OutOfResources', 'CalledProcessError')
_COMPILE_MARKS = ('PassManager::run failed', 'ptxas', 'PTX', 'LLVM', 'MLIR', 'Assertion')
_RUNTIME_MARKS = ('CUDA error', 'CUDA out of memory', 'out of memory', 'illegal', 'device-side')


def _compile_error(exc):
    """Triton failed to compile a kernel (its frontend, an MLIR pass, LLVM, ptxas, resources past
    the device's), as opposed to a run-time error (CUDA's: an illegal address, out of memory)."""
    if type(exc).__name__ in _COMPILE_TYPES:
        return True
    msg = str(exc)
    return (type(exc) is RuntimeError and not any(m in msg for m in _RUNTIME_MARKS)
            and any(m in msg for m in _COMPILE_MARKS))


def _first_line(exc):
    msg = [s.strip() for s in str(getattr(exc, 'error_message', None) or exc).splitlines() if s.strip()]
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


def _safer_options(kw, more=True):
    """Launch options to try, in order, where ``kw`` did not compile: no software pipelining
    (num_stages=1), then (``more``) also each other warp count."""
    one = dict(kw, num_stages=1)
    out = [one] if kw.get('num_stages') != 1 else []
    return out + [dict(one, num_warps=w) for w in (4, 8, 2) if more and w != kw.get('num_warps', 4)]


def _show(kw):
    return ', '.join(f'{k}={v}' for k, v in kw.items() if k.islower() or k.startswith('BLOCK'))


def _dtypes(inputs):
    return tuple(str(getattr(inputs.get(t), 'dtype', None)) for t in TENSORS)


def _set_kw(p, kw):
    p.kw = kw
    if getattr(p, 'combine_kw', None) is not None:   # (the split schedule's merge: no pipeline)
        p.combine_kw = {k: v for k, v in kw.items() if k != 'num_stages'}


def _remember(p, what, dtypes):
    """At a new plan: the options that compiled where ``p.kw`` did not, if any."""
    kw = _SAFER.get((what, repr(sorted(p.kw.items())), dtypes))
    if kw is not None:
        _set_kw(p, kw)


class _Options:
    """Launch options being retried (a launcher without a plan: the sum kernel's)."""
    __slots__ = ('kw',)

    def __init__(self, kw):
        self.kw = kw


def _safer_launch(p, what, launch, exc, dtypes, more=True):
    """``launch()`` again, with each of _safer_options(p.kw) in ``p.kw``, where the launch of kernel(s)
    ``what`` raised ``exc``, a compile error (codegen/launch_retry.py); else ``exc`` is raised."""
    if globals().get('_TUNING') or not _compile_error(exc):
        raise exc
    import warnings
    orig, tried = p.kw, [p.kw]
    for kw in _safer_options(orig, more):
        _set_kw(p, kw)
        try:
            out = launch()
        except Exception as e:  # noqa: BLE001 - only compile errors are retried
            if not _compile_error(e):
                _set_kw(p, orig)
                raise
            tried.append(kw)
            continue
        _SAFER[(what, repr(sorted(orig.items())), dtypes)] = kw
        warnings.warn(f"acefuse: program {PROGRAM!r}: Triton could not compile kernel {what} with {_show(orig)} "
                      f"({_first_line(exc)}); it runs with {_show(kw)} from now on", CompileRetryWarning)
        return out
    _set_kw(p, orig)
    raise KernelCompileError(
        f"program {PROGRAM!r}: Triton could not compile kernel {what} ({_first_line(exc)}) with any launch "
        f"options tried: " + '; '.join(f'[{_show(kw)}]' for kw in tried) + f". Its source is {__file__}. "
        "Please report this with the program and the source; meanwhile other launch options of the call "
        "(block_j=..., num_warps=..., schedule=...) may compile, and a model compiled with "
        "torch.compile(backend=af.backend) runs this region in torch instead, with a warning") from exc
'''
