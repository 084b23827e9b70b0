"""Recurrences: a spike that returns at the place of one that ended names the first spike of the chain
(``recurrence_of``), which occurrence it is (``occurrence``: 1 for a first spike) and when the first began
(``first_start_ns``).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("spikes") as batch:
        batch.add_column(sa.Column("recurrence_of", sa.String(32), nullable=True))
        batch.add_column(sa.Column("occurrence", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("first_start_ns", sa.BigInteger(), nullable=True))
    op.create_index("ix_spikes_recurrence_of", "spikes", ["recurrence_of"])


def downgrade() -> None:
    op.drop_index("ix_spikes_recurrence_of", table_name="spikes")
    with op.batch_alter_table("spikes") as batch:
        batch.drop_column("first_start_ns")
        batch.drop_column("occurrence")
        batch.drop_column("recurrence_of")
