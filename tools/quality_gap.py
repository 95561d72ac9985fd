"""The decomposed optimizer against the flat MILP, on graphs small enough for
the flat MILP to prove its optimum: a table of extra recompute.

    .venv/bin/python tools/quality_gap.py [--flat-limit 300] [--only gpt2-tiny] [--set FIELD=VALUE]

Models: `gpt2-tiny` (2 blocks, dropout on) and the same GPT without dropout,
`gpt2-tiny (dropout 0)` (fewer ops, so the flat MILP proves more budgets).  Budgets are fractions of
the unoptimized activation peak.  Each cell is one cold solve (a fresh
problem and memo) of one strategy of `remat_ir.optimize.search`:
`decomposed` with the "fast" effort (per-block MILPs stop at 500 nodes) and
the "full" one (every per-block MILP to its gap tolerance), `optimize` (the
default: on graphs this small, the flat MILP with its memory rows added as
plans break them), and `flat` alone with its status and optimality gap at
`--flat-limit` seconds.  The flat MILP is exact: where it says optimal, no
plan of the family recomputes less.  `--set FIELD=VALUE` (repeatable)
overrides a `Settings` field in every solve, as in `tools/optimize_times.py`.
"""
from __future__ import annotations

import argparse
import time

import torch

from optimize_times import settings_of
from remat_ir.models import GPT, GPTConfig
from remat_ir.optimize import search
from remat_ir.optimize.search import Infeasible, resolve_budget
from remat_ir.pipeline import trace_builtin
from remat_ir.trace.tracer import trace_module

SCOPE = "activations"


def gpt_no_dropout():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=1024, block_size=64, dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 1024, (2, 64), generator=gen)
    tg = torch.randint(0, 1024, (2, 64), generator=gen)
    return trace_module(GPT(cfg), (idx, tg), model_name="gpt2-tiny (dropout 0)")


def solve(strategy, p, budget, settings):
    t0 = time.perf_counter()
    try:
        r = strategy(p, budget, settings, scope=SCOPE)
    except Infeasible:
        return None, time.perf_counter() - t0
    return r, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flat-limit", type=float, default=300.0, help="time limit of each flat solve")
    ap.add_argument("--time-limit", type=float, default=600.0, help="time limit of each other solve")
    ap.add_argument("--only", default="", help="comma-separated model names (each a name, else a prefix)")
    ap.add_argument("--budgets", default="", help="comma-separated fractions for every model")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="FIELD=VALUE",
                    help="an optimizer setting (remat_ir.optimize.problem.Settings), repeatable")
    args = ap.parse_args(argv)
    efforts = {e: settings_of(e, args.settings + [f"time_limit={args.time_limit}"]) for e in ("fast", "full")}
    flat_settings = settings_of("fast", args.settings + [f"time_limit={args.flat_limit}"])
    only = [o for o in args.only.split(",") if o]
    fractions = tuple(float(b) for b in args.budgets.split(",") if b.strip())
    cases = [("gpt2-tiny", lambda: trace_builtin("gpt2-tiny", fake=True), (0.7, 0.6, 0.5)),
             ("gpt2-tiny (dropout 0)", gpt_no_dropout, (0.7, 0.6))]
    names = {name for name, _, _ in cases}
    print("| model | budget | decomposed, fast | decomposed, full | default (auto), fast | default (auto), full "
          "| flat MILP | decomposed full vs flat | default fast vs flat |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make, fracs in cases:
        if only and not any(name == o or (o not in names and name.startswith(o)) for o in only):
            continue
        p = make()
        for frac in fractions or fracs:
            budget = resolve_budget(p, frac, SCOPE)
            cells, got = [], {}
            for strategy in (search.decomposed, search.optimize):
                for effort, settings in efforts.items():
                    r, dt = solve(strategy, p, budget, settings)
                    how = "" if strategy is search.decomposed or r is None else f", {r.mode}"
                    cells.append("refused" if r is None else f"{r.overhead:.3%} ({dt:.0f} s{how})")
                    got[strategy, effort] = r
            fl, dt = solve(search.flat, p, budget, flat_settings)
            def rel(r):
                return "-" if r is None or fl is None or fl.extra_cost == 0 else \
                    f"{r.extra_cost / fl.extra_cost - 1:+.1%}"

            if fl is None:
                flat_cell = f"refused ({dt:.0f} s)"
            else:
                st = fl.solves[-1]
                how = ("optimal" if st.status == "optimal" else
                       f"{st.status}, gap {st.gap:.0%}" if st.gap is not None else st.status)
                flat_cell = f"{fl.overhead:.3%} ({how}, {dt:.0f} s)"
            print(f"| {name} | {frac} | {' | '.join(cells)} | {flat_cell} | {rel(got[search.decomposed, 'full'])} "
                  f"| {rel(got[search.optimize, 'fast'])} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
