"""Memory simulator: the live bytes of every storage over a program's schedule.

This is the single statement of what a schedule costs in memory, shared by
the optimizer (which must fit a budget), the verifier (which proves it fits)
and the CLI (which prints predictions).  It models exactly what the
interpreter and autograd do at run time:

* before the step: parameters, buffers, inputs, optimizer state and, on every
  step but the first, the `.grad` of each parameter;
* `compute`/`recompute` allocate the storages their outputs own (a view owns
  none) on top of everything live, so an op's inputs and outputs coexist;
* `free` drops a value; its storage is released when no value aliasing it is
  live any more;
* at the start of backward autograd allocates the tangents (`ones_like(loss)`);
* right after the last instruction that writes a gradient's storage (the one
  producing it, or a later in-place update: `remat_ir.ir.hand_overs`), the
  gradient is handed to autograd: with `.grad` present it is added in place and dropped; with
  `.grad` absent its storage becomes `.grad` (or, when its strides differ from
  the parameter's, autograd clones it into a fresh storage first);
* forward results are held by the caller until the step ends;
* in a compiled backward (`header.held_gradients`) each gradient is held
  until backward returns (the plan's gradient outputs are views taken at its
  end): the storage a gradient output views counts as gradients, not
  temporaries, from its allocation.

The peak is taken after each allocation, before the frees that follow.

Offload: two pools.  Everything above is the *device* pool, and every peak,
category and budget scope is of device bytes.  The *host* pool holds the
host copies of offloaded values (`MemoryReport.host_peak_bytes`,
`Event.host`).  The instructions, each naming a value V:

* V must own its storage (not a view), be made by a node (not an input,
  parameter, buffer or tangent), and be neither a forward result nor a
  gradient output;
* `offload V` (V live on the device, no copy of it in flight): starts copying
  V's storage to the host.  A host buffer of V's storage bytes is allocated
  now.  V's device storage stays allocated and V stays readable until the
  matching `wait V`; nothing may write V's storage (in place, or `out=`)
  while the copy is in flight;
* `wait V` after an offload: the copy is done and V's device storage is
  released.  V is now on the host: neither V nor any view of its storage may
  be read until it is reloaded, and no other live value may alias V's
  storage at this wait (a live view would keep the device storage alive);
* `reload V` (V on the host, its offload waited): allocates V's storage bytes
  on the device now (a fresh storage of the same shape, strides and dtype)
  and starts the copy back; V is not readable until its `wait V`;
* `wait V` after a reload: V is on the device and readable again; its host
  buffer is released;
* `free V` while V is on the host releases its host buffer; a `free` of a
  value whose copy is in flight is refused;
* a producer's `recompute` while its output is on the host or its copy in
  flight is refused; at the end of backward no copy may be in flight and no
  value left on the host (the verifier's rules).

Device bytes move at `wait` after an offload (released) and at `reload`
(allocated); host bytes at `offload` (allocated) and at `wait` after a reload
or `free` on the host (released).  The timeline has a point after each
offload, reload and wait.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from remat_ir.ir import (
    BACKWARD, BUFFER, COMPUTE, FREE, GRAD, INPUT, OFFLOAD, PARAM, RECOMPUTE, RELOAD, RESULT, TANGENT, VALUE,
    WAIT, DTYPE_BYTES, Program, hand_overs, node_inputs,
)
from remat_ir.ir.budgets import budget_int, parse_budget
from remat_ir.ir.schedule import default_schedule
from remat_ir.ir.types import DEFAULT_SCOPE, OPTIMIZER_STATES

# Breakdown categories, in the order tables print them.
PARAMS = "parameters"
BUFFERS = "buffers"
INPUTS = "inputs"
OPTIMIZER = "optimizer state"
GRADIENTS = "gradients"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
CATEGORIES = (PARAMS, BUFFERS, OPTIMIZER, INPUTS, GRADIENTS, ACTIVATIONS, TEMPORARIES)
# What `--scope activations` budgets: what the step adds above the state.
STEP_CATEGORIES = (ACTIVATIONS, TEMPORARIES)


class SimulationError(ValueError):
    """The schedule cannot be simulated (it uses a dead value, ...).

    The verifier gives the precise diagnosis; the simulator only refuses."""


@dataclass
class Event:
    """One point of the timeline: after instruction `index` of `phase`."""

    phase: str  # "forward", "backward", or "start"
    index: int  # index into that phase's instruction list (-1 for start points)
    line: int
    total: int  # live device bytes at this point
    by_category: dict[str, int]
    host: int = 0  # bytes of the host pool (offloaded copies) at this point


@dataclass
class MemoryReport:
    peak_bytes: int
    peak: Event
    baseline: dict[str, int]  # bytes before the step starts, by category
    activation_peak_bytes: int  # max over time of activations + temporaries
    activation_peak: Event
    top: list[tuple[str, int]]  # storages live at the peak, largest first
    timeline: list[Event] = field(repr=False, default_factory=list)
    peak_step: int = 0  # how many timeline points precede the peak (internal)
    host_peak_bytes: int = 0  # max over time of the host pool's bytes (offloaded copies)
    host_peak: Event | None = None  # where it is first reached (None: nothing is offloaded)
    offloads: int = 0  # how many `offload` instructions the schedule has

    @property
    def baseline_bytes(self) -> int:
        return sum(self.baseline.values())

    @property
    def step_peak_bytes(self) -> int:
        """The most the step holds above what existed before it: what a
        measurement from the step's start sees (with `.grad` present, the
        activation peak, plus any gradient a compiled backward holds)."""
        return self.peak_bytes - self.baseline_bytes

    def scope_peak(self, scope: str) -> int:
        return self.peak_bytes if scope == "total" else self.activation_peak_bytes


def optimizer_state_bytes(program: Program, optimizer: str) -> int:
    """Bytes of the state `optimizer` keeps for the trainable parameters
    (`OPTIMIZER_STATES` tensors of each parameter's size)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    per = OPTIMIZER_STATES[optimizer]
    return per * sum(v.nbytes for v in program.values if v.kind == PARAM and v.requires_grad)


def simulate(program: Program, *, grads_present: bool = True, optim_state_bytes: int | None = None,
             keep_timeline: bool = False, top_k: int = 8) -> MemoryReport:
    report = _play(program, grads_present, optim_state_bytes, keep_timeline, None)
    if top_k <= 0:
        return report
    # The storages live at the peak: a second pass that stops there is cheaper
    # than snapshotting at every new maximum (forward sets one per compute).
    try:
        _play(program, grads_present, optim_state_bytes, False, report.peak_step)
    except _Stop as stop:
        report.top = _top(stop.storage_bytes, top_k)
    return report


class _Stop(Exception):
    def __init__(self, storage_bytes):
        self.storage_bytes = storage_bytes


def _play(program: Program, grads_present: bool, optim_state_bytes: int | None, keep_timeline: bool,
          stop_at: int | None) -> MemoryReport:
    values = program.value_map()
    nodes = program.node_map()
    category = value_categories(program)
    opt_bytes = program.header.optim_state_bytes if optim_state_bytes is None else optim_state_bytes

    grad_of: dict[str, list[str]] = {}  # grad value -> keys (param/input names) it is the grad of
    results: set[str] = set()
    for o in program.outputs:
        if o.kind == GRAD:
            grad_of.setdefault(o.value, []).append(o.key)
        elif o.kind == RESULT:
            results.add(o.value)
    handed = hand_overs(program)

    cat_bytes = dict.fromkeys(CATEGORIES, 0)
    storage_bytes: dict[str, int] = {}  # live storage -> bytes
    storage_cat: dict[str, str] = {}
    refs: dict[str, int] = {}  # live storage -> number of live values aliasing it
    live: set[str] = set()
    # Offload (see the module docstring): the copy of each value in flight,
    # the values on the host, and the host pool's buffers.
    copying: dict[str, str] = {}  # value -> OFFLOAD or RELOAD
    on_host: set[str] = set()
    host_buffers: dict[str, int] = {}  # value -> bytes of its host buffer
    host_now = 0

    def alloc(storage: str, nbytes: int, cat: str) -> None:
        storage_bytes[storage] = nbytes
        storage_cat[storage] = cat
        cat_bytes[cat] += nbytes

    def release(storage: str) -> None:
        cat_bytes[storage_cat.pop(storage)] -= storage_bytes.pop(storage)
        refs.pop(storage, None)

    def make_live(name: str) -> None:
        v = values[name]
        if name in live:
            raise SimulationError(f"{name} is computed while live")
        if name in on_host or name in copying:
            raise SimulationError(f"{name} is computed while offloaded to the host")
        if v.storage == v.name:
            alloc(v.storage, v.nbytes, category[name])
        elif v.storage not in storage_bytes:
            raise SimulationError(f"{name} is a view of {v.storage}, which is not live")
        refs[v.storage] = refs.get(v.storage, 0) + 1
        live.add(name)

    def drop(name: str) -> None:
        if name not in live:
            raise SimulationError(f"{name} is freed while not live")
        live.discard(name)
        s = values[name].storage
        refs[s] -= 1
        if refs[s] == 0:
            release(s)

    # The state that exists before the step: never freed by the schedule.
    for v in program.values:
        if v.kind in (PARAM, BUFFER, INPUT):
            make_live(v.name)
    if opt_bytes:
        alloc("<optimizer state>", opt_bytes, OPTIMIZER)
    grad_targets = [values[k] for o in program.outputs if o.kind == GRAD for k in [o.key]]
    if grads_present:
        for v in grad_targets:
            alloc(f"<{v.name}.grad>", v.nbytes or dense_bytes(v), GRADIENTS)
    baseline = dict(cat_bytes)

    timeline: list[Event] = []
    best = Event("start", -1, 0, sum(cat_bytes.values()), dict(cat_bytes))
    best_act = Event("start", -1, 0, 0, dict(cat_bytes))
    best_host: Event | None = None
    step_no = 0
    peak_step = -1
    n_offloads = 0

    def record(phase: str, index: int, line: int) -> None:
        nonlocal best, best_act, best_host, step_no, peak_step
        step_no += 1
        if step_no == stop_at:
            raise _Stop(dict(storage_bytes))
        total = sum(cat_bytes.values())
        act = cat_bytes[ACTIVATIONS] + cat_bytes[TEMPORARIES]
        host_more = host_now > (best_host.host if best_host is not None else 0)
        if keep_timeline or total > best.total or act > best_act.total or host_more:
            ev = Event(phase, index, line, total, dict(cat_bytes), host_now)
            if keep_timeline:
                timeline.append(ev)
            if total > best.total:
                best = ev
                peak_step = step_no
            if act > best_act.total:
                best_act = Event(phase, index, line, act, dict(cat_bytes), host_now)
            if host_more:
                best_host = ev

    def offload(name: str) -> None:
        nonlocal host_now
        v = values.get(name)
        if v is None or v.kind != VALUE or v.storage != name:
            raise SimulationError(f"{name} is offloaded but is no value owning its storage")
        if name in copying or name in on_host:
            raise SimulationError(f"{name} is offloaded while already offloaded")
        if name not in live:
            raise SimulationError(f"{name} is offloaded while not live")
        host_buffers[name] = v.nbytes
        host_now += v.nbytes
        copying[name] = OFFLOAD

    def reload(name: str) -> None:
        if name not in on_host:
            raise SimulationError(f"{name} is reloaded while not on the host")
        on_host.discard(name)
        v = values[name]
        alloc(v.storage, v.nbytes, category[name])
        copying[name] = RELOAD

    def wait(name: str) -> None:
        nonlocal host_now
        kind = copying.pop(name, None)
        if kind is None:
            raise SimulationError(f"wait {name}: no copy of {name} is in flight")
        if kind == OFFLOAD:
            if refs.get(name, 0) != 1:
                raise SimulationError(f"wait {name}: another live value aliases its storage")
            drop(name)
            on_host.add(name)
        else:
            live.add(name)
            refs[name] = 1
            host_now -= host_buffers.pop(name)

    def free_host(name: str) -> None:
        nonlocal host_now
        on_host.discard(name)
        host_now -= host_buffers.pop(name)

    if stop_at == 0:
        raise _Stop(dict(storage_bytes))

    for phase, instrs in (("forward", program.forward), ("backward", program.backward)):
        if phase == "backward":
            for v in program.values:
                if v.kind == TANGENT:
                    make_live(v.name)
            record(phase, -1, 0)
        for i, ins in enumerate(instrs):
            if ins.kind in (COMPUTE, RECOMPUTE):
                node = nodes.get(ins.target)
                if node is None:
                    raise SimulationError(f"unknown node {ins.target}")
                for name in node_inputs(node):
                    if name not in live:
                        raise SimulationError(f"{ins.target} reads {name}, which is not live")
                for out in node.outputs:
                    if out:
                        make_live(out)
                record(phase, i, ins.line)
                if phase == "backward":
                    for out in handed.get(i, ()):
                        if out not in live:
                            raise SimulationError(f"{out}, a gradient output, is not live when handed to autograd")
                        _hand_over(out, grad_of[out], values, grads_present, live, refs,
                                   storage_cat, cat_bytes, alloc, drop, record, i, ins.line)
            elif ins.kind == FREE:
                if ins.target in results:
                    raise SimulationError(f"{ins.target} is a forward result; the caller holds it")
                if ins.target in copying:
                    raise SimulationError(f"{ins.target} is freed while its copy is in flight")
                if ins.target in on_host:
                    free_host(ins.target)
                else:
                    drop(ins.target)
            elif ins.kind in (OFFLOAD, RELOAD, WAIT):
                if ins.target in results or ins.target in grad_of:
                    raise SimulationError(f"{ins.target} is a forward result or a gradient output; it cannot "
                                          "be offloaded")
                if ins.kind == OFFLOAD:
                    offload(ins.target)
                    n_offloads += 1
                elif ins.kind == RELOAD:
                    reload(ins.target)
                else:
                    wait(ins.target)
                record(phase, i, ins.line)
            else:
                raise SimulationError(f"unknown instruction {ins.kind}")

    return MemoryReport(
        peak_bytes=best.total, peak=best, baseline=baseline,
        activation_peak_bytes=best_act.total, activation_peak=best_act,
        top=[], timeline=timeline, peak_step=max(peak_step, 0),
        host_peak_bytes=best_host.host if best_host is not None else 0, host_peak=best_host,
        offloads=n_offloads,
    )


def _hand_over(out, keys, values, grads_present, live, refs, storage_cat, cat_bytes, alloc, drop,
               record, index, line) -> None:
    """Give a gradient to autograd's AccumulateGrad (see the module docstring)."""
    v = values[out]
    for key in keys:
        target = values[key]
        if grads_present:
            continue  # `.grad += g`: no allocation
        if not obeys_layout_contract(v, target):
            # AccumulateGrad clones a gradient whose layout differs from the
            # parameter's; otherwise it steals it, views included.
            alloc(f"<{key}.grad>", dense_bytes(target), GRADIENTS)
            record("backward", index, line)
        else:
            # Stolen: the storage lives on as `.grad`.
            s = v.storage
            cat_bytes[storage_cat[s]] -= values[s].nbytes
            storage_cat[s] = GRADIENTS
            cat_bytes[GRADIENTS] += values[s].nbytes
            refs[s] += 1  # held by the parameter from now on
    drop(out)


def caller_held_bytes(program: Program) -> int:
    """Bytes the step holds for its caller whatever the schedule: the storages
    of the forward results (logits, a key/value cache) and the tangents
    autograd gives them in backward.  All are live when backward starts, so
    this is at most the activation peak.  Scalars (the loss and its seed
    gradient, a few bytes) are left out: a step that returns only its loss
    holds nothing here."""
    values = program.value_map()
    produced = {o for n in program.nodes for o in n.outputs if o}
    storages = {values[o.value].storage for o in program.outputs if o.kind == RESULT}
    held = sum(values[s].nbytes for s in storages if s in produced and values[s].shape)
    return held + sum(v.nbytes for v in program.values if v.kind == TANGENT and v.shape)


def unoptimized_peak(program: Program, scope: str = DEFAULT_SCOPE) -> int:
    """Peak in `scope` of the default schedule (compute in order, free after
    last use): the larger of the first step's (no `.grad`) and the steady
    state's."""
    fwd, bwd = default_schedule(program)
    base = Program(header=program.header, values=program.values, nodes=program.nodes,
                   forward=fwd, backward=bwd, outputs=program.outputs)
    return max(simulate(base, grads_present=gp, top_k=0).scope_peak(scope) for gp in (True, False))


def resolve_budget(program: Program, text: str | int | float, scope: str = DEFAULT_SCOPE) -> int:
    """Bytes of a budget given as "1.5GiB", "800MB" (SI), "123456" (bytes), or
    a fraction: "0.5", "50%".  A fraction f is of what a plan can cut: the
    bytes the caller holds whatever the schedule (`caller_held_bytes`: the
    results, logits or a cache, and their tangents) plus f of the rest of the
    unoptimized peak in the scope.  Raises ValueError when it cannot be read,
    or is not a positive, finite number of bytes that fits a 64-bit integer:
    `remat_ir.ir.budgets.parse_budget`.  (Here, not in the optimizer, so that
    a cached plan is checked against the bytes planning would aim at without
    loading the optimizer.)"""
    kind, amount = parse_budget(text)
    if kind == "fraction":
        peak = unoptimized_peak(program, scope)
        held = min(caller_held_bytes(program), peak)
        return budget_int(held + amount * (peak - held), text)
    return int(amount)


def obeys_layout_contract(grad, param) -> bool:
    """torch/csrc/autograd/utils/grad_layout_contract.h, for dense parameters:
    strides must agree on every dimension longer than 1, and none may be 0."""
    for size, gs, ps in zip(grad.shape, grad.stride, param.stride):
        if size != 1 and gs != ps:
            return False
        if size == 1 and gs == 0:
            return False
    return len(grad.shape) == len(param.shape)


def dense_bytes(v) -> int:
    """Bytes of a dense tensor of `v`'s dtype and shape (a value's own gradient, as autograd allocates it)."""
    n = DTYPE_BYTES.get(v.dtype, 4)
    for d in v.shape:
        n *= d
    return n


def value_categories(program: Program) -> dict[str, str]:
    """The breakdown category of each value's storage, counted from its allocation."""
    phase = {o: n.phase for n in program.nodes for o in n.outputs if o}
    category = {v.name: _category(v, phase) for v in program.values}
    if program.header.held_gradients:
        values = program.value_map()
        for o in program.outputs:
            if o.kind == GRAD and phase.get(values[o.value].storage) == BACKWARD:
                category[values[o.value].storage] = GRADIENTS
    return category


def _category(v, phase: dict[str, str]) -> str:
    if v.kind == PARAM:
        return PARAMS
    if v.kind == BUFFER:
        return BUFFERS
    if v.kind == INPUT:
        return INPUTS
    if v.kind == TANGENT:
        return TEMPORARIES
    return TEMPORARIES if phase.get(v.name) == BACKWARD else ACTIVATIONS


def _top(storage_bytes: dict[str, int], k: int) -> list[tuple[str, int]]:
    return sorted(((s, b) for s, b in storage_bytes.items() if not s.startswith("<")),
                  key=lambda t: -t[1])[:k]
