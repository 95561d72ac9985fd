"""remat-compile --pareto: a budget sweep from the unoptimized peak to the floor."""
from __future__ import annotations

import pytest

from remat_ir.cli.commands import compile_main
from remat_ir.runtime.load import load_model
from remat_ir.optimize.search import floor, unoptimized_peak
from remat_ir.optimize.pareto import (
    FLOOR, OPTIMIZED, UNOPTIMIZED, Row, budgets, format_table, plot, sweep, table_header,
)
from remat_ir.trace.tracer import trace_module
from remat_ir.check.verify import verify

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def mlp_program():
    m = load_model("mlp", fake=True)
    return trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=m.name, fake=True)


@pytest.fixture(scope="module")
def rows(mlp_program):
    return sweep(mlp_program, "activations", points=4)


def test_budgets_span_top_to_floor():
    assert budgets(100, 40, 4) == [100, 80, 60, 40]
    assert budgets(100, 40, 2) == [100, 40]
    assert budgets(10, 8, 8) == [10, 9, 8]  # fewer distinct bytes than points
    assert budgets(50, 50, 8) == [50]
    with pytest.raises(ValueError, match="at least 2"):
        budgets(100, 40, 1)


def test_sweep_rows_fit_their_budgets(mlp_program, rows):
    top = unoptimized_peak(mlp_program, "activations")
    low = floor(mlp_program, scope="activations").predicted_peak
    assert [r.budget for r in rows] == sorted((r.budget for r in rows), reverse=True)
    assert rows[0].budget == top and rows[0].fraction == 1.0
    assert rows[0].status == UNOPTIMIZED and rows[0].extra == 0.0 and rows[0].overhead == 0.0
    assert rows[-1].budget == low and rows[-1].status == FLOOR and rows[-1].peak == low
    assert all(r.status in (OPTIMIZED, UNOPTIMIZED) for r in rows[1:-1])
    for r in rows:
        assert r.peak is not None and r.peak <= r.budget
        assert 0.0 <= r.overhead and r.base > 0
        assert r.program.header.budget.bytes == r.budget
    # Lowering the budget below the unoptimized peak costs something.
    assert rows[-1].extra > 0
    assert verify(rows[-1].program).ok


def test_table_lists_every_budget(mlp_program, rows):
    t = format_table(rows, table_header(mlp_program, "activations"))
    lines = t.splitlines()
    assert "activation peak vs extra compute (FLOPs)" in lines[0]
    assert lines[1].split()[:2] == ["budget", "bytes"]
    assert len(lines) == 2 + len(rows)
    for r, line in zip(rows, lines[2:]):
        assert str(r.budget) in line and r.status in line
    assert "100.0%" in lines[2] and "+0.00%" in lines[2]


def test_plot_writes_a_png_atomically(rows, tmp_path):
    out = tmp_path / "sweep.png"
    plot(rows, out, title="mlp", scope="activations")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.png"]  # no temporary left behind
    with pytest.raises(ValueError, match="nothing to plot"):
        plot([Row(10, 1.0, None, 0.0, 0.0, 0.0, "infeasible")], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_cli_pareto_writes_table_png_and_unoptimized_plan(tmp_path, capsys):
    out = tmp_path / "mlp.rir"
    assert compile_main(["mlp", "--fake", "-o", str(out), "--pareto", "--pareto-points", "3",
                         "--scope", "activations"]) == 0
    text = capsys.readouterr().out
    assert "pareto sweep of mlp" in text
    assert "unoptimized" in text and "floor" in text
    png = tmp_path / "mlp.pareto.png"
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {png}" in text
    plan = out.read_text()
    assert "\nbudget " not in plan and "recompute " not in plan  # no --budget: the unoptimized plan


def test_cli_pareto_with_budget_writes_that_plan(tmp_path, capsys):
    out = tmp_path / "p.rir"
    png = tmp_path / "sweep.png"
    assert compile_main(["mlp", "--fake", "-o", str(out), "--pareto-png", str(png), "--pareto-points", "2",
                         "--scope", "activations", "--budget", "0.9"]) == 0
    text = capsys.readouterr().out
    assert "pareto sweep" in text and "FLOPs" in text.splitlines()[-1]
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "bytes activations" in out.read_text()


@pytest.mark.parametrize("argv, message", [
    (["--pareto", "--pareto-points", "1"], "--pareto-points must be at least 2"),
    (["--pareto-png", "no/such/dir/x.png"], "no directory"),
    (["--budget", "lots"], "--budget: cannot read budget"),
    (["--cost", "profile"], "--cost profile"),
    (["--pareto", "--solver", "NOSUCH"], "--solver NOSUCH is not installed"),
])
def test_cli_refuses_bad_flags_before_writing(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "x.rir"
    assert compile_main(["mlp", "--fake", "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
