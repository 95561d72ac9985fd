"""Built-in models and the example model files."""
import copy
import importlib.util
import math
import pathlib
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat_ir.models import BUILTINS, GPT, MLP, GPTConfig, ResNet, build_builtin, describe_builtins

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_builtin_names_and_description():
    for name in ["mlp", "gpt2-tiny", "gpt2-mid", "gpt2-mid8", "gpt2-small", "gpt2-medium", "gpt2-large",
                 "resnet-mini", "resnet18"]:
        assert name in BUILTINS
        assert name in describe_builtins()
    with pytest.raises(KeyError):
        build_builtin("gpt5")


@pytest.mark.parametrize("name,shape", [("gpt2-tiny", (2, 64)), ("gpt2-mid", (4, 128)),
                                        ("gpt2-mid8", (4, 128))])
def test_gpt_inputs_default_shapes(name, shape):
    model, (idx, targets) = build_builtin(name)
    assert isinstance(model, GPT) and model.training
    assert idx.shape == targets.shape == shape
    assert idx.dtype == targets.dtype == torch.int64
    assert 0 <= int(idx.min()) and int(idx.max()) < model.config.vocab_size


def test_gpt_tiny_forward_backward():
    model, inputs = build_builtin("gpt2-tiny")
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(1024)) < 0.5  # near-uniform predictions at init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


def test_gpt_structure_and_tied_weights():
    model, _ = build_builtin("gpt2-tiny")
    names = dict(model.named_modules())
    for path in ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0.ln_1",
                 "transformer.h.0.attn.c_attn", "transformer.h.0.attn.attn_dropout",
                 "transformer.h.0.attn.c_proj", "transformer.h.0.attn.resid_dropout",
                 "transformer.h.0.ln_2", "transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.c_proj",
                 "transformer.h.1.mlp.dropout", "transformer.ln_f", "lm_head"]:
        assert path in names, path
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.h[0].attn.c_attn.weight.shape == (3 * 128, 128)
    # the tied weight is one parameter; counted once
    n = sum(p.numel() for p in model.parameters())
    per_block = 2 * 2 * 128 + (3 * 128 * 128 + 3 * 128) + (128 * 128 + 128) + (4 * 128 * 128 + 4 * 128) \
        + (4 * 128 * 128 + 128)
    assert n == 1024 * 128 + 64 * 128 + 2 * per_block + 2 * 128
    assert model.num_parameters() == n
    # the causal mask is one non-persistent buffer shared by all layers
    assert len(list(model.buffers())) == 1
    assert "mask" not in "".join(model.state_dict().keys())
    # GPT-2 init: scaled residual projections
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * 2)) < 0.003


def test_tied_gradient_gets_both_contributions():
    model, (idx, targets) = build_builtin("gpt2-tiny", dropout=0.0)
    model(idx, targets).backward()
    g_tied = model.transformer.wte.weight.grad.clone()
    # Same computation with an untied copy of the head weight.
    model.zero_grad(set_to_none=True)
    head = model.lm_head.weight.detach().clone().requires_grad_(True)
    t = model.transformer
    x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1])))
    for block in t.h:
        x = block(x)
    logits = t.ln_f(x) @ head.t()
    torch.nn.functional.cross_entropy(logits.view(-1, 1024), targets.view(-1)).backward()
    torch.testing.assert_close(g_tied, model.transformer.wte.weight.grad + head.grad)


def test_gpt_uses_explicit_attention_and_dropout():
    model, inputs = build_builtin("gpt2-tiny")
    rec = _OpRecorder()
    with rec:
        model(*inputs)
    assert not any("scaled_dot_product" in op for op in rec.ops)
    assert "_softmax" in rec.ops and "masked_fill" in rec.ops
    assert any("dropout" in op or "bernoulli" in op for op in rec.ops)


