"""Graph rewrites of the traced joint graph: patterns of eager PyTorch's step
replaced by remat-ir's own ops (`remat_ir.ir.ops`), each giving eager's bits
exactly but cheaper to keep or recompute.

    rewrite(gm)     every rewrite below, in place, on a make_fx GraphModule
"""
from __future__ import annotations

import contextlib

import torch

from remat_ir.ir.ops import dropout_keep, dropout_scale, nll_log_softmax_backward


def rewrite(gm) -> None:
    """Apply the rewrites to `gm`'s graph, in place."""
    _fuse_dropout_masks(gm)
    _fuse_cross_entropy_backward(gm)


def _sole_producer(node, consumer, producer, nargs: int):
    """`node`'s first operand when `node` calls `consumer` (no keyword
    arguments) and that operand is a call of `producer` with `nargs`
    positional arguments and no keywords that only `node` reads: the pairs
    the rewrites below fuse.  Else None."""
    if node.op != "call_function" or node.target is not consumer or node.kwargs or not node.args:
        return None
    p = node.args[0]
    if (isinstance(p, torch.fx.Node) and p.target is producer and len(p.users) == 1 and not p.kwargs
            and len(p.args) == nargs):
        return p
    return None


def _fuse_dropout_masks(gm) -> None:
    """`empty_like(x) -> bernoulli_(p) -> div_(s)` (CPU dropout's mask) becomes
    `keep = remat.dropout_keep(x, p)` (a one-byte draw) and
    `remat.dropout_scale(keep, s, dtype)` (the mask); see remat_ir/ir/ops.py."""
    aten = torch.ops.aten
    g = gm.graph
    for d in list(g.nodes):
        b = _sole_producer(d, aten.div_.Scalar, aten.bernoulli_.float, 2)
        if b is None:
            continue
        e = b.args[0]
        if not (isinstance(e, torch.fx.Node) and e.target is aten.empty_like.default and len(e.users) == 1
                and len(e.args) == 1 and set(e.kwargs) <= {"memory_format"}
                and e.kwargs.get("memory_format", torch.preserve_format) is torch.preserve_format):
            continue
        mask = d.meta.get("val")
        if not (isinstance(mask, torch.Tensor) and mask.device.type == "cpu"):
            continue  # the one-byte draw is checked against CPU's bernoulli_ only
        with g.inserting_before(d):
            keep = g.call_function(dropout_keep, (e.args[0], b.args[1]))
            scaled = g.call_function(dropout_scale, (keep, d.args[1], mask.dtype))
        keep.meta = dict(d.meta)
        with getattr(mask, "fake_mode", None) or contextlib.nullcontext():
            keep.meta["val"] = torch.empty_like(mask, dtype=torch.bool)
        scaled.meta = dict(d.meta)
        d.replace_all_uses_with(scaled)
        for n in (d, b, e):
            g.erase_node(n)
    g.lint()


def _fuse_cross_entropy_backward(gm) -> None:
    """`nll_loss_backward` whose only reader is `_log_softmax_backward_data`
    becomes one `remat.nll_log_softmax_backward` that writes the second result
    over the first (one logits-sized tensor fewer; see remat_ir/ir/ops.py).  CPU
    only: that is the kernel whose in-place run is checked bit for bit."""
    aten = torch.ops.aten
    g = gm.graph
    for s in list(g.nodes):
        n = _sole_producer(s, aten._log_softmax_backward_data.default, aten.nll_loss_backward.default, 7)
        if n is None:
            continue
        nv, sv = n.meta.get("val"), s.meta.get("val")
        if not (isinstance(nv, torch.Tensor) and isinstance(sv, torch.Tensor) and nv.device.type == "cpu"
                and nv.dtype == sv.dtype and nv.shape == sv.shape and nv.stride() == sv.stride()
                and nv.is_contiguous()):
            continue
        with g.inserting_before(s):
            fused = g.call_function(nll_log_softmax_backward, (*n.args, *s.args[1:]))
        fused.meta = dict(s.meta)
        fused.meta["flops"] = float(2 * sv.numel())  # the two kernels'
        s.replace_all_uses_with(fused)
        g.erase_node(s)
        g.erase_node(n)
    g.lint()
