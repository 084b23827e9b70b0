"""Every read query of the REST API, the Jaeger API and the web pages (but the alert tables', in
``spikehound.storage.alerts``): :class:`Reader`, each query served by an index of ``spikehound.storage.schema``.

Methods return model records or small plain tuples; the API turns them into
JSON, the pages into HTML. They are synchronous (the collector runs them in a
thread pool). Trace search and the dependency graph scan span blocks in
``spikehound.storage.trace_search``; the Reader is their interface too.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Connection, Engine, and_, func, or_, select

from spikehound.model import (
    AffectedStream,
    Cause,
    CauseKind,
    LatencyWindow,
    MetricKind,
    MetricPoint,
    ProfileStack,
    Span,
    Spike,
)
from spikehound.otlp import spans_of_block, spans_of_trace
from spikehound.storage import schema, trace_search
from spikehound.storage.resolved_spikes import ResolvedSpikes
from spikehound.storage.trace_search import MAX_DEPENDENCY_SPANS, MAX_SCANNED_SPANS, TraceQuery
from spikehound.units import NS

MAX_TRACE_SPANS = 100_000  # a runaway trace must not take the API down with it
MAX_PROFILE_ROWS = 200_000  # (process, window, stack) rows one profile read may bring back
_STREAM_ROWS = 5000  # rows a streamed read holds at once
_FRAMES_CHUNK = 200  # stacks' frames read at once: 256 frames of JSON each, a megabyte or two
_FRAMES_CACHE = -2048  # KiB of SQLite page cache while a diff reads stacks' frames
# The longest profile window a read looks back for (the agent's are 10 s): it bounds the index range a read
# scans to the period asked for, instead of every older window of the service or host.
MAX_PROFILE_WINDOW_NS = 600 * NS


@contextmanager
def _small_cache(conn: Connection) -> Iterator[None]:
    """A diff passes hundreds of MB of profile rows and stacks through once: in SQLite's page cache
    (storage/engine.py: 64 MiB a connection) they would only displace the hot index pages and hold that much memory
    per connection, so its reads keep the connection's cache small and restore it after."""
    if conn.dialect.name != "sqlite":
        yield
        return
    cache = conn.exec_driver_sql("PRAGMA cache_size").scalar()
    conn.exec_driver_sql(f"PRAGMA cache_size={_FRAMES_CACHE}")
    try:
        yield
    finally:
        conn.exec_driver_sql(f"PRAGMA cache_size={int(cache)}")


class ProfileRow(NamedTuple):
    """One (process, window, stack) row of a profile read, its stack by number (:meth:`Reader.stack_frames`)."""

    stack_id: int
    host: str
    service: str
    pid: int
    process: str
    kind: str
    start_ns: int
    end_ns: int
    samples: int
    period_ns: int


@dataclass(slots=True, frozen=True)
class HostSummary:
    host: str
    last_seen_unix_nano: int
    metrics: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class MetricSeries:
    host: str
    name: str
    attributes: dict[str, Any]
    unit: str
    points: tuple[tuple[int, float], ...]  # (time ns, value), oldest first


@dataclass(slots=True, frozen=True)
class KindedSeries:
    """One stored metric series with its kind and its points in a range, oldest first (the pages' charts)."""

    host: str
    name: str
    attributes: dict[str, Any]
    kind: MetricKind
    unit: str
    points: tuple[tuple[int, float], ...]  # (time ns, value)


