"""Changes to a model after it was wrapped are seen at the next training step.

`remat_ir.runtime.bind.ModelGuard` is taken when a plan is made or bound and
compared at each training step.  For each kind of change that leaves the
parameters' shapes and dtypes as they were (a submodule replaced,
requires_grad flipped, a submodule put in eval mode on its own, a buffer or
a parameter replaced by another object), a budget wrap plans the model again
and trains bitwise as eager after the change, and a plan wrap refuses the
step with a PlanMismatch naming the change.  A parameter replaced by one of
another dtype is refused by the plan wrap too.  Nothing else replans: the
same model over several steps, or put in eval() and back in train().
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import remat_ir
from remat_ir.runtime.bind import ModelGuard, PlanMismatch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.bn(self.fc1(x)))))


def _loss(out, x):
    return out.square().mean()


def _replace_parameter(m):
    m.fc2.weight = nn.Parameter(m.fc2.weight.detach().clone())


# kind: (the change, applied to a model; what the plan wrap's refusal says; whether the graph changes)
CHANGES = {
    "submodule": (lambda m: setattr(m, "act", nn.Tanh()), "submodule act changed from ReLU to Tanh", True),
    "requires_grad": (lambda m: m.fc1.weight.requires_grad_(False),
                      "parameter fc1.weight: requires_grad changed from True to False", True),
    "training": (lambda m: m.drop.eval(), "submodule drop was put in eval mode", True),
    "buffer": (lambda m: setattr(m.bn, "running_mean", m.bn.running_mean.clone()),
               "buffer bn.running_mean was replaced by another tensor", False),
    "parameter": (_replace_parameter, "parameter fc2.weight was replaced by another Parameter", False),
}

X = [torch.randn(16, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]


def _eager_step(model, x, seed):
    torch.manual_seed(seed)  # the same dropout masks for eager and wrapped
    _loss(model(x), x).backward()


def _wrapped_step(wrapped, x, seed):
    torch.manual_seed(seed)
    wrapped(x).backward()


def _sgd(model):
    """One SGD step on the parameters that have gradients now; the gradients, by name."""
    grads = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad
                p.add_(p.grad, alpha=-0.1)
                p.grad = None
    return grads


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    return _same(dict(a.named_parameters()), dict(b.named_parameters())) and \
        _same(dict(a.named_buffers()), dict(b.named_buffers()))


@pytest.mark.parametrize("kind", list(CHANGES))
def test_budget_wrap_plans_a_changed_model_again(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    change, said, graph_changes = CHANGES[kind]
    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)
    wrapped = remat_ir.wrap(model, loss=_loss, budget=0.8)  # (this small step's floor is 0.73 of its peak)
    for i in range(2):
        _eager_step(eager, X[i], i)
        _wrapped_step(wrapped, X[i], i)
        assert _same(_sgd(eager), _sgd(model))
    (first,) = remat_ir.planner(wrapped).plans.values()
    assert "planning it again" not in capsys.readouterr().err  # unchanged: no second plan

    change(eager)
    change(model)
    for i in range(2, 4):
        _eager_step(eager, X[i], i)
        _wrapped_step(wrapped, X[i], i)
        assert _same(_sgd(eager), _sgd(model)), f"gradients differ from eager's at step {i}"
    assert _same_state(eager, model)
    (second,) = remat_ir.planner(wrapped).plans.values()
    assert second is not first  # the plan made before the change was dropped
    err = capsys.readouterr().err
    assert said in err and err.count("planning it again") == 1, err
    fingerprints = (first.program.header.fingerprint, second.program.header.fingerprint)
    # A changed graph is another plan (another cache file); a replaced object alone is the same plan.
    assert (fingerprints[0] != fingerprints[1]) == graph_changes
    assert len(list(tmp_path.glob("*.rir"))) == (2 if graph_changes else 1)


@pytest.mark.parametrize("kind", list(CHANGES))
def test_plan_wrap_refuses_a_changed_model_naming_the_change(kind):
    change, said, _ = CHANGES[kind]
    torch.manual_seed(0)
    model = Net()
    plan = remat_ir.compile(model, (X[0],), loss=_loss)
    wrapped = remat_ir.wrap(model, plan, loss=_loss)
    _wrapped_step(wrapped, X[0], 0)
    change(model)
    with pytest.raises(PlanMismatch, match=re.escape(said) + r".* since the plan was bound; wrap the model again"):
        wrapped(X[1])
    if kind in ("buffer", "parameter"):
        # The plan still fits the model: bound again, it runs.
        _wrapped_step(remat_ir.wrap(model, plan, loss=_loss), X[1], 1)


def test_a_parameter_of_another_dtype_is_refused():
    torch.manual_seed(0)
    model = Net()
    wrapped = remat_ir.wrap(model, remat_ir.compile(model, (X[0],), loss=_loss), loss=_loss)
    _wrapped_step(wrapped, X[0], 0)
    model.fc2.weight = nn.Parameter(model.fc2.weight.detach().double())
    with pytest.raises(PlanMismatch, match=re.escape("parameter fc2.weight was replaced by another Parameter "
                                                     "(float64[4, 32], was float32[4, 32])")):
        wrapped(X[1])


def test_no_change_no_refusal(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = Net()
    plan = remat_ir.compile(model, (X[0],), loss=_loss)
    twin = copy.deepcopy(model)
    model.eval()  # bound in eval mode: the guard looks at it as a training step will
    bound = remat_ir.wrap(twin, plan, loss=_loss)
    auto = remat_ir.wrap(model, loss=_loss)
    model.train()
    _wrapped_step(auto, X[0], 0)
    (first,) = remat_ir.planner(auto).plans.values()
    for i in range(3):
        _wrapped_step(bound, X[i], i)
        model.eval()
        with torch.no_grad():
            auto(X[i])
        model.train()
        _wrapped_step(auto, X[i], i)
    assert list(remat_ir.planner(auto).plans.values()) == [first]
    guard = ModelGuard(model)
    assert guard.changes(model) == []
    model.drop.eval()
    assert guard.changes(model) == ["submodule drop was put in eval mode"]
    model.drop.train()
    assert guard.changes(model) == []
    model.act = nn.ReLU()
    assert guard.changes(model) == ["submodule act was replaced by another ReLU"]
