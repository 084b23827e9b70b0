"""The one driver of the detection engine: a single collector's and a cluster leader's detection alike.

Both feed a :class:`DetectionEngine` the records storage committed, commit by commit, in the order they were
committed; they differ only in where those records come from: a single collector's own writer commits them
(``local_detection.py``), a cluster's leader reads every member's commits from the feed
(``cluster/leader.py``). Everything else is here, once: continuing from a checkpoint, reading back the traces
of the windows still open, holding the windows while backlogs drain (``catch_up.py``), moving event time on
when input is idle, keeping what each step produced for the next write, and announcing it once written.

The driver is not thread-safe: every method but ``stats`` runs on the one thread its source runs detection on
(the writer thread of a single collector, the leader's own thread), one call at a time.

>>> from spikehound.config import load
>>> detection_settings(load(env={"SPIKEHOUND_DETECTION_MIN_RISE": "0.3"})).min_rise
0.3
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from spikehound.collector.catch_up import CatchUp, close_held, hold_where_the_data_is
from spikehound.collector.detector_metrics import DetectorMetrics
from spikehound.collector.outgoing import Outgoing
from spikehound.collector.spike_announcer import SpikeAnnouncer
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.config import Config
from spikehound.detectors.engine import CHECKPOINT_FORMAT, Detection, DetectionEngine
from spikehound.detectors.settings import DetectionSettings
from spikehound.heap import release_free_heap
from spikehound.model import MetricPoint, Span
from spikehound.storage.checkpoints import Checkpoint
from spikehound.storage.reader import Reader
from spikehound.units import MS, NS

__all__ = ["CHECKPOINT_NAME", "DetectionDriver", "DriverSettings", "StepFailures", "detection_settings"]

log = logging.getLogger("spikehound.collector.detection")

# The one checkpoint row: a single collector and a cluster's leader keep the same one, so a collector that
# joins a cluster (or leaves it) continues from it.
CHECKPOINT_NAME = "detection"
REFILL_BLOCKS = 32  # span blocks read back at a time into the trace buffer


def detection_settings(cfg: Config) -> DetectionSettings:
    """The detection engine's settings from the collector's configuration (``spikehound replay`` reads them
    here too, so that a replay judges as the collector with the same file would)."""
    c, d = cfg.collector, cfg.detection
    return DetectionSettings(
        enabled=d.enabled,
        window_ns=int(c.window_seconds * NS),
        allowed_lateness_ns=int(c.allowed_lateness_seconds * NS),
        max_streams=c.max_streams,
        baseline_windows=d.baseline_windows,
        grace_windows=d.grace_windows,
        min_requests=d.min_requests,
        max_merge_windows=d.max_merge_windows,
        min_rise=d.min_rise,
        min_abs_rise_ns=int(d.min_abs_rise_ms * MS),
        min_score=d.min_score,
        resolve_windows=d.resolve_windows,
        hop_streams=d.hop_streams,
        split_generic=d.split_generic_operations,
        grace_requests=d.grace_requests,
        min_evidence=d.min_evidence,
        min_slow_requests=d.min_slow_requests,
        end_evidence=d.end_evidence,
        trace_buffer_spans=d.trace_buffer_spans,
        max_causes=d.max_causes,
    )


@dataclass(frozen=True, slots=True)
class DriverSettings:
    """What the driver reads from the configuration, converted once."""

    detection: DetectionSettings
    idle_flush_seconds: float
    allowed_lateness_seconds: float
    max_clock_skew_ns: int  # event time never runs past the clock by more than the receivers accept
    catch_up_seconds: float
    checkpoint_seconds: float

    @classmethod
    def from_config(cls, cfg: Config) -> DriverSettings:
        c = cfg.collector
        return cls(detection=detection_settings(cfg), idle_flush_seconds=c.idle_flush_seconds,
                   allowed_lateness_seconds=c.allowed_lateness_seconds,
                   max_clock_skew_ns=int(c.max_clock_skew_seconds * NS), catch_up_seconds=c.catch_up_seconds,
                   checkpoint_seconds=cfg.detection.checkpoint_seconds)


class StepFailures:
    """What failed on a committed batch after its commit (a detector step, a commit hook): counted in
    ``spikehound_detector_errors_total{part}``, logged with its traceback once per part and kind of error.

    Such a failure is never a failed write: the batch is stored and its senders were told so.
    """

    def __init__(self, errors: Counter) -> None:
        self.errors = errors
        self.counts: dict[str, int] = {}  # per part, as counted here (a detection process reports them)
        self._seen: set[tuple[str, str]] = set()

    def count(self, part: str, what: str, exc: Exception) -> None:
        self.errors.labels(part).inc()
        self.counts[part] = self.counts.get(part, 0) + 1
        kind = (part, exc.__class__.__name__)
        if kind not in self._seen:  # one traceback per part and kind, not one per batch
            self._seen.add(kind)
            log.error("%s failed on a batch (stored anyway); counted in spikehound_detector_errors_total, further "
                      "%s errors are not logged", what, kind[1], exc_info=exc)

    def commit_hook_failed(self, exc: Exception) -> None:
        self.count("metrics", "a commit hook (span or resource metrics)", exc)


class DetectionDriver:
    """Feeds one detection engine, ``detection``, and keeps what it produced until it is written.

    ``advance_while_held`` says whether idle time moves event time on while the windows are held. A single
    collector keeps it still (its senders hold their data during a storage episode and send it afterwards); a
    cluster's leader lets it move, since a missing member can hold the windows until it is declared gone, and
    the held windows then close, a window at a time, as far as idle time has brought them.
    """

    def __init__(self, settings: DriverSettings, telemetry: CollectorTelemetry, *, advance_while_held: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.advance_while_held = advance_while_held
        self.clock = clock  # seconds, for the catch-up; tests step it
        self.detection = DetectionEngine(settings.detection)
        self.catch_up = CatchUp(settings.catch_up_seconds, clock=clock)
        # Told of every written step; its listeners (alerting) of every spike state written.
        self.announcer = SpikeAnnouncer(telemetry)
        self.metrics = DetectorMetrics(self.stats)  # for the daemon to register
        self.failures = StepFailures(self.metrics.errors)
        self.outgoing = Outgoing()  # windows and spikes produced and not yet committed
        self._open_windows = 0  # (stream, window) pairs not yet judged, as of the last step
        self._data_lag_ns = 0  # how far the newest live data trailed the clock, as of the last feed (CatchUp.begin)

    def stats(self) -> dict[str, int]:
        """The detection engine's own figures now (the detector metrics read them when scraped, from any thread)."""
        held = self.catch_up.active or self.detection.windows.hold is not None
        return {**self.detection.stats(), "open_windows": self._open_windows, "catching_up": int(held),
                "process_restarts": 0, "waiting_bytes": 0}

    # -- continuing ----------------------------------------------------------------------------

    def restore(self, found: Checkpoint | None) -> bool:
        """Continue from ``found``; False when the detectors start fresh (none, another format, unreadable)."""
        self.reset()
        if found is None:
            log.info("detectors start fresh: no checkpoint")
            return False
        if found.format != CHECKPOINT_FORMAT:
            log.warning("detectors start fresh: the checkpoint has format %d, this version writes %d",
                        found.format, CHECKPOINT_FORMAT)
            return False
        try:
            self.detection = DetectionEngine.restore(self.settings.detection, found.state)
        except Exception as exc:
            log.warning("detectors start fresh: the checkpoint cannot be continued (%s: %s)",
                        exc.__class__.__name__, exc)
            return False
        if self.detection.limit_event_time(self._latest_event_time()):
            log.warning("the checkpoint's event time ran past this collector's clock plus "
                        "collector.max_clock_skew_seconds (a sender's clock was wrong): brought back, and the "
                        "windows beyond dropped")
        log.info("detectors restored from the checkpoint of %s: %d streams, %d open spikes",
                 time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(found.saved_at)),
                 self.detection.stats()["judged_streams"], len(self.detection.open_spikes()))
        self._open_windows = self.detection.windows.open_windows
        self._data_lag_ns = self._lag_behind(found.saved_at * NS)
        return True

    def reset(self) -> None:
        """A fresh detection engine and catch-up, nothing outgoing (a leader that stepped down; before a restore)."""
        self.detection = DetectionEngine(self.settings.detection)
        self.catch_up = CatchUp(self.settings.catch_up_seconds, clock=self.clock)
        self.outgoing = Outgoing()
        self._open_windows = 0

    def refill_traces(self, reader: Reader, found: Checkpoint, exclude: Collection[int] = ()) -> int:
        """Read back the traces of the windows still open at the checkpoint (they are not part of it), into the
        trace buffer only (the windows counted them already), so that a spike judged from them is attributed
        from whole traces as it would have been live. Blocks up to the checkpoint's position, but for those in
        ``exclude`` (the detectors are fed those anyway); how many spans."""
        earliest = self.detection.windows.earliest_open_ns
        if found.span_block_id is None or earliest is None:
            return 0
        since = earliest - self.settings.detection.window_ns  # and the window before, to compare with
        after: int | None = None
        spans = 0
        while True:
            last, chunk = reader.spans_ending_since(since, found.span_block_id, after, REFILL_BLOCKS,
                                                    exclude=exclude)
            self.detection.traces.add(chunk)
            spans += len(chunk)
            if last >= found.span_block_id or last == after:
                break
            after = last
        if spans:
            log.info("read back %d spans of the open windows' traces from before the checkpoint", spans)
        return spans

    def knows_open(self, stored_open: Sequence[str]) -> None:
        """The spikes open now: the detection engine's and ``stored_open`` (ids found open in storage); a state of one
        of them that is written next is an update, not an opening."""
        self.announcer.open_ids = {s.id for s in self.detection.open_spikes()} | set(stored_open)

    # -- feeding ---------------------------------------------------------------------------------

    def feed(self, spans: Sequence[Span], points: Sequence[MetricPoint], *, replayed: bool = False) -> None:
        """One commit's records: into the windows, then close what the watermark allows (kept for writing).
        ``replayed``: read back from storage after a restart, no sender's backlog (the catch-up ignores them)."""
        def add_and_advance() -> Detection:
            self.detection.add(spans, points)
            return self.detection.advance()

        self.keep(self.guarded(add_and_advance))
        if replayed or not spans:
            return
        if self.catch_up.active:
            self.catch_up.arrived([s.end_unix_nano for s in spans], self.detection.windows.hold)
        else:
            self._data_lag_ns = self._lag_behind(time.time_ns())

    def step(self, idle_seconds: float, *, source_waits: bool = False, busy: bool = False) -> None:
        """Between inputs: let go of the hold once the backlog has arrived (unless the source still waits for
        data, ``source_waits``), else move event time on when no span has come for ``idle_seconds`` (unless the
        source has data on its way, ``busy``). Only spans count as input: agents' host metrics keep coming
        when span traffic stops (a quiet night, a dead service), and the last windows, with any spike open in
        them, must still close."""
        released = self.release_if_caught_up(source_waits)
        if busy:
            return
        if released if self.advance_while_held else self.catch_up.active:
            return
        if idle_seconds < self.settings.idle_flush_seconds:
            return
        advance = int((self.settings.allowed_lateness_seconds + idle_seconds) * NS)
        watermark = self.detection.windows.watermark
        if watermark is not None:  # never past the clock plus the skew the receivers allow
            advance = max(min(advance, self._latest_event_time() - watermark), 0)
        self.keep(self.guarded(self.detection.advance, advance))

    def release_if_caught_up(self, source_waits: bool = False) -> bool:
        """Once the backlog has arrived (see CatchUp), move the held watermark to where the data is, a window at
        a time, as live traffic would have moved it (each step's spike states are kept, in order); whether it
        did."""
        if source_waits:
            return False
        if self.catch_up.active and not self.catch_up.done():
            return False
        if self.detection.windows.hold is None:
            return False
        steps = close_held(self.detection, self.settings.detection.window_ns,
                           lambda: self.keep(self.guarded(self.detection.advance)))
        log.info("caught up: the backlogs have arrived; the windows held open were closed in %d step(s)", steps)
        release_free_heap()  # what the held windows took (spikehound/heap.py)
        return True

    def begin_catch_up(self) -> None:
        """Backlogs are on their way (storage failed or came back, a restart, a member returned): hold the
        windows where the data has brought them until they have arrived."""
        self.catch_up.begin(self._data_lag_ns)
        if self.catch_up.active:
            self.hold()

    def hold(self) -> None:
        """Cap the windows' watermark where the data has brought it, unless it is capped already."""
        hold_where_the_data_is(self.detection)

    def let_go(self) -> None:
        """Lift a cap that held nothing back (the data has not moved past it): the next step closes the windows
        as far as the data goes, as any step does."""
        self.detection.hold(None)

    def guarded(self, fn: Callable[..., Detection], *args: int) -> Detection:
        """Run a detector step; a bug set off by odd input costs that step, never ingest or the leadership."""
        try:
            return fn(*args)
        except Exception as exc:
            self.failures.count("detectors", "the detectors", exc)
            return Detection()
        finally:  # counted here: /metrics must not walk the detectors' dicts from another thread
            self._open_windows = self.detection.windows.open_windows

    # -- writing ---------------------------------------------------------------------------------

    def keep(self, step: Detection) -> None:
        """Keep a step's windows and spikes for the next write: every state, in order (a spike that opened and
        resolved since the last write is announced and alerted as both; the writer keeps the last)."""
        self.outgoing.keep(step)

    def take_outgoing(self) -> Detection:
        """Hand over what waits to be written; give it back with ``not_written`` if the write fails."""
        return self.outgoing.take()

    def not_written(self, out: Detection) -> None:
        """``out``'s write failed: it goes out again first, with the next write."""
        self.outgoing.give_back(out)

    def written(self, out: Detection) -> None:
        """``out`` is committed: count it and announce its spike states."""
        self.announcer.written(out)

    def snapshot(self) -> bytes:
        return self.detection.snapshot()

    def _lag_behind(self, clock_ns: int) -> int:
        """How far the newest span end seen (the data's watermark plus the allowed lateness) trails ``clock_ns``."""
        watermark = self.detection.windows.data_watermark
        if watermark is None:
            return 0
        return max(clock_ns - watermark - self.settings.detection.allowed_lateness_ns, 0)

    def _latest_event_time(self) -> int:
        return time.time_ns() + self.settings.max_clock_skew_ns
