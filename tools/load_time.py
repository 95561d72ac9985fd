"""How long `load_plan` takes on a big plan.

    python tools/load_time.py [--model gpt2-medium] [--batch 4] [--seq 512] [--runs 7]

Traces the built-in model with fake tensors (no weights, no data), saves the
plan to a temporary file, loads it `--runs` times and prints a table: the
file's size and lines, the median and fastest load, and whether printing
the loaded plan gives back the file byte for byte.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-medium", help="a built-in model (remat_ir.models)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--runs", type=int, default=7, help="loads to time")
    args = p.parse_args(argv)

    from remat_ir.ir.files import load_plan, save_plan
    from remat_ir.ir.parser import parse_program
    from remat_ir.ir.printer import format_program
    from remat_ir.pipeline import trace_builtin

    program = trace_builtin(args.model, args.batch, args.seq, fake=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.rir")
        save_plan(program, path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        times = []
        for _ in range(max(1, args.runs)):
            t0 = time.perf_counter()
            load_plan(path)
            times.append(time.perf_counter() - t0)
    round_trip = format_program(parse_program(text)) == text

    rows = [
        ("plan", f"{args.model}, batch {args.batch}, seq {args.seq}"),
        ("nodes / values", f"{len(program.nodes)} / {len(program.values)}"),
        ("file size", f"{len(text.encode('utf-8')) / 1e6:.2f} MB"),
        ("lines", f"{text.count(chr(10))}"),
        (f"load_plan, median of {len(times)}", f"{statistics.median(times):.3f} s"),
        (f"load_plan, fastest of {len(times)}", f"{min(times):.3f} s"),
        ("print(parse(text)) == text", "yes" if round_trip else "NO"),
    ]
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} cores")
    print(f"| {'':<30} | {'':<36} |")
    print(f"|{'-' * 32}|{'-' * 38}|")
    for name, value in rows:
        print(f"| {name:<30} | {value:<36} |")


if __name__ == "__main__":
    main()
