"""remat-ir: rematerialization plans for PyTorch training, as files.

    plan = remat_ir.load_plan("plan.rir")
    model = remat_ir.wrap(model, plan)      # then: loss = model(x, y); loss.backward()

The runtime path (load a plan, run it) imports torch, lark and msgspec only.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["wrap", "load_plan", "save_plan", "trace_module", "verify", "simulate"]


def __getattr__(name):
    # Lazy, so `import remat_ir` stays cheap and pulls in nothing optional.
    if name == "wrap":
        from .interpret import wrap
        return wrap
    if name in ("load_plan", "save_plan"):
        from . import text
        return getattr(text, name)
    if name == "trace_module":
        from .trace import trace_module
        return trace_module
    if name == "verify":
        from .verify import verify
        return verify
    if name == "simulate":
        from .simulate import simulate
        return simulate
    raise AttributeError(f"module 'remat_ir' has no attribute {name!r}")
