"""The ledger's reads: a run's row, its rounds, its contributions, and the snapshot the audit
reads — shared by the server's handle (``repository``) and the audit (``audit``).

Nothing here writes. ``RunInfo`` and ``RoundSummary`` are how a run and a round look to
their readers; ``fetch_contributions`` is every contributed (client, round) of a run in one
indexed scan (the observed pattern for post-hoc accounting, and the audit's); ``read_run`` and
``participation_rows`` are what ``fedmf audit`` reads inside one read-only snapshot.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Text, cast, func, select
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.engine import URL, Connection
from sqlalchemy.orm import Session

from .. import checks
from ..participation import FixedEpoch, MinSep, Observed, schema_from_dict
from .db import LedgerError, display_url
from .models import ClientState, Participation, Round, RoundState, Run, UpdateNorm

__all__ = ["RunInfo", "RoundSummary", "RunRows", "norm_summary", "get_run", "round_summary", "fetch_contributions",
           "observed_from_arrays", "observed_pattern", "read_run", "participation_rows"]


# ---- views ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunInfo:
    """A run as the ledger holds it: its row, with the participation schema parsed."""

    id: int
    uid: str
    name: str | None
    created_at: dt.datetime
    code_version: str
    rounds: int
    noise_multiplier: float
    clip_norm: float
    delta: float
    target_epsilon: float | None
    schema: MinSep | FixedEpoch
    sampling: str
    mechanism_kind: str
    mechanism_checksum: str
    config: dict[str, Any]
    plan: dict[str, Any] | None = None
    plan_fingerprint: str | None = None
    diagnostics: bool = False
    genesis_sha256: str | None = None

    @property
    def min_sep(self) -> int:
        return self.schema.min_sep

    @property
    def max_participations(self) -> int:
        return self.schema.participations(self.rounds)

    @classmethod
    def from_row(cls, row: Run) -> RunInfo:
        return cls(
            id=row.id, uid=row.uid, name=row.name, created_at=row.created_at, code_version=row.code_version,
            rounds=row.rounds, noise_multiplier=row.noise_multiplier, clip_norm=row.clip_norm, delta=row.delta,
            target_epsilon=row.target_epsilon, schema=schema_from_dict(row.participation_schema),
            sampling=row.sampling, mechanism_kind=row.mechanism_kind, mechanism_checksum=row.mechanism_checksum,
            config=dict(row.config or {}), plan=row.plan, plan_fingerprint=row.plan_fingerprint,
            diagnostics=bool(row.diagnostics), genesis_sha256=row.genesis_sha256,
        )

    def to_dict(self) -> dict[str, Any]:
        created = self.created_at
        if created.tzinfo is None:  # SQLite keeps no time zone; the ledger writes UTC
            created = created.replace(tzinfo=dt.UTC)
        return {
            "id": self.id, "name": self.name, "created_at": created.isoformat(),
            "code_version": self.code_version, "rounds": self.rounds,
            "noise_multiplier": self.noise_multiplier, "clip_norm": self.clip_norm, "delta": self.delta,
            "target_epsilon": self.target_epsilon, "schema": self.schema.to_dict(self.rounds),
            "sampling": self.sampling, "mechanism_kind": self.mechanism_kind,
            "mechanism_checksum": self.mechanism_checksum, "config": self.config,
            "plan": self.plan, "plan_fingerprint": self.plan_fingerprint, "diagnostics": self.diagnostics,
            "genesis_sha256": self.genesis_sha256,
        }


@dataclass(frozen=True)
class RoundSummary:
    """A round as the ledger holds it: its committed record, else its ``round_state``
    (open or aborted), else planned. The norm fields and ``clipped`` are diagnostics: None
    unless the run records them."""

    round_index: int
    status: str
    attempts: int
    selected: int
    contributed: int
    dropped: int
    rejected: int
    noise_std: float | None  # absolute: z · clip_norm · sensitivity
    checkpoint_sha256: str | None
    epsilon_worst_user: float | None = None
    epsilon_planned: float | None = None
    chain_sha256: str | None = None
    clipped: int | None = None
    norm_min: float | None = None
    norm_median: float | None = None
    norm_mean: float | None = None
    norm_max: float | None = None
    clip_norm: float | None = None  # adaptive clipping: ζₜ of this round (None: the plan's fixed ζ)
    noisy_unclipped: float | None = None  # adaptive clipping: the released noisy count of norms ≤ ζₜ

    @classmethod
    def committed(cls, row: Any, norms: Sequence[tuple[float | None, bool | None]] | None) -> RoundSummary:
        """From a ``rounds`` record and, with diagnostics, its (update_norm, clipped) pairs."""
        fields = {f: getattr(row, f) for f in ("round_index", "status", "attempts", "selected", "contributed",
                                               "dropped", "rejected", "noise_std", "checkpoint_sha256",
                                               "epsilon_worst_user", "epsilon_planned", "chain_sha256",
                                               "clip_norm", "noisy_unclipped")}
        return cls(**fields, **norm_summary(norms))

    @classmethod
    def uncommitted(cls, t: int, status: str = "planned", attempts: int = 0) -> RoundSummary:
        return cls(t, status, attempts, 0, 0, 0, 0, None, None)


def norm_summary(norms: Sequence[tuple[float | None, bool | None]] | None) -> dict[str, Any]:
    """clipped count (None when a contribution's clipping is unknown: a secure sum) and min / median
    / mean / max of the recorded update norms (diagnostics); all None without them."""
    if norms is None:
        return {}
    values = np.array([n for n, _ in norms if n is not None], dtype=np.float64)
    # a secure sum records clipping as unknown (NULL): the count is then unknown too, not 0
    known = all(c is not None for _, c in norms)
    out: dict[str, Any] = {"clipped": sum(1 for _, c in norms if c) if known else None}
    for name, f in (("norm_min", np.min), ("norm_median", np.median), ("norm_mean", np.mean), ("norm_max", np.max)):
        out[name] = float(f(values)) if values.size else None
    return out


# ---- one run, one round -------------------------------------------------------------------
def get_run(session: Session, run_id: int, url: URL) -> Run:
    """The run row ``run_id`` of the ledger at ``url``."""
    row = session.get(Run, checks.positive_int("run_id", run_id))
    if row is None:
        raise LedgerError(f"no run with id {run_id} in ledger {display_url(url)}")
    return row


def round_summary(conn: Connection, run_id: int, t: int, diagnostics: bool) -> RoundSummary:
    """Round t of run ``run_id``: its committed record (with diagnostics, its norms), else its state."""
    record = conn.execute(select(Round.__table__).where(Round.run_id == run_id, Round.round_index == t)).first()
    if record is not None:
        norms = None
        if diagnostics:
            norms = conn.execute(select(UpdateNorm.update_norm, UpdateNorm.clipped).where(
                UpdateNorm.run_id == run_id, UpdateNorm.round_index == t)).all()
        return RoundSummary.committed(record, norms)
    state = conn.execute(select(RoundState.status, RoundState.attempts).where(
        RoundState.run_id == run_id, RoundState.round_index == t)).first()
    return RoundSummary.uncommitted(t) if state is None else RoundSummary.uncommitted(t, *state)


# ---- contributions ------------------------------------------------------------------------
def fetch_contributions(conn: Connection, run_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every contributed (client, round) of a run, grouped by client in one indexed scan.

    Returns (keys (U, 32) uint8 in key order, users (N,), rounds (N,)), sorted by (user,
    round). Each client's rounds arrive as one aggregated string, so a key crosses the
    wire once, not once per round."""
    rounds_text = (
        func.string_agg(cast(Participation.round_index, Text), aggregate_order_by(",", Participation.round_index))
        if conn.dialect.name == "postgresql"
        else func.group_concat(Participation.round_index)
    )
    stmt = (
        select(Participation.client_key, rounds_text)
        .where(Participation.run_id == run_id, Participation.status == "contributed")
        .group_by(Participation.client_key)
        .order_by(Participation.client_key)
    )
    rows = conn.execute(stmt).cursor.fetchall()  # plain driver rows: no per-row processing
    keys = [bytes(key) for key, _ in rows]
    texts = [text_ for _, text_ in rows]
    if not keys:
        return np.zeros((0, 32), dtype=np.uint8), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    rounds = np.array(",".join(texts).split(","), dtype=np.int64)
    counts = np.fromiter((t.count(",") + 1 for t in texts), dtype=np.int64, count=len(texts))
    users = np.repeat(np.arange(len(keys), dtype=np.int64), counts)
    order = np.lexsort((rounds, users))  # group_concat promises no order within a group
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, 32), users[order], rounds[order]


