"""Whether a run is learning: a model that is not finite, or a held-out loss that stays above the
initial model's, gives one line (the likely cause and what to change) and a record for ``results.json``.

    check = LearningCheck(settings={"server-lr": 1.0, "clip-norm": 1.0, "epsilon": 8.0})
    check.start(run.directory, run.next_round, lambda: task.evaluate(model))  # the initial held-out loss
    why = check.observe(record.round, record.metrics, model.parameters())   # after each committed round
    check.to_dict()                                                          # results.json's "learning"

The rules (README "When a run is not learning"):

* **Not finite**: a NaN or an infinity in the committed model's parameters, or in its held-out loss.
  Nothing useful can follow (every later update would be computed on that model, and every later
  round would spend budget on it), so the run stops (``observe`` returns the stop's reason). The
  round that made it is committed and accounted like any other: releasing its model is
  post-processing of a committed private release, not a privacy problem; but no later round is
  played, so it is never sent to a client again. Resuming such a run stops at once (``start``):
  start a new run with the changed setting.
* **Diverging**: the held-out loss above the initial model's by more than ``DIVERGENCE_MARGIN``
  (relative) for ``DIVERGENCE_EVALUATIONS`` consecutive evaluations. It warns by default (a DP run's
  loss may rise for a while and recover, and stopping costs the user the rounds already paid for);
  ``stop_when_diverging`` (``--stop-when-diverging``, run-config ``stop-when-diverging``) stops it.

A stopped run is an ordinary partial run: its ledger and accounting are exact (every committed round,
nothing else), and it resumes with the same command (after changing what the line says).

The held-out loss is the evaluation's ``loss`` (the tasks' cross-entropy; an evaluation without one
gets the finiteness check only). The initial held-out loss is measured once, when the run has
committed no round (its model is then the initial one), and kept in
``<run-dir>/initial-evaluation.json`` for the resumed invocations (which evaluate nothing before
their first round); a run started before this file existed has no divergence check. The consecutive count starts again in each invocation; ``replay``
gives the record over a whole run's history (``results.json``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_write

__all__ = ["LearningCheck", "DIVERGENCE_MARGIN", "DIVERGENCE_EVALUATIONS", "INITIAL_EVALUATION_FILE",
           "NOT_FINITE_FILE", "model_is_finite"]

#: a held-out loss counts as diverged above initial · (1 + margin) (initial > 0: a cross-entropy)
DIVERGENCE_MARGIN = 0.2
#: consecutive diverged evaluations before the run is said to diverge
DIVERGENCE_EVALUATIONS = 3
#: where the initial model's held-out evaluation is kept
INITIAL_EVALUATION_FILE = "initial-evaluation.json"
#: written when the committed model or its held-out loss is found not finite (a resume stops at once)
NOT_FINITE_FILE = "not-finite.json"
_WHAT_TO_CHANGE = "lower the server learning rate ({server-lr}) or the clip norm ({clip-norm}), or raise epsilon ({epsilon}) for less noise"


def model_is_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter is finite (no NaN, no infinity)."""
    return all(bool(torch.isfinite(p.detach()).all()) for p in params)


