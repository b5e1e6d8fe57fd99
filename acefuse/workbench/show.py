"""``acefuse show``: one derivation as a self-contained HTML page (inline CSS and SVG, no
script, nothing fetched): the program as written, its normal form notes, its states, each
pass with its saturation, every derived update and merge with its rule chain drawn as a
graph (svg.py), the alternatives the e-graph held for each with their costs, the outputs,
and the certificate of every step.

    acefuse show examples/user_rule.py --program renyi2 --html renyi2.html

Alternatives: every e-node of the class ``St(q, A u B)``, each completed with the cheapest
forms of its children, priced by the cost model with the pass's reachability (rolling or
split) and without the float32-overflow restriction that extraction adds for a state whose
forms failed the adversarial check (extract/simulate.py); the form extraction chose is
marked. Nodes that cannot be priced (they read what the schedule cannot see) are counted.
"""
from __future__ import annotations

from html import escape
import time

from acefuse.workbench import svg
from acefuse.workbench.progress import bar


class ShowError(ValueError):
    """The file or program cannot be shown; the message says what to do."""


def _load(path, name):
    import contextlib
    import runpy
    import sys
    from pathlib import Path
    from acefuse.rules.base import Rule
    from acefuse.workbench.corpus import _programs_in
    p = Path(path)
    if not p.is_file():
        raise ShowError(f"acefuse show: no such file: {path}")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            ns = runpy.run_path(str(p), run_name="acefuse_user_file")
    except Exception as exc:  # the user's file: name it and the cause
        raise ShowError(f"acefuse show: {path} could not be loaded ({type(exc).__name__}: {exc})") from None
    progs = _programs_in(ns)
    if not progs:
        raise ShowError(f"acefuse show: {path} defines no program; make one with af.program(name, out=...)")
    if name is None:
        if len(progs) > 1:
            raise ShowError(f"acefuse show: {path} defines {len(progs)} programs "
                            f"({', '.join(q.name for q in progs)}); pick one with --program NAME")
        prog = progs[0]
    else:
        match = [q for q in progs if q.name == name]
        if not match:
            raise ShowError(f"acefuse show: {path} has no program named {name!r}; its programs: "
                            f"{', '.join(q.name for q in progs)}")
        prog = match[0]
    rules = ns.get("RULES", ())
    rules = list(rules.values()) if isinstance(rules, dict) else list(rules)
    if any(not isinstance(r, Rule) for r in rules):
        raise ShowError(f"acefuse show: {path}: RULES must list Rule objects (made with rw(...))")
    return prog, rules


# ---- data ------------------------------------------------------------------------------------------
def alternatives(f, p, state: str, form: str, limit: int = 12) -> dict:
    """The forms the e-graph held for ``St(state, A u B)`` in pass ``p``, under the schedule of
    ``form`` ("rolling" or "merge"): ``{"forms": [(cost, text, chosen)], "unreachable": n,
    "nodes": n}``, cheapest first, at most ``limit`` (the chosen form always listed)."""
    from acefuse.extract.extractor import Extractor, Reach
    from acefuse.extract import cost as C
    from acefuse.rewrite.terms import pretty
    if p.egraph is None:
        return {"forms": [], "unreachable": 0, "nodes": 0}
    ex = getattr(p, "_wb_extractor", None)
    if ex is None:
        ex = Extractor(p.egraph.serialized())
        p._wb_extractor = ex
    names = [s.name for s in p.states]
    i = names.index(state)
    if form == "rolling":
        reach = Reach("rolling", frozenset(names), frozenset(names[:i]))
    else:
        reach = Reach("split", frozenset(names), frozenset(names[:i]))
    cid = ex.class_of(lambda op, args: op == "St" and args and args[0] == state and ex.blk.get(args[1]) == "AB")
    chosen = (p.rolling if form == "rolling" else p.merge).get(state)
    chosen_cost = (p.rolling_cost if form == "rolling" else p.merge_cost).get(state)
    if cid is None:
        return {"forms": [], "unreachable": 0, "nodes": 0}
    costs, best = ex.solve(reach, target=state)
    seen, forms, unreachable, nodes = set(), [], 0, 0
    for nid in ex.cls_nodes[cid]:
        if not ex._is_term(nid):
            continue
        nodes += 1
        c = ex.node_cost(nid, None, reach, costs, state)
        if c == C.INF:
            unreachable += 1
            continue
        forced = dict(best)
        forced[(cid, None)] = nid
        try:
            term = ex.build(cid, None, forced)
        except (RecursionError, ValueError, KeyError):   # a completion that loops back or names no block
            unreachable += 1
            continue
        text = pretty(term)
        if text in seen:
            continue
        seen.add(text)
        forms.append((float(c), text, chosen is not None and term == chosen))
    forms.sort(key=lambda x: (x[0], x[1]))
    out = forms[:limit]
    if chosen is not None and not any(x[2] for x in out):
        hit = [x for x in forms if x[2]]
        out.append(hit[0] if hit else (float(chosen_cost) if chosen_cost is not None else float("nan"),
                                      pretty(chosen), True))
    return {"forms": out, "unreachable": unreachable, "nodes": nodes, "more": max(0, len(forms) - limit)}


