"""The direct launch of compiled kernels (codegen/fastlaunch.py): its guard.

A kept CompiledKernel is only correct for arguments Triton would specialise the same way.
On the CPU the decision is tested, not the launch: ``spec_key`` must tell apart everything
Triton 3.6 specialises on (a bfloat16 view one element off its 16-byte aligned base, an
integer becoming 1 or divisible by 16 or leaving int32, a dtype), and a ``Site`` over a
stand-in JIT function must go back to the JIT path for each of those, for new launch
options, a launch hook, a changed global, another device or the switch; the interpreter,
and a Triton version not checked, never take the direct path. The GPU test compares the
direct path's outputs bit for bit with the JIT path's and with float64."""
import runpy
from pathlib import Path

import pytest
import torch

from acefuse.codegen import fastlaunch as fl

ROOT = Path(__file__).resolve().parents[1]


def _rand_int(g, lo, hi):
    return int(torch.randint(lo, hi, (1,), generator=g))


def test_spec_key_tells_apart_what_triton_specialises_on():
    g = torch.Generator().manual_seed(_rand_int(torch.Generator().manual_seed(15), 0, 2 ** 30))
    base = torch.randn(64, generator=g).to(torch.bfloat16)
    other = torch.randn(64, generator=g).to(torch.bfloat16)
    n = 16 * _rand_int(g, 2, 1000) + _rand_int(g, 1, 16)   # > 1, not divisible by 16
    key = fl.spec_key([base, n], (0, 1))
    assert fl.spec_key([other, n + 16], (0, 1)) == key           # same specialisation: same key
    assert fl.spec_key([base[1:], n], (0, 1)) != key             # 2 bytes off: not 16-byte aligned
    assert fl.spec_key([base[8:], n], (0, 1)) == key             # 16 bytes off: aligned again
    assert fl.spec_key([base.to(torch.float16), n], (0, 1)) != key   # another dtype
    assert fl.spec_key([base, 1], (0, 1)) != key                 # 1 is a constexpr for Triton
    assert fl.spec_key([base, 16 * (n // 16)], (0, 1)) != key    # divisible by 16
    assert fl.spec_key([base, n + 2 ** 31], (0, 1)) != key       # int64
    assert fl.spec_key([base, None], (0, 1)) != key
    assert fl.spec_key([base, True], (0, 1)) != fl.spec_key([base, 1], (0, 1))
    assert fl.spec_key([base, 2.5], (0, 1)) != key
    assert fl.spec_key([base, n], (0,)) == fl.spec_key([base, 16], (0,))   # (only the watched positions)
    assert fl.spec_key([base, "x"], (0, 1)) is None              # unknown type: the JIT path


def _native_specialisation():
    """Triton's own per-argument specialisation (what JITFunction.run keys its kernels on) for an
    sm_90 target, or None where this Triton has no native one."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        backend = CUDABackend(GPUTarget("cuda", 90, 32))
        native_specialize_impl(backend, 16, False, True, True)
    except Exception:  # noqa: BLE001
        return None
    return lambda a: native_specialize_impl(backend, a, False, True, True)


def test_spec_key_classes_are_tritons_specialisations():
    """Over random integers (near 1, multiples of 16, the int32/uint64/int64 bounds), bool, float,
    None and tensor views of four dtypes at random element offsets: arguments with one key have
    one specialisation in the installed Triton's native_specialize_impl (on the GPU machine
    Triton 3.6, the version the direct path runs on; checked against 3.6.0 and 3.9.0 offline),
    and keys are not merged beyond it (15 classes for these types, each its own)."""
    native = _native_specialisation()
    if native is None:
        pytest.skip("this Triton has no native_specialize_impl")
    seed = _rand_int(torch.Generator().manual_seed(16), 0, 2 ** 30)
    g = torch.Generator().manual_seed(seed)
    bufs = {dt: torch.empty(256, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int32)}
    edges = [0, 1, -1, 16, 2 ** 31 - 1, 2 ** 31, -2 ** 31, -2 ** 31 - 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, -2 ** 63]
    classes, seen = {}, 0
    for n in range(20000):
        r = n % 7
        if r == 0:
            a = edges[_rand_int(g, 0, len(edges))]
        elif r == 1:
            a = 16 * _rand_int(g, -2 ** 20, 2 ** 20) + [0, 1, 8][n % 3]
        elif r == 2:
            a = _rand_int(g, -2 ** 40, 2 ** 40) * [1, 2 ** 23][n % 2]
        elif r == 3:
            a = [True, False, 0.5, None][n % 4]
        else:
            buf = list(bufs.values())[n % 4]
            a = buf[_rand_int(g, 0, 64):]
        k = fl.spec_key([a], (0,))
        assert k is not None
        seen += 1
        nat = native(a)
        assert classes.setdefault(k, nat) == nat, (seed, a, k, classes[k], nat)
    assert len(set(classes.values())) == len(classes) >= 15, classes   # (no two keys for one specialisation)


class _Param:
    def __init__(self, name, default=None, has_default=False):
        self.name, self.default, self.has_default = name, default, has_default


class _CK:
    """A stand-in CompiledKernel: its launcher records the direct launches."""

    def __init__(self):
        self.launches = []
        self._run = lambda *a: self.launches.append(a)
        self.function = object()
        self.packed_metadata = (4, 1, 0)


class _FakeJIT:
    """A stand-in JITFunction: kernel(x_ptr, n, N, BLOCK: constexpr, FLAG: constexpr = 7)."""

    def __init__(self):
        self.params = [_Param("x_ptr"), _Param("n"), _Param("N"), _Param("BLOCK"), _Param("FLAG", 7, True)]
        self.pre_run_hooks = []
        self.used_global_vals = {}
        self.jit = []
        self.ck = {}

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.jit.append((grid, args, dict(kw)))
            return self.ck.setdefault(fl.spec_key(args, range(len(args))), _CK())
        return launch


@pytest.fixture
def site(monkeypatch):
    """A Site over a stand-in kernel with the direct path allowed (as on a checked Triton and a
    GPU): template (x_ptr: per call, n: per call, N: fixed 4096)."""
    monkeypatch.setattr(fl, "fast_ok", lambda fn: True)
    monkeypatch.setattr(fl, "_device", lambda: 0)
    monkeypatch.setattr(fl, "_stream", lambda dev: 1234)
    monkeypatch.setattr(fl, "_hooks_set", lambda runtime: False)
    monkeypatch.setattr(fl, "ENABLED", True)
    fn = _FakeJIT()
    return fn, fl.Site(fn, [None, None, 4096])


def _x(g, n=64, dtype=torch.bfloat16):
    return torch.randn(n, generator=g).to(dtype)


def test_the_second_launch_of_a_key_is_direct_with_every_argument_in_order(site):
    fn, s = site
    g = torch.Generator().manual_seed(1)
    kw = dict(BLOCK=64, num_warps=4)
    s((3,), [_x(g), 35, 4096], kw)
    assert len(fn.jit) == 1 and s.direct == 0
    x2 = _x(g)
    s((3, 2), [x2, 37, 4096], kw)   # another tensor, another odd length: same specialisation
    assert len(fn.jit) == 1 and s.direct == 1
    (ck,) = fn.ck.values()
    (launch,) = ck.launches
    # grid (3, 2, 1), the stream, the kernel, its metadata, no launch metadata nor hooks, then
    # every argument in signature order: positional, the constexpr from kw, the default
    assert launch[:4] == (3, 2, 1, 1234) and launch[4] is ck.function and launch[5] == ck.packed_metadata
    assert launch[6:9] == (None, None, None)
    assert launch[9] is x2 and launch[10:] == (37, 4096, 64, 7)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "one", "div16", "int64"])
def test_a_changed_specialisation_takes_the_jit_path(site, change):
    fn, s = site
    g = torch.Generator().manual_seed(2)
    kw = dict(BLOCK=64)
    x = _x(g, 80)
    s((1,), [x, 35, 4096], kw)
    s((1,), [x, 35, 4096], kw)
    assert (len(fn.jit), s.direct) == (1, 1)
    args = {"misaligned": [x[1:], 35, 4096], "dtype": [x.to(torch.float16), 35, 4096],
            "one": [x, 1, 4096], "div16": [x, 48, 4096], "int64": [x, 2 ** 31 + 3, 4096]}[change]
    s((1,), args, kw)
    assert (len(fn.jit), s.direct) == (2, 1)
    s((1,), args, kw)   # (now kept for its own key)
    assert (len(fn.jit), s.direct) == (2, 2)
    s((1,), [x, 35, 4096], kw)   # the first key's kernel is still kept
    assert (len(fn.jit), s.direct) == (2, 3)


def test_arguments_past_the_template_are_watched(site):
    fn, s = site
    g = torch.Generator().manual_seed(3)
    x, kw = _x(g), dict(BLOCK=64)
    s((1,), [x, 35, 4096, 33], kw)
    s((1,), [x, 35, 4096, 35], kw)
    assert (len(fn.jit), s.direct) == (1, 1)
    s((1,), [x, 35, 4096, 32], kw)
    assert (len(fn.jit), s.direct) == (2, 1)


def test_new_options_a_hook_a_global_a_device_or_the_switch_take_the_jit_path(site, monkeypatch):
    fn, s = site
    g = torch.Generator().manual_seed(4)
    x = _x(g)
    kw = dict(BLOCK=64, num_warps=4)
    s((1,), [x, 35, 4096], kw)
    s((1,), [x, 35, 4096], kw)
    assert (len(fn.jit), s.direct) == (1, 1)
    kw2 = dict(kw, num_stages=1)   # a retry with safer options: a new kw object
    s((1,), [x, 35, 4096], kw2)
    assert (len(fn.jit), s.direct) == (2, 1)
    with monkeypatch.context() as m:
        m.setattr(fl, "_hooks_set", lambda runtime: True)
        s((1,), [x, 35, 4096], kw2)
        assert (len(fn.jit), s.direct) == (3, 1)
    with monkeypatch.context() as m:
        m.setattr(fl, "_device", lambda: 1)
        s((1,), [x, 35, 4096], kw2)
        assert (len(fn.jit), s.direct) == (4, 1)
    fl.set_enabled(False)
    try:
        s((1,), [x, 35, 4096], kw2)
        assert (len(fn.jit), s.direct) == (5, 1)
    finally:
        fl.set_enabled(True)
    s((1,), [x, 35, 4096], kw2)   # (kept last for device 1: the JIT path, kept for device 0 again)
    assert (len(fn.jit), s.direct) == (6, 1)
    s((1,), [x, 35, 4096], kw2)
    assert (len(fn.jit), s.direct) == (6, 2)
    fn.pre_run_hooks.append(lambda *a, **k: None)
    s((1,), [x, 35, 4096], kw2)
    assert (len(fn.jit), s.direct) == (7, 2)


def test_a_changed_global_takes_the_jit_path(site):
    fn, s = site
    g = torch.Generator().manual_seed(5)
    x, kw = _x(g), dict(BLOCK=64)
    glob = {"NATIVE": object()}
    fn.used_global_vals = {("NATIVE", id(glob)): (glob["NATIVE"], glob)}
    s((1,), [x, 35, 4096], kw)
    s((1,), [x, 35, 4096], kw)
    assert (len(fn.jit), s.direct) == (1, 1)
    glob["NATIVE"] = object()
    s((1,), [x, 35, 4096], kw)
    assert (len(fn.jit), s.direct) == (2, 1)


def test_a_fixed_slot_given_another_value_is_not_kept(site):
    fn, s = site
    g = torch.Generator().manual_seed(6)
    x, kw = _x(g), dict(BLOCK=64)
    for _ in range(2):
        s((1,), [x, 35, 4095], kw)   # the template says 4096
    assert (len(fn.jit), s.direct) == (2, 0)


def test_hooks_set_reads_triton_hook_chains():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    class Runtime:
        def __init__(self, enter, exit_):
            self.launch_enter_hook, self.launch_exit_hook = enter, exit_
    assert not fl._hooks_set(Runtime(Chain([]), Chain([])))
    assert not fl._hooks_set(Runtime(None, None))
    assert fl._hooks_set(Runtime(Chain([print]), Chain([])))
    assert fl._hooks_set(Runtime(Chain([]), Chain([print])))
    assert fl._hooks_set(Runtime(print, None))   # (a plain callable assigned)


def test_only_a_checked_triton_version_and_no_interpreter(monkeypatch):
    import triton
    from triton.runtime.jit import JITFunction

    def k(x_ptr, n):
        pass
    monkeypatch.setattr(fl, "_device", lambda: 0)
    fn = JITFunction(k)
    monkeypatch.setattr(fl, "_interpreted", lambda: False)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert fl.fast_ok(fn)
    assert not fl.fast_ok(lambda: None)
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert not fl.fast_ok(fn)
    monkeypatch.setattr(triton, "__version__", "3.6.1")
    monkeypatch.setattr(fl, "_interpreted", lambda: True)
    assert not fl.fast_ok(fn)


def test_the_interpreter_never_launches_directly(monkeypatch):
    """A decode through the generated launcher under TRITON_INTERPRET=1 (as a checked version
    would see it): every launch goes through Triton, and the result matches float64."""
    import triton
    import acefuse as af
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    ex = runpy.run_path(str(ROOT / "examples" / "attention.py"))
    k = af.compile(ex["decode"])
    mod = getattr(k, "kernel", k).module
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 2, 1, 16, generator=g)
    kk, vv = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    s = torch.einsum("bgrid,bgjd->bgrij", q.double(), kk.double()) * ex["SCALE"]
    ref = torch.einsum("bgrij,bgje->bgrie", torch.softmax(s, -1), vv.double())
    for sched in ("loop", "split1", "split"):
        for _ in range(2):
            got = mod.run(q=q, k=kk, v=vv, schedule=sched)
            assert (got.double() - ref).abs().max().item() < 1e-4
    sites = [st for p in mod._PLANS.values() for st in p.sites.values()]
    assert len(sites) >= 4 and not any(st.fast or st.direct for st in sites)


def _gpu_decode_inputs(g, kv, dev, dtype=torch.bfloat16):
    return dict(q=torch.randn(2, 4, 4, 1, 128, generator=g).to(dev, dtype),
                k=torch.randn(2, 4, kv, 128, generator=g).to(dev, dtype),
                v=torch.randn(2, 4, kv, 128, generator=g).to(dev, dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_direct_launches_give_the_jit_paths_bits():
    """decode with schedule 'loop' and 'split1': the direct path's output equals the JIT
    path's bit for bit (fresh inputs each call, KV lengths of one power-of-two class, then a
    view one element off its base: a new signature), and both match float64."""
    import triton
    import acefuse as af
    if not triton.__version__.startswith(fl.VERSIONS):
        pytest.skip(f"the direct path is off on Triton {triton.__version__}")
    ex = runpy.run_path(str(ROOT / "examples" / "attention.py"))
    kern = af.compile(ex["decode"])
    mod = getattr(kern, "kernel", kern).module
    g = torch.Generator().manual_seed(_rand_int(torch.Generator().manual_seed(8), 0, 2 ** 30))

    def direct_count():
        return sum(st.direct for p in mod._PLANS.values() for st in p.sites.values())

    def jit_then_direct(ins, sched):
        fl.set_enabled(False)
        try:
            jit = mod.run(**ins, schedule=sched).clone()
        finally:
            fl.set_enabled(True)
        before = direct_count()
        direct = [mod.run(**ins, schedule=sched).clone() for _ in range(3)]
        torch.cuda.synchronize()
        assert direct_count() > before, f"schedule {sched!r}: no launch took the direct path"
        for d in direct:
            assert torch.equal(d, jit), sched
        qd, kd, vd = (ins[n].double() for n in "qkv")
        s = torch.einsum("bgrid,bgjd->bgrij", qd, kd) * ex["SCALE"]
        ref = torch.einsum("bgrij,bgje->bgrie", torch.softmax(s, -1), vd)
        assert (jit.double() - ref).abs().max().item() < 2e-2

    for sched in ("loop", "split1"):
        for kv in (1000, 1003, 1024, 1000):   # (odd and 16-divisible lengths: their own keys)
            jit_then_direct(_gpu_decode_inputs(g, kv, "cuda"), sched)
        # a misaligned view (k one bf16 element off its base): its own plan, the JIT path first
        ins = _gpu_decode_inputs(g, 1001, "cuda")
        bk = torch.randn(2 * 4 * 1001 * 128 + 1, generator=g).to("cuda", torch.bfloat16)
        ins["k"] = bk[1:].view(2, 4, 1001, 128)
        assert ins["k"].data_ptr() % 16
        jit_then_direct(ins, sched)


def test_keyed_slots_are_left_to_the_callers_key(site):
    """A slot in ``keyed`` (the contraction launcher's inputs: their dtype and alignment are in its
    plan key, so a misaligned input gets another plan and another Site) is not looked at again."""
    fn, _ = site
    s = fl.Site(fn, [None, None, 4096], keyed=[0])
    assert s.watch == (1,)
    g = torch.Generator().manual_seed(9)
    x, kw = _x(g, 80), dict(BLOCK=64)
    s((1,), [x, 35, 4096], kw)
    s((1,), [x[1:], 35, 4096], kw)
    assert (len(fn.jit), s.direct) == (1, 1)


def test_a_site_made_while_switched_off_launches_directly_once_on(site):
    fn, _ = site
    fl.set_enabled(False)
    try:
        s = fl.Site(fn, [None, None, 4096])
        g = torch.Generator().manual_seed(10)
        x, kw = _x(g), dict(BLOCK=64)
        s((1,), [x, 35, 4096], kw)
        s((1,), [x, 35, 4096], kw)
        assert (len(fn.jit), s.direct) == (2, 0)
    finally:
        fl.set_enabled(True)
    s((1,), [x, 35, 4096], kw)
    s((1,), [x, 35, 4096], kw)
    assert (len(fn.jit), s.direct) == (3, 1)


class CudaLauncher:
    """A stand-in for Triton 3.6's launcher (its class name): the C ``launch`` and the scratch sizes."""

    def __init__(self, scratch):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.raw, self.called = [], []
        self.launch = lambda *a: self.raw.append(a)

    def __call__(self, *a):
        self.called.append(a)


@pytest.mark.parametrize("scratch", [0, 128])
def test_the_c_launch_is_called_as_the_launcher_would(site, scratch):
    """Without scratch buffers the kept kernel's C launch is called with the arguments
    CudaLauncher.__call__ gives it (grid, stream, kernel, cooperative grid, PDL, no scratch, then
    metadata, hooks and the kernel's arguments); with them, CudaLauncher.__call__ itself."""
    fn, s = site
    g = torch.Generator().manual_seed(11)
    x, kw = _x(g), dict(BLOCK=64)
    s((2, 3), [x, 35, 4096], kw)
    (ck,) = fn.ck.values()
    lau = CudaLauncher(scratch)
    for k in s.kept.values():   # (the stand-in kernel was kept with its plain launcher: swap it)
        k.launcher, k.raw = lau, ((lau.launch, False, True) if scratch == 0 else None)
    s((2, 3), [x, 37, 4096], kw)
    if scratch:
        assert not lau.raw and lau.called[0][:3] == (2, 3, 1) and lau.called[0][-4:] == (37, 4096, 64, 7)
    else:
        (a,) = lau.raw
        assert a[:4] == (2, 3, 1, 1234) and a[4] is ck.function and a[5:9] == (False, True, None, None)
        assert a[9] == ck.packed_metadata and a[10:13] == (None, None, None) and a[13] is x
        assert a[14:] == (37, 4096, 64, 7)


def test_keep_chooses_the_c_launch_only_without_scratch(site):
    fn, s = site
    g = torch.Generator().manual_seed(12)
    x, kw = _x(g), dict(BLOCK=64)
    for scratch, raw in ((0, True), (256, False)):
        ck = _CK()
        ck._run = CudaLauncher(scratch)
        s.kept.clear()
        s._keep(("k",), ck, [x, 35, 4096], kw)
        assert (s.kept[("k",)].raw is not None) == raw


def test_a_launcher_that_refuses_the_arguments_turns_the_site_to_the_jit_path(site):
    """A TypeError from the kept launcher (its argument parsing: nothing launched) is said once
    and the launch is made through the JIT, as every later one of that site."""
    fn, s = site
    g = torch.Generator().manual_seed(13)
    x, kw = _x(g), dict(BLOCK=64)
    s((1,), [x, 35, 4096], kw)
    for k in s.kept.values():
        def refuse(*a):
            raise TypeError("function takes exactly 40 arguments (41 given)")
        k.launcher, k.raw = refuse, None
    with pytest.warns(RuntimeWarning, match="direct launch"):
        s((1,), [x, 35, 4096], kw)
    s((1,), [x, 35, 4096], kw)
    assert (len(fn.jit), s.direct, s.fast) == (3, 0, False)


def test_a_module_without_acefuse_launches_through_the_jit():
    """The generated launchers' import (fastlaunch.SRC) falls back to a plain JIT launch where
    acefuse is not importable (an exported module), taking the same arguments."""
    import builtins
    real_import = builtins.__import__

    def no_acefuse(name, *a, **k):
        if name.startswith("acefuse"):
            raise ImportError(name)
        return real_import(name, *a, **k)
    ns = {"__builtins__": dict(vars(builtins), __import__=no_acefuse)}
    exec("\n".join(fl.SRC), ns)
    assert ns["_Site"] is not fl.Site
    fn = _FakeJIT()
    s = ns["_Site"](fn, [None, None, 4096], keyed=[0])
    g = torch.Generator().manual_seed(14)
    x, kw = _x(g), dict(BLOCK=64)
    for _ in range(2):
        s((1,), [x, 35, 4096], kw)
    assert len(fn.jit) == 2


def test_a_tensor_descriptor_is_keyed_by_everything_but_its_address():
    """A host-side TensorDescriptor (the sum kernels' riders on a Hopper GPU): two with the same
    dtype, alignment, shape, strides, block shape and padding over different buffers share a
    key; any of those changed makes another; a field of a type not handled (a Gluon layout
    object) gives None (the JIT path). Where this Triton has its native specialisation, one key
    never covers two of its specialisations."""
    import dataclasses
    from triton.tools.tensor_descriptor import TensorDescriptor as TD
    g = torch.Generator().manual_seed(_rand_int(torch.Generator().manual_seed(16), 0, 2 ** 30))
    n_g, n_f, e = _rand_int(g, 1, 5), 16 * _rand_int(g, 1, 9), 16 * _rand_int(g, 1, 5)
    a, b = torch.zeros(n_g, n_f, e), torch.zeros(n_g, n_f, e)

    def desc(x, shape=None, block=(1, 16, 16), **kw):
        shape = list(shape or x.shape)
        return TD(x, shape, list(x.stride()), list(block), **kw)
    key = fl.spec_key([desc(a)], (0,))
    assert key is not None and fl.spec_key([desc(b)], (0,)) == key
    assert fl.spec_key([desc(a.to(torch.bfloat16))], (0,)) != key                       # dtype
    assert fl.spec_key([desc(a, block=(1, 32, 16))], (0,)) != key                      # block shape
    assert fl.spec_key([desc(a, shape=(n_g, n_f - 1, e))], (0,)) != key               # shape
    assert fl.spec_key([desc(a, padding="nan")], (0,)) != key                          # padding
    t = torch.zeros(n_g, n_f, e + 16)[:, :, :e]
    assert fl.spec_key([TD(t, list(t.shape), list(t.stride()), [1, 16, 16])], (0,)) != key   # strides
    flat = torch.zeros(n_g * n_f * e + 4)
    off = flat[4:].view(n_g, n_f, e)   # 16 bytes in: aligned, the same key
    assert fl.spec_key([desc(off)], (0,)) == key

    @dataclasses.dataclass
    class TensorDescriptor:   # a Gluon-like descriptor with a layout object
        base: torch.Tensor
        shape: list
        layout: object
    assert fl.spec_key([TensorDescriptor(a, [1], object())], (0,)) is None
    native = _native_specialisation()
    if native is None:
        return
    classes = {}
    for n in range(300):
        dt = [torch.float32, torch.bfloat16, torch.float16][n % 3]
        blk = [(1, 16, 16), (1, 32, 16), (1, 16, 64)][(n // 3) % 3]
        x = torch.zeros(n_g, n_f, e, dtype=dt)
        d = TD(x, list(x.shape), list(x.stride()), list(blk), padding=["zero", "nan"][n % 2])
        k = fl.spec_key([d], (0,))
        assert classes.setdefault(k, native(d)) == native(d)
