"""Streaming correlated noise in torch: the noise of round t is std·(L z)_t, L = C^{-1}.

Fresh Gaussian rows z_r are counter-based: the values of row r in chunk c of the flat
parameter vector come from a generator seeded with a keyed hash of (secret seed, r, c)
(BLAKE2b; values by ``fedmf.normal``, tails to 8.6σ), so any past draw can be regenerated
exactly and any slice of the parameters (a shard) can be produced alone and equals the same
slice of the unsharded noise
("Scaling up BandMF", Sec. 3.3: coordinate-wise independence).

State is bounded by the mechanism's structure ("Scaling up BandMF" Alg. 1 for banded C;
"Beyond Square Roots" Sec. 4 for banded C^{-1}; McMahan et al. 2024 for BLT buffers):
  banded C^{-1} (dp-sgd, bisr, bifr)   p - 1 past fresh draws (or none with regenerate=True)
  banded C (bsr, banded-toeplitz, robust, banded)   p - 1 past outputs
  blt                                  m buffers
  tree                                 O(log n) node estimates
  anything else (dense)                nothing: past draws are regenerated, O(t·d) per round

The seed is a secret (anyone holding it can subtract the noise): it is never printed,
logged or put in error messages; ``state_dict()`` contains it and must be stored like a key.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch

from .mechanisms.base import Mechanism
from .normal import fill_normal

__all__ = ["NoiseGenerator", "Layout", "CHUNK_SIZE"]

Layout = Union[int, Mapping[str, Sequence[int]]]
CHUNK_SIZE = 1 << 18
#: on CPU a round's arithmetic runs block by block so each output block stays in cache
BLOCK_SIZE = 1 << 19
_STATE_FORMAT = 2  # 2: draws by fedmf.normal, std folded into the draws and the state


def _key(seed: bytes | int | None) -> bytes:
    if seed is None:
        return secrets.token_bytes(32)
    if isinstance(seed, int) and not isinstance(seed, bool):
        if seed < 0:
            raise ValueError("an integer seed must be non-negative")
        return seed.to_bytes(max(1, (seed.bit_length() + 7) // 8), "little")
    if isinstance(seed, (bytes, bytearray)) and 1 <= len(seed) <= 64:
        return bytes(seed)
    raise ValueError("seed must be None, a non-negative int, or 1 to 64 bytes")


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
    threads; each chunk has its own seed, so the result does not depend on the thread count."""

    def __init__(self, key: bytes, total: int, lo: int, hi: int, dtype: torch.dtype, device: torch.device,
                 chunk: int, scale: float = 1.0) -> None:
        self.key, self.total, self.lo, self.hi = key, total, lo, hi
        self.dtype, self.device, self.chunk, self.scale = dtype, device, chunk, float(scale)

    def _seed(self, row: int, chunk: int) -> int:
        h = hashlib.blake2b(struct.pack("<QQ", row, chunk), key=self.key, digest_size=16, person=b"fedmf-noise-v2")
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
    """Interprets one mechanism's L for the generator: ``step(t, row, out)`` writes (L z)_t
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

    def state(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any], t: int, row: int) -> None:
        pass

    def slice(self, lo: int, hi: int) -> dict[str, Any]:
        """The state restricted to the flat range [lo, hi) of this structure's range."""
        return {k: [x[lo:hi].clone() for x in v] if isinstance(v, list) else v for k, v in self.state().items()}


class _Fir(_Structure):
    """w_t = sum_{j<p} a_j z_{t-j} (banded lower-triangular Toeplitz L), one fused pass:
    reads the p - 1 kept draws once and writes w_t once."""

    def __init__(self, draws: _Draws, taps: np.ndarray, regenerate: bool) -> None:
        super().__init__(draws)
        self.taps = [float(a) for a in taps]
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

    def load(self, state: dict[str, Any], t: int, row: int) -> None:
        # the past fresh draws are regenerated from the seed: nothing to store
        self.spare = None
        if not self.regenerate:
            self.past = [self.draws.new(row - j) for j in range(1, min(len(self.taps) - 1, t) + 1)]


