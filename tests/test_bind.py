"""A plan runs only on the model it was made for: `wrap` and `remat-run`
refuse a model whose code changed since the plan was compiled, and an unsound
plan, with a message naming what differs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import remat_ir
from remat_ir.cli.commands import compile_main, run_main
from remat_ir.runtime.bind import PlanMismatch

MODEL = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.{act}()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

def build():
    torch.manual_seed(0)
    return Net(), (torch.randn(3, 8),)

def loss(out, x):
    return out.square().mean()
'''


class Net(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = act
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))).sum()


def _plan_and_changed_model():
    torch.manual_seed(0)
    net = Net(nn.ReLU())
    x = torch.randn(3, 8)
    plan = remat_ir.compile(net, (x,))
    changed = Net(nn.Tanh())
    changed.load_state_dict(net.state_dict())  # the same parameters: only the code differs
    return plan, net, changed, x


def test_wrap_refuses_a_model_whose_code_changed():
    plan, net, changed, x = _plan_and_changed_model()
    remat_ir.wrap(net, plan)  # the model it was made for
    with pytest.raises(PlanMismatch) as ei:
        remat_ir.wrap(changed, plan)
    msg = str(ei.value)
    assert "aten.relu.default" in msg and "aten.tanh.default" in msg
    assert "module act" in msg and "recompile" in msg and "check_model=False" in msg


def test_the_model_check_can_be_skipped():
    plan, net, changed, x = _plan_and_changed_model()
    w = remat_ir.wrap(changed, plan, check_model=False)  # the user's word: it runs what the plan says
    w.train()
    w(x).backward()
    assert changed.fc1.weight.grad is not None


def test_wrap_refuses_an_unsound_plan_with_the_verifiers_message():
    plan, net, _, _ = _plan_and_changed_model()
    i = next(k for k, ins in enumerate(plan.forward) if ins.kind == "free")
    del plan.forward[i]  # a leak
    with pytest.raises(PlanMismatch) as ei:
        remat_ir.wrap(net, plan)
    assert "not sound" in str(ei.value) and "remat-verify" in str(ei.value)


def test_wrap_refuses_other_input_shapes_traced_differently():
    # A plan for inputs of one rank does not bind to a model that now reshapes them.
    plan, net, _, x = _plan_and_changed_model()

    class Flat(Net):
        def forward(self, x):
            return super().forward(x.reshape(3, 8))

    other = Flat(nn.ReLU())
    other.load_state_dict(net.state_dict())
    with pytest.raises(PlanMismatch, match="no longer produces the plan's graph"):
        remat_ir.wrap(other, plan)


def test_remat_run_refuses_a_changed_model_file(tmp_path, capsys):
    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(MODEL.format(act="ReLU"))
    new.write_text(MODEL.format(act="Tanh"))
    plan = tmp_path / "p.rir"
    assert compile_main([str(old), "-o", str(plan), "--quiet"]) == 0
    assert run_main([str(plan), str(old), "--steps", "1", "--check"]) == 0
    capsys.readouterr()
    assert run_main([str(plan), str(new), "--steps", "1", "--check"]) == 2
    err = capsys.readouterr().err
    assert "remat-run: error:" in err and "aten.tanh.default" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_remat_verify_with_the_model_names_the_line_that_differs(tmp_path, capsys):
    from remat_ir.cli.commands import verify_main

    old, new = tmp_path / "old.py", tmp_path / "new.py"
    old.write_text(MODEL.format(act="ReLU"))
    new.write_text(MODEL.format(act="Tanh"))
    plan = tmp_path / "p.rir"
    assert compile_main([str(old), "-o", str(plan), "--quiet"]) == 0
    assert verify_main([str(plan), "--model", str(old)]) == 0
    capsys.readouterr()
    # An edit of the graph section: refused by the fingerprint alone ...
    text = plan.read_text()
    edited = tmp_path / "edited.rir"
    edited.write_text(text.replace("aten.relu.default", "aten.sigmoid.default"))
    assert verify_main([str(edited)]) == 1
    out = capsys.readouterr().out
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("fingerprint "))
    assert f"{edited}:line {line}:" in out and "recompile the plan, or edit only the schedule" in out
    # ... and, with the model, at the node's own line.
    assert verify_main([str(edited), "--model", str(old)]) == 1
    out = capsys.readouterr().out
    node = next(i for i, ln in enumerate(text.splitlines(), 1) if "aten.relu.default" in ln)
    assert f"{edited}:line {node}:" in out and "aten.sigmoid.default" in out and "aten.relu.default" in out
    # The plan unedited, the model changed: bad input (exit 2), as remat-run says it.
    assert verify_main([str(plan), "--model", str(new)]) == 2
    assert f"{plan}:line {node}:" in capsys.readouterr().out
