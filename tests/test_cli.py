"""The command line, end to end, and what it says to bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from remat_ir.cli import compile_main, run_main, verify_main

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


def test_runtime_path_does_not_import_cvxpy(tiny_plan):
    code = (
        "import sys, torch\n"
        "import remat_ir\n"
        "from remat_ir.load import load_model\n"
        f"plan = remat_ir.load_plan({str(tiny_plan)!r})\n"
        "m = load_model('gpt2-tiny')\n"
        "w = remat_ir.wrap(m.module, plan)\n"
        "w(*m.inputs).backward()\n"
        "assert 'cvxpy' not in sys.modules, 'cvxpy imported on the runtime path'\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout
