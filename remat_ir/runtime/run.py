"""Run a plan for real: measured vs predicted peak, step time, gradient check.

Used by `remat-run` and the benchmark scripts.  Measurement (CPU: a storage
tracking dispatch mode; CUDA: `torch.cuda.max_memory_allocated`) covers one
training step, forward and `loss.backward()`, on top of what exists before it:
parameters, buffers, inputs, optimizer state and, after the first step, `.grad`.
A plan that offloads values also has its host pool (their host copies)
measured apart, against the simulator's `host_peak_bytes`.
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from remat_ir.runtime.bind import PlanMismatch
from remat_ir.runtime.interpret import unwrap, wrap
from remat_ir.ir import INPUT, RESULT, Program
from remat_ir.ir import sizes as sz
from remat_ir.ir.types import DTYPE_SHORT, OPTIMIZER_STATES
from remat_ir.runtime.load import LoadedModel
from remat_ir.runtime.memtrack import measure_step
from remat_ir.check.simulate import MemoryReport, optimizer_state_bytes, simulate


# How far a plan's gradients may be from eager's and still match: the
# largest |plan - eager| of a tensor over the largest |eager| of that tensor.
# Reordering float32 sums (a fused or split reduction) moves a gradient by
# about float32's own rounding; 1e-4 leaves room for longer reductions and still fails a
# wrong op, a wrong scale or a dropped term, which are off by far more.
GRAD_RTOL = 1e-4
# Gradients of 16 bits or fewer (float16, bfloat16) round each sum to ~1e-3.
GRAD_RTOL_LOW_PRECISION = 1e-2


def grad_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance for a tensor of `dtype` (the loss's, a gradient's, a buffer's)."""
    if dtype.is_floating_point or dtype.is_complex:
        return GRAD_RTOL_LOW_PRECISION if torch.finfo(dtype).bits <= 16 else GRAD_RTOL
    return 0.0  # integer state (batch norm's step count) has no rounding to forgive


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, tiny): 0.0 when equal, inf when the
    shapes differ, nan when either holds a NaN."""
    if got.shape != want.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    wide = torch.complex128 if want.is_complex() or got.is_complex() else torch.float64
    w, g = want.detach().to(wide), got.detach().to(wide)
    tiny = torch.finfo(want.dtype).tiny if (want.dtype.is_floating_point or want.is_complex()) else 1.0
    return (g - w).abs().max().item() / max(w.abs().max().item(), tiny)


def _close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, bool, float]:
    """(bitwise equal, within the tolerance, relative difference)."""
    if torch.equal(got, want):
        return True, True, 0.0
    rel = relative_difference(got, want)
    return False, rel <= grad_tolerance(want.dtype), rel  # a NaN difference is never close


@dataclass
class StepCheck:
    step: int
    grads_equal: bool  # bitwise: every gradient, buffer and in-place-updated input
    max_abs_grad_diff: float
    loss_equal: bool  # bitwise
    worst: str = ""  # the parameter (or "input NAME", "buffer NAME") with the largest relative difference
    max_rel_grad_diff: float = 0.0  # over the gradients (see relative_difference)
    grads_close: bool = True  # every gradient, buffer and in-place-updated input within grad_tolerance
    loss_close: bool = True
    worst_rel_diff: float = 0.0  # the relative difference of `worst`


@dataclass
class RunReport:
    predicted_first: MemoryReport
    predicted: MemoryReport  # grads present
    measured_first_peak: int
    measured_peak: int
    measured_baseline: dict[str, int]  # the registered state by category (what measured_peak counts)
    step_times: list[float]
    eager_step_times: list[float]
    checks: list[StepCheck] = field(default_factory=list)
    measured_outside: int = 0  # CUDA: what the device held beyond that state (workspaces), not counted
    # The host pool (copies of offloaded values): its measured peak in the first and a later step.
    measured_first_host_peak: int = 0
    measured_host_peak: int = 0

    @property
    def step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    @property
    def eager_step_time(self) -> float:
        return statistics.median(self.eager_step_times) if self.eager_step_times else float("nan")

    @property
    def grads_match(self) -> bool | None:
        """Loss, gradients and buffers within `grad_tolerance` of eager's, every step."""
        return all(c.grads_close and c.loss_close for c in self.checks) if self.checks else None

    @property
    def grads_bitwise(self) -> bool | None:
        return all(c.grads_equal for c in self.checks) if self.checks else None

    @property
    def loss_bitwise(self) -> bool | None:
        return all(c.loss_equal for c in self.checks) if self.checks else None

    @property
    def max_abs_grad_diff(self) -> float | None:
        return max(c.max_abs_grad_diff for c in self.checks) if self.checks else None

    @property
    def max_rel_grad_diff(self) -> float | None:
        return _max_nan(c.max_rel_grad_diff for c in self.checks) if self.checks else None

    def within_tolerance(self) -> bool:
        """Both steps' device peaks, and their host pools' peaks, as predicted (`matches`)."""
        return (matches(self.predicted_first.peak_bytes, self.measured_first_peak)
                and matches(self.predicted.peak_bytes, self.measured_peak)
                and matches(self.predicted_first.host_peak_bytes, self.measured_first_host_peak)
                and matches(self.predicted.host_peak_bytes, self.measured_host_peak))