def observed_from_arrays(keys: np.ndarray, users: np.ndarray, rounds: np.ndarray) -> Observed:
    """``fetch_contributions``'s arrays as an Observed pattern, keyed by key hex."""
    bounds = np.searchsorted(users, np.arange(len(keys) + 1))
    items = sorted(
        (keys[u].tobytes().hex(), tuple(int(x) for x in rounds[bounds[u] : bounds[u + 1]])) for u in range(len(keys))
    )
    return Observed(tuple(items))


def observed_pattern(session: Session, run_id: int, url: URL) -> Observed:
    """Every client's contributed rounds in run ``run_id`` (committed rounds only), keyed by key hex."""
    row = get_run(session, run_id, url)
    keys, users, rounds = fetch_contributions(session.connection(), row.id)
    return observed_from_arrays(keys, users, rounds)


# ---- the audit's snapshot -----------------------------------------------------------------
@dataclass
class RunRows:
    """What the audit reads of one run: its row, committed records, round state, update norms
    (diagnostics: by round), contributions (``fetch_contributions``) and client state."""

    run: Run
    records: list
    states: list
    norms: dict[int, list] | None
    contributions: tuple[np.ndarray, np.ndarray, np.ndarray]
    client_state: list

    @property
    def committed_rounds(self) -> list[int]:
        """The rounds the mutable round state marks committed."""
        return [int(t) for t, status, _ in self.states if status == "committed"]

    def run_values(self) -> dict[str, Any]:
        """The run row's columns by name (what the genesis hash covers)."""
        return {c.key: getattr(self.run, c.key) for c in Run.__table__.columns}


