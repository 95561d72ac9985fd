"""The optimizer chooses offloads (docs/02-optimizer.md#offload): offload-only
decision nodes in the plan family, whose exact memory model equals the
simulator on every plan; the ladder's offload rungs below the recompute-only
floor; the entry points (`fit`, `compile`, `wrap`, `remat-compile`); plans
that run bitwise as eager with the device and host pools as predicted; and
plans without offload exactly as before."""
from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from programs import programs, random_program  # noqa: E402

from remat_ir.check.simulate import simulate  # noqa: E402
from remat_ir.check.verify import verify  # noqa: E402
from remat_ir.ir import OFFLOAD, RECOMPUTE, RELOAD, TRANSFER_INSTRS, WAIT  # noqa: E402
from remat_ir.ir.costs import copy_cost, offload_cost, overhead, transfer_cost  # noqa: E402
from remat_ir.ir.parser import parse_program  # noqa: E402
from remat_ir.ir.printer import format_program  # noqa: E402
from remat_ir.optimize.family import (  # noqa: E402
    Analysis, apply_plan, model_peak, offload_candidates, offload_refused, simulated_peak,
)
from remat_ir.optimize.search import Infeasible  # noqa: E402

SCOPES = ("total", "activations")


def offloadable(a: Analysis) -> list[int]:
    return [i for i in a.decisions() if not offload_refused(a, i)]


def check_lowered(a: Analysis, keep: list[bool], scope: str) -> None:
    """The plan `keep` of `a`, lowered: the model's peak is the simulator's,
    it verifies, no offload-only node is recomputed, every copy comes back,
    the host holds every offloaded storage at the start of backward, and the
    copies and recomputes cost what the optimizer says."""
    plan = apply_plan(a, keep)
    assert model_peak(a, keep) == simulated_peak(plan, scope)[0]
    text = parse_program(format_program(plan), "plan.rir")
    v = verify(text)
    assert v.ok, str(v)
    off = {a.fwd[i].name for i in a.offload}
    assert not any(i.kind == RECOMPUTE and i.target in off for i in plan.backward)
    sent = [i.target for i in plan.forward if i.kind == OFFLOAD]
    assert sorted(sent) == sorted(i.target for i in plan.backward if i.kind == RELOAD)
    assert sum(i.kind == WAIT for i in plan.forward + plan.backward) == 2 * len(sent)
    values = plan.value_map()
    assert v.report.host_peak_bytes == sum(values[s].nbytes for s in sent)
    extra, _ = overhead(plan)
    assert extra == pytest.approx(a.recompute_cost(keep), rel=1e-12, abs=1e-9)


# ------------------------------------------------------------------ the model


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(min_forward=3, max_forward=14), st.randoms(use_true_random=False), st.sampled_from(SCOPES))
def test_model_equals_simulator_with_random_offloads(program, rnd, scope):
    """Random offload-only sets and random keep/drop choices: the exact
    model's peak is the simulated one, and the lowered plan is sound."""
    base = Analysis(program, scope)
    off = {base.fwd[i].name for i in offloadable(base) if rnd.random() < 0.6}
    a = Analysis(program, scope, off)
    dec = a.decisions()
    for _ in range(4):
        check_lowered(a, a.keep_of({d for d in dec if rnd.random() < 0.5}), scope)


@pytest.mark.slow
def test_every_plan_of_small_programs_with_offloads():
    """Every keep/drop choice of small programs, every node offloadable
    offload-only (and half of them): the model is the simulator."""
    checked = 0
    for seed in range(40):
        program = random_program(seed, n_forward=4 + seed % 7)
        for scope in SCOPES:
            base = Analysis(program, scope)
            cands = offloadable(base)
            for off in ({base.fwd[i].name for i in cands}, {base.fwd[i].name for i in cands[::2]}):
                a = Analysis(program, scope, off)
                dec = a.decisions()
                if len(dec) > 7:
                    continue
                for bits in itertools.product((0, 1), repeat=len(dec)):
                    check_lowered(a, a.keep_of({d for d, b in zip(dec, bits) if b}), scope)
                    checked += 1
    assert checked > 500


