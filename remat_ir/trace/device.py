"""The device a plan runs on: the fusions proven there, the device-neutral
trace, retargeting.

Fusions of the traced joint graph replace patterns of eager PyTorch's
step by remat-ir's own ops (`remat_ir.ir.ops`), each giving eager's bits
exactly but cheaper to keep or recompute; each is applied only on a device
where it is proven bit-equal (`FUSIONS`: CPU only, so far).

    rewrite(gm, device)     the fusions proven on `device`, in place, on a make_fx GraphModule
    device_neutral()        while tracing on CPU for CUDA: SDPA by its math backend,
                            dropout by native_dropout (what CUDA's eager dropout calls)
    retarget(program, dev)  a program's device arguments pointed at `dev`; refuses
                            ops that cannot run there
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch.overrides import TorchFunctionMode

from remat_ir.ir.ops import device_problems, dropout_keep, dropout_scale, nll_log_softmax_backward

# Device type -> the fusions proven bit-equal to eager there (tests/test_ops.py
# checks CPU's).  A CUDA entry waits for a measurement on a GPU
# (tools/gpu_probe.py compares the fused cross-entropy backward's bits).
FUSIONS = {"cpu": ("dropout_masks", "cross_entropy_backward")}

# The plan header's comment line that marks a device-neutral trace (read by
# `is_neutral`, so a retrace for comparison is traced the same way).
NEUTRAL_NOTE = ("device-neutral trace (made on CPU for CUDA): attention by SDPA's math backend, "
                "dropout by native_dropout")


class DeviceError(ValueError):
    """A plan holds ops that cannot run on the device it is meant for."""


def rewrite(gm, device: str = "cpu", fuse: bool = True) -> None:
    """Apply to `gm`'s graph, in place, the fusions proven on `device` (none
    when not `fuse`: the graph then stays eager's own)."""
    proven = FUSIONS.get(torch.device(device).type, ()) if fuse else ()
    if "dropout_masks" in proven:
        _fuse_dropout_masks(gm)
    if "cross_entropy_backward" in proven:
        fuse_cross_entropy_backward(gm)


def retarget(program, device: str):
    """`program`, traced for one device type, with its `device=` arguments and
    header pointed at `device`, in place.  Refuses (DeviceError) a program
    holding ops that cannot run there, by name: trace for the device instead
    (`trace_module(..., device=...)`)."""
    from remat_ir import ir
    from remat_ir.ir.fingerprint import fingerprint

    bad = device_problems([n.op for n in program.nodes], device)
    if bad:
        raise DeviceError(f"the plan holds ops that cannot run on {device} as eager would: "
                          f"{', '.join(bad)}; trace it for {device} instead (device='{device}')")
    target = canonical_device(device)

    def fix(a):
        if isinstance(a, ir.Device):
            return ir.Device(target if torch.device(a.name).type != torch.device(device).type else a.name)
        if isinstance(a, ir.Seq):
            return ir.Seq([fix(x) for x in a.items])
        return a

    for n in program.nodes:
        n.args = [fix(a) for a in n.args]
        n.kwargs = {k: fix(v) for k, v in n.kwargs.items()}
    program.header.device = torch.device(device).type
    program.header.fingerprint = fingerprint(program)
    return program


def canonical_device(device: str) -> str:
    """The device as a trace on it names it: `cuda` -> `cuda:0`, `cpu` -> `cpu`."""
    d = torch.device(device)
    return str(d) if d.type == "cpu" or d.index is not None else f"{d.type}:0"


def is_neutral(program) -> bool:
    """Whether `program` was traced device-neutral (see `device_neutral`)."""
    return NEUTRAL_NOTE in program.header.comment


class _DeviceNeutral(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            return _dropout(*args, **kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _sdpa_math(*args, **kwargs)
        return func(*args, **kwargs)


def device_neutral(enabled: bool = True):
    """When `enabled`, a context in which the model's forward records what it
    would on CUDA where CPU would record something else: dropout is
    `native_dropout` (CPU's eager dropout is an in-place `bernoulli_` chain),
    attention by SDPA is its math backend (CPU's eager SDPA may take a
    CPU-only flash kernel; CUDA's fused kernels cannot be traced without a
    CUDA build).  Ops called from C++ composites (an RNN's dropout) are not
    reached."""
    return _DeviceNeutral() if enabled else contextlib.nullcontext()


def _dropout(input, p=0.5, training=True, inplace=False):
    if training and 0 < p < 1 and input.numel() > 0 and not inplace:
        return torch.ops.aten.native_dropout.default(input, p, True)[0]
    return torch.nn.functional.dropout(input, p, training, inplace)


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """ATen's math backend of SDPA (`_scaled_dot_product_attention_math`, as
    traced), op for op, with its dropout drawn by `native_dropout` (as its
    `at::dropout` does on CUDA)."""
    aten = torch.ops.aten
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                                torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device))
    s = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    factor = math.sqrt(abs(s))
    q = aten.mul.Scalar(query, -factor if s < 0 else factor)
    if is_causal:
        if attn_mask is not None:
            raise ValueError("scaled_dot_product_attention: pass is_causal or attn_mask, not both")
        causal = torch.ones(q.size(-2), key.size(-2), dtype=torch.bool, device=q.device).tril()
        attn_mask = torch.where(causal, torch.scalar_tensor(0.0, dtype=q.dtype, device=q.device),
                                torch.scalar_tensor(-math.inf, dtype=q.dtype, device=q.device))
    k, v = key, value
    if enable_gqa and q.size(-3) != k.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    attn = torch.matmul(q, aten.mul.Scalar(k.transpose(-2, -1), factor))
    if attn_mask is not None:
        attn = attn.add(attn_mask)
    attn = aten._safe_softmax.default(attn, -1)
    if dropout_p > 0.0:
        attn = aten.native_dropout.default(attn, dropout_p, True)[0]
    return torch.matmul(attn, v)


def _sole_producer(node, consumer, producer, nargs: int):
    """`node`'s first operand when `node` calls `consumer` (no keyword
    arguments) and that operand is a call of `producer` with `nargs`
    positional arguments and no keywords that only `node` reads: the pairs
    the functions below fuse.  Else None."""
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


def fuse_cross_entropy_backward(gm) -> None:
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
        numel = sv.numel()  # (in a symbolic trace, at the traced sizes: float() of a size would fix it)
        fused.meta["flops"] = float(2 * (numel.node.hint if isinstance(numel, torch.SymInt) else numel))  # the two kernels'
        s.replace_all_uses_with(fused)
        g.erase_node(s)
        g.erase_node(n)
    g.lint()
