"""Checkpoints and secrets: the durable half of the atomic end of a round.

The end of round t is one step (ARCHITECTURE.md, "One round, as data flows"):

  1. ``CheckpointStore.save(t, state)`` writes {round, plan fingerprint, model, optimizer,
     privatizer (noise state), scheduler, RNG states} to a temporary file, fsyncs it and renames
     it into place; it returns the file's SHA-256;
  2. the ledger commits round t naming that hash — the commit is the point of no return;
  3. only then may anything derived from round t's noise leave the process (broadcast,
     evaluation, metrics, logs), and the checkpoints of earlier rounds are pruned.

After a crash the run resumes from the checkpoint of the last *committed* round (its hash must
match the ledger's); a checkpoint written for an uncommitted round is ignored and that round
is redone (nothing of it was released) with fresh noise: the noise state holds the salts of the
committed rounds only (fedmf.round.noise).

A checkpoint does not copy what can be regenerated from the seed (past Gaussian draws are
counter-based) and writes each noise tensor that no longer changes once: the noise state's
tensors labeled with the round that produced them (``structure_rounds``) live in files of
their own, written in the round that produced them and referenced, with their hash, by later
checkpoints. A noise file is named by its content (``noise-NAME-rROUND-HASH16.pt``) and only
referenced with the hash of the tensor in memory, so a file another attempt at that round wrote
(its noise never released) is never picked up, and one changed on disk is refused. A round
therefore writes the model, the optimizer state, one new noise tensor (banded C) or the few
that change every round (BLT buffers), not the whole noise history.

Secrets (noise seed, scheduler key, ledger HMAC secret) live in files of mode 0600 under
``<directory>/secrets``; they are never in a checkpoint, the ledger or a log. A run binds its
noise seed to itself: a random binding id is appended to the ``noise_seed`` file (and recorded
in ``run.json``) before the seed's first use, so a copy of the file carries it and a new run
refuses a seed that is already bound (``fedmf.run.private_run``). The checkpoints
themselves are confidential too — a banded C's past noise outputs and the scheduler's record of
who was sampled are in them — so the directory must be 0700 and every file is written 0600.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import secrets as _secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import checks
from ..errors import CheckpointError
from ..files import check_private, check_private_path, fsync_dir

__all__ = ["CheckpointStore", "load_or_create_secret", "RunSecrets", "BINDING_BYTES", "noise_file_rounds"]

_FORMAT = 1
#: the noise seed file's binding to its run: this many random bytes after the seed
BINDING_BYTES = 16
_NAME = re.compile(r"^round-(\d{6,})\.pt$")
_TENSOR_NAME = re.compile(r"^noise-([a-z_]+)-r(\d{6,})(-[0-9a-f]{16})?\.pt$")


def noise_file_rounds(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """(round, file name) of every noise tensor file in ``directory``: the round that produced it."""
    return sorted((int(m.group(2)), p.name) for p in Path(directory).iterdir() if (m := _TENSOR_NAME.match(p.name)))


def _atomic_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {e.strerror or e}") from None
    fsync_dir(path.parent)


def _serialize(obj: Any) -> bytes:
    import torch  # here, not at the top: the secrets' readers (fedmf budget) need no torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _deserialize(data: bytes, where: str) -> Any:
    return checks.load_tensors(io.BytesIO(data), f"checkpoint {where}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- secrets -------------------------------------------------------------------------------
def load_or_create_secret(path: str | os.PathLike, nbytes: int = 32, *, bindable: bool = False) -> bytes:
    """The secret in ``path``, created from the OS's secure source (mode 0600) if absent.
    A file readable by group or others is refused: the secret may have leaked. ``bindable``:
    the file may also hold a binding (``BINDING_BYTES`` after the secret), returned with it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise CheckpointError(f"cannot create the directory of secret file {str(path)!r}: {e.strerror or e}") from None
    check_private_path(path, "secret file", CheckpointError)  # every directory and link on the way to it
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise CheckpointError(f"secret file {str(path)!r} has mode {mode:o}; it must be 600 (chmod 600 it, "
                                  "and consider the secret leaked)") from None
        check_private(path, "secret file", CheckpointError)
        data = path.read_bytes()
        if len(data) != nbytes and not (bindable and len(data) == nbytes + BINDING_BYTES):
            raise CheckpointError(f"secret file {str(path)!r} is damaged (expected {nbytes} bytes)") from None
        return data
    except OSError as e:
        raise CheckpointError(f"cannot create secret file {str(path)!r}: {e.strerror or e}") from None
    data = _secrets.token_bytes(nbytes)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return data


