"""The optimizer's strategies: rewrite a program's schedule to fit a memory
budget with the least recomputation.

    problem = Problem.of(program, "activations")
    result = optimize(problem, budget_bytes, Settings.of("fast"), Memo())
    result.program          # same graph, new explicit schedule, header.budget set
    result.predicted_peak   # simulate() peak in the scope (max of first step / steady state)

Each strategy is a function of the problem, the budget, the settings and a
memo of what earlier searches of the same problem learned, and returns an
`OptimizeResult` (`problem.py`):

    flat(problem, budget, settings, memo)        one MILP over every decision (`flat.py`)
    decomposed(problem, budget, settings, memo)  blocks, their options, a combine (`decomposed.py`)
    floor(problem, settings, memo)               the least peak, by whichever of the two fits the size
    optimize(problem, budget, settings, memo)    the unoptimized plan when it fits, else the
                                                 search that fits the size, else the floor

The rewrite ladder (`ladder.py`) is the same kind of function over the
graph and its rewrites.  The plan family and its exact memory model are in
`family.py`; every plan is lowered by `family.apply_plan` and checked with
`simulate()`.  How far each MILP searches is a count of branch-and-bound
nodes (`Settings`), never a time, so the plan depends only on the program,
the budget and the settings.  For convenience, `program` may be given in
place of a problem, and `effort`, `solver`, `time_limit` and `decompose`
in place of settings.
"""
from __future__ import annotations

import time

import msgspec

from remat_ir.check.simulate import GRADIENTS, OPTIMIZER, PARAMS, simulate
# (In the simulator, which a cached plan's check reads without the optimizer; re-exported.)
from remat_ir.check.simulate import resolve_budget, unoptimized_peak  # noqa: F401
from remat_ir.ir import Budget, Program
from remat_ir.ir.printer import human_bytes
from remat_ir.ir.types import DEFAULT_SCOPE
from remat_ir.optimize import decomposed as _decomposed
from remat_ir.optimize import flat as _flat
from remat_ir.optimize.family import apply_plan, occupancy
from remat_ir.optimize.problem import (
    EFFORTS, Floor, Infeasible, Memo, OptimizeResult, Plan, Problem, Run, Settings,
)

__all__ = ["EFFORTS", "Infeasible", "Memo", "OptimizeResult", "Problem", "Settings", "below_floor", "decomposed",
           "flat", "floor", "optimize", "resolve_budget", "unoptimized_peak"]


# ---------------------------------------------------------------- arguments


def settings_of(settings: Settings | None = None, *, effort: str | None = None, **overrides) -> Settings:
    """`settings` (default: the "fast" effort's), or an effort's, with
    `overrides` (solver, time_limit, decompose, ...; None: the default)."""
    if settings is not None and not isinstance(settings, Settings):
        raise TypeError(f"settings must be a Settings, not {settings!r} (a scope is passed as scope=)")
    if settings is not None and effort is not None:
        raise TypeError("give settings or an effort, not both")
    return Settings.of(settings or effort or "fast", **overrides).installed()


def arguments(problem, scope, settings, memo, **given) -> tuple[Problem, Settings, Memo]:
    """(problem, settings, memo) from what a caller gave: a Problem, or a
    Program and its scope (the memo's own problem when it was made for that
    program); Settings, or an effort and overrides."""
    settings = settings_of(settings, **given)
    memo = Memo() if memo is None else memo
    if not isinstance(problem, Problem):
        scope = scope or DEFAULT_SCOPE
        mine = memo.bound_to[0] if memo.bound_to else None
        if mine is not None and mine.program is problem and mine.scope == scope:
            problem = mine
        else:
            problem = Problem.of(problem, scope)
    elif scope is not None and scope != problem.scope:
        raise ValueError(f"this problem is in scope {problem.scope}, not {scope}")
    return problem, settings, memo.bind(problem, settings)


def _none_found(problem: Problem, budget: int | None) -> Infeasible:
    """A search found no plan for `budget`; the floor is not known (0)."""
    return Infeasible(f"no plan found for budget {human_bytes(budget)} ({problem.scope})", 0, budget,
                      problem.scope)


