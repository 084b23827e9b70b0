"""Retention's size caps on SQLite and PostgreSQL: the oldest arrivals go first, exemplars and aggregates stay,
and the size retention keeps track of matches a full recount of the tables at every step."""

from __future__ import annotations

import dataclasses
import random

import pytest
from sqlalchemy import Engine, func, select

from spikehound.storage import retention
from spikehound.storage.reader import Reader, count_rows
from spikehound.storage.retention import Retention, RetentionPolicy, RetentionResult, StoredSize
from spikehound.storage.schema import metric_points, span_blocks
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.storage_data import FOREVER, NOW, SPIKES, T0, S, make_span, point, tid, window

NOW_S = NOW // S
DAY_S = 86_400
NO_AGE = dict(span_max_age_s=365 * DAY_S, point_max_age_s=365 * DAY_S)  # only the size caps bite

# engine (tests/conftest.py): a migrated database, SQLite then PostgreSQL


def recount(engine: Engine) -> StoredSize:
    """The truth, read the expensive way."""
    with engine.connect() as conn:
        span_bytes = conn.execute(select(func.coalesce(func.sum(func.length(span_blocks.c.payload)), 0))).scalar_one()
        points = conn.execute(select(func.count()).select_from(metric_points)).scalar_one()
    return StoredSize(int(span_bytes), int(points))


