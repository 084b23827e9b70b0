"""Retention: raw span blocks and metric samples go by age and by size, oldest arrivals first, in small batches.

Spikes and causes are kept (they are small), and so are the span blocks holding a trace that a stored spike
names as an exemplar: neither cap ever deletes them. Latency windows (a row per stream and 10 s: about 250 MB
a day for 150 streams) go when they are ``window_max_age_s`` older than the newest window stored: by event
time, since windows have no arrival, but from the data's own newest so that a replay of an old capture keeps
them. Operations (the span names of
``/api/v1/services``) go when none was recorded for the span age, and beyond ``operation_max_count`` the
services holding the most lose their least recently recorded ones first, so one service that puts ids into
its span names cannot push the others out. Deleting in batches keeps each
write transaction short, so ingest is never blocked for long. Arrival time, not event time, decides: a
replay of last year's capture is kept as long as fresh data.

Size caps need the current size: the payload bytes of the span blocks and the number of metric points.
Counting a large table every few minutes would cost more than the ingest it protects, so ``Retention``
keeps a ledger: the first ``measure`` reads everything once, later ones read only what arrived since
(an index range on ``ingested_at``), and every delete subtracts what it removed. Rows younger than
``SETTLE_SECONDS`` are re-read at every measure, since a write transaction stamped a little earlier may
still commit into that range.

>>> policy = RetentionPolicy(span_max_age_s=72 * 3600, point_max_age_s=168 * 3600, span_max_bytes=10 * 2**30)
>>> policy.size_capped
True
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Row,
    ScalarSelect,
    Table,
    and_,
    delete,
    func,
    literal_column,
    select,
)

from spikehound.storage import schema
from spikehound.storage.reader import Reader
from spikehound.storage.writer import OPERATION_REFRESH_SECONDS
from spikehound.units import NS

log = logging.getLogger("spikehound.storage.retention")

DELETE_BATCH = 5_000  # metric points per transaction
DELETE_BLOCKS = 200  # span blocks (up to a few hundred spans each) per transaction
SETTLE_SECONDS = 300  # rows that arrived this recently are re-read by every measure


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """What may stay: ages in seconds by arrival, sizes in payload bytes and points; a size of 0 means no cap."""

    span_max_age_s: float
    point_max_age_s: float
    span_max_bytes: int = 0
    point_max_count: int = 0
    profile_max_rows: int = 0  # (process, window, stack) rows of sampling profiles
    operation_max_count: int = 50_000  # (service, span name) pairs listed by /api/v1/services
    window_max_age_s: float = 0.0  # latency windows this much older than the newest one go; 0: none

    @property
    def size_capped(self) -> bool:
        return self.span_max_bytes > 0 or self.point_max_count > 0 or self.profile_max_rows > 0


@dataclass(slots=True)
class RetentionResult:
    spans: int = 0  # deleted for age
    points: int = 0
    spans_over_size: int = 0  # deleted to bring the store back under its size caps
    points_over_size: int = 0
    operations: int = 0  # not recorded for the span age, or beyond operation_max_count
    profile_samples: int = 0  # (process, window, stack) rows past the span age, their stacks with the last of them
    profile_samples_over_size: int = 0
    windows: int = 0  # latency windows older than the window age


@dataclass(slots=True)
class StoredSize:
    span_bytes: int  # OTLP payload bytes of the stored span blocks, exemplars included
    points: int
    profile_rows: int = 0


class _Ledger:
    """An aggregate over one table's rows; ``settled`` covers rows that arrived before ``boundary``."""

    def __init__(self, table: Table, aggregate: ColumnElement[int]) -> None:
        self.table = table
        self.aggregate = aggregate  # what the ledger adds up: count(*), sum(length(payload))
        self.boundary: int | None = None  # unix seconds; None until the first measure
        self.settled = 0
        self.fresh = 0

    @property
    def total(self) -> int:
        return self.settled + self.fresh

    def measure(self, conn: Connection, now_s: int) -> None:
        arrived = self.table.c.ingested_at
        new_boundary = now_s - SETTLE_SECONDS
        since = self.boundary
        if since is None or new_boundary < since:  # first look, or the clock went back: count everything
            since, self.settled = None, 0

        def total(condition: ColumnElement[bool]) -> ScalarSelect[int]:
            return select(func.coalesce(self.aggregate, 0)).select_from(self.table).where(condition).scalar_subquery()

        older = arrived < new_boundary if since is None else and_(arrived >= since, arrived < new_boundary)
        # One statement, so both parts come from one snapshot; each is a range of the ingested_at index.
        settled, fresh = conn.execute(select(total(older), total(arrived >= new_boundary))).one()
        self.settled += int(settled)
        self.fresh = int(fresh)
        self.boundary = new_boundary

    def removed(self, amount: int, settled: bool) -> None:
        if self.boundary is None:
            return
        if settled:
            self.settled -= amount
        else:
            self.fresh -= amount


