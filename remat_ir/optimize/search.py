"""The optimizer: rewrite a program's schedule to fit a memory budget with the
least recomputation.

    result = optimize(program, budget_bytes, scope="activations")
    result.program          # same graph, new explicit schedule, header.budget set
    result.predicted_peak   # simulate() peak in the scope (max of first step / steady state)

The plan family and its exact memory model are in `family.py`: per forward
node, keep its outputs for backward or recompute it lazily in backward.  The
MILP (`milp.py`, cvxpy; HiGHS by default) picks the cheapest plan that fits.

Graphs of up to FLAT_MAX_DECISIONS decisions are solved in one MILP
("flat", exact for the family), with its memory rows added as the plans it
finds break them (`Planner.lazy_flat`).  Larger ones are decomposed
(`blocks.py`): the forward graph is cut into segments along the model chain;
repeated blocks are found by structural hashing and each distinct segment is
solved once, for a range of targets, giving a Pareto set of options (bytes
kept into backward, transient peak, recompute cost); a dynamic program along
the chain (a small MILP when backward does not visit the segments in reverse
order) picks one option per segment, and more options are added around the
chosen ones.  Every plan is built into an explicit schedule and checked with
`simulate()`; when the real peak exceeds the budget (the decomposition is
approximate) the combine step is tightened and re-solved, and only plans
that fit are returned.  How far each MILP searches is a count of
branch-and-bound nodes (`Settings`), never a time, so the plan depends only
on the program, the budget and the options.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import msgspec
import numpy as np

from remat_ir.optimize.blocks import Segment, segments
from remat_ir.optimize.family import Analysis, apply_plan, profile, simulated_peak
from remat_ir.ir.costs import node_cost
from remat_ir.ir import COST_PROFILE, Budget, Program
from remat_ir.ir.budgets import budget_int, parse_budget
from remat_ir.ir.printer import human_bytes
from remat_ir.optimize.milp import KeepModel, SolveRecord, installed_solvers, pick_options
from remat_ir.ir.schedule import default_schedule
from remat_ir.ir.types import DEFAULT_SCOPE
from remat_ir.check.simulate import GRADIENTS, OPTIMIZER, PARAMS, simulate

# Up to this many decisions the flat MILP, with its memory rows added as the
# plans it finds break them, is solved to optimality in seconds: no
# decomposition, and a plan that depends on nothing but the program and the
# budget.  Above it, decompose (when the graph has segments).
FLAT_MAX_DECISIONS = 192
LAZY_ROUNDS = 40  # rounds of adding rows before the flat MILP takes every row at once
LAZY_ROUND_NODES = 500  # branch-and-bound nodes of the first round, which only learns rows
FLAT_PROOF_NODES = 3000  # ... and of the later rounds, which look for the cheapest plan
# The flat MILP stops within this relative gap of its optimum: proving the
# last fraction of a percent on chains of identical blocks (symmetric
# decisions) can take a minute.
FLAT_GAP = 5e-3
# Each round of a lazy search adds only the rows where its plan holds the
# most, not every row the plan breaks (docs/02-optimizer.md).  A
# least-peak search's first plan, solved against one row, breaks nearly all
# of them (a 3-layer Llama: 124,000 rows at once, 31 s for the root LP
# alone) while the peak is decided at a few; its time is the root's search
# for a plan at the LP bound, and with too few rows a round each plan moves
# its peak to rows not yet seen.  A budget search's time is the last round's
# branch and bound, which grows with the rows, and few rows bind at a
# budget: a round or two more of small MILPs cost less than one proof over
# every row the first plan broke.
PEAK_ROWS_PER_ROUND = 16  # a block's least-peak option MILPs
FLOOR_ROWS_PER_ROUND = 32  # the flat floor search
BUDGET_ROWS_PER_ROUND = 4  # the flat search at a budget, ...
ROWS_APART = 2  # ... events apart where it can (`_highest_apart`)

# A safety stop, not a tuning knob: the search's own limits are counts (see
# `Settings`), and a run this limit cuts short says so.
DEFAULT_TIME_LIMIT = 300.0


class Infeasible(ValueError):
    """The budget is below the smallest peak this optimizer can reach."""

    def __init__(self, message: str, floor_bytes: int, budget_bytes: int | None = None,
                 scope: str = DEFAULT_SCOPE):
        super().__init__(message)
        self.floor_bytes = int(floor_bytes)
        self.budget_bytes = budget_bytes
        self.scope = scope


@dataclass
class OptimizeResult:
    program: Program
    predicted_peak: int
    extra_cost: float  # recompute cost of the plan, in the program's cost model
    base_cost: float  # cost of every op of the step, same unit
    solves: list[SolveRecord]
    seconds: float
    budget: int = 0
    scope: str = DEFAULT_SCOPE
    mode: str = "flat"  # "flat", "decomposed" or "none" (the unoptimized plan fits)
    recomputed: list[str] = field(default_factory=list)
    time_limited: bool = False  # the safety time limit cut the search short

    @property
    def overhead(self) -> float:
        return self.extra_cost / self.base_cost if self.base_cost else 0.0


# ---------------------------------------------------------------- budgets

def unoptimized_peak(program: Program, scope: str = DEFAULT_SCOPE) -> int:
    """Peak of the default schedule (compute in order, free after last use)."""
    fwd, bwd = default_schedule(program)
    base = Program(header=program.header, values=program.values, nodes=program.nodes,
                   forward=fwd, backward=bwd, outputs=program.outputs)
    return simulated_peak(base, scope)[0]


def resolve_budget(program: Program, text: str | int | float, scope: str = DEFAULT_SCOPE) -> int:
    """Bytes of a budget given as "1.5GiB", "800MB" (SI), "123456" (bytes), or
    a fraction of the unoptimized peak in the scope: "0.5", "50%".  Raises
    ValueError when it cannot be read, or is not a positive, finite number of
    bytes that fits a 64-bit integer ("0", "-1", "1e400", "inf",
    "99999999999999999999TiB"): `remat_ir.ir.budgets.parse_budget`."""
    kind, amount = parse_budget(text)
    if kind == "fraction":
        return budget_int(amount * unoptimized_peak(program, scope), text)
    return int(amount)


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """How hard the decomposed search works.  Every limit is a count (MILP
    branch-and-bound nodes, option levels), never a time, so the plan depends
    only on the program, the budget and these settings.  A node limit of None
    solves to the gap tolerance."""

    option_nodes: int | None = None  # per option MILP of a block
    window_nodes: int | None = None  # per refinement-window MILP (two adjacent segments)
    combine_nodes: int | None = None  # per combine MILP (non-chain graphs)
    option_gap: float = 1e-3  # option MILPs sample a Pareto set: near-optimal is enough
    # Least-peak option MILPs (hard to prove) only set where the peak levels
    # start; the floor solves them again to `option_gap`.
    peak_gap: float = 1e-2
    kept_levels: int = 5  # option levels of bytes kept into backward ...
    kept_power: float = 1.5  # ... spaced by this power (denser near the least)
    peak_levels: int = 4  # option levels of a block's transient peak
    low_peak_levels: int = 1  # least-peak options at the smallest kept levels
    fit_per_class: int = 3  # options cut to the room the chain leaves, per block class
    densify_rounds: int = 3
    all_windows: bool = False  # refine every pair of adjacent segments, not only a whole-graph window
    combine: str = "auto"  # "auto": the chain DP where it is exact, else the MILP; "milp": always the MILP


# Both efforts give the same plan on any machine at any load.  "fast" stops
# each MILP at a node limit (with the memory rows added lazily, a block's
# MILP is small enough that this is fast); "full" solves each to its gap
# tolerance and refines every pair of adjacent segments.
EFFORTS = {
    "fast": Settings(option_nodes=500, window_nodes=3000, combine_nodes=3000),
    "full": Settings(fit_per_class=9, all_windows=True, peak_gap=1e-3),
}


@dataclass(frozen=True)
class Option:
    """One plan of a segment, as the combine sees it."""

    kept: frozenset  # kept decisions
    retained: int  # bytes kept from forward into backward
    fwd_peak: int  # peak over the segment's forward range (with the constants)
    bwd_peak: int  # peak over its backward window (with the constants)
    cost: float  # recompute cost

    @property
    def numbers(self) -> tuple:
        return (self.retained, self.fwd_peak, self.bwd_peak, self.cost)


def pareto_options(options: list[Option]) -> list[Option]:
    """`options` without duplicates and without any another option dominates
    (no worse in every number, better in one); first come first kept."""
    uniq: dict = {}
    for o in options:
        uniq.setdefault(o.kept, o)
    out, seen = [], set()
    for o in uniq.values():
        if o.numbers in seen:
            continue
        if any(q.numbers != o.numbers and all(x <= y for x, y in zip(q.numbers, o.numbers))
               for q in uniq.values()):
            continue
        seen.add(o.numbers)
        out.append(o)
    return out


def chain_dp(options: list[list[Option]], in_window: list[bool], start: float, budget: float | None):
    """One option per segment of a chain (backward visits the segments in
    reverse), by dynamic programming.  State: bytes kept by the segments so
    far (S); an option fits when `S + its transient peak <= budget`, the
    transient being the forward peak, and the backward one for segments with
    a backward window.  The frontier keeps the Pareto-best states: (S, cost)
    with a budget, (S, peak so far) without (the least peak).

    Returns (chosen option index per segment, or None; the objective; the
    frontier after each segment)."""
    # The frontier: rows (S, cost or peak, parent, option), as arrays.
    front = np.array([[0.0, 0.0, -1, -1]])
    steps = []
    for opts, win in zip(options, in_window):
        lims = np.array([max(o.fwd_peak, o.bwd_peak) if win else o.fwd_peak for o in opts], dtype=float)
        ret = np.array([o.retained for o in opts], dtype=float)
        ocost = np.array([o.cost for o in opts], dtype=float)
        S, c = front[:, 0][:, None], front[:, 1][:, None]
        pi = np.broadcast_to(np.arange(len(front))[:, None], (len(front), len(opts)))
        oi = np.broadcast_to(np.arange(len(opts))[None, :], (len(front), len(opts)))
        need = S + lims[None, :]
        s_new = S + ret[None, :]
        if budget is None:
            c_new, tie = np.maximum(c, need), np.broadcast_to(ocost[None, :], need.shape)
            ok = np.ones(need.shape, dtype=bool)
        else:
            c_new, tie = c + ocost[None, :], np.zeros(need.shape)
            ok = need <= budget
        cs, cc, ct, cp, co = (x[ok] for x in (s_new, np.broadcast_to(c_new, need.shape), tie, pi, oi))
        # Sorted by (S, cost, tie, parent, option); a state is kept when its
        # cost is below every state with less or equal S before it.
        order = np.lexsort((co, cp, ct, cc, cs))
        cs, cc, cp, co = cs[order], cc[order], cp[order], co[order]
        if len(cc):
            best_before = np.concatenate(([np.inf], np.minimum.accumulate(cc)[:-1]))
            keep = cc < best_before
            cs, cc, cp, co = cs[keep], cc[keep], cp[keep], co[keep]
        pruned = np.stack([cs, cc, cp.astype(float), co.astype(float)], axis=1) if len(cc) else np.zeros((0, 4))
        if len(pruned) > 20000:  # keep the frontier small: thin it evenly
            step = len(pruned) / 20000.0
            pruned = np.concatenate([pruned[[int(i * step) for i in range(20000)]], pruned[-1:]])
        front = pruned
        steps.append(front)
        if not len(front):
            return None, None, steps
    ok = [(max(t[1], start + t[0]) if budget is None else t[1], i) for i, t in enumerate(front.tolist())
          if budget is None or start + t[0] <= budget]
    if not ok:
        return None, None, steps
    val, i = min(ok)
    chosen = [0] * len(options)
    for k in range(len(options) - 1, -1, -1):
        t = steps[k][i]
        chosen[k] = int(t[3])
        i = int(t[2])
    return chosen, float(val), steps


# ---------------------------------------------------------------- planner


@dataclass
class Plan:
    keep: list[bool]
    peak: int  # simulated, max over first step / steady state
    cost: float  # recompute cost, in the program's cost model
    report: object = None


class Planner:
    """Everything about one program and scope that solves can share.  A
    caller that plans several budgets of one program (a sweep, the floor then
    a budget) holds one Planner and passes it to `floor` and `optimize`."""

    def __init__(self, program: Program, scope: str = DEFAULT_SCOPE, *, solver: str = "HIGHS",
                 decompose: bool | None = None, effort: str | Settings = "fast", log=None):
        if isinstance(effort, str) and effort not in EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(EFFORTS)}, not {effort!r}")
        self.settings = EFFORTS[effort] if isinstance(effort, str) else effort
        self.program = program
        self.scope = scope
        self.solver = solver.upper()
        self.log = log
        self.a = Analysis(program, scope)
        self.all_dec = self.a.decisions()
        # The step's cost in the plan's cost model (FLOPs, or profiled microseconds).
        self.base_cost = float(sum(node_cost(n, program.header.cost) for n in program.nodes))
        if decompose is None:
            decompose = len(self.all_dec) > FLAT_MAX_DECISIONS
            if decompose:
                segs, _ = segments(self.a)
                decompose = sum(1 for s in segs if s.decisions) >= 2
        self.decompose = decompose
        self.solves: list[SolveRecord] = []
        self.plans: dict[tuple, Plan] = {}
        self.class_models: dict[str, dict] = {}
        self.floor_plan: Plan | None = None
        self.floor_proven = False  # the flat MILP proved the floor optimal
        self.flat_floor_tried = False
        self.floor_mode = "flat"  # which search found the floor plan
        self.last_window_whole = False  # the last refinement solved one window over every decision
        self.last_frontier = None  # (segments, frontier after each) of the last chain DP
        self.deadline = math.inf
        self.time_limited = False  # the safety time limit stopped some search
        # The decomposition, made by `prepare_segments` on first use.
        self.segs: list[Segment] | None = None
        self.fixed: dict[int, int] = {}  # decisions forced to keep (segment boundaries)
        self.part: dict[int, tuple[int, int]] = {}  # segment -> its backward window of stages
        self.first_window = 0  # the first backward stage of any segment's window
        self.classes: dict[str, list[Segment]] = {}  # structural signature -> its segments
        self.chain = False  # backward visits the segments in reverse: the combine is the chain DP
        self.options: dict[int, list[Option]] = {}  # segment -> its Pareto options

    def say(self, msg: str) -> None:
        if self.log:
            self.log(msg)

    def cost_text(self, cost: float) -> str:
        """A recompute cost for the log: GFLOP, or ms under the profile cost model."""
        if self.program.header.cost == COST_PROFILE:
            return f"{cost / 1e3:.4g} ms"
        return f"{cost / 1e9:.4g} GFLOP"

    # ---- the safety time limit

    def start(self, time_limit: float) -> None:
        self.deadline = time.perf_counter() + time_limit

    def out_of_time(self, reserve: float = 0.0) -> bool:
        """Whether the safety time limit is (about to be) reached; if so, the
        result says the limit cut the search short."""
        if time.perf_counter() + reserve < self.deadline:
            return False
        self.time_limited = True
        return True

    def _timed(self, solve):
        """Run `solve(time_limit)` (one MILP, which returns (result,
        SolveRecord)) under what is left of the safety time limit; record the
        solve, and note when that limit, not the MILP's own node limit or
        gap, is what stopped it."""
        left = max(self.deadline - time.perf_counter(), 0.05)
        got, rec = solve(min(left, 1e6))
        self.solves.append(rec)
        if rec.seconds >= left * 0.98:
            self.time_limited = True
        return got, rec

    def _solve(self, compiled, name: str, *, nodes: int | None, **kw):
        """One MILP of a `KeepModel` under its node limit (see `_timed`)."""
        return self._timed(lambda limit: compiled.solve(name, solver=self.solver, time_limit=limit,
                                                        nodes=nodes, log=self.log, **kw))

    # ---- evaluation

    def evaluate(self, kept: set[int]) -> Plan:
        key = tuple(sorted(kept))
        if key in self.plans:
            return self.plans[key]
        keep = self.a.keep_of(kept)
        prog = apply_plan(self.a, keep)
        peak, rep = simulated_peak(prog, self.scope)
        plan = Plan(keep, peak, self.a.recompute_cost(keep), rep)
        self.plans[key] = plan
        return plan

    def keep_all(self) -> Plan:
        return self.evaluate(set(self.all_dec))

    # ---- flat

    def lazy_flat(self, budget: int | None) -> Plan | None:
        """The flat MILP (exact for the plan family) over every decision, with
        only the memory rows the plans it finds break: solve with some rows,
        profile the plan exactly, add the rows where it holds more than the
        budget (without a budget, more than the peak the MILP claimed), and
        solve again.  Each round's optimum bounds the true one from below,
        so the first plan that breaks no row is optimal.  Most rows never
        bind: gpt2-tiny's budgets end with a few to a few dozen of its
        ~8,000.
        Returns None when no plan fits (the budget is below the floor)."""
        a = self.a
        objective = "cost" if budget is not None else "peak"
        what = f"budget {human_bytes(budget)}" if budget is not None else "floor"
        # Each search starts from the start-of-backward row alone.  Rows one
        # budget needed are valid for every budget, but measured, starting
        # from them is slower: the MILP's time grows with its rows, and a
        # larger budget's rows save no round (gpt2-tiny's sweep: 20 s from
        # scratch, 24 s from the rows of the budget above).
        active: set | None = {("s",)}
        # The first round only needs a plan to learn rows from, not a proof:
        # it stops at a small node limit (with the start row alone it is a
        # knapsack, slow to prove on chains of identical blocks).  Later
        # rounds, and a first-round plan that breaks no row, search up to a
        # larger node limit; the plan is then the best found (its gap is in
        # the solve record).  Node limits, unlike time limits, stop every
        # machine at the same point.
        nodes = LAZY_ROUND_NODES
        # Without a budget every round's plan is a plan, with an exact peak:
        # a floor search that ends early (out of rounds or time) returns the
        # least of them rather than nothing.
        best: Plan | None = None

        def done(plan: Plan | None) -> Plan | None:
            if best is None or (plan is not None and (plan.peak, plan.cost) <= (best.peak, best.cost)):
                return plan
            return best
        for rnd in range(2 * LAZY_ROUNDS):
            m = KeepModel(a).build(active)
            c = m.compile(objective)
            if budget is not None:
                c.B.value = float(budget)
            rows = "every" if active is None else len(active)
            kept, rec = self._solve(c, f"flat {what}, round {rnd + 1} ({rows} memory rows)", nodes=nodes,
                                    rel_gap=FLAT_GAP)
            if kept is None:
                if nodes == FLAT_PROOF_NODES or rec.status == "infeasible":
                    return done(None)
                nodes = FLAT_PROOF_NODES  # no plan within the round's node limit: search further
                continue
            prof = profile(a, a.keep_of(kept), range(len(a.storages)))
            if budget is None:
                best = done(self.evaluate(kept))
            limit = float(budget) if budget is not None else float(c.B.value) + 0.5
            over = m.rows_over(prof, limit)
            if ("tail",) in over:
                return None  # bytes no plan changes exceed the budget
            new = set() if active is None else set(over) - active
            new = (_highest(new, over, FLOOR_ROWS_PER_ROUND) if budget is None
                   else _highest_apart(new, over, BUDGET_ROWS_PER_ROUND, ROWS_APART))
            if not new:
                if over and active is not None:
                    active = None  # (never seen) a row the mapping missed: take every row
                    continue
                if rec.status == "optimal" or nodes == FLAT_PROOF_NODES:
                    if budget is None:
                        self.floor_proven = rec.status == "optimal" and not rec.gap
                    return done(self.evaluate(kept))
                nodes = FLAT_PROOF_NODES  # fits every row: now search on for a cheaper one
                continue
            active |= new
            nodes = FLAT_PROOF_NODES  # later rounds usually end the search: let them finish it
            if rnd + 1 >= LAZY_ROUNDS:
                active = None
        return done(None)

    # ---- decomposed: segments and their options

    def prepare_segments(self) -> None:
        if self.segs is not None:
            return
        a = self.a
        t0 = time.perf_counter()
        segs, fixed = segments(a)
        self.segs, self.fixed = segs, fixed
        # Partition of the backward stages into windows, in backward order.
        with_st = sorted((s for s in segs if s.storages), key=lambda s: s.window[0])
        self.part = {}
        for i, s in enumerate(with_st):
            hi = with_st[i + 1].window[0] - 1 if i + 1 < len(with_st) else a.nb - 1
            self.part[s.index] = (s.window[0], max(hi, s.window[1]))
        self.first_window = with_st[0].window[0] if with_st else a.nb
        classes: dict[str, list[Segment]] = {}
        for s in segs:
            classes.setdefault(s.signature, []).append(s)
        self.classes = classes
        self.chain = self.settings.combine == "auto" and self._is_chain()
        self.say(f"decomposition: {len(segs)} segments, {len(classes)} distinct, "
                 f"{len(fixed)} checkpoints forced, {len(self.all_dec)} decisions "
                 f"({time.perf_counter() - t0:.2f} s)")
        # Per class: Pareto options from the canonical instance.
        for inst in classes.values():
            canon = inst[0]
            opts = self._class_options(canon) if canon.decisions else [frozenset()]
            self._evaluate_options(canon, inst, opts)

    def _is_chain(self) -> bool:
        """Backward visits the segments in reverse forward order, so what the
        others hold during a segment (forward or backward) is exactly what the
        segments before it keep: the combine is a dynamic program."""
        pos = {s.index: i for i, s in enumerate(self.segs)}
        lo = {si: self.part[si][0] for si in self.part}
        for si in lo:
            after = {j for j in lo if lo[j] > lo[si]}
            before = {j for j in lo if pos[j] < pos[si]}
            if after != before:
                return False
        return True

    def _solve_class(self, canon: Segment, objective: str, label: str, *, B=None, R=None, gap=None):
        """One MILP on a class's canonical segment; returns (kept, B value).

        Like the flat search, it is solved with only the memory rows plans
        break (`lazy_flat`), learned per class: a row one option's plan broke
        is a row of every option of the class."""
        a = self.a
        cm = self.class_models.setdefault(canon.signature, {"rows": set(), "models": {}})
        others = set(self.all_dec) - set(canon.decisions)
        capped = objective == "peak" or B is not None  # without a memory cap no row matters
        for _ in range(LAZY_ROUNDS):
            rows = cm["rows"] if capped else set()
            key = (objective, frozenset(rows))
            c = cm["models"].get(key)
            if c is None:
                m = KeepModel(a, nodes=canon.nodes, storages=canon.storages, fixed=self.fixed,
                              mode="local", decisions=canon.decisions).build(rows)
                c = cm["models"][key] = m.compile(objective, tie_retained=1e-3 if objective == "cost" else 0.0)
            if objective != "peak":
                c.B.value = float(B) if B is not None else 1e18
            c.Rcap.value = float(R) if R is not None else 1e18
            kept, _ = self._solve(c, f"{canon.name} {label} ({len(rows)} memory rows)",
                                  nodes=self.settings.option_nodes, warm=True,
                                  rel_gap=self.settings.option_gap if gap is None else gap)
            if kept is None or not capped:
                break
            limit = float(c.B.value) + 0.5 if objective == "peak" else float(B)
            prof = profile(a, a.keep_of(others | set(kept)), canon.storages)
            over = c.m.rows_over(prof, limit)
            new = set(over) - cm["rows"]
            if objective == "peak":
                new = _highest(new, over, PEAK_ROWS_PER_ROUND)
            if not new:
                break
            cm["rows"] |= new
        bval = float(c.B.value) if (objective == "peak" and c.B.value is not None) else None
        return kept, bval

    def _class_options(self, canon: Segment) -> list[frozenset]:
        """Kept-decision sets of the canonical instance: a Pareto set over
        (bytes kept into backward, transient peak, recompute cost)."""
        a, st = self.a, self.settings
        # Two plans need no solve: keep everything, recompute everything.
        opts: list[frozenset] = [frozenset(canon.decisions), frozenset()]
        others = set(self.all_dec) - set(canon.decisions)

        def retained(k):
            return profile(a, a.keep_of(others | set(k)), canon.storages, with_constants=False).retained

        def run(objective, label, B=None, R=None):
            if self.out_of_time():
                return None, None
            gap = st.peak_gap if objective == "peak" else None
            kept, bval = self._solve_class(canon, objective, label, B=B, R=R, gap=gap)
            if kept is not None:
                opts.append(frozenset(kept))
            return kept, bval

        r_all = retained(canon.decisions)
        # The two extremes first: they decide the floor.
        k_min, _ = run("retained", "min kept")
        r_min = retained(k_min) if k_min is not None else r_all
        k_pk, p_min = run("peak", "min peak")
        p_all = self._local_peak(canon, frozenset(canon.decisions))
        # Lower-transient options for the smallest kept sizes: the least
        # peak, then the cheapest plan at that peak.
        levels = [r_min + (r_all - r_min) * (i / max(st.kept_levels, 1)) ** st.kept_power
                  for i in range(max(st.kept_levels, 1))]
        for r in levels[:st.low_peak_levels]:
            k, bval = run("peak", f"min peak kept<={human_bytes(r)}", R=r + 0.5)
            if k is None or bval is None:
                continue
            pcap = bval * (1 + 1e-6) + 4096
            run("cost", f"peak<={human_bytes(pcap)} kept<={human_bytes(r)}", B=pcap, R=r + 0.5)
        # Then levels of kept size (peak free) and of transient peak (kept
        # size free).
        p_ok = k_pk is not None and p_min is not None and p_all > p_min + 1
        for i in range(max(st.kept_levels, st.peak_levels if p_ok else 0)):
            if i < st.kept_levels:
                run("cost", f"kept<={human_bytes(levels[i])}", R=levels[i] + 0.5)
            if p_ok and i < st.peak_levels:
                pcap = p_min + (p_all - p_min) * (i / st.peak_levels) ** 1.5
                run("cost", f"peak<={human_bytes(pcap)}", B=pcap * (1 + 1e-6) + 4096)
        return list(dict.fromkeys(opts))

    def _local_peak(self, canon: Segment, kept: frozenset) -> float:
        """The local peak of an option as the segment's MILP counts it."""
        a = self.a
        others = set(self.all_dec) - set(canon.decisions)
        pr = profile(a, a.keep_of(others | set(kept)), canon.storages, with_constants=False)
        lo, hi = canon.window
        pb = 0.0
        if hi >= lo:
            js = np.arange(lo, hi + 1)
            pb = float(max((a.const_b[js] + pr.live_b[js]).max(), (a.const_pre[js] + pr.live_q[js]).max()))
        f0, f1 = canon.fwd_range
        ts = np.arange(f0, f1 + 1)
        return max(pb, float((a.base_f + a.fwd_asap[ts] + pr.fwd_extra[ts]).max()))

    def densify(self, choice: dict) -> bool:
        """Add options next to the ones the combine chose (kept sizes halfway
        to the neighbouring options).  Returns whether any option was added."""
        added = False
        for inst in self.classes.values():
            canon = inst[0]
            if not canon.decisions:
                continue
            have = sorted({o.retained for o in self.options[canon.index]})
            chosen = sorted({choice[s.index].retained for s in inst if s.index in choice})
            caps = set()
            for r in chosen:
                i = have.index(r) if r in have else bisect_left(have, r)
                if i > 0:
                    caps.add((have[i - 1] + r) / 2)
                if i + 1 < len(have):
                    caps.add((r + have[i + 1]) / 2)
            caps = {c for c in caps if not any(abs(c - h) < 1 for h in have)}
            solves = [(f"kept<={human_bytes(c)}", dict(R=c + 0.5)) for c in sorted(caps)]
            added = self._add_options(canon, inst, solves) or added
        return added

    def fit_options(self, budget: float) -> bool:
        """Options cut to the room the chain leaves each segment.  The first
        option sets sample kept size and transient peak on fixed levels; the
        cheapest plan often pairs a segment's cheaper, larger-peak option
        with smaller kept sizes before it.  The chain DP's frontier before
        each segment lists the kept sizes S that can precede it, so solve each
        class again with its peak capped at budget - S (a few such S per
        class, spread over the frontier).  Returns whether any option was
        added."""
        if not self.chain or self.last_frontier is None:
            return False
        segs_dp, steps = self.last_frontier
        per_class = self.settings.fit_per_class
        caps: dict[str, set] = {}
        for k, s in enumerate(segs_dp):
            if not s.decisions or k >= len(steps) + 1:
                continue
            prefixes = {0.0} if k == 0 else set(steps[k - 1][:, 0].tolist())
            caps.setdefault(s.signature, set()).update(budget - S for S in prefixes if S < budget)
        added = False
        for sig, cs in caps.items():
            inst = self.classes[sig]
            cs = sorted(cs)
            if len(cs) > per_class:
                cs = [cs[round(i * (len(cs) - 1) / (per_class - 1))] for i in range(per_class)]
            solves = [(f"peak<={human_bytes(cap)} (room)", dict(B=cap)) for cap in dict.fromkeys(cs)]
            added = self._add_options(inst[0], inst, solves) or added
        return added

    def _add_options(self, canon: Segment, inst: list[Segment], solves: list[tuple[str, dict]]) -> bool:
        """Solve the class MILP (least recompute) under each (label, caps) in
        `solves`, and add what it finds to the class's options.  Returns
        whether the option sets grew."""
        new = []
        for label, caps in solves:
            if self.out_of_time():
                break
            kept, _ = self._solve_class(canon, "cost", label, **caps)
            if kept is not None:
                new.append(frozenset(kept))
        if not new:
            return False
        before = {o.kept for s in inst for o in self.options[s.index]}
        self._evaluate_options(canon, inst, new)
        return {o.kept for s in inst for o in self.options[s.index]} != before

    def _evaluate_options(self, canon: Segment, inst: list[Segment], opts: list[frozenset]) -> None:
        """Each option of a class, mapped onto its instances.  Instances of
        one layout (every storage and stage lines up) share one profile,
        shifted; a class can hold several layouts (the storages crossing
        segments live where they are last read), each profiled on its own
        first instance."""
        a = self.a
        layouts: dict[str, list[Segment]] = {}
        for s in inst:
            layouts.setdefault(s.layout, []).append(s)
        for group in layouts.values():
            rep = group[0]
            to_rep = dict(zip(canon.nodes, rep.nodes))
            others = set(self.all_dec) - set(rep.decisions)
            for o in opts:
                kept = frozenset(to_rep[d] for d in o)
                pr = profile(a, a.keep_of(others | set(kept)), rep.storages, with_constants=False)
                for s in group:
                    nmap = dict(zip(rep.nodes, s.nodes))
                    db = s.window[0] - rep.window[0]
                    df = s.nodes[0] - rep.nodes[0]
                    lo, hi = self.part.get(s.index, (s.window[0], s.window[1]))
                    pb = 0
                    if hi >= lo:
                        js = np.arange(lo, hi + 1)
                        rel = js - db
                        ok = (rel >= 0) & (rel < a.nb)
                        lb = np.zeros(len(js), dtype=np.int64)
                        lq = np.zeros(len(js), dtype=np.int64)
                        lb[ok] = pr.live_b[rel[ok]]
                        lq[ok] = pr.live_q[rel[ok]]
                        pb = int(max((a.const_b[js] + lb).max(), (a.const_pre[js] + lq).max()))
                    f0, f1 = s.fwd_range
                    ts = np.arange(f0, f1 + 1)
                    pf = int((a.base_f + a.fwd_asap[ts] + pr.fwd_extra[ts - df]).max())
                    self.options.setdefault(s.index, []).append(Option(
                        frozenset(nmap[d] for d in kept), int(pr.retained), pf, pb, pr.cost))
        for s in inst:
            self.options[s.index] = pareto_options(self.options[s.index])

    # ---- decomposed: combining options

    def _start_const(self) -> float:
        start = float(self.a.const_start)
        if self.first_window > 0:
            start = max(start, float(self.a.const_b[:self.first_window].max()))
        return start

    def combine(self, budget: float | None, label: str):
        """Pick one option per segment.  budget None: minimize the modeled
        peak.  Returns (kept decision set, modeled peak, choice) or None."""
        segs = [s for s in self.segs if self.options.get(s.index)]
        if self.chain:
            t0 = time.perf_counter()
            chosen, val, steps = chain_dp([self.options[s.index] for s in segs],
                                          [s.index in self.part for s in segs], self._start_const(), budget)
            self.last_frontier = (segs, steps)
            rec = SolveRecord(f"combine {label} (chain DP)", "infeasible" if chosen is None else "optimal",
                              val, 0.0, time.perf_counter() - t0,
                              sum(len(self.options[s.index]) for s in segs), 0, len(segs))
            self.solves.append(rec)
            self.say(f"  {rec.name}: {rec.status}, {rec.seconds:.2f} s (frontier "
                     f"{max((len(f) for f in steps), default=0)})")
            if chosen is None:
                return None
        else:
            chosen = self._combine_milp(segs, budget, label)
            if chosen is None:
                return None
        choice = {s.index: self.options[s.index][k] for s, k in zip(segs, chosen)}
        return self.kept_of(choice), self.modeled_peak(choice), choice

    def _combine_milp(self, segs: list[Segment], budget: float | None, label: str):
        """The combine for any window order: a small MILP over the options,
        one memory row per segment's forward range and backward window."""
        cols = [(s.index, k) for s in segs for k in range(len(self.options[s.index]))]
        opt = [self.options[si][k] for si, k in cols]
        R = np.array([o.retained for o in opt], dtype=float)
        pos_f = {s.index: i for i, s in enumerate(segs)}
        rows = []
        for s in segs:
            # forward range of s: its transient + what earlier segments keep
            rows.append([o.fwd_peak if si == s.index else (o.retained if pos_f[si] < pos_f[s.index] else 0.0)
                         for (si, _), o in zip(cols, opt)])
            if s.index in self.part:
                lo = self.part[s.index][0]
                rows.append([o.bwd_peak if si == s.index else
                             (o.retained if si in self.part and self.part[si][0] > lo else 0.0)
                             for (si, _), o in zip(cols, opt)])
        rows.append(list(R))
        A = np.array(rows, dtype=float)
        const = np.zeros(len(rows))
        const[-1] = self._start_const()
        groups = [[c for c, (si, _) in enumerate(cols) if si == s.index] for s in segs]
        picked, _ = self._timed(lambda limit: pick_options(
            A, const, np.array([o.cost for o in opt]), groups, budget, name=f"combine {label}",
            solver=self.solver, time_limit=limit, nodes=self.settings.combine_nodes, log=self.log))
        if picked is None:
            return None
        by_seg = {cols[c][0]: cols[c][1] for c in picked}
        return [by_seg[s.index] for s in segs]

    def modeled_peak(self, choice: dict) -> float:
        pos = {s.index: i for i, s in enumerate(self.segs)}
        lo = {si: self.part[si][0] for si in self.part}
        peak = self._start_const() + sum(o.retained for o in choice.values())
        for si, o in choice.items():
            before = sum(choice[j].retained for j in choice if pos[j] < pos[si])
            peak = max(peak, o.fwd_peak + before)
            if si in lo:
                after = sum(choice[j].retained for j in choice if j in lo and lo[j] > lo[si])
                peak = max(peak, o.bwd_peak + after)
        return float(peak)

    def kept_of(self, choice: dict) -> set[int]:
        kept = set(self.all_dec) - {d for s in self.segs for d in s.decisions}
        for o in choice.values():
            kept |= set(o.kept)
        return kept

    def decomposed_budget(self, budget: int) -> Plan | None:
        """The cheapest plan the combine finds that really fits (simulated),
        improved with denser options around the chosen ones."""
        self.prepare_segments()
        target = float(budget)
        best = None
        for it in range(8):
            got = self.combine(target, f"{human_bytes(budget)}" + (f" (try {it + 1})" if it else ""))
            if got is None:
                break
            kept, modeled, choice = got
            plan = self.evaluate(kept)
            self.say(f"  plan: modeled {human_bytes(modeled)}, simulated {human_bytes(plan.peak)}, "
                     f"+{self.cost_text(plan.cost)}")
            if plan.peak <= budget:
                best = (plan, choice, target)
                break
            over = plan.peak - budget
            target = min(target - over, modeled - over) - 1
        if best is None:
            return None
        plan, choice, target = best
        for _ in range(self.settings.densify_rounds):
            if plan.cost <= 0 or self.out_of_time() or not self.densify(choice):
                break
            got = self.combine(target, f"{human_bytes(budget)} (denser options)")
            if got is None:
                break
            kept, modeled, ch2 = got
            p2 = self.evaluate(kept)
            self.say(f"  denser: simulated {human_bytes(p2.peak)}, +{self.cost_text(p2.cost)}")
            if p2.peak <= budget and p2.cost < plan.cost:
                gain = plan.cost - p2.cost
                plan, choice = p2, ch2
                if gain < 0.002 * plan.cost:
                    break  # diminishing returns
            else:
                break
        if plan.cost > 0 and not self.out_of_time() and self.fit_options(budget):
            got = self.combine(target, f"{human_bytes(budget)} (options fitted to the room)")
            if got is not None:
                kept, modeled, ch2 = got
                p2 = self.evaluate(kept)
                self.say(f"  fitted: simulated {human_bytes(p2.peak)}, +{self.cost_text(p2.cost)}")
                if p2.peak <= budget and p2.cost < plan.cost:
                    plan, choice = p2, ch2
        if plan.cost > 0:
            plan = self.refine_windows(plan, budget)
        return plan

    def refine_windows(self, plan: Plan, budget: int) -> Plan:
        """Re-solve the decisions of two adjacent segments at a time with the
        exact (flat) memory model, every other decision held at `plan`'s:
        the segment models and the combine only approximate what segments
        cost each other.  Each window keeps the cheaper plan that fits.  With
        `all_windows` every window is solved; otherwise only a window that
        holds every decision (two segments: the flat MILP itself), since on
        longer chains each window costs seconds.  (No warm start: cvxpy's
        HiGHS interface only reuses a previous solve of the same problem
        object, and each window is a new one.)"""
        self.last_window_whole = False
        segs = [s for s in self.segs if s.decisions]
        if len(segs) < 2 or (not self.settings.all_windows and len(segs) > 2):
            return plan
        for i in range(len(segs) - 1):
            if plan.cost <= 0 or self.out_of_time():
                break
            window = set(segs[i].decisions) | set(segs[i + 1].decisions)
            kept = {d for d in self.all_dec if plan.keep[d]}
            fixed = {d: int(d in kept) for d in self.all_dec if d not in window}
            c = KeepModel(self.a, fixed=fixed).build().compile("cost")
            c.B.value = float(budget)
            if c.y is None:
                continue
            name = f"window {segs[i].name}+{segs[i + 1].name}"
            got, _ = self._solve(c, name, nodes=self.settings.window_nodes)
            if got is None:
                continue
            if len(segs) == 2:
                self.last_window_whole = True  # that MILP was the flat one
            p2 = self.evaluate(set(got) | {d for d, v in fixed.items() if v})
            self.say(f"  {name}: simulated {human_bytes(p2.peak)}, +{self.cost_text(p2.cost)}")
            if p2.peak <= budget and p2.cost < plan.cost:
                plan = p2
        return plan

    def decomposed_floor(self) -> Plan | None:
        self.prepare_segments()
        if self.settings.peak_gap > self.settings.option_gap:
            for inst in self.classes.values():
                canon = inst[0]
                if canon.decisions and not self.out_of_time():
                    kept, _ = self._solve_class(canon, "peak", "min peak (for the floor)")
                    if kept is not None:
                        self._evaluate_options(canon, inst, [frozenset(kept)])
        got = self.combine(None, "min peak")
        cands = []
        if got is not None:
            kept, modeled, _ = got
            plan = self.evaluate(kept)
            cands.append(plan)
            # The model is approximate: try to close the gap with budgets just
            # below the first plan's simulated peak.
            if plan.peak > modeled:
                p2 = self.decomposed_budget(int(modeled))
                if p2 is not None:
                    cands.append(p2)
        cands.append(self.keep_all())
        cands.append(self.evaluate(self.kept_of({})))  # checkpoint every segment
        return min(cands, key=lambda p: (p.peak, p.cost))

    # ---- the floor

    def floor_plan_for(self) -> Plan:
        if self.floor_plan is None:
            plan = self.decomposed_floor() if self.decompose else self.lazy_flat(None)
            self.flat_floor_tried = not self.decompose
            cands = [p for p in (plan, self.keep_all(), self.evaluate(set())) if p is not None]
            self.floor_plan = min(cands, key=lambda p: (p.peak, p.cost))
            self.floor_mode = "decomposed" if self.decompose else "flat"
        return self.floor_plan


