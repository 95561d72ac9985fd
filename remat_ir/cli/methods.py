"""The methods remat-bench measures side by side: its peers (eager PyTorch,
torch.utils.checkpoint around the model's blocks, selective activation
checkpointing, torch.compile's activation_memory_budget) and remat-ir's
plans (run by its interpreter, and by its torch.compile backend), each prepared on a fresh copy of the model (`remat_ir.cli.measure.Context`)
as a `Prepared` step.

Blocks are ``model.transformer.h`` (also found one level down, e.g.
``model.model.transformer.h`` for transformers' GPT-2), else the longest
``nn.ModuleList`` in the model.  transformers models are checkpointed through
their own ``gradient_checkpointing_enable`` (with the same checkpoint
function and arguments), which also turns their KV cache off.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import torch

from remat_ir.cli.measure import Context, MethodSpec, Prepared, Unavailable, mib


@contextlib.contextmanager
def quiet_stdout():
    """Silence fd 1 (HiGHS prints a banner from C++ even with verbose=False)."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # pytest capture without a real fd
        yield
        return
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The repeated blocks to checkpoint: `transformer.h` (at any depth), else
    the longest ModuleList."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and (name == "transformer.h" or name.endswith(".transformer.h")):
            return list(mod)
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1:
            if best is None or len(mod) > len(best):
                best = mod
    return list(best) if best is not None else None


def checkpoint_blocks(blocks, every: int = 1, context_fn=None) -> list[torch.nn.Module]:
    """Run every `every`-th block's forward under torch.utils.checkpoint
    (use_reentrant=False, `context_fn` when given): the instance's forward is
    replaced; `restore_blocks` undoes it.  The blocks patched."""
    from torch.utils.checkpoint import checkpoint

    patched = []
    for i, b in enumerate(blocks):
        if i % every:
            continue
        orig = b.forward  # the bound method of this instance
        kw = {"use_reentrant": False}
        if context_fn is not None:
            kw["context_fn"] = context_fn

        def fwd(*a, _orig=orig, _kw=kw, **k):
            return checkpoint(_orig, *a, **_kw, **k)

        b.forward = fwd
        patched.append(b)
    return patched


def restore_blocks(blocks) -> None:
    """Undo `checkpoint_blocks`: each block's forward is its class's again."""
    for b in blocks:
        del b.forward


def plain_step(ctx: Context, module, call=None):
    call = call or module

    def step():
        out = call(*ctx.inputs)
        loss = ctx.loss_fn(out, *ctx.inputs) if ctx.loss_fn is not None else out
        loss.backward()
        return loss.detach()

    return step


def prep_eager(ctx: Context) -> Prepared:
    m = ctx.fresh()
    return Prepared(m, plain_step(ctx, m))


def _checkpoint_blocks(ctx: Context, every: int, context_fn=None) -> Prepared:
    m = ctx.fresh()
    blocks = find_blocks(m)
    if not blocks:
        raise Unavailable("no repeated blocks (nn.ModuleList) found to checkpoint")
    hf = next((mod for mod in m.modules() if getattr(mod, "supports_gradient_checkpointing", False)
               and hasattr(mod, "gradient_checkpointing_enable")), None)
    if hf is not None:
        # transformers: its own hook checkpoints each layer with our function
        # and turns the KV cache off (a cache updated again by the recompute
        # breaks attention); then un-checkpoint the layers we skip.
        kw = {"use_reentrant": False}
        if context_fn is not None:
            kw["context_fn"] = context_fn
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        for i, b in enumerate(blocks):
            if i % every and hasattr(b, "gradient_checkpointing"):
                b.gradient_checkpointing = False
        return Prepared(m, plain_step(ctx, m))
    checkpoint_blocks(blocks, every, context_fn)
    return Prepared(m, plain_step(ctx, m))


def prep_ckpt_all(ctx):
    return _checkpoint_blocks(ctx, 1)


def prep_ckpt_every2(ctx):
    return _checkpoint_blocks(ctx, 2)


