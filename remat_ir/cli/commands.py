"""Command-line entry points: remat-compile, remat-verify, remat-run.

Each parses its arguments, calls the Python API (`remat_ir.compile` and its
stages in `remat_ir.pipeline`, `remat_ir.verify`, `remat_ir.runtime.run`),
and prints.  Exit codes and the error wrapper: `remat_ir.cli.errors` (0
success; 1 the plan is unsound / gradients differ; 2 bad input, one line
saying what and where, never a traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from remat_ir.cli.errors import EXIT_FAIL, EXIT_INPUT, EXIT_OK, CliError, run_cli
from remat_ir.cli.outputs import check_outputs, model_file

__all__ = ["EXIT_FAIL", "EXIT_INPUT", "EXIT_OK", "CliError", "bench_main", "compile_main", "run_main",
           "show_main", "verify_main"]


# ------------------------------------------------------------------ compile


def compile_main(argv=None) -> int:
    return run_cli("remat-compile", _compile, argv)


def _compile_parser() -> argparse.ArgumentParser:
    from remat_ir.ir.budgets import DEFAULT_TIME_LIMIT
    from remat_ir.ir.types import DEFAULT_SCOPE, SCOPES
    from remat_ir.models import describe_builtins

    p = argparse.ArgumentParser(
        prog="remat-compile", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Trace one training step of MODEL into a .rir plan (and optimize it for a budget).",
        epilog="MODEL is a .py file defining build() -> (module, example_inputs) and optionally "
               "loss(output, *inputs), or a built-in name.\n" + describe_builtins())
    p.add_argument("model")
    p.add_argument("-o", "--output", required=True, help="plan file to write (.rir)")
    p.add_argument("--fake", action="store_true", help="plan without allocating (FakeTensorMode)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where to build the model; the plan is for the device it is built on")
    p.add_argument("--optimizer", default="none", choices=["none", "sgd", "adam"],
                   help="optimizer whose state the prediction and the total budget include")
    p.add_argument("--autocast", metavar="DEVICE:DTYPE",
                   help="trace the forward and loss under torch.autocast (cpu:bfloat16, cuda:float16), as "
                        "mixed-precision training calls the model; the plan then runs only under it "
                        "(remat-run runs it so)")
    p.add_argument("--budget", help="memory budget: bytes, 1.5GiB, 800MB, a fraction (0.5) of the "
                                    "unoptimized peak in --scope, or floor (the smallest peak reachable)")
    p.add_argument("--scope", default=DEFAULT_SCOPE, choices=SCOPES,
                   help=f"what --budget measures (default {DEFAULT_SCOPE}): activations, what the step adds "
                        "on top of parameters, gradients and optimizer state; total, all of it")
    p.add_argument("--solver", default="HIGHS")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                   help=f"safety stop for the optimizer, in seconds per search (default {DEFAULT_TIME_LIMIT:g}); "
                        "a plan it cuts short says so in its header")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say where the optimizer's time went: each search (the graph, its floors, each "
                        "rewritten graph tried) and its solves by kind")
    p.add_argument("--effort", default="fast", choices=["fast", "full"],
                   help="how hard the search on large graphs (over 192 decisions) works: fast stops each "
                        "per-block MILP at a node limit; full solves each to its gap tolerance. Both give "
                        "the same plan on any machine")
    p.add_argument("--exact", action="store_true",
                   help="allow only graph rewrites that keep eager's bits (the BatchNorm split, the "
                        "chunked loss), not chunked attention, whose batched matmuls over fewer matrices "
                        "may take another kernel")
    p.add_argument("--offload", action="store_true",
                   help="where recomputation alone cannot fit --budget, also offload activations to host "
                        "memory between forward and backward (eager's bits: allowed with --exact), before any "
                        "graph rewrite")
    p.add_argument("--host-budget", metavar="BYTES",
                   help="with --offload: the most the offloaded copies may hold on the host at once (bytes, "
                        "8GiB, 800MB), written as the plan's host_budget line")
    p.add_argument("--cost", default="flops", choices=["flops", "profile"],
                   help="what recomputation costs: FLOPs per aten op (default), or each op's run time "
                        "measured on --device (needs real tensors: not with --fake)")
    p.add_argument("--profile-repeats", type=int, default=5, metavar="N",
                   help="with --cost profile: timed runs per op (the median is kept)")
    p.add_argument("--pareto", action="store_true",
                   help="also optimize for budgets from the unoptimized peak down to the floor: print "
                        "a table and plot predicted peak vs extra compute. The plan written is the "
                        "one for --budget, or the unoptimized plan without --budget")
    p.add_argument("--pareto-points", type=int, default=None, metavar="N",
                   help=f"budgets in the sweep, both ends included (default {_PARETO_POINTS}); "
                        "implies --pareto")
    p.add_argument("--pareto-png", metavar="FILE",
                   help="where to draw the sweep (default: next to -o, <stem>.pareto.png); implies --pareto")
    p.add_argument("--dynamic", action="store_true",
                   help="a symbolic plan: one for every batch and sequence size up to the example's (or "
                        "--max-size's); the batch and the token sequences' lengths are its size symbols")
    p.add_argument("--max-size", action="append", default=[], metavar="SYMBOL=N",
                   help="with --dynamic: the largest size of a symbol (T=512); repeat for others")
    p.add_argument("--quiet", action="store_true")
    return p


_PARETO_POINTS = 8


def _pareto_png(args) -> str | None:
    """Where the sweep's plot goes (None without --pareto)."""
    if not (args.pareto or args.pareto_points is not None or args.pareto_png is not None):
        return None
    if args.pareto_png:
        return args.pareto_png
    root, ext = os.path.splitext(args.output)
    return (root if ext == ".rir" else args.output) + ".pareto.png"


