"""Examples are tests: every script in examples/ runs, and every program it defines
derives, compiles and matches the float64 reference on fresh random inputs."""
import runpy
from pathlib import Path

import numpy as np
import pytest

import acefuse as af
from acefuse.reference import evaluate, random_inputs

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
PROGRAMS = []
for path in EXAMPLES:
    if path.name.startswith("torch_"):
        continue
    ns = runpy.run_path(str(path))
    for name, v in ns.items():
        if isinstance(v, af.Program):
            PROGRAMS.append(pytest.param(path.name, name, v, ns.get("RULES", ()), id=f"{path.stem}:{name}"))


# torch_block.py (41 s on 2 cores) runs with -m slow: tests/test_frontend.py puts the same block
# through both entry points in the default run
@pytest.mark.parametrize("script", [pytest.param(p, marks=pytest.mark.slow) if p.name == "torch_block.py" else p
                                    for p in EXAMPLES], ids=[p.name for p in EXAMPLES])
def test_example_script_runs(script):
    runpy.run_path(str(script), run_name="__main__")


@pytest.mark.parametrize("fname,var,prog,rules", PROGRAMS)
def test_example_program_compiles_and_matches_reference(fname, var, prog, rules):
    k = af.compile(prog, rules=rules)
    axis = k.fusion.axis
    sizes = {a: (29 if a == axis else 6) for a in prog.axes}
    inputs = random_inputs(prog, sizes, seed=len(var))
    out = k(**inputs)
    out = out if isinstance(out, dict) else {next(iter(prog.outputs)): out}
    ref = evaluate(prog, {n: t.double() if t.dtype.is_floating_point else t for n, t in inputs.items()})
    for o, r in ref.items():
        got = out[o].double().numpy()
        err = np.max(np.abs(got - r) / np.maximum(np.abs(r), 1.0))
        assert err < 2e-4, f"{var}.{o}: max rel err {err:.3e}"


@pytest.mark.parametrize("fname,var,prog,rules", PROGRAMS)
def test_example_default_run_sizes_fit_the_cpu_budget(fname, var, prog, rules):
    """``acefuse run FILE --check`` picks sizes per program that finish in seconds in
    Triton's CPU interpreter (attention at 37 x ... x 1000 took over 10 minutes)."""
    from acefuse import cli
    axis = prog.reduced_axes()[0]
    sizes = cli.default_sizes(prog, axis, {}, "cpu")
    assert int(np.prod(list(sizes.values()))) <= cli.SIZE_BUDGET["cpu"], sizes
    assert sizes[axis] >= min(cli.MIN_FUSED, cli.DEFAULT_FUSED)
