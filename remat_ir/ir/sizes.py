"""Sizes that vary between calls: a plan with symbols for some dimensions.

A fine-tuning script pads each batch to its own longest sequence, so the
step's shapes change at almost every call.  A *symbolic* plan names such a
dimension with a symbol (`B`, `T`) and writes every size that depends on it
as an integer expression over the symbols: a shape `f32[B,T,64]`, a storage
of `256*B*T` bytes, an argument `[B*T, 64]`.  The header gives each symbol its
range (`B=2..4`) and the conditions the traced code assumed of the sizes
(`size_guards`).  Its schedule is one for every size in the range.

`instantiate(program, sizes)` gives the concrete program of one size: every
stage that reasons about bytes (simulator, verifier, optimizer) works on
that, and a symbolic plan is sound when each of its instantiations is.

The expression language is small on purpose: integers, symbols, `+ - * //
%`, `max(a, b)`, `min(a, b)`, parentheses; conditions compare two
expressions and join comparisons with `and`.  Text is read with Python's
`ast` and only those node kinds are accepted, so a plan's text is never run
as code; the runtime compiles expressions from the checked tree.
"""
from __future__ import annotations

import ast
import functools
import operator
import re

import msgspec

from remat_ir.ir.fingerprint import fingerprint
from remat_ir.ir.types import Program, Seq, Sym, Value

__all__ = [
    "SizeError", "SizeRange", "bind_inputs", "bind_sizes", "check_sizes", "condition_holds", "evaluate", "expr_symbols",
    "format_range", "instantiate", "is_symbolic", "parse_range", "python_code", "size_text", "evaluate_grid",
    "conditions_grid", "degree", "sym_exprs",
]


class SizeError(ValueError):
    """A size expression, range or condition that is not in the language, or
    sizes that do not fit; `line`, `section`, `index`: the value or node of a
    program whose expression it is (0, "", -1: none)."""

    def __init__(self, message: str, line: int = 0, section: str = "", index: int = -1):
        super().__init__(message)
        self.line, self.section, self.index = line, section, index


SYMBOL_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FUNCS = ("max", "min")
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}
_CMPOPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
# (of ints, or elementwise of tensors)
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}
# Expressions come from shapes; a longer one is no plan's (and would make the checks slow).
MAX_EXPR_CHARS = 2000
# Nor is a deeper one; evaluating and printing recurse, so depth is bounded well below Python's stack.
MAX_EXPR_DEPTH = 100


# ------------------------------------------------------------------ reading


def _shown(text: str) -> str:
    """`text` quoted, cut short when long: messages echo expressions of up to MAX_EXPR_CHARS."""
    return repr(text) if len(text) <= 60 else repr(text[:60]) + "..."


def _tree(text: str, mode: str):
    if not isinstance(text, str):
        raise SizeError(f"a size expression must be text, not {type(text).__name__}")
    if len(text) > MAX_EXPR_CHARS:
        raise SizeError(f"size expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise SizeError(f"{_shown(text)} is not a size {mode}: expected integers, symbols, + - * // %, "
                        "max(a, b), min(a, b)" + (", compared with == != < <= > >= and joined by `and`"
                                                   if mode == "condition" else "")) from None
    except (RecursionError, MemoryError):
        raise SizeError(f"size {mode} {_shown(text)} is nested more than {MAX_EXPR_DEPTH} deep") from None
    stack = [(tree, 1)]
    while stack:
        n, depth = stack.pop()
        if depth > MAX_EXPR_DEPTH:
            raise SizeError(f"size {mode} {_shown(text)} is nested more than {MAX_EXPR_DEPTH} deep")
        stack += [(c, depth + 1) for c in ast.iter_child_nodes(n)]
    return tree


def _check_expr(node, text: str) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            stack += [n.left, n.right]
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            stack.append(n.operand)
        elif isinstance(n, ast.Constant) and type(n.value) is int:
            pass
        elif isinstance(n, ast.Name):
            if n.id in _FUNCS:
                raise SizeError(f"{_shown(text)}: {n.id} is a function, not a size symbol")
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _FUNCS
              and len(n.args) == 2 and not n.keywords):
            stack += list(n.args)
        else:
            raise SizeError(f"{_shown(text)} is not a size expression: {_shown(ast.unparse(n))} is not an integer, "
                            "a symbol, + - * // %, max(a, b) or min(a, b)")


@functools.lru_cache(maxsize=65536)
def _expr(text: str):
    tree = _tree(text, "expression")
    _check_expr(tree, text)
    return tree


