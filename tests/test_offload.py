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


# ----------------------------------------------------------------- verifier


@pytest.fixture(scope="module")
def offload_plans():
    """Sound plans with offloads: the tiny plan, mlp's and gpt2-tiny's with
    every value they keep for backward offloaded, and gpt2-tiny's with only
    its attention probabilities."""
    mlp, gpt2 = load_plan("schedules/mlp.rir"), load_plan("schedules/gpt2-tiny.rir")
    return {"tiny": tiny(), "mlp": with_offloads(mlp, candidates(mlp)),
            "gpt2-tiny": with_offloads(gpt2, candidates(gpt2)),
            "gpt2-tiny-softmax": with_offloads(gpt2, [n for n in kept_values(gpt2) if n.endswith("._softmax")])}


def test_plans_with_offloads_verify(offload_plans):
    from remat_ir.check.verify import verify

    for name, p in offload_plans.items():
        v = verify(p, graph=name == "tiny")
        assert v.ok, (name, str(v))
        assert v.report.host_peak_bytes > 0 and v.report.offloads == sum(i.kind == OFFLOAD for i in p.forward)
    gpt2 = load_plan("schedules/gpt2-tiny.rir")
    assert len(candidates(gpt2)) == len(kept_values(gpt2)) == 27  # every value kept for backward
    # Everything kept for backward off the device: the device peak is lower, the host holds it.
    before, after = simulate(gpt2), simulate(offload_plans["gpt2-tiny"])
    assert after.peak_bytes < before.peak_bytes and after.host_peak_bytes > 0


def test_the_host_budget_is_checked_on_plans_with_offloads(offload_plans):
    from remat_ir.check.verify import verify

    p = offload_plans["mlp"]
    peak = simulate(p).host_peak_bytes
    p.header.host_budget = peak
    assert verify(p, graph=False).ok
    p.header.host_budget = peak - 1
    v = verify(p, graph=False)
    assert not v.ok and len(v.errors) == 1 and "exceeds the host budget" in v.errors[0].message
    assert v.errors[0].line == simulate(p).host_peak.line
    p.header.host_budget = None


MUTATIONS = ("read an offloaded value", "drop a reload", "move a reload after its use", "double offload",
             "wait before its copy", "drop a wait")


def _positions(p, v):
    """Where the plan offloads value `v`: forward offload and wait, backward reload and wait."""
    fwd = [i for i, ins in enumerate(p.forward) if ins.target == v and ins.kind in (OFFLOAD, WAIT)]
    bwd = [i for i, ins in enumerate(p.backward) if ins.target == v and ins.kind in (RELOAD, WAIT)]
    assert len(fwd) == len(bwd) == 2
    return fwd[0], fwd[1], bwd[0], bwd[1]


def mutate(p, v, mutation, pick):
    """(the plan with `mutation` applied to value `v`'s offload, the line
    the verifier must refuse first), or None when the mutation does not apply
    to `v` (no forward read between its offload and its wait)."""
    from remat_ir.ir import node_inputs

    nodes = p.node_map()
    fwd, bwd = list(p.forward), list(p.backward)
    off, w1, rel, w2 = _positions(p, v)
    ins_off, ins_w1, ins_rel, ins_w2 = fwd[off], fwd[w1], bwd[rel], bwd[w2]
    where = None  # (section, index) of the expected error, in the mutated lists

    def reads(ins):
        return ins.kind in ("compute", "recompute") and v in node_inputs(nodes[ins.target])

    if mutation == "read an offloaded value":
        between = [i for i in range(off + 1, w1) if reads(fwd[i])]
        if not between:
            return None
        del fwd[w1]
        fwd.insert(off + 1, ins_w1)  # the wait right after the offload: forward's later reads read the host
        where = ("forward", between[0] + 1)
    elif mutation == "drop a reload":
        del bwd[rel]
        where = ("backward", rel)  # the wait, with no copy in flight
    elif mutation == "move a reload after its use":
        del bwd[rel:w2 + 1]
        use = next(i for i in range(rel, len(bwd)) if reads(bwd[i]))  # (other values' reloads may come first)
        bwd[use + 1:use + 1] = [ins_rel, ins_w2]
        where = ("backward", use)
    elif mutation == "double offload":
        fwd.insert(off + 1, Instr(OFFLOAD, v))
        where = ("forward", off + 1)
    elif mutation == "wait before its copy":
        del fwd[w1]
        fwd.insert(off, ins_w1)
        where = ("forward", off)
    elif pick:  # drop the offload's wait: the reload finds the copy to the host unwaited
        del fwd[w1]
        where = ("backward", rel)
    else:  # drop the reload's wait: the reload is never waited (and the first read reads while in flight)
        del bwd[w2]
        where = ("backward", rel)
    import msgspec

    q = parse_program(format_program(msgspec.structs.replace(p, forward=fwd, backward=bwd)), "mutant.rir")
    section, index = where
    return q, (q.forward if section == "forward" else q.backward)[index].line


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    given = None


