"""The adopted model is the user's model, to every library around it.

`remat_ir.wrap` adopts the model in place (`remat_ir.runtime.interpret.adopt`):
the same object, its class a same-named subclass, its state_dict keys, forward
signature and methods its own.  Checkpoints move between wrapped and unwrapped
runs with `strict=True`, transformers' Trainer resumes across them, peft's
`disable_adapter()` runs eagerly with a line saying so, a symbolic step prints
one cache key whatever traces came before, and processes sharing the cache
plan a step once.
"""
from __future__ import annotations

import copy
import inspect
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import remat_ir

ROOT = Path(__file__).resolve().parent.parent


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 4)

    def forward(self, x, scale: float = 1.0):
        return self.fc2(self.drop(torch.relu(self.fc1(x)))) * scale


def test_the_adopted_model_is_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = Net()
    keys, sig = list(model.state_dict()), inspect.signature(model.forward)
    eager = copy.deepcopy(model)
    w = remat_ir.wrap(model)
    assert w is model and isinstance(w, Net) and type(w).__name__ == "Net" and type(w).__module__ == Net.__module__
    assert list(w.state_dict()) == keys and inspect.signature(w.forward) == sig
    assert not hasattr(w, "module")  # (Trainer and accelerate unwrap whatever has one)
    x = torch.randn(4, 8)
    for m in (w, eager):
        torch.manual_seed(1)
        m(x).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(w.parameters(), eager.parameters()))
    assert len(remat_ir.planner(w).plans) == 1
    # A checkpoint of either loads into the other, strictly.
    eager.load_state_dict(w.state_dict(), strict=True)
    w.load_state_dict(Net().state_dict(), strict=True)
    # Copies come back adopted, each with its own planner over itself.
    for c in (copy.deepcopy(w), torch.load(io.BytesIO(_saved(w)), weights_only=False)):
        assert type(c) is type(w) and remat_ir.planner(c).module is c and remat_ir.planner(c) is not remat_ir.planner(w)
        c(x).sum().backward()
    # Wrapped again: the new options; unwrapped: the class it had.
    assert remat_ir.wrap(w, budget=0.9) is w and remat_ir.planner(w).options["budget"] == 0.9
    assert remat_ir.unwrap(w) is w and type(w) is Net and remat_ir.planner(w) is None
    with pytest.raises(TypeError, match=r"for a budget write wrap\(model, budget=5\)"):
        remat_ir.wrap(w, 5)
    with pytest.raises(TypeError, match="wrap\\(\\) takes a torch.nn.Module, not int"):
        remat_ir.wrap(3)


def _saved(m) -> bytes:
    buf = io.BytesIO()
    torch.save(m, buf)
    return buf.getvalue()


@pytest.mark.slow
def test_two_of_a_family_leave_one_cached_plan_each(tmp_path, monkeypatch):
    """A symbolic step prints its sizes in one canonical form (`B*T`, never
    `T*B`), whatever sympy's own symbol numbering after earlier traces."""
    transformers = pytest.importorskip("transformers")
    from remat_ir.models.families import FAMILIES

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    transformers.logging.set_verbosity_error()

    def gpt2(seed):
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0))

    files = []
    for make in (gpt2, lambda seed: FAMILIES["llama"](seed)[0]):
        for seed in (0, 1):
            model = remat_ir.wrap(make(seed))  # (a symbolic plan: batch and sequence are symbols)
            ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0))
            model(input_ids=ids, labels=ids).loss.backward()
            assert all(r.symbolic for r in remat_ir.planner(model).plans.values())
            files.append(sorted(p.name for p in tmp_path.glob("*.rir")))
    # The second of each family found the first one's plan: one file a family.
    assert [len(f) for f in files] == [1, 1, 2, 2] and files[0] == files[1] and files[2] == files[3], files


@pytest.mark.slow
def test_disable_adapter_runs_eagerly_with_a_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("peft")
    from remat_ir.models.families import FAMILIES

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    model, kwargs = FAMILIES["llama-lora"](0)
    eager = copy.deepcopy(model)
    w = remat_ir.wrap(model)

    def losses(m):
        out = []
        for i in range(3):
            torch.manual_seed(i)
            if i == 1:
                with m.disable_adapter():  # a reference pass, as DPO takes it
                    out.append(m(**kwargs).loss.detach())
            else:
                loss = m(**kwargs).loss
                loss.backward()
                out.append(loss.detach())
        return out

    assert all(torch.equal(a, b) for a, b in zip(losses(w), losses(eager)))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(w.parameters(), eager.parameters()) if p.requires_grad)
    assert "trains nothing" in capsys.readouterr().err


def test_accelerate_prepares_and_unwraps_the_adopted_model(tmp_path, monkeypatch):
    accelerate = pytest.importorskip("accelerate")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = remat_ir.wrap(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, opt = acc.prepare(model, opt)
    assert acc.unwrap_model(prepared) is model
    prepared(torch.randn(4, 8)).sum().backward()
    opt.step()
    acc.save_state(str(tmp_path / "state"))
    plain = Net()  # an unwrapped run resumes the wrapped one's state, and the reverse
    acc2 = accelerate.Accelerator(cpu=True)
    plain2, _ = acc2.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    acc2.load_state(str(tmp_path / "state"), strict=True)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))


