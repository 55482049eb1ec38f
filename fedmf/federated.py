"""Private federated training in a plain PyTorch loop — the in-process backend, and the
reference the Flower strategy must match bit for bit.

    result = train(model, users, plan, local_update, checkpoint_dir="run/", server_lr=1.0)

Each round t is ``fedmf.round_loop``'s, the Flower strategy's too, with local updates as its
cohort step: guard → select → open + record selection → local updates → validate, zero, clip,
sum → noise → divide by the planned expected users → server optimizer (exactly the workload A) →
checkpoint → ledger commit (naming the checkpoint's hash) → only then release (evaluation,
progress, callbacks).

Started again with the same plan and directory, ``train`` resumes after the last committed
round, whose noise it reproduces exactly; a round that was not committed is redone with the
same selection and fresh noise (fedmf.run). With deterministic local updates and
``repeatable_noise=True`` (tests only) the final model is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import torch

from .auditor import audit_command
from .errors import ConfigError, NotLearning
from .learning_check import LearningCheck
from .ledger.db import public_url
from .plan import RunPlan
from .round_loop import CohortStep, Contributions, LoopEnd, run_rounds
from .run import EVENTS, PrivateRun, RoundRecord
from .schedule import Selection

__all__ = ["train", "TrainResult", "RoundRecord", "LocalUpdate", "LocalUpdates", "EVENTS"]

#: a user's update: a mapping name → tensor (the model delta), or None when the user dropped out
LocalUpdate = Callable[[Mapping[str, torch.Tensor], Hashable, int], Mapping[str, torch.Tensor] | None]
#: a round's users trained together: (params, users, t) → {user: update or None}; a user missing
#: from the result dropped out
LocalUpdates = Callable[[Mapping[str, torch.Tensor], Sequence[Hashable], int],
                        Mapping[Hashable, Mapping[str, torch.Tensor] | None]]


@dataclass
class TrainResult:
    """What ``train`` did; ``ledger`` is the ledger's URL without any password."""

    run_id: int
    ledger: str
    rounds_done: int
    stopped: str
    history: list[RoundRecord]
    plan: dict[str, Any]
    #: the fewest users a round had to be able to select (``fedmf.cohort``; None: amplified sampling)
    min_cohort: int | None = None
    #: ``fedmf.learning_check.LearningCheck.to_dict()`` of this invocation's rounds
    learning: dict[str, Any] | None = None

    def audit_command(self) -> str:
        """``fedmf audit`` as the auditor runs it (``fedmf.auditor``: never the server's role or password)."""
        return audit_command(self.ledger, self.run_id)


class _Progress:
    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled and total > 0, total

    def show(self, record: RoundRecord) -> None:
        if not self.enabled:
            return
        metrics = " ".join(f"{k} {v:.4g}" for k, v in record.metrics.items())
        sys.stderr.write(f"\rround {record.round + 1}/{self.total}  eps {record.epsilon:.4g}  users "
                         f"{record.contributed}/{record.selected}  {metrics}".ljust(79))
        sys.stderr.flush()

    def note(self, line: str) -> None:
        """A line of its own (e.g. ``fedmf.learning_check``'s), below the progress line."""
        sys.stderr.write(f"\n{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _local_cohort(run: PrivateRun, local_update: LocalUpdate | None,
                  local_updates: LocalUpdates | None) -> CohortStep:
    """The in-process cohort step: the selected users who are reachable train on a copy of the
    committed model (one at a time, or together through ``local_updates``)."""

    def cohort(selection: Selection) -> Contributions:
        t = selection.round
        updates: dict[Hashable, Any] = {}
        if local_updates is not None:
            reachable = list(selection.reachable)
            if reachable:
                batch = local_updates(run.global_params(), reachable, t)
                asked = set(reachable)
                strays = [user for user in batch if user not in asked]
                if strays:  # e.g. keys "3" for a user 3: every user would silently drop out
                    raise ConfigError(f"local_updates returned users that were not asked for in round "
                                      f"{t}: {strays[:3]!r}")
                updates = {user: batch[user] for user in reachable if batch.get(user) is not None}
        else:
            for user in selection.reachable:
                update = local_update(run.global_params(), user, t)
                if update is not None:
                    updates[user] = update
        return updates, None

    return cohort


