"""--cost profile: each op's run time measured on the device, recorded in the
plan, and minimized by the optimizer."""
from __future__ import annotations

import re

import pytest
import torch

from remat_ir.cli.commands import compile_main, verify_main
from remat_ir.ir.costs import overhead, overhead_text
from remat_ir.runtime.op_timing import ProfileError, profile_costs
from remat_ir.optimize.family import Analysis
from remat_ir.ir import COST_FLOPS, COST_PROFILE, FORWARD
from remat_ir.runtime.load import load_model
from remat_ir.optimize.search import optimize, resolve_budget
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.trace.tracer import trace_module
from remat_ir.check.verify import verify


def _traced(name: str):
    m = load_model(name)
    return m, trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=m.name)


@pytest.fixture(scope="module")
def mlp():
    m, p = _traced("mlp")
    return m, p, profile_costs(p, m.module, m.inputs, repeats=3)


def test_every_op_of_gpt2_tiny_gets_a_time_and_the_plan_round_trips():
    m, p = _traced("gpt2-tiny")
    q = profile_costs(p, m.module, m.inputs, repeats=2)
    assert q.header.cost == COST_PROFILE
    assert all(n.time_us > 0 for n in q.nodes)
    assert any(n.phase == FORWARD for n in q.nodes)
    assert [n.flops for n in q.nodes] == [n.flops for n in p.nodes]
    # The traced program is left as it was.
    assert p.header.cost == COST_FLOPS and all(n.time_us == 0 for n in p.nodes)
    t = format_program(q)
    assert "\ncost profile\n" in t and " time_us " in t
    back = parse_program(t)
    assert format_program(back) == t
    assert [n.time_us for n in back.nodes] == [n.time_us for n in q.nodes]


def test_optimizer_minimizes_profiled_time(mlp):
    _, p, q = mlp
    assert Analysis(q, "activations").cost == [n.time_us for n in q.nodes if n.phase == FORWARD]
    assert Analysis(p, "activations").cost == [n.flops for n in p.nodes if n.phase == FORWARD]
    budget = resolve_budget(q, "0.8", "activations")
    r = optimize(q, budget, scope="activations")
    assert r.predicted_peak <= budget
    assert verify(r.program).ok
    assert r.program.header.cost == COST_PROFILE
    extra, base = overhead(r.program)
    assert extra > 0 and base == pytest.approx(sum(n.time_us for n in q.nodes))
    # The optimizer's own account of the extra cost is in microseconds too.
    assert r.extra_cost == pytest.approx(extra)
    assert overhead_text(r.program).endswith("step time (profiled on cpu)")
    assert format_program(parse_program(format_program(r.program))) == format_program(r.program)


def test_profiling_leaves_buffers_alone():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 4))
    x = torch.randn(32, 8)
    p = trace_module(net, (x,), loss_fn=lambda out, x: out.square().mean(), model_name="bn")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    q = profile_costs(p, net, (x,), repeats=3)
    assert all(n.time_us > 0 for n in q.nodes)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_fake_inputs_are_refused(mlp):
    m, p, _ = mlp
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = tuple(torch.empty(x.shape, dtype=x.dtype) for x in m.inputs)
    with pytest.raises(ProfileError, match="fake tensor"):
        profile_costs(p, m.module, fake)
    with pytest.raises(ProfileError, match="takes 2 inputs"):
        profile_costs(p, m.module, m.inputs + m.inputs)


def test_cli_cost_profile_prints_step_time_overhead(tmp_path, capsys):
    out = tmp_path / "mlp.rir"
    assert compile_main(["mlp", "-o", str(out), "--cost", "profile", "--profile-repeats", "2",
                         "--budget", "0.8", "--scope", "activations"]) == 0
    text = capsys.readouterr().out
    last = text.strip().splitlines()[-1]
    assert re.search(r"profiled \d+ ops in", last)
    assert "step time (profiled on cpu)" in last
    assert "profiled on cpu: +" in text  # the breakdown's line
    plan = out.read_text()
    assert "\ncost profile\n" in plan and " time_us " in plan
    assert verify_main([str(out)]) == 0