@pytest.mark.skipif(given is None, reason="needs hypothesis")
def test_mutations_of_offload_plans_are_refused_at_their_line(offload_plans):
    from remat_ir.check.verify import verify

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(offload_plans)), st.data(), st.sampled_from(MUTATIONS), st.booleans())
    def check(name, data, mutation, pick):
        p = offload_plans[name]
        offloaded = [i.target for i in p.forward if i.kind == OFFLOAD]
        v = data.draw(st.sampled_from(offloaded))
        got = mutate(p, v, mutation, pick)
        if got is None:
            return
        q, line = got
        verdict = verify(q, graph=False)
        assert not verdict.ok, (name, v, mutation)
        lines = sorted(d.line for d in verdict.errors)
        assert lines[0] == line, (name, v, mutation, line, str(verdict))
        first = next(d for d in verdict.errors if d.line == line)
        assert v in first.message and first.line > 0

    check()


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_mutation_is_refused_on_the_tiny_plan(mutation):
    from remat_ir.check.verify import verify

    for pick in (True, False):
        q, line = mutate(tiny(), "relu", mutation, pick)
        verdict = verify(q)
        assert not verdict.ok and min(d.line for d in verdict.errors) == line, (mutation, str(verdict))


# ------------------------------------------------------------------ runtime


def _offloaded(name: str, which: str):
    plan = load_plan(f"schedules/{name}.rir")
    names = candidates(plan)
    return plan, with_offloads(plan, names if which == "all" else names[:3])


@pytest.mark.parametrize("name", ["mlp", "gpt2-tiny"])
@pytest.mark.parametrize("which", ["all", "three largest"])
def test_offload_plans_run_bitwise_and_as_predicted(name, which):
    """Every step's gradients and loss bitwise eager's (dropout included),
    and both pools measured as predicted: the device to the 4 bytes plans
    without offload hold, the host pool exactly, first and later steps."""
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import run_plan

    plan, p = _offloaded(name, which)
    r = run_plan(p, load_model(name), steps=3, check=True, check_model=False)
    assert r.grads_bitwise and r.loss_bitwise and len(r.checks) == 3, r.checks
    assert 0 <= r.measured_first_peak - r.predicted_first.peak_bytes <= 4
    assert 0 <= r.measured_peak - r.predicted.peak_bytes <= 4
    assert r.predicted.host_peak_bytes > 0
    assert r.measured_first_host_peak == r.predicted_first.host_peak_bytes == r.predicted.host_peak_bytes
    assert r.measured_host_peak == r.predicted.host_peak_bytes
    assert r.within_tolerance()
    # Off the device between forward and backward: the device peak is not higher than without offload.
    assert r.predicted.peak_bytes <= simulate(plan).peak_bytes


class _MlpBatch:
    """The model of tests/plans/mlp-batch.rir: relu(x @ w1) @ w2, summed by its loss."""

    @staticmethod
    def build(batch: int):
        import torch

        from remat_ir.runtime.load import LoadedModel

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w1 = torch.nn.Parameter(torch.randn(4, 8))
                self.w2 = torch.nn.Parameter(torch.randn(8, 3))

            def forward(self, x):
                return torch.relu(x @ self.w1) @ self.w2

        torch.manual_seed(0)
        return LoadedModel(name="mlp-batch", module=M(), inputs=(torch.randn(batch, 4),),
                           loss=lambda out, x: out.sum())


@pytest.mark.parametrize("batch", [2, 5, 8])
def test_a_symbolic_plan_with_offloads_runs_at_each_size_as_predicted(batch):
    from remat_ir.check.verify import verify
    from remat_ir.runtime.run import run_plan

    p = with_offloads(load_plan("tests/plans/mlp-batch.rir"), ["h"])
    assert verify(p).ok
    r = run_plan(p, _MlpBatch.build(batch), steps=2, check=True, check_model=False)
    assert r.grads_bitwise and r.loss_bitwise
    assert r.measured_host_peak == r.measured_first_host_peak == r.predicted.host_peak_bytes == 32 * batch
    assert 0 <= r.measured_peak - r.predicted.peak_bytes <= 4
    assert 0 <= r.measured_first_peak - r.predicted_first.peak_bytes <= 4


