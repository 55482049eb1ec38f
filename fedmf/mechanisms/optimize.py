"""Shared optimization machinery: deterministic 1-D search, L-BFGS with a stated stopping
rule that reports each step to a progress callback (``fedmf.run.progress``).

Every optimizer in fedmf is deterministic: the same inputs give the same coefficients
(no random restarts; fixed initializations; single-threaded reductions where it matters).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..run.progress import ProgressCallback, Step

__all__ = ["grid_then_golden", "OptimizationResult", "lbfgs", "ProgressCallback", "Step"]

_INV_PHI = (math.sqrt(5) - 1) / 2


def grid_then_golden(
    f: Callable[[float], float], lo: float, hi: float, grid_points: int = 25, xatol: float = 1e-7
) -> tuple[float, float]:
    """Minimize f on [lo, hi]: evaluate a uniform grid, then golden-section search on the
    two cells around the best grid point. Deterministic; returns (x, f(x)).
    Finds the global minimum whenever f is unimodal on each grid cell pair."""
    grid = np.linspace(lo, hi, grid_points)
    values = [f(float(x)) for x in grid]
    i = int(np.argmin(values))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, grid_points - 1)]
    best_x, best_f = float(grid[i]), float(values[i])
    c, d = b - _INV_PHI * (b - a), a + _INV_PHI * (b - a)
    fc, fd = f(c), f(d)
    while b - a > xatol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _INV_PHI * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _INV_PHI * (b - a)
            fd = f(d)
    for x, fx in ((c, fc), (d, fd)):
        if fx < best_f:
            best_x, best_f = float(x), float(fx)
    return best_x, best_f


@dataclass
class OptimizationResult:
    """What an optimizer reports beside the mechanism it found."""

    converged: bool
    steps: int
    objective: float
    tolerance: float
    message: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "converged": self.converged,
            "optimizer_steps": self.steps,
            "objective": self.objective,
            "tolerance": self.tolerance,
            "optimizer_message": self.message,
            **self.details,
        }


def lbfgs(
    fun_and_grad: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x0: np.ndarray,
    *,
    max_steps: int = 1000,
    rtol: float = 1e-10,
    gtol: float = 1e-8,
    progress: ProgressCallback | None = None,
    report: Callable[[float], float] = lambda f: f,
    bounds: tuple[float, float] | None = None,
    close_progress: bool = True,
    note: str = "",
) -> tuple[np.ndarray, OptimizationResult]:
    """L-BFGS (scipy's L-BFGS-B) on a smooth objective, unbounded or in the box
    ``bounds`` = (lo, hi) on every coordinate.

    Stops when the relative decrease of the objective over one step is below ``rtol``
    or the largest gradient entry is below ``gtol`` (converged), or after ``max_steps``
    (not converged). Non-finite objective values are treated as +inf so line searches
    back off from unstable regions. ``report`` maps the objective to the value shown.
    Returns the best point evaluated. ``progress`` gets each step (of ``max_steps``, with the
    relative decrease as the convergence measure against ``rtol``, and ``note``) and, unless
    ``close_progress=False`` (a caller that runs several searches and reports their end itself),
    the final one.
    """
    from scipy.optimize import minimize

    started = time.perf_counter()
    state = {"step": 0, "best": math.inf, "x": np.array(x0, dtype=np.float64), "previous": math.inf}

    def wrapped(x: np.ndarray) -> tuple[float, np.ndarray]:
        f, g = fun_and_grad(x)
        if not np.isfinite(f) or not np.all(np.isfinite(g)):
            return math.inf, np.zeros_like(x)
        if f < state["best"]:
            state["best"], state["x"] = f, np.array(x)
        return float(f), np.asarray(g, dtype=np.float64)

    def callback(xk: np.ndarray) -> None:
        state["step"] += 1
        if progress is not None:
            # L-BFGS-B's ftol rule: (f_prev - f) / max(|f_prev|, |f|, 1) <= rtol
            f, previous = state["best"], state["previous"]
            measure = ((previous - f) / max(abs(previous), abs(f), 1.0)) if math.isfinite(previous) else None
            state["previous"] = f
            progress(Step(state["step"], max_steps, report(f), measure, rtol, note))

    res = minimize(
        wrapped,
        np.array(x0, dtype=np.float64),
        jac=True,
        method="L-BFGS-B",
        bounds=None if bounds is None else [bounds] * len(x0),
        callback=callback,
        options={"maxiter": max_steps, "ftol": rtol, "gtol": gtol, "maxcor": 20, "maxls": 50},
    )
    x = state["x"] if state["best"] <= res.fun else res.x
    f = min(state["best"], float(res.fun))
    message = res.message if isinstance(res.message, str) else res.message.decode()
    # ABNORMAL line-search exits at a point with no further descent are a convergence in practice
    converged = bool(res.success) or (
        "ABNORMAL" in message.upper() and state["step"] > 0 and np.max(np.abs(wrapped(x)[1])) < 1e-4
    )
    if progress is not None and close_progress:
        progress(Step(state["step"], max_steps, report(f), None, rtol, note, final=True, converged=converged))
    return x, OptimizationResult(
        converged=converged,
        steps=state["step"],
        objective=report(f),
        tolerance=rtol,
        message=message,
        seconds=time.perf_counter() - started,
    )
