"""Cost models: what recomputing an op costs, and what a plan's recomputes add.

Two models, named by `Header.cost`:

* ``flops`` (the default): `Node.flops`, counted per aten op by the tracer.
  Cheap and device independent, but blind to memory-bound ops (a softmax or a
  dropout costs few FLOPs and real time).
* ``profile``: `Node.time_us`, each op's median run time measured on the
  target device by `remat_ir.runtime.op_timing`, which runs the program's ops one by one on
  real tensors.  The optimizer then minimizes predicted step time.

The overhead of a plan is the cost of its `recompute` instructions and of
its host copies (`offload`, `reload`: `transfer_cost`) over the cost of
every op of the step (forward and backward), in the plan's model.

A host copy's time is its bytes over the link's bandwidth plus a latency
(`LINKS`, per device kind: defaults, not measurements).  Under ``profile``
that is microseconds; under ``flops`` it is that time times the device's
throughput, the FLOPs the device could have run meanwhile.  A `reload` is
issued where backward first needs the value (no prefetch), so its whole
time counts.  An `offload` overlaps the forward compute between it and its
`wait`: only the part of its time that exceeds that compute counts.  Copies
are charged one by one (two in flight at once do not share the link).

Profiling (measuring `time_us`) runs ops, so it lives in the runtime
(`remat_ir.runtime.op_timing`); reading costs needs nothing but the IR.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat_ir.ir.types import COMPUTE, COST_PROFILE, OFFLOAD, RECOMPUTE, RELOAD, WAIT, Node, Program


# ------------------------------------------------------------ reading costs


def node_cost(node: Node, model: str) -> float:
    """Cost of running `node` once under cost model `model`."""
    return float(node.time_us if model == COST_PROFILE else node.flops)


# ------------------------------------------------------------ host copies


@dataclass(frozen=True)
class Link:
    """The host <-> device link of a device kind, and the device's throughput."""

    bandwidth: float  # bytes per second, each way
    latency: float  # seconds per copy
    throughput: float  # FLOP/s: a copy's time in FLOPs under the `flops` cost model


# Defaults, not measurements: pinned host memory over PCIe and a data-center
# GPU's dense throughput; on CPU a memory copy and a few cores' throughput.
# Another device kind takes the `cuda` row.
LINKS = {
    "cpu": Link(bandwidth=10e9, latency=1e-6, throughput=100e9),
    "cuda": Link(bandwidth=25e9, latency=10e-6, throughput=200e12),
}


def link(device: str) -> Link:
    """The `LINKS` row of `device` ("cpu", "cuda", "cuda:1", ...)."""
    return LINKS.get(str(device).split(":")[0], LINKS["cuda"])


def link_text(device: str) -> str:
    """The link `device`'s copies are costed with, for reports."""
    lk = link(device)
    return (f"{lk.bandwidth / 1e9:g} GB/s and {lk.latency * 1e6:g} us a copy, {lk.throughput / 1e12:g} TFLOP/s: "
            f"defaults for {str(device).split(':')[0]}, not measured")


def copy_cost(nbytes: int, device: str, model: str) -> float:
    """One host copy of `nbytes` (either way) in cost model `model`:
    microseconds under `profile`, FLOPs the device could have run under `flops`."""
    lk = link(device)
    seconds = float(nbytes) / lk.bandwidth + lk.latency
    return seconds * 1e6 if model == COST_PROFILE else seconds * lk.throughput


def offload_cost(nbytes: int, between: float, device: str, model: str) -> float:
    """An offload whose copy overlaps `between` (the forward compute from it
    to its `wait`, same model), and the reload that brings it back."""
    c = copy_cost(nbytes, device, model)
    return c + max(0.0, c - between)


def transfer_cost(program: Program, model: str | None = None) -> float:
    """Cost of a plan's host copies (see the module docstring): every reload's
    time, and the time of every forward offload beyond the compute between
    it and its wait."""
    model = model or program.header.cost
    if not any(i.kind == OFFLOAD for i in program.forward + program.backward):
        return 0.0
    from remat_ir.ir import sizes

    if sizes.is_symbolic(program):  # (bytes are expressions: a symbolic plan's cost is at its largest sizes)
        program = sizes.instantiate(program, sizes.ends(program)[-1], refingerprint=False)
    nodes = program.node_map()
    values = program.value_map()
    device = program.header.device
    total = 0.0
    for instrs in (program.forward, program.backward):
        pending: dict[str, tuple[float, float]] = {}  # offloaded value -> (its copy's cost, compute since)
        for ins in instrs:
            if ins.kind in (COMPUTE, RECOMPUTE):
                c = node_cost(nodes[ins.target], model)
                for v, (cc, between) in pending.items():
                    pending[v] = (cc, between + c)
            elif ins.kind == OFFLOAD:
                pending[ins.target] = (copy_cost(values[ins.target].nbytes, device, model), 0.0)
            elif ins.kind == WAIT and ins.target in pending:
                cc, between = pending.pop(ins.target)
                total += max(0.0, cc - between)
            elif ins.kind == RELOAD:
                total += copy_cost(values[ins.target].nbytes, device, model)
        total += sum(max(0.0, cc - between) for cc, between in pending.values())  # (waited in a later section)
    return total


def overhead(program: Program, model: str | None = None, *, copies: bool = True) -> tuple[float, float]:
    """(cost of the plan's recomputes, and of its host copies unless not
    `copies`; cost of every op of the step), in cost model `model` (default:
    the plan's own; FLOPs, or microseconds when profiled)."""
    model = model or program.header.cost
    nodes = program.node_map()
    extra = sum(node_cost(nodes[i.target], model)
                for i in program.forward + program.backward if i.kind == RECOMPUTE)
    if copies:
        extra += transfer_cost(program, model)
    base = sum(node_cost(n, model) for n in program.nodes)
    return extra, base


def overhead_text(program: Program) -> str:
    """`+3.2% FLOPs`, or `+3.2% step time (profiled on cpu)`."""
    extra, base = overhead(program)
    pct = f"+{100 * extra / base:.1f}%" if base else "+0.0%"
    if program.header.cost == COST_PROFILE:
        return f"{pct} step time (profiled on {program.header.device})"
    return f"{pct} FLOPs"


def unit_label(program: Program) -> str:
    """What the overhead percentage is a percentage of, for axis labels."""
    if program.header.cost == COST_PROFILE:
        return f"% of step time, profiled on {program.header.device}"
    return "% of step FLOPs"