def _max_sizes(args) -> dict[str, int]:
    """--max-size SYMBOL=N, each given once."""
    out: dict[str, int] = {}
    for text in args.max_size:
        name, _, value = text.partition("=")
        if not (name.strip().isidentifier() and value.strip().isdigit()):
            raise CliError(f"--max-size {text!r}: expected SYMBOL=N, e.g. T=512")
        if name.strip() in out:
            raise CliError(f"--max-size: {name.strip()} given twice")
        out[name.strip()] = int(value)
    if out and not args.dynamic:
        raise CliError("--max-size sets the range of a symbolic plan: add --dynamic")
    return out


def _compile(argv) -> int:
    args = _compile_parser().parse_args(argv)
    import remat_ir
    from remat_ir.cli.report import breakdown
    from remat_ir.ir.costs import overhead_text
    from remat_ir.ir.printer import with_lines
    from remat_ir.ir.types import DEFAULT_SCOPE
    from remat_ir.pipeline import (
        BudgetError, CompileStats, UnsoundPlan, budget_bytes, check_budget, check_host_budget, check_time_limit, fit,
        trace,
    )
    from remat_ir.runtime.load import check_device, load_model

    # Flags are checked before any work, so a typo fails in a second.
    png = _pareto_png(args)
    png_flag = "--pareto-png" if args.pareto_png else "--pareto's plot"
    check_outputs([("-o", args.output), (png_flag, png)], [("the model file", model_file(args.model))],
                  images=[png_flag])
    check_device(args.device)
    if args.scope != DEFAULT_SCOPE and args.budget is None and not (
            args.pareto or args.pareto_points is not None or args.pareto_png is not None):
        raise CliError(f"--scope {args.scope} says what --budget (or --pareto) measures; give --budget, "
                       f"or drop --scope")
    if args.cost == "profile" and args.fake:
        raise CliError("--cost profile times each op on real tensors, and --fake tensors have no data "
                       "to run on: drop --fake, or use --cost flops")
    if args.profile_repeats < 1:
        raise CliError(f"--profile-repeats must be at least 1, not {args.profile_repeats}")
    try:
        check_time_limit(args.time_limit)
    except ValueError:
        raise CliError(f"--time-limit must be a positive, finite number of seconds, not {args.time_limit:g}") \
            from None
    try:
        check_budget(args.budget)
    except BudgetError as e:
        raise CliError(f"--budget: {e}") from None
    if args.host_budget is not None and not args.offload:
        raise CliError("--host-budget bounds what offloaded copies hold on the host: add --offload")
    try:
        check_host_budget(args.host_budget, args.offload)
    except BudgetError as e:
        raise CliError(f"--host-budget: {str(e).removeprefix('host budget: ')}") from None
    if args.offload and args.budget is None:
        raise CliError("--offload says how a plan may fit --budget: give --budget")
    if args.autocast is not None:
        from remat_ir.trace.calls import parse_autocast

        try:
            autocast_device, _ = parse_autocast(args.autocast)
        except ValueError as e:
            raise CliError(f"--autocast: {e}") from None
        if autocast_device != args.device:
            raise CliError(f"--autocast {args.autocast} is for {autocast_device}, but the model is built on "
                           f"--device {args.device}")
        from remat_ir.ir.header import autocast_problem

        if autocast_problem(args.autocast, args.device):
            raise CliError(f"--autocast {autocast_problem(args.autocast, args.device)}")
    pareto = args.pareto or args.pareto_points is not None or args.pareto_png is not None
    max_sizes = _max_sizes(args)
    if args.dynamic and (pareto or args.fake):
        raise CliError(f"--dynamic traces the model's own example with symbols for its sizes; it does not go "
                       f"with {'--pareto' if pareto else '--fake'}")
    points = _PARETO_POINTS if args.pareto_points is None else args.pareto_points
    if pareto and points < 2:
        raise CliError(f"--pareto-points must be at least 2 (the unoptimized peak and the floor), not {points}")
    if pareto or args.budget is not None:
        from remat_ir.pipeline import optimizer_settings

        try:
            optimizer_settings(args.solver, args.effort, args.time_limit)
        except ValueError as e:  # (--effort and --time-limit are checked before: this is the solver's)
            raise CliError(f"--{e}") from None
    say = (lambda *a: None) if args.quiet else print

    t0 = time.perf_counter()
    model = load_model(args.model, batch=args.batch, seq=args.seq, device=args.device, fake=args.fake)
    t_load = time.perf_counter() - t0
    stats = CompileStats()
    step = dict(loss=model.loss, name=model.name, optimizer=args.optimizer, fake=args.fake, cost=args.cost,
                profile_repeats=args.profile_repeats, autocast=args.autocast or "")
    solve = dict(scope=args.scope, time_limit=args.time_limit, solver=args.solver, effort=args.effort)
    rows = None
    exact = dict(exact=args.exact)
    if args.offload:  # (without it, fit's arguments are what they always were)
        exact.update(offload=True, host_budget=args.host_budget)
    # The step is traced in train mode whatever mode the model is in: say so.
    in_eval = [name for name, m in model.module.named_modules() if not m.training]
    try:
        if args.dynamic:
            from remat_ir.pipeline import widen
            from remat_ir.trace.calls import dynamic_dims, split_call

            dims = dynamic_dims(split_call(model.module, model.inputs))
            if not dims:
                raise CliError("--dynamic: the example has no batch or sequence dimension of size 2 or more to "
                               "make a symbol (or an input that is not a contiguous tensor of its own)")
            program = trace(model.module, model.inputs, **step, stats=stats, dynamic=dims)
            from remat_ir.ir import sizes as sz

            why = sz.check_sizes(program, sz.ends(program)[0])
            if why:  # (the model's code took a decision only sizes like the example's share)
                raise CliError(f"--dynamic: {why.replace('break', 'at the low end of its range break')}: the "
                               "model's code decides on its sizes, and a symbolic plan's guards must hold at both "
                               "ends of its range; compile it without --dynamic")
            if max_sizes:
                try:
                    program.header.sizes = widen(program, max_sizes)
                except ValueError as e:
                    raise CliError(f"--max-size: {e}") from None
                from remat_ir.ir.fingerprint import fingerprint

                program.header.fingerprint = fingerprint(program)
        else:
            program = trace(model.module, model.inputs, **step, stats=stats)
        _check_scalar_loss(program, args.model, model.loss)
        if not pareto:
            program = fit(program, args.budget, **solve, **exact, stats=stats)
        else:
            # Resolved before the sweep so a mistyped budget fails in a second, not after it.
            budget = None if args.budget is None else budget_bytes(program, args.budget, **solve, **exact)
            rows, t_sweep = _sweep(program, args, points, say)
            program = fit(program, budget, **solve, **exact, stats=stats)
    except BudgetError as e:
        raise CliError(f"--budget: {e}") from e
    except UnsoundPlan as e:
        raise CliError(f"internal error: {e}", EXIT_FAIL) from e
    notes, where = [], []
    if "profile" in stats.seconds:
        notes.append(f"profiled {len(program.nodes)} ops in {stats.seconds['profile']:.1f} s")
    if rows is not None:
        notes.append(f"swept {len(rows)} budgets in {t_sweep:.1f} s")
    if stats.optimized is not None:
        # All of the planning: a floor's search (resolving the budget) is part of it.
        stages = [(k, stats.seconds[k]) for k in ("budget", "optimize", "verify") if k in stats.seconds]
        spent = ", ".join(f"{k} {v:.1f} s" for k, v in stages)
        notes.append(f"optimized in {sum(v for _, v in stages):.1f} s ({spent}): {overhead_text(program)}")
        if args.verbose:
            where = _where_the_time_went(stats)
    if program.header.rewrites:
        from remat_ir.rewrite import describe

        notes.append(f"graph rewrites: {describe(program.header.rewrites)}")
    if rows is not None:
        from remat_ir.optimize.pareto import plot

        title = (f"{program.header.model or 'plan'}: predicted "
                 f"{'activation' if args.scope == 'activations' else 'total'} peak vs extra compute")
        try:
            plot(rows, png, title=title, scope=args.scope)
        except ValueError as e:
            raise CliError(str(e)) from e
        notes.append(f"wrote {png}")
    remat_ir.save_plan(program, args.output)
    if not args.quiet:
        if rows is not None:
            print()
        # Line numbers of the file just written, so the summary points into it.
        # compile() verified this plan's graph already: only the report is wanted.
        program = with_lines(program)
        verdict = remat_ir.verify(program, graph=False)
        print(breakdown(program, verdict.report, verdict.report_first_step))
        t_trace = t_load + stats.seconds["trace"]
        print("; ".join([f"traced in {t_trace:.1f} s", f"wrote {args.output}"] + notes))
        if where:
            print("where the optimizer's time went:")
            print("\n".join(where))
        if in_eval:
            print(f"note: traced in train mode ({_eval_text(in_eval)}): the plan is a training step, with "
                  f"dropout and batch-norm updates on, and remat-run runs it so")
    return EXIT_OK


