"""The verifier's promise, as a property: edit a valid plan anywhere (its graph
section, its header or its schedule) and the edited plan is either refused
at a line (by the parser or by the verifier), or it runs right: gradients
bitwise equal to eager PyTorch and the measured peak as predicted.  It is
never "sound" and wrong.

Header values (device, optimizer and its bytes, cost, budget, output_spec,
has_loss) and argument literals (floats with inf, nan and `1e999`, integers
past int64, strings, nested lists, None, devices) are edited too, half the
time with the fingerprint blanked (a hand-written plan): then the promise is
"sound means runnable": refused at a line, or `remat-run --check` runs it
(its numbers may differ from eager's: the model check would say so).

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
from remat_ir.ir import (
    BACKWARD, COMPUTE, FORWARD, FREE, GRAD, PARAM, RECOMPUTE, TANGENT, Budget, Device, Instr, Ref, Seq, Special,
)
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.ir.syntax import RirSyntaxError
from remat_ir.ir.types import OPTIMIZER_STATES
from remat_ir.runtime.bind import PlanMismatch
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


def edit_graph(p, data) -> str:
    """Edit the graph section or the header; returns what kind of edit."""
    what = data.draw(st.sampled_from(["op", "arg", "value", "flags", "grads", "header", "header", "tangent", "literal",
                                      "literal"]))
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
        edit_header(p, data)
    elif what == "literal":
        edit_literal(p, data)
    else:
        t = next(v for v in p.values if v.kind == TANGENT)
        t.source = data.draw(st.sampled_from(["7", "-1", "x"]))
    return what


# A float that prints as itself and stands for `1e999` in the text (replaced
# after printing: a float that large is infinity, which prints as `inf`).
BIG = 1.2345e300
BIG_TEXT = "1.2345e+300"
TUPLE_SPEC_2 = '[1, {"type": "builtins.tuple", "context": "null", "children_spec": [' \
    '{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]'


def edit_header(p, data) -> None:
    h = p.header
    field = data.draw(st.sampled_from(["device", "optim", "bytes", "cost", "budget", "spec", "loss"]))
    if field == "device":
        h.device = data.draw(st.sampled_from(["tpu", "meta", "mps", "xpu", "cpu:0", "cuda:128", "cuda:-1", "garbage",
                                              "", " cpu", "cpu", "cuda", "cuda:0"]))
    elif field == "optim":
        h.optim = data.draw(st.sampled_from(["lion", "", "sgd", "adam", "none"]))
        if h.optim in OPTIMIZER_STATES and data.draw(st.booleans()):  # with its right bytes
            h.optim_state_bytes = OPTIMIZER_STATES[h.optim] * sum(
                v.nbytes for v in p.values if v.kind == PARAM and v.requires_grad)
    elif field == "bytes":
        h.optim_state_bytes = data.draw(st.sampled_from([h.optim_state_bytes + 4096, -1, 2 ** 70]))
    elif field == "cost":
        h.cost = data.draw(st.sampled_from(["flops", "profile", "bogus"]))
    elif field == "budget":
        h.budget = data.draw(st.sampled_from([None, Budget(0), Budget(1 << 62), Budget(1 << 62, "activations"),
                                              Budget(-1), Budget(10 ** 30), Budget(10 ** 6, "bogus")]))
    elif field == "spec":
        h.output_spec = data.draw(st.sampled_from(["not json", "", "[1, {}]", TUPLE_SPEC_2]))
    else:
        h.has_loss = not h.has_loss


def literals():
    """Argument literals, the ones the runtime takes and the others."""
    scalars = st.one_of(
        st.floats(), st.sampled_from([BIG, -BIG, 1e308, -0.0, 0.7, 1.5]),
        st.integers(), st.sampled_from([2 ** 63 - 1, 2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 30, 0, 1, -1]),
        st.text(max_size=3), st.none(), st.booleans(),
        st.builds(Special, st.sampled_from(["inf", "-inf", "nan"])),
        st.builds(Device, st.sampled_from(["cpu", "meta", "cuda:0"])),
    )
    return st.one_of(scalars, st.recursive(scalars, lambda inner: st.builds(Seq, st.lists(inner, max_size=3)),
                                           max_leaves=4),
                     st.integers(30, 40).map(lambda d: _nested(d)))


def _nested(depth: int) -> Seq:
    a = Seq([1])
    for _ in range(depth - 1):
        a = Seq([a])
    return a


def edit_literal(p, data) -> None:
    """One argument, or one item of a list argument, of some node becomes a
    drawn literal (most often one that is a literal already: not a tensor)."""
    slots = []  # (container, key, is a literal now)
    for n in p.nodes:
        for i, a in enumerate(n.args):
            slots.append((n.args, i, not isinstance(a, Ref)))
            if isinstance(a, Seq):
                slots += [(a.items, k, not isinstance(x, Ref)) for k, x in enumerate(a.items)]
        for k, a in n.kwargs.items():
            slots.append((n.kwargs, k, not isinstance(a, Ref)))
    literal = [s for s in slots if s[2]]
    container, key, _ = data.draw(st.sampled_from(literal if literal and data.draw(st.integers(0, 3)) else slots))
    container[key] = data.draw(literals())


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
    hand_written = False
    if data.draw(st.sampled_from(["schedule", "schedule", "graph"]), label="edit") == "schedule":
        edit_schedule(p, data)
    else:
        what = edit_graph(p, data)
        if what in ("header", "literal") and data.draw(st.booleans(), label="blank the fingerprint"):
            p.header.fingerprint = ""
            hand_written = True
        event(f"{what} edit" + (", fingerprint blanked" if hand_written else ""))
    try:
        text = format_program(p).replace(BIG_TEXT, "1e999")
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
    sound = parse_program(text)
    if hand_written:
        # No fingerprint ties the graph to the model (the model check does,
        # off here): the plan must run, right or not.
        if torch.device(sound.header.device).type != "cpu":
            event("hand-written, sound, for a GPU: not run here")
            return
        try:
            run_plan(sound, model, steps=1, check=True, check_model=False)
        except PlanMismatch as e:  # remat-run's word for a step that is no loss (exit 2)
            assert not sound.header.has_loss and "not a scalar loss" in str(e), ("sound but not runnable", e, text)
        event("hand-written, sound: ran")
        return
    r = run_plan(sound, model, steps=1, check=True, check_model=False)
    assert r.grads_bitwise, ("sound but wrong", r.checks, text)
    assert all(c.loss_equal for c in r.checks), ("sound but the loss differs", r.checks, text)
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
