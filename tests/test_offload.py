"""Offload: activations moved to host memory and back by plan instructions
(`offload V`, `reload V`, `wait V`; docs/08-memory-model.md).  The
simulator's two pools, the verifier's rules, and the runtime: bitwise
gradients and the measured device and host peaks as predicted."""
from __future__ import annotations

import pytest

from remat_ir.check.simulate import SimulationError, simulate
from remat_ir.ir import OFFLOAD, RELOAD, WAIT, Instr
from remat_ir.ir import sizes as sz
from remat_ir.ir.files import load_plan
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program

from offload_plans import candidates, kept_values, with_offloads

# x @ w, a relu, a sum as the loss, and its backward; relu is kept for backward.
TINY = """\
rir 1
model "tiny"
fingerprint ""
device cpu
optimizer none 0 bytes
has_loss true

values
  x       input    f32[2,4] 32 bytes source x
  w       param    f32[4,3] 48 bytes source w requires_grad
  d.loss  tangent  f32[] 4 bytes source "0"

graph forward
  mm f32[2,3] 24 bytes = aten.mm.default(x, w)
  relu f32[2,3] 24 bytes = aten.relu.default(mm)
  loss f32[] 4 bytes = aten.sum.default(relu)
graph backward
  d.relu f32[2,3] 24 bytes = aten.expand_copy.default(d.loss, [2, 3])
  d.mm f32[2,3] 24 bytes = aten.threshold_backward.default(d.relu, relu, 0)
  x.t f32[4,2] stride [1,4] view of x = aten.t.default(x)
  d.w f32[4,3] 48 bytes = aten.mm.default(x.t, d.mm)

forward
  compute mm
  compute relu
  free mm
  compute loss
backward
  compute d.relu
  free d.loss
  compute d.mm
  free d.relu
  free relu
  compute x.t
  compute d.w
  free x.t
  free d.mm

outputs
  result 0 = loss
  grad w = d.w
"""


def tiny(offloaded=("relu",)):
    return with_offloads(parse_program(TINY, "tiny.rir"), offloaded)


def plain_text(program) -> str:
    """`program`'s text without comments, one blank between words: easy to edit."""
    lines = []
    for ln in format_program(program).split("\n"):
        words = " ".join(ln.split("#")[0].split()) if not ln.startswith("#") else ln
        lines.append(("  " + words) if ln.startswith(" ") else words)
    return "\n".join(lines)


def _edit(text: str, old: str, new: str, count: int = 1) -> str:
    assert text.count(old) >= count, old
    return text.replace(old, new, count)


# ---------------------------------------------------------------- simulator


def _at(report, phase, target_line):
    return next(e for e in report.timeline if e.phase == phase and e.line == target_line)


def test_the_tiny_plan_reads_as_written():
    p = tiny()
    assert [(i.kind, i.target) for i in p.forward] == [
        ("compute", "mm"), ("compute", "relu"), ("offload", "relu"), ("free", "mm"), ("compute", "loss"),
        ("wait", "relu")]
    assert [(i.kind, i.target) for i in p.backward[2:5]] == [("reload", "relu"), ("wait", "relu"),
                                                            ("compute", "d.mm")]


