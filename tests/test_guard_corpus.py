"""Guards are data: hostile guard texts are refused by remat-verify, at the
guards line, without running anything (no file made, no RNG drawn), and a
guard that fails as it runs is a one-line refusal naming it, before the step.
The rules are `remat_ir.ir.guards`'s; `tests/diagnostics/verify/guard-*.rir`
are the same refusals as expected-error files."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remat_ir.cli.commands import verify_main
from remat_ir.cli.errors import EXIT_FAIL, EXIT_OK, EXIT_INPUT
from remat_ir.ir.guards import OPS, Guard, GuardError, failed_guard

LEGAL = Path(__file__).parent / "diagnostics" / "verify" / "guard-legal.rir"


def _plan_with(guard: str) -> str:
    lines = LEGAL.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("guards "))
    lines[i] = "guards " + '"' + guard + '"'
    return "\n".join(lines) + "\n"


def _hostile(tmp_path: Path) -> list[str]:
    """Guard texts outside the guard language: the plan is unreadable."""
    target = tmp_path / "made-by-a-guard"
    return [
        f"aten.sum.default(aten.from_file.default('{target}', True, 16)) == 0",
        "aten.sum.default(aten.from_file.default('/etc/passwd', False, 16)) == 0",
        "aten.sum.default(aten._print.default('hello')) == 0",
        "aten.sum.default(aten.empty.memory_format([1000000000000])) == 0",
        "aten.sum.default(aten.rand.default([2])) == 0",
        "aten.sum.default(aten.randn_like.default(input('x'))) == 0",
        "aten.sum.default(aten.bernoulli.default(input('x'))) == 0",
        "prims.add(1, 2) == 3",
        "aten.add.Tensor(1, 2) == 3",
        "aten.sum.default(aten.zeros.default([4])) == 0",
        "aten.sum.default(aten.add_.Tensor(input('x'), 1)) == 0",
        "aten.sum.default(input('x'), bogus=1) == 0",
        "__import__('os').system('true') == 0",
        "aten.sum.default(aten.repeat.default(input('x'), [1000, 1000])) == 0",
    ]


# Guards in the language that cannot run on the plan's own inputs: unsound.
_UNRUNNABLE = [
    "aten.sum.default(aten.expand.default(input('x'), [1000000, 2, 4])) == 0",
    "aten.sum.default(aten.view.default(input('x'), [7])) == 0",
    "aten.sum.default(input('nope')) == 0",
    "aten.sum.default(aten.mul.Tensor(aten.view.default(input('x'), [8, 1]), aten.view.default(input('x'), [1, 8]))) == 0",
]


def test_remat_verify_refuses_hostile_guards(tmp_path, capsys):
    rng = torch.get_rng_state()
    for k, guard in enumerate(_hostile(tmp_path)):
        plan = tmp_path / f"hostile-{k}.rir"
        plan.write_text(_plan_with(guard))
        code = verify_main([str(plan)])
        cap = capsys.readouterr()
        out = (cap.out + cap.err).splitlines()
        assert code == EXIT_INPUT, (guard, out)
        assert len(out) == 1 and out[0].startswith(f"remat-verify: error: {plan}:8:8: guard "), (guard, out)
    for k, guard in enumerate(_UNRUNNABLE):
        plan = tmp_path / f"unrunnable-{k}.rir"
        plan.write_text(_plan_with(guard))
        code = verify_main([str(plan)])
        out = capsys.readouterr().out.splitlines()
        assert code == EXIT_FAIL, (guard, out)
        assert len(out) == 2 and out[0].startswith(f"{plan}:line 8: guard ") and guard in out[0], (guard, out)
        assert "UNSOUND (1 error)" in out[1]
    assert not (tmp_path / "made-by-a-guard").exists()
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_legal_guard_verifies(capsys):
    assert verify_main([str(LEGAL)]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1].endswith("sound")


_ATEN = sorted(f"aten.{p}.{o}" for p in dir(torch.ops.aten) if not p.startswith("__")
               for o in getattr(getattr(torch.ops.aten, p), "overloads", lambda: [])())


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(_ATEN), st.sampled_from(["input('x')", "input('x'), 1", "[input('x')]"]))
def test_ops_outside_the_language_are_refused(op, operands):
    text = f"{op}({operands}) == 0"
    if op in OPS:
        try:
            Guard(text)
        except GuardError as e:
            assert "is not an op of the guard language" not in str(e)
        return
    with pytest.raises(GuardError, match="is not an op of the guard language"):
        Guard(text)


@given(st.sampled_from(["prims", "torch", "remat", "quantized", "_c10d_functional", "os"]),
       st.sampled_from(["add.default", "sum.default", "system.default", "dropout_keep.default"]))
def test_other_namespaces_are_refused(ns, op):
    with pytest.raises(GuardError):
        Guard(f"{ns}.{op}(input('x')) == 0")


@pytest.mark.parametrize("guard, why", [
    ("aten._local_scalar_dense.default(aten.sum.default(aten.view.default(input('m'), [7]))) == 0",
     "RuntimeError: shape '[7]' is invalid"),
    ("aten._local_scalar_dense.default(aten.sum.default(buffer('nope'))) == 0", "reads buffer('nope')"),
    ("aten._local_scalar_dense.default(aten.sum.default(input('nope'))) == 0", "reads input('nope')"),
    ("aten._local_scalar_dense.default(aten.max.dim(input('m'), 0)[3]) == 0", "[3] takes the result"),
    ("aten._local_scalar_dense.default(aten.sum.default(aten._to_copy.default(input('m'), "
     "device=torch.device('meta')))) == 0", "cannot be evaluated"),
    ("aten._local_scalar_dense.default(aten.sum.default(aten.expand.default(input('m'), [100000, 4]))) == 0",
     "aten.expand.default would make 400000 elements, more than the 4 of"),
    ("aten.eq.Scalar(input('m'), 1) == True", "it gives a tensor of 4 elements"),
])
def test_a_guard_that_fails_as_it_runs_is_a_refusal(guard, why):
    g = Guard(guard)
    m = torch.ones(4)

    def leaf(kind, name):
        if kind == "input" and name == "m":
            return m
        if kind == "buffer":
            raise AttributeError(name)
        raise KeyError(name)

    problem = failed_guard([g], leaf)
    assert problem and "\n" not in problem and guard in problem and why in problem, problem


class _Masked(torch.nn.Module):
    """Reads its mask's values, as transformers' attention-mask check does."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, mask):
        y = self.lin(x)
        if torch.all(mask == 1):
            return y.sum()
        return (y * mask[:, :1]).sum()


