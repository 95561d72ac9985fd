"""Measuring training steps side by side: remat-bench's measurement, shared
with the scripts in tools/ that measure the same way.

* memory: the *second* step (``.grad`` present), measured with
  `remat_ir.runtime.memtrack.measure_step` (CPU: the storage tracker; CUDA:
  the allocator's statistics, and its requested bytes); the activation peak
  is the peak above what exists before the step;
* gradients: the first step from ``.grad = None`` at a seed, compared with a
  reference's bitwise (else the max absolute and relative difference);
* step time: rounds of one step of every method, the order rotated from
  round to round so drift on a busy machine hits all methods alike; per
  round, each step's time over the reference's (eager's) in that round.

`Context` (the model, its inputs and loss, shared by the methods),
`MethodSpec` / `Prepared` (a method, and the method ready to run) and `Row`
(one method's figures) are what `remat_ir.cli.methods` builds and
`remat_ir.cli.bench_output` prints.
"""
from __future__ import annotations

import copy
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

MiB = 2**20


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} s" if x >= 0.1 else f"{1e3 * x:.0f} ms"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_settings(dev: torch.device) -> dict:
    """What the numbers depend on besides the code: versions, TF32, matmul precision."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # allow_tf32 is deprecated in favour of fp32_precision
        s = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(dev),
             "float32_matmul_precision": torch.get_float32_matmul_precision(),
             "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
             "tf32_matmul": getattr(torch.backends.cuda.matmul, "allow_tf32", None),
             "tf32_cudnn": getattr(torch.backends.cudnn, "allow_tf32", None),
             "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
        if dev.type == "cuda":
            s.update(device_name=torch.cuda.get_device_name(dev),
                     capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
                     cudnn=torch.backends.cudnn.version(),
                     cudnn_deterministic=torch.backends.cudnn.deterministic,
                     cudnn_benchmark=torch.backends.cudnn.benchmark,
                     sdp_enabled={k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                                  for k in ("flash", "mem_efficient", "math", "cudnn")
                                  if hasattr(torch.backends.cuda, f"{k}_sdp_enabled")})
        else:
            s["device_name"] = "cpu"
    return s


# ------------------------------------------------------------ the records


@dataclass
class Prepared:
    """A method ready to run: `step()` runs one training step (forward, loss,
    backward) and returns the detached loss."""

    module: torch.nn.Module  # whose parameters receive the gradients
    step: Callable[[], torch.Tensor]
    setup_s: float = 0.0  # solve time etc., before the first step
    predicted_total: int | None = None
    predicted_act: int | None = None
    predicted_host: int | None = None  # a plan that offloads: the simulator's host peak
    extra: str = ""  # a short note for the table (extra compute, ...)
    program: object = None
    result: object = None  # remat-ir: the optimizer's OptimizeResult (what it recomputes, ...)
    # Called after the first step (a torch.compile backend plans when it compiles):
    # fills the prediction and notes made then.
    late: Callable[["Prepared"], None] | None = None


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
    host_peak: int | None = None  # host bytes the step held at its peak (offloaded copies; measured)
    predicted_host: int | None = None
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
    """What all methods share: the model, its inputs, the loss, the device.
    `args` has remat-bench's options (`remat_ir.cli.bench.default_args`)."""

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
        self._memo = None
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

    def memo(self, offload: bool = False):
        """One optimizer memo for every budget row (one for the rows with
        offload, one for those without: a memo serves one setting): the
        block options (and rewritten graphs) built for one budget serve the
        next."""
        if self._memo is None:
            self._memo = {}
        if offload not in self._memo:
            from remat_ir.optimize.ladder import LadderMemo

            self._memo[offload] = LadderMemo()
        return self._memo[offload]

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


@dataclass
class MethodSpec:
    key: str
    label: str
    family: str
    prepare: Callable[[Context], Prepared]
    default: bool = True  # run when --methods is not given (else only when it names the method)


