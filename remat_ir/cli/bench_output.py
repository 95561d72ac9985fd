"""remat-bench's output: the Markdown table with its notes, the JSON of every
row, and the Pareto plot (activation peak vs step-time ratio, labels placed
so they do not overlap); `write_table`, the table to stdout and files, also
serves the scripts in tools/ that print a table of their own."""
from __future__ import annotations

import json
import os
import sys

import torch

from remat_ir.cli.measure import MiB, Context, Row, fmt_s, mib
from remat_ir.ir.files import save_figure, write_atomically


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} intra-op thread{'s' if n != 1 else ''}"


def markdown(ctx: Context, rows: list[Row], wall: float) -> str:
    a = ctx.args
    eager = next(r for r in rows if r.key == "eager")
    e_act = eager.act_peak
    n_params = sum(p.numel() for p in ctx.base.parameters())
    shapes = ", ".join(f"{tuple(x.shape)}" for x in ctx.inputs if isinstance(x, torch.Tensor))
    host = any(r.family in HOST_FAMILIES for r in rows)  # offload rows: a column of host bytes
    lines = [
        f"## remat-bench: {ctx.name} ({n_params / 1e6:.2f} M parameters, inputs {shapes}), {ctx.device.type}",
        "",
        f"torch {torch.__version__}, {_threads()}, optimizer state: {a.optimizer}, "
        f"dropout on, seed {a.seed}; memory of the second step (.grad present); "
        f"step time: median of {a.steps} rounds, the methods' order rotated each round; \"vs eager\": "
        f"median over rounds of the step time / eager's step time in the same round.",
        "",
        "| method | peak total | activation peak | % of eager | predicted act. |"
        + (" host peak (predicted) |" if host else "")
        + " step time | vs eager | compile / solve | gradients vs eager |",
        "|---|---|---|---|---|" + ("---|" if host else "") + "---|---|---|---|",
    ]
    for r in rows:
        if not r.ok:
            lines.append(f"| {r.label} | {r.status} | | | |" + (" |" if host else "") + " | | | |")
            continue
        pct = f"{100 * r.act_peak / e_act:.1f}%" if e_act else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        if r.family in ("compile", "backend") and r.first_step_s is not None and r.step_time is not None:
            cs = f"compile {fmt_s(max(r.first_step_s - r.step_time, 0.0))}"
        elif r.family in ("remat", "offload") and r.setup_s:
            cs = f"solve {fmt_s(r.setup_s)}"
        else:
            cs = "-"
        if r.extra:
            cs += f" ({r.extra})"
        pred = mib(r.predicted_act) if r.predicted_act is not None else "-"
        g = r.grads + (" (recompiled!)" if r.recompiled else "")
        hcol = ""
        if host:
            hcol = f" {host_text(r, ctx.device.type)} |"
        lines.append(f"| {r.label} | {mib(r.total_peak)} | {mib(r.act_peak)} | {pct} | {pred} |{hcol} "
                     f"{fmt_s(r.step_time)} | {ratio} | {cs} | {g} |")
    lines.append("")
    notes = []
    if ctx.trace_s is not None:
        profiled = (f" and timed each of its ops in {ctx.profile_s:.1f} s (--cost profile: the optimizer "
                    "minimizes recomputed op time)" if ctx.profile_s is not None else "")
        notes.append(f"remat-ir traced the step once in {ctx.trace_s:.1f} s{profiled} (shared by its rows); "
                     "\"predicted act.\" is the simulator's activation peak for the plan; budgets are "
                     "fractions of the unoptimized plan's activation peak (results the caller holds kept whole); solve = wall time of resolving the "
                     "budget and optimizing (the optimizer reuses its analysis across the rows, so the first "
                     "remat-ir row pays for it).")
    if any(r.family == "backend" for r in rows):
        notes.append("remat-ir backend: `torch.compile(backend=remat_ir.backend(B, inner=\"aot_eager\"))`, the "
                     "torch.compile rows' inner compiler; each compiled region is planned to B x its own "
                     "unoptimized activation peak (the plan made at the first step's compile, counted in its "
                     "compile time); \"predicted act.\" is the simulator's step peak for that plan: its "
                     "activation peak plus the gradients a compiled backward holds until it returns, which "
                     "the budget leaves out (docs/13-torch-compile.md).")
    if host:
        notes.append("offload: \"host peak\" is the most host memory the second step held at once for "
                     "activations (the copies moved off the device), measured"
                     + (" by the storage tracker's host pool (a host buffer is a storage allocated inside "
                        "`memtrack.host_pool()`; device and host are both CPU memory here)"
                        if ctx.device.type == "cpu" else
                        " as the bytes of pinned host buffers in use (`memtrack.HOST_BYTES`; the caching "
                        "allocator's statistics do not see pinned memory)")
                     + "; for remat-ir the simulator's prediction in parentheses. remat-ir with offload: "
                     "`fit(..., offload=True)` without a host budget; at budgets recomputation alone meets "
                     "its plan is the recompute-only one (nothing offloaded). torch save_on_cpu: the eager "
                     "step inside `torch.autograd.graph.save_on_cpu(pin_memory=True)`: every tensor autograd "
                     "saves (weights included) is copied to the host and back for backward; its copies are "
                     "counted as remat-ir's are"
                     + (" (on CPU torch's unpack hands back the host copy itself; a clone stands for the "
                        "device copy a GPU would make, so its device bytes count as remat-ir's reloads do)"
                        if ctx.device.type == "cpu" else "") + ".")
    comp = [r for r in rows if r.family in ("compile", "backend")]
    if comp:
        notes.append("torch.compile: dynamo was reset before the compile rows; each budget compiles its own "
                     "entry function (a distinct code object) so no budget reuses another's graph while the "
                     "rows are interleaved; compile time = first step minus median step.")
        if any(r.ok and r.grad_diff for r in comp if r.family == "compile"):
            notes.append("torch.compile gradients that differ: the budgeted partitioner recomputes "
                         "native_dropout in backward with fresh randomness on CPU (known PyTorch issue; "
                         "with dropout 0 the budgets are bitwise equal).")
        if ctx.device.type == "cpu":
            notes.append("inductor: not measured here. Its CPU kernels allocate outside the dispatcher, where the "
                         "storage tracker cannot see them; tools/backend_memory.py measures the backend under "
                         "inductor from the CPU allocator's profiler events instead.")
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


