"""Interpreter: run a program's schedule as a drop-in `nn.Module`.

`wrap(model, program)` returns a module whose forward runs the forward part of
the schedule; a plain `loss.backward()` runs the backward part.  The schedule
is compiled to straight-line Python (like `torch.fx` code generation) that
calls aten ops on a dict of live tensors, so each `free` is a `del` and the
tensors that exist are exactly the values the schedule says are live.

Parameter gradients go through autograd: the backward schedule is cut after
each instruction that produces gradients, and each piece is the backward of
its own `autograd.Function` whose inputs are those parameters.  Autograd
therefore accumulates `.grad` (and fires hooks, DDP buckets) as soon as a
gradient exists, the same moment eager PyTorch would.

`offload`, `reload` and `wait` call the step's `Transfers`
(`remat_ir.runtime.offload`): a value offloaded and waited leaves the
dictionary of live tensors, and comes back into it at its reload's wait.

This module must not import cvxpy: loading and running a plan needs only torch.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils import _pytree as pytree

from remat_ir import ir

from remat_ir.ir.ops import resolve  # (importing ops registers the remat.* ops that plans name)
from remat_ir.ir.guards import Guard, GuardError, failed_guard
from remat_ir.ir.specs import load_treespec
from remat_ir.ir import sizes as sz
from remat_ir.ir import (
    BUFFER, COMPUTE, FREE, GRAD, INPUT, OFFLOAD, PARAM, RECOMPUTE, RELOAD, RESULT, TANGENT, TRANSFER_INSTRS, WAIT,
    Program, hand_overs,
)
from remat_ir.runtime.offload import Transfers, copies_for
from remat_ir.runtime.bind import (
    LiveGuard, ModelGuard, PlanMismatch, autocast_differs, check_device, check_graph, check_header, check_parameters,
    check_sound, constants_differ, own_class,
)
from remat_ir.trace.calls import autocast_off, split_call
from remat_ir.trace.live import tracing


# ------------------------------------------------------------------ codegen


def resolve_op(name: str):
    """The torch op a plan names, or PlanMismatch when this PyTorch build has none by that name."""
    try:
        return resolve(name)
    except AttributeError as e:
        raise PlanMismatch(f"unknown op {name} in this PyTorch build") from e


_SPECIALS = ("inf", "-inf", "nan")


def _str(s) -> str:
    """A plan's string as a Python string literal (never anything else)."""
    if not isinstance(s, str):
        raise PlanMismatch(f"expected a string in the plan, found {type(s).__name__}")
    return str.__repr__(s)


def _float(x: float) -> str:
    """A float literal; `float('inf')` and the like for the others."""
    r = float.__repr__(x)
    return r if x == x and x not in (float("inf"), float("-inf")) else f"float({r!r})"


def _torch_constant(a):
    """torch.float32 / torch.strided / torch.contiguous_format for a DType,
    Layout or MemoryFormat argument, and nothing else torch has."""
    kind = {ir.DType: torch.dtype, ir.Layout: torch.layout, ir.MemoryFormat: torch.memory_format}[type(a)]
    obj = getattr(torch, a.name, None) if isinstance(a.name, str) else None
    if not isinstance(obj, kind):
        raise PlanMismatch(f"torch.{a.name} is not a {kind.__name__.removeprefix('torch.')} in this PyTorch build")
    return obj


