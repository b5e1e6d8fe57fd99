"""Auxiliary states: reductions the program does not compute, that a merge needs.

``sum_j (x - max_j x)^2`` has states ``m = max_S(x)`` and ``s = sum_S((x - m_S)^2)``.
Its rolling update, after the shift ``m_AB = m_A + e`` and the binomial expansion,
is ``s_A - 2 e sum_A(x - m_A) + n_A e^2 + sum_B(...)``: one term is a sum over the
folded block A that no state carries, so the update is unreachable and the
program takes two passes. The e-graph already holds that sum (and its other
forms, ``sum_A(x) - n_A m_A``, ...): the rewrite system *proposes* it.

Discovery (acefuse/fuse.py drives it, this module holds its pieces): for a state
with no reachable rolling form, extraction runs once more with ``Reach.discover``
(extract/extractor.py): a ``sum_A(body)``
whose body is *A-local* (elements, constants, per-row values, ``n_A``, states
over A updated earlier in the pass) is reachable, at the price of one more
carried state (``cost.AUX_STATE`` plus its body per element). The cheapest form
names the sums to add: each becomes an auxiliary state ``aux = sum_S(body)``
(body over the block S), inserted before the state that needs it. The pass is
then derived again with the new states, so every auxiliary state needs its own
rolling update and merge, derived and certified like any other (one that is
itself unreachable proposes its own auxiliaries: ``sum (x - m)^3`` needs
``sum (x - m)^2``, which needs ``sum (x - m)``). Extraction then chooses among all
forms with the states present, and ``prune`` drops the auxiliary states that no
chosen form reads. The numerics term of the cost (cancellation at a large
offset) is what prefers the shifted ``sum_A(x - m_A)`` to the raw moment
``sum_A(x)``; the adversarial float32 check (extract/simulate.py) still refuses
any form that loses accuracy, and the state then takes another pass.

Which e-graph: the pass is first derived with the plain schedule, as always. If a
state is blocked and nothing is proposed, the pass is derived again with the
discovery schedules in turn (rewrite/schedules.py, ``discovery``: the binomial
expansion without general distributivity, whose e-graph stays small, then with
it), small integer powers of state-reading values written as products
(``expand_powers``). A discovery schedule that loses a state the plain one derives
is passed over; when nothing is found, the plain derivation of the pass stands.
``MAX_ROUNDS`` bounds the re-derivations of one program.

Nothing here names a workload: the candidates are whatever sums the rules
produced, and the choice is the cost model's.
"""
from __future__ import annotations

from dataclasses import replace

from acefuse.rewrite.terms import Term, A, pretty
from acefuse.rewrite.encode import StateDef, Encoding

MAX_ROUNDS = 6        # derivations of one pass with new auxiliary states, at most
MAX_STATES = 8        # auxiliary states of one program, at most
PREFIX = "aux"


def proposals(term: Term) -> list:
    """The bodies (over block A) of the sums over A that a discovered form reads, in order."""
    out: list = []

    def walk(t):
        if t.op == "Sum" and t.args[0].op == "BA":
            if t.args[1] not in out:
                out.append(t.args[1])
            return
        for c in t.children:
            walk(c)
    walk(term)
    return out


def to_program(enc: Encoding, t: Term) -> Term:
    """A block-local body as a program-level term (leaves, states and counts replaced by
    what they stand for), to name an auxiliary state in explanations."""
    if t.op in ("Elm", "Par"):
        return enc.leaves.get(t.args[0], t)
    if t.op == "St":
        return enc.state(t.args[0]).source
    if t.op == "Cnt":
        return Term("Size", (enc.axis,))
    if not t.children:
        return t
    return Term(t.op, tuple(to_program(enc, a) if isinstance(a, Term) else a for a in t.args))


def add(enc: Encoding, target: str, bodies: list, form: Term, known_defs: dict) -> tuple:
    """``enc`` with an auxiliary state ``sum_S(body)`` for every new body, inserted before
    ``target``; (new encoding, names added). ``known_defs`` maps a definition to the name it
    already has (an auxiliary proposed twice is added once)."""
    states = list(enc.states)
    pos = next(i for i, s in enumerate(states) if s.name == target)
    taken = {s.name for s in states} | set(enc.leaves)
    added = []
    n_aux = sum(1 for s in states if s.aux)
    for body in bodies:
        d = Term("Sum", (A, body))
        if d in known_defs or any(s.definition == d for s in states):
            continue
        if n_aux >= MAX_STATES:
            break
        k = 1
        while (name := PREFIX if k == 1 else f"{PREFIX}{k}") in taken:
            k += 1
        taken.add(name)
        deps = tuple(dict.fromkeys(u.args[0] for u in d.walk() if u.op == "St"))
        src = Term("Sum", (Term("Ax", (enc.axis,)), to_program(enc, body)))
        why = (f"the update of {target} ({target}_AB = {pretty(form)}) reads sum_A({pretty(body)}), a sum "
               f"over the folded block A whose elements are gone and which no state of the program carries")
        states.insert(pos, StateDef(name, "sum", d, src, deps, aux=why))
        pos += 1
        n_aux += 1
        known_defs[d] = name
        added.append(name)
    return replace(enc, states=states), added


def used(p, enc: Encoding) -> set:
    """The auxiliary states of pass ``p`` that some chosen form reads (transitively from the
    program's own states)."""
    aux = {s.name for s in enc.states if s.aux}
    forms = {**{k: [v] for k, v in p.rolling.items()}}
    for k, v in p.merge.items():
        forms.setdefault(k, []).append(v)
    need: set = set()
    todo = [s.name for s in p.states if s.name not in aux]
    seen = set(todo)
    while todo:
        q = todo.pop()
        for t in forms.get(q, ()):
            for u in t.walk():
                if u.op == "St" and u.args[0] in aux and u.args[0] not in seen:
                    seen.add(u.args[0])
                    need.add(u.args[0])
                    todo.append(u.args[0])
    return need


def prune(enc: Encoding, keep: set) -> Encoding:
    """``enc`` without the auxiliary states outside ``keep``."""
    return replace(enc, states=[s for s in enc.states if not s.aux or s.name in keep])


def _lower(t: Term) -> Term:
    if not t.children:
        return t
    args = tuple(_lower(a) if isinstance(a, Term) else a for a in t.args)
    if (t.op == "Pow" and isinstance(args[1], float) and args[1] in (3.0, 4.0)
            and any(u.op in ("St", "Cnt") for u in args[0].walk())):
        r = args[0]
        for _ in range(int(args[1]) - 1):
            r = Term("Mul", (r, args[0]))
        return r
    return Term(t.op, args)


def expand_powers(enc: Encoding, names) -> Encoding:
    """``enc`` with the small integer powers (3, 4) of values that read states, in the
    definitions of the states ``names``, written as the products the certificate lowers them
    to (proofs/certify.py, lower_pow): the binomial rules expand products, so the shifted body
    of ``sum_j (x - max_j x)**3`` can be derived. Only for re-derivations with the discovery
    schedules: in the plain derivation a power stays opaque and its e-graph small."""
    names = set(names)
    return replace(enc, states=[replace(s, definition=_lower(s.definition)) if s.name in names else s
                                for s in enc.states])
