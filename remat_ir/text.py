"""The `.rir` text format: a Program written for people.

    format_program(program) -> str          canonical text
    parse_program(text, filename) -> Program
    with_lines(program) -> Program          Instr.line / Output.line as printed
    load_plan(path) -> Program              save_plan(program, path)  (atomic)
    human_bytes(n) -> str                   "512 B", "64.0 KiB", "1.32 GiB"

The grammar is `grammar/rir.lark` (installed as the package data of
`remat_ir.grammar`).  A plan looks like this::

    #| remat-ir plan: gpt2-tiny                 <- header.comment, one per line
    rir 1
    model "gpt2-tiny"
    fingerprint "9c1e47a2d0b3"
    device cpu
    cost profile                                # what the optimizer minimizes (line absent: flops)
    optimizer adam 1024000 bytes                # 1000.0 KiB
    budget 3365000 bytes activations            # 3.21 MiB   (line absent: no budget)
    has_loss true
    output_spec "[1, {\\"type\\": null, ...}]"

    values
      idx                     input  i64[2,64]      1024 bytes  source idx      # 1.0 KiB
      transformer.wte.weight  param  f32[1000,128]  512000 bytes  source transformer.wte.weight  requires_grad  aliases [lm_head.weight]
      w.t                     param  f32[128,1000]  stride [1,128]  view of transformer.wte.weight

    graph forward
      emb f32[2,64,128] 65536 bytes = aten.embedding.default(transformer.wte.weight, idx) module transformer.wte   # 64.0 KiB
      drop f32[2,64,128] 65536 bytes, drop:1 b8[2,64,128] 8192 bytes = aten.native_dropout.default(emb, 0.1, true) random   # 72.0 KiB
      mx: _, mx:1 i64[2] 16 bytes = aten.foo.default(emb, dtype=torch.float32, device=device(cpu))
    graph backward
      ...

    forward
      compute   emb                             # +64.0 KiB   (what it allocates)
      free      emb                             # -64.0 KiB   (the storage it owns)
    backward
      recompute emb                             # +64.0 KiB
    outputs
      result 0 = loss
      grad transformer.wte.weight = d.transformer.wte.weight

Rules of the text:

* `#` starts a comment anywhere outside a string literal; comments,
  indentation and blank lines are ignored.  Sizes in comments are for people:
  the parser ignores them and reads the exact byte counts.
* The header comment (`Header.comment`) is the `#|` lines before `rir 1`, one
  line per entry: `#| text`, or `#|"json string"` when the text has control
  characters, leading/trailing blanks or starts with a quote.  A `#|` line
  anywhere else is an ordinary comment.
* Value names are bare when they look like `transformer.h.0.attn.c_attn.addmm`
  or `d.x.native_layer_norm_backward:1` (identifier segments joined by `.` or
  `:`); any other name, and the few that would read as a keyword where a name
  may also stand (`graph`, `forward`, `_`, `true`, `none`, ... and anything
  starting with `torch.`), is written `%"..."`.
* `values` lists the values no node produces (inputs, params, buffers,
  tangents).  A value a node produces is declared on that node's line, after
  its name: dtype+shape (`f32[2,64,128]`, `DTYPE_SHORT` names; full torch names
  are accepted too), `stride [..]` when not contiguous, then its storage:
  `N bytes` for an owner, `view of NAME` for a view (plus `N bytes` when a view
  claims bytes), then optional `source`, `requires_grad`, `aliases [..]`.
  A node output that is already declared is written by bare name; `_` is a
  non-tensor output.  (`Program.values` is read back as the `values` lines in
  order, then the declarations on node lines in graph order; the printer
  falls back to listing a node-produced value under `values` when that is
  what keeps the order exact.)
* A node is named after its first output; `NODE: outputs = ...` names it
  otherwise.  Node attributes after the call: `module PATH`, `random`,
  `mutates(a, b)`, `flops 1.5e6`, `time_us 12.5` (measured; read by the
  optimizer under `cost profile`).  Phase comes from the enclosing
  `graph forward` / `graph backward` block; blocks repeat when phases
  interleave.
* Arguments: value names, ints, floats (repr), `inf`/`-inf`/`nan` (Special),
  `true`/`false`/`none`, `"strings"` (JSON escapes), lists `[a, b]`,
  `torch.float32` / `torch.strided` / `torch.contiguous_format` (dtype, layout,
  memory format), `device(cuda:0)`; keyword arguments `key=value` come last.
* Schedule: `forward` then `backward` sections of `compute NODE`,
  `recompute NODE`, `free VALUE`; `outputs` of `result KEY = VALUE` and
  `grad VALUE = VALUE`.

Reading: a hand-written reader takes canonical-looking text fast (4,000 nodes
and 8,000 instructions in well under a second); whenever it is unsure it gives
up and lark, with the grammar, reads the text, so lark defines the language and
words every syntax error.

Errors are `RirSyntaxError` (a ValueError) rendered `file:line:col: message`.
Parsing resolves names: every value referenced is declared exactly once,
`compute`/`recompute` name nodes, `free` names values; whether the schedule
makes sense is the verifier's business.
"""
from __future__ import annotations

import difflib
import gc
import json
import math
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from . import ir
from .ir import (
    BACKWARD, COMPUTE, FORWARD, FREE, GRAD, RECOMPUTE, RESULT, VALUE,
    Budget, Device, DType, Header, Instr, Layout, MemoryFormat, Node, Output, Program,
    Ref, Seq, Special, Value,
)

__all__ = [
    "RirSyntaxError", "format_program", "parse_program", "with_lines", "load_plan", "save_plan",
    "human_bytes", "grammar_text",
]

# ------------------------------------------------------------------ errors


class RirSyntaxError(ValueError):
    """A `.rir` text that cannot be read: `str(e) == "file:line:col: message"`."""

    def __init__(self, filename: str, line: int, column: int, message: str):
        self.filename = filename
        self.line = line
        self.column = column
        self.message = message
        super().__init__(f"{filename}:{line}:{column}: {message}")

    def __reduce__(self):
        return (type(self), (self.filename, self.line, self.column, self.message))


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


_NAME_RE = re.compile(r"[A-Za-z_]\w*(?:[.:]\w+)*")
_DEVICE_BARE_RE = re.compile(r"[\w.:-]+")
_RESULT_KEY_RE = re.compile(r"0|-?[1-9][0-9]*")
_ESCAPE_RE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff]")

# Dtype names a `.rir` file may use (torch attribute names).
DTYPES = frozenset(ir.DTYPE_SHORT) | frozenset({
    "uint16", "uint32", "uint64", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
})
LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                     "sparse_bsc", "_mkldnn", "jagged"})
MEMORY_FORMATS = frozenset({"contiguous_format", "preserve_format", "channels_last",
                            "channels_last_3d"})
SPECIALS = ("inf", "-inf", "nan")
HEADER_FIELDS = ("model", "fingerprint", "device", "cost", "optimizer", "budget", "has_loss", "output_spec")
VALUE_DECL_KINDS = (ir.INPUT, ir.PARAM, ir.BUFFER, ir.TANGENT, VALUE)