class Executable:
    """A program compiled for execution: forward code and backward segments."""

    def __init__(self, program: Program):
        self.program = program
        self.values = program.value_map()
        self.nodes = program.node_map()
        self.consts: list = []  # ops and non-literal constants the code refers to
        self._const_ids: dict = {}
        recomputed = {i.target for i in program.backward + program.forward if i.kind == RECOMPUTE}
        self.replayed = [n for n in recomputed if self.nodes[n].random]
        self.results = [o.value for o in program.outputs if o.kind == RESULT]
        self.grad_outputs: dict[str, list[str]] = {}
        for o in program.outputs:
            if o.kind == GRAD:
                self.grad_outputs.setdefault(o.value, []).append(o.key)
        # (tangent value, index of the result it is the gradient of)
        self.tangents = [(v.name, int(v.source or 0)) for v in program.values if v.kind == TANGENT]
        self.params = [v for v in program.values if v.kind == PARAM]
        self.buffers = [v for v in program.values if v.kind == BUFFER]
        self.inputs = [v for v in program.values if v.kind == INPUT]
        # Offload: whether the plan moves values to the host, and which of its
        # `free`s drop a value on the host (its host buffer), by instruction.
        self.offloads = any(i.kind in TRANSFER_INSTRS for i in program.forward + program.backward)
        self.host_frees: set[int] = set()
        on_host: set[str] = set()
        copying: dict[str, str] = {}
        for ins in program.forward + program.backward:
            if ins.kind in (OFFLOAD, RELOAD):
                copying[ins.target] = ins.kind
                on_host.discard(ins.target)
            elif ins.kind == WAIT and copying.pop(ins.target, None) == OFFLOAD:
                on_host.add(ins.target)
            elif ins.kind == FREE and ins.target in on_host:
                on_host.discard(ins.target)
                self.host_frees.add(id(ins))

        self.forward_fn = self._compile("forward", program.forward, [])
        # Backward segments: cut after each instruction that hands gradients
        # over (the last write to their storage: `hand_overs`) and the frees
        # that follow it.  Those frees run before the gradients go to
        # autograd, so no other name still holds a gradient an in-place op
        # returned (`add_(e, f)` is `e`): autograd then takes its storage as
        # `.grad` instead of cloning it, as the simulator says.
        self.segments: list[tuple] = []  # (fn, [grad keys])
        handed = hand_overs(program)
        start = 0
        instrs = program.backward
        for i, ins in enumerate(instrs):
            if i < start:
                continue
            grads = [(v, k) for v in handed.get(i, ()) for k in self.grad_outputs[v]]
            if grads or i == len(instrs) - 1:
                end = i + 1
                while grads and end < len(instrs) and instrs[end].kind == FREE:
                    end += 1
                fn = self._compile(f"backward_{len(self.segments)}", instrs[start:end], grads)
                self.segments.append((fn, [k for _, k in grads]))
                start = end
        if start < len(instrs):
            fn = self._compile(f"backward_{len(self.segments)}", instrs[start:], [])
            self.segments.append((fn, []))
        if not self.segments:
            self.segments.append((self._compile("backward_0", [], []), []))

    def _const(self, obj) -> str:
        k = id(obj)
        if k not in self._const_ids:
            self._const_ids[k] = len(self.consts)
            self.consts.append(obj)
        return f"C[{self._const_ids[k]}]"

    # Generated code holds no plan text but string literals written by
    # `str.__repr__`: value names, keyword argument names (the keys of a dict
    # literal, passed as `**{...}`) and string arguments.  Everything else is a
    # literal number or a constant from `C` (ops, dtypes, devices, any other
    # object), so no plan, checked or not, can put code into it.

    def _expr(self, a, depth: int = 0) -> str:
        if a is None or a is True or a is False:
            return repr(a)
        t = type(a)
        if t is ir.Ref:
            return f"E[{_str(a.name)}]"
        if t is ir.Seq:
            if depth == ir.MAX_NESTING:  # (a plan run unverified: the verifier refuses it)
                raise PlanMismatch(f"an argument has lists nested more than {ir.MAX_NESTING} deep")
            return "[" + ", ".join(self._expr(x, depth + 1) for x in a.items) + "]"
        if t is ir.DType or t is ir.Layout or t is ir.MemoryFormat:
            return self._const(_torch_constant(a))
        if t is ir.Device:
            return self._const(torch.device(a.name))
        if t is ir.Sym:
            try:
                return sz.python_code(a.expr, "S")  # (from the checked expression tree, never the text)
            except sz.SizeError as e:
                raise PlanMismatch(str(e)) from None
        if t is ir.Special:
            if a.name not in _SPECIALS:
                raise PlanMismatch(f"unknown special float {a.name!r} (expected inf, -inf or nan)")
            return f"float({_str(a.name)})"
        if t is int:
            return int.__repr__(a)
        if t is float:
            return _float(a)
        if t is str:
            return _str(a)
        return self._const(a)

    def _call(self, node) -> str:
        op = self._const(resolve_op(node.op))
        args = [self._expr(a) for a in node.args]
        if node.kwargs:
            args.append("**{" + "".join(f"{_str(k)}: {self._expr(v)}, " for k, v in node.kwargs.items()) + "}")
        return f"{op}({', '.join(args)})"

    def _compile(self, name: str, instrs, grads):
        body: list[str] = []
        replay = set(self.replayed)
        for ins in instrs:
            if ins.kind == FREE:
                if id(ins) in self.host_frees:
                    body.append(f"X.free({_str(ins.target)})")
                else:
                    body.append(f"del E[{_str(ins.target)}]")
                continue
            if ins.kind == OFFLOAD:
                body.append(f"X.offload({_str(ins.target)}, E[{_str(ins.target)}])")
                continue
            if ins.kind == RELOAD:
                body.append(f"X.reload({_str(ins.target)})")
                continue
            if ins.kind == WAIT:
                body.append(f"X.wait({_str(ins.target)}, E)")
                continue
            node = self.nodes[ins.target]
            call = self._call(node)
            if node.random and node.name in replay:
                if ins.kind == COMPUTE:
                    body.append(f"R[{_str(node.name)}] = get_rng()")
                else:
                    body.append(f"_s = get_rng(); set_rng(R[{_str(node.name)}])")
            outs = node.outputs
            if len(outs) == 1 and self._single_output(node):
                body.append(f"E[{_str(outs[0])}] = {call}")
            else:
                body.append(f"_r = {call}")
                for k, out in enumerate(outs):
                    if out:
                        body.append(f"E[{_str(out)}] = _r[{k}]")
                body.append("del _r")
            if node.random and node.name in replay and ins.kind == RECOMPUTE:
                body.append("set_rng(_s); del _s")
        # Hand gradients over: popped so autograd holds the only reference.
        if grads:
            body.append("return (" + "".join(f"E.pop({_str(v)}), " for v, _ in grads) + ")")
        else:
            body.append("return ()")
        src = f"def {name}(E, R, C, S, X, get_rng, set_rng):\n" + "".join(f"    {ln}\n" for ln in body)
        scope: dict = {}
        exec(compile(src, f"<remat-ir {name}>", "exec"), scope)
        fn = scope[name]
        fn.source = src
        return fn

    def _single_output(self, node) -> bool:
        op = resolve_op(node.op)
        rets = op._schema.returns
        return len(rets) == 1 and not str(rets[0].type).endswith("[]")


