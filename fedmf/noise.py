"""Streaming correlated noise in torch: the noise of round t is std·(L z)_t, L = C^{-1}.

Fresh Gaussian rows z_r are counter-based: the values of row r in chunk c of the flat
parameter vector come from a generator seeded with a keyed hash of (secret seed, r, salt, c)
(BLAKE2b; values by ``fedmf.normal``, tails to 8.6σ), so any past draw can be regenerated
exactly and any slice of the parameters (a shard) can be produced alone and equals the same
slice of the unsharded noise
("Scaling up BandMF", Sec. 3.3: coordinate-wise independence).

Salts (``salted=True``; every private run uses them): each call of ``next()`` for round t
draws a fresh 16-byte salt from the OS's secure source before any of the round's fresh rows,
and those rows are keyed by it: seed of (row r, chunk c) = BLAKE2b-128(key = seed,
salt = salt_t, person = "fedmf-noise-s1", message = LE64(r) ‖ LE64(c)) (RFC 7693). The salts
of the rounds done are part of the state, so a generator restored from it regenerates past
draws exactly, but a round drawn again after a restore (or by a copy of the seed) gets new,
independent fresh noise. Unsalted rows (salt b"") keep the keys of state format 3:
BLAKE2b-128(key = seed, person = "fedmf-noise-v2", message = LE64(r) ‖ LE64(c)).

L comes from the mechanism as one description (``Mechanism.streaming_inverse()``, see
fedmf.mechanisms.streaming); each description type has one interpreter here, and the state
is bounded by it ("Scaling up BandMF" Alg. 1 for banded C; "Beyond Square Roots" Sec. 4 for
banded C^{-1}; McMahan et al. 2024 for BLT buffers):
  Fir    banded C^{-1} (dp-sgd, bisr, bifr)   p - 1 past fresh draws (or none with regenerate=True);
         none of them in the state: they are regenerated from the seed
  Iir    banded C (bsr, banded-toeplitz, robust, banded)   p - 1 past outputs
  Blt    m buffers
  Tree   O(log n) node estimates
  Dense  nothing: past draws are regenerated, O(t·d) per round

The state (format 4) is bound to its mechanism by ``Mechanism.fingerprint``. Its
``structure_rounds`` labels every kept tensor with the round whose ``next()`` produced it
(unchanged while it stays in the state, so a checkpoint writer can store it once), or None
for a tensor updated every round (BLT buffers).

The seed is a secret (anyone holding it can subtract the noise): it is never printed,
logged or put in error messages. ``state_dict()`` contains it (store it like a key) unless
``include_seed=False``, which puts a keyed check value in its place.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch

from . import checks
from .errors import CheckpointError, ConfigError, HorizonReached, PlanMismatch
from .mechanisms.base import Mechanism
from .mechanisms.streaming import Blt, Dense, Fir, Iir, StreamingInverse, Tree
from .normal import fill_normal

__all__ = ["NoiseGenerator", "Layout", "CHUNK_SIZE", "SALT_BYTES", "key_of"]

Layout = Union[int, Mapping[str, Sequence[int]]]
CHUNK_SIZE = 1 << 18
#: on CPU a round's arithmetic runs block by block so each output block stays in cache
BLOCK_SIZE = 1 << 19
#: 4: salts of the rounds done; 3: bound to the mechanism's fingerprint, seed or seed_check,
#: structure_rounds (read as 4 with every round unsalted); 2: std folded into the draws by
#: fedmf.normal; 1: another sampler, unscaled state
_STATE_FORMAT = 4
_UNSALTED_FORMAT = 3
SALT_BYTES = 16
_FLOATING = checks.floating_dtypes()
_SEED_CHECK_LABEL = b"fedmf noise state seed check"


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _key(seed: bytes | int | None) -> bytes:
    if seed is None:
        return secrets.token_bytes(32)
    if _is_int(seed):
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
    return _key(seed)


def _seed_check(key: bytes) -> str:
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


class _Draws:
    """Counter-based Gaussian rows, scaled by ``scale``, for the flat range [lo, hi) of a
    size-``total`` vector (values from ``fedmf.normal.fill_normal``, whose tails are not cut
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


class _Structure:
    """Interprets one description of L for the generator: ``step(t, row, out)`` writes (L z)_t
    into ``out`` (fresh draws already carry the noise std)."""

    def __init__(self, draws: _Draws) -> None:
        self.draws = draws

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.draws.hi - self.draws.lo, dtype=self.draws.dtype, device=self.draws.device)

    def _restore(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Checkpointed tensors, copied onto this generator's device and dtype."""
        return [x.to(self.draws.device, self.draws.dtype).clone() for x in tensors]

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        """For each tensor of ``state()`` after t rounds: the round whose ``next()`` produced
        its final value, or None if it changes every round."""
        return {}

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        pass

    def slice(self, lo: int, hi: int) -> dict[str, Any]:
        """The state restricted to the flat range [lo, hi) of this structure's range."""
        return {k: [x[lo:hi].clone() for x in v] for k, v in self.state().items()}


class _Fir(_Structure):
    """w_t = sum_{j<p} a_j z_{t-j} (banded lower-triangular Toeplitz L), one fused pass:
    reads the p - 1 kept draws once and writes w_t once."""

    def __init__(self, draws: _Draws, spec: Fir, regenerate: bool) -> None:
        super().__init__(draws)
        self.taps = [float(a) for a in spec.taps]
        self.regenerate = regenerate
        self.past: list[torch.Tensor] = []  # z_{t-1}, z_{t-2}, …
        self.spare: torch.Tensor | None = None  # storage of the draw that fell out of the window

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        p = len(self.taps)
        if p == 1 and self.taps[0] == 1.0:
            return self.draws.fill(row, out)
        z = self.spare if self.spare is not None else self._empty()
        self.spare = None
        count = min(p - 1, t)
        past = [self.draws.new(row - j) for j in range(1, count + 1)] if self.regenerate else self.past[:count]
        taps = self.taps

        def kernel(a: int, b: int) -> None:
            piece = torch.mul(z[a:b], taps[0], out=out[a:b])
            for tap, x in zip(taps[1:], past):
                piece.add_(x[a:b], alpha=tap)

        self.draws.run(row, z, kernel)
        if not self.regenerate and p > 1:
            if len(self.past) == p - 1:
                self.spare = self.past.pop()
            self.past.insert(0, z)
        return out

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        # the past fresh draws are regenerated from the seed: nothing to store
        self.spare = None
        if not self.regenerate:
            self.past = [self.draws.new(row - j) for j in range(1, min(len(self.taps) - 1, t) + 1)]


class _Iir(_Structure):
    """y_t = (z_t - sum_{r=1}^{p-1} C[t, t-r] y_{t-r}) / C[t, t] for banded C
    ("Scaling up BandMF", Alg. 1); Toeplitz C has constant bands. One fused pass; y_t
    overwrites the oldest kept output piece by piece once that piece has been read."""

    def __init__(self, draws: _Draws, spec: Iir) -> None:
        super().__init__(draws)
        self.spec = spec
        self.past: list[torch.Tensor] = []  # y_{t-1}, y_{t-2}, …: each unchanged until it leaves the window

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        p = self.spec.num_bands
        coefs = [-self.spec.coefficient(r, t) for r in range(1, len(self.past) + 1)]
        inverse_diagonal = 1.0 / self.spec.coefficient(0, t)
        keep = None
        if p > 1:
            keep = self.past[-1] if len(self.past) == p - 1 else self._empty()
        past = self.past

        def kernel(a: int, b: int) -> None:
            piece = out[a:b]
            for c, y in zip(coefs, past):
                piece.add_(y[a:b], alpha=c)
            piece.mul_(inverse_diagonal)
            if keep is not None:  # y_t overwrites the oldest kept output once this range of it is read
                keep[a:b].copy_(piece)

        self.draws.run(row, out, kernel)
        if keep is not None:
            self.past = [keep] + self.past[: p - 2]
        return out

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {"outputs": list(self.past)}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        return {"outputs": [t - 1 - j for j in range(min(t, self.spec.num_bands - 1))]}

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        self.past = self._restore(state["outputs"])


class _Blt(_Structure):
    """C^{-1} as a BLT: x_t = z_t + sum_i w_i buf_i ; buf_i <- d_i buf_i + z_t, where
    C^{-1} has coefficients 1, sum_i w_i d_i^(t-1) (McMahan et al. 2024, arXiv 2408.08868, Alg. 2).
    One fused pass over z and the m buffers."""

    def __init__(self, draws: _Draws, spec: Blt) -> None:
        super().__init__(draws)
        self.decay = [float(x) for x in spec.decay]
        self.scale = [float(x) for x in spec.scale]
        self.buffers = [self._empty().zero_() for _ in self.decay]
        self.z: torch.Tensor | None = None

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        if self.z is None:
            self.z = self._empty()
        z, buffers, scale, decay = self.z, self.buffers, self.scale, self.decay

        def kernel(a: int, b: int) -> None:
            zs, piece = z[a:b], out[a:b]
            piece.copy_(zs)
            for w, buf in zip(scale, buffers):
                piece.add_(buf[a:b], alpha=w)
            for d, buf in zip(decay, buffers):
                buf[a:b].mul_(d).add_(zs)

        self.draws.run(row, self.z, kernel)
        return out

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {"buffers": list(self.buffers)}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        return {"buffers": [None] * len(self.buffers)}  # every buffer is updated every round

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        self.buffers = self._restore(state["buffers"])


class _Tree(_Structure):
    """Online Honaker estimates (fedmf.mechanisms.tree): a stack of node estimates. An estimate
    is written only in the round that completes its node and is never modified while on the
    stack (a merge pops it first)."""

    def __init__(self, draws: _Draws, spec: Tree) -> None:
        super().__init__(draws)
        self.alpha = [float(a) for a in spec.alpha]
        self.stack: list[torch.Tensor] = []

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        height = ((t + 1) & -(t + 1)).bit_length() - 1
        estimate = self.draws.new(row)
        removed = None
        for h in range(1, height + 1):
            left = self.stack.pop()
            removed = left if removed is None else removed.add_(left)
            estimate.add_(left).mul_(1 - self.alpha[h]).add_(self.draws.new(row + h), alpha=self.alpha[h])
        self.stack.append(estimate)
        return out.copy_(estimate) if removed is None else torch.sub(estimate, removed, out=out)

    def state(self) -> dict[str, list[torch.Tensor]]:
        return {"stack": list(self.stack)}

    def rounds(self, t: int) -> dict[str, list[int | None]]:
        # after t rounds the stack holds the dyadic blocks of [0, t), largest first (one per set
        # bit of t); the block ending at e (exclusive) was completed by round e - 1
        labels, end = [], 0
        for bit in reversed(range(t.bit_length())):
            if t >> bit & 1:
                end += 1 << bit
                labels.append(end - 1)
        return {"stack": labels}

    def load(self, state: Mapping[str, Any], t: int, row: int) -> None:
        self.stack = self._restore(state["stack"])


class _Dense(_Structure):
    """w_t = sum_{s<=t} L[t, s] z_s with every past draw regenerated: O(d) memory, O(t·d) time."""

    def __init__(self, draws: _Draws, spec: Dense) -> None:
        super().__init__(draws)
        self.inverse = spec.inverse

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        scratch = torch.empty_like(out)
        for s in np.flatnonzero(self.inverse[t]):
            out.add_(self.draws.fill(int(s), scratch), alpha=float(self.inverse[t, s]))
        return out


def _structure(spec: StreamingInverse, draws: _Draws, regenerate: bool) -> _Structure:
    """The interpreter of ``spec``, chosen by the description's type."""
    interpreters: dict[type, Callable[[], _Structure]] = {
        Fir: lambda: _Fir(draws, spec, regenerate),
        Iir: lambda: _Iir(draws, spec),
        Blt: lambda: _Blt(draws, spec),
        Tree: lambda: _Tree(draws, spec),
        Dense: lambda: _Dense(draws, spec),
    }
    try:
        make = interpreters[type(spec)]
    except KeyError:
        raise TypeError(f"no noise interpreter for {type(spec).__name__}") from None
    return make()


# ---- validation ------------------------------------------------------------------------
def _layout_size(layout: Layout) -> tuple[int, list[tuple[str, tuple[int, ...]]] | None]:
    if _is_int(layout):
        if layout <= 0:
            raise ConfigError(f"layout size must be positive, got {layout}")
        return int(layout), None
    if isinstance(layout, Mapping) and layout:
        shapes = list(checks.layout(layout).items())
        return sum(math.prod(s) for _, s in shapes), shapes
    raise ConfigError("layout must be a positive int or a non-empty mapping name -> shape")


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None
    if dev.type == "meta":
        raise ConfigError("device 'meta' holds no values: noise needs a real device")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but CUDA is not available")
        if dev.index is None:  # tensors report cuda:N, never bare cuda
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    elif dev.type != "cpu":
        try:
            torch.empty(1, device=dev)
        except (RuntimeError, AssertionError):
            raise ConfigError(f"device {device!r} is not available") from None
    return dev


def _shard(shard: Any) -> tuple[int, int]:
    if (isinstance(shard, (tuple, list)) and len(shard) == 2 and all(_is_int(x) for x in shard)
            and shard[1] >= 1 and 0 <= shard[0] < shard[1]):
        return int(shard[0]), int(shard[1])
    raise ConfigError(f"shard must be (i, s) with ints 0 <= i < s, got {shard!r}")


def _snapshot(x: torch.Tensor, copy: bool) -> torch.Tensor:
    x = x.detach()
    if x.device.type != "cpu":
        return x.cpu()
    return x.clone() if copy else x


class NoiseGenerator:
    """Correlated noise for each round of ``mechanism``, in ``layout``, scaled by ``std``.

    ``next()`` returns round t's noise std·(C^{-1} z)_t (a dict of tensors for a dict
    layout, else a flat tensor) in ``dtype`` on ``device``. Same seed, mechanism, layout,
    device and dtype (and salts) ⇒ bit-identical noise. ``salted``: key each round's fresh
    rows with a new random salt (module docstring), so that a round drawn again after a restore
    never repeats the noise drawn before; past rounds are still regenerated exactly from the
    state's salts. ``shard=(i, s)`` produces only the i-th of s contiguous slices of the
    flattened parameters; the slices concatenate to the full noise (for a salted generator:
    when every shard gets the same ``salt`` in ``next``). Every argument is checked here
    (``fedmf.errors.ConfigError``).
    """

    def __reduce__(self):  # it holds a secret: never pickled (save state_dict() instead)
        checks.refuse_pickle(self)

    def __init__(
        self,
        mechanism: Mechanism,
        layout: Layout,
        std: float,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        seed: bytes | int | None = None,
        shard: tuple[int, int] = (0, 1),
        regenerate: bool = False,
        chunk_size: int = CHUNK_SIZE,
        salted: bool = False,
    ) -> None:
        if not isinstance(mechanism, Mechanism):
            raise ConfigError(f"mechanism must be a fedmf Mechanism, got {type(mechanism).__name__}")
        self.std = checks.non_negative("std", std)
        if dtype not in _FLOATING:
            raise ConfigError(f"dtype must be a floating torch dtype, got {dtype!r}")
        if not isinstance(regenerate, bool):
            raise ConfigError(f"regenerate must be True or False, got {regenerate!r}")
        if not isinstance(salted, bool):
            raise ConfigError(f"salted must be True or False, got {salted!r}")
        self.salted = salted
        if not _is_int(chunk_size) or chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.mechanism = mechanism
        self.layout = layout
        self.total, self._shapes = _layout_size(layout)
        self.dtype = dtype
        self.device = _device(device)
        self.shard_index, self.shard_count = _shard(shard)
        self._key = _key(seed)
        self.lo = self.total * self.shard_index // self.shard_count
        self.hi = self.total * (self.shard_index + 1) // self.shard_count
        self.regenerate = regenerate
        self.chunk_size = int(chunk_size)
        self._fingerprint = mechanism.fingerprint
        self._draws = _Draws(self._key, self.total, self.lo, self.hi, dtype, self.device, self.chunk_size,
                             self.std)
        self._structure = _structure(mechanism.streaming_inverse(), self._draws, regenerate)
        self.round = 0
        self._row = 0  # next fresh noise row
        self._salts: list[bytes] = []  # salt of each round done (b"": unsalted)
        self._draws.salts = []  # salt of each fresh row drawn

    def __repr__(self) -> str:  # never shows the seed
        return (f"NoiseGenerator(kind={self.mechanism.kind!r}, rounds={self.mechanism.rounds}, round={self.round}, "
                f"size={self.hi - self.lo}/{self.total}, dtype={self.dtype}, device={self.device})")

    @property
    def rounds(self) -> int:
        return self.mechanism.rounds

    def next(self, out: torch.Tensor | None = None, *,
             salt: bytes | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """The noise of the next round; raises ``HorizonReached`` once the mechanism's horizon
        is reached. A salted generator keys the round's fresh rows with ``salt`` (16 bytes;
        default: new ones from the OS's secure source — give one only to make shards agree).

        ``out``: an optional flat, contiguous tensor of this shard's size, dtype and device to
        write into (reusing one buffer saves a fresh allocation, and its page faults, per round);
        the result is then a view of ``out``, overwritten by the next call that gets the same
        ``out``: copy it (or add it to the model) before asking for the next round."""
        t = self.round
        if t >= self.mechanism.rounds:
            raise HorizonReached(
                f"noise for round {t} requested, but the mechanism covers rounds 0..{self.mechanism.rounds - 1}; "
                "noise is never repeated or reused"
            )
        size = self.hi - self.lo
        if out is None:
            out = torch.empty(size, dtype=self.dtype, device=self.device)
        elif not (isinstance(out, torch.Tensor) and out.shape == (size,) and out.dtype == self.dtype
                  and out.device == self.device and out.is_contiguous()):
            raise ConfigError(f"out must be a contiguous flat tensor of {size} elements, dtype {self.dtype}, "
                              f"device {self.device}")
        if salt is None:
            salt = secrets.token_bytes(SALT_BYTES) if self.salted else b""
        elif not (self.salted and isinstance(salt, bytes) and len(salt) == SALT_BYTES):
            raise ConfigError(f"salt must be {SALT_BYTES} bytes, given to a salted generator")
        rows = self.mechanism.fresh_rows(t)
        self._draws.salts[self._row:] = [salt] * rows  # before any of the round's fresh rows is drawn
        try:
            flat = self._structure.step(t, self._row, out)
        except BaseException:
            del self._draws.salts[self._row:]
            raise
        self._row += rows
        self._salts.append(salt)
        self.round += 1
        return self._unflatten(flat)

    def _unflatten(self, flat: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if self._shapes is None or self.shard_count > 1:
            return flat
        out, offset = {}, 0
        for name, shape in self._shapes:
            size = math.prod(shape)
            out[name] = flat[offset : offset + size].view(shape)
            offset += size
        return out

    # ---- checkpointing ---------------------------------------------------------------
    def state_dict(self, include_seed: bool = True, copy: bool = True) -> dict[str, Any]:
        """Everything needed to continue exactly. With ``include_seed`` (the default) it
        contains the secret seed; without, a ``seed_check`` in its place, and it loads only
        into a generator constructed with the same seed. ``copy=False`` returns the live CPU
        tensors (no copy of up to p − 1 noise vectors): serialize it before the next round."""
        if not isinstance(include_seed, bool):
            raise ConfigError(f"include_seed must be True or False, got {include_seed!r}")
        secret = {"seed": self._key} if include_seed else {"seed_check": _seed_check(self._key)}
        return {
            "format": _STATE_FORMAT,
            "fingerprint": self._fingerprint,
            "kind": self.mechanism.kind,
            "rounds": self.mechanism.rounds,
            "round": self.round,
            "row": self._row,
            "total": self.total,
            "shard": (self.shard_index, self.shard_count),
            "dtype": str(self.dtype),
            "std": self.std,
            "regenerate": self.regenerate,
            "chunk_size": self.chunk_size,
            "salts": [salt.hex() for salt in self._salts],  # hex: torch.load(weights_only) refuses b""
            **secret,
            "structure": {k: [_snapshot(x, copy) for x in v] for k, v in self._structure.state().items()},
            "structure_rounds": self._structure.rounds(self.round),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint written by ``state_dict`` for the same mechanism
        (fingerprint), layout, shard, std, dtype and chunking; all is checked before anything
        changes (``CheckpointError`` for an unreadable state, ``PlanMismatch`` for another one)."""
        # formats before 3 are not bound to their mechanism: never read
        fmt = checks.state_format(state, "noise state", (_UNSALTED_FORMAT, _STATE_FORMAT))
        if state.get("fingerprint") != self._fingerprint:
            raise PlanMismatch(f"noise state was written for another mechanism (fingerprint "
                               f"{str(state.get('fingerprint'))[:80]}, expected {self._fingerprint})")
        expected = {"kind": self.mechanism.kind, "rounds": self.mechanism.rounds, "total": self.total,
                    "shard": (self.shard_index, self.shard_count), "dtype": str(self.dtype), "std": self.std,
                    "regenerate": self.regenerate, "chunk_size": self.chunk_size}
        for name, value in expected.items():
            got = state.get(name)
            if name == "shard" and isinstance(got, (tuple, list)):
                got = tuple(got)
            if got != value:
                raise PlanMismatch(f"noise state does not match this generator: {name} is {str(got)[:80]}, "
                                   f"expected {value!r}")
        key = self._state_key(state)
        t, row = self._state_position(state)
        salts = self._state_salts(state, t) if fmt == _STATE_FORMAT else [b""] * t
        self._check_structure(state, t)
        self._key = key
        self._draws.key = key
        self.round, self._row = t, row
        self._salts = salts
        self._draws.salts = [salt for s in range(t) for salt in [salts[s]] * self.mechanism.fresh_rows(s)]
        self._structure.load(state["structure"], t, row)

    @staticmethod
    def _state_salts(state: Mapping[str, Any], t: int) -> list[bytes]:
        salts = state.get("salts")
        if not (isinstance(salts, (list, tuple)) and len(salts) == t
                and all(isinstance(x, str) and len(x) in (0, 2 * SALT_BYTES) for x in salts)):
            raise CheckpointError(f"noise state must hold one salt (empty or {SALT_BYTES} bytes in hex) for each of "
                                  f"its {t} rounds")
        try:
            return [bytes.fromhex(x) for x in salts]
        except ValueError:
            raise CheckpointError("noise state holds a salt that is not hex") from None

    def _state_key(self, state: Mapping[str, Any]) -> bytes:
        if "seed" in state:
            seed = state["seed"]
            if not (isinstance(seed, (bytes, bytearray)) and 1 <= len(seed) <= 64):
                raise CheckpointError("noise state holds an invalid seed (expected 1 to 64 bytes)")
            return bytes(seed)
        if "seed_check" in state:
            if not (isinstance(state["seed_check"], str)
                    and hmac.compare_digest(state["seed_check"], _seed_check(self._key))):
                raise PlanMismatch("noise state was written with another seed (its seed_check differs from "
                                   "this generator's)")
            return self._key
        raise CheckpointError("noise state holds neither a seed nor a seed_check")

    def _state_position(self, state: Mapping[str, Any]) -> tuple[int, int]:
        t, row = state.get("round"), state.get("row")
        if not (_is_int(t) and 0 <= t <= self.mechanism.rounds):
            raise CheckpointError(f"noise state has round {str(t)[:40]}, outside 0..{self.mechanism.rounds}")
        if row != sum(self.mechanism.fresh_rows(s) for s in range(t)):
            raise CheckpointError(f"noise state has row {str(row)[:40]}, inconsistent with round {t}")
        return int(t), int(row)

    def _check_structure(self, state: Mapping[str, Any], t: int) -> None:
        structure = state.get("structure")
        labels = self._structure.rounds(t)
        if not isinstance(structure, Mapping) or set(structure) != set(labels):
            raise CheckpointError(f"noise state structure must hold {sorted(labels)} for this mechanism")
        size = self.hi - self.lo
        for name, expected in labels.items():
            tensors = structure[name]
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(expected):
                raise CheckpointError(f"noise state structure {name!r} must hold {len(expected)} tensors at round {t}")
            if not all(isinstance(x, torch.Tensor) and x.shape == (size,) for x in tensors):
                raise CheckpointError(f"noise state structure {name!r} must hold flat tensors of {size} elements")

    def shard(self, index: int, count: int) -> "NoiseGenerator":
        """A generator for the i-th of ``count`` slices, at this generator's current round."""
        if self.shard_count != 1:
            raise ConfigError("shard() splits an unsharded generator")
        child = NoiseGenerator(self.mechanism, self.layout, self.std, dtype=self.dtype, device=self.device,
                               seed=self._key, shard=(index, count), regenerate=self.regenerate,
                               chunk_size=self.chunk_size, salted=self.salted)
        child.round, child._row = self.round, self._row
        child._salts, child._draws.salts = list(self._salts), list(self._draws.salts)
        child._structure.load(self._structure.slice(child.lo, child.hi), self.round, self._row)
        return child
