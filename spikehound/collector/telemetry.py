"""The collector's own metrics, served on ``/metrics`` (Prometheus text exposition).

Every instance gets its own registry, so tests can run several collectors in
one process. Names follow Prometheus conventions: ``_total`` for counters,
base units (seconds, items).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class CollectorTelemetry:
    """All counters and gauges of one collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Families written in the text format by their owner, after the registry's (the span metrics: too
        # many samples to build as prometheus_client's objects at every scrape; see SpanMetrics.exposition).
        self.expositions: list[Callable[[], bytes]] = []
        r = self.registry
        self.received = Counter("spikehound_ingest_received",
                                "Spans, metric points or profile samples received, before validation.",
                                ["signal", "protocol"], registry=r)
        self.stored = Counter("spikehound_ingest_stored",
                              "Spans, metric points or profile samples committed to storage.", ["signal"], registry=r)
        self.rejected = Counter("spikehound_ingest_rejected",
                                "Spans, metric points or profile samples rejected as invalid (reported to the sender, "
                                "not retried).", ["signal", "reason"], registry=r)
        self.dropped = Counter("spikehound_ingest_dropped",
                               "Spans, metric points or profile samples not stored because the collector could not "
                               "take them (queue full, storage down); the sender was told to retry.",
                               ["signal", "reason"], registry=r)
        self.rejected_requests = Counter("spikehound_ingest_rejected_requests",
                                         "Whole export requests refused before decoding (bytes_in_flight, "
                                         "profiles_in_flight, storage_unavailable: told to retry later).",
                                         ["protocol", "reason"], registry=r)
        self.aborted_requests = Counter("spikehound_ingest_aborted_requests",
                                        "Export requests whose sender hung up before the whole body arrived.",
                                        ["protocol"], registry=r)
        self.api_refused = Counter("spikehound_api_refused_requests",
                                   "Requests on the API port refused before their handler: host (a Host that is "
                                   "not the collector's, as in DNS rebinding), cross_origin (sent by another "
                                   "site's page), media_type (a body that is not JSON), too_large, "
                                   "unauthenticated.", ["reason"], registry=r)
        self.profile_diffs_refused = Counter("spikehound_profile_diffs_refused",
                                             "Profile diffs at spike time not computed because as many as the "
                                             "collector runs at once were running (the API answered 429 with "
                                             "Retry-After; the spike page was shown without its profile), by "
                                             "surface (api, page).", ["surface"], registry=r)
        self.profile_diffs_partial = Counter("spikehound_profile_diffs_partial",
                                             "Profile diffs at spike time cut at their bounds (distinct stacks, "
                                             "frames, functions, rows): answered with what was read, saying so, "
                                             "by surface (api, page).", ["surface"], registry=r)
        self.truncated = Counter("spikehound_ingest_truncated",
                                 "Names and values cut, or attributes dropped, at the collector's limits "
                                 "(collector.max_name_length, max_attribute_value_length, max_attributes_per_span), "
                                 "by signal and field; attributes_dropped counts attributes.",
                                 ["signal", "field"], registry=r)
        self.future = Counter("spikehound_ingest_future_records",
                              "Spans, metric samples and profile samples refused for being dated more than "
                              "collector.max_clock_skew_seconds after the collector's clock, by signal and sender "
                              "(the first 100 senders; later ones as service and host \"other\").",
                              ["signal", "service", "host"], registry=r)
        self.bytes_in_flight = Gauge("spikehound_ingest_bytes_in_flight",
                                     "Request bytes being decoded or waiting for their commit, both receivers.",
                                     registry=r)
        self.bytes_in_flight_capacity = Gauge("spikehound_ingest_bytes_in_flight_capacity",
                                              "Most request bytes in flight (collector.max_bytes_in_flight); "
                                              "beyond it senders are told to retry later.", registry=r)
        self.queue_items = Gauge("spikehound_ingest_queue_items",
                                 "Spans and points accepted but not yet committed.", registry=r)
        self.queue_capacity = Gauge("spikehound_ingest_queue_capacity",
                                    "Most spans and points the ingest queue holds.", registry=r)
        self.write_seconds = Histogram("spikehound_storage_write_seconds", "Time to commit one write batch.",
                                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                                       registry=r)
        self.write_errors = Counter("spikehound_storage_write_errors", "Write batches that failed to commit.",
                                    registry=r)
        self.storage_available = Gauge("spikehound_storage_available",
                                       "1 while storage takes writes, 0 during an outage (the last commit failed; "
                                       "senders are told to retry and /readyz answers 503).", registry=r)
        self.storage_outages = Counter("spikehound_storage_outages",
                                       "Storage outages (episodes from a failed commit to the next good one), by "
                                       "kind: unreachable, disk_full, error.", ["kind"], registry=r)
        self.windows_closed = Counter("spikehound_latency_windows_closed",
                                      "Event-time latency windows closed and stored.", registry=r)
        self.spikes = Counter("spikehound_spikes", "Spike state changes written to storage.", ["event"], registry=r)
        self.checkpoint_seconds = Histogram("spikehound_detector_checkpoint_seconds",
                                            "Time to save the detectors' learned state.",
                                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.retention_deleted = Counter("spikehound_retention_deleted",
                                         "Spans, metric points, profile rows, operations or latency windows "
                                         "deleted by retention, past their age or over the size caps.",
                                         ["table", "reason"], registry=r)
        self.stored_span_bytes = Gauge("spikehound_storage_span_payload_bytes",
                                       "Payload bytes of the stored spans, as retention last measured "
                                       "(storage.span_retention_max_bytes caps it).", registry=r)
        self.stored_metric_points = Gauge("spikehound_storage_metric_points",
                                          "Stored metric points, as retention last measured "
                                          "(storage.metric_retention_max_points caps it).", registry=r)

    def exposition(self) -> bytes:
        """What ``/metrics`` serves: the registry's families, then the ``expositions``'."""
        return generate_latest(self.registry) + b"".join(part() for part in self.expositions)
