"""Binding a plan to a model: `wrap` runs a plan only on the model it was made for.

A plan's graph section is derived from the model's code, and the interpreter
trusts it: run on a model whose code has changed since (`.relu()` become
`.tanh()`, same parameters), it would silently train the old graph.  So
before a plan runs, three checks, cheapest first:

* `check_parameters`: the model has exactly the plan's parameters and
  buffers (names, shapes, dtypes, requires_grad);
* `check_sound`: the verifier accepts the plan (a hand-edited unsound plan is
  refused with the verifier's own message, not a failure deep in generated
  code);
* `check_graph`: the model, traced again under FakeTensorMode (nothing is
  allocated) with the plan's input shapes, produces the plan's graph section
  op for op; the first op that differs is named with its module path.

Then, at each training step, `ModelGuard` notices the changes that leave
every parameter's shape and dtype as they were but not the graph: a
submodule replaced (`model.act = nn.Tanh()`), a parameter or buffer object
replaced, `requires_grad` flipped, a submodule put in eval() or train() on
its own.  A plan wrap refuses such a model, naming the change; a budget
wrap plans it again.
"""
from __future__ import annotations

import contextlib

import torch

from remat_ir.ir import sizes as sz
from remat_ir.ir import BUFFER, INPUT, PARAM, Node, Program, Value


class PlanMismatch(ValueError):
    """The plan does not fit the model or the inputs it is used with; `line`:
    the plan's line that differs from the model, when one does (else 0)."""

    def __init__(self, message: str, line: int = 0):
        super().__init__(message)
        self.line = line


_RECOMPILE = ("recompile the plan for this model (remat-compile), or, for a model you know is "
              "unchanged, skip this check with wrap(..., check_model=False) / remat-run --no-model-check")


def check_parameters(model: torch.nn.Module, program: Program) -> None:
    """Refuse a plan made for another model, naming the first difference."""
    from remat_ir.trace.tracer import model_buffers, model_params

    plan_params = {v.source: v for v in program.values if v.kind == PARAM}
    plan_buffers = {v.source: v for v in program.values if v.kind == BUFFER}
    have = {n: p for n, p, _ in model_params(model)}
    for name, v in plan_params.items():
        p = have.get(name)
        if p is None:
            raise PlanMismatch(f"the plan's parameter {name} does not exist in this model "
                               f"(plan for {program.header.model or 'another model'})")
        if list(p.shape) != v.shape or str(p.dtype) != "torch." + v.dtype:
            raise PlanMismatch(f"parameter {name}: the plan expects {v.dtype}{v.shape}, the model has "
                               f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}")
        if bool(p.requires_grad) != v.requires_grad:
            raise PlanMismatch(f"parameter {name}: requires_grad is {p.requires_grad} in the model but "
                               f"{v.requires_grad} in the plan")
    extra = [n for n in have if n not in plan_params]
    if extra:
        raise PlanMismatch(f"the model has parameter {extra[0]}, which the plan does not know "
                           f"({len(extra)} unknown in all)")
    have_b = {n: b for n, b, _ in model_buffers(model)}
    for name, v in plan_buffers.items():
        b = have_b.get(name)
        if b is None or list(b.shape) != v.shape or str(b.dtype) != "torch." + v.dtype:
            raise PlanMismatch(f"buffer {name}: the plan expects {v.dtype}{v.shape}, the model has "
                               + ("none" if b is None else f"{str(b.dtype).removeprefix('torch.')}{list(b.shape)}"))


def check_sound(program: Program) -> None:
    """Refuse a plan the verifier rejects, with its first errors."""
    from remat_ir.check.verify import verify

    verdict = verify(program)
    if not verdict.ok:
        shown = "; ".join(str(d) for d in verdict.errors[:3])
        more = f" (and {len(verdict.errors) - 3} more)" if len(verdict.errors) > 3 else ""
        raise PlanMismatch(f"the plan is not sound: {shown}{more}; run remat-verify on it")


