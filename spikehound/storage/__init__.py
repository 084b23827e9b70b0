"""Every SQL statement of spikehound: the schema and its migrations, the engine, the one writer, every read.

The collector and the CLI use the modules named below; ``migrations/`` is Alembic's, read through ``migrate``.
"""

__all__ = ["alerts", "checkpoints", "cluster", "engine", "migrate", "reader", "resolved_spikes", "retention",
           "schema", "trace_search", "writer"]