def _by_bytes(rows: set, over: dict) -> list:
    """`rows`, the one where the plan holds the most bytes first (ties: by id)."""
    return sorted(rows, key=lambda r: (-over[r], r))


def _highest(rows: set, over: dict, n: int) -> set:
    """The `n` rows of `rows` that hold the most bytes."""
    return set(_by_bytes(rows, over)[:n])


def _highest_apart(rows: set, over: dict, n: int, width: int) -> set:
    """The `n` rows of `rows` that hold the most bytes, taken greedily at
    least `width` + 1 events apart (forward rows by forward position), then
    the highest of the rest if that leaves fewer than `n`.  The rows that
    hold the most are often neighbours on one peak (after a backward node and
    in the gap before the next event the same tensors are live), a plan that
    fits one of them nearly fits the rest, and a row on another peak is what
    the next round would have found."""
    ranked = _by_bytes(rows, over)

    def place(r):
        return r[0] == "f", (r[1] if len(r) > 1 else -1)

    picked: list = []
    for r in ranked:
        if len(picked) == n:
            break
        f, x = place(r)
        if all(f != f2 or abs(x - x2) > width for f2, x2 in map(place, picked)):
            picked.append(r)
    picked += [r for r in ranked if r not in picked][:n - len(picked)]
    return set(picked)


