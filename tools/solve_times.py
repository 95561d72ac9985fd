"""Solve times of the optimizer on built-in models: a table.

    .venv/bin/python tools/solve_times.py                       # gpt2-small and gpt2-medium, activations
    .venv/bin/python tools/solve_times.py --models gpt2-tiny,gpt2-small --fractions 0.9,0.7,0.5 --scope total
    .venv/bin/python tools/solve_times.py --gap --models gpt2-tiny --flat-limit 120
    .venv/bin/python tools/solve_times.py --models gpt2-tiny --effort full --repeat 3

Models are traced with fake tensors (nothing is allocated).  Every budget is
solved cold (a fresh planner: the per-block option sets are recomputed), as
a CLI invocation would.  Budgets are fractions of the unoptimized peak in the
scope.  `--gap` also solves each budget with the flat MILP (no
decomposition) and prints the decomposed plan's extra recompute next to it.
`--repeat N` solves each budget N times (cold) and prints every run's extra
recompute: every MILP stops at a node limit or its gap, never at a time, so
the runs should agree.

Columns: `recompute` is the extra FLOPs over the step's FLOPs; `MILPs` the
number of MILPs solved (with `--effort fast` per-block option MILPs stop at
500 nodes: they sample the Pareto set, so their gap does not bound the
plan's optimality); `proven` how many of them the solver proved optimal (the
rest stopped at their node limit with an incumbent).  The combine step is an exact dynamic
program on a chain; every plan's peak is the simulator's.
"""
from __future__ import annotations

import argparse
import time

from remat_ir.optimize.search import Infeasible, floor, optimize, unoptimized_peak
from remat_ir.ir.printer import human_bytes
from remat_ir.ir.types import DEFAULT_SCOPE, SCOPES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2-small,gpt2-medium")
    ap.add_argument("--fractions", default="0.7,0.5,0.3")
    ap.add_argument("--scope", default=DEFAULT_SCOPE, choices=SCOPES)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--solver", default="HIGHS")
    ap.add_argument("--effort", default="fast", choices=("fast", "full"))
    ap.add_argument("--repeat", type=int, default=1, help="solve each budget this many times")
    ap.add_argument("--gap", action="store_true", help="compare with the flat MILP (slow)")
    ap.add_argument("--flat-limit", type=float, default=120.0, help="time limit of each flat solve")
    args = ap.parse_args(argv)

    from remat_ir.pipeline import trace_builtin

    fracs = [float(x) for x in args.fractions.split(",")]
    header = (f"{'model':<12} {'budget':>6} {'bytes':>11} {'floor':>11} {'peak':>11} {'recompute':>10} "
              f"{'seconds':>8} {'MILPs':>5} {'proven':>9}  status")
    if args.gap:
        header += f"   {'flat recompute':>14} {'flat s':>7} {'flat gap':>8}"
    rows = [header]
    print(header, flush=True)
    for model in args.models.split(","):
        t0 = time.perf_counter()
        p = trace_builtin(model, batch=args.batch, seq=args.seq, fake=True)
        t_trace = time.perf_counter() - t0
        top = unoptimized_peak(p, args.scope)
        t0 = time.perf_counter()
        f = floor(p, args.scope, time_limit=args.time_limit, solver=args.solver, effort=args.effort)
        t_floor = time.perf_counter() - t0
        line = (f"{model:<12} {'floor':>6} {'':>11} {human_bytes(f):>11} {'':>11} {'':>10} "
                f"{t_floor:>8.1f} {'':>5} {'':>9}  trace {t_trace:.1f} s, "
                f"{sum(n.phase == 'forward' for n in p.nodes)}/{len(p.nodes)} nodes, "
                f"unoptimized {human_bytes(top)} ({args.scope}); floor = {f / top:.0%}")
        print(line, flush=True)
        rows.append(line)
        for frac in fracs:
            budget = int(top * frac)
            t0 = time.perf_counter()
            try:
                r = optimize(p, budget, args.scope, time_limit=args.time_limit, solver=args.solver,
                             effort=args.effort)
                dt = time.perf_counter() - t0
                runs = [r.overhead]
                for _ in range(args.repeat - 1):
                    runs.append(optimize(p, budget, args.scope, time_limit=args.time_limit,
                                         solver=args.solver, effort=args.effort).overhead)
                milps = [s for s in r.solves if "chain DP" not in s.name]
                proven = sum(1 for s in milps if s.status == "optimal")
                line = (f"{model:<12} {frac:>6.2f} {human_bytes(budget):>11} {human_bytes(f):>11} "
                        f"{human_bytes(r.predicted_peak):>11} {r.overhead:>9.2%} {dt:>8.1f} "
                        f"{len(milps):>5} {f'{proven}/{len(milps)}':>9}  {r.mode}")
                if args.repeat > 1:
                    line += "  runs: " + " ".join(f"{x:.3%}" for x in runs)
            except Infeasible as e:
                dt = time.perf_counter() - t0
                r = None
                line = (f"{model:<12} {frac:>6.2f} {human_bytes(budget):>11} {human_bytes(e.floor_bytes):>11} "
                        f"{'-':>11} {'-':>10} {dt:>8.1f} {'':>5} {'':>9}  infeasible")
            if args.gap:
                t1 = time.perf_counter()
                try:
                    fl = optimize(p, budget, args.scope, time_limit=args.flat_limit, solver=args.solver,
                                  decompose=False)
                    st = fl.solves[-1] if fl.solves else None
                    g = st.gap if st is not None and st.gap is not None else 0.0
                    line += (f"   {fl.overhead:>14.2%} {time.perf_counter() - t1:>7.1f} {g:>8.2%}"
                             + (f" ({st.status})" if st is not None and st.status != "optimal" else ""))
                except Infeasible as e:
                    line += f"   {'infeasible':>14} {time.perf_counter() - t1:>7.1f} floor {human_bytes(e.floor_bytes)}"
            print(line, flush=True)
            rows.append(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