def _quote(s: str) -> str:
    q = json.dumps(s, ensure_ascii=False)
    if _ESCAPE_RE.search(q):
        q = _ESCAPE_RE.sub(lambda m: "\\u%04x" % ord(m.group()), q)
    return q


def _bare_ok(s: str) -> bool:
    return (_NAME_RE.fullmatch(s) is not None and s not in _reserved()
            and not s.startswith("torch."))


def _ref(name: str) -> str:
    return name if _bare_ok(name) else "%" + _quote(name)


def _word(s: str) -> str:
    # Where a word stands (source, module, device, ...) no keyword can, so
    # only the spelling matters.
    return s if _NAME_RE.fullmatch(s) else _quote(s)


def _hcomment(c: str) -> str:
    if c == "":
        return "#|"
    if c.isprintable() and c[0] not in ' "' and not c[-1].isspace():
        return "#| " + c
    return "#|" + _quote(c)


def _type(dtype: str, shape: list[int]) -> str:
    return f"{ir.DTYPE_SHORT.get(dtype, dtype)}[{','.join(str(d) for d in shape)}]"


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
    if t is DType or t is Layout or t is MemoryFormat:
        return "torch." + a.name
    if t is Device:
        return f"device({a.name if _DEVICE_BARE_RE.fullmatch(a.name) else _quote(a.name)})"
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
    if list(v.stride) != ir.contiguous_stride(list(v.shape)):
        parts.append(f"stride [{','.join(str(s) for s in v.stride)}]")
    if v.storage == v.name:
        parts.append(f"{v.nbytes} bytes")
    else:
        parts.append(f"view of {_ref(v.storage)}")
        if v.nbytes:
            parts.append(f"{v.nbytes} bytes")
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

    def emit(self, s: str) -> int:
        self.lines.append(s)
        return len(self.lines)

    def run(self) -> list[str]:
        p = self.p
        h = p.header
        emit = self.emit
        values = p.value_map()
        for c in h.comment:
            emit(_hcomment(c))
        emit(f"rir {int(h.version)}")
        emit(f"model {_quote(h.model)}")
        emit(f"fingerprint {_quote(h.fingerprint)}")
        emit(f"device {_word(h.device)}")
        if h.cost != ir.COST_FLOPS:
            emit(f"cost {h.cost}")
        emit(_comment(f"optimizer {_word(h.optimizer)} {int(h.optimizer_bytes)} bytes",
                      f"{human_bytes(h.optimizer_bytes)} of optimizer state" if h.optimizer_bytes else ""))
        if h.budget is not None:
            emit(_comment(f"budget {int(h.budget.bytes)} bytes {h.budget.scope}", human_bytes(h.budget.bytes)))
        emit(f"has_loss {'true' if h.has_loss else 'false'}")
        emit(f"output_spec {_quote(h.output_spec)}")

        inline = _inline_values(p)
        listed = [v for v in p.values if v.name not in inline]
        owned = sum(v.nbytes for v in listed if v.storage == v.name)
        emit("")
        plural = "" if len(listed) == 1 else "s"
        emit(_comment("values", f"{len(listed)} value{plural}, {human_bytes(owned)}" if listed else ""))
        if listed:
            refs = [_ref(v.name) for v in listed]
            w = min(max(len(r) for r in refs), 48)
            for v, r in zip(listed, refs):
                body = f"  {r:<{w}}  {v.kind:<7}  {_decl(v)}"
                emit(_comment(body, human_bytes(v.nbytes) if v.storage == v.name else ""))

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
        alloc: dict[str, int] = {}
        for phase, nodes in blocks:
            emit(f"graph {phase}")
            for n in nodes:
                line, size = self.node_line(n, values, inline, declared)
                alloc[n.name] = size
                emit(_comment(line, human_bytes(size)))

        # schedule
        names = [i.target for i in p.forward] + [i.target for i in p.backward]
        w = min(max((len(_ref(t)) for t in names), default=0), 48)
        for title, instrs, where in (("forward", p.forward, self.fwd_lines),
                                     ("backward", p.backward, self.bwd_lines)):
            emit("")
            emit(title)
            for ins in instrs:
                r = _ref(ins.target)
                note = ""
                if ins.kind == FREE:
                    v = values.get(ins.target)
                    if v is not None and v.storage == v.name and v.nbytes:
                        note = "-" + human_bytes(v.nbytes)
                elif alloc.get(ins.target):
                    note = "+" + human_bytes(alloc[ins.target])
                body = f"  {ins.kind:<9} {r:<{w}}" if note else f"  {ins.kind:<9} {r}"
                where.append(emit(_comment(body, note)))

        emit("")
        emit("outputs")
        for o in p.outputs:
            if o.kind == RESULT:
                key = o.key if _RESULT_KEY_RE.fullmatch(o.key) else _quote(o.key)
            else:
                key = _ref(o.key)
            self.out_lines.append(emit(f"  {o.kind} {key} = {_ref(o.value)}"))
        return self.lines

    def node_line(self, n: Node, values: dict[str, Value], inline: set[str],
                  declared: set[str]) -> tuple[str, int]:
        outs = []
        size = 0
        for o in n.outputs:
            if not o:
                outs.append("_")
                continue
            v = values.get(o)
            if v is not None and v.storage == v.name:
                size += v.nbytes
            if o in inline and o not in declared:
                declared.add(o)
                outs.append(f"{_ref(o)} {_decl(v)}")
            else:
                outs.append(_ref(o))
        head = ", ".join(outs)
        if not (n.outputs and n.outputs[0] and n.name == n.outputs[0]):
            head = f"{_ref(n.name)}: {head}" if head else f"{_ref(n.name)}:"
        args = [_arg(a) for a in n.args]
        for k, a in n.kwargs.items():
            args.append(f"{k if _bare_ok(k) else _quote(k)}={_arg(a)}")
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
        return line, size


def _comment(body: str, note: str) -> str:
    if not note:
        return body
    return f"{body:<40}   # {note}" if len(body) < 40 else f"{body}   # {note}"


def format_program(program: Program) -> str:
    """The canonical `.rir` text of `program` (Instr.line/Output.line ignored)."""
    return "\n".join(_Printer(program).run()) + "\n"


def with_lines(program: Program) -> Program:
    """`program` with Instr.line / Output.line set to where `format_program`
    prints them.  The result shares header, values and nodes with `program`;
    the instruction and output lists are new."""
    pr = _Printer(program)
    pr.run()
    fwd = [Instr(i.kind, i.target, ln) for i, ln in zip(program.forward, pr.fwd_lines)]
    bwd = [Instr(i.kind, i.target, ln) for i, ln in zip(program.backward, pr.bwd_lines)]
    outs = [Output(o.kind, o.key, o.value, ln) for o, ln in zip(program.outputs, pr.out_lines)]
    return Program(header=program.header, values=list(program.values), nodes=list(program.nodes),
                   forward=fwd, backward=bwd, outputs=outs)


# ----------------------------------------------------------------- grammar

_GRAMMAR_LOCK = threading.Lock()
_PARSE_LOCK = threading.Lock()
_parser_cache: dict[str, Any] = {}