def _eval_text(in_eval: list[str]) -> str:
    """Which part of the model was in eval mode, for the train-mode note."""
    if "" in in_eval:  # the root module
        return "the model was in eval mode"
    more = f" and {len(in_eval) - 1} more" if len(in_eval) > 1 else ""
    return f"submodule {in_eval[0]}{more} {'were' if more else 'was'} in eval mode"


def _where_the_time_went(stats) -> list[str]:
    """The optimizer's seconds by search, and its solves by kind."""
    out = [f"  {k}: {v:.2f} s" for k, v in stats.stages.items()]
    kinds: dict[str, list] = {}
    for r in stats.solves:
        kinds.setdefault(f"{r.kind} ({r.method})", []).append(r.seconds)
    out += [f"  {len(v)} {k} solves: {sum(v):.2f} s" for k, v in sorted(kinds.items())]
    return out


def _check_scalar_loss(program, model: str, loss) -> None:
    """Refuse a step that does not end in one scalar loss: remat-run (and a
    training loop) calls .backward() on it.  (A `loss()` that returns no
    scalar is refused by the tracer.)"""
    from remat_ir.runtime.run import step_result_problem

    problem = step_result_problem(program)
    if problem is None:
        return
    if loss is None:
        raise CliError(f"{model}: the model returns {problem} and defines no loss(); a training step needs "
                       f"a scalar loss: define loss(output, *inputs) in the model file, returning one, or "
                       f"return a scalar loss from forward")
    raise CliError(f"{model}: the step returns {problem}, not a scalar loss")