def train(
    model: torch.nn.Module,
    users: Sequence[Hashable],
    plan: RunPlan,
    local_update: LocalUpdate | None,
    *,
    local_updates: LocalUpdates | None = None,
    server_lr: float = 1.0,
    optimizer: str = "workload",
    rounds: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    ledger: str | os.PathLike | None = None,
    available: Callable[[int], Iterable[Hashable]] | None = None,
    evaluate: Callable[[torch.nn.Module], Mapping[str, float]] | None = None,
    on_event: Callable[[str, int], None] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    observed_guard: bool | None = None,
    progress: bool = False,
    repeatable_noise: bool = False,
    ledger_diagnostics: bool = False,
    budget_key: str | os.PathLike | None = None,
    min_clients_per_round: int | None = None,
    learning: LearningCheck | None = None,
) -> TrainResult:
    """Train ``model`` privately under ``plan`` over ``users`` (ids with a stable ``str``).

    ``local_update(params, user, t)`` gets a copy of the global parameters and returns the
    user's model delta (or None: the user dropped out); or, instead (``local_update=None``),
    ``local_updates(params, users, t)`` trains the round's reachable users together (vectorized
    clients) and returns {user: delta or None}. ``rounds``: stop after this many rounds
    in total (default: the plan's horizon). ``checkpoint_dir``: checkpoints, secrets (0600) and
    by default the SQLite ledger; the run resumes from it (default: a temporary directory, no
    resume). ``available(t)``: the users reachable in round t (default: all). ``evaluate(model)``
    runs after each commit (server-side held-out data). ``observed_guard`` (default: on for
    unamplified runs with a target ε) also stops before a round when a user's observed ε,
    accounted from the ledger, exceeds the target. ``repeatable_noise``: tests only, unsafe
    (``PrivateRun.open``). ``ledger_diagnostics``: a new run's ledger also keeps update norms
    (outside the DP guarantee). ``budget_key``: the ledger's budget secret file (lifetime budgets,
    ``PrivateRun.open``). ``min_clients_per_round``: the fewest users a round must be able to
    select, else the run stops before that round (None or 0: the default, ``fedmf.cohort``).
    ``learning``: what says that the run is not learning (default ``LearningCheck()``: a
    non-finite model stops the run, a diverging held-out loss is recorded; ``fedmf.learning_check``)."""
    if (local_update is None) == (local_updates is None):
        raise ConfigError("give exactly one of local_update (one user at a time) and local_updates (a round's users)")
    users = list(users)
    if not users or len({str(u) for u in users}) != len(users):
        raise ConfigError("users must be a non-empty list of distinct ids (distinct as strings)")
    end = plan.rounds if rounds is None else rounds
    if isinstance(end, bool) or not isinstance(end, int) or not 0 < end <= plan.rounds:
        raise ConfigError(f"rounds must be an integer in [1, {plan.rounds}], got {rounds!r}")
    temporary = tempfile.TemporaryDirectory(prefix="fedmf-") if checkpoint_dir is None else None
    directory = temporary.name if temporary is not None else checkpoint_dir
    try:
        with PrivateRun.open(model, plan, directory, ledger=ledger, server_lr=server_lr, optimizer=optimizer,
                             population=users, on_event=on_event, repeatable_noise=repeatable_noise,
                             ledger_diagnostics=ledger_diagnostics, budget_key=budget_key,
                             min_clients_per_round=min_clients_per_round) as run:
            history: list[RoundRecord] = []
            bar = _Progress(progress, end)
            check = LearningCheck() if learning is None else learning
            if check.announce is None and bar.enabled:
                check.announce = bar.note

            def released(record: RoundRecord) -> None:
                bar.show(record)
                if on_round is not None:
                    on_round(record)

            try:
                why = check.start(run.directory, run.next_round, None if evaluate is None else lambda: evaluate(model),
                                  run.model.parameters())
                if why is not None:  # a resumed model that is not finite: no round is played
                    ended = LoopEnd("learning", NotLearning(why))
                else:
                    ended = run_rounds(run, end, (lambda t: users) if available is None else available,
                                       _local_cohort(run, local_update, local_updates), observed=observed_guard,
                                       history=history,
                                       evaluate=None if evaluate is None else lambda _: evaluate(model),
                                       on_round=released,
                                       stop=lambda record: check.observe(record.round, record.metrics,
                                                                         run.model.parameters()))
            finally:
                bar.close()
            return TrainResult(run.run_id, public_url(run.ledger_url), run.next_round, ended.stopped, history,
                               plan.to_dict(), run.min_cohort, check.to_dict())
    finally:
        if temporary is not None:
            temporary.cleanup()
