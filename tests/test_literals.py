"""Literal arguments: what the verifier calls sound, the run can take.

`1e999` is infinity, read as `inf` is (a plan with either is the same plan:
same fingerprint, same generated code); non-finite floats made in memory hash
as the `inf`/`nan` they mean, not as `none` (JSON has no infinity: msgspec
writes `null`, so `none` edited to `1e999` kept the fingerprint and ran
wrong).  Numbers the kernels refuse but the fake run takes (a dropout
probability outside [0, 1], a fill value its dtype cannot hold, an integer
divided by 0, an output_mask entry that drops an output the plan reads) are
refused at their line: tests/diagnostics/verify/
dropout-probability.rir and literals-the-kernels-refuse.rir; here, each
literal kind on the nodes of a real plan is refused or runs."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import remat_ir
from remat_ir.cli.commands import compile_main, run_main, verify_main
from remat_ir.ir import Node, Seq, Special
from remat_ir.ir.fingerprint import fingerprint
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.ir.syntax import RirSyntaxError
from remat_ir.runtime.load import LoadedModel
from remat_ir.runtime.run import run_plan

try:
    from .test_trust import Tiny, tiny_loss
except ImportError:  # run as a plain module
    from test_trust import Tiny, tiny_loss

ROOT = Path(__file__).resolve().parent.parent

CLAMP_MODEL = (
    "import torch\n"
    "class M(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.lin = torch.nn.Linear(4, 4)\n"
    "    def forward(self, x):\n"
    "        return self.lin(x).clamp(max=float('inf')).square().mean()\n"
    "def build():\n"
    "    torch.manual_seed(0)\n"
    "    return M(), (torch.randn(3, 4),)\n")


@pytest.fixture(scope="module")
def clamp_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("clamp")
    model = d / "m.py"
    model.write_text(CLAMP_MODEL)
    plan = d / "m.rir"
    assert compile_main([str(model), "-o", str(plan), "--quiet"]) == 0
    return model, plan


def test_1e999_verifies_and_runs_as_inf(clamp_plan, tmp_path, capsys):
    model, plan = clamp_plan
    text = plan.read_text()
    assert text.count("aten.clamp.default(lin.addmm, none, inf)") == 1
    assert text.count("aten.le.Scalar(lin.addmm, inf)") == 1
    edited = tmp_path / "e.rir"
    edited.write_text(text.replace("(lin.addmm, none, inf)", "(lin.addmm, none, 1e999)")
                      .replace("(lin.addmm, inf)", "(lin.addmm, 1e999)"))
    # The same plan: the fingerprint still holds, the model check passes.
    assert parse_program(edited.read_text()) == parse_program(text)
    assert verify_main([str(edited)]) == 0
    capsys.readouterr()
    assert run_main([str(edited), str(model), "--check", "--steps", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["grads_bitwise"] is True and data["loss_bitwise"] is True


def test_none_edited_to_1e999_breaks_the_fingerprint(clamp_plan, tmp_path, capsys):
    model, plan = clamp_plan
    edited = tmp_path / "g.rir"
    edited.write_text(plan.read_text().replace("(lin.addmm, none, inf)", "(lin.addmm, 1e999, inf)"))
    assert verify_main([str(edited)]) == 1
    assert "no longer matches its fingerprint" in capsys.readouterr().out


def test_non_finite_floats_hash_as_what_they_mean():
    def program(arg):
        p = parse_program((ROOT / "schedules" / "mlp.rir").read_text())
        p.nodes[0] = Node(p.nodes[0].name, p.nodes[0].op, list(p.nodes[0].args) + [arg], p.nodes[0].kwargs,
                          p.nodes[0].outputs, p.nodes[0].phase)
        return fingerprint(p)

    assert program(float("inf")) == program(Special("inf")) != program(None)
    assert program(float("-inf")) == program(Special("-inf")) != program(float("inf"))
    assert program(float("nan")) == program(Special("nan")) != program(None)
    assert program(Seq([float("inf")])) == program(Seq([Special("inf")])) != program(Seq([None]))
    assert program(1e308) != program(None)


# ---------------------------------------------- each literal kind, on a real plan

@pytest.fixture(scope="module")
def tiny():
    import torch

    torch.manual_seed(0)
    module = Tiny()
    x = torch.randn(5, 6)
    plan = remat_ir.compile(module, (x,), loss=tiny_loss, name="tiny")
    text = format_program(plan)
    # Fingerprint blanked: the verifier's other checks, not the hash, must
    # catch what the run cannot take.
    lines = ['fingerprint ""' if ln.startswith("fingerprint ") else ln for ln in text.split("\n")]
    return module, x, "\n".join(lines)


SLOTS = {  # a call in the Tiny plan -> the same call with {} for a literal
    "bn.add_": ("aten.add_.Tensor(bn.num_batches_tracked, 1)", "aten.add_.Tensor(bn.num_batches_tracked, {})"),
    "div": ("aten.div.Scalar(d.expand, 15)", "aten.div.Scalar(d.expand, {})"),
    "pow": ("aten.pow.Tensor_Scalar(t, 2)", "aten.pow.Tensor_Scalar(t, {})"),
    "threshold": ("aten.threshold_backward.default(d.drop.mul, d.drop.detach_1, 0)",
                  "aten.threshold_backward.default(d.drop.mul, d.drop.detach_1, {})"),
    "momentum": ("true, 0.1, 1e-05) module bn", "true, {}, 1e-05) module bn"),
    "keep": ("remat.dropout_keep.default(relu, 0.7)", "remat.dropout_keep.default(relu, {})"),
    "sum dim": ("aten.sum.dim_IntList(d.t, [0], true)", "aten.sum.dim_IntList(d.t, [{}], true)"),
    # The kernel returns no tensor where the mask is false; the fake run returns one.
    "output mask": ("true, 1e-05, [true, true, true])", "true, 1e-05, [{}, true, true])"),
}
LITERALS = ["1e999", "-1e999", "nan", "1e308", "2.5", "-1.0", "0", "true", "false", "none", str(2 ** 63 - 1), str(2 ** 63),
            str(2 ** 64), str(-2 ** 63 - 1), "99999999999999999999999", '"x"', "[2]", "[[2]]", "device(cpu)",
            "torch.float32"]


@pytest.mark.parametrize("slot", sorted(SLOTS))
def test_each_literal_is_refused_at_a_line_or_runs(tiny, slot):
    """Sound means runnable: every literal in every slot is refused by the
    parser or the verifier naming a line, or the plan runs (its numbers
    may differ from eager's: the graph was edited, which the fingerprint or
    the model check, both off here, would catch)."""
    module, x, text = tiny
    old, new = SLOTS[slot]
    assert text.count(old) == 1, old
    outcomes = {}
    for lit in LITERALS:
        edited = text.replace(old, new.format(lit))
        try:
            plan = parse_program(edited, "edited.rir")
        except RirSyntaxError as e:
            assert e.line > 0
            outcomes[lit] = "unreadable"
            continue
        verdict = remat_ir.verify(plan)
        if not verdict.ok:
            assert all(d.line > 0 for d in verdict.errors), str(verdict)
            outcomes[lit] = "refused"
            continue
        model = LoadedModel("tiny", copy.deepcopy(module), (x,), tiny_loss)
        try:
            run_plan(plan, model, steps=1, check=True, check_model=False)
        except Exception as e:  # noqa: BLE001 - any failure is the bug under test
            pytest.fail(f"{slot} = {lit}: sound, but the run failed: {type(e).__name__}: {e}")
        outcomes[lit] = "ran"
    assert "ran" in outcomes.values(), outcomes
    if slot == "keep":  # a probability: 0 and 1 (true) run, nothing else
        assert [k for k, v in outcomes.items() if v == "ran"] == ["0", "true", "false"], outcomes
    if slot == "output mask":  # false, 0 and none drop output 0, which the plan reads
        assert all(outcomes[k] == "refused" for k in ("0", "false", "none")), outcomes
