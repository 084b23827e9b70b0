"""Trace search: which services each span block holds, and span blocks by event time.

``span_block_services`` has one row per (span block, service) with the range of span start times and
the longest span of that service in the block, so that a search by service, time and duration (the Jaeger
query API) reads only the blocks that can match. ``ix_span_blocks_end_ns`` finds blocks by event time
(the service dependency graph). Blocks stored before this revision have no rows: they stay readable by
trace id, and age out with retention.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "span_block_services",
        sa.Column("block_id", sa.BigInteger(), nullable=False),
        sa.Column("service", sa.String(length=255), nullable=False),
        sa.Column("min_start_ns", sa.BigInteger(), nullable=False),
        sa.Column("max_start_ns", sa.BigInteger(), nullable=False),
        sa.Column("max_duration_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("block_id", "service", name="pk_span_block_services"),
    )
    with op.batch_alter_table("span_block_services") as batch:
        batch.create_index("ix_span_block_services_search", ["service", "max_start_ns"], unique=False)
    with op.batch_alter_table("span_blocks") as batch:
        batch.create_index("ix_span_blocks_end_ns", ["end_ns"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("span_blocks") as batch:
        batch.drop_index("ix_span_blocks_end_ns")
    op.drop_table("span_block_services")
