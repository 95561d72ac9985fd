"""remat-show: the text summary, the PNG timeline, and bad input."""
from __future__ import annotations

import pytest

from remat_ir.ir import Budget, Instr, node_inputs
from remat_ir.cli.show import main
from remat_ir.check.simulate import simulate
from remat_ir.ir.printer import format_program
from remat_ir.pipeline import trace_builtin
from remat_ir.check.verify import verify


def _add_recomputes(p):
    """Free forward values early and recompute them in backward, where that
    is simple (no views, inputs still live): a plan with recomputes without
    needing the optimizer."""
    values, nodes = p.value_map(), p.node_map()
    viewed = {v.storage for v in p.values if v.storage != v.name}
    kept = {o.value for o in p.outputs}
    count = 0
    for n in [n for n in p.nodes if n.phase == "forward"]:
        outs = [o for o in n.outputs if o]
        if n.random or n.mutates or len(outs) != 1:
            continue
        o = outs[0]
        v = values[o]
        if v.storage != o or o in viewed or o in kept or not v.nbytes:
            continue
        reads = lambda ins: ins.kind != "free" and o in node_inputs(nodes[ins.target])  # noqa: E731
        fwd = [i for i, ins in enumerate(p.forward) if reads(ins)]
        bwd = [i for i, ins in enumerate(p.backward) if reads(ins)]
        if not bwd:
            continue
        ok = True
        for x in node_inputs(n):
            if values[x].kind in ("param", "buffer", "input"):
                continue
            frees = [i for i, ins in enumerate(p.backward) if ins.kind == "free" and ins.target == x]
            if any(ins.kind == "free" and ins.target == x for ins in p.forward) or not frees or frees[0] < bwd[0]:
                ok = False
                break
        if not ok:
            continue
        ci = next(i for i, ins in enumerate(p.forward) if ins.kind == "compute" and ins.target == n.name)
        p.forward.insert((fwd[-1] if fwd else ci) + 1, Instr("free", o))
        p.backward.insert(bwd[0], Instr("recompute", n.name))
        count += 1
    return count


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    p = trace_builtin("gpt2-tiny")
    assert _add_recomputes(p) >= 1
    rep = simulate(p)
    p.header.budget = Budget(int(rep.activation_peak_bytes * 1.1), "activations")
    assert verify(p).ok
    path = tmp_path_factory.mktemp("show") / "tiny.rir"
    path.write_text(format_program(p))
    return path


def test_text_summary(plan_file, capsys):
    assert main([str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "predicted peak, steady state" in out
    assert "at line " in out  # where the peak occurs, as a line of the .rir
    assert "largest step tensors live at the peak" in out
    assert "recomputed ops: " in out and "of the step's" in out
    assert "budget (activations)" in out


def test_text_first_step(plan_file, capsys):
    assert main([str(plan_file), "--first-step"]) == 0
    assert "first step (no .grad)" in capsys.readouterr().out


def test_png(plan_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert main([str(plan_file), "--png", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "wrote" in capsys.readouterr().out


def test_missing_file(tmp_path, capsys):
    assert main([str(tmp_path / "nope.rir")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat-show: error:") and "\n" not in err


def test_garbage_file(tmp_path, capsys):
    bad = tmp_path / "bad.rir"
    bad.write_text("this is not a plan\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat-show: error:") and "\n" not in err
    assert "Traceback" not in err


def test_binary_file(tmp_path, capsys):
    bad = tmp_path / "bin.rir"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert main([str(bad), "--png", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def test_png_into_a_missing_directory_is_refused_first(tmp_path, capsys, monkeypatch):
    import remat_ir.ir.files as files

    def no_load(*a, **k):  # refused before the plan is even read
        raise AssertionError("the plan was loaded")

    monkeypatch.setattr(files, "load_plan", no_load)
    png = tmp_path / "nowhere" / "t.png"
    assert main([str(tmp_path / "any.rir"), "--png", str(png)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"remat-show: error: cannot write {png}: no directory {png.parent}"


def test_output_into_a_closed_pipe_exits_quietly(plan_file, tmp_path, capsys):
    # `remat-show plan | head -1`: head exits after one line; the rest of the
    # output meets a closed pipe.  No traceback, no "Exception ignored" at
    # exit.  A value the summary names is renamed to a long name, so the
    # output overflows the pipe whatever the timing.
    import re
    import subprocess
    import sys

    assert main([str(plan_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    k = out.index("largest step tensors live at the peak (parameters and other state excluded):")
    name = out[k + 1].split()[2]
    big = tmp_path / "big.rir"
    big.write_text(re.sub(r"(?<![\w.:])" + re.escape(name) + r"(?![\w.:])", "v" * 300_000,
                          plan_file.read_text()))
    assert main([str(big)]) == 0
    assert len(capsys.readouterr().out) > 300_000
    cmd = f"{sys.executable} -m remat_ir.cli.show {big} | head -1"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert r.stdout.startswith("plan: model gpt2-tiny") and r.stdout.count("\n") == 1
    assert r.stderr == "", r.stderr
    assert r.returncode == 141  # as a command killed by SIGPIPE


# ------------------------------------------------------------ symbolic plans

SYMBOLIC_PLAN = __import__("os").path.join(__import__("os").path.dirname(__file__), "plans", "mlp-batch.rir")


def test_symbolic_plan_is_shown_at_the_high_end_or_the_sizes_asked(capsys):
    assert main([SYMBOLIC_PLAN]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sizes: at B=8, the high end of the plan's range (B=2..8); choose other sizes with --size")
    assert "256 B  h f32[8,8]" in out
    for size in (["--size", "B=3"], ["--size=B=3"]):
        assert main([SYMBOLIC_PLAN, *size]) == 0
        out = capsys.readouterr().out
        assert out.startswith("sizes: at B=3 (the plan covers B=2..8)") and "96 B  h f32[3,8]" in out


@pytest.mark.parametrize("size,words", [
    ("B=9", "--size: B=9 is outside the plan's range B=2..8"),
    ("T=3", "--size T=3: the plan has no size symbol T (its symbols: B)"),
    ("B", "--size 'B': expected SYMBOL=N, like T=96"),
    ("B=x", "--size 'B=x': expected SYMBOL=N"),
])
def test_symbolic_sizes_outside_the_plan_are_refused(size, words, capsys):
    assert main([SYMBOLIC_PLAN, "--size", size]) == 2
    assert words in capsys.readouterr().err


def test_verify_says_a_symbolic_plan_is_verified_over_its_range(capsys):
    from remat_ir.cli.commands import verify_main

    assert verify_main([SYMBOLIC_PLAN]) == 0
    out = capsys.readouterr().out
    assert "memory at the high end of the range (B=8):" in out
    assert out.rstrip().endswith("sound over its range B=2..8 (its size expressions at every size, in full at B=2 and at B=8)")
