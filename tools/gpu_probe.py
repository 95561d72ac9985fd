"""GPU probe: the device facts remat-ir's plans rely on, measured in seconds.

    python tools/gpu_probe.py                      # on a CUDA machine
    python tools/gpu_probe.py --device cpu         # the same questions on CPU
    python tools/gpu_probe.py --md probe.md --json probe.json

Each row is a yes/no question with the evidence:

* eager reproducibility: a training step of built-in models (gpt2-tiny, mlp;
  `--model` adds one) run twice at one seed gives bitwise equal gradients.
  Where it does, gpu_check fails a plan whose gradients differ from eager's.
* dropout replay: `native_dropout` after restoring the generator state (what
  the interpreter does before recomputing a random op) draws the same mask.
* fused cross-entropy backward: `remat.nll_log_softmax_backward` (writes the
  second kernel's result over the first's) gives the same bits as the two
  kernels run apart, for GPT-2's logits shape, each reduction, fp32 and
  bf16, with ignored targets.  The tracer fuses the pair only on a device
  where this holds (`remat_ir.trace.device.FUSIONS`).
* one-byte dropout draw: `remat.dropout_keep` + `remat.dropout_scale` give
  the mask of eager's in-place `bernoulli_` chain (CPU's dropout).
* SDPA: which kernel a trace on this device records for fp32 attention.

Settings (torch, CUDA, cuDNN, TF32, float32 matmul precision) are recorded.
Exit code 0 (the answers are data, not a verdict), 2 on bad input.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from remat_ir.cli.bench_output import write_table
from remat_ir.cli.measure import compare_grads, device_settings, first_step


def eager_reproducible(name: str, dev: torch.device, seed: int = 0) -> tuple[bool, str]:
    from remat_ir.runtime.load import load_model

    m = load_model(name, device=dev.type, seed=seed)
    module = m.module.to(dev).train()
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in m.inputs)

    def step():
        out = module(*inputs)
        (m.loss(out, *inputs) if m.loss is not None else out).backward()

    a, _ = first_step(module, step, seed, dev)
    b, _ = first_step(module, step, seed, dev)
    equal, diff = compare_grads(a, b)
    return equal, "bitwise equal" if equal else f"max diff {diff:.3g}"


def dropout_replay(dev: torch.device) -> tuple[bool, str]:
    get = (lambda: torch.cuda.get_rng_state(dev)) if dev.type == "cuda" else torch.get_rng_state
    put = (lambda s: torch.cuda.set_rng_state(s, dev)) if dev.type == "cuda" else torch.set_rng_state
    x = torch.randn(4, 512, 1024, device=dev)
    torch.manual_seed(0)
    state = get()
    out1, mask1 = torch.ops.aten.native_dropout(x, 0.1, True)
    out_next, _ = torch.ops.aten.native_dropout(x, 0.1, True)
    saved = get()
    put(state)
    out2, mask2 = torch.ops.aten.native_dropout(x, 0.1, True)
    put(saved)
    out_next2, _ = torch.ops.aten.native_dropout(x, 0.1, True)
    same = torch.equal(mask1, mask2) and torch.equal(out1, out2)
    stream_moves = not torch.equal(out_next, out_next2)
    return same, f"replayed mask {'equal' if same else 'DIFFERS'}; the stream after the replay {'moves on' if stream_moves else 'repeats'}"


def fused_cross_entropy(dev: torch.device, n: int, vocab: int) -> list[tuple[str, bool, str]]:
    from remat_ir.ir.ops import nll_log_softmax_backward

    aten = torch.ops.aten
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(n, vocab, device=dev, generator=gen).to(dtype)
        target = torch.randint(0, vocab, (n,), device=dev, generator=gen)
        target[::7] = -100
        logp = aten._log_softmax(logits, 1, False)
        for reduction in (0, 1, 2):  # none, mean, sum
            out, total = aten.nll_loss_forward(logp, target, None, reduction, -100)
            g_out = torch.ones_like(out) if reduction == 0 else torch.ones((), dtype=dtype, device=dev)
            g1 = aten.nll_loss_backward(g_out, logp, target, None, reduction, -100, total)
            apart = aten._log_softmax_backward_data(g1, logp, 1, dtype)
            fused = nll_log_softmax_backward(g_out, logp, target, None, reduction, -100, total, logp, 1, dtype)
            equal = torch.equal(apart, fused)
            diff = "" if equal else f"max diff {(apart.double() - fused.double()).abs().max().item():.3g}"
            name = f"fused cross-entropy backward, {str(dtype).removeprefix('torch.')} [{n}, {vocab}], " \
                   f"reduction {('none', 'mean', 'sum')[reduction]}"
            rows.append((name, equal, "bitwise equal" if equal else diff))
    return rows


def one_byte_dropout(dev: torch.device) -> tuple[bool, str]:
    from remat_ir.ir.ops import dropout_keep, dropout_scale

    x = torch.randn(4, 512, 1024, device=dev)
    torch.manual_seed(0)
    eager = torch.empty_like(x).bernoulli_(0.9).div_(0.9)
    torch.manual_seed(0)
    mine = dropout_scale(dropout_keep(x, 0.9), 0.9, x.dtype)
    equal = torch.equal(eager, mine)
    return equal, "same mask" if equal else "different mask: the tracer must not fuse dropout on this device"


def sdpa_kernel(dev: torch.device) -> tuple[bool, str]:
    """The SDPA op a trace on `dev` records for fp32 causal attention with dropout."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)

    try:
        with FakeTensorMode():
            q = torch.empty(4, 16, 512, 64, device=dev)
            gm = make_fx(f)(q)
    except Exception as e:  # noqa: BLE001 - a CPU-only build cannot trace CUDA
        return False, f"could not trace: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ops = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)})
    return True, ", ".join(ops) or "math decomposition (no fused attention op)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", action="append", default=[], help="also check this built-in model's eager "
                                                                  "reproducibility (repeatable)")
    ap.add_argument("--small", action="store_true", help="smaller cross-entropy shapes (a quick CPU run)")
    ap.add_argument("--md", help="also write the Markdown table here")
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_probe: error: no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    rows: list[tuple[str, bool, str]] = []

    def ask(name, fn):
        t = time.perf_counter()
        try:
            ok, why = fn()
        except Exception as e:  # noqa: BLE001 - one question failing must not sink the rest
            ok, why = False, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append((name, ok, why))
        print(f"{name}: {'yes' if ok else 'no'} ({why}) [{time.perf_counter() - t:.1f} s]", file=sys.stderr,
              flush=True)

    for name in ["gpt2-tiny", "mlp"] + args.model:
        ask(f"eager step reproducible at one seed: {name}", lambda name=name: eager_reproducible(name, dev))
    ask("native_dropout replays after restoring the RNG state", lambda: dropout_replay(dev))
    n, vocab = (256, 1000) if args.small else (2048, 50257)
    t = time.perf_counter()
    try:
        for r in fused_cross_entropy(dev, n, vocab):
            rows.append(r)
            print(f"{r[0]}: {'yes' if r[1] else 'no'} ({r[2]})", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001
        rows.append(("fused cross-entropy backward", False, f"failed: {type(e).__name__}: {e}"))
    print(f"  [{time.perf_counter() - t:.1f} s]", file=sys.stderr)
    ask("one-byte dropout draw gives eager's in-place bernoulli_ mask", lambda: one_byte_dropout(dev))
    ask("SDPA traced on this device", lambda: sdpa_kernel(dev))

    env = device_settings(dev)
    lines = [f"## gpu_probe: {dev.type} ({env.get('device_name')}), torch {torch.__version__}", "",
             "| question | answer | evidence |", "|---|---|---|"]
    lines += [f"| {q} | {'yes' if ok else 'no'} | {why} |" for q, ok, why in rows]
    lines += ["", "- settings: " + ", ".join(f"{k} {v}" for k, v in env.items() if k != "device"),
              f"- wall time {time.perf_counter() - t0:.0f} s"]
    md = "\n".join(lines) + "\n"
    write_table(md, args.md, {"settings": env, "rows": [
        {"question": q, "answer": ok, "evidence": why} for q, ok, why in rows]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