_TRAIN = textwrap.dedent('''
    import json, sys, torch, transformers, remat_ir
    from peft import LoraConfig, get_peft_model
    transformers.logging.set_verbosity_error()
    out, wrapped, resume, stop = sys.argv[1], sys.argv[2] == "wrapped", sys.argv[3], int(sys.argv[4])
    class Interrupt(transformers.TrainerCallback):  # the run ends at `stop`, its schedule that of 10 steps
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= stop
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if wrapped:
        model = remat_ir.wrap(model, budget=0.6)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 96, (int(n),), generator=g).tolist()}
            for n in torch.randint(8, 24, (40,), generator=g)]
    def collate(rows):  # pads each batch to its own longest row
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows])
        mask = (ids != 0).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=10, per_device_train_batch_size=4, learning_rate=1e-2, seed=0,
        use_cpu=True, bf16=True, report_to="none", save_strategy="steps", save_steps=5, eval_strategy="steps",
        eval_steps=5, dataloader_num_workers=0, disable_tqdm=True, logging_steps=100,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8],
                                   data_collator=collate, callbacks=[Interrupt()])
    trainer.train(resume_from_checkpoint=None if resume == "-" else resume)
    metrics = trainer.evaluate()
    trainer.save_model(out + "/final")
    torch.save({n: p.detach() for n, p in model.named_parameters()}, out + "/weights.pt")
    json.dump({"eval_loss": metrics.get("eval_loss"), "class": type(model).__name__}, open(out + "/m.json", "w"))
''')


@pytest.mark.slow
def test_trainer_resumes_across_wrapped_and_unwrapped(tmp_path):
    """LoRA + bf16 + gradient checkpointing + a padding collator, checkpointed
    every 5 steps: a run resumed from step 5 in a new process, by an unwrapped
    model and by a wrapped one, ends with the uninterrupted run's weights; eval
    reports eval_loss; save_model() reloads with PeftModel.from_pretrained."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    import json

    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = dict(os.environ, REMAT_IR_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")

    def run(out, how, resume="-", stop=10):
        subprocess.run([sys.executable, str(script), str(tmp_path / out), how, resume, str(stop)], check=True,
                       env=env, cwd=ROOT, capture_output=True, timeout=600)
        return torch.load(tmp_path / out / "weights.pt"), json.loads((tmp_path / out / "m.json").read_text())

    whole, m = run("whole", "wrapped")
    assert m["eval_loss"] is not None
    for first, then in (("wrapped", "unwrapped"), ("unwrapped", "wrapped")):
        run(f"{first}-5", first, stop=5)
        w, m = run(f"{first}-5", then, resume=str(tmp_path / f"{first}-5" / "checkpoint-5"))
        assert m["eval_loss"] is not None
        assert all(torch.equal(whole[k], w[k]) for k in whole), (first, then)
    from peft import PeftModel
    import transformers

    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0))
    assert (tmp_path / "whole" / "final" / "adapter_config.json").exists()
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "whole" / "final"))
    lora = {k: v for k, v in whole.items() if "lora_" in k}
    got = dict(loaded.named_parameters())
    assert lora and all(torch.equal(got[k], v) for k, v in lora.items())


_RANK = textwrap.dedent('''
    import os, sys, time, torch, torch.distributed as dist, remat_ir
    from remat_ir.models import build_builtin
    rank = int(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=int(sys.argv[3]))
    module, (idx, targets) = build_builtin("gpt2-tiny", seed=0)
    model = remat_ir.wrap(module, budget=0.7, dynamic=False)
    t0 = time.perf_counter()
    model(idx, targets).backward()
    print("solves", remat_ir.planner(model).solves, "seconds", round(time.perf_counter() - t0, 1))
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_ranks_plan_a_step_once(tmp_path):
    """Two gloo ranks sharing the plan cache: one plans, the other waits for
    its plan (a lock on the cache entry) and runs it."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = dict(os.environ, REMAT_IR_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(init), "2"], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    solves = sorted(int(o.split()[1]) for o, _ in outs)
    assert solves == [0, 1], outs
    assert sum("another process is planning this step" in e for _, e in outs) == 1


def _sft(wrapped: bool):
    """Four SFTTrainer steps of a tiny Llama (a word-level tokenizer built in
    place, NEFTune's noise on the embeddings), wrapped at 0.95 or not; the model."""
    import transformers
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import SFTConfig, SFTTrainer

    vocab = {f"w{i}": i for i in range(96)} | {"<pad>": 96, "<eos>": 97}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 96, (int(n),), generator=g))
             for n in torch.randint(6, 20, (16,), generator=g)]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=98, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=96, eos_token_id=97))
    if wrapped:
        model = remat_ir.wrap(model, budget=0.95)
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, seed=0,
                         use_cpu=True, report_to="none", save_strategy="no", dataloader_num_workers=0,
                         disable_tqdm=True, logging_steps=100, max_length=32, neftune_noise_alpha=5.0)
        SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                   processing_class=tokenizer).train()
    return model