@functools.lru_cache(maxsize=4096)
def _condition(text: str):
    tree = _tree(text, "condition")
    parts = tree.values if isinstance(tree, ast.BoolOp) and isinstance(tree.op, ast.And) else [tree]
    for p in parts:
        if not (isinstance(p, ast.Compare) and all(type(o) in _CMPOPS for o in p.ops)):
            raise SizeError(f"{_shown(text)} is not a size condition: expected comparisons of size expressions "
                            "(== != < <= > >=) joined by `and`")
        for e in [p.left, *p.comparators]:
            _check_expr(e, text)
    return parts


def expr_symbols(text: str | int) -> list[str]:
    """The symbols an expression or a condition names, in first-use order."""
    if type(text) is int:
        return []
    try:
        trees = [_expr(text)]
    except SizeError:
        trees = _condition(text)
    out: dict[str, None] = {}
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and n.id not in _FUNCS:  # (a symbol is never max or min)
                out.setdefault(n.id, None)
    return list(out)


# ---------------------------------------------------------------- evaluating


def _eval(node, sizes: dict):
    """The expression at `sizes`: symbol -> an int, or an int64 tensor of
    sizes (one per point: `evaluate_grid`); the same arithmetic either way
    (`//` and `%` of tensors round as Python's do)."""
    t = type(node)
    if t is ast.Constant:
        return node.value
    if t is ast.Name:
        try:
            return sizes[node.id]
        except KeyError:
            raise SizeError(f"no size given for the symbol {node.id}") from None
    if t is ast.BinOp:
        a, b = _eval(node.left, sizes), _eval(node.right, sizes)
        op = type(node.op)
        if op is ast.Add:
            return a + b
        if op is ast.Sub:
            return a - b
        if op is ast.Mult:
            return a * b
        if type(b) is int:
            if b == 0:
                raise SizeError("a size expression divides by zero")
        else:
            zero = (b == 0).nonzero()
            if len(zero):
                k = int(zero[0, 0])
                raise SizeError("a size expression divides by zero at "
                                + ", ".join(f"{s}={int(v[k])}" for s, v in sizes.items()))
        return a // b if op is ast.FloorDiv else a % b
    if t is ast.UnaryOp:
        return -_eval(node.operand, sizes)
    a, b = (_eval(x, sizes) for x in node.args)
    if type(a) is int and type(b) is int:
        return max(a, b) if node.func.id == "max" else min(a, b)
    import torch

    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return torch.maximum(a, b) if node.func.id == "max" else torch.minimum(a, b)


def evaluate(text: str | int, sizes: dict[str, int]) -> int:
    """The value of a size (an int, or an expression's text) at `sizes`."""
    if type(text) is int:
        return text
    return _eval(_expr(text), sizes)


def condition_holds(text: str, sizes: dict[str, int]) -> bool:
    for p in _condition(text):
        left = _eval(p.left, sizes)
        for op, right_node in zip(p.ops, p.comparators):
            right = _eval(right_node, sizes)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
    return True


def evaluate_grid(text: str | int, grid: dict):
    """The expression at many sizes at once: `grid` maps each symbol to an
    int64 tensor (one entry per point), and so does the result.  Raises
    SizeError naming the first point where a divisor is zero."""
    return _on_grid(text if type(text) is int else _expr(text), grid, text)


def _on_grid(node, grid: dict, text):
    """`_eval` of a tree (or an int) over `grid`, as a tensor of one value per point."""
    import torch

    n = len(next(iter(grid.values()))) if grid else 1
    try:
        out = node if type(node) is int else _eval(node, grid)
        out = out.expand(n).clone() if isinstance(out, torch.Tensor) else torch.full((n,), out, dtype=torch.int64)
    except (OverflowError, RuntimeError) as e:  # (a constant past int64)
        raise SizeError(f"{str(text)[:80]}: a number too large for a size ({e})") from None
    if len(out) and int(out.abs().max()) >= 1 << 62:
        raise SizeError(f"{str(text)[:80]} reaches {int(out.abs().max())}, too large for a size")
    return out


def conditions_grid(texts: list[str], grid: dict):
    """Where all the conditions hold, over `grid` (see `evaluate_grid`): a bool tensor."""
    import torch

    n = len(next(iter(grid.values()))) if grid else 1
    ok = torch.ones(n, dtype=torch.bool)
    # Each part only where the earlier ones held (`and` and chained comparisons
    # stop at the first false one, as `condition_holds` does).
    for text in texts:
        for p in _condition(text):
            nodes = [p.left, *p.comparators]
            for k, op in enumerate(p.ops):
                where = torch.nonzero(ok).flatten()
                if not len(where):
                    return ok
                sub = {s: v[where] for s, v in grid.items()}
                left, right = (_on_grid(x, sub, text) for x in nodes[k:k + 2])
                ok[where] = _COMPARE[type(op)](left, right)
    return ok


