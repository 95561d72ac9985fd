"""What a trace read of live Python, and what it did that a plan cannot replay.

A plan is one traced call; the model is live Python.  While the step is
traced, `watching(model)` records:

* each instance attribute of a submodule the step reads that is no tensor,
  parameter, buffer or submodule (`Dropout.p`, peft's `scaling`, a flag, a
  config object; not `training`, which `ModelGuard` watches), with its value
  at the first read; a config object read so (`self.config`) is watched in
  every field;
* what cannot be replayed, refused when the trace ends (`NotReplayable`,
  naming the module): an attribute of a submodule written
  during forward (`self.n += 1`, a tensor kept in `self.last`), Python's
  `random` or NumPy's global generator drawn from during forward, and a
  hook (forward, pre-forward, backward; the module's or global) that keeps
  the tensors it sees or prints.  A hook that returns a transformed output,
  or changes one in place, is part of the step and is traced into it.

Tracing runs the forward more than once: every attribute written and both
generators are put back as they were, so the user's objects are left as the
trace found them.

The reads are watched by giving each submodule, for the trace only, a
subclass of its class (same name, `isinstance` unchanged) that notes
attribute reads and writes, as `torch.nn.utils.parametrize` and FSDP2's
`fully_shard` change a module's class.  `LiveGuard` (in
`remat_ir.runtime.bind`) compares the values read, and every hook dict, at
each training step.
"""
from __future__ import annotations

import contextlib
import enum
import gc
import io
import random
import sys
import weakref
from dataclasses import dataclass, field, is_dataclass

import torch
from torch.nn.modules import module as _nn

__all__ = ["LiveReads", "NotReplayable", "guardable", "hook_dicts", "module_text", "settle", "snapshot", "torch_own",
           "tracing", "watching"]

# The attributes every nn.Module has (hook dicts, _parameters, training...):
# the module's own machinery, watched by ModelGuard and LiveGuard directly.
_MODULE_OWN = frozenset(torch.nn.Module().__dict__) | {"_forward_hooks_always_called"}
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                      "_global_backward_hooks")
_SCALARS = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype, torch.device)
_MAX_ITEMS = 64


class NotReplayable(Exception):
    """The step does something a plan cannot replay (see the module's docstring)."""


def guardable(v, depth: int = 0) -> bool:
    """Whether `v` is a value a guard compares by equality: a scalar, or a
    small tuple, list, dict or set of them."""
    if isinstance(v, _SCALARS):
        return True
    if depth >= 3 or not isinstance(v, (tuple, list, dict, set, frozenset)) or len(v) > _MAX_ITEMS:
        return False
    items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
    return all(guardable(x, depth + 1) for x in items)


def snapshot(v):
    """What a guard keeps of `v`: a copy of a guardable container (compared
    by equality later), else `v` itself (compared by identity, its own
    equality)."""
    if isinstance(v, (list, dict, set)) and guardable(v):
        import copy

        return copy.deepcopy(v)
    return v


def _is_config(v) -> bool:
    return not isinstance(v, (torch.nn.Module, torch.Tensor, type)) and hasattr(v, "__dict__") and (
        type(v).__name__.endswith("Config") or is_dataclass(v))


def hook_dicts(model: torch.nn.Module) -> list[tuple[str | None, str, dict]]:
    """(module path, the kind of its hooks in words, the dict) for every hook
    dict of `model`'s modules and the global ones (path None): ("h.0",
    "forward pre hook", ...)."""
    def kind(attr: str) -> str:
        return attr.removeprefix("_global_").strip("_").removesuffix("s").replace("_", " ")

    out = [(None, kind(k), getattr(_nn, k)) for k in _GLOBAL_HOOK_DICTS]
    for name, m in model.named_modules(remove_duplicate=False):
        out += [(name, kind(k), m.__dict__[k]) for k in _HOOK_DICTS if k in m.__dict__]
    return out


def module_text(path: str) -> str:
    """A submodule's path in words: "submodule h.0", or "the model" for the root."""
    return f"submodule {path}" if path else "the model"


@dataclass
class LiveReads:
    """What one trace read: `attributes` maps (module path, config attribute
    or "", name) to the value read: an attribute `name` of the submodule at
    that path, or a field of the config object in its attribute."""

    attributes: dict = field(default_factory=dict)

    live: dict = field(default_factory=dict)  # (path, via, name) -> the container read, for restoring it

    def note(self, path: str, via: str, name: str, value) -> None:
        key = (path, via, name)
        if key not in self.attributes:
            self.attributes[key] = snapshot(value)
            if isinstance(value, (list, dict, set)) and guardable(value):
                self.live[key] = value

    def restore_containers(self) -> list[str]:
        """Put back each list, dict or set the step read and then changed in
        place (`self.lens.append(T)`), saying which."""
        out = []
        for key, v in self.live.items():
            was = self.attributes[key]
            if v != was:
                if isinstance(v, list):
                    v[:] = was
                else:
                    v.clear()
                    v.update(was)
                out.append(f"{module_text(key[0])} changes its attribute {key[2]} in place in its forward: a plan runs "
                           "the ops it traced, not the model's Python; keep such state out of forward")
        self.live = {}
        return out


