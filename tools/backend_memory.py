"""The torch.compile backend's memory, predicted and measured on CPU, with
aot_eager and with inductor (docs/13-torch-compile.md).

    python tools/backend_memory.py [--model examples/gpt_narrow.py] [--batch N] [--seq N]
                                   [--inners aot_eager,inductor] [--budgets 0.7,0.5,0.3,floor]
                                   [--device cpu|cuda] [--md FILE]

`--model` is a built-in (`gpt2-mid`), a model file (`.py` with `build()`),
or a transformers family of `remat_ir.models.families` (`llama`).  Each
(inner, budget) compiles the model with `remat_ir.backend(budget,
inner=...)` (dropout as the model has it) and measures its second step
(`.grad` present) from the CPU allocator's own records: the profiler's
`[memory]` events (`torch.profiler.profile(profile_memory=True)`), which see
every allocation of a CPU tensor, inductor's kernels' buffers included,
where the storage tracker (`remat_ir/runtime/memtrack.py`) sees only what
goes through the dispatcher.  A marker between forward and backward splits
the step, so the table has:

* live after forward: the bytes forward leaves behind (the saved set, the
  forward's results: the loss, and logits where the model returns them; with aot_eager the RNG states a recomputed dropout replays, 5,056
  bytes each), against the plan's saved set (what its backward reads and
  does not compute, less what existed before the step) plus its results;
* step peak: the step's peak above what existed before it, against the
  plan's simulated one (`simulate(plan, grads_present=True).step_peak_bytes`:
  the activation peak plus the gradients the compiled backward holds then);
  with aot_eager on CPU also the storage tracker's measurement.

On CUDA (`--device cuda`) the caching allocator's statistics
(`torch.cuda.memory_allocated`, `max_memory_allocated`) see every
allocation, inductor's kernels' included, in blocks of 512 bytes.

Each row's gradients after its two steps are compared ("bitwise", or the
largest difference relative to the largest gradient) with the same two
steps at the same seeds run by eager PyTorch (aot_eager rows) or by stock
`torch.compile(backend="inductor")` (inductor rows: inductor draws dropout
from its own seeds, so eager's masks are not its masks).  Eager is run
twice, and its own run-to-run difference is printed above the table.

A budget below a region's floor is reported with the floor.  Exit status 0,
2 on bad input.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
import time

import torch

from remat_ir.cli.measure import MiB


def load(spec: str, batch, seq, device: str = "cpu"):
    """(module, call(module) -> (loss, output), name) for a built-in, a model
    file or a family; the output (logits, ...) is held until the step ends,
    as the plan counts a forward result handed to the caller."""
    from remat_ir.models import families

    if spec in families.FAMILIES:
        module, kwargs = families.FAMILIES[spec](0)
        module.to(device).train()
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        def call_family(m):
            out = m(**kwargs)
            return out.loss, out

        return module, call_family, spec
    from remat_ir.runtime.load import load_model

    lm = load_model(spec, batch=batch, seq=seq, seed=0, device=device)
    module, inputs, loss_fn = lm.module, lm.inputs, lm.loss
    module.train()

    def call(m):
        out = m(*inputs)
        return (loss_fn(out, *inputs) if loss_fn is not None else out), out

    return module, call, lm.name


def cuda_step(call, compiled):
    """One step on CUDA: (the bytes allocated at the end of forward, the
    step's peak), both relative to the start, from the caching allocator's
    statistics."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, out = call(compiled)
    torch.cuda.synchronize()
    fwd_end = torch.cuda.memory_allocated() - start
    loss.backward()
    del loss, out
    torch.cuda.synchronize()
    return fwd_end, torch.cuda.max_memory_allocated() - start


def reference_grads(base, call, backend=None) -> list[torch.Tensor]:
    """Gradients after two steps at seeds 1 and 2, as each row runs them:
    eager PyTorch's, or with `backend` stock `torch.compile`'s."""
    model = copy.deepcopy(base)
    if backend is not None:
        torch._dynamo.reset()
        model = torch.compile(model, backend=backend, dynamic=False)
    for seed in (1, 2):
        torch.manual_seed(seed)
        call(model)[0].backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def grad_difference(ref: list[torch.Tensor], got: list[torch.Tensor]) -> str:
    """"bitwise", or the largest difference from `ref` relative to the
    largest reference gradient."""
    from remat_ir.cli.measure import compare_grads

    if len(got) != len(ref):
        return f"{len(got)} gradients, the reference has {len(ref)}"
    equal, diff = compare_grads(ref, got)
    if equal:
        return "bitwise"
    scale = max(float(a.double().abs().max()) for a in ref) or 1.0
    return f"{diff / scale:.1e} relative"


def allocator_step(call, compiled):
    """One step (forward, backward) under the profiler: (the running sum of
    the CPU allocator's bytes at the end of forward, the step's peak), both
    relative to the start.  One window: a block allocated before the
    profiler started is freed without its size, so forward and backward are
    told apart by a marker's time, not by two windows."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("backend_memory.forward"):
            loss, out = call(compiled)
        with record_function("backend_memory.backward"):
            loss.backward()
        del loss, out
    events = prof.profiler.kineto_results.events()
    bwd_start = min(e.start_ns() for e in events if e.name() == "backend_memory.backward")
    cur = peak = 0
    fwd_end = None
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if fwd_end is None and e.start_ns() >= bwd_start:
            fwd_end = cur
        cur += e.nbytes()
        peak = max(peak, cur)
    return (cur if fwd_end is None else fwd_end), peak


def predicted_saved(plan) -> int:
    """The bytes of the plan's saved set that did not exist before the step
    (each storage once), plus the forward results (the loss, logits)."""
    from remat_ir.ir.types import BUFFER, INPUT, PARAM, RESULT
    from remat_ir.torch_compile import saved_values

    values = plan.value_map()
    storages = {values[v].storage for v in saved_values(plan)}
    storages |= {values[o.value].storage for o in plan.outputs if o.kind == RESULT}
    return sum(int(values[s].nbytes) for s in storages if values[s].kind not in (PARAM, BUFFER, INPUT))


def run_one(base, call, budget, inner: str, ref: list[torch.Tensor], device: str = "cpu"):
    """One row: compile, a first step, then the measured second step."""
    import remat_ir
    from remat_ir.check.simulate import caller_held_bytes, simulate
    from remat_ir.runtime.memtrack import measure_step

    torch._dynamo.reset()
    model = copy.deepcopy(base)
    be = remat_ir.backend(budget, inner=inner, cache=False)  # each row plans
    compiled = torch.compile(model, backend=be, dynamic=False)
    row = {"inner": inner, "budget": budget}
    t0 = time.perf_counter()
    try:
        torch.manual_seed(1)
        call(compiled)[0].backward()
    except Exception as e:  # noqa: BLE001 - a region below its floor: say so
        while getattr(e, "inner_exception", None) is not None:
            e = e.inner_exception
        fb = getattr(e, "floor_bytes", None)
        row["status"] = (f"infeasible: floor {fb / MiB:.2f} MiB" if fb
                         else f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return row
    row["compile_s"] = time.perf_counter() - t0
    plans = be.plans
    row["regions"] = len(plans)
    row["recomputed"] = sum(1 for p in plans for i in p.backward if i.kind == "recompute")
    # The fraction resolved: what the caller holds, plus `budget` of the rest
    # of the region's unoptimized peak (resolve_budget); the chunked loss
    # leaves the results and their tangents as they are.
    row["unoptimized"] = None if budget == "floor" else sum(
        caller_held_bytes(p) + (p.header.budget.bytes - caller_held_bytes(p)) / budget for p in plans)
    row["pred_act"] = sum(simulate(p, grads_present=True).step_peak_bytes for p in plans)
    row["pred_saved"] = sum(predicted_saved(p) for p in plans)
    gc.collect()
    torch.manual_seed(2)
    step = cuda_step if device == "cuda" else allocator_step
    row["live_after_fwd"], row["act"] = step(call, compiled)
    row["grads"] = grad_difference(ref, [p.grad for p in model.parameters() if p.grad is not None])
    if inner == "aot_eager" and device != "cuda":
        params = list(model.parameters())

        def step():
            torch.manual_seed(2)
            loss, out = call(compiled)
            loss.backward()
            return loss.detach(), out

        mem = measure_step(step, pre_existing={"params": params, "buffers": list(model.buffers()),
                                               "grads": [p.grad for p in params if p.grad is not None]})
        row["tracker"] = mem.peak_above_baseline
    row["status"] = "ok"
    return row


def _budget(b) -> str:
    return b if isinstance(b, str) else f"{b:g}"


def table(name: str, rows: list[dict], grad_bytes: int, device: str = "cpu", eager: str = "") -> str:
    where = "CUDA caching allocator" if device == "cuda" else "CPU allocator"
    lines = [f"### {name}: the backend's memory, predicted and measured ({where})", "",
             f"Parameters' gradients (held until a compiled backward returns): {grad_bytes:,} bytes "
             f"({grad_bytes / MiB:.2f} MiB).  Eager PyTorch twice at the same seeds: {eager}.", "",
             "| inner | budget | region's unoptimized act. peak | recomputed | predicted saved + results | live after forward (measured) "
             "| predicted step peak | measured (allocator) | measured (storage tracker) | measured - predicted "
             "| gradients vs reference (aot_eager: eager; inductor: stock inductor) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['inner']} | {_budget(r['budget'])} | | {r['status']} | | | | | | | |")
            continue
        tr = f"{r['tracker']:,}" if "tracker" in r else "-"
        unopt = "-" if r["unoptimized"] is None else f"{r['unoptimized'] / MiB:.2f} MiB"
        lines.append(f"| {r['inner']} | {_budget(r['budget'])} | {unopt} | {r['recomputed']} | {r['pred_saved']:,} | "
                     f"{r['live_after_fwd']:,} | {r['pred_act']:,} | {r['act']:,} | {tr} | "
                     f"{r['act'] - r['pred_act']:+,} ({100 * (r['act'] - r['pred_act']) / r['pred_act']:+.1f}%) "
                     f"| {r['grads']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="examples/gpt_narrow.py")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--inners", default="aot_eager,inductor")
    p.add_argument("--budgets", default="0.7,0.5,0.3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--md", help="also write the table here")
    a = p.parse_args(argv)
    try:
        budgets = [b.strip() if b.strip() == "floor" else float(b) for b in a.budgets.split(",") if b.strip()]
        inners = [i.strip() for i in a.inners.split(",") if i.strip()]
        if any(i not in ("aot_eager", "inductor") for i in inners):
            raise ValueError("--inners: aot_eager, inductor")
        if a.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here")
        base, call, name = load(a.model, a.batch, a.seq, a.device)
    except Exception as e:  # noqa: BLE001 - bad input: one line
        print(f"backend_memory: error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    ref = {"aot_eager": reference_grads(base, call)}
    eager = grad_difference(ref["aot_eager"], reference_grads(base, call))
    if "inductor" in inners:
        ref["inductor"] = reference_grads(base, call, "inductor")
    rows = []
    for inner in inners:
        for b in budgets:
            r = run_one(base, call, b, inner, ref[inner], a.device)
            print(f"  {inner} {_budget(b)}: {r['status']}" + (f", compile {r['compile_s']:.1f} s" if "compile_s" in r else ""),
                  file=sys.stderr, flush=True)
            rows.append(r)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    md = table(name, rows, grad_bytes, a.device, eager)
    sys.stdout.write(md)
    if a.md:
        from remat_ir.ir.files import write_atomically

        write_atomically(a.md, md.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
