"""Cost models: what recomputing an op costs, and what a plan's recomputes add.

Two models, named by `Header.cost`:

* ``flops`` (the default): `Node.flops`, counted per aten op by the tracer.
  Cheap and device independent, but blind to memory-bound ops (a softmax or a
  dropout costs few FLOPs and real time).
* ``profile``: `Node.time_us`, each op's median run time measured on the
  target device by `remat_ir.runtime.op_timing`, which runs the program's ops one by one on
  real tensors.  The optimizer then minimizes predicted step time.

The overhead of a plan is the cost of its `recompute` instructions over the
cost of every op of the step (forward and backward), in the plan's model.

Profiling (measuring `time_us`) runs ops, so it lives in the runtime
(`remat_ir.runtime.op_timing`); reading costs needs nothing but the IR.
"""
from __future__ import annotations

from remat_ir.ir.types import COST_PROFILE, RECOMPUTE, Node, Program


# ------------------------------------------------------------ reading costs


def node_cost(node: Node, model: str) -> float:
    """Cost of running `node` once under cost model `model`."""
    return float(node.time_us if model == COST_PROFILE else node.flops)


def overhead(program: Program, model: str | None = None) -> tuple[float, float]:
    """(cost of the plan's recomputes, cost of every op of the step), in cost
    model `model` (default: the plan's own; FLOPs, or microseconds when
    profiled)."""
    model = model or program.header.cost
    nodes = program.node_map()
    extra = sum(node_cost(nodes[i.target], model)
                for i in program.forward + program.backward if i.kind == RECOMPUTE)
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
