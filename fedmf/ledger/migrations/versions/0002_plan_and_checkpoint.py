"""The plan on the run row, the checkpoint hash on the round row, noise_std's unit.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Adds ``runs.plan`` (the RunPlan's JSON), ``runs.plan_fingerprint`` (indexed: a restarted
server finds its run by it) and ``rounds.checkpoint_sha256`` (the checkpoint written for the
committed round); all nullable, so a ledger at 0001 upgrades in place with its rows intact.
Also documents the unit of ``rounds.noise_std`` as a column comment (where the database
keeps comments: PostgreSQL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

NOISE_STD_COMMENT = "absolute noise std sigma = z * clip_norm * sensitivity (not z * sensitivity)"


def _comments() -> bool:
    return op.get_bind().dialect.supports_comments


def upgrade() -> None:
    op.add_column("runs", sa.Column("plan", sa.JSON(), nullable=True, comment="RunPlan.to_dict(); never a secret"))
    op.add_column("runs", sa.Column("plan_fingerprint", sa.String(80), nullable=True,
                                    comment="RunPlan.fingerprint: finds the run to resume"))
    op.create_index("ix_runs_plan_fingerprint", "runs", ["plan_fingerprint"])
    op.add_column("rounds", sa.Column("checkpoint_sha256", sa.String(64), nullable=True,
                                      comment="SHA-256 (hex) of the checkpoint written for this committed round"))
    if _comments():
        op.alter_column("rounds", "noise_std", existing_type=sa.Float(), existing_nullable=True,
                        comment=NOISE_STD_COMMENT)


def downgrade() -> None:
    if _comments():
        op.alter_column("rounds", "noise_std", existing_type=sa.Float(), existing_nullable=True, comment=None,
                        existing_comment=NOISE_STD_COMMENT)
    op.drop_column("rounds", "checkpoint_sha256")
    op.drop_index("ix_runs_plan_fingerprint", table_name="runs")
    op.drop_column("runs", "plan_fingerprint")
    op.drop_column("runs", "plan")
