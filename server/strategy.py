"""The DP-MF strategy: Flower's hooks as the round's recipe, each step one call into fedmf.

    configure_train:  guard → identify users → select (scheduler + ledger) → messages
    aggregate_train:  validate replies → privatize + optimizer step → commit + checkpoint → metrics
    start:            the round loop; the new model leaves the server only after the commit

Validation as a Flower message happens here (``server.replies``); validation of the update's
values, clipping, noise and the division by the planned users happen in ``fedmf``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Callable, Iterable, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedmf.auditor import audit_command
from fedmf.config import RunConfig
from fedmf.errors import HorizonReached, PrivacyBudgetExceeded
from fedmf.ledger.db import LedgerError, public_url
from fedmf.run import PrivateRun, RoundRecord

from .identity import IdentityPolicy, NodeDirectory, identity_policy
from .replies import RoundReplies, max_update_bytes

__all__ = ["DPMFStrategy"]

log = logging.getLogger("fedmf.server")
T = TypeVar("T")
#: a round whose ledger write fails is redone after 1, 2, 4, … s (at most 30 s), up to 8 times
LEDGER_RETRIES, LEDGER_BACKOFF_S, LEDGER_BACKOFF_MAX_S = 8, 1.0, 30.0


class DPMFStrategy(Strategy):
    """Privatizes every round with the run's DP-MF mechanism (``fedmf.run.PrivateRun``)."""

    def __init__(self, run: PrivateRun, config: RunConfig, *,
                 evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
                 identity: IdentityPolicy | None = None, min_available: int = 1) -> None:
        self.run = run
        self.min_available = min_available
        # the worst user's observed ε (accounted from the ledger) as a metric: unamplified runs only
        self.observed_metric = run.plan.sampling.observed_guard
        self.config = config
        self.evaluate_fn = evaluate_fn
        self.nonce = secrets.token_hex(16)  # replies to another server process are refused
        self.identity = identity  # None: identity_policy(grid, config) at the first round (no population check)
        self.nodes: NodeDirectory | None = None
        self.history: list[RoundRecord] = []
        self.stopped = ""
        self._replies: RoundReplies | None = None

    # ---- the round -----------------------------------------------------------------------
    def _directory(self, grid: Grid) -> NodeDirectory:
        """Who is behind which node (``server.identity``), bound to this run and server process."""
        if self.nodes is None:
            policy = self.identity or identity_policy(grid, self.config, None)
            self.nodes = NodeDirectory(policy, run=f"{self.run.run_id}:{self.nonce}",
                                        timeout=self.config.identity_timeout,
                                        label=lambda user: self.run.user_key(user).hex()[:12])
        return self.nodes

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        t = self.run.next_round
        nodes = self._directory(grid)
        reachable = nodes.refresh(grid, t)
        selection = self.run.select(reachable)
        self._replies = RoundReplies(t, self.nonce, {user: reachable[user] for user in selection.reachable}, nodes)
        content = {"round": t, "run-nonce": self.nonce, "task": self.config.task,
                   "task-options": json.dumps(self.config.task_options, sort_keys=True),
                   "client-lr": self.config.client_lr, "local-epochs": self.config.local_epochs,
                   "batch-size": self.config.batch_size}
        return [Message(RecordDict({"arrays": arrays, "config": ConfigRecord({**content, "user-id": user})}),
                        dst_node_id=node, message_type=MessageType.TRAIN)
                for user, node in self._replies.expected.items()]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        received = self._replies
        if received is None:
            raise RuntimeError("aggregate_train before configure_train")
        self._replies = None
        received.read(replies, self.run.privatizer.layout)
        report = self.run.aggregate(received.updates, received.rejected)
        record = self.run.commit()  # only now may the round's model leave the server
        record.metrics.update(received.metrics(str(u.user) for u in report.contributed))
        self.history.append(record)
        metrics = {"epsilon": record.epsilon, "selected": record.selected, "received": len(received.updates),
                   "rejected": record.rejected, "clipped": record.clipped, "zeroed": record.zeroed,
                   "dropped": record.dropped, **record.metrics}
        if self.observed_metric:
            try:
                worst = self.run.observed_epsilon()
            except LedgerError as e:  # the round is committed: never redone for a metric the ledger cannot give now
                worst = None
                log.warning("fedmf round %d: committed; its epsilon-worst-user-run metric is left out (%s)",
                            record.round, e)
            if worst is not None:
                # the worst user's ε over the whole run for the participations so far (what the observed
                # guard checks): it bounds what that user will have spent at the end, so it can exceed
                # the planned per-round curve, which only counts the releases made so far
                metrics["epsilon-worst-user-run"] = record.metrics["epsilon-worst-user-run"] = worst
        del report
        return ArrayRecord(self.run.model.state_dict()), MetricRecord(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        # federated evaluation would run on training users and is outside the DP guarantee: off
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        plan = self.run.plan
        log.info("fedmf DP-MF strategy: %s mechanism, %d rounds, %s, sampling %s, clip %g, z %.4g, noise std %.4g, "
                 "epsilon %.4g at delta %g", plan.mechanism.kind, plan.rounds, plan.schema.name, plan.sampling,
                 plan.clip_norm, plan.noise_multiplier, plan.noise_std, plan.epsilon(), plan.delta)
        log.info("fedmf: a reply holds the records arrays, config and metrics only, its arrays at most %d bytes "
                 "(the model in float64 as .npy); anything else is rejected",
                 max_update_bytes(self.run.privatizer.layout))

    # ---- the loop ------------------------------------------------------------------------
    def _with_retries(self, t: int, step: Callable[[], T], given_up: str) -> T:
        """``step()``; when the ledger fails, retried after 1, 2, 4, … s (``given_up``: what the
        failure left, for the log line)."""
        for attempt in range(LEDGER_RETRIES + 1):
            try:
                return step()
            except LedgerError as e:
                if attempt == LEDGER_RETRIES:
                    raise
                wait = min(LEDGER_BACKOFF_MAX_S, LEDGER_BACKOFF_S * 2 ** attempt)
                log.warning("fedmf round %d: the ledger failed (%s); %s; retry %d/%d in %.3g s", t, e, given_up,
                            attempt + 1, LEDGER_RETRIES, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _round_with_retries(self, t: int, grid: Grid, train_config: ConfigRecord,
                            timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Round t; when the ledger fails, the round is aborted (nothing of it was released) and
        redone after an exponential backoff — the same selection, fresh noise (a new salt per
        attempt); the committed rounds before it stay exactly as they were."""
        def attempt() -> tuple[ArrayRecord | None, MetricRecord | None]:
            self.run.global_params()  # raises if the state in memory is not the committed one (nothing is sent)
            arrays = ArrayRecord(self.run.model.state_dict())
            messages = self.configure_train(t + 1, arrays, train_config, grid)
            replies = grid.send_and_receive(messages, timeout=timeout)
            return self.aggregate_train(t + 1, replies)

        return self._with_retries(t, attempt, "the round was aborted and nothing of it was released")

    @staticmethod
    def _progress(record: RoundRecord, end: int) -> None:
        extra = "  ".join(f"{k} {v:.4g}" for k, v in record.metrics.items())
        log.info("fedmf round %d/%d  eps %.4g  users %d/%d  rejected %d  dropped %d  clipped %d  zeroed %d  %s",
                 record.round + 1, end, record.epsilon, record.contributed, record.selected, record.rejected,
                 record.dropped, record.clipped, record.zeroed, extra)

    def _wait_for_users(self, grid: Grid) -> None:
        """Before the first round, wait (up to the reply timeout) until ``min_available`` users
        are connected and identified, as Flower's FedAvg waits for its minimum of nodes."""
        deadline = time.time() + self.config.reply_timeout
        while len(self._directory(grid).refresh(grid, self.run.next_round)) < self.min_available \
                and time.time() < deadline:
            time.sleep(1.0)

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run (or resume) rounds until the plan's horizon, ``num_rounds`` in total, or the guard."""
        evaluate_fn = evaluate_fn or self.evaluate_fn
        timeout = self.config.reply_timeout if timeout is None else timeout
        end = self.run.plan.rounds if num_rounds is None else min(num_rounds, self.run.plan.rounds)
        self.summary()
        result = Result()
        observed = self.run.plan.sampling.observed_guard and self.run.plan.target_epsilon is not None
        started = time.time()
        if self.run.next_round < end:  # a restart with no round left (say, to write the final model) waits for no one
            self._wait_for_users(grid)
        while self.run.next_round < end:
            try:  # the observed guard reads the ledger: a database that is down is waited for
                self._with_retries(self.run.next_round, lambda: self.run.guard(observed=observed),
                                   "the round has not started")
            except (PrivacyBudgetExceeded, HorizonReached) as e:
                self.stopped = str(e)
                log.info("fedmf: stopping: %s", e)
                break
            t = self.run.next_round
            new_arrays, metrics = self._round_with_retries(t, grid, train_config or ConfigRecord(), timeout)
            result.arrays = new_arrays
            result.train_metrics_clientapp[t + 1] = metrics
            if evaluate_fn is not None:
                evaluation = evaluate_fn(t + 1, new_arrays)
                if evaluation is not None:
                    result.evaluate_metrics_serverapp[t + 1] = evaluation
                    self.history[-1].metrics.update({k: float(v) for k, v in evaluation.items()})
            self._progress(self.history[-1], end)
            self.run.released(t)
        else:
            self.stopped = "horizon" if end == self.run.plan.rounds else "rounds"
        # a password in the URL is never logged; the audit command is the auditor's (fedmf.auditor)
        log.info("fedmf: %d rounds committed in %.1fs (%s); ledger %s; audit with: %s", self.run.next_round,
                 time.time() - started, self.stopped or "done", public_url(self.run.ledger_url),
                 audit_command(self.run.ledger_url, self.run.run_id))
        if not result.arrays:
            result.arrays = ArrayRecord(self.run.model.state_dict())
        return result
