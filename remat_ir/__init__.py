"""remat-ir: rematerialization plans for PyTorch training, as files.

    model = remat_ir.wrap(model, budget=0.6)   # plans at the first training step, cached on disk

    plan = remat_ir.compile(model, (x, y), budget="0.5")   # trace + optimize (0.5 of the activation peak)
    remat_ir.save_plan(plan, "plan.rir")

    plan = remat_ir.load_plan("plan.rir")
    model = remat_ir.wrap(model, plan)      # then: loss = model(x, y); loss.backward()

The runtime path (load a plan, run it) imports torch and msgspec only.
"""
from __future__ import annotations

# In a leaf module, so that a submodule needing it does not import the package (whose __getattr__ imports it).
from remat_ir.version import __version__  # noqa: F401

__all__ = ["compile", "wrap", "unwrap", "planner", "eager", "backend", "load_plan", "save_plan", "trace_module", "verify",
           "simulate"]


def __getattr__(name):
    # Lazy, so `import remat_ir` stays cheap and pulls in nothing optional.
    if name == "compile":
        from remat_ir.pipeline import compile
        return compile
    if name == "wrap":
        # A plan given runs without the optimizer; a budget plans on first use (remat_ir.adopt).
        from remat_ir.adopt import wrap
        return wrap
    if name in ("unwrap", "planner", "eager"):
        # The model's own class again / what plans its steps (remat_ir.runtime.interpret).
        from remat_ir.runtime import interpret
        return getattr(interpret, name)
    if name == "backend":
        # torch.compile(model, backend=remat_ir.backend(budget=0.5)): a plan per compiled region.
        from remat_ir.torch_compile import backend
        return backend
    if name in ("load_plan", "save_plan"):
        from remat_ir.ir import files
        return getattr(files, name)
    if name == "trace_module":
        from remat_ir.trace.tracer import trace_module
        return trace_module
    if name == "verify":
        from remat_ir.check.verify import verify
        return verify
    if name == "simulate":
        from remat_ir.check.simulate import simulate
        return simulate
    raise AttributeError(f"module 'remat_ir' has no attribute {name!r}")
