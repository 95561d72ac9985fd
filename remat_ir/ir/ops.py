"""Ops remat-ir adds to aten, so a plan can name them.

CPU dropout's mask is, in eager PyTorch, `empty_like(x).bernoulli_(p).div_(scale)`:
an in-place chain that would pin the mask in memory (it can't be recomputed
piecewise) and holds it in `x`'s dtype, four bytes an element for float32.
The tracer rewrites that chain into two functional ops with the same bits:

* `remat::dropout_keep(x, p)`: the random draw, `empty_like(x, bool).bernoulli_(p)`.
  It consumes the generator exactly as the float draw does (same elements,
  same order), so the RNG stream after it matches eager's.  Random: a
  recompute replays its RNG state.
* `remat::dropout_scale(keep, scale, dtype)`: eager's mask bit for bit.  It
  computes `1 / scale` once in `dtype` (eager's division of a kept element)
  and multiplies the draw's bytes by it, which gives the same bits for 0 and 1
  (signs, infinities and NaN included) at a third of the cost of converting
  and dividing; where `1 / scale` overflows (`0 * inf` is NaN, `0 / scale`
  is 0) it divides like eager.

The optimizer can then keep the one-byte draw into backward and recompute the
cheap scale there, instead of keeping the mask or drawing it again.

Cross-entropy's backward is, in eager PyTorch, `nll_loss_backward` (a
logits-sized gradient, zero but at the targets) then
`_log_softmax_backward_data` (another logits-sized tensor), with the saved
log-probabilities live beside both: three logits-sized tensors at once, the
largest moment of a language model's step once its blocks are checkpointed.
`remat::nll_log_softmax_backward` runs the same two kernels but writes the
second one's result over the first one's, which nothing else reads: two
logits-sized tensors.  ATen's CPU kernel reduces each row of its gradient
before it writes that row, element by element, so writing in place gives the
same bits (`tests/test_ops.py` checks it against eager for every dim, dtype and
reduction); the tracer fuses the pair only in CPU traces.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch.utils import _pytree as pytree

_lib = torch.library.Library("remat", "FRAGMENT")
_lib.define("dropout_keep(Tensor x, float p) -> Tensor")
_lib.define("dropout_scale(Tensor keep, float scale, ScalarType dtype) -> Tensor")


def _dropout_keep(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.bool).bernoulli_(p)


def _dropout_keep_meta(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.bool)


def _dropout_scale(keep: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    # `1 / scale` is made on the host: a 0-dim CPU tensor is a valid operand on
    # any device, and reading it back costs no device sync.
    kept = torch.ones((), dtype=dtype).div_(scale)
    if not math.isfinite(kept.item()):
        return keep.to(dtype).div_(scale)
    return keep.view(torch.uint8) * kept


def _dropout_scale_meta(keep: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(keep, dtype=dtype)


_lib.define("nll_log_softmax_backward(Tensor grad_output, Tensor self, Tensor target, Tensor? weight, "
            "int reduction, int ignore_index, Tensor total_weight, Tensor output, int dim, "
            "ScalarType input_dtype) -> Tensor")


def _nll_log_softmax_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight,
                              output, dim, input_dtype):
    aten = torch.ops.aten
    g = aten.nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)
    return aten._log_softmax_backward_data.out(g, output, dim, input_dtype, out=g)


def _nll_log_softmax_backward_meta(grad_output, self, target, weight, reduction, ignore_index, total_weight,
                                   output, dim, input_dtype):
    return torch.empty_like(self, memory_format=torch.contiguous_format)


_lib.impl("dropout_keep", _dropout_keep, "CompositeExplicitAutograd")
_lib.impl("dropout_keep", _dropout_keep_meta, "Meta")
_lib.impl("dropout_scale", _dropout_scale, "CompositeExplicitAutograd")
_lib.impl("dropout_scale", _dropout_scale_meta, "Meta")
_lib.impl("nll_log_softmax_backward", _nll_log_softmax_backward, "CompositeExplicitAutograd")
_lib.impl("nll_log_softmax_backward", _nll_log_softmax_backward_meta, "Meta")

dropout_keep = torch.ops.remat.dropout_keep.default
dropout_scale = torch.ops.remat.dropout_scale.default
nll_log_softmax_backward = torch.ops.remat.nll_log_softmax_backward.default
RANDOM_OPS = frozenset({dropout_keep})

# Ops that update operands in place (in training mode) without an alias
# annotation in their schema (BatchNorm's running stats): op name -> (index
# of the `training` flag, None: always; indices of the operands updated).
# The tracer marks them `mutates(...)`; the verifier's type check expects it.
HIDDEN_MUTATORS = {
    "aten.batch_norm_update_stats.default": (None, (1, 2)),
    "aten.native_batch_norm.default": (5, (3, 4)),
    "aten.cudnn_batch_norm.default": (5, (3, 4)),
    "aten.miopen_batch_norm.default": (5, (3, 4)),
}

# Ops a plan must not hold when it runs on CUDA: those with no CUDA kernel,
# and remat-ir's own ops, each proven bit-equal to eager on CPU only (CUDA
# eager draws dropout with the fused philox `native_dropout`, not `bernoulli_`;
# the in-place cross-entropy backward is checked against CPU's kernel).
CPU_ONLY_OPS = frozenset({
    "remat.dropout_keep.default",
    "remat.dropout_scale.default",
    "remat.nll_log_softmax_backward.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
})


def resolve(name: str):
    """The OpOverload a plan names (`ns.op.overload`; `remat.*` ops are this
    module's).  Raises AttributeError when this PyTorch build has none."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def torch_arg(a, ref, _depth: int = 0):
    """A node argument (`remat_ir.ir.Arg`) as the op takes it; `ref(name)`
    gives the tensor a value name stands for.  Raises ValueError for lists
    nested more than MAX_NESTING deep."""
    from remat_ir.ir.types import MAX_NESTING, Device, DType, Layout, MemoryFormat, Ref, Seq, Special

    if isinstance(a, Ref):
        return ref(a.name)
    if isinstance(a, Seq):
        if _depth == MAX_NESTING:
            raise ValueError(f"an argument has lists nested more than {MAX_NESTING} deep")
        return [torch_arg(x, ref, _depth + 1) for x in a.items]
    if isinstance(a, (DType, Layout, MemoryFormat)):
        return getattr(torch, a.name)
    if isinstance(a, Device):
        return torch.device(a.name)
    if isinstance(a, Special):
        return float(a.name)
    return a


def cpu_only(op: str) -> bool:
    """Whether the op named `op` (`ns.name.overload`) may run on CPU only:
    listed above, or one of ATen's CPU-specific kernels (`*_for_cpu*`,
    oneDNN's `mkldnn*`)."""
    name = op.split(".")[1] if op.count(".") >= 2 else op
    return op in CPU_ONLY_OPS or "_for_cpu" in name or "mkldnn" in name


def device_problems(ops, device: str) -> list[str]:
    """The ops of `ops` (names) a plan for `device` must not hold, each once,
    in order; empty when all may run there."""
    if torch.device(device).type == "cpu":
        return []
    return list(dict.fromkeys(op for op in ops if cpu_only(op)))


@contextlib.contextmanager
def autocast_off(device_types=("cpu", "cuda")):
    """Every autocast in effect for `device_types` switched off within the
    block: a program's ops carry their casts, so running them (on fake
    tensors or real) under a caller's autocast must not cast them again."""
    with contextlib.ExitStack() as stack:
        for d in device_types:
            if torch.is_autocast_enabled(d):
                stack.enter_context(torch.autocast(d, enabled=False))
        yield


@contextlib.contextmanager
def fake_kernels(device_type: str):
    """Fake kernels for ops whose meta function refuses what the device's
    kernel runs: `aten._grouped_mm`'s (written for CUDA) takes bfloat16
    only, where the CPU kernel takes any float (transformers' MoE experts in
    float32 run it).  The shapes come from the meta function itself, asked
    in bfloat16; the dtype is the operands'."""
    if device_type != "cpu" or not hasattr(torch.ops.aten, "_grouped_mm"):
        yield
        return
    from torch._subclasses import fake_impls

    grouped = torch.ops.aten._grouped_mm.default

    def grouped_mm(mode, func, mat_a, mat_b, *args, **kwargs):
        if mat_a.dtype == torch.bfloat16 or mat_a.dtype != mat_b.dtype or kwargs.get("out_dtype") is not None:
            return NotImplemented
        def meta(t, dtype=None):
            if not isinstance(t, torch.Tensor):
                return t
            return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="meta")

        with torch.utils._python_dispatch._disable_current_modes():
            shape = grouped(meta(mat_a, torch.bfloat16), meta(mat_b, torch.bfloat16),
                            *pytree.tree_map(meta, args), **pytree.tree_map(meta, kwargs))
        with mode:
            return torch.empty_strided(shape.shape, shape.stride(), dtype=mat_a.dtype, device=mat_a.device)

    entry = (lambda func: func is grouped, grouped_mm)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
