"""Readings out as OTLP metrics, through the OpenTelemetry SDK's MeterProvider.

Each metric name gets one observable instrument (a gauge, or an observable
counter for cumulative totals) whose callback reports the latest readings.
``export()`` makes the provider collect once and hands the encoded OTLP
request to a sink, the agent's forward queue, instead of a network exporter:
metrics then share the spans' loss-free path to the collector.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from agent.sample import Kind, Sample
from spikehound.otlp import count_items

Sink = Callable[[bytes, int], bool]  # (serialized ExportMetricsServiceRequest, data points) -> queued?


class _SinkExporter(MetricExporter):
    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self.sink = sink
        self.refused = 0

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        request = encode_metrics(metrics_data)
        points = count_items(request)
        if not points:
            return MetricExportResult.SUCCESS
        if not self.sink(request.SerializeToString(), points):
            self.refused += points
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


class MetricsBridge:
    """Latest readings -> MeterProvider -> OTLP request -> sink."""

    def __init__(self, resource: dict[str, Any], sink: Sink) -> None:
        self._exporter = _SinkExporter(sink)
        self._reader = PeriodicExportingMetricReader(self._exporter, export_interval_millis=math.inf)
        # Host samples carry no trace context: exemplars would only cost time.
        self._provider = MeterProvider(resource=Resource.create(resource), metric_readers=[self._reader],
                                       exemplar_filter=AlwaysOffExemplarFilter())
        self._meter = self._provider.get_meter("spikehound.agent")
        self._latest: dict[str, list[Sample]] = {}

    @property
    def refused_points(self) -> int:
        return self._exporter.refused

    def update(self, samples: Sequence[Sample]) -> None:
        fresh: dict[str, list[Sample]] = {}
        for s in samples:
            fresh.setdefault(s.name, []).append(s)
        for name, group in fresh.items():
            if name not in self._latest:
                self._instrument(name, group[0])
        # A metric with no reading this interval (sampler timed out) reports nothing rather than stale values.
        self._latest = fresh

    def _instrument(self, name: str, first: Sample) -> None:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(s.value, s.attributes) for s in self._latest.get(name, ())]

        if first.kind is Kind.COUNTER:
            self._meter.create_observable_counter(name, callbacks=[observe], unit=first.unit)
        else:
            self._meter.create_observable_gauge(name, callbacks=[observe], unit=first.unit)

    def export(self) -> None:
        """Collect the latest readings once and hand them to the sink."""
        self._reader.force_flush()

    def shutdown(self) -> None:
        self._provider.shutdown()
