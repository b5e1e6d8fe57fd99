"""The built-in corpus of ``acefuse explore``: cascaded programs written plainly, the way a
user would, grouped by kind (norms, losses, statistics, attention variants, routing).

Nothing here is used by the optimizer; these are test subjects for rules. Some are fusible
with the library's rules, some are not (``mean_abs_dev``, ``renyi2``, thresholded routing),
and that is the point: a new rule shows its effect as programs that change.

    >>> from acefuse.workbench.corpus import builtin
    >>> len(builtin()) >= 40
    True
"""
from __future__ import annotations

from dataclasses import dataclass
import math

import acefuse as af


@dataclass(frozen=True)
class Entry:
    """One program of a corpus: where it comes from and what kind it is."""

    name: str          # unique within a run: ``file:program`` for files, the program name here
    category: str
    program: object    # an af.Program
    source: str        # "builtin" or the file it was read from


EPS = 1e-5


def _softmax_parts(s, axis="j"):
    m = af.max(s, axis)
    e = af.exp(s - m)
    return m, e, af.sum(e, axis)


def _norms(P):
    x, w, b = af.tensor("x", "r j"), af.tensor("w", "j"), af.tensor("b", "j")
    mu = af.mean(x, "j")
    var = af.mean((x - mu) ** 2, "j")
    P("layernorm", y=(x - mu) * af.rsqrt(var + EPS) * w + b)
    P("layernorm_plain", y=(x - mu) / af.sqrt(var + EPS))
    P("layernorm_onepass", y=(x - mu) * af.rsqrt(af.mean(x * x, "j") - mu * mu + EPS) * w + b)
    P("rmsnorm", y=x * af.rsqrt(af.mean(x * x, "j") + 1e-6) * w)
    P("rmsnorm_centered", y=(x - mu) * af.rsqrt(af.mean(x * x, "j") + 1e-6))
    P("l2_normalize", y=x / af.maximum(af.sqrt(af.sum(x * x, "j")), 1e-12))
    P("l1_normalize", y=x / af.maximum(af.sum(af.abs(x), "j"), 1e-12))
    P("scalenorm", y=w * x / af.sqrt(af.sum(x * x, "j") + EPS))
    P("std_of_centered", s=af.sqrt(af.mean((x - mu) ** 2, "j")))
    P("minmax_scale", y=(x - af.min(x, "j")) / (af.max(x, "j") - af.min(x, "j") + EPS))
    amax = af.max(af.abs(x), "j")
    P("fp8_quant", q=af.round(x * 448.0 / af.maximum(amax, 1e-12)), scale=amax / 448.0)
    P("int8_absmax_dequant_err", err=af.sum(af.abs(x - af.round(x * 127.0 / amax) * amax / 127.0), "j"))


def _losses(P):
    x, y, t = af.tensor("x", "r j"), af.tensor("y", "r j"), af.tensor("t", "r")
    m, e, l = _softmax_parts(x)
    lse = m + af.log(l)
    P("logsumexp", out=lse)
    P("log_softmax", y=x - lse)
    P("softmax", p=e / l)
    P("cross_entropy", loss=lse - af.take(x, t, "j"))
    P("label_smoothing_ce", loss=lse - 0.9 * af.take(x, t, "j") - 0.1 * af.mean(x, "j"))
    P("soft_target_ce", loss=af.sum(y * (lse - x), "j"))
    P("z_loss", z=lse * lse)
    P("softmax_entropy", h=lse - af.sum(e * x, "j") / l)
    P("renyi2", h=-af.log(af.sum(e * e, "j") / af.sum(e, "j") ** 2))
    P("tsallis2", h=1.0 - af.sum(e * e, "j") / (l * l))
    pt = af.exp(af.take(x, t, "j") - lse)
    P("focal_loss", loss=-((1.0 - pt) * (1.0 - pt)) * (af.take(x, t, "j") - lse))
    P("poly1_ce", loss=lse - af.take(x, t, "j") + (1.0 - pt))
    my, ey, ly = _softmax_parts(y)
    lse_y = my + af.log(ly)
    P("kl_softmax", kl=af.sum(e * ((x - lse) - (y - lse_y)), "j") / l)
    P("temperature_lse", out=2.0 * af.log(af.sum(af.exp((x - m) / 2.0), "j")) + m)
    P("logmeanexp", out=lse - af.log(af.size("j")))
    P("hinge_to_max", loss=af.sum(af.maximum(1.0 + x - af.max(x, "j"), 0.0), "j") - 1.0)


