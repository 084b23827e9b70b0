"""What the agent's receivers share: enrich the request, fit it to the collector's limit, queue it, count it.

The agent acknowledges a request once it is in the forward queue (memory or
disk); the collector's acknowledgement of the forwarded copy comes later.
When both memory and the disk spool are full the request is refused with
``QueueFull`` and the receivers push back (RESOURCE_EXHAUSTED / 429); when the
disk refuses the write, with ``QueueUnavailable`` (UNAVAILABLE / 503). Either
way the sender keeps the data and retries: nothing is dropped silently.

A request larger than the collector takes once enriched is cut to fit
(``spikehound.agent.request_split``); what cannot be cut is dropped, counted
and reported to the sender in ``partial_success``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from spikehound.agent.enrich import Enricher
from spikehound.agent.forward_queue import Sink
from spikehound.agent.request_split import ITEMS, DropLog, request_resource, request_sender, split_request
from spikehound.agent.services import ServiceMap, claimed_pid
from spikehound.agent.spool import Item, Signal, SpoolWriteError
from spikehound.export_outcome import Accepted, QueueFull
from spikehound.otlp import PayloadError, parse_metrics_request, parse_trace_request


class QueueUnavailable(Exception):
    """The request had to go to the disk spool and the disk refused the write."""


def export_response(signal: Signal, accepted: Accepted) -> Message:
    """The OTLP Export response for the sender, with ``partial_success`` when anything was rejected."""
    if signal is Signal.TRACES:
        traces = ExportTraceServiceResponse()
        if accepted.rejected:
            traces.partial_success.rejected_spans = accepted.rejected
            traces.partial_success.error_message = accepted.message
        return traces
    metrics = ExportMetricsServiceResponse()
    if accepted.rejected:
        metrics.partial_success.rejected_data_points = accepted.rejected
        metrics.partial_success.error_message = accepted.message
    return metrics


class Intake:
    """The receivers' one way into the forward queue: each request enriched, cut to fit, queued whole, counted."""

    def __init__(self, enricher: Enricher, queue: Sink, drop_log: DropLog | None = None,
                 services: ServiceMap | None = None) -> None:
        """``services`` learns which local process sends which service (for the profiler)."""
        self.enricher = enricher
        self.queue = queue
        self.drop_log = drop_log or DropLog()
        self.services = services
        self.received: Counter[tuple[Signal, str]] = Counter()  # (signal, protocol) -> items
        self.refused: Counter[Signal] = Counter()  # items pushed back because the queue was full
        self.unavailable: Counter[Signal] = Counter()  # items refused because the spool could not be written
        self.invalid_requests: Counter[str] = Counter()  # protocol -> requests that could not be read
        self.split_requests: Counter[Signal] = Counter()  # requests cut to fit the collector's limit
        self.too_large: Counter[Signal] = Counter()  # items dropped: alone larger than the collector's limit
        self.forward_loops = 0  # requests refused: this agent's own forwarder sent them (see otlp_grpc)

    def accept(self, signal: Signal, payload: bytes, protocol: str, json: bool = False,
               peer: Hashable | None = None) -> Accepted:
        """Queue one export request (protobuf, or OTLP/JSON when ``json``) that came by connection ``peer``.

        Raises PayloadError (unreadable, or nothing in it small enough to forward), QueueFull (push back) or
        QueueUnavailable (retry later).
        """
        try:
            if json:  # the queue and the collector only ever see protobuf
                parse = parse_trace_request if signal is Signal.TRACES else parse_metrics_request
                payload = parse(payload, json=True).SerializeToString()
            enriched, count = (self.enricher.traces(payload) if signal is Signal.TRACES
                               else self.enricher.metrics(payload))
        except ValueError:
            self.invalid_requests[protocol] += 1
            raise
        self.received[signal, protocol] += count
        services = self.services
        if peer is not None and services is not None and not services.knows_peer(peer):
            try:  # a connection's first request only; learning a service never refuses spans
                services.note_peer(peer, request_sender(enriched), claimed_pid(request_resource(enriched)))
            except Exception as exc:
                services.failed("a connection's first request", exc)
        if not count:
            return Accepted()
        limit = self.queue.max_request_bytes
        split = None if len(enriched) <= limit else split_request(signal, enriched, limit, count)
        items = [Item(signal, enriched, count)] if split is None else [Item(signal, p, n) for p, n in split.pieces]
        try:
            queued = self.queue.put_all(items)
        except SpoolWriteError as exc:
            self.unavailable[signal] += count
            raise QueueUnavailable(str(exc)) from None
        if not queued:
            self.refused[signal] += count
            raise QueueFull("agent forward queue and disk spool are full; retry later")
        if split is None:
            return Accepted(kept=count)
        if items:
            self.split_requests[signal] += 1
        rejected = split.dropped_items
        if not rejected:
            return Accepted(kept=count)
        self.too_large[signal] += rejected
        self.drop_log.report(signal, split.dropped, limit, f"{protocol} receiver")
        message = (f"{rejected} {ITEMS[signal]} dropped: each alone is larger than the {limit} bytes the collector "
                   "accepts in one request")
        if not items:
            raise PayloadError(message)
        return Accepted(rejected, message, count - rejected)
