"""Enrolled users and their proofs of identity: Ed25519 keys, the enrollment file, challenge signatures.

An operator enrolls each user (a user id and an Ed25519 public key) in an enrollment file. On an
identity exchange the server sends a node a fresh random challenge; the node's ClientApp signs

    "fedmf-identity-proof/v1" 0x00 ‖ len‖run ‖ len‖round ‖ len‖node id ‖ len‖challenge ‖ len‖user id

(each field prefixed by its 4-byte big-endian length: run and user id UTF-8, round and node id
8-byte big-endian unsigned, challenge 32 raw bytes) with the user's private key (Ed25519, RFC
8032); the server verifies the signature with the enrolled public key. A signature made for
another run, round, node, challenge or user does not verify.

Enrollment file (JSON, validated once when loaded):
``{"format": "fedmf-user-enrollment", "version": 1, "users": {"<user id>": "<base64 public key>"}}``.
A user id is enrolled once and a public key belongs to one user. Private key files are PKCS#8 PEM,
created 0600 and refused when group or others can read or write them; their contents never appear
in an error message.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ConfigError
from .files import atomic_write

__all__ = ["Enrollment", "EnrollmentFile", "check_user_id", "new_challenge", "proof_message", "sign_proof",
           "verify_proof", "generate_key_pair", "load_private_key", "read_public_key", "fingerprint",
           "CHALLENGE_BYTES", "SIGNATURE_BYTES", "MAX_USER_ID"]

FORMAT, VERSION = "fedmf-user-enrollment", 1
CHALLENGE_BYTES, SIGNATURE_BYTES, PUBLIC_KEY_BYTES = 32, 64, 32
MAX_USER_ID = 200
_DOMAIN = b"fedmf-identity-proof/v1\x00"


def check_user_id(user: object, what: str = "user id") -> str:
    """``user`` if it is a printable non-empty string of at most MAX_USER_ID characters."""
    if not isinstance(user, str) or not user or len(user) > MAX_USER_ID or not user.isprintable():
        shown = repr(user) if len(repr(user)) <= 60 else repr(user)[:57] + "..."
        raise ConfigError(f"{what} must be a printable non-empty string of at most {MAX_USER_ID} characters, "
                          f"got {shown}")
    return user


# ---- proofs ----------------------------------------------------------------------------------
def new_challenge() -> bytes:
    """A fresh challenge from the OS's secure random source."""
    return secrets.token_bytes(CHALLENGE_BYTES)


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def proof_message(run: str, round_: int, node_id: int, challenge: bytes, user: str) -> bytes:
    """The canonical bytes a user signs (module docstring): one encoding for one tuple of fields."""
    if not 0 <= round_ < 2 ** 64 or not 0 <= node_id < 2 ** 64 or len(challenge) != CHALLENGE_BYTES:
        raise ConfigError("identity proof: round, node id or challenge out of range")
    return (_DOMAIN + _field(run.encode("utf-8")) + _field(struct.pack(">Q", round_))
            + _field(struct.pack(">Q", node_id)) + _field(bytes(challenge)) + _field(user.encode("utf-8")))


def sign_proof(key: Ed25519PrivateKey, run: str, round_: int, node_id: int, challenge: bytes, user: str) -> bytes:
    """The user's 64-byte Ed25519 signature of ``proof_message(...)``."""
    return key.sign(proof_message(run, round_, node_id, challenge, user))


def verify_proof(public_key: bytes, signature: bytes, run: str, round_: int, node_id: int, challenge: bytes,
                 user: str) -> bool:
    """Whether ``signature`` is ``user``'s signature (under the raw 32-byte ``public_key``) of exactly these fields."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            signature, proof_message(run, round_, node_id, challenge, user))
    except (InvalidSignature, ValueError):
        return False
    return True


# ---- key files -------------------------------------------------------------------------------
def fingerprint(public_key: bytes) -> str:
    """A short public label of a public key (SHA-256, 16 hex digits)."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def _public_text(public_key: bytes) -> str:
    return base64.b64encode(public_key).decode("ascii")


def _parse_public(text: object, where: str) -> bytes:
    try:
        raw = base64.b64decode(str(text).strip(), validate=True) if isinstance(text, str) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ConfigError(f"{where}: not a base64 Ed25519 public key (32 bytes)")
    try:
        Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise ConfigError(f"{where}: not a valid Ed25519 public key") from None
    return raw


