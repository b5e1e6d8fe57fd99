"""The backward of a sharded call: the derived backward stages (``af.backward``) run on the
shards, exchanging what the derivation says must be exchanged.

The plan is read off the backward program's terms, nothing names a workload:

- **Saved values are the merged ones.** The forward runs the augmented program (outputs +
  saved values) sharded, so a row's max and sum are the global ones and each rank's
  backward recomputes its local probabilities exactly.
- **Hoisting.** A reduction over a sharded axis (the sharded axis ``J`` or an axis the
  ranks hold slices of, ``axis_offsets=``/``zigzag=``: the queries of context parallelism)
  nested inside another reduction, or in a position where partial values do not add up, is
  computed first as a value of its own (global, exchanged) and read as an input: the max
  adjoint's count of ties, ``sum_j(p_j * dP_j)`` inside a max adjoint.
- **Classes of outputs** (each stage output and each hoisted value), by the reductions over
  sharded axes left at a *linear* position (``sum_j(...)`` under +, -, a product or a
  quotient by a factor free of them, a where's branches; nothing added that is not):
  ``local`` (none: the rank's own block gives it), ``rows`` (a sum over ``J``, output not
  over ``J``: combined over every ``J`` shard: the ring accumulates while the shards visit,
  the all-gather variant sums over all of them, the state exchange all-reduces partials),
  ``home`` (over ``J``, a sum over a distributed axis: the contributions of every rank's
  rows go back to the shard's owner: the ring in reverse, each accumulator travelling with
  its shard and returning home, or a reduce-scatter after the all-gather), ``all`` (a sum
  over a distributed axis, output not over ``J``: all-reduced).
- **Levels.** A program runs once the values it reads are complete; the programs of one
  level share one ring (or one gather).
"""
from __future__ import annotations

from pathlib import Path

from acefuse.rewrite.terms import Term, pretty
from acefuse.distributed.base import DistributedError, instantiate, ring_peers, ring_shift, gpos, gpos_inputs

_LIN = ("Add", "Sub", "Neg")


def _red_axis(t):
    from acefuse.rewrite.encode import RED_OPS
    if t.op in RED_OPS and t.args and isinstance(t.args[0], Term) and t.args[0].op == "Ax":
        return t.args[0].args[0]
    return None


def _reads(t) -> set:
    return {u.args[0] for u in t.walk() if u.op in ("In", "Take")}


# ---- the plan: hoisting and classes ------------------------------------------------------
class _Prog:
    """One program of the plan: a (rewritten) backward stage or a hoisted value."""

    def __init__(self, name, outputs, kinds, combine):
        from acefuse.lang import Program, Expr
        self.outputs = outputs            # {name: (term, axes, tensors)}
        self.program = Program(name, {o: Expr(t, ax, tens) for o, (t, ax, tens) in outputs.items()})
        self.kinds = kinds                # {output: 'local' | 'rows' | 'home' | 'all'}
        self.combine = combine            # {output: 'sum' | 'max' | 'min'}
        self.level = 0
        self.is_block = any(k == "block" for k in kinds.values())

    @property
    def tensors(self):
        return self.program.tensors