class _Watch:
    """The state of one trace being watched."""

    def __init__(self, model: torch.nn.Module):
        self.paths = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.reads = LiveReads()
        self.configs: dict[int, tuple] = {}  # id -> (config object, module path, its attribute)
        self.written: dict[tuple, tuple] = {}  # (id, name) -> (object, name, old value or _MISSING, where)
        self.problems: list[str] = []
        self.seen: list[tuple] = []  # (weakref to a tensor a hook saw, what the hook is)
        self.active = True

    def where(self, obj) -> str:
        name = self.paths.get(id(obj))
        if name is None:
            return type(obj).__name__
        return f"submodule {name} ({type(obj).__name__})" if name else f"the model ({type(obj).__name__})"


_MISSING = object()
_HOOK_ADVICE = (": a plan runs no Python during the step; remove the hook while training, or take what it "
                "wants from the step's outputs (eval() and no_grad calls run eagerly, hooks included)")
_RANDOM_ADVICE = (": a plan replays torch's generator only; draw with torch (torch.rand, torch.bernoulli) "
                  "instead")
_current: list[_Watch] = []
_recorders: dict[type, type] = {}


def tracing() -> bool:
    """Whether a step is being traced (and watched) now."""
    return bool(_current)


def _recorder(cls: type) -> type:
    """`cls` with attribute reads and writes noted while a trace is watched."""
    rec = _recorders.get(cls)
    if rec is not None:
        return rec
    get, set_ = cls.__getattribute__, cls.__setattr__

    def __getattribute__(self, name):
        value = get(self, name)
        if _current and name not in _MODULE_OWN and name[:2] != "__":
            w = _current[-1]
            d = object.__getattribute__(self, "__dict__")
            path = w.paths.get(id(self))
            if w.active and path is not None and name in d and d[name] is value \
                    and not isinstance(value, torch.Tensor):
                w.reads.note(path, "", name, value)
                if _is_config(value) and id(value) not in w.configs:
                    w.configs[id(value)] = (value, path, name)
        return value

    def __setattr__(self, name, value):
        if _current and name not in _MODULE_OWN and _current[-1].active:
            w = _current[-1]
            d = object.__getattribute__(self, "__dict__")
            if not any(name in d.get(k, ()) for k in ("_parameters", "_buffers", "_modules")) \
                    and not isinstance(value, torch.nn.Module):
                old = d.get(name, _MISSING)
                if old is not value and not (guardable(old) and guardable(value) and old == value
                                             and type(old) is type(value)):
                    w.written.setdefault((id(self), name), (self, name, old, w.where(self)))
        set_(self, name, value)

    rec = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                      "_remat_watched": cls})
    _recorders[cls] = rec
    return rec


def _hook_name(fn) -> str:
    f = getattr(fn, "func", fn)  # (functools.partial)
    return getattr(f, "__qualname__", None) or type(f).__name__


def torch_own(fn) -> bool:
    """Hooks of torch itself and of remat-ir: their effects are their libraries' (FSDP's gathers, the tracer's names)."""
    mod = getattr(getattr(fn, "func", fn), "__module__", "") or ""
    return mod.startswith(("torch.", "remat_ir."))


def _watched_hook(w: _Watch, fn, what: str):
    def hook(*args, **kwargs):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = fn(*args, **kwargs)
        if out.getvalue():
            w.problems.append(f"{what} prints what it sees ({out.getvalue().strip().splitlines()[0][:60]!r}){_HOOK_ADVICE}")
        for t in torch.utils._pytree.tree_leaves((args, kwargs, result)):
            if isinstance(t, torch.Tensor):
                w.seen.append((weakref.ref(t), what))
        return result

    return hook


def _unwatched_hook(w: _Watch, fn):
    def hook(*args, **kwargs):
        active, w.active = w.active, False
        try:
            return fn(*args, **kwargs)
        finally:
            w.active = active

    return hook


def _random_state():
    np = sys.modules.get("numpy")
    return random.getstate(), np.random.get_state() if np is not None else None