@pytest.mark.slow
def test_the_search_is_exact_with_offloads():
    """On small programs the flat MILP's floor and cheapest plans equal a
    brute force over every plan of the family with offload-only nodes."""
    from remat_ir.optimize.problem import Problem
    from remat_ir.optimize.search import floor, optimize

    tried = 0
    for seed in range(60):
        program = random_program(seed, n_forward=5 + seed % 6)
        base = Analysis(program, "activations")
        cands = offloadable(base)
        if not cands:
            continue
        off = {base.fwd[i].name for i in cands[::2]}
        a = Analysis(program, "activations", off)
        dec = a.decisions()
        if not 2 <= len(dec) <= 7:
            continue
        plans = []
        for bits in itertools.product((0, 1), repeat=len(dec)):
            keep = a.keep_of({d for d, b in zip(dec, bits) if b})
            plans.append((simulated_peak(apply_plan(a, keep), "activations")[0], a.recompute_cost(keep)))
        problem = Problem.of(program, "activations", offload=off)
        least = min(p for p, _ in plans)
        assert floor(problem, decompose=False).predicted_peak == least
        for budget in sorted({p for p, _ in plans})[:3]:
            r = optimize(Problem.of(program, "activations", offload=off), budget, decompose=False)
            assert r.extra_cost == pytest.approx(min(c for p, c in plans if p <= budget), rel=1e-6, abs=1e-6)
            assert r.predicted_peak <= budget and verify(r.program).ok
        with pytest.raises(Infeasible):
            optimize(Problem.of(program, "activations", offload=off), least - 1, decompose=False)
        tried += 1
    assert tried >= 10


def test_what_cannot_be_offloaded_is_refused_by_name():
    program = random_program(3, n_forward=10)
    a = Analysis(program, "total")
    views = [n.name for i, n in enumerate(a.fwd) if a.kind[i] == "view"]
    with pytest.raises(ValueError, match="cannot be offloaded: no forward node"):
        Analysis(program, "total", {"no such node"})
    if views:
        with pytest.raises(ValueError, match="makes views"):
            Analysis(program, "total", {views[0]})


def test_the_copy_cost_model():
    """A copy is bytes over bandwidth plus latency: in microseconds under
    the profile cost model, times the device's throughput under FLOPs; an
    offload overlapped by enough forward compute costs only its reload."""
    assert copy_cost(10_000, "cpu", "profile") == pytest.approx(10_000 / 10e9 * 1e6 + 1.0)
    assert copy_cost(10_000, "cpu", "flops") == pytest.approx((10_000 / 10e9 + 1e-6) * 100e9)
    assert copy_cost(10_000, "cuda:1", "flops") == pytest.approx((10_000 / 25e9 + 10e-6) * 200e12)
    c = copy_cost(10_000, "cpu", "flops")
    assert offload_cost(10_000, 0.0, "cpu", "flops") == pytest.approx(2 * c)
    assert offload_cost(10_000, c / 4, "cpu", "flops") == pytest.approx(c + 0.75 * c)
    assert offload_cost(10_000, 10 * c, "cpu", "flops") == pytest.approx(c)


# ------------------------------------------------------------------ gpt2-tiny


@pytest.fixture(scope="module")
def gpt2_tiny():
    """gpt2-tiny traced, its recompute-only floor and its offload floor
    (exact: no rewrite but the bitwise chunked loss), and a budget between them."""
    from remat_ir.optimize import ladder
    from remat_ir.pipeline import trace_builtin

    program = trace_builtin("gpt2-tiny")
    recompute = ladder.floor(program, scope="activations", exact=True).predicted_peak
    offloading = ladder.floor(program, scope="activations", exact=True, offload=True)
    assert offloading.predicted_peak < recompute
    return program, recompute, offloading, (recompute + offloading.predicted_peak) // 2


