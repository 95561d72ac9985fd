"""`remat_ir.wrap`: one line in a training loop.

    model = remat_ir.wrap(model, budget=0.6)      # plans at the first training step
    model = remat_ir.wrap(model, plan)            # runs a plan made beforehand

With a budget (and no plan), the wrapper plans a training step the first
time it is called in training mode, from that call's own arguments: it traces
the step (under fake tensors: nothing is allocated), looks the plan up in the
plan cache, and only on a miss runs the optimizer and stores the plan there.
A call with other shapes (a smaller last batch, another sequence length) or
other arguments gets a plan of its own the same way, as does a call under
another `torch.autocast` (the forward is traced under the caller's, as eager
runs it; backward outside it); the last `max_plans` are kept in memory.
The step is traced with each module in the mode it is in (a dropout put in
eval() alone is off, as in eager).  A model changed since its plans were
made, in what `remat_ir.runtime.bind.ModelGuard` checks at each training
step (a submodule replaced, a parameter or buffer object replaced,
requires_grad or a submodule's mode changed), drops them and is planned
again.

The cache is a directory of `.rir` files: `$REMAT_IR_CACHE` when set, else
`remat-ir` in the user's cache directory as `platformdirs` finds it
(`$XDG_CACHE_HOME` or `~/.cache` on Linux, `~/Library/Caches` on macOS,
`%LOCALAPPDATA%` on Windows).  A plan's file name is a hash of the traced step's fingerprint
(the model's parameters, graph, input shapes and dtypes, output structure,
loss), the planning options (budget, scope, optimizer, cost model, solver,
effort, time limit) and the versions of torch and remat-ir, so a changed
model, input or option never meets a stale plan.  Files are written
atomically.  A file's name proves nothing (a file can be another request's
plan, or edited): a cached plan is used only when its header is what is
asked (the step's fingerprint, optimizer and cost model; no budget for no
budget, else a budget in the scope asked, of the bytes the budget resolves
to, a fraction as planning resolves it; "floor" is checked for its scope
only, as only a search finds it), its simulated peak is within those bytes,
and it verifies again; any other is planned afresh (saying why on stderr)
and its file rewritten.

Planning imports the optimizer (cvxpy) lazily; running a plan given
explicitly does not.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
import os
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from remat_ir.ir.budgets import DEFAULT_TIME_LIMIT, is_floor
from remat_ir.ir.types import DEFAULT_SCOPE, TRANSFER_INSTRS
from remat_ir.runtime.bind import LiveGuard, ModelGuard
from remat_ir.runtime.interpret import PlanRunner, WrappedModule, planner, unwrap  # noqa: F401 (re-exported)

__all__ = ["AutoRemat", "cache_dir", "planner", "unwrap", "wrap"]

_PROGRESS_AFTER_S = 2.0
_FLOOR_OF_CALL = "the floor of this call:"  # (a plan's comment)


def cache_dir() -> Path:
    """Where plans are cached: $REMAT_IR_CACHE, else remat-ir in the user's cache directory."""
    if os.environ.get("REMAT_IR_CACHE"):
        return Path(os.environ["REMAT_IR_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("remat-ir", appauthor=False))


def _uses_fsdp(model) -> bool:
    from remat_ir.runtime.fsdp import uses_fsdp

    return isinstance(model, torch.nn.Module) and uses_fsdp(model)


def wrap(model: torch.nn.Module, plan=None, loss=None, *, budget=None, scope: str = DEFAULT_SCOPE,
         optimizer: str = "none", cost: str = "flops", effort: str | None = None, time_limit: float = DEFAULT_TIME_LIMIT,
         solver: str = "HIGHS", cache: bool = True, max_plans: int = 8, check_model: bool = True,
         dynamic: bool = True, max_shape: dict | None = None, offload: bool = False, host_budget=None):
    """`model`, whose training steps run by a remat-ir plan.

    With `plan` (a Program or a `.rir` path): that plan, as
    `remat_ir.runtime.interpret.wrap` runs it (`check_model` as there).

    Without: plans made at the first training-mode call of each call
    signature, for `budget` (bytes, "1.5GiB", a fraction such as 0.6 of the
    unoptimized peak in `scope`, or "floor"; None: the unoptimized plan) in
    `scope` ("activations" by default: what the step adds on top of
    parameters, gradients and optimizer state; or "total").  `optimizer`,
    `cost`, `effort` (None: compile's default), `time_limit` and `solver`
    are `remat_ir.compile`'s.  `cache=False` keeps plans off disk.  `loss(output, *args,
    **kwargs)`, when given, is part of the step.  A model sharded with
    FSDP2's `fully_shard` gets a plan per FSDP unit, each for `budget` on
    each rank (`remat_ir.runtime.fsdp`).  A budget or `time_limit` that is
    no positive, finite amount (zero, negative, NaN, infinite) is refused
    here (BudgetError, ValueError); planning errors (an infeasible budget, a
    model that cannot be traced) are raised at that first call.

    `dynamic` (the default): one symbolic plan serves calls whose sizes
    differ (a batch padded to its own longest sequence; a smaller last
    batch), planned once (see the module's docstring); False: a plan per
    exact shape.  `max_shape`: input name -> the largest shape the calls
    will have ({"input_ids": (8, 512)}; None for a dimension left to the
    default): the range a symbolic plan covers, which a fraction of a budget
    refers to.

    `offload`: where recomputation alone cannot fit the budget, the plans
    may also offload activations to host memory between forward and
    backward (`remat_ir.fit`; eager's bits); `host_budget` (bytes or a size)
    bounds what they hold on the host.  Both are part of the plan cache's
    key.  Not with a model sharded with `fully_shard` yet."""
    from remat_ir.ir.types import Program
    from remat_ir.runtime.interpret import adopt, unwrap

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wrap() takes a torch.nn.Module, not {type(model).__name__}")
    if plan is not None and not isinstance(plan, (Program, str, os.PathLike)):
        hint = f"; for a budget write wrap(model, budget={plan!r})" if isinstance(plan, (int, float)) else ""
        raise TypeError(f"wrap()'s second argument is a plan (a Program, or a .rir file's path), not "
                        f"{type(plan).__name__}{hint}")
    if loss is not None and not callable(loss):
        raise TypeError(f"wrap()'s loss is a function loss(output, *args, **kwargs), not {type(loss).__name__}")
    if plan is not None:
        if budget is not None:
            raise ValueError("give wrap() a plan or a budget, not both: the plan already fits its budget")
        if offload or host_budget is not None:
            raise ValueError("offload and host_budget say how wrap() plans for a budget; a plan given already "
                             "says what it offloads")
        if isinstance(plan, (str, os.PathLike)):
            from remat_ir.ir.files import load_plan

            plan = load_plan(plan)
        from remat_ir.runtime.interpret import wrap as wrap_plan

        if _uses_fsdp(model):
            raise ValueError("a plan made beforehand covers one whole model's step; a model sharded with "
                             "fully_shard runs a plan per FSDP unit: wrap it with a budget, "
                             "remat_ir.wrap(model, budget=...)")
        return wrap_plan(model, plan, loss, check_model=check_model)
    from remat_ir import pipeline

    # A budget or time limit that is no positive, finite amount fails here, not at the first step.
    pipeline.check_budget(budget)
    pipeline.check_time_limit(time_limit)
    pipeline.check_host_budget(host_budget, offload)
    if _uses_fsdp(model):
        from remat_ir.runtime.fsdp import FSDPRemat

        if offload:
            raise NotImplementedError("offload with a model sharded with fully_shard is not supported yet: its "
                                      "units' plans recompute only")

        unwrap(model)  # wrapped again: the new options replace the old (a unit's forward included)
        return adopt(model, FSDPRemat(model, loss, unit_planner=AutoRemat, budget=budget, scope=scope,
                                      optimizer=optimizer, cost=cost, effort=effort, time_limit=time_limit,
                                      solver=solver, cache=cache, max_plans=max_plans))
    return adopt(model, AutoRemat(model, loss, budget=budget, scope=scope, optimizer=optimizer, cost=cost,
                                  effort=effort, time_limit=time_limit, solver=solver, cache=cache,
                                  max_plans=max_plans, dynamic=dynamic, max_shape=max_shape, offload=offload,
                                  host_budget=host_budget))


class AutoRemat(WrappedModule):
    """`model` with a plan per call signature, made on first use (see the
    module's docstring).  `plans` holds the ones in memory, most recent last."""

    def __init__(self, model: torch.nn.Module, loss_fn=None, *, budget=None, scope: str = DEFAULT_SCOPE,
                 optimizer: str = "none", cost: str = "flops", effort: str | None = None, time_limit: float = DEFAULT_TIME_LIMIT,
                 solver: str = "HIGHS", cache: bool = True, max_plans: int = 8, dynamic: bool = False,
                 max_shape: dict | None = None, offload: bool = False, host_budget=None):
        from remat_ir import pipeline

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"wrap() takes a torch.nn.Module, not {type(model).__name__}")
        # Typos fail here, not at the first step.
        if scope not in pipeline.SCOPES:
            raise ValueError(f"scope must be one of {', '.join(pipeline.SCOPES)}, not {scope!r}")
        pipeline.check_budget(budget)
        pipeline.check_time_limit(time_limit)
        pipeline.check_host_budget(host_budget, offload)
        if max_plans < 1:
            raise ValueError(f"max_plans must be at least 1, not {max_plans}")
        super().__init__(model, loss_fn)
        self.options = dict(budget=budget, scope=scope, optimizer=optimizer, cost=cost, effort=effort,
                            time_limit=time_limit, solver=solver)
        if offload:  # (part of the cache key; without offload the key is what it always was)
            self.options.update(offload=True, host_budget=host_budget)
        self.cache_plans = cache
        self.max_plans = max_plans
        self.dynamic = dynamic
        self.max_shape = _check_max_shape(max_shape)
        if self.max_shape and not dynamic:
            raise ValueError("max_shape is the range of sizes a symbolic plan covers; with dynamic=False each "
                             "shape gets a plan of its own: leave max_shape out")
        # (call structure, or shape class for a symbolic plan; guards) -> plan
        self.plans: OrderedDict[tuple, PlanRunner] = OrderedDict()
        # A symbolic plan's traced program (its unoptimized schedule: a
        # fraction of a budget is of its peak), to grow the plan's range.
        self._traced: dict[int, object] = {}
        self._seen: dict[str, list[list[int]]] = {}  # shape class -> the largest size of each input dimension
        self.solves = 0  # optimizer runs so far (a plan from the cache is not one)
        self._reads: list = []  # what the traces of the plans in memory read of the model's Python state
        self._eager: set = set()  # call structures whose steps train nothing (run eagerly)

    def step(self, call):
        guard, live = self.__dict__.get("_model_guard"), self.__dict__.get("_live_guard")
        eager = self.__dict__.setdefault("_eager", set())
        if (self.plans or eager) and guard is not None:
            changed = guard.changes(self.module) or (live.changes(self.module) if live is not None else [])
            if changed:
                # The plans were made from the model as it was: plan it as it is now.
                more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
                print(f"remat-ir: {'; '.join(changed[:3])}{more} since the plans for "
                      f"{type(self.module).__name__} were made: planning it again", file=sys.stderr)
                self.plans.clear()
                eager.clear()
                self.__dict__.pop("_fixed_sizes", None)
                self._reads = []
        # Calls of one structure (a symbolic plan: of one shape class) share a
        # plan unless the model's code decides on their values (an all-ones mask
        # or not): then each decision has its own, keyed by its guards.
        structure, shape_class = call.structure(), call.shape_class()
        if structure in eager or shape_class in eager:
            return self._eager_step(call)
        self._note_sizes(shape_class, call)
        key, runner = self._serving(call)
        if runner is None:
            # Planning is not part of the step: a dispatch mode the caller has on
            # (a memory tracker, a FLOP counter) does not see its fake tensors.
            from torch.utils._python_dispatch import _disable_current_modes
            from remat_ir.trace.tracer import NothingToTrain

            try:
                with _disable_current_modes():
                    runner = self._grown(call, shape_class) or self._plan(call)
            except Exception as e:  # noqa: BLE001 - only the two kinds below are caught
                if isinstance(e, NothingToTrain):
                    # (peft's disable_adapter(), every parameter frozen: no backward to plan)
                    why = f"{type(self.module).__name__}'s step trains nothing ({e})"
                elif _internal(e):
                    # A step the planner gets wrong must not stop the training loop: said, and run as eager does.
                    why = (f"cannot plan {type(self.module).__name__}'s step ({str(e).splitlines()[-1]}; "
                           "please report it)")
                else:
                    raise
                print(f"remat-ir: {why}; such calls run eagerly", file=sys.stderr)
                eager.update((structure, shape_class))
                self._take_guards(fresh=True)  # (a change plans such calls again)
                return self._eager_step(call)
            self._take_guards(fresh=not self.plans or guard is None)
            # A symbolic plan's inputs' shapes tell it from another of the same class
            # (a batch of one: symbolic in its sequence only).
            shapes = tuple(tuple(map(str, v.shape)) for v in runner.exe.inputs) if runner.symbolic else ()
            if runner.symbolic and _one_size(runner.program):  # (one per size: they do not replace each other)
                shapes += tuple(runner.program.header.sizes)
            key = (shape_class if runner.symbolic else structure, tuple(runner.program.header.guards), shapes)
            old = self.plans.pop(key, None)
            if old is not None:
                self._traced.pop(id(old), None)
            self.plans[key] = runner
            while len(self.plans) > self.max_plans:
                self._traced.pop(id(self.plans.popitem(last=False)[1]), None)
        self.plans.move_to_end(key)
        return runner.run(self.module, call, guards_checked=True)

    def _take_guards(self, fresh: bool) -> None:
        """Note what the plans in memory (and the calls run eagerly) were made
        from: the model (`fresh`: taken anew) and what their traces read."""
        if fresh:
            self._model_guard = ModelGuard(self.module)
        self._live_guard = LiveGuard(self._reads, self.module)

    def _eager_step(self, call):
        from remat_ir.runtime.interpret import eager_step

        args, kwargs = call.rebuild(call.tensors)
        return eager_step(self.module, self.loss_fn, args, kwargs)

    def plan_of(self, *args, **kwargs):
        """The plan a training call with these arguments ran by, as a program
        of its sizes (a symbolic plan instantiated at them: its peaks are the
        simulator's for this call), or None when no plan in memory serves
        such a call."""
        from remat_ir.ir import sizes as sz
        from remat_ir.trace.calls import split_call

        call = split_call(self.module, args, kwargs)
        _, r = self._serving(call)
        if r is None:
            return None
        return sz.instantiate(r.program, r.sizes_of(call)[0]) if r.symbolic else r.program

    def _serving(self, call):
        """(key, plan) of the plan in memory that runs `call`, or (None, None)."""
        structure, shape_class = call.structure(), call.shape_class()
        for k, r in self.plans.items():
            if k[0] == (shape_class if r.symbolic else structure) and not r.accepts(call) \
                    and not r.failed_guard(self.module, call):
                return k, r
        return None, None

    # ------------------------------------------------------------ sizes

    def _note_sizes(self, shape_class: str, call) -> None:
        seen = self._seen.setdefault(shape_class, [list(t.shape) for t in call.tensors])
        for s, t in zip(seen, call.tensors):
            s[:] = [max(a, b) for a, b in zip(s, t.shape)]

    def _dynamic_dims(self, call) -> dict[str, dict[int, str]]:
        from remat_ir.trace.calls import dynamic_dims

        shapes = {n: t.shape for n, t in zip(call.names, call.tensors)}
        for name, shape in self.max_shape.items():
            # (A typo would leave the range at the sizes seen, and the budget's fraction of a smaller peak.)
            if name not in shapes:
                raise ValueError(f"max_shape names {name!r}, which this call passes no tensor as (it passes "
                                 f"{', '.join(map(repr, shapes)) or 'none'})")
            if len(shape) > len(shapes[name]):
                raise ValueError(f"max_shape[{name!r}] has {len(shape)} sizes, but {name} has "
                                 f"{len(shapes[name])} dimensions ({list(shapes[name])})")
        seen = self._seen.get(call.shape_class(), [])
        varying = {(n, d) for n, t, s in zip(call.names, call.tensors, seen) for d in range(t.dim())
                   if s[d] != t.shape[d]}
        named = {(n, d) for n, shape in self.max_shape.items() for d, x in enumerate(shape) if x is not None}
        return dynamic_dims(call, varying | named)

    def _ranges(self, program, call) -> list[str]:
        """The range a new symbolic plan covers: from its low end to `max_shape`,
        else (for the sequence, with a budget that is no byte count) the
        model's own limit (`config.max_position_embeddings`), else the
        largest size seen so far."""
        from remat_ir.ir import sizes as sz
        from remat_ir.ir.budgets import parse_budget

        seen = dict(zip(call.names, self._seen.get(call.shape_class(), [])))
        high: dict[str, int] = {}
        for v in program.values:
            if v.kind != "input":
                continue
            name = v.source or v.name
            for d, x in enumerate(v.shape):
                if type(x) is str and sz.SYMBOL_RE.fullmatch(x):
                    most = seen.get(name, [0] * len(v.shape))[d]
                    limit = self.max_shape.get(name, ())
                    if d < len(limit) and limit[d] is not None:
                        most = max(most, int(limit[d]))
                    high[x] = max(high.get(x, 0), most)
        budget = self.options["budget"]
        by_bytes = budget is not None and not is_floor(budget) and parse_budget(budget)[0] == "bytes"
        config = getattr(self.module, "config", None)
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        named = {x for shape in self.max_shape.values() for x in shape if x is not None}
        if "T" in high and isinstance(limit, int) and limit > high["T"] and not by_bytes and not named:
            high["T"] = limit
        out = []
        for r in map(sz.parse_range, program.header.sizes):
            out.append(sz.format_range(sz.SizeRange(r.symbol, r.low, max(r.low, high.get(r.symbol, r.high)))))
        return out

    def _within_guards(self, program, call) -> None:
        """Narrow the range to the call's own sizes at an end where the
        trace's size guards do not hold (`B*T != 4` at B=T=2, `T <= 64` at a
        high end of 128): a plan verifies at both ends of its range.  Where
        that leaves one size only, such calls are traced at their sizes from
        now on (`_fix_sizes`)."""
        from remat_ir.ir import sizes as sz
        from remat_ir.ir.fingerprint import fingerprint

        ends = sz.ends(program)
        low, high = ends[0], ends[-1]
        bad_low, bad_high = sz.check_sizes(program, low), sz.check_sizes(program, high)
        if not (bad_low or bad_high):
            return
        sizes, _ = sz.bind_inputs(program, {n: t.shape for n, t in zip(call.names, call.tensors)})
        program.header.sizes = [
            sz.format_range(sz.SizeRange(s, sizes[s] if bad_low else r.low, sizes[s] if bad_high else r.high))
            for s, r in sz.ranges(program).items()]
        program.header.fingerprint = fingerprint(program)
        if _one_size(program):
            why = (bad_low or bad_high).split("break the plan's ")[-1]
            self._fix_sizes(call, f"{type(self.module).__name__}'s step depends on its exact sizes ({why})")

    def _fix_sizes(self, call, why: str) -> None:
        """Trace calls of this shape class at their own sizes from now on (the
        model's code fixes them: trl's chunked loss loops over `range(B*(T-1))`'s
        chunks, NEFTune scales its noise by `T*d`), saying so once."""
        fixed = self.__dict__.setdefault("_fixed_sizes", set())
        if call.shape_class() not in fixed:
            fixed.add(call.shape_class())
            print(f"remat-ir: {why}; planning each size of such calls on its own (padding to a multiple, "
                  "`pad_to_multiple_of`, keeps them few)", file=sys.stderr)

    def _grown(self, call, shape_class):
        """A symbolic plan of this shape class whose range, grown to this
        call's sizes, still fits its budget there (no optimizer run), or None."""
        import msgspec

        from remat_ir import pipeline
        from remat_ir.ir import sizes as sz
        from remat_ir.ir.fingerprint import fingerprint

        for k, r in list(self.plans.items()):
            traced = self._traced.get(id(r))
            if not r.symbolic or k[0] != shape_class or traced is None:
                continue
            program = r.program
            sizes, why = sz.bind_inputs(program, {n: t.shape for n, t in zip(call.names, call.tensors)})
            ranges = sz.ranges(program)
            if why or any(sizes[s] < ranges[s].low for s in ranges):
                continue
            wider = [sz.format_range(sz.SizeRange(s, x.low, max(x.high, sizes[s]))) for s, x in ranges.items()]
            header = msgspec.structs.replace(program.header, sizes=wider)
            grown = msgspec.structs.replace(program, header=header)
            high = sz.ends(grown)[-1]
            if sz.check_sizes(grown, sizes) or sz.check_sizes(grown, high):
                continue
            traced = msgspec.structs.replace(traced, header=msgspec.structs.replace(traced.header, sizes=wider))
            o = self.options
            budget = program.header.budget
            if budget is not None and o["budget"] is not None and not is_floor(o["budget"]):
                # A fraction is of the unoptimized peak at the range's new high end.
                nbytes = pipeline.budget_bytes(sz.instantiate(traced, high, refingerprint=False), o["budget"],
                                               o["scope"])
                budget = msgspec.structs.replace(budget, bytes=nbytes)
            elif budget is not None:
                continue  # a floor is searched again
            header.budget = budget
            header.fingerprint = fingerprint(grown)  # (the range is part of it)
            runner = PlanRunner(self.module, grown, self.loss_fn, check_model=False, check_plan=False)
            if runner.failed_guard(self.module, call):
                continue  # the model's code decides otherwise on this call's values
            if budget is not None and runner.peak(high)[1] > budget.bytes:
                continue
            self._traced[id(runner)] = traced
            if self.cache_plans:  # the next process starts from the grown range
                _store(self._path(traced), grown)
            return runner
        return None

    def _plan(self, call) -> PlanRunner:
        import msgspec

        from remat_ir import pipeline
        from remat_ir.ir.fingerprint import fingerprint
        from remat_ir.trace.tracer import NotReplayableError, TraceError

        if _uses_fsdp(self.module):
            # Sharded after wrapping: the plan would read DTensor shards where it needs gathered parameters.
            raise ValueError("the model was sharded with fully_shard after remat_ir.wrap; shard it first, "
                             "then wrap it, so that each FSDP unit runs a plan of its own")
        o = self.options
        what = ", ".join(f"{n} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                         for n, t in zip(call.names, call.tensors))
        budget = "no budget" if o["budget"] is None else f"budget {o['budget']} ({o['scope']})"
        with _Progress(f"remat-ir: planning {type(self.module).__name__} for {what or 'no tensors'}, "
                       f"{budget}{', autocast ' + call.autocast if call.autocast else ''}") as progress, \
                contextlib.ExitStack() as locks:
            args, kwargs = call.rebuild(call.tensors)
            trace = dict(loss=self.loss_fn, optimizer=o["optimizer"], cost=o["cost"], autocast=call.autocast,
                         as_called=True, live=self.__dict__.setdefault("_reads", []))
            program = None
            fixed = self.__dict__.get("_fixed_sizes", set())  # (`_fix_sizes`)
            dims = self._dynamic_dims(call) if self.dynamic and call.shape_class() not in fixed else {}
            if dims:
                try:
                    program = pipeline.trace(self.module, args, kwargs, dynamic=dims, **trace)
                    program.header.sizes = self._ranges(program, call)
                    program.header.fingerprint = fingerprint(program)
                    self._within_guards(program, call)
                except NotReplayableError:
                    raise
                except TraceError as e:
                    self._fix_sizes(call, str(e))
                    program = None
            traced = program
            if program is None:
                program = pipeline.trace(self.module, args, kwargs, **trace)
            path = cached = None
            if self.cache_plans:
                path = self._path(program)
                locks.enter_context(_planning_lock(path))
                cached = _load_cached(path, program, o)
            if cached is not None:
                # The fingerprint matched the step just traced, so no retrace; verified again
                # (a file on disk can have been edited).
                try:
                    runner = PlanRunner(self.module, cached, self.loss_fn, check_model=False)
                    why = runner.accepts(call)
                    if not why:
                        progress.note = f" (the plan cached in {path})"
                        if traced is not None:  # (the cached range, which a fraction of the budget refers to)
                            self._traced[id(runner)] = msgspec.structs.replace(
                                traced, header=msgspec.structs.replace(traced.header, sizes=cached.header.sizes))
                        return runner
                    _not_served(path, why)
                except ValueError as e:  # (it does not verify)
                    _not_served(path, str(e).splitlines()[0])
            effort = {} if o["effort"] is None else {"effort": o["effort"]}
            self.solves += o["budget"] is not None
            fit = dict(scope=o["scope"], time_limit=o["time_limit"], solver=o["solver"], **effort)
            if o.get("offload"):
                fit.update(offload=True, host_budget=o["host_budget"])
            try:
                plan = pipeline.fit(program, o["budget"], **fit) if traced is not None else \
                    self._fit_alone(program, fit)
            except pipeline.BudgetError as e:
                if traced is None:
                    raise
                # Below what recomputation alone reaches: graph rewrites, chosen for one size.
                print(f"remat-ir: {e}; planning this call's sizes alone", file=sys.stderr)
                traced = None
                program = pipeline.trace(self.module, args, kwargs, **trace)
                path = self._path(program) if self.cache_plans else None
                if path is not None:
                    locks.enter_context(_planning_lock(path))
                cached = _load_cached(path, program, o) if path is not None else None
                if cached is not None:
                    return PlanRunner(self.module, cached, self.loss_fn, check_model=False)
                plan = self._fit_alone(program, fit)
            # A call's floor, run in place of the budget it cannot meet, is not what
            # the request plans: a later process would find it and plan again anyway.
            if path is not None and not any(c.startswith(_FLOOR_OF_CALL) for c in plan.header.comment):
                _store(path, plan)
            runner = PlanRunner(self.module, plan, self.loss_fn, check_model=False, check_plan=False)
            if traced is not None:
                self._traced[id(runner)] = traced
            return runner

    def _fit_alone(self, program, fit: dict):
        """`program` (one call's sizes) fitted to the budget; a call that
        cannot meet it when other calls did (a short last batch, whose own
        step the fixed costs dominate) runs by its floor plan, saying so in
        one line, instead of stopping the loop.  The first call's budget is
        still refused: it is the user's to change."""
        from remat_ir import pipeline
        from remat_ir.optimize.search import Infeasible

        o = self.options
        try:
            return pipeline.fit(program, o["budget"], **fit)
        except (Infeasible, pipeline.BudgetError) as e:
            if not self.plans or o["budget"] is None or is_floor(o["budget"]):
                raise
            print(f"remat-ir: this call's step cannot meet budget {o['budget']} ({str(e).splitlines()[0]}); "
                  "it runs by its floor plan, the least memory a plan of it holds", file=sys.stderr)
        plan = pipeline.fit(program, "floor", **fit)
        plan.header.comment.append(f"{_FLOOR_OF_CALL} budget {o['budget']} ({o['scope']}) was below it")
        return plan

    def _path(self, program) -> Path:
        """The plan cache's file for `program` (as traced) and these options."""
        return cache_dir() / f"{type(self.module).__name__}-{self._key(program)}.rir"

    def _key(self, program) -> str:
        from remat_ir.version import __version__

        o = self.options
        facts = {"fingerprint": _class_fingerprint(program), "torch": torch.__version__,
                 "remat_ir": __version__, **{k: repr(v) for k, v in sorted(o.items())}}
        if program.header.sizes and _one_size(program):
            facts["sizes"] = list(program.header.sizes)  # (a plan per size: a file per size)
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def _one_size(program) -> bool:
    from remat_ir.ir import sizes as sz

    return all(r.low == r.high for r in sz.ranges(program).values())


def _check_max_shape(max_shape) -> dict[str, tuple]:
    """`max_shape` as input name -> sizes, each a positive int or None;
    ValueError naming what is not."""
    if max_shape is None:
        return {}
    if not isinstance(max_shape, dict):
        raise TypeError(f"max_shape is a dict of input name -> shape, not {type(max_shape).__name__}")
    out = {}
    for name, shape in max_shape.items():
        if not isinstance(name, str) or isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise ValueError(f"max_shape maps an input's name to a shape ({{'input_ids': (8, 512)}}), not "
                             f"{name!r}: {shape!r}")
        shape = tuple(shape)
        bad = [x for x in shape if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1)]
        if bad:
            raise ValueError(f"max_shape[{name!r}] = {shape!r}: each size is a positive int (or None for one "
                             f"left to the default), not {bad[0]!r}")
        out[name] = tuple(x if x is None else int(x) for x in shape)
    return out


def _internal(e: Exception) -> bool:
    """Whether planning failed on the planner's side (a plan that does not
    verify, a schedule the simulator refuses), not on the user's (a budget
    below the floor, a model that cannot be traced)."""
    from remat_ir import pipeline

    chain = [e, e.__cause__]
    return any(type(x).__name__ == "SimulationError" for x in chain) or isinstance(e, pipeline.UnsoundPlan)


def _class_fingerprint(program) -> str:
    """The fingerprint of the step, without a symbolic plan's range: one file
    per shape class, whatever sizes it was planned up to."""
    if not program.header.sizes:
        return program.header.fingerprint
    import msgspec

    from remat_ir.ir.fingerprint import fingerprint

    return fingerprint(msgspec.structs.replace(program, header=msgspec.structs.replace(program.header, sizes=[])))


def _load_cached(path: Path, program, options: dict):
    """The plan at `path` if it serves the step `program` (as traced) for
    the request `options`, else None, saying on stderr why a plan found there
    is not used (`_not_serving`)."""
    from remat_ir.ir.files import load_cached

    plan = load_cached(path)
    if plan is None:
        return None
    try:
        why = _not_serving(plan, program, options)
    except ValueError as e:  # (an edited range the simulator cannot read)
        why = str(e).splitlines()[0]
    if why is not None:
        _not_served(path, why)
        return None
    return plan


def _not_served(path: Path, why: str) -> None:
    print(f"remat-ir: the cached plan {path} does not serve this call ({why}): planning it again", file=sys.stderr)


def _not_serving(plan, program, options: dict) -> str | None:
    """Why the cached `plan` is not the one planning `program` (as traced)
    for `options` would give, or None: another step (fingerprint), another
    request in its header (`_cache_mismatch`, the budget resolved to bytes as
    planning resolves it), or a schedule whose simulated peak is over those
    bytes.  A file of the cache is any request's plan, or edited: its name
    proves nothing."""
    from remat_ir import pipeline
    from remat_ir.ir import sizes as sz

    if _class_fingerprint(plan) != _class_fingerprint(program):
        return f"made for another step: fingerprint {_class_fingerprint(plan)}, this step's {_class_fingerprint(program)}"
    budget, scope = options["budget"], options["scope"]
    nbytes = None
    if budget is not None and not is_floor(budget):
        # A fraction is of the traced step's unoptimized peak at the high end of the plan's range.
        at = program
        if sz.is_symbolic(plan):
            import msgspec

            ranged = msgspec.structs.replace(program, header=msgspec.structs.replace(program.header,
                                                                                      sizes=plan.header.sizes))
            at = sz.instantiate(ranged, sz.ends(ranged)[-1], refingerprint=False)
        nbytes = pipeline.budget_bytes(at, budget, scope)
    if not options.get("offload") and any(i.kind in TRANSFER_INSTRS for i in plan.forward + plan.backward):
        return "made with offloads to the host, asked without offload"
    problem = _cache_mismatch(plan.header, program.header, options, nbytes)
    if problem is not None or plan.header.budget is None:
        return problem
    peak = _simulated_peak(plan)
    want = nbytes if nbytes is not None else plan.header.budget.bytes  # ("floor": the bytes it was made for)
    if peak > want:
        return f"its simulated peak is {peak} bytes ({plan.header.budget.scope}), over the {want} bytes asked"
    return None


def _simulated_peak(plan) -> int:
    """The peak of `plan` in its budget's scope, at each end of its range,
    first step or steady state, as the verifier checks a budget."""
    from remat_ir.check.simulate import simulate
    from remat_ir.ir import sizes as sz

    programs = [sz.instantiate(plan, at, refingerprint=False) for at in sz.ends(plan)] if sz.is_symbolic(plan) \
        else [plan]
    return max(simulate(p, grads_present=gp, top_k=0).scope_peak(plan.header.budget.scope)
               for p in programs for gp in (True, False))


def _cache_mismatch(cached, traced, options: dict, nbytes: int | None = None) -> str | None:
    """How the header of a cached plan differs from what is asked (None when
    it does not): a plan without a budget for no budget; for a budget, one in
    its scope, of the bytes asked (`nbytes`: the budget resolved for the
    traced step; without it, a fraction and "floor" are resolved by planning,
    so only their scope is checked); the traced step's optimizer and cost
    model; the host budget asked (none without offload)."""
    from remat_ir.ir.budgets import host_budget_bytes, parse_budget

    have, want, scope = cached.budget, options["budget"], options["scope"]
    made = "without a budget" if have is None else f"for a budget of {have.bytes} bytes ({have.scope})"
    if want is None:
        if have is not None:
            return f"made {made}, asked for no budget"
    else:
        asked = f"asked budget {want!r} ({scope})"
        if have is None or have.scope != scope:
            return f"made {made}, {asked}"
        if not is_floor(want):
            kind, amount = parse_budget(want)
            amount = amount if kind == "bytes" else nbytes
            if amount is not None and have.bytes != amount:
                return f"made {made}, {asked}: {amount} bytes"
    host = host_budget_bytes(options.get("host_budget"))
    if cached.host_budget != host:
        return (f"made for host budget {cached.host_budget} bytes" if cached.host_budget is not None
                else "made without a host budget") + (f", asked {host} bytes" if host is not None else ", asked none")
    if cached.optim != traced.optim:
        return f"made for optimizer {cached.optim}, asked {traced.optim}"
    if cached.cost != traced.cost:
        return f"made for cost model {cached.cost}, asked {traced.cost}"
    return None


def _lock_timeout() -> float:
    try:
        return float(os.environ.get("REMAT_IR_LOCK_TIMEOUT", "1800"))
    except ValueError:
        return 1800.0


@contextlib.contextmanager
def _planning_lock(path: Path):
    """Held while a step is looked up in the cache, planned and stored: the
    processes that plan the same step (the ranks of one job, two scripts
    sharing the cache) take turns, so the first plans and the others read its
    plan.  An advisory lock on `<plan>.lock` (POSIX `flock`, released when its
    holder exits, even by a crash); a process that has waited
    `$REMAT_IR_LOCK_TIMEOUT` seconds (default 1800) says so and plans on its
    own.  Where no lock can be taken (no `fcntl`, a read-only cache), each
    process plans."""
    f = None
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "a")
    except (ImportError, OSError):
        pass
    if f is None:
        yield
        return
    with f:
        start, said, timeout = time.monotonic(), False, _lock_timeout()
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # (held by another process; any other error: a file system without locks)
                waited = time.monotonic() - start
                if waited > timeout:
                    print(f"remat-ir: waited {waited:.0f} s for another process planning this step (lock "
                          f"{f.name}); planning it here (REMAT_IR_LOCK_TIMEOUT sets the wait)", file=sys.stderr)
                    break
                if not said:
                    print(f"remat-ir: another process is planning this step (lock {f.name}); waiting for its "
                          "plan", file=sys.stderr, flush=True)
                    said = True
                time.sleep(0.1)
            except OSError:
                break
        try:
            yield
        finally:
            try:
                fcntl.flock(f, fcntl.LOCK_UN)
            except OSError:
                pass


def _store(path: Path, plan) -> None:
    from remat_ir.ir.files import save_plan

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_plan(plan, path)
    except OSError as e:
        # The step still runs; only the next process plans again.
        print(f"remat-ir: cannot cache the plan in {path.parent} ({e}); set REMAT_IR_CACHE to a "
              "writable directory", file=sys.stderr)


class _Progress:
    """Says on stderr what is being planned when it takes more than a moment,
    and how long it took."""

    def __init__(self, message: str):
        self.message = message
        self.note = ""
        self.shown = False

    def _show(self):
        self.shown = True
        print(f"{self.message} ...", file=self.stream, flush=True)

    def __enter__(self):
        # (the stream as it is now: the timer's thread must not write where a traced hook's output is caught)
        self.stream = sys.stderr
        self.t0 = time.perf_counter()
        self.timer = threading.Timer(_PROGRESS_AFTER_S, self._show)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.timer.cancel()
        self.timer.join()
        if self.shown:
            done = "failed" if exc_type is not None else "done"
            print(f"remat-ir: {done} in {time.perf_counter() - self.t0:.1f} s{self.note}", file=self.stream,
                  flush=True)
        return False
