"""One immutable description of a mechanism's streaming inverse L = C^{-1} (like jax_privacy's
``StreamingMatrix``), and its numpy interpreter.

Every mechanism lowers to exactly one of these (``Mechanism.streaming_inverse()``); the
numpy materializer here (``Mechanism.inverse_rows``/``inverse_matrix``/
``decoder_row_norms_sq``) and the torch noise generator (``fedmf.round.structures``) interpret the
description by its type, never by a mechanism's kind (tests/mechanisms/test_streaming.py checks that the two
give the same noise from the same draws, for every type):

    Fir(taps)            banded lower-triangular Toeplitz L: w_t = sum_{j<p} a_j z_{t-j}
    Iir(bands)           banded C, Toeplitz (p,) or general (p, n): y_t = (z_t - sum_r C[t,t-r] y_{t-r}) / C[t,t]
    Blt(decay, scale)    L itself a BLT: x_t = z_t + sum_i scale_i buf_i ; buf_i <- decay_i buf_i + z_t
    Tree(alpha)          binary tree with Honaker's decoder (round t consumes tz(t+1) + 1 fresh rows)
    Dense(inverse)       any causal L, applied row by row from the explicit matrix
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, HorizonReached

__all__ = ["StreamingInverse", "Fir", "Iir", "Blt", "Tree", "Dense", "InverseStream", "numpy_stream",
           "tree_fresh_rows"]


def _frozen(values: Any, name: str, ndim: tuple[int, ...]) -> np.ndarray:
    arr = np.array(values, dtype=np.float64)
    if arr.ndim not in ndim or arr.size == 0:
        raise ConfigError(f"{name} must be a non-empty array with {' or '.join(map(str, ndim))} dimensions, "
                          f"got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError(f"{name} must be finite")
    arr.setflags(write=False)
    return arr


def tree_fresh_rows(t: int) -> int:
    """Fresh rows of round t of the binary tree: one per dyadic node completed at t (tz(t+1) + 1)."""
    return ((t + 1) & -(t + 1)).bit_length()


class StreamingInverse(ABC):
    """A frozen description of L = C^{-1} that a streaming interpreter can apply round by round."""

    @abstractmethod
    def fresh_rows(self, t: int) -> int:
        """How many fresh noise rows round t consumes."""


@dataclass(frozen=True, eq=False)
class Fir(StreamingInverse):
    """Banded lower-triangular Toeplitz L with coefficients a_0..a_{p-1} ("Beyond Square Roots",
    Sec. 4: banded C^{-1}); keeps the p - 1 past fresh rows."""

    taps: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "taps", _frozen(self.taps, "Fir taps", (1,)))

    def fresh_rows(self, t: int) -> int:
        return 1


@dataclass(frozen=True, eq=False)
class Iir(StreamingInverse):
    """Banded lower-triangular C by bands, ``bands[r]`` (Toeplitz, shape (p,)) or ``bands[r, j] =
    C[j + r, j]`` (general, shape (p, n)); L z by "Scaling up BandMF", Alg. 1 (p - 1 past outputs)."""

    bands: np.ndarray

    def __post_init__(self) -> None:
        bands = _frozen(self.bands, "Iir bands", (1, 2))
        if np.any(bands[0] == 0):
            raise ConfigError("Iir bands need a non-zero diagonal")
        object.__setattr__(self, "bands", bands)

    @property
    def num_bands(self) -> int:
        return int(self.bands.shape[0])

    @property
    def horizon(self) -> int | None:
        """Rounds covered (general bands), or None (Toeplitz: any)."""
        return None if self.bands.ndim == 1 else int(self.bands.shape[1])

    def coefficient(self, r: int, t: int) -> float:
        """C[t, t - r]."""
        return float(self.bands[r] if self.bands.ndim == 1 else self.bands[r, t - r])

    def fresh_rows(self, t: int) -> int:
        return 1


@dataclass(frozen=True, eq=False)
class Blt(StreamingInverse):
    """L itself a buffered linear Toeplitz matrix with coefficients 1, sum_i scale_i decay_i^(t-1)
    (McMahan et al. 2024, arXiv 2408.08868, Alg. 2): m buffers, each updated every round."""

    decay: np.ndarray
    scale: np.ndarray

    def __post_init__(self) -> None:
        decay, scale = _frozen(self.decay, "Blt decay", (1,)), _frozen(self.scale, "Blt scale", (1,))
        if decay.shape != scale.shape:
            raise ConfigError(f"Blt decay and scale need equal lengths, got {decay.size} and {scale.size}")
        object.__setattr__(self, "decay", decay)
        object.__setattr__(self, "scale", scale)

    def fresh_rows(self, t: int) -> int:
        return 1


@dataclass(frozen=True, eq=False)
class Tree(StreamingInverse):
    """Binary-tree aggregation with Honaker's decoder (fedmf.mechanisms.tree): ``alpha[h]`` is
    the weight of a height-h node's own release in its estimate; O(log n) node estimates."""

    alpha: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", _frozen(self.alpha, "Tree alpha", (1,)))

    def fresh_rows(self, t: int) -> int:
        return tree_fresh_rows(t)


