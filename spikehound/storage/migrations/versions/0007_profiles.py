"""Sampling profiles: ``profile_stacks`` (each call stack once) and ``profile_samples`` (per process, window
and stack, its sample count).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "profile_stacks",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("digest", sa.LargeBinary(16), nullable=False),
        sa.Column("frames", sa.Text(), nullable=False),
        sa.UniqueConstraint("digest", name="uq_profile_stacks_digest"),
    )
    op.create_table(
        "profile_samples",
        sa.Column("stack_id", sa.BigInteger(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("service", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("process", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("period_ns", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("ingested_at", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("host", "service", "process", "pid", "kind", "start_ns", "stack_id",
                            name="uq_profile_samples_key"),
    )
    op.create_index("ix_profile_samples_service", "profile_samples", ["service", "start_ns"])
    op.create_index("ix_profile_samples_host", "profile_samples", ["host", "start_ns"])
    op.create_index("ix_profile_samples_ingested_at", "profile_samples", ["ingested_at"])
    op.create_index("ix_profile_samples_stack", "profile_samples", ["stack_id"])


def downgrade() -> None:
    op.drop_table("profile_samples")
    op.drop_table("profile_stacks")
