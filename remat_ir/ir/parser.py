"""Read `.rir` text into a `Program` (the format: `remat_ir.ir.syntax`).

    parse_program(text, filename) -> Program
    grammar_text() -> str                   the text of grammar/rir.lark

One hand-written reader.  The language is line oriented (no token spans a
line break, and blank and comment lines may stand anywhere), so the reader
takes the text a line at a time: the section it is in and the line's first
word say what the line is, and a small recursive-descent reader per kind of
line takes it apart.  It implements all of `grammar/rir.lark`, the
language's definition; tests/test_text.py runs lark on that grammar as an
oracle and checks that both accept the same texts and read them alike.

Then `_assemble` resolves names: every value is declared once, every name
used is declared somewhere, `compute` and `recompute` name nodes, `free`,
`offload`, `reload` and `wait` name values.
"""
from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from typing import Any

from remat_ir.ir.guards import Guard, GuardError
from remat_ir.ir import sizes as sz
from remat_ir.ir import types as ir
from remat_ir.ir.types import (
    BACKWARD, FORWARD, GRAD, INSTR_KINDS, MAX_NESTING, NODE_INSTRS, RESULT, VALUE,
    Budget, Device, DType, Header, Instr, Layout, MemoryFormat, Node, Output, Program,
    Ref, Seq, Special, Sym, Value,
)
from remat_ir.ir.syntax import (
    DTYPES, HEADER_FIELDS, INT_TEXT_RE, INTS_RE, KWARG_RE, LAYOUTS, MAX_SIZE_PARENS, MEMORY_FORMATS, NAME_RE,
    SIZE_RANGE_RE, SYM_RE, TYPE_RE, VALUE_DECL_KINDS, RirSyntaxError, default_stride, paren_depth, split_sizes,
)

__all__ = ["parse_program", "grammar_text"]


def grammar_text() -> str:
    """The text of `rir.lark`: package data of `remat_ir.grammar` when
    installed, `<source tree>/grammar/rir.lark` otherwise."""
    try:
        from importlib.resources import files
        res = files("remat_ir.grammar") / "rir.lark"
        if res.is_file():
            return res.read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = Path(__file__).resolve().parents[2] / "grammar" / "rir.lark"
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise RuntimeError(f"remat-ir: cannot find the .rir grammar (package remat_ir.grammar "
                           f"or {path}): {e}") from e


def parse_program(text: str, filename: str = "<string>") -> Program:
    """Parse `.rir` text.  Instr.line, Output.line, Value.line, Node.line and
    Header.lines are 1-based line numbers."""
    if not isinstance(text, str):
        raise TypeError(f"parse_program expects str, got {type(text).__name__}")
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.endswith("\n"):
        text += "\n"
    reader = _Reader(text, filename)
    return _assemble(reader.read(), reader.error_at)


# ----------------------------------------------------------------- lexemes

# The grammar's terminals, spelt as in rir.lark.
_WS = re.compile(r"[\t \f\r]*")
_NAME = NAME_RE
_STRING = re.compile(r'"(?:[^"\\\n\r]|\\.)*"')
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)")
_TYPE = TYPE_RE
_INTS = INTS_RE
_SYM = SYM_RE
_SIZE_RANGE = SIZE_RANGE_RE
_DEVICE = re.compile(r'device\((?:[\w.:-]+|"(?:[^"\\\n\r]|\\.)*")\)')

# Every keyword of the grammar that is spelt like a name (a test keeps this
# equal to the grammar's).  A keyword is only a keyword where the grammar
# expects it: elsewhere the same word is a name.
KEYWORDS = frozenset({
    "rir", "model", "fingerprint", "device", "cost", "flops", "profile", "optimizer", "bytes",
    "budget", "total", "activations", "host_budget", "has_loss", "output_spec", "rewrites", "autocast",
    "held_gradients", "constants", "guards", "sizes", "size_guards",
    "true", "false",
    "values", "input", "param", "buffer", "tangent", "value", "stride", "view", "of", "source",
    "requires_grad", "aliases", "graph", "forward", "backward", "_", "none", "inf", "nan",
    "module", "random", "mutates", "time_us", "compute", "recompute", "free", "offload", "reload", "wait",
    "outputs",
    "result", "grad",
})

_ARG_WORDS: dict[str, Any] = {"true": True, "false": False, "none": None,
                              "inf": Special("inf"), "nan": Special("nan")}
_KWARG_NAME = ("a keyword argument name: an identifier (letters, digits and `_`, not starting with a "
               "digit), bare or in quotes")
_INSTRS = INSTR_KINDS
_NODE_ATTRS = ("module", "random", "mutates", "flops", "time_us")
_ARGUMENT = ("an argument (a value name, number, string, true/false/none, list, "
             "torch.* constant, device(...) or size $B / $(B*T))")
_SIZE_FORM = "a size: `$SYMBOL` or `$(EXPRESSION)`, like $B or $(B*T)"

