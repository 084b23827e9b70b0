"""The p99 spike detector: is this window's tail unusual for this stream?

A River anomaly detector over one latency stream. It learns the stream's
normal window p99 on a log scale (latency is multiplicative: 10 -> 13 ms and
100 -> 130 ms are the same rise) with a rolling median, so that the odd slow
window it did learn from does not drag the baseline, and it learns how many
requests of a normal window are slower than that baseline (about 1 % by
construction, more where the tail is lumpy).

A window's score is the surprise of its count of requests over the baseline:
``-log10`` of the binomial probability of seeing that many or more at the
learned normal share. That is what separates a spike from bad luck. A lone
stall (a GC pause, a page fault) can double a window's p99 but adds one slow
request; a spike makes dozens slow. On streams whose p99 is set by a few
stalls, the p99 of normal windows swings by 2x while the count barely moves.

It never learns on its own: the caller decides which windows were normal
(:mod:`spikehound.detectors.stream_judge` learns only windows outside any incident),
which keeps a spike out of its own baseline.

>>> import random
>>> rng = random.Random(7)
>>> detector = P99SpikeDetector(window_size=60, grace_period=10)
>>> for _ in range(60):
...     detector.learn_one({"p99": rng.uniform(0.095, 0.105), "count": 400, "exceed": 4})
>>> round(detector.baseline, 2)
0.1
>>> detector.score_one({"p99": 0.101, "count": 400, "exceed": 5}) < 1
True
>>> detector.score_one({"p99": 0.2, "count": 400, "exceed": 60}) > 20
True
"""

from __future__ import annotations

import math
from typing import Any

from river import base, stats
from scipy.special import bdtrc  # binom.sf's tail without importing scipy.stats (0.6 s of every start)

__all__ = ["P99SpikeDetector", "null_exceed_rate"]


def null_exceed_rate(n: int) -> float:
    """The share of ``n`` requests expected over a baseline that is the median of nearest-rank p99s.

    The nearest-rank p99 of n values is order statistic ``r = ceil(0.99 n)``, whose median sits near
    quantile ``(r - 0.3) / (n + 0.4)``. Over 400 requests that is about 1.2 %; over 40 (where the p99
    is the maximum) about 1.7 %.

    >>> round(null_exceed_rate(400), 4), round(null_exceed_rate(40), 4)
    (0.0117, 0.0173)
    """
    r = -(-99 * n // 100)
    return max(1.0 - (r - 0.3) / (n + 0.4), 1e-4)


class P99SpikeDetector(base.AnomalyDetector):
    """Learns a stream's normal window p99 and share of requests above it; scores a window's surprise.

    Parameters
    ----------
    window_size
        How many learned (normal) windows the rolling median covers; 90 windows of 10 s is 15 minutes,
        which follows a daily load curve while ignoring a few odd windows.
    grace_period
        Windows to learn before any score is given (a score of 0 until then).
    fading_factor
        Weight of the newest window in the learned share of requests over the baseline.

    ``x`` holds ``"p99"`` (any time unit, always the same one), ``"count"`` (requests judged) and
    ``"exceed"`` (how many of them were slower than :attr:`baseline`).
    """

    def __init__(self, window_size: int = 90, grace_period: int = 12, fading_factor: float = 0.05) -> None:
        self.window_size = window_size
        self.grace_period = grace_period
        self.fading_factor = fading_factor
        self._median = stats.RollingQuantile(q=0.5, window_size=window_size)
        self._excess = stats.EWMean(fading_factor=fading_factor)  # share over the null rate, >= 1 on lumpy tails
        self.n_learned = 0

    @classmethod
    def _unit_test_params(cls) -> Any:
        yield {"window_size": 20, "grace_period": 3}

    def learn_one(self, x: dict[str, Any]) -> None:
        self._median.update(math.log(max(float(x["p99"]), 1e-9)))  # a 0 p99 is 1 ns, not -inf
        count = int(x.get("count", 0))
        if count and self.n_learned:  # the first window has no baseline to count against
            self._excess.update(int(x.get("exceed", 0)) / count / null_exceed_rate(count))
        self.n_learned += 1

    def score_one(self, x: dict[str, Any]) -> float:
        count, exceed = int(x.get("count", 0)), int(x.get("exceed", 0))
        if not self.warm or count == 0 or exceed == 0:
            return 0.0
        p = bdtrc(exceed - 1, count, self.exceed_rate(count))  # P(X > exceed - 1), X ~ Binomial(count, rate)
        return float(-math.log10(max(p, 1e-300)))

    def exceed_rate(self, count: int) -> float:
        """The normal share of ``count`` requests slower than the baseline."""
        return min(null_exceed_rate(count) * max(self._excess.get(), 1.0), 0.5)

    @property
    def warm(self) -> bool:
        """True once enough normal windows were learned for scores to mean something."""
        return self.n_learned >= self.grace_period

    @property
    def baseline(self) -> float:
        """The learned normal p99, in the unit it was given (0 before anything was learned)."""
        return math.exp(self._median.get()) if self.n_learned else 0.0
