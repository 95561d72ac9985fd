"""The `.rir` text format: round trips, errors, files."""
from __future__ import annotations

import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat_ir import ir, text
from remat_ir.ir import (
    Budget, Device, DType, Header, Instr, Layout, MemoryFormat, Node, Output, Program, Ref, Seq,
    Special, Value,
)
from remat_ir.text import (
    RirSyntaxError, format_program, human_bytes, load_plan, parse_program, save_plan, with_lines,
)

# ------------------------------------------------------------- strategies

SEGMENTS = ["transformer", "h", "0", "11", "attn", "c_attn", "addmm", "ln_1", "weight", "bias", "d",
            "mlp", "native_layer_norm_backward", "idx", "x", "input", "value", "param", "graph",
            "forward", "backward", "outputs", "values", "free", "compute", "_", "true", "none",
            "inf", "nan", "torch", "float32", "device", "view", "of", "bytes", "result", "grad", "é"]

segment = st.sampled_from(SEGMENTS)
path_name = st.builds(
    lambda first, rest: first + "".join(sep + s for sep, s in rest),
    segment, st.lists(st.tuples(st.sampled_from([".", ":"]), segment), max_size=4))
any_text = st.text(max_size=12)
name = st.one_of(path_name, path_name, path_name, any_text)
small_int = st.integers(min_value=0, max_value=2 ** 40)
i64 = st.integers(min_value=-2 ** 63, max_value=2 ** 63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
DTYPE_NAMES = sorted(ir.DTYPE_SHORT) + ["uint16", "complex32"]


def scalar_args(refs: list[str]):
    opts = [
        st.none(), st.booleans(), i64, finite, any_text,
        st.builds(DType, st.sampled_from(sorted(text.DTYPES))),
        st.builds(Layout, st.sampled_from(sorted(text.LAYOUTS))),
        st.builds(MemoryFormat, st.sampled_from(sorted(text.MEMORY_FORMATS))),
        st.builds(Device, st.one_of(st.sampled_from(["cpu", "cuda", "cuda:0", "meta"]), any_text)),
        st.builds(Special, st.sampled_from(["inf", "-inf", "nan"])),
    ]
    if refs:
        opts.append(st.builds(Ref, st.sampled_from(refs)))
    return st.one_of(*opts)


def args_of(refs: list[str]):
    return st.recursive(scalar_args(refs), lambda inner: st.builds(Seq, st.lists(inner, max_size=3)),
                        max_leaves=6)


@st.composite
def programs(draw) -> Program:
    header = Header(
        version=1,
        model=draw(any_text),
        fingerprint=draw(st.one_of(st.text("0123456789abcdef", max_size=12), any_text)),
        device=draw(st.one_of(st.sampled_from(["cpu", "cuda", "cuda:0"]), any_text)),
        cost=draw(st.sampled_from(ir.COST_MODELS)),
        optimizer=draw(st.one_of(st.sampled_from(["none", "sgd", "adam"]), any_text)),
        optimizer_bytes=draw(small_int),
        budget=draw(st.one_of(st.none(), st.builds(Budget, small_int,
                                                   st.sampled_from(["total", "activations"])))),
        output_spec=draw(st.one_of(st.just(""), st.just('[1, {"type": null, "context": "null"}]'),
                                   any_text)),
        has_loss=draw(st.booleans()),
        comment=draw(st.lists(st.one_of(st.just(""), any_text, st.just(" padded "), st.just('"q"')),
                              max_size=3)),
    )
    names = draw(st.lists(name, min_size=1, max_size=12, unique=True))
    n_inputs = draw(st.integers(min_value=0, max_value=len(names)))
    input_names, produced = names[:n_inputs], names[n_inputs:]

    def value(nm: str, kind: str) -> Value:
        shape = draw(st.lists(st.integers(min_value=0, max_value=4096), max_size=4))
        stride = draw(st.one_of(st.just(ir.contiguous_stride(shape)),
                                st.lists(st.integers(min_value=0, max_value=10 ** 6),
                                         min_size=len(shape), max_size=len(shape))))
        view_of = draw(st.one_of(st.none(), st.none(), st.sampled_from(names)))
        owner = view_of is None or view_of == nm
        return Value(
            name=nm, kind=kind, dtype=draw(st.sampled_from(DTYPE_NAMES)), shape=shape, stride=stride,
            storage=nm if owner else view_of,
            nbytes=draw(small_int) if owner else draw(st.sampled_from([0, 0, 12])),
            source=draw(st.one_of(st.just(""), path_name, any_text)) if kind != ir.VALUE or
            draw(st.booleans()) else "",
            requires_grad=draw(st.booleans()),
            aliases=draw(st.lists(st.one_of(path_name, any_text), max_size=2)),
        )

    values = [value(nm, draw(st.sampled_from([ir.INPUT, ir.PARAM, ir.BUFFER, ir.TANGENT])))
              for nm in input_names]
    # Split the produced values over nodes: 1-3 outputs each, some "" outputs.
    nodes: list[Node] = []
    node_names: set[str] = set()
    produced_values: list[Value] = []
    rest = list(produced)
    phase = ir.FORWARD
    while rest or (not nodes and draw(st.booleans())):
        k = draw(st.integers(min_value=1 if rest else 0, max_value=min(3, len(rest))))
        outs, rest = rest[:k], rest[k:]
        outputs = list(outs)
        for _ in range(draw(st.integers(min_value=0, max_value=2))):
            outputs.insert(draw(st.integers(min_value=0, max_value=len(outputs))), "")
        if outputs and draw(st.integers(min_value=0, max_value=9)) == 0 and produced_values:
            outputs.append(produced_values[0].name)  # an output two nodes share
        produced_values += [value(o, ir.VALUE) for o in outs]
        if outputs and outputs[0] and draw(st.booleans()):
            node_name = outputs[0]
        else:
            node_name = draw(name)
        if node_name in node_names:
            node_name = node_name + ".n" + str(len(nodes))
        node_names.add(node_name)
        if draw(st.integers(min_value=0, max_value=3)) == 0:
            phase = ir.BACKWARD if phase == ir.FORWARD else ir.FORWARD
        refs = names
        nodes.append(Node(
            name=node_name,
            op=draw(st.one_of(st.sampled_from(["aten.addmm.default", "aten.view.default",
                                               "aten.native_layer_norm_backward.default",
                                               "prims.convert_element_type.default"]), any_text)),
            args=draw(st.lists(args_of(refs), max_size=5)),
            kwargs=draw(st.dictionaries(st.one_of(st.sampled_from(["dtype", "device", "layout",
                                                                   "memory_format", "true", "alpha"]),
                                                  any_text), args_of(refs), max_size=3)),
            outputs=outputs,
            phase=phase,
            module=draw(st.one_of(st.just(""), path_name, any_text)),
            random=draw(st.booleans()),
            mutates=draw(st.lists(st.sampled_from(refs), max_size=2)),
            flops=draw(st.one_of(st.just(0.0), st.floats(min_value=0, max_value=1e18))),
            time_us=draw(st.one_of(st.just(0.0), st.floats(min_value=0, max_value=1e9))),
        ))
    if draw(st.integers(min_value=0, max_value=4)) == 0:
        all_values = draw(st.permutations(values + produced_values))
    else:
        all_values = values + produced_values
    node_list = sorted(node_names)

    def instrs():
        opts = [st.builds(Instr, st.just(ir.FREE), st.sampled_from(names))]
        if node_list:
            opts.append(st.builds(Instr, st.sampled_from([ir.COMPUTE, ir.RECOMPUTE]),
                                  st.sampled_from(node_list)))
        return st.lists(st.one_of(*opts), max_size=8)

    outputs = draw(st.lists(st.one_of(
        st.builds(Output, st.just(ir.RESULT),
                  st.one_of(st.integers(-3, 100).map(str), st.just("-0"), st.just("007"), any_text),
                  st.sampled_from(names)),
        st.builds(Output, st.just(ir.GRAD), st.one_of(st.sampled_from(names), name),
                  st.sampled_from(names))), max_size=4))
    return Program(header=header, values=all_values, nodes=nodes, forward=draw(instrs()),
                   backward=draw(instrs()), outputs=outputs)


def strip_lines(p: Program) -> Program:
    return msgspec.structs.replace(
        p,
        forward=[Instr(i.kind, i.target) for i in p.forward],
        backward=[Instr(i.kind, i.target) for i in p.backward],
        outputs=[Output(o.kind, o.key, o.value) for o in p.outputs])


SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------ round trips


@SETTINGS
@given(programs())
def test_round_trips(p):
    # text -> Program -> text, and Program -> text -> Program
    t = format_program(p)
    q = parse_program(t)
    assert strip_lines(q) == p
    assert format_program(q) == t
    # The fast reader takes every canonical text, and reads it as lark does.
    fast = text._assemble(text._FastReader(t).read())
    slow = text._assemble(text._lark_parse(t, "<t>"))
    assert fast == slow == q
    # Lines point at the instructions and outputs; with_lines agrees.
    lines = t.split("\n")
    for ins in q.forward + q.backward:
        src = lines[ins.line - 1].strip()
        assert src.startswith(ins.kind + " ") and text._ref(ins.target) in src
    for o in q.outputs:
        assert lines[o.line - 1].strip().startswith(o.kind + " ")
    assert with_lines(p) == q
    # The same programs survive msgspec.
    assert ir.from_json(ir.to_json(p)) == p
    assert ir.from_msgpack(ir.to_msgpack(p)) == p


def _perturb(t: str, draw) -> str:
    out = []
    seen_rir = False
    for line in t.split("\n"):
        if line and not line.startswith("#|"):
            if draw(st.booleans()):
                line = " " * draw(st.integers(0, 3)) + line.lstrip()
            if '"' not in line and draw(st.booleans()):
                line = line.replace(" ", "  ")
            if draw(st.booleans()):
                line += "   # note: a comment, with = and , and (\"#"
        seen_rir = seen_rir or line.lstrip().startswith("rir ")
        out.append(line)
        if draw(st.integers(0, 5)) == 0:
            extra = ["", "   ", "# a comment line"] + (["#| not the header now"] if seen_rir else [])
            out.append(draw(st.sampled_from(extra)))
    sep = "\r\n" if draw(st.booleans()) else "\n"
    return sep.join(out)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(), st.data())