@pytest.mark.parametrize("grads_present", [True, False])
def test_simulator_has_a_device_pool_and_a_host_pool(grads_present):
    plain = parse_program(TINY)
    p = tiny()
    before = simulate(plain, grads_present=grads_present, keep_timeline=True)
    r = simulate(p, grads_present=grads_present, keep_timeline=True)
    f, b = p.forward, p.backward
    # The offload allocates the host copy; the device keeps relu until the wait.
    off = _at(r, "forward", f[2].line)
    assert off.host == 24 and off.total == _at(before, "forward", parse_program(TINY).forward[1].line).total
    # Its wait releases relu's device storage: 24 bytes below the plan without offload from there ...
    wait = _at(r, "forward", f[5].line)
    assert wait.host == 24 and wait.total == _at(before, "forward", plain.forward[3].line).total - 24
    start = next(e for e in r.timeline if e.phase == "backward" and e.index == -1)
    start0 = next(e for e in before.timeline if e.phase == "backward" and e.index == -1)
    assert start.total == start0.total - 24 and start.host == 24
    # ... until the reload allocates it again (after `free d.loss`, 4 bytes); the reload's wait releases
    # the host copy.
    reload, back = _at(r, "backward", b[2].line), _at(r, "backward", b[3].line)
    assert reload.host == 24 and back.host == 0 and reload.total == back.total == \
        _at(before, "backward", plain.backward[0].line).total - 4
    assert reload.by_category["activations"] == 24 + 4  # relu again, and the loss
    # Peaks: the device peak is in backward (unchanged), the host peak at the offload.
    assert r.peak_bytes == before.peak_bytes and r.host_peak_bytes == 24 and r.offloads == 1
    assert r.host_peak.line == f[2].line and before.host_peak_bytes == 0 and before.host_peak is None
    assert all(e.host == 0 for e in before.timeline)


def test_offload_lowers_the_device_peak_where_the_value_would_be_live():
    """gpt2-tiny, every block's attention probabilities kept for backward:
    offloaded in between, they are off the device at the end of forward."""
    plan = load_plan("schedules/gpt2-tiny.rir")
    names = [n for n in kept_values(plan) if n.endswith("attn._softmax")]
    assert len(names) == 2
    p = with_offloads(plan, names)
    for gp in (True, False):
        a, b = simulate(plan, grads_present=gp, keep_timeline=True), simulate(p, grads_present=gp, keep_timeline=True)
        nbytes = sum(plan.value_map()[n].nbytes for n in names)
        assert b.host_peak_bytes == nbytes and b.peak_bytes <= a.peak_bytes
        end_a = next(e for e in a.timeline if e.phase == "backward" and e.index == -1)
        end_b = next(e for e in b.timeline if e.phase == "backward" and e.index == -1)
        assert end_b.total == end_a.total - nbytes and end_b.host == nbytes
        assert b.timeline[-1].host == 0 and b.timeline[-1].total == a.timeline[-1].total


def test_symbolic_plans_simulate_offloads_at_their_sizes():
    plan = load_plan("tests/plans/mlp-batch.rir")
    p = with_offloads(plan, ["h"])
    text = format_program(p)
    assert "  offload   h                              # host +256 B at B=8" in text
    for at in sz.ends(p):
        r = simulate(sz.instantiate(p, at))
        assert r.host_peak_bytes == 32 * at["B"]
        assert r.peak_bytes <= simulate(sz.instantiate(plan, at)).peak_bytes


# What the simulator cannot simulate, it refuses (the verifier says why, at the line).
REFUSED = [
    ("read on the host", "  compute loss\n  wait relu\n", "  wait relu\n  compute loss\n"),
    ("wait without a copy", "  compute mm\n", "  compute mm\n  wait mm\n"),
    ("double offload", "  offload relu\n", "  offload relu\n  offload relu\n"),
    ("reload while on the device", "  compute mm\n", "  compute mm\n  reload mm\n"),
    ("free while in flight", "  offload relu\n", "  offload relu\n  free relu\n"),
    ("offload of a view", "  compute x.t\n", "  compute x.t\n  offload x.t\n"),
    ("offload of a tangent", "  compute d.relu\n", "  offload d.loss\n  compute d.relu\n"),
    ("offload of the result", "  compute loss\n", "  compute loss\n  offload loss\n"),
    ("recompute while on the host", "  compute d.relu\n", "  recompute relu\n  compute d.relu\n"),
]


@pytest.mark.parametrize("what,old,new", REFUSED, ids=[r[0] for r in REFUSED])
def test_simulator_refuses_what_it_cannot_simulate(what, old, new):
    p = parse_program(_edit(plain_text(tiny()), old, new))
    with pytest.raises(SimulationError):
        simulate(p)
