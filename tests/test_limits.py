"""Long names, huge values and floods of unique names stay bounded: cut at decode, counted, capped downstream.

A sender may put a megabyte into a span name or an attribute, or a request id into every span name. The
collector cuts names and values to ``collector.max_name_length`` / ``max_attribute_value_length`` characters
and keeps ``max_attributes_per_span`` attributes, once, while decoding; storage, the API, the span metrics and
the operations list then only ever see what the limits allow. Request bytes in flight over both receivers are
capped too (``collector.max_bytes_in_flight``): beyond it senders are told to retry later.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import requests
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from sqlalchemy import create_engine, func, select

from harness.api_client import ApiClient, get_json
from harness.daemons import CollectorThread, collector_config
from harness.waiting import eventually
from spikehound.detectors.trace_buffer import TraceBuffer
from spikehound.model import Span, SpanKind, StatusCode
from spikehound.storage import schema
from spikehound.storage.migrate import upgrade
from spikehound.storage.retention import Retention, RetentionPolicy
from spikehound.storage.writer import OPERATION_REFRESH_SECONDS, WriteBatch, Writer

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MIB = 1024 * 1024
NAME_LIMIT, VALUE_LIMIT, ATTRIBUTE_LIMIT = 1024, 4096, 128  # the defaults


def unique_text(size: int) -> str:
    """``size`` characters whose first ones differ from any other call's (unique names, even once cut)."""
    return (os.urandom(8).hex() + "-") + "x" * (size - 17)


