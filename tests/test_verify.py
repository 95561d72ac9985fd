"""The verifier accepts valid programs and rejects broken ones at the right line."""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from remat_ir.ir import (
    BACKWARD, COMPUTE, FORWARD, FREE, GRAD, PARAM, RECOMPUTE, RESULT, TANGENT, VALUE, Budget, Instr,
    Ref, node_inputs,
)
from remat_ir.simulate import simulate
from remat_ir.verify import Diagnostic, needed_bytes, verify

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
        if len([o for o in p.outputs if o.kind == GRAD]) > len({n.name for n in p.nodes if n.op == "aten.mm_backward"}):
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


def test_mutating_node_recompute_vs_random_recompute_same_program():
    """The same position: a dropout recompute is fine, the buffer update is not."""
    for seed in range(200):
        p = random_program(seed, n_forward=12, with_buffer=True)
        rnd = [n for n in p.nodes if n.random and not n.mutates]
        pts = _recompute_points(p, rnd[0]) if rnd else []
        if pts:
            break
    else:  # pragma: no cover
        pytest.fail("no program with a recomputable dropout")
    sec, i = pts[-1]
    mut = next(n for n in p.nodes if n.mutates)
    good, bad = copy_program(p), copy_program(p)
    for q, node in ((good, rnd[0]), (bad, mut)):
        lst = q.forward if sec == "forward" else q.backward
        lst[i:i] = [Instr(RECOMPUTE, node.name)] + [Instr(FREE, o) for o in node.outputs if o]
        lined(q)
    check_ok(good)
    v = verify(bad)
    assert not v.ok and any("in place" in e.message for e in v.errors)


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


# ----------------------------------------------------------- targeted errors


def _prog(seed=5, **kw):
    return lined(random_program(seed, n_forward=16, **kw))


def test_free_of_a_parameter_and_of_a_result():
    p = _prog()
    param = next(v.name for v in p.values if v.kind == PARAM)
    result = next(o.value for o in p.outputs if o.kind == RESULT)
    p.backward[0:0] = [Instr(FREE, param), Instr(FREE, result)]
    v = verify(lined(p))
    assert [e.line for e in v.errors] == [p.backward[0].line, p.backward[1].line]
    assert "graph inputs live across steps and are never freed" in v.errors[0].message
    assert "forward result 0, which the caller holds" in v.errors[1].message


def test_reading_a_gradient_after_it_was_handed_over():
    p = _prog()
    nodes = p.node_map()
    grads = {o.value: o.key for o in p.outputs if o.kind == GRAD}
    i = next(i for i, ins in enumerate(p.backward)
             if ins.kind == COMPUTE and any(o in grads for o in nodes[ins.target].outputs))
    g = next(o for o in nodes[p.backward[i].target].outputs if o in grads)
    j = next(j for j in range(i + 1, len(p.backward)) if p.backward[j].kind == COMPUTE)
    nodes[p.backward[j].target].args.append(Ref(g))
    v = verify(p)
    assert [e.line for e in v.errors] == [p.backward[j].line], str(v)
    assert f"handed to autograd right after line {p.backward[i].line}" in v.errors[0].message


def test_freeing_a_gradient_output():
    p = _prog()
    g = next(o.value for o in p.outputs if o.kind == GRAD)
    p.backward.append(Instr(FREE, g))
    v = verify(lined(p))
    assert [e.line for e in v.errors] == [p.backward[-1].line]
    assert "autograd takes it" in v.errors[0].message


def test_tangent_read_in_forward():
    p = _prog()
    tangent = next(v.name for v in p.values if v.kind == TANGENT)
    p.node_map()[p.forward[0].target].args.append(Ref(tangent))
    v = verify(p)
    assert v.errors and v.errors[0].line == p.forward[0].line
    assert "tangent" in v.errors[0].message and "start of backward" in v.errors[0].message


def test_compute_twice_and_recompute_while_live():
    p = _prog()
    c = p.forward[0]
    p.forward[1:1] = [Instr(COMPUTE, c.target), Instr(RECOMPUTE, c.target)]
    v = verify(lined(p))
    assert [e.line for e in v.errors] == [p.forward[1].line, p.forward[2].line], str(v)
    assert f"was already computed at line {c.line}" in v.errors[0].message
    assert "is still live" in v.errors[1].message


def test_forward_node_first_computed_in_backward():
    p = _prog()
    nodes = p.node_map()
    i = max(i for i, ins in enumerate(p.forward) if ins.kind == COMPUTE and not nodes[ins.target].mutates)
    c = p.forward.pop(i)
    outs = [o for o in nodes[c.target].outputs if o]
    # Keep the frees that followed it consistent: move them too.
    moved = [c]
    while i < len(p.forward) and p.forward[i].kind == FREE and p.forward[i].target in outs:
        moved.append(p.forward.pop(i))
    p.backward[0:0] = moved
    v = verify(lined(p))
    assert any(e.line == c.line and "is a forward node but is first computed in the backward" in e.message
               for e in v.errors), str(v)