class Plan:
    """The sharded backward of one backward program, for a sharded axis ``J`` and the
    distributed axes ``D`` (axes whose local tensors are each rank's slice)."""

    def __init__(self, bwd, J, D):
        from acefuse.rewrite.encode import _Axes
        self.bwd, self.J, self.D = bwd, J, frozenset(D)
        self.sharded = {J} | set(D)
        self.tensors = {}
        for st in bwd.stages:
            self.tensors.update(st.tensors)
        self._ax = _Axes(self.tensors)
        self.order = []
        for st in bwd.stages:
            for a in st.axes:
                if a not in self.order:
                    self.order.append(a)
        self.hoisted = {}                 # term -> name
        self.progs = []
        stage_progs = []
        # an intermediate over J and a distributed axis (a pre-stage's scores over (i, j)) exists
        # only while a row shard and a J shard are on one rank: computed per block, never exchanged
        self.block_of = {}
        for st in bwd.stages:
            outs, kinds, comb = {}, {}, {}
            for o, e in st.outputs.items():
                if o not in bwd.outputs and J in e.axes and set(e.axes) & self.D:
                    kinds[o], comb[o] = "block", "sum"
                    outs[o] = (e.term, tuple(e.axes), {n: self.tensors[n] for n in sorted(_reads(e.term))})
                    continue
                term = self._top(e.term, set(e.axes))
                if not self._homogeneous(term, set(e.axes)) and self._kept(term, set(e.axes)):
                    term = self._nested(e.term)    # partials would not add up: hoist them all
                outs[o] = (term, tuple(e.axes), {n: self.tensors[n] for n in sorted(_reads(term))})
                kinds[o] = self._kind(st.name, o, term, set(e.axes))
                comb[o] = "sum"
            # one program per outermost reduced axis (an inlined intermediate may have moved
            # an output's reduction off the stage's fused axis)
            groups: dict = {}
            for o, v in outs.items():
                groups.setdefault(self._root_axis(v[0]), {})[o] = v
            for gi, (_, g) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
                for blk in (True, False):    # block values apart from the rest
                    part = {o: v for o, v in g.items() if (kinds[o] == "block") == blk}
                    if part:
                        pr = _Prog(f"{st.name}_shard{gi}{'b' if blk else ''}", part, {o: kinds[o] for o in part},
                                   {o: comb[o] for o in part})
                        stage_progs.append(pr)
                        if blk:
                            self.block_of.update({o: pr for o in part})
        self.progs += stage_progs          # hoisted values were appended while rewriting
        self._levels()

    # -- rewriting ---------------------------------------------------------------------------
    @staticmethod
    def _root_axis(t):
        for u in t.walk():
            a = _red_axis(u)
            if a is not None:
                return a
        return None

    def _has(self, t) -> bool:
        return any(_red_axis(u) in self.sharded for u in t.walk())

    def _nested(self, t):
        """``t`` with every reduction over a sharded axis replaced by a hoisted value."""
        if not t.children:
            return t
        u = Term(t.op, tuple(self._nested(a) if isinstance(a, Term) else a for a in t.args))
        return self._hoist(u) if _red_axis(u) in self.sharded else u

    def _hoist(self, u):
        if u not in self.hoisted:
            a = _red_axis(u)
            axes = tuple(x for x in self.order if x in self._ax(u))
            name = f"hoisted{len(self.hoisted)}_{a}"
            while name in self.tensors:
                name += "_"
            self.hoisted[u] = name
            self.tensors[name] = axes
            self._ax.memo.clear()
            outs = {name: (u, axes, {n: self.tensors[n] for n in sorted(_reads(u))})}
            kind = self._kind(name, name, u, set(axes))
            self.progs.append(_Prog(f"{self.bwd.name}_{name}", outs, {name: kind},
                                    {name: {"Sum": "sum", "RMax": "max", "RMin": "min"}[u.op]}))
        return Term("In", (self.hoisted[u],))

    def _top(self, t, out_axes):
        """Reductions over a sharded axis not in ``out_axes`` kept where partial values add
        up (their bodies' own sharded reductions hoisted); any other hoisted."""
        a = _red_axis(t)
        if a in self.sharded and a not in out_axes:
            return Term(t.op, (t.args[0], self._nested(t.args[1])) + tuple(t.args[2:]))
        op = t.op
        if op in _LIN:
            return Term(op, tuple(self._top(c, out_axes) for c in t.args))
        if op == "Mul":
            x, y = t.args
            if not self._has(y):
                return Term(op, (self._top(x, out_axes), y))
            return Term(op, (self._nested(x) if self._has(x) else x, self._top(y, out_axes)))
        if op == "Div":
            return Term(op, (self._top(t.args[0], out_axes), self._nested(t.args[1])))
        if op == "Where":
            return Term(op, (self._nested(t.args[0]), self._top(t.args[1], out_axes), self._top(t.args[2], out_axes)))
        return self._nested(t)

    def _kept(self, t, out_axes) -> set:
        return {_red_axis(u) for u in t.walk() if _red_axis(u) in self.sharded and _red_axis(u) not in out_axes}

    def _homogeneous(self, t, out_axes) -> bool:
        """``t`` is a sum of (products with / quotients by factors free of them) kept
        reductions: per-block values add up to the whole."""
        if not self._kept(t, out_axes):
            return t.op == "Num" and t.args[0] == 0.0
        a = _red_axis(t)
        if a in self.sharded and a not in out_axes:
            return True
        op = t.op
        if op in _LIN:
            return all(self._homogeneous(c, out_axes) for c in t.args)
        if op == "Mul":
            x, y = t.args
            return (self._homogeneous(x, out_axes) and not self._kept(y, out_axes)) or \
                (not self._kept(x, out_axes) and self._homogeneous(y, out_axes))
        if op == "Div":
            return self._homogeneous(t.args[0], out_axes) and not self._kept(t.args[1], out_axes)
        if op == "Where":
            return not self._kept(t.args[0], out_axes) and all(self._homogeneous(c, out_axes) for c in t.args[1:])
        return False

    def _kind(self, where, o, term, out_axes):
        kept = self._kept(term, out_axes)
        J = self.J
        if J in out_axes and out_axes & self.D:
            raise DistributedError(
                f"backward of {self.bwd.forward.name!r}: {where}'s output {o!r} ranges over the sharded axis {J!r} "
                f"and the distributed axis/axes {sorted(out_axes & self.D)} at once (a block of it on every rank "
                "pair); shard one of them only, or call the kernel without process_group")
        if not kept:
            return "local"
        if J in kept and kept & self.D:
            raise DistributedError(f"backward of {self.bwd.forward.name!r}: {where}'s output {o!r} sums over "
                                   f"{J!r} and {sorted(kept & self.D)} in separate terms (an acefuse bug: it "
                                   "should have been hoisted; please report the program)")
        if J in kept:
            return "rows"
        return "home" if J in out_axes else "all"

    def _levels(self):
        """A program's level: one more than the levels of the values it reads (a block value
        is computed inside its reader's block, at the level of what it reads itself)."""
        made = {}
        for p in self.progs:
            for o in p.outputs:
                made[o] = p
        done = {}

        def level(p):
            if id(p) not in done:
                done[id(p)] = 0
                deps = [made[n] for n in p.tensors if n in made and made[n] is not p]
                top = max((level(d) for d in deps), default=-1)
                done[id(p)] = top if p.is_block else top + 1
            return done[id(p)]
        for p in self.progs:
            p.level = level(p)
        rest = [p for p in self.progs if not p.is_block]
        self.levels = [[p for p in rest if p.level == k] for k in range(1 + max((p.level for p in rest), default=-1))]

    def closure(self, p) -> list:
        """The block programs ``p`` reads (directly or through another), readers last."""
        out = []

        def go(q):
            for n in q.tensors:
                b = self.block_of.get(n)
                if b is not None and b is not q and b not in out:
                    go(b)
                    out.append(b)
        go(p)
        return out

    def describe(self) -> str:
        L = []
        for k, lv in enumerate(self.levels):
            for p in lv:
                for o, (t, ax, _) in p.outputs.items():
                    L.append(f"level {k} {p.kinds[o]:5s} {p.combine[o]} {o}[{' '.join(ax)}] = {pretty(t)}")
        return "\n".join(L)


