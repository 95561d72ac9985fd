"""Is the planned step eager's step, on the transformers families users train?

    .venv/bin/python tools/fidelity.py [--budget 0.5] [--steps 3] [family ...]

For each family of `remat_ir.models.families` (small configs, called with
their usual arguments: masks, labels, LoRA adapters), one row: the eager and
traced aten op counts and the first difference between them
(`remat_ir.trace.fidelity.compare`), then `--steps` AdamW steps eagerly and
through `remat_ir.wrap(model, budget=...)` from the same weights and seeds:
whether the parameters are bitwise equal after every step, the largest
relative difference, and the first wrapped step's time (planning included).
"""
from __future__ import annotations

import argparse

from remat_ir.models.families import FAMILIES
from remat_ir.side_by_side import train_side_by_side
from remat_ir.trace.fidelity import compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", metavar="family", help=f"of {', '.join(FAMILIES)} (default: all)")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown family {unknown[0]}: choose from {', '.join(FAMILIES)}")
    print(f"| family | eager ops | traced ops | fidelity | {args.steps} AdamW steps at {args.budget} | "
          "max rel. diff | first step (planning) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.families or FAMILIES:
        try:
            model, kwargs = FAMILIES[name]()
        except ImportError as e:  # a family whose package is not installed (peft, timm)
            if args.families:
                raise
            print(f"| {name} | | | skipped: {e} | | | |", flush=True)
            continue
        f = compare(model, (), kwargs)
        r = train_side_by_side(model, kwargs, budget=args.budget, steps=args.steps)
        print(f"| {name} | {len(f.eager)} | {len(f.traced)} | {'same' if f.same else f.difference} | "
              f"{'bitwise' if r['bitwise'] else 'differ'} | {r['max_rel']:.1e} | {r['plan_s']:.1f} s |",
              flush=True)


if __name__ == "__main__":
    main()
