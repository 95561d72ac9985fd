"""remat-ir under FSDP2 (`torch.distributed.fsdp.fully_shard`): a plan per unit.

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    model = remat_ir.wrap(model, budget=0.6)     # the same one line as on one device

Each FSDP unit that holds no other unit (typically a transformer block) runs
a plan of its own step: the unit's inputs to its outputs, and from the
gradients of its outputs the gradients of its inputs and parameters.  The
plan runs inside the unit's forward, so FSDP2's hooks stay in charge: the
pre-forward hook has all-gathered the parameters when the plan reads them
(at call time, never at wrap time); the output's pre-backward hook gathers
them again before the plan's backward pieces run on the same storages; the
plan hands each gradient to the unsharded parameter's `.grad` through
autograd, and the post-backward hook reduce-scatters them.  A unit that
holds other units (the root) runs its own layers eagerly, as FSDP2 does.

Why per unit and not one plan over the whole model with gathers as
instructions: the per-unit plan needs nothing of FSDP2 but its public
behaviour (hooks around a module's forward), so prefetching, reduce-scatter
and mixed precision stay FSDP2's; and a unit's plan is traced from the
gathered parameters the unit sees at call time, so the same tracer, planner,
verifier and interpreter serve it unchanged.  The cost: remat-ir reorders
nothing across units, and the root's own layers (embedding, head, loss) are
not rematerialized.

Units whose steps are the same (the blocks of a transformer) share one plan
through the plan cache: the first plans it, the others find it.
The budget is each unit's: a fraction of its own unoptimized activation
peak, or bytes per unit, on each rank.

What a step holds per rank.  Before it: `state_bytes` (shards of the
parameters, of their gradients and of the optimizer's state; buffers and
inputs whole).  Within it, FSDP2 on CPU/gloo (measured with the storage
tracker, which follows the storage resizes FSDP2 frees and gathers
parameters with), for each unit in its order:

* forward: the flat all-gather buffer (the unit's parameters in full), then
  the unsharded parameters (in full) copied out of it; the previous unit's
  buffer is released after that copy, this unit's after the next unit's
  (the last one's at the end of the root's forward); the unsharded
  parameters are released at the unit's post-forward (the root's are kept
  until its post-backward);
* backward: at a unit's pre-backward its parameters are copied out of the
  buffer its predecessor's pre-backward prefetched, that buffer is
  released, and the next unit's buffer is prefetched; the plan's gradients
  (in full) live until the unit's post-backward, which releases the
  parameters and the previous unit's reduce-scatter input, allocates this
  unit's (in full) while the gradients still live, then an output shard,
  which becomes `.grad` or is added into it; the last reduce-scatter input
  is released when backward ends.

`predict_step_peak` predicts a step's peak on one rank from these rules:
the root's step traced with each unit opaque, each unit's plan in its
place, FSDP2's storages around them, walked by the simulator.  How close
it comes on gpt2-tiny (two ranks, blocks at 0.6), and the command that
measures it: docs/06-distributed.md.
"""
from __future__ import annotations

import collections
import sys
from dataclasses import dataclass

import torch

from remat_ir.runtime.interpret import WrappedModule, eager_step, opaque_to_dynamo, runs_plan
from remat_ir.trace.calls import split_call

__all__ = ["FSDPRemat", "StepPrediction", "fsdp_units", "planned_units", "predict_step_peak", "state_bytes",
           "uses_fsdp"]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _fsdp_module_class():
    # A model sharded with fully_shard has imported FSDP2 already; importing
    # it here for a model that has not would cost a second at each wrap.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def uses_fsdp(model: torch.nn.Module) -> bool:
    """Whether `model` or a module inside it was sharded with `fully_shard`."""
    cls = _fsdp_module_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def fsdp_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of each FSDP unit in `model`, in registration order."""
    cls = _fsdp_module_class()
    if cls is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def planned_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The units that run plans: those holding no other unit."""
    units = fsdp_units(model)
    unit_ids = {id(u) for _, u in units}
    return [(n, u) for n, u in units if not any(id(m) in unit_ids for m in u.modules() if m is not u)]


