"""The ingest pipeline: queue -> one storage writer thread -> commit -> the senders' answers.

Several queued requests are merged into one transaction. Each sender's answer waits for the commit of its
data, so an acknowledged span is on disk. After each commit, on the writer thread, the commit hooks
(``commit_hooks.py``) and the single collector's detection (``CommitDetection``, see
``local_detection.py``) are told of it; what detection produced is written with the next commit, so SQLite
never sees two writers. The pipeline's idle ticks and the time between two commits are detection's and
retention's schedule; its commits tell ``StorageHealth`` whether storage takes writes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from spikehound.collector.cluster.member import ClusterMember
from spikehound.collector.commit_hooks import CommitHooks
from spikehound.collector.ingest_queue import IngestQueue, Submission
from spikehound.collector.retention import RetentionSchedule
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.storage_unavailable import StorageUnavailable
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.config import CollectorConfig
from spikehound.detectors.engine import Detection
from spikehound.storage.writer import WriteBatch, Writer

__all__ = ["CommitDetection", "CommitPath", "Flush", "IngestPipeline", "PipelineParts", "PipelineSettings"]

log = logging.getLogger("spikehound.collector.pipeline")

TICK_SECONDS = 0.5
STALL_SECONDS = 10.0  # a write unanswered this long is an outage (see _write)
T = TypeVar("T")

# Commits what detection has waiting through the pipeline's commit path; False when storage failed.
Flush = Callable[[], Awaitable[bool]]


class CommitDetection(Protocol):
    """Detection that rides on the pipeline's commits (a single collector's; ``local_detection.py``).

    Every call but ``committed`` and ``probe`` comes from the pipeline's one task on the event loop, one at a
    time; those two run on the writer thread, between two commits. None but ``probe`` may raise: a detector
    failure is counted (``spikehound_detector_errors_total``), a failed checkpoint reported to
    ``StorageHealth.note``; an exception would end the pipeline (in ``committed``: fail a batch that is
    stored). A call may await the writer thread, never block the event loop; ``committed`` holds up every
    later commit while it runs.
    """

    # Whether ``committed`` reads the batch's decoded spans (else only its stored blocks' encodings).
    reads_spans: bool

    async def start(self, flush: Flush) -> None:
        """Before the pipeline takes its queue: continue from the checkpoint."""

    async def stop(self, flush: Flush) -> None:
        """After the pipeline committed its last batch."""

    def committed(self, batch: WriteBatch) -> None:
        """On the writer thread, right after ``batch`` committed (after the commit hooks)."""

    def probe(self) -> None:
        """On the writer thread during a storage episode: a real, sizeable write of its own (the checkpoint);
        raises when storage still fails. The one call that may raise."""

    def take_outgoing(self) -> Detection:
        """The windows and spikes to write with the next commit, handed over."""

    def has_outgoing(self) -> bool:
        """Whether windows or spikes wait to be written."""

    def sent(self, out: Detection, committed: bool) -> None:
        """``out`` was committed (announce it), or its commit failed (it goes with the next one)."""

    async def backlogs_coming(self, *, unless_holding: bool = False) -> None:
        """Storage failed or came back: senders will send their backlogs."""

    async def idle(self, idle_seconds: float) -> None:
        """An idle tick while storage takes writes; no span was taken for ``idle_seconds``."""

    async def between_commits(self, flush: Flush) -> None:
        """After every commit or tick (its checkpoint schedule)."""


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    batch_max_items: int  # submissions' spans and points merged into one commit, at most
    idle_flush_seconds: float  # input this long without spans is idle

    @classmethod
    def from_config(cls, c: CollectorConfig) -> PipelineSettings:
        return cls(batch_max_items=c.batch_max_items, idle_flush_seconds=c.idle_flush_seconds)


@dataclass(frozen=True, slots=True)
class CommitPath:
    """What a commit goes through: the writer, the one thread it runs on, and who is told of the outcome."""

    writer: Writer
    writer_thread: WriterThread  # the collector's, shared with retention and alerting
    health: StorageHealth  # told of every commit's outcome; asked by the receivers and /readyz
    telemetry: CollectorTelemetry


@dataclass(slots=True)
class PipelineParts:
    """What works beside the pipeline on its commits and its schedule.

    ``member``: in a cluster each commit is stamped into the member's feed (the leader detects over every
    member's feed; ``detection`` is then None). ``retention``: run on idle ticks where ``RetentionSchedule``
    says so.
    """

    hooks: CommitHooks
    detection: CommitDetection | None = None
    retention: RetentionSchedule | None = None
    member: ClusterMember | None = None

    def probe(self) -> None:
        """A real write during a storage episode with no sender's data: detection's checkpoint (sizeable, so a
        full disk does not pass it), or in a cluster the member's heartbeat."""
        if self.detection is not None:
            self.detection.probe()
        elif self.member is not None:
            self.member.probe()