def test_whitespace_and_comments_are_ignored(p, data):
    messy = _perturb(format_program(p), data.draw)
    q = parse_program(messy)
    assert strip_lines(q) == p
    slow = text._assemble(text._lark_parse(messy + "\n", "<t>"))
    assert strip_lines(slow) == p


# ------------------------------------------------------------ a real-looking plan


def sample_program() -> Program:
    v = [
        Value("idx", ir.INPUT, "int64", [2, 64], [64, 1], "idx", 1024, source="idx"),
        Value("transformer.wte.weight", ir.PARAM, "float32", [1000, 128], [128, 1],
              "transformer.wte.weight", 512000, source="transformer.wte.weight", requires_grad=True,
              aliases=["lm_head.weight"]),
        Value("transformer.wte.embedding", ir.VALUE, "float32", [2, 64, 128], [8192, 128, 1],
              "transformer.wte.embedding", 65536),
        Value("transformer.drop.native_dropout", ir.VALUE, "float32", [2, 64, 128], [8192, 128, 1],
              "transformer.drop.native_dropout", 65536),
        Value("transformer.drop.native_dropout:1", ir.VALUE, "bool", [2, 64, 128], [8192, 128, 1],
              "transformer.drop.native_dropout:1", 16384),
        Value("transformer.drop.view", ir.VALUE, "float32", [128, 128], [128, 1],
              "transformer.drop.native_dropout", 0),
        Value("loss", ir.VALUE, "float32", [], [], "loss", 4),
        Value("d.transformer.wte.weight", ir.VALUE, "float32", [1000, 128], [128, 1],
              "d.transformer.wte.weight", 512000),
    ]
    n = [
        Node("transformer.wte.embedding", "aten.embedding.default",
             [Ref("transformer.wte.weight"), Ref("idx")], {}, ["transformer.wte.embedding"],
             ir.FORWARD, module="transformer.wte"),
        Node("transformer.drop.native_dropout", "aten.native_dropout.default",
             [Ref("transformer.wte.embedding"), 0.1, True], {},
             ["transformer.drop.native_dropout", "transformer.drop.native_dropout:1"], ir.FORWARD,
             module="transformer.drop", random=True, flops=16384.0),
        Node("transformer.drop.view", "aten.view.default",
             [Ref("transformer.drop.native_dropout"), Seq([128, 128])], {},
             ["transformer.drop.view"], ir.FORWARD, module="transformer.drop"),
        Node("loss", "aten.sum.default", [Ref("transformer.drop.view")],
             {"dtype": DType("float32")}, ["loss"], ir.FORWARD, flops=16384.0),
        Node("d.transformer.wte.weight", "aten.embedding_dense_backward.default",
             [Ref("transformer.drop.native_dropout:1"), Ref("idx"), 1000, -1, False], {},
             ["d.transformer.wte.weight"], ir.BACKWARD, module="transformer.wte"),
    ]
    fwd = [Instr(ir.COMPUTE, "transformer.wte.embedding"),
           Instr(ir.COMPUTE, "transformer.drop.native_dropout"),
           Instr(ir.FREE, "transformer.wte.embedding"),
           Instr(ir.COMPUTE, "transformer.drop.view"),
           Instr(ir.COMPUTE, "loss"),
           Instr(ir.FREE, "transformer.drop.view"),
           Instr(ir.FREE, "transformer.drop.native_dropout")]
    bwd = [Instr(ir.RECOMPUTE, "transformer.wte.embedding"),
           Instr(ir.FREE, "transformer.wte.embedding"),
           Instr(ir.COMPUTE, "d.transformer.wte.weight"),
           Instr(ir.FREE, "transformer.drop.native_dropout:1")]
    outs = [Output(ir.RESULT, "0", "loss"), Output(ir.GRAD, "transformer.wte.weight", "d.transformer.wte.weight")]
    h = Header(model="gpt2-tiny", fingerprint="9c1e47a2d0b3", optimizer="adam", optimizer_bytes=1024000,
               budget=Budget(3365000, "activations"), has_loss=True,
               output_spec='[1, {"type": null, "context": "null", "children_spec": []}]',
               comment=["remat-ir plan: gpt2-tiny, batch 2, seq 64, fp32"])
    return Program(h, v, n, fwd, bwd, outs)


