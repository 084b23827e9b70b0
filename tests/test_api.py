"""REST API behaviour a user notices: errors that say what is wrong, tokens, health, documentation."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import grpc
import pytest
import requests
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from harness.api_client import ApiClient
from harness.daemons import CollectorThread, collector_config
from spikehound.collector.rest import jaeger
from spikehound.collector.rest.app import build_app
from spikehound.collector.web.routes import is_web_path
from spikehound.model import AffectedStream, Cause, CauseKind, Span, SpanKind, Spike, StatusCode
from spikehound.otlp import encode_spans
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.writer import WriteBatch, Writer


def one_span_request(service: str = "svc") -> tuple[ExportTraceServiceRequest, str]:
    now = time.time_ns()
    span = Span(trace_id=os.urandom(16), span_id=os.urandom(8), parent_span_id=None, service=service, host="h",
                name="GET /", kind=SpanKind.SERVER, start_unix_nano=now - 1_000_000, end_unix_nano=now,
                status=StatusCode.OK, attributes={"k": "v"})
    return encode_spans([span]), span.trace_id.hex()


@pytest.mark.parametrize(("path", "status", "needle"), [
    ("/api/v1/traces/xyz", 400, "32 hex digits"),
    ("/api/v1/traces/" + "ab" * 16, 404, "not found"),
    ("/api/v1/latency", 400, "service is required"),
    ("/api/v1/latency?service=a&since=yesterday", 400, "since"),
    ("/api/v1/latency?service=a&since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z", 400, "before"),
    ("/api/v1/latency?service=a&since=2026-01-01T00:00:00", 400, "time zone"),
    ("/api/v1/metrics", 400, "host, name"),
    ("/api/v1/spikes?state=sleeping", 400, "open or resolved"),
    ("/api/v1/spikes?limit=0", 400, "limit"),
    ("/api/v1/spikes/nope", 404, "not found"),
])
def test_bad_requests_say_what_is_wrong(sqlite_collector: CollectorThread, path: str, status: int, needle: str):
    r = ApiClient(sqlite_collector.api).request("GET", path)
    assert r.status_code == status
    assert needle in r.json()["error"]


def test_health_and_metrics(sqlite_collector: CollectorThread):
    api = ApiClient(sqlite_collector.api)
    assert api.get_json("/healthz") == {"status": "ok"}
    assert api.get("/readyz").status_code == 200
    text = api.get("/metrics").text
    for name in ("spikehound_ingest_received_total", "spikehound_ingest_queue_capacity",
                 "spikehound_latency_late_spans_total", "spikehound_storage_write_seconds_bucket"):
        assert name in text, name


def test_openapi_documents_every_route(sqlite_collector: CollectorThread):
    doc = requests.get(f"{sqlite_collector.api}/api/v1/openapi.json", timeout=5).json()
    assert doc["openapi"].startswith("3.")
    app = build_app(reader=None, telemetry=sqlite_collector.collector.telemetry, ready=None, token="",  # type: ignore[arg-type]
                    alerting=sqlite_collector.collector.alerting)
    # The web pages (HTML under /ui/) and the Jaeger API (Jaeger's own) are not part of spikehound's JSON API.
    jaeger_app = web.Application()
    jaeger.add_routes(jaeger_app)
    jaeger_routes = {r.resource.canonical for r in jaeger_app.router.routes()}
    routes = {(r.resource.canonical, r.method.lower()) for r in app.router.routes()
              if r.method != "HEAD" and not is_web_path(r.resource.canonical)
              and r.resource.canonical not in jaeger_routes}
    documented = {(path, method) for path, operations in doc["paths"].items() for method in operations}
    assert routes - {("/api/v1/openapi.json", "get")} == documented
    for schema in ("Span", "Spike", "Cause"):
        assert schema in doc["components"]["schemas"]


def test_spikes_are_served_in_the_brief_shape(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    engine = make_engine(url)
    upgrade(engine)
    trace = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
    Writer(engine).write(WriteBatch(spikes=[Spike(
        id="sp1", service="gateway", operation="POST /v1/predict", state="open", start_unix_nano=1_700_000_000 * 10**9,
        end_unix_nano=None, p99_ns=250_000_000, baseline_p99_ns=40_000_000, exemplar_trace_ids=(trace,),
        causes=(Cause(kind=CauseKind.NETWORK, score=0.8, summary="the gateway -> model-server hop added 170 ms",
                      service="model-server", operation="POST /infer", peer_service="gateway", baseline=2.0,
                      observed=172.0, unit="ms"),),
        affected=(AffectedStream("gateway", "POST /v1/predict", None, 1_700_000_000 * 10**9,
                                 1_700_000_010 * 10**9, 250_000_000, 40_000_000, 9.5, 12),
                  AffectedStream("model-server", "POST /infer", "gateway", 1_700_000_000 * 10**9,
                                 1_700_000_010 * 10**9, 251_000_000, 8_000_000, 7.25, 12)))]))
    engine.dispose()
    with CollectorThread(collector_config(url)) as c:
        api = ApiClient(c.api)
        spikes = api.get_json("/api/v1/spikes")["spikes"]
        one = api.get_json("/api/v1/spikes/sp1")
        moved = api.get_json("/api/v1/spikes", service="model-server")
        unmoved = api.get_json("/api/v1/spikes", service="postprocess")
    assert spikes == [one]
    assert one == {
        "id": "sp1", "service": "gateway", "operation": "POST /v1/predict", "state": "open",
        "start": "2023-11-14T22:13:20Z", "end": None, "p99_ms": 250.0, "baseline_p99_ms": 40.0,
        "exemplar_trace_ids": [trace.hex()],
        "causes": [{"kind": "network", "service": "model-server", "operation": "POST /infer",
                    "peer_service": "gateway", "host": None, "resource": None, "score": 0.8, "baseline": 2.0,
                    "observed": 172.0, "unit": "ms", "summary": "the gateway -> model-server hop added 170 ms"}],
        "peer_service": None,
        "affected_streams": [
            {"service": "gateway", "operation": "POST /v1/predict", "peer_service": None,
             "start": "2023-11-14T22:13:20Z", "last_anomalous_end": "2023-11-14T22:13:30Z", "p99_ms": 250.0,
             "baseline_p99_ms": 40.0, "evidence": 9.5, "slow_requests": 12},
            {"service": "model-server", "operation": "POST /infer", "peer_service": "gateway",
             "start": "2023-11-14T22:13:20Z", "last_anomalous_end": "2023-11-14T22:13:30Z", "p99_ms": 251.0,
             "baseline_p99_ms": 8.0, "evidence": 7.25, "slow_requests": 12}],
        "recurrence_of": None, "occurrence": 1, "first_start": None}
    # A service is found by the streams the spike moved, not only by the one that leads it.
    assert [s["id"] for s in moved["spikes"]] == ["sp1"] and unmoved["spikes"] == []


def test_a_polled_spike_list_follows_a_spike_written_again_after_it_resolved(tmp_path: Path):
    # Resolved spikes are kept as built and encoded between polls (storage/resolved_spikes.py); a detection
    # process that judges again after a restart writes one anew, and the next poll must show what it wrote.
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    engine = make_engine(url)
    upgrade(engine)
    moved = tuple(AffectedStream("gateway", f"route {i}", None, 1_700_000_000 * 10**9, 1_700_000_200 * 10**9,
                                 250_000_000, 40_000_000, 9.5, 12) for i in range(20))
    spike = Spike(id="sp1", service="gateway", operation="route 0", state="resolved",
                  start_unix_nano=1_700_000_000 * 10**9, end_unix_nano=1_700_000_240 * 10**9, p99_ns=250_000_000,
                  baseline_p99_ns=40_000_000, causes=(), exemplar_trace_ids=(), affected=moved)
    writer = Writer(engine)
    writer.write(WriteBatch(spikes=[spike]))
    with CollectorThread(collector_config(url)) as c:
        api = ApiClient(c.api)
        first, again = (api.get_json("/api/v1/spikes")["spikes"] for _ in range(2))
        writer.write(WriteBatch(spikes=[dataclasses.replace(spike, affected=(
            *moved[:19], dataclasses.replace(moved[19], slow_requests=13)))]))
        after = api.get_json("/api/v1/spikes")["spikes"]
    engine.dispose()
    assert first == again and len(first[0]["affected_streams"]) == 20
    assert [a["slow_requests"] for a in after[0]["affected_streams"]] == [12] * 19 + [13]


def test_tokens_guard_api_and_otlp(tmp_path: Path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}", collector__api_token="api-secret",
                           collector__otlp_token="otlp-secret")
    with CollectorThread(cfg) as c:
        api = ApiClient(c.api, headers={"Authorization": "Bearer api-secret"})
        anonymous = ApiClient(c.api)
        anonymous.document = api.document  # the document itself is behind the token
        assert anonymous.get_json("/api/v1/services", expect=401) == {"error": "missing or wrong bearer token"}
        assert anonymous.get("/metrics").status_code == 401
        assert anonymous.get_json("/healthz") == {"status": "ok"}  # probes need no token
        assert api.get("/api/v1/services").status_code == 200

        req, trace_id = one_span_request()
        body = req.SerializeToString()
        headers = {"Content-Type": "application/x-protobuf"}
        assert requests.post(f"{c.http_endpoint}/v1/traces", data=body, headers=headers, timeout=5).status_code == 401
        headers["Authorization"] = "Bearer otlp-secret"
        assert requests.post(f"{c.http_endpoint}/v1/traces", data=body, headers=headers, timeout=5).status_code == 200

        with grpc.insecure_channel(c.grpc_endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Export(req, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.Export(one_span_request()[0], timeout=5, metadata=(("authorization", "Bearer otlp-secret"),))
        assert c.metric("spikehound_ingest_rejected_requests_total", protocol="grpc", reason="unauthenticated") == 1
        assert c.metric("spikehound_ingest_stored_total", signal="spans") == 2
        assert api.get(f"/api/v1/traces/{trace_id}").status_code == 200


def test_the_api_client_holds_answers_to_the_served_document(sqlite_collector: CollectorThread):
    """harness/api_client.py itself: an answer unlike the document, or of an unlisted status, fails."""
    api = ApiClient(sqlite_collector.api)
    wrong = requests.Response()
    wrong.status_code, wrong.headers["Content-Type"] = 200, "application/json"
    wrong._content = b'{"spikes": [{"id": 7}]}'
    with pytest.raises(AssertionError, match=r"(?s)GET /api/v1/spikes answered 200 with a body unlike .*"
                                             r"at \$\.spikes\[0\]: 'service' is a required property"):
        api.validate("GET", "/api/v1/spikes", wrong)
    wrong.status_code = 418
    with pytest.raises(AssertionError, match="answered 418, which GET /api/v1/spikes does not list"):
        api.validate("GET", "/api/v1/spikes", wrong)
    assert api.get_json("/api/v1/spikes", state="open") == {"spikes": []}
