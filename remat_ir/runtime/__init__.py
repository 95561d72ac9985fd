"""Runtime: run a plan (interpreter and `nn.Module` wrapper), measure its
memory (storage tracker, CUDA allocator stats), load models.

Never imports the planning package, cvxpy or scipy."""
from __future__ import annotations
