"""The real OpenTelemetry SDK sends to a real collector over loopback; the API returns it exactly."""

from __future__ import annotations

import json
import os
import time

import pytest
import requests
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from harness.api_client import get_json, wait_json
from harness.daemons import CollectorThread
from tests.support.sdk_traffic import Recording


def send_inference_traces(exporter: SpanExporter, service: str, n: int = 5) -> list[ReadableSpan]:
    recording = Recording(exporter)
    provider = TracerProvider(resource=Resource.create({"service.name": service, "host.name": "gpu-host-7",
                                                        "service.version": "1.4.2"}))
    provider.add_span_processor(BatchSpanProcessor(recording, max_export_batch_size=64, schedule_delay_millis=100))
    tracer = provider.get_tracer("test")
    for i in range(n):
        with tracer.start_as_current_span("POST /v1/predict", kind=trace.SpanKind.SERVER,
                                          attributes={"model.name": "resnet50", "batch.size": 8,
                                                      "request.index": i}):
            with tracer.start_as_current_span("preprocess", attributes={"image.pixels": 224 * 224}):
                time.sleep(0.002)
            with tracer.start_as_current_span("forward", kind=trace.SpanKind.CLIENT) as fwd:
                fwd.add_event("batch.enqueued", {"queue.depth": 3})
                time.sleep(0.003)
    provider.shutdown()
    return recording.spans


def assert_trace_matches(api: str, sent: list[ReadableSpan], service: str) -> None:
    by_trace: dict[int, list[ReadableSpan]] = {}
    for s in sent:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    for trace_id, spans in by_trace.items():
        hex_id = format(trace_id, "032x")
        expected = len(spans)
        body = wait_json(f"{api}/api/v1/traces/{hex_id}", lambda b, n=expected: len(b["spans"]) == n)
        got = {s["span_id"]: s for s in body["spans"]}
        for s in spans:
            g = got[format(s.context.span_id, "016x")]
            assert g["trace_id"] == hex_id
            assert g["parent_span_id"] == (format(s.parent.span_id, "016x") if s.parent else None)
            assert g["service"] == service
            assert g["host"] == "gpu-host-7"
            assert g["name"] == s.name
            assert g["kind"] == s.kind.name
            assert g["start_unix_nano"] == s.start_time
            assert g["duration_ns"] == s.end_time - s.start_time
            assert g["attributes"] == dict(s.attributes)
            assert g["resource"]["service.version"] == "1.4.2"
            assert [e["name"] for e in g["events"]] == [e.name for e in s.events]
        root = next(s for s in spans if s.parent is None)
        assert body["critical_path"][0] == format(root.context.span_id, "016x")


def test_grpc_exporter_round_trip(collector: CollectorThread):
    sent = send_inference_traces(GrpcSpanExporter(endpoint=collector.grpc_endpoint, insecure=True), "gateway-grpc")
    assert len(sent) == 15
    assert_trace_matches(collector.api, sent, "gateway-grpc")
    services = get_json(f"{collector.api}/api/v1/services")["services"]
    gateway = next(s for s in services if s["service"] == "gateway-grpc")
    assert gateway["operations"] == ["POST /v1/predict", "forward", "preprocess"]
    assert collector.metric("spikehound_ingest_stored_total", signal="spans") == 15


def test_http_protobuf_exporter_round_trip(collector: CollectorThread):
    exporter = HttpSpanExporter(endpoint=f"{collector.http_endpoint}/v1/traces")
    sent = send_inference_traces(exporter, "gateway-http")
    assert_trace_matches(collector.api, sent, "gateway-http")
    assert collector.metric("spikehound_ingest_received_total", signal="spans", protocol="http") == 15


def test_http_json_is_accepted_with_hex_ids(collector: CollectorThread):
    trace_id, span_id, parent = os.urandom(16).hex(), os.urandom(8).hex(), os.urandom(8).hex()
    now = time.time_ns()
    body = {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "json-svc"}},
                                    {"key": "host.name", "value": {"stringValue": "h1"}}]},
        "scopeSpans": [{"spans": [{"traceId": trace_id, "spanId": span_id, "parentSpanId": parent,
                                   "name": "lookup", "kind": 3, "startTimeUnixNano": str(now - 7_000_000),
                                   "endTimeUnixNano": str(now), "status": {"code": 2},
                                   "attributes": [{"key": "db.system", "value": {"stringValue": "sqlite"}},
                                                  {"key": "rows", "value": {"intValue": "12"}}]}]}]}]}
    r = requests.post(f"{collector.http_endpoint}/v1/traces", data=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    span = get_json(f"{collector.api}/api/v1/traces/{trace_id}")["spans"][0]
    assert span["span_id"] == span_id and span["parent_span_id"] == parent
    assert (span["kind"], span["status"], span["duration_ns"]) == ("CLIENT", "ERROR", 7_000_000)
    assert span["attributes"] == {"db.system": "sqlite", "rows": 12}


def test_sdk_metrics_are_host_samples(collector: CollectorThread):
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=collector.grpc_endpoint, insecure=True),
                                           export_interval_millis=200)
    provider = MeterProvider(resource=Resource.create({"service.name": "agent", "host.name": "gpu-host-7"}),
                             metric_readers=[reader])
    meter = provider.get_meter("test")
    meter.create_observable_gauge("hw.gpu.utilization", unit="1", callbacks=[lambda _o: [
        Observation(0.93, {"hw.id": "GPU-aaaa", "gpu.index": 0}), Observation(0.12, {"hw.id": "GPU-bbbb",
                                                                                     "gpu.index": 1})]])
    sent = meter.create_counter("system.network.io", unit="By")
    sent.add(1500, {"network.io.direction": "transmit", "network.interface.name": "eth0"})
    provider.shutdown()  # exports what was recorded
    body = wait_json(f"{collector.api}/api/v1/metrics", lambda b: len(b["series"]) == 2, host="gpu-host-7",
                     name="hw.gpu.utilization")
    values = {s["attributes"]["hw.id"]: {p["value"] for p in s["points"]} for s in body["series"]}
    assert values == {"GPU-aaaa": {0.93}, "GPU-bbbb": {0.12}}
    assert body["series"][0]["unit"] == "1"
    net = wait_json(f"{collector.api}/api/v1/metrics", lambda b: b["series"], host="gpu-host-7",
                    name="system.network.io")
    assert net["series"][0]["points"][-1]["value"] == 1500
    hosts = get_json(f"{collector.api}/api/v1/hosts")["hosts"]
    assert [h["host"] for h in hosts] == ["gpu-host-7"]
    assert set(hosts[0]["metrics"]) == {"hw.gpu.utilization", "system.network.io"}


@pytest.mark.parametrize("when", ["rfc3339", "unix"])
def test_latency_windows_close_and_are_served(collector: CollectorThread, when: str):
    send_inference_traces(GrpcSpanExporter(endpoint=collector.grpc_endpoint, insecure=True), "lat-svc", n=20)
    since = "2000-01-01T00:00:00Z" if when == "rfc3339" else str(int(time.time()) - 600)
    body = wait_json(f"{collector.api}/api/v1/latency", lambda b: sum(p["count"] for p in b["points"]) == 20,
                     service="lat-svc", operation="POST /v1/predict", since=since)
    for p in body["points"]:
        assert 5.0 <= p["p50_ms"] <= p["p95_ms"] <= p["p99_ms"] < 1000