@pytest.mark.slow
def test_a_budget_below_the_recompute_floor_is_met_with_offload(gpt2_tiny):
    from remat_ir.pipeline import fit
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import run_plan

    program, recompute, offloading, budget = gpt2_tiny
    with pytest.raises(Infeasible):
        fit(program, budget, exact=True)
    plan = fit(program, budget, exact=True, offload=True)
    r = simulate(plan)
    assert r.offloads > 0 and r.activation_peak_bytes <= budget
    # (exact: only rewrites that keep eager's bits, the one chunked loss)
    assert all(r.startswith("lm_head_nll") for r in plan.header.rewrites) and plan.header.host_budget is None
    assert any(c.startswith("offload rung ") and "offload:" in c for c in plan.header.comment)
    # The floor plan of the offload rungs: every decision offload-only reaches
    # what every plan holds (the forward pass at its ASAP frees, each backward read).
    assert offloading.predicted_peak == Analysis(offloading.program, "activations").peak_lower_bound()
    # Run: every step's gradients bitwise eager's, both pools as predicted.
    run = run_plan(plan, load_model("gpt2-tiny"), steps=3, check=True, check_model=False)
    assert run.grads_bitwise and run.loss_bitwise and len(run.checks) == 3
    assert 0 <= run.measured_peak - run.predicted.peak_bytes <= 4
    assert 0 <= run.measured_first_peak - run.predicted_first.peak_bytes <= 4
    assert run.measured_host_peak == run.predicted.host_peak_bytes == r.host_peak_bytes > 0
    # What the plan says the copies cost is what the optimizer counted.
    assert transfer_cost(plan) > 0


@pytest.mark.slow
def test_a_host_budget_bounds_the_offload_rungs(gpt2_tiny):
    from remat_ir.pipeline import BudgetError, fit

    program, _, _, budget = gpt2_tiny
    plan = fit(program, budget, exact=True, offload=True)
    host = simulate(plan).host_peak_bytes
    same = fit(program, budget, exact=True, offload=True, host_budget=host)
    assert same.header.host_budget == host and verify(same).ok
    assert f"host_budget {host} bytes" in format_program(same)
    with pytest.raises(Infeasible, match="host budget"):
        fit(program, budget, exact=True, offload=True, host_budget=1024)
    with pytest.raises(ValueError, match="offload=True"):
        fit(program, budget, host_budget="1GiB")
    with pytest.raises(BudgetError, match="fraction"):
        fit(program, budget, offload=True, host_budget=0.5)


@pytest.mark.slow
def test_without_offload_plans_are_as_before(gpt2_tiny):
    """A budget recomputation alone meets: the same plan text with offload
    asked or not (the offload rungs are tried only below that floor), and no
    copy in it."""
    from remat_ir.optimize.ladder import LadderMemo, _Ladder
    from remat_ir.optimize.search import settings_of
    from remat_ir.pipeline import fit

    program, recompute, _, _ = gpt2_tiny
    budget = recompute + 64 * 1024
    plain = fit(program, budget)
    assert format_program(fit(program, budget, offload=True)) == format_program(plain)
    assert not any(i.kind in TRANSFER_INSTRS for i in plain.forward + plain.backward)
    assert "host_budget" not in format_program(plain)
    lad = _Ladder(program, "activations", settings_of(), LadderMemo(), False, None)
    assert lad.steps() == lad.rewrite_steps() and not any("offload" in s for r in lad.steps() for s in r)