class _Iir(_Structure):
    """y_t = (z_t - sum_{r=1}^{p-1} C[t, t-r] y_{t-r}) / C[t, t] for banded C
    ("Scaling up BandMF", Alg. 1); Toeplitz C has constant bands. One fused pass; y_t
    overwrites the oldest kept output piece by piece once that piece has been read."""

    def __init__(self, draws: _Draws, bands: np.ndarray) -> None:
        super().__init__(draws)
        self.bands = np.asarray(bands, dtype=np.float64)  # (p,) Toeplitz or (p, n) general
        self.past: list[torch.Tensor] = []

    def _coef(self, r: int, t: int) -> float:
        return float(self.bands[r] if self.bands.ndim == 1 else self.bands[r, t - r])

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        p = self.bands.shape[0]
        coefs = [-self._coef(r, t) for r in range(1, len(self.past) + 1)]
        inverse_diagonal = 1.0 / self._coef(0, t)
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

    def state(self) -> dict[str, Any]:
        return {"outputs": list(self.past)}

    def load(self, state: dict[str, Any], t: int, row: int) -> None:
        self.past = self._restore(state["outputs"])


class _Blt(_Structure):
    """C^{-1} as a BLT: x_t = z_t + sum_i w_i buf_i ; buf_i <- d_i buf_i + z_t, where
    C^{-1} has coefficients 1, sum_i w_i d_i^(t-1) (McMahan et al. 2024, arXiv 2408.08868, Alg. 2).
    One fused pass over z and the m buffers."""

    def __init__(self, draws: _Draws, decay: np.ndarray, scale: np.ndarray) -> None:
        super().__init__(draws)
        self.decay = [float(x) for x in decay]
        self.scale = [float(x) for x in scale]
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

    def state(self) -> dict[str, Any]:
        return {"buffers": list(self.buffers)}

    def load(self, state: dict[str, Any], t: int, row: int) -> None:
        self.buffers = self._restore(state["buffers"])


class _Tree(_Structure):
    """Online Honaker estimates (fedmf.mechanisms.tree): a stack of node estimates."""

    def __init__(self, draws: _Draws, alpha: np.ndarray) -> None:
        super().__init__(draws)
        self.alpha = [float(a) for a in alpha]
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

    def state(self) -> dict[str, Any]:
        return {"stack": list(self.stack)}

    def load(self, state: dict[str, Any], t: int, row: int) -> None:
        self.stack = self._restore(state["stack"])


