"""Checking: the memory simulator (the memory semantics, stated once) and the
verifier, an independent proof that a plan is sound.  Shares no code with the
optimizer it checks."""
from __future__ import annotations

from remat_ir.check.simulate import simulate  # noqa: F401
from remat_ir.check.verify import verify  # noqa: F401