def test_sample_text_reads_well():
    t = format_program(sample_program())
    assert t.startswith("#| remat-ir plan: gpt2-tiny, batch 2, seq 64, fp32\nrir 1\n")
    assert "budget 3365000 bytes activations" in t
    assert "  idx                     input    i64[2,64] 1024 bytes source idx" in t
    assert ("  transformer.drop.native_dropout f32[2,64,128] 65536 bytes, "
            "transformer.drop.native_dropout:1 b8[2,64,128] 16384 bytes = "
            "aten.native_dropout.default(transformer.wte.embedding, 0.1, true) "
            "module transformer.drop random flops 16384.0") in t
    assert "view of transformer.drop.native_dropout" in t
    assert "\ngraph forward\n" in t and "\ngraph backward\n" in t
    assert "  recompute transformer.wte.embedding" in t
    assert "  grad transformer.wte.weight = d.transformer.wte.weight" in t
    assert "dtype=torch.float32" in t
    assert strip_lines(parse_program(t)) == sample_program()


def test_profiled_costs_print_and_read_back():
    p = sample_program()
    p.header.cost = ir.COST_PROFILE
    p.nodes[1].time_us = 12.5
    p.nodes[3].time_us = 3.0
    t = format_program(p)
    assert "\ndevice cpu\ncost profile\noptimizer adam" in t
    assert "module transformer.drop random flops 16384.0 time_us 12.5" in t
    q = parse_program(t)
    assert strip_lines(q) == p
    assert format_program(q) == t
    assert text._assemble(text._lark_parse(t, "<t>")) == q
    # `cost flops` is the default: not printed, but read when written.
    assert "\ncost " not in format_program(sample_program())
    flops_text = t.replace("cost profile", "cost flops")
    assert parse_program(flops_text).header.cost == ir.COST_FLOPS
    with pytest.raises(RirSyntaxError, match="profile"):
        parse_program(t.replace("cost profile", "cost wallclock"), "p.rir")


