"""A model that checkpoints its own layers (`torch.utils.checkpoint`).

remat-ir traces through checkpoint calls as plain code (its plan decides what
is recomputed), while eager keeps checkpointing: a transformers GPT-2 with
`gradient_checkpointing_enable()` and dropout on, and hand-written models
calling `checkpoint(..., use_reentrant=False)`, `checkpoint(...,
use_reentrant=True)` and `checkpoint_sequential`, train 3 AdamW steps with
the parameters of eager, bitwise.  The inlining is scoped to the tracing
thread and to the trace.
"""
from __future__ import annotations

import copy
import importlib.util
import threading
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as ckpt

import remat_ir
from remat_ir.ir import RECOMPUTE
from remat_ir.trace.checkpoint import inline_checkpoints

ROOT = Path(__file__).resolve().parent.parent


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _adamw(model, step, n: int = 3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(n):
        torch.manual_seed(i)  # the same dropout masks for eager and the plan
        loss = step(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.detach()


def _recomputes(wrapper) -> bool:
    (runner,) = remat_ir.planner(wrapper).plans.values()
    p = runner.program
    return any(i.kind == RECOMPUTE for i in p.forward + p.backward)


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")  # transformers 5 renames it activation_...
@pytest.mark.parametrize("reentrant", [False, True])  # transformers' default, and the older one
def test_gpt2_with_gradient_checkpointing_trains_as_eager(reentrant, tmp_path, monkeypatch):
    pytest.importorskip("cvxpy")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    spec = importlib.util.spec_from_file_location("trainer_gpt2", ROOT / "examples" / "trainer_gpt2.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.build_model()  # dropout 0.1 everywhere
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True} if reentrant else None)
    model.train()
    eager = copy.deepcopy(model)
    assert eager.is_gradient_checkpointing
    w = remat_ir.wrap(model, budget=0.5)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(m):
        return m(input_ids=ids, labels=ids).loss

    assert torch.equal(_adamw(w, step), _adamw(eager, step))
    assert _same(model, eager) and _recomputes(w)


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


class Checkpointed(torch.nn.Module):
    def __init__(self, how: str, d: int = 16):
        super().__init__()
        self.how = how
        self.inp = torch.nn.Linear(8, d)
        self.blocks = torch.nn.Sequential(*[Block(d) for _ in range(4)])
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        if self.how == "sequential":
            h = ckpt.checkpoint_sequential(self.blocks, 2, h, use_reentrant=False)
        else:
            for b in self.blocks:
                h = ckpt.checkpoint(b, h, use_reentrant=self.how == "reentrant")
        return self.head(h).square().mean()


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "sequential"])
def test_a_model_calling_checkpoint_trains_as_eager(how, tmp_path, monkeypatch):
    pytest.importorskip("cvxpy")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = Checkpointed(how), torch.randn(32, 8)
    eager = copy.deepcopy(model)
    calls = []  # (a counter in the model's forward would be refused: a plan cannot replay it)
    for b in eager.blocks:
        b.register_forward_pre_hook(lambda m, a: calls.append(m))
    w = remat_ir.wrap(model, budget=0.5)
    assert torch.equal(_adamw(w, lambda m: m(x)), _adamw(eager, lambda m: m(x)))
    assert _same(model, eager) and _recomputes(w)
    # Eager checkpointed: its blocks ran again in backward (the plan's steps run no module code).
    assert len(calls) > 3 * len(eager.blocks), len(calls)
    # The trace left checkpoint as it was.
    assert ckpt.CheckpointFunction.__name__ == "CheckpointFunction"
    assert ckpt._checkpoint_without_reentrant_generator.__module__ == "torch.utils.checkpoint"


def test_inlining_is_scoped_to_the_tracing_thread():
    original = (ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator)
    calls = []

    def f(x):
        calls.append(1)
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    seen = {}

    def elsewhere():
        seen["reentrant"] = ckpt.checkpoint(f, x, use_reentrant=True).grad_fn.name()
        z = ckpt.checkpoint(f, x, use_reentrant=False)
        calls.clear()
        z.sum().backward()
        seen["recomputed"] = len(calls)

    with inline_checkpoints():
        with inline_checkpoints():  # nested (a retrace inside a trace)
            assert ckpt.checkpoint(f, x, use_reentrant=True).grad_fn.name() == "SinBackward0"
        assert ckpt.checkpoint(f, x, use_reentrant=False).grad_fn.name() == "SinBackward0"
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    assert seen == {"reentrant": "CheckpointFunctionBackward", "recomputed": 1}
    assert (ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator) == original
