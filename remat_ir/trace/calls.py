"""A call's arguments as a plan sees them.

The tensors of a call (positional, keyword, or inside lists, tuples and
dicts) are the plan's inputs; everything else (None, flags such as
`use_cache=False`) is a constant the step is traced with.  An input is named
by the forward parameter it is passed as, whether positionally or by keyword
(`input_ids`, `past.0`; `input3` for the fourth of `*args`), so
`model(ids, labels=y)` and `model(input_ids=ids, labels=y)` feed a plan the
same way, and a call passing a tensor where the plan was made with None (or
the reverse) shows as a different set of names.

The constants a call passes (not the forward's defaults it leaves out) are
named the same way and written as text, `name=literal` (`scale=2.0`,
`use_cache=False`), which the plan's header lists: an argument holding no
tensor is one constant, written whole (`sizes=(2, 3)`); inside an argument
that holds tensors, each other leaf is one (`past.1=None`).  The literal is
`repr` for None, bool, int, float, str, bytes and tuples, lists and dicts of
them, which `ast.literal_eval` reads back, except for the floats without a
literal: the infinities are written `1e999` and `-1e999` (which
`literal_eval` reads as them) and NaN `nan` (which `read_constant` reads).
Anything else is written `<TypeName repr>` (`<dtype torch.float16>`), or
`<TypeName object>` when its repr is long or holds an address: such a
constant cannot be built again from the plan, and calls are told apart by
that text alone.

A call also runs under the caller's `torch.autocast` for its device type (as
eager would run it there), written `cpu:bfloat16` ("" for none): a plan
traced under one runs only under the same (`autocast_state`).
"""
from __future__ import annotations

import inspect
import math
import re
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat_ir.ir.header import read_literal
from remat_ir.ir.ops import autocast_off  # noqa: F401 - (re-exported: the tracer and the runtime use it from here)
from remat_ir.trace.symbolic import dense

__all__ = ["Call", "CallError", "autocast_off", "autocast_state", "constant_text", "constants_map",
           "describe_autocast", "parse_autocast", "read_constant", "rebuildable", "split_call"]


class CallError(TypeError):
    """The forward cannot take the arguments given (the message says why)."""


class _Slot:
    """Stands for the leaf number `i` while the call is bound to the signature."""

    def __init__(self, i: int):
        self.i = i


