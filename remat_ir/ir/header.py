"""What a plan's header may say of the call it runs, as the runtime reads it:
one statement, which the verifier (`remat-verify`), the runtime (at load)
and the CLI's flags share, so a header the verifier calls sound is one the
runtime runs.

    autocast_problem("cpu:bfloat16", "cpu")   -> ""
    constant_problem("scale=2.0")             -> ""
    header_problems(header)                   -> [(line name, message), ...]
    retired_rewrite("chunked_loss:8")         -> "rewrite chunked_loss:8: the earlier ..."

An autocast is "<device type>:<dtype>", "" for none: the plan's device's
type, and a dtype `torch.autocast` takes there (any other it disables with a
warning, so no call ever runs under it).  A constant is "name=literal": a
Python literal (`nan` for NaN), or `<...>`, the text of a value that has
none (see `remat_ir.trace.calls`).
"""
from __future__ import annotations

import ast
import math

from remat_ir.ir.syntax import clip

# The dtypes `torch.autocast` takes on each device type it runs a plan's step on.
AUTOCAST_DTYPES = {"cpu": ("bfloat16", "float16"), "cuda": ("float16", "bfloat16")}


def autocast_problem(autocast: str, device: str) -> str:
    """What is wrong with `autocast` for a step on `device` ("cpu", "cuda:1"),
    in words that follow "autocast "; "" when the runtime runs it."""
    if not autocast:
        return ""
    device_type, _, dtype = autocast.partition(":")
    want = device.partition(":")[0]
    if device_type != want:
        return (f"{clip(autocast)!r} is for {clip(device_type) or 'no device'}, but the plan runs on {device}: "
                f"write {want}:<dtype>")
    takes = AUTOCAST_DTYPES.get(device_type)
    if takes is None:
        return f"{clip(autocast)!r}: torch.autocast runs on {' and '.join(AUTOCAST_DTYPES)} only"
    if dtype not in takes:
        return (f"{clip(autocast)!r}: torch.autocast on {device_type} takes {' or '.join(takes)}, not "
                f"{clip(dtype) or 'no dtype'}")
    return ""


class _Nan(ast.NodeTransformer):
    def visit_Name(self, node):
        if node.id == "nan":
            return ast.copy_location(ast.Constant(math.nan), node)
        return node


def read_literal(text: str):
    """The value of a constant's literal: `ast.literal_eval`, with `nan` for
    NaN.  Raises ValueError for one that is no literal."""
    try:
        tree = _Nan().visit(ast.parse(text.strip(), mode="eval"))
        return ast.literal_eval(tree.body)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:
        raise ValueError(f"{clip(text)} is not a Python literal ({e})") from None


def constant_problem(text: str) -> str:
    """What is wrong with `text` as a constant of the header, in words that
    follow "constant "; "" when the runtime reads it."""
    name, eq, literal = text.partition("=")
    if not eq or not name.strip() or name != name.strip():
        return f"{clip(text)!r} is not name=literal (scale=2.0, use_cache=False)"
    if literal.startswith("<") and literal.endswith(">"):
        return ""
    try:
        read_literal(literal)
    except ValueError as e:
        return f"{name}: {e}"
    return ""


def header_problems(header) -> list[tuple[str, str]]:
    """(header line name, message) for each autocast or constant of `header`
    the runtime does not run."""
    out = []
    problem = autocast_problem(header.autocast, header.device)
    if problem:
        out.append(("autocast", f"autocast {problem}"))
    seen: set[str] = set()
    for c in header.constants:
        problem = constant_problem(c)
        name = c.partition("=")[0]
        if not problem and name in seen:
            problem = f"{clip(name)} is given twice"
        seen.add(name)
        if problem:
            out.append(("constants", f"constant {problem}"))
    return out


def retired_rewrite(spec: str) -> str:
    """Why a plan naming the rewrite `spec` is refused, in one line, when
    `spec` is a rewrite this remat-ir no longer runs (the earlier chunked
    loss, `chunked_loss:K`, not eager's bits: `lm_head_nll:R` replaced it);
    "" for any other."""
    if spec.partition(":")[0] != "chunked_loss":
        return ""
    return (f"rewrite {clip(spec)}: the earlier chunked loss (not eager's bits), which this remat-ir no longer "
            "runs; compile the plan again (remat-compile), which chunks the loss with lm_head_nll")
