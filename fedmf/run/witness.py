"""The release witness: an append-only record, outside the run directory and the ledger, of the
rounds a run committed, so that a rollback of both stores together is refused.

When a run is created, after its ledger row and before its run.json (so before anything of it can be
released), the server writes the file's first line, the genesis line ``{"v": 1, "run_id",
"genesis_sha256", "round": -1, "chain_sha256": genesis_sha256}`` (``Witness.begin``). After round t's
ledger commit and before anything of round t is released, it appends one line ``{"v": 1, "run_id",
"genesis_sha256", "round": t, "chain_sha256": the ledger's chain head at round t}``. Each line is
fsynced (and the directory when the file is new). A resume whose ledger has committed fewer rounds
than the witness recorded, or whose chain head at the witness's last round is another one, or whose
witness file is missing or empty, is refused (``fedmf.run.rollback.check_witness``): the stores were
restored from a backup or rewritten (or the run row edited, which renames the file), and resuming
would release rounds again. A file written before the genesis line existed (rounds ≥ 0 only) is read
as it is.

A crash between the ledger commit and the append leaves the witness one round behind (at round −1
after round 0's commit): that round was never released, so a resume may go on; it records the
ledger's last round in the witness first (``Witness.append``), before releasing anything.

The file is ``<directory>/<key>``: ``directory`` is the ``witness`` setting (a path on other storage
in a deployment), by default ``$XDG_STATE_HOME/fedmf/witness`` or ``~/.local/state/fedmf/witness``;
``key`` is derived from the run's ledger genesis hash and run id (``witness_key``: public values, no
secret). The file is 0600 and opened without following a symbolic link; it and its directory must be
owned by the user running the server and not writable by group or others.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..files import check_private, check_private_path, fsync_dir
from .round_log import append_line

__all__ = ["Witness", "WitnessEntry", "witness_key", "default_witness_directory", "WITNESS_OFF",
           "GENESIS_ROUND"]

#: the round of the genesis line, written when the run is created (its head: the ledger's genesis hash)
GENESIS_ROUND = -1
#: the ``witness`` setting that turns the witness off (tests of the layers below it only: unsafe)
WITNESS_OFF = "off"
_FORMAT = 1  # in every line and in the file's name (witness_key): a genesis line keeps it, as old files are read
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class WitnessEntry:
    """One recorded round: its number and the ledger's chain head at it (``GENESIS_ROUND``: the genesis hash)."""

    round: int
    chain_sha256: str


def witness_key(genesis_sha256: str, run_id: int) -> str:
    """The witness file's name for a run: 32 hex digits of SHA-256 over its genesis hash and id."""
    return hashlib.sha256(f"fedmf-witness/v{_FORMAT}\0{genesis_sha256}\0{int(run_id)}".encode()).hexdigest()[:32]


def default_witness_directory() -> Path:
    """``$XDG_STATE_HOME/fedmf/witness`` (an absolute XDG_STATE_HOME), else ``~/.local/state/fedmf/witness``."""
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "fedmf" / "witness"


