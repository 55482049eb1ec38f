"""Counter-based Gaussian draws for the correlated noise: the secret key, and the fresh rows it keys.

Fresh Gaussian rows z_r are counter-based: the values of row r in chunk c of the flat
parameter vector come from a generator seeded with a keyed hash of (secret seed, r, salt, c)
(BLAKE2b; values by ``fedmf.round.normal``, tails to 8.6σ), so any past draw can be regenerated
exactly and any slice of the parameters (a shard) can be produced alone and equals the same
slice of the unsharded noise
("Scaling up BandMF", Sec. 3.3: coordinate-wise independence).

Salts (``salted=True`` in ``fedmf.round.noise``; every private run uses them): each round's
fresh rows are keyed by a fresh 16-byte salt: seed of (row r, chunk c) = BLAKE2b-128(key = seed,
salt = salt_t, person = "fedmf-noise-s1", message = LE64(r) ‖ LE64(c)) (RFC 7693). Unsalted rows
(salt b"") keep the keys of state format 3:
BLAKE2b-128(key = seed, person = "fedmf-noise-v2", message = LE64(r) ‖ LE64(c)).

The seed is a secret (anyone holding it can subtract the noise): it is never printed,
logged or put in error messages; ``seed_check`` identifies it without revealing it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from .normal import fill_normal

__all__ = ["Draws", "CHUNK_SIZE", "BLOCK_SIZE", "SALT_BYTES", "is_int", "new_key", "key_of", "seed_check"]

CHUNK_SIZE = 1 << 18
#: on CPU a round's arithmetic runs block by block so each output block stays in cache
BLOCK_SIZE = 1 << 19
SALT_BYTES = 16
_SEED_CHECK_LABEL = b"fedmf noise state seed check"


def is_int(x: Any) -> bool:
    """An int (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def new_key(seed: bytes | int | None) -> bytes:
    """The BLAKE2b key of ``seed``; None: 32 fresh bytes from the OS's secure source."""
    if seed is None:
        return secrets.token_bytes(32)
    if is_int(seed):
        seed = int(seed)
        if seed < 0 or seed.bit_length() > 512:  # BLAKE2b keys are at most 64 bytes
            raise ConfigError("an integer seed must be non-negative and below 2^512")
        return seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "little")
    if isinstance(seed, (bytes, bytearray)) and 1 <= len(seed) <= 64:
        return bytes(seed)
    raise ConfigError("seed must be None, a non-negative int, or 1 to 64 bytes")


def key_of(seed: bytes | int) -> bytes:
    """The BLAKE2b key a generator built with ``seed`` uses (the same bytes, so the same stream)."""
    if seed is None:
        raise ConfigError("key_of needs a seed")
    return new_key(seed)


def seed_check(key: bytes) -> str:
    """Keyed BLAKE2b (RFC 7693) of a fixed label under the seed, 16 bytes, hex: identifies the
    seed without revealing it."""
    return hashlib.blake2b(_SEED_CHECK_LABEL, key=key, digest_size=16, person=b"fedmf-seedcheck").hexdigest()


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()), thread_name_prefix="fedmf-noise")
    return _POOL


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the parent's threads: it makes its own pool


os.register_at_fork(after_in_child=_forget_pool)


class Draws:
    """Counter-based Gaussian rows, scaled by ``scale``, for the flat range [lo, hi) of a
    size-``total`` vector (values from ``fedmf.round.normal.fill_normal``, whose tails are not cut
    at 5.8σ as float32 ``torch.randn``'s are). On CPU the chunks of a row are drawn on several
    threads; each chunk has its own seed, so the result does not depend on the thread count.
    ``salts[r]``: the salt of row r (b"": unsalted), one entry per row drawn so far (a
    generator's draws); None: every row unsalted (draws on their own)."""

    def __init__(self, key: bytes, total: int, lo: int, hi: int, dtype: torch.dtype, device: torch.device,
                 chunk: int, scale: float = 1.0) -> None:
        self.key, self.total, self.lo, self.hi = key, total, lo, hi
        self.dtype, self.device, self.chunk, self.scale = dtype, device, chunk, float(scale)
        self.salts: list[bytes] | None = None

    def _seed(self, row: int, chunk: int) -> int:
        message = struct.pack("<QQ", row, chunk)
        salt = b"" if self.salts is None else self.salts[row]
        if salt:
            h = hashlib.blake2b(message, key=self.key, digest_size=16, salt=salt, person=b"fedmf-noise-s1")
        else:
            h = hashlib.blake2b(message, key=self.key, digest_size=16, person=b"fedmf-noise-v2")
        return int.from_bytes(h.digest(), "little")

    def _fill_chunk(self, row: int, c: int, out: torch.Tensor) -> None:
        start, stop = c * self.chunk, min((c + 1) * self.chunk, self.total)
        a, b = max(start, self.lo), min(stop, self.hi)
        if a == start and b == stop:
            fill_normal(out[a - self.lo : b - self.lo], self._seed(row, c), self.scale)
        else:
            full = fill_normal(torch.empty(stop - start, dtype=self.dtype, device=self.device), self._seed(row, c),
                               self.scale)
            out[a - self.lo : b - self.lo].copy_(full[a - start : b - start])

    def _fill_group(self, row: int, chunks: Sequence[int], out: torch.Tensor) -> None:
        for c in chunks:
            self._fill_chunk(row, c, out)

    def fill(self, row: int, out: torch.Tensor) -> torch.Tensor:
        """Write the shard's slice of fresh row ``row`` (times ``scale``) into ``out`` (length hi - lo)."""
        return self.run(row, out, None)

    def run(self, row: int, out: torch.Tensor, kernel: Callable[[int, int], None] | None) -> torch.Tensor:
        """``fill``, then ``kernel(a, b)`` on the local range in cache-sized blocks on CPU (one
        call on accelerators): the structure's arithmetic for this round."""
        if self.hi <= self.lo:
            return out
        chunks = list(range(self.lo // self.chunk, (self.hi - 1) // self.chunk + 1))
        workers = min(len(chunks), torch.get_num_threads()) if self.device.type == "cpu" else 1
        if workers <= 1:
            self._fill_group(row, chunks, out)
        else:
            groups = [chunks[i * len(chunks) // workers : (i + 1) * len(chunks) // workers] for i in range(workers)]
            for future in [_pool().submit(self._fill_group, row, g, out) for g in groups]:
                future.result()
        if kernel is not None:
            size = self.hi - self.lo
            step = BLOCK_SIZE if self.device.type == "cpu" else size
            for a in range(0, size, step):
                kernel(a, min(a + step, size))
        return out

    def new(self, row: int) -> torch.Tensor:
        return self.fill(row, torch.empty(self.hi - self.lo, dtype=self.dtype, device=self.device))

