"""The single batched writer: one transaction per batch, acknowledged after commit.

Spans are written as blocks (one per export request) plus one trace-index row
per (trace, block). A sender that retries after a lost answer stores its block
again; readers serve each (trace_id, span_id) once. Samples are identified by
(series, time) and stored once. Small lookup tables (operations, hosts,
series) are cached so that the hot path only inserts what is new; the caches
are bounded in bytes (the oldest entries are forgotten first, which costs no
more than a redundant upsert later).

An operation's ``first_seen_at`` is refreshed when it is seen again an hour
(``OPERATION_REFRESH_SECONDS``) or more after it was last recorded, so it says
when the operation was last recorded, to the hour: retention deletes the
operations whose spans stopped arriving (``spikehound/storage/retention.py``).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import sub
from typing import Any

import orjson
from sqlalchemy import Engine, String, Table, select
from sqlalchemy.dialects import postgresql, sqlite

from spikehound.model import Frame, LatencyWindow, MetricPoint, ProfileStack, Span, Spike
from spikehound.otlp import encode_spans
from spikehound.storage import schema
from spikehound.storage.cluster import FeedStamp, add_feed_row
from spikehound.units import NS

HOST_TOUCH_INTERVAL_NS = NS  # hosts.last_seen_at is refreshed at most once a second
TRACE_ID_BYTES = 16  # what decode_spans accepts and the trace index holds
OPERATION_REFRESH_SECONDS = 3600  # operations.first_seen_at is refreshed at most once an hour
CACHE_ENTRY_BYTES = 200  # a cache entry's memory besides its strings: key tuple, value, dict slot
CACHE_MAX_BYTES = {"operations": 32 * 2**20, "series": 16 * 2**20, "host_touched": 4 * 2**20}


@dataclass(slots=True, frozen=True)
class SpanBlock:
    """One export request as stored: its OTLP encoding and what the writer needs of the spans it holds.

    The spans themselves are not kept: a decoded span is eight of Python's small objects (about 580 bytes in
    its arenas), and the ingest queue, filled in a storage or detection stall, holds up to
    ``collector.queue_capacity`` (200,000) of them. Python never gives back an arena that still holds one
    live object, so a stall that filled it left the collector's RSS higher for good. What is kept here is a
    few objects a block (``benchmarks/arena_bursts.py``: 1 MB of arenas for 100,000 queued spans, 53 before).

    >>> from spikehound.model import Span, SpanKind, StatusCode
    >>> def span(trace, name, start, end):
    ...     return Span(trace_id=trace * 16, span_id=b"s" * 8, parent_span_id=None, service="gw", host="h1",
    ...                 name=name, kind=SpanKind.SERVER, start_unix_nano=start, end_unix_nano=end,
    ...                 status=StatusCode.OK)
    >>> block = SpanBlock.of(b"...", [span(b"a", "GET /", 10, 50), span(b"b", "GET /", 20, 25)])
    >>> block.span_count, block.start_ns, block.end_ns, block.max_duration_ns, sorted(block.operations)
    (2, 10, 50, 40, [('gw', 'GET /')])
    >>> sorted(block.trace_id_list())
    [b'aaaaaaaaaaaaaaaa', b'bbbbbbbbbbbbbbbb']
    """

    payload: bytes  # ExportTraceServiceRequest with exactly the spans described
    span_count: int
    start_ns: int
    end_ns: int
    max_start_ns: int
    max_duration_ns: int
    services: frozenset[str]
    operations: frozenset[tuple[str, str]]  # (service, name)
    hosts: frozenset[str]
    trace_ids: bytes  # the distinct trace ids, TRACE_ID_BYTES each, end to end: one object, not one an id

    @classmethod
    def of(cls, payload: bytes, spans: Sequence[Span]) -> SpanBlock:
        """The block of ``spans`` (at least one) encoded as ``payload`` (encoded here when empty).

        A few tight passes (comprehensions on slots, ``min``/``max``/``map`` in C): this runs for every span on
        the ingest hot path.
        """
        starts, ends = [s.start_unix_nano for s in spans], [s.end_unix_nano for s in spans]
        trace_ids = {s.trace_id for s in spans}
        if any(len(t) != TRACE_ID_BYTES for t in trace_ids):
            raise ValueError(f"a stored span's trace id is {TRACE_ID_BYTES} bytes")
        return cls(payload or encode_spans(spans).SerializeToString(), len(spans), min(starts), max(ends),
                   max(starts), max(map(sub, ends, starts)),
                   frozenset({s.service for s in spans}), frozenset({(s.service, s.name) for s in spans}),
                   frozenset({s.host for s in spans if s.host}), b"".join(trace_ids))

    def trace_id_list(self) -> list[bytes]:
        """The block's distinct trace ids."""
        ids, n = self.trace_ids, TRACE_ID_BYTES
        return [ids[i:i + n] for i in range(0, len(ids), n)]

    def service_rows(self, block_id: int) -> list[dict[str, Any]]:
        """One ``span_block_services`` row per service, with the block's range (a search decodes and filters)."""
        return [{"block_id": block_id, "service": service, "min_start_ns": self.start_ns,
                 "max_start_ns": self.max_start_ns, "max_duration_ns": self.max_duration_ns}
                for service in sorted(self.services)]


