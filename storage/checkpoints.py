"""Detector checkpoints: the learned detection state, saved and restored by name.

>>> from storage.engine import make_engine
>>> from storage.migrate import upgrade
>>> eng = make_engine("sqlite://")
>>> _ = upgrade(eng)
>>> save(eng, "detection", 1, b"state", now_s=1_700_000_000)
>>> load(eng, "detection")
Checkpoint(format=1, state=b'state', saved_at=1700000000)
>>> load(eng, "other") is None
True
"""

from __future__ import annotations

import time
from typing import NamedTuple

from sqlalchemy import Engine, select

from storage import schema
from storage.writer import upsert

__all__ = ["Checkpoint", "load", "save"]


class Checkpoint(NamedTuple):
    format: int
    state: bytes
    saved_at: int  # unix seconds


def save(engine: Engine, name: str, fmt: int, state: bytes, now_s: int | None = None) -> None:
    """Replace the checkpoint ``name`` in one transaction."""
    t = schema.detector_checkpoints
    stmt = upsert(engine, t)
    stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={
        "saved_at": stmt.excluded.saved_at, "format": stmt.excluded.format, "state": stmt.excluded.state})
    with engine.begin() as conn:
        conn.execute(stmt, {"name": name, "saved_at": int(now_s if now_s is not None else time.time()),
                            "format": fmt, "state": state})


def load(engine: Engine, name: str) -> Checkpoint | None:
    t = schema.detector_checkpoints
    with engine.connect() as conn:
        row = conn.execute(select(t.c.format, t.c.state, t.c.saved_at).where(t.c.name == name)).first()
    return Checkpoint(row.format, bytes(row.state), row.saved_at) if row else None
