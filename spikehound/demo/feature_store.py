"""The demo's feature store: a real SQLite database that the preprocess service queries per request.

Features are looked up by entity id through an index. The slow-query fault is
what happens to real feature stores: a migration drops the index, and every
lookup becomes a full scan of the table (a real slow SQL query, tens of
milliseconds instead of tens of microseconds); recovery recreates the index.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "features.db"
>>> create(path, rows=1000)
>>> store = FeatureStore(path)
>>> len(store.lookup(entity_id(7)))
64
>>> drop_index(path); len(store.lookup(entity_id(7))); create_index(path)
64
"""

from __future__ import annotations

import random
import sqlite3
import threading
from pathlib import Path

INDEX = "ix_features_entity"
QUERY = "SELECT embedding FROM features WHERE entity_id = ?"
SPAN_NAME = "SELECT features"  # the span the preprocess service wraps the query in
ROWS = 80_000  # a full scan of this many rows takes some 12 ms: a fault that hurts without swamping 2 cores


def entity_id(n: int) -> str:
    return f"user-{n:07d}"


def create(path: Path, rows: int = ROWS, seed: int = 7) -> None:
    """A features table of ``rows`` 64-byte embeddings, indexed by entity id."""
    rng = random.Random(seed)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE features (entity_id TEXT NOT NULL, embedding BLOB NOT NULL)")
        db.executemany("INSERT INTO features VALUES (?, ?)", ((entity_id(i), rng.randbytes(64)) for i in range(rows)))
        db.execute(f"CREATE INDEX {INDEX} ON features (entity_id)")
    db.close()


def drop_index(path: Path) -> None:
    """The fault: the index is gone, each lookup scans the whole table."""
    with sqlite3.connect(path, timeout=30) as db:
        db.execute(f"DROP INDEX IF EXISTS {INDEX}")
    db.close()


def create_index(path: Path) -> None:
    """The repair."""
    with sqlite3.connect(path, timeout=30) as db:
        db.execute(f"CREATE INDEX IF NOT EXISTS {INDEX} ON features (entity_id)")
    db.close()


class FeatureStore:
    """Lookups from many server threads: one connection per thread (sqlite3 connections are not shared)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()

    def lookup(self, entity: str) -> bytes:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite3.connect(self.path, timeout=30)
        row = db.execute(QUERY, (entity,)).fetchone()
        return row[0] if row else b""
