"""Engines for the two supported databases, tuned for one batched writer.

>>> make_engine("sqlite:///:memory:").dialect.name
'sqlite'
>>> normalize_url("postgres://u@h/db")
'postgresql+psycopg://u@h/db'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

# libpq's: give up connecting after 10 s; and on an open connection whose server went silent (a partition, a
# host gone without a reset), fail within about 30 s instead of the kernel's 15 minutes of retransmissions.
PG_TIMEOUTS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
               "keepalives_count": 3, "tcp_user_timeout": 30_000}


def normalize_url(url: str) -> str:
    """Route every PostgreSQL URL through psycopg 3, whatever the user wrote."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def make_engine(url: str, *, sqlite_synchronous: str = "NORMAL") -> Engine:
    """Create the engine; SQLite gets WAL so API readers never block the writer."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # A server that stops answering (a partition, not a refusal) must fail a write within half a minute, not
        # hang the writer: the collector then tells senders to retry and tries again (collector/storage_health.py).
        given = {k: v for k, v in PG_TIMEOUTS.items() if k not in parsed.query}  # the URL's own settings win
        return create_engine(url, pool_size=8, max_overflow=4, pool_pre_ping=True, connect_args=given)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={sqlite_synchronous}")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA cache_size=-65536")  # 64 MiB: keeps the span id index hot
        cur.execute("PRAGMA temp_store=MEMORY")
        cur.close()

    return engine
