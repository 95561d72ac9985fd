"""The interpreter's generated code holds no plan text but string literals.

`Executable` compiles a plan's schedule to Python source.  Whatever the plan
says (value and node names, keyword argument names and values, strings,
floats), the source is straight-line code of a few fixed shapes whose only
plan-given parts are literals; checked here on plans the verifier never saw."""
from __future__ import annotations

import ast
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat_ir.ir import (
    BACKWARD, COMPUTE, FORWARD, FREE, GRAD, INPUT, OFFLOAD, PARAM, RECOMPUTE, RELOAD, RESULT, TANGENT, VALUE, WAIT,
    Device, DType, Header, Instr, Layout, MemoryFormat, Node, Output, Program, Ref, Seq, Special, Sym, Value,
)
from remat_ir.runtime.bind import PlanMismatch
from remat_ir.runtime.interpret import Executable

INJECTED_KEY = "other=E['w']) if __import__('os').system('touch {}') == 0 else dict(a"

# (op, how many outputs it has, whether it draws random numbers)
OPS = [("aten.add.Tensor", 1, False), ("aten.mul.Tensor", 1, False),
       ("aten.native_dropout.default", 2, True), ("aten.split.Tensor", 3, False),
       ("aten.var_mean.correction", 2, False)]

text = st.text(max_size=10)
nasty = st.one_of(text, st.sampled_from([INJECTED_KEY, "'", '"', "\\", "')\n__import__('os')#", "\n", "E",
                                         "inf", "nan", "-inf", "float('inf')", "a b", "x.y", "é", ""]))


# Size expressions of a symbolic plan: any identifiers as symbols (the code
# holds them only as string keys of S).
symbol = st.sampled_from(["B", "T", "E", "C", "S", "__import__", "exec", "os", "_r"])
size_expr = st.recursive(
    st.one_of(symbol, st.integers(-5, 2 ** 40).map(str)),
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "//", "%"]), inner).map(lambda t: f"({t[0]}){t[1]}({t[2]})"),
        st.tuples(st.sampled_from(["max", "min"]), inner, inner).map(lambda t: f"{t[0]}({t[1]},{t[2]})")),
    max_leaves=6)


def scalars(refs: list[str]):
    return st.one_of(
        st.builds(Sym, size_expr),
        st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(), nasty,
        st.builds(DType, st.sampled_from(["float32", "int64", "bfloat16", "bool"])),
        st.builds(Layout, st.sampled_from(["strided", "sparse_coo"])),
        st.builds(MemoryFormat, st.sampled_from(["contiguous_format", "channels_last"])),
        st.builds(Device, st.sampled_from(["cpu", "meta", "cuda:0"])),
        st.builds(Special, st.sampled_from(["inf", "-inf", "nan"])),
        st.builds(Ref, st.sampled_from(refs)))


def args_of(refs: list[str]):
    return st.recursive(scalars(refs), lambda inner: st.builds(Seq, st.lists(inner, max_size=3)),
                        max_leaves=6)


def _value(name: str, kind: str, source: str = "") -> Value:
    return Value(name, kind, "float32", [2], [1], name, 8, source=source)


