"""Partial staging (codegen/row_gluon_partial.py), the staged row kernel's form for rows longer
than the ring: the launcher's choice of kept and rotating slots and its refusals, the compute
partition emulated with its slots on the CPU against float64 (and a wrong slot map caught), the
automatic choice reaching the timing for such rows (counting stand-ins), and, on a Hopper GPU,
the kernel itself. Its barrier protocol: tests/test_row_gluon_protocol.py; its offline sm_90
compile: tests/test_row_gluon.py ``test_compiles_for_sm90_offline``.

    python -m pytest -q tests/test_row_gluon_partial.py -p no:cacheprovider
"""
import time

import pytest
import torch

import acefuse as af
from acefuse.codegen import row_gluon as rg
from acefuse.codegen import row_gluon_auto as ra

from tests.test_row_gluon import PROGRAMS, _call, _check, _fusion, _inputs, _on_hopper, _reference, gpu  # noqa: F401


def test_partial_staging_options_and_refusals():
    """A row longer than the ring (or than ``nbuf``): partial staging, all the ring's slots
    (or nbuf), ``ring`` rotating (default: 96 KB of them, at least 2, at most half), one group
    (rows_in_flight=2's warps together); refused with a reason where it cannot take the row."""
    long = _inputs("softmax", 2, 262144, 1)
    for ring, keep in ((4, 24), (12, 16)):
        kw = rg.compile_staged(_fusion("softmax"), ring=ring).launch_args(long)[2]
        assert (kw["KEEP"], kw["RING"], kw["NBUF"]) == (keep, ring, 28)
    k2 = rg.compile_staged(_fusion("softmax"), rows_in_flight=2)
    kw = k2.launch_args(long)[2]
    assert kw["num_warps"] == 8 and "REGS" not in kw and kw["KEEP"] == 16 and "_compute1" not in k2.partial_source
    kw = rg.compile_staged(_fusion("softmax"), nbuf=6).launch_args(_inputs("softmax", 2, 8 * 4096, 1))[2]
    assert (kw["NC"], kw["KEEP"], kw["RING"]) == (8, 3, 3)   # nbuf below the row's chunks: partial too
    kw = rg.compile_staged(_fusion("two")).launch_args(_inputs("two", 2, 65536, 1))[2]   # 16 KB slots
    assert (kw["NBUF"], kw["KEEP"], kw["RING"]) == (14, 8, 6)
    with pytest.raises(ValueError, match="rg_softmax.*needs 64 ring slots.*ring=28 leaves no slot kept"):
        rg.compile_staged(_fusion("softmax"), ring=28).launch_args(long)
    with pytest.raises(ValueError, match="nbuf=40 is more than fit"):
        rg.compile_staged(_fusion("softmax"), nbuf=40).launch_args(long)
    with pytest.raises(ValueError, match="one row in flight and no tma_store form"):
        rg.staged_source(_fusion("softmax"), partial=True, rows_in_flight=2)
    src = rg.staged_source(_fusion("softmax"), partial=True)
    assert src == rg.staged_source(_fusion("softmax"), partial=True) and "KEEP: gl.constexpr" in src
    assert "partial staging" in src and "z_base" not in src and "z_t =" not in src   # (no dead temporaries)


