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

This module must not import cvxpy: loading and running a plan needs only torch.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from remat_ir import ir

from remat_ir.ir import ops  # noqa: F401 - registers the remat.* ops that plans name
from remat_ir.ir import COMPUTE, FREE, GRAD, INPUT, PARAM, BUFFER, RECOMPUTE, RESULT, TANGENT, Program
from remat_ir.runtime.bind import PlanMismatch, check_graph, check_parameters, check_sound


# ------------------------------------------------------------------ codegen


def _resolve_op(name: str):
    ns, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except AttributeError as e:
        raise PlanMismatch(f"unknown op {name} in this PyTorch build") from e


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

        self.forward_fn = self._compile("forward", program.forward, [])
        # Backward segments: cut after each instruction that yields gradients.
        self.segments: list[tuple] = []  # (fn, [grad keys])
        start = 0
        instrs = program.backward
        for i, ins in enumerate(instrs):
            keys = self._grad_keys(ins)
            if keys or i == len(instrs) - 1:
                grads = [(self._grad_value(ins, k), k) for k in keys]
                fn = self._compile(f"backward_{len(self.segments)}", instrs[start:i + 1], grads)
                self.segments.append((fn, [k for _, k in grads]))
                start = i + 1
        if not self.segments:
            self.segments.append((self._compile("backward_0", [], []), []))

    def _grad_keys(self, ins) -> list[str]:
        if ins.kind not in (COMPUTE, RECOMPUTE):
            return []
        return [k for out in self.nodes[ins.target].outputs if out in self.grad_outputs
                for k in self.grad_outputs[out]]

    def _grad_value(self, ins, key) -> str:
        for out in self.nodes[ins.target].outputs:
            if key in self.grad_outputs.get(out, ()):
                return out
        raise AssertionError(key)

    def _const(self, obj) -> str:
        k = id(obj)
        if k not in self._const_ids:
            self._const_ids[k] = len(self.consts)
            self.consts.append(obj)
        return f"C[{self._const_ids[k]}]"

    def _expr(self, a) -> str:
        if isinstance(a, ir.Ref):
            return f"E[{a.name!r}]"
        if isinstance(a, ir.Seq):
            return "[" + ", ".join(self._expr(x) for x in a.items) + "]"
        if isinstance(a, ir.DType):
            return self._const(getattr(torch, a.name))
        if isinstance(a, ir.Device):
            return self._const(torch.device(a.name))
        if isinstance(a, ir.Layout):
            return self._const(getattr(torch, a.name))
        if isinstance(a, ir.MemoryFormat):
            return self._const(getattr(torch, a.name))
        if isinstance(a, ir.Special):
            return f"float({a.name!r})"
        return repr(a)

    def _call(self, node) -> str:
        op = self._const(_resolve_op(node.op))
        args = [self._expr(a) for a in node.args]
        args += [f"{k}={self._expr(v)}" for k, v in node.kwargs.items()]
        return f"{op}({', '.join(args)})"

    def _compile(self, name: str, instrs, grads):
        body: list[str] = []
        replay = set(self.replayed)
        for ins in instrs:
            if ins.kind == FREE:
                body.append(f"del E[{ins.target!r}]")
                continue
            node = self.nodes[ins.target]
            call = self._call(node)
            if node.random and node.name in replay:
                if ins.kind == COMPUTE:
                    body.append(f"R[{node.name!r}] = get_rng()")
                else:
                    body.append(f"_s = get_rng(); set_rng(R[{node.name!r}])")
            outs = node.outputs
            if len(outs) == 1 and self._single_output(node):
                body.append(f"E[{outs[0]!r}] = {call}")
            else:
                body.append(f"_r = {call}")
                for k, out in enumerate(outs):
                    if out:
                        body.append(f"E[{out!r}] = _r[{k}]")
                body.append("del _r")
            if node.random and node.name in replay and ins.kind == RECOMPUTE:
                body.append("set_rng(_s); del _s")
        # Hand gradients over: popped so autograd holds the only reference.
        if grads:
            body.append("return (" + "".join(f"E.pop({v!r}), " for v, _ in grads) + ")")
        else:
            body.append("return ()")
        src = f"def {name}(E, R, C, get_rng, set_rng):\n" + "".join(f"    {ln}\n" for ln in body)
        scope: dict = {}
        exec(compile(src, f"<remat-ir {name}>", "exec"), scope)
        fn = scope[name]
        fn.source = src
        return fn

    def _single_output(self, node) -> bool:
        op = _resolve_op(node.op)
        rets = op._schema.returns
        return len(rets) == 1 and not str(rets[0].type).endswith("[]")


# ------------------------------------------------------------- autograd glue


