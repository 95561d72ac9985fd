"""remat-bench: remat-ir next to its peers, measured side by side in one run.

    remat-bench [--model gpt2-mid] [--batch 4] [--seq 128] [--device cpu] [--steps 5]
                [--methods eager,ckpt,sac,compile,remat] [--md FILE] [--png FILE]

Every method trains the same model (same initial weights, same inputs, same
seeds, dropout on) and is measured the same way:

* memory: the *second* step (``.grad`` present) of each method, measured with
  `remat_ir.runtime.memtrack.measure_step` (CPU: the storage-tracking dispatch mode;
  CUDA: ``torch.cuda.max_memory_allocated``).  "activations" is the peak above
  what exists before the step: parameters, buffers, inputs, gradients and
  optimizer state (the totals include these, counted for the method's own
  model only);
* step time: the median over ``--steps`` rounds; each round runs one step of
  every method, in an order rotated from round to round so drift on a busy
  machine hits all methods alike; "vs eager" is the median over rounds of the
  step time / eager's in the same round; on CPU one intra-op thread unless
  ``--threads`` says otherwise (steady under load, see --help);
* gradients: after a first step from ``.grad = None`` with the same seed as an
  eager reference step, compared bitwise (else the max absolute difference);
* compile/solve time: torch.compile's first-step cost above its median step,
  remat-ir's MILP solve time (the trace, shared by all budgets, is noted once).

Methods (``--methods`` takes keys or key prefixes, comma separated; eager, the
reference, always runs; without ``--methods`` all but the offload methods):

    eager          plain PyTorch
    ckpt-all       torch.utils.checkpoint (use_reentrant=False) around every block
    ckpt-every2    ... around every second block
    sac-matmul     selective activation checkpointing per block, saving mm/addmm/bmm outputs
    compile-B      torch.compile(backend="aot_eager") with activation_memory_budget B
    backend-B      torch.compile(backend=remat_ir.backend(B, inner="aot_eager")): remat-ir's plan
                   of each compiled region at B x its unoptimized activation peak
    remat-plan     remat-ir's unoptimized plan (the interpreter alone)
    remat-B        remat-ir optimized at B x the unoptimized activation peak
    remat-floor    remat-ir at the smallest activation budget it can meet
    offload-B      remat-ir at B, activations also offloaded to host memory where
                   recomputation alone cannot meet B (its recompute-only plan where it can)
    save-on-cpu    the eager step inside torch.autograd.graph.save_on_cpu (every saved
                   tensor copied to the host and back for backward)

The offload rows add a host-peak column: the most host memory the step held
for activations, measured (CPU: the storage tracker's host pool; CUDA: the
pinned bytes in use, `memtrack.HOST_BYTES`), and for remat-ir predicted
(`remat_ir.cli.methods.CountedSaveOnCpu`: how save_on_cpu's copies are counted).

Blocks are ``model.transformer.h`` (also found one level down, e.g.
``model.model.transformer.h`` for transformers' GPT-2), else the longest
``nn.ModuleList`` in the model.  transformers models are checkpointed through
their own ``gradient_checkpointing_enable`` (with the same checkpoint
function and arguments), which also turns their KV cache off.

This module is the command (its options, and the wiring); the methods are
`remat_ir.cli.methods`, the measurement `remat_ir.cli.measure`, the table,
JSON and plot `remat_ir.cli.bench_output`.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from remat_ir.cli.bench_output import markdown, pareto_png, write_json
from remat_ir.cli.errors import EXIT_FAIL, EXIT_OK, CliError, run_cli
from remat_ir.cli.measure import Context, Prepared, Row, eager_reference, measure, time_rounds
from remat_ir.cli.methods import method_specs, select
from remat_ir.cli.outputs import check_outputs, model_file
from remat_ir.ir.budgets import DEFAULT_TIME_LIMIT
from remat_ir.ir.files import write_atomically
from remat_ir.ir.syntax import clip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remat-bench", description=__doc__.split("\n\n")[0],
                                epilog="methods: eager, ckpt-all, ckpt-every2, sac-matmul, compile-B, "
                                       "backend-B, remat-plan, remat-B, remat-floor; named only: offload-B, "
                                       "save-on-cpu",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-mid", help="built-in name or .py model file (default gpt2-mid)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5, help="timed rounds (median; default 5)")
    p.add_argument("--methods", help="comma-separated method keys or prefixes (eager always runs)")
    p.add_argument("--budgets", default="0.7,0.5,0.3",
                   help="activation budgets for torch.compile, remat-ir and its backend (default 0.7,0.5,0.3)")
    p.add_argument("--optimizer", default="adam", choices=["none", "sgd", "adam"],
                   help="optimizer state allocated (and counted in the totals); default adam")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                   help=f"optimizer safety stop per search (s; default {DEFAULT_TIME_LIMIT:g})")
    p.add_argument("--cost", default="flops", choices=["flops", "profile"],
                   help="what remat-ir's optimizer minimizes: recomputed FLOPs (default), or recomputed op "
                        "time, each op timed on the device first (as remat-compile --cost profile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads; default on CPU 1: on a shared 2-core machine two intra-op "
                        "threads ran 5-8x slower and scattered whenever anything else was running (OpenMP "
                        "oversubscription), one thread stayed steady; on CUDA torch's default")
    p.add_argument("--md", help="also write the Markdown table to this file")
    p.add_argument("--png", help="write the Pareto plot (activation peak vs step-time ratio) here (.png, .pdf, "
                                    ".svg, ...)")
    p.add_argument("--json", help="also write every row's figures as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def default_args(**overrides) -> argparse.Namespace:
    """remat-bench's options with its defaults, for scripts that build a
    `Context` themselves; unknown option names are refused."""
    args = build_parser().parse_args([])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise TypeError(f"remat-bench has no option {k!r}")
        setattr(args, k, v)
    return args


def apply_threads(args) -> None:
    """Set torch's intra-op threads as remat-bench does (`--threads` help)."""
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)


