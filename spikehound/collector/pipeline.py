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
from dataclasses import replace
from typing import Any, TypeVar

from spikehound.collector.catch_up import CatchUp, close_held, hold_where_the_data_is
from spikehound.collector.cluster.member import ClusterMember
from spikehound.collector.commit_hooks import CommitHooks
from spikehound.collector.detection import detection_settings
from spikehound.collector.detector_metrics import DetectorMetrics
from spikehound.collector.ingest_queue import IngestQueue, Submission
from spikehound.collector.retention import RetentionRunner
from spikehound.collector.spike_announcer import SpikeAnnouncer
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.storage_unavailable import StorageUnavailable
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.config import Config
from spikehound.detectors.engine import CHECKPOINT_FORMAT, Detection, DetectionEngine
from spikehound.model import Spike
from spikehound.storage import checkpoints
from spikehound.storage.reader import Reader
from spikehound.storage.writer import SpanBlock, WriteBatch, Writer

log = logging.getLogger("spikehound.collector.pipeline")

NS = 1_000_000_000
CHECKPOINT_NAME = "detection"
TICK_SECONDS = 0.5
RETENTION_INTERVAL_SECONDS = 300.0
REPLAY_BLOCKS = 256  # span blocks read and fed to the detectors at a time when replaying after a restart
REPLAY_POINTS = 20_000  # metric points likewise
STALL_SECONDS = 10.0  # a write unanswered this long is an outage (see _write)
T = TypeVar("T")


