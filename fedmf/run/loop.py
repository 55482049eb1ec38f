"""The round loop both drivers run: guard → select → cohort → aggregate → commit → evaluate → release.

    end = run_rounds(run, rounds, available, cohort, evaluate=..., on_round=...)

``fedmf.run.federated.train`` and the Flower strategy (``server/strategy.py``) differ only in the
cohort step — how the selected users' updates reach the server: local updates in process, or
messages to the users' nodes and their validated replies — and in what they do with a committed
round (metrics, evaluation, progress) and with a failing ledger (``retry``). The order of the
steps, which carries ARCHITECTURE.md's rules, is here once:

* the guard (horizon, planned ε, the worst observed user's ε) runs before anything of a round;
* the scheduler, not the cohort, decides who takes part (``PrivateRun.select``);
* the round is committed (checkpoint, then ledger) before anything derived from it — metrics,
  evaluation, the model — leaves the server, and ``PrivateRun.released`` marks it released;
* a round that fails before its commit is aborted by ``PrivateRun`` (nothing of it was
  released) and may be redone by ``retry``, the same selection with fresh noise;
* a committed round whose record a stop cut off (between its commit and its release) gets it on
  resume, before the next round (``recover_records``): the last committed round evaluated then from
  its checkpoint (the model a resume loads), an older one with the ledger's counts and no metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CohortTooSmall, FedmfError, HorizonReached, NotLearning, PrivacyBudgetExceeded
from ..plan import RunPlan
from ..round.privatize import RoundReport
from ..schedule import Selection
from .private_run import RECOVERED_EVALUATED, RECOVERED_UNEVALUATED, PrivateRun, RoundRecord

__all__ = ["run_rounds", "play_round", "settle", "recover_records", "LoopEnd", "Contributions", "CohortStep", "Retry", "no_retry",
           "observed_accounting", "observed_guard", "GUARD", "ROUND"]

T = TypeVar("T")
#: a round's updates, user → update (a mapping name → tensor), and the users whose reply was
#: refused before it reached the engine, user → reason (None: none); optionally third, the users'
#: reported training loss, user → value (read only by a private client-metric release)
Contributions = (tuple[Mapping[Hashable, Any], Mapping[Hashable, str] | None]
                 | tuple[Mapping[Hashable, Any], Mapping[Hashable, str] | None, Mapping[Hashable, Any] | None])
#: the cohort step: the round's selection → the selected users' contributions
CohortStep = Callable[[Selection], Contributions]
#: ``retry(t, step, stage)`` runs ``step()`` for round t, and may run it again after a failure
#: (``stage``: ``GUARD``, nothing of round t has started; ``ROUND``, round t was aborted and
#: nothing of it was released)
Retry = Callable[[int, Callable[[], T], str], T]
GUARD, ROUND = "guard", "round"


def no_retry(t: int, step: Callable[[], T], stage: str) -> T:
    """``step()`` once: a failure ends the loop."""
    return step()


def observed_accounting(plan: RunPlan) -> bool:
    """Whether a user's ε can be accounted from the ledger's observed participations: without
    sampling only (an amplified run's guarantee comes from the sampling, which the ledger's
    pattern does not carry)."""
    return plan.sampling.observed_guard


def observed_guard(plan: RunPlan) -> bool:
    """Whether the guard also checks the worst observed user's ε by default: an unamplified run
    with a target ε."""
    return observed_accounting(plan) and plan.target_epsilon is not None


@dataclass(frozen=True)
class LoopEnd:
    """How the loop ended: ``reason`` "horizon" (the plan's last round done), "rounds" (the
    rounds asked for done, before the horizon), "guard" (``stop``, the guard's
    ``PrivacyBudgetExceeded`` or ``HorizonReached``, ended it before a round), "cohort" (``stop``, a
    ``CohortTooSmall``: too few users could take part, the round was not played; ``fedmf.run.cohort``) or
    "learning" (``stop``, a ``NotLearning`` from the driver's ``stop`` hook after a committed round)."""

    reason: str
    stop: FedmfError | None = None

    @property
    def stopped(self) -> str:
        """One line: the reason, or ``<reason>: <the stop's message>``."""
        return self.reason if self.stop is None else f"{self.reason}: {self.stop}"


def settle(run: PrivateRun, updates: Mapping[Hashable, Any], rejected: Mapping[Hashable, str] | None = None,
           values: Mapping[Hashable, Any] | None = None) -> tuple[RoundRecord, RoundReport]:
    """Aggregate the open round's contributions (validate, zero, clip, sum, noise, ÷ planned
    users, optimizer step: ``PrivateRun.aggregate``), then commit it (``PrivateRun.commit``)."""
    report = run.aggregate(updates, rejected) if values is None else run.aggregate(updates, rejected, values)
    return run.commit(), report


def play_round(run: PrivateRun, available: Iterable[Hashable], cohort: CohortStep) -> tuple[RoundRecord, RoundReport]:
    """One round up to its commit: select among ``available``, ``cohort(selection)``, ``settle``."""
    selection = run.select(available)
    updates, rejected, *values = cohort(selection)
    return settle(run, updates, rejected, values[0] if values else None)


def recover_records(run: PrivateRun, evaluate: Callable[[RoundRecord], Mapping[str, float] | None] | None = None,
                    on_round: Callable[[RoundRecord], None] | None = None) -> list[RoundRecord]:
    """Write the round log records that a stop between a commit and its release cut off
    (``PrivateRun.missing_records``). The last committed round's model is the one in memory after a
    resume, so ``evaluate(record)`` scores it and its scores join the record; an older round (only a
    run directory from before this recovery can have one) keeps the ledger's counts and no metrics.
    Each record is marked in the log as written on resume, then passed to ``on_round``. Returns them."""
    records = run.missing_records()
    last = run.next_round - 1
    for record in records:
        recovered = RECOVERED_UNEVALUATED
        if record.round == last and evaluate is not None:  # committed and witnessed: it may be released
            scores = evaluate(record)
            if scores is not None:
                record.metrics.update({k: float(v) for k, v in scores.items()})
            recovered = RECOVERED_EVALUATED
        run.record_missing(record, recovered)
        if on_round is not None:
            on_round(record)
    return records


def run_rounds(run: PrivateRun, end: int, available: Callable[[int], Iterable[Hashable]], cohort: CohortStep, *,
               observed: bool | None = None, history: list[RoundRecord] | None = None,
               committed: Callable[[RoundRecord, RoundReport], None] | None = None,
               evaluate: Callable[[RoundRecord], Mapping[str, float] | None] | None = None,
               on_round: Callable[[RoundRecord], None] | None = None, retry: Retry = no_retry,
               stop: Callable[[RoundRecord], str | None] | None = None) -> LoopEnd:
    """Run (or resume) ``run``'s rounds until round ``end`` (exclusive) or the guard stops it.

    Each round t: ``run.guard`` (``observed``: also the worst observed user's ε; default
    ``observed_guard(plan)``), under ``retry(t, ·, GUARD)``; then under ``retry(t, ·, ROUND)``,
    ``play_round`` with the users ``available(t)``; the committed record appended to ``history``;
    ``committed(record, report)`` (the driver's round metrics); ``evaluate(record)``, whose
    scores join ``record.metrics``; ``run.released(t)``; ``on_round(record)``; ``stop(record)``, whose
    reason (not None) ends the loop after that round (``NotLearning``: ``fedmf.run.learning_check``). A
    ``CohortTooSmall`` from the round's selection (which ``retry`` may wait out) ends the loop before
    anything of the round exists. First, the records a stop cut off are written (``recover_records``,
    with ``evaluate`` and ``on_round``)."""
    observed = observed_guard(run.plan) if observed is None else observed
    history = [] if history is None else history
    recover_records(run, evaluate, on_round)
    while run.next_round < end:
        t = run.next_round
        try:
            retry(t, lambda: run.guard(observed=observed), GUARD)
        except (PrivacyBudgetExceeded, HorizonReached) as e:
            return LoopEnd("guard", e)
        try:
            record, report = retry(t, lambda: play_round(run, available(t), cohort), ROUND)  # noqa: B023 (retry calls it at once)
        except CohortTooSmall as e:  # raised by select before the round was decided or recorded
            return LoopEnd("cohort", e)
        history.append(record)
        if committed is not None:
            committed(record, report)
        del report
        if evaluate is not None:  # only now: round t is committed
            scores = evaluate(record)
            if scores is not None:
                record.metrics.update({k: float(v) for k, v in scores.items()})
        run.released(t)
        if on_round is not None:
            on_round(record)
        why = None if stop is None else stop(record)
        if why is not None:
            return LoopEnd("learning", NotLearning(why))
    return LoopEnd("horizon" if end == run.plan.rounds else "rounds")
