"""The `.rir` text format: round trips, errors, files; and the reader
against lark running grammar/rir.lark, the language's definition."""
from __future__ import annotations

import functools
import json
import math
import os
import re

import lark
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lark.lexer import PatternStr

from remat_ir import ir

from remat_ir.ir import parser, printer, syntax
from remat_ir.ir import (
    Budget, Device, DType, Header, Instr, Layout, MemoryFormat, Node, Output, Program, Ref, Seq,
    Special, Sym, Value,
)
from remat_ir.ir import sizes as sz
from remat_ir.ir.files import load_plan, save_plan
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program, human_bytes, with_lines
from remat_ir.ir.syntax import RirSyntaxError

# ------------------------------------------------------------- strategies

SEGMENTS = ["transformer", "h", "0", "11", "attn", "c_attn", "addmm", "ln_1", "weight", "bias", "d",
            "mlp", "native_layer_norm_backward", "idx", "x", "input", "value", "param", "graph",
            "forward", "backward", "outputs", "values", "free", "compute", "offload", "reload", "wait",
            "host_budget", "_", "true", "none",
            "inf", "nan", "torch", "float32", "device", "view", "of", "bytes", "result", "grad", "é"]

segment = st.sampled_from(SEGMENTS)
path_name = st.builds(
    lambda first, rest: first + "".join(sep + s for sep, s in rest),
    segment, st.lists(st.tuples(st.sampled_from([".", ":"]), segment), max_size=4))
any_text = st.text(max_size=12)
name = st.one_of(path_name, path_name, path_name, any_text)
# Keyword argument names are identifiers (keywords of the language among them).
kwarg_name = st.one_of(st.from_regex(syntax.KWARG_RE, fullmatch=True).filter(lambda k: len(k) <= 12),
                       st.sampled_from(["_", "graph", "none", "nan", "inf", "false", "from", "torch"]))