# ------------------------------------------------------------- autograd glue


class _State:
    """Live tensors of one step, shared by the pieces of its autograd graph."""

    def __init__(self, exe: Executable, device: torch.device, copies=None):
        self.exe = exe
        self.env: dict[str, torch.Tensor] = {}
        self.rng: dict[str, torch.Tensor] = {}
        self.next_segment = 0
        self.device = device
        # The step's offloaded values (`copies`: the device's copy engine, kept by the runner).
        self.transfers = Transfers(copies, device) if copies is not None else None
        self.sizes: dict[str, int] = {}  # a symbolic plan's sizes in this step
        if device.type == "cuda":
            self.get_rng = lambda: torch.cuda.get_rng_state(device)
            self.set_rng = lambda s: torch.cuda.set_rng_state(s, device)
        else:
            self.get_rng = torch.get_rng_state
            self.set_rng = torch.set_rng_state

    def run(self, fn):
        # The plan's ops carry the casts of the autocast it was traced under:
        # an outer autocast must not cast them again.
        with autocast_off((self.device.type,)):
            return fn(self.env, self.rng, self.exe.consts, self.sizes, self.transfers, self.get_rng, self.set_rng)


def _token(device) -> torch.Tensor:
    # A zero-size tensor chaining the pieces in autograd; it owns no memory.
    return torch.empty(0, device=device)


def _no_create_graph() -> None:
    """Refuse a backward that is to be differentiated again: the plan's
    backward runs outside autograd, so its gradients would come back without
    a graph (a gradient penalty would add nothing)."""
    if torch.is_grad_enabled():
        raise RuntimeError("remat-ir: a planned step's backward cannot be differentiated again "
                           "(autograd.grad(..., create_graph=True) or backward(create_graph=True)): its "
                           "gradients would come back without a graph; run the step that needs create_graph "
                           "under `with remat_ir.eager(model):`, which runs the model's own forward")


