"""The optimizer: plans fit their budget, the floor is exact on tiny graphs,
and the MILP's recompute cost equals a brute-force search over the plan
family (keep or recompute each forward node; see `remat_ir/optimize/family.py`)."""
from __future__ import annotations

import dataclasses

import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from programs import programs, random_program  # noqa: E402

from remat_ir.optimize.family import Analysis, apply_plan, model_peak, simulated_peak  # noqa: E402
from remat_ir.ir import (  # noqa: E402
    BACKWARD, FORWARD, GRAD, INPUT, PARAM, RESULT, TANGENT, VALUE, Header, Node, Output, Program,
    Ref, Seq, Value, contiguous_stride,
)
from remat_ir.optimize.flat import highest_apart  # noqa: E402
from remat_ir.optimize.search import Infeasible, floor, optimize, resolve_budget, unoptimized_peak  # noqa: E402
from remat_ir.ir.schedule import default_schedule  # noqa: E402
from remat_ir.check.simulate import simulate  # noqa: E402
from remat_ir.check.verify import verify  # noqa: E402

SCOPES = ("total", "activations")


# ------------------------------------------------------------------ helpers


def stacked_program(n_blocks: int = 4, batch: int = 8, d: int = 16, h: int = 32) -> Program:
    """A residual MLP, `n_blocks` identical blocks (modules `blocks.i.*`):
    x' = x + relu(x @ W1) @ W2, loss = sum(x_n), with its backward graph."""
    values: list[Value] = []
    nodes: list[Node] = []

    def val(name, kind, shape, view_of=None, rg=False, stride=None):
        stride = contiguous_stride(shape) if stride is None else stride
        nbytes = 4
        for s in shape:
            nbytes *= s
        values.append(Value(name=name, kind=kind, dtype="float32", shape=list(shape), stride=stride,
                            storage=view_of or name, nbytes=0 if view_of else nbytes,
                            source=name if kind in (INPUT, PARAM) else "", requires_grad=rg))
        return name

    def node(name, op, ins, outs, phase, module, flops, extra=()):
        nodes.append(Node(name=name, op=op, args=[Ref(i) for i in ins] + list(extra), kwargs={}, outputs=outs,
                          phase=phase, module=module, flops=float(flops)))

    def transpose(name, of, module):  # a transpose, a view of the 2-D contiguous `of`
        rows, cols = next(v.shape for v in values if v.name == of)
        val(name, VALUE, [cols, rows], view_of=of, stride=[1, cols])
        node(name, "aten.t.default", [of], [name], BACKWARD, module, 0)
        return name

    x = val("x", INPUT, [batch, d])
    ws = []
    for i in range(n_blocks):
        ws.append((val(f"blocks.{i}.fc1.weight", PARAM, [d, h], rg=True),
                   val(f"blocks.{i}.fc2.weight", PARAM, [h, d], rg=True)))
    xs = [x]
    saved = []
    for i, (w1, w2) in enumerate(ws):
        m = f"blocks.{i}"
        a = val(f"{m}.fc1.mm", VALUE, [batch, h])
        node(a, "aten.mm.default", [xs[-1], w1], [a], FORWARD, f"{m}.fc1", 2 * batch * d * h)
        r = val(f"{m}.act.relu", VALUE, [batch, h])
        node(r, "aten.relu.default", [a], [r], FORWARD, f"{m}.act", batch * h)
        o = val(f"{m}.fc2.mm", VALUE, [batch, d])
        node(o, "aten.mm.default", [r, w2], [o], FORWARD, f"{m}.fc2", 2 * batch * h * d)
        y = val(f"{m}.add", VALUE, [batch, d])
        node(y, "aten.add.Tensor", [xs[-1], o], [y], FORWARD, m, batch * d)
        saved.append((xs[-1], r))
        xs.append(y)
    loss = val("sum", VALUE, [])
    node(loss, "aten.sum.default", [xs[-1]], [loss], FORWARD, "", batch * d)
    t = val("d.sum", TANGENT, [])
    g = val("d.expand", VALUE, [batch, d], view_of=t, stride=[0, 0])
    node(g, "aten.expand.default", [t], [g], BACKWARD, "", 0, extra=[Seq([batch, d])])
    outputs = [Output(RESULT, "0", loss)]
    for i in reversed(range(n_blocks)):
        m = f"d.blocks.{i}"
        w1, w2 = ws[i]
        xin, r = saved[i]
        rt = transpose(f"{m}.fc2.rt", r, f"blocks.{i}.fc2")
        dw2 = val(f"{m}.fc2.dw", VALUE, [h, d])
        node(dw2, "aten.mm.default", [rt, g], [dw2], BACKWARD, f"blocks.{i}.fc2", 2 * batch * h * d)
        w2t = transpose(f"{m}.fc2.wt", w2, f"blocks.{i}.fc2")
        dr = val(f"{m}.fc2.dx", VALUE, [batch, h])
        node(dr, "aten.mm.default", [g, w2t], [dr], BACKWARD, f"blocks.{i}.fc2", 2 * batch * h * d)
        da = val(f"{m}.act.relu_backward", VALUE, [batch, h])
        node(da, "aten.threshold_backward.default", [dr, r], [da], BACKWARD, f"blocks.{i}.act", batch * h,
             extra=[0])
        xt = transpose(f"{m}.fc1.xt", xin, f"blocks.{i}.fc1")
        dw1 = val(f"{m}.fc1.dw", VALUE, [d, h])
        node(dw1, "aten.mm.default", [xt, da], [dw1], BACKWARD, f"blocks.{i}.fc1", 2 * batch * d * h)
        w1t = transpose(f"{m}.fc1.wt", w1, f"blocks.{i}.fc1")
        dx = val(f"{m}.fc1.dx", VALUE, [batch, d])
        node(dx, "aten.mm.default", [da, w1t], [dx], BACKWARD, f"blocks.{i}.fc1", 2 * batch * d * h)
        g2 = val(f"{m}.add", VALUE, [batch, d])
        node(g2, "aten.add.Tensor", [g, dx], [g2], BACKWARD, f"blocks.{i}", batch * d)
        outputs += [Output(GRAD, w1, dw1), Output(GRAD, w2, dw2)]
        g = g2
    p = Program(header=Header(model="stacked", has_loss=True), values=values, nodes=nodes,
                forward=[], backward=[], outputs=outputs)
    p.forward, p.backward = default_schedule(p)
    return p