small_int = st.integers(min_value=0, max_value=2 ** 40)
i64 = st.integers(min_value=-2 ** 63, max_value=2 ** 63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
DTYPE_NAMES = sorted(ir.DTYPE_SHORT) + ["uint16", "complex32"]


# Symbolic plans: size symbols, and size expressions over them in canonical text.
SYMBOLS = ["B", "T", "S", "n_1"]


def size_exprs(symbols: list[str]):
    """Size expressions over `symbols`, as the IR holds them (`sizes.normal_size`)."""
    sym = st.sampled_from(symbols)
    num = st.integers(min_value=0, max_value=512)
    shapes = [
        sym,
        st.builds(lambda k, a: f"{k}*{a}", num, sym),
        st.builds(lambda a, b: f"{a}*{b}", sym, sym),
        st.builds(lambda a, k: f"{a}-{k}", sym, num),
        st.builds(lambda a, k: f"max({a},{k})", sym, num),
        st.builds(lambda k, a, b: f"{k}*(({a}+1)//2)*min({b},{k})", num, sym, sym),
        st.builds(lambda a, b, k: f"({a} + {b}) % {k + 1} - -{k}", sym, sym, num),
        st.builds(lambda k, a: f"{k}*({a}-1)", num, sym),
    ]
    return st.one_of(*shapes).map(sz.normal_size)


def dims(symbols: list[str]):
    ints = st.integers(min_value=0, max_value=4096)
    return st.one_of(ints, ints, size_exprs(symbols)) if symbols else ints


def scalar_args(refs: list[str], symbols: list[str] = ()):
    opts = [
        st.none(), st.booleans(), i64, finite, any_text,
        st.builds(DType, st.sampled_from(sorted(syntax.DTYPES))),
        st.builds(Layout, st.sampled_from(sorted(syntax.LAYOUTS))),
        st.builds(MemoryFormat, st.sampled_from(sorted(syntax.MEMORY_FORMATS))),
        st.builds(Device, st.one_of(st.sampled_from(["cpu", "cuda", "cuda:0", "meta"]), any_text)),
        st.builds(Special, st.sampled_from(["inf", "-inf", "nan"])),
    ]
    if refs:
        opts.append(st.builds(Ref, st.sampled_from(refs)))
    if symbols:
        opts.append(st.builds(Sym, size_exprs(list(symbols)).map(sz.size_text)))
    return st.one_of(*opts)


def args_of(refs: list[str], symbols: list[str] = ()):
    return st.recursive(scalar_args(refs, symbols), lambda inner: st.builds(Seq, st.lists(inner, max_size=3)),
                        max_leaves=6)


def size_ranges(symbols: list[str]):
    return st.tuples(*[st.tuples(st.integers(1, 64), st.integers(0, 200)) for _ in symbols]).map(
        lambda rs: [f"{s}={lo}..{lo + extra}" for s, (lo, extra) in zip(symbols, rs)])


def size_conditions(symbols: list[str]):
    return st.builds(lambda a, op, b: f"{a} {op} {b}", size_exprs(symbols).map(sz.size_text),
                     st.sampled_from(["==", "!=", "<", "<=", ">", ">="]),
                     st.one_of(st.integers(0, 99).map(str), size_exprs(symbols).map(sz.size_text)))


GUARDS = ["aten.all.default(aten.eq.Scalar(input('m'), 1)) == True", "traced() == False",
          "aten._local_scalar_dense.default(aten.sum.default(input('attention_mask'))) == 12",
          "aten.equal.default(buffer('rope.inv_freq'), input('f')) == False"]


@st.composite
def programs(draw) -> Program:
    header = Header(
        version=1,
        model=draw(any_text),
        fingerprint=draw(st.one_of(st.text("0123456789abcdef", max_size=12), any_text)),
        device=draw(st.one_of(st.sampled_from(["cpu", "cuda", "cuda:0"]), any_text)),
        cost=draw(st.sampled_from(ir.COST_MODELS)),
        optim=draw(st.one_of(st.sampled_from(["none", "sgd", "adam"]), any_text)),
        optim_state_bytes=draw(small_int),
        budget=draw(st.one_of(st.none(), st.builds(Budget, small_int,
                                                   st.sampled_from(["total", "activations"])))),
        host_budget=draw(st.one_of(st.none(), small_int)),
        output_spec=draw(st.one_of(st.just(""), st.just('[1, {"type": null, "context": "null"}]'),
                                   any_text)),
        has_loss=draw(st.booleans()),
        autocast=draw(st.one_of(st.sampled_from(["", "cpu:bfloat16", "cuda:float16"]), any_text)),
        held_gradients=draw(st.booleans()),
        constants=draw(st.lists(st.one_of(st.just("scale=2.0"), any_text), max_size=2)),
        # (guards are read as the guard language: text outside it is refused, tests/test_guard_corpus.py)
        guards=draw(st.lists(st.sampled_from(GUARDS), max_size=2)),
        comment=draw(st.lists(st.one_of(st.just(""), any_text, st.just(" padded "), st.just('"q"')),
                              max_size=3)),
    )
    # One program in three is symbolic: sizes vary between calls.
    symbols = draw(st.one_of(st.just([]), st.just([]),
                             st.lists(st.sampled_from(SYMBOLS), min_size=1, max_size=3, unique=True)))
    if symbols:
        header.sizes = draw(size_ranges(symbols))
        header.size_guards = draw(st.lists(size_conditions(symbols), max_size=2))
    names = draw(st.lists(name, min_size=1, max_size=12, unique=True))
    n_inputs = draw(st.integers(min_value=0, max_value=len(names)))
    input_names, produced = names[:n_inputs], names[n_inputs:]

    def value(nm: str, kind: str) -> Value:
        shape = draw(st.lists(dims(symbols), max_size=4))
        stride_item = st.one_of(st.integers(min_value=0, max_value=10 ** 6), size_exprs(symbols)) if symbols \
            else st.integers(min_value=0, max_value=10 ** 6)
        stride = draw(st.one_of(st.just(syntax.default_stride(shape)),
                                st.lists(stride_item, min_size=len(shape), max_size=len(shape))))
        view_of = draw(st.one_of(st.none(), st.none(), st.sampled_from(names)))
        owner = view_of is None or view_of == nm
        counts = st.one_of(small_int, size_exprs(symbols)) if symbols else small_int
        return Value(
            name=nm, kind=kind, dtype=draw(st.sampled_from(DTYPE_NAMES)), shape=shape, stride=stride,
            storage=nm if owner else view_of,
            nbytes=draw(counts) if owner else draw(st.sampled_from([0, 0, 12] + (["4*B"] if symbols else []))),
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
            args=draw(st.lists(args_of(refs, symbols), max_size=5)),
            kwargs=draw(st.dictionaries(st.one_of(st.sampled_from(["dtype", "device", "layout",
                                                                   "memory_format", "true", "alpha"]),
                                                  kwarg_name), args_of(refs, symbols), max_size=3)),
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
        opts = [st.builds(Instr, st.sampled_from([ir.FREE, ir.FREE, ir.OFFLOAD, ir.RELOAD, ir.WAIT]),
                          st.sampled_from(names))]
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


# ------------------------------------------------------------ the lark oracle
#
# lark, with the grammar, defines the language: LALR with the contextual
# lexer, plus two rules between lexer and parser (_PostLex).  The reader is
# written by hand; these helpers check that it reads what lark reads, the same.


class _PostLex:
    """* A line break directly after another is dropped (a `#|` line after the
      header is an ignored comment between two breaks).
    * A keyword lexed off the front of a longer word (`freex`: where no name
      may stand lark matches keywords as plain strings) becomes a NAME, so
      that the parser refuses it."""

    always_accept = ("_NL",)

    def __init__(self):
        self.keywords: frozenset[str] = frozenset()
        self.text = ""

    def process(self, stream):
        after_break = False
        for tok in stream:
            if tok.type == "_NL":
                if after_break:
                    continue
                after_break = True
            else:
                after_break = False
                if tok.type in self.keywords:
                    m = syntax.NAME_RE.match(self.text, tok.start_pos)
                    if m is not None and m.end() != tok.end_pos:
                        tok = tok.new_borrow_pos("NAME", m.group(), tok)
            yield tok


@functools.lru_cache(maxsize=None)
def _lark_parser() -> tuple[lark.Lark, _PostLex]:
    post = _PostLex()
    p = lark.Lark(parser.grammar_text(), parser="lalr", lexer="contextual", postlex=post,
                  maybe_placeholders=True)
    post.keywords = frozenset(_keyword_terminals(p))
    return p, post


def _keyword_terminals(p: lark.Lark) -> dict[str, str]:
    """Terminal name -> keyword, for the grammar's keywords spelt like names."""
    return {t.name: t.pattern.value for t in p.terminals
            if isinstance(t.pattern, PatternStr) and syntax.NAME_RE.fullmatch(t.pattern.value)}


def lark_tree(text: str) -> lark.Tree | None:
    """lark's parse tree of `text` (prepared as parse_program does), or None
    when lark refuses it."""
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.endswith("\n"):
        text += "\n"
    p, post = _lark_parser()
    post.text = text
    try:
        return p.parse(text)
    except lark.exceptions.UnexpectedInput:
        return None


def _string(tok) -> str:
    return json.loads(tok, strict=False)


def _word(tok) -> str:
    return _string(tok) if tok.type == "STRING" else str(tok)


def _sizes(text: str) -> list:
    """A dimension or stride list's items: ints, or size expressions (split
    at the commas outside parentheses)."""
    items, depth, cur = [], 0, ""
    for c in text + ",":
        depth += (c == "(") - (c == ")")
        if c == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += c
    if not text.strip():
        return []
    return [int(x) if re.fullmatch(r"\s*-?\d+\s*", x) else sz.normal_size(x) for x in items]


def _sym(tok) -> str | int:
    """`$B` or `$(expr)`: the expression, as the IR holds it."""
    text = str(tok)[1:]
    return sz.normal_size(text[1:-1] if text.startswith("(") else text)


def _count(tok) -> int | str:
    return int(tok) if tok.type == "INT" else _sym(tok)


class _ToProgram(lark.Transformer):
    """lark's tree as a Program, read naively: only texts the reader accepts
    get here, so names need no checking."""

    def start(self, c):
        header, values, nodes, fwd, bwd, outs = c
        declared = [v for n in nodes for v in n.declared]
        return Program(header, values + declared, [n.node for n in nodes], fwd, bwd, outs)

    # header
    def header(self, c):
        n = next(i for i, x in enumerate(c) if isinstance(x, lark.Token))
        h = Header(version=int(c[n]), comment=list(c[:n]))
        for field in c[n + 1:]:
            for k, v in field:
                setattr(h, k, v)
        return h

    def hcomment(self, c):
        rest = str(c[0])[2:].rstrip()
        return rest[1:] if rest.startswith(" ") else _string(rest) if rest.startswith('"') else rest

    def model(self, c):
        return [("model", _string(c[0]))]

    def fingerprint(self, c):
        return [("fingerprint", _string(c[0]))]

    def output_spec(self, c):
        return [("output_spec", _string(c[0]))]

    def device(self, c):
        return [("device", _word(c[0]))]

    def cost(self, c):
        return [("cost", str(c[0].children[0]))]

    def optimizer(self, c):
        return [("optim", _word(c[0])), ("optim_state_bytes", int(c[1]))]

    def budget(self, c):
        return [("budget", Budget(int(c[0]), str(c[1].children[0])))]

    def host_budget(self, c):
        return [("host_budget", int(c[0]))]

    def has_loss(self, c):
        return [("has_loss", str(c[0].children[0]) == "true")]

    def autocast(self, c):
        return [("autocast", _word(c[0]))]

    def held_gradients(self, c):
        return [("held_gradients", str(c[0].children[0]) == "true")]

    def constants(self, c):
        return [("constants", [_string(x) for x in c])]

    def guards(self, c):
        return [("guards", [_string(x) for x in c])]

    def sizes(self, c):
        return [("sizes", [str(x) for x in c])]

    def size_guards(self, c):
        return [("size_guards", [_string(x) for x in c])]

    # values
    def values(self, c):
        return c

    def value_line(self, c):
        return self._value(str(c[0]), str(c[1].children[0]), c[2])

    @staticmethod
    def _value(name, kind, d):
        t, stride, (owner, nbytes), source, rg, aliases = d
        short, _, shape = str(t)[:-1].partition("[")
        shape = _sizes(shape)
        return Value(name, kind, ir.DTYPE_LONG.get(short, short), shape,
                     syntax.default_stride(shape) if stride is None else stride,
                     name if owner is None else owner, nbytes, "" if source is None else _word(source),
                     rg is not None, aliases or [])

    def decl(self, c):
        return c

    def stride(self, c):
        return _sizes(str(c[0])[1:-1])

    def owner(self, c):
        return None, _count(c[0])

    def view(self, c):
        return str(c[0]), 0 if c[1] is None else _count(c[1])

    def source(self, c):
        return c[0]

    def aliases(self, c):
        return [] if c[0] is None else [_word(t) for t in c[0].children]

    def escaped(self, c):
        return lark.Token.new_borrow_pos("NAME", _string(c[0]), c[0])

    # graph
    def graph(self, c):
        return [n for block in c for n in block]

    def graph_block(self, c):
        for n in c[1:]:
            n.node.phase = str(c[0].children[0])
        return c[1:]

    def node_line(self, c):
        name, outs, op, items, attrs = c
        outs = [] if outs is None else outs.children
        args = [a for a in items or () if not isinstance(a, tuple)]
        kwargs = dict(a for a in items or () if isinstance(a, tuple))
        node = Node(str(name.children[0]) if name is not None else outs[0][0], _word(op.children[0]),
                    args, kwargs, [o[0] or "" for o in outs], ir.FORWARD)
        for attr in attrs.children:
            setattr(node, *attr)
        return _OracleNode(node, [self._value(o, ir.VALUE, d) for o, d in outs if d is not None])

    def no_output(self, c):
        return None, None

    def bare_output(self, c):
        return str(c[0]), None

    def declared_output(self, c):
        return str(c[0]), c[1]

    def call_args(self, c):
        return c

    def kwarg(self, c):
        key = c[0].children[0]
        return (key[1:-1] if key.type == "QUOTED_KEY" else str(key)), c[1]

    def name_arg(self, c):
        name = str(c[0])
        if not name.startswith("torch."):
            return Ref(name)
        attr = name[6:]
        return (DType if attr in syntax.DTYPES else Layout if attr in syntax.LAYOUTS else MemoryFormat)(attr)

    def escaped_ref(self, c):
        return Ref(_string(c[0]))

    def int_arg(self, c):
        return int(c[0])

    def float_arg(self, c):
        x = float(c[0])  # past the largest float (1e999): infinity, as `inf`
        return x if math.isfinite(x) else Special("inf" if x > 0 else "-inf")

    def str_arg(self, c):
        return _string(c[0])

    def true_arg(self, c):
        return True

    def false_arg(self, c):
        return False

    def none_arg(self, c):
        return None

    def inf_arg(self, c):
        return Special("inf")

    def ninf_arg(self, c):
        return Special("-inf")

    def nan_arg(self, c):
        return Special("nan")

    def device_arg(self, c):
        inner = str(c[0])[7:-1]
        return Device(_string(inner) if inner.startswith('"') else inner)

    def sym_arg(self, c):
        return Sym(str(_sym(c[0])))

    def list_arg(self, c):
        return Seq([] if c[0] is None else c[0].children)

    def module(self, c):
        return "module", _word(c[0])

    def random(self, c):
        return "random", True

    def mutates(self, c):
        return "mutates", [str(t) for t in c]

    def flops(self, c):
        return "flops", float(c[0])

    def time_us(self, c):
        return "time_us", float(c[0])

    # schedule and outputs
    def forward(self, c):
        return c

    backward = forward

    def compute(self, c):
        return Instr(ir.COMPUTE, str(c[0]), c[0].line)

    def recompute(self, c):
        return Instr(ir.RECOMPUTE, str(c[0]), c[0].line)

    def free(self, c):
        return Instr(ir.FREE, str(c[0]), c[0].line)

    def offload(self, c):
        return Instr(ir.OFFLOAD, str(c[0]), c[0].line)

    def reload(self, c):
        return Instr(ir.RELOAD, str(c[0]), c[0].line)

    def wait(self, c):
        return Instr(ir.WAIT, str(c[0]), c[0].line)

    def outputs(self, c):
        return c

    def result(self, c):
        key = _string(c[0]) if c[0].type == "STRING" else str(int(c[0]))
        return Output(ir.RESULT, key, str(c[1]), c[1].line)

    def grad(self, c):
        return Output(ir.GRAD, str(c[0]), str(c[1]), c[1].line)


class _OracleNode:
    def __init__(self, node: Node, declared: list[Value]):
        self.node = node
        self.declared = declared


# How the reader words a syntax error; anything else is about meaning
# (a name never declared, an unknown dtype, ...), which lark cannot see.
SYNTAX_ERRORS = ("expected ", "unterminated string", "unknown section", "unknown header line")


def read_as_lark_does(text: str) -> Program | None:
    """parse_program(text), checked against lark: lark refuses the text iff
    the reader finds a syntax error in it, and when the reader accepts it,
    lark's tree says the same.  The Program, or None when refused."""
    tree = lark_tree(text)
    try:
        p = parse_program(text, "t.rir")
    except RirSyntaxError as e:
        if tree is not None:
            assert not e.message.startswith(SYNTAX_ERRORS), f"lark reads it, but the reader says {e}"
        return None
    assert tree is not None, "the reader accepts a text lark refuses"
    assert _ToProgram().transform(tree) == strip_graph_lines(p)
    return p


def strip_graph_lines(p: Program) -> Program:
    """`p` with Value.line, Node.line and Header.lines zeroed (the lark oracle
    records only the schedule's and the outputs' lines)."""
    replace = msgspec.structs.replace
    return replace(p, header=replace(p.header, lines={}),
                   values=[replace(v, line=0) for v in p.values],
                   nodes=[replace(n, line=0) for n in p.nodes])


def strip_lines(p: Program) -> Program:
    return msgspec.structs.replace(
        strip_graph_lines(p),
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
    # lark, with the grammar, reads every canonical text the same.
    assert read_as_lark_does(t) == q
    # Lines point at the instructions and outputs; with_lines agrees.
    lines = t.split("\n")
    for ins in q.forward + q.backward:
        src = lines[ins.line - 1].strip()
        assert src.startswith(ins.kind + " ") and printer._ref(ins.target) in src
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
    q = read_as_lark_does(messy)
    assert q is not None and strip_lines(q) == p


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
    h = Header(model="gpt2-tiny", fingerprint="9c1e47a2d0b3", optim="adam", optim_state_bytes=1024000,
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


def offload_sample() -> Program:
    """The sample with the dropout mask offloaded to the host after forward
    and reloaded for its backward use, and a host budget."""
    p = sample_program()
    mask = "transformer.drop.native_dropout:1"
    p.forward[2:2] = [Instr(ir.OFFLOAD, mask)]
    p.forward.append(Instr(ir.WAIT, mask))
    p.backward[2:2] = [Instr(ir.RELOAD, mask), Instr(ir.WAIT, mask)]
    p.header.host_budget = 16384
    return p


def test_offload_text_reads_well():
    p = offload_sample()
    t = format_program(p)
    lines = t.split("\n")
    at = lines.index("host_budget 16384 bytes                    # 16.0 KiB of host memory")
    assert lines[at - 1].startswith("budget 3365000 bytes activations")
    mask = "transformer.drop.native_dropout:1"
    # One instruction a line, with what it moves: host bytes for the copy out, device bytes freed at its
    # wait; device bytes for the copy back, host bytes freed at its wait.
    got = [ln.split("#")[0].split() + [ln.split("#")[1].strip()] for ln in lines
           if ln.split()[1:2] == [mask] and ln.split()[0] in ("offload", "reload", "wait")]
    assert got == [["offload", mask, "host +16.0 KiB"], ["wait", mask, "-16.0 KiB"],
                   ["reload", mask, "+16.0 KiB"], ["wait", mask, "host -16.0 KiB"]]
    q = parse_program(t)
    assert strip_lines(q) == p and format_program(q) == t
    assert q.header.host_budget == 16384 and q.header.lines["host_budget"] == at + 1
    assert read_as_lark_does(t) == q
    assert [(i.kind, i.target) for i in q.backward[2:4]] == [(ir.RELOAD, mask), (ir.WAIT, mask)]
    # Freed while on the host: its host buffer.
    p.forward[-1:] = [Instr(ir.WAIT, mask), Instr(ir.FREE, mask)]
    p.backward[2:4] = []
    p.backward[-1:] = []
    assert "  free      transformer.drop.native_dropout:1   # host -16.0 KiB" in format_program(p)


def test_plans_without_offload_print_as_before():
    """The canonical plans of the repository print back to themselves, and
    a plan without offload has no host_budget line and no new instruction."""
    root = os.path.join(os.path.dirname(__file__), "..")
    for rel in ("schedules/gpt2-tiny.rir", "schedules/gpt2-tiny.budget-0.7.rir", "schedules/mlp.rir",
                "tests/plans/mlp-batch.rir", "tests/plans/pinned-result-view.rir"):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            t = f.read()
        p = parse_program(t, rel)
        assert p.header.host_budget is None and format_program(p) == t, rel
        assert not any(i.kind in ir.TRANSFER_INSTRS for i in p.forward + p.backward)


@pytest.mark.parametrize("kind", [ir.OFFLOAD, ir.RELOAD, ir.WAIT])
def test_offload_instructions_name_declared_values(kind):
    t = format_program(sample_program())
    lines = t.split("\n")
    i = _index(lines, "  free      transformer.drop.view")
    for target, msg in (("transformer.drop.veiw", f"{kind} of unknown value `transformer.drop.veiw`; did you "
                                                  f"mean `transformer.drop.view`?"),
                        ("loss.n", f"{kind} of unknown value `loss.n`"),
                        ("transformer.wte.embedding", None)):
        lines2 = list(lines)
        lines2[i] = f"  {kind}  {target}"
        if msg is None:
            assert parse_program("\n".join(lines2)).forward[5] == Instr(kind, target, i + 1)
            continue
        e = _err("\n".join(lines2))
        assert (e.line, e.column) == (i + 1, 5 + len(kind)) and e.message.startswith(msg), e
    # A node is not a value: the instruction names the node's outputs.
    p = sample_program()
    p.nodes[0].name = "embed"
    p.forward[0].target = "embed"
    p.backward[0].target = "embed"
    t = format_program(p).replace("  free      transformer.wte.embedding", f"  {kind} embed", 1)
    assert f"{kind} of unknown value `embed` (that is a node; {kind} its outputs)" in str(_err(t))
    # In the schedule, an unknown word lists the instructions.
    e = _err(format_program(sample_program()).replace("  free      transformer.drop.view", "  offlaod x", 1))
    assert "`compute`, `recompute`, `free`, `offload`, `reload`, `wait` or `backward`" in e.message
    assert "did you mean `offload`?" in e.message


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
    assert read_as_lark_does(t) == q
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
    g = parser.grammar_text()
    assert "node_line" in g and "start:" in g


def test_reserved_words_match_the_grammar():
    # Keywords that can stand where a name can (a state of lark's parser that
    # shifts NAME also takes them) must be escaped when printed.
    p, _ = _lark_parser()
    keywords = _keyword_terminals(p)
    states = p.parser.parser.parser.parse_table.states
    reserved = {keywords[t] for actions in states.values() if "NAME" in actions
                for t in actions if t in keywords}
    assert reserved == syntax.RESERVED
    # And the reader knows every keyword the grammar has.
    assert set(keywords.values()) == parser.KEYWORDS


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
    q = parse_program(t)  # its time is measured by tools/load_time.py, not asserted here
    assert strip_lines(q) == p


# ----------------------------------------------------------------- errors


def _err(t: str) -> RirSyntaxError:
    with pytest.raises(RirSyntaxError) as ei:
        parse_program(t, "plan.rir")
    e = ei.value
    assert str(e) == f"plan.rir:{e.line}:{e.column}: {e.message}"
    assert isinstance(e, ValueError)
    return e


def _index(lines, prefix):
    return next(i for i, line in enumerate(lines) if line.startswith(prefix))


def test_error_truncated_file():
    """Cut anywhere, a plan fails at a line of what is left.  (Messages at
    lines: tests/diagnostics/parse/.)"""
    t = format_program(sample_program())
    for cut in (len(t) // 3, len(t) // 2, t.index("\nbackward") + 1, len(t) - 30):
        e = _err(t[:cut])
        assert 1 <= e.line <= t[:cut].count("\n") + 1


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


INJECTED_KEY = "other=E['w']) if __import__('os').system('touch /tmp/x') == 0 else dict(a"


def test_keyword_argument_names_are_identifiers():
    lines = format_program(sample_program()).split("\n")
    i = _sample_line("  loss ")
    lines[i] = f'  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, {json.dumps(INJECTED_KEY)}=1)'
    with pytest.raises(RirSyntaxError) as e:
        parse_program("\n".join(lines), "k.rir")
    col = lines[i].index('"other') + 1
    assert (e.value.line, e.value.column) == (i + 1, col)
    assert e.value.message.startswith("expected a keyword argument name: an identifier (letters, digits "
                                      "and `_`, not starting with a digit), bare or in quotes, found a string")
    lines[i] = "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, dim.x=1)"
    with pytest.raises(RirSyntaxError, match=r"^k.rir:\d+:\d+: expected a keyword argument name: .* found a "
                                             r"name `dim.x`"):
        parse_program("\n".join(lines), "k.rir")
    # The printer writes no name the reader would refuse.
    p = sample_program()
    node = next(n for n in p.nodes if n.args)
    for bad in (INJECTED_KEY, "a.b", "é", "1x", ""):
        node.kwargs = {bad: 1}
        with pytest.raises(ValueError, match="cannot print keyword argument name"):
            format_program(p)
    node.kwargs = {"true": 1, "from": 2, "graph": 3}
    assert strip_lines(read_as_lark_does(format_program(p))).nodes == p.nodes


def test_a_float_past_the_largest_reads_as_inf():
    """`1e999` is infinity: read as `inf` is (a Special), so it is the same
    plan, with the same fingerprint, and prints as `inf`."""
    t = format_program(sample_program())
    i = _index(t.split("\n"), "  loss ")
    lines = t.split("\n")
    for lit, want in (("1e999", Special("inf")), ("-1e999", Special("-inf")), ("-2.5E+400", Special("-inf")),
                      ("1e308", 1e308), ("1e-999", 0.0)):
        lines[i] = f"  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, {lit})"
        p = parse_program("\n".join(lines))
        got = next(n for n in p.nodes if n.name == "loss").args[1]
        assert got == want and type(got) is type(want), (lit, got)


def test_special_float_args_print_as_keywords():
    assert printer._arg(Seq([Special("inf"), Special("-inf"), Special("nan"), -0.0, 1e-05])) == \
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
        parse_program(t, "m.rir")
    except RirSyntaxError as e:
        assert str(e).startswith("m.rir:") and e.line >= 1 and e.column >= 1
    read_as_lark_does(t)


# ------------------------------------------------------ the reader against lark


def _with_line(i: int, new: str) -> str:
    lines = format_program(sample_program()).split("\n")
    lines[i] = new
    return "\n".join(lines)


def _sample_line(prefix: str) -> int:
    return _index(format_program(sample_program()).split("\n"), prefix)


# (line of the sample to replace, its new text, whether it reads)
CORNERS = [
    ("  free      transformer.drop.view", "  freex", False),  # a keyword glued to a name is a name
    ("  free      transformer.drop.view", "  free%\"transformer.drop.view\"", True),
    ("  free      transformer.drop.view", "  free % \"transformer.drop.view\"", True),
    ("  free      transformer.drop.view", "  free transformer.drop.view:", False),
    ("  free      transformer.drop.view", "  free.x transformer.drop.view", False),
    ("  idx ", "  idx input i64[2,64]1024bytes source idx", True),  # no blank needed between tokens
    ("  idx ", "  idx input i64[ 2 , 64 ] 1024 bytes source graph", True),  # a word may be a keyword
    ("  idx ", "  idx inputs i64[2,64] 1024 bytes", False),
    ("  idx ", "  idx input i64[2,,64] 1024 bytes", None),  # lark reads it; the integer list is bad
    ("  idx ", "  forward input i64[2,64] 1024 bytes", None),  # a name here; but never used
    ("  idx ", "  graph input i64[2,64] 1024 bytes", False),  # a keyword here
    ("  idx ", "\t idx\tinput\fi64[2,64]\r1024 bytes   # blanks: tab, form feed, CR", True),
    ("  idx ", "  idx input i64[2,64] view of transformer.wte.weight aliases [ ]", True),
    ("  idx ", "  idx input i64[2,64] view of transformer.wte.weight aliases[]", False),  # lexed as a dtype
    ("  idx ", "  idx input i64[2,64] view of transformer.wte.weight 8 bytes aliases[]", True),
    ("  idx ", "  idx input i64[2,64] stride [-1, 2] 1024 bytes", True),
    ("  idx ", "  idx input i64[2,64] stride[1] 1024 bytes", None),  # reads; 2 dims, stride of 1
    ("  idx ", "  idx input i64[2,64] 1024 bytes requires_grad source idx", False),  # order matters
    ("  idx ", "  %\"idx\" input i64[2,64] 1024 bytes #| not a header comment here", True),
    ("  idx ", "#| a comment now", False),  # and so `values` has no `idx`
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, -inf, inf, nan, "
                "[], [[1], [-2.5e3]], 1., device(cuda:0), device(\"a b\"), none) random flops 1", True),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, infinity)", None),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, 1e999, -2.5e400, [1e308])", True),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, -infinity)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, 1e5, 1_0)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, device (cpu))", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, x_1=1, \"true\"=2, "
                "device = 3, _=4, graph=5, \"alpha\" =6)", True),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, true=1)", False),
    # A keyword argument's name is an identifier: no dots, colons, other letters, escapes.
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, torch.x=1)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, a:1=1)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, aé=1)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, truex=1, nan_=2)", True),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, \"a b\"=1)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, \"\\u0061\"=1)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, \"\"=1)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, \"1a\"=1)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, [a=1])", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view,)", False),
    ("  loss ", "  loss f32[] 4 bytes = graph(transformer.drop.view) module forward", True),
    ("  loss ", "  loss f32[] 4 bytes = \"my op\"(transformer.drop.view) mutates ( loss )", True),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view) mutates()", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view) random random", None),
    ("  loss ", "  loss: loss f32[] 4 bytes = aten.sum.default(transformer.drop.view)", True),
    ("  loss ", "  loss: = aten.sum.default(transformer.drop.view)", None),  # `loss` never declared
    ("  loss ", "  loss f32[] 4 bytes, _ = aten.sum.default(transformer.drop.view)", True),
    ("  loss ", "  _ : loss f32[] 4 bytes = aten.sum.default(transformer.drop.view)", False),
    ("  loss ", "  loss f32[] 4 bytes: x = aten.sum.default(transformer.drop.view)", False),
    ("  loss ", "  loss f32[] 4 bytes, = aten.sum.default(transformer.drop.view)", False),
    ("  loss ", "  = aten.sum.default(transformer.drop.view)", None),  # a node with no name
    ("rir 1", "rir 1 # the version", True),
    ("#| remat-ir plan", "#|\"a\"b\"", None),  # lark reads any `#|` line; this one is bad JSON
    ("#| remat-ir plan", "#|\"", None),
    ("#| remat-ir plan", "#|\"tab\\there\"  ", True),
    ("rir 1", "rir1", False),
    ("rir 1", "rir 01", True),
    ("device cpu", "device \"cuda:0\"", True),
    ("device cpu", "fingerprint \"x\"", False),  # header lines come in order, at most once
    ("has_loss true", "has_losstrue", False),
    ("budget ", "budget 7bytes total", True),
    ("budget ", "budget 7 bytes", False),
    # Offload: the host budget and the copy instructions.
    ("budget ", "budget 7 bytes total\nhost_budget 64 bytes", True),
    ("budget ", "budget 7 bytes total\nhost_budget 64", False),
    ("budget ", "budget 7 bytes total\nhost_budget $B bytes", False),
    ("budget ", "host_budget 64 bytes\nbudget 7 bytes total", False),  # order
    ("budget ", "budget 7 bytes total\nhost_budget64 bytes", False),
    ("  free      transformer.drop.view", "  offload transformer.drop.view", True),
    ("  free      transformer.drop.view", "  reload %\"transformer.drop.view\"", True),
    ("  free      transformer.drop.view", "  wait transformer.drop.view  # the copy", True),
    ("  free      transformer.drop.view", "  waittransformer.drop.view", False),
    ("  free      transformer.drop.view", "  wait", False),
    ("  free      transformer.drop.view", "  offload transformer.drop.view transformer.drop.view", False),
    ("  free      transformer.drop.view", "  offload nosuchvalue", None),  # lark reads it; never declared
    ("  idx ", "  wait input i64[2,64] 1024 bytes source idx", None),  # a name there; but never used
    ("  result 0", "  result -0 = loss", True),
    ("  result 0", "  result \"k\"=loss", True),
    ("  result 0", "  result 1.5 = loss", False),
    ("  grad ", "  grad %\"x y\" = d.transformer.wte.weight", True),
    ("outputs", "outputs extra", False),
    # Symbolic plans: sizes, size guards, size expressions.
    ("output_spec", "output_spec \"\"\nsizes B=2..4, T=32..128\nsize_guards \"T <= 128\", \"B*T != 4\"", True),
    ("output_spec", "output_spec \"\"\nsizes B = 2..4", False),
    ("output_spec", "output_spec \"\"\nsizes B=2..4,", False),
    ("output_spec", "output_spec \"\"\nsizes max=2..4", True),  # (a function's name: the verifier's business)
    ("output_spec", "output_spec \"\"\nsize_guards \"T <= 128\"\nsizes B=2..4", False),  # order
    ("output_spec", "output_spec \"\"\nsize_guards T", False),
    ("  idx ", "  idx input i64[B,T] $(8*B*T) bytes source idx", True),
    ("  idx ", "  idx input i64[B, max(T, 8)] stride [max(T,8), 1] $(8 * B*max(T,8)) bytes", True),
    ("  idx ", "  idx input i64[B,T] $B bytes", True),
    ("  idx ", "  idx input i64[B,T] $B.x bytes", False),
    ("  idx ", "  idx input i64[B,T+] 8 bytes", None),  # lark reads it; the expression is bad
    ("  idx ", "  idx input i64[B,(T] 8 bytes", None),
    ("  idx ", "  idx input i64[B,T] $(B*) bytes", None),
    ("  idx ", "  idx input i64[B,T] $(B*T bytes", False),
    ("  idx ", "  idx input i64[B,T] $() bytes", None),
    ("  idx ", "  idx input i64[2,64] view of transformer.wte.weight $(2*B) bytes", True),
    ("  idx ", "  idx input i64[2,64] view of transformer.wte.weight aliases[B]", False),  # lexed as a dtype
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, [$(B*T), $B, -1], x=$(T-1))",
     True),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, $ B)", False),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, $(max(B,T), 8))", None),
    ("  loss ", "  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, $(B) )", True),
]


