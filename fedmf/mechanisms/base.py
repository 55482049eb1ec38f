"""The Mechanism interface: a factorization A = B·C of a workload, with its error metrics.

A mechanism releases x + sigma·L z, where L is a causal left inverse of the strategy C
(L C = I; L = C^{-1} when C is square) and z holds fresh Gaussian noise rows. The model,
a linear function A of the noisy sums, then carries the noise B z with B = A L.

Error metrics (noise multiplier 1, clip norm 1; ARCHITECTURE.md conventions):
    loss = (1/n)·||A L||_F^2·sens^2,  rmse = sqrt(loss),  max_error = max_i ||(A L)_i||·sens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import Any, ClassVar, Iterator, Sequence

import numpy as np

from .. import sensitivity as _sens
from ..participation import Schema
from ..workloads import Workload, WorkloadStream

__all__ = ["Mechanism", "InverseStream", "FirStream", "IirStream"]


def check_rounds(rounds: Any) -> int:
    """``rounds`` if it is a positive int, else a one-line ValueError."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    return rounds


class InverseStream(ABC):
    """Applies L row by row: ``step(z)`` takes this round's fresh noise rows
    (shape (fresh_rows, *dims)) and returns this round's correlated noise (shape dims)."""

    @abstractmethod
    def step(self, z: np.ndarray) -> np.ndarray: ...


class FirStream(InverseStream):
    """w_t = sum_{j<p} a_j z_{t-j}: a banded lower-triangular Toeplitz L (keeps p-1 past z)."""

    def __init__(self, taps: np.ndarray) -> None:
        self.taps = np.asarray(taps, dtype=np.float64)
        self.past: list[np.ndarray] = []  # most recent first

    def step(self, z: np.ndarray) -> np.ndarray:
        z = np.array(z[0], dtype=np.float64)  # a copy: the caller may reuse its buffer
        out = self.taps[0] * z
        for a, past in zip(self.taps[1:], self.past):
            out = out + a * past
        if len(self.taps) > 1:
            self.past = [z] + self.past[: len(self.taps) - 2]
        return out


class IirStream(InverseStream):
    """y_t = (z_t - sum_{r=1}^{p-1} c_r y_{t-r}) / c_0: the inverse of a banded Toeplitz C
    ("Scaling up BandMF", Alg. 1; keeps p-1 past outputs)."""

    def __init__(self, coefficients: np.ndarray) -> None:
        self.coef = np.asarray(coefficients, dtype=np.float64)
        self.past: list[np.ndarray] = []

    def step(self, z: np.ndarray) -> np.ndarray:
        acc = z[0]
        for c, past in zip(self.coef[1:], self.past):
            acc = acc - c * past
        y = acc / self.coef[0]
        if len(self.coef) > 1:
            self.past = [y.copy()] + self.past[: len(self.coef) - 2]  # the caller may modify y
        return y