@st.composite
def programs(draw) -> Program:
    names = draw(st.lists(nasty, min_size=3, max_size=10, unique=True))
    n_in = draw(st.integers(1, len(names) - 1))
    inputs, produced = names[:n_in], names[n_in:]
    values = [_value(n, draw(st.sampled_from([INPUT, PARAM]))) for n in inputs]
    tangent = names[0] + "\x00t"
    values.append(_value(tangent, TANGENT, source="0"))
    refs = inputs + [tangent]
    nodes: list[Node] = []
    node_names: set[str] = set()
    rest = list(produced)
    while rest:
        op, n_out, random = draw(st.sampled_from(OPS))
        k = 1 if n_out == 1 else draw(st.integers(1, min(n_out, len(rest))))
        outs, rest = rest[:k], rest[k:]
        outputs = list(outs)
        while len(outputs) < n_out and n_out > 1:
            outputs.insert(draw(st.integers(0, len(outputs))), "")
        name = outs[0] if draw(st.booleans()) else draw(nasty)
        while name in node_names:
            name += "'"
        node_names.add(name)
        nodes.append(Node(
            name=name, op=op, args=draw(st.lists(args_of(refs), max_size=4)),
            kwargs=draw(st.dictionaries(nasty, args_of(refs), max_size=3)),
            outputs=outputs, phase=draw(st.sampled_from([FORWARD, BACKWARD])), random=random))
        values += [_value(o, VALUE) for o in outs]
        refs = refs + outs
    order = [n.name for n in nodes]
    forward = [Instr(COMPUTE, n) for n in order]
    forward += [Instr(FREE, v) for v in draw(st.lists(st.sampled_from(names), max_size=3))]
    backward = [Instr(RECOMPUTE, n) for n in draw(st.lists(st.sampled_from(order), max_size=3))]
    backward += [Instr(FREE, v) for v in draw(st.lists(st.sampled_from(names), max_size=2))]
    # Offload instructions, anywhere: the code calls the step's transfers with the value's name.
    for section in (forward, backward):
        for kind, v in draw(st.lists(st.tuples(st.sampled_from([OFFLOAD, RELOAD, WAIT]), st.sampled_from(names)),
                                     max_size=3)):
            section.insert(draw(st.integers(0, len(section))), Instr(kind, v))
    outputs = [Output(RESULT, "0", draw(st.sampled_from(names)))]
    outputs += [Output(GRAD, draw(nasty), v) for v in draw(st.lists(st.sampled_from(produced), max_size=3))]
    return Program(header=Header(), values=values, nodes=nodes, forward=forward, backward=backward,
                   outputs=outputs)


# ----------------------------------------------------- the shapes of the code