# ---- running the plan --------------------------------------------------------------------
class ShardedBackward:
    """Runs a Plan on the ranks of a ShardedKernel's group."""

    send_home = True   # False only in tests: the reverse ring skipped (a broken exchange must fail them)
    skip_masked = True   # the ring skips blocks the forward's mask analysis proves fully masked (_skip)
    skipped = 0          # blocks skipped so far (per instance once counted; tests and benchmarks read it)

    def __init__(self, bwd, plan, compile_kw):
        self.sk, self.bwd, self.plan = None, bwd, plan
        self._final = frozenset(bwd.grads.values())     # gradients returned as they are computed
        self.kw = dict(compile_kw)
        self._kernels = {}
        for p in plan.progs:     # the derivations, once (kernels with global offsets come from them)
            try:
                self._kernel(p, {}, {})
            except Exception as e:  # noqa: BLE001 - say which program of the plan
                raise DistributedError(
                    f"backward of {bwd.forward.name!r} across ranks: the program {p.program.name!r} (computing "
                    f"{', '.join(p.outputs)}) does not compile ({type(e).__name__}: {str(e).splitlines()[0]}). "
                    "Gather the shards and call the kernel without process_group for its gradient") from e

    # -- kernels --------------------------------------------------------------------------
    def _kernel(self, p, offsets, gsizes):
        terms = [t for t, _, _ in p.outputs.values()]
        used_i = {u.args[0] for t in terms for u in t.walk() if u.op == "Idx"}
        used_s = {u.args[0] for t in terms for u in t.walk() if u.op == "Size"}
        offs = {a: int(v) for a, v in offsets.items() if a in used_i}
        gs = {a: int(v) for a, v in gsizes.items() if a in used_s}
        # the offsets are runtime inputs (gpos_a): one kernel per program for every block offset,
        # unless that kernel's mask analysis skips fewer tiles than with the offsets as constants
        key = (id(p), tuple(sorted(offs)), tuple(sorted(gs.items())))
        k = self._kernels.get(key)
        if k is None:
            base = self._kernels.get((id(p), (), ()))
            if base is None:
                base = self._kernels[(id(p), (), ())] = self._compile(p, {}, {}, False)
            if not offs and not gs:
                return base
            k = self._compile(p, offs, gs, True)
            # (a constant offset keeps the plain program's mask analysis: the base counts)
            if offs and _mask_marks(k) < _mask_marks(base):
                k = _CONSTANTS
            self._kernels[key] = k
        if k is _CONSTANTS:
            return self._const(p, offs, gs)
        return k

    def _compile(self, p, offs, gs, runtime):
        """``p``'s program with index(a) -> index(a) + gpos_a (``runtime``: a 0-d input, the
        block's global offset given per launch; else the offset's value) and its global lengths
        fixed, derived again (a template's own instantiation of the fused forms does not reach
        every place the mask is read)."""
        from acefuse.autograd import compile_stage
        if not offs and not gs:
            return compile_stage(p.program, **self.kw)
        from acefuse.lang import Program, Expr

        def expr(e):
            t = instantiate(e.term, offs, gs, runtime=runtime)
            read = {u.args[0] for u in t.walk() if u.op == "In"}
            return Expr(t, e.axes, {**e.tensors, **{gpos(a): () for a in sorted(offs) if gpos(a) in read}})
        return compile_stage(Program(p.program.name, {o: expr(e) for o, e in p.program.outputs.items()}), **self.kw)

    def _const(self, p, offs, gs):
        """The kernel of ``p`` with these offsets as constants (one per offset: the fallback
        when the runtime-offset kernel loses mask analysis)."""
        key = (id(p), "constants", tuple(sorted(offs.items())), tuple(sorted(gs.items())))
        if key not in self._kernels:
            k = self._kernels[key] = self._compile(p, offs, gs, False)
            _share_tuning(self._kernels[(id(p), (), ())], k)
        return self._kernels[key]

    def _run(self, p, env, offsets, gsizes, opts):
        """{output: float32 tensor laid out over its declared axes} of ``p`` on one block."""
        import torch
        k = self._kernel(p, offsets, gsizes)
        names = getattr(getattr(k, "fusion", None), "encoding", None)
        names = list(names.tensors) if names is not None else list(p.tensors)
        env = {**env, **gpos_inputs(offsets, next((v.device for v in env.values() if hasattr(v, "device")), None))}
        ins = {n: env[n] for n in names}
        run_kw = {o: v for o, v in opts.items() if o in ("num_warps", "num_stages", "block_i", "block_j", "block_r")}
        try:
            out = k(**ins, **run_kw)
        except (TypeError, ValueError):
            out = k(**ins)
        outs = out if isinstance(out, dict) else {next(iter(p.outputs)): out}
        # values combined across blocks or ranks, and values later programs read, in float32;
        # a gradient complete on this rank (kind 'local': a vocab shard's logit gradient) stays
        # in the kernel's type (widening it cost two passes over the shard and a cast back)
        done = self._final
        return {o: outs[o] if outs[o].dtype == torch.float64 or (o in done and p.kinds.get(o) == "local")
                else outs[o].float() for o in p.outputs}

    # -- running ----------------------------------------------------------------------------
    def run(self, env, info, opts):
        """Every level of the plan on this rank; ``env``: name -> local tensor (forward inputs,
        saved values, cotangents), extended with every value computed. ``info``: mode, world,
        rank, sizes (shard lengths along J), offsets (distributed axes), gsizes, zigzag."""
        self.info = info
        for lv in self.plan.levels:
            self._level(lv, env, opts)
        return env

    def _combine(self, a, b, how):
        import torch
        if a is None:
            return b
        return a + b if how == "sum" else torch.maximum(a, b) if how == "max" else torch.minimum(a, b)

    def _combine_into(self, acc, b, how):
        """``acc`` <- combine(acc, b) in place (one pass: the ring's travelling dK/dV slices
        were combined into a new tensor and copied back, two)."""
        import torch
        if how == "sum":
            acc.add_(b)
        else:
            (torch.maximum if how == "max" else torch.minimum)(acc, b, out=acc)

    def _all_reduce(self, vals: dict, combine: dict):
        """One all_reduce per combine kind over every value given (flattened, concatenated)."""
        import torch
        import torch.distributed as dist
        out = dict(vals)
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        for how in ("sum", "max", "min"):
            names = [o for o in vals if combine[o] == how]
            if not names:
                continue
            flat = torch.cat([vals[o].float().reshape(-1) for o in names])
            dist.all_reduce(flat, op=ops[how], group=self.sk.group)
            pos = 0
            for o in names:
                n = vals[o].numel()
                out[o] = flat[pos:pos + n].view(vals[o].shape)
                pos += n
        return out

    def _pieces(self, rows: dict):
        """The rank's row inputs split where the zig-zag axes jump: [(inputs, offsets)]."""
        info = self.info
        zz = info["zigzag"]
        if not zz:
            return [(rows, dict(info["offsets"]))]
        out = []
        for start, n, off in self.sk._chunks(info["rank"], info["sizes"], True):
            ins = {}
            for t, x in rows.items():
                ax = self.plan.tensors.get(t, ())
                a = next((a for a in zz if a in ax), None)
                ins[t] = x.narrow(ax.index(a), start, n).contiguous() if a is not None else x
            offs = dict(info["offsets"])
            offs.update({a: off for a in zz})
            out.append((ins, offs))
        return out

    def _join(self, vals, axes, how):
        """Per-piece values of one output joined: along the zig-zag axis it ranges over, else
        the first (the pieces computed the same value)."""
        import torch
        if len(vals) == 1:
            return vals[0]
        za = [a for a in self.info["zigzag"] if a in axes]
        return torch.cat(vals, dim=axes.index(za[0])) if za else vals[0]

    def _block(self, progs, ins, offs, gs, opts):
        """The outputs of ``progs`` on one block (block values they read computed here)."""
        env = dict(ins)
        res = {}
        for p in progs:
            for b in self.plan.closure(p):
                if not all(o in env for o in b.outputs):
                    env.update(self._run(b, env, offs, gs, opts))
            out = self._run(p, env, offs, gs, opts)
            res.update(out)
        return res

    def _level(self, progs, env, opts):
        plan, info = self.plan, self.info
        J = plan.J
        kinds = {o: p.kinds[o] for p in progs for o in p.outputs}
        comb = {o: p.combine[o] for p in progs for o in p.outputs}
        axes = {o: p.outputs[o][1] for p in progs for o in p.outputs}

        def reads_j(p):
            return any(J in plan.tensors[n] for q in plan.closure(p) + [p] for n in q.tensors
                       if n not in plan.block_of)
        pj = [p for p in progs if reads_j(p)]
        pn = [p for p in progs if not reads_j(p)]
        gs = dict(info["gsizes"])
        new = {}
        # programs of the rows alone (a pre-stage's sum_e(grad_o * o)): once per row piece
        if pn:
            rows = {n: env[n] for q in pn for n in q.tensors}
            per = [self._block(pn, ins, offs, gs, opts) for ins, offs in self._pieces(rows)]
            for o in per[0]:
                if kinds[o] == "all":
                    v = per[0][o]
                    for r in per[1:]:
                        v = self._combine(v, r[o], comb[o])
                    new[o] = v
                else:
                    new[o] = self._join([r[o] for r in per], axes[o], comb[o])
            alls = {o: new[o] for o in new if kinds[o] == "all"}
            if alls:
                new.update(self._all_reduce(alls, comb))
        if pj:
            mode = info["mode"]
            if mode == "states" and any(kinds[o] in ("home", "all") for p in pj for o in p.outputs):
                raise DistributedError(f"backward of {plan.bwd.forward.name!r}: sums over distributed axes with "
                                       "exchange='states'; use exchange='ring' or 'gather'")
            fn = {"ring": self._ring, "gather": self._gather}.get(mode, self._states)
            new.update(fn(pj, env, opts, kinds, comb, axes))
        env.update(new)

    def _states(self, progs, env, opts, kinds, comb, axes):
        """The rows are the same on every rank: the rank's own block; sums over J all-reduced."""
        info = self.info
        gs = dict(info["gsizes"])
        offs = dict(info["offsets"])
        offs[self.plan.J] = sum(info["sizes"][:info["rank"]])
        res = self._block(progs, {n: env[n] for p in progs for q in self.plan.closure(p) + [p] for n in q.tensors
                                  if n in env}, offs, gs, opts)
        rows = {o: v for o, v in res.items() if kinds.get(o) == "rows"}
        if rows:
            res.update(self._all_reduce(rows, comb))
        return {o: v for o, v in res.items() if o in kinds}

    def _needed(self, progs, env):
        names = []
        for p in progs:
            for q in self.plan.closure(p) + [p]:
                for n in q.tensors:
                    if n in env and n not in names:
                        names.append(n)
        return names

    def _ring(self, progs, env, opts, kinds, comb, axes):
        """J shards travel the ring; sums over J accumulate on the rows' rank, sums over the
        distributed axes travel with their J shard and return home after the last step."""
        import torch
        plan, info, sk = self.plan, self.info, self.sk
        J = plan.J
        world, rank, sizes, zz = info["world"], info["rank"], info["sizes"], bool(info["zigzag"])
        mx = max(sizes)
        gs = dict(info["gsizes"])
        names = self._needed(progs, env)
        jn = [n for n in names if J in plan.tensors[n]]
        cur = {}
        for t in jn:
            x, d = env[t], plan.tensors[t].index(J)
            pad = list(x.shape)
            pad[d] = mx - x.shape[d]
            cur[t] = torch.cat([x, x.new_zeros(pad)], dim=d).contiguous() if pad[d] else x.contiguous()
        pieces = self._pieces({n: env[n] for n in names if n not in jn})
        lsize = {}
        for n in names:
            for a, k in zip(plan.tensors[n], env[n].shape):
                lsize.setdefault(a, k)
        home = [o for p in progs for o in p.outputs if kinds[o] == "home"]
        ident = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}
        dev = next(iter(cur.values())).device
        racc = [dict() for _ in pieces]
        local = {}
        src = rank
        # the home sums (dK/dV) of the visiting shard: this step's part in ``part`` (a chunk's
        # first block copies, later ones add); the shard's accumulator from the ranks before
        # arrives meanwhile (``pending``), this step's part is added to it and it travels on
        # while the next step computes
        pending, acc = None, {}
        nxt_rank, prv_rank = ring_peers(sk.group, rank, world)
        for step in range(world):
            reqs, nxt = [], {}
            if step < world - 1:
                nxt, reqs = ring_shift({t: cur[t] for t in jn}, nxt_rank, prv_rank, sk.group)
            run = [p for p in progs if any(kinds[o] in ("rows", "home") for o in p.outputs) or src == rank]
            part = {o: torch.empty([mx if a == J else lsize[a] for a in axes[o]], dtype=torch.float32, device=dev)
                    for o in home}
            written = {}   # (home output, chunk start) -> chunk length, of the slices written this step
            for start, n_src, off in sk._chunks(src, sizes, zz):
                kv = {t: cur[t].narrow(plan.tensors[t].index(J), start, n_src) for t in jn}
                for h, (ins, offs) in enumerate(pieces):
                    offs = dict(offs)
                    offs[J] = off
                    if self._skip(run, {**ins, **kv}, offs, gs, kinds, started=bool(racc[h])):
                        self.skipped += 1
                        continue
                    res = self._block(run, {**ins, **kv}, offs, gs, opts)
                    for o, v in res.items():
                        k = kinds.get(o)
                        if k == "rows":
                            racc[h][o] = self._combine(racc[h].get(o), v, comb[o])
                        elif k == "home":
                            sl = part[o].narrow(axes[o].index(J), start, n_src)
                            if (o, start) in written:
                                self._combine_into(sl, v, comb[o])
                            else:
                                sl.copy_(v)
                                written[(o, start)] = n_src
                        elif k == "local" and src == rank:
                            local.setdefault(o, []).append(v)
            for r in reqs:
                r.wait()
            if home:
                if pending is not None:     # this shard's accumulator from the ranks before: add this step's part
                    got, hreqs, _ = pending
                    for r in hreqs:
                        r.wait()
                    for (o, start), n in written.items():
                        d = axes[o].index(J)
                        self._combine_into(got[o].narrow(d, start, n), part[o].narrow(d, start, n), comb[o])
                    part = got
                else:                       # the first step: what no block wrote holds the identity
                    for o in home:
                        d = axes[o].index(J)
                        ends = 0
                        for st_, n_, _ in sk._chunks(src, sizes, zz):
                            ends = max(ends, st_ + n_)
                            if (o, st_) not in written:
                                part[o].narrow(d, st_, n_).fill_(ident[comb[o]])
                        if ends < part[o].shape[d]:   # (padding past a shorter shard)
                            part[o].narrow(d, ends, part[o].shape[d] - ends).fill_(ident[comb[o]])
                if self.send_home:          # the accumulators follow their shard to the next rank
                    pending = (*ring_shift(part, nxt_rank, prv_rank, sk.group), part)   # (sent: kept until waited)
                else:
                    acc = part
            if step < world - 1:
                cur = nxt
                src = (src - 1) % world
        if pending is not None:            # back home after `world` hops
            got, hreqs, _ = pending
            for r in hreqs:
                r.wait()
            acc = got
        out = {}
        for o in home:       # back home after `world` hops
            out[o] = acc[o].narrow(axes[o].index(J), 0, sizes[rank])
        for o in {o for r in racc for o in r}:
            out[o] = self._join([r[o] for r in racc], axes[o], comb[o])
        for o, vs in local.items():
            if len(vs) != 1:
                raise DistributedError(f"backward of {plan.bwd.forward.name!r}: output {o!r} over {J!r} computed "
                                       "block by block with distributed rows (an acefuse bug, please report)")
            out[o] = vs[0]
        return out

    def _gather(self, progs, env, opts, kinds, comb, axes):
        """All-gathered J shards: sums over J complete per row piece; sums over the distributed
        axes (over all of J) all-reduced, the rank keeps its own chunks (a reduce-scatter)."""
        import torch
        plan, info, sk = self.plan, self.info, self.sk
        J = plan.J
        rank, sizes, zz = info["rank"], info["sizes"], bool(info["zigzag"])
        gs = dict(info["gsizes"])
        names = self._needed(progs, env)
        jn = [n for n in names if J in plan.tensors[n]]
        full = {t: self._gather_j(env[t], plan.tensors[t].index(J)) for t in jn}
        pieces = self._pieces({n: env[n] for n in names if n not in jn})
        racc = [dict() for _ in pieces]
        homes = {}
        run = [p for p in progs if any(kinds[o] in ("rows", "home") for o in p.outputs)]
        for h, (ins, offs) in enumerate(pieces):
            offs = dict(offs)
            offs[J] = 0
            res = self._block(run, {**ins, **full}, offs, gs, opts) if run else {}
            for o, v in res.items():
                if kinds.get(o) == "rows":
                    racc[h][o] = v
                elif kinds.get(o) == "home":
                    homes[o] = self._combine(homes.get(o), v, comb[o])
        out = {}
        if homes:
            homes = self._all_reduce(homes, comb)
            for o, v in homes.items():
                d = axes[o].index(J)
                out[o] = torch.cat([v.narrow(d, off, n) for _, n, off in sk._chunks(rank, sizes, zz)], dim=d)
        for o in {o for r in racc for o in r}:
            out[o] = self._join([r[o] for r in racc], axes[o], comb[o])
        loc = [p for p in progs if p not in run]
        if loc:     # the rank's own block (rows the same on every rank)
            offs = dict(info["offsets"])
            offs[J] = sum(sizes[:rank])
            res = self._block(loc, {n: env[n] for n in names}, offs, gs, opts)
            out.update({o: v for o, v in res.items() if o in kinds})
        return out

    def _gather_j(self, x, d):
        """``x`` (this rank's shard along J) gathered over the ranks, in sequence order."""
        import torch
        info, sk = self.info, self.sk
        sizes = info["sizes"]
        got = sk._all_gather_axis(x, d, sizes)
        if not info["zigzag"]:
            return got
        parts = []
        for r in range(len(sizes)):
            base = sum(sizes[:r])
            for start, n, off in sk._chunks(r, sizes, True):
                parts.append((off, got.narrow(d, base + start, n)))
        return torch.cat([v for _, v in sorted(parts, key=lambda kv: kv[0])], dim=d)

    def _skip(self, run, ins, offs, gs, kinds, started=True) -> bool:
        """True for a block the forward's mask analysis (``ShardedKernel._all_masked``) proves
        fully masked: the forward's states are then the same whatever the block's inputs, so
        every gradient sum over its (row, key) pairs is zero (the stage kernels' own analysis
        skips each of its tiles), and the ring skips its launches and accumulations (sums over
        rows or travelling home: a missing block adds the identity). Never a piece's first
        block with per-row sums (``started``: they start from it), nor a run computing values
        kept per block (kind 'local'). ``skip_masked = False`` turns it off."""
        if not self.skip_masked or self.sk is None:
            return False
        outs = [o for p in run for o in p.outputs if kinds.get(o) is not None]
        if any(kinds[o] not in ("rows", "home") for o in outs) or (not started and any(kinds[o] == "rows" for o in outs)):
            return False
        fwd = {t: x for t, x in ins.items() if t in self.sk.program.tensors}
        return self.sk._all_masked(fwd, offs, gs)