def _fitting(run: Run, plan: Plan | None, budget: int | None, mode: str, t0: float) -> OptimizeResult:
    """The result of a strategy's `plan`, or Infeasible when it found none that fits."""
    if plan is None or (budget is not None and plan.peak > budget):
        raise _none_found(run.problem, budget)
    return _result(run, plan, budget, mode, t0)


def _result(run: Run, plan: Plan, budget: int | None, mode: str, t0: float) -> OptimizeResult:
    p = run.problem
    out = apply_plan(run.a, plan.keep, Budget(budget if budget is not None else plan.peak, p.scope))
    # The result owns its graph: editing it must not change the input program.
    out = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=Program)
    if mode == "decomposed" and run.memo.flat_overworked:
        out.header.comment.append("strategy: block by block, the flat search having passed its work limits "
                                  "(remat_ir.optimize.problem.Settings.flat_work)")
    return OptimizeResult(
        program=out, predicted_peak=int(plan.peak), extra_cost=float(plan.cost), base_cost=p.base_cost,
        solves=list(run.solves), seconds=time.perf_counter() - t0, budget=budget, scope=p.scope, mode=mode,
        recomputed=[ins.target for ins in out.backward if ins.kind == "recompute"],
        time_limited=run.time_limited)


# ---------------------------------------------------------------- strategies


def flat(problem, budget: int | None, settings: Settings | None = None, memo: Memo | None = None, *,
         scope: str | None = None, log=None, **given) -> OptimizeResult:
    """The flat search's plan for `budget` (None: its least peak).  Raises
    Infeasible (floor unknown: 0) when it finds none."""
    problem, settings, memo = arguments(problem, scope, settings, memo, **given)
    t0 = time.perf_counter()
    run = Run(problem, settings, memo, log)
    plan, _ = _flat.search(run, None if budget is None else int(budget))
    return _fitting(run, plan, budget, "flat", t0)


def decomposed(problem, budget: int | None, settings: Settings | None = None, memo: Memo | None = None, *,
               scope: str | None = None, log=None, **given) -> OptimizeResult:
    """The decomposed search's plan for `budget` (None: its least peak).
    Raises Infeasible (floor unknown: 0) when it finds none."""
    problem, settings, memo = arguments(problem, scope, settings, memo, **given)
    t0 = time.perf_counter()
    run = Run(problem, settings, memo, log)
    plan = _decomposed.floor(run) if budget is None else _decomposed.search(run, int(budget))
    return _fitting(run, plan, budget, "decomposed", t0)


def _block_by_block(run: Run) -> bool:
    """Whether this run's searches are the decomposed one's: by the settings,
    or because the flat search passed its work limits on this problem."""
    return run.problem.decomposes(run.settings) or run.memo.flat_overworked


def _floor(run: Run) -> Floor:
    """The floor, from the memo or searched once and kept there."""
    memo = run.memo
    if memo.floor is None:
        dec = _block_by_block(run)
        flat_best = None
        if not dec:
            try:
                plan, proven = _flat.search(run, None)
            except _flat.Overworked as e:
                run.say(f"{e}: the floor searched block by block")
                dec, flat_best = True, e.best
        if dec:
            plan, proven = _decomposed.floor(run), False
        cands = [q for q in (plan, flat_best, run.keep_all(), run.evaluate(set())) if q is not None]
        best = min(cands, key=lambda q: (q.peak, q.cost))
        memo.floor = Floor(best, "decomposed" if dec else "flat", proven and best is plan, not dec,
                           run.time_limited)
    return memo.floor


def floor(problem, settings: Settings | None = None, memo: Memo | None = None, *, scope: str | None = None,
          log=None, **given) -> OptimizeResult:
    """The plan of the smallest peak (in the scope, max of first step and
    steady state) this optimizer reaches, the least recompute among those;
    `result.predicted_peak` is the floor.  Kept in the memo."""
    problem, settings, memo = arguments(problem, scope, settings, memo, **given)
    t0 = time.perf_counter()
    run = Run(problem, settings, memo, log)
    fl = _floor(run)
    run.time_limited = run.time_limited or fl.time_limited
    return _result(run, fl.plan, None, fl.strategy, t0)


