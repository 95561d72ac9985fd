"""A plan's guards: the decisions its step took on the values of its inputs.

Each guard is one line of text, `expression == value`: the expression is
aten op calls over the step's inputs (`input('attention_mask')`) and buffers
(`buffer('rope.inv_freq')`), in a symbolic plan sizes (`size('B*T')`, an
expression over its size symbols: `remat_ir.ir.sizes`) and literals, written by the tracer
(`remat_ir.trace.guards`); the value is what it gave on the call the plan was
made from.  `traced() == False` records that the model asked whether it was
traced and was told no, as in eager.  A plan's step is its graph only while
its guards hold.  `Guard` reads the text back without running it as code:
anything but those calls, leaves and literals is refused.
"""
from __future__ import annotations

import ast
import math
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["Guard", "GuardError", "TRACED", "answers_of", "failed_guard", "literal", "run_op", "mutates"]

TRACED = "traced() == False"


class GuardError(ValueError):
    """A guard's text is not one remat-ir writes, or a query cannot be answered."""


def literal(x) -> str:
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return repr(x)
    if isinstance(x, float):
        return repr(x) if math.isfinite(x) else f"float({str(x)!r})"
    if isinstance(x, torch.dtype) or isinstance(x, (torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, torch.device):
        return f"torch.device({str(x)!r})"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(literal(y) for y in x) + "]"
    raise TypeError(f"a {type(x).__name__} is not a guard literal")


def run_op(func, args, kwargs):
    """An aten op on real tensors, as eager runs it: no modes, no autocast, no grad."""
    with _disable_current_modes(), torch._C._DisableAutocast(), torch.no_grad():
        return func(*args, **kwargs)


def mutates(func) -> bool:
    schema = func._schema
    return schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


_TORCH_ATTRS = (torch.dtype, torch.layout, torch.memory_format)


class Guard:
    """A guard read back from its text: `expr(leaf)` is the value its
    expression has now (`leaf(kind, name)` gives a tensor), `want` the one
    the plan recorded, `expression` the text left of `==`."""

    def __init__(self, text: str):
        self.text = text
        if text == TRACED:
            self.expression, self.expr, self.want = "traced()", (lambda leaf: False), False
            return
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError as e:
            raise GuardError(f"guard {text!r} is not an expression: {e.msg}") from None
        if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1 and isinstance(tree.ops[0], ast.Eq)
                and "\n" not in text):
            raise GuardError(f"guard {text!r} is not `expression == value`")
        self.expression = text[:tree.left.end_col_offset]
        expr = _build(tree.left, text)
        self.expr = expr if callable(expr) else (lambda leaf: expr)
        self.want = _build(tree.comparators[0], text)
        if callable(self.want) or not isinstance(self.want, (bool, int, float)):
            raise GuardError(f"guard {text!r}: the recorded value must be a number or a bool")


def _build(node, text: str):
    """`node` as a constant, or as a function of `leaf` when it reads tensors."""
    def bad(what: str):
        raise GuardError(f"guard {text!r}: {what} is not allowed in a guard")

    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _build(node.operand, text)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v
        bad("a negated non-number")
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_build(x, text) for x in node.elts]
        if any(callable(x) for x in items):
            return lambda leaf: [x(leaf) if callable(x) else x for x in items]
        return items
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        v = getattr(torch, node.attr, None)
        if isinstance(v, _TORCH_ATTRS):
            return v
        bad(f"torch.{node.attr}")
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
        inner, k = _build(node.value, text), node.slice.value
        if not callable(inner):
            bad("indexing a constant")
        return lambda leaf: inner(leaf)[k]
    if isinstance(node, ast.Call):
        fname = _dotted(node.func)
        if fname in ("input", "buffer") and len(node.args) == 1 and not node.keywords \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            kind, name = fname, node.args[0].value
            return lambda leaf: leaf(kind, name)
        if fname == "size" and len(node.args) == 1 and not node.keywords \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            from remat_ir.ir.sizes import SizeError, size_text

            try:
                expr = size_text(node.args[0].value)
            except SizeError as e:
                raise GuardError(f"guard {text!r}: {e}") from None
            return lambda leaf: leaf("size", expr)
        if fname == "float" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value in ("inf", "-inf", "nan"):
            return float(node.args[0].value)
        if fname == "torch.device" and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            return torch.device(node.args[0].value)
        if fname is None or fname.count(".") != 2:
            bad(f"calling {ast.unparse(node.func)}")
        from remat_ir.ir.ops import resolve

        try:
            func = resolve(fname)
        except AttributeError:
            raise GuardError(f"guard {text!r}: unknown op {fname} in this PyTorch build") from None
        if not isinstance(func, torch._ops.OpOverload) or mutates(func):
            bad(f"the op {fname}")
        args = [_build(a, text) for a in node.args]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                bad("**")
            kwargs[kw.arg] = _build(kw.value, text)

        def call(leaf):
            a = [x(leaf) if callable(x) else x for x in args]
            k = {n: x(leaf) if callable(x) else x for n, x in kwargs.items()}
            return run_op(func, a, k)

        return call
    bad(type(node).__name__)


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def failed_guard(guards: list[Guard], leaf: Callable) -> str:
    """The first of `guards` that does not hold, in words, or "" when all hold."""
    for g in guards:
        try:
            now = g.expr(leaf)
        except KeyError as e:
            return f"the plan's guard {g.text!r} reads {e.args[0]}, which this call does not have"
        if isinstance(now, torch.Tensor):
            now = now.item()
        if now != g.want or isinstance(now, bool) != isinstance(g.want, bool):
            return f"the plan holds while {g.text}, and this call gives {literal(now)}"
    return ""


def answers_of(guards: list[str]) -> dict:
    """expression -> recorded value, for a check of a model against a plan."""
    return {g.expression: g.want for g in map(Guard, guards) if g.text != TRACED}
