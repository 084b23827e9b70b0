"""The forwarder against a real OTLP/gRPC server on loopback that records what arrives and answers as told.

A flush merges each signal's queued requests into one and sends the signals side by side; what the server
refuses as invalid is found by sending one by one and dropped (counted), what it pushes back stays queued.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agent.forward_queue import ForwardQueue
from agent.forwarder import Forwarder
from agent.spool import DiskSpool, Item, Signal

TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


class Collector:
    """Records (method, payload) of each request; refuses trace requests holding a span named ``bad`` as invalid,
    and answers UNAVAILABLE (with a RetryInfo) to the next ``unavailable[method]`` requests of a method."""

    def __init__(self) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.unavailable = {TRACES: 0, METRICS: 0}
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler(method.strip("/").split("/")[0], {"Export": (
                grpc.unary_unary_rpc_method_handler(self._handler(method)))}) for method in (TRACES, METRICS)])

    def _handler(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def export(payload: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                if self.unavailable[method]:
                    self.unavailable[method] -= 1
                    info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=50_000_000))
                    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message="restarting")
                    status.details.add().Pack(info)
                    context.abort(grpc.StatusCode.UNAVAILABLE, "restarting",
                                  trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),))
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
def queue(tmp_path: Path) -> Iterator[ForwardQueue]:
    q = ForwardQueue(1 << 20, DiskSpool(tmp_path / "spool", 1 << 20))
    yield q
    q.close()


def spans(*names: str) -> Item:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for name in names:
        scope.spans.add(name=name, trace_id=bytes(16), span_id=bytes(8))
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
