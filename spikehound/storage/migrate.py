"""Schema migrations (Alembic), run by ``spikehound db upgrade`` and at start."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

MIGRATIONS = Path(__file__).parent / "migrations"
MIGRATION_LOCK = 0x5350_4B48_0001  # PostgreSQL advisory lock key held while migrating ("SPKH" 1)


def _alembic_config() -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Bring the database to ``revision``; return the revision it is at afterwards."""
    cfg = _alembic_config()
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            # Collectors of a cluster start together on one database: one migrates, the others wait for it
            # (held to the end of this transaction), then find the schema at head and do nothing.
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return current_revision(engine)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()