@pytest.mark.slow
def test_offload_rungs_least_change_first(gpt2_tiny):
    """The heavy rung takes the matmuls (their copies cost less than their
    recompute), the all rung every decision; the heavy rung is used where it fits."""
    from remat_ir.pipeline import fit

    program, recompute, offloading, _ = gpt2_tiny
    a = Analysis(program, "activations")
    heavy, every = offload_candidates(a, "heavy"), offload_candidates(a, "all")
    assert heavy < every
    assert {a.fwd[a.fidx[n]].op for n in heavy} <= {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
    plan = fit(program, recompute - 1, exact=True, offload=True)
    assert any("offload:heavy" in c for c in plan.header.comment)
    assert {i.target for i in plan.forward if i.kind == OFFLOAD} <= {o for n in heavy
                                                                    for o in program.node_map()[n].outputs}


@pytest.mark.slow
def test_remat_compile_offload(tmp_path, capsys, gpt2_tiny):
    from remat_ir.cli.commands import compile_main, run_main
    from remat_ir.ir.files import load_plan

    program, _, _, budget = gpt2_tiny
    out = tmp_path / "t.rir"
    assert compile_main(["gpt2-tiny", "-o", str(out), "--budget", str(budget), "--exact", "--offload",
                         "--host-budget", "64MiB"]) == 0
    text = capsys.readouterr().out
    assert "offloaded to the host:" in text and "the copies cost" in text
    plan = load_plan(out)
    assert plan.header.host_budget == 64 * 2 ** 20 and simulate(plan).offloads > 0
    assert run_main([str(out), "gpt2-tiny", "--steps", "1", "--check", "--no-model-check"]) == 0
    assert "gradients: bitwise equal to eager" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--budget", "0.5", "--host-budget", "1GiB"], "add --offload"),
    (["--offload"], "give --budget"),
    (["--budget", "0.5", "--offload", "--host-budget", "0.5"], "fraction"),
])
def test_remat_compile_offload_flags_are_checked_first(tmp_path, capsys, argv, message):
    from remat_ir.cli.commands import compile_main

    assert compile_main(["gpt2-tiny", "-o", str(tmp_path / "x.rir")] + argv) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ wrap


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128))


def _batch(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 48), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd"])  # (AdamW: the sliding-window families below)
def test_wrap_offloads_a_llama_below_its_recompute_floor(tmp_path, monkeypatch, optimizer):
    """A 2-layer transformers Llama, a budget below what recomputation alone
    reaches: refused without offload, met with it; three optimizer steps
    through `wrap(..., offload=True)` give eager's gradients bitwise, and the
    measured device peak of each step is the plan's."""
    pytest.importorskip("transformers")
    import torch

    import remat_ir
    from remat_ir.optimize import ladder
    from remat_ir.pipeline import fit, trace
    from remat_ir.runtime.memtrack import measure_step

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = _llama()
    eager = copy.deepcopy(model)
    program = trace(model, (), _batch(0), as_called=True)
    recompute = ladder.floor(program, scope="activations", exact=True).predicted_peak
    low = ladder.floor(program, scope="activations", exact=True, offload=True).predicted_peak
    assert low < recompute
    # (A quarter of the way up: the floor search's plan is not proven least
    # on this graph, and budget searches find plans a little below it.)
    budget = low + (recompute - low) // 4
    with pytest.raises(Infeasible):
        fit(program, budget, exact=True)

    wrapped = remat_ir.wrap(model, budget=budget, offload=True)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3)}[optimizer]
    opt, opt_eager = make(model.parameters()), make(eager.parameters())
    for step in range(3):
        batch = _batch(step)
        params = list(model.parameters())
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        grads_present = any(p.grad is not None for p in params)
        pre = {"params": params, "buffers": list(model.buffers()), "inputs": list(batch.values()),
               "optimizer": state}
        if grads_present:
            pre["grads"] = [p.grad for p in params if p.grad is not None]
        measured = measure_step(lambda: wrapped(**batch).loss.backward(), pre_existing=pre)
        eager(**batch).loss.backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters())), step
        plan = remat_ir.planner(wrapped).plan_of(**batch)
        assert plan is not None and any(i.kind == OFFLOAD for i in plan.forward)
        predicted = simulate(plan, grads_present=grads_present,
                             optim_state_bytes=sum(t.untyped_storage().nbytes() for t in state))
        assert predicted.activation_peak_bytes <= budget
        assert 0 <= measured.peak_bytes - predicted.peak_bytes <= 4, step
        assert measured.host_peak_bytes == predicted.host_peak_bytes > 0
        for o in (opt, opt_eager):
            o.step()
            o.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
    assert remat_ir.planner(wrapped).solves == 1


