"""Does a wrapped model train as the eager one does?  `train_side_by_side`
runs a few optimizer steps of both (it plans, so it lives beside
`remat_ir.adopt`, above the tracer; `remat_ir.trace.fidelity.compare` is the
tracer's op-by-op check)."""
from __future__ import annotations

import torch

__all__ = ["train_side_by_side"]


def train_side_by_side(model: torch.nn.Module, kwargs: dict, *, budget=0.5, steps: int = 3,
                       seed: int = 0) -> dict:
    """`steps` AdamW steps of a copy of `model` eagerly and of another copy
    through `remat_ir.wrap(copy, budget=budget)` (plans kept off disk), on
    the same call and seeds.  Returns {"bitwise": parameters (and gradients) equal bit for
    bit after every step, "max_rel": the largest parameter difference over
    its tensor's largest magnitude, "plan_s": seconds of the first wrapped
    step (planning), "plans": plans made}."""
    import copy
    import time

    from remat_ir.adopt import planner, wrap

    eager = copy.deepcopy(model).train()
    wrapped = wrap(copy.deepcopy(model).train(), budget=budget, cache=False)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (eager, wrapped)]
    bitwise, max_rel, plan_s = True, 0.0, 0.0
    for step in range(steps):
        for m, opt in ((eager, opts[0]), (wrapped, opts[1])):
            torch.manual_seed(seed + step)
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            m(**kwargs).loss.backward()
            if m is wrapped and step == 0:
                plan_s = time.perf_counter() - t0
            opt.step()
        for a, b in zip(eager.parameters(), wrapped.parameters()):
            # Gradients too: AdamW's step can round a 1-ulp gradient difference away.
            bitwise &= torch.equal(a, b) and (a.grad is None) == (b.grad is None) and (
                a.grad is None or torch.equal(a.grad, b.grad))
            scale = a.detach().abs().max().item() or 1.0
            max_rel = max(max_rel, (a - b).abs().max().item() / scale)
    return {"bitwise": bitwise, "max_rel": max_rel, "plan_s": plan_s, "plans": len(planner(wrapped).plans)}
