"""OpenTelemetry SDK set-up for the demo's services, from the standard ``OTEL_*`` environment variables.

This is all an application needs to send to a spikehound agent: a tracer
provider whose resource comes from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, a ``BatchSpanProcessor`` (``OTEL_BSP_SCHEDULE_DELAY``)
and an OTLP exporter to ``OTEL_EXPORTER_OTLP_ENDPOINT`` over the protocol of
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc``, the default, or ``http/protobuf``).
"""

from __future__ import annotations

import os
from typing import Any


def _protocol() -> str:
    return os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc").strip().lower()


def tracer_provider() -> Any:
    """A ``TracerProvider`` exporting in batches to the OTLP endpoint of the environment."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if _protocol() == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        exporter: Any = HttpSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create())
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def meter_provider() -> Any:
    """A ``MeterProvider`` exporting every ``OTEL_METRIC_EXPORT_INTERVAL`` ms to the same endpoint."""
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    if _protocol() == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

        exporter: Any = HttpMetricExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        exporter = OTLPMetricExporter()
    return MeterProvider(resource=Resource.create(), metric_readers=[PeriodicExportingMetricReader(exporter)],
                         exemplar_filter=AlwaysOffExemplarFilter())
