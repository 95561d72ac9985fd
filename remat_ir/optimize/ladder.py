"""The rewrite ladder: graph rewrites (`remat_ir.rewrite`) when recomputation
alone cannot fit a budget.

The traced graph is tried first; a rewrite is used only when the budget is
below its floor.  Then the rungs, least change first:

    batchnorm_split                     (when the graph has a training BatchNorm;
                                         eager's bits, so allowed under `exact`)
    [batchnorm_split,] lm_head_nll:R    the chunked loss, R rows a chunk (a scratch
                                        of about 1 MiB; eager's bits, so allowed
                                        under `exact`)
    [batchnorm_split,] lm_head_nll:R:late
                                        a head weight tied to the embedding:
                                        its head gradient made again at the end
                                        of backward (more compute, a weight less held)
    [... the last of those,] chunked_attention:K
                                        K = 2, 4, 8: every softmax attention in K
                                        chunks of its B*H matrices

With `offload=True`, two offload rungs come first (after the BatchNorm
split, on top of it when there is one), least change first:

    [batchnorm_split,] offload:heavy    the decisions whose copies to the host
                                        and back cost less than their recompute
                                        (matmuls, convolutions, attention) are
                                        kept or offloaded, never recomputed
    [batchnorm_split,] offload:all      every decision that can be offloaded is

Last, each rewrite family's last rung with the offload rungs on top
(`lm_head_nll:R, offload:heavy`, ...): the chunked loss removes the
logits-sized tensors offload cannot move, offload the blocks' activations
that remain.

An offload rung is no graph rewrite: the graph is the traced one (the
plan's `rewrites` does not list it, a header comment names it), and it
keeps eager's bits, so it is tried under `exact` too.  With a host budget,
an offload rung whose plan's host peak exceeds it does not fit.

Whether a rung fits is decided by its floor when the rewritten graph is
planned block by block (large graphs, where that search takes seconds),
else by a node-limited search at the budget, then by the floor.  The rungs
are tried in order until one fits (the fewest chunks that fit; a family
whose most chunks do not fit is passed over whole; the chunked loss's two
families, plain and late, have one rung each), and the
next count up in that family is planned too: the one with the lower total
cost (every op of the rewritten step plus its recomputes, in the program's
cost model) wins, the fewer chunks on a tie.

`floor` and `optimize` are functions of the program, the budget, the
settings and a `LadderMemo`: each rung's rewritten graph, problem and memo
(its block options, learned rows and floor), and the floors found, so a
rung searched once (for the floor, or an earlier budget) is not searched
again; and the rungs share their blocks' options (the transformer blocks
are the same in every rung: only the head or the attention changes), so a
block class solved for one rung is not solved for the next.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from remat_ir.check.simulate import SimulationError, simulate
from remat_ir.ir import OFFLOAD, Program
from remat_ir.ir.printer import human_bytes
from remat_ir.ir.types import DEFAULT_SCOPE
from remat_ir.optimize import search
from remat_ir.optimize.family import OFFLOAD_ALL, OFFLOAD_HEAVY, offload_candidates
from remat_ir.optimize.problem import Infeasible, Memo, OptimizeResult, Problem, Settings
from remat_ir.rewrite import (
    BATCHNORM_SPLIT, BIT_EXACT, CHUNKED_ATTENTION, CHUNKED_LOSS, apply, attention_choices, describe,
    has_batchnorm, late_applies, loss_rows_of,
)

OWN_BLOCKS = ("(the graph, block by block)",)  # the graph's own floor searched by blocks
UNUSABLE = 1 << 62  # the floor of a rung whose rewritten schedule the simulator refuses
OFFLOAD_RUNG = "offload:"  # a rung's last item "offload:heavy" / "offload:all": no rewrite (module docstring)


def offload_of(rung: tuple) -> str | None:
    """The offload rung's kind ("heavy", "all"), or None for a rung of rewrites only."""
    return rung[-1][len(OFFLOAD_RUNG):] if rung and rung[-1].startswith(OFFLOAD_RUNG) else None


def rewrites_of(rung: tuple) -> tuple:
    """The graph rewrites of a rung (without its offload item)."""
    return rung[:-1] if offload_of(rung) else rung


def rung_text(rung: tuple) -> str:
    parts = [describe(list(rewrites_of(rung)))] if rewrites_of(rung) else []
    if offload_of(rung):
        parts.append(f"{OFFLOAD_RUNG}{offload_of(rung)}")
    return ", ".join(parts)


