"""Bad OTLP input gets a 4xx / INVALID_ARGUMENT with a message, is counted, and never breaks the collector."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from harness.api_client import get_json
from harness.daemons import CollectorThread, collector_config
from harness.waiting import eventually
from tests.support.otlp_requests import JSON, PROTOBUF, assert_still_serving, post, request, span

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"






def otlp_json(req: ExportTraceServiceRequest) -> bytes:
    """OTLP/JSON: protobuf's JSON mapping, but with ids as hex as the OTLP specification asks."""
    doc = json_format.MessageToDict(req)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in sp:
                        sp[key] = base64.b64decode(sp[key]).hex()
    return json.dumps(doc).encode()




def error_message(r: requests.Response) -> str:
    """The google.rpc.Status message of an error answer, in whichever encoding it came."""
    if r.headers["Content-Type"].startswith(JSON):
        body = r.json()
        assert body["code"] == 3, body  # INVALID_ARGUMENT
        return body["message"]
    assert r.headers["Content-Type"].startswith(PROTOBUF)
    status = status_pb2.Status.FromString(r.content)
    assert status.code == 3
    return status.message




def rejected_requests(c: CollectorThread, protocol: str, reason: str) -> float:
    return c.metric("spikehound_ingest_rejected_requests_total", protocol=protocol, reason=reason)


def rejected_spans(c: CollectorThread) -> float:
    return c.metric("spikehound_ingest_rejected_total", signal="spans", reason="invalid")


