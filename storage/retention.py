"""Retention: raw spans and metric samples age out by arrival time, in small batches.

Latency windows, spikes and causes are kept (they are small), and so are the
spans of every trace a stored spike names as an exemplar. Deleting in batches
keeps each write transaction short, so ingest is never blocked for long.
Arrival time, not event time, decides: a replay of last year's capture is
kept as long as fresh data.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, Engine, Table, delete, literal_column, select

from storage import schema
from storage.reader import Reader

DELETE_BATCH = 5_000


@dataclass(slots=True)
class RetentionResult:
    spans: int = 0
    points: int = 0


def expire(engine: Engine, span_cutoff_s: int, point_cutoff_s: int, max_batches: int = 200) -> RetentionResult:
    """Delete spans that arrived before ``span_cutoff_s`` and points before ``point_cutoff_s``."""
    keep = Reader(engine).exemplar_trace_ids()
    spans = schema.spans
    span_filter = spans.c.ingested_at < span_cutoff_s
    if keep:
        span_filter = span_filter & spans.c.trace_id.not_in(keep)
    points = schema.metric_points
    return RetentionResult(
        spans=_delete_in_batches(engine, spans, span_filter, max_batches),
        points=_delete_in_batches(engine, points, points.c.ingested_at < point_cutoff_s, max_batches))


def _delete_in_batches(engine: Engine, table: Table, condition: ColumnElement[bool], max_batches: int) -> int:
    # The physical row address (SQLite rowid, PostgreSQL ctid) lets LIMIT bound each transaction.
    row = literal_column("rowid" if engine.dialect.name == "sqlite" else "ctid")
    total = 0
    for _ in range(max_batches):
        victims = select(row).select_from(table).where(condition).limit(DELETE_BATCH)
        with engine.begin() as conn:
            deleted = conn.execute(delete(table).where(row.in_(victims))).rowcount
        total += deleted
        if deleted < DELETE_BATCH:
            break
    return total
