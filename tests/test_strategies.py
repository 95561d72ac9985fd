"""The optimizer's shape: strategies as functions of (problem, budget,
settings, memo) with one result type, one settings object, typed solve
records, and a memo that spares a second search without changing a plan."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import remat_ir
from remat_ir.check.verify import verify
from remat_ir.ir.printer import format_program
from remat_ir.optimize import ladder, search
from remat_ir.optimize.milp import COMBINE, FLAT, OPTION
from remat_ir.optimize.search import Infeasible, Memo, OptimizeResult, Problem, Settings, unoptimized_peak

SCOPE = "activations"


@pytest.fixture(scope="module")
def tiny():
    from remat_ir.pipeline import trace_builtin

    return trace_builtin("gpt2-tiny", fake=True)


@pytest.fixture(scope="module")
def stacked():
    """Eight identical residual blocks: small for the flat search, blocks for the decomposed one."""
    from test_optimize import stacked_program

    return stacked_program(8)


@pytest.fixture(scope="module")
def wide_head():
    """A one-block GPT whose vocabulary dwarfs its width: below its recompute
    floor only the chunked loss fits."""
    from remat_ir.models import GPT, GPTConfig

    torch.manual_seed(0)
    module = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=2048, block_size=32)).train()
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 2048, (2, 32), generator=g), torch.randint(0, 2048, (2, 32), generator=g))
    return remat_ir.compile(module, inputs)


def test_settings_are_one_frozen_object_with_every_default():
    fast, full = Settings.of("fast"), Settings.of("full")
    assert fast == Settings() and full.all_windows and full.option_nodes is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.solver = "SCIP"
    assert Settings.of("fast", solver="scip").solver == "SCIP"
    assert Settings.of(full, time_limit=None) is full  # None: the default stands
    with pytest.raises(TypeError, match="no such optimizer setting: flat_gapp"):
        Settings.of("fast", flat_gapp=0.1)
    with pytest.raises(ValueError, match="effort must be one of fast, full"):
        Settings.of("fastest")
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time_limit must be a positive"):
            Settings(time_limit=bad)
    with pytest.raises(ValueError, match="combine"):
        Settings(combine="greedy")


def test_a_scope_passed_where_settings_go_is_refused(tiny):
    with pytest.raises(TypeError, match="scope="):
        search.optimize(tiny, 10 ** 9, "activations")


@pytest.mark.slow
def test_every_strategy_returns_the_one_result_type(stacked):
    problem, settings = Problem.of(stacked, SCOPE), Settings.of("fast")
    budget = int(0.6 * unoptimized_peak(stacked, SCOPE))
    results = [search.flat(problem, budget, settings, Memo()), search.decomposed(problem, budget, settings, Memo()),
               search.optimize(problem, budget, settings, Memo()), search.floor(problem, settings, Memo()),
               ladder.optimize(stacked, budget, settings, ladder.LadderMemo(), scope=SCOPE),
               ladder.floor(stacked, settings, ladder.LadderMemo(), scope=SCOPE)]
    for r in results:
        assert isinstance(r, OptimizeResult)
        assert r.program.header.budget.scope == SCOPE
        v = verify(r.program)
        assert v.ok and v.report.activation_peak_bytes == r.predicted_peak
    assert {r.mode for r in results[:2]} == {"flat", "decomposed"}
    assert all(r.predicted_peak <= budget for r in results[:3])


def test_solve_records_are_typed(tiny, stacked):
    budget = int(0.6 * unoptimized_peak(tiny, SCOPE))
    flat = search.flat(tiny, budget, scope=SCOPE)
    assert {r.kind for r in flat.solves} == {FLAT}
    assert [r.round for r in flat.solves] == list(range(1, len(flat.solves) + 1))
    assert all(isinstance(r.rows, int) and r.rows >= 1 and r.method == "MILP" for r in flat.solves)
    # A round's node limit is its setting's, or less on a model of many rows (`Settings.flat_round_work`).
    st = Settings()

    def limits(r):
        return {min(n, max(st.flat_round_work // max(r.constraints, 1) ** 2, 1))
                for n in (st.first_round_nodes, st.round_nodes)}

    assert all(r.nodes in limits(r) for r in flat.solves)
    assert flat.solves[0].nodes == min(limits(flat.solves[0]))
    assert all(r.explored is not None and r.explored <= r.nodes + 1 for r in flat.solves)
    dec = search.decomposed(stacked, int(0.6 * unoptimized_peak(stacked, SCOPE)), scope=SCOPE)
    kinds = {r.kind for r in dec.solves}
    assert {OPTION, COMBINE} <= kinds
    assert any(r.kind == COMBINE and r.method == "DP" for r in dec.solves)
    assert all(r.seconds >= 0 and r.status for r in dec.solves)
    assert "round 1" in flat.solves[0].name and flat.solves[0].name.startswith("flat budget")


def test_a_memo_serves_the_next_search_and_never_another_problem(stacked):
    tiny = stacked
    problem, settings = Problem.of(tiny, SCOPE), Settings.of("fast")
    budget = int(0.6 * unoptimized_peak(tiny, SCOPE))
    memo = Memo()
    first = search.decomposed(problem, budget, settings, memo)
    again = search.decomposed(problem, budget, settings, memo)
    assert format_program(again.program) == format_program(first.program)
    assert len([r for r in again.solves if r.kind == OPTION]) < len([r for r in first.solves if r.kind == OPTION])
    # A fresh memo makes the same plan: the memo only saves work.
    cold = search.decomposed(Problem.of(tiny, SCOPE), budget, settings, Memo())
    assert format_program(cold.program) == format_program(first.program)
    with pytest.raises(ValueError, match="another problem or other settings"):
        search.decomposed(Problem.of(tiny, SCOPE), budget, settings, memo)
    with pytest.raises(ValueError, match="another problem or other settings"):
        search.decomposed(problem, budget, Settings.of("full"), memo)
    # Given the program rather than the problem, the memo's own problem is used.
    assert search.floor(tiny, settings, memo, scope=SCOPE).predicted_peak == memo.floor.plan.peak


def test_the_floor_is_searched_once_per_memo(tiny):
    memo = Memo()
    f = search.floor(tiny, memo=memo, scope=SCOPE)
    assert f.solves and f.budget is None
    again = search.floor(tiny, memo=memo, scope=SCOPE)
    assert again.solves == [] and again.predicted_peak == f.predicted_peak
    at_floor = search.optimize(tiny, f.predicted_peak, memo=memo, scope=SCOPE)
    assert at_floor.solves == [] and format_program(at_floor.program).split("\n", 3)[3] == \
        format_program(f.program).split("\n", 3)[3]


def test_the_ladder_searches_no_rung_twice(wide_head):
    memo = ladder.LadderMemo()
    f = ladder.floor(wide_head, memo=memo, scope=SCOPE)
    assert f.program.header.rewrites and f.stages  # below the graph's own floor: a rewrite
    assert set(memo.floors) >= {()}
    at_floor = ladder.optimize(wide_head, f.predicted_peak, memo=memo, scope=SCOPE)
    assert at_floor.solves == [] and at_floor.program.header.rewrites == f.program.header.rewrites
    own = memo.floors[()]
    r = ladder.optimize(wide_head, own - 1, memo=memo, scope=SCOPE)
    assert r.predicted_peak <= own - 1 and r.program.header.rewrites
    assert not any(k.startswith("floor of the graph") for k in r.stages)  # its floor was known
    exact = ladder.optimize(wide_head, own - 1, memo=ladder.LadderMemo(), scope=SCOPE, exact=True)
    assert [s.split(":")[0] for s in exact.program.header.rewrites] == ["lm_head_nll"]  # eager's bits
    with pytest.raises(ValueError, match="another program, scope or setting"):
        ladder.optimize(wide_head, own - 1, memo=memo, scope=SCOPE, exact=True)


def test_the_problem_carries_the_scope(tiny):
    total = Problem.of(tiny, "total")
    r = search.optimize(total, unoptimized_peak(tiny, "total"), scope=None)
    assert r.scope == "total" and r.mode == "none"
    with pytest.raises(ValueError, match="in scope total"):
        search.optimize(total, 10 ** 9, scope="activations")


def test_a_room_below_a_class_s_proven_least_peak_is_not_solved(tiny):
    """The least-peak MILP's dual bound is a bound: no plan of the class
    fits under it (the MILP capped just below it has none), and one capped
    at the least peak found has one.  `fit_options` skips a room below it
    (a record of method "bound") rather than solving it."""
    from remat_ir.optimize.decomposed import solve_class
    from remat_ir.optimize.problem import Run

    problem = Problem.of(tiny, SCOPE)
    run = Run(problem, Settings(), Memo(), None)
    bounded = 0
    for inst in problem.decomposition.classes.values():
        canon = inst[0]
        if not canon.decisions:
            continue
        kept, least = solve_class(run, canon, "peak", "min peak", gap=Settings().peak_gap)
        assert kept is not None
        bound = run.memo.peak_bounds.get(canon.signature)
        if bound is None:
            continue  # the least peak is the constants': no bound on the plans
        bounded += 1
        assert 0 < bound <= least
        below, _ = solve_class(run, canon, "cost", "below the bound", B=bound)
        at, _ = solve_class(run, canon, "cost", "at the least peak", B=least * (1 + 1e-6) + 1)
        assert below is None and at is not None
    assert bounded


def test_block_classes_on_threads_give_the_serial_plan_and_records(tiny):
    """`Settings.workers` solves block classes at once; each class keeps to
    its own part of the memo, so the plan, and the solve records and log in
    their order, are the serial run's."""
    budget = int(0.6 * unoptimized_peak(tiny, SCOPE))
    runs = []
    for workers in (1, 2):
        lines = []
        r = search.decomposed(Problem.of(tiny, SCOPE), budget, Settings(workers=workers), Memo(),
                              log=lines.append)
        runs.append((format_program(r.program), [(s.kind, s.subject, s.status, s.objective) for s in r.solves],
                     [line.split(": ")[0] for line in lines]))
    assert len({c.signature for c in Problem.of(tiny, SCOPE).decomposition.segs if c.decisions}) > 1
    assert runs[0] == runs[1]


