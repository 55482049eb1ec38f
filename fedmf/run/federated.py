"""Private federated training in a plain PyTorch loop — the in-process backend, and the
reference the Flower strategy must match bit for bit.

    result = train(model, users, plan, local_update, checkpoint_dir="run/", server_lr=1.0)

Each round t is ``fedmf.run.loop``'s, the Flower strategy's too, with local updates as its
cohort step: guard → select → open + record selection → local updates → validate, zero, clip,
sum → noise → divide by the planned expected users → server optimizer (exactly the workload A) →
checkpoint → ledger commit (naming the checkpoint's hash) → only then release (evaluation,
progress, callbacks). A round whose lifetime-budget charge loses to a concurrent run
(``ConcurrentChargeError``) is redone as the Flower strategy redoes it (``fedmf.run.ledger_retry``).

With ``secure_sum`` (``fedmf simulate --secure-aggregation``: ``server/secagg_inprocess.py``, found
through the ``fedmf.secure_aggregation`` entry point) the cohort step hands the round's local results
to secure aggregation, whose ``SecureSum`` (the unmasked residues) ``PrivateRun.aggregate`` privatizes: the server
side sees no update and no reported value.

Started again with the same plan and directory, ``train`` resumes after the last committed
round, whose noise it reproduces exactly; a round that was not committed is redone with the
same selection and fresh noise (fedmf.run.private_run). With deterministic local updates and
``repeatable_noise=True`` (tests only) the final model is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..audit.auditor import audit_command
from ..budgets import ConcurrentChargeError
from ..errors import ConfigError, NotLearning
from ..ledger.db import public_url
from ..plan import RunPlan
from ..round.client_metrics import METRIC as CLIENT_METRIC
from ..schedule import Selection
from ..secagg.errors import SecAggAbort
from ..secagg.secure_sum import SecureSum
from .learning_check import LearningCheck
from .ledger_retry import ledger_retry
from .loop import CohortStep, Contributions, LoopEnd, run_rounds
from .private_run import EVENTS, PrivateRun, RoundRecord
from .progress import ProgressBar, ProgressCallback, Step

__all__ = ["train", "TrainResult", "RoundRecord", "LocalUpdate", "LocalUpdates", "SecureSumStep", "EVENTS"]

#: a user's update: a mapping name → tensor (the model delta), or None when the user dropped out
LocalUpdate = Callable[[Mapping[str, torch.Tensor], Hashable, int], Mapping[str, torch.Tensor] | None]
#: a round's users trained together: (params, users, t) → {user: update or None}; a user missing
#: from the result dropped out
LocalUpdates = Callable[[Mapping[str, torch.Tensor], Sequence[Hashable], int],
                        Mapping[Hashable, Mapping[str, torch.Tensor] | None]]
#: secure aggregation of a round: (run, selection, {user: update}, {user: reported value}) → its SecureSum (the unmasked residues)
SecureSumStep = Callable[[PrivateRun, Selection, Mapping[Hashable, Any], Mapping[Hashable, Any]], SecureSum]


@dataclass
class TrainResult:
    """What ``train`` did; ``ledger`` is the ledger's URL without any password."""

    run_id: int
    ledger: str
    rounds_done: int
    stopped: str
    history: list[RoundRecord]
    plan: dict[str, Any]
    #: the ledger's chain head at the last committed round, "ROUND:HASH" (record it outside the ledger)
    head: str = ""
    #: the release witness file (None: off)
    witness: str | None = None
    #: the fewest users a round had to be able to select (``fedmf.run.cohort``; None: amplified sampling)
    min_cohort: int | None = None
    #: ``fedmf.run.learning_check.LearningCheck.to_dict()`` of this invocation's rounds
    learning: dict[str, Any] | None = None

    def audit_command(self) -> str:
        """``fedmf audit`` as the auditor runs it (``fedmf.audit.auditor``: never the server's role or password)."""
        return audit_command(self.ledger, self.run_id)