def test_interleaved_phases_and_order_fallback():
    p = sample_program()
    p.nodes[2].phase = ir.BACKWARD  # forward, backward, forward, backward blocks
    p.values = p.values[::-1]  # node outputs no longer last: listed under `values`
    t = format_program(p)
    assert t.count("graph forward") == 2 and t.count("graph backward") == 2
    assert "  loss" in t and " value " in t
    assert strip_lines(parse_program(t)) == p


def test_node_named_apart_from_outputs():
    p = sample_program()
    p.nodes[0].name = "embed"
    p.forward[0].target = p.forward[2].target = "embed"
    p.backward[0].target = "embed"
    p.forward[2] = Instr(ir.FREE, "transformer.wte.embedding")
    p.backward[1] = Instr(ir.FREE, "transformer.wte.embedding")
    t = format_program(p)
    assert "  embed: transformer.wte.embedding f32[2,64,128]" in t
    assert strip_lines(parse_program(t)) == p


def test_reserved_and_odd_names_are_escaped():
    p = sample_program()
    ren = {"idx": "graph", "loss": "true", "transformer.drop.view": "torch.float32",
           "transformer.wte.embedding": "a name with spaces # and hash"}

    def r(s):
        return ren.get(s, s)

    for v in p.values:
        v.name, v.storage = r(v.name), r(v.storage)
    for n in p.nodes:
        n.name = r(n.name)
        n.outputs = [r(o) for o in n.outputs]
        n.args = [Ref(r(a.name)) if isinstance(a, Ref) else a for a in n.args]
    for i in p.forward + p.backward:
        i.target = r(i.target)
    for o in p.outputs:
        o.value = r(o.value)
    t = format_program(p)
    assert '%"graph"' in t and '%"true"' in t and '%"torch.float32"' in t
    assert '%"a name with spaces # and hash"' in t
    assert strip_lines(parse_program(t)) == p


