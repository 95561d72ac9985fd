"""Type-check a plan's graph section against this PyTorch build.

The verifier proves the schedule sound against the graph; this module checks
the graph itself: that what the `values` and `graph` lines and the header say
is what the ops of this PyTorch build do.  It shares no code with the tracer
that wrote those facts; it re-derives them.

    typecheck(program) -> [(loc, message)]      loc: (section, index, line)

For each node, in graph order:

* its op resolves (`torch.ops.<ns>.<op>.<overload>`; `remat.*` ops are those
  of `remat_ir.ir.ops`), with a "did you mean" for a near miss or a missing
  overload;
* the op runs under `FakeTensorMode` on fake tensors built from the *declared*
  operands (dtype, shape, stride; a view sits on its storage owner's fake
  storage, so storage sharing is what the plan says) and the node's other
  arguments, and each output's declared dtype, shape, strides (those of
  dimensions longer than one: the others address nothing), storage bytes and
  storage owner (`view of`) are what the op produced;
* `random` says whether the op draws from the RNG
  (`torch.Tag.nondeterministic_seeded`, or `remat_ir.ir.ops.RANDOM_OPS`), and
  `mutates(...)` lists exactly the operands the op's schema writes (plus the
  running statistics `native_batch_norm` updates in training, which its schema
  does not mark: `remat_ir.ir.ops.HIDDEN_MUTATORS`);
* its literal numbers are ones the kernel takes where the fake run checks
  nothing (`check_scalars`): a dropout or bernoulli probability in [0, 1], a
  fill value (full, fill_, masked_fill, ...) its dtype can hold, no
  `output_mask` entry false where the node names the output (the kernel then
  returns None; the fake run a tensor), and on CPU plans, the scalars of a
  pointwise op as its CPU kernel takes them, run for real on two elements
  (an integer divided by 0 or raised to a negative power, a clamp bound past
  int64).

Each node is checked on its declared operands, not on what earlier nodes
produced, so one wrong fact is reported once, where it is declared.  Values,
tangents and the header are checked too: a tangent's `source` is the index of
a forward result of its shape and dtype; the header's device, and every
`device(...)` argument, is one the runtime runs plans on (`cpu`, `cuda`,
`cuda:N`: `device_problem`); its optimizer is one of `OPTIMIZER_STATES` with
the state bytes that optimizer keeps, its `output_spec` empty or a treespec
with one leaf per result, and a plan that includes its loss (`has_loss`)
returns one tensor of one element, as the tracer requires of a loss.
Nothing raises: what cannot be checked (an op fake mode cannot run,
one whose outputs depend on the data) is reported as an error.

torch is imported on the first call, not with the module.
"""
from __future__ import annotations

import difflib
import logging
import re

from remat_ir.ir.guards import Guard, GuardError
from remat_ir.ir.header import header_problems
from remat_ir.ir.ops import autocast_off, fake_kernels
from remat_ir.ir.syntax import clip
from remat_ir.ir.types import (
    COST_MODELS, DTYPE_BYTES, DTYPE_SHORT, FORMAT_VERSION, INPUT, MAX_NESTING, OPTIMIZER_STATES, PARAM, RESULT,
    TANGENT, Device, DType, Layout, MemoryFormat, Program, Ref, Seq, Special, arg_depth, arg_refs,
)

__all__ = ["typecheck", "device_problem"]

# The devices the runtime runs plans on, in a header's `device` line and in
# `device(...)` arguments alike: `cpu`, `cuda` and `cuda:N`.  N is at most 127,
# torch's largest device index (torch.device("cuda:128") is cuda:-128); an
# index beyond the machine's GPUs is the machine's to refuse, at run time.
# Other torch device types (meta, mps, xpu, ...) have no RNG, memory
# accounting or autocast path in the runtime.
DEVICE_RE = re.compile(r"cpu|cuda(?::(?:0|[1-9][0-9]?|1[01][0-9]|12[0-7]))?")
_DEVICE_WORDS = ("cpu", "cuda", "cuda:0")