class Witness:
    """The witness file of one run (``open``), its last entry (``last``) and ``append``."""

    def __init__(self, path: Path, run_id: int, genesis_sha256: str, entries: list[WitnessEntry]) -> None:
        self.path, self.run_id, self.genesis = path, int(run_id), genesis_sha256
        self._last = max(entries, key=lambda e: e.round, default=None)
        self._by_round = {e.round: e for e in entries}

    @staticmethod
    def directory(directory: str | os.PathLike | None) -> Path:
        """The witness directory ``directory`` (None: ``default_witness_directory()``), created 0700
        if missing and checked: owned by this user, not writable by group or others, not a symbolic
        link, and every directory and link on the way to it safe from other users
        (``fedmf.files.check_private_path``) (``CheckpointError``, one line)."""
        where = Path(directory) if directory is not None else default_witness_directory()
        # the directories on the way to it: one another user may write could rename it away (a fresh,
        # empty witness would then be made and every rollback accepted)
        check_private_path(where, "release witness directory", CheckpointError)
        try:
            missing = []
            for parent in (where, *where.parents):
                if parent.exists() or parent.is_symlink():
                    break
                missing.append(parent)
            for made in reversed(missing):  # each one 0700 whatever the umask (mkdir(parents=True) is not)
                made.mkdir(mode=0o700, exist_ok=True)
                os.chmod(made, 0o700)
        except OSError as e:
            raise CheckpointError(f"cannot create the release witness directory {str(where)!r}: "
                                  f"{e.strerror or e}") from None
        if where.is_symlink():
            raise CheckpointError(f"the release witness directory {str(where)!r} is a symbolic link: give the "
                                  "directory itself")
        check_private(where, "release witness directory", CheckpointError, others_may_read=True)
        return where

    @classmethod
    def open(cls, directory: str | os.PathLike | None, *, run_id: int, genesis_sha256: str) -> Witness:
        """The witness of run ``run_id`` (its ledger genesis ``genesis_sha256``) in ``directory``
        (``Witness.directory``); its file is read (absent: no entry). A directory or file another
        user owns or may write, a symbolic link, or a file holding another run's entries:
        ``CheckpointError`` (one line)."""
        path = cls.directory(directory) / witness_key(genesis_sha256, run_id)
        return cls(path, run_id, genesis_sha256, cls._read(path, run_id, genesis_sha256))

    @staticmethod
    def _read(path: Path, run_id: int, genesis: str) -> list[WitnessEntry]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise CheckpointError(f"cannot read the release witness {str(path)!r}: {e.strerror or e} "
                                  "(a symbolic link is refused)") from None
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077 or not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"the release witness {str(path)!r} must be a regular file of mode 600 owned "
                                      f"by uid {os.geteuid()} (it has mode {stat.S_IMODE(info.st_mode):o}, uid "
                                      f"{info.st_uid}): consider it tampered with")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        entries = []
        for raw in b"".join(chunks).split(b"\n")[:-1]:  # after the last newline: a torn line, if any
            try:
                entry = json.loads(raw)
                t, head = entry["round"], entry["chain_sha256"]
                ok = entry["v"] == _FORMAT and isinstance(t, int) and t >= GENESIS_ROUND and _HEX64.match(head)
            except (ValueError, TypeError, KeyError):
                ok = False
            if not ok:
                raise CheckpointError(f"the release witness {str(path)!r} holds a line that is not a witness entry: "
                                      "consider it tampered with")
            if entry.get("run_id") != run_id or entry.get("genesis_sha256") != genesis:
                raise CheckpointError(f"the release witness {str(path)!r} holds entries of another run: consider "
                                      "it tampered with")
            if t == GENESIS_ROUND and head != genesis:
                raise CheckpointError(f"the release witness {str(path)!r} holds a genesis line whose hash is not the "
                                      "run's ledger genesis: consider it tampered with")
            entries.append(WitnessEntry(t, head))
        return entries

    def begin(self) -> None:
        """Write the genesis line of a run being created (before anything of it can be released):
        refused when the file already records a round (a bug, or another run's file)."""
        self.append(GENESIS_ROUND, self.genesis)

    def last(self) -> WitnessEntry | None:
        """The entry of the highest round recorded (``GENESIS_ROUND``: the genesis line only; None: none)."""
        return self._last

    def at(self, t: int) -> WitnessEntry | None:
        """The entry recorded for round t, if any."""
        return self._by_round.get(t)

    def append(self, t: int, chain_sha256: str) -> None:
        """Record round t with the ledger's chain head at it: one line, fsynced (the directory too
        when the file is new). Recording a round at or below the last one is refused (a bug), unless
        it repeats an entry exactly (a no-op)."""
        if self._last is not None and t <= self._last.round:
            same = self._by_round.get(t)
            if same is not None and same.chain_sha256 == chain_sha256:
                return
            raise CheckpointError(f"the release witness {str(self.path)!r} already records round "
                                  f"{self._last.round}: round {t} cannot be recorded after it")
        line = json.dumps({"v": _FORMAT, "run_id": self.run_id, "genesis_sha256": self.genesis, "round": int(t),
                           "chain_sha256": chain_sha256}, sort_keys=True) + "\n"
        created = not os.path.lexists(self.path)
        try:
            append_line(self.path, line, flags=os.O_NOFOLLOW | os.O_CLOEXEC)
            if created:
                fsync_dir(self.path.parent)
        except OSError as e:
            raise CheckpointError(f"cannot record round {t} in the release witness {str(self.path)!r}: "
                                  f"{e.strerror or e}") from None
        entry = WitnessEntry(int(t), chain_sha256)
        self._last, self._by_round[entry.round] = entry, entry