def test_a_traced_model_runs_with_offloads_checked_against_its_model():
    """A plan traced here (not a stored one), its activations offloaded,
    wrapped with the model check on: as eager, bitwise, and as predicted."""
    import copy

    import torch

    import remat_ir
    from remat_ir.check.verify import verify
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import run_plan
    from remat_ir.trace.tracer import trace_module

    m = load_model("mlp")
    program = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name="mlp")
    names = candidates(program)
    assert len(names) >= 4
    p = with_offloads(program, names)
    assert verify(p).ok  # the graph type-checked too
    r = run_plan(p, load_model("mlp"), steps=2, check=True)
    assert r.grads_bitwise and r.within_tolerance()
    assert r.measured_host_peak == r.predicted.host_peak_bytes > 0
    # wrap's own model: two steps, .grad as eager's.
    wrapped, eager = remat_ir.wrap(copy.deepcopy(m.module), p, loss=m.loss), copy.deepcopy(m.module)
    for _ in range(2):
        for mod in (wrapped, eager):
            torch.manual_seed(5)
            out = mod(*m.inputs)
            (out if m.loss is None else m.loss(out, *m.inputs)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(wrapped.parameters(), eager.parameters()))


def test_generated_code_calls_the_transfers():
    from remat_ir.runtime.interpret import Executable

    p = tiny()
    exe = Executable(p)
    src = exe.forward_fn.source
    assert "X.offload('relu', E['relu'])" in src and "X.wait('relu', E)" in src
    assert exe.offloads and not exe.host_frees
    back = "".join(fn.source for fn, _ in exe.segments)
    assert back.index("X.reload('relu')") < back.index("X.wait('relu', E)") < back.index("E['d.mm'] =")
    assert "del E['relu']" in back  # freed on the device, after its reload
    # A value freed while on the host drops its host buffer.
    text = _edit(plain_text(tiny()), "  compute relu\n", "  offload mm\n  compute relu\n  wait mm\n")
    q = parse_program(text)
    exe = Executable(q)
    assert [q.forward.index(i) for i in q.forward if id(i) in exe.host_frees] == [5]
    assert "X.free('mm')" in exe.forward_fn.source and "del E['mm']" not in exe.forward_fn.source


class _FakeEvent:
    def __init__(self, log, n):
        self.log, self.n = log, n

    def record(self, stream):
        self.log.append(("record", self.n, stream.name))


class _FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, ev):
        self.log.append(("wait", self.name, ev.n))


class FakeStreams:
    """`CudaStreams` on CPU: streams and events that log what is asked of them."""

    def __init__(self):
        import contextlib

        self.log = []
        self.compute, self.copy = _FakeStream(self.log, "compute"), _FakeStream(self.log, "copy")
        self.current = "compute"
        self.n_events = 0
        self.pinned_made = []
        self._contextlib = contextlib

    def compute_stream(self):
        return self.compute

    def copy_stream(self):
        return self.copy

    def event(self):
        self.n_events += 1
        return _FakeEvent(self.log, self.n_events)

    def on(self, stream):
        @self._contextlib.contextmanager
        def ctx():
            self.log.append(("enter", stream.name))
            yield
            self.log.append(("exit", stream.name))

        return ctx()

    def pinned(self, nbytes):
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_made.append(buf)
        self.log.append(("pinned", nbytes))
        return buf


def test_stream_copies_order_the_copy_stream_by_events():
    """The CUDA path's stream and event logic, on fakes: an offload's copy
    waits on the copy stream for the compute stream's work, its `wait` makes
    the compute stream wait for the copy (never the host); a reload
    allocates on the compute stream first; pinned buffers come back to a
    pool keyed by bytes and are reused."""
    import torch

    from remat_ir.runtime.memtrack import HostBytes
    from remat_ir.runtime.offload import StreamCopies, Transfers

    fake, host = FakeStreams(), HostBytes()
    copies = StreamCopies(fake, host_bytes=host)
    x = torch.randn(3, 5)[:, 1:4]  # a view with an offset: the whole storage travels
    env = {"v": x}
    t = Transfers(copies, torch.device("cpu"))
    t.offload("v", x)
    assert fake.log == [("pinned", 60), ("record", 1, "compute"), ("wait", "copy", 1), ("enter", "copy"),
                        ("exit", "copy"), ("record", 2, "copy")]
    assert host.live == 60 and "v" in env
    fake.log.clear()
    t.wait("v", env)
    assert fake.log == [("wait", "compute", 2)] and "v" not in env
    t.reload("v")
    assert fake.log[1:] == [("record", 3, "compute"), ("wait", "copy", 3), ("enter", "copy"), ("exit", "copy"),
                            ("record", 4, "copy")]
    assert "v" not in env  # not readable before its wait
    t.wait("v", env)
    assert fake.log[-1] == ("wait", "compute", 4)
    back = env["v"]
    assert torch.equal(back, x) and back.stride() == x.stride() and back.storage_offset() == x.storage_offset()
    assert back.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert host.live == 0 and host.peak == 60 and copies.pool == {60: fake.pinned_made}
    # The next step reuses the pinned buffer; a buffer of other bytes is new.
    t2 = Transfers(copies, torch.device("cpu"))
    t2.offload("v", x)
    t2.offload("w", torch.ones(7))
    assert len(fake.pinned_made) == 2 and host.live == 88
    t2.wait("v", env)
    t2.free("v")
    t2.clear()
    assert host.live == 0 and sorted(copies.pool) == [28, 60]