class HostOver(Infeasible):
    """An offload rung's plan holds more on the host than the host budget."""


@dataclass
class LadderMemo:
    """What the ladder learned about one program, scope and `exact`."""

    programs: dict[tuple, Program] = field(default_factory=dict)  # rung -> its rewritten graph
    problems: dict[tuple, Problem] = field(default_factory=dict)
    memos: dict[tuple, Memo] = field(default_factory=dict)  # rung -> its search memo
    settings: dict[tuple, Settings] = field(default_factory=dict)  # rung -> the settings it is planned with
    floors: dict[tuple, int] = field(default_factory=dict)  # rung -> its floor, once searched
    floor_rung: tuple | None = None  # the rung of the ladder's floor (`floor`), once searched
    unusable: dict[tuple, str] = field(default_factory=dict)  # rung -> why the simulator refuses its plans
    offloaded: dict[tuple, frozenset] = field(default_factory=dict)  # offload rung -> its offload-only nodes
    blocks: dict = field(default_factory=dict)  # block options, shared by every rung (`Memo.shared`)
    bound_to: tuple | None = None

    def bind(self, program: Program, scope: str, exact: bool, settings: Settings, offload: bool = False,
             host_budget: int | None = None) -> LadderMemo:
        key = (program, scope, exact, settings, offload, host_budget)
        if self.bound_to is None:
            self.bound_to = key
            self.programs[()] = program
        elif self.bound_to[0] is not program or self.bound_to[1:] != key[1:]:
            raise ValueError("this ladder memo holds what another program, scope or setting learned")
        return self


