"""A model file for the remat-ir CLI: a 2-layer transformers GPT-2.

The CLI imports this file and calls ``build()``, which returns
``(module, example_inputs)``; ``module(*example_inputs)`` is the scalar
training loss.  Eager attention is requested so attention dropout is an
explicit, replayable op (SDPA fuses it).
"""
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel


class GPT2WithLoss(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.model = GPT2LMHeadModel(config)
        self.model.loss_type = "ForCausalLM"  # else transformers warns "loss_type=None ... unrecognized"

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(batch: int = 2, seq: int = 64, seed: int = 0):
    config = GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=64,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        bos_token_id=1023, eos_token_id=1023,  # defaults (50256) lie outside this vocab
        attn_implementation="eager",  # transformers 5: a config kwarg, sets config._attn_implementation
    )
    torch.manual_seed(seed)
    module = GPT2WithLoss(config)
    module.train()
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    # Labels equal to the inputs: GPT2LMHeadModel shifts them internally.
    labels = input_ids.clone()
    return module, (input_ids, labels)


if __name__ == "__main__":
    m, inputs = build()
    print(m.model.config._attn_implementation, m(*inputs).item())
