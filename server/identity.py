"""Which user is behind which Flower node: proven, not declared.

The ledger identifies users, not Flower node ids (a user who reconnects under a new node id is
the same user). The server sends every live node it has not identified a QUERY with a fresh
challenge; the ClientApp answers with its user id and, in a deployment, an Ed25519 signature of
(run, round, its node id, the challenge, the user id) made with the user's private key
(``fedmf.enrollment``). How a claim is checked depends on the :class:`IdentityPolicy`:

* ``enrolled`` (a deployment; the default): the signature must verify under the key enrolled for
  that user in the operator's enrollment file, re-read when it changes;
* ``in-process`` (Flower's simulation engine, ``server.local_grid``): the ClientApp runs inside the
  server's federation and its partition id is trusted;
* ``declared-insecure`` (explicit, logged as insecure): the declared user id is trusted.

In every mode only users of the task's population are accepted. A node that does not answer in
``identity-timeout`` seconds, or answers with anything but a valid proof, is logged once and asked
again after a backoff b (30 s, doubling up to 16 min): at the first multiple of b, on a clock common
to all nodes (time since the directory started), that is at least b after the failure. So failing nodes are
asked together: a node at backoff b is asked only at multiples of b, and at most one exchange that
waits for a timeout starts in each 30 s step (once one has timed out, the nodes due, a node seen for
the first time included, wait for the next step). However
many nodes fail, the rounds pay at most one identity timeout per 30 s; when they have all reached the
16 min backoff, one per 16 min. A node that disconnects keeps its backoff and its "logged" mark
until it has been gone for 16 min, and one away at its retry time is treated as having failed it, so
a node that keeps reconnecting costs no more than one that stays. A user proven on two live
nodes is selected on the most recently proven one only (one log line naming the pseudonymous user
and the nodes).

A node that does not answer a TRAIN message within the reply timeout (``missed``) is treated as one
that failed an identity exchange — no longer identified, asked again after the same backoff — and
its backoff keeps doubling across new proofs until it answers a TRAIN message (``answered``): a node
that proves but never trains costs one reply timeout per backoff, not one per round. This changes
only who is reachable (what the scheduler is given as available), never how it samples. Not for
in-process nodes (Flower's simulation engine), so that a simulation stays the in-process loop's.
Enrolled keys are validated once, when the enrollment is loaded (``fedmf.enrollment.EnrolledKey``):
checking a proof costs one Ed25519 signature verification.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedmf.enrollment import EnrollmentFile, check_user_id, new_challenge, verify_proof
from fedmf.errors import ConfigError, FedmfError

from .config import ServerConfig

__all__ = ["NodeDirectory", "IdentityPolicy", "identity_policy", "IDENTITY_RECORD", "BACKOFF_S", "BACKOFF_MAX_S"]

IDENTITY_RECORD = "identity"
#: a node that failed an identity exchange is asked again after BACKOFF_S, doubling up to BACKOFF_MAX_S
BACKOFF_S, BACKOFF_MAX_S = 30.0, 960.0
#: at most this many disconnected nodes keep their backoff (the oldest are forgotten first)
MAX_GONE_REMEMBERED = 100_000
log = logging.getLogger("fedmf.server")


@dataclass(frozen=True)
class IdentityPolicy:
    """How claims are checked: ``mode`` (module docstring), the enrollment (``enrolled`` only) and the
    task's population (None: any user id)."""

    mode: str
    enrollment: EnrollmentFile | None = None
    population: frozenset[str] | None = None


def _in_process(grid: Grid) -> bool:
    from flwr.superlink.grid import InMemoryGrid  # the grid of Flower's simulation engine (flwr run, sim)

    from .local_grid import LocalGrid

    return isinstance(grid, (InMemoryGrid, LocalGrid))