@pytest.mark.parametrize("prefix,new,reads", CORNERS)
def test_corners_read_as_lark_reads(prefix, new, reads):
    p = read_as_lark_does(_with_line(_sample_line(prefix), new))
    if reads is not None:
        assert (p is not None) == reads


def test_layout_variants_read_as_lark_reads():
    t = format_program(sample_program())
    for text in ["\ufeff" + t, t.replace("\n", "\r\n"), "\n\n# c\n" + t + "\n\n  # end\n",
                 "#| a\n  #| b\n\n# c\n#|\"q\\u0001\"\n" + t, t.replace("rir 1", "rir 1\n#| late"),
                 t.replace("\ngraph backward\n", "\ngraph backward\n\ngraph backward\n"),
                 t.replace("\ngraph backward\n", "\ngraph backward\ngraph forward\ngraph backward\n"),
                 "\n".join(line for line in t.split("\n") if not line.startswith(("model", "budget"))),
                 t.rstrip("\n"), t.replace("\noutputs\n", "\noutputs\n\x0b")]:
        read_as_lark_does(text)


# Words and symbols of the language, to make lines of.
VOCABULARY = [
    "x", "idx", "loss", "_", "graph", "forward", "backward", "values", "outputs", "compute", "free",
    "freex", "view", "of", "bytes", "source", "requires_grad", "aliases", "stride", "input", "value",
    "true", "none", "inf", "-inf", "nan", "infinity", "torch.float32", "torch.x", "device(cpu)",
    "device", "module", "random", "mutates", "flops", "time_us", "result", "grad", "f32[2]", "f32[]",
    "b8[2,64,128]", "[1,2]", "[", "]", "(", ")", ",", "=", ":", "%", '"s"', '"a\\"b"', '"', "1", "-1",
    "1.5", "1e5", "0", "#c", "#|h", "aten.sum.default", "transformer.drop.view", "transformer.wte.weight",
    "d.transformer.wte.weight", "idx:1", "\t", "\r",
    "$B", "$(B*T)", "$(max(B,(T)))", "$", "$(", "f32[B,T-1]", "[64*T,1]", "sizes", "size_guards", "B=2..4",
]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.integers(0, 40), st.booleans(),
       st.lists(st.tuples(st.sampled_from(VOCABULARY), st.sampled_from(["", " ", "  "])), max_size=10))
