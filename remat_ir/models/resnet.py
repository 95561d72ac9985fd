"""A small ResNet (BasicBlocks, batch norm) whose forward returns the cross-entropy loss.

Module paths follow torchvision's ResNet so IR value names read naturally:
``conv1``, ``bn1``, ``relu`` (the stem), ``maxpool`` (ImageNet-style stem
only), ``layer{1..4}.{i}.{conv1,bn1,relu,conv2,bn2}``, a block's shortcut
``layer{k}.{i}.downsample.{0,1}`` (1x1 conv + batch norm, where the block
changes width or stride), ``avgpool`` and ``fc``.

Batch norm in training mode updates its running statistics in place, so a
plan of this model has ops that update buffers (never recomputed) next to
plain recomputable convolutions.  There is no dropout: a step is
deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BasicBlock", "ResNet", "ResNetConfig"]


@dataclass(frozen=True)
class ResNetConfig:
    widths: tuple[int, ...] = (64, 128, 256, 512)
    blocks: tuple[int, ...] = (2, 2, 2, 2)
    n_classes: int = 10
    image_size: int = 32
    # "cifar": 3x3 stride-1 stem conv, no max pool (small images keep their
    # resolution); "imagenet": 7x7 stride-2 conv and a 3x3 stride-2 max pool.
    stem: str = "cifar"


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(c_in, c_out, stride)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.conv2 = conv3x3(c_out, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        if len(config.widths) != len(config.blocks) or not config.widths:
            raise ValueError("widths and blocks must name the same number of stages (at least one)")
        if config.stem not in ("cifar", "imagenet"):
            raise ValueError(f"unknown stem {config.stem!r}; expected 'cifar' or 'imagenet'")
        self.config = config
        self.n_classes = config.n_classes
        w0 = config.widths[0]
        if config.stem == "imagenet":
            self.conv1 = nn.Conv2d(3, w0, kernel_size=7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = conv3x3(3, w0)
        self.bn1 = nn.BatchNorm2d(w0)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1) if config.stem == "imagenet" else None
        c_in = w0
        for k, (width, n) in enumerate(zip(config.widths, config.blocks), start=1):
            blocks = []
            for i in range(n):
                # The first stage keeps the stem's resolution; each later one halves it.
                stride = 2 if (i == 0 and k > 1) else 1
                blocks.append(BasicBlock(c_in, width, stride))
                c_in = width
            self.add_module(f"layer{k}", nn.Sequential(*blocks))
        self.n_stages = len(config.widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, config.n_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        if self.maxpool is not None:
            x = self.maxpool(x)
        for k in range(1, self.n_stages + 1):
            x = getattr(self, f"layer{k}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), y)