class Shapes:
    """Checks a generated function's AST node by node: every statement and
    expression is one the code generator writes, every name one of its few."""

    def __init__(self, program: Program, n_consts: int):
        self.value_names = {v.name for v in program.values}
        self.node_names = {n.name for n in program.nodes}
        self.kwarg_keys = {k for n in program.nodes for k in n.kwargs}
        self.strings = set()
        for n in program.nodes:
            self._strings(n.args)
            self._strings(list(n.kwargs.values()))
        self.n_consts = n_consts
        self.calls = 0

    def _strings(self, args):
        for a in args:
            if isinstance(a, str):
                self.strings.add(a)
            elif isinstance(a, Seq):
                self._strings(a.items)

    def function(self, src: str, name: str) -> None:
        mod = ast.parse(src)
        assert len(mod.body) == 1
        fn = mod.body[0]
        assert type(fn) is ast.FunctionDef and fn.name == name
        assert not fn.decorator_list and fn.returns is None
        a = fn.args
        assert [x.arg for x in a.args] == ["E", "R", "C", "S", "X", "get_rng", "set_rng"]
        assert not (a.posonlyargs or a.kwonlyargs or a.defaults or a.kw_defaults or a.vararg or a.kwarg)
        for s in fn.body[:-1]:
            self.statement(s)
        ret = fn.body[-1]
        assert type(ret) is ast.Return and type(ret.value) is ast.Tuple
        for e in ret.value.elts:
            assert type(e) is ast.Call and not e.keywords and len(e.args) == 1
            assert type(e.func) is ast.Attribute and e.func.attr == "pop" and self.is_name(e.func.value, "E")
            assert self.string_const(e.args[0]) in self.value_names

    @staticmethod
    def is_name(e, *names) -> bool:
        return type(e) is ast.Name and e.id in names

    @staticmethod
    def string_const(e) -> str:
        assert type(e) is ast.Constant and type(e.value) is str
        return e.value

    def subscript(self, e, base: str) -> str:
        assert type(e) is ast.Subscript and self.is_name(e.value, base)
        return self.string_const(e.slice)

    def statement(self, s) -> None:
        t = type(s)
        if t is ast.Delete:
            assert len(s.targets) == 1
            d = s.targets[0]
            if type(d) is ast.Name:
                assert d.id in ("_r", "_s")
            else:
                assert self.subscript(d, "E") in self.value_names
            return
        if t is ast.Expr and type(s.value.func) is ast.Attribute:  # X.offload('v', E['v']), X.wait('v', E), ...
            c = s.value
            assert self.is_name(c.func.value, "X") and not c.keywords
            assert c.func.attr in ("offload", "reload", "wait", "free")
            assert self.string_const(c.args[0]) in self.value_names
            rest = {"offload": "E[name]", "wait": "E"}.get(c.func.attr)
            if rest is None:
                assert len(c.args) == 1
            elif rest == "E":
                assert len(c.args) == 2 and self.is_name(c.args[1], "E")
            else:
                assert len(c.args) == 2 and self.subscript(c.args[1], "E") == c.args[0].value
            return
        if t is ast.Expr:  # set_rng(R[...]) / set_rng(_s)
            c = s.value
            assert type(c) is ast.Call and self.is_name(c.func, "set_rng") and not c.keywords
            assert len(c.args) == 1
            if type(c.args[0]) is ast.Name:
                assert c.args[0].id == "_s"
            else:
                assert self.subscript(c.args[0], "R") in self.node_names
            return
        assert t is ast.Assign and len(s.targets) == 1, ast.dump(s)
        target, value = s.targets[0], s.value
        if type(target) is ast.Name:
            assert target.id in ("_r", "_s")
            if target.id == "_s":
                assert self.rng_call(value)
            else:
                self.op_call(value)
            return
        assert type(target) is ast.Subscript and type(target.value) is ast.Name
        if target.value.id == "R":
            assert self.subscript(target, "R") in self.node_names and self.rng_call(value)
            return
        assert self.subscript(target, "E") in self.value_names
        if type(value) is ast.Subscript and self.is_name(value.value, "_r"):
            assert type(value.slice) is ast.Constant and type(value.slice.value) is int
        else:
            self.op_call(value)

    def rng_call(self, e) -> bool:
        return type(e) is ast.Call and self.is_name(e.func, "get_rng") and not e.args and not e.keywords

    def const_ref(self, e) -> None:
        assert type(e) is ast.Subscript and self.is_name(e.value, "C")
        assert type(e.slice) is ast.Constant and type(e.slice.value) is int
        assert 0 <= e.slice.value < self.n_consts

    def op_call(self, e) -> None:
        assert type(e) is ast.Call
        self.const_ref(e.func)
        self.calls += 1
        for a in e.args:
            self.arg(a)
        if e.keywords:
            assert len(e.keywords) == 1 and e.keywords[0].arg is None
            d = e.keywords[0].value
            assert type(d) is ast.Dict
            for k, v in zip(d.keys, d.values):
                assert self.string_const(k) in self.kwarg_keys
                self.arg(v)

    def arg(self, e) -> None:
        t = type(e)
        if t is ast.Constant:
            assert type(e.value) in (str, int, float, bool, type(None))
            if type(e.value) is str:
                assert e.value in self.strings
        elif t is ast.UnaryOp and type(e.operand) is ast.Constant:  # a negative number
            assert type(e.op) is ast.USub
            assert type(e.operand.value) in (int, float)
        elif t is ast.UnaryOp:
            self.size(e)
        elif t is ast.List:
            for x in e.elts:
                self.arg(x)
        elif t is ast.Call and self.is_name(e.func, "max", "min"):
            self.size(e)
        elif t is ast.Call:  # float('inf'), float('-inf'), float('nan')
            assert self.is_name(e.func, "float") and not e.keywords and len(e.args) == 1
            assert self.string_const(e.args[0]) in ("inf", "-inf", "nan")
        elif t is ast.Subscript and self.is_name(e.value, "E"):
            assert self.subscript(e, "E") in self.value_names
        elif t is ast.BinOp or (t is ast.Subscript and self.is_name(e.value, "S")):
            self.size(e)
        else:
            self.const_ref(e)

    def size(self, e) -> None:
        """A size expression: integers, S['symbol'], + - * // %, unary -, max, min."""
        t = type(e)
        if t is ast.Constant:
            assert type(e.value) is int
        elif t is ast.Subscript:
            self.string_const(e.slice)
            assert self.is_name(e.value, "S")
        elif t is ast.BinOp:
            assert type(e.op) in (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
            self.size(e.left)
            self.size(e.right)
        elif t is ast.UnaryOp:
            assert type(e.op) is ast.USub
            self.size(e.operand)
        else:
            assert t is ast.Call and self.is_name(e.func, "max", "min") and len(e.args) == 2 and not e.keywords
            self.size(e.args[0])
            self.size(e.args[1])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_generated_code_has_only_its_own_shapes(program):
    exe = Executable(program)  # no verifier: the code must be safe whatever the plan says
    shapes = Shapes(program, len(exe.consts))
    fns = [(exe.forward_fn, "forward")] + [(fn, f"backward_{i}") for i, (fn, _) in enumerate(exe.segments)]
    for fn, name in fns:
        shapes.function(fn.source, name)
    scheduled = sum(1 for i in program.forward + program.backward if i.kind in (COMPUTE, RECOMPUTE))
    assert shapes.calls == scheduled
    # The constants are the ops and torch's dtypes, layouts, memory formats and devices.
    for c in exe.consts:
        assert isinstance(c, (torch._ops.OpOverload, torch.dtype, torch.layout, torch.memory_format,
                              torch.device))


# --------------------------------------------------- what the code then does


def _one_node_program(node: Node, inputs=("x", "y")) -> Program:
    values = [_value(n, INPUT) for n in inputs] + [_value(o, VALUE) for o in node.outputs if o]
    return Program(header=Header(), values=values, nodes=[node], forward=[Instr(COMPUTE, node.name)],
                   backward=[], outputs=[Output(RESULT, "0", node.outputs[0])])


def _run_forward(exe: Executable, env: dict) -> dict:
    exe.forward_fn(env, {}, exe.consts, {}, None, torch.get_rng_state, torch.set_rng_state)
    return env


def test_keyword_arguments_and_non_finite_floats_run(tmp_path):
    x, y = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])
    add = Node("z", "aten.add.Tensor", [Ref("x"), Ref("y")], {"alpha": 2.0}, ["z"], FORWARD)
    assert torch.equal(_run_forward(Executable(_one_node_program(add)), {"x": x, "y": y})["z"], x + 2 * y)
    # A float inf (not Special) is `float('inf')` in the code, not the name `inf`.
    clamp = Node("z", "aten.clamp.default", [Ref("x")], {"min": -math.inf, "max": Special("inf")}, ["z"], FORWARD)
    exe = Executable(_one_node_program(clamp))
    assert "float('-inf')" in exe.forward_fn.source
    assert torch.equal(_run_forward(exe, {"x": x, "y": y})["z"], x)
    fill = Node("z", "aten.add.Scalar", [Ref("x"), math.nan], {}, ["z"], FORWARD)
    assert torch.isnan(_run_forward(Executable(_one_node_program(fill)), {"x": x, "y": y})["z"]).all()
    # A keyword argument name the reader refuses is only ever a dict key.
    marker = tmp_path / "x"
    bad = Node("z", "aten.add.Tensor", [Ref("x"), Ref("y")], {INJECTED_KEY.format(marker): 1}, ["z"], FORWARD)
    exe = Executable(_one_node_program(bad))
    assert repr(INJECTED_KEY.format(marker)) in exe.forward_fn.source
    with pytest.raises((TypeError, RuntimeError)):
        _run_forward(exe, {"x": x, "y": y, "w": y})
    assert not marker.exists()