@pytest.mark.parametrize("name,R,N,chunk,nbuf,ring", [
    ("softmax", 5, 12360, 1024, 6, None),     # 13 chunks (a tail of 72), 3 kept, 3 rotating
    ("log_softmax", 3, 9000, 512, 8, 2),      # 18 chunks, a tail of 296 (sub-rows of 8: some empty)
    ("layernorm", 3, 6152, 512, 5, 1),        # 13 chunks, one rotating slot
    ("rmsnorm", 3, 8192, 512, 15, 13),        # 16 chunks, 2 kept, 13 rotating (RING = S - 1)
    ("two", 3, 5000, 512, 4, None),           # two staged inputs
    ("quot", 6, 4096, 512, 4, 2),             # the exact quotient's loop (subnormal denominators)
])
def test_partial_staging_emulated_against_float64(name, R, N, chunk, nbuf, ring):
    """Partial staging's compute partition emulated with its slots (a scratch ring per program,
    NaN-filled: a chunk is copied in where the kernel waits for it, read back from its slot):
    kept chunks read by pass 2 from the slot pass 1 read, streamed ones copied again; several
    rows per program, ragged tail chunks, fresh inputs, against float64 (tolerance 2e-2 of the
    row's largest value, as the other emulated checks)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests run the kernel itself")
    ins = _inputs(name, R, N, int(time.time() * 1000) % 100000)
    k = rg.RowStagedKernel(_fusion(name), "", None, rg.StagedGen(_fusion(name)), chunk=chunk, nbuf=nbuf, ring=ring,
                           partial=("", None))
    assert "KEEP" in k.launch_args(ins)[2]   # (the partial form is what runs)
    out = rg.run_emulated(_fusion(name), programs=2, chunk=chunk, nbuf=nbuf, ring=ring, **ins)
    _check(out if len(out) > 1 else next(iter(out.values())), _reference(name, ins))


@pytest.mark.parametrize("old,new", [
    ("z_slot = KEEP + z_u % RING", "z_slot = z_u % RING"),   # the streamed chunks over the kept slots
    # pass 2 takes its first streamed chunk for a kept one (not copied again: another chunk's slot)
    ("if z_c < KEEP:   # a kept chunk: still", "if z_c < KEEP + 1:   # a kept chunk: still"),
])
def test_partial_staging_emulation_can_fail(monkeypatch, old, new):
    """The emulated slots catch a wrong slot map: streamed chunks that land on kept slots (pass 2
    reads another chunk there), a streamed chunk taken for a kept one. (Whether the copy warp
    fills the slots the compute warps read: tests/test_row_gluon_protocol.py.)"""
    real = rg.emulation_source

    def broken(f, **o):
        src = real(f, **o)
        assert not o.get("partial") or old in src
        return src.replace(old, new)
    monkeypatch.setattr(rg, "emulation_source", broken)
    ins = _inputs("softmax", 3, 12360, 7)
    out = rg.run_emulated(_fusion("softmax"), programs=2, chunk=1024, nbuf=6, **ins)["y"]
    with pytest.raises(AssertionError):
        _check(out, _reference("softmax", ins))


def test_auto_times_the_partial_form_for_rows_longer_than_the_ring(gpu, monkeypatch):   # noqa: F811 (the fixture)
    """A row longer than the ring reaches the timing (partial staging) instead of the refusal,
    and the faster is kept as for rows that fit (here with 1 KB slots, 6 of them, 16 chunks a row)."""
    monkeypatch.setattr(ra, "AUTO_CONFIGS", ({"num_warps": 8, "rows_in_flight": 2, "chunk": 512, "nbuf": 6},))
    ins = _inputs("softmax", 3, 8192, 21)
    k = _call(af.compile(PROGRAMS["softmax"][0]), "softmax", ins)
    kept = next(iter(k._staged_choice.values()))
    assert gpu.timed == [2] and isinstance(kept, rg.RowStagedKernel) and kept.partial_source
    kw = kept.launch_args(ins)[2]
    assert (kw["NC"], kw["KEEP"], kw["RING"]) == (16, 3, 3)



@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layernorm", "rmsnorm", "two", "quot"])
@pytest.mark.parametrize("R,N,ring", [(264, 262144, None), (133, 200008, 4), (3, 40000, None)])
def test_partial_staging_against_float64(name, R, N, ring):
    """Partial staging on the GPU: rows longer than the ring (262144: 64 chunks in 28 slots;
    200008: a tail, sub-rows of 8; 40000 with nbuf=6), more rows than SMs, one and two rows per
    program."""
    if not _on_hopper():
        pytest.skip("the staged kernel needs an sm_90 GPU")
    kern = rg.compile_staged(_fusion(name), ring=ring, nbuf=6 if N == 40000 else None)
    ins = _inputs(name, R, N, int(time.time() * 1000) % 100000, device="cuda")
    assert "KEEP" in kern.launch_args(ins)[2]
    out = kern(**ins)
    _check(out if len(out) > 1 else next(iter(out.values())), _reference(name, ins))