# -------------------------------------------------------------- gradients


def grads(module) -> list[torch.Tensor | None]:
    """Copies of the module's parameters' gradients (None where there is none)."""
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


def grad_check(ref: list, got: list) -> tuple[bool, float, float]:
    """(bitwise equal, max absolute difference, max relative difference) of
    `got` against `ref`; the differences are 0.0 where equal."""
    equal, diff = compare_grads(ref, got)
    if equal:
        return True, 0.0, 0.0
    return False, diff, relative_grads(ref, got)


# ------------------------------------------------------------------ steps


def first_step(module, step: Callable[[], object], seed: int, device: torch.device) -> tuple[list, float]:
    """One step from `.grad = None` at `seed`: the gradients it leaves (copies)
    and its wall time."""
    for p in module.parameters():
        p.grad = None
    gc.collect()
    torch.manual_seed(seed)
    sync(device)
    t = time.perf_counter()
    step()
    sync(device)
    return grads(module), time.perf_counter() - t


def pre_existing(module, inputs, opt_state) -> dict:
    """What exists before a step, by category (`measure_step`'s pre_existing):
    parameters, buffers, inputs, optimizer state and the gradients present."""
    pre = {"params": list(module.parameters()), "buffers": list(module.buffers()),
           "inputs": [x for x in inputs if isinstance(x, torch.Tensor)], "optimizer": opt_state}
    present = [p.grad for p in module.parameters() if p.grad is not None]
    if present:
        pre["grads"] = present
    return pre


def own_state_bytes(pre: dict) -> int:
    """The distinct storages' bytes of `pre` (each storage once)."""
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


def measured_step(step: Callable[[], object], pre: dict, seed: int, device: torch.device):
    """One step at `seed` with the state `pre` present, measured: the
    `measure_step` result, and on CUDA the allocator's requested bytes at the
    peak above the start (the bytes asked for, what the simulator models;
    None elsewhere)."""
    from remat_ir.runtime.memtrack import measure_step

    gc.collect()
    torch.manual_seed(seed)
    req0 = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        req0 = torch.cuda.memory_stats(device).get("requested_bytes.all.current")
    mem = measure_step(step, pre_existing=pre, device=device)
    requested = None
    if req0 is not None:
        # measure_step reset the peaks; this one is the step's.
        requested = torch.cuda.memory_stats(device)["requested_bytes.all.peak"] - req0
    return mem, requested


def compile_count() -> int:
    """Graphs dynamo has compiled so far (0 when dynamo is not loaded)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"].get("unique_graphs", 0))
    except Exception:  # noqa: BLE001
        return 0


def eager_reference(ctx: Context) -> list:
    """Eager gradients after a first step from `.grad = None` with the run's
    seed: what `measure` compares every method's first step with."""
    m = ctx.fresh()
    torch.manual_seed(ctx.args.seed)
    loss = ctx.eager_loss(m)
    loss.backward()
    return grads(m)