def peaks(program: Program, scope: str) -> int:
    return max(simulate(program, grads_present=g).scope_peak(scope) for g in (True, False))


def check_plan(result, program: Program, budget: int, scope: str) -> None:
    out = result.program
    assert out.values == program.values and out.nodes == program.nodes
    assert out.outputs == program.outputs
    assert out.header.budget is not None and out.header.budget.bytes == budget
    assert out.header.budget.scope == scope
    real = peaks(out, scope)
    assert real <= budget, f"simulated peak {real} > budget {budget}"
    assert result.predicted_peak == real
    v = verify(out)
    assert v.ok, str(v)
    recomputed = sum(n.flops for n in out.nodes
                     if any(i.kind == "recompute" and i.target == n.name for i in out.backward))
    counts = {}
    for i in out.backward:
        if i.kind == "recompute":
            counts[i.target] = counts.get(i.target, 0) + 1
    nm = out.node_map()
    assert result.extra_cost == pytest.approx(sum(nm[k].flops * c for k, c in counts.items()))
    assert recomputed <= result.extra_cost + 1e-6
    assert result.base_cost == pytest.approx(sum(n.flops for n in program.nodes))


def brute_force(program: Program, scope: str):
    """(peak, recompute cost) of every plan of the family, by building and simulating it."""
    a = Analysis(program, scope)
    dec = a.decisions()
    out = []
    for bits in itertools.product((0, 1), repeat=len(dec)):
        keep = a.keep_of({d for d, b in zip(dec, bits) if b})
        peak, _ = simulated_peak(apply_plan(a, keep), scope)
        out.append((peak, a.recompute_cost(keep)))
    return out