class Reader:
    """Queries over one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._resolved: ResolvedSpikes[Spike] = ResolvedSpikes()

    def trace(self, trace_id: bytes) -> list[Span]:
        """Every span of a trace, oldest first; a span stored twice (a retried export) is served once."""
        b, t = schema.span_blocks, schema.trace_blocks
        query = (select(b.c.payload).join(t, t.c.block_id == b.c.id)
                 .where(t.c.trace_id == trace_id).order_by(b.c.id))
        seen: set[bytes] = set()
        spans: list[Span] = []
        with self.engine.connect() as conn:
            for (payload,) in conn.execute(query):
                for span in spans_of_trace(bytes(payload), trace_id):
                    if span.span_id not in seen and len(spans) < MAX_TRACE_SPANS:
                        seen.add(span.span_id)
                        spans.append(span)
        spans.sort(key=lambda s: (s.start_unix_nano, s.span_id))
        return spans

    def services(self) -> list[tuple[str, list[str]]]:
        o = schema.operations
        out: dict[str, list[str]] = {}
        with self.engine.connect() as conn:
            for service, name in conn.execute(select(o.c.service, o.c.name).order_by(o.c.service, o.c.name)):
                out.setdefault(service, []).append(name)
        return list(out.items())

    def latency(self, service: str, operation: str | None, since_ns: int, until_ns: int,
                limit: int = 10_000, peer_service: str | None = None) -> list[LatencyWindow]:
        """Windows of ``service``'s entry streams, or with ``peer_service`` of the hops from it into ``service``."""
        w = schema.latency_windows
        conditions = [w.c.service == service, w.c.start_ns >= since_ns, w.c.start_ns < until_ns,
                      w.c.peer_service == (peer_service or "")]
        if operation is not None:
            conditions.append(w.c.operation == operation)
        query = select(w).where(and_(*conditions)).order_by(w.c.start_ns, w.c.operation).limit(limit)
        with self.engine.connect() as conn:
            return [window_of(r) for r in conn.execute(query)]

    def hosts(self) -> list[HostSummary]:
        h, m = schema.hosts, schema.metric_series
        with self.engine.connect() as conn:
            names: dict[str, list[str]] = {}
            for host, name in conn.execute(select(m.c.host, m.c.name).distinct().order_by(m.c.host, m.c.name)):
                names.setdefault(host, []).append(name)
            return [HostSummary(r.host, r.last_seen_at, tuple(names.get(r.host, ())))
                    for r in conn.execute(select(h).order_by(h.c.host))]

    def metrics(self, host: str | None, name: str | None, since_ns: int, until_ns: int,
                max_points: int = 20_000) -> tuple[list[MetricSeries], bool]:
        """Series matching host and/or name with their points in the range; True when cut at max_points."""
        m, p = schema.metric_series, schema.metric_points
        series_query = select(m).order_by(m.c.host, m.c.name, m.c.attributes)
        if host is not None:
            series_query = series_query.where(m.c.host == host)
        if name is not None:
            series_query = series_query.where(m.c.name == name)
        out: list[MetricSeries] = []
        budget = max_points
        with self.engine.connect() as conn:
            for row in conn.execute(series_query).all():
                # With the budget spent, the query still asks for one point: only a point left out truncates.
                points = conn.execute(
                    select(p.c.t_ns, p.c.value)
                    .where(p.c.series_id == row.id, p.c.t_ns >= since_ns, p.c.t_ns < until_ns)
                    .order_by(p.c.t_ns).limit(budget + 1)).all()
                truncated = len(points) > budget
                points = points[:budget]
                budget -= len(points)
                if points:
                    out.append(MetricSeries(row.host, row.name, orjson.loads(row.attributes), row.unit,
                                            tuple((t, v) for t, v in points)))
                if truncated:
                    return out, True
        return out, False

    def spikes(self, service: str | None = None, since_ns: int | None = None, until_ns: int | None = None,
               state: str | None = None, limit: int = 500) -> list[Spike]:
        k = schema.spikes
        query = select(k).order_by(k.c.start_ns.desc(), k.c.id.desc()).limit(limit)
        if service is not None:  # the service leads the spike or is one of the streams it moved
            moved = select(schema.spike_streams.c.spike_id).where(schema.spike_streams.c.service == service)
            query = query.where(or_(k.c.service == service, k.c.id.in_(moved)))
        if since_ns is not None:
            query = query.where(k.c.start_ns >= since_ns)
        if until_ns is not None:
            query = query.where(k.c.start_ns < until_ns)
        if state is not None:
            query = query.where(k.c.state == state)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
            return self._with_causes(conn, rows)

    def spike(self, spike_id: str) -> Spike | None:
        k = schema.spikes
        with self.engine.connect() as conn:
            rows = conn.execute(select(k).where(k.c.id == spike_id)).all()
            found = self._with_causes(conn, rows)
        return found[0] if found else None

    def exemplar_trace_ids(self) -> set[bytes]:
        """Every trace a stored spike points to (retention keeps these)."""
        with self.engine.connect() as conn:
            return {bytes.fromhex(t) for (ids,) in conn.execute(select(schema.spikes.c.exemplar_trace_ids))
                    for t in orjson.loads(ids)}

    def spikes_by_top_cause_kind(self) -> dict[str, int]:
        """How many spikes are stored per kind of their top-ranked cause; ``none`` for spikes without causes.

        One pass over ``spikes`` (a small table) joined to ``causes`` through its primary key.
        """
        k, c = schema.spikes, schema.causes
        kind = func.coalesce(c.c.kind, "none")
        query = (select(kind, func.count()).select_from(k.outerjoin(c, and_(c.c.spike_id == k.c.id, c.c.rank == 0)))
                 .group_by(kind))
        with self.engine.connect() as conn:
            return {str(name): int(n) for name, n in conn.execute(query)}

    def _with_causes(self, conn: Any, rows: Sequence[Any]) -> list[Spike]:
        """The spikes of ``rows`` with their causes and streams; resolved ones as built before when their stamp
        is the same (:mod:`spikehound.storage.resolved_spikes`)."""
        if not rows:
            return []
        resolved = [r.id for r in rows if r.state == "resolved"]
        stamps = self._resolved_stamps(conn, resolved) if resolved else {}
        kept = {r.id: spike for r in rows if r.id in stamps
                and (spike := self._resolved.get((tuple(r), stamps[r.id]))) is not None}
        built = {spike.id: spike for spike in self._build_spikes(conn, [r for r in rows if r.id not in kept])}
        for r in rows:
            if r.id in stamps and r.id in built:
                self._resolved.put((tuple(r), stamps[r.id]), built[r.id])
        return [kept.get(r.id) or built[r.id] for r in rows]

    @staticmethod
    def _resolved_stamps(conn: Any, ids: list[str]) -> dict[str, tuple[Any, ...]]:
        """Per spike, what the database sums up of its stream and cause rows (counts, sums, the latest end): a
        spike written again with other figures has another stamp."""
        c, a = schema.causes, schema.spike_streams
        stamps: dict[str, tuple[Any, ...]] = {i: () for i in ids}
        for spike_id, *figures in conn.execute(
                select(a.c.spike_id, func.count(), func.sum(a.c.slow_requests), func.sum(a.c.evidence),
                       func.max(a.c.last_anomalous_end_ns), func.sum(a.c.p99_ns))
                .where(a.c.spike_id.in_(ids)).group_by(a.c.spike_id)).all():
            stamps[spike_id] += tuple(figures)
        for spike_id, *figures in conn.execute(
                select(c.c.spike_id, func.count(), func.sum(c.c.score), func.sum(c.c.baseline), func.sum(c.c.observed),
                       func.sum(func.length(c.c.summary)))
                .where(c.c.spike_id.in_(ids)).group_by(c.c.spike_id)).all():
            stamps[spike_id] += ("causes", *figures)
        return stamps

    @staticmethod
    def _build_spikes(conn: Any, rows: Sequence[Any]) -> list[Spike]:
        if not rows:
            return []
        c, a = schema.causes, schema.spike_streams
        ids = [r.id for r in rows]
        # Plain tuples, fetched at once: the spike list reads a thousand stream rows, and a Row's attribute
        # lookups (and a fetch per row) were most of its time.
        causes: dict[str, list[Cause]] = {}
        for spike_id, kind, score, summary, service, operation, peer, host, resource, baseline, observed, unit in (
                conn.execute(select(c.c.spike_id, c.c.kind, c.c.score, c.c.summary, c.c.service, c.c.operation,
                                    c.c.peer_service, c.c.host, c.c.resource, c.c.baseline, c.c.observed, c.c.unit)
                             .where(c.c.spike_id.in_(ids)).order_by(c.c.spike_id, c.c.rank)).all()):
            causes.setdefault(spike_id, []).append(Cause(
                kind=CauseKind(kind), score=score, summary=summary, service=service, operation=operation,
                peer_service=peer, host=host, resource=resource, baseline=baseline, observed=observed, unit=unit))
        affected: dict[str, list[AffectedStream]] = {}
        for spike_id, service, operation, peer, start, last_end, p99, baseline_p99, evidence, slow in (
                conn.execute(select(a.c.spike_id, a.c.service, a.c.operation, a.c.peer_service, a.c.start_ns,
                                    a.c.last_anomalous_end_ns, a.c.p99_ns, a.c.baseline_p99_ns, a.c.evidence,
                                    a.c.slow_requests)
                             .where(a.c.spike_id.in_(ids)).order_by(a.c.spike_id, a.c.rank)).all()):
            affected.setdefault(spike_id, []).append(AffectedStream(
                service=service, operation=operation, peer_service=peer, start_unix_nano=start,
                last_anomalous_end_unix_nano=last_end, p99_ns=p99, baseline_p99_ns=baseline_p99, evidence=evidence,
                slow_requests=slow))
        return [Spike(id=r.id, service=r.service, operation=r.operation, state=r.state,
                      start_unix_nano=r.start_ns, end_unix_nano=r.end_ns, p99_ns=r.p99_ns,
                      baseline_p99_ns=r.baseline_p99_ns, causes=tuple(causes.get(r.id, ())),
                      exemplar_trace_ids=tuple(bytes.fromhex(t) for t in orjson.loads(r.exemplar_trace_ids)),
                      detected_unix_nano=r.detected_ns, peer_service=r.peer_service,
                      affected=tuple(affected.get(r.id, ())), recurrence_of=r.recurrence_of,
                      occurrence=r.occurrence, first_start_unix_nano=r.first_start_ns)
                for r in rows]

    def span_payloads(self, since_ns: int, until_ns: int, *, max_block_seconds: int = 3600) -> Iterator[bytes]:
        """Every stored span block that may hold a span ending in [since, until), each stored block once.

        For compare and the serving analyses, which read whole time ranges, however long ago. The
        event-time index on the blocks' latest end bounds the read to the range (plus
        ``max_block_seconds``: a block whose spans ended more than that after the range's end, yet also
        inside it, is not read); the blocks' own time range does the rest. A block stored twice (a
        retried export) is served once. Rows stream (a server-side cursor on PostgreSQL).
        """
        b = schema.span_blocks
        query = select(b.c.payload, b.c.start_ns, b.c.end_ns).where(
            b.c.end_ns >= since_ns, b.c.end_ns < until_ns + max_block_seconds * NS,
            b.c.start_ns < until_ns)
        seen: set[tuple[int, int, int, int]] = set()
        with self.engine.connect() as conn:
            for payload, start_ns, end_ns in conn.execution_options(stream_results=True, yield_per=64
                                                                    ).execute(query):
                data = bytes(payload)
                digest = (len(data), zlib.crc32(data), start_ns, end_ns)
                if digest not in seen:
                    seen.add(digest)
                    yield data


    def spans_after(self, block_id: int, limit: int = 256, max_spans: int | None = None) -> tuple[int, list[Span]]:
        """The spans of up to ``limit`` span blocks committed after ``block_id``, in commit (id) order, and the
        last block id read (``block_id`` when none is newer); with ``max_spans``, no block is read past the one
        that reached it. Each block as stored: a block stored twice (a retried export) comes twice; the
        detectors skip what they saw. For the collector's restart, which feeds its restored detectors what was
        committed after their checkpoint."""
        b = schema.span_blocks
        query = select(b.c.id, b.c.payload).where(b.c.id > block_id).order_by(b.c.id).limit(limit)
        spans: list[Span] = []
        last = block_id
        with self.engine.connect() as conn:
            for row_id, payload in conn.execute(query):
                spans += spans_of_block(bytes(payload))
                last = row_id
                if max_spans is not None and len(spans) >= max_spans:
                    break
        return last, spans

    def spans_ending_since(self, end_ns: int, up_to_block: int, after_block: int | None = None, limit: int = 256,
                           exclude: Collection[int] = ()) -> tuple[int, list[Span]]:
        """The spans of up to ``limit`` span blocks up to ``up_to_block`` that end at ``end_ns`` or later, in id
        order from after ``after_block`` (from the first such block when None), and the last block id read;
        blocks whose id is in ``exclude`` are read past, not decoded. For the collector's restart and a cluster's
        new leader, which refill their detectors' recent traces (not part of a checkpoint)."""
        b = schema.span_blocks
        with self.engine.connect() as conn:
            if after_block is None:
                first = conn.execute(select(func.min(b.c.id)).where(b.c.end_ns >= end_ns)).scalar_one_or_none()
                if first is None:
                    return up_to_block, []
                after_block = first - 1
            query = (select(b.c.id, b.c.payload)
                     .where(b.c.id > after_block, b.c.id <= up_to_block, b.c.end_ns >= end_ns)
                     .order_by(b.c.id).limit(limit))
            spans: list[Span] = []
            last = up_to_block
            rows = conn.execute(query).all()
        for row_id, payload in rows:
            if row_id not in exclude:
                spans += spans_of_block(bytes(payload))
            last = row_id
        return (last if rows else up_to_block), spans

    def points_since(self, ingested_at: int, after: tuple[int, int] = (0, -(2**63)), limit: int = 10_000
                     ) -> tuple[tuple[int, int], list[MetricPoint]]:
        """Up to ``limit`` metric points that arrived in or after second ``ingested_at``, by (series id, time)
        after the key ``after``; with the key to continue from (``after`` when none is left)."""
        m, p = schema.metric_series, schema.metric_points
        series, since = after
        query = (select(p.c.series_id, p.c.t_ns, p.c.value, m.c.host, m.c.name, m.c.attributes, m.c.kind, m.c.unit)
                 .join(m, m.c.id == p.c.series_id)
                 .where(p.c.ingested_at >= ingested_at,
                        or_(p.c.series_id > series, and_(p.c.series_id == series, p.c.t_ns > since)))
                 .order_by(p.c.series_id, p.c.t_ns).limit(limit))
        points: list[MetricPoint] = []
        key = after
        attributes: dict[str, dict[str, Any]] = {}
        with self.engine.connect() as conn:
            for r in conn.execute(query):
                attrs = attributes.get(r.attributes)
                if attrs is None:
                    attrs = attributes[r.attributes] = orjson.loads(r.attributes)
                points.append(MetricPoint(host=r.host, name=r.name, attributes=attrs, time_unix_nano=r.t_ns,
                                          value=r.value, kind=MetricKind(r.kind), unit=r.unit))
                key = (r.series_id, r.t_ns)
        return key, points

    # --- trace search and the dependency graph (the Jaeger query API) -----------------------------

    def profile_stacks(self, since_ns: int, until_ns: int, *, service: str | None = None, host: str | None = None,
                       limit: int = MAX_PROFILE_ROWS) -> list[ProfileStack]:
        """The sampled stacks of profile windows overlapping ``[since_ns, until_ns)``, of ``service`` and/or
        ``host`` when given, oldest window first (at most ``limit`` rows); windows longer than
        ``MAX_PROFILE_WINDOW_NS`` are not looked for. The whole read is held at once: the diff, which must stay
        bounded whatever was stored, folds :meth:`profile_rows` instead."""
        rows = list(self.profile_rows(since_ns, until_ns, service=service, host=host, limit=limit))
        # A process runs the same stacks window after window: each is read and parsed once, and its frames
        # shared by every row that counts it.
        frames = {i: tuple((str(fn), str(file), int(line)) for fn, file, line in raw)
                  for i, raw in self.stack_frames(sorted({r.stack_id for r in rows}))}
        return [ProfileStack(host=r.host, service=r.service, pid=r.pid, process=r.process, start_unix_nano=r.start_ns,
                             end_unix_nano=r.end_ns, frames=frames[r.stack_id], samples=r.samples, kind=r.kind,
                             period_ns=r.period_ns) for r in rows if r.stack_id in frames]

    def profile_rows(self, since_ns: int, until_ns: int, *, service: str | None = None, host: str | None = None,
                     limit: int = MAX_PROFILE_ROWS) -> Generator[ProfileRow, None, None]:
        """The rows :meth:`profile_stacks` reads, without their frames (:meth:`stack_frames`), streamed from the
        database as they are iterated rather than held: what a diff folds row by row."""
        ps = schema.profile_samples
        query = (select(ps.c.stack_id, ps.c.host, ps.c.service, ps.c.pid, ps.c.process, ps.c.kind, ps.c.start_ns,
                        ps.c.end_ns, ps.c.samples, ps.c.period_ns)
                 .where(ps.c.start_ns < until_ns, ps.c.start_ns > since_ns - MAX_PROFILE_WINDOW_NS,
                        ps.c.end_ns > since_ns))
        if service is not None:
            query = query.where(ps.c.service == service)
        if host is not None:
            query = query.where(ps.c.host == host)
        query = query.order_by(ps.c.start_ns, ps.c.host, ps.c.pid).limit(limit)
        # A server-side cursor on PostgreSQL: the driver holds a batch of rows, not the whole answer.
        with (self.engine.connect() as conn, _small_cache(conn),
              conn.execution_options(stream_results=True, yield_per=_STREAM_ROWS).execute(query) as result):
            for r in result:
                yield ProfileRow(*r)

    def stack_frames(self, stack_ids: Sequence[int]) -> Generator[tuple[int, list[Any]], None, None]:
        """The frames (``[function, file, line]`` lists, root first) of the stored stacks ``stack_ids``, a few
        hundred at a time, in no particular order; unknown ids are left out."""
        st = schema.profile_stacks
        with self.engine.connect() as conn, _small_cache(conn):
            for at in range(0, len(stack_ids), _FRAMES_CHUNK):
                chunk = stack_ids[at:at + _FRAMES_CHUNK]
                # Streamed: a stored stack's frames may be half a MB of long names, and psycopg would otherwise
                # hold the whole chunk's answer at once.
                query = select(st.c.id, st.c.frames).where(st.c.id.in_(chunk))
                with conn.execution_options(stream_results=True, yield_per=16).execute(query) as result:
                    for i, text in result:
                        yield i, orjson.loads(text)

    def find_trace_ids(self, query: TraceQuery, max_scanned_spans: int = MAX_SCANNED_SPANS) -> list[bytes]:
        """Ids of traces matching ``query``, the one with the latest matching span first, at most ``query.limit``."""
        return trace_search.find_trace_ids(self.engine, query, max_scanned_spans)

    def traces(self, trace_ids: Iterable[bytes]) -> dict[bytes, list[Span]]:
        """The spans of several traces, each oldest first; unknown ids are left out."""
        return trace_search.traces(self.engine, trace_ids)

    def dependencies(self, since_ns: int, until_ns: int,
                     max_spans: int = MAX_DEPENDENCY_SPANS) -> list[tuple[str, str, int]]:
        """``(parent service, child service, calls)`` for spans starting in the range whose parent is elsewhere."""
        return trace_search.dependencies(self.engine, since_ns, until_ns, max_spans)

    # --- what only the web pages ask ------------------------------------------------------------

    def recent_windows(self, lookback_ns: int) -> list[LatencyWindow]:
        """Every service's windows of its last ``lookback_ns`` (before its newest window), by service and start.

        Per service, the newest window start is found through the (service, start)
        index, and the windows from ``lookback_ns`` before it are read through the same
        index. A service that went quiet a day ago shows its last minutes of a day ago.
        """
        w, o = schema.latency_windows, schema.operations
        out: list[LatencyWindow] = []
        with self.engine.connect() as conn:
            services = conn.execute(select(o.c.service).distinct().order_by(o.c.service)).scalars().all()
            for service in services:
                newest = conn.execute(select(func.max(w.c.start_ns)).where(w.c.service == service)).scalar()
                if newest is None:
                    continue
                rows = conn.execute(select(w).where(w.c.service == service, w.c.start_ns >= newest - lookback_ns,
                                                    w.c.peer_service == "")  # entry streams: the service's own
                                    .order_by(w.c.start_ns, w.c.operation)).all()
                out += [window_of(r) for r in rows]
        return out

    def host_series(self, host: str, names: Sequence[str], since_ns: int, until_ns: int, *,
                    skip_attribute_keys: Collection[str] = (), max_points_per_series: int = 20_000
                    ) -> list[KindedSeries]:
        """The series of ``host`` named in ``names`` with their points in [since, until), with their kind so that
        a page can turn counters into rates.

        Series whose point attributes hold any of ``skip_attribute_keys`` are not
        read at all (per-CPU series when the page wants the whole machine). Each
        series keeps at most ``max_points_per_series`` points, the oldest.
        """
        m, p = schema.metric_series, schema.metric_points
        out: list[KindedSeries] = []
        with self.engine.connect() as conn:
            for name in names:
                series = conn.execute(select(m).where(m.c.host == host, m.c.name == name)
                                      .order_by(m.c.attributes)).all()
                for row in series:
                    attributes = orjson.loads(row.attributes)
                    if any(key in attributes for key in skip_attribute_keys):
                        continue
                    points = conn.execute(select(p.c.t_ns, p.c.value)
                                          .where(p.c.series_id == row.id, p.c.t_ns >= since_ns, p.c.t_ns < until_ns)
                                          .order_by(p.c.t_ns).limit(max_points_per_series)).all()
                    if points:
                        out.append(KindedSeries(row.host, row.name, attributes, MetricKind(row.kind), row.unit,
                                                tuple((t, v) for t, v in points)))
        return out


def window_of(row: Any) -> LatencyWindow:
    """A stored ``latency_windows`` row as the model's window (an empty peer_service is an entry stream)."""
    return LatencyWindow(service=row.service, operation=row.operation, start_unix_nano=row.start_ns,
                         end_unix_nano=row.end_ns, count=row.count, p50_ns=row.p50_ns, p95_ns=row.p95_ns,
                         p99_ns=row.p99_ns, max_ns=row.max_ns, peer_service=row.peer_service or None)


def count_rows(engine: Engine, table: str) -> int:
    """Row count of one table (operations and tests)."""
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(schema.metadata.tables[table])).scalar_one()