class _Ladder:
    """One ladder call: the rungs of a program and the searches it ran."""

    def __init__(self, program: Program, scope: str, settings: Settings, memo: LadderMemo, exact: bool, log,
                 offload: bool = False, host_budget: int | None = None):
        self.program, self.scope, self.settings, self.exact, self.log = program, scope, settings, exact, log
        self.offload, self.host_budget = offload, host_budget
        self.memo = memo.bind(program, scope, exact, settings, offload, host_budget)
        self.results: list[OptimizeResult] = []
        self.stages: dict[str, float] = {}
        self.refused_time_limited = False  # a search that refused its budget was cut short by the time limit

    def base(self) -> tuple:
        return (BATCHNORM_SPLIT,) if has_batchnorm(self.program) else ()

    def rewrite_steps(self) -> list[tuple]:
        """The rewrite lists to try after the graph itself, least change first."""
        base = self.base()
        steps = [base] if base else []
        if not self.exact or BIT_EXACT[CHUNKED_LOSS]:
            rows = loss_rows_of(self.program)
            if rows is not None:
                steps.append(base + (f"{CHUNKED_LOSS}:{rows}",))
                if late_applies(self.program):
                    steps.append(base + (f"{CHUNKED_LOSS}:{rows}:late",))
        if not self.exact or BIT_EXACT[CHUNKED_ATTENTION]:
            last = steps[-1] if steps else base
            steps += [last + (f"{CHUNKED_ATTENTION}:{k}",) for k in attention_choices(self.program)]
        return steps

    def offload_steps(self) -> list[tuple]:
        """The offload rungs (with `offload`), on the graph after the BatchNorm
        split when it has one: "heavy" when it offloads something and not
        everything "all" does, then "all"."""
        if not self.offload:
            return []
        heavy, every = (self.base() + (OFFLOAD_RUNG + kind,) for kind in (OFFLOAD_HEAVY, OFFLOAD_ALL))
        if not self.offloaded(every):
            return []
        return ([heavy] if self.offloaded(heavy) and self.offloaded(heavy) != self.offloaded(every) else []) + [every]

    def steps(self) -> list[tuple]:
        """The rungs to try after the graph itself, least change first: the
        BatchNorm split, the offload rungs, the other rewrites."""
        rw = self.rewrite_steps()
        split = rw[:1] if rw and rw[0] == (BATCHNORM_SPLIT,) else []
        return split + self.offload_steps() + rw[len(split):] + self.combined_steps(rw[len(split):])

    def combined_steps(self, rewrites: list[tuple]) -> list[tuple]:
        """With `offload`, last: each rewrite family's last rung with the
        offload rungs on top (the chunked loss and offload together reach
        below both: the loss's logits-sized tensors are what offload cannot
        move, the blocks' activations what the loss leaves)."""
        if not self.offload:
            return []
        ends = [r for i, r in enumerate(rewrites) if i + 1 == len(rewrites) or _family(rewrites[i + 1]) != _family(r)]
        out = []
        for r in ends:
            for kind in (OFFLOAD_HEAVY, OFFLOAD_ALL):
                rung = r + (OFFLOAD_RUNG + kind,)
                if self.offloaded(rung) and (kind == OFFLOAD_ALL or self.offloaded(rung) != self.offloaded(
                        r + (OFFLOAD_RUNG + OFFLOAD_ALL,))):
                    out.append(rung)
        return out

    def offloaded(self, rung: tuple) -> frozenset:
        """The offload-only nodes of an offload rung (its graph's decisions that its kind takes)."""
        m = self.memo
        if rung not in m.offloaded:
            m.offloaded[rung] = offload_candidates(self.problem(rewrites_of(rung)).analysis, offload_of(rung))
        return m.offloaded[rung]

    def rewritten(self, rung: tuple) -> Program:
        m = self.memo
        rung = rewrites_of(rung)
        if rung not in m.programs:
            m.programs[rung] = apply(self.program, list(rung))
        return m.programs[rung]

    def problem(self, rung: tuple) -> Problem:
        m = self.memo
        if rung not in m.problems:
            if rung == OWN_BLOCKS:
                m.problems[rung] = self.problem(())
            elif offload_of(rung):
                m.problems[rung] = Problem.of(self.rewritten(rung), self.scope, offload=self.offloaded(rung))
            else:
                m.problems[rung] = Problem.of(self.rewritten(rung), self.scope)
        return m.problems[rung]

    def rung_settings(self, rung: tuple) -> Settings:
        """A rewritten graph past `flat_floor_decisions` is planned block by
        block when it has blocks: the flat search's floor proof, which decides
        each rung, grows too slow (minutes at 120 decisions).  An offload rung
        of the graph itself is planned as the graph is (its floor is searched
        flat up to `flat_max_decisions`, within the flat search's work limit)."""
        m = self.memo
        if rung not in m.settings:
            st = self.settings
            p = self.problem(rung)
            big = len(p.decisions) > st.flat_floor_decisions and p.decomposition.blocks >= 2
            if rung == OWN_BLOCKS or (rewrites_of(rung) and big):
                st = replace(st, decompose=True)
            m.settings[rung] = st
        return m.settings[rung]

    def _call(self, what: str, rung: tuple, fn, *args, **kw) -> OptimizeResult:
        """One search of a rung.  A rewrite whose plans the simulator refuses
        (a rewrite that missed a case of its region: a bug, said in the log
        with the node) is passed over as if its floor were unreachable, so the
        ladder goes on with the others; the graph's own plans are not."""
        if rung in self.memo.unusable:
            raise Infeasible(self.memo.unusable[rung], UNUSABLE, None, self.scope)
        t0 = time.perf_counter()
        memo = self.memo.memos.setdefault(rung, Memo(shared=self.memo.blocks))
        try:
            r = fn(self.problem(rung), *args, self.rung_settings(rung), memo, log=self.log, **kw)
        except SimulationError as e:
            if rung in ((), OWN_BLOCKS):
                raise
            why = self.memo.unusable[rung] = (f"the rung {rung_text(rung)} makes a schedule the simulator "
                                              f"refuses ({e}); passed over")
            if self.log:
                self.log(why)
            raise Infeasible(why, UNUSABLE, None, self.scope) from e
        except Infeasible as e:
            self.refused_time_limited |= e.time_limited
            raise
        finally:
            label = f"{what} " + ("the graph" if not rung else "the graph by blocks" if rung == OWN_BLOCKS
                                  else rung_text(rung))
            self.stages[label] = self.stages.get(label, 0.0) + time.perf_counter() - t0
        self.results.append(r)
        return r

    def time_limited(self) -> bool:
        """Whether the time limit cut any of the searches this call ran short."""
        return self.refused_time_limited or any(r.time_limited for r in self.results)

    def floor_of(self, rung: tuple) -> int:
        if rung not in self.memo.floors:
            try:
                self.memo.floors[rung] = self._call("floor of", rung, search.floor).predicted_peak
            except Infeasible:  # (a floor search refuses nothing: the rung is unusable)
                self.memo.floors[rung] = UNUSABLE
        return self.memo.floors[rung]

    def optimize(self, rung: tuple, budget: int, prove: bool = False) -> OptimizeResult:
        r = self._call("search of", rung, search.optimize, budget, prove=prove)
        self.label(rung, r)
        return r

    def label(self, rung: tuple, r: OptimizeResult) -> None:
        """`r`'s plan as its rung made it: the rewrites in its header; an
        offload rung's plan checked against the host budget (HostOver) and
        named in a comment."""
        if rewrites_of(rung) and rung != OWN_BLOCKS:
            r.program.header.rewrites = list(rewrites_of(rung))
        if not offload_of(rung):
            return
        copies = [i.target for i in r.program.forward if i.kind == OFFLOAD]
        if not copies:
            return
        host = simulate(r.program, top_k=0).host_peak_bytes
        if self.host_budget is not None and host > self.host_budget:
            raise HostOver(f"the plan of {rung_text(rung)} for budget {human_bytes(r.budget or r.predicted_peak)} "
                           f"holds {human_bytes(host)} on the host, over the host budget "
                           f"{human_bytes(self.host_budget)}", self.memo.floors.get(rung, 0), r.budget,
                           self.scope)
        line = (f"offload rung {rung_text(rung)} (the budget is below what recomputation alone reaches): "
                f"{len(copies)} values offloaded to the host, host peak {human_bytes(host)}")
        if line not in r.program.header.comment:
            r.program.header.comment.append(line)

    def host_ok(self, rung: tuple) -> bool:
        """Whether the floor plan of `rung` keeps within the host budget."""
        if not offload_of(rung) or self.host_budget is None:
            return True
        try:
            self.label(rung, self._call("floor of", rung, search.floor))
        except HostOver:
            return False
        return True

    def own_rung(self, steps: list) -> tuple:
        """The rung whose floor is the graph's own: the graph itself, or, for
        a large graph with rewrites to try that the flat search takes (its
        settings do not decompose it), the graph searched block by block."""
        p = self.problem(())
        if (not p.decomposes(self.settings) and len(p.decisions) > self.settings.flat_floor_decisions and steps
                and p.decomposition.blocks >= 2):
            return OWN_BLOCKS
        return ()

    def refusal(self, rung: tuple, budget: int) -> Infeasible | None:
        """The refusal of `budget` from the floor `rung`'s floor search
        already found, when that floor is above the budget (no budget search
        that finds nothing); else None."""
        memo = self.memo.memos.get(rung)
        if memo is None or memo.floor is None or memo.floor.plan.peak <= budget:
            return None
        return search.below_floor(self.problem(rung), budget, self.rung_settings(rung), memo)


