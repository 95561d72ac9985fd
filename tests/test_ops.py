"""The ops remat-ir adds to aten give eager PyTorch's bits (remat_ir/ir/ops.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from remat_ir.ir.ops import (
    dropout_keep, dropout_scale, lm_head_nll, lm_head_nll_backward, loss_spans, nll_log_softmax_backward,
)

aten = torch.ops.aten
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal is False for NaN == NaN; compare the stored bytes instead.
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8)))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), transpose=st.booleans(),
       dtype=st.sampled_from(DTYPES), p=st.floats(0.0, 1.0),
       scale=st.one_of(st.floats(1e-6, 1.0), st.sampled_from([0.0, -0.5, 1e-30, float("inf")])),
       seed=st.integers(0, 2**31 - 1))
def test_dropout_pair_is_eagers_mask_and_rng_stream(shape, transpose, dtype, p, scale, seed):
    x = torch.randn(shape, dtype=torch.float32).to(dtype)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)  # the mask follows x's strides, as empty_like does
    torch.manual_seed(seed)
    want = torch.empty_like(x).bernoulli_(p).div_(scale)
    after_eager = torch.rand(3)
    torch.manual_seed(seed)
    keep = dropout_keep(x, p)
    got = dropout_scale(keep, scale, dtype)
    after_ours = torch.rand(3)
    assert keep.dtype == torch.bool and keep.element_size() == 1
    assert _same_bits(want, got)
    assert torch.equal(after_eager, after_ours)  # the generator advanced exactly as eager's


def test_dropout_pair_meta_matches_real_layout():
    x = torch.randn(6, 5).t()
    keep = dropout_keep(x, 0.9)
    real = dropout_scale(keep, 0.9, torch.float32)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fx = torch.empty_strided(x.shape, x.stride())
        fkeep = dropout_keep(fx, 0.9)
        fake = dropout_scale(fkeep, 0.9, torch.float32)
    assert (fkeep.dtype, fkeep.stride()) == (keep.dtype, keep.stride())
    assert (fake.dtype, fake.shape, fake.stride()) == (real.dtype, real.shape, real.stride())


def _nll_case(n, c, dtype, reduction, weighted, ignore, seed, one_d=False):
    g = torch.Generator().manual_seed(seed)
    shape = (c,) if one_d else (n, c)
    dim = 0 if one_d else 1
    x = torch.randn(shape, generator=g).to(dtype)
    out = aten._log_softmax(x, dim, False)
    target = torch.randint(0, c, () if one_d else (n,), generator=g)
    if ignore and not one_d:
        target[0] = -100
    weight = torch.rand(c, generator=g).to(dtype) if weighted else None
    loss, total_weight = aten.nll_loss_forward(out, target, weight, reduction, -100)
    grad_out = torch.rand(loss.shape, generator=g).to(dtype) + 0.5
    return grad_out, out, target, weight, reduction, total_weight, dim


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), c=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.float64,
                                                                          torch.bfloat16]),
       reduction=st.sampled_from([0, 1, 2]), weighted=st.booleans(), ignore=st.booleans(),
       one_d=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fused_cross_entropy_backward_is_eagers(n, c, dtype, reduction, weighted, ignore, one_d, seed):
    grad_out, out, target, weight, reduction, total_weight, dim = _nll_case(
        n, c, dtype, reduction, weighted, ignore, seed, one_d)
    g = aten.nll_loss_backward(grad_out, out, target, weight, reduction, -100, total_weight)
    want = aten._log_softmax_backward_data(g, out, dim, dtype)
    got = nll_log_softmax_backward(grad_out, out, target, weight, reduction, -100, total_weight,
                                   out, dim, dtype)
    assert _same_bits(want, got)


@pytest.mark.parametrize("shape", [(512, 8192), (3, 50257)])
def test_fused_cross_entropy_backward_at_language_model_shapes(shape):
    grad_out, out, target, weight, reduction, total_weight, dim = _nll_case(
        shape[0], shape[1], torch.float32, 1, False, True, 0)
    g = aten.nll_loss_backward(grad_out, out, target, weight, reduction, -100, total_weight)
    want = aten._log_softmax_backward_data(g, out, dim, torch.float32)
    got = nll_log_softmax_backward(grad_out, out, target, weight, reduction, -100, total_weight,
                                   out, dim, torch.float32)
    assert _same_bits(want, got)


def test_tracer_fuses_on_cpu():
    from remat_ir.pipeline import trace_builtin

    p = trace_builtin("gpt2-tiny", fake=True)
    ops = [n.op for n in p.nodes]
    assert "remat.nll_log_softmax_backward.default" in ops
    assert "aten.nll_loss_backward.default" not in ops
    assert "aten._log_softmax_backward_data.default" not in ops
    assert ops.count("remat.dropout_keep.default") == ops.count("remat.dropout_scale.default") > 0
    assert "aten.bernoulli_.float" not in ops
    values = p.value_map()
    keeps = [n.outputs[0] for n in p.nodes if n.op == "remat.dropout_keep.default"]
    assert all(values[k].dtype == "bool" for k in keeps)


def _eager_loss(x, weight_t, bias, target, reduction, ignore_index, dtype):
    """Eager's LM head (when `weight_t`), log-softmax, nll_loss and their
    backward: (loss, total_weight, gradient of the logits, the loss's grad)."""
    logits = x if weight_t is None else (torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t))
    lp = aten._log_softmax(logits, 1, False)
    loss, total_weight = aten.nll_loss_forward(lp, target, None, reduction, ignore_index)
    grad_out = torch.tensor(0.37, dtype=dtype)
    g = aten.nll_loss_backward(grad_out, lp, target, None, reduction, ignore_index, total_weight)
    return loss, total_weight, aten._log_softmax_backward_data(g, lp, 1, dtype), grad_out


