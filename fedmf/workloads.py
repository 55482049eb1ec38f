"""Workloads A: the linear map from the stream of summed updates to the model trajectory.

A workload is SGD with heavy-ball momentum ``beta`` and a per-round learning-rate
schedule ``lr``; plain prefix sums are the special case beta = 0, lr = 1.

    m_t = beta * m_{t-1} + x_t ;  theta_t = theta_{t-1} + lr_t * m_t
    A[i, j] = sum_{s=j}^{i} lr_s * beta^(s-j)          (i >= j)

Source: "Multi-Epoch Matrix Factorization Mechanisms" (Choquette-Choo et al. 2023),
Sec. 5.2 / App. F (momentum 0.95 with a linear learning-rate cooldown over the last
25% of rounds to 0.05x); the 2-buffer streaming form is "Scaling up the Banded Matrix
Factorization Mechanism" App. D.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError
from .filters import toeplitz_solve

__all__ = ["Workload", "parse_workload"]


@dataclass(frozen=True)
class Workload:
    """SGD with momentum and a learning-rate schedule (prefix sum when both are trivial).

    ``cooldown`` is the fraction of final rounds over which the learning rate decays
    linearly from 1 to ``cooldown_final`` (0 means a constant learning rate).
    """

    momentum: float = 0.0
    cooldown: float = 0.0
    cooldown_final: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must lie in [0, 1), got {self.momentum}")
        if not 0.0 <= self.cooldown <= 1.0:
            raise ConfigError(f"cooldown fraction must lie in [0, 1], got {self.cooldown}")
        if not 0.0 < self.cooldown_final <= 1.0:
            raise ConfigError(f"cooldown final factor must lie in (0, 1], got {self.cooldown_final}")

    @classmethod
    def prefix(cls) -> Workload:
        return cls()

    @property
    def is_prefix(self) -> bool:
        return self.momentum == 0.0 and self.cooldown == 0.0

    @property
    def name(self) -> str:
        if self.is_prefix:
            return "prefix"
        text = f"momentum:{self.momentum!r}"
        if self.cooldown:
            text += f":cooldown={self.cooldown!r}"
            if self.cooldown_final != 0.05:
                text += f":final={self.cooldown_final!r}"
        return text

    def to_dict(self) -> dict:
        return {"momentum": self.momentum, "cooldown": self.cooldown, "cooldown_final": self.cooldown_final}

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        values = [data["momentum"], data["cooldown"], data["cooldown_final"]]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ConfigError("workload parameters must be numbers")
        return cls(*(float(v) for v in values))

    def learning_rates(self, n: int) -> np.ndarray:
        """Per-round learning rates; the cooldown follows the seed paper's code:
        lr[-c:] = linspace(1, final, c) with c = floor(cooldown * n)."""
        lr = np.ones(n)
        c = int(np.floor(self.cooldown * n))
        if c > 0:
            lr[n - c :] = np.linspace(1.0, self.cooldown_final, c)
        return lr

    @property
    def is_toeplitz(self) -> bool:
        """A constant learning rate makes A Toeplitz."""
        return self.cooldown == 0.0

    def toeplitz_coefficients(self, n: int) -> np.ndarray:
        """First column of A when A is Toeplitz: a_j = (1 - beta^(j+1)) / (1 - beta)."""
        if not self.is_toeplitz:
            raise ConfigError("a workload with a learning-rate cooldown is not Toeplitz")
        return self.apply_toeplitz(np.eye(1, n).ravel())

    def apply_toeplitz(self, coefficients: np.ndarray) -> np.ndarray:
        """Coefficients of A·T for a lower-triangular Toeplitz T (A Toeplitz): O(n)."""
        out = np.asarray(coefficients, dtype=np.float64)
        if self.momentum:
            out = toeplitz_solve([1.0, -self.momentum], out)
        return np.cumsum(out)

    def apply(self, rows: np.ndarray) -> np.ndarray:
        """A @ rows for an (n, m) array, by the 2-buffer recursion along axis 0."""
        rows = np.asarray(rows, dtype=np.float64)
        n = rows.shape[0]
        out = toeplitz_solve([1.0, -self.momentum], rows) if self.momentum else rows.copy()
        if self.cooldown:
            out *= self.learning_rates(n).reshape((n,) + (1,) * (rows.ndim - 1))
        return np.cumsum(out, axis=0)

    def toeplitz_row_norms_sq(self, coefficients: np.ndarray, block: int = 512) -> np.ndarray:
        """||(A·T)_i||^2 for every row i of A·T, T lower-triangular Toeplitz with the given
        n coefficients. O(n) for a Toeplitz A; O(n^2) in column blocks otherwise, using
        (A·T)[i, j] = sum_{s=j}^{i} lr_s·u_{s-j} with u the coefficients of M_beta·T."""
        n = len(coefficients)
        if self.is_toeplitz:
            return np.cumsum(self.apply_toeplitz(coefficients) ** 2)
        u = np.asarray(coefficients, dtype=np.float64)
        if self.momentum:
            u = toeplitz_solve([1.0, -self.momentum], u)
        lr = self.learning_rates(n)
        block = min(block, n)
        padded = np.concatenate([np.zeros(n), u])
        windows = np.lib.stride_tricks.sliding_window_view(padded, block)
        norms = np.zeros(n)
        for j0 in range(0, n, block):
            width = min(block, n - j0)
            # rows s >= j0 of column j0 + c hold u_{s - j0 - c} (zero above the diagonal)
            start = n - block + 1
            cols = windows[start : start + n - j0, ::-1][:, :width] * lr[j0:, None]
            np.cumsum(cols, axis=0, out=cols)
            norms[j0:] += np.einsum("ij,ij->i", cols, cols)
        return norms

    def matrix(self, n: int) -> np.ndarray:
        """Dense n x n lower-triangular A."""
        return self.apply(np.eye(n))


class WorkloadStream:
    """Row-by-row application of A over ``rounds`` rounds: feed row t of M, get row t of A·M."""

    def __init__(self, workload: Workload, width: int, rounds: int) -> None:
        self._beta = workload.momentum
        self._lr = workload.learning_rates(rounds)
        self._momentum = np.zeros(width)
        self._total = np.zeros(width)
        self._t = 0

    def step(self, row: np.ndarray) -> np.ndarray:
        self._momentum *= self._beta
        self._momentum += row
        self._total += self._lr[self._t] * self._momentum
        self._t += 1
        return self._total.copy()


def parse_workload(text: str) -> Workload:
    """Parse ``prefix`` or ``momentum:BETA[:cooldown=FRACTION][:final=FACTOR]``."""
    parts = text.strip().split(":")
    if parts == ["prefix"]:
        return Workload.prefix()
    if parts[0] != "momentum" or len(parts) < 2:
        raise ConfigError(f"unknown workload {text!r} (expected prefix or momentum:BETA[:cooldown=F][:final=G])")
    try:
        beta = float(parts[1])
        options = {}
        for item in parts[2:]:
            key, _, value = item.partition("=")
            if key not in ("cooldown", "final") or key in options or (key == "final" and not value):
                raise ValueError
            options[key] = float(value) if value else 0.25
    except ValueError:
        raise ConfigError(f"cannot parse workload {text!r} (expected momentum:BETA[:cooldown=F][:final=G])") from None
    if "final" in options and not options.get("cooldown"):
        raise ConfigError(f"workload {text!r}: final=G needs a cooldown")
    return Workload(beta, options.get("cooldown", 0.0), options.get("final", 0.05))