def _family(specs: tuple) -> tuple:
    """The rewrites of a rung less their chunk counts: rungs of one family
    differ only in how many chunks."""
    return tuple(s.split(":")[0] + (":late" if s.endswith(":late") else "") for s in specs)


def _total(r: OptimizeResult) -> float:
    return r.base_cost + r.extra_cost


def _explained(e: Infeasible, specs: tuple, time_limited: bool = False) -> Infeasible:
    """`e` with the rung it refers to, time-limited when any search of the
    ladder was."""
    time_limited = e.time_limited or time_limited
    if isinstance(e, HostOver) or (not specs and time_limited == e.time_limited):
        return e
    what = "rewrites" if not offload_of(specs) else "rung"
    text = f"{e} (with {what}: {rung_text(specs)})" if specs else str(e)
    return Infeasible(text, e.floor_bytes, e.budget_bytes, e.scope, time_limited)


def _finish(lad: _Ladder, r: OptimizeResult, t0: float, budget: int | None) -> OptimizeResult:
    """`r`, with the solves, seconds and stages of every search the call ran."""
    return replace(r, solves=[s for x in lad.results for s in x.solves], seconds=time.perf_counter() - t0,
                   stages=dict(lad.stages), budget=budget,
                   time_limited=lad.time_limited())