class RunSecrets:
    """The run's three secrets, each in its own 0600 file under ``directory``;
    ``noise_seed_binding``: the run the noise seed is bound to (None: not bound yet)."""

    def __reduce__(self):  # it holds a secret: never pickled (save state_dict() instead)
        checks.refuse_pickle(self)

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            check_private(directory, "secrets directory", CheckpointError)
            check_private_path(directory, "secrets directory", CheckpointError)  # and the way to it
        except OSError as e:
            raise CheckpointError(f"cannot create secrets directory {str(directory)!r}: {e.strerror or e}") from None
        self._noise_seed_file = directory / "noise_seed"
        seed = load_or_create_secret(self._noise_seed_file, bindable=True)
        self.noise_seed, self.noise_seed_binding = seed[:32], (seed[32:] or None)
        self.schedule_key = load_or_create_secret(directory / "schedule_key")
        self.ledger_secret = load_or_create_secret(directory / "ledger_secret")

    def bind_noise_seed(self) -> str:
        """Bind the noise seed to a new run: append a new random binding id to its file
        (atomically, 0600); returns the id in hex."""
        binding = _secrets.token_bytes(BINDING_BYTES)
        _atomic_bytes(self._noise_seed_file, self.noise_seed + binding)
        self.noise_seed_binding = binding
        return binding.hex()

    def __repr__(self) -> str:  # never shows a secret
        return "RunSecrets(<3 secrets>)"