def _max_nan(xs) -> float:
    """max, but a NaN anywhere is the answer (max() would drop it after a number)."""
    out = 0.0
    for x in xs:
        if math.isnan(x):
            return x
        out = max(out, x)
    return out


def matches(predicted: int, measured: int) -> bool:
    """The project's promise: within 1% + 1 MiB."""
    return abs(predicted - measured) <= 0.01 * max(predicted, measured) + 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_state(module: torch.nn.Module, optimizer: str) -> list[torch.Tensor]:
    """Tensors the size of what `optimizer` keeps (`OPTIMIZER_STATES` per
    trainable parameter, each like the parameter), so measurements include
    them as a training loop would."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    per = OPTIMIZER_STATES[optimizer]
    return [torch.zeros_like(p) for p in module.parameters() if p.requires_grad for _ in range(per)]


def step_result_problem(program: Program) -> str | None:
    """Why `program`'s step does not end in one scalar loss that
    `loss.backward()` can start from ("a tuple of 2 tensors (f32[3,4],
    f32[3,4])"); None when it does."""
    values = program.value_map()
    results = [values[o.value] for o in program.outputs if o.kind == RESULT]
    spec = pytree.treespec_loads(program.header.output_spec) if program.header.output_spec else None
    leaf = spec is None or spec.is_leaf()
    if len(results) == 1 and leaf:
        n = math.prod(results[0].shape)
        return None if n == 1 else f"a tensor of shape {results[0].shape} ({n} elements)"
    kind = spec.type.__name__ if spec is not None and spec.type is not None else "structure"
    shapes = ", ".join(f"{DTYPE_SHORT.get(v.dtype, v.dtype)}[{','.join(map(str, v.shape))}]" for v in results)
    return f"a {kind} of {len(results)} tensor{'s' if len(results) != 1 else ''} ({shapes})"


def own_copy(inputs: tuple) -> tuple:
    """The step's inputs, copied: a model that updates an input in place
    (`x.mul_(2)`) then changes only its own copy.  `requires_grad` is kept."""
    return tuple(x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                 for x in inputs)


def _scalar_step(program: Program) -> None:
    problem = step_result_problem(program)
    if problem is not None:
        raise PlanMismatch(f"the plan's step returns {problem}, not a scalar loss, so a training step "
                           f"cannot call .backward() on it; compile the plan from a model whose forward, "
                           f"or loss(output, *inputs), returns a scalar loss")


def _autocast(program: Program):
    """The `torch.autocast` a step of `program` runs its forward (and loss)
    under: the one it was traced under (its header's), none when it has none."""
    if not program.header.autocast:
        return contextlib.nullcontext()
    from remat_ir.trace.calls import parse_autocast

    device_type, dtype = parse_autocast(program.header.autocast)
    return torch.autocast(device_type, dtype=dtype)


