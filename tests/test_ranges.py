"""A symbolic plan holds over its whole range, not only at its ends
(`remat_ir.check.ranges`), and `remat-run` runs it at the sizes it is given.

The counter-examples are edits that agree with the traced plan at both ends
of T=2..48 and differ between them: a size argument that divides by zero at
T=20, a view whose shape is right at T=2 and T=48 only, a byte count short
of its shape's in the middle.  Each is refused at its line.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remat_ir
from remat_ir.check.ranges import degree_points, exhaustive, range_errors
from remat_ir.cli.commands import compile_main, run_main, verify_main
from remat_ir.cli.errors import EXIT_FAIL, EXIT_INPUT, EXIT_OK
from remat_ir.ir import sizes as sz
from remat_ir.ir.parser import parse_program

pytest.importorskip("transformers")

LLAMA = textwrap.dedent('''
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM


    class LlamaWithLoss(LlamaForCausalLM):
        def forward(self, input_ids, labels):
            return super().forward(input_ids=input_ids, labels=labels).loss


    def build(batch: int = 2, seq: int = 16, seed: int = 0):
        torch.manual_seed(seed)
        model = LlamaWithLoss(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=128))
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))
        return model, (ids, ids.clone())
''')


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model file, its symbolic plan's text over T=2..48 at budget 0.7)."""
    d = tmp_path_factory.mktemp("ranges")
    model = d / "llama_file.py"
    model.write_text(LLAMA)
    plan = d / "llama.rir"
    assert compile_main([str(model), "--dynamic", "--max-size", "T=48", "--budget", "0.7", "-o", str(plan)]) == EXIT_OK
    return model, plan


def _edited(text: str, old: str, new: str) -> tuple[str, int]:
    """`text` with the first line holding `old` edited (fingerprint cleared:
    a hand edit), and that line's number."""
    lines = text.splitlines()
    k = next(i for i, line in enumerate(lines) if old in line)
    lines[k] = lines[k].replace(old, new, 1)
    out = "\n".join(lines) + "\n"
    out = "\n".join('fingerprint ""' if line.startswith("fingerprint ") else line for line in out.splitlines()) + "\n"
    return out, k + 1


@pytest.mark.parametrize("old, new, says", [
    ("[$B, $T, -1, 16]", "[$B, $(T+0*(T//(T-20))), -1, 16]", "divides by zero at B=2, T=20"),
    ("[$(B*T), 64]", "[$(T*B+(T-2)*(48-T)), 64]", "inside the plan's range"),
    ("$(512*B*T) bytes", "$(512*B*T-(T-2)*(48-T)) bytes", "but its shape spans"),
])
def test_mid_range_counter_examples_are_refused_at_their_line(llama, tmp_path, capsys, old, new, says):
    _, plan = llama
    text, line = _edited(plan.read_text(), old, new)
    edited = tmp_path / "edited.rir"
    edited.write_text(text)
    # Both ends alone would call it sound: the edit agrees with the plan there.
    program = parse_program(text)
    assert all(remat_ir.verify(sz.instantiate(program, at)).ok for at in sz.ends(program))
    assert verify_main([str(edited)]) == EXIT_FAIL
    out = capsys.readouterr().out
    assert f"{edited}:line {line}: " in out and says in out, out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=st.integers(1, 9), a=st.integers(3, 47))
def test_a_byte_count_off_only_between_the_ends_is_refused(llama, c, a):
    """Any multiple of (T-2)*(48-T)*(T-a)^2 added to a byte count: zero at
    both ends (and at T=a), nonzero elsewhere between them."""
    _, plan = llama
    text, line = _edited(plan.read_text(), "$(512*B*T) bytes", f"$(512*B*T+{c}*(T-2)*(48-T)*(T-{a})*(T-{a})) bytes")
    errors = range_errors(parse_program(text))
    assert errors and errors[0][0] == line


def test_the_traced_plan_holds_over_its_range(llama):
    _, plan = llama
    program = remat_ir.load_plan(plan)
    assert exhaustive(program) and range_errors(program) == []
    assert remat_ir.verify(program).ok