def degree(text: str | int, symbol: str) -> int:
    """The degree of `symbol` in the expression, as a polynomial's (`//`,
    `%`, `max`, `min` count as their operands' highest): how many sizes of
    it a check at distinct points needs (degree + 1) to see every
    polynomial disagreement."""
    if type(text) is int:
        return 0

    def deg(node) -> int:
        t = type(node)
        if t is ast.Constant:
            return 0
        if t is ast.Name:
            return int(node.id == symbol)
        if t is ast.BinOp:
            a, b = deg(node.left), deg(node.right)
            return a + b if type(node.op) is ast.Mult else max(a, b)
        if t is ast.UnaryOp:
            return deg(node.operand)
        return max(deg(x) for x in node.args)

    return deg(_expr(text))


def python_code(text: str | int, env: str = "S") -> str:
    """Python source computing the expression from the dict `env` of sizes.
    Written from the checked tree: symbols become `env['B']` (the name by
    `str.__repr__`), numbers by `int.__repr__`, nothing else appears."""
    if type(text) is int:
        return int.__repr__(text)

    def code(n) -> str:
        t = type(n)
        if t is ast.Constant:
            return int.__repr__(n.value)
        if t is ast.Name:
            return f"{env}[{str.__repr__(n.id)}]"
        if t is ast.BinOp:
            return f"({code(n.left)} {_BINOPS[type(n.op)]} {code(n.right)})"
        if t is ast.UnaryOp:
            return f"(-{code(n.operand)})"
        return f"{n.func.id}({code(n.args[0])}, {code(n.args[1])})"

    return code(_expr(text))


_PREC = {ast.Add: 1, ast.Sub: 1, ast.Mult: 2, ast.FloorDiv: 2, ast.Mod: 2}


def _show(n, outer: int = 0, right: bool = False) -> str:
    t = type(n)
    if t is ast.Constant:
        return str(n.value) if n.value >= 0 or outer == 0 else f"({n.value})"
    if t is ast.Name:
        return n.id
    if t is ast.UnaryOp:
        text = "-" + _show(n.operand, 3)
        return f"({text})" if outer >= 1 else text
    if t is ast.Call:
        return f"{n.func.id}({_show(n.args[0])},{_show(n.args[1])})"
    p = _PREC[type(n.op)]
    text = f"{_show(n.left, p)}{_BINOPS[type(n.op)]}{_show(n.right, p, True)}"
    # (a-b)-c reads without parentheses; a-(b-c) and a*(b+c) need them.
    return f"({text})" if p < outer or (right and p == outer) else text


def size_text(x) -> str:
    """How a size reads in `.rir` text, canonically: `64`, `B`, `B*T`, `2*(T-1)`."""
    return str(x) if type(x) is int else _show(_expr(x))


def normal_size(x):
    """A dimension, bytes or argument as the IR holds it: an int when the
    text is a plain (possibly negative) integer, else the expression's
    canonical text."""
    if type(x) is int:
        return x
    t = size_text(x)
    return int(t) if re.fullmatch(r"-?\d+", t) else t


# ------------------------------------------------------------------ ranges


class SizeRange(msgspec.Struct, frozen=True):
    symbol: str
    low: int
    high: int


_RANGE_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*\.\.\s*(\d+)\s*")


def parse_range(text: str) -> SizeRange:
    """`B=2..4` (both ends included)."""
    m = _RANGE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise SizeError(f"{text!r} is not a size range: expected SYMBOL=LOW..HIGH, e.g. T=32..128")
    r = SizeRange(m.group(1), int(m.group(2)), int(m.group(3)))
    if r.symbol in _FUNCS:
        raise SizeError(f"{text!r}: {r.symbol} is a function, not a size symbol")
    if not 1 <= r.low <= r.high:
        raise SizeError(f"{text!r}: a range runs from a low end of at least 1 to a high end no smaller")
    return r


def format_range(r: SizeRange) -> str:
    return f"{r.symbol}={r.low}..{r.high}"


def ranges(program: Program) -> dict[str, SizeRange]:
    return {r.symbol: r for r in map(parse_range, program.header.sizes)}


def is_symbolic(program: Program) -> bool:
    return bool(program.header.sizes)


def ends(program: Program) -> list[dict[str, int]]:
    """The sizes at the two ends of the program's range (all low, all high)."""
    rs = ranges(program).values()
    low = {r.symbol: r.low for r in rs}
    high = {r.symbol: r.high for r in rs}
    return [low, high] if low != high else [high]


def check_sizes(program: Program, sizes: dict[str, int]) -> str:
    """Why `sizes` are outside what `program` covers (its range, its size
    guards), in words, or ""."""
    rs = ranges(program)
    for s, r in rs.items():
        if s not in sizes:
            return f"no size for {s}"
        if not r.low <= sizes[s] <= r.high:
            return f"{s}={sizes[s]} is outside the plan's range {format_range(r)}"
    for g in program.header.size_guards:
        if not condition_holds(g, sizes):
            return f"the sizes {', '.join(f'{k}={v}' for k, v in sizes.items())} break the plan's size guard {g}"
    return ""


