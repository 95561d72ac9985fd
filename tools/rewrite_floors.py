"""Floors with and without graph rewrites, and the rewrites a budget gets.

    python tools/rewrite_floors.py [--only gpt2-mid,resnet-mini] [--effort fast] [--exact]

For each model: the traced step's unoptimized activation peak, the floor
recomputation alone reaches, the floor with the rewrites the optimizer may
use (`remat_ir.rewrite`; `remat_ir.optimize.ladder.floor`), and the plan for
a budget below the first floor (`remat_ir.pipeline.fit`, verified): the
rewrites chosen and the time to plan.  Both share one `LadderMemo`, so the
plan reuses the rungs the floor search planned, as a CLI run that resolves
`--budget floor` first does.  GPT-2 medium and resnet18 are planned under
fake tensors.  Budgets and floors are in the activation scope; `--exact`
allows only the rewrites that keep eager's bits.  A budget below the floor
with rewrites is reported as refused.  (To time the
ladder under other settings, `tools/optimize_times.py` takes `--set`.)
"""
from __future__ import annotations

import argparse
import time

from torch._subclasses.fake_tensor import FakeTensorMode

from remat_ir.models import build_builtin
from remat_ir.optimize import ladder
from remat_ir.optimize.search import Infeasible, settings_of, unoptimized_peak
from remat_ir.pipeline import fit, trace

SCOPE = "activations"
# model -> (budget as a fraction of the unoptimized activation peak, fake, optimizer state)
CASES = {
    "gpt2-mid": (0.35, False, "adam"),
    "gpt2-medium": (0.1, True, "adam"),
    "resnet-mini": (0.4, False, "adam"),
    "resnet18": (0.45, True, "adam"),
}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model names")
    ap.add_argument("--effort", default="fast", choices=("fast", "full"))
    ap.add_argument("--exact", action="store_true", help="only rewrites that keep eager's bits")
    args = ap.parse_args()
    # The settings `fit` plans with (the memo holds what they learned).
    settings = settings_of(effort=args.effort)
    names = args.only.split(",") if args.only else list(CASES)
    print("| model | unoptimized | recompute-only floor | floor with rewrites (chosen; time) | budget | "
          "rewrites chosen | plan time |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        fraction, fake, optim = CASES[name]
        if fake:
            with FakeTensorMode():
                module, inputs = build_builtin(name)
                program = trace(module, inputs, fake=True, optimizer=optim)
        else:
            module, inputs = build_builtin(name)
            program = trace(module, inputs, optimizer=optim)
        peak = unoptimized_peak(program, SCOPE)
        memo = ladder.LadderMemo()
        t0 = time.perf_counter()
        low = ladder.floor(program, settings, memo, scope=SCOPE, exact=args.exact)
        t_floor = time.perf_counter() - t0
        # The graph's own floor: searched whole, or block by block when it is large.
        own = memo.floors.get((), memo.floors.get(ladder.OWN_BLOCKS))
        budget = int(fraction * peak)
        t0 = time.perf_counter()
        try:
            chosen = ", ".join(fit(program, budget, scope=SCOPE, effort=args.effort, memo=memo,
                                   exact=args.exact).header.rewrites) or "none"
        except Infeasible:
            chosen = "refused: below the floor"
        t_plan = time.perf_counter() - t0
        f = low.predicted_peak
        print(f"| {name} | {mib(peak)} | {mib(own)} ({own / peak:.1%}) | {mib(f)} ({f / peak:.1%}; "
              f"{', '.join(low.program.header.rewrites) or 'none'}; {t_floor:.0f} s) | {fraction} ({mib(budget)}) | "
              f"{chosen} | {t_plan:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
