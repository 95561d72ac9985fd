"""The command line, end to end, and what it says to bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from remat_ir.cli.commands import compile_main, run_main, verify_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "tiny.rir"
    assert compile_main(["gpt2-tiny", "-o", str(path), "--quiet"]) == 0
    return path


def test_compile_prints_breakdown(tmp_path, capsys):
    out = tmp_path / "mlp.rir"
    assert compile_main(["mlp", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("parameters", "gradients", "activations", "predicted peak"):
        assert word in text
    assert out.read_text().startswith("#")


def test_verify_and_run_check_json(tiny_plan, capsys):
    assert verify_main([str(tiny_plan)]) == 0
    assert "sound" in capsys.readouterr().out
    assert run_main([str(tiny_plan), "gpt2-tiny", "--steps", "2", "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("predicted_peak_bytes", "measured_peak_bytes", "grads_match", "max_abs_grad_diff",
                "step_time_s", "eager_step_time_s"):
        assert key in data
    assert data["grads_match"] is True
    assert data["max_abs_grad_diff"] == 0.0
    assert data["memory_within_tolerance"] is True


def test_malformed_plan_names_file_line_column(tiny_plan, tmp_path, capsys):
    lines = tiny_plan.read_text().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("compute "))
    lines[i] = lines[i].replace("compute", "compoot", 1)
    bad = tmp_path / "bad.rir"
    bad.write_text("\n".join(lines) + "\n")
    assert verify_main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:{i + 1}:" in err
    assert "Traceback" not in err


def test_unsound_plan_exits_1_naming_the_line(tiny_plan, tmp_path, capsys):
    lines = tiny_plan.read_text().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("free "))
    del lines[i]  # a leak
    bad = tmp_path / "leak.rir"
    bad.write_text("\n".join(lines) + "\n")
    assert verify_main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "line " in out and "UNSOUND" in out


def test_model_file_without_build(tmp_path, capsys):
    f = tmp_path / "nobuild.py"
    f.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\n")
    out = tmp_path / "x.rir"
    assert compile_main([str(f), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "build()" in err and "Traceback" not in err
    assert not out.exists()


def test_plan_for_another_model(tiny_plan, capsys):
    assert run_main([str(tiny_plan), "mlp", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "parameter" in err and "Traceback" not in err


def test_unsupported_op_is_named(tmp_path, capsys):
    f = tmp_path / "dyn.py"
    f.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.lin(x)\n"
        "        return y[y > 0].sum()\n"
        "def build():\n"
        "    return M(), (torch.randn(3, 4),)\n")
    out = tmp_path / "dyn.rir"
    assert compile_main([str(f), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "aten.nonzero" in err or "aten.masked_select" in err
    assert not out.exists()


def test_missing_plan_file(capsys):
    assert verify_main(["/nonexistent/plan.rir"]) == 2
    assert "plan.rir" in capsys.readouterr().err


def test_entry_points_installed():
    # The console scripts exist after `pip install`.
    exe = os.path.join(os.path.dirname(sys.executable), "remat-verify")
    if not os.path.exists(exe):
        pytest.skip("console scripts not installed in this environment")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "plan" in r.stdout


# The runtime path importing no optimizer, cvxpy or scipy: tests/test_layering.py.


# ------------------------------------------------------- the API behind it


def _small_net():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 4))
    return net, (torch.randn(128, 8),), (lambda out, x: out.square().mean())


def test_compile_api_completes_the_header_and_verifies():
    import remat_ir
    from remat_ir.pipeline import BudgetError, CompileStats
    from remat_ir.runtime.load import ModelError

    net, args, loss = _small_net()
    stats = CompileStats()
    plan = remat_ir.compile(net, args, loss=loss, name="net", optimizer="adam", stats=stats)
    h = plan.header
    assert (h.model, h.device, h.optim) == ("net", "cpu", "adam")
    assert h.optim_state_bytes == 2 * 4 * sum(p.numel() for p in net.parameters())
    assert h.comment == ["remat-ir plan: net (input float32[128, 8])"]
    assert h.budget is None and not any(i.kind == "recompute" for i in plan.backward)
    assert set(stats.seconds) == {"trace", "verify"} and stats.optimized is None
    assert remat_ir.compile(net, args, loss=loss).header.model == "Sequential"
    with pytest.raises(BudgetError, match="cannot read budget"):
        remat_ir.compile(net, args, loss=loss, budget="lots")
    with pytest.raises(ValueError, match="scope"):
        remat_ir.compile(net, args, loss=loss, scope="everything")
    with pytest.raises(ValueError, match="optimizer"):
        remat_ir.compile(net, args, loss=loss, optimizer="lamb")
    with pytest.raises(ModelError, match="nn.Module"):
        remat_ir.compile("net", args)


def test_compile_api_fits_a_budget():
    import remat_ir
    from remat_ir.pipeline import CompileStats

    net, args, loss = _small_net()
    stats = CompileStats()
    plan = remat_ir.compile(net, args, loss=loss, budget="floor", scope="activations", stats=stats)
    assert plan.header.budget.scope == "activations" and plan.header.budget.bytes == stats.budget
    assert stats.optimized is not None and stats.optimized.predicted_peak <= stats.budget
    assert {"trace", "budget", "optimize", "verify"} <= set(stats.seconds)
    verdict = remat_ir.verify(plan)
    assert verdict.ok and verdict.report.activation_peak_bytes <= stats.budget


def test_compile_api_takes_the_device_from_the_model():
    import torch

    import remat_ir

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    net, args, loss = _small_net()
    plan = remat_ir.compile(net.cuda(), tuple(a.cuda() for a in args), loss=loss)
    assert plan.header.device == "cuda"


# ------------------------------------------------------------- bad flags


def test_output_over_the_model_source_is_refused(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text(open(os.path.join(ROOT, "examples", "mlp_with_loss.py")).read())
    before = src.read_text()
    assert compile_main([str(src), "-o", str(src), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is the model file itself" in err and str(src) in err
    assert src.read_text() == before


def test_output_into_a_missing_directory_fails_first(tmp_path, capsys, monkeypatch):
    import remat_ir.runtime.load as load

    def no_load(*a, **k):  # the check must come before the model is even built
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(load, "load_model", no_load)
    path = tmp_path / "nowhere" / "p.rir"
    assert compile_main(["mlp", "-o", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {path}: no directory" in err and ".tmp" not in err


def test_scope_without_budget_is_refused(tmp_path, capsys):
    assert compile_main(["mlp", "-o", str(tmp_path / "p.rir"), "--scope", "activations"]) == 2
    assert "--scope activations says what --budget" in capsys.readouterr().err
    assert not (tmp_path / "p.rir").exists()


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_run_refuses_steps_below_one(tiny_plan, capsys, steps):
    assert run_main([str(tiny_plan), "gpt2-tiny", "--steps", steps]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_run_exits_1_when_memory_is_outside_the_prediction(tiny_plan, tmp_path, capsys):
    # The same plan with every parameter's declared bytes doubled: sound, but
    # it predicts a peak the run cannot meet.
    text = tiny_plan.read_text()
    lines = []
    for ln in text.splitlines():
        words = ln.split()
        if len(words) > 4 and words[1] == "param" and words[3].isdigit() and words[4] == "bytes":
            ln = ln.replace(f" {words[3]} bytes", f" {int(words[3]) * 64} bytes", 1)
        lines.append(ln)
    bad = tmp_path / "big.rir"
    bad.write_text("\n".join(lines) + "\n")
    assert verify_main([str(bad)]) == 0
    capsys.readouterr()
    assert run_main([str(bad), "gpt2-tiny", "--steps", "1"]) == 1
    captured = capsys.readouterr()
    assert "OUTSIDE" in captured.out and "outside 1% + 1 MiB" in captured.err
