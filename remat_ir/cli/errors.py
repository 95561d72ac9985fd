"""The exit codes every command shares, and the one wrapper that turns errors
into them.

    0  success
    1  the plan is unsound, gradients differ, a prediction is off, a step fails
    2  bad input: an unreadable plan, a model file without build(), a plan for
       another model, an unreadable or infeasible budget, a bad flag

Bad input gets one line, `PROG: error: what and where`, never a traceback;
the line is bounded (`remat_ir.ir.syntax.clip`) however long what it echoes.
A closed output (`remat-show plan.rir | head -1`) ends the command quietly
with 141, as a command killed by SIGPIPE does.
"""
from __future__ import annotations

import os
import sys

EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2
EXIT_PIPE = 128 + 13  # SIGPIPE


class CliError(Exception):
    """Stop the command with this message and exit code."""

    def __init__(self, message: str, code: int = EXIT_INPUT):
        super().__init__(message)
        self.code = code


def input_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "bad input", not a bug (`Infeasible` too,
    matched by name so that this never imports the optimizer)."""
    from remat_ir.ir.syntax import RirSyntaxError
    from remat_ir.pipeline import BudgetError
    from remat_ir.runtime.bind import PlanMismatch
    from remat_ir.runtime.load import ModelError
    from remat_ir.runtime.op_timing import ProfileError
    from remat_ir.trace.tracer import TraceError

    return (ModelError, TraceError, RirSyntaxError, PlanMismatch, ProfileError, BudgetError, OSError)


def run_cli(prog: str, body, argv) -> int:
    """`body(argv)`'s exit code; errors as one line on stderr and their code."""
    from remat_ir.ir.syntax import clip

    try:
        code = body(argv)
        sys.stdout.flush()  # so that a closed pipe shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        return _output_closed()
    except CliError as e:
        print(f"{prog}: error: {clip(str(e))}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        if isinstance(e, input_errors()) or type(e).__name__ == "Infeasible":
            print(f"{prog}: error: {clip(str(e))}", file=sys.stderr)
            return EXIT_INPUT
        raise


def _output_closed() -> int:
    """The reader of stdout went away (`| head -1`): stop without a word.
    Stdout is pointed at the null device so that flushing what is still
    buffered, at exit, does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured)
        pass
    return EXIT_PIPE
