"""tools/gpu_check.py end to end on CPU (--device cpu --small): plans compiled
under FakeTensorMode into a directory, then loaded and run."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gpu_check():
    return _load()


@pytest.fixture(scope="module")
def plans(gpu_check, tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    rc = gpu_check.main(["--compile-only", "--plans", str(d), "--device", "cpu", "--small", "--budgets", "0.7,0.5"])
    assert rc in (0, 1)  # 1: some budget has no plan (e.g. the optimizer is not available)
    return d


def test_compile_only_writes_plans(gpu_check, plans):
    files = sorted(p.name for p in plans.glob("*.rir"))
    assert gpu_check.plan_name("gpt2-tiny", 2, 64, "cpu", "plan") in files
    # Budgets without a plan are recorded with the reason (e.g. below the floor).
    missing = json.loads((plans / gpu_check.plan_name("gpt2-tiny", 2, 64, "cpu", "missing")
                          .replace(".rir", ".json")).read_text())
    for tag in ("0.7", "0.5", "floor"):
        assert (gpu_check.plan_name("gpt2-tiny", 2, 64, "cpu", tag) in files) != (tag in missing)
    from remat_ir.ir.files import load_plan

    for f in plans.glob("*.rir"):
        p = load_plan(f)
        assert p.header.optim == "adam" and p.header.optim_state_bytes > 0
        assert p.header.device == "cpu"


def test_small_run_from_plans(gpu_check, plans, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = gpu_check.main(["--device", "cpu", "--small", "--plans", str(plans), "--json", str(out),
                         "--budgets", "0.7,0.5"])
    text = capsys.readouterr()
    assert "loaded" in text.err
    assert "traced" not in text.err  # plans, and reasons for missing ones, came from the directory
    assert "solved" not in text.err
    js = json.loads(out.read_text())
    rows = {r["key"]: r for r in js["rows"]}
    for key in ("eager", "ckpt-all", "remat-plan"):
        assert rows[key]["status"] == "ok", rows[key]
    # The storage tracker on CPU measures exactly what the simulator predicts.
    assert rows["remat-plan"]["grad_diff"] == 0.0
    for r in js["rows"]:
        if r["status"] == "ok" and r.get("predicted_total") is not None:
            assert abs(r["measured_total"] - r["predicted_total"]) <= 0.01 * r["predicted_total"] + 2**20, r
            if r["key"] != "eager":
                assert r["grad_diff"] == 0.0, r
        else:
            assert r["status"] == "ok" or r["status"].startswith("n/a"), r
    assert rc == 0
    assert "| remat-ir, unoptimized plan |" in text.out


def test_plan_for_cuda_is_retargeted():
    from remat_ir import ir
    from remat_ir.cli.bench import retarget_device
    from remat_ir.trace.tracer import trace_builtin

    p = retarget_device(trace_builtin("gpt2-tiny", fake=True), "cuda")
    devs = {a.name for n in p.nodes for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, ir.Device)}
    assert devs == {"cuda"} and p.header.device == "cuda"


def test_bad_input(gpu_check, capsys):
    assert gpu_check.main(["--device", "cpu", "--small", "--budgets", "x"]) == 2
    assert gpu_check.main(["--compile-only", "--small"]) == 2
