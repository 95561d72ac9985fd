"""Regenerate the golden plans in schedules/.

    python tools/make_schedules.py [--check]

Each plan is compiled from a built-in model with default inputs.  With
--check, compares instead of writing and exits 1 on a difference.  Plans
depend on the PyTorch version that traced them (op decompositions change), so
the torch version is recorded in each file's header comment.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from remat_ir.ir.printer import format_program
from remat_ir.pipeline import trace_builtin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "schedules")

# name -> (built-in model, budget as a fraction of the activation peak or None)
PLANS = {
    "mlp": ("mlp", None),
    "gpt2-tiny": ("gpt2-tiny", None),
    "gpt2-tiny.budget-0.7": ("gpt2-tiny", "0.7"),
}


def build(model: str, budget: str | None) -> str:
    program = trace_builtin(model)
    program.header.comment = [f"remat-ir golden plan: {model}, default inputs, torch {torch.__version__.split('+')[0]}"
                              + (f", budget {budget} of the activation peak" if budget else "")]
    if budget is not None:
        from remat_ir.optimize.search import optimize, resolve_budget

        # The default settings (the "fast" effort): the plan the CLI makes.
        program = optimize(program, resolve_budget(program, budget, "activations"), scope="activations").program
    return format_program(program)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    status = 0
    for name, (model, budget) in PLANS.items():
        text = build(model, budget)
        path = os.path.join(OUT, f"{name}.rir")
        if args.check:
            same = os.path.exists(path) and open(path).read() == text
            print(f"{path}: {'same' if same else 'DIFFERS'}")
            status |= not same
        else:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {path} ({len(text.splitlines())} lines)")
    return status


if __name__ == "__main__":
    sys.exit(main())
