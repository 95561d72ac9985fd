"""A wrapped model called under `torch.autocast`, as AMP training calls it.

The step is traced under the caller's autocast (forward and loss inside it,
backward outside, as eager runs `loss.backward()` after the block), the plan's
header records it, and the plan's ops, which carry autocast's casts, run with
the outer autocast switched off: gpt2-tiny and a transformers Llama train
bitwise as eager under the same autocast, and so does transformers' Trainer
with `bf16=True`.  A plan runs only under the autocast it was made under.
"""
from __future__ import annotations

import copy
import tempfile

import pytest
import torch

import remat_ir
from remat_ir.ir import RECOMPUTE
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.runtime.bind import PlanMismatch
from remat_ir.runtime.load import load_model

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _same(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _adamw(model, step, n: int = 3, autocast: dict | None = BF16):
    """`n` AdamW steps of `loss = step(model)`, under `autocast` (None: none),
    backward after the block; the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(n):
        torch.manual_seed(i)  # the same dropout masks for eager and the plan
        with torch.autocast(**autocast) if autocast else torch.autocast("cpu", enabled=False):
            loss = step(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.detach()


def _recomputes(program) -> bool:
    return any(i.kind == RECOMPUTE for i in program.forward + program.backward)


def test_gpt2_tiny_under_autocast_trains_as_eager(tmp_path, monkeypatch):
    pytest.importorskip("cvxpy")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    m = load_model("gpt2-tiny", batch=2, seq=16)
    eager = copy.deepcopy(m.module)
    w = remat_ir.wrap(m.module, budget=0.8)

    def step(model):
        return model(*m.inputs)

    assert torch.equal(_adamw(w, step), _adamw(eager, step))
    assert _same(m.module, eager)
    (runner,) = remat_ir.planner(w).plans.values()
    plan = runner.program
    assert plan.header.autocast == "cpu:bfloat16" and _recomputes(plan)
    assert any(v.dtype == "bfloat16" for v in plan.values)  # the casts are the plan's own ops
    assert parse_program(format_program(plan)).header.autocast == "cpu:bfloat16"
    # Without autocast: another step, another plan (and another cache entry).  In float32 this
    # budget takes the LM head and loss in chunks (a sum in another order): close, not bitwise.
    assert torch.allclose(_adamw(w, step, 1, None), _adamw(eager, step, 1, None), rtol=1e-5, atol=0)
    assert all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in zip(m.module.parameters(), eager.parameters()))
    assert [r.program.header.autocast for r in remat_ir.planner(w).plans.values()] == ["cpu:bfloat16", ""]
    assert len(list(tmp_path.glob("*.rir"))) == 2


def test_llama_under_autocast_trains_as_eager(tmp_path, monkeypatch):
    pytest.importorskip("cvxpy")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = _llama(transformers)
    eager = copy.deepcopy(model)
    w = remat_ir.wrap(model, budget=0.5)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(m):
        return m(input_ids=ids, labels=ids).loss

    assert torch.equal(_adamw(w, step), _adamw(eager, step))
    assert _same(model, eager)
    (runner,) = remat_ir.planner(w).plans.values()
    assert runner.program.header.autocast == "cpu:bfloat16" and _recomputes(runner.program)


def _llama(transformers, gradient_checkpointing: bool = False):
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).float().square().mean()


def test_a_plan_runs_only_under_its_own_autocast():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    plain = remat_ir.wrap(net, remat_ir.compile(net, (x,)))
    with torch.autocast(**BF16):
        with pytest.raises(PlanMismatch, match=r"the step runs under torch.autocast\('cpu', dtype=torch.bfloat16\) "
                                               r"but the plan was made under no autocast"):
            plain(x)
        with torch.no_grad():
            plain(x)  # evaluation runs the model eagerly: autocast is the caller's business
    plain(x).backward()

    # Made under autocast: by the option, or by compiling inside the block (the same plan).
    mixed = remat_ir.compile(net, (x,), autocast="cpu:bfloat16")
    with torch.autocast(**BF16):
        inside = remat_ir.compile(net, (x,))
    assert mixed.header.autocast == inside.header.autocast == "cpu:bfloat16"
    assert mixed.header.fingerprint == inside.header.fingerprint != remat_ir.compile(net, (x,)).header.fingerprint
    w = remat_ir.wrap(net, mixed)  # the model check retraces under the plan's autocast
    with pytest.raises(PlanMismatch, match=r"the step runs under no autocast but the plan was made under "
                                           r"torch.autocast\('cpu', dtype=torch.bfloat16\)"):
        w(x)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(
            PlanMismatch, match=r"under torch.autocast\('cpu', dtype=torch.float16\) but the plan was made under "
                                r"torch.autocast\('cpu', dtype=torch.bfloat16\)"):
        w(x)
    net.zero_grad(set_to_none=True)
    eager = copy.deepcopy(net)
    with torch.autocast(**BF16):
        a, b = w(x), eager(x)
    a.backward()
    b.backward()
    assert torch.equal(a, b) and all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), eager.parameters()))
    with pytest.raises(remat_ir.trace.TraceError, match="autocast"):
        remat_ir.compile(net, (x,), autocast="cpu:bfloat")


def test_trainer_bf16_trains_the_wrapped_model_as_the_model(tmp_path, monkeypatch):
    pytest.importorskip("cvxpy")
    transformers = pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    spec = importlib.util.spec_from_file_location(
        "trainer_gpt2", Path(__file__).resolve().parent.parent / "examples" / "trainer_gpt2.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def train(wrapped: bool):
        model = _llama(transformers)
        wrapper = remat_ir.wrap(model, budget=0.5) if wrapped else model
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, seed=0,
                use_cpu=True, bf16=True, report_to="none", save_strategy="no", dataloader_num_workers=0,
                disable_tqdm=True)
            trainer = transformers.Trainer(model=wrapper, args=args, train_dataset=example.RandomTokens(n=16, seq=16))
            trainer.train()
        assert trainer.accelerator.mixed_precision == "bf16"  # accelerate's autocast around the forward
        return model, wrapper

    model, wrapper = train(True)
    eager, _ = train(False)
    assert _same(model, eager)
    assert not _same(model, _llama(transformers))  # it trained
    # accelerate patches the model's own forward with its autocast (the model is adopted in place, so
    # that forward is what the step traces): the casts are inside the traced step.
    (runner,) = remat_ir.planner(wrapper).plans.values()
    assert any(v.dtype == "bfloat16" for v in runner.program.values)


def test_remat_compile_autocast_and_remat_run(tmp_path, capsys):
    import json

    from remat_ir.cli.commands import compile_main, run_main

    out = tmp_path / "mlp_bf16.rir"
    assert compile_main(["mlp", "-o", str(out), "--autocast", "cpu:bfloat16", "--quiet"]) == 0
    assert "autocast cpu:bfloat16" in out.read_text()
    capsys.readouterr()
    # remat-run runs the step (eager's and the plan's) under the plan's autocast.
    assert run_main([str(out), "mlp", "--steps", "2", "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["grads_bitwise"] is True and data["loss_bitwise"] is True
    assert data["memory_within_tolerance"] is True
    for bad, said in (("cpu:bfloat", "write it as the device type and the dtype"),
                      ("cuda:float16", "is for cuda, but the model is built on --device cpu")):
        assert compile_main(["mlp", "-o", str(tmp_path / "x.rir"), "--autocast", bad]) == 2
        assert said in capsys.readouterr().err


def test_verdict_and_plan_do_not_depend_on_the_callers_autocast():
    """wrap plans inside the caller's autocast (its first call). The plan's
    ops carry their own casts, so the verifier's fake runs of them, and the
    optimizer, must not cast again: CPU autocast would run this fp32 plan's
    `mm` in bfloat16 (CUDA autocast, `sum` in float32), and the verifier
    would reject a sound plan."""
    from remat_ir.check.verify import verify
    from remat_ir.pipeline import fit, trace

    m = load_model("mlp")
    program = trace(m.module, m.inputs, loss=m.loss, name="mlp")
    plain = fit(program, 0.8, scope="activations")
    assert verify(program).ok
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert verify(program).ok
        assert verify(plain).ok
        inside = fit(program, 0.8, scope="activations")
    assert format_program(inside) == format_program(plain)


def test_model_check_of_a_rewritten_plan_does_not_depend_on_the_callers_autocast():
    """The model check applies the plan's rewrites (the chunked loss) to a
    fresh trace, on fake tensors: inside the caller's autocast their matmuls
    would be cast to bfloat16, and a sound plan refused as made for another
    model."""
    from remat_ir.check.verify import verify
    from remat_ir.pipeline import trace
    from remat_ir.rewrite import apply

    m = load_model("gpt2-tiny")
    plan = apply(trace(m.module, m.inputs, loss=m.loss, name="gpt2-tiny"), ["lm_head_nll:16"])
    assert plan.header.rewrites and verify(plan).ok
    remat_ir.wrap(copy.deepcopy(m.module), plan, loss=m.loss)  # the model check, outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        remat_ir.wrap(copy.deepcopy(m.module), plan, loss=m.loss)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 0.8])
def test_per_step_gradients_under_autocast_are_eagers_bits(budget, tmp_path, monkeypatch):
    """Each step's gradients, not the parameters after an optimizer (whose
    updates can hide a difference): one symbolic plan serves calls of three
    sizes, its dropout eager's own (`dropout`'s C++ composite, whose mask
    holds 1/(1-p) in bfloat16, not `native_dropout`'s exact scale)."""
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    m = load_model("gpt2-tiny", batch=2, seq=16)
    eager = copy.deepcopy(m.module)
    w = remat_ir.wrap(m.module, budget=budget)
    (idx, targets) = m.inputs
    for b, t in [(2, 16), (3, 12), (2, 16)]:
        x, y = idx.repeat(2, 1)[:b, :t].contiguous(), targets.repeat(2, 1)[:b, :t].contiguous()
        for model in (w, eager):
            torch.manual_seed(b * t)
            with torch.autocast(**BF16):
                loss = model(x, y)
            loss.backward()
        for (name, p), q in zip(m.module.named_parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), (name, (b, t), (p.grad - q.grad).abs().max().item())
        m.module.zero_grad()
        eager.zero_grad()
