"""OTLP trace export requests to send a collector by hand, and the check that it still takes one after bad input."""

from __future__ import annotations

import os
import time
from typing import Any

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from harness.api_client import get_json
from harness.daemons import CollectorThread

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


def span(trace_id: bytes, name: str = "GET /items", **fields: Any) -> dict[str, Any]:
    """Keyword arguments of one valid span; ``fields`` override (e.g. a bad id)."""
    now = time.time_ns()
    return {"trace_id": trace_id, "span_id": os.urandom(8), "name": name, "kind": 2,
            "start_time_unix_nano": now - 3_000_000, "end_time_unix_nano": now} | fields


def request(*spans: dict[str, Any], service: str = "bad-input-svc") -> ExportTraceServiceRequest:
    """One resource of ``service`` with these spans (keyword arguments of ``span``)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    scope = rs.scope_spans.add()
    for fields in spans:
        scope.spans.add(**fields)
    return req


def post(c: CollectorThread, body: bytes, content_type: str = PROTOBUF, encoding: str | None = None
         ) -> requests.Response:
    """POST an export body to the collector's OTLP/HTTP trace receiver."""
    headers = {"Content-Type": content_type} | ({"Content-Encoding": encoding} if encoding else {})
    return requests.post(f"{c.http_endpoint}/v1/traces", data=body, headers=headers, timeout=10)


def assert_still_serving(c: CollectorThread) -> None:
    """A good export after the bad one is answered 200 and its span is readable."""
    trace_id = os.urandom(16)
    r = post(c, request(span(trace_id, name="after-bad-input")).SerializeToString())
    assert r.status_code == 200, r.content
    spans = get_json(f"{c.api}/api/v1/traces/{trace_id.hex()}")["spans"]
    assert [s["name"] for s in spans] == ["after-bad-input"]
