"""The repository API the server calls.

    ledger = Ledger.open("ledger.db", secret=server_secret)          # or postgresql://…
    run = ledger.create_run("so.mech.json", noise_multiplier=z, clip_norm=1.0, delta=1e-6)
    run.open_round(t)
    chosen = run.record_selection(t, candidates)     # refuses clients that would break MinSep(b, k)
    run.record_contribution(t, client, update_norm=…)  # the norm is kept only with diagnostics=True
    run.record_rejection(t, client, "non-finite update")
    run.commit_round(t, noise_std=σ, checkpoint_sha256=h)  # all of round t's rows, or (abort_round) none
    run.eligible(clients, t) -> [bool, …]            # one indexed query
    ledger.observed_pattern(run.id) -> Observed      # what really happened, for post-hoc accounting
    ledger.find_runs(plan.fingerprint)               # a restarted server finds the run to resume

A round's selections and contributions are held in memory until ``commit_round`` inserts
them, with the round's record (counts, noise, the accountant's ε, its chain hash), in one
transaction; ``abort_round`` discards them and marks the round aborted in ``round_state``
(it may be re-opened). History (``runs``, ``rounds``, ``participations``, ``update_norms``)
is only ever inserted, and exists only for committed rounds; what changes during a round
lives in ``round_state`` and ``client_state``. A round left open by a server that stopped is
taken over by the next ``open_round``.

Update norms and whether a contribution was clipped are data-dependent and outside the DP
guarantee: they are stored (in ``update_norms``) only for a run created with
``diagnostics=True``.

Every writing transaction takes the write lock when it begins (SQLite: BEGIN IMMEDIATE,
waiting up to the busy timeout), so servers writing different runs of one SQLite ledger
wait for each other instead of failing; reads never take it.

Only contributions count as participations (a dropped or rejected update was never
summed, so it spends no privacy); eligibility and the observed pattern use them alone.
What a run and a round look like to readers, and the reads shared with the audit, are in
``queries``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import Session

from .. import checks
from ..errors import ConfigError
from ..participation import FixedEpoch, MinSep, Observed
from .chain import genesis_sha256, round_sha256
from .db import (
    WRITE,
    LedgerError,
    database_errors,
    display_url,
    private_sqlite_file,
    resolve_url,
    upgrade,
    writer_engine,
)
from .keys import ServerSecret
from .models import ClientState, Participation, Round, RoundState, Run, UpdateNorm
from .queries import RoundSummary, RunInfo, get_run, round_summary
from .queries import observed_pattern as _observed_pattern

__all__ = ["Ledger", "RunLedger"]

_IN_CHUNK = 5000  # keys per IN (...) list
_HISTORY_SQL = "SELECT client_key, contributions, last_round FROM client_state WHERE run_id = %s AND client_key {}"


def _upsert_client_state(dialect: str):
    """INSERT … ON CONFLICT (run_id, client_key) DO UPDATE: one more contribution, in round t."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    stmt = dialect_insert(ClientState)
    return stmt.on_conflict_do_update(
        index_elements=[ClientState.run_id, ClientState.client_key],
        set_={"contributions": ClientState.contributions + 1, "last_round": stmt.excluded.last_round},
    )
_REASON_MAX = 200
_FINGERPRINT_MAX = 80
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SECRET_WORDS = ("secret", "seed")  # a plan's keys that would put a secret into the ledger


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_label(key: bytes) -> str:
    """How a client appears in messages and audits: a prefix of its pseudonymous key."""
    return key.hex()[:16]


class _Pending:
    """The open round's rows, in memory until commit."""

    def __init__(self, t: int, attempt: int) -> None:
        self.t = t
        self.attempt = attempt  # the round row's attempts when this handle opened it
        self.selected: dict[bytes, None] = {}
        self.contributed: dict[bytes, tuple[float | None, bool]] = {}
        self.rejected: dict[bytes, str] = {}
        self.n_selected = 0  # accepted by record_selection (some may be rejected later)