def test_backward_node_in_forward():
    p = _prog()
    c = next(ins for ins in p.backward if ins.kind == COMPUTE)
    p.forward.append(Instr(COMPUTE, c.target))
    v = verify(lined(p))
    assert any(e.line == p.forward[-1].line and "is a backward node and cannot run in the forward" in e.message
               for e in v.errors), str(v)


def test_read_of_a_buffer_after_its_in_place_update_is_allowed():
    """Like `native_batch_norm_backward` reading the running stats that
    `native_batch_norm` updated: a node after the update in the graph sees the
    updated data, which is what the graph says."""
    p = _prog(with_buffer=True)
    nodes = p.node_map()
    mut = next(n for n in p.nodes if n.mutates)
    buf = mut.mutates[0]
    i = next(i for i, ins in enumerate(p.backward) if ins.kind == COMPUTE)
    nodes[p.backward[i].target].args.append(Ref(buf))
    check_ok(p)


def test_reader_scheduled_before_the_in_place_update_it_follows():
    p = _prog(with_buffer=True)
    nodes = p.node_map()
    mut = next(n for n in p.nodes if n.mutates)
    buf = mut.mutates[0]
    i = next(i for i, ins in enumerate(p.forward) if ins.target == mut.name)
    # A node after the update (in graph and schedule order) also reads the buffer...
    j = next(j for j in range(i + 1, len(p.forward)) if p.forward[j].kind == COMPUTE)
    reader = p.forward[j]
    nodes[reader.target].args.append(Ref(buf))
    # ...but the update is now scheduled after it.
    block = [p.forward[i]] + [ins for ins in p.forward[i + 1:j] if ins.kind == FREE and ins.target == mut.outputs[0]]
    for ins in block:
        p.forward.remove(ins)
    k = p.forward.index(reader)
    p.forward[k + 1:k + 1] = block
    v = verify(lined(p))
    assert any(e.line == reader.line and f"reads {buf} before {mut.name} updates {buf} in place" in e.message
               for e in v.errors), str(v)


def test_reader_scheduled_after_the_in_place_update_it_precedes():
    p = _prog(with_buffer=True)
    mut = next(n for n in p.nodes if n.mutates)
    buf = mut.mutates[0]
    nodes = p.node_map()
    i = next(i for i, ins in enumerate(p.forward) if ins.target == mut.name)
    r = next(i for i, ins in enumerate(p.forward)
             if ins.kind == COMPUTE and ins.target != mut.name and buf in node_inputs(nodes[ins.target]))
    assert r < i
    p.forward.insert(i + 1, p.forward.pop(r))  # the reader now runs after the update
    v = verify(lined(p))
    assert not v.ok
    assert any("updated in place" in e.message for e in v.errors), str(v)


def _inplace_dropout(p):
    """(empty_like, bernoulli_, div_) of an in-place dropout, or None."""
    for n in p.nodes:
        if n.op == "aten.bernoulli_.float":
            e = n.mutates[0]
            div = next(m for m in p.nodes if m.mutates == [n.outputs[0]])
            return p.producer_map()[e], n, div
    return None


def _chain_points(p, chain):
    empty, bern, div = chain
    vals = p.value_map()
    e = empty.outputs[0]
    return [(sec, i) for sec, i, live, computed in _live_before(p)
            if div.name in computed and all(r in live for r in node_inputs(empty))
            and not any(vals[x].storage == e for x in live)]


def _find_inplace_dropout_program():
    for seed in range(300):
        p = random_program(seed, n_forward=12, p_dropout=0.4)
        chain = _inplace_dropout(p)
        if chain and _chain_points(p, chain):
            return p, chain
    pytest.fail("no program with a recomputable in-place dropout")  # pragma: no cover


def test_recompute_of_an_in_place_dropout_on_a_fresh_storage_is_accepted():
    """bernoulli_ updates its operand in place, but when empty_like was
    recomputed first the update applies once, to fresh data."""
    p, (empty, bern, div) = _find_inplace_dropout_program()
    sec, i = _chain_points(p, (empty, bern, div))[-1]
    lst = p.forward if sec == "forward" else p.backward
    e, b, d = empty.outputs[0], bern.outputs[0], div.outputs[0]
    lst[i:i] = [Instr(RECOMPUTE, empty.name), Instr(RECOMPUTE, bern.name), Instr(FREE, e),
                Instr(RECOMPUTE, div.name), Instr(FREE, b), Instr(FREE, d)]
    check_ok(lined(p))


