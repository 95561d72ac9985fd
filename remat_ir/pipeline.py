"""The compile pipeline as a Python API: a module and its example inputs in, a
verified plan out.  `remat-compile`, `remat-bench` and `tools/gpu_check.py`
are faces over it.

    plan = remat_ir.compile(model, (x, y), loss=loss_fn, budget="0.5")   # half the activation peak
    remat_ir.save_plan(plan, "plan.rir")

The arguments follow `torch.export.export`: the module, a tuple of
positional inputs, a dict of keyword inputs.  Their tensors are the plan's
inputs; None and other non-tensor arguments are constants of the plan.
`loss(output, *args, **kwargs)`, when given, is part of the step.
The stages, also callable one by one (one trace, several budgets):

    trace(model, args, kwargs)   one training step -> a Program with a complete
                                 header: device (where the parameters and inputs
                                 live), optimizer state, comment; with
                                 cost="profile", each op timed on that device
    fit(program, budget, ...)    the plan for a budget, verified; without a
                                 budget the unoptimized plan, verified
    compile(model, args, kwargs) fit(trace(...), budget)

A budget is bytes (int), a size ("1.5GiB", "800MB"), a fraction of the
unoptimized peak in `scope` (0.5, "0.5", "50%"; what the caller holds under
every plan, returned logits or a cache, kept whole: `resolve_budget`), or "floor" (the smallest peak
the optimizer reaches); zero, negative, NaN and infinite budgets, and a
`time_limit` that is no positive, finite number of seconds, are refused
before any work (`check_budget`, `check_time_limit`).  `scope` is "activations" by default (`DEFAULT_SCOPE`,
every entry point's): what the step adds on top of parameters, gradients and
optimizer state, which recomputation can shrink; "total" counts those too.
Pass `stats=CompileStats()` to learn how long each stage took and what the
optimizer did.

Errors: `TraceError` (the step cannot be traced), `ModelError` (`model` is no
`nn.Module`), `ProfileError`, `BudgetError` (a `ValueError`: an unreadable
budget), `Infeasible` (the budget is below the floor), `ValueError` (an unknown
optimizer, scope, cost model, solver or effort), `UnsoundPlan` (an internal
error: the plan made does not verify).

Nothing here imports the optimizer (cvxpy) unless a budget is given.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from remat_ir.ir import COST_FLOPS, COST_MODELS, COST_PROFILE, Program
import msgspec

from remat_ir.ir import budgets, sizes
from remat_ir.ir.fingerprint import fingerprint
from remat_ir.ir.types import DEFAULT_SCOPE, OPTIMIZER_STATES, SCOPES

__all__ = ["BudgetError", "CompileStats", "UnsoundPlan", "budget_bytes", "check_budget", "check_host_budget",
           "check_time_limit", "compile", "fit", "optimizer_settings", "plan_device", "trace", "trace_builtin"]

TIME_LIMIT = budgets.DEFAULT_TIME_LIMIT


class BudgetError(ValueError):
    """The budget cannot be read (the message says how to write one)."""


class UnsoundPlan(RuntimeError):
    """Internal error: the plan the pipeline made does not verify."""

    def __init__(self, errors: list):
        self.errors = list(errors)
        super().__init__("the generated plan does not verify:\n" + "\n".join(str(d) for d in self.errors[:20]))


@dataclass
class CompileStats:
    """Filled in by `trace`, `fit` and `compile` when passed as `stats=`."""

    # Wall seconds per stage: "trace", "profile", "budget" (resolving it; for
    # "floor" a search), "optimize", "verify".
    seconds: dict[str, float] = field(default_factory=dict)
    budget: int | None = None  # the budget in bytes, once resolved
    optimized: Any = None  # the optimizer's OptimizeResult (mode, solves, recomputed), when it ran
    stages: dict[str, float] = field(default_factory=dict)  # the optimizer's seconds by search (floors, rungs)
    solves: list = field(default_factory=list)  # every solve the optimizer ran (SolveRecord)

    def _add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def add_stages(self, stages: dict[str, float]) -> None:
        for k, v in stages.items():
            self.stages[k] = self.stages.get(k, 0.0) + v


class _Clock:
    def __init__(self, stats: CompileStats | None, stage: str):
        self.stats, self.stage = stats, stage

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.stats is not None:
            self.stats._add(self.stage, time.perf_counter() - self.t0)
        return False


def check_budget(budget) -> None:
    """Raises BudgetError unless `budget` is None, "floor" or one `fit` can
    read: a positive, finite amount (zero, negative, NaN and infinite budgets
    are refused, in remat-compile's words).  Every entry point checks it
    before any work."""
    if budget is None or budgets.is_floor(budget):
        return
    try:
        budgets.parse_budget(budget)
    except ValueError as e:
        raise BudgetError(str(e)) from None


def check_time_limit(time_limit) -> float:
    """`time_limit` as a float; ValueError unless a positive, finite number of seconds."""
    return budgets.check_time_limit(time_limit)


def optimizer_settings(solver: str = "HIGHS", effort: str = "fast", time_limit: float = TIME_LIMIT):
    """The optimizer's settings for these options; ValueError (saying what
    to use) for a solver that is not installed or has no node limit, or an
    unknown effort."""
    from remat_ir.optimize.search import settings_of

    return settings_of(effort=effort, solver=solver, time_limit=time_limit)


def trace(model, args=(), kwargs: dict | None = None, *, loss: Callable | None = None,
          name: str | None = None, optimizer: str = "none", fake: bool = False, cost: str = COST_FLOPS,
          profile_repeats: int = 5, stats: CompileStats | None = None, device: str | None = None,
          autocast: str | None = None, as_called: bool = False,
          dynamic: dict[str, dict[int, str]] | None = None, live: list | None = None) -> Program:
    """One training step of `model(*args, **kwargs)`, traced into an unoptimized
    Program whose header is complete (device, optimizer state, comment).
    `name` is the header's model name (default: the module's class name).
    With `fake`, nothing is allocated (FakeTensorMode).  With cost="profile",
    each op is timed on the model's device (`profile_repeats` runs, the
    median) and the optimizer minimizes recomputed time instead of FLOPs.
    `device`: the device type the plan is for (default: where the model's
    parameters and inputs are); see `remat_ir.trace.tracer.trace_module`, as
    for `as_called` (each module traced in the mode it is in, not all in
    train mode).  `autocast`: the `torch.autocast` the forward and loss are traced under,
    "cpu:bfloat16" ("" for none); None: the one in effect where `trace` is
    called, for the step's device type, as the call would run there, so
    `with torch.autocast("cpu", dtype=torch.bfloat16): compile(model, args)`
    makes the plan a call in that block runs.  The plan runs only under the
    same autocast (its header's `autocast` line).  `dynamic`: the input
    dimensions that vary between calls, for a symbolic program (see
    `remat_ir.trace.tracer.trace_module`, as for `live`: what the trace read
    of the model's Python state is appended to it)."""
    import torch

    from remat_ir.check.simulate import optimizer_state_bytes
    from remat_ir.runtime.load import ModelError
    from remat_ir.trace.tracer import trace_module

    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"compile() takes a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    args = tuple(args)
    if cost not in COST_MODELS:
        raise ValueError(f"cost must be one of {', '.join(COST_MODELS)}, not {cost!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, not {optimizer!r}")
    if cost == COST_PROFILE:
        from remat_ir.runtime.op_timing import ProfileError

        if fake:
            raise ProfileError("cost 'profile' times each op on real tensors, and fake tensors have no "
                               "data to run on: trace without fake, or use cost 'flops'")
        if profile_repeats < 1:
            raise ProfileError(f"profile_repeats must be at least 1, not {profile_repeats}")
    name = type(model).__name__ if name is None else name

    with _Clock(stats, "trace"):
        program = trace_module(model, args, kwargs=kwargs, loss_fn=loss, model_name=name, fake=fake,
                               device=device, autocast=autocast, as_called=as_called, dynamic=dynamic,
                               live=live)
        program.header.optim = optimizer
        program.header.optim_state_bytes = optimizer_state_bytes(program, optimizer)
        program.header.fingerprint = fingerprint(program)  # the optimizer state is part of it
        shape = ", ".join(f"{v.name} {v.dtype}[{', '.join(map(str, v.shape))}]"
                          for v in program.values if v.kind == "input")
        program.header.comment = [f"remat-ir plan: {name} ({shape})"] + program.header.comment
    if cost == COST_PROFILE:
        from remat_ir.runtime.op_timing import profile_costs

        from remat_ir.trace.calls import autocast_off, split_call

        with _Clock(stats, "profile"), autocast_off():  # the plan's ops carry their casts
            program = profile_costs(program, model, split_call(model, args, kwargs).tensors,
                                    repeats=profile_repeats)
        program.header.comment.append(f"op costs: median of {profile_repeats} timed runs on "
                                      f"{program.header.device}")
    return program


def trace_builtin(name: str, batch: int | None = None, seq: int | None = None, *, fake: bool = False,
                  device: str = "cpu") -> Program:
    """Trace a built-in model (see `remat_ir.models`) with its default inputs
    (`remat_ir.trace.tracer.trace_module`, as the model is loaded by
    `remat_ir.runtime.load.load_model`)."""
    from remat_ir.runtime.load import load_model
    from remat_ir.trace.tracer import trace_module

    m = load_model(name, batch=batch, seq=seq, device=device, fake=fake)
    return trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=name, fake=fake, device=device)


def budget_bytes(program: Program, budget, scope: str = DEFAULT_SCOPE, *, time_limit: float = TIME_LIMIT,
                 solver: str = "HIGHS", effort: str = "fast", stats: CompileStats | None = None,
                 memo=None, exact: bool = False, offload: bool = False, host_budget=None) -> int:
    """`budget` (see the module's docstring) in bytes, for `program` in
    `scope`.  Raises BudgetError when it cannot be read.  A fraction is of
    the traced step's unoptimized peak; "floor" is the smallest peak any
    plan reaches, with the graph rewrites `exact` allows (and, with
    `offload`, offloads within `host_budget`).  `memo`: see `fit`."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    time_limit = check_time_limit(time_limit)
    with _Clock(stats, "budget"):
        if budgets.is_floor(budget):
            from remat_ir.optimize import ladder

            r = ladder.floor(program, optimizer_settings(solver, effort, time_limit), memo, scope=scope, exact=exact,
                             offload=offload, host_budget=check_host_budget(host_budget, offload))
            if stats is not None:
                stats.add_stages(r.stages)
                stats.solves += r.solves
            nbytes = int(r.predicted_peak)
        else:
            from remat_ir.check.simulate import resolve_budget

            try:
                nbytes = int(resolve_budget(program, budget, scope))
            except ValueError as e:
                raise BudgetError(str(e)) from e
    if stats is not None:
        stats.budget = nbytes
    return nbytes


def check_host_budget(host_budget, offload: bool) -> int | None:
    """`host_budget` in bytes (None: none); BudgetError for what cannot be
    read, ValueError for a host budget without `offload`."""
    if host_budget is not None and not offload:
        raise ValueError("a host budget bounds what offloaded copies hold on the host: give offload=True "
                         "(remat-compile --offload) with it")
    try:
        return budgets.host_budget_bytes(host_budget)
    except ValueError as e:
        raise BudgetError(str(e)) from None


def _verified(program: Program, stats: CompileStats | None) -> Program:
    from remat_ir.check.verify import verify

    with _Clock(stats, "verify"):
        verdict = verify(program)
    if not verdict.ok:
        raise UnsoundPlan(verdict.errors)
    return program


def fit(program: Program, budget=None, *, scope: str = DEFAULT_SCOPE, time_limit: float = TIME_LIMIT,
        solver: str = "HIGHS", effort: str = "fast", stats: CompileStats | None = None,
        memo=None, exact: bool = False, offload: bool = False, host_budget=None) -> Program:
    """The plan for `program` (as `trace` returns it) whose predicted peak in
    `scope` fits `budget`, verified; without a budget, `program` itself,
    verified.  When recomputation alone cannot fit the budget, the optimizer
    rewrites the graph (`remat_ir.rewrite`: a BatchNorm split, the loss in
    row chunks, attention in chunks) and the plan's header lists the
    rewrites; `exact` allows only those that keep eager's bits (all but
    chunked attention).  `time_limit` is a safety
    stop: when it cuts the search short, the plan's header says so.  To plan
    several budgets of one program, pass the same `memo`
    (`remat_ir.optimize.ladder.LadderMemo()`): the work done for one budget
    serves the next.  A budget or `time_limit` that is no
    positive, finite amount is refused before any work (BudgetError,
    ValueError).

    `offload`: where recomputation alone cannot fit the budget, activations
    may also be offloaded to host memory between forward and backward
    (`offload`/`reload`/`wait` instructions; eager's bits, so allowed under
    `exact`), before any graph rewrite is tried (`remat_ir.optimize.ladder`);
    without it a plan is exactly as before.  `host_budget` (bytes or a
    size, with `offload`): the most the plan's offloaded copies may hold on
    the host at once, written as the plan's `host_budget` line."""
    check_budget(budget)
    time_limit = check_time_limit(time_limit)
    host_bytes = check_host_budget(host_budget, offload)
    if budget is None:
        return _verified(program, stats)
    if sizes.is_symbolic(program):
        return _fit_symbolic(program, budget, scope=scope, time_limit=time_limit, solver=solver, effort=effort,
                             stats=stats, exact=exact, offload=offload, host_budget=host_bytes)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    from remat_ir.optimize import ladder

    settings = optimizer_settings(solver, effort, time_limit)
    memo = ladder.LadderMemo() if memo is None else memo
    from remat_ir.check.simulate import SimulationError

    try:
        nbytes = budget_bytes(program, budget, scope, time_limit=time_limit, solver=solver, effort=effort,
                              stats=stats, memo=memo, exact=exact, offload=offload, host_budget=host_bytes)
        with _Clock(stats, "optimize"):
            result = ladder.optimize(program, nbytes, settings, memo, scope=scope, exact=exact, offload=offload,
                                     host_budget=host_bytes)
    except SimulationError as e:
        # The optimizer's own schedule of the traced graph is wrong: no plan, said with the node it
        # trips on, as a budget that cannot be met (a caller that falls back on one does so here).
        raise BudgetError(f"no plan for budget {budget}: the optimizer made a schedule the simulator refuses "
                          f"({e}); please report it") from e
    if stats is not None:
        stats.optimized = result
        stats.add_stages(result.stages)
        stats.solves += result.solves
    header = result.program.header
    if host_bytes is not None:
        header.host_budget = host_bytes
    if header.rewrites:
        from remat_ir.rewrite import describe

        header.comment.append(f"graph rewrites (the budget is below what recomputation alone reaches): "
                              f"{describe(header.rewrites)}")
    if result.time_limited:
        header.comment.append(
            f"the optimizer's time limit ({time_limit:g} s) cut its search short: this plan can "
            "differ between runs; raise the time limit for a reproducible one")
    return _verified(result.program, stats)


