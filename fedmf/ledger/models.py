"""The ledger's tables as SQLAlchemy 2 typed ORM models.

The migrations in ``fedmf/ledger/migrations`` create exactly these tables (a test
compares them); the same migrations run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Optional

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base",
    "Run",
    "Round",
    "Participation",
    "PrivacySnapshot",
    "ClientState",
    "ROUND_STATUSES",
    "PARTICIPATION_STATUSES",
    "VERSION_TABLE",
    "NOISE_STD_COMMENT",
]

VERSION_TABLE = "fedmf_ledger_version"  # Alembic's version table, named so it cannot clash
ROUND_STATUSES = ("planned", "open", "committed", "aborted")
PARTICIPATION_STATUSES = ("contributed", "dropped", "rejected")
NOISE_STD_COMMENT = "absolute noise std sigma = z * clip_norm * sensitivity (not z * sensitivity)"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One training run: its configuration and the plan it was calibrated for."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    uid: Mapped[str] = mapped_column(String(32))  # random; salts the client keys
    name: Mapped[Optional[str]] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=_utcnow)
    code_version: Mapped[str] = mapped_column(String(64))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)  # free-form server configuration
    mechanism_kind: Mapped[str] = mapped_column(String(64))
    mechanism_checksum: Mapped[str] = mapped_column(String(80))
    mechanism_document: Mapped[str] = mapped_column(Text)  # the mechanism file, verbatim
    rounds: Mapped[int] = mapped_column(Integer)  # n
    noise_multiplier: Mapped[float] = mapped_column(Float)  # z
    clip_norm: Mapped[float] = mapped_column(Float)  # zeta
    delta: Mapped[float] = mapped_column(Float)
    target_epsilon: Mapped[Optional[float]] = mapped_column(Float)
    participation_schema: Mapped[dict[str, Any]] = mapped_column(JSON)  # the plan: MinSep or FixedEpoch
    sampling: Mapped[str] = mapped_column(String(200))
    key_check: Mapped[str] = mapped_column(String(64))  # HMAC of a fixed label under the secret
    plan: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON, comment="RunPlan.to_dict(); never a secret")
    plan_fingerprint: Mapped[Optional[str]] = mapped_column(
        String(80), comment="RunPlan.fingerprint: finds the run to resume"
    )

    __table_args__ = (
        Index("ix_runs_plan_fingerprint", "plan_fingerprint"),
        CheckConstraint("rounds > 0", name="ck_runs_rounds"),
        CheckConstraint("noise_multiplier > 0", name="ck_runs_noise_multiplier"),
        CheckConstraint("clip_norm > 0", name="ck_runs_clip_norm"),
        CheckConstraint("delta > 0 AND delta < 1", name="ck_runs_delta"),
        UniqueConstraint("uid", name="uq_runs_uid"),
    )


class Round(Base):
    """One round of one run (one row per round index, created 'planned' with the run)."""

    __tablename__ = "rounds"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE", name="fk_rounds_run"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="planned")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    opened_at: Mapped[Optional[dt.datetime]] = mapped_column(DateTime(timezone=True))
    closed_at: Mapped[Optional[dt.datetime]] = mapped_column(DateTime(timezone=True))
    abort_reason: Mapped[Optional[str]] = mapped_column(String(200))
    selected: Mapped[int] = mapped_column(Integer, default=0)
    contributed: Mapped[int] = mapped_column(Integer, default=0)
    dropped: Mapped[int] = mapped_column(Integer, default=0)
    rejected: Mapped[int] = mapped_column(Integer, default=0)
    clipped: Mapped[int] = mapped_column(Integer, default=0)
    norm_min: Mapped[Optional[float]] = mapped_column(Float)
    norm_median: Mapped[Optional[float]] = mapped_column(Float)
    norm_mean: Mapped[Optional[float]] = mapped_column(Float)
    norm_max: Mapped[Optional[float]] = mapped_column(Float)
    # the absolute std sigma = z * clip_norm * sensitivity added to the round's sum (never z * sensitivity)
    noise_std: Mapped[Optional[float]] = mapped_column(Float, comment=NOISE_STD_COMMENT)
    checkpoint_sha256: Mapped[Optional[str]] = mapped_column(
        String(64), comment="SHA-256 (hex) of the checkpoint written for this committed round"
    )

    __table_args__ = (
        CheckConstraint("status IN ('planned', 'open', 'committed', 'aborted')", name="ck_rounds_status"),
        CheckConstraint("round_index >= 0", name="ck_rounds_index"),
        Index("ix_rounds_status", "run_id", "status", "round_index"),
    )


class Participation(Base):
    """One client's part in one committed round (rows exist only for committed rounds)."""

    __tablename__ = "participations"

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    client_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[Optional[str]] = mapped_column(String(200))
    update_norm: Mapped[Optional[float]] = mapped_column(Float)
    clipped: Mapped[Optional[bool]] = mapped_column(Boolean)

    __table_args__ = (
        CheckConstraint("status IN ('contributed', 'dropped', 'rejected')", name="ck_participations_status"),
        # one client's history, and the audit's scan grouped by client (index-only)
        Index("ix_participations_client", "run_id", "client_key", "status", "round_index"),
        ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.round_index"], ondelete="CASCADE",
            name="fk_participations_round",
        ),
        {"sqlite_with_rowid": False},  # clustered on the primary key (run, round, client)
    )


class PrivacySnapshot(Base):
    """The ε the server's accountant reported after a committed round."""

    __tablename__ = "privacy_snapshots"

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    epsilon_worst_user: Mapped[Optional[float]] = mapped_column(Float)
    epsilon_planned: Mapped[Optional[float]] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=_utcnow)

    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.round_index"], ondelete="CASCADE",
            name="fk_privacy_snapshots_round",
        ),
    )


class ClientState(Base):
    """Per run and client: contributions so far and the last contributed round.

    Derived from ``participations`` (written in the same transaction by ``commit_round``) so
    that eligibility is one primary-key lookup per candidate, however long the run; the
    audit checks that it agrees with the participations."""

    __tablename__ = "client_state"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE", name="fk_client_state_run"), primary_key=True
    )
    client_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    contributions: Mapped[int] = mapped_column(Integer)
    last_round: Mapped[int] = mapped_column(Integer)

    __table_args__ = ({"sqlite_with_rowid": False},)
