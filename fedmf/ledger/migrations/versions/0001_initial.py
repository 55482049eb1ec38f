"""Initial ledger schema: runs, rounds, participations, client state, privacy snapshots.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Revision ids are zero-padded integers, so a ledger written by a newer fedmf is
recognised as newer (``fedmf.ledger.db.check_version``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("uid", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("code_version", sa.String(64), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("mechanism_kind", sa.String(64), nullable=False),
        sa.Column("mechanism_checksum", sa.String(80), nullable=False),
        sa.Column("mechanism_document", sa.Text(), nullable=False),
        sa.Column("rounds", sa.Integer(), nullable=False),
        sa.Column("noise_multiplier", sa.Float(), nullable=False),
        sa.Column("clip_norm", sa.Float(), nullable=False),
        sa.Column("delta", sa.Float(), nullable=False),
        sa.Column("target_epsilon", sa.Float(), nullable=True),
        sa.Column("participation_schema", sa.JSON(), nullable=False),
        sa.Column("sampling", sa.String(200), nullable=False),
        sa.Column("key_check", sa.String(64), nullable=False),
        sa.UniqueConstraint("uid", name="uq_runs_uid"),
        sa.CheckConstraint("rounds > 0", name="ck_runs_rounds"),
        sa.CheckConstraint("noise_multiplier > 0", name="ck_runs_noise_multiplier"),
        sa.CheckConstraint("clip_norm > 0", name="ck_runs_clip_norm"),
        sa.CheckConstraint("delta > 0 AND delta < 1", name="ck_runs_delta"),
    )
    op.create_table(
        "rounds",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE", name="fk_rounds_run"),
                  primary_key=True),
        sa.Column("round_index", sa.Integer(), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("abort_reason", sa.String(200), nullable=True),
        sa.Column("selected", sa.Integer(), nullable=False),
        sa.Column("contributed", sa.Integer(), nullable=False),
        sa.Column("dropped", sa.Integer(), nullable=False),
        sa.Column("rejected", sa.Integer(), nullable=False),
        sa.Column("clipped", sa.Integer(), nullable=False),
        sa.Column("norm_min", sa.Float(), nullable=True),
        sa.Column("norm_median", sa.Float(), nullable=True),
        sa.Column("norm_mean", sa.Float(), nullable=True),
        sa.Column("norm_max", sa.Float(), nullable=True),
        sa.Column("noise_std", sa.Float(), nullable=True),
        sa.CheckConstraint("status IN ('planned', 'open', 'committed', 'aborted')", name="ck_rounds_status"),
        sa.CheckConstraint("round_index >= 0", name="ck_rounds_index"),
    )
    op.create_index("ix_rounds_status", "rounds", ["run_id", "status", "round_index"])
    op.create_table(
        "participations",
        sa.Column("run_id", sa.Integer(), primary_key=True),
        sa.Column("round_index", sa.Integer(), primary_key=True),
        sa.Column("client_key", sa.LargeBinary(32), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(200), nullable=True),
        sa.Column("update_norm", sa.Float(), nullable=True),
        sa.Column("clipped", sa.Boolean(), nullable=True),
        sa.CheckConstraint("status IN ('contributed', 'dropped', 'rejected')", name="ck_participations_status"),
        sa.ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.round_index"], ondelete="CASCADE",
            name="fk_participations_round",
        ),
        sqlite_with_rowid=False,
    )
    op.create_index(
        "ix_participations_client", "participations", ["run_id", "client_key", "status", "round_index"]
    )
    op.create_table(
        "client_state",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE", name="fk_client_state_run"),
                  primary_key=True),
        sa.Column("client_key", sa.LargeBinary(32), primary_key=True),
        sa.Column("contributions", sa.Integer(), nullable=False),
        sa.Column("last_round", sa.Integer(), nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "privacy_snapshots",
        sa.Column("run_id", sa.Integer(), primary_key=True),
        sa.Column("round_index", sa.Integer(), primary_key=True),
        sa.Column("epsilon_worst_user", sa.Float(), nullable=True),
        sa.Column("epsilon_planned", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id", "round_index"], ["rounds.run_id", "rounds.round_index"], ondelete="CASCADE",
            name="fk_privacy_snapshots_round",
        ),
    )


def downgrade() -> None:
    op.drop_table("privacy_snapshots")
    op.drop_table("client_state")
    op.drop_index("ix_participations_client", table_name="participations")
    op.drop_table("participations")
    op.drop_index("ix_rounds_status", table_name="rounds")
    op.drop_table("rounds")
    op.drop_table("runs")
