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
from dataclasses import replace

from sqlalchemy import Engine

from spikehound.collector.detection_driver import CHECKPOINT_NAME, DetectionDriver
from spikehound.collector.pipeline import Flush
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.detectors.engine import CHECKPOINT_FORMAT, Detection
from spikehound.heap import release_free_heap
from spikehound.model import Spike
from spikehound.storage import checkpoints
from spikehound.storage.reader import Reader
from spikehound.storage.writer import WriteBatch

__all__ = ["LocalDetection"]

log = logging.getLogger("spikehound.collector.detection")

REPLAY_BLOCKS = 256  # span blocks read and fed to the detectors at a time when replaying after a restart
REPLAY_POINTS = 20_000  # metric points likewise
OPEN_SPIKES_READ = 10_000  # open spikes read from storage at start (far more than ever open at once)

class LocalDetection:
    """Implements the pipeline's ``CommitDetection``; its calls come from the pipeline's one task."""

    def __init__(self, driver: DetectionDriver, engine: Engine, writer_thread: WriterThread, health: StorageHealth,
                 telemetry: CollectorTelemetry, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.driver = driver
        self.engine = engine
        self.reader = Reader(engine)
        self.writer_thread = writer_thread
        self.health = health  # told of checkpoints that fail
        self.telemetry = telemetry
        self.clock = clock  # seconds, for the checkpoint schedule; tests step it
        self._orphans: list[Spike] = []  # open in storage, unknown to the restored detectors (see start)
        self._next_checkpoint = clock() + driver.settings.checkpoint_seconds

    # -- start and stop ---------------------------------------------------------------------------

    async def start(self, flush: Flush) -> None:
        """Continue from the last checkpoint, if one fits, and feed what was committed after it; close the
        spikes it does not know; then save a checkpoint at once."""
        run = self.writer_thread.run
        found = await run(checkpoints.load, self.engine, CHECKPOINT_NAME)
        replayed = False
        if await run(self.driver.restore, found):
            assert found is not None
            # Senders that spooled while the collector was down send their backlogs now; and what was committed
            # after the checkpoint is replayed into windows that must stay open as they were before the kill.
            await run(self.driver.begin_catch_up)
            await run(self.driver.refill_traces, self.reader, found)
            replayed = await self._replay_committed(found)
        stored = await run(self.reader.spikes, None, None, None, "open", OPEN_SPIKES_READ)
        known = await run(self._engine_open_ids)
        # Opened after the checkpoint the detectors continue from (the collector was killed in between). After
        # a replay the detectors find them again (same id) once the held windows are judged; without one (a
        # checkpoint that does not say where storage stood) they do not know them, and nothing would ever
        # resolve them. Those left are closed at the last window that saw them anomalous, once event time has
        # moved past it (alerting announces them meanwhile, as it would any open spike it finds at start).
        self._orphans = [spike for spike in stored if spike.id not in known]
        await run(self.driver.knows_open, [spike.id for spike in stored])
        if self._orphans and not replayed:
            log.warning("%d spike(s) open in storage are not in the detectors' checkpoint (the collector stopped "
                        "without saving it): they will be closed at their last anomalous window once event time "
                        "passes it: %s", len(self._orphans), ", ".join(s.id for s in self._orphans[:10]))
        # At once, not only every checkpoint_seconds: it says where storage stands, so that a collector killed
        # before its first periodic checkpoint (a crash loop, a kill in its first minute) replays what it
        # committed instead of starting its detectors from nothing.
        await self.checkpoint(flush)

    async def stop(self, flush: Flush) -> None:
        """Open windows are not flushed: they are in the checkpoint, and a restart continues them."""
        await self.checkpoint(flush)

    def _engine_open_ids(self) -> set[str]:
        return {spike.id for spike in self.driver.detection.open_spikes()}

    async def _replay_committed(self, found: checkpoints.Checkpoint) -> bool:
        """Feed the restored detectors what was committed after their checkpoint (the collector was killed
        before it saved another): every committed span is seen once, and what they make of it waits for the
        next commit (windows and spikes are upserts: writing one again changes nothing)."""
        if found.span_block_id is None or found.points_ingested_at is None:
            log.info("the checkpoint does not say where storage stood: nothing committed after it is replayed")
            return False
        started = time.perf_counter()
        block, spans = found.span_block_id, 0
        while True:
            block, fed = await self.writer_thread.run(self._replay_spans, block)
            if not fed:
                break
            spans += fed
        key, points = (0, -(2**63)), 0
        while True:
            key, read, fed = await self.writer_thread.run(self._replay_points, found.points_ingested_at, key)
            if not read:
                break
            points += fed
        log.info("replayed what was committed after the checkpoint to the detectors: %d spans, %d metric points "
                 "in %.2f s", spans, points, time.perf_counter() - started)
        return True

    def _replay_spans(self, after: int) -> tuple[int, int]:
        block, chunk = self.reader.spans_after(after, REPLAY_BLOCKS)
        if chunk:
            self.driver.feed(chunk, [], replayed=True)
        return block, len(chunk)

    def _replay_points(self, since: int, after: tuple[int, int]) -> tuple[tuple[int, int], int, int]:
        key, chunk = self.reader.points_since(since, after, REPLAY_POINTS)
        read = len(chunk)
        # The checkpoint's second is replayed whole, so some of these were seen: those in open windows are
        # skipped as repeats; those whose window was judged were seen, or were late then too.
        judged = self.driver.detection.resources.judged
        chunk = [p for p in chunk if not judged(p.time_unix_nano)]
        if read:
            self.driver.feed([], chunk, replayed=True)
        return key, read, len(chunk)

    # -- the pipeline's calls ---------------------------------------------------------------------

    def committed(self, batch: WriteBatch) -> None:
        """On the writer thread, right after ``batch`` committed: feed its records; never raises."""
        if not batch.spans and not batch.points:
            return  # a write of windows and spikes alone
        self.driver.feed(batch.spans, batch.points)
        self.driver.release_if_caught_up()
        self._close_orphans()

    def take_outgoing(self) -> Detection:
        """The windows and spikes to write with the next commit, handed over."""
        return self.driver.take_outgoing()

    def has_outgoing(self) -> bool:
        out = self.driver.outgoing
        return bool(out.windows or out.spikes)

    def sent(self, out: Detection, committed: bool) -> None:
        """``out`` (from ``take_outgoing``) was committed, or goes out again with the next commit."""
        if committed:
            self.driver.written(out)
        else:
            self.driver.not_written(out)

    async def backlogs_coming(self, *, unless_holding: bool = False) -> None:
        """Storage failed or came back: hold the windows until the senders' backlogs have arrived.
        ``unless_holding``: a hold that is on already keeps its start."""
        if unless_holding and self.driver.catch_up.active:
            return
        await self.writer_thread.run(self.driver.begin_catch_up)

    async def idle(self, idle_seconds: float) -> None:
        """No input (storage takes writes): let go of a hold whose backlog arrived, move event time on."""
        await self.writer_thread.run(self._idle_step, idle_seconds)

    def _idle_step(self, idle_seconds: float) -> None:
        self.driver.step(idle_seconds)
        self._close_orphans()

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

    def _close_orphans(self) -> None:
        """Resolve the orphans whose last anomalous window event time has passed (see ``start``).

        Not while the windows are held: the replayed and the senders' data are still to be judged, and the
        detectors find most of them again (same id) once it is; those are no orphans.
        """
        if not self._orphans:
            return
        detection = self.driver.detection
        watermark = detection.windows.watermark
        if watermark is None or detection.windows.hold is not None:
            return
        known = {s.id for s in detection.open_spikes()} | {s.id for s in self.driver.outgoing.spikes}
        due: list[Spike] = []
        waiting: list[Spike] = []
        for spike in self._orphans:
            if spike.id in known:
                continue
            end = _last_anomalous_end(spike)
            if end + self.driver.settings.detection.window_ns <= watermark:
                due.append(replace(spike, state="resolved", end_unix_nano=end))
            else:
                waiting.append(spike)
        self._orphans = waiting
        if due:
            log.info("closed %d orphaned spike(s) as resolved: %s", len(due), ", ".join(s.id for s in due[:10]))
            self.driver.keep(Detection(spikes=due))


def _last_anomalous_end(spike: Spike) -> int:
    ends = [a.last_anomalous_end_unix_nano for a in spike.affected if a.last_anomalous_end_unix_nano]
    return max(ends, default=spike.detected_unix_nano or spike.start_unix_nano)
