"""The verifier's promise, as a property: edit a valid plan anywhere (its graph
section, its header or its schedule) and the edited plan is either refused
at a line (by the parser or by the verifier), or it runs right: gradients
bitwise equal to eager PyTorch and the measured peak as predicted.  It is
never "sound" and wrong.

REMAT_TRUST_EXAMPLES sets the number of edits (500 by default);
REMAT_TRUST_RANDOM=1 draws other edits than CI's fixed ones."""
from __future__ import annotations

import copy
import os

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import remat_ir
from remat_ir.ir import BACKWARD, COMPUTE, FORWARD, FREE, GRAD, RECOMPUTE, TANGENT, Instr, Ref
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.ir.syntax import RirSyntaxError
from remat_ir.runtime.load import LoadedModel
from remat_ir.runtime.run import run_plan

EXAMPLES = int(os.environ.get("REMAT_TRUST_EXAMPLES", 500))


class Tiny(nn.Module):
    """Small enough to run hundreds of times, yet with what plans must get
    right: a buffer updated in place (BatchNorm), a random op (dropout), views."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        return self.fc2(h).t()


def tiny_loss(out, x):
    return out.square().mean()


class Base(tuple):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return "Base(Tiny, x, plan)"


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    module = Tiny()
    x = torch.randn(5, 6)
    plan = remat_ir.compile(module, (x,), loss=tiny_loss, name="tiny")
    return Base((module, x, plan))


OPS = ["aten.relu.default", "aten.sigmoid.default", "aten.tanh.default", "aten.neg.default",
       "aten.t.default", "aten.clone.default"]


def edit_graph(p, data) -> None:
    what = data.draw(st.sampled_from(["op", "arg", "value", "flags", "grads", "header", "tangent"]))
    fwd = [n for n in p.nodes if n.args]
    if what == "op":
        n = data.draw(st.sampled_from(fwd))
        n.op = data.draw(st.sampled_from(OPS + [n.op.rsplit(".", 1)[0], n.op + "x"]))
    elif what == "arg":
        cands = [(n, i) for n in p.nodes for i, a in enumerate(n.args)
                 if type(a) in (int, float, bool) or isinstance(a, Ref)]
        n, i = data.draw(st.sampled_from(cands))
        a = n.args[i]
        if isinstance(a, Ref):
            n.args[i] = Ref(data.draw(st.sampled_from([v.name for v in p.values])))
        elif isinstance(a, bool):
            n.args[i] = not a
        else:
            n.args[i] = a + data.draw(st.sampled_from([1, -1, 0.5]))
    elif what == "value":
        v = data.draw(st.sampled_from(p.values))
        field = data.draw(st.sampled_from(["nbytes", "shape", "dtype", "stride", "storage", "kind"]))
        if field == "nbytes":
            v.nbytes = data.draw(st.sampled_from([v.nbytes * 100, v.nbytes + 4, 0]))
        elif field == "shape":
            v.shape = list(v.shape) + [1] if data.draw(st.booleans()) or not v.shape else v.shape[:-1]
        elif field == "dtype":
            v.dtype = data.draw(st.sampled_from(["float64", "float16", "int64", "bool"]))
        elif field == "stride":
            v.stride = [s + 1 for s in v.stride]
        elif field == "storage":
            v.storage = data.draw(st.sampled_from([w.name for w in p.values]))
        else:
            v.kind = data.draw(st.sampled_from(["input", "param", "buffer", "tangent", "value"]))
    elif what == "flags":
        n = data.draw(st.sampled_from(p.nodes))
        if n.random or n.mutates:
            n.random, n.mutates = False, []
        else:
            n.random = True
    elif what == "grads":
        grads = [o for o in p.outputs if o.kind == GRAD]
        a, b = data.draw(st.permutations(grads))[:2]
        a.value, b.value = b.value, a.value
    elif what == "header":
        h = p.header
        field = data.draw(st.sampled_from(["device", "optim", "bytes", "spec", "loss"]))
        if field == "device":
            h.device = "tpu"
        elif field == "optim":
            h.optim = "lion"
        elif field == "bytes":
            h.optim_state_bytes += 4096
        elif field == "spec":
            h.output_spec = "not json"
        else:
            h.has_loss = not h.has_loss
    else:
        t = next(v for v in p.values if v.kind == TANGENT)
        t.source = data.draw(st.sampled_from(["7", "-1", "x"]))


def edit_schedule(p, data) -> None:
    sections = [p.forward, p.backward]
    what = data.draw(st.sampled_from(["delete", "move", "duplicate", "recompute", "free"]))
    sec = data.draw(st.sampled_from(sections))
    i = data.draw(st.integers(0, len(sec) - 1))
    if what == "delete":
        del sec[i]
    elif what == "move":
        ins = sec.pop(i)
        dst = data.draw(st.sampled_from(sections))
        dst.insert(data.draw(st.integers(0, len(dst))), ins)
    elif what == "duplicate":
        sec.insert(data.draw(st.integers(0, len(sec))), sec[i])
    elif what == "recompute":
        n = data.draw(st.sampled_from([n for n in p.nodes if n.phase == FORWARD]))
        p.backward.insert(data.draw(st.integers(0, len(p.backward))), Instr(RECOMPUTE, n.name))
    else:
        v = data.draw(st.sampled_from(p.values))
        sec.insert(data.draw(st.integers(0, len(sec))), Instr(FREE, v.name))


def refused_at_a_line(text: str) -> bool | None:
    """True when the parser or the verifier refuses `text` naming a line, False
    when it refuses it without one, None when it accepts it."""
    try:
        plan = parse_program(text, "edited.rir")
    except RirSyntaxError as e:
        return e.line > 0
    verdict = remat_ir.verify(plan)
    if verdict.ok:
        return None
    return any(d.line > 0 for d in verdict.errors)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("REMAT_TRUST_RANDOM"),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_an_edited_plan_is_refused_at_a_line_or_runs_right(base, data):
    module, x, plan = base
    p = msgspec.convert(msgspec.to_builtins(plan), type(plan))  # a deep copy
    if data.draw(st.integers(0, 2), label="edit the schedule") < 2:
        edit_schedule(p, data)
    else:
        edit_graph(p, data)
    try:
        text = format_program(p)
    except ValueError:
        event("not printable")
        return  # no plan to judge
    verdict = refused_at_a_line(text)
    event("refused" if verdict is not None else "called sound: run and checked")
    if verdict is not None:
        assert verdict, "refused, but no line named:\n" + "\n".join(
            str(d) for d in remat_ir.verify(parse_program(text)).errors[:5])
        return
    # Called sound: it must run right.  check_model=False: the verifier's
    # word alone, not the model check wrap adds.
    model = LoadedModel("tiny", copy.deepcopy(module), (x,), tiny_loss)
    r = run_plan(parse_program(text), model, steps=1, check=True, check_model=False)
    assert r.grads_bitwise, ("sound but wrong", r.checks, text)
    assert r.within_tolerance(), ("sound but mispredicted", r.predicted.peak_bytes, r.measured_peak, text)


def test_the_unedited_plan_runs_right(base):
    module, x, plan = base
    text = format_program(plan)
    assert refused_at_a_line(text) is None
    r = run_plan(parse_program(text), LoadedModel("tiny", copy.deepcopy(module), (x,), tiny_loss),
                 steps=1, check=True)
    assert r.grads_bitwise and r.within_tolerance()
    assert any(n.random for n in plan.nodes) and any(n.mutates for n in plan.nodes)
    assert any(ins.kind == COMPUTE for ins in plan.backward) and BACKWARD