def _optional(name: str, value: object) -> float | None:
    """An optional diagnostic (a norm, a std, an ε): None or a finite float >= 0."""
    return None if value is None else checks.non_negative(name, value)


def _plan_json(plan: object) -> dict[str, Any] | None:
    """``plan`` checked to be a JSON object without secrets (it is stored verbatim)."""
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise ConfigError(f"plan must be a dict (RunPlan.to_dict()), not {type(plan).__name__}")
    try:
        data = json.loads(json.dumps(plan, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(f"plan must be JSON (finite numbers, string keys): {e}") from None
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if any(word in key.lower() for word in _SECRET_WORDS):
                    raise ConfigError(f"plan must not carry secrets: remove its key {key!r}")
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
    return data


def _fingerprint(value: object, *, allow_none: bool) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _FINGERPRINT_MAX:
        raise ConfigError(f"plan_fingerprint must be a non-empty string of at most {_FINGERPRINT_MAX} "
                          f"characters, got {value!r}")
    return value


class Ledger:
    """A connection to one ledger database (SQLite file or PostgreSQL), migrated to the head
    schema on open. ``secret`` (bytes, >= 16) is needed to write rounds or ask eligibility."""

    def __init__(self, engine: Engine, url: URL, secret: ServerSecret | None) -> None:
        self.engine = engine
        self.url = url
        self._secret = secret
        self.write_engine = engine.execution_options(**WRITE)  # its transactions take the write lock first

    def __repr__(self) -> str:
        return f"Ledger({display_url(self.url)!r})"

    @classmethod
    def open(cls, url: str | os.PathLike, secret: bytes | str | ServerSecret | None = None) -> Ledger:
        """Open (creating or migrating) the ledger at ``url``; refuses one from a newer fedmf."""
        resolved = resolve_url(url)
        if secret is not None and not isinstance(secret, ServerSecret):
            secret = ServerSecret(secret)
        private_sqlite_file(resolved)
        with database_errors(resolved, "cannot open ledger"):
            engine = writer_engine(resolved)
        try:
            upgrade(engine, resolved)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, resolved, secret)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _errors(self, doing: str = "ledger error on"):
        return database_errors(self.url, doing)

    # ---- runs ----------------------------------------------------------------------------------
    def create_run(
        self,
        mechanism: str | os.PathLike | Any,
        *,
        noise_multiplier: float,
        clip_norm: float,
        delta: float,
        target_epsilon: float | None = None,
        schema: MinSep | FixedEpoch | None = None,
        sampling: str = "fixed-order",
        name: str | None = None,
        config: dict[str, Any] | None = None,
        plan: dict[str, Any] | None = None,
        plan_fingerprint: str | None = None,
        diagnostics: bool = False,
    ) -> RunLedger:
        """Record a new run and its plan; returns it ready for round 0.

        ``mechanism`` is a mechanism file (its text and checksum are stored, so the ledger
        alone suffices for an audit) or a Mechanism (stored as ``fedmf.mechanisms.io.dumps``
        writes it). ``schema`` defaults to the schema the file was planned for. ``plan`` (a
        ``RunPlan.to_dict()``, JSON without secrets) and ``plan_fingerprint`` are stored on the
        run row; ``find_runs(plan_fingerprint)`` finds the run again. ``diagnostics``: also
        record each contribution's update norm and whether it was clipped (data-dependent,
        outside the DP guarantee; off by default).
        """
        from .. import __version__
        from ..mechanisms.io import loads

        secret = self._need_secret()
        z = checks.positive("noise_multiplier", noise_multiplier)
        zeta = checks.positive("clip_norm", clip_norm)
        d = checks.open_unit("delta", delta)
        eps = None if target_epsilon is None else checks.positive("target_epsilon", target_epsilon)
        plan_data = _plan_json(plan)
        fingerprint = _fingerprint(plan_fingerprint, allow_none=True)
        document, source = _mechanism_document(mechanism, schema)
        mech, planned, checksum = loads(document, source=source)  # the one validating reader
        if schema is None:
            schema = planned
        if schema is None:
            raise ConfigError(f"{source!r} records no participation schema: pass schema=MinSep(b, k)")
        if not isinstance(schema, (MinSep, FixedEpoch)):
            raise ConfigError(f"a run is planned for MinSep or FixedEpoch, not {type(schema).__name__}")
        schema.validate(mech.rounds)
        if not isinstance(diagnostics, bool):
            raise ConfigError(f"diagnostics must be True or False, got {diagnostics!r}")
        values = dict(
            uid=secrets.token_hex(16), name=name, code_version=f"fedmf {__version__}",
            config=json.loads(json.dumps(dict(config or {}))), mechanism_kind=mech.kind,
            mechanism_checksum=checksum, mechanism_document=document, rounds=mech.rounds, noise_multiplier=z,
            clip_norm=zeta, delta=d, target_epsilon=eps, participation_schema=schema.to_dict(mech.rounds),
            sampling=str(sampling)[:200], key_check=secret.key_check(), plan=plan_data, plan_fingerprint=fingerprint,
            diagnostics=diagnostics,
        )
        row = Run(**values, created_at=_now(), genesis_sha256=genesis_sha256(values))
        with self._errors("cannot write to ledger"), Session(self.write_engine) as session, session.begin():
            session.add(row)
            session.flush()
            run_id = row.id
        return self.run(run_id)

    def runs(self) -> list[RunInfo]:
        """Every run, oldest first."""
        with self._errors(), Session(self.engine) as session:
            return [RunInfo.from_row(r) for r in session.scalars(select(Run).order_by(Run.id))]

    def find_runs(self, plan_fingerprint: str) -> list[RunInfo]:
        """The runs recorded for the plan with this fingerprint, oldest first (an indexed query)."""
        fingerprint = _fingerprint(plan_fingerprint, allow_none=False)
        with self._errors(), Session(self.engine) as session:
            rows = session.scalars(select(Run).where(Run.plan_fingerprint == fingerprint).order_by(Run.id))
            return [RunInfo.from_row(r) for r in rows]

    def run(self, run_id: int) -> RunLedger:
        """Resume a run (needs the secret it was created with). A round that a stopped server
        left open stays open until ``open_round`` takes it over (as a new attempt)."""
        secret = self._need_secret()
        with self._errors(), Session(self.engine) as session, session.begin():
            row = get_run(session, run_id, self.url)
            if row.key_check != secret.key_check():
                raise LedgerError(f"run {run_id}: the server secret is not the one this run was recorded with")
            info = RunInfo.from_row(row)
        return RunLedger(self, info, secret)

    def run_row_intact(self, run_id: int) -> bool:
        """Whether run ``run_id``'s stored genesis hash is the one its row's fields give
        (``fedmf.ledger.chain.genesis_sha256``): an edited row or genesis column does not match."""
        with self._errors(), Session(self.engine) as session:
            row = get_run(session, run_id, self.url)
            return row.genesis_sha256 == genesis_sha256({c.key: getattr(row, c.key) for c in Run.__table__.columns})

    def observed_pattern(self, run_id: int) -> Observed:
        """Every client's contributed rounds (committed rounds only), keyed by key hex."""
        with self._errors(), Session(self.engine) as session:
            return _observed_pattern(session, run_id, self.url)

    def _need_secret(self) -> ServerSecret:
        if self._secret is None:
            raise LedgerError("this operation needs the server secret: Ledger.open(url, secret=...)")
        return self._secret


def _mechanism_document(mechanism: Any, schema: MinSep | FixedEpoch | None) -> tuple[str, str]:
    """(the mechanism file's text, what to call it in messages); a Mechanism object is
    written the way ``io.save`` would write it."""
    from ..mechanisms.base import Mechanism
    from ..mechanisms.io import dumps, read_text

    if isinstance(mechanism, Mechanism):
        return dumps(mechanism, schema), f"mechanism {mechanism.kind}"
    if not isinstance(mechanism, (str, os.PathLike)):
        raise ConfigError(f"mechanism must be a mechanism file path or a Mechanism, not {type(mechanism).__name__}")
    return read_text(mechanism), os.fspath(mechanism)


class RunLedger:
    """One run's rounds: the server's handle (from ``Ledger.create_run`` or ``Ledger.run``)."""

    def __init__(self, ledger: Ledger, info: RunInfo, secret: ServerSecret) -> None:
        self.ledger = ledger
        self.info = info
        self._secret = secret
        self._pending: _Pending | None = None

    def __repr__(self) -> str:
        return f"RunLedger(run={self.info.id}, ledger={display_url(self.ledger.url)!r})"

    @property
    def id(self) -> int:
        return self.info.id

    def key(self, client: object) -> bytes:
        """The client's pseudonymous key in this run (HMAC-SHA256 under the server secret)."""
        return self._secret.client_key(self.info.uid, client)

    def keys(self, clients: Iterable[object]) -> list[bytes]:
        """The pseudonymous keys of many clients (one HMAC each)."""
        return self._secret.client_keys(self.info.uid, list(clients))

    # ---- state ---------------------------------------------------------------------------------
    @property
    def next_round(self) -> int:
        """The round to open next: one past the last committed round."""
        with self.ledger._errors(), self.ledger.engine.connect() as conn:
            last = conn.execute(select(func.max(Round.round_index)).where(Round.run_id == self.id)).scalar()
        return 0 if last is None else int(last) + 1

    def round(self, t: int) -> RoundSummary:
        """Round t: its committed record, else its open or aborted state, else planned."""
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.info.rounds:
            raise LedgerError(f"run {self.id} has no round {t}")
        with self.ledger._errors(), self.ledger.engine.connect() as conn:
            summary = round_summary(conn, self.id, int(t), self.info.diagnostics)
            conn.rollback()
        return summary

    # ---- rounds --------------------------------------------------------------------------------
    def open_round(self, t: int) -> None:
        """Open round t = ``next_round``: a planned round, one aborted before, or one that a
        stopped server left open (taken over as a new attempt; the old handle can no longer
        commit it)."""
        if self._pending is not None:
            raise LedgerError(f"round {self._pending.t} is still open: commit or abort it first")
        self._check_index(t)
        expected = self.next_round
        if t != expected:
            raise LedgerError(f"run {self.id}: the next round to open is {expected}, not {t}")
        where = (RoundState.run_id == self.id, RoundState.round_index == t)
        with self.ledger._errors("cannot write to ledger"), self.ledger.write_engine.begin() as conn:
            if conn.execute(select(Round.round_index).where(Round.run_id == self.id, Round.round_index == t)).first():
                raise LedgerError(f"run {self.id}: round {t} cannot be opened (it is committed)")
            done = conn.execute(
                update(RoundState)
                .where(*where, RoundState.status.in_(("aborted", "open")))
                .values(status="open", attempts=RoundState.attempts + 1, opened_at=_now(), closed_at=None,
                        abort_reason=None)
            ).rowcount
            if done == 0:  # the first attempt (a concurrent first attempt fails on the primary key)
                conn.execute(insert(RoundState).values(run_id=self.id, round_index=t, status="open", attempts=1,
                                                       opened_at=_now()))
            attempt = conn.execute(select(RoundState.attempts).where(*where)).scalar()
        self._pending = _Pending(t, int(attempt))

    def record_selection(self, t: int, clients: Iterable[object], *, enforce: bool = True) -> list[object]:
        """Select ``clients`` for the open round t; returns those accepted.

        With ``enforce`` (the default) a client that would break MinSep(b, k) is not selected
        but recorded as rejected with the reason; ``enforce=False`` records every client
        (a test or a simulation of a server that did not enforce the plan).
        """
        pending = self._open(t)
        clients = list(clients)
        keys = self.keys(clients)
        if len(set(keys)) != len(keys):
            raise LedgerError("a client is listed twice in one selection")
        for key in keys:
            if key in pending.selected or key in pending.rejected:
                raise LedgerError(f"client {_key_label(key)} was already selected or rejected in round {t}")
        reasons = self._ineligibility(keys, t) if enforce else [None] * len(keys)
        accepted = []
        for client, key, reason in zip(clients, keys, reasons):
            if reason is None:
                pending.selected[key] = None
                pending.n_selected += 1
                accepted.append(client)
            else:
                pending.rejected[key] = reason
        return accepted

    def record_contribution(self, t: int, client: object, update_norm: float | None = None,
                            clipped: bool | None = None) -> None:
        """A selected client's update was summed into round t (``update_norm``: before clipping;
        ``clipped`` defaults to update_norm > clip_norm). Both are kept only when the run records
        diagnostics."""
        pending = self._open(t)
        key = self.key(client)
        norm = _optional("update_norm", update_norm)
        if key not in pending.selected:
            raise LedgerError(f"client {_key_label(key)} was not selected in round {t}")
        if key in pending.contributed:
            raise LedgerError(f"client {_key_label(key)} already contributed to round {t}")
        if clipped is None:
            clipped = norm is not None and norm > self.info.clip_norm
        pending.contributed[key] = (norm, bool(clipped))

    def record_contributions(self, t: int, clients: Iterable[object],
                             update_norms: Iterable[float | None] | None = None) -> None:
        clients = list(clients)
        norms = [None] * len(clients) if update_norms is None else list(update_norms)
        if len(norms) != len(clients):
            raise LedgerError("update_norms must have one entry per client")
        for client, norm in zip(clients, norms):
            self.record_contribution(t, client, norm)

    def record_rejection(self, t: int, client: object, reason: str) -> None:
        """The client's update was not summed (invalid, late, not selected …): recorded with
        ``reason`` (which must not name the client)."""
        pending = self._open(t)
        key = self.key(client)
        if key in pending.contributed:
            raise LedgerError(f"client {_key_label(key)} already contributed to round {t}")
        if key in pending.rejected:
            raise LedgerError(f"client {_key_label(key)} was already rejected in round {t}")
        pending.selected.pop(key, None)
        pending.rejected[key] = str(reason)[:_REASON_MAX] or "rejected"

    def commit_round(self, t: int, *, noise_std: float | None = None, epsilon_worst_user: float | None = None,
                     epsilon_planned: float | None = None, checkpoint_sha256: str | None = None,
                     clip_norm: float | None = None, noisy_unclipped: float | None = None) -> RoundSummary:
        """Insert round t's record (counts, noise, ε, chain hash) and participations in one
        transaction (with diagnostics, also the update norms).

        ``noise_std`` is the absolute std σ = z·ζ·sens added to the round's sum;
        ``checkpoint_sha256`` the SHA-256 (64 lowercase hex digits) of the checkpoint written
        for round t, which a resumed server checks before trusting it. With adaptive clipping,
        ``clip_norm`` is ζₜ (the round clipped to it; σ = z·ζₜ·sens) and ``noisy_unclipped`` the
        released noisy count of updates with norm ≤ ζₜ; both None otherwise (and then not hashed)."""
        pending = self._open(t)
        if checkpoint_sha256 is not None and (not isinstance(checkpoint_sha256, str)
                                              or not _SHA256_HEX.fullmatch(checkpoint_sha256)):
            raise ConfigError(f"checkpoint_sha256 must be 64 lowercase hex digits, got {checkpoint_sha256!r}")
        noise = _optional("noise_std", noise_std)
        eps_w = _optional("epsilon_worst_user", epsilon_worst_user)
        eps_p = _optional("epsilon_planned", epsilon_planned)
        zeta = _optional("clip_norm", clip_norm)
        noisy = None if noisy_unclipped is None else checks.number("noisy_unclipped", noisy_unclipped)
        rows: list[dict[str, Any]] = []
        for key in pending.contributed:
            rows.append({"client_key": key, "status": "contributed", "reason": None})
        dropped = [k for k in pending.selected if k not in pending.contributed]
        for key in dropped:
            rows.append({"client_key": key, "status": "dropped", "reason": "no update received"})
        for key, reason in pending.rejected.items():
            rows.append({"client_key": key, "status": "rejected", "reason": reason})
        for row in rows:
            row.update(run_id=self.id, round_index=t)
        record = {
            "run_id": self.id, "round_index": t, "status": "committed", "attempts": pending.attempt,
            "selected": pending.n_selected, "contributed": len(pending.contributed), "dropped": len(dropped),
            "rejected": len(pending.rejected), "noise_std": noise, "checkpoint_sha256": checkpoint_sha256,
            "epsilon_worst_user": eps_w, "epsilon_planned": eps_p, "clip_norm": zeta, "noisy_unclipped": noisy,
        }
        norms = None
        if self.info.diagnostics:
            norms = [{"run_id": self.id, "round_index": t, "client_key": key, "update_norm": norm, "clipped": clipped}
                     for key, (norm, clipped) in pending.contributed.items()]
        with self.ledger._errors("cannot write to ledger"), self.ledger.write_engine.begin() as conn:
            status, attempts, opened = conn.execute(
                select(RoundState.status, RoundState.attempts, RoundState.opened_at)
                .where(RoundState.run_id == self.id, RoundState.round_index == t)
                .with_for_update()
            ).one_or_none() or ("planned", 0, None)
            self._check_still_ours(t, status, attempts, "committed")
            if t == 0:
                previous = conn.execute(select(Run.genesis_sha256).where(Run.id == self.id)).scalar_one()
            else:
                previous = conn.execute(select(Round.chain_sha256).where(
                    Round.run_id == self.id, Round.round_index == t - 1)).scalar_one()
            record["chain_sha256"] = round_sha256(
                previous, record, [(r["client_key"], r["status"], r["reason"]) for r in rows])
            now = _now()
            conn.execute(insert(Round).values(**record, opened_at=opened, closed_at=now))
            if rows:
                conn.execute(insert(Participation), rows)
            if norms:
                conn.execute(insert(UpdateNorm), norms)
            if pending.contributed:
                conn.execute(_upsert_client_state(conn.dialect.name),
                             [{"run_id": self.id, "client_key": key, "contributions": 1, "last_round": t}
                              for key in pending.contributed])
            conn.execute(update(RoundState).where(RoundState.run_id == self.id, RoundState.round_index == t)
                         .values(status="committed", closed_at=now))
            # read back inside the transaction: once COMMIT returns there is nothing left that can fail
            summary = round_summary(conn, self.id, t, self.info.diagnostics)
        self._pending = None
        return summary

    def confirm_commit(self, t: int, checkpoint_sha256: str) -> RoundSummary | None:
        """After a commit that failed with an unknown outcome (the connection lost during COMMIT):
        round t's summary if the ledger holds it committed naming ``checkpoint_sha256`` — the
        commit did happen, and the open round is closed here — else None."""
        if self._pending is not None and self._pending.t != t:
            return None
        summary = self.round(t)
        if summary.status != "committed" or summary.checkpoint_sha256 != checkpoint_sha256:
            return None
        self._pending = None
        return summary

    def abort_round(self, t: int, reason: str = "aborted") -> None:
        """Discard round t's rows (none was written) and mark it aborted; it may be re-opened."""
        pending = self._open(t)
        self._pending = None  # forgotten even if the database is down: the round stays open, taken over later
        with self.ledger._errors("cannot write to ledger"), self.ledger.write_engine.begin() as conn:
            done = conn.execute(
                update(RoundState)
                .where(RoundState.run_id == self.id, RoundState.round_index == t, RoundState.status == "open",
                       RoundState.attempts == pending.attempt)
                .values(status="aborted", closed_at=_now(), abort_reason=str(reason)[:_REASON_MAX])
            ).rowcount
        if done != 1:
            raise LedgerError(f"run {self.id}: round {t} was taken over by another handle; nothing to abort")

    # ---- queries -------------------------------------------------------------------------------
    def history(self, keys: Sequence[bytes]) -> dict[bytes, tuple[int, int]]:
        """(contributions, last contributed round) of each key that has any: primary-key
        lookups in ``client_state``, one query per 5000 keys. The SQL is fixed text run on the
        driver (PostgreSQL: ``= ANY(array)``, so psycopg prepares it once)."""
        out: dict[bytes, tuple[int, int]] = {}
        with self.ledger._errors(), self.ledger.engine.connect() as conn:
            postgres = conn.dialect.name == "postgresql"
            cursor = conn.connection.dbapi_connection.cursor()
            try:
                for i in range(0, len(keys), _IN_CHUNK):
                    chunk = list(keys[i : i + _IN_CHUNK])
                    if postgres:  # binary parameters: the keys travel as bytes, not as hex text
                        cursor.execute(_HISTORY_SQL.format("= ANY(%s)"), (self.id, chunk), binary=True)
                    else:
                        cursor.execute(_HISTORY_SQL.format("IN (" + ",".join("?" * len(chunk)) + ")").replace("%s", "?"),
                                       (self.id, *chunk))
                    for key, count, last in cursor.fetchall():
                        out[bytes(key)] = (int(count), int(last))
            finally:
                cursor.close()
            conn.rollback()
        return out

    def _ineligibility(self, keys: Sequence[bytes], t: int) -> list[str | None]:
        self._check_index(t)
        b, k = self.info.min_sep, self.info.max_participations
        hist = self.history(list(dict.fromkeys(keys)))
        out: list[str | None] = []
        for key in keys:
            count, last = hist.get(key, (0, None))
            if count == 0:
                out.append(None)
            elif count >= k:
                out.append(f"ineligible: already took part in {count} rounds (max_participations={k})")
            elif t - last < b:
                out.append(f"ineligible: took part in round {last}, less than min_sep={b} rounds before {t}")
            else:
                out.append(None)
        return out

    def eligible(self, clients: Iterable[object], t: int) -> list[bool]:
        """Whether each client may take part in round t under MinSep(b, k): fewer than k
        contributions so far and the last one at least b rounds before t."""
        return [r is None for r in self._ineligibility(self.keys(list(clients)), t)]

    def observed_pattern(self) -> Observed:
        return self.ledger.observed_pattern(self.id)

    # ---- helpers -------------------------------------------------------------------------------
    def _check_index(self, t: int) -> None:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.info.rounds:
            raise LedgerError(f"round index must be an integer in [0, {self.info.rounds}), got {t!r}")

    def _check_still_ours(self, t: int, status: str, attempts: int, doing: str) -> None:
        if status != "open":
            raise LedgerError(f"run {self.id}: round {t} is {status}, not open; it cannot be {doing}")
        if attempts != self._pending.attempt:
            raise LedgerError(f"run {self.id}: round {t} was re-opened by another handle (attempt {attempts}); "
                              f"it cannot be {doing} here")

    def _open(self, t: int) -> _Pending:
        if self._pending is None or self._pending.t != t:
            raise LedgerError(f"run {self.id}: round {t} is not open")
        return self._pending
