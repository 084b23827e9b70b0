"""Per-stream judgement: every closed window of every stream, by two tests, and what each stream learns.

Each stream (entry or hop, see :mod:`spikehound.detectors.streams`) is judged two ways:

- the **window test** (:class:`~spikehound.detectors.p99_spike.P99SpikeDetector`) on a
  busy stream: is this window's p99 materially over the learned baseline
  (``min_rise`` and ``min_abs_rise_ns``), with enough requests over it that
  it is not bad luck (``min_score``)? A window with fewer than
  ``min_requests`` requests waits to be judged together with the windows after
  it, up to ``max_merge_windows`` of them (merged windows tumble: each request
  is judged once). This finds a rise within one window;
- the **sequential test** (:mod:`spikehound.detectors.sequential`) request by request:
  each request's surprise against the stream's learned normal requests goes
  into a CUSUM that carries across windows, so a stream with three calls a
  minute is judged on its last calls, whatever window they fell in.

A stream is *hot* when either test has something to say: the window test
fires, or the sequential evidence holds a slow request and reaches
``hot_evidence``. Hot streams are attributed and grouped into incidents by
:mod:`spikehound.detectors.incidents`; this module only judges.

Learning is held back while a stream is hot or in an incident, so that a
spike never teaches itself to be normal: the window test learns a window that
was judged normal, and the request pool learns a window's requests once the
evidence has gone back to zero without an incident (a lone stall is learned
then, as the normal tail it is). While a spike is open, and for the minute
before its onset (:attr:`StreamJudge.quarantine`), no stream learns a window
that held evidence or was elevated, and windows held back for later learning
that fall in that time are dropped. An incident open for
``adapt_after_windows`` windows is taken as the new normal: its streams learn
again. A stream too new to be judged holds back the requests that stand out
from what it learned, and drops them if a spike claimed their time or they came
in a cluster (see :meth:`StreamJudge._unproven`).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter

from spikehound.detectors.p99_spike import P99SpikeDetector
from spikehound.detectors.sequential import SequentialEvidence, TailSurprise
from spikehound.detectors.settings import DetectionSettings
from spikehound.detectors.streams import StreamKey
from spikehound.detectors.windows import Sample
from spikehound.model import LatencyWindow
from spikehound.units import NS

RECENT_NS = 600 * NS  # a stream judged in the last ten minutes (event time) is one of the hypotheses tested
SEQUENTIAL_MAX = 256  # requests of one window the sequential test reads (a busy one is thinned to this)
STRAGGLER_NS = 300 * NS  # how long after a spike ended a request of a trace begun during it may start
FAR_OUT = 3.0  # an unproven request this many times a new stream's slowest counts toward a cluster
COLD_SHIFT_NS = 1200 * NS  # a stream too new to judge whose requests stand out in clusters this long: a new normal
SPREAD_TRIM = 0.05  # of a fired window's excess over its baseline, left out at either end of its slow requests' span
EVICTION_SCAN = 64  # how many of the least recently judged streams eviction looks at for one never warm

WEAK_LEAD = 0.5  # a rise's leading request under this share of its typical one is no onset (both tests')

__all__ = ["Judgement", "StreamJudge", "tail_band"]


@dataclass(slots=True)
class Judgement:
    """The verdict on one closed window of one stream."""

    stream: StreamKey
    root: bool  # a stream of trace roots: what users see
    window_start_ns: int
    window_end_ns: int
    count: int  # requests the window test judged (merged with earlier windows on low traffic); 0: not judged
    p99_ns: int
    baseline_ns: int  # the learned normal p99 (the request pool's while the window test is not warm)
    score: float  # the window test's surprise (-log10 P), 0 when it did not judge
    dense: bool  # the window test fired: a material rise over many requests
    elevated: bool  # the window test still sees half the rise (what holds a busy stream's incident open)
    evidence: float  # the sequential evidence (-log10 units) after this window
    samples: list[Sample]  # this window's requests, fastest first
    judged: list[Sample]  # the requests the window test judged (this window, or merged with earlier ones)
    onset_ns: int  # where the rise began
    hot: bool = False  # worth attributing and grouping
    exceed: int = 0  # requests the window test judged that were slower than the baseline
    spread_ns: int = 0  # how far apart in time the slow requests of the window test ended
    busy: bool = False  # judged by the window test alone (enough requests in this one window, warm)
    # The sequential test's scores of this window's requests, (surprise, sample) in end-time order; empty
    # when it did not judge them (a busy window, or a stream not warm yet).
    scored: list[tuple[float, Sample]] = field(default_factory=list)
    standing: bool = False  # no request in this window: its evidence stands from earlier ones (see standing())

    @property
    def window(self) -> tuple[int, int]:
        return self.window_start_ns, self.window_end_ns


@dataclass(slots=True)
class _StreamState:
    window_test: P99SpikeDetector
    tail: TailSurprise
    evidence: SequentialEvidence
    root: bool = False
    recent: deque[tuple[int, int, tuple[Sample, ...]]] = field(default_factory=deque)
    # (window start, its durations) not learned yet: the evidence was above zero
    pending: list[tuple[int, list[int]]] = field(default_factory=list)
    # [window start, its durations, in a cluster (None: too near to count)] that stood out while the stream was
    # too new to judge them (see _unproven), and since when they have come in clusters (None: the last did not)
    unproven: list[list] = field(default_factory=list)
    clustered_since: int | None = None
    incident: str | None = None
    incident_windows: int = 0
    last_end_ns: int = 0


class StreamJudge:
    """Judges closed windows per stream and holds what each stream learned; pure, no clock."""

    def __init__(self, settings: DetectionSettings) -> None:
        self.settings = settings
        self.evicted_streams = 0
        # Least recently judged first; bounded by max_streams so that a storm of one-off operation names
        # cannot grow it without end (a stream in an incident is never evicted).
        self._streams: OrderedDict[StreamKey, _StreamState] = OrderedDict()
        # Event-time spans (from, to; None: still open) of spikes and the minute before each one's onset,
        # set by the engine: what falls in them is never learned as normal.
        self.quarantine: list[tuple[int, int | None]] = []
        # When a request's trace began (None: unknown), set by the engine from its trace buffer: a request of a
        # trace that began during a spike belongs to it, however late it ended.
        self.trace_start: Callable[[bytes], int | None] | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"settings": self.settings, "evicted_streams": self.evicted_streams, "_streams": self._streams,
                "quarantine": self.quarantine, "trace_start": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    # -- input -------------------------------------------------------------

    def judge(self, window: LatencyWindow, root: bool = False) -> Judgement:
        """Judge one closed window (nothing is learned yet: see :meth:`settle`)."""
        s = self.settings
        stream = StreamKey(window.service, window.operation, window.peer_service)
        state = self._state(stream)
        state.root = state.root or root
        state.last_end_ns = max(state.last_end_ns, window.end_unix_nano)
        j = self._window_test(state, stream, window)
        j.busy = window.count >= s.min_requests and state.window_test.warm
        if j.busy:
            # A busy window is the window test's to judge, and far more sensitive there; request by request
            # it would only add cost. The evidence starts from zero, and the window counts as calm or not.
            state.evidence.reset()
            state.evidence.calm_run = 0 if j.elevated or j.dense else state.evidence.calm_run + window.count
        else:
            # The sequential test: every request in end-time order, into the stream's running evidence. A
            # busy window whose window test is still learning is thinned evenly across its latencies (they
            # are sorted by duration): its rise shows as well in a few hundred, at a fraction of the cost.
            # The last requests of a spike that ended (their traces began while it lasted) are its, not news.
            samples = self.unclaimed(window.samples, ended_only=True)
            if len(samples) > SEQUENTIAL_MAX:
                samples = samples[::-(-len(samples) // SEQUENTIAL_MAX)]
            by_end = sorted(samples, key=itemgetter(3))
            surprises = state.tail.surprises([d for d, _, _, _ in by_end])
            scored = list(zip(surprises, by_end, strict=True))
            state.evidence.update(window.start_unix_nano, scored)
            if state.tail.warm:
                j.scored = scored
        j.evidence = state.evidence.value
        if j.count == 0:  # the window test did not judge: report this window's own numbers
            j.p99_ns = window.p99_ns
        if not j.baseline_ns:
            j.baseline_ns = int(state.tail.normal_p99())
        seq_onset = state.evidence.onset_ns
        if seq_onset is not None and not j.dense:
            j.onset_ns = seq_onset
        j.hot = j.dense or (bool(state.evidence.slow) and j.evidence >= s.hot_evidence)
        return j

    def settle(self, j: Judgement, incident: str | None) -> None:
        """After grouping: record the stream's incident and learn what may be learned from ``j``."""
        s = self.settings
        state = self._streams.get(j.stream)
        if state is None:
            return
        if incident is not None and state.incident != incident:
            state.incident, state.incident_windows = incident, 0
            state.pending.clear()  # the requests before it belonged to the rise
            state.unproven.clear()
        if state.incident is not None:
            state.incident_windows += 1
            if state.incident_windows < s.adapt_after_windows:
                return
        # A request that ran while a spike was open (or in the minute before it) is never learned as normal
        # by a stream that showed anything (evidence, an elevated window, a spike of its own), nor is such a
        # window; a stream that stayed calm all along keeps learning its calm requests.
        showed = state.evidence.value > 0.0 or j.elevated or j.hot or state.incident is not None
        samples = self.unclaimed(j.samples) if showed else j.samples
        doubtful = len(samples) < len(j.samples)
        if j.count and not j.dense and not j.hot and not doubtful:
            state.window_test.learn_one({"p99": j.p99_ns, "count": j.count, "exceed": j.exceed})
        learnable = _spread_over(samples, s.pool_per_window)
        if state.evidence.value > 0.0 and state.incident is None:
            # Learned once the evidence is back to zero without an incident, unless a spike claimed its time.
            state.pending.append((j.window_start_ns, learnable))
            if len(state.pending) > s.max_merge_windows * 30:
                self._learn_held(state, [state.pending.pop(0)])
            return
        self._learn_held(state, state.pending)
        state.pending.clear()
        if not doubtful:
            self._learn(state, self._unproven(state, j.window_start_ns, learnable))
        if state.unproven and state.unproven[0][0] <= j.window_start_ns - self.proving_ns:
            self._prove(state, j.window_start_ns - self.proving_ns)

    def release(self, stream: StreamKey) -> None:
        """The stream's incident resolved: its evidence starts again from zero."""
        state = self._streams.get(stream)
        if state is None:
            return
        state.incident = None
        state.incident_windows = 0
        state.evidence.reset()
        state.pending.clear()
        state.recent.clear()  # the incident's requests must not be judged again in a merged window

    # -- introspection -----------------------------------------------------

    def evidence(self, stream: StreamKey) -> SequentialEvidence | None:
        state = self._streams.get(stream)
        return state.evidence if state else None

    def unclaimed(self, samples: Sequence[Sample], ended_only: bool = False) -> Sequence[Sample]:
        """``samples`` less the requests that ran during a spike or the minute before it (``ended_only``: a
        spike that has ended)."""
        if not self.quarantine or not samples:
            return samples
        periods = [(lo, hi) for lo, hi in self.quarantine if hi is not None or not ended_only]
        if not periods:
            return samples
        start_of = self.trace_start
        out = []
        for x in samples:
            began = x[3] - x[0]
            # The trace is looked up only for a request that began shortly after a spike ended (a straggler).
            claimed = [hi for lo, hi in periods if x[3] > lo and (hi is None or began < hi + STRAGGLER_NS)]
            if claimed:
                if any(hi is not None and began >= hi for hi in claimed) and start_of is not None:
                    began = min(began, start_of(x[1]) or began)
                if any(hi is None or began < hi for hi in claimed):
                    continue
            out.append(x)
        return out

    def quarantined(self, window_start_ns: int) -> bool:
        """Whether a window starting at ``window_start_ns`` falls in a spike or the minute before one."""
        end = window_start_ns + self.settings.window_ns
        return any(lo < end and (hi is None or window_start_ns < hi) for lo, hi in self.quarantine)

    def forget_evidence(self, stream: StreamKey) -> None:
        """Start ``stream``'s evidence again from zero (its slow requests belonged to a spike that ended)."""
        state = self._streams.get(stream)
        if state is not None:
            state.evidence.reset()
            state.pending = [(start, held) for start, held in state.pending if not self.quarantined(start)]

    def forget_windows(self, from_ns: int, to_ns: int) -> None:
        """Drop every stream's windows held for merging that started in [from_ns, to_ns): a spike that ended
        there must not be judged again in a low-traffic stream's merged window."""
        for state in self._streams.values():
            if state.recent and state.recent[-1][0] >= from_ns and state.recent[0][0] < to_ns:
                state.recent = deque(part for part in state.recent if not from_ns <= part[0] < to_ns)

    def standing(self, judged: set[StreamKey], window_start_ns: int, window_end_ns: int) -> list[Judgement]:
        """Hot streams with no request in this window: their evidence stands, and its slow requests, the last
        within ``standing_ns``, are still evidence for their place. A fault on a service of a few calls a minute
        slows one call of one route and, a minute later, two of another; neither route alone is sure.

        A stream in an incident is not standing (its requests already count toward the incident).
        """
        s = self.settings
        since = window_end_ns - s.standing_ns
        out = []
        for stream, state in self._streams.items():
            evidence = state.evidence
            if (not evidence.slow or evidence.value < s.hot_evidence or evidence.slow[-1].end_ns < since
                    or state.incident is not None or stream in judged):
                continue
            onset = evidence.onset_ns
            out.append(Judgement(
                stream, state.root, window_start_ns, window_end_ns, count=0,
                p99_ns=max(r.duration_ns for r in evidence.slow), baseline_ns=self.baseline_ns(stream) or 0,
                score=0.0, dense=False, elevated=False, evidence=evidence.value, samples=[], judged=[],
                onset_ns=onset if onset is not None else window_start_ns, hot=True, standing=True))
        return out

    def streams_with_slow(self) -> list[tuple[StreamKey, SequentialEvidence]]:
        """The streams whose evidence holds slow requests."""
        return [(stream, st.evidence) for stream, st in self._streams.items() if st.evidence.slow]

    def is_root(self, stream: StreamKey) -> bool:
        state = self._streams.get(stream)
        return bool(state and state.root)

    def baseline_ns(self, stream: StreamKey) -> int | None:
        state = self._streams.get(stream)
        if state is None:
            return None
        if state.window_test.n_learned:
            return int(state.window_test.baseline)
        return int(state.tail.normal_p99()) if state.tail.pooled else None

    def is_warm(self, stream: StreamKey) -> bool:
        state = self._streams.get(stream)
        return bool(state and (state.window_test.warm or state.tail.warm))

    def warm_streams(self, now_ns: int) -> int:
        """Streams judged by a warm test in the last ``RECENT_NS``: the hypotheses tested, window by window.

        Streams that went quiet (a route no one calls any more, yesterday's one-off names) test nothing and
        must not raise everyone's bar.
        """
        since = now_ns - RECENT_NS
        return sum(1 for st in self._streams.values()
                   if st.last_end_ns >= since and (st.window_test.warm or st.tail.warm))

    def __len__(self) -> int:
        return len(self._streams)

    # -- internals ---------------------------------------------------------

    def _state(self, stream: StreamKey) -> _StreamState:
        state = self._streams.get(stream)
        if state is not None:
            self._streams.move_to_end(stream)
            return state
        s = self.settings
        if len(self._streams) >= s.max_streams:
            # Of the least recently judged, one that never learned enough to judge goes first: a flood of
            # one-off names then pushes out its own kind, not the baselines that took hours to learn.
            free = [old for old, st in islice(self._streams.items(), EVICTION_SCAN) if st.incident is None]
            cold = next((old for old in free if not (self._streams[old].tail.warm
                                                     or self._streams[old].window_test.warm)), None)
            victim = cold if cold is not None else free[0] if free else next(
                (old for old, st in self._streams.items() if st.incident is None), None)
            if victim is not None:
                del self._streams[victim]
                self.evicted_streams += 1
        state = _StreamState(
            P99SpikeDetector(window_size=s.baseline_windows, grace_period=s.grace_windows),
            TailSurprise(pool_size=s.request_pool, grace_requests=s.grace_requests, min_rise=s.min_rise,
                         min_abs_rise=s.min_abs_rise_ns, max_surprise=s.max_surprise),
            SequentialEvidence(drift=s.surprise_drift, slow_surprise=s.slow_surprise))
        self._streams[stream] = state
        return state

    def _unproven(self, state: _StreamState, window_start_ns: int, durations: list[int]) -> list[int]:
        """``durations`` less those held back as unproven, which are kept in ``state.unproven``.

        A stream too new to be judged (its pool short of ``grace_requests``) cannot tell a fault from its normal
        tail, and a sparse hop can take an hour to become warm: one fault request learned then would set its
        p99 to the fault's for as long as the pool holds it, blind to the fault's return. So a request that
        stands out from what such a stream learned (slower than its slowest by ``min_rise`` and
        ``min_abs_rise_ns``) waits until a spike somewhere would have claimed its time (:meth:`_prove`).
        """
        tail = state.tail
        if tail.warm or not tail.n_learned:
            return durations
        s = self.settings
        slowest = tail.quantile(1.0)
        bar = max(slowest * (1 + s.min_rise), slowest + s.min_abs_rise_ns)
        standing_out = [d for d in durations if d > bar]
        if not standing_out:
            return durations
        far = [d for d in standing_out if d > FAR_OUT * slowest]
        if far:
            state.unproven.append([window_start_ns, far, False])
        if len(far) < len(standing_out):
            state.unproven.append([window_start_ns, [d for d in standing_out if d <= FAR_OUT * slowest], None])
        recent = [e for e in state.unproven if e[0] > window_start_ns - self.proving_ns and e[2] is not None]
        if far and sum(len(e[1]) for e in recent) > s.min_slow_requests:
            # More far-out ones within a few minutes than a spike needs: the rise a stream this new cannot
            # judge. (Nearer ones come in runs from a heavy tail that a short pool has not seen yet.)
            for e in recent:
                e[2] = True
            if state.clustered_since is None:
                state.clustered_since = recent[0][0]
        return [d for d in durations if d <= bar]

    def _prove(self, state: _StreamState, before_ns: int) -> None:
        """Settle the unproven requests of windows that started before ``before_ns``: a lone one is learned (the
        normal tail), unless a spike claimed its time; those that came in a cluster are dropped, unless the
        stream has had nothing but clusters for ``COLD_SHIFT_NS``: then that is its new normal."""
        cut = bisect.bisect_right(state.unproven, before_ns, key=itemgetter(0))
        for start, durations, clustered in state.unproven[:cut]:
            if not clustered:  # alone, or not far out (None)
                state.clustered_since = None
                self._learn_held(state, [(start, durations)])
            elif state.clustered_since is not None and start - state.clustered_since >= COLD_SHIFT_NS:
                self._learn_held(state, [(start, durations)])
        del state.unproven[:cut]

    @property
    def proving_ns(self) -> int:
        """How long an unproven request waits: a spike opens up to a merged test's reach after its onset, and
        claims the minute before that."""
        s = self.settings
        return s.quarantine_before_ns + s.max_merge_windows * s.window_ns

    def _learn_held(self, state: _StreamState, held: list[tuple[int, list[int]]]) -> None:
        for start, durations in held:
            if not self.quarantined(start):
                self._learn(state, durations)

    @staticmethod
    def _learn(state: _StreamState, durations: list[int]) -> None:
        for duration in durations:
            state.tail.learn_one({"duration": duration})

    def _window_test(self, state: _StreamState, stream: StreamKey, window: LatencyWindow) -> Judgement:
        """The window test on this window, merged with the ones before it while traffic is low."""
        s = self.settings
        start, end = window.start_unix_nano, window.end_unix_nano
        if window.count >= s.min_requests:
            state.recent.clear()
            parts: list[tuple[int, int, tuple[Sample, ...]]] = [(start, end, window.samples)]
            samples = list(window.samples)
        else:
            horizon = end - s.max_merge_windows * s.window_ns
            # The last requests of a spike that ended are its, not the next merged window's news.
            state.recent.append((start, end, tuple(self.unclaimed(window.samples, ended_only=True))))
            while state.recent and state.recent[0][0] < horizon:
                state.recent.popleft()
            parts = list(state.recent)
            samples = sorted(x for _, _, part in parts for x in part)
        verdict = Judgement(stream=stream, root=state.root, window_start_ns=start, window_end_ns=end, count=0,
                            p99_ns=0, baseline_ns=0, score=0.0, dense=False, elevated=False, evidence=0.0,
                            samples=list(window.samples), judged=samples, onset_ns=start)
        detector = state.window_test
        if len(samples) < s.min_requests:
            if detector.n_learned:
                verdict.baseline_ns = int(detector.baseline)
            return verdict
        # Merged windows tumble: the next judgement starts from fresh requests. Sliding, each request would be
        # judged (and learned) a dozen times over, and the baseline would follow the last minute's luck.
        state.recent.clear()
        n = len(samples)
        p99 = samples[min(max(-(-99 * n // 100) - 1, 0), n - 1)][0]  # nearest rank, as windows.nearest_rank
        baseline = int(detector.baseline)
        exceed = n - bisect.bisect_right(samples, baseline, key=itemgetter(0)) if baseline else 0
        # Half the rise is enough to be scored: an open incident stays open while it holds (hysteresis).
        half_rise = detector.warm and p99 >= baseline * (1 + s.min_rise / 2) and p99 - baseline >= s.min_abs_rise_ns / 2
        material = half_rise and p99 >= baseline * (1 + s.min_rise) and p99 - baseline >= s.min_abs_rise_ns
        # The score last: it is the only costly test.
        score = detector.score_one({"p99": p99, "count": n, "exceed": exceed}) if half_rise else 0.0
        verdict.count, verdict.p99_ns, verdict.baseline_ns, verdict.score = n, p99, baseline, score
        verdict.exceed = exceed
        verdict.elevated = score >= s.min_score / 2
        if material and score >= s.min_score:
            verdict.spread_ns = slow_spread(samples, baseline)
            verdict.dense = True
            verdict.onset_ns = change_point(parts, baseline)
        return verdict


def slow_spread(samples: Sequence[Sample], baseline: int) -> int:
    """How far apart in time a fired window's slow requests ended (``Judgement.spread_ns``), as a pause reads.

    The span of the ends of the requests over ``baseline``, each weighed by how much slower it was, leaving
    out ``SPREAD_TRIM`` of that excess at either end. A pause releases every request it held within a second
    or two, and its callers then finish theirs; a busy window also holds a request or two just over its p99
    that ends seconds apart from them, and must not make the pause a sustained rise. Samples are
    ``(duration, trace, span, end)``.

    >>> ms = 1_000_000
    >>> pause = [((4000 - t) * ms, b"", b"", (4000 + t // 2) * ms) for t in range(0, 2000, 100)]  # held till 4 s
    >>> tail = [(110 * ms, b"", b"", 7000 * ms), (115 * ms, b"", b"", 9000 * ms)]  # just over a 100 ms baseline
    >>> slow_spread(pause + tail, 100 * ms) / 1e9, slow_spread(pause, 100 * ms) / 1e9
    (0.9, 0.9)
    >>> fault = [(1500 * ms, b"", b"", t * 1000 * ms) for t in range(10)]  # +1.4 s on calls a second apart
    >>> slow_spread(fault, 100 * ms) / 1e9
    9.0
    """
    slow = sorted((end, duration - baseline) for duration, _, _, end in samples if duration > baseline)
    if not slow:
        return 0
    trim = SPREAD_TRIM * sum(excess for _, excess in slow)
    return max(_end_past(reversed(slow), trim) - _end_past(slow, trim), 0)


def _end_past(slow: Iterable[tuple[int, int]], trim: float) -> int:
    """The end of the first of ``slow`` ((end, excess) pairs) at which their summed excess passes ``trim``."""
    total, last = 0, 0
    for end, excess in slow:
        total, last = total + excess, end
        if total > trim:
            break
    return last


def _spread_over(samples: list[Sample], limit: int) -> list[int]:
    """The durations of at most ``limit`` of ascending ``samples``, taken evenly over their whole range (a
    busy window is thinned into the request pool without tilting it towards its median or its tail)."""
    n = len(samples)
    step = max(n // limit, 1) if limit > 0 else n + 1
    return [samples[i][0] for i in range(step // 2, n, step)][:limit]


def change_point(parts: list[tuple[int, int, tuple[Sample, ...]]], baseline: int) -> int:
    """The start of the merged window from which requests over ``baseline`` are likeliest to have risen.

    The maximum-likelihood change point of a rate: the split that best separates a low share of
    requests over the baseline before it from a high share after, so that one stray slow request two
    minutes earlier does not move the onset back to it. Nor does a stray just before the rise: the rise
    begins at the first part holding a request over the baseline by ``WEAK_LEAD`` of the rise's typical
    excess (as a sparse run begins at a request that said half as much as its typical one;
    :func:`spikehound.detectors.incidents.incident_onset`): a call of 41 ms against a baseline of 25, in
    the window before calls of 2.4 s, dated a spike 12 s before its fault.

    >>> ms = 1_000_000
    >>> calm, stray, slow = (20 * ms,) * 4, (20 * ms, 41 * ms), (2400 * ms,) * 5
    >>> parts = [(t, t + 10, tuple((d, b"", b"", t) for d in ds)) for t, ds in ((0, calm), (10, stray), (20, slow))]
    >>> change_point(parts, 25 * ms)
    20
    """
    counts = [(len(part), sum(1 for d, _, _, _ in part if d > baseline)) for _, _, part in parts]
    best, first = -math.inf, len(parts) - 1
    for i in range(len(counts)):
        after_n = sum(n for n, _ in counts[i:])
        after_k = sum(k for _, k in counts[i:])
        before_n = sum(n for n, _ in counts[:i])
        before_k = sum(k for _, k in counts[:i])
        if after_k == 0:
            continue
        ll = _bernoulli_ll(after_k, after_n) + _bernoulli_ll(before_k, before_n)
        if ll > best + 1e-9:
            best, first = ll, i
    excess = sorted(d - baseline for _, _, part in parts[first:] for d, _, _, _ in part if d > baseline)
    if excess:
        bar = WEAK_LEAD * excess[len(excess) // 2]
        while first < len(parts) - 1 and not any(d - baseline >= bar for d, _, _, _ in parts[first][2]):
            first += 1
    return parts[first][0]


def _bernoulli_ll(k: int, n: int) -> float:
    if n == 0 or k in (0, n):
        return 0.0
    p = k / n
    return k * math.log(p) + (n - k) * math.log(1 - p)


def tail_band(samples: list[Sample], limit: int) -> list[Sample]:
    """Up to ``limit`` requests spread evenly over the p90-and-up tail of ascending ``samples``.

    >>> [d for d, _, _, _ in tail_band([(i, b"", b"", 0) for i in range(1, 101)], 3)]
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
