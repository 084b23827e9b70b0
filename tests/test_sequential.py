"""Sequential evidence on sparse streams: request surprise against a learned pool, and its CUSUM.

The River contract of :class:`TailSurprise` is checked with the other detectors in tests/test_detectors.py.
"""

from __future__ import annotations

import pickle
import random

import pytest

from spikehound.detectors.sequential import SequentialEvidence, TailSurprise

MS = 1_000_000


def _pool(n: int = 200, seed: int = 1, median_ms: float = 20.0) -> TailSurprise:
    rng = random.Random(seed)
    tail = TailSurprise(grace_requests=24)
    for _ in range(n):
        tail.learn_one({"duration": median_ms * rng.lognormvariate(0.0, 0.4) * MS})
    return tail


def test_nothing_is_surprising_before_the_pool_is_warm():
    tail = _pool(n=23)
    assert not tail.warm and tail.score_one({"duration": 10_000 * MS}) == 0.0
    tail.learn_one({"duration": 20 * MS})
    assert tail.warm and tail.score_one({"duration": 10_000 * MS}) > 3


def test_surprise_grows_with_how_far_over_normal_and_is_capped():
    tail = _pool()
    scores = [tail.score_one({"duration": ms * MS}) for ms in (10, 20, 60, 200, 2_000, 200_000)]
    assert scores == sorted(scores), scores
    assert scores[0] == scores[1] == 0.0 or scores[0] < 0.2  # a typical request says nothing
    assert scores[-1] == tail.max_surprise  # one request never says more than that


def test_a_rise_must_be_material_to_surprise():
    # A pool of microsecond health checks: 5 ms more is the least that counts (min_abs_rise).
    tail = TailSurprise(grace_requests=10)
    for i in range(100):
        tail.learn_one({"duration": (20 + i) * 1_000})
    assert tail.score_one({"duration": 3 * MS}) == 0.0  # 25x slower, but only 3 ms
    assert tail.score_one({"duration": 6 * MS}) > 2


def test_vectorised_surprise_equals_one_by_one():
    tail = _pool()
    rng = random.Random(3)
    durations = sorted(int(rng.lognormvariate(3.2, 1.2) * MS) for _ in range(200))
    assert tail.surprises(durations) == pytest.approx([tail.score_one({"duration": d}) for d in durations])


def test_the_pool_forgets_its_oldest_requests():
    tail = TailSurprise(pool_size=50, grace_requests=10)
    for _ in range(50):
        tail.learn_one({"duration": 500 * MS})
    for _ in range(50):
        tail.learn_one({"duration": 10 * MS})
    assert tail.pooled == 50 and tail.quantile(1.0) == 10 * MS


def _sample(i: int, end_s: float, duration_ms: float = 1.0) -> tuple[int, bytes, bytes, int]:
    return (int(duration_ms * MS), i.to_bytes(16, "big"), i.to_bytes(8, "big"), int(end_s * 1e9))


def test_normal_requests_bring_the_evidence_back_to_zero_and_a_run_of_slow_ones_piles_it_up():
    evidence = SequentialEvidence(drift=0.9)
    evidence.update(0, [(4.0, _sample(1, 1))])  # a lone far-over request
    assert evidence.value == pytest.approx(3.1) and len(evidence.slow) == 1
    evidence.update(10, [(0.1, _sample(i, 11 + i)) for i in range(2, 6)])  # four normal ones
    assert evidence.value == 0.0 and evidence.slow == [] and evidence.calm_run == 4
    for k in range(3):
        evidence.update(20 + 10 * k, [(4.0, _sample(10 + k, 21 + 10 * k))])
    assert evidence.value == pytest.approx(9.3) and [r.trace_id[-1] for r in evidence.slow] == [10, 11, 12]
    assert evidence.calm_run == 0


def test_the_onset_is_where_the_run_began_not_a_stray_slow_request_before_it():
    evidence = SequentialEvidence(drift=0.9)
    evidence.update(0, [(4.0, _sample(1, 1))])  # a stray stall ...
    evidence.update(10, [(0.0, _sample(i, 11)) for i in range(2, 6)])  # ... normal requests take it away ...
    for k in range(4):  # ... then the fault
        evidence.update(20 + 10 * k, [(4.0, _sample(10 + k, 21 + 10 * k)), (0.0, _sample(20 + k, 22 + 10 * k))])
    assert evidence.onset_ns == 20 and evidence.slow[0].trace_id[-1] == 10
    # Between two slow ones, a dip that normal requests did not clear is part of the same rise.
    evidence.update(60, [(0.0, _sample(30, 61)), (4.0, _sample(31, 62))])
    assert evidence.onset_ns == 20


def test_a_busy_window_gives_the_same_evidence_added_at_once_or_request_by_request():
    rng = random.Random(11)
    scored = [(rng.choice([0.0, 0.1, 0.3, 4.0]) if i > 150 else rng.random() * 0.5, _sample(i, i * 0.01))
              for i in range(400)]
    at_once = SequentialEvidence(drift=0.9)
    at_once.update(0, scored)
    one_by_one = SequentialEvidence(drift=0.9)
    for item in scored:
        one_by_one.update(0, [item])
    assert at_once.value == pytest.approx(one_by_one.value)
    assert [r.trace_id for r in at_once.slow] == [r.trace_id for r in one_by_one.slow]
    assert at_once.calm_run == one_by_one.calm_run
    assert at_once.penalty == pytest.approx(one_by_one.penalty)


def test_the_evidence_survives_a_checkpoint():
    evidence = SequentialEvidence()
    evidence.update(0, [(4.0, _sample(1, 1)), (4.0, _sample(2, 2))])
    assert pickle.loads(pickle.dumps(evidence)) == evidence
