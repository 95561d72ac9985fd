"""remat-show: what a plan's memory looks like over its schedule.

    remat-show PLAN.rir                 text: the peak, where it occurs, what is live
                                        there, and what the plan recomputes
    remat-show PLAN.rir --png FILE      the memory timeline as a picture
    remat-show PLAN.rir --size B=2,T=96 a symbolic plan at those sizes (others at
                                        the high end of its range, the default)

The timeline is the simulator's (`remat_ir.check.simulate`): live bytes right after
each instruction's allocation, by category, in the steady state (`.grad`
present; `--first-step` for the first step, without `.grad`).  A plan that
offloads values to the host also shows its host pool: the text lists each
offloaded value with its instructions' lines and the host peak, the picture
draws the host pool's bytes as a line and marks the copies.

Exit codes: 0 shown; 1 the plan cannot be simulated (run remat-verify);
2 bad input (unreadable plan, missing matplotlib for --png, a --png that is
no regular file, is the plan itself or has an extension matplotlib cannot write).
"""
from __future__ import annotations

import argparse
import sys

from remat_ir.cli.errors import EXIT_FAIL, EXIT_OK, CliError, run_cli
from remat_ir.cli.outputs import check_outputs
from remat_ir.ir.files import save_figure
from remat_ir.ir.printer import human_bytes

# Category colours for the stacked timeline (simulate.CATEGORIES order).
COLORS = {
    "parameters": "#4c72b0",
    "buffers": "#8172b3",
    "optimizer state": "#937860",
    "inputs": "#64b5cd",
    "gradients": "#dd8452",
    "activations": "#55a868",
    "temporaries": "#c44e52",
}


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _unit(nbytes: float) -> tuple[str, int]:
    """The unit `human_bytes` writes `nbytes` in, and its size in bytes: the
    plot's axis is in the unit its labels use."""
    unit = human_bytes(nbytes).rsplit(" ", 1)[1]
    return unit, 1024 ** _BINARY_UNITS.index(unit)


def _x(program, ev) -> float:
    """Position of a timeline event on the instruction axis: forward
    instructions first, then backward ones."""
    if ev.phase == "forward":
        return float(ev.index)
    if ev.phase == "backward":
        return float(len(program.forward) + ev.index) if ev.index >= 0 else len(program.forward) - 0.5
    return -1.0


def _producers(program) -> dict[str, object]:
    return program.producer_map()


def _describe_storage(program, name: str) -> str:
    """`transformer.h.0.attn.softmax f32[4,4,128,128]` for a storage name."""
    v = program.value_map().get(name)
    if v is None:
        return name
    from remat_ir.ir import DTYPE_SHORT

    return f"{name} {DTYPE_SHORT.get(v.dtype, v.dtype)}[{','.join(map(str, v.shape))}]"


def recompute_summary(program) -> tuple[list[tuple[str, str, float, int]], float, float]:
    """[(phase, node, flops, line)] of every recompute, the extra FLOPs, and
    the FLOPs of the step without recomputation."""
    nodes = program.node_map()
    rows = []
    for phase, instrs in (("forward", program.forward), ("backward", program.backward)):
        for ins in instrs:
            if ins.kind == "recompute":
                n = nodes.get(ins.target)
                rows.append((phase, ins.target, float(n.flops) if n is not None else 0.0, ins.line))
    extra = sum(r[2] for r in rows)
    base = sum(float(n.flops) for n in program.nodes)
    return rows, extra, base


def offload_summary(program) -> list[dict]:
    """Each value the plan offloads, in the order of its offloads: {"value",
    "bytes", "offload", "wait", "reload", "reload_wait", "free_on_host"}, the
    last five the lines of those instructions (0: none; a value offloaded
    twice has a row for each time)."""
    values = program.value_map()
    rows: list[dict] = []
    open_row: dict[str, dict] = {}
    copying: dict[str, str] = {}
    for ins in program.forward + program.backward:
        name = ins.target
        if ins.kind == "offload":
            v = values.get(name)
            row = {"value": name, "bytes": v.nbytes if v is not None else 0, "offload": ins.line, "wait": 0,
                   "reload": 0, "reload_wait": 0, "free_on_host": 0}
            rows.append(row)
            open_row[name] = row
            copying[name] = "offload"
        elif ins.kind == "reload" and name in open_row:
            open_row[name]["reload"] = ins.line
            copying[name] = "reload"
        elif ins.kind == "wait" and name in open_row:
            key = "wait" if copying.pop(name, "offload") == "offload" else "reload_wait"
            open_row[name][key] = ins.line
            if key == "reload_wait":
                del open_row[name]
        elif ins.kind == "free" and name in open_row and open_row[name]["wait"] and not open_row[name]["reload"]:
            open_row.pop(name)["free_on_host"] = ins.line
    return rows


