"""Is the traced step eager's step?  Compare their aten ops.

A plan runs the step the tracer saw.  Where the model's code can tell a
trace from a real call (fake tensors, tracing flags, kernels that differ),
that step can be another program than the one eager runs.  `compare` runs
one step eagerly on the real model and inputs, recording every aten op with
a `TorchDispatchMode`, traces the same call as a plan would be (without the
tracer's fusions, so its ops are eager's), and reports the first op where
the two differ, with its module path.

The eager step is the one the trace holds: forward, the loss, then
`torch.autograd.grad` of the forward results (the loss) against the
trainable parameters and the inputs that require grad, with ones as their
gradients; it allocates the model's activations, so use small configs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from remat_ir.trace.calls import split_call
from remat_ir.trace.guards import storage_of, written_tensors
from remat_ir.trace.tracer import backward, model_params, trace_module

__all__ = ["Fidelity", "compare", "eager_ops"]

# Ops that only say who owns a tensor: make_fx does not record them.
_BOOKKEEPING = {"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default",
                "aten.lift_fresh_copy.default"}
# A tensor constant the model makes (`torch.tensor(0.5)`) is no op in eager
# and an `aten.full` in the trace (`remat_ir.trace.tracer`): fills are not
# compared.
_CONSTANTS = {"aten.full.default"}


@dataclass
class Fidelity:
    """`eager` and `traced`: the op names of each step, in order; `difference`:
    the first one, in words ("" when the steps are the same)."""

    eager: list[str]
    traced: list[str]
    difference: str

    @property
    def same(self) -> bool:
        return not self.difference


def _view(t: torch.Tensor) -> tuple:
    return storage_of(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


class _Record(TorchDispatchMode):
    """Each op with the ops whose results it read, so that ops whose results
    the step never uses (the trace holds none) can be left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.deps: list[list[int]] = []
        self.root: list[bool] = []
        # A tensor as a view of its storage -> the op that returned it (autograd may
        # hand the caller another tensor object for the same view).
        self.made: dict[tuple, int] = {}
        # A tensor -> the op that returned it: two views alike (CLIP's `logits.t()`
        # and `logits.T`) are two ops, and the caller's tensor is one of them.
        self.made_by_id: dict[int, int] = {}
        self.written: dict[int, int] = {}  # storage -> the op that last wrote into it in place
        self.fresh: set[int] = set()  # storages the step allocated
        self.keep: list = []  # the tensors seen, so their ids and storages stay theirs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.keep += outs
        if str(func) in _BOOKKEEPING:
            return out
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        k = len(self.ops)
        self.ops.append(str(func))
        self.deps.append(self._sources(ins))
        written = written_tensors(func, args, kwargs)
        # Random draws, and writes into memory that existed before the step
        # (buffers), happen whether or not the step reads them.
        self.root.append(torch.Tag.nondeterministic_seeded in func.tags
                         or any(storage_of(t) not in self.fresh for t in written))
        for t in written:
            self.written[storage_of(t)] = k
        aliasing = func.is_view or any(r.alias_info is not None for r in func._schema.returns)
        for t in outs:
            self.made[_view(t)] = k
            self.made_by_id[id(t)] = k
            if not aliasing:
                self.fresh.add(storage_of(t))
        self.keep += ins
        return out

    def _sources(self, tensors) -> list[int]:
        out = [self.made_by_id.get(id(t), self.made.get(_view(t))) for t in tensors]
        out = [k for k in out if k is not None]
        return out + [self.written[storage_of(t)] for t in tensors if storage_of(t) in self.written]

    def used(self, results) -> list[str]:
        """The ops that `results` (tensors) depend on, and the roots, in order."""
        live = set()
        work = self._sources(results)
        work += [k for k, r in enumerate(self.root) if r]
        while work:
            k = work.pop()
            if k not in live:
                live.add(k)
                work.extend(self.deps[k])
        return [op for k, op in enumerate(self.ops) if k in live]


def eager_ops(model: torch.nn.Module, args=(), kwargs=None, loss_fn=None) -> list[str]:
    """The aten ops of one eager training step of `model(*args, **kwargs)`
    (see the module's docstring) that contribute to its results, gradients
    or state, in the order they ran.  The RNG state and the parameters'
    `.grad` are left as they were."""
    call = split_call(model, args, kwargs)
    a, k = call.rebuild(call.tensors)
    trainable = [p for _, p, _ in model_params(model) if p.requires_grad]
    wrt = trainable + [x for x in call.tensors if x.requires_grad]
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[]):
            rec = _Record()
            with rec:
                out = model(*a, **k)
                if loss_fn is not None:
                    out = loss_fn(out, *a, **k)
            leaves = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            tangents = [torch.ones_like(o) for o in leaves]  # the trace's inputs, not its ops
            with rec:
                grads = backward(leaves, wrt, tangents)
    finally:
        model.train(was_training)
    return rec.used(leaves + [g for g in grads if g is not None])


def compare(model: torch.nn.Module, args=(), kwargs=None, loss_fn=None) -> Fidelity:
    """The eager step and the traced step of the same call, side by side."""
    if not isinstance(args, (tuple, list)):
        args = (args,)
    program = trace_module(model, tuple(args), kwargs=kwargs, loss_fn=loss_fn, fuse=False)
    # The trace's ops in its own order (graph order: forward, then backward).
    nodes = [n for n in program.nodes if n.op not in _BOOKKEEPING and n.op not in _CONSTANTS]
    traced, modules, phases = [n.op for n in nodes], [n.module for n in nodes], [n.phase for n in nodes]
    eager = eager_ops(model, args, kwargs, loss_fn)
    eager = [op for op in eager if op not in _CONSTANTS]
    return Fidelity(eager, traced, _first_difference(eager, traced, modules, phases))


def _first_difference(eager: list[str], traced: list[str], modules: list[str], phases: list[str]) -> str:
    for i, (e, t) in enumerate(zip(eager, traced)):
        if e != t:
            where = f"{phases[i]} op {i}" + (f" in {modules[i]}" if modules[i] else "")
            return (f"at {where}: eager runs {e}, the trace runs {t} "
                    f"(next eager: {', '.join(eager[i + 1:i + 4]) or 'none'}; "
                    f"next traced: {', '.join(traced[i + 1:i + 4]) or 'none'})")
    if len(eager) != len(traced):
        longer, name = (eager, "eager") if len(eager) > len(traced) else (traced, "the trace")
        n = min(len(eager), len(traced))
        return f"{name} runs {len(longer) - n} more ops, from {longer[n]}"
    return ""