def test_lines_of_words_read_as_lark_reads(where, replace, words):
    lines = format_program(sample_program()).split("\n")
    where %= len(lines)
    line = "  " * (where % 2) + "".join(w + sep for w, sep in words)
    lines[where:where + replace] = [line]
    read_as_lark_does("\n".join(lines))


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=200),
                 st.binary(max_size=200).map(lambda b: b.decode("utf-8", errors="replace")),
                 st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 st.text(alphabet=st.sampled_from(list("rir 1\nvalues graph forward backward outputs"
                                                       "x=()[],:%\"#|_-.0123456789\r\t")), max_size=300)))
def test_any_text_reads_or_fails_cleanly(text):
    for t in (text, "rir 1\n" + text, format_program(sample_program())[:300] + text):
        try:
            parse_program(t, "r.rir")
        except RirSyntaxError as e:
            assert e.line >= 1 and e.column >= 1 and str(e).startswith("r.rir:")
        read_as_lark_does(t)


# ------------------------------------------------------------ symbolic plans

PLANS = os.path.join(os.path.dirname(__file__), "plans")


def test_symbolic_plan_reads_and_prints_back():
    path = os.path.join(PLANS, "mlp-batch.rir")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    p = load_plan(path)
    assert format_program(p) == text
    assert read_as_lark_does(text) == p
    assert p.header.sizes == ["B=2..8"]
    x = p.value_map()["x"]
    assert x.shape == ["B", 4] and x.stride == [4, 1] and x.nbytes == "16*B"
    assert p.value_map()["h.t"].stride == [1, 8]
    d_out = next(n for n in p.nodes if n.name == "d.out")
    assert d_out.args[1] == Seq([Sym("B"), 3])
    # Byte counts in comments are at the high end of the range, and say so.
    assert "  x       input    f32[B,4] $(16*B) bytes source x   # 128 B at B=8" in text
    assert "# 4 values, 356 B at B=8" in text


