"""Quantiles and bootstrap intervals of detectors.bootstrap: exact where it claims to be, honest where it thins."""

from __future__ import annotations

import numpy as np
import pytest

from spikehound.detectors.bootstrap import OrderStatistics, delta


def naive_replicates(values: np.ndarray, q: float, rng: np.random.Generator, count: int) -> np.ndarray:
    """The textbook bootstrap: resample n values with replacement, take the nearest-rank quantile."""
    n = len(values)
    k = int(np.ceil(q * n - 1e-9))
    draws = np.sort(rng.choice(values, size=(count, n), replace=True), axis=1)
    return draws[:, k - 1]


@pytest.mark.parametrize(("n", "q"), [(50, 0.5), (400, 0.99), (1000, 0.95)])
def test_beta_draws_give_the_textbook_bootstrap_distribution(n, q):
    rng = np.random.default_rng(3)
    values = rng.lognormal(2.0, 0.6, size=n)
    fast = OrderStatistics.of(values).replicates(q, np.random.default_rng(1), 20_000)
    slow = naive_replicates(values, q, np.random.default_rng(2), 4000)
    # Both are draws from one discrete distribution over the sample's order statistics.
    for p in (0.025, 0.25, 0.5, 0.75, 0.975):
        lo, hi = np.quantile(slow, [max(p - 0.02, 0), min(p + 0.02, 1)])
        assert lo <= np.quantile(fast, p) <= hi, p


def test_quantiles_are_nearest_rank_values_that_happened():
    s = OrderStatistics.of([5, 1, 4, 2, 3])
    assert [s.quantile(q) for q in (0.0, 0.2, 0.21, 0.5, 0.99, 1.0)] == [1, 1, 2, 3, 5, 5]
    assert OrderStatistics.of([]).quantile(0.5) is None


def test_a_thinned_large_sample_keeps_its_quantiles_and_intervals():
    rng = np.random.default_rng(11)
    values = rng.lognormal(3.0, 0.8, size=400_000)
    thin = OrderStatistics.of(values)
    exact = OrderStatistics.of(values, max_points=len(values))
    assert not thin.exact and exact.exact and len(thin.values) <= 3000
    for q in (0.5, 0.95, 0.99, 0.999):
        assert thin.quantile(q) == pytest.approx(exact.quantile(q), rel=2e-3)
        a = np.quantile(thin.replicates(q, np.random.default_rng(5), 4000), [0.025, 0.975])
        b = np.quantile(exact.replicates(q, np.random.default_rng(5), 4000), [0.025, 0.975])
        assert a == pytest.approx(b, rel=5e-3)


def test_json_round_trip_and_bad_input():
    rng = np.random.default_rng(0)
    for s in (OrderStatistics.of(rng.random(10)), OrderStatistics.of(rng.random(10_000))):
        back = OrderStatistics.from_json(s.to_json())
        assert back.n == s.n and back.quantile(0.99) == pytest.approx(s.quantile(0.99), abs=1)
    for bad, needle in (({"values": [1]}, "needs n"), ({"n": 3, "values": [1, 2]}, "3 has 2 values"),
                        ({"n": 2, "values": [2, 1]}, "sorted"),
                        ({"n": 5, "values": [1, 2], "ranks": [1, 4]}, "from 1 to n")):
        with pytest.raises(ValueError, match=needle):
            OrderStatistics.from_json(bad)


def test_delta_interval_covers_a_real_shift_and_zero_for_none():
    rng = np.random.default_rng(4)
    base = OrderStatistics.of(rng.lognormal(2.0, 0.3, 2000))
    same = OrderStatistics.of(rng.lognormal(2.0, 0.3, 2000))
    slower = OrderStatistics.of(rng.lognormal(2.0, 0.3, 2000) * 1.3)
    d = delta(base, same, 0.99, np.random.default_rng(1))
    assert d.relative_low < 0 < d.relative_high
    d = delta(base, slower, 0.99, np.random.default_rng(1))
    assert 0.05 < d.relative_low < 0.3 < d.relative_high
    assert d.low > 0