class IngestPipeline:
    """Owns the latency windows and the detectors; runs as one background task from ``start`` until ``stop``.

    Every write goes through ``writer_thread``, the collector's, which retention and alerting share; the
    pipeline runs ``retention`` when it is idle (it knows when that is). Its commits tell ``health`` whether
    storage takes writes (the receivers and ``/readyz`` ask it).
    The detector metrics (``detector_metrics``) are for the daemon to register.
    """

    name = "ingest pipeline"

    def __init__(self, cfg: Config, queue: IngestQueue, writer: Writer, writer_thread: WriterThread,
                 retention: RetentionRunner, telemetry: CollectorTelemetry, *,
                 health: StorageHealth | None = None, clock: Callable[[], float] = time.monotonic,
                 member: ClusterMember | None = None, runs_retention: Callable[[], bool] = lambda: True) -> None:
        self.cfg = cfg
        # In a cluster (docs/scale-out.md) the pipeline stores and stamps each commit into the member's feed;
        # the detection leader, one member, runs the detectors over every member's feed instead.
        self.member = member
        self.detects = member is None
        self.runs_retention = runs_retention  # in a cluster, the leader alone runs it
        # Seconds for the schedules (idle flush, checkpoints, retention); tests step it instead of waiting.
        self.clock = clock
        self.queue = queue
        self.writer = writer
        self.writer_thread = writer_thread
        self.telemetry = telemetry
        self.settings = detection_settings(cfg)
        self.engine = DetectionEngine(self.settings)
        self.detector_metrics = DetectorMetrics(self.detector_stats)
        self.health = health or StorageHealth(telemetry)
        # Holds the windows after an episode or a restart until the senders' backlogs have drained.
        self.catch_up = CatchUp(cfg.collector.catch_up_seconds, clock=clock)
        self.announcer = SpikeAnnouncer(telemetry)
        # Called on the event loop with every spike state written (opened, updated, resolved).
        self.spike_listeners = self.announcer.listeners
        self._pending = Detection()  # windows and spikes waiting for the next commit
        self._open_windows = 0  # (stream, window) pairs not yet judged, as of the last detector step
        self._orphans: list[Spike] = []  # open in storage, unknown to the restored detectors (see restore)
        self._last_input = self.clock()
        self._next_retention = self.clock() + RETENTION_INTERVAL_SECONDS
        self._next_checkpoint = self.clock() + cfg.detection.checkpoint_seconds
        self.retention = retention  # run on this pipeline's idle ticks
        self._freed_for_episode = False  # retention was run once for the current disk-full episode
        self._detector_errors_seen: set[tuple[str, str]] = set()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._failed: asyncio.Future[None] | None = None
        # Told of every committed batch, on the writer thread; a failing hook never fails the commit.
        self.commit_hooks = CommitHooks(on_failure=self._commit_hook_failed)

    def detector_stats(self) -> dict[str, int]:
        """The detection engine's own figures now (the detector metrics read them when scraped)."""
        return {**self.engine.stats(), "open_windows": self._open_windows, "catching_up": int(self.catch_up.active)}

    def storage_returned(self) -> None:
        """Storage takes writes again after an outage: hold the windows until the senders' backlogs arrive."""
        self.catch_up.begin()

    async def start(self) -> None:
        """Continue from the checkpoint, then take the queue in a background task (see ``failed``)."""
        self._failed = asyncio.get_running_loop().create_future()
        if self.detects:
            await self.restore()
            # At once, not only every checkpoint_seconds: it says where storage stands, so that a collector
            # killed before its first periodic checkpoint (a crash loop, a kill in its first minute) replays
            # what it committed instead of starting its detectors from nothing.
            await self.checkpoint()
        self._task = asyncio.create_task(self.run(), name="ingest-pipeline")
        self._task.add_done_callback(self._ended)

    def failed(self) -> asyncio.Future[None]:
        """Completes with the error if the pipeline's task ends before ``stop`` was called."""
        assert self._failed is not None, "start() first"
        return self._failed

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self._stopping or self._failed is None or self._failed.done():
            return  # an error while stopping is raised by stop() itself
        if task.cancelled():
            self._failed.set_exception(RuntimeError("ingest pipeline cancelled"))
        else:
            self._failed.set_exception(task.exception() or RuntimeError("ingest pipeline ended"))

    async def stop(self) -> None:
        """Take no new batches once the queue is empty: commit everything accepted, write the pending windows and
        spikes, save the checkpoint."""
        self._stopping = True
        try:
            if self._task is not None and not self._task.done():
                await self._task
        finally:
            if self._failed is not None and not self._failed.done():
                self._failed.cancel()

    async def restore(self) -> None:
        """Continue from the last checkpoint, if there is one that fits; close the spikes it does not know."""
        found = await self._restore_checkpoint()
        replayed = False
        if found is not None:
            # Senders that spooled while the collector was down send their backlogs now; and what was committed
            # after the checkpoint is replayed into windows that must stay open as they were before the kill.
            await self._begin_catch_up()
            await self._refill_traces(found)
            replayed = await self._replay_committed(found)
        self._open_windows = self.engine.windows.open_windows
        self.announcer.open_ids = {s.id for s in self.engine.open_spikes()}
        stored = await self.writer_thread.run(Reader(self.writer.engine).spikes, None, None, None, "open", 10_000)
        # Opened after the checkpoint the detectors continue from (the collector was killed in between). After
        # a replay the detectors find them again (same id) once the held windows are judged; without one (a
        # checkpoint from before positions) they do not know them, and nothing would ever resolve them. Those
        # left are closed at the last window that saw them anomalous, once event time has moved past it
        # (alerting announces them meanwhile, as it would any open spike it finds at start).
        self._orphans = [spike for spike in stored if spike.id not in self.announcer.open_ids]
        self.announcer.open_ids.update(spike.id for spike in self._orphans)
        if self._orphans and not replayed:
            log.warning("%d spike(s) open in storage are not in the detectors' checkpoint (the collector stopped "
                        "without saving it): they will be closed at their last anomalous window once event time "
                        "passes it: %s", len(self._orphans), ", ".join(s.id for s in self._orphans[:10]))

    async def _refill_traces(self, found: checkpoints.Checkpoint) -> None:
        """The detectors' recent traces are not in the checkpoint: read back those of the windows still open
        from before it, so that a spike judged from them (after a catch-up, a crash loop) is attributed from
        whole traces as it would have been live. Into the trace buffer only: the windows counted them already."""
        earliest = self.engine.windows.earliest_open_ns
        if found.span_block_id is None or earliest is None:
            return
        reader = Reader(self.writer.engine)
        since = earliest - self.settings.window_ns  # and the window before, for normal traces to compare with
        block: int | None = None
        spans = 0
        while block is None or block < found.span_block_id:
            block, chunk = await self.writer_thread.run(reader.spans_ending_since, since, found.span_block_id, block,
                                                        REPLAY_BLOCKS)
            if not chunk:
                break
            spans += len(chunk)
            await self.writer_thread.run(self.engine.traces.add, chunk)
        if spans:
            log.info("read back %d spans of the open windows' traces from before the checkpoint", spans)

    async def _replay_committed(self, found: checkpoints.Checkpoint) -> bool:
        """Feed the restored detectors what was committed after their checkpoint (the collector was killed
        before it saved another): every committed span is seen once, and what they make of it waits for the
        next commit (windows and spikes are upserts: writing one again changes nothing)."""
        if found.span_block_id is None or found.points_ingested_at is None:
            log.info("the checkpoint does not say where storage stood (written by an older version): nothing "
                     "committed after it is replayed")
            return False
        started = time.perf_counter()
        reader = Reader(self.writer.engine)
        block, spans = found.span_block_id, 0
        while True:
            block, chunk = await self.writer_thread.run(reader.spans_after, block, REPLAY_BLOCKS)
            if not chunk:
                break
            spans += len(chunk)
            self._take(await self.writer_thread.run(self._detect, self._add_and_advance, WriteBatch(spans=chunk)))
        key, points = (0, -(2**63)), 0
        while True:
            key, chunk_points = await self.writer_thread.run(reader.points_since, found.points_ingested_at, key,
                                                             REPLAY_POINTS)
            if not chunk_points:
                break
            # The checkpoint's second is replayed whole, so some of these were seen: those in open windows are
            # skipped as repeats; those whose window was judged were seen, or were late then too.
            judged = self.engine.resources.judged
            chunk_points = [p for p in chunk_points if not judged(p.time_unix_nano)]
            points += len(chunk_points)
            self._take(await self.writer_thread.run(self._detect, self._add_and_advance,
                                                    WriteBatch(points=chunk_points)))
        log.info("replayed what was committed after the checkpoint to the detectors: %d spans, %d metric points "
                 "in %.2f s", spans, points, time.perf_counter() - started)
        return True

    def _take(self, detected: Detection) -> None:
        """Keep a detector step's windows and spikes for the next commit: every state, in order (a spike that
        opened and resolved since the last commit is announced and alerted as both; the writer keeps the last)."""
        self._pending.windows.extend(detected.windows)
        self._pending.spikes.extend(detected.spikes)

    async def _begin_catch_up(self) -> None:
        """Hold the windows where the data has brought them, before any backlog reaches the detectors."""
        if not self.detects:
            return
        self.catch_up.begin()
        await self.writer_thread.run(self._set_hold)

    def _set_hold(self) -> None:
        """On the writer thread: cap the windows' watermark where it is (see CatchUp)."""
        if self.catch_up.active:
            hold_where_the_data_is(self.engine)

    def _release_hold(self) -> None:
        """On the writer thread: the backlog has arrived; move the held watermark to where the data is, a window
        at a time, as live traffic would have moved it (each step's spike states are kept, in order)."""
        if self.engine.windows.hold is None:
            return
        steps = close_held(self.engine, self.settings.window_ns,
                           lambda: self._take(self._detect(self.engine.advance)))
        log.info("caught up: the senders' backlogs have arrived; the windows held open were closed in %d step(s)",
                 steps)

    def _close_orphans(self) -> None:
        """Resolve the spikes restore() found orphaned whose last anomalous window event time has passed.

        Not while the windows are held: the replayed and the senders' data are still to be judged, and the
        detectors find most of them again (same id) once it is; those are no orphans.
        """
        watermark = self.engine.windows.watermark
        if watermark is None or self.engine.windows.hold is not None:
            return
        known = {s.id for s in self.engine.open_spikes()} | {s.id for s in self._pending.spikes}
        due: list[Spike] = []
        waiting: list[Spike] = []
        for spike in self._orphans:
            if spike.id in known:
                continue
            end = _last_anomalous_end(spike)
            if end + self.settings.window_ns <= watermark:
                due.append(replace(spike, state="resolved", end_unix_nano=end))
            else:
                waiting.append(spike)
        self._orphans = waiting
        if due:
            log.info("closed %d orphaned spike(s) as resolved: %s", len(due), ", ".join(s.id for s in due[:10]))
            self._pending.spikes.extend(due)

    async def _restore_checkpoint(self) -> checkpoints.Checkpoint | None:
        """The checkpoint the detectors continue from (None: they start fresh)."""
        found = await self.writer_thread.run(checkpoints.load, self.writer.engine, CHECKPOINT_NAME)
        if found is None:
            log.info("detectors start fresh: no checkpoint")
            return None
        if found.format != CHECKPOINT_FORMAT:
            log.warning("detectors start fresh: the checkpoint has format %d, this version writes %d",
                        found.format, CHECKPOINT_FORMAT)
            return None
        try:
            self.engine = await self.writer_thread.run(DetectionEngine.restore, self.settings, found.state)
        except Exception as exc:
            log.warning("detectors start fresh: the checkpoint cannot be continued (%s: %s)",
                        exc.__class__.__name__, exc)
            return None
        latest = time.time_ns() + int(self.cfg.collector.max_clock_skew_seconds * NS)
        if await self.writer_thread.run(self.engine.limit_event_time, latest):
            log.warning("the checkpoint's event time ran past this collector's clock plus "
                        "collector.max_clock_skew_seconds (a sender's clock was wrong): brought back, and the "
                        "windows beyond dropped")
        log.info("detectors restored from the checkpoint of %s: %d streams, %d open spikes",
                 time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(found.saved_at)),
                 self.engine.stats()["judged_streams"], len(self.engine.open_spikes()))
        return found

    async def run(self) -> None:
        """Write until ``stop`` is called and the queue is empty."""
        c = self.cfg.collector
        while not (self._stopping and not self.queue.pending()):
            taken = await self.queue.take(c.batch_max_items, timeout=TICK_SECONDS)
            if taken:
                # Only spans move event time: agents' host metrics keep coming when span traffic stops (a quiet
                # night, a dead service), and the last windows, with any spike open in them, must still close.
                if any(sub.spans for sub in taken):
                    self._last_input = self.clock()
                await self._commit(taken)
                if self.clock() - self._last_input >= c.idle_flush_seconds:
                    await self._tick()
            else:
                await self._tick()
            # Also under continuous ingest: a SIGKILL loses at most checkpoint_seconds of learned state.
            if self.detects and self.clock() >= self._next_checkpoint:
                self._next_checkpoint = self.clock() + self.cfg.detection.checkpoint_seconds
                await self.checkpoint()
        # Open windows are not flushed: they are in the checkpoint, and a restart continues them.
        await self._write_pending()
        if self.detects:
            await self.checkpoint()

    async def _commit(self, taken: list[Submission]) -> None:
        spans = [s for sub in taken for s in sub.spans]
        points = [p for sub in taken for p in sub.points]
        if not self.health.available and not self.catch_up.active:
            # An attempt during an outage: if it succeeds, backlogs follow, and this batch may already hold
            # live data; the windows are held before it reaches the detectors.
            await self._begin_catch_up()
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
        self.announcer.written(pending)
        self._pending = detected
        if self.catch_up.active and spans:
            self.catch_up.arrived([s.end_unix_nano for s in spans], self.engine.windows.hold)
        await self._catch_up_step()
        if self._orphans:
            self._close_orphans()

    def _write_and_detect(self, batch: WriteBatch) -> Detection:
        """On the writer thread: commit, then feed what was committed to the detectors (keeps the loop free).

        Only the commit may raise: the hooks and the detectors after it count their own failures, so that a
        batch on disk is never answered as a failed write.
        """
        member = self.member if batch.spans or batch.points else None
        if member is not None:
            batch = replace(batch, feed=member.stamp())
        try:
            self.writer.write(batch)
        except Exception:
            if member is not None:
                member.forget()  # it may have committed all the same (an answer lost with the connection)
            raise
        if member is not None and batch.feed is not None:
            member.committed(batch.feed)
        self.commit_hooks.run(batch)
        if not self.detects or (not batch.spans and not batch.points):
            return Detection()
        return self._detect(self._add_and_advance, batch)

    async def _catch_up_step(self) -> None:
        """Release the hold once the backlog drained (see CatchUp)."""
        if (self.catch_up.active and self.catch_up.done()) or (
                not self.catch_up.active and self.engine.windows.hold is not None):
            await self.writer_thread.run(self._release_hold)

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

    def _commit_hook_failed(self, exc: Exception) -> None:
        self._count_failure("metrics", "a commit hook (span or resource metrics)", exc)

    def _count_failure(self, part: str, what: str, exc: Exception) -> None:
        self.detector_metrics.errors.labels(part).inc()
        kind = (part, exc.__class__.__name__)
        if kind not in self._detector_errors_seen:  # one traceback per part and kind, not one per batch
            self._detector_errors_seen.add(kind)
            log.error("%s failed on a batch (stored anyway); counted in spikehound_detector_errors_total, further "
                      "%s errors are not logged", what, kind[1], exc_info=exc)

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
        self.announcer.written(pending)
        return True

    async def checkpoint(self) -> None:
        """Save the detectors' learned state (on the writer thread, between two commits)."""
        # What the detectors closed before it is written first: the checkpoint's storage position says that
        # everything before it was seen, and a SIGKILL right after must not lose those windows and spikes.
        if not await self._write_pending():
            return
        started = time.perf_counter()
        try:
            await self.writer_thread.run(self._save_checkpoint)
        except Exception as exc:
            self.health.note("detector checkpoint", exc)
            return
        self.telemetry.checkpoint_seconds.observe(time.perf_counter() - started)

    def _save_checkpoint(self) -> None:
        # With the position storage is at now: this runs on the writer thread, between two commits.
        checkpoints.save(self.writer.engine, CHECKPOINT_NAME, CHECKPOINT_FORMAT, self.engine.snapshot())

    async def _write(self, batch: WriteBatch) -> Detection:
        """Commit ``batch``; return what the detectors made of it."""
        started = time.perf_counter()
        write = asyncio.ensure_future(self.writer_thread.run(self._write_and_detect, batch))
        try:
            # A database that stops answering without closing the connection (a hung server; on loopback TCP
            # keepalives never fire) would keep every sender waiting: past STALL_SECONDS the outage is declared,
            # and new requests are refused while this write waits on.
            done, _ = await asyncio.wait({write}, timeout=STALL_SECONDS)
            if not done:
                self.health.stalled(STALL_SECONDS)
            detected = await write
        except Exception:
            self.telemetry.write_errors.inc()
            raise
        self.telemetry.write_seconds.observe(time.perf_counter() - started)
        await self._storage_wrote()
        return detected

    async def write_aside(self, part: str, fn: Callable[..., T], *args: Any) -> T:
        """Run another signal's own transaction (``fn(*args)``, profiles) on the writer thread, between the
        pipeline's commits, and tell ``health`` its outcome as a commit of the pipeline's would.

        A success during an outage is storage's return (the windows are held for the backlogs, as after the
        pipeline's own attempt). A failure during an outage is one more failed attempt, and outside one a
        database out of reach or a full disk starts one; an error of any other kind outside an outage is that
        write's own (``StorageHealth.note``), so one odd request cannot make the collector refuse every sender.
        Raises StorageUnavailable when ``fn`` failed.
        """
        try:
            result = await self.writer_thread.run(fn, *args)
        except Exception as exc:
            self.telemetry.write_errors.inc()
            began = not self.health.episode
            if self.health.episode:
                self.health.failed(exc)
            else:
                self.health.note(part, exc)  # starts an episode when the database is away or the disk full
            if began and self.health.episode:  # as _backoff: windows open now wait for the senders' backlogs
                await self._begin_catch_up()
            raise StorageUnavailable(f"storage write failed: {exc.__class__.__name__}") from exc
        await self._storage_wrote()
        return result

    async def _storage_wrote(self) -> None:
        if self.health.succeeded():
            self.storage_returned()
            await self.writer_thread.run(self._set_hold)  # where an outage began without one (a stalled write)
        if not self.health.episode:
            self._freed_for_episode = False

    async def _backoff(self, exc: Exception) -> None:
        """After a failed write: wait until the next attempt is due (the receivers refuse meanwhile)."""
        began = not self.health.episode
        delay = self.health.failed(exc)
        if began:  # the windows open now stay open until the senders' backlogs have come in after it
            await self._begin_catch_up()
        # The step, not a draw: there is one writer, with no crowd of retries to spread out.
        await asyncio.sleep(delay)

    async def _probe(self) -> None:
        """During an outage with no sender's data to try: a real write tells whether storage is back."""
        if self._pending.windows or self._pending.spikes:
            await self._write_pending()
            return
        try:  # sizeable, so a full disk does not pass it (a member's heartbeat is small, but its own)
            await self.writer_thread.run(self._save_checkpoint if self.member is None else self.member.probe)
        except Exception as exc:
            self.telemetry.write_errors.inc()
            await self._backoff(exc)
            return
        await self._storage_wrote()

    async def _tick(self) -> None:
        """With no input: let the watermark catch up, write what the detectors closed, run retention."""
        c = self.cfg.collector
        self.health.settle()
        if not self.health.available:
            # No data reaches the detectors meanwhile (the senders hold it): event time must not move on idle.
            if self.health.kind == "disk_full" and not self._freed_for_episode:
                self._freed_for_episode = True  # where caps are set, deletions free pages for new rows
                await self.run_retention()
            if self.health.due():
                await self._probe()
            return
        idle = self.clock() - self._last_input
        await self._catch_up_step()
        # Not while the senders' backlogs drain (after an outage or a restart): the windows they fill must
        # stay open. (While storage is away, the return above keeps event time still.)
        if self.detects and idle >= c.idle_flush_seconds and not self.catch_up.active:
            advance = int((c.allowed_lateness_seconds + idle) * NS)
            watermark = self.engine.windows.watermark
            if watermark is not None:  # never past the clock plus the skew the receivers allow
                latest = time.time_ns() + int(c.max_clock_skew_seconds * NS)
                advance = max(min(advance, latest - watermark), 0)
            self._take(await self.writer_thread.run(self._detect, self.engine.advance, advance))
        if self._orphans:
            self._close_orphans()
        if not await self._write_pending():
            return
        if self.clock() >= self._next_retention and self.runs_retention():
            self._next_retention = self.clock() + RETENTION_INTERVAL_SECONDS
            await self.run_retention()

    async def run_retention(self) -> None:
        await self.retention.run(self.cfg.storage)


def _last_anomalous_end(spike: Spike) -> int:
    ends = [a.last_anomalous_end_unix_nano for a in spike.affected if a.last_anomalous_end_unix_nano]
    return max(ends, default=spike.detected_unix_nano or spike.start_unix_nano)
