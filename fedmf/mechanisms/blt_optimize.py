"""The optimizer of buffered linear Toeplitz (BLT) mechanisms: the BLT minimizing
error^2 x sensitivity^2 under MinSep(b, k), from the closed forms of ``blt``.

The candidates are parametrized so that every one interlaces (``_rates_from_gaps``), which
makes C's coefficients non-negative and non-increasing ([MP25] Theorem 1) and its MinSep
sensitivity exact ([BSR] Theorem 1). Box-constrained L-BFGS (``optimize.lbfgs``) on
log(loss) with torch float64 gradients from fixed starts: deterministic.
Sources as cited in ``blt``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import checks
from ..errors import ConfigError
from ..participation import MinSep, Schema
from ..workloads import Workload
from .base import check_rounds
from .blt import (
    _F64,
    DENSE_LIMIT,
    MAX_BUFFERS,
    BufferedLinearToeplitz,
    _ResidueGrid,
    minsep_sensitivity_sq,
    output_scales,
    prefix_error_sq,
    single_sensitivity_sq,
    workload_error_sq,
)
from .optimize import OptimizationResult, ProgressCallback, Step, lbfgs

__all__ = ["optimize_blt", "make", "AUTO_BUFFER_GAIN"]

#: the auto buffer search stops when one more buffer improves the loss by less than this
AUTO_BUFFER_GAIN = 0.01


def _rates_from_gaps(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Interlaced rates from 2m unconstrained numbers: the sorted sequence
    a_1 < ahat_1 < a_2 < ahat_2 < ... (theta_1 > that_1 > theta_2 > ...) is the cumulative sum
    of the gaps e^z. Every z is feasible: w > 0, what < 0, decays in (0, 1), sum w < 1
    (interlacing <=> the sign conditions of [MP25] Theorem 1; sum w = c_1 = sum theta -
    sum that [derived from the x-coefficient of p/q] < 1 as the intervals are disjoint)."""
    v = torch.cumsum(torch.exp(z), 0)
    return v[0::2], v[1::2]


def _gaps_from_rates(rates: np.ndarray) -> np.ndarray:
    """Inverse of ``_rates_from_gaps`` for a sorted sequence of 2m positive rates."""
    return np.log(np.diff(np.concatenate([[0.0], rates])))


def _starts(num_buffers: int, rounds: int, previous: np.ndarray | None) -> dict[str, np.ndarray]:
    """Deterministic starting rates (sorted, 2m of them) for m buffers:
    "geometric": 2m rates geometrically spaced in [1/n, 1] (poles and zeros of rational
    approximations of (1 - x)^(-1/2) interlace geometrically in 1 - x, cf. [DMPST24] Sec. 4);
    "extend": the (m-1)-buffer optimum plus a faster pair at 2x and 4x its largest rate
    (multi-participation losses have local minima that this continuation avoids)."""
    starts = {"geometric": np.geomspace(min(1.0 / rounds, 0.1), 1.0, 2 * num_buffers)}
    if previous is not None and previous.size == 2 * num_buffers - 2:
        starts["extend"] = np.concatenate([previous, previous[-1] * np.array([2.0, 4.0])])
    return starts


class _Objective:
    """log(error^2 x sensitivity^2) of an interlaced BLT as a function of its log gaps."""

    def __init__(self, rounds: int, schema: MinSep, workload: Workload, error: str) -> None:
        self.n, self.workload, self.error = rounds, workload, error
        self.k = schema.participations(rounds)
        self.grid = _ResidueGrid(rounds, schema.min_sep, self.k) if self.k > 1 else None
        # box on the log gaps: rates in [1e-3/n, 8m] keep L-BFGS off the flat regions
        # theta -> 1 (a buffer that never decays) and theta -> 0 (C -> I)
        self.bounds = (math.log(1e-3 / rounds), math.log(4.0))

    def loss(self, z: torch.Tensor) -> torch.Tensor:
        a, ahat = _rates_from_gaps(z)
        w, what = output_scales(a, ahat), output_scales(ahat, a)
        if self.grid is None:
            sens2 = single_sensitivity_sq(w, a, self.n)
        else:
            sens2 = minsep_sensitivity_sq(w, a, self.grid)
        if self.workload.is_prefix:
            mean, largest = prefix_error_sq(a, ahat, what, self.n)
        else:
            mean, largest = workload_error_sq(what, ahat, self.workload, self.n)
        return (mean if self.error == "mean" else largest) * sens2

    def __call__(self, x: np.ndarray) -> tuple[float, np.ndarray]:
        z = torch.tensor(x, dtype=_F64, requires_grad=True)
        f = torch.log(self.loss(z))
        if not torch.isfinite(f):
            return math.inf, np.zeros_like(x)
        f.backward()
        g = z.grad.numpy().copy()
        if not np.all(np.isfinite(g)):
            return math.inf, np.zeros_like(x)
        return float(f.detach()), g


