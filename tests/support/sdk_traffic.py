"""Traces made by the OpenTelemetry SDK and raw OTLP export requests, for the agent and collector tests: what
was sent, and what the receiver acknowledged."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from harness.waiting import eventually


def hex_key(span: ReadableSpan) -> tuple[str, str]:
    """(trace id, span id) in hex, as the API shows them."""
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


class Recording(SpanExporter):
    """Wraps a real exporter; remembers every span the SDK handed it, which the receiver acknowledged and
    which exports failed.

    ``on_ack``, when set, is called right after each successful export with the count acknowledged so far;
    ``owns_inner=False`` leaves shutting the real exporter down to its owner.
    """

    def __init__(self, inner: SpanExporter, *, owns_inner: bool = True) -> None:
        self.inner = inner
        self.owns_inner = owns_inner
        self._lock = threading.Lock()
        self._acked: set[tuple[str, str]] = set()
        self._failed: set[tuple[str, str]] = set()
        self.spans: list[ReadableSpan] = []
        self.on_ack: Callable[[int], None] | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        with self._lock:
            (self._acked if result is SpanExportResult.SUCCESS else self._failed).update(hex_key(s) for s in spans)
            self.spans.extend(spans)
            count = len(self._acked)
        if result is SpanExportResult.SUCCESS and self.on_ack is not None:
            self.on_ack(count)
        return result

    @property
    def acked(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._acked)

    @property
    def failed(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._failed)

    def shutdown(self) -> None:
        if self.owns_inner:
            self.inner.shutdown()


def send_spans(exporter: SpanExporter, resource: dict[str, str], n: int = 4) -> Recording:
    """``n`` small traces (a server span with two children) through the SDK; returns once exported."""
    recording = Recording(exporter)
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(BatchSpanProcessor(recording, schedule_delay_millis=50))
    tracer = provider.get_tracer("agent-test")
    for i in range(n):
        with tracer.start_as_current_span("POST /v1/generate", kind=trace.SpanKind.SERVER,
                                          attributes={"request.index": i}):
            for step in ("prefill", "decode"):
                with tracer.start_as_current_span(step):
                    pass
    provider.shutdown()
    return recording


def trace_request(service: str, spans: int = 1, host: str | None = None, trace_id: bytes | None = None,
                  padding: int = 40, size: int | None = None) -> tuple[bytes, bytes]:
    """A serialized ExportTraceServiceRequest of ``spans`` spans in one new trace, and the trace id.

    Each span has a ``padding`` attribute of that many bytes; with ``size``, the last span's is grown or
    shrunk until the request is ``size`` bytes.
    """
    trace_id = trace_id or os.urandom(16)
    now = time.time_ns()
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    if host:
        rs.resource.attributes.add(key="host.name").value.string_value = host
    scope = rs.scope_spans.add()
    for i in range(spans):
        sp = scope.spans.add(trace_id=trace_id, span_id=os.urandom(8), name=f"step-{i % 4}", kind=2,
                             start_time_unix_nano=now - 3_000_000 + i, end_time_unix_nano=now + i)
        sp.attributes.add(key="padding").value.string_value = "x" * padding
    last = scope.spans[-1].attributes[0].value
    while size is not None and req.ByteSize() != size:  # length prefixes grow with the padding: settle it
        last.string_value = "x" * (len(last.string_value) + size - req.ByteSize())
    return req.SerializeToString(), trace_id


class SdkApp:
    """An application on the SDK sending ``traces_per_second`` traces of 10 spans to the agent (300 spans/s)."""

    def __init__(self, endpoint: str, service: str, traces_per_second: float = 30,
                 exporter: SpanExporter | None = None, export_timeout: float = 10) -> None:
        """``exporter`` replaces the OTLP/gRPC one to ``endpoint`` (an OTLP/HTTP exporter, say);
        ``export_timeout`` is how long the SDK retries one export before it gives it up."""
        # The SDK's default 10 s: an export retries UNAVAILABLE while the agent restarts.
        self.recording = Recording(exporter or GrpcSpanExporter(endpoint=endpoint, insecure=True,
                                                                timeout=export_timeout))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service, "host.name": "pod-7"}))
        self.provider.add_span_processor(BatchSpanProcessor(self.recording, max_export_batch_size=256,
                                                            schedule_delay_millis=100, max_queue_size=8192))
        self.period = 1 / traces_per_second
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdk-app", daemon=True)

    def _run(self) -> None:
        tracer = self.provider.get_tracer("outage-test")
        next_at = time.monotonic()
        while not self._stop.is_set():
            with tracer.start_as_current_span("POST /v1/generate", kind=trace.SpanKind.SERVER):
                for step in ("tokenize", "prefill", *["decode"] * 6, "detokenize"):
                    with tracer.start_as_current_span(step):
                        pass
            next_at += self.period
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> SdkApp:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop creating spans and export what is left (the agent is up by then)."""
        self._stop.set()
        self._thread.join(10)
        self.provider.shutdown()


class SdkTraffic:
    """An application creating small traces as fast as it can, exported by the SDK in the background."""

    def __init__(self, grpc_endpoint: str, service: str) -> None:
        # A short timeout: with the collector gone an export gives up in about 2 s instead of retrying for long.
        self.exporter = GrpcSpanExporter(endpoint=grpc_endpoint, insecure=True, timeout=2)
        self.recorder = Recording(self.exporter, owns_inner=False)  # stop() shuts the real exporter down first
        self.provider = TracerProvider(resource=Resource.create({"service.name": service, "host.name": "crash-host"}))
        self.provider.add_span_processor(BatchSpanProcessor(self.recorder, max_export_batch_size=256,
                                                            schedule_delay_millis=50))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdk-traffic", daemon=True)

    def _run(self) -> None:
        tracer = self.provider.get_tracer("crash-test")
        while not self._stop.is_set():
            with tracer.start_as_current_span("POST /predict", kind=trace.SpanKind.SERVER):
                for step in ("tokenize", "forward", "detokenize"):
                    with tracer.start_as_current_span(step):
                        pass
            time.sleep(0.002)

    def start(self) -> SdkTraffic:
        self._thread.start()
        return self

    def wait_acked(self, count: int, timeout: float = 60) -> None:
        eventually(lambda: len(self.recorder.acked) >= count, f"{count} spans acknowledged", timeout, every=0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.exporter.shutdown()  # an export retrying against a dead collector gives up now
        self.provider.shutdown()


class GrpcExports:
    """``senders`` threads exporting 256-span OTLP/gRPC requests back to back, each on a channel of its own: a
    collector's gRPC server kept busy (``acked`` counts the requests answered OK)."""

    def __init__(self, grpc_endpoint: str, senders: int = 4, spans: int = 256) -> None:
        self.endpoint, self.spans = grpc_endpoint, spans
        self.acked = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"grpc-exports-{i}", daemon=True)
                         for i in range(senders)]

    def _run(self) -> None:
        with grpc.insecure_channel(self.endpoint) as channel:
            stub = TraceServiceStub(channel)
            while not self._stop.is_set():
                body, _ = trace_request("grpc-load", spans=self.spans)
                with contextlib.suppress(grpc.RpcError):  # told to retry, or the collector restarting
                    stub.Export(ExportTraceServiceRequest.FromString(body), timeout=10)
                    with self._lock:
                        self.acked += 1

    def start(self) -> GrpcExports:
        for thread in self._threads:
            thread.start()
        return self

    def wait_acked(self, count: int, timeout: float = 60) -> None:
        eventually(lambda: self.acked >= count, f"{count} requests acknowledged", timeout, every=0.05)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)
