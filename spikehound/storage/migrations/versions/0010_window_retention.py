"""Window retention: latency windows older than ``storage.window_retention_days`` are deleted, found through an
index on their start (the newest window, and the oldest ones, without reading the table).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 01:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_latency_windows_start", "latency_windows", ["start_ns"])


def downgrade() -> None:
    op.drop_index("ix_latency_windows_start", table_name="latency_windows")