def check_device(program: Program) -> None:
    """Refuse a plan holding ops that cannot run on its device as eager would
    there (CPU-only kernels, fusions proven on CPU only), naming them."""
    from remat_ir.ir.ops import device_problems

    bad = device_problems([n.op for n in program.nodes], program.header.device)
    if bad:
        raise PlanMismatch(f"the plan is for {program.header.device} but holds ops that run there differently "
                           f"from eager or not at all: {', '.join(bad)}; trace it for {program.header.device}: "
                           f"compile(..., device='{program.header.device}') on any machine, or remat-compile "
                           f"--device {program.header.device} on one that has it")


def check_header(program: Program) -> None:
    """Refuse a plan whose header says the step runs under an autocast, or
    with constants, that no call can have (`remat_ir.ir.header`, as the
    verifier reads them), naming the line."""
    from remat_ir.ir.header import header_problems

    problems = header_problems(program.header)
    if problems:
        field, message = problems[0]
        raise PlanMismatch(f"the plan's {message}", program.header.lines.get(field, 0))


def autocast_differs(plan_autocast: str, call_autocast: str) -> str:
    """How the autocast a step runs under (`call_autocast`, "cpu:bfloat16" or
    "" for none) differs from the one its plan was traced under, naming both;
    "" when it does not.  The plan's ops carry autocast's casts already (the
    runner switches autocast off while they run), so only the same autocast
    gives eager's dtypes."""
    from remat_ir.trace.calls import describe_autocast

    if plan_autocast == call_autocast:
        return ""
    return (f"the step runs under {describe_autocast(call_autocast)} but the plan was made under "
            f"{describe_autocast(plan_autocast)}")


def constants_differ(constants: list[str], call) -> str:
    """How the constants of `call` (a `remat_ir.trace.calls.Call`) differ
    from `constants`, those a plan was made with (its header's), naming the
    argument; "" when they do not.  An argument left out counts as the
    forward's default, so passing the default is the same call."""
    from remat_ir.trace.calls import constants_map

    want, got = constants_map(constants), constants_map(call.constants)
    for name in list(want) + [n for n in got if n not in want]:
        w, g = want.get(name, call.defaults.get(name)), got.get(name, call.defaults.get(name))
        if w == g:
            continue
        now = f"argument {name} is {g}" if name in got else (
            f"argument {name} is not passed" + (f" (its default is {g})" if g is not None else ""))
        made = f"the plan was made with {name}={w}" if name in want else (
            "the plan was made without it" + (f" (its default, {w})" if w is not None else ""))
        return f"{now} but {made}"
    return ""


def check_graph(model: torch.nn.Module, program: Program, loss_fn=None, live: list | None = None) -> None:
    """Refuse a plan whose graph section this model no longer produces: the
    step is traced again under fake tensors, with inputs of the plan's
    shapes, dtypes and strides, and compared with the plan node by node.
    What that trace read of the model's Python state is appended to `live`."""
    from torch._subclasses.fake_tensor import FakeTensor

    from remat_ir.trace.calls import CallError, call_from_names, constants_map, read_constant, rebuildable
    from remat_ir.trace.device import is_neutral
    from remat_ir.trace.tracer import TraceError, trace_module

    # A model built inside FakeTensorMode traces in its own mode.
    mode = next((p.fake_mode for p in model.parameters() if isinstance(p, FakeTensor)), None)
    device = next((p.device for p in model.parameters()), torch.device(program.header.device))
    dynamic, at_sizes = _symbolic_call(program)
    with mode or contextlib.nullcontext():
        named, made = {}, {}
        for v in at_sizes.values:
            if v.kind == INPUT:
                # One tensor passed twice (`input_ids=ids, labels=ids`) is one storage in the plan.
                t = made.get(v.storage)
                if t is None or list(t.shape) != v.shape or list(t.stride()) != v.stride:
                    t = _blank(v, device)
                    made.setdefault(v.storage, t)
                named[v.source or v.name] = t
    # The call's constants as the plan was made with them (`scale=2.0`), not the forward's defaults.
    at = program.header.lines.get("constants", 0)
    for name, text in constants_map(program.header.constants).items():
        if not rebuildable(text):
            raise PlanMismatch(f"cannot check the model against the plan: it was made with the argument "
                               f"{name}={text}, which cannot be built again from the plan's text; for a model "
                               "you know is unchanged, skip this check with wrap(..., check_model=False)", at)
        try:
            named[name] = read_constant(text)
        except ValueError as e:
            raise PlanMismatch(f"the plan's constant {name}: {e}", at) from None
    try:
        args, kwargs = call_from_names(model, named)
    except CallError as e:
        raise PlanMismatch(f"cannot check the model against the plan: {e}; for a model you know is "
                           "unchanged, skip this check with wrap(..., check_model=False)") from e
    try:
        fresh = trace_module(model, args, kwargs=kwargs, loss_fn=loss_fn, autocast=program.header.autocast,
                             model_name=program.header.model, dynamic=dynamic,
                             fake=True, neutral=is_neutral(program), guards=program.header.guards, live=live)
    except TraceError as e:
        raise PlanMismatch(f"this model no longer traces to the plan's graph ({e}); {_RECOMPILE}") from e
    if program.header.rewrites:
        from remat_ir.rewrite import NotApplicable, apply

        try:
            fresh = apply(fresh, program.header.rewrites)
        except NotApplicable as e:
            raise PlanMismatch(f"the plan's rewrites ({', '.join(program.header.rewrites)}) do not apply to "
                               f"this model's step: {e}; {_RECOMPILE}", program.header.lines.get("rewrites", 0)) from e
    difference, line = first_difference(program, fresh)
    if difference:
        raise PlanMismatch(f"this model no longer produces the plan's graph: {difference}; {_RECOMPILE}",
                           line)


