"""remat-bench: remat-ir next to its peers, measured side by side in one run.

    remat-bench [--model gpt2-mid] [--batch 4] [--seq 128] [--device cpu] [--steps 5]
                [--methods eager,ckpt,sac,compile,remat] [--md FILE] [--png FILE]

Every method trains the same model (same initial weights, same inputs, same
seeds, dropout on) and is measured the same way:

* memory: the *second* step (``.grad`` present) of each method, measured with
  `remat_ir.runtime.memtrack.measure_step` (CPU: the storage-tracking dispatch mode;
  CUDA: ``torch.cuda.max_memory_allocated``).  "activations" is the peak above
  what exists before the step: parameters, buffers, inputs, gradients and
  optimizer state (the totals include these, counted for the method's own
  model only);
* step time: the median over ``--steps`` rounds; each round runs one step of
  every method, in an order rotated from round to round so drift on a busy
  machine hits all methods alike; "vs eager" is the median over rounds of the
  step time / eager's in the same round; on CPU one intra-op thread unless
  ``--threads`` says otherwise (steady under load, see --help);
* gradients: after a first step from ``.grad = None`` with the same seed as an
  eager reference step, compared bitwise (else the max absolute difference);
* compile/solve time: torch.compile's first-step cost above its median step,
  remat-ir's MILP solve time (the trace, shared by all budgets, is noted once).

Methods (``--methods`` takes keys or key prefixes, comma separated; eager, the
reference, always runs):

    eager          plain PyTorch
    ckpt-all       torch.utils.checkpoint (use_reentrant=False) around every block
    ckpt-every2    ... around every second block
    sac-matmul     selective activation checkpointing per block, saving mm/addmm/bmm outputs
    compile-B      torch.compile(backend="aot_eager") with activation_memory_budget B
    remat-plan     remat-ir's unoptimized plan (the interpreter alone)
    remat-B        remat-ir optimized at B x the unoptimized activation peak
    remat-floor    remat-ir at the smallest activation budget it can meet

Blocks are ``model.transformer.h`` (also found one level down, e.g.
``model.model.transformer.h`` for transformers' GPT-2), else the longest
``nn.ModuleList`` in the model.  transformers models are checkpointed through
their own ``gradient_checkpointing_enable`` (with the same checkpoint
function and arguments), which also turns their KV cache off.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from remat_ir.cli.errors import EXIT_FAIL, EXIT_OK, CliError, run_cli
from remat_ir.cli.outputs import check_outputs, model_file
from remat_ir.ir.files import save_figure, write_atomically

MiB = 2**20


# ------------------------------------------------------------------ helpers


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# ------------------------------------------------------------ the methods


@dataclass
class Prepared:
    """A method ready to run: `step()` runs one training step (forward, loss,
    backward) and returns the detached loss."""

    module: torch.nn.Module  # whose parameters receive the gradients
    step: Callable[[], torch.Tensor]
    setup_s: float = 0.0  # solve time etc., before the first step
    predicted_total: int | None = None
    predicted_act: int | None = None
    extra: str = ""  # a short note for the table (extra compute, ...)
    program: object = None
    result: object = None  # remat-ir: the optimizer's OptimizeResult (what it recomputes, ...)


@dataclass
class Row:
    key: str
    label: str
    family: str
    status: str = "ok"  # "ok", or why there is no measurement
    total_peak: int | None = None
    act_peak: int | None = None
    predicted_total: int | None = None
    predicted_act: int | None = None
    first_step_s: float | None = None
    setup_s: float | None = None
    times: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # per round, to eager's step in that round
    grads: str = ""
    grad_diff: float | None = None
    extra: str = ""
    recompiled: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def step_time(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    @property
    def ratio(self) -> float | None:
        """Median over rounds of this step's time / eager's in the same round."""
        return statistics.median(self.ratios) if self.ratios else None


class Unavailable(Exception):
    """The method cannot run here; the message says why (shown as n/a)."""


class Context:
    """What all methods share: the model, its inputs, the loss, the device."""

    def __init__(self, args):
        from remat_ir.runtime.load import load_model

        self.args = args
        self.device = torch.device(args.device)
        m = load_model(args.model, batch=args.batch, seq=args.seq, device=args.device, seed=args.seed)
        self.name = m.name
        self.base = m.module.to(self.device)
        self.base.train()
        self.inputs = tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in m.inputs)
        self.loss_fn = m.loss
        self._program = None
        self.trace_s = None
        self.profile_s = None  # with --cost profile: timing every op of the traced step
        self._opt_api = None
        self._planner = None
        self.load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0

    def fresh(self) -> torch.nn.Module:
        m = copy.deepcopy(self.base)
        m.train()
        return m

    def eager_loss(self, module):
        out = module(*self.inputs)
        return self.loss_fn(out, *self.inputs) if self.loss_fn is not None else out

    # remat-ir: one trace shared by all budgets
    def program(self):
        if self._program is None:
            from remat_ir.pipeline import CompileStats, trace

            stats = CompileStats()
            self._program = trace(self.fresh(), self.inputs, loss=self.loss_fn, name=self.name,
                                  optimizer=self.args.optimizer, cost=self.args.cost, stats=stats)
            self.trace_s = stats.seconds["trace"]
            self.profile_s = stats.seconds.get("profile")
        return self._program

    def planner(self):
        """One optimizer planner for every budget row: the block options (and
        rewritten graphs) built for one budget serve the next."""
        if self._planner is None:
            from remat_ir.optimize.rewrites import RewritePlanner

            self._planner = RewritePlanner(self.program(), "activations")
        return self._planner

    def optimizer_api(self):
        """The optimizer package, or Unavailable (shown as n/a) when it cannot be imported."""
        if self._opt_api is None:
            try:
                import remat_ir.optimize as opt

                self._opt_api = opt
            except Exception as e:  # noqa: BLE001 - report, don't crash the benchmark
                self._opt_api = e
        if isinstance(self._opt_api, Exception):
            e = self._opt_api
            raise Unavailable(f"optimizer unavailable: {type(e).__name__}: {str(e).split(' (')[0]}")
        return self._opt_api


def _plain_step(ctx: Context, module, call=None):
    call = call or module

    def step():
        out = call(*ctx.inputs)
        loss = ctx.loss_fn(out, *ctx.inputs) if ctx.loss_fn is not None else out
        loss.backward()
        return loss.detach()

    return step


def prep_eager(ctx: Context) -> Prepared:
    m = ctx.fresh()
    return Prepared(m, _plain_step(ctx, m))


def _checkpoint_blocks(ctx: Context, every: int, context_fn=None) -> Prepared:
    from torch.utils.checkpoint import checkpoint

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
        return Prepared(m, _plain_step(ctx, m))
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
    return Prepared(m, _plain_step(ctx, m))


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


def _fresh_caller(module, tag: str):
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
    compiled = torch.compile(_fresh_caller(m, f"compile {budget}"), backend="aot_eager", fullgraph=True)
    inner = _plain_step(ctx, m, compiled)

    def step():
        # The partitioner reads the budget when the graph is compiled; patch
        # it around every call so a (re)compile always sees this budget.
        with fconfig.patch(activation_memory_budget=budget):
            return inner()

    return Prepared(m, step)


def prep_remat(ctx: Context, budget: str | int | None) -> Prepared:
    """`budget` (activation scope): None (unoptimized plan), a fraction string,
    bytes (int), or "floor"."""
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
                              stats=stats, planner=ctx.planner())
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ == "Infeasible":
                fb = getattr(e, "floor_bytes", None)
                why = f"below the floor, {_mib(fb)}" if fb else str(e)
                raise Unavailable(f"infeasible: {why}") from e
            raise
        res = stats.optimized
        # Resolving the budget (the floor: a search) + the solve.
        setup = stats.seconds.get("budget", 0.0) + stats.seconds.get("optimize", 0.0)
        extra = overhead_text(program)
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
                    predicted_act=rep.activation_peak_bytes, extra=extra, program=program, result=res)


@dataclass
class MethodSpec:
    key: str
    label: str
    family: str
    prepare: Callable[[Context], Prepared]


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
    specs.append(MethodSpec("remat-plan", "remat-ir, unoptimized plan", "remat",
                            functools.partial(prep_remat, budget=None)))
    for b in budgets:
        specs.append(MethodSpec(f"remat-{b:g}", f"remat-ir, budget {b:g}", "remat",
                                functools.partial(prep_remat, budget=f"{b:g}")))
    specs.append(MethodSpec("remat-floor", "remat-ir, floor", "remat",
                            functools.partial(prep_remat, budget="floor")))
    return specs


def select(specs: list[MethodSpec], methods: str | None) -> list[MethodSpec]:
    if not methods:
        return specs
    wanted = [w.strip() for w in methods.split(",") if w.strip()]
    keys = [s.key for s in specs]
    for w in wanted:
        if not any(k == w or k.startswith(w) for k in keys):
            raise ValueError(f"--methods: {w!r} matches no method; methods are {', '.join(keys)}")
    return [s for s in specs if s.key == "eager" or any(s.key == w or s.key.startswith(w) for w in wanted)]


# --------------------------------------------------------------- measuring


def _grads(module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def relative_grads(ref: list, got: list) -> float:
    """The largest relative difference (`remat_ir.runtime.run.relative_difference`)
    between matching gradients of `got` and `ref`."""
    from remat_ir.runtime.run import relative_difference

    return max((relative_difference(b, a) for a, b in zip(ref, got) if a is not None and b is not None),
               default=0.0)


def compare_grads(ref: list, got: list) -> tuple[bool, float]:
    equal, diff = True, 0.0
    if len(ref) != len(got):
        return False, float("inf")
    for a, b in zip(ref, got):
        if (a is None) != (b is None):
            return False, float("inf")
        if a is None:
            continue
        if not torch.equal(a, b):
            equal = False
            if a.numel():
                diff = max(diff, (a.double() - b.double()).abs().max().item())
    return equal, diff


def _pre_existing(ctx: Context, prep: Prepared, opt_state) -> dict:
    m = prep.module
    pre = {"params": list(m.parameters()), "buffers": list(m.buffers()),
           "inputs": [x for x in ctx.inputs if isinstance(x, torch.Tensor)], "optimizer": opt_state}
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    if grads:
        pre["grads"] = grads
    return pre


def _own_state_bytes(pre: dict) -> int:
    from torch.utils._pytree import tree_flatten

    from remat_ir.runtime.memtrack import storage_key

    seen, total = set(), 0
    for tensors in pre.values():
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                k = storage_key(t)
                if k not in seen:
                    seen.add(k)
                    total += t.untyped_storage().nbytes()
    return total


def _compile_count() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"].get("unique_graphs", 0))
    except Exception:  # noqa: BLE001
        return 0


def measure(ctx: Context, spec: MethodSpec, ref_grads, log) -> tuple[Row, Prepared | None]:
    """Prepare one method, check its gradients (first step) and measure its
    memory (second step)."""
    from remat_ir.runtime.memtrack import measure_step
    from remat_ir.runtime.run import optimizer_state

    row = Row(spec.key, spec.label, spec.family)
    dev = ctx.device
    try:
        t0 = time.perf_counter()
        prep = spec.prepare(ctx)
        row.setup_s = prep.setup_s if prep.setup_s else None
        row.predicted_total, row.predicted_act, row.extra = prep.predicted_total, prep.predicted_act, prep.extra
        prep_s = time.perf_counter() - t0
        opt_state = optimizer_state(prep.module, ctx.args.optimizer)
        # Step 1, from .grad = None, same seed as the eager reference.
        for p in prep.module.parameters():
            p.grad = None
        gc.collect()
        torch.manual_seed(ctx.args.seed)
        _sync(dev)
        t1 = time.perf_counter()
        prep.step()
        _sync(dev)
        row.first_step_s = time.perf_counter() - t1
        if ref_grads is None:
            row.grads = "-"
        else:
            got = _grads(prep.module)
            equal, diff = compare_grads(ref_grads, got)
            from remat_ir.runtime.run import GRAD_RTOL

            rel = 0.0 if equal else relative_grads(ref_grads, got)
            # Within the tolerance remat-run --check documents (a chunked loss
            # sums in another order) is not a wrong gradient.
            row.grad_diff = 0.0 if equal or rel <= GRAD_RTOL else diff
            row.grads = ("bitwise" if equal else f"within tolerance ({rel:.1g} relative)" if rel <= GRAD_RTOL
                         else f"differ ({diff:.3g})")
        # Step 2: .grad present; measured.
        pre = _pre_existing(ctx, prep, opt_state)
        gc.collect()
        n0 = _compile_count()
        torch.manual_seed(ctx.args.seed + 1)
        mem = measure_step(prep.step, pre_existing=pre, device=dev)
        if _compile_count() != n0:
            row.recompiled = True
        row.act_peak = mem.peak_above_baseline
        row.total_peak = _own_state_bytes(pre) + mem.peak_above_baseline
        prep.opt_state = opt_state  # keep it alive: it is part of the state
        log(f"  {spec.key:<14} act {_mib(row.act_peak):>12}  total {_mib(row.total_peak):>12}  "
            f"first step {row.first_step_s:.2f} s  prep {prep_s:.1f} s  grads {row.grads}")
        return row, prep
    except Unavailable as e:
        row.status = f"n/a ({e})"
    except Exception as e:  # noqa: BLE001 - one method failing must not sink the table
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row.status = f"failed: {type(e).__name__}: {msg[:160]}"
    log(f"  {spec.key:<14} {row.status}")
    return row, None


def time_rounds(ctx: Context, rows: list[Row], preps: dict[str, Prepared], rounds: int, log) -> None:
    keys = [r.key for r in rows if r.ok and r.key in preps]
    by_key = {r.key: r for r in rows}
    dev = ctx.device
    for i in range(rounds):
        k = i % len(keys) if keys else 0
        order = keys[k:] + keys[:k]
        gc.collect()
        for key in order:
            n0 = _compile_count()
            torch.manual_seed(ctx.args.seed + 100 + i)
            _sync(dev)
            t0 = time.perf_counter()
            preps[key].step()
            _sync(dev)
            by_key[key].times.append(time.perf_counter() - t0)
            if _compile_count() != n0:
                by_key[key].recompiled = True
        if "eager" in by_key and by_key["eager"].times and len(by_key["eager"].times) == i + 1:
            te = by_key["eager"].times[-1]
            for key in order:
                by_key[key].ratios.append(by_key[key].times[-1] / te)
        log(f"  round {i + 1}/{rounds}: " + ", ".join(f"{k} {_fmt_s(by_key[k].times[-1])}" for k in keys))


# ------------------------------------------------------------------ output


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} s" if x >= 0.1 else f"{1e3 * x:.0f} ms"


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} intra-op thread{'s' if n != 1 else ''}"


def markdown(ctx: Context, rows: list[Row], wall: float) -> str:
    a = ctx.args
    eager = next(r for r in rows if r.key == "eager")
    e_act = eager.act_peak
    n_params = sum(p.numel() for p in ctx.base.parameters())
    shapes = ", ".join(f"{tuple(x.shape)}" for x in ctx.inputs if isinstance(x, torch.Tensor))
    lines = [
        f"## remat-bench: {ctx.name} ({n_params / 1e6:.2f} M parameters, inputs {shapes}), {ctx.device.type}",
        "",
        f"torch {torch.__version__}, {_threads()}, optimizer state: {a.optimizer}, "
        f"dropout on, seed {a.seed}; memory of the second step (.grad present); "
        f"step time: median of {a.steps} rounds, the methods' order rotated each round; \"vs eager\": "
        f"median over rounds of the step time / eager's step time in the same round.",
        "",
        "| method | peak total | activation peak | % of eager | predicted act. | step time | vs eager "
        "| compile / solve | gradients vs eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.ok:
            lines.append(f"| {r.label} | {r.status} | | | | | | | |")
            continue
        pct = f"{100 * r.act_peak / e_act:.1f}%" if e_act else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        if r.family == "compile" and r.first_step_s is not None and r.step_time is not None:
            cs = f"compile {_fmt_s(max(r.first_step_s - r.step_time, 0.0))}"
        elif r.family == "remat" and r.setup_s:
            cs = f"solve {_fmt_s(r.setup_s)}"
        else:
            cs = "-"
        if r.extra:
            cs += f" ({r.extra})"
        pred = _mib(r.predicted_act) if r.predicted_act is not None else "-"
        g = r.grads + (" (recompiled!)" if r.recompiled else "")
        lines.append(f"| {r.label} | {_mib(r.total_peak)} | {_mib(r.act_peak)} | {pct} | {pred} | "
                     f"{_fmt_s(r.step_time)} | {ratio} | {cs} | {g} |")
    lines.append("")
    notes = []
    if ctx.trace_s is not None:
        profiled = (f" and timed each of its ops in {ctx.profile_s:.1f} s (--cost profile: the optimizer "
                    "minimizes recomputed op time)" if ctx.profile_s is not None else "")
        notes.append(f"remat-ir traced the step once in {ctx.trace_s:.1f} s{profiled} (shared by its rows); "
                     "\"predicted act.\" is the simulator's activation peak for the plan; budgets are "
                     "fractions of the unoptimized plan's activation peak; solve = wall time of resolving the "
                     "budget and optimizing (the optimizer reuses its analysis across the rows, so the first "
                     "remat-ir row pays for it).")
    comp = [r for r in rows if r.family == "compile"]
    if comp:
        notes.append("torch.compile: dynamo was reset before the compile rows; each budget compiles its own "
                     "entry function (a distinct code object) so no budget reuses another's graph while the "
                     "rows are interleaved; compile time = first step minus median step.")
        if any(r.ok and r.grad_diff for r in comp):
            notes.append("torch.compile gradients that differ: the budgeted partitioner recomputes "
                         "native_dropout in backward with fresh randomness on CPU (known PyTorch issue; "
                         "with dropout 0 the budgets are bitwise equal).")
        if ctx.device.type == "cpu":
            notes.append("inductor: not measured. Its CPU kernels allocate outside the dispatcher, where the "
                         "storage tracker cannot see them, and its C++ compile is too slow for this machine.")
        else:
            notes.append("inductor: not measured (aot_eager isolates the partitioner's choices).")
    if any(r.recompiled for r in rows):
        notes.append("(recompiled!): dynamo compiled again during a measured step; that row's figures "
                     "include compile work.")
    if ctx.device.type == "cuda":
        notes.append("CUDA gradients may differ in the last bits between any two runs (atomics in "
                     "embedding backward); bitwise equality is not expected there.")
    load = ""
    if hasattr(os, "getloadavg"):
        load = (f"; 1-minute load average at the start {ctx.load_start:.1f}, at the end {os.getloadavg()[0]:.1f} "
                f"on {os.cpu_count()} CPUs (other work on the machine inflates and scatters step times)")
    notes.append(f"wall time of the whole benchmark: {wall:.0f} s{load}.")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


FAMILY_STYLE = {
    "eager": ("black", "o"), "checkpoint": ("tab:blue", "s"), "sac": ("tab:purple", "D"),
    "compile": ("tab:orange", "^"), "remat": ("tab:green", "*"),
}


def short_label(r: Row) -> str:
    s = r.label.replace("torch.compile aot_eager, ", "compile ").replace("remat-ir, ", "remat-ir ")
    s = s.replace("checkpoint every", "ckpt every").replace(", save matmul outputs", " (matmuls)")
    return s.replace("eager PyTorch", "eager").replace("unoptimized plan", "unoptimized")


def _place_labels(fig, ax, labels, obstacles=()) -> None:
    """Annotate points, trying a few offsets so labels do not overlap each
    other (greedy; good enough for a dozen points)."""
    offsets = [(7, 6, "left", "bottom"), (7, -7, "left", "top"), (-7, 6, "right", "bottom"),
               (-7, -7, "right", "top"), (0, 10, "center", "bottom"), (0, -11, "center", "top"),
               (7, 18, "left", "bottom"), (7, -19, "left", "top")]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.transforms import Bbox

    placed = [o.get_window_extent(renderer) for o in obstacles]
    for x, y, _, _ in labels:  # the markers themselves
        px, py = ax.transData.transform((x, y))
        placed.append(Bbox([[px - 6, py - 6], [px + 6, py + 6]]))
    axbox = ax.get_window_extent(renderer)
    for x, y, text, color in labels:
        best = None
        for dx, dy, ha, va in offsets:
            t = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                            fontsize=8, color=color)
            bb = t.get_window_extent(renderer).expanded(1.03, 1.1)
            clash = sum(bb.overlaps(o) for o in placed)
            outside = not (axbox.x0 <= bb.x0 and bb.x1 <= axbox.x1 and axbox.y0 <= bb.y0 and bb.y1 <= axbox.y1)
            score = clash * 10 + outside * 5
            if best is None or score < best[0]:
                if best is not None:
                    best[1].remove()
                best = (score, t, bb)
            else:
                t.remove()
            if score == 0:
                break
        placed.append(best[2])


def pareto_png(ctx: Context, rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r.ratio, r.act_peak / MiB, r) for r in rows
           if r.ok and r.ratio is not None and r.act_peak is not None]
    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=120)
    seen = set()
    labels = []
    differ = False
    for x, y, r in pts:
        color, marker = FAMILY_STYLE.get(r.family, ("gray", "o"))
        fam_label = {"eager": "eager", "checkpoint": "torch.utils.checkpoint", "sac": "selective AC",
                     "compile": "torch.compile (aot_eager)", "remat": "remat-ir"}.get(r.family, r.family)
        wrong = bool(r.grad_diff)  # gradients differ from eager: hollow, off the frontier
        differ |= wrong
        ax.scatter([x], [y], marker=marker, s=160 if marker == "*" else 70, zorder=3,
                   facecolors="none" if wrong else color, edgecolors=color if wrong else "white",
                   linewidths=1.3 if wrong else 0.5,
                   label=None if r.family in seen else fam_label)
        seen.add(r.family)
        labels.append((x, y, short_label(r), color))
    # Pareto frontier over the methods with eager's gradients: no other such
    # point is both faster and smaller.
    good = [(x, y) for x, y, r in pts if not r.grad_diff]
    front = sorted((x, y) for x, y in good
                   if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for x2, y2 in good))
    if len(front) > 1:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="gray", lw=1, ls="--",
                zorder=1, label="Pareto frontier (eager's gradients)")
    if differ:
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray", label="hollow: gradients differ")
    ax.axvline(1.0, color="lightgray", lw=0.8, zorder=0)
    ax.margins(x=0.12)
    ax.set_ylim(0, max([y for _, y, _ in pts] + [1]) * 1.15)
    ax.set_xlabel("step time / eager step time (lower is faster)")
    ax.set_ylabel("activation peak (MiB) above params, grads, inputs, optimizer state")
    shapes = " x ".join(str(d) for d in ctx.inputs[0].shape) if ctx.inputs else ""
    ax.set_title(f"{ctx.name} ({shapes}), {ctx.device.type}: activation memory vs step time")
    ax.grid(True, alpha=0.3)
    leg = ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    _place_labels(fig, ax, labels, obstacles=[leg])
    save_figure(fig, path)


# -------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remat-bench", description=__doc__.split("\n\n")[0],
                                epilog="methods: eager, ckpt-all, ckpt-every2, sac-matmul, compile-B, "
                                       "remat-plan, remat-B, remat-floor",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-mid", help="built-in name or .py model file (default gpt2-mid)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5, help="timed rounds (median; default 5)")
    p.add_argument("--methods", help="comma-separated method keys or prefixes (eager always runs)")
    p.add_argument("--budgets", default="0.7,0.5,0.3",
                   help="activation budgets for torch.compile and remat-ir (default 0.7,0.5,0.3)")
    p.add_argument("--optimizer", default="adam", choices=["none", "sgd", "adam"],
                   help="optimizer state allocated (and counted in the totals); default adam")
    p.add_argument("--time-limit", type=float, default=300.0, help="optimizer safety stop per budget (s)")
    p.add_argument("--cost", default="flops", choices=["flops", "profile"],
                   help="what remat-ir's optimizer minimizes: recomputed FLOPs (default), or recomputed op "
                        "time, each op timed on the device first (as remat-compile --cost profile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads; default on CPU 1: on a shared 2-core machine two intra-op "
                        "threads ran 5-8x slower and scattered whenever anything else was running (OpenMP "
                        "oversubscription), one thread stayed steady; on CUDA torch's default")
    p.add_argument("--md", help="also write the Markdown table to this file")
    p.add_argument("--png", help="write the Pareto plot (activation peak vs step-time ratio) here (.png, .pdf, "
                                    ".svg, ...)")
    p.add_argument("--json", help="also write every row's figures as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def default_args(**overrides) -> argparse.Namespace:
    """remat-bench's options with its defaults, for scripts that build a
    `Context` themselves; unknown option names are refused."""
    args = build_parser().parse_args([])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise TypeError(f"remat-bench has no option {k!r}")
        setattr(args, k, v)
    return args


def apply_threads(args) -> None:
    """Set torch's intra-op threads as remat-bench does (`--threads` help)."""
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)