def _fit_symbolic(program: Program, budget, **options) -> Program:
    """A symbolic program's plan: the schedule `fit` chooses for its largest
    sizes (the high end of its range: a fraction is of the peak there),
    which is the schedule of every size (the instantiations share node and
    value names), verified over the range.  A budget only graph rewrites
    reach is refused: their chunks are chosen for one size."""
    from remat_ir.optimize.search import Infeasible

    high = sizes.ends(program)[-1]
    at = ", ".join(f"{k}={v}" for k, v in high.items())
    try:
        plan = fit(sizes.instantiate(program, high), budget, **options)
    except Infeasible as e:
        # (A plan of one size may still reach it, with graph rewrites: the caller can plan sizes alone.)
        raise BudgetError(f"at {at}: {e}") from e
    if plan.header.rewrites:
        raise BudgetError(f"at {at} the budget is below what recomputation alone reaches, and a plan for every "
                          "size cannot rewrite the graph; raise the budget, or plan each size on its own")
    header = msgspec.structs.replace(program.header, budget=plan.header.budget, host_budget=plan.header.host_budget,
                                     comment=plan.header.comment + [f"schedule chosen at {at}, the largest "
                                                                    "sizes of the range"])
    out = msgspec.structs.replace(program, header=header, forward=plan.forward, backward=plan.backward)
    return _verified(out, options.get("stats"))


