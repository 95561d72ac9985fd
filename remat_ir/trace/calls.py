"""A call's arguments as a plan sees them.

The tensors of a call (positional, keyword, or inside lists, tuples and
dicts) are the plan's inputs; everything else (None, flags such as
`use_cache=False`) is a constant the step is traced with.  An input is named
by the forward parameter it is passed as, whether positionally or by keyword
(`input_ids`, `past.0`; `input3` for the fourth of `*args`), so
`model(ids, labels=y)` and `model(input_ids=ids, labels=y)` feed a plan the
same way, and a call passing a tensor where the plan was made with None (or
the reverse) shows as a different set of names.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Call", "CallError", "split_call"]


class CallError(TypeError):
    """The forward cannot take the arguments given (the message says why)."""


class _Slot:
    """Stands for the tensor leaf number `i` while the call is bound to the signature."""

    def __init__(self, i: int):
        self.i = i


class Call:
    """One call's arguments: `tensors` (named `names`), and the structure with
    the constants to rebuild the call from other tensors of the same names."""

    def __init__(self, leaves: list, spec, tensor_at: list[int], names: list[str]):
        self._leaves, self._spec, self._tensor_at = leaves, spec, tensor_at
        self.names = names
        self.tensors = [leaves[i] for i in tensor_at]

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        """(args, kwargs) of this call with `tensors` in place of its own."""
        leaves = list(self._leaves)
        for i, t in zip(self._tensor_at, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return tuple(args), dict(kwargs)

    def structure(self) -> str:
        """The call without its tensors' data: argument structure, constants,
        and each tensor's name, dtype, shape, strides, device type and
        requires_grad.  Two calls with the same structure run the same plan."""
        parts = [str(self._spec)]
        for name, t in zip(self.names, self.tensors):
            parts.append(f"{name}:{str(t.dtype).removeprefix('torch.')}{list(t.shape)}/{list(t.stride())}"
                         f"@{t.device.type}{'+grad' if t.requires_grad else ''}")
        tensor_at = set(self._tensor_at)
        consts = [repr(x) for i, x in enumerate(self._leaves) if i not in tensor_at]
        return "|".join(parts + consts)


def split_call(module: torch.nn.Module, args=(), kwargs: dict | None = None) -> Call:
    """`module(*args, **kwargs)` split into its tensors and the rest.  Raises
    CallError when the forward's signature cannot take these arguments."""
    if not isinstance(args, (tuple, list)):
        args = (args,)
    args, kwargs = tuple(args), dict(kwargs or {})
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    slots = list(leaves)
    for i in tensor_at:
        slots[i] = _Slot(i)
    s_args, s_kwargs = pytree.tree_unflatten(slots, spec)
    names = _names(module, s_args, s_kwargs)
    return Call(leaves, spec, tensor_at, [names[i] for i in tensor_at])


def _names(module, args, kwargs) -> dict[int, str]:
    """Leaf number -> its name, for the leaves that are `_Slot`s."""
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
    for pname, value in bound.arguments.items():
        kind = sig.parameters[pname].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            tops = [(f"input{n_positional + k}", v) for k, v in enumerate(value)]
        elif kind == inspect.Parameter.VAR_KEYWORD:
            tops = list(value.items())
        else:
            tops = [(pname, value)]
        for top, v in tops:
            for path, leaf in pytree.tree_flatten_with_path(v)[0]:
                if isinstance(leaf, _Slot):
                    out[leaf.i] = top + "".join(f".{_key(k)}" for k in path)
    return out


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
