"""Scale-out: ``cluster_feed`` (each member's commits, in its order), ``cluster_members`` (heartbeats) and
``cluster_cursors`` (where the detection leader's checkpoint stands in each feed). Used only by collectors
with ``cluster.enabled``; a single collector leaves them empty.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cluster_feed",
        sa.Column("member", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("block_ids", sa.Text(), nullable=False),
        sa.Column("points", sa.LargeBinary(), nullable=True),
        sa.Column("written_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("member", "seq", name="pk_cluster_feed"),
    )
    op.create_table(
        "cluster_members",
        sa.Column("member", sa.String(64), primary_key=True),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger(), nullable=False),
        sa.Column("fed_seq", sa.BigInteger(), nullable=False),
        sa.Column("api_url", sa.String(255), nullable=False),
        sa.Column("instance", sa.String(32), nullable=False, server_default=""),
        sa.Column("leader_pid", sa.BigInteger(), nullable=True),
    )
    op.create_table(
        "cluster_cursors",
        sa.Column("member", sa.String(64), primary_key=True),
        sa.Column("seq", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("cluster_cursors")
    op.drop_table("cluster_members")
    op.drop_table("cluster_feed")
