"""Lifetime per-user budgets across the runs of one ledger.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27

Adds ``budget_settings`` (one row: the default lifetime ε, the lifetime δ, the budget secret's key
check), ``user_budgets`` (a user's own ε by lifetime key), ``budget_charges`` (a run's worst-case μ²
on a user, inserted when the run first selects them) and ``budget_skips`` (per round, how many
available users were passed over for their budget). Keys are HMACs; no raw id or secret is stored.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

KEY_CHECK_COMMENT = "HMAC of a fixed label under the budget secret"


def _comment(text: str) -> str | None:
    return text if op.get_bind().dialect.supports_comments else None


def upgrade() -> None:
    op.create_table(
        "budget_settings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("default_epsilon", sa.Float(), nullable=True),
        sa.Column("delta", sa.Float(), nullable=False),
        sa.Column("key_check", sa.String(64), nullable=False, comment=_comment(KEY_CHECK_COMMENT)),
        sa.PrimaryKeyConstraint("id"),
        sa.CheckConstraint("id = 1", name="ck_budget_settings_id"),
        sa.CheckConstraint("delta > 0 AND delta < 1", name="ck_budget_settings_delta"),
    )
    op.create_table(
        "user_budgets",
        sa.Column("lifetime_key", sa.LargeBinary(32), nullable=False),
        sa.Column("epsilon", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("lifetime_key"),
        sa.CheckConstraint("epsilon >= 0", name="ck_user_budgets_epsilon"),
    )
    op.create_table(
        "budget_charges",
        sa.Column("lifetime_key", sa.LargeBinary(32), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("mu_squared", sa.Float(), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("lifetime_key", "run_id"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_budget_charges_run"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "budget_skips",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("skipped", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "round_index"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_budget_skips_run"),
    )


def downgrade() -> None:
    for table in ("budget_skips", "budget_charges", "user_budgets", "budget_settings"):
        op.drop_table(table)