class IngestPipeline:
    """Commits the queue's submissions; runs as one background task from ``start`` until ``stop``."""

    name = "ingest pipeline"

    def __init__(self, settings: PipelineSettings, queue: IngestQueue, path: CommitPath, parts: PipelineParts, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.queue = queue
        self.writer = path.writer
        self.writer_thread = path.writer_thread
        self.health = path.health
        self.telemetry = path.telemetry
        self.parts = parts
        # Without detection (a cluster's member) the commit hooks count the spans (span metrics).
        queue.keep_spans = parts.detection is None or parts.detection.reads_spans
        # Told of every committed batch, on the writer thread; a failing hook never fails the commit.
        self.commit_hooks = parts.hooks
        # Seconds for the idle ticks; tests step it instead of waiting.
        self.clock = clock
        self._last_spans = clock()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._failed: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Let detection continue from its checkpoint, then take the queue in a background task (see
        ``failed``)."""
        self._failed = asyncio.get_running_loop().create_future()
        if self.parts.detection is not None:
            await self.parts.detection.start(self.flush)
        self._task = asyncio.create_task(self._run(), name="ingest-pipeline")
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
        """Take no new batches once the queue is empty: commit everything accepted, write what detection has
        waiting, let it save its checkpoint."""
        self._stopping = True
        try:
            if self._task is not None and not self._task.done():
                await self._task
        finally:
            if self._failed is not None and not self._failed.done():
                self._failed.cancel()

    async def _run(self) -> None:
        """Write until ``stop`` is called and the queue is empty."""
        detection = self.parts.detection
        while not (self._stopping and not self.queue.pending()):
            taken = await self.queue.take(self.settings.batch_max_items, timeout=TICK_SECONDS)
            if taken:
                # Only spans make input busy: agents' host metrics keep coming when span traffic stops (a
                # quiet night, a dead service), and idle ticks must still come.
                if any(sub.block is not None for sub in taken):
                    self._last_spans = self.clock()
                await self._commit(taken)
                if self.clock() - self._last_spans >= self.settings.idle_flush_seconds:
                    await self._tick()
            else:
                await self._tick()
            if detection is not None:
                await detection.between_commits(self.flush)
        await self.flush()
        if detection is not None:
            await detection.stop(self.flush)

    async def _commit(self, taken: list[Submission]) -> None:
        spans = [s for sub in taken for s in sub.spans]
        span_count = sum(sub.span_count for sub in taken)
        points = [p for sub in taken for p in sub.points]
        detection = self.parts.detection
        if detection is not None and not self.health.available:
            # An attempt during an outage: if it succeeds, backlogs follow, and this batch may already hold
            # live data; the windows are held before it reaches the detectors.
            await detection.backlogs_coming(unless_holding=True)
        out = detection.take_outgoing() if detection is not None else Detection()
        try:
            blocks = [sub.block for sub in taken if sub.block is not None]
            await self._write(WriteBatch(spans=spans, points=points, windows=out.windows, spikes=out.spikes,
                                         blocks=blocks))
        except Exception as exc:
            if detection is not None:
                detection.sent(out, committed=False)
            error = StorageUnavailable(f"storage write failed: {exc.__class__.__name__}")
            for sub in taken:
                if not sub.committed.done():
                    sub.committed.set_exception(error)
            self.telemetry.dropped.labels("spans", "storage_error").inc(span_count)
            self.telemetry.dropped.labels("metrics", "storage_error").inc(len(points))
            await self._backoff(exc)
            return
        finally:
            self.queue.release(taken)
            self.telemetry.queue_items.set(self.queue.items)
        for sub in taken:
            if not sub.committed.done():  # the sender may have gone away; its data is stored anyway
                sub.committed.set_result(None)
        self.telemetry.stored.labels("spans").inc(span_count)
        self.telemetry.stored.labels("metrics").inc(len(points))
        if detection is not None:
            detection.sent(out, committed=True)

    def _write_and_tell(self, batch: WriteBatch, committed: threading.Event) -> None:
        """On the writer thread: commit (then set ``committed``), then tell the hooks and detection (keeps the
        loop free).

        Only the commit may raise: the hooks and detection after it count their own failures, so that a batch
        on disk is never answered as a failed write.
        """
        member = self.parts.member if batch.span_count or batch.points else None
        if member is not None:
            batch = replace(batch, feed=member.stamp())
        try:
            self.writer.write(batch)
        except Exception:
            if member is not None:
                member.forget()  # it may have committed all the same (an answer lost with the connection)
            raise
        committed.set()
        if member is not None and batch.feed is not None:
            member.committed(batch.feed)
        self.commit_hooks.run(batch)
        if self.parts.detection is not None:
            self.parts.detection.committed(batch)

    async def flush(self) -> bool:
        """Commit the windows and spikes waiting for a commit; False when storage failed."""
        detection = self.parts.detection
        if detection is None or not detection.has_outgoing():
            return True
        out = detection.take_outgoing()
        try:
            await self._write(WriteBatch(windows=out.windows, spikes=out.spikes))
        except Exception as exc:
            detection.sent(out, committed=False)
            await self._backoff(exc)
            return False
        detection.sent(out, committed=True)
        return True

    async def _write(self, batch: WriteBatch) -> None:
        """Commit ``batch`` (and tell who is told of commits)."""
        started = time.perf_counter()
        committed = threading.Event()
        write = asyncio.ensure_future(self.writer_thread.run(self._write_and_tell, batch, committed))
        try:
            # A database that stops answering without closing the connection (a hung server; on loopback TCP
            # keepalives never fire) would keep every sender waiting: past STALL_SECONDS the outage is declared,
            # and new requests are refused while this write waits on. A commit that went through and waits for
            # the detection process to take it (behind, or stopped) is that process's back-pressure, not an
            # outage: the queue fills and the receivers push back, and a process that takes nothing for
            # ANSWER_SECONDS is replaced (detection_process.py).
            done, _ = await asyncio.wait({write}, timeout=STALL_SECONDS)
            if not done and committed.is_set():
                log.warning("a commit has waited %.0f s for the detection process to take it (behind, or stopped); "
                            "the senders wait meanwhile", STALL_SECONDS)
            elif not done:
                self.health.stalled(STALL_SECONDS)
            await write
        except Exception:
            self.telemetry.write_errors.inc()
            raise
        self.telemetry.write_seconds.observe(time.perf_counter() - started)
        await self._storage_wrote()

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
                await self._backlogs_coming()
            raise StorageUnavailable(f"storage write failed: {exc.__class__.__name__}") from exc
        await self._storage_wrote()
        return result

    async def _storage_wrote(self) -> None:
        if self.health.succeeded():  # storage is back: the senders' backlogs follow
            await self._backlogs_coming()

    async def _backlogs_coming(self) -> None:
        if self.parts.detection is not None:
            await self.parts.detection.backlogs_coming()

    async def _backoff(self, exc: Exception) -> None:
        """After a failed write: wait until the next attempt is due (the receivers refuse meanwhile)."""
        began = not self.health.episode
        delay = self.health.failed(exc)
        if began:  # the windows open now stay open until the senders' backlogs have come in after it
            await self._backlogs_coming()
        # The step, not a draw: there is one writer, with no crowd of retries to spread out.
        await asyncio.sleep(delay)

    async def _probe(self) -> None:
        """During an outage with no sender's data to try: a real write tells whether storage is back."""
        if self.parts.detection is not None and self.parts.detection.has_outgoing():
            await self.flush()
            return
        try:
            await self.writer_thread.run(self.parts.probe)
        except Exception as exc:
            self.telemetry.write_errors.inc()
            await self._backoff(exc)
            return
        await self._storage_wrote()

    async def _tick(self) -> None:
        """With no input: let detection move event time on, write what it closed, run retention when due."""
        self.health.settle()
        retention = self.parts.retention
        if not self.health.available:
            # No data reaches the detectors meanwhile (the senders hold it): event time must not move on idle.
            if self.health.kind == "disk_full" and retention is not None:
                await retention.free_space(self.health.since)  # where caps are set, deletions free pages
            if self.health.due():
                await self._probe()
            return
        if self.parts.detection is not None:
            await self.parts.detection.idle(self.clock() - self._last_spans)
        if not await self.flush():
            return
        if retention is not None:
            await retention.when_due()
