"""A plan's guards: the decisions its step took on the values of its inputs.

Each guard is one line of text, `expression == value`: the expression is
aten op calls over the step's inputs (`input('attention_mask')`) and buffers
(`buffer('rope.inv_freq')`), in a symbolic plan sizes (`size('B*T')`, an
expression over its size symbols: `remat_ir.ir.sizes`) and literals, written by the tracer
(`remat_ir.trace.guards`); the value is what it gave on the call the plan was
made from.  `traced() == False` records that the model asked whether it was
traced and was told no, as in eager.  A plan's step is its graph only while
its guards hold.

A guard is plan text, and plan text is data: it is read back without running
it as code, and it may only read values.  Its calls are the ops of `OPS`
(comparisons, logic, reductions, casts, views and arithmetic: what model code
runs to look at a mask), each with a tensor operand computed from an input or
a buffer; no factory, random op, I/O or printing can be named.  Evaluation is
bounded: no op's result may have more elements than the largest tensor the
guard reads (one element at least), which only broadcasting and `expand` could
break, and they are checked before they run.  A guard that fails as it runs (a
bad reshape, a missing input, another device) is a refusal naming it, never an
error of the program.  The runtime, the verifier and the tracer all take these
rules from here.
"""
from __future__ import annotations

import ast
import math
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["OPS", "Guard", "GuardError", "TRACED", "answers_of", "failed_guard", "literal", "run_op", "mutates"]

TRACED = "traced() == False"

# The guard language's ops.  Each reads values and allocates at most what
# its operands hold (broadcasting and `expand` are bounded as they run).
OPS = frozenset("aten." + op for op in """
    _local_scalar_dense.default item.default is_nonzero.default equal.default
    eq.Scalar eq.Tensor ne.Scalar ne.Tensor lt.Scalar lt.Tensor le.Scalar le.Tensor
    gt.Scalar gt.Tensor ge.Scalar ge.Tensor
    logical_and.default logical_or.default logical_xor.default logical_not.default
    bitwise_and.Tensor bitwise_and.Scalar bitwise_or.Tensor bitwise_or.Scalar
    bitwise_xor.Tensor bitwise_xor.Scalar bitwise_not.default
    isnan.default isinf.default isfinite.default where.self
    all.default all.dim all.dims any.default any.dim any.dims
    sum.default sum.dim_IntList prod.default prod.dim_int mean.default mean.dim
    min.default min.dim max.default max.dim amin.default amax.default
    argmin.default argmax.default count_nonzero.default count_nonzero.dim_IntList
    cumsum.default diff.default
    add.Tensor add.Scalar sub.Tensor sub.Scalar rsub.Tensor rsub.Scalar
    mul.Tensor mul.Scalar div.Tensor div.Scalar div.Tensor_mode div.Scalar_mode
    remainder.Tensor remainder.Scalar floor_divide.default neg.default abs.default sign.default
    minimum.default maximum.default clamp.default
    _to_copy.default to.dtype clone.default alias.default detach.default
    view.default _unsafe_view.default reshape.default slice.Tensor select.int narrow.default
    unsqueeze.default squeeze.default squeeze.dim squeeze.dims expand.default
    permute.default t.default transpose.int unbind.int
    sym_size.int sym_numel.default sym_stride.int
""".split())

# The one op of OPS whose result can be larger than all its operands but for
# broadcasting them: it gives the shape it is asked for.
_EXPAND = "aten.expand.default"


class GuardError(ValueError):
    """A guard's text is not in the guard language, a guard cannot be
    evaluated on a call, or a query cannot be answered."""


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


# ------------------------------------------------------------ the expression


class _Leaf:
    """`input('x')`, `buffer('x')`, or `size('B*T')` (an int)."""

    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name


class _Call:
    def __init__(self, name: str, func, args: list, kwargs: dict):
        self.name, self.func, self.args, self.kwargs = name, func, args, kwargs


class _Item:
    """The k-th result of an op that returns several (`aten.max.dim(...)[0]`)."""

    def __init__(self, inner, k: int):
        self.inner, self.k = inner, k


class _Refused(Exception):
    """A guard that cannot be evaluated on this call, and why."""


def _reads_tensor(x) -> bool:
    """Whether `x` depends on an input or a buffer (a size leaf is an int)."""
    if isinstance(x, _Leaf):
        return x.kind != "size"
    if isinstance(x, _Call):
        return True  # (every call has such an operand: `_build` checks it)
    if isinstance(x, _Item):
        return _reads_tensor(x.inner)
    if isinstance(x, list):
        return any(_reads_tensor(y) for y in x)
    return False


def _leaves(x, out: dict) -> dict:
    if isinstance(x, _Leaf):
        out[(x.kind, x.name)] = x
    elif isinstance(x, _Call):
        for a in [*x.args, *x.kwargs.values()]:
            _leaves(a, out)
    elif isinstance(x, _Item):
        _leaves(x.inner, out)
    elif isinstance(x, list):
        for y in x:
            _leaves(y, out)
    return out


