"""transformers' Trainer on a remat-ir-wrapped GPT-2: one line added.

    python examples/trainer_gpt2.py [--steps 3] [--budget 0.6] [--eager]

A 2-layer GPT-2 (d=64, vocab 256) trains on random token sequences for a few
steps.  `remat_ir.wrap(model, budget=...)` plans the training step at the
first call (the plan is cached: a second run starts without planning); the
rest is plain Trainer.  `--eager` trains the unwrapped model, for comparison.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import remat_ir


def build_model(seed: int = 0, dropout: float = 0.1) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=0, eos_token_id=0,  # the defaults (50256) lie outside this vocab
        attn_implementation="eager",  # attention dropout as an explicit op a plan can replay
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # else transformers warns that loss_type=None is unrecognized
    return model


class RandomTokens(torch.utils.data.Dataset):
    """`n` sequences of `seq` random tokens; a causal LM's labels are its inputs."""

    def __init__(self, n: int = 64, seq: int = 32, vocab: int = 256, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train(steps: int = 3, budget=0.6, *, eager: bool = False, batch: int = 2, output_dir: str | None = None,
          seed: int = 0) -> GPT2LMHeadModel:
    """Train for `steps` steps; returns the (unwrapped) model."""
    model = build_model(seed)
    wrapped = model if eager else remat_ir.wrap(model, budget=budget)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=output_dir or tmp, max_steps=steps, per_device_train_batch_size=batch,
            learning_rate=1e-3, seed=seed, use_cpu=True, report_to=[], save_strategy="no",
            logging_steps=1, dataloader_num_workers=0, disable_tqdm=True,
        )
        Trainer(model=wrapped, args=args, train_dataset=RandomTokens(seed=seed)).train()
    return model


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", default="0.6",
                    help="a fraction of the activation peak (0.6, 60%%), a size (800KB) or floor; default 0.6")
    ap.add_argument("--eager", action="store_true", help="train the model unwrapped")
    a = ap.parse_args()
    train(a.steps, a.budget, eager=a.eager)
