"""Memory / compute trade-off of one program: optimize it for a range of
budgets, from its unoptimized peak down to its floor.

    rows = sweep(program, "total", points=8)   # unoptimized peak first, floor last
    print(format_table(rows))
    plot(rows, "plan.pareto.png", title="gpt2-tiny")

Every budget is solved on the same `program` object, so the optimizer's
per-program planner (and the option sets it has built for each block) is
reused: the later points cost a fraction of the first.

Extra compute is measured on each plan the optimizer returns, in the
program's cost model (`costs.overhead`): FLOPs, or profiled step time.  The
optimizer is exact on small graphs and heuristic on large ones, so a lower
budget can, rarely, come back with less extra compute than a higher one;
the table shows what each solve returned.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from remat_ir.ir.costs import overhead, unit_label
from remat_ir.ir import COST_PROFILE, Program
from remat_ir.ir.files import save_figure
from remat_ir.ir.printer import human_bytes
from remat_ir.ir.types import DEFAULT_SCOPE

DEFAULT_POINTS = 8

# Row status.
UNOPTIMIZED = "unoptimized"  # the unoptimized plan fits: nothing recomputed
OPTIMIZED = "optimized"
FLOOR = "floor"  # the smallest peak the optimizer can reach
INFEASIBLE = "infeasible"  # no plan found that fits (only possible for a heuristic floor)


@dataclass
class Row:
    budget: int  # bytes, in the sweep's scope
    fraction: float  # budget / unoptimized peak
    peak: int | None  # predicted peak in the scope (None: infeasible)
    extra: float  # recompute cost, in the cost model's unit
    base: float  # cost of every op of the step, same unit
    seconds: float  # optimizer wall time for this budget
    status: str
    mode: str = ""  # optimizer mode: none, flat, decomposed
    program: Program | None = None  # the plan, when one fits

    @property
    def overhead(self) -> float:
        """Extra compute as a fraction of the step's."""
        return self.extra / self.base if self.base else 0.0


def budgets(top: int, floor: int, points: int = DEFAULT_POINTS) -> list[int]:
    """`points` budgets evenly spaced from `top` down to `floor`, both
    included (duplicates dropped when the range is narrower than `points` bytes)."""
    if points < 2:
        raise ValueError(f"a sweep needs at least 2 points (the unoptimized peak and the floor), not {points}")
    top, floor = int(top), int(floor)
    if top <= floor:
        return [top]
    out = [int(round(top - (top - floor) * k / (points - 1))) for k in range(points)]
    return sorted(set(out), reverse=True)


def sweep(program: Program, scope: str = DEFAULT_SCOPE, *, points: int = DEFAULT_POINTS,
          time_limit: float | None = None, solver: str = "HIGHS", log=None, progress=None,
          effort: str = "fast") -> list[Row]:
    """Optimize `program` for `points` budgets from its unoptimized peak down to
    its floor (in `scope`); one row per budget, highest budget first.

    `time_limit` bounds each solve (the floor search included).  `progress`,
    when given, is called with each row as soon as it is solved."""
    from remat_ir.optimize.search import Infeasible, Memo, floor, optimize, settings_of, unoptimized_peak

    settings = settings_of(effort=effort, solver=solver, time_limit=time_limit)
    # One memo for every budget: the block options built for one serve the rest.
    memo = Memo()
    top = unoptimized_peak(program, scope)
    low = floor(program, settings, memo, scope=scope, log=log).predicted_peak
    rows: list[Row] = []
    for b in budgets(top, low, points):
        try:
            r = optimize(program, b, settings, memo, scope=scope, log=log)
        except Infeasible as e:
            row = Row(b, b / top if top else 1.0, None, 0.0, 0.0, 0.0, INFEASIBLE)
            if log:
                log(f"pareto: budget {human_bytes(b)}: {e}")
        else:
            extra, base = overhead(r.program)
            status = UNOPTIMIZED if r.mode == "none" else FLOOR if b == low else OPTIMIZED
            row = Row(b, b / top if top else 1.0, r.predicted_peak, extra, base, r.seconds, status,
                      r.mode, r.program)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


# ------------------------------------------------------------------ table

_HEADERS = ("budget", "bytes", "of unopt.", "predicted peak", "extra compute", "solve", "status")