def main(argv=None) -> int:
    threads = torch.get_num_threads()
    try:
        return run_cli("remat-bench", _main, argv)
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) get theirs back


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    # Before any work: a bench run takes minutes, and must not write over its model file.
    check_outputs([("--md", args.md), ("--json", args.json), ("--png", args.png)],
                  [("the model file", model_file(args.model))], images=["--png"])
    try:
        budgets = []
        for b in (b for b in args.budgets.split(",") if b.strip()):
            try:
                budgets.append(float(b))
            except ValueError:
                raise ValueError(f"--budgets {clip(args.budgets)}: {clip(repr(b.strip()))} is no number; "
                                 "write fractions of the unoptimized peak, 0.7,0.5,0.3") from None
            if not (0 < budgets[-1] <= 1):
                raise ValueError(f"--budgets {clip(args.budgets)}: {clip(b.strip())} is not a fraction in (0, 1]")
        if not budgets:
            raise ValueError("--budgets names no budget; write fractions of the unoptimized peak, 0.7,0.5,0.3")
        specs = select(method_specs(budgets), args.methods)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but no CUDA device is available")
        if args.steps < 1:
            raise ValueError("--steps must be at least 1")
        if not (math.isfinite(args.time_limit) and args.time_limit > 0):
            raise ValueError(f"--time-limit must be a positive, finite number of seconds, not {args.time_limit:g}")
        apply_threads(args)
        t_start = time.perf_counter()
        ctx = Context(args)
    except Exception as e:  # noqa: BLE001 - bad input: one line
        raise CliError(str(e)) from e

    log(f"remat-bench: {ctx.name} on {args.device}, {len(specs)} methods")
    if any(s.family == "compile" for s in specs):
        import torch._dynamo as dynamo

        dynamo.reset()
    # The reference: eager's gradients after a first step from .grad = None.
    try:
        ref = eager_reference(ctx)
    except Exception as e:  # noqa: BLE001
        raise CliError(f"the eager step fails: {type(e).__name__}: {e}", EXIT_FAIL) from e
    rows: list[Row] = []
    preps: dict[str, Prepared] = {}
    for spec in specs:
        row, prep = measure(ctx, spec, ref, log)
        if spec.key == "eager":
            if prep is None:
                raise CliError(f"eager failed: {row.status}", EXIT_FAIL)
            row.grads = "reference" if row.grad_diff == 0.0 else f"reference (rerun differs: {row.grads})"
        rows.append(row)
        if prep is not None:
            preps[spec.key] = prep
    log("timing:")
    time_rounds(rows, {k: p.step for k, p in preps.items()}, args.steps, ctx.device, args.seed, log)
    wall = time.perf_counter() - t_start
    md = markdown(ctx, rows, wall)
    sys.stdout.write(md)
    sys.stdout.flush()
    if args.md:
        write_atomically(args.md, md.encode("utf-8"))
    if args.json:
        write_json(ctx, rows, wall, args.json)
    if args.png:
        pareto_png(ctx, rows, args.png)
        log(f"wrote {args.png}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
