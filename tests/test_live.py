"""A plan follows what the program does after it was traced, or refuses in one line.

Each case changes the model's Python state the way training scripts do
(after the first step, or in forward itself) and compares every step's
gradients with eager's (`torch.equal`): a budget wrap plans again where the
step read what changed, a plan wrap refuses naming it, and a step that does
what no plan can replay is refused when it is traced, leaving the model as
it was.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import remat_ir
from remat_ir.runtime.bind import LiveGuard, PlanMismatch
from remat_ir.trace.tracer import TraceError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x)))) * self.scale


def _loss(out, x):
    return out.square().mean()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _steps(model, changes, n: int = 3, x=None):
    """Per-step gradients of `n` SGD steps, `changes[i]` applied to the model before step i."""
    torch.manual_seed(0)
    x = torch.randn(6, 8) if x is None else x
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(n):
        if i in changes:
            changes[i](getattr(model, "module", model))
        torch.manual_seed(100 + i)
        _loss(model(x), x).backward()
        out.append(_grads(model))
        opt.step()
        opt.zero_grad()
    return out


def _equal(a, b) -> bool:
    return all(torch.equal(p, q) for ga, gb in zip(a, b) for p, q in zip(ga, gb))


def _set(path, name, value):
    def change(model):
        setattr(model.get_submodule(path), name, value)
    return change


def _hook(model):
    model.fc1.register_forward_hook(lambda m, i, o: o * 0.5)


CHANGES = {
    "dropout p to 0": ({1: _set("drop", "p", 0.0)}, "attribute p of submodule drop changed from 0.25 to 0.0"),
    "a float read in forward": ({1: _set("", "scale", 0.5)}, "attribute scale of the model changed from 1.0 to 0.5"),
    "a forward hook added": ({1: _hook}, "a forward hook of submodule fc1 was added"),
}


@pytest.mark.parametrize("case", CHANGES)
def test_budget_wrap_plans_again_after_a_change(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    changes, said = CHANGES[case]
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    wrapped = remat_ir.wrap(model, loss=None)
    assert _equal(_steps(wrapped, changes), _steps(eager, changes))
    assert said in capsys.readouterr().err
    assert len(remat_ir.planner(wrapped).plans) == 1


@pytest.mark.parametrize("case", CHANGES)
def test_plan_wrap_refuses_a_change_naming_it(case):
    changes, said = CHANGES[case]
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(6, 8)
    plan = remat_ir.compile(model, (x,))
    wrapped = remat_ir.wrap(model, plan)
    _loss(wrapped(x), x).backward()
    changes[1](model)
    with pytest.raises(PlanMismatch, match=said):
        wrapped(x)


def test_unchanged_model_keeps_its_plan_and_eval_runs_hooks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = Net()
    eager = copy.deepcopy(model)
    wrapped = remat_ir.wrap(model)
    assert _equal(_steps(wrapped, {}, 4), _steps(eager, {}, 4))
    assert "planning it again" not in capsys.readouterr().err
    seen = []
    h = model.fc1.register_forward_hook(lambda m, i, o: seen.append(o))  # eval calls run eagerly, hooks too
    model.eval()
    with torch.no_grad():
        wrapped(torch.randn(2, 8))
    assert len(seen) == 1 and not isinstance(seen[0], torch._subclasses.FakeTensor)
    h.remove()


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.n = 0

    def forward(self, x):
        self.n += 1
        return self.fc(x) * self.n


class PyRandomDepth(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        if random.random() < 0.5:  # stochastic depth decided in Python
            x = self.a(x)
        return self.b(x)


def _recording(model):
    kept = []
    model.fc1.register_forward_hook(lambda m, i, o: kept.append(o))
    return model


def _printing(model):
    model.fc1.register_forward_hook(lambda m, i, o: print(o.shape))
    return model


REFUSED = {
    "a counter written in forward": (Counter, "the model \\(Counter\\) sets its attribute n in its forward"),
    "Python's random": (PyRandomDepth, "the model \\(PyRandomDepth\\) draws from Python's random"),
    "a hook that keeps what it sees": (lambda: _recording(Net()), "forward hook .*<lambda> of submodule fc1 "
                                                                 "keeps the tensors it sees"),
    "a hook that prints": (lambda: _printing(Net()), "forward hook .*<lambda> of submodule fc1 prints"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_be_replayed_is_refused_and_the_model_left_as_found(case, tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    make, said = REFUSED[case]
    model = make()
    wrapped = remat_ir.wrap(model)
    state = random.getstate()
    before = {k: v for k, v in vars(model).items() if not k.startswith("_")}
    x = torch.randn(2, 8)
    with pytest.raises(TraceError, match=said) as e:
        wrapped(x)
    assert "\n" not in str(e.value)
    assert random.getstate() == state
    assert {k: v for k, v in vars(model).items() if not k.startswith("_")} == before
    assert "_remat_watched" not in type(model).__dict__  # the class the trace watched it with is gone
    with pytest.raises(TraceError, match=said):
        remat_ir.compile(model, (x,))


def test_a_transforming_hook_is_traced_into_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = Net()
    _hook(model)
    eager = copy.deepcopy(model)
    assert _equal(_steps(remat_ir.wrap(model), {}), _steps(eager, {}))


def test_guard_survives_pickling(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = Net()
    wrapped = remat_ir.wrap(model)
    _steps(wrapped, {}, 1)
    copied = copy.deepcopy(wrapped)
    assert remat_ir.planner(copied)._live_guard.changes(copied) == []
    copied.drop.p = 0.0
    assert remat_ir.planner(copied)._live_guard.changes(copied) == ["attribute p of submodule drop changed from 0.25 to 0.0"]
    assert remat_ir.planner(wrapped)._live_guard.changes(model) == []


@pytest.mark.slow
def test_peft_set_scale_plans_again(tmp_path, monkeypatch, capsys):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from remat_ir.models.families import FAMILIES

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model, kwargs = FAMILIES["llama-lora"](0)
    eager = copy.deepcopy(model)

    def set_scale(m):
        for mod in m.modules():
            if hasattr(mod, "set_scale") and hasattr(mod, "scaling"):
                mod.set_scale("default", 0.5)

    def steps(m):
        out = []
        for i in range(2):
            if i == 1:
                set_scale(m)
            torch.manual_seed(i)
            m(**kwargs).loss.backward()
            out.append([p.grad.clone() for p in m.parameters() if p.requires_grad])
            m.zero_grad()
        return out

    assert _equal(steps(remat_ir.wrap(model)), steps(eager))
    assert "attribute scaling of submodule" in capsys.readouterr().err


def test_live_guard_lists_nothing_for_an_unchanged_model():
    model = Net()
    guard = LiveGuard([], model)
    assert guard.changes(model) == []
    h = model.register_forward_pre_hook(lambda m, a: None)
    assert guard.changes(model) == ["a forward pre hook of the model was added"]
    h.remove()
    assert guard.changes(model) == []


def test_create_graph_through_a_plan_is_refused_at_the_grad_call(tmp_path, monkeypatch):
    """A gradient penalty (WGAN-GP, R1) differentiates the gradient: a plan's
    backward has no graph, so the call is refused, never answered without one."""
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    wrapped = remat_ir.wrap(Net())
    model = copy.deepcopy(remat_ir.unwrap(copy.deepcopy(wrapped)))  # eager's twin
    x = torch.randn(6, 8, requires_grad=True)
    out = _loss(wrapped(x), x)
    with pytest.raises(RuntimeError, match="create_graph") as e:
        torch.autograd.grad(out, x, create_graph=True)
    assert "\n" not in str(e.value)
    with remat_ir.eager(wrapped):  # the model's own forward: a gradient with its graph
        torch.manual_seed(2)
        penalty = torch.autograd.grad(_loss(wrapped(x), x), x, create_graph=True)[0].square().sum()
    torch.manual_seed(2)
    assert torch.equal(penalty, torch.autograd.grad(_loss(model(x), x), x, create_graph=True)[0].square().sum())
    assert penalty.requires_grad
    # Without create_graph, the same step's gradient is eager's.
    torch.manual_seed(1)
    g = torch.autograd.grad(_loss(wrapped(x), x), x)[0]
    torch.manual_seed(1)
    assert torch.equal(g, torch.autograd.grad(_loss(model(x), x), x)[0])


@pytest.mark.slow
def test_a_short_last_batch_below_its_floor_runs_by_its_floor_plan(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0))
    eager = copy.deepcopy(model)
    wrapped = remat_ir.wrap(model, budget=0.8)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    batches = [ids, ids[:2, :1]]  # the last batch: 2 x 1

    def steps(m):
        out = []
        for b in batches:
            torch.manual_seed(0)
            m(input_ids=b, labels=b).loss.backward()
            out.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad()
        return out

    assert _equal(steps(wrapped), steps(eager))
    err = capsys.readouterr().err
    assert "cannot meet budget 0.8" in err and "runs by its floor plan" in err


class Lengths(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(x.shape[0])  # a list changed in place: as a counter, it cannot be replayed
        return self.fc(x)


def test_a_container_changed_in_place_is_refused_and_put_back(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = Lengths()
    with pytest.raises(TraceError, match="changes its attribute seen in place"):
        remat_ir.wrap(model)(torch.randn(2, 8))
    assert model.seen == []


def test_torch_s_own_hooks_neither_refused_nor_a_change(tmp_path, monkeypatch, capsys):
    """A FLOP counter registers global hooks anew at each `with`; the old
    weight_norm recomputes its weight in a pre-forward hook: both torch's own."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model, eager = [], []
    for m in (model, eager):  # (a weight_norm module cannot be deep-copied: built twice)
        torch.manual_seed(0)
        m.append(Net())
        torch.nn.utils.weight_norm(m[0].fc2)
    model, eager = model[0], eager[0]
    wrapped = remat_ir.wrap(model)
    x = torch.randn(6, 8)
    for m in (wrapped, eager):
        for i in range(2):
            torch.manual_seed(i)
            with FlopCounterMode(display=False):
                _loss(m(x), x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))
    assert "planning it again" not in capsys.readouterr().err
