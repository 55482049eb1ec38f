"""Append-only history with a hash chain; update norms only as opt-in diagnostics.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26

* ``rounds`` keeps only committed rounds (one record each, never updated) and gains the
  ε the server recorded (from ``privacy_snapshots``, dropped) and ``chain_sha256``; the
  norm summaries and the clipped count leave it.
* ``round_state`` (new, mutable) holds the status and attempts of rounds that were opened.
* ``participations`` loses ``update_norm`` and ``clipped``; existing values move to
  ``update_norms`` (new; diagnostics) and their runs are marked ``diagnostics``.
* ``runs`` gains ``diagnostics`` and ``genesis_sha256``.
* The chain of every existing run is computed here (``fedmf.ledger.chain``, encoding v1): it
  attests the history from this migration on, not what happened to it before.

No downgrade: the chain and the split tables have no 0002 equivalent.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_GENESIS_COMMENT = "the hash chain's genesis (fedmf.ledger.chain)"
_CHAIN_COMMENT = "hash of this record, its participations and the previous round's hash"
_DIAGNOSTICS_COMMENT = "update norms recorded (outside the DP guarantee)"


def _comment(text: str) -> str | None:
    return text if op.get_bind().dialect.supports_comments else None


def upgrade() -> None:
    conn = op.get_bind()
    op.create_table(
        "round_state",
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE", name="fk_round_state_run"),
                  primary_key=True),
        sa.Column("round_index", sa.Integer(), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("abort_reason", sa.String(200), nullable=True),
        sa.CheckConstraint("status IN ('open', 'committed', 'aborted')", name="ck_round_state_status"),
    )
    conn.execute(sa.text(
        "INSERT INTO round_state (run_id, round_index, status, attempts, opened_at, closed_at, abort_reason) "
        "SELECT run_id, round_index, status, attempts, opened_at, closed_at, abort_reason FROM rounds "
        "WHERE status IN ('open', 'committed', 'aborted')"))
    op.create_table(
        "update_norms",
        sa.Column("run_id", sa.Integer(), primary_key=True),
        sa.Column("round_index", sa.Integer(), primary_key=True),
        sa.Column("client_key", sa.LargeBinary(32), primary_key=True),
        sa.Column("update_norm", sa.Float(), nullable=True),
        sa.Column("clipped", sa.Boolean(), nullable=True),
        sa.ForeignKeyConstraint(["run_id", "round_index"], ["rounds.run_id", "rounds.round_index"],
                                ondelete="CASCADE", name="fk_update_norms_round"),
        sqlite_with_rowid=False,
    )
    conn.execute(sa.text(
        "INSERT INTO update_norms (run_id, round_index, client_key, update_norm, clipped) "
        "SELECT p.run_id, p.round_index, p.client_key, p.update_norm, p.clipped FROM participations p "
        "JOIN rounds r ON r.run_id = p.run_id AND r.round_index = p.round_index "
        "WHERE r.status = 'committed' AND p.status = 'contributed' "
        "AND (p.update_norm IS NOT NULL OR p.clipped IS NOT NULL)"))

    # the recorded ε moves onto the committed round's record
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("epsilon_worst_user", sa.Float(), nullable=True))
        batch.add_column(sa.Column("epsilon_planned", sa.Float(), nullable=True))
        batch.add_column(sa.Column("chain_sha256", sa.String(64), nullable=True))
    for column in ("epsilon_worst_user", "epsilon_planned"):
        conn.execute(sa.text(
            f"UPDATE rounds SET {column} = (SELECT s.{column} FROM privacy_snapshots s "
            "WHERE s.run_id = rounds.run_id AND s.round_index = rounds.round_index)"))
    op.drop_table("privacy_snapshots")
    conn.execute(sa.text("DELETE FROM participations WHERE NOT EXISTS (SELECT 1 FROM rounds r WHERE "
                         "r.run_id = participations.run_id AND r.round_index = participations.round_index "
                         "AND r.status = 'committed')"))
    conn.execute(sa.text("DELETE FROM rounds WHERE status <> 'committed'"))
    op.drop_index("ix_rounds_status", table_name="rounds")
    with op.batch_alter_table("participations") as batch:
        batch.drop_column("update_norm")
        batch.drop_column("clipped")
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("diagnostics", sa.Boolean(), nullable=True, comment=_comment(_DIAGNOSTICS_COMMENT)))
        batch.add_column(sa.Column("genesis_sha256", sa.String(64), nullable=True, comment=_comment(_GENESIS_COMMENT)))
    conn.execute(sa.text("UPDATE runs SET diagnostics = EXISTS (SELECT 1 FROM update_norms u "
                         "WHERE u.run_id = runs.id)"))
    _chain_existing_runs(conn)
    with op.batch_alter_table("rounds") as batch:
        for column in ("abort_reason", "clipped", "norm_min", "norm_median", "norm_mean", "norm_max"):
            batch.drop_column(column)
        batch.drop_constraint("ck_rounds_status", type_="check")
        batch.create_check_constraint("ck_rounds_status", "status = 'committed'")
        batch.alter_column("chain_sha256", existing_type=sa.String(64), nullable=False,
                           comment=_comment(_CHAIN_COMMENT))
    with op.batch_alter_table("runs") as batch:
        batch.alter_column("diagnostics", existing_type=sa.Boolean(), nullable=False,
                           existing_comment=_comment(_DIAGNOSTICS_COMMENT))
        batch.alter_column("genesis_sha256", existing_type=sa.String(64), nullable=False,
                           existing_comment=_comment(_GENESIS_COMMENT))


def _chain_existing_runs(conn) -> None:
    """Genesis and round hashes of every run already in the ledger (the code that verifies them)."""
    from fedmf.ledger.chain import GENESIS_FIELDS, ROUND_FIELDS, genesis_sha256, round_sha256

    meta = sa.MetaData()
    meta.reflect(conn, only=("runs", "rounds", "participations"))
    runs, rounds, parts = meta.tables["runs"], meta.tables["rounds"], meta.tables["participations"]
    for run in conn.execute(sa.select(runs.c.id, *(runs.c[f] for f, _ in GENESIS_FIELDS))).mappings().all():
        previous = genesis_sha256(run)
        conn.execute(runs.update().where(runs.c.id == run["id"]).values(genesis_sha256=previous))
        records = conn.execute(sa.select(*(rounds.c[f] for f, _ in ROUND_FIELDS)).where(rounds.c.run_id == run["id"])
                               .order_by(rounds.c.round_index)).mappings().all()
        for record in records:  # one round's participations in memory at a time
            t = record["round_index"]
            rows = conn.execute(sa.select(parts.c.client_key, parts.c.status, parts.c.reason)
                                .where(parts.c.run_id == run["id"], parts.c.round_index == t))
            previous = round_sha256(previous, record, [(bytes(k), s, r) for k, s, r in rows])
            conn.execute(rounds.update().where(rounds.c.run_id == run["id"], rounds.c.round_index == t)
                         .values(chain_sha256=previous))


def downgrade() -> None:
    raise NotImplementedError("a ledger at 0003 cannot be downgraded (its hash chain has no 0002 form)")