def _statistics(P):
    x, y, w = af.tensor("x", "r j"), af.tensor("y", "r j"), af.tensor("w", "r j")
    mu = af.mean(x, "j")
    var = af.mean((x - mu) ** 2, "j")
    P("variance", var=var)
    P("variance_unbiased", var=af.sum((x - mu) ** 2, "j") / (af.size("j") - 1.0))
    P("skewness", g1=af.mean((x - mu) * (x - mu) * (x - mu), "j") / (var * af.sqrt(var)))
    P("kurtosis", g2=af.mean((x - mu) ** 2 * (x - mu) ** 2, "j") / (var * var))
    P("mean_abs_dev", mad=af.mean(af.abs(x - mu), "j"))
    muw = af.sum(w * x, "j") / af.sum(w, "j")
    P("weighted_variance", var=af.sum(w * (x - muw) ** 2, "j") / af.sum(w, "j"))
    my = af.mean(y, "j")
    cov = af.mean((x - mu) * (y - my), "j")
    P("covariance", cov=cov)
    P("pearson", rho=cov / af.sqrt(var * af.mean((y - my) ** 2, "j")))
    P("max_deviation", d=af.max(x - mu, "j"))
    P("count_above_mean", n=af.sum(af.where(x > mu, 1.0, 0.0), "j"))
    m, e, l = _softmax_parts(x)
    P("softmax_weighted_mean", out=af.sum(e * y, "j") / l)
    P("softmax_weighted_var", out=af.sum(e * (y - af.sum(e * y, "j") / l) ** 2, "j") / l)


def _attention(P):
    q, k, v = af.tensor("q", "b h i d"), af.tensor("k", "b h j d"), af.tensor("v", "b h j e")
    slope, sink = af.tensor("slope", "h"), af.tensor("sink", "h")
    i, j = af.index("i"), af.index("j")
    s = af.sum(q * k, "d") * (1.0 / math.sqrt(64.0))

    def attend(name, sc, **extra):
        m, p, l = _softmax_parts(sc)
        P(name, o=af.sum(p * v, "j") / l, **extra)

    attend("attention", s)
    attend("causal_attention", af.where(j <= i, s, af.NEG_INF))
    attend("alibi_attention", af.where(j <= i, s + slope * (j - i), af.NEG_INF))
    attend("softcap_attention", 30.0 * af.tanh(s / 30.0))
    attend("sliding_window_attention", af.where((j <= i) & (i - j < 128), s, af.NEG_INF))
    attend("prefix_lm_attention", af.where((j <= i) | (j < 16), s, af.NEG_INF))
    m, p, l = _softmax_parts(s)
    attend("attention_with_lse", s, lse=m + af.log(l))
    P("attention_sink", o=af.sum(p * v, "j") / (l + af.exp(sink - m)))
    P("attention_entropy", h=m + af.log(l) - af.sum(p * s, "j") / l)
    P("attention_normalize_inside", o=af.sum(p * v / l, "j"))
    P("quiet_attention", o=af.sum(p * v, "j") / (af.exp(-m) + l))


def _routing(P):
    x, g = af.tensor("x", "t e"), af.tensor("g", "t e")
    m, p, l = _softmax_parts(x, "e")
    P("router_top1_prob", prob=1.0 / l)
    P("router_probs", p=p / l)
    P("router_z_loss", z=(m + af.log(l)) * (m + af.log(l)))
    P("router_entropy", h=m + af.log(l) - af.sum(p * x, "e") / l)
    P("router_threshold_mass", mass=af.sum(af.where(p / l > 0.1, p / l, 0.0), "e"))
    mg, pg, lg = _softmax_parts((x + g) * 2.0, "e")
    P("gumbel_softmax", y=pg / lg)
    P("router_renormalized_top", w=p / af.sum(af.where(x > m - 1.0, p, 0.0), "e"))
    P("sigmoid_router_norm", w=af.sigmoid(x) / af.sum(af.sigmoid(x), "e"))