def _steps(f, p, state, form):
    """``[(rule, theory, phase, first iteration)]`` of a correction's chain."""
    by_name = {r.name: r for r in f.rules}
    sched = getattr(p, "schedule", None) or f.schedule
    phase_of = {}
    for ph in (sched.phases if sched else ()):
        for th in ph.theories:
            phase_of.setdefault(th, ph.name)
    first = p.stats.first_iteration if p.stats else {}
    out = []
    for n in f.rule_chain(state, form):
        th = by_name[n].theory if n in by_name else "?"
        out.append((n, th, phase_of.get(th, ""), first.get(n)))
    return out, [ph.name for ph in (sched.phases if sched else ())]


# ---- page ------------------------------------------------------------------------------------------
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #111; line-height: 1.4; }
code, pre, .formula { font-family: ui-monospace, monospace; font-size: 13px; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; }
table { border-collapse: collapse; margin: .5em 0 1em; }
td, th { border: 1px solid #d1d5db; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f4f6; }
.ok { color: #166534; font-weight: 600; } .bad { color: #991b1b; font-weight: 600; }
.chosen { background: #ecfdf5; font-weight: 600; }
section.state { border-left: 4px solid #93c5fd; padding-left: 1em; margin: 1.5em 0; }
"""


def _formula(t) -> str:
    return f'<span class="formula">{escape(t)}</span>'


def page(f, source: str = "", alternatives_limit: int = 12) -> str:
    """The HTML page of a fusion ``f``."""
    from acefuse.rewrite.terms import pretty
    from acefuse.fuse import _show, _final_str
    prog, enc = f.program, f.encoding
    L = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         f"<title>acefuse derivation: {escape(prog.name)}</title>", f"<style>{CSS}</style></head><body>"]
    L.append(f"<h1>Derivation of <code>{escape(prog.name)}</code></h1>")
    verdict = ('<span class="ok">fusible</span>' if f.fusible else '<span class="bad">not fully fusible</span>')
    hp = f.hbm_passes
    L.append(f"<p>{escape(source)} &middot; fused axis <code>{escape(f.axis)}</code> &middot; {verdict} &middot; "
             f"HBM passes over the input: unfused {hp['unfused']}, fused {hp['fused']} &middot; "
             f"derived in {f.seconds * 1e3:.0f} ms</p>")
    if not f.fusible:
        L.append(f"<p><b>Why not:</b> {escape(f.reason)}</p>")

    L.append('<h2 id="program">The program</h2><table><tr><th>input</th><th>axes</th></tr>')
    for n, axes in prog.tensors.items():
        L.append(f"<tr><td><code>{escape(n)}</code></td><td>{escape(' '.join(axes))}</td></tr>")
    L.append("</table><table><tr><th>output</th><th>as written</th></tr>")
    for k, e in prog.outputs.items():
        L.append(f"<tr><td><code>{escape(k)}</code></td><td>{_formula(pretty(e.term))}</td></tr>")
    L.append("</table>")
    if f.normal_form:
        L.append("<p>Normal form:</p><ul>" + "".join(f"<li>{escape(n)}</li>" for n in f.normal_form) + "</ul>")

    L.append('<h2 id="states">States</h2><p>Block-local definitions over a block S.</p>'
             "<table><tr><th>state</th><th>kind</th><th>definition</th><th>from</th></tr>")
    for s in enc.states:
        aux = getattr(s, "aux", "")
        L.append(f'<tr class="state-def" data-state="{escape(s.name)}"><td><code>{escape(s.name)}</code></td>'
                 f"<td>{escape(s.op)}{' (auxiliary)' if aux else ''}</td><td>{_formula(_show(s.definition, 'S'))}</td>"
                 f"<td>{_formula(pretty(s.source))}</td></tr>")
    L.append("</table>")

    for p in f.passes:
        L.append(f'<h2 id="pass-{p.index}">Pass {p.index}: carries {escape(", ".join(s.name for s in p.states))}</h2>')
        if p.known:
            L.append(f"<p>With {escape(', '.join(p.known))} final from earlier passes.</p>")
        if p.stats:
            L.append(f"<p>Saturation {escape(p.stats.describe(timing=True))}.</p>")
            if p.stats.phases:
                L.append("<table><tr><th>phase</th><th>stopped</th><th>iterations</th><th>e-nodes</th></tr>"
                         + "".join(f"<tr><td>{escape(str(n))}</td><td>{escape(str(w))}</td><td>{i}</td><td>{k}</td></tr>"
                                   for n, w, i, k in p.stats.phases) + "</table>")
        if not p.split_ok:
            L.append("<p>Split schedule: not available for this pass.</p>")
        for s in p.states:
            L.append(f'<section class="state" id="state-{escape(s.name)}" data-state="{escape(s.name)}">')
            L.append(f"<h3>State <code>{escape(s.name)}</code></h3>")
            L.append(f'<p>init &nbsp; {_formula(f"{s.name}_B = " + pretty(p.init[s.name]))}</p>')
            for form in ("rolling", "merge"):
                forms = p.rolling if form == "rolling" else p.merge
                if s.name not in forms:
                    continue
                L.append(f'<h4 data-state="{escape(s.name)}" data-form="{form}">{form}: '
                         f'{_formula(f"{s.name}_AB = " + pretty(forms[s.name]))}</h4>')
                steps, phases = _steps(f, p, s.name, form)
                if steps:
                    L.append("<p>Rule chain (the rules this form needs, reconstructed by ablation, in the order "
                             "they first fired):</p>")
                else:
                    L.append("<p>Rule chain: none (the form is the definition itself).</p>")
                L.append(svg.chain(s.name, form, pretty(reblock_ab(s, p)), steps, pretty(forms[s.name]), phases))
                alt = _alternatives_cache(f, p, s.name, form, alternatives_limit)
                L.append(f"<details><summary>Alternatives the e-graph held for <code>{escape(s.name)}_AB</code> "
                         f"({form}): {alt['nodes']} e-nodes, {alt['unreachable']} unreachable in this schedule"
                         f"{', ' + str(alt['more']) + ' more not listed' if alt.get('more') else ''}</summary>"
                         f'<table class="alternatives" data-state="{escape(s.name)}" data-form="{form}">'
                         "<tr><th>cost</th><th>form</th></tr>")
                for c, text, chosen in alt["forms"]:
                    L.append(f'<tr{" class=chosen" if chosen else ""}><td>{c:.1f}</td><td>{_formula(text)}'
                             f'{" &nbsp;&larr; chosen" if chosen else ""}</td></tr>')
                L.append("</table></details>")
            L.append("</section>")

    L.append('<h2 id="outputs">Outputs</h2><table><tr><th>output</th><th>from final states</th><th>kind</th></tr>')
    for k, t in enc.outputs.items():
        kind = "epilogue, elementwise over " + f.axis if k in enc.elementwise_outputs else "finalize, per row"
        L.append(f"<tr><td><code>{escape(k)}</code></td><td>{_formula(_final_str(t))}</td><td>{escape(kind)}</td></tr>")
    L.append("</table>")

    cert = f.certificate
    L.append(f'<h2 id="certificate">Certificate: {"<span class=ok>every step certified</span>" if cert.ok else "<span class=bad>not every step certified</span>"}</h2>')
    L.append("<table><tr><th>step</th><th>state / output</th><th>status</th><th>detail</th></tr>")
    for c in cert.steps:
        cls = "ok" if c.ok else "bad"
        L.append(f'<tr class="cert" data-step="{escape(c.step)}" data-state="{escape(c.state)}"><td>{escape(c.step)}</td>'
                 f"<td><code>{escape(c.state)}</code></td><td class={cls}>{escape(c.status)}</td>"
                 f"<td>{escape(c.detail)}</td></tr>")
    L.append("</table>")
    L.append("<h2 id=\"explain\">explain()</h2><pre>" + escape(f.explain()) + "</pre>")
    L.append(f"<p><small>acefuse show, {time.strftime('%Y-%m-%d %H:%M:%S')}</small></p></body></html>")
    return "\n".join(L)


def reblock_ab(s, p):
    """The state's definition over ``A u B`` (earlier passes' states as final values)."""
    from acefuse.fuse import _known_to_final, AB, J
    from acefuse.rewrite.terms import Term, reblock
    finals = {k: Term("St", (k, J)) for k in p.known}
    return reblock(_known_to_final(s.definition, finals), AB)


_ALT: dict = {}


def _alternatives_cache(f, p, state, form, limit):
    key = (id(f), p.index, state, form, limit)
    if key not in _ALT:
        _ALT[key] = alternatives(f, p, state, form, limit)
    return _ALT[key]


def write(path, out, program=None, axis=None, alternatives: int = 12, quiet: bool = False) -> str:
    """Derive ``program`` of the file ``path`` (with the file's ``RULES``) and write its page."""
    from pathlib import Path
    from acefuse.fuse import fuse
    prog, rules = _load(path, program)
    steps = bar(total=4, quiet=quiet, desc=f"show {prog.name}", unit="step")
    try:
        steps.set_postfix_str("derive")
        try:
            f = fuse(prog, axis=axis, rules=rules)
        except Exception as exc:  # FuseError, an unproved rule: say which program
            raise ShowError(f"acefuse show: program {prog.name!r} of {path}: {exc}") from None
        steps.update()
        steps.set_postfix_str("rule chains")
        for p in f.passes:
            for s in p.states:
                f.rule_chain(s.name, "rolling")
        steps.update()
        steps.set_postfix_str("alternatives")
        for p in f.passes:
            for s in p.states:
                for form in ("rolling", "merge"):
                    if form == "rolling" or s.name in p.merge:
                        _alternatives_cache(f, p, s.name, form, alternatives)
        steps.update()
        steps.set_postfix_str("certificate")
        f.certificate
        steps.update()
        html = page(f, source=str(path), alternatives_limit=alternatives)
    finally:
        steps.close()
        _ALT.clear()
    dst = Path(out)
    if dst.parent and not dst.parent.exists():
        raise ShowError(f"acefuse show: --html {out}: the folder {dst.parent} does not exist")
    dst.write_text(html, encoding="utf-8")
    return str(dst)
