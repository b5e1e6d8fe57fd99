"""Pass 2 of the row family's staged Gluon kernel (codegen/row_gluon.py ``StagedGen``) and the
per-element forms it can take: its chunk loop with the per-row values hoisted before it
(``hoist``), the loop twice where it divides by per-row values (``qfast``: one multiply per
element on rows whose denominators are normal floats, the exact ``_qdiv`` on the others), and
the kernel's own helpers (``OWN_HELPERS``: ``_expf`` for ``exp2``, ``_rcp_ok`` and ``_qfast``).
Text in, text out: the generator's lines of Triton text, before they become Gluon text.
"""
from __future__ import annotations

import re


# the names that change from one chunk of a row to the next inside pass 2 (chunk_setup's, the
# slot's and the TMA-store buffer's)
CHUNK_NAMES = {"z_c", "z_t", "z_slot", "z_col0", "cols", "tmask", "n_b", "z_ob", "z_orow"}
_ASSIGN = re.compile(r"^(\s*)([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*) = (.*)$")
_RCP = re.compile(r"^(\s*)(_fq\d+), (_pq\d+) = _rcp_row\((\w+)\)")
_QDIV = re.compile(r"_qdiv\((\w+), (\w+)\[:, None\], (_fq\d+)\[:, None\], (_pq\d+)\[:, None\], (\w+)\)")

# the staged kernel's own helpers (StagedGen.exp2, qfast), Triton text (the Gluon module: gl. for tl.)
OWN_HELPERS = '''@triton.jit
def _expf(x):
    # exp(x) = exp2(x * log2(e)): ex2.approx.ftz (a result below 2^-126 is 0)
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def _rcp_ok(b):
    # b a normal float of at most 2^126 in magnitude: RN(1/b) is a normal float too (NaN: false)
    return (tl.abs(b) >= 1.1754943508222875e-38) & (tl.abs(b) <= 8.507059173023462e37)


@triton.jit
def _qfast(a, b, r, P):
    # a / b, b one value per row with _rcp_ok(b), r = RN(1/b): written to a float16/bfloat16 output
    # (P's element type), a * r (within 1 ulp of float32 and b nonzero: no 0/0); any other output,
    # correctly rounded (_div0)
    if P.dtype.element_ty == tl.bfloat16:
        return a * r
    elif P.dtype.element_ty == tl.float16:
        return a * r
    else:
        return _div0(a, b)'''


def _hoist(B, ind):
    """(the assignments of ``B`` at indent ``ind`` that depend on no name of CHUNK_NAMES, the rest
    of ``B``), each in its order; a name assigned twice stays in the loop."""
    targets = [n for ln in B for m in [_ASSIGN.match(ln)] if m for n in m.group(2).split(", ")]
    var = set(CHUNK_NAMES) | {n for n in targets if targets.count(n) > 1}
    pre, rest = [], []
    for ln in B:
        m = _ASSIGN.match(ln)
        if m:
            names = m.group(2).split(", ")
            if m.group(1) == ind and not set(re.findall(r"[A-Za-z_]\w*", m.group(3))) & var and not set(names) & var:
                pre.append(ln)
                continue
            var.update(names)
        rest.append(ln)
    return pre, rest


def pass2_loop(L, B, ind, hoist, qfast):
    """Pass 2's chunk loop of body lines ``B`` (indented one level below ``ind``): with
    ``hoist``, the body's assignments that depend on no chunk (nothing of CHUNK_NAMES,
    directly or through an earlier assignment) go before the loop, once per row; with
    ``qfast``, where the body divides by per-row values (``_rcp_row``), the loop twice: a
    row whose every denominator is a normal float multiplies by RN(1/b) (``_qfast``), any
    other row keeps ``_qdiv``."""
    i2 = ind + "    "
    pre = []
    if hoist:
        pre, B = _hoist(B, i2)
    L.extend(ind + ln[len(i2):] if ln.startswith(i2) else ln for ln in pre)
    rcp = [m.groups() for m in map(_RCP.match, pre) if m] if qfast else []
    if not rcp:
        L.append(f"{ind}for z_c in range(0, NC):")
        L.extend(B)
        return
    ok = []
    for k, (sp, fq, pq, b) in enumerate(rcp):
        L.append(f"{ind}{fq.replace('_fq', '_rq')} = {fq} * {pq}   # RN(1/{b}) where {b} is a normal float")
        ok.append(f"_rcp_ok({b})")
    L.append(f"{ind}# one multiply per element where every denominator of the row is a normal float; else the "
             "exact split")
    L.append(f"{ind}z_qok = tl.min(tl.where({' & '.join(ok)}, 1, 0), axis=0) > 0")
    fast = [_QDIV.sub(lambda m: f"_qfast({m.group(1)}, {m.group(2)}[:, None], "
                                 f"{m.group(3).replace('_fq', '_rq')}[:, None], {m.group(5)})", ln) for ln in B]
    L.append(f"{ind}if z_qok:")
    L.append(f"{i2}for z_c in range(0, NC):")
    L.extend("    " + ln for ln in fast)
    L.append(f"{ind}else:")
    L.append(f"{i2}for z_c in range(0, NC):")
    L.extend("    " + ln for ln in B)