def floor(program: Program, settings: Settings | None = None, memo: LadderMemo | None = None, *,
          scope: str = DEFAULT_SCOPE, exact: bool = False, log=None, offload: bool = False,
          host_budget: int | None = None, **given) -> OptimizeResult:
    """The smallest peak the optimizer reaches: the graph's own floor, or
    (with `offload`) the last offload rung's when lower and its floor plan
    within the host budget (else the one before), or the last rewrite rung's (the most chunks) when that is lower
    still; the result's plan is that rung's floor plan.  When the last
    family of rewrite rungs (chunked attention, or the late tied gradient)
    is used only when it lowers the floor below the families before it:
    the same floor with less change and recompute otherwise.  Only each
    family's last rung is searched (each floor search of a rewritten graph
    takes seconds)."""
    t0 = time.perf_counter()
    settings = search.settings_of(settings, **given)
    lad = _Ladder(program, scope, settings, memo if memo is not None else LadderMemo(), exact, log, offload,
                  host_budget)
    steps = lad.steps()
    m = lad.memo
    if m.floor_rung is None:
        own = lad.own_rung(lad.rewrite_steps())
        best = (lad.floor_of(own), own)
        if own == OWN_BLOCKS and lad.floor_of(()) < best[0]:
            # (The flat search, within its work limits, can reach below the
            # block-by-block floor; a refusal compares with both.)
            best = (lad.floor_of(()), ())
        for off in reversed(lad.offload_steps()):  # (the lowest whose floor plan keeps to the host budget)
            if lad.floor_of(off) < best[0] and lad.host_ok(off):
                best = (lad.floor_of(off), off)
                break
        rw = lad.rewrite_steps()
        ends = [i for i in range(len(rw)) if i + 1 == len(rw) or _family(rw[i + 1]) != _family(rw[i])]
        last = None
        for i in reversed(ends):  # the last family's floor, then those before it
            if rw[i] == (BATCHNORM_SPLIT,) and last is not None:
                break
            f = lad.floor_of(rw[i])
            if last is None or f <= last[0]:
                last = (f, rw[i])
        if last is not None and last[0] < best[0]:
            best = last
        for both in reversed(lad.combined_steps(rw[1:] if rw and rw[0] == (BATCHNORM_SPLIT,) else rw)):
            if lad.floor_of(both) < best[0] and lad.host_ok(both):
                best = (lad.floor_of(both), both)
                break
        m.floor_rung = best[1]
    rung = m.floor_rung
    r = lad._call("floor of", rung, search.floor)
    lad.label(rung, r)
    return _finish(lad, r, t0, None)


