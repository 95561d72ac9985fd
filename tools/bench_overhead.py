"""Step time of a model run by its (unoptimized) plan vs eager PyTorch.

    python tools/bench_overhead.py [--model gpt2-mid] [--steps 11] [--rounds 3] [--guard-calls 2000]

Prints a table: eager and wrapped median step times and their ratio.  The two
are interleaved step by step so machine noise hits both alike.  Then the
cost of the per-step model guard (`remat_ir.runtime.bind.ModelGuard`, part
of each wrapped step above) alone: its check timed over `--guard-calls`
calls, five times, the median, and its share of the wrapped step.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from remat_ir.runtime.interpret import wrap
from remat_ir.runtime.load import load_model
from remat_ir.trace.tracer import trace_module


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

    times = {"eager": [], "remat-ir": []}
    for i in range(args.steps + 2):
        order = [("eager", eager_step), ("remat-ir", plan_step)]
        if i % 2:
            order.reverse()
        for name, fn in order:
            torch.manual_seed(i)
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= 2:  # two warm-up rounds
                times[name].append(dt)
    e, w = statistics.median(times["eager"]), statistics.median(times["remat-ir"])
    shape = " x ".join(str(s) for s in m.inputs[0].shape)
    print(f"model {args.model} (inputs {shape}), {len(program.nodes)} ops, median of {args.steps} steps, "
          f"{torch.get_num_threads()} threads")
    print(f"| {'method':<10} | {'step time':>10} | {'ratio':>6} |")
    print(f"|{'-' * 12}|{'-' * 12}|{'-' * 8}|")
    print(f"| {'eager':<10} | {1e3 * e:>7.1f} ms | {1.0:>6.3f} |")
    print(f"| {'remat-ir':<10} | {1e3 * w:>7.1f} ms | {w / e:>6.3f} |")

    guard, module = wrapped._model_guard, wrapped.module
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.guard_calls):
            changed = guard.changes(module)
        rounds.append((time.perf_counter() - t0) / args.guard_calls)
        assert not changed
    g = statistics.median(rounds)
    n_modules = sum(1 for _ in module.modules())
    n_tensors = sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers())
    print(f"model guard check ({n_modules} modules, {n_tensors} parameters and buffers): {1e6 * g:.1f} us a step "
          f"(median of 5 x {args.guard_calls} calls), {100 * g / w:.3f}% of the remat-ir step")


if __name__ == "__main__":
    main()