def _offload_lines(program, report, max_rows: int) -> list[str]:
    rows = offload_summary(program)
    if not rows:
        return []
    from remat_ir.cli.report import where

    at = where(program, report.host_peak) if report.host_peak is not None else "-"
    lines = [f"offloaded to the host: {len(rows)} value{'s' if len(rows) != 1 else ''}, host peak "
             f"{human_bytes(report.host_peak_bytes)} at {at}"]
    if program.header.host_budget is not None:
        lines[-1] += f" (host budget {human_bytes(program.header.host_budget)})"
    for r in sorted(rows, key=lambda r: -r["bytes"] if isinstance(r["bytes"], int) else 0)[:max_rows]:
        steps = [f"offload line {r['offload']}", f"wait line {r['wait']}"]
        if r["reload"]:
            steps += [f"reload line {r['reload']}", f"wait line {r['reload_wait']}"]
        if r["free_on_host"]:
            steps.append(f"freed on the host line {r['free_on_host']}")
        lines.append(f"  {human_bytes(r['bytes']):>10}  {r['value']}  ({', '.join(steps)})")
    if len(rows) > max_rows:
        lines.append(f"  ... and {len(rows) - max_rows} more")
    return lines


def _pct(part: float, whole: float) -> str:
    p = 100 * part / max(whole, 1)
    return f"{p:.1f}%" if p >= 0.1 or p == 0 else f"{p:.2g}%"


def _flops(x: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if x >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} FLOP"


def text_summary(program, report, *, first_step: bool = False, top: int = 6, max_ops: int = 15) -> str:
    from remat_ir.cli.report import where
    from remat_ir.check.simulate import CATEGORIES, STEP_CATEGORIES

    h = program.header
    lines = []
    n_params = sum(_numel(v.shape) for v in program.values if v.kind == "param")
    lines.append(f"plan: model {h.model or '?'}, {len(program.nodes)} ops, "
                 f"{len(program.forward)} + {len(program.backward)} instructions, device {h.device}, "
                 f"{n_params / 1e6:.2f} M parameters, optimizer {h.optim}")
    state = "first step (no .grad)" if first_step else "steady state (.grad present)"
    lines.append(f"predicted peak, {state}: {human_bytes(report.peak_bytes)} at "
                 f"{where(program, report.peak)}, in {report.peak.phase}")
    lines.append(f"activation peak (activations + temporaries): {human_bytes(report.activation_peak_bytes)} at "
                 f"{where(program, report.activation_peak)}")
    lines.append(f"before the step: {human_bytes(report.baseline_bytes)}")
    if h.budget is not None:
        used = report.scope_peak(h.budget.scope)
        lines.append(f"budget ({h.budget.scope}): {human_bytes(h.budget.bytes)}, predicted "
                     f"{human_bytes(used)}, slack {human_bytes(h.budget.bytes - used)}")
    else:
        lines.append("budget: none")
    lines.append("at the peak:")
    for cat in CATEGORIES:
        b = report.peak.by_category.get(cat, 0)
        if b or cat in STEP_CATEGORIES:
            lines.append(f"  {cat:<17}{human_bytes(b):>12}")
    tensors = step_tensors(program, report)
    if tensors:
        lines.append("largest step tensors live at the peak (parameters and other state excluded):")
        prod = _producers(program)
        for name, nb in tensors[:top]:
            n = prod.get(name)
            mod = f"  ({n.op.split('.')[1]} in {n.module})" if n is not None and n.module else ""
            lines.append(f"  {human_bytes(nb):>10}  {_describe_storage(program, name)}{mod}")
    rows, extra, base = recompute_summary(program)
    if rows:
        lines.append(f"recomputed ops: {len(rows)}, extra compute {_flops(extra)} = "
                     f"{_pct(extra, base)} of the step's {_flops(base)}")
        for phase, name, fl, line in sorted(rows, key=lambda r: -r[2])[:max_ops]:
            at = f"line {line}" if line else phase
            lines.append(f"  {_flops(fl):>12}  {name}  ({at})")
        if len(rows) > max_ops:
            rest = sum(r[2] for r in sorted(rows, key=lambda r: -r[2])[max_ops:])
            lines.append(f"  ... and {len(rows) - max_ops} more ({_flops(rest)})")
    else:
        lines.append(f"recomputed ops: none (step compute {_flops(base)})")
    lines += _offload_lines(program, report, max_ops)
    return "\n".join(lines)


