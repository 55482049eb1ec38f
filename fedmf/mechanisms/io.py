"""Versioned, checksummed mechanism files (JSON), and the same documents as text.

Layout: {"format": "fedmf-mechanism", "version": 1, "checksum": "sha256:…", "body": {…}}
where body = {kind, rounds, workload, params, schema, created_by} and the checksum is the
SHA-256 of the body's canonical JSON. Floats are written with repr precision, so a
loaded mechanism is bit-identical to the saved one.

``dumps``/``loads`` are the one writer and the one validating reader; ``save``, ``load`` and
``load_with_schema`` wrap them with a file (the ledger stores the text itself).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError, FedmfError
from ..files import atomic_write
from ..participation import Schema, schema_from_dict
from ..workloads import Workload
from .base import Mechanism

__all__ = ["FORMAT", "VERSION", "MechanismFileError", "dumps", "loads", "save", "load", "load_with_schema",
           "read_text"]

FORMAT = "fedmf-mechanism"
VERSION = 1


class MechanismFileError(FedmfError):
    """A mechanism file that cannot be trusted or read."""


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _checksum(body: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()


def _document(mechanism: Mechanism, schema: Schema | None, extra: dict | None) -> tuple[str, str]:
    """(text, checksum) of ``mechanism``'s document."""
    from .. import __version__

    body = {
        "kind": mechanism.kind,
        "rounds": mechanism.rounds,
        "workload": mechanism.workload.to_dict(),
        "params": mechanism.params(),
        "schema": None if schema is None else schema.to_dict(mechanism.rounds),
        "created_by": f"fedmf {__version__}",
        **({"extra": extra} if extra else {}),
    }
    checksum = _checksum(body)
    document = {"format": FORMAT, "version": VERSION, "checksum": checksum, "body": body}
    return json.dumps(document, indent=1, allow_nan=False) + "\n", checksum


def dumps(mechanism: Mechanism, schema: Schema | None = None, extra: dict | None = None) -> str:
    """The text ``save`` writes for ``mechanism`` (and the schema it was planned for)."""
    return _document(mechanism, schema, extra)[0]


def save(mechanism: Mechanism, path: str | os.PathLike, schema: Schema | None = None, extra: dict | None = None) -> str:
    """Write ``mechanism`` (and the schema it was planned for) atomically; returns the checksum."""
    text, checksum = _document(mechanism, schema, extra)
    atomic_write(path, lambda f: f.write(text), text=True)
    return checksum


def _reject_constant(name: str) -> float:
    raise MechanismFileError(f"non-finite number {name}")


def read_text(path: str | os.PathLike) -> str:
    """A mechanism file's text; unreadable or non-UTF-8 files are a MechanismFileError."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise MechanismFileError(f"cannot read mechanism file {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise MechanismFileError(f"{str(path)!r} is not a mechanism file (not UTF-8 text)") from None


def _parse_document(text: str, label: str) -> dict[str, Any]:
    """The document in ``text`` after its format, version and checksum were checked."""
    try:
        document = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise MechanismFileError(f"{label} is not a mechanism file (truncated, not JSON or non-finite numbers)") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise MechanismFileError(f"{label} is not a fedmf mechanism file")
    version = document.get("version")
    if version != VERSION:
        raise MechanismFileError(f"{label} has mechanism file version {version!r}; this fedmf reads version {VERSION}")
    body = document.get("body")
    try:
        valid = isinstance(body, dict) and document.get("checksum") == _checksum(body)
    except ValueError:  # e.g. 1e999 parsed as inf
        valid = False
    if not valid:
        raise MechanismFileError(f"{label} failed its checksum: the file was modified or damaged")
    return document


def loads(text: str | bytes, *, source: str = "<text>") -> tuple[Mechanism, Schema | None, str]:
    """The mechanism in a document's ``text``, the schema it was planned for (or None), and its
    checksum; ``source`` names the text in error messages."""
    from . import from_params

    label = repr(str(source))
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise MechanismFileError(f"{label} is not a mechanism file (not UTF-8 text)") from None
    if not isinstance(text, str):
        raise MechanismFileError(f"{label} is not a mechanism file (not text)")
    document = _parse_document(text, label)
    body = document["body"]
    try:
        rounds = body["rounds"]
        if isinstance(rounds, bool) or not isinstance(rounds, int):
            raise ConfigError(f"rounds must be an integer, got {rounds!r}")
        workload = Workload.from_dict(body["workload"])
        mechanism = from_params(body["kind"], rounds, workload, body["params"])
        schema = None if body.get("schema") is None else schema_from_dict(body["schema"])
        if schema is not None:
            schema.validate(rounds)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise MechanismFileError(f"{label} holds an invalid mechanism: {e}") from None
    return mechanism, schema, document["checksum"]


def load_with_schema(path: str | os.PathLike) -> tuple[Mechanism, Schema | None, str]:
    """Load a mechanism, the schema it was planned for (or None), and its checksum."""
    return loads(read_text(path), source=str(path))


def load(path: str | os.PathLike) -> Mechanism:
    """Load the mechanism saved at ``path``."""
    return load_with_schema(path)[0]
