"""Detection: detector checkpoints, and the event time at which each spike was detected.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 13:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "detector_checkpoints",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("saved_at", sa.BigInteger(), nullable=False),
        sa.Column("format", sa.Integer(), nullable=False),
        sa.Column("state", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    with op.batch_alter_table("spikes") as batch:
        batch.add_column(sa.Column("detected_ns", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("spikes") as batch:
        batch.drop_column("detected_ns")
    op.drop_table("detector_checkpoints")
