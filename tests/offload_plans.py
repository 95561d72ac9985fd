"""Plans with offloads, for tests: made from a verified plan without
recomputation by moving activations kept from forward into backward to the
host in between.

For each value V offloaded, `with_offloads` inserts

* `offload V` right after the instruction computing V (forward);
* `wait V` right after V's last forward read (or right after the offload,
  when forward reads V no more), which releases V's device storage;
* `reload V` and `wait V` right before V's first backward read.

Such a plan is sound when V owns its storage, no view of V's storage is live
at the first wait, and nothing writes V's storage in place: `candidates`
lists the values for which it verifies.
"""
from __future__ import annotations

import msgspec

from remat_ir.ir import (
    COMPUTE, FORWARD, OFFLOAD, RELOAD, VALUE, WAIT, GRAD, RESULT, Instr, Program, node_inputs,
)
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program


def _reads(program: Program, ins: Instr, name: str) -> bool:
    node = program.node_map().get(ins.target) if ins.kind == COMPUTE else None
    return node is not None and name in node_inputs(node)


def with_offloads(program: Program, names) -> Program:
    """`program` (a plan that recomputes nothing) with each value of `names`
    offloaded after forward's last use of it and reloaded right before
    backward's first, read back from its printed text (so every instruction
    has its line)."""
    fwd, bwd = list(program.forward), list(program.backward)
    producer = program.producer_map()
    for name in names:
        node = producer[name]
        c = next(i for i, ins in enumerate(fwd) if ins.kind == COMPUTE and ins.target == node.name)
        reads = [i for i, ins in enumerate(fwd) if i > c and _reads(program, ins, name)]
        last = reads[-1] if reads else c
        fwd.insert(last + 1, Instr(WAIT, name))
        fwd.insert(c + 1, Instr(OFFLOAD, name))
        first = next(i for i, ins in enumerate(bwd) if _reads(program, ins, name))
        bwd[first:first] = [Instr(RELOAD, name), Instr(WAIT, name)]
    out = msgspec.structs.replace(program, forward=fwd, backward=bwd)
    return parse_program(format_program(out), f"{program.header.model or 'plan'}-offload.rir")


def kept_values(program: Program) -> list[str]:
    """Values a forward node makes, that own their storage, are no output
    of the step, are written in place by no node, and are read in backward:
    what `with_offloads` may take, largest first."""
    values = program.value_map()
    producer = program.producer_map()
    outputs = {o.value for o in program.outputs if o.kind in (RESULT, GRAD)}
    mutated = {values[m].storage for n in program.nodes for m in n.mutates if m in values}
    read_in_backward = {r for n in program.nodes if n.phase != FORWARD for r in node_inputs(n)}
    out = [v for v in program.values
           if v.kind == VALUE and v.storage == v.name and v.name in producer
           and producer[v.name].phase == FORWARD and v.name not in outputs and v.name not in mutated
           and v.name in read_in_backward and v.nbytes != 0]
    # (a symbolic plan's byte counts are expressions: those keep their order)
    return [v.name for v in sorted(out, key=lambda v: -v.nbytes if isinstance(v.nbytes, int) else 0)]


def candidates(program: Program, limit: int | None = None) -> list[str]:
    """The values of `kept_values` whose offload alone verifies (no view of
    them live at forward's wait), largest first; at most `limit`."""
    from remat_ir.check.verify import verify

    out = []
    for name in kept_values(program):
        if verify(with_offloads(program, [name]), graph=False).ok:
            out.append(name)
            if limit is not None and len(out) == limit:
                break
    return out
