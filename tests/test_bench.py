"""remat-bench on a tiny configuration: every method runs, the table, JSON
and the Pareto plot are written.  No timing assertions."""
from __future__ import annotations

import json

import pytest

from remat_ir.cli import bench
from remat_ir.cli.methods import method_specs, select
from remat_ir.runtime.run import matches


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    argv = ["--model", "gpt2-tiny", "--steps", "2", "--budgets", "0.5", "--quiet",
            "--methods", "ckpt,sac,compile-0.5,remat",
            "--md", str(d / "b.md"), "--json", str(d / "b.json"), "--png", str(d / "b.png")]
    rc = bench.main(argv)
    return rc, d


def test_runs_and_writes(result, capsys):
    rc, d = result
    assert rc == 0
    md = (d / "b.md").read_text()
    for label in ("eager PyTorch", "checkpoint every block", "checkpoint every 2nd block",
                  "SAC, save matmul outputs", "torch.compile aot_eager, budget 0.5",
                  "remat-ir, unoptimized plan", "remat-ir, budget 0.5", "remat-ir, floor"):
        assert f"| {label} |" in md, label
    assert (d / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_rows(result):
    _, d = result
    rows = {r["key"]: r for r in json.loads((d / "b.json").read_text())["rows"]}
    eager = rows["eager"]
    assert eager["status"] == "ok" and eager["act_peak"] > 0
    for key in ("ckpt-all", "ckpt-every2", "sac-matmul"):
        r = rows[key]
        assert r["status"] == "ok", r
        assert r["grads"] == "bitwise", r
        assert r["act_peak"] < eager["act_peak"]
        assert len(r["times"]) == 2
    # remat-ir's unoptimized plan is eager's schedule but for the fused
    # cross-entropy backward, which holds one logits-sized tensor (128 x 1024
    # f32) fewer at the peak and the 4-byte total weight it reads one op
    # longer; measured as predicted.
    plan = rows["remat-plan"]
    assert plan["status"] == "ok" and plan["grads"] == "bitwise"
    assert eager["act_peak"] - plan["act_peak"] == 128 * 1024 * 4 - 4
    assert matches(plan["predicted_act"], plan["act_peak"])
    for key in ("remat-0.5", "remat-floor"):
        r = rows[key]
        if r["status"] != "ok":
            assert r["status"].startswith("n/a"), r  # the optimizer may be unavailable, never a crash
            continue
        if "chunked_attention" in r["extra"]:  # (a matmul over fewer matrices: eager's bits not promised)
            assert r["grads"] == "bitwise" or r["grads"].startswith("within tolerance"), r
        else:
            assert r["grads"] == "bitwise", r
        assert matches(r["predicted_act"], r["act_peak"]), r
    c = rows["compile-0.5"]
    assert c["status"] == "ok" or c["status"].startswith(("n/a", "failed")), c


def test_methods_filter():
    specs = select(method_specs([0.7, 0.5]), "ckpt-all,remat-0")
    assert [s.key for s in specs] == ["eager", "ckpt-all", "remat-0.7", "remat-0.5"]
    with pytest.raises(ValueError):
        select(method_specs([0.5]), "nothing")


def test_bad_input(capsys):
    assert bench.main(["--methods", "bogus", "--model", "gpt2-tiny"]) == 2
    assert bench.main(["--model", "no-such-model"]) == 2
    assert "remat-bench: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_backend_rows(tmp_path):
    # remat-ir's torch.compile backend beside torch.compile's budgets: a plan
    # the region can meet (0.9) measured as predicted, bitwise; 0.3 of
    # gpt2-tiny at batch 2 only with its loss in row chunks, bitwise too; one
    # below the region's floor (0.02) is n/a with the floor, not a failure.
    js = tmp_path / "b.json"
    assert bench.main(["--model", "gpt2-tiny", "--steps", "1", "--budgets", "0.9,0.3,0.02", "--quiet",
                       "--methods", "backend", "--json", str(js), "--md", str(tmp_path / "b.md")]) == 0
    rows = {r["key"]: r for r in json.loads(js.read_text())["rows"]}
    for key in ("backend-0.9", "backend-0.3"):
        ok = rows[key]
        assert ok["status"] == "ok" and ok["grads"] == "bitwise", ok
        assert ok["act_peak"] < rows["eager"]["act_peak"]
        assert matches(ok["predicted_act"], ok["act_peak"]), ok
        assert "recomputed" in ok["extra"]
    assert rows["backend-0.3"]["act_peak"] < rows["backend-0.9"]["act_peak"]
    assert rows["backend-0.02"]["status"].startswith("n/a (infeasible: a region's floor is"), rows["backend-0.02"]
    assert "| remat-ir backend aot_eager, budget 0.9 |" in (tmp_path / "b.md").read_text()
    assert [s.key for s in select(method_specs([0.5]), "backend")] == ["eager", "backend-0.5"]


def test_offload_rows(tmp_path):
    # Below remat-ir's recompute-only floor (gpt2-tiny, 2 x 64: 0.27 of the
    # unoptimized activation peak) the plan with offload runs: bitwise, its
    # device and host peaks measured as predicted; torch's save_on_cpu beside
    # it (every saved tensor's copy counted in the host pool), bitwise too.
    js = tmp_path / "b.json"
    md = tmp_path / "b.md"
    assert bench.main(["--model", "gpt2-tiny", "--steps", "1", "--budgets", "0.27", "--quiet",
                       "--methods", "remat-0,offload,save-on-cpu", "--json", str(js), "--md", str(md)]) == 0
    rows = {r["key"]: r for r in json.loads(js.read_text())["rows"]}
    assert list(rows) == ["eager", "remat-0.27", "offload-0.27", "save-on-cpu"]
    assert rows["remat-0.27"]["status"].startswith("n/a (infeasible: below the floor"), rows["remat-0.27"]
    off = rows["offload-0.27"]
    assert off["status"] == "ok" and off["grads"] == "bitwise", off
    assert off["act_peak"] == off["predicted_act"], off
    assert off["host_peak"] == off["predicted_host"] > 0, off
    assert "offloaded" in off["extra"] and "nothing offloaded" not in off["extra"], off
    soc = rows["save-on-cpu"]
    assert soc["status"] == "ok" and soc["grads"] == "bitwise", soc
    assert soc["host_peak"] > 0 and soc["act_peak"] < rows["eager"]["act_peak"], soc
    text = md.read_text()
    assert "| remat-ir, budget 0.27, offload |" in text and "| torch save_on_cpu |" in text
    assert "host peak (predicted)" in text


def test_offload_methods_opt_in():
    keys = [s.key for s in select(method_specs([0.5]), None)]
    assert "save-on-cpu" not in keys and "offload-0.5" not in keys and "remat-0.5" in keys
    assert [s.key for s in select(method_specs([0.5]), "offload,save")] == [
        "eager", "offload-0.5", "save-on-cpu"]