def test_symbolic_text_is_canonical():
    p = sample_program()
    p.header.sizes = ["B=2..4", "T=32..128"]
    p.header.size_guards = ["T <= 128", "B*T != 4"]
    emb = p.value_map()["transformer.wte.embedding"]
    emb.shape, emb.stride, emb.nbytes = ["B", "T", 128], ["128*T", 128, 1], "512*B*T"
    view = p.value_map()["transformer.drop.view"]
    view.shape, view.stride = ["B*T", "max(T,8)"], ["max(T,8)", 1]
    p.nodes[2].args[1] = Seq([Sym("B*T"), Sym("2*(T-1)"), Sym("B")])
    t = format_program(p)
    assert "\nsizes B=2..4, T=32..128\nsize_guards \"T <= 128\", \"B*T != 4\"\n" in t
    assert " f32[B,T,128] $(512*B*T) bytes = aten.embedding.default" in t  # (a contiguous stride: not written)
    assert " f32[B*T,max(T,8)] view of transformer.drop.native_dropout = " in t
    assert "aten.view.default(transformer.drop.native_dropout, [$(B*T), $(2*(T-1)), $B])" in t
    assert "# 256.0 KiB at B=4,T=128" in t
    q = parse_program(t)
    assert strip_lines(q) == p and format_program(q) == t and read_as_lark_does(t) == q
    # Any spelling reads as the canonical one.
    messy = t.replace("f32[B,T,128] $(512*B*T)", "f32[ B , (T) ,128] $( 512 * B * T )").replace(
        "[$(B*T), $(2*(T-1)), $B]", "[$( B*T ), $(2*(T - 1)), $(B)]")
    assert messy != t and format_program(parse_program(messy)) == t


