"""The round log: one JSON line per released round, appended only after the round's ledger commit.

``<run-dir>/rounds.jsonl`` (0600) keeps what each released round reported — the ``RoundRecord``
with its released metrics and those its driver added (server-side evaluation; the private client-metric
release's noisy-train-loss, never a value a client sent) — so that ``results.json`` and ``progress.png``
can be rebuilt for the whole run by any later process: a re-run, a resume after a kill, the other
backend's reader. A line holds the run id, the round, the SHA-256 of
the checkpoint the ledger's commit names, and the record; nothing in it is per user or secret, and it
is written only once the round may be released (``PrivateRun.released``).

Appends are single ``write`` calls of whole lines on a file opened ``O_APPEND``, then ``fsync``. A
crash mid-write can leave a torn last line: readers ignore it and the next append cuts it off first.
Readers keep only the lines of rounds the ledger committed, with the same run id and checkpoint hash
(a line of a rolled-back attempt or of another run is ignored), the last such line of each round.
A committed round whose line a stop cut off gets one on resume, marked ``"recovered"`` (what its
metrics are: ``fedmf.run.loop.recover_records``). A line past the ledger's last committed round
shows a rolled-back ledger: ``PrivateRun.open`` refuses to resume (``logged_rounds``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError

if TYPE_CHECKING:
    from .private_run import RoundRecord

__all__ = ["ROUND_LOG", "append_round", "read_rounds", "logged_rounds", "cut_torn_tail", "append_line"]

ROUND_LOG = "rounds.jsonl"


def append_line(path: Path, line: str, *, flags: int = 0) -> None:
    """Append ``line`` (ending in a newline) to the 0600 file ``path``, after cutting a torn last line,
    and fsync it (``flags``: more ``os.open`` flags, e.g. ``O_NOFOLLOW``); an ``OSError`` on failure."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | flags, 0o600)
    try:
        cut_torn_tail(fd)
        data = line.encode("utf-8")
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def cut_torn_tail(fd: int) -> None:
    """Truncate a last line that has no newline (a write a crash interrupted)."""
    size = os.lseek(fd, 0, os.SEEK_END)
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    keep, block = 0, 1 << 16
    end = size
    while end > 0:  # the last newline, reading backwards
        start = max(0, end - block)
        chunk = os.pread(fd, end - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            keep = start + cut + 1
            break
        end = start
    os.ftruncate(fd, keep)


def append_round(directory: str | os.PathLike, run_id: int, checkpoint_sha256: str, record: RoundRecord, *,
                 recovered: str | None = None) -> None:
    """Append committed round ``record`` of run ``run_id``, whose ledger commit names
    ``checkpoint_sha256``, to ``directory``'s round log (created 0600). ``recovered``: the record
    was written on a resume, not at the round's release (why, in words: the line's ``recovered``)."""
    entry = {"run_id": int(run_id), "round": int(record.round), "checkpoint_sha256": checkpoint_sha256,
             "record": asdict(record)}
    if recovered is not None:
        entry["recovered"] = recovered
    line = json.dumps(entry, sort_keys=True, allow_nan=True) + "\n"
    path = Path(directory) / ROUND_LOG
    try:
        append_line(path, line)
    except OSError as e:
        raise CheckpointError(f"cannot append round {record.round} to the round log {str(path)!r}: "
                              f"{e.strerror or e}") from None


def logged_rounds(directory: str | os.PathLike, run_id: int) -> dict[int, str]:
    """Round → the checkpoint hash its last well-formed line names, for every round of run ``run_id``
    the round log holds, whether or not a ledger committed it (``PrivateRun``'s rollback check: a line
    is written only after its round's commit). No log: {}."""
    found: dict[int, str] = {}
    for entry in _lines(Path(directory) / ROUND_LOG):
        t = entry.get("round")
        if entry.get("run_id") == run_id and isinstance(t, int) and isinstance(entry.get("checkpoint_sha256"), str):
            found[t] = entry["checkpoint_sha256"]
    return found


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointError(f"cannot read the round log {str(path)!r}: {e.strerror or e}") from None
    out = []
    for raw in data.split(b"\n")[:-1]:  # the part after the last newline is a torn line, if any
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def read_rounds(directory: str | os.PathLike, run_id: int, committed: Mapping[int, str]) -> dict[int, dict[str, Any]]:
    """Round → its logged record (a dict of ``RoundRecord`` fields) for the rounds of run ``run_id``
    that the ledger ``committed`` (round → the checkpoint hash its commit names); lines that do not
    parse, belong to another run or name another checkpoint are ignored. No log: {}."""
    found: dict[int, dict[str, Any]] = {}
    for entry in _lines(Path(directory) / ROUND_LOG):
        try:
            t, record = entry["round"], entry["record"]
            if (entry["run_id"] == run_id and isinstance(t, int) and committed.get(t) == entry["checkpoint_sha256"]
                    and isinstance(record, dict) and record.get("round") == t):
                found[t] = record
        except (ValueError, TypeError, KeyError):
            continue
    return found
