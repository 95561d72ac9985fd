"""Step-time acceptance check: remat-ir against eager PyTorch and
torch.utils.checkpoint on a mid-size GPT, on CPU.

    python tools/step_time.py [--model gpt2-mid8] [--steps 7] [--budget 0.5] [--cost flops|profile]
                              [--threads N]

The criteria, each printed as a PASS/FAIL line:

1. remat-ir at ``--budget`` (0.5) of eager's measured activation peak:
   measured activation peak at most that, and step time at most 1.10x
   eager's.  (The same fraction of remat-ir's own unoptimized peak, which is
   lower than eager's, is shown as well.)
2. remat-ir at a budget equal to the activation peak *measured* for
   torch.utils.checkpoint around every block: measured peak at most
   checkpointing's, and step time lower than checkpointing's.

Everything is measured as `remat-bench` measures it (the functions are
`remat_ir.cli.measure`'s): memory of the second step (``.grad`` present) with the
storage tracker, gradients of the first step compared bitwise with eager,
step time the median of ``--steps`` rounds with the methods' order rotated
each round; a ratio is the median over rounds of the two methods' times in
the same round.  The unoptimized plan runs too: its ratio to eager is the
interpreter's own cost, which every remat-ir row also pays (it runs eager's
ops but for the tracer's two fusions, which change memory, not arithmetic).

Exit status: 0 both criteria pass, 1 one fails, 2 bad input.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

from remat_ir.cli.bench import apply_threads, default_args
from remat_ir.cli.measure import MiB, Context, MethodSpec, Row, eager_reference, measure, paired_ratios, time_rounds
from remat_ir.cli.methods import prep_ckpt_all, prep_eager, prep_remat
from remat_ir.ir.costs import overhead_text

RATIO_LIMIT = 1.10


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _spread(ratios: list[float]) -> str:
    # The range shows how much of a margin the machine's noise can swallow.
    return f"rounds {min(ratios):.2f}-{max(ratios):.2f}" if ratios else "no rounds"


def _recompute_summary(prep) -> str:
    res = getattr(prep, "result", None) if prep is not None else None
    if res is None:
        return ""
    nodes = res.program.node_map()
    count: collections.Counter = collections.Counter()
    views = 0
    for name in res.recomputed:
        n = nodes[name]
        if not n.flops:  # views and other aliases: free to recompute
            views += 1
            continue
        count[n.op.split(".")[1]] += 1
    ops = ", ".join(f"{k} x{v}" for k, v in count.most_common())
    return (f"recomputes {ops or 'nothing'}" + (f" (+{views} views)" if views else "")
            + f"; {overhead_text(res.program)} ({res.mode}, solved in {res.seconds:.1f} s)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="step_time.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-mid8", help="built-in name or .py model file (default gpt2-mid8)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, default=7, help="timed rounds, at least 5 (median; default 7)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="criterion 1's budget, a fraction of the activation peak (default 0.5)")
    p.add_argument("--optimizer", default="adam", choices=["none", "sgd", "adam"])
    p.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit per solve (s)")
    p.add_argument("--cost", default="flops", choices=["flops", "profile"],
                   help="what the optimizer minimizes: recomputed FLOPs (default) or profiled op time")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default on CPU: 1, see remat-bench)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.steps < 5:
        print("step_time.py: error: --steps must be at least 5", file=sys.stderr)
        return 2
    if not 0 < a.budget <= 1:
        print("step_time.py: error: --budget is a fraction in (0, 1]", file=sys.stderr)
        return 2
    log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    args = default_args(model=a.model, batch=a.batch, seq=a.seq, device="cpu", steps=a.steps,
                              optimizer=a.optimizer, time_limit=a.time_limit, cost=a.cost, threads=a.threads,
                              seed=a.seed, quiet=a.quiet)
    apply_threads(args)
    t_start = time.perf_counter()
    ctx = Context(args)
    ref = eager_reference(ctx)

    frac = f"{a.budget:g}"
    rows: dict[str, Row] = {}
    preps: dict = {}
    budgets: dict[str, str] = {}

    def run(spec: MethodSpec) -> None:
        row, prep = measure(ctx, spec, ref, log)
        rows[spec.key] = row
        if prep is not None:
            preps[spec.key] = prep

    for spec in (MethodSpec("eager", "eager PyTorch", "eager", prep_eager),
                 MethodSpec("ckpt-all", "checkpoint every block", "checkpoint", prep_ckpt_all),
                 MethodSpec("remat-plan", "remat-ir, unoptimized plan", "remat",
                            lambda c: prep_remat(c, None))):
        run(spec)
    eager = rows["eager"]
    if not eager.ok:
        print(f"step_time.py: error: eager failed: {eager.status}", file=sys.stderr)
        return 1
    # Criterion 1 is a fraction of eager's measured peak.  The unoptimized
    # plan's own peak is lower (its fused cross-entropy backward holds one
    # logits-sized tensor fewer), so the same fraction of *that* is a tighter
    # budget: shown too, not a criterion.
    half = int(a.budget * eager.act_peak)
    budgets[f"remat-{frac}"] = f"{frac} x eager's = {half / MiB:.1f} MiB"
    run(MethodSpec(f"remat-{frac}", f"remat-ir, budget {frac} of eager's peak", "remat",
                   lambda c: prep_remat(c, half)))
    budgets[f"remat-{frac}-plan"] = f"{frac} x the unoptimized plan's"
    run(MethodSpec(f"remat-{frac}-plan", f"remat-ir, budget {frac} of its unoptimized plan's peak", "remat",
                   lambda c: prep_remat(c, frac)))
    ckpt = rows["ckpt-all"]
    if ckpt.ok:
        # The measured peak, not a fraction: "at equal or lower measured peak".
        nbytes = int(ckpt.act_peak)
        budgets["remat-ckpt"] = f"{nbytes / MiB:.1f} MiB (= ckpt-all measured)"
        run(MethodSpec("remat-ckpt", "remat-ir, budget = ckpt-all's peak", "remat",
                       lambda c: prep_remat(c, nbytes)))

    log("timing:")
    ordered = list(rows.values())
    time_rounds(ordered, {k: p.step for k, p in preps.items()}, a.steps, ctx.device, args.seed, log)
    wall = time.perf_counter() - t_start

    e_act = eager.act_peak
    n_params = sum(p.numel() for p in ctx.base.parameters())
    shapes = ", ".join(str(tuple(x.shape)) for x in ctx.inputs if isinstance(x, torch.Tensor))
    print(f"## step time: {ctx.name} ({n_params / 1e6:.2f} M parameters, inputs {shapes}), cpu, "
          f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), dropout on, "
          f"median of {a.steps} rotated rounds")
    print()
    print("| method | budget | predicted act. peak | measured act. peak | % of eager | step time | vs eager "
          "| gradients equal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in ordered:
        if not r.ok:
            print(f"| {r.label} | {budgets.get(r.key, '-')} | {r.status} | | | | | |")
            continue
        pred = _mib(r.predicted_act) if r.predicted_act is not None else "-"
        ratio = f"{r.ratio:.3f}x" if r.ratio is not None else "-"
        grads = "yes (bitwise)" if r.grads == "bitwise" else f"no ({r.grads})"
        if r.key == "eager":
            grads = "reference"
        print(f"| {r.label} | {budgets.get(r.key, '-')} | {pred} | {_mib(r.act_peak)} | "
              f"{_pct(r.act_peak / e_act)} | {r.step_time:.3f} s | {ratio} | {grads} |")
    print()
    for key in (f"remat-{frac}", f"remat-{frac}-plan", "remat-ckpt"):
        s = _recompute_summary(preps.get(key))
        if s:
            print(f"- {key}: {s}")
    plan = rows.get("remat-plan")
    if plan is not None and plan.ok and plan.ratio is not None:
        print(f"- unoptimized plan (eager's ops, but dropout's mask and the cross-entropy backward fused): "
              f"{plan.ratio:.3f}x eager")
    load = ""
    if hasattr(os, "getloadavg"):
        load = (f"; 1-minute load average at the start {ctx.load_start:.1f}, at the end "
                f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"- wall time {wall:.0f} s{load}")
    print()

    ok = True
    # Criterion 1.
    r1 = rows[f"remat-{frac}"]
    if not r1.ok:
        ok = False
        print(f"FAIL criterion 1: remat-ir at {frac} of the activation peak: {r1.status}")
    else:
        mem_ok = r1.act_peak <= a.budget * e_act
        t_ok = r1.ratio is not None and r1.ratio <= RATIO_LIMIT
        grads_ok = r1.grads == "bitwise"
        ok &= mem_ok and t_ok and grads_ok
        over = "" if t_ok else f", {100 * (r1.ratio / RATIO_LIMIT - 1):.1f}% over the limit"
        print(f"{'PASS' if mem_ok and t_ok and grads_ok else 'FAIL'} criterion 1: remat-ir at {frac} of the "
              f"activation peak: step time {r1.ratio:.3f}x eager ({_spread(r1.ratios)}; limit "
              f"{RATIO_LIMIT:.2f}x{over}); measured "
              f"activation peak {_mib(r1.act_peak)} = {_pct(r1.act_peak / e_act)} of eager's "
              f"{_mib(e_act)} ({'within' if mem_ok else 'OVER'} {frac}); gradients "
              f"{'bitwise equal' if grads_ok else r1.grads}")
    # Criterion 2.
    r2 = rows.get("remat-ckpt")
    if not ckpt.ok:
        ok = False
        print(f"FAIL criterion 2: checkpoint every block did not run: {ckpt.status}")
    elif r2 is None or not r2.ok:
        ok = False
        why = r2.status if r2 is not None else "not run"
        print(f"FAIL criterion 2: remat-ir at checkpoint-every-block's measured peak "
              f"({_mib(ckpt.act_peak)}): {why}")
    else:
        paired = paired_ratios(r2, ckpt)
        vs_ckpt = statistics.median(paired) if paired else float("nan")
        mem_ok = r2.act_peak <= ckpt.act_peak
        t_ok = bool(paired) and vs_ckpt < 1.0
        grads_ok = r2.grads == "bitwise"
        ok &= mem_ok and t_ok and grads_ok
        print(f"{'PASS' if mem_ok and t_ok and grads_ok else 'FAIL'} criterion 2: remat-ir at checkpoint-every-"
              f"block's measured peak: step time {vs_ckpt:.3f}x checkpointing's ({_spread(paired)}; must be "
              f"< 1; {r2.ratio:.3f}x vs {ckpt.ratio:.3f}x eager); measured activation peak {_mib(r2.act_peak)} "
              f"{'<=' if mem_ok else '>'} {_mib(ckpt.act_peak)} ({r2.act_peak:,} vs {ckpt.act_peak:,} B); gradients "
              f"{'bitwise equal' if grads_ok else r2.grads}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