HOST_FAMILIES = ("offload", "save_on_cpu")


def host_text(r: Row, device_type: str) -> str:
    """The host-peak cell: measured, and predicted for remat-ir's plans."""
    if r.family not in HOST_FAMILIES:
        return "-"
    if r.host_peak is None:
        return "not measured"
    pred = f" ({mib(r.predicted_host)})" if r.predicted_host is not None else ""
    return mib(r.host_peak) + pred


FAMILY_STYLE = {
    "eager": ("black", "o"), "checkpoint": ("tab:blue", "s"), "sac": ("tab:purple", "D"),
    "compile": ("tab:orange", "^"), "remat": ("tab:green", "*"), "backend": ("tab:olive", "P"),
    "offload": ("tab:red", "*"), "save_on_cpu": ("tab:brown", "v"),
}


def short_label(r: Row) -> str:
    s = r.label.replace("torch.compile aot_eager, ", "compile ").replace("remat-ir, ", "remat-ir ")
    s = s.replace("remat-ir backend aot_eager, ", "backend ").replace("torch save_on_cpu", "save_on_cpu")
    s = s.replace("checkpoint every", "ckpt every").replace(", save matmul outputs", " (matmuls)")
    return s.replace("eager PyTorch", "eager").replace("unoptimized plan", "unoptimized")


def place_labels(fig, ax, labels, obstacles=()) -> None:
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
                     "compile": "torch.compile (aot_eager)", "remat": "remat-ir",
                     "backend": "remat-ir backend (aot_eager)", "offload": "remat-ir with offload",
                     "save_on_cpu": "torch save_on_cpu"}.get(r.family, r.family)
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
    place_labels(fig, ax, labels, obstacles=[leg])
    save_figure(fig, path)


def write_json(ctx: Context, rows: list[Row], wall: float, path: str) -> None:
    import dataclasses

    a = ctx.args
    out = {"model": ctx.name, "device": ctx.device.type, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "steps": a.steps, "optimizer": a.optimizer, "wall_s": wall,
           "trace_s": ctx.trace_s,
           "inputs": [list(x.shape) for x in ctx.inputs if isinstance(x, torch.Tensor)],
           "rows": [dict(dataclasses.asdict(r), step_time=r.step_time, ratio=r.ratio) for r in rows]}
    write_atomically(path, json.dumps(out, indent=1).encode("utf-8"))


def write_table(md: str, md_path: str | None = None, js=None, json_path: str | None = None) -> None:
    """The Markdown table to stdout and to `md_path`, `js` as JSON to `json_path`."""
    sys.stdout.write(md)
    sys.stdout.flush()
    if md_path:
        write_atomically(md_path, md.encode("utf-8"))
    if json_path:
        write_atomically(json_path, json.dumps(js, indent=1).encode("utf-8"))
