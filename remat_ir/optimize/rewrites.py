"""Choosing graph rewrites (`remat_ir.rewrite`) when recomputation alone cannot fit a budget.

The traced graph is tried first; a rewrite is used only when the budget is
below its floor.  Then the ladder, least change first:

    batchnorm_split                     (when the graph has a training BatchNorm;
                                         eager's bits, so allowed under `exact`)
    [batchnorm_split,] chunked_loss:K   K = 2, 4, 8, ... (not under `exact`)
    [batchnorm_split,] chunked_loss:K:late
                                        a head weight tied to the embedding:
                                        its head gradient made at the end of
                                        backward (more compute, a weight less held)
    [... the last of those,] chunked_attention:K
                                        K = 2, 4, 8: every softmax attention in K
                                        chunks of its B*H matrices

Whether a rung fits is decided by its floor when the rewritten graph is
planned block by block (large graphs, where that search takes seconds),
else by a node-limited search at the budget, then by the floor.  The rungs
are tried in order until one fits (the fewest chunks that fit; a family,
plain or late, whose most chunks do not fit is passed over whole), and the
next count up in that family is planned too: the one with the lower
total cost (every op of the rewritten step plus its recomputes, in the
program's cost model) wins, the fewer chunks on a tie.  Each graph gets its
own `Planner`, kept for later budgets.
"""
from __future__ import annotations

from remat_ir.ir import Program
from remat_ir.ir.types import DEFAULT_SCOPE
from remat_ir.optimize.blocks import segments
from remat_ir.optimize.family import Analysis
from remat_ir.optimize.search import DEFAULT_TIME_LIMIT, Infeasible, OptimizeResult, Planner, optimize
from remat_ir.rewrite import (
    BATCHNORM_SPLIT, BIT_EXACT, CHUNKED_ATTENTION, CHUNKED_LOSS, apply, attention_choices, chunk_choices,
    describe, has_batchnorm, late_applies,
)


# Rewritten graphs with more decisions than this are planned block by block.
FLAT_FLOOR_DECISIONS = 100