@pytest.mark.slow
def test_sft_trainer_runs_a_plan_as_eager(tmp_path, monkeypatch, capsys):
    """trl's SFTTrainer computes the loss with its own chunked LM head, which
    writes the head's gradient in place chunk by chunk (`mm(..., out=rows)`):
    the plan is traced from that forward (the adopted model's own) and hands
    the gradient to autograd after its last write, so the step runs by the
    plan, bitwise with eager's SFTTrainer.  NEFTune scales its noise by the
    padded length (`torch.tensor(T * d)`), which fixes the sizes: each length
    gets a plan of its own, said once."""
    pytest.importorskip("trl")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    wrapped, eager = _sft(True), _sft(False)
    assert all(torch.equal(p, q) for p, q in zip(wrapped.parameters(), eager.parameters()))
    err = capsys.readouterr().err
    assert remat_ir.planner(wrapped).solves >= 2 and "eagerly" not in err, err
    assert err.count("planning each size of such calls on its own") == 1, err


@pytest.mark.slow
def test_lightning_checkpoints_load_across_wrapped_and_unwrapped(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning.pytorch")
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path / "cache"))

    class Module(L.LightningModule):
        def __init__(self, wrapped: bool = False):
            super().__init__()
            self.wrapped = wrapped
            torch.manual_seed(0)
            self.net = Net()

        def configure_model(self):  # Lightning's hook for setting the model up
            if self.wrapped:
                remat_ir.wrap(self.net)

        def training_step(self, batch, _):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    kw = dict(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, default_root_dir=str(tmp_path))
    runs = {}
    for wrapped in (True, False):
        m = Module(wrapped)
        trainer = L.Trainer(**kw)
        torch.manual_seed(1)
        trainer.fit(m, data)
        trainer.save_checkpoint(tmp_path / f"{wrapped}.ckpt")
        runs[wrapped] = m
    assert type(runs[True].net) is not Net and isinstance(runs[True].net, Net)  # adopted, and trained by its plan
    assert remat_ir.planner(runs[True].net).plans
    assert all(torch.equal(p, q) for p, q in zip(runs[True].parameters(), runs[False].parameters()))
    for written in (True, False):
        loaded = Module.load_from_checkpoint(tmp_path / f"{written}.ckpt", wrapped=not written, strict=True)
        assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), runs[written].parameters()))


class _RowsHead(torch.autograd.Function):
    """A chunked LM-head loss as trl's SFTTrainer computes it: backward
    allocates the weight's gradient and fills it chunk by chunk in place
    (`mm(..., out=rows)`), so the gradient is written after the instruction
    that computes it."""

    @staticmethod
    def forward(ctx, h, w, labels):
        ctx.save_for_backward(h, w, labels)
        return torch.nn.functional.cross_entropy(h @ w.t(), labels)

    @staticmethod
    def backward(ctx, g):
        h, w, labels = ctx.saved_tensors
        p = torch.softmax(h @ w.t(), -1)
        p[torch.arange(len(labels)), labels] -= 1
        p = p * (g / len(labels))
        gw = torch.zeros_like(w)
        for v in range(0, w.shape[0], 8):
            torch.mm(p[:, v:v + 8].t(), h, out=gw[v:v + 8])
        return p @ w, gw, None


class _Chunked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 24, bias=False)

    def forward(self, x, labels):
        return _RowsHead.apply(self.body(x), self.head.weight, labels)


@pytest.mark.parametrize("budget", [None, "floor"])
def test_a_gradient_written_in_place_after_it_is_made_runs_by_the_plan(budget):
    """The gradient goes to autograd after the last write to its storage
    (`remat_ir.ir.hand_overs`): the plan verifies, runs bitwise with eager
    and peaks where the simulator says."""
    from remat_ir.pipeline import fit
    from remat_ir.runtime.load import LoadedModel
    from remat_ir.runtime.run import run_plan

    torch.manual_seed(0)
    model = _Chunked()
    inputs = (torch.randn(12, 16), torch.randint(0, 24, (12,)))
    program = remat_ir.compile(copy.deepcopy(model), inputs)
    writes = [n for n in program.nodes if n.phase == "backward" and n.mutates]
    assert len(writes) == 3  # one per chunk of rows
    plan = program if budget is None else fit(program, budget)
    assert remat_ir.verify(plan)
    r = run_plan(plan, LoadedModel(name="chunked", module=copy.deepcopy(model), inputs=inputs, loss=None),
                 steps=2, check=True)
    assert r.measured_first_peak - r.predicted_first.peak_bytes <= 4
    assert r.measured_peak - r.predicted.peak_bytes <= 4
    wrapped, eager = remat_ir.wrap(copy.deepcopy(model), plan), copy.deepcopy(model)
    for m in (wrapped, eager):
        m(*inputs).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(wrapped.parameters(), eager.parameters()))
