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
      compute   emb                             # 64.0 KiB
      free      emb                             # 64.0 KiB
    backward
      recompute emb                             # 64.0 KiB
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
  `mutates(a, b)`, `flops 1.5e6`.  Phase comes from the enclosing
  `graph forward` / `graph backward` block; blocks repeat when phases
  interleave.
* Arguments: value names, ints, floats (repr), `inf`/`-inf`/`nan` (Special),
  `true`/`false`/`none`, `"strings"` (JSON escapes), lists `[a, b]`,
  `torch.float32` / `torch.strided` / `torch.contiguous_format` (dtype, layout,
  memory format), `device(cuda:0)`; keyword arguments `key=value` come last.
* Schedule: `forward` then `backward` sections of `compute NODE`,
  `recompute NODE`, `free VALUE`; `outputs` of `result KEY = VALUE` and
  `grad VALUE = VALUE`.

Errors are `RirSyntaxError` (a ValueError) rendered `file:line:col: message`.
Parsing resolves names: every value referenced is declared exactly once,
`compute`/`recompute` name nodes, `free` names values; whether the schedule
makes sense is the verifier's business.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgspec

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
SECTIONS = ("values", "graph", "forward", "backward", "outputs")
HEADER_FIELDS = ("model", "fingerprint", "device", "optimizer", "budget", "has_loss", "output_spec")
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
    return s if _bare_ok(s) else _quote(s)


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
        emit(_comment("values", f"{len(listed)} values, {human_bytes(owned)}" if listed else ""))
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
                        note = human_bytes(v.nbytes)
                elif alloc.get(ins.target):
                    note = human_bytes(alloc[ins.target])
                body = f"  {ins.kind:<9} {r:<{w}}" if note else f"  {ins.kind:<9} {r}"
                where.append(emit(_comment(body, note)))

        emit("")
        emit("outputs")
        for o in p.outputs:
            if o.kind == RESULT:
                key = o.key if re.fullmatch(r"-?(?:0|[1-9]\d*)", o.key) and o.key != "-0" else _quote(o.key)
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
                tr = _Builder()
                p = lark.Lark(grammar_text(), parser="lalr", lexer="contextual", transformer=tr,
                              maybe_placeholders=True, propagate_positions=False)
                _parser_cache["transformer"] = tr
                _parser_cache["terminals"] = {t.name: t for t in p.terminals}
                _parser_cache["reserved"] = _compute_reserved(p)
                _parser_cache["lark"] = p
    return p


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


def _reserved() -> frozenset[str]:
    r = _parser_cache.get("reserved")
    if r is None:
        _lark()
        r = _parser_cache["reserved"]
    return r


# ----------------------------------------------------------------- parsing


class _Sem(Exception):
    """A semantic error found while building; carries the offending token."""

    def __init__(self, tok, message: str):
        self.tok = tok
        self.message = message


def _pos(tok) -> tuple[int, int]:
    line = getattr(tok, "line", None) or 1
    col = getattr(tok, "column", None) or 1
    return line, col


def _str(tok) -> str:
    try:
        return json.loads(tok, strict=False)
    except ValueError as e:
        raise _Sem(tok, f"bad string literal {str(tok)[:60]}: {e.msg if hasattr(e, 'msg') else e}")


def _wordval(tok) -> str:
    return _str(tok) if tok.type == "STRING" else str(tok)


def _ints(tok, text: str) -> list[int]:
    body = text.strip()
    if not body:
        return []
    try:
        return [int(x) for x in body.split(",")]
    except ValueError:
        raise _Sem(tok, f"bad integer list `{tok}`: write integers separated by commas, like [2,64,128]")


def _dtype_name(tok, short: str) -> str:
    long = ir.DTYPE_LONG.get(short)
    if long is not None:
        return long
    if short in DTYPES:
        return short
    close = difflib.get_close_matches(short, list(ir.DTYPE_LONG) + sorted(DTYPES), n=1)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    raise _Sem(tok, f"unknown dtype `{short}` (known: {', '.join(ir.DTYPE_LONG)}){hint}")


class _Kw:
    __slots__ = ("key", "value", "tok")

    def __init__(self, key, value, tok):
        self.key, self.value, self.tok = key, value, tok


class _Decl:
    __slots__ = ("tok", "dtype", "shape", "stride", "storage", "storage_tok", "nbytes", "source",
                 "requires_grad", "aliases")


class _NodeRec:
    __slots__ = ("name", "name_tok", "outs", "op", "op_tok", "args", "kwargs", "attrs", "refs", "phase")


