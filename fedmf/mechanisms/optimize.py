"""Shared optimization machinery: deterministic 1-D search, L-BFGS with a stated stopping
rule, and a progress line on stderr.

Every optimizer in fedmf is deterministic: the same inputs give the same coefficients
(no random restarts; fixed initializations; single-threaded reductions where it matters).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import numpy as np

__all__ = ["grid_then_golden", "Progress", "OptimizationResult", "lbfgs"]

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


class Progress:
    """A one-line progress display on stderr: ``label  step N  objective V`` (rewritten in
    place on a terminal, one line per update at most every ``interval`` seconds otherwise).
    Silent when ``enabled`` is False."""

    def __init__(self, label: str, enabled: bool = True, stream: TextIO | None = None, interval: float = 0.5) -> None:
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self._last = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._shown = False

    def update(self, step: int, objective: float, extra: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        text = f"{self.label}  step {step:>5d}  objective {objective:.10g}{('  ' + extra) if extra else ''}"
        if self._tty:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._shown = True

    def close(self, step: int, objective: float, extra: str = "") -> None:
        if not self.enabled:
            return
        self.update(step, objective, extra, force=True)
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


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
    progress: Progress | None = None,
    report: Callable[[float], float] = lambda f: f,
    bounds: tuple[float, float] | None = None,
    close_progress: bool = True,
) -> tuple[np.ndarray, OptimizationResult]:
    """L-BFGS (scipy's L-BFGS-B) on a smooth objective, unbounded or in the box
    ``bounds`` = (lo, hi) on every coordinate.

    Stops when the relative decrease of the objective over one step is below ``rtol``
    or the largest gradient entry is below ``gtol`` (converged), or after ``max_steps``
    (not converged). Non-finite objective values are treated as +inf so line searches
    back off from unstable regions. ``report`` maps the objective to the value shown.
    Returns the best point evaluated. ``close_progress=False`` leaves the progress line
    open for a caller that runs several searches under one line.
    """
    from scipy.optimize import minimize

    started = time.perf_counter()
    state = {"step": 0, "best": math.inf, "x": np.array(x0, dtype=np.float64)}

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
            progress.update(state["step"], report(state["best"]))

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
        progress.close(state["step"], report(f), "converged" if converged else "NOT converged")
    return x, OptimizationResult(
        converged=converged,
        steps=state["step"],
        objective=report(f),
        tolerance=rtol,
        message=message,
        seconds=time.perf_counter() - started,
    )