def table_header(program: Program, scope: str) -> str:
    """The table's title line: what the columns are measured in."""
    what = "activation peak" if scope == "activations" else "total peak"
    unit = f"step time, profiled on {program.header.device}" if program.header.cost == COST_PROFILE else "FLOPs"
    return f"pareto sweep of {program.header.model or 'the program'}: {what} vs extra compute ({unit})"


def format_row(row: Row) -> str:
    peak = human_bytes(row.peak) if row.peak is not None else "-"
    extra = f"+{100 * row.overhead:.2f}%" if row.peak is not None else "-"
    status = row.status + (f" ({row.mode})" if row.mode not in ("", "none") else "")
    return (f"{human_bytes(row.budget):>10}  {row.budget:>13}  {100 * row.fraction:>8.1f}%  {peak:>14}  "
            f"{extra:>13}  {row.seconds:>6.2f}s  {status}")


def format_columns() -> str:
    """The table's column headings."""
    h = _HEADERS
    return f"{h[0]:>10}  {h[1]:>13}  {h[2]:>9}  {h[3]:>14}  {h[4]:>13}  {h[5]:>7}  {h[6]}"


def format_table(rows: list[Row], title: str = "") -> str:
    """The rows as a fixed-width table (budgets in bytes and as a fraction of
    the unoptimized peak)."""
    lines = [title] if title else []
    lines.append(format_columns())
    lines += [format_row(r) for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------- plot


def plot(rows: list[Row], path: str | os.PathLike, *, title: str = "", scope: str = DEFAULT_SCOPE,
         ylabel: str = "") -> None:
    """Predicted peak (x) against extra compute (y), one marker per budget,
    written to `path` (atomically: a temporary file renamed) in the format
    its extension names (PNG without one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [r for r in rows if r.peak is not None]
    if not fits:
        raise ValueError("no budget of the sweep has a plan: nothing to plot")
    if not ylabel:
        prog = next(r.program for r in fits if r.program is not None)
        ylabel = f"extra compute ({unit_label(prog)})"
    size, unit = 1 << 20, "MiB"
    if max(r.peak for r in fits) >= 4 << 30:
        size, unit = 1 << 30, "GiB"
    elif max(r.peak for r in fits) < 1 << 20:
        size, unit = 1 << 10, "KiB"
    pts = sorted(fits, key=lambda r: r.peak)
    xs = [r.peak / size for r in pts]
    ys = [100 * r.overhead for r in pts]

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    # A step, not a slope: between two plans, a budget can only use the plan with the smaller peak.
    ax.plot(xs, ys, "-", color="#4c72b0", lw=1.5, alpha=0.6, zorder=2, drawstyle="steps-post")
    colors = {UNOPTIMIZED: "#55a868", FLOOR: "#c44e52", OPTIMIZED: "#4c72b0"}
    for st, label in ((UNOPTIMIZED, "unoptimized plan"), (OPTIMIZED, "optimized for a budget"),
                      (FLOOR, "floor (smallest peak)")):
        sel = [(x, y) for x, y, r in zip(xs, ys, pts) if r.status == st]
        if sel:
            ax.scatter([x for x, _ in sel], [y for _, y in sel], s=46, color=colors[st], zorder=3,
                       label=label, edgecolors="white", linewidths=0.8)
    # Each point's budget, as a fraction of the unoptimized peak.
    for x, y, r in zip(xs, ys, pts):
        ax.annotate(f"{100 * r.fraction:.0f}%", xy=(x, y), xytext=(6, 5), textcoords="offset points",
                    fontsize=8, color="dimgray")
    span_x = (max(xs) - min(xs)) or max(xs) * 0.05 or 1.0
    ax.set_xlim(min(xs) - 0.08 * span_x, max(xs) + 0.12 * span_x)
    top_y = max(ys) if max(ys) > 0 else 1.0
    ax.set_ylim(-0.05 * top_y, top_y * 1.15)
    what = "activation peak" if scope == "activations" else "total peak"
    ax.set_xlabel(f"predicted {what} ({unit})")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "memory / compute trade-off")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.95)
    fig.text(0.99, 0.01, "labels: budget as % of the unoptimized peak", ha="right", va="bottom",
             fontsize=7.5, color="dimgray")
    fig.tight_layout()
    save_figure(fig, path)
