"""Contract tests of the Jaeger query API (what Grafana's Jaeger data source calls), on both databases.

Traces come from the real OpenTelemetry SDK through a real collector; the answers are compared with the JSON
shapes of Jaeger's query service (``structuredResponse`` and its UI model).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
import requests
from opentelemetry import trace

from harness.daemons import CollectorThread, collector_config
from harness.waiting import eventually
from tests.support.otel_send import MS, timed_span, tracer_provider

RESPONSE_KEYS = {"data", "total", "limit", "offset", "errors"}
TRACE_KEYS = {"traceID", "spans", "processes", "warnings"}
SPAN_KEYS = {"traceID", "spanID", "flags", "operationName", "references", "startTime", "duration", "tags", "logs",
             "processID", "warnings"}
TAG_TYPES = {"string", "bool", "int64", "float64", "binary"}


@dataclass
class Sent:
    start_ns: int
    roots: list[str]  # 32-hex trace ids, oldest first
    durations_ms: list[int]


def send_stack(endpoint: str) -> Sent:
    """Five requests: gateway SERVER -> CLIENT -> model-server SERVER -> forward; the last one fails."""
    start = (time.time_ns() // 1_000_000_000 - 600) * 1_000_000_000
    gateway = tracer_provider(endpoint, "gateway", host="gw-1", **{"service.version": "2.1.0"})
    model = tracer_provider(endpoint, "model-server", host="gpu-1", **{"service.version": "0.9.3"})
    gw, ms = gateway.get_tracer("test"), model.get_tracer("test")
    roots, durations, previous = [], [], None
    for i in range(5):
        t = start + i * 1_000 * MS
        duration = (i + 1) * 100
        root = timed_span(gw, "POST /v1/chat", t, duration * MS, attributes={
            "model.name": "llama" if i % 2 == 0 else "mistral", "http.response.status_code": 200, "ratio": 0.5,
            "cached": False}, error=i == 4)
        client = timed_span(gw, "POST /infer", t + MS, (duration - 2) * MS, kind=trace.SpanKind.CLIENT,
                            parent=root, events=[("retry", t + 2 * MS, {"attempt": 2})] if i == 1 else ())
        server = timed_span(ms, "POST /infer", t + 2 * MS, (duration - 4) * MS, parent=client)
        timed_span(ms, "forward", t + 3 * MS, (duration - 6) * MS, kind=trace.SpanKind.INTERNAL, parent=server,
                   links=[previous] if previous is not None else ())
        previous = root
        roots.append(format(root.get_span_context().trace_id, "032x"))
        durations.append(duration)
    gateway.shutdown()
    model.shutdown()
    return Sent(start, roots, durations)


def get(api: str, path: str, **params) -> tuple[int, dict]:
    r = requests.get(f"{api}{path}", params=params, timeout=30)
    assert r.headers["Content-Type"].startswith("application/json"), r.text[:200]
    body = r.json()
    assert set(body) == RESPONSE_KEYS, body
    return r.status_code, body


def search(api: str, **params) -> list[dict]:
    status, body = get(api, "/api/traces", **params)
    assert status == 200 and body["errors"] is None, body
    return body["data"]


def wait_traces(api: str, n: int, **params) -> list[dict]:
    """The Jaeger search's traces once ``n`` complete ones (four spans each) are found."""

    def complete() -> list[dict] | None:
        data = search(api, **params)
        assert len(data) >= n and all(len(t["spans"]) == 4 for t in data), f"found: {json.dumps(data)[:300]}"
        return data

    return eventually(complete, f"{n} complete traces", 20, every=0.2)