class _Head(torch.autograd.Function):
    """Runs the forward schedule; its backward receives the tangents."""

    @staticmethod
    def forward(ctx, state: _State, token):
        exe = state.exe
        state.run(exe.forward_fn)
        ctx.state = state
        # Detached so the environment holds no tensor whose grad_fn points
        # back at this node (a reference cycle through C++).
        outs = tuple(state.env[r].detach() for r in exe.results)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        exe = state.exe
        _no_create_graph()
        if state.next_segment != 0:
            raise RuntimeError("remat-ir: backward through a wrapped step can run only once "
                               "(retain_graph / double backward is not supported)")
        for name, i in exe.tangents:
            g = grads[i]
            state.env[name] = g if g is not None else torch.zeros_like(state.env[exe.results[i]])
        del grads
        return None, _token(state.device)


class _Segment(torch.autograd.Function):
    """Runs one piece of the backward schedule and returns its gradients."""

    @staticmethod
    def forward(ctx, state: _State, index: int, token, *tensors):
        ctx.state = state
        ctx.index = index
        return _token(token.device)

    @staticmethod
    def backward(ctx, token_grad):
        state = ctx.state
        _no_create_graph()
        if state.next_segment != ctx.index:
            raise RuntimeError("remat-ir: backward pieces ran out of order")
        fn, _ = state.exe.segments[ctx.index]
        grads = state.run(fn)
        state.next_segment += 1
        if state.next_segment == len(state.exe.segments):
            state.env.clear()
            state.rng.clear()
            if state.transfers is not None:
                state.transfers.clear()
        return (None, None, _token(state.device), *grads)


# ------------------------------------------------------------------ wrapper


# A training step by a plan is one opaque region to torch.compile: dynamo
# must neither run the planning (tracing under fake tensors inside dynamo's
# own tracing, the optimizer's C extensions) nor trace the plan's generated
# code and autograd pieces; it compiles what is around the wrapper, and the
# model's eager (eval, no_grad) calls.  torch.compiler.disable would import
# dynamo when this module is imported (over a second); torch's own lazy form
# imports it at the first call, and dynamo skips it (torch._compile is in its
# skip list), running the step with dynamo off throughout.
opaque_to_dynamo = getattr(torch, "_disable_dynamo", None) or (lambda fn: torch.compiler.disable(fn))


def eager_step(model, loss_fn, args: tuple, kwargs: dict):
    """What the step is without a plan: the model, then the loss if any."""
    out = model(*args, **kwargs)
    return loss_fn(out, *args, **kwargs) if loss_fn is not None else out


def runs_plan(model: torch.nn.Module) -> bool:
    """Whether a call of `model` is a training step, the plan's to run.  The
    wrapped model's own mode decides (a wrapper's may differ from it when
    the model was put in eval() on its own)."""
    return model.training and torch.is_grad_enabled()


