"""Symbolic plans: one plan for every batch shape, no solver run per sequence length.

A fine-tuning script pads each batch to its own longest sequence; the wrapped
model plans once with the batch and sequence dimensions as symbols
(`remat_ir.ir.sizes`), and each call runs that plan at its own sizes, with
eager's results and the simulator's peak for those sizes."""
from __future__ import annotations

import copy
import random

import pytest
import torch

import remat_ir
from remat_ir.check.simulate import simulate
from remat_ir.ir import sizes as sz
from remat_ir.ir.types import Header, Instr, Node, Output, Program, Ref, Seq, Sym, Value
from remat_ir.runtime.memtrack import measure_step

pytest.importorskip("transformers")

MiB = 2 ** 20


def _llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128))


def _batch(rng: random.Random, g: torch.Generator, batch: int, seq: int) -> dict:
    """A batch padded to its longest sequence, as a collator pads it: each
    row's tail past its own length masked, its labels -100."""
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, rng.randint(seq // 2, seq):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _optimizer_state(opt) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


@pytest.mark.slow
def test_varying_shapes_train_as_eager_with_one_plan_and_exact_peaks(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = _llama()
    eager = copy.deepcopy(model)
    wrapped = remat_ir.wrap(model, budget=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    seen = set()
    for step in range(20):
        batch = _batch(rng, g, rng.choice([2, 4]), rng.randint(32, 128))
        seen.add(tuple(batch["input_ids"].shape))
        params = list(model.parameters())
        grads_present = any(p.grad is not None for p in params)
        pre = {"params": params, "buffers": list(model.buffers()), "inputs": list(batch.values()),
               "optimizer": _optimizer_state(opt)}
        if grads_present:
            pre["grads"] = [p.grad for p in params if p.grad is not None]

        def plan_step():
            wrapped(**batch).loss.backward()

        measured = measure_step(plan_step, pre_existing=pre)
        opt.step()
        opt.zero_grad()
        eager(**batch).loss.backward()
        opt_eager.step()
        opt_eager.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters())), step

        plan = remat_ir.planner(wrapped).plan_of(**batch)
        assert plan is not None and not plan.header.sizes  # the plan at this call's sizes
        state = sum(t.untyped_storage().nbytes() for t in pre["optimizer"])
        predicted = simulate(plan, grads_present=grads_present, optim_state_bytes=state)
        assert abs(measured.peak_bytes - predicted.peak_bytes) <= 0.01 * predicted.peak_bytes + MiB, step
        assert predicted.activation_peak_bytes <= plan.header.budget.bytes
    assert len(seen) >= 15  # (most steps had sizes of their own)
    assert remat_ir.planner(wrapped).solves <= 2
    symbolic = [r.program for r in remat_ir.planner(wrapped).plans.values() if r.symbolic]
    assert symbolic and all(sz.ranges(p)["T"].high == 128 for p in symbolic)  # the model's own limit


@pytest.mark.slow
def test_a_size_outside_the_range_gets_a_plan_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = _llama(layers=1)
    eager = copy.deepcopy(model)
    wrapped = remat_ir.wrap(model, budget=0.6)
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    for batch_size, seq in [(2, 40), (3, 24), (1, 16)]:  # a batch of one is below every symbolic range
        batch = _batch(rng, g, batch_size, seq)
        wrapped(**batch).loss.backward()
        eager(**batch).loss.backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))
    # The batch of one got a plan of its own, symbolic in its sequence only.
    assert sorted(sorted(sz.ranges(r.program)) for r in remat_ir.planner(wrapped).plans.values()) == [["B", "T"], ["T"]]


@pytest.mark.slow
def test_dynamic_false_plans_each_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = _llama(layers=1)
    wrapped = remat_ir.wrap(model, budget=0.6, dynamic=False)
    rng, g = random.Random(2), torch.Generator().manual_seed(2)
    for seq in (20, 24):
        wrapped(**_batch(rng, g, 2, seq)).loss.backward()
    assert [r.symbolic for r in remat_ir.planner(wrapped).plans.values()] == [False, False]


