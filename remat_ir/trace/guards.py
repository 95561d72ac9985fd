"""The traced step answers as eager would: input values and tracing probes.

A model's code can look at the values of its inputs (`torch.all(mask == 1)`
to skip building an attention mask) and ask whether it is being traced
(transformers' `is_tracing`, true for fake tensors).  Under a fake trace the
first fails and the second says yes, so the traced step could be another
program than the one eager runs on the same call.  While a step is traced:

* every fake tensor computed from the call's inputs (and buffers) alone, by
  ops that are not random, carries a *recipe*: the aten ops that made it
  from those leaves.  Nothing is computed when it is made.
* a query of values (`bool(t)`, `t.item()`, `torch.equal`) on such a tensor
  is answered from the call's real tensors, by running its recipe on them,
  and recorded as a *guard*: `"aten.all.default(aten.eq.Scalar(input('attention_mask'), 1)) == True"`.
  Only a recipe in the guard language (`remat_ir.ir.guards`: its ops, its
  bounds) is a guard; any other is as a tensor without a recipe, and its query
  fails as a data-dependent operation.  A recipe of literals alone (a mask
  the model made with `torch.ones`) has the same value on every call: its
  query is answered and recorded nowhere.
  The guard goes in the plan's header; the plan is that step only while its
  guards hold, so each call checks them (a few small ops on the inputs) and
  one where a guard fails runs another plan (`remat_ir.wrap` with a budget) or
  is refused (a plan made beforehand).
* tracing probes (`PROBES`) answer as in eager: not traced.  The first
  probe asked is recorded as the guard `traced() == False`.

When a plan is checked against a model again (`remat_ir.runtime.bind`),
the trace answers each query from the plan's own guards instead, so it
needs no values and gives the plan's graph if the model still takes those
decisions.  A trace with fake inputs and no guards to replay (a plan made
under `--fake`) answers nothing: probes say traced, and a query fails as a
data-dependent operation.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from remat_ir.ir.guards import TRACED, Guard, GuardError, literal, mutates, run_op

__all__ = ["StepValues", "PROBES", "storage_of", "written_tensors"]

# Functions model code calls to ask whether it is traced, as
# (module, attribute); each is replaced, wherever a module holds it, by one
# that answers as eager does.  transformers routes every such question
# through these two.
PROBES = (("transformers.utils.import_utils", "is_tracing"),
          ("transformers.utils.import_utils", "is_fake_tensor"))

# Ops that hand a tensor's values to Python.
_QUERIES = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default",
            "aten.item.default"}
# Ops whose result has no defined values (filled later, in place).
_UNDEFINED = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
              "aten.new_empty.default", "aten.new_empty_strided.default"}
_MAX_TEXT = 20_000


# ------------------------------------------------------------------ recipes


class _Leaf:
    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name


class _Op:
    __slots__ = ("func", "args", "kwargs", "item", "_text")

    def __init__(self, func, args, kwargs, item: int | None = None):
        self.func, self.args, self.kwargs, self.item = func, args, kwargs, item
        self._text = None


class _Opaque(Exception):
    """An operand a recipe cannot write."""


def _text(r) -> str:
    if isinstance(r, _Leaf):
        return f"{r.kind}({r.name!r})"
    if isinstance(r, _Op):
        if r._text is None:
            parts = [_operand(a) for a in r.args] + [f"{k}={_operand(v)}" for k, v in r.kwargs.items()]
            r._text = f"{r.func}({', '.join(parts)})" + ("" if r.item is None else f"[{r.item}]")
            if len(r._text) > _MAX_TEXT:
                raise _Opaque("too long")
        return r._text
    return literal(r)


def _operand(a) -> str:
    if isinstance(a, (list, tuple)) and any(isinstance(x, (_Leaf, _Op)) for x in a):
        return "[" + ", ".join(_operand(x) for x in a) + "]"
    return _text(a)


_UNANSWERED = object()  # a query this trace cannot answer from values


def _leaf_kinds(r, memo: dict) -> set:
    """The kinds of leaf (input, buffer, size) recipe `r` reads."""
    if isinstance(r, _Leaf):
        return {r.kind}
    if isinstance(r, (list, tuple)):
        return set().union(*(_leaf_kinds(x, memo) for x in r))
    if not isinstance(r, _Op):
        return set()
    if id(r) not in memo:
        memo[id(r)] = _leaf_kinds([*r.args, *r.kwargs.values()], memo)
    return memo[id(r)]


def _evaluate(r, leaves: dict, memo: dict):
    if isinstance(r, _Leaf):
        return leaves[(r.kind, r.name)]
    if not isinstance(r, _Op):
        if isinstance(r, (list, tuple)):
            return type(r)(_evaluate(x, leaves, memo) for x in r)
        return r
    if id(r) not in memo:
        args = [_evaluate(a, leaves, memo) for a in r.args]
        kwargs = {k: _evaluate(v, leaves, memo) for k, v in r.kwargs.items()}
        out = run_op(r.func, args, kwargs)
        memo[id(r)] = out if r.item is None else out[r.item]
    return memo[id(r)]


# --------------------------------------------------------------- the trace


class StepValues(TorchDispatchMode):
    """Entered inside the traced step: gives tensors from the inputs recipes
    and answers queries of their values (see the module's docstring).

    `inputs` and `buffers` map names to (fake tensor in the trace, real
    tensor or None); `answers` maps a guard's expression to its recorded
    value (a check against a plan), else queries run on the real tensors.
    `guards` collects what was asked, in order."""

    def __init__(self, inputs: dict, buffers: dict, answers: dict | None = None, size_of: Callable | None = None):
        super().__init__()
        # A symbolic trace: a size in a recipe (`mask.sum() == mask.numel()`)
        # is written as its expression, `size('B*T')`, and valued at this call.
        self.size_of = size_of
        self.recipes = WeakTensorKeyDictionary()
        self.leaves: dict = {}
        for kind, named in (("input", inputs), ("buffer", buffers)):
            for name, (fake, real) in named.items():
                if real is not None or answers is not None:
                    self.recipes[fake] = _Leaf(kind, name)
                    self.leaves[(kind, name)] = real
        self.answers = answers
        self.guards: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in _QUERIES:
            recipe = self._recipe(func, args, kwargs)
            if recipe is not None:
                value = self._answer(recipe)
                if value is not _UNANSWERED:
                    return value
        out = func(*args, **kwargs)
        if mutates(func):
            self._forget(func, args, kwargs)
            return out
        if name in _UNDEFINED or torch.Tag.nondeterministic_seeded in func.tags:
            return out
        recipe = self._recipe(func, args, kwargs)
        if recipe is not None:
            if isinstance(out, torch.Tensor):
                self.recipes[out] = recipe
            elif isinstance(out, (tuple, list)):
                for k, o in enumerate(out):
                    if isinstance(o, torch.Tensor):
                        self.recipes[o] = _Op(func, recipe.args, recipe.kwargs, k)
        return out

    def _recipe(self, func, args, kwargs) -> _Op | None:
        """The recipe of `func(*args, **kwargs)` when every tensor operand has one."""
        def sub(x):
            if isinstance(x, torch.SymInt) and self.size_of is not None:
                text, value = self.size_of(x)
                if type(text) is int:
                    return text
                self.leaves[("size", text)] = value
                return _Leaf("size", text)
            if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise _Opaque("size")
            if isinstance(x, torch.Tensor):
                r = self.recipes.get(x)
                if r is None:
                    raise _Opaque("tensor")
                return r
            return x

        try:
            r_args = [_sub_tree(a, sub) for a in args]
            r_kwargs = {k: _sub_tree(v, sub) for k, v in kwargs.items()}
            op = _Op(func, r_args, r_kwargs)
            _text(op)
        except (_Opaque, TypeError):
            return None
        return op

    def _forget(self, func, args, kwargs) -> None:
        # A tensor written in place no longer has the value its recipe says;
        # nor has any other view of its storage.
        written = {storage_of(a) for a in written_tensors(func, args, kwargs)}
        for t in list(self.recipes.keys()):
            if storage_of(t) in written:
                del self.recipes[t]

    def _answer(self, recipe: _Op):
        text = _text(recipe)
        kinds = _leaf_kinds(recipe, {})
        if not kinds & {"input", "buffer"}:
            # Literals alone give the same value on every call this plan
            # serves; sizes would not, and a guard must read a tensor.
            return _UNANSWERED if kinds else _evaluate(recipe, {}, {})
        try:
            guard = Guard(f"{text} == True")
        except GuardError:
            return _UNANSWERED  # (outside the guard language: no plan could check it)
        if self.answers is not None:
            if text not in self.answers:
                raise GuardError(f"the model's code reads the value of {text}, which the plan's guards do not "
                                 "record")
            value = self.answers[text]
        else:
            if any(key not in self.leaves for key in guard.reads):
                raise GuardError(f"the model's code reads the value of {text}, which depends on a tensor "
                                 "without values here")
            try:
                value = guard.expr(lambda kind, name: self.leaves[(kind, name)])
            except GuardError:
                return _UNANSWERED  # (past the guard language's bounds on this call)
        guard = f"{text} == {literal(value)}"
        if guard not in self.guards:
            self.guards.append(guard)
        return value

    @contextlib.contextmanager
    def answering(self):
        """While entered: this mode is on and the tracing probes say "not traced"."""
        guards = self.guards

        def not_traced(*args, **kwargs):
            if TRACED not in guards:
                guards.insert(0, TRACED)
            return False

        with self, _replaced_probes(not_traced):
            yield


def _sub_tree(x, sub):
    if isinstance(x, (list, tuple)):
        return [_sub_tree(y, sub) for y in x]
    return sub(x)


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def written_tensors(func, args, kwargs) -> list:
    """The tensors `func(*args, **kwargs)` writes in place (its schema says which)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]
    return out


@contextlib.contextmanager
def _replaced_probes(fn: Callable):
    """Every module attribute that holds a probe function holds `fn` while entered."""
    originals = []
    for mod_name, attr in PROBES:
        mod = sys.modules.get(mod_name)
        if mod is not None and hasattr(mod, attr):
            originals.append(getattr(mod, attr))
    if not originals:
        yield
        return
    targets = {id(f) for f in originals}
    patched = []
    for name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict) or not (name.startswith("transformers") or name.startswith("peft")):
            continue
        for attr, v in list(d.items()):
            if id(v) in targets:
                patched.append((d, attr, v))
                d[attr] = fn
    try:
        yield
    finally:
        for d, attr, v in patched:
            d[attr] = v


