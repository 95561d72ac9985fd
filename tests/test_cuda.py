"""CUDA: plans traced for CUDA run on the GPU with gradients equal to eager
and the predicted peak measured by the allocator.  Skipped without a GPU.

Needs torch, msgspec and pytest only (tools/gpu_window.sh installs the last
two from wheels).  Plans with recomputation come from REMAT_CUDA_PLANS (a
directory written by `tools/gpu_check.py --compile-only --device cuda
--small`), or are optimized here when cvxpy is importable.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _eager_reproducible(name: str) -> bool:
    from remat_ir.runtime.load import load_model

    m = load_model(name, device="cuda")
    grads = []
    for _ in range(2):
        m.module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = m.module(*m.inputs)
        (m.loss(out, *m.inputs) if m.loss is not None else out).backward()
        grads.append([p.grad.clone() for p in m.module.parameters() if p.grad is not None])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def _cuda_plan(name: str, tag: str):
    """A gpt2-tiny plan for CUDA made on CPU (REMAT_CUDA_PLANS), else optimized here."""
    from remat_ir.ir.files import load_plan

    d = os.environ.get("REMAT_CUDA_PLANS")
    path = os.path.join(d, f"{name}_b2_s64_cuda_{tag}.rir") if d else None
    if path and os.path.exists(path):
        return load_plan(path)
    pytest.importorskip("cvxpy", reason="no precompiled plan (REMAT_CUDA_PLANS) and no optimizer")
    from remat_ir.pipeline import fit, trace
    from remat_ir.runtime.load import load_model

    m = load_model(name, fake=True)
    return fit(trace(m.module, m.inputs, loss=m.loss, name=name, optimizer="adam", fake=True, device="cuda"),
               tag, scope="activations")


@pytest.mark.parametrize("name", ["gpt2-tiny", "mlp"])
def test_cuda_run_matches_eager_and_prediction(name):
    from remat_ir.ir.ops import device_problems
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import run_plan
    from remat_ir.trace.tracer import trace_module

    m = load_model(name, device="cuda")
    program = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=name, fake=True, device="cuda")
    assert program.header.device == "cuda" and not device_problems([n.op for n in program.nodes], "cuda")
    assert any(n.op == "aten.native_dropout.default" for n in program.nodes)
    r = run_plan(program, load_model(name, device="cuda"), steps=3, device="cuda", check=True)
    if _eager_reproducible(name):
        assert r.grads_match, [c for c in r.checks]
    assert r.within_tolerance(), (r.predicted.peak_bytes, r.measured_peak,
                                  r.predicted_first.peak_bytes, r.measured_first_peak)


@pytest.mark.parametrize("tag", ["0.5", "floor"])
def test_recomputed_dropout_replays_philox(tag):
    """A plan made on CPU that draws dropout masks again in backward gives
    eager CUDA's gradients: the CUDA generator's state is replayed."""
    from remat_ir.ir import RECOMPUTE
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import check_gradients

    program = _cuda_plan("gpt2-tiny", tag)
    nodes = program.node_map()
    assert any(nodes[i.target].random for i in program.backward if i.kind == RECOMPUTE)
    from remat_ir.rewrite import keeps_bits

    checks = check_gradients(program, load_model("gpt2-tiny", device="cuda"), steps=2, device="cuda")
    # The floor's plan chunks the loss, which changes the sum's order: eager's within tolerance.
    if _eager_reproducible("gpt2-tiny") and keeps_bits(list(program.header.rewrites)):
        assert all(c.grads_equal for c in checks), checks
    assert all(c.grads_close for c in checks), checks


def test_plan_made_on_cpu_is_the_cuda_trace():
    """The device-neutral plan (made on CPU) is op for op what tracing on
    CUDA records for the built-in GPT-2."""
    from remat_ir.runtime.bind import first_difference
    from remat_ir.runtime.load import load_model
    from remat_ir.trace.device import is_neutral
    from remat_ir.trace.tracer import trace_module

    d = os.environ.get("REMAT_CUDA_PLANS")
    path = os.path.join(d, "gpt2-tiny_b2_s64_cuda_plan.rir") if d else ""
    if not os.path.exists(path):
        pytest.skip("no plan made on CPU (REMAT_CUDA_PLANS)")
    from remat_ir.ir.files import load_plan

    plan = load_plan(path)
    assert is_neutral(plan)
    m = load_model("gpt2-tiny", device="cuda")
    fresh = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name="gpt2-tiny", fake=True, device="cuda")
    assert first_difference(plan, fresh) == ("", 0)


def test_outer_autocast_other_than_the_plans_is_refused_on_cuda():
    from remat_ir.runtime.bind import PlanMismatch
    from remat_ir.runtime.interpret import wrap
    from remat_ir.runtime.load import load_model
    from remat_ir.trace.tracer import trace_module

    m = load_model("mlp", device="cuda")
    w = wrap(m.module, trace_module(m.module, m.inputs, loss_fn=m.loss, fake=True, device="cuda"), loss=m.loss)
    with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(
            PlanMismatch, match="but the plan was made under no autocast"):
        w(*m.inputs)


def test_a_step_under_cuda_autocast_trains_as_eager():
    import copy

    import remat_ir
    from remat_ir.runtime.load import load_model

    m = load_model("mlp", device="cuda")
    eager = copy.deepcopy(m.module)
    w = remat_ir.wrap(m.module, loss=m.loss, cache=False)  # no budget: the unoptimized plan, traced at the first call
    for model in (w, eager):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(3):
            torch.manual_seed(i)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(*m.inputs)
                loss = out if model is w or m.loss is None else m.loss(out, *m.inputs)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(m.module.parameters(), eager.parameters()))
    assert [r.program.header.autocast for r in remat_ir.planner(w).plans.values()] == ["cuda:bfloat16"]


def test_profile_on_cuda_keeps_the_rng_stream():
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.op_timing import profile_costs
    from remat_ir.trace.tracer import trace_module

    m = load_model("mlp", device="cuda")
    program = trace_module(m.module, m.inputs, loss_fn=m.loss, fake=True, device="cuda")
    torch.manual_seed(0)
    before = torch.cuda.get_rng_state()
    p = profile_costs(program, m.module, m.inputs, repeats=2)
    assert torch.equal(before, torch.cuda.get_rng_state())
    assert all(n.time_us > 0 for n in p.nodes)


@pytest.mark.parametrize("name", ["gpt2-tiny", "mlp"])
def test_offloaded_activations_run_as_eager_and_as_predicted(name):
    """A CUDA plan with every activation kept for backward offloaded
    (pinned host buffers, a copy stream, events): gradients as eager's, the
    device peak the allocator measures and the pinned bytes in use as
    predicted, first and later steps; the pinned buffers of one step serve
    the next."""
    from offload_plans import candidates, with_offloads

    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import run_plan
    from remat_ir.trace.tracer import trace_module

    m = load_model(name, device="cuda")
    program = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=name, fake=True, device="cuda")
    p = with_offloads(program, candidates(program))
    r = run_plan(p, load_model(name, device="cuda"), steps=3, device="cuda", check=True)
    if _eager_reproducible(name):
        assert r.grads_bitwise, [c for c in r.checks]
    assert r.within_tolerance(), (r.predicted.peak_bytes, r.measured_peak, r.predicted_first.peak_bytes,
                                  r.measured_first_peak)
    assert r.measured_host_peak == r.measured_first_host_peak == r.predicted.host_peak_bytes > 0
