"""Run a plan for real: measured vs predicted peak, step time, gradient check.

Used by `remat-run` and the benchmark scripts.  Measurement (CPU: a storage
tracking dispatch mode; CUDA: `torch.cuda.max_memory_allocated`) covers one
training step, forward and `loss.backward()`, on top of what exists before it:
parameters, buffers, inputs, optimizer state and, after the first step, `.grad`.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from remat_ir.runtime.bind import PlanMismatch
from remat_ir.runtime.interpret import wrap
from remat_ir.ir import INPUT, RESULT, Program
from remat_ir.ir.types import DTYPE_SHORT, OPTIMIZER_STATES
from remat_ir.runtime.load import LoadedModel
from remat_ir.runtime.memtrack import measure_step
from remat_ir.check.simulate import MemoryReport, optimizer_state_bytes, simulate


@dataclass
class StepCheck:
    step: int
    grads_equal: bool
    max_abs_grad_diff: float
    loss_equal: bool
    worst: str = ""  # the parameter (or "input NAME", "buffer NAME") with the largest difference


@dataclass
class RunReport:
    predicted_first: MemoryReport
    predicted: MemoryReport  # grads present
    measured_first_peak: int
    measured_peak: int
    measured_baseline: dict[str, int]
    step_times: list[float]
    eager_step_times: list[float]
    checks: list[StepCheck] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    @property
    def eager_step_time(self) -> float:
        return statistics.median(self.eager_step_times) if self.eager_step_times else float("nan")

    @property
    def grads_match(self) -> bool | None:
        return all(c.grads_equal and c.loss_equal for c in self.checks) if self.checks else None

    @property
    def max_abs_grad_diff(self) -> float | None:
        return max(c.max_abs_grad_diff for c in self.checks) if self.checks else None

    def within_tolerance(self) -> bool:
        return (matches(self.predicted_first.peak_bytes, self.measured_first_peak)
                and matches(self.predicted.peak_bytes, self.measured_peak))


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
        out = eager_module(*eager_inputs)
        loss = loss_fn(out, *eager_inputs) if loss_fn is not None else out
        loss.backward()
        return loss.detach()

    def plan_step():
        loss = wrapped(*inputs)
        loss.backward()
        return loss.detach()

    opt_state = optimizer_state(module, program.header.optim)
    opt_bytes = optimizer_state_bytes(program, program.header.optim)
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
        predicted_first=simulate(program, grads_present=False, optim_state_bytes=opt_bytes),
        predicted=simulate(program, grads_present=True, optim_state_bytes=opt_bytes),
        measured_first_peak=first.peak_bytes, measured_peak=later.peak_bytes,
        measured_baseline=later.baseline_by_category, step_times=[], eager_step_times=[])

    # Eager gets its own module and inputs (a model may update an input in place).
    eager_module = copy.deepcopy(module).train()
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

    if check:
        # The model was checked against the plan by the wrap above.
        report.checks = check_gradients(program, model, steps=steps, device=device, seed=seed,
                                        check_model=False)
    return report


def check_gradients(program: Program, model: LoadedModel, *, steps: int = 3, device: str = "cpu",
                    seed: int = 0, check_model: bool = True) -> list[StepCheck]:
    """Eager and planned steps from the same parameters, inputs and seeds,
    compared after each step: the loss, every parameter's gradient, the
    gradient of every input that requires grad, and the buffers.  Each side
    has its own copy of the module and of the inputs, so a model that updates
    an input in place sees the same input on both.  Steps cycle through
    `.grad` handling: set to None, accumulated, zeroed in place."""
    _scalar_step(program)
    dev = torch.device(device)
    base = copy.deepcopy(model.module).to(dev)
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
        for m in (eager, planned.module):
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
        e = eager(*eager_inputs)
        e = loss_fn(e, *eager_inputs) if loss_fn is not None else e
        e.backward()
        torch.manual_seed(seed + step)
        p = planned(*plan_inputs)
        p.backward()
        worst, diff, equal = "", 0.0, True
        pairs = [(name, a, b) for (name, a), b in zip(eager.named_parameters(), planned.module.parameters())]
        pairs += grad_inputs
        for name, a, b in pairs:
            if (a.grad is None) != (b.grad is None):
                equal, diff, worst = False, float("inf"), name
                continue
            if a.grad is None:
                continue
            if not torch.equal(a.grad, b.grad):
                equal = False
            d = (a.grad.double() - b.grad.double()).abs().max().item() if a.grad.numel() else 0.0
            if d > diff or (not worst and not equal):
                diff, worst = d, name
        for (name, a), b in zip(eager.named_buffers(), planned.module.buffers()):
            if not torch.equal(a, b):
                equal, worst = False, f"buffer {name}"
        for (name, a, b) in zip(names, eager_inputs, plan_inputs):
            if isinstance(a, torch.Tensor) and not torch.equal(a, b):  # updated in place differently
                equal, worst = False, f"input {name} (updated in place)"
        out.append(StepCheck(step, equal, diff, bool(torch.equal(e.detach(), p.detach())), worst))
    return out