def measure(ctx: Context, spec: MethodSpec, ref_grads, log) -> tuple[Row, Prepared | None]:
    """Prepare one method, check its gradients (first step) and measure its
    memory (second step)."""
    from remat_ir.runtime.run import GRAD_RTOL, optimizer_state

    row = Row(spec.key, spec.label, spec.family)
    dev = ctx.device
    try:
        t0 = time.perf_counter()
        prep = spec.prepare(ctx)
        row.setup_s = prep.setup_s if prep.setup_s else None
        row.predicted_total, row.predicted_act, row.extra = prep.predicted_total, prep.predicted_act, prep.extra
        row.predicted_host = prep.predicted_host
        prep_s = time.perf_counter() - t0
        opt_state = optimizer_state(prep.module, ctx.args.optimizer)
        # Step 1, from .grad = None, same seed as the eager reference.
        got, row.first_step_s = first_step(prep.module, prep.step, ctx.args.seed, dev)
        if prep.late is not None:
            prep.late(prep)
            row.predicted_total, row.predicted_act, row.extra = prep.predicted_total, prep.predicted_act, prep.extra
        if ref_grads is None:
            row.grads = "-"
        else:
            equal, diff, rel = grad_check(ref_grads, got)
            # Within the tolerance remat-run --check documents (a chunked loss
            # sums in another order) is not a wrong gradient.
            row.grad_diff = 0.0 if equal or rel <= GRAD_RTOL else diff
            row.grads = ("bitwise" if equal else f"within tolerance ({rel:.1g} relative)" if rel <= GRAD_RTOL
                         else f"differ ({diff:.3g})")
        del got
        # Step 2: .grad present; measured.
        pre = pre_existing(prep.module, ctx.inputs, opt_state)
        n0 = compile_count()
        mem, _ = measured_step(prep.step, pre, ctx.args.seed + 1, dev)
        if compile_count() != n0:
            row.recompiled = True
        row.act_peak = mem.peak_above_baseline
        row.host_peak = mem.host_peak_bytes
        row.total_peak = own_state_bytes(pre) + mem.peak_above_baseline
        prep.opt_state = opt_state  # keep it alive: it is part of the state
        log(f"  {spec.key:<14} act {mib(row.act_peak):>12}  total {mib(row.total_peak):>12}  "
            f"first step {row.first_step_s:.2f} s  prep {prep_s:.1f} s  grads {row.grads}")
        return row, prep
    except Unavailable as e:
        row.status = f"n/a ({e})"
    except Exception as e:  # noqa: BLE001 - one method failing must not sink the table
        while type(e).__name__ == "BackendCompilerFailed" and getattr(e, "inner_exception", None) is not None:
            e = e.inner_exception  # dynamo's wrapper: the backend's own error says why
        if type(e).__name__ == "BackendError":
            fb = getattr(e, "floor_bytes", None)
            row.status = (f"n/a (infeasible: a region's floor is {mib(fb)})" if fb
                          else f"n/a ({str(e).split(':')[0]}: {str(e).split(': ', 1)[-1][:160]})")
            log(f"  {spec.key:<14} {row.status}")
            return row, None
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row.status = f"failed: {type(e).__name__}: {msg[:160]}"
    log(f"  {spec.key:<14} {row.status}")
    return row, None


def time_rounds(rows: list[Row], steps: dict[str, Callable[[], object]], rounds: int, device: torch.device,
                seed: int, log) -> None:
    """`rounds` rounds of one step of every row that is ok and has a step in
    `steps`, the order rotated each round: each round's time is appended to
    the row's `times`, and, when an "eager" row ran, the time over eager's in
    that round to its `ratios`; a row whose step made dynamo compile is
    marked `recompiled`."""
    keys = [r.key for r in rows if r.ok and r.key in steps]
    by_key = {r.key: r for r in rows}
    for i in range(rounds):
        k = i % len(keys) if keys else 0
        order = keys[k:] + keys[:k]
        gc.collect()
        for key in order:
            n0 = compile_count()
            torch.manual_seed(seed + 100 + i)
            sync(device)
            t0 = time.perf_counter()
            steps[key]()
            sync(device)
            by_key[key].times.append(time.perf_counter() - t0)
            if compile_count() != n0:
                by_key[key].recompiled = True
        if "eager" in by_key and by_key["eager"].times and len(by_key["eager"].times) == i + 1:
            te = by_key["eager"].times[-1]
            for key in order:
                by_key[key].ratios.append(by_key[key].times[-1] / te)
        log(f"  round {i + 1}/{rounds}: " + ", ".join(f"{k} {fmt_s(by_key[k].times[-1])}" for k in keys))


def paired_ratios(a: Row, b: Row) -> list[float]:
    """a's step time / b's, round by round (empty unless both ran every round)."""
    if len(a.times) != len(b.times):
        return []
    return [x / y for x, y in zip(a.times, b.times)]