class PlanRunner:
    """A plan bound to a model: checked once, compiled once, run per step.

    `check_plan=False` skips the verifier for a plan the pipeline has just
    verified; `check_model=False` skips the retrace (see `wrap`)."""

    def __init__(self, model: torch.nn.Module, program: Program, loss_fn=None, *, check_model: bool = True,
                 check_plan: bool = True):
        check_parameters(model, program)
        if program.header.has_loss and loss_fn is None:
            raise PlanMismatch("this plan includes a loss function: pass it as wrap(model, plan, loss=fn)")
        if check_plan:
            check_sound(program)
        check_device(program)
        check_header(program)
        self.live_reads: list = []  # what the model's check read of its Python state
        if check_model:
            check_graph(model, program, loss_fn, self.live_reads)
        self.program = program
        self.loss_fn = loss_fn
        self._build()

    def _build(self) -> None:
        program = self.program
        self.exe = exe = Executable(program)
        spec = program.header.output_spec
        self.output_spec = load_treespec(spec) if spec else None
        # Which parameters each backward piece produces gradients for.
        self.seg_keys = [keys for _, keys in exe.segments]
        self.input_names = [v.source or v.name for v in exe.inputs]
        self.symbolic = sz.is_symbolic(program)
        self._peaks: dict[tuple, tuple[int, int]] = {}  # (sizes, .grad present) -> peaks
        self.param_types = [(v, getattr(torch, v.dtype), torch.Size(v.shape)) for v in exe.params]
        try:
            self.guards = [Guard(g) for g in program.header.guards]
        except GuardError as e:
            raise PlanMismatch(str(e), program.header.lines.get("guards", 0)) from None

    def copies(self, device: torch.device):
        """The copy engine of `device` for a plan that offloads: made at the
        first step on it and kept (on CUDA its pool of pinned buffers is
        reused by every step)."""
        found = self.__dict__.setdefault("_copies", {})
        if device not in found:
            found[device] = copies_for(device)
        return found[device]

    # The compiled code is generated Python, which pickle cannot hold: a
    # pickled runner keeps the plan and compiles it again when loaded.
    def __getstate__(self):
        return {"program": self.program, "loss_fn": self.loss_fn, "live_reads": []}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._build()

    def accepts(self, call) -> str:
        """Why `call` (a `remat_ir.trace.calls.Call`) cannot run this plan, or ""."""
        return self.sizes_of(call)[1]

    def sizes_of(self, call) -> tuple[dict[str, int], str]:
        """(the sizes of a symbolic plan's symbols in `call`, why the call
        cannot run this plan or "")."""
        got = dict(zip(call.names, call.tensors))
        if sorted(got) != sorted(self.input_names):
            missing = [n for n in self.input_names if n not in got]
            extra = [n for n in call.names if n not in self.input_names]
            what = ([f"no tensor for {', '.join(missing)} (None or not given)"] if missing else []) + (
                [f"a tensor for {', '.join(extra)}, which the plan was made without (None or not given)"]
                if extra else [])
            return {}, (f"the plan takes the tensors {', '.join(self.input_names) or '(none)'}; this call passes "
                        + " and ".join(what))
        for v, name in zip(self.exe.inputs, self.input_names):
            x = got[name]
            if str(x.dtype) != "torch." + v.dtype or (not self.symbolic and list(x.shape) != v.shape):
                return {}, (f"input {name}: the plan was compiled for {v.dtype}{_shape_text(v.shape)}, got "
                            f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
        sizes: dict[str, int] = {}
        if self.symbolic:
            sizes, why = sz.bind_inputs(self.program, {n: t.shape for n, t in got.items()})
            why = why or sz.check_sizes(self.program, sizes)
            if why:
                return {}, why
            for v, name in zip(self.exe.inputs, self.input_names):
                # The plan's ops were traced for inputs laid out so (contiguous, mostly).
                want = [sz.evaluate(x, sizes) for x in v.stride]
                x = got[name]
                if x.dim() and list(x.stride()) != want:
                    return {}, f"input {name}: the plan takes strides {want} at these sizes, got {list(x.stride())}"
        return sizes, (constants_differ(self.program.header.constants, call)
                       or autocast_differs(self.program.header.autocast, call.autocast))

    def peak(self, sizes: dict[str, int], grads_present: bool | None = None) -> tuple[int, int]:
        """(the predicted peak, the peak in the budget's scope) of a step at
        `sizes` (a plan without symbols: {}), with the parameters' `.grad`
        present before it or not (None: the larger of the two, as the
        verifier checks a budget).  Computed once per size, by the
        simulator on that size's program."""
        if grads_present is None:
            a, b = self.peak(sizes, True), self.peak(sizes, False)
            return max(a[0], b[0]), max(a[1], b[1])
        key = (tuple(sorted(sizes.items())), grads_present)
        if key not in self._peaks:
            from remat_ir.check.simulate import simulate

            program = sz.instantiate(self.program, sizes, refingerprint=False) if self.symbolic else self.program
            report = simulate(program, grads_present=grads_present, top_k=0)
            scope = self.program.header.budget.scope if self.program.header.budget else "total"
            self._peaks[key] = (report.peak_bytes, report.scope_peak(scope))
        return self._peaks[key]

    def failed_guard(self, model: torch.nn.Module, call) -> str:
        """Which of the plan's guards `call` breaks (the model's code would take
        another path on its values), in words, or ""."""
        if not self.guards:
            return ""
        got = dict(zip(call.names, call.tensors))
        sizes = self.sizes_of(call)[0] if self.symbolic else {}

        def leaf(kind, name):
            if kind == "size":
                return sz.evaluate(name, sizes)
            return got[name] if kind == "input" else model.get_buffer(name)

        return failed_guard(self.guards, leaf)

    def run(self, model: torch.nn.Module, call, *, guards_checked: bool = False):
        """One training step of `model` on `call`, by the plan."""
        exe = self.exe
        by_name = {}
        for v, dtype, shape in self.param_types:
            p = model.get_parameter(v.source)
            if p.dtype != dtype or p.shape != shape:
                # After wrapping, e.g. `.double()` or `.half()`: the plan's ops would meet
                # tensors of other dtypes deep in generated code.
                raise PlanMismatch(f"parameter {v.source} is {str(p.dtype).removeprefix('torch.')}"
                                   f"{list(p.shape)} but the plan was compiled for {v.dtype}{v.shape}; "
                                   "convert the model before wrapping it, or compile a plan for it as it is now")
            by_name[v.name] = p
        sizes, problem = self.sizes_of(call)
        problem = problem or (not guards_checked and self.failed_guard(model, call))
        if problem:
            raise PlanMismatch(f"{problem}; compile a plan for this call")
        budget = self.program.header.budget
        if self.symbolic and budget is not None:
            # A verified plan fits at both ends of its range; each size between them is checked too.
            grads = any(p.grad is not None for p in by_name.values() if p.requires_grad)
            peak = self.peak(sizes, grads)[1]
            if peak > budget.bytes:
                raise PlanMismatch(f"at {_sizes_text(sizes)} the plan's peak ({budget.scope}) is {peak} bytes, "
                                   f"over its budget of {budget.bytes} bytes; compile a plan for this call")
        got = dict(zip(call.names, call.tensors))
        device = call.tensors[0].device if call.tensors else next(model.parameters()).device
        want = self.program.header.device
        if torch.device(want).type != device.type:
            raise PlanMismatch(f"the plan was compiled for device {want}, but the step runs on {device}; "
                               f"recompile with --device {device.type}")
        for v in exe.buffers:
            by_name[v.name] = model.get_buffer(v.source)
        for v, name in zip(exe.inputs, self.input_names):
            by_name[v.name] = got[name]
        state = _State(exe, device, self.copies(device) if exe.offloads else None)
        state.sizes = sizes
        env = state.env
        # Graph inputs enter the environment detached: autograd sees them only
        # through the pieces below.
        for name, t in by_name.items():
            env[name] = t.detach()
        # The chain starts at a leaf that requires grad, so every piece runs
        # in backward even when it yields no gradient.
        token = torch.empty(0, device=device, requires_grad=True)
        for k in reversed(range(len(exe.segments))):
            leaves = [by_name[key] for key in self.seg_keys[k]]
            token = _Segment.apply(state, k, token, *leaves)
        outs = _Head.apply(state, token)
        if self.output_spec is not None:
            return pytree.tree_unflatten(list(outs), self.output_spec)
        return outs[0] if len(outs) == 1 else outs


def _shape_text(shape) -> str:
    return "[" + ", ".join(sz.size_text(d) for d in shape) + "]"


def _sizes_text(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


class WrappedModule(torch.nn.Module):
    """What every wrapper of a model shares: training steps (the model in
    train mode, grad enabled) go to `step`, other calls run the model
    eagerly; `forward` shows the model's own signature (so tools that read
    it, like transformers' Trainer, see the model's arguments); attributes
    the wrapper lacks are the model's (`wrapper.config`); and it pickles and
    deep-copies without its compiled code, which is made again from the plan."""

    def __init__(self, model: torch.nn.Module, loss_fn=None):
        super().__init__()
        self.module = model
        self.loss_fn = loss_fn
        _show_signature(self)

    def step(self, call):
        raise NotImplementedError

    def forward(self, *args, **kwargs):
        if not runs_plan(self.module):
            return eager_step(self.module, self.loss_fn, args, kwargs)
        return self._planned_step(args, kwargs)

    @opaque_to_dynamo
    def _planned_step(self, args, kwargs):
        # While the step is planned and run, a call of the adopted model (the
        # trace's) is the model's own.
        with _counting(self, "_busy"):
            return self.step(split_call(self.module, args, kwargs))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name.startswith("__"):
                raise
            return getattr(inner, name)

    def __getstate__(self):
        import pickle

        try:
            pickle.dumps(self.loss_fn)
        except Exception as e:  # noqa: BLE001 - whatever pickle says, say what to save instead
            raise TypeError(f"cannot pickle the wrapped model: its loss function {self.loss_fn!r} cannot be "
                            f"pickled ({e}); save the model's state_dict() (or remat_ir.unwrap(model) first) "
                            "and wrap it again after loading") from None
        state = self.__dict__.copy()
        for k in ("forward", "_busy", "_in_eager"):  # (a copy made inside a step or eager() is not in one)
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        _show_signature(self)
        if self.__dict__.get("_adopts"):  # (a copy of an adopted model: the copy is adopted too)
            model = self.module
            model.__class__ = _adopted_class(own_class(model))

    def __deepcopy__(self, memo):
        import copy

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()
                          if k not in ("forward", "_busy", "_in_eager")})
        return new


