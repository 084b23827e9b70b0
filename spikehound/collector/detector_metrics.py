"""The detectors' metrics: what the detection engine counts, read when scraped, and the failures it survived.

One Prometheus collector, registered on the collector's registry by the daemon.
The engine's figures are pure computation kept by the engine itself (see
``DetectionEngine.stats``); they are read at scrape time, from whichever engine
the pipeline holds then (a restore replaces it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# (metric name, key in the engine's stats, help); counters get "_total" when exposed.
ENGINE_COUNTERS = (
    ("spikehound_latency_late_spans", "late_spans",
     "Entry spans that arrived after their window closed (stored, not counted in window percentiles)."),
    ("spikehound_latency_stream_overflow_spans", "overflow_spans",
     "Entry spans not aggregated because the stream limit (collector.max_streams) was reached."),
    ("spikehound_latency_unjoined_calls", "unjoined_calls",
     "CLIENT spans left out of hop streams: their answer never came and several callees answer such calls."),
    ("spikehound_detector_evicted_streams", "evicted_streams",
     "Quiet streams whose learned baseline was dropped to stay within collector.max_streams."),
    ("spikehound_detector_judged_windows", "judged_windows",
     "Closed windows of latency streams (entry and hop) judged by the detectors."),
    ("spikehound_trace_buffer_evicted_traces", "trace_buffer_evicted_traces",
     "Traces dropped from the attribution buffer to stay within detection.trace_buffer_spans."),
    ("spikehound_attribution_missing_traces", "attributions_without_traces",
     "Spike updates that found none of their slow traces in the attribution buffer."),
    ("spikehound_detector_duplicate_spans", "duplicate_spans",
     "Spans the detectors skipped as already seen (a retried export whose first commit succeeded)."),
    ("spikehound_resource_late_points", "resource_late_points",
     "Metric samples that arrived after their window was judged."),
    ("spikehound_resource_overflow_points", "resource_overflow_points",
     "Metric samples not judged because the resource series limit was reached."),
    ("spikehound_detection_process_restarts", "process_restarts",
     "Times the detection process was started again after it died (it continued from the checkpoint)."),
)
ENGINE_GAUGES = (
    ("spikehound_latency_streams", "streams", "Latency streams with open windows."),
    ("spikehound_latency_open_windows", "open_windows",
     "Latency windows (stream and window) whose spans are counted and that are not yet closed and judged."),
    ("spikehound_detector_streams", "judged_streams", "Latency streams with a learned baseline."),
    ("spikehound_detector_open_spikes", "open_spikes",
     "Spikes the detectors hold open now (restored from the checkpoint after a restart)."),
    ("spikehound_trace_buffer_spans", "trace_buffer_spans", "Spans held for attribution."),
    ("spikehound_trace_buffer_bytes", "trace_buffer_bytes",
     "Estimated bytes of the spans held for attribution (bounded by detection.trace_buffer_bytes)."),
    ("spikehound_resource_series", "resource_series", "Resource series watched by the resource detectors."),
    ("spikehound_detection_catching_up", "catching_up",
     "1 while the latency windows' watermark is held for a backlog to drain (after a storage outage or a "
     "restart from a checkpoint), else 0."),
    ("spikehound_detection_waiting_bytes", "waiting_bytes",
     "Bytes of committed span blocks handed to the detection process (detection.own_process) and not yet taken "
     "by it; at 32 MiB the writer waits for it and the senders are pushed back. 0 with detection in-process."),
)


class DetectorMetrics(Collector):
    """``spikehound_detector_errors_total{part}`` and the engine's own counters and gauges.

    ``stats`` returns the engine's figures now (the keys of ``ENGINE_COUNTERS`` and ``ENGINE_GAUGES``).
    """

    def __init__(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self._stats = stats
        # part: "detectors" (a detector step raised) or "metrics" (a commit hook raised).
        self.errors = Counter("spikehound_detector_errors",
                              "Committed batches that the detectors or a metrics hook failed on (stored "
                              "and acknowledged anyway; their windows or span metrics may miss them). "
                              "The first of each kind is logged with its traceback.", ["part"], registry=None)

    def collect(self) -> Iterator[Metric]:
        yield from self.errors.collect()
        stats = self._stats()
        for name, key, doc in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats[key])
        for name, key, doc in ENGINE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats[key])
