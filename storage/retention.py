"""Retention: raw span blocks and metric samples age out by arrival time, in small batches.

Latency windows, spikes and causes are kept (they are small), and so are the
span blocks holding a trace that a stored spike names as an exemplar. Deleting in batches
keeps each write transaction short, so ingest is never blocked for long.
Arrival time, not event time, decides: a replay of last year's capture is
kept as long as fresh data.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, delete, literal_column, select

from storage import schema
from storage.reader import Reader

DELETE_BATCH = 5_000  # metric points per transaction
DELETE_BLOCKS = 200  # span blocks (up to a few hundred spans each) per transaction


@dataclass(slots=True)
class RetentionResult:
    spans: int = 0
    points: int = 0


def expire(engine: Engine, span_cutoff_s: int, point_cutoff_s: int, max_batches: int = 200) -> RetentionResult:
    """Delete span blocks that arrived before ``span_cutoff_s`` and points before ``point_cutoff_s``."""
    return RetentionResult(spans=_expire_blocks(engine, span_cutoff_s, max_batches),
                           points=_expire_points(engine, point_cutoff_s, max_batches))


def _expire_blocks(engine: Engine, cutoff_s: int, max_batches: int) -> int:
    b, t = schema.span_blocks, schema.trace_blocks
    keep = Reader(engine).exemplar_trace_ids()
    condition = b.c.ingested_at < cutoff_s
    if keep:  # a block holding an exemplar trace stays, with the other traces it holds
        condition = condition & b.c.id.not_in(select(t.c.block_id).where(t.c.trace_id.in_(keep)))
    spans = 0
    for _ in range(max_batches):
        with engine.begin() as conn:
            victims = conn.execute(select(b.c.id, b.c.span_count).where(condition).order_by(b.c.ingested_at)
                                   .limit(DELETE_BLOCKS)).all()
            if not victims:
                break
            ids = [v.id for v in victims]
            conn.execute(delete(t).where(t.c.block_id.in_(ids)))
            conn.execute(delete(schema.span_block_services).where(schema.span_block_services.c.block_id.in_(ids)))
            conn.execute(delete(b).where(b.c.id.in_(ids)))
        spans += sum(v.span_count for v in victims)
        if len(victims) < DELETE_BLOCKS:
            break
    return spans


def _expire_points(engine: Engine, cutoff_s: int, max_batches: int) -> int:
    # The physical row address (SQLite rowid, PostgreSQL ctid) lets LIMIT bound each transaction.
    p = schema.metric_points
    row = literal_column("rowid" if engine.dialect.name == "sqlite" else "ctid")
    total = 0
    for _ in range(max_batches):
        victims = select(row).select_from(p).where(p.c.ingested_at < cutoff_s).limit(DELETE_BATCH)
        with engine.begin() as conn:
            deleted = conn.execute(delete(p).where(row.in_(victims))).rowcount
        total += deleted
        if deleted < DELETE_BATCH:
            break
    return total