@pytest.mark.parametrize("arg", [Special("__import__('os')"), DType("load"), DType("float32)"),
                                 Layout("float32"), MemoryFormat("nn"), Sym("__import__('os')"),
                                 Sym("T.__class__"), Sym("[T]"), Sym("T if T else 0"), Sym("T**2")])
def test_other_torch_names_and_specials_are_refused(arg):
    node = Node("z", "aten.add.Tensor", [Ref("x"), Ref("y")], {"alpha": arg}, ["z"], FORWARD)
    with pytest.raises(PlanMismatch):
        Executable(_one_node_program(node))



def test_sizes_are_computed_from_the_steps_sizes():
    view = Node("z", "aten.view.default", [Ref("x"), Seq([Sym("B*T//(max(T,2)//2)"), Sym("max(T,2)//2")])], {}, ["z"], FORWARD)
    values = [Value("x", INPUT, "float32", ["B", "T"], ["T", 1], "x", "4*B*T"),
              Value("z", VALUE, "float32", ["B*T//(max(T,2)//2)", "max(T,2)//2"], ["max(T,2)//2", 1], "x", 0)]
    program = Program(header=Header(sizes=["B=2..4", "T=2..8"]), values=values, nodes=[view],
                      forward=[Instr(COMPUTE, "z")], backward=[], outputs=[Output(RESULT, "0", "z")])
    exe = Executable(program)
    x = torch.arange(12.0).reshape(3, 4)
    env = {"x": x}
    exe.forward_fn(env, {}, exe.consts, {"B": 3, "T": 4}, None, torch.get_rng_state, torch.set_rng_state)
    assert env["z"].shape == (6, 2) and torch.equal(env["z"], x.view(6, 2))
