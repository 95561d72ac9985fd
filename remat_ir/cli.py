"""Command-line entry points: remat-compile, remat-verify, remat-run.

Exit codes: 0 success; 1 the plan is unsound / gradients differ; 2 bad input
(unreadable plan, model file without build(), a plan for another model, an
infeasible budget).  Bad input gets one line saying what and where, never a
traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_INPUT):
        super().__init__(message)
        self.code = code


def _input_errors():
    """Exception types that mean "bad input", not a bug."""
    from .interpret import PlanMismatch
    from .load import ModelError
    from .text import RirSyntaxError
    from .trace import TraceError

    return (ModelError, TraceError, RirSyntaxError, PlanMismatch, OSError)


def _main(prog: str, body, argv) -> int:
    try:
        return body(argv)
    except CliError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        if isinstance(e, _input_errors()) or type(e).__name__ == "Infeasible":
            print(f"{prog}: error: {e}", file=sys.stderr)
            return EXIT_INPUT
        raise


# ------------------------------------------------------------------ compile


def compile_main(argv=None) -> int:
    return _main("remat-compile", _compile, argv)


def _compile_parser() -> argparse.ArgumentParser:
    from .models import describe_builtins

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
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--optimizer", default="none", choices=["none", "sgd", "adam"],
                   help="optimizer whose state the prediction and the total budget include")
    p.add_argument("--budget", help="memory budget: bytes, 1.5GiB, 800MB, or a fraction (0.5) of the "
                                    "unoptimized peak in --scope")
    p.add_argument("--scope", default="total", choices=["total", "activations"])
    p.add_argument("--solver", default="HIGHS")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per optimizer solve "
                                                                    "(per budget with --pareto)")
    p.add_argument("--effort", default="fast", choices=["fast", "full"],
                   help="fast: each per-block MILP stops after about a second with its best plan, so "
                        "plans can vary with machine load; full: each runs to optimality (slower; the "
                        "same plan on every machine unless --time-limit stops it)")
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
    p.add_argument("--quiet", action="store_true")
    return p


_PARETO_POINTS = 8


def _pareto_png(args) -> str:
    """Where the sweep's plot goes; refuses, before any work, a place it cannot be written."""
    import os

    if args.pareto_png:
        path = args.pareto_png
    else:
        root, ext = os.path.splitext(args.output)
        path = (root if ext == ".rir" else args.output) + ".pareto.png"
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise CliError(f"cannot write {path}: no directory {d}")
    if os.path.isdir(path):
        raise CliError(f"cannot write {path}: it is a directory")
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise CliError("--pareto draws its plot with matplotlib: pip install matplotlib") from e
    return path


