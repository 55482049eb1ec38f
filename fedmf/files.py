"""Atomic file writes: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[Any]], object], *, text: bool,
                 mode: int | None = None) -> None:
    """Call ``write(f)`` on a temporary file beside ``path`` (text with newline="" or binary),
    give it ``mode`` (default: the umask's permissions), fsync it, rename it over ``path`` and
    fsync the directory, so that after a crash or power loss the old or the whole new file is
    there; on any error remove it."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        with os.fdopen(fd, "w" if text else "wb", **({"newline": ""} if text else {})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
