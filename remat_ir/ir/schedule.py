"""The schedule autograd would use: compute every node once, in graph order,
and free every value right after its last use.

This is the baseline a plan starts from; the optimizer rewrites it.
"""
from __future__ import annotations

from remat_ir.ir import BACKWARD, COMPUTE, FORWARD, FREE, VALUE, Instr, Program, node_inputs


def default_schedule(program: Program) -> tuple[list[Instr], list[Instr]]:
    """Forward and backward instruction lists for `program`'s nodes, in order.

    A value is freed right after the instruction that last reads it (or right
    after it is produced, when nothing reads it), in the phase that instruction
    belongs to.  Forward results and gradient outputs are never freed: the
    caller and autograd take them.
    """
    values = program.value_map()
    kept = {o.value for o in program.outputs}
    order = [n for n in program.nodes if n.phase == FORWARD] + [n for n in program.nodes if n.phase == BACKWARD]
    last_use: dict[str, int] = {}
    for i, node in enumerate(order):
        for name in node_inputs(node):
            last_use[name] = i
        for out in node.outputs:
            if out:
                last_use.setdefault(out, i)
    # Tangents are freed after their last use as well.
    frees_after: dict[int, list[str]] = {}
    for name, i in last_use.items():
        v = values[name]
        if name in kept or v.kind not in (VALUE, "tangent"):
            continue
        frees_after.setdefault(i, []).append(name)
    fwd: list[Instr] = []
    # A tangent nothing reads is dropped as soon as it arrives.
    bwd: list[Instr] = [Instr(FREE, v.name) for v in program.values
                        if v.kind == "tangent" and v.name not in last_use]
    for i, node in enumerate(order):
        target = fwd if node.phase == FORWARD else bwd
        target.append(Instr(COMPUTE, node.name))
        for name in frees_after.get(i, ()):
            target.append(Instr(FREE, name))
    return fwd, bwd
