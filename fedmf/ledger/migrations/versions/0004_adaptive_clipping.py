"""The clip norm each round used, and the privatized count of unclipped updates.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26

Adds ``rounds.clip_norm`` (ζₜ, the clip norm round t's updates were clipped to and its noise was
scaled by; with adaptive clipping it changes from round to round) and ``rounds.noisy_unclipped``
(the count of unclipped updates as released with Gaussian noise, from which ζₜ₊₁ follows; null
without adaptive clipping). Both nullable: rounds committed before 0004 keep their rows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

CLIP_NORM_COMMENT = "the clip norm zeta_t of this round (adaptive clipping: it changes per round)"
NOISY_UNCLIPPED_COMMENT = "count of updates with norm <= zeta_t plus Gaussian noise (adaptive clipping only)"


def _comment(text: str) -> str | None:
    return text if op.get_bind().dialect.supports_comments else None


def upgrade() -> None:
    op.add_column("rounds", sa.Column("clip_norm", sa.Float(), nullable=True, comment=_comment(CLIP_NORM_COMMENT)))
    op.add_column("rounds", sa.Column("noisy_unclipped", sa.Float(), nullable=True,
                                      comment=_comment(NOISY_UNCLIPPED_COMMENT)))


def downgrade() -> None:
    op.drop_column("rounds", "noisy_unclipped")
    op.drop_column("rounds", "clip_norm")