def _symbolic_call(program: Program) -> tuple[dict | None, Program]:
    """For a symbolic plan: which input dimensions are its symbols, and the
    plan at sizes to trace the model with (each symbol a size of its own, so
    that tracing keeps them apart); else (None, the plan)."""
    if not sz.is_symbolic(program):
        return None, program
    ranges = sz.ranges(program)
    sizes: dict[str, int] = {}
    for s, r in ranges.items():  # the high end, or the largest size below it that no other symbol has
        n = r.high
        while n in sizes.values() and n > r.low:
            n -= 1
        sizes[s] = n
    try:
        at = sz.instantiate(program, sizes)
    except sz.SizeError as e:
        raise PlanMismatch(f"cannot check the model against the plan at {sizes}: {e}; for a model you know is "
                           "unchanged, skip this check with wrap(..., check_model=False)") from None
    dynamic: dict[str, dict[int, str]] = {}
    for v in program.values:
        if v.kind == INPUT:
            dims = {d: x for d, x in enumerate(v.shape) if type(x) is str and x in ranges}
            if dims:
                dynamic[v.source or v.name] = dims
    return dynamic, at


def _blank(v: Value, device) -> torch.Tensor:
    t = torch.zeros(v.shape, dtype=getattr(torch, v.dtype), device=device)
    if list(t.stride()) != v.stride:
        t = torch.empty_strided(v.shape, v.stride, dtype=t.dtype, device=device).zero_()
    return t.requires_grad_(v.requires_grad)


def _call(n: Node) -> str:
    args = [a.name if hasattr(a, "name") and type(a).__name__ == "Ref" else repr(a) for a in n.args]
    args += [f"{k}={v!r}" for k, v in n.kwargs.items()]
    text = f"{n.op}({', '.join(args)})"
    return text if len(text) <= 160 else text[:157] + "..."


def _where(n: Node) -> str:
    at = [f"line {n.line}"] if n.line else []
    at += [f"module {n.module}"] if n.module else []
    return f"node {n.name}" + (f" ({', '.join(at)})" if at else "")


# What a node and a value are, for the comparison: everything but costs
# (flops, measured time_us), which do not change what runs.
_NODE_FIELDS = ("name", "op", "args", "kwargs", "outputs", "phase", "random", "mutates")
_VALUE_FIELDS = ("kind", "dtype", "shape", "stride", "storage", "nbytes", "source", "requires_grad",
                 "aliases")