def test_reproducible_and_rng_untouched():
    state = torch.get_rng_state()
    m1, in1 = build_builtin("gpt2-tiny", seed=3)
    m2, in2 = build_builtin("gpt2-tiny", seed=3)
    _, in3 = build_builtin("gpt2-tiny", seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for a, b in zip(in1, in2):
        assert torch.equal(a, b)
    assert not torch.equal(in1[0], in3[0])
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    # no dropout: two calls give the same loss
    m, inp = build_builtin("gpt2-tiny", dropout=0.0)
    assert m(*inp).item() == m(*inp).item()


def test_overrides_and_errors():
    _, (idx, _) = build_builtin("gpt2-tiny", batch=3, seq=16)
    assert idx.shape == (3, 16)
    with pytest.raises(ValueError):
        build_builtin("gpt2-tiny", seq=65)
    with pytest.raises(ValueError):
        build_builtin("mlp", seq=4)


def test_mlp_forward_backward():
    model, (x, y) = build_builtin("mlp")
    assert isinstance(model, MLP)
    assert x.shape == (32, 256) and x.dtype == torch.float32
    assert y.shape == (32,) and y.dtype == torch.int64
    loss = model(x, y)
    assert loss.dim() == 0 and abs(loss.item() - math.log(10)) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    kinds = [type(m).__name__ for m in model.net]
    assert kinds == ["Linear", "ReLU", "Dropout"] * 4 + ["Linear"]


def test_gpt2_medium_in_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    t0 = time.perf_counter()
    with FakeTensorMode():
        model, (idx, targets) = build_builtin("gpt2-medium")
    elapsed = time.perf_counter() - t0
    assert elapsed < 15, elapsed  # ~2-3 s on 2 cores
    params = list(model.parameters())
    assert all(isinstance(p, FakeTensor) for p in params)
    assert isinstance(idx, FakeTensor) and idx.shape == (4, 512)
    n = sum(p.numel() for p in params)
    assert n == 354_823_168  # 354.8 M, tied embedding counted once
    assert abs(n * 4 / 2**30 - 1.32) < 0.01


def test_gpt_config_defaults():
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=8)
    assert cfg.dropout == 0.1 and cfg.bias is True
    model = GPT(cfg)
    idx = torch.zeros(1, 8, dtype=torch.long)
    assert model(idx, idx).dim() == 0


def test_example_mlp_with_loss_hook():
    ex = _load_example("mlp_with_loss")
    module, inputs = ex.build()
    out = module(*inputs)
    assert out.shape == (32, 10)
    loss = ex.loss(out, *inputs)
    assert loss.dim() == 0
    loss.backward()
    module.eval()  # no dropout: module(x) alone gives the same logits as module(x, y)
    torch.testing.assert_close(module(inputs[0]), module(*inputs))


def test_example_hf_gpt2():
    pytest.importorskip("transformers")
    ex = _load_example("hf_gpt2")
    module, (input_ids, labels) = ex.build()
    assert input_ids.shape == (2, 64) and labels.shape == (2, 64)
    assert module.model.config._attn_implementation == "eager"
    loss = module(input_ids, labels)
    assert loss.dim() == 0 and abs(loss.item() - math.log(1024)) < 0.5
    loss.backward()
    # seeded construction: building twice gives the same weights
    module2, _ = ex.build()
    for p1, p2 in zip(module.parameters(), module2.parameters()):
        assert torch.equal(p1, p2)


# ------------------------------------------------------------------ ResNets


def _fake_resnet18():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model, inputs = build_builtin("resnet18")
    return mode, model, inputs


