"""Editing a program's graph: new nodes whose output values are what the op
produces, found by running it under FakeTensorMode on the declared operands.

A rewrite states the ops it adds and their operands; dtype, shape, strides,
bytes and the storage owner of every output are derived here, never written
by hand, so they agree with what the interpreter will allocate.
"""
from __future__ import annotations

import torch

from remat_ir.ir import VALUE, Node, Program, Ref, Seq, Value, contiguous_stride
from remat_ir.ir.types import DTYPE_BYTES, Arg, Device, DType, Layout, MemoryFormat, Special


def _op(name: str):
    if name.startswith("remat."):
        import remat_ir.ir.ops  # noqa: F401 - registers torch.ops.remat
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


class GraphEdit:
    """Nodes to add to `program`, each checked by a fake run as it is added."""

    def __init__(self, program: Program):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.program = program
        self.values = program.value_map()
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.fakes: dict[str, torch.Tensor] = {}
        self.taken = set(self.values) | {n.name for n in program.nodes}

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def fake(self, name: str) -> torch.Tensor:
        t = self.fakes.get(name)
        if t is None:
            v = self.values[name]
            dtype = getattr(torch, v.dtype)
            with self.mode:
                if v.storage == v.name:
                    t = torch.empty_strided(v.shape, v.stride, dtype=dtype)
                else:
                    owner = self.fake(v.storage)
                    t = owner.as_strided(v.shape, v.stride)
            self.fakes[name] = t
        return t

    def _real(self, a: Arg):
        if isinstance(a, Ref):
            return self.fake(a.name)
        if isinstance(a, Seq):
            return [self._real(x) for x in a.items]
        if isinstance(a, DType):
            return getattr(torch, a.name)
        if isinstance(a, (Layout, MemoryFormat)):
            return getattr(torch, a.name)
        if isinstance(a, Device):
            return torch.device(a.name)
        if isinstance(a, Special):
            return float(a.name)
        return a

    def node(self, base: str, op: str, args: list, phase: str, module: str, *, mutates=(), flops=None,
             outputs: int | None = None) -> Node:
        """A new node named after `base` calling `op` on `args` (value names
        as `Ref`s), with its output values declared; not yet placed."""
        name = self.unique(base)
        with self.mode:
            out = _op(op)(*[self._real(a) for a in args])
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if outputs is not None:
            outs = outs[:outputs]
        names = [name] if len(outs) == 1 else [self.unique(f"{name}:{k}") for k in range(len(outs))]
        storages = {}
        for n in self.fakes:
            try:
                storages.setdefault(self.fakes[n].untyped_storage()._cdata, self.values[n].storage)
            except RuntimeError:
                pass
        for vname, t in zip(names, outs):
            owner = storages.get(t.untyped_storage()._cdata)
            nbytes = 0 if owner else t.untyped_storage().nbytes()
            v = Value(name=vname, kind=VALUE, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                      stride=list(t.stride()), storage=owner or vname, nbytes=nbytes)
            self.values[vname] = v
            self.fakes[vname] = t
        if flops is None:
            flops = 0.0 if all(self.values[n].storage != n for n in names) else float(
                sum(t.numel() for t in outs))
        return Node(name=name, op=op, args=args, kwargs={}, outputs=names, phase=phase, module=module,
                    mutates=list(mutates), flops=float(flops))

    def declared(self) -> list[Value]:
        """The program's values in order, then the new ones in order of creation."""
        return list(self.values.values())


def matmul_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


__all__ = ["GraphEdit", "matmul_flops", "DTYPE_BYTES", "contiguous_stride"]
