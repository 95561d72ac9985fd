"""Tracing: one training step of a PyTorch module -> an IR `Program`
(make_fx joint graph), with the graph rewrites that make it cheaper to keep."""
from __future__ import annotations

from remat_ir.trace.tracer import TraceError, trace_module  # noqa: F401
