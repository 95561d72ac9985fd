"""What every search strategy shares: the problem, the settings, the memo,
the result, and one run's bookkeeping.

    problem = Problem.of(program, "activations")    # immutable: the graph's analysis
    settings = Settings.of("fast")                  # every default and limit, one object
    memo = Memo()                                   # what searches learned, for the next
    result = search.optimize(problem, budget, settings, memo)

A strategy (`search.flat`, `search.decomposed`, `search.floor`,
`search.optimize`, `ladder.optimize`) is a function of the problem, the
budget, the settings and the memo, and returns an `OptimizeResult`.  The
memo is the only thing carried from one call to the next, and it is
explicit: memory rows learned per block class, block options, evaluated
plans and the floor.  A fresh memo gives the plan of a cold call; a memo
that earlier searches filled (a sweep of budgets, the floor then a budget)
saves their work, and its extra block options can only let the combine
find a cheaper plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

from remat_ir.ir import COST_PROFILE, Program
from remat_ir.ir.budgets import DEFAULT_TIME_LIMIT, check_time_limit
from remat_ir.ir.costs import node_cost
from remat_ir.ir.types import DEFAULT_SCOPE
from remat_ir.optimize.family import Analysis, apply_plan, simulated_peak
from remat_ir.optimize.milp import MILP_SOLVERS, NODE_LIMITED, SolveRecord, installed_solvers


# ---------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Every default of the optimizer.  Each limit is a count (branch-and-bound
    nodes, rounds, option levels), never a time, so a plan depends only on the
    program, the budget and these settings; `time_limit` is a safety stop, and
    a result it cut short says so.  A node limit of None solves to the gap."""

    solver: str = "HIGHS"
    time_limit: float = DEFAULT_TIME_LIMIT  # seconds, per strategy call
    decompose: bool | None = None  # None: decompose past `flat_max_decisions` when the graph has blocks

    # The flat search (one MILP, its memory rows added as the plans it finds break them).
    flat_max_decisions: int = 192
    lazy_rounds: int = 40  # rounds of adding rows before the MILP takes every row
    first_round_nodes: int = 500  # the first round only learns rows ...
    round_nodes: int = 3000  # ... later rounds look for the cheapest plan
    # Proving the last fraction of a percent on chains of identical blocks
    # (symmetric decisions) can take a minute.
    flat_gap: float = 5e-3
    # How much one flat search may do, in counts every machine reproduces:
    # a round's node limit shrinks so that nodes x the model's rows squared
    # stays within `flat_round_work` (a node's simplex iterations grow with
    # the rows, and so does each iteration); a round of more than `flat_max_rows` rows is
    # not solved; and the rounds' simplex iterations x rows (HiGHS's count;
    # other backends: nodes x rows) add up to at most `flat_work`.  Past
    # any of them a graph with blocks is planned block by block instead
    # (the plan's header says so).
    flat_round_work: int = 35_000_000_000
    flat_max_rows: int = 8_000
    flat_work: int = 150_000_000
    # Rows added per round: where the plan holds the most (docs/02-optimizer.md).
    floor_rows_per_round: int = 32
    budget_rows_per_round: int = 4
    rows_apart: int = 2  # ... events apart where it can
    peak_rows_per_round: int = 8  # a block's least-peak option MILPs

    # The decomposed search (blocks, their options, a combine).
    option_nodes: int | None = 500  # per option MILP of a block
    window_nodes: int | None = 3000  # per refinement window (two adjacent segments)
    combine_nodes: int | None = 3000  # per combine MILP (non-chain graphs)
    option_gap: float = 1e-3  # option MILPs sample a Pareto set: near-optimal is enough
    # Least-peak option MILPs (hard to prove) only set where the peak levels
    # start; the floor solves them again to `option_gap`, each class whose
    # least-peak MILPs did at most `floor_resolve_work` simplex iterations x
    # rows (HiGHS's count): past that, solving again costs more than it gains.
    peak_gap: float = 5e-2
    floor_resolve_work: int = 100_000_000
    kept_levels: int = 5  # option levels of bytes kept into backward ...
    peak_levels: int = 4  # ... and of a block's transient peak,
    level_power: float = 1.5  # ... spaced by this power (denser near the least)
    low_peak_levels: int = 1  # least-peak options at the smallest kept levels
    fit_per_class: int = 3  # options cut to the room the chain leaves, per block class
    densify_rounds: int = 3
    # Block classes whose option MILPs are solved at once, on threads (HiGHS
    # only; each class extends its own part of the memo, so no plan depends on it).
    workers: int = 2
    all_windows: bool = False  # refine every pair of adjacent segments, not only a whole-graph window
    combine: str = "auto"  # "auto": the chain DP where it is exact, else the MILP; "milp": always the MILP

    # The rewrite ladder: rewritten graphs past this many decisions are planned block by block.
    flat_floor_decisions: int = 100
    # ... and when no rung fits, the graph's own flat search is tried only
    # for a budget at least this fraction of its block-by-block floor: on the
    # family corpus its plans reached at most 8.4% under that floor (docs/02).
    flat_reach: float = 0.85

    def __post_init__(self):
        object.__setattr__(self, "solver", str(self.solver).upper())
        if self.solver not in MILP_SOLVERS:
            raise ValueError(f"solver {self.solver} is not installed; installed MILP solvers: "
                             f"{', '.join(installed_solvers())}")
        if self.solver not in NODE_LIMITED:
            raise ValueError(f"solver {self.solver} has no node limit, so a plan it makes would depend on the "
                             f"machine's speed; use one of {', '.join(NODE_LIMITED)}")
        object.__setattr__(self, "time_limit", check_time_limit(self.time_limit))
        if self.combine not in ("auto", "milp"):
            raise ValueError(f"combine must be 'auto' or 'milp', not {self.combine!r}")

    @classmethod
    def of(cls, effort: str | Settings = "fast", **overrides) -> Settings:
        """The settings of an effort ("fast" or "full"), with `overrides`
        (None values ignored: the effort's default stands)."""
        if isinstance(effort, Settings):
            base = effort
        elif effort in EFFORTS:
            base = EFFORTS[effort]
        else:
            raise ValueError(f"effort must be one of {', '.join(EFFORTS)}, not {effort!r}")
        overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"no such optimizer setting: {', '.join(sorted(unknown))}")
        return replace(base, **overrides) if overrides else base

    def installed(self) -> Settings:
        """These settings, or ValueError when their solver is not installed here."""
        if self.solver not in installed_solvers():
            raise ValueError(f"solver {self.solver} is not installed; installed MILP solvers: "
                             f"{', '.join(installed_solvers())}")
        return self