_CONSTANTS = object()   # a program whose kernels take the offsets as constants (_kernel)


def _share_tuning(base, k) -> None:
    """A program instantiated at a constant block offset is the same kernel as the plain one but
    for constants: its launch configuration is timed once for all offsets (the GPU's first call
    times each sum kernel's configurations for 13-24 s) by sharing the generated launcher's table
    of timed choices (keyed by sizes and dtypes)."""
    mb, mk = getattr(base, "module", None), getattr(k, "module", None)
    if mb is None or mk is None or not isinstance(getattr(mb, "_TUNED", None), dict) or not hasattr(mk, "_TUNED"):
        return
    same = all(getattr(mb, a, None) == getattr(mk, a, None) for a in ("AXIS", "TENSORS", "OUTPUTS"))
    if same and type(base) is type(k):
        mk._TUNED = mb._TUNED


def _mask_marks(k) -> int:
    """How many mask analyses (tile skipping) a generated kernel's source holds (0 for a
    kernel without source). The sum kernel's analysis (codegen/sums.py) takes no 0-d input as
    a point interval yet (codegen/masks.py does), so a backward stage masked by a shifted index
    would skip no tile with runtime offsets: such a stage keeps constant offsets."""
    import re
    src = getattr(k, "source", None)
    if src is None and getattr(k, "path", None) is not None:
        src = Path(k.path).read_text()
    return len(re.findall(r"# mask analysis|tiles the mask excludes entirely", src or ""))


