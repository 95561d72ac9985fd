"""A call's non-tensor arguments are constants of the plan, recorded in its header.

`remat_ir.compile(m, (x,), {"scale": 2.0})` makes a plan whose header lists
`scale=2.0` (not the forward's default): the model check retraces with it,
the fingerprint covers it, a plan wrap refuses a call with another value by
name, and a budget wrap plans again for it.  Values are Python literals;
anything else is marked as such and cannot be rebuilt for the model check.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import remat_ir
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.runtime.bind import PlanMismatch
from remat_ir.trace.calls import constant_text, read_constant, rebuildable, split_call


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x, mask=None, *, scale: float = 1.0, mode: str = "square"):
        h = self.drop(torch.relu(self.fc1(x)))
        if mask is not None:
            h = h * mask
        y = self.fc2(h) * scale
        return (y.square() if mode == "square" else y.abs()).mean()


class Opaque:
    """A constant that is no Python literal."""

    def __init__(self, k: float):
        self.k = k


class WithObject(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, cfg=None):
        return (self.fc(x) * (cfg.k if cfg is not None else 1.0)).square().mean()


def _steps(model, x, kwargs, n: int = 3):
    """`n` AdamW steps on `model(x, **kwargs)` (a scalar loss); the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(n):
        torch.manual_seed(10 + i)  # the same dropout masks for eager and the plan
        loss = model(x, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_constant_text_round_trips_literals():
    for v in [None, True, 0, -3, 2.0, -0.0, 1e-300, "a=b", b"\x00", (), (1,), [1, (2.5, None)],
              {"k": [True, "v"], 3: None}, float("inf"), -float("inf"), [float("inf")]]:
        text = constant_text(v)
        assert rebuildable(text), text
        back = read_constant(text)
        assert back == v and type(back) is type(v) and repr(back) == repr(v), (v, text)
    import ast

    # The infinities are literals ast.literal_eval itself reads; NaN is `nan`.
    assert constant_text(float("inf")) == "1e999" and ast.literal_eval("-1e999") == -math.inf
    assert constant_text(float("nan")) == "nan" and math.isnan(read_constant("nan"))
    assert constant_text(torch.float16) == "<dtype torch.float16>"
    assert constant_text(Opaque(2.0)) == "<Opaque object>"  # its repr holds an address
    assert constant_text([1, Opaque(2.0)]) == "<list object>" or not rebuildable(constant_text([1, Opaque(2.0)]))
    assert not rebuildable(constant_text(Opaque(2.0)))
    with pytest.raises(ValueError, match="not a Python literal"):
        read_constant("<Opaque object>")
    with pytest.raises(ValueError, match="not a Python literal"):
        read_constant("__import__('os')")


def test_only_the_constants_a_call_passes_are_named():
    net, x, t = Net(), torch.randn(2, 8), torch.ones(2, 16)
    c = split_call(net, (x,), {"scale": 2.0})
    assert c.names == ["x"] and c.constants == ["scale=2.0"]
    assert c.defaults == {"mask": "None", "scale": "1.0", "mode": "'square'"}
    # Positional or keyword, the same names; a None passed is a constant.
    assert split_call(net, (x, None), {"mode": "abs"}).constants == ["mask=None", "mode='abs'"]
    assert split_call(net, (x, t)).constants == []

    class Nested(torch.nn.Module):
        def forward(self, pair, *rest, **kw):
            return pair[0]

    c = split_call(Nested(), ([x, None, 3],), {"sizes": (2, 3), "flag": True})
    # Inside an argument holding tensors each leaf is named; one without, whole.
    assert c.names == ["pair.0"]
    assert c.constants == ["pair.1=None", "pair.2=3", "sizes=(2, 3)", "flag=True"]
    assert split_call(Nested(), (x, 1.5, t)).constants == ["input1=1.5"]


def test_constants_are_in_the_header_and_the_fingerprint():
    net, x = Net(), torch.randn(4, 8)
    plan = remat_ir.compile(net, (x,), {"scale": 2.0, "mode": "abs"})
    assert plan.header.constants == ["scale=2.0", "mode='abs'"]
    text = format_program(plan)
    assert "constants \"scale=2.0\", \"mode='abs'\"" in text
    back = parse_program(text)
    assert back.header.constants == plan.header.constants
    assert back.header.fingerprint == plan.header.fingerprint
    assert remat_ir.verify(back).ok
    other = remat_ir.compile(net, (x,), {"scale": 3.0, "mode": "abs"})
    default = remat_ir.compile(net, (x,))
    assert default.header.constants == []
    prints = {plan.header.fingerprint, other.header.fingerprint, default.header.fingerprint}
    assert len(prints) == 3
    # The default passed explicitly: recorded as passed, a graph like the default's.
    explicit = remat_ir.compile(net, (x,), {"scale": 1.0})
    assert explicit.header.constants == ["scale=1.0"]
    assert [n.op for n in explicit.nodes] == [n.op for n in default.nodes]


def test_plan_wrap_with_a_non_default_constant_trains_as_eager():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    eager = copy.deepcopy(net)
    plan = remat_ir.compile(net, (x,), {"scale": 2.0})
    w = remat_ir.wrap(net, plan)  # the model check retraces with scale=2.0, not the default
    assert [torch.equal(a, b) for a, b in zip(_steps(w, x, {"scale": 2.0}), _steps(eager, x, {"scale": 2.0}))] \
        == [True] * 3
    assert _same(net, eager)

    # Another value, or the default by leaving it out, is refused by name, checked or not.
    for check in (True, False):
        w = remat_ir.wrap(net, plan, check_model=check)
        with pytest.raises(PlanMismatch, match=r"argument scale is 3.0 but the plan was made with scale=2.0"):
            w(x, scale=3.0)
        with pytest.raises(PlanMismatch, match=r"argument scale is not passed \(its default is 1.0\) but the "
                                               r"plan was made with scale=2.0"):
            w(x)
        with pytest.raises(PlanMismatch, match=r"argument mode is 'abs' but the plan was made without it "
                                               r"\(its default, 'square'\)"):
            w(x, scale=2.0, mode="abs")
    # Passing a default explicitly is the same call as leaving it out.
    w(x, scale=2.0, mode="square", mask=None).backward()
    w0 = remat_ir.wrap(net, remat_ir.compile(net, (x,)))
    w0(x, scale=1.0).backward()


def test_budget_wrap_plans_again_for_another_constant(tmp_path, monkeypatch):
    pytest.importorskip("cvxpy")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    eager = copy.deepcopy(net)
    w = remat_ir.wrap(net, budget="floor")
    for scale in (2.0, 3.0):
        assert [torch.equal(a, b) for a, b in zip(_steps(w, x, {"scale": scale}), _steps(eager, x, {"scale": scale}))] \
            == [True] * 3
        assert _same(net, eager)
    plans = [r.program for r in remat_ir.planner(w).plans.values()]
    assert [p.header.constants for p in plans] == [["scale=2.0"], ["scale=3.0"]]
    assert plans[0].header.fingerprint != plans[1].header.fingerprint
    assert len(list(tmp_path.glob("*.rir"))) == 2  # cached apart: the key holds the fingerprint


def test_a_constant_that_is_no_literal():
    torch.manual_seed(0)
    m, x = WithObject(), torch.randn(4, 8)
    plan = remat_ir.compile(m, (x,), {"cfg": Opaque(2.0)})
    assert plan.header.constants == ["cfg=<Opaque object>"]
    with pytest.raises(PlanMismatch, match=r"argument cfg=<Opaque object>, which cannot be built again.*"
                                           r"check_model=False"):
        remat_ir.wrap(m, plan)
    w = remat_ir.wrap(m, plan, check_model=False)
    eager = copy.deepcopy(m)
    assert torch.equal(w(x, cfg=Opaque(2.0)), eager(x, cfg=Opaque(2.0)))
    # Told apart by its text alone: another type is refused, another Opaque is not.
    with pytest.raises(PlanMismatch, match=r"argument cfg is None but the plan was made with cfg=<Opaque object>"):
        w(x, cfg=None)
