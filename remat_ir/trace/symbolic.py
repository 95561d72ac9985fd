"""Symbolic tracing: one trace for every size of the dimensions that vary.

The tracer fakes the call's inputs with a symbol for each dynamic dimension
(make_fx's ShapeEnv, duck-sized: dimensions of one size class share a
symbol) and every other dimension, and all parameters and buffers, fixed.
What the model's code computes from sizes becomes SymInt expressions in
sympy; this module names the symbols as the caller asked (`B`, `T`) and
writes the expressions in the plan's size language (`remat_ir.ir.sizes`),
and turns the ShapeEnv's guards (what the code assumed of the sizes, such as
`T <= 128`) into the plan's size guards.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from remat_ir.ir import sizes as sz


class SymbolicError(ValueError):
    """The step does not trace to one program for every size: the message says why."""


def dense(t: torch.Tensor) -> bool:
    """Whether `t` is contiguous and its storage holds exactly its elements:
    then its bytes are a function of its sizes, as a symbolic plan states them."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class Symbolic:
    """The symbolic side of one trace: the ShapeEnv and the symbols' names."""

    def __init__(self, call, dynamic: dict[str, dict[int, str]]):
        self.env = ShapeEnv()
        self.dynamic = {n: dict(d) for n, d in dynamic.items()}
        unknown = [n for n in self.dynamic if n not in call.names]
        if unknown:
            raise SymbolicError(f"no input named {', '.join(unknown)} in this call (it has "
                                f"{', '.join(call.names) or 'no tensors'})")
        # Duck sizing gives equal sizes one symbol: two symbols the caller
        # tells apart must differ in this call, or the trace would merge them.
        size_of: dict[str, int] = {}
        got = dict(zip(call.names, call.tensors))
        for name, dims in self.dynamic.items():
            if not dense(got[name]):
                raise SymbolicError(f"input {name} is not a contiguous tensor with a storage of its own")
            for d, s in dims.items():
                if not 0 <= d < got[name].dim():
                    raise SymbolicError(f"input {name} has no dimension {d}")
                n = int(got[name].shape[d])
                if size_of.setdefault(s, n) != n:
                    raise SymbolicError(f"{s} is {size_of[s]} and {n} in one call")
                if n < 2:
                    raise SymbolicError(f"{s} is {n} in this call; a symbolic trace needs a size of at least 2")
        by_size: dict[int, str] = {}
        for s, n in size_of.items():
            if by_size.setdefault(n, s) != s:
                raise SymbolicError(f"{by_size[n]} and {s} are both {n} in this call; trace with a call where "
                                    "they differ")
        self.hints = size_of
        self.names: dict = {}  # sympy symbol -> name

    @staticmethod
    def own(t: torch.Tensor) -> torch.Tensor:
        """`t` as an input of the trace: a view of a storage it covers exactly
        (a batch sliced from a larger tensor and made contiguous is not one)
        is faked without its base, whose sizes would be symbols of their own."""
        if t._base is None:
            return t
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # (called inside the fake mode)
            return t.detach()

    def context(self, name: str | None, t: torch.Tensor) -> dict:
        """from_tensor's keyword arguments for an input `name` (None: a parameter or buffer)."""
        dims = self.dynamic.get(name) if name is not None else None
        if not dims:
            return {"static_shapes": True}
        return {"symbolic_context": StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DUCK if d in dims else DimDynamic.STATIC for d in range(t.dim())])}

    def name_symbols(self, fakes, in_names) -> None:
        for f, name in zip(fakes, in_names):
            for d, s in self.dynamic.get(name, {}).items():
                expr = f.shape[d].node.expr if isinstance(f.shape[d], torch.SymInt) else None
                if expr is None or not expr.is_Symbol:
                    raise SymbolicError(f"dimension {d} of {name} did not trace as a symbol")
                self.names[expr] = s

    # ------------------------------------------------------------ conversion

    def size(self, x):
        """An int, or a SymInt as the canonical text of its expression (an int
        when it is a constant)."""
        if isinstance(x, int):
            return x
        if isinstance(x, torch.SymInt):
            import sympy

            # Expanded, so a size reads as a polynomial (8*B*T, not 8*T+8*T*(B-1)).
            expr = sympy.expand(self.env.replace(x.node.expr))
            if expr.is_Integer:
                return int(expr)
            return sz.normal_size(self._text(expr))
        raise SymbolicError(f"a size of type {type(x).__name__} where an integer was expected")

    def hint(self, x) -> int:
        """The size `x` has in the traced call (no guard is added)."""
        if isinstance(x, torch.SymInt):
            return int(x.node.hint)
        return int(x)

    def _text(self, e) -> str:
        import sympy
        from torch.utils._sympy import functions as F

        if e.is_Integer:
            return str(int(e))
        if e.is_Symbol:
            if e not in self.names:
                raise SymbolicError(f"the size {e} is not one of the call's dimensions")
            return self.names[e]
        # Operands of + * max min in one order whatever order sympy holds them in (it
        # sorts by its own symbol names, s0, s1, ..., which depend on earlier traces):
        # numbers first, then by text, so one step prints one way in any process.
        if isinstance(e, sympy.Add):  # terms with a minus sign last, as subtractions: T-1, not (-1)+T
            plus = sorted((self._text(a) for a in e.args if not a.could_extract_minus_sign()), key=_order)
            minus = sorted((self._text(-a) for a in e.args if a.could_extract_minus_sign()), key=_order)
            return "(" + ("+".join(plus) or "0") + "".join(f"-{m}" for m in minus) + ")"
        args = [self._text(a) for a in e.args]
        if isinstance(e, (sympy.Mul, sympy.Max, sympy.Min)) or type(e).__name__ in ("Max", "Min"):
            args.sort(key=_order)
        if isinstance(e, sympy.Mul):
            return "(" + "*".join(args) + ")"
        if isinstance(e, sympy.Pow) and e.args[1].is_Integer and int(e.args[1]) >= 1:
            return "(" + "*".join([args[0]] * int(e.args[1])) + ")"
        if isinstance(e, (F.FloorDiv, getattr(F, "CleanDiv", F.FloorDiv))):
            return f"({args[0]}//{args[1]})"
        if isinstance(e, (F.Mod, F.PythonMod)):
            return f"({args[0]}%{args[1]})"
        if isinstance(e, (sympy.Max, sympy.Min)) or type(e).__name__ in ("Max", "Min"):
            fn = "max" if isinstance(e, sympy.Max) or type(e).__name__ == "Max" else "min"
            out = args[0]
            for a in args[1:]:
                out = f"{fn}({out},{a})"
            return out
        raise SymbolicError(f"the size expression {e} uses {type(e).__name__}, which a plan cannot state")

    def condition(self, e) -> str | None:
        """A guard as a size condition; None when it always holds."""
        import sympy

        e = self.env.simplify(e)
        if e is sympy.true:
            return None
        if e is sympy.false:
            raise SymbolicError("the traced code assumed sizes that contradict each other")
        parts = e.args if isinstance(e, sympy.And) else (e,)
        ops = {sympy.Eq: "==", sympy.Ne: "!=", sympy.Lt: "<", sympy.Le: "<=", sympy.Gt: ">", sympy.Ge: ">="}
        out = []
        for p in parts:
            op = next((o for k, o in ops.items() if isinstance(p, k)), None)
            if op is None:
                raise SymbolicError(f"the traced code assumed {p} of the sizes, which a plan cannot state")
            lhs, rhs = sz.size_text(self._text(p.lhs)), sz.size_text(self._text(p.rhs))
            if op in ("==", "!=") and _order(lhs) < _order(rhs):  # (symmetric: the sizes first)
                lhs, rhs = rhs, lhs
            out.append(f"{lhs} {op} {rhs}")
        return " and ".join(out)

    def header(self) -> tuple[list[str], list[str]]:
        """(sizes, size_guards) for the program's header: each symbol's range
        from the smallest size the trace assumes to the call's, and the
        guards the trace added."""
        specialized = [s for sym, s in self.names.items() if self.env.replace(sym).is_Integer]
        if specialized:
            raise SymbolicError(f"the model's code fixes {', '.join(specialized)} to the size of this call "
                                "(it branches on it or checks it against a constant)")
        guards: list[str] = []
        for g in self.env.guards:
            c = self.condition(g.expr)
            if c is not None and c not in guards:
                guards.append(c)
        ranges = []
        for sym, s in self.names.items():
            vr = self.env.var_to_range.get(sym)
            low = max(2, int(vr.lower)) if vr is not None and vr.lower.is_finite else 2
            ranges.append(f"{s}={low}..{self.hints[s]}")
        # Ranges in first-use order of the inputs, one per symbol.
        seen: dict[str, None] = {}
        for r in ranges:
            seen.setdefault(r, None)
        return list(seen), guards


def _order(text: str) -> tuple:
    """Where an operand's text goes among its siblings: numbers first (by value), then by text."""
    t = text.strip("()")
    return (0, int(t), "") if t.isdigit() else (1, 0, text)
