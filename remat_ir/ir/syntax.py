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
    host_budget 1048576 bytes                   # 1.00 MiB of offloaded copies (line absent: none)
    has_loss true
    output_spec "[1, {\\"type\\": null, ...}]"
    rewrites chunked_loss:8                     # graph rewrites applied (line absent: none)
    autocast cpu:bfloat16                       # the caller's torch.autocast (line absent: none)
    held_gradients true                         # a compiled backward: gradients held until it returns
    constants "scale=2.0", "use_cache=False"    # the call's non-tensor arguments
    guards "aten.all.default(aten.eq.Scalar(attention_mask, 1)) == True"   # decisions on input values

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
  `true`/`false`/`none`, `"strings"` (JSON escapes), lists `[a, b]` (nested
  at most 32 deep: `MAX_NESTING`),
  `torch.float32` / `torch.strided` / `torch.contiguous_format` (dtype, layout,
  memory format), `device(cuda:0)`; keyword arguments `key=value` come last.
  A keyword argument's name is an identifier (`[A-Za-z_][A-Za-z0-9_]*`), bare,
  or quoted (`"true"=...`) when it is one of the argument keywords `true`,
  `false`, `none`, `inf`, `nan`; no other name is read.
* A symbolic plan (sizes that vary between calls, `remat_ir.ir.sizes`) has
  header lines `sizes B=2..4, T=32..128` and `size_guards "T <= 128"`; a
  dimension or stride may be a size expression (`f32[B*T,64]`,
  `stride [64*T,64,1]`; the brackets delimit it, commas inside `max(a,b)`
  do not split), a byte count or an integer argument `$B` or `$(256*B*T)`
  (parentheses at most MAX_SIZE_PARENS deep).  Expressions print in
  canonical text (`sizes.size_text`); a contiguous stride (`default_stride`)
  is left out; byte sizes in comments are at the range's high end.
* Schedule: `forward` then `backward` sections of `compute NODE`,
  `recompute NODE`, `free VALUE`, and the offload instructions `offload VALUE`,
  `reload VALUE`, `wait VALUE` (what they mean: `remat_ir.check.simulate`);
  `outputs` of `result KEY = VALUE` and `grad VALUE = VALUE`.

Reading: one hand-written reader (`remat_ir.ir.parser`) takes the text a line
at a time, implements the whole grammar and words every error itself (its time on a
GPT-2 medium plan: docs/09-benchmarks.md).  `grammar/rir.lark` is
the language's definition: the tests run lark on it as an oracle and check
that lark and the reader accept the same texts and read them alike.

