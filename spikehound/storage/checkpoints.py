"""Detector checkpoints: the learned detection state, saved and restored by name.

A checkpoint also records where storage stood when it was saved (``position``): the highest span block
id and the latest metric point arrival second, read in the same call, between two commits of the one
writer. What was committed after it is what a restarted collector feeds its restored detectors.

>>> from spikehound.storage.engine import make_engine
>>> from spikehound.storage.migrate import upgrade
>>> eng = make_engine("sqlite://")
>>> _ = upgrade(eng)
>>> save(eng, "detection", 1, b"state", now_s=1_700_000_000)
>>> load(eng, "detection")
Checkpoint(format=1, state=b'state', saved_at=1700000000, span_block_id=0, points_ingested_at=0)
>>> load(eng, "other") is None
True
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, func, select

from spikehound.storage import schema
from spikehound.storage.writer import upsert

__all__ = ["Checkpoint", "latest_block_id", "load", "position", "save", "save_on", "writing"]


class Checkpoint(NamedTuple):
    format: int
    state: bytes
    saved_at: int  # unix seconds
    span_block_id: int | None = None  # spans in blocks after this id came later (None: saved before 0006)
    points_ingested_at: int | None = None  # metric points that arrived in or after this second may be later


def position(engine: Engine) -> tuple[int, int]:
    """(highest span block id, latest metric point arrival second) committed now; 0 where there is none."""
    with engine.connect() as conn:
        block = latest_block_id(conn)
        second = conn.execute(select(func.max(schema.metric_points.c.ingested_at))).scalar()
    return block, int(second or 0)


def latest_block_id(conn: Connection) -> int:
    """The highest span block id committed (0: none), as ``conn``'s transaction sees it."""
    return int(conn.execute(select(func.max(schema.span_blocks.c.id))).scalar() or 0)


def save(engine: Engine, name: str, fmt: int, state: bytes, now_s: int | None = None) -> None:
    """Replace the checkpoint ``name`` in one transaction, with storage's position now (see ``position``).

    Call it between commits (the collector does, on its writer thread) so that the position fits the state.
    """
    block, second = position(engine)
    with writing(engine) as conn:
        save_on(conn, name, fmt, state, block, second, now_s)


@contextlib.contextmanager
def writing(engine: Engine) -> Iterator[Connection]:
    """A connection in a transaction to write a checkpoint on; on PostgreSQL it is closed after, not pooled.

    libpq keeps a connection's send buffer as large as the largest message it ever sent: a pooled connection
    that wrote a checkpoint of 15-30 MB would hold 16 or 32 MiB for good, and the pool hands each write to
    the next connection, so that within minutes every one of them would (a soak's collector process grew
    130 MB in an hour this way). A fresh connection per checkpoint, once a minute, costs a few milliseconds.
    """
    with engine.connect() as conn:
        with conn.begin():
            yield conn
        if conn.dialect.name == "postgresql":
            conn.invalidate()


def save_on(conn: Connection, name: str, fmt: int, state: bytes, span_block_id: int | None,
            points_ingested_at: int | None, now_s: int | None = None) -> None:
    """Replace the checkpoint ``name`` in the caller's transaction on ``conn``, with the position given."""
    t = schema.detector_checkpoints
    stmt = upsert(conn.engine, t)
    stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={
        "saved_at": stmt.excluded.saved_at, "format": stmt.excluded.format, "state": stmt.excluded.state,
        "span_block_id": stmt.excluded.span_block_id, "points_ingested_at": stmt.excluded.points_ingested_at})
    conn.execute(stmt, {"name": name, "saved_at": int(now_s if now_s is not None else time.time()),
                        "format": fmt, "state": state, "span_block_id": span_block_id,
                        "points_ingested_at": points_ingested_at})


def load(engine: Engine | Connection, name: str) -> Checkpoint | None:
    t = schema.detector_checkpoints
    with _connection(engine) as conn:
        row = conn.execute(select(t.c.format, t.c.state, t.c.saved_at, t.c.span_block_id, t.c.points_ingested_at)
                           .where(t.c.name == name)).first()
    return Checkpoint(row.format, bytes(row.state), row.saved_at, row.span_block_id,
                      row.points_ingested_at) if row else None


def _connection(where: Engine | Connection) -> Any:
    """A connection to read on: a new one from an engine, or the caller's own (left open)."""
    return where.connect() if isinstance(where, Engine) else contextlib.nullcontext(where)