def optimize(problem, budget: int, settings: Settings | None = None, memo: Memo | None = None, *,
             scope: str | None = None, log=None, prove: bool = True, **given) -> OptimizeResult:
    """A plan whose simulated peak in the scope fits `budget` (first step and
    steady state), with the least recompute cost the search finds.  Raises
    `Infeasible` below the floor.

    `settings.time_limit` is a safety stop: when it cuts the search short,
    `OptimizeResult.time_limited` says so, and the plan may then differ from
    run to run.  With `prove=False`, a search that finds no plan raises
    `Infeasible` at once (floor unknown: 0) instead of searching for the
    floor, which can take much longer: for a caller that has other graphs to
    try."""
    problem, settings, memo = arguments(problem, scope, settings, memo, **given)
    t0 = time.perf_counter()
    budget = int(budget)
    run = Run(problem, settings, memo, log)
    dec = _block_by_block(run)
    run.say(f"optimize {problem.program.header.model or 'program'}: budget {human_bytes(budget)} "
            f"({problem.scope}), {run.a.nf} forward / {run.a.nb} backward nodes, {len(problem.decisions)} "
            f"decisions, {'decomposed' if dec else 'flat'}")
    plan, mode = None, "none"
    base = run.keep_all()
    if base.peak <= budget:
        plan = base  # nothing to recompute
    else:
        mode = "decomposed" if dec else "flat"
        if memo.floor is not None and memo.floor.plan.peak == budget:
            # `--budget floor`: the floor search's plan (least peak, then least
            # recompute) is the answer; searching again at its peak is the
            # hardest budget there is.
            plan, mode = memo.floor.plan, memo.floor.strategy
        elif dec:
            plan = _decomposed.search(run, budget)
        else:
            try:
                plan, _ = _flat.search(run, budget)
            except _flat.Overworked as e:
                run.say(f"{e}: planning block by block")
                plan, mode = _decomposed.search(run, budget), "decomposed"
        if plan is not None and plan.peak > budget:  # the flat model is exact: a backend's bad point
            plan = None
        if plan is None and not prove and memo.floor is None:
            raise _none_found(problem, budget)
        if plan is None:
            fl = _floor(run)
            if fl.plan.peak > budget:
                raise _infeasible(run, budget, fl)
            plan, mode = fl.plan, fl.strategy
    return _result(run, plan, budget, mode, t0)


def below_floor(problem: Problem, budget: int, settings: Settings, memo: Memo) -> Infeasible:
    """The refusal of `budget`, below the floor a `floor` search with this
    memo found (the refusal `optimize` raises, for a caller that compared
    the budget with the floor and needs no budget search)."""
    fl = memo.floor
    if fl is None or fl.plan.peak <= budget:
        raise ValueError("below_floor needs a budget below the floor this memo holds")
    return _infeasible(Run(problem, settings, memo, None), int(budget), fl)


def _infeasible(run: Run, budget: int, fl: Floor) -> Infeasible:
    scope, f = run.problem.scope, fl.plan.peak
    if scope == "total":
        base = simulate(run.problem.program, grads_present=True).baseline
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
    where = occupancy(run.a, fl.plan.keep, range(len(run.a.storages))).where
    what = "activation peak" if scope == "activations" else "total peak"
    how = ""
    if run.time_limited or fl.time_limited:
        how = " (the search was cut short by its time limit: raise --time-limit)"
    elif not fl.searched_flat:
        how = " (decomposed search: block inputs kept as checkpoints)"
    elif not fl.proven:
        how = " (the best the search found; not proven the least)"
    msg = (f"budget {human_bytes(budget)} ({scope}) is below the floor: the smallest {what} this "
           f"graph allows is {human_bytes(f)} (at {where}){how}; asked {human_bytes(budget)}")
    return Infeasible(msg, f, budget, scope, run.time_limited or fl.time_limited)