def first_difference(plan: Program, fresh: Program) -> tuple[str, int]:
    """The first way in which `fresh` (the model traced now) differs from
    `plan`, in words, and the plan's line where it is (0: none); ("", 0)
    when the graphs are the same."""
    for a, b in zip(plan.nodes, fresh.nodes):
        if a.op != b.op or a.args != b.args or a.kwargs != b.kwargs:
            return f"at {_where(a)} the plan runs {_call(a)}, the model now runs {_call(b)}", a.line
        for f in _NODE_FIELDS:
            if getattr(a, f) != getattr(b, f):
                return (f"at {_where(a)} the plan has {f} {getattr(a, f)!r}, the model now gives "
                        f"{getattr(b, f)!r}"), a.line
    if len(plan.nodes) != len(fresh.nodes):
        if len(plan.nodes) > len(fresh.nodes):
            n = plan.nodes[len(fresh.nodes)]
            return f"the model now ends before the plan's {_where(n)}: {_call(n)}", n.line
        n = fresh.nodes[len(plan.nodes)]
        return f"the model now runs more ops, from {_where(n)}: {_call(n)}", 0
    fresh_values = fresh.value_map()
    for v in plan.values:
        w = fresh_values.get(v.name)
        if w is None:
            return f"the plan's value {v.name} no longer exists", v.line
        for f in _VALUE_FIELDS:
            if getattr(v, f) != getattr(w, f):
                return (f"value {v.name}: the plan has {f} {getattr(v, f)!r}, the model now gives "
                        f"{getattr(w, f)!r}"), v.line
    for f in ("output_spec", "has_loss"):
        if getattr(plan.header, f) != getattr(fresh.header, f):
            return (f"the step's {f} changed (the plan: {getattr(plan.header, f)!r}, the model now: "
                    f"{getattr(fresh.header, f)!r})"), plan.header.lines.get(f, 0)
    if [(o.kind, o.key, o.value) for o in plan.outputs] != [(o.kind, o.key, o.value) for o in fresh.outputs]:
        return "the step's outputs changed", 0
    return "", 0


# ------------------------------------------------------------ per-step guard


class ModelGuard:
    """What a bound plan depends on that can change after binding without a
    parameter's shape or dtype changing: the module tree (each submodule's
    name, object and class), each parameter and buffer object, each
    parameter's `requires_grad` and each module's `training` flag.

    `ModelGuard(model)` is taken when a plan is made or bound; `changes(model)`,
    at each training step, lists what differs since, in words ([] when
    nothing does).  The check compares the ids of the objects and a list of
    the flags with what was taken (its cost against a training step, with
    the command that measures it: docs/05-wrap.md); only when they
    differ is the model walked by name to say what changed.  Objects are held weakly (a replaced parameter is not kept
    alive); one that dies marks the guard changed, so an id reused by a new
    object is not mistaken for the old one.  Pickled, a guard keeps the flags
    and takes the objects afresh at its first check after loading.

    The flags are the ones of a training step: a model in eval mode when the
    guard is taken is looked at as `model.train()` would put it (as a plan's
    trace puts it), and its modes are left as they were."""

    def __init__(self, model: torch.nn.Module):
        self._take(model)

    def _take(self, model: torch.nn.Module) -> None:
        import weakref

        with _train_mode(model):
            objects, self.facts = _scan(model)
            self.names = _by_name(model, weak=True)
        self.ids = list(map(id, objects))
        self.dead = False
        died = self._died  # (a bound method: the refs' callbacks keep no other state)
        self._refs = [weakref.ref(o, died) for o in objects if o is not None]

    def _died(self, _ref) -> None:
        self.dead = True

    def changes(self, model: torch.nn.Module) -> list[str]:
        """What changed in `model` since the guard was taken, in words."""
        if not self.dead:
            objects, facts = _scan(model)
            if facts == self.facts:
                if self.ids is None:  # unpickled: the flags are the same; take the objects now
                    self._take(model)
                    return []
                if list(map(id, objects)) == self.ids:
                    return []
        return _differences(self.names, _by_name(model, weak=False)) or [
            "the order of its submodules, parameters or buffers changed, or one was replaced and freed"]

    def __getstate__(self):
        names = {k: {n: (None, *rest) for n, (_, *rest) in d.items()} for k, d in self.names.items()}
        return {"facts": self.facts, "names": names, "ids": None, "dead": False}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._refs = []