class RewritePlanner:
    """Planners for `program` and each rewrite of it the ladder tries."""

    def __init__(self, program: Program, scope: str = DEFAULT_SCOPE, *, solver: str = "HIGHS", effort="fast",
                 exact: bool = False, log=None, planner: Planner | None = None):
        self.program, self.scope, self.solver, self.effort, self.exact, self.log = (
            program, scope, solver, effort, exact, log)
        self._planners: dict[tuple, Planner] = {}
        self._programs: dict[tuple, Program] = {(): program}
        self._own_planner: Planner | None = None  # the graph's own, block by block, for its floor
        if planner is not None:
            self._planners[()] = planner

    def ladder(self) -> list[tuple]:
        """The rewrite lists to try after the graph itself, least change first."""
        base = (BATCHNORM_SPLIT,) if has_batchnorm(self.program) else ()
        steps = [base] if base else []
        if not self.exact or BIT_EXACT[CHUNKED_LOSS]:
            ks = chunk_choices(self.program)
            steps += [base + (f"{CHUNKED_LOSS}:{k}",) for k in ks]
            if ks and late_applies(self.program):
                steps += [base + (f"{CHUNKED_LOSS}:{k}:late",) for k in ks]
        if not self.exact or BIT_EXACT[CHUNKED_ATTENTION]:
            last = steps[-1] if steps else base
            steps += [last + (f"{CHUNKED_ATTENTION}:{k}",) for k in attention_choices(self.program)]
        return steps

    def rewritten(self, specs: tuple) -> Program:
        if specs not in self._programs:
            self._programs[specs] = apply(self.program, list(specs))
        return self._programs[specs]

    def planner(self, specs: tuple) -> Planner:
        if specs not in self._planners:
            # A rewritten graph past FLAT_FLOOR_DECISIONS is planned block by
            # block when it has blocks: the flat search's floor proof, which
            # decides each rung, grows too slow (minutes at 120 decisions).
            program = self.rewritten(specs)
            big = specs and len(Analysis(program, self.scope).decisions()) > FLAT_FLOOR_DECISIONS
            self._planners[specs] = Planner(program, self.scope, solver=self.solver, log=self.log,
                                            effort=self.effort,
                                            decompose=True if big and self._blocks(specs) else None)
        return self._planners[specs]

    def _blocks(self, specs: tuple) -> bool:
        segs, _ = segments(Analysis(self.rewritten(specs), self.scope))
        return sum(1 for s in segs if s.decisions) >= 2

    def _optimize(self, specs: tuple, budget: int, time_limit: float, prove: bool = False,
                  planner: Planner | None = None) -> OptimizeResult:
        return optimize(self.rewritten(specs), budget, self.scope, time_limit=time_limit, solver=self.solver,
                        effort=self.effort, planner=planner or self.planner(specs), prove=prove)

    def floor(self, time_limit: float = DEFAULT_TIME_LIMIT) -> int:
        """The smallest peak the optimizer reaches: the graph's own floor
        (kept as `own_floor`), or the last rung's (the most chunks) when that
        is lower (`floor_specs` says which).  When the last family of rungs
        (chunked attention, or the late tied gradient) does not lower the
        floor below the family before it, that one's last rung is used: the
        same floor with less recompute.  Only those two are compared (each
        floor search of a rewritten graph takes seconds to a minute)."""
        from remat_ir.optimize.search import floor

        steps = self.ladder()
        # The graph's own floor, block by block when it is large (as the rungs').
        own = self._own_floor_planner(steps)
        self._floor_planner = own
        self.floor_specs = ()
        self._floor = self.own_floor = floor(self.program, self.scope, time_limit=time_limit,
                                             solver=self.solver, effort=self.effort, planner=own)
        ends = [i for i in range(len(steps)) if i + 1 == len(steps) or _family(steps[i + 1]) != _family(steps[i])]
        best = None
        for i in reversed(ends[-2:]):  # the last family's floor, then the one before it
            if steps[i] == (BATCHNORM_SPLIT,) and best is not None:
                break
            f = floor(self.rewritten(steps[i]), self.scope, time_limit=time_limit, solver=self.solver,
                      effort=self.effort, planner=self.planner(steps[i]))
            if best is None or f <= best[0]:
                best = (f, i)
        if best is not None and best[0] < self._floor:
            self._floor, self.floor_specs, self._floor_planner = best[0], steps[best[1]], self.planner(steps[best[1]])
        return self._floor

    def _own_floor_planner(self, steps: list) -> Planner:
        """The planner for the graph's own floor: its flat planner, or, for a
        large graph with rewrites to try, one that plans block by block."""
        own = self.planner(())
        if not own.decompose and len(own.all_dec) > FLAT_FLOOR_DECISIONS and steps and self._blocks(()):
            if self._own_planner is None:
                self._own_planner = Planner(self.program, self.scope, solver=self.solver, log=self.log,
                                            effort=self.effort, decompose=True)
            own = self._own_planner
        return own

    def optimize(self, budget: int, time_limit: float = DEFAULT_TIME_LIMIT) -> OptimizeResult:
        """The cheapest plan for `budget` the ladder finds; raises Infeasible
        (with the floor of the last rung) when none fits.  The graph itself is
        probed by a search that stops at its node limits without proving a
        floor; each rung, by that search and then by its floor."""
        if getattr(self, "_floor", None) == budget:
            return self._optimize(self.floor_specs, budget, time_limit, prove=True, planner=self._floor_planner)
        steps = self.ladder()
        try:
            own = self._own_floor_planner(steps)
            if own is not self.planner(()):
                # A large graph: its block-by-block floor (seconds) says whether
                # to search it at all, not a flat search (a minute) that fails.
                own.start(time_limit)
                if own.floor_plan_for().peak > budget:
                    raise Infeasible("below the graph's own floor", own.floor_plan.peak, budget, self.scope)
            return self._optimize((), budget, time_limit, prove=not steps)
        except Infeasible:
            if not steps:
                raise
        floors: dict[int, int] = {}
        found: dict[int, OptimizeResult] = {}

        def fits(i: int) -> bool:
            # Block by block, the floor search is the cheaper test; flat, a
            # node-limited search at the budget, then the floor.  The planner
            # keeps its floor plan, so a budget at or above the floor is then
            # planned without a second search.
            if i not in floors:
                planner = self.planner(steps[i])
                if not planner.decompose:
                    try:
                        found[i] = self._optimize(steps[i], budget, time_limit)
                        floors[i] = 0
                        return True
                    except Infeasible:
                        pass
                planner.start(time_limit)
                floors[i] = planner.floor_plan_for().peak
            return floors[i] <= budget

        def plan(i: int) -> OptimizeResult:
            return found.get(i) or self._optimize(steps[i], budget, time_limit, prove=True)

        # The BatchNorm split alone is the smallest change; then the chunks.
        lo = 0
        if steps[0] == (BATCHNORM_SPLIT,):
            if fits(0):
                return plan(0)
            lo = 1
        # The fewest chunks that fit, counting up: a budget just under the
        # graph's own floor, the usual case, needs few, and a graph of more
        # chunks takes longer to plan.  A family whose most chunks do not fit
        # is passed over with one test.
        def family_end(i: int) -> int:
            while i + 1 < len(steps) and _family(steps[i + 1]) == _family(steps[i]):
                i += 1
            return i

        while lo < len(steps):
            end = family_end(lo)
            if fits(end):
                while not fits(lo):
                    lo += 1
                break
            lo = end + 1
        if lo == len(steps):
            # Nothing fits: refuse with the lowest floor a rung reached (every
            # family's last was tested; the last rung's need not be the lowest).
            low = min(floors, key=lambda i: (floors[i], i))
            try:
                return self._optimize(steps[low], budget, time_limit, prove=True)
            except Infeasible as e:
                raise _explained(e, steps[low]) from None
        best = plan(lo)
        if lo + 1 <= family_end(lo) and fits(lo + 1):
            more = plan(lo + 1)
            if _total(more) < _total(best):
                best = more
        return best

def _family(specs: tuple) -> tuple:
    """The rewrites of a rung less their chunk counts: rungs of one family
    differ only in how many chunks."""
    return tuple(s.split(":")[0] + (":late" if s.endswith(":late") else "") for s in specs)


def _total(r: OptimizeResult) -> float:
    return r.base_cost + r.extra_cost


def _explained(e: Infeasible, specs: tuple) -> Infeasible:
    if not specs:
        return e
    return Infeasible(f"{e} (with rewrites: {describe(list(specs))})", e.floor_bytes, e.budget_bytes, e.scope)