def _sweep(program, args, points: int, say) -> tuple[list, float]:
    """The --pareto table, printed row by row as each budget is solved; the
    rows and the seconds the sweep took."""
    from remat_ir.optimize.pareto import format_columns, format_row, sweep, table_header

    t0 = time.perf_counter()
    say(table_header(program, args.scope))
    say(format_columns())
    # The same program object for every budget: the optimizer reuses its memo.
    rows = sweep(program, args.scope, points=points, time_limit=args.time_limit, solver=args.solver,
                 effort=args.effort, progress=lambda r: say(format_row(r)))
    return rows, time.perf_counter() - t0


# ------------------------------------------------------------------- verify


def verify_main(argv=None) -> int:
    return run_cli("remat-verify", _verify, argv)


def _verify(argv) -> int:
    p = argparse.ArgumentParser(prog="remat-verify", description="Prove a .rir plan sound and within budget.")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", help="also check that MODEL (a built-in name or a .py file) still produces "
                                   "the plan's graph, naming the first op that differs")
    args = p.parse_args(argv)
    import remat_ir
    from remat_ir.cli.report import breakdown

    from remat_ir.check.ranges import LATTICE, exhaustive
    from remat_ir.ir import sizes as sz

    program = remat_ir.load_plan(args.plan)
    verdict = remat_ir.verify(program)
    over = ""  # a symbolic plan: verified over its range, at both ends
    shown = program
    if sz.is_symbolic(program):
        try:
            ends = sz.ends(program)
            every = "every size" if exhaustive(program) else f"a lattice of up to {LATTICE} sizes per symbol"
            over = (f" over its range {', '.join(program.header.sizes)} (its size expressions at {every}, "
                    f"in full at {' and at '.join(', '.join(f'{k}={v}' for k, v in e.items()) for e in ends)})")
            if verdict.ok:
                shown = sz.instantiate(program, ends[-1], refingerprint=False)
        except sz.SizeError:
            over = f" over its range {', '.join(program.header.sizes)}"
    failed = EXIT_FAIL
    if args.model is not None:
        from remat_ir.runtime.bind import PlanMismatch, check_graph
        from remat_ir.runtime.load import load_model

        model = load_model(args.model)
        try:
            check_graph(model.module, program, model.loss)
        except PlanMismatch as e:
            from remat_ir.check.verify import Diagnostic

            # A sound plan for another model (or its old code) is bad input, as remat-run says; an
            # unsound one stays unsound.
            failed = EXIT_INPUT if verdict.ok else EXIT_FAIL
            verdict.ok = False
            verdict.errors.insert(0, Diagnostic(e.line, str(e), "nodes"))
    if args.json:
        out = {"ok": verdict.ok, "errors": [{"line": d.line, "message": d.message} for d in verdict.errors]}
        if verdict.report is not None:
            out["predicted_peak_bytes"] = verdict.report.peak_bytes
            out["predicted_first_step_peak_bytes"] = verdict.report_first_step.peak_bytes
            out["activation_peak_bytes"] = verdict.report.activation_peak_bytes
            out["predicted_host_peak_bytes"] = verdict.report.host_peak_bytes
        print(json.dumps(out))
        return EXIT_OK if verdict.ok else failed
    if not verdict.ok:
        for d in verdict.errors:
            print(f"{args.plan}:{d}")
        print(f"remat-verify: {args.plan}: UNSOUND ({len(verdict.errors)} error"
              f"{'s' if len(verdict.errors) != 1 else ''}){over}")
        return failed
    if over:
        print(f"memory at the high end of the range ({', '.join(f'{k}={v}' for k, v in sz.ends(program)[-1].items())}):")
    print(breakdown(shown, verdict.report, verdict.report_first_step))
    print(f"remat-verify: {args.plan}: sound{over}")
    return EXIT_OK


