"""Nested list arguments: a list nested 1,000 deep (a 3 KB plan) made
remat-verify, remat-show and remat-run die with RecursionError.  The reader
refuses lists nested more than MAX_NESTING (32) deep at their line and
column; the verifier refuses those of a program built in memory, the printer
does not write them, and the walkers over arguments (`arg_refs`, `arg_depth`)
are iterative."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import remat_ir
from remat_ir.ir import MAX_NESTING, Ref, Seq, arg_depth, arg_refs, node_inputs
from remat_ir.ir.fingerprint import fingerprint as fingerprint_of
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.ir.syntax import RirSyntaxError

try:
    from .test_diagnostics import PLAN
except ImportError:  # run as a plain module
    from test_diagnostics import PLAN

LIST = "[2, 3]"  # the one list argument of PLAN (expand_copy's size), on line 17
assert PLAN.count(LIST) == 1
LIST_COL = PLAN.split("\n")[16].index(LIST) + 1


def nested(depth: int, inner: str = "2, 3") -> str:
    return PLAN.replace(LIST, "[" * depth + inner + "]" * depth)


def expand(p):
    """PLAN's node with the list argument."""
    return next(n for n in p.nodes if n.op == "aten.expand_copy.default")


def deep(depth: int, leaf=3):
    a = leaf
    for _ in range(depth):
        a = Seq([a])
    return a


def test_max_nesting_is_32():
    assert MAX_NESTING == 32


def test_the_reader_takes_32_levels_and_refuses_33_at_the_33rd_bracket():
    p = parse_program(nested(32))
    arg = expand(p).args[1]
    assert arg_depth(arg) == 32
    assert format_program(p).count("[" * 32 + "2, 3" + "]" * 32) == 1  # printed as read
    for depth in (33, 34, 1000, 100_000):
        with pytest.raises(RirSyntaxError) as e:
            parse_program(nested(depth), "deep.rir")
        assert (e.value.line, e.value.column) == (17, LIST_COL + 32)
        assert "lists nested more than 32 deep" in e.value.message
    # Beside other items, in a keyword argument, and after a shallow list closed.
    for inner, col in ((f"1, [{'[' * 32}2]{']' * 32}", LIST_COL + 35), (f"[1], {'[' * 32}2{']' * 32}", LIST_COL + 37)):
        with pytest.raises(RirSyntaxError) as e:
            parse_program(nested(1, inner))
        assert (e.value.line, e.value.column) == (17, col), e.value
    assert PLAN.count("aten.sum.default(mm)") == 1
    kw = PLAN.replace("aten.sum.default(mm)", "aten.sum.default(mm, dtype=" + "[" * 33 + "]" * 33 + ")")
    with pytest.raises(RirSyntaxError, match="lists nested more than 32 deep"):
        parse_program(kw)


@pytest.mark.parametrize("prog", ["remat-verify", "remat-show", "remat-run"])
def test_a_plan_nested_1000_deep_exits_2_in_one_line(tmp_path, prog):
    exe = os.path.join(os.path.dirname(sys.executable), prog)
    if not os.path.exists(exe):
        pytest.skip("console scripts not installed in this environment")
    plan = tmp_path / "deep.rir"
    plan.write_text(nested(1000))
    assert len(plan.read_bytes()) < 3500
    args = [exe, str(plan)] + (["mlp", "--check", "--steps", "1"] if prog == "remat-run" else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "\n" not in err and "Traceback" not in err and "RecursionError" not in err, err
    assert err.startswith(f"{prog}: error: {plan}:17:{LIST_COL + 32}: lists nested more than 32 deep"), err
    assert r.stdout == ""


def test_walkers_over_arguments_take_any_depth():
    a = deep(100_000, Ref("x"))
    assert arg_refs(a) == ["x"]
    assert arg_depth(a, MAX_NESTING) == MAX_NESTING + 1
    assert arg_depth(deep(5000)) == 5000
    assert [arg_depth(x) for x in (3, Ref("x"), Seq([]), Seq([1, 2]), Seq([Seq([]), 1]), Seq([1, Seq([Seq([])])]))] \
        == [0, 0, 1, 1, 2, 3]
    assert arg_refs(Seq([Ref("a"), Seq([Seq([Ref("b")]), Ref("c")]), 1, Ref("d")])) == ["a", "b", "c", "d"]


def test_the_verifier_refuses_a_program_nested_too_deep_built_in_memory():
    """Made in memory, the program never met the reader: the verifier says
    where (the node's line), and nothing in it recurses (fingerprint check,
    type check), the printer and the fingerprint refuse it, the runtime
    refuses to run it."""
    from remat_ir.runtime.bind import PlanMismatch
    from remat_ir.runtime.interpret import Executable

    for fingerprint in ("", "0123456789abcdef"):
        p = parse_program(PLAN)
        p.header.fingerprint = fingerprint
        node = expand(p)
        node.args[1] = deep(5000, Seq([2, 3]))
        assert node_inputs(node) == ["d.loss"]
        verdict = remat_ir.verify(p)
        msgs = [(d.line, d.message) for d in verdict.errors]
        assert (17, f"node d.mm: an argument has lists nested more than 32 deep; an op takes flat lists "
                    f"(`[2, 3]`, `[x, y]`), and the .rir reader refuses deeper ones") in msgs, msgs
        assert all("RecursionError" not in m and "type checker failed" not in m for _, m in msgs), msgs
        with pytest.raises(ValueError, match="nested more than 32 deep"):
            format_program(p)
        with pytest.raises(ValueError, match="nested more than 32 deep"):
            fingerprint_of(p)
        with pytest.raises(PlanMismatch, match="nested more than 32 deep"):
            Executable(p)
    p = parse_program(PLAN)
    expand(p).args[1] = deep(31, Seq([2, 3]))  # 32 deep: no nesting error (a type error: expand_copy's size)
    assert not any("nested" in d.message for d in remat_ir.verify(p).errors)