class Guard:
    """A guard read back from its text: `expr(leaf)` is the value its
    expression has now (`leaf(kind, name)` gives a tensor, or an int for
    `size`), `want` the one the plan recorded, `expression` the text left
    of `==`.  `expr` raises GuardError when the guard cannot be evaluated."""

    def __init__(self, text: str):
        self.text = text
        if text == TRACED:
            self.expression, self._tree, self.want, self._leaves, self.reads = "traced()", False, False, {}, []
            return
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError as e:
            raise GuardError(f"guard {text!r} is not an expression: {e.msg}") from None
        except (RecursionError, MemoryError, ValueError):
            raise GuardError(f"guard {text!r} is not an expression remat-ir writes") from None
        if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1 and isinstance(tree.ops[0], ast.Eq)
                and "\n" not in text):
            raise GuardError(f"guard {text!r} is not `expression == value`")
        self.expression = text[:tree.left.end_col_offset]
        try:
            self._tree = _build(tree.left, text)
            self.want = _build(tree.comparators[0], text)
        except RecursionError:
            raise GuardError(f"guard {text!r} nests too deep") from None
        if not _reads_tensor(self._tree):
            raise GuardError(f"guard {text!r} reads no input or buffer: a guard is a decision on their values")
        if not isinstance(self.want, (bool, int, float)):
            raise GuardError(f"guard {text!r}: the recorded value must be a number or a bool")
        self._leaves = _leaves(self._tree, {})
        self.reads = list(self._leaves)  # (kind, name) of each leaf

    def expr(self, leaf: Callable):
        if self.text == TRACED:
            return False
        values = {}
        for key in self._leaves:
            try:
                values[key] = leaf(*key)
            except Exception:  # noqa: BLE001 (whatever the lookup raises, the call has no such value)
                raise GuardError(f"the plan's guard {self.text!r} reads {key[0]}({key[1]!r}), which this call "
                                 "does not have") from None
        limit = max([1] + [v.numel() for v in values.values() if isinstance(v, torch.Tensor)])
        try:
            now = _evaluate(self._tree, values, limit, {}, False)
            if isinstance(now, torch.Tensor):
                if now.numel() != 1:
                    raise _Refused(f"it gives a tensor of {now.numel()} elements, not one value")
                now = now.item()
            if not isinstance(now, (bool, int, float)):
                raise _Refused(f"it gives a {type(now).__name__}, not a number or a bool")
        except _Refused as e:
            raise GuardError(f"the plan's guard {self.text!r} cannot be evaluated on this call: {e}") from None
        except Exception as e:  # noqa: BLE001 (plan text is data: an op it names may fail in any way)
            first = (str(e).strip().splitlines() or [""])[0]
            raise GuardError(f"the plan's guard {self.text!r} cannot be evaluated on this call: "
                             f"{type(e).__name__}: {first}") from None
        return now

    def shape_problem(self, fakes: dict) -> str:
        """Why this guard cannot run on tensors of the shapes of `fakes`
        ((kind, name) -> fake tensor, for each of `reads`), or "".  Values
        are not read: what depends on them is not checked."""
        if self.text == TRACED:
            return ""
        limit = max([1] + [v.numel() for v in fakes.values() if isinstance(v, torch.Tensor)])
        try:
            _evaluate(self._tree, fakes, limit, {}, True)
        except _Refused as e:
            return f"guard {self.text!r} cannot run on the plan's inputs: {e}"
        except Exception as e:  # noqa: BLE001 (as in `expr`)
            first = (str(e).strip().splitlines() or [""])[0]
            return f"guard {self.text!r} cannot run on the plan's inputs: {type(e).__name__}: {first}"
        return ""


# Ops of OPS that hand a tensor's values to Python.
_READS_VALUES = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
                 "aten.equal.default"}
_UNKNOWN = object()  # a value not known when only shapes are
_MADE = "elements made"  # (a memo key: no id() is a str)
_MAX_MADE = 16


