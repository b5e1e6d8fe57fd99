"""The rule DSL: one declarative line per rule, with a stable kebab-case name.

    rw("sum-factor-right", rsum(s, f * k), rsum(s, f) * k, when=[inv(k)])

A rule is either a *rewrite* (lhs = rhs, applied left to right) or an *analysis*
rule (whenever lhs matches, the fact ``then`` holds of it; ``self_`` in ``then``
names the matched term). Side conditions are visible relation facts (``Inv``,
``NonZero``, ``Le``, ``UB``) that the analysis rules establish.

A rule that is exact over the reals but risky in floating point carries
``float_unsafe="why"``; the cost model sees the tag (extract/cost.py). The tag is
checked: ``acefuse prove`` derives it by evaluating the rule in float32 on
adversarial values (proofs/floatcheck.py) and reports a rule whose declared tag
disagrees. Analysis rules carry the tag too (a fact true over the reals but false
in float32, like ``NonZero(exp(a))``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import re

from acefuse.rewrite.terms import Term, RELATIONS

_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def V(name: str, sort: str = "T") -> Term:
    """A pattern variable of a sort (``T``, ``Blk`` or ``String``)."""
    return Term("?", (name, sort))


def tvars(names: str):
    return [V(n, "T") for n in names.split()]


def bvars(names: str):
    return [V(n, "Blk") for n in names.split()]


SELF = V("self_", "T")  # the term matched by an analysis rule's lhs


def fact(rel: str, *args) -> Term:
    if rel not in RELATIONS:
        raise ValueError(f"unknown relation {rel!r}; known: {sorted(RELATIONS)}")
    return Term(rel, tuple(args))


def inv(t):
    """Side condition: t does not depend on the reduced element."""
    return fact("Inv", t)


def nonzero(t):
    """Side condition: t is never zero."""
    return fact("NonZero", t)


def le(a, b):
    """Side condition: a <= b."""
    return fact("Le", a, b)


def ub(m, e, s):
    """Side condition: m >= e for every element of block s."""
    return fact("UB", m, e, s)


def pos(t):
    """Side condition: t > 0 (the two facts ``le(num(0), t)`` and ``nonzero(t)``; ``when``
    lists may contain it as one item)."""
    from acefuse.rewrite.terms import num
    return (le(num(0.0), t), nonzero(t))


def _flat(conds) -> tuple:
    out = []
    for c in conds:
        if isinstance(c, (tuple, list)):
            out.extend(_flat(c))
        elif isinstance(c, Term):
            if c.op not in RELATIONS:
                raise ValueError(f"side condition {c!r} is not a relation fact; use inv(t), nonzero(t), "
                                 f"pos(t), le(a, b) or ub(m, e, s)")
            out.append(c)
        else:
            raise TypeError(f"side condition {c!r} is not a fact; use inv(t), nonzero(t), pos(t), le(a, b) "
                            f"or ub(m, e, s)")
    return tuple(out)


@dataclass(frozen=True)
class Rule:
    name: str
    lhs: Term
    rhs: Term | None = None          # rewrite rules
    then: tuple = ()                 # analysis rules: facts concluded of the match
    when: tuple = ()                 # side conditions (relation facts)
    theory: str = "user"
    float_unsafe: str = ""           # why the rule is risky in floating point ("" = safe)
    doc: str = ""

    @property
    def kind(self) -> str:
        return "rewrite" if self.rhs is not None else "analysis"

    @property
    def float_safe(self) -> bool:
        return not self.float_unsafe

    def variables(self) -> dict[str, str]:
        """Pattern variables and their sorts."""
        out: dict[str, str] = {}
        terms = [self.lhs] + ([self.rhs] if self.rhs is not None else []) + list(self.when) + list(self.then)
        for t in terms:
            for sub in t.walk():
                if sub.op == "?":
                    out[sub.args[0]] = sub.args[1]
                for a in sub.args:
                    if isinstance(a, str) and a.startswith("?"):
                        out[a[1:]] = "String"
        return out

    def egglog(self, ruleset: str) -> str:
        """The rule as egglog text."""
        conds = " ".join(c.sexpr() for c in self.when)
        if self.kind == "rewrite":
            when = f" :when ({conds})" if conds else ""
            return f'(rewrite {self.lhs.sexpr()} {self.rhs.sexpr()}{when} :ruleset {ruleset} :name "{self.name}")'
        facts = " ".join(c.sexpr() for c in self.then)
        return f'(rule ((= {SELF.sexpr()} {self.lhs.sexpr()}) {conds}) ({facts}) :ruleset {ruleset} :name "{self.name}")'

    def __str__(self):
        from acefuse.rewrite.terms import pretty
        cond = (" if " + ", ".join(_fact_str(c) for c in self.when)) if self.when else ""
        if self.kind == "rewrite":
            return f"{self.name}: {pretty(self.lhs)} => {pretty(self.rhs)}{cond}"
        return f"{self.name}: {pretty(self.lhs)}{cond} |- " + ", ".join(_fact_str(c) for c in self.then)


def _fact_str(c: Term) -> str:
    from acefuse.rewrite.terms import pretty
    args = [pretty(a).replace("self_", "it") for a in c.args]
    return f"{c.op}({', '.join(args)})"


def rw(name, lhs, rhs, when=(), float_unsafe="", doc="") -> Rule:
    """A rewrite rule ``lhs => rhs`` (sound as an equation ``lhs = rhs`` under ``when``)."""
    _check_name(name)
    return Rule(name=name, lhs=lhs, rhs=rhs, when=_flat(when), float_unsafe=float_unsafe, doc=doc)


def infer(name, lhs, then, when=(), float_unsafe="", doc="") -> Rule:
    """An analysis rule: when ``lhs`` matches (and ``when`` holds), the facts ``then`` hold.

    ``float_unsafe="why"``: the fact is true over the reals but can be false in
    float32 (``NonZero(exp(a))``: ``exp(-104) == 0``)."""
    _check_name(name)
    then = (then,) if isinstance(then, Term) else tuple(then)
    return Rule(name=name, lhs=lhs, then=then, when=_flat(when), float_unsafe=float_unsafe, doc=doc)


def _check_name(name):
    if not _NAME.match(name):
        raise ValueError(f"rule name {name!r} must be kebab-case (lower-case words joined by '-')")


@dataclass
class Theory:
    """A named group of rules about one algebraic theory."""

    name: str
    doc: str
    rules: list = field(default_factory=list)

    def __post_init__(self):
        self.rules = [r if r.theory == self.name else _retheory(r, self.name) for r in self.rules]


def _retheory(r: Rule, theory: str) -> Rule:
    from dataclasses import replace
    return replace(r, theory=theory)
