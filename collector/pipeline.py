"""The ingest pipeline: queue -> one storage writer thread -> commit acks -> detectors.

Several queued requests are merged into one transaction. Each sender's answer
waits for the commit of its data, so an acknowledged span is on disk. Only
committed spans reach the event-time windows, and closed windows are written
by the same single writer, so SQLite never sees two writers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from collector.ingest_queue import IngestQueue, Submission
from collector.retention import RetentionRunner
from collector.telemetry import CollectorTelemetry
from detectors.windows import LatencyWindows
from spikehound.config import Config
from spikehound.model import LatencyWindow
from storage.retention import Retention
from storage.writer import SpanBlock, WriteBatch, Writer

log = logging.getLogger("spikehound.collector.pipeline")
T = TypeVar("T")

NS = 1_000_000_000
TICK_SECONDS = 0.5
RETENTION_INTERVAL_SECONDS = 300.0
ERROR_BACKOFF_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)


class StorageUnavailable(Exception):
    """The batch could not be committed; the sender should retry."""


class IngestPipeline:
    """Owns the writer thread and the latency windows; runs as one background task."""

    def __init__(self, cfg: Config, queue: IngestQueue, writer: Writer, telemetry: CollectorTelemetry) -> None:
        c = cfg.collector
        self.cfg = cfg
        self.queue = queue
        self.writer = writer
        self.telemetry = telemetry
        self.windows = LatencyWindows(window_ns=int(c.window_seconds * NS),
                                      allowed_lateness_ns=int(c.allowed_lateness_seconds * NS),
                                      max_streams=c.max_streams)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spikehound-writer")
        self.healthy = True  # False while the last commit failed; /readyz reports it
        self._closed_windows: list[LatencyWindow] = []
        self._last_input = time.monotonic()
        self._next_retention = time.monotonic() + RETENTION_INTERVAL_SECONDS
        self.retention = RetentionRunner(Retention(writer.engine), telemetry)
        self._failures = 0
        self._stopping = False
        telemetry.add_counter_source(lambda: {
            "spikehound_latency_late_spans": ("Entry spans that arrived after their window closed "
                                              "(stored, not counted in window percentiles).",
                                              self.windows.late_spans),
            "spikehound_latency_stream_overflow_spans": ("Entry spans not aggregated because the stream "
                                                         "limit (collector.max_streams) was reached.",
                                                         self.windows.overflow_spans),
        })

    async def run(self) -> None:
        """Write until ``stop`` is called and the queue is empty."""
        c = self.cfg.collector
        while not (self._stopping and not self.queue.pending()):
            taken = await self.queue.take(c.batch_max_items, timeout=TICK_SECONDS)
            if taken:
                self._last_input = time.monotonic()
                await self._commit(taken)
            else:
                await self._tick()
        self._closed_windows += await self._on_writer(self.windows.flush)
        if self._closed_windows:
            await self._write(WriteBatch(windows=self._closed_windows))

    def stop(self) -> None:
        self._stopping = True

    async def _commit(self, taken: list[Submission]) -> None:
        spans = [s for sub in taken for s in sub.spans]
        points = [p for sub in taken for p in sub.points]
        windows = self._closed_windows
        try:
            blocks = [SpanBlock(sub.payload, sub.spans) for sub in taken if sub.spans]
            closed = await self._write(WriteBatch(spans=spans, points=points, windows=windows, blocks=blocks))
        except Exception as exc:
            error = StorageUnavailable(f"storage write failed: {exc.__class__.__name__}")
            for sub in taken:
                if not sub.committed.done():
                    sub.committed.set_exception(error)
            self.telemetry.dropped.labels("spans", "storage_error").inc(len(spans))
            self.telemetry.dropped.labels("metrics", "storage_error").inc(len(points))
            await self._backoff(exc)
            return
        finally:
            self.queue.release(taken)
            self.telemetry.queue_items.set(self.queue.items)
        self._closed_windows = []
        self.telemetry.windows_closed.inc(len(windows))
        for sub in taken:
            if not sub.committed.done():  # the sender may have gone away; its data is stored anyway
                sub.committed.set_result(None)
        self.telemetry.stored.labels("spans").inc(len(spans))
        self.telemetry.stored.labels("metrics").inc(len(points))
        self._closed_windows += closed

    def _write_and_window(self, batch: WriteBatch) -> list[LatencyWindow]:
        """On the writer thread: commit, then feed the committed spans to the windows (keeps the loop free)."""
        self.writer.write(batch)
        if not batch.spans:
            return []
        self.windows.add(batch.spans)
        return self.windows.close()

    async def _on_writer(self, fn: Callable[..., T], *args: Any) -> T:
        # The windows are only ever touched from the writer thread, so they need no lock.
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _write(self, batch: WriteBatch) -> list[LatencyWindow]:
        """Commit ``batch``; return the windows its spans closed."""
        started = time.perf_counter()
        try:
            closed = await self._on_writer(self._write_and_window, batch)
        except Exception:
            self.healthy = False
            self.telemetry.write_errors.inc()
            raise
        self.healthy = True
        self._failures = 0
        self.telemetry.write_seconds.observe(time.perf_counter() - started)
        return closed

    async def _backoff(self, exc: Exception) -> None:
        delay = ERROR_BACKOFF_SECONDS[min(self._failures, len(ERROR_BACKOFF_SECONDS) - 1)]
        self._failures += 1
        log.error("storage write failed (%s: %s); senders are told to retry; next try in %.1f s",
                  exc.__class__.__name__, str(exc).splitlines()[0][:200], delay)
        await asyncio.sleep(delay)

    async def _tick(self) -> None:
        """With no input: let the watermark catch up, write closed windows, run retention."""
        c = self.cfg.collector
        idle = time.monotonic() - self._last_input
        if idle >= c.idle_flush_seconds:
            advance = int((c.allowed_lateness_seconds + idle) * NS)
            self._closed_windows += await self._on_writer(self.windows.close, advance)
        if self._closed_windows:
            windows = self._closed_windows
            try:
                await self._write(WriteBatch(windows=windows))
            except Exception as exc:
                await self._backoff(exc)
            else:
                self._closed_windows = []
                self.telemetry.windows_closed.inc(len(windows))
        if time.monotonic() >= self._next_retention:
            self._next_retention = time.monotonic() + RETENTION_INTERVAL_SECONDS
            await self.run_retention()

    async def run_retention(self) -> None:
        await self.retention.run(self.cfg.storage, self._on_writer)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