def test_recompute_of_an_in_place_dropout_on_the_same_storage_is_rejected():
    p, (empty, bern, div) = _find_inplace_dropout_program()
    e, b, d = empty.outputs[0], bern.outputs[0], div.outputs[0]
    # Keep the temporary (and so its storage) alive instead of recomputing it.
    free_e = next(ins for ins in p.forward if ins.kind == FREE and ins.target == e)
    p.forward.remove(free_e)
    rec = Instr(RECOMPUTE, bern.name)
    p.backward += [rec, Instr(FREE, e), Instr(FREE, b)]
    v = verify(lined(p))
    assert not v.ok
    assert any(e_.line == rec.line and f"updates {e} in place and already did so" in e_.message
               and f"recompute {empty.name} first" in e_.message for e_ in v.errors), str(v)


def test_recompute_of_a_reader_after_a_later_update_is_rejected():
    """A node that read the temporary before div_ updated it cannot be
    recomputed on the updated storage."""
    p, (empty, bern, div) = _find_inplace_dropout_program()
    b, d = bern.outputs[0], div.outputs[0]
    # A reader of bernoulli_'s output placed between bernoulli_ and div_.
    probe = "probe"
    from remat_ir.ir import Node, Value
    bv = p.value_map()[b]
    p.values.append(Value(probe, VALUE, bv.dtype, list(bv.shape), list(bv.stride), probe,
                          needed_bytes(bv.shape, bv.stride, bv.dtype)))
    pos = [n.name for n in p.nodes].index(div.name)
    p.nodes.insert(pos, Node(probe, "aten.clone.default", [Ref(b)], {}, [probe], FORWARD))
    k = next(k for k, ins in enumerate(p.forward) if ins.target == div.name)
    p.forward[k:k] = [Instr(COMPUTE, probe), Instr(FREE, probe)]
    check_ok(lined(p))
    k = next(k for k, ins in enumerate(p.forward) if ins.target == div.name)
    rec = Instr(RECOMPUTE, probe)
    p.forward[k + 1:k + 1] = [rec, Instr(FREE, probe)]  # after div_, b still live
    v = verify(lined(p))
    assert [e.line for e in v.errors] == [rec.line], str(v)
    assert f"which {div.name} updated in place at line" in v.errors[0].message
    assert "after probe was first computed" in v.errors[0].message


def test_missing_gradient_output():
    p = _prog()
    k = next(k for k, o in enumerate(p.outputs) if o.kind == GRAD)
    key = p.outputs.pop(k).key
    v = verify(p)
    assert any(e.message.startswith(f"gradient of {key} is never produced") for e in v.errors), str(v)


def test_view_of_a_dead_storage():
    """A view cannot come back once its storage is gone."""
    p = _prog(seed=11)
    vals = p.value_map()
    nodes = p.node_map()
    fl = flat(p)
    for j, (_, _, ins) in enumerate(fl):
        if ins.kind != COMPUTE:
            continue
        node = nodes[ins.target]
        views = [o for o in node.outputs if o and vals[o].storage != o]
        if views and node.phase == FORWARD:
            break
    else:  # pragma: no cover
        pytest.skip("no forward view")
    vnode = node
    # Compute the view node again at the very end of backward, after everything is freed.
    p.backward.append(Instr(RECOMPUTE, vnode.name))
    v = verify(lined(p))
    assert not v.ok
    assert any(e.line == p.backward[-1].line for e in v.errors), str(v)


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
    """Timings live in tools/timings.py; here only that a big program passes."""
    p = random_program(1, n_forward=1400)
    assert len(p.nodes) >= 4000
    v = verify(p)
    assert v.ok, v
    assert v.report.peak_bytes == simulate(p).peak_bytes


# ---------------------------------------------------------------- text form


def test_parsed_program_errors_name_the_text_line():
    text_mod = pytest.importorskip("remat_ir.text")
    p = random_program(7, n_forward=20)
    src = text_mod.format_program(p)
    q = text_mod.parse_program(src)
    assert all(ins.line > 0 for ins in q.forward + q.backward)
    check_ok(q)
    lines = src.splitlines()
    # Move the first free of a value read again later to just before that reader.
    fl = flat(q)
    for j, (_, _, f) in enumerate(fl):
        if f.kind != FREE:
            continue
        k = next((k for k in range(j) if reads(q, fl[k][2], f.target)), None)
        if k is not None:
            break
    reader = fl[k][2]
    fl[j][0].remove(f)
    fl[k][0].insert(fl[k][0].index(reader), f)
    v = verify(q)
    assert not v.ok and v.errors[0].line == reader.line
    assert reader.target in lines[reader.line - 1]
    assert f"freed at line {f.line}" in v.errors[0].message
    assert f.target in lines[f.line - 1]
