"""A plain MLP classifier whose forward returns the cross-entropy loss.

Layers live in ``net``: ``net.0`` Linear, ``net.1`` ReLU, ``net.2`` Dropout,
repeated ``depth`` times, then the classifier Linear.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP"]


class MLP(nn.Module):
    def __init__(self, d_in: int = 256, hidden: int = 512, depth: int = 4,
                 n_classes: int = 10, dropout: float = 0.1):
        super().__init__()
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.d_in, self.hidden, self.depth, self.n_classes = d_in, hidden, depth, n_classes
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)