class _State:
    """Live tensors of one step, shared by the pieces of its autograd graph."""

    def __init__(self, exe: Executable, device: torch.device):
        self.exe = exe
        self.env: dict[str, torch.Tensor] = {}
        self.rng: dict[str, torch.Tensor] = {}
        self.next_segment = 0
        self.device = device
        if device.type == "cuda":
            self.get_rng = lambda: torch.cuda.get_rng_state(device)
            self.set_rng = lambda s: torch.cuda.set_rng_state(s, device)
        else:
            self.get_rng = torch.get_rng_state
            self.set_rng = torch.set_rng_state

    def run(self, fn):
        return fn(self.env, self.rng, self.exe.consts, self.get_rng, self.set_rng)


def _token(device) -> torch.Tensor:
    # A zero-size tensor chaining the pieces in autograd; it owns no memory.
    return torch.empty(0, device=device)


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
        if state.next_segment != ctx.index:
            raise RuntimeError("remat-ir: backward pieces ran out of order")
        fn, _ = state.exe.segments[ctx.index]
        grads = state.run(fn)
        state.next_segment += 1
        if state.next_segment == len(state.exe.segments):
            state.env.clear()
            state.rng.clear()
        return (None, None, _token(state.device), *grads)


# ------------------------------------------------------------------ wrapper


class RematModule(torch.nn.Module):
    """`model` run by a plan.  Training steps (train mode, grad enabled) follow
    the plan; evaluation and `no_grad` calls run the model eagerly."""

    def __init__(self, model: torch.nn.Module, program: Program, loss_fn=None, check_model: bool = True):
        super().__init__()
        check_parameters(model, program)
        if program.header.has_loss and loss_fn is None:
            raise PlanMismatch("this plan includes a loss function: pass it as wrap(model, plan, loss=fn)")
        check_sound(program)
        if check_model:
            check_graph(model, program, loss_fn)
        self.module = model
        self.loss_fn = loss_fn
        self.program = program
        self.exe = Executable(program)
        self.output_spec = pytree.treespec_loads(program.header.output_spec) if program.header.output_spec else None
        # Which parameters each backward piece produces gradients for.
        self._seg_keys = [keys for _, keys in self.exe.segments]

    def forward(self, *inputs):
        if not (self.training and torch.is_grad_enabled()):
            out = self.module(*inputs)
            return self.loss_fn(out, *inputs) if self.loss_fn is not None else out
        exe = self.exe
        if len(inputs) != len(exe.inputs):
            raise PlanMismatch(f"the plan takes {len(exe.inputs)} inputs "
                               f"({', '.join(v.name for v in exe.inputs)}); got {len(inputs)}")
        for v, x in zip(exe.inputs, inputs):
            if not isinstance(x, torch.Tensor) or list(x.shape) != v.shape or str(x.dtype) != "torch." + v.dtype:
                got = f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise PlanMismatch(f"input {v.name}: the plan was compiled for {v.dtype}{v.shape}, got {got}; "
                                   "recompile the plan for these shapes")
        device = inputs[0].device if inputs else next(self.module.parameters()).device
        want = self.program.header.device
        if torch.device(want).type != device.type:
            raise PlanMismatch(f"the plan was compiled for device {want}, but the step runs on {device}; "
                               f"recompile with --device {device.type}")
        state = _State(exe, device)
        env = state.env
        by_name = {}
        for v in exe.params:
            by_name[v.name] = self.module.get_parameter(v.source)
        for v in exe.buffers:
            by_name[v.name] = self.module.get_buffer(v.source)
        for v, x in zip(exe.inputs, inputs):
            by_name[v.name] = x
        # Graph inputs enter the environment detached: autograd sees them only
        # through the pieces below.
        for name, t in by_name.items():
            env[name] = t.detach()
        # The chain starts at a leaf that requires grad, so every piece runs
        # in backward even when it yields no gradient.
        token = torch.empty(0, device=device, requires_grad=True)
        for k in reversed(range(len(exe.segments))):
            leaves = [by_name[key] for key in self._seg_keys[k]]
            token = _Segment.apply(state, k, token, *leaves)
        outs = _Head.apply(state, token)
        if self.output_spec is not None:
            return pytree.tree_unflatten(list(outs), self.output_spec)
        return outs[0] if len(outs) == 1 else outs


def wrap(model: torch.nn.Module, program: Program, loss=None, *, check_model: bool = True) -> RematModule:
    """`model` run by `program`; `loss` is the loss function when the plan includes one.

    Refuses (PlanMismatch) a plan made for other parameters, an unsound plan,
    and, unless `check_model=False`, a plan whose graph the model no longer
    produces (the step is traced again under fake tensors: see
    `remat_ir.runtime.bind`)."""
    return RematModule(model, program, loss, check_model)