def _plain_class(unit: torch.nn.Module) -> type:
    cls = _fsdp_module_class()
    # (past FSDP<Class> and, on an adopted root, its remat-ir mixin: the model's own class)
    return next(c for c in type(unit).__mro__ if not issubclass(c, cls) and issubclass(c, torch.nn.Module))


def plain_twin(unit: torch.nn.Module) -> torch.nn.Module:
    """The unit as its own class, without FSDP2's hooks, sharing its
    submodules, parameters and buffers: what the tracer traces and the plan
    reads parameters from.  FSDP2 swaps gathered and sharded parameters in
    the (shared) submodules, so the twin sees whatever the unit holds now."""
    twin = object.__new__(_plain_class(unit))
    twin.__dict__.update(_hookless_state(unit))
    return twin


def _hookless_state(m: torch.nn.Module) -> dict:
    """`m.__dict__` without FSDP2's forward and with its hook dicts empty."""
    state = dict(m.__dict__)
    state.pop("forward", None)
    for name in _HOOK_DICTS:
        if name in state:
            state[name] = collections.OrderedDict()
    return state


class _UnitForward:
    """A unit's forward while wrapped: training steps by the unit's plans,
    anything else by the unit's own forward."""

    def __init__(self, owner: "FSDPRemat", path: str, unit: torch.nn.Module):
        self.path = path
        self.unit = unit
        self.twin = plain_twin(unit)
        self.auto = owner._planner(self.twin)
        self.eager = type(unit).forward.__get__(unit)

    def __call__(self, *args, **kwargs):
        if not runs_plan(self.unit):
            return self.eager(*args, **kwargs)
        return self._planned_step(args, kwargs)

    @opaque_to_dynamo  # (a unit compiled on its own, `block.compile()`: see WrappedModule)
    def _planned_step(self, args, kwargs):
        self.twin.training = self.unit.training  # (the twin's own flag is a copy made at wrap time)
        return self.auto.step(split_call(self.twin, args, kwargs))


class FSDPRemat(WrappedModule):
    """A model sharded with `fully_shard`, its units each run by a plan (see
    the module's docstring); the model itself is called as it is, so FSDP2's
    root hooks run as without remat-ir."""

    def __init__(self, model: torch.nn.Module, loss_fn=None, *, unit_planner, **options):
        super().__init__(model, loss_fn)
        # `unit_planner(twin, **options)`: the wrapper that plans a unit's step on first use
        # (remat_ir.adopt.AutoRemat, passed in by remat_ir.wrap: the runtime imports no planner).
        self.unit_planner = unit_planner
        self.options = options
        self._planners: dict = {}
        self.units = []
        for path, unit in planned_units(model):
            if "forward" in unit.__dict__:
                raise ValueError(f"the FSDP unit {path or '(root)'} already has a forward of its own "
                                 "(wrapped twice?); wrap the model once")
            runner = _UnitForward(self, path, unit)
            unit.__dict__["forward"] = runner
            self.units.append(runner)

    def _planner(self, twin):
        # Units with the same step find the plan the first one made in the
        # plan cache (the same fingerprint), without running the optimizer.
        return self.unit_planner(twin, None, **self.options)

    def step(self, call):
        args, kwargs = call.rebuild(call.tensors)
        return eager_step(self.module, self.loss_fn, args, kwargs)

    @property
    def plans(self):
        return {u.path: list(u.auto.plans.values()) for u in self.units}


