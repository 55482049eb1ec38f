"""Toeplitz strategies robust to a min-separation known only to lie in [b0, b1].

Federated reality: the server plans for separation b1 but users may come back after only
b0 rounds (the realized separation is audited afterwards). For a Toeplitz C with
non-negative, non-increasing coefficients the MinSep sensitivity is exact for every
separation ("Beyond Square Roots", Thm 1), whatever the number of bands, and it can only
grow as the separation shrinks (MinSep(b0, k) contains MinSep(b, k) for b >= b0), so the
worst case over [b0, b1] is attained at b0.

``optimize_robust`` minimizes the worst case (or the mean) of the loss over a grid of
separations in [b0, b1] over banded Toeplitz C with p bands (p may exceed b0), kept
non-negative and non-increasing by the parameterization theta_j = sum_{r>=j} exp(phi_r).
``taper`` is the heuristic of "Scaling up BandMF", App. H.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..participation import MinSep, Schema
from ..sensitivity import is_nonnegative_nonincreasing
from ..workloads import Workload
from .banded_toeplitz import ToeplitzObjective, optimize_banded_toeplitz
from .optimize import OptimizationResult, ProgressCallback, lbfgs
from .toeplitz import BandedToeplitz

__all__ = ["separation_grid", "taper", "optimize_robust", "rmse_by_min_sep"]


def separation_grid(b0: int, b1: int, points: int = 9) -> list[int]:
    """Integer separations from b0 to b1 (both included)."""
    if not 1 <= b0 <= b1:
        raise ConfigError(f"min-sep range needs 1 <= B0 <= B1, got {b0}:{b1}")
    return sorted({int(round(x)) for x in np.linspace(b0, b1, points)})


def taper(theta: np.ndarray, b0: int, b1: int) -> np.ndarray:
    """"Scaling up BandMF", App. H: theta_i <- ((b1 - i)/(b1 - b0))·theta_i for i >= b0
    (1-indexed; the factor is 1 at i = b0 and 0 at i = b1), then renormalized."""
    out = np.array(theta, dtype=np.float64)
    if b1 > b0:
        i = np.arange(1, out.size + 1)
        factor = np.where(i >= b0, np.clip((b1 - i) / (b1 - b0), 0.0, 1.0), 1.0)
        out = out * factor
    out = np.trim_zeros(out, "b")
    return out / np.linalg.norm(out)


def rmse_by_min_sep(mechanism, separations: list[int], participations: int | None) -> dict[int, float]:
    """rmse of ``mechanism`` under MinSep(s, k) for each separation s."""
    return {s: mechanism.rmse(MinSep(s, participations)) for s in separations}


def _monotone_params(theta: np.ndarray) -> np.ndarray:
    """phi with theta_j = sum_{r>=j} exp(phi_r) (floor keeps every decrement positive)."""
    theta = np.minimum.accumulate(np.maximum(theta, 0.0))
    decrements = theta - np.append(theta[1:], 0.0)
    return np.log(np.maximum(decrements, 1e-12 * max(theta[0], 1e-300)))


def _theta(phi: np.ndarray) -> np.ndarray:
    return np.cumsum(np.exp(phi)[::-1])[::-1]


def optimize_robust(
    rounds: int,
    b0: int,
    b1: int,
    workload: Workload = Workload(),
    *,
    participations: int | None = None,
    num_bands: int | None = None,
    weighting: str = "worst",
    error: str = "mean",
    tolerance: float = 1e-10,
    max_steps: int = 3000,
    grid_points: int = 9,
    starts: list[np.ndarray] | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[RobustToeplitz, OptimizationResult]:
    """Banded Toeplitz C (p bands, default b1) minimizing the worst-case (``weighting=
    "worst"``) or mean (``"mean"``) loss over separations in [b0, b1], k = ``participations``
    (default ceil(n/b1), the cap the server enforces). Starts from banded-Toeplitz optima for
    b0 and b1 bands, their taper, and any ``starts`` given, and keeps the best."""
    if weighting not in ("worst", "mean"):
        raise ConfigError(f"weighting must be 'worst' or 'mean', got {weighting!r}")
    separations = separation_grid(b0, b1, grid_points)
    if b1 > rounds:
        raise ConfigError(f"B1={b1} exceeds the number of rounds n={rounds}")
    k = participations if participations is not None else math.ceil(rounds / b1)
    p = b1 if num_bands is None else num_bands
    if not 1 <= p <= rounds:
        raise ConfigError(f"bands p={p} must lie in [1, rounds={rounds}]")
    objectives = [ToeplitzObjective(rounds, workload, s, MinSep(s, k).participations(rounds), error) for s in separations]

    def combined(theta: np.ndarray) -> tuple[float, np.ndarray]:
        err, g_err = objectives[0].error_and_grad(theta)
        sens = [o.sensitivity_squared(theta) for o in objectives]
        if weighting == "worst":
            s2, g_s2 = max(sens, key=lambda x: x[0])
        else:
            s2 = float(np.mean([s for s, _ in sens]))
            g_s2 = np.mean([g for _, g in sens], axis=0)
        return err * s2, s2 * g_err + err * g_s2

    def log_loss_phi(phi: np.ndarray) -> tuple[float, np.ndarray]:
        theta = _theta(phi)
        loss, g_theta = combined(theta)
        if not np.isfinite(loss) or loss <= 0:
            return math.inf, np.zeros_like(phi)
        # d theta_j / d phi_r = exp(phi_r) for j <= r
        return math.log(loss), np.exp(phi) * np.cumsum(g_theta) / loss

    candidates = list(starts or [])
    quiet = None
    bt1, _ = optimize_banded_toeplitz(rounds, min(b1, p), MinSep(b1, k), workload, error=error, progress=quiet)
    candidates += [bt1.coefficients, taper(bt1.coefficients, b0, b1)]
    if b0 <= p:
        bt0, _ = optimize_banded_toeplitz(rounds, b0, MinSep(b0, k), workload, error=error, progress=quiet)
        candidates.append(bt0.coefficients)
    inits = []
    for c in candidates:
        padded = np.zeros(p)
        padded[: min(p, c.size)] = c[:p]
        if padded[0] > 0:
            inits.append(padded / np.linalg.norm(padded))
    feasible = [t for t in inits if is_nonnegative_nonincreasing(t)]
    init = min(inits, key=lambda t: combined(np.minimum.accumulate(np.maximum(t, 0)))[0])
    report = lambda f: math.sqrt(math.exp(f))  # noqa: E731
    phi, result = lbfgs(
        log_loss_phi, _monotone_params(init), max_steps=max_steps, rtol=tolerance, gtol=1e-9,
        progress=progress, report=report,
    )
    theta = _theta(phi)
    # never return something worse than a start that is already in the family
    best_start = min(feasible, key=lambda t: combined(t)[0], default=None)
    if best_start is not None and combined(best_start)[0] < combined(theta)[0]:
        theta = best_start
        result.objective = report(math.log(combined(theta)[0]))
    theta = theta / np.linalg.norm(theta)
    if not is_nonnegative_nonincreasing(theta):
        raise RuntimeError("robust optimization left the non-negative non-increasing family")
    result.details["separations"] = separations
    result.details["weighting"] = weighting
    return RobustToeplitz(rounds, theta, b0, b1, workload), result


class RobustToeplitz(BandedToeplitz):
    """A banded Toeplitz strategy planned for a min-separation range [b0, b1]."""

    kind = "robust"
    bands_within_min_sep = False
    options = ("min_sep_range", "taper", "weighting", "error", "tolerance", "max_steps", "progress")

    @classmethod
    def make(cls, rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
             **options: Any) -> tuple[RobustToeplitz, OptimizationResult]:
        """Optimized over the separations ``min_sep_range`` (B0, B1) for ``schema``'s k, or (``taper``)
        the App. H taper of the banded-Toeplitz optimum for B1."""
        min_sep_range = options.pop("min_sep_range", None)
        if min_sep_range is None:
            raise ConfigError("robust needs a min_sep_range (B0, B1)")
        b0, b1 = min_sep_range
        k = schema.max_participations
        if options.pop("taper", False):
            options.pop("weighting", None)
            bt, result = optimize_banded_toeplitz(rounds, b1, MinSep(b1, k), workload, **options)
            coefficients = taper(bt.coefficients, b0, b1)
            result.message = f"taper of banded-toeplitz optimized for min_sep {b1}: {result.message}"
            result.details["taper"] = True
            return cls(rounds, coefficients, b0, b1, workload), result
        return optimize_robust(rounds, b0, b1, workload, participations=k, num_bands=num_bands, **options)

    def __init__(self, rounds: int, coefficients: np.ndarray, b0: int, b1: int, workload: Workload = Workload()) -> None:
        object.__setattr__(self, "min_sep_range", (int(b0), int(b1)))
        BandedToeplitz.__init__(self, rounds, coefficients, workload)

    def params(self) -> dict:
        return {**super().params(), "min_sep_range": list(self.min_sep_range)}

    @classmethod
    def from_params(cls, rounds: int, workload: Workload, params: dict) -> RobustToeplitz:
        b0, b1 = params["min_sep_range"]
        return cls(rounds, np.asarray(params["coefficients"], dtype=np.float64), int(b0), int(b1), workload)
