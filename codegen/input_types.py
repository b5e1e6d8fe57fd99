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
