"""The collector's retention runs: the configured caps applied to storage, counted on /metrics and logged.

Sizes are measured on a reader connection off the writer thread (the first measure after a start reads
the whole store once; later ones only what arrived since); the deletes run on the writer thread, between
ingest batches, so SQLite still sees one writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.config import Config, StorageConfig
from spikehound.storage.retention import Retention, RetentionPolicy, RetentionResult

log = logging.getLogger("spikehound.collector.retention")


def policy_for(storage: StorageConfig) -> RetentionPolicy:
    return RetentionPolicy(span_max_age_s=storage.span_retention_hours * 3600,
                           point_max_age_s=storage.metric_retention_hours * 3600,
                           span_max_bytes=storage.span_retention_max_bytes,
                           point_max_count=storage.metric_retention_max_points,
                           profile_max_rows=storage.profile_retention_max_rows,
                           window_max_age_s=storage.window_retention_days * 86400)


class RetentionRunner:
    """One collector's retention runs; ``run`` is called by ``RetentionSchedule`` (and the two never overlap)."""

    def __init__(self, retention: Retention, telemetry: CollectorTelemetry, writer_thread: WriterThread) -> None:
        self.retention = retention
        self.telemetry = telemetry
        self.writer_thread = writer_thread
        self._lock = asyncio.Lock()  # a reload's run and the periodic one never overlap

    async def run(self, storage: StorageConfig) -> RetentionResult | None:
        """Apply ``storage``'s caps now; None when it failed (logged, retried at the next run)."""
        policy = policy_for(storage)
        async with self._lock:
            now = time.time()
            try:
                if policy.size_capped:
                    await asyncio.get_running_loop().run_in_executor(None, self.retention.measure, now)
                result: RetentionResult = await self.writer_thread.run(self.retention.enforce, policy, now)
            except Exception as exc:
                log.error("retention failed: %s: %s", exc.__class__.__name__, str(exc).splitlines()[0][:200])
                return None
        self._count(result, policy)
        return result

    def _count(self, result: RetentionResult, policy: RetentionPolicy) -> None:
        t = self.telemetry
        t.retention_deleted.labels("spans", "age").inc(result.spans)
        t.retention_deleted.labels("metric_points", "age").inc(result.points)
        t.retention_deleted.labels("spans", "size").inc(result.spans_over_size)
        t.retention_deleted.labels("metric_points", "size").inc(result.points_over_size)
        t.retention_deleted.labels("profile_samples", "age").inc(result.profile_samples)
        t.retention_deleted.labels("profile_samples", "size").inc(result.profile_samples_over_size)
        t.retention_deleted.labels("operations", "age").inc(result.operations)
        t.retention_deleted.labels("latency_windows", "age").inc(result.windows)
        if self.retention.measured:
            size = self.retention.size
            t.stored_span_bytes.set(size.span_bytes)
            t.stored_metric_points.set(size.points)
            log.debug("stored: %d span payload bytes (cap %d), %d metric points (cap %d)", size.span_bytes,
                      policy.span_max_bytes, size.points, policy.point_max_count)
        if result.spans or result.points:
            log.info("retention deleted %d spans and %d metric points past their age", result.spans, result.points)
        if result.spans_over_size or result.points_over_size:
            log.info("retention deleted %d spans and %d metric points over the size caps", result.spans_over_size,
                     result.points_over_size)


class RetentionSchedule:
    """When this collector runs retention: every ``INTERVAL_SECONDS`` on the ingest pipeline's idle ticks and
    after a reload that changes a cap, where ``runs_here`` says so (in a cluster, on the leader only); and once
    per storage episode of a full disk on any collector, since where caps are set deletions free pages for new
    rows. Used on the event loop only."""

    INTERVAL_SECONDS = 300.0

    def __init__(self, runner: RetentionRunner, cfg: Config, runs_here: Callable[[], bool] = lambda: True, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.cfg = cfg  # the running configuration: a reload changes its caps in place
        self.runs_here = runs_here
        self.clock = clock
        self._next = clock() + self.INTERVAL_SECONDS
        self._freed_for: float | None = None  # the start of the disk-full episode retention ran for

    async def when_due(self) -> None:
        if self.clock() >= self._next and self.runs_here():
            self._next = self.clock() + self.INTERVAL_SECONDS
            await self.run()

    async def free_space(self, episode_since: float) -> None:
        """The disk is full in the storage episode that began at ``episode_since``: run once in it."""
        if self._freed_for != episode_since:
            self._freed_for = episode_since
            await self.run()

    async def run(self) -> None:
        await self.runner.run(self.cfg.storage)