SECTIONS = (("norms", _norms), ("losses", _losses), ("statistics", _statistics),
            ("attention", _attention), ("routing", _routing))


def builtin() -> list:
    """The built-in corpus: a list of ``Entry`` (fresh programs on every call)."""
    out: list = []
    for cat, make in SECTIONS:
        def P(name, _cat=cat, **outputs):
            out.append(Entry(name, _cat, af.program(name, **outputs), "builtin"))
        make(P)
    return out


# ---- corpora from files ---------------------------------------------------------------------
class CorpusError(ValueError):
    """A corpus could not be read; the message names the file or directory."""


def _programs_in(ns: dict) -> list:
    """Programs defined at module level, or one level down (in a dict, list or tuple, or as
    the ``.program`` of an object: ``examples/masks.py`` keeps its gallery in a dict)."""
    from acefuse.lang import Program
    out, seen = [], set()

    def add(v):
        if isinstance(v, Program) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
        elif isinstance(getattr(v, "program", None), Program):
            add(v.program)

    for k, v in ns.items():
        if k.startswith("__"):
            continue
        add(v)
        if isinstance(v, dict):
            for u in v.values():
                add(u)
        elif isinstance(v, (list, tuple)):
            for u in v:
                add(u)
    return out


def from_file(path, category: str | None = None) -> list:
    """The programs of one Python file, as entries named ``stem:program``."""
    import runpy
    from pathlib import Path
    p = Path(path)
    import contextlib
    import sys
    try:   # whatever the file prints goes to stderr: stdout may be carrying --json
        with contextlib.redirect_stdout(sys.stderr):
            ns = runpy.run_path(str(p), run_name="acefuse_corpus_file")
    except SystemExit as exc:
        raise CorpusError(f"{p}: the file called sys.exit({exc.code}) when loaded") from None
    except Exception as exc:  # a user's file: say which one and why, not a bare traceback
        raise CorpusError(f"{p}: could not be loaded ({type(exc).__name__}: {exc})") from None
    return [Entry(f"{p.stem}:{prog.name}", category or p.stem, prog, str(p)) for prog in _programs_in(ns)]


def examples_dir():
    """The repository's ``examples/`` folder (next to the package in a source checkout, else
    in the current directory); None when there is none."""
    from pathlib import Path
    import acefuse
    for d in (Path(acefuse.__file__).resolve().parents[1] / "examples", Path.cwd() / "examples"):
        if d.is_dir():
            return d
    return None


def load(specs, warn=None) -> list:
    """Entries of every corpus named in ``specs``: ``"builtin"``, ``"examples"``, a folder
    (each ``*.py`` in it) or a ``.py`` file. A file of a folder that fails to load is
    skipped with a message to ``warn``, and a file of a folder whose text never calls
    ``program(`` is not run at all (a folder of examples may hold scripts with side effects,
    like ``examples/torch_block.py``); a file named on its own that fails raises
    ``CorpusError``."""
    from pathlib import Path
    out: list = []
    for spec in specs:
        if spec == "builtin":
            out.extend(builtin())
            continue
        if spec == "examples":
            d = examples_dir()
            if d is None:
                raise CorpusError("--corpus examples: no examples/ folder next to the acefuse package or in the "
                                  "current directory; name the folder with --corpus DIR")
            spec = str(d)
        p = Path(spec)
        if p.is_dir():
            files = sorted(p.glob("*.py"))
            if not files:
                raise CorpusError(f"--corpus {spec}: the folder holds no .py file")
            for f in files:
                if "program(" not in f.read_text(errors="replace"):
                    continue   # defines no program (a script such as examples/torch_block.py): not run
                try:
                    out.extend(from_file(f))
                except CorpusError as exc:
                    if warn:
                        warn(f"skipped {exc}")
        elif p.is_file():
            out.extend(from_file(p))
        else:
            raise CorpusError(f"--corpus {spec}: no such file or folder (use 'builtin', 'examples', a folder "
                              "of .py files or one .py file)")
    names: dict = {}
    uniq = []
    for e in out:   # the same program name twice in one run (two files): number them
        n = names.get(e.name, 0)
        names[e.name] = n + 1
        uniq.append(e if n == 0 else Entry(f"{e.name}#{n + 1}", e.category, e.program, e.source))
    return uniq