def test_a_rewrite_whose_plans_the_simulator_refuses_is_passed_over(wide_head, monkeypatch):
    """A rewrite that leaves a schedule the simulator refuses (a case its
    region missed) does not stop planning: that rung is passed over, said
    with the node, and a budget only it could meet is refused as below the
    floor, an error `wrap` and `fit` handle, not an internal one."""
    from remat_ir.check.simulate import SimulationError

    own = ladder.floor(wide_head, memo=ladder.LadderMemo(), scope=SCOPE)
    assert own.program.header.rewrites  # the wide head's floor is a chunked loss's
    real = {"floor": search.floor, "optimize": search.optimize}

    def refusing(name):
        def fn(problem, *args, **kw):
            if problem.program.header.rewrites:
                raise SimulationError("d.loss_chunk.add_ reads loss, which is not live")
            return real[name](problem, *args, **kw)
        return fn

    monkeypatch.setattr(search, "floor", refusing("floor"))
    monkeypatch.setattr(search, "optimize", refusing("optimize"))
    lines: list[str] = []
    memo = ladder.LadderMemo()
    graph_floor = ladder.floor(wide_head, memo=memo, scope=SCOPE, log=lines.append)
    assert not graph_floor.program.header.rewrites and graph_floor.predicted_peak > own.predicted_peak
    assert any("passed over" in x and "d.loss_chunk.add_" in x for x in lines)
    lines.clear()
    with pytest.raises(Infeasible, match="below the floor") as e:
        ladder.optimize(wide_head, graph_floor.predicted_peak - 1, memo=ladder.LadderMemo(), scope=SCOPE,
                        log=lines.append)
    assert e.value.floor_bytes == graph_floor.predicted_peak
    assert any("passed over" in x and "d.loss_chunk.add_" in x for x in lines)
    # The graph's own plans failing so is the optimizer's fault: `fit` says so as a BudgetError.
    from remat_ir.pipeline import BudgetError, fit

    monkeypatch.setattr(search, "optimize", lambda *a, **k: (_ for _ in ()).throw(
        SimulationError("d.h.0.mlp.gelu reads d.h.0.mlp.fc, which is not live")))
    with pytest.raises(BudgetError, match="simulator refuses .*d.h.0.mlp.gelu") as e:
        fit(wide_head, graph_floor.predicted_peak - 1, scope=SCOPE)
    assert isinstance(e.value.__cause__, SimulationError)