Errors are `RirSyntaxError` (a ValueError) rendered `file:line:col: message`.
Parsing resolves names: every value referenced is declared exactly once,
`compute`/`recompute` name nodes, `free`/`offload`/`reload`/`wait` name values; whether the schedule
makes sense is the verifier's business.
"""
from __future__ import annotations

import re

from remat_ir.ir import sizes as sz
from remat_ir.ir.types import BUFFER, DTYPE_SHORT, INPUT, PARAM, TANGENT, VALUE, contiguous_stride


# Error messages echo what they complain about; a token longer than
# LONG_TOKEN characters (a 2 MB name in a generated file) is cut to its first
# CUT_TOKEN and "...", and a whole message to MAX_MESSAGE characters.
LONG_TOKEN, CUT_TOKEN, MAX_MESSAGE = 200, 60, 2000
_LONG_TOKEN_RE = re.compile(r"[^\s`'\"]{%d,}" % (LONG_TOKEN + 1))


def clip(message: str) -> str:
    """`message` of bounded length: each run of more than LONG_TOKEN
    characters without blanks or quotes cut to its first CUT_TOKEN and "...",
    then the whole to MAX_MESSAGE characters.  Idempotent; short messages
    come back unchanged."""
    if len(message) <= LONG_TOKEN:
        return message
    message = _LONG_TOKEN_RE.sub(lambda m: m.group()[:CUT_TOKEN] + "...", message)
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 3] + "..."
    return message


class RirSyntaxError(ValueError):
    """A `.rir` text that cannot be read: `str(e) == "file:line:col: message"`
    (the message `clip`ped: whatever it echoes, it stays short)."""

    def __init__(self, filename: str, line: int, column: int, message: str):
        message = clip(message)
        self.filename = filename
        self.line = line
        self.column = column
        self.message = message
        super().__init__(f"{filename}:{line}:{column}: {message}")

    def __reduce__(self):
        return (type(self), (self.filename, self.line, self.column, self.message))


NAME_RE = re.compile(r"[A-Za-z_]\w*(?:[.:]\w+)*")
KWARG_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a keyword argument's name
DEVICE_BARE_RE = re.compile(r"[\w.:-]+")
RESULT_KEY_RE = re.compile(r"0|-?[1-9][0-9]*")
ESCAPE_RE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff]")

# Dtype names a `.rir` file may use (torch attribute names).
DTYPES = frozenset(DTYPE_SHORT) | frozenset({
    "uint16", "uint32", "uint64", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
})
LAYOUTS = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
                     "sparse_bsc", "_mkldnn", "jagged"})
MEMORY_FORMATS = frozenset({"contiguous_format", "preserve_format", "channels_last",
                            "channels_last_3d"})
SPECIALS = ("inf", "-inf", "nan")
HEADER_FIELDS = ("model", "fingerprint", "device", "cost", "optimizer", "budget", "host_budget", "has_loss",
                 "output_spec", "rewrites", "autocast", "held_gradients", "constants", "guards", "sizes", "size_guards")
VALUE_DECL_KINDS = (INPUT, PARAM, BUFFER, TANGENT, VALUE)

# Keywords that can stand where a name can, so a value of that name is
# written `%"..."` (a test keeps this equal to what the grammar implies).
RESERVED = frozenset({"graph", "forward", "_", "true", "false", "none", "inf", "nan"})


# ------------------------------------------------------------ symbolic sizes
#
# A symbolic plan (`remat_ir.ir.sizes`) writes sizes as expressions over its
# size symbols: a dimension or stride inside a type's brackets
# (`f32[B*T,64]`, `stride [64*T,64,1]`: the brackets delimit it), a byte
# count or an integer argument as `$B` (one symbol) or `$(256*B*T)`.  The
# header says `sizes B=2..4, T=32..128` (SIZE_RANGE_RE each) and
# `size_guards "T <= 128"`.

SYMBOL_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SIZE_RANGE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\d+\.\.\d+")
# The characters of a size expression, less parentheses.
_SIZE_CHARS = r"[ \tA-Za-z0-9_,*+\-\/%]"  # (`\/`: a `/` ends a regular expression in rir.lark)
# How deep parentheses nest in a `$(...)`, the outer pair counted: the
# grammar's SYM lexeme balances that many (a regular expression balances a
# fixed depth), and the reader refuses deeper ones at their line.
MAX_SIZE_PARENS = 8


def _sym_pattern(depth: int) -> str:
    inner = _SIZE_CHARS + "*"
    for _ in range(depth - 1):
        inner = r"(?:" + _SIZE_CHARS + r"|\(" + inner + r"\))*"
    return r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\(" + inner + r"\))"


# `$B` or `$(B*T)`: a byte count or an integer argument that is a size expression.
SYM_RE = re.compile(_sym_pattern(MAX_SIZE_PARENS))
# A dtype and shape (`f32[2,64]`, `f32[B,T-1,max(T,8)]`), a stride list.
TYPE_RE = re.compile(r"[A-Za-z_]\w*\[(?:" + _SIZE_CHARS + r"|[()])*\]")
INTS_RE = re.compile(r"\[(?:" + _SIZE_CHARS + r"|[()])*\]")
INT_TEXT_RE = re.compile(r"[ \t]*-?\d+[ \t]*")


def split_sizes(body: str) -> list[str]:
    """The items of a dimension or stride list's text (between its
    brackets), split at the commas outside parentheses: `B,max(T,8)` ->
    [`B`, `max(T,8)`]; [] for blanks only."""
    if not body.strip():
        return []
    out, depth, start = [], 0, 0
    for i, c in enumerate(body):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(body[start:i])
            start = i + 1
    out.append(body[start:])
    return out


def paren_depth(text: str) -> int:
    """How deep parentheses nest in `text`."""
    depth = most = 0
    for c in text:
        if c == "(":
            depth += 1
            most = max(most, depth)
        elif c == ")":
            depth -= 1
    return most


def sym_text(x) -> str:
    """A byte count or an integer argument that is an expression, as the
    text writes it: `$B` for one symbol, else `$(expr)` (canonical)."""
    t = sz.size_text(x)
    return "$" + t if SYMBOL_RE.fullmatch(t) else f"$({t})"


def default_stride(shape: list) -> list:
    """The stride a value has when its line gives none: the contiguous
    stride, for a symbolic shape as expressions (`[B,T,64]` -> `[64*T,64,1]`;
    a symbolic dimension is taken to be at least 1)."""
    if all(type(d) is int for d in shape):
        return contiguous_stride(shape)
    stride: list = []
    coef, factors = 1, []  # the product so far: an int and expressions, those from the left first
    for d in reversed(shape):
        if not factors:
            stride.append(coef)
        else:
            stride.append(sz.normal_size("*".join(([str(coef)] if coef != 1 else []) +
                                                  [f"({f})" for f in factors])))
        if type(d) is int:
            coef *= max(d, 1)
        else:
            factors.insert(0, d)
    return stride[::-1]
