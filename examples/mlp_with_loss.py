"""A model file for the remat-ir CLI that uses the optional ``loss`` hook.

``build()`` returns ``(module, example_inputs)`` where the module returns
logits, not a loss; the CLI then computes the training loss as
``loss(module(*example_inputs), *example_inputs)``.  ``forward`` accepts and
ignores the labels so that calling it with all example inputs works; calling
``module(x)`` alone works too.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Classifier(nn.Module):
    def __init__(self, d_in: int = 256, hidden: int = 512, depth: int = 4,
                 n_classes: int = 10, dropout: float = 0.1):
        super().__init__()
        layers = []
        width = d_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor = None) -> torch.Tensor:
        return self.net(x)  # logits; y is only for the loss hook


def build(batch: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    module = Classifier()
    module.train()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 256, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return module, (x, y)


def loss(output: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, y)


if __name__ == "__main__":
    m, (x, y) = build()
    print(loss(m(x, y), x, y).item())
