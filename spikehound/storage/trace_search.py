"""Trace search and the service dependency graph over stored span blocks (behind the Jaeger query API, which
calls them through ``spikehound.storage.reader.Reader``).

A search names a service and a range of span start times; ``span_block_services`` (indexed by service and
latest start) gives the blocks that hold spans of that service in the range, and with ``min_duration_ns`` only
blocks whose longest such span is long enough. Those blocks are decoded newest first until ``limit`` traces
match or ``max_scanned_spans`` spans were read, so a search never reads the whole store: with a filter that
almost nothing matches, it answers from the newest part of the range.

The dependency graph counts, per (parent service, child service), the spans whose parent span belongs to
another service, over the newest ``max_spans`` spans whose blocks end in the range (the ``end_ns`` index).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, Result, Select, select

from spikehound.model import Span
from spikehound.otlp import decode_spans, parse_trace_request
from spikehound.storage import schema

MAX_SCANNED_SPANS = 1_000_000  # about a second of decoding: the most one search reads
MAX_DEPENDENCY_SPANS = 200_000  # spans held in memory while the dependency graph is computed
FETCH_BLOCKS = 32  # blocks per round trip while scanning


@dataclass(frozen=True, slots=True)
class TraceQuery:
    """What a trace search asks for: traces with a span of ``service`` matching every given condition."""

    service: str
    start_ns: int  # span start time, inclusive
    end_ns: int  # span start time, inclusive
    operation: str | None = None
    min_duration_ns: int | None = None
    max_duration_ns: int | None = None
    limit: int = 100
    # Further conditions on a candidate span (the API's tag filter); every one must hold.
    conditions: tuple[Callable[[Span], bool], ...] = field(default=())

    def matches(self, s: Span) -> bool:
        if s.service != self.service or not self.start_ns <= s.start_unix_nano <= self.end_ns:
            return False
        if self.operation is not None and s.name != self.operation:
            return False
        duration = s.duration_ns
        if self.min_duration_ns is not None and duration < self.min_duration_ns:
            return False
        if self.max_duration_ns is not None and duration > self.max_duration_ns:
            return False
        return all(condition(s) for condition in self.conditions)


@contextmanager
def _streamed(conn: Connection, query: Select[Any]) -> Iterator[Result[Any]]:
    """Rows fetched a few blocks at a time (a server-side cursor on PostgreSQL), closed even when left early."""
    result = conn.execution_options(yield_per=FETCH_BLOCKS).execute(query)
    try:
        yield result
    finally:
        result.close()


def _spans(payload: bytes) -> list[Span]:
    return decode_spans(parse_trace_request(bytes(payload))).spans


def find_trace_ids(engine: Engine, query: TraceQuery, max_scanned_spans: int = MAX_SCANNED_SPANS) -> list[bytes]:
    """Ids of traces matching ``query``, the one with the latest matching span first, at most ``query.limit``."""
    t, b = schema.span_block_services, schema.span_blocks
    where = [t.c.service == query.service, t.c.max_start_ns >= query.start_ns, t.c.min_start_ns <= query.end_ns]
    if query.min_duration_ns is not None:
        where.append(t.c.max_duration_ns >= query.min_duration_ns)
    blocks = (select(b.c.payload, b.c.span_count).join(t, t.c.block_id == b.c.id).where(*where)
              .order_by(t.c.max_start_ns.desc(), t.c.block_id.desc()))
    latest: dict[bytes, int] = {}  # trace id -> start of its latest matching span
    scanned = 0
    with engine.connect() as conn, _streamed(conn, blocks) as rows:
        for payload, span_count in rows:
            for s in _spans(payload):
                if query.matches(s) and s.start_unix_nano > latest.get(s.trace_id, -1):
                    latest[s.trace_id] = s.start_unix_nano
            scanned += span_count
            if len(latest) >= query.limit or scanned >= max_scanned_spans:
                break
    return sorted(latest, key=lambda trace_id: (latest[trace_id], trace_id), reverse=True)[:query.limit]


def traces(engine: Engine, trace_ids: Iterable[bytes]) -> dict[bytes, list[Span]]:
    """The spans of several traces, each oldest first, decoding every block they share once.

    A span stored twice (a retried export) is served once; unknown ids are left out.
    """
    wanted = set(trace_ids)
    if not wanted:
        return {}
    t, b = schema.trace_blocks, schema.span_blocks
    out: dict[bytes, dict[bytes, Span]] = {}
    with engine.connect() as conn:
        block_ids = conn.execute(select(t.c.block_id).where(t.c.trace_id.in_(wanted)).distinct()).scalars().all()
        for (payload,) in conn.execute(select(b.c.payload).where(b.c.id.in_(block_ids)).order_by(b.c.id)):
            for s in _spans(payload):
                if s.trace_id in wanted:
                    out.setdefault(s.trace_id, {}).setdefault(s.span_id, s)
    return {trace_id: sorted(spans.values(), key=lambda s: (s.start_unix_nano, s.span_id))
            for trace_id, spans in out.items()}


def dependencies(engine: Engine, since_ns: int, until_ns: int,
                 max_spans: int = MAX_DEPENDENCY_SPANS) -> list[tuple[str, str, int]]:
    """``(parent service, child service, calls)`` for spans starting in the range whose parent is elsewhere.

    Counted over the newest ``max_spans`` spans of blocks that end in the range; a span whose parent is
    not among them (its trace began earlier) is not counted.
    """
    b = schema.span_blocks
    blocks = (select(b.c.payload).where(b.c.end_ns >= since_ns, b.c.start_ns <= until_ns)
              .order_by(b.c.end_ns.desc()))
    # Keyed by trace id + span id (span ids are unique within a trace only): a span stored twice counts once.
    service_of: dict[bytes, str] = {}
    parent_of: dict[bytes, tuple[bytes, str]] = {}
    with engine.connect() as conn, _streamed(conn, blocks) as rows:
        for (payload,) in rows:
            for s in _spans(payload):
                if since_ns <= s.start_unix_nano <= until_ns:
                    service_of[s.trace_id + s.span_id] = s.service
                    if s.parent_span_id is not None:
                        parent_of[s.trace_id + s.span_id] = (s.trace_id + s.parent_span_id, s.service)
            if len(service_of) >= max_spans:
                break
    calls: Counter[tuple[str, str]] = Counter()
    for parent, child_service in parent_of.values():
        parent_service = service_of.get(parent)
        if parent_service is not None and parent_service != child_service:
            calls[(parent_service, child_service)] += 1
    return [(parent, child, n) for (parent, child), n in sorted(calls.items())]
