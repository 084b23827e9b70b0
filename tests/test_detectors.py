"""The detectors on their own: the River contract, spike judgement, memory bounds and event-time order."""

from __future__ import annotations

import pickle
import random
import tracemalloc
from typing import Any

import pytest
from river import base

from harness.scenarios.traffic import Scenario
from spikehound.detectors.engine import DetectionEngine
from spikehound.detectors.p99_spike import P99SpikeDetector
from spikehound.detectors.resource import ResourceDetector
from spikehound.detectors.sequential import TailSurprise
from spikehound.detectors.settings import DetectionSettings
from spikehound.detectors.streams import StreamKey
from spikehound.model import Span, SpanKind, StatusCode

NS = 1_000_000_000
MS = 1_000_000
WINDOW = 10 * NS


# --- the River contract, shared by every detector ---------------------------------------------------------

def _inputs(detector: base.AnomalyDetector, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    if isinstance(detector, P99SpikeDetector):
        return [{"p99": rng.lognormvariate(-2.5, 0.1), "count": 400, "exceed": rng.randrange(0, 9)}
                for _ in range(40)]
    if isinstance(detector, TailSurprise):
        return [{"duration": rng.lognormvariate(3.0, 0.3)} for _ in range(40)]
    return [{"value": rng.gauss(0.7, 0.05)} for _ in range(40)]


@pytest.mark.parametrize("cls", [P99SpikeDetector, ResourceDetector, TailSurprise])
def test_every_detector_keeps_the_river_contract(cls: type[base.AnomalyDetector]):
    for params in cls._unit_test_params():
        detector = cls(**params)
        assert isinstance(detector, base.AnomalyDetector)
        # Constructor arguments are stored as given, so clone() and repr() describe the detector.
        assert {k: v for k, v in detector._get_params().items() if k in params} == params
        fresh = detector.clone()
        assert fresh._get_params() == detector._get_params() and fresh is not detector

        inputs = _inputs(detector, seed=1)
        assert detector.score_one(inputs[0]) == 0.0, "scores before the grace period are 0"
        for x in inputs:
            assert detector.learn_one(x) is None
        probe = [*_inputs(detector, seed=2)[:5], {"p99": 1.0, "count": 400, "exceed": 120}, {"value": 0.1},
                 {"duration": 1e6}]
        probe = [x for x in probe if set(x) == set(inputs[0])]
        scores = [detector.score_one(x) for x in probe]
        assert all(isinstance(s, float) for s in scores)
        assert scores[-1] > 3, "an extreme input scores high"

        # Same input, same answers: after a clone that learns the same, and after a pickle round trip
        # (which is how the collector checkpoints them).
        twin = detector.clone()
        for x in inputs:
            twin.learn_one(x)
        assert [twin.score_one(x) for x in probe] == scores
        assert [pickle.loads(pickle.dumps(detector)).score_one(x) for x in probe] == scores


# --- spike judgement --------------------------------------------------------------------------------------

T0 = 1_767_225_600 * NS


def _normal(rng: random.Random, n: int, median_ms: float = 50.0) -> list[float]:
    return [median_ms * rng.lognormvariate(0, 0.2) for _ in range(n)]


def _feed(engine: DetectionEngine, k: int, durations_ms: list[float], operation: str = "POST /predict"
          ) -> list[tuple[int, str]]:
    """Requests of one stream ending in window ``k`` (spread over it), then one step: (window, event) of spikes."""
    spans = []
    for i, d in enumerate(durations_ms):
        end = T0 + k * WINDOW + (i + 1) * WINDOW // (len(durations_ms) + 1)
        trace = (k * 100_000 + i).to_bytes(16, "big")
        spans.append(Span(trace_id=trace, span_id=trace[8:], parent_span_id=None, service="api", host="h1",
                          name=operation, kind=SpanKind.SERVER, start_unix_nano=end - int(d * MS),
                          end_unix_nano=end, status=StatusCode.UNSET))
    engine.add(spans)
    return [(k, s.state) for s in engine.advance().spikes]


def _opened(engine: DetectionEngine, windows: list[list[float]]) -> list[int]:
    """The windows in which spikes opened (the engine's count of opened spikes, window by window)."""
    out = []
    for k, durations in enumerate(windows):
        before = engine.spikes_opened
        _feed(engine, k, durations)
        out += [k] * (engine.spikes_opened - before)
    return out


def test_a_sustained_rise_opens_a_spike_in_its_first_window_and_resolves_after_calm_windows():
    rng = random.Random(1)
    engine = DetectionEngine(DetectionSettings())
    windows = [_normal(rng, 300) for _ in range(30)] + [[d + 30 for d in _normal(rng, 300)] for _ in range(6)]
    windows += [_normal(rng, 300) for _ in range(9)]
    opened, resolved = [], []
    for k, durations in enumerate(windows):
        for _, state in _feed(engine, k, durations):
            (resolved if state == "resolved" else opened).append(k)
    # A window is judged when the next one's spans move the watermark past it (plus the 5 s lateness).
    assert opened[0] == 31 and engine.spikes_opened == 1, opened
    # Two calm windows (36 and 37) say the rise is over; the end is held one more window before it is final.
    assert resolved == [39], resolved


def test_a_spike_is_not_learned_as_normal():
    rng = random.Random(2)
    engine = DetectionEngine(DetectionSettings(resolve_windows=2))
    stream = StreamKey("api", "POST /predict")
    for k in range(30):
        _feed(engine, k, _normal(rng, 300))
    _feed(engine, 30, [d * 2 for d in _normal(rng, 300)])  # the last normal window is judged with this step
    baseline = engine.judge.baseline_ns(stream)
    for k in range(31, 60):  # five minutes of spike
        _feed(engine, k, [d * 2 for d in _normal(rng, 300)])
    assert engine.judge.baseline_ns(stream) == baseline
    assert engine.incidents.open_count == 1 and engine.spikes_opened == 1


def test_lone_stalls_and_tiny_rises_page_nobody():
    rng = random.Random(3)
    windows = []
    for k in range(60):
        durations = _normal(rng, 300)
        if k % 7 == 0:
            durations[0] = 900.0  # one request stalls for almost a second
            durations[1] = 700.0
        windows.append(durations)
    assert _opened(DetectionEngine(DetectionSettings()), windows) == []

    tiny = [_normal(rng, 300, median_ms=2.0) for _ in range(30)]
    tiny += [_normal(rng, 300, median_ms=3.0) for _ in range(10)]  # 2 ms -> 3 ms
    assert _opened(DetectionEngine(DetectionSettings()), tiny) == []


def test_a_low_traffic_stream_is_judged_and_its_spike_found_within_two_minutes():
    rng = random.Random(4)
    # One request every two seconds: five a window.
    windows = [_normal(rng, 5) for _ in range(150)] + [[d + 80 for d in _normal(rng, 5)] for _ in range(20)]
    opened = _opened(DetectionEngine(DetectionSettings()), windows)
    assert len(opened) == 1 and 150 <= opened[0] <= 162, opened


def test_a_sparse_stream_is_judged_request_by_request_and_one_stall_is_not_a_spike():
    rng = random.Random(5)
    # One request a window: never 40 within the merge horizon, so the window test never judges it.
    calm = [_normal(rng, 1, median_ms=50.0) for _ in range(80)]
    slow = [[500.0] for _ in range(20)]  # every request ten times slower: calls far over the normal maximum
    opened = _opened(DetectionEngine(DetectionSettings()), calm + slow)
    # Judged a window late (the next request moves the watermark): the second slow call opens it.
    assert opened == [82], opened

    calm[60] = [5_000.0]  # a lone multi-second stall: no spike ...
    assert _opened(DetectionEngine(DetectionSettings()), calm) == []
    # ... and learned as the normal tail it is, so the same rise is less surprising: it takes a few more calls.
    opened = _opened(DetectionEngine(DetectionSettings()), calm + slow)
    assert len(opened) == 1 and 82 < opened[0] <= 86, opened


# --- memory bounds ----------------------------------------------------------------------------------------

def _entry(i: int, name: str, end_ns: int) -> Span:
    return Span(trace_id=i.to_bytes(16, "big"), span_id=i.to_bytes(8, "big"), parent_span_id=None,
                service="api", host="h1", name=name, kind=SpanKind.SERVER, start_unix_nano=end_ns - 5 * MS,
                end_unix_nano=end_ns, status=StatusCode.UNSET)


def test_a_cardinality_bomb_keeps_memory_bounded_and_counts_the_overflow():
    # The caps at a fifth of their defaults: the same twentyfold and hundredfold overflow, a fifth of the spans.
    settings = DetectionSettings(max_streams=200, trace_buffer_spans=1_000)
    engine = DetectionEngine(settings)
    t0 = 1_767_225_600 * NS

    def feed(first: int, last: int) -> None:
        # 100 distinct operation names a second, each seen once: an id baked into the span name.
        for i in range(first, last, 100):
            end = t0 + (i // 100) * NS
            engine.add([_entry(j, f"GET /user/{j}", end) for j in range(i, i + 100)])
            engine.advance()

    tracemalloc.start()
    try:
        feed(0, 4_000)
        after_4k = tracemalloc.get_traced_memory()[0]
        feed(4_000, 20_000)
        after_20k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    stats = engine.stats()
    assert stats["streams"] <= 200 and stats["judged_streams"] <= 200 and len(engine.profiles) <= 200
    assert stats["trace_buffer_spans"] <= 1_000
    # Names seen while 200 were tracked could not be tracked: each of their spans is counted.
    assert stats["overflow_spans"] >= 10_000, stats
    # Five times the names, (almost) no more memory: everything that grows with names is capped.
    assert after_20k < after_4k * 1.3, (after_4k, after_20k)


def test_a_flood_of_one_off_names_pushes_out_its_own_kind_not_a_learned_baseline():
    """The judge is full (max_streams) of one warm stream and cold ones; new one-off names evict the cold."""
    engine = DetectionEngine(DetectionSettings(max_streams=50))
    rng = random.Random(5)
    for k in range(20):  # a stream with a learned baseline
        _feed(engine, k, _normal(rng, 60))
    learned = StreamKey("api", "POST /predict")
    assert engine.judge.is_warm(learned)
    for k in range(20, 40):  # then 100 one-off names a window, each seen once
        engine.add([_entry(k * 1000 + j, f"GET /user/{k * 1000 + j}", T0 + k * WINDOW + NS) for j in range(100)])
        engine.advance()
    # Four times the table went through eviction; least recently judged, the baseline would have gone first.
    assert engine.judge.is_warm(learned) and engine.stats()["evicted_streams"] >= 4 * 50


def test_only_streams_judged_lately_raise_the_bar():
    """Yesterday's streams test nothing today: the Bonferroni count is of streams judged in the last ten
    minutes (event time)."""
    engine = DetectionEngine(DetectionSettings())
    rng = random.Random(6)
    for k in range(20):
        _feed(engine, k, _normal(rng, 60))
    now = T0 + 20 * WINDOW
    assert engine.judge.warm_streams(now) == 1
    assert engine.judge.warm_streams(now + 11 * 60 * NS) == 0


def test_a_chain_of_thousands_of_distinct_spans_costs_a_bounded_walk_and_bounded_memory():
    """Each span of a 3,000-span parent chain is its own stream; each would learn its normal profile from the
    critical path below it (the square of the chain's length, in time and in profile components)."""
    engine = DetectionEngine(DetectionSettings())
    n, end = 3_000, T0 + 5 * NS
    ids = [i.to_bytes(8, "big") for i in range(1, n + 1)]
    engine.add([Span(trace_id=b"\x07" * 16, span_id=sid, parent_span_id=ids[i - 1] if i else None, service="svc",
                     host=None, name=f"op{i}", kind=SpanKind.SERVER, start_unix_nano=end - 100 * MS + i,
                     end_unix_nano=end - i, status=StatusCode.UNSET) for i, sid in enumerate(ids)])
    engine.advance(idle_advance_ns=30 * NS)
    assert engine.stats()["judged_streams"] == n
    assert max(len(p.means) for p in engine.profiles.values()) <= 128
    # Profiles of a few streams near the top of the chain, not 3,000 of them, learned from it.
    assert sum(1 for p in engine.profiles.values() if p.traces) < 100
    assert len(engine.snapshot()) < 5 * 2**20


def test_the_overflow_is_counted_per_span():
    engine = DetectionEngine(DetectionSettings(max_streams=10))
    t0 = 1_767_225_600 * NS
    engine.add([_entry(j, f"op-{j}", t0 + NS) for j in range(25)])
    assert engine.stats()["overflow_spans"] == 15


# --- event time -------------------------------------------------------------------------------------------

def _run(batches: list[tuple[list[Span], list[Any]]], restart_at: int | None = None
         ) -> tuple[list[Any], dict[str, Any]]:
    """Windows (as tuples) and spikes (by id) of one engine run; ``restart_at`` continues from a snapshot there."""
    engine = DetectionEngine(DetectionSettings())
    windows, spikes = [], {}
    for i, (spans, points) in enumerate(batches):
        if i == restart_at:  # checkpoint, and continue in a new engine as a restarted collector does
            engine = DetectionEngine.restore(DetectionSettings(), engine.snapshot())
        engine.add(spans, points)
        step = engine.advance()
        windows += step.windows
        spikes.update((s.id, s) for s in step.spikes)
    step = engine.flush()
    windows += step.windows
    spikes.update((s.id, s) for s in step.spikes)
    return [(w.service, w.operation, w.start_unix_nano, w.count, w.p50_ns, w.p99_ns, w.max_ns) for w in windows], \
        spikes


def test_late_and_out_of_order_spans_within_the_lateness_change_nothing():
    sc = Scenario("queue_wait", "large", seed=5, minutes=5, onset_s=205.0, fault_s=50.0)
    batches = [(b.spans, b.points) for b in sc.batches()]
    in_order_windows, in_order_spikes = _run(batches)
    assert in_order_spikes, "the scenario raises a spike"

    # Reshuffle: every span moves to a random second up to 4 s later (the lateness is 5 s), and each
    # second's spans arrive in random order. Metric samples too.
    rng = random.Random(9)
    late: list[tuple[list[Span], list[Any]]] = [([], []) for _ in range(len(batches) + 5)]
    for i, (spans, points) in enumerate(batches):
        for span in spans:
            late[i + rng.randrange(0, 4)][0].append(span)
        for point in points:
            late[i + rng.randrange(0, 4)][1].append(point)
    for spans, points in late:
        rng.shuffle(spans)
        rng.shuffle(points)
    shuffled_windows, shuffled_spikes = _run(late)

    assert shuffled_windows == in_order_windows
    assert shuffled_spikes.keys() == in_order_spikes.keys()
    for spike_id, spike in in_order_spikes.items():
        other = shuffled_spikes[spike_id]
        assert (other.start_unix_nano, other.end_unix_nano, other.p99_ns, other.baseline_p99_ns) == \
            (spike.start_unix_nano, spike.end_unix_nano, spike.p99_ns, spike.baseline_p99_ns)
        assert [(c.kind, c.service, c.operation, c.host) for c in other.causes] == \
            [(c.kind, c.service, c.operation, c.host) for c in spike.causes]


def test_the_learned_state_survives_a_snapshot():
    sc = Scenario("network_hop", "large", seed=6, minutes=5, onset_s=215.0, fault_s=40.0)
    batches = [(b.spans, b.points) for b in sc.batches()]
    whole_windows, whole_spikes = _run(batches)
    windows, spikes = _run(batches, restart_at=225)  # mid-spike
    assert any(s.start_unix_nano < sc.start_ns + 225 * NS < (s.end_unix_nano or 0) for s in whole_spikes.values())
    assert windows == whole_windows
    assert {k: (s.start_unix_nano, s.end_unix_nano, s.state) for k, s in spikes.items()} == \
        {k: (s.start_unix_nano, s.end_unix_nano, s.state) for k, s in whole_spikes.items()}


def test_a_checkpoint_of_another_window_length_is_refused():
    blob = DetectionEngine(DetectionSettings()).snapshot()
    with pytest.raises(ValueError, match="window length"):
        DetectionEngine.restore(DetectionSettings(window_ns=30 * NS), blob)