def compile(model, args=(), kwargs: dict | None = None, *, loss: Callable | None = None,
            name: str | None = None, budget=None, scope: str = DEFAULT_SCOPE, optimizer: str = "none",
            fake: bool = False, cost: str = COST_FLOPS, profile_repeats: int = 5, time_limit: float = TIME_LIMIT,
            solver: str = "HIGHS", effort: str = "fast", stats: CompileStats | None = None,
            device: str | None = None, exact: bool = False, autocast: str | None = None,
            dynamic: bool = False, max_sizes: dict[str, int] | None = None, offload: bool = False,
            host_budget=None) -> Program:
    """Trace one training step of `model(*args, **kwargs)` and plan it for `budget`
    (None: the unoptimized plan); the plan returned verifies.

    `dynamic`: a symbolic plan (`remat_ir.ir.sizes`), one for every batch
    and sequence size (the dimensions `remat_ir.trace.calls.dynamic_dims`
    picks), covering sizes up to this call's, or up to `max_sizes`
    ({"T": 512}: symbol -> the largest size); a fraction of a budget is of
    the peak at the largest sizes.

    `autocast` ("cpu:bfloat16", "" for none): the `torch.autocast` the step
    is traced under; by default the one in effect where `compile` is called
    (see `trace`).

    `optimizer` ("none", "sgd", "adam"): whose state the prediction and a
    total budget include.  `effort` (graphs over 192 decisions, which are
    decomposed): "fast" stops each per-block MILP at a node limit; "full"
    solves each to its gap tolerance.  Either way the plan depends on the
    model, the budget and the options alone.  `exact`, `offload` and
    `host_budget`: see `fit`."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    # Before the trace, which can take minutes.
    check_budget(budget)
    check_time_limit(time_limit)
    check_host_budget(host_budget, offload)
    if budget is not None:
        optimizer_settings(solver, effort, time_limit)
    dims = None
    if dynamic:
        from remat_ir.trace.calls import CallError, dynamic_dims, split_call

        try:
            dims = dynamic_dims(split_call(model, args, kwargs))
        except CallError as e:
            raise ValueError(str(e)) from None
        if not dims:
            raise ValueError("dynamic: this call has no batch or sequence dimension of size 2 or more (or an "
                             "input that is not a contiguous tensor of its own): nothing to make a symbol")
    program = trace(model, args, kwargs, loss=loss, name=name, optimizer=optimizer, fake=fake, cost=cost,
                    profile_repeats=profile_repeats, stats=stats, device=device, autocast=autocast,
                    dynamic=dims)
    if dims and max_sizes:
        program.header.sizes = widen(program, max_sizes)
        program.header.fingerprint = fingerprint(program)
    return fit(program, budget, scope=scope, time_limit=time_limit, solver=solver, effort=effort, stats=stats,
               exact=exact, offload=offload, host_budget=host_budget)


def widen(program: Program, max_sizes: dict[str, int]) -> list[str]:
    """A symbolic program's ranges with their high ends at `max_sizes`
    (symbol -> size; others as they are).  Raises ValueError for a symbol
    the program has not, a size below its low end, or one its size guards
    exclude."""
    ranges = sizes.ranges(program)
    unknown = [s for s in max_sizes if s not in ranges]
    if unknown:
        raise ValueError(f"no size symbol {', '.join(unknown)} in this plan (it has {', '.join(ranges) or 'none'})")
    out = []
    for s, r in ranges.items():
        high = int(max_sizes.get(s, r.high))
        if high < r.low:
            raise ValueError(f"{s}={high} is below the smallest size the plan covers, {r.low}")
        out.append(sizes.format_range(sizes.SizeRange(s, r.low, high)))
    wide = msgspec.structs.replace(program, header=msgspec.structs.replace(program.header, sizes=out))
    why = sizes.check_sizes(wide, sizes.ends(wide)[-1])
    if why:
        raise ValueError(why)
    return out


def plan_device(program: Program, device: str | None = None) -> str:
    """The device to run `program` on: `device`, or the plan's own.  Raises
    ValueError when it is not available, or of another type than the one the
    plan was compiled for."""
    import torch

    device = device or program.header.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}, but no CUDA device is available")
    if torch.device(device).type != torch.device(program.header.device).type:
        raise ValueError(f"the plan was compiled for {program.header.device}; recompile it for {device}")
    return device
