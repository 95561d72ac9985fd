"""Human-readable summaries of a plan's predicted memory."""
from __future__ import annotations

from remat_ir.check.simulate import CATEGORIES, STEP_CATEGORIES, MemoryReport
from remat_ir.ir import COST_FLOPS, COST_PROFILE, Program
from remat_ir.ir.costs import link_text, overhead, transfer_cost
from remat_ir.ir.printer import human_bytes  # the one byte formatter, as in the .rir comments


def where(program: Program, event) -> str:
    """`line 412 (compute d.lm_head.mm)` for a timeline event."""
    if event.index < 0:
        return f"the start of {event.phase}" if event.phase != "start" else "the start of the step"
    instrs = program.forward if event.phase == "forward" else program.backward
    ins = instrs[event.index]
    at = f"line {ins.line}" if ins.line else f"{event.phase}[{event.index}]"
    return f"{at} ({ins.kind} {ins.target})"


def breakdown(program: Program, steady: MemoryReport, first: MemoryReport) -> str:
    """The predicted peak of a training step and what it is made of."""
    b = program.header.budget
    lines = []
    n_params = sum(_numel(v.shape) for v in program.values if v.kind == "param")
    lines.append(f"model {program.header.model or '?'}: {n_params / 1e6:.1f} M parameters, "
                 f"{len(program.nodes)} ops, device {program.header.device}")
    lines.append(f"predicted peak, steady state (.grad present): {human_bytes(steady.peak_bytes)} "
                 f"at {where(program, steady.peak)}")
    lines.append(f"predicted peak, first step (no .grad):        {human_bytes(first.peak_bytes)} "
                 f"at {where(program, first.peak)}")
    lines.append("")
    lines.append(f"  {'category':<17}{'at peak':>12}{'before step':>14}")
    for cat in CATEGORIES:
        at = steady.peak.by_category.get(cat, 0)
        before = steady.baseline.get(cat, 0)
        if at or before or cat in STEP_CATEGORIES:
            lines.append(f"  {cat:<17}{human_bytes(at):>12}{human_bytes(before):>14}")
    lines.append(f"  {'total':<17}{human_bytes(steady.peak_bytes):>12}{human_bytes(steady.baseline_bytes):>14}")
    lines.append(f"  activation peak (activations + temporaries): {human_bytes(steady.activation_peak_bytes)} "
                 f"at {where(program, steady.activation_peak)}")
    if steady.top:
        names = ", ".join(f"{s} {human_bytes(n)}" for s, n in steady.top[:4])
        lines.append(f"  largest tensors live at the peak: {names}")
    recomputes = [i for i in program.forward + program.backward if i.kind == "recompute"]
    if recomputes:
        extra, total = overhead(program, COST_FLOPS, copies=False)
        lines.append(f"  recomputed ops: {len(recomputes)}, extra compute {extra / 1e9:.3f} GFLOP "
                     f"({100 * extra / max(total, 1):.1f}% of the step)")
        if program.header.cost == COST_PROFILE:
            t_extra, t_total = overhead(program, COST_PROFILE, copies=False)
            lines.append(f"  profiled on {program.header.device}: +{t_extra / 1e3:.2f} ms of op time "
                         f"({100 * t_extra / max(t_total, 1e-9):.1f}% of the step's {t_total / 1e3:.2f} ms)")
    if b is not None:
        used = max(steady.scope_peak(b.scope), first.scope_peak(b.scope))
        lines.append(f"  budget ({b.scope}): {human_bytes(b.bytes)}, predicted {human_bytes(used)}, "
                     f"slack {human_bytes(b.bytes - used)}")
    if steady.offloads:
        hb = program.header.host_budget
        lines.append(f"  offloaded to the host: {steady.offloads} copies, host pool peak "
                     f"{human_bytes(steady.host_peak_bytes)} at {where(program, steady.host_peak)}"
                     + (f" (host budget {human_bytes(hb)})" if hb is not None else ""))
        copies = transfer_cost(program)
        _, total = overhead(program, copies=False)
        unit = (f"{copies / 1e3:.3f} ms" if program.header.cost == COST_PROFILE
                else f"{copies / 1e9:.3f} GFLOP of device time")
        lines.append(f"  the copies cost {unit} ({100 * copies / max(total, 1e-9):.1f}% of the step; "
                     f"{link_text(program.header.device)})")
    return "\n".join(lines)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