class Call:
    """One call's arguments: `tensors` (named `names`), and the structure with
    the constants to rebuild the call from other tensors of the same names.
    `constants`: the constants the call passes, each "name=literal" (see the
    module's docstring), as a plan's header lists them; `defaults`: name ->
    literal of the forward's defaults (passed or not); `autocast`: the
    `torch.autocast` the call runs under, "cpu:bfloat16" ("" for none)."""

    def __init__(self, leaves: list, spec, tensor_at: list[int], names: list[str],
                 constants: list[str] | None = None, defaults: dict[str, str] | None = None,
                 autocast: str = ""):
        self._leaves, self._spec, self._tensor_at = leaves, spec, tensor_at
        self.names = names
        self.tensors = [leaves[i] for i in tensor_at]
        self.constants = list(constants or [])
        self.defaults = dict(defaults or {})
        self.autocast = autocast

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        """(args, kwargs) of this call with `tensors` in place of its own."""
        leaves = list(self._leaves)
        for i, t in zip(self._tensor_at, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return tuple(args), dict(kwargs)

    def structure(self) -> str:
        """The call without its tensors' data: argument structure, constants,
        each tensor's name, dtype, shape, strides, device type and
        requires_grad, and the autocast it runs under.  Two calls with the
        same structure run the same plan."""
        parts = [str(self._spec)]
        for name, t in zip(self.names, self.tensors):
            parts.append(f"{name}:{str(t.dtype).removeprefix('torch.')}{list(t.shape)}/{list(t.stride())}"
                         f"@{t.device.type}{'+grad' if t.requires_grad else ''}")
        tensor_at = set(self._tensor_at)
        consts = [repr(x) for i, x in enumerate(self._leaves) if i not in tensor_at]
        return "|".join(parts + consts + ([f"autocast={self.autocast}"] if self.autocast else []))

    def shape_class(self) -> str:
        """`structure()` with each tensor's shape and strides reduced to its
        number of dimensions and whether it is dense (contiguous, in a storage
        of its own size): calls of one shape
        class differ only in sizes, and a symbolic plan (`remat_ir.ir.sizes`)
        can serve them all."""
        parts = [str(self._spec)]
        for name, t in zip(self.names, self.tensors):
            parts.append(f"{name}:{str(t.dtype).removeprefix('torch.')}[{t.dim()}]"
                         f"{'' if dense(t) else '/strided'}"
                         f"@{t.device.type}{'+grad' if t.requires_grad else ''}")
        tensor_at = set(self._tensor_at)
        consts = [repr(x) for i, x in enumerate(self._leaves) if i not in tensor_at]
        return "|".join(parts + consts + ([f"autocast={self.autocast}"] if self.autocast else []))


def dynamic_dims(call: Call, also=()) -> dict[str, dict[int, str]]:
    """Which of the call's dimensions a symbolic plan makes symbols, each
    with its symbol ({"input_ids": {0: "B", 1: "T"}}): the batch (B: the
    first dimension of each tensor that has the first tensor's), the
    sequences (T, then S2, S3, ...: the second dimension of each 2-D integer
    tensor, token ids, masks and labels, and each later dimension of such a
    size), and the (name, dimension) pairs `also` names (seen to vary, or
    given a maximum).  Sizes under 2 stay numbers (a batch of one is another
    plan), as does every dimension of a call with an input that is not dense."""
    tensors = dict(zip(call.names, call.tensors))
    if not all(dense(t) for t in call.tensors):
        return {}  # a symbolic plan states each input's bytes from its sizes
    first = next((t for t in call.tensors if t.dim() >= 1), None)
    size_symbol: dict[int, str] = {}
    if first is not None and first.shape[0] >= 2:
        size_symbol[int(first.shape[0])] = "B"
    for t in call.tensors:
        if t.dim() == 2 and not (t.is_floating_point() or t.is_complex()) and t.shape[1] >= 2 \
                and int(t.shape[1]) not in size_symbol:
            size_symbol[int(t.shape[1])] = "T" if "T" not in size_symbol.values() else f"S{len(size_symbol)}"
    order = {n: i for i, n in enumerate(call.names)}
    for n, d in sorted(also, key=lambda nd: (order.get(nd[0], len(order)), nd[1])):
        size = int(tensors[n].shape[d]) if n in tensors and d < tensors[n].dim() else 0
        if size >= 2 and size not in size_symbol:
            size_symbol[size] = f"S{len(size_symbol)}"
    dims: dict[str, dict[int, str]] = {}
    for n, t in tensors.items():
        for d in range(t.dim()):
            symbol = size_symbol.get(int(t.shape[d]))
            if symbol is None or (symbol == "B" and d != 0) or (symbol != "B" and d == 0):
                continue  # a batch size elsewhere, or a sequence length first, is a coincidence
            dims.setdefault(n, {})[d] = symbol
    return dims


def split_call(module: torch.nn.Module, args=(), kwargs: dict | None = None) -> Call:
    """`module(*args, **kwargs)` split into its tensors and the rest, with
    the autocast in effect here for the step's device type (its tensors',
    else the module's parameters').  Raises CallError when the forward's
    signature cannot take these arguments."""
    if not isinstance(args, (tuple, list)):
        args = (args,)
    args, kwargs = tuple(args), dict(kwargs or {})
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    s_args, s_kwargs = pytree.tree_unflatten([_Slot(i) for i in range(len(leaves))], spec)
    names, constants, defaults = _names(module, s_args, s_kwargs, leaves)
    device = leaves[tensor_at[0]].device.type if tensor_at else next(
        (t.device.type for t in module.parameters()), "cpu")
    return Call(leaves, spec, tensor_at, [names[i] for i in tensor_at], constants, defaults,
                autocast_state(device))


def _names(module, args, kwargs, leaves) -> tuple[dict[int, str], list[str], dict[str, str]]:
    """Leaf number -> its name for the tensor leaves (the arguments hold
    `_Slot`s for the `leaves`); the constants passed, as "name=literal";
    and name -> literal of the forward's defaults."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin forward: no signature to name by
        sig = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                                 inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise CallError(f"{type(module).__name__}.forward{sig} cannot take these arguments: {e}") from None
    n_positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in sig.parameters.values())
    out: dict[int, str] = {}
    constants: list[str] = []
    for pname, value in bound.arguments.items():
        kind = sig.parameters[pname].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            tops = [(f"input{n_positional + k}", v) for k, v in enumerate(value)]
        elif kind == inspect.Parameter.VAR_KEYWORD:
            tops = list(value.items())
        else:
            tops = [(pname, value)]
        for top, v in tops:
            flat = [(path, leaf) for path, leaf in pytree.tree_flatten_with_path(v)[0] if isinstance(leaf, _Slot)]
            if not any(isinstance(leaves[leaf.i], torch.Tensor) for _, leaf in flat):
                # No tensor in it: one constant, the argument as passed.
                whole = pytree.tree_map(lambda x: leaves[x.i] if isinstance(x, _Slot) else x, v)
                constants.append(f"{top}={constant_text(whole)}")
                continue
            for path, leaf in flat:
                name = top + "".join(f".{_key(k)}" for k in path)
                if isinstance(leaves[leaf.i], torch.Tensor):
                    out[leaf.i] = name
                else:
                    constants.append(f"{name}={constant_text(leaves[leaf.i])}")
    defaults = {p.name: constant_text(p.default) for p in sig.parameters.values()
                if p.default is not p.empty and not isinstance(p.default, torch.Tensor)}
    return out, constants, defaults


def _key(k: Any) -> str:
    for attr in ("idx", "key", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def call_from_names(module: torch.nn.Module, named: dict[str, Any]) -> tuple[tuple, dict]:
    """(args, kwargs) that pass `named` (input name -> value, as `split_call`
    names them) to `module`'s forward.  Raises CallError for names inside a
    list, tuple or dict argument, whose structure the names do not tell."""
    nested = [n for n in named if "." in n]
    if nested:
        raise CallError(f"input {nested[0]} is inside a list, tuple or dict argument; the call cannot be "
                        "rebuilt from its name")
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    extra = sorted((n for n in named if n.startswith("input") and n[5:].isdigit()
                    and n not in {p.name for p in params}), key=lambda n: int(n[5:]))
    # Positionally while the parameters are given in order (as a plain call
    # passes them, and a loss function takes them), all of them when `*args`
    # inputs follow; the rest by keyword.
    upto = 0
    while upto < len(positional) and positional[upto].name in named:
        upto += 1
    if extra:
        upto = len(positional)
    args = []
    for p in positional[:upto]:
        if p.name in named:
            args.append(named[p.name])
        elif p.default is not p.empty:
            args.append(p.default)
        else:
            raise CallError(f"no input for the forward's positional parameter {p.name}")
    args += [named[n] for n in extra]
    taken = {p.name for p in positional[:upto]} | set(extra)
    return tuple(args), {n: v for n, v in named.items() if n not in taken}


def constant_text(value) -> str:
    """`value`, a call's constant, as a plan writes it: a Python literal when
    it has one, else `<TypeName repr>` or `<TypeName object>` (see the
    module's docstring)."""
    text = _literal(value)
    if text is not None:
        return text
    kind = type(value).__qualname__
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails says nothing either
        r = ""
    if not r or len(r) > 80 or "\n" in r or _ADDRESS.search(r):
        return f"<{kind} object>"
    return f"<{kind} {r}>"


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")


def _literal(v) -> str | None:
    t = type(v)
    if v is None or t in (bool, int, str, bytes):
        return repr(v)
    if t is float:
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "1e999" if v > 0 else "-1e999"
        return repr(v)
    if t in (tuple, list):
        items = [_literal(x) for x in v]
        if any(x is None for x in items):
            return None
        if t is list:
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if t is dict:
        pairs = [(_literal(k), _literal(x)) for k, x in v.items()]
        if any(k is None or x is None for k, x in pairs):
            return None
        return "{" + ", ".join(f"{k}: {x}" for k, x in pairs) + "}"
    return None


def rebuildable(text: str) -> bool:
    """Whether a constant's text is a literal `read_constant` reads (not `<...>`)."""
    return not text.startswith("<")


def read_constant(text: str):
    """The value a constant's text (as `constant_text` writes it) stands for:
    `ast.literal_eval`, with `nan` for NaN (`remat_ir.ir.header.read_literal`,
    as the verifier reads it).  Raises ValueError for one that is no literal
    (`<TypeName object>`)."""
    if not rebuildable(text):
        raise ValueError(f"{text} is not a Python literal: the value cannot be built from the plan")
    return read_literal(text)


def constants_map(constants: list[str]) -> dict[str, str]:
    """Name -> literal, of constants written "name=literal"."""
    return dict(c.partition("=")[::2] for c in constants)


# ------------------------------------------------------------------ autocast


def autocast_state(device_type: str) -> str:
    """The `torch.autocast` in effect here for `device_type`, as a plan's
    header writes it ("cpu:bfloat16"), or "" when none is."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return ""
        dtype = torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        return ""
    return f"{device_type}:{str(dtype).removeprefix('torch.')}"


def parse_autocast(text: str) -> tuple[str, torch.dtype]:
    """(device type, dtype) of an autocast written "cpu:bfloat16".  Raises
    ValueError for one that is not so written."""
    device_type, _, name = text.partition(":")
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not device_type or not isinstance(dtype, torch.dtype):
        raise ValueError(f"autocast {text!r}: write it as the device type and the dtype, "
                         "cpu:bfloat16 or cuda:float16")
    return device_type, dtype


def describe_autocast(text: str) -> str:
    """An autocast as a person reads it: "torch.autocast('cpu', dtype=torch.bfloat16)", or "no autocast"."""
    if not text:
        return "no autocast"
    device_type, _, name = text.partition(":")
    return f"torch.autocast({device_type!r}, dtype=torch.{name})"


