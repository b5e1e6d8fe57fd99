"""The automatic choice between a program's Triton module and its Gluon kernels on an sm_90 GPU,
shared by the contraction family (codegen/contraction_gluon.py ``auto_gluon``: the
warp-specialised attention kernels) and the row family (codegen/row_gluon_auto.py
``auto_staged``: the shared-memory staged kernel).

On the first call per input shapes, strides, dtypes and device, the Triton module runs (its own
first call, with its own timed launch choice), then every Gluon kernel of the family; a Gluon
kernel whose outputs differ from the Triton module's keeps the Triton module, with a warning that
names the program, and nothing is written to disk; otherwise all are timed and the fastest Gluon
kernel is kept where it takes at most the family's ``AUTO_MARGIN`` of the Triton time. The choice
is remembered on the kernel object and on disk (codegen/tuning.py, keyed by a hash of the
generated sources, the inputs and the device), so a fresh process runs the remembered kernel
without timing or compiling the others.

What differs between the families comes from the family's module ``m``, read at call time (so a
test can replace any of it): ``m._cuda_eager``, ``m._time_pair``, ``m.AUTO_MARGIN``,
``m._not_here(kernel, device)`` (why the family has no Gluon kernel on that device, or None),
``m._compile_all(kernel)`` (the Gluon kernels, or an exception saying why none),
``m._too_little(g0, inputs)`` (too little work to time), ``m._tag(g)`` (a kernel's name on disk),
``m._single_out(g0)`` (the name of a one-output program's output) and
``m._choice_source(kernel, gs)``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """How one family keeps its choice. ``attr``: the kernel attributes' prefix (``{attr}_auto``:
    the Gluon kernels or False; ``{attr}_choice``: per input key, 'triton' or the kept kernel;
    ``{attr}_reason``: why the Triton module runs; ``{attr}_times``: (Triton s, fastest Gluon s)
    per key; ``{attr}_all_times``: each Gluon kernel's seconds, where timed here). ``what``: the
    tuning cache's kind and the stored kernel's name. ``noun``: the Gluon kernel in warnings.
    ``tag_key``: the stored entry's field naming the kept Gluon kernel."""
    attr: str
    what: str
    noun: str
    tag_key: str


def result(out: dict):
    """Outputs as ``af.compile``'s kernels return them: one output, the tensor; else the dict."""
    return next(iter(out.values())) if len(out) == 1 else out


def agree(a, b) -> bool:
    """Whether two outputs of the same derived program agree within 16-bit rounding (and are
    finite at the same places)."""
    import torch
    if a.shape != b.shape:
        return False
    a, b = a.float(), b.float()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return False
    if not fa.any():
        return True
    scale = max(1.0, b[fb].abs().max().item())
    return (a[fa] - b[fb]).abs().max().item() <= 2e-2 * scale


def remembered(fam: Family, m, stored, gs):
    """A stored choice as (the kept kernel: 'triton' or one of ``gs``, (Triton s, fastest Gluon
    s)), or None when it is not one (another version wrote it: then it is timed again)."""
    slow = f"{fam.what}_s"
    if not (isinstance(stored, dict) and stored.get("kernel") in (fam.what, "triton")
            and all(isinstance(stored.get(k), (int, float)) for k in ("triton_s", slow))):
        return None
    times = (float(stored["triton_s"]), float(stored[slow]))
    if stored["kernel"] == "triton":
        return "triton", times
    hit = [g for g in gs if m._tag(g) == stored.get(fam.tag_key)]
    return (hit[0], times) if hit else None


