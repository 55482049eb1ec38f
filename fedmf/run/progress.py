"""Progress of long work — optimizer iterations, training rounds — with rate and time left.

The engine reports; the edge renders. An optimizer or the round loop calls a ``ProgressCallback``
with a ``Step`` (work done of the most there can be, and for an optimizer its convergence measure
against its tolerance); the CLI passes a ``ProgressBar``, which draws a live bar rewritten in place
on a terminal and, on a pipe or in a log file, plain lines (never a carriage return) at most every
``every_s`` seconds.

Time left: ``(total − done) / rate``, the rate measured over this process's steps. An optimizer
usually stops before its step limit, when its measure reaches the tolerance; while the measure falls
geometrically (a straight line in log scale, fitted over the recent steps), the steps still needed
are ``(log tolerance − log measure) / slope``, and the bar shows the smaller of the two estimates
(marked ``~`` when it comes from the convergence trend, ``≤`` when from the step limit).
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

__all__ = ["Step", "ProgressCallback", "ProgressBar", "format_seconds", "eta_seconds"]

#: steps of the convergence trend fitted for the time left
_TREND_STEPS = 20
_BAR_WIDTH = 20


@dataclass(frozen=True)
class Step:
    """One report of long work: ``done`` of at most ``total`` units (steps, rounds); an optimizer
    adds its ``objective`` and its convergence ``measure`` (it stops once ``measure <= tolerance``).
    ``start``: units done before this process began (a resumed run), left out of the rate.
    ``final``: the work ended (``converged`` says how, for an optimizer). ``note``: extra text."""

    done: int
    total: int | None = None
    objective: float | None = None
    measure: float | None = None
    tolerance: float | None = None
    note: str = ""
    final: bool = False
    converged: bool | None = None
    start: int = 0


#: what an optimizer or the round loop calls after each unit of work
ProgressCallback = Callable[[Step], None]


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h`` (``?`` when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def eta_seconds(done: int, total: int | None, rate: float, trend: list[tuple[int, float]] | None = None,
                tolerance: float | None = None) -> tuple[float, str]:
    """Seconds left and how they were estimated (``"limit"``, ``"trend"`` or ``""``: unknown) at
    ``rate`` units per second: to ``total`` units, or sooner where the convergence ``trend``
    ((step, measure) pairs, measure > 0) falls geometrically toward ``tolerance``."""
    if not rate > 0:
        return math.nan, ""
    best, how = math.nan, ""
    if total is not None and total >= done:
        best, how = (total - done) / rate, "limit"
    points = [(s, math.log(m)) for s, m in (trend or []) if m is not None and m > 0 and math.isfinite(m)]
    if tolerance is not None and tolerance > 0 and len(points) >= 3:
        # least-squares slope of log(measure) against the step
        n = len(points)
        ms = sum(s for s, _ in points) / n
        ml = sum(v for _, v in points) / n
        sxx = sum((s - ms) ** 2 for s, _ in points)
        slope = sum((s - ms) * (v - ml) for s, v in points) / sxx if sxx > 0 else 0.0
        if slope < 0:
            steps = max((math.log(tolerance) - points[-1][1]) / slope, 0.0)
            seconds = steps / rate
            if not seconds >= best:  # also when best is nan
                best, how = seconds, "trend"
    return best, how


class ProgressBar:
    """Renders ``Step`` reports on ``stream`` (default stderr) as ``label [bar] done/total unit,
    rate, ETA, objective, measure/tolerance, note``: rewritten in place (``\\r``) when ``live``
    (default: the stream is a terminal), else one plain line at most every ``every_s`` seconds
    (default 10; 0: every report) and the final one. Silent when ``enabled`` is False."""

    def __init__(self, label: str, *, unit: str = "steps", enabled: bool = True, stream: TextIO | None = None,
                 live: bool | None = None, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.unit, self.enabled = label, unit, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)()) if live is None else live
        self.every_s = (0.2 if self.live else 10.0) if every_s is None else every_s
        self._clock = clock
        self._started: float | None = None
        self._first = 0
        self._last_shown = -math.inf
        self._trend: deque[tuple[int, float]] = deque(maxlen=_TREND_STEPS)
        self._open = False  # a live line is on the terminal without its newline

    def begin(self, done: int = 0) -> None:
        """Start the clock before the first unit of work (``done``: units done before it)."""
        if self._started is None:
            self._started, self._first = self._clock(), done

    def rate(self, step: Step) -> float:
        """Units per second over this process's reports (nan before any time passed)."""
        if self._started is None:
            return math.nan
        elapsed = self._clock() - self._started
        return (step.done - self._first) / elapsed if elapsed > 0 and step.done > self._first else math.nan

    def line(self, step: Step) -> str:
        """The text of one report (no carriage return, no newline)."""
        parts = [self.label]
        if step.total:
            filled = min(_BAR_WIDTH, int(_BAR_WIDTH * step.done / step.total)) if step.total > 0 else 0
            parts.append(f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {step.done}/{step.total} {self.unit}")
        else:
            parts.append(f"{step.done} {self.unit}")
        rate = self.rate(step)
        if math.isfinite(rate):
            parts.append(f"{rate:.3g} {self.unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit[:-1] or 'unit'}")
        if step.final:
            if self._started is not None:
                parts.append(f"took {format_seconds(self._clock() - self._started)}")
        else:
            seconds, how = eta_seconds(step.done, step.total, rate, list(self._trend), step.tolerance)
            if how:
                parts.append(f"ETA {'~' if how == 'trend' else '≤' if step.tolerance else ''}"
                             f"{format_seconds(seconds)}")
        if step.objective is not None:
            parts.append(f"objective {step.objective:.8g}")
        if step.measure is not None:
            parts.append(f"measure {step.measure:.2e}" + ("" if step.tolerance is None else
                                                          f" (stops at {step.tolerance:.1e})"))
        if step.note:
            parts.append(step.note)
        if step.final and step.converged is not None:
            parts.append("converged" if step.converged else "NOT converged")
        return "  ".join(parts)

    def __call__(self, step: Step) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if self._started is None:
            self._started, self._first = now, step.start if step.start else step.done
        if step.measure is not None and step.measure > 0:
            self._trend.append((step.done, step.measure))
        if not step.final and now - self._last_shown < self.every_s:
            return
        self._last_shown = now
        text = self.line(step)
        if self.live:
            self.stream.write("\r\x1b[K" + text + ("\n" if step.final else ""))
            self._open = not step.final
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (e.g. a warning) that a live bar does not overwrite."""
        if not self.enabled:
            return
        if self.live and self._open:
            self.stream.write("\r\x1b[K")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a live line left open (work stopped without a final report)."""
        if self.enabled and self.live and self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
