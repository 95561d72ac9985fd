"""Trace -> program -> wrapped module: gradients equal eager, memory as predicted."""
from __future__ import annotations

import copy

import pytest
import torch

from remat_ir.runtime.interpret import PlanMismatch, wrap
from remat_ir.runtime.load import load_model
from remat_ir.runtime.run import check_gradients, matches, run_plan
from remat_ir.check.simulate import simulate
from remat_ir.trace.tracer import TraceError, trace_module
from remat_ir.check.verify import verify

MODELS = ["gpt2-tiny", "mlp", "examples/mlp_with_loss.py"]


@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(name):
        if name not in cache:
            m = load_model(name)
            cache[name] = (m, trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=name))
        return cache[name]

    return get


@pytest.mark.parametrize("name", MODELS + ["examples/hf_gpt2.py"])
def test_gradients_bitwise_equal_with_dropout(traced, name):
    if name.endswith("hf_gpt2.py"):
        pytest.importorskip("transformers")
    _, program = traced(name)
    assert verify(program).ok
    checks = check_gradients(program, load_model(name), steps=3)
    for c in checks:
        assert c.loss_equal, c
        assert c.grads_equal, c
        assert c.max_abs_grad_diff == 0.0


@pytest.mark.parametrize("name", MODELS + ["examples/hf_gpt2.py"])
def test_measured_peak_equals_predicted(traced, name):
    if name.endswith("hf_gpt2.py"):
        pytest.importorskip("transformers")
    _, program = traced(name)
    r = run_plan(program, load_model(name), steps=1)
    assert matches(r.predicted_first.peak_bytes, r.measured_first_peak), (r.predicted_first.peak_bytes,
                                                                          r.measured_first_peak)
    assert matches(r.predicted.peak_bytes, r.measured_peak), (r.predicted.peak_bytes, r.measured_peak)
    # The model has parameters, so the later step holds a full set of gradients more.
    assert r.measured_peak > r.measured_first_peak


def test_dropout_is_active_and_replayed_per_step(traced):
    m, program = traced("gpt2-tiny")
    w = wrap(copy.deepcopy(m.module), program)
    torch.manual_seed(1)
    a = w(*m.inputs).item()
    torch.manual_seed(2)
    b = w(*m.inputs).item()
    assert a != b  # dropout draws fresh masks each step


def test_eval_and_no_grad_run_eagerly(traced):
    m, program = traced("gpt2-tiny")
    module = copy.deepcopy(m.module)
    w = wrap(module, program)
    w.eval()
    with torch.no_grad():
        assert torch.equal(w(*m.inputs), module(*m.inputs))
    w.train()
    with torch.no_grad():
        out = w(*m.inputs)
    assert out.grad_fn is None


def test_hooks_fire_and_grads_accumulate(traced):
    m, program = traced("mlp")
    module = copy.deepcopy(m.module)
    w = wrap(module, program)
    seen = []
    first = next(module.parameters())
    first.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    torch.manual_seed(0)
    w(*m.inputs).backward()
    g1 = first.grad.clone()
    torch.manual_seed(0)
    w(*m.inputs).backward()
    assert len(seen) == 2
    assert torch.allclose(first.grad, 2 * g1)


def test_plan_refuses_other_model(traced):
    _, program = traced("gpt2-tiny")
    other = load_model("mlp")
    with pytest.raises(PlanMismatch, match="parameter"):
        wrap(other.module, program)
    m = load_model("gpt2-tiny")
    with torch.no_grad():
        pass
    m.module.transformer.h[0].ln_1.weight = torch.nn.Parameter(torch.ones(64))
    with pytest.raises(PlanMismatch, match="transformer.h.0.ln_1.weight"):
        wrap(m.module, program)


def test_input_shape_mismatch_is_a_clear_error(traced):
    m, program = traced("gpt2-tiny")
    w = wrap(copy.deepcopy(m.module), program)
    idx = m.inputs[0][:, :32]
    with pytest.raises(PlanMismatch, match="compiled for int64\\[2, 64\\]"):
        w(idx, m.inputs[1][:, :32])


def test_buffers_mutated_once_per_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                              torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    x = torch.randn(8, 8)
    program = trace_module(net, (x,), loss_fn=lambda out, x: out.square().mean())
    assert verify(program).ok
    bn_nodes = [n for n in program.nodes if n.mutates]
    assert any("running_mean" in m for n in bn_nodes for m in n.mutates)
    eager = copy.deepcopy(net)
    w = wrap(net, program, loss=lambda out, x: out.square().mean())
    for step in range(2):
        torch.manual_seed(step)
        eager(x).square().mean().backward()
        torch.manual_seed(step)
        w(x).backward()
    for a, b in zip(eager.buffers(), net.buffers()):
        assert torch.equal(a, b)
    for a, b in zip(eager.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_inputs_requiring_grad_get_gradients():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    program = trace_module(lin, (x,), loss_fn=lambda out, x: out.sum())
    assert any(o.kind == "grad" and o.key == "input" for o in program.outputs)
    w = wrap(lin, program, loss=lambda out, x: out.sum())
    x2 = x.detach().clone().requires_grad_()
    w(x2).backward()
    x3 = x.detach().clone().requires_grad_()
    lin(x3).sum().backward()
    assert torch.equal(x2.grad, x3.grad)


def test_data_dependent_op_is_named():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y[y > 0].sum()

    with pytest.raises(TraceError, match="nonzero|data-dependent|masked_select|item"):
        trace_module(Bad(), (torch.randn(3, 4),))


def test_fake_trace_of_gpt2_medium_plans_without_allocating():
    m = load_model("gpt2-medium", fake=True)
    program = trace_module(m.module, m.inputs, model_name="gpt2-medium", fake=True)
    params = sum(v.nbytes for v in program.values if v.kind == "param")
    n = sum(torch.Size(v.shape).numel() for v in program.values if v.kind == "param")
    assert abs(n / 1e6 - 354.8) < 0.1
    assert abs(params / 2**30 - 1.32) < 0.01
    report = simulate(program)
    assert report.peak.by_category["parameters"] == params
    assert report.peak_bytes > 3 * params
