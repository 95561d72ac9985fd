"""The decomposed optimizer against the flat MILP, on graphs small enough for
the flat MILP to prove its optimum: a table of extra recompute.

    .venv/bin/python tools/quality_gap.py [--flat-limit 300]

Models: `gpt2-tiny` (2 blocks, dropout on) and the same GPT without dropout
(fewer ops, so the flat MILP proves more budgets).  Budgets are fractions of
the unoptimized activation peak.  Each cell is one cold solve: the decomposed
search with `effort="fast"` (per-block MILPs stop at 500 nodes) and
`effort="full"` (every per-block MILP to its gap tolerance), the default
search (`decompose=None`: on graphs this small, the flat MILP with its
memory rows added as plans break them), and the flat MILP alone (`decompose=False`) with its status
and optimality gap at `--flat-limit`.  The flat MILP is exact: where
it says optimal, no plan of the family recomputes less.
"""
from __future__ import annotations

import argparse
import time

import torch

from remat_ir.models import GPT, GPTConfig
from remat_ir.optimize.search import Infeasible, optimize, resolve_budget
from remat_ir.pipeline import trace_builtin
from remat_ir.trace.tracer import trace_module


def gpt_no_dropout():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=1024, block_size=64, dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 1024, (2, 64), generator=gen)
    tg = torch.randint(0, 1024, (2, 64), generator=gen)
    return trace_module(GPT(cfg), (idx, tg), model_name="gpt2-tiny, dropout 0")


def solve(p, budget, **kw):
    t0 = time.perf_counter()
    try:
        r = optimize(p, budget, "activations", **kw)
    except Infeasible:
        return None, time.perf_counter() - t0
    return r, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flat-limit", type=float, default=300.0, help="time limit of each flat solve")
    ap.add_argument("--time-limit", type=float, default=600.0, help="time limit of each decomposed solve")
    args = ap.parse_args(argv)
    cases = [("gpt2-tiny", lambda: trace_builtin("gpt2-tiny", fake=True), (0.7, 0.6, 0.5)),
             ("gpt2-tiny, dropout 0", gpt_no_dropout, (0.7, 0.6))]
    print("| model | budget | decomposed, fast | decomposed, full | default (auto), fast | default (auto), full "
          "| flat MILP | decomposed full vs flat | default fast vs flat |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make, fracs in cases:
        p = make()
        for frac in fracs:
            budget = resolve_budget(p, frac, "activations")
            cells, got = [], {}
            for decompose in (True, None):
                for effort in ("fast", "full"):
                    r, dt = solve(p, budget, effort=effort, decompose=decompose, time_limit=args.time_limit)
                    how = "" if decompose or r is None else f", {r.mode}"
                    cells.append("refused" if r is None else f"{r.overhead:.3%} ({dt:.0f} s{how})")
                    got[decompose, effort] = r
            fl, dt = solve(p, budget, decompose=False, time_limit=args.flat_limit)
            def rel(r):
                return "-" if r is None or fl is None or fl.extra_cost == 0 else \
                    f"{r.extra_cost / fl.extra_cost - 1:+.1%}"

            if fl is None:
                flat_cell = f"refused ({dt:.0f} s)"
            else:
                st = fl.solves[-1]
                how = "optimal" if st.status == "optimal" else f"{st.status}, gap {st.gap:.0%}"
                flat_cell = f"{fl.overhead:.3%} ({how}, {dt:.0f} s)"
            print(f"| {name} | {frac} | {' | '.join(cells)} | {flat_cell} | {rel(got[True, 'full'])} "
                  f"| {rel(got[None, 'fast'])} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
