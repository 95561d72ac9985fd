"""A narrow GPT for remat-bench's torch.compile rows (docs/13-torch-compile.md).

4 layers, d=64, 4 heads, vocab 64, dropout 0.1, batch 16 x sequence 64: the
GPT of tests/test_backend.py.  Narrow and with a small vocabulary, so that
activations rather than the gradients a compiled backward holds until its
end set the floor of the compiled region, and budgets 0.7, 0.5 and 0.3 are
all feasible under `remat_ir.backend`.

    remat-bench --model examples/gpt_narrow.py --methods compile,backend
"""
import torch

from remat_ir.models.gpt import GPT, GPTConfig


def build(batch: int = 16, seq: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    module = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=64, block_size=max(seq, 64), dropout=0.1))
    module.train()
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, 64, (batch, seq), generator=gen)
    targets = torch.randint(0, 64, (batch, seq), generator=gen)
    return module, (idx, targets)
