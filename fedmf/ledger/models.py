"""The ledger's tables as SQLAlchemy 2 typed ORM models.

History (only ever INSERTed; on PostgreSQL the server role may not UPDATE or DELETE it):
``runs`` (the genesis of the hash chain), ``rounds`` (one record per committed round, chained),
``participations`` (one row per client and committed round) and ``update_norms`` (diagnostics,
written only when the run enables them). Mutable state: ``round_state`` (the open or aborted
attempt of a round) and ``client_state`` (eligibility, derived from the participations).

The migrations in ``fedmf/ledger/migrations`` create exactly these tables (a test
compares them); the same migrations run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

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
    "UpdateNorm",
    "RoundState",
    "ClientState",
    "HISTORY_TABLES",
    "MUTABLE_TABLES",
    "ROUND_STATUSES",
    "PARTICIPATION_STATUSES",
    "VERSION_TABLE",
    "NOISE_STD_COMMENT",
    "BudgetSettings",
    "UserBudget",
    "BudgetCharge",
    "BudgetSkip",
    "BUDGET_TABLES",
]

VERSION_TABLE = "fedmf_ledger_version"  # Alembic's version table, named so it cannot clash
ROUND_STATUSES = ("planned", "open", "committed", "aborted")  # "planned": no round_state row yet
HISTORY_TABLES = ("runs", "rounds", "participations", "update_norms")  # INSERT only
MUTABLE_TABLES = ("round_state", "client_state")
#: lifetime budgets (fedmf.ledger.budgets): settings and per-user budgets are the operator's; charges
#: are only ever inserted; skips are rewritten by a redone round
BUDGET_TABLES = ("budget_settings", "user_budgets", "budget_charges", "budget_skips")
PARTICIPATION_STATUSES = ("contributed", "dropped", "rejected")
NOISE_STD_COMMENT = "absolute noise std sigma = z * clip_norm * sensitivity (not z * sensitivity)"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One training run: its configuration and the plan it was calibrated for."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    uid: Mapped[str] = mapped_column(String(32))  # random; salts the client keys
    name: Mapped[str | None] = mapped_column(String(200))
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
    target_epsilon: Mapped[float | None] = mapped_column(Float)
    participation_schema: Mapped[dict[str, Any]] = mapped_column(JSON)  # the plan: MinSep or FixedEpoch
    sampling: Mapped[str] = mapped_column(String(200))
    key_check: Mapped[str] = mapped_column(String(64))  # HMAC of a fixed label under the secret
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, comment="RunPlan.to_dict(); never a secret")
    plan_fingerprint: Mapped[str | None] = mapped_column(
        String(80), comment="RunPlan.fingerprint: finds the run to resume"
    )
    diagnostics: Mapped[bool] = mapped_column(
        Boolean, default=False, comment="update norms recorded (outside the DP guarantee)"
    )
    genesis_sha256: Mapped[str] = mapped_column(String(64), comment="the hash chain's genesis (fedmf.ledger.chain)")

    __table_args__ = (
        Index("ix_runs_plan_fingerprint", "plan_fingerprint"),
        CheckConstraint("rounds > 0", name="ck_runs_rounds"),
        CheckConstraint("noise_multiplier > 0", name="ck_runs_noise_multiplier"),
        CheckConstraint("clip_norm > 0", name="ck_runs_clip_norm"),
        CheckConstraint("delta > 0 AND delta < 1", name="ck_runs_delta"),
        UniqueConstraint("uid", name="uq_runs_uid"),
    )


class Round(Base):
    """One committed round of one run: its counts, noise and ε, chained to the previous round
    (``fedmf.ledger.chain``). Inserted once, by ``commit_round``; never updated."""

    __tablename__ = "rounds"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE", name="fk_rounds_run"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="committed")
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    opened_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    closed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    selected: Mapped[int] = mapped_column(Integer, default=0)
    contributed: Mapped[int] = mapped_column(Integer, default=0)
    dropped: Mapped[int] = mapped_column(Integer, default=0)
    rejected: Mapped[int] = mapped_column(Integer, default=0)
    # the absolute std sigma = z * clip_norm * sensitivity added to the round's sum (never z * sensitivity)
    noise_std: Mapped[float | None] = mapped_column(Float, comment=NOISE_STD_COMMENT)
    checkpoint_sha256: Mapped[str | None] = mapped_column(
        String(64), comment="SHA-256 (hex) of the checkpoint written for this committed round"
    )
    epsilon_worst_user: Mapped[float | None] = mapped_column(Float)  # as the server's accountant reported
    epsilon_planned: Mapped[float | None] = mapped_column(Float)
    clip_norm: Mapped[float | None] = mapped_column(
        Float, comment="the clip norm zeta_t of this round (adaptive clipping: it changes per round)")
    noisy_unclipped: Mapped[float | None] = mapped_column(
        Float, comment="count of updates with norm <= zeta_t plus Gaussian noise (adaptive clipping only)")
    chain_sha256: Mapped[str] = mapped_column(String(64), comment="hash of this record, its participations and "
                                                                  "the previous round's hash")

    __table_args__ = (
        CheckConstraint("status = 'committed'", name="ck_rounds_status"),
        CheckConstraint("round_index >= 0", name="ck_rounds_index"),
    )


class Participation(Base):
    """One client's part in one committed round (inserted with the round's record)."""

    __tablename__ = "participations"

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    client_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(200))

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


class UpdateNorm(Base):
    """Diagnostics, only for runs created with ``diagnostics=True``: a contribution's update norm
    before clipping and whether it was clipped. Data-dependent and outside the DP guarantee;
    accounting never reads it."""

    __tablename__ = "update_norms"

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    client_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    update_norm: Mapped[float | None] = mapped_column(Float)
    clipped: Mapped[bool | None] = mapped_column(Boolean)

    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.round_index"], ondelete="CASCADE",
            name="fk_update_norms_round",
        ),
        {"sqlite_with_rowid": False},
    )


class RoundState(Base):
    """The mutable state of a round that was opened: its status (open, aborted, committed) and
    attempts. Not history: the audit reads it only for rounds that are not committed."""

    __tablename__ = "round_state"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE", name="fk_round_state_run"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)
    opened_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    closed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    abort_reason: Mapped[str | None] = mapped_column(String(200))

    __table_args__ = (
        CheckConstraint("status IN ('open', 'committed', 'aborted')", name="ck_round_state_status"),
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


class BudgetSettings(Base):
    """The ledger-wide lifetime budget (one row, id 1): the default ε (None: users without their
    own budget are not limited), the lifetime δ, and the key check of the budget secret."""

    __tablename__ = "budget_settings"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    default_epsilon: Mapped[float | None] = mapped_column(Float)
    delta: Mapped[float] = mapped_column(Float)
    key_check: Mapped[str] = mapped_column(String(64), comment="HMAC of a fixed label under the budget secret")

    __table_args__ = (
        CheckConstraint("id = 1", name="ck_budget_settings_id"),
        CheckConstraint("delta > 0 AND delta < 1", name="ck_budget_settings_delta"),
    )


class UserBudget(Base):
    """A user's own lifetime ε (at the ledger's lifetime δ), keyed by their lifetime key."""

    __tablename__ = "user_budgets"

    lifetime_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    epsilon: Mapped[float] = mapped_column(Float)

    __table_args__ = (CheckConstraint("epsilon >= 0", name="ck_user_budgets_epsilon"),)


class BudgetCharge(Base):
    """A run's worst-case charge on a user: μ² of everything the run's schema allows it to take
    from them, inserted when the run first selects them (never updated)."""

    __tablename__ = "budget_charges"

    lifetime_key: Mapped[bytes] = mapped_column(LargeBinary(32), primary_key=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE", name="fk_budget_charges_run"), primary_key=True)
    mu_squared: Mapped[float] = mapped_column(Float)
    round_index: Mapped[int] = mapped_column(Integer)  # the round that first selected the user

    __table_args__ = ({"sqlite_with_rowid": False},)


class BudgetSkip(Base):
    """How many available users a round passed over because of their lifetime budget (a count only)."""

    __tablename__ = "budget_skips"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE", name="fk_budget_skips_run"), primary_key=True)
    round_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    skipped: Mapped[int] = mapped_column(Integer)
