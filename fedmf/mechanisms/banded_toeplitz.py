"""Optimizing banded-Toeplitz strategies C(theta), theta in R^p.

Objective ("Scaling up BandMF", Prop. 3.1): with w the coefficients of C^{-1} and
beta = A·w the coefficients of B = A C^{-1} (A a Toeplitz workload),
    mean:  (1/n)·||B||_F^2 = (1/n)·sum_j (n - j)·beta_j^2,     max: sum_j beta_j^2,
times sens^2 under MinSep(b, k). With p <= b, or theta non-negative and non-increasing,
sens^2 = ||sum_{i<k} shift(theta, i·b)||^2 exactly ("Beyond Square Roots", Thm 1).
Everything is O(n·p) per evaluation, with an analytic adjoint gradient:
    dE/dtheta_r = -sum_{i>=r} lambda_i w_{i-r},  lambda = C^{-T} A^T dE/dbeta
(derived from dC^{-1} = -C^{-1} dC C^{-1}; "Scaling up BandMF" App. D.3 uses autodiff).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..filters import series_inverse, toeplitz_solve
from ..participation import MinSep, Schema
from ..workloads import Workload
from .base import default_bands
from .optimize import OptimizationResult, ProgressCallback, Step, grid_then_golden, lbfgs
from .toeplitz import BandedToeplitz, fractional_power_coefficients

__all__ = ["ToeplitzObjective", "make", "optimize_banded_toeplitz", "reciprocal_plus_constant"]


def _correlate(lam: np.ndarray, w: np.ndarray, p: int) -> np.ndarray:
    """out_r = sum_{i>=r} lam_i w_{i-r} for r < p."""
    n = lam.size
    if p <= 64:
        return np.array([lam[r:] @ w[: n - r] for r in range(p)])
    size = 1 << (2 * n - 1).bit_length()
    full = np.fft.irfft(np.fft.rfft(lam, size) * np.conj(np.fft.rfft(w, size)), size)
    return full[:p]


@dataclass(frozen=True)
class ToeplitzObjective:
    """loss(theta) = error(theta) · sens^2(theta) for a Toeplitz workload, with gradient."""

    rounds: int
    workload: Workload
    min_sep: int
    participations: int
    error: str = "mean"

    def __post_init__(self) -> None:
        if not self.workload.is_toeplitz:
            raise ConfigError(
                "Toeplitz optimization needs a Toeplitz workload (prefix or momentum without cooldown); "
                "use kind 'banded' or 'dense' for a learning-rate cooldown"
            )
        if self.error not in ("mean", "max"):
            raise ConfigError(f"error must be 'mean' or 'max', got {self.error!r}")

    def sensitivity_squared(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """||S||^2 with S = sum_{i<k} shift(theta, i·b), and its gradient in theta."""
        n, b, p = self.rounds, self.min_sep, theta.size
        s = np.zeros(n)
        for i in range(self.participations):
            start = i * b
            if start >= n:
                break
            m = min(p, n - start)
            s[start : start + m] += theta[:m]
        grad = np.zeros(p)
        for i in range(self.participations):
            start = i * b
            if start >= n:
                break
            m = min(p, n - start)
            grad[:m] += 2 * s[start : start + m]
        return float(s @ s), grad

    def error_and_grad(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        n = self.rounds
        w = series_inverse(theta, n)
        beta = self.workload.apply_toeplitz(w)
        if self.error == "mean":
            weights = (n - np.arange(n)) / n
        else:
            weights = np.ones(n)
        err = float(np.sum(weights * beta**2))
        g_beta = 2 * weights * beta
        g_w = self.workload.apply_toeplitz(g_beta[::-1])[::-1]  # A^T = J A J for Toeplitz A
        lam = toeplitz_solve(theta, g_w[::-1])[::-1]  # C^{-T} = J C^{-1} J
        return err, -_correlate(lam, w, theta.size)

    def __call__(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        with np.errstate(over="ignore", invalid="ignore"):  # unstable trial points become inf
            err, g_err = self.error_and_grad(theta)
        sens2, g_sens = self.sensitivity_squared(theta)
        return err * sens2, sens2 * g_err + err * g_sens

    def log_loss(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """log(loss) and its gradient: scale-free and well conditioned for L-BFGS."""
        if theta[0] <= 0:
            return math.inf, np.zeros_like(theta)
        loss, grad = self(theta)
        if not np.isfinite(loss) or loss <= 0:
            return math.inf, np.zeros_like(theta)
        return math.log(loss), grad / loss


def reciprocal_plus_constant(num_bands: int, objective: ToeplitzObjective) -> np.ndarray:
    """theta_i = 1/i + c (i = 1..p) with c from a 1-D search ("Scaling up BandMF", App. J)."""
    base = 1.0 / np.arange(1, num_bands + 1)

    def value(c: float) -> float:
        theta = base + c
        if theta[-1] <= 0:
            return math.inf
        loss = objective(theta)[0]
        return loss if np.isfinite(loss) else math.inf

    c, _ = grid_then_golden(value, -1.0 / num_bands + 1e-9, 4.0, grid_points=41, xatol=1e-6)
    return base + c


def optimize_banded_toeplitz(
    rounds: int,
    num_bands: int,
    schema: MinSep,
    workload: Workload = Workload(),
    *,
    error: str = "mean",
    tolerance: float = 1e-12,
    max_steps: int = 2000,
    progress: ProgressCallback | None = None,
) -> tuple[BandedToeplitz, OptimizationResult]:
    """The banded-Toeplitz C with ``num_bands`` <= b bands minimizing the loss under
    MinSep(b, k). L-BFGS on log(loss) from two deterministic starts — banded square root
    (Prop. E.2: never worse than BSR) and 1/i + c (App. J) — keeping the better.
    Returned coefficients are normalized to ||theta|| = 1."""
    schema.validate(rounds)
    if not 1 <= num_bands <= rounds:
        raise ConfigError(f"bands p={num_bands} must lie in [1, rounds={rounds}]")
    if num_bands > schema.min_sep:
        raise ConfigError(
            f"banded-toeplitz needs bands p <= min_sep b under MinSep (got p={num_bands} > b={schema.min_sep})"
        )
    objective = ToeplitzObjective(rounds, workload, schema.min_sep, schema.participations(rounds), error)
    report = lambda f: math.sqrt(math.exp(f))  # noqa: E731  (shown: rmse, or max error)
    if num_bands == 1:
        theta = np.ones(1)
        result = OptimizationResult(True, 0, report(objective.log_loss(theta)[0]), tolerance, "no free parameters")
        return BandedToeplitz(rounds, theta, workload), result
    starts = [fractional_power_coefficients(-0.5, num_bands), reciprocal_plus_constant(num_bands, objective)]
    best: tuple[np.ndarray, OptimizationResult] | None = None
    total_steps = 0
    for i, start in enumerate(starts):
        theta, result = lbfgs(
            objective.log_loss, start / np.linalg.norm(start), max_steps=max_steps, rtol=tolerance, gtol=1e-9,
            progress=progress, report=report, close_progress=False, note=f"start {i + 1}/{len(starts)}",
        )
        total_steps += result.steps
        if best is None or result.objective < best[1].objective:
            best = (theta, result)
    theta, result = best
    result.steps = total_steps
    if progress is not None:
        progress(Step(total_steps, max_steps * len(starts), result.objective, None, tolerance, "both starts",
                      final=True, converged=result.converged))
    theta = theta / np.linalg.norm(theta)
    return BandedToeplitz(rounds, theta, workload), result


def make(rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
         **options: Any) -> tuple[BandedToeplitz, OptimizationResult]:
    """``fedmf.mechanisms.plan``'s maker of this kind (the class cannot name its solver: the solver
    imports it): ``optimize_banded_toeplitz`` with p = ``num_bands`` or ``default_bands``."""
    p = default_bands(rounds, schema) if num_bands is None else num_bands
    return optimize_banded_toeplitz(rounds, p, schema, workload, **options)
