"""The agent's intake on its own: it queues no request larger than the collector takes.

A request that enrichment (host.name, host.id, GPU uuids on every resource) pushes over the collector's
limit is split by resource, scope and span, or data point, into requests that fit, each a valid OTLP request
of its own; a span alone over the limit is refused to its sender in ``partial_success`` and counted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from harness.waiting import eventually
from spikehound.agent.enrich import Enricher
from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.intake import Intake, export_response
from spikehound.agent.otlp_http import http_app
from spikehound.agent.spool import DiskSpool, Signal
from spikehound.otlp import PayloadError
from tests.support.spool_items import queued

LIMIT = 8192
IDENTITY = {"host.name": "gpu-node-3", "host.id": "5f2c" * 8, "nvidia.gpu.uuids": [f"GPU-{n:032x}" for n in range(8)]}


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[ForwardQueue]:
    q = ForwardQueue(1 << 20, DiskSpool(tmp_path / "spool", 1 << 20))
    q.max_request_bytes = LIMIT  # as the forwarder sets it once the collector named its limit
    yield q
    q.close()




def trace_request(*spans: tuple[str, int], resources: int = 1, service: str = "llm-server") -> bytes:
    """``resources`` resources, each with the spans given as (name, bytes of padding)."""
    request = ExportTraceServiceRequest()
    for r in range(resources):
        resource_spans = request.resource_spans.add()
        resource_spans.resource.attributes.add(key="service.name").value.string_value = service
        resource_spans.resource.attributes.add(key="service.instance.id").value.string_value = f"pod-{r}"
        scope = resource_spans.scope_spans.add()
        scope.scope.name = "vllm"
        for name, padding in spans:
            span = scope.spans.add(name=f"{name}@{r}", trace_id=bytes(range(16)), span_id=bytes(range(8)))
            span.attributes.add(key="prompt").value.string_value = "x" * padding
    return request.SerializeToString()


def span_names(payloads: list[bytes]) -> list[str]:
    return [sp.name for p in payloads for rs in ExportTraceServiceRequest.FromString(p).resource_spans
            for ss in rs.scope_spans for sp in ss.spans]


def test_a_request_enrichment_pushes_over_the_limit_is_split_before_it_is_queued(queue):
    payload = trace_request(*((f"decode-{n}", 135) for n in range(20)), resources=2)
    assert LIMIT - 400 < len(payload) <= LIMIT  # the sender's request fits; enriched, it does not
    intake = Intake(Enricher(IDENTITY), queue)
    accepted = intake.accept(Signal.TRACES, payload, "grpc")
    assert (accepted.kept, accepted.rejected) == (40, 0)
    items = queued(queue)
    assert len(items) >= 2 and all(len(i.payload) <= LIMIT for i in items)
    assert sum(i.count for i in items) == 40
    assert span_names([i.payload for i in items]) == span_names([payload])  # every span once, in order
    for i in items:  # each piece is a whole request: resource (enriched) and scope come with its spans
        for rs in ExportTraceServiceRequest.FromString(i.payload).resource_spans:
            attributes = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
            assert attributes["host.name"] == "gpu-node-3" and attributes["service.name"] == "llm-server"
            assert [ss.scope.name for ss in rs.scope_spans] == ["vllm"]
    assert intake.split_requests[Signal.TRACES] == 1


def test_a_metric_with_more_points_than_fit_is_split_by_data_point(queue):
    request = ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    metric = scope.metrics.add(name="hw.gpu.memory.usage", unit="By")
    metric.sum.aggregation_temporality = 2
    metric.sum.is_monotonic = False
    for n in range(1500):
        point = metric.sum.data_points.add(time_unix_nano=n, as_int=n)
        point.attributes.add(key="hw.id").value.string_value = f"GPU-{n % 8}"
    intake = Intake(Enricher(IDENTITY), queue)
    accepted = intake.accept(Signal.METRICS, request.SerializeToString(), "http")
    assert (accepted.kept, accepted.rejected) == (1500, 0)
    items = queued(queue)
    assert len(items) >= 3 and all(len(i.payload) <= LIMIT for i in items)
    values = []
    for i in items:
        (m,) = ExportMetricsServiceRequest.FromString(i.payload).resource_metrics[0].scope_metrics[0].metrics
        assert (m.name, m.unit, m.sum.aggregation_temporality, m.sum.is_monotonic) == (
            "hw.gpu.memory.usage", "By", 2, False)
        assert i.count == len(m.sum.data_points)
        values += [p.as_int for p in m.sum.data_points]
    assert values == list(range(1500))


def test_a_span_alone_over_the_limit_is_refused_to_its_sender_and_the_rest_queued(queue, caplog):
    intake = Intake(Enricher(IDENTITY), queue)
    payload = trace_request(("prefill", 100), ("decode", 2 * LIMIT), ("sample", 100))
    with caplog.at_level(logging.ERROR, logger="spikehound.agent"):
        accepted = intake.accept(Signal.TRACES, payload, "grpc")
        assert (accepted.kept, accepted.rejected) == (2, 1)
        response = export_response(Signal.TRACES, accepted)
        assert response.partial_success.rejected_spans == 1
        assert f"larger than the {LIMIT} bytes" in response.partial_success.error_message
        assert span_names([i.payload for i in queued(queue)]) == ["prefill@0", "sample@0"]
        with pytest.raises(PayloadError, match="larger than"):  # nothing left to queue: the sender is told
            intake.accept(Signal.TRACES, trace_request(("decode", 2 * LIMIT)), "grpc")
    assert intake.too_large[Signal.TRACES] == 2
    assert len(queue) == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "'llm-server'" in errors[0], errors  # once per sender, not per span


def test_the_agents_http_receiver_counts_an_abandoned_upload_without_a_traceback(queue, caplog):
    """A sender that timed out or was killed mid-upload is routine: counted, no error logged, still serving."""
    caplog.set_level(logging.INFO)
    intake = Intake(Enricher(IDENTITY), queue)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(http_app(intake, LIMIT))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    port = runner.addresses[0][1]
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    head = b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b"Content-Length: 100000\r\n\r\n" + b"\x0a" * 100)  # then hangs up
        eventually(lambda: intake.invalid_requests["http"] == 1, "the abandoned upload to be counted", timeout=10)
        request = trace_request(("prefill", 10))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + f"Content-Length: {len(request)}\r\n\r\n".encode() + request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        assert span_names([item.payload for item in queued(queue)]) == ["prefill@0"]
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        serving.join(timeout=10)
        loop.close()
