"""GPU check: remat-ir plans on GPT-2 medium, predicted vs measured, gradients vs eager.

    python tools/gpu_check.py                              # on a CUDA machine, all in one go
    python tools/gpu_check.py --compile-only --plans DIR   # on any machine (CPU, FakeTensorMode)
    python tools/gpu_check.py --plans DIR                  # on the CUDA machine: no cvxpy needed
    python tools/gpu_check.py --device cpu --small         # a quick end-to-end run on CPU

(`tools/gpu_window.sh` runs it on a GPU with `tests/test_cuda.py` and
`tools/gpu_probe.py`, from plans and wheels prepared on CPU.)

GPT-2 medium (the built-in "gpt2-medium"), fp32, batch 4 x seq 512, dropout
on, Adam state allocated (two fp32 moments per parameter, as
`remat_ir.runtime.run.optimizer_state`), `.grad` present.  Rows: eager PyTorch,
torch.utils.checkpoint around every block, remat-ir's unoptimized plan, and
plans optimized at 0.7 / 0.5 / 0.3 of the unoptimized activation peak and at
the floor.  For each: predicted peak (the simulator) vs measured, total and
activations (above parameters, gradients, optimizer state, buffers, inputs);
on CUDA measured twice, as the allocator's `requested_bytes.all.peak` (the
bytes asked for, what the simulator models) and `max_memory_allocated`
(rounded up to the allocator's blocks); on CPU by the storage tracker.  Then
the step time relative to eager and to checkpointing every block, and the
gradients against eager at the same seed.

The rows are measured as remat-bench measures its methods, with the same
functions (`remat_ir.cli.measure`): the first step from ``.grad = None`` for
the gradients, the second for memory, rotated rounds for the step time.

Eager's prediction is the step as eager PyTorch runs it on the device:
traced there without remat-ir's fusions (on a CUDA machine, under fake CUDA
tensors, so SDPA is the backend CUDA picks).

Eager runs twice at the same seed first.  Where its gradients are bitwise
reproducible, every plan's gradients must equal eager's bit for bit; where
they are not, differences are reported beside eager's own run-to-run
difference.  The torch, CUDA and cuDNN versions and the TF32 and float32
matmul-precision settings are recorded with the table.

Offload (`--offload-budgets B,...`): plans that may also move activations
to host memory (`fit(..., offload=True, exact=True)`: no graph rewrite
that changes eager's bits; on CUDA the chunked loss is not available
either, its ops being CPU-only, so below the recompute floor these plans
are offload alone), tagged `offload-B`, and a row for torch's
`torch.autograd.graph.save_on_cpu` (the eager step inside it: every saved
tensor copied to the host and back; `remat_ir.cli.methods.CountedSaveOnCpu`).
Their rows add the host peak (measured: pinned bytes in use on CUDA, the
storage tracker's host pool on CPU; predicted for the plans) and the step
time against the recompute-only floor plan ("floor" in `--budgets`).

Plans are traced on CPU under FakeTensorMode (nothing is allocated) for the
target device (`trace(..., device=...)`: CUDA's dropout, no CPU-only ops);
`--plans DIR` reads `.rir` files written by `--compile-only` (file names
carry model, batch, seq, device and budget), so the CUDA machine needs only
torch, msgspec and remat-ir's runtime (no cvxpy).  A plan missing from DIR
is compiled on the spot when the optimizer is importable.  All models share
one set of parameters, so the GPU holds one model.

Exit code 0 when every measured peak is within 1% + 1 MiB of the prediction
(CUDA: requested bytes) and, where eager is reproducible, every plan's
gradients equal eager's; 1 otherwise; 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from remat_ir.cli.bench_output import write_table
from remat_ir.cli.measure import (Row, compare_grads, device_settings, first_step, grad_check, measured_step, mib,
                                  paired_ratios, pre_existing, time_rounds)
from remat_ir.cli.methods import CountedSaveOnCpu, checkpoint_blocks, find_blocks, quiet_stdout, restore_blocks

OFFLOAD_TAG = "offload-"  # an offload plan's tag: "offload-0.15"


def plan_name(model: str, batch: int, seq: int | None, device: str, tag: str) -> str:
    base = os.path.basename(model).replace(".py", "")
    return f"{base}_b{batch}_s{seq if seq else 0}_{device}_{tag}.rir"


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------- compiling


def trace_plan(args):
    """The unoptimized plan for the target device, traced on CPU under fake mode."""
    from remat_ir.pipeline import trace
    from remat_ir.runtime.load import load_model

    m = load_model(args.model, batch=args.batch, seq=args.seq, device="cpu", fake=True, seed=args.seed)
    program = trace(m.module, m.inputs, loss=m.loss, name=m.name, optimizer="adam", fake=True,
                    device=args.device)
    program.header.comment[0] += ", gpu_check"
    return program


def eager_program(model, inputs, loss_fn, name: str, device: str):
    """The step as eager PyTorch runs it on `device`, as a plan: traced there
    (fake tensors on the model's device) without remat-ir's fusions; its
    simulated peak is eager's prediction."""
    from remat_ir.check.simulate import optimizer_state_bytes
    from remat_ir.trace.tracer import trace_module

    p = trace_module(model, inputs, loss_fn=loss_fn, model_name=name, fake=True, device=device, fuse=False)
    p.header.optim = "adam"
    p.header.optim_state_bytes = optimizer_state_bytes(p, "adam")
    return p


def compile_plans(args, tags: list[str], plans: dict) -> dict[str, str]:
    """Fill `plans` (tag -> Program) for the missing tags; tag -> reason for
    those that could not be made."""
    failed: dict[str, str] = {}
    if "plan" not in plans:
        t0 = time.perf_counter()
        plans["plan"] = trace_plan(args)
        _log(f"traced {args.model} in {time.perf_counter() - t0:.1f} s ({len(plans['plan'].nodes)} ops)")
    base = plans["plan"]
    todo = [t for t in tags if t != "plan" and t not in plans]
    if not todo:
        return failed
    from remat_ir.pipeline import CompileStats, fit

    try:
        import remat_ir.optimize  # noqa: F401
    except Exception as e:  # noqa: BLE001
        reason = f"optimizer unavailable: {type(e).__name__}: {str(e).split(' (')[0]}"
        return {t: reason for t in todo}
    for tag in todo:
        t0 = time.perf_counter()
        stats = CompileStats()
        offload = tag.startswith(OFFLOAD_TAG)
        budget = tag[len(OFFLOAD_TAG):] if offload else tag
        # Offload plans: eager's bits (exact), moved to the host where recomputation cannot fit.
        kw = {"offload": True, "exact": True} if offload else {}
        try:
            with quiet_stdout(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # cvxpy's "solution may be inaccurate": the plan is verified anyway
                p = fit(base, budget, scope="activations", time_limit=args.time_limit, stats=stats, **kw)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ == "Infeasible" and getattr(e, "floor_bytes", None):
                failed[tag] = f"infeasible: below the floor, {mib(e.floor_bytes)}"
            else:
                failed[tag] = f"{type(e).__name__}: {e}"
            _log(f"  {tag}: {failed[tag]}")
            continue
        res = stats.optimized
        extra = 100 * res.extra_cost / max(res.base_cost, 1)
        n_off = sum(1 for ins in p.forward if ins.kind == "offload")
        # With offload the modeled cost counts the copies too (their time, in the cost model's units).
        what = "modeled extra cost (recompute and copies)" if offload else "extra compute"
        how = f", {n_off} values offloaded" if offload else ""
        p.header.comment = list(base.header.comment) + [
            f"budget {tag} (activations): solved in {res.seconds:.1f} s, {what} {extra:.1f}%{how}"]
        plans[tag] = p
        _log(f"  {tag}: solved in {res.seconds:.1f} s ({time.perf_counter() - t0:.1f} s), {what} +{extra:.1f}%{how}")
    return failed


def manifest_path(args) -> str:
    return os.path.join(args.plans, plan_name(args.model, args.batch, args.seq, args.device, "missing")
                        .replace(".rir", ".json"))


def load_plans(args, tags) -> tuple[dict, dict]:
    """Plans found in --plans, and the reasons recorded by --compile-only for
    the budgets that have none (e.g. infeasible: below the floor)."""
    from remat_ir.ir.files import load_plan

    plans, missing = {}, {}
    if not args.plans:
        return plans, missing
    if os.path.exists(manifest_path(args)):
        with open(manifest_path(args)) as f:
            missing = {k: v for k, v in json.load(f).items() if k in tags}
    for tag in tags:
        path = os.path.join(args.plans, plan_name(args.model, args.batch, args.seq, args.device, tag))
        if os.path.exists(path):
            t0 = time.perf_counter()
            plans[tag] = load_plan(path)
            missing.pop(tag, None)
            _log(f"loaded {path} ({time.perf_counter() - t0:.1f} s)")
    return plans, missing


# --------------------------------------------------------------- running


@dataclass
class Check(Row):
    """One row: remat-bench's `Row` (measured total and activation peaks,
    step times, per-round ratios to eager) and what the check adds."""

    step: Callable[[], object] | None = None
    program: object = None  # the plan (remat-ir rows)
    note: str = ""
    requested_total: int | None = None  # CUDA only: the allocator's requested bytes
    requested_act: int | None = None
    raw_peak: int | None = None
    grad_equal: bool | None = None
    grad_rel: float | None = None  # max relative difference from eager's gradients


def label_of(tag: str) -> str:
    if tag.startswith(OFFLOAD_TAG):
        return f"remat-ir, budget {tag[len(OFFLOAD_TAG):]}, offload"
    return {"plan": "remat-ir, unoptimized plan", "floor": "remat-ir, floor"}.get(tag, f"remat-ir, budget {tag}")


def run(args, plans: dict, failed: dict) -> tuple[list[Check], dict]:
    from remat_ir.check.simulate import simulate
    from remat_ir.runtime.bind import PlanMismatch, first_difference
    from remat_ir.runtime.interpret import adopt, planner, unwrap, wrap
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import optimizer_state
    from remat_ir.trace.device import is_neutral

    dev = torch.device(args.device)
    info: dict = {}
    t0 = time.perf_counter()
    m = load_model(args.model, batch=args.batch, seq=args.seq, device=args.device, seed=args.seed)
    model = m.module.to(dev).train()
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in m.inputs)
    loss_fn = m.loss
    _log(f"built {args.model} on {dev} in {time.perf_counter() - t0:.1f} s")
    opt_state = optimizer_state(model, "adam")

    def eager_step():
        out = model(*inputs)
        loss = loss_fn(out, *inputs) if loss_fn is not None else out
        loss.backward()

    blocks = find_blocks(model) or []

    def ckpt_step():
        # The model is shared with the other rows: checkpoint its blocks for this step only.
        patched = checkpoint_blocks(blocks)
        try:
            eager_step()
        finally:
            restore_blocks(patched)

    eager = Check("eager", "eager PyTorch (predicted: its own trace)", "eager", step=eager_step)
    t1 = time.perf_counter()
    eager_prog = eager_program(model, inputs, loss_fn, m.name, args.device)
    rep = simulate(eager_prog, grads_present=True)
    eager.predicted_total, eager.predicted_act = rep.peak_bytes, rep.activation_peak_bytes
    _log(f"eager's own trace on {dev}: {time.perf_counter() - t1:.1f} s")
    if "plan" in plans and is_neutral(plans["plan"]):
        difference, _ = first_difference(plans["plan"], eager_prog)
        info["neutral_vs_device_trace"] = difference or "same graph"
        _log(f"device-neutral plan vs the trace on {dev}: {difference or 'same graph'}")
    del eager_prog

    def save_on_cpu_step():
        with CountedSaveOnCpu(dev):
            eager_step()

    methods = [eager]
    if blocks:
        methods.append(Check("ckpt-all", "checkpoint every block", "checkpoint", step=ckpt_step))
    if args.offload_budgets:
        methods.append(Check("save-on-cpu", "torch save_on_cpu", "save_on_cpu", step=save_on_cpu_step))
    for tag in args.tags:
        label = label_of(tag)
        family = "offload" if tag.startswith(OFFLOAD_TAG) else "remat"
        if tag not in plans:
            methods.append(Check(f"remat-{tag}", label, family, status=f"n/a ({failed.get(tag, 'no plan')})"))
            continue
        program = plans[tag]
        note = ""
        try:
            try:
                w = wrap(model, program, loss=loss_fn)
            except PlanMismatch as e:
                if "no longer" not in str(e):
                    raise
                # The retrace on this device differs from the plan: say so, and measure it anyway.
                note = f"model check: {str(e).split('; recompile')[0]}"
                w = wrap(model, program, loss=loss_fn, check_model=False)
        except Exception as e:  # noqa: BLE001
            methods.append(Check(f"remat-{tag}", label, family, status=f"failed: {type(e).__name__}: {e}"))
            continue

        # wrap() adopts the model in place: each plan's step adopts it for itself, and
        # the eager steps (and the other plans) meet the model as it was.
        p = planner(w)
        unwrap(model)

        def plan_step(p=p):
            adopt(model, p)
            try:
                model(*inputs).backward()
            finally:
                unwrap(model)

        rep = simulate(program, grads_present=True)
        methods.append(Check(f"remat-{tag}", label, family, step=plan_step, program=program, note=note,
                             predicted_total=rep.peak_bytes, predicted_act=rep.activation_peak_bytes,
                             predicted_host=rep.host_peak_bytes if family == "offload" else None))

    # Eager twice at the same seed: whether its gradients are reproducible
    # decides whether a plan's differing gradients fail the check.
    ref, _ = first_step(model, eager_step, args.seed, dev)
    again, _ = first_step(model, eager_step, args.seed, dev)
    equal, diff = compare_grads(ref, again)
    info["eager_reproducible"] = equal
    info["eager_rerun_grad_diff"] = 0.0 if equal else diff
    del again
    _log(f"  eager twice at one seed: {'bitwise equal' if equal else f'differs by up to {diff:.3g}'}")

    for mm in methods:
        if mm.status != "ok":
            _log(f"  {mm.key:<12} {mm.status}")
            continue
        try:
            # Step 1 from .grad = None (also the CUDA warm-up): the gradients.
            got, mm.first_step_s = first_step(model, mm.step, args.seed, dev)
            if mm.key != "eager":
                mm.grad_equal, mm.grad_diff, mm.grad_rel = grad_check(ref, got)
            del got
            # Step 2 with .grad present: measured.
            pre = pre_existing(model, inputs, opt_state)
            mem, requested = measured_step(mm.step, pre, args.seed + 1, dev)
            own = sum(v for k, v in mem.baseline_by_category.items() if k != "unregistered")
            mm.act_peak = mem.peak_above_baseline
            mm.host_peak = mem.host_peak_bytes
            mm.total_peak = own + mem.peak_above_baseline
            mm.raw_peak = sum(mem.baseline_by_category.values()) + mem.peak_above_baseline  # workspaces too
            if requested is not None:
                mm.requested_act = requested
                mm.requested_total = own + requested
            _log(f"  {mm.key:<12} measured act {mib(mm.requested_act if dev.type == 'cuda' else mm.act_peak)}, "
                 f"predicted {mib(mm.predicted_act)}")
        except Exception as e:  # noqa: BLE001 - one row failing (out of memory, ...) must not sink the rest
            mm.status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if mm.status != "ok":
            _log(f"  {mm.key:<12} {mm.status}")
            for p in model.parameters():
                p.grad = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    time_rounds(methods, {mm.key: mm.step for mm in methods if mm.ok}, args.steps, dev, args.seed, _log)
    return methods, info


def _pct(measured, predicted) -> str:
    return "-" if measured is None or predicted is None else f"{100 * (measured - predicted) / max(predicted, 1):+.2f}%"


def report(args, methods: list[Check], info: dict, wall: float) -> tuple[str, bool, dict]:
    from remat_ir.rewrite import keeps_bits
    from remat_ir.runtime.run import GRAD_RTOL, matches

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    env = device_settings(dev)
    repro = info.get("eager_reproducible", False)
    host = any(mm.family in ("offload", "save_on_cpu") for mm in methods)  # offload rows: their columns
    lines = [
        f"## gpu_check: {args.model}, batch {args.batch} x seq {args.seq}, fp32, Adam state, .grad present, "
        f"{dev.type} ({env['device_name']}), torch {torch.__version__}",
        "",
        "| method | predicted total | measured total | predicted act. | measured act. | diff | "
        "allocated act. | diff (allocated) |" + (" host peak (predicted) |" if host else "")
        + " step time | vs eager | vs ckpt every block |" + (" vs recompute floor |" if host else "")
        + " grads vs eager |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if host else "") + "---|---|---|" + ("---|" if host else "")
        + "---|",
    ]
    mem_ok = grads_ok = True
    out = {"settings": env, "model": args.model, "batch": args.batch, "seq": args.seq, "rows": [], **info}
    notes = []
    ckpt = next((mm for mm in methods if mm.key == "ckpt-all" and mm.ok), None)
    floor = next((mm for mm in methods if mm.key == "remat-floor" and mm.ok), None)
    for mm in methods:
        row = {"key": mm.key, "label": mm.label, "status": mm.status}
        if mm.note:
            row["note"] = mm.note
            notes.append(f"- {mm.label}: {mm.note}")
        if mm.status != "ok":
            lines.append(f"| {mm.label} | {mm.status} | | | | | | | | | |" + (" | |" if host else "") + " |")
            out["rows"].append(row)
            continue
        # The verdict's measure: what was asked of the allocator on CUDA, the storage tracker on CPU.
        total = mm.requested_total if cuda else mm.total_peak
        act = mm.requested_act if cuda else mm.act_peak
        good = None
        if mm.predicted_total is not None and total is not None:
            good = matches(mm.predicted_total, total)
            mem_ok &= good
        diff = _pct(total, mm.predicted_total) + ("" if good in (None, True) else " (outside 1% + 1 MiB)")
        hcol = fcol = ""
        if host:
            hgood = None
            if mm.family == "offload" and mm.predicted_host is not None:
                hgood = matches(mm.predicted_host, mm.host_peak)
                mem_ok &= hgood
            hcol = ("-" if mm.family not in ("offload", "save_on_cpu") else
                    mib(mm.host_peak) + (f" ({mib(mm.predicted_host)})" if mm.predicted_host is not None else "")
                    + ("" if hgood in (None, True) else " (outside 1% + 1 MiB)"))
            hcol = f" {hcol} |"
            vs_floor = paired_ratios(mm, floor) if floor is not None else []
            fcol = f" {statistics.median(vs_floor):.2f}x |" if vs_floor else " - |"
        t = mm.step_time
        vs_ckpt = paired_ratios(mm, ckpt) if ckpt is not None else []
        re_ = f"{mm.ratio:.2f}x" if mm.ratio is not None else "-"
        rc = f"{statistics.median(vs_ckpt):.2f}x" if vs_ckpt else "-"
        if mm.key == "eager":
            gd = "reference"
        elif mm.grad_equal:
            gd = "bitwise"
        elif mm.program is not None and not keeps_bits(mm.program.header.rewrites) and mm.grad_rel <= GRAD_RTOL:
            # A rewrite that does not promise eager's bits (chunked attention): within the documented tolerance is right.
            gd = f"within tolerance ({mm.grad_rel:.1g} relative; {', '.join(mm.program.header.rewrites)})"
        else:
            gd = f"max diff {mm.grad_diff:.3g}"
            if mm.key.startswith("remat-") and repro:
                grads_ok = False
                gd += " (FAIL: eager is reproducible)"
        lines.append(f"| {mm.label} | {mib(mm.predicted_total)} | {mib(total)} | {mib(mm.predicted_act)} | "
                     f"{mib(act)} | {diff} | {mib(mm.act_peak) if cuda else '-'} | "
                     f"{_pct(mm.act_peak, mm.predicted_act) if cuda else '-'} |{hcol} "
                     f"{'-' if t is None else f'{1e3 * t:.0f} ms'} | {re_} | {rc} |{fcol} {gd} |")
        row.update(predicted_total=mm.predicted_total, measured_total=mm.total_peak,
                   predicted_act=mm.predicted_act, measured_act=mm.act_peak,
                   requested_total=mm.requested_total, requested_act=mm.requested_act, raw_peak=mm.raw_peak,
                   within_tolerance=good, step_times=mm.times,
                   host_peak=mm.host_peak, predicted_host=mm.predicted_host,
                   ratio_eager=mm.ratio, ratio_ckpt=statistics.median(vs_ckpt) if vs_ckpt else None,
                   grad_equal=mm.grad_equal, grad_diff=mm.grad_diff, grad_rel=mm.grad_rel,
                   rewrites=list(mm.program.header.rewrites) if mm.program is not None else [])
        if mm.program is not None:
            row["comment"] = list(mm.program.header.comment)
        out["rows"].append(row)
    lines.append("")
    if cuda:
        lines.append("- measured = this model's parameters, gradients, Adam state, buffers and inputs + the step's "
                     "peak above them, from the allocator: requested_bytes.all.peak (bytes asked for; the "
                     "verdict) and max_memory_allocated (allocated act.: rounded up to blocks); activations = "
                     "that peak alone. MiB = 2^20 bytes.")
    else:
        lines.append("- measured = this model's parameters, gradients, Adam state, buffers and inputs + the step's "
                     "peak above them (the storage tracker); activations = that peak alone. MiB = 2^20 bytes.")
    if host:
        lines.append("- host peak: the most host memory the step held at once for offloaded activations, "
                     + ("pinned bytes in use (`memtrack.HOST_BYTES`; the allocator's statistics do not see "
                        "pinned memory)" if cuda else "the storage tracker's host pool (`memtrack.host_pool()`)")
                     + "; predicted by the simulator for the plans. Offload plans: `fit(..., offload=True, "
                     "exact=True)`. torch save_on_cpu: the eager step inside "
                     "`torch.autograd.graph.save_on_cpu(pin_memory=True)`, every saved tensor (weights included) "
                     "copied to the host and back, counted as remat-ir's copies are"
                     + ("" if cuda else " (on CPU a clone stands for the device copy its unpack would make)")
                     + ". \"vs recompute floor\": step time over the recompute-only floor plan's, per round.")
    lines.append(f"- step time: median of {args.steps} rounds, methods rotated each round; ratios are medians "
                 "of per-round ratios.")
    rerun = info.get("eager_rerun_grad_diff")
    lines.append("- eager twice at one seed: " + ("bitwise equal, so any plan's gradient difference fails the "
                                                  "check." if repro else
                                                  f"differs by up to {rerun:.3g}, so plans' gradient differences "
                                                  "are reported, not failed."))
    if "neutral_vs_device_trace" in info:
        lines.append(f"- the plans were traced device-neutral on CPU; against the step traced on this device: "
                     f"{info['neutral_vs_device_trace']}.")
    lines.append("- settings: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("device",)))
    lines.extend(notes)
    ok = mem_ok and grads_ok
    lines.append(f"- wall time {wall:.0f} s; predictions within 1% + 1 MiB: {'yes' if mem_ok else 'NO'}; "
                 f"gradients: {'ok' if grads_ok else 'NO'}.")
    out.update(all_within_tolerance=mem_ok, grads_ok=grads_ok, ok=ok, wall_s=wall)
    return "\n".join(lines) + "\n", ok, out


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="gpt2-tiny, 2 timed steps: a quick end-to-end run")
    p.add_argument("--model", help="built-in model (default gpt2-medium; --small: gpt2-tiny)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, help="timed rounds (default 5; --small: 2)")
    p.add_argument("--budgets", default="0.7,0.5,0.3,floor",
                   help="fractions of the unoptimized activation peak, and/or floor; '' for none (the "
                        "unoptimized plan only)")
    p.add_argument("--offload-budgets", default="",
                   help="fractions of the unoptimized activation peak for plans that may also offload to host "
                        "memory (exact: no bits-changing rewrite), with a row for torch's save_on_cpu; "
                        "default none")
    p.add_argument("--plans", help="directory of precompiled plans (read; with --compile-only: written)")
    p.add_argument("--compile-only", action="store_true", help="trace (fake) and optimize the plans, write "
                                                               "them to --plans, run nothing")
    p.add_argument("--fake", action="store_true", help="accepted for clarity: plans are always traced under "
                                                       "FakeTensorMode")
    p.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit per solve (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--md", help="also write the Markdown table here")
    return p


def main(argv=None) -> int:
    threads = torch.get_num_threads()
    try:
        return _main(argv)
    finally:
        torch.set_num_threads(threads)


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.budgets = [b.strip() if b.strip() == "floor" else f"{float(b):g}"
                        for b in args.budgets.split(",") if b.strip()]
        args.offload_budgets = [f"{OFFLOAD_TAG}{b.strip() if b.strip() == 'floor' else f'{float(b):g}'}"
                                for b in args.offload_budgets.split(",") if b.strip()]
    except ValueError:
        print(f"gpu_check: error: --budgets / --offload-budgets: not fractions or floor: {args.budgets} / "
              f"{args.offload_budgets}", file=sys.stderr)
        return 2
    args.model = args.model or ("gpt2-tiny" if args.small else "gpt2-medium")
    from remat_ir.models import BUILTINS

    spec = BUILTINS.get(args.model)
    if spec is None and not os.path.isfile(args.model):
        print(f"gpu_check: error: unknown model {args.model}", file=sys.stderr)
        return 2
    if spec is not None:
        args.batch = args.batch or spec.batch
        args.seq = args.seq or spec.seq
    args.steps = args.steps or (2 if args.small else 5)
    if args.device == "cpu" or args.compile_only:
        # One intra-op thread: a shared small CPU box oversubscribed by two
        # ran several times slower (see remat-bench --help).
        torch.set_num_threads(1)
    if args.compile_only and not args.plans:
        print("gpu_check: error: --compile-only needs --plans DIR", file=sys.stderr)
        return 2
    if not args.compile_only and args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device (use --device cpu, or --compile-only)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    args.tags = tags = ["plan"] + args.budgets + args.offload_budgets
    try:
        plans, failed = ({}, {}) if args.compile_only else load_plans(args, tags)
    except Exception as e:  # noqa: BLE001
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    todo = [t for t in tags if t not in plans and t not in failed]
    if todo:
        failed.update(compile_plans(args, todo, plans))
    if args.compile_only:
        from remat_ir.ir.files import save_plan

        os.makedirs(args.plans, exist_ok=True)
        for tag, p in plans.items():
            path = os.path.join(args.plans, plan_name(args.model, args.batch, args.seq, args.device, tag))
            save_plan(p, path)
            print(f"wrote {path}")
        with open(manifest_path(args), "w") as f:
            json.dump(failed, f, indent=1)
        for tag, why in failed.items():
            print(f"no plan for {tag}: {why}")
        # An infeasible budget is a result, not an error.
        return 0 if all(why.startswith("infeasible") for why in failed.values()) else 1
    methods, info = run(args, plans, failed)
    md, ok, js = report(args, methods, info, time.perf_counter() - t0)
    write_table(md, args.md, js, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