def test_size_lexemes_are_the_grammars():
    g = parser.grammar_text()
    for terminal, regex in (("TYPE.2", syntax.TYPE_RE), ("INTS.2", syntax.INTS_RE), ("SYM", syntax.SYM_RE),
                            ("SIZE_RANGE", syntax.SIZE_RANGE_RE)):
        line = next(line for line in g.split("\n") if line.startswith(terminal + ": /"))
        assert line[len(terminal) + 3:].startswith(regex.pattern + "/"), terminal


def test_size_expressions_nest_at_most_8_deep():
    lines = format_program(sample_program()).split("\n")
    i = _index(lines, "  loss ")
    for depth in range(1, syntax.MAX_SIZE_PARENS + 3):
        expr = "(" * (depth - 1) + "B" + ")" * (depth - 1)
        lines[i] = f"  loss f32[] 4 bytes = aten.sum.default(transformer.drop.view, $({expr}))"
        text = "\n".join(lines)
        p = read_as_lark_does(text)
        if depth <= syntax.MAX_SIZE_PARENS:
            assert next(n for n in p.nodes if n.name == "loss").args[1] == Sym("B")
        else:
            assert p is None
            e = _err(text)
            assert (e.line, e.column) == (i + 1, lines[i].index("$") + 1)
            assert "parentheses nest more than 8 deep" in e.message
    # In a dimension, too (the brackets delimit it: lark reads any depth, the reader refuses).
    lines[i] = "  loss f32[" + "(" * 9 + "B" + ")" * 9 + "] 4 bytes = aten.sum.default(transformer.drop.view)"
    assert "parentheses nest more than 8 deep" in _err("\n".join(lines)).message


