"""Alembic environment: migrations always run on a connection handed in by ``spikehound.storage.migrate``."""

from __future__ import annotations

from alembic import context

from spikehound.storage.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - only the alembic command line lands here
    raise SystemExit("run migrations with `spikehound db upgrade`, which supplies the database connection")

context.configure(connection=connection, target_metadata=metadata, render_as_batch=True,
                  compare_type=True)
with context.begin_transaction():
    context.run_migrations()
