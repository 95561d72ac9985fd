"""The flat search: one MILP over every decision (exact for the plan family),
with only the memory rows the plans it finds break.

Solve with some rows, find the plan's exact occupancy, add the rows where it holds
more than the budget (without a budget, more than the peak the MILP
claimed), and solve again.  Each round's optimum bounds the true one from
below, so the first plan that breaks no row is optimal.  Most rows never
bind (docs/02-optimizer.md has the counts).
"""
from __future__ import annotations

from remat_ir.ir.printer import human_bytes
from remat_ir.optimize.family import occupancy
from remat_ir.optimize.milp import FLAT, KeepModel
from remat_ir.optimize.problem import Plan, Run


class Overworked(Exception):
    """The flat search passed its work limits (`Settings.flat_work`, ...) on a
    graph the decomposed search can plan; `best` is its least-peak plan so
    far (a floor search), or None."""

    def __init__(self, best: Plan | None, work: int, rows: int):
        super().__init__(f"the flat search passed its work limit ({work:,} iteration x row units done, "
                         f"{rows:,} rows next)")
        self.best = best


def search(run: Run, budget: int | None) -> tuple[Plan | None, bool]:
    """The cheapest plan that fits `budget` (None: the least peak, then the
    least recompute), and whether the MILP proved it optimal.  The plan is
    None when none fits (the budget is below the floor)."""
    a, st = run.a, run.settings
    least = a.peak_lower_bound()
    if budget is not None and budget < least:
        run.say(f"budget {human_bytes(budget)} is under {human_bytes(least)}, what every plan holds at some point")
        return None, True
    objective = "cost" if budget is not None else "peak"
    what = f"budget {human_bytes(budget)}" if budget is not None else "floor"
    # Each search starts from the start-of-backward row alone.  Rows one
    # budget needed are valid for every budget, but starting from them is
    # slower: the MILP's time grows with its rows, and a larger budget's
    # rows save no round.
    active: set | None = {("s",)}
    # The first round only needs a plan to learn rows from, not a proof: it
    # stops at a small node limit (with the start row alone it is a
    # knapsack, slow to prove on chains of identical blocks).  Later rounds
    # search up to a larger node limit; the plan is then the best found (its
    # gap is in the solve record).  Node limits, unlike time limits, stop
    # every machine at the same point.
    nodes = st.first_round_nodes
    # Without a budget every round's plan is a plan, with an exact peak: a
    # floor search that ends early returns the least of them.
    best: Plan | None = None

    def done(plan: Plan | None, proven: bool = False) -> tuple[Plan | None, bool]:
        if best is None or (plan is not None and (plan.peak, plan.cost) <= (best.peak, best.cost)):
            return plan, proven
        return best, False

    work = 0
    blocks = run.problem.decomposition.blocks >= 2
    for rnd in range(2 * st.lazy_rounds):
        m = KeepModel(a).build(active)
        c = m.compile(objective)
        if budget is not None:
            c.B.value = float(budget)
        rows = max(m.n_constraints, 1)
        round_nodes = min(nodes, max(st.flat_round_work // rows ** 2, 1))
        if blocks and (work > st.flat_work or rows > st.flat_max_rows):
            run.memo.flat_overworked = True
            raise Overworked(best, work, rows)
        kept, rec = run.solve(c, FLAT, what, round=rnd + 1, nodes=round_nodes, rel_gap=st.flat_gap)
        work += (rec.iterations if rec.iterations is not None else round_nodes) * rows
        if kept is None:
            if blocks and round_nodes < nodes and rec.status != "infeasible":
                run.memo.flat_overworked = True  # (no plan within the work a round may do)
                raise Overworked(best, work, rows)
            if nodes == st.round_nodes or rec.status == "infeasible":
                return done(None)
            nodes = st.round_nodes  # no plan within the round's node limit: search further
            continue
        prof = occupancy(a, a.keep_of(kept), range(len(a.storages)))
        if budget is None:
            best = done(run.evaluate(kept))[0]
            if best.peak <= least:
                # No plan holds less: this is the floor.  The least recompute
                # at it is a search at that budget (rows and a cost objective).
                cheaper, _ = search(run, best.peak)
                if cheaper is not None and cheaper.cost < best.cost:
                    best = cheaper
                return best, True
        limit = float(budget) if budget is not None else float(c.B.value) + 0.5
        over = m.rows_over(prof, limit)
        if ("tail",) in over:
            return None, False  # bytes no plan changes exceed the budget
        new = set() if active is None else set(over) - active
        new = (highest(new, over, st.floor_rows_per_round) if budget is None
               else highest_apart(new, over, st.budget_rows_per_round, st.rows_apart))
        if not new:
            if over and active is not None:
                active = None  # (never seen) a row the mapping missed: take every row
                continue
            if rec.status == "optimal" or nodes == st.round_nodes:
                return done(run.evaluate(kept), rec.status == "optimal" and not rec.gap)
            nodes = st.round_nodes  # fits every row: now search on for a cheaper one
            continue
        active |= new
        nodes = st.round_nodes  # later rounds usually end the search: let them finish it
        if rnd + 1 >= st.lazy_rounds:
            active = None
    return done(None)


def by_bytes(rows: set, over: dict) -> list:
    """`rows`, the one where the plan holds the most bytes first (ties: by id)."""
    return sorted(rows, key=lambda r: (-over[r], r))


def highest(rows: set, over: dict, n: int) -> set:
    """The `n` rows of `rows` that hold the most bytes."""
    return set(by_bytes(rows, over)[:n])


def highest_apart(rows: set, over: dict, n: int, width: int) -> set:
    """The `n` rows of `rows` that hold the most bytes, taken greedily at
    least `width` + 1 events apart (forward rows by forward position), then
    the highest of the rest if that leaves fewer than `n`.  The rows that
    hold the most are often neighbours on one peak (after a backward node and
    in the gap before the next event the same tensors are live), a plan that
    fits one of them nearly fits the rest, and a row on another peak is what
    the next round would have found."""
    ranked = by_bytes(rows, over)

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