# Sections in order; the words that start a line of one.
_SECTIONS = ("values", "graph", "forward", "backward", "outputs")
_LINE_SECTION = {**{kind: FORWARD for kind in INSTR_KINDS}, RESULT: "outputs", GRAD: "outputs"}
_NEXT_SECTION = {"header": "values", "values": "graph", "graph": FORWARD, FORWARD: BACKWARD,
                 BACKWARD: "outputs", "outputs": None}
_ORDER_TEXT = "sections come in this order: values, graph forward|backward, forward, backward, outputs"


def _alternatives(words) -> str:
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _quoted(words) -> str:
    return _alternatives(f"`{w}`" for w in words)


def _did_you_mean(word: str, keywords) -> str:
    # A keyword glued to a name reads as one longer name (`freemm`): suggest
    # the blank when the rest is a name; a one-letter rest is more likely a
    # misspelling (`params`, `freed`).
    for kw in sorted(keywords, key=len, reverse=True):
        rest = word[len(kw):]
        if word.startswith(kw) and len(rest) > 1 and _NAME.fullmatch(rest):
            return f"; did you mean `{kw} {rest}`?"
    close = difflib.get_close_matches(word, list(keywords), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


# ----------------------------------------------------------------- records


class _Decl:
    """What a value line or a node output says about a value."""

    __slots__ = ("col", "dtype", "shape", "stride", "owner", "owner_col", "nbytes", "source",
                 "requires_grad", "aliases")


class _NodeLine:
    __slots__ = ("node", "line", "col", "outs", "refs")

    def __init__(self, node: Node, line: int, col: int, outs: list, refs: list):
        self.node = node
        self.line = line
        self.col = col  # of the node's name
        self.outs = outs  # (name or None for `_`, col, _Decl or None)
        self.refs = refs  # (name, col): values the arguments and `mutates` use


# ------------------------------------------------------------------ reader


class _Reader:
    """Reads one text.  The current line is `s`, numbered `n` (1-based); `i`
    is the position in it."""

    def __init__(self, text: str, filename: str):
        self.lines = text.split("\n")
        self.filename = filename
        self.n = 0
        self.s = ""
        self.i = 0
        self.eof = False
        self.section = "header"
        self.keyword_lead: str | None = None  # a reserved word this line starts with, read as a keyword

    def read(self) -> tuple:
        header = self.header()
        values = self.values()
        nodes = self.graph()
        fwd = self.schedule(FORWARD, BACKWARD)
        bwd = self.schedule(BACKWARD, "outputs")
        outs = self.outputs()
        return header, values, nodes, fwd, bwd, outs

    # -- moving through the text

    def next_line(self, hcomments: list | None = None) -> bool:
        """Go to the next line with code on it; False at the end of the text.
        With `hcomments`, `#|` lines on the way are header comments."""
        lines = self.lines
        n = self.n
        while n < len(lines):
            s = lines[n]
            n += 1
            i = _WS.match(s).end()
            if i < len(s) and s[i] != "#":
                self.s, self.n, self.i = s, n, i
                self.keyword_lead = None
                return True
            if hcomments is not None and s.startswith("#|", i):
                hcomments.append(self.hcomment(s[i:], n, i + 1))
        # Errors at the end point just past the last line.
        self.eof = True
        self.n = max(1, len(lines) - 1)
        self.s = lines[self.n - 1]
        self.i = len(self.s)
        return False

    def skip(self) -> int:
        self.i = i = _WS.match(self.s, self.i).end()
        return i

    def at_end(self) -> bool:
        i = self.skip()
        return i >= len(self.s) or self.s[i] == "#"

    def word(self) -> str | None:
        """The name-like word here, not taken."""
        m = _NAME.match(self.s, self.skip())
        return None if m is None else m.group()

    def keyword(self, kw: str) -> bool:
        """Take `kw` if it is the whole word here."""
        i = self.skip()
        m = _NAME.match(self.s, i)
        if m is not None and m.group() == kw:
            self.i = m.end()
            return True
        return False

    def choice(self, options) -> str:
        w = self.word()
        if w not in options:
            self.fail(_quoted(options), options)
        self.i += len(w)
        return w

    def expect_keyword(self, kw: str) -> None:
        if not self.keyword(kw):
            self.fail(f"`{kw}`", (kw,))

    def punct(self, c: str) -> bool:
        i = self.skip()
        if self.s.startswith(c, i):
            self.i = i + 1
            return True
        return False

    def expect_end(self, expected: str = "end of line") -> None:
        if not self.at_end():
            self.fail(expected)

    def follows(self, chars: str) -> bool:
        i = self.skip()
        return i < len(self.s) and self.s[i] in chars

    # -- tokens

    def ref(self) -> tuple[str, int]:
        """A value name, bare or `%"..."`, with its column."""
        i = self.skip()
        m = _NAME.match(self.s, i)
        if m is not None:
            self.i = m.end()
            return m.group(), i + 1
        if self.s.startswith("%", i):
            self.i = i + 1
            return self.string('a string after `%` (a name written %"...")'), i + 1
        self.fail("a name")

    def string(self, expected: str = "a string") -> str:
        i = self.skip()
        m = _STRING.match(self.s, i)
        if m is None:
            self.fail(expected)
        self.i = m.end()
        return self.decode(m.group(), i + 1)

    def guard_string(self) -> str:
        """A guard: a string in the guard language (`remat_ir.ir.guards`).
        Text outside it is no plan, whatever the rest says: refused here, so
        no stage ever holds a guard that could act."""
        col = self.skip() + 1
        text = self.string("a guard (a string)")
        try:
            Guard(text)
        except GuardError as e:
            raise self.error_at(self.n, col, f"{e} (the guard language: docs/01-plan-format.md, Guards)") from None
        return text

    def word_value(self, expected: str) -> str:
        """A NAME or a STRING: a name that is never a keyword (module, source, ...)."""
        i = self.skip()
        m = _NAME.match(self.s, i)
        if m is not None:
            self.i = m.end()
            return m.group()
        return self.string(expected)

    def integer(self, expected: str = "an integer") -> int:
        i = self.skip()
        m = _INT.match(self.s, i)
        if m is None:
            self.fail(expected)
        self.i = m.end()
        return self.to_int(m.group(), i + 1)

    def number(self) -> float:
        i = self.skip()
        m = _FLOAT.match(self.s, i) or _INT.match(self.s, i)
        if m is None:
            self.fail("a number")
        self.i = m.end()
        return float(m.group())

    # -- meanings of tokens

    def decode(self, literal: str, col: int, line: int = 0) -> str:
        """A string literal's text (JSON escapes)."""
        body = literal[1:-1]
        if len(literal) > 1 and literal[-1] == '"' and "\\" not in body and '"' not in body:
            return body  # nothing to unescape
        try:
            return json.loads(literal, strict=False)
        except ValueError as e:
            raise self.error_at(line or self.n, col, f"bad string literal {literal[:60]}: "
                                                     f"{getattr(e, 'msg', e)}") from None

    def to_int(self, digits: str, col: int) -> int:
        try:
            return int(digits)
        except ValueError:  # past Python's limit on digits
            raise self.error_at(self.n, col, f"integer too long: {digits[:20]}... "
                                             f"({len(digits)} digits)") from None

    def size_list(self, body: str, col: int, literal: str, what: str) -> list:
        """The dimensions or strides between a list's brackets: each an int,
        or a size expression's canonical text."""
        out = []
        for item in split_sizes(body):
            if INT_TEXT_RE.fullmatch(item):
                out.append(self.to_int(item.strip(), col))
            elif not item.strip():
                raise self.error_at(self.n, col, f"bad {what} list `{literal}`: write integers or size "
                                                 f"expressions separated by commas, like [2,64,128] or [B,T,64]")
            else:
                out.append(self.size(item, col, what))
        return out

    def size(self, text: str, col: int, what: str):
        """A size expression: an int when it is a plain integer, else its canonical text."""
        text = text.strip()
        if paren_depth(text) > MAX_SIZE_PARENS:
            raise self.error_at(self.n, col, f"bad {what} `{text}`: parentheses nest more than "
                                             f"{MAX_SIZE_PARENS} deep")
        try:
            return sz.normal_size(text)
        except sz.SizeError as e:
            raise self.error_at(self.n, col, f"bad {what} `{text}`: {e}") from None
        except RecursionError:
            raise self.error_at(self.n, col, f"bad {what} `{text[:40]}...`: too deeply nested") from None

    def sym(self, what: str) -> str:
        """`$B` or `$(expr)` here: the expression's canonical text."""
        i = self.skip()
        m = _SYM.match(self.s, i)
        if m is None:
            if self.s.startswith("$(", i):
                depth = 0
                for c in self.s[i + 1:]:
                    depth += (c == "(") - (c == ")")
                    if depth > MAX_SIZE_PARENS:
                        raise self.error_at(self.n, i + 1, f"a size expression whose parentheses nest more "
                                                           f"than {MAX_SIZE_PARENS} deep")
                    if depth <= 0:
                        break
            self.fail(_SIZE_FORM)
        self.i = m.end()
        text = m.group()[1:]
        if text.startswith("("):
            text = text[1:-1]
        x = self.size(text, i + 1, what)
        return str(x) if type(x) is int else x

    def byte_count(self, expected: str):
        """INT or `$B` / `$(expr)`: an int, or the expression's canonical text."""
        if self.s.startswith("$", self.skip()):
            x = self.sym("byte count")
            return sz.normal_size(x)
        return self.integer(expected)

    def dtype(self, short: str, col: int) -> str:
        long = ir.DTYPE_LONG.get(short)
        if long is not None:
            return long
        if short in DTYPES:
            return short
        close = difflib.get_close_matches(short, list(ir.DTYPE_LONG) + sorted(DTYPES), n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        raise self.error_at(self.n, col, f"unknown dtype `{short}` (known: {', '.join(ir.DTYPE_LONG)}){hint}")

    def torch_constant(self, name: str, col: int) -> Any:
        attr = name[6:]
        if attr in DTYPES:
            return DType(attr)
        if attr in LAYOUTS:
            return Layout(attr)
        if attr in MEMORY_FORMATS:
            return MemoryFormat(attr)
        raise self.error_at(self.n, col, f"unknown torch constant `{name}`: expected a dtype (torch.float32, "
                                         f"...), a layout (torch.strided, ...) or a memory format "
                                         f"(torch.contiguous_format, ...); a value of that name is "
                                         f"written %\"{name}\"")

    def hcomment(self, text: str, line: int, col: int) -> str:
        rest = text[2:].rstrip()
        if rest.startswith(" "):
            return rest[1:]
        if rest.startswith('"'):
            return self.decode(rest, col, line)
        return rest

    # -- header

    def header(self) -> Header:
        self.section = "start"
        comments: list[str] = []
        if not self.next_line(comments) or not self.keyword("rir"):
            self.fail("`rir 1` (the format version line) or a `#|` header comment", ("rir",))
        self.section = "header"
        col = self.skip() + 1
        version = self.integer("the format version (an integer)")
        if version != ir.FORMAT_VERSION:
            raise self.error_at(self.n, col, f"unsupported format version {version}: this remat-ir "
                                             f"reads `rir {ir.FORMAT_VERSION}`")
        self.expect_end()
        h = Header(version=version, comment=comments, lines={"rir": self.n})
        fields = list(HEADER_FIELDS)
        while True:
            if not self.next_line():
                self.fail(_quoted(fields + ["values"]))
            w = self.word()
            if w == "values":
                return h
            if w not in fields:
                note = (f"; header lines come in the order {', '.join(HEADER_FIELDS)}, each at most once"
                        if w in HEADER_FIELDS else "")
                self.fail(_quoted(fields + ["values"]), fields + ["values"], note)
            del fields[:fields.index(w) + 1]
            h.lines[w] = self.n
            self.i += len(w)
            self.header_field(h, w)
            self.expect_end()

    def header_field(self, h: Header, field: str) -> None:
        if field in ("model", "fingerprint", "output_spec"):
            setattr(h, field, self.string())
        elif field == "device":
            h.device = self.word_value("a device name (cpu, cuda:0, ...)")
        elif field == "cost":
            h.cost = self.choice(ir.COST_MODELS)
        elif field == "optimizer":
            h.optim = self.word_value("an optimizer name (none, sgd, adam, ...)")
            h.optim_state_bytes = self.integer("the bytes of optimizer state (an integer)")
            self.expect_keyword("bytes")
        elif field == "budget":
            n = self.integer("the budget in bytes (an integer)")
            self.expect_keyword("bytes")
            h.budget = Budget(bytes=n, scope=self.choice(("total", "activations")))
        elif field == "host_budget":
            h.host_budget = self.integer("the host budget in bytes (an integer)")
            self.expect_keyword("bytes")
        elif field == "rewrites":
            h.rewrites = [self.word_value("a rewrite (batchnorm_split, chunked_loss:8)")]
            while self.follows(","):
                self.i += 1
                h.rewrites.append(self.word_value("a rewrite (batchnorm_split, chunked_loss:8)"))
        elif field == "autocast":
            h.autocast = self.word_value("the autocast as device:dtype (cpu:bfloat16)")
        elif field == "sizes":
            h.sizes = [self.size_range()]
            while self.follows(","):
                self.i += 1
                h.sizes.append(self.size_range())
        elif field in ("constants", "guards", "size_guards"):
            items = [self.guard_string() if field == "guards" else self.string()]
            while self.follows(","):
                self.i += 1
                items.append(self.guard_string() if field == "guards" else self.string())
            setattr(h, field, items)
        elif field == "held_gradients":
            h.held_gradients = self.choice(("true", "false")) == "true"
        else:
            h.has_loss = self.choice(("true", "false")) == "true"

    def size_range(self) -> str:
        m = _SIZE_RANGE.match(self.s, self.skip())
        if m is None:
            self.fail("a size range SYMBOL=LOW..HIGH, like T=32..128")
        self.i = m.end()
        return m.group()

    # -- values

    def values(self) -> list:
        self.section = "values"
        self.i += len("values")
        self.expect_end()
        out = []
        while True:
            if not self.next_line():
                self.fail("a value line or `graph`")
            if self.word() == "graph":
                return out
            name, col = self.ref()
            kind = self.word()
            if kind not in VALUE_DECL_KINDS:
                note = ("; this looks like a node line: is the `graph forward` line missing?"
                        if "=" in self.s else "")
                self.fail("a value kind: " + _quoted(VALUE_DECL_KINDS), VALUE_DECL_KINDS, note)
            self.i += len(kind)
            out.append((name, self.n, col, kind, self.decl(in_node=False)))

    def decl(self, in_node: bool) -> _Decl:
        """TYPE [stride] storage [source] [requires_grad] [aliases], and a
        check that what follows may follow."""
        s = self.s
        i = self.skip()
        m = _TYPE.match(s, i)
        if m is None:
            self.fail("a dtype and shape like f32[2,3]")
        d = _Decl()
        d.col = i + 1
        t = m.group()
        b = t.index("[")
        d.dtype = self.dtype(t[:b], i + 1)
        d.shape = self.size_list(t[b + 1:-1], i + 1, t, "dimension")
        self.i = m.end()
        d.stride = None
        if self.keyword("stride"):
            j = self.skip()
            m = _INTS.match(s, j)
            if m is None:
                self.fail("the stride, a list of integers or size expressions like [1,2] or [64*T,64,1]")
            self.i = m.end()
            d.stride = self.size_list(m.group()[1:-1], j + 1, m.group(), "stride")
        rest = ["`source`", "`requires_grad`", "`aliases`"]
        d.owner = None
        d.owner_col = 0
        d.nbytes = 0
        if self.keyword("view"):
            self.expect_keyword("of")
            d.owner, d.owner_col = self.ref()
            if _TYPE.match(s, self.skip()):
                # After a name the grammar's lexer tries a dtype first, so a
                # glued `aliases[]` reads as one, and lark refuses it.
                glued = s.startswith("aliases", self.i)
                self.fail("a byte count or " + _alternatives(rest),
                          note=" (write a blank between `aliases` and `[`)" if glued else "")
            if _INT.match(s, self.i) or s.startswith("$", self.i):
                d.nbytes = self.byte_count("an integer")
                self.expect_keyword("bytes")
        else:
            d.nbytes = self.byte_count("`view` or a byte count like `24 bytes`"
                                       if d.stride is not None else
                                       "`stride`, `view` or a byte count like `24 bytes`")
            self.expect_keyword("bytes")
        d.source = ""
        if self.keyword("source"):
            d.source = self.word_value("a name or a string (where the value comes from)")
            rest = rest[1:]
        d.requires_grad = self.keyword("requires_grad")
        if d.requires_grad:
            rest = rest[-1:]
        d.aliases = []
        if self.keyword("aliases"):
            d.aliases = self.aliases()
            rest = []
        if in_node:
            if not self.follows(",="):
                self.fail(_alternatives(rest + ["`,`", "`=`"]))
        elif not self.at_end():
            self.fail(_alternatives(rest + ["end of line"]))
        return d

    def aliases(self) -> list[str]:
        if not self.punct("["):
            self.fail("`[`")
        out: list[str] = []
        if self.punct("]"):
            return out
        while True:
            out.append(self.word_value("a name or a string"))
            if self.punct("]"):
                return out
            if not self.punct(","):
                self.fail("`,` or `]`")

    # -- graph

    def graph(self) -> list[_NodeLine]:
        self.section = "graph"
        out: list[_NodeLine] = []
        phase = FORWARD
        while True:
            w = self.word()
            if w == "graph":
                self.keyword_lead = w
                self.i += len(w)
                phase = self.choice((FORWARD, BACKWARD))
                self.expect_end()
            elif w == FORWARD:
                self.keyword_lead = w
                return out
            else:
                out.append(self.node_line(phase))
            if not self.next_line():
                self.fail("a node line, `graph` or `forward`")

    def node_line(self, phase: str) -> _NodeLine:
        """[NODE ":"] OUTPUT, ... = OP(ARG, ..., KEY=ARG, ...) ATTRIBUTES"""
        line = self.n
        name = None
        outs: list = []
        if not self.punct("="):
            first = self.node_out("a name, `_` or `=`", first=True)
            if first[0] is not None and first[2] is None and self.punct(":"):
                name = first[:2]
                if not self.punct("="):
                    outs.append(self.node_out("a name, `_` or `=`"))
            else:
                outs.append(first)
            if outs:
                while self.punct(","):
                    outs.append(self.node_out("a name or `_`"))
                if not self.punct("="):
                    self.fail("`,` or `=`")
        op_col = self.skip() + 1
        op = self.word_value("an op name (like aten.mm.default) or a string")
        if not self.punct("("):
            self.fail("`(`")
        args: list = []
        kwargs: dict = {}
        refs: list = []
        if not self.punct(")"):
            while True:
                keyable = self.item(args, kwargs, refs)
                if self.punct(","):
                    continue
                if self.punct(")"):
                    break
                self.fail("`)`, `,` or `=`" if keyable else "`)` or `,`")
        node = Node(name="", op=op, args=args, kwargs=kwargs, outputs=[o[0] or "" for o in outs],
                    phase=phase)
        self.node_attrs(node, refs)
        if name is None:
            if not outs or outs[0][0] is None:
                raise self.error_at(line, op_col, "this node has no name: its first output is `_` or "
                                                  "missing; name it with `NAME: ` at the start of the line")
            name = outs[0][:2]
        node.name = name[0]
        return _NodeLine(node, line, name[1], outs, refs)

    def node_out(self, expected: str, first: bool = False) -> tuple:
        """`_`, NAME or NAME DECL, and a check that what follows may follow."""
        i = self.skip()
        m = _NAME.match(self.s, i)
        if m is not None and m.group() == "_":
            if first:
                self.keyword_lead = "_"
            self.i = m.end()
            if not self.follows(",="):
                self.fail("`,` or `=`")
            return None, i + 1, None
        if m is None and not self.s.startswith("%", i):
            self.fail(expected)
        name, col = self.ref()
        if _TYPE.match(self.s, self.skip()):
            return name, col, self.decl(in_node=True)
        if not self.follows(":,=" if first else ",="):
            self.fail("a dtype and shape like f32[2,3], " + ("`:`, `,` or `=`" if first else "`,` or `=`"))
        return name, col, None

    def item(self, args: list, kwargs: dict, refs: list) -> bool:
        """ARG or KEY=ARG; True when it was a word that could have been a key."""
        s = self.s
        i = self.skip()
        m = None if _DEVICE.match(s, i) else (_NAME.match(s, i) or _STRING.match(s, i))
        if m is not None:
            j = _WS.match(s, m.end()).end()
            if s.startswith("=", j):
                word = m.group()
                if word in _ARG_WORDS:
                    self.i = j
                    self.fail("`)` or `,`", note=f" (`{word}` is a keyword here; a keyword argument of that "
                                                 f"name is written \"{word}\"=...)")
                key = word[1:-1] if word[0] == '"' else word
                if not KWARG_RE.fullmatch(key):
                    self.i = i
                    self.fail(_KWARG_NAME)
                self.i = j + 1
                value = self.arg(refs)
                if key in kwargs:
                    raise self.error_at(self.n, i + 1, f"keyword argument `{key}` given twice")
                kwargs[key] = value
                return False
        value = self.arg(refs)
        if kwargs:
            raise self.error_at(self.n, i + 1, "a positional argument follows a keyword argument "
                                               "(write positional arguments first)")
        args.append(value)
        return m is not None and m.group() not in _ARG_WORDS

    def arg(self, refs: list) -> Any:
        """One argument; lists are read with a stack, and nest at most
        MAX_NESTING deep (so nothing after the reader recurses deeply)."""
        open_lists: list[list] = []
        while True:
            if self.punct("["):
                if len(open_lists) == MAX_NESTING:
                    raise self.error_at(self.n, self.i, f"lists nested more than {MAX_NESTING} deep: an op "
                                                        f"takes flat lists (`[2, 3]`, `[x, y]`)")
                open_lists.append([])
                if not self.punct("]"):
                    continue
                value = Seq(open_lists.pop())
            else:
                value = self.scalar(refs)
            while open_lists:
                open_lists[-1].append(value)
                if self.punct(","):
                    break
                if not self.punct("]"):
                    self.fail("`,` or `]`")
                value = Seq(open_lists.pop())
            else:
                return value

    def scalar(self, refs: list) -> Any:
        s = self.s
        i = self.skip()
        c = s[i:i + 1]
        if c == '"':
            return self.string()
        if c == "%":
            name, col = self.ref()
            refs.append((name, col))
            return Ref(name)
        if c == "$":
            return Sym(self.sym("size argument"))
        m = _DEVICE.match(s, i)
        if m is not None:
            self.i = m.end()
            inner = m.group()[7:-1]
            return Device(self.decode(inner, i + 8) if inner.startswith('"') else inner)
        m = _NAME.match(s, i)
        if m is not None:
            w = m.group()
            self.i = m.end()
            if w in _ARG_WORDS:
                return _ARG_WORDS[w]
            if w.startswith("torch."):
                return self.torch_constant(w, i + 1)
            refs.append((w, i + 1))
            return Ref(w)
        m = _FLOAT.match(s, i)
        if m is not None:
            self.i = m.end()
            x = float(m.group())
            # Past the largest float (1e999): infinity, read as `inf` is.
            return x if math.isfinite(x) else Special("inf" if x > 0 else "-inf")
        m = _INT.match(s, i)
        if m is not None:
            self.i = m.end()
            return self.to_int(m.group(), i + 1)
        if s.startswith("-inf", i):
            self.i = i + 4
            return Special("-inf")
        self.fail(_ARGUMENT)

    def node_attrs(self, node: Node, refs: list) -> None:
        seen: set[str] = set()
        while not self.at_end():
            w = self.word()
            if w not in _NODE_ATTRS:
                self.fail("a node attribute (" + _quoted(_NODE_ATTRS) + ") or end of line", _NODE_ATTRS)
            col = self.i + 1
            self.i += len(w)
            if w in seen:
                raise self.error_at(self.n, col, f"node attribute `{w}` given twice")
            seen.add(w)
            if w == "module":
                node.module = self.word_value("a module path or a string")
            elif w == "random":
                node.random = True
            elif w == "mutates":
                if not self.punct("("):
                    self.fail("`(`")
                while True:
                    name, c = self.ref()
                    node.mutates.append(name)
                    refs.append((name, c))
                    if self.punct(")"):
                        break
                    if not self.punct(","):
                        self.fail("`)` or `,`")
            elif w == "flops":
                node.flops = self.number()
            else:
                node.time_us = self.number()

    # -- schedule and outputs

    def schedule(self, title: str, next_title: str) -> list[tuple]:
        self.section = title
        self.i += len(title)
        self.expect_end()
        out = []
        expected = _quoted((*_INSTRS, next_title))
        while True:
            if not self.next_line():
                self.fail(expected)
            w = self.word()
            if w == next_title:
                return out
            if w not in _INSTRS:
                self.fail(expected, (*_INSTRS, next_title))
            self.i += len(w)
            name, col = self.ref()
            self.expect_end()
            out.append((w, name, self.n, col))

    def outputs(self) -> list[tuple]:
        self.section = "outputs"
        self.i += len("outputs")
        self.expect_end()
        out = []
        while self.next_line():
            kind = self.choice((RESULT, GRAD))
            if kind == RESULT:
                i = self.skip()
                m = _INT.match(self.s, i)
                if m is not None:
                    self.i = m.end()
                    key = str(self.to_int(m.group(), i + 1))
                else:
                    key = self.string("the result's key: an integer or a string")
            else:
                key = self.ref()[0]
            if not self.punct("="):
                self.fail("`=`")
            name, col = self.ref()
            self.expect_end()
            out.append((kind, key, name, self.n, col))
        return out

    # -- errors

    def error_at(self, line: int, col: int, message: str) -> RirSyntaxError:
        return RirSyntaxError(self.filename, line, col, message)

    def fail(self, expected: str, keywords=(), note: str = ""):
        """Raise `expected EXPECTED, found WHAT-IS-HERE` at the current position."""
        s = self.s
        i = self.skip()
        if not self.eof and s.startswith('"', i) and not _STRING.match(s, i):
            raise self.error_at(self.n, i + 1, 'unterminated string literal (a string ends with `"` '
                                               'on the same line)')
        lone = self.lone_word()
        if lone is not None:
            raise self.error_at(self.n, 1, lone)
        message = f"expected {expected}, found {self.found()}" + (note or self.note(keywords))
        raise self.error_at(self.n, i + 1, message)

    def found(self) -> str:
        s, i = self.s, self.i
        if self.eof:
            return "end of file"
        if i >= len(s) or s[i] == "#":
            return "end of line"
        for regex, what in ((_STRING, "a string"), (_TYPE, "a dtype and shape"), (_DEVICE, "a device"),
                            (_SYM, "a size"),
                            (_NAME, "a name"), (_FLOAT, "a number"), (_INT, "an integer")):
            m = regex.match(s, i)
            if m is not None:
                text = m.group()
                if regex is _NAME and text in KEYWORDS:
                    return f"`{text}`"
                return f"{what} `{text if len(text) <= 40 else text[:37] + '...'}`"
        c = s[i]
        return f"`{c}`" if c.isprintable() and not c.isspace() else f"the character U+{ord(c):04X}"

    def lone_word(self) -> str | None:
        """A message for a line that is one unknown word at the margin: a
        misspelt section (or header line); None for anything else."""
        if self.eof or self.section not in _NEXT_SECTION or self.keyword_lead:
            return None
        code = self.s.split("#", 1)[0]
        words = code.split()
        if (not words or code[:1].isspace() or len(words) > 2 or "=" in code
                or not _NAME.fullmatch(words[0]) or words[0] in KEYWORDS):
            return None
        choices = list(_SECTIONS)
        what = "section"
        if self.section == "header":
            choices += HEADER_FIELDS
            what = "header line or section"
        return f"unknown {what} `{words[0]}`{_did_you_mean(words[0], choices)} ({_ORDER_TEXT})"

    def note(self, keywords) -> str:
        """What to do about the error at the current position: a misspelt or
        glued keyword, a section line missing above, a keyword used as a name."""
        nxt = _NEXT_SECTION.get(self.section)
        if self.eof:
            if self.section == "start":
                return ""
            if nxt is None:
                return ": the file ends early (truncated?)"
            return f": the file ends before the `{nxt}` section (truncated?); {_ORDER_TEXT}"
        s, i = self.s, self.i
        here = _NAME.match(s, i)
        word = here.group() if here is not None else None
        lead_i = _WS.match(s).end()
        if i == lead_i:  # the line's first word is wrong
            if word is not None and nxt is not None and self.later_than(word, nxt):
                return f": the `{nxt}` section is missing; {_ORDER_TEXT}"
            hint = _did_you_mean(word, keywords) if word is not None and keywords else ""
            if not hint and self.section == "header" and lead_i > 0:
                hint = "; is the `values` line missing above?"
            return hint
        m = _NAME.match(s, lead_i)
        lead = m.group() if m is not None else None
        second = m is not None and not s[m.end():i].strip()  # the error is at the line's second token
        if second and lead in _LINE_SECTION and self.section in ("values", "graph"):
            sec = _LINE_SECTION[lead]
            where = "`forward` or `backward`" if sec == FORWARD else f"`{sec}`"
            return f"; `{lead}` lines belong in the {where} section: is its header line missing?"
        if lead in _SECTIONS and nxt is not None and self.later_than(lead, nxt):
            return f"; the `{nxt}` section is missing; {_ORDER_TEXT}"
        if second and lead in HEADER_FIELDS and self.section == "values":
            return f"; `{lead}` is a header line: header lines come before `values`"
        hint = _did_you_mean(word, keywords) if word is not None and keywords else ""
        if not hint and second and self.keyword_lead == lead:
            hint = f" (`{lead}` is a keyword here; a value of that name is written %\"{lead}\")"
        return hint

    @staticmethod
    def later_than(word: str, section: str) -> bool:
        """Whether a line starting with `word` belongs after the start of `section`."""
        if word in _SECTIONS:
            return _SECTIONS.index(word) > _SECTIONS.index(section)
        if word in _LINE_SECTION:
            return _SECTIONS.index(_LINE_SECTION[word]) >= _SECTIONS.index(section)
        return False


# ---------------------------------------------------------------- assembly


def _assemble(parts: tuple, error) -> Program:
    """Resolve names: build the values, check every reference."""
    header, value_lines, node_lines, fwd, bwd, out_recs = parts
    values: list[Value] = []
    where: dict[str, tuple[int, int]] = {}  # value name -> (line, col) of its declaration
    views: list[tuple[str, int, int]] = []  # (owner, line, col) of each view's owner

    def declare(name: str, line: int, col: int, kind: str, d: _Decl) -> None:
        if name in where:
            raise error(line, col, f"duplicate value `{name}`: it is already declared on line {where[name][0]}")
        where[name] = (line, col)
        if d.stride is None:
            stride = default_stride(d.shape)
        else:
            stride = d.stride
            if len(stride) != len(d.shape):
                raise error(line, d.col, f"`{name}` has {len(d.shape)} dimensions but a stride of {len(stride)}")
        values.append(Value(name=name, kind=kind, dtype=d.dtype, shape=d.shape, stride=stride,
                            storage=name if d.owner is None else d.owner, nbytes=d.nbytes,
                            source=d.source, requires_grad=d.requires_grad, aliases=d.aliases,
                            line=line))
        if d.owner is not None:
            views.append((d.owner, line, d.owner_col))

    def undeclared(name: str, line: int, col: int, what: str) -> RirSyntaxError:
        close = difflib.get_close_matches(name, list(where), n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        return error(line, col, f"{what} `{name}` is never declared{hint}")

    for name, line, col, kind, d in value_lines:
        declare(name, line, col, kind, d)

    nodes: list[Node] = []
    node_where: dict[str, int] = {}  # node name -> line
    pending: list[tuple[bool, str, int, int]] = []  # (is an output, name, line, col), checked at the end
    for rec in node_lines:
        node = rec.node
        if node.name in node_where:
            raise error(rec.line, rec.col, f"duplicate node `{node.name}`: a node of that name is on "
                                           f"line {node_where[node.name]}")
        node_where[node.name] = rec.line
        node.line = rec.line
        for name, col, d in rec.outs:
            if name is None:
                continue
            if d is not None:
                declare(name, rec.line, col, VALUE, d)
            else:
                pending.append((True, name, rec.line, col))
        for name, col in rec.refs:
            if name not in where:  # maybe declared further down
                pending.append((False, name, rec.line, col))
        nodes.append(node)

    for is_output, name, line, col in pending:
        if name in where:
            continue
        if is_output:
            raise error(line, col, f"node output `{name}` is not declared as a value: declare it on this "
                                   f"line with its type and storage, e.g. `{name} f32[2,3] 24 bytes`, "
                                   f"or under `values`")
        raise undeclared(name, line, col, "value")
    for owner, line, col in views:
        if owner not in where:
            raise undeclared(owner, line, col, "storage owner")

    def instrs(recs) -> list[Instr]:
        out = []
        for kind, name, line, col in recs:
            if kind not in NODE_INSTRS:
                if name not in where:
                    hint = ""
                    if name in node_where:
                        hint = f" (that is a node; {kind} its outputs)"
                    elif len(name) <= 100:
                        close = difflib.get_close_matches(name, list(where), n=1)
                        hint = f"; did you mean `{close[0]}`?" if close else ""
                    raise error(line, col, f"{kind} of unknown value `{name}`{hint}")
            elif name not in node_where:
                close = difflib.get_close_matches(name, list(node_where), n=1)
                hint = f"; did you mean `{close[0]}`?" if close else ""
                raise error(line, col, f"{kind} of unknown node `{name}`{hint}")
            out.append(Instr(kind, name, line))
        return out

    forward, backward = instrs(fwd), instrs(bwd)
    outputs = []
    for kind, key, name, line, col in out_recs:
        if name not in where:
            raise undeclared(name, line, col, "value")
        outputs.append(Output(kind=kind, key=key, value=name, line=line))
    return Program(header=header, values=values, nodes=nodes, forward=forward, backward=backward,
                   outputs=outputs)