# ---- checkpoints ---------------------------------------------------------------------------
class CheckpointStore:
    """Round checkpoints in ``directory`` (``round-NNNNNN.pt`` plus shared noise tensor files)."""

    def __init__(self, directory: str | os.PathLike, *, clean: bool = True) -> None:
        """``clean``: remove the temporary files a killed process left (False: call
        ``clean()`` once the directory is locked, ``fedmf.files.lock_directory``)."""
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            # checkpoints hold noise tensors and who was sampled: as secret as the seed
            check_private(self.directory, "run directory", CheckpointError)
            check_private_path(self.directory, "run directory", CheckpointError)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint directory {str(directory)!r}: {e.strerror or e}") from None
        if clean:
            self.clean()
        self.last_bytes = 0

    def clean(self) -> None:
        """Remove half-written files of a process that was killed (never while another one runs)."""
        for stale in self.directory.glob(".*.tmp"):
            stale.unlink(missing_ok=True)

    def path(self, t: int) -> Path:
        """Round t's checkpoint file; t = -1 is the initial state (before round 0)."""
        return self.directory / ("initial.pt" if t == -1 else f"round-{t:06d}.pt")

    def rounds(self) -> list[int]:
        """Rounds that have a checkpoint file, ascending."""
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def save(self, t: int, state: Mapping[str, Any]) -> str:
        """Write round t's checkpoint (the state after round t); returns its SHA-256 (hex)."""
        state = dict(state)
        written = 0
        if "privatizer" in state:
            state["privatizer"], written = self._externalize(t, state["privatizer"])
        data = _serialize({"format": _FORMAT, "round": t, "state": state})
        _atomic_bytes(self.path(t), data)
        self.last_bytes = written + len(data)
        self._saved = (t, {ref["file"] for ref in self._references(state.get("privatizer", {}))})
        return _sha256(data)

    def load(self, t: int, sha256: str | None) -> dict[str, Any]:
        """Round t's checkpoint, verified against ``sha256`` (the hash the ledger committed)."""
        path = self.path(t)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint for round {t} in {str(self.directory)!r}") from None
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {e.strerror or e}") from None
        if sha256 is not None and _sha256(data) != sha256:
            raise CheckpointError(f"checkpoint {str(path)!r} does not match the hash the ledger committed for round {t}")
        document = _deserialize(data, repr(str(path)))
        checks.state_format(document, f"checkpoint {str(path)!r}", _FORMAT)
        if document.get("round") != t:
            raise CheckpointError(f"{str(path)!r} is not a fedmf checkpoint of round {t}")
        state = dict(document["state"])
        if "privatizer" in state:
            state["privatizer"] = self._internalize(state["privatizer"])
        return state

    def prune(self, keep: int) -> None:
        """Remove every checkpoint but round ``keep``'s, and the noise files it does not use."""
        used: set[str] = set()
        keep_path = self.path(keep)
        saved = getattr(self, "_saved", None)
        if saved is not None and saved[0] == keep:
            used = set(saved[1])
        elif keep_path.exists():
            document = _deserialize(keep_path.read_bytes(), repr(str(keep_path)))
            for ref in self._references(document["state"].get("privatizer", {})):
                used.add(ref["file"])
        for p in self.directory.iterdir():
            if (_NAME.match(p.name) and p != keep_path) or (_TENSOR_NAME.match(p.name) and p.name not in used):
                p.unlink(missing_ok=True)

    # ---- noise tensors written once ---------------------------------------------------
    def _externalize(self, t: int, privatizer: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        privatizer = dict(privatizer)
        noise = dict(privatizer["noise"])
        labels = noise.get("structure_rounds", {})
        structure, written = {}, 0
        known = self._known_noise()
        for name, tensors in noise.get("structure", {}).items():
            rounds = labels.get(name, [None] * len(tensors))
            kept = []
            for tensor, label in zip(tensors, rounds):
                if label is None:
                    kept.append(tensor)
                    continue
                data = None
                digest = known.get((name, int(label))) if label < t else None
                if digest is None:  # produced this round (or a redo of it), or not known yet
                    data = _serialize(tensor.detach().cpu().contiguous())
                    digest = _sha256(data)
                # named by its content: a file another attempt at that round wrote is never picked up
                file = f"noise-{name}-r{int(label):06d}-{digest[:16]}.pt"
                path = self.directory / file
                if not path.exists():
                    if data is None:
                        data = _serialize(tensor.detach().cpu().contiguous())
                    _atomic_bytes(path, data)
                    written += len(data)
                elif self._digest(path) != digest:
                    raise CheckpointError(f"checkpoint noise file {file!r} does not hold this run's noise of round "
                                          f"{int(label)} (changed on disk?): refusing to reference it")
                known[(name, int(label))] = digest
                kept.append({"file": file, "sha256": digest})
            structure[name] = kept
        noise["structure"] = structure
        privatizer["noise"] = noise
        return privatizer, written

    def _known_noise(self) -> dict[tuple[str, int], str]:
        """(tensor name, round) → SHA-256 of the bytes of the noise tensor in memory, for the
        tensors this store wrote or read (verified) itself: written once, they never change."""
        return self.__dict__.setdefault("_known", {})

    def _digest(self, path: Path) -> str:
        cache = self.__dict__.setdefault("_digests", {})
        stamp = path.stat()
        key = (path.name, stamp.st_size, stamp.st_mtime_ns)
        if key not in cache:
            cache[key] = _sha256(path.read_bytes())
        return cache[key]

    def _internalize(self, privatizer: Mapping[str, Any]) -> dict[str, Any]:
        privatizer = dict(privatizer)
        noise = dict(privatizer["noise"])
        import torch

        structure, known = {}, self._known_noise()
        labels = noise.get("structure_rounds", {})
        for name, items in noise.get("structure", {}).items():
            tensors = []
            for item, label in zip(items, labels.get(name, [None] * len(items))):
                if isinstance(item, torch.Tensor):
                    tensors.append(item)
                    continue
                path = self.directory / item["file"]
                try:
                    data = path.read_bytes()
                except OSError:
                    raise CheckpointError(f"checkpoint noise file {item['file']!r} is missing") from None
                if _sha256(data) != item["sha256"]:
                    raise CheckpointError(f"checkpoint noise file {item['file']!r} does not match its hash")
                tensors.append(_deserialize(data, repr(item["file"])))
                if label is not None:
                    known[(name, int(label))] = item["sha256"]
            structure[name] = tensors
        noise["structure"] = structure
        privatizer["noise"] = noise
        return privatizer

    @staticmethod
    def _references(privatizer: Mapping[str, Any]) -> list[dict[str, str]]:
        noise = privatizer.get("noise", {}) if isinstance(privatizer, Mapping) else {}
        return [item for items in noise.get("structure", {}).values() for item in items if isinstance(item, dict)]