def main(argv=None) -> int:
    threads = torch.get_num_threads()
    try:
        return run_cli("remat-bench", _main, argv)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) get theirs back


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    # Before any work: a bench run takes minutes, and must not write over its model file.
    check_outputs([("--md", args.md), ("--json", args.json), ("--png", args.png)],
                  [("the model file", model_file(args.model))], images=["--png"])
    try:
        budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
        if any(not (0 < b <= 1) for b in budgets):
            raise ValueError("budgets are fractions in (0, 1]")
        specs = select(method_specs(budgets), args.methods)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but no CUDA device is available")
        if args.steps < 1:
            raise ValueError("--steps must be at least 1")
        if not (math.isfinite(args.time_limit) and args.time_limit > 0):
            raise ValueError(f"--time-limit must be a positive, finite number of seconds, not {args.time_limit:g}")
        apply_threads(args)
        t_start = time.perf_counter()
        ctx = Context(args)
    except Exception as e:  # noqa: BLE001 - bad input: one line
        raise CliError(str(e)) from e

    log(f"remat-bench: {ctx.name} on {args.device}, {len(specs)} methods")
    if any(s.family == "compile" for s in specs):
        import torch._dynamo as dynamo

        dynamo.reset()
    # The reference: eager's gradients after a first step from .grad = None.
    try:
        ref = eager_reference(ctx)
    except Exception as e:  # noqa: BLE001
        raise CliError(f"the eager step fails: {type(e).__name__}: {e}", EXIT_FAIL) from e
    rows: list[Row] = []
    preps: dict[str, Prepared] = {}
    for spec in specs:
        row, prep = measure(ctx, spec, ref, log)
        if spec.key == "eager":
            if prep is None:
                raise CliError(f"eager failed: {row.status}", EXIT_FAIL)
            row.grads = "reference" if row.grad_diff == 0.0 else f"reference (rerun differs: {row.grads})"
        rows.append(row)
        if prep is not None:
            preps[spec.key] = prep
    log("timing:")
    time_rounds(ctx, rows, preps, args.steps, log)
    wall = time.perf_counter() - t_start
    md = markdown(ctx, rows, wall)
    sys.stdout.write(md)
    sys.stdout.flush()
    if args.md:
        write_atomically(args.md, md.encode("utf-8"))
    if args.json:
        write_json(ctx, rows, wall, args.json)
    if args.png:
        pareto_png(ctx, rows, args.png)
        log(f"wrote {args.png}")
    return EXIT_OK


def write_json(ctx: Context, rows: list[Row], wall: float, path: str) -> None:
    import dataclasses
    import json

    a = ctx.args
    out = {"model": ctx.name, "device": ctx.device.type, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "steps": a.steps, "optimizer": a.optimizer, "wall_s": wall,
           "trace_s": ctx.trace_s,
           "inputs": [list(x.shape) for x in ctx.inputs if isinstance(x, torch.Tensor)],
           "rows": [dict(dataclasses.asdict(r), step_time=r.step_time, ratio=r.ratio) for r in rows]}
    write_atomically(path, json.dumps(out, indent=1).encode("utf-8"))


def eager_reference(ctx: Context) -> list:
    """Eager gradients after a first step from `.grad = None` with the run's
    seed: what `measure` compares every method's first step with."""
    m = ctx.fresh()
    torch.manual_seed(ctx.args.seed)
    loss = ctx.eager_loss(m)
    loss.backward()
    return _grads(m)


if __name__ == "__main__":
    sys.exit(main())