@dataclass(frozen=True, eq=False)
class Dense(StreamingInverse):
    """Any causal L given explicitly, shape (rounds, noise_rows); row t is applied to every
    fresh row drawn so far (O(t) work per round, no state beyond the draws)."""

    inverse: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "inverse", _frozen(self.inverse, "Dense inverse", (2,)))

    def fresh_rows(self, t: int) -> int:
        return 1


# ---- the numpy interpreter -------------------------------------------------------------
# Works on numpy arrays (float64) and, for callers that stream torch tensors, on tensors:
# only arithmetic operators plus the two helpers below touch the values.


def _copy(x: Any) -> Any:
    return x.clone() if hasattr(x, "clone") else np.array(x, dtype=np.float64)


def _zeros(shape: tuple[int, ...], like: Any) -> Any:
    return like.new_zeros(shape) if hasattr(like, "new_zeros") else np.zeros(shape)


class InverseStream(ABC):
    """Applies L row by row: ``step(z)`` takes this round's fresh noise rows
    (shape (fresh_rows, *dims)) and returns this round's correlated noise (shape dims)."""

    @abstractmethod
    def step(self, z: Any) -> Any: ...


class _FirStream(InverseStream):
    def __init__(self, spec: Fir) -> None:
        self.taps = spec.taps
        self.past: list[Any] = []  # most recent first

    def step(self, z: Any) -> Any:
        z = _copy(z[0])  # a copy: the caller may reuse its buffer
        out = float(self.taps[0]) * z
        for a, past in zip(self.taps[1:], self.past):
            out = out + float(a) * past
        if len(self.taps) > 1:
            self.past = [z] + self.past[: len(self.taps) - 2]
        return out


class _IirStream(InverseStream):
    def __init__(self, spec: Iir) -> None:
        self.spec = spec
        self.past: list[Any] = []
        self.t = 0

    def step(self, z: Any) -> Any:
        t, spec = self.t, self.spec
        if spec.horizon is not None and t >= spec.horizon:
            raise HorizonReached(f"the banded strategy has {spec.horizon} rounds; round {t} is past the end")
        acc = z[0]
        for r, past in enumerate(self.past, start=1):
            acc = acc - spec.coefficient(r, t) * past
        y = acc / spec.coefficient(0, t)
        if spec.num_bands > 1:
            self.past = [_copy(y)] + self.past[: spec.num_bands - 2]  # the caller may modify y
        self.t += 1
        return y


class _BltStream(InverseStream):
    def __init__(self, spec: Blt) -> None:
        self.spec = spec
        self.buffers: list[Any] | None = None

    def step(self, z: Any) -> Any:
        z0 = z[0]
        if self.buffers is None:
            self.buffers = [_zeros(tuple(z0.shape), z0) for _ in self.spec.decay]
        out = _copy(z0)
        for w, buf in zip(self.spec.scale, self.buffers):
            out = out + float(w) * buf
        self.buffers = [float(d) * buf + z0 for d, buf in zip(self.spec.decay, self.buffers)]
        return out


class _TreeStream(InverseStream):
    """Online Honaker estimates: a stack of node estimates for the current decomposition."""

    def __init__(self, spec: Tree) -> None:
        self.alpha = spec.alpha
        self.stack: list[Any] = []
        self.t = 0

    def step(self, z: Any) -> Any:
        height = tree_fresh_rows(self.t) - 1
        if z.shape[0] != height + 1:
            raise ConfigError(f"round {self.t} of the tree needs {height + 1} fresh noise rows, got {z.shape[0]}")
        estimate = _copy(z[0])
        removed = None
        for h in range(1, height + 1):
            left = self.stack.pop()
            removed = left if removed is None else removed + left
            a = float(self.alpha[h])
            estimate = a * z[h] + (1 - a) * (left + estimate)
        self.stack.append(estimate)
        self.t += 1
        # noise of round t = prefix estimate(t) - prefix estimate(t-1) = new node - merged nodes
        return _copy(estimate) if removed is None else estimate - removed


class _DenseStream(InverseStream):
    def __init__(self, spec: Dense) -> None:
        self.inverse = spec.inverse
        self.rows: list[Any] = []
        self.t = 0

    def step(self, z: Any) -> Any:
        t, (n, m) = self.t, self.inverse.shape
        if t >= n:
            raise HorizonReached(f"the dense mechanism has {n} rounds; round {t} is past the end")
        self.rows.extend(_copy(z[i]) for i in range(z.shape[0]))
        if len(self.rows) > m:
            raise ConfigError(f"round {t} brings the fresh rows to {len(self.rows)}, more than the {m} of L")
        out = _zeros(tuple(z[0].shape), z[0])
        for s, row in enumerate(self.rows):
            if self.inverse[t, s] != 0:
                out = out + float(self.inverse[t, s]) * row
        self.t += 1
        return out


_NUMPY = {Fir: _FirStream, Iir: _IirStream, Blt: _BltStream, Tree: _TreeStream, Dense: _DenseStream}


def numpy_stream(spec: StreamingInverse) -> InverseStream:
    """A fresh numpy (or torch-tensor) applicator of the described L."""
    try:
        return _NUMPY[type(spec)](spec)
    except KeyError:
        raise TypeError(f"no numpy interpreter for {type(spec).__name__}") from None