def trace_request(spans: list[dict[str, Any]], service: str = "limits-svc", host: str = "limits-host",
                  attributes: dict[str, str] | None = None) -> ExportTraceServiceRequest:
    """One resource of ``service`` on ``host`` holding ``spans`` (keyword arguments of OTLP spans, plus
    ``attributes``: a dict of string attributes)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, value in {"service.name": service, "host.name": host, **(attributes or {})}.items():
        rs.resource.attributes.add(key=key).value.string_value = value
    scope = rs.scope_spans.add()
    now = time.time_ns()
    for fields in spans:
        span_attributes = fields.pop("attributes", {})
        sp = scope.spans.add(**({"span_id": os.urandom(8), "kind": 2, "start_time_unix_nano": now - 2_000_000,
                                 "end_time_unix_nano": now} | fields))
        for key, value in span_attributes.items():
            sp.attributes.add(key=key).value.string_value = value
    return req


def post(c: CollectorThread, body: bytes, path: str = "/v1/traces", content_type: str = PROTOBUF
         ) -> requests.Response:
    return requests.post(f"{c.http_endpoint}{path}", data=body, headers={"Content-Type": content_type}, timeout=60)


def export(c: CollectorThread, req: ExportTraceServiceRequest, protocol: str) -> ExportTraceServiceResponse:
    """Send over ``protocol`` (grpc, http-protobuf, http-json) and return the OK answer."""
    if protocol == "grpc":
        with grpc.insecure_channel(c.grpc_endpoint, options=[("grpc.max_send_message_length", 64 * MIB)]) as ch:
            call = ch.unary_unary(EXPORT_METHOD, response_deserializer=ExportTraceServiceResponse.FromString)
            return call(req.SerializeToString(), timeout=60)
    if protocol == "http-json":
        doc = json_format.MessageToDict(req)
        for sp in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:  # OTLP/JSON ids are hex, not base64
            sp["traceId"], sp["spanId"] = (base64.b64decode(sp[k]).hex() for k in ("traceId", "spanId"))
        r = post(c, json.dumps(doc).encode(), content_type=JSON)
        assert r.status_code == 200, r.text
        return json_format.Parse(r.text, ExportTraceServiceResponse())
    r = post(c, req.SerializeToString())
    assert r.status_code == 200, r.content
    return ExportTraceServiceResponse.FromString(r.content)


def trace_spans(c: CollectorThread, trace_id: bytes) -> list[dict[str, Any]]:
    return ApiClient(c.api, timeout=30).get_json(f"/api/v1/traces/{trace_id.hex()}")["spans"]


def truncated(c: CollectorThread, field: str, signal: str = "spans") -> float:
    return c.metric("spikehound_ingest_truncated_total", signal=signal, field=field)


def stored_payload_bytes(db_url: str) -> int:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.coalesce(func.sum(func.length(schema.span_blocks.c.payload)), 0)))
                       .scalar_one())
    finally:
        engine.dispose()


@pytest.fixture
def limited(db_url: str) -> Iterator[CollectorThread]:
    """A collector with few span-metric series, so that their bounds show with a handful of spans."""
    with CollectorThread(collector_config(db_url, collector__span_metrics_max_series=20)) as running:
        yield running


@pytest.mark.parametrize("protocol", ["http-protobuf", "grpc", "http-json"])
def test_megabyte_names_and_values_are_cut_everywhere_and_counted(limited: CollectorThread, db_url: str,
                                                                 protocol: str):
    trace_id = os.urandom(16)
    long_name, long_value, long_service = unique_text(MIB), unique_text(MIB), unique_text(1000)
    wide = {f"attr.{i:03d}": f"value {i}" for i in range(200)}
    req = trace_request([
        {"trace_id": trace_id, "name": long_name, "attributes": {"prompt": long_value}},
        {"trace_id": trace_id, "name": "é" * 3000},  # two UTF-8 bytes a character: cut between characters
        {"trace_id": trace_id, "name": "wide", "attributes": wide},
        {"trace_id": trace_id, "name": "fits", "attributes": {"model.name": "llama"}},
    ], service=long_service)
    response = export(limited, req, protocol)

    # Accepted whole; the sender is told what was cut, as a warning (nothing is rejected).
    assert response.partial_success.rejected_spans == 0
    assert "cut to the collector's limits" in response.partial_success.error_message
    assert "2 span_name" in response.partial_success.error_message

    spans = {s["name"][:4]: s for s in trace_spans(limited, trace_id)}
    assert len(spans) == 4
    cut = spans[long_name[:4]]
    assert cut["name"] == long_name[:NAME_LIMIT]
    assert cut["attributes"]["prompt"] == long_value[:VALUE_LIMIT]
    assert cut["service"] == long_service[:255]  # the width storage indexes service names with
    assert spans["éééé"]["name"] == "é" * NAME_LIMIT
    assert len(spans["wide"]["attributes"]) == ATTRIBUTE_LIMIT
    assert spans["wide"]["attributes"] == dict(list(wide.items())[:ATTRIBUTE_LIMIT])  # the first ones stay
    assert spans["fits"]["attributes"] == {"model.name": "llama"}

    assert truncated(limited, "span_name") == 2
    assert truncated(limited, "attribute_value") == 1
    assert truncated(limited, "service_name") == 1
    assert truncated(limited, "attributes_dropped") == 200 - ATTRIBUTE_LIMIT
    assert limited.metric("spikehound_ingest_stored_total", signal="spans") == 4

    # Storage keeps the request as cut, not the 2 MiB that came in.
    assert stored_payload_bytes(db_url) < 64 * 1024
    services = get_json(f"{limited.api}/api/v1/services")["services"]
    assert [s["service"] for s in services] == [long_service[:255]]
    assert long_name[:NAME_LIMIT] in services[0]["operations"]
    assert max(len(op) for s in services for op in s["operations"]) <= NAME_LIMIT


def test_metrics_body_stays_small_under_long_unique_span_names(limited: CollectorThread):
    """Every span-metric series is written some twenty times: long names would multiply /metrics."""
    before = len(requests.get(f"{limited.api}/metrics", timeout=30).content)
    for _ in range(3):
        req = trace_request([{"trace_id": os.urandom(16), "name": unique_text(MIB)} for _ in range(4)]
                            + [{"trace_id": os.urandom(16), "name": f"op-{os.urandom(6).hex()}"} for _ in range(30)])
        assert post(limited, req.SerializeToString()).status_code == 200
    text = requests.get(f"{limited.api}/metrics", timeout=30).text

    assert len(text) - before < 512 * 1024
    assert truncated(limited, "span_name") == 12
    assert limited.metric("spikehound_span_metrics_overflow_spans_total", set="spanmetrics") > 0
    assert 'otel_metric_overflow="true"' in text
    names = [line.partition('span_name="')[2].partition('"')[0] for line in text.splitlines()
             if line.startswith("traces_span_metrics_calls_total{") and 'span_name="' in line]
    assert names and len(set(names)) <= 20 and max(map(len, names)) <= NAME_LIMIT


def test_metric_samples_are_cut_too(sqlite_collector: CollectorThread):
    c = sqlite_collector
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    host = unique_text(1000)
    rm.resource.attributes.add(key="host.name").value.string_value = host
    metric = rm.scope_metrics.add().metrics.add(name="hw.gpu.utilization", unit="1")
    dp = metric.gauge.data_points.add(time_unix_nano=time.time_ns(), as_double=0.5)
    dp.attributes.add(key="hw.id").value.string_value = unique_text(10_000)
    for i in range(150):
        dp.attributes.add(key=f"extra.{i:03d}").value.int_value = i
    assert post(c, req.SerializeToString(), "/v1/metrics").status_code == 200

    series = get_json(f"{c.api}/api/v1/metrics", host=host[:255], name="hw.gpu.utilization")["series"]
    assert len(series) == 1
    assert len(series[0]["attributes"]) == ATTRIBUTE_LIMIT
    assert len(series[0]["attributes"]["hw.id"]) == VALUE_LIMIT
    assert truncated(c, "host_name", "metrics") == 1
    assert truncated(c, "attribute_value", "metrics") == 1
    assert truncated(c, "attributes_dropped", "metrics") == 151 - ATTRIBUTE_LIMIT


# --- bytes in flight --------------------------------------------------------------------------------------


@pytest.fixture
def small_budget(tmp_path) -> Iterator[CollectorThread]:
    cfg = collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}", collector__max_bytes_in_flight=100_000,
                           collector__retry_after_seconds=2)
    with CollectorThread(cfg) as running:
        yield running


def small_request() -> bytes:
    return trace_request([{"trace_id": os.urandom(16), "name": "small"}]).SerializeToString()


def test_request_bytes_in_flight_are_capped_over_both_receivers(small_budget: CollectorThread):
    c = small_budget
    # A sender that announced 90 kB and is still uploading them holds 90 kB of the 100 kB budget.
    slow_body = trace_request([{"trace_id": os.urandom(16), "name": "slow", "attributes": {"pad": "p" * 3000}}
                               for _ in range(30)]).SerializeToString()
    assert 80_000 < len(slow_body) < 100_000
    with socket.create_connection(("127.0.0.1", c.collector.http_port), timeout=30) as slow:
        slow.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {PROTOBUF}\r\n"
                     f"Content-Length: {len(slow_body)}\r\n\r\n".encode() + slow_body[:1000])
        # Held before the next request is sent: otherwise that one would fit and the test prove nothing.
        eventually(lambda: c.metric("spikehound_ingest_bytes_in_flight") >= len(slow_body),
                   "the slow upload's bytes held", timeout=60, every=0.02)

        # Meanwhile another 20 kB request does not fit: HTTP 429 with Retry-After ...
        refused = post(c, trace_request([{"trace_id": os.urandom(16), "name": "more",
                                          "attributes": {"pad": "p" * 20_000}}]).SerializeToString())
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "2"
        assert status_pb2.Status.FromString(refused.content).code == code_pb2.RESOURCE_EXHAUSTED
        # ... and RESOURCE_EXHAUSTED with a RetryInfo over gRPC, which OTLP exporters retry.
        with grpc.insecure_channel(c.grpc_endpoint) as channel:
            call = channel.unary_unary(EXPORT_METHOD, response_deserializer=ExportTraceServiceResponse.FromString)
            with pytest.raises(grpc.RpcError) as caught:
                call(trace_request([{"trace_id": os.urandom(16), "name": "more",
                                     "attributes": {"pad": "p" * 20_000}}]).SerializeToString(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = dict(caught.value.trailing_metadata())["grpc-status-details-bin"]
        info = error_details_pb2.RetryInfo()
        assert status_pb2.Status.FromString(details).details[0].Unpack(info)
        assert info.retry_delay.seconds == 2

        slow.sendall(slow_body[1000:])  # the slow upload completes and is answered OK
        assert slow.recv(4096).startswith(b"HTTP/1.1 200")

    assert c.metric("spikehound_ingest_rejected_requests_total", protocol="http", reason="bytes_in_flight") == 1
    assert c.metric("spikehound_ingest_rejected_requests_total", protocol="grpc", reason="bytes_in_flight") == 1
    assert c.metric("spikehound_ingest_bytes_in_flight") == 0  # given back after the answers
    assert c.metric("spikehound_ingest_bytes_in_flight_capacity") == 100_000
    assert post(c, small_request()).status_code == 200  # and room again once it is answered


def test_a_request_larger_than_the_whole_budget_still_gets_in_alone(small_budget: CollectorThread):
    body = trace_request([{"trace_id": os.urandom(16), "name": "big", "attributes": {"pad": "p" * 4000}}
                          for _ in range(60)]).SerializeToString()
    assert len(body) > 200_000
    assert post(small_budget, body).status_code == 200
    # Also when it arrives gzipped (a few kB) and inflates beyond the budget: never refused for ever.
    r = requests.post(f"{small_budget.http_endpoint}/v1/traces", data=gzip.compress(body), timeout=30,
                      headers={"Content-Type": PROTOBUF, "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.content
    assert small_budget.metric("spikehound_ingest_stored_total", signal="spans") == 120


# --- operations, trace buffer ----------------------------------------------------------------------------


def operation(service: str, name: str) -> Span:
    now = time.time_ns()
    return Span(trace_id=os.urandom(16), span_id=os.urandom(8), parent_span_id=None, service=service, host="h",
                name=name, kind=SpanKind.SERVER, start_unix_nano=now - 1_000, end_unix_nano=now,
                status=StatusCode.UNSET)


def operations(engine: Any) -> dict[str, int]:
    o = schema.operations
    with engine.connect() as conn:
        return {service: n for service, n in conn.execute(select(o.c.service, func.count()).group_by(o.c.service))}


def test_operations_are_capped_by_retention_taking_from_the_noisiest_service(db_url: str):
    engine = create_engine(db_url)
    try:
        upgrade(engine)
        writer, t0 = Writer(engine), time.time_ns()
        writer.write(WriteBatch(spans=[operation("checkout", f"op-{i}") for i in range(5)]), now_ns=t0)
        # A service that puts a request id into every span name, recorded after the steady one.
        writer.write(WriteBatch(spans=[operation("noisy", f"GET /users/{i}") for i in range(600)]),
                     now_ns=t0 + 10 * 10**9)
        assert operations(engine) == {"checkout": 5, "noisy": 600}

        policy = RetentionPolicy(span_max_age_s=72 * 3600, point_max_age_s=72 * 3600, operation_max_count=100)
        result = Retention(engine).enforce(policy, now_s=t0 / 1e9 + 20)
        assert result.operations == 505
        assert operations(engine) == {"checkout": 5, "noisy": 95}  # the steady service keeps all of its own

        # An operation still arriving is recorded again (hourly), so only those that stopped go by age.
        later = t0 + (OPERATION_REFRESH_SECONDS + 1) * 10**9
        writer.write(WriteBatch(spans=[operation("checkout", "op-0")]), now_ns=later)
        Retention(engine).enforce(policy, now_s=later / 1e9 + 72 * 3600 - 10)
        assert operations(engine) == {"checkout": 1}
    finally:
        engine.dispose()


def test_trace_buffer_is_bounded_by_bytes_as_well_as_spans():
    buffer = TraceBuffer(max_spans=100_000, max_bytes=1_000_000)
    for i in range(100):
        buffer.add([Span(trace_id=i.to_bytes(16, "big"), span_id=b"\x01" * 8, parent_span_id=None, service="svc",
                         host="h", name=f"{i}-" + "n" * 50_000, kind=SpanKind.SERVER, start_unix_nano=1,
                         end_unix_nano=2, status=StatusCode.UNSET)])
    assert buffer.bytes <= 1_000_000 and buffer.spans < 20
    assert buffer.evicted_traces == 100 - buffer.spans
    assert [s.name[:3] for s in buffer.trace((99).to_bytes(16, "big"))] == ["99-"]  # the newest stay
