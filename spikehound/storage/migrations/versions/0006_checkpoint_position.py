"""Detector checkpoints record where storage stood when they were saved.

``detector_checkpoints`` gains ``span_block_id`` (the highest ``span_blocks.id`` committed) and
``points_ingested_at`` (the latest ``metric_points.ingested_at`` second): after a SIGKILL the collector
feeds its restored detectors what was committed after them. Both are NULL in a checkpoint written
before (nothing is replayed after such a one).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 20:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("detector_checkpoints") as batch:
        batch.add_column(sa.Column("span_block_id", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("points_ingested_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("detector_checkpoints") as batch:
        batch.drop_column("points_ingested_at")
        batch.drop_column("span_block_id")
