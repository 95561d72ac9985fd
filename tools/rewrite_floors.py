"""Floors with and without graph rewrites, and the rewrites a budget gets.

    python tools/rewrite_floors.py [--only gpt2-mid,resnet-mini]

For each model: the traced step's unoptimized activation peak, the floor
recomputation alone reaches, the floor with the rewrites the optimizer may
use (`remat_ir.rewrite`), and the plan for a budget below the first floor:
the rewrites chosen and the time to plan.  GPT-2 medium and resnet18 are
planned under fake tensors.  Budgets and floors are in the activation scope.
"""
from __future__ import annotations

import argparse
import time

from torch._subclasses.fake_tensor import FakeTensorMode

from remat_ir.models import build_builtin
from remat_ir.optimize.rewrites import RewritePlanner
from remat_ir.optimize.search import unoptimized_peak
from remat_ir.pipeline import fit, trace

SCOPE = "activations"
# model -> (budget as a fraction of the unoptimized activation peak, fake, optimizer state)
CASES = {
    "gpt2-mid": (0.3, False, "adam"),
    "gpt2-medium": (0.1, True, "adam"),
    "resnet-mini": (0.4, False, "adam"),
    "resnet18": (0.45, True, "adam"),
}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model names")
    args = ap.parse_args()
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
        rp = RewritePlanner(program, SCOPE)
        t0 = time.perf_counter()
        low = rp.floor()
        own = rp.own_floor
        t_floor = time.perf_counter() - t0
        budget = int(fraction * peak)
        t0 = time.perf_counter()
        plan = fit(program, budget, scope=SCOPE, planner=rp)
        t_plan = time.perf_counter() - t0
        print(f"| {name} | {mib(peak)} | {mib(own)} ({own / peak:.1%}) | {mib(low)} ({low / peak:.1%}; "
              f"{', '.join(rp.floor_specs) or 'none'}; {t_floor:.0f} s) | {fraction} ({mib(budget)}) | "
              f"{', '.join(plan.header.rewrites) or 'none'} | {t_plan:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
