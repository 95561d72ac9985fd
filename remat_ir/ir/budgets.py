"""Reading a memory budget and the optimizer's time limit, with no program at
hand: every entry point (remat-compile, `remat_ir.compile`, `fit`, `wrap`)
refuses the same values with the same words, before any work.

    parse_budget(budget) -> ("bytes", n) | ("fraction", f)
    budget_int(nbytes, budget) -> int
    check_time_limit(seconds) -> float

A budget is bytes (an int, "123456"), a size ("1.5GiB", "800MB"), or a
fraction of the unoptimized peak (a float, "0.5", "50%"); always a positive,
finite amount.  ("floor" is the caller's business: it needs the optimizer.)
"""
from __future__ import annotations

import math
import numbers
import re

from remat_ir.ir.syntax import clip

HOW = "write bytes (123456), a size (800MB, 1.5GiB) or a fraction of the unoptimized peak (0.5, 50%)"
MAX_BUDGET = 2 ** 63 - 1  # bytes: what a plan's budget line (an int64) can hold, 8 EiB

UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
    "t": 1000 ** 4, "tb": 1000 ** 4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}

_NUMBER = re.compile(r"([-+]?)([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)(%|[a-zA-Z]*)")


def _not_positive(budget) -> ValueError:
    return ValueError(f"budget {clip(repr(budget))} is not a positive amount of memory: {HOW}")


def budget_int(nbytes: float | int, budget) -> int:
    """`nbytes` (of the budget written `budget`) rounded to an int, refusing
    what is no amount of memory."""
    if isinstance(nbytes, float) and not math.isfinite(nbytes):
        raise ValueError(f"budget {clip(repr(budget))} is not a finite number of bytes: {HOW}")
    if nbytes > MAX_BUDGET:
        raise ValueError(f"budget {clip(repr(budget))} is {float(nbytes):.3g} bytes, more than any memory "
                         f"(a budget is at most 2**63 - 1 bytes, 8 EiB): {HOW}")
    if nbytes <= 0:
        raise _not_positive(budget)
    return int(round(nbytes))


def is_floor(budget) -> bool:
    """Whether `budget` asks for the floor (the smallest peak any plan reaches)."""
    return isinstance(budget, str) and budget.strip().lower() == "floor"


def parse_budget(budget) -> tuple[str, float | int]:
    """("bytes", n) for bytes or a size, ("fraction", f) for a fraction of the
    unoptimized peak.  Raises ValueError, saying how to write one, for what
    cannot be read or is no amount of memory: zero, negative, NaN, infinite,
    over 2**63 - 1 bytes."""
    if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
        return "bytes", budget_int(int(budget), budget)
    if isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        f = float(budget)
        if not math.isfinite(f):
            raise ValueError(f"budget {budget!r} is not a finite number: {HOW}")
        if f <= 0:
            raise _not_positive(budget)
        return "fraction", f
    if not isinstance(budget, str):
        raise ValueError(f"cannot read budget {clip(repr(budget))} ({type(budget).__name__}): {HOW}")
    s = budget.strip().replace("_", "").replace(" ", "")
    if s.lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise ValueError(f"budget {clip(repr(budget))} is not a finite number: {HOW}")
    m = _NUMBER.fullmatch(s)
    if not m:
        raise ValueError(f"cannot read budget {clip(repr(budget))}: {HOW}")
    sign, num, unit = m.group(1), m.group(2), m.group(3).lower()
    value = float(num)
    if sign == "-" or value == 0:
        raise _not_positive(budget)
    if unit == "%":
        value /= 100.0
        if not math.isfinite(value):
            raise ValueError(f"budget {clip(repr(budget))} is not a finite number: {HOW}")
        return "fraction", value
    if unit == "" and "." in num and "e" not in num.lower():
        return "fraction", value
    if unit not in UNITS:
        raise ValueError(f"unknown unit {clip(repr(m.group(3)))} in budget {clip(repr(budget))}; "
                         f"use B, KB, MB, GB, KiB, MiB, GiB")
    return "bytes", budget_int(value * UNITS[unit], budget)


def host_budget_bytes(host_budget) -> int | None:
    """A host budget (what offloaded copies may hold on the host at once) in
    bytes: bytes or a size ("8GiB"), not a fraction; None for none.  Raises
    ValueError saying how to write one."""
    if host_budget is None:
        return None
    try:
        kind, amount = parse_budget(host_budget)
    except ValueError as e:
        raise ValueError(f"host budget: {e}") from None
    if kind != "bytes":
        raise ValueError(f"host budget {clip(repr(host_budget))} is a fraction; give bytes or a size (\"8GiB\")")
    return int(amount)


# The optimizer's safety stop in seconds, per search: its searches are bounded
# by counts, not time (remat_ir.optimize.problem.Settings), and a search this
# stops says so in its plan's header.
DEFAULT_TIME_LIMIT = 300.0


def check_time_limit(seconds) -> float:
    """The optimizer's time limit in seconds, as a float; ValueError unless it
    is a positive, finite number."""
    if isinstance(seconds, numbers.Real) and not isinstance(seconds, bool):
        s = float(seconds)
        if math.isfinite(s) and s > 0:
            return s
    raise ValueError(f"time_limit must be a positive, finite number of seconds, not {clip(repr(seconds))}")
