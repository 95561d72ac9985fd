"""What a cache hit costs: the first training step of a wrapped model whose
plan is already in the plan cache, split into its stages.

    python tools/cache_hit.py [--models gpt2-mid,llama] [--budget 0.5]

For each model, one process plans it (filling a fresh `$REMAT_IR_CACHE`),
then a second process wraps the same model and times its first step
(the cache hit), split into tracing the step to compute its cache key
(`pipeline.trace`), binding the plan (parsing, verifying it again, compiling
its code: `PlanRunner`), and the rest (the step itself, guards); then its
second step, for scale.  `gpt2-mid` is the built-in GPT; `llama` is
`remat_ir.models.families`' Llama called with a mask and labels.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

_STEP = textwrap.dedent('''
    import sys, time, torch
    torch.set_num_threads(2)
    import remat_ir
    from remat_ir import pipeline
    from remat_ir.runtime import interpret
    name, budget = sys.argv[1], float(sys.argv[2])
    spent = {"trace": 0.0, "bind": 0.0}
    def timed(key, fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return inner
    pipeline.trace = timed("trace", pipeline.trace)
    init = interpret.PlanRunner.__init__
    interpret.PlanRunner.__init__ = timed("bind", init)
    if name == "llama":
        from remat_ir.models.families import FAMILIES
        model, kwargs = FAMILIES["llama"](0)
        step = lambda m: m(**kwargs).loss.backward()
    else:
        from remat_ir.models import build_builtin
        model, inputs = build_builtin(name, seed=0)
        step = lambda m: m(*inputs).backward()
    model = remat_ir.wrap(model, budget=budget)
    t0 = time.perf_counter(); step(model); first = time.perf_counter() - t0
    t0 = time.perf_counter(); step(model); second = time.perf_counter() - t0
    print(first, spent["trace"], spent["bind"], second, remat_ir.planner(model).solves)
''')


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt2-mid,llama")
    p.add_argument("--budget", type=float, default=0.5)
    a = p.parse_args(argv)
    print("| model | first step, cache hit | tracing (the key) | binding the plan | the rest | second step |")
    print("|---|---|---|---|---|---|")
    for name in a.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "step.py")
            with open(script, "w") as f:
                f.write(_STEP)
            env = dict(os.environ, REMAT_IR_CACHE=os.path.join(tmp, "cache"))
            runs = []
            for _ in range(2):  # planned, then the cache hit
                out = subprocess.run([sys.executable, script, name, str(a.budget)], env=env, check=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
                runs.append([float(x) for x in out.split()])
            first, trace, bind, second, solves = runs[1]
            assert solves == 0, "the second process planned again"
            print(f"| {name} | {first:.2f} s | {trace:.2f} s | {bind:.2f} s | {first - trace - bind:.2f} s | "
                  f"{second:.2f} s |")


if __name__ == "__main__":
    main()