def test_wrap_offload_options_are_checked_and_keyed(tmp_path, monkeypatch):
    import torch

    import remat_ir
    from remat_ir.adopt import AutoRemat

    m = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="offload=True"):
        remat_ir.wrap(m, budget=0.5, host_budget="1GiB")
    with pytest.raises(ValueError, match="a plan given"):
        remat_ir.wrap(m, "schedules/mlp.rir", offload=True)
    plain = AutoRemat(torch.nn.Linear(4, 4), budget=0.5)
    off = AutoRemat(torch.nn.Linear(4, 4), budget=0.5, offload=True)
    assert "offload" not in plain.options and off.options["offload"] is True


def test_a_cached_plan_with_offloads_serves_only_an_offload_request():
    from remat_ir.adopt import _not_serving
    from remat_ir.ir.parser import parse_program

    from test_offload import TINY, tiny

    program, plan = parse_program(TINY, "tiny.rir"), tiny()
    asked = dict(budget=None, scope="activations", optimizer="none", cost="flops")
    assert "made with offloads" in _not_serving(plan, program, asked)
    assert _not_serving(plan, program, dict(asked, offload=True, host_budget=None)) is None
    assert "asked 100 bytes" in _not_serving(plan, program, dict(asked, offload=True, host_budget=100))
    plan.header.host_budget = 100
    assert _not_serving(plan, program, dict(asked, offload=True, host_budget=100)) is None


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_wrap_offloads_sliding_window_families_recomputation_refuses_at_0_3(tmp_path, monkeypatch, family):
    """Two transformers families with a sliding window and a padded mask,
    whose budget 0.3 recomputation alone (and the chunked loss) cannot meet:
    with `offload=True` three AdamW steps through `wrap` give eager's
    gradients bitwise, and each step's measured device peak is the plan's."""
    pytest.importorskip("transformers")
    import torch

    import remat_ir
    from remat_ir.models.families import FAMILIES
    from remat_ir.pipeline import BudgetError, fit, trace
    from remat_ir.runtime.memtrack import measure_step

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model, call = FAMILIES[family](0)
    eager = copy.deepcopy(model)
    with pytest.raises((Infeasible, BudgetError)):
        fit(trace(copy.deepcopy(model), (), call, loss=lambda out, *a, **k: out.loss), 0.3)
    wrapped = remat_ir.wrap(model, budget=0.3, offload=True)
    opt, opt_eager = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(eager.parameters(), lr=1e-3)
    for step in range(3):
        params = list(model.parameters())
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        grads_present = any(p.grad is not None for p in params)
        pre = {"params": params, "buffers": list(model.buffers()), "inputs": list(call.values()), "optimizer": state}
        if grads_present:
            pre["grads"] = [p.grad for p in params if p.grad is not None]
        torch.manual_seed(step)
        measured = measure_step(lambda: wrapped(**call).loss.backward(), pre_existing=pre)
        torch.manual_seed(step)
        eager(**call).loss.backward()
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), \
                (step, name)
        plan = remat_ir.planner(wrapped).plan_of(**call)
        assert plan is not None and any(i.kind == OFFLOAD for i in plan.forward)
        predicted = simulate(plan, grads_present=grads_present,
                             optim_state_bytes=sum(t.untyped_storage().nbytes() for t in state))
        assert 0 <= measured.peak_bytes - predicted.peak_bytes <= 4, step
        assert measured.host_peak_bytes == predicted.host_peak_bytes > 0
        for o in (opt, opt_eager):
            o.step()
            o.zero_grad()
    assert remat_ir.planner(wrapped).solves == 1
