"""Sequential evidence: judge a sparse stream request by request, not window by window.

A stream with three calls a minute gives a window p99 of nothing. What it does
give is requests, each of which is either like the stream's normal ones or not.
Two pieces turn them into evidence:

- :class:`TailSurprise` (a River anomaly detector) learns a pool of the
  stream's normal request latencies (the last few hundred; a busy stream's
  windows are thinned into it evenly) and scores a request by its **surprise**:
  ``-log10`` of the share of normal requests that were slower than it is,
  counting only a material rise (the request must be ``min_rise`` and
  ``min_abs_rise`` over them). Beyond the slowest normal request the share is
  extrapolated from the pool's spread, so a call at forty times the normal
  maximum is more surprising than one just over it, up to ``max_surprise``.
- :class:`SequentialEvidence` adds the surprise of each request, less a drift,
  into a CUSUM that never goes below zero, in event time and across window
  boundaries. A normal request takes evidence away (under no change the mean
  surprise is about 0.43, below the drift); a handful of calls far over the
  normal maximum pile it up. It keeps the current *excursion* (everything
  since the sum last stood at zero): its slow requests, what the normal ones
  in between took away, and where the rise began.

What counts as enough (with how many other streams, and how many distinct slow
traces) is decided by :mod:`spikehound.detectors.incidents`; a lone stall, however slow,
adds at most ``max_surprise - drift`` and never opens a spike on its own.

>>> import random
>>> rng = random.Random(3)
>>> tail = TailSurprise(grace_requests=20)
>>> for _ in range(200):
...     tail.learn_one({"duration": rng.lognormvariate(3.0, 0.4) * 1e6})  # about 20 ms
>>> round(tail.score_one({"duration": 20e6}), 2), round(tail.score_one({"duration": 2e9}), 2)
(0.11, 4.0)
>>> evidence = SequentialEvidence(drift=0.9)
>>> evidence.update(0, [(0.1, (20_000_000, b"t1", b"s1", 1)), (3.5, (2_000_000_000, b"t2", b"s2", 2))])
>>> round(evidence.value, 2), [s.trace_id for s in evidence.slow]
(2.6, [b't2'])
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from river import base

from spikehound.detectors.windows import Sample

__all__ = ["RecoveryEvidence", "SequentialEvidence", "SlowRequest", "TailSurprise"]

_LN10 = math.log(10.0)
_Z90 = 1.2816  # the standard normal's 90th percentile: (ln p90 - ln p50) / _Z90 is a log-scale spread
_VECTOR_MIN = 32  # from this many requests a window is scored with NumPy
CALM_KEPT = 8  # normal requests kept per stream to test other streams' evidence: 8 take away about 4 digits


class TailSurprise(base.AnomalyDetector):
    """Learns a stream's normal request latencies; scores how surprising one request's latency is.

    Parameters
    ----------
    pool_size
        How many learned requests the pool holds (the oldest go first).
    grace_requests
        Requests to learn before any score is given (0 until then).
    min_rise
        A request is only compared with normal requests it is at least this much (relatively) slower than.
    min_abs_rise
        ... and this much (absolutely, in the unit of ``duration``) slower than.
    max_surprise
        The most one request can say, in digits (``-log10`` of a probability).

    ``x`` holds ``"duration"``, in any unit (always the same one).
    """

    def __init__(self, pool_size: int = 256, grace_requests: int = 12, min_rise: float = 0.2,
                 min_abs_rise: float = 5e6, max_surprise: float = 4.0) -> None:
        self.pool_size = pool_size
        self.grace_requests = grace_requests
        self.min_rise = min_rise
        self.min_abs_rise = min_abs_rise
        self.max_surprise = max_surprise
        # Flat arrays of doubles, not lists of float objects: thousands of streams' pools were millions of small
        # objects that lived for hours, and each one learned after a burst pinned the burst's freed memory.
        self._ring = array("d")  # in learning order
        self._sorted = array("d")
        self._array: np.ndarray | None = None  # _sorted as an array, rebuilt after learning
        self._spread = 0.0  # log-scale spread of the pool, for the tail beyond its maximum
        self.n_learned = 0

    @classmethod
    def _unit_test_params(cls) -> Any:
        yield {"pool_size": 64, "grace_requests": 10, "min_abs_rise": 0.0}

    def learn_one(self, x: dict[str, Any]) -> None:
        value = max(float(x["duration"]), 1.0)
        if len(self._ring) >= self.pool_size:
            old = self._ring[0]
            del self._ring[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._ring.append(value)
        bisect.insort(self._sorted, value)
        self._array = None
        self.n_learned += 1

    def score_one(self, x: dict[str, Any]) -> float:
        if not self.warm:
            return 0.0
        return self._surprise(float(x["duration"]))

    def surprises(self, durations: Sequence[int]) -> list[float]:
        """The surprise of each of ``durations`` (0 for all while not warm)."""
        if not self.warm:
            return [0.0] * len(durations)
        if len(durations) < _VECTOR_MIN:
            return [self._surprise(float(d)) for d in durations]
        pool = self._pool()
        n = len(pool)
        d = np.asarray(durations, dtype=np.float64)
        base_ = np.minimum(d / (1.0 + self.min_rise), d - self.min_abs_rise)
        slower = n - np.searchsorted(pool, base_, side="right")
        p = (slower + 0.5) / (n + 1)
        beyond = (slower == 0) & (base_ > 0)
        if beyond.any():
            over = np.log(base_[beyond] / pool[-1]) / self._spread
            p[beyond] = p[beyond] * np.exp(-over)
        out = np.minimum(-np.log10(np.maximum(p, 1e-300)), self.max_surprise)
        out[base_ <= 0] = 0.0
        return np.maximum(out, 0.0).tolist()

    def quantile(self, q: float) -> float:
        """The nearest-rank ``q``-quantile of the learned pool (0 when empty)."""
        if not self._sorted:
            return 0.0
        n = len(self._sorted)
        return self._sorted[min(max(math.ceil(q * n) - 1, 0), n - 1)]

    def normal_p99(self) -> float:
        """The pool's p99 as a baseline one request cannot set: with fewer than 100 requests pooled the
        nearest-rank p99 is the slowest of them (a lone stall learned as normal), so the second slowest is
        taken (0 when empty).

        >>> t = TailSurprise()
        >>> for ms in [50.0] * 79 + [5000.0]:
        ...     t.learn_one({"duration": ms})
        >>> t.quantile(0.99), t.normal_p99()
        (5000.0, 50.0)
        """
        return self.quantile(min(0.99, 1.0 - 1.0 / max(len(self._sorted), 1)))

    @property
    def warm(self) -> bool:
        return len(self._sorted) >= self.grace_requests

    @property
    def pooled(self) -> int:
        return len(self._sorted)

    def _pool(self) -> np.ndarray:
        if self._array is None:
            self._array = np.array(self._sorted, dtype=np.float64)  # a copy: the pool must stay resizable
            median, p90 = self.quantile(0.5), self.quantile(0.9)
            self._spread = max(math.log(p90 / median) / _Z90, 0.1)
        return self._array

    def _surprise(self, duration: float) -> float:
        base_ = min(duration / (1.0 + self.min_rise), duration - self.min_abs_rise)
        if base_ <= 0:
            return 0.0
        pool = self._pool()
        n = len(pool)
        slower = n - bisect.bisect_right(self._sorted, base_)
        log10_p = math.log10((slower + 0.5) / (n + 1))
        if slower == 0:
            log10_p -= math.log(base_ / pool[-1]) / self._spread / _LN10
        return max(min(-log10_p, self.max_surprise), 0.0)


@dataclass(slots=True)
class SlowRequest:
    """One request of an excursion that was clearly out of the ordinary."""

    trace_id: bytes
    span_id: bytes
    duration_ns: int
    end_ns: int
    window_ns: int  # start of its window
    gain: float  # surprise less the drift: what it added
    # Where its time was added (service, and the caller when a hop), set by the engine when the request
    # is judged, while its trace is at hand; kept in the checkpoint with the rest of the evidence.
    locus: tuple[str, str | None] | None = None


@dataclass(slots=True)
class SequentialEvidence:
    """A CUSUM of request surprise, with the excursion it is in.

    ``drift`` is taken off every request's surprise, so a run of normal requests brings the sum back to
    zero; ``slow_surprise`` is how surprising a request must be to count as one of the excursion's slow
    requests (it still adds its evidence below that). The excursion keeps at most ``max_slow`` slow
    requests (thinned evenly beyond) and ``max_windows`` windows.
    """

    drift: float = 0.9
    slow_surprise: float = 1.5
    max_slow: int = 256
    max_windows: int = 360
    value: float = 0.0
    slow: list[SlowRequest] = field(default_factory=list)
    penalty: float = 0.0  # what the not-slow requests of the excursion took away (<= 0)
    windows: list[tuple[int, float, int]] = field(default_factory=list)  # (window start, its gain, slow ones)
    calm_run: int = 0  # the latest requests in a row that were not slow
    # The latest normal requests that found the sum at zero (their ends and what each would have taken away):
    # they test what another stream of the same place said before them (incidents.py, "Tested since").
    calm_ends: array = field(default_factory=lambda: array("q"))
    calm_gains: array = field(default_factory=lambda: array("d"))

    def update(self, window_start_ns: int, scored: Sequence[tuple[float, Sample]]) -> None:
        """Add one window's requests, (surprise, sample) in end-time order."""
        if not scored:
            return
        if len(scored) >= _VECTOR_MIN:
            self._update_many(window_start_ns, scored)
            return
        for surprise, sample in scored:
            self._add(window_start_ns, surprise, sample)

    def calm_after(self, end_ns: int) -> float:
        """What the normal requests that ended after ``end_ns`` and found the sum at zero took away (<= 0; the
        latest ``CALM_KEPT`` of them)."""
        return sum(g for e, g in zip(self.calm_ends, self.calm_gains, strict=True) if e > end_ns)

    def _calm(self, end_ns: int, gain: float) -> None:
        self.calm_ends.append(end_ns)
        self.calm_gains.append(min(gain, 0.0))
        if len(self.calm_ends) > CALM_KEPT:
            del self.calm_ends[0]
            del self.calm_gains[0]

    def reset(self) -> None:
        self.value = 0.0
        self.slow = []
        self.penalty = 0.0
        self.windows = []

    @property
    def onset_ns(self) -> int | None:
        """Where the rise began: the first window holding a slow request after the likeliest change point."""
        if not self.windows:
            return None
        best, best_at, total = -math.inf, 0, 0.0
        for i in range(len(self.windows) - 1, -1, -1):  # the suffix of windows with the most evidence
            total += self.windows[i][1]
            if total >= best:
                best, best_at = total, i
        return next((w for w, _, slow in self.windows[best_at:] if slow), self.windows[best_at][0])

    def _add(self, window_start_ns: int, surprise: float, sample: Sample) -> None:
        gain = surprise - self.drift
        if self.value + gain <= 0.0:
            self.reset()
            self.calm_run += 1
            self._calm(sample[3], gain)
            return
        self.value += gain
        slow = surprise >= self.slow_surprise
        if slow:
            self.slow.append(SlowRequest(sample[1], sample[2], sample[0], sample[3], window_start_ns, gain))
            if len(self.slow) > self.max_slow:
                del self.slow[::2]  # thin evenly: the start and the end of a long excursion both stay
            self.calm_run = 0
        else:
            self.calm_run += 1
            self.penalty += min(gain, 0.0)
        if self.windows and self.windows[-1][0] == window_start_ns:
            start, total, n_slow = self.windows[-1]
            self.windows[-1] = (start, total + gain, n_slow + slow)
        else:
            self.windows.append((window_start_ns, gain, int(slow)))
            if len(self.windows) > self.max_windows:
                del self.windows[0]

    def _update_many(self, window_start_ns: int, scored: Sequence[tuple[float, Sample]]) -> None:
        """The same as adding each request in turn, with the sums in NumPy (a busy window has thousands)."""
        gains = np.fromiter((s for s, _ in scored), dtype=np.float64, count=len(scored)) - self.drift
        path = self.value + np.cumsum(gains)
        # The CUSUM is the running sum less its running minimum (clamped at zero); it last stood at zero
        # where that minimum was last reached at or below zero.
        floor = np.minimum.accumulate(np.minimum(path, 0.0))
        cusum = path - floor
        zeros = np.flatnonzero(cusum <= 0.0)
        first = 0
        if zeros.size:
            self.reset()
            first = int(zeros[-1]) + 1
            for i in range(max(first - CALM_KEPT, 0), first):
                self._calm(scored[i][1][3], float(gains[i]))
        for i in range(first, len(scored)):
            self._add(window_start_ns, scored[i][0], scored[i][1])
        slow = [i for i, (surprise, _) in enumerate(scored) if surprise >= self.slow_surprise]
        self.calm_run = len(scored) - 1 - slow[-1] if slow else self.calm_run + first


