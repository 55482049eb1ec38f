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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ConfigError
from .files import atomic_write, check_private_path

__all__ = ["Enrollment", "EnrollmentFile", "EnrolledKey", "check_user_id", "new_challenge", "proof_message",
           "sign_proof", "verify_proof", "check_public_key", "generate_key_pair", "load_private_key", "read_public_key",
           "fingerprint", "CHALLENGE_BYTES", "SIGNATURE_BYTES", "MAX_USER_ID"]

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


class EnrolledKey:
    """A public key validated once (``check_public_key``: a point, canonical, not of small order)
    and loaded for verification: what an ``Enrollment`` holds for each user, so that checking a
    proof costs one signature verification, not the key's validation again (about 9 modular
    exponentiations in Python; issue 34)."""

    __slots__ = ("raw", "_key")

    def __init__(self, raw: bytes, *, validated: bool = False) -> None:
        """``validated``: ``check_public_key(raw)`` has just been called (this module only)."""
        problem = None if validated else check_public_key(raw)
        if problem is not None:
            raise ConfigError(f"the public key is {problem}")
        self.raw = bytes(raw)
        self._key = Ed25519PublicKey.from_public_bytes(self.raw)

    def verify(self, signature: bytes, message: bytes) -> bool:
        """Whether ``signature`` is a valid Ed25519 signature of ``message`` under this key."""
        try:
            self._key.verify(signature, message)
        except (InvalidSignature, ValueError):
            return False
        return True

    def __repr__(self) -> str:
        return f"EnrolledKey({fingerprint(self.raw)})"


def verify_proof(public_key: bytes | EnrolledKey, signature: bytes, run: str, round_: int, node_id: int,
                 challenge: bytes, user: str) -> bool:
    """Whether ``signature`` is ``user``'s signature of exactly these fields under ``public_key``:
    an ``EnrolledKey`` (validated when it was loaded: one signature verification), or raw 32 bytes
    (validated here first, on every call)."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    if not isinstance(public_key, EnrolledKey):
        try:  # (a small-order key would accept signatures made without its private key)
            public_key = EnrolledKey(public_key)
        except (ConfigError, TypeError, ValueError):
            return False
    return public_key.verify(signature, proof_message(run, round_, node_id, challenge, user))


# ---- key files -------------------------------------------------------------------------------
def fingerprint(public_key: bytes) -> str:
    """A short public label of a public key (SHA-256, 16 hex digits)."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def _public_text(public_key: bytes) -> str:
    return base64.b64encode(public_key).decode("ascii")


