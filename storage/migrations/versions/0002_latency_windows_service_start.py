"""Index latency windows by (service, start) so that a service's latency over a time range is one index range.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("latency_windows", schema=None) as batch_op:
        batch_op.create_index("ix_latency_windows_service_start", ["service", "start_ns"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("latency_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_latency_windows_service_start")
