"""Per-stream spike state: judge each closed window, open spikes, resolve them with hysteresis.

For every closed latency window the tracker decides whether the stream's p99
is in a spike. A window is **anomalous** only when all of these hold, so that
neither a lone slow request nor a 2 ms -> 3 ms wobble at 3 a.m. pages anyone:

- the stream is warm (its :class:`~detectors.p99_spike.P99SpikeDetector` has
  learned ``grace_windows`` normal windows);
- the p99 is at least ``min_rise`` above the baseline, and ``min_abs_rise_ns``;
- the rise is *sustained* across requests, not one outlier: the detector's
  score, the surprise of the number of requests slower than the baseline p99,
  is at least ``min_score`` (``-log10`` of a binomial tail probability).

A spike opens on the first anomalous window, so it is found one window (plus
the allowed lateness) after its onset. It stays open while windows stay
elevated and resolves after ``resolve_windows`` calm windows in a row
(hysteresis: *calm* is under half the opening rise), or when the stream has
had no traffic for ``max_merge_windows`` windows. The baseline learns only
from windows judged normal while no spike is open, so a spike never teaches
itself to be normal; a spike open for ``adapt_after_windows`` windows is taken
as the new normal and learned from again.

Low-traffic streams (fewer than ``min_requests`` requests in a window) are
judged over the last windows merged, up to ``max_merge_windows`` back, and not
at all until those hold ``min_requests``: a p99 of five requests means nothing.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from detectors.p99_spike import P99SpikeDetector
from detectors.settings import DetectionSettings
from detectors.windows import nearest_rank
from spikehound.model import LatencyWindow

__all__ = ["Judgement", "OpenSpike", "SpikeEvent", "SpikeTracker", "spike_id", "tail_band"]

Stream = tuple[str, str]
Sample = tuple[int, bytes, bytes]  # (duration ns, trace id, entry span id)


@dataclass(slots=True)
class Judgement:
    """The verdict on one closed window of one stream (merged with earlier ones on low traffic)."""

    stream: Stream
    window_start_ns: int
    window_end_ns: int
    count: int
    p99_ns: int
    baseline_ns: int
    score: float
    exceed: int  # requests slower than the baseline p99
    anomalous: bool
    samples: list[Sample]  # the judged requests, fastest first
    onset_ns: int  # start of the earliest judged window holding a request over the baseline


@dataclass(slots=True)
class OpenSpike:
    """A spike while the tracker holds it; the engine turns it into a :class:`spikehound.model.Spike`."""

    id: str
    stream: Stream
    start_ns: int
    last_anomalous_end_ns: int
    detected_ns: int
    baseline_ns: int
    peak_p99_ns: int
    windows: int = 1
    calm: int = 0
    end_ns: int | None = None
    slowest: Sample | None = None

    @property
    def state(self) -> str:
        return "open" if self.end_ns is None else "resolved"


@dataclass(slots=True)
class SpikeEvent:
    kind: str  # "opened" | "updated" | "resolved"
    spike: OpenSpike
    judgement: Judgement | None = None


@dataclass(slots=True)
class _StreamState:
    detector: P99SpikeDetector
    recent: deque[tuple[int, int, tuple[Sample, ...]]] = field(default_factory=deque)
    spike: OpenSpike | None = None
    last_end_ns: int = 0


def spike_id(stream: Stream, start_ns: int) -> str:
    """A spike's id: stable for the same stream and start, so a replay names it as live ingest did.

    >>> spike_id(("gateway", "POST /predict"), 1_700_000_000_000_000_000)
    'e9b6cebdb3f417e2'
    """
    key = f"{stream[0]}\0{stream[1]}\0{start_ns}".encode()
    return hashlib.blake2b(key, digest_size=8).hexdigest()


class SpikeTracker:
    """Judges closed windows per stream and keeps each stream's spike state; pure, no clock."""

    def __init__(self, settings: DetectionSettings) -> None:
        self.settings = settings
        self.evicted_streams = 0
        self.open_count = 0  # kept as a number: /metrics reads it from another thread
        # Least recently judged first; bounded by max_streams so that a storm of one-off operation
        # names cannot grow it without end (a stream with an open spike is never evicted).
        self._streams: OrderedDict[Stream, _StreamState] = OrderedDict()

    # -- input -------------------------------------------------------------

    def judge(self, window: LatencyWindow, watermark_ns: int) -> tuple[Judgement | None, list[SpikeEvent]]:
        """Judge one closed window; return the verdict (None: too few requests yet) and what changed.

        A verdict that is not anomalous while no spike is open was learned as normal.
        """
        stream = (window.service, window.operation)
        state = self._state(stream)
        state.last_end_ns = max(state.last_end_ns, window.end_unix_nano)
        judgement = self._judgement(state, window)
        if judgement is None:
            return None, []
        return judgement, self._update(state, judgement, watermark_ns)

    def expire(self, watermark_ns: int) -> list[SpikeEvent]:
        """Resolve open spikes of streams that have gone quiet (no windows for max_merge_windows)."""
        s = self.settings
        horizon = watermark_ns - s.max_merge_windows * s.window_ns
        out = []
        for state in self._streams.values():
            spike = state.spike
            if spike is not None and state.last_end_ns < horizon:
                out.append(self._resolve(state, spike))
        return out

    # -- introspection -----------------------------------------------------

    @property
    def open_spikes(self) -> list[OpenSpike]:
        return [st.spike for st in self._streams.values() if st.spike is not None]

    def baseline_ns(self, stream: Stream) -> int | None:
        state = self._streams.get(stream)
        return int(state.detector.baseline) if state and state.detector.n_learned else None

    def is_warm(self, stream: Stream) -> bool:
        state = self._streams.get(stream)
        return bool(state and state.detector.warm)

    def in_spike(self, stream: Stream) -> bool:
        state = self._streams.get(stream)
        return bool(state and state.spike is not None)

    def __len__(self) -> int:
        return len(self._streams)

    # -- internals ---------------------------------------------------------

    def _state(self, stream: Stream) -> _StreamState:
        state = self._streams.get(stream)
        if state is not None:
            self._streams.move_to_end(stream)
            return state
        s = self.settings
        if len(self._streams) >= s.max_streams:
            for old, old_state in self._streams.items():
                if old_state.spike is None:
                    del self._streams[old]
                    self.evicted_streams += 1
                    break
        state = _StreamState(P99SpikeDetector(window_size=s.baseline_windows, grace_period=s.grace_windows))
        self._streams[stream] = state
        return state

    def _judgement(self, state: _StreamState, window: LatencyWindow) -> Judgement | None:
        s = self.settings
        stream = (window.service, window.operation)
        if window.count >= s.min_requests:
            state.recent.clear()
            parts: list[tuple[int, int, tuple[Sample, ...]]] = [(window.start_unix_nano, window.end_unix_nano,
                                                                  window.samples)]
            samples = list(window.samples)
        else:
            horizon = window.end_unix_nano - s.max_merge_windows * s.window_ns
            state.recent.append((window.start_unix_nano, window.end_unix_nano, window.samples))
            while state.recent and state.recent[0][0] < horizon:
                state.recent.popleft()
            parts = list(state.recent)
            samples = sorted(x for _, _, part in parts for x in part)
            if len(samples) < s.min_requests:
                return None
        durations = [d for d, _, _ in samples]
        p99 = nearest_rank(durations, 0.99)
        detector = state.detector
        baseline = int(detector.baseline)
        exceed = len(durations) - bisect.bisect_right(durations, baseline) if baseline else 0
        # Half the rise is enough to be scored: an open spike stays open while it holds (hysteresis).
        half_rise = detector.warm and p99 >= baseline * (1 + s.min_rise / 2) and p99 - baseline >= s.min_abs_rise_ns / 2
        material = half_rise and p99 >= baseline * (1 + s.min_rise) and p99 - baseline >= s.min_abs_rise_ns
        # The score last: it is the only costly test.
        score = detector.score_one({"p99": p99, "count": len(durations), "exceed": exceed}) if half_rise else 0.0
        anomalous = material and score >= s.min_score
        onset = window.start_unix_nano
        if anomalous:
            onset = min((start for start, _, part in parts if part and part[-1][0] > baseline), default=onset)
        return Judgement(stream=stream, window_start_ns=window.start_unix_nano, window_end_ns=window.end_unix_nano,
                         count=len(durations), p99_ns=p99, baseline_ns=baseline, score=score, exceed=exceed,
                         anomalous=bool(anomalous), samples=samples, onset_ns=onset)

    def _update(self, state: _StreamState, j: Judgement, watermark_ns: int) -> list[SpikeEvent]:
        s = self.settings
        spike = state.spike
        if spike is None:
            if not j.anomalous:
                state.detector.learn_one({"p99": j.p99_ns, "count": j.count, "exceed": j.exceed})
                return []
            spike = OpenSpike(id=spike_id(j.stream, j.onset_ns), stream=j.stream, start_ns=j.onset_ns,
                              last_anomalous_end_ns=j.window_end_ns, detected_ns=watermark_ns,
                              baseline_ns=j.baseline_ns, peak_p99_ns=j.p99_ns)
            self._keep_slowest(spike, j)
            state.spike = spike
            self.open_count += 1
            return [SpikeEvent("opened", spike, j)]

        spike.windows += 1
        if spike.windows >= s.adapt_after_windows:
            state.detector.learn_one({"p99": j.p99_ns, "count": j.count, "exceed": j.exceed})
        # Still elevated: half the opening rise, over many requests (a lone stall does not hold it open).
        elevated = j.score >= s.min_score / 2
        if j.anomalous or elevated:
            spike.calm = 0
            if j.anomalous or (elevated and j.p99_ns >= spike.baseline_ns * (1 + s.min_rise)):
                spike.last_anomalous_end_ns = j.window_end_ns
                spike.peak_p99_ns = max(spike.peak_p99_ns, j.p99_ns)
                self._keep_slowest(spike, j)
                return [SpikeEvent("updated", spike, j)]
            return []
        spike.calm += 1
        if spike.calm >= s.resolve_windows:
            return [self._resolve(state, spike)]
        return []

    def _resolve(self, state: _StreamState, spike: OpenSpike) -> SpikeEvent:
        spike.end_ns = spike.last_anomalous_end_ns
        state.spike = None
        self.open_count -= 1
        state.recent.clear()  # the spike's requests must not be judged again in a merged window
        return SpikeEvent("resolved", spike)

    @staticmethod
    def _keep_slowest(spike: OpenSpike, j: Judgement) -> None:
        if j.samples and (spike.slowest is None or j.samples[-1] > spike.slowest):
            spike.slowest = j.samples[-1]


def tail_band(samples: list[Sample], limit: int) -> list[Sample]:
    """Up to ``limit`` requests spread evenly over the p90-and-up tail of ascending ``samples``.

    >>> [d for d, _, _ in tail_band([(i, b"", b"") for i in range(1, 101)], 3)]
    [90, 95, 100]
    """
    n = len(samples)
    if n == 0 or limit < 1:
        return []
    p90_index = -(-9 * n // 10) - 1  # nearest-rank p90
    band = samples[p90_index:]
    if len(band) <= limit:
        return list(band)
    if limit == 1:
        return [band[-1]]
    step = (len(band) - 1) / (limit - 1)
    return [band[round(i * step)] for i in range(limit)]
