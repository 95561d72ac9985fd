"""The files a command writes, checked before it does any work.

Every output flag of every command (`remat-compile -o` and `--pareto-png`,
`remat-show --png`, `remat-bench --md`, `--json` and `--png`) goes through
`check_outputs`, which refuses (CliError, exit 2, one line):

* a path that is no regular file or nothing: a symbolic link (to anything),
  a directory, a device file, a FIFO, a socket (`remat_ir.ir.files.output_problem`;
  the atomic writer refuses them too), or whose directory is missing;
* an output that is one of the command's inputs (the model file, the plan),
  or another of its outputs, naming both;
* an image whose extension matplotlib cannot write (a fixed list, so that
  checking does not import matplotlib), and an image when matplotlib is not
  installed.

Outputs are written through `remat_ir.ir.files.write_atomically` (images are
drawn into memory first, in the format their extension names: `image_format`).
"""
from __future__ import annotations

import os
from typing import Iterable

from remat_ir.cli.errors import CliError
from remat_ir.ir.files import IMAGE_FORMATS, image_format, output_problem


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def model_file(spec: str | None) -> str | None:
    """The MODEL argument's file, when `remat_ir.runtime.load.load_model`
    reads it as one (not a built-in name)."""
    if spec is None:
        return None
    if spec.endswith(".py") or "/" in spec or os.path.isfile(spec):
        return spec
    return None


def check_outputs(outputs: Iterable[tuple[str, str | None]], inputs: Iterable[tuple[str, str | None]] = (),
                  images: Iterable[str] = ()) -> None:
    """Refuse (CliError) outputs that cannot be written, or whose writing
    would destroy a file the command reads or writes.  `outputs` are (flag,
    path) pairs, `inputs` (what, path) pairs (`("the model file", "m.py")`);
    pairs whose path is None are left out.  `images` names the flags whose
    file is a picture."""
    outputs = [(flag, path) for flag, path in outputs if path is not None]
    inputs = [(what, path) for what, path in inputs if path is not None]
    images = set(images)
    seen: list[tuple[str, str]] = []
    for flag, path in outputs:
        if path == "-":
            # (Standard output carries the command's own report: a file named `-` was written instead.)
            raise CliError(f"{flag} -: write to a file; standard output is where the command prints its report")
        problem = output_problem(path)
        if problem is not None:
            raise CliError(f"cannot write {path}: {problem}")
        for what, src in inputs:
            if _same(path, src):
                also = "" if os.path.abspath(path) == os.path.abspath(src) else f" ({src})"
                raise CliError(f"{flag} {path} is {what} itself{also}, which writing would destroy; "
                               f"write to another path")
        for other_flag, other in seen:
            if _same(path, other):
                raise CliError(f"{flag} {path} and {other_flag} {other} are the same file; give each "
                               f"output its own path")
        seen.append((flag, path))
        if flag in images:
            fmt = image_format(path)
            if fmt not in IMAGE_FORMATS:
                raise CliError(f"{flag} {path}: matplotlib cannot draw a .{fmt} image; give a file ending in "
                               f"{', '.join('.' + f for f in IMAGE_FORMATS)}")
    if any(flag in images for flag, _ in outputs):
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            flags = " and ".join(sorted({flag for flag, _ in outputs if flag in images}))
            raise CliError(f"{flags} draws with matplotlib: pip install matplotlib")
