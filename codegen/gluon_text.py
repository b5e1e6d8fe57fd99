"""Triton text of the contraction template -> Gluon text (codegen/contraction_gluon.py and
codegen/contraction_gluon_ws.py): the layouts of the tensors the template makes, and the
module header's helpers a Gluon kernel calls, as Gluon functions."""
from __future__ import annotations

import re

from acefuse.codegen.emit import CodegenError
from acefuse.codegen.masks import SCAN_KEYS
from acefuse.codegen.contraction import TANH_MM
from acefuse.codegen.row import HEADER

# the layout output tiles are stored from (GluonGen.store_outputs): 2 rows x 8 values a thread, a
# warp 16 rows x 32 values (warp w: rows 16w .. 16w + 15, as in the MMA layout)
STORE_LAYOUTS = ("    STORE_L: gl.constexpr = gl.BlockedLayout([2, 8], [8, 4], [{nw}, 1], [1, 0])   # output tiles\n"
                 "    SROW_L: gl.constexpr = gl.SliceLayout(1, STORE_L)\n"
                 "    SCOL_L: gl.constexpr = gl.SliceLayout(0, STORE_L)")

# layouts of the aranges the template writes, by their length
_ARANGE_LAYOUT = {"BLOCK_I": "ROW_L", "BLOCK_J": "COL_L", "BLOCK_E": "COL_L", "BLOCK_D": "COL_L", "SCAN": "SCANV_L",
                  "SCAN_LD": "SCANV_L"}   # (SCAN_LD: the persistent load partition's scan step)


def scan_layouts(nw, lookups: bool) -> list:
    """The mask analysis' layouts (after ``SCAN_L``'s definition): its vectors over a scan step's
    key tiles (``SCANV_L``), and where a lookup's interval loads those tiles' values
    (masks.MaskAnalysis._lookup_interval: ``[SCAN, BLOCK_J]`` indices) the 2-d layout they slice
    and its key axis (``SCANJ_L``)."""
    if not lookups:
        return ["    SCANV_L: gl.constexpr = SCAN_L"]
    return [f"    SCAN2_L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [{nw}, 1], [1, 0])   # a scan step's key tiles",
            "    SCANV_L: gl.constexpr = gl.SliceLayout(1, SCAN2_L)",
            "    SCANJ_L: gl.constexpr = gl.SliceLayout(0, SCAN2_L)"]


def _shape_layout(shape: str) -> str:
    """The layout of a tensor made by tl.full / tl.zeros with the given shape text."""
    dims = [d.strip() for d in shape.strip("[]").split(",")]
    if len(dims) == 2:
        return "MMA"
    return _ARANGE_LAYOUT.get(dims[0], None) or _fail(f"a 1-d tensor of length {dims[0]}")


def _fail(what):
    raise CodegenError(f"the Gluon kernel has no layout for {what}; use the Triton paths")


def _gluonize(src: str) -> str:
    """Triton text of the template -> Gluon text: layouts attached where a tensor is made
    (arange, full, zeros), ``tl.`` -> ``gl.`` elsewhere (elementwise ops, reductions and
    loads are the same builtins in Gluon, with layouts carried by their operands)."""
    def arange(m):
        n = m.group(1).strip()
        lay = _ARANGE_LAYOUT.get(n) or _fail(f"tl.arange(0, {n})")
        return f"gl.arange(0, {n}, layout={lay})"
    # (a lookup's key positions over a scan step: MaskAnalysis._lookup_interval)
    src = src.replace(SCAN_KEYS, SCAN_KEYS.replace("tl.arange(0, BLOCK_J)", "gl.arange(0, BLOCK_J, layout=SCANJ_L)"))
    src = re.sub(r"tl\.arange\(0, ([A-Za-z_0-9]+)\)", arange, src)

    def full(m):
        shape, rest = m.group(1), m.group(2)
        return f"gl.full({shape}, {rest}, layout={_shape_layout(shape)})"
    src = re.sub(r"tl\.full\((\[[^\]]*\]), ([^()]*?(?:\([^()]*\))?[^()]*?)\)", full, src)

    def zeros(m):
        shape, dt = m.group(1), m.group(2)
        return f"gl.zeros({shape}, {dt}, layout={_shape_layout(shape)})"
    src = re.sub(r"tl\.zeros\((\[[^\]]*\]), (tl\.\w+)\)", zeros, src)
    if "tl.trans(" in src or "tl.dot(" in src or "tl.range(" in src or "tl.make_tensor_descriptor" in src:
        _fail("a Triton-only construct (tl.dot / tl.trans / tl.range / device descriptors) left in the text")
    return re.sub(r"\btl\.", "gl.", src)


def _helpers(kern: str) -> list:
    """The module header's helpers (codegen/row.py) and the contraction family's ``_tanh_mm``
    (codegen/contraction.py) that the kernel calls, transitively, as Gluon functions (the same
    text with ``gl.`` for ``tl.``)."""
    defs, lines = {}, (HEADER.replace("{{", "{").replace("}}", "}") + "\n\n\n" + TANH_MM).split("\n")
    for i, ln in enumerate(lines):
        if ln == "@triton.jit" and i + 1 < len(lines) and lines[i + 1].startswith("def _"):
            name = lines[i + 1][4:].split("(")[0]
            k = i + 2
            while k < len(lines) and (not lines[k].strip() or lines[k].startswith((" ", "#"))):
                k += 1
            defs[name] = "\n".join(lines[i:k]).rstrip()
    need, todo = [], [n for n in defs if re.search(rf"\b{n}\(", kern)]
    while todo:
        n = todo.pop(0)
        if n in need:
            continue
        need.append(n)
        body = defs[n].split("\n", 2)[2]
        todo += [m for m in defs if m not in need and re.search(rf"\b{m}\(", body)]
    return [re.sub(r"\btl\.", "gl.", defs[n].replace("@triton.jit", "@gluon.jit")) for n in defs if n in need]
