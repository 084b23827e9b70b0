"""The ingest pipeline: queue -> one storage writer thread -> commit acks -> detectors.

Several queued requests are merged into one transaction. Each sender's answer
waits for the commit of its data, so an acknowledged span is on disk. Only
committed spans and samples reach the detection engine (on the same writer
thread, right after the commit), and the windows and spikes it produces are
written with the next commit, so SQLite never sees two writers. The engine's
learned state is checkpointed every ``detection.checkpoint_seconds`` and at
shutdown, and restored at start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from collector.detection import detection_settings
from collector.ingest_queue import IngestQueue, Submission
from collector.retention import RetentionRunner
from collector.telemetry import CollectorTelemetry
from detectors.engine import CHECKPOINT_FORMAT, Detection, DetectionEngine
from spikehound.config import Config
from spikehound.model import Spike
from spikehound.text import printable
from storage import checkpoints
from storage.reader import Reader
from storage.retention import Retention
from storage.writer import SpanBlock, WriteBatch, Writer

log = logging.getLogger("spikehound.collector.pipeline")
T = TypeVar("T")

NS = 1_000_000_000
CHECKPOINT_NAME = "detection"
TICK_SECONDS = 0.5
RETENTION_INTERVAL_SECONDS = 300.0
ERROR_BACKOFF_SECONDS = (0.2, 0.5, 1.0, 2.0, 5.0)


class StorageUnavailable(Exception):
    """The batch could not be committed; the sender should retry."""


class IngestPipeline:
    """Owns the writer thread and the latency windows; runs as one background task."""

    def __init__(self, cfg: Config, queue: IngestQueue, writer: Writer, telemetry: CollectorTelemetry, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        # Seconds for the schedules (idle flush, checkpoints, retention); tests step it instead of waiting.
        self.clock = clock
        self.queue = queue
        self.writer = writer
        self.telemetry = telemetry
        self.settings = detection_settings(cfg)
        self.engine = DetectionEngine(self.settings)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spikehound-writer")
        self.healthy = True  # False while the last commit failed; /readyz reports it
        # Called on the event loop with every spike state written (opened, updated, resolved).
        self.spike_listeners: list[Callable[[list[Spike]], None]] = []
        self._pending = Detection()  # windows and spikes waiting for the next commit
        self._open_ids: set[str] = set()
        self._open_windows = 0  # (stream, window) pairs not yet judged, as of the last detector step
        self._orphans: list[Spike] = []  # open in storage, unknown to the restored detectors (see restore)
        self._last_input = self.clock()
        self._next_retention = self.clock() + RETENTION_INTERVAL_SECONDS
        self._next_checkpoint = self.clock() + cfg.detection.checkpoint_seconds
        self.retention = RetentionRunner(Retention(writer.engine), telemetry)
        self._failures = 0
        self._detector_errors_seen: set[tuple[str, str]] = set()
        self._stopping = False
        self.commit_hooks: list[Callable[[WriteBatch], None]] = []  # told of every committed batch, on the writer
        telemetry.add_counter_source(self._counters)
        telemetry.add_gauge_source(self._gauges)

    def _counters(self) -> dict[str, tuple[str, float]]:
        st = self.engine.stats()
        return {
            "spikehound_latency_late_spans": ("Entry spans that arrived after their window closed "
                                              "(stored, not counted in window percentiles).", st["late_spans"]),
            "spikehound_latency_stream_overflow_spans": ("Entry spans not aggregated because the stream "
                                                         "limit (collector.max_streams) was reached.",
                                                         st["overflow_spans"]),
            "spikehound_detector_evicted_streams": ("Quiet streams whose learned baseline was dropped to stay "
                                                    "within collector.max_streams.", st["evicted_streams"]),
            "spikehound_detector_judged_windows": ("Closed windows of latency streams (entry and hop) judged "
                                                   "by the detectors.", st["judged_windows"]),
            "spikehound_trace_buffer_evicted_traces": ("Traces dropped from the attribution buffer to stay "
                                                       "within detection.trace_buffer_spans.",
                                                       st["trace_buffer_evicted_traces"]),
            "spikehound_attribution_missing_traces": ("Spike updates that found none of their slow traces in "
                                                      "the attribution buffer.", st["attributions_without_traces"]),
            "spikehound_resource_late_points": ("Metric samples that arrived after their window was judged.",
                                                st["resource_late_points"]),
            "spikehound_resource_overflow_points": ("Metric samples not judged because the resource series "
                                                    "limit was reached.", st["resource_overflow_points"]),
        }

    def _gauges(self) -> dict[str, tuple[str, float]]:
        st = self.engine.stats()
        return {
            "spikehound_latency_streams": ("Latency streams with open windows.", st["streams"]),
            "spikehound_latency_open_windows": ("Latency windows (stream and window) whose spans are counted and "
                                                "that are not yet closed and judged.", self._open_windows),
            "spikehound_detector_streams": ("Latency streams with a learned baseline.", st["judged_streams"]),
            "spikehound_detector_open_spikes": ("Spikes the detectors hold open now (restored from the "
                                                "checkpoint after a restart).", st["open_spikes"]),
            "spikehound_trace_buffer_spans": ("Spans held for attribution.", st["trace_buffer_spans"]),
            "spikehound_resource_series": ("Resource series watched by the resource detectors.",
                                           st["resource_series"]),
        }

    async def restore(self) -> None:
        """Continue from the last checkpoint, if there is one that fits; close the spikes it does not know."""
        await self._restore_checkpoint()
        self._open_windows = self.engine.windows.open_windows
        self._open_ids = {s.id for s in self.engine.open_spikes()}
        stored = await self._on_writer(Reader(self.writer.engine).spikes, None, None, None, "open", 10_000)
        # Opened after the checkpoint the detectors continue from (the collector was killed in between): the
        # detectors do not know them, so nothing would ever resolve them. They are closed at the last window
        # that saw them anomalous, once event time has moved past it (alerting announces them meanwhile, as
        # it would any open spike it finds at start).
        self._orphans = [spike for spike in stored if spike.id not in self._open_ids]
        self._open_ids.update(spike.id for spike in self._orphans)
        if self._orphans:
            log.warning("%d spike(s) open in storage are not in the detectors' checkpoint (the collector stopped "
                        "without saving it): they will be closed at their last anomalous window once event time "
                        "passes it: %s", len(self._orphans), ", ".join(s.id for s in self._orphans[:10]))

    def _close_orphans(self) -> None:
        """Resolve the spikes restore() found orphaned whose last anomalous window event time has passed."""
        watermark = self.engine.windows.watermark
        if watermark is None:
            return
        due: list[Spike] = []
        waiting: list[Spike] = []
        for spike in self._orphans:
            end = _last_anomalous_end(spike)
            if end + self.settings.window_ns <= watermark:
                due.append(replace(spike, state="resolved", end_unix_nano=end))
            else:
                waiting.append(spike)
        self._orphans = waiting
        if due:
            log.info("closed %d orphaned spike(s) as resolved: %s", len(due), ", ".join(s.id for s in due[:10]))
            self._pending.spikes.extend(due)

    async def _restore_checkpoint(self) -> None:
        found = await self._on_writer(checkpoints.load, self.writer.engine, CHECKPOINT_NAME)
        if found is None:
            log.info("detectors start fresh: no checkpoint")
            return
        if found.format != CHECKPOINT_FORMAT:
            log.warning("detectors start fresh: the checkpoint has format %d, this version writes %d",
                        found.format, CHECKPOINT_FORMAT)
            return
        try:
            self.engine = await self._on_writer(DetectionEngine.restore, self.settings, found.state)
        except Exception as exc:
            log.warning("detectors start fresh: the checkpoint cannot be continued (%s: %s)",
                        exc.__class__.__name__, exc)
            return
        latest = time.time_ns() + int(self.cfg.collector.max_clock_skew_seconds * NS)
        if await self._on_writer(self.engine.limit_event_time, latest):
            log.warning("the checkpoint's event time ran past this collector's clock plus "
                        "collector.max_clock_skew_seconds (a sender's clock was wrong): brought back, and the "
                        "windows beyond dropped")
        log.info("detectors restored from the checkpoint of %s: %d streams, %d open spikes",
                 time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(found.saved_at)),
                 self.engine.stats()["judged_streams"], len(self.engine.open_spikes()))

    async def run(self) -> None:
        """Write until ``stop`` is called and the queue is empty."""
        c = self.cfg.collector
        while not (self._stopping and not self.queue.pending()):
            taken = await self.queue.take(c.batch_max_items, timeout=TICK_SECONDS)
            if taken:
                self._last_input = self.clock()
                await self._commit(taken)
            else:
                await self._tick()
            # Also under continuous ingest: a SIGKILL loses at most checkpoint_seconds of learned state.
            if self.clock() >= self._next_checkpoint:
                self._next_checkpoint = self.clock() + self.cfg.detection.checkpoint_seconds
                await self.checkpoint()
        # Open windows are not flushed: they are in the checkpoint, and a restart continues them.
        await self._write_pending()
        await self.checkpoint()

    def stop(self) -> None:
        self._stopping = True

    async def _commit(self, taken: list[Submission]) -> None:
        spans = [s for sub in taken for s in sub.spans]
        points = [p for sub in taken for p in sub.points]
        pending = self._pending
        try:
            blocks = [SpanBlock(sub.payload, sub.spans) for sub in taken if sub.spans]
            detected = await self._write(WriteBatch(spans=spans, points=points, windows=pending.windows,
                                                    spikes=pending.spikes, blocks=blocks))
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
        for sub in taken:
            if not sub.committed.done():  # the sender may have gone away; its data is stored anyway
                sub.committed.set_result(None)
        self.telemetry.stored.labels("spans").inc(len(spans))
        self.telemetry.stored.labels("metrics").inc(len(points))
        self._written(pending)
        self._pending = detected
        if self._orphans:
            self._close_orphans()

    def _write_and_detect(self, batch: WriteBatch) -> Detection:
        """On the writer thread: commit, then feed what was committed to the detectors (keeps the loop free)."""
        self.writer.write(batch)
        for hook in self.commit_hooks:  # the batch is committed: a failing hook costs its own figures only
            try:
                hook(batch)
            except Exception as exc:
                self._count_failure("metrics", "a commit hook (span or resource metrics)", exc)
        if not batch.spans and not batch.points:
            return Detection()
        return self._detect(self._add_and_advance, batch)

    def _add_and_advance(self, batch: WriteBatch) -> Detection:
        self.engine.add(batch.spans, batch.points)
        return self.engine.advance()

    def _detect(self, fn: Callable[..., Detection], *args: Any) -> Detection:
        """Run a detector step; a bug set off by odd input costs that step, never ingest or the loop."""
        try:
            return fn(*args)
        except Exception as exc:
            self._count_failure("detectors", "the detectors", exc)
            return Detection()
        finally:  # counted here, on the writer thread: /metrics must not walk the engine's dicts from another
            self._open_windows = self.engine.windows.open_windows

    def _count_failure(self, part: str, what: str, exc: Exception) -> None:
        self.telemetry.detector_errors.labels(part).inc()
        kind = (part, exc.__class__.__name__)
        if kind not in self._detector_errors_seen:  # one traceback per part and kind, not one per batch
            self._detector_errors_seen.add(kind)
            log.error("%s failed on a batch (stored anyway); counted in spikehound_detector_errors_total, further "
                      "%s errors are not logged", what, kind[1], exc_info=exc)

    def _written(self, done: Detection) -> None:
        """Account for windows and spikes that were just committed, and tell the listeners."""
        self.telemetry.windows_closed.inc(len(done.windows))
        if not done.spikes:
            return
        for spike in done.spikes:
            event = self._announce(spike)
            self.telemetry.spikes.labels(event).inc()
        for listener in self.spike_listeners:
            try:
                listener(done.spikes)
            except Exception:
                log.exception("spike listener failed")

    def _announce(self, spike: Spike) -> str:
        # Names come from senders: shown escaped, so a span name cannot forge or recolour a log line.
        what = (f"{printable(spike.service, 255)} {spike.operation[:1024]!r}: p99 {spike.p99_ns / 1e6:.1f} ms "
                f"against {spike.baseline_p99_ns / 1e6:.1f} ms")
        top = printable(spike.causes[0].summary, 2048) if spike.causes else "no cause found yet"
        if spike.state == "resolved":
            self._open_ids.discard(spike.id)
            log.info("spike %s resolved on %s", spike.id, what)
            return "resolved"
        if spike.id not in self._open_ids:
            self._open_ids.add(spike.id)
            log.warning("spike %s opened on %s; top cause: %s", spike.id, what, top)
            return "opened"
        return "updated"

    async def _write_pending(self) -> bool:
        """Commit the windows and spikes waiting for a commit; False when storage failed."""
        pending = self._pending
        if not pending.windows and not pending.spikes:
            return True
        try:
            await self._write(WriteBatch(windows=pending.windows, spikes=pending.spikes))
        except Exception as exc:
            await self._backoff(exc)
            return False
        self._pending = Detection()
        self._written(pending)
        return True

    async def checkpoint(self) -> None:
        """Save the detectors' learned state (on the writer thread, between two commits)."""
        started = time.perf_counter()
        try:
            await self._on_writer(self._save_checkpoint)
        except Exception as exc:
            log.error("detector checkpoint failed: %s: %s", exc.__class__.__name__, str(exc).splitlines()[0][:200])
            return
        self.telemetry.checkpoint_seconds.observe(time.perf_counter() - started)

    def _save_checkpoint(self) -> None:
        checkpoints.save(self.writer.engine, CHECKPOINT_NAME, CHECKPOINT_FORMAT, self.engine.snapshot())

    async def _on_writer(self, fn: Callable[..., T], *args: Any) -> T:
        # The detection engine is only ever touched from the writer thread, so it needs no lock.
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def on_writer(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the writer thread between two commits: SQLite's one writer (alerts use it)."""
        return await self._on_writer(fn, *args)

    async def _write(self, batch: WriteBatch) -> Detection:
        """Commit ``batch``; return what the detectors made of it."""
        started = time.perf_counter()
        try:
            detected = await self._on_writer(self._write_and_detect, batch)
        except Exception:
            self.healthy = False
            self.telemetry.write_errors.inc()
            raise
        self.healthy = True
        self._failures = 0
        self.telemetry.write_seconds.observe(time.perf_counter() - started)
        return detected

    async def _backoff(self, exc: Exception) -> None:
        delay = ERROR_BACKOFF_SECONDS[min(self._failures, len(ERROR_BACKOFF_SECONDS) - 1)]
        self._failures += 1
        log.error("storage write failed (%s: %s); senders are told to retry; next try in %.1f s",
                  exc.__class__.__name__, str(exc).splitlines()[0][:200], delay)
        await asyncio.sleep(delay)

    async def _tick(self) -> None:
        """With no input: let the watermark catch up, write what the detectors closed, run retention."""
        c = self.cfg.collector
        idle = self.clock() - self._last_input
        if idle >= c.idle_flush_seconds:
            advance = int((c.allowed_lateness_seconds + idle) * NS)
            watermark = self.engine.windows.watermark
            if watermark is not None:  # never past the clock plus the skew the receivers allow
                latest = time.time_ns() + int(c.max_clock_skew_seconds * NS)
                advance = max(min(advance, latest - watermark), 0)
            detected = await self._on_writer(self._detect, self.engine.advance, advance)
            self._pending.windows.extend(detected.windows)
            self._pending.spikes.extend(detected.spikes)
        if self._orphans:
            self._close_orphans()
        if not await self._write_pending():
            return
        if self.clock() >= self._next_retention:
            self._next_retention = self.clock() + RETENTION_INTERVAL_SECONDS
            await self.run_retention()

    async def run_retention(self) -> None:
        await self.retention.run(self.cfg.storage, self._on_writer)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def _last_anomalous_end(spike: Spike) -> int:
    ends = [a.last_anomalous_end_unix_nano for a in spike.affected if a.last_anomalous_end_unix_nano]
    return max(ends, default=spike.detected_unix_nano or spike.start_unix_nano)
