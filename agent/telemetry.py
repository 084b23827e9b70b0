"""The agent's own metrics on its loopback ``/metrics``: intake, forwarding, spool and samplers.

Values are read from the components when scraped, so the hot path only
increments plain integers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.forward_queue import ForwardQueue
from agent.forwarder import Forwarder
from agent.intake import Intake
from agent.metrics_out import MetricsBridge
from agent.sampling import SamplingLoop
from agent.spool import Signal

_SIGNALS = {Signal.TRACES: "spans", Signal.METRICS: "metrics"}


class AgentMetrics(Collector):
    def __init__(self, intake: Intake, queue: ForwardQueue, forwarder: Forwarder, sampling: SamplingLoop,
                 bridge: MetricsBridge) -> None:
        self.intake, self.queue, self.forwarder, self.sampling, self.bridge = intake, queue, forwarder, sampling, bridge

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily("spikehound_agent_received", "Spans or metric points received from local "
                                       "senders.", labels=["signal", "protocol"])
        for (signal, protocol), n in sorted(self.intake.received.items()):
            received.add_metric([_SIGNALS[signal], protocol], n)
        yield received
        forwarded = CounterMetricFamily("spikehound_agent_forwarded", "Spans or metric points the collector "
                                        "acknowledged.", labels=["signal"])
        dropped = CounterMetricFamily("spikehound_agent_dropped", "Spans or metric points dropped: the collector "
                                      "rejected them as invalid, or the queue refused the agent's own samples.",
                                      labels=["signal", "reason"])
        refused = CounterMetricFamily("spikehound_agent_refused", "Spans or metric points pushed back to local "
                                      "senders because the queue and spool were full (the sender retries).",
                                      labels=["signal"])
        requests = CounterMetricFamily("spikehound_agent_forward_requests", "Requests the collector acknowledged; "
                                       "queued requests of a signal are merged into one.", labels=["signal"])
        for signal, name in _SIGNALS.items():
            forwarded.add_metric([name], self.forwarder.stats.forwarded[signal])
            requests.add_metric([name], self.forwarder.stats.requests[signal])
            dropped.add_metric([name, "rejected_by_collector"], self.forwarder.stats.dropped[signal])
            refused.add_metric([name], self.intake.refused[signal])
        dropped.add_metric(["metrics", "queue_full"], self.bridge.refused_points)
        yield from (forwarded, requests, dropped, refused)
        invalid = CounterMetricFamily("spikehound_agent_invalid_requests", "Requests from local senders that could "
                                      "not be read.", labels=["protocol"])
        for protocol, n in sorted(self.intake.invalid_requests.items()):
            invalid.add_metric([protocol], n)
        yield invalid
        yield CounterMetricFamily("spikehound_agent_spilled_requests", "Requests written to the disk spool.",
                                  value=self.queue.spilled_items)
        yield CounterMetricFamily("spikehound_agent_forward_retries", "Failed forwarding attempts that will be "
                                  "retried.", value=self.forwarder.stats.retries)
        yield GaugeMetricFamily("spikehound_agent_queue_memory_bytes", "Bytes waiting in the memory queue.",
                                value=self.queue.memory_used)
        yield GaugeMetricFamily("spikehound_agent_spool_bytes", "Bytes waiting in the disk spool.",
                                value=self.queue.spool.bytes_used)
        yield GaugeMetricFamily("spikehound_agent_spool_requests", "Requests waiting in the disk spool.",
                                value=len(self.queue.spool))
        yield CounterMetricFamily("spikehound_agent_spool_corrupt_records", "Spool records skipped because their "
                                  "checksum failed.", value=self.queue.spool.corrupt_records)
        yield GaugeMetricFamily("spikehound_agent_collector_up", "1 when the last forward attempt succeeded.",
                                value=1 if self.forwarder.stats.connected else 0)
        runs = CounterMetricFamily("spikehound_agent_sampler_runs", "Sampler runs.", labels=["sampler"])
        errors = CounterMetricFamily("spikehound_agent_sampler_errors", "Sampler runs that failed.",
                                     labels=["sampler"])
        timeouts = CounterMetricFamily("spikehound_agent_sampler_timeouts", "Sampler runs skipped or cut off "
                                       "because the previous run was still going.", labels=["sampler"])
        seconds = CounterMetricFamily("spikehound_agent_sampler_seconds", "Time spent sampling.", labels=["sampler"])
        for name, health in sorted(self.sampling.health.items()):
            runs.add_metric([name], health.runs)
            errors.add_metric([name], health.errors)
            timeouts.add_metric([name], health.timeouts)
            seconds.add_metric([name], health.total_seconds)
        yield from (runs, errors, timeouts, seconds)


def registry_for(metrics: AgentMetrics) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return registry
