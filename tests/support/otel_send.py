"""Send spans with chosen timings and resource samples through the real OpenTelemetry SDK (OTLP/gRPC)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Status, StatusCode

MS = 1_000_000


def tracer_provider(endpoint: str, service: str, host: str | None = None, **resource: Any) -> TracerProvider:
    """A provider exporting over OTLP/gRPC to ``endpoint`` in batches; ``shutdown()`` flushes it."""
    attributes = {"service.name": service, **resource}
    if host is not None:
        attributes["host.name"] = host
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                                   max_export_batch_size=512, schedule_delay_millis=100))
    return provider


def timed_span(tracer: trace.Tracer, name: str, start_ns: int, duration_ns: int,
               kind: trace.SpanKind = trace.SpanKind.SERVER, parent: trace.Span | None = None,
               error: bool = False, ok: bool = False, attributes: dict[str, Any] | None = None,
               events: Sequence[tuple[str, int, dict[str, Any]]] = (), links: Sequence[trace.Span] = ()
               ) -> trace.Span:
    """A finished span with exactly this start and duration (no sleeping); ``parent`` None makes a root."""
    context = trace.set_span_in_context(parent) if parent is not None else trace.set_span_in_context(
        trace.INVALID_SPAN)
    span = tracer.start_span(name, context=context, kind=kind, start_time=start_ns, attributes=attributes,
                             links=[Link(s.get_span_context()) for s in links])
    for event_name, at_ns, event_attributes in events:
        span.add_event(event_name, event_attributes, timestamp=at_ns)
    if error:
        span.set_status(Status(StatusCode.ERROR, "model server returned 503"))
    elif ok:
        span.set_status(Status(StatusCode.OK))
    span.end(end_time=start_ns + duration_ns)
    return span


def send_durations(endpoint: str, service: str, name: str, durations_ns: Iterable[int], start_ns: int,
                   host: str | None = None, kind: trace.SpanKind = trace.SpanKind.SERVER,
                   error: bool = False) -> int:
    """One root span per duration, 1 ms apart from ``start_ns``; returns how many were sent."""
    provider = tracer_provider(endpoint, service, host)
    tracer = provider.get_tracer("spikehound-tests")
    n = 0
    for n, duration in enumerate(durations_ns, 1):
        timed_span(tracer, name, start_ns + n * MS, duration, kind=kind, error=error)
    provider.shutdown()
    return n


Gauges = dict[str, tuple[str, Callable[[], list[tuple[float, dict[str, Any]]]]]]


def sample_provider(endpoint: str, host: str, gauges: Gauges, counters: Gauges | None = None,
                    interval_ms: int = 500) -> MeterProvider:
    """Export observable gauges (and cumulative counters) named like the agent's samples every ``interval_ms``.

    ``gauges`` maps a metric name to its unit and a function giving ``(value, attributes)`` pairs. Call
    ``shutdown()`` to stop.
    """
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True),
                                           export_interval_millis=interval_ms)
    provider = MeterProvider(resource=Resource.create({"service.name": "test-samples", "host.name": host}),
                             metric_readers=[reader])
    meter = provider.get_meter("spikehound-tests")

    def callback(read: Callable[[], list[tuple[float, dict[str, Any]]]]
                 ) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: [Observation(value, attrs) for value, attrs in read()]

    for name, (unit, read) in gauges.items():
        meter.create_observable_gauge(name, callbacks=[callback(read)], unit=unit)
    for name, (unit, read) in (counters or {}).items():
        meter.create_observable_counter(name, callbacks=[callback(read)], unit=unit)
    return provider