def _make_builder_class():
    from lark import Transformer, Token

    class Builder(Transformer):
        """Builds plain records while lark parses (LALR callbacks)."""

        def __init__(self):
            super().__init__(visit_tokens=False)
            self.reset()

        def reset(self):
            self.arg_refs: list = []  # ref tokens seen in the current node's args

        # -- header
        def hcomment(self, c):
            tok = c[0]
            rest = str(tok)[2:].rstrip()
            if rest.startswith(" "):
                return rest[1:]
            if rest.startswith('"'):
                return _str(Token.new_borrow_pos("STRING", rest, tok))
            return rest

        def header(self, c):
            comments = []
            i = 0
            while isinstance(c[i], str) and not isinstance(c[i], Token):
                comments.append(c[i])
                i += 1
            vtok = c[i]
            if int(vtok) != ir.FORMAT_VERSION:
                raise _Sem(vtok, f"unsupported format version {vtok}: this remat-ir reads "
                                 f"`rir {ir.FORMAT_VERSION}`")
            h = Header(version=int(vtok), comment=comments)
            for field, val in c[i + 1:]:
                setattr(h, field, val)
            return h

        def model(self, c):
            return ("model", _str(c[0]))

        def fingerprint(self, c):
            return ("fingerprint", _str(c[0]))

        def device(self, c):
            return ("device", _wordval(c[0]))

        def optimizer(self, c):
            return ("optimizer_bytes", int(c[1])), ("optimizer", _wordval(c[0]))

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
            ref, kind, d = c
            return (ref, str(kind), d)

        def kind(self, c):
            return c[0]

        def decl(self, c):
            t, stride, storage, source, rg, aliases = c
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
            d.requires_grad = rg is not None
            d.aliases = [] if aliases is None else aliases
            return d

        def stride(self, c):
            s = str(c[0])
            return _ints(c[0], s[1:-1])

        def owner(self, c):
            return (None, int(c[0]))

        def view(self, c):
            return (c[0], 0 if c[1] is None else int(c[1]))

        def source(self, c):
            return _wordval(c[0])

        def requires_grad(self, c):
            return True

        def aliases(self, c):
            if len(c) == 1 and c[0] is None:
                return []
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
            rec.refs = self.arg_refs
            self.arg_refs = []
            return rec

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
            t = c[0]
            return (_wordval(t), t)

        def call_args(self, c):
            return c

        def node_attrs(self, c):
            return c

        def kwarg(self, c):
            k, v = c
            return _Kw(k, v, self._last_key_tok)

        def key(self, c):
            t = c[0]
            self._last_key_tok = t
            return _wordval(t)

        def name_arg(self, c):
            t = c[0]
            if t.startswith("torch."):
                attr = t[6:]
                if attr in DTYPES:
                    return DType(attr)
                if attr in LAYOUTS:
                    return Layout(attr)
                if attr in MEMORY_FORMATS:
                    return MemoryFormat(attr)
                raise _Sem(t, f"unknown torch constant `{t}`: expected a dtype (torch.float32, ...), "
                              f"a layout (torch.strided, ...) or a memory format "
                              f"(torch.contiguous_format, ...); write a value named so as %\"{t}\"")
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
            s = str(c[0])[7:-1]
            return Device(_str(Token.new_borrow_pos("STRING", s, c[0])) if s.startswith('"') else s)

        def list_arg(self, c):
            if len(c) == 1 and c[0] is None:
                return Seq([])
            return Seq(list(c))

        def module(self, c):
            return ("module", _wordval(c[0]), c[0])

        def random(self, c):
            return ("random", True, None)

        def mutates(self, c):
            return ("mutates", c, c[0])

        def flops(self, c):
            return ("flops", float(c[0]), c[0])

        # -- schedule / outputs
        def forward(self, c):
            return [Instr(COMPUTE if k == 0 else RECOMPUTE if k == 1 else FREE, t, t.line) for k, t in c]

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
            key = _str(k) if k.type == "STRING" else str(int(k))
            return (RESULT, key, k, v)

        def grad(self, c):
            k, v = c
            return (GRAD, str(k), k, v)

        def start(self, c):
            return c

    return Builder


class _LazyBuilder:
    cls = None


def _Builder():
    if _LazyBuilder.cls is None:
        _LazyBuilder.cls = _make_builder_class()
    return _LazyBuilder.cls()


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
            flops = 0.0
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
                else:
                    flops = val
            nodes.append(Node(name=rec.name, op=rec.op, args=rec.args, kwargs=rec.kwargs, outputs=outs,
                              phase=rec.phase, module=module, random=random, mutates=mutates,
                              flops=flops))
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
    if not text.endswith("\n"):
        text += "\n"
    lk = _lark()
    tr = _parser_cache["transformer"]
    import lark.exceptions as le
    with _PARSE_LOCK:
        tr.reset()
        try:
            parts = lk.parse(text)
            return _assemble(parts)
        except _Sem as e:
            line, col = _pos(e.tok)
            raise RirSyntaxError(filename, line, col, e.message) from None
        except le.VisitError as e:  # a callback failed outside our control
            orig = e.orig_exc
            if isinstance(orig, _Sem):
                line, col = _pos(orig.tok)
                raise RirSyntaxError(filename, line, col, orig.message) from None
            raise RirSyntaxError(filename, 1, 1, f"cannot read plan: {orig}") from None
        except le.UnexpectedInput as e:
            raise _syntax_error(e, text, filename) from None
        except le.LarkError as e:
            raise RirSyntaxError(filename, 1, 1, f"cannot read plan: {e}") from None
        except RecursionError:
            raise RirSyntaxError(filename, 1, 1, "nesting too deep") from None


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


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    t = _parser_cache.get("terminals", {}).get(name)
    if t is not None and type(t.pattern).__name__ == "PatternStr":
        return f"`{t.pattern.value}`"
    return name.lower()


