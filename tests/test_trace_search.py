"""Trace search and the dependency graph over stored span blocks (spikehound/storage/trace_search.py, read through
spikehound.storage.reader.Reader), on both databases."""

from __future__ import annotations

from spikehound.model import SpanKind
from spikehound.storage.reader import Reader
from spikehound.storage.trace_search import TraceQuery
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.storage_data import MS, NOW, T0, make_span, tid

# engine (tests/conftest.py): a migrated database of each kind

S = 1_000_000_000
HOUR = 3600 * S


def test_search_reads_only_the_service_and_range_asked_and_the_newest_matches_come_first(engine):
    writer = Writer(engine)
    for i in range(6):  # one request per trace: gateway root + model-server child, i seconds apart
        start = T0 + i * S
        writer.write(WriteBatch(spans=[
            make_span(i + 1, 1, start=start, duration=(i + 1) * 100 * MS),
            make_span(i + 1, 2, 1, service="model-server", name="forward", kind=SpanKind.INTERNAL,
                      start=start + MS, duration=(i + 1) * 90 * MS, attributes={"batch.size": 2 ** i})]), now_ns=NOW)

    def ids(**query) -> list[int]:
        found = Reader(engine).find_trace_ids(TraceQuery(**{"start_ns": T0, "end_ns": T0 + HOUR, **query}))
        return [int.from_bytes(t, "big") for t in found]

    assert ids(service="gateway") == [6, 5, 4, 3, 2, 1]
    assert ids(service="gateway", limit=2) == [6, 5]
    assert ids(service="model-server", min_duration_ns=300 * MS) == [6, 5, 4]  # 90 ms x (i + 1) >= 300 ms
    assert ids(service="model-server", max_duration_ns=200 * MS) == [2, 1]
    assert ids(service="model-server", operation="POST /predict") == []
    assert ids(service="model-server", conditions=(lambda s: s.attributes["batch.size"] >= 8,)) == [6, 5, 4]
    assert ids(service="gateway", start_ns=T0 + 2 * S, end_ns=T0 + 3 * S) == [4, 3]  # start times, inclusive
    assert ids(service="nobody") == []

    spans = Reader(engine).traces([tid(3), tid(99)])
    assert list(spans) == [tid(3)] and [s.service for s in spans[tid(3)]] == ["gateway", "model-server"]
    assert Reader(engine).dependencies(T0, T0 + HOUR) == [("gateway", "model-server", 6)]


def test_a_search_stops_after_its_scan_budget(engine):
    writer = Writer(engine)
    for i in range(5):
        writer.write(WriteBatch(spans=[make_span(i + 1, 1, start=T0 + i * S)]), now_ns=NOW)
    query = TraceQuery("gateway", T0, T0 + HOUR, conditions=(lambda s: False,))
    assert Reader(engine).find_trace_ids(query, max_scanned_spans=2) == []
    budgeted = TraceQuery("gateway", T0, T0 + HOUR, limit=100)
    assert Reader(engine).find_trace_ids(budgeted, max_scanned_spans=2) == [tid(5), tid(4)]  # newest blocks


def test_a_retried_request_is_searched_and_counted_once(engine):
    writer = Writer(engine)
    batch = WriteBatch(spans=[make_span(1, 1, kind=SpanKind.CLIENT),
                              make_span(1, 2, 1, service="model-server", start=T0 + MS)])
    writer.write(batch, now_ns=NOW)
    writer.write(batch, now_ns=NOW + S)  # the sender retried after a lost answer: the same spans again

    assert Reader(engine).find_trace_ids(TraceQuery("model-server", T0, T0 + HOUR)) == [tid(1)]
    assert [s.span_id for s in Reader(engine).traces([tid(1)])[tid(1)]] == [b"\0" * 7 + b"\1",
                                                                                  b"\0" * 7 + b"\2"]
    assert Reader(engine).dependencies(T0, T0 + HOUR) == [("gateway", "model-server", 1)]