def test_with_lines_matches_format():
    p = sample_program()
    t = format_program(p)
    q = with_lines(p)
    lines = t.split("\n")
    assert [lines[i.line - 1].split()[1] for i in q.forward] == [i.target for i in p.forward]
    assert q.outputs[1].line == len(lines) - 1
    assert q == parse_program(t)
    assert all(i.line == 0 for i in p.forward)  # the input is not changed


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(512) == "512 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(64 * 1024) == "64.0 KiB"
    assert human_bytes(int(1.32 * 2 ** 30)) == "1.32 GiB"
    assert human_bytes(3 * 2 ** 20 + 2 ** 19) == "3.50 MiB"
    assert human_bytes(500 * 1024) == "500.0 KiB"
    assert human_bytes(-2048) == "-2.00 KiB"


def test_grammar_file_is_found():
    g = text.grammar_text()
    assert "node_line" in g and "start:" in g


def test_reserved_words_match_the_grammar():
    # Keywords that can stand where a name can must be escaped when printed.
    assert text._compute_reserved(text._lark()) == text._RESERVED


def test_big_plan_parses_fast():
    vals = [Value("idx", ir.INPUT, "int64", [2, 64], [64, 1], "idx", 1024, source="idx")]
    vals += [Value(f"transformer.h.{i}.mlp.c_fc.weight", ir.PARAM, "float32", [128, 512], [512, 1],
                   f"transformer.h.{i}.mlp.c_fc.weight", 262144,
                   source=f"transformer.h.{i}.mlp.c_fc.weight", requires_grad=True) for i in range(24)]
    nodes, fwd, bwd, prev = [], [], [], "idx"
    for i in range(4000):
        nm = f"transformer.h.{i % 24}.mlp.c_fc.addmm_{i}"
        vals.append(Value(nm, ir.VALUE, "float32", [2, 64, 512], [32768, 512, 1], nm, 262144))
        vals.append(Value(nm + ":1", ir.VALUE, "float32", [2, 64, 1], [64, 1, 1], nm + ":1", 512))
        nodes.append(Node(nm, "aten.native_layer_norm.default",
                          [Ref(prev), Seq([512]), Ref(f"transformer.h.{i % 24}.mlp.c_fc.weight"), None, 1e-05],
                          {"dtype": DType("float32")}, [nm, nm + ":1"],
                          ir.FORWARD if i < 2000 else ir.BACKWARD, module=f"transformer.h.{i % 24}.mlp",
                          flops=4194304.0))
        prev = nm
        sched = fwd if i < 2000 else bwd
        sched += [Instr(ir.COMPUTE, nm), Instr(ir.FREE, nm + ":1")]
    p = Program(Header(model="big"), vals, nodes, fwd, bwd, [Output(ir.RESULT, "0", prev)])
    t = format_program(p)
    parse_program(format_program(sample_program()))  # warm up (grammar load)
    q = parse_program(t)  # its time is measured by tools/timings.py, not asserted here
    assert strip_lines(q) == p