def grammar_text() -> str:
    """The text of `rir.lark`: package data of `remat_ir.grammar` when
    installed, `<source tree>/grammar/rir.lark` otherwise."""
    try:
        from importlib.resources import files
        res = files("remat_ir.grammar") / "rir.lark"
        if res.is_file():
            return res.read_text(encoding="utf-8")
    except (ImportError, ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
        pass
    path = Path(__file__).resolve().parent.parent / "grammar" / "rir.lark"
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise RuntimeError(f"remat-ir: cannot find the .rir grammar (package remat_ir.grammar "
                           f"or {path}): {e}") from e


def _lark():
    p = _parser_cache.get("lark")
    if p is None:
        with _GRAMMAR_LOCK:
            p = _parser_cache.get("lark")
            if p is None:
                import lark
                from lark.lexer import PatternStr
                tr = _Builder()
                post = _PostLex()
                p = lark.Lark(grammar_text(), parser="lalr", lexer="contextual", transformer=tr,
                              postlex=post, maybe_placeholders=True, propagate_positions=False)
                post.keywords = frozenset(t.name for t in p.terminals if isinstance(t.pattern, PatternStr)
                                          and _NAME_RE.fullmatch(t.pattern.value))
                _parser_cache["postlex"] = post
                _parser_cache["transformer"] = tr
                _parser_cache["terminals"] = {t.name: t for t in p.terminals}
                _parser_cache["lark"] = p
    return p


class _PostLex:
    """Between lark's lexer and parser:

    * drops a line break that directly follows another one (a `#|` line after
      the header is an ignored comment between two breaks);
    * makes a keyword lexed off the front of a longer word (`freex`: lark
      matches keywords as plain strings where no name may stand) a NAME, so
      that the parser rejects it.
    """

    always_accept = ("_NL",)
    keywords: frozenset = frozenset()
    text = ""

    def process(self, stream):
        prev = False
        keywords = self.keywords
        text = self.text
        match = _NAME_RE.match
        for tok in stream:
            if tok.type == "_NL":
                if prev:
                    continue
                prev = True
            else:
                prev = False
                if tok.type in keywords:
                    m = match(text, tok.start_pos)
                    if m is not None and m.end() != tok.end_pos:
                        tok = tok.new_borrow_pos("NAME", m.group(), tok)
            yield tok


def _compute_reserved(p) -> frozenset[str]:
    """Keywords that can stand where a name can: those must be escaped."""
    from lark.lexer import PatternStr
    keywords = {t.name: t.pattern.value for t in p.terminals
                if isinstance(t.pattern, PatternStr) and _NAME_RE.fullmatch(t.pattern.value)}
    try:
        states = p.parser.parser.parser.parse_table.states
        out = set()
        for actions in states.values():
            if "NAME" in actions:
                out.update(keywords[k] for k in actions if k in keywords)
        return frozenset(out)
    except AttributeError:  # another lark layout: escape every keyword
        return frozenset(keywords.values())


# What `_compute_reserved` finds for grammar/rir.lark (a test keeps the two
# equal); spelt out so that printing and the fast reader never build lark.
_RESERVED = frozenset({"graph", "forward", "_", "true", "false", "none", "inf", "nan"})


def _reserved() -> frozenset[str]:
    return _RESERVED


# ----------------------------------------------------------------- parsing
#
# Two readers build the same records (header, value lines, graph blocks,
# schedule, outputs) for `_assemble`:
#
# * `_FastReader`, a hand-written reader of the line-oriented text.  It is
#   deliberately strict (it accepts a subset of the grammar: whatever it is
#   not sure about, it gives up on) and exists because lark's per-token cost
#   makes big plans slow.
# * lark with `grammar/rir.lark` (LALR, contextual lexer): the definition of
#   the language.  It runs whenever the fast reader gives up, so every syntax
#   error is lark's and every text lark accepts is accepted.


class _Sem(Exception):
    """A semantic error found while building; carries the offending token."""

    def __init__(self, tok, message: str):
        super().__init__(message)
        self.tok = tok
        self.message = message


class _GiveUp(Exception):
    """The fast reader is not sure: let lark read the text."""


def _pos(tok) -> tuple[int, int]:
    line = getattr(tok, "line", None) or 1
    col = getattr(tok, "column", None) or 1
    return line, col


def _str(tok) -> str:
    try:
        return json.loads(tok, strict=False)
    except ValueError as e:
        raise _Sem(tok, f"bad string literal {str(tok)[:60]}: {getattr(e, 'msg', e)}") from None


def _wordval(tok) -> str:
    return _str(tok) if tok.type == "STRING" else str(tok)


def _ints(tok, text: str) -> list[int]:
    body = text.strip()
    if not body:
        return []
    try:
        return [int(x) for x in body.split(",")]
    except ValueError:
        raise _Sem(tok, f"bad integer list `{tok}`: write integers separated by commas, "
                        f"like [2,64,128]") from None


def _dtype_name(tok, short: str) -> str:
    long = ir.DTYPE_LONG.get(short)
    if long is not None:
        return long
    if short in DTYPES:
        return short
    close = difflib.get_close_matches(short, list(ir.DTYPE_LONG) + sorted(DTYPES), n=1)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    raise _Sem(tok, f"unknown dtype `{short}` (known: {', '.join(ir.DTYPE_LONG)}){hint}")


def _torch_const(t) -> Any:
    attr = t[6:]
    if attr in DTYPES:
        return DType(attr)
    if attr in LAYOUTS:
        return Layout(attr)
    if attr in MEMORY_FORMATS:
        return MemoryFormat(attr)
    raise _Sem(t, f"unknown torch constant `{t}`: expected a dtype (torch.float32, ...), a layout "
                  f"(torch.strided, ...) or a memory format (torch.contiguous_format, ...); "
                  f"a value of that name is written %\"{t}\"")


def _device(tok) -> Device:
    s = str(tok)[7:-1]
    if s.startswith('"'):
        return Device(_str(_Token("STRING", s, tok.line, tok.column)))
    return Device(s)


def _hcomment_text(tok) -> str:
    rest = str(tok)[2:].rstrip()
    if rest.startswith(" "):
        return rest[1:]
    if rest.startswith('"'):
        return _str(_Token("STRING", rest, tok.line, tok.column))
    return rest


def _make_header(comments: list[str], vtok, fields) -> Header:
    if int(vtok) != ir.FORMAT_VERSION:
        raise _Sem(vtok, f"unsupported format version {vtok}: this remat-ir reads "
                         f"`rir {ir.FORMAT_VERSION}`")
    h = Header(version=int(vtok), comment=comments)
    for field, val in fields:
        if field == "optimizer":
            h.optimizer, h.optimizer_bytes = val
        else:
            setattr(h, field, val)
    return h


class _Kw:
    __slots__ = ("key", "value", "tok")

    def __init__(self, key, value, tok):
        self.key, self.value, self.tok = key, value, tok


class _Decl:
    __slots__ = ("tok", "dtype", "shape", "stride", "storage", "storage_tok", "nbytes", "source",
                 "requires_grad", "aliases")


def _make_decl(t, stride, storage, source, rg, aliases) -> _Decl:
    d = _Decl()
    d.tok = t
    s = str(t)
    b = s.index("[")
    d.dtype = _dtype_name(t, s[:b])
    d.shape = _ints(t, s[b + 1:-1])
    d.stride = stride
    d.storage_tok, d.nbytes = storage
    d.storage = None if d.storage_tok is None else str(d.storage_tok)
    d.source = "" if source is None else source
    d.requires_grad = bool(rg)
    d.aliases = [] if aliases is None else aliases
    return d


class _NodeRec:
    __slots__ = ("name", "name_tok", "outs", "op", "op_tok", "args", "kwargs", "attrs", "refs", "phase")


def _make_node(name_tok, outs, op, op_tok, items, attrs, refs) -> _NodeRec:
    rec = _NodeRec()
    rec.outs = outs or []
    if name_tok is None:
        first = rec.outs[0] if rec.outs else None
        if first is None or first[0] is None:
            raise _Sem(op_tok, "this node has no name: its first output is `_` or missing; "
                               "name it with `NAME: ` at the start of the line")
        name_tok = first[0]
    rec.name = str(name_tok)
    rec.name_tok = name_tok
    rec.op, rec.op_tok = op, op_tok
    args: list = []
    kwargs: dict = {}
    for it in items or ():
        if type(it) is _Kw:
            if it.key in kwargs:
                raise _Sem(it.tok, f"keyword argument `{it.key}` given twice")
            kwargs[it.key] = it.value
        else:
            if kwargs:
                raise _Sem(op_tok, "a positional argument follows a keyword argument "
                                   "(write positional arguments first)")
            args.append(it)
    rec.args, rec.kwargs = args, kwargs
    rec.attrs = attrs
    rec.refs = refs
    return rec


_INSTR_KINDS = (COMPUTE, RECOMPUTE, FREE)


def _Token(type_: str, value: str, line: int, column: int):
    tok = _parser_cache.get("Token")
    if tok is None:
        from lark import Token as tok
        _parser_cache["Token"] = tok
    return tok(type_, value, None, line, column)


def _make_builder_class():
    from lark import Token, Transformer

    class Builder(Transformer):
        """Builds the records while lark parses (LALR callbacks)."""

        def __init__(self):
            super().__init__(visit_tokens=False)
            self.reset()

        def reset(self):
            self.arg_refs: list = []  # ref tokens seen in the current node's arguments
            self.last_key = None

        # -- header
        def hcomment(self, c):
            return _hcomment_text(c[0])

        def header(self, c):
            i = 0
            while not isinstance(c[i], Token):
                i += 1
            return _make_header(c[:i], c[i], c[i + 1:])

        def model(self, c):
            return ("model", _str(c[0]))

        def fingerprint(self, c):
            return ("fingerprint", _str(c[0]))

        def device(self, c):
            return ("device", _wordval(c[0]))

        def cost(self, c):
            return ("cost", str(c[0]))

        def cost_model(self, c):
            return c[0]

        def optimizer(self, c):
            return ("optimizer", (_wordval(c[0]), int(c[1])))

        def budget(self, c):
            return ("budget", Budget(bytes=int(c[0]), scope=str(c[1])))

        def scope(self, c):
            return c[0]

        def has_loss(self, c):
            return ("has_loss", c[0])

        def bool(self, c):
            return c[0] == "true"

        def output_spec(self, c):
            return ("output_spec", _str(c[0]))

        # -- values
        def values(self, c):
            return c

        def value_line(self, c):
            return (c[0], str(c[1]), c[2])

        def kind(self, c):
            return c[0]

        def decl(self, c):
            return _make_decl(*c)

        def stride(self, c):
            return _ints(c[0], str(c[0])[1:-1])

        def owner(self, c):
            return (None, int(c[0]))

        def view(self, c):
            return (c[0], 0 if c[1] is None else int(c[1]))

        def source(self, c):
            return _wordval(c[0])

        def requires_grad(self, c):
            return True

        def aliases(self, c):
            return [] if c[0] is None else c[0]

        def alias_items(self, c):
            return [_wordval(t) for t in c]

        def escaped(self, c):
            return Token.new_borrow_pos("NAME", _str(c[0]), c[0])

        # -- graph
        def graph(self, c):
            return c

        def graph_block(self, c):
            phase = str(c[0])
            for rec in c[1:]:
                rec.phase = phase
            return c[1:]

        def phase(self, c):
            return c[0]

        def node_line(self, c):
            name_tok, outs, (op, op_tok), items, attrs = c
            refs, self.arg_refs = self.arg_refs, []
            return _make_node(name_tok, outs, op, op_tok, items, attrs, refs)

        def node_name(self, c):
            return c[0]

        def node_outs(self, c):
            return c

        def no_output(self, c):
            return (None, None)

        def bare_output(self, c):
            return (c[0], None)

        def declared_output(self, c):
            return (c[0], c[1])

        def op(self, c):
            return (_wordval(c[0]), c[0])

        def call_args(self, c):
            return c

        def node_attrs(self, c):
            return c

        def kwarg(self, c):
            return _Kw(c[0], c[1], self.last_key)

        def key(self, c):
            self.last_key = c[0]
            return _wordval(c[0])

        def name_arg(self, c):
            t = c[0]
            if t.startswith("torch."):
                return _torch_const(t)
            self.arg_refs.append(t)
            return Ref(str(t))

        def escaped_ref(self, c):
            t = Token.new_borrow_pos("NAME", _str(c[0]), c[0])
            self.arg_refs.append(t)
            return Ref(str(t))

        def int_arg(self, c):
            return int(c[0])

        def float_arg(self, c):
            return float(c[0])

        def str_arg(self, c):
            return _str(c[0])

        def true_arg(self, c):
            return True

        def false_arg(self, c):
            return False

        def none_arg(self, c):
            return None

        def inf_arg(self, c):
            return Special("inf")

        def ninf_arg(self, c):
            return Special("-inf")

        def nan_arg(self, c):
            return Special("nan")

        def device_arg(self, c):
            return _device(c[0])

        def list_arg(self, c):
            return Seq([] if c[0] is None else c[0])

        def list_items(self, c):
            return c

        def module(self, c):
            return ("module", _wordval(c[0]), c[0])

        def random(self, c):
            return ("random", True, None)

        def mutates(self, c):
            return ("mutates", c, c[0])

        def flops(self, c):
            return ("flops", float(c[0]), c[0])

        def time_us(self, c):
            return ("time_us", float(c[0]), c[0])

        # -- schedule / outputs
        def forward(self, c):
            return [Instr(_INSTR_KINDS[k], t, t.line) for k, t in c]

        backward = forward

        def compute(self, c):
            return (0, c[0])

        def recompute(self, c):
            return (1, c[0])

        def free(self, c):
            return (2, c[0])

        def outputs(self, c):
            return c

        def result(self, c):
            k, v = c
            return (RESULT, _str(k) if k.type == "STRING" else str(int(k)), k, v)

        def grad(self, c):
            k, v = c
            return (GRAD, str(k), k, v)

        def start(self, c):
            return c

    return Builder


def _Builder():
    cls = _parser_cache.get("builder_class")
    if cls is None:
        cls = _parser_cache["builder_class"] = _make_builder_class()
    return cls()


# -------------------------------------------------------- the fast reader

_WS_RE = re.compile(r"[ \t\f\r]*")
_STRING_RE = re.compile(r'"(?:[^"\\\n\r]|\\.)*"')
_INT_RE = re.compile(r"-?\d+")
_FLOAT_RE = re.compile(r"-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)")
_TYPE_RE = re.compile(r"[A-Za-z_]\w*\[[ \t\d,]*\]")
_INTS_RE = re.compile(r"\[[ \t\d,-]*\]")
_DEVICE_RE = re.compile(r'device\((?:[\w.:-]+|"(?:[^"\\\n\r]|\\.)*")\)')
_ARG_WORDS = {"true": True, "false": False, "none": None}
_ARG_SPECIALS = {"inf": "inf", "nan": "nan"}
_KINDS = frozenset(VALUE_DECL_KINDS)


class _FastReader:
    """Reads canonical-looking text quickly; raises _GiveUp on anything else."""

    def __init__(self, text: str):
        self.lines = text.split("\n")
        self.reserved = _reserved()
        self.s = ""
        self.i = 0
        self.ln = 0

    # -- lexing within the current line
    def ws(self) -> int:
        i = self.i = _WS_RE.match(self.s, self.i).end()
        return i

    def end(self) -> bool:
        i = self.ws()
        return i >= len(self.s) or self.s[i] == "#"

    def expect_end(self) -> None:
        if not self.end():
            raise _GiveUp

    def char(self, c: str) -> bool:
        i = self.ws()
        if self.s.startswith(c, i):
            self.i = i + len(c)
            return True
        return False

    def expect(self, c: str) -> None:
        if not self.char(c):
            raise _GiveUp

    def match(self, regex, type_: str):
        i = self.ws()
        m = regex.match(self.s, i)
        if m is None:
            return None
        self.i = m.end()
        return _Token(type_, m.group(), self.ln, i + 1)

    def raw(self, regex) -> str | None:
        """The text `regex` matches here (no token made), or None."""
        i = self.ws()
        m = regex.match(self.s, i)
        if m is None:
            return None
        self.i = m.end()
        return m.group()

    def name(self):
        """A NAME token (any spelling), or None."""
        return self.match(_NAME_RE, "NAME")

    def keyword(self, *words: str) -> str | None:
        i = self.ws()
        m = _NAME_RE.match(self.s, i)
        if m is not None and m.group() in words:
            self.i = m.end()
            return m.group()
        return None

    def expect_keyword(self, word: str) -> None:
        if self.keyword(word) is None:
            raise _GiveUp

    def peek_name(self) -> str | None:
        m = _NAME_RE.match(self.s, self.ws())
        return None if m is None else m.group()

    def ref(self):
        t = self.name()
        if t is not None:
            if t in self.reserved:
                raise _GiveUp
            return t
        if self.char("%"):
            s = self.match(_STRING_RE, "STRING")
            if s is None:
                raise _GiveUp
            return _Token("NAME", _str(s), s.line, s.column)
        raise _GiveUp

    def word(self):
        t = self.name()
        if t is not None:
            return str(t)
        s = self.match(_STRING_RE, "STRING")
        if s is None:
            raise _GiveUp
        return _str(s)

    def string(self) -> str:
        s = self.raw(_STRING_RE)
        if s is None:
            raise _GiveUp
        return _str(s)

    def int_tok(self):
        t = self.match(_INT_RE, "INT")
        if t is None:
            raise _GiveUp
        return t

    def int(self) -> int:
        t = self.raw(_INT_RE)
        if t is None:
            raise _GiveUp
        return int(t)

    # -- lines
    def next_line(self) -> bool:
        """Advance to the next line with code on it; False at the end."""
        lines = self.lines
        while self.ln < len(lines):
            self.s = lines[self.ln]
            self.ln += 1
            self.i = 0
            if not self.end():
                return True
        return False

    def read(self):
        # header
        comments: list[str] = []
        lines = self.lines
        while True:
            if self.ln >= len(lines):
                raise _GiveUp
            self.s = lines[self.ln]
            self.ln += 1
            self.i = 0
            i = self.ws()
            if self.s.startswith("#|", i):
                comments.append(_hcomment_text(_Token("HCOMMENT", self.s[i:], self.ln, i + 1)))
            elif not self.end():
                break
        self.expect_keyword("rir")
        vtok = self.int_tok()
        self.expect_end()
        fields = []
        order = list(HEADER_FIELDS)
        while True:
            if not self.next_line():
                raise _GiveUp
            kw = self.keyword(*order)
            if kw is None:
                break
            del order[:order.index(kw) + 1]
            if kw in ("model", "fingerprint", "output_spec"):
                fields.append((kw, self.string()))
            elif kw == "device":
                fields.append((kw, self.word()))
            elif kw == "cost":
                model = self.keyword(*ir.COST_MODELS)
                if model is None:
                    raise _GiveUp
                fields.append((kw, model))
            elif kw == "optimizer":
                w = self.word()
                n = self.int()
                self.expect_keyword("bytes")
                fields.append((kw, (w, n)))
            elif kw == "budget":
                n = self.int()
                self.expect_keyword("bytes")
                scope = self.keyword("total", "activations")
                if scope is None:
                    raise _GiveUp
                fields.append((kw, Budget(bytes=n, scope=scope)))
            else:
                b = self.keyword("true", "false")
                if b is None:
                    raise _GiveUp
                fields.append((kw, b == "true"))
            self.expect_end()
        header = _make_header(comments, vtok, fields)

        # values
        self.expect_keyword("values")
        self.expect_end()
        value_lines = []
        while True:
            if not self.next_line():
                raise _GiveUp
            if self.keyword("graph"):
                break
            tok = self.ref()
            kind = self.peek_name()
            if kind not in _KINDS:
                raise _GiveUp
            self.keyword(kind)
            d = self.decl()
            self.expect_end()
            value_lines.append((tok, kind, d))

        # graph
        blocks = []
        while True:
            phase = self.keyword(FORWARD, BACKWARD)
            if phase is None:
                raise _GiveUp
            self.expect_end()
            block: list[_NodeRec] = []
            blocks.append(block)
            while True:
                if not self.next_line():
                    raise _GiveUp
                w = self.peek_name()
                if w == "graph" or w == FORWARD:
                    self.keyword(w)
                    break
                rec = self.node_line()
                rec.phase = phase
                block.append(rec)
            if w == FORWARD:
                break

        # schedule
        self.expect_end()
        fwd = self.instrs(BACKWARD)
        bwd = self.instrs("outputs")

        # outputs
        outs = []
        while self.next_line():
            kw = self.keyword(RESULT, GRAD)
            if kw == RESULT:
                k = self.match(_INT_RE, "INT")
                key = self.string() if k is None else str(int(k))
                ktok = k
            elif kw == GRAD:
                ktok = self.ref()
                key = str(ktok)
            else:
                raise _GiveUp
            self.expect("=")
            v = self.ref()
            self.expect_end()
            outs.append((kw, key, ktok, v))
        return [header, value_lines, blocks, fwd, bwd, outs]

    def instrs(self, next_section: str) -> list[Instr]:
        out = []
        kinds = {COMPUTE: COMPUTE, RECOMPUTE: RECOMPUTE, FREE: FREE}
        while True:
            if not self.next_line():
                raise _GiveUp
            kw = self.keyword(COMPUTE, RECOMPUTE, FREE, next_section)
            if kw is None:
                raise _GiveUp
            if kw == next_section:
                self.expect_end()
                return out
            t = self.ref()
            self.expect_end()
            out.append(Instr(kinds[kw], t, t.line))

    def decl(self) -> _Decl:
        t = self.match(_TYPE_RE, "TYPE")
        if t is None:
            raise _GiveUp
        stride = None
        if self.keyword("stride"):
            st = self.match(_INTS_RE, "INTS")
            if st is None:
                raise _GiveUp
            stride = _ints(st, str(st)[1:-1])
        if self.keyword("view"):
            self.expect_keyword("of")
            owner = self.ref()
            n = self.raw(_INT_RE)
            if n is not None:
                self.expect_keyword("bytes")
            storage = (owner, 0 if n is None else int(n))
        else:
            n = self.int()
            self.expect_keyword("bytes")
            storage = (None, n)
        source = None
        if self.keyword("source"):
            source = self.word()
        rg = self.keyword("requires_grad") is not None
        aliases = None
        if self.keyword("aliases"):
            self.expect("[")
            aliases = []
            if not self.char("]"):
                aliases.append(self.word())
                while self.char(","):
                    aliases.append(self.word())
                self.expect("]")
        return _make_decl(t, stride, storage, source, rg, aliases)

    def node_out(self):
        if self.keyword("_"):
            return (None, None)
        tok = self.ref()
        i = self.ws()
        if _TYPE_RE.match(self.s, i):
            return (tok, self.decl())
        return (tok, None)

    def node_line(self) -> _NodeRec:
        name_tok = None
        outs = []
        if not self.char("="):
            first = self.node_out()
            if first[1] is None and first[0] is not None and self.char(":"):
                name_tok = first[0]
                if not self.char("="):
                    outs.append(self.node_out())
            else:
                outs.append(first)
            if outs:
                while self.char(","):
                    outs.append(self.node_out())
                self.expect("=")
        op_t = self.name()
        if op_t is not None:
            if op_t in self.reserved:
                raise _GiveUp
            op = str(op_t)
        else:
            op_t = self.match(_STRING_RE, "STRING")
            if op_t is None:
                raise _GiveUp
            op = _str(op_t)
        self.expect("(")
        items: list = []
        refs: list = []
        if not self.char(")"):
            items.append(self.item(refs))
            while self.char(","):
                items.append(self.item(refs))
            self.expect(")")
        attrs = []
        while not self.end():
            kw = self.keyword("module", "random", "mutates", "flops", "time_us")
            if kw == "module":
                t = self.match(_NAME_RE, "NAME") or self.match(_STRING_RE, "STRING")
                if t is None:
                    raise _GiveUp
                attrs.append(("module", _wordval(t), t))
            elif kw == "random":
                attrs.append(("random", True, None))
            elif kw == "mutates":
                self.expect("(")
                ms = [self.ref()]
                while self.char(","):
                    ms.append(self.ref())
                self.expect(")")
                attrs.append(("mutates", ms, ms[0]))
            elif kw in ("flops", "time_us"):
                t = self.match(_FLOAT_RE, "FLOAT") or self.match(_INT_RE, "INT")
                if t is None:
                    raise _GiveUp
                attrs.append((kw, float(t), t))
            else:
                raise _GiveUp
        return _make_node(name_tok, outs, op, op_t, items, attrs, refs)

    def item(self, refs: list):
        i = self.ws()
        s = self.s
        m = _NAME_RE.match(s, i)
        if m is not None and not s.startswith("device(", i):
            # a keyword argument, or a name argument
            j = _WS_RE.match(s, m.end()).end()
            if s.startswith("=", j):
                key = m.group()
                if key in self.reserved:
                    raise _GiveUp
                kt = _Token("NAME", key, self.ln, i + 1)
                self.i = j + 1
                return _Kw(key, self.arg(refs), kt)
        elif s.startswith('"', i):
            m = _STRING_RE.match(s, i)
            if m is None:
                raise _GiveUp
            j = _WS_RE.match(s, m.end()).end()
            if s.startswith("=", j):
                kt = _Token("STRING", m.group(), self.ln, i + 1)
                self.i = j + 1
                return _Kw(_str(kt), self.arg(refs), kt)
        return self.arg(refs)

    def arg(self, refs: list):
        i = self.ws()
        s = self.s
        if i >= len(s):
            raise _GiveUp
        c = s[i]
        if c == "[":
            self.i = i + 1
            items = []
            if not self.char("]"):
                items.append(self.arg(refs))
                while self.char(","):
                    items.append(self.arg(refs))
                self.expect("]")
            return Seq(items)
        if c == '"':
            return self.string()
        if c == "%":
            t = self.ref()
            refs.append(t)
            return Ref(str(t))
        if c == "-" or c.isdigit():
            if s.startswith("-inf", i):
                if _NAME_RE.match(s, i + 1).end() != i + 4:  # -infinity, -inf.x: let lark decide
                    raise _GiveUp
                self.i = i + 4
                return Special("-inf")
            t = self.raw(_FLOAT_RE)
            if t is not None:
                return float(t)
            return self.int()
        if s.startswith("device(", i):
            t = self.match(_DEVICE_RE, "DEVICE")
            if t is None:
                raise _GiveUp
            return _device(t)
        t = self.name()
        if t is None:
            raise _GiveUp
        if t in _ARG_WORDS:
            return _ARG_WORDS[t]
        if t in _ARG_SPECIALS:
            return Special(_ARG_SPECIALS[t])
        if t in self.reserved:
            raise _GiveUp
        if t.startswith("torch."):
            return _torch_const(t)
        refs.append(t)
        return Ref(str(t))


def _assemble(parts) -> Program:
    header, value_lines, blocks, fwd, bwd, out_recs = parts
    values: list[Value] = []
    where: dict[str, Any] = {}  # value name -> token of its declaration
    views: list[tuple[Value, Any]] = []

    def declare(tok, kind: str, d: _Decl) -> None:
        name = str(tok)
        if name in where:
            ln, _ = _pos(where[name])
            raise _Sem(tok, f"duplicate value `{name}`: it is already declared on line {ln}")
        where[name] = tok
        if d.stride is None:
            stride = ir.contiguous_stride(d.shape)
        else:
            stride = d.stride
            if len(stride) != len(d.shape):
                raise _Sem(d.tok, f"`{name}` has {len(d.shape)} dimensions but a stride of {len(stride)}")
        v = Value(name=name, kind=kind, dtype=d.dtype, shape=d.shape, stride=stride,
                  storage=name if d.storage is None else d.storage, nbytes=d.nbytes,
                  source=d.source, requires_grad=d.requires_grad, aliases=d.aliases)
        values.append(v)
        if d.storage is not None:
            views.append((v, d.storage_tok))

    for tok, kind, d in value_lines:
        declare(tok, kind, d)

    nodes: list[Node] = []
    node_where: dict[str, Any] = {}
    pending_outs: list = []
    for block in blocks:
        for rec in block:
            if rec.name in node_where:
                ln, _ = _pos(node_where[rec.name])
                raise _Sem(rec.name_tok, f"duplicate node `{rec.name}`: a node of that name is on line {ln}")
            node_where[rec.name] = rec.name_tok
            outs = []
            for tok, d in rec.outs:
                if tok is None:
                    outs.append("")
                    continue
                if d is not None:
                    declare(tok, VALUE, d)
                else:
                    pending_outs.append(tok)
                outs.append(str(tok))
            module = ""
            random = False
            mutates: list[str] = []
            flops = time_us = 0.0
            seen_attrs: set[str] = set()
            for kind, val, tok in rec.attrs:
                if kind in seen_attrs:
                    raise _Sem(tok or rec.op_tok, f"node attribute `{kind}` given twice")
                seen_attrs.add(kind)
                if kind == "module":
                    module = val
                elif kind == "random":
                    random = True
                elif kind == "mutates":
                    mutates = [str(t) for t in val]
                    rec.refs.extend(val)
                elif kind == "time_us":
                    time_us = val
                else:
                    flops = val
            nodes.append(Node(name=rec.name, op=rec.op, args=rec.args, kwargs=rec.kwargs, outputs=outs,
                              phase=rec.phase, module=module, random=random, mutates=mutates,
                              flops=flops, time_us=time_us))
            for t in rec.refs:
                if t not in where:
                    pending_outs.append((t, "arg"))

    def undeclared(tok, what: str) -> _Sem:
        close = difflib.get_close_matches(str(tok), list(where), n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        return _Sem(tok, f"{what} `{tok}` is never declared{hint}")

    for item in pending_outs:
        if isinstance(item, tuple):
            tok, _ = item
            if tok not in where:
                raise undeclared(tok, "value")
        elif item not in where:
            raise _Sem(item, f"node output `{item}` is not declared as a value: declare it on this "
                             f"line with its type and storage, e.g. `{item} f32[2,3] 24 bytes`, "
                             f"or under `values`")
    for v, tok in views:
        if v.storage not in where:
            raise undeclared(tok, "storage owner")

    for ins in fwd + bwd:
        tok = ins.target
        if ins.kind == FREE:
            if tok not in where:
                hint = " (that is a node; free its outputs)" if tok in node_where else ""
                raise _Sem(tok, f"free of unknown value `{tok}`{hint}")
        elif tok not in node_where:
            close = difflib.get_close_matches(str(tok), list(node_where), n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise _Sem(tok, f"{ins.kind} of unknown node `{tok}`{hint}")
        ins.target = str(tok)

    outputs = []
    for kind, key, ktok, vtok in out_recs:
        if vtok not in where:
            raise undeclared(vtok, "value")
        outputs.append(Output(kind=kind, key=key, value=str(vtok), line=vtok.line))
    return Program(header=header, values=values, nodes=nodes, forward=fwd, backward=bwd, outputs=outputs)


def parse_program(text: str, filename: str = "<string>") -> Program:
    """Parse `.rir` text.  Instr.line / Output.line are 1-based line numbers."""
    if not isinstance(text, str):
        raise TypeError(f"parse_program expects str, got {type(text).__name__}")
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.endswith("\n"):
        text += "\n"
    gc_was_enabled = gc.isenabled()
    gc.disable()  # many small objects, no cycles: collections only cost time
    try:
        try:
            parts = _FastReader(text).read()
        except Exception:  # noqa: BLE001 - anything unusual: lark decides
            parts = _lark_parse(text, filename)
        return _assemble(parts)
    except _Sem as e:
        line, col = _pos(e.tok)
        raise RirSyntaxError(filename, line, col, e.message) from None
    finally:
        if gc_was_enabled:
            gc.enable()


def _lark_parse(text: str, filename: str):
    import lark.exceptions as le
    lk = _lark()
    tr = _parser_cache["transformer"]
    post = _parser_cache["postlex"]
    with _PARSE_LOCK:
        tr.reset()
        post.text = text
        try:
            return lk.parse(text)
        except _Sem:
            raise
        except le.VisitError as e:  # a callback failed outside our control
            orig = e.orig_exc
            if isinstance(orig, _Sem):
                raise orig from None
            raise RirSyntaxError(filename, 1, 1, f"cannot read plan: {orig}") from None
        except le.UnexpectedInput as e:
            raise _syntax_error(e, text, filename) from None
        except le.LarkError as e:
            raise RirSyntaxError(filename, 1, 1, f"cannot read plan: {e}") from None
        except RecursionError:
            raise RirSyntaxError(filename, 1, 1, "lists nested too deeply") from None
        finally:
            tr.reset()
            post.text = ""


# ----------------------------------------------------------- syntax errors

_TERMINAL_WORDS = {
    "NAME": "a name",
    "STRING": "a string",
    "INT": "an integer",
    "FLOAT": "a number",
    "TYPE": "a dtype and shape like f32[2,3]",
    "INTS": "an integer list like [1,2]",
    "DEVICE": "device(...)",
    "HCOMMENT": "a `#|` comment",
    "_NL": "end of line",
    "$END": "end of file",
}
_ARG_START = {"NAME", "PERCENT", "INT", "FLOAT", "STRING", "TRUE", "FALSE", "NONE", "INF", "NAN",
              "DEVICE", "LSQB"}
# Which section a line starting with this word belongs to.
_SECTION_OF = {"compute": "forward", "recompute": "forward", "free": "forward",
               "result": "outputs", "grad": "outputs"}
_SECTION_ORDER = {"values": 0, "graph": 1, "forward": 2, "backward": 3, "outputs": 4}
_ORDER_TEXT = "sections come in this order: values, graph forward|backward, forward, backward, outputs"


def _literal(name: str) -> str | None:
    t = _parser_cache.get("terminals", {}).get(name)
    if t is not None and type(t.pattern).__name__ == "PatternStr":
        return t.pattern.value
    return None


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    lit = _literal(name)
    return f"`{lit}`" if lit is not None else name.lower()


def _expected_words(expected) -> str:
    names = set(expected)
    words: list[str] = []
    if len(names & _ARG_START) >= 8:
        names -= _ARG_START
        words.append("an argument (a value name, number, string, true/false/none, list, "
                     "torch.* constant or device(...))")
    elif {"NAME", "PERCENT"} <= names:
        names -= {"NAME", "PERCENT"}
        words.append("a name")
    names.discard("PERCENT")
    rest = sorted(n for n in names if _literal(n) is None and n not in ("_NL", "$END"))
    lits = sorted(_describe_terminal(n) for n in names if _literal(n) is not None)
    words += [_describe_terminal(n) for n in rest] + lits
    for n in ("_NL", "$END"):
        if n in names:
            words.append(_TERMINAL_WORDS[n])
    if len(words) > 10:
        words = words[:10] + ["..."]
    if not words:
        return "nothing"
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _describe_token(tok) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    if _literal(tok.type) is not None:
        return f"`{tok}`"
    s = str(tok)
    if len(s) > 40:
        s = s[:37] + "..."
    return f"{_describe_terminal(tok.type)} `{s}`"


def _exact_accepts(state) -> set[str] | None:
    """The terminals the parser could take in `state`, found by simulating
    reductions on the state stack only (LALR's own `expected` sets merge the
    lookaheads of every context a rule is used in)."""
    try:
        from lark.parsers.lalr_analysis import Shift
        conf = state.parse_conf
        states = conf.states
        stack0 = list(state.state_stack)
        end = conf.end_state
    except (AttributeError, ImportError):
        return None
    terms = _parser_cache.get("terminal_names")
    if terms is None:
        terms = {k for st in states.values() for k in st if k.isupper() or k == "$END"}
        _parser_cache["terminal_names"] = terms
    out = set()
    for t in terms:
        stack = list(stack0)
        for _ in range(100000):
            act = states[stack[-1]].get(t)
            if act is None:
                break
            action, arg = act
            if action is Shift:
                out.add(t)
                break
            size = len(arg.expansion)
            if size:
                del stack[-size:]
            goto = states[stack[-1]].get(arg.origin.name)
            if goto is None:
                break
            stack.append(goto[1])
            if stack[-1] == end:
                out.add(t)
                break
    return out


def _section_at(lines: list[str], line: int) -> str:
    """The section line `line` (1-based) is in, judged by the section lines above it."""
    for src in reversed(lines[:line - 1]):
        w = src.split("#", 1)[0].split()
        if w and not src[:1].isspace() and w[0] in _SECTION_ORDER:
            return w[0]
    return "header"


def _syntax_error(e, text: str, filename: str) -> RirSyntaxError:
    import lark.exceptions as le
    lines = text.split("\n")
    nlines = len(lines) - 1 if text.endswith("\n") else len(lines)
    line = getattr(e, "line", -1)
    col = getattr(e, "column", -1)
    if not isinstance(line, int) or line < 1:
        line, col = max(1, nlines), 1
    if not isinstance(col, int) or col < 1:
        col = 1
    state = getattr(e, "state", None)
    accepts = _exact_accepts(state) if state is not None else None

    if isinstance(e, le.UnexpectedCharacters):
        allowed = accepts if accepts is not None else set(getattr(e, "allowed", None) or ())
        ch = e.char
        if ch == '"':
            msg = "unterminated string literal (a string ends with `\"` on the same line)"
        else:
            msg = f"unexpected character {ch!r}"
            if allowed:
                msg += f"; expected {_expected_words(allowed)}"
        return RirSyntaxError(filename, line, col, msg)

    tok = getattr(e, "token", None)
    expected = accepts if accepts else set(getattr(e, "expected", None) or ())
    is_end = tok is None or tok.type == "$END"
    found = "end of file" if is_end else _describe_token(tok)
    if is_end:
        line, col = max(1, nlines), max(1, len(lines[nlines - 1]) + 1 if nlines else 1)
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    code = src.split("#", 1)[0]
    words = code.split()
    lead = words[0] if words else ""
    sections = [s for s in _SECTION_ORDER if s.upper() in expected]

    # A lone unknown word at the start of a line: a misspelt section or header line.
    if (not is_end and words and not code[:1].isspace() and len(words) <= 2 and "=" not in code
            and lead not in _SECTION_ORDER and lead not in HEADER_FIELDS and lead != "rir"
            and lead not in _SECTION_OF and _NAME_RE.fullmatch(lead)):
        header_too = any(f.upper() in expected for f in HEADER_FIELDS)
        choices = list(_SECTION_ORDER) + (list(HEADER_FIELDS) if header_too else [])
        close = difflib.get_close_matches(lead, choices, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        what = "header line or section" if header_too else "section"
        return RirSyntaxError(filename, line, 1, f"unknown {what} `{lead}`{hint} ({_ORDER_TEXT})")

    msg = f"expected {_expected_words(expected)}, found {found}"
    if sections:
        missing = sections[-1]
        word = str(tok) if not is_end else ""
        later = _SECTION_ORDER.get(word, -1)
        if word in _SECTION_OF:
            later = _SECTION_ORDER[_SECTION_OF[word]] + 0.5
        if is_end:
            msg += f": the file ends before the `{missing}` section (truncated?); {_ORDER_TEXT}"
        elif later > _SECTION_ORDER[missing]:
            msg += f": the `{missing}` section is missing; {_ORDER_TEXT}"
        elif (code[:1].isspace() and lead == word
              and expected <= {k.upper() for k in (*_SECTION_ORDER, *HEADER_FIELDS)} | {"_NL"}):
            msg += f"; is the `{missing}` line missing above?"
    elif is_end:
        msg += ": the file ends early (truncated?)"
    elif (lead in _SECTION_OF and col > len(src) - len(src.lstrip()) + 1
          and _section_at(lines, line) not in (_SECTION_OF[lead], "backward")):
        sec = _SECTION_OF[lead]
        where = "`forward` or `backward`" if sec == "forward" else f"`{sec}`"
        msg += f"; `{lead}` lines belong in the {where} section: is its header line missing?"
    elif "=" in code and expected and expected <= {k.upper() for k in VALUE_DECL_KINDS}:
        msg += "; this looks like a node line: is the `graph forward` line missing?"
    if tok is not None and tok.type == "NAME":
        lits = [lit for n in expected if (lit := _literal(n)) and _NAME_RE.fullmatch(lit)]
        glued = [lit for lit in sorted(lits, key=len, reverse=True) if str(tok).startswith(lit)]
        close = difflib.get_close_matches(str(tok), lits, n=1)
        if glued:
            msg += f"; did you mean `{glued[0]} {str(tok)[len(glued[0]):]}`?"
        elif close:
            msg += f"; did you mean `{close[0]}`?"
    if lead in _reserved() and "NAME" not in expected and not is_end and col > 1:
        msg += f" (`{lead}` is a keyword here; a value of that name is written %\"{lead}\")"
    return RirSyntaxError(filename, line, col, msg)


# --------------------------------------------------------------- files


def load_plan(path: str | os.PathLike) -> Program:
    """Read and parse a `.rir` file."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as e:
        raise OSError(e.errno, f"cannot read plan {name}: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        start = e.start
        line = data.count(b"\n", 0, start) + 1
        col = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise RirSyntaxError(name, line, col, f"not UTF-8 text: byte 0x{data[start]:02x} cannot be "
                                              f"decoded; save the plan as UTF-8") from None
    return parse_program(text, name)


def save_plan(program: Program, path: str | os.PathLike) -> None:
    """Write `program` to `path` atomically: a temporary file in the same
    directory, fsync, rename.  On failure nothing is left behind and an
    existing file at `path` is untouched."""
    write_atomically(path, format_program(program).encode("utf-8"))


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory,
    fsync and rename: readers see the old file or the whole new one, never a
    half-written one, and a failure leaves nothing behind."""
    name = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(name))
    try:
        mode = os.stat(name).st_mode & 0o7777
    except OSError:
        umask = os.umask(0o22)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(name) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
