"""Words modulo 2^b and the masks that hide them.

A mask is the ChaCha20 keystream (from ``cryptography``, the library Flower's own secure-
aggregation crypto wraps) under a key derived with HKDF-SHA256 from a 32-byte secret: the
client's own mask seed, or the ECDH secret it shares with a neighbour. Each 8 keystream bytes
give one word, reduced modulo 2^b (exactly uniform: 2^b divides 2^64). Flower's
``secaggplus_utils.pseudo_rand_gen`` is not used: it folds the seed to 32 bits for numpy's
Mersenne Twister — 2^32 candidate masks, which a server can search — and draws from
[0, 2^b − 1), never 2^b − 1.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import SecAggError

__all__ = ["SELF_MASK", "PAIRWISE_MASK", "expand_mask", "mod_add", "mod_sub", "mod_sum"]

#: HKDF ``info`` of the two kinds of mask (domain separation)
SELF_MASK = b"fedmf secagg self mask v1"
PAIRWISE_MASK = b"fedmf secagg pairwise mask v1"


def expand_mask(secret: bytes, length: int, bits: int, purpose: bytes) -> np.ndarray:
    """``length`` uniform words modulo 2^``bits`` (uint64) from ``secret`` (≥ 16 bytes)."""
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise SecAggError("a mask secret must be at least 16 bytes")
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=purpose).derive(secret)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(8 * length))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64) & np.uint64((1 << bits) - 1)


def mod_add(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a + b) mod 2^bits, uint64 (numpy's uint64 addition wraps modulo 2^64)."""
    return (a + b) & np.uint64((1 << bits) - 1)


def mod_sub(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a − b) mod 2^bits, uint64."""
    return (a - b) & np.uint64((1 << bits) - 1)


def mod_sum(vectors: Iterable[np.ndarray], length: int, bits: int) -> np.ndarray:
    """The sum of ``vectors`` modulo 2^bits (zeros when there are none)."""
    total = np.zeros(length, dtype=np.uint64)
    for v in vectors:
        total = mod_add(total, v, bits)
    return total
