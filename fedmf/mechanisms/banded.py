"""BandMF: a general banded lower-triangular C with unit-norm columns.

Parameterization ("Scaling up BandMF", Sec. 3.1, indices corrected in the notes):
Theta in R^{p x n}, C[j + r, j] = Theta[r, j] / ||Theta[:, j]|| (entries past row n
ignored), so every column has norm 1 and, with p <= b, sens = sqrt(k) exactly.

Objective: ||A C^{-1}||_F^2 (its Alg. 3 computes it row by row). Here it is computed
column block by column block — column a of C^{-1} is a banded triangular solve that starts
at row a, so each block works on the trailing sub-problem — with the adjoint gradient
    dF/dC = -C^{-T} (2 A^T A C^{-1}) C^{-T},
of which only the p bands are accumulated: O(n^2 p) time and O(n·block) memory per
evaluation (the paper's autodiff needs O(n^2 p) memory without checkpointing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..participation import MinSep, Schema
from ..workloads import Workload
from .base import OPTIMIZED, Mechanism, default_bands
from .optimize import OptimizationResult, ProgressCallback, lbfgs
from .streaming import Iir

__all__ = ["ColumnNormalizedBanded", "BandedObjective", "optimize_banded"]


class _BlockBanded:
    """A banded lower-triangular C split into row blocks of size s >= p, so that C is
    block lower-bidiagonal: solves become two small dense products per block (BLAS-3)
    instead of a column-at-a-time banded substitution."""

    def __init__(self, bands: np.ndarray, size: int) -> None:
        p, n = bands.shape
        self.n, self.size = n, max(size, p)
        self.starts = list(range(0, n, self.size))
        self.diag_inv: list[np.ndarray] = []
        self.sub: list[np.ndarray | None] = []  # C[R_k, R_{k-1}]
        for k, r0 in enumerate(self.starts):
            r1 = min(r0 + self.size, n)
            self.diag_inv.append(np.linalg.inv(self._dense(bands, r0, r1, r0, r1)))
            self.sub.append(None if k == 0 else self._dense(bands, r0, r1, r0 - self.size, r0))

    @staticmethod
    def _dense(bands: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        out = np.zeros((r1 - r0, c1 - c0))
        p = bands.shape[0]
        for j in range(c0, c1):
            lo, hi = max(j, r0), min(j + p, r1)
            if lo < hi:
                out[lo - r0 : hi - r0, j - c0] = bands[lo - j : hi - j, j]
        return out

    def solve(self, rhs: np.ndarray, first: int = 0) -> np.ndarray:
        """C[first:, first:]^{-1} rhs, with ``first`` a multiple of the block size."""
        x = np.empty_like(rhs)
        k0 = first // self.size
        prev = None
        for k in range(k0, len(self.starts)):
            r0 = self.starts[k] - first
            r1 = min(r0 + self.size, rhs.shape[0])
            b = rhs[r0:r1] if prev is None else rhs[r0:r1] - self.sub[k] @ prev
            x[r0:r1] = prev = self.diag_inv[k] @ b
        return x

    def solve_transpose(self, rhs: np.ndarray, first: int = 0) -> np.ndarray:
        """C[first:, first:]^{-T} rhs."""
        x = np.empty_like(rhs)
        k0 = first // self.size
        nxt = None
        for k in range(len(self.starts) - 1, k0 - 1, -1):
            r0 = self.starts[k] - first
            r1 = min(r0 + self.size, rhs.shape[0])
            b = rhs[r0:r1] if nxt is None else rhs[r0:r1] - self.sub[k + 1].T @ nxt
            x[r0:r1] = nxt = self.diag_inv[k].T @ b
        return x


def _workload_apply(workload: Workload, lr: np.ndarray, x: np.ndarray) -> np.ndarray:
    """A x along axis 0 for the workload restricted to rounds with learning rates ``lr``."""
    y = x
    if workload.momentum:
        from ..filters import toeplitz_solve

        y = toeplitz_solve([1.0, -workload.momentum], y)
    if workload.cooldown:
        y = y * lr[:, None]
    return np.cumsum(y, axis=0)


def _workload_apply_transpose(workload: Workload, lr: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A^T y along axis 0: A^T = M_beta^T diag(lr) S^T (suffix sums, then the reversed filter)."""
    x = np.cumsum(y[::-1], axis=0)[::-1]
    if workload.cooldown:
        x = x * lr[:, None]
    if workload.momentum:
        from ..filters import toeplitz_solve

        x = toeplitz_solve([1.0, -workload.momentum], x[::-1])[::-1]
    return x