# ---- the differentiable sharded call -----------------------------------------------------
_AUG: dict = {}        # id(differentiable kernel) -> (it, backward program, augmented forward kernel)
_RUNNERS: dict = {}    # (id(backward program), J, D) -> ShardedBackward


def _grad_parts(dk, axis):
    """(backward program, augmented forward kernel) of a differentiable kernel, compiled once
    per process (and inherited by forked ranks)."""
    from acefuse.codegen.compile import compile_program
    got = _AUG.get(id(dk))
    if got is None or got[0] is not dk:
        bwd = dk.backward_program
        kw = {k: v for k, v in getattr(dk, "_kw", {}).items() if k != "axis"}
        aug = dk.kernel if bwd.augmented is dk.prog else compile_program(bwd.augmented, axis=axis, **kw)
        got = _AUG[id(dk)] = (dk, bwd, aug, kw)
    return got[1:]


def _runner(bwd, J, D, kw):
    key = (id(bwd), J, frozenset(D))
    got = _RUNNERS.get(key)
    if got is None or got.bwd is not bwd:
        got = _RUNNERS[key] = ShardedBackward(bwd, Plan(bwd, J, D), kw)
    return got


def prepare(kernel, sharded_axis, wrt=None, distributed_axes=(), offsets=(), sizes=None):
    """Compile on this process what a differentiable sharded call of ``kernel`` (from
    ``af.compile``) needs: its backward program, the augmented forward and the kernels of the
    sharded backward's programs, for inputs ``wrt`` requiring grad (default: every float input)
    and the distributed axes (``axis_offsets``/``zigzag`` axes), and the kernels for the
    global offsets ``offsets`` (dicts axis -> offset: the blocks the ranks will run; one kernel
    per program serves all of them, the offsets being runtime inputs) and global lengths
    ``sizes`` fixed. Calls do this themselves on first use; ranks forked from this
    process inherit the result (a derivation after a fork of a process that derived before can
    hang in egglog's threads: the tests prepare on the parent)."""
    floats = frozenset(n for n, ax in kernel.prog.tensors.items() if n not in _index_names(kernel.prog))
    dk = kernel._for(frozenset(wrt) if wrt is not None else floats, floats)
    bwd, _, kw = _grad_parts(dk, sharded_axis)
    r = _runner(bwd, sharded_axis, distributed_axes, kw)
    for offs in offsets:
        for p in r.plan.progs:
            r._kernel(p, offs, dict(sizes or {}))
    return r.plan


