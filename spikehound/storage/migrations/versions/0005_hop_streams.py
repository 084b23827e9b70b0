"""Hop streams and incidents: latency windows of caller -> callee edges, and the streams a spike moved.

``latency_windows`` gains ``peer_service`` (the caller of a hop stream; empty for an entry stream), which
joins its primary key: the hop into ``service``'s ``operation`` and the operation itself are two streams.
The table is rebuilt with the new key and its rows copied as entry streams. ``spikes`` gains
``peer_service`` (set when a hop stream leads the spike), and ``spike_streams`` holds every stream a
spike moved, with its own numbers, the leader first.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_WINDOW_COLUMNS = ("service", "operation", "start_ns", "end_ns", "count", "p50_ns", "p95_ns", "p99_ns", "max_ns")


def _windows_table(name: str, with_peer: bool) -> None:
    key = ("service", "operation", "peer_service", "start_ns") if with_peer else ("service", "operation", "start_ns")
    op.create_table(
        name,
        sa.Column("service", sa.String(length=255), nullable=False),
        sa.Column("operation", sa.String(length=1024), nullable=False),
        *([sa.Column("peer_service", sa.String(length=255), nullable=False, server_default="")] if with_peer else []),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("p50_ns", sa.BigInteger(), nullable=False),
        sa.Column("p95_ns", sa.BigInteger(), nullable=False),
        sa.Column("p99_ns", sa.BigInteger(), nullable=False),
        sa.Column("max_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*key, name=f"pk_{name}"),
    )


def _rebuild_windows(with_peer: bool) -> None:
    """Copy latency_windows into a table of the other shape, then put it in its place."""
    _windows_table("latency_windows_next", with_peer)
    columns = ", ".join(_WINDOW_COLUMNS)
    where = "" if with_peer else " WHERE peer_service = ''"
    op.execute(f"INSERT INTO latency_windows_next ({columns}) SELECT {columns} FROM latency_windows{where}")
    op.drop_index("ix_latency_windows_service_start", table_name="latency_windows")
    op.drop_table("latency_windows")
    _windows_table("latency_windows", with_peer)
    op.execute("INSERT INTO latency_windows SELECT * FROM latency_windows_next")
    op.drop_table("latency_windows_next")
    op.create_index("ix_latency_windows_service_start", "latency_windows", ["service", "start_ns"], unique=False)


def upgrade() -> None:
    _rebuild_windows(with_peer=True)
    with op.batch_alter_table("spikes") as batch:
        batch.add_column(sa.Column("peer_service", sa.String(length=255), nullable=True))
    op.create_table(
        "spike_streams",
        sa.Column("spike_id", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.SmallInteger(), nullable=False),
        sa.Column("service", sa.String(length=255), nullable=False),
        sa.Column("operation", sa.String(length=1024), nullable=False),
        sa.Column("peer_service", sa.String(length=255), nullable=True),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("last_anomalous_end_ns", sa.BigInteger(), nullable=False),
        sa.Column("p99_ns", sa.BigInteger(), nullable=False),
        sa.Column("baseline_p99_ns", sa.BigInteger(), nullable=False),
        sa.Column("evidence", sa.Float(), nullable=False),
        sa.Column("slow_requests", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("spike_id", "rank", name="pk_spike_streams"),
    )
    op.create_index("ix_spike_streams_service", "spike_streams", ["service"], unique=False)


def downgrade() -> None:
    op.drop_table("spike_streams")
    with op.batch_alter_table("spikes") as batch:
        batch.drop_column("peer_service")
    _rebuild_windows(with_peer=False)