@pytest.fixture
def stack(collector) -> tuple[CollectorThread, Sent]:
    sent = send_stack(collector.grpc_endpoint)
    wait_traces(collector.api, 5, service="gateway", start=sent.start_ns // 1000)
    return collector, sent


def assert_jaeger_trace(t: dict) -> None:
    assert set(t) == TRACE_KEYS
    for span in t["spans"]:
        assert set(span) == SPAN_KEYS, span
        assert span["traceID"] == t["traceID"]
        assert span["processID"] in t["processes"]
        assert isinstance(span["logs"], list)
        assert all(tag["type"] in TAG_TYPES and set(tag) == {"key", "type", "value"} for tag in span["tags"])
        for ref in span["references"]:
            assert set(ref) == {"refType", "traceID", "spanID"} and ref["refType"] in ("CHILD_OF", "FOLLOWS_FROM")
    for process in t["processes"].values():
        assert set(process) == {"serviceName", "tags"}


def test_services_and_operations(stack):
    collector, _ = stack
    status, body = get(collector.api, "/api/services")
    assert status == 200 and sorted(body["data"]) == ["gateway", "model-server"] and body["total"] == 2
    status, body = get(collector.api, "/api/services/model-server/operations")
    assert status == 200 and body["data"] == ["POST /infer", "forward"] and body["total"] == 2
    status, body = get(collector.api, "/api/services/nobody/operations")
    assert status == 200 and body["data"] == [] and body["total"] == 0


def test_a_trace_in_jaeger_shape(stack):
    collector, sent = stack
    status, body = get(collector.api, f"/api/traces/{sent.roots[1]}")
    assert status == 200 and body["errors"] is None and len(body["data"]) == 1
    t = body["data"][0]
    assert_jaeger_trace(t)
    assert t["traceID"] == sent.roots[1]
    spans = {s["operationName"] + "@" + t["processes"][s["processID"]]["serviceName"]: s for s in t["spans"]}
    root, client = spans["POST /v1/chat@gateway"], spans["POST /infer@gateway"]
    server, forward = spans["POST /infer@model-server"], spans["forward@model-server"]
    assert root["references"] == []
    assert client["references"] == [{"refType": "CHILD_OF", "traceID": t["traceID"], "spanID": root["spanID"]}]
    assert server["references"][0]["spanID"] == client["spanID"]
    assert forward["references"][1] == {"refType": "FOLLOWS_FROM", "traceID": sent.roots[0],
                                        "spanID": forward["references"][1]["spanID"]}
    assert root["startTime"] == (sent.start_ns + 1_000 * MS) // 1000 and root["duration"] == 200_000  # microseconds
    tags = {tag["key"]: (tag["type"], tag["value"]) for tag in root["tags"]}
    assert tags["model.name"] == ("string", "mistral") and tags["http.response.status_code"] == ("int64", 200)
    assert tags["ratio"] == ("float64", 0.5) and tags["cached"] == ("bool", False)
    assert tags["span.kind"] == ("string", "server")
    assert client["logs"] == [{"timestamp": (sent.start_ns + 1_002 * MS) // 1000,
                               "fields": [{"key": "event", "type": "string", "value": "retry"},
                                          {"key": "attempt", "type": "int64", "value": 2}]}]
    process = t["processes"][root["processID"]]
    assert {"key": "host.name", "type": "string", "value": "gw-1"} in process["tags"]
    assert {"key": "service.version", "type": "string", "value": "2.1.0"} in process["tags"]
    assert len(t["processes"]) == 2

    status, body = get(collector.api, f"/api/traces/{sent.roots[4]}")
    failed = {s["operationName"]: {tag["key"]: tag["value"] for tag in s["tags"]} for s in body["data"][0]["spans"]
              if t["processes"].get(s["processID"], {}).get("serviceName") == "gateway"}
    assert failed["POST /v1/chat"]["error"] is True and failed["POST /v1/chat"]["otel.status_code"] == "ERROR"
    assert failed["POST /v1/chat"]["otel.status_description"] == "model server returned 503"


def test_search_by_operation_duration_tags_time_and_limit(stack):
    collector, sent = stack
    api, start_us = collector.api, sent.start_ns // 1000
    ids = lambda data: [t["traceID"] for t in data]  # noqa: E731

    everything = search(api, service="gateway", start=start_us)
    assert ids(everything) == sent.roots[::-1]  # the latest first
    for t in everything:
        assert_jaeger_trace(t)
    assert ids(search(api, service="gateway", start=start_us, limit=2)) == sent.roots[:2:-1]
    assert ids(search(api, service="model-server", operation="forward", start=start_us, minDuration="250ms")) == \
        sent.roots[:1:-1]  # forward spans take duration - 6 ms: 294, 394 and 494 ms
    assert ids(search(api, service="gateway", operation="POST /v1/chat", start=start_us, minDuration="0.2s",
                      maxDuration="300ms")) == [sent.roots[2], sent.roots[1]]
    assert ids(search(api, service="gateway", start=start_us, tags=json.dumps({"model.name": "mistral"}))) == \
        [sent.roots[3], sent.roots[1]]
    assert ids(search(api, service="gateway", start=start_us, tag="error:true")) == [sent.roots[4]]
    assert ids(search(api, service="gateway", start=start_us, tag="host.name:gw-1", limit=1)) == [sent.roots[4]]
    assert ids(search(api, service="gateway", start=start_us, end=start_us + 1_500_000)) == sent.roots[1::-1]
    assert search(api, service="gateway", start=start_us, operation="GET /nothing") == []
    assert search(api, service="gateway", start=start_us, tags=json.dumps({"model.name": "gpt"})) == []

    status, body = get(api, "/api/traces", traceID=[sent.roots[0], "abc123"])
    assert status == 200 and ids(body["data"]) == [sent.roots[0]]
    assert body["errors"] == [{"msg": "trace not found", "traceID": "0000000000abc123"}]


def test_a_trace_id_with_a_zero_upper_half_is_written_with_16_digits(collector):
    trace_id, now = "0000000000000000" + "00c0ffee00c0ffee", time.time_ns()
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "j"}}]},
                               "scopeSpans": [{"spans": [{"traceId": trace_id, "spanId": "00000000000000aa",
                                                          "name": "GET /", "kind": 2,
                                                          "startTimeUnixNano": str(now - 5 * MS),
                                                          "endTimeUnixNano": str(now)}]}]}]}
    r = requests.post(f"{collector.http_endpoint}/v1/traces", data=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 200
    for asked in ("00c0ffee00c0ffee", trace_id, "C0FFEE00C0FFEE"):
        status, answer = get(collector.api, f"/api/traces/{asked}")
        assert status == 200 and answer["data"][0]["traceID"] == "00c0ffee00c0ffee", asked


def test_dependencies_count_calls_between_services(stack):
    collector, sent = stack
    end_ms = time.time_ns() // 1_000_000
    status, body = get(collector.api, "/api/dependencies", endTs=end_ms, lookback=3_600_000)
    assert status == 200 and body["errors"] is None
    assert body["data"] == [{"parent": "gateway", "child": "model-server", "callCount": 5}]
    status, body = get(collector.api, "/api/dependencies", endTs=end_ms, lookback=3_600_000, service="nobody")
    assert body["data"] == []
    status, body = get(collector.api, "/api/dependencies", endTs=sent.start_ns // 1_000_000, lookback=60_000)
    assert body["data"] == []  # the minute before anything was sent


@pytest.mark.parametrize(("path", "params", "status", "message"), [
    ("/api/traces/4bf92f3577b34da6a3ce929d0e0e4736", {}, 404, "trace not found"),
    ("/api/traces/not-hex", {}, 400, "is not 1 to 32 hex digits"),
    ("/api/traces", {}, 400, "parameter 'service' is required"),
    ("/api/traces", {"service": "gateway", "minDuration": "fast"}, 400, "cannot parse minDuration"),
    ("/api/traces", {"service": "gateway", "minDuration": "2s", "maxDuration": "1s"}, 400,
     "'maxDuration' should be greater than 'minDuration'"),
    ("/api/traces", {"service": "gateway", "tags": "{not json"}, 400, "malformed 'tags' parameter"),
    ("/api/traces", {"service": "gateway", "tag": "novalue"}, 400, "malformed 'tag' parameter"),
    ("/api/traces", {"service": "gateway", "start": "yesterday"}, 400, "unable to parse start"),
    ("/api/traces", {"traceID": "xyz"}, 400, "cannot parse traceID param"),
    ("/api/dependencies", {"endTs": "soon"}, 400, "unable to parse endTs"),
])
def test_errors_in_jaeger_form(sqlite_collector, path, params, status, message):
    got, body = get(sqlite_collector.api, path, **params)
    assert got == status
    assert body["data"] is None and len(body["errors"]) == 1
    assert body["errors"][0]["code"] == status and message in body["errors"][0]["msg"]


def test_the_jaeger_api_needs_the_api_token_when_one_is_set(tmp_path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}", collector__api_token="s3cret-token")
    with CollectorThread(cfg) as collector:
        assert requests.get(f"{collector.api}/api/services", timeout=10).status_code == 401
        r = requests.get(f"{collector.api}/api/services", headers={"Authorization": "Bearer s3cret-token"},
                         timeout=10)
        assert r.status_code == 200 and r.json()["data"] == []