def optimize(program: Program, budget: int, settings: Settings | None = None, memo: LadderMemo | None = None,
             *, scope: str = DEFAULT_SCOPE, exact: bool = False, log=None, offload: bool = False,
             host_budget: int | None = None, **given) -> OptimizeResult:
    """The cheapest plan for `budget` the ladder finds; raises Infeasible
    (with the lowest floor found) when none fits.  The graph itself is
    probed by a search that stops at its node limits without proving a
    floor; each rung, by that search and then by its floor; when no rung
    fits, the graph itself once more, by the flat search to its floor where
    that search takes the graph (a rung planned block by block may stop
    above what the flat search reaches), unless the budget is far under the
    graph's block-by-block floor (`Settings.flat_reach`).  `offload`: the offload rungs are
    tried first (module docstring); `host_budget` (bytes): what their plans
    may hold on the host."""
    t0 = time.perf_counter()
    budget = int(budget)
    settings = search.settings_of(settings, **given)
    lad = _Ladder(program, scope, settings, memo if memo is not None else LadderMemo(), exact, log, offload,
                  host_budget)
    m = lad.memo
    if m.floor_rung is not None and m.floors.get(m.floor_rung) == budget:
        # `--budget floor`: the floor rung's floor plan (its memo holds it).
        return _finish(lad, lad.optimize(m.floor_rung, budget, prove=True), t0, budget)
    steps = lad.steps()
    own = None
    # The graph itself is searched as without offload (the offload rungs
    # change no plan recomputation alone finds): its own rung and whether
    # its search proves its floor follow the rewrite rungs alone.
    rewrites = lad.rewrite_steps()
    try:
        own = lad.own_rung(rewrites)
        if own == OWN_BLOCKS and lad.floor_of(own) > budget:
            # A large graph: its block-by-block floor (seconds) says whether
            # to search it at all, not a flat search (a minute) that fails.
            raise Infeasible("below the graph's own floor", lad.floor_of(own), budget, scope)
        return _finish(lad, lad.optimize((), budget, prove=not rewrites), t0, budget)
    except Infeasible:
        if not steps:
            raise
    found: dict[int, OptimizeResult] = {}
    tested: dict[int, bool] = {}
    host_over: dict[int, HostOver] = {}  # offload rungs (by index) whose plans the host budget refused

    def fits(i: int) -> bool:
        # Block by block, the floor search is the cheaper test; flat, a
        # node-limited search at the budget, then the floor.  The rung's memo
        # keeps its floor plan, so a budget at or above the floor is then
        # planned without a second search.
        if i not in tested:
            rung = steps[i]
            if not lad.rung_settings(rung).decompose and rung not in m.floors:
                try:
                    found[i] = lad.optimize(rung, budget)
                    tested[i] = True
                    return True
                except HostOver as e:
                    host_over[i] = e
                    tested[i] = False
                    return False
                except Infeasible:
                    pass
            tested[i] = lad.floor_of(rung) <= budget
            if tested[i] and offload_of(rung) and lad.host_budget is not None:
                try:  # (over the host budget: the rung does not fit)
                    found[i] = lad.optimize(rung, budget, prove=True)
                except HostOver as e:
                    host_over[i] = e
                    tested[i] = False
        return tested[i]

    def plan(i: int) -> OptimizeResult:
        return found.get(i) or lad.optimize(steps[i], budget, prove=True)

    def family_end(i: int) -> int:
        while i + 1 < len(steps) and _family(steps[i + 1]) == _family(steps[i]):
            i += 1
        return i

    # The BatchNorm split alone is the smallest change; then the chunks.
    lo = 0
    if steps[0] == (BATCHNORM_SPLIT,):
        if fits(0):
            return _finish(lad, plan(0), t0, budget)
        lo = 1
    # The fewest chunks that fit, counting up: a budget just under the
    # graph's own floor, the usual case, needs few, and a graph of more
    # chunks takes longer to plan.  A family whose most chunks do not fit is
    # passed over with one test.
    while lo < len(steps):
        end = family_end(lo)
        if fits(end):
            while not fits(lo):
                lo += 1
            break
        if end in host_over:
            # (An offload family's last rung offloads the most: over the host
            # budget, a rung before it, holding less there, may still fit.)
            first = next((i for i in range(lo, end) if fits(i)), None)
            if first is not None:
                lo = first
                break
        lo = end + 1
    if lo == len(steps):
        # No rung fits.  The graph itself, when the flat search takes it, was
        # probed without its floor (or judged by its floor block by block): a
        # rung planned block by block can have a higher floor than the flat
        # search reaches, so the graph's own flat search goes to its floor first.
        # A budget far under the graph's block-by-block floor is refused at
        # that floor without the flat search (`Settings.flat_reach`).
        own_error = None
        if own == OWN_BLOCKS and budget < lad.settings.flat_reach * lad.floor_of(own):
            own_error = lad.refusal(own, budget)
        if own_error is None:
            try:
                return _finish(lad, lad.optimize((), budget, prove=True), t0, budget)
            except Infeasible as e:
                own_error = e
        # Refuse with the lowest floor a rung reached (every family's last
        # was tested; the last rung's need not be the lowest), or the graph's.
        floored = [i for i in tested if steps[i] in m.floors]
        if not floored:  # (only offload rungs, each over the host budget)
            if own_error is not None:
                raise own_error
            raise next(iter(host_over.values()))
        low = min(floored, key=lambda i: (m.floors[steps[i]], i))
        if own_error is not None and 0 < own_error.floor_bytes <= m.floors[steps[low]]:
            raise own_error
        if m.floors[steps[low]] == UNUSABLE:
            own_floor = lad.floor_of(own)
            raise Infeasible(f"budget is below the floor: the smallest activation peak this graph allows is "
                             f"{human_bytes(own_floor)}, and no graph rewrite could be used ("
                             + "; ".join(m.unusable.values()) + ")", own_floor, budget, scope, lad.time_limited())
        try:
            refused = lad.refusal(steps[low], budget)
            if refused is not None:
                raise refused
            return _finish(lad, lad.optimize(steps[low], budget, prove=True), t0, budget)
        except Infeasible as e:
            e = _explained(e, steps[low], lad.time_limited())
            if host_over:  # (and the rungs that would have fitted hold too much on the host)
                e = Infeasible(f"{e}; with offload: {next(iter(host_over.values()))}", e.floor_bytes, e.budget_bytes, e.scope,
                               e.time_limited)
            raise e from None
    best = plan(lo)
    # (The offload rungs: the least change that fits, "all" only where "heavy" does not.)
    if lo + 1 <= family_end(lo) and not offload_of(steps[lo]) and fits(lo + 1):
        more = plan(lo + 1)
        if _total(more) < _total(best):
            best = more
    return _finish(lad, best, t0, budget)