def _index_names(prog):
    from acefuse.backward import index_inputs
    return set(index_inputs(prog))


class ShardedGrad:
    """What a differentiable sharded call needs, built once per ShardedKernel and set of
    inputs requiring grad: the backward program, the augmented forward sharded like the call
    (outputs + saved values, merged across ranks), and the plan of the backward."""

    def __init__(self, sk, requested, floats):
        from acefuse.distributed.sharded import ShardedKernel
        dk = sk.kernel
        name = sk.program.name
        if not hasattr(dk, "_for") or not hasattr(dk, "backward_program"):
            raise DistributedError(f"program {name!r}: inputs require grad, but this kernel is not differentiable "
                                   "(compile the program with af.compile(prog) for a differentiable kernel)")
        dk = dk._for(frozenset(requested), frozenset(floats))
        self.prog = dk.prog
        self.bwd, aug, self.kw = _grad_parts(dk, sk.axis)
        bwd = self.bwd
        self.aug = ShardedKernel(aug, sk.group, sk.axis, sk.exchange)
        self.aug.keep_wide = frozenset(n for n in bwd.saved if n not in dk.prog.outputs) | frozenset(
            n for n, kind in bwd.saved_kind.items() if kind == "output")
        self.sk = sk

    def runner(self, D):
        r = _runner(self.bwd, self.sk.axis, D, self.kw)
        r.sk = self.sk
        return r


