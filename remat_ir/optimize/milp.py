"""The keep/recompute MILP over the schedule family of `family.py`.

Variables (for the nodes and storages in scope):

* ``k_d``, one per decision node: keep its outputs from forward to their
  last backward use (1) or recompute the node lazily in backward (0).  Views
  share the decision of the node owning their storage.  The boolean variable
  is ``1 - k_d``, so the objective (recompute cost) has no constant term.
* ``X[n, e]`` (continuous, integral at any integral ``k``): node ``n`` has
  been recomputed by backward event ``e``.  Only the stages at which ``n``
  can first be needed get a variable (``stages(n)``); elsewhere ``X`` is a
  constant or repeats the last variable.  The constraints pin ``X`` to the
  family's lazy rule exactly: ``X[n,e] >= X[w,e] - k_n`` for every consumer
  ``w`` (a recomputed consumer needs ``n``), ``X[n,e] <= sum_w X[w,e]``
  (nothing else makes ``n`` needed before its first backward read), and
  ``X[n,e] = 1 - k_n`` from that read on.
* liveness of every storage at every record point of the simulator: after
  each backward node (``Lb``), after each recompute (``Lq``, through a chain
  ``Z`` of "still needed at this slot or later"), across stages where nothing
  happens (``Lq`` at slot -inf), and kept into backward (``R``).  These are
  continuous and bounded below by ``L >= need - (X[u,E] - X[u,t])``: a
  storage needed at or after point ``t`` is live there unless its owner
  ``u`` is recomputed only later.  At integral points that equals the
  product ``made AND need``; in the LP relaxation it is much tighter than
  the textbook ``L >= made + need - 1`` (the root bound on a 6-block toy
  went from 2% to 70% of the optimum).  Memory pushes ``L`` down, so at an
  optimum it is exact.

Constraints: for every record point, constant bytes (from `Analysis`) +
sum of storage sizes x liveness <= budget (forward records, backward records,
the start of backward).  Objective: recompute cost (FLOPs, or microseconds
under the `profile` cost model).  For the plan family this model is exact:
its optimum equals the optimum over all plans built and simulated one by one
(checked by brute force in the tests).

Most memory rows never bind, and each row brings its own liveness
variables: `build(active=...)` builds only the rows named, and `rows_over`
names the rows a plan's exact occupancy breaks, so `search.py` solves with
the rows it needs (a whole 2-layer GPT: 64 binaries, a few to a few dozen
of ~8,000 memory rows, seconds instead of minutes for the whole model).

Built as one sparse matrix (scipy) handed to cvxpy in a single vectorized
constraint, so canonicalization stays fast.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import os
import time
import warnings
from dataclasses import dataclass

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from remat_ir.optimize.family import NEVER, UNIT, VIEW, Analysis

CONST = -1  # key of the constant term in a linear expression


def _add(dst: dict, src: dict, scale: float = 1.0) -> dict:
    for k, v in src.items():
        dst[k] = dst.get(k, 0.0) + scale * v
    return dst


def lin(*terms) -> dict:
    """Sum of (scale, expr) pairs (zero coefficients dropped)."""
    out: dict = {}
    for scale, e in terms:
        _add(out, e, scale)
    return {k: v for k, v in out.items() if abs(v) > 1e-12 or (k == CONST and v != 0.0)}


FLAT, OPTION, COMBINE, WINDOW = "flat", "option", "combine", "window"  # what a solve was for


@dataclass(frozen=True)
class SolveRecord:
    """One solve of a search: what it was for, how large, how it ended."""

    kind: str  # FLAT (the whole graph), OPTION (a block class), COMBINE (one option per segment), WINDOW
    subject: str  # what it solved for: "budget 12 MiB", "floor", a block class and its caps, ...
    status: str
    seconds: float
    objective: float | None = None
    gap: float | None = None
    round: int = 0  # the round of a lazy search (memory rows added between rounds); 0: not lazy
    rows: int | None = None  # memory rows in the model; None: every row
    nodes: int | None = None  # branch-and-bound node limit; None: solved to the gap
    method: str = "MILP"  # or "DP" (the chain combine), or "bound" (not solved: below a proven bound)
    variables: int = 0
    binaries: int = 0
    constraints: int = 0
    # Simplex iterations the backend reports (HiGHS), a count that, unlike
    # seconds, every machine reproduces; None: not reported.
    iterations: int | None = None
    explored: int | None = None  # branch-and-bound nodes the backend explored (HiGHS); None: not reported

    @property
    def name(self) -> str:
        """The record as one line of a log."""
        extra = f", round {self.round}" if self.round else ""
        if self.kind in (FLAT, OPTION) or self.rows is not None:
            extra += f", {'every' if self.rows is None else self.rows} memory rows"
        return f"{self.kind} {self.subject} ({self.method}{extra})"


_SILENCED = [0]  # `silenced()` blocks open


@contextlib.contextmanager
def silenced():
    """HiGHS's banner off (C-level stdout) and the backends' warnings
    ignored.  Both are process-wide state, which threads must not swap
    under each other: while one block is open (the one around solves run on
    several threads, `decomposed.per_class`), a block inside it does nothing."""
    if _SILENCED[0]:
        yield
        return
    _SILENCED[0] += 1
    try:
        with quiet_stdout(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _SILENCED[0] -= 1


@contextlib.contextmanager
def quiet_stdout():
    """Silence C-level stdout (HiGHS prints a banner even when not verbose)."""
    try:
        fd = os.dup(1)
    except OSError:  # no stdout
        yield
        return
    try:
        import sys
        sys.stdout.flush()
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            try:
                yield
            finally:
                sys.stdout.flush()
                os.dup2(fd, 1)
    finally:
        os.close(fd)


class KeepModel:
    """The MILP for the nodes/storages in scope.

    mode "flat": every record point of the program, budget ``<= B``.
    mode "local": only the scope's forward range and backward events (a
    segment of a decomposition); memory rows ``<= P`` and the bytes kept into
    backward ``<= Rcap``; other segments are added by the caller.
    """

    def __init__(self, a: Analysis, *, nodes=None, storages=None, fixed: dict | None = None,
                 mode: str = "flat", decisions=None):
        self.a = a
        self.mode = mode
        nf = a.nf
        fixed = dict(fixed or {})
        scope_nodes = set(range(nf)) if nodes is None else set(nodes)
        self.scope_nodes = scope_nodes
        st_idx = list(range(len(a.storages))) if storages is None else list(storages)
        self.st_idx = st_idx
        dec = a.decisions() if decisions is None else list(decisions)
        dec = [d for d in dec if d in scope_nodes and d not in fixed]
        self.dec = dec
        self.ypos = {d: i for i, d in enumerate(dec)}
        self.fixed = fixed
        self.ny = len(dec)
        self.nx = 0
        self.xub: list[float] = []
        self.rows: list[tuple[dict, str]] = []  # (expr, kind): expr <= 0 / <= B / <= Rcap
        self.const_mem = 0.0  # the largest constant of a memory row: a least peak is at least this
        self.active: set | None = None  # the memory rows built (None: every row)

        # The binaries say *recompute* (1 - keep): the recompute cost is then
        # a linear form without a constant, so the solver's relative gap is
        # a gap on the extra compute itself.
        def keep(n: int) -> dict:
            k = a.key[n]
            if k < 0:
                return {CONST: 1.0}
            if k in self.ypos:
                return {CONST: 1.0, self.ypos[k]: -1.0}
            return {CONST: float(fixed.get(k, 1))}

        def recompute(n: int) -> dict:
            return lin((1.0, {CONST: 1.0}), (-1.0, keep(n)))

        self.keep, self.recompute = keep, recompute
        # Recomputable nodes in scope.
        rec = []
        for n in sorted(scope_nodes):
            if a.kind[n] in (UNIT, VIEW) and a.maybe[n] and keep(n) != {CONST: 1.0}:
                rec.append(n)
        rec_set = set(rec)
        # A view owns no memory and shares its storage owner's decision, so
        # whether it has been recomputed changes no memory row: it only passes
        # on when its input is needed (when a consumer of the view is, or from
        # the view's own first backward read).  Such views are left out of the
        # model, their consumers and first reads handed to their inputs: an
        # exact contraction.  A view with a recompute cost is kept unless it is
        # surely recomputed when dropped (read in backward), where its cost is
        # linear.
        def contractible(v: int) -> bool:
            if a.kind[v] != VIEW or (a.cost[v] and a.dfirst[v] >= NEVER):
                return False
            ins = {a.prod_f[r] for r in a.fin[v] if r in a.prod_f}
            return all(a.key[u] == a.key[v] for u in ins if u in rec_set)
        gone = {v for v in rec if contractible(v)}
        cons: dict[int, list[int]] = {}
        dfirst: dict[int, int] = {}
        for n in reversed(rec):
            ws: set[int] = set()
            d = a.dfirst[n]
            for w in a.cons[n]:
                if w not in rec_set:
                    continue
                if w in gone:
                    ws.update(cons[w])
                    d = min(d, dfirst[w])
                else:
                    ws.add(w)
            cons[n], dfirst[n] = sorted(ws), d
        self.contracted = gone
        rec = [n for n in rec if n not in gone]
        self.rec = rec
        cons = {n: cons[n] for n in rec}
        self.cons = cons
        self.dfirst = dfirst
        # Stages at which each node can first be needed.
        ps: dict[int, list[int]] = {}
        for n in reversed(rec):
            d = dfirst[n]
            pts = {d} if d < NEVER else set()
            for w in cons[n]:
                for p in ps[w]:
                    if p < d:
                        pts.add(p)
            ps[n] = sorted(pts)
        self.ps = ps
        # Events: stages where something in scope happens.
        ev = set()
        for n in rec:
            ev.update(ps[n])
        for k in st_idx:
            st = a.storages[k]
            ev.update(st.reads)
            ev.update(st.holds)
        self.events = sorted(ev)
        self._xcache: dict = {}
        self.xvar: dict[tuple[int, int], int] = {}  # made as rows name them (see `build`)

    # ------------------------------------------------------------ helpers

    def _new(self, ub: float = 1.0) -> int:
        i = self.ny + self.nx
        self.nx += 1
        self.xub.append(ub)
        return i

    def X(self, n: int, stage: int) -> dict:
        """Recomputed by `stage` (an expression; do not mutate)."""
        key = (n, stage)
        r = self._xcache.get(key)
        if r is None:
            r = self._xcache[key] = self._X(n, stage)
        return r

    def _X(self, n: int, stage: int) -> dict:
        p = self._point(n, stage)
        if p is None:
            return {}
        if p == self.dfirst[n]:
            return self.recompute(n)
        v = self.xvar.get((n, p))
        if v is None:
            v = self.xvar[(n, p)] = self._new()
        return {v: 1.0}

    def _point(self, n: int, stage: int):
        """The stage of ps[n] whose X holds at `stage` (None: n cannot be
        needed by then)."""
        pts = self.ps.get(n)
        if not pts:
            return None
        i = bisect.bisect_right(pts, stage) - 1
        return pts[i] if i >= 0 else None

    def RC(self, n: int, e_idx: int) -> dict:
        """Recomputed exactly at event e (index into events; do not mutate)."""
        key = ("rc", n, e_idx)
        r = self._xcache.get(key)
        if r is None:
            r = self._xcache[key] = self._RC(n, e_idx)
        return r

    def _RC(self, n: int, e_idx: int) -> dict:
        stage = self.events[e_idx]
        pts = self.ps.get(n)
        if not pts or stage not in pts:
            return {}
        prev = self.events[e_idx - 1] if e_idx > 0 else -1
        return lin((1.0, self.X(n, stage)), (-1.0, self.X(n, prev)))

    def row(self, expr: dict, kind: str = "le") -> None:
        e = {k: v for k, v in expr.items() if v != 0.0 or k == CONST}
        if all(k == CONST for k in e):
            if kind == "mem":
                self.const_mem = max(self.const_mem, e.get(CONST, 0.0))
            return
        self.rows.append((e, kind))

    @staticmethod
    def any_of(terms: list[dict]) -> list[dict]:
        """An OR of 0/1 expressions, as the list of its terms: [] is false,
        [{CONST: 1}] is true.  An OR stays a list until a liveness variable
        takes it (`live`), which then bounds itself by each term: the same
        LP as an OR variable of its own, with one variable and one row fewer."""
        terms = [t for t in terms if t]
        if any(set(t) <= {CONST} and t.get(CONST, 0.0) >= 1.0 for t in terms):
            return [{CONST: 1.0}]
        return [t for t in terms if not (set(t) <= {CONST})]

    def ge_max(self, terms: list[dict]) -> dict:
        """A variable >= every term (an OR of 0/1 expressions when minimized)."""
        terms = self.any_of(terms)
        if not terms:
            return {}
        if len(terms) == 1:
            return terms[0]
        v = self._new()
        for t in terms:
            self.row(lin((1.0, t), (-1.0, {v: 1.0})))
        return {v: 1.0}

    # ------------------------------------------------------------ model

    def build(self, active: set | None = None):
        """Build the rows.  `active`, when given, names the memory rows to
        build (see `row_id`); the others are left out, with the liveness
        variables only they need.  A plan that fits every row it was solved
        with and then fits the exact profile is optimal for the whole model."""
        a = self.a
        nf = a.nf
        self.const_mem = 0.0
        events = self.events
        self.active = active
        self.chains: dict[int, list] = {}  # event -> its chain of rows: None (the gap before it), recomputes

        def want(rid) -> bool:
            return active is None or rid in active
        E = len(events)
        last_stage = events[-1] if events else -1
        rec, cons, ps, dfirst = self.rec, self.cons, self.ps, self.dfirst

        # ---- X: the lazy rule, exactly, at the stages the memory rows read.
        # X[n] changes only at the stages of ps[n], and "recomputed by
        # stage s" follows from the consumers' values at s alone, so the rule
        # stated at a subset of stages is exact there.  With some memory rows
        # only, that subset is their stages (and the stage before each, for
        # "recomputed at this event"), plus the last (whether n is recomputed
        # at all): a fraction of the variables and rows.
        if active is None:
            at = set(events)
        else:
            at = set()
            for rid in active:
                if rid[0] in ("b", "q") and rid[1] < E:
                    at.add(events[rid[1]])
                    if rid[1] > 0:
                        at.add(events[rid[1] - 1])
        at.add(last_stage)
        at = sorted(at)
        # Per node, the stage of ps[n] whose X holds at each stage of `at`.
        point = {n: [self._point(n, s) for s in at] for n in rec}
        for n in rec:
            pts = ps[n]
            if not pts:
                continue
            used = sorted(set(point[n]) - {None})
            for p1, p2 in zip(used, used[1:]):
                self.row(lin((1.0, self.X(n, p1)), (-1.0, self.X(n, p2))))
            if dfirst[n] == NEVER:
                self.row(lin((1.0, self.X(n, pts[-1])), (-1.0, self.recompute(n))))
            for p in dict.fromkeys(point[n]):
                if p is not None and p < dfirst[n]:
                    self.row(lin((1.0, self.X(n, p)), *[(-1.0, self.X(w, p)) for w in cons[n]]))
            for w in cons[n]:
                for pw, p in dict.fromkeys(zip(point[w], point[n])):
                    if pw is not None and p is not None and p < dfirst[n]:
                        self.row(lin((1.0, self.X(w, pw)), (-1.0, self.keep(n)), (-1.0, self.X(n, p))))

        # ---- storages
        sts = [a.storages[k] for k in self.st_idx]
        dyn = [[w for w in st.consumers if w in cons] for st in sts]
        maxneed = []
        for st, ws in zip(sts, dyn):
            m = st.last_static
            for w in ws:
                if ps[w]:
                    m = max(m, ps[w][-1])
            maxneed.append(m)
        # Yb: needed at the backward node of event e or later.
        ycache: dict[tuple[int, int], list] = {}

        def Yb(k: int, e: int) -> list[dict]:
            key = (k, e)
            if key in ycache:
                return ycache[key]
            st, stage = sts[k], events[e]
            if stage <= st.last_static:
                r = [{CONST: 1.0}]
            else:
                terms = []
                for w in dyn[k]:
                    if ps[w] and ps[w][-1] > stage:
                        terms.append(lin((1.0, self.X(w, last_stage)), (-1.0, self.X(w, stage))))
                r = self.any_of(terms)
            ycache[key] = r
            return r

        def live(k: int, z: list[dict], stage: int) -> dict:
            """Storage k is live at a point after `stage`'s recomputes given it
            is needed there or later (z, an OR: `any_of`).  Not made yet means
            its owner is recomputed later, so L >= z - (X[u,E] - X[u,stage]):
            exact at integral points and much tighter in the LP relaxation
            than L >= made + z - 1."""
            if not z:
                return {}
            u = sts[k].owner
            later = lin((1.0, self.X(u, last_stage)), (-1.0, self.X(u, stage)))  # recomputed after `stage`
            if z == [{CONST: 1.0}]:
                return lin((1.0, {CONST: 1.0}), (-1.0, later))
            v = self._new()
            for t in z:
                self.row(lin((1.0, t), (-1.0, later), (-1.0, {v: 1.0})))
            return {v: 1.0}

        # Retained into backward.
        R = []
        for k, st in enumerate(sts):
            if st.reads or st.holds:
                ya = [{CONST: 1.0}]
            else:
                ya = self.any_of([self.X(w, last_stage) for w in dyn[k]])
            R.append(live(k, ya, -1))

        # Slots per event: units owning a storage in scope, recomputable then.
        owners = {st.owner for st in sts}
        slots: dict[int, list[int]] = {}
        for q in rec:
            if a.kind[q] == UNIT and q in owners:
                for p in ps[q]:
                    slots.setdefault(p, []).append(q)
        for p in slots:
            slots[p].sort()

        const_b, const_pre = a.const_b, a.const_pre
        for e in range(E):
            stage = events[e]
            prev = events[e - 1] if e > 0 else -1
            # after the backward node
            if want(("b", e)):
                mem = {CONST: float(const_b[stage])}
                for k in range(len(sts)):
                    if stage > maxneed[k]:
                        continue
                    y = Yb(k, e)
                    if y:
                        _add(mem, live(k, y, stage), float(sts[k].size))
                self.row(mem, "mem")
            # recompute slots, and the gap before this event
            qs = list(slots.get(stage, ()))
            gap_lo = prev + 1 if (e > 0 or self.mode == "flat") else stage
            gap = const_b[gap_lo:stage].max() if stage > gap_lo else None
            chain = ([None] if gap is not None else []) + qs  # None: slot -inf
            self.chains[e] = chain
            if not chain:
                continue
            rows_wanted = [i for i in range(len(chain)) if want(("q", e, i))]
            if not rows_wanted:
                continue
            mems = [{CONST: float(gap if q is None else const_pre[stage])} for q in chain]
            for k, st in enumerate(sts):
                owner_slot = st.owner in qs
                if stage > maxneed[k] and not owner_slot:
                    continue
                # Z_i: needed at slot i or later.  Every row: chained from the
                # back.  Some rows: each Z_i on its own, an OR of the same terms.
                z_next = Yb(k, e) if stage <= maxneed[k] else []
                zs: list = [[]] * len(chain)
                if active is None:
                    for i in range(len(chain) - 1, -1, -1):
                        lo = -1 if chain[i] is None else chain[i]
                        hi = chain[i + 1] if i + 1 < len(chain) else nf
                        z = self.ge_max(z_next + [self.RC(w, e) for w in dyn[k] if lo <= w < hi])
                        z_next = zs[i] = [z] if z else []
                else:
                    for i in rows_wanted:
                        lo = -1 if chain[i] is None else chain[i]
                        zs[i] = self.any_of(z_next + [self.RC(w, e) for w in dyn[k] if lo <= w])
                for i in rows_wanted:
                    q = chain[i]
                    point = stage if (q is not None and st.owner <= q) else prev
                    lv = live(k, zs[i], point)
                    if q is not None and st.owner == q:
                        rc = self.RC(q, e)
                        if rc:
                            lv = self.ge_max([lv, rc]) if lv else rc
                    if lv:
                        _add(mems[i], lv, float(st.size))
            for i in rows_wanted:
                self.row(mems[i], "mem")
        # Trailing stages with nothing in scope (flat mode: constants only).
        if self.mode == "flat":
            tail_lo = (events[-1] + 1) if events else 0
            if tail_lo < a.nb:
                self.const_mem = max(self.const_mem, float(const_b[tail_lo:].max()))

        # ---- forward records
        lo_t, hi_t = (0, nf - 1) if self.mode == "flat" else (
            min(self.scope_nodes), max(self.scope_nodes))
        self.fwd_range = (lo_t, hi_t)
        if nf:
            prof = a.base_f + a.fwd_asap
            deaths = sorted({st.asap_death for st, r in zip(sts, R) if r and lo_t <= st.asap_death + 1 <= hi_t})
            cuts = [lo_t] + [d + 1 for d in deaths] + [hi_t + 1]
            for c0, c1 in zip(cuts, cuts[1:]):
                if c1 <= c0 or not (active is None or any(want(("f", t)) for t in range(c0, c1))):
                    continue
                mem = {CONST: float(prof[c0:c1].max())}
                for st, r in zip(sts, R):
                    if r and st.asap_death < c0:
                        _add(mem, r, float(st.size))
                self.row(mem, "mem")
        # ---- start of backward / bytes kept into backward
        ret: dict = {}
        for st, r in zip(sts, R):
            if r:
                _add(ret, r, float(st.size))
        self.retained_expr = ret
        if self.mode != "flat":
            self.row(dict(ret), "ret")
        elif want(("s",)):
            start = dict(ret)
            start[CONST] = start.get(CONST, 0.0) + float(a.const_start)
            self.row(start, "mem")

        # ---- objective: recompute cost (FLOPs, or measured time with --cost profile)
        obj: dict = {}
        for n in rec:
            c = a.cost[n]
            if c:
                _add(obj, self.X(n, last_stage), float(c))
        for v in self.contracted:  # recomputed exactly when dropped (see __init__)
            if a.cost[v]:
                _add(obj, self.recompute(v), float(a.cost[v]))
        self.obj = obj
        return self

    def rows_over(self, prof, limit: float) -> dict:
        """The memory rows (ids for `build(active=...)`) at which a plan whose
        exact profile is `prof` (`family.profile`, with constants) holds more
        than `limit` bytes, each with the most bytes seen there.  A record the
        model has no row of its own for (the recompute of a node that owns
        no decided storage) frees and allocates nothing the plan decides, so
        the row of the recompute before it bounds it."""
        nf = self.a.nf
        out: dict = {}

        def add(rid, v):
            out[rid] = max(out.get(rid, 0), int(v))

        local = self.mode != "flat"
        lo_t, hi_t = self.fwd_range
        for t in np.nonzero(prof.fwd_total > limit)[0]:
            if lo_t <= t <= hi_t:
                add(("f", int(t)), prof.fwd_total[t])
        if prof.start > limit and not local:
            add(("s",), prof.start)
        stage, slot, tot = prof.records
        events = self.events
        for k in np.nonzero(tot > limit)[0]:
            j, q = int(stage[k]), int(slot[k])
            e = bisect.bisect_left(events, j)
            if local and (e == len(events) or (e == 0 and events[0] != j)):
                continue  # outside the segment's backward window: no row of this model
            if e == len(events):
                add(("tail",), tot[k])  # constants only: no row can change it
            elif events[e] != j:
                add(("q", e, 0), tot[k])  # in the gap before event e
            elif q == nf:
                add(("b", e), tot[k])
            else:
                chain = self.chains.get(e, [])
                before = [i for i, x in enumerate(chain) if x is None or x <= q]
                if before:
                    add(("q", e, before[-1]), tot[k])
                else:  # nothing decided was allocated since the backward node before
                    add(("b", e - 1) if e > 0 else ("b", e), tot[k])
        return out

    # ------------------------------------------------------------ cvxpy

    def compile(self, objective: str = "cost", *, tie_retained: float = 0.0) -> "Compiled":
        """A cvxpy problem over this model.

        objective "cost": minimize recompute cost, memory rows <= parameter B.
        objective "retained": minimize bytes kept into backward (+1e-4 cost).
        objective "peak": B is a variable; minimize it (+1e-4 cost).
        In local mode the retained row is <= parameter Rcap."""
        if not hasattr(self, "_A"):
            self._matrices()
        return Compiled(self, objective, tie_retained)

    def _matrices(self):
        ny, nx = self.ny, self.nx
        rows = self.rows
        sizes = [abs(v) for e, kind in rows if kind != "le" for k, v in e.items() if k != CONST]
        self.scale = 1000.0 / max(max(sizes, default=1.0), 1.0)
        r_i, c_i, vals = [], [], []
        rhs = np.zeros(len(rows))
        kind_mem = np.zeros(len(rows))
        kind_ret = np.zeros(len(rows))
        for i, (e, kind) in enumerate(rows):
            s = self.scale if kind != "le" else 1.0
            for k, v in e.items():
                if k == CONST:
                    rhs[i] = -v * s
                else:
                    r_i.append(i)
                    c_i.append(k)
                    vals.append(v * s)
            if kind == "mem":
                kind_mem[i] = 1.0
            elif kind == "ret":
                kind_ret[i] = 1.0
        self._A = sp.csr_matrix((vals, (r_i, c_i)), shape=(len(rows), ny + nx))
        self._rhs, self._kmem, self._kret = rhs, kind_mem, kind_ret
        cost = np.zeros(ny + nx)
        for k, v in self.obj.items():
            if k != CONST:
                cost[k] += v
        self._cost = cost / max(np.abs(cost).max(initial=0.0), 1.0)
        ret = np.zeros(ny + nx)
        for k, v in self.retained_expr.items():
            if k != CONST:
                ret[k] += v * self.scale
        self._ret = ret
        self.n_constraints = len(rows)


class Compiled:
    """One cvxpy problem of a `KeepModel` (see `KeepModel.compile`)."""

    def __init__(self, m: KeepModel, objective: str, tie_retained: float):
        self.m = m
        self.objective = objective
        ny, nx = m.ny, m.nx
        A = m._A
        y = cp.Variable(ny, boolean=True) if ny else None
        x = cp.Variable(nx) if nx else None
        self.y, self.x = y, x

        def dot(vec):
            e = 0
            if ny:
                e = e + vec[:ny] @ y
            if nx:
                e = e + vec[ny:] @ x
            return e

        lhs = 0
        if ny:
            lhs = lhs + A[:, :ny] @ y
        if nx:
            lhs = lhs + A[:, ny:] @ x
        cons = []
        peak = objective == "peak"
        self.B = cp.Variable() if peak else cp.Parameter(nonneg=True, value=1e18)
        self.Rcap = cp.Parameter(nonneg=True, value=1e18)
        if m.n_constraints:
            bound = m._rhs + m._kmem * (self.B * m.scale)
            if m._kret.any():
                bound = bound + m._kret * (self.Rcap * m.scale)
            cons.append(lhs <= bound)
        if nx:
            cons += [x >= 0, x <= np.array(m.xub)]
        if peak:
            cons.append(self.B >= m.const_mem)
        cost = dot(m._cost)
        if objective == "cost":
            obj = cost
            if tie_retained:
                obj = obj + tie_retained * dot(m._ret) / max(np.abs(m._ret).sum(), 1.0)
        elif objective == "retained":
            obj = dot(m._ret) / max(np.abs(m._ret).sum(), 1.0) + 1e-4 * cost
        elif objective == "peak":
            obj = self.B * m.scale + 1e-4 * cost
        else:
            raise ValueError(objective)
        self.problem = cp.Problem(cp.Minimize(obj), cons)

    def peak_lower_bound(self) -> float | None:
        """After a solve of the "peak" objective: a cap in bytes under which
        no plan meets this model's memory rows (or any superset of them),
        from the backend's dual bound (HiGHS only), or None."""
        if self.objective != "peak":
            return None
        try:
            dual = float(self.problem.solver_stats.extra_stats.mip_dual_bound)
        except Exception:  # noqa: BLE001 - no dual bound from this backend: no bound
            return None
        if not np.isfinite(dual):
            return None
        m = self.m
        # The objective is B * scale + 1e-4 * cost: take the most the cost term can be.
        ub = np.concatenate([np.ones(m.ny), np.asarray(m.xub, dtype=float)])
        most = 1e-4 * float(np.clip(m._cost, 0.0, None) @ ub)
        bound = (dual - most) / m.scale
        # B is at least the constants (`B >= const_mem`), which a MILP with B
        # a cap does not have: only a bound above them bounds its rows.  The
        # margin covers the solver's tolerances.
        bound = bound * (1 - 1e-6) - 1.0
        return bound if bound > m.const_mem else None

    def solve(self, kind: str, subject: str, *, round: int = 0, solver: str = "HIGHS", time_limit: float = 60.0,
              warm: bool = False, log=None, rel_gap: float = 1e-6, nodes: int | None = None):
        """Solve; returns (kept decisions or None, SolveRecord).  A solution is
        accepted only when every binary is integral (CBC may return the LP
        relaxation at a time limit)."""
        m = self.m
        t0 = time.perf_counter()
        keep = None
        ok, status, objv, gap = run_solver(self.problem, solver, time_limit, rel_gap, nodes, warm=warm)
        if ok and m.ny == 0:
            keep = set()
        elif ok and self.y.value is not None:
            yv = np.asarray(self.y.value, dtype=float)
            if np.all(np.abs(yv - np.round(yv)) < 1e-4):
                keep = {d for d, v in zip(m.dec, yv) if v < 0.5}
            else:
                status = status + " (fractional)"
        rec = SolveRecord(kind, subject, status, time.perf_counter() - t0, objv, gap, round=round,
                          rows=None if m.active is None else len(m.active), nodes=nodes,
                          variables=m.ny + m.nx, binaries=m.ny, constraints=m.n_constraints,
                          iterations=highs_count(self.problem, solver, "simplex_iteration_count"),
                          explored=highs_count(self.problem, solver, "mip_node_count"))
        if log:
            g = "-" if gap is None else f"{gap:.2%}"
            its = "" if rec.iterations is None else f", {rec.iterations} iterations"
            its += "" if rec.explored is None else f", {rec.explored} nodes"
            log(f"  {rec.name}: {status}, gap {g}, {rec.seconds:.2f} s "
                f"({m.ny} binaries, {m.nx} continuous, {m.n_constraints} rows{its})")
        return keep, rec