#: converged means: L-BFGS stopped on its own (not at max_steps) at a point whose projected
#: gradient of log(loss) w.r.t. the log gaps is below this (a 0.01% relative slope)
_STATIONARY = 1e-4


def _projected_gradient(x: np.ndarray, g: np.ndarray, lo: float, hi: float) -> float:
    pg = np.where((x <= lo) & (g > 0), 0.0, np.where((x >= hi) & (g < 0), 0.0, g))
    return float(np.max(np.abs(pg)))


def _lbfgs(objective: _Objective, rates0: np.ndarray, tolerance: float, max_steps: int,
           progress: ProgressCallback | None, note: str = "") -> tuple[np.ndarray, float, OptimizationResult]:
    """Box-constrained L-BFGS (``optimize.lbfgs``) on the log gaps from ``rates0``;
    converged by this optimizer's own rule (``_STATIONARY``)."""
    lo, hi = objective.bounds
    x0 = np.clip(_gaps_from_rates(rates0), lo, hi)
    x, result = lbfgs(objective, x0, max_steps=max_steps, rtol=tolerance, gtol=1e-10, progress=progress,
                      report=lambda f: math.sqrt(math.exp(f)), bounds=(lo, hi), close_progress=False, note=note)
    f, g = objective(x)
    stationary = _projected_gradient(x, g, lo, hi) <= _STATIONARY
    result.converged = bool(np.isfinite(f) and stationary and result.steps < max_steps)
    result.objective = math.sqrt(math.exp(f))
    with torch.no_grad():
        a, ahat = _rates_from_gaps(torch.tensor(x, dtype=_F64))
    return np.sort(np.concatenate([a.numpy(), ahat.numpy()])), math.exp(f), result


@dataclass
class _Fit:
    blt: BufferedLinearToeplitz
    rates: np.ndarray  # the sorted interlaced sequence a_1 < ahat_1 < ...
    loss: float
    result: OptimizationResult
    start: str


def _fit(objective: _Objective, num_buffers: int, previous: np.ndarray | None, tolerance: float, max_steps: int,
         progress: ProgressCallback | None) -> _Fit:
    """The best of the L-BFGS runs from each deterministic start for m buffers."""
    best: _Fit | None = None
    starts = _starts(num_buffers, objective.n, previous)
    for i, (name, rates0) in enumerate(starts.items()):
        note = f"{num_buffers} buffers, start {i + 1}/{len(starts)}"
        rates, loss, result = _lbfgs(objective, rates0, tolerance, max_steps, progress, note)
        if best is None or loss < best.loss:
            blt = BufferedLinearToeplitz(objective.n, rates[0::2], rates[1::2], objective.workload)
            best = _Fit(blt, rates, loss, result, name)
    assert best is not None
    if not best.blt.is_monotone:  # impossible for interlaced rates; guards Theorem 1's premise
        raise RuntimeError("optimized BLT violates non-negative non-increasing coefficients")
    return best


def _check_buffers(name: str, value: int) -> None:
    checks.positive_int(name, value)
    if value > MAX_BUFFERS:
        raise ConfigError(f"{name}={value} exceeds {MAX_BUFFERS}: more buffers are numerically unreliable (3-7 is typical)")


