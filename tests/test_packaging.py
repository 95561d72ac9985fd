"""A non-editable install works: a wheel of the repository, installed into a
fresh virtual environment, compiles a plan for a budget and verifies it from
a directory outside the source tree.

The editable install the tests run from maps `remat_ir` onto the source tree,
so it cannot catch a package (or the grammar) missing from the wheel: this
test builds the wheel from a copy of the packaging inputs (the repository's
own tree is not written to), installs it with `--no-deps` into a new venv
that sees the current environment's dependencies (torch, cvxpy, msgspec)
through a `.pth` line but not its `remat_ir`, and runs the installed console
scripts there.  Nothing is downloaded: the build uses the setuptools already
installed (`--no-build-isolation`, `--no-index`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the build reads: the metadata, the readme it names, the package list,
# the package and the grammar (package-dir maps remat_ir.grammar there).
INPUTS = ("pyproject.toml", "setup.py", "README.md", "remat_ir", "grammar")


def _run(argv, cwd, env, timeout=300):
    r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (f"{' '.join(map(str, argv))} exited {r.returncode}\n"
                               f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}")
    return r


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONNOUSERSITE="1",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def test_wheel_installs_and_compiles_outside_the_source_tree(tmp_path):
    try:
        import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        pytest.importorskip("wheel", reason="building a wheel offline needs setuptools >= 70.1 or wheel")
    env = _clean_env()

    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)

    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", wheels, src], cwd=tmp_path, env=env)
    (wheel,) = wheels.glob("remat_ir-*.whl")

    # The wheel goes in before the .pth line exists, so pip sees an empty
    # environment (not the editable remat_ir of the current one).
    venv_dir = tmp_path / "venv"
    venv.create(venv_dir, with_pip=False, system_site_packages=False, symlinks=os.name != "nt")
    bindir = venv_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         cwd=tmp_path, env=env)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path, env=env).stdout.strip())
    assert (site / "remat_ir" / "__init__.py").is_file()
    # The dependencies, from the current environment: a plain path line, so
    # that environment's own .pth files (its editable remat_ir finder) do not run.
    (site / "_remat_ir_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "work"  # not the repository: its remat_ir/ must not be importable
    work.mkdir()
    probe = ("import importlib.resources, remat_ir, remat_ir.rewrite\n"
             "from remat_ir.ir.parser import grammar_text\n"
             "assert 'start' in grammar_text()\n"
             "print(remat_ir.__file__)\n"
             "print(importlib.resources.files('remat_ir.grammar') / 'rir.lark')\n")
    mod_file, lark = (Path(line) for line in _run([python, "-c", probe], cwd=work, env=env).stdout.split("\n")[:2])
    assert mod_file.resolve().is_relative_to(site.resolve()), mod_file
    assert lark.resolve().is_relative_to(site.resolve()) and lark.is_file(), lark

    # A budget runs the optimizer and its graph rewrites (remat_ir.rewrite).
    exe = ".exe" if os.name == "nt" else ""
    _run([bindir / f"remat-compile{exe}", "mlp", "--fake", "-o", "p.rir", "--budget", "0.9", "--scope", "activations",
          "--quiet"], cwd=work, env=env)
    assert "budget" in (work / "p.rir").read_text()
    r = _run([bindir / f"remat-verify{exe}", "p.rir"], cwd=work, env=env)
    assert "sound" in r.stdout
