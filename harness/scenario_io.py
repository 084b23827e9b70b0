"""Scenario traffic as OTLP requests: sent to a collector over HTTP, or written as a recorded file."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

import orjson
import requests
from google.protobuf import json_format

from harness.scenarios.traffic import Scenario
from spikehound.otlp import encode_points, encode_spans

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def scenario_requests(scenario: Scenario) -> list[tuple[str, bytes]]:
    """(signal, protobuf body) per second of the scenario: its spans, then its metric samples."""
    out = []
    for batch in scenario.batches():
        if batch.spans:
            out.append(("traces", encode_spans(batch.spans).SerializeToString()))
        if batch.points:
            out.append(("metrics", encode_points(batch.points).SerializeToString()))
    return out


def send(http_endpoint: str, bodies: Iterable[tuple[str, bytes]]) -> None:
    """POST each body in turn; each answer comes after the commit, so order is kept."""
    with requests.Session() as session:
        for signal, body in bodies:
            response = session.post(f"{http_endpoint}/v1/{signal}", data=body, headers=PROTOBUF, timeout=60)
            assert response.status_code == 200, response.text


def write_protobuf(path: Path, bodies: Iterable[tuple[str, bytes]]) -> None:
    """The file exporter's ``format: proto``: each message behind its 4-byte big-endian length."""
    with path.open("wb") as f:
        for _, body in bodies:
            f.write(struct.pack(">I", len(body)) + body)


def write_json_lines(path: Path, bodies: Iterable[tuple[str, bytes]]) -> None:
    """The file exporter's JSON lines: OTLP JSON with hex ids, one TracesData/MetricsData a line."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    with path.open("wb") as f:
        for signal, body in bodies:
            if signal == "traces":
                doc = json_format.MessageToDict(ExportTraceServiceRequest.FromString(body))
                for rs in doc.get("resourceSpans", []):
                    for ss in rs.get("scopeSpans", []):
                        for span in ss.get("spans", []):
                            for key in ("traceId", "spanId", "parentSpanId"):
                                if key in span:
                                    span[key] = _b64_to_hex(span[key])
            else:
                doc = json_format.MessageToDict(ExportMetricsServiceRequest.FromString(body))
            f.write(orjson.dumps(doc) + b"\n")


def _b64_to_hex(text: str) -> str:
    import base64

    return base64.b64decode(text).hex()