def _show_signature(wrapper: WrappedModule) -> None:
    """Give `wrapper.forward` the wrapped model's signature.  Per instance,
    so it is a function in the instance's dict (not pickled: see above)."""
    import inspect

    try:
        sig = inspect.signature(wrapper.module.forward)
    except (TypeError, ValueError):
        return
    cls_forward = type(wrapper).forward

    def forward(*args, **kwargs):
        return cls_forward(wrapper, *args, **kwargs)

    forward.__signature__ = sig
    forward.__doc__ = cls_forward.__doc__
    wrapper.__dict__["forward"] = forward


# ------------------------------------------------------------ adoption


class Adopted:
    """The mixin of an adopted model's class (see `adopt`): a training call
    goes to the model's planner, anything else (and the planner's own calls)
    to the model's class as it was.  Pickled or deep-copied, the model is
    saved as its own class and its copy adopted again.  (No `__slots__`:
    with them the class's layout would differ from the model's.)"""

    def __call__(self, *args, **kwargs):
        planner = self.__dict__.get("_remat_ir")
        # Its own forward also while remat-ir traces a step (the model called inside another one,
        # compile()), and on a shallow copy that shares the planner (DataParallel's replicas).
        if planner is None or planner.__dict__.get("_busy") or tracing() or planner.module is not self:
            return super().__call__(*args, **kwargs)
        if not runs_plan(self) or planner.__dict__.get("_in_eager"):  # (with the loss wrap() was given)
            return eager_step(super().__call__, planner.loss_fn, args, kwargs)
        return planner._planned_step(args, kwargs)

    def __reduce_ex__(self, protocol):
        import copyreg

        rv = super().__reduce_ex__(protocol)
        func, args = rv[0], rv[1]
        if args and args[0] is type(self):
            # (pickle refuses __newobj__ of another class than the object's: a function of our own)
            rv = (_instance_of if func is copyreg.__newobj__ else func, (type(self)._remat_base, *args[1:]),
                  *rv[2:])
        return rv