@dataclass(slots=True)
class WriteBatch:
    """Everything one transaction commits.

    ``spans`` are stored as ``blocks``; without blocks they are encoded into one. With blocks, ``spans`` are
    the same spans where somebody in this process still reads them after the commit, else empty (see
    :class:`SpanBlock`).
    """

    spans: Sequence[Span] = ()
    blocks: Sequence[SpanBlock] = ()
    points: Sequence[MetricPoint] = ()
    windows: Sequence[LatencyWindow] = ()
    spikes: Sequence[Spike] = ()
    # A member of a cluster stamps each batch with its next feed number: the feed row is committed with it.
    feed: FeedStamp | None = None

    def __len__(self) -> int:
        return self.span_count + len(self.points)

    @property
    def span_count(self) -> int:
        return sum(b.span_count for b in self.blocks) if self.blocks else len(self.spans)


def _fit(value: str, limit: int | None) -> str:
    """What a text column can hold: PostgreSQL refuses NUL characters and strings longer than a VARCHAR.

    Senders choose service, host and span names; one odd name must not fail the batch it came in.
    """
    return value.replace("\x00", "\ufffd")[:limit]


def _fits(value: str | None, limit: int | None) -> bool:
    return value is None or ((limit is None or len(value) <= limit) and "\x00" not in value)


