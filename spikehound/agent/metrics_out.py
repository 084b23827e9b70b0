"""Readings out as OTLP metrics: each tick's samples become one ``ExportMetricsServiceRequest`` for a sink.

The sink is the agent's forward queue, so metrics share the spans' loss-free
path to the collector. The request has the shape the OpenTelemetry SDK's
``MeterProvider`` gives it with one observable instrument per metric name: the
resource from the SDK's ``Resource.create`` (so ``OTEL_RESOURCE_ATTRIBUTES``
and the ``telemetry.sdk.*`` keys apply), one scope ``spikehound.agent``, a
gauge per GAUGE sample name and a cumulative monotonic sum per COUNTER name,
whose points start when the agent first saw the series. No exemplars: host
samples carry no trace context. The samples are encoded here rather than
through the SDK because the SDK's collect and encode, every tick, would take
a large share of the agent's CPU budget.

>>> sent = []
>>> out = MetricsBridge({"service.name": "spikehound-agent", "host.name": "gpu-1"},
...                     lambda payload, points: sent.append(payload) or True)
>>> out.export([Sample("hw.power", 412.5, "W", {"hw.id": "GPU-1"})])
>>> metric = ExportMetricsServiceRequest.FromString(sent[0]).resource_metrics[0].scope_metrics[0].metrics[0]
>>> metric.name, metric.unit, metric.gauge.data_points[0].as_double
('hw.power', 'W', 412.5)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourcePb
from opentelemetry.sdk.resources import Resource

from spikehound.agent.sample import Kind, Sample
from spikehound.otlp import set_any_value

Sink = Callable[[bytes, int], bool]  # (serialized ExportMetricsServiceRequest, data points) -> queued?
SCOPE = "spikehound.agent"
FORGET_AFTER_TICKS = 300  # a series unseen this long (a process that exited) is forgotten
_CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
SeriesKey = tuple[str, tuple[tuple[str, Any], ...]]


@dataclass(slots=True)
class _Series:
    attributes: bytes  # the point's attributes, encoded once
    started: int  # when the agent first saw it: the start of a cumulative sum
    seen: int  # the last tick it was sampled in


class MetricsBridge:
    """Samples -> OTLP metrics request -> sink; one ``export`` per sampling tick."""

    def __init__(self, resource: dict[str, Any], sink: Sink) -> None:
        self._sink = sink
        self.refused_points = 0  # points the sink (a full queue and spool) did not take
        pb = ResourcePb()
        for key, value in Resource.create(resource).attributes.items():
            set_any_value(pb.attributes.add(key=key).value, value)
        self._resource = pb.SerializeToString()  # encoded once: it never changes
        self._series: dict[SeriesKey, _Series] = {}
        self._ticks = 0

    def encode(self, samples: Sequence[Sample], now_ns: int | None = None) -> ExportMetricsServiceRequest:
        """The request for one tick's samples; a series sampled twice in it keeps its last reading."""
        now = now_ns or time.time_ns()
        self._ticks += 1
        latest: dict[SeriesKey, Sample] = {}
        for sample in samples:
            latest[(sample.name, tuple(sample.attributes.items()))] = sample
        request = ExportMetricsServiceRequest()
        rm = request.resource_metrics.add()
        rm.resource.MergeFromString(self._resource)
        sm = rm.scope_metrics.add()
        sm.scope.name = SCOPE
        points: dict[str, Any] = {}  # metric name -> its repeated data_points
        for key, sample in latest.items():
            name = sample.name
            target = points.get(name)
            if target is None:
                metric = sm.metrics.add(name=name, unit=sample.unit)
                if sample.kind is Kind.COUNTER:
                    metric.sum.aggregation_temporality = _CUMULATIVE
                    metric.sum.is_monotonic = True
                    target = points[name] = metric.sum.data_points
                else:
                    target = points[name] = metric.gauge.data_points
            series = self._series.get(key) or self._new_series(key, sample, now)
            series.seen = self._ticks
            point = target.add(time_unix_nano=now)
            point.MergeFromString(series.attributes)
            if sample.kind is Kind.COUNTER:
                point.start_time_unix_nano = series.started
            value = sample.value
            if isinstance(value, int):  # as the SDK: integral readings stay integers
                point.as_int = value
            else:
                point.as_double = value
        if self._ticks % FORGET_AFTER_TICKS == 0:
            self._series = {k: v for k, v in self._series.items() if self._ticks - v.seen < FORGET_AFTER_TICKS}
        return request

    def _new_series(self, key: SeriesKey, sample: Sample, now: int) -> _Series:
        point = metrics_pb2.NumberDataPoint()
        for name, value in sample.attributes.items():
            set_any_value(point.attributes.add(key=name).value, value)
        series = self._series[key] = _Series(point.SerializeToString(), now, self._ticks)
        return series

    def export(self, samples: Sequence[Sample]) -> None:
        """Encode one tick's samples and hand them to the sink; nothing is sent for an empty tick."""
        if not samples:
            return
        request = self.encode(samples)
        points = sum(len(getattr(m, m.WhichOneof("data")).data_points)
                     for m in request.resource_metrics[0].scope_metrics[0].metrics)
        if not self._sink(request.SerializeToString(), points):
            self.refused_points += points