def _infeasible(pl: Planner, budget: int, floor_plan: Plan) -> Infeasible:
    scope = pl.scope
    f = floor_plan.peak
    if scope == "total":
        base = simulate(pl.program, grads_present=True).baseline
        params = base.get(PARAMS, 0)
        grads = base.get(GRADIENTS, 0)
        opt = base.get(OPTIMIZER, 0)
        fixed = sum(base.values())
        if fixed > budget:
            parts = [f"parameters {human_bytes(params)}", f"gradients {human_bytes(grads)}"]
            if opt:
                parts.append(f"optimizer state {human_bytes(opt)}")
            rest = fixed - params - grads - opt
            if rest:
                parts.append(f"buffers and inputs {human_bytes(rest)}")
            msg = (f"budget {human_bytes(budget)} (total) is below the floor: {' + '.join(parts)} "
                   f"already exceed it (the smallest total peak is {human_bytes(f)})")
            return Infeasible(msg, f, budget, scope)
    where = profile(pl.a, floor_plan.keep, range(len(pl.a.storages))).where
    what = "activation peak" if scope == "activations" else "total peak"
    how = ""
    if pl.time_limited:
        how = " (the search was cut short by its time limit: raise --time-limit)"
    elif pl.decompose and not pl.flat_floor_tried:
        how = " (decomposed search: block inputs kept as checkpoints)"
    elif not pl.floor_proven:
        how = " (the best the search found; not proven the least)"
    msg = (f"budget {human_bytes(budget)} ({scope}) is below the floor: the smallest {what} this "
           f"graph allows is {human_bytes(f)} (at {where}){how}; asked {human_bytes(budget)}")
    return Infeasible(msg, f, budget, scope)


