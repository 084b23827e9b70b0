"""Latency samples, nearest-rank quantiles and their bootstrap confidence intervals.

The bootstrap here resamples a quantile without resampling the data. Draw n
values with replacement from a sample of n: that is the sample's quantile
function applied to n uniforms, and since the quantile function never goes
down, the k-th smallest drawn value is the quantile function at the k-th
smallest uniform, which is Beta(k, n - k + 1) distributed. One Beta draw is
therefore one exact bootstrap replicate of the k-th order statistic, so 2,000
replicates of a p99 over a million requests cost what they cost over a
hundred, after one sort.

Quantiles use the nearest-rank method (the k-th smallest value, k = ceil(q n)),
so every reported latency really happened, as in ``spikehound.detectors.windows``.

An ``OrderStatistics`` of a sample keeps every sorted value up to ``max_points`` values; of a larger
sample it keeps the order statistics at a grid of ranks that is dense near the top (every
one of the slowest values, then ranks spaced evenly on a log scale of the
distance from the top, plus an even grid over the body) and reads the ranks in
between by linear interpolation. That keeps a saved baseline small while its
p99 still rests on the order statistics around rank 0.99 n.

>>> s = OrderStatistics.of(range(1, 101))
>>> s.n, s.quantile(0.5), s.quantile(0.99), s.quantile(1.0)
(100, 50.0, 99.0, 100.0)
>>> rng = np.random.default_rng(7)
>>> d = delta(OrderStatistics.of([10.0] * 500), OrderStatistics.of([12.0] * 500), 0.99, rng)
>>> d.point, d.low, d.high, round(d.relative, 2)
(2.0, 2.0, 2.0, 0.2)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DEFAULT_REPLICATES", "Delta", "OrderStatistics", "delta", "interval"]

DEFAULT_REPLICATES = 2000
DEFAULT_MAX_POINTS = 3000


def _grid(n: int, max_points: int) -> np.ndarray:
    """Ranks (1-based, increasing, with 1 and n) kept of a sample of n > max_points values."""
    top = np.arange(n - max_points // 10 + 1, n + 1)  # the slowest values, each of them
    from_top = np.geomspace(1, n, max_points * 6 // 10)  # log-spaced distance from the top
    body = np.linspace(1, n, max_points * 3 // 10)
    ranks = np.concatenate([top, n + 1 - np.rint(from_top), np.rint(body), [1, n]]).astype(np.int64)
    return np.unique(np.clip(ranks, 1, n))


@dataclass(frozen=True, slots=True, eq=False)
class OrderStatistics:
    """A sample of ``n`` values, kept as its order statistics at ``ranks`` (1-based, increasing, 1 and n included).

    When ``ranks`` is every rank the sample is exact; else ranks in between
    are read by linear interpolation.
    """

    n: int
    ranks: np.ndarray  # int64
    values: np.ndarray  # float64, sorted

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray, max_points: int = DEFAULT_MAX_POINTS) -> OrderStatistics:
        array = np.sort(np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64))
        n = len(array)
        if n <= max_points:
            return cls(n, np.arange(1, n + 1, dtype=np.int64), array)
        ranks = _grid(n, max_points)
        return cls(n, ranks, array[ranks - 1])

    @property
    def exact(self) -> bool:
        return len(self.ranks) == self.n

    def at_rank(self, ranks: np.ndarray | int) -> np.ndarray | float:
        """The order statistic(s) at 1-based rank(s)."""
        if self.exact:
            return self.values[np.asarray(ranks) - 1]
        return np.interp(ranks, self.ranks, self.values)

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile (the ceil(q n)-th smallest value); None for an empty sample."""
        if self.n == 0:
            return None
        return float(self.at_rank(_rank(q, self.n)))

    def replicates(self, q: float, rng: np.random.Generator, count: int = DEFAULT_REPLICATES) -> np.ndarray:
        """``count`` bootstrap replicates of the q-quantile (exact, see the module docstring)."""
        k = _rank(q, self.n)
        u = rng.beta(k, self.n - k + 1, size=count)
        ranks = np.clip(np.ceil(u * self.n).astype(np.int64), 1, self.n)
        return np.asarray(self.at_rank(ranks), dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON; values are rounded to whole units (nanoseconds in spikehound)."""
        out: dict[str, Any] = {"n": self.n, "values": [round(float(v)) for v in self.values]}
        if not self.exact:
            out["ranks"] = self.ranks.tolist()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OrderStatistics:
        """The inverse of ``to_json``; raises ValueError naming what is wrong with the data."""
        try:
            n = int(data["n"])
            values = np.asarray(data["values"], dtype=np.float64)
            ranks = (np.asarray(data["ranks"], dtype=np.int64) if "ranks" in data
                     else np.arange(1, len(values) + 1, dtype=np.int64))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a sample needs n, values and optional ranks: {exc}") from None
        exact_size_wrong = "ranks" not in data and n != len(values)
        if values.ndim != 1 or len(values) != len(ranks) or (n == 0) != (len(values) == 0) or exact_size_wrong:
            raise ValueError(f"a sample of {n} has {len(values)} values and {len(ranks)} ranks")
        if n and (ranks[0] != 1 or ranks[-1] != n or np.any(np.diff(ranks) <= 0)):
            raise ValueError("sample ranks must increase from 1 to n")
        if np.any(np.diff(values) < 0) or not np.all(np.isfinite(values)):
            raise ValueError("sample values must be finite and sorted")
        return cls(n, ranks, values)


def _rank(q: float, n: int) -> int:
    return min(max(math.ceil(q * n - 1e-9), 1), n)


def interval(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central ``confidence`` interval of bootstrap replicates (percentile method)."""
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(samples, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True, slots=True)
class Delta:
    """Candidate minus baseline for one quantile: the point estimate and its bootstrap interval.

    ``relative`` (and its interval) is the ratio minus one; None when the
    baseline quantile (or a replicate of it) is zero.
    """

    point: float
    low: float
    high: float
    relative: float | None
    relative_low: float | None
    relative_high: float | None


def delta(baseline: OrderStatistics, candidate: OrderStatistics, q: float, rng: np.random.Generator, *,
          confidence: float = 0.95, replicates: int = DEFAULT_REPLICATES) -> Delta:
    """Bootstrap the change of the q-quantile between two independent samples (both non-empty)."""
    b, c = baseline.quantile(q), candidate.quantile(q)
    assert b is not None and c is not None, "both samples need values"
    b_star, c_star = baseline.replicates(q, rng, replicates), candidate.replicates(q, rng, replicates)
    low, high = interval(c_star - b_star, confidence)
    if b > 0 and np.all(b_star > 0):
        rel_low, rel_high = interval(c_star / b_star - 1.0, confidence)
        return Delta(c - b, low, high, c / b - 1.0, rel_low, rel_high)
    return Delta(c - b, low, high, None, None, None)
