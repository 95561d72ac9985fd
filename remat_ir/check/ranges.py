"""A symbolic plan between the ends of its range.

The verifier checks a symbolic plan in full (graph, types, schedule, budget)
on its instantiations at the two ends of its range (`verify._verify_symbolic`).
What holds at the ends can fail between them: `$(T+0*(T//(T-20)))` divides by
zero at T=20 only, `[$(T*B+(T-2)*(48-T)), 128]` is the right view at T=2 and
T=48 only, a byte count can be exact at the ends and short in the middle.
So, over the range:

* Every size expression (dimensions, strides, byte counts, size arguments,
  size guards, the `size(...)` a guard reads) is evaluated at every point of
  the range where the size guards hold, all points at once (int64 tensors): no
  division by zero, no negative dimension, stride or byte count.  An owner's
  byte count relates to the bytes its shape and strides span as it does at
  the low end (equal, or more), and a view never spans beyond its owner.
  Exhaustive up to `MAX_POINTS` points (B=2..64 with T=2..1024 is 64k);
  a larger range is evaluated on a lattice: each symbol's sizes near both
  ends and evenly spaced between (`LATTICE` of them).  Not a proof there,
  which the docs say.
* Every byte count grows with each symbol, never shrinking from one size to
  the next: the schedule is the same at every size, so every peak is then
  at the high end, where the budget is checked.
* The graph is type-checked (ops run on fake tensors against the declared
  outputs) at degree + 1 sizes of each symbol, its highest degree over the
  plan's expressions: a shape or argument that is a polynomial in the sizes
  and agrees with what the op gives at that many distinct sizes agrees at
  every size, as two polynomials of degree d equal at d + 1 points are equal.
  (`//`, `%`, `max` and `min` are counted as their operands' degree: for
  them this is a check at more sizes, not a proof.)
"""
from __future__ import annotations

import itertools

import torch

from remat_ir.ir import DTYPE_BYTES, Program
from remat_ir.ir.guards import Guard, GuardError
from remat_ir.ir import sizes as sz

__all__ = ["MAX_POINTS", "LATTICE", "degree_points", "exhaustive", "range_errors"]

MAX_POINTS = 1 << 16
LATTICE = 64  # sizes per symbol beyond MAX_POINTS (fewer with 3 symbols or more): an eighth at each end, the rest evenly spread
MAX_TYPECHECKS = 12  # instantiations type-checked between the ends


def exhaustive(program: Program) -> bool:
    """Whether `range_errors` sees every size of the range (else a lattice of it)."""
    total = 1
    for r in sz.ranges(program).values():
        total *= r.high - r.low + 1
    return total <= MAX_POINTS


def _axes(program: Program) -> dict[str, torch.Tensor]:
    rs = sz.ranges(program)
    every = exhaustive(program)
    out = {}
    # Past MAX_POINTS, each symbol gets at most `per` sizes, so the lattice stays within it.
    per = max(4, min(LATTICE, int(MAX_POINTS ** (1 / max(len(rs), 1)))))
    for s, r in rs.items():
        if every or r.high - r.low + 1 <= per:
            out[s] = torch.arange(r.low, r.high + 1, dtype=torch.int64)
        else:
            e = per // 8
            ends = torch.cat([torch.arange(r.low, r.low + e), torch.arange(r.high - e + 1, r.high + 1)])
            mid = torch.linspace(r.low, r.high, per - 2 * e, dtype=torch.float64).round().to(torch.int64)
            out[s] = torch.unique(torch.cat([ends, mid]))
    return out


