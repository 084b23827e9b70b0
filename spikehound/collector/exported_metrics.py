"""Wires the metrics that dashboards and alert rules read (span, resource and spike metrics) into a collector.

They are read by Prometheus from the collector's ``/metrics`` beside its own counters; see
``span_metrics.py``, ``resource_metrics.py`` and ``spike_metrics.py`` beside this module.
"""

from __future__ import annotations

from spikehound.collector.detection_process import ProcessDetection
from spikehound.collector.pipeline import IngestPipeline
from spikehound.collector.resource_metrics import ResourceMetrics
from spikehound.collector.span_metrics import SpanMetrics
from spikehound.collector.spike_metrics import SpikeMetrics
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.config import Config
from spikehound.storage.reader import Reader

RESOURCE_MAX_SERIES = 50_000  # hosts x (GPUs + interfaces x directions x 3 + 1): a large fleet fits


def install_exported_metrics(cfg: Config, pipeline: IngestPipeline, telemetry: CollectorTelemetry,
                             reader: Reader) -> SpanMetrics | None:
    """Register the exported metrics on ``telemetry``'s registry and feed them from ``pipeline``'s commits.

    Returns the span metrics, or None when ``collector.span_metrics`` is off.
    """
    spans = None
    if cfg.collector.span_metrics:
        spans = SpanMetrics(cfg.collector.span_metrics_max_series)
        detection = pipeline.parts.detection
        if isinstance(detection, ProcessDetection):
            detection.count_spans(spans)  # in the detection process, which decodes every committed span anyway
        else:
            pipeline.commit_hooks.add(spans.add)
        telemetry.expositions.append(spans.exposition)
    resources = ResourceMetrics(RESOURCE_MAX_SERIES)
    pipeline.commit_hooks.add(resources.add)
    telemetry.registry.register(resources)
    telemetry.registry.register(SpikeMetrics(reader))
    return spans
