"""On a machine without a GPU, acefuse chooses Triton's interpreter itself (codegen/compile.py
_ensure_backend, on the first compile): a user need not set TRITON_INTERPRET. That only works
while nothing imports Triton before then, because Triton makes its own library functions
(tl.sum, tl.max, ...) interpreted or compiled when it is imported. In session 15 a module
imported at ``import acefuse`` (codegen/fastlaunch.py) imported Triton at module level, and
every row kernel on the CPU then failed ("Cannot call @triton.jit'd outside of the scope of a
kernel"): the fuzzer, which runs without TRITON_INTERPRET, reported 2166 crashes; the tests did
not notice because conftest.py sets TRITON_INTERPRET first. These tests run a fresh Python
without it."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's choice of backend (no GPU)")

_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _python(code):
    r = subprocess.run([sys.executable, "-c", code], env=_ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_import_does_not_import_triton():
    assert _python("import sys, acefuse; print('triton' in sys.modules)").strip() == "False"


def test_kernels_run_without_triton_interpret_set(tmp_path):
    """A row kernel (softmax) and an attention kernel, each against float64, in a process where
    TRITON_INTERPRET was never set by the user."""
    code = f"""
import os
os.environ['ACEFUSE_CACHE_DIR'] = {str(tmp_path)!r}
import torch, acefuse as af
x_ = af.tensor('x', 'r j'); m = af.max(x_, 'j'); p = af.exp(x_ - m)
k = af.compile(af.program('softmax_cpu_backend', y=p / af.sum(p, 'j')))
x = torch.randn(5, 70, generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(2), 'little')))
y = k(x=x)
err = (y.double() - torch.softmax(x.double(), -1)).abs().max().item()
assert err < 1e-5, err
q = af.tensor('q', 'b i d'); kk = af.tensor('k', 'b j d'); v = af.tensor('v', 'b j e')
s = af.sum(q * kk, 'd'); mm = af.max(s, 'j'); e = af.exp(s - mm)
att = af.compile(af.program('attn_cpu_backend', o=af.sum(e * v, 'j') / af.sum(e, 'j')))
g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), 'little'))
Q, K, V = torch.randn(2, 9, 16, generator=g), torch.randn(2, 13, 16, generator=g), torch.randn(2, 13, 8, generator=g)
o = att(q=Q, k=K, v=V)
ref = torch.softmax(Q.double() @ K.double().transpose(1, 2), -1) @ V.double()
err = (o.double() - ref).abs().max().item()
assert err < 1e-4, err
print('ok')
"""
    assert _python(code).strip().endswith("ok")
