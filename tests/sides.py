"""A model trained eagerly and compiled side by side, and its step's memory
measured against its plan's prediction: what the torch.compile backend's
tests (test_backend.py) and the chunked loss's (test_rewrites.py) check."""
from __future__ import annotations

import copy

import torch

from remat_ir.check.simulate import simulate
from remat_ir.runtime.memtrack import measure_step
from remat_ir.runtime.run import matches


def train_side_by_side(model, inputs, be, steps=3):
    """Train `model` eagerly and compiled with `be` from the same weights and
    seeds for `steps` SGD steps; assert losses, gradients and buffers are
    bitwise equal at every step.  Returns the compiled model."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=be, dynamic=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(steps):
        losses = []
        for m, run in ((eager, eager), (model, compiled)):
            torch.manual_seed(100 + step)
            loss = run(*inputs)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"step {step}: loss {losses[0]} != {losses[1]}"
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: the gradient of {name} differs from eager's"
        for (name, b), c in zip(eager.named_buffers(), model.buffers()):
            assert torch.equal(b, c), f"step {step}: buffer {name} differs from eager's"
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return compiled


def check_memory(model, compiled, inputs, plan):
    """Predicted vs measured bytes above the step's baseline, on a step
    without `.grad` (the gradients stolen into `.grad` count) and on one
    with `.grad` (the activation peak).  Returns the four figures."""
    params = list(model.parameters())

    def step():
        torch.manual_seed(7)
        loss = compiled(*inputs)
        loss.backward()
        return loss.detach()

    pre = {"params": params, "buffers": list(model.buffers()), "inputs": list(inputs)}
    for p in params:
        p.grad = None
    first = measure_step(step, pre_existing=pre)
    later = measure_step(step, pre_existing=dict(pre, grads=[p.grad for p in params]))
    first_rep = simulate(plan, grads_present=False)
    later_rep = simulate(plan, grads_present=True)
    predicted_first = first_rep.step_peak_bytes
    predicted = later_rep.step_peak_bytes
    assert matches(predicted_first, first.peak_above_baseline), (predicted_first, first.peak_above_baseline)
    assert matches(predicted, later.peak_above_baseline), (predicted, later.peak_above_baseline)
    return predicted_first, first.peak_above_baseline, predicted, later.peak_above_baseline
