"""Plan files: read and write `.rir` text atomically."""
from __future__ import annotations

import os
import stat
import tempfile

from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.ir.syntax import RirSyntaxError
from remat_ir.ir.types import Program

__all__ = ["IMAGE_FORMATS", "image_format", "load_plan", "output_problem", "save_plan", "write_atomically"]

# What matplotlib's Agg, PDF, PS and SVG backends write (jpg, tif and webp
# through Pillow, which it requires), by extension; a fixed list, so that
# checking an output does not import matplotlib.  pgf is left out: it needs LaTeX.
IMAGE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")

# --------------------------------------------------------------- files


def load_plan(path: str | os.PathLike) -> Program:
    """Read and parse a `.rir` file."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as e:
        raise OSError(e.errno, f"cannot read plan {name}: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        start = e.start
        line = data.count(b"\n", 0, start) + 1
        col = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise RirSyntaxError(name, line, col, f"not UTF-8 text: byte 0x{data[start]:02x} cannot be "
                                              f"decoded; save the plan as UTF-8") from None
    return parse_program(text, name)


def load_cached(path) -> Program | None:
    """The plan in a cache file, or None when there is no such file or it
    cannot be read (said on stderr: a cache is planned again, never fatal)."""
    import sys

    if not os.path.isfile(path):
        return None
    try:
        return load_plan(path)
    except (OSError, ValueError) as e:
        print(f"remat-ir: ignoring the unreadable cached plan {path}: {e}", file=sys.stderr)
        return None


def save_plan(program: Program, path: str | os.PathLike) -> None:
    """Write `program` to `path` atomically: a temporary file in the same
    directory, fsync, rename.  On failure nothing is left behind and an
    existing file at `path` is untouched."""
    write_atomically(path, format_program(program).encode("utf-8"))


def output_problem(path: str | os.PathLike) -> str | None:
    """Why a new regular file cannot be put at `path`, or None when it can:
    `path` is a symbolic link (to anything: writing would replace the link),
    a directory, a device file, a FIFO or a socket, or its directory is
    missing.  What `write_atomically` refuses, and the CLI's output flags
    before any work."""
    name = os.fspath(path)
    try:
        st = os.lstat(name)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return e.strerror or str(e)
    if st is not None:
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            try:
                target = os.readlink(name)
            except OSError:
                target = "?"
            return f"it is a symbolic link (to {target}), which writing would replace; give a regular file's path"
        if stat.S_ISDIR(mode):
            return "it is a directory"
        if not stat.S_ISREG(mode):
            kind = ("a device file" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                    "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else
                    "a socket" if stat.S_ISSOCK(mode) else "no regular file")
            return f"it is {kind}, which writing would replace with a regular file"
    directory = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(directory):
        return f"no directory {directory}"
    return None


def image_format(path: str | os.PathLike) -> str:
    """The format a picture at `path` is written in: its extension, or png
    when it has none (as matplotlib does).  Not necessarily one of
    `IMAGE_FORMATS`: the CLI refuses the others before any work."""
    ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    return ext or "png"


def save_figure(fig, path: str | os.PathLike) -> None:
    """Write a matplotlib figure to `path` in the format its extension names,
    atomically (drawn in memory first), and close it."""
    import io

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=image_format(path))
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    write_atomically(path, buf.getvalue())


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory,
    fsync and rename: readers see the old file or the whole new one, never a
    half-written one, and a failure leaves nothing behind.  Refuses (OSError)
    a `path` that is anything but a regular file or nothing (`output_problem`):
    the rename would replace a symbolic link, a device file or a FIFO."""
    name = os.fspath(path)
    problem = output_problem(name)
    if problem is not None:
        raise OSError(f"cannot write {name}: {problem}")
    directory = os.path.dirname(os.path.abspath(name))
    try:
        mode = os.stat(name).st_mode & 0o7777
    except OSError:
        umask = os.umask(0o22)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(name) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)