def test_plans_run_bitwise_through_the_stream_copy_logic(monkeypatch):
    """A whole plan run by the CUDA path's copy engine (on fake streams):
    gradients as eager's, and the pool's buffers reused from step to step."""
    import torch

    from remat_ir.runtime import interpret
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.memtrack import HostBytes
    from remat_ir.runtime.offload import StreamCopies
    from remat_ir.runtime.run import check_gradients

    fake, host = FakeStreams(), HostBytes()
    monkeypatch.setattr(interpret, "copies_for", lambda device: StreamCopies(fake, host_bytes=host))
    _, p = _offloaded("gpt2-tiny", "all")
    checks = check_gradients(p, load_model("gpt2-tiny"), steps=3, check_model=False)
    assert all(c.grads_equal and c.loss_equal for c in checks)
    n_offloads = sum(i.kind == OFFLOAD for i in p.forward)
    assert host.live == 0 and host.peak == simulate(p).host_peak_bytes
    # Each step offloads every value; the buffers of the first step serve the later ones.
    assert len(fake.pinned_made) == n_offloads
    assert sum(1 for e in fake.log if e[0] == "wait" and e[1] == "compute") == 3 * 2 * n_offloads
    assert torch.is_tensor(fake.pinned_made[0])


# ---------------------------------------------------------------- commands


@pytest.fixture(scope="module")
def mlp_offload_file(tmp_path_factory):
    from remat_ir.ir.files import save_plan

    _, p = _offloaded("mlp", "all")
    p.header.host_budget = simulate(p).host_peak_bytes
    path = tmp_path_factory.mktemp("offload") / "mlp-offload.rir"
    save_plan(p, path)
    return path


def test_commands_report_the_host_pool(mlp_offload_file, capsys):
    import json

    from remat_ir.cli.commands import run_main, verify_main

    host = simulate(load_plan(mlp_offload_file)).host_peak_bytes
    assert verify_main([str(mlp_offload_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_host_peak_bytes"] == host
    assert verify_main([str(mlp_offload_file)]) == 0
    out = capsys.readouterr().out
    assert "offloaded to the host: 14 copies, host pool peak 769.3 KiB at line" in out
    assert run_main([str(mlp_offload_file), "mlp", "--steps", "2", "--check", "--json", "--no-model-check"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["predicted_host_peak_bytes"] == data["measured_host_peak_bytes"] == host
    assert data["predicted_first_step_host_peak_bytes"] == data["measured_first_step_host_peak_bytes"] == host
    assert data["grads_bitwise"] and data["memory_within_tolerance"]
    assert run_main([str(mlp_offload_file), "mlp", "--steps", "1", "--no-model-check"]) == 0
    table = capsys.readouterr().out
    assert "host pool, first step" in table and "host pool, later step" in table
    assert "host pool, later step          769.3 KiB   769.3 KiB     0.00%" in table


def test_show_lists_the_offloads_and_draws_the_host_pool(mlp_offload_file, tmp_path, capsys):
    from remat_ir.cli.show import main

    assert main([str(mlp_offload_file)]) == 0
    out = capsys.readouterr().out
    assert "offloaded to the host: 14 values, host peak 769.3 KiB at line" in out
    assert "(host budget 769.3 KiB)" in out
    row = next(ln for ln in out.splitlines() if "  net.1.relu  (" in ln)
    assert row.strip().startswith("64.0 KiB") and "offload line" in row and "reload line" in row
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main([str(mlp_offload_file), "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_show_without_offloads_says_nothing_of_them(capsys):
    from remat_ir.cli.show import main

    assert main(["schedules/mlp.rir"]) == 0
    assert "offload" not in capsys.readouterr().out
