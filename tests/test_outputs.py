"""Outputs never destroy files: every output flag of every command refuses,
before any work, a path that is a device file, FIFO, socket, symbolic link
or directory, or in a missing directory, one that is an input of the command
or another of its outputs, and an image extension matplotlib cannot write;
one line on stderr, exit 2, nothing written, the target unchanged."""
from __future__ import annotations

import os
import re
import socket
import stat

import pytest

from remat_ir.cli import bench
from remat_ir.cli.commands import compile_main, show_main
from remat_ir.ir.files import write_atomically

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = open(os.path.join(ROOT, "examples", "mlp_with_loss.py")).read()


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("outputs") / "p.rir"
    assert compile_main(["mlp", "--fake", "-o", str(path), "--quiet"]) == 0
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command loads a model, a plan or a bench context."""
    import remat_ir.ir.files as files
    import remat_ir.runtime.load as load

    def refuse(*a, **k):
        raise AssertionError("work was done before the outputs were checked")

    monkeypatch.setattr(load, "load_model", refuse)
    monkeypatch.setattr(files, "load_plan", refuse)
    monkeypatch.setattr(bench, "Context", refuse)


def _one_line(capsys, prog: str) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"{prog}: error:") and "\n" not in err and "Traceback" not in err, err
    return err


def _snapshot(tmp_path) -> dict:
    """Every entry of tmp_path: its kind, and a link's target or a file's bytes."""
    out = {}
    for name in sorted(os.listdir(tmp_path)):
        path = os.path.join(tmp_path, name)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            out[name] = ("link", os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            out[name] = ("file", open(path, "rb").read())
        else:
            out[name] = (stat.S_IFMT(st.st_mode), st.st_rdev)
    return out


def _device(path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 3))  # like /dev/null
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot create a device file here: {e}")


def _special_targets(tmp_path, kind: str) -> str:
    """Make tmp_path/out a `kind` of file; what the error says about it."""
    target = tmp_path / "out"
    if kind == "device":
        _device(target)
        says = "it is a device file"
    elif kind == "fifo":
        os.mkfifo(target)
        says = "it is a named pipe (FIFO)"
    elif kind == "link-to-fd":
        os.symlink("/proc/self/fd/1", target)
        says = "it is a symbolic link (to /proc/self/fd/1)"
    elif kind == "link-to-file":
        (tmp_path / "real.rir").write_text("keep me\n")
        os.symlink(tmp_path / "real.rir", target)
        says = "it is a symbolic link"
    elif kind == "dangling-link":
        os.symlink(tmp_path / "nothing", target)
        says = "it is a symbolic link"
    elif kind == "directory":
        target.mkdir()
        (target / "inside").write_text("x")
        says = "it is a directory"
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(str(target))
        finally:
            s.close()
        says = "it is a socket"
    else:
        raise AssertionError(kind)
    return says


KINDS = ["device", "fifo", "link-to-fd", "link-to-file", "dangling-link", "directory", "socket"]

COMMANDS = {
    "compile -o": ("remat-compile", lambda t, out: compile_main(["mlp", "--fake", "-o", out, "--quiet"])),
    "compile --pareto-png": ("remat-compile", lambda t, out: compile_main(
        ["mlp", "--fake", "-o", str(t / "p.rir"), "--pareto-png", out, "--quiet"])),
    "show --png": ("remat-show", lambda t, out: show_main([str(t / "any.rir"), "--png", out])),
    "bench --md": ("remat-bench", lambda t, out: bench.main(["--model", "mlp", "--md", out, "--quiet"])),
    "bench --json": ("remat-bench", lambda t, out: bench.main(["--model", "mlp", "--json", out, "--quiet"])),
    "bench --png": ("remat-bench", lambda t, out: bench.main(["--model", "mlp", "--png", out, "--quiet"])),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_output_that_is_no_regular_file_is_refused_first(tmp_path, capsys, no_work, command, kind):
    says = _special_targets(tmp_path, kind)
    before = _snapshot(tmp_path)
    prog, run = COMMANDS[command]
    out = str(tmp_path / "out")
    assert run(tmp_path, out) == 2
    err = _one_line(capsys, prog)
    assert f"cannot write {out}: {says}" in err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_output_in_a_missing_directory_is_refused_first(tmp_path, capsys, no_work, command):
    prog, run = COMMANDS[command]
    out = tmp_path / "nowhere" / "x.png"
    assert run(tmp_path, str(out)) == 2
    assert _one_line(capsys, prog) == f"{prog}: error: cannot write {out}: no directory {out.parent}"
    assert os.listdir(tmp_path) == []


def test_a_device_file_given_to_o_stays_a_device_file(tmp_path, capsys, no_work):
    # mknod mynull c 1 3; remat-compile mlp --fake -o mynull
    _device(tmp_path / "mynull")
    assert compile_main(["mlp", "--fake", "-o", str(tmp_path / "mynull"), "--quiet"]) == 2
    _one_line(capsys, "remat-compile")
    assert stat.S_ISCHR(os.lstat(tmp_path / "mynull").st_mode)


# ----------------------------------------------- outputs over inputs, or each other


def _model(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(MODEL)
    return src


def test_pareto_png_over_the_model_file(tmp_path, capsys, no_work):
    src = _model(tmp_path)
    before = _snapshot(tmp_path)
    assert compile_main([str(src), "-o", str(tmp_path / "p.rir"), "--pareto-png", str(src), "--quiet"]) == 2
    err = _one_line(capsys, "remat-compile")
    assert f"--pareto-png {src} is the model file itself" in err
    assert _snapshot(tmp_path) == before


def test_o_over_the_model_file_through_a_link_or_another_name(tmp_path, capsys, no_work):
    src = _model(tmp_path)
    os.link(src, tmp_path / "hard.py")
    os.symlink(src, tmp_path / "soft.py")
    before = _snapshot(tmp_path)
    for model, out in ((src, tmp_path / "hard.py"), (tmp_path / "soft.py", src),
                       (src, tmp_path / "." / "m.py")):
        assert compile_main([str(model), "-o", str(out), "--quiet"]) == 2
        err = _one_line(capsys, "remat-compile")
        assert f"-o {out} is the model file itself" in err, err
    assert _snapshot(tmp_path) == before


def test_pareto_png_equal_to_o(tmp_path, capsys, no_work):
    out = tmp_path / "p.png"
    assert compile_main(["mlp", "--fake", "-o", str(out), "--pareto-png", str(out), "--quiet"]) == 2
    err = _one_line(capsys, "remat-compile")
    assert f"--pareto-png {out} and -o {out} are the same file" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag", ["--md", "--json", "--png"])
def test_bench_output_over_the_model_file(tmp_path, capsys, no_work, flag):
    src = _model(tmp_path)
    before = _snapshot(tmp_path)
    assert bench.main(["--model", str(src), flag, str(src), "--quiet"]) == 2
    err = _one_line(capsys, "remat-bench")
    assert f"{flag} {src} is the model file itself" in err
    assert _snapshot(tmp_path) == before


def test_bench_outputs_that_are_one_file(tmp_path, capsys, no_work):
    out = tmp_path / "b.md"
    assert bench.main(["--model", "mlp", "--md", str(out), "--json", str(out), "--quiet"]) == 2
    assert f"--json {out} and --md {out} are the same file" in _one_line(capsys, "remat-bench")
    assert os.listdir(tmp_path) == []


def test_show_png_over_the_plan(plan, tmp_path, capsys, no_work):
    # remat-show p.png --png p.png
    shown = tmp_path / "p.png"
    shown.write_bytes(plan.read_bytes())
    before = _snapshot(tmp_path)
    assert show_main([str(shown), "--png", str(shown)]) == 2
    assert f"--png {shown} is the plan itself" in _one_line(capsys, "remat-show")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["x.rir", "model.py", "x.gif", "x.txt"])
def test_an_image_extension_matplotlib_cannot_write(plan, tmp_path, capsys, no_work, name):
    # remat-show p.rir --png x.rir died with "ValueError: Format 'rir' is not supported".
    out = tmp_path / name
    ext = name.rsplit(".", 1)[1]
    assert show_main([str(plan), "--png", str(out)]) == 2
    assert f"--png {out}: matplotlib cannot draw a .{ext} image" in _one_line(capsys, "remat-show")
    assert compile_main(["mlp", "--fake", "-o", str(tmp_path / "p.rir"), "--pareto-png", str(out)]) == 2
    assert f"--pareto-png {out}: matplotlib cannot draw a .{ext} image" in _one_line(capsys, "remat-compile")
    assert bench.main(["--model", "mlp", "--png", str(out), "--quiet"]) == 2
    assert f"--png {out}: matplotlib cannot draw a .{ext} image" in _one_line(capsys, "remat-bench")
    assert os.listdir(tmp_path) == []


def test_show_draws_in_the_format_its_extension_names(plan, tmp_path, capsys):
    for name, magic in (("t.svg", b"<?xml"), ("t.pdf", b"%PDF"), ("t", b"\x89PNG")):
        assert show_main([str(plan), "--png", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(magic), name
    capsys.readouterr()


# ------------------------------------------------------------ the writer itself


@pytest.mark.parametrize("kind", ["device", "fifo", "link-to-fd", "link-to-file", "directory"])
def test_the_atomic_writer_renames_over_regular_files_only(tmp_path, kind):
    says = _special_targets(tmp_path, kind)
    before = _snapshot(tmp_path)
    with pytest.raises(OSError, match=f"cannot write .*out: {re.escape(says)}"):
        write_atomically(tmp_path / "out", b"data")
    assert _snapshot(tmp_path) == before  # no temporary file left either
    write_atomically(tmp_path / "fine", b"data")
    assert (tmp_path / "fine").read_bytes() == b"data"
