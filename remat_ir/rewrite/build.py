"""Editing a program's graph: new nodes whose output values are what the op
produces, found by running it under FakeTensorMode on the declared operands.

A rewrite states the ops it adds and their operands; dtype, shape, strides,
bytes and the storage owner of every output are derived here, never written
by hand, so they agree with what the interpreter will allocate.
"""
from __future__ import annotations

import msgspec
import torch

from remat_ir.ir import VALUE, Node, Output, Program, Value, node_inputs
from remat_ir.ir.fingerprint import fingerprint
from remat_ir.ir.ops import autocast_off, fake_kernels, resolve, torch_arg
from remat_ir.ir.schedule import default_schedule

__all__ = ["GraphEdit", "matmul_flops", "without_dead_views"]


class GraphEdit:
    """Nodes to add to `program`, each checked by a fake run as it is added."""

    def __init__(self, program: Program):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.program = program
        self.values = program.value_map()
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.fakes: dict[str, torch.Tensor] = {}
        self.owners: dict[int, str] = {}  # a fake storage -> the value that owns it
        self.taken = set(self.values) | {n.name for n in program.nodes}

    def _device_type(self) -> str:
        try:
            return torch.device(self.program.header.device).type
        except (RuntimeError, TypeError):
            return "cpu"

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def release(self, name: str) -> str:
        """Free the name of a value the rewrite drops, for the node that
        stands for it (readers outside the region keep reading that name)."""
        del self.values[name]
        self.taken.discard(name)
        return name

    def restore(self, rename: dict[str, str]) -> None:
        """Views of a value the rewrite renamed (old -> new name) view the
        storage by its new name."""
        for name, v in list(self.values.items()):
            if v.storage in rename and v.name != v.storage:
                self.values[name] = msgspec.structs.replace(v, storage=rename[v.storage])

    def fake(self, name: str) -> torch.Tensor:
        t = self.fakes.get(name)
        if t is None:
            v = self.values[name]
            with self.mode:
                if v.storage == v.name:
                    t = torch.empty_strided(v.shape, v.stride, dtype=getattr(torch, v.dtype))
                else:
                    t = self.fake(v.storage).as_strided(v.shape, v.stride)
            self._keep(name, t)
        return t

    def _keep(self, name: str, t: torch.Tensor) -> None:
        self.fakes[name] = t
        self.owners.setdefault(t.untyped_storage()._cdata, self.values[name].storage)

    def node(self, base: str, op: str, args: list, phase: str, module: str, *, mutates=(),
             flops=None, names: dict[int, str] | None = None) -> Node:
        """A new node named after `base` calling `op` on `args` (value names
        as `Ref`s), with its output values declared; not yet placed.
        `names`: output index -> the name of that output (one `release`d,
        which readers outside the region keep reading)."""
        name = self.unique(base)
        # (The op as written: an autocast the caller is in, wrap's first call
        # or its model check, must not cast it.)
        with autocast_off(), self.mode, fake_kernels(self._device_type()):  # as the tracer and checker run it
            out = resolve(op)(*[torch_arg(a, self.fake) for a in args])
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        given = names or {}
        if len(outs) == 1:
            names = [given.get(0) or name]
        else:
            names = [given.get(k) or self.unique(f"{name}:{k}") for k in range(len(outs))]
        self.taken.update(names)
        for vname, t in zip(names, outs):
            owner = self.owners.get(t.untyped_storage()._cdata)
            self.values[vname] = Value(name=vname, kind=VALUE, dtype=str(t.dtype).removeprefix("torch."),
                                       shape=list(t.shape), stride=list(t.stride()), storage=owner or vname,
                                       nbytes=0 if owner else t.untyped_storage().nbytes())
            self._keep(vname, t)
        if flops is None:
            flops = 0.0 if all(self.values[n].storage != n for n in names) else float(
                sum(t.numel() for t in outs))
        return Node(name=name, op=op, args=args, kwargs={}, outputs=names, phase=phase, module=module,
                    mutates=list(mutates), flops=float(flops))

    def program_of(self, nodes: list[Node], outputs: list[Output], rewrite: str) -> Program:
        """The rewritten program: `nodes`, the values they and the graph
        inputs name, `outputs`; the header names `rewrite` and the new
        fingerprint; the unoptimized schedule."""
        h = self.program.header
        header = msgspec.structs.replace(h, rewrites=list(h.rewrites) + [rewrite], comment=list(h.comment),
                                         lines={})
        alive = {o for n in nodes for o in n.outputs if o} | {v.name for v in self.program.values
                                                               if v.kind != VALUE}
        out = Program(header=header, values=[v for v in self.values.values() if v.name in alive], nodes=nodes,
                      forward=[], backward=[], outputs=outputs)
        out.header.fingerprint = fingerprint(out)
        out.forward, out.backward = default_schedule(out)
        return out


def without_dead_views(nodes: list[Node], kept: set, views, phase: str | None = None) -> list[Node]:
    """`nodes` less the nodes calling one of `views` (in `phase`, when given)
    that nothing reads any more, nor `kept` names: views only a removed
    region read."""
    while True:
        read = {i for n in nodes for i in node_inputs(n)} | kept
        dead = {n.name for n in nodes if n.op in views and (phase is None or n.phase == phase) and not n.mutates
                and not any(o in read for o in n.outputs if o)}
        if not dead:
            return nodes
        nodes = [n for n in nodes if n.name not in dead]


def matmul_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n