@pytest.fixture
def grpc_channel(sqlite_collector: CollectorThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(sqlite_collector.grpc_endpoint) as channel:
        yield channel


GOOD = request(span(b"\x11" * 16), span(b"\x11" * 16, name="child")).SerializeToString()

# (content type, body, content encoding, status, counter reason, words the message must contain)
UNREADABLE = {
    "garbage protobuf": (PROTOBUF, b"\xff\xfe\xfd garbage \x00\x01", None, 400, "bad_payload", "invalid OTLP protobuf"),
    "truncated protobuf": (PROTOBUF, GOOD[: len(GOOD) // 2], None, 400, "bad_payload", "invalid OTLP protobuf"),
    "broken JSON": (JSON, b'{"resourceSpans": [{"scopeSpans": [', None, 400, "bad_payload", "invalid JSON"),
    "JSON that is not an object": (JSON, b"[1, 2]", None, 400, "bad_payload", "must be a JSON object"),
    "JSON id that is not hex": (JSON, b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
                                {}, 400, "bad_payload", "is not hex"),
    "broken gzip": (PROTOBUF, b"\x1f\x8b\x08\x00 not really gzip", "gzip", 400,
                    "bad_payload", "invalid gzip body"),
    "wrong content type": ("text/plain", GOOD, None, 415, "unsupported_media_type", "unsupported Content-Type"),
    "unknown content encoding": (PROTOBUF, GOOD, "br", 415, "unsupported_encoding",
                                 "unsupported Content-Encoding"),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_http_request_is_refused_with_a_message(sqlite_collector: CollectorThread, case: str):
    content_type, body, encoding, status, reason, words = UNREADABLE[case]
    before = rejected_requests(sqlite_collector, "http", reason)
    r = post(sqlite_collector, body, content_type, encoding)
    assert r.status_code == status, r.content
    assert words in error_message(r)
    assert rejected_requests(sqlite_collector, "http", reason) == before + 1
    assert sqlite_collector.metric("spikehound_ingest_stored_total", signal="spans") == 0
    assert_still_serving(sqlite_collector)


@pytest.mark.parametrize("body", [b"\xff\xfe\xfd garbage", GOOD[: len(GOOD) // 2]], ids=["garbage", "truncated"])
def test_unreadable_grpc_request_is_invalid_argument(sqlite_collector: CollectorThread, grpc_channel: grpc.Channel,
                                                     body: bytes):
    export = grpc_channel.unary_unary(EXPORT_METHOD)  # no serializer: the bytes go out as they are
    with pytest.raises(grpc.RpcError) as raised:
        export(body, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid OTLP protobuf" in raised.value.details()
    assert rejected_requests(sqlite_collector, "grpc", "bad_payload") == 1
    TraceServiceStub(grpc_channel).Export(request(span(os.urandom(16))), timeout=10)  # still answers
    assert_still_serving(sqlite_collector)


# (span field overrides, words the error must contain)
INVALID_SPANS = {
    "short trace id": ({"trace_id": b"\x01" * 8}, "trace_id must be 16 bytes, got 8"),
    "long span id": ({"span_id": b"\x02" * 16}, "span_id must be 8 bytes, got 16"),
    "short parent id": ({"parent_span_id": b"\x03" * 4}, "parent_span_id must be empty or 8 bytes, got 4"),
    "zero trace id": ({"trace_id": bytes(16)}, "trace_id is all zeroes"),
    "end before start": ({"start_time_unix_nano": 2_000_000_000, "end_time_unix_nano": 1_000_000_000},
                         "end time 1000000000 is before start time 2000000000"),
}


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
@pytest.mark.parametrize("case", list(INVALID_SPANS))
def test_invalid_span_over_http_is_400(sqlite_collector: CollectorThread, case: str, encoding: str):
    fields, words = INVALID_SPANS[case]
    req = request(span(os.urandom(16), name="bad-span") | fields)
    if encoding == "json":
        r = post(sqlite_collector, otlp_json(req), JSON)
    else:
        r = post(sqlite_collector, req.SerializeToString())
    assert r.status_code == 400, r.content
    message = error_message(r)
    assert words in message and "bad-span" in message, message
    assert rejected_spans(sqlite_collector) == 1
    assert sqlite_collector.metric("spikehound_ingest_stored_total", signal="spans") == 0
    assert_still_serving(sqlite_collector)


@pytest.mark.parametrize("case", list(INVALID_SPANS))
def test_invalid_span_over_grpc_is_invalid_argument(sqlite_collector: CollectorThread, grpc_channel: grpc.Channel,
                                                    case: str):
    fields, words = INVALID_SPANS[case]
    stub = TraceServiceStub(grpc_channel)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Export(request(span(os.urandom(16), name="bad-span") | fields), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in raised.value.details()
    assert rejected_spans(sqlite_collector) == 1
    assert sqlite_collector.metric("spikehound_ingest_stored_total", signal="spans") == 0
    assert_still_serving(sqlite_collector)


@pytest.mark.parametrize("protocol", ["http-protobuf", "http-json", "grpc"])
def test_one_bad_span_is_rejected_and_the_rest_stored(collector: CollectorThread, protocol: str):
    trace_id = os.urandom(16)
    good = [span(trace_id, name=f"good-{i}") for i in range(4)]
    bad = span(trace_id, name="inverted", start_time_unix_nano=20, end_time_unix_nano=10)
    req = request(good[0], good[1], bad, good[2], good[3])
    if protocol == "grpc":
        with grpc.insecure_channel(collector.grpc_endpoint) as channel:
            response = TraceServiceStub(channel).Export(req, timeout=10)
    else:
        as_json = protocol == "http-json"
        r = post(collector, otlp_json(req) if as_json else req.SerializeToString(), JSON if as_json else PROTOBUF)
        assert r.status_code == 200, r.content
        if as_json:
            response = json_format.Parse(r.text, ExportTraceServiceResponse())
        else:
            response = ExportTraceServiceResponse.FromString(r.content)
    assert response.partial_success.rejected_spans == 1
    assert "span 2 (inverted): end time 10 is before start time 20" in response.partial_success.error_message
    assert rejected_spans(collector) == 1
    stored = get_json(f"{collector.api}/api/v1/traces/{trace_id.hex()}")["spans"]
    assert sorted(s["span_id"] for s in stored) == sorted(s["span_id"].hex() for s in good)
    assert collector.metric("spikehound_ingest_stored_total", signal="spans") == 4


def test_gzip_protobuf_and_json_are_accepted(sqlite_collector: CollectorThread):
    trace_id = os.urandom(16)
    first, second = span(trace_id, name="zipped-protobuf"), span(trace_id, name="zipped-json")
    r = post(sqlite_collector, gzip.compress(request(first).SerializeToString()), encoding="gzip")
    assert r.status_code == 200, r.content
    assert ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans == 0
    r = post(sqlite_collector, gzip.compress(otlp_json(request(second))), JSON, encoding="gzip")
    assert r.status_code == 200, r.content
    spans = get_json(f"{sqlite_collector.api}/api/v1/traces/{trace_id.hex()}")["spans"]
    assert sorted(s["name"] for s in spans) == ["zipped-json", "zipped-protobuf"]


@pytest.fixture
def small_collector(tmp_path: Path) -> Iterator[CollectorThread]:
    cfg = collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}", collector__max_request_bytes=4096)
    with CollectorThread(cfg) as running:
        yield running


def test_oversized_body_is_413(small_collector: CollectorThread):
    big = request(*(span(os.urandom(16), name=f"op-{i}") for i in range(200))).SerializeToString()
    assert len(big) > 4096
    for content_type, body in ((PROTOBUF, big), (JSON, b'{"resourceSpans": []}' + b" " * 8000)):
        r = post(small_collector, body, content_type)
        assert r.status_code == 413, r.content
        assert "exceeds 4096 bytes" in error_message(r)
    assert rejected_requests(small_collector, "http", "too_large") == 2
    assert_still_serving(small_collector)


def test_gzip_bomb_is_413(small_collector: CollectorThread):
    bomb_span = span(os.urandom(16), name="bomb")
    bomb = request(bomb_span)
    bomb.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="padding").value.string_value = "a" * 2_000_000
    body = gzip.compress(bomb.SerializeToString())
    assert len(body) < 4096  # small on the wire, 2 MB once inflated
    r = post(small_collector, body, encoding="gzip")
    assert r.status_code == 413, r.content
    assert "exceeds 4096 bytes" in error_message(r)
    assert rejected_requests(small_collector, "http", "too_large") == 1
    assert small_collector.metric("spikehound_ingest_received_total", signal="spans", protocol="http") == 0
    # A compressed request that fits once inflated is still taken.
    r = post(small_collector, gzip.compress(request(span(os.urandom(16))).SerializeToString()),
             encoding="gzip")
    assert r.status_code == 200, r.content
    assert_still_serving(small_collector)


def _raw_post(c: CollectorThread, head: bytes, body: bytes = b"") -> socket.socket:
    """An OTLP/HTTP request written by hand: headers as given, then ``body`` (maybe less than announced)."""
    sock = socket.create_connection(("127.0.0.1", c.collector.http_port), timeout=10)
    sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
                 + head + b"\r\n\r\n" + body)
    return sock


def test_an_announced_body_over_the_limit_is_refused_before_it_is_sent(sqlite_collector: CollectorThread):
    # Ten gigabytes announced, none sent: the answer must not wait for them.
    with _raw_post(sqlite_collector, b"Content-Length: 10000000000") as sock:
        answer = sock.recv(4096)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    limit = sqlite_collector.cfg.collector.max_request_bytes
    assert status_pb2.Status.FromString(body).message == f"request body exceeds {limit} bytes"
    assert rejected_requests(sqlite_collector, "http", "too_large") == 1
    assert_still_serving(sqlite_collector)


def test_a_sender_hanging_up_mid_upload_is_counted_without_a_traceback(sqlite_collector: CollectorThread,
                                                                        caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO)
    for head, part in ((b"Content-Length: 100000", b"\x0a" * 100), (b"Transfer-Encoding: chunked", b"64\r\n\x0a")):
        with _raw_post(sqlite_collector, head, part):
            pass  # closed with most of the body unsent
    aborted = "spikehound_ingest_aborted_requests_total"
    eventually(lambda: sqlite_collector.metric(aborted, protocol="http") >= 2, "both aborted uploads counted",
               every=0.05)
    assert sqlite_collector.metric(aborted, protocol="http") == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []
    assert_still_serving(sqlite_collector)