class Mechanism(ABC):
    """A factorization mechanism over ``rounds`` rounds for ``workload``.

    Subclasses are immutable descriptions (their parameters); structure-specific fast
    paths are exposed through ``strategy_toeplitz``/``strategy_bands`` (C) and
    ``inverse_toeplitz`` (L), which the interpreters (sensitivity, errors, noise) use.
    """

    kind: ClassVar[str]
    rounds: int
    workload: Workload

    # ---- description -------------------------------------------------------------
    @abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON-serializable parameters that rebuild this mechanism with ``from_params``."""

    @classmethod
    @abstractmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> "Mechanism": ...

    # ---- strategy C (m x n) ------------------------------------------------------
    @property
    def strategy_toeplitz(self) -> np.ndarray | None:
        """Coefficients c_0, c_1, … when C is lower-triangular Toeplitz (zero beyond)."""
        return None

    @property
    def strategy_bands(self) -> int | None:
        """Number of bands when C is banded lower-triangular."""
        return None

    @abstractmethod
    def strategy_matrix(self) -> np.ndarray:
        """Dense C, shape (noise_rows, rounds)."""

    def strategy_columns(self, indices: Sequence[int]) -> np.ndarray:
        coef = self.strategy_toeplitz
        if coef is None:
            return self.strategy_matrix()[:, list(indices)]
        n = self.rounds
        c = np.zeros(n)
        c[: min(n, coef.size)] = coef[:n]
        out = np.zeros((n, len(indices)))
        for col, j in enumerate(indices):
            out[j:, col] = c[: n - j]
        return out

    def column_norms_sq(self) -> np.ndarray:
        coef = self.strategy_toeplitz
        if coef is None:
            return np.sum(self.strategy_matrix() ** 2, axis=0)
        c = np.zeros(self.rounds)
        c[: min(self.rounds, coef.size)] = coef[: self.rounds]
        return np.cumsum(c**2)[::-1].copy()  # column j holds c_0..c_{n-1-j}

    def gram(self) -> np.ndarray:
        c = self.strategy_matrix()
        return c.T @ c

    # ---- inverse L (n x m) ---------------------------------------------------------
    @property
    def noise_rows(self) -> int:
        """m: the number of Gaussian noise rows the mechanism consumes over the run."""
        return self.rounds

    def fresh_rows(self, t: int) -> int:
        """How many fresh noise rows round t consumes."""
        return 1

    @property
    def inverse_toeplitz(self) -> np.ndarray | None:
        """Coefficients of L when it is lower-triangular Toeplitz (length n)."""
        return None

    @abstractmethod
    def inverse_stream(self) -> InverseStream:
        """A fresh streaming applicator of L."""

    def inverse_rows(self) -> Iterator[np.ndarray]:
        """Rows of L one at a time (each of length m), by streaming the identity."""
        stream = self.inverse_stream()
        eye_offset = 0
        m = self.noise_rows
        for t in range(self.rounds):
            r = self.fresh_rows(t)
            z = np.zeros((r, m))
            z[np.arange(r), eye_offset + np.arange(r)] = 1.0
            eye_offset += r
            yield np.array(stream.step(z), dtype=np.float64)

    def inverse_matrix(self) -> np.ndarray:
        """Dense L, shape (rounds, noise_rows)."""
        coef = self.inverse_toeplitz
        if coef is not None:
            n = self.rounds
            out = np.zeros((n, n))
            for j in range(n):
                out[j:, j] = coef[: n - j]
            return out
        return np.array(list(self.inverse_rows()))

    # ---- errors ----------------------------------------------------------------------
    @cached_property
    def decoder_row_norms_sq(self) -> np.ndarray:
        """||(A L)_i||^2 for every round i (unit noise)."""
        coef = self.inverse_toeplitz
        n = self.rounds
        if coef is not None:
            return self.workload.toeplitz_row_norms_sq(coef[:n])
        stream = WorkloadStream(self.workload, self.noise_rows, n)
        return np.array([float(np.dot(row, row)) for row in map(stream.step, self.inverse_rows())])

    def sensitivity(self, schema: Schema) -> "_sens.Sensitivity":
        return _sens.sensitivity(self, schema)

    def evaluate(self, schema: Schema) -> dict[str, Any]:
        """loss, rmse, max_error and sensitivity under ``schema``."""
        sens = self.sensitivity(schema)
        norms = self.decoder_row_norms_sq
        loss = float(np.mean(norms)) * sens.value**2
        return {
            "loss": loss,
            "rmse": float(np.sqrt(loss)),
            "max_error": float(np.sqrt(np.max(norms))) * sens.value,
            **sens.to_dict(),
        }

    def loss(self, schema: Schema) -> float:
        return self.evaluate(schema)["loss"]

    def rmse(self, schema: Schema) -> float:
        return self.evaluate(schema)["rmse"]

    def max_error(self, schema: Schema) -> float:
        return self.evaluate(schema)["max_error"]
