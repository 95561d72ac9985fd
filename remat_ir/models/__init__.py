"""Built-in models for the CLI, tests and benchmarks.

``build_builtin(name, batch=None, seq=None, device="cpu", seed=0)`` returns
``(module, example_inputs)``; ``module(*example_inputs)`` is the scalar training
loss.  Kinds: ``gpt`` (nanoGPT-style GPT-2), ``mlp`` and ``cnn`` (a ResNet of
BasicBlocks with batch norm).  Model initialisation and inputs are both seeded by ``seed`` (the global
RNG state is left untouched).  Everything also works inside
``torch._subclasses.fake_tensor.FakeTensorMode()``: parameters and inputs are
then fake tensors, so big models can be planned without allocating.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .gpt import GPT, GPTConfig
from .mlp import MLP
from .resnet import ResNet, ResNetConfig

__all__ = ["BUILTINS", "BuiltinSpec", "GPT", "GPTConfig", "MLP", "ResNet", "ResNetConfig", "build_builtin",
           "describe_builtins"]


@dataclass(frozen=True)
class BuiltinSpec:
    kind: str  # "gpt", "mlp" or "cnn"
    batch: int
    seq: Optional[int]  # sequence length (GPT only)
    description: str
    gpt: Optional[GPTConfig] = None
    mlp: dict = field(default_factory=dict)
    cnn: Optional[ResNetConfig] = None


BUILTINS: dict[str, BuiltinSpec] = {
    "mlp": BuiltinSpec("mlp", 32, None, "MLP 256 -> 4 x 512 (ReLU, dropout 0.1) -> 10 classes",
                       mlp=dict(d_in=256, hidden=512, depth=4, n_classes=10, dropout=0.1)),
    "gpt2-tiny": BuiltinSpec("gpt", 2, 64, "GPT 2 layers, d=128, 4 heads, vocab 1024, block 64",
                             gpt=GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=1024, block_size=64)),
    "gpt2-mid": BuiltinSpec("gpt", 4, 128, "GPT 4 layers, d=256, 4 heads, vocab 8192, block 128",
                            gpt=GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=8192, block_size=128)),
    # Deep enough that checkpointing every block gets under half the activation
    # peak (the LM head and loss dominate gpt2-mid's), so a 0.5 budget
    # is feasible and comparable with torch.utils.checkpoint.
    "gpt2-mid8": BuiltinSpec("gpt", 4, 128, "GPT 8 layers, d=256, 4 heads, vocab 8192, block 128",
                             gpt=GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=8192, block_size=128)),
    "gpt2-small": BuiltinSpec("gpt", 4, 512, "GPT-2 small: 12 layers, d=768, 12 heads (124 M params)",
                              gpt=GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)),
    "gpt2-medium": BuiltinSpec("gpt", 4, 512, "GPT-2 medium: 24 layers, d=1024, 16 heads (355 M params)",
                               gpt=GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024)),
    "gpt2-large": BuiltinSpec("gpt", 4, 512, "GPT-2 large: 36 layers, d=1280, 20 heads (774 M params)",
                              gpt=GPTConfig(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257, block_size=1024)),
    # Small enough for a real step in well under a second on a CPU: the
    # batch-norm model the tests run against eager.
    "resnet-mini": BuiltinSpec("cnn", 8, None, "ResNet 4 stages x 2 BasicBlocks, widths 8/16/32/64, batch norm, "
                                               "3x32x32 images -> 10 classes",
                               cnn=ResNetConfig(widths=(8, 16, 32, 64), blocks=(2, 2, 2, 2), n_classes=10,
                                                image_size=32, stem="cifar")),
    "resnet18": BuiltinSpec("cnn", 8, None, "ResNet-18: 4 stages x 2 BasicBlocks, widths 64/128/256/512, "
                                            "7x7 stem + max pool, 3x96x96 images -> 10 classes (11.2 M params)",
                            cnn=ResNetConfig(widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), n_classes=10,
                                             image_size=96, stem="imagenet")),
}


def describe_builtins() -> str:
    """One line per built-in model, for CLI help."""
    lines = ["built-in models (default batch x seq):"]
    for name, spec in BUILTINS.items():
        shape = f"batch {spec.batch}" + (f" x seq {spec.seq}" if spec.seq else "")
        lines.append(f"  {name:<12} {spec.description}; {shape}")
    return "\n".join(lines)


def move_to(model: torch.nn.Module, device) -> torch.nn.Module:
    """`model.to(device)`, a buffer shared by several modules (GPT's one
    causal mask) still shared: `Module.to` copies a buffer once per module
    that holds it, so the moved model would hold more buffer bytes than the
    one traced for that device (which never moves)."""
    moved: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = moved.setdefault(id(b), b.to(device))
    return model.to(device)


def build_builtin(name: str, batch: Optional[int] = None, seq: Optional[int] = None,
                  device="cpu", seed: int = 0,
                  dropout: Optional[float] = None) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Build built-in model ``name`` and reproducible example inputs.

    Returns ``(module, example_inputs)`` with the module in training mode on
    ``device``.  GPT inputs are ``(idx, targets)`` int64 of shape
    ``(batch, seq)``; MLP inputs are ``(x float32 (batch, d_in), y int64 (batch,))``;
    CNN inputs are ``(x float32 (batch, 3, H, W), y int64 (batch,))``.
    ``dropout`` overrides the model's dropout probability when given (the CNNs
    have none, and refuse one).
    """
    if name not in BUILTINS:
        raise KeyError(f"unknown built-in model {name!r}; choose from {', '.join(BUILTINS)}")
    spec = BUILTINS[name]
    if spec.kind == "cnn" and dropout is not None:
        raise ValueError(f"the {name} model has no dropout layers, so dropout={dropout!r} cannot apply; "
                         f"leave dropout unset")
    if spec.kind != "gpt" and seq is not None:
        raise ValueError(f"the {name} model takes no sequence length")
    batch = spec.batch if batch is None else int(batch)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device="cpu").manual_seed(seed)

    # Seed model initialisation without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.kind == "gpt":
            cfg = spec.gpt
            if dropout is not None:
                cfg = GPTConfig(**{**cfg.__dict__, "dropout": float(dropout)})
            model = GPT(cfg)
        elif spec.kind == "cnn":
            model = ResNet(spec.cnn)
        else:
            kw = dict(spec.mlp)
            if dropout is not None:
                kw["dropout"] = float(dropout)
            model = MLP(**kw)
    # (.to() on fake parameters fails under FakeTensorMode: only move when needed.)
    if any(t.device != device for t in list(model.parameters()) + list(model.buffers())):
        model = move_to(model, device)
    model.train()

    if spec.kind == "gpt":
        seq = spec.seq if seq is None else int(seq)
        if seq > cfg.block_size:
            raise ValueError(f"seq {seq} > block_size {cfg.block_size} of {name}")
        idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen, dtype=torch.int64)
        targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen, dtype=torch.int64)
        inputs = (idx.to(device), targets.to(device))
    elif spec.kind == "cnn":
        size = spec.cnn.image_size
        x = torch.randn(batch, 3, size, size, generator=gen, dtype=torch.float32)
        y = torch.randint(0, spec.cnn.n_classes, (batch,), generator=gen, dtype=torch.int64)
        inputs = (x.to(device), y.to(device))
    else:
        x = torch.randn(batch, model.d_in, generator=gen, dtype=torch.float32)
        y = torch.randint(0, model.n_classes, (batch,), generator=gen, dtype=torch.int64)
        inputs = (x.to(device), y.to(device))
    return model, inputs