def _evaluate(x, values: dict, limit: int, memo: dict, shapes_only: bool):
    if isinstance(x, _Leaf):
        return values[(x.kind, x.name)]
    if isinstance(x, list):
        items = [_evaluate(y, values, limit, memo, shapes_only) for y in x]
        return _UNKNOWN if any(i is _UNKNOWN for i in items) else items
    if isinstance(x, _Item):
        v = _evaluate(x.inner, values, limit, memo, shapes_only)
        if v is _UNKNOWN:
            return v
        if not isinstance(v, (tuple, list)) or not -len(v) <= x.k < len(v):
            raise _Refused(f"[{x.k}] takes the result of an op that does not return {x.k + 1} or more")
        return v[x.k]
    if not isinstance(x, _Call):
        return x
    if id(x) not in memo:
        args = [_evaluate(a, values, limit, memo, shapes_only) for a in x.args]
        kwargs = {k: _evaluate(v, values, limit, memo, shapes_only) for k, v in x.kwargs.items()}
        if any(a is _UNKNOWN for a in [*args, *kwargs.values()]) or shapes_only and x.name in _READS_VALUES:
            memo[id(x)] = _UNKNOWN
            return _UNKNOWN
        tensors = [t for t in _flat([args, list(kwargs.values())]) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise _Refused(f"{x.name} has no tensor operand")
        n = _result_elements(x.name, tensors, args, kwargs)
        if n > limit:
            raise _Refused(f"{x.name} would make {n} elements, more than the {limit} of the largest tensor the "
                           "guard reads")
        # Bounded as a whole too: every result is kept until the guard is answered.
        made = memo.get(_MADE, 0) + n
        if made > _MAX_MADE * limit:
            raise _Refused(f"its ops would make {made} elements in all, more than {_MAX_MADE} times the {limit} of "
                           "the largest tensor it reads")
        memo[_MADE] = made
        device = kwargs.get("device")
        if kwargs.get("pin_memory") or isinstance(device, torch.device) and any(
                t.device.type != device.type or device.index is not None and t.device.index != device.index
                for t in tensors):
            raise _Refused(f"{x.name} would copy to {'pinned memory' if kwargs.get('pin_memory') else device}; a "
                           "guard reads its inputs where they are")
        memo[id(x)] = run_op(x.func, args, kwargs)
    return memo[id(x)]


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def _result_elements(name: str, tensors: list, args: list, kwargs: dict) -> int:
    """How many elements an op of OPS may make at most, before it runs."""
    if name == _EXPAND:
        size = args[1] if len(args) > 1 else kwargs.get("size")
        if not isinstance(size, (list, tuple)) or not all(isinstance(s, int) for s in size):
            return 0  # (the op refuses it)
        have = list(tensors[0].shape)
        have = [1] * (len(size) - len(have)) + have
        return math.prod(h if s == -1 else max(s, 0) for s, h in zip(size, have))
    most = max(t.numel() for t in tensors)
    if len(tensors) > 1:
        try:
            return max(most, math.prod(torch.broadcast_shapes(*(t.shape for t in tensors))))
        except RuntimeError:
            return most  # (not broadcastable: the op refuses it, or does not broadcast)
    return most


def _build(node, text: str):
    """`node` as a constant, or as a tree of `_Leaf`, `_Call`, `_Item` and lists."""
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
        return [_build(x, text) for x in node.elts]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        v = getattr(torch, node.attr, None)
        if isinstance(v, _TORCH_ATTRS):
            return v
        bad(f"torch.{node.attr}")
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and type(node.slice.value) is int:
        inner = _build(node.value, text)
        if not isinstance(inner, _Call):
            bad("indexing anything but an op's results")
        return _Item(inner, node.slice.value)
    if isinstance(node, ast.Call):
        fname = _dotted(node.func)
        one_string = len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str)
        if fname in ("input", "buffer") and one_string:
            return _Leaf(fname, node.args[0].value)
        if fname == "size" and one_string:
            from remat_ir.ir.sizes import SizeError, size_text

            try:
                return _Leaf("size", size_text(node.args[0].value))
            except SizeError as e:
                raise GuardError(f"guard {text!r}: {e}") from None
        if fname == "float" and one_string and node.args[0].value in ("inf", "-inf", "nan"):
            return float(node.args[0].value)
        if fname == "torch.device" and one_string:
            try:
                return torch.device(node.args[0].value)
            except RuntimeError:
                bad(f"the device {node.args[0].value!r}")
        if fname is None or fname.count(".") != 2:
            bad(f"calling {ast.unparse(node.func)}")
        if fname not in OPS:
            raise GuardError(f"guard {text!r}: {fname} is not an op of the guard language (comparisons, "
                             "logic, reductions, casts, views and arithmetic on the inputs' values)")
        from remat_ir.ir.ops import resolve

        try:
            func = resolve(fname)
        except AttributeError:
            raise GuardError(f"guard {text!r}: unknown op {fname} in this PyTorch build") from None
        args = [_build(a, text) for a in node.args]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                bad("**")
            kwargs[kw.arg] = _build(kw.value, text)
        schema = func._schema.arguments
        if len(args) > sum(1 for a in schema if not a.kwarg_only):
            bad(f"{fname} with {len(args)} positional arguments")
        for k in kwargs:
            if k not in {a.name for a in schema}:
                bad(f"{fname}'s keyword {k}=")
        if not _reads_tensor([args, list(kwargs.values())]):
            raise GuardError(f"guard {text!r}: {fname} has no operand computed from an input or a buffer")
        return _Call(fname, func, args, kwargs)
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
    """The first of `guards` that does not hold, or cannot be evaluated, in
    words, or "" when all hold."""
    for g in guards:
        try:
            now = g.expr(leaf)
        except GuardError as e:
            return str(e)
        if now != g.want or isinstance(now, bool) != isinstance(g.want, bool):
            return f"the plan holds while {g.text}, and this call gives {literal(now)}"
    return ""


def answers_of(guards: list[str]) -> dict:
    """expression -> recorded value, for a check of a model against a plan."""
    return {g.expression: g.want for g in map(Guard, guards) if g.text != TRACED}
