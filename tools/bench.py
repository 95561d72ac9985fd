"""Benchmark remat-ir against eager PyTorch, torch.utils.checkpoint, selective
activation checkpointing and torch.compile's activation memory budget.

    python tools/bench.py [--model gpt2-mid] [--steps 5] [--md FILE] [--png FILE]

A thin wrapper: the implementation is `remat_ir.cli.bench` (also `remat-bench`).
"""
from __future__ import annotations

import sys

from remat_ir.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