# Both efforts give the same plan on any machine at any load.  "fast" stops
# each MILP at a node limit; "full" solves each to its gap tolerance and
# refines every pair of adjacent segments.
EFFORTS = {
    "fast": Settings(),
    "full": Settings(option_nodes=None, window_nodes=None, combine_nodes=None, fit_per_class=9,
                     all_windows=True, peak_gap=1e-3),
}


# ---------------------------------------------------------------- the problem


@dataclass(frozen=True, eq=False)
class Problem:
    """One program in one scope, analysed once: what every strategy reads
    and none changes."""

    program: Program
    scope: str
    analysis: Analysis
    decisions: tuple[int, ...]
    base_cost: float  # the step's cost in the plan's cost model (FLOPs, or profiled microseconds)
    # Offload-only decision nodes (names): kept, or offloaded to the host and
    # reloaded where backward needs them, never recomputed (`family.py`).
    offload: frozenset = frozenset()

    @classmethod
    def of(cls, program: Program, scope: str = DEFAULT_SCOPE, offload=frozenset()) -> Problem:
        offload = frozenset(offload)
        a = Analysis(program, scope, offload)
        return cls(program, scope, a, tuple(a.decisions()),
                   float(sum(node_cost(n, program.header.cost) for n in program.nodes)), offload)

    @cached_property
    def decomposition(self):
        from remat_ir.optimize.blocks import decompose

        return decompose(self.analysis)

    def decomposes(self, settings: Settings) -> bool:
        """Whether the strategy for this problem is the decomposed one."""
        if settings.decompose is not None:
            return settings.decompose
        return len(self.decisions) > settings.flat_max_decisions and self.decomposition.blocks >= 2

    def cost_text(self, cost: float) -> str:
        """A recompute cost for the log: GFLOP, or ms under the profile cost model."""
        if self.program.header.cost == COST_PROFILE:
            return f"{cost / 1e3:.4g} ms"
        return f"{cost / 1e9:.4g} GFLOP"


@dataclass
class Plan:
    """One point of the plan family, evaluated exactly."""

    keep: list[bool]
    peak: int  # simulated, max over first step / steady state
    cost: float  # recompute cost, in the program's cost model
    report: object = None


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


@dataclass
class Floor:
    plan: Plan
    strategy: str  # "flat" or "decomposed": which search found it
    proven: bool  # the flat MILP proved it the least
    searched_flat: bool  # the flat search (not the block-by-block one) looked for it
    time_limited: bool