def round_progress(record: RoundRecord, total: int, start: int) -> Step:
    """The progress report of committed round ``record``: rounds done of ``total`` (a count), the
    round by its 0-based index (ARCHITECTURE.md, Names), ε spent, users and released metrics."""
    metrics = "  ".join(f"{k} {v:.4g}" for k, v in record.metrics.items())
    return Step(record.round + 1, total, note=f"round {record.round}: eps {record.epsilon:.4g}  users "
                f"{record.contributed}/{record.selected}" + (f"  {metrics}" if metrics else ""),
                final=record.round + 1 >= total, start=start)


def _split(result: Any) -> tuple[Any, Any]:
    """A local update's result → (update, reported train-loss or None): an update (a mapping), or a
    task's ``LocalResult`` (``update`` and ``metrics``)."""
    if result is None or isinstance(result, Mapping) or not hasattr(result, "update"):
        return result, None
    metrics = getattr(result, "metrics", None)
    return result.update, metrics.get(CLIENT_METRIC) if isinstance(metrics, Mapping) else None


def _local_cohort(run: PrivateRun, local_update: LocalUpdate | None,
                  local_updates: LocalUpdates | None, secure_sum: SecureSumStep | None = None) -> CohortStep:
    """The in-process cohort step: the selected users who are reachable train on a copy of the
    committed model (one at a time, or together through ``local_updates``). A result may be a task's
    ``LocalResult``: its reported train-loss then goes to the plan's private client-metric release
    (``fedmf.round.client_metrics``) and nowhere else. With ``secure_sum`` the updates and values go
    to secure aggregation and the step returns its ``SecureSum`` (an abort aborts the round)."""

    def cohort(selection: Selection) -> Contributions:
        t = selection.round
        updates: dict[Hashable, Any] = {}
        values: dict[Hashable, Any] = {}

        def keep(user: Hashable, result: Any) -> None:
            update, value = _split(result)
            if update is not None:
                updates[user] = update
                values[user] = value
        if local_updates is not None:
            reachable = list(selection.reachable)
            if reachable:
                batch = local_updates(run.global_params(), reachable, t)
                asked = set(reachable)
                strays = [user for user in batch if user not in asked]
                if strays:  # e.g. keys "3" for a user 3: every user would silently drop out
                    raise ConfigError(f"local_updates returned users that were not asked for in round "
                                      f"{t}: {strays[:3]!r}")
                for user in reachable:
                    keep(user, batch.get(user))
        else:
            for user in selection.reachable:
                keep(user, local_update(run.global_params(), user, t))
        if secure_sum is not None:
            try:
                return secure_sum(run, selection, updates, values), None, None
            except SecAggAbort as e:  # nothing of the round was noised or released
                run.abort(f"secure aggregation aborted: {e}")
                raise
        return updates, None, values if run.plan.client_metrics is not None else None

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
    progress: bool | ProgressCallback = False,
    repeatable_noise: bool = False,
    ledger_diagnostics: bool = False,
    budget_key: str | os.PathLike | None = None,
    witness: str | os.PathLike | None = None,
    min_clients_per_round: int | None = None,
    learning: LearningCheck | None = None,
    evaluate_every: int = 1,
    secure_sum: SecureSumStep | None = None,
) -> TrainResult:
    """Train ``model`` privately under ``plan`` over ``users`` (ids with a stable ``str``).

    ``local_update(params, user, t)`` gets a copy of the global parameters and returns the
    user's model delta (or None: the user dropped out); or, instead (``local_update=None``),
    ``local_updates(params, users, t)`` trains the round's reachable users together (vectorized
    clients) and returns {user: delta or None}. ``rounds``: stop after this many rounds
    in total (default: the plan's horizon). ``checkpoint_dir``: checkpoints, secrets (0600) and
    by default the SQLite ledger; the run resumes from it (default: a temporary directory, no
    resume). ``available(t)``: the users reachable in round t (default: all). ``evaluate(model)``
    runs after each commit (server-side held-out data). ``progress``: a callback that gets a
    ``fedmf.run.progress.Step`` when the run starts and after each released round (``round_progress``),
    or True for a ``ProgressBar`` on stderr. ``observed_guard`` (default: on for
    unamplified runs with a target ε) also stops before a round when a user's observed ε,
    accounted from the ledger, exceeds the target. ``repeatable_noise``: tests only, unsafe
    (``PrivateRun.open``). ``ledger_diagnostics``: a new run's ledger also keeps update norms
    (outside the DP guarantee). ``budget_key``: the ledger's budget secret file (lifetime budgets,
    ``PrivateRun.open``). ``witness``: the release witness's directory (``PrivateRun.open``; None:
    the user's state directory). A resumed run says so on stderr with ``progress``; a committed round
    whose record a stop cut off is recorded (the last one evaluated) before the next round.
    ``min_clients_per_round``: the fewest users a round must be able to
    select, else the run stops before that round (None or 0: the default, ``fedmf.run.cohort``).
    ``learning``: what says that the run is not learning (default ``LearningCheck()``: a
    non-finite model stops the run, a diverging held-out loss is recorded; ``fedmf.run.learning_check``).
    ``evaluate_every``: ``evaluate`` runs after every n-th round (rounds n-1, 2n-1, … 0-based) and after
    the last one (``rounds``) only; the others are released without held-out scores. ``secure_sum``:
    each round's updates are summed by secure aggregation (the plan must record it:
    ``RunPlan.with_secure_aggregation``)."""
    if isinstance(evaluate_every, bool) or not isinstance(evaluate_every, int) or evaluate_every < 1:
        raise ConfigError(f"evaluate_every must be an integer >= 1, got {evaluate_every!r}")
    if (secure_sum is None) != (plan.secure_aggregation is None):
        raise ConfigError("secure_sum is given exactly when the plan records secure aggregation")
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
                             ledger_diagnostics=ledger_diagnostics, budget_key=budget_key, witness=witness,
                             min_clients_per_round=min_clients_per_round) as run:
            history: list[RoundRecord] = []
            bar = progress or None
            if progress is True:
                bar = ProgressBar("fedmf", unit="rounds")
                if not bar.live:
                    bar.every_s = 0.0  # a plain line for every round on a pipe or in a log
            first = run.next_round
            if progress and run.resumed_from is not None:
                if isinstance(bar, ProgressBar):
                    bar.message(run.resumed_line())
                else:
                    sys.stderr.write(run.resumed_line() + "\n")
            if bar is not None and first < end:
                bar(Step(first, end, note="starting" if first == 0 else f"resuming at round {first}", start=first))
            check = LearningCheck() if learning is None else learning
            if check.announce is None and isinstance(bar, ProgressBar):
                check.announce = bar.message
            elif check.announce is None and progress:
                check.announce = lambda line: sys.stderr.write(line + "\n")

            def released(record: RoundRecord) -> None:
                if bar is not None:
                    bar(round_progress(record, end, first))
                if on_round is not None:
                    on_round(record)

            try:
                why = check.start(run.directory, run.next_round, None if evaluate is None else lambda: evaluate(model),
                                  run.model.parameters())
                if why is not None:  # a resumed model that is not finite: no round is played
                    ended = LoopEnd("learning", NotLearning(why))
                else:
                    ended = run_rounds(run, end, (lambda t: users) if available is None else available,
                                       _local_cohort(run, local_update, local_updates, secure_sum), observed=observed_guard,
                                       history=history,
                                       evaluate=None if evaluate is None else
                                       lambda record: evaluate(model) if (record.round + 1) % evaluate_every == 0
                                       or record.round + 1 == end else None,
                                       on_round=released,
                                       stop=lambda record: check.observe(record.round, record.metrics,
                                                                         run.model.parameters()),
                                       retry=ledger_retry((ConcurrentChargeError,)))
            finally:
                if progress is True:
                    bar.close()
            head_round, head = run.head
            return TrainResult(run.run_id, public_url(run.ledger_url), run.next_round, ended.stopped, history,
                               plan.to_dict(), f"{head_round}:{head}",
                               None if run.witness_path is None else str(run.witness_path),
                               run.min_cohort, check.to_dict())
    finally:
        if temporary is not None:
            temporary.cleanup()
