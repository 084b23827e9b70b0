"""The compare verdict (spikehound.detectors.compare) on known distributions: how often it errs, what it names."""

from __future__ import annotations

import numpy as np

from spikehound.detectors.bootstrap import OrderStatistics
from spikehound.detectors.compare import CompareOptions, compare, comparison_report
from spikehound.detectors.path_time import Stage
from spikehound.detectors.profile import OperationProfile, Profile

MS = 1e6
PRE, FWD = Stage("span", "pre", "resize"), Stage("span", "model", "forward")


def side(rng: np.random.Generator, n: int, slow_share: float = 0.0, extra_ms: float = 0.0,
         new_stage: Stage | None = None) -> Profile:
    """n requests of preprocessing + forward (log-normal, with a rare heavy tail); a share gets extra_ms more."""
    pre = rng.lognormal(np.log(2.0), 0.3, n) + np.where(rng.random(n) < slow_share, extra_ms, 0.0)
    fwd = rng.lognormal(np.log(6.0), 0.25, n) * np.where(rng.random(n) < 0.01, rng.pareto(1.5, n) + 1, 1.0)
    # whole ns, as spans have
    stages = {PRE: OrderStatistics.of(np.rint(pre * MS)), FWD: OrderStatistics.of(np.rint(fwd * MS))}
    if new_stage is not None:
        stages[new_stage] = OrderStatistics.of(np.full(n, 4 * MS))
    latency = OrderStatistics.of(np.rint((pre + fwd + (4.0 if new_stage else 0.0)) * MS))
    return Profile({("gw", "POST /predict"): OperationProfile("gw", "POST /predict", latency, stages, n)})


def test_same_distribution_rarely_fails_the_gate():
    rng = np.random.default_rng(20)
    exits = [compare(side(rng, 400), side(rng, 400), CompareOptions(seed=i)).exit_code for i in range(300)]
    assert set(exits) <= {0, 1}
    assert exits.count(1) <= 6  # the rule asks the whole interval to clear +5 %: far fewer than 5 % fail


def test_a_15_ms_tail_on_preprocessing_is_found_and_named():
    rng = np.random.default_rng(21)
    found = []
    for i in range(40):
        result = compare(side(rng, 600), side(rng, 600, slow_share=0.05, extra_ms=15.0), CompareOptions(seed=i))
        (op,) = result.operations
        found.append(result.exit_code == 1 and op.grew is not None and op.grew.stage == PRE)
        assert op.delta["p50"].low < 0.1 * MS  # the median did not move
    assert sum(found) >= 38


def test_a_new_span_on_the_path_is_what_grew():
    rng = np.random.default_rng(22)
    audit = Stage("span", "gw", "audit log")
    result = compare(side(rng, 500), side(rng, 500, new_stage=audit))
    (op,) = result.operations
    assert result.exit_code == 1 and op.grew is not None and op.grew.stage == audit
    assert "the span that grew: gw: audit log" in result.message


def test_filters_limits_and_a_saved_profile():
    rng = np.random.default_rng(23)
    base, cand = side(rng, 300), side(rng, 300, slow_share=0.2, extra_ms=30.0)
    assert compare(base, cand, CompareOptions(service="other")).message == (
        "too little data to judge: no operation matches --service other")
    short = compare(base, cand, CompareOptions(min_requests=500))
    assert short.exit_code == 2 and "the baseline has 300 requests and the candidate has 300 requests" in short.message
    loose = compare(base, cand, CompareOptions(max_regression=10.0))
    assert loose.exit_code == 0 and loose.operations[0].delta["p99"].relative_low > 0.05
    saved = Profile.from_json(base.to_json())
    assert comparison_report(compare(saved, cand), saved, cand)["operations"] == \
        comparison_report(compare(base, cand), base, cand)["operations"]