def _fit_rows(table: Table, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fit every text value of ``rows`` to ``table``'s columns (rows are changed in place)."""
    limits = {c.name: c.type.length for c in table.columns if isinstance(c.type, String)}
    for row in rows:
        for name, limit in limits.items():
            value = row.get(name)
            if not _fits(value, limit):
                row[name] = _fit(value, limit)
    return rows


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()


def frames_json(frames: Sequence[Frame]) -> str:
    """A stack as stored: ``[[function, file, line], ...]``, root first (PostgreSQL refuses NUL characters)."""
    return orjson.dumps([[_fit(fn, None), _fit(file, None), line] for fn, file, line in frames]).decode()


def stack_digest(frames_text: str) -> bytes:
    """What identifies a stored stack: 16 bytes of BLAKE2b over its JSON."""
    return hashlib.blake2b(frames_text.encode(), digest_size=16).digest()


class BoundedCache:
    """A dict bounded by an estimate of its memory: strings of the key count by length; the oldest go first.

    >>> cache = BoundedCache(max_bytes=2 * CACHE_ENTRY_BYTES + 10)
    >>> cache.update({("svc", "a"): 1, ("svc", "b"): 2, ("svc", "c"): 3})
    >>> list(cache.entries), cache.evicted
    ([('svc', 'b'), ('svc', 'c')], 1)
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evicted = 0
        # Evicted from the front: an OrderedDict finds its first key at once where a plain dict scans.
        self.entries: OrderedDict[Hashable, int] = OrderedDict()

    def get(self, key: Hashable) -> int | None:
        return self.entries.get(key)

    def update(self, items: dict[Any, int]) -> None:
        entries = self.entries
        for key, value in items.items():
            if key not in entries:
                self.bytes += _entry_bytes(key)
            entries[key] = value
        while self.bytes > self.max_bytes and entries:
            key, _ = entries.popitem(last=False)
            self.bytes -= _entry_bytes(key)
            self.evicted += 1


def _entry_bytes(key: Any) -> int:
    if isinstance(key, str):
        return CACHE_ENTRY_BYTES + len(key)
    return CACHE_ENTRY_BYTES + sum(len(part) for part in key if isinstance(part, str))


@dataclass(slots=True)
class _Caches:
    """What one transaction adds to the writer's caches (merged into them once it committed)."""

    operations: dict[tuple[str, str], int] = field(default_factory=dict)  # -> arrival second last recorded
    series: dict[tuple[str, str, str], int] = field(default_factory=dict)  # -> metric_series.id
    host_touched: dict[str, int] = field(default_factory=dict)  # -> arrival ns last recorded


class Writer:
    """Commits batches to the database; not thread-safe: use it from one thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        dialect = engine.dialect.name
        self._cache = {name: BoundedCache(size) for name, size in CACHE_MAX_BYTES.items()}
        # One statement for a batch's blocks, ids in the blocks' order: on PostgreSQL a statement a block was a
        # round trip each, the writer's largest wait.
        self._block = schema.span_blocks.insert().returning(schema.span_blocks.c.id, sort_by_parameter_order=True)
        # One index row per (trace, block), no per-row Core processing: on SQLite a DB-API executemany on tuples
        # (statements in-process cost little); on PostgreSQL one statement over two arrays, which the server
        # takes as one execution instead of one per row (a few hundred a commit).
        self._index_as_arrays = dialect == "postgresql"
        self._trace_block_sql = (
            "INSERT INTO trace_blocks (trace_id, block_id) SELECT * FROM unnest(%s::bytea[], %s::bigint[]) "
            "ON CONFLICT DO NOTHING" if self._index_as_arrays else
            "INSERT INTO trace_blocks (trace_id, block_id) VALUES (?, ?) ON CONFLICT DO NOTHING")
        operations = upsert(engine, schema.operations)
        self._operations = operations.on_conflict_do_update(
            index_elements=["service", "name"], set_={"first_seen_at": operations.excluded.first_seen_at})
        self._points = upsert(engine, schema.metric_points).on_conflict_do_nothing()
        self._series = upsert(engine, schema.metric_series).on_conflict_do_nothing()
        hosts = upsert(engine, schema.hosts)
        self._hosts = hosts.on_conflict_do_update(index_elements=["host"],
                                                  set_={"last_seen_at": hosts.excluded.last_seen_at})
        windows = upsert(engine, schema.latency_windows)
        self._windows = windows.on_conflict_do_update(
            index_elements=["service", "operation", "peer_service", "start_ns"],
            set_={c: windows.excluded[c] for c in ("end_ns", "count", "p50_ns", "p95_ns", "p99_ns", "max_ns")})
        self._profile_stacks = upsert(engine, schema.profile_stacks).on_conflict_do_nothing()
        self._profile_samples = upsert(engine, schema.profile_samples).on_conflict_do_nothing()
        spikes = upsert(engine, schema.spikes)
        self._spikes = spikes.on_conflict_do_update(
            index_elements=["id"],
            set_={c: spikes.excluded[c] for c in ("service", "operation", "peer_service", "state", "end_ns",
                                                  "p99_ns", "baseline_p99_ns", "exemplar_trace_ids", "detected_ns",
                                                  "recurrence_of", "occurrence", "first_start_ns")})

    def write(self, batch: WriteBatch, now_ns: int | None = None) -> None:
        """Commit the batch in one transaction, or raise and commit nothing."""
        now_ns = now_ns or time.time_ns()
        now_s = now_ns // NS
        pending = _Caches()
        with self.engine.begin() as conn:
            blocks = batch.blocks or ([SpanBlock.of(b"", batch.spans)] if batch.spans else [])
            block_ids = self._write_spans(conn, blocks, now_s, pending) if blocks else []
            if batch.points:
                self._write_points(conn, batch.points, now_s, pending)
            if batch.feed is not None and (block_ids or batch.points):
                add_feed_row(conn, batch.feed, block_ids, batch.points)
            hosts = {p.host for p in batch.points}.union(*(b.hosts for b in blocks))
            touched = self._cache["host_touched"]
            touch = [{"host": h, "last_seen_at": now_ns} for h in sorted(hosts)
                     if now_ns - (touched.get(h) or 0) >= HOST_TOUCH_INTERVAL_NS]
            if touch:
                conn.execute(self._hosts, _fit_rows(schema.hosts, [dict(t) for t in touch]))
                pending.host_touched.update((t["host"], now_ns) for t in touch)
            self.write_detection(conn, batch.windows, batch.spikes)
        # Only committed rows may enter the caches, or a rolled-back insert would be skipped forever.
        self._cache["operations"].update(pending.operations)
        self._cache["series"].update(pending.series)
        self._cache["host_touched"].update(pending.host_touched)

    def write_detection(self, conn: Any, windows: Sequence[LatencyWindow], spikes: Sequence[Spike]) -> None:
        """Closed windows and spike states on ``conn``, in the caller's transaction (a cluster's leader writes
        them in its own, which first checks it still leads)."""
        if windows:
            conn.execute(self._windows, _fit_rows(schema.latency_windows, [_window_row(w) for w in windows]))
        if spikes:
            self._write_spikes(conn, spikes)

    def write_profiles(self, stacks: Sequence[ProfileStack], now_ns: int | None = None) -> None:
        """Commit sampling profiles in one transaction, or raise and commit nothing.

        Each distinct stack is stored once (by the digest of its frames); a (process, window, stack) already
        stored, as when an agent retries an export whose answer was lost, is kept as it was.
        """
        if not stacks:
            return
        now_s = (now_ns or time.time_ns()) // NS
        texts = {s.frames: frames_json(s.frames) for s in stacks}
        digests = {frames: stack_digest(text) for frames, text in texts.items()}
        with self.engine.begin() as conn:
            conn.execute(self._profile_stacks, [{"digest": digests[f], "frames": t} for f, t in texts.items()])
            st = schema.profile_stacks
            ids = dict(conn.execute(select(st.c.digest, st.c.id).where(st.c.digest.in_(set(digests.values())))).all())
            rows = [{"stack_id": ids[digests[s.frames]], "host": s.host, "service": s.service, "pid": s.pid,
                     "process": s.process, "kind": s.kind, "start_ns": s.start_unix_nano, "end_ns": s.end_unix_nano,
                     "period_ns": s.period_ns, "samples": s.samples, "ingested_at": now_s} for s in stacks]
            conn.execute(self._profile_samples, _fit_rows(schema.profile_samples, rows))

    def _write_spans(self, conn: Any, blocks: Sequence[SpanBlock], now_s: int, pending: _Caches) -> list[int]:
        """Write the span blocks; their ids, in order."""
        recorded, due = self._cache["operations"].entries.get, now_s - OPERATION_REFRESH_SECONDS
        fresh = pending.operations
        for block in blocks:
            for op in block.operations:
                last = recorded(op)
                if (last is None or last <= due) and op not in fresh:
                    fresh[op] = now_s
        if fresh:
            rows = _fit_rows(schema.operations, [{"service": service, "name": name, "first_seen_at": now_s}
                                                 for service, name in fresh])
            # Names that differ only past the column's width are one row; sorted, so that collectors sharing
            # a PostgreSQL lock the rows of one batch in the same order.
            unique = {(r["service"], r["name"]): r for r in rows}
            conn.execute(self._operations, [unique[k] for k in sorted(unique)])
        block_ids: list[int] = list(conn.execute(self._block, [{
            "ingested_at": now_s, "span_count": block.span_count, "start_ns": block.start_ns,
            "end_ns": block.end_ns, "payload": block.payload} for block in blocks]).scalars())
        index_rows: list[tuple[bytes, int]] = []
        service_rows: list[dict[str, Any]] = []
        for block, block_id in zip(blocks, block_ids, strict=True):
            index_rows.extend((trace_id, block_id) for trace_id in block.trace_id_list())
            service_rows += block.service_rows(block_id)
        if self._index_as_arrays:
            conn.exec_driver_sql(self._trace_block_sql, ([t for t, _ in index_rows], [b for _, b in index_rows]))
        else:
            conn.exec_driver_sql(self._trace_block_sql, index_rows)
        conn.execute(schema.span_block_services.insert(), _fit_rows(schema.span_block_services, service_rows))
        return block_ids

    def _write_points(self, conn: Any, points: Sequence[MetricPoint], now_s: int, pending: _Caches) -> None:
        rows = []
        series_of = self._cache["series"].entries.get
        for p in points:
            attrs = _json(p.attributes)
            key = (p.host, p.name, attrs)
            sid = series_of(key) or pending.series.get(key)
            if sid is None:
                sid = pending.series[key] = self._series_id(conn, p, attrs)
            rows.append({"series_id": sid, "t_ns": p.time_unix_nano, "value": p.value, "ingested_at": now_s})
        conn.execute(self._points, rows)

    def _series_id(self, conn: Any, p: MetricPoint, attrs: str) -> int:
        t = schema.metric_series
        (row,) = _fit_rows(t, [{"host": p.host, "name": p.name, "attributes": attrs, "kind": int(p.kind),
                                "unit": p.unit}])
        conn.execute(self._series, row)
        return conn.execute(select(t.c.id).where(t.c.host == row["host"], t.c.name == row["name"],
                                                 t.c.attributes == row["attributes"])).scalar_one()

    def _write_spikes(self, conn: Any, spikes: Sequence[Spike]) -> None:
        # One row per spike: a batch may carry several states of one (detector steps since the last commit,
        # a catch-up closing many windows at once); the latest, last in the batch, is the one to keep.
        spikes = list({s.id: s for s in spikes}.values())
        conn.execute(self._spikes, _fit_rows(schema.spikes, [{
            "id": s.id, "service": s.service, "operation": s.operation, "state": s.state,
            "start_ns": s.start_unix_nano, "end_ns": s.end_unix_nano, "p99_ns": s.p99_ns,
            "baseline_p99_ns": s.baseline_p99_ns,
            "exemplar_trace_ids": _json([t.hex() for t in s.exemplar_trace_ids]),
            "detected_ns": s.detected_unix_nano, "peer_service": s.peer_service,
            "recurrence_of": s.recurrence_of, "occurrence": s.occurrence, "first_start_ns": s.first_start_unix_nano,
        } for s in spikes]))
        ids = [s.id for s in spikes]
        # Streams join a spike and causes are re-ranked while it lasts: replace both as a whole.
        conn.execute(schema.spike_streams.delete().where(schema.spike_streams.c.spike_id.in_(ids)))
        stream_rows = [{
            "spike_id": s.id, "rank": rank, "service": a.service, "operation": a.operation,
            "peer_service": a.peer_service, "start_ns": a.start_unix_nano,
            "last_anomalous_end_ns": a.last_anomalous_end_unix_nano, "p99_ns": a.p99_ns,
            "baseline_p99_ns": a.baseline_p99_ns, "evidence": a.evidence, "slow_requests": a.slow_requests,
        } for s in spikes for rank, a in enumerate(s.affected)]
        if stream_rows:
            conn.execute(schema.spike_streams.insert(), _fit_rows(schema.spike_streams, stream_rows))
        conn.execute(schema.causes.delete().where(schema.causes.c.spike_id.in_(ids)))
        cause_rows = [{
            "spike_id": s.id, "rank": rank, "kind": str(c.kind), "service": c.service, "operation": c.operation,
            "peer_service": c.peer_service, "host": c.host, "resource": c.resource, "score": c.score,
            "baseline": c.baseline, "observed": c.observed, "unit": c.unit, "summary": c.summary,
        } for s in spikes for rank, c in enumerate(s.causes)]
        if cause_rows:
            conn.execute(schema.causes.insert(), _fit_rows(schema.causes, cause_rows))


def upsert(engine: Engine, table: Table) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_update`` / ``on_conflict_do_nothing``."""
    return (sqlite.insert if engine.dialect.name == "sqlite" else postgresql.insert)(table)


def _window_row(w: LatencyWindow) -> dict[str, Any]:
    return {"service": w.service, "operation": w.operation, "peer_service": w.peer_service or "",
            "start_ns": w.start_unix_nano,
            "end_ns": w.end_unix_nano, "count": w.count, "p50_ns": w.p50_ns, "p95_ns": w.p95_ns,
            "p99_ns": w.p99_ns, "max_ns": w.max_ns}