def _literal(name: str) -> str | None:
    t = _parser_cache.get("terminals", {}).get(name)
    if t is not None and type(t.pattern).__name__ == "PatternStr":
        return t.pattern.value
    return None


def _expected_words(expected) -> str:
    names = set(expected)
    words: list[str] = []
    if len(names & _ARG_START) >= 8:
        names -= _ARG_START
        words.append("an argument (a value name, number, string, true/false/none, list, torch.* "
                     "constant or device(...))")
    elif {"NAME", "PERCENT"} <= names:
        names -= {"NAME", "PERCENT"}
        words.append("a name")
    names.discard("PERCENT")
    lits = sorted(n for n in names if _literal(n) is not None)
    rest = sorted(n for n in names if _literal(n) is None)
    words += [_describe_terminal(n) for n in rest if n != "_NL"]
    words += [_describe_terminal(n) for n in lits]
    if "_NL" in names:
        words.append("end of line")
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


def _syntax_error(e, text: str, filename: str) -> RirSyntaxError:
    import lark.exceptions as le
    lines = text.split("\n")
    line = getattr(e, "line", -1) or -1
    col = getattr(e, "column", -1) or -1
    if line < 1:
        line = max(1, len(lines) - 1 if text.endswith("\n") else len(lines))
        col = 1
    if col < 1:
        col = 1
    if isinstance(e, le.UnexpectedCharacters):
        ch = e.char
        if ch == '"':
            msg = "unterminated string literal (strings end with `\"` on the same line)"
        else:
            msg = f"unexpected character {ch!r}"
            allowed = getattr(e, "allowed", None)
            if allowed:
                msg += f"; expected {_expected_words(allowed)}"
        return RirSyntaxError(filename, line, col, msg)

    tok = getattr(e, "token", None)
    expected = set(getattr(e, "expected", None) or ())
    found = _describe_token(tok) if tok is not None else "end of file"
    sections_expected = [s for s in SECTIONS if s.upper() in expected]
    is_end = tok is None or tok.type == "$END"

    # A lone unknown word at the start of a line where a section could begin.
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    code = src.split("#", 1)[0]
    words = code.split()
    if (sections_expected and words and not code[:1].isspace() and len(words) <= 2
            and words[0] not in SECTIONS and words[0] not in HEADER_FIELDS and words[0] != "rir"
            and _NAME_RE.fullmatch(words[0])):
        header_too = any(f.upper() in expected for f in HEADER_FIELDS)
        choices = list(SECTIONS) + (list(HEADER_FIELDS) if header_too else [])
        close = difflib.get_close_matches(words[0], choices, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        what = "header line or section" if header_too else "section"
        return RirSyntaxError(filename, line, 1,
                              f"unknown {what} `{words[0]}`{hint} (sections come in this order: "
                              f"values, graph forward|backward, forward, backward, outputs)")

    msg = f"expected {_expected_words(expected)}, found {found}"
    if sections_expected:
        missing = sections_expected[-1]
        later = tok is not None and tok.type in {s.upper() for s in SECTIONS} \
            and SECTIONS.index(str(tok)) > SECTIONS.index(missing)
        if is_end:
            msg += (f": the file ends before section `{missing}` (truncated?); sections come in "
                    f"this order: values, graph, forward, backward, outputs")
        elif later:
            msg += (f": section `{missing}` is missing; sections come in this order: values, graph, "
                    f"forward, backward, outputs")
    elif is_end:
        msg += ": the file ends in the middle of a line (truncated?)"
    if tok is not None and tok.type == "NAME":
        lits = [_literal(n) for n in expected if _literal(n) and _NAME_RE.fullmatch(_literal(n))]
        close = difflib.get_close_matches(str(tok), lits, n=1)
        if close:
            msg += f"; did you mean `{close[0]}`?"
        elif str(tok) in _reserved() or str(tok) in {_literal(n) for n in _parser_cache["terminals"]}:
            pass
    if tok is not None and tok.type in {"GRAPH", "FORWARD", "BACKWARD", "VALUES", "OUTPUTS", "UNDERSCORE",
                                         "TRUE", "FALSE", "NONE", "INF", "NAN"} and "NAME" in expected:
        msg += f"; a value named `{tok}` is written %\"{tok}\""
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
    name = os.fspath(path)
    data = format_program(program).encode("utf-8")
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