def _normalized(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mask entries past row n and scale each column to unit norm; returns (bands, norms)."""
    p, n = theta.shape
    mask = (np.arange(p)[:, None] + np.arange(n)[None, :]) < n
    masked = np.where(mask, theta, 0.0)
    norms = np.sqrt(np.sum(masked**2, axis=0))
    return masked / norms, norms


@dataclass(frozen=True)
class BandedObjective:
    """F(Theta) = ||A C(Theta)^{-1}||_F^2 and its gradient, by column blocks."""

    rounds: int
    workload: Workload
    block: int = 1024

    def __call__(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        bands, norms = _normalized(theta)
        if not np.all(np.isfinite(bands)) or np.any(bands[0] <= 0):
            return math.inf, np.zeros_like(theta)
        value, grad_bands = self.value_and_band_gradient(bands)
        # chain rule through K = Theta / ||Theta_col||: (G - K (K·G)) / norm
        dot = np.sum(bands * grad_bands, axis=0)
        grad = (grad_bands - bands * dot) / norms
        mask = (np.arange(theta.shape[0])[:, None] + np.arange(self.rounds)[None, :]) < self.rounds
        return value, np.where(mask, grad, 0.0)

    def value_and_band_gradient(self, bands: np.ndarray) -> tuple[float, np.ndarray]:
        n, p = self.rounds, bands.shape[0]
        lr = self.workload.learning_rates(n)
        value = 0.0
        grad = np.zeros_like(bands)
        solver = _BlockBanded(bands, max(128, p))
        block = solver.size * max(1, self.block // solver.size)
        for a0 in range(0, n, block):
            width = min(block, n - a0)
            m = n - a0
            rhs = np.zeros((m, width))
            rhs[np.arange(width), np.arange(width)] = 1.0
            inv_cols = solver.solve(rhs, a0)  # columns a0.. of C^{-1}, rows a0..
            out = _workload_apply(self.workload, lr[a0:], inv_cols)
            value += float(np.einsum("ij,ij->", out, out))
            g = 2.0 * _workload_apply_transpose(self.workload, lr[a0:], out)
            lam = solver.solve_transpose(g, a0)
            for r in range(min(p, m)):
                grad[r, a0 : n - r] -= np.einsum("ij,ij->i", lam[r:], inv_cols[: m - r])
        return value, grad


@dataclass(frozen=True, eq=False)
class ColumnNormalizedBanded(Mechanism):
    """A banded lower-triangular C with unit-norm columns, stored by bands:
    ``bands[r, j] = C[j + r, j]``."""

    kind = "banded"
    made_by = OPTIMIZED
    banded = bands_within_min_sep = True
    options = ("tolerance", "max_steps", "progress")
    rounds: int
    bands: np.ndarray
    workload: Workload = Workload()

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[ColumnNormalizedBanded, OptimizationResult]:
        p = default_bands(rounds, schema) if num_bands is None else num_bands
        return optimize_banded(rounds, p, schema, workload, **options)

    def __post_init__(self) -> None:
        b = np.array(self.bands, dtype=np.float64)
        if b.ndim != 2 or b.shape[1] != self.rounds or not 1 <= b.shape[0] <= self.rounds:
            raise ConfigError(f"bands must have shape (p, rounds={self.rounds}) with 1 <= p <= rounds")
        normalized, norms = _normalized(b)
        if np.allclose(norms, 1.0, rtol=0, atol=4e-16):  # already normalized: keep it bit-exact
            mask = (np.arange(b.shape[0])[:, None] + np.arange(self.rounds)[None, :]) < self.rounds
            b = np.where(mask, b, 0.0)
        else:
            b = normalized
        if not np.all(np.isfinite(b)) or np.any(b[0] <= 0):
            raise ConfigError("banded strategy needs finite entries and a positive diagonal")
        b.setflags(write=False)
        object.__setattr__(self, "bands", b)

    def params(self) -> dict[str, Any]:
        return {"bands": self.bands.tolist()}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict[str, Any]) -> ColumnNormalizedBanded:
        return cls(rounds, np.asarray(params["bands"], dtype=np.float64), workload)

    @property
    def num_bands(self) -> int:
        return int(self.bands.shape[0])

    @property
    def strategy_bands(self) -> int:
        return self.num_bands

    def column_norms_sq(self) -> np.ndarray:
        return np.sum(self.bands**2, axis=0)

    def strategy_matrix(self) -> np.ndarray:
        n = self.rounds
        c = np.zeros((n, n))
        for r in range(self.num_bands):
            idx = np.arange(n - r)
            c[idx + r, idx] = self.bands[r, : n - r]
        return c

    def strategy_columns(self, indices) -> np.ndarray:
        out = np.zeros((self.rounds, len(indices)))
        for col, j in enumerate(indices):
            m = min(self.num_bands, self.rounds - j)
            out[j : j + m, col] = self.bands[:m, j]
        return out

    def inverse_matrix(self) -> np.ndarray:
        return _BlockBanded(self.bands, max(64, self.num_bands)).solve(np.eye(self.rounds))

    def streaming_inverse(self) -> Iir:
        return Iir(self.bands)  # general banded C ("Scaling up BandMF", Alg. 1)

    @cached_property
    def decoder_row_norms_sq(self) -> np.ndarray:
        n = self.rounds
        solver = _BlockBanded(self.bands, max(64, self.num_bands))
        block = solver.size * max(1, 1024 // solver.size)
        lr = self.workload.learning_rates(n)
        norms = np.zeros(n)
        for a0 in range(0, n, block):
            width = min(block, n - a0)
            rhs = np.zeros((n - a0, width))
            rhs[np.arange(width), np.arange(width)] = 1.0
            cols = solver.solve(rhs, a0)
            out = _workload_apply(self.workload, lr[a0:], cols)
            norms[a0:] += np.einsum("ij,ij->i", out, out)
        return norms


def optimize_banded(
    rounds: int,
    num_bands: int,
    schema: MinSep,
    workload: Workload = Workload(),
    *,
    tolerance: float = 1e-10,
    max_steps: int = 500,
    progress: ProgressCallback | None = None,
) -> tuple[ColumnNormalizedBanded, OptimizationResult]:
    """Column-normalized banded C with p <= b bands minimizing ||A C^{-1}||_F^2 (so the
    loss k·||A C^{-1}||_F^2 / n under MinSep(b, k)). L-BFGS on log F, started from the
    optimized banded-Toeplitz strategy (for Toeplitz workloads) or the banded square root."""
    from .banded_toeplitz import optimize_banded_toeplitz
    from .toeplitz import fractional_power_coefficients

    schema.validate(rounds)
    if not 1 <= num_bands <= min(rounds, schema.min_sep):
        raise ConfigError(f"banded needs 1 <= bands p <= min_sep b (got p={num_bands}, b={schema.min_sep})")
    if workload.is_toeplitz:
        start = optimize_banded_toeplitz(rounds, num_bands, schema, workload)[0].coefficients
    else:
        start = fractional_power_coefficients(-0.5, num_bands)
    theta0 = np.repeat(start[:, None], rounds, axis=1)
    objective = BandedObjective(rounds, workload)
    k = schema.participations(rounds)
    shape = theta0.shape

    def log_objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = objective(x.reshape(shape))
        if not np.isfinite(value) or value <= 0:
            return math.inf, np.zeros_like(x)
        return math.log(value), (grad / value).ravel()

    report = lambda f: math.sqrt(math.exp(f) * k / rounds)  # noqa: E731  (rmse)
    x, result = lbfgs(log_objective, theta0.ravel(), max_steps=max_steps, rtol=tolerance, gtol=1e-9,
                      progress=progress, report=report)
    return ColumnNormalizedBanded(rounds, x.reshape(shape), workload), result