def device_problem(name) -> str:
    """What is wrong with `name` as a device of a plan (a header's `device`,
    a `device(...)` argument), in words that follow "device "; "" when the
    runtime runs plans there."""
    if isinstance(name, str) and DEVICE_RE.fullmatch(name):
        return ""
    shown = clip(name) if isinstance(name, str) else type(name).__name__
    short = isinstance(name, str) and len(name) < 40
    close = difflib.get_close_matches(name, _DEVICE_WORDS, n=1) if short else []
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return (f"{shown!r} is not one the runtime runs plans on: write cpu, cuda or cuda:N (N a GPU index "
            f"from 0 to 127){hint}")

Loc = tuple  # (section, index, line)


def typecheck(program: Program) -> list[tuple[Loc, str]]:
    """Every disagreement between `program`'s graph section (and header) and
    what this PyTorch build does; [] when none.  Never raises."""
    try:
        return _Checker(program).run()
    except Exception as e:  # pragma: no cover - a bug here must not hide the verifier's other errors
        return [(("nodes", -1, 0), f"the graph type checker failed ({type(e).__name__}: {e}); this is a "
                                   f"bug in remat-ir, the graph section was not checked")]


def _type(dtype: str, shape) -> str:
    return f"{DTYPE_SHORT.get(dtype, dtype)}[{','.join(str(d) for d in shape)}]"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _needed_bytes(shape, stride, dtype) -> int:
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(shape, stride))) * DTYPE_BYTES[dtype]


def _significant_strides(shape, stride) -> list:
    """The strides that address memory: those of dimensions longer than one
    (none for an empty tensor)."""
    if any(d == 0 for d in shape):
        return []
    return [(i, s) for i, (d, s) in enumerate(zip(shape, stride)) if d != 1]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _spec_kind(spec) -> str:
    t = getattr(spec, "type", None)
    return getattr(t, "__name__", "structure") if t is not None else "structure"


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    line = text.splitlines()[0]
    return line if len(line) <= 300 else line[:297] + "..."


class _Unconvertible(Exception):
    pass


