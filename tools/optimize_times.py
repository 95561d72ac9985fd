"""The optimizer's own time on the models and budgets it is held to, against
the targets, as a markdown table.

    .venv/bin/python tools/optimize_times.py [--only gpt2-tiny,mlp] [--repeat 2]

Each model is traced once (fake tensors where it is large); each row then
times a fresh planner (the graph's analysis) and `optimize`, cold, and prints the plan's extra
compute, the search mode, and a short hash of the plan text.  With
`--repeat N` every row is solved N times and the hashes must agree: a plan
depends on the program, the budget and the options only (every MILP stops
at a node limit or its gap, never at a time).  Budgets are fractions of the
unoptimized activation peak.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from remat_ir.ir.printer import format_program
from remat_ir.optimize.search import Planner, optimize, resolve_budget
from remat_ir.optimize.pareto import sweep
from remat_ir.pipeline import trace
from remat_ir.runtime.load import load_model

ROOT = Path(__file__).resolve().parents[1]
SCOPE = "activations"


def builtin(name, **kw):
    def make():
        m = load_model(name, fake=kw.get("fake", False), batch=kw.get("batch"), seq=kw.get("seq"))
        return trace(m.module, m.inputs, loss=m.loss, name=m.name, fake=kw.get("fake", False))
    return make


def model_file(path):
    def make():
        m = load_model(str(ROOT / path))
        return trace(m.module, m.inputs, loss=m.loss, name=m.name)
    return make


def llama3():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=1000, max_position_embeddings=64,
                      attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    return trace(model, (), {"input_ids": ids, "labels": ids}, name="transformers Llama, 3 layers")


def encoder_decoder(kind: str, layers: int):
    """A transformers T5 or BART with `layers` encoder and decoder layers
    (d=128), traced under fake tensors for a batch of 4 x 64 (labels 32)."""
    def make():
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            if kind == "t5":
                from transformers import T5Config, T5ForConditionalGeneration

                model = T5ForConditionalGeneration(T5Config(
                    vocab_size=1000, d_model=128, d_ff=256, d_kv=32, num_layers=layers,
                    num_decoder_layers=layers, num_heads=4, decoder_start_token_id=0, pad_token_id=0))
            else:
                from transformers import BartConfig, BartForConditionalGeneration

                model = BartForConditionalGeneration(BartConfig(
                    vocab_size=1000, d_model=128, encoder_layers=layers, decoder_layers=layers,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                    decoder_ffn_dim=256, max_position_embeddings=128, pad_token_id=1, bos_token_id=0,
                    eos_token_id=2, decoder_start_token_id=2))
            model.train()
            call = {"input_ids": torch.randint(0, 1000, (4, 64)), "attention_mask": torch.ones(4, 64, dtype=torch.long),
                    "labels": torch.randint(0, 1000, (4, 32))}
        return trace(model, (), call, name=f"transformers {kind} {layers}+{layers}", fake=True)
    return make


def llama_70b_shapes(layers: int):
    """Llama-2-70B's shapes (d=8192, GQA 64/8 heads, FFN 28672) with `layers`
    layers, fake, one sequence of 4096."""
    def make():
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from transformers import LlamaConfig, LlamaForCausalLM

        with FakeTensorMode():
            model = LlamaForCausalLM(LlamaConfig(
                hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096))
            model.train()
            ids = torch.randint(0, 32000, (1, 4096))
        return trace(model, (), {"input_ids": ids, "labels": ids}, name=f"Llama-2-70B shapes, {layers} layers",
                     fake=True)
    return make


# (label, program maker, budgets, target seconds per budget)
CASES = [
    ("gpt2-tiny", builtin("gpt2-tiny", fake=True), (0.7, 0.5), 2.0),
    ("mlp", builtin("mlp"), (0.8,), 2.0),
    ("transformers GPT-2, 2 layers", model_file("examples/hf_gpt2.py"), (0.7,), 2.0),
    ("transformers Llama, 3 layers", llama3, (0.7,), 2.0),
    ("gpt2-mid8", builtin("gpt2-mid8", fake=True), (0.5,), 5.0),
    ("GPT-2 medium 4x512 (fake)", builtin("gpt2-medium", fake=True, batch=4, seq=512), (0.5, 0.3), 8.0),
    # Encoder-decoders and a deep model (the optimizer issue's targets).
    ("T5 3+3 (fake)", encoder_decoder("t5", 3), (0.7, 0.5, 0.3), 10.0),
    ("BART 3+3 (fake)", encoder_decoder("bart", 3), (0.7, 0.5, 0.3), 10.0),
    ("T5 12+12 (fake)", encoder_decoder("t5", 12), (0.5,), 10.0),
    ("BART 12+12 (fake)", encoder_decoder("bart", 12), (0.5,), 10.0),
    ("Llama-2-70B shapes, 8 layers (fake)", llama_70b_shapes(8), (0.3,), 15.0),
    ("Llama-2-70B shapes, 32 layers (fake)", llama_70b_shapes(32), (0.3,), 15.0),
    ("Llama-2-70B shapes, 80 layers (fake)", llama_70b_shapes(80), (0.3,), 15.0),
]


def digest(program) -> str:
    return hashlib.sha256(format_program(program).encode()).hexdigest()[:10]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated labels (prefixes) to run")
    ap.add_argument("--repeat", type=int, default=1, help="solves per row (the plan hashes must agree)")
    ap.add_argument("--no-pareto", action="store_true", help="skip the gpt2-tiny --pareto row")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    print("| model | decisions | budget | optimize time | target | extra compute | search | plan |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for label, make, fracs, target in CASES:
        if only and not any(label.startswith(o) for o in only):
            continue
        program = make()
        for frac in fracs:
            budget = resolve_budget(program, frac, SCOPE)
            times, hashes = [], set()
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                pl = Planner(program, SCOPE)  # the graph's analysis counts: a CLI run does it too
                r = optimize(program, budget, SCOPE, planner=pl)
                times.append(time.perf_counter() - t0)
                hashes.add(digest(r.program))
            t = min(times)
            same = "" if len(hashes) == 1 else f" ({len(hashes)} different plans!)"
            ok = ok and len(hashes) == 1
            print(f"| {label} | {len(pl.all_dec)} | {frac} | {t:.1f} s{' ' if t <= target else ' (over)'} "
                  f"| {target:g} s | {r.overhead:.3%} | {r.mode} | {next(iter(hashes))}{same} |", flush=True)
    if not args.no_pareto and (not only or any("gpt2-tiny".startswith(o) or o == "pareto" for o in only)):
        program = builtin("gpt2-tiny", fake=True)()
        t0 = time.perf_counter()
        rows = sweep(program, SCOPE, points=8)
        t = time.perf_counter() - t0
        print(f"| gpt2-tiny --pareto, {len(rows)} points | - | whole sweep | {t:.1f} s"
              f"{'' if t <= 10 else ' (over)'} | 10 s | - | - | - |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