def optimize_blt(
    rounds: int,
    schema: MinSep,
    workload: Workload = Workload(),
    *,
    num_buffers: int | None = None,
    max_buffers: int = 10,
    error: str = "mean",
    tolerance: float = 1e-10,
    max_steps: int = 1000,
    progress: ProgressCallback | None = None,
) -> tuple[BufferedLinearToeplitz, OptimizationResult]:
    """The BLT minimizing error^2 x sens^2 under MinSep(b, k) for ``workload``.

    error "mean": (1/n)||A C^{-1}||_F^2 sens^2 (rmse^2); "max": max_i ||(A C^{-1})_i||^2 sens^2.
    sens is exact ([BSR] Theorem 1; [DMPST24] Lemma 5.3 for k = 1), valid because every
    candidate interlaces (see ``_rates_from_gaps``). Box-constrained L-BFGS on log(loss)
    with torch float64 gradients from fixed starts (``_starts``): deterministic.
    ``num_buffers=None`` tries m = 1, 2, … and keeps m - 1 once one more buffer improves
    the loss by less than 1% (or stops at ``max_buffers``). ``tolerance`` is L-BFGS-B's
    ftol on log(loss). ``result.objective`` is the rmse ("mean") or max_error ("max");
    ``result.converged`` is True only if every run it took stopped at a stationary point.
    """
    check_rounds(rounds)
    if not isinstance(schema, MinSep):
        raise ConfigError("optimize_blt needs a MinSep(b, k) schema")
    if error not in ("mean", "max"):
        raise ConfigError(f"error must be 'mean' or 'max', got {error!r}")
    schema.validate(rounds)
    if not workload.is_toeplitz and rounds > DENSE_LIMIT:
        raise ConfigError(f"a cooldown workload is optimized densely, up to n={DENSE_LIMIT} rounds (got {rounds})")
    if num_buffers is not None:
        _check_buffers("num_buffers", num_buffers)
    _check_buffers("max_buffers", max_buffers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a thread pool only adds overhead (and spins under load)
    try:
        return _optimize(_Objective(rounds, schema, workload, error), num_buffers, max_buffers, tolerance,
                         max_steps, progress)
    finally:
        torch.set_num_threads(threads)


def _optimize(objective: _Objective, num_buffers: int | None, max_buffers: int, tolerance: float, max_steps: int,
              progress: ProgressCallback | None) -> tuple[BufferedLinearToeplitz, OptimizationResult]:
    started = time.perf_counter()
    counts = [num_buffers] if num_buffers is not None else range(1, max_buffers + 1)
    fits: list[_Fit] = []
    chosen: _Fit | None = None
    for m in counts:
        fit = _fit(objective, m, fits[-1].rates if fits else None, tolerance, max_steps, progress)
        fits.append(fit)
        if chosen is not None and fit.loss > (1 - AUTO_BUFFER_GAIN) * chosen.loss:
            break
        chosen = fit
    assert chosen is not None
    result = chosen.result
    result.converged = all(f.result.converged for f in fits)
    result.seconds = time.perf_counter() - started
    if progress is not None:
        progress(Step(result.steps, max_steps, result.objective, None, tolerance,
                      f"{chosen.blt.num_buffers} buffers", final=True, converged=result.converged))
    result.details = {
        "num_buffers": chosen.blt.num_buffers,
        "loss": chosen.loss,
        "error": objective.error,
        "buffers_tried": [
            {"num_buffers": f.blt.num_buffers, "loss": f.loss, "converged": f.result.converged,
             "steps": f.result.steps, "start": f.start}
            for f in fits
        ],
    }
    return chosen.blt, result


def make(rounds: int, schema: Schema, workload: Workload, num_bands: int | None,
         **options: Any) -> tuple[BufferedLinearToeplitz, OptimizationResult]:
    """``fedmf.mechanisms.plan``'s maker of this kind (the class cannot name its solver: the solver
    imports it): ``optimize_blt``; a cooldown workload is optimized densely, up to
    DENSE_LIMIT rounds, with at most MAX_BUFFERS buffers."""
    if not workload.is_toeplitz and rounds > DENSE_LIMIT:
        raise ConfigError(f"a cooldown workload is optimized densely, up to n={DENSE_LIMIT} rounds (got {rounds})")
    if options.get("num_buffers") is not None:
        options["num_buffers"] = checks.integer("num_buffers", options["num_buffers"], minimum=1, maximum=MAX_BUFFERS)
    return optimize_blt(rounds, schema, workload, **options)