def _function():
    import torch

    class ShardedFunction(torch.autograd.Function):
        """Forward: the augmented program sharded (outputs and merged saved values); backward:
        the plan of the derived backward on the shards."""

        @staticmethod
        def forward(ctx, sg, call, info, names, *tensors):
            inputs = dict(zip(names, tensors))
            out = sg.aug(**inputs, **call)
            keys = list(sg.prog.outputs)
            out = out if isinstance(out, dict) else {list(sg.bwd.augmented.outputs)[0]: out}
            saved = [out[n] for n in sg.bwd.saved]
            ctx.sg, ctx.call, ctx.info, ctx.names = sg, call, info, names
            ctx.set_materialize_grads(False)
            ctx.out_meta = [(out[k].shape, out[k].dtype, out[k].device) for k in keys]
            ctx.save_for_backward(*tensors, *saved)
            res = tuple(out[k] if out[k].dtype == tensors[0].dtype or not out[k].dtype.is_floating_point
                        else out[k] for k in keys)
            return res

        @staticmethod
        def backward(ctx, *cots):
            sg = ctx.sg
            if torch.is_grad_enabled():
                from acefuse.codegen.compile import NotDifferentiableError
                raise NotDifferentiableError(f"program {sg.prog.name!r}: higher-order gradients through a sharded "
                                             "acefuse call are not supported")
            bwd = sg.bwd
            n = len(ctx.names)
            vals = ctx.saved_tensors
            inputs = dict(zip(ctx.names, vals[:n]))
            env = dict(inputs)
            env.update(zip(bwd.saved, vals[n:]))
            for k, g, (shape, dtype, dev) in zip(sg.prog.outputs, cots, ctx.out_meta):
                env[f"grad_{k}"] = (torch.zeros(shape, dtype=dtype, device=dev) if g is None else g.to(dtype)).contiguous()
            for nm in bwd.index_inputs:
                if nm in env:
                    env[nm] = env[nm].to(torch.float32)
            info = ctx.info
            runner = sg.runner(info["D"])
            env = runner.run(env, info, info["opts"])
            grads = assemble(bwd, runner.plan, env, inputs)
            res = []
            for i, (name, x) in enumerate(zip(ctx.names, vals[:n])):
                g = grads.get(f"grad_{name}") if ctx.needs_input_grad[4 + i] else None
                res.append(None if g is None else g.to(x.dtype))
            return (None, None, None, None) + tuple(res)
    return ShardedFunction


_FN = None


def sharded_function():
    global _FN
    if _FN is None:
        _FN = _function()
    return _FN


def assemble(bwd, plan, env, inputs) -> dict:
    """{grad_<input>: tensor in the input's (local) shape} from the computed values."""
    import torch
    from acefuse.autograd import _to_axes
    axes = {}
    for p in plan.progs:
        for o, (_, ax, _) in p.outputs.items():
            axes[o] = ax
    for gname, (part, red) in getattr(bwd, "finish", {}).items():
        t, ax = env[part], axes[part]
        env[gname] = t.sum([ax.index(a) for a in red], dtype=torch.float32)
        axes[gname] = tuple(a for a in ax if a not in red)
    grads = {}
    for name, gname in bwd.grads.items():
        if name not in inputs:
            continue
        shape = list(inputs[name].shape)
        grads[gname] = _to_axes(env[gname], axes[gname], bwd.input_axes[name], shape)
    for name in bwd.zero_grads:
        if name in inputs:
            grads[f"grad_{name}"] = torch.zeros_like(inputs[name])
    return grads
