"""A single collector's detectors fed its own commits, synchronously, on whichever one thread runs them.

The one job here is what a detection driver fed by one collector's commits does: continue from a checkpoint
(read back the open windows' traces and replay what was committed after it), feed each commit, move event
time on when idle, and close the spikes storage holds open that the restored detectors do not know
(``orphans``). It runs in the collector's process on the writer thread (``local_detection.py``) or in the
detection process of its own (``detection_process.py``); neither it nor the driver writes to storage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from spikehound.collector.detection_driver import DetectionDriver
from spikehound.detectors.engine import Detection
from spikehound.model import MetricPoint, Span, Spike
from spikehound.storage.checkpoints import Checkpoint
from spikehound.storage.reader import Reader

__all__ = ["CommitFeed"]

log = logging.getLogger("spikehound.collector.detection")

# What a replay after a restart reads and feeds the detectors at a time: about one commit's spans, as live.
# Hundreds of thousands decoded at once left the detection process's heap in pieces (their few survivors, ids
# the trace buffer keeps, pinned the rest) and it kept that much memory for the rest of its life.
REPLAY_SPANS = 5_000
REPLAY_BLOCKS = 32  # and rows fetched at a time (a PostgreSQL driver fetches a query's rows whole)
REPLAY_POINTS = 20_000  # metric points likewise
OPEN_SPIKES_READ = 10_000  # open spikes read from storage at start (far more than ever open at once)


class CommitFeed:
    """Feeds ``driver`` one collector's commits; every call on the same thread, one at a time."""

    def __init__(self, driver: DetectionDriver, reader: Reader) -> None:
        self.driver = driver
        self.reader = reader
        self._orphans: list[Spike] = []  # open in storage, unknown to the restored detectors (see resume)

    def resume(self, found: Checkpoint | None) -> None:
        """Continue from ``found``, if it fits, and feed what was committed after it; learn which spikes are
        open (the driver's and storage's); keep those the detectors do not know to close later."""
        replayed = False
        if self.driver.restore(found):
            assert found is not None
            # What was committed after the checkpoint is replayed, the windows closing as they did live: held
            # instead, they kept every replayed request until the hold ended, and the process kept that much
            # memory for the rest of its life. Then senders that spooled while the collector was down send
            # their backlogs: the windows wait for them where the replay left them, as they were at the kill.
            self.driver.refill_traces(self.reader, found)
            replayed = self._replay_committed(found)
            self.driver.begin_catch_up()
        stored = self.reader.spikes(None, None, None, "open", OPEN_SPIKES_READ)
        known = {spike.id for spike in self.driver.detection.open_spikes()}
        # Opened after the checkpoint the detectors continue from (the collector was killed in between). After
        # a replay the detectors find them again (same id) once the held windows are judged; without one (a
        # checkpoint that does not say where storage stood) they do not know them, and nothing would ever
        # resolve them. Those left are closed at the last window that saw them anomalous, once event time has
        # moved past it (alerting announces them meanwhile, as it would any open spike it finds at start).
        self._orphans = [spike for spike in stored if spike.id not in known]
        self.driver.knows_open([spike.id for spike in stored])
        if self._orphans and not replayed:
            log.warning("%d spike(s) open in storage are not in the detectors' checkpoint (the collector stopped "
                        "without saving it): they will be closed at their last anomalous window once event time "
                        "passes it: %s", len(self._orphans), ", ".join(s.id for s in self._orphans[:10]))

    def committed(self, spans: Sequence[Span], points: Sequence[MetricPoint]) -> None:
        """One commit's records, right after it; never raises (a detector failure is counted)."""
        if not spans and not points:
            return  # a write of windows and spikes alone
        self.driver.feed(spans, points)
        self.driver.release_if_caught_up()
        self._close_orphans()

    def idle(self, idle_seconds: float) -> None:
        """No span came for ``idle_seconds`` (storage takes writes): let go of a hold, move event time on."""
        self.driver.step(idle_seconds)
        self._close_orphans()

    def backlogs_coming(self, unless_holding: bool) -> None:
        """Hold the windows until the senders' backlogs have arrived (``unless_holding``: keep a hold's start)."""
        if unless_holding and self.driver.catch_up.active:
            return
        self.driver.begin_catch_up()

    # -- replay after a restart --------------------------------------------------------------------

    def _replay_committed(self, found: Checkpoint) -> bool:
        """Feed the restored detectors what was committed after their checkpoint (the collector was killed
        before it saved another): every committed span is seen once, and what they make of it waits for the
        next commit (windows and spikes are upserts: writing one again changes nothing)."""
        if found.span_block_id is None or found.points_ingested_at is None:
            log.info("the checkpoint does not say where storage stood: nothing committed after it is replayed")
            return False
        started = time.perf_counter()
        # Metric points first, under a hold: they are read back by series, not by time, and one series' later
        # points must not close the windows another's still fill (nor may the spans). A few per host and
        # second, they are small beside the spans.
        self.driver.hold()
        key, points = (0, -(2**63)), 0
        # The checkpoint's second is replayed whole, so some of these were seen: those in open windows are
        # skipped as repeats; those whose window was judged were seen, or were late then too.
        judged = self.driver.detection.resources.judged
        while True:
            key, chunk = self.reader.points_since(found.points_ingested_at, key, REPLAY_POINTS)
            if not chunk:
                break
            unseen = [p for p in chunk if not judged(p.time_unix_nano)]
            self.driver.feed([], unseen, replayed=True)
            points += len(unseen)
        # Then the spans in commit order, the windows closing as they did live.
        self.driver.let_go()
        block, spans = found.span_block_id, 0
        while True:
            block, chunk = self.reader.spans_after(block, REPLAY_BLOCKS, REPLAY_SPANS)
            if not chunk:
                break
            self.driver.feed(chunk, [], replayed=True)
            spans += len(chunk)
        log.info("replayed what was committed after the checkpoint to the detectors: %d spans, %d metric points "
                 "in %.2f s", spans, points, time.perf_counter() - started)
        return True

    def _close_orphans(self) -> None:
        """Resolve the orphans whose last anomalous window event time has passed (see ``resume``).

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
