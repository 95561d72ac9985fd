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

Below that, the log-probabilities themselves are the floor: eager holds the
logits and their log-softmax in forward, the log-softmax and its gradient in
backward.  `remat::lm_head_nll` and `remat::lm_head_nll_backward` run the
loss over rows, `rows` at a time, through one chunk-sized scratch buffer, so
no logits-sized tensor lives between forward and backward; backward computes
each chunk's log-probabilities again, straight into the rows of the gradient
it returns, and writes the gradient over them.  With `weight_t` they start
from the LM head's input (`input @ weight_t (+ bias)`, the matmul chunk by
chunk), without it from the logits.  Every element gets eager's bits:
log-softmax and its backward reduce within a row; `nll_loss_forward` sums the
picked log-probabilities (gathered into an [N, 2] tensor, with targets
remapped to a column) in its own order; a matmul's row does not depend on how
many rows are computed with it (checked for chunks of 12 rows and more on
CPU: chunks are at least 16 rows, the last takes the remainder).  What a
chunk needs beyond its inputs is returned (`picked`, `classes`, `scratch`),
so a plan counts it.
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


_lib.define("lm_head_nll(Tensor input, Tensor? weight_t, Tensor? bias, Tensor target, int reduction, "
            "int ignore_index, int rows) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_lib.define("lm_head_nll_backward(Tensor grad_output, Tensor input, Tensor? weight_t, Tensor? bias, "
            "Tensor target, int reduction, int ignore_index, Tensor total_weight, int dim, "
            "ScalarType input_dtype, int rows) -> (Tensor, Tensor)")


# The chunked loss's scratch buffer is about this size (a chunk's log-probabilities).
LOSS_SCRATCH_BYTES = 1 << 20
# Chunks are at least this many rows: a matmul's rows are checked bit-equal from 12 at a time.
MIN_LOSS_ROWS = 16


def loss_rows(n: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk of the chunked loss over `n` rows of `vocab` classes:
    a sixteenth of the rows, at most a scratch of about LOSS_SCRATCH_BYTES,
    a multiple of 16 and at least MIN_LOSS_ROWS."""
    rows = min(n // 16, LOSS_SCRATCH_BYTES // max(1, vocab * itemsize))
    return max(MIN_LOSS_ROWS, rows // 16 * 16)


def loss_spans(n: int, rows: int) -> list[tuple[int, int]]:
    """The row ranges of the chunked loss: `rows` each, the last one taking
    the remainder (so no chunk but a single one has fewer than `rows`)."""
    starts = list(range(0, n, max(1, rows)))
    if len(starts) > 1 and n - starts[-1] < rows:
        starts.pop()
    return list(zip(starts, starts[1:] + [n]))


def _log_probs(input, weight_t, bias, a: int, b: int, out) -> None:
    """Rows a:b of log_softmax(input (@ weight_t + bias)) written into `out`."""
    aten = torch.ops.aten
    if weight_t is None:
        aten._log_softmax.out(input[a:b], 1, False, out=out)
        return
    if bias is None:
        torch.mm(input[a:b], weight_t, out=out)
    else:
        torch.addmm(bias, input[a:b], weight_t, out=out)
    aten._log_softmax.out(out, 1, False, out=out)  # in place: each row is reduced before it is written


def _loss_layout(input, weight_t, rows):
    """(rows N, vocabulary, the chunks' row spans, the scratch's shape)."""
    n = input.shape[0]
    vocab = input.shape[1] if weight_t is None else weight_t.shape[1]
    spans = loss_spans(n, rows)
    return n, vocab, spans, (max(b - a for a, b in spans), vocab)


def _lm_head_nll(input, weight_t, bias, target, reduction, ignore_index, rows):
    n, vocab, spans, scratch_shape = _loss_layout(input, weight_t, rows)
    scratch = input.new_empty(scratch_shape)
    picked = input.new_empty((n, 2))
    classes = torch.empty_like(target)
    column = 1 if ignore_index == 0 else 0  # any column but the ignored class: both hold the pick
    for a, b in spans:
        out = scratch[:b - a]
        _log_probs(input, weight_t, bias, a, b, out)
        t = target[a:b]
        ignored = t == ignore_index
        if bool(((t < 0) | (t >= vocab)).logical_and_(ignored.logical_not()).any()):
            raise IndexError(f"Target {int(t[(t < 0) | (t >= vocab)][0])} is out of bounds.")
        torch.gather(out, 1, t.clamp(0, vocab - 1).unsqueeze(1).expand(b - a, 2), out=picked[a:b])
        classes[a:b].copy_(t).masked_fill_(ignored.logical_not_(), column)  # ignored rows keep theirs
    loss, total_weight = torch.ops.aten.nll_loss_forward(picked, classes, None, reduction, ignore_index)
    return loss, total_weight, picked, classes, scratch


def _lm_head_nll_meta(input, weight_t, bias, target, reduction, ignore_index, rows):
    n, _, _, scratch_shape = _loss_layout(input, weight_t, rows)
    loss = input.new_empty(() if reduction else (n,))
    return (loss, input.new_empty(()), input.new_empty((n, 2)), torch.empty_like(target),
            input.new_empty(scratch_shape))


def _lm_head_nll_backward(grad_output, input, weight_t, bias, target, reduction, ignore_index, total_weight,
                          dim, input_dtype, rows):
    aten = torch.ops.aten
    n, vocab, spans, scratch_shape = _loss_layout(input, weight_t, rows)
    grad = input.new_empty((n, vocab))
    scratch = input.new_empty(scratch_shape)
    for a, b in spans:
        lp = grad[a:b]
        _log_probs(input, weight_t, bias, a, b, lp)
        g = scratch[:b - a]
        aten.nll_loss_backward.grad_input(grad_output, lp, target[a:b], None, reduction, ignore_index,
                                          total_weight, grad_input=g)
        aten._log_softmax_backward_data.out(g, lp, dim, input_dtype, out=lp)  # over the log-probabilities
    return grad, scratch


def _lm_head_nll_backward_meta(grad_output, input, weight_t, bias, target, reduction, ignore_index,
                               total_weight, dim, input_dtype, rows):
    n, vocab, _, scratch_shape = _loss_layout(input, weight_t, rows)
    return input.new_empty((n, vocab)), input.new_empty(scratch_shape)


_lib.impl("dropout_keep", _dropout_keep, "CompositeExplicitAutograd")
_lib.impl("dropout_keep", _dropout_keep_meta, "Meta")
_lib.impl("dropout_scale", _dropout_scale, "CompositeExplicitAutograd")
_lib.impl("dropout_scale", _dropout_scale_meta, "Meta")
_lib.impl("nll_log_softmax_backward", _nll_log_softmax_backward, "CompositeExplicitAutograd")
_lib.impl("nll_log_softmax_backward", _nll_log_softmax_backward_meta, "Meta")
_lib.impl("lm_head_nll", _lm_head_nll, "CompositeExplicitAutograd")
_lib.impl("lm_head_nll", _lm_head_nll_meta, "Meta")
_lib.impl("lm_head_nll_backward", _lm_head_nll_backward, "CompositeExplicitAutograd")
_lib.impl("lm_head_nll_backward", _lm_head_nll_backward_meta, "Meta")

dropout_keep = torch.ops.remat.dropout_keep.default
dropout_scale = torch.ops.remat.dropout_scale.default
nll_log_softmax_backward = torch.ops.remat.nll_log_softmax_backward.default
lm_head_nll = torch.ops.remat.lm_head_nll.default
lm_head_nll_backward = torch.ops.remat.lm_head_nll_backward.default
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
    "remat.lm_head_nll.default",
    "remat.lm_head_nll_backward.default",
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


def _fast_setup_strides(func, args, kwargs, outs):
    """The strides eager's TensorIterator gives the results of the pointwise
    op `func` where its "fast setup" applies, else None.  When every operand
    has the results' shape (a Python number in a Tensor argument is a 0-dim
    operand, so none does then) and all are contiguous, the results are
    allocated contiguous; all channels-last: channels-last; all dense with
    one set of strides: those strides.  Fake tensors' meta functions (the
    Python refs') tell these cases apart otherwise where sizes of 1 make
    strides ambiguous: a (N, C, 1, 1) tensor with channels-last strides
    (C, 1, C, C) is contiguous too, and eager's GELU of it has strides (C, 1,
    1, 1) where the meta function keeps (C, 1, C, C).  Code that branches on
    strides then takes another path in the trace (`adaptive_avg_pool2d` to
    1 x 1 restrides its result with `as_strided_` when its input "suggests"
    channels-last: timm's ConvNeXt on 32 x 32 images)."""
    if torch.Tag.pointwise not in func.tags and func not in _ITERATOR or func._schema.is_mutable \
            or func in _NOT_ITERATOR:
        return None
    arguments = func._schema.arguments
    if func._overloadname.startswith("Scalar") and hasattr(func.overloadpacket, "Tensor") and sum(
            isinstance(a.type, torch.TensorType) for a in arguments) == 1:
        return None  # `mul.Scalar`, `gt.Scalar`: the number is a 0-dim operand, as in `mul.Tensor`
    shape = outs[0].shape
    ins = []
    for a, v in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                          func._schema.arguments[len(args):]]):
        tensor_arg = isinstance(a.type, torch.TensorType) or isinstance(a.type, torch.OptionalType) and \
            isinstance(a.type.getElementType(), torch.TensorType)
        if isinstance(v, torch.Tensor):
            ins.append(v)
        elif tensor_arg and v is not None:  # a number: a 0-dim operand
            return None
    if not ins or not all(_same_sizes(t.shape, shape) for t in ins + outs) \
            or any(t.layout != torch.strided for t in ins):
        return None
    if all(t.is_contiguous() for t in ins):
        return torch._prims_common.make_contiguous_strides_for(shape)
    if len(shape) in (4, 5):
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        if all(t.is_contiguous(memory_format=fmt) for t in ins):
            return torch._prims_common.make_channels_last_strides_for(shape)
    if all(torch._prims_common.is_non_overlapping_and_dense_or_false(t) and _same_sizes(t.stride(), ins[0].stride())
           for t in ins):
        return ins[0].stride()
    return None