class _Dense(_Structure):
    """w_t = sum_{s<=t} L[t, s] z_s with every past draw regenerated: O(d) memory, O(t·d) time."""

    def __init__(self, draws: _Draws, inverse: np.ndarray) -> None:
        super().__init__(draws)
        self.inverse = np.asarray(inverse, dtype=np.float64)

    def step(self, t: int, row: int, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        scratch = torch.empty_like(out)
        for s in np.flatnonzero(self.inverse[t]):
            out.add_(self.draws.fill(int(s), scratch), alpha=float(self.inverse[t, s]))
        return out


def _structure(mechanism: Mechanism, draws: _Draws, regenerate: bool) -> _Structure:
    kind = mechanism.kind
    if kind == "dp-sgd":
        return _Fir(draws, np.ones(1), regenerate)
    if hasattr(mechanism, "inverse_coefficients"):  # bisr, bifr, banded-inverse-toeplitz
        return _Fir(draws, mechanism.inverse_coefficients, regenerate)
    if kind == "banded":
        return _Iir(draws, mechanism.bands)
    if kind == "blt":
        return _Blt(draws, mechanism.inverse_buf_decay, mechanism.inverse_output_scale)
    if kind == "tree":
        from .mechanisms.tree import honaker_weights

        return _Tree(draws, honaker_weights(mechanism.height))
    if getattr(mechanism, "strategy_bands", None) is not None and mechanism.strategy_toeplitz is not None:
        return _Iir(draws, mechanism.strategy_toeplitz)  # bsr, banded-toeplitz, robust
    return _Dense(draws, mechanism.inverse_matrix())


def _layout_size(layout: Layout) -> tuple[int, list[tuple[str, tuple[int, ...]]] | None]:
    if isinstance(layout, int) and not isinstance(layout, bool):
        if layout <= 0:
            raise ValueError(f"layout size must be positive, got {layout}")
        return layout, None
    if isinstance(layout, Mapping) and layout:
        shapes = [(str(k), tuple(int(x) for x in v)) for k, v in layout.items()]
        if any(x < 0 for _, s in shapes for x in s):
            raise ValueError("layout shapes must be non-negative")
        total = sum(math.prod(s) for _, s in shapes)
        if total <= 0:
            raise ValueError("layout has no parameters")
        return total, shapes
    raise ValueError("layout must be a positive int or a non-empty mapping name -> shape")


class NoiseGenerator:
    """Correlated noise for each round of ``mechanism``, in ``layout``, scaled by ``std``.

    ``next()`` returns round t's noise std·(C^{-1} z)_t (a dict of tensors for a dict
    layout, else a flat tensor) in ``dtype`` on ``device``. Same seed, mechanism, layout,
    device and dtype ⇒ bit-identical noise. ``shard=(i, s)`` produces only the i-th of s
    contiguous slices of the flattened parameters; the slices concatenate to the full noise.
    """

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
    ) -> None:
        if not math.isfinite(std) or std < 0:
            raise ValueError(f"std must be a finite non-negative number, got {std}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.mechanism = mechanism
        self.layout = layout
        self.total, self._shapes = _layout_size(layout)
        self.std = float(std)
        self.dtype = dtype
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:  # tensors report cuda:N, never bare cuda
            self.device = torch.device("cuda", torch.cuda.current_device())
        index, count = shard
        if not (isinstance(count, int) and isinstance(index, int) and count >= 1 and 0 <= index < count):
            raise ValueError(f"shard must be (i, s) with 0 <= i < s, got {shard}")
        self.shard_index, self.shard_count = index, count
        self.lo, self.hi = self.total * index // count, self.total * (index + 1) // count
        self.regenerate = regenerate
        self.chunk_size = int(chunk_size)
        self._key = _key(seed)
        self._draws = _Draws(self._key, self.total, self.lo, self.hi, dtype, self.device, self.chunk_size,
                             self.std)
        self._structure = _structure(mechanism, self._draws, regenerate)
        self.round = 0
        self._row = 0  # next fresh noise row

    def __repr__(self) -> str:  # never shows the seed
        return (f"NoiseGenerator(kind={self.mechanism.kind!r}, rounds={self.mechanism.rounds}, round={self.round}, "
                f"size={self.hi - self.lo}/{self.total}, dtype={self.dtype}, device={self.device})")

    @property
    def rounds(self) -> int:
        return self.mechanism.rounds

    def next(self, out: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """The noise of the next round; raises once the mechanism's horizon is reached.

        ``out``: an optional flat, contiguous tensor of this shard's size, dtype and device to
        write into (reusing one buffer saves a fresh allocation, and its page faults, per round);
        the result is then a view of ``out``, overwritten by the next call that gets the same
        ``out``: copy it (or add it to the model) before asking for the next round."""
        t = self.round
        if t >= self.mechanism.rounds:
            raise RuntimeError(
                f"noise for round {t} requested, but the mechanism covers rounds 0..{self.mechanism.rounds - 1}; "
                "noise is never repeated or reused"
            )
        size = self.hi - self.lo
        if out is None:
            out = torch.empty(size, dtype=self.dtype, device=self.device)
        elif not (isinstance(out, torch.Tensor) and out.shape == (size,) and out.dtype == self.dtype
                  and out.device == self.device and out.is_contiguous()):
            raise ValueError(f"out must be a contiguous flat tensor of {size} elements, dtype {self.dtype}, "
                             f"device {self.device}")
        flat = self._structure.step(t, self._row, out)
        self._row += self.mechanism.fresh_rows(t)
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
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (contains the secret seed)."""
        return {
            "format": _STATE_FORMAT,
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
            "seed": self._key,
            "structure": {k: [x.detach().cpu().clone() for x in v] for k, v in self._structure.state().items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint written by ``state_dict`` for the same mechanism and layout."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unsupported noise state format {state.get('format')!r} (this fedmf writes and reads "
                             f"format {_STATE_FORMAT}; format 1 used another sampler and unscaled state)")
        expected = {"kind": self.mechanism.kind, "rounds": self.mechanism.rounds, "total": self.total,
                    "shard": (self.shard_index, self.shard_count), "dtype": str(self.dtype), "std": self.std,
                    "regenerate": self.regenerate, "chunk_size": self.chunk_size}
        for name, value in expected.items():
            got = tuple(state[name]) if name == "shard" else state.get(name)
            if got != value:
                raise ValueError(f"noise state does not match this generator: {name} is {got!r}, expected {value!r}")
        self._key = bytes(state["seed"])
        self._draws.key = self._key
        self.round, self._row = int(state["round"]), int(state["row"])
        self._structure.load(state["structure"], self.round, self._row)

    def shard(self, index: int, count: int) -> "NoiseGenerator":
        """A generator for the i-th of ``count`` slices, at this generator's current round."""
        if self.shard_count != 1:
            raise ValueError("shard() splits an unsharded generator")
        child = NoiseGenerator(self.mechanism, self.layout, self.std, dtype=self.dtype, device=self.device,
                               seed=self._key, shard=(index, count), regenerate=self.regenerate,
                               chunk_size=self.chunk_size)
        child.round, child._row = self.round, self._row
        child._structure.load(self._structure.slice(child.lo, child.hi), self.round, self._row)
        return child
