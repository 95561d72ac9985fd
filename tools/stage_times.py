"""Wall times of the pipeline's stages on a large model, as a user sees them:
a table of stages and seconds.

    python tools/stage_times.py [--model gpt2-medium] [--batch 4] [--seq 512]

Runs `remat-compile MODEL --fake` and `remat-verify` as subprocesses (so
interpreter start-up and imports count), then times the stages in-process
(building the model under fake tensors, tracing, simulating, verifying,
printing and parsing the plan), and the model check `wrap` runs before a
plan (`remat_ir.runtime.bind`).  No optimizer: the plan is unoptimized (the
optimizer's times are `tools/optimize_times.py`'s table).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def timed(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
    return time.perf_counter() - t0, r.returncode


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-medium")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args(argv)
    bindir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        plan = os.path.join(tmp, "plan.rir")
        t_compile, rc1 = timed([os.path.join(bindir, "remat-compile"), args.model, "--fake", "--batch",
                                str(args.batch), "--seq", str(args.seq), "-o", plan, "--quiet"])
        t_verify, rc2 = timed([os.path.join(bindir, "remat-verify"), plan])

        from remat_ir.runtime.load import load_model
        from remat_ir.check.simulate import simulate
        from remat_ir.ir.parser import parse_program
        from remat_ir.ir.printer import format_program
        from remat_ir.trace.tracer import trace_module
        from remat_ir.check.verify import verify
        from remat_ir.runtime.bind import check_graph

        rows = [(f"remat-compile {args.model} --fake (process)", t_compile, rc1),
                ("remat-verify (process)", t_verify, rc2)]
        t0 = time.perf_counter()
        m = load_model(args.model, batch=args.batch, seq=args.seq, fake=True)
        rows.append(("build model under FakeTensorMode", time.perf_counter() - t0, 0))
        t0 = time.perf_counter()
        program = trace_module(m.module, m.inputs, fake=True)
        rows.append((f"trace ({len(program.nodes)} ops)", time.perf_counter() - t0, 0))
        for name, fn in (("simulate", lambda: simulate(program)), ("verify", lambda: verify(program))):
            t0 = time.perf_counter()
            fn()
            rows.append((name, time.perf_counter() - t0, 0))
        t0 = time.perf_counter()
        text = format_program(program)
        rows.append((f"print ({len(text.splitlines())} lines)", time.perf_counter() - t0, 0))
        t0 = time.perf_counter()
        parse_program(text)
        rows.append(("parse", time.perf_counter() - t0, 0))
        # What wrap() adds before a plan runs: the model traced again, compared op by op.
        t0 = time.perf_counter()
        check_graph(m.module, program)
        rows.append(("model check in wrap (fake retrace + compare)", time.perf_counter() - t0, 0))
    print(f"{args.model}, batch {args.batch}, seq {args.seq}, {os.cpu_count()} cores")
    print(f"| {'stage':<48} | {'seconds':>8} |")
    print(f"|{'-' * 50}|{'-' * 10}|")
    for name, t, rc in rows:
        print(f"| {name:<48} | {t:>8.2f} |" + ("" if rc == 0 else f" exit {rc}"))


if __name__ == "__main__":
    main()
