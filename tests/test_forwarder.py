"""The forwarder against a real OTLP/gRPC server on loopback that records what arrives and answers as told.

A flush merges each signal's queued requests into one and sends the signals side by side; what the server
refuses as invalid is found by sending one by one and dropped (counted), what it pushes back stays queued.
What gRPC refuses as larger than the server's maximum is sent again in pieces that fit, and a span that
alone is larger is dropped and counted; forwarding that stays stuck says why, once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.forwarder import Forwarder
from spikehound.agent.spool import DiskSpool, Item, Signal

TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
LIMIT = 64 * 1024  # the small collector's largest request


class Collector:
    """Records (method, payload) of each request; refuses trace requests holding a span named ``bad`` as invalid,
    answers UNAVAILABLE (with a RetryInfo) to the next ``unavailable[method]`` requests of a method and
    RESOURCE_EXHAUSTED (with a RetryInfo: backpressure) to the next ``exhausted[method]``. gRPC itself refuses
    requests over ``max_message_bytes``, as the collector's receiver does over collector.max_request_bytes."""

    def __init__(self, max_message_bytes: int | None = None) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.unavailable = {TRACES: 0, METRICS: 0}
        self.exhausted = {TRACES: 0, METRICS: 0}
        self._lock = threading.Lock()
        options = [("grpc.max_receive_message_length", max_message_bytes)] if max_message_bytes else []
        self._server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(method.strip("/").split("/")[0], {"Export": (
                grpc.unary_unary_rpc_method_handler(self._handler(method)))}) for method in (TRACES, METRICS)])

    def _handler(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def export(payload: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                for refusals, code, message in ((self.unavailable, grpc.StatusCode.UNAVAILABLE, "restarting"),
                                                (self.exhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")):
                    if refusals[method]:
                        refusals[method] -= 1
                        info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=50_000_000))
                        status = status_pb2.Status(code=code.value[0], message=message)
                        status.details.add().Pack(info)
                        context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
                        context.abort(code, message)
                if method == TRACES and "bad" in span_names(payload):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "span 'bad' is invalid")
                self.received.append((method, payload))
            return b""

        return export

    def requests(self, method: str) -> list[bytes]:
        with self._lock:
            return [payload for m, payload in self.received if m == method]


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    c._server.start()
    yield c
    c._server.stop(None).wait(5)



@pytest.fixture
def small_collector() -> Iterator[Collector]:
    """A collector that takes requests of at most LIMIT bytes."""
    c = Collector(max_message_bytes=LIMIT)
    c._server.start()
    yield c
    c._server.stop(None).wait(5)


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[ForwardQueue]:
    q = ForwardQueue(1 << 20, DiskSpool(tmp_path / "spool", 1 << 20))
    yield q
    q.close()


def spans(*names: str, service: str = "", big: frozenset[str] = frozenset()) -> Item:
    """One request of spans named ``names``; those in ``big`` carry an attribute of LIMIT bytes."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    if service:
        resource_spans.resource.attributes.add(key="service.name").value.string_value = service
    scope = resource_spans.scope_spans.add()
    for name in names:
        span = scope.spans.add(name=name, trace_id=bytes(16), span_id=bytes(8))
        if name in big:
            span.attributes.add(key="padding").value.string_value = "x" * LIMIT
    return Item(Signal.TRACES, request.SerializeToString(), len(names))


def points(*names: str) -> Item:
    request = ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    for name in names:
        scope.metrics.add(name=name).gauge.data_points.add(as_double=1.0)
    return Item(Signal.METRICS, request.SerializeToString(), len(names))


def span_names(payload: bytes) -> list[str]:
    return [sp.name for rs in ExportTraceServiceRequest.FromString(payload).resource_spans
            for ss in rs.scope_spans for sp in ss.spans]


def all_span_names(payloads: list[bytes]) -> list[str]:
    """The span names of several requests, in order."""
    return [name for payload in payloads for name in span_names(payload)]


def metric_names(payload: bytes) -> list[str]:
    return [m.name for rm in ExportMetricsServiceRequest.FromString(payload).resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics]


async def flush(queue: ForwardQueue, collector: Collector, times: int = 1) -> Forwarder:
    forwarder = Forwarder(queue, f"127.0.0.1:{collector.port}")
    try:
        for _ in range(times):
            await forwarder.flush(timeout=10)
    finally:
        await forwarder.close()
    return forwarder


def test_one_flush_sends_each_signal_once_with_its_requests_merged_in_order(queue, collector):
    for item in (spans("a"), points("cpu"), spans("b", "c"), points("memory"), spans("d")):
        assert queue.put(item)
    forwarder = asyncio.run(flush(queue, collector))
    (traces,), (metrics,) = collector.requests(TRACES), collector.requests(METRICS)
    assert span_names(traces) == ["a", "b", "c", "d"]
    assert metric_names(metrics) == ["cpu", "memory"]
    assert len(queue) == 0
    assert forwarder.stats.forwarded == {Signal.TRACES: 4, Signal.METRICS: 2}
    assert forwarder.stats.requests == {Signal.TRACES: 1, Signal.METRICS: 1}


def test_an_invalid_request_is_found_dropped_and_counted_and_the_rest_arrive(queue, collector):
    for item in (spans("a"), spans("bad", "b"), points("cpu"), spans("c")):
        queue.put(item)
    forwarder = asyncio.run(flush(queue, collector))
    assert [span_names(p) for p in collector.requests(TRACES)] == [["a"], ["c"]]  # one by one after the refusal
    assert [metric_names(p) for p in collector.requests(METRICS)] == [["cpu"]]
    assert len(queue) == 0
    assert forwarder.stats.dropped == {Signal.TRACES: 2, Signal.METRICS: 0}
    assert forwarder.stats.forwarded == {Signal.TRACES: 2, Signal.METRICS: 1}


def test_a_pushed_back_signal_stays_queued_in_order_while_the_other_goes(queue, collector):
    collector.unavailable[METRICS] = 1
    for item in (points("cpu"), spans("a"), points("memory")):
        queue.put(item)

    async def run() -> tuple[Forwarder, int, bool]:
        forwarder = Forwarder(queue, f"127.0.0.1:{collector.port}")
        try:
            await forwarder.flush(timeout=10)  # metrics refused: retried after the back-off
            left = len(queue)
            connected = forwarder.stats.connected
            queue.put(points("network"))
            await forwarder.flush(timeout=10)
        finally:
            await forwarder.close()
        return forwarder, left, connected

    forwarder, left, connected = asyncio.run(run())
    assert left == 2 and not connected
    assert [span_names(p) for p in collector.requests(TRACES)] == [["a"]]
    assert [metric_names(p) for p in collector.requests(METRICS)] == [["cpu", "memory", "network"]]
    assert forwarder.stats.retries == 1 and forwarder.stats.connected
    assert len(queue) == 0


# --- requests larger than the collector takes -------------------------------------------------------


def merged(item: Item) -> Item:
    """Several resources in one request, as the forwarder's merge makes them: ``item``'s resources and two more."""
    request = ExportTraceServiceRequest.FromString(item.payload)
    for service in ("tokenizer", "llm-server"):
        resource_spans = request.resource_spans.add()
        resource_spans.resource.attributes.add(key="service.name").value.string_value = service
        scope = resource_spans.scope_spans.add()
        for n in range(150):
            scope.spans.add(name=f"{service}-{n}", trace_id=bytes(16), span_id=bytes(8)).attributes.add(
                key="padding").value.string_value = "x" * 300
    return Item(Signal.TRACES, request.SerializeToString(), item.count + 300)


def test_a_request_over_the_collectors_limit_is_split_and_delivered_whole(queue, small_collector):
    big = merged(spans("first"))
    assert len(big.payload) > 1.5 * LIMIT
    queue.put(big)
    queue.put(points("cpu"))
    forwarder = asyncio.run(flush(queue, small_collector))
    arrived = small_collector.requests(TRACES)
    assert len(arrived) >= 2 and all(len(p) <= LIMIT for p in arrived)
    assert all_span_names(arrived) == span_names(big.payload)  # every span once, in order
    assert [metric_names(p) for p in small_collector.requests(METRICS)] == [["cpu"]]  # metrics went on meanwhile
    assert len(queue) == 0
    assert queue.max_request_bytes == LIMIT  # learned from the refusal: later requests are cut before sending
    assert forwarder.stats.forwarded == {Signal.TRACES: 301, Signal.METRICS: 1}
    assert forwarder.stats.split_requests[Signal.TRACES] == 1
    assert forwarder.stats.too_large == {Signal.TRACES: 0, Signal.METRICS: 0}
    assert forwarder.stats.failures["too_large"] == 1


def test_a_spooled_request_over_the_limit_does_not_block_what_is_spooled_behind_it(tmp_path, small_collector):
    # Written by an agent that did not know the limit, it sat at the head of the spool across restarts.
    spool = DiskSpool(tmp_path / "spool", 1 << 20)
    big = merged(spans("first"))
    assert spool.append(big) and spool.append(points("cpu")) and spool.append(spans("later"))
    spool.close()
    queue = ForwardQueue(1 << 20, DiskSpool(tmp_path / "spool", 1 << 20))  # the next start
    try:
        forwarder = asyncio.run(flush(queue, small_collector, times=3))
        assert len(queue) == 0 and len(queue.spool) == 0
    finally:
        queue.close()
    assert all_span_names(small_collector.requests(TRACES)) == [*span_names(big.payload), "later"]
    assert [metric_names(p) for p in small_collector.requests(METRICS)] == [["cpu"]]
    assert forwarder.stats.forwarded == {Signal.TRACES: 302, Signal.METRICS: 1}


def test_a_span_alone_over_the_limit_is_dropped_counted_and_logged_once_per_sender(queue, small_collector, caplog):
    queue.put(spans("a", service="llm-server"))
    queue.put(spans("huge-1", service="llm-server", big=frozenset({"huge-1"})))
    queue.put(spans("b", service="llm-server"))
    queue.put(spans("huge-2", "c", service="llm-server", big=frozenset({"huge-2"})))
    with caplog.at_level(logging.ERROR, logger="spikehound.agent"):
        forwarder = asyncio.run(flush(queue, small_collector, times=2))
    assert all_span_names(small_collector.requests(TRACES)) == ["a", "b", "c"]
    assert len(queue) == 0
    assert forwarder.stats.too_large[Signal.TRACES] == 2
    assert forwarder.stats.forwarded[Signal.TRACES] == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors  # one line per sender, not per span
    assert "'llm-server'" in errors[0] and "dropped 1 spans" in errors[0]


def test_backpressure_is_retried_whole_not_split(queue, collector):
    collector.exhausted[TRACES] = 2  # RESOURCE_EXHAUSTED with a RetryInfo: the collector's queue is full
    queue.put(spans("a", "b"))
    forwarder = asyncio.run(flush(queue, collector, times=3))
    assert [span_names(p) for p in collector.requests(TRACES)] == [["a", "b"]]
    assert forwarder.stats.failures["backpressure"] == 2
    assert forwarder.stats.split_requests[Signal.TRACES] == 0 and forwarder.stats.too_large[Signal.TRACES] == 0
    assert queue.max_request_bytes > LIMIT * 100  # nothing learned from backpressure


def test_a_collector_that_names_a_delay_is_retried_after_it_not_after_our_back_off(queue, collector):
    # Storage away for a while: the collector answers UNAVAILABLE with RetryInfo 50 ms every time. Our own
    # back-off would have grown to 30 s by the eighth retry (about a minute of waiting in all), keeping the
    # backlog waiting long after storage returned; the collector's word keeps each wait at 50-75 ms.
    collector.unavailable[TRACES] = 8
    queue.put(spans("a"))
    started = time.monotonic()
    forwarder = asyncio.run(flush(queue, collector, times=9))
    waited = time.monotonic() - started
    assert forwarder.stats.failures["unavailable"] == 8
    assert [span_names(p) for p in collector.requests(TRACES)] == [["a"]]
    assert waited < 10, f"{waited:.1f} s: the agent backed off on its own instead of the collector's delay"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stuck_forwarding_says_why_once_not_per_retry(queue, collector, caplog):
    collector.exhausted[TRACES] = 12
    queue.put(spans("a"))
    clock = Clock()

    async def run() -> tuple[Forwarder, list[float]]:
        forwarder = Forwarder(queue, f"127.0.0.1:{collector.port}", clock=clock, backoff_start=0.001,
                              backoff_max=0.001)
        stalled = []
        try:
            for _ in range(12):  # two minutes of retries every ten seconds
                await forwarder.flush(timeout=10)
                stalled.append(forwarder.stalled_seconds)
                clock.now += 10
            await forwarder.flush(timeout=10)
        finally:
            await forwarder.close()
        return forwarder, stalled

    with caplog.at_level(logging.INFO, logger="spikehound.agent"):
        forwarder, stalled = asyncio.run(run())
    assert stalled == [10.0 * n for n in range(12)]
    assert forwarder.stalled_seconds == 0  # it went through at last
    assert [span_names(p) for p in collector.requests(TRACES)] == [["a"]]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "no progress for 30 s" in warnings[0] and "pushing back" in warnings[0]
    assert any("resumed after 120 s" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
