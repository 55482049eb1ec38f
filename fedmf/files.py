"""Atomic file writes (a reader sees the old file or the whole new one, never a part), the
checks that a run's directories and files, and every directory and link on the way to them, are
private to the user running the server, and the lock that keeps a run directory to one server."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .errors import ConfigError

__all__ = ["atomic_write", "check_private", "check_private_path", "lock_directory", "LOCK_FILE"]

#: the lock file in a run directory, held (flock) by the server using it
LOCK_FILE = "run.lock"
#: symbolic links followed at most on the way to one path (Linux's limit, MAXSYMLINKS)
_MAX_LINKS = 40


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries durable (after a file in it was created or renamed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_private_path(path: str | os.PathLike, what: str, error: Callable[[str], Exception] = ConfigError) -> None:
    """Raise ``error(one line)`` unless every directory and symbolic link on the way to ``path``
    is safe from other users: each directory traversed (``/`` first, then each component, and
    through each link to its target, as the kernel resolves the path) and each link is owned by
    this process's user or root, and no traversed directory is writable by group or others
    unless it has the sticky bit (as ``/tmp``: others cannot rename or remove what they do not
    own in it). Otherwise another local user could swap the file, or a link to it, under the
    server. ``path`` itself, once resolved, is the caller's to check (``check_private``, or an
    ``fstat`` of what it opened); components that do not exist yet end the walk (the caller
    creates them, in a directory that passed)."""
    shown = str(os.fspath(path))
    me = os.geteuid()

    def refuse(reason: str) -> None:
        raise error(f"{what} {shown!r} cannot be trusted: {reason}; another user could replace it")

    def check_directory(directory: str) -> None:
        try:
            info = os.stat(directory)
        except OSError as e:
            raise error(f"{what} {shown!r}: the directory {directory!r} on its path: {e.strerror or e}") from None
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid not in (me, 0):
            refuse(f"the directory {directory!r} on its path is owned by uid {info.st_uid}, neither the user "
                   f"running fedmf (uid {me}) nor root")
        if mode & 0o022 and not mode & stat.S_ISVTX:
            refuse(f"{directory!r} on its path is a directory writable by group or others without the sticky bit "
                   f"(mode {mode:04o}; chmod go-w it)")

    pending = [part for part in os.path.join(os.getcwd(), os.fspath(path)).split("/") if part]
    current, links = "/", 0
    check_directory(current)
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":  # the parent of a directory reached (and checked) on the way
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR) and not os.path.lexists(candidate):
                return  # does not exist yet: created by the caller inside ``current``, which passed
            raise error(f"{what} {shown!r}: {candidate!r} on its path: {e.strerror or e}") from None
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise error(f"{what} {shown!r}: too many levels of symbolic links")
            if info.st_uid not in (me, 0):
                refuse(f"the symbolic link {candidate!r} on its path is owned by uid {info.st_uid}, neither the user "
                       f"running fedmf (uid {me}) nor root")
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = "/"
            pending[:0] = [part for part in target.split("/") if part]
            continue
        current = candidate
        if pending and stat.S_ISDIR(info.st_mode):  # a directory the path goes through
            check_directory(current)


def check_private(path: str | os.PathLike, what: str, error: Callable[[str], Exception], *,
                  others_may_read: bool = False) -> None:
    """Raise ``error(one line)`` unless ``path`` is owned by this process's user and neither group
    nor others may write it (nor read it, unless ``others_may_read``): another user who can write
    a run directory, its ``secrets/`` or the ledger can replace the secrets, checkpoints or
    history under the server."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as e:
        dangling = " (a symbolic link to nothing)" if path.is_symlink() and not path.exists() else ""
        raise error(f"{what} {str(path)!r} cannot be used: {e.strerror or e}{dangling}") from None
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid():
        raise error(f"{what} {str(path)!r} is owned by uid {info.st_uid}, not by the user running fedmf (uid "
                    f"{os.geteuid()}): chown it, and consider what it holds tampered with")
    if mode & (0o022 if others_may_read else 0o077):
        fix = "chmod go-w" if others_may_read else "chmod 700" if path.is_dir() else "chmod 600"
        whom = "writable" if others_may_read else "readable or writable"
        raise error(f"{what} {str(path)!r} has mode {mode:o}; it must not be {whom} by group or others ({fix} it)")


def lock_directory(directory: str | os.PathLike, error: Callable[[str], Exception]) -> int:
    """Hold an exclusive lock on the run ``directory`` (``flock`` on its ``run.lock``) and return
    the lock's file descriptor (``os.close`` it to release it; the OS releases it when the process
    dies, so a crashed server's directory can be resumed). A directory another server holds:
    ``error(one line)``. Two servers on one directory would both write round files and noise
    files of attempts the ledger refuses."""
    path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise error(f"cannot open the lock file {str(path)!r}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise error(f"run directory {str(Path(directory))!r} is in use by another process (a server running on "
                    "it): stop that one first; one directory, one server") from None
    return fd


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
