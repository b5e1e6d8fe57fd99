"""Inline SVG drawings for ``acefuse show`` (no library, no network): a correction's rule
chain as a graph, from the state's definition over ``A u B`` through each rule the
derivation needs (in the order they first fired, coloured by the schedule phase that runs
them) to the derived form."""
from __future__ import annotations

from html import escape

PHASE_COLOURS = ("#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#ede9fe", "#e0f2fe", "#fee2e2")
WIDTH = 760
BOX_H = 38
GAP = 22
MAX_CHARS = 104


def _clip(text: str, n: int = MAX_CHARS) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def chain(state: str, form: str, start: str, steps: list, result: str, phases: list) -> str:
    """The rule chain of one correction as an SVG graph.

    ``steps``: ``[(rule, theory, phase, first_iteration)]`` in chain order; ``phases``: the
    schedule's phase names (their order picks the colours). Every node carries its full text
    in a ``<title>``; the rule nodes carry ``data-rule``."""
    uid = "arrow-" + "".join(c if c.isalnum() else "-" for c in f"{state}-{form}")   # ids unique in a page
    colour = {p: PHASE_COLOURS[i % len(PHASE_COLOURS)] for i, p in enumerate(phases)}
    nodes = [("start", f"{state}_AB = {start}", "#f3f4f6", None)]
    for rule, theory, phase, it in steps:
        label = f"{rule}   [{theory}; phase {phase or '?'}; first fired in iteration {it if it else '?'}]"
        nodes.append(("rule", label, colour.get(phase, "#f3f4f6"), rule))
    nodes.append(("result", f"{state}_AB = {result}", "#ffffff", None))
    h = len(nodes) * (BOX_H + GAP) - GAP + 8
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chain" width="{WIDTH}" height="{h}" '
           f'viewBox="0 0 {WIDTH} {h}" role="img" data-state="{escape(state)}" data-form="{escape(form)}" '
           f'data-rules="{escape(" ".join(s[0] for s in steps))}">',
           f"<title>{escape(f'{state} {form}: rule chain')}</title>",
           f'<defs><marker id="{uid}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>']
    for k, (kind, text, fill, rule) in enumerate(nodes):
        y = 4 + k * (BOX_H + GAP)
        stroke = "#2563eb" if kind == "rule" else "#6b7280"
        attr = f' data-rule="{escape(rule)}"' if rule else f' data-node="{kind}"'
        out.append(f'<g class="node {kind}"{attr}><title>{escape(text)}</title>'
                   f'<rect x="4" y="{y}" width="{WIDTH - 8}" height="{BOX_H}" rx="7" fill="{fill}" '
                   f'stroke="{stroke}"/>'
                   f'<text x="16" y="{y + BOX_H / 2 + 5}" font-family="monospace" font-size="12">'
                   f'{escape(_clip(rule if rule else text))}</text>')
        if rule:
            detail = text[len(rule):].strip()
            out.append(f'<text x="{WIDTH - 14}" y="{y + BOX_H / 2 + 5}" text-anchor="end" font-family="sans-serif" '
                       f'font-size="11" fill="#374151">{escape(_clip(detail, 70))}</text>')
        out.append("</g>")
        if k + 1 < len(nodes):
            y1, y2 = y + BOX_H, y + BOX_H + GAP
            out.append(f'<line x1="{WIDTH // 2}" y1="{y1}" x2="{WIDTH // 2}" y2="{y2 - 1}" stroke="#555" '
                       f'stroke-width="1.5" marker-end="url(#{uid})"/>')
    out.append("</svg>")
    return "\n".join(out)