def input_sizes(program: Program, inputs: tuple) -> dict[str, int]:
    """The size symbols of a symbolic `program` bound by the tensors among
    `inputs` (positional, as a model file's `build()` gives them); ValueError
    when they do not fit its inputs' shapes."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    plan_inputs = [v for v in program.values if v.kind == INPUT]
    if len(tensors) != len(plan_inputs):
        raise ValueError(f"the plan takes {len(plan_inputs)} tensor inputs, the call gives {len(tensors)} "
                         "(positional tensors)")
    sizes, why = sz.bind_sizes([(v.source or v.name, v.shape, list(t.shape)) for v, t in zip(plan_inputs, tensors)])
    if why:
        raise ValueError(why)
    return sizes


def _instantiated(program: Program, inputs: tuple) -> Program:
    """`program` at the sizes of `inputs` (a plan without symbols: itself)."""
    if not sz.is_symbolic(program):
        return program
    sizes = input_sizes(program, inputs)
    why = sz.check_sizes(program, sizes)
    if why:
        raise ValueError(f"the plan does not cover these inputs: {why}")
    return sz.instantiate(program, sizes)


def run_plan(program: Program, model: LoadedModel, *, steps: int = 3, device: str = "cpu",
             check: bool = False, seed: int = 0, check_model: bool = True) -> RunReport:
    _scalar_step(program)
    dev = torch.device(device)
    module = model.module.to(dev)
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in model.inputs)
    wrapped = wrap(module, program, loss=model.loss, check_model=check_model)
    wrapped.train()
    loss_fn = model.loss
    eager_module = eager_inputs = None  # made after the measurement, which they would be part of on CUDA

    def eager_step():
        with _autocast(program):
            out = eager_module(*eager_inputs)
            loss = loss_fn(out, *eager_inputs) if loss_fn is not None else out
        loss.backward()
        return loss.detach()

    def plan_step():
        with _autocast(program):
            loss = wrapped(*inputs)
        loss.backward()
        return loss.detach()

    # A symbolic plan runs as it is (its model check retraces with symbols); its
    # predictions are its instantiation's at these inputs' sizes.
    at = _instantiated(program, inputs)
    opt_state = optimizer_state(module, program.header.optim)
    opt_bytes = optimizer_state_bytes(at, program.header.optim)
    params = [p for p in module.parameters()]
    pre = {"params": params, "buffers": list(module.buffers()),
           "inputs": [x for x in inputs if isinstance(x, torch.Tensor)], "optimizer": opt_state}

    # On CUDA, one warm-up step first so one-time allocations (cuBLAS
    # workspaces, ...) are not in the measured peak; then start fresh.
    if dev.type == "cuda":
        torch.manual_seed(seed)
        plan_step()
        for p in params:
            p.grad = None

    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    first = measure_step(plan_step, pre_existing=pre, device=dev)
    pre_with_grads = dict(pre, grads=[p.grad for p in params if p.grad is not None])
    torch.manual_seed(seed + 1)
    later = measure_step(plan_step, pre_existing=pre_with_grads, device=dev)

    report = RunReport(
        predicted_first=simulate(at, grads_present=False, optim_state_bytes=opt_bytes),
        predicted=simulate(at, grads_present=True, optim_state_bytes=opt_bytes),
        measured_first_peak=first.peak_bytes, measured_peak=later.peak_bytes,
        measured_baseline={k: v for k, v in later.baseline_by_category.items() if k != "unregistered"},
        measured_outside=later.baseline_by_category.get("unregistered", 0), step_times=[], eager_step_times=[],
        measured_first_host_peak=first.host_peak_bytes, measured_host_peak=later.host_peak_bytes)

    # Eager gets its own module and inputs (a model may update an input in place).
    eager_module = unwrap(copy.deepcopy(module)).train()
    eager_inputs = own_copy(inputs)
    # Timing: alternate the two so drift on a busy machine hits both alike.
    for i in range(max(steps, 1)):
        for fn, sink in ((eager_step, report.eager_step_times), (plan_step, report.step_times)):
            torch.manual_seed(seed + 100 + i)
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            sink.append(time.perf_counter() - t0)

    unwrap(module)  # (the caller's model as it was)
    if check:
        # The model was checked against the plan by the wrap above.
        report.checks = check_gradients(program, model, steps=steps, device=device, seed=seed,
                                        check_model=False)
    return report


def check_gradients(program: Program, model: LoadedModel, *, steps: int = 3, device: str = "cpu",
                    seed: int = 0, check_model: bool = True) -> list[StepCheck]:
    """Eager and planned steps from the same parameters, inputs and seeds,
    compared after each step: the loss, every parameter's gradient, the
    gradient of every input that requires grad, and the buffers, each both
    bitwise and within `grad_tolerance` (relative to eager's).  Each side
    has its own copy of the module and of the inputs, so a model that updates
    an input in place sees the same input on both.  Steps cycle through
    `.grad` handling: set to None, accumulated, zeroed in place."""
    _scalar_step(program)
    dev = torch.device(device)
    base = unwrap(copy.deepcopy(model.module)).to(dev)
    eager = copy.deepcopy(base)
    planned = wrap(copy.deepcopy(base), program, loss=model.loss, check_model=check_model)
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in model.inputs)
    eager_inputs, plan_inputs = own_copy(inputs), own_copy(inputs)
    names = [v.name for v in program.values if v.kind == INPUT]
    names += [f"input{i}" for i in range(len(names), len(inputs))]
    grad_inputs = [(f"input {names[i]}", eager_inputs[i], plan_inputs[i]) for i, x in enumerate(inputs)
                   if isinstance(x, torch.Tensor) and x.requires_grad]
    loss_fn = model.loss
    out: list[StepCheck] = []
    for step in range(steps):
        mode = step % 3
        for m in (eager, planned):
            if mode == 0:
                m.zero_grad(set_to_none=True)
            elif mode == 2:
                m.zero_grad(set_to_none=False)
        for _, *xs in grad_inputs:
            for x in xs:
                if mode == 0:
                    x.grad = None
                elif mode == 2 and x.grad is not None:
                    x.grad.zero_()
        torch.manual_seed(seed + step)
        with _autocast(program):  # forward (and loss) as the plan was traced; backward outside
            e = eager(*eager_inputs)
            e = loss_fn(e, *eager_inputs) if loss_fn is not None else e
        e.backward()
        torch.manual_seed(seed + step)
        with _autocast(program):
            p = planned(*plan_inputs)
        p.backward()
        worst, worst_rel, diff, grad_rel, equal, close = "", 0.0, 0.0, 0.0, True, True

        def differs(name: str, same: bool, near: bool, rel: float) -> None:
            nonlocal worst, worst_rel, equal, close
            equal, close = equal and same, close and near
            if not same and (not worst or math.isnan(rel) or rel > worst_rel):
                worst, worst_rel = name, rel

        pairs = [(name, a, b) for (name, a), b in zip(eager.named_parameters(), planned.parameters())]
        pairs += grad_inputs
        for name, a, b in pairs:
            if (a.grad is None) != (b.grad is None):
                diff, grad_rel = float("inf"), float("inf")
                differs(name, False, False, float("inf"))
                continue
            if a.grad is None:
                continue
            same, near, rel = _close(b.grad, a.grad)
            differs(name, same, near, rel)
            grad_rel = _max_nan((grad_rel, rel))
            if a.grad.shape != b.grad.shape:
                diff = float("inf")
            elif a.grad.numel() and not same:
                diff = max(diff, (a.grad.double() - b.grad.double()).abs().max().item())
        for (name, a), b in zip(eager.named_buffers(), planned.buffers()):
            differs(f"buffer {name}", *_close(b, a))
        for (name, a, b) in zip(names, eager_inputs, plan_inputs):
            if isinstance(a, torch.Tensor):  # updated in place differently?
                differs(f"input {name} (updated in place)", *_close(b, a))
        loss_same, loss_near, _ = _close(p.detach(), e.detach())
        out.append(StepCheck(step, equal, diff, loss_same, worst, max_rel_grad_diff=grad_rel,
                             grads_close=close, loss_close=loss_near, worst_rel_diff=worst_rel))
    return out