def generate_key_pair(private_path: str | os.PathLike) -> bytes:
    """Make a user key pair: the private key in ``private_path`` (PKCS#8 PEM, created 0600, never
    overwritten) and the public key in ``<private_path>.pub`` (base64, one line); returns the raw
    public key."""
    private_path = Path(private_path)
    public_path = Path(f"{private_path}.pub")
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise ConfigError(f"{str(path)!r} exists: refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    atomic_write(public_path, lambda f: f.write(_public_text(public) + "\n"), text=True, mode=0o644)
    return public


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """The user's private key from ``path``; refused (one line, never its contents) unless it is a
    regular file owned by this user that group and others can neither read nor write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"user key {str(path)!r}: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"user key {str(path)!r} is not a regular file")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ConfigError(f"user key {str(path)!r} is accessible by group or others "
                              f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
        if info.st_uid != os.geteuid():
            raise ConfigError(f"user key {str(path)!r} is owned by another user")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(64 * 1024)
    finally:
        os.close(fd)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"user key {str(path)!r} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"user key {str(path)!r} is not an Ed25519 key")
    return key


def read_public_key(path: str | os.PathLike) -> bytes:
    """A public key file written by ``generate_key_pair`` (base64 on one line)."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"public key {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
    return _parse_public(text, f"public key {str(path)!r}")


# ---- the enrollment file ---------------------------------------------------------------------
@dataclass(frozen=True)
class Enrollment:
    """Enrolled users: user id → raw 32-byte Ed25519 public key (ids and keys each unique)."""

    users: Mapping[str, bytes]

    def __post_init__(self) -> None:
        users = {check_user_id(u, "enrolled user id"): bytes(k) for u, k in dict(self.users).items()}
        if any(len(k) != PUBLIC_KEY_BYTES for k in users.values()):
            raise ConfigError("enrollment: a public key is not 32 bytes")
        if len(set(users.values())) != len(users):
            raise ConfigError("enrollment: one public key is enrolled for two users")
        object.__setattr__(self, "users", users)

    def key(self, user: str) -> bytes | None:
        return self.users.get(user)

    def with_user(self, user: str, public_key: bytes, *, replace: bool = False) -> "Enrollment":
        """Enroll ``user`` (``replace``: rotate the key of an enrolled user; required then, refused otherwise)."""
        if (user in self.users) != replace:
            raise ConfigError(f"user {user!r} is already enrolled (rotate replaces a key)" if not replace
                              else f"user {user!r} is not enrolled (enroll it first)")
        owner = next((u for u, k in self.users.items() if k == public_key and u != user), None)
        if owner is not None or (replace and self.users[user] == public_key):
            raise ConfigError(f"this public key is already enrolled (fingerprint {fingerprint(public_key)})")
        return Enrollment({**self.users, user: public_key})

    def without_user(self, user: str) -> "Enrollment":
        """Revoke ``user``."""
        if user not in self.users:
            raise ConfigError(f"user {user!r} is not enrolled")
        return Enrollment({u: k for u, k in self.users.items() if u != user})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Enrollment":
        """Read and validate an enrollment file (one-line ``ConfigError`` on any problem)."""
        where = f"enrollment file {str(path)!r}"
        try:
            info = os.stat(path)
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: {getattr(e, 'strerror', None) or e}") from None
        if stat.S_IMODE(info.st_mode) & 0o022:
            raise ConfigError(f"{where} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})")

        def no_duplicates(pairs):
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise ConfigError(f"{where}: a user id or field appears twice")
            return dict(pairs)

        try:
            data = json.loads(text, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"{where}: not a fedmf enrollment file")
        if data.get("version") != VERSION:
            raise ConfigError(f"{where}: version {data.get('version')!r} is not supported (this fedmf reads {VERSION})")
        users = data.get("users")
        if not isinstance(users, dict) or set(data) != {"format", "version", "users"}:
            raise ConfigError(f"{where}: expected exactly the fields format, version, users (an object)")
        try:
            return cls({check_user_id(u, "enrolled user id"): _parse_public(k, f"user {u!r}") for u, k in users.items()})
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (mode 0644: public keys, but only the operator may change it)."""
        data = {"format": FORMAT, "version": VERSION,
                "users": {u: _public_text(k) for u, k in sorted(self.users.items())}}
        atomic_write(path, lambda f: f.write(json.dumps(data, indent=1) + "\n"), text=True, mode=0o644)


class EnrollmentFile:
    """An enrollment file read once, and again whenever it changes on disk (enroll, rotate, revoke
    while a run goes on). A changed file that no longer loads leaves the last good enrollment in force."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._stamp = self._stat()
        self.enrollment = Enrollment.load(self.path)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    def reload(self) -> bool:
        """Re-read the file if it changed on disk; True when the enrollment changed. ``ConfigError``
        (one line) when the changed file does not load (the previous enrollment stays)."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        new = Enrollment.load(self.path)
        changed = new.users != self.enrollment.users
        self.enrollment = new
        return changed