@dataclass(slots=True)
class RecoveryEvidence:
    """Sequential evidence that a spike's fault is over, request by request: a CUSUM toward normal.

    Each request the spike could have slowed (one through its locus, each trace once) is either *slow* (surprise
    ``slow_surprise`` or more) or not. Normal traffic gives a slow one with probability ``normal_slow`` (``10 **
    -slow_surprise``: one in 30); the fault gives one with the share ``f`` it showed on the places (streams) the
    request went through, up to their latest slow request (the calm run being judged is not yet part of the fault).
    A fault moves its places unevenly: a CPU fault may slow one route's every call and another's one in three, and
    a normal call of the second says little. So each place keeps its own share, its slow requests over all it saw,
    drawn toward the spike's share over every place by ``prior_requests`` requests' worth; a request takes the
    highest share among its places, at most ``max_share``. A request adds its log-likelihood ratio of normal
    against the fault, ``log10((1 - p0) / (1 - f))`` for a normal one and ``log10(p0 / f)`` for a slow one, into a
    sum that never drops below zero. The fault is over once the sum reaches the threshold the caller sets: with
    ``f`` at its cap and a threshold of 3, three normal requests in a row; under the fault itself such a run has
    odds near ``(1 - f) ** 3``. A busy stream's calm window counts ``window_weight`` at once (its window test
    judged dozens of requests), an elevated one as a slow request.

    Only normal requests that ended after the latest slow one move the sum: one that ended before the first
    came before the fault, one between two tells the fault's share (a spike's first window holds all three).

    ``last_slow_ns`` is the end of the window that held the latest slow request: where the spike ended.

    >>> r = RecoveryEvidence(last_slow_ns=60)
    >>> for i in range(6):
    ...     _ = r.update_one(True, 100 + i, 110, ("route",))
    >>> [round(r.update_one(False, 200 + i, 210, ("route",)), 2) for i in range(3)]
    [1.29, 2.57, 3.86]
    >>> round(r.update_one(True, 300, 310, ("route",)), 2), r.last_slow_ns
    (2.38, 310)

    A place the fault slows one call in three says less per normal call than one it slows every time:

    >>> uneven = RecoveryEvidence()
    >>> for i in range(12):
    ...     _ = uneven.update_one(True, i, 10, ("hop",))
    ...     _ = uneven.update_one(i % 3 == 0, i, 10, ("side route",))
    >>> round(uneven.share_of(("hop",)), 2), round(uneven.share_of(("side route",)), 2)
    (0.95, 0.45)
    """

    normal_slow: float = 10 ** -1.5
    max_share: float = 0.95
    prior_requests: float = 2.0  # how many requests' worth of the spike's share a place starts from
    value: float = 0.0
    requests: int = 0  # requests judged from the spike's opening to its latest slow one
    slow: int = 0  # ... of which slow
    calm_run: int = 0  # normal requests since the latest slow one
    last_slow_ns: int = 0
    first_slow_end_ns: int = 2**63  # when the first slow request ended (read once there is one)
    last_slow_end_ns: int = 0  # when the latest slow request ended
    first_seen_ns: int | None = None
    last_seen_ns: int | None = None
    # The same three counts per place: [requests to its latest slow one, slow, normal since].
    places: dict[Any, list[int]] = field(default_factory=dict)

    @property
    def share(self) -> float:
        """The share of the spike's requests that were slow: what the fault does to a request."""
        return self._bounded((self.slow + 0.5) / (self.requests + 1))

    def share_of(self, places: Sequence[Any]) -> float:
        """The share of slow requests the fault gives a request through ``places``: the highest of theirs."""
        overall = self.share
        best = 0.0
        for place in places:
            counts = self.places.get(place)
            if counts is None:
                best = max(best, overall)
            else:
                k = self.prior_requests
                best = max(best, (counts[1] + k * overall) / (counts[0] + k))
        return self._bounded(best) if places else overall

    def update_one(self, slow: bool, end_ns: int, window_end_ns: int, places: Sequence[Any] = ()) -> float:
        """One request: slow or not, when it ended, the end of its window, the places (streams) it went
        through; returns the evidence."""
        p0, f = self.normal_slow, self.share_of(places)
        # A normal request that ended before a slow one already counted says nothing of the fault being over
        # (a spike's first window holds both): before the first, it came before the fault and is left out;
        # between two, it tells how many of its requests the fault slows.
        if not slow and self.slow and end_ns < self.first_slow_end_ns:
            return self.value
        during = not slow and end_ns < self.last_slow_end_ns
        if slow:
            self.requests += self.calm_run + 1
            self.slow += 1
            self.calm_run = 0
            self.value = max(self.value + math.log10(p0 / f), 0.0)
            self.last_slow_ns = max(self.last_slow_ns, window_end_ns)
            self.last_slow_end_ns = max(self.last_slow_end_ns, end_ns)
            self.first_slow_end_ns = min(self.first_slow_end_ns, end_ns)
        elif during:
            self.requests += 1
        else:
            self.calm_run += 1
            self.value += math.log10((1 - p0) / (1 - f))
        for place in places:
            counts = self.places.setdefault(place, [0, 0, 0])
            if slow:
                counts[0] += counts[2] + 1
                counts[1] += 1
                counts[2] = 0
            elif during:
                counts[0] += 1
            else:
                counts[2] += 1
        if self.first_seen_ns is None:
            self.first_seen_ns = end_ns
        self.last_seen_ns = max(self.last_seen_ns or end_ns, end_ns)
        return self.value

    def _bounded(self, share: float) -> float:
        return min(max(share, 2 * self.normal_slow), self.max_share)

    def update_window(self, elevated: bool, window_end_ns: int, window_weight: float) -> float:
        """One busy window judged by the window test: elevated (slow) or calm (``window_weight`` toward normal)."""
        if elevated:
            self.value = 0.0
            self.last_slow_ns = max(self.last_slow_ns, window_end_ns)
        else:
            self.value += window_weight
        self.last_seen_ns = max(self.last_seen_ns or window_end_ns, window_end_ns)
        return self.value

    def typical_gap_ns(self) -> int | None:
        """The mean time between the spike's requests (None before two)."""
        seen = self.requests + self.calm_run
        if self.first_seen_ns is None or self.last_seen_ns is None or seen < 2:
            return None
        return (self.last_seen_ns - self.first_seen_ns) // (seen - 1)
