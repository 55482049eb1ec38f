"""Results of slow accounting searches kept on disk across processes (``fedmf calibrate`` run
twice, many ``fedmf simulate`` runs at one ε).

Where: ``$FEDMF_CACHE_DIR`` (empty: no disk cache), else ``$XDG_CACHE_HOME/fedmf``, else
``~/.cache/fedmf``. One small JSON file per entry, named by the SHA-256 of its key; the key holds
every input of the result, this format's version and the dp_accounting version, and is stored
in the file and compared on load. Writes are atomic; an unreadable, corrupt or mismatched entry
(or one that is a symbolic link, not a regular file, or over ``MAX_ENTRY_BYTES``) is ignored (and
overwritten by the next store), and a directory that cannot be written only means no caching. A
cached value is a hint, never trusted: the caller verifies it before use (``gaussian.calibrate``
checks that it meets the target and is minimal), so an edited file can never lower the noise (beyond
float rounding: the check's closed form and the search's dp_accounting curve differ by ~1e-13 in z).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["FORMAT_VERSION", "cache_dir", "load", "store"]

FORMAT_VERSION = 1
#: an entry is a few hundred bytes; a larger file is not one
MAX_ENTRY_BYTES = 64 * 1024


def cache_dir() -> Path | None:
    """The cache directory (not created here), or None when ``FEDMF_CACHE_DIR`` is set empty."""
    chosen = os.environ.get("FEDMF_CACHE_DIR")
    if chosen is not None:
        return Path(chosen) if chosen else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fedmf"


def _full_key(kind: str, key: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        dp_accounting = version("dp-accounting")
    except PackageNotFoundError:
        dp_accounting = "unknown"
    return {"format": FORMAT_VERSION, "kind": kind, "dp_accounting": dp_accounting, **key}


def _path(directory: Path, full: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode("utf-8")).hexdigest()
    return directory / f"{full['kind']}-{digest}.json"


def _read_entry(path: Path) -> str:
    """The entry's text: a regular file of at most ``MAX_ENTRY_BYTES``, opened without following a
    symbolic link and without blocking (a link to /dev/zero, a FIFO or a huge file planted in the
    directory is an ``OSError``, i.e. no entry, never a hang)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_ENTRY_BYTES:
            raise OSError(f"{path} is not a cache entry")
        data = os.read(fd, MAX_ENTRY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_ENTRY_BYTES:
        raise OSError(f"{path} is not a cache entry")
    return data.decode("utf-8")


def load(kind: str, key: dict[str, Any]) -> float | None:
    """The finite float stored under (``kind``, ``key``), or None (no entry, or one that is unreadable,
    corrupt or for other inputs)."""
    directory = cache_dir()
    if directory is None:
        return None
    full = _full_key(kind, key)
    try:
        entry = json.loads(_read_entry(_path(directory, full)))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != full:
        return None
    value = entry.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def store(kind: str, key: dict[str, Any], value: float) -> None:
    """Keep ``value`` under (``kind``, ``key``); silently nothing where the directory cannot be written."""
    from ..files import atomic_write

    directory = cache_dir()
    if directory is None:
        return
    full = _full_key(kind, key)
    text = json.dumps({"key": full, "value": float(value)}, sort_keys=True)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(_path(directory, full), lambda f: f.write(text), text=True, mode=0o600)
    except OSError:
        return