def identity_policy(grid: Grid, config: ServerConfig, population: Iterable[object] | None) -> IdentityPolicy:
    """The policy for this grid and configuration (a one-line ``ConfigError`` before round 1 for a
    deployment with neither an enrollment file nor the explicit insecure mode)."""
    users = None if population is None else frozenset(str(u) for u in population)
    if _in_process(grid):
        return IdentityPolicy("in-process", population=users)
    if config.identity == "declared-insecure":
        log.warning("fedmf: INSECURE: identity = declared-insecure: the user-id each SuperNode declares is trusted "
                    "without proof; any node can claim any user")
        return IdentityPolicy("declared-insecure", population=users)
    if not config.user_enrollment:
        raise ConfigError("a deployment needs user-enrollment (an enrollment file made with `fedmf user enroll`), "
                          "or identity = 'declared-insecure' for an insecure trial")
    enrollment = EnrollmentFile(config.user_enrollment)
    log.info("fedmf: identity: users prove keys enrolled in %s (%d users)", config.user_enrollment,
             len(enrollment.enrollment.users))
    return IdentityPolicy("enrolled", enrollment=enrollment, population=users)


def _random_label() -> Callable[[str], str]:
    key = os.urandom(32)
    return lambda user: hmac.new(key, user.encode("utf-8"), hashlib.sha256).hexdigest()[:12]