def test_degree_points_cover_each_symbol_polynomially():
    """A degree-2 expression in T asks for a third size of T between the ends."""
    from remat_ir.ir import Header, Program, Value

    v = Value(name="x", kind="input", dtype="float32", shape=["B", "T*T"], stride=["T*T", 1], storage="x",
              nbytes="4*B*T*T", source="x")
    p = Program(header=Header(version=1, model="m", fingerprint="", device="cpu", sizes=["B=2..8", "T=2..64"]),
                values=[v], nodes=[], forward=[], backward=[], outputs=[])
    points = degree_points(p)
    assert {q["T"] for q in points} == {2, 33, 64} and {q["B"] for q in points} == {2, 8}
    assert {"B": 2, "T": 2} not in points and {"B": 8, "T": 64} not in points


@pytest.mark.slow
def test_compile_dynamic_then_run_at_several_sizes_inside_the_range(llama, capsys):
    model, plan = llama
    for n in (3, 21, 48):
        assert run_main([str(plan), str(model), "--seq", str(n), "--check", "--steps", "2"]) == EXIT_OK
        out = capsys.readouterr()
        assert f"running {plan} at B=2, T={n}" in out.err and "gradients: bitwise equal to eager" in out.out
    assert run_main([str(plan), str(model), "--size", "T=30", "--steps", "1"]) == EXIT_OK


@pytest.mark.parametrize("flags, says", [
    (["--seq", "60"], "T=60 is outside the plan's range"),
    (["--size", "S=3"], "has no size symbol S"),
    (["--size", "T=3", "--seq", "4"], "disagree"),
    (["--size", "T"], "expected SYMBOL=N"),
])
def test_remat_run_refuses_sizes_the_plan_does_not_cover_in_one_line(llama, capsys, flags, says):
    model, plan = llama
    assert run_main([str(plan), str(model), *flags]) == EXIT_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_grid_evaluation_is_pythons(llama):
    """`evaluate_grid` gives `evaluate`'s values (floor division and modulo of negatives included)."""
    grid = {"T": torch.arange(-6, 7), "B": torch.full((13,), 3)}
    for text in ("T//B", "T%B", "(T-7)//(B-5)", "max(T, B)-min(T*T, 4)"):
        got = sz.evaluate_grid(text, grid).tolist()
        assert got == [sz.evaluate(text, {"T": t, "B": 3}) for t in range(-6, 7)], text
    assert sz.degree("B*T*T+T", "T") == 2 and sz.degree("max(B, T)//2", "B") == 1


def _one_value_program(sizes: list[str], nbytes: str, guards: list[str] = ()):
    from remat_ir.ir import Header, Program, Value

    v = Value(name="x", kind="input", dtype="uint8", shape=["B"], stride=[1], storage="x", nbytes="B", source="x")
    w = Value(name="y", kind="value", dtype="uint8", shape=[nbytes], stride=[1], storage="y", nbytes=nbytes)
    return Program(header=Header(version=1, model="m", fingerprint="", device="cpu", sizes=sizes,
                                 size_guards=list(guards)), values=[v, w], nodes=[], forward=[], backward=[],
                   outputs=[])


def test_a_byte_count_shrinking_between_allowed_sizes_is_refused():
    """Growth is checked from each size the guards allow to the next allowed
    one: with `B % 2 == 0`, no two neighbours are both allowed."""
    bad = _one_value_program(["B=2..8"], "128*(B-5)*(B-5)", ["B % 2 == 0"])
    errors = range_errors(bad)
    assert errors and "shrinks" in errors[0][1], errors
    assert range_errors(_one_value_program(["B=2..8"], "128*B", ["B % 2 == 0"])) == []


def test_conditions_stop_at_their_first_false_part_as_at_run_time():
    p = _one_value_program(["B=2..8"], "B", ["B != 5 and 6 % (B - 5) == 0"])
    assert range_errors(p) == []  # (6 % 0 is never evaluated: B != 5 is false there)
    assert sz.conditions_grid(["B != 5 and 6 % (B - 5) == 0"], {"B": torch.arange(2, 9)}).tolist() == [
        sz.condition_holds("B != 5 and 6 % (B - 5) == 0", {"B": b}) for b in range(2, 9)]


def test_sizes_past_int64_are_a_diagnostic_not_a_crash():
    errors = range_errors(_one_value_program(["B=2..8"], f"B+{1 << 70}"))
    assert errors and "too large" in errors[0][1], errors
