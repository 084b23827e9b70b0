"""The detection engine: spans and metric samples in, closed windows and spikes with causes out.

One object wires the detectors together, in the order the data needs:

1. committed spans feed the event-time latency windows and the trace buffer;
   metric samples feed the resource windows;
2. :meth:`DetectionEngine.advance` closes what the watermark allows: resource
   windows first (so their flags exist), then latency windows, each judged by
   the spike tracker;
3. a normal window teaches its stream's normal profile a few of its tail
   traces; an anomalous one opens or extends a spike, and the spike's tail
   traces are attributed against that profile, joined with resource flags.

It reads no clock and does no I/O, so the collector runs it on its writer
thread, ``spikehound replay`` runs it over files, and tests run it on
generated traffic, all with the same answers. Its whole learned state
(windows, baselines, profiles, open spikes, resource detectors; not the trace
buffer, which refills in seconds) round-trips through :meth:`snapshot` and
:meth:`restore`.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from detectors.attribution import Breakdown, NormalProfile, attribute, breakdown
from detectors.resource import ResourceFlag, ResourceWatch
from detectors.settings import DetectionSettings
from detectors.spike_tracker import Judgement, OpenSpike, SpikeEvent, SpikeTracker, tail_band
from detectors.trace_buffer import TraceBuffer
from detectors.windows import LatencyWindows
from spikehound.model import Cause, LatencyWindow, MetricPoint, Span, Spike

__all__ = ["CHECKPOINT_FORMAT", "Detection", "DetectionEngine"]

# Bump when the pickled state's layout changes: an older checkpoint is then ignored, not misread.
CHECKPOINT_FORMAT = 1
Stream = tuple[str, str]


@dataclass(slots=True)
class Detection:
    """What one step of the engine produced."""

    windows: list[LatencyWindow] = field(default_factory=list)
    spikes: list[Spike] = field(default_factory=list)  # opened, updated or resolved: their latest state
    flags: list[ResourceFlag] = field(default_factory=list)


class DetectionEngine:
    """Everything between committed telemetry and stored spikes; pure computation.

    >>> engine = DetectionEngine(DetectionSettings())
    >>> engine.add(spans=[], points=[])
    >>> engine.advance().spikes
    []
    """

    def __init__(self, settings: DetectionSettings) -> None:
        self.settings = settings
        s = settings
        self.windows = LatencyWindows(window_ns=s.window_ns, allowed_lateness_ns=s.allowed_lateness_ns,
                                      max_streams=s.max_streams)
        self.tracker = SpikeTracker(s)
        self.resources = ResourceWatch(window_ns=s.window_ns, max_series=s.max_resource_series,
                                       keep_windows=s.resource_flag_windows)
        self.traces = TraceBuffer(s.trace_buffer_spans)
        self.profiles: OrderedDict[Stream, NormalProfile] = OrderedDict()
        self._causes: dict[str, tuple[Cause, ...]] = {}
        # Per open spike: the critical-path breakdowns of the tail requests of its anomalous windows,
        # with their (trace id, entry span id). Held as breakdowns, not trace ids, so that the trace
        # buffer may forget the traces of a long spike without changing its attribution.
        self._slow: dict[str, list[tuple[bytes, bytes, Breakdown]]] = {}
        self._metric_max_ns: int | None = None
        self.spikes_opened = 0
        self.attributions_without_traces = 0

    # -- input -------------------------------------------------------------

    def add(self, spans: Iterable[Span] = (), points: Iterable[MetricPoint] = ()) -> None:
        """Take committed spans and metric samples (any order, any batch size)."""
        spans = spans if isinstance(spans, list) else list(spans)
        if spans:
            self.windows.add(spans)
            if self.settings.enabled:
                self.traces.add(spans)
        if not self.settings.enabled:
            return
        points = points if isinstance(points, list) else list(points)
        if points:
            self.resources.add(points)
            latest = max(p.time_unix_nano for p in points)
            if self._metric_max_ns is None or latest > self._metric_max_ns:
                self._metric_max_ns = latest

    def advance(self, idle_advance_ns: int = 0) -> Detection:
        """Close and judge what the watermark (moved on by ``idle_advance_ns`` when input is idle) allows."""
        return self._process(self.windows.close(idle_advance_ns), idle_advance_ns)

    def flush(self) -> Detection:
        """Close every open window (end of a replay). Open spikes stay open."""
        return self._process(self.windows.flush(), 0)

    # -- state -------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The learned state as bytes, for a checkpoint in storage."""
        state = {"windows": self.windows, "tracker": self.tracker, "resources": self.resources,
                 "profiles": self.profiles, "causes": self._causes, "slow": self._slow,
                 "metric_max_ns": self._metric_max_ns, "spikes_opened": self.spikes_opened,
                 "window_ns": self.settings.window_ns}
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def restore(cls, settings: DetectionSettings, blob: bytes) -> DetectionEngine:
        """An engine continuing from ``snapshot()`` bytes, under (possibly changed) ``settings``.

        Raises ValueError when the checkpoint cannot be continued (another window length).
        The bytes come from the collector's own database, never from a sender.
        """
        state = pickle.loads(blob)
        if state.get("window_ns") != settings.window_ns:
            raise ValueError("the checkpoint was taken with another window length")
        engine = cls(settings)
        engine.windows = state["windows"]
        engine.windows.allowed_lateness_ns = settings.allowed_lateness_ns
        engine.windows.max_streams = settings.max_streams
        engine.tracker = state["tracker"]
        engine.tracker.settings = settings
        engine.resources = state["resources"]
        engine.profiles = state["profiles"]
        engine._causes = state["causes"]
        engine._slow = state["slow"]
        engine._metric_max_ns = state["metric_max_ns"]
        engine.spikes_opened = state["spikes_opened"]
        return engine

    def open_spikes(self) -> list[Spike]:
        return [self._spike(sp) for sp in self.tracker.open_spikes]

    def stats(self) -> dict[str, int]:
        """Counters and sizes for the collector's /metrics (plain numbers: safe to read from another thread)."""
        return {
            "streams": self.windows.streams,
            "late_spans": self.windows.late_spans,
            "overflow_spans": self.windows.overflow_spans,
            "judged_streams": len(self.tracker),
            "evicted_streams": self.tracker.evicted_streams,
            "open_spikes": self.tracker.open_count,
            "spikes_opened": self.spikes_opened,
            "trace_buffer_spans": self.traces.spans,
            "trace_buffer_evicted_traces": self.traces.evicted_traces,
            "attributions_without_traces": self.attributions_without_traces,
            "resource_series": self.resources.series,
            "resource_late_points": self.resources.late_points,
            "resource_overflow_points": self.resources.overflow_points,
        }

    # -- internals ---------------------------------------------------------

    def _process(self, closed: list[LatencyWindow], idle_advance_ns: int) -> Detection:
        s = self.settings
        watermark = self.windows.watermark
        resource_watermark = watermark
        if self._metric_max_ns is not None:
            from_metrics = self._metric_max_ns - s.allowed_lateness_ns + idle_advance_ns
            resource_watermark = from_metrics if watermark is None else max(watermark, from_metrics)
        out = Detection(windows=closed)
        if not s.enabled:
            return out
        if resource_watermark is not None:
            out.flags = self.resources.close(resource_watermark)
        if watermark is None:
            return out
        changed: dict[str, OpenSpike] = {}
        # Detection happens when the latest event time seen reaches the window's end plus the lateness.
        now = watermark + s.allowed_lateness_ns
        for window in closed:
            judgement, events = self.tracker.judge(window, now)
            if judgement is not None and not events and not self.tracker.in_spike(judgement.stream):
                self._learn_normal(judgement)
            for event in events:
                self._on_event(event)
                changed[event.spike.id] = event.spike
        for event in self.tracker.expire(watermark):
            changed[event.spike.id] = event.spike
        out.spikes = [self._spike(sp) for sp in changed.values()]
        for sp in changed.values():
            if sp.end_ns is not None:
                self._causes.pop(sp.id, None)
                self._slow.pop(sp.id, None)
        return out

    def _profile(self, stream: Stream) -> NormalProfile:
        profile = self.profiles.get(stream)
        if profile is None:
            if len(self.profiles) >= self.settings.max_streams:
                self.profiles.popitem(last=False)
            profile = self.profiles[stream] = NormalProfile()
        else:
            self.profiles.move_to_end(stream)
        return profile

    def _learn_normal(self, j: Judgement) -> None:
        profile = self._profile(j.stream)
        for _, trace_id, span_id in tail_band(j.samples, self.settings.normal_traces_per_window):
            profile.learn(breakdown(self.traces.trace(trace_id), span_id))
        _, trace_id, _ = j.samples[len(j.samples) // 2]
        if trace_id in self.traces:
            profile.normal_trace_id = trace_id

    def _on_event(self, event: SpikeEvent) -> None:
        if event.kind == "resolved" or event.judgement is None:
            return
        if event.kind == "opened":
            self.spikes_opened += 1
        s = self.settings
        spike, j = event.spike, event.judgement
        slow = self._slow.setdefault(spike.id, [])
        for _, trace_id, span_id in tail_band(j.samples, s.slow_traces_per_window):
            b = breakdown(self.traces.trace(trace_id), span_id)
            if b.components:
                slow.append((trace_id, span_id, b))
        if len(slow) > s.max_slow_traces:
            del slow[::2]  # thin evenly, so early and late windows of a long spike both stay represented
        if not slow:
            self.attributions_without_traces += 1
            return
        flags = self.resources.flags(None, spike.start_ns - s.window_ns, spike.last_anomalous_end_ns)
        causes = attribute([b for _, _, b in slow], self.profiles.get(spike.stream) or NormalProfile(), flags,
                           max_causes=s.max_causes)
        if causes:
            self._causes[spike.id] = tuple(causes)

    def slow_traces(self, spike_id: str) -> list[tuple[bytes, bytes]]:
        """(trace id, entry span id) of the slow requests an open spike was attributed from."""
        return [(trace_id, span_id) for trace_id, span_id, _ in self._slow.get(spike_id, ())]

    def _spike(self, sp: OpenSpike) -> Spike:
        exemplars: list[bytes] = []
        if sp.slowest is not None:
            exemplars.append(sp.slowest[1])
        profile = self.profiles.get(sp.stream)
        if profile is not None and profile.normal_trace_id is not None and profile.normal_trace_id not in exemplars:
            exemplars.append(profile.normal_trace_id)
        spike = Spike(id=sp.id, service=sp.stream[0], operation=sp.stream[1], state=sp.state,
                      start_unix_nano=sp.start_ns, end_unix_nano=sp.end_ns, p99_ns=sp.peak_p99_ns,
                      baseline_p99_ns=sp.baseline_ns, causes=self._causes.get(sp.id, ()),
                      exemplar_trace_ids=tuple(exemplars), detected_unix_nano=sp.detected_ns)
        return spike