class _Checker:
    def __init__(self, program: Program):
        import torch
        from torch._subclasses import fake_tensor

        import remat_ir.ir.ops as remat_ops  # registers the remat.* ops

        self.torch = torch
        self.ft = fake_tensor
        self.random_ops = remat_ops.RANDOM_OPS
        self.hidden_mutators = remat_ops.HIDDEN_MUTATORS
        self.p = program
        self.out: list[tuple[Loc, str]] = []
        self.values = {}
        self.value_index = {}
        for i, v in enumerate(program.values):
            self.values.setdefault(v.name, v)
            self.value_index.setdefault(v.name, i)
        self.ops: dict[str, object] = {}  # op name -> OpOverload, or an error message (str)
        self.storages: dict[str, object] = {}  # owner name -> fake untyped storage
        self.fakes: dict[str, object] = {}  # value name -> its fake tensor
        self.facts: dict[str, tuple] = {}  # value name -> (shape, stride, dtype) its fake was made with
        self.owner_of: dict[int, str] = {}  # fake storage id -> owner name
        self.device = None
        self.mode = None
        self._all_ops = None
        self.guards: list[Guard] = []  # the header's guards that parse and read only the plan's inputs

    def err(self, loc: Loc, message: str) -> None:
        self.out.append((loc, message))

    def run(self) -> list[tuple[Loc, str]]:
        self.check_header()
        self.check_tangents()
        torch = self.torch
        if self.device is None:
            self.device = torch.device("cpu")
        # Fake mode logs a traceback for every op that refuses its operands;
        # here that is a diagnostic, not a crash.
        log = logging.getLogger(self.ft.__name__)
        was_disabled, log.disabled = log.disabled, True
        try:
            # The verdict must not depend on an autocast the caller is in (CUDA
            # autocast runs `sum` in float32, CPU autocast `mm` in bfloat16).
            with autocast_off(), self.ft.FakeTensorMode(allow_non_fake_inputs=False) as mode, \
                    fake_kernels(self.device.type):
                self.mode = mode
                for i, n in enumerate(self.p.nodes):
                    try:
                        self.check_node(i, n)
                    except Exception as e:  # pragma: no cover - defensive: report, never raise
                        self.err(("nodes", i, n.line), f"node {n.name}: the type checker could not check "
                                                       f"{n.op} ({type(e).__name__}: {_first_line(e)})")
                self.check_guards()
        finally:
            log.disabled = was_disabled
        return self.out

    # ---------------------------------------------------------------- header

    def check_header(self) -> None:
        torch = self.torch
        h = self.p.header

        def loc(field: str) -> Loc:
            return ("header", -1, h.lines.get(field, 0))

        if h.version != FORMAT_VERSION:
            self.err(loc("rir"), f"format version {h.version!r} is not {FORMAT_VERSION}, the version this "
                                 f"remat-ir reads")
        problem = device_problem(h.device)
        if problem:
            self.err(loc("device"), f"device {problem}")
        else:
            self.device = torch.device(h.device)
        if h.cost not in COST_MODELS:
            self.err(loc("cost"), f"cost model {h.cost!r} is unknown; expected one of "
                                  f"{', '.join(COST_MODELS)}")
        if h.optim not in OPTIMIZER_STATES:
            close = difflib.get_close_matches(str(h.optim), list(OPTIMIZER_STATES), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            self.err(loc("optimizer"), f"optimizer {h.optim!r} is unknown: the runtime and the memory "
                                       f"prediction know {', '.join(OPTIMIZER_STATES)}{hint}")
        else:
            per = OPTIMIZER_STATES[h.optim]
            want = per * sum(v.nbytes for v in self.p.values
                             if v.kind == PARAM and v.requires_grad and _is_int(v.nbytes))
            if h.optim_state_bytes != want:
                self.err(loc("optimizer"), f"optimizer {h.optim} keeps {per} tensor{'s' if per != 1 else ''} "
                                           f"per trainable parameter, {want} bytes for this plan's "
                                           f"parameters, but the header says {h.optim_state_bytes} bytes; "
                                           f"write `optimizer {h.optim} {want} bytes`")
        for field, message in header_problems(h):
            self.err(loc(field), message)
        inputs = {v.source or v.name for v in self.p.values if v.kind == INPUT}
        for g in h.guards:
            try:
                guard = Guard(g)
            except GuardError as e:
                self.err(loc("guards"), f"{e}; guards are written by the tracer: restore the line, or "
                                        "compile the plan again")
                continue
            # (A buffer a guard reads need not be one the step uses: only the model knows its buffers.)
            unknown = [name for kind, name in guard.reads if kind == "input" and name not in inputs]
            for name in unknown:
                self.err(loc("guards"), f"guard {g!r} reads input({name!r}), which is not an input of the "
                                        "plan; guards are written by the tracer: restore the line, or "
                                        "compile the plan again")
            if not unknown:
                self.guards.append(guard)
        if h.output_spec:
            from remat_ir.ir.specs import load_treespec
            try:
                spec = load_treespec(h.output_spec)
            except Exception as e:
                self.err(loc("output_spec"), f"output_spec is not a serialized pytree treespec "
                                             f"(torch.utils._pytree.treespec_loads: {_first_line(e)}); "
                                             f"write the one the tracer wrote, or \"\" for a plain tuple")
            else:
                results = sum(1 for o in self.p.outputs if o.kind == RESULT)
                if spec.num_leaves != results:
                    self.err(loc("output_spec"), f"output_spec has {spec.num_leaves} "
                                                 f"lea{'f' if spec.num_leaves == 1 else 'ves'}, but the plan "
                                                 f"has {results} forward result{'' if results == 1 else 's'}")
                elif h.has_loss and not spec.is_leaf():
                    self.err(loc("output_spec"), f"the plan includes its loss (has_loss true), but output_spec "
                                                 f"makes the step return a {_spec_kind(spec)} of {results}, not "
                                                 f"the loss itself; a loss is one tensor of one element: write "
                                                 f"the leaf spec the tracer wrote")
        if h.has_loss:
            results = [self.values.get(o.value) for o in self.p.outputs if o.kind == RESULT]
            if len(results) != 1 or (results[0] is not None and all(_is_int(d) for d in results[0].shape)
                                     and _numel(results[0].shape) != 1):
                what = (f"{len(results)} results" if len(results) != 1
                        else f"a result of shape {list(results[0].shape)}")
                self.err(loc("has_loss"), f"the plan includes its loss (has_loss true), but its step returns "
                                          f"{what}, not one tensor of one element: a training step cannot call "
                                          f".backward() on it")

    def check_tangents(self) -> None:
        results = [o for o in self.p.outputs if o.kind == RESULT]
        seen: dict[int, str] = {}
        for i, v in enumerate(self.p.values):
            if v.kind != TANGENT:
                continue
            loc = ("values", i, v.line)
            src = v.source or "0"
            try:
                k = int(src)
            except ValueError:
                k = None
            if k is None or not 0 <= k < len(results):
                have = (f"0..{len(results) - 1}" if results else "none")
                self.err(loc, f"tangent {v.name} has source {src!r}, but a tangent's source is the index of "
                              f"the forward result it is the gradient of, and this plan has "
                              f"{len(results)} result{'' if len(results) == 1 else 's'} (indices: {have})")
                continue
            if k in seen:
                self.err(loc, f"tangents {seen[k]} and {v.name} both have source {k}; each forward result "
                              f"has one gradient")
            seen.setdefault(k, v.name)
            r = self.values.get(results[k].value)
            if r is None:
                continue
            if (r.dtype, list(r.shape)) != (v.dtype, list(v.shape)):
                self.err(loc, f"tangent {v.name} is {_type(v.dtype, v.shape)}, but it is the gradient of "
                              f"result {results[k].key} ({r.name}), which is {_type(r.dtype, r.shape)}")

    # ----------------------------------------------------------------- nodes

    def resolve(self, name: str):
        """The OpOverload named `name`, or a message saying why there is none."""
        got = self.ops.get(name)
        if got is None:
            got = self.ops[name] = self._resolve(name)
        return got

    def _resolve(self, name: str):
        torch = self.torch
        parts = name.split(".")
        if len(parts) == 3 and all(parts):
            ns, op, overload = parts
            try:
                return getattr(getattr(getattr(torch.ops, ns), op), overload)
            except (AttributeError, RuntimeError):
                pass
        table = self.all_ops()
        if len(parts) == 2 and all(parts) and parts[0] in table and parts[1] in table[parts[0]]:
            overloads = sorted(table[parts[0]][parts[1]], key=lambda o: (o != "default", o))
            return (f"op {name} names no overload: an op is written NAMESPACE.OP.OVERLOAD; did you mean "
                    f"`{name}.{overloads[0]}`?" + (f" (its overloads: {', '.join(overloads)})"
                                                   if len(overloads) > 1 else ""))
        msg = f"op {name} does not exist in this PyTorch build (torch {torch.__version__})"
        if len(parts) >= 2:
            ns, op = parts[0], parts[1]
            overload = parts[2] if len(parts) > 2 else "default"
            if ns in table and op in table[ns]:
                overloads = sorted(table[ns][op])
                close = difflib.get_close_matches(overload, overloads, n=1, cutoff=0.5)
                guess = f"{ns}.{op}.{close[0] if close else overloads[0]}"
                return f"{msg}: {ns}.{op} has no overload {overload!r}; did you mean `{guess}`? " \
                       f"(its overloads: {', '.join(overloads)})"
            if ns in table:
                close = difflib.get_close_matches(op, list(table[ns]), n=1, cutoff=0.75)
                if close:
                    ovs = table[ns][close[0]]
                    ov = overload if overload in ovs else ("default" if "default" in ovs else sorted(ovs)[0])
                    return f"{msg}; did you mean `{ns}.{close[0]}.{ov}`?"
            else:
                close = difflib.get_close_matches(ns, list(table), n=1, cutoff=0.75)
                if close:
                    return f"{msg}: there is no op namespace {ns!r}; did you mean `{close[0]}`?"
        return msg

    def all_ops(self) -> dict[str, dict[str, set[str]]]:
        """namespace -> op -> overloads, of every op this build registers."""
        if self._all_ops is None:
            table: dict[str, dict[str, set[str]]] = {}
            for full in self.torch._C._dispatch_get_all_op_names():
                ns, _, rest = full.partition("::")
                op, _, overload = rest.partition(".")
                table.setdefault(ns, {}).setdefault(op, set()).add(overload or "default")
            self._all_ops = table
        return self._all_ops

    def check_node(self, i: int, n) -> None:
        loc = ("nodes", i, n.line)
        op = self.resolve(n.op)
        if isinstance(op, str):
            self.err(loc, f"node {n.name}: {op}")
            return
        torch = self.torch
        # RNG use.
        random = torch.Tag.nondeterministic_seeded in op.tags or op in self.random_ops
        if random and not n.random:
            self.err(loc, f"node {n.name}: {n.op} draws from the RNG, but the node is not marked `random`, "
                          f"so a recompute would not replay its RNG state and would draw other numbers; "
                          f"add `random`")
        elif n.random and not random:
            self.err(loc, f"node {n.name} is marked `random`, but {n.op} does not draw from the RNG; "
                          f"remove `random`")
        # In-place updates.
        writes = self.written(op, n)
        declared = list(dict.fromkeys(n.mutates))
        missing = [w for w in writes if w not in declared]
        extra = [m for m in declared if m not in writes]
        if missing:
            self.err(loc, f"node {n.name}: {n.op} writes {', '.join(missing)} in place, but the node does "
                          f"not say so; write `mutates({', '.join(declared + missing)})` (the verifier's rules "
                          f"for in-place updates and recomputes rely on it)")
        if extra:
            fix = f"; write `mutates({', '.join(writes)})`" if writes else "; remove `mutates(...)`"
            self.err(loc, f"node {n.name} says it mutates {', '.join(extra)}, but {n.op} does not write "
                          f"{'it' if len(extra) == 1 else 'them'}{fix}")
        self.check_outputs(loc, n, op)

    def written(self, op, n) -> list[str]:
        """Names of the operands `op` writes, as the tracer records them."""
        hidden = self.hidden_mutators.get(n.op)
        if hidden is not None:
            flag, idx = hidden
            training = True if flag is None else n.args[flag] if len(n.args) > flag else n.kwargs.get(
                "training", False)
            if training is not True:
                return []
            return [n.args[k].name for k in idx if k < len(n.args) and isinstance(n.args[k], Ref)]
        out: list[str] = []
        for k, a in enumerate(op._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            arg = n.args[k] if k < len(n.args) else n.kwargs.get(a.name)
            for r in arg_refs(arg):
                if r not in out:
                    out.append(r)
        return out

    # --------------------------------------------------------- fake running

    def valid(self, name: str) -> bool:
        """Whether `name` is a value whose facts can make a fake tensor (the
        verifier reports the others)."""
        v = self.values.get(name)
        if v is None or v.dtype not in DTYPE_BYTES or not isinstance(getattr(self.torch, v.dtype, None),
                                                                     self.torch.dtype):
            return False
        if len(v.shape) != len(v.stride) or any(not _is_int(d) or d < 0 for d in v.shape) \
                or any(not _is_int(s) or s < 0 for s in v.stride):
            return False
        owner = self.values.get(v.storage)
        if owner is None or owner.storage != owner.name or not _is_int(owner.nbytes) or owner.nbytes < 0:
            return False
        return _needed_bytes(v.shape, v.stride, v.dtype) <= owner.nbytes

    def check_guards(self) -> None:
        """Each guard runs on the plan's inputs' shapes (its values aside) within
        the guard language's bounds.  A guard that reads a buffer or a size is
        left to the runtime: only the model and the call know them."""
        by_source = {v.source or v.name: v.name for v in self.p.values if v.kind == INPUT}
        loc = ("header", -1, self.p.header.lines.get("guards", 0))
        for guard in self.guards:
            if any(kind != "input" for kind, _ in guard.reads):
                continue
            try:
                fakes = {(kind, name): self.fake(by_source[name]) for kind, name in guard.reads}
            except Exception:  # noqa: BLE001 (an input whose declared facts are wrong: reported on its line)
                continue
            problem = guard.shape_problem(fakes)
            if problem:
                self.err(loc, f"{problem}; guards are written by the tracer: restore the line, or compile the "
                              "plan again")

    def fake(self, name: str):
        """A fake tensor with `name`'s declared facts, on its owner's fake
        storage; made once and reused while no op changes its metadata."""
        t = self.fakes.get(name)
        if t is not None:
            return t
        torch = self.torch
        v = self.values[name]
        dtype = getattr(torch, v.dtype)
        if v.storage == name:
            if v.nbytes == _needed_bytes(v.shape, v.stride, v.dtype):
                t = torch.empty_strided(v.shape, v.stride, dtype=dtype, device=self.device)
            else:
                st = torch.empty((v.nbytes,), dtype=torch.uint8, device=self.device).untyped_storage()
                t = torch.empty((0,), dtype=dtype, device=self.device).set_(st, 0, v.shape, v.stride)
            st = t.untyped_storage()
            self.owner_of[st._cdata] = name
            self.storages[name] = st
        else:
            base = self.fake(v.storage)  # the owner first: it makes the storage
            if base.dtype == dtype and base.storage_offset() == 0:
                t = base.as_strided(v.shape, v.stride, 0)
            else:
                t = torch.empty((0,), dtype=dtype, device=self.device).set_(
                    self.storages[v.storage], 0, v.shape, v.stride)
        self.fakes[name] = t
        self.facts[name] = (tuple(v.shape), tuple(v.stride), dtype)
        return t

    def evict_changed(self, env: dict) -> None:
        """Forget the operands whose metadata an op changed in place (`t_`,
        `resize_`, ...): the next node gets a fresh one."""
        for name, t in env.items():
            shape, stride, dtype = self.facts[name]
            if (tuple(t.shape) != shape or tuple(t.stride()) != stride or t.dtype != dtype
                    or t.storage_offset() != 0 or t.untyped_storage()._cdata not in self.owner_of):
                del self.fakes[name]
                if self.values[name].storage == name:
                    # Views of it must not outlive their storage's new identity.
                    st = self.storages.pop(name, None)
                    if st is not None:
                        self.owner_of.pop(st._cdata, None)
                    for other in [o for o in self.fakes if self.values[o].storage == name]:
                        del self.fakes[other]

    def convert(self, a, env: dict):
        torch = self.torch
        if isinstance(a, Ref):
            t = env.get(a.name)
            if t is None:
                t = env[a.name] = self.fake(a.name)
            return t
        if isinstance(a, Seq):
            return [self.convert(x, env) for x in a.items]
        if isinstance(a, (DType, Layout, MemoryFormat)):
            got = getattr(torch, a.name, None)
            kind = {DType: torch.dtype, Layout: torch.layout, MemoryFormat: torch.memory_format}[type(a)]
            if not isinstance(got, kind):
                raise _Unconvertible(f"torch.{a.name} is not a {kind.__name__}")
            return got
        if isinstance(a, Device):
            problem = device_problem(a.name)
            if problem:
                raise _Unconvertible(f"device({a.name}): {problem}")
            return torch.device(a.name)
        if isinstance(a, Special):
            try:
                return float(a.name)
            except ValueError:
                raise _Unconvertible(f"{a.name!r} is not inf, -inf or nan") from None
        return a

    def check_outputs(self, loc: Loc, n, op) -> None:
        if any(arg_depth(a, MAX_NESTING) > MAX_NESTING for a in list(n.args) + list(n.kwargs.values())):
            return  # the verifier reports it (and `convert` recurses)
        refs = [r for a in list(n.args) + list(n.kwargs.values()) for r in arg_refs(a)]
        if not all(self.valid(r) for r in refs):
            return  # the verifier reports the undeclared or malformed operand
        env: dict = {}
        try:
            args = [self.convert(a, env) for a in n.args]
            kwargs = {k: self.convert(a, env) for k, a in n.kwargs.items()}
        except _Unconvertible as e:
            self.err(loc, f"node {n.name}: an argument of {n.op} cannot be made: {e}")
            return
        try:
            results = self.run_op(loc, n, op, refs, args, kwargs)
        finally:
            self.evict_changed(env)
        if results is not None:
            self.check_scalars(loc, n, op, results)

    def run_op(self, loc: Loc, n, op, refs: list, args: list, kwargs: dict) -> list | None:
        """Run the op on the fakes; its results, or None when it cannot run
        (reported)."""
        ft = self.ft
        try:
            result = op(*args, **kwargs)
        except (ft.DynamicOutputShapeException, ft.DataDependentOutputException) as e:
            self.err(loc, f"node {n.name}: the output of {n.op} depends on the data, which a static plan "
                          f"cannot hold ({type(e).__name__}); its outputs cannot be checked")
            return None
        except ft.UnsupportedOperatorException as e:
            self.err(loc, f"node {n.name}: {n.op} cannot run under FakeTensorMode in this PyTorch build "
                          f"({_first_line(e)}), so its outputs cannot be checked")
            return None
        except Exception as e:
            sig = ", ".join(f"{r} {_type(self.values[r].dtype, self.values[r].shape)}"
                            for r in dict.fromkeys(refs))
            self.err(loc, f"node {n.name}: {n.op} cannot run on the declared operands"
                          f"{' (' + sig + ')' if sig else ''}: {_first_line(e)}")
            return None
        torch = self.torch
        results = list(result) if isinstance(result, (tuple, list)) else ([] if result is None else [result])
        if len(n.outputs) > len(results):
            self.err(loc, f"node {n.name} has {len(n.outputs)} outputs, but {n.op} returns "
                          f"{len(results)}")
        fresh: dict[int, str] = {}  # storage id -> the first output of this node that owns it
        for k, (name, got) in enumerate(zip(n.outputs, results)):
            if not name:
                continue
            v = self.values.get(name)
            if v is None or not self.valid(name):
                continue  # reported by the verifier
            vloc = ("values", self.value_index[name], v.line or n.line)
            if not isinstance(got, torch.Tensor):
                what = "nothing" if got is None else f"a {type(got).__name__}, not a tensor"
                self.err(vloc, f"{name} is output {k} of {n.name}, but {n.op} returns {what} there")
                continue
            gtype = str(got.dtype).removeprefix("torch.")
            gshape = list(got.shape)
            if (gtype, gshape) != (v.dtype, list(v.shape)):
                self.err(vloc, f"{name} is declared {_type(v.dtype, v.shape)}, but {n.op} (node {n.name}) "
                               f"returns {_type(gtype, gshape)}")
                continue
            gstride = list(got.stride())
            if _significant_strides(gshape, gstride) != _significant_strides(v.shape, v.stride):
                self.err(vloc, f"{name} is declared with stride {list(v.stride)}, but {n.op} (node {n.name}) "
                               f"returns stride {gstride}")
            st = got.untyped_storage()
            sid = st._cdata
            owner = self.owner_of.get(sid) or fresh.get(sid)
            if owner is None:
                fresh[sid] = name
                nbytes = int(st.nbytes())
                if v.storage != v.name:
                    self.err(vloc, f"{name} is declared a view of {v.storage}, but {n.op} (node {n.name}) "
                                   f"returns a new storage of {nbytes} bytes: write `{nbytes} bytes` "
                                   f"instead of `view of {v.storage}`")
                elif v.nbytes != nbytes:
                    self.err(vloc, f"{name} is declared with {v.nbytes} bytes of storage, but {n.op} "
                                   f"(node {n.name}) allocates {nbytes} bytes")
            elif v.storage != owner:
                if v.storage == v.name:
                    self.err(vloc, f"{name} is declared with a storage of its own ({v.nbytes} bytes), but "
                                   f"{n.op} (node {n.name}) returns a view of {owner}: write "
                                   f"`view of {owner}`")
                else:
                    self.err(vloc, f"{name} is declared a view of {v.storage}, but {n.op} (node {n.name}) "
                                   f"returns a view of {owner}")
        return results

    # ------------------------------------------------------ literal scalars

    def check_scalars(self, loc: Loc, n, op, results: list) -> None:
        """The literal numbers of a node the kernel checks and the fake run
        does not: a probability outside [0, 1], a fill value the output's
        dtype cannot hold, and (on CPU plans) whatever the CPU kernel of a
        pointwise op refuses of its scalars (an integer divided by 0, raised
        to a negative power, clamped at 2**63)."""
        torch = self.torch
        self.check_output_mask(loc, n, op, results)
        at = _PROBABILITY.get(n.op)
        if at is not None:
            p = _literal(_arg_at(n, *at))
            train = _arg_at(n, 2, "train") if n.op == "aten.native_dropout.default" else True
            if p is not None and train is not False and not 0 <= p <= 1:
                self.err(loc, f"node {n.name}: {n.op} takes a probability p in [0, 1], but p is {p!r}; the "
                              f"kernel refuses it when the plan runs")
            return
        at = _FILL.get(n.op)
        if at is not None:
            value = _literal(_arg_at(n, *at))
            v = self.values.get(n.outputs[0]) if n.outputs and n.outputs[0] else None
            dtype = getattr(torch, v.dtype, None) if v is not None else None
            if value is None or not isinstance(dtype, torch.dtype):
                return
            with self.ft.unset_fake_temporarily():
                try:
                    torch.empty(2, dtype=dtype).fill_(value)
                except Exception as e:  # noqa: BLE001 - what the kernel says is the diagnostic
                    self.err(loc, f"node {n.name}: {n.op} fills a tensor of {v.dtype} with {value!r}, which "
                                  f"{v.dtype} cannot hold ({_first_line(e)}); the kernel refuses it when "
                                  f"the plan runs")
            return
        if self.device.type == "cpu" and torch.Tag.pointwise in op.tags \
                and torch.Tag.nondeterministic_seeded not in op.tags:
            self.probe_pointwise(loc, n, op)

    def check_output_mask(self, loc: Loc, n, op, results: list) -> None:
        """A backward op's `output_mask` (native_batch_norm_backward,
        convolution_backward, ...): where it is false, the kernel returns no
        tensor (None), while the fake run returns one all the same; a node
        naming an output there would hand None to its readers."""
        for k, a in enumerate(op._schema.arguments):
            if a.name != "output_mask":
                continue
            mask = n.args[k] if len(n.args) > k else n.kwargs.get(a.name)
            if not isinstance(mask, Seq):
                continue
            for i, item in enumerate(mask.items):
                value = _literal(item)
                off = item is None or (value is not None and not value)
                if off and i < len(n.outputs) and n.outputs[i] and i < len(results) and results[i] is not None:
                    shown = "none" if item is None else "false" if item is False else repr(item)
                    self.err(loc, f"node {n.name}: output_mask[{i}] of {n.op} is {shown}, so the kernel "
                                  f"returns no output {i} (None), but the node names it {n.outputs[i]}; "
                                  f"write `_` for that output, or true in the mask")

    def probe_pointwise(self, loc: Loc, n, op) -> None:
        """Run a pointwise op with literal numbers for real, on two-element
        tensors of ones of its operands' declared dtypes: its CPU kernel
        checks the scalars (their values, against those dtypes) as at run
        time, which the fake run does not.  Shapes do not matter to a
        pointwise op; the data (ones) divides and raises to any power."""
        torch = self.torch
        items = list(n.args) + list(n.kwargs.values())
        if not any(_literal(a) is not None for a in items) or any(isinstance(a, Seq) for a in items):
            return

        def real(a):
            if isinstance(a, Ref):
                return torch.ones(2, dtype=getattr(torch, self.values[a.name].dtype))
            if isinstance(a, Special):
                return float(a.name)
            if isinstance(a, (DType, Layout, MemoryFormat)):
                return getattr(torch, a.name)
            if isinstance(a, Device):
                return torch.device(a.name)
            return a

        with self.ft.unset_fake_temporarily():
            try:
                op(*[real(a) for a in n.args], **{k: real(a) for k, a in n.kwargs.items()})
            except Exception as e:  # noqa: BLE001 - what the kernel says is the diagnostic
                self.err(loc, f"node {n.name}: {n.op} refuses its arguments when the plan runs: "
                              f"{_first_line(e)} (the CPU kernel, run on two elements of the declared "
                              f"dtypes)")


# Ops whose kernel checks a probability argument the fake run does not:
# op -> (index, name) of `p`.
_PROBABILITY = {
    "aten.bernoulli_.float": (1, "p"),
    "aten.bernoulli.p": (1, "p"),
    "aten.native_dropout.default": (1, "p"),
    "remat.dropout_keep.default": (1, "p"),
}
# Ops that fill their output with a scalar the kernel converts to the
# output's dtype, refusing one it cannot hold (300 in uint8, 2**63 in int64,
# 1e10 in float16, inf in an integer dtype): op -> (index, name) of the value.
# `empty(2, dtype).fill_(value)` makes exactly that check.
_FILL = {
    "aten.full.default": (1, "fill_value"),
    "aten.full_like.default": (1, "fill_value"),
    "aten.new_full.default": (2, "fill_value"),
    "aten.fill.Scalar": (1, "value"),
    "aten.fill_.Scalar": (1, "value"),
    "aten.masked_fill.Scalar": (2, "value"),
    "aten.masked_fill_.Scalar": (2, "value"),
}


def _arg_at(n, index: int, name: str):
    return n.args[index] if len(n.args) > index else n.kwargs.get(name)


def _literal(a):
    """A literal number argument as Python has it (a Special as its float),
    or None for anything else."""
    if isinstance(a, Special):
        try:
            return float(a.name)
        except ValueError:
            return None
    if isinstance(a, (bool, int, float)):
        return a
    return None
