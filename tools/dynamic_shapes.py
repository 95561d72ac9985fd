"""Training with a batch shape per step: one symbolic plan against eager.

    python tools/dynamic_shapes.py [--steps 20] [--layers 4] [--trainer-steps 12]

Table 1: a small transformers Llama trained with AdamW on batches padded to
their own longest sequence (lengths 32-128, batch 2 or 4, as a collator pads
them), wrapped with `remat_ir.wrap(model, budget=0.5)`: per step the sizes,
eager's and the wrapped step's time, the optimizer runs so far, the
predicted and measured peak (measured in a second, untimed run of the same
step under the storage tracker), and whether the parameters are still
eager's bit for bit.  Table 2: transformers' Trainer with
DataCollatorForLanguageModeling (padding to the longest sequence of each
batch), the wrapped model against the model itself.
"""
from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time

import torch

import remat_ir
from remat_ir.check.simulate import simulate
from remat_ir.cli.measure import pre_existing
from remat_ir.runtime.memtrack import measure_step

MiB = 2 ** 20


def llama(layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128))


def padded_batch(rng: random.Random, g: torch.Generator, batch: int, seq: int) -> dict:
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, rng.randint(seq // 2, seq):] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loop_table(steps: int, layers: int) -> None:
    model = llama(layers)
    eager = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as cache:
        import os

        os.environ["REMAT_IR_CACHE"] = cache  # a cold start: the first step plans
        wrapped = remat_ir.wrap(model, budget=0.5)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3)
        rng, g = random.Random(0), torch.Generator().manual_seed(0)
        print("| step | batch x seq | eager s | wrapped s | optimizer runs | predicted MiB | measured MiB | bitwise |")
        print("|---|---|---|---|---|---|---|---|")
        over = []
        for step in range(steps):
            batch = padded_batch(rng, g, rng.choice([2, 4]), rng.randint(32, 128))
            t0 = time.perf_counter()
            eager(**batch).loss.backward()
            t_eager = time.perf_counter() - t0
            t0 = time.perf_counter()
            wrapped(**batch).loss.backward()
            t_wrapped = time.perf_counter() - t0
            # The peak of the same step, measured (untimed) with the gradients as they now are.
            state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            params = list(model.parameters())
            pre = pre_existing(model, list(batch.values()), state)
            measured = measure_step(lambda: wrapped(**batch).loss.backward(), pre_existing=pre)
            for p in params:  # the measured run's gradients were added on top: drop them
                p.grad.div_(2)
            plan = remat_ir.planner(wrapped).plan_of(**batch)
            predicted = simulate(plan, grads_present=True,
                                 optim_state_bytes=sum(t.untyped_storage().nbytes() for t in state))
            opt.step()
            opt.zero_grad()
            opt_eager.step()
            opt_eager.zero_grad()
            same = all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
            if step:
                over.append(t_wrapped - (3 * t_eager + 0.05))
            print(f"| {step} | {batch['input_ids'].shape[0]} x {batch['input_ids'].shape[1]} | {t_eager:.3f} | "
                  f"{t_wrapped:.3f} | {remat_ir.planner(wrapped).solves} | {predicted.peak_bytes / MiB:.3f} | "
                  f"{measured.peak_bytes / MiB:.3f} | {'yes' if same else 'NO'} |")
        print(f"\nsteps after the first over 3 x eager + 50 ms: {sum(x > 0 for x in over)} of {len(over)} "
              f"(largest margin {max(over):+.3f} s); optimizer runs: {remat_ir.planner(wrapped).solves}\n")


def trainer_table(steps: int) -> None:
    from tokenizers import Tokenizer, models
    from transformers import (DataCollatorForLanguageModeling, PreTrainedTokenizerFast, Trainer,
                              TrainingArguments)

    vocab = {f"t{i}": i for i in range(127)} | {"[PAD]": 127}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  pad_token="[PAD]")
    rng = random.Random(0)
    data = [{"input_ids": [rng.randrange(127) for _ in range(rng.randint(32, 128))]} for _ in range(steps * 4)]
    collator = DataCollatorForLanguageModeling(tok, mlm=False)  # pads each batch to its longest
    rows = []
    models_ = {}
    for name in ("eager", "wrapped"):
        model = llama(2)
        model.config.pad_token_id = 127
        run = model if name == "eager" else remat_ir.wrap(model, budget=0.5)
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, max_steps=steps, per_device_train_batch_size=4,
                                     learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], save_strategy="no",
                                     dataloader_num_workers=0, disable_tqdm=True, logging_steps=10 ** 6)
            t0 = time.perf_counter()
            Trainer(model=run, args=args, train_dataset=data, data_collator=collator).train()
            rows.append((name, time.perf_counter() - t0, getattr(run, "solves", "-")))
        models_[name] = model
    same = all(torch.equal(a, b) for a, b in zip(models_["eager"].parameters(), models_["wrapped"].parameters()))
    print("| Trainer, padding collator | wall s | optimizer runs |")
    print("|---|---|---|")
    for name, secs, solves in rows:
        print(f"| {name} | {secs:.1f} | {solves} |")
    print(f"\nparameters bitwise equal after {steps} steps: {'yes' if same else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trainer-steps", type=int, default=12)
    a = ap.parse_args()
    loop_table(a.steps, a.layers)
    if a.trainer_steps:
        trainer_table(a.trainer_steps)


if __name__ == "__main__":
    main()
