"""The input types the kernels read, and the error that lists them.

One list and one message for every launcher: the generated modules' input check
(codegen/row.py's PREPARE, shared by the row, top-k, contraction and sum-kernel families)
carries this source (generated modules import nothing from acefuse), and af.gemm's host
check (acefuse/quant_gemm.py) imports it.
"""
from __future__ import annotations

import inspect

import torch

FLOAT_OK = (torch.float32, torch.float16, torch.bfloat16)   # float inputs every kernel family reads
FLOAT8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)      # read by the families that decode float8
INT_TYPES = (torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool)   # where a family reads integers


def axis_lengths(program, tensors, inputs) -> dict:
    """The length of every axis of ``program``'s inputs, checked as the Gluon kernels' launchers
    (contraction and staged row) take them: ``tensors`` maps each input's name to its axes; a
    missing or unknown input is a TypeError, an input of the wrong rank or an axis of two lengths
    a ValueError, each naming the program, the input and the axis."""
    missing = [n for n in tensors if n not in inputs]
    extra = [n for n in inputs if n not in tensors]
    if missing or extra:
        raise TypeError(f"program {program!r}: inputs {list(tensors)} expected"
                        + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else ""))
    lens = {}
    for n, axes in tensors.items():
        t = inputs[n]
        if not isinstance(t, torch.Tensor) or t.dim() != len(axes):
            raise ValueError(f"program {program!r}: input {n!r} must be a tensor over {' '.join(axes)!r} "
                             f"({len(axes)} axes), got {getattr(t, 'shape', type(t).__name__)}")
        for a, sz in zip(axes, t.shape):
            if lens.setdefault(a, sz) != sz:
                raise ValueError(f"program {program!r}: axis {a!r} has length {lens[a]} and {sz}")
    return lens


def _type_error(program, t, dtype, ok):
    """The TypeError for input ``t`` of ``program`` given as ``dtype``, which is not one of ``ok``."""
    names = [str(d).replace("torch.", "") for d in ok]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    return TypeError(f"input {t!r} of program {program!r} is {dtype}, which its kernel does not read; it "
                     f"accepts {listed}: convert it before the call, e.g. {t}.to(torch.float32)")


def _tuple_src(types) -> str:
    return "(" + ", ".join(f"torch.{str(d).replace('torch.', '')}" for d in types) + ")"


# the same, as source for the generated modules (row.PREPARE)
SRC = "\n".join([
    f"FLOAT_OK = {_tuple_src(FLOAT_OK)}   # float inputs every kernel family reads (codegen/input_types.py)",
    f"INT_TYPES = {_tuple_src(INT_TYPES)}   # integer inputs, of the inputs INT_OK names",
    "",
    "",
    inspect.getsource(_type_error),
])
