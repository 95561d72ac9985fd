"""The flat search (graphs of up to 192 decisions) on a set of budgets, with
its lazy-row settings overridable: a table and a total.

    .venv/bin/python tools/flat_times.py
    .venv/bin/python tools/flat_times.py --budget-rows 1000000 --apart -1   # every row a plan breaks
    .venv/bin/python tools/flat_times.py --highs mip_heuristic_run_rins=true,mip_heuristic_run_rens=true
    .venv/bin/python tools/flat_times.py --floors --floor-rows 16

Budgets: gpt2-tiny (fake) at 0.45-0.75 of its unoptimized activation peak,
the 2-layer transformers GPT-2 at 0.5-0.7, the 3-layer transformers Llama at
0.6 and 0.7; each solved cold (a fresh planner), the graph's analysis
included.  `--floors` solves the floor (least peak) of gpt2-tiny and of the
transformers GPT-2 instead.  Each row shows the time, the plan's extra
compute, and the rounds and memory rows of the lazy search.  The options
replace the search's constants for this run only: `--budget-rows` and
`--apart` (rows a budget round adds, and how many events apart; -1: no
spacing), `--floor-rows` (rows a floor round adds), `--highs` (HiGHS options
on top of the search's own).
"""
from __future__ import annotations

import argparse
import sys
import time

import remat_ir.optimize.milp as milp
import remat_ir.optimize.search as search
from optimize_times import builtin, llama3, model_file
from remat_ir.ir.costs import overhead

MODELS = {
    "gpt2-tiny": (builtin("gpt2-tiny", fake=True), (0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75)),
    "transformers GPT-2, 2 layers": (model_file("examples/hf_gpt2.py"), (0.5, 0.6, 0.7)),
    "transformers Llama, 3 layers": (llama3, (0.6, 0.7)),
}
FLOOR_MODELS = ("gpt2-tiny", "transformers GPT-2, 2 layers")
SCOPE = "activations"


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-rows", type=int, default=search.BUDGET_ROWS_PER_ROUND)
    ap.add_argument("--apart", type=int, default=search.ROWS_APART)
    ap.add_argument("--floor-rows", type=int, default=search.FLOOR_ROWS_PER_ROUND)
    ap.add_argument("--highs", default="", help="comma-separated name=value HiGHS options")
    ap.add_argument("--floors", action="store_true", help="solve the floors instead of the budgets")
    args = ap.parse_args(argv)

    search.BUDGET_ROWS_PER_ROUND = args.budget_rows
    search.ROWS_APART = args.apart
    search.FLOOR_ROWS_PER_ROUND = args.floor_rows
    highs = {name: _value(v) for name, v in (kv.split("=", 1) for kv in args.highs.split(",") if kv)}
    if highs:
        own = milp.solver_options

        def with_highs(*a, **k):
            return {**own(*a, **k), **highs}
        milp.solver_options = with_highs

    print(f"budget rows {args.budget_rows}, apart {args.apart}, floor rows {args.floor_rows}"
          f"{', HiGHS ' + args.highs if args.highs else ''}")
    print("| model | budget | time | extra compute | rounds | memory rows (last round) |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for label, (make, fracs) in MODELS.items():
        if args.floors and label not in FLOOR_MODELS:
            continue
        program = make()
        for frac in (None,) if args.floors else fracs:
            t0 = time.perf_counter()
            pl = search.Planner(program, SCOPE)
            if frac is None:
                search.floor(program, SCOPE, planner=pl)
                plan = pl.floor_plan
            else:
                plan = search.optimize(program, search.resolve_budget(program, frac, SCOPE), SCOPE,
                                       planner=pl).program
            t = time.perf_counter() - t0
            total += t
            if frac is None:
                extra = f"{plan.cost / pl.base_cost:.3%} (peak {plan.peak:,} B)"
            else:
                e, base = overhead(plan)
                extra = f"{e / base:.3%}"
            rows = pl.solves[-1].name.rsplit("(", 1)[-1].split(" ")[0]
            print(f"| {label} | {'floor' if frac is None else frac} | {t:.1f} s | {extra} "
                  f"| {len(pl.solves)} | {rows} |", flush=True)
    print(f"\ntotal {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
