"""DistributedDataParallel over a wrapped model: gradients equal DDP's over
the model itself, bitwise (gloo, two CPU processes, dropout on).

The plan hands each gradient to autograd as soon as it exists, so DDP's
hooks bucket and all-reduce them as they would in eager PyTorch.  Both
wrappers are checked: a budgeted plan given explicitly (the golden gpt2-tiny
plan at 0.7 of its activation peak), and a plan made at the first call
inside DDP's forward, in each process.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
STEPS = 2


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import remat_ir
    from remat_ir.models import build_builtin
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        plan = remat_ir.load_plan(ROOT / "schedules" / "gpt2-tiny.budget-0.7.rir")
        grads = {}
        for kind in ("eager", "plan", "first call"):
            module, _ = build_builtin("gpt2-tiny", seed=0)
            if kind == "eager":
                model = module
            elif kind == "plan":
                model = remat_ir.wrap(module, plan)
            else:
                model = remat_ir.wrap(module)  # no budget: the unoptimized plan, made in DDP's forward
            ddp = DistributedDataParallel(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            grads[kind] = []
            for step in range(STEPS):
                # Each process its own batch, so the all-reduce averages different gradients.
                _, (idx, targets) = build_builtin("gpt2-tiny", seed=100 * rank + step)
                torch.manual_seed(1000 * rank + step)  # the same dropout masks in every run
                ddp(idx, targets).backward()
                grads[kind].append([p.grad.clone() for p in module.parameters()])
                opt.step()
                opt.zero_grad()
        torch.save(grads, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_ddp_gradients_equal_unwrapped_ddp_bitwise(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path / "cache"))
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for grads in per_rank:
        for kind in ("plan", "first call"):
            for step in range(STEPS):
                assert all(torch.equal(a, b) for a, b in zip(grads["eager"][step], grads[kind][step])), \
                    f"{kind}, step {step}"
    # All-reduced: every process holds the same gradients.
    assert all(torch.equal(a, b) for a, b in zip(per_rank[0]["plan"][0], per_rank[1]["plan"][0]))