def test_resnet_mini_builds_and_steps():
    model, (x, y) = build_builtin("resnet-mini")
    assert isinstance(model, ResNet) and model.training
    assert BUILTINS["resnet-mini"].kind == BUILTINS["resnet18"].kind == "cnn"
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (8,) and y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < 10
    names = dict(model.named_modules())
    for path in ["conv1", "bn1", "layer1.0.conv1", "layer1.0.bn2", "layer2.0.downsample.0",
                 "layer2.0.downsample.1", "layer4.0.conv2", "avgpool", "fc"]:
        assert path in names, path
    assert names["layer1.0"].downsample is None  # same width and stride: identity shortcut
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 1 + 4 * 2 * 2 + 3
    before = model.layer1[0].bn1.running_mean.clone()
    loss = model(x, y)
    assert loss.dim() == 0 and abs(loss.item() - math.log(10)) < 1.0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert not torch.equal(model.layer1[0].bn1.running_mean, before)  # train mode: the stats moved
    m2, (x2, y2) = build_builtin("resnet-mini", batch=3, seed=1)
    assert x2.shape == (3, 3, 32, 32) and y2.shape == (3,)
    assert not torch.equal(m2.conv1.weight, model.conv1.weight)


def test_resnet_reproducible_and_refusals():
    state = torch.get_rng_state()
    m1, in1 = build_builtin("resnet-mini", seed=5)
    m2, in2 = build_builtin("resnet-mini", seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(in1, in2))
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    with pytest.raises(ValueError, match="no dropout"):
        build_builtin("resnet-mini", dropout=0.1)
    with pytest.raises(ValueError, match="sequence length"):
        build_builtin("resnet-mini", seq=4)
    build_builtin("resnet-mini", dropout=None)  # None means "the model's own": accepted


def test_resnet18_in_fake_mode_traces():
    import remat_ir
    from torch._subclasses.fake_tensor import FakeTensor

    mode, model, (x, y) = _fake_resnet18()
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert isinstance(x, FakeTensor) and x.shape == (8, 3, 96, 96) and y.shape == (8,)
    assert sum(p.numel() for p in model.parameters()) == 11_181_642  # torchvision's, with a 10-class head
    assert [len(getattr(model, f"layer{k}")) for k in range(1, 5)] == [2, 2, 2, 2]
    assert [getattr(model, f"layer{k}")[0].conv1.out_channels for k in range(1, 5)] == [64, 128, 256, 512]
    with mode:
        plan = remat_ir.compile(model, (x, y))
    assert remat_ir.verify(plan).ok
    assert any(n.mutates for n in plan.nodes)  # batch norm's running statistics


def _step_both(eager, wrapped, inputs, steps=2):
    for step in range(steps):
        torch.manual_seed(step)
        le = eager(*inputs)
        le.backward()
        torch.manual_seed(step)
        lp = wrapped(*inputs)
        lp.backward()
        assert torch.equal(le.detach(), lp.detach()), step
        for (name, a), b in zip(eager.named_parameters(), wrapped.parameters()):
            assert torch.equal(a.grad, b.grad), (step, name)
        for (name, a), b in zip(eager.named_buffers(), wrapped.buffers()):
            assert torch.equal(a, b), (step, name)


@pytest.mark.parametrize("budget", [None, 0.6])
def test_resnet_mini_plan_gradients_bitwise_equal_to_eager(budget):
    import remat_ir

    model, inputs = build_builtin("resnet-mini")
    plan = remat_ir.compile(model, inputs, budget=budget, scope="activations")
    assert remat_ir.verify(plan).ok
    if budget is not None:
        assert any(ins.kind == "recompute" for ins in plan.forward + plan.backward)
    _step_both(copy.deepcopy(model), remat_ir.wrap(copy.deepcopy(model), plan), inputs)


def test_a_builtin_built_for_another_device_keeps_its_one_mask():
    """GPT's layers share one causal mask. `Module.to` would copy it once per
    layer, so the model on CUDA would hold buffer bytes the plan traced for
    CUDA (built under fake tensors, never moved) does not: the built-in is
    moved with its shares kept (the meta device stands in for CUDA)."""
    for device in ("cpu", "meta"):
        model, _ = build_builtin("gpt2-tiny", device=device)
        masks = {id(b) for name, b in model.named_buffers(remove_duplicate=False) if name.endswith("mask")}
        assert len(masks) == 1, device
        assert all(p.device == torch.device(device) for p in model.parameters())