@pytest.mark.slow
def test_max_shape_sets_the_range(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model = _llama(layers=1)
    wrapped = remat_ir.wrap(model, budget=0.6, max_shape={"input_ids": (8, 64)})
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    wrapped(**_batch(rng, g, 2, 20)).loss.backward()
    (runner,) = remat_ir.planner(wrapped).plans.values()
    ranges = sz.ranges(runner.program)
    assert (ranges["B"].high, ranges["T"].high) == (8, 64)
    wrapped(**_batch(rng, g, 8, 64)).loss.backward()
    assert remat_ir.planner(wrapped).solves == 1
    # The plan on disk is a symbolic .rir: canonical text, sound over its range, drawn at a size.
    from remat_ir.cli.commands import show_main
    from remat_ir.ir.parser import parse_program
    from remat_ir.ir.printer import format_program

    (path,) = tmp_path.glob("*.rir")
    text = path.read_text()
    assert "sizes B=2..8, T=2..64" in text and format_program(parse_program(text)) == text
    assert remat_ir.verify(remat_ir.load_plan(path)).ok
    assert show_main([str(path), "--size", "B=3,T=40"]) in (0, None)
    assert "at B=3, T=40" in capsys.readouterr().out



def test_a_bias_whose_size_is_b_times_t_here_fixes_no_size():
    """A linear layer's bias (d,) and its matmul's (B*T, d), compared as
    shapes by the trace's pointwise strides, are not a decision on the sizes
    when B*T == d at the traced call (Whisper's encoder: 2 x 32 frames, d=64):
    the plan has no guard `B*T == 8`, which would fix B and T to this call's."""
    from remat_ir.pipeline import trace
    from remat_ir.trace.calls import dynamic_dims, split_call

    class Proj(torch.nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.emb, self.proj = torch.nn.Embedding(16, d), torch.nn.Linear(d, d)

        def forward(self, input_ids):
            return self.proj(self.emb(input_ids)).sum()

    torch.manual_seed(0)
    model, ids = Proj(), torch.randint(0, 16, (2, 4))
    program = trace(model, (ids,), dynamic=dynamic_dims(split_call(model, (ids,))))
    assert program.header.sizes == ["B=2..2", "T=2..4"] and program.header.size_guards == []


# ------------------------------------------------------------ the language


def test_expressions_are_read_not_run():
    assert sz.evaluate("B*T+max(T,3)//2", {"B": 2, "T": 5}) == 12
    assert sz.condition_holds("T <= 128 and B*T != 4", {"B": 2, "T": 5})
    assert sz.size_text("2 * ( T - 1 )") == "2*(T-1)"
    for bad in ["__import__('os')", "T.real", "T**2", "[T]", "T if T else 1", "lambda: 1", "max(T)", "1.5"]:
        with pytest.raises(sz.SizeError):
            sz.evaluate(bad, {"T": 2})
    with pytest.raises(sz.SizeError, match="no size given for the symbol B"):
        sz.evaluate("B", {})


def test_bind_sizes_says_what_does_not_fit():
    shapes = [("ids", ["B", "T"], [2, 7]), ("mask", ["B", "T"], [2, 7]), ("x", ["B*T", 4], [14, 4])]
    assert sz.bind_sizes(shapes) == ({"B": 2, "T": 7}, "")
    _, why = sz.bind_sizes([("ids", ["B", "T"], [2, 7]), ("mask", ["B", "T"], [2, 8])])
    assert "T, which is 7 elsewhere" in why
    _, why = sz.bind_sizes([("x", ["B", 4], [2, 5])])
    assert "dimension 1 is 4 in the plan, got 5" in why


def test_instantiate_evaluates_every_size():
    values = [Value("x", "input", "float32", ["B", "T"], ["T", 1], "x", "4*B*T"),
              Value("y", "value", "float32", ["B*T"], [1], "x", 0)]
    node = Node("y", "aten.view.default", [Ref("x"), Seq([Sym("B*T")])], {}, ["y"], "forward")
    program = Program(header=Header(sizes=["B=2..4", "T=2..9"]), values=values, nodes=[node],
                      forward=[Instr("compute", "y")], backward=[], outputs=[Output("result", "0", "y")])
    at = sz.instantiate(program, {"B": 3, "T": 5})
    assert at.values[0].shape == [3, 5] and at.values[0].nbytes == 60 and at.values[1].shape == [15]
    assert at.nodes[0].args[1] == Seq([15]) and not at.header.sizes
    with pytest.raises(sz.SizeError, match="outside the plan's range"):
        sz.instantiate(program, {"B": 5, "T": 5})


@pytest.mark.slow
def test_trainer_with_a_padding_collator_trains_the_wrapped_model_as_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path / "cache"))
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast, Trainer, TrainingArguments

    vocab = {f"t{i}": i for i in range(127)} | {"[PAD]": 127}
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "t0")),
                                  pad_token="[PAD]")
    rng = random.Random(0)
    data = [{"input_ids": [rng.randrange(127) for _ in range(rng.randint(8, 40))]} for _ in range(16)]
    trained = {}
    for name in ("eager", "wrapped"):
        model = _llama(layers=1)
        model.config.pad_token_id = 127
        run = model if name == "eager" else remat_ir.wrap(model, budget=0.5)
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=4, per_device_train_batch_size=4,
                                 learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], save_strategy="no",
                                 dataloader_num_workers=0, disable_tqdm=True)
        # The collator pads each batch to its own longest sequence: four shapes in four steps.
        Trainer(model=run, args=args, train_dataset=data,
                data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).train()
        trained[name] = (model, run)
    (eager, _), (model, wrapped) = trained["eager"], trained["wrapped"]
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters()))
    assert remat_ir.planner(wrapped).solves == 1 and [r.symbolic for r in remat_ir.planner(wrapped).plans.values()] == [True]