def _compile(argv) -> int:
    args = _compile_parser().parse_args(argv)
    from .load import load_model
    from .simulate import optimizer_state_bytes
    from .text import save_plan, with_lines
    from .trace import trace_module
    from .verify import verify

    if args.cost == "profile" and args.fake:
        raise CliError("--cost profile times each op on real tensors, and --fake tensors have no data "
                       "to run on: drop --fake, or use --cost flops")
    if args.profile_repeats < 1:
        raise CliError(f"--profile-repeats must be at least 1, not {args.profile_repeats}")
    pareto = args.pareto or args.pareto_points is not None or args.pareto_png is not None
    points = _PARETO_POINTS if args.pareto_points is None else args.pareto_points
    if pareto and points < 2:
        raise CliError(f"--pareto-points must be at least 2 (the unoptimized peak and the floor), not {points}")
    png = _pareto_png(args) if pareto else None
    if pareto or args.budget is not None:
        from .milp import installed_solvers

        if args.solver.upper() not in installed_solvers():
            raise CliError(f"--solver {args.solver} is not installed; installed MILP solvers: "
                           f"{', '.join(installed_solvers())}")
    say = (lambda *a: None) if args.quiet else print

    t0 = time.perf_counter()
    model = load_model(args.model, batch=args.batch, seq=args.seq, device=args.device, fake=args.fake)
    program = trace_module(model.module, model.inputs, loss_fn=model.loss, model_name=model.name,
                           fake=args.fake)
    program.header.device = args.device
    program.header.optimizer = args.optimizer
    program.header.optimizer_bytes = optimizer_state_bytes(program, args.optimizer)
    shape = ", ".join(f"{v.name} {v.dtype}{v.shape}" for v in program.values if v.kind == "input")
    program.header.comment = [f"remat-ir plan: {model.name} ({shape})"]
    t_trace = time.perf_counter() - t0
    notes = []
    if args.cost == "profile":
        from .costs import ProfileError, profile_costs

        t1 = time.perf_counter()
        try:
            program = profile_costs(program, model.module, model.inputs, repeats=args.profile_repeats)
        except ProfileError as e:
            raise CliError(str(e)) from e
        program.header.comment.append(f"op costs: median of {args.profile_repeats} timed runs on "
                                      f"{args.device}")
        notes.append(f"profiled {len(program.nodes)} ops in {time.perf_counter() - t1:.1f} s")
    # Parsed before the sweep so a mistyped budget fails in a second, not after it.
    budget = None
    if args.budget is not None:
        from .optimize import resolve_budget

        try:
            budget = resolve_budget(program, args.budget, args.scope)
        except ValueError as e:
            raise CliError(f"--budget: {e}") from e
    rows = None
    if pareto:
        from .pareto import format_columns, format_row, sweep, table_header

        t1 = time.perf_counter()
        say(table_header(program, args.scope))
        say(format_columns())
        # The same program object for every budget: the optimizer reuses its planner.
        rows = sweep(program, args.scope, points=points, time_limit=args.time_limit, solver=args.solver,
                     effort=args.effort,
                     progress=lambda r: say(format_row(r)))
        notes.append(f"swept {len(rows)} budgets in {time.perf_counter() - t1:.1f} s")
    if budget is not None:
        from .costs import overhead_text
        from .optimize import optimize

        result = optimize(program, budget, args.scope, time_limit=args.time_limit, solver=args.solver,
                          effort=args.effort)
        program = result.program
        notes.append(f"optimized in {result.seconds:.1f} s: {overhead_text(program)}")
    verdict = verify(program)
    if not verdict.ok:
        msg = "\n".join(str(d) for d in verdict.errors[:20])
        raise CliError(f"internal error: the generated plan does not verify:\n{msg}", EXIT_FAIL)
    if rows is not None:
        from .pareto import plot

        title = (f"{program.header.model or 'plan'}: predicted "
                 f"{'activation' if args.scope == 'activations' else 'total'} peak vs extra compute")
        try:
            plot(rows, png, title=title, scope=args.scope)
        except ValueError as e:
            raise CliError(str(e)) from e
        notes.append(f"wrote {png}")
    save_plan(program, args.output)
    if not args.quiet:
        from .report import breakdown

        if rows is not None:
            print()
        # Line numbers of the file just written, so the summary points into it.
        program = with_lines(program)
        verdict = verify(program)
        print(breakdown(program, verdict.report, verdict.report_first_step))
        print("; ".join([f"traced in {t_trace:.1f} s", f"wrote {args.output}"] + notes))
    return EXIT_OK


# ------------------------------------------------------------------- verify


def verify_main(argv=None) -> int:
    return _main("remat-verify", _verify, argv)


def _verify(argv) -> int:
    p = argparse.ArgumentParser(prog="remat-verify", description="Prove a .rir plan sound and within budget.")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from .report import breakdown
    from .text import load_plan
    from .verify import verify

    program = load_plan(args.plan)
    verdict = verify(program)
    if args.json:
        out = {"ok": verdict.ok, "errors": [{"line": d.line, "message": d.message} for d in verdict.errors]}
        if verdict.report is not None:
            out["predicted_peak_bytes"] = verdict.report.peak_bytes
            out["predicted_first_step_peak_bytes"] = verdict.report_first_step.peak_bytes
            out["activation_peak_bytes"] = verdict.report.activation_peak_bytes
        print(json.dumps(out))
        return EXIT_OK if verdict.ok else EXIT_FAIL
    if not verdict.ok:
        for d in verdict.errors:
            print(f"{args.plan}:{d}")
        print(f"remat-verify: {args.plan}: UNSOUND ({len(verdict.errors)} error"
              f"{'s' if len(verdict.errors) != 1 else ''})")
        return EXIT_FAIL
    print(breakdown(program, verdict.report, verdict.report_first_step))
    print(f"remat-verify: {args.plan}: sound")
    return EXIT_OK