@dataclass
class Memo:
    """What the searches of one problem under one settings object learned.
    Passed in explicitly; a strategy reads and extends it."""

    plans: dict[tuple, Plan] = field(default_factory=dict)  # kept decisions -> evaluated plan
    class_rows: dict[str, set] = field(default_factory=dict)  # block class -> memory rows plans broke
    class_models: dict[tuple, object] = field(default_factory=dict)  # (class, objective, rows) -> MILP
    options: dict[int, list[Option]] = field(default_factory=dict)  # segment -> its Pareto options
    classes_with_budget_options: set[str] = field(default_factory=set)  # (else the floor's options only)
    extremes: dict[str, dict] = field(default_factory=dict)  # block class -> its least-kept and least-peak plans
    # Block class -> a proven lower bound of its local peak (the least-peak
    # MILP's dual bound): a MILP capped below it has no plan, so none is solved.
    peak_bounds: dict[str, float] = field(default_factory=dict)
    floor_options_proven: bool = False  # the least-peak option MILPs solved again to the option gap
    peak_work: dict[str, int] = field(default_factory=dict)  # class -> its least-peak MILPs' simplex iterations x rows
    floor: Floor | None = None
    # The flat search passed its work limit on this problem (`Settings.flat_work`):
    # its searches are the decomposed one's from then on.
    flat_overworked: bool = False
    # Block options by (class signature, node names), shared by the memos of
    # graphs that hold the same blocks (the rewrite ladder's rungs); None: not shared.
    shared: dict | None = None
    bound_to: tuple | None = None  # (problem, settings) of the first use

    def bind(self, problem: Problem, settings: Settings) -> Memo:
        if self.bound_to is None:
            self.bound_to = (problem, settings)
        elif self.bound_to[0] is not problem or self.bound_to[1] != settings:
            raise ValueError("this memo holds what another problem or other settings learned")
        return self


# ---------------------------------------------------------------- results


class Infeasible(ValueError):
    """The budget is below the smallest peak this optimizer can reach."""

    def __init__(self, message: str, floor_bytes: int, budget_bytes: int | None = None,
                 scope: str = DEFAULT_SCOPE, time_limited: bool = False):
        super().__init__(message)
        self.floor_bytes = int(floor_bytes)
        self.budget_bytes = budget_bytes
        self.scope = scope
        # The safety time limit cut a search short: the floor is the best
        # found, and a longer search may plan the budget.
        self.time_limited = bool(time_limited)


@dataclass
class OptimizeResult:
    """What every strategy returns."""

    program: Program  # the plan: same graph (or its rewrite), an explicit schedule, header.budget set
    predicted_peak: int
    extra_cost: float  # recompute cost of the plan, in the program's cost model
    base_cost: float  # cost of every op of the step, same unit
    solves: list[SolveRecord]
    seconds: float  # every search the call ran (floors and ladder rungs included)
    budget: int | None = 0  # None: the floor was asked
    scope: str = DEFAULT_SCOPE
    mode: str = "flat"  # "flat", "decomposed" or "none" (the unoptimized plan fits)
    recomputed: list[str] = field(default_factory=list)
    time_limited: bool = False  # the safety time limit cut the search short
    stages: dict[str, float] = field(default_factory=dict)  # seconds by stage (floor, search, rungs...)

    @property
    def overhead(self) -> float:
        return self.extra_cost / self.base_cost if self.base_cost else 0.0


# ---------------------------------------------------------------- one run


class Run:
    """One strategy call's bookkeeping: its deadline (the safety stop), the
    solves it ran, and the log.  Dies with the call."""

    def __init__(self, problem: Problem, settings: Settings, memo: Memo, log=None):
        self.problem, self.settings, self.log = problem, settings, log
        self.memo = memo.bind(problem, settings)
        self.a = problem.analysis
        self.solves: list[SolveRecord] = []
        self.deadline = time.perf_counter() + settings.time_limit
        self.time_limited = False

    def child(self) -> Run:
        """A Run for one block class's solves on a worker thread: the same
        problem, memo and deadline; its own solve records and log lines,
        which `adopt` takes back."""
        c = Run(self.problem, self.settings, self.memo)
        c.deadline = self.deadline
        c.lines = []
        c.log = c.lines.append if self.log else None
        return c

    def adopt(self, child: Run) -> None:
        self.solves += child.solves
        self.time_limited |= child.time_limited
        for line in child.lines:
            self.say(line)

    def say(self, msg: str) -> None:
        if self.log:
            self.log(msg)

    def out_of_time(self, reserve: float = 0.0) -> bool:
        """Whether the safety time limit is (about to be) reached; if so, the
        result says the limit cut the search short."""
        if time.perf_counter() + reserve < self.deadline:
            return False
        self.time_limited = True
        return True

    def timed(self, solve):
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

    def solve(self, compiled, kind: str, subject: str, *, nodes: int | None, round: int = 0, **kw):
        """One MILP of a `KeepModel` under its node limit (see `timed`)."""
        return self.timed(lambda limit: compiled.solve(kind, subject, round=round, solver=self.settings.solver,
                                                       time_limit=limit, nodes=nodes, log=self.log, **kw))

    def evaluate(self, kept) -> Plan:
        """The plan keeping `kept`, built and simulated (memoized)."""
        key = tuple(sorted(kept))
        plan = self.memo.plans.get(key)
        if plan is None:
            keep = self.a.keep_of(kept)
            peak, rep = simulated_peak(apply_plan(self.a, keep), self.problem.scope)
            plan = self.memo.plans[key] = Plan(keep, peak, self.a.recompute_cost(keep), rep)
        return plan

    def keep_all(self) -> Plan:
        return self.evaluate(self.problem.decisions)