def bind_sizes(shapes: list[tuple[str, list, list[int]]]) -> tuple[dict[str, int], str]:
    """The symbols' sizes from the call: `shapes` holds (input name, the
    plan's shape of it, the call's shape).  Returns (sizes, "") or ({}, why
    the call does not fit the shapes)."""
    sizes: dict[str, int] = {}
    later: list[tuple[str, int, str, int]] = []
    for name, want, got in shapes:
        if len(want) != len(got):
            return {}, f"input {name}: the plan takes {len(want)} dimensions, got {len(got)}"
        for d, (w, g) in enumerate(zip(want, got)):
            if type(w) is int:
                if w != g:
                    return {}, f"input {name}: dimension {d} is {w} in the plan, got {g}"
            elif SYMBOL_RE.fullmatch(w):
                if sizes.setdefault(w, g) != g:
                    return {}, f"input {name}: dimension {d} is {w}, which is {sizes[w]} elsewhere in this call, got {g}"
            else:
                later.append((name, d, w, g))
    for name, d, w, g in later:
        try:
            have = evaluate(w, sizes)
        except SizeError as e:
            return {}, f"input {name}: dimension {d} ({w}): {e}"
        if have != g:
            return {}, f"input {name}: dimension {d} is {w} = {have} for these sizes, got {g}"
    return sizes, ""


def bind_inputs(program: Program, shapes: dict[str, list[int]]) -> tuple[dict[str, int], str]:
    """`bind_sizes` for a call of `program`: `shapes` maps each input's name
    (its source, the forward's argument) to the call's shape of it."""
    return bind_sizes([(v.source or v.name, v.shape, list(shapes[v.source or v.name]))
                       for v in program.values if v.kind == "input"])


# ------------------------------------------------------------- instantiation


def _arg(a, sizes):
    t = type(a)
    if t is Sym:
        return evaluate(a.expr, sizes)
    if t is Seq:
        return Seq([_arg(x, sizes) for x in a.items])
    return a


def instantiate(program: Program, sizes: dict[str, int], *, refingerprint: bool = True) -> Program:
    """The concrete program of one size: every shape, stride, byte count and
    size argument evaluated at `sizes`; no range, and (unless not
    `refingerprint`, for a program only simulated) the fingerprint of what it
    now says.  The same names, nodes and schedule, so a schedule chosen for
    one instantiation is the symbolic program's schedule."""
    if not program.header.sizes:
        return program
    why = check_sizes(program, sizes)
    if why:
        raise SizeError(why)
    values = []
    for i, v in enumerate(program.values):
        if any(type(d) is not int for d in v.shape) or any(type(s) is not int for s in v.stride) \
                or type(v.nbytes) is not int:
            try:
                v = msgspec.structs.replace(
                    v, shape=[evaluate(d, sizes) for d in v.shape], stride=[evaluate(s, sizes) for s in v.stride],
                    nbytes=evaluate(v.nbytes, sizes))
            except SizeError as e:  # (said at the value's line, not the header's)
                raise SizeError(f"value {v.name}: {e}", v.line, "values", i) from None
        values.append(v)
    nodes = []
    for i, n in enumerate(program.nodes):
        if _has_sym(n.args) or _has_sym(n.kwargs.values()):
            try:
                n = msgspec.structs.replace(n, args=[_arg(a, sizes) for a in n.args],
                                            kwargs={k: _arg(a, sizes) for k, a in n.kwargs.items()})
            except SizeError as e:
                raise SizeError(f"node {n.name}: {e}", n.line, "nodes", i) from None
        nodes.append(n)
    # A concrete program of its own: no range, and the fingerprint of what it now says
    # (the lines it came from kept, so messages about it point into the plan's text).
    header = msgspec.structs.replace(program.header, sizes=[], size_guards=[])
    out = msgspec.structs.replace(program, header=header, values=values, nodes=nodes)
    if header.fingerprint and refingerprint:
        header.fingerprint = fingerprint(out)
    return out


def sym_exprs(args):
    """The size expressions (`Sym`) among a node's arguments, nested lists included."""
    stack = list(args)
    while stack:
        a = stack.pop()
        if type(a) is Sym:
            yield a.expr
        elif type(a) is Seq:
            stack.extend(a.items)


def _has_sym(args) -> bool:
    return next(sym_exprs(args), None) is not None


def value_is_symbolic(v: Value) -> bool:
    return type(v.nbytes) is not int or any(type(d) is not int for d in list(v.shape) + list(v.stride))
