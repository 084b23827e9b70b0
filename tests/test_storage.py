"""Storage on SQLite and PostgreSQL: migrations, the writer/reader round trip, failures, retention, indexes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy.exc
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2
from sqlalchemy import Engine, select, text

from spikehound.heap import configure_malloc, heap_used_and_free_bytes
from spikehound.model import (
    AffectedStream,
    Span,
    SpanKind,
    StatusCode,
)
from spikehound.otlp import count_items, decode_spans, encode_span, encode_spans, set_any_value
from spikehound.storage import checkpoints, retention
from spikehound.storage import reader as reader_module
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import current_revision, head_revision, upgrade
from spikehound.storage.reader import HostSummary, MetricSeries, Reader, count_rows
from spikehound.storage.retention import RetentionResult, expire
from spikehound.storage.schema import metadata, span_blocks
from spikehound.storage.trace_search import TraceQuery
from spikehound.storage.writer import SpanBlock, WriteBatch, Writer
from tests.support.query_plans import FULL_SCAN, plan_of
from tests.support.storage_data import FOREVER, MS, NOW, SPIKES, T0, S, causes, make_span, point, sid, tid, window

DAY_S = 86_400


def view(s: Span) -> tuple[Any, ...]:
    """Everything the API shows of a span."""
    return (s.trace_id, s.span_id, s.parent_span_id, s.service, s.host, s.name, s.kind, s.start_unix_nano,
            s.end_unix_nano, s.duration_ns, s.status, s.attributes, s.events, s.resource)


def stored_blocks(engine: Engine) -> list[tuple[int, bytes]]:
    """(span_count, payload) of every stored span block, oldest first."""
    with engine.connect() as conn:
        return [(n, bytes(payload)) for n, payload in conn.execute(
            select(span_blocks.c.span_count, span_blocks.c.payload).order_by(span_blocks.c.id))]


# --- migrations -------------------------------------------------------------------------------


def test_upgrade_reaches_head_is_idempotent_and_matches_the_schema(db_url):
    eng = make_engine(db_url)
    try:
        assert current_revision(eng) is None
        assert head_revision() == "0011"
        assert upgrade(eng) == head_revision()
        Writer(eng).write(WriteBatch(spans=[make_span(1, 1)]), now_ns=NOW)

        assert upgrade(eng) == head_revision()  # running it again (every collector start does) changes nothing
        assert current_revision(eng) == head_revision()
        assert [s.span_id for s in Reader(eng).trace(tid(1))] == [sid(1)]

        with eng.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, metadata) == []
    finally:
        eng.dispose()


@pytest.mark.postgres
def test_span_blocks_large_enough_to_compress_are_stored_with_lz4_on_postgresql(pg_url):
    eng = make_engine(pg_url)
    try:
        upgrade(eng)
        # A request's block of a few hundred spans is some kilobytes: PostgreSQL compresses it when stored.
        Writer(eng).write(WriteBatch(spans=[make_span(1, n) for n in range(1, 201)]), now_ns=NOW)
        with eng.connect() as conn:
            method, stored, encoded = conn.execute(text(
                "SELECT pg_column_compression(payload), pg_column_size(payload), length(payload) "
                "FROM span_blocks")).one()
        assert (method, stored < encoded / 2) == ("lz4", True)
    finally:
        eng.dispose()


@pytest.mark.postgres
@pytest.mark.skipif(not configure_malloc(), reason="glibc's malloc only")
def test_checkpoints_written_on_postgresql_leave_no_pooled_connection_holding_their_size(pg_url):
    # libpq keeps a connection's send buffer at the largest message it sent. A soak's collector wrote its
    # 15-30 MB checkpoint every minute through whichever pooled connection was free, and each kept 16 or 32 MiB.
    eng = make_engine(pg_url)
    held: list[Any] = []
    try:
        upgrade(eng)
        state = bytes(range(256)) * (15 * 2**12)  # 15 MiB
        before, _ = heap_used_and_free_bytes()
        for _ in range(3):
            checkpoints.save(eng, "detection", 1, state)
            held.append(eng.connect())  # busy elsewhere (the writer, a page): the next one goes another way
        for conn in held:
            conn.close()
        grown = heap_used_and_free_bytes()[0] - before
        assert checkpoints.load(eng, "detection").state == state
        assert grown < 12 * 2**20  # three connections holding 16 MiB each, before
    finally:
        eng.dispose()


# --- spans ------------------------------------------------------------------------------------


def test_spans_built_in_code_round_trip_with_attributes_events_and_resource(engine):
    root = make_span(1, 1, status=StatusCode.OK, resource={"service.version": "1.2.3", "k8s.pod.name": "gw-0"},
                     attributes={"http.route": "/predict", "http.response.status_code": 200, "ratio": 0.25,
                                 "cached": False, "tags": ["a", "b"], "labels": {"team": "ml"}})
    child = make_span(1, 2, 1, service="model", host="gpu-2", name="forward", kind=SpanKind.INTERNAL,
                      start=T0 + 1 * MS, duration=3 * MS, status=StatusCode.ERROR, attributes={"gpu.index": 0},
                      events=[{"name": "exception", "time_unix_nano": T0 + 2 * MS,
                               "attributes": {"exception.type": "RuntimeError", "exception.message": "CUDA OOM"}}],
                      resource={"service.version": "9"})
    client = make_span(1, 3, 1, service="gateway", host=None, name="GET features", kind=SpanKind.CLIENT,
                       start=T0 + 500_000, duration=400_000, resource={"service.version": "1.2.3",
                                                                       "k8s.pod.name": "gw-0"})
    elsewhere = make_span(2, 9)
    Writer(engine).write(WriteBatch(spans=[child, elsewhere, client, root]), now_ns=NOW)

    got = Reader(engine).trace(tid(1))

    assert [view(s) for s in got] == [view(s) for s in (root, client, child)]  # ordered by start time
    assert [s.message for s in got] == [encode_span(s) for s in (root, client, child)]
    assert got[2].events[0]["attributes"]["exception.message"] == "CUDA OOM"
    assert [s.span_id for s in Reader(engine).trace(tid(2))] == [sid(9)]
    assert Reader(engine).trace(tid(3)) == []
    assert count_rows(engine, "span_blocks") == 1  # one batch without blocks: its spans are encoded into one
    assert count_rows(engine, "trace_blocks") == 2  # indexed once per trace it holds


def _otlp_request() -> tuple[ExportTraceServiceRequest, list[trace_pb2.Span]]:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, value in {"service.name": "gateway", "host.name": "gpu-7", "service.version": "2.0",
                       "telemetry.sdk.language": "python"}.items():
        set_any_value(rs.resource.attributes.add(key=key).value, value)
    spans = rs.scope_spans.add(scope={"name": "test"}).spans
    root = spans.add(trace_id=tid(5), span_id=sid(1), name="POST /predict", kind=trace_pb2.Span.SPAN_KIND_SERVER,
                     start_time_unix_nano=T0, end_time_unix_nano=T0 + 20 * MS, trace_state="vendor=x")
    root.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    root.status.message = "upstream timed out"
    for key, value in {"http.request.method": "POST", "retries": 3, "latency.budget": 0.5, "sampled": True,
                       "model.inputs": ["text", "image"], "payload": b"\x01\xff"}.items():
        set_any_value(root.attributes.add(key=key).value, value)
    ev = root.events.add(name="queue.wait", time_unix_nano=T0 + MS)
    set_any_value(ev.attributes.add(key="depth").value, 7)
    root.links.add(trace_id=tid(77), span_id=sid(7))
    child = spans.add(trace_id=tid(5), span_id=sid(2), parent_span_id=sid(1), name="tokenize",
                      kind=trace_pb2.Span.SPAN_KIND_UNSPECIFIED, start_time_unix_nano=T0 + MS,
                      end_time_unix_nano=T0 + 4 * MS)
    return req, [root, child]


def test_spans_decoded_from_otlp_round_trip_keeping_the_whole_message(engine):
    req, sent = _otlp_request()
    decoded = decode_spans(req).spans
    Writer(engine).write(WriteBatch(spans=decoded), now_ns=NOW)

    root, child = Reader(engine).trace(tid(5))

    assert (root.service, root.host, root.name, root.kind, root.status) == (
        "gateway", "gpu-7", "POST /predict", SpanKind.SERVER, StatusCode.ERROR)
    assert (root.parent_span_id, root.start_unix_nano, root.duration_ns) == (None, T0, 20 * MS)
    assert root.resource == {"service.version": "2.0", "telemetry.sdk.language": "python"}
    assert root.attributes == {"http.request.method": "POST", "retries": 3, "latency.budget": 0.5,
                               "sampled": True, "model.inputs": ["text", "image"], "payload": "01ff"}
    assert root.events == [{"name": "queue.wait", "time_unix_nano": T0 + MS, "attributes": {"depth": 7}}]
    assert (child.parent_span_id, child.kind, child.status, child.attributes) == (
        sid(1), SpanKind.INTERNAL, StatusCode.UNSET, {})
    # Links, trace state and the status message are not shown by the API yet, but nothing is thrown away.
    assert [s.message for s in (root, child)] == sent
    assert [encode_span(s) for s in (root, child)] == sent
    assert [view(s) for s in (root, child)] == [view(s) for s in decoded]


def test_a_request_is_stored_as_received_minus_its_rejected_spans(engine):
    """The collector's path: one block per export request, holding the request's own bytes."""
    req, sent = _otlp_request()
    body = req.SerializeToString()
    whole = decode_spans(req, body)
    assert whole.payload is body  # every span valid: the bytes as received, not re-encoded
    other = ExportTraceServiceRequest()
    other.CopyFrom(req)
    spans = other.resource_spans[0].scope_spans[0].spans
    spans.add(trace_id=tid(6), span_id=sid(1), name="GET /a", start_time_unix_nano=T0, end_time_unix_nano=T0 + MS)
    spans.add(trace_id=tid(6), span_id=b"\x02" * 4, name="broken", start_time_unix_nano=T0,
              end_time_unix_nano=T0 + MS)
    partial = decode_spans(other, other.SerializeToString())
    assert (len(partial.spans), partial.rejected) == (3, 1)

    Writer(engine).write(WriteBatch(spans=whole.spans + partial.spans,
                                    blocks=[SpanBlock.of(whole.payload, whole.spans),
                                            SpanBlock.of(partial.payload, partial.spans)]), now_ns=NOW)

    (first, n1), (second, n2) = [(payload, n) for n, payload in stored_blocks(engine)]
    assert (first, n1) == (body, 2)
    assert (count_items(ExportTraceServiceRequest.FromString(second)), n2) == (3, 3)  # the broken span is gone
    reader = Reader(engine)
    assert [s.message for s in reader.trace(tid(5))] == sent  # in both blocks, served once
    assert [s.name for s in reader.trace(tid(6))] == ["GET /a"]
    assert count_rows(engine, "trace_blocks") == 3  # (5, first), (5, second), (6, second)


def test_blocks_alone_store_what_their_spans_would(engine, tmp_path):
    """The collector's own path when detection has its process: the queue keeps each request's block, not its
    decoded spans; the writer must store the same traces, operations, trace index and hosts from the blocks."""
    spans = [make_span(1, 1), make_span(1, 2, 1, name="forward"), make_span(2, 1, name="GET /health")]
    blocks = [SpanBlock.of(encode_spans(part).SerializeToString(), part) for part in (spans[:2], spans[2:])]
    Writer(engine).write(WriteBatch(blocks=blocks), now_ns=NOW)
    with_spans = make_engine(f"sqlite:///{tmp_path / 'with-spans.db'}")
    try:
        upgrade(with_spans)
        Writer(with_spans).write(WriteBatch(spans=spans, blocks=blocks), now_ns=NOW)
        for e in (engine, with_spans):
            reader = Reader(e)
            assert [view(s) for s in reader.trace(tid(1))] == [view(s) for s in spans[:2]]
            assert [view(s) for s in reader.trace(tid(2))] == [view(s) for s in spans[2:]]
            assert [(service, sorted(ops)) for service, ops in reader.services()] == [
                ("gateway", ["GET /health", "POST /predict", "forward"])]
            assert [h.host for h in reader.hosts()] == [spans[0].host]
            assert (count_rows(e, "span_blocks"), count_rows(e, "trace_blocks")) == (2, 2)
    finally:
        with_spans.dispose()


def test_a_block_keeps_one_object_for_its_trace_ids_and_refuses_an_id_storage_cannot_index():
    spans = [make_span(t, 1) for t in (3, 1, 3, 2)]
    block = SpanBlock.of(b"payload", spans)
    assert (block.span_count, sorted(block.trace_id_list())) == (4, [tid(1), tid(2), tid(3)])
    assert isinstance(block.trace_ids, bytes)
    odd = Span(trace_id=b"short", span_id=sid(1), parent_span_id=None, service="gateway", host=None, name="GET /",
               kind=SpanKind.SERVER, start_unix_nano=T0, end_unix_nano=T0 + MS, status=StatusCode.OK)
    with pytest.raises(ValueError, match="16 bytes"):
        SpanBlock.of(b"payload", [odd])


def test_a_retried_batch_is_served_once(engine):
    spans = [make_span(1, 1), make_span(1, 2, 1, name="forward"), make_span(2, 1)]
    batch = WriteBatch(spans=spans, points=[point(T0, 0.5)])
    writer = Writer(engine)
    writer.write(batch, now_ns=NOW)
    writer.write(batch, now_ns=NOW + S)  # the sender never saw the answer and sent it again
    Writer(engine).write(batch, now_ns=NOW + 2 * S)  # ... to a restarted collector, with empty caches
    # ... and once more inside one batch, next to the rest of its trace that came in another request
    late = make_span(1, 3, 2, name="forward", start=T0 + MS)
    again = SpanBlock.of(stored_blocks(engine)[0][1], spans)
    late_block = SpanBlock.of(encode_spans([late]).SerializeToString(), [late])
    writer.write(WriteBatch(spans=[*spans, late], blocks=[again, again, late_block]), now_ns=NOW + 3 * S)

    reader = Reader(engine)
    got = reader.trace(tid(1))
    assert [s.span_id for s in got] == [sid(1), sid(2), sid(3)]  # each span once, by start time
    assert [view(s) for s in got] == [view(s) for s in (spans[0], spans[1], late)]
    assert [s.span_id for s in reader.trace(tid(2))] == [sid(1)]
    assert count_rows(engine, "span_blocks") == 6  # retries are stored again: reading takes care of them
    assert count_rows(engine, "operations") == 2  # one row per operation, however often it arrives
    assert [(service, sorted(ops)) for service, ops in reader.services()] == [("gateway", ["POST /predict", "forward"])]
    series, _ = reader.metrics("gpu-1", None, 0, FOREVER)
    assert [s.points for s in series] == [((T0, 0.5),)]
    assert count_rows(engine, "metric_points") == 1


def test_a_replay_reads_blocks_in_commit_order_and_stops_at_the_block_that_reached_its_span_budget(engine):
    """What a restart replays is read a commit's worth at a time (collector/commit_feed.py), not hundreds of
    thousands of spans at once."""
    writer = Writer(engine)
    for request in range(5):  # five requests of four spans each, a block each
        spans = [make_span(10 + request, i, name=f"r{request}") for i in range(1, 5)]
        writer.write(WriteBatch(spans=spans), now_ns=NOW)
    reader = Reader(engine)
    last, first = reader.spans_after(0, 256, max_spans=6)  # the second block reaches six
    assert [s.name for s in first] == ["r0"] * 4 + ["r1"] * 4
    last, rest = reader.spans_after(last, 256, max_spans=6)
    assert [s.name for s in rest] == ["r2"] * 4 + ["r3"] * 4
    last, end = reader.spans_after(last, 256)
    assert [s.name for s in end] == ["r4"] * 4
    assert reader.spans_after(last, 256) == (last, [])


def test_a_runaway_trace_is_cut_at_max_trace_spans(engine, monkeypatch):
    monkeypatch.setattr(reader_module, "MAX_TRACE_SPANS", 3)
    spans = [make_span(1, s, start=T0 + s * MS) for s in range(1, 6)]
    writer = Writer(engine)
    writer.write(WriteBatch(spans=spans[:2]), now_ns=NOW)
    writer.write(WriteBatch(spans=spans[:2]), now_ns=NOW)  # duplicates do not count against the cap
    writer.write(WriteBatch(spans=spans[2:]), now_ns=NOW)

    assert [s.span_id for s in Reader(engine).trace(tid(1))] == [sid(1), sid(2), sid(3)]


def test_services_list_every_operation_once(engine):
    writer = Writer(engine)
    writer.write(WriteBatch(spans=[make_span(1, 1, service="model", name="forward"),
                                   make_span(1, 2, service="gateway", name="POST /predict"),
                                   make_span(2, 1, service="model", name="forward")]), now_ns=NOW)
    writer.write(WriteBatch(spans=[make_span(3, 1, service="model", name="load")]), now_ns=NOW)

    assert Reader(engine).services() == [("gateway", ["POST /predict"]), ("model", ["forward", "load"])]


# --- metrics and hosts ------------------------------------------------------------------------


def test_metric_points_round_trip_by_host_name_and_time(engine):
    points = ([point(T0 + i * S, i / 10) for i in range(10)]
              + [point(T0 + i * S, 1 - i / 10, attributes={"hw.id": "GPU-1"}) for i in range(10)]
              + [point(T0 + i * S, 0.3, name="system.cpu.utilization", attributes={}) for i in range(3)]
              + [point(T0, 42.0, host="gpu-2", name="system.cpu.utilization", attributes={"cpu.mode": "user"},
                       unit="%")])
    Writer(engine).write(WriteBatch(points=points), now_ns=NOW)
    reader = Reader(engine)

    series, truncated = reader.metrics("gpu-1", "hw.gpu.utilization", T0, T0 + 10 * S)
    assert not truncated
    assert [(s.host, s.name, s.attributes, s.unit) for s in series] == [
        ("gpu-1", "hw.gpu.utilization", {"hw.id": "GPU-0"}, "1"),
        ("gpu-1", "hw.gpu.utilization", {"hw.id": "GPU-1"}, "1")]
    assert series[0].points == tuple((T0 + i * S, i / 10) for i in range(10))

    series, _ = reader.metrics("gpu-1", "hw.gpu.utilization", T0 + 2 * S, T0 + 5 * S)  # since <= t < until
    assert [[t for t, _ in s.points] for s in series] == [[T0 + 2 * S, T0 + 3 * S, T0 + 4 * S]] * 2

    series, _ = reader.metrics(None, "system.cpu.utilization", 0, FOREVER)
    assert series == [
        MetricSeries("gpu-1", "system.cpu.utilization", {}, "1", tuple((T0 + i * S, 0.3) for i in range(3))),
        MetricSeries("gpu-2", "system.cpu.utilization", {"cpu.mode": "user"}, "%", ((T0, 42.0),))]

    series, _ = reader.metrics("gpu-2", None, 0, FOREVER)
    assert [s.name for s in series] == ["system.cpu.utilization"]
    assert reader.metrics("gpu-3", None, 0, FOREVER) == ([], False)
    assert reader.metrics("gpu-1", None, T0 + 100 * S, FOREVER) == ([], False)


def test_metric_queries_stop_at_max_points_and_say_so(engine):
    points = ([point(T0 + i * S, float(i)) for i in range(10)]
              + [point(T0 + i * S, float(i), attributes={"hw.id": "GPU-1"}) for i in range(10)]
              # A third series whose only sample lies outside the range asked for.
              + [point(T0 - 100 * S, 1.0, attributes={"hw.id": "GPU-2"})])
    Writer(engine).write(WriteBatch(points=points), now_ns=NOW)
    reader = Reader(engine)

    series, truncated = reader.metrics("gpu-1", None, T0, FOREVER, max_points=15)
    assert truncated
    assert [len(s.points) for s in series] == [10, 5]
    assert series[1].points == tuple((T0 + i * S, float(i)) for i in range(5))  # oldest first

    series, truncated = reader.metrics("gpu-1", None, T0, FOREVER, max_points=5)
    assert truncated and [len(s.points) for s in series] == [5]

    series, truncated = reader.metrics("gpu-1", None, T0, FOREVER, max_points=20)
    assert not truncated  # exactly everything there is fits
    assert [len(s.points) for s in series] == [10, 10]

    series, truncated = reader.metrics("gpu-1", None, T0, FOREVER, max_points=21)
    assert not truncated and [len(s.points) for s in series] == [10, 10]


def test_a_series_without_points_in_range_does_not_count_as_truncation(engine):
    Writer(engine).write(WriteBatch(points=[point(T0 + i * S, float(i)) for i in range(4)]
                                    + [point(T0 - 100 * S, 1.0, attributes={"hw.id": "GPU-1"})]), now_ns=NOW)

    series, truncated = Reader(engine).metrics("gpu-1", None, T0, FOREVER, max_points=4)

    assert [len(s.points) for s in series] == [4]
    assert not truncated


def test_hosts_list_their_metric_names_and_when_they_were_last_seen(engine):
    writer = Writer(engine)
    writer.write(WriteBatch(points=[point(T0, 0.5), point(T0, 0.2, name="system.cpu.utilization", attributes={}),
                                    point(T0, 0.7, attributes={"hw.id": "GPU-1"})]), now_ns=NOW)
    writer.write(WriteBatch(spans=[make_span(1, 1, host="gpu-2"), make_span(1, 2, 1, host=None)]),
                 now_ns=NOW + 5 * S)

    assert Reader(engine).hosts() == [
        HostSummary("gpu-1", NOW, ("hw.gpu.utilization", "system.cpu.utilization")),
        HostSummary("gpu-2", NOW + 5 * S, ())]

    writer.write(WriteBatch(points=[point(T0 + S, 0.5)]), now_ns=NOW + 10 * S)
    assert Reader(engine).hosts()[0] == HostSummary("gpu-1", NOW + 10 * S,
                                                    ("hw.gpu.utilization", "system.cpu.utilization"))


def test_a_nan_or_infinite_sample_is_rejected_to_its_sender_and_the_rest_is_stored(engine):
    """SQLite would store NaN as NULL and JSON cannot say infinity: decoding rejects both with a reason.

    The rest of the request is kept.
    """
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from spikehound.otlp import decode_metrics

    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="host.name").value.string_value = "gpu-1"
    gauge = rm.scope_metrics.add().metrics.add(name="hw.gpu.utilization").gauge
    for t, v in ((T0, float("nan")), (T0 + S, 0.5), (T0 + 2 * S, float("inf"))):
        gauge.data_points.add(time_unix_nano=t, as_double=v)
    decoded = decode_metrics(req)
    assert decoded.rejected == 2
    assert [e.split(": ")[1] for e in decoded.errors] == ["value nan is not a finite number",
                                                          "value inf is not a finite number"]
    Writer(engine).write(WriteBatch(spans=[make_span(1, 1)], points=decoded.points), now_ns=NOW)

    series, _ = Reader(engine).metrics("gpu-1", None, 0, FOREVER)
    assert [s.points for s in series] == [((T0 + S, 0.5),)]
    assert len(Reader(engine).trace(tid(1))) == 1


def test_names_the_columns_cannot_hold_are_cut_to_fit_not_failing_the_batch(engine):
    """PostgreSQL refuses over-long VARCHARs and NUL characters; a sender's odd span must not poison the batch.

    Spans themselves are kept whole in their block; only the lookup rows (operations, hosts, windows, series) are cut.
    """
    long_name = "SELECT " + "x, " * 600 + "y FROM t"  # some database instrumentations name spans by the query
    odd = make_span(1, 1, service="s" * 300, host="h\x00st", name=long_name)
    # Two names that differ only past the column width become one operation row, in the same batch.
    twin = make_span(1, 2, 1, service="s" * 300, host="h\x00st", name=long_name + " LIMIT 1", start=T0 + MS)
    nul = make_span(3, 1, service="model", name="GET /\x00x")
    Writer(engine).write(WriteBatch(spans=[odd, twin, make_span(2, 1), nul],
                                    points=[point(T0, 1.0, host="gpu-1", name="m" * 300, unit="u" * 100)],
                                    windows=[window(T0, 50, service="s" * 300, operation=long_name)]), now_ns=NOW)
    reader = Reader(engine)

    stored, stored_twin = reader.trace(tid(1))
    assert (stored.service, stored.name, stored.host) == ("s" * 300, long_name, "h\x00st")  # intact
    assert stored_twin.name == long_name + " LIMIT 1"
    assert [s.message for s in (stored, stored_twin)] == [encode_span(odd), encode_span(twin)]
    assert [s.name for s in reader.trace(tid(3))] == ["GET /\x00x"]
    assert len(reader.trace(tid(2))) == 1
    assert ("s" * 255, [long_name[:1024]]) in reader.services()
    assert ("model", ["GET /\ufffdx"]) in reader.services()
    assert "h\ufffdst" in [h.host for h in reader.hosts()]
    assert [w.p99_ns for w in reader.latency("s" * 255, long_name[:1024], 0, FOREVER)] == [50 * MS]
    series, _ = reader.metrics("gpu-1", "m" * 255, 0, FOREVER)
    assert [(s.unit, s.points) for s in series] == [("u" * 64, ((T0, 1.0),))]


# --- latency windows --------------------------------------------------------------------------


def test_latency_windows_round_trip_filter_and_upsert(engine):
    writer, reader = Writer(engine), Reader(engine)
    writer.write(WriteBatch(windows=[window(T0 + i * 10 * S, 10 + i) for i in range(6)]
                            + [window(T0 + 10 * S, 99, operation="GET /health"),
                               window(T0, 7, service="model", operation="forward")]), now_ns=NOW)

    got = reader.latency("gateway", "POST /predict", T0 + 10 * S, T0 + 40 * S)  # since <= start < until
    assert got == [window(T0 + i * 10 * S, 10 + i) for i in (1, 2, 3)]

    every_operation = reader.latency("gateway", None, T0, T0 + 30 * S)
    assert [(w.start_unix_nano, w.operation) for w in every_operation] == [
        (T0, "POST /predict"), (T0 + 10 * S, "GET /health"), (T0 + 10 * S, "POST /predict"),
        (T0 + 20 * S, "POST /predict")]
    assert len(reader.latency("gateway", None, T0, FOREVER, limit=2)) == 2
    assert reader.latency("nobody", None, 0, FOREVER) == []

    # A window written again (a late span reopened it) keeps one row, with the new numbers.
    writer.write(WriteBatch(windows=[window(T0 + 10 * S, 250, count=101)]), now_ns=NOW + S)
    assert reader.latency("gateway", "POST /predict", T0 + 10 * S, T0 + 20 * S) == [
        window(T0 + 10 * S, 250, count=101)]
    assert count_rows(engine, "latency_windows") == 8


# --- spikes -----------------------------------------------------------------------------------


def test_spikes_round_trip_newest_first_with_causes_in_rank_order(engine):
    Writer(engine).write(WriteBatch(spikes=SPIKES), now_ns=NOW)
    reader = Reader(engine)
    a1, b2, c3 = SPIKES

    assert reader.spikes() == [c3, b2, a1]
    assert [c.summary for c in reader.spike("a1").causes] == [f"cause number {i}" for i in range(12)]
    assert reader.spike("b2") == b2
    assert reader.spike("nope") is None


SPIKE_FILTERS = [
    ({"service": "gateway"}, ["c3", "a1"]),
    ({"state": "open"}, ["c3", "b2"]),
    ({"state": "resolved"}, ["a1"]),
    ({"since_ns": T0 + 60 * S}, ["c3", "b2"]),
    ({"until_ns": T0 + 60 * S}, ["a1"]),
    ({"service": "gateway", "state": "open", "since_ns": T0}, ["c3"]),
    ({"service": "model"}, []),
    ({"limit": 2}, ["c3", "b2"]),
]


def test_spike_filters(engine):
    Writer(engine).write(WriteBatch(spikes=SPIKES), now_ns=NOW)
    reader = Reader(engine)

    assert [[s.id for s in reader.spikes(**filters)] for filters, _ in SPIKE_FILTERS] == [
        expected for _, expected in SPIKE_FILTERS]


def test_a_spike_written_again_is_updated_and_its_causes_replaced(engine):
    writer, reader = Writer(engine), Reader(engine)
    writer.write(WriteBatch(spikes=SPIKES), now_ns=NOW)
    resolved = dataclasses.replace(SPIKES[2], state="resolved", end_unix_nano=T0 + 180 * S, p99_ns=800 * MS,
                                   causes=causes(3)[1:], exemplar_trace_ids=(tid(9),))
    fewer = dataclasses.replace(SPIKES[0], causes=causes(2))
    writer.write(WriteBatch(spikes=[resolved, fewer]), now_ns=NOW + S)

    assert reader.spike("c3") == resolved
    assert reader.spike("a1") == fewer
    assert [s.id for s in reader.spikes()] == ["c3", "b2", "a1"]
    assert [s.id for s in reader.spikes(state="open")] == ["b2"]
    assert reader.exemplar_trace_ids() == {tid(1), tid(2), tid(3), tid(9)}


def test_a_resolved_spike_is_built_once_and_read_afresh_whenever_it_is_written_again(engine):
    # The spike list is polled: a resolved spike's causes and streams no longer change, and are not built again
    # (storage/resolved_spikes.py), unless a detection process that judged again writes the spike anew.
    streams = tuple(AffectedStream(service="gateway", operation=f"route {i}", peer_service=None,
                                   start_unix_nano=T0, last_anomalous_end_unix_nano=T0 + 50 * S, p99_ns=900 * MS,
                                   baseline_p99_ns=100 * MS, evidence=5.0 + i, slow_requests=3 + i)
                    for i in range(30))
    writer, reader = Writer(engine), Reader(engine)
    resolved = dataclasses.replace(SPIKES[0], affected=streams)
    writer.write(WriteBatch(spikes=[resolved, *SPIKES[1:]]), now_ns=NOW)

    first, again = reader.spikes(), reader.spikes()
    assert first == again == [SPIKES[2], SPIKES[1], resolved]
    assert again[2] is first[2] and reader.spike("a1") is first[2]  # built once
    assert again[0] is not first[0]  # an open spike is read afresh

    one_more_slow = (*streams[:7], dataclasses.replace(streams[7], slow_requests=11), *streams[8:])
    for rewritten in (dataclasses.replace(resolved, affected=one_more_slow),
                      dataclasses.replace(resolved, affected=one_more_slow, causes=causes(11)),
                      dataclasses.replace(resolved, affected=one_more_slow, causes=causes(11), p99_ns=950 * MS)):
        writer.write(WriteBatch(spikes=[rewritten]), now_ns=NOW + S)
        assert reader.spikes()[2] == reader.spike("a1") == rewritten


# --- failures ---------------------------------------------------------------------------------


def _fail_late(self: Writer, conn: Any, spikes: Any) -> None:
    raise RuntimeError("database went away")


@pytest.mark.parametrize("failure", ["not-null-violation", "late-failure"])
def test_a_failed_write_leaves_nothing_behind_and_the_writer_keeps_working(engine, monkeypatch, failure):
    writer, reader = Writer(engine), Reader(engine)
    new_span = make_span(7, 1, service="fresh", name="GET /new", host="gpu-9")
    new_point = point(T0, 1.5, host="gpu-9", name="new.metric", attributes={"a": 1})
    if failure == "not-null-violation":
        bad = WriteBatch(spans=[new_span], points=[dataclasses.replace(new_point, value=None)])
        expected_error: type[Exception] = sqlalchemy.exc.IntegrityError
    else:  # everything went in, then the transaction failed
        monkeypatch.setattr(Writer, "_write_spikes", _fail_late)
        bad = WriteBatch(spans=[new_span], points=[new_point], windows=[window(T0, 20)], spikes=SPIKES[:1])
        expected_error = RuntimeError
    with pytest.raises(expected_error):
        writer.write(bad, now_ns=NOW)

    assert reader.trace(tid(7)) == []
    assert count_rows(engine, "span_blocks") == count_rows(engine, "trace_blocks") == 0
    assert reader.services() == []
    assert reader.hosts() == []
    assert reader.metrics("gpu-9", None, 0, FOREVER) == ([], False)
    assert reader.latency("gateway", None, 0, FOREVER) == []
    assert reader.spikes() == []

    monkeypatch.undo()
    writer.write(WriteBatch(spans=[new_span], points=[new_point]), now_ns=NOW + S)  # same operation and series

    assert [s.span_id for s in reader.trace(tid(7))] == [sid(1)]
    assert reader.services() == [("fresh", ["GET /new"])]
    assert reader.hosts() == [HostSummary("gpu-9", NOW + S, ("new.metric",))]
    assert reader.metrics("gpu-9", None, 0, FOREVER) == (
        [MetricSeries("gpu-9", "new.metric", {"a": 1}, "1", ((T0, 1.5),))], False)


# --- retention --------------------------------------------------------------------------------


def test_retention_removes_what_arrived_before_the_cutoff_and_keeps_spike_exemplars(engine):
    writer, reader = Writer(engine), Reader(engine)
    old, recent = NOW - 10 * DAY_S * S, NOW
    plain = WriteBatch(spans=[make_span(1, 1), make_span(1, 2, 1, name="forward")],  # a plain old trace ...
                       points=[point(T0 + i * S, float(i)) for i in range(5)], windows=[window(T0, 30)])
    writer.write(plain, now_ns=old)
    writer.write(plain, now_ns=old + S)  # ... and its retry
    # A spike's exemplar (trace 2), sharing its request with trace 4, and the rest of trace 2 in another request.
    writer.write(WriteBatch(spans=[make_span(2, 1), make_span(4, 1, name="GET /health")]), now_ns=old)
    writer.write(WriteBatch(spans=[make_span(2, 2, 1, name="forward")]), now_ns=old)
    writer.write(WriteBatch(spans=[make_span(3, 1, start=T0 - 365 * DAY_S * S)],  # a replay: old event time
                            points=[point(T0 + i * S, float(i)) for i in range(5, 8)],
                            spikes=[dataclasses.replace(SPIKES[0], exemplar_trace_ids=(tid(2), tid(99)))]),
                 now_ns=recent)
    span_cutoff_s = point_cutoff_s = (NOW - DAY_S * S) // S

    result = expire(engine, span_cutoff_s, point_cutoff_s)

    assert result == RetentionResult(spans=4, points=5)  # the spans of both copies of trace 1's block
    assert reader.trace(tid(1)) == []
    assert [s.span_id for s in reader.trace(tid(2))] == [sid(1), sid(2)]  # every block of the exemplar
    assert len(reader.trace(tid(4))) == 1  # whole blocks are kept: trace 4 stays with the exemplar
    assert len(reader.trace(tid(3))) == 1  # arrival time decides, not event time
    assert count_rows(engine, "span_blocks") == 3
    assert count_rows(engine, "trace_blocks") == 4  # (2, 4) -> first block, 2 -> second, 3 -> third
    assert count_rows(engine, "span_block_services") == 3  # the trace-search rows go with their blocks
    series, _ = reader.metrics("gpu-1", None, 0, FOREVER)
    assert [t for t, _ in series[0].points] == [T0 + i * S for i in range(5, 8)]
    assert reader.latency("gateway", None, 0, FOREVER) == [window(T0, 30)]  # aggregates are kept
    assert [s.id for s in reader.spikes()] == ["a1"]
    assert reader.services() == [("gateway", ["GET /health", "POST /predict", "forward"])]  # operations are kept
    assert expire(engine, span_cutoff_s, point_cutoff_s) == RetentionResult()


def test_retention_cutoffs_are_separate_and_exclusive(engine):
    writer, reader = Writer(engine), Reader(engine)
    writer.write(WriteBatch(spans=[make_span(1, 1)], points=[point(T0, 1.0)]), now_ns=NOW)
    now_s = NOW // S

    assert expire(engine, span_cutoff_s=now_s, point_cutoff_s=now_s) == RetentionResult()  # arrived at the cutoff
    assert expire(engine, span_cutoff_s=now_s + 1, point_cutoff_s=0) == RetentionResult(spans=1)
    assert reader.trace(tid(1)) == []
    assert reader.metrics("gpu-1", None, 0, FOREVER)[0][0].points == ((T0, 1.0),)
    assert expire(engine, span_cutoff_s=0, point_cutoff_s=now_s + 1) == RetentionResult(points=1)
    assert reader.metrics("gpu-1", None, 0, FOREVER) == ([], False)


def test_retention_deletes_in_batches_and_bounds_its_work(engine, monkeypatch):
    monkeypatch.setattr(retention, "DELETE_BATCH", 3)
    monkeypatch.setattr(retention, "DELETE_BLOCKS", 2)
    writer, reader = Writer(engine), Reader(engine)
    # Old blocks of trace n hold n spans; trace 6, an exemplar, sits among them and must not stop the batches.
    for t in (1, 2, 6, 3, 4, 5):
        writer.write(WriteBatch(spans=[make_span(t, s, s - 1 if s > 1 else None) for s in range(1, t % 6 + 2)]),
                     now_ns=NOW)
    writer.write(WriteBatch(points=[point(T0 + i * S, float(i)) for i in range(7)]), now_ns=NOW)
    writer.write(WriteBatch(spans=[make_span(9, 1)], points=[point(T0 + 100 * S, 1.0)],
                            spikes=[dataclasses.replace(SPIKES[0], exemplar_trace_ids=(tid(6),))]),
                 now_ns=NOW + DAY_S * S)
    cutoff_s = (NOW + S) // S

    # Two transactions: blocks of traces 1 and 2 (2 + 3 spans), then 3 and 4 (4 + 5 spans).
    assert expire(engine, cutoff_s, cutoff_s, max_batches=2) == RetentionResult(spans=14, points=6)
    assert count_rows(engine, "span_blocks") == 3
    assert [len(reader.trace(tid(t))) for t in (1, 2, 3, 4, 5)] == [0, 0, 0, 0, 6]
    assert expire(engine, cutoff_s, cutoff_s) == RetentionResult(spans=6, points=1)
    assert count_rows(engine, "span_blocks") == count_rows(engine, "trace_blocks") == 2
    assert reader.trace(tid(5)) == []
    assert len(reader.trace(tid(6))) == 1
    assert len(reader.trace(tid(9))) == 1
    series, _ = reader.metrics("gpu-1", None, 0, FOREVER)
    assert series[0].points == ((T0 + 100 * S, 1.0),)


# --- every API query is served by an index (SQLite's plans) -----------------------------------

QUERIES: dict[str, tuple[Callable[[Reader], object], list[str]]] = {
    # name: (the API's call, fragments the plan must contain)
    # The trace index's primary key finds the blocks, each read by its own primary key.
    "trace by id": (lambda r: r.trace(tid(3)),
                    ["SEARCH trace_blocks USING COVERING INDEX sqlite_autoindex_trace_blocks", "(trace_id=?)",
                     "SEARCH span_blocks USING INTEGER PRIMARY KEY"]),
    "latency of one operation": (lambda r: r.latency("gateway", "op-1", T0, T0 + 3600 * S),
                                 ["SEARCH latency_windows", "operation=?", "start_ns>?", "start_ns<?"]),
    "latency of every operation": (lambda r: r.latency("gateway", None, T0, T0 + 3600 * S),
                                   ["SEARCH latency_windows", "service=?", "start_ns>?", "start_ns<?"]),
    "metrics by host": (lambda r: r.metrics("gpu-1", None, T0, T0 + 3600 * S),
                        ["SEARCH metric_series", "(host=?)", "SEARCH metric_points", "series_id=? AND t_ns>?"]),
    "metrics by name": (lambda r: r.metrics(None, "hw.gpu.utilization", T0, T0 + 3600 * S),
                        ["SEARCH metric_series", "(name=?)", "SEARCH metric_points", "series_id=? AND t_ns>?"]),
    "metrics by host and name": (lambda r: r.metrics("gpu-1", "hw.gpu.utilization", T0, T0 + 3600 * S),
                                 ["SEARCH metric_series", "host=? AND name=?", "SEARCH metric_points"]),
    "newest spikes": (lambda r: r.spikes(), ["USING INDEX ix_spikes_start", "SEARCH causes"]),
    "spikes of a service since": (lambda r: r.spikes(service="gateway", since_ns=T0),
                                  ["SEARCH spikes USING INDEX ix_spikes_service_start (service=? AND start_ns>?)"]),
    "open spikes": (lambda r: r.spikes(state="open"), ["USING INDEX ix_spikes_start"]),
    "one spike": (lambda r: r.spike("a1"), ["SEARCH spikes", "(id=?)", "SEARCH causes"]),
    "services": (lambda r: r.services(), ["operations USING COVERING INDEX"]),
    "hosts": (lambda r: r.hosts(), ["metric_series USING COVERING INDEX", "hosts USING INDEX"]),
    "spikes by top cause kind (/metrics)": (lambda r: r.spikes_by_top_cause_kind(),
                                            ["spikes USING COVERING INDEX", "SEARCH causes"]),
    # The Jaeger query API: trace search, traces by id, the dependency graph.
    "trace search by service and time": (
        lambda r: r.find_trace_ids(TraceQuery("gateway", T0, T0 + 3600 * S, limit=5)),
        ["SEARCH span_block_services USING INDEX ix_span_block_services_search (service=? AND max_start_ns>?)",
         "SEARCH span_blocks USING INTEGER PRIMARY KEY"]),
    "traces by id": (lambda r: r.traces([tid(1), tid(2)]),
                     ["SEARCH trace_blocks", "(trace_id=?)", "SEARCH span_blocks USING INTEGER PRIMARY KEY"]),
    "dependencies": (lambda r: [r.dependencies(T0, T0 + 3600 * S)],  # [] is an answer too
                     ["SEARCH span_blocks USING INDEX ix_span_blocks_end_ns (end_ns>?)"]),
    # The profile diff at spike time: the windows of a period, by service or host, however long ago.
    "profile stacks of a service": (
        lambda r: r.profile_stacks(T0 + 60 * S, T0 + 120 * S, service="preprocess"),
        ["SEARCH profile_samples USING INDEX ix_profile_samples_service (service=? AND start_ns>? AND start_ns<?)",
         "SEARCH profile_stacks USING INTEGER PRIMARY KEY"]),
    "profile stacks of a host": (
        lambda r: r.profile_stacks(T0 + 60 * S, T0 + 120 * S, host="gpu-1"),
        ["SEARCH profile_samples USING INDEX ix_profile_samples_host (host=? AND start_ns>? AND start_ns<?)"]),
    # compare and the serving analyses: the blocks of an event-time range, however long ago.
    "span blocks of a time range": (lambda r: list(r.span_payloads(T0, T0 + 3600 * S)),
                                    ["SEARCH span_blocks USING INDEX ix_span_blocks_end_ns (end_ns>? AND end_ns<?)"]),
}



@pytest.mark.parametrize("query", list(QUERIES))
def test_every_api_query_is_served_by_an_index(planned, query):
    reader, statements = planned
    call, required = QUERIES[query]
    text = plan_of(reader.engine, statements, lambda: call(reader))

    assert not FULL_SCAN.search(text), f"{query} reads a whole table:\n{text}"
    for fragment in required:
        assert fragment in text, f"{query}: expected {fragment!r} in the plan:\n{text}"
