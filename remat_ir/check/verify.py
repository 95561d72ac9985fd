"""Verifier: an independent proof that a program's schedule is sound.

`verify(program)` checks the schedule against the graph, and the graph
against what PyTorch computes (`remat_ir.check.typecheck`), and returns a
`Verdict` listing every error it finds, each naming the `.rir` line (or the
section and index when the program was built in memory) and saying what to
change.  It shares no code with the optimizer and does not trust the memory
simulator for liveness: the ordering, liveness, aliasing, mutation, random
replay and output rules are all re-derived here.  `simulate()` is used only
for the peak figures of a schedule already proven sound (and for the budget).

The rules (the runtime semantics the interpreter and autograd implement):

* values of kind input/param/buffer exist before the step and are never
  computed or freed; tangents appear at the start of backward and must be
  freed by the backward schedule;
* every node is `compute`d exactly once, forward nodes in the forward
  section, backward nodes in the backward section;
* `recompute` repeats a forward node already computed, whose outputs are all
  dead (and no live view still holds an output's storage); it may replay a
  random node (the interpreter replays its RNG state) but never apply an
  in-place update twice to the same storage (a buffer update can never be
  recomputed; `bernoulli_` on a temporary can, once the temporary's producer
  was recomputed into a fresh storage), nor read a storage updated in place
  since it was first computed;
* every operand of a compute/recompute is live; a view becomes live only while
  its storage is live (a storage lives while any value aliasing it is live);
* `free V` needs V live, and V not a graph input, a forward result or a
  gradient output; every value made live is freed once per lifetime by the end
  of backward, except forward results (the caller holds them) and gradient
  outputs (handed to autograd right after the last instruction that writes
  them, computing them or updating them in place, and never read after it);
* in-place updates keep graph order: a node reading a storage (through any
  value aliasing it) sees exactly the updates that precede it in the graph,
  so a reader of the old data never runs after the update and a reader of the
  new data never before it (readers after an update may name the updated
  operand itself: `native_batch_norm_backward` reads the running stats
  `native_batch_norm` updated, as eager autograd does);
* the graph is consistent: names are declared and unique, shapes, strides and
  byte counts agree, views name their storage owner, outputs are well formed
  (a gradient has its parameter's shape and dtype), every trainable parameter
  that some node reads gets a gradient, list arguments nest at most 32 deep
  (`MAX_NESTING`);
* the graph is what PyTorch computes (`remat_ir.check.typecheck`, skipped with
  `graph=False`): every op exists, and run under FakeTensorMode on the declared
  operands it produces each output's declared dtype, shape, strides, bytes and
  storage owner; `random` and `mutates(...)` say what the op does; literal
  numbers the kernels check and the fake run does not (a probability, a fill
  value, an `output_mask`, a pointwise op's scalars) are ones they take; the
  header's device (`cpu`, `cuda`, `cuda:N`, as `device(...)` arguments),
  optimizer, output_spec, has_loss and the tangents' sources are ones the
  runtime accepts;
* the graph section and the header facts derived from the model still hash
  to the header's fingerprint (they were not edited after compiling), and
  every node, run on fake tensors of its declared operands, produces what
  its outputs declare (`remat_ir.check.typecheck`);
* the graph rewrites the header lists compute what the regions they stand
  for computed (`remat_ir.check.rewritten`: a chunked loss covers every row
  once and sums every chunk once; a BatchNorm split updates the running
  statistics once and normalizes purely);
* offload (the semantics: `remat_ir.check.simulate`): `offload V`,
  `reload V` and `wait V` name a value that owns its storage, made by a node,
  neither a forward result nor a gradient output; an offload needs V live on
  the device with no copy of it in flight, a reload needs V on the host (its
  offload waited), a wait needs a copy of V in flight; after an offload's
  wait no other live value may alias V's storage; nothing writes V's storage
  while its copy to the host is in flight; V is not read while on the host or
  while its reload is in flight; its producer is not recomputed while V is
  offloaded; `free V` on the host drops its host copy; at the end of backward
  no copy is in flight and no value is left on the host;
* with a budget in the header, the simulated peak (steady state and first
  step, whichever is larger) in the budget's scope fits it; with a
  `host_budget`, so does the host pool's peak (offloaded copies).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from remat_ir.ir import (
    BACKWARD, BUFFER, COMPUTE, DTYPE_BYTES, FORWARD, FREE, GRAD, INPUT, MAX_NESTING, OFFLOAD, PARAM, RECOMPUTE,
    RELOAD, RESULT, TANGENT, TRANSFER_INSTRS, VALUE, VALUE_KINDS, WAIT, Node, Program, arg_depth, hand_overs,
    node_inputs,
)
from remat_ir.ir import sizes as sz
from remat_ir.ir.printer import human_bytes
from remat_ir.ir.syntax import clip
from remat_ir.ir.fingerprint import fingerprint
from remat_ir.check.ranges import degree_points, range_errors
from remat_ir.check.simulate import MemoryReport, SimulationError, simulate
from remat_ir.check.rewritten import check_rewrites
from remat_ir.check.typecheck import typecheck

MAX_ERRORS = 50

GRAPH_INPUT_KINDS = (INPUT, PARAM, BUFFER)
_SECTION_RANK = {"header": 0, "values": 1, "nodes": 2, "forward": 3, "start": 3, "backward": 4,
                 "outputs": 5, "": 6}


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class Diagnostic:
    """One error.  `line` is the `.rir` line (0 when unknown); then `section`
    ("forward", "backward", "values", "nodes", "outputs", "header") and
    `index` (-1: the section as a whole) say where it is."""

    line: int
    message: str
    section: str = ""
    index: int = -1

    def __post_init__(self):
        # Messages echo names; a 2 MB name in a generated plan must not make a 2 MB line.
        object.__setattr__(self, "message", clip(self.message))

    @property
    def where(self) -> str:
        if self.line:
            return f"line {self.line}"
        if self.section:
            if self.index >= 0:
                return f"{self.section}[{self.index}]"
            return f"start of {self.section}" if self.section in ("forward", "backward") else self.section
        return ""

    def __str__(self) -> str:
        w = self.where
        return f"{w}: {self.message}" if w else self.message


@dataclass
class Verdict:
    ok: bool
    errors: list[Diagnostic] = field(default_factory=list)
    report: MemoryReport | None = None  # steady state: `.grad` present
    report_first_step: MemoryReport | None = None  # first step: `.grad` absent
    omitted: int = 0  # errors found beyond the cap and left out of `errors`

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return "ok"
        lines = [str(e) for e in self.errors]
        if self.omitted:
            lines.append(f"... and {self.omitted} more errors")
        return "\n".join(lines)


# ------------------------------------------------------------------ helpers

Loc = tuple  # (section, index, line)


def _where(loc: Loc) -> str:
    section, index, line = loc
    if line:
        return f"line {line}"
    if index < 0:
        return f"the start of {section}"
    return f"{section}[{index}]"


def _after(a: Loc, b: Loc) -> bool:
    """Whether schedule location `a` comes after `b`."""
    rank = {"forward": 0, "backward": 1}
    return (rank.get(a[0], 2), a[1]) > (rank.get(b[0], 2), b[1])


def needed_bytes(shape: list[int], stride: list[int], dtype: str) -> int:
    """Bytes a tensor of this shape and stride spans from its storage offset."""
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(shape, stride))) * DTYPE_BYTES[dtype]


# After an error about a size expression in a plan without a `sizes` line.
_NO_SIZES = " (a size expression: only a symbolic plan, with a `sizes` line declaring its symbols, has them)"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ----------------------------------------------------------------- verifier


def verify(program: Program, *, max_errors: int = MAX_ERRORS, graph: bool = True) -> Verdict:
    """Check `program`; return every error found (sorted, at most `max_errors`).

    A symbolic program (`header.sizes`, `remat_ir.ir.sizes`) is checked over
    its range: its size expressions are well formed and name declared
    symbols, each symbol is a whole dimension of an input, its fingerprint
    matches, and the program verifies at each end of the range
    (`sizes.ends`, via `sizes.instantiate`), each error saying at which
    sizes; the report is the high end's.

    `graph=False` skips the type check of the graph section against PyTorch
    (`remat_ir.check.typecheck`, the costly part: it runs each op on fake
    tensors, and the first time in a process imports FakeTensorMode's
    machinery; its time on GPT-2 medium is in docs/09-benchmarks.md): for callers that changed only the schedule of a
    plan whose graph was checked already.  The graph's consistency (names, shapes
    against byte counts, views, outputs) is always checked."""
    if program.header.sizes:
        return _verify_symbolic(program, max_errors, graph)
    return _verify_concrete(program, max_errors, graph)


def _verify_concrete(program: Program, max_errors: int, graph: bool) -> Verdict:
    v = _Verifier(program)
    v.check_graph()
    if graph:
        v.check_fingerprint()
        for loc, message in typecheck(program):
            v.err(loc, message)
    for loc, message in check_rewrites(program):
        v.err(loc, message)
    v.check_schedule()
    errors = v.errors
    report = first = None
    if not errors:
        try:
            report = simulate(program, grads_present=True)
            first = simulate(program, grads_present=False)
        except SimulationError as e:  # pragma: no cover - would be a verifier bug
            errors.append(Diagnostic(0, f"the memory simulator refused a schedule the verifier "
                                        f"accepted ({e}); this is a bug in remat-ir"))
        else:
            v.check_budget(report, first)
            v.check_host_budget(report)
    _sort(errors)
    omitted = max(0, len(errors) - max_errors)
    return Verdict(ok=not errors, errors=errors[:max_errors], report=report,
                   report_first_step=first, omitted=omitted)


def _sort(errors: list[Diagnostic]) -> None:
    errors.sort(key=lambda d: (d.line, _SECTION_RANK.get(d.section, 6), d.index))


def _at(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def _verify_symbolic(program: Program, max_errors: int, graph: bool) -> Verdict:
    errors = _symbolic_errors(program)
    if graph:
        v = _Verifier(program)
        v.check_fingerprint()  # of the symbolic program; each instantiation has its own
        errors += v.errors
    report = first = None
    if not errors:
        h = program.header
        found: dict[tuple, list[str]] = {}
        for at in sz.ends(program):
            try:
                concrete = sz.instantiate(program, at)
            except sz.SizeError as e:
                if e.line or e.section:  # a value's or node's own expression
                    found.setdefault((e.line, str(e), e.section, e.index), []).append(_at(at))
                    continue
                errors.append(Diagnostic(h.lines.get("size_guards", h.lines.get("sizes", 0)),
                                         f"at {_at(at)}, an end of the plan's range: {e}; the plan is verified "
                                         "at the ends of its range, so they must pass its size guards", "header"))
                continue
            concrete.header.lines = dict(h.lines)
            verdict = _verify_concrete(concrete, max_errors, graph)
            for d in verdict.errors:
                found.setdefault((d.line, d.message, d.section, d.index), []).append(_at(at))
            report, first = verdict.report, verdict.report_first_step  # (the high end's: last)
        for (line, message, section, index), ats in found.items():
            errors.append(Diagnostic(line, f"at {' and at '.join(ats)}: {message}", section, index))
    if not errors:
        # Between the ends: every size expression at every size, the graph at degree + 1 sizes.
        errors += [Diagnostic(*e) for e in range_errors(program)]
    if not errors and graph:
        found = {}
        try:
            points = degree_points(program)
        except sz.SizeError as e:
            points = []
            errors.append(Diagnostic(h.lines.get("size_guards", h.lines.get("sizes", 0)), f"size guard: {e}",
                                     "header"))
        for at in points:
            try:
                concrete = sz.instantiate(program, at)
            except sz.SizeError as e:
                found.setdefault((e.line or h.lines.get("sizes", 0), str(e), e.section or "header", e.index),
                                 []).append(_at(at))
                continue
            concrete.header.lines = dict(h.lines)
            v = _Verifier(concrete)
            v.check_graph()
            for loc, message in typecheck(concrete):
                v.err(loc, message)
            for d in v.errors:
                found.setdefault((d.line, d.message, d.section, d.index), []).append(_at(at))
        for (line, message, section, index), ats in found.items():
            errors.append(Diagnostic(line, f"at {' and at '.join(ats)}, inside the plan's range: {message}",
                                     section, index))
    _sort(errors)
    omitted = max(0, len(errors) - max_errors)
    return Verdict(ok=not errors, errors=errors[:max_errors], report=report if not errors else None,
                   report_first_step=first if not errors else None, omitted=omitted)


def _symbolic_errors(program: Program) -> list[Diagnostic]:
    """What is wrong with a symbolic program's size expressions, ranges and
    guards, before it is instantiated."""
    h = program.header
    out: list[Diagnostic] = []
    sizes_line = h.lines.get("sizes", 0)
    declared: dict[str, sz.SizeRange] = {}
    for r_text in h.sizes:
        try:
            r = sz.parse_range(r_text)
        except sz.SizeError as e:
            out.append(Diagnostic(sizes_line, f"size range: {e}", "header"))
            continue
        if r.symbol in declared:
            out.append(Diagnostic(sizes_line, f"size symbol {r.symbol} is given two ranges", "header"))
        declared[r.symbol] = r

    def check(x, what: str, line: int, section: str, index: int) -> None:
        if type(x) is int:
            return
        if not isinstance(x, str):
            out.append(Diagnostic(line, f"{what} is {x!r}, neither an integer nor a size expression",
                                  section, index))
            return
        try:
            sz.size_text(x)
            names = sz.expr_symbols(x)
        except (sz.SizeError, RecursionError) as e:
            out.append(Diagnostic(line, f"{what}: {e}", section, index))
            return
        for s in names:
            if s not in declared:
                out.append(Diagnostic(line, f"{what} `{x}` names the size symbol {s}, which the header's "
                                            f"`sizes` line does not declare (declared: "
                                            f"{', '.join(declared) or 'none'})", section, index))

    for i, v in enumerate(program.values):
        for d in v.shape:
            check(d, f"value {v.name}: dimension", v.line, "values", i)
        for st in v.stride:
            check(st, f"value {v.name}: stride", v.line, "values", i)
        check(v.nbytes, f"value {v.name}: byte count", v.line, "values", i)
    for i, n in enumerate(program.nodes):
        for x in sz.sym_exprs([*n.args, *n.kwargs.values()]):
            check(x, f"node {n.name}: size argument", n.line, "nodes", i)
    guards_line = h.lines.get("size_guards", 0)
    high = {s: r.high for s, r in declared.items()}
    for g in h.size_guards:
        try:
            names = sz.expr_symbols(g)
            undeclared = [s for s in names if s not in declared]
            if undeclared:
                out.append(Diagnostic(guards_line, f"size guard `{g}` names the size symbol {undeclared[0]}, which "
                                                   "the header's `sizes` line does not declare", "header"))
                continue
            sz.condition_holds(g, high)
        except (sz.SizeError, RecursionError) as e:
            out.append(Diagnostic(guards_line, f"size guard: {e}", "header"))
    bound = {d for v in program.values if v.kind == INPUT for d in v.shape if isinstance(d, str)}
    for s in declared:
        if s not in bound:
            out.append(Diagnostic(sizes_line, f"size symbol {s} is no whole dimension of any input, so a call's "
                                              f"shapes cannot tell its size; give some input a dimension {s}, "
                                              "or remove the symbol", "header"))
    return out


class _Verifier:
    def __init__(self, program: Program):
        self.p = program
        self.errors: list[Diagnostic] = []
        self.values: dict = {}
        for val in program.values:
            self.values.setdefault(val.name, val)
        self.nodes: dict[str, Node] = {}
        for n in program.nodes:
            self.nodes.setdefault(n.name, n)
        self.inputs: dict[int, list[str]] = {id(n): node_inputs(n) for n in program.nodes}
        self.producer: dict[str, Node] = {}
        for n in program.nodes:
            for o in n.outputs:
                if o:
                    self.producer.setdefault(o, n)
        # Graph order: forward nodes, then backward nodes, each in list order.
        order = [n for n in program.nodes if n.phase == FORWARD] + \
                [n for n in program.nodes if n.phase != FORWARD]
        self.gidx = {}
        for i, n in enumerate(order):
            self.gidx.setdefault(n.name, i)
        self.results: dict[str, str] = {}  # value -> result key
        self.grad_of: dict[str, list[str]] = {}  # grad value -> keys
        for o in program.outputs:
            if o.kind == RESULT:
                self.results.setdefault(o.value, o.key)
            elif o.kind == GRAD:
                self.grad_of.setdefault(o.value, []).append(o.key)
        self._suggestions_left = 10
        self.too_deep = False  # some node has an argument nested more than MAX_NESTING deep

    # ------------------------------------------------------------ reporting

    def err(self, loc: Loc, message: str) -> None:
        section, index, line = loc
        self.errors.append(Diagnostic(line, message, section, index))

    def _did_you_mean(self, name: str, pool) -> str:
        if self._suggestions_left <= 0:
            return ""
        self._suggestions_left -= 1
        close = difflib.get_close_matches(name, pool, n=1, cutoff=0.75)
        return f" (did you mean {close[0]}?)" if close else ""

    # ---------------------------------------------------------------- graph

    def check_fingerprint(self) -> None:
        """The graph section and the header facts derived from the model are
        what the tracer wrote (see remat_ir.ir.fingerprint); an empty
        fingerprint (a hand-written plan) is not checked."""
        h = self.p.header
        if not h.fingerprint or self.too_deep:  # (too deep: reported, and too deep for msgspec to hash)
            return
        now = fingerprint(self.p)
        if now != h.fingerprint:
            self.err(("header", -1, h.lines.get("fingerprint", 0)),
                     f"the plan's graph section or header no longer matches its fingerprint "
                     f"{h.fingerprint} (it now hashes to {now}): they are derived from the model, and "
                     f"were edited after compiling; recompile the plan, or edit only the schedule "
                     f"(the forward and backward sections); remat-verify PLAN --model MODEL names the "
                     f"first op that differs")

    def check_graph(self) -> None:
        p = self.p
        values = self.values
        h = p.header
        if h.budget is not None:
            budget_loc = ("header", -1, h.lines.get("budget", 0))
            if h.budget.scope not in ("total", "activations"):
                self.err(budget_loc, f"budget scope {h.budget.scope!r} is unknown; use 'total' or "
                                     "'activations'")
            if not _is_int(h.budget.bytes) or h.budget.bytes < 0:
                self.err(budget_loc, f"budget of {h.budget.bytes!r} bytes is not a non-negative integer")
        if h.host_budget is not None and (not _is_int(h.host_budget) or h.host_budget < 0):
            self.err(("header", -1, h.lines.get("host_budget", 0)),
                     f"host budget of {h.host_budget!r} bytes is not a non-negative integer")

        seen: set[str] = set()
        for i, val in enumerate(p.values):
            loc = ("values", i, val.line)
            name = val.name
            if not name:
                self.err(loc, "a value has an empty name")
            if name in seen:
                self.err(loc, f"value {name} is declared twice; rename one of them")
            seen.add(name)
            if val.kind not in VALUE_KINDS:
                self.err(loc, f"value {name} has unknown kind {val.kind!r}; expected one of "
                              f"{', '.join(VALUE_KINDS)}")
            shape_ok = True
            if val.dtype not in DTYPE_BYTES:
                self.err(loc, f"value {name} has unknown dtype {val.dtype!r}")
                shape_ok = False
            if len(val.shape) != len(val.stride):
                self.err(loc, f"value {name} has {len(val.shape)} dims but {len(val.stride)} strides "
                              f"(shape {val.shape}, stride {val.stride})")
                shape_ok = False
            if any(not _is_int(d) or d < 0 for d in val.shape):
                self.err(loc, f"value {name} has a negative or non-integer size in shape {val.shape}"
                              + _NO_SIZES * any(isinstance(d, str) for d in val.shape))
                shape_ok = False
            if any(not _is_int(s) or s < 0 for s in val.stride):
                self.err(loc, f"value {name} has a negative or non-integer stride in {val.stride}"
                              + _NO_SIZES * any(isinstance(d, str) for d in val.stride))
                shape_ok = False
            if not _is_int(val.nbytes) or val.nbytes < 0:
                self.err(loc, f"value {name} has invalid nbytes {val.nbytes!r}" + _NO_SIZES * isinstance(val.nbytes, str))
                shape_ok = False
            need = needed_bytes(val.shape, val.stride, val.dtype) if shape_ok else 0
            if val.storage == name:
                if shape_ok and val.nbytes < need:
                    self.err(loc, f"value {name} {val.dtype}{val.shape} with stride {val.stride} needs "
                                  f"{need} bytes of storage but nbytes is {val.nbytes}; set nbytes to "
                                  f"at least {need} or fix its shape")
            else:
                owner = values.get(val.storage)
                if owner is None:
                    self.err(loc, f"value {name} is a view of storage {val.storage}, which is not a "
                                  f"declared value" + self._did_you_mean(val.storage, values))
                elif owner.storage != owner.name:
                    self.err(loc, f"value {name} names {val.storage} as its storage, but "
                                  f"{val.storage} is itself a view of {owner.storage}; a view's "
                                  f"storage must be the owner ({owner.storage})")
                else:
                    if _is_int(val.nbytes) and val.nbytes != 0:
                        self.err(loc, f"view {name} has nbytes {val.nbytes}; a view owns no bytes "
                                      f"(they are counted on {val.storage}), set it to 0")
                    if shape_ok and _is_int(owner.nbytes) and need > owner.nbytes:
                        self.err(loc, f"view {name} {val.dtype}{val.shape} with stride {val.stride} "
                                      f"spans {need} bytes but its storage {owner.name} has only "
                                      f"{owner.nbytes}")
            prod = self.producer.get(name)
            if val.kind in GRAPH_INPUT_KINDS + (TANGENT,) and prod is not None:
                self.err(loc, f"{val.kind} {name} is produced by node {prod.name}; a {val.kind} "
                              f"exists before the step, declare the node's output as a new value")
            elif val.kind == VALUE and prod is None:
                self.err(loc, f"value {name} is not produced by any node; declare it as an input, "
                              f"or add the node that computes it")

        node_seen: set[str] = set()
        out_seen: dict[str, str] = {}
        for i, n in enumerate(p.nodes):
            loc = ("nodes", i, n.line)
            if n.name in node_seen:
                self.err(loc, f"node {n.name} is declared twice; rename one of them")
            node_seen.add(n.name)
            if n.phase not in (FORWARD, BACKWARD):
                self.err(loc, f"node {n.name} has unknown phase {n.phase!r}; expected forward or backward")
            for o in n.outputs:
                if not o:
                    continue
                if o in out_seen and out_seen[o] != n.name:
                    self.err(loc, f"value {o} is an output of both {out_seen[o]} and {n.name}; "
                                  f"each value has one producer")
                elif o in out_seen:
                    self.err(loc, f"node {n.name} lists output {o} twice")
                out_seen.setdefault(o, n.name)
            if any(arg_depth(a, MAX_NESTING) > MAX_NESTING for a in list(n.args) + list(n.kwargs.values())):
                self.too_deep = True
                self.err(loc, f"node {n.name}: an argument has lists nested more than {MAX_NESTING} deep; an "
                              f"op takes flat lists (`[2, 3]`, `[x, y]`), and the .rir reader refuses deeper ones")
            ins = self.inputs[id(n)]
            for m in n.mutates:
                if m not in ins:
                    self.err(loc, f"node {n.name} mutates {m}, which is not one of its operands "
                                  f"({', '.join(ins) or 'none'})")

        rkeys: set[str] = set()
        gkeys: set[str] = set()
        for i, o in enumerate(p.outputs):
            loc = ("outputs", i, o.line)
            if o.kind not in (RESULT, GRAD):
                self.err(loc, f"output {o.key} has unknown kind {o.kind!r}; expected result or grad")
                continue
            val = values.get(o.value)
            if val is None:
                self.err(loc, f"{o.kind} output {o.key} names {o.value}, which is not a declared value"
                         + self._did_you_mean(o.value, values))
                continue
            prod = self.producer.get(o.value)
            if o.kind == RESULT:
                if o.key in rkeys:
                    self.err(loc, f"result {o.key} is declared twice")
                rkeys.add(o.key)
                if prod is None:
                    self.err(loc, f"result {o.key} is {o.value}, a {val.kind}; results must be "
                                  f"computed by a forward node")
                elif prod.phase != FORWARD:
                    self.err(loc, f"result {o.key} is {o.value}, computed by backward node {prod.name}; "
                                  f"results must be computed by a forward node")
            else:
                if o.key in gkeys:
                    self.err(loc, f"the gradient of {o.key} is declared twice; keep one grad output")
                gkeys.add(o.key)
                if len(self.grad_of.get(o.value, ())) > 1 and self.grad_of[o.value][0] != o.key:
                    # (autograd takes a gradient's tensor as `.grad`: one tensor cannot be two)
                    self.err(loc, f"the gradient of {o.key} is {o.value}, already the gradient of "
                                  f"{self.grad_of[o.value][0]}; each gradient output is a value of its own")
                target = values.get(o.key)
                if target is None:
                    self.err(loc, f"grad output for {o.key}: no value is named {o.key}"
                             + self._did_you_mean(o.key, values))
                elif target.kind not in (PARAM, INPUT):
                    self.err(loc, f"grad output for {o.key}: {o.key} is a {target.kind}; only "
                                  f"parameters and inputs have gradients")
                elif list(target.shape) != list(val.shape):
                    self.err(loc, f"the gradient of {o.key} is {o.value} with shape {val.shape}, but "
                                  f"{o.key} has shape {target.shape}")
                elif target.dtype != val.dtype:
                    self.err(loc, f"the gradient of {o.key} is {o.value} of dtype {val.dtype}, but "
                                  f"{o.key} is {target.dtype}")
                if prod is None:
                    self.err(loc, f"the gradient of {o.key} is {o.value}, a {val.kind}; a gradient "
                                  f"must be computed by a backward node")
                elif prod.phase != BACKWARD:
                    self.err(loc, f"the gradient of {o.key} is {o.value}, computed by forward node "
                                  f"{prod.name}; a gradient must be computed by a backward node")
                if o.value in self.results:
                    self.err(loc, f"{o.value} is both a forward result and the gradient of {o.key}")

        read: set[str] = set()
        for n in p.nodes:
            read.update(self.inputs[id(n)])
        for i, val in enumerate(p.values):
            if val.kind == PARAM and val.requires_grad and val.name not in gkeys and val.name in read:
                self.err(("values", i, val.line), f"gradient of {val.name} is never produced: the parameter "
                                           f"requires grad but no `grad {val.name}` output exists")

    # ------------------------------------------------------------- schedule

    def check_schedule(self) -> None:
        p = self.p
        values = self.values
        self.live: set[str] = set()
        self.phantom: set[str] = set()  # revived after an error: not reported again
        self.srefs: dict[str, int] = {}  # storage -> live values aliasing it
        self.freed_at: dict[str, Loc] = {}
        self.handed_at: dict[str, Loc] = {}
        self.hand_overs = hand_overs(p)  # backward index -> gradients autograd takes after it
        self.last_touch: dict[str, Loc] = {}
        self.computed_at: dict[str, Loc] = {}
        self.computed_t: dict[str, int] = {}
        # In-place updates.  A node must see a storage exactly as the graph
        # order says: updated by the mutators before it, not by those after.
        self.mutators: dict[str, list[tuple[int, str, str]]] = {}  # storage -> [(graph index, node, operand)]
        for n in p.nodes:
            for m in n.mutates:
                if m in values and self.nodes.get(n.name) is n:
                    self.mutators.setdefault(values[m].storage, []).append(
                        (self.gidx.get(n.name, 0), n.name, m))
        # A storage *instance* is one allocation: a recompute of its owner after
        # it was released makes a fresh one, which no update has touched yet.
        self.inst: dict[str, int] = {}  # live storage -> its current instance
        self.n_inst = 0
        self.inst_ran: dict[int, dict[str, tuple[int, Loc]]] = {}  # instance -> mutator -> (t, loc)
        self.reported_refs: set[str] = set()  # nodes whose undeclared names were reported
        self.made_at: dict[str, Loc] = {}  # value -> where its current lifetime began
        # Offload: the copy of each value in flight (OFFLOAD or RELOAD, where it
        # started), the values on the host (where offloaded, where waited), and
        # the storage instance each left on the device (a reload's data is the
        # same data, in-place updates included).
        self.copying: dict[str, tuple[str, Loc]] = {}
        self.on_host: dict[str, tuple[Loc, Loc]] = {}
        self.host_inst: dict[str, int | None] = {}
        self.reloads: dict[str, list[Loc]] = {}  # value -> every `reload` of it, in order
        for section, instrs in (("forward", p.forward), ("backward", p.backward)):
            for i, ins in enumerate(instrs):
                if ins.kind == RELOAD:
                    self.reloads.setdefault(ins.target, []).append((section, i, ins.line))

        # Where each node is first `compute`d, for messages about order.
        self.first_compute: dict[str, Loc] = {}
        for section, instrs in (("forward", p.forward), ("backward", p.backward)):
            for i, ins in enumerate(instrs):
                if ins.kind == COMPUTE:
                    self.first_compute.setdefault(ins.target, (section, i, ins.line))

        for val in p.values:
            if val.kind in GRAPH_INPUT_KINDS:
                self._make_live(val.name, ("forward", -1, 0))
        t = 0
        for section, instrs in (("forward", p.forward), ("backward", p.backward)):
            if section == "backward":
                self._end_of_forward()
                start = ("backward", -1, 0)
                for val in p.values:
                    if val.kind == TANGENT and val.name not in self.live:
                        self._make_live(val.name, start)
            for i, ins in enumerate(instrs):
                t += 1
                loc = (section, i, ins.line)
                if ins.kind in (COMPUTE, RECOMPUTE):
                    self._exec_node(ins.kind, ins.target, loc, t)
                elif ins.kind == FREE:
                    self._exec_free(ins.target, loc)
                elif ins.kind in TRANSFER_INSTRS:
                    self._exec_transfer(ins.kind, ins.target, loc)
                else:
                    self.err(loc, f"unknown instruction {ins.kind!r} {ins.target}; expected compute, "
                                  f"recompute, free, offload, reload or wait")
        self._end_of_backward()

    # state changes

    def _make_live(self, name: str, loc: Loc, phantom: bool = False, instance: int | None = None) -> None:
        """`name` live from `loc`; `instance`: the storage instance it holds
        again (a reload), else a new one when its storage was not live."""
        self.live.add(name)
        s = self.values[name].storage
        if instance is not None:
            self.inst[s] = instance
        elif self.srefs.get(s, 0) <= 0:  # a new allocation
            self.n_inst += 1
            self.inst[s] = self.n_inst
        self.srefs[s] = self.srefs.get(s, 0) + 1
        self.last_touch[name] = loc
        self.made_at[name] = loc
        if phantom:
            self.phantom.add(name)
        else:
            self.phantom.discard(name)

    def _drop(self, name: str) -> None:
        self.live.discard(name)
        self.phantom.discard(name)
        s = self.values[name].storage
        self.srefs[s] = self.srefs.get(s, 0) - 1

    # instructions

    def _exec_node(self, verb: str, name: str, loc: Loc, t: int) -> None:
        values = self.values
        section = loc[0]
        node = self.nodes.get(name)
        if node is None:
            msg = f"{verb} {name}: no node is named {name}"
            prod = self.producer.get(name)
            if prod is not None:
                msg += f"; {name} is a value computed by node {prod.name}, write `{verb} {prod.name}`"
            elif name in values:
                msg += f"; {name} is a {values[name].kind}, not a node"
            else:
                msg += self._did_you_mean(name, self.nodes)
            self.err(loc, msg)
            return
        ok = True
        first = name not in self.computed_at
        if verb == COMPUTE:
            if not first:
                self.err(loc, f"compute {name}: {name} was already computed at "
                              f"{_where(self.computed_at[name])}; a node is computed once, write "
                              f"`recompute {name}` to run it again")
                ok = False
            elif node.phase == FORWARD and section == "backward":
                self.err(loc, f"compute {name}: {name} is a forward node but is first computed in the "
                              f"backward section; add `compute {name}` to the forward section (a later "
                              f"`recompute {name}` in backward is allowed)")
                ok = False
            elif node.phase == BACKWARD and section == "forward":
                self.err(loc, f"compute {name}: {name} is a backward node and cannot run in the forward "
                              f"section; move it into the backward section")
                ok = False
        else:
            if node.phase != FORWARD:
                self.err(loc, f"recompute {name}: {name} is a backward node; only forward nodes can be "
                              f"recomputed, so keep the outputs of {name} live until their last use "
                              f"instead")
                ok = False
            elif first:
                fc = self.first_compute.get(name)
                if fc is not None:
                    self.err(loc, f"recompute {name} comes before its first `compute {name}` at "
                                  f"{_where(fc)}; a recompute repeats a node already computed")
                else:
                    self.err(loc, f"recompute {name}: {name} is never computed; write `compute {name}`")
                ok = False
            for m in node.mutates:
                msg = self._double_update(name, m)
                if msg:
                    self.err(loc, msg)
                    ok = False

        # Names the node uses that the graph does not declare (reported once per node).
        inputs = self.inputs[id(node)]
        outs = [o for o in node.outputs if o]
        if name not in self.reported_refs:
            self.reported_refs.add(name)
            for o in outs:
                if o not in values:
                    self.err(loc, f"{verb} {name}: its output {o} is not a declared value; declare it "
                                  f"in the graph" + self._did_you_mean(o, values))
                    ok = False

        # Operands.
        for r in inputs:
            if r not in values:
                self.err(loc, f"{verb} {name} reads {r}, which is not a declared value"
                         + self._did_you_mean(r, values))
                ok = False
                continue
            if r in self.on_host or self.copying.get(r, ("",))[0] == RELOAD:
                self.err(loc, self._host_read(verb, name, r, loc))
                ok = False
                continue  # (still on the host: a later reload finds it there)
            if r not in self.live:
                self.err(loc, self._dead_read(verb, name, r, loc))
                ok = False
                self._make_live(r, loc, phantom=True)  # report each dead lifetime once
                continue
            self.last_touch[r] = loc
            if values[r].storage in self.mutators:
                msg = self._stale_read(verb, name, r, t)
                if msg:
                    self.err(loc, msg)
                    ok = False

        # Nothing writes a storage while its copy to the host is in flight.
        for m in node.mutates:
            s = values[m].storage if m in values else None
            if s in self.copying and self.copying[s][0] == OFFLOAD:
                alias = "" if s == m else f" (a view of {s})"
                self.err(loc, f"{verb} {name} writes {m}{alias} in place while the copy of {s} to the host "
                              f"(offload at {_where(self.copying[s][1])}) is in flight, so the host copy could "
                              f"hold either data; move `wait {s}` before {_where(loc)}")
                ok = False

        # Outputs must be dead before a node runs again (a repeated `compute`
        # was reported above already).
        offloaded: set[str] = set()
        if verb == RECOMPUTE:
            for o in outs:
                if o not in values:
                    continue
                if o in self.on_host or o in self.copying:
                    at = self.copying[o][1] if o in self.copying else self.on_host[o][0]
                    state = "on its way to the host" if self.copying.get(o, ("",))[0] == OFFLOAD else \
                        "being reloaded" if o in self.copying else "on the host"
                    self.err(loc, f"{verb} {name}: its output {o} is {state} (offloaded at {_where(at)}); "
                                  f"reload {o} instead of recomputing it, or free {o} before this {verb}")
                    offloaded.add(o)
                    ok = False
                    continue
                if o in self.live:
                    self.err(loc, f"{verb} {name}: its output {o} is still live (made at "
                                  f"{_where(self.made_at.get(o, loc))}); free {o} before this "
                                  f"{verb}, or drop the {verb} and keep {o}")
                    ok = False
                elif values[o].storage == o and self.srefs.get(o, 0) > 0:
                    holders = sorted(x for x in self.live if values[x].storage == o)[:3]
                    self.err(loc, f"{verb} {name}: the storage of its output {o} is still held by live "
                                  f"view(s) {', '.join(holders)}; free them before this {verb}")
                    ok = False

        # Outputs become live.
        for o in outs:
            if o not in values or o in self.live or o in offloaded:
                continue
            s = values[o].storage
            if s != o and s in values and self.srefs.get(s, 0) <= 0:
                self.err(loc, f"{verb} {name}: its output {o} is a view of {s}, whose storage is not "
                              f"live here; {s} (or a view of it) must be live at this point")
                ok = False
            self._make_live(o, loc, phantom=not ok)

        if verb == COMPUTE and first:
            self.computed_at[name] = loc
            self.computed_t[name] = t
        for m in node.mutates:
            if m in values:
                inst = self.inst.get(values[m].storage)
                if inst is not None:
                    self.inst_ran.setdefault(inst, {}).setdefault(name, (t, loc))

        # Gradient outputs go to autograd right after the last instruction
        # writing them (`hand_overs`); computed in forward, right away.
        if section == "forward":
            for o in outs:
                if o in self.grad_of and o in self.live:
                    self.err(loc, f"{verb} {name} produces {o}, the gradient of "
                                  f"{', '.join(self.grad_of[o])}, in the forward section; gradients "
                                  f"are handed to autograd and must be computed in backward")
                    self._drop(o)
                    self.handed_at[o] = loc
        else:
            for o in self.hand_overs.get(loc[1], ()):
                if o in self.live:
                    self._drop(o)
                    self.handed_at[o] = loc

    def _double_update(self, name: str, m: str) -> str:
        """Why recomputing mutating node `name` would update `m` twice, or ""."""
        val = self.values.get(m)
        if val is None:
            return ""
        got = self.inst_ran.get(self.inst.get(val.storage, -1), {}).get(name)
        if got is None:
            return ""  # a fresh storage (its producer was recomputed): the update applies once
        head = (f"recompute {name}: {name} updates {m} in place and already did so at {_where(got[1])}, "
                f"so running it again would apply the update twice")
        owner = self.values.get(val.storage)
        if val.kind in GRAPH_INPUT_KINDS or (owner is not None and owner.kind in GRAPH_INPUT_KINDS):
            return f"{head} ({m} is a {owner.kind if owner else val.kind} the step updates once); keep the " \
                   f"outputs of {name} live instead of recomputing it"
        prod = self.producer.get(val.storage)
        fresh = f"recompute {prod.name} first (after the old storage is released) so the update " \
                f"applies to fresh data, or " if prod is not None else ""
        return f"{head}; {fresh}keep the outputs of {name} live instead of recomputing it"

    def _stale_read(self, verb: str, name: str, r: str, t: int) -> str:
        """Why reading `r` here sees other data than the graph says, or ""."""
        s = self.values[r].storage
        alias = "" if s == r else f" (a view of {s})"
        ran = self.inst_ran.get(self.inst.get(s, -1), {})
        t0 = self.computed_t.get(name)
        gi = self.gidx.get(name, 0)
        for (mgi, mnode, operand) in self.mutators[s]:
            if mnode == name:
                continue
            got = ran.get(mnode)
            if mgi > gi and got is not None:
                if verb == RECOMPUTE and t0 is not None and got[0] > t0:
                    return (f"recompute {name} reads {r}{alias}, which {mnode} updated in place at "
                            f"{_where(got[1])}, after {name} was first computed at "
                            f"{_where(self.computed_at[name])}; the recompute would see different data, "
                            f"keep the outputs of {name} live instead")
                return (f"{verb} {name} reads {r}{alias}, which {mnode} already updated in place at "
                        f"{_where(got[1])}, but {name} comes before {mnode} in the graph and must see "
                        f"the old data; schedule {verb} {name} before {_where(got[1])}")
            if mgi < gi and got is None:
                fc = self.first_compute.get(mnode)
                when = f" (it runs at {_where(fc)})" if fc is not None and mnode not in self.computed_at else ""
                return (f"{verb} {name} reads {r}{alias} before {mnode} updates {operand} in place"
                        f"{when}, but {name} comes after {mnode} in the graph and must see the updated "
                        f"data; run {mnode} on this storage first")
        return ""

    def _dead_read(self, verb: str, name: str, r: str, loc: Loc) -> str:
        head = f"{verb} {name} reads {r}"
        val = self.values[r]
        prod = self.producer.get(r)
        if r in self.handed_at:
            return (f"{head}, the gradient of {', '.join(self.grad_of.get(r, ['?']))}, which was "
                    f"handed to autograd right after {_where(self.handed_at[r])}; a gradient output "
                    f"cannot be read after the last instruction that writes it")
        if r in self.freed_at:
            fl = self.freed_at[r]
            msg = f"{head}, which was freed at {_where(fl)}; move that free after {_where(loc)}"
            if prod is not None and prod.phase == FORWARD and not prod.mutates:
                msg += f" or `recompute {prod.name}` before {_where(loc)}"
            return msg
        if val.kind == TANGENT:
            return (f"{head}, a tangent, which autograd delivers only at the start of backward; "
                    f"move {verb} {name} into the backward section")
        if prod is None:
            return f"{head}, which no node produces"
        fc = self.first_compute.get(prod.name)
        if fc is not None and prod.name not in self.computed_at:
            return (f"{head} before it is computed: its producer {prod.name} is computed at "
                    f"{_where(fc)}; move `compute {prod.name}` before {_where(loc)}")
        if prod.name not in self.computed_at:
            return (f"{head}, whose producer {prod.name} is never computed; add `compute {prod.name}` "
                    f"before {_where(loc)}")
        return f"{head}, which is not live here"

    def _exec_free(self, name: str, loc: Loc) -> None:
        values = self.values
        val = values.get(name)
        if val is None:
            msg = f"free {name}: no value is named {name}"
            node = self.nodes.get(name)
            if node is not None:
                outs = [o for o in node.outputs if o]
                msg += f"; {name} is a node, free its outputs ({', '.join(outs) or 'none'})"
            else:
                msg += self._did_you_mean(name, values)
            self.err(loc, msg)
            return
        if val.kind in GRAPH_INPUT_KINDS:
            self.err(loc, f"free {name}: {name} is a {'parameter' if val.kind == PARAM else val.kind}; "
                          f"graph inputs live across steps and are never freed, remove this free")
            return
        if name in self.results:
            self.err(loc, f"free {name}: {name} is forward result {self.results[name]}, which the "
                          f"caller holds; remove this free")
            return
        if name in self.grad_of:
            msg = f"free {name}: {name} is the gradient of {', '.join(self.grad_of[name])}"
            if name in self.handed_at:
                msg += f", handed to autograd right after {_where(self.handed_at[name])}"
            self.err(loc, msg + "; autograd takes it, remove this free")
            return
        if name in self.copying:
            kind, at = self.copying[name]
            self.err(loc, f"free {name}: the copy of {name} {'to' if kind == OFFLOAD else 'from'} the host "
                          f"({kind} at {_where(at)}) is in flight; add `wait {name}` before this free")
            return
        if name in self.on_host:  # its host copy is dropped
            del self.on_host[name]
            self.host_inst.pop(name, None)
            self.freed_at[name] = loc
            return
        if name not in self.live:
            if name in self.freed_at:
                self.err(loc, f"free {name}: {name} was already freed at {_where(self.freed_at[name])} "
                              f"(double free); remove one of the two frees")
            elif val.kind == TANGENT:
                self.err(loc, f"free {name}: tangent {name} exists only in the backward section; move "
                              f"this free into backward")
            else:
                prod = self.producer.get(name)
                if prod is None:
                    why, fix = "no node produces it", "remove this free"
                elif prod.name in self.first_compute and prod.name not in self.computed_at:
                    why = (f"its producer {prod.name} is computed later, at "
                           f"{_where(self.first_compute[prod.name])}")
                    fix = f"move this free after {_where(self.first_compute[prod.name])}"
                elif prod.name not in self.computed_at:
                    why = f"its producer {prod.name} is never computed"
                    fix = f"add `compute {prod.name}` before it or remove this free"
                else:
                    why, fix = "it is not live here", "remove this free"
                self.err(loc, f"free {name}: {name} was never made live ({why}); {fix}")
            return
        self._drop(name)
        self.freed_at[name] = loc

    # offload

    def _not_offloadable(self, name: str) -> str:
        """Why `name` can never be offloaded, or ""."""
        val = self.values[name]
        if val.kind in GRAPH_INPUT_KINDS or val.kind == TANGENT:
            what = {PARAM: "a parameter", INPUT: "an input"}.get(val.kind, f"a {val.kind}")
            return (f"{name} is {what}; only a value a node makes can be offloaded"
                    + ("" if val.kind == TANGENT else " (graph inputs live across steps)"))
        if val.storage != name:
            return (f"{name} is a view of {val.storage}; offload the value that owns the storage, "
                    f"{val.storage}, at a point where no view of it is live")
        if name in self.results:
            return f"{name} is forward result {self.results[name]}, which the caller holds; it cannot be offloaded"
        if name in self.grad_of:
            return (f"{name} is the gradient of {', '.join(self.grad_of[name])}, which autograd takes; it "
                    f"cannot be offloaded")
        return ""

    def _exec_transfer(self, kind: str, name: str, loc: Loc) -> None:
        values = self.values
        if name not in values:
            msg = f"{kind} {name}: no value is named {name}"
            node = self.nodes.get(name)
            if node is not None:
                outs = [o for o in node.outputs if o]
                msg += f"; {name} is a node, {kind} its outputs ({', '.join(outs) or 'none'})"
            else:
                msg += self._did_you_mean(name, values)
            self.err(loc, msg)
            return
        why = self._not_offloadable(name)
        if why:
            self.err(loc, f"{kind} {name}: {why}")
            return
        self.last_touch[name] = loc
        if kind == OFFLOAD:
            self._exec_offload(name, loc)
        elif kind == RELOAD:
            self._exec_reload(name, loc)
        else:
            self._exec_wait(name, loc)

    def _exec_offload(self, name: str, loc: Loc) -> None:
        if name in self.copying:
            kind, at = self.copying[name]
            if kind == OFFLOAD:
                self.err(loc, f"offload {name}: {name} is already being copied to the host (offload at "
                              f"{_where(at)}; double offload); remove one of the two offloads")
            else:
                self.err(loc, f"offload {name}: {name} is being reloaded (reload at {_where(at)}); add "
                              f"`wait {name}` before offloading it again")
            return
        if name in self.on_host:
            off, at = self.on_host[name]
            self.err(loc, f"offload {name}: {name} is already on the host (offloaded at {_where(off)}, "
                          f"waited at {_where(at)}; double offload); remove this offload, or reload {name} "
                          f"(`reload {name}`, `wait {name}`) before it")
            return
        if name not in self.live:
            if name in self.freed_at:
                why = f"it was freed at {_where(self.freed_at[name])}"
            elif self.producer.get(name) is not None and self.producer[name].name not in self.computed_at:
                why = f"its producer {self.producer[name].name} is not computed yet"
            else:
                why = "it is not live here"
            self.err(loc, f"offload {name}: {name} is not on the device ({why}); offload a value while it "
                          f"is live")
            return
        self.copying[name] = (OFFLOAD, loc)

    def _exec_reload(self, name: str, loc: Loc) -> None:
        if name in self.on_host:
            del self.on_host[name]
            self.copying[name] = (RELOAD, loc)
            return
        if name in self.copying:
            kind, at = self.copying[name]
            if kind == OFFLOAD:
                self.err(loc, f"reload {name}: the copy of {name} to the host (offload at {_where(at)}) is "
                              f"not waited; add `wait {name}` before this reload")
            else:
                self.err(loc, f"reload {name}: {name} is already being reloaded (reload at {_where(at)}); "
                              f"remove one of the two reloads")
            return
        if name in self.live:
            self.err(loc, f"reload {name}: {name} is on the device, not on the host; remove this reload, "
                          f"or `offload {name}` and `wait {name}` before it")
        elif name in self.freed_at:
            self.err(loc, f"reload {name}: {name} was freed at {_where(self.freed_at[name])}, so no copy of "
                          f"it is on the host; move that free after this reload's use")
        else:
            self.err(loc, f"reload {name}: {name} is not on the host (it was never offloaded here); "
                          f"`offload {name}` and `wait {name}` before this reload")

    def _exec_wait(self, name: str, loc: Loc) -> None:
        got = self.copying.pop(name, None)
        if got is None:
            if name in self.on_host:
                off, at = self.on_host[name]
                self.err(loc, f"wait {name}: no copy of {name} is in flight: its offload at {_where(off)} "
                              f"was waited at {_where(at)}; remove this wait")
            else:
                self.err(loc, f"wait {name}: no copy of {name} is in flight here; a wait ends the copy "
                              f"that an `offload {name}` or a `reload {name}` before it started: add one, or "
                              f"remove this wait")
            return
        kind, at = got
        if kind == OFFLOAD:
            holders = sorted(x for x in self.live if x != name and self.values[x].storage == name)
            if holders:
                more = f" (and {len(holders) - 3} more)" if len(holders) > 3 else ""
                self.err(loc, f"wait {name}: live view(s) {', '.join(holders[:3])}{more} of {name}'s storage "
                              f"would keep its device memory once {name} is on the host; free them before "
                              f"this wait")
            self.host_inst[name] = self.inst.get(name)
            self._drop(name)
            self.on_host[name] = (at, loc)
        else:
            self._make_live(name, loc, instance=self.host_inst.pop(name, None))

    def _host_read(self, verb: str, name: str, r: str, loc: Loc) -> str:
        """Why node `name` cannot read `r` here: it is on the host, or its reload is in flight."""
        head = f"{verb} {name} reads {r}"
        if r in self.copying:
            return (f"{head} while its reload (at {_where(self.copying[r][1])}) is in flight; add `wait {r}` "
                    f"before {_where(loc)}")
        off, at = self.on_host[r]
        later = [x for x in self.reloads.get(r, ()) if _after(x, loc)]
        fix = (f"move `reload {r}` (at {_where(later[0])}) and its `wait {r}` before {_where(loc)}" if later
               else f"add `reload {r}` and `wait {r}` before {_where(loc)}")
        return f"{head}, which is on the host here (offloaded at {_where(off)}, waited at {_where(at)}); {fix}"

    # section ends

    def _end_of_forward(self) -> None:
        for i, o in enumerate(self.p.outputs):
            if o.kind != RESULT or o.value not in self.values:
                continue
            if o.value not in self.live:
                prod = self.producer.get(o.value)
                hint = f"; add `compute {prod.name}` to the forward section" if prod is not None else ""
                self.err(("outputs", i, o.line), f"result {o.key} ({o.value}) is not live at the end of "
                                                 f"the forward section{hint}")

    def _end_of_backward(self) -> None:
        p = self.p
        for name, (kind, at) in self.copying.items():
            self.err(at, f"{kind} {name}: this copy is never waited, and no copy may be in flight when the "
                         f"step ends; add `wait {name}` after it")
        for name, (off, at) in self.on_host.items():
            self.err(at, f"{name} is left on the host at the end of backward (offloaded at {_where(off)}); "
                         f"`free {name}` (on the host) after its last use, or reload it before one")
        for i, n in enumerate(p.nodes):
            if n.name not in self.computed_at and n.name in self.nodes and self.nodes[n.name] is n:
                sec = f"the {n.phase} section" if n.phase in (FORWARD, BACKWARD) else "the schedule"
                self.err(("nodes", i, n.line), f"node {n.name} is never computed; add `compute {n.name}` "
                                          f"to {sec}")
        for name in sorted(self.live):
            val = self.values[name]
            if val.kind in GRAPH_INPUT_KINDS or name in self.results or name in self.phantom or name in self.copying:
                continue  # (a copy in flight: said above)
            loc = self.last_touch.get(name, ("backward", -1, 0))
            if loc[1] < 0:
                what = f"{'tangent ' if val.kind == TANGENT else ''}{name} is never freed (leak); add " \
                       f"`free {name}` at the start of backward"
            else:
                last = "where it is made (nothing reads it)" if self.made_at.get(name) == loc else \
                    "its last use"
                what = (f"{name} is never freed: it is still live at the end of backward (leak); add "
                        f"`free {name}` after {_where(loc)}, {last}")
            self.err(loc, what)
        for i, o in enumerate(p.outputs):
            if o.kind != GRAD or o.value not in self.values or o.value in self.handed_at:
                continue
            prod = self.producer.get(o.value)
            if prod is not None and prod.name not in self.computed_at:
                why = f"its value {o.value} is computed by {prod.name}, which is never computed"
            else:
                why = f"its value {o.value} is never handed to autograd"
            self.err(("outputs", i, o.line), f"gradient of {o.key} is never produced: {why}")

    # ---------------------------------------------------------------- budget

    def check_budget(self, report: MemoryReport, first: MemoryReport) -> None:
        b = self.p.header.budget
        if b is None or b.scope not in ("total", "activations") or not _is_int(b.bytes):
            return
        steady = report.scope_peak(b.scope)
        fresh = first.scope_peak(b.scope)
        rep, when = (report, "steady-state steps (.grad present)") if steady >= fresh else \
            (first, "the first step (.grad absent)")
        peak = max(steady, fresh)
        if peak <= b.bytes:
            return
        ev = rep.peak if b.scope == "total" else rep.activation_peak
        if ev.phase == "start":
            section, index, at = "forward", -1, "before the first instruction"
        else:
            section, index = ev.phase, ev.index
            instrs = self.p.forward if ev.phase == "forward" else self.p.backward
            if 0 <= index < len(instrs):
                ins = instrs[index]
                at = f"at {_where((section, index, ev.line))} ({ins.kind} {ins.target})"
            else:
                at = "at the start of backward, when autograd delivers the tangents"
        top = self._live_storages(section, index, b.scope)
        tops = ", ".join(f"{s} {human_bytes(n)}" for s, n in top[:5])
        self.errors.append(Diagnostic(
            ev.line,
            f"peak memory ({b.scope}) {human_bytes(peak)} ({peak} B) exceeds the budget of "
            f"{human_bytes(b.bytes)} ({b.bytes} B) by {human_bytes(peak - b.bytes)} {at} on {when}"
            + (f"; largest storages live there: {tops}" if tops else "")
            + "; free or recompute values live across that point, or raise the budget",
            section, index))

    def check_host_budget(self, report: MemoryReport) -> None:
        """The host pool's peak (offloaded copies) within the header's `host_budget`."""
        limit = self.p.header.host_budget
        if limit is None or not _is_int(limit) or report.host_peak_bytes <= limit:
            return
        ev = report.host_peak
        peak = report.host_peak_bytes
        instrs = self.p.forward if ev.phase == "forward" else self.p.backward
        ins = instrs[ev.index]
        held = self._host_copies(ev.phase, ev.index)
        self.errors.append(Diagnostic(
            ev.line,
            f"host memory of offloaded copies {human_bytes(peak)} ({peak} B) exceeds the host budget of "
            f"{human_bytes(limit)} ({limit} B) by {human_bytes(peak - limit)} at "
            f"{_where((ev.phase, ev.index, ev.line))} ({ins.kind} {ins.target}); copies held there: "
            + ", ".join(f"{n} {human_bytes(self.values[n].nbytes)}" for n in held[:5])
            + "; reload or free offloaded values sooner, offload fewer, or raise the host budget",
            ev.phase, ev.index))

    def _host_copies(self, section: str, index: int) -> list[str]:
        """Values with a host copy right after instruction `index` of `section`, largest first."""
        held: dict[str, None] = {}
        reloading: set[str] = set()
        for sec, instrs in (("forward", self.p.forward), ("backward", self.p.backward)):
            for i, ins in enumerate(instrs):
                if ins.kind == OFFLOAD:
                    held[ins.target] = None
                elif ins.kind == RELOAD:
                    reloading.add(ins.target)
                elif ins.kind == WAIT and ins.target in reloading:
                    reloading.discard(ins.target)
                    held.pop(ins.target, None)
                elif ins.kind == FREE:
                    held.pop(ins.target, None)
                if sec == section and i == index:
                    return sorted(held, key=lambda n: -self.values[n].nbytes)
        return sorted(held, key=lambda n: -self.values[n].nbytes)

    def _live_storages(self, section: str, index: int, scope: str) -> list[tuple[str, int]]:
        """Storages of values live right after instruction `index` of `section`
        (before any grad hand-over), by replaying the sound schedule: a value
        on the host holds no device storage, one being reloaded does."""
        values = self.values
        live: set[str] = {v.name for v in self.p.values if v.kind in GRAPH_INPUT_KINDS}
        nodes = self.nodes
        reloading: set[str] = set()
        for sec, instrs in (("forward", self.p.forward), ("backward", self.p.backward)):
            if sec == "backward":
                live.update(v.name for v in self.p.values if v.kind == TANGENT)
            if sec == section and index < 0:
                break
            done = False
            for i, ins in enumerate(instrs):
                if ins.kind == FREE:
                    live.discard(ins.target)
                elif ins.kind == RELOAD:
                    reloading.add(ins.target)
                elif ins.kind == WAIT:
                    if ins.target in reloading:
                        reloading.discard(ins.target)
                        live.add(ins.target)
                    else:
                        live.discard(ins.target)
                elif ins.kind in (COMPUTE, RECOMPUTE):
                    outs = [o for o in nodes[ins.target].outputs if o]
                    live.update(outs)
                    if sec == section and i == index:
                        done = True
                        break
                    live.difference_update(o for o in outs if o in self.grad_of)
                if sec == section and i == index:
                    done = True
                    break
            if done:
                break
        live |= reloading
        sizes: dict[str, int] = {}
        for name in live:
            s = values[name].storage
            owner = values[s]
            if scope == "activations" and owner.kind in GRAPH_INPUT_KINDS:
                continue
            sizes[s] = owner.nbytes
        return sorted(sizes.items(), key=lambda t: -t[1])