def run_solver(problem, solver: str, time_limit: float, rel_gap: float, nodes: int | None, *,
               warm: bool = False):
    """Solve a cvxpy MILP quietly.  Returns (whether it holds a solution,
    status, objective, gap): a backend that fails is a failed solve, not a
    crash, and a solve stopped before any incumbent holds no plan, whatever
    values cvxpy reports."""
    status, objv, gap = "error", None, None
    try:
        with silenced():
            problem.solve(solver=solver, warm_start=warm,
                          **solver_options(solver, max(time_limit, 0.05), rel_gap, nodes))
        status = problem.status
        objv = None if problem.value is None else float(problem.value)
        gap = mip_gap(problem, solver)
    except cp.error.SolverError as e:
        status = f"error: {str(e)[:80]}"
    except Exception as e:  # noqa: BLE001 - a backend failing is a failed solve, not a crash
        status = f"error: {type(e).__name__}: {str(e)[:80]}"
    ok = status in ("optimal", "optimal_inaccurate", "user_limit")
    if ok and status == "user_limit" and not has_solution(problem, solver):
        ok, status = False, "user_limit (no solution)"
    return ok, status, objv, gap


def solver_options(solver: str, time_limit: float, rel_gap: float = 1e-6, nodes: int | None = None) -> dict:
    """Time limit, relative optimality gap and branch-and-bound node limit, in
    each backend's words.  The node limit is what keeps a stopped solve
    deterministic: a time limit stops it wherever the machine's load left it."""
    solver = solver.upper()
    if solver == "HIGHS":
        # Cuts are separated at the root only, and the RINS and RENS sub-MIP
        # heuristics are off: on these models the root's own heuristics find
        # the final plan, and the sub-MIPs and node cuts cost more time than
        # they save (docs/02-optimizer.md).
        opts = {"time_limit": float(time_limit), "mip_rel_gap": rel_gap, "mip_abs_gap": 1e-9,
                "mip_allow_cut_separation_at_nodes": False,
                "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False}
        if nodes is not None:
            opts["mip_max_nodes"] = int(nodes)
        return opts
    if solver == "SCIP":
        params = {"limits/time": float(time_limit), "limits/gap": rel_gap}
        if nodes is not None:
            params["limits/nodes"] = int(nodes)
        return {"scip_params": params}
    if solver == "CBC":
        opts = {"maximumSeconds": max(1, int(time_limit)), "allowableFractionGap": rel_gap}
        if nodes is not None:
            opts["maximumNodes"] = int(nodes)
        return opts
    if solver == "SCIPY":
        opts = {"time_limit": float(time_limit), "mip_rel_gap": rel_gap}
        if nodes is not None:
            opts["node_limit"] = int(nodes)
        return {"scipy_options": opts}
    raise ValueError(f"no node limit for the MILP backend {solver}: a search it stops would depend on the "
                     f"machine's speed; use one of {', '.join(NODE_LIMITED)}")


def has_solution(problem, solver: str) -> bool:
    """Whether a stopped solve holds a feasible point (HiGHS says; for other
    backends the caller's own feasibility checks decide)."""
    try:
        info = problem.solver_stats.extra_stats
        if solver.upper() == "HIGHS" and info is not None:
            return int(info.primal_solution_status) == 2  # kSolutionStatusFeasible
    except Exception:  # noqa: BLE001 - best effort: fall back to the caller's checks
        pass
    return True


def highs_count(problem, solver: str, name: str) -> int | None:
    """A count HiGHS reports for the last solve (`simplex_iteration_count`,
    `mip_node_count`), or None (another backend, or none reported)."""
    try:
        info = problem.solver_stats.extra_stats
        if solver.upper() == "HIGHS" and info is not None:
            return int(getattr(info, name))
    except Exception:  # noqa: BLE001 - counts are best effort
        return None
    return None


def mip_gap(problem, solver: str):
    try:
        info = problem.solver_stats.extra_stats
        if solver.upper() == "HIGHS" and info is not None:
            g = float(info.mip_gap)
            if np.isfinite(g):
                return max(g, 0.0)
            return None
    except Exception:  # noqa: BLE001 - gap reporting is best effort
        return None
    if problem.status == "optimal":
        return 0.0
    return None


MILP_SOLVERS = ("HIGHS", "SCIP", "CBC", "GLPK_MI", "SCIPY")
# The backends with a branch-and-bound node limit, so that a search stopped
# early stops at the same point on any machine: the ones a plan may be made
# with.  GLPK has only a time limit.
NODE_LIMITED = ("HIGHS", "SCIP", "CBC", "SCIPY")


@functools.cache
def installed_solvers() -> tuple[str, ...]:
    """The MILP backends cvxpy can use here (asked once: cvxpy's own check
    imports each backend, tens of milliseconds a call)."""
    return tuple(s for s in MILP_SOLVERS if s in cp.installed_solvers())


def pick_options(A: np.ndarray, const: np.ndarray, cost: np.ndarray, groups: list[list[int]],
                 budget: float | None, *, subject: str, solver: str = "HIGHS", time_limit: float = 60.0,
                 nodes: int | None = None, log=None):
    """One option per group (the columns of A), such that every memory row
    ``A @ z + const`` stays within `budget`, at the least `cost`; with
    `budget` None, the least peak (ties: the least cost).  Returns (the
    chosen columns or None, SolveRecord)."""
    n = A.shape[1]
    scale = 1000.0 / max(float(np.abs(A).max(initial=0.0)), 1.0)
    z = cp.Variable(n, boolean=True)
    cons = [cp.sum(z[g]) == 1 for g in groups if g]
    cosc = cost / max(float(cost.sum()), 1.0)
    if budget is None:
        B = cp.Variable()
        cons.append((A * scale) @ z + const * scale <= B)
        obj = cp.Minimize(B + 1e-4 * (cosc @ z))
    else:
        cons.append((A * scale) @ z + const * scale <= float(budget) * scale)
        obj = cp.Minimize(cosc @ z)
    prob = cp.Problem(obj, cons)
    t0 = time.perf_counter()
    ok, status, objv, gap = run_solver(prob, solver, time_limit, 1e-6, nodes)
    rec = SolveRecord(COMBINE, subject, status, time.perf_counter() - t0, objv, gap, nodes=nodes,
                      variables=n, binaries=n, constraints=A.shape[0] + len(groups))
    if log:
        g = "-" if gap is None else f"{gap:.2%}"
        log(f"  {rec.name}: {status}, gap {g}, {rec.seconds:.2f} s ({n} options)")
    if not ok or z.value is None:
        return None, rec
    zv = np.asarray(z.value)
    if np.any(np.abs(zv - np.round(zv)) > 1e-4):
        return None, rec
    return [c for c in range(n) if zv[c] > 0.5], rec
