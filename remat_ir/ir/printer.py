"""Print a `Program` as canonical `.rir` text (the format: `remat_ir.ir.syntax`).

    format_program(program) -> str          canonical text
    with_lines(program) -> Program          every `line` (and Header.lines) as printed
    human_bytes(n) -> str                   "512 B", "64.0 KiB", "1.32 GiB"
"""
from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from remat_ir.ir import sizes as sz
from remat_ir.ir import types as ir
from remat_ir.ir.types import (
    BACKWARD, FORWARD, FREE, OFFLOAD, RELOAD, RESULT, VALUE, WAIT, Device, DType, Instr, Layout, MemoryFormat, Node,
    Output, Program, Ref, Seq, Special, Sym, Value,
)
from remat_ir.ir.syntax import (
    DEVICE_BARE_RE, ESCAPE_RE, KWARG_RE, NAME_RE, RESERVED, RESULT_KEY_RE, SIZE_RANGE_RE, SPECIALS,
    default_stride, sym_text,
)

__all__ = ["format_program", "with_lines", "human_bytes"]


# ------------------------------------------------------------ small helpers


def human_bytes(n: int | float) -> str:
    """512 B, 64.0 KiB, 1.32 GiB: three significant digits above 1 KiB."""
    n = int(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024.0
        if x < 1024 or unit == "PiB":
            break
    return f"{sign}{x:.2f} {unit}" if x < 10 else f"{sign}{x:.1f} {unit}"


def _quote(s: str) -> str:
    q = json.dumps(s, ensure_ascii=False)
    if ESCAPE_RE.search(q):
        q = ESCAPE_RE.sub(lambda m: "\\u%04x" % ord(m.group()), q)
    return q


def _bare_ok(s: str) -> bool:
    return (NAME_RE.fullmatch(s) is not None and s not in RESERVED
            and not s.startswith("torch."))


def _ref(name: str) -> str:
    return name if _bare_ok(name) else "%" + _quote(name)


def _kwarg_name(k: str) -> str:
    if not isinstance(k, str) or not KWARG_RE.fullmatch(k):
        raise ValueError(f"cannot print keyword argument name {k!r}: expected an identifier "
                         "(letters, digits and _, not starting with a digit)")
    return k if k not in RESERVED else _quote(k)


def _word(s: str) -> str:
    # Where a word stands (source, module, device, ...) no keyword can, so
    # only the spelling matters.
    return s if NAME_RE.fullmatch(s) else _quote(s)


def _hcomment(c: str) -> str:
    if c == "":
        return "#|"
    if c.isprintable() and c[0] not in ' "' and not c[-1].isspace():
        return "#| " + c
    return "#|" + _quote(c)


def _size(x) -> str:
    """A dimension or stride: an int, or a size expression's canonical text."""
    if type(x) is int:
        return str(x)
    try:
        return sz.size_text(x)
    except sz.SizeError as e:
        raise ValueError(f"cannot print size {x!r}: {e}") from None


def _count(x) -> str:
    """A byte count: `64`, or `$B` / `$(256*B*T)`."""
    if type(x) is int:
        return str(x)
    try:
        return sym_text(x)
    except sz.SizeError as e:
        raise ValueError(f"cannot print byte count {x!r}: {e}") from None


def _range(r: str) -> str:
    if not isinstance(r, str) or not SIZE_RANGE_RE.fullmatch(r):
        raise ValueError(f"cannot print size range {r!r}: expected SYMBOL=LOW..HIGH, like T=32..128")
    return r


def _type(dtype: str, shape: list) -> str:
    return f"{ir.DTYPE_SHORT.get(dtype, dtype)}[{','.join(_size(d) for d in shape)}]"


def _arg(a: Any) -> str:
    if a is None:
        return "none"
    if a is True:
        return "true"
    if a is False:
        return "false"
    t = type(a)
    if t is Ref:
        return _ref(a.name)
    if t is int:
        return str(a)
    if t is float:
        if math.isfinite(a):
            return repr(a)
        return "nan" if math.isnan(a) else ("inf" if a > 0 else "-inf")
    if t is str:
        return _quote(a)
    if t is Seq:
        return "[" + ", ".join([_arg(x) for x in a.items]) + "]"
    if t is Sym:
        try:
            return sym_text(a.expr)
        except sz.SizeError as e:
            raise ValueError(f"cannot print size argument {a.expr!r}: {e}") from None
    if t is DType or t is Layout or t is MemoryFormat:
        return "torch." + a.name
    if t is Device:
        return f"device({a.name if DEVICE_BARE_RE.fullmatch(a.name) else _quote(a.name)})"
    if t is Special:
        if a.name not in SPECIALS:
            raise ValueError(f"cannot print Special({a.name!r}): expected one of {SPECIALS}")
        return a.name
    if isinstance(a, bool):
        return "true" if a else "false"
    if isinstance(a, int):
        return str(int(a))
    if isinstance(a, float):
        return _arg(float(a))
    if isinstance(a, str):
        return _quote(str(a))
    raise ValueError(f"cannot print argument {a!r} of type {type(a).__name__}")


def _decl(v: Value) -> str:
    parts = [_type(v.dtype, v.shape)]
    if list(v.stride) != default_stride(list(v.shape)):
        parts.append(f"stride [{','.join(_size(s) for s in v.stride)}]")
    if v.storage == v.name:
        parts.append(f"{_count(v.nbytes)} bytes")
    else:
        parts.append(f"view of {_ref(v.storage)}")
        if v.nbytes != 0:
            parts.append(f"{_count(v.nbytes)} bytes")
    if v.source:
        parts.append(f"source {_word(v.source)}")
    if v.requires_grad:
        parts.append("requires_grad")
    if v.aliases:
        parts.append("aliases [" + ", ".join(_word(a) for a in v.aliases) + "]")
    return " ".join(parts)


# --------------------------------------------------------------- printing


def _inline_values(program: Program) -> set[str]:
    """Names of values declared on node lines rather than under `values`.

    The parser rebuilds `Program.values` as the `values` lines followed by the
    node-line declarations in graph order, so the node-line ones must be a
    suffix of `program.values` that is a subsequence of the node outputs in
    graph order.  Take the longest such suffix (greedy from the end).
    """
    first_outputs: list[str] = []
    seen: set[str] = set()
    for n in program.nodes:
        for o in n.outputs:
            if o and o not in seen:
                seen.add(o)
                first_outputs.append(o)
    pos = {name: i for i, name in enumerate(first_outputs)}
    names = [v.name for v in program.values]
    if len(set(names)) != len(names):
        counts: dict[str, int] = {}
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    else:
        counts = {}
    inline: set[str] = set()
    limit = len(first_outputs)
    for v in reversed(program.values):
        i = pos.get(v.name)
        if v.kind != VALUE or i is None or i >= limit or counts.get(v.name, 1) > 1:
            break
        inline.add(v.name)
        limit = i
    return inline


class _Printer:
    def __init__(self, program: Program):
        self.p = program
        self.lines: list[str] = []
        self.fwd_lines: list[int] = []
        self.bwd_lines: list[int] = []
        self.out_lines: list[int] = []
        self.header_lines: dict[str, int] = {}  # header line name -> line
        self.value_lines: dict[int, int] = {}  # id(Value) -> the line declaring it
        self.node_lines: dict[int, int] = {}  # id(Node) -> its line
        # A symbolic plan's byte counts are shown (in comments) at the high end of its range.
        self.high: dict[str, int] = {}
        self.at = ""
        if program.header.sizes:
            try:
                self.high = sz.ends(program)[-1]
                self.at = ",".join(f"{k}={v}" for k, v in self.high.items())
            except (sz.SizeError, TypeError):
                pass

    def nbytes(self, x) -> tuple[int | None, bool]:
        """(bytes as a number, or None when they cannot be worked out; whether they depend on sizes)."""
        if type(x) is int:
            return x, False
        try:
            return sz.evaluate(x, self.high), True
        except (sz.SizeError, TypeError, RecursionError):
            return None, True

    def human(self, n: int | None, symbolic: bool, sign: str = "") -> str:
        if n is None:
            return ""
        return sign + human_bytes(n) + (f" at {self.at}" if symbolic else "")

    def owned(self, v: Value | None, sign: str, host: bool = False) -> str:
        """The bytes value `v` owns, signed, for a comment ("" for a view, an
        unknown value, or no bytes); `host` says they are host memory."""
        if v is None or v.storage != v.name or v.nbytes == 0:
            return ""
        text = self.human(*self.nbytes(v.nbytes), sign=sign)
        return "host " + text if host and text else text

    def emit(self, s: str) -> int:
        self.lines.append(s)
        return len(self.lines)

    def run(self) -> list[str]:
        p = self.p
        h = p.header
        emit = self.emit
        values = p.value_map()
        hl = self.header_lines
        for c in h.comment:
            emit(_hcomment(c))
        hl["rir"] = emit(f"rir {int(h.version)}")
        hl["model"] = emit(f"model {_quote(h.model)}")
        hl["fingerprint"] = emit(f"fingerprint {_quote(h.fingerprint)}")
        hl["device"] = emit(f"device {_word(h.device)}")
        if h.cost != ir.COST_FLOPS:
            hl["cost"] = emit(f"cost {h.cost}")
        hl["optimizer"] = emit(_comment(
            f"optimizer {_word(h.optim)} {int(h.optim_state_bytes)} bytes",
            f"{human_bytes(h.optim_state_bytes)} of optimizer state" if h.optim_state_bytes else ""))
        if h.budget is not None:
            hl["budget"] = emit(_comment(f"budget {int(h.budget.bytes)} bytes {h.budget.scope}",
                                         human_bytes(h.budget.bytes)))
        if h.host_budget is not None:
            hl["host_budget"] = emit(_comment(f"host_budget {int(h.host_budget)} bytes",
                                              human_bytes(h.host_budget) + " of host memory"))
        hl["has_loss"] = emit(f"has_loss {'true' if h.has_loss else 'false'}")
        hl["output_spec"] = emit(f"output_spec {_quote(h.output_spec)}")
        if h.rewrites:
            hl["rewrites"] = emit(f"rewrites {', '.join(_word(r) for r in h.rewrites)}")
        if h.autocast:
            hl["autocast"] = emit(f"autocast {_word(h.autocast)}")
        if h.held_gradients:
            hl["held_gradients"] = emit("held_gradients true")
        for field in ("constants", "guards"):
            if getattr(h, field):
                hl[field] = emit(f"{field} {', '.join(_quote(x) for x in getattr(h, field))}")
        if h.sizes:
            hl["sizes"] = emit(f"sizes {', '.join(_range(r) for r in h.sizes)}")
        if h.size_guards:
            hl["size_guards"] = emit(f"size_guards {', '.join(_quote(x) for x in h.size_guards)}")

        inline = _inline_values(p)
        listed = [v for v in p.values if v.name not in inline]
        owned = [self.nbytes(v.nbytes) for v in listed if v.storage == v.name]
        total = None if any(n is None for n, _ in owned) else sum(n for n, _ in owned)
        total_note = self.human(total, any(sym for _, sym in owned))
        emit("")
        plural = "" if len(listed) == 1 else "s"
        emit(_comment("values", f"{len(listed)} value{plural}" + (f", {total_note}" if total_note else "")
                      if listed else ""))
        if listed:
            refs = [_ref(v.name) for v in listed]
            w = min(max(len(r) for r in refs), 48)
            for v, r in zip(listed, refs):
                body = f"  {r:<{w}}  {v.kind:<7}  {_decl(v)}"
                note = self.human(*self.nbytes(v.nbytes)) if v.storage == v.name else ""
                self.value_lines[id(v)] = emit(_comment(body, note))

        # graph
        emit("")
        blocks: list[tuple[str, list[Node]]] = []
        for n in p.nodes:
            if blocks and blocks[-1][0] == n.phase:
                blocks[-1][1].append(n)
            else:
                blocks.append((n.phase, [n]))
        if not blocks or blocks[0][0] != FORWARD:
            blocks.insert(0, (FORWARD, []))
        if blocks[-1][0] != BACKWARD:
            blocks.append((BACKWARD, []))
        declared: set[str] = set()
        alloc: dict[str, tuple[int | None, bool]] = {}
        for phase, nodes in blocks:
            emit(f"graph {phase}")
            for n in nodes:
                line, size = self.node_line(n, values, inline, declared)
                alloc[n.name] = size
                self.node_lines[id(n)] = emit(_comment(line, self.human(*size)))

        # schedule
        names = [i.target for i in p.forward] + [i.target for i in p.backward]
        w = min(max((len(_ref(t)) for t in names), default=0), 48)
        copying: dict[str, str] = {}  # value -> the copy in flight (offload or reload)
        on_host: set[str] = set()
        for title, instrs, where in (("forward", p.forward, self.fwd_lines),
                                     ("backward", p.backward, self.bwd_lines)):
            emit("")
            emit(title)
            for ins in instrs:
                r = _ref(ins.target)
                note = ""
                if ins.kind == FREE:
                    # (a value on the host: the bytes of its host buffer)
                    note = self.owned(values.get(ins.target), "-", host=ins.target in on_host)
                    on_host.discard(ins.target)
                elif ins.kind in (OFFLOAD, RELOAD):
                    copying[ins.target] = ins.kind
                    on_host.discard(ins.target)
                    note = self.owned(values.get(ins.target), "+", host=ins.kind == OFFLOAD)
                elif ins.kind == WAIT:
                    copy = copying.pop(ins.target, None)
                    if copy == OFFLOAD:
                        on_host.add(ins.target)
                    if copy is not None:
                        note = self.owned(values.get(ins.target), "-", host=copy == RELOAD)
                elif alloc.get(ins.target, (0, False))[0]:
                    note = self.human(*alloc[ins.target], sign="+")
                body = f"  {ins.kind:<9} {r:<{w}}" if note else f"  {ins.kind:<9} {r}"
                where.append(emit(_comment(body, note)))

        emit("")
        emit("outputs")
        for o in p.outputs:
            if o.kind == RESULT:
                key = o.key if RESULT_KEY_RE.fullmatch(o.key) else _quote(o.key)
            else:
                key = _ref(o.key)
            self.out_lines.append(emit(f"  {o.kind} {key} = {_ref(o.value)}"))
        return self.lines

    def node_line(self, n: Node, values: dict[str, Value], inline: set[str],
                  declared: set[str]) -> tuple[str, tuple[int | None, bool]]:
        outs = []
        size: int | None = 0
        symbolic = False
        for o in n.outputs:
            if not o:
                outs.append("_")
                continue
            v = values.get(o)
            if v is not None and v.storage == v.name:
                k, sym = self.nbytes(v.nbytes)
                size = None if k is None or size is None else size + k
                symbolic = symbolic or sym
            if o in inline and o not in declared:
                declared.add(o)
                self.value_lines[id(v)] = len(self.lines) + 1  # the line this node is printed on
                outs.append(f"{_ref(o)} {_decl(v)}")
            else:
                outs.append(_ref(o))
        head = ", ".join(outs)
        if not (n.outputs and n.outputs[0] and n.name == n.outputs[0]):
            head = f"{_ref(n.name)}: {head}" if head else f"{_ref(n.name)}:"
        for a in list(n.args) + list(n.kwargs.values()):
            if ir.arg_depth(a, ir.MAX_NESTING) > ir.MAX_NESTING:
                raise ValueError(f"cannot print node {n.name}: an argument has lists nested more than "
                                 f"{ir.MAX_NESTING} deep, which the .rir reader refuses")
        args = [_arg(a) for a in n.args]
        for k, a in n.kwargs.items():
            args.append(f"{_kwarg_name(k)}={_arg(a)}")
        op = n.op if _bare_ok(n.op) else _quote(n.op)
        line = f"  {head} = {op}({', '.join(args)})"
        if n.module:
            line += f" module {_word(n.module)}"
        if n.random:
            line += " random"
        if n.mutates:
            line += " mutates(" + ", ".join(_ref(m) for m in n.mutates) + ")"
        if n.flops:
            line += f" flops {float(n.flops)!r}"
        if n.time_us:
            line += f" time_us {float(n.time_us)!r}"
        return line, (size, symbolic)


def _comment(body: str, note: str) -> str:
    if not note:
        return body
    return f"{body:<40}   # {note}" if len(body) < 40 else f"{body}   # {note}"


def format_program(program: Program) -> str:
    """The canonical `.rir` text of `program` (every `line` and Header.lines ignored)."""
    return "\n".join(_Printer(program).run()) + "\n"


def with_lines(program: Program) -> Program:
    """`program` with Instr.line, Output.line, Value.line, Node.line and
    Header.lines set to where `format_program` prints them.  `program` is left
    as it is: the header, values, nodes, instructions and outputs are new
    (shallow copies)."""
    pr = _Printer(program)
    pr.run()
    replace = msgspec.structs.replace
    header = replace(program.header, lines=dict(pr.header_lines))
    values = [replace(v, line=pr.value_lines.get(id(v), 0)) for v in program.values]
    nodes = [replace(n, line=pr.node_lines.get(id(n), 0)) for n in program.nodes]
    fwd = [Instr(i.kind, i.target, ln) for i, ln in zip(program.forward, pr.fwd_lines)]
    bwd = [Instr(i.kind, i.target, ln) for i, ln in zip(program.backward, pr.bwd_lines)]
    outs = [Output(o.kind, o.key, o.value, ln) for o, ln in zip(program.outputs, pr.out_lines)]
    return Program(header=header, values=values, nodes=nodes, forward=fwd, backward=bwd, outputs=outs)


