"""The schedulers' secret-seeded stream: keyed BLAKE2b of (purpose, round, user) read as
uniform 64-bit words (the format is documented in ``fedmf.schedule``)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError

__all__ = ["Stream", "check_key", "encode_id"]

_PERSON = b"fedmf-sched-v1"
_KEY_BYTES = (16, 64)
_UNIT = 2.0**-53


def check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise ConfigError(f"the scheduler key must be bytes (secrets.token_bytes(32)), got {type(key).__name__}")
    lo, hi = _KEY_BYTES
    if not lo <= len(key) <= hi:
        raise ConfigError(f"the scheduler key must be {lo} to {hi} bytes long, got {len(key)} bytes")
    return bytes(key)


def encode_id(user_id: str) -> bytes:
    return user_id.encode("utf-8", "surrogatepass")


class Stream:
    """Keyed BLAKE2b of (purpose, round, user) -> uniform 64-bit words (module docstring)."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(key=key, person=_PERSON, digest_size=8)

    def __repr__(self) -> str:
        return "Stream(<secret>)"

    def words(self, purpose: bytes, t: int, names: Sequence[bytes]) -> np.ndarray:
        h = self._base.copy()
        h.update(purpose + b"\0" + struct.pack(">q", t))
        copy = h.copy  # the key block and the prefix are absorbed once per call

        def one(name: bytes) -> bytes:
            x = copy()
            x.update(name)
            return x.digest()

        return np.frombuffer(b"".join(map(one, names)), dtype=">u8").astype(np.uint64)

    def uniforms(self, purpose: bytes, t: int, names: Sequence[bytes]) -> np.ndarray:
        """Uniform on the grid k·2⁻⁵³ of [0, 1): the top 53 bits of each word."""
        return (self.words(purpose, t, names) >> np.uint64(11)).astype(np.float64) * _UNIT

    def check(self) -> str:
        """A keyed check value that identifies the key without revealing it."""
        return f"{int(self.words(b'check', 0, [b''])[0]):016x}"