# ---------------------------------------------------------------------- run


def run_main(argv=None) -> int:
    return run_cli("remat-run", _run, argv)


def _run(argv) -> int:
    p = argparse.ArgumentParser(prog="remat-run", description="Run training steps through a plan; "
                                "compare predicted and measured peak memory, and step time with eager.")
    p.add_argument("plan")
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--check", action="store_true",
                   help="compare the loss, every gradient and the buffers with eager PyTorch: they must "
                        "match within a relative tolerance (printed with the result), and the output says "
                        "whether they are bitwise equal")
    p.add_argument("--json", action="store_true")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--size", action="append", default=[], metavar="SYMBOL=N",
                   help="a symbolic plan: run it at this size of a symbol (B=4, T=96; B and T are --batch and "
                        "--seq); repeat for others; sizes not given are the model's example's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-model-check", action="store_true",
                   help="skip retracing the model to check that it still produces the plan's graph "
                        "(only for a model you know is unchanged)")
    args = p.parse_args(argv)
    if args.steps < 1:
        raise CliError(f"--steps must be at least 1, not {args.steps}")
    import remat_ir
    from remat_ir.ir import sizes as sz
    from remat_ir.ir.printer import human_bytes
    from remat_ir.pipeline import plan_device
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import run_plan

    program = remat_ir.load_plan(args.plan)
    verdict = remat_ir.verify(program)
    if not verdict.ok:
        raise CliError(f"{args.plan} does not verify; run remat-verify {args.plan}", EXIT_FAIL)
    try:
        device = plan_device(program, args.device)
    except ValueError as e:
        raise CliError(str(e)) from e
    from remat_ir.runtime.run import step_result_problem

    problem = step_result_problem(program)
    if problem is not None:
        raise CliError(f"{args.plan}: the plan's step returns {problem}, not a scalar loss, so remat-run "
                       f"cannot call .backward() on it; recompile it from a model whose forward, or "
                       f"loss(output, *inputs), returns a scalar loss")
    asked = _sizes_flag(args, program)
    model = load_model(args.model, batch=args.batch, seq=args.seq, device=device, seed=args.seed)
    sizes = _at_sizes(program, model, asked, args.plan) if sz.is_symbolic(program) else {}
    shapes = {v.name: [sz.evaluate(d, sizes) for d in v.shape] for v in program.values if v.kind == "input"}
    r = run_plan(program, model, steps=args.steps, device=device, check=args.check, seed=args.seed,
                 check_model=not args.no_model_check)
    ok_mem = r.within_tolerance()
    if args.json:
        print(json.dumps({
            "device": device,
            "predicted_peak_bytes": r.predicted.peak_bytes,
            "measured_peak_bytes": r.measured_peak,
            "predicted_first_step_peak_bytes": r.predicted_first.peak_bytes,
            "measured_first_step_peak_bytes": r.measured_first_peak,
            "predicted_activation_peak_bytes": r.predicted.activation_peak_bytes,
            "predicted_host_peak_bytes": r.predicted.host_peak_bytes,
            "measured_host_peak_bytes": r.measured_host_peak,
            "predicted_first_step_host_peak_bytes": r.predicted_first.host_peak_bytes,
            "measured_first_step_host_peak_bytes": r.measured_first_host_peak,
            "memory_within_tolerance": ok_mem,
            "grads_match": r.grads_match,
            "grads_bitwise": r.grads_bitwise,
            "loss_bitwise": r.loss_bitwise,
            "max_rel_grad_diff": r.max_rel_grad_diff,
            "max_abs_grad_diff": r.max_abs_grad_diff,
            "step_time_s": r.step_time,
            "eager_step_time_s": r.eager_step_time,
            "steps": args.steps,
            "input_shapes": shapes,
        }))
    else:
        print(f"{'step':<28}{'predicted':>12}{'measured':>12}{'diff':>10}")
        rows = [("first (no .grad)", r.predicted_first.peak_bytes, r.measured_first_peak),
                ("later (.grad present)", r.predicted.peak_bytes, r.measured_peak)]
        if r.predicted.host_peak_bytes or r.measured_host_peak or r.measured_first_host_peak:
            # The plan offloads: its host pool (the offloaded copies), apart from the device's.
            rows += [("host pool, first step", r.predicted_first.host_peak_bytes, r.measured_first_host_peak),
                     ("host pool, later step", r.predicted.host_peak_bytes, r.measured_host_peak)]
        for label, pr, me in rows:
            print(f"{label:<28}{human_bytes(pr):>12}{human_bytes(me):>12}"
                  f"{100 * (me - pr) / max(pr, 1):>9.2f}%")
        print("measured before the step: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in r.measured_baseline.items())
              + (f" (and {human_bytes(r.measured_outside)} the device held beyond the model, such as cuBLAS "
                 "workspaces: not counted)" if r.measured_outside else ""))
        print("predicted at the peak:     " + ", ".join(f"{k} {human_bytes(v)}"
                                                   for k, v in r.predicted.peak.by_category.items() if v))
        print(f"step time: {1e3 * r.step_time:.2f} ms (eager {1e3 * r.eager_step_time:.2f} ms, "
              f"ratio {r.step_time / r.eager_step_time:.3f}), median of {args.steps}")
        if r.checks:
            for c in r.checks:
                print(f"check step {c.step}: {_check_text(c)}")
            print(_grads_summary(r))
        print(f"memory prediction {'within' if ok_mem else 'OUTSIDE'} 1% + 1 MiB")
    if args.check and not r.grads_match:
        return EXIT_FAIL
    if not ok_mem:
        print("remat-run: the measured peak is outside 1% + 1 MiB of the predicted one", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _sizes_flag(args, program) -> dict[str, int]:
    """--size SYMBOL=N (and --batch, --seq as B and T) for a symbolic plan;
    --size for a plan without symbols is refused."""
    from remat_ir.ir import sizes as sz

    out: dict[str, int] = {}
    for text in args.size:
        name, eq, n = text.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier() or not n.strip().isdigit():
            raise CliError(f"--size {text!r}: expected SYMBOL=N, e.g. T=96")
        if name in out:
            raise CliError(f"--size: {name} given twice")
        out[name] = int(n)
    if out and not sz.is_symbolic(program):
        raise CliError(f"--size: {args.plan} has no size symbols (no `sizes` line); it runs at its own shapes")
    if out:
        declared = sz.ranges(program)
        for name in out:
            if name not in declared:
                raise CliError(f"--size {name}: {args.plan} has no size symbol {name} (it has "
                               f"{', '.join(declared)})")
        for flag, sym in (("batch", "B"), ("seq", "T")):
            given = getattr(args, flag)
            if sym in out and given is not None and given != out[sym]:
                raise CliError(f"--size {sym}={out[sym]} and --{flag} {given} disagree; give one")
            if sym in out and given is None:
                setattr(args, flag, out[sym])
    return out


def _at_sizes(program, model, asked: dict[str, int], path: str) -> dict[str, int]:
    """The sizes of a symbolic plan's symbols in the model's inputs (as
    --batch, --seq, --size built them), refused in one line where those are
    not the asked ones or lie outside what the plan covers."""
    from remat_ir.ir import sizes as sz
    from remat_ir.runtime.run import input_sizes

    try:
        sizes = input_sizes(program, model.inputs)
    except ValueError as e:
        raise CliError(f"{path}: {e}") from None
    for name, n in asked.items():
        if sizes.get(name) != n:
            raise CliError(f"--size {name}={n}: the model's example has {name}={sizes.get(name)}; only B and T "
                           "(--batch, --seq) change the example's sizes")
    why = sz.check_sizes(program, sizes)
    if why:
        raise CliError(f"{path}: {why}; give sizes inside its range ({', '.join(program.header.sizes)})")
    print(f"remat-run: running {path} at {', '.join(f'{k}={v}' for k, v in sizes.items())}", file=sys.stderr)
    return sizes


def _check_text(c) -> str:
    """One step of --check: the loss, then the gradients (and buffers)."""
    loss = "equal" if c.loss_equal else "within tolerance" if c.loss_close else "DIFFERS"
    if c.grads_equal:
        grads = "bitwise equal"
    elif c.grads_close:
        grads = f"within tolerance (max relative difference {c.max_rel_grad_diff:.2g})"
    else:
        grads = (f"DIFFER (relative difference {c.worst_rel_diff:.3g} at {c.worst}; "
                 f"max abs gradient difference {c.max_abs_grad_diff:.3g})")
    return f"loss {loss}, gradients {grads}"


def _grads_summary(r) -> str:
    """--check over all steps: bitwise, within the tolerance, or not."""
    from remat_ir.runtime.run import GRAD_RTOL, GRAD_RTOL_LOW_PRECISION

    tol = f"tolerance: relative {GRAD_RTOL:g}, {GRAD_RTOL_LOW_PRECISION:g} for float16/bfloat16"
    if r.grads_bitwise:
        text = "gradients: bitwise equal to eager"
    elif all(c.grads_close for c in r.checks):
        text = f"gradients: within tolerance (max relative difference {r.max_rel_grad_diff:.2g}; {tol})"
    else:
        bad = max((c for c in r.checks if not c.grads_close), key=lambda c: c.worst_rel_diff)
        text = (f"gradients: DIFFER from eager beyond the tolerance (relative difference "
                f"{bad.worst_rel_diff:.3g} at {bad.worst}, step {bad.step}; {tol})")
    if not r.loss_bitwise:
        text += "; loss " + ("within tolerance" if all(c.loss_close for c in r.checks) else "DIFFERS")
    return text


# ------------------------------------------------------------ show, bench


def show_main(argv=None) -> int:
    from remat_ir.cli.show import main

    return main(argv)


def bench_main(argv=None) -> int:
    from remat_ir.cli.bench import main

    return main(argv)
