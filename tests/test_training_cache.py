"""Issue 12's warm start: a training step in a second process with the same ``ACEFUSE_CACHE_DIR``
derives and generates nothing. The frontend's disk index (acefuse/frontend/kernels.py) holds every
kernel of the step: the forward kernels, the backward programs, each backward stage's axis and
kernel (a staged kernel of two modules included: a norm's weight gradient summed over the batch
of rows), the rider modules, and the region programs that have no kernel of a form. Two fresh
subprocesses run the same step on a tiny model (HF-style RMSNorm, LayerNorm, a linear head,
cross-entropy); the second must call no fusion, no backward derivation and no code generation,
and its gradients, like the first's, must match float64 eager (computed here, in this process)."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

RTOL, ATOL = 1e-4, 1e-6      # float32 kernels vs float64 eager (test_training.py's tolerances)

MODEL = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):             # Hugging Face's spelling: pow().mean() in float32
        def __init__(self, c):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(c))

        def forward(self, x):
            v = x.float().pow(2).mean(-1, keepdim=True)
            return self.weight * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)

    class Tiny(nn.Module):
        def __init__(self, c=12, v=9):
            super().__init__()
            self.inp = nn.Linear(c, c)
            self.rms, self.ln = RMSNorm(c), nn.LayerNorm(c)
            self.head = nn.Linear(c, v)

        def forward(self, x, y):
            h = self.inp(self.rms(x))            # (batch, sequence, features): dW sums over two axes
            logits = self.head(self.ln(h))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))

    def make(seed=0):
        torch.manual_seed(seed)
        m = Tiny()
        with torch.no_grad():             # norm weights away from 1 / 0: their gradients matter
            for n, p in m.named_parameters():
                if n.startswith(("rms", "ln")):
                    p.add_(torch.randn_like(p) * 0.3)
        return m

    def data(seed=1):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 5, 12, generator=g), torch.randint(0, 9, (2, 5), generator=g)
''')

CHILD = MODEL + textwrap.dedent('''
    import json, sys, warnings
    import acefuse as af
    from acefuse.frontend.runtime import AcefuseFallbackWarning
    from acefuse.frontend import kernels as K
    counts = {"fuse": 0, "backward": 0, "generated": 0}

    def counting(mod, attr, what):        # every `from module import f` copy in acefuse's modules
        f = getattr(sys.modules[mod], attr)

        def wrapped(*a, **k):
            counts[what] += 1
            return f(*a, **k)
        for m in list(sys.modules.values()):
            if getattr(m, "__name__", "").startswith("acefuse") and getattr(m, attr, None) is f:
                setattr(m, attr, wrapped)
    import acefuse.fuse, acefuse.backward, acefuse.codegen.compile
    counting("acefuse.fuse", "fuse", "fuse")
    counting("acefuse.backward", "backward", "backward")
    counting("acefuse.codegen.compile", "cached_source", "generated")   # every generated module's write
    m = make()
    be = af.Backend(inner="eager")
    cm = torch.compile(m, backend=be, dynamic=False)
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AcefuseFallbackWarning)
        loss = cm(x, y)
        loss.backward()
    regions = [r for cf in be.functions for g in cf.graphs.values() for r in g.af_regions]
    stages = [type(k).__name__ for r in regions if r.grad is not None for k in r.grad._bwd_kernel.kernels]
    torch.save({"loss": loss.detach(), "grads": {n: p.grad for n, p in m.named_parameters()}}, sys.argv[1])
    print("RESULT " + json.dumps({"counts": counts, "stats": dict(K.stats), "stages": stages,
                                  "calls": [dict(r.calls) for r in regions]}))
''')


def _run(cache, out):
    env = {**__import__("os").environ, "ACEFUSE_CACHE_DIR": str(cache)}
    p = subprocess.run([sys.executable, "-c", CHILD, str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), torch.load(out)


def _reference():
    ns: dict = {}
    exec(MODEL, ns)
    m = ns["make"]().double()
    x, y = ns["data"]()
    loss = m(x.double(), y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.slow
def test_second_process_derives_and_generates_nothing(tmp_path):
    from acefuse.proofs import cache as proof_cache
    src = proof_cache.cache_path().parent
    cache = tmp_path / "cache"
    cache.mkdir()
    for f in ("proofs.json", "proofs.key"):          # (the rules' proofs are not this test's work)
        if (src / f).exists():
            (cache / f).write_bytes((src / f).read_bytes())
    ref_loss, ref = _reference()
    runs = [_run(cache, tmp_path / f"out{i}.pt") for i in range(2)]
    for info, got in runs:                           # both processes: kernels everywhere, right gradients
        assert info["calls"] and all(c["grad"] == 1 and c["torch"] == 0 for c in info["calls"]), info
        torch.testing.assert_close(got["loss"].double(), ref_loss, rtol=RTOL, atol=ATOL)
        assert set(got["grads"]) == set(ref)
        for n, r in ref.items():
            assert got["grads"][n] is not None, f"parameter {n} got no gradient"
            torch.testing.assert_close(got["grads"][n].double(), r, rtol=RTOL, atol=ATOL,
                                       msg=lambda msg: f"{n}: {msg}")
    (first, _), (second, _) = runs
    assert first["counts"]["fuse"] and first["counts"]["backward"] and first["counts"]["generated"], first
    # the first process compiled a staged backward stage (the RMSNorm weight gradient over rows)
    assert "StagedKernel" in first["stages"], first["stages"]
    assert second["counts"] == {"fuse": 0, "backward": 0, "generated": 0}, second
    assert second["stats"]["kernel_compiles"] == 0 and second["stats"]["backward_derivations"] == 0, second
    assert second["stats"]["backward_disk_hits"] == len(second["calls"]), second
    assert "_LoadedStaged" in second["stages"], second["stages"]   # the staged stage came from disk