def block_sizes(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return [n for (n,) in conn.execute(select(func.length(span_blocks.c.payload)).order_by(span_blocks.c.id))]


def write_traces(writer: Writer, traces: range, arrived_s: int, spans: int = 2) -> None:
    """One request (one stored block) per trace, each arriving a second after the last."""
    for n, trace in enumerate(traces):
        batch = WriteBatch(spans=[make_span(trace, s, s - 1 if s > 1 else None) for s in range(1, spans + 1)])
        writer.write(batch, now_ns=(arrived_s + n) * S)


def test_the_span_cap_deletes_the_oldest_blocks_until_the_payloads_fit_and_never_an_exemplar(engine):
    writer, reader = Writer(engine), Reader(engine)
    write_traces(writer, range(1, 9), NOW_S - 3600)
    writer.write(WriteBatch(windows=[window(T0, 30)], spikes=[dataclasses.replace(SPIKES[0],
                                                                                  exemplar_trace_ids=(tid(1),))]))
    sizes = block_sizes(engine)
    cap = sizes[0] + sum(sizes[-3:])  # the exemplar's block counts against the cap too
    r = Retention(engine)

    assert r.measure(NOW_S) == recount(engine) == StoredSize(sum(sizes), 0)
    result = r.enforce(RetentionPolicy(**NO_AGE, span_max_bytes=cap), NOW_S)

    assert result == RetentionResult(spans_over_size=8)  # traces 2 to 5, two spans each
    assert [len(reader.trace(tid(t))) for t in range(1, 9)] == [2, 0, 0, 0, 0, 2, 2, 2]
    assert r.size == recount(engine) == StoredSize(cap, 0)
    assert count_rows(engine, "trace_blocks") == 4
    assert reader.latency("gateway", None, 0, FOREVER) == [window(T0, 30)]  # aggregates and spikes stay
    assert [s.id for s in reader.spikes()] == ["a1"]
    assert r.enforce(RetentionPolicy(**NO_AGE, span_max_bytes=cap), NOW_S) == RetentionResult()


def test_when_only_exemplars_are_left_the_span_cap_stops_and_says_so(engine, caplog):
    writer = Writer(engine)
    write_traces(writer, range(1, 4), NOW_S - 3600)
    writer.write(WriteBatch(spikes=[dataclasses.replace(SPIKES[0], exemplar_trace_ids=(tid(1), tid(2)))]))
    r = Retention(engine)
    r.measure(NOW_S)

    assert r.enforce(RetentionPolicy(**NO_AGE, span_max_bytes=1), NOW_S) == RetentionResult(spans_over_size=2)
    assert [len(Reader(engine).trace(tid(t))) for t in (1, 2, 3)] == [2, 2, 0]
    assert "spike exemplar traces, which retention keeps" in caplog.text
    assert r.size == recount(engine)


def test_the_point_cap_deletes_the_oldest_points(engine):
    writer, reader = Writer(engine), Reader(engine)
    for batch in range(3):  # 4 points per batch; the batches arrive a minute apart
        writer.write(WriteBatch(points=[point(T0 + (batch * 4 + i) * S, float(batch)) for i in range(4)]),
                     now_ns=(NOW_S - 600 + batch * 60) * S)
    r = Retention(engine)
    r.measure(NOW_S)

    assert r.enforce(RetentionPolicy(**NO_AGE, point_max_count=5), NOW_S) == RetentionResult(points_over_size=7)
    series, _ = reader.metrics("gpu-1", None, 0, FOREVER)
    assert [t for t, _ in series[0].points] == [T0 + i * S for i in range(7, 12)]
    assert r.size == recount(engine) == StoredSize(0, 5)


def test_the_point_cap_reaches_into_rows_that_arrived_moments_ago(engine, monkeypatch):
    monkeypatch.setattr(retention, "DELETE_BATCH", 2)
    writer = Writer(engine)
    writer.write(WriteBatch(points=[point(T0 + i * S, 1.0) for i in range(3)]), now_ns=(NOW_S - 3600) * S)
    writer.write(WriteBatch(points=[point(T0 + i * S, 2.0) for i in range(3, 8)]), now_ns=(NOW_S - 1) * S)
    r = Retention(engine)
    r.measure(NOW_S)  # the second batch is still settling: it is re-read at every measure

    assert r.enforce(RetentionPolicy(**NO_AGE, point_max_count=2), NOW_S) == RetentionResult(points_over_size=6)
    series, _ = Reader(engine).metrics("gpu-1", None, 0, FOREVER)
    assert [t for t, _ in series[0].points] == [T0 + 6 * S, T0 + 7 * S]
    assert r.size == recount(engine) == StoredSize(0, 2)


def test_age_goes_first_then_size(engine):
    writer = Writer(engine)
    write_traces(writer, range(1, 3), NOW_S - 10 * DAY_S)  # past the age
    write_traces(writer, range(3, 7), NOW_S - 3600)
    sizes = block_sizes(engine)
    r = Retention(engine)
    r.measure(NOW_S)

    result = r.enforce(RetentionPolicy(span_max_age_s=DAY_S, point_max_age_s=DAY_S, span_max_bytes=sum(sizes[-2:])),
                       NOW_S)

    assert result == RetentionResult(spans=4, spans_over_size=4)
    assert [len(Reader(engine).trace(tid(t))) for t in range(1, 7)] == [0, 0, 0, 0, 2, 2]
    assert r.size == recount(engine)


def test_caps_of_zero_and_an_unmeasured_store_delete_nothing_for_size(engine):
    writer = Writer(engine)
    write_traces(writer, range(1, 4), NOW_S - 3600)
    writer.write(WriteBatch(points=[point(T0 + i * S, 1.0) for i in range(3)]), now_ns=(NOW_S - 3600) * S)
    r = Retention(engine)

    assert r.enforce(RetentionPolicy(**NO_AGE, span_max_bytes=1, point_max_count=1), NOW_S) == RetentionResult()
    r.measure(NOW_S)
    assert r.enforce(RetentionPolicy(**NO_AGE), NOW_S) == RetentionResult()
    assert recount(engine) == r.size == StoredSize(sum(block_sizes(engine)), 3)


def test_the_kept_size_matches_a_recount_through_writes_measures_and_deletes(engine):
    """Writes stamped up to a settling window before they commit, measures minutes apart, a clock that jumps
    back, caps that bite: after every step the ledger equals the expensive recount."""
    rng = random.Random(6)
    writer = Writer(engine)
    r = Retention(engine)
    now_s, trace, t = NOW_S, 1, T0
    for step in range(12):
        for _ in range(rng.randint(0, 4)):
            arrived = now_s - rng.choice([retention.SETTLE_SECONDS - 10, 30, 0])
            spans = [make_span(trace, s, s - 1 if s > 1 else None) for s in range(1, rng.randint(2, 4))]
            points = [point(t + i * S, 1.0, host=rng.choice(["gpu-1", "gpu-2"])) for i in range(rng.randint(0, 30))]
            writer.write(WriteBatch(spans=spans, points=points), now_ns=arrived * S)
            trace, t = trace + 1, t + 100 * S
        now_s += rng.choice([60, 200, 400]) if step != 7 else -1000  # step 7: the clock went back
        r.measure(now_s)
        assert r.size == recount(engine), f"after measure {step}"
        truth = recount(engine)
        policy = RetentionPolicy(span_max_age_s=3000, point_max_age_s=3000,
                                 span_max_bytes=truth.span_bytes * rng.choice([1, 3]) // 4 or 1,
                                 point_max_count=truth.points * rng.choice([1, 3]) // 4 or 1)
        r.enforce(policy, now_s)
        assert r.size == recount(engine), f"after enforce {step}"
        assert r.size.span_bytes <= policy.span_max_bytes or not block_sizes(engine)
        assert r.size.points <= policy.point_max_count


@pytest.mark.parametrize("now_offset", [0, 100])
def test_a_measure_reads_only_rows_not_counted_yet(engine, now_offset):
    """Rows that arrived before the last measure's settling boundary are never read again: deleting them behind
    retention's back (which nothing but retention does) leaves the kept size unchanged."""
    writer = Writer(engine)
    write_traces(writer, range(1, 4), NOW_S - 3600)
    r = Retention(engine)
    first = r.measure(NOW_S)
    with engine.begin() as conn:
        conn.execute(span_blocks.delete())
    assert r.measure(NOW_S + now_offset) == first


def test_latency_windows_go_by_their_age_from_the_newest_window_and_spikes_stay(engine):
    """A window row per stream and 10 s grows for ever without a cap. They have no arrival time: the age counts
    back from the newest window stored, so that windows of a capture replayed today are not taken for old."""
    old_start = T0 - 40 * DAY_S * S  # a month and more before the newest window
    writer = Writer(engine)
    writer.write(WriteBatch(windows=[window(old_start + i * 10 * S, 200) for i in range(6)]
                 + [window(T0 + i * 10 * S, 200) for i in range(3)], spikes=list(SPIKES)), now_ns=NOW)
    r = Retention(engine)
    policy = RetentionPolicy(span_max_age_s=DAY_S, point_max_age_s=DAY_S, window_max_age_s=30 * DAY_S)

    assert r.enforce(policy, NOW_S).windows == 6
    starts = [w.start_unix_nano for w in Reader(engine).latency("gateway", "POST /predict", 0, FOREVER)]
    assert starts == [T0 + i * 10 * S for i in range(3)]
    assert len(Reader(engine).spikes(None, None, None, None, 100)) == len(SPIKES)
    assert r.enforce(dataclasses.replace(policy, window_max_age_s=0), NOW_S).windows == 0  # 0: kept for ever
