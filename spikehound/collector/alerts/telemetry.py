"""The alerting counters on the collector's ``/metrics``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class _RouterCounts(Collector):
    """The router's per-spike outcomes (pure bookkeeping keeps plain counts), read when scraped."""

    def __init__(self, read: Callable[[], Counter[tuple[str, str]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "spikehound_alert_spikes", "Spikes by what routing did with them: routed (per route), silenced "
            "(per route), rate_limited (notifications held back, per route), unmatched or too_short (ended "
            "before any route took them).", labels=["outcome", "route"])
        for (outcome, route), value in sorted(self._read().items()):
            family.add_metric([outcome, route], value)
        yield family


class AlertTelemetry:
    def __init__(self, registry: CollectorRegistry, router_counts: Callable[[], Counter[tuple[str, str]]]) -> None:
        r = registry
        self.notifications = PromCounter("spikehound_alert_notifications", "Notifications queued in the outbox.",
                                         ["route", "status"], registry=r)
        self.attempts = PromCounter("spikehound_alert_delivery_attempts",
                                    "Delivery attempts by result: delivered, retry (will be tried again) or dead "
                                    "(dead-lettered).", ["receiver", "result"], registry=r)
        self.latency = Histogram("spikehound_alert_delivery_seconds",
                                 "Time from queueing a notification to its delivery.", ["receiver"],
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800), registry=r)
        self.outbox = Gauge("spikehound_alert_outbox_notifications", "Notifications in the outbox by state.",
                            ["state"], registry=r)
        self.state_errors = PromCounter("spikehound_alert_state_errors",
                                        "Failed commits of routing state and queued notifications (retried).",
                                        registry=r)
        self.profile_errors = PromCounter("spikehound_alert_profile_errors",
                                          "Alerts sent without their profile line because reading the spike's "
                                          "profiles failed or took too long.", registry=r)
        r.register(_RouterCounts(router_counts))