def _same_sizes(a, b) -> bool:
    """Whether two shapes (or strides) are equal for every size a symbolic
    trace stands for, adding no guard: ranks first (a tuple comparison of a
    bias's (d,) with a matmul's (B*T, d) compares B*T with d, and guards on
    it when they are equal at this call), then each size provably equal."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


# Pointwise ops whose eager kernel allocates with `empty_like` (the input's
# strides), not through TensorIterator's fast setup; and ops whose results are
# contiguous whatever the input's layout (`masked_fill`: a contiguous clone
# filled in place; layer norm's, where its meta function keeps the strides of
# an input that is contiguous but strided otherwise, as sizes of 1 allow).
_NOT_ITERATOR = {torch.ops.aten.hardtanh.default, torch.ops.aten.fill.Scalar, torch.ops.aten.fill.Tensor,
                 torch.ops.aten.clone.default, torch.ops.aten.nan_to_num.default}
# TensorIterator ops that are not tagged pointwise.
_ITERATOR = {getattr(torch.ops.aten, name).default for name in (
    "hardswish", "hardswish_backward", "hardsigmoid_backward", "leaky_relu_backward", "elu_backward",
    "hardtanh_backward", "softplus_backward", "softshrink_backward", "threshold", "mish_backward")}
_CONTIGUOUS = {torch.ops.aten.masked_fill.Scalar, torch.ops.aten.masked_fill.Tensor, torch.ops.aten.pow.Scalar,
               torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_layer_norm_backward.default}


@contextlib.contextmanager
def _eager_strides():
    """Fake tensors' results with the strides eager gives them: pointwise
    ops' (`_fast_setup_strides`), and those of the ops in `_CONTIGUOUS`.  The
    results are restrided inside FakeTensorMode's dispatch, below make_fx's
    tracing mode, so a trace records the op alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dispatch = FakeTensorMode.dispatch

    def eager_strided(mode, func, types, args=(), kwargs=None):
        out = dispatch(mode, func, types, args, kwargs)
        kwargs = kwargs or {}
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or func._schema.is_mutable or func.is_view:
            return out
        ins = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        strides = None if func in _CONTIGUOUS else _fast_setup_strides(func, args, kwargs, outs)
        for t in outs:
            want = strides
            if func in _CONTIGUOUS and t.layout == torch.strided and \
                    torch._prims_common.is_non_overlapping_and_dense_or_false(t):
                want = torch._prims_common.make_contiguous_strides_for(t.shape)
            if want is not None and id(t) not in ins and tuple(t.stride()) != tuple(want):
                t.as_strided_(t.shape, want)  # a fresh result: its storage holds it either way
        return out

    FakeTensorMode.dispatch = eager_strided
    try:
        yield
    finally:
        FakeTensorMode.dispatch = dispatch


@contextlib.contextmanager
def fake_kernels(device_type: str):
    """Fake kernels for ops whose meta function refuses what the device's
    kernel runs: `aten._grouped_mm`'s (written for CUDA) takes bfloat16
    only, where the CPU kernel takes any float (transformers' MoE experts in
    float32 run it).  The shapes come from the meta function itself, asked
    in bfloat16; the dtype is the operands'.  Results get the strides eager
    gives them where sizes of 1 leave them ambiguous (`_eager_strides`)."""
    with _eager_strides(), _grouped_mm_kernel(device_type):
        yield


@contextlib.contextmanager
def _grouped_mm_kernel(device_type: str):
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