def tiny_programs(n: int):
    """Random programs with 2..8 decisions (at most 256 plans)."""
    got, seed = [], 0
    while len(got) < n:
        p = random_program(seed, n_forward=4 + seed % 6)
        seed += 1
        d = len(Analysis(p, "total").decisions())
        if 2 <= d <= 8:
            got.append((seed - 1, p))
    return got


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("seed,program", tiny_programs(12), ids=lambda x: str(x) if isinstance(x, int) else "")
def test_floor_and_cost_match_brute_force(seed, program):
    for scope in SCOPES:
        plans = brute_force(program, scope)
        best = min(p for p, _ in plans)
        assert floor(program, scope=scope, decompose=False).predicted_peak == best
        distinct = sorted({p for p, _ in plans})
        for budget in distinct[:3] + [distinct[len(distinct) // 2]]:
            want = min(f for p, f in plans if p <= budget)
            r = optimize(program, budget, scope=scope, decompose=False)
            assert r.extra_cost == pytest.approx(want, rel=1e-9, abs=1e-9), (scope, budget)
            check_plan(r, program, budget, scope)
        with pytest.raises(Infeasible) as e:
            optimize(program, best - 1, scope=scope, decompose=False)
        assert e.value.floor_bytes == best


def test_model_equals_simulator_on_every_plan():
    """The MILP's memory model, evaluated directly, is the simulator's peak."""
    for _, program in tiny_programs(6):
        for scope in SCOPES:
            a = Analysis(program, scope)
            dec = a.decisions()
            for bits in itertools.product((0, 1), repeat=len(dec)):
                keep = a.keep_of({d for d, b in zip(dec, bits) if b})
                assert model_peak(a, keep) == simulated_peak(apply_plan(a, keep), scope)[0]


def test_model_with_some_rows_is_exact_at_those_rows():
    """Built with a subset of its memory rows (the lazy search), the MILP
    states the recompute rule only at the stages those rows read.  At a
    plan, its least peak over rows after backward nodes is still the
    simulator's bytes there (when above what no plan changes)."""
    import random

    from remat_ir.optimize.family import occupancy
    from remat_ir.optimize.milp import KeepModel, quiet_stdout

    rng = random.Random(0)
    checked = 0
    for seed in range(30):
        program = random_program(seed, n_forward=10 + seed % 8)
        for scope in SCOPES:
            a = Analysis(program, scope)
            dec = a.decisions()
            for _ in range(8):
                bits = [rng.randint(0, 1) for _ in dec]
                keep = a.keep_of({d for d, b in zip(dec, bits) if b})
                exact = KeepModel(a).build().rows_over(occupancy(a, keep, range(len(a.storages))), -1.0)
                after = sorted(r for r in exact if r[0] == "b")
                if len(after) < 2:
                    continue
                active = set(rng.sample(after, rng.randint(1, min(4, len(after) - 1))))
                m = KeepModel(a, fixed=dict(zip(dec, bits))).build(active)
                top = max(exact[r] for r in active)
                if top <= m.const_mem:
                    continue
                c = m.compile("peak")
                with quiet_stdout():
                    c.problem.solve(solver="HIGHS")
                assert c.B.value == pytest.approx(top, abs=0.5), (seed, scope, bits, sorted(active))
                checked += 1
    assert checked > 50


def test_stacked_flat_matches_brute_force():
    p = stacked_program(3)
    for scope in SCOPES:
        plans = brute_force(p, scope)
        best = min(x for x, _ in plans)
        assert floor(p, scope=scope, decompose=False).predicted_peak == best
        mid = sorted({x for x, _ in plans})[len(plans) and len({x for x, _ in plans}) // 3]
        r = optimize(p, mid, scope=scope, decompose=False)
        assert r.extra_cost == pytest.approx(min(f for x, f in plans if x <= mid))
        check_plan(r, p, mid, scope)


# ------------------------------------------------------------------ decomposition


@pytest.fixture(scope="module")
def stacked12():
    return stacked_program(12)


def test_decomposed_plans_fit(stacked12):
    p = stacked12
    for scope in SCOPES:
        top = unoptimized_peak(p, scope)
        f = floor(p, scope=scope, decompose=True).predicted_peak
        assert f <= top
        for frac in (0.9, 0.7, 0.5):
            budget = int(top * frac)
            if budget < f:
                with pytest.raises(Infeasible) as e:
                    optimize(p, budget, scope=scope, decompose=True)
                assert e.value.floor_bytes == f
                continue
            r = optimize(p, budget, scope=scope, decompose=True)
            assert r.mode in ("decomposed", "none")
            check_plan(r, p, budget, scope)
            assert all(s.status for s in r.solves)
        r = optimize(p, f, scope=scope, decompose=True)
        check_plan(r, p, f, scope)


def test_flat_search_below_the_decomposed_floor(stacked12):
    """Where the decomposed search (which keeps every block input) cannot go,
    the flat MILP does, given the work: its floor is lower, and budgets
    between the two get a plan.  (Within its default work limits the flat
    floor search of this chain hands it to the block search.)"""
    p = stacked12
    scope = "activations"
    unlimited = dict(flat_work=10**15, flat_max_rows=10**9, flat_round_work=10**15)
    f_dec = floor(p, scope=scope, decompose=True).predicted_peak
    f = floor(p, scope=scope, time_limit=30, **unlimited).predicted_peak
    assert f < f_dec  # a chain of 12: the flat MILP drops some block inputs
    budget = (f + f_dec) // 2
    r = optimize(p, budget, scope=scope, time_limit=30, **unlimited)
    assert r.mode == "flat"
    check_plan(r, p, budget, scope)


def test_combine_milp_when_not_a_chain(stacked12):
    """The general combine (a MILP over per-segment options, used when
    backward does not visit the segments in reverse order) gives a plan that
    fits too."""
    from remat_ir.optimize.search import Settings
    p = stacked_program(12)
    budget = int(unoptimized_peak(p, "activations") * 0.7)
    milp = optimize(p, budget, Settings.of("fast", combine="milp", decompose=True), scope="activations")
    check_plan(milp, p, budget, "activations")
    assert any(s.kind == "combine" and s.method == "MILP" for s in milp.solves)


def test_decomposition_finds_repeated_blocks(stacked12):
    from remat_ir.optimize.blocks import segments

    a = Analysis(stacked12, "activations")
    segs, fixed = segments(a)
    sigs = {s.signature for s in segs}
    assert len(segs) == 12 and len(sigs) <= 3  # first, middle (x10), last
    assert fixed  # the block inputs are the checkpoints


def test_large_block_is_cut_along_its_sub_blocks(monkeypatch):
    """A block with more than SPLIT_DECISIONS decisions (T5's decoder block:
    118 of its 203) is cut along the list inside it (`outer.0.blocks.i`);
    its sub-blocks are then found repeated like blocks.  At or under the
    limit the block stays whole."""
    import remat_ir.optimize.blocks as blocks

    p = stacked_program(6)
    for n in p.nodes:  # one outer block `outer.0` holding the list `blocks`
        if n.module.startswith("blocks."):
            n.module = "outer.0." + n.module
    a = Analysis(p, "activations")
    n_dec = blocks._n_decisions(a, [i for i, n in enumerate(a.fwd) if n.module.startswith("outer.0")])
    monkeypatch.setattr(blocks, "SPLIT_DECISIONS", n_dec)
    segs, _ = blocks.segments(a)
    assert len([s for s in segs if s.decisions]) == 1
    monkeypatch.setattr(blocks, "SPLIT_DECISIONS", n_dec - 1)
    segs, fixed = blocks.segments(a)
    assert len(segs) == 6 and len({s.signature for s in segs}) <= 3
    assert all(s.name.startswith(f"outer.0.blocks.{i}") for i, s in enumerate(segs))
    assert fixed
    assert blocks.sub_key("decoder.block.0.layer.1.EncDecAttention.k", "decoder.block.0") == "decoder.block.0.layer.1"
    assert blocks.sub_key("decoder.block.0.final_norm", "decoder.block.0") is None
    assert blocks.sub_key("decoder.block.10.layer.1", "decoder.block.1") is None


def test_decomposed_quality_vs_flat():
    """On a graph small enough for the flat MILP, the decomposed plan costs
    at most a little more (and never less: the flat MILP is exact)."""
    p = stacked_program(5)
    scope = "activations"
    top = unoptimized_peak(p, scope)
    for frac in (0.8, 0.6):
        budget = int(top * frac)
        try:
            flat = optimize(p, budget, scope=scope, decompose=False)
        except Infeasible:
            continue
        dec = optimize(p, budget, scope=scope, decompose=True)
        check_plan(dec, p, budget, scope)
        assert dec.extra_cost >= flat.extra_cost - 1e-6
        assert dec.extra_cost <= 2 * flat.extra_cost + 0.05 * flat.base_cost


def test_refinement_window_reaches_the_flat_optimum_on_two_segments():
    """With two segments one refinement window holds every decision: the
    decomposed search then ends with the exact MILP (warm-started from its
    own plan), so it matches a proven flat optimum."""
    p = stacked_program(2)
    scope = "activations"
    top = unoptimized_peak(p, scope)
    compared = 0
    for frac in (0.8, 0.65, 0.5):
        budget = int(top * frac)
        try:
            flat = optimize(p, budget, scope=scope, decompose=False)
        except Infeasible:
            continue
        if flat.mode == "none" or flat.solves[-1].status != "optimal":
            continue
        dec = optimize(p, budget, scope=scope, decompose=True)
        check_plan(dec, p, budget, scope)
        assert dec.mode == "decomposed"
        assert any(rec.kind == "window" for rec in dec.solves)
        assert dec.extra_cost == pytest.approx(flat.extra_cost, rel=1e-9, abs=1e-6)
        compared += 1
    assert compared


# ------------------------------------------------------------------ infeasible


def test_infeasible_message_names_parameters():
    p = stacked_program(2)
    base = simulate(p, grads_present=True).baseline_bytes
    with pytest.raises(Infeasible) as e:
        optimize(p, base // 2, scope="total")
    msg = str(e.value)
    assert "parameters" in msg and "gradients" in msg and "exceed" in msg
    assert e.value.floor_bytes == floor(p, scope="total").predicted_peak


def test_infeasible_message_names_the_peak():
    p = stacked_program(2)
    f = floor(p, scope="activations").predicted_peak
    with pytest.raises(Infeasible) as e:
        optimize(p, f - 1, scope="activations")
    assert "smallest activation peak" in str(e.value) and e.value.floor_bytes == f


# ------------------------------------------------------------------ properties


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(min_forward=2, max_forward=12), st.floats(0.2, 1.05), st.sampled_from(SCOPES))
def test_random_programs_fit_or_infeasible(program, frac, scope):
    budget = int(unoptimized_peak(program, scope) * frac)
    try:
        r = optimize(program, budget, scope=scope, time_limit=20)
    except Infeasible as e:
        assert e.floor_bytes > budget
        assert e.floor_bytes == floor(program, scope=scope, time_limit=20).predicted_peak
        return
    check_plan(r, program, budget, scope)


def test_keep_all_fits_means_no_recompute():
    p = stacked_program(3)
    top = unoptimized_peak(p, "total")
    r = optimize(p, top, scope="total")
    assert r.extra_cost == 0 and r.mode == "none"
    check_plan(r, p, top, "total")


def test_time_limit_still_returns_a_plan(stacked12):
    p = stacked12
    budget = int(unoptimized_peak(p, "activations") * 0.8)
    r = optimize(p, budget, scope="activations", time_limit=1.0)
    check_plan(r, p, budget, "activations")


# ------------------------------------------------------------------ budgets


def test_resolve_budget():
    p = stacked_program(2)
    top = unoptimized_peak(p, "activations")
    assert resolve_budget(p, "123456", "activations") == 123456
    assert resolve_budget(p, "800MB") == 800_000_000
    assert resolve_budget(p, "1.5GiB") == int(1.5 * (1 << 30))
    assert resolve_budget(p, "2 KiB") == 2048
    assert resolve_budget(p, "1e6") == 1_000_000
    assert resolve_budget(p, "0.5", "activations") == round(0.5 * top)
    assert resolve_budget(p, "50%", "activations") == round(0.5 * top)
    assert resolve_budget(p, 0.25, "activations") == round(0.25 * top)
    with pytest.raises(ValueError):
        resolve_budget(p, "lots")
    with pytest.raises(ValueError):
        resolve_budget(p, "3 parsecs")


def test_unknown_solver():
    with pytest.raises(ValueError, match="not installed"):
        optimize(stacked_program(2), 10 ** 9, solver="NOSUCH")


# ------------------------------------------------------------------ traced model


@pytest.fixture(scope="module")
def gpt2_tiny():
    from remat_ir.pipeline import trace_builtin

    return trace_builtin("gpt2-tiny", fake=True)


def test_gpt2_tiny(gpt2_tiny):
    p = gpt2_tiny
    scope = "activations"
    top = unoptimized_peak(p, scope)
    f = floor(p, scope=scope, time_limit=30).predicted_peak
    for frac in (0.8, 0.6):
        budget = int(top * frac)
        if budget < f:
            continue
        r = optimize(p, budget, scope=scope, time_limit=30)
        check_plan(r, p, budget, scope)
        # dropout masks are updated in place: never recomputed
        for ins in r.program.backward:
            if ins.kind == "recompute":
                assert not p.node_map()[ins.target].mutates


@pytest.mark.skipif("SCIPY" not in __import__("remat_ir.optimize.milp", fromlist=["x"]).installed_solvers(),
                    reason="scipy MILP backend not installed")
def test_other_solver_same_optimum():
    for _, program in tiny_programs(4):
        scope = "activations"
        f = floor(program, scope=scope, decompose=False).predicted_peak
        a = optimize(program, f, scope=scope, decompose=False)
        b = optimize(program, f, scope=scope, decompose=False, solver="SCIPY")
        assert b.extra_cost == pytest.approx(a.extra_cost)
        check_plan(b, program, f, scope)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
@given(programs(min_forward=3, max_forward=10), st.integers(0, 1000), st.sampled_from(SCOPES))
def test_brute_force_property(program, pick, scope):
    from hypothesis import assume

    assume(1 <= len(Analysis(program, scope).decisions()) <= 7)
    plans = brute_force(program, scope)
    best = min(p for p, _ in plans)
    assert floor(program, scope=scope, decompose=False).predicted_peak == best
    distinct = sorted({p for p, _ in plans})
    budget = distinct[pick % len(distinct)]
    r = optimize(program, budget, scope=scope, decompose=False)
    assert r.extra_cost == pytest.approx(min(f for p, f in plans if p <= budget), rel=1e-9, abs=1e-9)
    check_plan(r, program, budget, scope)


def test_node_pinned_by_a_result_view_is_kept():
    """A node that no plan can drop (a forward result views one of its
    outputs) but that has an activation output is kept by every plan: the
    family once freed its pinned output in forward and read it in backward."""
    from remat_ir.ir.files import load_plan

    program = load_plan(Path(__file__).parent / "plans" / "pinned-result-view.rir")
    for scope in SCOPES:
        plans = brute_force(program, scope)
        best = min(p for p, _ in plans)
        assert floor(program, scope=scope, decompose=False).predicted_peak == best
        for budget in sorted({p for p, _ in plans}):
            r = optimize(program, budget, scope=scope, decompose=False)
            assert r.extra_cost == pytest.approx(min(f for p, f in plans if p <= budget))
            check_plan(r, program, budget, scope)


def _busy():
    while True:
        pass


def _gpt2_tiny():
    from remat_ir.pipeline import trace_builtin

    return trace_builtin("gpt2-tiny", fake=True)


@pytest.mark.parametrize("case", ["gpt2-tiny, default search", "stacked12, decomposed, effort full"])
def test_the_same_plan_on_a_loaded_machine(case):
    """The default search on a small graph (the flat MILP, rows added as
    plans break them, solved to optimality) and effort "full" on a
    decomposed one bound every MILP by counts, never by time: a cold solve on
    an idle machine and one beside two busy loops (one per core) print the
    same plan."""
    import multiprocessing

    from remat_ir.ir.printer import format_program

    if case.startswith("gpt2-tiny"):
        make, frac, kw = _gpt2_tiny, 0.5, {}
    else:
        make, frac, kw = (lambda: stacked_program(12)), 0.6, dict(effort="full", decompose=True)
    p = make()
    budget = int(unoptimized_peak(p, "activations") * frac)
    plans = []
    for loaded in (False, True):
        procs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(2 if loaded else 0)]
        for q in procs:
            q.start()
        try:
            r = optimize(p, budget, scope="activations", **kw)
        finally:
            for q in procs:
                q.kill()
                q.join()
        check_plan(r, p, budget, "activations")
        assert not r.time_limited
        plans.append(format_program(r.program))
    assert plans[0] == plans[1]


@pytest.mark.parametrize("decompose", [False, None])
def test_time_limit_without_a_solution_is_not_a_plan(decompose):
    """A MILP stopped before any incumbent reports values that are not a plan:
    the optimizer must refuse (Infeasible) rather than return them."""
    p = stacked_program(12)
    budget = int(unoptimized_peak(p, "activations") * 0.5)
    for tl in (0.01, 0.2):
        try:
            r = optimize(p, budget, scope="activations", time_limit=tl, decompose=decompose)
        except Infeasible as e:
            assert e.floor_bytes > budget
            continue
        check_plan(r, p, budget, "activations")


def test_a_refusal_says_whether_the_time_limit_cut_it_short():
    """Below the floor, `Infeasible.time_limited` says whether the floor it
    names is only the best a search cut short found (the search's and the
    rewrite ladder's refusals alike).  Block by block, the search looks at
    its deadline before each block's first MILP: a deadline already past
    cuts it short however fast the machine."""
    from remat_ir.optimize import ladder

    p = stacked_program(6)
    for strategy in (optimize, ladder.optimize):
        for tl, cut in ((1e-6, True), (300, False)):
            with pytest.raises(Infeasible) as e:
                strategy(p, 1000, scope="activations", time_limit=tl, decompose=True)
            assert e.value.time_limited is cut and ("time limit" in str(e.value)) is cut


def test_a_budget_round_takes_its_rows_apart_then_the_highest_of_the_rest():
    over = {("b", 10): 900, ("q", 11, 0): 899, ("b", 11): 898, ("q", 12, 3): 897,  # one peak
            ("b", 20): 800, ("f", 5): 700, ("f", 6): 699, ("b", 30): 600}
    assert highest_apart(set(over), over, 4, 2) == {("b", 10), ("b", 20), ("f", 5), ("b", 30)}
    # Fewer places than rows: the highest of the rest fill the round.
    few = {k: over[k] for k in (("b", 10), ("q", 11, 0), ("b", 11), ("q", 12, 3))}
    assert highest_apart(set(few), few, 3, 2) == {("b", 10), ("q", 11, 0), ("b", 11)}
    assert highest_apart(set(over), over, 0, 2) == set()


def test_every_backend_a_plan_is_made_with_stops_at_a_node_limit():
    from remat_ir.optimize.milp import NODE_LIMITED, solver_options

    assert solver_options("HIGHS", 5, nodes=7)["mip_max_nodes"] == 7
    assert solver_options("SCIP", 5, nodes=7)["scip_params"]["limits/nodes"] == 7
    assert solver_options("CBC", 5, nodes=7)["maximumNodes"] == 7
    assert solver_options("SCIPY", 5, nodes=7)["scipy_options"]["node_limit"] == 7
    assert "GLPK_MI" not in NODE_LIMITED
    with pytest.raises(ValueError, match="no node limit"):
        solver_options("GLPK_MI", 5, nodes=7)


def test_a_backend_without_a_node_limit_is_refused():
    from remat_ir import pipeline
    from remat_ir.optimize.search import Settings

    for make in (lambda: Settings(solver="GLPK_MI"), lambda: pipeline.optimizer_settings("GLPK_MI", "fast", 60.0),
                 lambda: optimize(stacked_program(2), 10 ** 9, solver="glpk_mi")):
        with pytest.raises(ValueError, match="GLPK_MI has no node limit.*use one of HIGHS"):
            make()