@pytest.mark.parametrize("decl,at,words", [
    ("f32[B,T+] 4 bytes", "f32", "bad dimension `T+`: 'T+' is not a size expression: expected integers, symbols"),
    ("f32[B] stride [B**2] 4 bytes", "[B**", "bad stride `B**2`: 'B**2' is not a size expression"),
    ("f32[B] $(B x) bytes", "$", "bad byte count `B x`: 'B x' is not a size expression: expected"),
    ("f32[B] $(B, 2) bytes", "$", "bad byte count `B, 2`"),
    ("f32[B,] 4 bytes", "f32", "bad dimension list `f32[B,]`: write integers or size expressions"),
    ("f32[] 4 bytes = aten.sum.default(transformer.drop.view, $(max(B)))", "$", "bad size argument `max(B)`"),
])
def test_malformed_size_expressions_are_errors_at_their_place(decl, at, words):
    lines = format_program(sample_program()).split("\n")
    i = _index(lines, "  loss ")
    lines[i] = "  loss " + decl + ("" if "=" in decl else " = aten.sum.default(transformer.drop.view)")
    e = _err("\n".join(lines))
    assert (e.line, e.column) == (i + 1, lines[i].index(at) + 1) and words in e.message, e
    read_as_lark_does("\n".join(lines))


def test_printer_refuses_what_is_no_size():
    for edit in (lambda p: setattr(p.values[0], "shape", ["B+", 64]),
                 lambda p: setattr(p.values[0], "nbytes", "B*"),
                 lambda p: setattr(p.nodes[2], "args", [Ref("transformer.drop.native_dropout"), Sym("T<2")]),
                 lambda p: setattr(p.header, "sizes", ["T = 1..2"])):
        p = sample_program()
        edit(p)
        with pytest.raises(ValueError, match="cannot print"):
            format_program(p)
