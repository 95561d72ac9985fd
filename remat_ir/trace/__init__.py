"""Tracing: one training step of a PyTorch module -> an IR `Program`
(make_fx joint graph), with the fusions proven on the target device that make
it cheaper to keep (`remat_ir.trace.device`)."""
from __future__ import annotations

from remat_ir.trace.tracer import TraceError, trace_module  # noqa: F401
