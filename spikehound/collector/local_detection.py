"""A single collector's detection: the driver fed by this collector's own commits, on its writer thread.

The ingest pipeline tells it of every commit (``committed``, on the writer thread right after the commit) and
of its schedule (idle ticks, the time between two commits, storage episodes); what the detectors produce is
written with the pipeline's next commit (``take_outgoing``), so SQLite never sees two writers. The detectors'
learned state is checkpointed every ``detection.checkpoint_seconds`` and at shutdown, and restored at start,
where what was committed after the checkpoint is fed again (``start``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import Engine

from spikehound.collector.commit_feed import CommitFeed
from spikehound.collector.detection_driver import CHECKPOINT_NAME, DetectionDriver, StepFailures
from spikehound.collector.detector_metrics import DetectorMetrics
from spikehound.collector.pipeline import Flush
from spikehound.collector.spike_announcer import SpikeAnnouncer
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.detectors.engine import CHECKPOINT_FORMAT, Detection
from spikehound.heap import release_free_heap
from spikehound.storage import checkpoints
from spikehound.storage.reader import Reader
from spikehound.storage.writer import WriteBatch

__all__ = ["LocalDetection"]

log = logging.getLogger("spikehound.collector.detection")


class LocalDetection:
    """Implements the pipeline's ``CommitDetection``; its calls come from the pipeline's one task."""

    reads_spans = True  # the detectors take each commit's decoded spans

    def __init__(self, driver: DetectionDriver, engine: Engine, writer_thread: WriterThread, health: StorageHealth,
                 telemetry: CollectorTelemetry, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.driver = driver
        self.engine = engine
        self.reader = Reader(engine)
        self.writer_thread = writer_thread
        self.health = health  # told of checkpoints that fail
        self.telemetry = telemetry
        self.clock = clock  # seconds, for the checkpoint schedule; tests step it
        self.feed = CommitFeed(driver, self.reader)
        self._next_checkpoint = clock() + driver.settings.checkpoint_seconds

    @property
    def announcer(self) -> SpikeAnnouncer:
        return self.driver.announcer

    @property
    def metrics(self) -> DetectorMetrics:
        return self.driver.metrics

    @property
    def failures(self) -> StepFailures:
        return self.driver.failures

    def stats(self) -> dict[str, int]:
        return self.driver.stats()

    # -- start and stop ---------------------------------------------------------------------------

    async def start(self, flush: Flush) -> None:
        """Continue from the last checkpoint, if one fits, and feed what was committed after it (``CommitFeed``);
        then save a checkpoint at once."""
        run = self.writer_thread.run
        found = await run(checkpoints.load, self.engine, CHECKPOINT_NAME)
        await run(self.feed.resume, found)
        # At once, not only every checkpoint_seconds: it says where storage stands, so that a collector killed
        # before its first periodic checkpoint (a crash loop, a kill in its first minute) replays what it
        # committed instead of starting its detectors from nothing.
        await self.checkpoint(flush)

    async def stop(self, flush: Flush) -> None:
        """Open windows are not flushed: they are in the checkpoint, and a restart continues them."""
        await self.checkpoint(flush)

    # -- the pipeline's calls ---------------------------------------------------------------------

    def committed(self, batch: WriteBatch) -> None:
        """On the writer thread, right after ``batch`` committed: feed its records; never raises."""
        self.feed.committed(batch.spans, batch.points)

    def take_outgoing(self) -> Detection:
        """The windows and spikes to write with the next commit, handed over."""
        return self.driver.take_outgoing()

    def has_outgoing(self) -> bool:
        return bool(self.driver.outgoing)

    def sent(self, out: Detection, committed: bool) -> None:
        """``out`` (from ``take_outgoing``) was committed, or goes out again with the next commit."""
        if committed:
            self.driver.written(out)
        else:
            self.driver.not_written(out)

    async def backlogs_coming(self, *, unless_holding: bool = False) -> None:
        """Storage failed or came back: hold the windows until the senders' backlogs have arrived.
        ``unless_holding``: a hold that is on already keeps its start."""
        await self.writer_thread.run(self.feed.backlogs_coming, unless_holding)

    async def idle(self, idle_seconds: float) -> None:
        """No input (storage takes writes): let go of a hold whose backlog arrived, move event time on."""
        await self.writer_thread.run(self.feed.idle, idle_seconds)

    async def between_commits(self, flush: Flush) -> None:
        """Also under continuous ingest: a SIGKILL loses at most checkpoint_seconds of learned state."""
        if self.clock() >= self._next_checkpoint:
            self._next_checkpoint = self.clock() + self.driver.settings.checkpoint_seconds
            await self.checkpoint(flush)

    async def checkpoint(self, flush: Flush) -> None:
        """Save the detectors' learned state (on the writer thread, between two commits)."""
        # What the detectors closed before it is written first: the checkpoint's storage position says that
        # everything before it was seen, and a SIGKILL right after must not lose those windows and spikes.
        if not await flush():
            return
        started = time.perf_counter()
        try:
            await self.writer_thread.run(self.probe)
        except Exception as exc:
            self.health.note("detector checkpoint", exc)
            return
        self.telemetry.checkpoint_seconds.observe(time.perf_counter() - started)

    def probe(self) -> None:
        """On the writer thread: save the checkpoint, with the position storage is at now (between two commits).
        Sizeable, so a write of it during a storage episode tells whether a full disk has room again."""
        checkpoints.save(self.engine, CHECKPOINT_NAME, CHECKPOINT_FORMAT, self.driver.snapshot())
        release_free_heap()  # the pickle's tens of MB, and whatever a catch-up freed (spikehound/heap.py)