def sac_policy(ctx_, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def prep_sac(ctx):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return _checkpoint_blocks(ctx, 1, context_fn=functools.partial(create_selective_checkpoint_contexts, sac_policy))


def fresh_caller(module, tag: str):
    """`lambda *x: module(*x)` with a code object of its own, so dynamo's
    per-code cache cannot hand one budget's compiled graph to another."""
    name = "bench_" + "".join(c if c.isalnum() else "_" for c in tag)
    src = f"def {name}(*inputs):\n    return module(*inputs)\n"
    scope = {"module": module}
    exec(compile(src, f"<remat-bench {tag}>", "exec"), scope)
    return scope[name]


def prep_compile(ctx: Context, budget: float) -> Prepared:
    import torch._functorch.config as fconfig

    if not hasattr(fconfig, "activation_memory_budget"):
        raise Unavailable("this PyTorch has no torch._functorch.config.activation_memory_budget")
    m = ctx.fresh()
    compiled = torch.compile(fresh_caller(m, f"compile {budget}"), backend="aot_eager", fullgraph=True)
    inner = plain_step(ctx, m, compiled)

    def step():
        # The partitioner reads the budget when the graph is compiled; patch
        # it around every call so a (re)compile always sees this budget.
        with fconfig.patch(activation_memory_budget=budget):
            return inner()

    return Prepared(m, step)


def prep_backend(ctx: Context, budget: float) -> Prepared:
    """remat-ir's torch.compile backend (`remat_ir.backend`) at `budget`, with
    the torch.compile rows' inner compiler (aot_eager): each compiled region
    planned to `budget` x its own unoptimized activation peak.  The plan is
    made at the first step's compile; `Prepared.late` reads its prediction."""
    from remat_ir.check.simulate import simulate
    from remat_ir.torch_compile import backend

    m = ctx.fresh()
    # No plan cache: each run plans, and the compile time counts it.
    be = backend(budget, inner="aot_eager", model_name=ctx.name, cache=False)
    compiled = torch.compile(fresh_caller(m, f"backend {budget}"), backend=be, fullgraph=True, dynamic=False)

    def late(prep: Prepared) -> None:
        if not be.plans:
            return
        reps = [simulate(p, grads_present=True) for p in be.plans]
        # One region (fullgraph): its step peak; several: an upper bound.
        prep.predicted_act = sum(r.step_peak_bytes for r in reps)
        prep.program = be.plans[0] if len(be.plans) == 1 else be.plans
        n_re = sum(1 for p in be.plans for ins in p.backward if ins.kind == "recompute")
        prep.extra = f"{n_re} recomputed" + (f", {len(be.plans)} regions" if len(be.plans) > 1 else "")

    return Prepared(m, plain_step(ctx, m, compiled), late=late)


def prep_remat(ctx: Context, budget: str | int | None, offload: bool = False) -> Prepared:
    """`budget` (activation scope): None (unoptimized plan), a fraction string,
    bytes (int), or "floor".  `offload`: the plan may also offload activations
    to host memory (`fit(..., offload=True)`, no host budget); where
    recomputation alone meets the budget its plan is the recompute-only one."""
    from remat_ir.check.simulate import simulate
    from remat_ir.ir.costs import overhead_text
    from remat_ir.pipeline import CompileStats, fit
    from remat_ir.runtime.interpret import wrap

    program = ctx.program()
    setup = 0.0
    extra = ""
    res = None
    if budget is not None:
        ctx.optimizer_api()
        stats = CompileStats()
        try:
            with quiet_stdout(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                program = fit(program, budget, scope="activations", time_limit=ctx.args.time_limit,
                              stats=stats, memo=ctx.memo(offload), offload=offload)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ == "Infeasible":
                fb = getattr(e, "floor_bytes", None)
                why = f"below the floor, {mib(fb)}" if fb else str(e)
                raise Unavailable(f"infeasible: {why}") from e
            raise
        res = stats.optimized
        # Resolving the budget (the floor: a search) + the solve.
        setup = stats.seconds.get("budget", 0.0) + stats.seconds.get("optimize", 0.0)
        extra = overhead_text(program)
        n_off = sum(1 for ins in program.forward if ins.kind == "offload")
        if offload:
            extra += f", {n_off} offloaded" if n_off else ", nothing offloaded"
        if program.header.rewrites:
            extra += f", {', '.join(program.header.rewrites)}"
        msgs = sorted({str(w.message).split(".")[0] for w in caught})
        if msgs:
            extra += "; solver warned: " + "; ".join(msgs)
    rep = simulate(program, grads_present=True)
    m = ctx.fresh()
    w = wrap(m, program, loss=ctx.loss_fn)
    w.train()

    def step():
        loss = w(*ctx.inputs)
        loss.backward()
        return loss.detach()

    return Prepared(m, step, setup_s=setup, predicted_total=rep.peak_bytes,
                    predicted_act=rep.activation_peak_bytes, predicted_host=rep.host_peak_bytes if offload else None,
                    extra=extra, program=program, result=res)


class CountedSaveOnCpu:
    """`torch.autograd.graph.save_on_cpu` with its host copies counted as
    remat-ir's offloaded copies are (`remat_ir.runtime.memtrack`, "Two pools").

    Its own pack and unpack run; around them:

    * pack (the copy of a saved tensor into a host tensor) runs inside
      `memtrack.host_pool()`: on CPU the storage tracker counts the copy in
      its host pool; on CUDA the copy's bytes (pinned memory, which the
      allocator's statistics do not see) are reported to `memtrack.HOST_BYTES`
      until the host tensor dies;
    * unpack on CUDA is torch's: a fresh device tensor per saved tensor
      (the caching allocator counts it).  On CPU torch's unpack (`.to("cpu")`)
      hands back the host tensor itself, so backward would read the host
      copy in place; to count the device bytes a device would hold, the
      unpacked tensor is cloned there (outside the host pool: device memory,
      as remat-ir's CPU reload allocates a fresh device storage).  The bits
      are the copy's, so the gradients are unchanged.

    On CUDA it is `save_on_cpu(pin_memory=True)`.  On CPU it is
    `save_on_cpu(pin_memory=True)` as well: with pin_memory=False torch's
    pack returns the tensor itself when it is already on the CPU (no copy,
    nothing to count); with True it copies into a fresh tensor (pinned only
    where CUDA is available)."""

    def __init__(self, device: torch.device):
        from torch.autograd.graph import save_on_cpu

        self.device = device
        self.hooks = save_on_cpu(pin_memory=True)
        pack, unpack = self.hooks.pack_hook, self.hooks.unpack_hook
        self.hooks.pack_hook = functools.partial(self._pack, pack)
        self.hooks.unpack_hook = functools.partial(self._unpack, unpack)

    def _pack(self, pack, t):
        import weakref

        from remat_ir.runtime.memtrack import HOST_BYTES, host_pool

        with host_pool():
            dev, packed = pack(t)
        if self.device.type == "cuda" and packed.device.type == "cpu" and packed is not t:
            nb = packed.untyped_storage().nbytes()
            HOST_BYTES.alloc(nb)
            weakref.finalize(packed, HOST_BYTES.free, nb)
        return dev, packed

    def _unpack(self, unpack, packed):
        t = unpack(packed)
        if self.device.type == "cpu" and t.untyped_storage()._cdata == packed[1].untyped_storage()._cdata:
            t = t.clone()
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


def prep_save_on_cpu(ctx: Context) -> Prepared:
    """The step run eagerly inside `torch.autograd.graph.save_on_cpu`: every
    tensor autograd saves goes to host memory and comes back for backward
    (`CountedSaveOnCpu`: how its host bytes are counted)."""
    m = ctx.fresh()
    inner = plain_step(ctx, m)

    def step():
        with CountedSaveOnCpu(ctx.device):
            return inner()

    return Prepared(m, step)


def method_specs(budgets: list[float]) -> list[MethodSpec]:
    specs = [
        MethodSpec("eager", "eager PyTorch", "eager", prep_eager),
        MethodSpec("ckpt-all", "checkpoint every block", "checkpoint", prep_ckpt_all),
        MethodSpec("ckpt-every2", "checkpoint every 2nd block", "checkpoint", prep_ckpt_every2),
        MethodSpec("sac-matmul", "SAC, save matmul outputs", "sac", prep_sac),
    ]
    for b in budgets:
        specs.append(MethodSpec(f"compile-{b:g}", f"torch.compile aot_eager, budget {b:g}", "compile",
                                functools.partial(prep_compile, budget=b)))
    for b in budgets:
        specs.append(MethodSpec(f"backend-{b:g}", f"remat-ir backend aot_eager, budget {b:g}", "backend",
                                functools.partial(prep_backend, budget=b)))
    specs.append(MethodSpec("remat-plan", "remat-ir, unoptimized plan", "remat",
                            functools.partial(prep_remat, budget=None)))
    for b in budgets:
        specs.append(MethodSpec(f"remat-{b:g}", f"remat-ir, budget {b:g}", "remat",
                                functools.partial(prep_remat, budget=f"{b:g}")))
    specs.append(MethodSpec("remat-floor", "remat-ir, floor", "remat",
                            functools.partial(prep_remat, budget="floor")))
    # Offload: run when --methods names them (at budgets recomputation alone
    # meets, remat-ir's offload plan is its recompute-only plan).
    for b in budgets:
        specs.append(MethodSpec(f"offload-{b:g}", f"remat-ir, budget {b:g}, offload", "offload",
                                functools.partial(prep_remat, budget=f"{b:g}", offload=True), default=False))
    specs.append(MethodSpec("save-on-cpu", "torch save_on_cpu", "save_on_cpu", prep_save_on_cpu, default=False))
    return specs


def select(specs: list[MethodSpec], methods: str | None) -> list[MethodSpec]:
    if not methods:
        return [s for s in specs if s.default]
    wanted = [w.strip() for w in methods.split(",") if w.strip()]
    keys = [s.key for s in specs]
    for w in wanted:
        if not any(k == w or k.startswith(w) for k in keys):
            raise ValueError(f"--methods: {w!r} matches no method; methods are {', '.join(keys)}")
    return [s for s in specs if s.key == "eager" or any(s.key == w or s.key.startswith(w) for w in wanted)]