# ----------------------------------------------------------------- errors


def _lines():
    return format_program(sample_program()).split("\n")


def _err(t: str) -> RirSyntaxError:
    with pytest.raises(RirSyntaxError) as ei:
        parse_program(t, "plan.rir")
    e = ei.value
    assert str(e) == f"plan.rir:{e.line}:{e.column}: {e.message}"
    assert isinstance(e, ValueError)
    return e


def _index(lines, prefix):
    return next(i for i, line in enumerate(lines) if line.startswith(prefix))


def test_error_malformed_line_names_its_line():
    lines = _lines()
    i = _index(lines, "  compute   transformer.drop.view")
    lines[i] = "  compute"
    e = _err("\n".join(lines))
    assert e.line == i + 1
    assert "expected a name" in e.message and "end of line" in e.message


def test_error_misspelt_instruction():
    lines = _lines()
    i = _index(lines, "  free      transformer.drop.view")
    lines[i] = "  fre transformer.drop.view"
    e = _err("\n".join(lines))
    assert (e.line, e.column) == (i + 1, 3)
    assert "did you mean `free`" in e.message
    lines[i] = "  freetransformer.drop.view"  # a keyword glued to a name is not the keyword
    e = _err("\n".join(lines))
    assert e.line == i + 1 and "did you mean `free transformer.drop.view`" in e.message


def test_error_unknown_op_syntax():
    lines = _lines()
    i = _index(lines, "  loss ")
    lines[i] = "  loss f32[] 4 bytes = aten.sum.default transformer.drop.view"
    e = _err("\n".join(lines))
    assert e.line == i + 1 and e.message.startswith("expected `(`")
    lines[i] = "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view dtype=torch.float32)"
    e = _err("\n".join(lines))
    assert e.line == i + 1 and "`,`" in e.message and "`)`" in e.message
    lines[i] = "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, torch.float33)"
    e = _err("\n".join(lines))
    assert e.line == i + 1 and "unknown torch constant" in e.message
    lines[i] = "  loss f32[] 4 bytes = aten.sum.default(dtype=torch.float32, transformer.drop.view)"
    e = _err("\n".join(lines))
    assert e.line == i + 1 and "positional argument follows a keyword" in e.message


def test_error_missing_section():
    t = format_program(sample_program())
    e = _err(t.replace("\noutputs\n", "\n"))
    assert "`outputs` section is missing" in e.message
    e = _err(t.replace("\nforward\n", "\n"))
    assert "forward" in e.message and "missing" in e.message
    e = _err(t.replace("\nvalues", "\n"))
    assert "`values`" in e.message
    lines = t.split("\n")
    i = _index(lines, "backward")
    lines[i] = "schedule"
    e = _err("\n".join(lines))
    assert (e.line, e.column) == (i + 1, 1) and "unknown section `schedule`" in e.message


def test_error_duplicate_value():
    lines = _lines()
    i = _index(lines, "  transformer.wte.weight")
    lines.insert(i + 1, "  idx  buffer  f32[3] 12 bytes")
    e = _err("\n".join(lines))
    assert e.line == i + 2 and "duplicate value `idx`" in e.message and f"line {i}" in e.message