class LearningCheck:
    """Consumes a run's evaluations and says when it is not learning (module docstring).
    ``settings``: the current values named in the advice (e.g. ``{"server-lr": 1.0}``); ``flag``: how
    the user names a setting (``"--"`` on the command line, ``""`` in a run config)."""

    def __init__(self, *, settings: Mapping[str, Any] | None = None, flag: str = "--",
                 margin: float = DIVERGENCE_MARGIN, evaluations: int = DIVERGENCE_EVALUATIONS,
                 stop_when_diverging: bool = False, announce: Callable[[str], None] | None = None) -> None:
        self.margin, self.evaluations, self.stop_when_diverging = float(margin), int(evaluations), stop_when_diverging
        self.announce = announce
        names = ("server-lr", "clip-norm", "epsilon")
        given = dict(settings or {})
        self._advice = _WHAT_TO_CHANGE.format(**{n: f"{flag}{n} {given[n]:g}" if n in given else f"{flag}{n}"
                                                 for n in names})
        self.initial_loss: float | None = None
        self.status = "learning"  # or "diverging", "not-finite"
        self.line: str | None = None
        self.round: int | None = None  # the round (0-based) at which the line was first raised
        self._directory: Path | None = None  # the run directory (``start``)
        self.last_loss: float | None = None
        self._above = 0

    # ---- the initial model ----------------------------------------------------------------
    def start(self, directory: str | Path, next_round: int, evaluate: Callable[[], Mapping[str, float]] | None,
              params: Iterable[torch.Tensor] | None = None) -> str | None:
        """Before the first round of this invocation: the initial held-out loss (measured now when
        no round is committed, ``next_round == 0``, and kept in the run directory; read back on a
        resume, which evaluates nothing). On a resume, the stop's reason when the committed model
        (``params``) is not finite, or an earlier invocation found it or its held-out loss not finite
        (``NOT_FINITE_FILE``): no round is played on it."""
        self._directory = Path(directory)
        path = self._directory / INITIAL_EVALUATION_FILE
        if next_round == 0 and evaluate is not None:
            with torch.no_grad():
                scores = {k: float(v) for k, v in evaluate().items()}
            atomic_write(path, lambda f: json.dump({k: v if math.isfinite(v) else None for k, v in scores.items()},
                                                   f), text=True, mode=0o600)
        else:
            try:
                scores = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                scores = {}
        loss = scores.get("loss") if isinstance(scores, dict) else None
        if isinstance(loss, (int, float)) and math.isfinite(loss) and loss > 0:
            self.initial_loss = float(loss)
        if next_round > 0 and ((params is not None and not model_is_finite(params))
                               or (self._directory / NOT_FINITE_FILE).exists()):
            return self._flag("not-finite", next_round - 1, f"not learning: the model committed in round "
                              f"{next_round - 1} or its held-out loss is not finite (NaN or inf): resuming cannot "
                              f"help; start a new run and {self._advice}")
        return None

    # ---- each committed round -------------------------------------------------------------
    def observe(self, t: int, metrics: Mapping[str, float], params: Iterable[torch.Tensor] | None = None) -> str | None:
        """Round t (0-based) committed with held-out ``metrics`` (may be empty) and model ``params``:
        the stop's reason when the run must stop (not finite; diverging with ``stop_when_diverging``),
        else None. The first time a line is raised it goes to ``announce``."""
        loss = metrics.get("loss")
        finite_loss = loss is None or math.isfinite(float(loss))
        if (params is not None and not model_is_finite(params)) or not finite_loss:
            what = "model" if finite_loss else "held-out loss"
            return self._flag("not-finite", t, f"not learning: the {what} is not finite (NaN or inf) after round "
                              f"{t}; likely cause: updates or noise too large for the server step; "
                              f"{self._advice}; the run stopped (its committed rounds stay accounted)")
        if loss is None or self.initial_loss is None:
            return None
        self.last_loss = float(loss)
        limit = self.initial_loss * (1.0 + self.margin)
        self._above = self._above + 1 if self.last_loss > limit else 0
        if self._above < self.evaluations or self.status != "learning":
            return self._stop_if_diverging()
        first = t - self.evaluations + 1  # the round (0-based) of the first of the consecutive evaluations
        stops = "the run stopped (--stop-when-diverging)" if self.stop_when_diverging else "the run goes on"
        self._flag("diverging", t, f"not learning: the held-out loss has been above the initial {self.initial_loss:.4g} "
                   f"by more than {self.margin:.0%} for {self.evaluations} evaluations (rounds {first}-{t}; now "
                   f"{self.last_loss:.4g}); likely cause: the server step or the noise is too large; "
                   f"{self._advice}; {stops}")
        return self._stop_if_diverging()

    def _stop_if_diverging(self) -> str | None:
        return self.line if self.status == "diverging" and self.stop_when_diverging else None

    def _flag(self, status: str, t: int, line: str) -> str:
        if self.status != status:
            self.status, self.line, self.round = status, line, t
            if status == "not-finite" and self._directory is not None:  # a resume stops at once (``start``)
                atomic_write(self._directory / NOT_FINITE_FILE, lambda f: json.dump({"round": t}, f), text=True,
                             mode=0o600)
            if self.announce is not None:
                self.announce(line)
        return self.line

    def replay(self, history: Iterable[Mapping[str, Any]]) -> LearningCheck:
        """A check over a whole run's ``history`` (``fedmf.run.simulate.run_history``: rounds with their
        released metrics, across resumes), with this one's rule, advice and initial loss; a model this
        one found not finite stays so. Nothing is announced."""
        other = LearningCheck(margin=self.margin, evaluations=self.evaluations,
                              stop_when_diverging=self.stop_when_diverging)
        other._advice, other.initial_loss = self._advice, self.initial_loss
        for entry in history:
            metrics = {k: float(v) if v is not None else math.nan for k, v in entry.get("metrics", {}).items()}
            if other.observe(int(entry["round"]), metrics) is not None and other.status == "not-finite":
                break
        if self.status == "not-finite" and other.status != "not-finite":
            other.status, other.line, other.round = self.status, self.line, self.round
        return other

    # ---- the record -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """``results.json``'s ``learning``: status ("learning", "diverging", "not-finite"), the line,
        the 0-based round it was raised at, the initial and last held-out losses and the rule."""
        return {"status": self.status, "line": self.line, "round": self.round, "initial_loss": self.initial_loss,
                "last_loss": self.last_loss, "margin": self.margin, "evaluations": self.evaluations,
                "stop_when_diverging": self.stop_when_diverging}