# ---------------------------------------------------------------------- run


def run_main(argv=None) -> int:
    return _main("remat-run", _run, argv)


def _run(argv) -> int:
    p = argparse.ArgumentParser(prog="remat-run", description="Run training steps through a plan; "
                                "compare predicted and measured peak memory, and step time with eager.")
    p.add_argument("plan")
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--check", action="store_true", help="compare every gradient with eager PyTorch")
    p.add_argument("--json", action="store_true")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch

    from .load import load_model
    from .report import human_bytes
    from .run import run_plan
    from .text import load_plan
    from .verify import verify

    program = load_plan(args.plan)
    verdict = verify(program)
    if not verdict.ok:
        raise CliError(f"{args.plan} does not verify; run remat-verify {args.plan}", EXIT_FAIL)
    device = args.device or program.header.device
    if device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda, but no CUDA device is available")
    if torch.device(device).type != torch.device(program.header.device).type:
        raise CliError(f"the plan was compiled for {program.header.device}; recompile it with --device {device}")
    shapes = {v.name: v.shape for v in program.values if v.kind == "input"}
    model = load_model(args.model, batch=args.batch, seq=args.seq, device=device, seed=args.seed)
    r = run_plan(program, model, steps=args.steps, device=device, check=args.check, seed=args.seed)
    ok_mem = r.within_tolerance()
    if args.json:
        print(json.dumps({
            "device": device,
            "predicted_peak_bytes": r.predicted.peak_bytes,
            "measured_peak_bytes": r.measured_peak,
            "predicted_first_step_peak_bytes": r.predicted_first.peak_bytes,
            "measured_first_step_peak_bytes": r.measured_first_peak,
            "predicted_activation_peak_bytes": r.predicted.activation_peak_bytes,
            "memory_within_tolerance": ok_mem,
            "grads_match": r.grads_match,
            "max_abs_grad_diff": r.max_abs_grad_diff,
            "step_time_s": r.step_time,
            "eager_step_time_s": r.eager_step_time,
            "steps": args.steps,
            "input_shapes": shapes,
        }))
    else:
        print(f"{'step':<28}{'predicted':>12}{'measured':>12}{'diff':>10}")
        for label, pr, me in (("first (no .grad)", r.predicted_first.peak_bytes, r.measured_first_peak),
                              ("later (.grad present)", r.predicted.peak_bytes, r.measured_peak)):
            print(f"{label:<28}{human_bytes(pr):>12}{human_bytes(me):>12}"
                  f"{100 * (me - pr) / max(pr, 1):>9.2f}%")
        print("measured before the step: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in r.measured_baseline.items()))
        print("predicted at the peak:     " + ", ".join(f"{k} {human_bytes(v)}"
                                                   for k, v in r.predicted.peak.by_category.items() if v))
        print(f"step time: {1e3 * r.step_time:.2f} ms (eager {1e3 * r.eager_step_time:.2f} ms, "
              f"ratio {r.step_time / r.eager_step_time:.3f}), median of {args.steps}")
        if r.checks:
            for c in r.checks:
                print(f"check step {c.step}: loss {'equal' if c.loss_equal else 'DIFFERS'}, gradients "
                      f"{'bitwise equal' if c.grads_equal else f'DIFFER (max abs {c.max_abs_grad_diff:.3g} at {c.worst})'}")
        print(f"memory prediction {'within' if ok_mem else 'OUTSIDE'} 1% + 1 MiB")
    if args.check and not r.grads_match:
        return EXIT_FAIL
    return EXIT_OK


# ------------------------------------------------------------ show, bench


def show_main(argv=None) -> int:
    from .show import main

    return main(argv)


def bench_main(argv=None) -> int:
    from .bench import main

    return main(argv)