def timeline_png(program, report, path: str, *, title: str = "", first_step: bool = False,
                 top: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from remat_ir.check.simulate import CATEGORIES

    tl = report.timeline
    if not tl:
        raise CliError("the plan has no instructions to plot", EXIT_FAIL)
    unit, size = _unit(max(report.peak_bytes, 1))
    xs = [_x(program, ev) for ev in tl]
    cats = [c for c in CATEGORIES if any(ev.by_category.get(c, 0) for ev in tl)]
    ys = [[ev.by_category.get(c, 0) / size for ev in tl] for c in cats]

    fig, ax = plt.subplots(figsize=(14, 6), dpi=110)
    fig.subplots_adjust(left=0.055, right=0.70, top=0.93, bottom=0.09)
    ax.stackplot(xs, ys, labels=cats, colors=[COLORS.get(c, "gray") for c in cats], step="post",
                 alpha=0.9, linewidth=0)
    n_fwd = len(program.forward)
    ax.axvline(n_fwd - 0.5, color="black", lw=1, ls=":")
    ymax = report.peak_bytes / size
    # Budget line, comparable with the stacked totals.
    b = program.header.budget
    if b is not None:
        if b.scope == "activations":
            y = (b.bytes + report.baseline_bytes) / size
            blabel = f"budget: {human_bytes(b.bytes)} activations + {human_bytes(report.baseline_bytes)} state"
        else:
            y = b.bytes / size
            blabel = f"budget: {human_bytes(b.bytes)} total"
        ax.axhline(y, color="crimson", lw=1.5, ls="--", label=blabel)
        ymax = max(ymax, y)
    # Recomputations: ticks along the bottom.
    rec = [i for i, ins in enumerate(program.forward) if ins.kind == "recompute"]
    rec += [n_fwd + i for i, ins in enumerate(program.backward) if ins.kind == "recompute"]
    if rec:
        ax.plot(rec, [0] * len(rec), "|", color="black", ms=10, mew=0.8, clip_on=False,
                label=f"recompute ({len(rec)})")
    # Offload: the host pool's bytes (a line, not stacked: they are not device memory), and the copies.
    if report.host_peak_bytes:
        ax.step(xs, [ev.host / size for ev in tl], where="post", color="#8c564b", lw=1.5, ls="-.",
                label=f"host pool (offloaded copies), peak {human_bytes(report.host_peak_bytes)}")
        for kind, marker in (("offload", "^"), ("reload", "v")):
            at = [i for i, ins in enumerate(program.forward) if ins.kind == kind]
            at += [n_fwd + i for i, ins in enumerate(program.backward) if ins.kind == kind]
            if at:
                ax.plot(at, [0] * len(at), marker, color="#8c564b", ms=5, clip_on=False,
                        label=f"{kind} ({len(at)})")
    # The peak, and what is live there (beside the plot, with the legend).
    px, py = _x(program, report.peak), report.peak_bytes / size
    ax.plot([px], [py], "v", color="black", ms=9, zorder=5)
    ax.annotate(f"peak {human_bytes(report.peak_bytes)}", xy=(px, py), xytext=(0, 8),
                textcoords="offset points", ha="center", va="bottom", fontsize=9, fontweight="bold",
                bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8))
    from remat_ir.cli.report import where

    names = [f"{human_bytes(nb):>10}  {_short(_describe_storage(program, name), 50)}"
             for name, nb in step_tensors(program, report)[:top]]
    txt = f"peak {human_bytes(report.peak_bytes)} at\n{_short(where(program, report.peak), 58)}"
    if names:
        txt += "\n\nlargest step tensors live there:\n" + "\n".join(names)
    rows, extra, base = recompute_summary(program)
    if rows:
        txt += f"\n\nrecomputed ops: {len(rows)}, +{_pct(extra, base)} compute"
    if report.host_peak_bytes:
        txt += (f"\n\noffloaded to the host: {len(offload_summary(program))} values,\n"
                f"host peak {human_bytes(report.host_peak_bytes)}")
    fig.text(0.712, 0.45, txt, ha="left", va="top", fontsize=7.5, family="monospace",
             bbox=dict(boxstyle="round", fc="white", ec="gray", alpha=0.95))
    top_y = ymax * 1.12
    ax.set_ylim(0, top_y)
    ax.set_xlim(-1, n_fwd + len(program.backward))
    ax.text(n_fwd - 0.5, top_y * 0.985, "forward \u2190 ", ha="right", va="top", fontsize=9, color="dimgray")
    ax.text(n_fwd - 0.5, top_y * 0.985, " \u2192 backward", ha="left", va="top", fontsize=9, color="dimgray")
    ax.set_xlabel("instruction (forward, then backward)")
    ax.set_ylabel(f"live memory ({unit})")
    h = program.header
    state = "first step, no .grad" if first_step else "steady state, .grad present"
    ax.set_title(title or f"remat-ir plan {h.model or ''}: predicted memory timeline ({state})")
    handles, labels = ax.get_legend_handles_labels()
    # Stack order top-down in the legend, like the picture.
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              framealpha=0.95)
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, path)