def test_past_its_work_limit_the_flat_search_hands_a_graph_with_blocks_to_the_block_search(stacked):
    """The flat search's work is counted in node x row units, not seconds:
    past `flat_work` a graph with blocks is planned block by block, the
    plan's header says so, and the plan is the same on every run."""
    small = Settings.of("fast", flat_work=1)
    budget = int(0.6 * unoptimized_peak(stacked, SCOPE))
    plans = []
    for _ in range(2):
        lines: list[str] = []
        r = search.optimize(stacked, budget, small, Memo(), scope=SCOPE, log=lines.append)
        assert r.mode == "decomposed" and r.predicted_peak <= budget
        assert any("work limit" in x for x in lines)
        assert any(c.startswith("strategy: block by block") for c in r.program.header.comment)
        assert not verify(r.program).errors
        plans.append(format_program(r.program))
    assert plans[0] == plans[1]
    # The floor keeps the least peak either search found.
    memo = Memo()
    f = search.floor(stacked, small, memo, scope=SCOPE)
    assert memo.flat_overworked and f.predicted_peak >= search.floor(stacked, scope=SCOPE).predicted_peak
    # Within the limit, nothing changes.
    assert search.optimize(stacked, budget, scope=SCOPE).mode == "flat"


@pytest.mark.slow
def test_a_budget_far_under_the_block_floor_is_refused_from_the_floors_alone(tiny):
    """Every rung refused and the budget under `flat_reach` x the graph's
    block-by-block floor: the refusal comes from the floors the ladder
    found, with no budget search of any graph (gpt2-tiny planned as a large
    graph is, by `flat_floor_decisions`)."""
    settings = search.settings_of(flat_floor_decisions=10)
    memo = ladder.LadderMemo()
    f = ladder.floor(tiny, settings, memo, scope=SCOPE)
    budget = int(0.5 * f.predicted_peak)
    lines: list[str] = []
    with pytest.raises(Infeasible) as e:
        ladder.optimize(tiny, budget, settings, memo, scope=SCOPE, log=lines.append)
    assert e.value.floor_bytes >= f.predicted_peak > budget and "below the floor" in str(e.value)
    assert not [x for x in lines if x.startswith("optimize ")]  # (no budget search ran)
    with pytest.raises(ValueError, match="below the floor this memo holds"):
        search.below_floor(Problem.of(tiny, SCOPE), budget, settings, Memo())