# Edwards25519 (RFC 8032 section 5.1): -x^2 + y^2 = 1 + d x^2 y^2 over GF(p)
_P = 2 ** 255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _decode_point(raw: bytes) -> tuple[int, int] | None:
    """The affine point ``raw`` encodes (RFC 8032 section 5.1.3, but lenient: y ≥ p is reduced and
    the sign of x = 0 ignored, so that a non-canonical encoding decodes and fails to re-encode),
    None when it is not a point."""
    y = (int.from_bytes(raw, "little") & ((1 << 255) - 1)) % _P
    sign = raw[31] >> 7
    u, v = (y * y - 1) % _P, (_D * y * y + 1) % _P
    x = u * pow(v, 3, _P) * pow(u * pow(v, 7, _P), (_P - 5) // 8, _P) % _P
    if v * x * x % _P == (-u) % _P:
        x = x * _SQRT_M1 % _P
    elif v * x * x % _P != u:
        return None
    return ((_P - x) % _P if (x & 1) != sign else x), y


def _double(point: tuple[int, int]) -> tuple[int, int]:
    """[2]·point by the Edwards addition law (RFC 8032 section 5.1.4, affine form)."""
    x, y = point
    t = _D * x * x * y * y % _P
    return 2 * x * y * pow(1 + t, _P - 2, _P) % _P, (y * y + x * x) * pow(1 - t, _P - 2, _P) % _P


def _encode_point(point: tuple[int, int]) -> bytes:
    x, y = point
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def check_public_key(raw: bytes) -> str | None:
    """Why ``raw`` may not be enrolled (None: it may): not a point, not its point's canonical
    encoding, or a point of small order ([8]·P is the identity; such a key accepts signatures
    made without any private key, since OpenSSL's verification does not refuse them)."""
    point = _decode_point(raw) if len(raw) == PUBLIC_KEY_BYTES else None
    if point is None:
        return "not a valid Ed25519 public key"
    if _encode_point(point) != raw:
        return "not the canonical encoding of an Ed25519 public key"
    for _ in range(3):
        point = _double(point)
    if point == (0, 1):
        return "a small-order Ed25519 point (it would accept any signature)"
    return None


def _parse_public(text: object, where: str) -> EnrolledKey:
    try:
        raw = base64.b64decode(str(text).strip(), validate=True) if isinstance(text, str) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ConfigError(f"{where}: not a base64 Ed25519 public key (32 bytes)")
    problem = check_public_key(raw)
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return EnrolledKey(raw, validated=True)


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


def _open_own_file(path: str | os.PathLike, where: str) -> tuple[int, os.stat_result]:
    """An open read-only descriptor of ``path`` and its fstat, refused (one line) unless ``path`` is
    a regular file (not a symlink, not a FIFO: opened without following links and without
    blocking) owned by this process's user. Check and read the same descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        reason = "is a symbolic link" if os.path.islink(path) else e.strerror or str(e)
        raise ConfigError(f"{where}: {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{where} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ConfigError(f"{where} is owned by uid {info.st_uid}, not by the user running fedmf")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _read_fd(fd: int, where: str, limit: int = 64 * 1024 * 1024) -> bytes:
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConfigError(f"{where} is larger than {limit} bytes")
    return data


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """The user's private key from ``path``; refused (one line, never its contents) unless it is a
    regular file owned by this user that group and others can neither read nor write."""
    where = f"user key {str(path)!r}"
    check_private_path(path, "user key", ConfigError)
    fd, info = _open_own_file(path, where)
    try:
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ConfigError(f"{where} is accessible by group or others "
                              f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
        data = _read_fd(fd, where, 64 * 1024)
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
    return _parse_public(text, f"public key {str(path)!r}").raw


# ---- the enrollment file ---------------------------------------------------------------------
@dataclass(frozen=True)
class Enrollment:
    """Enrolled users: user id → raw 32-byte Ed25519 public key (ids and keys each unique). Given
    raw bytes, each key is validated here; given an ``EnrolledKey``, it was validated already. Either
    way a proof is then checked by one signature verification (``verifier``)."""

    users: Mapping[str, bytes]

    def __post_init__(self) -> None:
        verifiers: dict[str, EnrolledKey] = {}
        for user, key in dict(self.users).items():  # each key validated once, here, not on every proof
            user = check_user_id(user, "enrolled user id")
            try:
                verifiers[user] = key if isinstance(key, EnrolledKey) else EnrolledKey(bytes(key))
            except ConfigError as e:
                problem = str(e).removeprefix("the public key is ")
                raise ConfigError(f"enrollment: the public key of user {user!r} is {problem}") from None
        users = {user: key.raw for user, key in verifiers.items()}
        if len(set(users.values())) != len(users):
            raise ConfigError("enrollment: one public key is enrolled for two users")
        object.__setattr__(self, "users", users)
        object.__setattr__(self, "_verifiers", verifiers)

    def key(self, user: str) -> bytes | None:
        return self.users.get(user)

    def verifier(self, user: str) -> EnrolledKey | None:
        """``user``'s enrolled key, validated when the enrollment was loaded (None: not enrolled)."""
        return self._verifiers.get(user)

    def with_user(self, user: str, public_key: bytes, *, replace: bool = False) -> Enrollment:
        """Enroll ``user`` (``replace``: rotate the key of an enrolled user; required then, refused otherwise)."""
        if (user in self.users) != replace:
            raise ConfigError(f"user {user!r} is already enrolled (rotate replaces a key)" if not replace
                              else f"user {user!r} is not enrolled (enroll it first)")
        owner = next((u for u, k in self.users.items() if k == public_key and u != user), None)
        if owner is not None or (replace and self.users[user] == public_key):
            raise ConfigError(f"this public key is already enrolled (fingerprint {fingerprint(public_key)})")
        return Enrollment({**self._verifiers, user: public_key})

    def without_user(self, user: str) -> Enrollment:
        """Revoke ``user``."""
        if user not in self.users:
            raise ConfigError(f"user {user!r} is not enrolled")
        return Enrollment({u: k for u, k in self._verifiers.items() if u != user})

    @classmethod
    def load(cls, path: str | os.PathLike) -> Enrollment:
        """Read and validate an enrollment file (one-line ``ConfigError`` on any problem)."""
        where = f"enrollment file {str(path)!r}"
        fd, info = _open_own_file(path, where)
        try:
            if stat.S_IMODE(info.st_mode) & 0o022:
                raise ConfigError(f"{where} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})")
            check_private_path(path, "enrollment file", ConfigError)  # its directories: no one else's to change
            data = _read_fd(fd, where)
        finally:
            os.close(fd)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: not UTF-8 text") from None

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
        parsed = {}
        for position, (user, key) in enumerate(users.items(), 1):  # errors name positions: ids may be private
            try:
                check_user_id(user)
            except ConfigError:
                raise ConfigError(f"{where}: user #{position}: the user id is not a printable non-empty string "
                                  f"of at most {MAX_USER_ID} characters") from None
            parsed[user] = _parse_public(key, f"{where}: user #{position}")
        return cls(parsed)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (mode 0644: public keys, but only the operator may change it)."""
        data = {"format": FORMAT, "version": VERSION,
                "users": {u: _public_text(k) for u, k in sorted(self.users.items())}}
        atomic_write(path, lambda f: f.write(json.dumps(data, indent=1) + "\n"), text=True, mode=0o644)


class EnrollmentFile:
    """An enrollment file read once, and again whenever it changes on disk (enroll, rotate, revoke
    while a run goes on). A changed file that no longer loads leaves the last good enrollment in force,
    and ``reload`` says so again on every call until the file loads."""

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
        (one line, naming no user id) when the changed file does not load (the previous enrollment
        stays; raised again on every call while it does not load)."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        new = Enrollment.load(self.path)  # raises again on every call while the file does not load
        self._stamp = stamp
        changed = new.users != self.enrollment.users
        self.enrollment = new
        return changed