class Retention:
    """Enforces a ``RetentionPolicy`` on one database. ``measure`` only reads and may run on any thread;
    ``enforce`` deletes and belongs on the writer thread. Never call the two at the same time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._blocks = _Ledger(schema.span_blocks, func.sum(func.length(schema.span_blocks.c.payload)))
        self._points = _Ledger(schema.metric_points, func.count())
        self._profiles = _Ledger(schema.profile_samples, func.count())
        self._row = literal_column("rowid" if engine.dialect.name == "sqlite" else "ctid")

    def measure(self, now_s: float) -> StoredSize:
        """Bring the ledgers up to date: reads only what arrived since the last call (everything the first time)."""
        with self.engine.connect() as conn:
            self._blocks.measure(conn, int(now_s))
            self._points.measure(conn, int(now_s))
            self._profiles.measure(conn, int(now_s))
        return self.size

    @property
    def size(self) -> StoredSize:
        return StoredSize(self._blocks.total, self._points.total, self._profiles.total)

    @property
    def measured(self) -> bool:
        return self._blocks.boundary is not None

    def enforce(self, policy: RetentionPolicy, now_s: float, max_batches: int = 200) -> RetentionResult:
        """Delete by age, then (once measured) the oldest until back under each size cap."""
        keep = Reader(self.engine).exemplar_trace_ids()
        result = self.expire(int(now_s - policy.span_max_age_s), int(now_s - policy.point_max_age_s), max_batches,
                             keep)
        span_excess = self._blocks.total - policy.span_max_bytes
        if self.measured and policy.span_max_bytes and span_excess > 0:
            result.spans_over_size = self._delete_blocks(None, keep, max_batches, span_excess)
        point_excess = self._points.total - policy.point_max_count
        if self.measured and policy.point_max_count and point_excess > 0:
            result.points_over_size = self._delete_points(None, max_batches, point_excess)
        profile_excess = self._profiles.total - policy.profile_max_rows
        if self.measured and policy.profile_max_rows and profile_excess > 0:
            result.profile_samples_over_size = self._delete_profiles(None, max_batches, profile_excess)
        # An operation still sending is recorded again every OPERATION_REFRESH_SECONDS: never take it for gone.
        age = max(policy.span_max_age_s, 2 * OPERATION_REFRESH_SECONDS)
        result.operations = self._prune_operations(int(now_s - age), policy.operation_max_count, max_batches)
        if result.operations:
            log.info("retention deleted %d operations not recorded for %.0f hours or beyond the %d kept",
                     result.operations, age / 3600, policy.operation_max_count)
        if policy.window_max_age_s > 0:
            result.windows = self._expire_windows(int(policy.window_max_age_s * NS), max_batches)
        return result

    def _expire_windows(self, max_age_ns: int, max_batches: int) -> int:
        """Delete latency windows that start ``max_age_ns`` or more before the newest one; the number deleted."""
        w = schema.latency_windows
        with self.engine.connect() as conn:
            newest = conn.execute(select(func.max(w.c.start_ns))).scalar()
        if newest is None:
            return 0
        return self._delete_rows(w, w.c.start_ns < newest - max_age_ns, max_batches)

    def _prune_operations(self, cutoff_s: int, max_count: int, max_batches: int) -> int:
        """Delete operations last recorded before ``cutoff_s``, then the least recently recorded of the services
        over their fair share of ``max_count`` (0: no cap); the number deleted."""
        o = schema.operations
        deleted = self._delete_rows(o, o.c.first_seen_at < cutoff_s, max_batches)
        if not max_count:
            return deleted
        with self.engine.connect() as conn:
            counts = conn.execute(select(o.c.service, func.count()).group_by(o.c.service)).all()
        level = fair_level([n for _, n in counts], max_count)
        for service, count in counts:
            excess = count - level
            if excess <= 0:
                continue
            mine = o.c.service == service
            with self.engine.connect() as conn:  # the time of the excess-th least recently recorded
                boundary = conn.execute(select(o.c.first_seen_at).where(mine).order_by(o.c.first_seen_at)
                                        .offset(excess - 1).limit(1)).scalar_one()
            older = self._delete_rows(o, mine & (o.c.first_seen_at < boundary), max_batches)
            deleted += older + self._delete_rows(o, mine & (o.c.first_seen_at == boundary), max_batches,
                                                 excess - older)
        return deleted

    def _delete_rows(self, table: Table, condition: ColumnElement[bool], max_batches: int,
                     budget: int | None = None) -> int:
        """Delete the rows of ``table`` matching ``condition`` (at most ``budget``), a short transaction a batch."""
        total = 0
        for _ in range(max_batches):
            limit = DELETE_BATCH if budget is None else min(DELETE_BATCH, budget - total)
            if limit <= 0:
                break
            victims = select(self._row).select_from(table).where(condition).limit(limit)
            with self.engine.begin() as conn:
                done = conn.execute(delete(table).where(self._row.in_(victims))).rowcount
            total += done
            if done < limit:
                break
        return total

    def expire(self, span_cutoff_s: int, point_cutoff_s: int, max_batches: int = 200,
               keep: set[bytes] | None = None) -> RetentionResult:
        """Delete span blocks that arrived before ``span_cutoff_s`` and points before ``point_cutoff_s``."""
        keep = Reader(self.engine).exemplar_trace_ids() if keep is None else keep
        return RetentionResult(spans=self._delete_blocks(span_cutoff_s, keep, max_batches, None),
                               points=self._delete_points(point_cutoff_s, max_batches, None),
                               profile_samples=self._delete_profiles(span_cutoff_s, max_batches))

    def _delete_profiles(self, cutoff_s: int | None, max_batches: int, budget: int | None = None) -> int:
        """Delete profile rows that arrived before ``cutoff_s`` (profiles are evidence beside the traces, and go
        with them), all of them or the ``budget`` oldest, then the stacks no row uses any more; the number of
        rows deleted."""
        ps, st = schema.profile_samples, schema.profile_stacks
        deleted = self._delete_oldest(ps, self._profiles, cutoff_s, max_batches, budget)
        if deleted:
            unused = ~select(ps.c.stack_id).where(ps.c.stack_id == st.c.id).exists()
            self._delete_rows(st, unused, max_batches)
        return deleted

    def _delete_blocks(self, cutoff_s: int | None, keep: set[bytes], max_batches: int, budget: int | None) -> int:
        """Delete the oldest blocks (never an exemplar's) that arrived before ``cutoff_s``, all of them or until
        ``budget`` payload bytes are freed; the number of spans deleted."""
        b, t = schema.span_blocks, schema.trace_blocks
        condition = b.c.ingested_at < cutoff_s if cutoff_s is not None else b.c.id.is_not(None)
        if keep:  # a block holding an exemplar trace stays, with the other traces it holds
            condition = condition & b.c.id.not_in(select(t.c.block_id).where(t.c.trace_id.in_(keep)))
        spans = freed = 0
        exhausted = False
        for _ in range(max_batches):
            with self.engine.begin() as conn:
                candidates = conn.execute(
                    select(b.c.id, b.c.span_count, b.c.ingested_at, func.length(b.c.payload).label("size"))
                    .where(condition).order_by(b.c.ingested_at, b.c.id).limit(DELETE_BLOCKS)).all()
                victims = candidates if budget is None else _prefix_freeing(candidates, budget - freed)
                if not victims:
                    exhausted = not candidates
                    break
                ids = [v.id for v in victims]
                conn.execute(delete(t).where(t.c.block_id.in_(ids)))
                conn.execute(delete(schema.span_block_services).where(schema.span_block_services.c.block_id.in_(ids)))
                conn.execute(delete(b).where(b.c.id.in_(ids)))
            boundary = self._blocks.boundary
            for v in victims:
                self._blocks.removed(v.size, boundary is not None and v.ingested_at < boundary)
            spans += sum(v.span_count for v in victims)
            freed += sum(v.size for v in victims)
            if budget is not None and freed >= budget:
                break
            if len(candidates) < DELETE_BLOCKS:
                exhausted = True
                break
        if budget is not None and freed < budget and exhausted:
            log.warning("span payloads exceed storage.span_retention_max_bytes by %d bytes, but what is left "
                        "holds spike exemplar traces, which retention keeps", budget - freed)
        return spans

    def _delete_points(self, cutoff_s: int | None, max_batches: int, budget: int | None) -> int:
        """Delete the oldest points that arrived before ``cutoff_s``: all of them, or ``budget`` of them."""
        return self._delete_oldest(schema.metric_points, self._points, cutoff_s, max_batches, budget)

    def _delete_oldest(self, p: Table, ledger: _Ledger, cutoff_s: int | None, max_batches: int,
                       budget: int | None) -> int:
        """Delete the oldest rows of ``p`` (counted by ``ledger``) that arrived before ``cutoff_s``: all of them,
        or ``budget`` of them."""
        arrived = p.c.ingested_at
        boundary = ledger.boundary
        # Settled rows first, then fresh ones (still oldest first), so the ledger knows what each delete removed.
        phases = [(arrived < boundary, True), (arrived >= boundary, False)] if boundary is not None \
            else [(arrived.is_not(None), False)]
        total = batches = 0
        for phase, settled in phases:
            condition = and_(phase, arrived < cutoff_s) if cutoff_s is not None else phase
            while batches < max_batches:
                batches += 1
                limit = DELETE_BATCH if budget is None else min(DELETE_BATCH, budget - total)
                if limit <= 0:
                    return total
                victims = select(self._row).select_from(p).where(condition).order_by(arrived).limit(limit)
                with self.engine.begin() as conn:
                    deleted = conn.execute(delete(p).where(self._row.in_(victims))).rowcount
                total += deleted
                ledger.removed(deleted, settled)
                if deleted < limit:
                    break
        return total


def fair_level(counts: Sequence[int], cap: int) -> int:
    """The most rows each holder may keep so that all of them keep at most ``cap`` in all (water-filling).

    >>> fair_level([10, 200_000, 40], 1_000), fair_level([10, 20], 1_000)
    (950, 20)
    """
    low, high = 0, max(counts, default=0)
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(n, mid) for n in counts) <= cap:
            low = mid
        else:
            high = mid - 1
    return low


def _prefix_freeing(candidates: Sequence[Row[Any]], needed: int) -> Sequence[Row[Any]]:
    """The shortest prefix of ``candidates`` (oldest first) whose sizes add up to ``needed`` bytes."""
    freed = 0
    for n, row in enumerate(candidates):
        if freed >= needed:
            return candidates[:n]
        freed += row.size
    return candidates


def expire(engine: Engine, span_cutoff_s: int, point_cutoff_s: int, max_batches: int = 200) -> RetentionResult:
    """Delete span blocks that arrived before ``span_cutoff_s`` and points before ``point_cutoff_s`` (age only)."""
    return Retention(engine).expire(span_cutoff_s, point_cutoff_s, max_batches)