def test_error_truncated_file():
    t = format_program(sample_program())
    for cut in (len(t) // 3, len(t) // 2, t.index("\nbackward") + 1, len(t) - 30):
        e = _err(t[:cut])
        assert 1 <= e.line <= t[:cut].count("\n") + 1
    e = _err(t[:t.index("outputs")])
    assert "truncated" in e.message and "outputs" in e.message


def test_error_semantics():
    lines = _lines()
    i = _index(lines, "  idx")
    lines[i] = lines[i].replace("i64[2,64]", "i65[2,64]")
    e = _err("\n".join(lines))
    assert e.line == i + 1 and "unknown dtype `i65`" in e.message and "i64" in e.message
    lines = _lines()
    i = _index(lines, "  loss ")
    lines[i] = "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.vew)"
    e = _err("\n".join(lines))
    assert (e.line, e.column) == (i + 1, lines[i].index("transformer.drop.vew") + 1)
    assert "never declared" in e.message and "transformer.drop.view" in e.message
    lines = _lines()
    lines[i] = "  loss, zz = aten.sum.default(transformer.drop.view)"
    e = _err("\n".join(lines))
    assert e.line == i + 1 and "not declared as a value" in e.message
    lines = _lines()
    j = _index(lines, "  compute   loss")
    lines[j] = "  compute   los"
    e = _err("\n".join(lines))
    assert e.line == j + 1 and "unknown node `los`" in e.message
    lines = _lines()
    j = _index(lines, "rir 1")
    lines[j] = "rir 7"
    e = _err("\n".join(lines))
    assert e.line == j + 1 and "version" in e.message
    lines = _lines()
    j = _index(lines, "model")
    lines[j] = 'model "unterminated'
    e = _err("\n".join(lines))
    assert e.line == j + 1 and "unterminated string" in e.message


def test_errors_on_garbage_never_escape_as_other_exceptions():
    t = format_program(sample_program())
    for junk in ["", "\n", "rir", "rir 1\n", "\x00\x01", "((((", "rir 1\nvalues\ngraph forward\n  a = b(" + "[" * 3000,
                 t.replace("=", ""), t.replace("(", "[", 3), t.replace("bytes", "byte"), t[::-1]]:
        _err(junk)


# ------------------------------------------------------------------ files


def test_save_and_load(tmp_path):
    p = sample_program()
    path = tmp_path / "plan.rir"
    save_plan(p, path)
    assert path.read_text() == format_program(p)
    q = load_plan(path)
    assert strip_lines(q) == p and q.forward[0].line > 0
    assert os.listdir(tmp_path) == ["plan.rir"]


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "plan.rir"
    path.write_text("old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        save_plan(sample_program(), path)
    assert os.listdir(tmp_path) == ["plan.rir"] and path.read_text() == "old"
    monkeypatch.undo()
    bad = sample_program()
    bad.nodes[0].args = [object()]
    with pytest.raises(ValueError):
        save_plan(bad, path)
    assert os.listdir(tmp_path) == ["plan.rir"] and path.read_text() == "old"


def test_load_errors(tmp_path):
    missing = tmp_path / "nope.rir"
    with pytest.raises(OSError) as ei:
        load_plan(missing)
    assert str(missing) in str(ei.value)
    bad = tmp_path / "bad.rir"
    bad.write_bytes(b"rir 1\nmodel \"\xff\"\n")
    with pytest.raises(RirSyntaxError) as ei:
        load_plan(bad)
    assert (ei.value.line, ei.value.column) == (2, 8) and "UTF-8" in ei.value.message
    assert str(ei.value).startswith(f"{bad}:2:8: ")
    crlf = tmp_path / "crlf.rir"
    crlf.write_bytes(format_program(sample_program()).replace("\n", "\r\n").encode())
    assert strip_lines(load_plan(crlf)) == sample_program()


def test_error_is_picklable():
    import pickle
    e = RirSyntaxError("f.rir", 3, 4, "boom")
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == "f.rir:3:4: boom" and e2.line == 3


def test_special_float_args_print_as_keywords():
    assert text._arg(Seq([Special("inf"), Special("-inf"), Special("nan"), -0.0, 1e-05])) == \
        "[inf, -inf, nan, -0.0, 1e-05]"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 3),
                          st.sampled_from(list(' \n\t"#%|:.,=()[]_-0123456789abefinorstuvx\\')),
                          ), min_size=1, max_size=4))
def test_mangled_text_reads_or_fails_cleanly(edits):
    t = format_program(sample_program())
    for where, n_deleted, ch in edits:
        i = int(where * len(t))
        t = t[:i] + ch + t[i + n_deleted:]
    try:
        p = parse_program(t, "m.rir")
    except RirSyntaxError as e:
        assert str(e).startswith("m.rir:") and e.line >= 1 and e.column >= 1
        return
    # Whatever reads must read the same through lark.
    assert strip_lines(text._assemble(text._lark_parse(t + "\n", "m.rir"))) == strip_lines(p)