@pytest.mark.parametrize("n,d,vocab,rows", [(512, 64, 2048, 32), (100, 48, 1000, 16), (37, 8, 33, 16),
                                            (7, 16, 50, 16), (64, 64, 128, 16)])
@pytest.mark.parametrize("start", ["input", "input+bias", "logits"])
@pytest.mark.parametrize("reduction,ignore_index", [(1, -100), (2, -1), (1, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_loss_is_eagers(n, d, vocab, rows, start, reduction, ignore_index, dtype):
    """`remat.lm_head_nll` and its backward, row chunks with a remainder,
    ignored rows, every reduction a language model uses: eager's bits."""
    g = torch.Generator().manual_seed(n * vocab + rows)
    w = (torch.randn(vocab, d, generator=g) * 0.1).to(dtype)
    weight_t = None if start == "logits" else w.t()
    bias = torch.randn(vocab, generator=g).to(dtype) if start == "input+bias" else None
    x = torch.randn(n, vocab if weight_t is None else d, generator=g).to(dtype)
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::5] = ignore_index  # every fifth row ignored
    loss, total_weight, grad, grad_out = _eager_loss(x, weight_t, bias, target, reduction, ignore_index, dtype)
    f = lm_head_nll(x, weight_t, bias, target, reduction, ignore_index, rows)
    b = lm_head_nll_backward(grad_out, x, weight_t, bias, target, reduction, ignore_index, f[1], 1, dtype, rows)
    assert _same_bits(loss, f[0]) and _same_bits(total_weight, f[1])
    assert _same_bits(grad, b[0])
    # What a chunk needs is returned, so a plan counts it: one chunk's rows at most (the last has the remainder).
    width = max(b - a for a, b in loss_spans(n, rows))
    assert f[4].shape == b[1].shape == (width, vocab) and width < 2 * rows
    meta = lm_head_nll(x.to("meta"), None if weight_t is None else weight_t.to("meta"),
                       None if bias is None else bias.to("meta"), target.to("meta"), reduction, ignore_index, rows)
    assert [t.shape for t in meta] == [t.shape for t in f]


def test_chunked_loss_refuses_targets_out_of_range_as_eager_does():
    x, target = torch.randn(20, 9), torch.full((20,), 3)
    target[4] = 9
    with pytest.raises(IndexError, match="out of bounds"):
        aten.nll_loss_forward(aten._log_softmax(x, 1, False), target, None, 1, -100)
    with pytest.raises(IndexError, match="out of bounds"):
        lm_head_nll(x, None, None, target, 1, -100, 16)