def range_errors(program: Program) -> list[tuple[int, str, str, int]]:
    """(line, message, section, index) for each size expression that fails
    somewhere in the range (see the module docstring).  Expects expressions
    already read and their symbols declared (`verify._symbolic_errors`)."""
    axes = _axes(program)
    names = list(axes)
    mesh = torch.meshgrid(*axes.values(), indexing="ij")
    shape = mesh[0].shape
    flat = {s: m.reshape(-1) for s, m in zip(names, mesh)}
    h = program.header
    errors: list[tuple[int, str, str, int]] = []
    try:
        held = sz.conditions_grid(h.size_guards, flat)
    except sz.SizeError as e:
        return [(h.lines.get("size_guards", 0), f"size guard: {e}", "header", 0)]
    # Points the size guards leave out are no call's: evaluated at the low end instead, and never compared.
    low = {s: int(a[0]) for s, a in axes.items()}
    grid = {s: torch.where(held, v, low[s]) for s, v in flat.items()}
    cache: dict = {}

    def at(k: int) -> str:
        return ", ".join(f"{s}={int(flat[s][k])}" for s in names)

    def value(x):
        if x not in cache:
            cache[x] = sz.evaluate_grid(x, grid)
        return cache[x]

    def first(bad) -> int | None:
        idx = torch.nonzero(bad & held)
        return int(idx[0, 0]) if len(idx) else None

    for g in h.guards:
        try:
            sizes = [name for kind, name in Guard(g).reads if kind == "size"]
        except GuardError:
            continue  # (the type check names it)
        for expr in sizes:
            try:
                value(expr)
            except sz.SizeError as e:
                errors.append((h.lines.get("guards", 0), f"guard {g!r}: size('{expr}'): {e}", "header", 0))
    for i, n in enumerate(program.nodes):
        for expr in sz.sym_exprs([*n.args, *n.kwargs.values()]):
            try:
                value(expr)
            except sz.SizeError as e:
                errors.append((n.line, f"node {n.name}: size argument `{expr}`: {e}", "nodes", i))
    values = program.value_map()

    def problem(v) -> str | None:
        """What is wrong with value `v`'s sizes somewhere in the range, or None."""
        dims, strides, nbytes = [value(d) for d in v.shape], [value(st) for st in v.stride], value(v.nbytes)
        for what, arrays in (("a dimension", dims), ("a stride", strides), ("its byte count", [nbytes])):
            for a in arrays:
                k = first(a < 0)
                if k is not None:
                    return f"value {v.name}: {what} is {int(a[k])} at {at(k)}; sizes are never negative"
        need = _spanned(dims, strides, v.dtype, len(grid[names[0]]))
        if v.storage != v.name:
            owner = values.get(v.storage)
            try:
                room = value(owner.nbytes) if owner is not None else None
            except sz.SizeError:
                return None  # (reported at the owner)
            k = first(need > room) if room is not None else None
            return None if k is None else (f"view {v.name} spans {int(need[k])} bytes at {at(k)}, beyond the "
                                           f"{int(room[k])} bytes of its storage {owner.name}")
        exact = bool(nbytes[0] == need[0])
        k = first(nbytes != need) if exact else first(nbytes < need)
        if k is not None:
            return (f"value {v.name}: byte count {v.nbytes} is {int(nbytes[k])} at {at(k)}, but its shape spans "
                    f"{int(need[k])} bytes there; it must be {'equal to' if exact else 'at least'} them at every "
                    "size of the range, as at its low end")
        k = _shrinks(nbytes.reshape(shape), held.reshape(shape))
        if k is not None:
            a, b = k
            return (f"value {v.name}: byte count {v.nbytes} shrinks from {int(nbytes[a])} at {at(a)} to "
                    f"{int(nbytes[b])} at {at(b)}; the plan's peak is checked at the high end of its range, which "
                    "holds only while byte counts grow with the sizes")
        return None

    for i, v in enumerate(program.values):
        if all(type(x) is int for x in [*v.shape, *v.stride, v.nbytes]):
            continue
        try:
            why = problem(v)
        except sz.SizeError as e:
            why = f"value {v.name}: {e}"
        if why:
            errors.append((v.line, why, "values", i))
    return errors


def _spanned(dims, strides, dtype: str, n: int):
    """`verify.needed_bytes` at every point."""
    span = torch.ones(n, dtype=torch.int64)
    empty = torch.zeros(n, dtype=torch.bool)
    for d, st in zip(dims, strides):
        span = span + (d - 1) * st
        empty |= d == 0
    return torch.where(empty, 0, span * DTYPE_BYTES.get(dtype, 4))


def _shrinks(a, held) -> tuple[int, int] | None:
    """Flat indices (before, after) of the first step along any axis where
    `a` decreases from one size the size guards allow to the next allowed
    one (guards such as `T % 64 == 0` leave gaps between them), or None."""
    flat = torch.arange(a.numel()).reshape(a.shape)
    for axis in range(a.ndim):
        n = a.shape[axis]
        if n < 2:
            continue
        va = a.movedim(axis, -1).reshape(-1, n)
        ok = held.movedim(axis, -1).reshape(-1, n)
        ix = flat.movedim(axis, -1).reshape(-1, n)
        pos = torch.arange(n).expand_as(va)
        last = torch.where(ok, pos, -1).cummax(dim=1).values  # the last allowed size at or before each
        prev = torch.cat([torch.full((va.shape[0], 1), -1), last[:, :-1]], dim=1)
        before = va.gather(1, prev.clamp(min=0))
        bad = torch.nonzero(ok & (prev >= 0) & (va < before))
        if len(bad):
            row, j = int(bad[0, 0]), int(bad[0, 1])
            return int(ix[row, int(prev[row, j])]), int(ix[row, j])
    return None


def degree_points(program: Program) -> list[dict[str, int]]:
    """Sizes to type-check the graph at, besides the two ends: for each
    symbol, degree + 1 sizes spread over its range (its highest degree over
    the plan's expressions), in every combination, each moved to the nearest
    size the size guards allow; at most MAX_TYPECHECKS of them."""
    rs = sz.ranges(program)
    texts: set[str] = set()
    for v in program.values:
        texts.update(x for x in [*v.shape, *v.stride, v.nbytes] if type(x) is str)
    for n in program.nodes:
        texts.update(sz.sym_exprs([*n.args, *n.kwargs.values()]))
    per: dict[str, list[int]] = {}
    for s, r in rs.items():
        d = max((sz.degree(t, s) for t in texts), default=1)
        k = min(max(d, 1) + 1, r.high - r.low + 1)
        per[s] = sorted({round(r.low + (r.high - r.low) * j / max(k - 1, 1)) for j in range(k)})
    ends = [tuple(e[s] for s in rs) for e in sz.ends(program)]
    out: list[dict[str, int]] = []
    for combo in itertools.product(*per.values()):
        if combo in ends:
            continue
        point = _allowed(program, dict(zip(rs, combo)), rs)
        if point is not None and point not in out and tuple(point.values()) not in ends:
            out.append(point)
        if len(out) >= MAX_TYPECHECKS:
            break
    return out


def _allowed(program: Program, point: dict[str, int], rs) -> dict[str, int] | None:
    """`point`, or the nearest sizes to it within the range that pass the size guards."""
    for step in range(0, 9):
        for sign in (1, -1):
            p = {s: min(max(x + sign * step, rs[s].low), rs[s].high) for s, x in point.items()}
            if not sz.check_sizes(program, p):
                return p
    return None