class NodeDirectory:
    """node id → proven user id, kept while the node is live."""

    def __init__(self, policy: IdentityPolicy, *, run: str, timeout: float = 10.0,
                 label: Callable[[str], str] | None = None, clock: Callable[[], float] = time.monotonic,
                 backoff_s: float = BACKOFF_S, backoff_max_s: float = BACKOFF_MAX_S) -> None:
        self.policy, self.run, self.timeout = policy, run, timeout
        self.label = label or _random_label()  # pseudonymous user labels for log lines (never the raw id)
        self.clock, self.backoff_s, self.backoff_max_s = clock, backoff_s, backoff_max_s
        self._epoch = clock()
        self._user_of: dict[int, str] = {}
        self._proven_at: dict[int, int] = {}  # node → sequence number of its proof (higher: more recent)
        self._proven_key: dict[int, bytes | None] = {}  # node → the enrolled key it proved (None: not enrolled mode)
        self._sequence = 0
        self._retry: dict[int, tuple[float, float]] = {}  # node → (ask again at, current backoff)
        self._train_backoff: dict[int, float] = {}  # node → its backoff after its last missed TRAIN reply
        self._reported: set[int] = set()  # nodes whose failure was logged
        self._gone_since: dict[int, float] = {}  # backed-off node → when it was first seen disconnected
        self._timeout_step: int | None = None  # the backoff_s step in which an exchange last timed out
        self._duplicates_logged: set[tuple[str, tuple[int, ...]]] = set()
        self.queries = 0  # identity messages sent (tests, metrics)

    def user_of(self, node_id: int) -> str | None:
        return self._user_of.get(node_id)

    def refresh(self, grid: Grid, round_: int = 0) -> dict[str, int]:
        """The users reachable now: user id → its node (the most recently proven one when a user is
        proven on several live nodes). Asks the live nodes that are unidentified and due."""
        live = {int(n) for n in grid.get_node_ids()}
        now = self.clock()
        for gone in [n for n in self._user_of if n not in live]:
            self._forget(gone)
        self._forget_gone(live, now)
        self._reload_enrollment()
        due = sorted(n for n in live if n not in self._user_of and self._retry.get(n, (now, 0.0))[0] <= now)
        if due and self._timeout_step != self._step(now):  # else this step already paid a timeout: wait
            self._identify(grid, due, round_)
        return self._reachable(live)

    def _forget_gone(self, live: set[int], now: float) -> None:
        """A node that disconnects keeps its backoff and "logged" mark until it has been gone for
        backoff_max_s (MAX_GONE_REMEMBERED gone nodes at most, the longest gone forgotten first); one
        gone at its retry time is treated as having failed it (its backoff doubles; no log line)."""
        for node in [n for n in self._gone_since if n in live]:
            del self._gone_since[node]
        for node, (at, backoff) in self._retry.items():
            if node not in live:
                self._gone_since.setdefault(node, now)
                if at <= now:  # a missed retry counts as a failed one
                    backoff = min(self.backoff_max_s, backoff * 2)
                    self._retry[node] = (self._epoch + (math.floor((now - self._epoch) / backoff) + 1) * backoff,
                                         backoff)
        by_age = sorted(self._gone_since, key=self._gone_since.__getitem__)
        expired = [n for n in by_age if self._gone_since[n] + self.backoff_max_s <= now]
        expired += by_age[len(expired):max(len(expired), len(by_age) - MAX_GONE_REMEMBERED)]
        for node in expired:
            self._retry.pop(node, None)
            self._gone_since.pop(node, None)
        self._reported &= live | set(self._retry)
        for node in [n for n in self._train_backoff if n not in live and n not in self._retry]:
            del self._train_backoff[node]

    def _step(self, now: float) -> int:
        return math.floor((now - self._epoch) / self.backoff_s)

    def _multiple_from(self, time_s: float, period: float) -> float:
        """The first multiple of ``period`` at or after ``time_s`` on the directory's clock."""
        return self._epoch + math.ceil((time_s - self._epoch) / period) * period

    # ---- the exchange --------------------------------------------------------------------
    def _identify(self, grid: Grid, nodes: list[int], round_: int) -> None:
        challenges = {node: new_challenge() for node in nodes}
        messages = [Message(RecordDict({"config": ConfigRecord({"request": "identity", "run": self.run,
                                                                "round": round_, "challenge": challenges[node]})}),
                            dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
        self.queries += len(messages)
        answered: set[int] = set()
        unanswered = f"no identity reply within {self.timeout:g} s"
        step = self._step(self.clock())
        try:
            replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        except Exception as e:  # the SuperLink failed: every asked node is retried later
            unanswered = f"the identity exchange with the SuperLink failed ({type(e).__name__})"
            log.warning("fedmf: %s; the %d nodes asked are asked again after their backoff", unanswered, len(nodes))
            replies = []
        # Flower's grids (and LocalGrid) give each sent message its id, and a reply must name its query's
        # id; a test grid that pushes nothing assigns none, and there the source node alone decides
        sent = {int(m.metadata.dst_node_id): m.metadata.message_id for m in messages}
        for reply in replies:
            try:  # nothing a node sends may stop the server
                node = int(reply.metadata.src_node_id)
                answers = reply.metadata.reply_to_message_id
            except Exception:
                continue
            if node not in challenges or node in answered or (sent[node] and answers != sent[node]):
                continue  # not a reply to this exchange's query to that node
            answered.add(node)
            try:
                user, reason = self._check(reply, node, round_, challenges[node])
            except Exception as e:
                user, reason = None, f"malformed identity reply ({type(e).__name__})"
            if user is None:
                self._failed(node, reason)
            else:
                self._sequence += 1
                self._user_of[node], self._proven_at[node] = user, self._sequence
                self._proven_key[node] = self._enrolled_key(user)
                self._retry.pop(node, None)
                self._reported.discard(node)
        for node in nodes:
            if node not in answered:
                self._timeout_step = step
                self._failed(node, unanswered)

    def _check(self, reply: Message, node: int, round_: int, challenge: bytes) -> tuple[str | None, str]:
        """(the proven user, "") or (None, why not)."""
        if reply.has_error() or not reply.has_content():
            return None, "the ClientApp answered with an error"
        record = reply.content.config_records.get(IDENTITY_RECORD)
        if record is None:
            return None, "no identity record"
        try:
            user = check_user_id(record.get("user-id"))
        except FedmfError:
            return None, "an invalid user id"
        population = self.policy.population
        if population is not None and user not in population:
            return None, "a user id outside the task's population"
        if self.policy.mode != "enrolled":
            return user, ""
        source = self.policy.enrollment
        key = None if source is None else source.enrollment.verifier(user)  # validated once, at load
        if key is None:
            return None, "a user id that is not enrolled"
        if not verify_proof(key, record.get("signature"), self.run, round_, node, challenge, user):
            return None, "no valid proof of the enrolled user's key"
        return user, ""

    def _enrolled_key(self, user: str) -> bytes | None:
        source = self.policy.enrollment
        return None if source is None else source.enrollment.key(user)

    def _forget(self, node: int) -> None:
        del self._user_of[node], self._proven_at[node], self._proven_key[node]

    def _failed(self, node: int, reason: str) -> float:
        """Put ``node`` on the retry schedule with its next backoff (returned), logged once."""
        previous = max(self._retry.get(node, (0.0, 0.0))[1], self._train_backoff.get(node, 0.0))
        backoff = min(self.backoff_max_s, previous * 2) if previous else self.backoff_s
        # on a multiple of its own backoff, so that failing nodes are asked again together (module docstring)
        self._retry[node] = (self._multiple_from(self.clock() + backoff, backoff), backoff)
        if node not in self._reported:  # once per node, not per round
            self._reported.add(node)
            log.warning("fedmf: node %d not identified (%s); not selectable, asked again after a backoff", node,
                        reason)
        return backoff

    # ---- TRAIN replies -------------------------------------------------------------------
    def missed(self, nodes: Iterable[int], timeout_s: float) -> None:
        """``nodes`` did not answer a TRAIN message within ``timeout_s`` (the reply timeout): each one
        is treated as a node that failed an identity exchange — no longer identified, so its user is
        not reachable, and asked to prove its identity again after the same backoff (30 s, doubling
        up to 16 min, on the common clock). Its backoff keeps growing across new proofs until it
        answers a TRAIN message (``answered``), so a node that proves but never trains costs one
        reply timeout per backoff, not one per round. Not in-process (Flower's simulation engine):
        its nodes are local, and a simulation stays bit-identical to the in-process loop."""
        if self.policy.mode == "in-process":
            return
        for node in nodes:
            if node in self._user_of:
                self._forget(node)
            self._reported.add(node)  # logged here, not again as "not identified"
            backoff = self._failed(node, "")
            self._train_backoff[node] = backoff
            log.warning("fedmf: node %d did not answer its TRAIN message within %g s; not selectable, asked to "
                        "prove its identity again after a backoff of %g s", node, timeout_s, backoff)

    def answered(self, nodes: Iterable[int]) -> None:
        """``nodes`` answered their TRAIN message (accepted or not): their TRAIN backoff ends."""
        for node in nodes:
            self._train_backoff.pop(node, None)

    def _reload_enrollment(self) -> None:
        source = self.policy.enrollment
        if source is None:
            return
        try:
            changed = source.reload()
        except FedmfError as e:
            log.error("fedmf: the changed enrollment file does not load, so the previous enrollment stays in force "
                      "(keys revoked or rotated since still verify; repeated each round until the file loads): %s", e)
            return
        if changed:  # a revoked or rotated key's proofs end now; newly enrolled users are asked again now
            for node in [n for n, u in self._user_of.items() if self._enrolled_key(u) != self._proven_key[n]]:
                self._forget(node)
            self._retry.clear()
            self._gone_since.clear()
            log.info("fedmf: enrollment reloaded (%d users)", len(source.enrollment.users))

    # ---- who is reachable ----------------------------------------------------------------
    def _reachable(self, live: set[int]) -> dict[str, int]:
        nodes_of: dict[str, list[int]] = {}
        for node in sorted(live):
            user = self._user_of.get(node)
            if user is not None:
                nodes_of.setdefault(user, []).append(node)
        reachable = {}
        for user, nodes in nodes_of.items():
            chosen = max(nodes, key=lambda n: self._proven_at[n])
            reachable[user] = chosen
            if len(nodes) > 1 and (user, tuple(nodes)) not in self._duplicates_logged:
                self._duplicates_logged.add((user, tuple(nodes)))
                log.warning("fedmf: user %s is proven on live nodes %s; only node %d (the most recent proof) is "
                            "selectable", self.label(user), ", ".join(str(n) for n in nodes), chosen)
        return reachable