def read_run(conn: Connection, url: URL, run_id: int | None) -> RunRows:
    """Run ``run_id`` (None: the latest) as the audit reads it, on ``conn`` (one snapshot)."""
    session = Session(bind=conn)
    if run_id is None:
        run_id = conn.execute(select(func.max(Run.id))).scalar()
        if run_id is None:
            raise LedgerError(f"ledger {display_url(url)} holds no runs")
    run = session.get(Run, run_id)
    if run is None:
        raise LedgerError(f"no run with id {run_id} in ledger {display_url(url)}")
    records = conn.execute(select(Round.__table__).where(Round.run_id == run_id)
                           .order_by(Round.round_index)).mappings().all()
    states = conn.execute(select(RoundState.round_index, RoundState.status, RoundState.attempts)
                          .where(RoundState.run_id == run_id).order_by(RoundState.round_index)).all()
    norms: dict[int, list] | None = None
    if run.diagnostics:
        norms = {}
        for t, norm, clipped in conn.execute(select(UpdateNorm.round_index, UpdateNorm.update_norm,
                                                    UpdateNorm.clipped).where(UpdateNorm.run_id == run_id)):
            norms.setdefault(t, []).append((norm, clipped))
    contributions = fetch_contributions(conn, run_id)
    state = conn.execute(
        select(ClientState.client_key, ClientState.contributions, ClientState.last_round)
        .where(ClientState.run_id == run_id).order_by(ClientState.client_key)
    ).cursor.fetchall()
    session.expunge_all()
    return RunRows(run, records, states, norms, contributions, state)


def participation_rows(conn: Connection, run_id: int) -> Iterator[tuple[int, bytes, str, str | None]]:
    """Every participation of run ``run_id`` as (round, client_key, status, reason), streamed in
    primary-key order (one round in memory at a time): what the chain verification reads."""
    result = conn.execution_options(stream_results=True, yield_per=10_000).execute(
        select(Participation.round_index, Participation.client_key, Participation.status, Participation.reason)
        .where(Participation.run_id == run_id).order_by(Participation.round_index, Participation.client_key))
    return ((t, bytes(k), s, r) for t, k, s, r in result)
