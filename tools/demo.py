"""The main job on a built-in model: compile a plan, verify it, run it, and
print predicted vs measured peak memory.

    python tools/demo.py [--model gpt2-tiny] [--budget 0.5] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from remat_ir.cli.commands import compile_main, run_main, verify_main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--budget", default=None, help="optional budget (fraction of the activation peak, or bytes)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="directory for the plan (default: a temporary one)")
    args = p.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="remat-ir-")
    os.makedirs(out, exist_ok=True)
    plan = os.path.join(out, f"{args.model.replace('/', '_')}.rir")
    steps = [
        ("remat-compile", compile_main, [args.model, "-o", plan]
         + (["--budget", args.budget, "--scope", "activations"] if args.budget else [])),
        ("remat-verify", verify_main, [plan]),
        ("remat-run --check", run_main, [plan, args.model, "--steps", str(args.steps), "--check"]),
    ]
    for title, fn, a in steps:
        print(f"\n$ {title} {' '.join(a)}", flush=True)
        rc = fn(a)
        if rc != 0:
            print(f"{title} failed with exit code {rc}", file=sys.stderr)
            return rc
    print(f"\nplan: {plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
