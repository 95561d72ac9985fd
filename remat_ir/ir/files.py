"""Plan files: read and write `.rir` text atomically."""
from __future__ import annotations

import os
import tempfile

from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.ir.syntax import RirSyntaxError
from remat_ir.ir.types import Program

__all__ = ["load_plan", "save_plan", "write_atomically"]

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


def save_plan(program: Program, path: str | os.PathLike) -> None:
    """Write `program` to `path` atomically: a temporary file in the same
    directory, fsync, rename.  On failure nothing is left behind and an
    existing file at `path` is untouched."""
    write_atomically(path, format_program(program).encode("utf-8"))


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory,
    fsync and rename: readers see the old file or the whole new one, never a
    half-written one, and a failure leaves nothing behind."""
    name = os.fspath(path)
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

