"""How a server run ended, as data: ``<run-dir>/outcome.json``, written by the Flower ServerApp when
it returns or stops on a ``FedmfError``, read by whoever launched it (``fedmf simulate --backend
flower``) instead of its log lines.

    write_outcome(run_dir, RunOutcome(run_id=3, rounds_done=20, stopped="horizon", ledger="ledger.db"))
    read_outcome(run_dir).stopped    # "horizon", "rounds", "guard: <why>", "cohort: <why>", "learning: <why>" or "error"
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import checks
from ..errors import OutcomeError
from ..files import atomic_write

__all__ = ["RunOutcome", "OUTCOME_FILE", "OUTCOME_FORMAT", "STOP_PREFIXES", "write_outcome", "read_outcome",
           "clear_outcome"]

#: the file in the run directory
OUTCOME_FILE = "outcome.json"
#: the version of its layout
OUTCOME_FORMAT = 1

_FIELDS = ("run_id", "rounds_done", "stopped", "ledger", "error")
#: the stops that carry their one line (``fedmf.run.loop.LoopEnd``): the privacy guard, a round too few
#: users could join (``fedmf.run.cohort``), a run that is not learning (``fedmf.run.learning_check``)
STOP_PREFIXES = ("guard: ", "cohort: ", "learning: ")


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended. ``stopped``: "horizon" (the plan's last round done), "rounds" (the rounds
    asked for done), "guard: <why>" (the privacy guard refused the next round), "cohort: <why>" (too few
    users could join the next round), "learning: <why>" (the model is not finite, or diverged) or "error" (with
    ``error``, the one-line message). ``run_id`` and ``rounds_done`` are None when the run never
    opened; ``ledger`` is the ledger's public URL (never a password)."""

    run_id: int | None
    rounds_done: int | None
    stopped: str
    ledger: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        for name in ("run_id", "rounds_done"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise OutcomeError(f"outcome {name} must be an integer >= 0 or null, got {value!r}")
        for name in ("ledger", "error"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise OutcomeError(f"outcome {name} must be a string or null, got {value!r}")
        stopped = self.stopped
        if not isinstance(stopped, str) or not (stopped in ("horizon", "rounds", "error")
                                                or stopped.startswith(STOP_PREFIXES)):
            raise OutcomeError(f"outcome stopped must be horizon, rounds, error, 'guard: <why>', 'cohort: <why>' or "
                               f"'learning: <why>', got {stopped!r}")
        if (stopped == "error") != (self.error is not None):
            raise OutcomeError("outcome error is given exactly when stopped is error")

    def to_dict(self) -> dict[str, Any]:
        return {"format": OUTCOME_FORMAT, **asdict(self)}


def write_outcome(run_dir: str | os.PathLike, outcome: RunOutcome) -> Path:
    """Write ``outcome`` to ``<run_dir>/outcome.json`` (atomically, mode 0600); its path."""
    path = Path(run_dir) / OUTCOME_FILE
    atomic_write(path, lambda f: json.dump(outcome.to_dict(), f, indent=1, allow_nan=False), text=True, mode=0o600)
    return path


def read_outcome(run_dir: str | os.PathLike) -> RunOutcome:
    """The outcome in ``<run_dir>/outcome.json``; a one-line :class:`OutcomeError` when it is missing,
    not JSON, of another format version or holds bad fields."""
    path = Path(run_dir) / OUTCOME_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OutcomeError(f"no run outcome {str(path)!r}: the server did not finish") from None
    except OSError as e:
        raise OutcomeError(f"cannot read the run outcome {str(path)!r}: {e.strerror or e}") from None
    except ValueError:
        raise OutcomeError(f"the run outcome {str(path)!r} is damaged (not JSON)") from None
    if not isinstance(data, dict):
        raise OutcomeError(f"the run outcome {str(path)!r} is damaged (not a JSON object)")
    checks.state_format(data, f"the run outcome {str(path)!r}", OUTCOME_FORMAT, error=OutcomeError)
    if set(data) != {"format", *_FIELDS}:
        raise OutcomeError(f"the run outcome {str(path)!r} is damaged (fields {sorted(data)})")
    try:
        return RunOutcome(**{name: data[name] for name in _FIELDS})
    except OutcomeError as e:
        raise OutcomeError(f"the run outcome {str(path)!r} is damaged: {e}") from None


def clear_outcome(run_dir: str | os.PathLike) -> None:
    """Remove an earlier run's outcome file (before a new launch reads the one it writes)."""
    (Path(run_dir) / OUTCOME_FILE).unlink(missing_ok=True)