def _instance_of(cls, *args):
    return cls.__new__(cls, *args)


_ADOPTED: dict[type, type] = {}


def _adopted_class(base: type) -> type:
    """`base` with training calls by a plan: same name, module and qualified
    name, a subclass (`isinstance` holds), made once per class, as FSDP2's
    `fully_shard` makes `FSDP<Class>`."""
    cls = _ADOPTED.get(base)
    if cls is None:
        cls = type(base.__name__, (Adopted, base), {"__module__": base.__module__,
                                                    "__qualname__": base.__qualname__, "_remat_base": base})
        _ADOPTED[base] = cls
    return cls


def adopt(model: torch.nn.Module, planner: WrappedModule) -> torch.nn.Module:
    """`model` itself, its training calls run by `planner` from now on: its
    class becomes `_adopted_class` of its own (nothing else of it changes:
    its state_dict keys, forward signature, attributes, hooks and methods are
    its own) and the planner is kept in its `__dict__` (not a submodule: no
    state_dict key, not moved by `.to()`).  A model adopted already is
    adopted by the new planner.  `unwrap` undoes it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"remat-ir adopts a torch.nn.Module, not {type(model).__name__}")
    model.__class__ = _adopted_class(own_class(model))
    model.__dict__["_remat_ir"] = planner
    planner.__dict__["_adopts"] = True
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """`model` as it was before `remat_ir.wrap`: its own class, no planner
    (plans made are dropped; a unit of a sharded model gets its forward
    back).  A model never wrapped is returned as it is."""
    planner = model.__dict__.pop("_remat_ir", None)
    model.__class__ = own_class(model)
    if planner is not None:
        planner.__dict__["_adopts"] = False
        for unit in getattr(planner, "units", ()):
            unit.unit.__dict__.pop("forward", None)
    return model


@contextlib.contextmanager
def eager(model: torch.nn.Module):
    """Within it, calls of an adopted `model` run its own forward, training
    steps included (a step to differentiate twice, a debugging run)."""
    p = planner(model)
    with _counting(p, "_in_eager") if p is not None else contextlib.nullcontext():
        yield model


@contextlib.contextmanager
def _counting(planner: WrappedModule, key: str):
    """`planner.__dict__[key]` one higher while inside (nested calls stack)."""
    planner.__dict__[key] = planner.__dict__.get(key, 0) + 1
    try:
        yield
    finally:
        planner.__dict__[key] -= 1


def planner(model: torch.nn.Module):
    """The planner of an adopted model (its `plans`, `plan_of`, `solves`), or None."""
    return model.__dict__.get("_remat_ir") if isinstance(model, torch.nn.Module) else None


class RematModule(WrappedModule):
    """`model` run by a plan.  Training steps (the model in train mode, grad
    enabled) follow the plan; evaluation and `no_grad` calls run the model
    eagerly.  Positional and keyword arguments are taken as the model takes
    them, and the model's output structure (a tuple, a dict, a transformers
    ModelOutput) comes back."""

    def __init__(self, model: torch.nn.Module, program: Program, loss_fn=None, check_model: bool = True,
                 *, check_plan: bool = True):
        runner = PlanRunner(model, program, loss_fn, check_model=check_model, check_plan=check_plan)
        super().__init__(model, loss_fn)
        self.runner = runner
        self.program = program
        self._model_guard = ModelGuard(model)
        self._live_guard = LiveGuard(runner.live_reads, model)

    def step(self, call):
        if "_model_guard" not in self.__dict__:  # (pickled before there were guards)
            self._model_guard = ModelGuard(self.module)
        if "_live_guard" not in self.__dict__:
            self._live_guard = LiveGuard([], self.module)
        changed = self._model_guard.changes(self.module) or self._live_guard.changes(self.module)
        if changed:
            more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
            raise PlanMismatch(f"{'; '.join(changed[:3])}{more} since the plan was bound; wrap the model "
                               "again (remat_ir.wrap(model, plan)), which checks the plan against the model as "
                               "it is now, or compile a plan for it")
        return self.runner.run(self.module, call)


def wrap(model: torch.nn.Module, program: Program, loss=None, *, check_model: bool = True) -> torch.nn.Module:
    """`model` itself, adopted (`adopt`): its training steps run by
    `program` from now on; `loss` is the loss function when the plan
    includes one.

    Refuses (PlanMismatch) a plan made for other parameters, an unsound plan,
    and, unless `check_model=False`, a plan whose graph the model no longer
    produces (the step is traced again under fake tensors: see
    `remat_ir.runtime.bind`).  At each training step it refuses a call whose
    tensors are not the plan's (other names, shapes or dtypes, a tensor where
    the plan had None), a model whose parameters changed dtype since, and one
    changed since in what `remat_ir.runtime.bind.ModelGuard` watches (a
    submodule replaced, a parameter or buffer object replaced, requires_grad
    or a submodule's train/eval mode changed), naming the change."""
    # (Its checks trace the model's own forward, adopted or not: see `Adopted.__call__`.)
    return adopt(model, RematModule(model, program, loss, check_model))
