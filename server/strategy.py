"""The DP-MF strategy: a Flower ``Strategy`` whose ``start`` runs fedmf's round loop with Flower
I/O as its cohort step. Each round, in ``fedmf.run.loop.run_rounds``:

    guard        PrivateRun.guard (horizon, planned ε, the worst observed user's ε)
    select       who is connected (server.identity) → PrivateRun.select (scheduler + ledger)
    send         TRAIN messages with the committed model → Grid.send_and_receive
    validate     the replies as Flower messages (server.replies)
    clip … step  PrivateRun.aggregate: validate values, zero, clip, sum, noise, ÷ planned users, step
    commit       PrivateRun.commit: checkpoint, then the ledger
    broadcast    only now: metrics, server-side evaluation, PrivateRun.released, the progress line;
                 the model goes out in the next round's messages and in ``start``'s Result

What is the strategy's own: the Flower I/O, the ledger retries (a guard or a round that the ledger
fails is redone after a backoff; an aborted round released nothing) and the round's metrics. The
metrics clients report (training loss, example counts) are never published as sent: with
``client-metrics = "private"`` the engine releases the training loss clipped, summed and noised
(``fedmf.round.client_metrics``), otherwise nothing of them.
``configure_train`` / ``aggregate_train`` (abstract in Flower's ``Strategy``) are not used by
``start``: they are the two halves of one round for a caller that drives the hooks itself.

With ``secure-aggregation = "secaggplus"`` (``config.secagg``) the send/validate steps are the
SecAgg+ stages (``server/secagg_round.py``): the clients clip to the ζₜ sent, zero, check and
quantize their own updates and mask them (with ``client-metrics = "private"`` their training loss too,
as the last masked word); the engine privatizes the unmasked modular sum (``PrivateRun.aggregate``
with a ``SecureSum``: σ from ζ·inflation, the plan's recorded inflation, the noise added before the
sum is centred, ÷ the planned users). A round
whose secure sum aborts (survivors below the threshold) is aborted — nothing of it was noised or
released — and redone with fresh noise, up to ``SECAGG_REDOS`` times; a client whose committed
shares did not give its committed secret, or that returned a share other than the one committed to
it, is left out of the redo (recorded as rejected, hence not in the sum).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedmf.audit.auditor import audit_command
from fedmf.errors import CohortTooSmall, ConfigError, NotLearning
from fedmf.ledger.db import LedgerError, public_url
from fedmf.round.privatize import RoundReport
from fedmf.run.learning_check import LearningCheck
from fedmf.run.ledger_retry import ledger_retry
from fedmf.run.loop import ROUND, Contributions, LoopEnd, observed_accounting, run_rounds, settle
from fedmf.run.private_run import PrivateRun, RoundRecord
from fedmf.schedule import Selection
from fedmf.secagg.errors import SecAggAbort
from fedmf.secagg.secure_sum import SecureSum

from .config import ServerConfig
from .identity import IdentityPolicy, NodeDirectory, identity_policy
from .replies import RoundReplies, max_update_bytes
from .secagg_round import SecureRound, run_quantization

__all__ = ["DPMFStrategy"]

log = logging.getLogger("fedmf.server")
T = TypeVar("T")
#: a round whose ledger write fails is redone after 1, 2, 4, … s (at most 30 s), up to 8 times
LEDGER_RETRIES, LEDGER_BACKOFF_S, LEDGER_BACKOFF_MAX_S = 8, 1.0, 30.0
#: a round too few users can join (``fedmf.run.cohort``) is tried again every COHORT_POLL_S seconds, for at
#: most the configuration's reply-timeout, then the run stops (resumable)
COHORT_POLL_S = 5.0
#: a round whose secure sum aborted is redone (fresh noise, nothing released) up to this many times
SECAGG_REDOS = 3


class DPMFStrategy(Strategy):
    """Privatizes every round with the run's DP-MF mechanism (``fedmf.run.private_run.PrivateRun``), driven by
    ``start``. ``history``: the committed rounds' records; ``stopped``: how the last ``start``
    ended ("horizon", "rounds", or the guard's message)."""

    def __init__(self, run: PrivateRun, config: ServerConfig, *,
                 evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
                 identity: IdentityPolicy | None = None, min_available: int = 1) -> None:
        self.run = run
        self.min_available = min_available
        # the worst user's observed ε (accounted from the ledger) as a metric: unamplified runs only
        self.observed_metric = observed_accounting(run.plan)
        self.config = config
        self.evaluate_fn = evaluate_fn
        self.nonce = secrets.token_hex(16)  # replies to another server process are refused
        self.identity = identity  # None: identity_policy(grid, config) at the first round (no population check)
        self.nodes: NodeDirectory | None = None
        self.history: list[RoundRecord] = []
        self.stopped = ""
        self._reachable: dict = {}  # user → node of the identified users connected at the last refresh
        self._replies: RoundReplies | None = None  # the replies the open round's messages expect
        self.cohort_poll_s = COHORT_POLL_S
        self.learning = LearningCheck(settings={"server-lr": config.server_lr, "clip-norm": config.clip_norm,
                                                **({} if config.target_epsilon is None
                                                   else {"epsilon": config.target_epsilon})},
                                      flag="", stop_when_diverging=config.stop_when_diverging,
                                      announce=lambda line: log.warning("fedmf: %s", line))
        #: None: the central mode; else the SecAgg+ rounds (server/secagg_round.py)
        self.secure = None if config.secagg is None else self._secure_round(run, config)
        #: users left out of the open round's redo (user → reason) and that round
        self._excluded: dict = {}
        self._excluded_round: int | None = None

    @staticmethod
    def _secure_round(run: PrivateRun, config: ServerConfig) -> SecureRound:
        """The run's SecAgg+ rounds (the ServerApp checked, before the run opened, that no cohort of
        its population can wrap the modular sum: ``server.app``)."""
        q = run_quantization(config.secagg, run.plan, run.privatizer.size)
        return SecureRound(config.secagg, q, run.privatizer.layout)

    # ---- Flower I/O: who is connected, the TRAIN messages, the replies --------------------------
    def _directory(self, grid: Grid) -> NodeDirectory:
        """Who is behind which node (``server.identity``), bound to this run and server process."""
        if self.nodes is None:
            policy = self.identity or identity_policy(grid, self.config, None)
            self.nodes = NodeDirectory(policy, run=f"{self.run.run_id}:{self.nonce}",
                                        timeout=self.config.identity_timeout,
                                        label=lambda user: self.run.user_key(user).hex()[:12])
        return self.nodes

    def _available(self, grid: Grid, t: int) -> dict:
        """The identified users connected now, user → node: whom round t's scheduler may select."""
        self._reachable = self._directory(grid).refresh(grid, t)
        return self._reachable

    def _train_config(self, t: int) -> dict[str, Any]:
        """What every TRAIN message of round t tells its client (its user id is added per message):
        the round and run nonce it must echo, the task and the local-training hyperparameters."""
        return {"round": t, "run-nonce": self.nonce, "task": self.config.task,
                "task-options": json.dumps(self.config.task_options, sort_keys=True),
                "client-lr": self.config.client_lr, "local-epochs": self.config.local_epochs,
                "batch-size": self.config.batch_size}

    def _messages(self, selection: Selection, arrays: ArrayRecord) -> list[Message]:
        """One TRAIN message with ``arrays`` (the committed model) per selected user who is
        connected; the round's replies are expected from exactly those nodes."""
        t = selection.round
        self._replies = RoundReplies(t, self.nonce, {user: self._reachable[user] for user in selection.reachable},
                                     self.nodes)
        content = self._train_config(t)
        return [Message(RecordDict({"arrays": arrays, "config": ConfigRecord({**content, "user-id": user})}),
                        dst_node_id=node, message_type=MessageType.TRAIN)
                for user, node in self._replies.expected.items()]

    def _validate(self, replies: Iterable[Message], timeout: float | None = None) -> RoundReplies:
        """The replies to the open round's messages, validated as Flower messages (``server.replies``).
        The nodes that sent nothing within ``timeout`` (default: the reply timeout) back off
        (``NodeDirectory.missed``): their users are not reachable, so not sent a message, until
        they prove their identity again."""
        received, self._replies = self._replies, None
        if received is None:
            raise RuntimeError("aggregate_train before configure_train")
        received.read(replies, self.run.privatizer.layout)
        heard = {user for user in received.expected if user in received.updates or user in received.rejected}
        self.nodes.answered(node for user, node in received.expected.items() if user in heard)
        self.nodes.missed([node for user, node in received.expected.items() if user not in heard],
                          self.config.reply_timeout if timeout is None else timeout)
        return received

    def _secure_exchange(self, grid: Grid, selection: Selection, timeout: float) -> SecureSum:
        """The round's SecAgg+ stages with the selected users who are connected; their secure sum (the unmasked residues).
        A ``SecAggAbort`` aborts the open round (nothing of it was noised) before it propagates."""
        t = selection.round
        if self._excluded_round != t:
            self._excluded_round, self._excluded = t, {}
        expected = {user: self._reachable[user] for user in selection.reachable}
        privatizer = self.run.privatizer
        config = {**self._train_config(t),
                  **self.secure.encoding(privatizer.clip_norm, privatizer.clipping.zero_threshold)}
        try:
            total = self.secure.run(grid, expected, config, ArrayRecord(self.run.model.state_dict()), timeout,
                                    self._excluded)
        except SecAggAbort as e:
            self.run.abort(f"secure aggregation aborted: {e}")
            self._exclude_culprits(expected)
            raise
        finally:
            protocol = self.secure.server  # None: no protocol ran (a cohort below the threshold), nobody asked
            asked = {} if protocol is None else {u: node for u, node in expected.items() if node in protocol.sampled}
            heard = {u for u, node in asked.items() if protocol is not None and node in protocol.u1}
            self.nodes.answered(node for user, node in asked.items() if user in heard)
            self.nodes.missed([node for user, node in asked.items() if user not in heard], timeout)
        return total

    def _exclude_culprits(self, expected: dict) -> None:
        """Leave the culprits (owners whose committed shares did not give their committed secret,
        holders that returned shares other than the committed ones) and the survivors that did not
        sign the survivor set at the consistency check out of the round's redo: the same selection
        (they stay sampled for the accountant) with them as rejected, i.e. dropped from the sum, so
        that one hostile client cannot abort every attempt (REVIEW-i36 MEDIUM-3, REVIEW-i36-secagg-2
        MEDIUM-3). A non-signer may be an honest dropout: it only sits out that round's redo."""
        server = self.secure.server
        culprits = server.culprits if server is not None else frozenset()
        silent = server.non_signers if server is not None else frozenset()
        for user, node in expected.items():
            if node in culprits:
                self._excluded[user] = "left out after an aborted attempt: " + (
                    "it returned a share other than the one its owner committed to" if node in server.bad_holders
                    else "its committed shares did not give its committed mask secret")
            elif node in silent:
                self._excluded[user] = ("left out after an aborted attempt: it did not sign the survivor set at "
                                        "the consistency check")

    def _redo_aborted(self, t: int, step: Callable[[], T]) -> T:
        """``step()``, redone while its secure sum aborts, at most ``SECAGG_REDOS`` times."""
        for attempt in range(SECAGG_REDOS + 1):
            try:
                return step()
            except SecAggAbort as e:
                if attempt == SECAGG_REDOS:
                    raise
                log.warning("fedmf round %d: %s; the round was aborted and nothing of it was released; redone with "
                            "fresh noise (%d/%d)", t, e, attempt + 1, SECAGG_REDOS)
        raise AssertionError("unreachable")

    def _values(self, received: RoundReplies) -> dict | None:
        """The clients' reported training loss for the engine's private release (``fedmf.round.client_metrics``),
        only when the plan has one; nothing a client reports is ever published as sent."""
        return received.losses() if self.run.plan.client_metrics is not None else None

    def _round_metrics(self, record: RoundRecord, report: RoundReport, received: RoundReplies) -> MetricRecord:
        """The committed round's metrics: its counts, ε, the released metrics of ``record.metrics``
        (adaptive clipping's ζₜ and noisy fraction, the private client-metric release when planned) and
        (unamplified runs) the worst user's observed ε, which also joins ``record.metrics``. No
        client-reported value is among them as sent."""
        got = len(received.updates) if self.secure is None else record.contributed  # secure: in the sum
        metrics = {"epsilon": record.epsilon, "selected": record.selected, "received": got,
                   "rejected": record.rejected, "dropped": record.dropped, **record.metrics}
        if record.clipped is not None:  # ledger diagnostics only (outside the DP guarantee)
            metrics.update(clipped=record.clipped, zeroed=record.zeroed)
        rho = self.run.plan.rho_after(record.round)  # ρ-zCDP as planned; none for amplified accounting
        if rho is not None:
            metrics["rho"] = rho
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
        return MetricRecord(metrics)

    # ---- Flower's Strategy hooks (abstract in its ABC) -------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Not called by ``start``. The first half of one round for a caller that drives the hooks
        itself (``benchmarks/server.py``): select (who is connected, then the scheduler and the
        ledger) and return the TRAIN messages carrying ``arrays``, which must be the committed
        model. No guard: the caller runs ``run.guard`` first. ``config`` is not used. Refused with
        secure aggregation (its stages run only in ``start``): the updates would reach the server."""
        if self.secure is not None:
            raise ConfigError("configure_train sends plain TRAIN messages: with secure-aggregation use start")
        selection = self.run.select(self._available(grid, self.run.next_round))
        return self._messages(selection, arrays)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Not called by ``start``. The second half of the round ``configure_train`` opened: validate
        the replies, aggregate (clip, sum, noise, step) and commit; return the committed model and
        the round's metrics, the record joining ``history``. The caller releases it
        (``run.released``); no retry."""
        received = self._validate(replies)
        record, report = settle(self.run, received.updates, received.rejected, self._values(received))
        self.history.append(record)
        return ArrayRecord(self.run.model.state_dict()), self._round_metrics(record, report, received)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No messages: federated evaluation would run on training users and is outside the DP
        guarantee (evaluation is server-side, ``evaluate_fn``). Not called by ``start``."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (``configure_evaluate`` sends nothing). Not called by ``start``."""
        return None

    def summary(self) -> None:
        """Log the plan, what is published of the client metrics and the reply bound (three lines); ``start``
        calls it first."""
        plan = self.run.plan
        log.info("fedmf DP-MF strategy: %s mechanism, %d rounds, %s, sampling %s, clip %g, z %.4g, noise std %.4g, "
                 "epsilon %.4g at delta %g", plan.mechanism.kind, plan.rounds, plan.schema.name, plan.sampling,
                 plan.clip_norm, plan.noise_multiplier, plan.noise_std, plan.epsilon(), plan.delta)
        metrics = plan.client_metrics
        if metrics is None:
            log.info("fedmf: client metrics: none published (client-metrics = \"none\")")
        else:
            log.info("fedmf: client metrics: the training loss released privately, clipped to [0, %g], noise std "
                     "%g on the sum, %.3g of the privacy spent", metrics.clip, metrics.noise_std,
                     plan.summary()["privacy_split"]["client-metrics"])
        if self.secure is not None:
            q, params = self.secure.quantization, self.secure.params
            planned = params.for_cohort(max(2, round(plan.expected_users)))
            log.info("fedmf: secure aggregation (SecAgg+): degree %d, threshold %d%s, modulo 2^%d, scale %g; the "
                     "server sees only the sum; quantization inflation %.6g (noise std x it)", planned.degree,
                     planned.threshold, " (derived from each round's cohort; here the planned one)"
                     if params.derived else "", params.bits, params.scale, q.inflation)
            return
        log.info("fedmf: a reply holds the records arrays, config and metrics only, its arrays at most %d bytes "
                 "(the model in float64 as .npy); anything else is rejected",
                 max_update_bytes(self.run.privatizer.layout))

    # ---- start: the round loop ---------------------------------------------------------------
    def _with_retries(self, t: int, step: Callable[[], T], stage: str) -> T:
        """``step()``; when the ledger fails (any ``LedgerError``), retried after 1, 2, 4, … s
        (``fedmf.run.ledger_retry``, with this module's constants). When too few users can join the round
        (``CohortTooSmall``: nothing of it exists yet), tried again every ``cohort_poll_s`` seconds
        for at most the reply timeout, each try with the users connected then; the last refusal ends
        the run (``fedmf.run.cohort``)."""
        retry = ledger_retry((LedgerError,), retries=LEDGER_RETRIES, backoff_s=LEDGER_BACKOFF_S,
                             backoff_max_s=LEDGER_BACKOFF_MAX_S, log=log)
        waited_since = None
        if self.secure is not None and stage == ROUND:
            inner = step
            step = lambda: self._redo_aborted(t, inner)  # noqa: E731
        while True:
            try:
                value = retry(t, step, stage)
                if waited_since is not None:
                    log.info("fedmf round %d: enough users after waiting %.0f s", t, time.time() - waited_since)
                return value
            except CohortTooSmall as e:
                now = time.time()
                if waited_since is None:
                    waited_since = now
                    log.warning("fedmf: waiting for users: %s (trying again every %g s for up to %g s, "
                                "reply-timeout)", e, self.cohort_poll_s, self.config.reply_timeout)
                if now - waited_since + self.cohort_poll_s > self.config.reply_timeout:
                    raise
                time.sleep(self.cohort_poll_s)

    @staticmethod
    def _progress(record: RoundRecord, end: int) -> None:
        extra = "  ".join(f"{k} {v:.4g}" for k, v in record.metrics.items())
        if record.clipped is not None:  # ledger diagnostics only (outside the DP guarantee)
            extra = f"clipped {record.clipped}  zeroed {record.zeroed}  {extra}"
        # rounds are named 0-based, as the ledger stores them; "done/end" counts rounds (ARCHITECTURE.md, Names)
        log.info("fedmf round %d (%d/%d done)  eps %.4g  users %d/%d  rejected %d  dropped %d  %s",
                 record.round, record.round + 1, end, record.epsilon, record.contributed, record.selected,
                 record.rejected, record.dropped, extra)

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
        """Run (or resume) rounds until the plan's horizon, ``num_rounds`` in total, or the guard:
        ``fedmf.run.loop.run_rounds`` with the Flower exchange as its cohort step and the ledger
        retries; each round's model and metrics go into the Result after its commit. The model sent
        is the run's committed one (``initial_arrays``, ``train_config`` and ``evaluate_config`` are
        not used); ``timeout``: for the replies (default: the configuration's reply timeout)."""
        evaluate_fn = evaluate_fn or self.evaluate_fn
        timeout = self.config.reply_timeout if timeout is None else timeout
        end = self.run.plan.rounds if num_rounds is None else min(num_rounds, self.run.plan.rounds)
        self.summary()
        result = Result()
        received: RoundReplies | None = None
        started = time.time()

        def exchange(selection: Selection) -> Contributions:  # the cohort step: Flower I/O
            nonlocal received
            self.run.global_params()  # raises if the state in memory is not the committed one (nothing is sent)
            if self.secure is not None:
                received = RoundReplies(selection.round, self.nonce, {}, self.nodes)  # no update reaches the server
                return self._secure_exchange(grid, selection, timeout), None, None
            messages = self._messages(selection, ArrayRecord(self.run.model.state_dict()))
            received = self._validate(grid.send_and_receive(messages, timeout=timeout), timeout)
            return received.updates, received.rejected, self._values(received)

        def committed(record: RoundRecord, report: RoundReport) -> None:
            nonlocal received
            result.arrays = ArrayRecord(self.run.model.state_dict())
            result.train_metrics_clientapp[record.round + 1] = self._round_metrics(record, report, received)
            received = None

        def evaluate(record: RoundRecord) -> MetricRecord | None:  # server-side, of the committed model
            evaluation = evaluate_fn(record.round + 1, result.arrays)
            if evaluation is not None:
                result.evaluate_metrics_serverapp[record.round + 1] = evaluation
            return evaluation

        if self.run.resumed_from is not None:
            log.info("%s", self.run.resumed_line())
        result.arrays = ArrayRecord(self.run.model.state_dict())  # the committed model (a record recovered on resume)
        def initial() -> dict:  # the initial model's held-out scores (no round committed: fedmf.run.learning_check)
            scores = evaluate_fn(0, ArrayRecord(self.run.model.state_dict()))
            return {} if scores is None else {k: float(v) for k, v in scores.items()}

        why = self.learning.start(self.run.directory, self.run.next_round, None if evaluate_fn is None else initial,
                                  self.run.model.parameters())
        if why is not None:  # a resumed model that is not finite: nothing is sent
            ended = LoopEnd("learning", NotLearning(why))
        else:
            if self.run.next_round < end:  # a restart with no round left (to write the final model) waits for no one
                self._wait_for_users(grid)
            ended = run_rounds(self.run, end, lambda t: self._available(grid, t), exchange, history=self.history,
                               committed=committed, evaluate=None if evaluate_fn is None else evaluate,
                               on_round=lambda record: self._progress(record, end), retry=self._with_retries,
                               stop=lambda record: self.learning.observe(record.round, record.metrics,
                                                                         self.run.model.parameters()))
        if ended.stop is not None:
            self.stopped = str(ended.stop) if ended.reason == "guard" else ended.stopped
            log.info("fedmf: stopping: %s", ended.stop)
        else:
            self.stopped = ended.reason
        # a password in the URL is never logged; the audit command is the auditor's (fedmf.audit.auditor)
        log.info("fedmf: %d rounds committed in %.1fs (%s); ledger %s; audit with: %s", self.run.next_round,
                 time.time() - started, self.stopped or "done", public_url(self.run.ledger_url),
                 audit_command(self.run.ledger_url, self.run.run_id))
        head_round, head = self.run.head
        log.info("fedmf: ledger head %d:%s (record it outside the ledger; check it later with fedmf audit --verify "
                 "--head %d:%s)", head_round, head, head_round, head)
        return result
