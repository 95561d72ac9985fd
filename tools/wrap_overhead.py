"""The plan's overhead: step time of a model run by its (unoptimized) plan vs
eager PyTorch, and the per-step model guard's share of it.

    python tools/wrap_overhead.py [--model gpt2-mid] [--steps 11] [--guard-calls 2000]

Prints a table: eager and wrapped median step times and their ratio, timed
as remat-bench times its methods (`remat_ir.cli.measure.time_rounds`: the
order rotated each round so machine noise hits both alike; two warm-up
rounds first, not counted).  Then the
cost of the per-step guards (`remat_ir.runtime.bind.ModelGuard`, the module
tree, and `LiveGuard`, the attributes the trace read and the hook dicts;
part of each wrapped step above) alone: each check timed over
`--guard-calls` calls, five times, the median, and its share of the wrapped
step.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from remat_ir.cli.measure import Row, time_rounds
from remat_ir.runtime.interpret import planner, wrap
from remat_ir.runtime.load import load_model
from remat_ir.trace.tracer import trace_module


def print_nothing(line: str) -> None:
    pass


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-mid")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--guard-calls", type=int, default=2000)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    m = load_model(args.model, batch=args.batch, seq=args.seq)
    program = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=args.model)
    eager = copy.deepcopy(m.module)
    wrapped = wrap(m.module, program, loss=m.loss)

    def eager_step():
        out = eager(*m.inputs)
        (m.loss(out, *m.inputs) if m.loss else out).backward()

    def plan_step():
        wrapped(*m.inputs).backward()

    steps = {"eager": eager_step, "remat-ir": plan_step}
    cpu = torch.device("cpu")
    time_rounds([Row(k, k, "warm-up") for k in steps], steps, 2, cpu, 0, print_nothing)  # not counted
    rows = [Row(k, k, "timed") for k in steps]
    time_rounds(rows, steps, args.steps, cpu, 0, print_nothing)
    e, w = rows[0].step_time, rows[1].step_time
    shape = " x ".join(str(s) for s in m.inputs[0].shape)
    print(f"model {args.model} (inputs {shape}), {len(program.nodes)} ops, median of {args.steps} steps, "
          f"{torch.get_num_threads()} threads")
    print(f"| {'method':<10} | {'step time':>10} | {'ratio':>6} |")
    print(f"|{'-' * 12}|{'-' * 12}|{'-' * 8}|")
    print(f"| {'eager':<10} | {1e3 * e:>7.1f} ms | {1.0:>6.3f} |")
    print(f"| {'remat-ir':<10} | {1e3 * w:>7.1f} ms | {rows[1].ratio:>6.3f} |")

    module = wrapped
    n_modules = sum(1 for _ in module.modules())
    n_tensors = sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers())
    live = planner(wrapped)._live_guard
    for name, guard, what in [
            ("model guard", planner(wrapped)._model_guard, f"{n_modules} modules, {n_tensors} parameters and buffers"),
            ("live guard", live, f"{len(live.entries)} attributes read, {len(live._hooks)} hook dicts")]:
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.guard_calls):
                changed = guard.changes(module)
            rounds.append((time.perf_counter() - t0) / args.guard_calls)
            assert not changed
        g = statistics.median(rounds)
        print(f"{name} check ({what}): {1e6 * g:.1f} us a step (median of 5 x {args.guard_calls} calls), "
              f"{100 * g / w:.3f}% of the remat-ir step")


if __name__ == "__main__":
    main()