def _planner_for(program: Program, scope: str, solver: str, log, decompose, effort,
                 planner: Planner | None) -> Planner:
    if planner is None:
        return Planner(program, scope, solver=solver, log=log, decompose=decompose, effort=effort)
    if planner.program is not program or planner.scope != scope:
        raise ValueError("this planner was made for another program or scope")
    planner.log = log if log is not None else planner.log
    return planner


def floor(program: Program, scope: str = DEFAULT_SCOPE, *, time_limit: float = DEFAULT_TIME_LIMIT,
          solver: str = "HIGHS", log=None, decompose: bool | None = None, effort: str | Settings = "fast",
          planner: Planner | None = None) -> int:
    """The smallest peak (in `scope`, max of first step and steady state) of
    any plan this optimizer can produce for `program`.  Pass a `planner` to
    reuse its work for later budgets."""
    pl = _planner_for(program, scope, solver, log, decompose, effort, planner)
    pl.start(time_limit)
    return pl.floor_plan_for().peak


def optimize(program: Program, budget_bytes: int, scope: str = DEFAULT_SCOPE, *,
             time_limit: float = DEFAULT_TIME_LIMIT, solver: str = "HIGHS", log=None,
             decompose: bool | None = None, effort: str | Settings = "fast",
             planner: Planner | None = None, prove: bool = True) -> OptimizeResult:
    """A plan for `program` whose simulated peak in `scope` fits `budget_bytes`
    (first step and steady state), with the least recompute cost the search
    finds.  Raises `Infeasible` below the floor.

    The search's limits are counts (`effort`: "fast" or "full", see
    `Settings`), so the plan depends only on the program, the budget and
    the options.  `time_limit` is a safety stop: when it cuts the search
    short, `OptimizeResult.time_limited` says so, and the plan may then
    differ from run to run.  A `planner` (one per program and scope) shares
    block options between budgets.  With `prove=False`, a search that finds
    no plan raises `Infeasible` at once (floor unknown: 0) instead of
    searching for the floor, which can take much longer: for a caller that
    has other graphs to try."""
    t0 = time.perf_counter()
    budget = int(budget_bytes)
    solver = solver.upper()
    if solver not in installed_solvers():
        raise ValueError(f"solver {solver} is not installed; installed MILP solvers: "
                         f"{', '.join(installed_solvers())}")
    pl = _planner_for(program, scope, solver, log, decompose, effort, planner)
    pl.start(time_limit)
    pl.time_limited = False
    n_solves = len(pl.solves)
    pl.say(f"optimize {program.header.model or 'program'}: budget {human_bytes(budget)} ({scope}), "
           f"{pl.a.nf} forward / {pl.a.nb} backward nodes, {len(pl.all_dec)} decisions, "
           f"{'decomposed' if pl.decompose else 'flat'}")
    plan, mode = None, "none"
    base = pl.keep_all()
    if base.peak <= budget:
        plan = base  # nothing to recompute
    else:
        mode = "decomposed" if pl.decompose else "flat"
        if pl.floor_plan is not None and pl.floor_plan.peak == budget:
            # `--budget floor`: the floor search's plan (least peak, then least
            # recompute) is the answer; searching again at its peak is the
            # hardest budget there is.
            plan, mode = pl.floor_plan, pl.floor_mode
        elif pl.decompose:
            plan = pl.decomposed_budget(budget)
        else:
            plan = pl.lazy_flat(budget)
        if plan is not None and plan.peak > budget:  # the flat model is exact: a backend's bad point
            plan = None
        if plan is None and not prove and pl.floor_plan is None:
            raise Infeasible(f"no plan found for budget {human_bytes(budget)} ({scope})", 0, budget, scope)
        if plan is None:
            fp = pl.floor_plan_for()
            if fp.peak > budget:
                raise _infeasible(pl, budget, fp)
            plan, mode = fp, pl.floor_mode
    out = apply_plan(pl.a, plan.keep, Budget(budget, scope))
    # The result owns its graph: editing it must not change the input program.
    out = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=Program)
    recomputed = [ins.target for ins in out.backward if ins.kind == "recompute"]
    return OptimizeResult(
        program=out, predicted_peak=int(plan.peak), extra_cost=float(plan.cost),
        base_cost=pl.base_cost, solves=list(pl.solves[n_solves:]), seconds=time.perf_counter() - t0,
        budget=budget, scope=scope, mode=mode, recomputed=recomputed, time_limited=pl.time_limited)