def _shard_bytes(p: torch.Tensor, world: int) -> int:
    """Bytes of one rank's shard of `p`: FSDP2 shards dimension 0, each rank
    holding ceil(size / world) rows (padded on the last ranks)."""
    rows = -(-p.shape[0] // world) if p.dim() else 1
    per_row = p[0].numel() if p.dim() else 1
    return rows * per_row * p.element_size()


def state_bytes(model: torch.nn.Module, inputs=(), *, grads: bool = True, optimizer: str = "none") -> int:
    """The state one rank holds before a step of a model sharded with
    `fully_shard`: each parameter's shard (1/world_size of it, padded to
    whole rows), as much again for its gradient when `.grad` exists and
    `OPTIMIZER_STATES[optimizer]` times for the optimizer's state; buffers
    and `inputs` whole, replicated on every rank.  Parameters of no unit are
    counted whole."""
    from remat_ir.ir.types import OPTIMIZER_STATES

    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    sharded = {}
    for _, unit in fsdp_units(model):
        for p in unit.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                sharded[id(p)] = _shard_bytes(p, mesh.size())
    total = 0
    for p in model.parameters():
        own = sharded.get(id(p), p.numel() * p.element_size())
        copies = 1 + (grads and p.requires_grad) + (OPTIMIZER_STATES[optimizer] if p.requires_grad else 0)
        total += own * copies
    seen = set()
    for t in list(model.buffers()) + [x for x in inputs if isinstance(x, torch.Tensor)]:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# ------------------------------------------------------------ step prediction


@dataclass
class StepPrediction:
    """A step's memory on one rank, in bytes: `state` before it (as
    `state_bytes`), `peak_above_state` at its peak, and their sum."""

    state: int
    peak_above_state: int

    @property
    def peak_bytes(self) -> int:
        return self.state + self.peak_above_state


class _Opaque(torch.autograd.Function):
    """A unit's place in the root's trace: an op from its input to each
    result and back, keeping nothing, so the root's own liveness of what
    it passes and gets back is traced and the unit's comes from its plan."""

    @staticmethod
    def forward(ctx, x, shapes):
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return tuple(torch.ops.aten.alias_copy.default(x) if (s, d) == (x.shape, x.dtype)
                     else x.new_empty(s, dtype=d) for s, d in shapes)

    @staticmethod
    def backward(ctx, *grads):
        g = next(g for g in grads if g is not None)
        out = (torch.ops.aten.alias_copy.default(g) if (g.shape, g.dtype) == (ctx.shape, ctx.dtype)
               else g.new_empty(ctx.shape, dtype=ctx.dtype))
        return out, None


class _StandIn(torch.nn.Module):
    def __init__(self, program, path: str):
        super().__init__()
        from remat_ir.ir.specs import load_treespec

        values = program.value_map()
        inputs = [v for v in program.values if v.kind == "input"]
        if len(inputs) != 1:
            raise NotImplementedError(f"predicting the step of the FSDP unit {path}, which takes "
                                      f"{len(inputs)} tensors, is not supported (units of one tensor are)")
        results = [values[o.value] for o in program.outputs if o.kind == "result"]
        self.shapes = tuple((torch.Size(v.shape), getattr(torch, v.dtype)) for v in results)
        spec = program.header.output_spec
        self.spec = load_treespec(spec) if spec else None

    def forward(self, x, *args, **kwargs):
        outs = _Opaque.apply(x, self.shapes)
        if self.spec is not None:
            return torch.utils._pytree.tree_unflatten(list(outs), self.spec)
        return outs[0] if len(outs) == 1 else outs


def _unit_program(runner):
    plans = list(runner.auto.plans.values())
    if not plans:
        raise ValueError(f"the FSDP unit {runner.path or '(root)'} has no plan yet: run a training step first")
    return plans[-1].program  # the most recently used


def _root_twin(wrapper, mode):
    """The root as plain modules (no FSDP2 hooks), its parameters fake and
    whole, each planned unit a `_StandIn`; the model itself is untouched."""
    units = {id(r.unit): r for r in wrapper.units}
    fakes: dict[int, torch.nn.Parameter] = {}

    def fake(p):
        if id(p) not in fakes:
            with mode:
                fakes[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                  requires_grad=p.requires_grad)
        return fakes[id(p)]

    def twin(m):
        if id(m) in units:
            r = units[id(m)]
            return _StandIn(_unit_program(r), r.path)
        t = object.__new__(_plain_class(m))
        state = _hookless_state(m)
        state["_parameters"] = {k: None if p is None else fake(p) for k, p in m._parameters.items()}
        state["_modules"] = {k: None if c is None else twin(c) for k, c in m._modules.items()}
        t.__dict__.update(state)
        return t

    return twin(wrapper.module)


def _unit_param_bytes(unit, inner_ids) -> tuple[int, int]:
    """(unsharded bytes, all-gather buffer bytes) of the parameters `unit`
    manages itself (not those of units inside it)."""
    full = flat = 0
    seen = set()
    for p in unit.parameters():
        if id(p) in seen or id(p) in inner_ids:
            continue
        seen.add(id(p))
        full += p.numel() * p.element_size()
        mesh = getattr(p, "device_mesh", None)
        world = mesh.size() if mesh is not None else 1
        flat += _shard_bytes(p, world) * world
    return full, flat


def predict_step_peak(wrapper, *args, grads: bool = True, **kwargs) -> StepPrediction:
    """One rank's memory during a training step of the wrapped sharded model
    on `args`/`kwargs`, as the storage tracker measures it on CPU: the state
    (`state_bytes`) and the peak above it.  `grads`: whether the sharded
    `.grad` exist before the step (every step but the first).

    Composed from the IR, never measured: the root's step is traced with
    each planned unit opaque (eager's own ops, as the root runs them), each
    unit's place in it is filled with the unit's plan, and FSDP2's buffers
    are placed around them by the rules in this module's docstring (sizes
    from the parameters' shapes and shards); the simulator then walks the
    whole step.  Each unit must have run a step (its plan is the one its
    last step used).  The root's step must call its units in a chain (each
    unit one tensor in)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat_ir.check.simulate import simulate
    from remat_ir.runtime.interpret import planner
    from remat_ir.trace.tracer import trace_module

    if planner(wrapper) is not None:  # (the adopted model: its planner)
        wrapper = planner(wrapper)
    root = wrapper.module
    mode = FakeTensorMode()
    rprog = trace_module(_root_twin(wrapper, mode), args, kwargs=kwargs, loss_fn=wrapper.loss_fn, fake=True,
                         fuse=False)
    inner = {id(p) for r in wrapper.units for p in r.unit.parameters()}
    world = next((p.device_mesh.size() for p in root.parameters() if hasattr(p, "device_mesh")), 1)
    units = [(_unit_program(r), _unit_param_bytes(r.unit, set())) for r in wrapper.units]
    program = _Composer(rprog, units, _unit_param_bytes(root, inner), world, grads).program()
    report = simulate(program, grads_present=False)
    tensors = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]
    return StepPrediction(state=state_bytes(root, tensors, grads=grads),
                          peak_above_state=report.step_peak_bytes)


def _renamed(a, ren):
    from remat_ir import ir

    if isinstance(a, ir.Ref):
        return ir.Ref(ren(a.name))
    if isinstance(a, ir.Seq):
        return ir.Seq([_renamed(x, ren) for x in a.items])
    return a


class _Composer:
    """One program for a whole step on one rank: the root's eager schedule,
    each opaque unit in it replaced by its plan's schedule, and FSDP2's
    storages as nodes of their own that allocate them (unsharded parameters,
    all-gather and reduce-scatter buffers) and frees that release them, at
    the points the module's docstring gives.  Parameters own no bytes in
    it: their memory is FSDP2's unsharded storages, gathered and released
    whole per unit.  Units are numbered in the order the root calls them."""

    def __init__(self, rprog, units, root_sizes, world: int, grads_exist: bool):
        from remat_ir.ir import BACKWARD, FORWARD, GRAD, INPUT, RESULT

        self.rprog, self.units, self.root_sizes = rprog, units, root_sizes
        self.world, self.grads_exist = world, grads_exist
        self.values: dict = {}
        self.nodes: list = []
        self.fwd: list = []
        self.bwd: list = []
        opaque = [n for n in rprog.nodes if n.op in ("aten.alias_copy.default", "aten.new_empty.default")]
        self.f_nodes = [n for n in opaque if n.phase == FORWARD]
        b_nodes = [n for n in opaque if n.phase == BACKWARD]
        if len(self.f_nodes) != len(units) or len(b_nodes) != len(units):
            raise NotImplementedError("predicting a step whose root does not call each planned unit once, "
                                      "in a chain, is not supported")
        from remat_ir.ir import TRANSFER_INSTRS

        if any(ins.kind in TRANSFER_INSTRS for prog in [rprog] + [u[0] for u in units]
               for ins in prog.forward + prog.backward):
            raise NotImplementedError("predicting an FSDP step whose plans offload values to the host is not "
                                      "supported")
        # In a chain, backward meets the units in the reverse order.
        self.forward_of = {n.name: i for i, n in enumerate(self.f_nodes)}
        self.backward_of = {n.name: len(units) - 1 - i for i, n in enumerate(b_nodes)}
        self.b_nodes = {self.backward_of[n.name]: n for n in b_nodes}
        # The root's values the opaque ops make are the units' storages:
        # results in forward, the input's gradient in backward.
        remap = {}
        for i, (prog, _) in enumerate(units):
            pv = prog.value_map()
            res = [o.value for o in prog.outputs if o.kind == RESULT]
            for out, r in zip(self.f_nodes[i].outputs, res):
                remap[out] = f"u{i}/{pv[r].storage}"
            gx = [o.value for o in prog.outputs if o.kind == GRAD and pv[o.key].kind == INPUT]
            for out in self.b_nodes[i].outputs:
                if out and gx:
                    remap[out] = f"u{i}/{pv[gx[0]].storage}"
        self.remap = remap

    # ----------------------------------------------------------- helpers
    def add(self, v):
        self.values[v.name] = v

    def emit(self, out, name, reads=(), made=(), phase="forward"):
        from remat_ir import ir

        for v in made:
            self.add(v)
        self.nodes.append(ir.Node(name=name, op="fsdp." + name.rsplit("/", 1)[-1].split("@")[0],
                                  args=[ir.Ref(r) for r in reads], kwargs={},
                                  outputs=[v.name for v in made], phase=phase))
        out.append(ir.Instr("compute", name))

    def alloc(self, out, name, nbytes, phase="forward"):
        from remat_ir import ir

        v = ir.Value(name=name, kind="value", dtype="uint8", shape=[nbytes], stride=[1], storage=name,
                     nbytes=nbytes)
        self.emit(out, name + "!", made=[v], phase=phase)

    @staticmethod
    def free(out, name):
        from remat_ir import ir

        out.append(ir.Instr("free", name))

    # ------------------------------------------------------------- build
    def program(self):
        import msgspec

        from remat_ir import ir
        from remat_ir.check.simulate import dense_bytes, obeys_layout_contract
        from remat_ir.ir import BACKWARD, FREE, GRAD, PARAM, RESULT

        rprog = self.rprog
        for v in rprog.values:
            storage = self.remap.get(v.storage, v.storage)
            owner_moved = v.storage in self.remap
            self.add(msgspec.structs.replace(v, storage=storage,
                                             nbytes=0 if v.kind == PARAM or owner_moved else v.nbytes))
        rnodes = rprog.node_map()
        rvals = rprog.value_map()
        root_full, root_flat = self.root_sizes
        ag = self.ag = {}
        # Root pre-forward: its all-gather buffer, then its unsharded parameters out of it.
        self.alloc(self.fwd, "root/ag", root_flat)
        self.last_ag = "root/ag"
        self.alloc(self.fwd, "root/params", root_full)
        root_grads = {}
        for o in rprog.outputs:
            if o.kind == GRAD and rvals[o.key].kind == PARAM:
                root_grads.setdefault(o.value, []).append(o.key)
        kept_grads = []
        self.rs = None
        for phase, instrs, out in (("forward", rprog.forward, self.fwd), ("backward", rprog.backward, self.bwd)):
            if phase == "backward":
                # Root post-forward releases the last unit's all-gather buffer; root
                # pre-backward prefetches it again (after autograd's tangent).
                self.free(self.bwd, self.last_ag)
                self.last_ag = None
                if self.units:
                    n = len(self.units) - 1
                    ag[n] = f"u{n}/ag@bwd"
                    self.alloc(self.bwd, ag[n], self.units[n][1][1], BACKWARD)
            for ins in instrs:
                if ins.kind == FREE:
                    out.append(ins)
                    continue
                node = rnodes[ins.target]
                if node.name in self.forward_of:
                    self._unit_forward(self.forward_of[node.name], node)
                    continue
                if node.name in self.backward_of:
                    self._unit_backward(self.backward_of[node.name], node)
                    continue
                self.nodes.append(node)
                out.append(ins)
                for o in node.outputs:
                    for key in root_grads.get(o, ()):
                        if obeys_layout_contract(rvals[o], rvals[key]):
                            kept_grads.append(o)  # AccumulateGrad steals it
                        else:
                            self.alloc(out, f"root/{key}.grad", dense_bytes(rvals[key]), BACKWARD)
                            kept_grads.append(f"root/{key}.grad")
                            self.free(out, o)
        # Root post-backward, when backward ends.
        self.free(self.bwd, "root/params")
        self._reduce_scatter("root", root_flat, kept_grads)
        self.free(self.bwd, self.rs)
        results = [o for o in rprog.outputs if o.kind == RESULT]
        return ir.Program(header=ir.Header(model=rprog.header.model), values=list(self.values.values()),
                          nodes=self.nodes, forward=self.fwd, backward=self.bwd, outputs=results)

    def _unit_values(self, i, prog, x_storage=None):
        """The unit's values under its prefix: parameters own no bytes,
        inputs and tangents are views of the root's storages (bound later)."""
        import msgspec

        from remat_ir.ir import INPUT, PARAM, TANGENT

        p = f"u{i}/"
        pv = prog.value_map()
        for v in prog.values:
            src = pv[v.storage].kind
            storage = p + v.storage
            if src in (INPUT, TANGENT):
                storage = None  # resolved when bound
            kind = "value" if v.kind in (INPUT, TANGENT) else v.kind
            nbytes = 0 if v.kind in (PARAM, INPUT, TANGENT) else v.nbytes
            self.add(msgspec.structs.replace(v, name=p + v.name, kind=kind, storage=storage, nbytes=nbytes,
                                             source=""))

    def _bind(self, i, prog, kind, root_value, out, phase):
        """Point the unit's values of `kind` (its input, its tangents), and
        their views, at the root's storage of `root_value`; make them live."""
        import msgspec

        p = f"u{i}/"
        pv = prog.value_map()
        storage = self.values[root_value].storage
        made = []
        for v in prog.values:
            if pv[v.storage].kind == kind:
                nv = msgspec.structs.replace(self.values[p + v.name], storage=storage)
                self.values[p + v.name] = nv
                if v.kind == kind:
                    made.append(self.values.pop(p + v.name))
        self.emit(out, f"{p}bind_{kind}", reads=[root_value], made=made, phase=phase)
        return {v.name for v in made}

    def _unit_forward(self, i, node):
        import msgspec

        from remat_ir.ir import FREE, INPUT, RESULT

        prog, (full, flat) = self.units[i]
        p = f"u{i}/"
        out = self.fwd
        # Pre-forward: all-gather, the parameters copied out, the previous buffer released.
        self.alloc(out, f"{p}ag@fwd", flat)
        self.alloc(out, f"{p}params@fwd", full)
        self.free(out, self.last_ag)
        self.last_ag = f"{p}ag@fwd"
        self._unit_values(i, prog)
        (x,) = [a.name for a in _refs(node)]
        live = self._bind(i, prog, INPUT, x, out, "forward")
        ren = (lambda n: p + n)
        for n in prog.nodes:
            self.nodes.append(msgspec.structs.replace(
                n, name=p + n.name, args=[_renamed(a, ren) for a in n.args],
                kwargs={k: _renamed(a, ren) for k, a in n.kwargs.items()},
                outputs=[p + o if o else o for o in n.outputs]))
        pnodes = prog.node_map()
        for ins in prog.forward:
            out.append(msgspec.structs.replace(ins, target=p + ins.target))
            if ins.kind == FREE:
                live.discard(p + ins.target)
            else:
                live.update(p + o for o in pnodes[ins.target].outputs if o)
        # What the root gets back: views of the unit's results.
        res = [p + o.value for o in prog.outputs if o.kind == RESULT]
        made = [self.values.pop(o) for o in node.outputs if o]
        self.emit(out, f"{p}results", reads=res, made=made)
        # Post-forward: the unsharded parameters released.
        self.free(out, f"{p}params@fwd")
        self.unit_live = getattr(self, "unit_live", {})
        self.unit_live[i] = live

    def _unit_backward(self, i, node):
        import msgspec

        from remat_ir.check.simulate import dense_bytes, obeys_layout_contract
        from remat_ir.ir import FREE, GRAD, INPUT, TANGENT, hand_overs

        prog, (full, flat) = self.units[i]
        p = f"u{i}/"
        out = self.bwd
        pv = prog.value_map()
        pnodes = prog.node_map()
        live = self.unit_live.pop(i)
        # Pre-backward: the parameters out of the prefetched buffer (gathered
        # now when none was), that buffer released, the next unit's prefetched.
        if i not in self.ag:
            self.ag[i] = f"{p}ag@bwd"
            self.alloc(out, self.ag[i], flat, "backward")
        self.alloc(out, f"{p}params@bwd", full, "backward")
        self.free(out, self.ag.pop(i))
        if i > 0:
            self.ag[i - 1] = f"u{i - 1}/ag@bwd"
            self.alloc(out, self.ag[i - 1], self.units[i - 1][1][1], "backward")
        (gy,) = [a.name for a in _refs(node)]
        live |= self._bind(i, prog, TANGENT, gy, out, "backward")
        grad_of = {}
        for o in prog.outputs:
            if o.kind == GRAD:
                grad_of.setdefault(o.value, []).append(o.key)
        gx = [o for o in node.outputs if o]
        grads = []
        handed = hand_overs(prog)  # (after the last write to a gradient's storage)
        for j, ins in enumerate(prog.backward):
            out.append(msgspec.structs.replace(ins, target=p + ins.target))
            if ins.kind == FREE:
                live.discard(p + ins.target)
                continue
            for o in pnodes[ins.target].outputs:
                if o:
                    live.add(p + o)
            for o in handed.get(j, ()):
                for key in grad_of.get(o, ()):
                    if pv[key].kind == INPUT:
                        # Autograd carries it on into the root's graph.
                        self.emit(out, f"{p}grad_input", reads=[p + o], made=[self.values.pop(gx[0])],
                                  phase="backward")
                    elif obeys_layout_contract(pv[o], pv[key]):
                        grads.append(p + o)  # stolen as the unsharded parameter's `.grad`
                    else:
                        self.alloc(out, f"{p}{key}.grad", dense_bytes(pv[key]), "backward")
                        grads.append(f"{p}{key}.grad")
                # Handed over (popped from the plan's environment).
                live.discard(p + o)
                if p + o not in grads:
                    self.free(out, p + o)
        # The last piece clears the plan's environment.
        for name in sorted(live):
            self.free(out, name)
        # Post-backward: parameters released, then the reduce-scatter.
        self.free(out, f"{p}params@bwd")
        self._reduce_scatter(p, flat, grads)

    def _reduce_scatter(self, p, flat, grads):
        """The previous reduce-scatter input released, this unit's allocated
        while its gradients live, then its output shard, added into `.grad`
        (or kept as `.grad` on a first step)."""
        out = self.bwd
        if self.rs is not None:
            self.free(out, self.rs)
        self.rs = f"{p}/rs"
        self.alloc(out, self.rs, flat, "backward")
        for g in grads:
            self.free(out, g)
        self.alloc(out, f"{p}/rs_out", flat // self.world, "backward")
        if self.grads_exist:
            self.free(out, f"{p}/rs_out")


def _refs(node):
    from remat_ir import ir
    from remat_ir.ir import node_inputs

    return [ir.Ref(n) for n in node_inputs(node)]
