"""The agent's own metrics on its loopback ``/metrics``: intake, forwarding, spool and samplers.

Values are read from the components when scraped, so the hot path only
increments plain integers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spikehound.agent.dispatcher import Dispatcher
from spikehound.agent.forwarder import REASONS
from spikehound.agent.intake import Intake
from spikehound.agent.metrics_out import MetricsBridge
from spikehound.agent.profiler import FAILURES, Profiler
from spikehound.agent.samplers.cpu import LEFT_OUT_REASONS, CpuSampler
from spikehound.agent.sampling import SamplingLoop
from spikehound.agent.spool import Signal

_SIGNALS = {Signal.TRACES: "spans", Signal.METRICS: "metrics", Signal.PROFILES: "profiles"}


class AgentMetrics(Collector):
    """Totals over the collectors the agent forwards to keep the names they had with one collector; the
    ``collector``-labelled series and ``spikehound_agent_collector_members`` break them down."""

    def __init__(self, intake: Intake, dispatcher: Dispatcher, sampling: SamplingLoop, bridge: MetricsBridge,
                 profiler: Profiler | None = None) -> None:
        self.intake, self.dispatcher, self.sampling, self.bridge = intake, dispatcher, sampling, bridge
        self.profiler = profiler

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily("spikehound_agent_received", "Spans or metric points received from local "
                                       "senders.", labels=["signal", "protocol"])
        for (signal, protocol), n in sorted(self.intake.received.items()):
            received.add_metric([_SIGNALS[signal], protocol], n)
        yield received
        forwarded = CounterMetricFamily("spikehound_agent_forwarded", "Spans or metric points the collector "
                                        "acknowledged.", labels=["signal"])
        dropped = CounterMetricFamily("spikehound_agent_dropped", "Spans or metric points dropped: the collector "
                                      "rejected them as invalid (rejected_by_collector), one alone was larger than "
                                      "the collector accepts in a request (too_large), or the queue refused the "
                                      "agent's own samples (queue_full: full, or the disk refused the spool).",
                                      labels=["signal", "reason"])
        refused = CounterMetricFamily("spikehound_agent_refused", "Spans or metric points pushed back to local "
                                      "senders because the queue and spool were full (the sender retries).",
                                      labels=["signal"])
        unavailable = CounterMetricFamily("spikehound_agent_unavailable", "Spans or metric points refused to local "
                                          "senders with UNAVAILABLE / 503 because the disk spool could not be "
                                          "written (disk full, file too large; the sender retries).",
                                          labels=["signal"])
        requests = CounterMetricFamily("spikehound_agent_forward_requests", "Requests the collector acknowledged; "
                                       "queued requests of a signal are merged into one.", labels=["signal"])
        split = CounterMetricFamily("spikehound_agent_split_requests", "Requests cut into several because they were "
                                    "larger than the collector accepts (see spikehound_agent_forward_max_request_"
                                    "bytes).", labels=["signal"])
        stats = self.dispatcher.totals.stats()
        for signal, name in _SIGNALS.items():
            forwarded.add_metric([name], stats.forwarded[signal])
            requests.add_metric([name], stats.requests[signal])
            dropped.add_metric([name, "rejected_by_collector"], stats.dropped[signal])
            dropped.add_metric([name, "too_large"], stats.too_large[signal] + self.intake.too_large[signal])
            refused.add_metric([name], self.intake.refused[signal])
            unavailable.add_metric([name], self.intake.unavailable[signal])
            split.add_metric([name], stats.split_requests[signal] + self.intake.split_requests[signal])
        dropped.add_metric(["metrics", "queue_full"], self.bridge.refused_points)
        yield from (forwarded, requests, dropped, refused, unavailable, split)
        invalid = CounterMetricFamily("spikehound_agent_invalid_requests", "Requests from local senders that could "
                                      "not be read.", labels=["protocol"])
        for protocol, n in sorted(self.intake.invalid_requests.items()):
            invalid.add_metric([protocol], n)
        yield invalid
        yield CounterMetricFamily("spikehound_agent_spilled_requests", "Requests written to the disk spool.",
                                  value=self.dispatcher.totals.spilled_items)
        yield CounterMetricFamily("spikehound_agent_forward_retries", "Failed forwarding attempts that will be "
                                  "retried.", value=stats.retries)
        failures = CounterMetricFamily("spikehound_agent_forward_failures", "Forwarding attempts that failed, by "
                                       "reason: unavailable (unreachable or down), backpressure (its queue is full), "
                                       "timeout, unauthenticated (wrong agent.collector_token), too_large (split and "
                                       "sent again), other.", labels=["reason"])
        for reason in (*REASONS, "too_large"):
            failures.add_metric([reason], stats.failures[reason])
        yield failures
        yield GaugeMetricFamily("spikehound_agent_forward_stalled_seconds", "Seconds forwarding has failed without "
                                "anything reaching the collector; 0 while it flows. The agent's log says why.",
                                value=self.dispatcher.totals.stalled_seconds)
        yield GaugeMetricFamily("spikehound_agent_forward_max_request_bytes", "Largest request the agent sends: the "
                                "collector's default limit, or the lower one it named when it refused a request.",
                                value=self.dispatcher.max_request_bytes)
        yield GaugeMetricFamily("spikehound_agent_queue_memory_bytes", "Bytes waiting in the memory queues.",
                                value=self.dispatcher.totals.memory_used)
        yield GaugeMetricFamily("spikehound_agent_spool_bytes", "Bytes waiting in the disk spools.",
                                value=self.dispatcher.totals.spool_bytes)
        yield GaugeMetricFamily("spikehound_agent_spool_requests", "Requests waiting in the disk spools.",
                                value=self.dispatcher.totals.spool_requests)
        yield CounterMetricFamily("spikehound_agent_spool_corrupt_records", "Damaged spool records skipped: a "
                                  "record failing its checksum, or a damaged stretch up to the next sound record.",
                                  value=self.dispatcher.totals.spool_total("corrupt_records"))
        yield CounterMetricFamily("spikehound_agent_spool_skipped_bytes", "Bytes of damaged spool data skipped.",
                                  value=self.dispatcher.totals.spool_total("skipped_bytes"))
        yield CounterMetricFamily("spikehound_agent_spool_write_errors", "Appends to the disk spool that the disk "
                                  "refused (full, file too large); rolled back, the sender was told to retry.",
                                  value=self.dispatcher.totals.spool_total("write_errors"))
        yield GaugeMetricFamily("spikehound_agent_collector_up", "1 when the last forward attempt to every "
                                "collector succeeded.", value=1 if stats.connected else 0)
        yield from self._members()
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
        yield from self._left_out()
        yield from self._profiler()

    def _left_out(self) -> Iterator[Metric]:
        cpu = next((s for s in self.sampling.samplers if isinstance(s, CpuSampler)), None)
        total = CounterMetricFamily("spikehound_agent_processes_left_out", "Processes matching agent.process_"
                                    "patterns or agent.pid_files that were not sampled or profiled, each counted "
                                    "once: max_processes (over agent.profile_max_processes), user (owner not in "
                                    "agent.profile_users).", labels=["reason"])
        now = GaugeMetricFamily("spikehound_agent_processes_left_out_now", "Matching processes left out at the "
                                "last process scan, by reason (as spikehound_agent_processes_left_out_total).",
                                labels=["reason"])
        for reason in LEFT_OUT_REASONS:
            total.add_metric([reason], cpu.left_out[reason] if cpu is not None else 0)
            now.add_metric([reason], cpu.left_out_now(reason) if cpu is not None else 0)
        yield from (total, now)

    def _members(self) -> Iterator[Metric]:
        r = self.dispatcher
        yield GaugeMetricFamily("spikehound_agent_collector_members", "Collectors traces are routed over now.",
                                value=len(r.active))
        queued = GaugeMetricFamily("spikehound_agent_forward_queue_requests", "Requests queued (memory and spool) "
                                   "for each collector; state: active, departing (left the membership, still "
                                   "forwarded to), rerouting (left and silent: moved to the current members).",
                                   labels=["collector", "state"])
        queued_bytes = GaugeMetricFamily("spikehound_agent_forward_queue_bytes", "Bytes queued (memory and spool) "
                                         "for each collector.", labels=["collector", "state"])
        up = GaugeMetricFamily("spikehound_agent_collector_member_up", "1 when the last forward attempt to this "
                               "collector succeeded.", labels=["collector", "state"])
        refused = CounterMetricFamily("spikehound_agent_route_refused_requests", "Requests pushed back because "
                                      "this collector's queue and spool had no room (all pieces of a request or "
                                      "none are queued).", labels=["collector"])
        for key, member in sorted(r.members.items()):
            labels = [key, member.state]
            queued.add_metric(labels, len(member.queue))
            queued_bytes.add_metric(labels, member.queue.memory_used + member.queue.spool.reserved_bytes)
            up.add_metric(labels, 1 if member.forwarder is not None and member.forwarder.stats.connected else 0)
        for key, n in sorted(r.refused.items()):
            refused.add_metric([key], n)
        yield from (queued, queued_bytes, up, refused)
        yield CounterMetricFamily("spikehound_agent_membership_changes", "Changes of the collector membership "
                                  "(dns:/// or file:///), each logged once with the members added and removed.",
                                  value=r.membership_changes)
        yield CounterMetricFamily("spikehound_agent_membership_resolve_failures", "Lookups of the membership that "
                                  "failed or named no collector; the last good membership stood.",
                                  value=r.membership.resolve_failures)
        yield CounterMetricFamily("spikehound_agent_membership_abandoned_lookups", "Lookups of the membership "
                                  "that gave no answer within 10 s and were abandoned (a hung DNS server or file "
                                  "system); the next interval starts a fresh one.",
                                  value=r.membership.abandoned_lookups)
        own = CounterMetricFamily("spikehound_agent_self_members", "Collectors left out of the membership because "
                                  "they are this agent itself, once per episode: address (one of its own OTLP "
                                  "listen addresses), loop (its own receiver got back what it forwarded there, "
                                  "through a name or a proxy).", labels=["reason"])
        for reason in ("address", "loop"):
            own.add_metric([reason], r.membership.self_members[reason])
        yield own
        yield CounterMetricFamily("spikehound_agent_forward_loops", "Requests the agent's OTLP/gRPC receiver "
                                  "refused because they had already gone through this agent (its id in their "
                                  "chain of agent ids: its own forwarder, or an agent forwarding to it sent them "
                                  "back; FAILED_PRECONDITION, the sender then leaves that member out).",
                                  value=self.intake.forward_loops)
        yield CounterMetricFamily("spikehound_agent_members_retired_early", "Departed collectors forgotten before "
                                  "their time because the agent held more than 512 members (the membership "
                                  "changing faster than they drain); what they held was routed over the current "
                                  "members.", value=r.rerouter.retired_early)
        yield GaugeMetricFamily("spikehound_agent_route_sticky_traces", "Traces the sticky map keeps on their "
                                "collector across a membership change.", value=len(r.sticky))
        yield CounterMetricFamily("spikehound_agent_route_sticky_evictions", "Traces forgotten by the sticky map "
                                  "before their time because it was full.", value=r.sticky.evictions)
        yield CounterMetricFamily("spikehound_agent_rerouted_requests", "Requests moved off a collector that left "
                                  "the membership and stopped answering, routed by trace over the current ones.",
                                  value=r.rerouter.rerouted_requests)

    def _profiler(self) -> Iterator[Metric]:
        p = self.profiler
        stats = p.stats if p is not None else None
        yield GaugeMetricFamily("spikehound_agent_profiler_processes", "Model-server processes being profiled "
                                "(tracked, and not set aside after a ptrace refusal); 0 when profiling is off.",
                                value=p.profiled_processes if p is not None else 0)
        yield CounterMetricFamily("spikehound_agent_profile_windows", "Profile windows queued for the collector "
                                  "(one request each, split when larger than the collector takes).",
                                  value=stats.windows if stats else 0)
        yield CounterMetricFamily("spikehound_agent_profile_stacks", "Distinct stacks (per process and window) "
                                  "queued.", value=stats.stacks if stats else 0)
        yield CounterMetricFamily("spikehound_agent_profile_samples", "Stack samples queued.",
                                  value=stats.samples if stats else 0)
        yield CounterMetricFamily("spikehound_agent_profile_folded_stacks", "Rare stacks summed into one "
                                  "\"(other stacks)\" stack because a process-window had more than 2,000.",
                                  value=stats.folded_stacks if stats else 0)
        failures = CounterMetricFamily("spikehound_agent_profile_failures", "py-spy runs or windows that gave no "
                                       "profile, by reason: gone (the process exited), permission (ptrace not "
                                       "permitted: see the agent's log), not_python, timeout, error; queue_full "
                                       "(windows lost: queue and spool full), too_large (stacks dropped), "
                                       "max_processes (processes left out of a window: over "
                                       "agent.profile_max_processes).",
                                       labels=["reason"])
        for reason in FAILURES:
            failures.add_metric([reason], stats.failures[reason] if stats else 0)
        yield failures
        yield CounterMetricFamily("spikehound_agent_profiler_cpu_seconds", "CPU time (user and system) of the "
                                  "agent's py-spy children.", value=p.children_cpu_seconds if p is not None else 0)
        services = p.services if p is not None else None
        yield CounterMetricFamily("spikehound_agent_service_map_errors", "Failures (bugs) while learning which "
                                  "process sends which service: counted, the spans taken all the same.",
                                  value=services.errors if services is not None else 0)
        yield CounterMetricFamily("spikehound_agent_service_map_refuted_claims", "Connections whose resource "
                                  "claimed a process.pid other than the one the socket table names: not believed.",
                                  value=services.refuted_claims if services is not None else 0)


def registry_for(metrics: AgentMetrics) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return registry
