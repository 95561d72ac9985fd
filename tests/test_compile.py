"""`torch.compile` over a wrapped model.

A training step by a plan is one opaque region to torch.compile (see
`remat_ir.runtime.interpret.opaque_to_dynamo`): the planning (trace and
optimizer) runs outside dynamo, and the plan runs as it runs without
torch.compile.  So gpt2-tiny wrapped with a budget and compiled (aot_eager,
inductor) trains bitwise as the same wrapper uncompiled (SGD, dropout on),
and no graph of the training step reaches the backend.  Against eager
PyTorch too the gradients are bitwise: at 0.7 this step's plan has the
chunked loss (`lm_head_nll:16`, eager's bits), below what recomputation
alone reaches.  A plan wrap under torch.compile trains the same way, and
eval calls, which run the model eagerly, are compiled by dynamo as usual.
"""
from __future__ import annotations

import pytest
import torch

import remat_ir
from remat_ir.models import build_builtin

STEPS = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # One plan cache for the module: the second backend finds the plan the first made.
    return tmp_path_factory.mktemp("plans")


def _model():
    # batch 1 x 32: its 0.7 budget is below what recomputation alone reaches.
    return build_builtin("gpt2-tiny", batch=1, seq=32, seed=0)


def _train(model, params, batches, seed: int = 0):
    """SGD steps; the gradients of each step, as lists."""
    opt = torch.optim.SGD(params, lr=0.1)
    grads = []
    for i, (idx, targets) in enumerate(batches):
        torch.manual_seed(seed + i)  # the same dropout masks for eager and compiled
        model(idx, targets).backward()
        grads.append([p.grad.clone() for p in params])
        opt.step()
        opt.zero_grad()
    return grads


def _batches():
    return [build_builtin("gpt2-tiny", batch=1, seq=32, seed=10 + s)[1] for s in range(STEPS)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _counting(backend: str):
    """`backend`, counting the graphs dynamo hands it (a plan's step must give none)."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)
    graphs = []

    def count(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return inner(gm, example_inputs, **kwargs)

    return count, graphs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_budget_wrap_trains_bitwise_as_uncompiled(backend, cache, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(cache))
    torch._dynamo.reset()
    (eager, _), (plain, _), (module, _) = _model(), _model(), _model()
    wrapped = remat_ir.wrap(module, budget=0.7)
    counting, graphs = _counting(backend)
    compiled = torch.compile(wrapped, backend=counting)
    batches = _batches()
    g_eager = _train(eager, list(eager.parameters()), batches)
    g_plain = _train(remat_ir.wrap(plain, budget=0.7), list(plain.parameters()), batches)
    g_comp = _train(compiled, list(module.parameters()), batches)
    assert len(remat_ir.planner(wrapped).plans) == 1
    plan = next(iter(remat_ir.planner(wrapped).plans.values())).program
    assert plan.header.budget is not None and any(i.kind == "recompute" for i in plan.backward)
    assert plan.header.rewrites == ["lm_head_nll:16"]
    for step, (a, b, c) in enumerate(zip(g_plain, g_comp, g_eager)):
        assert _same(a, b), f"gradients differ from the uncompiled wrapper's at step {step}"
        assert _same(c, b), f"gradients differ from eager's at step {step}"
    assert _same(list(plain.parameters()), list(module.parameters()))
    assert _same(list(eager.parameters()), list(module.parameters()))
    assert graphs == []  # the training steps were opaque: nothing of them reached the backend
    torch._dynamo.reset()


def test_compiled_plan_wrap_trains_as_uncompiled_and_eval_calls_are_compiled(cache, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(cache))
    torch._dynamo.reset()
    (plain, (idx, targets)), (module, _) = _model(), _model()
    auto = remat_ir.wrap(plain, budget=0.7)
    batches = [(idx, targets)] * 2
    g_plain = _train(auto, list(plain.parameters()), batches)
    plan = next(iter(remat_ir.planner(auto).plans.values())).program
    backend, graphs = _counting("aot_eager")
    compiled = torch.compile(remat_ir.wrap(module, plan), backend=backend)
    g_comp = _train(compiled, list(module.parameters()), batches)
    assert all(_same(a, b) for a, b in zip(g_plain, g_comp))
    assert _same(list(plain.parameters()), list(module.parameters()))
    assert graphs == []  # the training steps were opaque: nothing of them reached the backend

    # Evaluation runs the model eagerly, so dynamo compiles it.
    plain.eval()
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx, targets), plain(idx, targets))
    assert graphs, "the eval call was not compiled"
    torch._dynamo.reset()