def step_tensors(program, report) -> list[tuple[str, int]]:
    """The storages live at the peak that the step made (activations and
    temporaries: not parameters, buffers or inputs), largest first."""
    kinds = {v.name: v.kind for v in program.values}
    return [(s, b) for s, b in report.top if kinds.get(s) in ("value", "tangent")]


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else "..." + s[-(n - 3):]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remat-show", description="Show a .rir plan's predicted memory: "
                                "the peak and what makes it, the recomputations, or (--png) the timeline.")
    p.add_argument("plan", help="plan file (.rir)")
    p.add_argument("--png", help="write the memory timeline to this image file (.png, .pdf, .svg, ...)")
    p.add_argument("--first-step", action="store_true", help="the first step (no .grad yet) instead of "
                                                             "the steady state")
    p.add_argument("--top", type=int, default=6, help="how many of the largest tensors to name")
    p.add_argument("--size", action="append", default=[], metavar="SYMBOL=N[,SYMBOL=N]",
                   help="a symbolic plan: show it at these sizes (repeatable; a symbol not given is at the "
                        "high end of the plan's range)")
    return p


def at_sizes(program, given: list[str], plan: str):
    """A symbolic plan instantiated at the sizes `--size` gives (the others
    at the high end of its range), and a line saying which; a concrete plan
    as it is, and ""."""
    from remat_ir.ir import sizes as sz

    if not sz.is_symbolic(program):
        if given:
            raise CliError(f"--size: {plan} is not a symbolic plan (it has no `sizes` line)")
        return program, ""
    try:
        ranges = sz.ranges(program)
    except sz.SizeError as e:
        raise CliError(f"{plan}: {e}; run remat-verify {plan}") from e
    sizes = {s: r.high for s, r in ranges.items()}
    for item in (x for arg in given for x in arg.split(",")):
        sym, eq, n = item.partition("=")
        sym = sym.strip()
        if not eq or not n.strip().isdigit():
            raise CliError(f"--size {item!r}: expected SYMBOL=N, like T=96")
        if sym not in ranges:
            raise CliError(f"--size {item}: the plan has no size symbol {sym} (its symbols: {', '.join(ranges)})")
        sizes[sym] = int(n)
    try:
        why = sz.check_sizes(program, sizes)
        if why:
            raise CliError(f"--size: {why}")
        concrete = sz.instantiate(program, sizes, refingerprint=False)
    except sz.SizeError as e:
        raise CliError(f"{plan}: cannot instantiate the plan at these sizes: {e}; run remat-verify {plan}") from e
    at = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if given:
        return concrete, f"at {at} (the plan covers {', '.join(program.header.sizes)})"
    return concrete, (f"at {at}, the high end of the plan's range ({', '.join(program.header.sizes)}); "
                      "choose other sizes with --size")


def _run(argv) -> int:
    args = build_parser().parse_args(argv)
    from remat_ir.check.simulate import SimulationError, simulate
    from remat_ir.ir.files import load_plan

    # Refused before any work: the plan may take a while to read and simulate.
    check_outputs([("--png", args.png)], [("the plan", args.plan)], images=["--png"])
    try:
        program = load_plan(args.plan)
    except (OSError, ValueError) as e:  # RirSyntaxError is a ValueError
        raise CliError(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    except Exception as e:  # noqa: BLE001 - whatever the parser raises: one line
        raise CliError(f"{args.plan}: cannot read the plan: {type(e).__name__}: {e}") from e
    program, sizes_note = at_sizes(program, args.size, args.plan)
    try:
        # top_k covers every storage: the state is filtered out afterwards.
        report = simulate(program, grads_present=not args.first_step, keep_timeline=True,
                          top_k=len(program.values))
    except (SimulationError, KeyError) as e:
        raise CliError(f"{args.plan}: the plan cannot be simulated ({e}); run remat-verify {args.plan}",
                        EXIT_FAIL) from e
    if args.png:
        timeline_png(program, report, args.png, first_step=args.first_step, top=min(args.top, 5))
        from remat_ir.cli.report import where

        print(f"wrote {args.png}: peak {human_bytes(report.peak_bytes)} at {where(program, report.peak)}"
              + (f"; {sizes_note}" if sizes_note else ""))
    else:
        if sizes_note:
            print(f"sizes: {sizes_note}")
        print(text_summary(program, report, first_step=args.first_step, top=args.top))
    return EXIT_OK


def main(argv=None) -> int:
    return run_cli("remat-show", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