def _same_random(a, b) -> tuple[bool, bool]:
    """(Python's random unchanged, NumPy's unchanged) between two states."""
    np_same = True
    if a[1] is not None and b[1] is not None:
        np_same = a[1][2] == b[1][2] and bool((a[1][1] == b[1][1]).all())
    return a[0] == b[0], np_same


def _set_random(state) -> None:
    random.setstate(state[0])
    np = sys.modules.get("numpy")
    if state[1] is not None and np is not None:
        np.random.set_state(state[1])


def settle(model: torch.nn.Module) -> None:
    """Do the set-up a library does lazily in a model's first forward, once
    and for good, as eager's first call would: transformers installs its
    output-capturing hooks (router logits, attentions) on the first call that
    records outputs, and marks the model.  Done before a trace, that write
    is no state the step changes, and the hooks are in the guard's snapshot."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    install = getattr(capturing, "maybe_install_capturing_hooks", None)
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    if install is None or registry is None:
        return
    for m in model.modules():
        if hasattr(m, "_can_record_outputs") and registry.get(m):
            install(m)


@contextlib.contextmanager
def watching(model: torch.nn.Module, reads: list | None = None):
    """Watch a trace of `model` (see the module's docstring).  On leaving,
    the model is as it was and the `LiveReads` is appended to `reads` when
    given; `NotReplayable` is raised naming the first thing the step did that
    a plan cannot replay."""
    w = _Watch(model)
    swapped: list[tuple] = []
    hooks: list[tuple] = []
    for m in model.modules():
        if type(m) not in _recorders.values():
            try:
                cls = type(m)
                m.__class__ = _recorder(cls)
                swapped.append((m, cls))
            except TypeError:  # a class whose layout a subclass cannot take: its reads are not noted
                pass
    for path, kind, d in hook_dicts(model):
        for k, fn in list(d.items()):
            hooks.append((d, k, fn))
            if torch_own(fn):  # (torch's own: what it reads and writes is torch's, weight_norm's weight)
                d[k] = _unwatched_hook(w, fn)
                continue
            name = f"the global {kind} {_hook_name(fn)}" if path is None else \
                f"the {kind} {_hook_name(fn)} of {module_text(path)}"
            d[k] = _watched_hook(w, fn, name)
    start = _random_state()
    stack: list[tuple] = []

    def pre(mod, args):
        stack.append((mod, _random_state()))

    def post(mod, args, out):
        if not stack:
            return
        m, before = stack.pop()
        py, np_ = _same_random(before, _random_state())
        if not (py and np_):
            gen = "Python's random" if not py else "NumPy's global random generator"
            w.problems.append(f"{w.where(m)} draws from {gen} in its forward{_RANDOM_ADVICE}")
            _set_random(before)  # (the outer modules see it unchanged: the innermost is named)

    handles = [_nn.register_module_forward_pre_hook(pre), _nn.register_module_forward_hook(post, always_call=True)]
    _current.append(w)
    failed = True
    try:
        yield w.reads
        failed = False
    finally:
        w.active = False
        _current.remove(w)
        for h in handles:
            h.remove()
        for d, k, fn in hooks:
            if k in d:
                d[k] = fn
        for m, cls in swapped:
            m.__class__ = cls
        for obj, name, old, _ in w.written.values():
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                object.__setattr__(obj, name, old) if not isinstance(obj, torch.nn.Module) else \
                    torch.nn.Module.__setattr__(obj, name, old)
        py, np_ = _same_random(start, _random_state())
        if not (py and np_):
            if not any("draws from" in p for p in w.problems):
                w.problems.append("the step draws from " + ("Python's random" if not py else
                                                            "NumPy's global random generator") + _RANDOM_ADVICE)
            _set_random(start)
        for cfg, path, via in w.configs.values():
            for k, v in vars(cfg).items():
                if guardable(v):
                    w.reads.note(path, via, k, v)
        if reads is not None:  # (a trace that failed read them too: what to watch for a change)
            reads.append(w.reads)
        changed = w.reads.restore_containers()
    if failed:
        return
    problems = list(w.problems) + changed
    for obj, name, old, where in w.written.values():
        was = "" if old is _MISSING else f" (was {_short(old)})"
        problems.append(f"{where} sets its attribute {name} in its forward{was}: a plan runs the ops it "
                        "traced, not the model's Python; keep such state out of forward (a tensor buffer "
                        "changed in place, or an argument of the call)")
    if w.seen:
        gc.collect()
        kept = next((what for ref, what in w.seen if ref() is not None), None)
        if kept:
            problems.append(f"{kept} keeps the tensors it sees{_HOOK_ADVICE}")
    if problems:
        raise NotReplayable(problems[0])


def _short(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor {str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
