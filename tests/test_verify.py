"""The verifier accepts valid programs and rejects broken ones at the right line.

Here: properties over random programs (valid ones pass, mutated ones fail at
the mutated line) and what a `.rir` text cannot express.  Fixed cases, one
broken plan and its messages at their lines, are files under
tests/diagnostics/verify/ (run by tests/test_diagnostics.py)."""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from remat_ir.ir import (
    BACKWARD, COMPUTE, FREE, GRAD, PARAM, RECOMPUTE, RESULT, TANGENT, VALUE, Budget, DType, Instr,
    Ref, Seq, Sym, contiguous_stride, node_inputs,
)
from remat_ir.ir.printer import with_lines
from remat_ir.check.simulate import optimizer_state_bytes, simulate
from remat_ir.check.verify import Diagnostic, needed_bytes, verify

try:  # tests/ as a package, or as a plain directory on sys.path
    from .programs import assign_lines, copy_program, programs, random_program
except ImportError:
    from programs import assign_lines, copy_program, programs, random_program

# REMAT_VERIFY_EXAMPLES=500 for a deeper run.
SETTINGS = settings(max_examples=int(os.environ.get("REMAT_VERIFY_EXAMPLES", 30)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ------------------------------------------------------------------ helpers


def flat(p):
    """[(section list, index, instr)] in execution order."""
    return [(p.forward, i, ins) for i, ins in enumerate(p.forward)] + \
           [(p.backward, i, ins) for i, ins in enumerate(p.backward)]


def reads(p, ins, name) -> bool:
    if ins.kind == FREE:
        return False
    return name in node_inputs(p.node_map()[ins.target])


def produces(p, ins, name) -> bool:
    return ins.kind != FREE and name in p.node_map()[ins.target].outputs


def pick(data, items, label):
    assume(items)
    return data.draw(st.sampled_from(items), label=label)


def lined(p):
    return assign_lines(p)


def line_errors(verdict, line):
    return [e for e in verdict.errors if e.line == line]


def check_ok(p):
    v = verify(p)
    assert v.ok, str(v)
    return v


# ---------------------------------------------------------------- valid ones


@SETTINGS
@given(programs())
def test_valid_programs_pass(p):
    v = check_ok(p)
    assert v.errors == [] and str(v) == "ok" and bool(v)
    assert v.report.peak_bytes == simulate(p).peak_bytes
    assert v.report.activation_peak_bytes == simulate(p).activation_peak_bytes
    assert v.report_first_step.peak_bytes == simulate(p, grads_present=False).peak_bytes


@pytest.mark.parametrize("seed", range(40))
def test_valid_programs_many_shapes(seed):
    rng = random.Random(seed)
    p = random_program(rng, n_forward=rng.randint(1, 60), with_buffer=bool(seed % 2),
                       extra_result=bool(seed % 3 == 0), p_frozen=0.3 if seed % 4 == 0 else 0.1)
    check_ok(lined(p))


def test_generator_covers_the_interesting_cases():
    """Across a handful of seeds the builder makes every feature the mutation tests need."""
    seen = set()
    for seed in range(30):
        p = random_program(seed, n_forward=25, with_buffer=True)
        vals = p.value_map()
        for n in p.nodes:
            if n.random:
                seen.add("random")
            if n.mutates:
                seen.add("mutates")
            if len([o for o in n.outputs if o]) > 1:
                seen.add("multi-output")
        for v in p.values:
            if v.storage != v.name:
                seen.add("view-bwd" if any(n.phase == BACKWARD and v.name in n.outputs for n in p.nodes)
                         else "view")
        for o in p.outputs:
            if o.kind == GRAD and vals[o.value].storage != o.value:
                seen.add("grad-view")
            if o.kind == RESULT and o.key == "1":
                seen.add("extra-result")
        if any(v.name.endswith(".acc") for v in p.values):
            seen.add("accumulate")
        if any(v.kind == PARAM and not v.requires_grad for v in p.values):
            seen.add("frozen")
    assert {"random", "mutates", "multi-output", "view", "view-bwd", "grad-view", "extra-result",
            "frozen"} <= seen


# ------------------------------------------------------------------ mutations


@SETTINGS
@given(programs(), st.data())
def test_free_moved_before_a_use(p, data):
    fl = flat(p)
    cands = []
    for j, (_, _, f) in enumerate(fl):
        if f.kind != FREE or p.value_map()[f.target].kind != VALUE:
            continue
        for k in range(j):
            if reads(p, fl[k][2], f.target):
                cands.append((j, k))
    j, k = pick(data, cands, "free/reader")
    free, reader = fl[j][2], fl[k][2]
    fl[j][0].remove(free)
    lst, idx = fl[k][0], fl[k][0].index(reader)
    lst.insert(idx, free)
    lined(p)
    v = verify(p)
    assert not v.ok
    e = v.errors[0]
    assert e.line == reader.line, str(v)
    assert f"reads {free.target}, which was freed at line {free.line}" in e.message
    assert f"move that free after line {reader.line}" in e.message
    assert str(e).startswith(f"line {reader.line}: ")


@SETTINGS
@given(programs(), st.data())
def test_compute_dropped(p, data):
    fl = flat(p)
    cands = [j for j, (_, _, ins) in enumerate(fl) if ins.kind == COMPUTE]
    j = pick(data, cands, "compute")
    lst, _, c = fl[j]
    node = p.node_map()[c.target]
    later_reader = next((ins for (_, _, ins) in fl[j + 1:]
                         if any(reads(p, ins, o) for o in node.outputs if o)), None)
    lst.remove(c)
    lined(p)
    v = verify(p)
    assert not v.ok
    assert any(e.message == f"node {node.name} is never computed; add `compute {node.name}` to the "
                            f"{node.phase} section" for e in v.errors), str(v)
    if later_reader is not None:
        errs = line_errors(v, later_reader.line)
        assert any(f"whose producer {node.name} is never computed" in e.message for e in errs), str(v)


@SETTINGS
@given(programs(), st.data())
def test_free_duplicated(p, data):
    fl = flat(p)
    j = pick(data, [j for j, (_, _, ins) in enumerate(fl) if ins.kind == FREE], "free")
    lst, i, f = fl[j]
    dup = Instr(FREE, f.target)
    lst.insert(i + 1, dup)
    lined(p)
    v = verify(p)
    assert not v.ok
    assert len(v.errors) == 1, str(v)
    e = v.errors[0]
    assert e.line == dup.line
    assert f"was already freed at line {f.line} (double free)" in e.message


@SETTINGS
@given(programs(), st.data())
def test_free_dropped_is_a_leak(p, data):
    fl = flat(p)
    vals = p.value_map()
    j = pick(data, [j for j, (_, _, ins) in enumerate(fl)
                    if ins.kind == FREE and vals[ins.target].kind == VALUE], "free")
    lst, _, f = fl[j]
    name = f.target
    last = next(ins for (_, _, ins) in reversed(fl[:j]) if reads(p, ins, name) or produces(p, ins, name))
    lst.remove(f)
    lined(p)
    v = verify(p)
    assert not v.ok
    assert len(v.errors) == 1, str(v)
    e = v.errors[0]
    assert e.line == last.line
    assert e.message.startswith(f"{name} is never freed") and "leak" in e.message
    assert f"add `free {name}` after line {last.line}" in e.message


@SETTINGS
@given(programs(), st.data())
def test_recompute_of_a_backward_node(p, data):
    nodes = p.node_map()
    cands = [i for i, ins in enumerate(p.backward)
             if ins.kind == COMPUTE and nodes[ins.target].phase == BACKWARD]
    i = pick(data, cands, "backward compute")
    pos = data.draw(st.integers(i + 1, len(p.backward)), label="position")
    rec = Instr(RECOMPUTE, p.backward[i].target)
    p.backward.insert(pos, rec)
    lined(p)
    v = verify(p)
    assert not v.ok
    assert any(f"recompute {rec.target}: {rec.target} is a backward node" in e.message
               for e in line_errors(v, rec.line)), str(v)


@SETTINGS
@given(programs(), st.data())
def test_nbytes_too_small_for_the_shape(p, data):
    cands = [i for i, val in enumerate(p.values)
             if val.storage == val.name and needed_bytes(val.shape, val.stride, val.dtype) > 0]
    i = pick(data, cands, "value")
    val = p.values[i]
    if data.draw(st.booleans(), label="shrink nbytes"):
        val.nbytes = needed_bytes(val.shape, val.stride, val.dtype) - 1
    else:
        assume(val.shape)
        val.shape = [val.shape[0] + 1] + val.shape[1:]
    v = verify(lined(p))
    assert not v.ok
    hits = [e for e in v.errors if e.section == "values" and e.index == i]
    assert any(f"value {val.name} " in e.message and f"nbytes is {val.nbytes}" in e.message for e in hits), str(v)
    assert str(hits[0]).startswith(f"values[{i}]: ")
    assert v.report is None


def _live_before(p):
    """For each (section, index) gap: the set of live values before that
    instruction in a sound program (index == len(section) is the end)."""
    nodes = p.node_map()
    grads = {o.value for o in p.outputs if o.kind == GRAD}
    live = {v.name for v in p.values if v.kind in ("input", "param", "buffer")}
    computed = set()
    out = []
    for name, instrs in (("forward", p.forward), ("backward", p.backward)):
        if name == "backward":
            live |= {v.name for v in p.values if v.kind == TANGENT}
        for i, ins in enumerate(instrs):
            out.append((name, i, set(live), set(computed)))
            if ins.kind == FREE:
                live.discard(ins.target)
            else:
                computed.add(ins.target)
                live |= {o for o in nodes[ins.target].outputs if o}
                live -= grads
        out.append((name, len(instrs), set(live), set(computed)))
    return out


def _recompute_points(p, node):
    """Where `node` may be recomputed: computed before, inputs live, outputs
    dead and no live view still holding an output's storage."""
    vals = p.value_map()
    outs = [o for o in node.outputs if o]
    ins = node_inputs(node)
    return [(sec, i) for sec, i, live, computed in _live_before(p)
            if node.name in computed and all(r in live for r in ins)
            and not any(vals[x].storage in outs for x in live)]


@SETTINGS
@given(programs(min_forward=6), st.data())
def test_recompute_of_a_random_node_is_accepted(p, data):
    rnd = [n for n in p.nodes if n.random and not n.mutates]
    assume(rnd)
    node = data.draw(st.sampled_from(rnd), label="random node")
    points = _recompute_points(p, node)
    sec, i = pick(data, points, "point")
    lst = p.forward if sec == "forward" else p.backward
    extra = [Instr(RECOMPUTE, node.name)] + [Instr(FREE, o) for o in node.outputs if o]
    lst[i:i] = extra
    v = check_ok(lined(p))
    assert v.report.peak_bytes == simulate(p).peak_bytes


@SETTINGS
@given(programs(min_forward=4, with_buffer=True), st.data())
def test_recompute_of_a_mutating_node_is_rejected(p, data):
    node = next(n for n in p.nodes if n.mutates)
    fl = flat(p)
    out = node.outputs[0]
    j = next(j for j, (_, _, ins) in enumerate(fl) if ins.kind == FREE and ins.target == out)
    lst, i, _ = fl[j]
    pos = data.draw(st.integers(i + 1, len(lst)), label="position")
    rec = Instr(RECOMPUTE, node.name)
    lst[pos:pos] = [rec, Instr(FREE, out)]
    v = verify(lined(p))
    assert not v.ok
    errs = line_errors(v, rec.line)
    assert any(f"updates {node.mutates[0]} in place and already did so at line" in e.message
               and "twice" in e.message for e in errs), str(v)
    assert all(e.line == rec.line for e in v.errors), str(v)


@SETTINGS
@given(programs(), st.data())
def test_use_of_an_undeclared_value(p, data):
    fl = flat(p)
    j = pick(data, [j for j, (_, _, ins) in enumerate(fl) if ins.kind == COMPUTE], "compute")
    ins = fl[j][2]
    p.node_map()[ins.target].args.append(Ref("no.such.value"))
    v = verify(lined(p))
    assert not v.ok
    assert len(v.errors) == 1, str(v)
    assert v.errors[0].line == ins.line
    assert f"compute {ins.target} reads no.such.value, which is not a declared value" in v.errors[0].message


def test_free_of_an_undeclared_value_suggests_a_name():
    p = random_program(3, n_forward=10)
    name = p.forward[0].target
    p.backward.append(Instr(FREE, name + "x"))
    v = verify(lined(p))
    assert [e.line for e in v.errors] == [p.backward[-1].line]
    assert "no value is named" in v.errors[0].message


@SETTINGS
@given(programs(), st.sampled_from(["total", "activations"]), st.data())
def test_budget(p, scope, data):
    lined(p)
    steady, first = simulate(p), simulate(p, grads_present=False)
    rep = steady if steady.scope_peak(scope) >= first.scope_peak(scope) else first
    peak = rep.scope_peak(scope)
    ev = rep.peak if scope == "total" else rep.activation_peak
    slack = data.draw(st.integers(0, 100), label="slack")
    p.header.budget = Budget(peak + slack, scope)
    check_ok(p)
    assume(peak > 0)
    p.header.budget = Budget(max(0, peak - 1 - slack), scope)
    v = verify(p)
    assert not v.ok
    assert len(v.errors) == 1, str(v)
    e = v.errors[0]
    assert e.line == ev.line and e.index == ev.index
    assert f"({peak} B) exceeds the budget" in e.message
    assert v.report is not None and v.report.peak_bytes == steady.peak_bytes  # sound, just too big


# ------------------------------- errors a .rir text cannot show; reporting


def _prog(seed=5, **kw):
    return lined(random_program(seed, n_forward=16, **kw))


def test_graph_consistency_errors():
    p = _prog()
    val = next(v for v in p.values if v.kind == VALUE and v.storage != v.name)
    val.storage = "nowhere"
    dup = copy_program(p).values[0]
    p.values.append(dup)
    p.values[1].dtype = "float33"
    v = verify(p)
    msgs = [str(e) for e in v.errors]
    assert any(f"value {val.name} is a view of storage nowhere, which is not a declared value" in m for m in msgs)
    assert any("is declared twice" in m for m in msgs)
    assert any("unknown dtype 'float33'" in m for m in msgs)


def test_errors_are_sorted_and_capped():
    p = _prog(seed=2)
    p.forward = [ins for ins in p.forward if ins.kind != FREE]
    p.backward = [ins for ins in p.backward if ins.kind != FREE]
    v = verify(lined(p), max_errors=7)
    assert len(v.errors) == 7 and v.omitted > 0
    assert [e.line for e in v.errors] == sorted(e.line for e in v.errors)
    assert str(v).endswith(f"... and {v.omitted} more errors")


def test_diagnostic_str():
    assert str(Diagnostic(57, "boom", "forward", 3)) == "line 57: boom"
    assert str(Diagnostic(0, "boom", "forward", 12)) == "forward[12]: boom"
    assert str(Diagnostic(0, "boom", "backward", -1)) == "start of backward: boom"
    assert str(Diagnostic(0, "boom")) == "boom"


def test_unlined_programs_report_section_and_index():
    p = random_program(4, n_forward=10)
    f = next(i for i, ins in enumerate(p.backward) if ins.kind == FREE)
    p.backward.insert(f + 1, Instr(FREE, p.backward[f].target))
    v = verify(p)
    assert [str(e).split(":")[0] for e in v.errors] == [f"backward[{f + 1}]"]
    assert f"already freed at backward[{f}]" in v.errors[0].message


# ------------------------------------------------------------------- scale


def test_verify_a_4000_node_program():
    """Timings live in tools/stage_times.py; here only that a big program passes."""
    p = random_program(1, n_forward=1400)
    assert len(p.nodes) >= 4000
    v = verify(p)
    assert v.ok, v
    assert v.report.peak_bytes == simulate(p).peak_bytes


# ------------------------------------------------- the graph's type check
#
# Fixed cases (one edit of a plan's graph section or header, and its message
# at its line) are files under tests/diagnostics/verify/; here: properties over
# random programs, whose graphs are real (tests/programs.py runs each op under
# FakeTensorMode), and what a `.rir` text cannot express.


def printed(p):
    """`p` with every line as `format_program` prints it (values, nodes and
    header included), as remat-verify sees a plan file."""
    return with_lines(p)


def type_errors(v):
    return [e for e in v.errors if e.section in ("nodes", "values", "header")]


@SETTINGS
@given(programs(), st.data())
def test_wrong_output_facts_are_reported_at_the_value(p, data):
    """An output's dtype, shape, stride, byte count or storage owner edited:
    the error names the value, at the line declaring it."""
    p = printed(p)
    prods = p.producer_map()
    cands = [v for v in p.values if v.kind == VALUE and v.name in prods]
    v = pick(data, cands, "value")
    edit = data.draw(st.sampled_from(["dtype", "shape", "stride", "bytes", "view"]), label="edit")
    if edit == "dtype":
        assume(v.storage == v.name)  # (a view twice as wide would overrun its storage)
        assume(v.dtype in ("float32", "float64"))  # (bool -> f64 is 8x the bytes, not 2x)
        v.dtype = "float64" if v.dtype != "float64" else "float32"
        v.nbytes = needed_bytes(v.shape, v.stride, v.dtype)
        want = f"{v.name} is declared f64[" if v.dtype == "float64" else f"{v.name} is declared f32["
    elif edit == "shape":
        assume(v.shape and v.storage == v.name)
        v.shape = [v.shape[0] + 1] + v.shape[1:]
        v.stride = contiguous_stride(v.shape)
        v.nbytes = needed_bytes(v.shape, v.stride, v.dtype)
        want = f"{v.name} is declared"
    elif edit == "stride":
        sig = [i for i, d in enumerate(v.shape) if d > 1]
        assume(sig)
        i = data.draw(st.sampled_from(sig), label="dim")
        assume(v.stride[i] > 0)
        v.stride[i] -= 1  # smaller: still inside the storage
        want = f"{v.name} is declared with stride {v.stride}"
    elif edit == "bytes":
        assume(v.storage == v.name and v.nbytes > 0)
        v.nbytes *= 100
        want = f"{v.name} is declared with {v.nbytes} bytes of storage"
    else:
        assume(v.storage != v.name)
        v.storage, v.nbytes = v.name, needed_bytes(v.shape, v.stride, v.dtype)
        want = f"{v.name} is declared with a storage of its own"
    verdict = verify(p)
    assert not verdict.ok
    assert any(e.line == v.line and want in e.message for e in verdict.errors), (want, str(verdict))
    # Each node is checked on its declared operands: errors stay at the edit or
    # at the nodes reading the edited value (their lines, their outputs' lines).
    vals = p.value_map()
    readers = [n for n in p.nodes if v.name in node_inputs(n)]
    near = {v.line} | {n.line for n in readers} | {vals[o].line for n in readers for o in n.outputs if o}
    # ... or at a tangent, when the edited value is a result (its gradient).
    if any(o.kind == "result" and o.value == v.name for o in p.outputs):
        near |= {t.line for t in p.values if t.kind == "tangent"}
    assert all(e.line in near for e in type_errors(verdict)), str(verdict)


@SETTINGS
@given(programs(), st.data())
def test_wrong_node_facts_are_reported_at_the_node(p, data):
    """An op misspelt or without its overload, `random` or `mutates(...)`
    removed or added: the error is at the node's line."""
    p = printed(p)
    edit = data.draw(st.sampled_from(["misspelt", "overload", "random", "not-random", "mutates"]),
                     label="edit")
    if edit == "misspelt":
        n = pick(data, [n for n in p.nodes if n.op == "aten.mm.default"], "node")
        n.op, want = "aten.mmm.default", "did you mean `aten.mm.default`?"
    elif edit == "overload":
        n = pick(data, [n for n in p.nodes if n.op.endswith(".default")], "node")
        short = n.op[:-len(".default")]
        n.op, want = short, f"op {short} names no overload"
    elif edit == "random":
        n = pick(data, [n for n in p.nodes if n.random], "node")
        n.random, want = False, "draws from the RNG, but the node is not marked `random`"
    elif edit == "not-random":
        n = pick(data, [n for n in p.nodes if not n.random], "node")
        n.random, want = True, f"is marked `random`, but {n.op} does not draw from the RNG"
    else:
        n = pick(data, [n for n in p.nodes if n.mutates], "node")
        n.mutates, want = [], "in place, but the node does not say so"
    verdict = verify(p)
    assert any(e.line == n.line and want in e.message for e in verdict.errors), str(verdict)
    assert all(e.line == n.line for e in type_errors(verdict)), str(verdict)


def test_graph_false_skips_the_type_check():
    p = printed(random_program(6, n_forward=12))
    n = next(n for n in p.nodes if n.op == "aten.mm.default")
    n.op = "aten.mm"
    assert not verify(p).ok
    assert verify(p, graph=False).ok


def test_graph_errors_carry_the_lines_of_a_printed_plan():
    """Errors about values, nodes and the header name their lines, not
    `values[i]` or `header`."""
    p = printed(random_program(7, n_forward=10))
    val = next(v for v in p.values if v.kind == VALUE and v.storage == v.name and v.nbytes)
    val.nbytes -= 1
    n = p.nodes[3]
    p.forward = [ins for ins in p.forward if ins.target != n.name]
    p.header.device = "tpu"
    verdict = verify(p)
    by_line = {e.line: e.message for e in verdict.errors}
    assert "needs" in by_line[val.line] and f"nbytes is {val.nbytes}" in by_line[val.line]
    assert f"node {n.name} is never computed" in by_line[n.line]
    assert "device 'tpu' is not one the runtime runs plans on" in by_line[p.header.lines["device"]]
    assert all(e.line > 0 for e in verdict.errors), str(verdict)


def test_gradient_binding_dtype():
    p = random_program(8, n_forward=8)
    o = next(o for o in p.outputs if o.kind == GRAD)
    target = p.value_map()[o.key]
    target.dtype, target.nbytes = "float64", target.nbytes * 2
    v = verify(lined(p), graph=False)
    assert [e.message for e in v.errors] == [
        f"the gradient of {o.key} is {o.value} of dtype float32, but {o.key} is float64"]
    assert v.errors[0].line == o.line


def test_header_facts():
    p = random_program(9, n_forward=6)
    p.header.device, p.header.optim, p.header.output_spec = "tpu", "lion", "{not json"
    tangent = next(v for v in p.values if v.kind == TANGENT)
    tangent.source = "2"
    msgs = [str(e) for e in verify(p).errors]
    assert any(m.startswith("header: device 'tpu' is not one the runtime runs plans on") for m in msgs), msgs
    assert any("optimizer 'lion' is unknown" in m for m in msgs), msgs
    assert any("output_spec is not a serialized pytree treespec" in m for m in msgs), msgs
    assert any(f"tangent {tangent.name} has source '2'" in m for m in msgs), msgs
    p.header.device, p.header.optim, p.header.output_spec, tangent.source = "cuda", "sgd", "", "0"
    assert [str(e) for e in verify(p).errors] == [
        f"header: optimizer sgd keeps 1 tensor per trainable parameter, "
        f"{optimizer_state_bytes(p, 'sgd')} bytes for this plan's parameters, but the header says 0 bytes; "
        f"write `optimizer sgd {optimizer_state_bytes(p, 'sgd')} bytes`"]
    p.header.optim_state_bytes = optimizer_state_bytes(p, "sgd")
    assert verify(p).ok  # fake CUDA tensors: no GPU needed to check a CUDA plan


def _tiny(graph: str, schedule: str, outputs: str = "  result 0 = y\n") -> str:
    return ("rir 1\nmodel \"t\"\nfingerprint \"\"\ndevice cpu\noptimizer none 0 bytes\nhas_loss false\n"
            "output_spec \"\"\n\nvalues\n  x input f32[4] 16 bytes source x\n\ngraph forward\n" + graph +
            "graph backward\n\nforward\n" + schedule + "backward\n\noutputs\n" + outputs)


def test_ops_that_cannot_be_checked_are_reported_not_raised():
    from remat_ir.ir.parser import parse_program
    text = _tiny("  y i64[4,1] 32 bytes = aten.nonzero.default(x)\n", "  compute y\n")
    v = verify(parse_program(text))
    assert [(e.line, e.message) for e in v.errors] == [
        (13, "node y: the output of aten.nonzero.default depends on the data, which a static plan cannot "
             "hold (DynamicOutputShapeException); its outputs cannot be checked")]
    for op, words in [("aten.mm.default", "cannot run on the declared operands (x f32[4])"),
                      ("foo.bar.baz", "op foo.bar.baz does not exist in this PyTorch build"),
                      ("aten.relu.nosuch", "aten.relu has no overload 'nosuch'; did you mean"),
                      ("aten", "op aten does not exist"), ("", "op  does not exist")]:
        p = parse_program(_tiny("  y f32[4] 16 bytes = aten.relu.default(x)\n", "  compute y\n"))
        p.nodes[0].op = op
        p.nodes[0].args = [Ref("x"), Ref("x")] if op == "aten.mm.default" else p.nodes[0].args
        got = [e.message for e in verify(p).errors]
        assert len(got) == 1 and words in got[0], (op, got)
    # Arguments that are not what they say.
    p = parse_program(_tiny("  y f64[4] 32 bytes = aten.to.dtype(x, torch.float64)\n", "  compute y\n"))
    assert verify(p).ok
    p.nodes[0].args[1] = DType("float33")
    assert [e.message for e in verify(p).errors] == [
        "node y: an argument of aten.to.dtype cannot be made: torch.float33 is not a dtype"]


def test_an_op_that_changes_an_operand_in_place_does_not_mislead_later_nodes():
    """`t_` transposes its operand in place: the next node that reads the
    operand is checked on the operand as declared, not as `t_` left it."""
    from remat_ir.ir.parser import parse_program
    text = _tiny("  a f32[2,2] view of x = aten.view.default(x, [2, 2])\n"
                 "  b f32[2,2] 16 bytes = aten.clone.default(a)\n"
                 "  c f32[2,2] stride [1,2] view of b = aten.t_.default(b) mutates(b)\n"
                 "  y f32[2,2] 16 bytes = aten.mul.Tensor(b, c)\n",
                 "  compute a\n  compute b\n  compute c\n  compute y\n  free a\n  free b\n  free c\n")
    p = parse_program(text)
    from remat_ir.check.typecheck import typecheck
    assert typecheck(p) == []


def test_typecheck_of_a_traced_plan_matches_the_tracer():
    """The golden plans were traced by the tracer; the type check re-derives
    every fact of their graphs and finds them all."""
    import glob
    from remat_ir.ir.files import load_plan
    from remat_ir.check.typecheck import typecheck
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plans = sorted(glob.glob(os.path.join(root, "schedules", "*.rir")))
    assert plans
    for path in plans:
        assert typecheck(load_plan(path)) == [], path


@pytest.mark.parametrize("device, ok", [
    ("cpu", True), ("cuda", True), ("cuda:0", True), ("cuda:7", True), ("cuda:127", True),
    ("meta", False), ("tpu", False), ("mps", False), ("xpu", False), ("cpu:0", False), ("cuda:128", False),
    ("cuda:01", False), ("cuda:-1", False), ("CUDA", False), ("cuda ", False), ("", False), ("x" * 5000, False),
])
def test_devices_the_runtime_runs(device, ok):
    """A plan's device (header and `device(...)` arguments) is cpu, cuda or
    cuda:N: a `meta` plan verified and died in remat-run (no autocast, RNG
    or memory accounting for meta), and cuda:128 is cuda:-128 to torch.  An
    index beyond this machine's GPUs is refused by the run, not here."""
    from remat_ir.check.typecheck import device_problem

    p = random_program(9, n_forward=6)
    p.header.device = device
    msgs = [str(e) for e in verify(p).errors]
    assert (device_problem(device) == "") is ok
    if ok:
        assert msgs == [], msgs
    else:
        assert len(msgs) == 1 and msgs[0].startswith("header: device ") and "write cpu, cuda or cuda:N" in msgs[0]
        assert len(msgs[0]) < 400, msgs[0]


def test_a_plan_with_its_loss_returns_one_scalar():
    """has_loss true (the tracer took a loss function) means the step returns
    the loss, one tensor of one element, which remat-run calls .backward()
    on; a plan that says so and returns more or other was sound and
    refused by remat-run."""
    from remat_ir.ir.parser import parse_program

    try:
        from .test_diagnostics import PLAN
    except ImportError:
        from test_diagnostics import PLAN
    p = parse_program(PLAN)
    assert verify(p).ok
    two = parse_program(PLAN.replace("  result 0 = loss\n", "  result 0 = loss\n  result 1 = mm\n"))
    line = two.header.lines["has_loss"]
    assert [d.message for d in verify(two).errors if d.line == line] == [
        "the plan includes its loss (has_loss true), but its step returns 2 results, not one tensor of one "
        "element: a training step cannot call .backward() on it"]
    without = parse_program(PLAN.replace("  result 0 = loss\n", "  result 0 = loss\n  result 1 = mm\n")
                            .replace("has_loss true", "has_loss false"))
    assert not any("has_loss" in d.message for d in verify(without).errors)


# ------------------------------------------------------------ symbolic plans

SYMBOLIC_PLAN = os.path.join(os.path.dirname(__file__), "plans", "mlp-batch.rir")


def _symbolic():
    from remat_ir.ir.files import load_plan

    return load_plan(SYMBOLIC_PLAN)


def _fingerprinted():
    from remat_ir.ir.fingerprint import fingerprint

    p = _symbolic()
    p.header.fingerprint = fingerprint(p)
    return p


def test_symbolic_plan_verifies_over_its_range():
    from remat_ir.ir import sizes as sz

    p = _fingerprinted()
    v = verify(p)
    assert v.ok, str(v)
    # The report is the high end's (B=8): x alone is 8*16 bytes there.
    high = verify(sz.instantiate(p, {"B": 8}))
    assert v.report.peak_bytes == high.report.peak_bytes


@pytest.mark.parametrize("edit", [
    lambda p: setattr(p.value_map()["a"], "shape", ["B+1", 8]),
    lambda p: setattr(p.value_map()["a"], "nbytes", "32*B+4"),
    lambda p: setattr(p.value_map()["h.t"], "stride", [1, "8*B"]),
    lambda p: p.nodes[4].args.__setitem__(1, Seq([Sym("B+1"), 3])),
    lambda p: setattr(p.header, "sizes", ["B=2..9"]),
    lambda p: setattr(p.header, "size_guards", ["B != 3"]),
])
def test_editing_a_symbolic_plan_breaks_its_fingerprint(edit):
    p = _fingerprinted()
    edit(p)
    v = verify(p)
    assert not v.ok
    assert any("no longer matches its fingerprint" in d.message for d in v.errors), str(v)


def test_symbolic_budget_is_checked_at_both_ends():
    from remat_ir.ir import Budget
    from remat_ir.ir import sizes as sz

    p = _symbolic()
    def peak(v):
        return max(v.report.peak_bytes, v.report_first_step.peak_bytes)

    low, high = (peak(verify(sz.instantiate(p, s))) for s in sz.ends(p))
    assert low < high
    p.header.budget = Budget((low + high) // 2, "total")
    v = verify(p)
    assert not v.ok and len(v.errors) == 1
    assert v.errors[0].message.startswith("at B=8: peak memory (total)"), v.errors[0]
    p.header.budget = Budget(high, "total")
    assert verify(p).ok


def test_symbolic_expressions_are_checked():
    p = _symbolic()
    p.value_map()["a"].shape = ["B*(", 8]
    p.nodes[0].args.append(Sym("Q"))
    p.header.size_guards = ["B <", "Z > 1"]
    p.header.sizes = ["B=2..8", "B=1..2", "T=4..1"]
    msgs = [d.message for d in verify(p).errors]
    assert any("size symbol B is given two ranges" in m for m in msgs), msgs
    assert any("size range: 'T=4..1'" in m for m in msgs), msgs
    assert any("value a: dimension: 'B*(' is not a size expression" in m for m in msgs), msgs
    assert any("size argument `Q` names the size symbol Q" in m for m in msgs), msgs
    assert any("size guard `Z > 1` names the size symbol Z" in m for m in msgs), msgs
    assert any(m.startswith("size guard: 'B <'") for m in msgs), msgs
