"""Initial schema: span blocks with their trace index, operations, hosts, metric samples,
latency windows, spikes and causes.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 12:18:57.917768
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "causes",
        sa.Column("spike_id", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.SmallInteger(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("service", sa.String(length=255), nullable=True),
        sa.Column("operation", sa.String(length=1024), nullable=True),
        sa.Column("peer_service", sa.String(length=255), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("resource", sa.String(length=255), nullable=True),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("baseline", sa.Float(), nullable=True),
        sa.Column("observed", sa.Float(), nullable=True),
        sa.Column("unit", sa.String(length=32), nullable=True),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("spike_id", "rank", name="pk_causes"),
    )
    op.create_table(
        "hosts",
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("last_seen_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("host"),
    )
    op.create_table(
        "latency_windows",
        sa.Column("service", sa.String(length=255), nullable=False),
        sa.Column("operation", sa.String(length=1024), nullable=False),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("p50_ns", sa.BigInteger(), nullable=False),
        sa.Column("p95_ns", sa.BigInteger(), nullable=False),
        sa.Column("p99_ns", sa.BigInteger(), nullable=False),
        sa.Column("max_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("service", "operation", "start_ns", name="pk_latency_windows"),
    )
    with op.batch_alter_table("latency_windows", schema=None) as batch_op:
        batch_op.create_index("ix_latency_windows_service_start", ["service", "start_ns"], unique=False)

    op.create_table(
        "metric_points",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("t_ns", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("ingested_at", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("series_id", "t_ns", name="uq_metric_points_series_t"),
    )
    with op.batch_alter_table("metric_points", schema=None) as batch_op:
        batch_op.create_index("ix_metric_points_ingested_at", ["ingested_at"], unique=False)

    op.create_table(
        "metric_series",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("attributes", sa.Text(), nullable=False),
        sa.Column("kind", sa.SmallInteger(), nullable=False),
        sa.Column("unit", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("host", "name", "attributes", name="uq_metric_series_key"),
    )
    with op.batch_alter_table("metric_series", schema=None) as batch_op:
        batch_op.create_index("ix_metric_series_name", ["name"], unique=False)

    op.create_table(
        "operations",
        sa.Column("service", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=1024), nullable=False),
        sa.Column("first_seen_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("service", "name", name="pk_operations"),
    )
    op.create_table(
        "span_blocks",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("ingested_at", sa.BigInteger(), nullable=False),
        sa.Column("span_count", sa.Integer(), nullable=False),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("span_blocks", schema=None) as batch_op:
        batch_op.create_index("ix_span_blocks_ingested_at", ["ingested_at"], unique=False)

    op.create_table(
        "spikes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("service", sa.String(length=255), nullable=False),
        sa.Column("operation", sa.String(length=1024), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=True),
        sa.Column("p99_ns", sa.BigInteger(), nullable=False),
        sa.Column("baseline_p99_ns", sa.BigInteger(), nullable=False),
        sa.Column("exemplar_trace_ids", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("spikes", schema=None) as batch_op:
        batch_op.create_index("ix_spikes_service_start", ["service", "start_ns"], unique=False)
        batch_op.create_index("ix_spikes_start", ["start_ns"], unique=False)

    op.create_table(
        "trace_blocks",
        sa.Column("trace_id", sa.LargeBinary(length=16), nullable=False),
        sa.Column("block_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("trace_id", "block_id", name="pk_trace_blocks"),
    )
    with op.batch_alter_table("trace_blocks", schema=None) as batch_op:
        batch_op.create_index("ix_trace_blocks_block", ["block_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("trace_blocks", schema=None) as batch_op:
        batch_op.drop_index("ix_trace_blocks_block")

    op.drop_table("trace_blocks")
    with op.batch_alter_table("spikes", schema=None) as batch_op:
        batch_op.drop_index("ix_spikes_start")
        batch_op.drop_index("ix_spikes_service_start")

    op.drop_table("spikes")
    with op.batch_alter_table("span_blocks", schema=None) as batch_op:
        batch_op.drop_index("ix_span_blocks_ingested_at")

    op.drop_table("span_blocks")
    op.drop_table("operations")
    with op.batch_alter_table("metric_series", schema=None) as batch_op:
        batch_op.drop_index("ix_metric_series_name")

    op.drop_table("metric_series")
    with op.batch_alter_table("metric_points", schema=None) as batch_op:
        batch_op.drop_index("ix_metric_points_ingested_at")

    op.drop_table("metric_points")
    with op.batch_alter_table("latency_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_latency_windows_service_start")

    op.drop_table("latency_windows")
    op.drop_table("hosts")
    op.drop_table("causes")
