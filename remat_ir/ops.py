"""Ops remat-ir adds to aten, so a plan can name them.

`remat::dropout_mask(x, p, scale)` is CPU dropout's mask as eager computes
it: `empty_like(x).bernoulli_(p).div_(scale)`.  The tracer fuses that
three-op chain, whose in-place updates would otherwise pin the mask in
memory (an in-place chain can't be recomputed piecewise), into this one
functional random op: same allocation, same random draws, same bits, and it
can be recomputed with its RNG state replayed.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("remat", "FRAGMENT")
_lib.define("dropout_mask(Tensor x, float p, float scale) -> Tensor")


def _dropout_mask(x: torch.Tensor, p: float, scale: float) -> torch.Tensor:
    return torch.empty_like(x).bernoulli_(p).div_(scale)


def _dropout_mask_fake(x: torch.Tensor, p: float, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


_lib.impl("dropout_mask", _dropout_mask, "CompositeExplicitAutograd")
_lib.impl("dropout_mask", _dropout_mask_fake, "Meta")

dropout_mask = torch.ops.remat.dropout_mask.default
RANDOM_OPS = frozenset({dropout_mask})