def choose(fam: Family, m, kernel, inputs: dict):
    """The outputs of ``kernel`` on ``inputs`` by the kept Gluon kernel, or None where the caller
    runs the Triton module: not plain eager CUDA tensors, no Gluon kernel for this program or
    device (``{attr}_reason`` says why), inputs outside it, too little work, or the Triton module
    measured (or remembered) faster. On the timed call that keeps the Triton module, its outputs
    (already computed) are returned."""
    import warnings
    A = fam.attr
    state = getattr(kernel, A + "_auto", None)
    if state is False or not inputs:
        return None
    ts = list(inputs.values())
    if not all(hasattr(t, "is_cuda") for t in ts) or not m._cuda_eager(ts):
        return None
    key = tuple((n, tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for n, t in inputs.items())
    choices = kernel.__dict__.setdefault(A + "_choice", {})
    choice = choices.get(key)
    if choice == "triton":
        return None
    if choice is not None:
        return result(choice(**inputs))
    name = kernel.fusion.program.name
    shapes = [tuple(t.shape) for t in ts]
    if state is None:   # first CUDA call: can this program have the kernels at all?
        why = m._not_here(kernel, ts[0].device)
        if why:
            setattr(kernel, A + "_auto", False)
            setattr(kernel, A + "_reason", why)
            return None
        try:
            setattr(kernel, A + "_auto", tuple(m._compile_all(kernel)))
        except Exception as exc:   # outside the kernels' scope (or no Gluon in this Triton): the Triton module
            setattr(kernel, A + "_auto", False)
            setattr(kernel, A + "_reason", f"{type(exc).__name__}: {exc}")
            return None
    gs = getattr(kernel, A + "_auto")
    g0 = gs[0]
    try:
        g0.launch_args(inputs)   # (the kernels of a family check inputs alike)
    except (ValueError, TypeError) as exc:   # these inputs: dtype, layout, sizes
        choices[key] = "triton"
        setattr(kernel, A + "_reason", str(exc))
        return None
    if m._too_little(g0, inputs):
        choices[key] = "triton"
        return None
    from acefuse.codegen import tuning
    from acefuse.codegen.compile import run_module
    src = m._choice_source(kernel, gs)
    dev = ts[0].device
    disk_key = tuple((n, tuple(t.shape), tuple(t.stride()), str(t.dtype)) for n, t in inputs.items())
    stored = remembered(fam, m, tuning.lookup(src, fam.what, disk_key, dev), gs)
    if stored is not None:   # measured (and the outputs checked) by an earlier process on this device
        which, times = stored
        kernel.__dict__.setdefault(A + "_times", {})[key] = times
        if which == "triton":
            choices[key] = "triton"
            return None
        try:
            out = which(**inputs)
        except Exception as exc:   # the remembered kernel fails here (its compile, say): the Triton module
            warnings.warn(f"program {name!r}: {fam.noun} remembered as the faster ({m._tag(which)}) failed at "
                          f"shapes {shapes} ({type(exc).__name__}: {str(exc)[:200]}); the Triton kernel runs",
                          stacklevel=4)
            choices[key] = "triton"
            setattr(kernel, A + "_reason", f"{type(exc).__name__}: {exc}")
            return None
        choices[key] = which
        return result(out)
    want = run_module(kernel.module, (), inputs)   # (its own first call: the Triton launch's timed choice)
    outs = want if isinstance(want, dict) else {m._single_out(g0): want}
    ran, first = [], {}
    for g in gs:
        try:
            got = g(**inputs)
        except Exception as exc:   # e.g. a compile failure of this kernel on this Triton: left out
            warnings.warn(f"program {name!r}: {fam.noun} ({m._tag(g)}) failed at shapes {shapes} "
                          f"({type(exc).__name__}: {str(exc)[:200]}); it is left out of the choice", stacklevel=4)
            setattr(kernel, A + "_reason", f"{m._tag(g)}: {type(exc).__name__}: {exc}")
            continue
        if set(got) != set(outs) or not all(got[n].dtype == outs[n].dtype and agree(got[n], outs[n]) for n in outs):
            warnings.warn(f"program {name!r}: the outputs of {fam.noun} ({m._tag(g)}) differ from the Triton "
                          f"kernel's at shapes {shapes}; the Triton kernel is kept", stacklevel=4)
            choices[key] = "triton"
            return want
        ran.append(g)
        first[g] = got
    if not ran:
        choices[key] = "triton"
        return want
    times = m._time_pair([lambda: run_module(kernel.module, (), inputs)] + [lambda g=g: g(**inputs) for g in ran])
    t_tri, t_glu = times[0], min(times[1:])
    best = ran[times[1:].index(t_glu)]
    choices[key] = best if t_glu <= m.AUTO_MARGIN * t_tri else "triton"
    kernel.__dict__.setdefault(A + "_times", {})[key] = (t_tri, t_glu)
    kernel.__dict__.setdefault(A + "_all_times", {})[key] = {m._tag(g): t for g, t in zip(ran, times[1:])}
    if len(ran) == len(gs):   # (a kernel that failed to run here is not judged: nothing recorded)
        tuning.record(src, fam.what, disk_key, dev,
                      {"kernel": "triton" if choices[key] == "triton" else fam.what, fam.tag_key: m._tag(best),
                       "triton_s": t_tri, f"{fam.what}_s": t_glu})
    if choices[key] == "triton":
        return want
    return result(first[best])


__all__ = ["Family", "agree", "choose", "remembered", "result"]
