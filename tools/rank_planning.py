"""How long each rank of a job takes for its first (planned) step when the
ranks share the plan cache: one plans, the others wait for its plan.

    python tools/rank_planning.py [--ranks 2,4] [--model gpt2-tiny] [--budget 0.7]

For each world size, starts that many processes (gloo, CPU), each wrapping
the same built-in model with `remat_ir.wrap(model, budget=...)` and timing
its first training step from a fresh, shared `$REMAT_IR_CACHE`; prints a
table of each rank's seconds and optimizer runs (solves), and the time one
process alone takes.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

_RANK = textwrap.dedent('''
    import sys, time, torch, torch.distributed as dist, remat_ir
    from remat_ir.models import build_builtin
    rank, world, model_name, budget = int(sys.argv[1]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=world)
    module, (idx, targets) = build_builtin(model_name, seed=0)
    model = remat_ir.wrap(module, budget=budget, dynamic=False)
    t0 = time.perf_counter()
    model(idx, targets).backward()
    print(rank, remat_ir.planner(model).solves, round(time.perf_counter() - t0, 2))
    if world > 1:
        dist.destroy_process_group()
''')


def run(world: int, model: str, budget: float) -> list[tuple[int, int, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(_RANK)
        env = dict(os.environ, REMAT_IR_CACHE=os.path.join(tmp, "cache"), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, script, str(r), os.path.join(tmp, "init"), str(world), model,
                                   str(budget)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for r in range(world)]
        rows = []
        for p in procs:
            out, _ = p.communicate()
            r, solves, seconds = out.split()
            rows.append((int(r), int(solves), float(seconds)))
        return sorted(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--budget", type=float, default=0.7)
    a = p.parse_args(argv)
    alone = run(1, a.model, a.budget)[0][2]
    print(f"model {a.model}, budget {a.budget}; one process alone: {alone:.2f} s for its first step")
    print("| ranks | each rank's first step (s) | solves per rank |")
    print("|---|---|---|")
    for world in map(int, a.ranks.split(",")):
        rows = run(world, a.model, a.budget)
        print(f"| {world} | {', '.join(f'{s:.2f}' for _, _, s in rows)} | {', '.join(str(n) for _, n, _ in rows)} |")


if __name__ == "__main__":
    main()