def test_a_plan_refuses_a_guard_that_fails_before_its_step(tmp_path):
    import remat_ir
    from remat_ir.ir.fingerprint import fingerprint
    from remat_ir.runtime.bind import PlanMismatch

    torch.manual_seed(0)
    model, x, mask = _Masked(), torch.randn(2, 4), torch.ones(2, 4)
    plan = remat_ir.compile(model, (x, mask))
    assert any("input('mask')" in g for g in plan.header.guards), plan.header.guards
    guards = list(plan.header.guards)

    def with_guard(bad):
        plan.header.guards = guards + [bad]
        plan.header.fingerprint = fingerprint(plan)
        return plan

    # The verifier runs a guard on the plan's input shapes: this one is refused by wrap.
    bad = "aten._local_scalar_dense.default(aten.sum.default(aten.view.default(input('mask'), [7]))) == 0"
    with pytest.raises(PlanMismatch) as e:
        remat_ir.wrap(model, with_guard(bad))
    assert "\n" not in str(e.value) and bad in str(e.value)
    # A buffer only the model knows: refused at the call, before the step.
    bad = "aten._local_scalar_dense.default(aten.sum.default(buffer('nope'))) == 0"
    w = remat_ir.wrap(model, with_guard(bad))
    with pytest.raises(PlanMismatch) as e:
        w(x, mask)
    assert "\n" not in str(e.value) and bad in str(e.value) and "reads buffer('nope')" in str(e.value)
    assert model.lin.weight.grad is None  # no step ran


def test_the_tracer_records_only_guards_in_the_language():
    import remat_ir
    from remat_ir.trace.tracer import TraceError

    class Sine(torch.nn.Module):  # sin is not an op of the guard language
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, mask):
            return self.lin(x).sum() if torch.all(torch.sin(mask) > 0) else self.lin(x).mean()

    class Ones(torch.nn.Module):  # a mask of literals alone: the same on every call, no guard
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, mask):
            return self.lin(x).sum() if torch.all(torch.ones(2, 4) == 1) else self.lin(x).mean()

    x, mask = torch.randn(2, 4), torch.ones(2, 4)
    with pytest.raises(TraceError, match="data-dependent|depends on tensor values"):
        remat_ir.compile(Sine(), (x, mask))
    assert remat_ir.compile(Ones(), (x, mask)).header.guards == []
