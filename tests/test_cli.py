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
    for key in ("predicted_peak_bytes", "measured_peak_bytes", "grads_match", "grads_bitwise", "loss_bitwise",
                "max_rel_grad_diff", "max_abs_grad_diff", "step_time_s", "eager_step_time_s"):
        assert key in data
    assert data["grads_match"] is True and data["grads_bitwise"] is True and data["loss_bitwise"] is True
    assert data["max_rel_grad_diff"] == 0.0 and data["max_abs_grad_diff"] == 0.0
    assert data["memory_within_tolerance"] is True


def test_exact_floor_chunks_the_loss_and_run_check_is_bitwise(tmp_path, capsys):
    """`--exact` plans below the loss's floor with the chunked loss (eager's
    bits), and `remat-run --check` finds every step bitwise, as predicted."""
    plan = tmp_path / "floor.rir"
    assert compile_main(["gpt2-tiny", "--budget", "floor", "--scope", "activations", "--exact", "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "graph rewrites: cross-entropy in chunks of 16 rows (remat.lm_head_nll)" in out
    assert "\nrewrites lm_head_nll:16" in plan.read_text()
    assert run_main([str(plan), "gpt2-tiny", "--steps", "2", "--check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["grads_bitwise"] is True and data["loss_bitwise"] is True and data["max_abs_grad_diff"] == 0.0
    assert 0 <= data["measured_peak_bytes"] - data["predicted_peak_bytes"] <= 4  # (a mean loss backward's scalar)


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


@pytest.mark.parametrize("where", ["import", "build"])
@pytest.mark.parametrize("call, shown", [("sys.exit(0)", "sys.exit(0)"), ("sys.exit()", "sys.exit()"),
                                         ("sys.exit(3)", "sys.exit(3)"), ("raise SystemExit('bye')",
                                                                         "sys.exit('bye')")])
def test_model_file_that_exits(tmp_path, capsys, where, call, shown):
    # sys.exit(0) in a model file ended remat-compile with 0, no plan and no word.
    body = open(os.path.join(ROOT, "examples", "mlp_with_loss.py")).read()
    if where == "import":
        body = "import sys\n" + call + "\n" + body
        says = f"importing the model file exited ({shown}); a model file must define build() and not exit"
    else:
        body += "\n_build = build\ndef build():\n    import sys\n    " + call + "\n"
        says = f"build() exited ({shown})"
    f = tmp_path / "m.py"
    f.write_text(body)
    out = tmp_path / "x.rir"
    assert compile_main([str(f), "-o", str(out), "--quiet"]) == 2
    err = _one_line_error(capsys, "remat-compile")
    assert f"{f}: {says}" in err, err
    assert not out.exists()


def test_model_file_that_exits_makes_the_command_exit_2(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import sys\nsys.exit(0)\n")
    code = "import sys; from remat_ir.cli.commands import compile_main; sys.exit(compile_main())"
    r = subprocess.run([sys.executable, "-c", code, str(f), "-o", str(tmp_path / "x.rir")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == [f"remat-compile: error: {f}: importing the model file exited "
                                             f"(sys.exit(0)); a model file must define build() and not exit"]
    assert not (tmp_path / "x.rir").exists()


def test_plan_for_another_model(tiny_plan, capsys):
    assert run_main([str(tiny_plan), "mlp", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "parameter" in err and "Traceback" not in err
    # remat-verify --model says so with the same exit code (it said 1, as for an unsound plan).
    assert verify_main([str(tiny_plan), "--model", "mlp"]) == 2
    assert "Traceback" not in capsys.readouterr().err


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
    # Only a scope other than the default says something a missing budget leaves unused.
    assert compile_main(["mlp", "-o", str(tmp_path / "p.rir"), "--scope", "total"]) == 2
    assert "--scope total says what --budget" in capsys.readouterr().err
    assert not (tmp_path / "p.rir").exists()
    assert compile_main(["mlp", "--fake", "-o", str(tmp_path / "p.rir"), "--scope", "activations", "--quiet"]) == 0
    assert "\nbudget " not in (tmp_path / "p.rir").read_text()


@pytest.mark.parametrize("autocast", ["cpu:float64", "cpu:float32"])
def test_compile_refuses_an_autocast_dtype_autocast_does_not_take(tmp_path, capsys, autocast):
    # torch.autocast on cpu disables itself for these: the plan was written, and no call could run it.
    assert compile_main(["mlp", "-o", str(tmp_path / "p.rir"), "--autocast", autocast]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("remat-compile: error: --autocast ") and "bfloat16 or float16" in err[0]
    assert not (tmp_path / "p.rir").exists()


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_run_refuses_steps_below_one(tiny_plan, capsys, steps):
    assert run_main([str(tiny_plan), "gpt2-tiny", "--steps", steps]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_run_exits_1_when_memory_is_outside_the_prediction(tiny_plan, tmp_path, capsys):
    # A plan whose parameters declare 64x their bytes: it predicts a peak the
    # run cannot meet.  Only a plan with no fingerprint (hand-written: not
    # checked against the graph) and no model check gets that far.
    text = tiny_plan.read_text()
    lines = []
    for ln in text.splitlines():
        words = ln.split()
        if len(words) > 4 and words[1] == "param" and words[3].isdigit() and words[4] == "bytes":
            ln = ln.replace(f" {words[3]} bytes", f" {int(words[3]) * 64} bytes", 1)
        if ln.startswith("fingerprint "):
            ln = 'fingerprint ""'
        lines.append(ln)
    bad = tmp_path / "big.rir"
    bad.write_text("\n".join(lines) + "\n")
    assert verify_main([str(bad)]) == 0
    capsys.readouterr()
    assert run_main([str(bad), "gpt2-tiny", "--steps", "1", "--no-model-check"]) == 1
    captured = capsys.readouterr()
    assert "OUTSIDE" in captured.out and "outside 1% + 1 MiB" in captured.err


# ------------------------------------------- bad input: one line, exit 2


def _model_file(tmp_path, name: str, body: str):
    f = tmp_path / f"{name}.py"
    f.write_text("import torch\n" + body)
    return f


def _one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{prog}: error:") and "\n" not in err and "Traceback" not in err, err
    return err


_TUPLE_MODEL = (
    "class M(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.lin = torch.nn.Linear(4, 4)\n"
    "    def forward(self, x):\n"
    "        y = self.lin(x)\n"
    "        return y, y.relu()\n"
    "def build():\n"
    "    torch.manual_seed(0)\n"
    "    return M(), (torch.randn(3, 4),)\n")


def test_tuple_output_without_loss_says_to_define_one(tmp_path, capsys):
    f = _model_file(tmp_path, "tup", _TUPLE_MODEL)
    out = tmp_path / "tup.rir"
    assert compile_main([str(f), "-o", str(out), "--quiet"]) == 2
    err = _one_line_error(capsys, "remat-compile")
    assert "returns a tuple of 2 tensors (f32[3,4], f32[3,4]) and defines no loss()" in err
    assert "define loss(output, *inputs) in the model file" in err and "return a scalar loss" in err
    assert not out.exists()


def test_run_refuses_a_plan_whose_step_is_no_scalar(tmp_path, capsys):
    # The API compiles such a model (a drop-in module whose loss is computed
    # outside); remat-run, which calls .backward() on the step, refuses it.
    import runpy

    import remat_ir

    f = _model_file(tmp_path, "tup", _TUPLE_MODEL)
    module, args = runpy.run_path(str(f))["build"]()
    plan = tmp_path / "tup.rir"
    remat_ir.save_plan(remat_ir.compile(module, args), str(plan))
    assert run_main([str(plan), str(f), "--steps", "1"]) == 2
    err = _one_line_error(capsys, "remat-run")
    assert "returns a tuple of 2 tensors" in err and "not a scalar loss" in err


def test_non_scalar_loss_is_refused_naming_its_shape(tmp_path, capsys):
    import torch

    import remat_ir
    from remat_ir.trace.tracer import TraceError

    f = _model_file(tmp_path, "vec", "def build():\n"
                                      "    return torch.nn.Linear(4, 4), (torch.randn(3, 4),)\n"
                                      "def loss(out, x):\n"
                                      "    return out.sum(0)\n")
    assert compile_main([str(f), "-o", str(tmp_path / "vec.rir"), "--quiet"]) == 2
    err = _one_line_error(capsys, "remat-compile")
    assert "loss() returned a tensor of shape [4] (4 elements); a loss must be one scalar tensor" in err
    with pytest.raises(TraceError, match=r"loss\(\) returned a tuple of 2 tensors"):
        remat_ir.compile(torch.nn.Linear(4, 4), (torch.randn(3, 4),), loss=lambda out, x: (out.sum(), out.mean()))


@pytest.mark.parametrize("budget, says", [
    ("1e400", "budget '1e400' is not a finite number of bytes"),
    ("99999999999999999999999999TiB", "is 1.1e+38 bytes, more than any memory (a budget is at most 2**63 - 1"),
    ("inf", "budget 'inf' is not a finite number: write bytes"),
    ("-1", "budget '-1' is not a positive amount of memory: write bytes"),
    ("0", "budget '0' is not a positive amount of memory"),
])
def test_budget_beyond_any_integer(tmp_path, capsys, budget, says):
    f = _model_file(tmp_path, "lin", "def build():\n"
                                      "    return torch.nn.Linear(4, 4), (torch.randn(3, 4),)\n"
                                      "def loss(out, x):\n"
                                      "    return out.square().mean()\n")
    assert compile_main([str(f), "-o", str(tmp_path / "p.rir"), "--budget", budget]) == 2
    err = _one_line_error(capsys, "remat-compile")
    assert err.startswith("remat-compile: error: --budget: ") and says in err


def test_budget_api_refuses_what_is_no_amount_of_memory():
    from remat_ir.pipeline import BudgetError, fit, trace

    net, args, loss = _small_net()
    program = trace(net, args, loss=loss)
    for budget in (float("inf"), float("nan"), 1e300, 10 ** 30, "1e400", "nan", "1e400%",
                   "99999999999999999999999999TiB", "9" * 30 + ".5"):
        with pytest.raises(BudgetError, match="budget"):
            fit(program, budget)


@pytest.mark.parametrize("flag", [["--time-limit", "-5"], ["--time-limit", "nan"], ["--time-limit=-inf"],
                                  ["--time-limit", "inf"], ["--time-limit", "0"], ["--time-limit", "-0"]])
def test_time_limit_must_be_positive_and_finite(tmp_path, capsys, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "x.rir"
    limit = float(flag[-1].split("=")[-1])
    assert compile_main(["mlp", "--fake", "-o", str(out), "--budget", "0.5", *flag]) == 2
    err = _one_line_error(capsys, "remat-compile")
    assert err == f"remat-compile: error: --time-limit must be a positive, finite number of seconds, not {limit:g}"
    assert list(tmp_path.iterdir()) == []
    from remat_ir.cli.bench import main as bench_main

    assert bench_main(["--model", "mlp", "--quiet", *flag]) == 2
    err = _one_line_error(capsys, "remat-bench")
    assert err == f"remat-bench: error: --time-limit must be a positive, finite number of seconds, not {limit:g}"


def test_time_limit_api_refuses_what_is_no_positive_finite_time(monkeypatch):
    import remat_ir
    from remat_ir import pipeline

    net, args, loss = _small_net()

    def work(*a, **k):
        raise AssertionError("a bad time limit got as far as the pipeline's work")

    for stage in ("trace", "_verified", "optimizer_settings"):
        monkeypatch.setattr(pipeline, stage, work)
    for limit in (-5, -5.0, 0, 0.0, float("nan"), float("inf"), float("-inf"), "60", None, True):
        for call in (lambda: remat_ir.wrap(net, budget=0.5, time_limit=limit),  # at construction
                     lambda: remat_ir.wrap(net, time_limit=limit),
                     lambda: remat_ir.compile(net, args, loss=loss, budget=0.5, time_limit=limit),
                     lambda: remat_ir.compile(net, args, loss=loss, time_limit=limit),
                     lambda: pipeline.fit(None, 0.5, time_limit=limit),
                     lambda: pipeline.budget_bytes(None, 0.5, time_limit=limit)):
            with pytest.raises(ValueError, match=r"^time_limit must be a positive, finite number of seconds, "
                                                 r"not " + repr(limit).replace("(", r"\(").replace(")", r"\)")):
                call()
    for limit in (0.5, 1, 300.0):
        remat_ir.wrap(net, budget=0.5, time_limit=limit)


def test_device_cuda_without_cuda_is_refused_first(tmp_path, capsys, monkeypatch):
    import torch

    import remat_ir.runtime.load as load

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(load, "load_model", no_load)
    assert compile_main(["mlp", "-o", str(tmp_path / "p.rir"), "--device", "cuda"]) == 2
    err = _one_line_error(capsys, "remat-compile")
    assert "--device cuda, but this machine has no CUDA device" in err and "use --device cpu" in err


@pytest.mark.parametrize("flags, says", [
    (["--batch", "-3"], "--batch -3: the batch size must be at least 1"),
    (["--batch", "0"], "--batch 0: the batch size must be at least 1"),
    (["--seq", "0"], "--seq 0: the sequence length must be at least 1"),
    (["--seq", "65"], "--seq 65 is longer than gpt2-tiny's block size, 64 positions: give --seq 64 or less"),
])
def test_batch_and_seq_out_of_range(tiny_plan, tmp_path, capsys, flags, says):
    assert compile_main(["gpt2-tiny", "-o", str(tmp_path / "p.rir"), "--quiet"] + flags) == 2
    assert says in _one_line_error(capsys, "remat-compile")
    assert run_main([str(tiny_plan), "gpt2-tiny", "--steps", "1"] + flags) == 2
    assert says in _one_line_error(capsys, "remat-run")


def test_flags_a_model_cannot_take(tmp_path, capsys):
    assert compile_main(["mlp", "-o", str(tmp_path / "p.rir"), "--seq", "8"]) == 2
    assert "--seq 8: mlp takes no sequence length; drop --seq" in _one_line_error(capsys, "remat-compile")
    f = _model_file(tmp_path, "tup", _TUPLE_MODEL)
    assert compile_main([str(f), "-o", str(tmp_path / "p.rir"), "--batch", "8"]) == 2
    assert "--batch 8, but build() takes no batch argument" in _one_line_error(capsys, "remat-compile")
    # A model file whose config states its positions (as transformers' GPT-2 does): under
    # fake tensors an embedding does not check its indices, so the trace alone would not fail.
    f = _model_file(tmp_path, "pos", "import types\n"
                                     "class M(torch.nn.Module):\n"
                                     "    config = types.SimpleNamespace(n_positions=16)\n"
                                     "    def __init__(self):\n"
                                     "        super().__init__()\n"
                                     "        self.wpe = torch.nn.Embedding(16, 4)\n"
                                     "    def forward(self, x):\n"
                                     "        return self.wpe(torch.arange(x.shape[1])).square().mean()\n"
                                     "def build(seq=8):\n"
                                     "    return M(), (torch.zeros(2, seq),)\n")
    assert compile_main([str(f), "-o", str(tmp_path / "p.rir"), "--seq", "17"]) == 2
    assert (f"{f}: --seq 17 is longer than the model's config.n_positions, 16 positions: give --seq 16 "
            "or less") in _one_line_error(capsys, "remat-compile")
    assert compile_main([str(f), "-o", str(tmp_path / "p.rir"), "--seq", "16", "--quiet"]) == 0


def _renamed(text: str, name: str, new: str) -> str:
    import re

    return re.sub(r"(?<![\w.:])" + re.escape(name) + r"(?![\w.:])", new, text)


def test_errors_echo_a_huge_token_cut_short(tiny_plan, tmp_path, capsys):
    huge = "n" * 2_000_000
    text = tiny_plan.read_text()
    # A parse error naming the token: a free of a value never declared.
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("free "))
    victim = lines[i].split()[1]
    lines[i] = "  free " + huge
    bad = tmp_path / "parse.rir"
    bad.write_text("\n".join(lines) + "\n")
    assert verify_main([str(bad)]) == 2
    err = _one_line_error(capsys, "remat-verify")
    assert len(err) < 400 and "free of unknown value `" + "n" * 60 + "...`" in err
    # A verifier error naming it: a value renamed to the huge name, its free gone (a leak).
    lines2 = _renamed(text, victim, huge).splitlines()
    lines2.remove(next(ln for ln in lines2 if ln.split("#")[0].split() == ["free", huge]))
    leak = tmp_path / "leak.rir"
    leak.write_text("\n".join(lines2) + "\n")
    assert verify_main([str(leak)]) == 1
    out = capsys.readouterr().out
    assert len(out) < 20_000 and "n" * 60 + "..." in out and huge not in out
    assert verify_main([str(leak), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["errors"] and all(len(e["message"]) <= 2000 for e in data["errors"])


# ------------------------------------------- remat-run --check compares honestly


def test_check_gives_eager_and_the_plan_their_own_inputs(tmp_path, capsys):
    # The model doubles its input in place: sharing one input tensor, the plan
    # would see the input eager already doubled and "differ".
    f = _model_file(tmp_path, "inplace", "class M(torch.nn.Module):\n"
                                          "    def __init__(self):\n"
                                          "        super().__init__()\n"
                                          "        self.lin = torch.nn.Linear(4, 4)\n"
                                          "    def forward(self, x):\n"
                                          "        x.mul_(2)\n"
                                          "        return self.lin(x).square().mean()\n"
                                          "def build():\n"
                                          "    torch.manual_seed(0)\n"
                                          "    return M(), (torch.randn(3, 4),)\n")
    plan = tmp_path / "inplace.rir"
    assert compile_main([str(f), "-o", str(plan), "--quiet"]) == 0
    assert run_main([str(plan), str(f), "--steps", "3", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.count("loss equal, gradients bitwise equal") == 3
    assert "gradients: bitwise equal to eager" in out


_NO_PARAMS = ("class M(torch.nn.Module):\n"
              "    def forward(self, x, w):\n"
              "        return (x @ w).tanh().square().mean()\n"
              "def build():\n"
              "    torch.manual_seed(0)\n"
              "    return M(), (torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True))\n")


def test_check_compares_input_gradients(tmp_path, capsys):
    import runpy

    from remat_ir.ir.parser import parse_program
    from remat_ir.ir.printer import format_program
    from remat_ir.runtime.load import LoadedModel
    from remat_ir.runtime.run import check_gradients

    f = _model_file(tmp_path, "noparams", _NO_PARAMS)
    plan = tmp_path / "noparams.rir"
    assert compile_main([str(f), "-o", str(plan), "--quiet"]) == 0
    assert run_main([str(plan), str(f), "--steps", "3", "--check"]) == 0
    assert capsys.readouterr().out.count("gradients bitwise equal") == 3
    # A plan whose backward is off by a factor: only the inputs' gradients show it.
    # (With the fingerprint blanked: a fingerprinted plan with an edited graph
    # is refused before it runs, and the comparison itself is under test here.)
    text = "\n".join('fingerprint ""' if ln.startswith("fingerprint ") else ln
                     for ln in plan.read_text().split("\n"))
    assert text.count("aten.mul.Scalar(d.pow, 2.0)") == 1
    wrong = parse_program(text.replace("aten.mul.Scalar(d.pow, 2.0)",
                                                          "aten.mul.Scalar(d.pow, 3.0)"), "wrong.rir")
    module, args = runpy.run_path(str(f))["build"]()
    checks = check_gradients(wrong, LoadedModel("noparams", module, args, None), steps=3, check_model=False)
    assert not any(c.grads_equal for c in checks) and all(c.loss_equal for c in checks)
    assert all(c.worst.startswith("input ") and c.max_abs_grad_diff > 0 for c in checks)
    assert format_program(wrong)  # still a readable plan: only the numbers are off


def test_compile_says_an_eval_model_is_traced_in_train_mode(tmp_path, capsys):
    f = _model_file(tmp_path, "ev", "def build():\n"
                                    "    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1))\n"
                                    "    return m.eval(), (torch.randn(3, 4),)\n"
                                    "def loss(out, x):\n"
                                    "    return out.square().mean()\n")
    assert compile_main([str(f), "-o", str(tmp_path / "ev.rir")]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "train mode" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: traced in train mode (the model was in eval mode)")
    f.write_text(f.read_text().replace("m.eval()", "m"))
    assert compile_main([str(f), "-o", str(tmp_path / "ev.rir")]) == 0
    assert "train mode" not in capsys.readouterr().out
    f.write_text(f.read_text().replace("return m,", "m[1].eval()\n    return m,"))
    assert compile_main([str(f), "-o", str(tmp_path / "ev.rir")]) == 0
    assert "note: traced in train mode (submodule 1 was in eval mode)" in capsys.readouterr().out


def _edited_plan(tmp_path, plan, old: str, new: str):
    """`plan` with one op's constant changed (fingerprint blanked: a
    fingerprinted plan with an edited graph is refused before it runs)."""
    text = "\n".join('fingerprint ""' if ln.startswith("fingerprint ") else ln
                     for ln in plan.read_text().split("\n"))
    assert text.count(old) == 1
    out = tmp_path / f"edited{len(list(tmp_path.glob('edited*')))}.rir"
    out.write_text(text.replace(old, new))
    return out


def test_check_accepts_rounding_within_tolerance_and_says_bitwise_or_not(tmp_path, capsys):
    f = _model_file(tmp_path, "noparams", _NO_PARAMS)
    plan = tmp_path / "noparams.rir"
    assert compile_main([str(f), "-o", str(plan), "--quiet"]) == 0
    # 2.0000002 is 2 * (1 + 2**-23) in float32: the gradients move by float32's
    # rounding, as a reordered sum would move them.
    near = _edited_plan(tmp_path, plan, "aten.mul.Scalar(d.pow, 2.0)", "aten.mul.Scalar(d.pow, 2.0000002)")
    args = ["--steps", "2", "--check", "--no-model-check"]
    assert run_main([str(near), str(f), *args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["grads_match"] is True and data["grads_bitwise"] is False and data["loss_bitwise"] is True
    assert 0.0 < data["max_rel_grad_diff"] < 1e-6 and data["max_abs_grad_diff"] > 0.0
    assert run_main([str(near), str(f), *args]) == 0
    out = capsys.readouterr().out
    assert out.count("loss equal, gradients within tolerance (max relative difference ") == 2
    assert "gradients: within tolerance (max relative difference " in out
    assert "tolerance: relative 0.0001, 0.01 for float16/bfloat16" in out

    wrong = _edited_plan(tmp_path, plan, "aten.mul.Scalar(d.pow, 2.0)", "aten.mul.Scalar(d.pow, 3.0)")
    assert run_main([str(wrong), str(f), *args, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["grads_match"] is False and data["grads_bitwise"] is False and data["loss_bitwise"] is True
    assert data["max_rel_grad_diff"] == pytest.approx(0.5, rel=1e-5)  # 3/2 of eager's gradient
    assert run_main([str(wrong), str(f), *args]) == 1
    out = capsys.readouterr().out
    assert out.count("loss equal, gradients DIFFER (relative difference 0.5 at input ") == 2
    assert "gradients: DIFFER from eager beyond the tolerance (relative difference 0.5 at input " in out


def test_gradient_tolerance_by_dtype():
    import torch

    from remat_ir.runtime.run import (GRAD_RTOL, GRAD_RTOL_LOW_PRECISION, _close, grad_tolerance,
                                      relative_difference)

    assert GRAD_RTOL == 1e-4 and GRAD_RTOL_LOW_PRECISION == 1e-2
    assert grad_tolerance(torch.float32) == grad_tolerance(torch.float64) == GRAD_RTOL
    assert grad_tolerance(torch.float16) == grad_tolerance(torch.bfloat16) == GRAD_RTOL_LOW_PRECISION
    assert grad_tolerance(torch.int64) == 0.0
    want = torch.tensor([4.0, -2.0, 0.0])
    # relative to the tensor's largest entry, not entry by entry: the 0.0 may move
    assert relative_difference(want + torch.tensor([0.0, 0.0, 4e-5]), want) == pytest.approx(1e-5)
    assert _close(want.clone(), want) == (True, True, 0.0)
    assert _close(want * (1 + 1e-5), want)[:2] == (False, True)
    assert _close(want * (1 + 1e-3), want)[:2] == (False, False)
    assert _close(want.half() * (1 + 2e-3), want.half())[:2] == (False, True)
    assert _close(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))[:2] == (False, False)
    assert _close(torch.tensor([3]), torch.tensor([2]))[:2] == (False, False)  # integer state: exact
    assert relative_difference(torch.zeros(2), torch.zeros(3)) == float("inf")
    assert relative_difference(torch.zeros(0), torch.zeros(0)) == 0.0


def test_cnn_builtin_takes_no_seq(tmp_path, capsys):
    assert compile_main(["resnet-mini", "-o", str(tmp_path / "r.rir"), "--seq", "4"]) == 2
    assert "resnet-mini takes no sequence length" in capsys.readouterr().err


def test_verbose_says_where_the_optimizers_time_went(tmp_path, capsys):
    out = tmp_path / "mlp.rir"
    assert compile_main(["mlp", "-o", str(out), "--budget", "0.8", "-v"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("traced in "))
    assert "optimized in " in lines[summary] and "(budget " in lines[summary]
    assert lines[summary + 1] == "where the optimizer's time went:"
    assert lines[summary + 2].startswith("  search of the graph: ")
    assert any(line.startswith("  ") and " flat (MILP) solves: " in line for line in lines[summary + 2:])
    assert compile_main(["mlp", "-o", str(tmp_path / "again.rir"), "--budget", "0.8"]) == 0
    assert "where the optimizer's time went" not in capsys.readouterr().out


def test_max_shape_refuses_an_unknown_name_and_sizes_that_are_none(tmp_path, monkeypatch):
    # Both were ignored: the plan's range, and the budget's fraction of its peak, silently another.
    import torch

    import remat_ir

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    net, (x,), loss = _small_net()
    for shape, says in (({"input": (-1, 8)}, r"max_shape\['input'\] = \(-1, 8\): each size is a positive int"),
                        ({"input": (0,)}, "not 0"), ({"input": ("8",)}, "not '8'"), ({"input": 8}, "maps an input")):
        with pytest.raises(ValueError, match=says):
            remat_ir.wrap(net, loss=loss, max_shape=shape)
    with pytest.raises(ValueError, match="with dynamic=False"):
        remat_ir.wrap(net, loss=loss, max_shape={"input": (256, None)}, dynamic=False)
    wrapped = remat_ir.wrap(net, loss=loss, max_shape={"nope": (256, None)})
    with pytest.raises(ValueError, match="max_shape names 'nope', which this call passes no tensor as "
                                         r"\(it passes 'input'\)"):
        wrapped(x)
    wrapped = remat_ir.wrap(net, loss=loss, max_shape={"input": (256, 8, 1)})
    with pytest.raises(ValueError, match=r"max_shape\['input'\] has 3 sizes, but input has 2 dimensions"):
        wrapped(x)
    wrapped = remat_ir.wrap(net, loss=loss, max_shape={"input": (256, None)})
    wrapped(x).backward()
    assert torch.is_tensor(net[0].weight.grad)


@pytest.mark.parametrize("budgets, says", [("0.5,abc", "--budgets 0.5,abc: 'abc' is no number"),
                                           ("0.5,2", "--budgets 0.5,2: 2 is not a fraction in (0, 1]"),
                                           (",", "--budgets names no budget")])
def test_bench_budgets_that_cannot_be_read_name_the_flag(capsys, budgets, says):
    from remat_ir.cli.commands import bench_main

    assert bench_main(["--model", "mlp", "--budgets", budgets, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"remat-bench: error: {says}" + err[0].split(says, 1)[1]] and len(err) == 1, err


def test_an_output_named_dash_is_refused(tmp_path, capsys, monkeypatch):
    # It wrote a file named `-`; standard output carries the command's report.
    monkeypatch.chdir(tmp_path)
    assert compile_main(["mlp", "-o", "-", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["remat-compile: error: -o -: write to a file; standard output is where the command prints its "
                   "report"]
    assert not (tmp_path / "-").exists()