def _scan(model: torch.nn.Module) -> tuple[list, list]:
    """The objects of the model's tree (modules, parameters, buffers, in a
    fixed order) and its facts (names, classes, flags), as two flat lists."""
    objects, facts = [model], []
    todo, seen = [model], {id(model)}
    for m in todo:  # (grows as it goes: breadth first)
        facts.append(own_class(m))
        facts.append(m.training)
        for k, p in m._parameters.items():
            objects.append(p)
            facts.append(k)
            facts.append(p is not None and p.requires_grad)
        for k, b in m._buffers.items():
            objects.append(b)
            facts.append(k)
        for k, c in m._modules.items():
            objects.append(c)
            facts.append(k)
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                todo.append(c)
    return objects, facts


def _by_name(model: torch.nn.Module, weak: bool) -> dict:
    """Each submodule, parameter and buffer by name, with what the guard
    compares (the object, or a weak reference to it, first)."""
    import weakref

    ref = weakref.ref if weak else (lambda o: o)
    return {"module": {n: (ref(m), own_class(m), m.training)
                       for n, m in model.named_modules(remove_duplicate=False)},
            "parameter": {n: (ref(p), p.requires_grad, _type(p))
                          for n, p in model.named_parameters(remove_duplicate=False)},
            "buffer": {n: (ref(b), _type(b)) for n, b in model.named_buffers(remove_duplicate=False)}}


def own_class(m: torch.nn.Module) -> type:
    """`m`'s class, or the class it had before remat-ir adopted it (which
    pickle can find by name)."""
    cls = type(m)
    return cls.__dict__.get("_remat_base", cls)


def _type(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _differences(then: dict, now: dict) -> list[str]:
    """What differs between two `_by_name` maps (`then` weak), in words: a
    replaced or removed submodule stands for everything under it."""
    out: list[str] = []
    gone: list[str] = []  # submodules replaced or removed: nothing under them is listed again

    def under(name: str) -> bool:
        return any(name.startswith(g + ".") for g in gone)

    for name, (ref, cls, training) in then["module"].items():
        if under(name):
            continue
        what = f"submodule {name}" if name else "the model"
        m = now["module"].get(name)
        if m is None:
            out.append(f"{what} ({cls.__name__}) was removed")
            gone.append(name)
        elif own_class(m[0]) is not cls:
            out.append(f"{what} changed from {cls.__name__} to {type(m[0]).__name__}")
            gone.append(name)
        elif ref is not None and ref() is not m[0]:
            out.append(f"{what} was replaced by another {cls.__name__}")
            gone.append(name)
        elif m[2] != training:
            out.append(f"{what} was put in {'train' if m[2] else 'eval'} mode")
    out += [f"submodule {n} ({type(m).__name__}) was added" for n, (m, _, _) in now["module"].items()
            if n not in then["module"] and not under(n)]
    for kind in ("parameter", "buffer"):
        for name, (ref, *facts) in then[kind].items():
            if under(name):
                continue
            t = now[kind].get(name)
            if t is None:
                out.append(f"{kind} {name} was removed")
            elif ref is not None and ref() is not t[0]:
                other = "Parameter" if kind == "parameter" else "tensor"
                was = facts[-1]
                out.append(f"{kind} {name} was replaced by another {other}"
                           + ("" if t[-1] == was else f" ({t[-1]}, was {was})"))
            elif kind == "parameter" and t[1] != facts[0]:
                out.append(f"parameter {name}: requires_grad changed from {facts[0]} to {t[1]}")
        out += [f"{kind} {n} was added" for n in now[kind] if n not in then[kind] and not under(n)]
    return out


@contextlib.contextmanager
def _train_mode(model: torch.nn.Module):
    """`model` as a training step sees it: put in train mode if it is not,
    every module's mode restored after."""
    if model.training:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


# ------------------------------------------------------- live Python guard


_ABSENT = object()


class LiveGuard:
    """What the traces of a model's plans read of its live Python state
    (`remat_ir.trace.live`: submodules' attributes such as `Dropout.p` or
    peft's `scaling`, the config objects they read) and every hook dict of
    the model and the global ones.  `changes(model)`, at each training step,
    lists what differs since, in words ([] when nothing does): equal values
    for scalars and small containers, the same object for anything else, the
    same hooks (a hook added or removed is a change; a plan traced the ones
    there were).

    The check is one list comparison of the values and one of the hook
    dicts' keys (its cost: docs/05-wrap.md).  Entries are kept by module
    path, so a pickled or deep-copied guard binds to the model it meets."""

    def __init__(self, reads: list, model: torch.nn.Module | None = None):
        entries: dict = {}
        for r in reads:
            for k, v in r.attributes.items():
                entries.setdefault(k, v)
        self.entries = list(entries.items())  # ((path, via, name), value)
        self._bound = None
        if model is not None:
            self._bind(model)

    def _bind(self, model: torch.nn.Module) -> None:
        from remat_ir.trace.live import guardable, hook_dicts

        owners = []  # (the owner's __dict__, name), in the entries' order
        for i, ((path, via, name), value) in enumerate(self.entries):
            try:
                owner = model.get_submodule(path)
            except AttributeError:
                owner = None
            if via:
                owner = owner.__dict__.get(via) if owner is not None else None
            d = getattr(owner, "__dict__", {})
            if isinstance(value, _Rebind):  # (unpickled: the objects are the model's as it is now)
                self.entries[i] = ((path, via, name), d.get(name, _ABSENT))
            owners.append((d, name))
        self._by_value = [guardable(v) for _, v in self.entries]
        # Compared by equality (scalars, small containers) and by identity (anything else).
        self._eq = [o for o, by_value in zip(owners, self._by_value) if by_value]
        self._same = [o for o, by_value in zip(owners, self._by_value) if not by_value]
        self._eq_values = [v for (_, v), by_value in zip(self.entries, self._by_value) if by_value]
        self._same_ids = [id(v) for (_, v), by_value in zip(self.entries, self._by_value) if not by_value]
        self._owners = owners
        self._hooks = hook_dicts(model)
        self._hook_keys = [_user_hooks(d) for _, _, d in self._hooks]
        self._bound = True

    def changes(self, model: torch.nn.Module) -> list[str]:
        """What changed in `model`'s live state since the guard was taken."""
        if self._bound is None:
            self._bind(model)
        if [d.get(n, _ABSENT) for d, n in self._eq] == self._eq_values \
                and [id(d.get(n, _ABSENT)) for d, n in self._same] == self._same_ids \
                and [_user_hooks(d) for _, _, d in self._hooks] == self._hook_keys:
            return []
        return self._describe()

    def _describe(self) -> list[str]:
        from remat_ir.trace.live import module_text

        out = []
        for ((path, via, name), value), (d, _), by_value in zip(self.entries, self._owners, self._by_value):
            now = d.get(name, _ABSENT)
            if (now == value) if by_value else (now is value):
                continue
            attr = f"{via}.{name}" if via else name
            got = "was deleted" if now is _ABSENT else (
                f"changed from {_brief(value)} to {_brief(now)}" if by_value else "was replaced")
            out.append(f"attribute {attr} of {module_text(path)} {got}")
        for (path, kind, d), keys in zip(self._hooks, self._hook_keys):
            hooks = _user_hooks(d)
            if hooks != keys:
                where = f"a global {kind}" if path is None else f"a {kind} of {module_text(path)}"
                added, removed = set(hooks) - set(keys), set(keys) - set(hooks)
                out.append(f"{where} was " + ("added" if added and not removed else
                                              "removed" if removed and not added else "replaced"))
        return out or ["the model's live state changed"]

    def __getstate__(self):
        from remat_ir.trace.live import guardable

        return {"entries": [(k, v if guardable(v) else _Rebind()) for k, v in self.entries], "_bound": None}


class _Rebind:
    """In a pickled LiveGuard: an object compared by identity, taken afresh from the model."""


def _user_hooks(d: dict) -> tuple:
    """The keys of a hook dict's hooks that are not torch's own (a FLOP
    counter's or memory tracker's, registered anew at each `with`)."""
    if not d:
        return ()
    from remat_ir.trace.live import torch_own

    return tuple(k for k, fn in d.items() if not torch_own(fn))


def _brief(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."
